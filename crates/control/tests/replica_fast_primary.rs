//! The primary's fast-path hand-off (`replica::core`'s fast half for `rep_p_in` / `rep_p_out`,
//! issue 22 item 4) against an emulated map that behaves as `rep_p_op` and the programs' slow
//! path (`bpf/replica/rep_tc.c`): a protected connection is installed once its handshake is
//! through and the backup follows, the backup's reports are decided on the programs' fields and
//! given back with the backup's figures, a declined packet of the server (copy mode) is decided
//! by the engine and sent by the raw socket before its connection goes back to the kernel, and
//! the fast path runs only while the pair protects (the OUTPUT rule's match takes the output
//! before the backup is heard, after a yield and once the backup failed). No kernel.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use unbroken_control::daemon::{Meta, Mode, Outbox};
use unbroken_control::replica::core::{Boot, Core, Fast, FastMap, Fields, MapDone, MapOp, MapRecord, Request, Settings, State, Taken};
use unbroken_engines::replica::{Config, ConnKey, DetectorConfig, PFast};
use unbroken_engines::Verdict;
use unbroken_wire::ctl::Key;
use unbroken_wire::replica::{flag, hdr, ConnProgress, Progress, Role, Session};
use unbroken_wire::tcp::{self, flags as F};
use unbroken_wire::Seq;

use common::emu::Entries;

const CLIENT: &str = "10.0.0.9";
const SERVICE: &str = "10.77.3.10";
const PORT: u16 = 6379;
const P_ISN: u32 = 9000;
const C_ISN: u32 = 1000;

fn key() -> Key {
    Key::from_hex("00112233445566778899aabbccddeeff").unwrap()
}

fn peer() -> SocketAddr {
    "10.77.3.11:7790".parse().unwrap()
}

/// A primary core with relaxed output commit (the primary's fast path carries only that).
fn primary() -> Core {
    let engine = Config { strict: false, ..Config::default() };
    let s = Settings { role: Role::Primary, detector: DetectorConfig { interval_ms: 10, misses: 3 }, engine, finished_grace_ms: 1000 };
    Core::new(s, key(), peer(), Boot { id: 0xaa, secret: [7; 32] }, 0)
}

/// The emulated map (its entries and the core's operations: [`common::emu::Entries`]).
#[derive(Default)]
struct Emu {
    map: Entries<PFast>,
    records: Vec<MapRecord>,
    /// What the OUTPUT rule's match says (`queue_out`); the daemon starts it on.
    queue_out: Option<bool>,
    output_at: Option<u64>,
    renewals: u32,
}

impl std::ops::Deref for Emu {
    type Target = Entries<PFast>;
    fn deref(&self) -> &Entries<PFast> {
        &self.map
    }
}

impl std::ops::DerefMut for Emu {
    fn deref_mut(&mut self) -> &mut Entries<PFast> {
        &mut self.map
    }
}

#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Emu>>);

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Emu> {
        self.0.lock().unwrap()
    }
    fn ops(&self) -> Vec<String> {
        std::mem::take(&mut self.lock().ops)
    }
    /// `rep_p_out` declines a packet of `k`: frozen and counted if it has an entry; the packet
    /// reaches the daemon as a copy (copy mode).
    fn decline_out(&self, k: &ConnKey, pkt: Vec<u8>) {
        let mut m = self.lock();
        let counted = m.decline(k);
        m.records.push(MapRecord::Slow { pkt, counted });
    }
    /// A program claims a packet of `k` and learns from it.
    fn claim(&self, k: &ConnKey, learn: impl FnOnce(&mut PFast)) {
        self.lock().claim(k, learn)
    }
}

impl FastMap for Shared {
    fn take(&mut self, key: &ConnKey, counted: bool, _: u64) -> Option<Taken> {
        self.lock().take(key, counted)
    }

    fn apply(&mut self, op: &MapOp, _: u64) -> MapDone {
        self.lock().apply(op)
    }

    fn collect(&mut self, key: &ConnKey, _: u64) -> Option<Fields> {
        self.lock().collect(key)
    }

    fn records(&mut self) -> Vec<MapRecord> {
        std::mem::take(&mut self.lock().records)
    }

    fn promote(&mut self) -> Result<(), String> {
        Err("a primary is never promoted".into())
    }

    fn queue_out(&mut self, on: bool) -> Result<(), String> {
        let mut m = self.lock();
        m.ops.push(format!("queue_out {on}"));
        m.queue_out = Some(on);
        Ok(())
    }

    fn output_at(&mut self, _: u64) -> Option<u64> {
        self.lock().output_at
    }

    fn renew_lease(&mut self) -> Result<(), String> {
        self.lock().renewals += 1;
        Ok(())
    }
}

fn conn(port: u16) -> ConnKey {
    ConnKey { client: CLIENT.parse().unwrap(), client_port: port, server_port: PORT }
}

