//! Per-packet cost of replica mode's backup half: the BPF programs (`rep_b_in`, `rep_b_out`) by
//! `BPF_PROG_TEST_RUN` (the kernel's own timer around each run) and the Rust engine
//! (`replica::Backup::incoming` / `outgoing`, this thread's CPU time), on the same packets of
//! one aligned connection with Δ, a timestamp offset and window scaling, so every rewrite
//! happens. Output: a stream of fresh consecutive segments (each digested and kept once), one
//! run each. Client ACKs: the same packet again and again (the state does not move after the
//! first). Neither includes what surrounds it in a daemon (NFQUEUE's round trip and the copy to
//! user space for the engine; the skb's trip through tc for the programs). Root only.
//!
//! sudo target/release/examples/fastpath_replica_cost [--segments N] [--repeat N]

use std::hint::black_box;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use unbroken_drivers::fastpath::replica::{flag, Direction, Key, Replica, State, CONSUMED};
use unbroken_drivers::fastpath::Verdict;
use unbroken_engines::replica::Backup;
use unbroken_wire::ip;
use unbroken_wire::tcp::{flags as F, Repr};
use unbroken_wire::Seq;

const C_ISN: u32 = 77_777;
const P_ISN: u32 = 0xffff_f000;
const B_ISN: u32 = 1_000;
const P_TS0: u32 = 4_000_000_000;
const B_TS0: u32 = 12;

fn cli() -> IpAddr {
    "10.0.9.2".parse().unwrap()
}
fn svc() -> IpAddr {
    "10.0.0.1".parse().unwrap()
}
fn from_client(r: Repr, payload: &[u8]) -> Vec<u8> {
    ip::tcp_packet(cli(), svc(), &Repr { src_port: 40000, dst_port: 6379, ..r }, payload).unwrap()
}
fn from_server(r: Repr, payload: &[u8]) -> Vec<u8> {
    ip::tcp_packet(svc(), cli(), &Repr { src_port: 6379, dst_port: 40000, ..r }, payload).unwrap()
}
fn server_seg(off: u32, len: usize) -> Vec<u8> {
    from_server(Repr { seq: Seq(B_ISN + 1 + off), ack: Seq(C_ISN + 1), flags: F::ACK | F::PSH, window: 500, timestamp: Some((B_TS0 + 5, 501)), ..Default::default() }, &vec![0x5a; len])
}

/// The aligned engine and the entry the daemon installs for it (the fields as the handshake
/// leaves them: ST-TCP 3.3.0.1 (1)-(3)).
fn aligned() -> (Backup, State) {
    let mut b = Backup::new();
    b.incoming(&mut from_client(Repr { seq: Seq(C_ISN), flags: F::SYN, window: 65535, mss: Some(1460), wscale: Some(7), sack_perm: true, timestamp: Some((500, 0)), ..Default::default() }, &[]));
    b.outgoing(&mut from_server(Repr { seq: Seq(B_ISN), ack: Seq(C_ISN + 1), flags: F::SYN | F::ACK, window: 65535, mss: Some(1460), wscale: Some(7), sack_perm: true, timestamp: Some((B_TS0, 500)), ..Default::default() }, &[]));
    b.incoming(&mut from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1)), flags: F::ACK, window: 512, timestamp: Some((501, P_TS0)), ..Default::default() }, &[]));
    let delta = P_ISN.wrapping_sub(B_ISN);
    let st = State {
        out_hash: unbroken_wire::replica::HASH_INIT,
        flags: flag::ALIGNED | flag::RCV_KNOWN | flag::CLIENT_SEEN | flag::ACKED_B | flag::TS_FLOOR | flag::CTS_MAX | flag::CTS | flag::B_TS | flag::SERVER | flag::STRICT,
        delta,
        ts_off: P_TS0.wrapping_sub(B_TS0),
        snd_max: B_ISN + 1,
        rcv_nxt: C_ISN + 1,
        rcv_edge: C_ISN + 1 + 65535,
        out_end: P_ISN.wrapping_add(1),
        last_ack: P_ISN.wrapping_add(1),
        acked_b: B_ISN + 1,
        ts_floor: P_TS0,
        cts_max_val: 501,
        cts_max_ecr: P_TS0,
        cts_val: 501,
        cts_ecr: P_TS0,
        b_ts_val: B_TS0,
        server: unbroken_drivers::fastpath::replica::addr16(svc()),
        client_win: 512,
        ws_b: 7,
        ..State::default()
    };
    (b, st)
}

