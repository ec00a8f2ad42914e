//! Replica mode's steps one at a time, on hand-built packets, for what the simulation's smoltcp
//! stacks do not show: SACK blocks, timestamps as PAWS sees them, the ACK clamp, forged or
//! stale progress, a promoted backup on a diverged connection. Named after the papers' steps.

use std::net::IpAddr;

use unbroken_engines::replica::{
    Backup, Config, ConnKey, Notice, Primary, ReadWatch, RelayFrom, ServerSocket, Why,
};
use unbroken_engines::Verdict;
use unbroken_wire::ip::{self, IpInfo};
use unbroken_wire::replica::{self as rw, hash_continue, ConnProgress, Progress, Role, HASH_INIT};
use unbroken_wire::tcp::{flags as F, Packet, Repr};
use unbroken_wire::Seq;

const P_ISN: u32 = 0xffff_f000; // the primary's ISN, near the wrap
const B_ISN: u32 = 1_000; // the backup's
const C_ISN: u32 = 77_777;
const P_TS0: u32 = 4_000_000_000;
const B_TS0: u32 = 12;

fn svc() -> IpAddr {
    "10.0.0.1".parse().unwrap()
}
fn cli() -> IpAddr {
    "10.0.9.2".parse().unwrap()
}
fn key() -> ConnKey {
    ConnKey { client: cli(), client_port: 40000, server_port: 6379 }
}

fn from_client(r: Repr, payload: &[u8]) -> Vec<u8> {
    ip::tcp_packet(cli(), svc(), &Repr { src_port: 40000, dst_port: 6379, ..r }, payload).unwrap()
}
fn from_server(r: Repr, payload: &[u8]) -> Vec<u8> {
    ip::tcp_packet(svc(), cli(), &Repr { src_port: 6379, dst_port: 40000, ..r }, payload).unwrap()
}

/// Parses a packet, asserting its checksum.
fn seg(pkt: &[u8]) -> (Repr, Vec<u8>) {
    let info = IpInfo::parse(pkt).unwrap();
    let t = Packet::new_checked(&pkt[info.l4_offset..info.l4_offset + info.l4_len]).unwrap();
    assert!(t.verify_checksum(info.pseudo_sum(info.l4_len)), "bad checksum");
    (Repr::parse(&t).unwrap(), t.payload().to_vec())
}

fn syn() -> Vec<u8> {
    from_client(Repr { seq: Seq(C_ISN), flags: F::SYN, window: 65535, mss: Some(1460), wscale: Some(7), sack_perm: true, timestamp: Some((500, 0)), ..Default::default() }, &[])
}

/// ST-TCP 3.3.0.1 (1)-(3): SYN, the backup's (withheld) SYN-ACK, the client's handshake ACK.
fn aligned_backup() -> Backup {
    let mut b = Backup::new();
    assert_eq!(b.incoming(&mut syn()), Verdict::PASS);
    let mut sa = from_server(Repr { seq: Seq(B_ISN), ack: Seq(C_ISN + 1), flags: F::SYN | F::ACK, window: 65535, mss: Some(1460), wscale: Some(7), sack_perm: true, timestamp: Some((B_TS0, 500)), ..Default::default() }, &[]);
    assert_eq!(b.outgoing(&mut sa), Verdict::Drop, "(2) the backup's SYN-ACK is suppressed");
    let mut ack = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1)), flags: F::ACK, window: 512, timestamp: Some((501, P_TS0)), ..Default::default() }, &[]);
    assert_eq!(b.incoming(&mut ack), Verdict::Accept { modified: true });
    let (r, _) = seg(&ack);
    assert_eq!(r.ack, Seq(B_ISN + 1), "(3) the handshake ACK names the backup's SYN-ACK");
    assert_eq!(r.timestamp, Some((501, B_TS0)), "TSecr in the backup's clock");
    assert_eq!(b.counters.aligned, 1);
    // The primary follows it too (its report names it): a take-over continues it.
    assert!(b.primary_report(&primary_names(rw::flag::RCV_KNOWN | rw::flag::ISN_KNOWN, Seq(0))).is_empty());
    b
}

/// The primary's report of the one connection, with these flags and verified output end.
fn primary_names(flags: u8, out_end: Seq) -> Progress {
    let rec = ConnProgress { client: cli(), client_port: 40000, server_port: 6379, rcv_nxt: Seq(C_ISN + 1), rcv_edge: Seq(C_ISN + 1000), out_end, out_hash: 0, last_ack: Seq(0), isn: Seq(P_ISN), flags };
    Progress { role: Role::Primary, beat: 1, flags: 0, records: vec![rec] }
}

/// The backup's server sends `n` bytes from its stream offset `off` (withheld or not).
fn backup_sends(b: &mut Backup, off: u32, data: &[u8], ts: u32) -> (Verdict, Vec<u8>) {
    let mut p = from_server(Repr { seq: Seq(B_ISN + 1 + off), ack: Seq(C_ISN + 1), flags: F::ACK | F::PSH, window: 500, timestamp: Some((ts, 501)), ..Default::default() }, data);
    let v = b.outgoing(&mut p);
    (v, p)
}

#[test]
fn st_tcp_3_3_0_1_backup_aligns_and_translates_sack_and_timestamps() {
    let mut b = aligned_backup();
    let (v, _) = backup_sends(&mut b, 0, &[1; 100], B_TS0 + 5);
    assert_eq!(v, Verdict::Drop, "withheld before take-over");
    // The client acknowledges 40 bytes and SACKs 60..100 of the primary's output.
    let p = |x: u32| Seq(P_ISN.wrapping_add(1 + x));
    let mut r = Repr { seq: Seq(C_ISN + 1), ack: p(40), flags: F::ACK, window: 512, timestamp: Some((502, P_TS0 + 5)), ..Default::default() };
    r.sack[0] = (p(60), p(100));
    r.sack_len = 1;
    let mut pkt = from_client(r, &[]);
    assert!(matches!(b.incoming(&mut pkt), Verdict::Accept { modified: true }));
    let (t, _) = seg(&pkt);
    assert_eq!(t.ack, Seq(B_ISN + 1 + 40));
    assert_eq!(t.sack[0], (Seq(B_ISN + 1 + 60), Seq(B_ISN + 1 + 100)), "SACK edges name the backup's space");
    assert_eq!(t.timestamp, Some((502, B_TS0 + 5)));
}

/// Linux discards a segment whose ACK covers data it never sent, payload included: the client's
/// ACK (and SACK edges) toward the backup are clamped to the backup server's SND.MAX.
#[test]
fn backup_clamps_acks_beyond_what_its_server_sent() {
    let mut b = aligned_backup();
    backup_sends(&mut b, 0, &[1; 10], B_TS0 + 1);
    // The primary reported output that far: the client may have acknowledged it.
    b.primary_report(&primary_names(rw::flag::RCV_KNOWN | rw::flag::ISN_KNOWN, Seq(P_ISN.wrapping_add(1 + 700))));
    let mut r = Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1 + 500)), flags: F::ACK, window: 512, ..Default::default() };
    r.sack[0] = (Seq(P_ISN.wrapping_add(600)), Seq(P_ISN.wrapping_add(700)));
    r.sack_len = 1;
    let mut pkt = from_client(r, b"GET");
    assert!(matches!(b.incoming(&mut pkt), Verdict::Accept { modified: true }));
    let (t, payload) = seg(&pkt);
    assert_eq!(t.ack, Seq(B_ISN + 1 + 10));
    assert_eq!(t.sack[0], (Seq(B_ISN + 11), Seq(B_ISN + 11)));
    assert_eq!(payload, b"GET");
    assert_eq!(b.counters.ack_clamped, 1);
}

/// Koch 5: after take-over the backup's output goes out in the primary's sequence space, its
/// TSval continuing the primary's clock (PAWS at the client).
#[test]
fn koch_5_takeover_continues_in_the_primarys_space() {
    let mut b = aligned_backup();
    assert_eq!(backup_sends(&mut b, 0, &[1; 10], B_TS0 + 3).0, Verdict::Drop);
    b.take_over();
    let (v, pkt) = backup_sends(&mut b, 10, &[2; 10], B_TS0 + 9);
    assert_eq!(v, Verdict::Accept { modified: true });
    let (t, _) = seg(&pkt);
    assert_eq!(t.seq, Seq(P_ISN.wrapping_add(11)));
    assert_eq!(t.timestamp, Some((P_TS0 + 9, 501)), "TSval in the primary's clock");
    assert_eq!(t.ack, Seq(C_ISN + 1), "the client's space is shared: unchanged");
}

/// A connection the primary reported diverged is never answered by a promoted backup.
#[test]
fn promoted_backup_silences_diverged_connections() {
    let mut b = aligned_backup();
    let rec = ConnProgress { client: cli(), client_port: 40000, server_port: 6379, rcv_nxt: Seq(0), rcv_edge: Seq(0), out_end: Seq(0), out_hash: 0, last_ack: Seq(0), isn: Seq(0), flags: rw::flag::DIVERGED };
    assert!(b.primary_report(&Progress { role: Role::Primary, beat: 1, flags: 0, records: vec![rec] }).is_empty());
    b.take_over();
    assert_eq!(backup_sends(&mut b, 0, &[1; 10], B_TS0).0, Verdict::Drop);
    assert_eq!(b.counters.diverged_silenced, 1);
}

/// ...and its client is told at the take-over: RSTs at its last ACK and at the furthest point the
/// primary verified (the client cannot be further), then a RST exactly at the ACK of any packet it still sends
/// (Linux answers an in-window RST with a challenge ACK, which lands here). Never a byte of the
/// backup's output, never a client left waiting for ever.
#[test]
fn promoted_backup_resets_the_clients_of_diverged_connections() {
    let mut b = aligned_backup();
    // The primary verified 5 bytes of output, then found the next ones different.
    let verified = Seq(P_ISN.wrapping_add(1 + 5));
    let rec = ConnProgress { client: cli(), client_port: 40000, server_port: 6379, rcv_nxt: Seq(C_ISN + 1), rcv_edge: Seq(C_ISN + 1 + 1000), out_end: verified, out_hash: 0, last_ack: Seq(P_ISN.wrapping_add(1)), flags: rw::flag::DIVERGED | rw::flag::RCV_KNOWN, isn: Seq(P_ISN) };
    let _ = b.primary_report(&Progress { role: Role::Primary, beat: 1, flags: 0, records: vec![rec] });
    assert!(b.take_transmit().is_empty(), "nothing before take-over: the primary still serves it");
    b.take_over();
    // At once, even if neither side sends again (an idle client): at the client's last ACK
    // and at the end the primary verified.
    let out = b.take_transmit();
    assert_eq!(out.len(), 2, "{out:?}");
    let seqs: Vec<Seq> = out.iter().map(|p| seg(p).0.seq).collect();
    assert_eq!(seqs, vec![Seq(P_ISN.wrapping_add(1)), verified]);
    for p in &out {
        let (r, payload) = seg(p);
        assert_eq!((r.flags & F::RST, r.src_port, r.dst_port), (F::RST, 6379, 40000));
        assert!(payload.is_empty());
    }
    assert_eq!(backup_sends(&mut b, 0, &[1; 10], B_TS0).0, Verdict::Drop);
    assert_eq!(backup_sends(&mut b, 10, &[2; 10], B_TS0).0, Verdict::Drop);
    assert!(b.take_transmit().is_empty(), "not one more per segment");
    // The client's challenge ACK (it had received 3 bytes only) is answered exactly.
    let at = Seq(P_ISN.wrapping_add(1 + 3));
    let mut ack = from_client(Repr { seq: Seq(C_ISN + 1), ack: at, flags: F::ACK, window: 512, ..Default::default() }, &[]);
    assert_eq!(b.incoming(&mut ack), Verdict::Drop, "nothing reaches the backup's server any more");
    let out = b.take_transmit();
    assert_eq!(out.len(), 1);
    let (r, _) = seg(&out[0]);
    assert_eq!((r.flags & F::RST, r.seq), (F::RST, at));
    assert_eq!(b.counters.diverged_reset, 3);
}

/// A client packet the backup cannot align yet (its server has not answered the SYN) is
/// dropped: the primary's ACK waits for the backup, so the client resends it.
#[test]
fn backup_drops_what_it_cannot_align_yet() {
    let mut b = Backup::new();
    b.incoming(&mut syn());
    let mut ack = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1)), flags: F::ACK, window: 512, ..Default::default() }, b"x");
    assert_eq!(b.incoming(&mut ack), Verdict::Drop);
    assert_eq!(b.counters.unaligned_dropped, 1);
    let mut bad = syn();
    let n = bad.len();
    bad[n - 1] ^= 1;
    assert_eq!(b.incoming(&mut bad), Verdict::Drop, "a bad checksum teaches nothing");
    assert_eq!(b.counters.bad_checksum, 1);
}

/// ST-TCP 3.6's LastAckReceived, relayed again: a client ACK clamped because the backup's server
/// had not sent those bytes yet is given to that server once it has sent them (the client has
/// everything from the primary and never sends that ACK again; without the relay the backup's
/// server waits for it, its output stays behind until the lag bound: found by the simulation at
/// `SIM_SCALE=20`, `PrimaryAppHang` 13259).
#[test]
fn st_tcp_3_6_clamped_client_ack_relayed_once_the_backup_sent_the_bytes() {
    let mut b = aligned_backup();
    backup_sends(&mut b, 0, &[1; 10], B_TS0 + 1);
    // The primary verified 30 bytes (the backup's server is behind it).
    b.primary_report(&primary_names(rw::flag::RCV_KNOWN | rw::flag::ISN_KNOWN, Seq(P_ISN.wrapping_add(31))));
    let mut ack = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1 + 30)), flags: F::ACK, window: 512, ..Default::default() }, &[]);
    b.incoming(&mut ack);
    assert_eq!(seg(&ack).0.ack, Seq(B_ISN + 11), "clamped to what the backup's server sent");
    let report = |beat| {
        let rec = ConnProgress { client: cli(), client_port: 40000, server_port: 6379, rcv_nxt: Seq(C_ISN + 1), rcv_edge: Seq(C_ISN + 1001), out_end: Seq(P_ISN.wrapping_add(31)), out_hash: 0, last_ack: Seq(P_ISN.wrapping_add(31)), isn: Seq(0), flags: 0 };
        Progress { role: Role::Primary, beat, flags: 0, records: vec![rec] }
    };
    assert!(b.primary_report(&report(1)).is_empty(), "nothing more to give yet");
    backup_sends(&mut b, 10, &[2; 10], B_TS0 + 2);
    let inj = b.primary_report(&report(2));
    assert_eq!(inj.len(), 1, "the clamped ACK, relayed now that the bytes exist");
    let (t, d) = seg(&inj[0]);
    assert_eq!((t.seq, t.ack, t.flags, d.len()), (Seq(C_ISN + 1), Seq(B_ISN + 21), F::ACK, 0));
    assert!(b.primary_report(&report(3)).is_empty(), "once");
    backup_sends(&mut b, 20, &[3; 10], B_TS0 + 3);
    let inj = b.primary_report(&report(4));
    assert_eq!(inj.len(), 1);
    assert_eq!(seg(&inj[0]).0.ack, Seq(B_ISN + 31));
    assert!(b.primary_report(&report(5)).is_empty(), "never beyond the client's ACK");
    assert_eq!(b.counters.acks_relayed, 2);
}

