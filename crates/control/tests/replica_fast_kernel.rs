//! The backup's core with its fast path on, over the real programs and map (`fastmap::
//! KernelMap`, packets through `rep_b_in` / `rep_b_out` by `BPF_PROG_TEST_RUN`, copy mode as
//! attached), against a core without it: for a steady stream of requests and replies, with the
//! primary's reports, the engine's view of the connection (its fields, checkpoints, kept
//! copies) is the same on both paths after every round. Root only
//! (SKIP otherwise; a failure with `UNBROKEN_REQUIRE_LAB=1`); no namespace.

use std::net::SocketAddr;

use unbroken_control::daemon::{Meta, Mode, Outbox};
use unbroken_control::replica::core::{Boot, Core, Fast, Request, Settings, State};
use unbroken_control::replica::fastmap::KernelMap;
use unbroken_drivers::fastpath::replica::{Direction, Replica, CONSUMED};
use unbroken_drivers::fastpath::Verdict as FpVerdict;
use unbroken_engines::replica::{BFast, Config, ConnKey, DetectorConfig};
use unbroken_wire::ctl::Key;
use unbroken_wire::replica::{flag, hdr, ConnProgress, Progress, Role, Session};
use unbroken_wire::tcp::{self, flags as F};
use unbroken_wire::Seq;

const CLIENT: &str = "10.0.0.9";
const SERVICE: &str = "10.77.3.10";
const PORT: u16 = 6379;
const CPORT: u16 = 40100;
const P_ISN: u32 = 0xfff0_0000;
const B_ISN: u32 = 7000;
const C_ISN: u32 = 0x8000_0000;

fn programs(test: &str) -> Option<Replica> {
    match Replica::load() {
        Ok(r) => Some(r),
        Err(e) => {
            if std::env::var("UNBROKEN_REQUIRE_LAB").is_ok_and(|v| v == "1") {
                panic!("{test}: {e}");
            }
            eprintln!("SKIP {test}: {e}");
            None
        }
    }
}

fn key() -> Key {
    Key::from_hex("00112233445566778899aabbccddeeff").unwrap()
}

fn peer() -> SocketAddr {
    "10.77.3.11:7790".parse().unwrap()
}

fn backup(strict: bool) -> Core {
    let engine = Config { strict, ..Config::default() };
    let s = Settings { role: Role::Backup, detector: DetectorConfig { interval_ms: 10, misses: 3 }, engine, finished_grace_ms: 1000 };
    Core::new(s, key(), peer(), Boot { id: 0xbb, secret: [7; 32] }, 0)
}

fn conn() -> ConnKey {
    ConnKey { client: CLIENT.parse().unwrap(), client_port: CPORT, server_port: PORT }
}

fn pkt(from_client: bool, seq: u32, ack: u32, flags: u8, ts: (u32, u32), payload: &[u8]) -> Vec<u8> {
    let (sp, dp, src, dst) = if from_client { (CPORT, PORT, CLIENT, SERVICE) } else { (PORT, CPORT, SERVICE, CLIENT) };
    let r = tcp::Repr { src_port: sp, dst_port: dp, seq: Seq(seq), ack: Seq(ack), flags, window: 500, timestamp: Some(ts), ..Default::default() };
    unbroken_wire::ip::tcp_packet(src.parse().unwrap(), dst.parse().unwrap(), &r, payload).unwrap()
}

fn queue(c: &mut Core, now: u64, p: &[u8], outgoing: bool, mark: u32) -> Vec<Vec<u8>> {
    let mut buf = p.to_vec();
    let len = buf.len();
    buf.resize(len + 64, 0);
    let meta = Meta { id: 1, hook: if outgoing { 3 } else { 0 }, mark, ..Meta::default() };
    let mut out = Outbox::default();
    c.packet(now, meta, &mut buf, len, &mut out);
    c.collect(&mut out);
    c.after_flush(now);
    out.send
}

/// A scripted primary (binds both cores, sends both the same reports) with the cores' `strict`.
struct Primary {
    beat: u64,
    strict: bool,
}

impl Primary {
    fn msg(&mut self, echo: (u64, u64), records: Vec<ConnProgress>) -> Vec<u8> {
        self.beat += 1;
        let s = Session { boot: 0xaa, nonce_t: self.beat, nonce: 0x5eed ^ self.beat, echo_t: echo.0, echo: echo.1 };
        let flags = if self.strict { 0 } else { hdr::RELAXED };
        Progress { role: Role::Primary, beat: self.beat, flags, records }.emit_session(&s, &key()).unwrap()
    }
}

