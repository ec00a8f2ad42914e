//! Checkpoint mode's fast path against the RTCP engine (issue 22, step 1): the same packets
//! through `rtcp::outgoing_parsed` / `rtcp::incoming_parsed` and, by `BPF_PROG_TEST_RUN`,
//! through the BPF programs (`bpf/checkpoint/ckpt_tc.c`). For every packet the fast path claims
//! the bytes (checksums included) and the connection's state afterwards must be the engine's;
//! every packet it does not claim must come back as `Verdict::Slow`, not a byte changed, its
//! entry untouched. Tests are named after the paper's steps (seed 004, section 3.1) and use
//! the engine's own vectors (`crates/engines/tests/rtcp_vectors`) and the kernel's packets
//! (`crates/wire/tests/kernel_pcap`).
//!
//! Root only, no namespace: each test prints "SKIP" and passes when it cannot load BPF programs
//! (not root, no tc-BPF), or fails with the reason when UNBROKEN_REQUIRE_LAB=1.

include!("common/require.rs");
include!("common/loaded.rs");

#[path = "../../engines/tests/rtcp_vectors/mod.rs"]
mod rtcp_vectors;

#[path = "../../wire/tests/kernel_pcap/mod.rs"]
mod kernel_pcap;

use std::net::{IpAddr, SocketAddr};

use rtcp_vectors::*;
use unbroken_drivers::fastpath::checkpoint::{Checkpoint, Direction, Key};
use unbroken_drivers::fastpath::Verdict;
use unbroken_engines::rtcp::{self, flag, Conn, PeerChecksum};
use unbroken_wire::ctl::{Command, Op};
use unbroken_wire::ip::{self, IpInfo};
use unbroken_wire::tcp::{flags as F, Packet as Tcp, Repr};
use unbroken_wire::{ipv4, Seq};

use Direction::{Incoming, Outgoing};

/// The loaded programs, or `None` after a SKIP line (BPF unavailable here). Any other failure
/// (the verifier refusing a program, a map that cannot be made) fails the test.
fn fast_path(test: &str) -> Option<Checkpoint> {
    loaded_or_skip(test, Checkpoint::load())
}

fn a6() -> IpAddr {
    "fd77:2::10".parse().unwrap()
}
fn b6() -> IpAddr {
    "fd77:1::2".parse().unwrap()
}

/// The state after a recovery, once the application's TELL fixed the new socket's origin:
/// Δ ≠ 0, a timestamp offset, and the new socket's window scale (9) differs from the one *B*
/// applies (7). The engine's own vector (`recovered`) followed by C1.
fn recovered_told(new_isn: u32) -> Conn {
    let (mut c, o, _) = recovered(new_isn);
    assert_eq!(o.event, Some(rtcp::Event::Recovered));
    let cmd = Command::request(Op::Tell, SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT), 9, 9);
    rtcp::command(&mut c, &cmd, &mut [0u8; 128]);
    assert_eq!(c.flags & (flag::SYN_PENDING | flag::ORIGIN_PINNED), 0);
    assert_ne!(c.delta, 0);
    assert_ne!(c.ts_off, 0);
    c
}

/// One connection run through both paths: the engine's state and the fast path's map entry.
struct Both {
    fp: Checkpoint,
    key: Key,
    c: Conn,
    claimed: usize,
    slow: usize,
}

impl Both {
    fn new(fp: Checkpoint, c: Conn) -> Both {
        Both::at(fp, c, a_ip(), b_ip())
    }

    fn at(mut fp: Checkpoint, c: Conn, a: IpAddr, b: IpAddr) -> Both {
        let key = Key::new(SocketAddr::new(a, A_PORT), SocketAddr::new(b, B_PORT));
        fp.insert(&key, &c).unwrap();
        Both { fp, key, c, claimed: 0, slow: 0 }
    }

    /// Replaces the state on both paths.
    fn set(&mut self, c: Conn) {
        self.c = c;
        self.fp.insert(&self.key, &c).unwrap();
    }

    /// `p` through both paths, checked against each other (see the module docs). A packet the
    /// fast path leaves to the slow path is then decided by the engine, whose state goes back
    /// into the map, as the daemon will do. Returns the fast path's verdict.
    fn step(&mut self, d: Direction, p: &P, what: &str) -> Verdict {
        let pkt = &p.buf[..p.len];
        let before = self.fp.get(&self.key).unwrap();
        let run = self.fp.run(d, pkt).unwrap();
        let mut buf = p.buf.clone();
        let mut c = self.c;
        let engine = IpInfo::parse(pkt).and_then(|info| match d {
            Outgoing => rtcp::outgoing_parsed(&mut c, &mut buf, p.len, &info),
            Incoming => rtcp::incoming_parsed(&mut c, &mut buf, p.len, &info, peer_checksum(pkt, &info)),
        });
        match run.verdict {
            Verdict::Done => {
                let o = engine.unwrap_or_else(|e| panic!("{what}: claimed by the fast path, refused by the engine: {e:?}"));
                assert!(matches!(o.verdict, unbroken_engines::Verdict::Accept { .. }), "{what}: claimed, but the engine says {:?} ({:?})", o.verdict, o.event);
                assert_eq!(o.event, None, "{what}: claimed, but the engine saw {:?}", o.event);
                assert_eq!(hex(&run.packet), hex(&buf[..o.len]), "{what}: the fast path's bytes differ from the engine's");
                assert_eq!(self.fp.get(&self.key).unwrap(), Some(c), "{what}: the fast path's state differs from the engine's");
                self.claimed += 1;
            }
            Verdict::Slow => {
                assert_eq!(hex(&run.packet), hex(pkt), "{what}: left to the slow path, but modified");
                assert_eq!(self.fp.get(&self.key).unwrap(), before, "{what}: left to the slow path, but the entry changed");
                if before.is_some() {
                    self.fp.insert(&self.key, &c).unwrap();
                }
                self.slow += 1;
            }
            v => panic!("{what}: unexpected verdict {v:?}"),
        }
        self.c = c;
        run.verdict
    }

    /// `p` must be claimed (and match the engine).
    fn claims(&mut self, d: Direction, p: &P, what: &str) {
        assert_eq!(self.step(d, p, what), Verdict::Done, "{what}: expected the fast path to claim it");
    }

    /// `p` must be left to the slow path, untouched.
    fn leaves(&mut self, d: Direction, p: &P, what: &str) {
        assert_eq!(self.step(d, p, what), Verdict::Slow, "{what}: expected the slow path");
    }
}

