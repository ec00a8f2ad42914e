//! Per-packet cost of checkpoint mode's transform: the BPF programs by `BPF_PROG_TEST_RUN`
//! (the kernel's own timer, mean over `--repeat` runs) and the Rust engine (`rtcp::*_parsed`
//! with the IP header parsed once, as the guard does; this thread's CPU time, so that other
//! load on the machine does not count), on the same packets and state (after a
//! recovery: Δ, a timestamp offset and a rescaled window, so every rewrite happens). Both
//! rewrite the same packet again and again and keep their state, as the kernel's repeat does.
//! Neither includes what surrounds it in a daemon (NFQUEUE's round trip for the engine; the
//! skb's trip through tc for the programs). Root only.
//!
//! sudo target/release/examples/fastpath_cost [--repeat N]

#[path = "../../engines/tests/rtcp_vectors/mod.rs"]
#[allow(dead_code, unused_imports)]
mod rtcp_vectors;

use std::hint::black_box;
use std::net::SocketAddr;

use rtcp_vectors::*;
use unbroken_drivers::fastpath::checkpoint::{Checkpoint, Direction, Key};
use unbroken_drivers::fastpath::Verdict;
use unbroken_engines::rtcp::{self, Conn, PeerChecksum};
use unbroken_wire::ctl::{Command, Op};
use unbroken_wire::ip::IpInfo;
use unbroken_wire::tcp::{flags as F, Repr};
use unbroken_wire::Seq;

fn main() {
    let mut repeat: u32 = 1_000_000;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--repeat" => repeat = args.next().and_then(|v| v.parse().ok()).expect("--repeat N"),
            _ => panic!("usage: fastpath_cost [--repeat N]"),
        }
    }
    let mut fp = Checkpoint::load().unwrap_or_else(|e| panic!("{e}"));
    let (mut told, _, _) = recovered(777);
    let cmd = Command::request(Op::Tell, SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT), 1, 1);
    rtcp::command(&mut told, &cmd, &mut [0u8; 128]);
    let key = Key::new(SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT));
    let (s, n) = {
        let mut s = [(Seq(0), Seq(0)); 4];
        s[0] = (Seq(A_ISN + 3201), Seq(A_ISN + 4649));
        (s, 1)
    };
    let cases: Vec<(&str, Direction, P)> = vec![
        ("A→B data, 1448 B, TS (O7, O8, TS, window)", Direction::Outgoing, from_a(Repr { seq: Seq(778), ack: Seq(B_ISN + 3001), flags: F::ACK | F::PSH, window: 100, timestamp: Some((25, 150)), ..Default::default() }, &[7u8; 1448])),
        ("A→B pure ACK, TS", Direction::Outgoing, from_a(Repr { seq: Seq(778), ack: Seq(B_ISN + 3001), flags: F::ACK, window: 100, timestamp: Some((25, 150)), ..Default::default() }, b"")),
        ("B→A pure ACK, TS, 1 SACK block (I3)", Direction::Incoming, from_b(Repr { seq: Seq(B_ISN + 2001), ack: Seq(A_ISN + 3001), flags: F::ACK, window: 500, timestamp: Some((170, 9700)), sack: s, sack_len: n, ..Default::default() }, b"")),
        ("B→A data, 1448 B, TS (checksum verified)", Direction::Incoming, from_b(Repr { seq: Seq(B_ISN + 2001), ack: Seq(A_ISN + 3001), flags: F::ACK | F::PSH, window: 500, timestamp: Some((170, 9700)), ..Default::default() }, &[9u8; 1448])),
    ];
    // What the fast path pays before it declines: the parse and the map lookup (no entry), and
    // a FIN from B (declined after the parse, the lookup and the flags, before the checksum).
    let declined: Vec<(&str, Direction, P)> = vec![
        ("A→B data, 1448 B, no entry (parse + lookup)", Direction::Outgoing, from_a(Repr { src_port: A_PORT, seq: Seq(778), ack: Seq(B_ISN + 3001), flags: F::ACK | F::PSH, window: 100, timestamp: Some((25, 150)), ..Default::default() }, &[7u8; 1448])),
        ("B→A FIN, 1448 B (parse, lookup, flags)", Direction::Incoming, from_b(Repr { seq: Seq(B_ISN + 2001), ack: Seq(A_ISN + 3001), flags: F::ACK | F::FIN, window: 500, timestamp: Some((170, 9700)), ..Default::default() }, &[9u8; 1448])),
    ];
    println!("{:<46} {:>12} {:>12} {:>8}", "packet", "BPF ns/pkt", "engine ns/pkt", "verdict");
    for (what, d, p) in cases {
        let pkt = &p.buf[..p.len];
        fp.insert(&key, &told).unwrap();
        let bpf = fp.time_per_packet(d, pkt, repeat).unwrap();
        // The last run's verdict: the cost measured is the claimed path's.
        let v = fp.run(d, pkt).unwrap().verdict;
        assert_eq!(v, Verdict::Done, "{what}: not claimed");
        let mut c: Conn = told;
        let mut buf = p.buf.clone();
        let t0 = thread_cpu_ns();
        for _ in 0..repeat {
            let info = IpInfo::parse(&buf[..p.len]).unwrap();
            let o = match d {
                Direction::Outgoing => rtcp::outgoing_parsed(&mut c, &mut buf, p.len, &info),
                Direction::Incoming => rtcp::incoming_parsed(&mut c, &mut buf, p.len, &info, PeerChecksum::Verify),
            };
            black_box(o.unwrap());
        }
        let engine = (thread_cpu_ns() - t0) as f64 / repeat as f64;
        println!("{:<46} {:>12} {:>12.0} {:>8?}", what, bpf.as_nanos(), engine, v);
    }
    for (i, (what, d, p)) in declined.into_iter().enumerate() {
        let pkt = &p.buf[..p.len];
        if i == 0 {
            fp.remove(&key).unwrap();
        } else {
            fp.insert(&key, &told).unwrap();
        }
        let bpf = fp.time_per_packet(d, pkt, repeat).unwrap();
        let v = fp.run(d, pkt).unwrap().verdict;
        assert_eq!(v, Verdict::Slow, "{what}: claimed");
        println!("{:<46} {:>12} {:>12} {:>8?}", what, bpf.as_nanos(), "-", v);
    }
}

/// This thread's CPU time in nanoseconds.
fn thread_cpu_ns() -> u128 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(r, 0, "clock_gettime");
    ts.tv_sec as u128 * 1_000_000_000 + ts.tv_nsec as u128
}
