//! The backup's fast-path hand-off (`replica::core`'s fast half, issue 22 item 4) against an
//! emulated map that behaves as `rep_op` and the programs' slow path (`bpf/replica/rep_tc.c`):
//! when a connection is installed, taken, thawed, forced back and removed, what the ring's
//! records do to the engine, and the take-over's order. No kernel: the programs' claims are
//! the test's edits of the emulated entries.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use unbroken_control::daemon::{Meta, Mode, Outbox};
use unbroken_control::replica::core::{FastMap, Fields, Boot, Core, EgressSeen, Fast, MapDone, MapOp, MapRecord, Request, Settings, State, Taken, EGRESS_UNKNOWN_MAX, EGRESS_WATCH_MS, HOLD_BOUND_MS, MARK_DONE, MARK_SLOW};
use unbroken_engines::replica::{BFast, Config, ConnKey, DetectorConfig};
use unbroken_engines::Verdict;
use unbroken_wire::ctl::Key;
use unbroken_wire::replica::{ConnProgress, Progress, Role, Session};
use unbroken_wire::tcp::{self, flags as F};
use unbroken_wire::Seq;

use common::emu::Entries;

const CLIENT: &str = "10.0.0.9";
const SERVICE: &str = "10.77.3.10";
const PORT: u16 = 6379;
/// The primary's ISN and the backup server's: Δ = 4000.
const P_ISN: u32 = 9000;
const B_ISN: u32 = 5000;
const C_ISN: u32 = 1000;

fn key() -> Key {
    Key::from_hex("00112233445566778899aabbccddeeff").unwrap()
}

fn peer() -> SocketAddr {
    "10.77.3.11:7790".parse().unwrap()
}

fn backup() -> Core {
    let s = Settings { role: Role::Backup, detector: DetectorConfig { interval_ms: 10, misses: 3 }, engine: Config::default(), finished_grace_ms: 1000 };
    Core::new(s, key(), peer(), Boot { id: 0xbb, secret: [7; 32] }, 0)
}

