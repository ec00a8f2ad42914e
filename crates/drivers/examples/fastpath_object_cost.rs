//! Per-packet cost of object mode's fast path: the BPF programs by `BPF_PROG_TEST_RUN` (the
//! kernel's own timer) and the TRODS engine (`Engine::packet_parsed` after `IpInfo::parse`, as
//! the agent's core calls it; this thread's CPU time), on the same packets and state: a
//! download whose first response segment is stored (IPv4, timestamps), so that a client ACK
//! inside the response and a body segment pass. Repeated runs see the packet as the previous
//! one left the state (the body segment is a retransmission after the first run; the tc
//! program's rewrite is timed one run at a time, since a repeat would find the ACK lowered
//! already). Neither includes what surrounds it (NFQUEUE's round trip for the engine; the
//! skb's trip through netfilter and tc for the programs). Root only.
//!
//! sudo target/release/examples/fastpath_object_cost [--repeat N]

use std::hint::black_box;
use std::net::SocketAddr;

use unbroken_drivers::fastpath::object::{self, monotonic_ns, Object, Prog, State, Steer};
use unbroken_engines::trods::{Action, Config, Dir, Engine, Key};
use unbroken_engines::Verdict;
use unbroken_wire::ip::{self, IpInfo};
use unbroken_wire::marker::marker_mac;
use unbroken_wire::tcp::{flags as F, Packet as Tcp, Repr};
use unbroken_wire::Seq;

const C_ISN: u32 = 1_000_000;
const S_ISN: u32 = 4_294_960_000;

fn build(src: SocketAddr, dst: SocketAddr, r: Repr, payload: &[u8]) -> Vec<u8> {
    let r = Repr { src_port: src.port(), dst_port: dst.port(), ..r };
    let tl = r.header_len() + payload.len();
    let mut buf = vec![0u8; 60 + tl];
    let hl = ip::emit_header(&mut buf, src.ip(), dst.ip(), ip::PROTO_TCP, tl).unwrap();
    r.emit(&mut buf[hl..]).unwrap();
    buf[hl + r.header_len()..hl + tl].copy_from_slice(payload);
    Tcp::new_checked(&mut buf[hl..hl + tl]).unwrap().fill_checksum(ip::pseudo_sum(src.ip(), dst.ip(), ip::PROTO_TCP, tl));
    buf.truncate(hl + tl);
    buf
}