/// How the slow path would take a packet from *B*: a checksum field that holds the folded
/// pseudo-header sum is what a host puts there before the checksum is completed
/// (CHECKSUM_PARTIAL, NFQUEUE's csum_not_ready), and the fast path takes it as such (it cannot
/// read ip_summed); any other packet must verify.
fn peer_checksum(pkt: &[u8], info: &IpInfo) -> PeerChecksum {
    use unbroken_wire::checksum;
    let l4_len = info.l4_len as u32;
    let sum = match (info.src, info.dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => checksum::pseudo_v4(s.octets(), d.octets(), ip::PROTO_TCP, l4_len),
        (IpAddr::V6(s), IpAddr::V6(d)) => checksum::pseudo_v6(s.octets(), d.octets(), ip::PROTO_TCP, l4_len),
        _ => return PeerChecksum::Verify,
    };
    let at = info.l4_offset + 16;
    match pkt.get(at..at + 2) {
        Some(f) if u16::from_be_bytes([f[0], f[1]]) == checksum::fold(sum) => PeerChecksum::Partial,
        _ => PeerChecksum::Verify,
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Rebuilds the checksums of `p` after a test edited its bytes by hand.
fn refill(p: &mut P) {
    let info = IpInfo::parse(&p.buf[..p.len]).unwrap();
    if info.src.is_ipv4() {
        ipv4::Packet::new_checked(&mut p.buf[..p.len]).unwrap().fill_checksum();
    }
    let (l4, n) = (info.l4_offset, info.l4_len);
    Tcp::new_checked(&mut p.buf[l4..l4 + n]).unwrap().fill_checksum(info.pseudo_sum(n));
}

/// A segment `src` → `dst` whose TCP options are exactly `opts` (a multiple of 4 bytes).
fn with_options(src: IpAddr, dst: IpAddr, r: Repr, opts: &[u8], payload: &[u8]) -> P {
    assert_eq!(opts.len() % 4, 0);
    let bare = Repr { mss: None, wscale: None, sack_perm: false, timestamp: None, sack_len: 0, ..r };
    let tl = 20 + opts.len() + payload.len();
    let mut buf = vec![0u8; 60 + tl + 64];
    let hl = ip::emit_header(&mut buf, src, dst, ip::PROTO_TCP, tl).unwrap();
    bare.emit(&mut buf[hl..]).unwrap();
    buf[hl + 12] = (((20 + opts.len()) / 4) as u8) << 4;
    buf[hl + 20..hl + 20 + opts.len()].copy_from_slice(opts);
    buf[hl + 20 + opts.len()..hl + tl].copy_from_slice(payload);
    let mut p = P { buf, len: hl + tl };
    refill(&mut p);
    p
}

fn data_from_a(seq: u32, ack: u32, window: u16, ts: Option<(u32, u32)>, payload: &[u8]) -> P {
    from_a(Repr { seq: Seq(seq), ack: Seq(ack), flags: F::ACK | F::PSH, window, timestamp: ts, ..Default::default() }, payload)
}

fn sack(blocks: &[(u32, u32)]) -> ([(Seq, Seq); 4], u8) {
    let mut s = [(Seq(0), Seq(0)); 4];
    for (i, (l, r)) in blocks.iter().enumerate() {
        s[i] = (Seq(*l), Seq(*r));
    }
    (s, blocks.len() as u8)
}

fn ack_from_b(seq: u32, ack: u32, window: u16, ts: Option<(u32, u32)>, blocks: &[(u32, u32)]) -> P {
    let (sack, sack_len) = sack(blocks);
    from_b(Repr { seq: Seq(seq), ack: Seq(ack), flags: F::ACK, window, timestamp: ts, sack, sack_len, ..Default::default() }, b"")
}

const NEW_ISN: u32 = 777;

/// O8 (SEQ - Δ), O7 (the ACK clamped to the checkpoint, the window widened by the held bytes),
/// the timestamp offset and the window rescaled from the new socket's scale to the one *B*
/// applies: after a recovery, with and without timestamps, every payload size the checksum
/// loop treats differently.
#[test]
fn o7_o8_outgoing_after_recovery_matches_the_engine() {
    let Some(fp) = fast_path("o7_o8_outgoing_after_recovery_matches_the_engine") else { return };
    let mut both = Both::new(fp, recovered_told(NEW_ISN));
    let mut seq = NEW_ISN + 1;
    let mut tsval = 25;
    for (i, len) in [0usize, 1, 6, 100, 511, 512, 513, 1024, 1460, 2999].into_iter().enumerate() {
        let payload: Vec<u8> = (0..len).map(|k| (k * 7 + i) as u8).collect();
        // A's TCP acknowledges up to 3000 bytes beyond the checkpoint (B_ISN + 2001): O7 holds them.
        let ack = B_ISN + 2001 + (i as u32) * 300;
        let ts = (i % 3 != 2).then_some((tsval, 150 + i as u32));
        both.claims(Outgoing, &data_from_a(seq, ack, 100 + i as u16, ts, &payload), &format!("O8 segment {i} of {len} bytes"));
        seq += len as u32;
        tsval += 1;
    }
    // The state the engine would have: the end of what A sent is B's view of SEQ + length.
    assert_eq!(both.c.a_end, (A_ISN + 3001).wrapping_add(seq - (NEW_ISN + 1)));
    // An ACK at or below the checkpoint passes unchanged (O7 never raises it); window 0.
    both.claims(Outgoing, &data_from_a(seq, B_ISN + 1500, 0, Some((tsval, 160)), b""), "O7 ACK below the checkpoint");
    // A checkpointed more (C2): the ACK follows.
    let cmd = Command { ack_a: B_ISN + 2601, ..Command::request(Op::Acknowledge, SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT), 10, 10) };
    let mut c = both.c;
    rtcp::command(&mut c, &cmd, &mut [0u8; 128]);
    both.set(c);
    both.claims(Outgoing, &data_from_a(seq, B_ISN + 4001, 0xffff, Some((tsval + 1, 161)), b"x"), "O7 after ACKNOWLEDGE, window saturating");
    // C4: acknowledging everything, the ACK is not touched.
    let mut c = both.c;
    rtcp::command(&mut c, &Command { op: Op::ShutdownReading, ..cmd }, &mut [0u8; 128]);
    both.set(c);
    both.claims(Outgoing, &data_from_a(seq + 1, B_ISN + 4001, 77, Some((tsval + 2, 162)), b"y"), "O7 after SHUTDOWN_READING");
    assert_eq!(both.slow, 0);
}

/// I3: *B*'s ACK + Δ and its SACK edges + Δ (1 to 3 blocks with timestamps, 4 without), the
/// TSecr taken back into *A*'s clock, ackB and *B*'s clock learned.
#[test]
fn i3_incoming_ack_and_sack_edges_after_recovery_match_the_engine() {
    let Some(fp) = fast_path("i3_incoming_ack_and_sack_edges_after_recovery_match_the_engine") else { return };
    let mut both = Both::new(fp, recovered_told(NEW_ISN));
    // The new socket resends 3000 bytes (B's view: A_ISN + 3001 ...).
    both.claims(Outgoing, &data_from_a(NEW_ISN + 1, B_ISN + 2001, 100, Some((25, 150)), &[5u8; 1400]), "resend 1");
    both.claims(Outgoing, &data_from_a(NEW_ISN + 1401, B_ISN + 2001, 100, Some((26, 150)), &[6u8; 1400]), "resend 2");
    let base = A_ISN + 3001;
    let ts = |v: u32| Some((160 + v, both_tsval(v)));
    both.claims(Incoming, &ack_from_b(B_ISN + 2001, base + 100, 500, ts(0), &[]), "I3 plain ACK");
    both.claims(Incoming, &ack_from_b(B_ISN + 2001, base + 100, 500, ts(1), &[(base + 200, base + 300)]), "I3 one SACK block");
    both.claims(Incoming, &ack_from_b(B_ISN + 2001, base + 100, 500, ts(2), &[(base + 400, base + 500), (base + 200, base + 300)]), "I3 two SACK blocks");
    both.claims(Incoming, &ack_from_b(B_ISN + 2001, base + 100, 500, ts(3), &[(base + 600, base + 700), (base + 400, base + 500), (base + 200, base + 300)]), "I3 three SACK blocks");
    both.claims(Incoming, &ack_from_b(B_ISN + 2001, base + 100, 500, None, &[(base + 800, base + 900), (base + 600, base + 700), (base + 400, base + 500), (base + 200, base + 300)]), "I3 four SACK blocks, no timestamps");
    // Data from B (inside the window A's TCP accepts), acknowledging more.
    let data = from_b(Repr { seq: Seq(B_ISN + 2001), ack: Seq(base + 2800), flags: F::ACK | F::PSH, window: 500, timestamp: ts(4), ..Default::default() }, &[9u8; 1000]);
    both.claims(Incoming, &data, "I3 data from B");
    assert_eq!(both.c.ack_b, base + 2800, "ackB learned");
    assert_eq!(both.slow, 0);
}

/// The TSecr *B* echoes: the TSval *A*'s packets carried after the offset.
fn both_tsval(v: u32) -> u32 {
    25 + v
}

/// Issue 21, item 2, through both paths: *B*'s ACK beyond what the recovered socket sent is
/// lowered to that end (the engine's step of the same name, on the same vectors).
#[test]
fn peer_ack_beyond_what_the_recovered_socket_sent_is_lowered_to_its_end() {
    let Some(fp) = fast_path("peer_ack_beyond_what_the_recovered_socket_sent_is_lowered_to_its_end") else { return };
    let mut both = Both::new(fp, recovered_told(NEW_ISN));
    both.claims(Outgoing, &data_from_a(NEW_ISN + 1, B_ISN + 2001, 100, Some((25, 150)), &[7u8; 100]), "the new socket resends 100 bytes");
    let late = Repr { seq: Seq(B_ISN + 4001), ack: Seq(A_ISN + 3502), flags: F::ACK, window: 500, timestamp: Some((160, 9700)), ..Default::default() };
    let p = from_b(late, b"");
    both.claims(Incoming, &p, "B acknowledges the dead incarnation's output");
    let out = both.fp.run(Incoming, &p.buf[..p.len]).unwrap();
    let info = IpInfo::parse(&out.packet).unwrap();
    let t = Tcp::new_checked(&out.packet[info.l4_offset..]).unwrap();
    assert_eq!(t.ack(), Seq(NEW_ISN + 101), "lowered to what the new socket sent, + Δ");
    assert_eq!(both.c.ack_b, A_ISN + 3502, "ackB is B's own");
}

/// *B*'s pure ACK whose SEQ (its SND.NXT) lies beyond the right edge *B* saw from *A* is
/// lowered to that edge; inside the window, and for data, SEQ is never touched.
#[test]
fn pure_acks_beyond_a_recovered_sockets_window_are_brought_inside() {
    let Some(fp) = fast_path("pure_acks_beyond_a_recovered_sockets_window_are_brought_inside") else { return };
    let mut both = Both::new(fp, recovered_told(9000));
    both.claims(Outgoing, &data_from_a(9001, B_ISN + 2001, 100, Some((50, 170)), b""), "A's window");
    let far = Repr { seq: Seq(B_ISN + 60_001), ack: Seq(A_ISN + 3001), flags: F::ACK, window: 300, timestamp: Some((180, 60)), ..Default::default() };
    both.claims(Incoming, &from_b(far, b""), "pure ACK beyond the edge");
    let near = Repr { seq: Seq(B_ISN + 2001), timestamp: Some((181, 60)), ..far };
    both.claims(Incoming, &from_b(near, b""), "pure ACK inside the edge");
    both.claims(Incoming, &from_b(Repr { timestamp: Some((182, 60)), ..far }, b"data"), "data beyond the edge");
}

/// Before any recovery (Δ = 0, no timestamp offset): only O7 and the window change.
#[test]
fn o7_established_connection_without_recovery_matches_the_engine() {
    let Some(fp) = fast_path("o7_established_connection_without_recovery_matches_the_engine") else { return };
    let mut both = Both::new(fp, established());
    for i in 0..5u32 {
        both.claims(Outgoing, &data_from_a(A_ISN + 1 + i * 10, B_ISN + 1 + i * 1000, 500, Some((9001 + i, 101 + i)), &[1u8; 10]), &format!("A's segment {i}"));
        let blocks = [(A_ISN + 1 + i * 10 + 20, A_ISN + 1 + i * 10 + 30)];
        both.claims(Incoming, &ack_from_b(B_ISN + 1 + i * 1000, A_ISN + 1 + i * 10, 502, Some((102 + i, 9001 + i)), &blocks[..(i as usize % 2)]), &format!("B's ACK {i}"));
    }
}

/// The same transforms over IPv6 (the state is the address-free engine state).
#[test]
fn ipv6_packets_after_recovery_match_the_engine() {
    let Some(fp) = fast_path("ipv6_packets_after_recovery_match_the_engine") else { return };
    let mut both = Both::at(fp, recovered_told(NEW_ISN), a6(), b6());
    let out = Repr { src_port: A_PORT, dst_port: B_PORT, seq: Seq(NEW_ISN + 1), ack: Seq(B_ISN + 2500), flags: F::ACK, window: 100, timestamp: Some((25, 150)), ..Default::default() };
    both.claims(Outgoing, &build(a6(), b6(), out, &[3u8; 1200]), "IPv6 O8");
    let (s, n) = sack(&[(A_ISN + 3500, A_ISN + 3600)]);
    let inc = Repr { src_port: B_PORT, dst_port: A_PORT, seq: Seq(B_ISN + 2001), ack: Seq(A_ISN + 3101), flags: F::ACK, window: 500, timestamp: Some((170, 25)), sack: s, sack_len: n, ..Default::default() };
    both.claims(Incoming, &build(b6(), a6(), inc, &[4u8; 700]), "IPv6 I3");
    // An IPv4 packet of the same ports is another connection: no entry.
    both.leaves(Outgoing, &data_from_a(NEW_ISN + 1, B_ISN + 2001, 100, None, b"v4"), "IPv4 twin without an entry");
}

/// Everything the fast path does not handle comes back as the slow path's, untouched.
#[test]
fn slow_path_gets_every_packet_the_fast_path_does_not_claim_untouched() {
    let Some(fp) = fast_path("slow_path_gets_every_packet_the_fast_path_does_not_claim_untouched") else { return };
    let told = recovered_told(NEW_ISN);
    let mut both = Both::new(fp, told);
    let ts = Some((30, 150));
    let a = |r: Repr, pl: &[u8]| from_a(Repr { seq: Seq(NEW_ISN + 1), ack: Seq(B_ISN + 2001), window: 100, timestamp: ts, ..r }, pl);
    let b = |r: Repr, pl: &[u8]| from_b(Repr { seq: Seq(B_ISN + 2001), ack: Seq(A_ISN + 3001), window: 500, timestamp: Some((170, 30)), ..r }, pl);

    // O1, O3-O6, I2: RST, SYN, FIN, no ACK.
    for (what, f) in [("O1 RST", F::RST), ("O1 RST+ACK", F::RST | F::ACK), ("O6 FIN", F::FIN | F::ACK), ("O3 SYN", F::SYN), ("SYN-ACK", F::SYN | F::ACK), ("no ACK", F::PSH)] {
        both.leaves(Outgoing, &a(Repr { flags: f, ..Default::default() }, b""), &format!("outgoing {what}"));
        both.set(told);
        both.leaves(Incoming, &b(Repr { flags: f, ..Default::default() }, b""), &format!("incoming {what}"));
        both.set(told);
    }
    // I1 / O2: an option the engine overwrites with NOPs (MPTCP), a malformed one, a timestamp
    // at an odd offset.
    let mptcp = [30u8, 4, 0, 0];
    let bad_ts = [8u8, 9, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1];
    let odd_ts = [1u8, 8, 10, 0, 0, 0, 1, 0, 0, 0, 2, 1];
    for (what, opts) in [("MPTCP option", &mptcp[..]), ("timestamp of length 9", &bad_ts[..]), ("timestamp at an odd offset", &odd_ts[..])] {
        let r = Repr { seq: Seq(NEW_ISN + 1), ack: Seq(B_ISN + 2001), flags: F::ACK, window: 100, src_port: A_PORT, dst_port: B_PORT, ..Default::default() };
        both.leaves(Outgoing, &with_options(a_ip(), b_ip(), r, opts, b"z"), &format!("outgoing {what}"));
        let r = Repr { seq: Seq(B_ISN + 2001), ack: Seq(A_ISN + 3001), flags: F::ACK, window: 100, src_port: B_PORT, dst_port: A_PORT, ..Default::default() };
        both.leaves(Incoming, &with_options(b_ip(), a_ip(), r, opts, b"z"), &format!("incoming {what}"));
    }
    // Issue 9, item 2: B's checksum does not verify; a segment beyond the window; one entirely
    // below the checkpoint.
    let mut bad = b(Repr { flags: F::ACK, ..Default::default() }, b"bad");
    bad.buf[bad.len - 1] ^= 0x40;
    both.leaves(Incoming, &bad, "incoming with a bad checksum");
    let at = |seq: u32, pl: &[u8]| from_b(Repr { seq: Seq(seq), ack: Seq(A_ISN + 3001), flags: F::ACK, window: 500, timestamp: Some((170, 30)), ..Default::default() }, pl);
    both.leaves(Incoming, &at(B_ISN + 2001 + (0xffff << 7) + 1, b"far"), "incoming beyond the window");
    both.leaves(Incoming, &at(B_ISN + 1001, &[0u8; 100]), "incoming entirely below the checkpoint");
    // Their neighbours inside the window are the fast path's.
    both.claims(Incoming, &at(B_ISN + 2001 + (0xffff << 7), b""), "incoming at the window's end");
    both.claims(Incoming, &at(B_ISN + 1901, &[0u8; 101]), "incoming overlapping the checkpoint");
    // IP options, a fragment, an IPv6 extension header.
    let mut ipopt = a(Repr { flags: F::ACK, ..Default::default() }, b"o");
    ipopt.buf.splice(20..20, [1u8, 1, 1, 0]);
    ipopt.len += 4;
    ipopt.buf[0] = 0x46;
    let total = ipopt.len as u16;
    ipopt.buf[2..4].copy_from_slice(&total.to_be_bytes());
    refill(&mut ipopt);
    both.leaves(Outgoing, &ipopt, "IPv4 options");
    let mut frag = a(Repr { flags: F::ACK, ..Default::default() }, b"f");
    frag.buf[6] |= 0x20;
    ipv4::Packet::new_checked(&mut frag.buf[..frag.len]).unwrap().fill_checksum();
    both.leaves(Outgoing, &frag, "IPv4 fragment (MF)");
    let mut both6 = Both::at(fast_path("slow_path (IPv6)").unwrap(), told, a6(), b6());
    let mut ext = build(a6(), b6(), Repr { src_port: A_PORT, dst_port: B_PORT, seq: Seq(NEW_ISN + 1), ack: Seq(B_ISN + 2001), flags: F::ACK, window: 100, ..Default::default() }, b"e");
    ext.buf.splice(40..40, [6u8, 0, 1, 4, 0, 0, 0, 0]);
    ext.len += 8;
    ext.buf[6] = 0;
    let plen = (ext.len - 40) as u16;
    ext.buf[4..6].copy_from_slice(&plen.to_be_bytes());
    both6.leaves(Outgoing, &ext, "IPv6 hop-by-hop header");
    // No entry for the connection.
    let other = build(a_ip(), b_ip(), Repr { src_port: A_PORT + 1, dst_port: B_PORT, seq: Seq(1), ack: Seq(2), flags: F::ACK, ..Default::default() }, b"");
    both.leaves(Outgoing, &other, "outgoing without an entry");
    // States the fast path leaves alone: a recovery in progress, not synchronized; without a
    // checkpoint, A's packets (O6 resets A) but not B's, which the engine translates as usual.
    let (pinned, _, _) = recovered(NEW_ISN);
    assert_ne!(pinned.flags & flag::ORIGIN_PINNED, 0);
    let no_checkpoint = Conn { flags: told.flags & !(flag::ACK_ALLOWED | flag::ACK_EVERYTHING), ..told };
    for (what, c, incoming_claimed) in [
        ("origin pinned (before TELL)", pinned, false),
        ("SYN pending", Conn { flags: told.flags | flag::SYN_PENDING, ..told }, false),
        ("not synchronized (I0, O6)", Conn { flags: told.flags & !flag::SYNCED, ..told }, false),
        ("no checkpoint (O6)", no_checkpoint, true),
    ] {
        both.set(c);
        both.leaves(Outgoing, &a(Repr { flags: F::ACK, ..Default::default() }, b"s"), &format!("outgoing, {what}"));
        both.set(c);
        let p = b(Repr { flags: F::ACK, ..Default::default() }, b"s");
        if incoming_claimed {
            both.claims(Incoming, &p, &format!("incoming, {what}"));
        } else {
            both.leaves(Incoming, &p, &format!("incoming, {what}"));
        }
    }
    assert_eq!(both.claimed, 3);
}

/// The kernel's own packets (testdata/kernel_tcp.pcap, IPv4 and IPv6, TSO-free, checksums
/// the kernel's), each run as *A*'s and as *B*'s through a recovered state placed around it.
#[test]
fn kernel_packets_through_both_paths() {
    let Some(mut fp) = fast_path("kernel_packets_through_both_paths") else { return };
    let told = recovered_told(NEW_ISN);
    let (mut claimed, mut slow) = (0, 0);
    for (i, pkt) in kernel_pcap::ip_packets().into_iter().enumerate() {
        let info = IpInfo::parse(&pkt).unwrap();
        let t = Tcp::new_checked(&pkt[info.l4_offset..info.l4_offset + info.l4_len]).unwrap();
        let (sp, dp, seq, ack) = (t.src_port(), t.dst_port(), t.seq().0, t.ack().0);
        let mut buf = pkt.clone();
        buf.resize(pkt.len() + 64, 0);
        let p = P { buf, len: pkt.len() };
        for d in [Outgoing, Incoming] {
            let (a, b) = match d {
                Outgoing => (SocketAddr::new(info.src, sp), SocketAddr::new(info.dst, dp)),
                Incoming => (SocketAddr::new(info.dst, dp), SocketAddr::new(info.src, sp)),
            };
            // The checkpoint 100 bytes behind A's ACK (outgoing) or at B's SEQ (incoming); A's
            // socket has sent less than B acknowledges (the ACK is lowered).
            let c = match d {
                Outgoing => Conn { ack_a: ack.wrapping_sub(100), ..told },
                Incoming => Conn { ack_a: seq, a_end: ack.wrapping_sub(5), ..told },
            };
            let key = Key::new(a, b);
            fp.insert(&key, &c).unwrap();
            let mut both = Both { fp, key, c, claimed: 0, slow: 0 };
            both.step(d, &p, &format!("kernel packet {i} {d:?}"));
            claimed += both.claimed;
            slow += both.slow;
            fp = both.fp;
        }
    }
    // 32 packets twice: the handshakes' SYNs and the FINs go to the slow path, the rest is claimed.
    assert!(claimed >= 40, "claimed {claimed}, slow {slow}");
    assert!(slow >= 8, "claimed {claimed}, slow {slow}");
}

/// xorshift64: deterministic, so a failing case replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
    fn near(&mut self, base: u32, spread: u32) -> u32 {
        base.wrapping_add(self.below(2 * spread as u64 + 1) as u32).wrapping_sub(spread)
    }
}