fn main() {
    let (mut segments, mut repeat) = (4000usize, 200_000u32);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--segments" => segments = args.next().and_then(|v| v.parse().ok()).expect("--segments N"),
            "--repeat" => repeat = args.next().and_then(|v| v.parse().ok()).expect("--repeat N"),
            _ => panic!("usage: fastpath_replica_cost [--segments N] [--repeat N]"),
        }
    }
    let mut fp = Replica::load().unwrap_or_else(|e| panic!("{e}"));
    let key = Key::new(SocketAddr::new(cli(), 40000), 6379);
    println!("{:<58} {:>10} {:>12}", "packet", "BPF ns", "engine ns");

    // Output: fresh segments, each digested and kept once (rep_b_out / Backup::outgoing).
    for len in [0usize, 100, 1448, 3000] {
        let (mut b, st) = aligned();
        fp.insert(&key, &st).unwrap();
        let pkts: Vec<Vec<u8>> = (0..segments).map(|i| server_seg((i * len) as u32, len)).collect();
        let mut bpf = Duration::ZERO;
        for (i, p) in pkts.iter().enumerate() {
            bpf += fp.time_per_packet(Direction::Outgoing, p, 1).unwrap();
            if i % 256 == 0 {
                black_box(fp.records());
            }
        }
        let last = fp.run(Direction::Outgoing, &server_seg((segments * len) as u32, len)).unwrap().verdict;
        assert_eq!(last, CONSUMED, "not claimed");
        black_box(fp.records());
        let mut bufs = pkts.clone();
        let t0 = thread_cpu_ns();
        for p in bufs.iter_mut() {
            black_box(b.outgoing(p));
        }
        let engine = (thread_cpu_ns() - t0) as f64 / segments as f64;
        let what = if len == 0 { "server pure ACK (withheld; ACK, window, TSval learned)".to_string() } else { format!("server {len} B output (withheld, digested, kept)") };
        println!("{:<58} {:>10} {:>12.0}", what, bpf.as_nanos() / segments as u128, engine);
    }

    // Client segments (rep_b_in / Backup::incoming): the same packet again and again.
    let mut sack = [(Seq(0), Seq(0)); 4];
    sack[0] = (Seq(P_ISN.wrapping_add(1 + 3000)), Seq(P_ISN.wrapping_add(1 + 4448)));
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("client pure ACK, TS, 1 SACK block (ACK/SACK - Δ, TSecr)", from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1 + 1448)), flags: F::ACK, window: 512, timestamp: Some((600, P_TS0 + 5)), sack, sack_len: 1, ..Default::default() }, &[])),
        ("client 1448 B data, TS (checksum verified)", from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1 + 1448)), flags: F::ACK | F::PSH, window: 512, timestamp: Some((600, P_TS0 + 5)), ..Default::default() }, &[7u8; 1448])),
    ];
    for (what, pkt) in cases {
        let (mut b, st) = aligned();
        // The backup's server sent 4448 bytes: the ACK and the SACK block lie within it.
        b.outgoing(&mut server_seg(0, 4448 - 1448));
        b.outgoing(&mut server_seg(3000, 1448));
        fp.insert(&key, &State { snd_max: B_ISN + 1 + 4448, ..st }).unwrap();
        let mut bpf = Duration::ZERO;
        let n = (repeat / 10).max(1);
        for _ in 0..n {
            bpf += fp.time_per_packet(Direction::Incoming, &pkt, 1).unwrap();
        }
        let v = fp.run(Direction::Incoming, &pkt).unwrap().verdict;
        assert_eq!(v, Verdict::Done, "{what}: not claimed");
        let looped = fp.time_per_packet(Direction::Incoming, &pkt, repeat).unwrap();
        let mut buf = pkt.clone();
        let t0 = thread_cpu_ns();
        for _ in 0..repeat {
            buf.copy_from_slice(&pkt);
            black_box(b.incoming(&mut buf));
        }
        let engine = (thread_cpu_ns() - t0) as f64 / repeat as f64;
        println!("{:<58} {:>10} {:>12.0}   (kernel repeat loop: {} ns)", what, bpf.as_nanos() / n as u128, engine, looped.as_nanos());
    }

    // The primary's pure ACKs (rep_p_in / Primary::incoming, rep_p_out / Primary::outgoing's
    // gate and stamp): the backup behind, so the ACK is lowered and the window recomputed.
    {
        use unbroken_drivers::fastpath::replica::{pflag, PState, PrimaryDirection};
        use unbroken_engines::replica::{Config, Primary};
        use unbroken_wire::replica::{self as rw, ConnProgress, Progress, Role};
        let mut p = Primary::new(Config::default());
        p.incoming(&from_client(Repr { seq: Seq(C_ISN), flags: F::SYN, window: 65535, mss: Some(1460), wscale: Some(7), sack_perm: true, timestamp: Some((500, 0)), ..Default::default() }, &[]));
        p.outgoing(&mut from_server(Repr { seq: Seq(P_ISN), ack: Seq(C_ISN + 1), flags: F::SYN | F::ACK, window: 65535, mss: Some(1460), wscale: Some(7), sack_perm: true, timestamp: Some((P_TS0, 500)), ..Default::default() }, &[]), 0);
        let rec = ConnProgress { client: cli(), client_port: 40000, server_port: 6379, rcv_nxt: Seq(C_ISN + 1), rcv_edge: Seq(C_ISN + 1 + 100_000), out_end: Seq(P_ISN.wrapping_add(1)), out_hash: rw::HASH_INIT, last_ack: Seq(0), isn: Seq(B_ISN), flags: rw::flag::RCV_KNOWN | rw::flag::ALIGNED | rw::flag::ISN_KNOWN };
        p.backup_progress(&Progress { role: Role::Backup, beat: 1, flags: 0, records: vec![rec] }, 1);
        p.take_transmit();
        p.incoming(&from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1)), flags: F::ACK, window: 512, timestamp: Some((501, P_TS0)), ..Default::default() }, &[]));
        let st = PState {
            flags: pflag::ANSWERED | pflag::ESTABLISHED | pflag::B | pflag::B_RCV_KNOWN | pflag::TS | pflag::TS_MAX | pflag::SENT_ACK | pflag::CLIENT_LAST | pflag::CL_TS,
            ack_p: C_ISN + 1,
            edge_p: C_ISN + 1 + (65535 << 7),
            b_rcv_nxt: C_ISN + 1,
            b_rcv_edge: C_ISN + 1 + 100_000,
            ts_val: P_TS0,
            ts_ecr: 500,
            ts_max: P_TS0,
            sent_ack: C_ISN + 1,
            snd_p: P_ISN.wrapping_add(1),
            p_max: P_ISN.wrapping_add(1),
            stream_start: P_ISN.wrapping_add(1),
            client_ack: P_ISN.wrapping_add(1),
            cl_end: C_ISN + 1,
            cl_ts_val: 501,
            cl_ts_ecr: P_TS0,
            cl_win: 512,
            ws_p: 7,
            // 1,448 bytes released already: the output row is a retransmission of them.
            rel: P_ISN.wrapping_add(1 + 1448),
            p_end: P_ISN.wrapping_add(1 + 1448),
            snd_c: P_ISN.wrapping_add(1 + 1448),
            ..PState::default()
        };
        let cases: Vec<(&str, PrimaryDirection, Vec<u8>)> = vec![
            ("primary: server pure ACK, TS (gate: ACK lowered, window)", PrimaryDirection::Outgoing, from_server(Repr { seq: Seq(P_ISN.wrapping_add(1)), ack: Seq(C_ISN + 1 + 5000), flags: F::ACK, window: 700, timestamp: Some((P_TS0 + 3, 600)), ..Default::default() }, &[])),
            ("primary: 1448 B output, TS, retransmission of released bytes (gate)", PrimaryDirection::Outgoing, from_server(Repr { seq: Seq(P_ISN.wrapping_add(1)), ack: Seq(C_ISN + 1 + 5000), flags: F::ACK | F::PSH, window: 700, timestamp: Some((P_TS0 + 3, 600)), ..Default::default() }, &[9u8; 1448])),
            ("primary: client pure ACK, TS (learned, unchanged)", PrimaryDirection::Incoming, from_client(Repr { seq: Seq(C_ISN + 1), ack: Seq(P_ISN.wrapping_add(1)), flags: F::ACK, window: 512, timestamp: Some((600, P_TS0 + 3)), ..Default::default() }, &[])),
        ];
        for (what, d, pkt) in cases {
            fp.p_insert(&key, &st).unwrap();
            let mut bpf = Duration::ZERO;
            let n = (repeat / 10).max(1);
            for _ in 0..n {
                bpf += fp.primary_time_per_packet(d, &pkt, 1).unwrap();
            }
            assert_eq!(fp.run_primary(d, &pkt).unwrap().verdict, Verdict::Done, "{what}: not claimed");
            let looped = fp.primary_time_per_packet(d, &pkt, repeat).unwrap();
            let mut buf = pkt.clone();
            let t0 = thread_cpu_ns();
            for i in 0..repeat {
                buf.copy_from_slice(&pkt);
                match d {
                    PrimaryDirection::Outgoing => black_box(p.outgoing(&mut buf, 2 + i as u64)),
                    PrimaryDirection::Incoming => black_box(p.incoming(&buf)),
                };
            }
            let engine = (thread_cpu_ns() - t0) as f64 / repeat as f64;
            println!("{:<58} {:>10} {:>12.0}   (kernel repeat loop: {} ns)", what, bpf.as_nanos() / n as u128, engine, looped.as_nanos());
        }
    }

    // What the programs pay before they decline: no entry.
    fp.remove(&key).unwrap();
    let p = server_seg(0, 1448);
    let t = fp.time_per_packet(Direction::Outgoing, &p, repeat).unwrap();
    assert_eq!(fp.run(Direction::Outgoing, &p).unwrap().verdict, Verdict::Slow);
    println!("{:<58} {:>10} {:>12}", "server 1448 B, no entry (parse + lookup)", t.as_nanos(), "-");
}

/// This thread's CPU time in nanoseconds.
fn thread_cpu_ns() -> u128 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(r, 0, "clock_gettime");
    ts.tv_sec as u128 * 1_000_000_000 + ts.tv_nsec as u128
}