fn client_pkt(port: u16, seq: u32, ack: u32, flags: u8, payload: &[u8]) -> Vec<u8> {
    let r = tcp::Repr { src_port: port, dst_port: PORT, seq: Seq(seq), ack: Seq(ack), flags, window: 1000, ..Default::default() };
    unbroken_wire::ip::tcp_packet(CLIENT.parse().unwrap(), SERVICE.parse().unwrap(), &r, payload).unwrap()
}

fn server_pkt(port: u16, seq: u32, ack: u32, flags: u8, payload: &[u8]) -> Vec<u8> {
    let r = tcp::Repr { src_port: PORT, dst_port: port, seq: Seq(seq), ack: Seq(ack), flags, window: 1000, ..Default::default() };
    unbroken_wire::ip::tcp_packet(SERVICE.parse().unwrap(), CLIENT.parse().unwrap(), &r, payload).unwrap()
}

/// A queued packet through the core, its verdict.
fn queue(c: &mut Core, now: u64, pkt: &[u8], outgoing: bool, mark: u32) -> Verdict {
    let mut buf = pkt.to_vec();
    let len = buf.len();
    buf.resize(len + 64, 0);
    let meta = Meta { id: 1, hook: if outgoing { 3 } else { 0 }, mark, ..Meta::default() };
    let mut out = Outbox::default();
    c.packet(now, meta, &mut buf, len, &mut out).0
}

/// A loop round's end: what the core sends (raw socket) and its requests, then the flush.
fn round(c: &mut Core, now: u64) -> (Vec<Vec<u8>>, Vec<Request>) {
    let mut out = Outbox::default();
    c.tick(now, &mut out);
    c.collect(&mut out);
    c.after_flush(now);
    (out.send, out.requests)
}

/// The scripted backup: binds the primary core, then reports.
struct Backup {
    beat: u64,
    echo: (u64, u64),
}

impl Backup {
    fn bind(c: &mut Core, now: u64) -> Backup {
        let mut b = Backup { beat: 0, echo: (0, 0) };
        let (_, reqs) = round(c, now);
        b.hear(&reqs);
        c.side(now, peer(), &b.msg(vec![]));
        assert_eq!(c.state(), State::Protecting);
        b
    }
    fn hear(&mut self, reqs: &[Request]) {
        for r in reqs {
            if let Request::Side(d) = r {
                let (_, s) = Progress::parse_session(d, &key()).unwrap();
                self.echo = (s.nonce_t, s.nonce);
            }
        }
    }
    fn msg(&mut self, records: Vec<ConnProgress>) -> Vec<u8> {
        self.beat += 1;
        let s = Session { boot: 0xbb, nonce_t: self.beat, nonce: 0x5eed ^ self.beat, echo_t: self.echo.0, echo: self.echo.1 };
        Progress { role: Role::Backup, beat: self.beat, flags: hdr::RELAXED, records }.emit_session(&s, &key()).unwrap()
    }
}

/// The backup's record of `port`: its server has the client's bytes up to `rcv_nxt`, aligned.
fn report(port: u16, rcv_nxt: u32, out_end: u32) -> ConnProgress {
    ConnProgress { client: CLIENT.parse().unwrap(), client_port: port, server_port: PORT, rcv_nxt: Seq(rcv_nxt), rcv_edge: Seq(rcv_nxt + 1000), out_end: Seq(out_end), out_hash: 0, last_ack: Seq(0), isn: Seq(P_ISN), flags: flag::ISN_KNOWN | flag::ALIGNED | flag::RCV_KNOWN }
}

/// A protected connection through its handshake: the SYN from the queue, the server's
/// SYN-ACK as copy mode brings it (held until the backup answered), the backup's report that
/// releases it, the client's ACK from the queue, the round's end.
fn protected(c: &mut Core, m: &Shared, b: &mut Backup, port: u16, now: u64) {
    queue(c, now, &client_pkt(port, C_ISN, 0, F::SYN, &[]), false, 0);
    m.decline_out(&conn(port), server_pkt(port, P_ISN, C_ISN + 1, F::SYN | F::ACK, &[]));
    c.fast_records(now);
    let (sent, _) = round(c, now);
    assert!(sent.is_empty(), "the SYN-ACK waits for the backup's server (Koch 7.1)");
    c.side(now, peer(), &b.msg(vec![report(port, C_ISN + 1, P_ISN + 1)]));
    let (sent, _) = round(c, now);
    assert_eq!(sent.len(), 1, "released once the backup answered");
    queue(c, now, &client_pkt(port, C_ISN + 1, P_ISN + 1, F::ACK, &[]), false, 0);
}

fn setup() -> (Core, Shared, Backup) {
    let mut c = primary();
    let m = Shared::default();
    c.enable_fast_path(Box::new(m.clone()));
    let b = Backup::bind(&mut c, 0);
    (c, m, b)
}