/// Without strict output commit a client segment whose ACK lies beyond what the backup's server
/// sent and the primary reported still reaches that server (its ACK clamped), and its kernel
/// takes the segment's TSval as the newest. A relayed ACK made later must not carry an older
/// TSval: PAWS discards it (`TcpExtPAWSEstab`), the backup's server never learns that its last
/// bytes arrived, stops in retransmission backoff with its FIN queued behind them, and the
/// primary's FIN waits for it until `max_delay_fin_ms` (the connection then ran unprotected:
/// `bench replica --quick`, relaxed bulk, 7 runs in 24 under load).
#[test]
fn relayed_ack_never_carries_an_older_tsval_than_a_clamped_segment_gave_the_server() {
    let mut b = aligned_backup();
    b.set_strict(false);
    backup_sends(&mut b, 0, &[1; 10], B_TS0 + 1);
    // The primary's report names 10 bytes of output; the client already acknowledges 30 (the
    // primary's server sent them since): beyond, clamped, passed, with the client's newest TSval.
    b.primary_report(&primary_names(rw::flag::RCV_KNOWN | rw::flag::ISN_KNOWN, Seq(P_ISN.wrapping_add(11))));
    let mut ack = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1 + 30)), flags: F::ACK, window: 512, timestamp: Some((900, P_TS0 + 3)), ..Default::default() }, &[]);
    assert!(matches!(b.incoming(&mut ack), Verdict::Accept { .. }), "relaxed: passed to the backup's server");
    assert_eq!(b.counters.ack_unverified, 1, "beyond the report");
    assert_eq!(seg(&ack).0.ack, Seq(B_ISN + 11), "clamped to what the backup's server sent");
    backup_sends(&mut b, 10, &[2; 20], B_TS0 + 2);
    let rec = ConnProgress { client: cli(), client_port: 40000, server_port: 6379, rcv_nxt: Seq(C_ISN + 1), rcv_edge: Seq(C_ISN + 1001), out_end: Seq(P_ISN.wrapping_add(31)), out_hash: 0, last_ack: Seq(P_ISN.wrapping_add(31)), isn: Seq(0), flags: rw::flag::RCV_KNOWN | rw::flag::ISN_KNOWN };
    let inj = b.primary_report(&Progress { role: Role::Primary, beat: 9, flags: 0, records: vec![rec] });
    assert_eq!(inj.len(), 1, "the clamped ACK, relayed now that the bytes exist");
    let (t, _) = seg(&inj[0]);
    assert_eq!(t.ack, Seq(B_ISN + 31));
    let (val, _) = t.timestamp.expect("timestamps on");
    assert!(val >= 900, "TSval {val}: older than the 900 the backup's kernel already took (PAWS drops it)");
    // Had that ACK been lost all the same (a failed injection), the backup's kernel resends
    // bytes it covered: relayed again at the next report, not waited for for ever.
    assert!(b.primary_report(&Progress { role: Role::Primary, beat: 10, flags: 0, records: vec![rec] }).is_empty(), "once");
    backup_sends(&mut b, 10, &[2; 20], B_TS0 + 3);
    assert_eq!(b.counters.acks_unheard, 1);
    let inj = b.primary_report(&Progress { role: Role::Primary, beat: 11, flags: 0, records: vec![rec] });
    assert_eq!(inj.len(), 1, "relayed again after the retransmission");
    assert_eq!(seg(&inj[0]).0.ack, Seq(B_ISN + 31));
    assert_eq!(b.counters.acks_relayed, 2);
}

/// The relay trusts only the primary's (authenticated) view of the client's ACK: a forgery
/// that acknowledges more than the client did (even one that guessed an acceptable sequence
/// number) is never turned into an injected ACK beyond what it gave by itself.
#[test]
fn forged_client_ack_is_never_relayed() {
    let mut b = aligned_backup();
    backup_sends(&mut b, 0, &[1; 10], B_TS0 + 1);
    let mut forged = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1 + 1000)), flags: F::ACK, window: 512, ..Default::default() }, &[]);
    b.incoming(&mut forged);
    backup_sends(&mut b, 10, &[2; 10], B_TS0 + 2);
    let rec = ConnProgress { client: cli(), client_port: 40000, server_port: 6379, rcv_nxt: Seq(C_ISN + 1), rcv_edge: Seq(C_ISN + 1001), out_end: Seq(P_ISN.wrapping_add(21)), out_hash: 0, last_ack: Seq(P_ISN.wrapping_add(1)), isn: Seq(0), flags: 0 };
    assert!(b.primary_report(&Progress { role: Role::Primary, beat: 1, flags: 0, records: vec![rec] }).is_empty(), "the client acknowledged nothing");
    assert_eq!(b.counters.acks_relayed, 0);
}

/// A blind forgery (the client's address, a valid checksum, a guessed sequence number outside
/// the window the backup's server announced) neither aligns a connection (Δ would be wrong for
/// good, and the backup's kernel would take the translated ACK as its handshake's) nor teaches
/// the engine anything; the genuine handshake ACK still aligns it.
#[test]
fn forged_out_of_window_ack_neither_aligns_nor_teaches() {
    let mut b = Backup::new();
    b.incoming(&mut syn());
    let mut sa = from_server(Repr { seq: Seq(B_ISN), ack: Seq(C_ISN + 1), flags: F::SYN | F::ACK, window: 65535, wscale: Some(7), ..Default::default() }, &[]);
    b.outgoing(&mut sa);
    let mut forged = from_client(Repr { seq: Seq(C_ISN + 1_000_000), ack: Seq(P_ISN.wrapping_add(6)), flags: F::ACK, window: 512, ..Default::default() }, &[]);
    assert_eq!(b.incoming(&mut forged), Verdict::Drop);
    assert_eq!((b.counters.aligned, b.counters.unacceptable), (0, 1));
    let mut ack = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1)), flags: F::ACK, window: 512, ..Default::default() }, &[]);
    b.incoming(&mut ack);
    assert_eq!(seg(&ack).0.ack, Seq(B_ISN + 1), "aligned on the genuine ACK");
    // Once aligned, an out-of-window packet goes to the kernel (which drops it) unlearned.
    backup_sends(&mut b, 0, &[1; 10], B_TS0 + 1);
    let mut forged = from_client(Repr { seq: Seq(C_ISN + 1_000_000), ack: Seq(P_ISN.wrapping_add(11)), flags: F::ACK | F::FIN, window: 512, ..Default::default() }, &[]);
    assert!(matches!(b.incoming(&mut forged), Verdict::Accept { .. }));
    let rec = &b.progress(1)[0].records[0];
    assert_eq!(rec.last_ack, Seq(P_ISN.wrapping_add(1)), "the forged ACK was not taken for the client's");
}

// --- the primary ---------------------------------------------------------------------------

fn progress(beat: u64, rcv_nxt: u32, out: &[u8], fin: bool) -> Progress {
    let rec = ConnProgress {
        client: cli(),
        client_port: 40000,
        server_port: 6379,
        rcv_nxt: Seq(rcv_nxt),
        rcv_edge: Seq(rcv_nxt + 1000),
        out_end: Seq(P_ISN.wrapping_add(1 + out.len() as u32)),
        out_hash: hash_continue(HASH_INIT, out),
        last_ack: Seq(0),
        isn: Seq(0),
        flags: rw::flag::RCV_KNOWN | rw::flag::ALIGNED | if fin { rw::flag::FIN_OUT } else { 0 },
    };
    Progress { role: Role::Backup, beat, flags: 0, records: vec![rec] }
}

/// Koch 7.1 and 3.2: SYN-ACK held until the backup saw the SYN; established.
fn primary(strict: bool) -> Primary {
    let mut p = Primary::new(Config { strict, max_delay_fin_ms: 1_000, ..Config::default() });
    assert_eq!(p.incoming(&syn()), Verdict::PASS);
    let mut sa = from_server(Repr { seq: Seq(P_ISN), ack: Seq(C_ISN + 1), flags: F::SYN | F::ACK, window: 65535, mss: Some(1460), wscale: Some(7), ..Default::default() }, &[]);
    assert_eq!(p.outgoing(&mut sa, 0), Verdict::Held, "the SYN-ACK waits for the backup");
    p.backup_progress(&progress(1, C_ISN + 1, &[], false), 1);
    assert_eq!(p.take_transmit(), vec![sa], "released as the primary built it");
    p
}

fn primary_sends(p: &mut Primary, off: u32, data: &[u8], ack: u32, flags: u8, now: u64) -> (Verdict, Vec<u8>) {
    let mut pkt = from_server(Repr { seq: Seq(P_ISN.wrapping_add(1 + off)), ack: Seq(ack), flags: F::ACK | flags, window: 100, ..Default::default() }, data);
    let v = p.outgoing(&mut pkt, now);
    (v, pkt)
}

/// Koch 3.2 and 3.4: the ACK the client sees is the backup's when it is lower; the window
/// keeps the primary's right edge when that is the lower one; a fresh ACK follows the backup.
#[test]
fn koch_3_2_min_ack_and_fresh_ack() {
    let mut p = primary(false);
    let (v, pkt) = primary_sends(&mut p, 0, b"hello", C_ISN + 1 + 300, 0, 2);
    assert_eq!(v, Verdict::Accept { modified: true });
    let (t, _) = seg(&pkt);
    assert_eq!(t.ack, Seq(C_ISN + 1), "min(primary, backup)");
    // Primary's edge: C+301 + 100 << 7; backup's: C+1+1000: the lower is the backup's.
    assert_eq!(t.window as u32, 1000 >> 7);
    assert_eq!(p.counters.acks_lowered, 1);
    p.backup_progress(&progress(2, C_ISN + 1 + 200, &[], false), 3);
    let out = p.take_transmit();
    assert_eq!(out.len(), 1, "Koch 3.4: a fresh ACK");
    let (t, payload) = seg(&out[0]);
    assert_eq!((t.ack, t.seq, payload.len()), (Seq(C_ISN + 201), Seq(P_ISN.wrapping_add(6)), 0));
    // A replayed (stale) progress message changes nothing.
    p.backup_progress(&progress(1, C_ISN + 1 + 300, &[], false), 4);
    assert!(p.take_transmit().is_empty());
    assert_eq!(p.counters.stale_progress, 1);
}

/// Koch's strict output commit: held until the backup produced the same bytes; a
/// retransmission of held bytes is dropped (a copy is kept).
#[test]
fn koch_3_2_strict_output_commit_holds_then_releases() {
    let mut p = primary(true);
    assert_eq!(primary_sends(&mut p, 0, b"hello ", C_ISN + 1, 0, 2).0, Verdict::Held);
    assert_eq!(primary_sends(&mut p, 6, b"world", C_ISN + 1, 0, 2).0, Verdict::Held);
    assert_eq!(primary_sends(&mut p, 0, b"hello ", C_ISN + 1, 0, 3).0, Verdict::Drop, "retransmission of held bytes");
    p.backup_progress(&progress(2, C_ISN + 1, b"hello wo", false), 4);
    let out = p.take_transmit();
    assert_eq!(out.len(), 2, "the verified segment, then the verified part of the next");
    assert_eq!(seg(&out[0]).1, b"hello ");
    let (t, payload) = seg(&out[1]);
    assert_eq!((t.seq, payload.as_slice()), (Seq(P_ISN.wrapping_add(7)), &b"wo"[..]), "only verified bytes, never the unverified 'rld'");
    assert_eq!(p.counters.partial_released, 1);
    // Nothing more is verified: the partial part is not sent again.
    p.tick(5);
    assert!(p.take_transmit().is_empty());
    p.backup_progress(&progress(3, C_ISN + 1, b"hello world", false), 5);
    let out = p.take_transmit();
    assert_eq!(out.len(), 1);
    assert_eq!(seg(&out[0]).1, b"world", "a wire-sized segment goes whole (a super-packet only its rest)");
    // Now released: a retransmission goes out at once.
    assert!(matches!(primary_sends(&mut p, 6, b"world", C_ISN + 1, 0, 6).0, Verdict::Accept { .. }));
}

/// The wire segments of `out`, in order: each at most `max` bytes of payload, its checksum
/// right, contiguous from `from`; their payloads joined.
fn wire_segments(out: &[Vec<u8>], from: Seq, max: usize) -> Vec<u8> {
    let mut at = from;
    let mut all = Vec::new();
    for pkt in out {
        let (t, payload) = seg(pkt);
        assert!(payload.len() <= max, "a segment of {} bytes, more than {max}", payload.len());
        assert_eq!(t.seq, at, "segments in order, no gap, no overlap");
        at = at + payload.len() as u32;
        all.extend(payload);
    }
    all
}

/// A GSO super-packet (the primary's queue takes them whole) is held, verified and released
/// like any segment, but what the engine sends itself goes out through a raw socket, which
/// cannot send it whole: released in wire segments of the handshake's MSS, the verified part
/// first, the rest once verified, and on unprotection.
#[test]
fn koch_3_2_super_packet_released_in_wire_segments() {
    let mut p = primary(true);
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
    assert_eq!(primary_sends(&mut p, 0, &data, C_ISN + 1, F::PSH, 2).0, Verdict::Held);
    p.backup_progress(&progress(2, C_ISN + 1, &data[..5_000], false), 3);
    let out = p.take_transmit();
    assert_eq!(wire_segments(&out, Seq(P_ISN.wrapping_add(1)), 1460), &data[..5_000], "only the verified part, in MSS-sized segments");
    assert_eq!(out.len(), 4);
    p.backup_progress(&progress(3, C_ISN + 1, &data, false), 4);
    let out = p.take_transmit();
    assert_eq!(wire_segments(&out, Seq(P_ISN.wrapping_add(5_001)), 1460), &data[5_000..]);
    assert!(seg(out.last().unwrap()).0.flags & F::PSH != 0, "PSH on the last segment only");
    assert!(out[..out.len() - 1].iter().all(|q| seg(q).0.flags & F::PSH == 0));
    // Unprotected (a divergence further on): the held super-packet goes out as its server built
    // it, cut, from where the partial release of its verified part stopped.
    assert_eq!(primary_sends(&mut p, 10_000, &data, C_ISN + 1, 0, 5).0, Verdict::Held);
    p.backup_progress(&progress(4, C_ISN + 1, &[&data[..], &data[..3_000]].concat(), false), 6);
    assert_eq!(wire_segments(&p.take_transmit(), Seq(P_ISN.wrapping_add(10_001)), 1460), &data[..3_000]);
    let mut wrong = data.clone();
    wrong[5_000] ^= 1;
    let mut all = data.clone();
    all.extend(&wrong);
    p.backup_progress(&progress(5, C_ISN + 1, &all, false), 7);
    assert_eq!(p.counters.diverged, 1);
    let out = p.take_transmit();
    assert_eq!(wire_segments(&out, Seq(P_ISN.wrapping_add(13_001)), 1460), &data[3_000..], "the rest only, never twice");
}

/// A forged SYN's tiny MSS cannot make a super-packet into thousands of segments: RFC 1122's
/// 536 bytes at the least.
#[test]
fn hostile_tiny_mss_cuts_super_packets_at_536() {
    let mut p = Primary::new(Config { strict: true, max_delay_fin_ms: 1_000, ..Config::default() });
    let tiny = from_client(Repr { seq: Seq(C_ISN), flags: F::SYN, window: 65535, mss: Some(1), ..Default::default() }, &[]);
    assert_eq!(p.incoming(&tiny), Verdict::PASS);
    let mut sa = from_server(Repr { seq: Seq(P_ISN), ack: Seq(C_ISN + 1), flags: F::SYN | F::ACK, window: 65535, mss: Some(1460), ..Default::default() }, &[]);
    assert_eq!(p.outgoing(&mut sa, 0), Verdict::Held);
    p.backup_progress(&progress(1, C_ISN + 1, &[], false), 1);
    assert_eq!(p.take_transmit().len(), 1);
    let data = vec![9u8; 5_000];
    assert_eq!(primary_sends(&mut p, 0, &data, C_ISN + 1, 0, 2).0, Verdict::Held);
    p.backup_progress(&progress(2, C_ISN + 1, &data, false), 3);
    let out = p.take_transmit();
    assert_eq!(wire_segments(&out, Seq(P_ISN.wrapping_add(1)), 536), data);
    assert_eq!(out.len(), 10);
}

/// Different bytes at the same offset: counted, the connection unprotected, the primary's own
/// bytes released (the client never got an unverified byte before).
#[test]
fn koch_strict_divergence_detected() {
    let mut p = primary(true);
    assert_eq!(primary_sends(&mut p, 0, b"value=1", C_ISN + 1, 0, 2).0, Verdict::Held);
    p.backup_progress(&progress(2, C_ISN + 1, b"value=2", false), 3);
    assert_eq!(p.counters.diverged, 1);
    assert_eq!(p.conn_state(&key()), Some(Why::Diverged));
    assert_eq!(p.take_notices(), vec![Notice::Unprotected { key: key(), why: Why::Diverged }]);
    let out = p.take_transmit();
    assert_eq!(seg(&out[0]).1, b"value=1");
    let rep = p.report(1);
    assert_ne!(rep[0].records[0].flags & rw::flag::DIVERGED, 0, "reported to the backup");
}