/// Random states (every field and the flag bits the fast path reads, around the engine's own
/// states) and random packets (both directions and families, flags, options, SACK blocks,
/// payloads, bad checksums): whatever the fast path claims must be the engine's answer, and a
/// good share of them must be claimed.
#[test]
fn random_states_and_packets_agree_with_the_engine() {
    let Some(mut fp) = fast_path("random_states_and_packets_agree_with_the_engine") else { return };
    let seed = std::env::var("FASTPATH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_2201u64);
    let cases: usize = std::env::var("FASTPATH_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let mut rng = Rng(seed);
    let bases = [established(), recovered_told(NEW_ISN), recovered_told(u32::MAX - 2), recovered_told(0x8000_0000)];
    let toggles = [flag::ACK_EVERYTHING, flag::A_WIN_KNOWN, flag::TS_A_KNOWN, flag::TS_B_KNOWN, flag::RECOVERABLE, flag::OPTS_KNOWN, flag::ACK_ALLOWED, flag::FIN_A_SEEN, flag::FIN_B_SEEN];
    let rare = [flag::SYN_PENDING, flag::ORIGIN_PINNED, flag::SYNCED];
    let (mut claimed, mut slow) = (0usize, 0usize);
    for case in 0..cases {
        let mut c = bases[rng.below(bases.len() as u64) as usize];
        if rng.chance(500) {
            c.delta = rng.next() as u32;
        }
        if rng.chance(300) {
            c.ts_off = if rng.chance(300) { 0 } else { rng.next() as u32 };
        }
        if rng.chance(300) {
            c.ws = rng.next() as u8;
            c.ws_cur = rng.next() as u8;
        }
        if rng.chance(300) {
            c.a_win = rng.next() as u16;
        }
        c.a_end = rng.near(c.a_end, 5000);
        c.ack_a = rng.near(c.ack_a, 5000);
        c.ack_b = rng.near(c.ack_b, 5000);
        c.ts_a = rng.near(c.ts_a, 50);
        c.ts_b = rng.near(c.ts_b, 50);
        for f in toggles {
            if rng.chance(100) {
                c.flags ^= f;
            }
        }
        for f in rare {
            if rng.chance(20) {
                c.flags ^= f;
            }
        }
        let d = if rng.chance(500) { Outgoing } else { Incoming };
        let v6 = rng.chance(250);
        let (a, b) = if v6 { (a6(), b6()) } else { (a_ip(), b_ip()) };
        let flags = match rng.below(20) {
            0 => F::SYN,
            1 => F::FIN | F::ACK,
            2 => F::RST | F::ACK,
            3 => F::PSH,
            4 => F::ACK | F::URG,
            _ => F::ACK | if rng.chance(500) { F::PSH } else { 0 },
        };
        // SEQ and ACK in each direction's terms (A's new sequence space is B's view + Δ).
        let (seq, ack) = match d {
            Outgoing => (rng.near(c.ack_b.wrapping_add(c.delta), 3000), rng.near(c.ack_a, 3000)),
            Incoming => (rng.near(c.ack_a, 3000), rng.near(c.ack_b, 3000)),
        };
        let ts = rng.chance(700).then(|| (rng.near(if d == Outgoing { c.ts_a.wrapping_sub(c.ts_off) } else { c.ts_b }, 20), if rng.chance(50) { 0 } else { rng.next() as u32 }));
        let max_blocks = if ts.is_some() { 3 } else { 4 };
        let n_blocks = if rng.chance(300) { 1 + rng.below(max_blocks) as usize } else { 0 };
        let blocks: Vec<(u32, u32)> = (0..n_blocks).map(|_| {
            let l = rng.near(ack, 4000);
            (l, l.wrapping_add(rng.below(3000) as u32))
        }).collect();
        let (sack, sack_len) = sack(&blocks);
        let len = match rng.below(4) {
            0 => 0,
            1 => rng.below(64) as usize,
            2 => rng.below(1460) as usize,
            _ => rng.below(3400) as usize,
        };
        let payload: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        let (src, dst, sp, dp) = match d {
            Outgoing => (a, b, A_PORT, B_PORT),
            Incoming => (b, a, B_PORT, A_PORT),
        };
        let r = Repr { src_port: sp, dst_port: dp, seq: Seq(seq), ack: Seq(ack), flags, window: rng.next() as u16, timestamp: ts, sack, sack_len, ..Default::default() };
        let mut p = build(src, dst, r, &payload);
        if rng.chance(30) {
            let at = 20 + rng.below((p.len - 20) as u64) as usize;
            p.buf[at] ^= 1 << rng.below(8);
        }
        let key = Key::new(SocketAddr::new(a, A_PORT), SocketAddr::new(b, B_PORT));
        fp.insert(&key, &c).unwrap();
        let mut both = Both { fp, key, c, claimed: 0, slow: 0 };
        both.step(d, &p, &format!("case {case} (FASTPATH_SEED={seed}), state {c:?}, {d:?} {r:?}, {len} bytes"));
        claimed += both.claimed;
        slow += both.slow;
        fp = both.fp;
        fp.remove(&key).unwrap();
    }
    eprintln!("random_states_and_packets_agree_with_the_engine: {cases} cases, {claimed} claimed, {slow} left to the slow path");
    assert!(claimed > cases / 4, "the fast path claimed only {claimed} of {cases}");
    assert!(slow > cases / 20, "the fast path left only {slow} of {cases} to the slow path");
}

fn key_ab() -> Key {
    Key::new(SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT))
}

/// The hand-off between the paths (bpf/checkpoint/rtcp_state.h): a packet the fast path leaves
/// to the slow path freezes the entry; while frozen, every packet of the connection goes the
/// slow way, counted, and nothing in the entry changes; the daemon takes the state (Take for a
/// counted packet, Freeze otherwise) and gives it back (Thaw) only when it took every counted
/// packet, the state it wrote then being what the fast path continues from.
#[test]
fn handoff_freezes_at_the_first_slow_packet_and_thaws_only_when_nothing_is_between_the_paths() {
    use unbroken_drivers::fastpath::checkpoint::{ctl, Entry, Op, OpResult};
    let Some(mut fp) = fast_path("handoff_freezes_at_the_first_slow_packet_and_thaws_only_when_nothing_is_between_the_paths") else { return };
    let told = recovered_told(NEW_ISN);
    let key = key_ab();
    assert!(fp.install(&key, &Entry::new(&told, None, None)).unwrap());
    assert!(!fp.install(&key, &Entry::new(&Conn::default(), None, None)).unwrap(), "a second install leaves the entry alone");
    assert_eq!(fp.get(&key).unwrap(), Some(told));
    let c0 = fp.counters().unwrap();
    let data = |seq: u32| data_from_a(seq, B_ISN + 2001, 100, Some((30, 150)), b"data");
    assert_eq!(fp.run(Outgoing, &data(NEW_ISN + 1).buf[..data(NEW_ISN + 1).len]).unwrap().verdict, Verdict::Done);
    let e1 = fp.entry(&key).unwrap().unwrap();
    assert_eq!((e1.ctl, e1.slow, e1.seen), (0, 0, 0));
    // O6: a FIN goes slow and freezes the entry.
    let fin = from_a(Repr { seq: Seq(NEW_ISN + 5), ack: Seq(B_ISN + 2001), flags: F::FIN | F::ACK, window: 100, timestamp: Some((31, 150)), ..Default::default() }, b"");
    assert_eq!(fp.run(Outgoing, &fin.buf[..fin.len]).unwrap().verdict, Verdict::Slow);
    let e2 = fp.entry(&key).unwrap().unwrap();
    assert_eq!((e2.ctl, e2.slow, e2.state), (ctl::FROZEN, 1, e1.state));
    // Frozen: a packet the fast path would claim goes slow, untouched, counted; B's too.
    let d2 = data(NEW_ISN + 5);
    let run = fp.run(Outgoing, &d2.buf[..d2.len]).unwrap();
    assert_eq!((run.verdict, hex(&run.packet)), (Verdict::Slow, hex(&d2.buf[..d2.len])));
    let b = ack_from_b(B_ISN + 2001, A_ISN + 3001, 500, Some((170, 30)), &[]);
    assert_eq!(fp.run(Incoming, &b.buf[..b.len]).unwrap().verdict, Verdict::Slow);
    let e3 = fp.entry(&key).unwrap().unwrap();
    assert_eq!((e3.slow, e3.state), (3, e1.state), "frozen: counted, the state unchanged");
    // The daemon takes the first packet: the state is the fast path's newest (USER was clear).
    let t1 = fp.op(Op::Take, &key, None).unwrap();
    assert_eq!((t1.result, t1.ctl_before, t1.entry.seen), (OpResult::Done, ctl::FROZEN, 1));
    assert_eq!(t1.entry.ctl, ctl::FROZEN | ctl::USER);
    assert_eq!(t1.entry.conn(), e1.conn());
    // Giving it back now would let two counted packets still in the queue be overtaken.
    let mut mine = t1.entry;
    mine.state.ack_a = mine.state.ack_a.wrapping_add(100);
    assert_eq!(fp.op(Op::Thaw, &key, Some(&mine)).unwrap().result, OpResult::Stale);
    assert_eq!(fp.entry(&key).unwrap().unwrap().state, e1.state, "a refused thaw writes nothing");
    let t2 = fp.op(Op::Take, &key, None).unwrap();
    assert_eq!(t2.ctl_before, ctl::FROZEN | ctl::USER, "the second take says the daemon's copy is the newest");
    fp.op(Op::Take, &key, None).unwrap();
    let th = fp.op(Op::Thaw, &key, Some(&mine)).unwrap();
    assert_eq!(th.result, OpResult::Done);
    assert_eq!((th.entry.ctl, th.entry.conn()), (0, mine.conn()));
    // The fast path continues from the state the daemon wrote: the checkpoint it raised.
    let d3 = data(NEW_ISN + 9);
    let mut both = Both { fp, key, c: mine.conn(), claimed: 0, slow: 0 };
    both.claims(Outgoing, &d3, "after the thaw, from the daemon's state");
    let mut fp = both.fp;
    // A command: Freeze (not counted) and Thaw at once.
    let f = fp.op(Op::Freeze, &key, None).unwrap();
    assert_eq!((f.ctl_before, f.entry.ctl), (0, ctl::FROZEN | ctl::USER));
    let cur = f.entry;
    assert_eq!(fp.op(Op::Thaw, &key, Some(&cur)).unwrap().result, OpResult::Done);
    // A counted packet that never reached the daemon: only ThawForce gives the entry back.
    assert_eq!(fp.run(Outgoing, &fin.buf[..fin.len]).unwrap().verdict, Verdict::Slow);
    assert_eq!(fp.op(Op::Thaw, &key, Some(&cur)).unwrap().result, OpResult::Stale);
    let forced = fp.op(Op::ThawForce, &key, Some(&cur)).unwrap();
    assert_eq!((forced.result, forced.entry.ctl, forced.entry.seen, forced.entry.slow), (OpResult::Done, 0, 4, 4));
    // No entry.
    fp.remove(&key).unwrap();
    assert_eq!(fp.op(Op::Take, &key, None).unwrap().result, OpResult::NoEntry);
    let c1 = fp.counters().unwrap();
    assert_eq!((c1.outgoing - c0.outgoing, c1.slow - c0.slow), (2, 4));
}

/// The guard's own checks around the engine (crates/control guard::Core::packet_with) on the
/// fast path: B cannot acknowledge beyond the end of what A ever sent (RFC 5961 section 5.2: the
/// slow path drops it), which A's claimed packets raise; the highest segment from B is kept
/// for the recovery nudge; the application's unprotected mark goes to the slow path.
#[test]
fn hostile_peer_ack_beyond_a_hi_and_the_unprotected_mark_go_the_slow_way() {
    use unbroken_drivers::fastpath::checkpoint::{ctl, Entry};
    let Some(mut fp) = fast_path("hostile_peer_ack_beyond_a_hi_and_the_unprotected_mark_go_the_slow_way") else { return };
    let told = recovered_told(NEW_ISN);
    let key = key_ab();
    let hi = A_ISN + 3001;
    assert!(fp.install(&key, &Entry::new(&told, Some(hi), None)).unwrap());
    let b_ack = |ack: u32, seq: u32, payload: &[u8]| from_b(Repr { seq: Seq(seq), ack: Seq(ack), flags: F::ACK, window: 500, timestamp: Some((170, 30)), ..Default::default() }, payload);
    let beyond = b_ack(hi + 1, B_ISN + 2001, b"");
    assert_eq!(fp.run(Incoming, &beyond.buf[..beyond.len]).unwrap().verdict, Verdict::Slow, "an ACK beyond a_hi");
    // (It froze the entry: start again.)
    fp.remove(&key).unwrap();
    assert!(fp.install(&key, &Entry::new(&told, Some(hi), None)).unwrap());
    let at = b_ack(hi, B_ISN + 2001, b"0123456789");
    assert_eq!(fp.run(Incoming, &at.buf[..at.len]).unwrap().verdict, Verdict::Done, "an ACK at a_hi");
    let e = fp.entry(&key).unwrap().unwrap();
    assert_eq!((e.ctl, e.peer()), (ctl::A_HI | ctl::PEER, Some((B_ISN + 2001, B_ISN + 2011))));
    // A pure ACK stands for an MSS-long segment ending at its SEQ; a lower one changes nothing.
    let pure = b_ack(hi, B_ISN + 2011, b"");
    assert_eq!(fp.run(Incoming, &pure.buf[..pure.len]).unwrap().verdict, Verdict::Done);
    assert_eq!(fp.entry(&key).unwrap().unwrap().peer(), Some((B_ISN + 2001, B_ISN + 2011)), "not beyond the highest end");
    let mss = told.b_mss.max(536) as u32;
    let later = b_ack(hi, B_ISN + 2111, b"");
    assert_eq!(fp.run(Incoming, &later.buf[..later.len]).unwrap().verdict, Verdict::Done);
    assert_eq!(fp.entry(&key).unwrap().unwrap().peer(), Some((B_ISN + 2111 - mss, B_ISN + 2111)));
    // A's data raises a_hi (in B's sequence space: after O8).
    let d = data_from_a(NEW_ISN + 1, B_ISN + 2001, 100, Some((30, 150)), &[7u8; 50]);
    assert_eq!(fp.run(Outgoing, &d.buf[..d.len]).unwrap().verdict, Verdict::Done);
    let seq_b = (NEW_ISN + 1).wrapping_sub(told.delta);
    assert_eq!(fp.entry(&key).unwrap().unwrap().a_hi(), Some(seq_b.wrapping_add(50)).filter(|v| Seq(*v).gt(Seq(hi))).or(Some(hi)));
    // The unprotected mark (DSCP) goes slow.
    let mut m = data_from_a(NEW_ISN + 51, B_ISN + 2001, 100, Some((31, 150)), b"x");
    m.buf[1] = unbroken_wire::ctl::UNPROTECTED_DSCP << 2;
    refill(&mut m);
    assert_eq!(fp.run(Outgoing, &m.buf[..m.len]).unwrap().verdict, Verdict::Slow, "the unprotected mark");
}

/// A packet built on this host and handed over before its checksum was completed
/// (CHECKSUM_PARTIAL: the field holds the pseudo-header's sum, as on a veth from a namespace)
/// is taken on the fast path as the slow path takes it (NFQUEUE's csum_not_ready); one whose
/// checksum is simply wrong goes slow.
#[test]
fn partial_checksums_from_this_host_as_the_slow_path_takes_them() {
    let Some(fp) = fast_path("partial_checksums_from_this_host_as_the_slow_path_takes_them") else { return };
    let mut both = Both::new(fp, recovered_told(NEW_ISN));
    let mut p = from_b(Repr { seq: Seq(B_ISN + 2001), ack: Seq(A_ISN + 3001), flags: F::ACK, window: 500, timestamp: Some((170, 30)), ..Default::default() }, &[9u8; 300]);
    let info = IpInfo::parse(&p.buf[..p.len]).unwrap();
    let partial = unbroken_wire::checksum::fold(info.pseudo_sum(info.l4_len));
    let at = info.l4_offset + 16;
    p.buf[at..at + 2].copy_from_slice(&partial.to_be_bytes());
    assert!(matches!(peer_checksum(&p.buf[..p.len], &info), PeerChecksum::Partial));
    both.claims(Incoming, &p, "a partial checksum");
    p.buf[at] ^= 0x10;
    both.leaves(Incoming, &p, "neither partial nor right");
}

/// RTCP C2 in the kernel (Op::Acknowledge): for a connection the programs own, the checkpoint
/// raised in place leaves the entry exactly as rtcp::command's ACKNOWLEDGE leaves the engine's
/// state (ackA, and the window shrunk by the advance), over random states and checkpoints; it
/// is refused (nothing changed) where C2 would change more (no checkpoint yet, options not
/// known) and on a frozen entry.
#[test]
fn c2_acknowledge_in_the_kernel_is_the_engines() {
    use unbroken_drivers::fastpath::checkpoint::{Entry, Op as MapOp, OpResult};
    let Some(mut fp) = fast_path("c2_acknowledge_in_the_kernel_is_the_engines") else { return };
    let key = key_ab();
    let mut rng = Rng(0xacc0_2202);
    let bases = [established(), recovered_told(NEW_ISN), recovered_told(u32::MAX - 2)];
    let (mut done, mut refused) = (0, 0);
    for case in 0..3000 {
        let mut c = bases[rng.below(bases.len() as u64) as usize];
        c.ack_a = rng.next() as u32;
        c.a_win = rng.next() as u16;
        c.ws = rng.next() as u8;
        for f in [flag::ACK_ALLOWED, flag::OPTS_KNOWN, flag::A_WIN_KNOWN] {
            if rng.chance(150) {
                c.flags ^= f;
            }
        }
        let ack = rng.near(c.ack_a, 200_000);
        let frozen = rng.chance(50);
        fp.remove(&key).unwrap();
        assert!(fp.install(&key, &Entry::new(&c, None, None)).unwrap());
        if frozen {
            fp.op(MapOp::Freeze, &key, None).unwrap();
        }
        let mut req = Entry::new(&c, None, None);
        req.state.ack_a = ack;
        let ans = fp.op(MapOp::Acknowledge, &key, Some(&req)).unwrap();
        let mut engine = c;
        let mut cmd = Command::request(Op::Acknowledge, SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT), case as u64, 1);
        cmd.ack_a = ack;
        let mut buf = [0u8; 128];
        rtcp::command(&mut engine, &cmd, &mut buf);
        let light = c.flags & (flag::ACK_ALLOWED | flag::OPTS_KNOWN) == flag::ACK_ALLOWED | flag::OPTS_KNOWN && !frozen;
        if light {
            assert_eq!(ans.result, OpResult::Done, "case {case}: {c:?}");
            assert_eq!(ans.entry.conn(), engine, "case {case}: {c:?}, checkpoint {ack}");
            done += 1;
        } else {
            assert_eq!(ans.result, OpResult::Refused, "case {case}: {c:?}, frozen {frozen}");
            assert_eq!(fp.get(&key).unwrap(), Some(c), "case {case}: refused, yet changed");
            refused += 1;
        }
    }
    assert!(done > 1000 && refused > 300, "{done} done, {refused} refused");
}