fn echo_of(c: &mut Core, now: u64) -> (u64, u64) {
    let mut out = Outbox::default();
    c.tick(now, &mut out);
    c.collect(&mut out);
    let mut e = (0, 0);
    for r in &out.requests {
        if let Request::Side(d) = r {
            let (_, s) = Progress::parse_session(d, &key()).unwrap();
            e = (s.nonce_t, s.nonce);
        }
    }
    e
}

/// The engine's view on the fast path: the map's fields while the programs own them.
fn effective(c: &mut Core, m: &mut KernelMap) -> BFast {
    let k = conn();
    let mut f = if c.fast_where(&k) == Fast::Kernel {
        use unbroken_control::replica::core::FastMap;
        m.collect(&k, 0).and_then(|f| f.backup()).expect("an entry")
    } else {
        c.backup().unwrap().fast_state(&k).unwrap()
    };
    // When the server's newest TSval was seen is each path's own clock.
    f.b_ts_seen = f.b_ts_seen.map(|(v, _)| (v, 0));
    f
}

fn strip(mut f: BFast) -> BFast {
    f.b_ts_seen = f.b_ts_seen.map(|(v, _)| (v, 0));
    f
}

struct Run {
    claimed_in: u32,
    claimed_out: u32,
    slow: u32,
}

fn steady_stream(strict: bool) -> Option<Run> {
    let test = "replica_fast_kernel::steady_stream";
    let mut fp = programs(test)?;
    fp.set_egress_copy(true).unwrap();
    fp.add_service(SocketAddr::new(SERVICE.parse().unwrap(), PORT)).unwrap();
    // The map is shared between the core (through the box) and the test's program runs: the
    // test runs packets through a second handle to the same loaded object, which it keeps.
    let mut a = backup(strict);
    let mut b = backup(strict);
    let km = KernelMap::new(fp, strict, None);
    let shared = std::sync::Arc::new(std::sync::Mutex::new(km));
    b.enable_fast_path(Box::new(Handle(shared.clone())));
    let mut p = Primary { beat: 0, strict };
    for c in [&mut a, &mut b] {
        let e = echo_of(c, 0);
        c.side(0, peer(), &p.msg(e, vec![]));
        assert_eq!(c.state(), State::Protecting);
    }
    let mut run = Run { claimed_in: 0, claimed_out: 0, slow: 0 };
    let delta = P_ISN.wrapping_sub(B_ISN);
    let mut now = 1;
    // One packet both ways: the plain core from the queue, the fast one through the programs
    // first (a claimed packet never reaches its queue; a declined client packet does, marked
    // if counted; a server packet reaches its core only as ring records).
    let step = |a: &mut Core, b: &mut Core, now: u64, p: &[u8], from_client: bool, run: &mut Run| {
        queue(a, now, p, !from_client, 0);
        let mut m = shared.lock().unwrap();
        let slow_before = m.fp.entry(&unbroken_control::replica::fastmap::key_of(&conn())).unwrap().map_or(0, |e| e.slow);
        let r = m.fp.run(if from_client { Direction::Incoming } else { Direction::Outgoing }, p).unwrap();
        let slow_after = m.fp.entry(&unbroken_control::replica::fastmap::key_of(&conn())).unwrap().map_or(0, |e| e.slow);
        drop(m);
        let counted = slow_after > slow_before;
        if from_client {
            match r.verdict {
                FpVerdict::Done => run.claimed_in += 1,
                // Dropped by decision (TC_ACT_SHOT: TCX ignores STOLEN).
                FpVerdict::Drop => run.claimed_in += 1,
                FpVerdict::Slow => {
                    run.slow += 1;
                    queue(b, now, p, false, if counted { 0x1000_0000 } else { 0 });
                }
                v => panic!("rep_b_in: {v:?}"),
            }
        } else {
            assert_eq!(r.verdict, CONSUMED, "copy mode: the server's packets never pass");
            if counted {
                run.slow += 1;
            } else if b.fast_where(&conn()) == Fast::Kernel {
                run.claimed_out += 1;
            }
            b.fast_records(now);
            b.after_flush(now);
        }
    };
    let ts = |t: u32| (t, 0);
    // Handshake: the SYN from the queue, the SYN-ACK copied, the ACK aligns (and installs).
    step(&mut a, &mut b, now, &pkt(true, C_ISN, 0, F::SYN, (100, 0), &[]), true, &mut run);
    step(&mut a, &mut b, now, &pkt(false, B_ISN, C_ISN + 1, F::SYN | F::ACK, (5000, 100), &[]), false, &mut run);
    step(&mut a, &mut b, now, &pkt(true, C_ISN + 1, P_ISN + 1, F::ACK, (101, 9000), &[]), true, &mut run);
    assert_eq!(b.fast_where(&conn()), Fast::Kernel, "installed once aligned");
    let (mut c_seq, mut b_seq) = (C_ISN + 1, B_ISN + 1);
    let mut tsv = 102u32;
    for i in 0..60u32 {
        now += 1;
        tsv += 1;
        let req = vec![b'r'; 40 + (i as usize % 7)];
        // The request, its data ACKed and answered in two segments (one 1,448, one smaller).
        step(&mut a, &mut b, now, &pkt(true, c_seq, b_seq.wrapping_add(delta), F::ACK | F::PSH, ts(tsv), &req), true, &mut run);
        c_seq = c_seq.wrapping_add(req.len() as u32);
        let reply1 = vec![(i % 251) as u8; 1448];
        let reply2 = vec![(i % 13) as u8; 300 + i as usize];
        step(&mut a, &mut b, now, &pkt(false, b_seq, c_seq, F::ACK, (5000 + i, tsv), &reply1), false, &mut run);
        b_seq = b_seq.wrapping_add(1448);
        step(&mut a, &mut b, now, &pkt(false, b_seq, c_seq, F::ACK | F::PSH, (5000 + i, tsv), &reply2), false, &mut run);
        b_seq = b_seq.wrapping_add(reply2.len() as u32);
        // The client's ACK of the reply (the primary's space), sometimes twice (a duplicate).
        tsv += 1;
        let ack = pkt(true, c_seq, b_seq.wrapping_add(delta), F::ACK, ts(tsv), &[]);
        step(&mut a, &mut b, now, &ack, true, &mut run);
        if i % 9 == 4 {
            step(&mut a, &mut b, now, &ack, true, &mut run);
        }
        // A retransmission of the reply's last segment now and then (the engine's: the ACK
        // covered it; ... or a resend the client had not acknowledged yet).
        if i % 11 == 7 {
            step(&mut a, &mut b, now, &pkt(false, b_seq.wrapping_sub(reply2.len() as u32), c_seq, F::ACK | F::PSH, (5000 + i, tsv), &reply2), false, &mut run);
        }
        // The primary's report every few rounds: its verified output end and the client's ACK.
        if i % 5 == 0 {
            let rec = ConnProgress { client: CLIENT.parse().unwrap(), client_port: CPORT, server_port: PORT, rcv_nxt: Seq(c_seq), rcv_edge: Seq(c_seq.wrapping_add(64_000)), out_end: Seq(b_seq.wrapping_add(delta)), out_hash: 0, last_ack: Seq(b_seq.wrapping_add(delta)), isn: Seq(P_ISN), flags: flag::ISN_KNOWN | flag::ALIGNED | flag::RCV_KNOWN };
            for c in [&mut a, &mut b] {
                let e = echo_of(c, now);
                c.side(now, peer(), &p.msg(e, vec![rec]));
            }
        }
        let fa = strip(a.backup().unwrap().fast_state(&conn()).unwrap());
        let fb = effective(&mut b, &mut shared.lock().unwrap());
        assert_eq!(fa, fb, "round {i}: the fields differ (plain vs fast path)");
        let (sa, sb) = (a.backup().unwrap().side(&conn()).unwrap(), b.backup().unwrap().side(&conn()).unwrap());
        assert_eq!(sa.checkpoints, sb.checkpoints, "round {i}: checkpoints");
        assert_eq!(sa.kept, sb.kept, "round {i}: kept copies");
    }
    Some(run)
}