/// Koch 3.4 on an unprotected connection (a fresh-clone CI failure of
/// `replica_strict_divergence_detected`): its ACK still waits for the backup (the backup's
/// server must miss no input the primary's took), so when the primary's server answered the
/// client's FIN with its own FIN and closed, the ACK of the client's FIN was lowered, and no
/// fresh ACK followed once the backup had it: the client resent its FIN to a closed socket and
/// got a RST. Now the fresh ACK follows the backup on unprotected connections too, after the
/// server's FIN, with its latest timestamp.
#[test]
fn koch_3_4_fresh_ack_after_the_close_of_an_unprotected_connection() {
    let mut p = primary(true);
    assert_eq!(primary_sends(&mut p, 0, b"value=1", C_ISN + 1, 0, 2).0, Verdict::Held);
    p.backup_progress(&progress(2, C_ISN + 1, b"value=2", false), 3);
    assert_eq!(p.conn_state(&key()), Some(Why::Diverged));
    p.take_transmit();
    // The client's FIN (after 4 request bytes); the primary's server answers with its FIN.
    let fin = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(8)), flags: F::ACK | F::FIN, window: 512, ..Default::default() }, b"QUIT");
    assert_eq!(p.incoming(&fin), Verdict::PASS);
    let mut sfin = from_server(Repr { seq: Seq(P_ISN.wrapping_add(8)), ack: Seq(C_ISN + 6), flags: F::ACK | F::FIN, window: 100, timestamp: Some((900, 77)), ..Default::default() }, &[]);
    assert!(matches!(p.outgoing(&mut sfin, 4), Verdict::Accept { .. }), "unprotected: its output passes");
    assert_eq!(seg(&sfin).0.ack, Seq(C_ISN + 1), "its ACK waits for the backup");
    p.backup_progress(&progress(3, C_ISN + 6, b"value=2", true), 5);
    let out = p.take_transmit();
    assert_eq!(out.len(), 1, "Koch 3.4: a fresh ACK");
    let (t, payload) = seg(&out[0]);
    assert_eq!((t.ack, t.seq, payload.len()), (Seq(C_ISN + 6), Seq(P_ISN.wrapping_add(9)), 0), "past the server's FIN");
    assert_eq!(t.timestamp.map(|x| x.0), Some(900), "its timestamp is the server's latest");
}

/// ST-TCP 3.7.4: the primary's FIN waits for the backup's at the same offset; its data goes
/// out on its own once verified.
#[test]
fn st_tcp_3_7_4_fin_waits_for_the_backups() {
    let mut p = primary(true);
    assert_eq!(primary_sends(&mut p, 0, b"bye", C_ISN + 1, F::FIN, 2).0, Verdict::Held);
    p.backup_progress(&progress(2, C_ISN + 1, b"bye", false), 3);
    let out = p.take_transmit();
    assert_eq!(out.len(), 1);
    let (t, d) = seg(&out[0]);
    assert_eq!((d.as_slice(), t.flags & F::FIN), (&b"bye"[..], 0), "the data without the FIN");
    p.backup_progress(&progress(3, C_ISN + 1, b"bye", true), 4);
    let out = p.take_transmit();
    assert_eq!(out.len(), 1);
    let (t, d) = seg(&out[0]);
    assert_eq!((t.seq, d.len(), t.flags & F::FIN), (Seq(P_ISN.wrapping_add(4)), 0, F::FIN));
}

/// ST-TCP Table 3.3 row 3, backup, without strict output commit: the client had every reply
/// from the primary and closed; the backup's server, behind, read the client's EOF with replies
/// still unwritten and closed with less output (Redis drops them). It had all the input the
/// primary's server acknowledged, so its state is the primary's: that connection alone runs
/// unprotected, the backup is not stale. With input missing it is (row 3 as before).
#[test]
fn table_3_3_row3_backup_closed_early_after_the_clients_close_is_that_connections_only() {
    for missed_input in [false, true] {
        let mut p = primary(false);
        assert!(matches!(primary_sends(&mut p, 0, b"abcdef", C_ISN + 1, 0, 2).0, Verdict::Accept { .. }));
        // The client acknowledges all of it and closes; the primary's server acknowledges the FIN.
        let fin = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(7)), flags: F::ACK | F::FIN, window: 1000, ..Default::default() }, &[]);
        assert_eq!(p.incoming(&fin), Verdict::PASS);
        assert!(matches!(primary_sends(&mut p, 6, b"", C_ISN + 2, 0, 3).0, Verdict::Accept { .. }));
        // The backup's server closed after three bytes of output.
        let rcv = if missed_input { C_ISN + 1 } else { C_ISN + 2 };
        p.backup_progress(&progress(2, rcv, b"abc", true), 4);
        let want = if missed_input { Why::BackupFinAlone } else { Why::BackupClosedEarly };
        let notices = p.take_notices();
        assert!(notices.contains(&Notice::Unprotected { key: key(), why: want }), "missed input {missed_input}: {notices:?}");
        assert_eq!(p.backup_stale().is_some(), missed_input, "stale only when its server missed input");
    }
}

/// ST-TCP Table 3.3 row 3, primary: a FIN where the backup has more output, while the server's
/// listening socket is gone (it crashed): the host is sick, yield. The FIN never goes out.
#[test]
fn table_3_3_row3_primary_fin_alone_with_its_listener_gone_yields() {
    let mut p = primary(true);
    p.server_listening(true);
    primary_sends(&mut p, 0, b"ab", C_ISN + 1, F::FIN, 2);
    p.server_listening(false);
    assert_eq!(p.take_notices(), vec![Notice::YieldToBackup { key: None }], "a listener gone is a sick host at once");
    p.backup_progress(&progress(2, C_ISN + 1, b"abcdef", false), 3);
    assert!(p.take_notices().is_empty(), "one yield");
    assert!(p.take_transmit().iter().all(|pkt| seg(pkt).0.flags & F::FIN == 0), "the FIN never went out");
    assert_eq!(p.conn_state(&key()), None, "the connection stays protected: the backup continues it");
}

/// Issue 20 item 9: one connection's close race (an idle timeout meeting a request: the
/// primary's server closed, the backup's answered) while the server still listens is that
/// connection's failure, not the host's: it runs unprotected and the client gets what the
/// primary's server did (its bytes, then its FIN); no yield, so no client can force a failover.
#[test]
fn hostile_one_connections_close_race_does_not_move_the_host() {
    let mut p = primary(true);
    p.server_listening(true);
    primary_sends(&mut p, 0, b"ab", C_ISN + 1, F::FIN, 2);
    p.backup_progress(&progress(2, C_ISN + 1, b"abcdef", false), 3);
    assert!(p.take_notices().is_empty(), "a grace for the daemon's listener check");
    p.tick(3 + unbroken_engines::replica::PRIMARY_FAIL_GRACE_MS);
    assert_eq!(p.take_notices(), vec![Notice::Unprotected { key: key(), why: Why::PrimaryFailed }]);
    assert_eq!(p.counters.primary_failed, 1);
    let out = p.take_transmit();
    assert!(out.iter().any(|pkt| seg(pkt).1 == b"ab"), "its verified bytes");
    assert!(out.iter().any(|pkt| seg(pkt).0.flags & F::FIN != 0), "then the primary's FIN, as an unreplicated server");
    assert_eq!(p.backup_stale(), None, "the backup still follows every other connection");
}

/// The reverse of the backup's early close: the client closed, the primary's server read its
/// EOF with replies unwritten and closed with less output than the backup's. A close race, not
/// the primary's failure: that connection alone leaves protection (`PrimaryClosedEarly`,
/// nothing counted as `primary_failed`), the client gets the primary's bytes and its FIN. Only
/// with the evidence that its kernel had the client's FIN when its server closed (its FIN
/// acknowledges it): a client's FIN after the server's leaves it the primary's failure (as does
/// a forged in-window FIN seen first, its sequence number never acknowledged: the label errs
/// toward failure). With the listening socket gone the host is sick and yields, as before.
#[test]
fn table_3_3_row3_primary_closed_early_after_the_clients_close_is_no_failure() {
    for (listener_gone, client_first) in [(false, true), (false, false), (true, true)] {
        let mut p = primary(false);
        p.server_listening(true);
        assert!(matches!(primary_sends(&mut p, 0, b"ab", C_ISN + 1, 0, 2).0, Verdict::Accept { .. }));
        let fin = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(3)), flags: F::ACK | F::FIN, window: 1000, ..Default::default() }, &[]);
        if client_first {
            assert_eq!(p.incoming(&fin), Verdict::PASS);
            primary_sends(&mut p, 2, b"", C_ISN + 2, F::FIN, 3);
        } else {
            primary_sends(&mut p, 2, b"", C_ISN + 1, F::FIN, 3);
            assert_eq!(p.incoming(&fin), Verdict::PASS);
        }
        p.backup_progress(&progress(2, C_ISN + 2, b"abcdef", false), 4);
        if listener_gone {
            p.server_listening(false);
            assert_eq!(p.take_notices(), vec![Notice::YieldToBackup { key: None }], "a listener gone is a sick host");
            continue;
        }
        assert!(p.take_notices().is_empty(), "a grace for the daemon's listener check");
        p.tick(4 + unbroken_engines::replica::PRIMARY_FAIL_GRACE_MS);
        let why = if client_first { Why::PrimaryClosedEarly } else { Why::PrimaryFailed };
        assert_eq!(p.take_notices(), vec![Notice::Unprotected { key: key(), why }], "client first {client_first}");
        assert_eq!(p.counters.primary_failed, u64::from(!client_first), "a close race is no failure");
        assert!(p.take_transmit().iter().any(|pkt| seg(pkt).0.flags & F::FIN != 0), "the primary's FIN goes out");
        assert_eq!(p.backup_stale(), None);
    }
}

/// ST-TCP 3.7.4: a RST of the primary's server never reaches the client while protected; alone
/// for MaxDelayFIN it is that connection's failure (unprotected), a yield only with a sick host.
#[test]
fn st_tcp_3_7_4_primary_rst_held_then_the_connections_failure() {
    let mut p = primary(true);
    assert_eq!(primary_sends(&mut p, 0, &[], C_ISN + 1, F::RST, 10).0, Verdict::Drop);
    p.tick(500);
    assert!(p.take_notices().is_empty());
    p.tick(1_010);
    assert_eq!(p.take_notices(), vec![Notice::Unprotected { key: key(), why: Why::PrimaryFailed }]);
    let mut q = primary(true);
    q.server_listening(true);
    assert_eq!(primary_sends(&mut q, 0, &[], C_ISN + 1, F::RST, 10).0, Verdict::Drop);
    q.server_listening(false);
    assert_eq!(q.take_notices(), vec![Notice::YieldToBackup { key: None }]);
}

/// Table 3.3 row 2, primary: the primary's server stalls on a connection (the backup's answered)
/// while producing nothing anywhere for the lag bound: a hung server, yield. If it produced output
/// on another connection meanwhile, the stall is that connection's only.
#[test]
fn table_3_3_row2_primary_stall_yields_only_when_the_whole_server_stalls() {
    let mut p = primary(true);
    p.backup_progress(&progress(2, C_ISN + 1, b"abc", false), 3);
    p.tick(100);
    p.tick(5_200);
    assert_eq!(p.take_notices(), vec![Notice::YieldToBackup { key: Some(key()) }]);
    let mut q = primary(true);
    q.backup_progress(&progress(2, C_ISN + 1, b"abc", false), 3);
    q.tick(100);
    // Output on another connection at 4 s: the server is alive.
    let other = ConnKey { client_port: 40001, ..key() };
    let syn2 = ip::tcp_packet(cli(), svc(), &Repr { src_port: 40001, dst_port: 6379, seq: Seq(5), flags: F::SYN, window: 100, ..Default::default() }, &[]).unwrap();
    q.incoming(&syn2);
    let mut sa2 = ip::tcp_packet(svc(), cli(), &Repr { src_port: 6379, dst_port: 40001, seq: Seq(9), ack: Seq(6), flags: F::SYN | F::ACK, window: 100, ..Default::default() }, &[]).unwrap();
    q.outgoing(&mut sa2, 3_000);
    let mut d2 = ip::tcp_packet(svc(), cli(), &Repr { src_port: 6379, dst_port: 40001, seq: Seq(10), ack: Seq(6), flags: F::ACK, window: 100, ..Default::default() }, b"zz").unwrap();
    q.outgoing(&mut d2, 4_000);
    assert!(q.follows(&other));
    q.tick(5_200);
    assert_eq!(q.take_notices(), vec![Notice::Unprotected { key: key(), why: Why::PrimaryFailed }]);
}

/// Table 3.3 row 2 without AppMaxLagTime: the primary's server reads none of its input
/// ([`ReadWatch`]) while the backup's answered beyond it: after `max_hang_ms` of both, the
/// primary yields (issue 20: a stopped server stalled its clients for the 5 s lag bound).
#[test]
fn table_3_3_row2_hung_primary_yields_after_the_hang_bound() {
    let mut p = primary(true);
    p.backup_progress(&progress(2, C_ISN + 1, b"abc", false), 3);
    p.server_reading(Some(20), &[key()].into());
    p.tick(100);
    assert!(p.take_notices().is_empty(), "hung for 80 ms only");
    p.tick(160);
    assert!(
        p.take_notices().is_empty(),
        "the backup ahead for 157 ms, hung 140 ms"
    );
    p.tick(175);
    assert_eq!(
        p.take_notices(),
        vec![Notice::YieldToBackup { key: Some(key()) }]
    );
    assert_eq!(p.counters.hung_yields, 1);
}

/// A stalled primary server whose backup is not ahead is no failure (nothing to compare:
/// idle, or waiting as much as the backup); nor is a stall the backup shares (a long command
/// of a deterministic server); nor a stall the backup's server was ahead of for less than the
/// bound (it finished the same long command a few ms sooner).
#[test]
fn hung_on_both_sides_or_not_ahead_is_no_failure() {
    let mut p = primary(true);
    p.server_reading(Some(10), &[key()].into());
    p.tick(1_000);
    assert!(
        p.take_notices().is_empty(),
        "stalled but the backup is not ahead"
    );
    // Both hung (the backup says so), the backup ahead with an earlier answer.
    p.backup_hung(true);
    p.backup_progress(&progress(2, C_ISN + 1, b"abc", false), 1_000);
    p.tick(1_100);
    p.tick(1_400);
    p.backup_hung(true);
    assert!(p.take_notices().is_empty(), "both servers hung");
    // The backup's server finished first: it went on from 1 400 ms, the primary still stalled.
    p.backup_hung(false);
    p.backup_progress(&progress(3, C_ISN + 1, b"abcdef", false), 1_400);
    p.tick(1_500);
    assert!(p.take_notices().is_empty(), "gone on for 100 ms only");
    // The primary's server reads and answers: nothing more.
    p.server_reading(None, &[key()].into());
    primary_sends(&mut p, 0, b"abcdef", C_ISN + 1, 0, 1_520);
    assert_eq!(p.take_transmit().len(), 1, "verified, released");
    p.tick(2_000);
    assert!(p.take_notices().is_empty());
    // The hang rule off: only the lag bound.
    let mut q = Primary::new(Config {
        max_hang_ms: 0,
        ..Config::default()
    });
    q.server_reading(Some(0), &[key()].into());
    q.tick(10_000);
    assert!(q.take_notices().is_empty());
}

/// Table 3.3 row 2, backup, without AppMaxLagTime: the backup says its server is hung while
/// the primary holds output for it: after `max_hang_ms` the backup is stale, everything held
/// goes out, and the client waits no longer.
#[test]
fn table_3_3_row2_hung_backup_is_stale_after_the_hang_bound() {
    let mut p = primary(true);
    assert_eq!(
        primary_sends(&mut p, 0, b"abc", C_ISN + 1, 0, 10).0,
        Verdict::Held
    );
    p.backup_progress(&progress(2, C_ISN + 1, &[], false), 11);
    p.backup_hung(true);
    p.tick(100);
    assert!(
        p.take_transmit().is_empty(),
        "held: the backup lags for 90 ms only"
    );
    // This host's server hung too: a shared stall, nothing happens.
    p.server_reading(Some(0), &[key()].into());
    p.tick(200);
    assert!(
        p.take_transmit().is_empty() && p.backup_stale().is_none(),
        "both hung"
    );
    p.server_reading(None, &[key()].into());
    p.tick(210);
    assert!(p.backup_stale().is_none(), "this host's server was stalled (last seen at 100 ms) less than the bound ago: the one that finishes first does not condemn the other");
    p.tick(250);
    assert_eq!(p.backup_stale(), Some(Why::BackupHung));
    assert_eq!(p.take_transmit().len(), 1, "the held output goes out");
    assert!(p.take_notices().contains(&Notice::BackupStale {
        why: Why::BackupHung
    }));
}