#[test]
fn the_output_goes_through_the_queue_until_the_backup_is_heard() {
    let mut c = primary();
    let m = Shared::default();
    c.enable_fast_path(Box::new(m.clone()));
    round(&mut c, 0);
    assert_eq!(m.lock().queue_out, None, "the daemon starts with the queue taking the output: nothing to switch");
    // A copy that slipped past: passed as the queue would pass it while waiting.
    m.decline_out(&conn(40000), server_pkt(40000, P_ISN + 1, C_ISN + 1, F::ACK, b"hi"));
    c.fast_records(1);
    let (sent, _) = round(&mut c, 1);
    assert_eq!(sent.len(), 1, "waiting for the backup, the primary passes its server's output");
    let _b = Backup::bind(&mut c, 20);
    round(&mut c, 21);
    assert!(m.ops().contains(&"queue_out false".to_string()), "protecting: the egress program carries the output");
}

#[test]
fn a_protected_connection_is_installed_after_its_handshake_and_its_ack_verdict() {
    let (mut c, m, mut b) = setup();
    round(&mut c, 1);
    m.ops();
    protected(&mut c, &m, &mut b, 41000, 2);
    assert!(!m.ops().iter().any(|o| o.starts_with("install")), "not before the ACK's verdict left");
    round(&mut c, 2);
    assert!(m.ops().contains(&"install 41000".to_string()));
    assert_eq!(c.fast_where(&conn(41000)), Fast::Kernel);
    let f = m.lock().entries[&conn(41000)].f;
    assert!(f.answered && f.established);
    assert_eq!(f.b.map(|b| b.2), Some(Seq(C_ISN + 1)), "the backup's RCV.NXT, for the gate");
    assert_eq!(f.rel, Seq(P_ISN + 1));
}

#[test]
fn a_backup_report_is_decided_on_the_programs_fields_and_gives_the_gate_the_new_figures() {
    let (mut c, m, mut b) = setup();
    protected(&mut c, &m, &mut b, 41001, 1);
    round(&mut c, 1);
    m.ops();
    // The programs passed 500 bytes of output and learned the client's ACK of them.
    m.claim(&conn(41001), |f| {
        f.p_end = Seq(P_ISN + 501);
        f.rel = Seq(P_ISN + 501);
        f.snd_c = Seq(P_ISN + 501);
        f.client_ack = Seq(P_ISN + 501);
        f.out_seen = true;
    });
    c.side(2, peer(), &b.msg(vec![report(41001, C_ISN + 101, P_ISN + 501)]));
    let ops = m.ops();
    assert_eq!(ops, ["freeze 41001", "thaw 41001"], "taken before the engine, given back at once");
    let f = m.lock().entries[&conn(41001)].f;
    assert_eq!(f.b.map(|b| b.2), Some(Seq(C_ISN + 101)), "the report's RCV.NXT is in the map");
    assert_eq!((f.p_end, f.client_ack), (Seq(P_ISN + 501), Seq(P_ISN + 501)), "and what the programs learned survived");
    // A report of a connection the programs do not carry touches nothing.
    c.side(3, peer(), &b.msg(vec![report(49999, C_ISN + 1, P_ISN + 1)]));
    assert!(m.ops().is_empty());
}

#[test]
fn a_declined_segment_is_decided_sent_and_only_then_given_back() {
    let (mut c, m, mut b) = setup();
    protected(&mut c, &m, &mut b, 41002, 1);
    round(&mut c, 1);
    m.ops();
    // A segment the program left to the slow path (e.g. its entry was frozen): copied, counted.
    let seg = server_pkt(41002, P_ISN + 1, C_ISN + 1, F::ACK | F::PSH, &[b'x'; 300]);
    m.decline_out(&conn(41002), seg.clone());
    c.fast_records(2);
    assert_eq!(m.ops(), ["take 41002"]);
    assert_eq!(c.fast_where(&conn(41002)), Fast::Held);
    let mut out = Outbox::default();
    c.tick(2, &mut out);
    c.collect(&mut out);
    assert_eq!(out.send.len(), 1, "relaxed: the engine passes it, the raw socket sends it");
    assert_eq!(&out.send[0][40..], &seg[40..], "its bytes as the server built them");
    assert!(!m.ops().iter().any(|o| o.starts_with("thaw")), "not given back before the send");
    c.after_flush(2);
    assert_eq!(m.ops(), ["thaw 41002"]);
    assert_eq!(c.fast_where(&conn(41002)), Fast::Kernel);
    assert_eq!(m.lock().entries[&conn(41002)].f.p_end, Seq(P_ISN + 301), "the engine's view of it went back to the kernel");
}

