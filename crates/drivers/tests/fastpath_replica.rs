//! Replica mode's fast path, the backup's half, against the engine (issue 22 item 4, step 1):
//! the same packets through `replica::Backup::incoming` / `outgoing` and, by
//! `BPF_PROG_TEST_RUN`, through `bpf/replica/rep_tc.c`. A packet the programs claim must get
//! the engine's verdict and bytes (checksums included), leave the entry holding the engine's
//! per-connection fields, move the counters the engine moves, and send the daemon exactly the
//! checkpoint and kept copy the engine recorded; a packet they leave to the slow path must come
//! back untouched with its entry frozen and counted, and the daemon's hand-off (take, the
//! engine decides, thaw) then puts the engine's state back. The engine's state is read through
//! its fast-path API (`Backup::fast_state`, `side`, `fast_eligible`; the primary's likewise),
//! converted by `State::from_engine` / `PState::from_engine` as the daemon will.
//!
//! Root only, no namespace: SKIP otherwise (UNBROKEN_REQUIRE_LAB=1 makes a skip a failure).

include!("common/require.rs");
include!("common/loaded.rs");

use std::net::IpAddr;

use unbroken_drivers::fastpath::replica::{ctl, Direction, Key, Op, OpResult, Record, Replica, State, CONSUMED};
use unbroken_drivers::fastpath::Verdict;
use unbroken_engines::replica::{Backup, BackupCounters, ConnKey};
use unbroken_engines::Verdict as EVerdict;
use unbroken_wire::ip::{self, IpInfo};
use unbroken_wire::replica::{self as rw, ConnProgress, Progress, Role};
use unbroken_wire::tcp::{flags as F, Packet as Tcp, Repr};
use unbroken_wire::{ipv4, Seq};

use Direction::{Incoming, Outgoing};

fn fast_path(test: &str) -> Option<Replica> {
    loaded_or_skip(test, Replica::load())
}

const CPORT: u16 = 40000;
const SPORT: u16 = 6379;

// ---------------------------------------------------------------------------------------------
// The engine's state, through its fast-path API
// ---------------------------------------------------------------------------------------------

/// What the engine keeps about the connection beyond the entry: checkpoints, kept copies (end,
/// length), output kept beyond a gap.
#[derive(Debug, Clone, PartialEq)]
struct Side {
    checkpoints: Vec<(u32, u64)>,
    kept: Vec<(u32, usize)>,
    /// Where the engine's copy of the client's bytes for the primary ends.
    input_end: Option<u32>,
}

fn side(b: &Backup, key: &ConnKey) -> Side {
    let s = b.side(key).expect("one connection in the engine");
    Side { checkpoints: s.checkpoints.iter().map(|(e, h)| (e.0, *h)).collect(), kept: s.kept.iter().map(|(e, n)| (e.0, *n)).collect(), input_end: s.input_end.map(|e| e.0) }
}

/// The entry's state as the engine's fields give it (`b_ts_at` is the kernel's clock: taken
/// from `kernel_ts_at`).
fn state_of(b: &Backup, key: &ConnKey, strict: bool, kernel_ts_at: u64) -> State {
    State::from_engine(&b.fast_state(key).expect("one connection in the engine"), strict, kernel_ts_at)
}

// ---------------------------------------------------------------------------------------------
// Packets
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy)]
struct Conn {
    cli: IpAddr,
    svc: IpAddr,
    c_isn: u32,
    p_isn: u32,
    b_isn: u32,
    p_ts0: u32,
    b_ts0: u32,
}

impl Conn {
    fn v4() -> Conn {
        Conn { cli: "10.0.9.2".parse().unwrap(), svc: "10.0.0.1".parse().unwrap(), c_isn: 77_777, p_isn: 0xffff_f000, b_isn: 1_000, p_ts0: 4_000_000_000, b_ts0: 12 }
    }
    fn v6() -> Conn {
        Conn { cli: "fd77:9::2".parse().unwrap(), svc: "fd77::1".parse().unwrap(), ..Conn::v4() }
    }
    fn key(&self) -> Key {
        Key::new(std::net::SocketAddr::new(self.cli, CPORT), SPORT)
    }
    fn from_client(&self, r: Repr, payload: &[u8]) -> Vec<u8> {
        ip::tcp_packet(self.cli, self.svc, &Repr { src_port: CPORT, dst_port: SPORT, ..r }, payload).unwrap()
    }
    fn from_server(&self, r: Repr, payload: &[u8]) -> Vec<u8> {
        ip::tcp_packet(self.svc, self.cli, &Repr { src_port: SPORT, dst_port: CPORT, ..r }, payload).unwrap()
    }
    /// Client → backup: its ACK names the primary's output offset `out` (from its ISN + 1).
    fn client(&self, seq_off: u32, out: u32, ts: Option<(u32, u32)>, sack: &[(u32, u32)], payload: &[u8]) -> Vec<u8> {
        let p = |x: u32| Seq(self.p_isn.wrapping_add(1).wrapping_add(x));
        let mut r = Repr { seq: Seq(self.c_isn.wrapping_add(1).wrapping_add(seq_off)), ack: p(out), flags: F::ACK | F::PSH, window: 512, timestamp: ts, ..Default::default() };
        for (i, (l, h)) in sack.iter().enumerate() {
            r.sack[i] = (p(*l), p(*h));
        }
        r.sack_len = sack.len() as u8;
        self.from_client(r, payload)
    }
    /// The backup's server: its output from stream offset `off`, acknowledging client offset
    /// `rcv`.
    fn server(&self, off: u32, rcv: u32, window: u16, ts: Option<(u32, u32)>, payload: &[u8]) -> Vec<u8> {
        self.server_from(self.b_isn, off, rcv, window, ts, payload)
    }
    /// The primary's server, the same way.
    fn pserver(&self, off: u32, rcv: u32, window: u16, ts: Option<(u32, u32)>, payload: &[u8]) -> Vec<u8> {
        self.server_from(self.p_isn, off, rcv, window, ts, payload)
    }
    fn server_from(&self, isn: u32, off: u32, rcv: u32, window: u16, ts: Option<(u32, u32)>, payload: &[u8]) -> Vec<u8> {
        let r = Repr { seq: Seq(isn.wrapping_add(1).wrapping_add(off)), ack: Seq(self.c_isn.wrapping_add(1).wrapping_add(rcv)), flags: F::ACK | if payload.is_empty() { 0 } else { F::PSH }, window, timestamp: ts, ..Default::default() };
        self.from_server(r, payload)
    }
}