/// The read watch: a stall is input waiting while nothing anywhere is consumed; a server with
/// nothing to read, or that read anything, is not stalled; nonsense counts are ignored.
#[test]
fn read_watch_sees_a_server_that_reads_nothing() {
    let s = |id, unread, received| ServerSocket {
        id,
        key: key(),
        unread,
        received,
        send_queued: 0,
        send_buf: 0,
    };
    let mut w = ReadWatch::default();
    assert_eq!(
        w.sample(0, &[s(1, 0, 100), s(2, 0, 50)], None),
        None,
        "nothing to read"
    );
    assert_eq!(
        w.sample(20, &[s(1, 30, 130), s(2, 0, 50)], None),
        Some(20),
        "input waits, nothing read"
    );
    assert_eq!(
        w.sample(40, &[s(1, 60, 160), s(2, 10, 60)], None),
        Some(20),
        "still nothing read"
    );
    assert_eq!(
        w.sample(60, &[s(1, 60, 160), s(2, 0, 60)], None),
        None,
        "socket 2 read its 10 bytes"
    );
    assert_eq!(w.sample(80, &[s(1, 60, 160), s(2, 0, 60)], None), Some(80));
    // A new connection whose input was read already: the server reads.
    assert_eq!(w.sample(100, &[s(1, 60, 160), s(3, 0, 5)], None), None);
    assert_eq!(w.sample(120, &[s(1, 60, 160), s(3, 0, 5)], None), Some(120));
    // Socket 1 closed and gone: nothing waits.
    assert_eq!(w.sample(140, &[s(3, 0, 5)], None), None);
    // More unread than received (no tcp_info): ignored, never a stall.
    assert_eq!(w.sample(160, &[s(4, 10, 0)], None), None);
    assert_eq!(w.sample(180, &[s(4, 10, 0)], None), None);
    // Input waits while the server computes (its CPU time grows): busy, not stalled; once its
    // CPU time stands still, stalled.
    let mut w = ReadWatch::default();
    assert_eq!(w.sample(0, &[s(1, 30, 130)], Some(7)), Some(0));
    assert_eq!(w.sample(20, &[s(1, 30, 130)], Some(9)), None, "busy");
    assert_eq!(w.sample(40, &[s(1, 30, 130)], Some(11)), None, "busy");
    assert_eq!(
        w.sample(60, &[s(1, 30, 130)], Some(11)),
        Some(60),
        "stopped"
    );
    assert_eq!(w.sample(80, &[s(1, 30, 130)], Some(11)), Some(60));
    assert_eq!(
        w.sample(100, &[s(1, 30, 130)], None),
        Some(60),
        "unknown CPU: the sockets alone"
    );
    // Input waits on a socket whose send buffer is full (queued output above two thirds of
    // it): the server is blocked writing, waiting for the client, not stalled; once a third of
    // it was acknowledged and nothing filled it again, its unread input counts.
    let blocked = |id, unread, received, queued| ServerSocket { id, key: key(), unread, received, send_queued: queued, send_buf: 300_000 };
    let mut w = ReadWatch::default();
    assert_eq!(w.sample(0, &[blocked(1, 30, 130, 250_000)], Some(7)), None);
    assert_eq!(w.sample(20, &[blocked(1, 30, 130, 250_000)], Some(7)), None, "blocked on output");
    assert_eq!(w.sample(40, &[blocked(1, 30, 130, 200_000)], Some(7)), Some(40), "writable again, nothing written: its input counts");
    assert_eq!(w.sample(60, &[blocked(1, 30, 130, 10)], Some(7)), Some(40));
    // Beside it, another socket's input waiting unread is evidence as before.
    let other = ConnKey { client_port: 40001, ..key() };
    let s2 = ServerSocket { id: 2, key: other, unread: 10, received: 60, send_queued: 0, send_buf: 300_000 };
    let mut w = ReadWatch::default();
    assert_eq!(w.sample(0, &[blocked(1, 30, 130, 250_000), s2], Some(7)), Some(0));
    assert_eq!(w.sample(20, &[blocked(1, 30, 130, 250_000), s2], Some(7)), Some(0));
    assert_eq!(w.waiting().iter().copied().collect::<Vec<_>>(), vec![other], "only the socket that is not blocked");
}

/// Koch 6: the backup failed: everything held goes out, later output passes unchanged.
#[test]
fn koch_6_backup_failure_releases_everything() {
    let mut p = primary(true);
    assert_eq!(primary_sends(&mut p, 0, b"abc", C_ISN + 1 + 50, 0, 2).0, Verdict::Held);
    p.backup_failed();
    assert_eq!(p.take_transmit().len(), 1);
    assert_eq!(p.unprotected(), Some(Why::BackupFailed));
    let (v, pkt) = primary_sends(&mut p, 3, b"def", C_ISN + 1 + 50, 0, 3);
    assert_eq!(v, Verdict::PASS);
    assert_eq!(seg(&pkt).0.ack, Seq(C_ISN + 51), "the primary's own ACK");
}

/// A port reused after both sides closed is a new connection on both engines; a SYN on a live
/// connection (a retransmission or a forgery) changes nothing.
#[test]
fn port_reuse_after_close_is_a_new_connection() {
    let mut b = aligned_backup();
    assert_eq!(b.incoming(&mut syn()), Verdict::PASS);
    b.take_over();
    let (_, pkt) = backup_sends(&mut b, 0, b"x", B_TS0);
    assert_eq!(seg(&pkt).0.seq, Seq(P_ISN.wrapping_add(1)), "a SYN on a live connection kept the alignment");
    // Both sides close.
    let mut fin = from_server(Repr { seq: Seq(B_ISN + 2), ack: Seq(C_ISN + 1), flags: F::ACK | F::FIN, window: 500, ..Default::default() }, &[]);
    b.outgoing(&mut fin);
    let mut cfin = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(3)), flags: F::ACK | F::FIN, window: 512, ..Default::default() }, &[]);
    b.incoming(&mut cfin);
    // The old SYN retransmitted changes nothing; a new connection on the same port (a new
    // ISN) is aligned afresh on its new SYN-ACK (ISN 5000).
    b.incoming(&mut syn());
    assert_eq!(b.counters.aligned, 1);
    const C2: u32 = C_ISN + 1_000_000;
    b.incoming(&mut from_client(Repr { seq: Seq(C2), flags: F::SYN, window: 65535, ..Default::default() }, &[]));
    let mut sa = from_server(Repr { seq: Seq(5_000), ack: Seq(C2 + 1), flags: F::SYN | F::ACK, window: 65535, ..Default::default() }, &[]);
    b.outgoing(&mut sa);
    let mut ack = from_client(Repr { seq: Seq(C2 + 1), ack: Seq(9_001), flags: F::ACK, window: 512, ..Default::default() }, &[]);
    b.incoming(&mut ack);
    assert_eq!(seg(&ack).0.ack, Seq(5_001));
    assert_eq!(b.counters.aligned, 2);

    let mut p = primary(true);
    assert_eq!(p.incoming(&syn()), Verdict::PASS);
    assert_eq!(primary_sends(&mut p, 0, b"ab", C_ISN + 1, 0, 2).0, Verdict::Held, "still protected after a SYN on a live connection");
}

/// Every SYN may be forged: the tables are bounded. A table full of established connections
/// follows no new one (counted; it runs unprotected), unless a finished one can be forgotten for
/// it; forged SYNs never displace an established connection.
#[test]
fn tables_are_bounded_forged_syns_do_not_grow_them() {
    let mut b = Backup::with_capacity(2);
    let mut p = Primary::new(Config { max_conns: 2, ..Config::default() });
    let mut beat = 0;
    open(&mut b, &mut p, 1, &mut beat);
    open(&mut b, &mut p, 2, &mut beat);
    for port in 3..=5u16 {
        let mut s = ip::tcp_packet(cli(), svc(), &Repr { src_port: port, dst_port: 6379, seq: Seq(9), flags: F::SYN, window: 1000, ..Default::default() }, &[]).unwrap();
        assert_eq!(p.incoming(&s), Verdict::PASS);
        assert_eq!(b.incoming(&mut s), Verdict::PASS);
    }
    assert_eq!((b.connections(), b.counters.table_full, p.counters.table_full), (2, 3, 3));
    assert_eq!((b.counters.half_open_evicted, p.counters.half_open_evicted), (0, 0));
    // A connection of the full table that finished (its server reset it) makes room.
    let mut rst = ip::tcp_packet(svc(), cli(), &Repr { src_port: 6379, dst_port: 1, seq: Seq(B_ISN + 1), ack: Seq(C_ISN + 1), flags: F::RST | F::ACK, ..Default::default() }, &[]).unwrap();
    b.outgoing(&mut rst);
    let mut s = ip::tcp_packet(cli(), svc(), &Repr { src_port: 9, dst_port: 6379, seq: Seq(9), flags: F::SYN, window: 1000, ..Default::default() }, &[]).unwrap();
    b.incoming(&mut s);
    assert_eq!((b.connections(), b.counters.table_full), (2, 3));
    assert!(b.follows(&port_key(9)) && !b.follows(&port_key(1)) && b.follows(&port_key(2)));
}

fn port_key(port: u16) -> ConnKey {
    ConnKey { client_port: port, ..key() }
}

/// Opens a connection from client port `port` on both engines, through the handshake: the
/// client's SYN, both servers' SYN-ACKs (the backup's withheld, the primary's held until the
/// backup's progress shows its server answered), the client's handshake ACK (the backup aligns).
fn open(b: &mut Backup, p: &mut Primary, port: u16, beat: &mut u64) {
    let from_c = |r: Repr| ip::tcp_packet(cli(), svc(), &Repr { src_port: port, dst_port: 6379, ..r }, &[]).unwrap();
    let from_s = |r: Repr| ip::tcp_packet(svc(), cli(), &Repr { src_port: 6379, dst_port: port, ..r }, &[]).unwrap();
    let mut syn = from_c(Repr { seq: Seq(C_ISN), flags: F::SYN, window: 65535, mss: Some(1460), wscale: Some(7), ..Default::default() });
    assert_eq!(p.incoming(&syn), Verdict::PASS);
    assert_eq!(b.incoming(&mut syn), Verdict::PASS);
    let mut sa = from_s(Repr { seq: Seq(B_ISN), ack: Seq(C_ISN + 1), flags: F::SYN | F::ACK, window: 65535, wscale: Some(7), ..Default::default() });
    assert_eq!(b.outgoing(&mut sa), Verdict::Drop, "port {port}: the backup's SYN-ACK is withheld");
    let mut sa = from_s(Repr { seq: Seq(P_ISN), ack: Seq(C_ISN + 1), flags: F::SYN | F::ACK, window: 65535, mss: Some(1460), wscale: Some(7), ..Default::default() });
    assert_eq!(p.outgoing(&mut sa, 0), Verdict::Held, "port {port}: followed by the primary");
    for m in b.progress(*beat) {
        p.backup_progress(&m, 1);
    }
    *beat += 1;
    // (With the SYN-ACKs of other connections the backup's server answered too.)
    assert!(p.take_transmit().contains(&sa), "port {port}: the SYN-ACK released");
    let mut ack = from_c(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1)), flags: F::ACK, window: 512, ..Default::default() });
    assert_eq!(p.incoming(&ack), Verdict::PASS);
    assert!(matches!(b.incoming(&mut ack), Verdict::Accept { .. }));
    assert_eq!(seg(&ack).0.ack, Seq(B_ISN + 1), "port {port}: the backup aligned");
}

/// `n` forged SYNs from as many addresses, each answered by both servers (the kernels answer a
/// SYN with a SYN-ACK whoever sent it); numbered from `first`.
fn syn_flood(b: &mut Backup, p: &mut Primary, first: u32, n: u32) {
    for i in first..first + n {
        let a = IpAddr::from([10, 1, (i >> 8) as u8, i as u8]);
        let mut syn = ip::tcp_packet(a, svc(), &Repr { src_port: 1024 + (i % 60000) as u16, dst_port: 6379, seq: Seq(i.wrapping_mul(7919)), flags: F::SYN, window: 1000, ..Default::default() }, &[]).unwrap();
        assert_eq!(p.incoming(&syn), Verdict::PASS);
        assert_eq!(b.incoming(&mut syn), Verdict::PASS);
        let sa = Repr { src_port: 6379, dst_port: 1024 + (i % 60000) as u16, ack: Seq(i.wrapping_mul(7919).wrapping_add(1)), flags: F::SYN | F::ACK, window: 65535, ..Default::default() };
        let mut bsa = ip::tcp_packet(svc(), a, &Repr { seq: Seq(B_ISN), ..sa }, &[]).unwrap();
        assert_eq!(b.outgoing(&mut bsa), Verdict::Drop);
        let mut psa = ip::tcp_packet(svc(), a, &Repr { seq: Seq(P_ISN), ..sa }, &[]).unwrap();
        p.outgoing(&mut psa, 0);
    }
}

fn flood_key(i: u32) -> ConnKey {
    ConnKey { client: IpAddr::from([10, 1, (i >> 8) as u8, i as u8]), client_port: 1024 + (i % 60000) as u16, server_port: 6379 }
}

/// A SYN flood of ten times the table's size (forged SYNs whose handshakes never complete)
/// churns the half-open entries, oldest first, on both engines: an established connection is
/// never evicted, a real connection opened after the flood is followed and protected (the
/// primary holds its output for the backup), and a second flood does not evict it either. (The
/// tables used to fill with the flood's half-open entries: every later connection ran
/// unprotected, `table_full`, until the daemon forgot them.)
#[test]
fn syn_flood_evicts_half_open_entries_oldest_first() {
    const CAP: u32 = 64;
    let mut b = Backup::with_capacity(CAP as usize);
    let mut p = Primary::new(Config { strict: true, max_conns: CAP as usize, ..Config::default() });
    let mut beat = 1;
    open(&mut b, &mut p, 40000, &mut beat);
    syn_flood(&mut b, &mut p, 0, 10 * CAP);
    assert_eq!(b.connections(), CAP as usize);
    assert_eq!((b.counters.table_full, p.counters.table_full), (0, 0));
    let evicted = u64::from(10 * CAP - (CAP - 1));
    assert_eq!((b.counters.half_open_evicted, p.counters.half_open_evicted), (evicted, evicted));
    assert!(b.follows(&key()) && p.follows(&key()), "the established connection stays");
    // Oldest first: the youngest CAP - 1 forged entries are the ones left.
    for i in 0..10 * CAP {
        let young = i >= 10 * CAP - (CAP - 1);
        assert_eq!((b.follows(&flood_key(i)), p.follows(&flood_key(i))), (young, young), "forged SYN {i}");
    }

    open(&mut b, &mut p, 40001, &mut beat);
    syn_flood(&mut b, &mut p, 10 * CAP, 10 * CAP);
    assert_eq!((b.counters.table_full, p.counters.table_full), (0, 0));
    for port in [40000, 40001] {
        assert!(b.follows(&port_key(port)) && p.follows(&port_key(port)), "port {port} is still followed");
        assert_eq!(p.conn_state(&port_key(port)), None, "port {port} is protected");
    }
    let mut out = from_server(Repr { src_port: 6379, dst_port: 40001, seq: Seq(P_ISN.wrapping_add(1)), ack: Seq(C_ISN + 1), flags: F::ACK | F::PSH, window: 100, ..Default::default() }, b"+OK");
    // `from_server` names port 40000: build it for 40001.
    out = ip::tcp_packet(svc(), cli(), &Repr { dst_port: 40001, ..seg(&out).0 }, b"+OK").unwrap();
    assert_eq!(p.outgoing(&mut out, 5), Verdict::Held, "strict output commit waits for the backup");
    let mut bout = ip::tcp_packet(svc(), cli(), &Repr { src_port: 6379, dst_port: 40001, seq: Seq(B_ISN + 1), ack: Seq(C_ISN + 1), flags: F::ACK | F::PSH, window: 100, ..Default::default() }, b"+OK").unwrap();
    assert_eq!(b.outgoing(&mut bout), Verdict::Drop);
    for m in b.progress(beat) {
        p.backup_progress(&m, 6);
    }
    // (With the flood's SYN-ACKs the backup's server answered too.)
    let sent: Vec<_> = p.take_transmit().iter().map(|x| seg(x)).filter(|(r, _)| r.dst_port == 40001).collect();
    assert_eq!(sent.len(), 1, "released once the backup produced the same bytes");
    assert_eq!(sent[0].1, b"+OK");
}