/// The core's box and the test share one `KernelMap`.
struct Handle(std::sync::Arc<std::sync::Mutex<KernelMap>>);

impl unbroken_control::replica::core::FastMap for Handle {
    fn take(&mut self, key: &ConnKey, counted: bool, now_ms: u64) -> Option<unbroken_control::replica::core::Taken> {
        self.0.lock().unwrap().take(key, counted, now_ms)
    }
    fn apply(&mut self, op: &unbroken_control::replica::core::MapOp, now_ms: u64) -> unbroken_control::replica::core::MapDone {
        self.0.lock().unwrap().apply(op, now_ms)
    }
    fn collect(&mut self, key: &ConnKey, now_ms: u64) -> Option<unbroken_control::replica::core::Fields> {
        self.0.lock().unwrap().collect(key, now_ms)
    }
    fn records(&mut self) -> Vec<unbroken_control::replica::core::MapRecord> {
        self.0.lock().unwrap().records()
    }
    fn promote(&mut self) -> Result<(), String> {
        self.0.lock().unwrap().promote()
    }
}

#[test]
fn st_tcp_steady_stream_leaves_the_engine_as_the_queue_alone_would_strict_and_not() {
    for strict in [true, false] {
        let Some(run) = steady_stream(strict) else { return };
        eprintln!("strict={strict}: {} client packets and {} server packets claimed in the kernel, {} left to the slow path", run.claimed_in, run.claimed_out, run.slow);
        assert!(run.claimed_in > 100 && run.claimed_out > 100, "the kernel carried the stream");
    }
}