fn main() {
    let mut repeat: u32 = 1_000_000;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--repeat" => repeat = args.next().and_then(|v| v.parse().ok()).expect("--repeat N"),
            _ => panic!("usage: fastpath_object_cost [--repeat N]"),
        }
    }
    let key = Key { client: "10.77.0.2:40000".parse().unwrap(), service: "10.77.0.100:80".parse().unwrap() };
    let cs = |o: u32| C_ISN.wrapping_add(1).wrapping_add(o);
    let ss = |o: u32| S_ISN.wrapping_add(1).wrapping_add(o);
    let c = |seq, ack, flags, pl: &[u8]| build(key.client, key.service, Repr { seq: Seq(seq), ack: Seq(ack), flags, window: 500, timestamp: Some((77, 1000)), ..Default::default() }, pl);
    let s = |seq, ack, flags, pl: &[u8]| build(key.service, key.client, Repr { seq: Seq(seq), ack: Seq(ack), flags, window: 1000, timestamp: Some((1000, 77)), ..Default::default() }, pl);
    let mut e = Engine::new(Config::default());
    let mut now = 1000;
    let feed = |e: &mut Engine, dir, mut p: Vec<u8>, now: &mut u64| {
        *now += 1;
        let v = e.packet(0, &mut p, dir, *now);
        while let Some(a) = e.poll_action() {
            match a {
                Action::Store { token, .. } | Action::Delete { token, .. } => e.store_done(token, true),
            }
        }
        while e.take_released().is_some() {}
        while e.take_injected().is_some() {}
        v
    };
    let syn = build(key.client, key.service, Repr { seq: Seq(C_ISN), flags: F::SYN, window: 64240, mss: Some(1400), wscale: Some(7), sack_perm: true, timestamp: Some((5, 0)), ..Default::default() }, b"");
    feed(&mut e, Dir::FromClient, syn, &mut now);
    let sa = build(key.service, key.client, Repr { seq: Seq(S_ISN), ack: Seq(cs(0)), flags: F::SYN | F::ACK, window: 65160, mss: Some(1460), wscale: Some(9), sack_perm: true, timestamp: Some((9, 5)), ..Default::default() }, b"");
    feed(&mut e, Dir::ToClient, sa, &mut now);
    feed(&mut e, Dir::FromClient, c(cs(0), ss(0), F::ACK, b""), &mut now);
    let req = b"GET /big.bin HTTP/1.1\r\nHost: s\r\n\r\n";
    let req_end = req.len() as u32;
    feed(&mut e, Dir::FromClient, c(cs(0), ss(0), F::ACK | F::PSH, req), &mut now);
    let mut first = b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\nETag: \"e1\"\r\n\r\n".to_vec();
    first.resize(1448, 7);
    feed(&mut e, Dir::ToClient, s(ss(0), cs(req_end), F::ACK, &first), &mut now);

    let mut fp = Object::load().unwrap_or_else(|err| panic!("{err}"));
    let bucket = 7;
    fp.set_lease(bucket, monotonic_ns() + 3_600_000_000_000).unwrap();
    // The agent's own lease: without it the filters pass nothing.
    fp.set_alive(monotonic_ns() + 3_600_000_000_000);
    let k = object::Key::new(&key);
    let publish = |fp: &mut Object, e: &Engine| fp.insert(&k, &State::publish(&e.fast_view(&key).unwrap(), Some(bucket), true, monotonic_ns())).unwrap();
    publish(&mut fp, &e);
    let mac = marker_mac(bucket);
    let ack = c(cs(req_end), ss(1000), F::ACK, b"");
    let seg = s(ss(1448), cs(req_end), F::ACK, &[9u8; 1448]);
    let syn2 = c(cs(req_end), ss(1000), F::SYN, b"");

    println!("{:<52} {:>12} {:>14}", "packet", "BPF ns/pkt", "engine ns/pkt");
    let engine = |e: &mut Engine, dir: Dir, p: &[u8], n: u32| -> f64 {
        let t0 = thread_cpu_ns();
        for i in 0..n {
            let mut buf = p.to_vec();
            let info = IpInfo::parse(&buf).unwrap();
            black_box(e.packet_parsed(i as u64, &mut buf, &info, dir, 5000, false));
        }
        (thread_cpu_ns() - t0) as f64 / n as f64
    };
    for (what, prog, dir, p) in [("client pure ACK inside the response (passed)", Prog::FromClient, Dir::FromClient, &ack), ("server body segment, 1448 B (passed)", Prog::ToClient, Dir::ToClient, &seg)] {
        publish(&mut fp, &e);
        assert_eq!(fp.run(prog, p, mac, 0).unwrap().steer(), Steer::Pass, "{what}");
        let bpf = fp.time_per_packet(prog, p, mac, repeat).unwrap();
        let mut buf = p.to_vec();
        assert!(matches!(e.packet(0, &mut buf, dir, 5000), Verdict::Accept { .. }));
        let eng = engine(&mut e, dir, p, repeat);
        println!("{:<52} {:>12} {:>14.0}", what, bpf.as_nanos(), eng);
    }
    // tc egress, the ACK lowered (one run at a time: a repeat would find it lowered already).
    let n = (repeat / 10).max(1000);
    let mut total = std::time::Duration::ZERO;
    for _ in 0..n {
        total += fp.time_per_packet(Prog::ToClientTc, &seg, mac, 1).unwrap();
    }
    println!("{:<52} {:>12} {:>14}", "tc egress: server segment, ACK lowered", (total / n).as_nanos(), "(in the above)");
    let lowered = fp.run(Prog::ToClientTc, &seg, mac, 0).unwrap().packet;
    let bpf = fp.time_per_packet(Prog::ToClientTc, &lowered, mac, repeat).unwrap();
    println!("{:<52} {:>12} {:>14}", "tc egress: ACK at the hold already (nothing to do)", bpf.as_nanos(), "-");
    publish(&mut fp, &e);
    let bpf = fp.time_per_packet(Prog::FromClient, &syn2, mac, repeat).unwrap();
    println!("{:<52} {:>12} {:>14}", "slow: client SYN (parse, lookup, flags)", bpf.as_nanos(), "-");
    fp.remove(&k).unwrap();
    let bpf = fp.time_per_packet(Prog::ToClient, &seg, mac, repeat).unwrap();
    println!("{:<52} {:>12} {:>14}", "slow: no entry (parse, lookup)", bpf.as_nanos(), "-");
}

/// This thread's CPU time in nanoseconds.
fn thread_cpu_ns() -> u128 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(r, 0, "clock_gettime");
    ts.tv_sec as u128 * 1_000_000_000 + ts.tv_nsec as u128
}