/// Window scaling is in effect only if the server's SYN-ACK carries the option (RFC 7323 2.2),
/// so both engines learn it from the SYN-ACK, the answer to the SYN the server took: a forged
/// SYN without the option (the primary used to keep the first SYN's options, the backup the
/// latest's) no longer makes them read the scaled windows unscaled, and one with the option
/// does not make them scale windows of a connection without scaling.
#[test]
fn forged_syn_does_not_set_window_scaling() {
    let forged = |ws: Option<u8>| from_client(Repr { seq: Seq(C_ISN + 50_000), flags: F::SYN, window: 1000, wscale: ws, ..Default::default() }, &[]);
    let real = |ws: Option<u8>| from_client(Repr { seq: Seq(C_ISN), flags: F::SYN, window: 65535, wscale: ws, ..Default::default() }, &[]);
    for (real_ws, forged_ws, scaled_edge) in [(Some(7), None, 1000u32 << 7), (None, Some(7), 65535)] {
        let what = format!("real SYN {real_ws:?}, forged {forged_ws:?}");
        // The primary: the forged SYN first.
        let mut p = Primary::new(Config { strict: false, ..Config::default() });
        p.incoming(&forged(forged_ws));
        p.incoming(&real(real_ws));
        let mut sa = from_server(Repr { seq: Seq(P_ISN), ack: Seq(C_ISN + 1), flags: F::SYN | F::ACK, window: 65535, wscale: real_ws, ..Default::default() }, &[]);
        assert_eq!(p.outgoing(&mut sa, 0), Verdict::Held, "{what}");
        p.backup_progress(&progress(1, C_ISN + 1, &[], false), 1);
        let mut ack = from_server(Repr { seq: Seq(P_ISN.wrapping_add(1)), ack: Seq(C_ISN + 1), flags: F::ACK, window: 1000, ..Default::default() }, &[]);
        p.outgoing(&mut ack, 2);
        assert_eq!(p.report(1)[0].records[0].rcv_edge, Seq(C_ISN + 1 + scaled_edge), "primary, {what}");
        // The backup: the forged SYN after the real one.
        let mut b = Backup::new();
        b.incoming(&mut real(real_ws));
        b.incoming(&mut forged(forged_ws));
        let mut sa = from_server(Repr { seq: Seq(B_ISN), ack: Seq(C_ISN + 1), flags: F::SYN | F::ACK, window: 65535, wscale: real_ws, ..Default::default() }, &[]);
        b.outgoing(&mut sa);
        let mut hs = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1)), flags: F::ACK, window: 512, ..Default::default() }, &[]);
        b.incoming(&mut hs);
        let mut ack = from_server(Repr { seq: Seq(B_ISN + 1), ack: Seq(C_ISN + 1), flags: F::ACK, window: 1000, ..Default::default() }, &[]);
        b.outgoing(&mut ack);
        let rec = &b.progress(1)[0].records[0];
        assert_eq!(rec.flags & rw::flag::ALIGNED, rw::flag::ALIGNED, "{what}");
        assert_eq!(rec.rcv_edge, Seq(C_ISN + 1 + scaled_edge), "backup, {what}");
    }
}

/// The host-wide cap on held output (`Config::max_held_total`): the connection whose output
/// would pass it runs unprotected (`Why::HeldTotal`, counted), everything it held goes out as
/// its server built it (never a wrong byte), the other connections stay protected, and the
/// engine's count of held bytes follows every release and forget.
#[test]
fn host_wide_cap_on_held_output() {
    let mut b = Backup::new();
    let mut p = Primary::new(Config { strict: true, max_held_total: 3_000, ..Config::default() });
    let mut beat = 1;
    open(&mut b, &mut p, 40000, &mut beat);
    open(&mut b, &mut p, 40001, &mut beat);
    let send = |p: &mut Primary, port: u16, off: u32, byte: u8| {
        let mut pkt = ip::tcp_packet(svc(), cli(), &Repr { src_port: 6379, dst_port: port, seq: Seq(P_ISN.wrapping_add(1 + off)), ack: Seq(C_ISN + 1), flags: F::ACK | F::PSH, window: 100, ..Default::default() }, &[byte; 1000]).unwrap();
        let v = p.outgoing(&mut pkt, 10);
        (v, pkt)
    };
    let (v, a1) = send(&mut p, 40000, 0, 1);
    assert_eq!(v, Verdict::Held);
    let (v, b1) = send(&mut p, 40001, 0, 2);
    assert_eq!(v, Verdict::Held);
    assert_eq!(p.held_bytes(), a1.len() + b1.len());
    assert!(p.take_notices().is_empty());
    // 40000's next segment would pass 3,000 bytes held on the host.
    let (v, a2) = send(&mut p, 40000, 1000, 3);
    assert_eq!(v, Verdict::Held);
    assert_eq!(p.conn_state(&port_key(40000)), Some(Why::HeldTotal));
    assert_eq!(p.take_notices(), vec![Notice::Unprotected { key: port_key(40000), why: Why::HeldTotal }]);
    assert_eq!(p.counters.held_total_exceeded, 1);
    assert_eq!(p.take_transmit(), vec![a1, a2], "its output, in order, as its server built it");
    assert_eq!(p.held_bytes(), b1.len(), "what the other connection holds");
    assert_eq!(p.conn_state(&port_key(40001)), None, "the other connection stays protected");
    // From now on 40000's output passes at once (its ACK still waits for the backup, which
    // may take over the other connections: it must miss none of this one's input either).
    assert!(matches!(send(&mut p, 40000, 2000, 4).0, Verdict::Accept { .. }));
    // The other connection's output is released when the backup produced the same bytes.
    let mut bout = ip::tcp_packet(svc(), cli(), &Repr { src_port: 6379, dst_port: 40001, seq: Seq(B_ISN + 1), ack: Seq(C_ISN + 1), flags: F::ACK | F::PSH, window: 100, ..Default::default() }, &[2; 1000]).unwrap();
    b.outgoing(&mut bout);
    for m in b.progress(beat) {
        p.backup_progress(&m, 11);
    }
    assert_eq!(p.take_transmit().len(), 1);
    assert_eq!(p.held_bytes(), 0);
    let (v, _) = send(&mut p, 40001, 1000, 5);
    assert_eq!(v, Verdict::Held);
    assert!(p.held_bytes() > 0);
    p.forget(&port_key(40001));
    assert_eq!(p.held_bytes(), 0, "forgetting a connection forgets what it held");
}

/// ST-TCP's MaxDelayFIN counts from the client's ACK of every byte before the lone FIN: until
/// then the client may be waiting for that data (a lost segment the primary's server resends
/// after 1, 2, 4 s), so it has not sent the request that would show the backup's output going
/// past the FIN. A FIN let out on the old clock ended the client's stream early (found by the
/// simulation at `SIM_SCALE=20`, `PrimaryAppFin` 1806).
#[test]
fn st_tcp_max_delay_fin_counts_from_the_clients_ack_of_the_data_before_it() {
    let mut p = primary(true); // MaxDelayFIN 1 s
    assert_eq!(primary_sends(&mut p, 0, b"bye", C_ISN + 1, F::FIN, 2).0, Verdict::Held);
    p.backup_progress(&progress(2, C_ISN + 1, b"bye", false), 3);
    assert_eq!(p.take_transmit().len(), 1, "the data without the FIN");
    let no_fin = |p: &mut Primary| p.take_transmit().iter().all(|pkt| seg(pkt).0.flags & F::FIN == 0);
    p.tick(2_000);
    assert!(p.take_notices().is_empty() && no_fin(&mut p), "the client has not acknowledged the data: the FIN waits");
    let ack = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(4)), flags: F::ACK, window: 512, ..Default::default() }, &[]);
    assert_eq!(p.incoming(&ack), Verdict::PASS);
    p.tick(2_100);
    p.tick(3_050);
    assert!(p.take_notices().is_empty() && no_fin(&mut p), "MaxDelayFIN from the client's ACK");
    p.tick(3_101);
    assert_eq!(p.take_notices(), vec![Notice::Unprotected { key: key(), why: Why::FinTimeout }]);
    assert!(!no_fin(&mut p), "then the lone FIN goes out (ST-TCP's rule)");
}

/// The client's ACK as the primary reports it (relayed to the backup's server, and MaxDelayFIN's
/// clock) is learned only from a segment within the primary server's receive window: a blind
/// forgery with the client's address is ignored.
#[test]
fn primary_learns_the_clients_ack_only_from_acceptable_segments() {
    let mut p = primary(false);
    p.backup_progress(&progress(2, C_ISN + 1, &[], false), 2);
    assert!(matches!(primary_sends(&mut p, 0, b"hello", C_ISN + 1, 0, 3).0, Verdict::Accept { .. }));
    let last_ack = |p: &Primary| p.report(1)[0].records[0].last_ack;
    let forged = from_client(Repr { seq: Seq(C_ISN + 1_000_000), ack: Seq(P_ISN.wrapping_add(6)), flags: F::ACK, window: 512, ..Default::default() }, &[]);
    assert_eq!(p.incoming(&forged), Verdict::PASS);
    assert_eq!(last_ack(&p), Seq(P_ISN.wrapping_add(1)));
    let genuine = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(6)), flags: F::ACK, window: 512, ..Default::default() }, &[]);
    p.incoming(&genuine);
    assert_eq!(last_ack(&p), Seq(P_ISN.wrapping_add(6)));
}

/// A forged client FIN (outside the window) does not make a connection look finished: it is
/// not forgotten (with its held output) to make room in a full table.
#[test]
fn forged_client_fin_does_not_make_a_connection_forgettable() {
    let mut p = Primary::new(Config { strict: true, max_conns: 1, ..Config::default() });
    assert_eq!(p.incoming(&syn()), Verdict::PASS);
    let mut sa = from_server(Repr { seq: Seq(P_ISN), ack: Seq(C_ISN + 1), flags: F::SYN | F::ACK, window: 65535, mss: Some(1460), wscale: Some(7), ..Default::default() }, &[]);
    p.outgoing(&mut sa, 0);
    p.backup_progress(&progress(1, C_ISN + 1, &[], false), 1);
    assert_eq!(primary_sends(&mut p, 0, b"bye", C_ISN + 1, F::FIN, 2).0, Verdict::Held);
    let forged = from_client(Repr { seq: Seq(C_ISN + 1_000_000), ack: Seq(P_ISN.wrapping_add(5)), flags: F::ACK | F::FIN, window: 512, ..Default::default() }, &[]);
    p.incoming(&forged);
    let other = ip::tcp_packet(cli(), svc(), &Repr { src_port: 40001, dst_port: 6379, seq: Seq(9), flags: F::SYN, window: 1000, ..Default::default() }, &[]).unwrap();
    p.incoming(&other);
    assert_eq!(p.counters.table_full, 1, "the live connection was kept");
    assert!(p.held_bytes() > 0, "its held output too");
}

/// The primary's report carries its server's ISN (wire version 2). Once the backup has it, only
/// the client's ACK of the primary's SYN-ACK (ISN + 1) aligns: a forgery that guessed the
/// client's sequence number within the window must now also guess the primary's ISN.
#[test]
fn forged_handshake_ack_cannot_align_once_the_primary_reported_its_isn() {
    let mut b = Backup::new();
    b.incoming(&mut syn());
    let mut sa = from_server(Repr { seq: Seq(B_ISN), ack: Seq(C_ISN + 1), flags: F::SYN | F::ACK, window: 65535, wscale: Some(7), timestamp: Some((B_TS0, 500)), ..Default::default() }, &[]);
    b.outgoing(&mut sa);
    let p = primary(true);
    let report = p.report(1);
    let rec = report[0].records[0];
    assert_eq!((rec.isn, rec.flags & rw::flag::ISN_KNOWN), (Seq(P_ISN), rw::flag::ISN_KNOWN));
    assert!(b.primary_report(&report[0]).is_empty());
    let mut forged = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1 + 1000)), flags: F::ACK, window: 512, ..Default::default() }, &[]);
    assert_eq!(b.incoming(&mut forged), Verdict::Drop, "in the window, but not the ACK of the primary's SYN-ACK");
    assert_eq!((b.counters.aligned, b.counters.unacceptable), (0, 1));
    let mut ack = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1)), flags: F::ACK, window: 512, timestamp: Some((501, P_TS0)), ..Default::default() }, &[]);
    assert_eq!(b.incoming(&mut ack), Verdict::Accept { modified: true });
    assert_eq!(seg(&ack).0.ack, Seq(B_ISN + 1), "aligned on the genuine ACK");
    assert_eq!(b.counters.aligned, 1);
}

/// A forged in-window ACK that reached the backup before the primary's ISN did aligns it with a
/// wrong Δ (and its server takes the forgery as its handshake): the primary's ISN shows it, the
/// backup reports the connection MISALIGNED, the primary runs it unprotected, and a promoted
/// backup never answers on it. A genuine alignment is not disturbed by the report.
#[test]
fn forged_handshake_ack_before_the_primarys_isn_is_found_and_unprotected() {
    let p = primary(true);
    let mut genuine = aligned_backup();
    genuine.primary_report(&p.report(1)[0]);
    assert_eq!(genuine.counters.misaligned, 0);
    assert_eq!(genuine.progress(1)[0].records[0].flags & rw::flag::MISALIGNED, 0);

    let mut b = Backup::new();
    b.incoming(&mut syn());
    let mut sa = from_server(Repr { seq: Seq(B_ISN), ack: Seq(C_ISN + 1), flags: F::SYN | F::ACK, window: 65535, wscale: Some(7), ..Default::default() }, &[]);
    b.outgoing(&mut sa);
    let mut forged = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1 + 1000)), flags: F::ACK, window: 512, ..Default::default() }, &[]);
    assert!(matches!(b.incoming(&mut forged), Verdict::Accept { .. }), "no way to tell yet");
    assert_eq!(b.counters.aligned, 1);
    let mut p = p;
    b.primary_report(&p.report(1)[0]);
    assert_eq!(b.counters.misaligned, 1);
    let prog = b.progress(2);
    assert_eq!(prog[0].records[0].flags & rw::flag::MISALIGNED, rw::flag::MISALIGNED);
    p.backup_progress(&prog[0], 5);
    assert_eq!(p.conn_state(&key()), Some(Why::BackupMisaligned));
    // Its server took the forgery as its handshake: it no longer receives what the primary's
    // does on that connection, so its state is not the primary's (issue 20 item 5): stale.
    assert_eq!(p.take_notices(), vec![Notice::Unprotected { key: key(), why: Why::BackupMisaligned }, Notice::BackupStale { why: Why::BackupMisaligned }]);
    assert_eq!(p.backup_stale(), Some(Why::BackupMisaligned));
    assert_eq!(p.counters.backup_misaligned, 1);
    b.take_over();
    assert_eq!(backup_sends(&mut b, 0, b"+OK", B_TS0 + 1).0, Verdict::Drop, "never answered after take-over");
    assert_eq!(b.counters.diverged_silenced, 1);
}

/// Koch 5 with Linux's timers: what the backup's server sent last was withheld, and its TCP
/// would resend it only at its retransmission timeout; the client never got it from the dead
/// primary. The engine kept a copy of the withheld segments the client has not acknowledged and
/// sends them at take-over, translated; what the client acknowledged is not resent.
#[test]
fn koch_5_takeover_resends_the_withheld_output_the_client_lacks() {
    let mut b = aligned_backup();
    assert_eq!(backup_sends(&mut b, 0, &[7; 10], B_TS0 + 2).0, Verdict::Drop);
    // The client acknowledges those 10 bytes (it got them from the primary).
    let mut ack = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(11)), flags: F::ACK, window: 512, timestamp: Some((502, P_TS0 + 2)), ..Default::default() }, &[]);
    assert!(matches!(b.incoming(&mut ack), Verdict::Accept { .. }));
    // Then 20 more bytes, and the primary dies before the client has them.
    assert_eq!(backup_sends(&mut b, 10, &[8; 20], B_TS0 + 3).0, Verdict::Drop);
    assert!(b.take_transmit().is_empty(), "nothing before the take-over");
    b.take_over();
    let out = b.take_transmit();
    assert_eq!(out.len(), 1, "only the segment the client lacks");
    let (r, payload) = seg(&out[0]);
    assert_eq!(r.seq, Seq(P_ISN.wrapping_add(11)), "in the primary's space");
    assert_eq!(payload, vec![8; 20]);
    assert_eq!(r.timestamp.map(|t| t.0), Some(P_TS0 + 3), "TSval in the primary's clock");
    assert_eq!(b.counters.takeover_resent, 1);
    b.take_over();
    assert!(b.take_transmit().is_empty(), "a second take-over repeats nothing");

    let mut quiet = aligned_backup();
    quiet.take_over();
    assert!(quiet.take_transmit().is_empty(), "nothing outstanding: nothing sent");
}

/// Review finding: a connection the primary runs unprotected for any reason (not only a
/// divergence) is flagged in its report, so that a backup never continues it after a take-over
/// (its input there may have a hole the client will never fill).
#[test]
fn primary_reports_every_unprotected_connection_as_not_to_be_continued() {
    let mut p = primary(true);
    assert_eq!(primary_sends(&mut p, 0, b"abc", C_ISN + 1 + 50, 0, 2).0, Verdict::Held);
    let flags = |p: &Primary| p.report(1)[0].records[0].flags;
    assert_eq!(flags(&p) & rw::flag::DIVERGED, 0, "protected: not flagged");
    p.backup_failed();
    assert_ne!(flags(&p) & rw::flag::DIVERGED, 0, "unprotected (backup failed): flagged");
}

// --- issue 20: large replies, timestamps, hostile inputs ------------------------------------