#[test]
fn a_yield_takes_every_connection_back_and_the_queue_drops_the_output() {
    let (mut c, m, mut b) = setup();
    protected(&mut c, &m, &mut b, 41003, 1);
    protected(&mut c, &m, &mut b, 41004, 1);
    round(&mut c, 1);
    m.ops();
    // The server's listening socket disappears (seen listening before): the host yields.
    c.server_listening(true);
    c.server_listening(false);
    round(&mut c, 2);
    assert_eq!(c.state(), State::Yielded);
    let ops = m.ops();
    for port in [41003, 41004] {
        assert!(ops.contains(&format!("freeze {port}")) && ops.contains(&format!("remove {port}")), "{ops:?}");
    }
    assert!(ops.contains(&"queue_out true".to_string()), "{ops:?}");
    assert!(m.lock().entries.is_empty());
    // A copy that crossed the switch: dropped like the queue's packets.
    m.decline_out(&conn(41003), server_pkt(41003, P_ISN + 1, C_ISN + 1, F::ACK, b"late"));
    c.fast_records(3);
    let (sent, _) = round(&mut c, 3);
    assert!(sent.is_empty(), "a yielded primary sends nothing of its server's");
    assert_eq!(queue(&mut c, 3, &server_pkt(41003, P_ISN + 1, C_ISN + 1, F::ACK, b"late"), true, 0), Verdict::Drop);
}

#[test]
fn a_failed_backup_ends_the_fast_path_and_the_gate_with_it() {
    let (mut c, m, mut b) = setup();
    protected(&mut c, &m, &mut b, 41005, 1);
    round(&mut c, 1);
    m.ops();
    // The backup goes silent: the detector runs the fencing command, which succeeds.
    let mut t = 1;
    let fenced = loop {
        t += 10;
        let (_, reqs) = round(&mut c, t);
        if reqs.contains(&Request::Fence) {
            break true;
        }
        if t > 5_000 {
            break false;
        }
    };
    assert!(fenced, "the silent backup is fenced");
    c.fence_done(true, t);
    round(&mut c, t + 1);
    assert!(c.primary().unwrap().unprotected().is_some());
    let ops = m.ops();
    assert!(ops.contains(&"remove 41005".to_string()), "{ops:?}");
    assert!(ops.contains(&"queue_out true".to_string()), "{ops:?}");
    // Its pure ACKs are no longer held to the failed backup's RCV.NXT: the engine passes them.
    let ack = server_pkt(41005, P_ISN + 1, C_ISN + 900, F::ACK, &[]);
    assert_eq!(queue(&mut c, t + 2, &ack, true, 0), Verdict::Accept { modified: false });
}

#[test]
fn the_engine_learns_when_the_programs_last_passed_output() {
    let (mut c, m, mut b) = setup();
    protected(&mut c, &m, &mut b, 41006, 1);
    round(&mut c, 1);
    m.lock().output_at = Some(777);
    assert!(c.primary().unwrap().last_output_ms() < 777);
    round(&mut c, 800);
    assert_eq!(c.primary().unwrap().last_output_ms(), 777, "its stall evidence sees the output the engine never saw");
}

#[test]
fn hostile_a_copy_the_core_cannot_name_is_never_sent() {
    let (mut c, m, _b) = setup();
    m.lock().records.push(MapRecord::Slow { pkt: vec![0x45, 0, 0, 20, 1, 2, 3], counted: true });
    m.lock().records.push(MapRecord::Slow { pkt: vec![], counted: false });
    c.fast_records(1);
    let (sent, _) = round(&mut c, 1);
    assert!(sent.is_empty(), "garbage from the ring never reaches the wire");
}

#[test]
fn a_connection_the_engine_must_decide_leaves_the_map_and_its_lease_is_renewed() {
    let (mut c, m, mut b) = setup();
    protected(&mut c, &m, &mut b, 41007, 1);
    round(&mut c, 1);
    m.ops();
    // Its server's FIN (declined: the engine holds it until the backup's): from then on every
    // packet is the engine's, so the entry goes instead of staying frozen (a frozen entry's
    // pure ACKs would pass unlearned for good).
    m.decline_out(&conn(41007), server_pkt(41007, P_ISN + 1, C_ISN + 1, F::ACK | F::FIN, &[]));
    c.fast_records(2);
    round(&mut c, 2);
    let ops = m.ops();
    assert!(ops.contains(&"take 41007".to_string()) && ops.contains(&"remove 41007".to_string()), "{ops:?}");
    assert_eq!(c.fast_where(&conn(41007)), Fast::Off);
    // The daemon renews the programs' lease while it runs (every LEASE_RENEW_MS).
    let n0 = m.lock().renewals;
    for t in (3..1000).step_by(10) {
        round(&mut c, t);
    }
    let n = m.lock().renewals - n0;
    assert!((8..=11).contains(&n), "{n} renewals in about 1 s");
}