/// The emulated map (its entries and the core's operations: [`common::emu::Entries`]).
#[derive(Default)]
struct Emu {
    map: Entries<BFast>,
    records: Vec<MapRecord>,
    promoted: bool,
    promote_fails: bool,
    /// What the programs' counters say ([`FastMap::stats`]).
    stats: Vec<(&'static str, u64)>,
    /// The egress watch's answer ([`FastMap::egress_seen`]): `None` (the default) present;
    /// `stuck`: no new look since the last read.
    egress: Option<Result<EgressSeen, String>>,
    looks: u64,
    stuck: bool,
    user_out: bool,
}

impl std::ops::Deref for Emu {
    type Target = Entries<BFast>;
    fn deref(&self) -> &Entries<BFast> {
        &self.map
    }
}

impl std::ops::DerefMut for Emu {
    fn deref_mut(&mut self) -> &mut Entries<BFast> {
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
    /// A program declines a packet of `k`: frozen, counted (the packet carries MARK_SLOW).
    fn decline(&self, k: &ConnKey) -> u32 {
        if self.lock().decline(k) {
            MARK_SLOW
        } else {
            0
        }
    }
    /// A program claims a packet of `k` and learns from it.
    fn claim(&self, k: &ConnKey, learn: impl FnOnce(&mut BFast)) {
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

    fn stats(&mut self) -> Vec<(&'static str, u64)> {
        self.lock().stats.clone()
    }

    fn egress_seen(&mut self) -> (u64, Option<Result<EgressSeen, String>>) {
        let mut m = self.lock();
        if !m.stuck {
            m.looks += 1;
        }
        (m.looks, Some(m.egress.clone().unwrap_or(Ok(EgressSeen::Present))))
    }

    fn user_out(&mut self) -> Result<(), String> {
        let mut m = self.lock();
        m.ops.push("user_out".into());
        m.user_out = true;
        Ok(())
    }

    fn promote(&mut self) -> Result<(), String> {
        let mut m = self.lock();
        m.ops.push("promote".into());
        if m.promote_fails {
            return Err("no OUTPUT rule".into());
        }
        m.promoted = true;
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

/// A queued packet through the core (`hook` 3: the backup's server's), its verdict and bytes.
fn queue(c: &mut Core, now: u64, pkt: &[u8], outgoing: bool, mark: u32) -> (Verdict, Vec<u8>) {
    let mut buf = pkt.to_vec();
    let len = buf.len();
    buf.resize(len + 64, 0);
    let meta = Meta { id: 1, hook: if outgoing { 3 } else { 0 }, mark, ..Meta::default() };
    let mut out = Outbox::default();
    let (v, n) = c.packet(now, meta, &mut buf, len, &mut out);
    buf.truncate(n);
    (v, buf)
}

/// The round's verdicts left.
fn flush(c: &mut Core, now: u64) {
    c.after_flush(now);
}

/// A connection through its handshake: the SYN from the queue, the server's SYN-ACK as copy
/// mode brings it (a ring record), the client's ACK from the queue, then the flush.
fn aligned(c: &mut Core, m: &Shared, port: u16, now: u64) {
    queue(c, now, &client_pkt(port, C_ISN, 0, F::SYN, &[]), false, 0);
    m.lock().records.push(MapRecord::Slow { pkt: server_pkt(port, B_ISN, C_ISN + 1, F::SYN | F::ACK, &[]), counted: false });
    c.fast_records(now);
    queue(c, now, &client_pkt(port, C_ISN + 1, P_ISN + 1, F::ACK, &[]), false, 0);
    flush(c, now);
}

fn setup() -> (Core, Shared) {
    let mut c = backup();
    let m = Shared::default();
    c.enable_fast_path(Box::new(m.clone()));
    (c, m)
}

#[test]
fn a_connection_is_installed_once_aligned_and_only_after_its_packets_verdict_left() {
    let (mut c, m) = setup();
    queue(&mut c, 0, &client_pkt(40000, C_ISN, 0, F::SYN, &[]), false, 0);
    flush(&mut c, 0);
    m.lock().records.push(MapRecord::Slow { pkt: server_pkt(40000, B_ISN, C_ISN + 1, F::SYN | F::ACK, &[]), counted: false });
    c.fast_records(0);
    assert!(m.ops().is_empty(), "nothing installed before the engine aligned it");
    queue(&mut c, 1, &client_pkt(40000, C_ISN + 1, P_ISN + 1, F::ACK, &[]), false, 0);
    assert!(m.ops().is_empty(), "not before the ACK's verdict left");
    flush(&mut c, 1);
    assert_eq!(m.ops(), ["install 40000"]);
    assert_eq!(c.fast_where(&conn(40000)), Fast::Kernel);
    let f = m.lock().entries[&conn(40000)].f;
    assert!(f.aligned);
    assert_eq!(f.delta, P_ISN.wrapping_sub(B_ISN));
    assert_eq!(c.fast_counters().installed, 1);
}

#[test]
fn a_marked_packet_takes_the_programs_fields_and_the_connection_goes_back_after_the_flush() {
    let (mut c, m) = setup();
    aligned(&mut c, &m, 40001, 0);
    m.ops();
    // The programs withheld 100 bytes of the server's output: the digest moved in the kernel.
    m.claim(&conn(40001), |f| {
        f.snd_max = Seq(B_ISN + 101);
        f.out_end = Seq(P_ISN + 101);
        f.out_hash = 0x1234;
    });
    // A client FIN: the engine's (declined, marked).
    let mark = m.decline(&conn(40001));
    assert_eq!(mark, MARK_SLOW);
    queue(&mut c, 5, &client_pkt(40001, C_ISN + 1, P_ISN + 101, F::FIN | F::ACK, &[]), false, mark);
    assert_eq!(m.ops(), ["take 40001"]);
    assert_eq!(c.fast_where(&conn(40001)), Fast::Held);
    let f = c.backup().unwrap().fast_state(&conn(40001)).unwrap();
    assert_eq!((f.out_end, f.out_hash, f.snd_max), (Seq(P_ISN + 101), 0x1234, Seq(B_ISN + 101)), "the engine decided on the programs' fields");
    flush(&mut c, 5);
    assert_eq!(m.ops(), ["thaw 40001"]);
    let e = m.lock().entries[&conn(40001)];
    assert!(!e.frozen);
    assert_eq!((e.f.out_end, e.f.out_hash), (Seq(P_ISN + 101), 0x1234), "given back with what the engine kept");
}

#[test]
fn a_thaw_waits_until_every_counted_packet_was_taken() {
    let (mut c, m) = setup();
    aligned(&mut c, &m, 40002, 0);
    m.ops();
    // Two packets declined; the first reaches the queue.
    let m1 = m.decline(&conn(40002));
    let m2 = m.decline(&conn(40002));
    queue(&mut c, 3, &client_pkt(40002, C_ISN + 1, P_ISN + 1, F::ACK | F::PSH, b"x"), false, m1);
    flush(&mut c, 3);
    assert_eq!(m.ops(), ["take 40002", "thaw 40002"]);
    assert_eq!(c.fast_where(&conn(40002)), Fast::Held, "refused: the second is between the paths");
    assert_eq!(c.fast_counters().thaw_refused, 1);
    // The engine's copy is newer now: the second take must not overwrite it.
    m.claim_frozen_poison(&conn(40002));
    queue(&mut c, 4, &client_pkt(40002, C_ISN + 2, P_ISN + 1, F::ACK | F::PSH, b"y"), false, m2);
    assert_ne!(c.backup().unwrap().fast_state(&conn(40002)).unwrap().out_hash, 0xdead, "an older copy never replaces the engine's");
    flush(&mut c, 4);
    assert_eq!(m.ops(), ["take 40002", "thaw 40002"]);
    assert_eq!(c.fast_where(&conn(40002)), Fast::Kernel);
}

impl Shared {
    /// Writes a value into a frozen entry's copy that must never reach the engine (the
    /// kernel never changes a frozen entry; this only makes a wrong take visible).
    fn claim_frozen_poison(&self, k: &ConnKey) {
        self.lock().entries.get_mut(k).unwrap().f.out_hash = 0xdead;
    }
}

#[test]
fn an_unmarked_packet_of_an_installed_connection_freezes_it() {
    let (mut c, m) = setup();
    aligned(&mut c, &m, 40003, 0);
    m.ops();
    // Queued before the install, or unparsable for the programs: not counted.
    queue(&mut c, 2, &client_pkt(40003, C_ISN + 1, P_ISN + 1, F::ACK, &[]), false, 0);
    flush(&mut c, 2);
    assert_eq!(m.ops(), ["freeze 40003", "thaw 40003"]);
    assert_eq!(c.fast_where(&conn(40003)), Fast::Kernel);
}

#[test]
fn a_connection_held_past_the_bound_is_forced_back() {
    let (mut c, m) = setup();
    aligned(&mut c, &m, 40004, 0);
    let m1 = m.decline(&conn(40004));
    let _lost = m.decline(&conn(40004));
    queue(&mut c, 10, &client_pkt(40004, C_ISN + 1, P_ISN + 1, F::ACK, &[]), false, m1);
    flush(&mut c, 10);
    m.ops();
    let mut out = Outbox::default();
    c.tick(10 + HOLD_BOUND_MS - 1, &mut out);
    assert!(m.ops().iter().all(|o| !o.starts_with("thaw")), "not before the bound");
    c.tick(10 + HOLD_BOUND_MS, &mut out);
    assert!(m.ops().contains(&"thaw_force 40004".to_string()));
    assert_eq!(c.fast_where(&conn(40004)), Fast::Kernel);
    assert_eq!(c.fast_counters().thaw_forced, 1);
}

/// A scripted primary: binds the backup core, then sends reports.
struct Primary {
    beat: u64,
    echo: (u64, u64),
}

impl Primary {
    fn bind(c: &mut Core, now: u64) -> Primary {
        let mut p = Primary { beat: 0, echo: (0, 0) };
        let mut out = Outbox::default();
        c.tick(now, &mut out);
        c.collect(&mut out);
        p.hear(&out.requests);
        c.side(now, peer(), &p.msg(vec![]));
        assert_eq!(c.state(), State::Protecting);
        p
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
        let s = Session { boot: 0xaa, nonce_t: self.beat, nonce: 0x5eed ^ self.beat, echo_t: self.echo.0, echo: self.echo.1 };
        Progress { role: Role::Primary, beat: self.beat, flags: 0, records }.emit_session(&s, &key()).unwrap()
    }
}

fn report(port: u16, out_end: u32, last_ack: u32) -> ConnProgress {
    ConnProgress { client: CLIENT.parse().unwrap(), client_port: port, server_port: PORT, rcv_nxt: Seq(C_ISN + 1), rcv_edge: Seq(C_ISN + 1001), out_end: Seq(out_end), out_hash: 0, last_ack: Seq(last_ack), isn: Seq(P_ISN), flags: unbroken_wire::replica::flag::ISN_KNOWN | unbroken_wire::replica::flag::ALIGNED | unbroken_wire::replica::flag::RCV_KNOWN }
}

#[test]
fn a_primary_report_is_decided_on_the_programs_fields_and_gives_them_back_with_its_own() {
    let (mut c, m) = setup();
    let mut p = Primary::bind(&mut c, 0);
    aligned(&mut c, &m, 40005, 1);
    m.ops();
    m.claim(&conn(40005), |f| {
        f.snd_max = Seq(B_ISN + 201);
        f.out_end = Seq(P_ISN + 201);
    });
    c.side(2, peer(), &p.msg(vec![report(40005, P_ISN + 201, 0)]));
    assert_eq!(m.ops(), ["freeze 40005", "thaw 40005"], "taken before the engine, given back at once");
    let e = m.lock().entries[&conn(40005)];
    assert_eq!(e.f.p_out, Some(Seq(P_ISN + 201)), "the report's p_out is in the map");
    assert_eq!(e.f.out_end, Seq(P_ISN + 201), "and the programs' output end survived");
    // A report of a connection the programs do not carry touches nothing.
    c.side(3, peer(), &p.msg(vec![report(49999, P_ISN + 1, 0)]));
    assert!(m.ops().is_empty());
}

#[test]
fn ring_records_reach_the_engine_and_one_progress_message_covers_the_round() {
    let (mut c, m) = setup();
    let _p = Primary::bind(&mut c, 0);
    aligned(&mut c, &m, 40006, 1);
    aligned(&mut c, &m, 40007, 1);
    let mut out = Outbox::default();
    c.tick(20, &mut out);
    c.collect(&mut out);
    m.ops();
    let kept = server_pkt(40006, B_ISN + 1, C_ISN + 1, F::ACK | F::PSH, &[b'a'; 100]);
    for port in [40006, 40007] {
        m.claim(&conn(port), |f| {
            f.out_end = Seq(P_ISN + 101);
            f.snd_max = Seq(B_ISN + 101);
            f.rcv_nxt = Seq(C_ISN + 1);
            f.rcv_known = true;
        });
    }
    m.lock().records.extend([
        MapRecord::Checkpoint(conn(40006), Seq(P_ISN + 101), 0xabc),
        MapRecord::Kept(conn(40006), Seq(B_ISN + 101), kept.clone()),
        MapRecord::Changed(conn(40006)),
        MapRecord::Changed(conn(40007)),
    ]);
    c.fast_records(21);
    assert_eq!(m.ops(), ["collect 40006", "collect 40007"]);
    let side = c.backup().unwrap().side(&conn(40006)).unwrap();
    assert_eq!(side.checkpoints, [(Seq(P_ISN + 101), 0xabc)]);
    assert_eq!(side.kept, [(Seq(B_ISN + 101), kept.len())]);
    let mut out = Outbox::default();
    c.tick(22, &mut out);
    c.collect(&mut out);
    let msgs: Vec<Progress> = out.requests.iter().filter_map(|r| if let Request::Side(d) = r { Some(Progress::parse_message(d, &key()).unwrap().0) } else { None }).collect();
    assert_eq!(msgs.len(), 1, "one progress message for the round");
    let ports: Vec<u16> = msgs[0].records.iter().filter(|r| r.out_end == Seq(P_ISN + 101)).map(|r| r.client_port).collect();
    assert!(ports.contains(&40006) && ports.contains(&40007), "both connections' collected figures: {ports:?}");
}

#[test]
fn a_forgotten_connection_leaves_the_map() {
    let (mut c, m) = setup();
    aligned(&mut c, &m, 40008, 0);
    // Both FINs (the engine's): the connection finishes.
    let mk = m.decline(&conn(40008));
    queue(&mut c, 1, &client_pkt(40008, C_ISN + 1, P_ISN + 1, F::FIN | F::ACK, &[]), false, mk);
    flush(&mut c, 1);
    let mk = m.decline(&conn(40008));
    m.lock().records.push(MapRecord::Slow { pkt: server_pkt(40008, B_ISN + 1, C_ISN + 2, F::FIN | F::ACK, &[]), counted: mk != 0 });
    c.fast_records(2);
    m.ops();
    let mut out = Outbox::default();
    for t in [1000, 2000, 3000, 4000] {
        c.tick(t, &mut out);
    }
    assert!(!c.backup().unwrap().follows(&conn(40008)), "forgotten after its grace");
    assert!(m.ops().contains(&"remove 40008".to_string()));
    assert!(!m.lock().entries.contains_key(&conn(40008)));
    assert_eq!(c.fast_where(&conn(40008)), Fast::Off);
}

/// Fences the primary of a bound backup core: silence, the fence request, its success.
fn take_over(c: &mut Core, from: u64) -> u64 {
    let mut out = Outbox::default();
    let mut t = from;
    loop {
        t += 10;
        c.tick(t, &mut out);
        c.collect(&mut out);
        if out.requests.iter().any(|r| *r == Request::Fence) {
            break;
        }
        out.requests.clear();
        assert!(t < from + 10_000, "no fence");
    }
    c.fence_done(true, t);
    assert_eq!(c.state(), State::TookOver);
    t
}

#[test]
fn the_take_over_promotes_first_then_loads_every_entry_then_clears_the_map() {
    let (mut c, m) = setup();
    let _p = Primary::bind(&mut c, 0);
    aligned(&mut c, &m, 40009, 1);
    aligned(&mut c, &m, 40010, 1);
    m.claim(&conn(40009), |f| {
        f.snd_max = Seq(B_ISN + 301);
        f.out_end = Seq(P_ISN + 301);
        f.out_hash = 0x77;
    });
    // A copy the programs sent before the take-over, still in the ring.
    m.lock().records.push(MapRecord::Checkpoint(conn(40009), Seq(P_ISN + 301), 0x77));
    m.ops();
    take_over(&mut c, 1);
    let ops = m.ops();
    // (Full beats while the primary fell silent collected the entries: they only read them.)
    let order: Vec<&str> = ops.iter().map(|o| o.split(' ').next().unwrap()).filter(|o| *o != "collect").collect();
    assert_eq!(order, ["promote", "freeze", "freeze", "remove", "remove"], "{ops:?}");
    assert!(m.lock().entries.is_empty());
    let b = c.backup().unwrap();
    assert!(b.is_promoted());
    let f = b.fast_state(&conn(40009)).unwrap();
    assert_eq!((f.out_end, f.out_hash), (Seq(P_ISN + 301), 0x77), "loaded before take_over()");
    assert_eq!(c.fast_where(&conn(40009)), Fast::Off);
    // After the take-over nothing is installed again; the queue carries every packet.
    queue(&mut c, 20_000, &client_pkt(40009, C_ISN + 1, P_ISN + 301, F::ACK, &[]), false, MARK_SLOW);
    flush(&mut c, 20_000);
    assert!(m.ops().is_empty());
}

#[test]
fn a_take_over_without_the_output_rule_sends_the_copies_it_translates() {
    let (mut c, m) = setup();
    let _p = Primary::bind(&mut c, 0);
    aligned(&mut c, &m, 40011, 1);
    m.lock().promote_fails = true;
    let t = take_over(&mut c, 1);
    assert_eq!(c.fast_counters().promote_failed, 1);
    let mut out = Outbox::default();
    c.collect(&mut out);
    // The egress program still copies: the engine translates into the primary's space and the
    // raw socket sends it.
    m.lock().records.push(MapRecord::Slow { pkt: server_pkt(40011, B_ISN + 1, C_ISN + 1, F::ACK | F::PSH, b"hello"), counted: false });
    c.fast_records(t + 1);
    c.collect(&mut out);
    let sent: Vec<&Vec<u8>> = out.send.iter().filter(|p| p.ends_with(b"hello")).collect();
    assert_eq!(sent.len(), 1);
    let info = unbroken_wire::ip::IpInfo::parse(sent[0]).unwrap();
    let seq = u32::from_be_bytes(sent[0][info.l4_offset + 4..info.l4_offset + 8].try_into().unwrap());
    assert_eq!(seq, P_ISN + 1, "in the primary's sequence space");
}

#[test]
fn hostile_a_packet_the_programs_decided_is_never_decided_again() {
    let (mut c, m) = setup();
    aligned(&mut c, &m, 40012, 0);
    m.ops();
    let before = c.backup().unwrap().counters;
    let f_before = c.backup().unwrap().fast_state(&conn(40012));
    // Already rewritten by rep_b_in (ACK - Δ): a chain edited by hand sends it to the queue.
    let pkt = client_pkt(40012, C_ISN + 1, B_ISN + 1, F::ACK, &[]);
    let (v, bytes) = queue(&mut c, 1, &pkt, false, MARK_DONE);
    assert_eq!(v, Verdict::Accept { modified: false });
    assert_eq!(bytes, pkt, "not a byte changed");
    flush(&mut c, 1);
    assert!(m.ops().is_empty(), "the hand-off untouched");
    assert_eq!(c.backup().unwrap().counters, before);
    assert_eq!(c.backup().unwrap().fast_state(&conn(40012)), f_before);
    assert_eq!(c.fast_counters().fast_done_queued, 1);
}

#[test]
fn hostile_a_marked_packet_of_an_unknown_connection_changes_nothing_in_the_map() {
    let (mut c, m) = setup();
    // Forged with MARK_SLOW's meaning (a mark set by another rule): no entry, nothing made.
    queue(&mut c, 0, &client_pkt(41000, 1, 1, F::ACK, &[]), false, MARK_SLOW);
    flush(&mut c, 0);
    assert_eq!(m.ops(), ["take 41000"]);
    assert!(m.lock().entries.is_empty());
    assert_eq!(c.fast_where(&conn(41000)), Fast::Off);
}

/// Review finding 8 of the attach: what the programs lose (ring records, copies that did not
/// fit together, unparsable packets dropped) was counted and never said. A rise is logged
/// once per reading, with what it costs; no rise, no line.
#[test]
fn fast_path_losses_are_logged_when_they_rise() {
    let (mut c, m) = setup();
    let lines = |c: &mut Core, now: u64| -> Vec<String> {
        let mut out = Outbox::default();
        c.tick(now, &mut out);
        c.collect(&mut out);
        out.requests.iter().filter_map(|r| if let Request::Log(l) = r { Some(l.clone()) } else { None }).filter(|l| l.contains("fast path")).collect()
    };
    m.lock().stats = vec![("kernel_records_lost", 0), ("pieces_dropped", 0), ("kernel_unparsed_dropped", 0)];
    assert!(lines(&mut c, 2_000).is_empty(), "nothing lost");
    m.lock().stats = vec![("kernel_records_lost", 5), ("pieces_dropped", 0), ("kernel_unparsed_dropped", 0)];
    assert!(lines(&mut c, 2_500).is_empty(), "read once a second");
    let l = lines(&mut c, 3_000);
    assert!(l.len() == 1 && l[0].contains("5 more kernel_records_lost"), "{l:?}");
    assert!(lines(&mut c, 4_000).is_empty(), "no rise since");
    m.lock().stats = vec![("kernel_records_lost", 5), ("pieces_dropped", 0), ("kernel_unparsed_dropped", 2)];
    let l = lines(&mut c, 5_000);
    assert!(l.len() == 1 && l[0].contains("2 more kernel_unparsed_dropped"), "{l:?}");
}

/// Review finding 5 of the attach: the egress filter that withholds the backup's server's
/// output can vanish under the daemon (`tc qdisc del dev X clsact`, a recreated device). The
/// core looks for it every `EGRESS_WATCH_MS`; gone, the server's packets go through the queue
/// again first (`user_out`), then every connection goes back to the engine, the map is
/// cleared, nothing is installed again, and it is said once. A look with no answer decides
/// nothing.
#[test]
fn hostile_a_vanished_egress_filter_sends_the_output_through_the_queue_again() {
    let (mut c, m) = setup();
    aligned(&mut c, &m, 40020, 0);
    aligned(&mut c, &m, 40021, 0);
    m.claim(&conn(40020), |f| {
        f.snd_max = Seq(B_ISN + 101);
        f.out_end = Seq(P_ISN + 101);
        f.out_hash = 0x55;
    });
    m.ops();
    let mut logs = Vec::new();
    let tick = |c: &mut Core, now: u64, logs: &mut Vec<String>| {
        let mut out = Outbox::default();
        c.tick(now, &mut out);
        c.collect(&mut out);
        logs.extend(out.requests.iter().filter_map(|r| if let Request::Log(l) = r { Some(l.clone()) } else { None }));
    };
    tick(&mut c, 500, &mut logs);
    assert!(m.ops().iter().all(|o| o.starts_with("collect")), "present: nothing changes");
    m.lock().egress = Some(Err("rtnetlink busy".into()));
    tick(&mut c, 700, &mut logs);
    assert_eq!(c.fast_counters().egress_check_failed, 1);
    assert!(c.fast_path_on() && !m.lock().user_out, "no answer decides nothing");
    m.lock().egress = None;
    tick(&mut c, 800, &mut logs);
    m.lock().egress = Some(Ok(EgressSeen::Gone("rep_b_out's filter is no longer attached at eth0 egress".into())));
    tick(&mut c, 900, &mut logs);
    let ops = m.ops();
    let order: Vec<&str> = ops.iter().map(|o| o.split(' ').next().unwrap()).filter(|o| *o != "collect").collect();
    assert_eq!(order, ["user_out", "freeze", "freeze", "remove", "remove"], "the queue first: {ops:?}");
    assert!(m.lock().entries.is_empty());
    let f = c.backup().unwrap().fast_state(&conn(40020)).unwrap();
    assert_eq!((f.out_end, f.out_hash), (Seq(P_ISN + 101), 0x55), "the programs' fields are the engine's again");
    assert_eq!(c.fast_where(&conn(40020)), Fast::Off);
    let st = c.fast_status();
    assert_eq!(st["on"], false, "{st}");
    assert_eq!(st["egress_lost"], true, "{st}");
    assert!(st["off_because"].as_str().unwrap().contains("no longer attached"), "{st}");
    assert_eq!(logs.iter().filter(|l| l.contains("no longer attached") && l.contains("NFQUEUE again")).count(), 1, "{logs:?}");
    // From now on the engine decides the server's output from the queue (withheld), and
    // nothing goes back to the map.
    let (v, _) = queue(&mut c, 1_000, &server_pkt(40020, B_ISN + 101, C_ISN + 1, F::ACK | F::PSH, b"more"), true, 0);
    assert_eq!(v, Verdict::Drop, "withheld by the engine");
    flush(&mut c, 1_000);
    tick(&mut c, 1_200, &mut logs);
    assert!(m.ops().is_empty(), "nothing installed, nothing looked for again: {:?}", m.ops());
    assert_eq!(c.backup().unwrap().fast_state(&conn(40020)).unwrap().out_end, Seq(P_ISN + 105));
}

/// Finding 1 of the second review: the watch runs on its own thread (its rtnetlink dump waits
/// for the kernel's RTNL lock), so the core only reads its answers; answers that do not come
/// (errors, or a watch stuck in the kernel) turn the fast path off after
/// `EGRESS_UNKNOWN_MAX` reads in a row: the safe side, since the filter may be gone unseen.
#[test]
fn hostile_an_egress_watch_that_never_answers_turns_the_fast_path_off() {
    let (mut c, m) = setup();
    aligned(&mut c, &m, 40030, 0);
    m.ops();
    let mut out = Outbox::default();
    let mut t = 0;
    let mut read = |c: &mut Core, t: &mut u64| {
        *t += EGRESS_WATCH_MS;
        c.tick(*t, &mut out);
        c.collect(&mut out);
    };
    read(&mut c, &mut t);
    assert!(c.fast_path_on());
    // Stuck: the same (good) answer again and again, no new look.
    m.lock().stuck = true;
    for _ in 0..EGRESS_UNKNOWN_MAX - 1 {
        read(&mut c, &mut t);
    }
    assert!(c.fast_path_on(), "not before {EGRESS_UNKNOWN_MAX} reads without an answer");
    // One good look in between starts the count again.
    m.lock().stuck = false;
    read(&mut c, &mut t);
    m.lock().stuck = true;
    for _ in 0..EGRESS_UNKNOWN_MAX - 1 {
        read(&mut c, &mut t);
    }
    assert!(c.fast_path_on());
    read(&mut c, &mut t);
    assert!(!c.fast_path_on(), "{EGRESS_UNKNOWN_MAX} reads in a row without an answer");
    assert!(m.lock().user_out);
    assert!(c.fast_status()["off_because"].as_str().unwrap().contains("could not be looked for"));
}