/// A packet the stack will drop after tc (TTL or hop limit 1: forwarding drops it; a bad IPv4
/// header checksum; an IPv4-mapped IPv6 address) would, if counted, never be taken: the
/// connection would stay frozen. The programs leave such packets alone without counting them
/// or freezing the entry (a forger on the peer's side cannot hold a connection on the slow
/// path with one packet). And a counted packet taken after ThawForce gave up on it opens no gap.
#[test]
fn hostile_packets_the_stack_drops_freeze_nothing() {
    use unbroken_drivers::fastpath::checkpoint::{Entry, Op as MapOp, OpResult};
    let Some(mut fp) = fast_path("hostile_packets_the_stack_drops_freeze_nothing") else { return };
    let told = recovered_told(NEW_ISN);
    let key = key_ab();
    assert!(fp.install(&key, &Entry::new(&told, None, None)).unwrap());
    let rst = |ttl: u8| {
        let mut p = from_b(Repr { seq: Seq(B_ISN + 2001), ack: Seq(A_ISN + 3001), flags: F::RST | F::ACK, window: 0, ..Default::default() }, b"");
        p.buf[8] = ttl;
        refill(&mut p);
        p
    };
    let mut bad_header = rst(64);
    bad_header.buf[10] ^= 0x01;
    for (what, p) in [("TTL 1", rst(1)), ("TTL 0", rst(0)), ("bad IPv4 header checksum", bad_header)] {
        assert_eq!(fp.run(Incoming, &p.buf[..p.len]).unwrap().verdict, Verdict::Slow, "{what}");
        let e = fp.entry(&key).unwrap().unwrap();
        assert_eq!((e.ctl, e.slow), (0, 0), "{what}: froze or counted");
    }
    // IPv4-mapped IPv6 addresses alias the IPv4 connection's key.
    let mapped = |ip: IpAddr| match ip {
        IpAddr::V4(v4) => IpAddr::V6(v4.to_ipv6_mapped()),
        v6 => v6,
    };
    let m = build(mapped(b_ip()), mapped(a_ip()), Repr { src_port: B_PORT, dst_port: A_PORT, seq: Seq(B_ISN + 2001), ack: Seq(A_ISN + 3001), flags: F::RST, ..Default::default() }, b"");
    assert_eq!(fp.run(Incoming, &m.buf[..m.len]).unwrap().verdict, Verdict::Slow);
    assert_eq!(fp.entry(&key).unwrap().unwrap().slow, 0, "an IPv4-mapped IPv6 packet was counted");
    // A hop limit of 1 on a real IPv6 connection.
    let key6 = Key::new(SocketAddr::new(a6(), A_PORT), SocketAddr::new(b6(), B_PORT));
    assert!(fp.install(&key6, &Entry::new(&told, None, None)).unwrap());
    let mut h = build(b6(), a6(), Repr { src_port: B_PORT, dst_port: A_PORT, seq: Seq(B_ISN + 2001), ack: Seq(A_ISN + 3001), flags: F::RST, ..Default::default() }, b"");
    h.buf[7] = 1;
    assert_eq!(fp.run(Incoming, &h.buf[..h.len]).unwrap().verdict, Verdict::Slow);
    assert_eq!(fp.entry(&key6).unwrap().unwrap().slow, 0, "hop limit 1 was counted");
    // Counted, given up on (ThawForce), then taken late: no gap.
    assert_eq!(fp.run(Incoming, &rst(64).buf[..rst(64).len]).unwrap().verdict, Verdict::Slow);
    let cur = fp.entry(&key).unwrap().unwrap();
    assert_eq!(cur.slow, 1);
    assert_eq!(fp.op(MapOp::ThawForce, &key, Some(&cur)).unwrap().result, OpResult::Done);
    let late = fp.op(MapOp::Take, &key, None).unwrap();
    assert_eq!((late.entry.seen, late.entry.slow), (1, 1));
    assert_eq!(fp.op(MapOp::Thaw, &key, Some(&late.entry)).unwrap().result, OpResult::Done, "a late take opened a gap");
}