fn refill(p: &mut [u8]) {
    let info = IpInfo::parse(p).unwrap();
    if info.src.is_ipv4() {
        ipv4::Packet::new_checked(&mut p[..]).unwrap().fill_checksum();
    }
    let (l4, n) = (info.l4_offset, info.l4_len);
    Tcp::new_checked(&mut p[l4..l4 + n]).unwrap().fill_checksum(info.pseudo_sum(n));
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

// ---------------------------------------------------------------------------------------------
// Both paths
// ---------------------------------------------------------------------------------------------

/// One connection on the engine and on the programs, the daemon's hand-off emulated.
struct Both {
    fp: Replica,
    b: Backup,
    conn: Conn,
    key: Key,
    /// The same connection's key in the engine.
    ek: ConnKey,
    strict: bool,
    claimed: usize,
    slow: usize,
    /// The entry is frozen and the daemon's (not eligible to go back).
    held: bool,
}

impl Both {
    /// ST-TCP 3.3.0.1 (1)-(3) on the engine (the slow path's work), then the entry installed
    /// from its state, as the daemon will.
    fn new(mut fp: Replica, conn: Conn, strict: bool, ts: bool) -> Both {
        let mut b = Backup::new();
        b.set_strict(strict);
        let key = conn.key();
        fp.remove(&key).unwrap();
        let syn = conn.from_client(Repr { seq: Seq(conn.c_isn), flags: F::SYN, window: 65535, mss: Some(1460), wscale: Some(7), sack_perm: true, timestamp: ts.then_some((500, 0)), ..Default::default() }, &[]);
        assert_eq!(b.incoming(&mut syn.clone()), EVerdict::PASS);
        let sa = conn.from_server(Repr { seq: Seq(conn.b_isn), ack: Seq(conn.c_isn.wrapping_add(1)), flags: F::SYN | F::ACK, window: 65535, mss: Some(1460), wscale: Some(7), sack_perm: true, timestamp: ts.then_some((conn.b_ts0, 500)), ..Default::default() }, &[]);
        assert_eq!(b.outgoing(&mut sa.clone()), EVerdict::Drop);
        let ack = conn.from_client(Repr { seq: Seq(conn.c_isn.wrapping_add(1)), ack: Seq(conn.p_isn.wrapping_add(1)), flags: F::ACK, window: 512, timestamp: ts.then_some((501, conn.p_ts0)), ..Default::default() }, &[]);
        assert!(matches!(b.incoming(&mut ack.clone()), EVerdict::Accept { .. }));
        assert_eq!(b.counters.aligned, 1);
        let rec = ConnProgress { client: conn.cli, client_port: CPORT, server_port: SPORT, rcv_nxt: Seq(conn.c_isn.wrapping_add(1)), rcv_edge: Seq(conn.c_isn.wrapping_add(1000)), out_end: Seq(0), out_hash: 0, last_ack: Seq(0), isn: Seq(conn.p_isn), flags: rw::flag::RCV_KNOWN | rw::flag::ISN_KNOWN };
        b.primary_report(&Progress { role: Role::Primary, beat: 1, flags: 0, records: vec![rec] });
        let ek = ConnKey { client: conn.cli, client_port: CPORT, server_port: SPORT };
        assert!(b.fast_eligible(&ek), "aligned: the fast path may carry it");
        let st = state_of(&b, &ek, strict, 0);
        assert!(fp.install(&key, &st).unwrap());
        let _ = fp.records();
        Both { fp, b, conn, key, ek, strict, claimed: 0, slow: 0, held: false }
    }

    fn kernel_state(&mut self) -> State {
        self.fp.entry(&self.key).unwrap().expect("an entry").state
    }

    /// `pkt` through both paths, compared (module docs). Returns the programs' verdict.
    fn step(&mut self, d: Direction, pkt: &[u8], what: &str) -> Verdict {
        let before = self.fp.entry(&self.key).unwrap();
        let side0 = side(&self.b, &self.ek);
        let c0: BackupCounters = self.b.counters;
        let k0 = self.fp.counters().unwrap();
        let run = self.fp.run(d, pkt).unwrap();
        let recs = self.fp.records();
        let mut buf = pkt.to_vec();
        let v = match d {
            Incoming => self.b.incoming(&mut buf),
            Outgoing => self.b.outgoing(&mut buf),
        };
        let side1 = side(&self.b, &self.ek);
        let c1 = self.b.counters;
        let k1 = self.fp.counters().unwrap();
        // rep_b_in drops by decision with TC_ACT_SHOT (TCX ignores STOLEN); rep_b_out consumes.
        let consumed = run.verdict == CONSUMED || (d == Incoming && run.verdict == Verdict::Drop);
        let claimed = run.verdict == Verdict::Done || consumed;
        if claimed {
            let before = before.expect("claimed without an entry");
            match (run.verdict, v) {
                (Verdict::Done, EVerdict::Accept { .. }) => assert_eq!(hex(&run.packet), hex(&buf), "{what}: the fast path's bytes differ from the engine's"),
                (_, EVerdict::Drop) if consumed => {}
                (a, b) => panic!("{what}: the fast path says {a:?}, the engine {b:?}"),
            }
            let k = self.kernel_state();
            assert_eq!(k, state_of(&self.b, &self.ek, self.strict, k.b_ts_at), "{what}: the entry differs from the engine's state");
            if d == Outgoing && before.state.b_ts_val != k.b_ts_val {
                assert_ne!(k.b_ts_at, before.state.b_ts_at, "{what}: b_ts_seen's time not taken");
            }
            assert_eq!((k1.unacceptable - k0.unacceptable, k1.ack_unverified - k0.ack_unverified, k1.ack_clamped - k0.ack_clamped, k1.withheld - k0.withheld), (c1.unacceptable - c0.unacceptable, c1.ack_unverified - c0.ack_unverified, c1.ack_clamped - c0.ack_clamped, c1.withheld - c0.withheld), "{what}: counters");
            // The records: the engine's new checkpoints, its new kept copy (the packet), and
            // the change, once per collection.
            let new_cps: Vec<(u32, u64)> = side1.checkpoints[side0.checkpoints.len().min(side1.checkpoints.len())..].to_vec();
            let cps: Vec<(u32, u64)> = recs.iter().filter_map(|r| if let Record::Checkpoint { key, end, hash } = r { assert_eq!(*key, self.key); Some((*end, *hash)) } else { None }).collect();
            assert_eq!(cps, new_cps, "{what}: checkpoints");
            let mut kept = vec![];
            let mut kept_end = None;
            for r in &recs {
                if let Record::Keep { key, end_b, total, off, bytes, .. } = r {
                    assert_eq!(*key, self.key);
                    assert_eq!(*off as usize, kept.len(), "{what}: pieces in order");
                    assert_eq!(*total as usize, pkt.len());
                    kept.extend_from_slice(bytes);
                    kept_end = Some(*end_b);
                }
            }
            // The client's bytes rep_b_in passed: one packet's pieces, in order, the packet the
            // server got (a copy for the primary).
            let mut input = vec![];
            let mut input_of = None;
            for r in &recs {
                if let Record::Input { key, total, off, of, bytes } = r {
                    assert_eq!(*key, self.key);
                    assert_eq!(*off as usize, input.len(), "{what}: input pieces in order");
                    assert!(input_of.is_none_or(|o| o == *of), "{what}: input pieces of two packets");
                    input_of = Some(*of);
                    assert_eq!(*total as usize, pkt.len());
                    input.extend_from_slice(bytes);
                }
            }
            // The engine keeps a copy of every withheld segment with payload, unless beyond its
            // bounds (counted).
            let payload = IpInfo::parse(pkt).ok().map(|i| i.l4_len - Tcp::new_checked(&pkt[i.l4_offset..i.l4_offset + i.l4_len]).unwrap().header_len()).unwrap_or(0);
            let engine_kept = d == Outgoing && payload > 0 && c1.kept_dropped == c0.kept_dropped;
            if engine_kept {
                let (end, len) = *side1.kept.last().unwrap();
                assert_eq!(kept_end, Some(end), "{what}: kept copy's end");
                assert_eq!(len, pkt.len());
                assert_eq!(hex(&kept), hex(pkt), "{what}: the kept copy is the packet");
            } else {
                assert!(kept.is_empty(), "{what}: a copy the engine did not keep");
            }
            if !input.is_empty() {
                assert_eq!((d, run.verdict), (Incoming, Verdict::Done), "{what}: an input copy of a packet not passed to the server");
                assert_eq!(hex(&input), hex(&run.packet), "{what}: the input copy is the packet the server got");
            }
            if side1.input_end != side0.input_end {
                assert!(!input.is_empty(), "{what}: the engine copied client bytes the programs did not");
            }
            let changed = recs.iter().filter(|r| matches!(r, Record::Changed(_))).count();
            let expect = (d == Outgoing && before.ctl & unbroken_drivers::fastpath::replica::ctl::CHANGED == 0) as usize;
            assert_eq!(changed, expect, "{what}: change records");
            self.claimed += 1;
        } else {
            assert_eq!(run.verdict, Verdict::Slow, "{what}: unexpected verdict");
            assert_eq!(hex(&run.packet), hex(pkt), "{what}: left to the slow path, but modified");
            assert!(recs.is_empty(), "{what}: records for a packet left to the slow path");
            if let Some(e0) = before {
                let e1 = self.fp.entry(&self.key).unwrap().unwrap();
                assert_eq!(e1.state, e0.state, "{what}: left to the slow path, but the entry changed");
                // A packet the programs could not parse far enough to name its connection (IP
                // options, fragments, extension headers, truncated or not TCP) is neither counted
                // nor marked: the daemon freezes the entry before its engine decides it (as
                // checkpoint mode's guard does); one they named is counted and marked, and taken.
                let marked = e1.slow == e0.slow + 1;
                if marked {
                    assert!(e1.ctl & unbroken_drivers::fastpath::replica::ctl::FROZEN != 0, "{what}: not frozen");
                } else {
                    assert_eq!((e1.slow, e1.ctl), (e0.slow, e0.ctl), "{what}: the entry changed");
                    assert!(unparsable(pkt), "{what}: a parsable packet of the connection left unmarked");
                }
                // The daemon takes it, decides it with the engine (done above), and gives the
                // connection back if it can.
                let a = self.fp.op(if marked { Op::Take } else { Op::Freeze }, &self.key, None).unwrap();
                assert_eq!(a.result, OpResult::Done);
                if !self.held {
                    let k = a.entry.state;
                    assert_eq!(k, State { b_ts_at: k.b_ts_at, ..state_of_before(&e0) }, "{what}: taken state");
                }
                self.give_back(what);
            }
            self.slow += 1;
        }
        run.verdict
    }

    /// The daemon's THAW with the engine's state when the connection is eligible (aligned, no
    /// output kept beyond a gap); otherwise it stays frozen and the daemon's.
    fn give_back(&mut self, what: &str) {
        if !self.b.fast_eligible(&self.ek) {
            self.held = true;
            return;
        }
        let k = self.fp.entry(&self.key).unwrap().unwrap().state;
        let st = state_of(&self.b, &self.ek, self.strict, k.b_ts_at);
        let a = self.fp.op(Op::Thaw, &self.key, Some(&st)).unwrap();
        assert_eq!(a.result, OpResult::Done, "{what}: thaw refused with nothing between the paths");
        self.held = false;
    }

    /// A side-channel message the daemon applies to the engine: freeze, engine, thaw.
    fn primary_report(&mut self, p_out: u32, last_ack: u32, what: &str) {
        let a = self.fp.op(Op::Freeze, &self.key, None).unwrap();
        assert_eq!(a.result, OpResult::Done);
        if !self.held {
            let k = a.entry.state;
            assert_eq!(k, state_of(&self.b, &self.ek, self.strict, k.b_ts_at), "{what}: frozen state");
        }
        let c = self.conn;
        let rec = ConnProgress { client: c.cli, client_port: CPORT, server_port: SPORT, rcv_nxt: Seq(c.c_isn.wrapping_add(1)), rcv_edge: Seq(c.c_isn.wrapping_add(1000)), out_end: Seq(c.p_isn.wrapping_add(1).wrapping_add(p_out)), out_hash: 0, last_ack: Seq(c.p_isn.wrapping_add(1).wrapping_add(last_ack)), isn: Seq(c.p_isn), flags: rw::flag::RCV_KNOWN | rw::flag::ISN_KNOWN };
        self.b.primary_report(&Progress { role: Role::Primary, beat: 2, flags: 0, records: vec![rec] });
        self.give_back(what);
    }

    fn claims(&mut self, d: Direction, pkt: &[u8], what: &str) {
        let v = self.step(d, pkt, what);
        assert!(v == Verdict::Done || v == CONSUMED || (d == Incoming && v == Verdict::Drop), "{what}: expected the fast path to claim it, got {v:?}");
    }

    fn leaves(&mut self, d: Direction, pkt: &[u8], what: &str) {
        assert_eq!(self.step(d, pkt, what), Verdict::Slow, "{what}: expected the slow path");
    }
}

/// Whether `fp_parse` refuses `pkt` (no connection named): what the engine's parser calls
/// malformed or unsupported, IP options, not TCP, a TCP header that does not fit.
fn unparsable(pkt: &[u8]) -> bool {
    let Ok(i) = IpInfo::parse(pkt) else { return true };
    if i.protocol != ip::PROTO_TCP || (i.l4_offset != 20 && i.l4_offset != 40) || pkt.len() < i.l4_offset + i.l4_len || i.l4_len < 20 {
        return true;
    }
    let doff = (pkt[i.l4_offset + 12] >> 4) as usize * 4;
    doff < 20 || doff > i.l4_len
}

/// The state an entry held (for comparing a taken state with the engine's before the packet).
fn state_of_before(e: &unbroken_drivers::fastpath::replica::Entry) -> State {
    e.state
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

/// ST-TCP 3.3.1 / Koch 3.1 in the steady state: the backup's server answers requests (withheld,
/// digested, kept), the client acknowledges the primary's output with SACK and timestamps; every
/// packet claimed, each as the engine decides it.
fn steady_stream(fp: Replica, conn: Conn, strict: bool) -> Replica {
    let mut both = Both::new(fp, conn, strict, true);
    let mut out = 0u32;
    let mut rcv = 0u32;
    for i in 0..20u32 {
        let req = vec![b'a' + (i % 26) as u8; 100 + i as usize];
        both.claims(Incoming, &conn.client(rcv, out, Some((502 + i, conn.p_ts0 + i)), &[], &req), &format!("request {i}"));
        rcv += req.len() as u32;
        let reply: Vec<u8> = (0..(1000 + 97 * i)).map(|x| (x * 7 + i) as u8).collect();
        for (j, chunk) in reply.chunks(1448).enumerate() {
            both.claims(Outgoing, &conn.server(out, rcv, 300, Some((conn.b_ts0 + 10 + i, 502 + i)), chunk), &format!("reply {i} segment {j}: withheld, digested"));
            out += chunk.len() as u32;
        }
        if i % 4 == 1 {
            // Its server retransmits the reply's last bytes (a lost segment): withheld, kept,
            // not digested again.
            let n = reply.len().min(700);
            both.claims(Outgoing, &conn.server(out - n as u32, rcv, 300, Some((conn.b_ts0 + 10 + i, 502 + i)), &reply[reply.len() - n..]), &format!("reply {i} retransmitted"));
        }
        if i % 4 == 2 {
            // The primary's server is ahead (its report says so): the client acknowledges
            // output the backup's server has not sent yet; clamped, not taken for a forgery.
            both.primary_report(out + 300, out, &format!("primary ahead {i}"));
            both.claims(Incoming, &conn.client(rcv, out + 200, Some((503 + i, conn.p_ts0 + i + 1)), &[(out + 250, out + 300)], b""), &format!("ACK of output the backup's server has not sent {i}"));
            assert_eq!(both.kernel_state().acked_b, conn.b_isn.wrapping_add(1 + out), "clamped to SND.MAX");
            let v = both.step(Incoming, &conn.client(rcv, out + 400, Some((503 + i, conn.p_ts0 + i + 1)), &[], b""), &format!("ACK beyond the primary's report {i}"));
            assert_eq!(v == Verdict::Drop, strict, "dropped in strict mode only");
        }
        let sack: &[(u32, u32)] = if i % 3 == 0 { &[(out - 10, out)] } else { &[] };
        both.claims(Incoming, &conn.client(rcv, out.saturating_sub(20 * (i % 2)), Some((503 + i, conn.p_ts0 + i + 1)), sack, b""), &format!("ACK {i}"));
        if i % 5 == 4 {
            both.primary_report(out, out, &format!("primary's report {i}"));
            let _ = both.fp.op(Op::Collect, &both.key, None).unwrap();
        }
    }
    assert_eq!(both.slow, 0);
    eprintln!("steady stream: {} packets claimed", both.claimed);
    both.fp
}

#[test]
fn st_tcp_3_3_1_steady_stream_is_the_engines_strict_and_not() {
    let Some(mut fp) = fast_path("st_tcp_3_3_1_steady_stream_is_the_engines_strict_and_not") else { return };
    for strict in [true, false] {
        fp = steady_stream(fp, Conn::v4(), strict);
    }
}

#[test]
fn ipv6_steady_stream_is_the_engines() {
    let Some(fp) = fast_path("ipv6_steady_stream_is_the_engines") else { return };
    steady_stream(fp, Conn::v6(), true);
}

/// A small deterministic generator (xorshift*), as in fastpath_checkpoint.rs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// The hostile packets: each mutation of a well-formed packet `p` of connection `conn`.
const HOSTILE: usize = 15;

fn hostile(p: &[u8], kind: usize, v6: bool) -> (Vec<u8>, &'static str) {
    let info = IpInfo::parse(p).unwrap();
    let (l4, n) = (info.l4_offset, info.l4_len);
    let mut q = p.to_vec();
    let what = match kind {
        0 => {
            q[l4 + 13] |= F::SYN;
            refill(&mut q);
            "forged SYN on an established connection"
        }
        1 => {
            q[l4 + 13] |= F::FIN;
            refill(&mut q);
            "FIN"
        }
        2 => {
            q[l4 + 13] |= F::RST;
            refill(&mut q);
            "RST"
        }
        3 => {
            q[l4 + 13] &= !F::ACK;
            refill(&mut q);
            "no ACK"
        }
        4 => {
            q.truncate(l4 + 10);
            "truncated inside the TCP header (the IP length says more)"
        }
        5 => {
            if v6 {
                q[4..6].copy_from_slice(&10u16.to_be_bytes());
            } else {
                q[2..4].copy_from_slice(&30u16.to_be_bytes());
                ipv4::Packet::new_checked(&mut q[..]).unwrap().fill_checksum();
            }
            "IP length shorter than the TCP header"
        }
        6 => {
            q[l4 + 12] = (4 << 4) | (q[l4 + 12] & 0x0f);
            "TCP data offset below 5"
        }
        7 => {
            q[l4 + 12] = (15 << 4) | (q[l4 + 12] & 0x0f);
            if n >= 60 {
                q.truncate(l4 + 40);
                if !v6 {
                    let tl = q.len() as u16;
                    q[2..4].copy_from_slice(&tl.to_be_bytes());
                    ipv4::Packet::new_checked(&mut q[..]).unwrap().fill_checksum();
                } else {
                    q[4..6].copy_from_slice(&40u16.to_be_bytes());
                }
            }
            "TCP data offset beyond the segment"
        }
        8 if !v6 => {
            // Four bytes of IP options (NOP NOP NOP EOL).
            let mut r = q[..20].to_vec();
            r.extend_from_slice(&[1, 1, 1, 0]);
            r.extend_from_slice(&q[20..]);
            r[0] = 0x46;
            let tl = r.len() as u16;
            r[2..4].copy_from_slice(&tl.to_be_bytes());
            ipv4::Packet::new_checked(&mut r[..]).unwrap().fill_checksum();
            q = r;
            "IP options"
        }
        8 => {
            // A hop-by-hop extension header before TCP.
            let mut r = q[..40].to_vec();
            r[6] = 0;
            r.extend_from_slice(&[6, 0, 1, 4, 0, 0, 0, 0]);
            r.extend_from_slice(&q[40..]);
            let pl = (r.len() - 40) as u16;
            r[4..6].copy_from_slice(&pl.to_be_bytes());
            q = r;
            "IPv6 extension header"
        }
        9 if !v6 => {
            q[6] |= 0x20;
            ipv4::Packet::new_checked(&mut q[..]).unwrap().fill_checksum();
            "first fragment (MF)"
        }
        10 if !v6 => {
            q[7] = 0x10;
            ipv4::Packet::new_checked(&mut q[..]).unwrap().fill_checksum();
            "non-first fragment"
        }
        9 | 10 => {
            // An IPv6 fragment header.
            let mut r = q[..40].to_vec();
            r[6] = 44;
            r.extend_from_slice(&[6, 0, 0, 1, 0, 0, 0, 7]);
            r.extend_from_slice(&q[40..]);
            let pl = (r.len() - 40) as u16;
            r[4..6].copy_from_slice(&pl.to_be_bytes());
            q = r;
            "IPv6 fragment header"
        }
        11 => {
            let at = q.len() - 1;
            q[at] ^= 0x5a;
            if n == Tcp::new_checked(&q[l4..l4 + n]).unwrap().header_len() {
                q[l4 + 16] ^= 0x01;
            }
            "bad TCP checksum"
        }
        12 => {
            // The timestamp option's kind (after NOP NOP) made unknown.
            if let Some(i) = (l4 + 20..l4 + Tcp::new_checked(&q[l4..l4 + n]).unwrap().header_len()).find(|&i| q[i] == 8 && q[i + 1] == 10) {
                q[i] = 99;
            } else {
                q[l4 + 13] |= 0x20; // URG instead
            }
            refill(&mut q);
            "an option the engines do not know (or URG)"
        }
        13 => {
            // NOP TS NOP: the timestamp at an odd offset.
            let hl = Tcp::new_checked(&q[l4..l4 + n]).unwrap().header_len();
            if let Some(i) = (l4 + 20..l4 + hl - 1).find(|&i| q[i] == 1 && q[i + 1] == 1 && q.get(i + 2) == Some(&8)) {
                let ts: Vec<u8> = q[i + 2..i + 12].to_vec();
                q[i] = 1;
                q[i + 1..i + 11].copy_from_slice(&ts);
                q[i + 11] = 1;
            }
            refill(&mut q);
            "timestamp at an odd offset"
        }
        _ => {
            if !v6 {
                q[9] = 17;
                ipv4::Packet::new_checked(&mut q[..]).unwrap().fill_checksum();
            } else {
                q[6] = 17;
            }
            "not TCP"
        }
    };
    (q, what)
}

/// Random connections (v4 and v6, strict and not, timestamps or none, ISNs anywhere on the
/// ring) and random sequences of packets in both directions: new output, retransmissions,
/// overlaps, output beyond a gap (the slow path, then given back), pure ACKs, windows; client
/// segments in and out of the window, ACKs and SACK edges below and beyond what the backup's
/// server sent, old and new timestamps; the primary's reports; hostile packets.
#[test]
fn random_sequences_agree_with_the_engine() {
    let Some(mut fp) = fast_path("random_sequences_agree_with_the_engine") else { return };
    let seed = std::env::var("FASTPATH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_2204u64);
    let seqs: usize = std::env::var("FASTPATH_CASES").ok().and_then(|s| s.parse::<usize>().ok()).map(|c| c / 100).unwrap_or(80).max(1);
    let mut rng = Rng(seed | 1);
    let (mut claimed, mut slow) = (0, 0);
    for s in 0..seqs {
        let v6 = rng.chance(300);
        let base = if v6 { Conn::v6() } else { Conn::v4() };
        let conn = Conn { c_isn: rng.next() as u32, p_isn: rng.next() as u32, b_isn: rng.next() as u32, p_ts0: rng.next() as u32, b_ts0: rng.next() as u32, ..base };
        let strict = rng.chance(600);
        let ts_on = rng.chance(800);
        let mut both = Both::new(fp, conn, strict, ts_on);
        let (mut out, mut c_sent, mut acked, mut rcv) = (0u32, 0u32, 0u32, 0u32);
        let (mut bts, mut cts) = (conn.b_ts0.wrapping_add(1), 502u32);
        for step in 0..100 {
            let what = |w: &str| format!("sequence {s} step {step} (FASTPATH_SEED={seed}), strict {strict}, v6 {v6}, ts {ts_on}: {w}");
            let r = rng.below(1000);
            if r < 440 {
                // The backup's server.
                let (off, len, w) = match rng.below(10) {
                    0 => (out, 0, "pure ACK"),
                    1 => (out.saturating_sub(rng.below(2000) as u32), rng.below(1448) as u32 + 1, "retransmission or overlap"),
                    2 if rng.chance(300) => (out + 1 + rng.below(600) as u32, rng.below(500) as u32 + 1, "beyond a gap"),
                    3 => (out, rng.below(3000) as u32 + 1, "a super-packet (GSO)"),
                    _ => (out, rng.below(1448) as u32 + 1, "new output"),
                };
                if rng.chance(900) {
                    bts = bts.wrapping_add(rng.below(5) as u32);
                }
                rcv = rcv.max(c_sent.saturating_sub(rng.below(300) as u32));
                let tsv = if ts_on { Some((if rng.chance(50) { bts.wrapping_sub(100) } else { bts }, cts)) } else { None };
                let p = conn.server(off, rcv, rng.below(65536) as u16, tsv, &rng.bytes(len as usize));
                both.step(Outgoing, &p, &what(w));
                // (Output beyond a gap does not move the stream: the next new output fills the
                // gap, as its server's retransmission would.)
                if w != "beyond a gap" {
                    out = out.max(off + len);
                }
            } else if r < 900 {
                // The client.
                let (seq_off, len, w) = match rng.below(12) {
                    0 => (c_sent.wrapping_add(70_000 + rng.below(1 << 20) as u32), rng.below(100) as u32, "out of the window"),
                    1 => (c_sent.saturating_sub(rng.below(3000) as u32 + 1), rng.below(300) as u32, "old data"),
                    _ => (c_sent, if rng.chance(500) { 0 } else { rng.below(800) as u32 + 1 }, "in order"),
                };
                let ack = match rng.below(10) {
                    0 => out + 1 + rng.below(5000) as u32,
                    1 => acked.saturating_sub(rng.below(500) as u32),
                    _ => acked.max(out.saturating_sub(rng.below(1500) as u32)),
                };
                acked = acked.max(ack.min(out));
                cts = cts.wrapping_add(rng.below(3) as u32);
                let tsv = if ts_on || rng.chance(20) { Some((if rng.chance(50) { cts.wrapping_sub(50) } else { cts }, if rng.chance(100) { bts.wrapping_sub(1000) } else { bts.wrapping_add(rng.below(3) as u32) })) } else { None };
                let nblocks = rng.below(if tsv.is_some() { 4 } else { 5 }) as usize;
                let blocks: Vec<(u32, u32)> = (0..nblocks).map(|_| {
                    let l = ack + rng.below(3000) as u32;
                    (l, l + 1 + rng.below(2000) as u32)
                }).collect();
                let p = conn.client(seq_off, ack, tsv, &blocks, &rng.bytes(len as usize));
                both.step(Incoming, &p, &what(w));
                if w == "in order" {
                    c_sent += len;
                }
            } else if r < 940 {
                let p_out = out.saturating_sub(rng.below(3000) as u32) + rng.below(100) as u32;
                both.primary_report(p_out, acked.max(out.saturating_sub(rng.below(2000) as u32)), &what("the primary's report"));
            } else if r < 960 {
                let a = both.fp.op(Op::Collect, &both.key, None).unwrap();
                assert_eq!(a.result, OpResult::Done);
            } else {
                let d = if rng.chance(500) { Incoming } else { Outgoing };
                let n = rng.below(200) as usize;
                let data = rng.bytes(n);
                let p = match d {
                    Incoming => conn.client(c_sent, acked, ts_on.then_some((cts, bts)), &[], &data),
                    Outgoing => conn.server(out, rcv, 300, ts_on.then_some((bts, cts)), &data),
                };
                let (q, w) = hostile(&p, rng.below(HOSTILE as u64 + 1) as usize, v6);
                both.step(d, &q, &what(&format!("hostile: {w}")));
            }
        }
        claimed += both.claimed;
        slow += both.slow;
        fp = both.fp;
    }
    eprintln!("random_sequences_agree_with_the_engine: {seqs} sequences, {claimed} packets claimed, {slow} left to the slow path");
    assert!(claimed > slow, "the fast path claims most packets of a steady connection");
}

/// Every hostile packet, in both directions and both families, goes the slow way untouched
/// (or, where the engine treats it as an ordinary segment, is claimed as the engine decides).
#[test]
fn hostile_packets_never_pass_the_fast_path_unchecked() {
    let Some(mut fp) = fast_path("hostile_packets_never_pass_the_fast_path_unchecked") else { return };
    for conn in [Conn::v4(), Conn::v6()] {
        let v6 = conn.cli.is_ipv6();
        for kind in 0..=HOSTILE {
            for d in [Incoming, Outgoing] {
                let mut both = Both::new(fp, conn, true, true);
                both.claims(Outgoing, &conn.server(0, 0, 300, Some((conn.b_ts0 + 1, 501)), b"+OK\r\n"), "output before");
                let p = match d {
                    Incoming => conn.client(0, 5, Some((502, conn.p_ts0 + 1)), &[], b"GET k\r\n"),
                    Outgoing => conn.server(5, 0, 300, Some((conn.b_ts0 + 2, 501)), b"$3\r\nabc\r\n"),
                };
                let (q, w) = hostile(&p, kind, v6);
                let v = both.step(d, &q, &format!("{d:?} v6 {v6}: {w}"));
                let benign = (kind == 11 && d == Outgoing) || (kind == 12 && q[IpInfo::parse(&q).unwrap().l4_offset + 13] & 0x20 != 0);
                if !benign {
                    assert_eq!(v, Verdict::Slow, "{d:?} v6 {v6}: {w}: claimed");
                }
                // Whatever it was, the connection goes on on the fast path afterwards.
                both.claims(Incoming, &conn.client(0, 5, Some((503, conn.p_ts0 + 2)), &[], b""), &format!("{d:?} v6 {v6}: after {w}"));
                fp = both.fp;
            }
        }
    }
}

/// The hand-off (rep_state.h): the first packet left to the slow path freezes the entry, every
/// later one follows it there (counted, untouched), a THAW is refused while one of them has
/// not reached the daemon, and output beyond a gap keeps the connection the daemon's until the
/// gap is filled (the engine's `ooo`); then the programs own it again.
#[test]
fn handoff_freezes_at_the_first_slow_packet_and_thaws_only_when_nothing_is_between_the_paths() {
    let Some(fp) = fast_path("handoff_freezes_at_the_first_slow_packet_and_thaws_only_when_nothing_is_between_the_paths") else { return };
    let conn = Conn::v4();
    let mut both = Both::new(fp, conn, true, true);
    let key = both.key;
    // A FIN from the client: slow; the entry freezes. The next ordinary ACK follows it.
    let mut fin = conn.client(0, 0, Some((502, conn.p_ts0)), &[], b"QUIT\r\n");
    let l4 = IpInfo::parse(&fin).unwrap().l4_offset;
    fin[l4 + 13] |= F::FIN;
    refill(&mut fin);
    let r = both.fp.run(Incoming, &fin).unwrap();
    assert_eq!(r.verdict, Verdict::Slow);
    let r = both.fp.run(Incoming, &conn.client(0, 0, Some((502, conn.p_ts0)), &[], b"")).unwrap();
    assert_eq!(r.verdict, Verdict::Slow, "frozen: every packet follows the first");
    let r = both.fp.run(Outgoing, &conn.server(0, 6, 300, Some((conn.b_ts0 + 1, 502)), b"+OK\r\n")).unwrap();
    assert_eq!(r.verdict, Verdict::Slow, "both directions");
    assert!(both.fp.records().is_empty());
    let e = both.fp.entry(&key).unwrap().unwrap();
    assert_eq!((e.slow, e.seen), (3, 0));
    let st = e.state;
    assert_eq!(both.fp.op(Op::Thaw, &key, Some(&st)).unwrap().result, OpResult::Stale, "three packets between the paths");
    for i in 0..3 {
        let a = both.fp.op(Op::Take, &key, None).unwrap();
        assert_eq!(a.entry.seen, i + 1);
        if i < 2 {
            assert_eq!(both.fp.op(Op::Thaw, &key, Some(&st)).unwrap().result, OpResult::Stale);
        }
    }
    assert_eq!(both.fp.op(Op::Thaw, &key, Some(&st)).unwrap().result, OpResult::Done);
    let r = both.fp.run(Incoming, &conn.client(0, 0, Some((502, conn.p_ts0)), &[], b"")).unwrap();
    assert_eq!(r.verdict, Verdict::Done, "given back");
    // A forced thaw gives it back even with a packet lost before the queue.
    both.fp.run(Incoming, &fin).unwrap();
    assert_eq!(both.fp.op(Op::Thaw, &key, Some(&st)).unwrap().result, OpResult::Stale);
    assert_eq!(both.fp.op(Op::ThawForce, &key, Some(&st)).unwrap().result, OpResult::Done);

    // Output beyond a gap: the daemon's until the gap is filled.
    let mut both = Both::new(both.fp, conn, true, true);
    both.claims(Outgoing, &conn.server(0, 0, 300, Some((conn.b_ts0 + 1, 501)), &[1; 100]), "in order");
    both.leaves(Outgoing, &conn.server(200, 0, 300, Some((conn.b_ts0 + 2, 501)), &[3; 100]), "beyond a gap");
    assert!(both.held, "the engine keeps it aside: not given back");
    both.leaves(Incoming, &conn.client(0, 100, Some((502, conn.p_ts0 + 1)), &[], b""), "frozen meanwhile");
    both.leaves(Outgoing, &conn.server(100, 0, 300, Some((conn.b_ts0 + 3, 501)), &[2; 100]), "the gap filled");
    assert!(!both.held, "given back once nothing is kept aside");
    both.claims(Outgoing, &conn.server(300, 0, 300, Some((conn.b_ts0 + 4, 501)), &[4; 10]), "on the fast path again");
    assert_eq!(both.kernel_state().out_end, conn.p_isn.wrapping_add(1 + 310));

    // No entry (not aligned, or after the take-over): nothing claimed, nothing recorded.
    both.fp.remove(&key).unwrap();
    assert_eq!(both.fp.run(Outgoing, &conn.server(310, 0, 300, None, &[5; 10])).unwrap().verdict, Verdict::Slow);
    assert_eq!(both.fp.run(Incoming, &conn.client(0, 0, None, &[], b"x")).unwrap().verdict, Verdict::Slow);
    assert!(both.fp.records().is_empty());
}

// ---------------------------------------------------------------------------------------------
// The primary's half: pure ACKs (Primary::incoming learns, Primary::outgoing gates)
// ---------------------------------------------------------------------------------------------

use unbroken_drivers::fastpath::replica::{pflag, PState, PrimaryDirection as PD};
use unbroken_engines::replica::{Config, Primary};

/// The primary entry as the engine's fields give it (`heard_at`: the kernel's clock).
fn pstate_of(p: &Primary, key: &ConnKey, heard_at: u64) -> PState {
    PState::from_engine(&p.fast_state(key).expect("one connection in the engine"), p.config().strict, heard_at)
}

struct PBoth {
    fp: Replica,
    p: Primary,
    conn: Conn,
    key: Key,
    /// The same connection's key in the engine.
    ek: ConnKey,
    now: u64,
    claimed: usize,
    slow: usize,
    held: bool,
    /// The primary server's output so far (the backup reports the same).
    output: Vec<u8>,
    /// The backup's reports say it aligned (ST-TCP 3.3.0.1).
    aligned: bool,
    /// Reports applied in place, and those the op took (a fresh ACK foreseen).
    in_place: usize,
    taken_by_report: usize,
    nudged: usize,
}

impl PBoth {
    /// The handshake on the engine (SYN, the SYN-ACK held until the backup's first report,
    /// Koch 7.1; the client's ACK), then the entry installed.
    fn new(fp: Replica, conn: Conn, strict: bool, ts: bool) -> PBoth {
        PBoth::with_handshake(fp, conn, strict, ts, true)
    }

    /// `handshake`: the client's handshake ACK reaches the engine before the entry is
    /// installed (else the entry is installed as soon as the SYN-ACK went out).
    fn with_handshake(fp: Replica, conn: Conn, strict: bool, ts: bool, handshake: bool) -> PBoth {
        PBoth::with_options(fp, conn, strict, ts, handshake, true)
    }

    /// `aligned`: the backup's reports say it aligned.
    fn with_options(mut fp: Replica, conn: Conn, strict: bool, ts: bool, handshake: bool, aligned: bool) -> PBoth {
        let mut p = Primary::new(Config { strict, ..Config::default() });
        let key = conn.key();
        fp.p_remove(&key).unwrap();
        let syn = conn.from_client(Repr { seq: Seq(conn.c_isn), flags: F::SYN, window: 65535, mss: Some(1460), wscale: Some(7), sack_perm: true, timestamp: ts.then_some((500, 0)), ..Default::default() }, &[]);
        p.incoming(&syn);
        let mut sa = conn.from_server(Repr { seq: Seq(conn.p_isn), ack: Seq(conn.c_isn.wrapping_add(1)), flags: F::SYN | F::ACK, window: 65535, mss: Some(1460), wscale: Some(7), sack_perm: true, timestamp: ts.then_some((conn.p_ts0, 500)), ..Default::default() }, &[]);
        assert_eq!(p.outgoing(&mut sa, 0), EVerdict::Held, "Koch 7.1: the SYN-ACK waits for the backup");
        let ek = ConnKey { client: conn.cli, client_port: CPORT, server_port: SPORT };
        let mut both = PBoth { fp, p, conn, key, ek, now: 1, claimed: 0, slow: 0, held: true, output: vec![], aligned, in_place: 0, taken_by_report: 0, nudged: 0 };
        both.report_to_engine(0, 65535 << 7);
        assert_eq!(both.p.take_transmit().len(), 1, "the SYN-ACK released");
        let ack = conn.from_client(Repr { seq: Seq(conn.c_isn.wrapping_add(1)), ack: Seq(conn.p_isn.wrapping_add(1)), flags: F::ACK, window: 512, timestamp: ts.then_some((501, conn.p_ts0)), ..Default::default() }, &[]);
        if handshake {
            both.p.incoming(&ack);
        }
        let st = pstate_of(&both.p, &both.ek, 0);
        both.fp.p_insert(&key, &st).unwrap();
        both.held = false;
        both
    }

    fn report_to_engine(&mut self, rcv: u32, win: u32) {
        let c = self.conn;
        let nxt = c.c_isn.wrapping_add(1).wrapping_add(rcv);
        // The backup's output: the same bytes as the primary's so far (a deterministic server).
        let out_end = Seq(c.p_isn.wrapping_add(1).wrapping_add(self.output.len() as u32));
        let out_hash = rw::hash_continue(rw::HASH_INIT, &self.output);
        let rec = ConnProgress { client: c.cli, client_port: CPORT, server_port: SPORT, rcv_nxt: Seq(nxt), rcv_edge: Seq(nxt.wrapping_add(win)), out_end, out_hash, last_ack: Seq(0), isn: Seq(c.b_isn), flags: rw::flag::RCV_KNOWN | rw::flag::ISN_KNOWN | if self.aligned { rw::flag::ALIGNED } else { 0 } };
        self.now += 1;
        self.p.backup_progress(&Progress { role: Role::Backup, beat: self.now, flags: 0, records: vec![rec] }, self.now);
    }

    /// The backup's report, applied by the daemon: in place when the programs own the entry
    /// (`REP_OP_REPORT`: the receive figures written, the entry left to the programs unless the
    /// engine answers the record with a packet, which the op must foresee), else freeze,
    /// engine, thaw.
    fn backup_report(&mut self, rcv: u32, win: u32, what: &str) {
        if !self.held {
            let c = self.conn;
            let nxt = Seq(c.c_isn.wrapping_add(1).wrapping_add(rcv));
            let (r, e) = self.fp.p_report(&self.key, Some((nxt, nxt + win)), self.aligned, Seq(0)).unwrap();
            self.report_to_engine(rcv, win);
            let sent = self.p.take_transmit();
            match r {
                OpResult::Done => {
                    // Only the engine's timers may answer (three duplicate ACKs for a backup
                    // behind in the client's bytes, at the engine's own pace): never a fresh
                    // ACK the op should have foreseen.
                    let dups = sent.len() == 3 && sent.iter().all(|p| *p == sent[0]);
                    assert!(sent.is_empty() || dups, "{what}: the op left the entry to the programs, the engine answered with {} packet(s): {:?}", sent.len(), sent.iter().map(|p| { let i = IpInfo::parse(p).unwrap(); let t = Tcp::new_checked(&p[i.l4_offset..]).unwrap(); (t.seq(), t.ack(), t.flags(), p.len() - i.l4_offset - t.header_len()) }).collect::<Vec<_>>());
                    if dups {
                        // The daemon takes it then (fast_after_report), newest fields kept.
                        let (r, _, _) = self.fp.p_op(Op::Freeze, &self.key, None).unwrap();
                        assert_eq!(r, OpResult::Done);
                        self.nudged += 1;
                        self.give_back(what);
                        return;
                    }
                    assert_eq!(e.state, pstate_of(&self.p, &self.ek, e.state.heard_at), "{what}: the report in place differs from the engine's");
                    let now = self.fp.p_entry(&self.key).unwrap().unwrap();
                    assert_eq!(now.ctl & ctl::FROZEN, 0, "{what}: left to the programs");
                    self.in_place += 1;
                }
                OpResult::Taken => {
                    // Foreseen: a fresh ACK (or a relayed ACK): the engine's, given back after.
                    self.give_back(what);
                    self.taken_by_report += 1;
                }
                r => panic!("{what}: REP_OP_REPORT answered {r:?}"),
            }
            return;
        }
        let (r, _, e) = self.fp.p_op(Op::Freeze, &self.key, None).unwrap();
        assert_eq!(r, OpResult::Done);
        if !self.held {
            assert_eq!(e.state, pstate_of(&self.p, &self.ek, e.state.heard_at), "{what}: frozen state");
        }
        self.report_to_engine(rcv, win);
        let _ = self.p.take_transmit();
        self.give_back(what);
    }

    fn give_back(&mut self, what: &str) {
        if !self.p.fast_eligible(&self.ek) {
            self.held = true;
            return;
        }
        let k = self.fp.p_entry(&self.key).unwrap().unwrap().state;
        let (r, _, _) = self.fp.p_op(Op::Thaw, &self.key, Some(&pstate_of(&self.p, &self.ek, k.heard_at))).unwrap();
        assert_eq!(r, OpResult::Done, "{what}: thaw refused");
        self.held = false;
    }

    fn step(&mut self, d: PD, pkt: &[u8], what: &str) -> Verdict {
        let before = self.fp.p_entry(&self.key).unwrap();
        let c0 = self.p.counters;
        let k0 = self.fp.p_counters().unwrap();
        let run = self.fp.run_primary(d, pkt).unwrap();
        let mut buf = pkt.to_vec();
        self.now += 1;
        let v = match d {
            PD::Incoming => self.p.incoming(&buf),
            PD::Outgoing => self.p.outgoing(&mut buf, self.now),
        };
        let _ = self.p.take_transmit();
        let _ = self.p.take_notices();
        let c1 = self.p.counters;
        let k1 = self.fp.p_counters().unwrap();
        let was_frozen = before.is_some_and(|e| e.ctl & ctl::FROZEN != 0);
        if run.verdict == Verdict::Done && was_frozen {
            // A client pure ACK of an entry the daemon holds: passed unchanged, not learned,
            // not counted (the engine passes it unchanged too).
            assert_eq!(d, PD::Incoming, "{what}: a frozen entry's server packet claimed");
            assert_eq!(hex(&run.packet), hex(pkt), "{what}: passed, but modified");
            assert_eq!(v, EVerdict::Accept { modified: false }, "{what}: the engine would not pass it unchanged");
            assert_eq!(self.fp.p_entry(&self.key).unwrap(), before, "{what}: a frozen entry changed");
            assert_eq!(k1.unlearned, k0.unlearned + 1, "{what}: counted as unlearned");
            self.claimed += 1;
            return run.verdict;
        }
        if run.verdict == Verdict::Done {
            assert!(before.is_some(), "{what}: claimed without an entry");
            assert!(matches!(v, EVerdict::Accept { .. }), "{what}: claimed, the engine says {v:?}");
            assert_eq!(hex(&run.packet), hex(&buf), "{what}: the fast path's bytes differ from the engine's");
            let k = self.fp.p_entry(&self.key).unwrap().unwrap().state;
            assert_eq!(k, pstate_of(&self.p, &self.ek, k.heard_at), "{what}: the entry differs from the engine's state");
            assert_eq!((k1.acks_lowered - k0.acks_lowered, k1.ts_raised - k0.ts_raised), (c1.acks_lowered - c0.acks_lowered, c1.ts_raised - c0.ts_raised), "{what}: counters");
            self.claimed += 1;
        } else {
            assert_eq!(run.verdict, Verdict::Slow, "{what}: unexpected verdict");
            assert_eq!(hex(&run.packet), hex(pkt), "{what}: left to the slow path, but modified");
            if let Some(e0) = before {
                let e1 = self.fp.p_entry(&self.key).unwrap().unwrap();
                assert_eq!(e1.state, e0.state, "{what}: left to the slow path, but the entry changed");
                let marked = e1.slow == e0.slow + 1;
                if !marked {
                    assert!(unparsable(pkt), "{what}: a parsable packet of the connection left unmarked");
                }
                let (r, _, _) = self.fp.p_op(if marked { Op::Take } else { Op::Freeze }, &self.key, None).unwrap();
                assert_eq!(r, OpResult::Done);
                self.give_back(what);
            }
            self.slow += 1;
        }
        run.verdict
    }
}

/// Koch 3.2 on pure ACKs: the primary's server acknowledges client bytes the backup has not
/// reported yet (lowered to the backup's), the window follows the lower edge, a TSval older than
/// one sent is raised; the client's pure ACKs are learned from (LastAckReceived, established,
/// client_last) and passed unchanged. Every pure ACK claimed, each as the engine decides it.
#[test]
fn koch_3_2_pure_acks_are_gated_as_the_engine_gates_them() {
    let Some(mut fp) = fast_path("koch_3_2_pure_acks_are_gated_as_the_engine_gates_them") else { return };
    for (conn, strict) in [(Conn::v4(), true), (Conn::v4(), false), (Conn::v6(), true)] {
        let mut both = PBoth::new(fp, conn, strict, true);
        let mut rcv = 0u32;
        let mut backup_rcv = 0u32;
        for i in 0..30u32 {
            let req = vec![b'x'; 50 + i as usize];
            let v = both.step(PD::Incoming, &conn.client(rcv, 0, Some((502 + i, conn.p_ts0 + i)), &[], &req), &format!("request {i}"));
            assert_eq!(v, Verdict::Slow, "client data: the relay copy is the engine's");
            rcv += req.len() as u32;
            let tsv = conn.p_ts0 + 1 + i - if i % 7 == 3 { 5 } else { 0 };
            let v = both.step(PD::Outgoing, &conn.pserver(0, rcv, 400 + i as u16, Some((tsv, 502 + i)), b""), &format!("server ACK {i}"));
            assert_eq!(v, Verdict::Done, "server ACK {i}");
            if i % 3 == 2 {
                backup_rcv = rcv - (i % 2) * 10;
                both.backup_report(backup_rcv, (300 + i) << 7, &format!("backup report {i}"));
            }
            let v = both.step(PD::Incoming, &conn.client(rcv, 0, Some((503 + i, conn.p_ts0 + i)), &[], b""), &format!("client ACK {i}"));
            assert_eq!(v, Verdict::Done, "client ACK {i}");
        }
        // A client ACK without timestamps (a middlebox stripped them): client_last has none.
        let v = both.step(PD::Incoming, &conn.client(rcv, 0, None, &[], b""), "client ACK without timestamps");
        assert_eq!(v, Verdict::Done);
        assert_eq!(both.fp.p_entry(&both.key).unwrap().unwrap().state.flags & pflag::CL_TS, 0);
        assert!(both.p.counters.acks_lowered > 0, "some ACKs lowered to the backup's");
        assert!(both.p.counters.ts_raised > 0, "some TSvals raised");
        eprintln!("pure ACKs: {} claimed, {} slow (v6 {}, strict {strict}), backup at {backup_rcv}", both.claimed, both.slow, conn.cli.is_ipv6());
        fp = both.fp;
    }
}

/// Random sequences on the primary: pure ACKs both ways (ACKs behind and ahead, windows, old
/// timestamps, out-of-window client segments), its server's output and retransmissions (strict:
/// held until the backup's digest, then its retransmissions claimed; relaxed: claimed at once),
/// the backup's reports, client data and hostile packets between them.
#[test]
fn primary_random_sequences_agree_with_the_engine() {
    let Some(mut fp) = fast_path("primary_random_sequences_agree_with_the_engine") else { return };
    let seed = std::env::var("FASTPATH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_2205u64);
    let seqs: usize = std::env::var("FASTPATH_CASES").ok().and_then(|s| s.parse::<usize>().ok()).map(|c| c / 100).unwrap_or(60).max(1);
    let mut rng = Rng(seed | 1);
    let (mut claimed, mut slow, mut in_place, mut taken_by_report) = (0, 0, 0, 0);
    for s in 0..seqs {
        let v6 = rng.chance(300);
        let base = if v6 { Conn::v6() } else { Conn::v4() };
        let conn = Conn { c_isn: rng.next() as u32, p_isn: rng.next() as u32, b_isn: rng.next() as u32, p_ts0: rng.next() as u32, ..base };
        let strict = rng.chance(500);
        let ts_on = rng.chance(800);
        let mut both = PBoth::new(fp, conn, strict, ts_on);
        let (mut c_sent, mut rcv) = (0u32, 0u32);
        let mut pts = conn.p_ts0.wrapping_add(1);
        for step in 0..100 {
            let what = |w: &str| format!("sequence {s} step {step} (FASTPATH_SEED={seed}), strict {strict}, v6 {v6}, ts {ts_on}: {w}");
            let r = rng.below(1000);
            if r < 400 {
                rcv = rcv.max(c_sent.saturating_sub(rng.below(200) as u32));
                let ack = if rng.chance(100) { rcv.saturating_sub(rng.below(500) as u32) } else { rcv };
                pts = pts.wrapping_add(rng.below(3) as u32);
                let tsv = ts_on.then(|| (if rng.chance(100) { pts.wrapping_sub(7) } else { pts }, 502 + step));
                let p = conn.pserver(0, ack, rng.below(65536) as u16, tsv, b"");
                both.step(PD::Outgoing, &p, &what("server pure ACK"));
            } else if r < 550 {
                // Its server's output: new, or a retransmission of the last bytes.
                let retrans = rng.chance(300) && !both.output.is_empty();
                let (off, data) = if retrans {
                    let n = rng.below(both.output.len().min(1448) as u64) as usize + 1;
                    (both.output.len() - n, both.output[both.output.len() - n..].to_vec())
                } else {
                    let n = rng.below(1448) as usize + 1;
                    (both.output.len(), rng.bytes(n))
                };
                pts = pts.wrapping_add(rng.below(3) as u32);
                let p = conn.pserver(off as u32, rcv, rng.below(65536) as u16, ts_on.then_some((pts, 502 + step)), &data);
                both.step(PD::Outgoing, &p, &what(if retrans { "server retransmission" } else { "server output" }));
                if !retrans {
                    both.output.extend_from_slice(&data);
                    if strict && rng.chance(700) {
                        // A backup that keeps up: its digest of the same bytes comes next.
                        both.backup_report(rcv.saturating_sub(rng.below(100) as u32), 1 << 16, &what("the backup's report of that output"));
                    }
                }
            } else if r < 750 {
                let seq = match rng.below(10) {
                    0 => c_sent.wrapping_add(1 << 20),
                    1 => c_sent.saturating_sub(rng.below(1000) as u32 + 1),
                    _ => c_sent,
                };
                let out = if rng.chance(100) { 5 } else { 0 };
                let tsv = if ts_on || rng.chance(20) { Some((502 + step as u32, pts)) } else { None };
                let p = conn.client(seq, out, tsv, &[], b"");
                both.step(PD::Incoming, &p, &what("client pure ACK"));
            } else if r < 880 {
                let n = rng.below(600) as usize + 1;
                let data = rng.bytes(n);
                let p = conn.client(c_sent, 0, ts_on.then_some((502 + step as u32, pts)), &[], &data);
                both.step(PD::Incoming, &p, &what("client data (slow: the relay copy)"));
                c_sent += n as u32;
            } else if r < 960 {
                let b = rcv.saturating_sub(rng.below(300) as u32);
                both.backup_report(b, rng.below(1 << 20) as u32, &what("the backup's report"));
            } else {
                let d = if rng.chance(500) { PD::Incoming } else { PD::Outgoing };
                let p = match d {
                    PD::Incoming => conn.client(c_sent, 0, ts_on.then_some((502, pts)), &[], b""),
                    PD::Outgoing => conn.pserver(0, rcv, 300, ts_on.then_some((pts, 502)), b""),
                };
                let (q, w) = hostile(&p, rng.below(HOSTILE as u64 + 1) as usize, v6);
                both.step(d, &q, &what(&format!("hostile: {w}")));
            }
        }
        claimed += both.claimed;
        slow += both.slow;
        in_place += both.in_place;
        taken_by_report += both.taken_by_report;
        fp = both.fp;
    }
    eprintln!("primary_random_sequences_agree_with_the_engine: {seqs} sequences, {claimed} claimed, {slow} left to the slow path; reports: {in_place} in place, {taken_by_report} taken (a fresh ACK)");
    assert!(claimed > slow);
    assert!(in_place > 0 && taken_by_report > 0, "both kinds of report in place were tried");
}

/// An entry installed before the client's handshake ACK: only an acceptable ACK of what the
/// primary's server sent establishes the connection (a blind forgery acknowledging more does
/// not, so it stays evictable, as in the engine).
#[test]
fn primary_handshake_ack_establishes_only_within_what_was_sent() {
    let Some(fp) = fast_path("primary_handshake_ack_establishes_only_within_what_was_sent") else { return };
    let conn = Conn::v4();
    let mut both = PBoth::with_handshake(fp, conn, true, true, false);
    assert_eq!(both.fp.p_entry(&both.key).unwrap().unwrap().state.flags & pflag::ESTABLISHED, 0);
    let v = both.step(PD::Incoming, &conn.client(0, 1000, Some((501, conn.p_ts0)), &[], b""), "an ACK of bytes never sent");
    assert_eq!(v, Verdict::Done);
    assert_eq!(both.fp.p_entry(&both.key).unwrap().unwrap().state.flags & pflag::ESTABLISHED, 0, "not established");
    let v = both.step(PD::Incoming, &conn.client(0, 0, Some((501, conn.p_ts0)), &[], b""), "the handshake ACK");
    assert_eq!(v, Verdict::Done);
    assert_ne!(both.fp.p_entry(&both.key).unwrap().unwrap().state.flags & pflag::ESTABLISHED, 0, "established");
}

/// Copy mode (how the egress programs are meant to run attached at tc egress, after netfilter's
/// OUTPUT): a packet of the service they decline (no entry, frozen, a FIN) is copied to the
/// daemon in pieces and consumed, never passed as its server built it; a packet of another
/// port is passed untouched; a claimed one is as without copy mode.
#[test]
fn egress_copy_mode_never_passes_a_declined_packet_of_the_service() {
    let Some(mut fp) = fast_path("egress_copy_mode_never_passes_a_declined_packet_of_the_service") else { return };
    let conn = Conn::v4();
    fp.set_egress_copy(true).unwrap();
    fp.add_service(std::net::SocketAddr::new(conn.svc, SPORT)).unwrap();
    let mut both = Both::new(fp, conn, true, true);
    let key = both.key;
    let collect = |fp: &mut Replica| -> Vec<u8> {
        let mut got = vec![];
        for r in fp.records() {
            if let Record::Slow { key: k, total, off, bytes, .. } = r {
                assert_eq!(k, key);
                assert_eq!(off as usize, got.len());
                got.extend_from_slice(&bytes);
                assert!(got.len() <= total as usize);
            }
        }
        got
    };
    // Claimed: withheld as without copy mode.
    let p = conn.server(0, 0, 300, Some((conn.b_ts0 + 1, 501)), &[1; 100]);
    assert_eq!(both.fp.run(Outgoing, &p).unwrap().verdict, CONSUMED);
    assert!(collect(&mut both.fp).is_empty(), "no copy of a claimed packet");
    // Declined (a FIN, a 3,000-byte one in two pieces): copied and consumed; the entry frozen.
    let mut fin = conn.server(100, 0, 300, Some((conn.b_ts0 + 2, 501)), &[2; 3000]);
    let l4 = IpInfo::parse(&fin).unwrap().l4_offset;
    fin[l4 + 13] |= F::FIN;
    refill(&mut fin);
    assert_eq!(both.fp.run(Outgoing, &fin).unwrap().verdict, CONSUMED, "declined but not passed");
    assert_eq!(hex(&collect(&mut both.fp)), hex(&fin), "the daemon gets the packet");
    let e = both.fp.entry(&key).unwrap().unwrap();
    assert_eq!((e.slow, e.ctl & unbroken_drivers::fastpath::replica::ctl::FROZEN), (1, unbroken_drivers::fastpath::replica::ctl::FROZEN));
    // Frozen: the next ordinary segment follows it to the daemon.
    let p = conn.server(3100, 0, 300, Some((conn.b_ts0 + 3, 501)), &[3; 10]);
    assert_eq!(both.fp.run(Outgoing, &p).unwrap().verdict, CONSUMED);
    assert_eq!(hex(&collect(&mut both.fp)), hex(&p));
    // No entry (a new connection's SYN-ACK): copied and consumed.
    both.fp.remove(&key).unwrap();
    let sa = conn.from_server(Repr { seq: Seq(5), ack: Seq(6), flags: F::SYN | F::ACK, window: 100, ..Default::default() }, &[]);
    assert_eq!(both.fp.run(Outgoing, &sa).unwrap().verdict, CONSUMED);
    assert_eq!(hex(&collect(&mut both.fp)), hex(&sa));
    // Another port of the host: not the service's, passed untouched.
    let other = ip::tcp_packet(conn.svc, conn.cli, &Repr { src_port: 22, dst_port: CPORT, seq: Seq(5), ack: Seq(6), flags: F::ACK, window: 100, ..Default::default() }, b"ssh").unwrap();
    let r = both.fp.run(Outgoing, &other).unwrap();
    assert_eq!((r.verdict, hex(&r.packet)), (Verdict::Slow, hex(&other)));
    assert!(collect(&mut both.fp).is_empty());
    // Review finding 2 (fail closed): a packet the parser refuses (IPv4 options here; BIG TCP,
    // fragments and IPv6 extension headers alike) from the service address is dropped, counted,
    // never passed as its server built it; from another address it is not the service's.
    let with_options = |src: std::net::IpAddr| {
        let p = ip::tcp_packet(src, conn.cli, &Repr { src_port: SPORT, dst_port: CPORT, seq: Seq(5), ack: Seq(6), flags: F::ACK, window: 100, ..Default::default() }, b"data").unwrap();
        let mut v = p[..20].to_vec();
        v.extend_from_slice(&[1, 1, 1, 0]);
        v.extend_from_slice(&p[20..]);
        v[0] = 0x46;
        let n = (v.len() as u16).to_be_bytes();
        v[2..4].copy_from_slice(&n);
        v[10..12].copy_from_slice(&[0, 0]);
        let sum = !v[..24].chunks(2).fold(0u32, |a, w| {
            let a = a + u16::from_be_bytes([w[0], w[1]]) as u32;
            (a & 0xffff) + (a >> 16)
        }) as u16;
        v[10..12].copy_from_slice(&sum.to_be_bytes());
        v
    };
    let before = both.fp.counters().unwrap().unparsed_dropped;
    let r = both.fp.run(Outgoing, &with_options(conn.svc)).unwrap();
    assert_eq!(r.verdict, Verdict::Drop, "an unparsable packet of the service address passed");
    assert_eq!(both.fp.counters().unwrap().unparsed_dropped, before + 1);
    let elsewhere = with_options("10.9.9.9".parse().unwrap());
    let r = both.fp.run(Outgoing, &elsewhere).unwrap();
    assert_eq!((r.verdict, hex(&r.packet)), (Verdict::Slow, hex(&elsewhere)), "not the service's: untouched");
    assert!(collect(&mut both.fp).is_empty());
    // The primary's egress program too: a declined packet of the service (its server's data,
    // which strict output commit holds) goes to the daemon, not ungated to the wire.
    let mut pb = PBoth::new(both.fp, conn, true, true);
    let data = conn.pserver(0, 0, 300, Some((conn.p_ts0 + 1, 501)), b"+OK\r\n");
    assert_eq!(pb.fp.run_primary(PD::Outgoing, &data).unwrap().verdict, CONSUMED);
    assert_eq!(hex(&collect(&mut pb.fp)), hex(&data));
    let ack = conn.pserver(0, 0, 300, Some((conn.p_ts0 + 1, 501)), b"");
    assert_eq!(pb.fp.run_primary(PD::Outgoing, &ack).unwrap().verdict, CONSUMED, "a pure ACK of the frozen entry: copied, not passed ungated");
    assert_eq!(hex(&collect(&mut pb.fp)), hex(&ack));
    let e = pb.fp.p_entry(&pb.key).unwrap().unwrap();
    assert_eq!((e.slow, e.state), (2, pstate_of(&pb.p, &pb.ek, e.state.heard_at)), "both counted, the state untouched");
    // The primary's attach, review finding 1: what the parser refuses from the service address
    // is dropped there too (with its OUTPUT queue rule off, nothing else would stop it).
    let before = pb.fp.counters().unwrap().unparsed_dropped;
    let r = pb.fp.run_primary(PD::Outgoing, &with_options(conn.svc)).unwrap();
    assert_eq!(r.verdict, Verdict::Drop, "an unparsable packet of the primary's service passed ungated");
    assert_eq!(pb.fp.counters().unwrap().unparsed_dropped, before + 1);
    let r = pb.fp.run_primary(PD::Outgoing, &elsewhere).unwrap();
    assert_eq!((r.verdict, hex(&r.packet)), (Verdict::Slow, hex(&elsewhere)), "not the service's: untouched");
    pb.fp.set_egress_copy(false).unwrap();
}

/// Copy mode's records say whether the packet was counted in its entry (the daemon then takes
/// it as a marked packet); after the take-over (`set_promoted`) `rep_b_out` passes every packet
/// untouched and copies nothing: the OUTPUT queue rule's verdicts decided them before tc egress.
#[test]
fn egress_copies_say_whether_they_were_counted_and_a_promoted_backup_passes_only_what_the_queue_accepted() {
    let Some(mut fp) = fast_path("egress_copies_say_whether_they_were_counted_and_a_promoted_backup_passes_only_what_the_queue_accepted") else { return };
    let conn = Conn::v4();
    fp.set_egress_copy(true).unwrap();
    fp.add_service(std::net::SocketAddr::new(conn.svc, SPORT)).unwrap();
    let mut both = Both::new(fp, conn, true, true);
    let key = both.key;
    let counted = |fp: &mut Replica| -> Vec<bool> { fp.records().into_iter().filter_map(|r| if let Record::Slow { counted, off: 0, .. } = r { Some(counted) } else { None }).collect() };
    // A FIN of a connection with an entry: counted (and marked).
    let mut fin = conn.server(0, 0, 300, Some((conn.b_ts0 + 1, 501)), &[2; 10]);
    let l4 = IpInfo::parse(&fin).unwrap().l4_offset;
    fin[l4 + 13] |= F::FIN;
    refill(&mut fin);
    assert_eq!(both.fp.run(Outgoing, &fin).unwrap().verdict, CONSUMED);
    assert_eq!(counted(&mut both.fp), [true]);
    assert_eq!(both.fp.entry(&key).unwrap().unwrap().slow, 1);
    // No entry (a new connection's SYN-ACK): not counted.
    both.fp.remove(&key).unwrap();
    let sa = conn.from_server(Repr { seq: Seq(5), ack: Seq(6), flags: F::SYN | F::ACK, window: 100, ..Default::default() }, &[]);
    assert_eq!(both.fp.run(Outgoing, &sa).unwrap().verdict, CONSUMED);
    assert_eq!(counted(&mut both.fp), [false]);
    // Promoted (the take-over, the map cleared): what the queue accepted carries the daemon's
    // mark and passes untouched; a packet without it passed OUTPUT before the switch and
    // would leave untranslated: copied and consumed instead (review 2, finding 2).
    const OWN: u32 = 0x7562_0003;
    both.fp.set_own_mark(OWN).unwrap();
    both.fp.set_promoted(true).unwrap();
    let data = conn.server(10, 0, 300, Some((conn.b_ts0 + 2, 501)), &[3; 100]);
    for p in [&sa, &fin, &data] {
        let r = both.fp.run_marked(Outgoing, p, OWN).unwrap();
        assert_eq!((r.verdict, hex(&r.packet)), (Verdict::Slow, hex(p)), "accepted by the queue: passed");
    }
    assert!(both.fp.records().is_empty());
    for p in [&sa, &fin, &data] {
        assert_eq!(both.fp.run(Outgoing, p).unwrap().verdict, CONSUMED, "not through the queue: never passed untranslated");
    }
    assert_eq!(counted(&mut both.fp), [false, false, false]);
    // Copy mode is on underneath (set_promoted keeps the other flags).
    both.fp.set_promoted(false).unwrap();
    assert_eq!(both.fp.run(Outgoing, &sa).unwrap().verdict, CONSUMED);
    assert_eq!(counted(&mut both.fp), [false]);
    // The daemon's own sends (its raw socket's mark, exactly) pass untouched in copy mode,
    // never copied again: a take-over whose OUTPUT rule failed sends what its engine translated
    // that way (without this they looped through the copy forever). Another mark is copied.
    let r = both.fp.run_marked(Outgoing, &sa, OWN).unwrap();
    assert_eq!((r.verdict, hex(&r.packet)), (Verdict::Slow, hex(&sa)));
    assert!(both.fp.records().is_empty());
    assert_eq!(both.fp.run_marked(Outgoing, &sa, OWN ^ 1).unwrap().verdict, CONSUMED);
    assert_eq!(counted(&mut both.fp), [false]);
    assert_eq!(both.fp.run_marked(Outgoing, &sa, 0x1000_0000).unwrap().verdict, CONSUMED);
    assert_eq!(counted(&mut both.fp), [false]);
    both.fp.set_egress_copy(false).unwrap();
}

/// ST-TCP without strict output commit: the primary's output passes at once, but only once the
/// backup is aligned (else the client could acknowledge output before the ACK the backup aligns
/// on); before, the engine holds it and the programs leave it to the engine.
#[test]
fn relaxed_output_passes_at_once_only_once_the_backup_is_aligned() {
    let Some(fp) = fast_path("relaxed_output_passes_at_once_only_once_the_backup_is_aligned") else { return };
    let conn = Conn::v4();
    let mut both = PBoth::with_options(fp, conn, false, true, true, false);
    let v = both.step(PD::Outgoing, &conn.pserver(0, 0, 300, Some((conn.p_ts0 + 1, 501)), b"+OK\r\n"), "output before the backup aligned");
    assert_eq!(v, Verdict::Slow);
    both.output.extend_from_slice(b"+OK\r\n");
    both.aligned = true;
    both.backup_report(0, 1 << 16, "the backup aligned");
    assert!(!both.held, "given back once the held output went");
    let v = both.step(PD::Outgoing, &conn.pserver(5, 0, 300, Some((conn.p_ts0 + 2, 501)), b"$1\r\nx\r\n"), "output after");
    assert_eq!(v, Verdict::Done);
}

/// `p` with the TCP options `opts` (a multiple of 4 bytes) after its fixed header.
fn with_tcp_options(p: &[u8], opts: &[u8]) -> Vec<u8> {
    assert_eq!(opts.len() % 4, 0);
    let info = IpInfo::parse(p).unwrap();
    let l4 = info.l4_offset;
    let mut q = p[..l4 + 20].to_vec();
    q.extend_from_slice(opts);
    q.extend_from_slice(&p[l4 + 20..]);
    q[l4 + 12] = (((20 + opts.len()) / 4) as u8) << 4;
    if info.src.is_ipv4() {
        let tl = q.len() as u16;
        q[2..4].copy_from_slice(&tl.to_be_bytes());
    } else {
        let pl = (q.len() - 40) as u16;
        q[4..6].copy_from_slice(&pl.to_be_bytes());
    }
    refill(&mut q);
    q
}

/// Two timestamp options (and two SACK options) in one segment: the replica engine's parser
/// keeps the last of each, and so do the programs, byte for byte.
#[test]
fn hostile_duplicate_options_are_read_as_the_engine_reads_them() {
    let Some(fp) = fast_path("hostile_duplicate_options_are_read_as_the_engine_reads_them") else { return };
    let conn = Conn::v4();
    let mut both = Both::new(fp, conn, false, true);
    both.claims(Outgoing, &conn.server(0, 0, 300, Some((conn.b_ts0 + 1, 501)), &[1; 3000]), "output");
    let ts = |v: u32, e: u32| -> Vec<u8> { let mut o = vec![8, 10]; o.extend_from_slice(&v.to_be_bytes()); o.extend_from_slice(&e.to_be_bytes()); o };
    let edge = |x: u32| conn.p_isn.wrapping_add(1 + x).to_be_bytes();
    let mut opts = vec![1, 1];
    opts.extend(ts(600, conn.p_ts0 + 1));
    opts.extend([1, 1]);
    opts.extend(ts(601, conn.p_ts0 + 2));
    let base = conn.client(0, 100, None, &[], b"");
    both.step(Incoming, &with_tcp_options(&base, &opts), "two timestamp options");
    let mut opts = vec![1, 1, 5, 10];
    opts.extend(edge(200));
    opts.extend(edge(300));
    opts.extend([1, 1, 5, 10]);
    opts.extend(edge(400));
    opts.extend(edge(3500));
    both.step(Incoming, &with_tcp_options(&base, &opts), "two SACK options, the last beyond SND.MAX");
    assert_eq!((both.claimed, both.slow), (3, 0), "claimed as the engine decides them");
}

/// The primary's lease (review of the primary's attach, finding 3): once it ran out (a daemon
/// killed or stuck) its programs claim nothing, neither the client's pure ACKs nor its server's
/// output, and count nothing against a thaw; renewed, they claim again.
#[test]
fn primary_programs_claim_nothing_once_the_lease_ran_out() {
    let Some(fp) = fast_path("primary_programs_claim_nothing_once_the_lease_ran_out") else { return };
    let conn = Conn::v4();
    let mut pb = PBoth::new(fp, conn, false, true);
    let ack_in = conn.client(0, 0, Some((502, conn.p_ts0)), &[], b"");
    let ack_out = conn.pserver(0, 0, 300, Some((conn.p_ts0 + 1, 502)), b"");
    assert_eq!(pb.fp.run_primary(PD::Incoming, &ack_in).unwrap().verdict, Verdict::Done, "claimed under no lease");
    // Expired: the kernel's clock is far past 1 ns.
    pb.fp.set_lease(1).unwrap();
    let before = pb.fp.p_entry(&pb.key).unwrap();
    for (d, p) in [(PD::Incoming, &ack_in), (PD::Outgoing, &ack_out)] {
        let r = pb.fp.run_primary(d, p).unwrap();
        assert_eq!((r.verdict, hex(&r.packet)), (Verdict::Slow, hex(p)), "{d:?}: claimed past the lease");
    }
    assert_eq!(pb.fp.p_entry(&pb.key).unwrap(), before, "the entry untouched, nothing counted");
    // Renewed (an hour from now on any clock this test meets).
    pb.fp.set_lease(u64::MAX / 2).unwrap();
    assert_eq!(pb.fp.run_primary(PD::Incoming, &ack_in).unwrap().verdict, Verdict::Done);
    assert_eq!(pb.fp.run_primary(PD::Outgoing, &ack_out).unwrap().verdict, Verdict::Done);
}