/// Issue 20 item 1: a beat repeats the oldest checkpoints the primary has not verified, which
/// are older than one it already keeps (the backup's current end, far ahead). They must be kept
/// and used: taking only newer ones than the last kept left the held output waiting for the
/// lag bound.
#[test]
fn koch_3_2_older_checkpoints_repeated_by_a_beat_are_used() {
    let mut p = primary(true);
    assert_eq!(primary_sends(&mut p, 0, b"0123456789", C_ISN + 1, 0, 2).0, Verdict::Held);
    let cp = |beat: u64, out: &[u8]| progress(beat, C_ISN + 1, out, false);
    // The backup is ahead (its current end at 20 bytes, beyond what the primary has).
    p.backup_progress(&cp(2, b"0123456789abcdefghij"), 3);
    assert!(p.take_transmit().is_empty(), "nothing the primary has is verified yet");
    // A beat repeats an older checkpoint at 10 bytes: it verifies the primary's segment.
    p.backup_progress(&cp(3, b"0123456789"), 4);
    let out = p.take_transmit();
    assert_eq!(out.len(), 1);
    assert_eq!(seg(&out[0]).1, b"0123456789");
}

/// Issue 20 item 2: held output released after a younger segment went out (a retransmission
/// of released bytes with a fresh timestamp) carries the newest TSval: the client would discard
/// an older one (PAWS), thousands of times with large replies.
#[test]
fn paws_released_output_never_carries_an_older_timestamp() {
    let mut p = primary(true);
    let send_ts = |p: &mut Primary, off: u32, data: &[u8], ts: u32, now: u64| {
        let mut pkt = from_server(Repr { seq: Seq(P_ISN.wrapping_add(1 + off)), ack: Seq(C_ISN + 1), flags: F::ACK, window: 100, timestamp: Some((ts, 500)), ..Default::default() }, data);
        let v = p.outgoing(&mut pkt, now);
        (v, pkt)
    };
    assert_eq!(send_ts(&mut p, 0, b"aaaa", 1_000, 2).0, Verdict::Held);
    p.backup_progress(&progress(2, C_ISN + 1, b"aaaa", false), 3);
    assert_eq!(p.take_transmit().len(), 1);
    assert_eq!(send_ts(&mut p, 4, b"bbbb", 1_001, 4).0, Verdict::Held, "held at TSval 1001");
    // The client lost "aaaa": its server resends it 200 ms later with TSval 1200; it passes.
    let (v, _) = send_ts(&mut p, 0, b"aaaa", 1_200, 204);
    assert!(matches!(v, Verdict::Accept { .. }));
    p.backup_progress(&progress(3, C_ISN + 1, b"aaaabbbb", false), 205);
    let out = p.take_transmit();
    assert_eq!(out.len(), 1);
    let (t, d) = seg(&out[0]);
    assert_eq!((d.as_slice(), t.timestamp.map(|x| x.0)), (&b"bbbb"[..], Some(1_200)), "raised to the newest sent");
    assert!(p.counters.ts_raised >= 1);
}

/// Issue 20 item 4: a promoted backup's resent withheld output carries its server's clock now
/// (estimated from its newest TSval and the engine's clock), never the TSval of when it was
/// withheld, which the client would discard (PAWS).
#[test]
fn paws_takeover_resend_carries_a_current_timestamp() {
    let mut b = aligned_backup();
    b.tick(1_000);
    assert_eq!(backup_sends(&mut b, 0, &[1; 10], B_TS0 + 1).0, Verdict::Drop);
    // Three seconds later the primary dies; the backup's server sent nothing since.
    b.tick(4_000);
    b.take_over();
    let out = b.take_transmit();
    assert_eq!(out.len(), 1, "the withheld segment is resent");
    let (t, _) = seg(&out[0]);
    let tsval = t.timestamp.unwrap().0;
    assert!(tsval.wrapping_sub(P_TS0 + 1) >= 3_000 && tsval.wrapping_sub(P_TS0 + 1) < 3_100, "TSval {tsval}: the primary's clock 3 s later");
}

/// Issue 20 item 10: forged SYNs leave half-open entries that expire (they loaded both loops and
/// the side channel for good); a half-open entry the primary still names is kept on the backup.
#[test]
fn hostile_forged_syns_expire() {
    let mut p = Primary::new(Config::default());
    let forged = |port: u16| ip::tcp_packet(cli(), svc(), &Repr { src_port: port, dst_port: 6379, seq: Seq(9), flags: F::SYN, window: 100, ..Default::default() }, &[]).unwrap();
    p.tick(0);
    for port in 1000..1100 {
        p.incoming(&forged(port));
    }
    assert_eq!(p.connections(), 100);
    p.tick(unbroken_engines::replica::HALF_OPEN_TTL_MS - 1);
    assert_eq!(p.connections(), 100, "not before their time");
    p.tick(unbroken_engines::replica::HALF_OPEN_TTL_MS + 1);
    assert_eq!((p.connections(), p.counters.half_open_expired), (0, 100));

    let mut b = Backup::new();
    b.tick(0);
    for port in [2000u16, 2001] {
        let mut syn = forged(port);
        b.incoming(&mut syn);
        let mut sa = ip::tcp_packet(svc(), cli(), &Repr { src_port: 6379, dst_port: port, seq: Seq(B_ISN), ack: Seq(10), flags: F::SYN | F::ACK, window: 100, ..Default::default() }, &[]).unwrap();
        b.outgoing(&mut sa);
    }
    // The primary still names port 2001 (its handshake may be slow).
    let named = ConnProgress { client: cli(), client_port: 2001, server_port: 6379, rcv_nxt: Seq(10), rcv_edge: Seq(110), out_end: Seq(0), out_hash: 0, last_ack: Seq(0), isn: Seq(P_ISN), flags: rw::flag::RCV_KNOWN };
    b.tick(unbroken_engines::replica::HALF_OPEN_TTL_MS - 5);
    b.primary_report(&Progress { role: Role::Primary, beat: 7, flags: 0, records: vec![named] });
    b.tick(unbroken_engines::replica::HALF_OPEN_TTL_MS + 1);
    assert!(!b.follows(&port_key(2000)), "expired");
    assert!(b.follows(&port_key(2001)), "the primary names it");
    assert_eq!(b.counters.half_open_expired, 1);
}

/// Issue 20 item 10: a client RST exactly at the server's RCV.NXT ends the entry on both engines
/// (a reused 4-tuple must not inherit it); an in-window RST elsewhere (Linux answers it with a
/// challenge ACK, RFC 5961) does not.
#[test]
fn hostile_client_rst_ends_an_entry_only_when_exact() {
    let mut b = Backup::new();
    let mut p = Primary::new(Config::default());
    let mut beat = 1;
    open(&mut b, &mut p, 40000, &mut beat);
    let rst = |seq: u32| ip::tcp_packet(cli(), svc(), &Repr { src_port: 40000, dst_port: 6379, seq: Seq(seq), ack: Seq(P_ISN.wrapping_add(1)), flags: F::RST | F::ACK, window: 0, ..Default::default() }, &[]).unwrap();
    assert_eq!(p.incoming(&rst(C_ISN + 1 + 300)), Verdict::PASS);
    b.incoming(&mut rst(C_ISN + 1 + 300));
    assert!(p.finished().is_empty() && b.finished().is_empty(), "an in-window RST is not the end");
    p.incoming(&rst(C_ISN + 1));
    b.incoming(&mut rst(C_ISN + 1));
    assert_eq!(p.finished(), vec![port_key(40000)]);
    assert_eq!(b.finished(), vec![port_key(40000)]);
    assert_eq!((p.counters.client_resets, b.counters.client_resets), (1, 1));
}

/// Issue 20 item 12: a connection the primary's reports never named (it did not follow it:
/// started before it armed, its table full) is not continued at take-over without any output
/// check: its client is reset, and the backup's output on it never goes out.
#[test]
fn hostile_connection_the_primary_never_reported_is_reset_at_takeover() {
    let mut b = Backup::new();
    assert_eq!(b.incoming(&mut syn()), Verdict::PASS);
    let mut sa = from_server(Repr { seq: Seq(B_ISN), ack: Seq(C_ISN + 1), flags: F::SYN | F::ACK, window: 65535, wscale: Some(7), ..Default::default() }, &[]);
    b.outgoing(&mut sa);
    let mut ack = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1)), flags: F::ACK, window: 512, ..Default::default() }, &[]);
    assert!(matches!(b.incoming(&mut ack), Verdict::Accept { .. }));
    // Two of the primary's beats that do not name it.
    let other = ConnProgress { client: cli(), client_port: 1, server_port: 6379, rcv_nxt: Seq(0), rcv_edge: Seq(0), out_end: Seq(0), out_hash: 0, last_ack: Seq(0), isn: Seq(0), flags: 0 };
    for beat in [10, 11] {
        b.primary_report(&Progress { role: Role::Primary, beat, flags: 0, records: vec![other] });
    }
    b.take_over();
    let out = b.take_transmit();
    assert!(!out.is_empty() && out.iter().all(|p| seg(p).0.flags & F::RST != 0), "its client is told");
    assert_eq!(b.counters.unreported_reset, 1);
    assert_eq!(backup_sends(&mut b, 0, b"+OK", B_TS0 + 1).0, Verdict::Drop, "never answered");
}

/// Issue 20 item 14: a blind in-window segment whose ACK lies beyond everything the backup's
/// server sent (and beyond what the primary reported) is neither clamped into a full
/// acknowledgement of its output nor lets its bytes into the backup's server alone: Linux
/// discards such a segment, payload and all, on the primary, and so does the backup's engine
/// (a genuine one, ahead of the primary's report, comes again through the primary's relay).
#[test]
fn hostile_blind_ack_beyond_what_was_sent_is_not_a_full_acknowledgement() {
    let mut b = aligned_backup();
    backup_sends(&mut b, 0, &[1; 10], B_TS0 + 1);
    let mut forged = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1 + 5_000)), flags: F::ACK, window: 512, ..Default::default() }, b"SET x 1");
    assert_eq!(b.incoming(&mut forged), Verdict::Drop);
    assert_eq!(b.counters.ack_unverified, 1);
    // The genuine client's next segment is still taken.
    let mut real = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1 + 10)), flags: F::ACK, window: 512, ..Default::default() }, b"GET x");
    assert!(matches!(b.incoming(&mut real), Verdict::Accept { .. }));
    assert_eq!(seg(&real).0.ack, Seq(B_ISN + 11));
}

/// A yield the daemon refused (the backup not heard) is asked again at the next evidence,
/// never dropped for good: a dead server on a primary that keeps beating was an outage.
#[test]
fn refused_yield_is_asked_again() {
    let mut p = primary(true);
    p.server_listening(true);
    p.server_listening(false);
    assert_eq!(p.take_notices(), vec![Notice::YieldToBackup { key: None }]);
    p.server_listening(false);
    assert!(p.take_notices().is_empty(), "one request while it stands");
    p.yield_refused();
    p.server_listening(false);
    assert_eq!(p.take_notices(), vec![Notice::YieldToBackup { key: None }], "asked again");
}

// --- loss toward the primary: the client's ACK the backup heard -------------------------------

/// A primary established with a client (its handshake ACK heard at 1 ms).
fn primary_established() -> Primary {
    let mut p = primary(false);
    p.tick(1);
    let ack = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1)), flags: F::ACK, window: 512, timestamp: Some((501, P_TS0)), ..Default::default() }, &[]);
    assert_eq!(p.incoming(&ack), Verdict::PASS);
    p
}

/// The client's ACK the backup heard goes into the primary's own server, in the client's name,
/// once the primary has heard nothing of that client for `ACK_RELAY_AFTER_MS`, once, and never
/// beyond what that server sent.
#[test]
fn loss_toward_primary_the_backups_view_of_the_clients_ack_reaches_the_server() {
    let mut p = primary_established();
    primary_sends(&mut p, 0, &[7; 10], C_ISN + 1, 0, 5);
    let rep = |beat, last_ack: u32| {
        let rec = ConnProgress { last_ack: Seq(last_ack), ..progress(beat, C_ISN + 1, &[], false).records[0] };
        Progress { role: Role::Backup, beat, flags: 0, records: vec![rec] }
    };
    p.backup_progress(&rep(2, P_ISN.wrapping_add(11)), 10);
    assert!(p.take_inject().is_empty(), "the primary heard the client 9 ms ago");
    p.backup_progress(&rep(3, P_ISN.wrapping_add(500)), 30);
    assert!(p.take_inject().is_empty(), "beyond what its server sent: a forgery or nonsense");
    p.backup_progress(&rep(4, P_ISN.wrapping_add(11)), 31);
    let inj = p.take_inject();
    assert_eq!(inj.len(), 1);
    let (t, d) = seg(&inj[0]);
    assert_eq!((t.src_port, t.dst_port, t.seq, t.ack, t.flags, d.len()), (40000, 6379, Seq(C_ISN + 1), Seq(P_ISN.wrapping_add(11)), F::ACK, 0));
    assert_eq!(t.timestamp, Some((501, P_TS0)), "the client's latest timestamps this host heard (never older: PAWS)");
    p.backup_progress(&rep(5, P_ISN.wrapping_add(11)), 50);
    assert!(p.take_inject().is_empty(), "once");
    assert_eq!(p.counters.acks_from_backup, 1);
}

/// The same relay never goes into a server that sent its FIN: its host may have heard the
/// client's last ACKs (which the engine missed: the fast path passes a frozen connection's pure
/// ACKs unlearned) and closed the socket, and a closed socket answers a relayed copy with a RST
/// whatever it acknowledges, the FIN or data before it. Before the FIN it relays as ever.
#[test]
fn loss_toward_primary_no_relay_once_the_server_sent_its_fin() {
    let mut p = primary_established();
    primary_sends(&mut p, 0, &[7; 10], C_ISN + 1, 0, 5);
    primary_sends(&mut p, 10, &[], C_ISN + 1, F::FIN, 6);
    let rep = |beat, last_ack: u32| {
        let rec = ConnProgress { last_ack: Seq(last_ack), ..progress(beat, C_ISN + 1, &[7; 10], true).records[0] };
        Progress { role: Role::Backup, beat, flags: 0, records: vec![rec] }
    };
    // The backup's server closed at the same offset: the FIN goes out.
    p.backup_progress(&rep(2, P_ISN.wrapping_add(1)), 7);
    assert!(p.take_transmit().iter().any(|pkt| seg(pkt).0.flags & F::FIN != 0), "the FIN released");
    for (beat, last_ack) in [(3, P_ISN.wrapping_add(6)), (4, P_ISN.wrapping_add(11)), (5, P_ISN.wrapping_add(12))] {
        p.backup_progress(&rep(beat, last_ack), 40 + beat * 20);
        assert!(p.take_inject().is_empty(), "no relay after the server's FIN (last_ack {last_ack})");
    }
    assert_eq!(p.counters.acks_from_backup, 0);
}

/// Issue 20 review: a client that parks unread bytes on its own connection makes the server
/// look stalled, but that is no evidence about another connection: the primary yields only for
/// a connection whose own input waits unread while the backup is ahead on it.
#[test]
fn hostile_unread_input_parked_on_another_connection_is_no_evidence() {
    let mut p = primary(true);
    p.backup_progress(&progress(2, C_ISN + 1, b"abc", false), 3);
    let other = ConnKey { client_port: 40001, ..key() };
    p.server_reading(Some(20), &[other].into());
    p.tick(100);
    p.tick(400);
    assert!(p.take_notices().is_empty(), "stalled on another connection only");
    // Its own input waits too: a hung server.
    p.server_reading(Some(20), &[other, key()].into());
    p.tick(420);
    assert_eq!(p.take_notices(), vec![Notice::YieldToBackup { key: Some(key()) }]);
}

/// Both servers closed with a FIN and the backup had all the input: a RST from the backup's
/// server after that (a late segment after its close) is no failure, the backup stays a spare;
/// a RST before its FIN (or with input missing) is one (unprotected, stale).
#[test]
fn backup_rst_after_both_closed_is_no_failure() {
    let rst_after_fin = |beat, rcv_nxt| {
        let mut p = progress(beat, rcv_nxt, b"bye", true);
        p.records[0].flags |= rw::flag::RST_OUT;
        p
    };
    let mut p = primary(true);
    assert_eq!(primary_sends(&mut p, 0, b"bye", C_ISN + 1, F::FIN, 2).0, Verdict::Held);
    p.backup_progress(&progress(2, C_ISN + 1, b"bye", true), 3);
    assert!(!p.take_transmit().is_empty(), "data and FIN verified, released");
    p.backup_progress(&rst_after_fin(3, C_ISN + 1), 4);
    p.tick(10_000);
    assert!(p.backup_stale().is_none() && p.unprotected().is_none(), "{:?}", p.take_notices());
    assert_eq!(p.counters.backup_rst_after_close, 1);
    // A RST where the primary's server has not closed: the backup's failure.
    let mut q = primary(true);
    q.backup_progress(&rst_after_fin(2, C_ISN + 1), 3);
    assert_eq!(q.backup_stale(), Some(Why::BackupRst));
}

/// A client segment the primary's server took, whose bytes the primary copied for the backup.
fn client_sends(p: &mut Primary, off: u32, data: &[u8]) {
    let pkt = from_client(Repr { seq: Seq(C_ISN + 1 + off), ack: Seq(P_ISN.wrapping_add(1)), flags: F::ACK, window: 512, ..Default::default() }, data);
    assert_eq!(p.incoming(&pkt), Verdict::PASS);
}

/// The client bytes the primary relays to a backup that missed everything since the
/// handshake: its server consumed `consumed` bytes (its ACK), the backup reports none.
fn relayed_after_backup_missed(p: &mut Primary, consumed: u32) -> Vec<(u32, Vec<u8>)> {
    primary_sends(p, 0, &[], C_ISN + 1 + consumed, 0, 5);
    p.backup_progress(&progress(2, C_ISN + 1, &[], false), 10);
    p.backup_progress(&progress(3, C_ISN + 1, &[], false), 40);
    p.take_relay().into_iter().map(|(k, seq, d)| {
        assert_eq!(k, key());
        (seq.0 - (C_ISN + 1), d)
    }).collect()
}

/// The relayed bytes, in order, as one stream.
fn stream(relayed: &[(u32, Vec<u8>)]) -> Vec<u8> {
    relayed.iter().flat_map(|(_, d)| d.clone()).collect()
}

/// A primary that kept "abcde" at 0 and "klmno" at 10, then saw "ijXlm" at 8, which
/// contradicts the second copy.
fn primary_with_contradicted_input() -> Primary {
    let mut p = primary_established();
    client_sends(&mut p, 0, b"abcde");
    client_sends(&mut p, 10, b"klmno");
    client_sends(&mut p, 8, b"ijXlm");
    assert_eq!(p.counters.input_conflicts, 1);
    p
}

/// ST-TCP 3.6 (issue 20, a backup stale after 200 ms of loss): the primary's copy of the
/// client's input for the backup went on only in order, so one segment it saw early (or could
/// not keep) stopped every later copy and relay for good; the backup then crawled at the
/// client's retransmission timeouts until it was made stale. Bytes seen out of order are kept
/// and relayed like the others.
#[test]
fn st_tcp_3_6_input_the_primary_saw_out_of_order_is_relayed() {
    let mut p = primary_established();
    client_sends(&mut p, 10, b"klmnopqrst");
    client_sends(&mut p, 0, b"abcdefghij");
    client_sends(&mut p, 20, b"uvw");
    let relayed = relayed_after_backup_missed(&mut p, 23);
    let joined = stream(&relayed);
    assert_eq!(relayed.first().map(|r| r.0), Some(0));
    assert_eq!(joined, b"abcdefghijklmnopqrstuvw".to_vec(), "{relayed:?}");
    assert_eq!(p.counters.input_conflicts, 0);
}

/// A retransmission overlapping what was kept adds only what is new; a segment that
/// contradicts a kept copy (a forgery that guessed the client's sequence number) leaves that
/// range unrelayed (the relay stops before it: the backup waits for the client's own
/// retransmission), counted, never a byte the primary's server may not have.
#[test]
fn hostile_contradicting_input_is_never_relayed() {
    let mut p = primary_established();
    client_sends(&mut p, 0, b"abcde");
    client_sends(&mut p, 10, b"klmno");
    client_sends(&mut p, 3, b"defghijklm");
    let relayed = relayed_after_backup_missed(&mut p, 15);
    let joined = stream(&relayed);
    assert_eq!(joined, b"abcdefghijklmno".to_vec(), "overlaps add only the new bytes: {relayed:?}");
    assert_eq!(p.counters.input_conflicts, 0);

    let mut q = primary_with_contradicted_input();
    let relayed = relayed_after_backup_missed(&mut q, 15);
    let joined = stream(&relayed);
    assert_eq!(joined, b"abcde".to_vec(), "the gap before the contradicted range stops the relay: {relayed:?}");

    // The forger's second try (or anyone's) never fills the extent its first one emptied,
    // until the backup has it: the relay stops there even once the gap before it is filled.
    let mut r = primary_with_contradicted_input();
    client_sends(&mut r, 5, b"fgh");
    client_sends(&mut r, 10, b"ZZZZZ");
    let relayed = relayed_after_backup_missed(&mut r, 15);
    let joined = stream(&relayed);
    assert_eq!(joined, b"abcdefghij".to_vec(), "{relayed:?}");
    assert_eq!(r.counters.input_conflicts, 1);
}

/// Bytes the primary's server had already taken when a copy of them came (a retransmission,
/// or a forgery that guessed the sequence numbers) are not kept: they were kept when they
/// first came, or never (the backup then waits for the client).
#[test]
fn hostile_input_below_what_the_primarys_server_took_is_not_kept() {
    let mut p = primary_established();
    primary_sends(&mut p, 0, &[], C_ISN + 1 + 10, 0, 2);
    client_sends(&mut p, 0, b"FORGEDXXXX");
    client_sends(&mut p, 10, b"klmno");
    let relayed = relayed_after_backup_missed(&mut p, 15);
    assert_eq!(relayed, vec![], "the relay stops at the first byte it has no copy of");
}

/// The copy's bounds keep what the backup can use: it takes input in order, so bytes above a
/// hole are worth nothing until the hole is filled. A client (or a forger) that leaves holes
/// until the range bound is reached no longer stops the relay for good: the hole's bytes,
/// when they come, push out the highest ranges.
#[test]
fn hostile_holes_up_to_the_bound_do_not_keep_out_the_bytes_the_backup_needs() {
    let mut p = primary_established();
    for k in 0..unbroken_engines::replica::MAX_INPUT_RANGES as u32 {
        client_sends(&mut p, 10 + 2 * k, b"z");
    }
    client_sends(&mut p, 0, b"abcdefghij");
    let relayed = relayed_after_backup_missed(&mut p, 11);
    assert_eq!(stream(&relayed), b"abcdefghijz".to_vec(), "{:?}", &relayed[..relayed.len().min(3)]);
}

/// ST-TCP 3.6's relay does not feed a loaded backup duplicates (issue 20: resent every 40 ms,
/// 74 MB of copies went to a backup whose queue held the client's own packets, until it fell
/// seconds behind and went stale): nothing is relayed while the backup's server still takes
/// input, and a relay it does not confirm goes again after gaps that double.
#[test]
fn st_tcp_3_6_relay_waits_for_a_stopped_backup_and_backs_off() {
    let mut p = primary_established();
    client_sends(&mut p, 0, &[b'x'; 3000]);
    primary_sends(&mut p, 0, &[], C_ISN + 1 + 3000, 0, 5);
    // The backup's server takes input, slowly: no relay.
    for (i, t) in (10..=90).step_by(10).enumerate() {
        p.backup_progress(&progress(2 + i as u64, C_ISN + 1 + 100 * i as u32, &[], false), t);
    }
    assert!(p.take_relay().is_empty(), "a backup that still takes input is not sent copies");
    // It stopped: relayed once, then again only after 40, 80, 160 ms without confirmation.
    let mut sent_at = vec![];
    for t in (91..=500).step_by(1) {
        p.backup_progress(&progress(20 + t, C_ISN + 1 + 800, &[], false), t);
        if !p.take_relay().is_empty() {
            sent_at.push(t);
        }
    }
    assert_eq!(sent_at, vec![110, 150, 230, 390], "relayed when stopped for 20 ms, then after gaps of 40, 80, 160 ms");
    // Confirmed (its receive point reached the relay's end), more input it missed, stopped
    // again: relayed once it stopped for 20 ms, whatever the last gap was.
    client_sends(&mut p, 3000, &[b'y'; 1000]);
    primary_sends(&mut p, 0, &[], C_ISN + 1 + 4000, 0, 501);
    p.backup_progress(&progress(600, C_ISN + 1 + 3000, &[], false), 501);
    p.backup_progress(&progress(601, C_ISN + 1 + 3000, &[], false), 511);
    assert!(p.take_relay().is_empty());
    p.backup_progress(&progress(602, C_ISN + 1 + 3000, &[], false), 521);
    let r = p.take_relay();
    assert_eq!(r.iter().map(|(_, s, d)| (s.0 - (C_ISN + 1), d.len())).collect::<Vec<_>>(), vec![(3000, 1000)]);
}

// ---------------------------------------------------------------------------------------------
// The kernel's fast path: the hand-off of a connection's fields (issue 22 item 4)
// ---------------------------------------------------------------------------------------------

/// What the fast path hands back is taken exactly; what it cannot have produced (another Δ,
/// a connection not aligned, after the take-over, an unknown one) is refused and changes
/// nothing.
#[test]
fn backup_fast_state_round_trips_and_refuses_what_the_fast_path_cannot_produce() {
    let mut b = aligned_backup();
    backup_sends(&mut b, 0, &[1; 10], B_TS0 + 1);
    let f = b.fast_state(&key()).expect("followed");
    assert!(f.aligned && b.fast_eligible(&key()));
    assert!(b.set_fast_state(&key(), &f));
    assert_eq!(b.fast_state(&key()), Some(f), "identity");
    let moved = unbroken_engines::replica::BFast { snd_max: f.snd_max + 5, last_ack: f.last_ack + 3, acked_b: Some(f.snd_max), ..f };
    assert!(b.set_fast_state(&key(), &moved));
    assert_eq!(b.fast_state(&key()), Some(moved), "taken");
    for bad in [unbroken_engines::replica::BFast { delta: f.delta + 1, ..moved }, unbroken_engines::replica::BFast { aligned: false, ..moved }, unbroken_engines::replica::BFast { ws_b: 3, ..moved }] {
        assert!(!b.set_fast_state(&key(), &bad), "{bad:?}");
        assert_eq!(b.fast_state(&key()), Some(moved), "unchanged");
    }
    let other = ConnKey { client_port: 40001, ..key() };
    assert!(!b.set_fast_state(&other, &moved) && b.fast_state(&other).is_none() && !b.fast_eligible(&other));
    // Half-open: not aligned, never the fast path's.
    let mut h = Backup::new();
    h.incoming(&mut syn());
    assert!(!h.fast_eligible(&key()) && !h.set_fast_state(&key(), &moved));
    b.take_over();
    let now = b.fast_state(&key());
    assert!(!b.fast_eligible(&key()) && !b.set_fast_state(&key(), &f), "after the take-over every entry was loaded");
    assert_eq!(b.fast_state(&key()), now, "unchanged");
}

/// A connection the fast path carried for a while goes on on the engine exactly as if the
/// engine had seen every packet: engine `a` decides everything; engine `b` gets the same
/// packets except a middle stretch, for which it gets what the programs hand the daemon (the
/// fields, each checkpoint, each kept copy, the change). Both then answer the same report,
/// send the same progress, and resend the same segments at the take-over.
#[test]
fn backup_carried_by_the_fast_path_goes_on_exactly_as_the_engine() {
    for strict in [true, false] {
        let mut a = aligned_backup();
        let mut b = aligned_backup();
        a.set_strict(strict);
        b.set_strict(strict);
        let k = key();
        let mut off = 0u32;
        let mut rcv = 0u32;
        for round in 0..12u32 {
            let fast = (3..9).contains(&round);
            let side0 = a.side(&k).unwrap();
            let data: Vec<u8> = (0..300 + 50 * round).map(|x| (x + round) as u8).collect();
            // The backup's server answers (withheld), the client acknowledges part of what the
            // primary sent and sends a request.
            let (va, pa) = backup_sends(&mut a, off, &data, B_TS0 + 10 + round);
            assert_eq!(va, Verdict::Drop);
            off += data.len() as u32;
            let ack_to = off - 40;
            let req = vec![b'r'; 20];
            let mut c = from_client(Repr { seq: Seq(C_ISN + 1 + rcv), ack: Seq(P_ISN.wrapping_add(1 + ack_to)), flags: F::ACK | F::PSH, window: 512, timestamp: Some((600 + round, P_TS0 + round)), ..Default::default() }, &req);
            rcv += req.len() as u32;
            let ca = c.clone();
            let v = a.incoming(&mut c);
            if fast {
                // What the programs hand the daemon: the fields, then the records in order.
                let side1 = a.side(&k).unwrap();
                assert!(b.set_fast_state(&k, &a.fast_state(&k).unwrap()));
                for &(e, h) in &side1.checkpoints[side0.checkpoints.len().min(side1.checkpoints.len())..] {
                    b.push_checkpoint(&k, e, h);
                }
                if side1.kept.len() > side0.kept.len() || side1.kept.last() != side0.kept.last() {
                    let &(end, _) = side1.kept.last().unwrap();
                    b.push_kept(&k, end, pa.clone());
                }
                b.mark_changed(&k);
            } else {
                let (vb, pb) = backup_sends(&mut b, off - data.len() as u32, &data, B_TS0 + 10 + round);
                assert_eq!((vb, &pb), (va, &pa));
                let mut cb = ca;
                assert_eq!(b.incoming(&mut cb), v);
                assert_eq!(cb, c, "round {round}: the same bytes to the server");
            }
            assert_eq!(a.fast_state(&k), b.fast_state(&k), "round {round} (strict {strict})");
            // Kept copies the client's ACK covers may be let go at different moments (the
            // engine drops them at its server's next segment, the daemon when it adds one): the
            // ones that matter are those beyond it.
            let acked = a.fast_state(&k).unwrap().acked_b;
            let live = |s: unbroken_engines::replica::BSide| (s.checkpoints, s.kept.into_iter().filter(|(e, _)| acked.is_none_or(|a| e.gt(a))).collect::<Vec<_>>(), s.ooo_empty);
            assert_eq!(live(a.side(&k).unwrap()), live(b.side(&k).unwrap()), "round {round} (strict {strict}): checkpoints and kept copies");
        }
        let rec = ConnProgress { client: cli(), client_port: 40000, server_port: 6379, rcv_nxt: Seq(C_ISN + 1 + rcv), rcv_edge: Seq(C_ISN + 1001 + rcv), out_end: Seq(P_ISN.wrapping_add(1 + off - 100)), out_hash: 0, last_ack: Seq(P_ISN.wrapping_add(1 + off - 40)), isn: Seq(P_ISN), flags: rw::flag::RCV_KNOWN | rw::flag::ISN_KNOWN };
        let rep = Progress { role: Role::Primary, beat: 5, flags: 0, records: vec![rec] };
        assert_eq!(a.primary_report(&rep), b.primary_report(&rep), "the relayed ACK");
        assert_eq!(a.progress_changed(6), b.progress_changed(6), "the next message");
        assert_eq!(a.progress(7), b.progress(7), "the beat");
        a.take_over();
        b.take_over();
        let (ta, tb) = (a.take_transmit(), b.take_transmit());
        assert!(!ta.is_empty(), "withheld output resent");
        assert_eq!(ta, tb, "strict {strict}: the take-over's resends");
    }
}

/// The primary's half: its fields round-trip; a connection whose SYN-ACK has not gone out,
/// another window shift or stream start, an unknown connection are refused; a held segment
/// takes the connection off the fast path until it is released.
#[test]
fn primary_fast_state_round_trips_and_eligibility_follows_held_output() {
    let mut p = primary_established();
    let f = p.fast_state(&key()).expect("followed");
    assert!(f.answered && p.fast_eligible(&key()));
    assert!(p.set_fast_state(&key(), &f));
    assert_eq!(p.fast_state(&key()), Some(f), "identity");
    let moved = unbroken_engines::replica::PFast { ack_p: f.ack_p + 7, client_ack: f.client_ack + 3, client_heard_at: 42, ..f };
    assert!(p.set_fast_state(&key(), &moved));
    assert_eq!(p.fast_state(&key()), Some(moved), "taken");
    for bad in [unbroken_engines::replica::PFast { ws_p: 9, ..moved }, unbroken_engines::replica::PFast { stream_start: moved.stream_start + 1, ..moved }, unbroken_engines::replica::PFast { answered: false, ..moved }] {
        assert!(!p.set_fast_state(&key(), &bad), "{bad:?}");
        assert_eq!(p.fast_state(&key()), Some(moved), "unchanged");
    }
    let other = ConnKey { client_port: 40001, ..key() };
    assert!(!p.set_fast_state(&other, &moved) && p.fast_state(&other).is_none() && !p.fast_eligible(&other));
    // Strict mode: new output waits for the backup's digest: held, the engine's alone.
    let mut s = primary(true);
    let ack = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1)), flags: F::ACK, window: 512, ..Default::default() }, &[]);
    s.incoming(&ack);
    assert!(s.fast_eligible(&key()));
    let (v, _) = primary_sends(&mut s, 0, &[7; 10], C_ISN + 1, 0, 5);
    assert_eq!(v, Verdict::Held);
    assert!(!s.fast_eligible(&key()), "held output is the engine's");
}

/// Koch 5 with GSO on the backup's queue: a withheld super-packet is kept whole and, at the
/// take-over, resent as the kernel would have cut it: segments of at most the client's MSS
/// less the options, in the primary's space, together the whole output.
#[test]
fn koch_5_takeover_cuts_a_kept_super_packet_to_the_clients_mss() {
    let mut b = aligned_backup();
    let data: Vec<u8> = (0..5000u32).map(|x| (x * 13) as u8).collect();
    let (v, _) = backup_sends(&mut b, 0, &data, B_TS0 + 1);
    assert_eq!(v, Verdict::Drop, "withheld");
    b.take_over();
    let out = b.take_transmit();
    assert_eq!(out.len(), 4, "5000 bytes in segments of 1460 - 12 (timestamps)");
    let mut got = vec![];
    for (i, p) in out.iter().enumerate() {
        let (r, payload) = seg(p);
        assert_eq!(r.seq, Seq(P_ISN.wrapping_add(1 + 1448 * i as u32)), "the primary's space");
        assert!(payload.len() <= 1448);
        assert!(r.timestamp.is_some());
        got.extend_from_slice(&payload);
    }
    assert_eq!(got, data);
    // How many pieces the take-over resends when the client's SYN names `mss` (the backup's
    // SYN-ACK names 1460).
    let pieces = |mss: u16| {
        let mut h = Backup::new();
        h.incoming(&mut from_client(Repr { seq: Seq(C_ISN), flags: F::SYN, window: 65535, mss: Some(mss), wscale: Some(7), timestamp: Some((500, 0)), ..Default::default() }, &[]));
        let mut sa = from_server(Repr { seq: Seq(B_ISN), ack: Seq(C_ISN + 1), flags: F::SYN | F::ACK, window: 65535, mss: Some(1460), wscale: Some(7), timestamp: Some((B_TS0, 500)), ..Default::default() }, &[]);
        h.outgoing(&mut sa);
        let mut ack = from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1)), flags: F::ACK, window: 512, timestamp: Some((501, P_TS0)), ..Default::default() }, &[]);
        h.incoming(&mut ack);
        assert!(h.primary_report(&primary_names(rw::flag::RCV_KNOWN | rw::flag::ISN_KNOWN, Seq(0))).is_empty());
        backup_sends(&mut h, 0, &data, B_TS0 + 1);
        h.take_over();
        h.take_transmit().len()
    };
    // A forged SYN's tiny MSS cannot make thousands of segments: 536 at the least.
    assert_eq!(pieces(1), 5000usize.div_ceil(536 - 12), "cut at 536 - 12");
    // Nor a forged SYN's huge MSS an unsendable one: the SYN-ACK's (the backup's own link) bounds it.
    assert_eq!(pieces(65535), 4, "cut at the SYN-ACK's 1460 - 12");
}

/// Koch 3.2 with super-packets: one segment of the backup's server that crosses several
/// multiples of `CHECKPOINT_STEP` (primary's space) leaves a checkpoint at each and at its end,
/// each the digest of the output up to there, so that the primary, whose held segments end
/// elsewhere, always finds one within a step of what it holds.
#[test]
fn koch_3_2_a_super_packet_leaves_a_checkpoint_every_step() {
    use unbroken_engines::replica::CHECKPOINT_STEP;
    let mut b = aligned_backup();
    let data: Vec<u8> = (0..5000u32).map(|x| (x * 31 + 7) as u8).collect();
    backup_sends(&mut b, 0, &data, B_TS0 + 1);
    let side = b.side(&key()).unwrap();
    let start = Seq(P_ISN.wrapping_add(1));
    let end = start + data.len() as u32;
    let mut want = vec![];
    let mut at = start;
    while at.lt(end) {
        let next = Seq((at.0 / CHECKPOINT_STEP + 1).wrapping_mul(CHECKPOINT_STEP));
        at = if next.lt(end) { next } else { end };
        want.push((at, hash_continue(HASH_INIT, &data[..(at - start) as usize])));
    }
    assert_eq!(side.checkpoints, want);
    assert!(want.len() >= 5, "{} checkpoints", want.len());
    assert!(want[..want.len() - 1].iter().all(|(e, _)| e.0 % CHECKPOINT_STEP == 0));
    // A segment that ends exactly on a step leaves one checkpoint there, not two.
    let mut b = aligned_backup();
    let to_step = (CHECKPOINT_STEP - start.0 % CHECKPOINT_STEP) as usize;
    backup_sends(&mut b, 0, &data[..to_step], B_TS0 + 1);
    assert_eq!(b.side(&key()).unwrap().checkpoints.len(), 1);
}

/// Without strict output commit the primary releases output without the backup's digest: a
/// relaxed backup computes none (its records keep `HASH_INIT`, no checkpoints), only the end of
/// its server's output moves (the lag bounds and the FIN's offset need it). The primary refuses
/// a peer whose setting differs (`hdr::RELAXED`, the daemon's core).
#[test]
fn relaxed_backup_learns_the_output_end_without_a_digest() {
    let mut b = aligned_backup();
    b.set_strict(false);
    let data: Vec<u8> = (0..5000u32).map(|x| (x * 31 + 7) as u8).collect();
    assert_eq!(backup_sends(&mut b, 0, &data, B_TS0 + 1).0, Verdict::Drop, "withheld as ever");
    assert!(b.side(&key()).unwrap().checkpoints.is_empty(), "no checkpoints");
    let f = b.fast_state(&key()).unwrap();
    assert_eq!((f.out_end, f.out_hash), (Seq(P_ISN.wrapping_add(1 + 5000)), HASH_INIT));
    let recs: Vec<ConnProgress> = b.progress(2).into_iter().flat_map(|p| p.records).collect();
    assert_eq!(recs.len(), 1, "one record, at the end: {recs:?}");
    assert_eq!((recs[0].out_end, recs[0].out_hash), (Seq(P_ISN.wrapping_add(5001)), HASH_INIT));
}

// --- loss toward the primary: the backup relays the client's bytes -------------------------

/// The primary's report of the one connection with its server's RCV.NXT at `rcv`.
fn primary_at(beat: u64, rcv: u32) -> Progress {
    let mut p = primary_names(rw::flag::RCV_KNOWN | rw::flag::ISN_KNOWN, Seq(0));
    p.beat = beat;
    p.records[0].rcv_nxt = Seq(rcv);
    p
}

/// A client segment with `n` bytes at stream offset `off` through the backup's engine.
fn client_to_backup(b: &mut Backup, off: u32, n: usize, tsval: u32) {
    let mut pkt = from_client(Repr { seq: Seq(C_ISN + 1 + off), ack: Seq(P_ISN.wrapping_add(1)), flags: F::ACK | F::PSH, window: 512, timestamp: Some((tsval, P_TS0)), ..Default::default() }, &vec![(off % 251) as u8; n]);
    assert!(matches!(b.incoming(&mut pkt), Verdict::Accept { .. }));
}

/// The backup's server acknowledges the client's first `n` bytes (its kernel took them).
fn backup_acks(b: &mut Backup, n: u32) {
    let mut p = from_server(Repr { seq: Seq(B_ISN + 1), ack: Seq(C_ISN + 1 + n), flags: F::ACK, window: 500, timestamp: Some((B_TS0 + 1, 501)), ..Default::default() }, &[]);
    assert_eq!(b.outgoing(&mut p), Verdict::Drop, "withheld");
}

/// The relays of one report, as (offset, bytes) with what they say of the client.
fn relays(b: &mut Backup) -> (Vec<(u32, Vec<u8>)>, Vec<Option<RelayFrom>>) {
    b.take_relay().into_iter().map(|(k, seq, d, f)| {
        assert_eq!(k, key());
        assert!(d.len() <= rw::MAX_INPUT);
        ((seq.0 - (C_ISN + 1), d), f)
    }).unzip()
}

/// Loss toward the primary (ST-TCP Table 3.3 row 5's other host; the reverse of 3.6): the
/// backup keeps copies of the client's bytes beyond the primary server's RCV.NXT and relays
/// them once that RCV.NXT stood still for `INPUT_RELAY_AFTER_MS` below bytes the backup has
/// had as long; again after a gap when the primary does not confirm them; never what the
/// primary's server already has; nothing to a primary that is merely behind.
#[test]
fn loss_toward_primary_the_backup_relays_the_bytes_the_primary_missed() {
    let mut b = aligned_backup();
    b.tick(100);
    client_to_backup(&mut b, 0, 3000, 600);
    backup_acks(&mut b, 1000);
    b.tick(110);
    b.primary_report(&primary_at(2, C_ISN + 1));
    assert!(b.take_relay().is_empty(), "those bytes came 10 ms ago: the primary's report may not show them yet");
    b.tick(125);
    b.primary_report(&primary_at(3, C_ISN + 1));
    let (r, from) = relays(&mut b);
    assert_eq!((r[0].0, stream(&r)), (0, vec![0u8; 1000]), "in order, only what the backup's own server acknowledged");
    assert!(from.iter().all(|f| *f == Some(RelayFrom { ts: Some((600, P_TS0)), window: 512 })), "the segment's own timestamps, the client's window: {from:?}");
    backup_acks(&mut b, 3000);
    b.tick(130);
    b.primary_report(&primary_at(4, C_ISN + 1));
    let (r, _) = relays(&mut b);
    assert_eq!((r[0].0, stream(&r).len()), (1000, 2000), "then the rest, once acknowledged, not again what went");
    b.tick(150);
    b.primary_report(&primary_at(5, C_ISN + 1));
    assert!(b.take_relay().is_empty(), "not again before the gap (40 ms from the first relay)");
    b.tick(170);
    b.primary_report(&primary_at(6, C_ISN + 1));
    assert_eq!(stream(&relays(&mut b).0).len(), 3000, "unconfirmed: sent again after the gap");
    // Confirmed; the next bytes are lost toward the primary as well: only they go.
    b.tick(175);
    b.primary_report(&primary_at(7, C_ISN + 3001));
    client_to_backup(&mut b, 3000, 1000, 700);
    backup_acks(&mut b, 4000);
    b.tick(190);
    b.primary_report(&primary_at(8, C_ISN + 3001));
    assert!(b.take_relay().is_empty());
    b.tick(200);
    b.primary_report(&primary_at(9, C_ISN + 3001));
    let (r, from) = relays(&mut b);
    assert_eq!((r[0].0, stream(&r).len()), (3000, 1000), "from the primary's figure, never below");
    assert_eq!(from[0].unwrap().ts, Some((700, P_TS0)));
    // A primary merely behind (its queue on a loaded host): its figure moves, nothing goes.
    b.tick(300);
    client_to_backup(&mut b, 4000, 1000, 800);
    backup_acks(&mut b, 5000);
    for (i, (t, at)) in [(310, 4001), (320, 4501), (335, 4501), (338, 5001)].into_iter().enumerate() {
        b.tick(t);
        b.primary_report(&primary_at(10 + i as u64, C_ISN + at));
        assert!(b.take_relay().is_empty(), "at {t} ms");
    }
    assert_eq!(b.counters.relayed_to_primary, 7000);
}

/// Attacker's-eye review of the relay: only bytes the backup's kernel took are relayed. A
/// segment whose bytes differ from a copy of the same sequence numbers (one of the two guessed
/// them) drops that connection's copies until the primary has those bytes; a RST's payload is
/// never copied; bytes the backup's server has not acknowledged wait.
#[test]
fn hostile_only_bytes_the_backups_kernel_took_are_relayed() {
    let mut b = aligned_backup();
    b.tick(100);
    client_to_backup(&mut b, 0, 1000, 600);
    let mut forged = from_client(Repr { seq: Seq(C_ISN + 501), ack: Seq(P_ISN.wrapping_add(1)), flags: F::ACK | F::PSH, window: 512, timestamp: Some((601, P_TS0)), ..Default::default() }, &[0xee; 1000]);
    assert!(matches!(b.incoming(&mut forged), Verdict::Accept { .. }));
    assert_eq!(b.counters.input_conflicts, 1);
    backup_acks(&mut b, 1500);
    for t in [110, 125, 200] {
        b.tick(t);
        b.primary_report(&primary_at(t, C_ISN + 1));
        assert!(b.take_relay().is_empty(), "at {t} ms: contradicted copies are never relayed");
    }
    // The primary has them: copies resume. A RST carrying bytes is not copied.
    b.tick(210);
    b.primary_report(&primary_at(210, C_ISN + 1501));
    let mut rst = from_client(Repr { seq: Seq(C_ISN + 1601), ack: Seq(P_ISN.wrapping_add(1)), flags: F::ACK | F::RST, window: 512, timestamp: Some((700, P_TS0)), ..Default::default() }, &[0xdd; 100]);
    b.incoming(&mut rst);
    client_to_backup(&mut b, 1500, 100, 701);
    client_to_backup(&mut b, 1600, 100, 702);
    backup_acks(&mut b, 1650);
    b.tick(240);
    b.primary_report(&primary_at(240, C_ISN + 1501));
    let (r, _) = relays(&mut b);
    assert_eq!((r[0].0, stream(&r)), (1500, [vec![(1500 % 251) as u8; 100], vec![(1600 % 251) as u8; 50]].concat()), "the client's bytes, up to what the backup's server acknowledged");
}

/// The primary puts the backup's relay into its own server as the client's segment: only the
/// bytes it has not had (a resend, an overlap, the client's own segment that did arrive), with
/// the client's latest ACK and window as this host heard them and the newer TSval of the two
/// hosts' (an older one would be discarded, PAWS).
#[test]
fn loss_toward_primary_the_backups_relay_reaches_the_server_once() {
    let mut p = primary_established();
    let from = RelayFrom { ts: Some((700, P_TS0)), window: 300 };
    assert!(p.backup_input(&key(), Seq(C_ISN + 1), &[9u8; 100], from));
    let inj = p.take_inject();
    assert_eq!(inj.len(), 1);
    let (t, d) = seg(&inj[0]);
    assert_eq!((t.src_port, t.dst_port, t.seq, t.ack, t.window, d), (40000, 6379, Seq(C_ISN + 1), Seq(P_ISN.wrapping_add(1)), 512, vec![9u8; 100]));
    assert_eq!(t.timestamp, Some((700, P_TS0)), "the backup heard the client later");
    assert!(!p.backup_input(&key(), Seq(C_ISN + 1), &[9u8; 100], from), "a resend brings nothing new");
    assert!(p.take_inject().is_empty());
    assert!(p.backup_input(&key(), Seq(C_ISN + 51), &[8u8; 100], RelayFrom { ts: Some((650, P_TS0)), window: 300 }));
    let (t, d) = seg(&p.take_inject()[0]);
    assert_eq!((t.seq, d.len()), (Seq(C_ISN + 101), 50), "only the new part");
    assert_eq!(t.timestamp, Some((700, P_TS0)), "never an older TSval than one already given");
    // The client's own segment reached this host: the backup's copy of it is a duplicate.
    client_sends(&mut p, 150, &[7u8; 50]);
    assert!(!p.backup_input(&key(), Seq(C_ISN + 151), &[7u8; 50], from));
    assert_eq!((p.counters.backup_input, p.counters.backup_input_redundant), (150, 2));
}

/// A relay for a connection this primary does not protect (the backup failed, or it diverged)
/// or does not follow never reaches its server: the backup's copy is only worth something for
/// a connection both hosts follow.
#[test]
fn hostile_relay_into_an_unprotected_or_unknown_connection_is_refused() {
    let mut p = primary_established();
    let from = RelayFrom { ts: Some((700, P_TS0)), window: 300 };
    let other = ConnKey { client_port: 40001, ..key() };
    assert!(!p.backup_input(&other, Seq(C_ISN + 1), &[9u8; 10], from));
    // At or across the edge of its server's window (65,535 from the SYN-ACK): cut there, never
    // beyond (nothing left: refused).
    assert!(!p.backup_input(&key(), Seq(C_ISN + 1 + 65535), &[9u8; 10], from));
    assert!(p.backup_input(&key(), Seq(C_ISN + 1 + 65530), &[9u8; 10], from));
    let inj = p.take_inject();
    let (t, d) = seg(&inj[0]);
    assert_eq!((t.seq, d.len()), (Seq(C_ISN + 1 + 65530), 5));
    p.backup_failed();
    assert!(!p.backup_input(&key(), Seq(C_ISN + 1), &[9u8; 10], from));
    assert!(p.take_inject().is_empty());
}
