//! Object mode's fast path against the TRODS engine (issue 22 item 3, first step): every packet
//! goes through `trods::Engine` and, by `BPF_PROG_TEST_RUN`, through the socket filter of its
//! direction (`bpf/object/obj_fast.c`). A packet the filter passes must be one the engine
//! accepts with nothing else to do (no store, no held, released, injected or dropped packet,
//! no counter but `acks_lowered`), every field of the engine's state the same afterwards except
//! those the kernel keeps, which must equal the kernel's; a server packet it passes must come
//! out of the tc program byte for byte as the engine's (the ACK lowered to the hold). A packet
//! it sends to the slow path is then decided by the engine, and the entry published again from
//! the engine's state, as the agent will do. Scenarios follow trods_cases (Table 1, §3.2 case ③
//! on an adopted connection, keep-alive, pipelining), then random sequences and hostile packets.
//!
//! Root only, no namespace: each test prints "SKIP" and passes when it cannot load BPF programs
//! (not root, no BPF), or fails with the reason when UNBROKEN_REQUIRE_LAB=1.

include!("common/require.rs");
include!("common/loaded.rs");

use std::net::{IpAddr, SocketAddr};

use unbroken_drivers::fastpath::object::{self, flag, monotonic_ns, Kept, Object, Prog, State, Steer};
use unbroken_drivers::fastpath::Verdict as TcVerdict;
use unbroken_engines::trods::{self, plan_recovery, Action, Config, Dir, Engine, FastKept, FastView, Plan, Record, Trigger};
use unbroken_engines::Verdict;
use unbroken_wire::ip::{self, IpInfo};
use unbroken_wire::marker::marker_mac;
use unbroken_wire::tcp::{flags as F, Packet as Tcp, Repr};
use unbroken_wire::Seq;

const C_ISN: u32 = 1_000_000;
const S_ISN: u32 = 4_294_960_000; // wraps during the tests
const BUCKET: u16 = 7;

fn fast_path(test: &str) -> Option<Object> {
    loaded_or_skip(test, Object::load())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The engine's view with the fields the kernel keeps (and the clock) blanked: what must not
/// change on a packet the fast path passes. `body_left` falls as body bytes pass; its sum with
/// `srv_next` (the body's end) is checked through the published walls.
fn fixed(v: &FastView) -> FastView {
    FastView { client_acked: 0, srv_next: 0, sent_next: 0, last_window: 0, last_ts: None, last_seen: 0, body_left: 0, in_body: false, ..*v }
}

/// The published part of an entry (the kernel's kept fields, its clock, its USER bit and
/// write sequence blanked).
fn published(s: &State) -> State {
    State { flags: s.flags & !flag::USER, wseq: 0, pub_gen: 0, client_acked: 0, srv_next: 0, sent_next: 0, last_seen_ns: 0, last_window: 0, has_ts: 0, last_tsval: 0, last_tsecr: 0, ..*s }
}

/// The client at `c`, the service at `s`: the engine and the fast path side by side.
struct World {
    fp: Object,
    e: Engine,
    /// The agent's engine as it will run: it sees only the packets the kernel leaves to the
    /// slow path, and before each (and before any other event) takes back what the kernel
    /// moved (`Engine::absorb` with the entry's kept fields). After every slow packet it must
    /// be in the state of `e`, which saw every packet.
    twin: Engine,
    /// The twin's actions not yet completed (the same as `pending`, asserted).
    twin_pending: Vec<Action>,
    key: trods::Key,
    k: object::Key,
    id: u64,
    now: u64,
    /// The marker the client's frames carry (the LB's), and whether the entry has the bucket.
    mac: [u8; 6],
    bucket: Option<u16>,
    fenced: bool,
    /// The server's timestamp clock (its segments carry TSval = this, TSecr = 77).
    tsv: u32,
    /// Actions the engine asked for and not yet completed.
    pending: Vec<Action>,
    passed_c: usize,
    passed_s: usize,
    slow: usize,
    /// Check that the kernel's USER bit is set on every slow packet of a known entry.
    check_user: bool,
    /// Tell the engine the client's packets were built on this host (NFQUEUE's
    /// `csum_not_ready`): it trusts their checksum.
    csum_not_ready: bool,
}

impl World {
    fn new(fp: Object, cfg: Config, c: SocketAddr, s: SocketAddr) -> World {
        let key = trods::Key { client: c, service: s };
        let mut w = World {
            fp,
            twin: Engine::new(cfg.clone()),
            twin_pending: Vec::new(),
            e: Engine::new(cfg),
            key,
            k: object::Key::new(&key),
            id: 0,
            now: 1000,
            mac: marker_mac(BUCKET),
            bucket: Some(BUCKET),
            fenced: true,
            tsv: 1000,
            pending: Vec::new(),
            passed_c: 0,
            passed_s: 0,
            slow: 0,
            check_user: true,
            csum_not_ready: false,
        };
        w.lease(true);
        w.fp.set_alive(monotonic_ns() + 3_600_000_000_000);
        w
    }

    fn v4(fp: Object, cfg: Config) -> World {
        World::new(fp, cfg, "10.77.0.2:40000".parse().unwrap(), "10.77.0.100:80".parse().unwrap())
    }

    fn v6(fp: Object, cfg: Config) -> World {
        World::new(fp, cfg, "[fd77::2]:40000".parse().unwrap(), "[fd77::100]:80".parse().unwrap())
    }

    /// This server holds the lease on the connection's bucket (for an hour), or not.
    fn lease(&mut self, held: bool) {
        let until = if held { monotonic_ns() + 3_600_000_000_000 } else { 0 };
        self.fp.set_lease(BUCKET, until).unwrap();
    }

    fn build(&self, dir: Dir, r: Repr, payload: &[u8]) -> Vec<u8> {
        let (src, dst) = match dir {
            Dir::FromClient => (self.key.client, self.key.service),
            Dir::ToClient => (self.key.service, self.key.client),
        };
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

    fn client_pkt(&self, seq: u32, ack: u32, flags: u8, payload: &[u8]) -> Vec<u8> {
        self.build(Dir::FromClient, Repr { seq: Seq(seq), ack: Seq(ack), flags, window: 500, timestamp: Some((77, self.tsv)), ..Default::default() }, payload)
    }

    fn server_pkt(&mut self, seq: u32, ack: u32, flags: u8, payload: &[u8]) -> Vec<u8> {
        self.tsv += 1;
        let w = 1000 + (self.tsv % 7) as u16;
        self.build(Dir::ToClient, Repr { seq: Seq(seq), ack: Seq(ack), flags, window: w, timestamp: Some((self.tsv, 77)), ..Default::default() }, payload)
    }

    /// The entry as the agent publishes it from the engine's state now (removed when the
    /// engine forgot the connection).
    fn publish(&mut self) {
        match self.e.fast_view(&self.key) {
            Some(v) => {
                // The hand-off: the agent takes the entry before it writes it.
                self.fp.take(&self.k).unwrap();
                let s = State::publish(&v, self.bucket, self.fenced, monotonic_ns());
                self.fp.insert(&self.k, &s).unwrap();
            }
            None => self.fp.remove(&self.k).unwrap(),
        }
    }

    /// Completes every pending store (`ok`), then publishes; returns the records stored.
    fn store_all(&mut self, ok: bool) -> Vec<Record> {
        let mut recs = vec![];
        let mut any = false;
        loop {
            while let Some(a) = self.e.poll_action() {
                self.pending.push(a);
            }
            if self.pending.is_empty() {
                break;
            }
            while let Some(a) = self.twin.poll_action() {
                self.twin_pending.push(a);
            }
            assert_eq!(std::mem::take(&mut self.twin_pending), self.pending, "the twin asks for other stores");
            // An event not caused by a packet: the agent takes the entry back first.
            let (entry, before) = (self.fp.get(&self.k).unwrap(), self.e.fast_view(&self.key));
            self.absorb(entry, before, "a store's completion");
            any = true;
            for a in std::mem::take(&mut self.pending) {
                match a {
                    Action::Store { token, value, .. } => {
                        if let Ok(r) = Record::decode(&value) {
                            recs.push(r);
                        }
                        self.e.store_done(token, ok);
                        self.twin.store_done(token, ok);
                    }
                    Action::Delete { token, .. } => {
                        self.e.store_done(token, ok);
                        self.twin.store_done(token, ok);
                    }
                }
            }
        }
        self.drain_both("stores");
        if any {
            self.same_state("stores");
        }
        self.publish();
        recs
    }

    /// Drains what both engines released, injected and dropped: the same.
    fn drain_both(&mut self, what: &str) {
        let (mut a, mut b) = (vec![], vec![]);
        while let Some(x) = self.e.take_released() {
            a.push(format!("released {x:?}"));
        }
        while let Some(x) = self.e.take_injected() {
            a.push(format!("injected {x:?}"));
        }
        while let Some(x) = self.e.take_dropped() {
            a.push(format!("dropped {x:?}"));
        }
        while let Some(x) = self.twin.take_released() {
            b.push(format!("released {x:?}"));
        }
        while let Some(x) = self.twin.take_injected() {
            b.push(format!("injected {x:?}"));
        }
        while let Some(x) = self.twin.take_dropped() {
            b.push(format!("dropped {x:?}"));
        }
        assert_eq!(b, a, "{what}: the twin's packets differ");
    }

    /// After an event both engines saw (the twin after its hand-off): the same state.
    fn same_state(&self, what: &str) {
        assert_eq!(self.twin.fast_view(&self.key), self.e.fast_view(&self.key), "{what}: the twin's state differs");
    }

    /// The agent's hand-off before an event: the twin takes back what the kernel kept (the
    /// entry's fields; `last_seen` converted exactly, here from the engine that saw it all).
    fn absorb(&mut self, entry: Option<State>, before: Option<FastView>, what: &str) {
        let (Some(e), Some(v)) = (entry, before) else { return };
        if self.twin.fast_view(&self.key).is_none() {
            return;
        }
        let k = e.kept();
        let fk = FastKept { client_acked: k.client_acked, srv_next: k.srv_next, sent_next: k.sent_next, last_window: k.last_window, last_ts: k.last_ts, last_seen: v.last_seen };
        assert!(self.twin.absorb(&self.key, &fk), "{what}: the twin refused the kernel's fields {fk:?}");
        assert_eq!(self.twin.fast_view(&self.key), Some(v), "{what}: after absorbing, the twin differs from the engine that saw every packet");
    }

    /// `Engine::expire` on both, the twin after its hand-off.
    fn expire(&mut self) {
        let entry = self.fp.get(&self.k).unwrap();
        let before = self.e.fast_view(&self.key);
        self.absorb(entry, before, "expire");
        self.e.expire(self.now);
        self.twin.expire(self.now);
        self.drain_both("expire");
        self.same_state("expire");
    }

    /// `Engine::adopt` on both.
    fn adopt(&mut self, rec: &Record, plan: &Plan) {
        let key = self.key;
        self.e.adopt(key, rec, plan, self.now);
        self.twin.adopt(key, rec, plan, self.now);
    }

    /// `pkt` through both paths, checked against each other (module docs). Returns the filter's
    /// answer.
    fn send(&mut self, dir: Dir, pkt: &[u8], what: &str) -> Steer {
        self.send_mac(dir, pkt, self.mac, what)
    }

    fn send_mac(&mut self, dir: Dir, pkt: &[u8], mac: [u8; 6], what: &str) -> Steer {
        self.now += 1;
        let prog = if dir == Dir::FromClient { Prog::FromClient } else { Prog::ToClient };
        let before = self.e.fast_view(&self.key);
        let counters = self.e.counters;
        let entry = self.fp.get(&self.k).unwrap();
        let run = self.fp.run(prog, pkt, mac, 0).unwrap_or_else(|e| panic!("{what}: {e:?} ({} bytes)", pkt.len()));
        assert_eq!(hex(&run.packet), hex(pkt), "{what}: a socket filter changed the packet");
        self.id += 1;
        let mut buf = pkt.to_vec();
        let v = self.e.packet_csum(self.id, &mut buf, dir, self.now, self.csum_not_ready);
        let after = self.e.fast_view(&self.key);
        let steer = run.steer();
        match steer {
            Steer::Pass => {
                let (before, after, entry) = (before.unwrap_or_else(|| panic!("{what}: passed, but the engine does not track it")), after.expect("tracked"), entry.expect("an entry"));
                let mut lowered = 0;
                if dir == Dir::ToClient {
                    let tc = self.fp.run(Prog::ToClientTc, pkt, mac, 0).unwrap();
                    assert_eq!(tc.verdict(), TcVerdict::Done, "{what}: tc");
                    assert_eq!(hex(&tc.packet), hex(&buf), "{what}: the tc program's bytes differ from the engine's");
                    assert_eq!(v, Verdict::Accept { modified: buf != pkt }, "{what}: passed, but the engine says {v:?}");
                    lowered = (buf != pkt) as u64;
                    self.passed_s += 1;
                } else {
                    assert_eq!(v, Verdict::Accept { modified: false }, "{what}: passed, but the engine says {v:?}");
                    self.passed_c += 1;
                }
                let mut expect = counters;
                expect.acks_lowered += lowered;
                assert_eq!(self.e.counters, expect, "{what}: passed, but the engine counted something");
                assert!(self.e.poll_action().is_none(), "{what}: passed, but the engine asked for a store");
                assert!(self.e.take_released().is_none() && self.e.take_injected().is_none() && self.e.take_dropped().is_none(), "{what}: passed, but the engine released, injected or dropped packets");
                assert_eq!(fixed(&after), fixed(&before), "{what}: passed, but the engine's state changed beyond what the kernel keeps");
                let kernel = self.fp.get(&self.k).unwrap().expect("entry");
                assert_eq!(kernel.kept(), Kept::of(&after), "{what}: the kernel keeps other values than the engine holds");
                assert!(kernel.last_seen_ns >= entry.last_seen_ns, "{what}: last_seen went back");
                assert_eq!(kernel.flags & flag::USER, 0, "{what}: passed with USER set");
                assert_eq!(kernel.wseq % 2, 0, "{what}: odd write sequence");
                let now = State::publish(&after, self.bucket, self.fenced, 0);
                assert_eq!(published(&kernel), published(&now), "{what}: the engine would publish other walls now");
            }
            Steer::Slow => {
                let now = self.fp.get(&self.k).unwrap();
                if let (Some(e), Some(n)) = (entry, now) {
                    assert_eq!(n.kept(), e.kept(), "{what}: slow, but the kernel changed its kept fields");
                    if self.check_user {
                        assert_ne!(n.flags & flag::USER, 0, "{what}: slow without USER");
                    }
                }
                self.slow += 1;
                // The agent's engine: the hand-off (absorb what the kernel kept), then it decides
                // the packet exactly as the engine that saw every packet did.
                self.absorb(entry, before, what);
                let mut tb = pkt.to_vec();
                let tv = self.twin.packet_csum(self.id, &mut tb, dir, self.now, self.csum_not_ready);
                assert_eq!((tv, hex(&tb)), (v, hex(&buf)), "{what}: the twin decided otherwise");
                // The agent: the engine decided; its stores run (left pending here), and the
                // entry is published again from its state.
                while let Some(a) = self.e.poll_action() {
                    self.pending.push(a);
                }
                while let Some(a) = self.twin.poll_action() {
                    self.twin_pending.push(a);
                }
                assert_eq!(self.twin_pending, self.pending, "{what}: the twin asks for other stores");
                self.drain_both(what);
                self.same_state(what);
                self.publish();
            }
            Steer::Other(r) => panic!("{what}: the filter returned {r}"),
        }
        steer
    }

    fn c(&mut self, seq: u32, ack: u32, fl: u8, pl: &[u8], what: &str) -> Steer {
        let p = self.client_pkt(seq, ack, fl, pl);
        self.send(Dir::FromClient, &p, what)
    }

    fn s(&mut self, seq: u32, ack: u32, fl: u8, pl: &[u8], what: &str) -> Steer {
        let p = self.server_pkt(seq, ack, fl, pl);
        self.send(Dir::ToClient, &p, what)
    }

    /// SYN (MSS 1400, WS 7, SACK, TS), SYN-ACK (WS 9), the client's ACK, its record stored.
    /// The handshake, the request (slow) and the response's first segment with its header
    /// (slow, held until its record is stored), stored: the connection is inside a body of
    /// BODY_LEN bytes, the next server segment at `ss(1400)`. Returns the request's end.
    fn into_the_body(&mut self) -> u32 {
        self.handshake();
        let req_end = REQ.len() as u32;
        assert_eq!(self.c(cs(0), ss(0), F::ACK | F::PSH, REQ, "request"), Steer::Slow);
        let h = hdr(BODY_LEN);
        let mut first = h.clone();
        first.extend(body(1400 - h.len(), 1));
        assert_eq!(self.s(ss(0), cs(req_end), F::ACK, &first, "first"), Steer::Slow);
        self.store_all(true);
        req_end
    }

    fn handshake(&mut self) {
        let syn = Repr { seq: Seq(C_ISN), flags: F::SYN, window: 64240, mss: Some(1400), wscale: Some(7), sack_perm: true, timestamp: Some((5, 0)), ..Default::default() };
        let p = self.build(Dir::FromClient, syn, b"");
        assert_eq!(self.send(Dir::FromClient, &p, "SYN"), Steer::Slow);
        let sa = Repr { seq: Seq(S_ISN), ack: Seq(cs(0)), flags: F::SYN | F::ACK, window: 65160, mss: Some(1460), wscale: Some(9), sack_perm: true, timestamp: Some((9, 5)), ..Default::default() };
        let p = self.build(Dir::ToClient, sa, b"");
        assert_eq!(self.send(Dir::ToClient, &p, "SYN-ACK"), Steer::Slow);
        assert_eq!(self.c(cs(0), ss(0), F::ACK, b"", "the ACK of the SYN-ACK (the first store)"), Steer::Slow);
        self.store_all(true);
    }
}

fn cs(o: u32) -> u32 {
    C_ISN.wrapping_add(1).wrapping_add(o)
}
fn ss(o: u32) -> u32 {
    S_ISN.wrapping_add(1).wrapping_add(o)
}

const REQ: &[u8] = b"GET /big.bin HTTP/1.1\r\nHost: s\r\nUser-Agent: t\r\n\r\n";
const BODY_LEN: u32 = 20_000;

fn hdr(n: u32) -> Vec<u8> {
    format!("HTTP/1.1 200 OK\r\nContent-Length: {n}\r\nETag: \"e1\"\r\n\r\n").into_bytes()
}

fn body(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// A request at client offset `req_off` answered by a response of `body_len` body bytes at
/// server offset `resp_off`, downloaded in 1400-byte segments with a client ACK every two, as
/// Table 1 runs it: the request, the server's pure ACK of it and the first response segment
/// are the slow path's (parsed, dropped, held until its record is stored); the body segments
/// and the client's ACKs inside the response pass; the ACK of the whole response is the slow
/// path's (it prunes the response: a store). Returns (passed client ACKs, passed segments).
fn download(w: &mut World, req_off: u32, req: &[u8], resp_off: u32, body_len: u32) -> (usize, usize) {
    let (pc, ps) = (w.passed_c, w.passed_s);
    let req_end = req_off + req.len() as u32;
    assert_eq!(w.c(cs(req_off), ss(resp_off), F::ACK | F::PSH, req, "the request"), Steer::Slow);
    assert_eq!(w.s(ss(resp_off), cs(req_end), F::ACK, b"", "the server's pure ACK of the request"), Steer::Slow);
    let h = hdr(body_len);
    let mut first = h.clone();
    first.extend(body(1400 - h.len(), 1));
    assert_eq!(w.s(ss(resp_off), cs(req_end), F::ACK | F::PSH, &first, "the response's first segment"), Steer::Slow);
    w.store_all(true);
    let end = resp_off + h.len() as u32 + body_len;
    let mut off = resp_off + 1400;
    let mut n = 0;
    while off < end {
        let len = (end - off).min(1400);
        let st = w.s(ss(off), cs(req_end), F::ACK, &body(len as usize, n as u8), &format!("body segment at {off}"));
        assert_eq!(st, Steer::Pass, "body segment at {off}");
        off += len;
        n += 1;
        if n % 2 == 0 && off < end {
            assert_eq!(w.c(cs(req_end), ss(off), F::ACK, b"", &format!("client ACK of {off}")), Steer::Pass, "client ACK of {off}");
        }
    }
    assert_eq!(w.c(cs(req_end), ss(end), F::ACK, b"", "the ACK of the whole response"), Steer::Slow);
    w.store_all(true);
    (w.passed_c - pc, w.passed_s - ps)
}

/// Table 1 on a kept-alive connection: two downloads one after the other; everything between
/// the first segment's store and the ACK of the response's end passes.
#[test]
fn table1_download_passes_body_segments_and_client_acks_inside_the_response() {
    let Some(fp) = fast_path("table1_download_passes_body_segments_and_client_acks_inside_the_response") else { return };
    let mut w = World::v4(fp, Config::default());
    w.handshake();
    let (c1, s1) = download(&mut w, 0, REQ, 0, BODY_LEN);
    assert!(c1 >= 6 && s1 >= 13, "{c1} client ACKs, {s1} segments passed");
    let resp2 = hdr(BODY_LEN).len() as u32 + BODY_LEN;
    let (c2, s2) = download(&mut w, REQ.len() as u32, REQ, resp2, 5000);
    assert!(c2 >= 1 && s2 >= 3, "{c2} client ACKs, {s2} segments passed");
    let c = w.fp.counters().unwrap();
    assert_eq!((c.client_passed, c.server_passed), ((c1 + c2) as u64, (s1 + s2) as u64));
    // The ACK lowered to the hold on every passed segment, by tc, counted as the engine does.
    assert_eq!(c.acks_lowered as usize, s1 + s2);
    eprintln!("table1: {} passed, {} slow", w.passed_c + w.passed_s, w.slow);
}

/// The same over IPv6 (no extension headers).
#[test]
fn table1_download_over_ipv6() {
    let Some(fp) = fast_path("table1_download_over_ipv6") else { return };
    let mut w = World::v6(fp, Config::default());
    w.handshake();
    let (c1, s1) = download(&mut w, 0, REQ, 0, BODY_LEN);
    assert!(c1 >= 6 && s1 >= 13, "{c1} client ACKs, {s1} segments passed");
}

/// Without a marker in the frame the core records nothing: the packets pass; without a load
/// balancer server packets are not fenced.
#[test]
fn no_marker_and_no_fence() {
    let Some(fp) = fast_path("no_marker_and_no_fence") else { return };
    let mut w = World::v4(fp, Config::default());
    w.mac = [0x02, 0, 0, 0, 0, 9];
    w.bucket = None;
    w.fenced = false;
    w.lease(false);
    w.handshake();
    let (c1, s1) = download(&mut w, 0, REQ, 0, BODY_LEN);
    assert!(c1 >= 6 && s1 >= 13, "{c1} client ACKs, {s1} segments passed");
}

/// A response bigger than the progress step: the segment that makes the progress mark due
/// goes slow (a store, the segments after it held until it is stored), then passing resumes.
#[test]
fn progress_mark_due_goes_slow() {
    let Some(fp) = fast_path("progress_mark_due_goes_slow") else { return };
    let mut w = World::v4(fp, Config { progress_step: 8000, ..Config::default() });
    let req_end = w.into_the_body();
    let mut off = 1400;
    let mut kinds = vec![];
    while off < 12_000 {
        kinds.push(w.s(ss(off), cs(req_end), F::ACK, &body(1400, 3), "body"));
        if kinds.last() == Some(&Steer::Slow) {
            w.store_all(true);
        }
        off += 1400;
    }
    assert_eq!(kinds.iter().filter(|k| **k == Steer::Slow).count(), 1, "{kinds:?}");
    assert_eq!(kinds[4], Steer::Slow, "the segment reaching 8000 bytes: {kinds:?}");
}

/// The fence: with the bucket's lease lapsed (or the bucket another server's), server packets
/// go slow (the core holds them); the client's still pass.
#[test]
fn lapsed_lease_sends_server_packets_to_the_slow_path() {
    let Some(fp) = fast_path("lapsed_lease_sends_server_packets_to_the_slow_path") else { return };
    let mut w = World::v4(fp, Config::default());
    let req_end = w.into_the_body();
    assert_eq!(w.s(ss(1400), cs(req_end), F::ACK, &body(1400, 1), "leased"), Steer::Pass);
    w.lease(false);
    let p = w.server_pkt(ss(2800), cs(req_end), F::ACK, &body(1400, 2));
    let before = w.fp.get(&w.k).unwrap().unwrap();
    let run = w.fp.run(Prog::ToClient, &p, w.mac, 0).unwrap();
    assert_eq!(run.steer(), Steer::Slow, "no lease");
    assert_eq!(w.fp.get(&w.k).unwrap().unwrap().kept(), before.kept());
    // (The core fences it: the engine never sees it until the lease is back.)
    w.lease(true);
    w.publish();
    assert_eq!(w.send(Dir::ToClient, &p, "leased again"), Steer::Pass);
    assert_eq!(w.c(cs(req_end), ss(4200), F::ACK, b"", "client ack"), Steer::Pass);
}

/// The agent's own lease: a killed or wedged agent renews it no more, and once it lapses both
/// filters pass nothing (its queue rules keep these filters until a successor replaces them,
/// and the successor must see every packet: a client ACK of a rebuilt connection whose socket
/// died with the agent, passed to the kernel, would be answered with a RST). The entry is the
/// slow path's from then on, until the agent publishes it again.
#[test]
fn dead_agent_passes_nothing_once_its_own_lease_lapses() {
    let Some(fp) = fast_path("dead_agent_passes_nothing_once_its_own_lease_lapses") else { return };
    let mut w = World::v4(fp, Config::default());
    let req_end = w.into_the_body();
    assert_eq!(w.s(ss(1400), cs(req_end), F::ACK, &body(1400, 1), "alive"), Steer::Pass);
    assert_eq!(w.c(cs(req_end), ss(2800), F::ACK, b"", "client ack, alive"), Steer::Pass);
    // The agent stops renewing (its lease ends now): both directions go slow, nothing kept.
    w.fp.set_alive(monotonic_ns());
    let before = w.fp.get(&w.k).unwrap().unwrap();
    let c = w.client_pkt(cs(req_end), ss(2800), F::ACK, b"");
    let run = w.fp.run(Prog::FromClient, &c, w.mac, 0).unwrap();
    assert_eq!(run.steer(), Steer::Slow, "a client ACK with no live agent");
    let after = w.fp.get(&w.k).unwrap().unwrap();
    assert_eq!(after.kept(), before.kept());
    assert_ne!(after.flags & object::flag::USER, 0, "the entry is the slow path's");
    let p = w.server_pkt(ss(2800), cs(req_end), F::ACK, &body(1400, 2));
    assert_eq!(w.fp.run(Prog::ToClient, &p, w.mac, 0).unwrap().steer(), Steer::Slow, "a server segment with no live agent");
    // An agent that published again but is not alive still passes nothing.
    w.publish();
    assert_eq!(w.fp.run(Prog::FromClient, &c, w.mac, 0).unwrap().steer(), Steer::Slow, "published, not alive");
    // Alive again: the engine's decisions pass again.
    w.fp.set_alive(monotonic_ns() + 3_600_000_000_000);
    w.publish();
    assert_eq!(w.send(Dir::ToClient, &p, "alive again"), Steer::Pass);
    assert_eq!(w.c(cs(req_end), ss(4200), F::ACK, b"", "client ack, alive again"), Steer::Pass);
}

/// A successor revokes its predecessor's fast path: the predecessor, killed, renews its own
/// lease no more, and its pinned filters (which its queue rules still name) would pass packets
/// until it lapsed; `revoke_pinned` on the pin directory ends it at once. Nothing pinned there:
/// nothing to revoke; `unpin_filters` removes every pin.
#[test]
fn successor_revokes_the_pinned_fast_path_of_its_predecessor() {
    let Some(fp) = fast_path("successor_revokes_the_pinned_fast_path_of_its_predecessor") else { return };
    object::ensure_bpffs().unwrap();
    let dir = std::path::PathBuf::from(format!("/sys/fs/bpf/unbroken-test-revoke-{}", std::process::id()));
    let _ = object::unpin_filters(&dir);
    assert!(!object::revoke_pinned(&dir).unwrap(), "nothing pinned yet");
    let mut w = World::v4(fp, Config::default());
    w.fp.pin_filters(&dir).unwrap();
    let req_end = w.into_the_body();
    assert_eq!(w.c(cs(req_end), ss(1400), F::ACK, b"", "client ack before"), Steer::Pass);
    let revoked = object::revoke_pinned(&dir);
    let c = w.client_pkt(cs(req_end), ss(1400), F::ACK, b"");
    let after = w.fp.run(Prog::FromClient, &c, w.mac, 0).map(|r| r.steer());
    object::unpin_filters(&dir).unwrap();
    assert!(revoked.unwrap(), "the pinned leases were found");
    assert_eq!(after.unwrap(), Steer::Slow, "the predecessor's filter passes nothing once revoked");
    assert!(!dir.exists(), "every pin removed");
}

/// §3.2 case ③ on a connection this server rebuilt (`Engine::adopt`): the rebuilt socket
/// resends from the client's ACK (bytes parsed long ago: they pass, `sent_next` kept), the
/// rest of the body passes, and a client ACK of bytes this socket never sent is the slow
/// path's (`acks_unsent`: superseded).
#[test]
fn case3_adopted_connection_resends_and_supersede_goes_slow() {
    let Some(fp) = fast_path("case3_adopted_connection_resends_and_supersede_goes_slow") else { return };
    // The record of a download as the dead server stored it.
    let mut w0 = World::v4(Object::load().unwrap(), Config::default());
    w0.handshake();
    let req_end = REQ.len() as u32;
    w0.c(cs(0), ss(0), F::ACK | F::PSH, REQ, "request");
    let h = hdr(BODY_LEN);
    let mut first = h.clone();
    first.extend(body(1400 - h.len(), 1));
    w0.s(ss(0), cs(req_end), F::ACK, &first, "first");
    let rec = w0.store_all(true).pop().unwrap();
    for off in (1400..8000).step_by(1400) {
        w0.s(ss(off), cs(req_end), F::ACK, &body(1400, 1), "the dead server's body");
    }
    let hl = h.len() as u32;
    let t = Trigger { seq: cs(req_end), ack: ss(3000), payload_len: 0, flags: F::ACK, window: 500, tsval: Some(1), tsecr: Some(2) };
    let plan = plan_recovery(&rec, &t).unwrap();
    let mut w = World::v4(fp, Config::default());
    w.adopt(&rec, &plan);
    // The agent's first packet of the adopted connection comes from the rebuilt socket.
    w.publish();
    // The first resent segment tells the client its request arrived (`told`): slow; the
    // rest pass (their bytes were parsed by the dead server: only `sent_next` moves).
    assert_eq!(w.s(ss(3000), cs(req_end), F::ACK, &body(1000, 2), "resent, told"), Steer::Slow);
    let mut off = 4000;
    while off < 8000 {
        assert_eq!(w.s(ss(off), cs(req_end), F::ACK, &body(1000, 2), "resent"), Steer::Pass, "resent at {off}");
        off += 1000;
    }
    // The client's first ACK marks the connection established (slow), later ones pass.
    assert_eq!(w.c(cs(req_end), ss(5000), F::ACK, b"", "the client's first ACK"), Steer::Slow);
    assert_eq!(w.c(cs(req_end), ss(6000), F::ACK, b"", "client ACK within sent"), Steer::Pass);
    assert_eq!(w.c(cs(req_end), ss(9000), F::ACK, b"", "client ACK beyond sent"), Steer::Slow);
    assert!(!w.e.knows(&w.key), "superseded");
    let _ = hl;
}

/// xorshift64: deterministic, so a failing case replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
}

/// How a random run starts: a live connection, the server's byte stream from offset 0, where
/// the client's stream stands (its next sequence number), the ACK field the server sends, and
/// how far the server has sent.
struct Start {
    w: World,
    stream: Vec<u8>,
    cseq: u32,
    srv_ack: u32,
    srv: u32,
}

const REQ2: &[u8] = b"GET /small.bin HTTP/1.1\r\nHost: s\r\n\r\n";

/// The server's stream of responses with these body lengths (bodies as `body`).
fn responses(lens: &[u32]) -> Vec<u8> {
    let mut v = vec![];
    for (i, &n) in lens.iter().enumerate() {
        v.extend(hdr(n));
        v.extend(body(n as usize, i as u8));
    }
    v
}

/// Sends the server's stream from `from` to `to` in 1400-byte segments, storing after each
/// slow one; returns how many passed.
fn serve(w: &mut World, stream: &[u8], from: u32, to: u32, ack: u32) -> usize {
    let (mut off, mut passed) = (from, 0);
    while off < to {
        let n = (to - off).min(1400);
        let st = w.s(ss(off), ack, F::ACK, &stream[off as usize..(off + n) as usize], &format!("segment at {off}"));
        if st == Steer::Slow {
            w.store_all(true);
        } else {
            passed += 1;
        }
        off += n;
    }
    passed
}

/// Starting points: 0 a download (Table 1), 1 a client that half-closed after its request,
/// 2 two pipelined requests (the first response's end inside the run), 3 a connection this
/// server rebuilt (§3.2 case ③, `Engine::adopt`), 4 a chunked response (unprotected, passed
/// through).
fn start(kind: u64, v6: bool, cfg: Config) -> Start {
    let fp = Object::load().unwrap();
    let mut w = if v6 { World::v6(fp, cfg.clone()) } else { World::v4(fp, cfg.clone()) };
    let req_end = REQ.len() as u32;
    match kind {
        0 | 1 => {
            w.handshake();
            let fin = kind == 1;
            w.c(cs(0), ss(0), F::ACK | F::PSH | if fin { F::FIN } else { 0 }, REQ, "request");
            let stream = responses(&[BODY_LEN]);
            let ack = cs(req_end + fin as u32);
            serve(&mut w, &stream, 0, 1400, ack);
            Start { w, stream, cseq: ack, srv_ack: ack, srv: 1400 }
        }
        2 => {
            w.handshake();
            let mut reqs = REQ.to_vec();
            reqs.extend_from_slice(REQ2);
            w.c(cs(0), ss(0), F::ACK | F::PSH, &reqs, "pipelined requests");
            let stream = responses(&[2500, BODY_LEN]);
            let ack = cs(reqs.len() as u32);
            serve(&mut w, &stream, 0, 1400, ack);
            Start { w, stream, cseq: ack, srv_ack: ack, srv: 1400 }
        }
        4 => {
            // A chunked response: not resumable, so unprotected (a tombstone stored), then
            // passed through.
            w.handshake();
            w.c(cs(0), ss(0), F::ACK | F::PSH, REQ, "request");
            let mut stream = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
            while stream.len() < 30_000 {
                stream.extend_from_slice(b"400\r\n");
                stream.extend(body(0x400, 9));
                stream.extend_from_slice(b"\r\n");
            }
            let ack = cs(req_end);
            serve(&mut w, &stream, 0, 1400, ack);
            w.store_all(true);
            Start { w, stream, cseq: ack, srv_ack: ack, srv: 1400 }
        }
        _ => {
            // The dead server's record, then the rebuild from a client that has 3000 bytes.
            let mut w0 = World::v4(Object::load().unwrap(), cfg);
            w0.handshake();
            w0.c(cs(0), ss(0), F::ACK | F::PSH, REQ, "request");
            let stream = responses(&[BODY_LEN]);
            w0.s(ss(0), cs(req_end), F::ACK, &stream[..1400], "first");
            let rec = w0.store_all(true).pop().expect("the record of the first response");
            let t = Trigger { seq: cs(req_end), ack: ss(1000), payload_len: 0, flags: F::ACK, window: 500, tsval: Some(1), tsecr: Some(2) };
            let plan = plan_recovery(&rec, &t).unwrap();
            w.adopt(&rec, &plan);
            w.publish();
            Start { w, stream, cseq: cs(req_end), srv_ack: cs(req_end), srv: 1000 }
        }
    }
}

/// Random sequences from each starting point: client ACKs and segments anywhere around the
/// stream positions (in and out of the window, before, inside and past the responses),
/// server segments of its real stream around what it sent (retransmissions, gaps, new bytes
/// past a body, pure ACKs, ACK fields around the requests), random flags, store completions
/// that come late or fail, the lease lapsing, both families. Whatever passes must be the
/// engine's answer (`World::send`).
#[test]
fn random_sequences_agree_with_the_engine() {
    let Some(fp0) = fast_path("random_sequences_agree_with_the_engine") else { return };
    drop(fp0);
    let seed = std::env::var("FASTPATH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x0b1e_c722u64);
    let runs: usize = std::env::var("FASTPATH_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(50);
    let mut rng = Rng(seed);
    let (mut passed, mut slow, mut packets) = (0usize, 0usize, 0usize);
    let mut passed_by_kind = [0usize; 5];
    for run in 0..runs {
        let cfg = Config { progress_step: if rng.chance(300) { 6000 } else { 256 << 20 }, ..Config::default() };
        let kind = (run % 5) as u64;
        let Start { mut w, stream, cseq, srv_ack, mut srv } = start(kind, run % 8 == 5, cfg);
        let total = stream.len() as u32;
        let mut cli_acked = 0u32;
        for step in 0..100 {
            let what = format!("seed {seed:#x} run {run} (start {kind}) step {step}");
            let r = rng.below(100);
            if r < 40 {
                // The server: mostly the next segment, sometimes a retransmission, a gap, a
                // pure ACK, bytes past the stream, an odd ACK field, flags.
                let (seq, len) = match rng.below(10) {
                    0 => (rng.below(srv as u64 + 1) as u32, rng.below(1400) as u32),
                    1 => (srv + 1 + rng.below(3000) as u32, 100),
                    2 => (srv, 0),
                    3 => (total.saturating_sub(rng.below(1000) as u32).max(srv.min(total)), 1400),
                    _ => (srv, 1 + rng.below(1400) as u32),
                };
                // Where the client's stream stands now (requests sent during the run move it).
                let (cli_next, fin) = w.e.fast_view(&w.key).map_or((0, false), |v| (v.cli_next as u32, v.cli_fin.is_some()));
                let ack = match rng.below(10) {
                    0 => srv_ack.wrapping_sub(rng.below(100) as u32).wrapping_add(rng.below(4) as u32),
                    1 => rng.next() as u32,
                    2 | 3 => cs(cli_next + fin as u32),
                    _ => srv_ack,
                };
                let mut fl = F::ACK;
                if rng.chance(50) {
                    fl |= [F::FIN, F::RST, F::SYN, F::PSH, F::URG][rng.below(5) as usize];
                }
                if rng.chance(20) {
                    fl &= !F::ACK;
                }
                let pl: Vec<u8> = (seq..seq + len).map(|o| stream.get(o as usize).copied().unwrap_or(b'x')).collect();
                let p = w.server_pkt(ss(seq), ack, fl, &pl);
                if w.send(Dir::ToClient, &p, &what) == Steer::Pass {
                    passed += 1;
                    passed_by_kind[kind as usize] += 1;
                } else {
                    slow += 1;
                }
                if seq + len > srv && seq <= srv {
                    srv = seq + len;
                }
            } else if r < 85 {
                // The client: mostly ACKs of what arrived, sometimes beyond, before, out of
                // the window, with data, bad checksums, foreign markers, flags.
                let a = match rng.below(10) {
                    0 => rng.below(total as u64 + 3000) as u32,
                    1 => srv + rng.below(2000) as u32,
                    2 => rng.next() as u32,
                    _ => cli_acked.max(srv.saturating_sub(rng.below(3000) as u32)),
                };
                let now_at = w.e.fast_view(&w.key).map_or(cseq, |v| cs(v.cli_next as u32 + v.cli_fin.is_some() as u32));
                let seq = match rng.below(12) {
                    0 => cseq.wrapping_add(rng.below(1 << 20) as u32),
                    1 => cseq.wrapping_sub(1 + rng.below(5) as u32),
                    2 => rng.next() as u32,
                    3..=6 => now_at,
                    _ => cseq,
                };
                let mut fl = F::ACK;
                if rng.chance(40) {
                    fl |= [F::FIN, F::RST, F::SYN, F::PSH, F::URG][rng.below(5) as usize];
                }
                let pl: &[u8] = match rng.below(100) {
                    0..=2 => b"GET / HTTP/1.1\r\n",
                    3..=5 => REQ2,
                    _ => b"",
                };
                let mut p = w.client_pkt(seq, ss(a), fl, pl);
                if rng.chance(30) {
                    let n = p.len();
                    p[n - 1 - rng.below(12) as usize] ^= 0x40; // a wrong checksum (or a changed field)
                }
                let mac = if rng.chance(30) { marker_mac(BUCKET + 1) } else { w.mac };
                if w.send_mac(Dir::FromClient, &p, mac, &what) == Steer::Pass {
                    passed += 1;
                    passed_by_kind[kind as usize] += 1;
                    cli_acked = cli_acked.max(a);
                } else {
                    slow += 1;
                }
            } else if r < 93 {
                w.store_all(!rng.chance(100));
            } else if r < 96 {
                w.lease(false);
                w.publish();
            } else {
                w.lease(true);
                w.publish();
            }
            packets += 1;
            if !w.e.tracks(&w.key) {
                break;
            }
        }
    }
    eprintln!("random sequences: {runs} runs, {packets} steps, {passed} passed ({passed_by_kind:?} by start), {slow} slow");
    assert!(passed > packets / 10, "too few passed: {passed} of {packets}");
    assert!(passed_by_kind.iter().all(|&n| n > 0), "a start never passed anything: {passed_by_kind:?}");
}

/// Two pipelined requests: the first response's body passes up to its end; the segment that
/// carries the second response's header and the client's ACK of the first response's end are
/// the slow path's; the second body and the client's ACKs inside it pass.
#[test]
fn pipelined_responses_wall_at_each_end() {
    let Some(fp) = fast_path("pipelined_responses_wall_at_each_end") else { return };
    drop(fp);
    let Start { mut w, stream, cseq, srv_ack, .. } = start(2, false, Config::default());
    let end1 = (hdr(2500).len() + 2500) as u32;
    let end2 = stream.len() as u32;
    // Up to the segment that crosses into the second header.
    assert_eq!(w.s(ss(1400), srv_ack, F::ACK, &stream[1400..end1 as usize], "the rest of the first body"), Steer::Pass);
    assert_eq!(w.c(cseq, ss(2000), F::ACK, b"", "inside the first response"), Steer::Pass);
    assert_eq!(w.s(ss(end1), srv_ack, F::ACK, &stream[end1 as usize..end1 as usize + 1400], "the second header"), Steer::Slow);
    w.store_all(true);
    assert_eq!(w.c(cseq, ss(end1), F::ACK, b"", "the first response's end"), Steer::Slow);
    w.store_all(true);
    let passed = serve(&mut w, &stream, end1 + 1400, end2, srv_ack);
    assert!(passed >= 13, "{passed}");
    assert_eq!(w.c(cseq, ss(end1 + 5000), F::ACK, b"", "inside the second response"), Steer::Pass);
    assert_eq!(w.c(cseq, ss(end2), F::ACK, b"", "the second response's end"), Steer::Slow);
}

/// A request pipelined during a download: the client's request is the slow path's (parsed),
/// and so is the server's next body segment, whose ACK tells of it (`srv_ack` grows); the
/// segments after it pass, their ACK lowered to the hold as before.
#[test]
fn request_during_a_download_makes_the_next_server_ack_slow() {
    let Some(fp) = fast_path("request_during_a_download_makes_the_next_server_ack_slow") else { return };
    drop(fp);
    let Start { mut w, stream, cseq, srv_ack, .. } = start(0, false, Config::default());
    assert_eq!(w.s(ss(1400), srv_ack, F::ACK, &stream[1400..2800], "body"), Steer::Pass);
    assert_eq!(w.c(cseq, ss(2800), F::ACK | F::PSH, REQ2, "the next request"), Steer::Slow);
    let ack2 = cseq.wrapping_add(REQ2.len() as u32);
    assert_eq!(w.s(ss(2800), ack2, F::ACK, &stream[2800..4200], "the first ACK of it"), Steer::Slow);
    w.store_all(true);
    assert_eq!(w.s(ss(4200), ack2, F::ACK, &stream[4200..5600], "body"), Steer::Pass);
    assert_eq!(w.c(ack2, ss(5600), F::ACK, b"", "client ACK after its request"), Steer::Pass);
}

/// An unprotected connection (a chunked response: `unprotected_http`, a tombstone): while the
/// tombstone is being stored its ACKs are still lowered (slow); once stored, the engine parses
/// nothing and the kernel passes its segments and the client's ACKs without the response walls,
/// keeping only `sent_next` (not `srv_next`, not `client_acked`, which the engine no longer
/// moves); its FIN is the slow path's.
#[test]
fn unprotected_connection_passes_through_once_its_tombstone_is_stored() {
    let Some(fp) = fast_path("unprotected_connection_passes_through_once_its_tombstone_is_stored") else { return };
    drop(fp);
    let Start { mut w, stream, cseq, srv_ack, .. } = start(4, false, Config::default());
    let v = w.e.fast_view(&w.key).unwrap();
    assert!(!v.protected && v.ack_limit.is_none() && !v.stale_record, "{v:?}");
    let s = w.fp.get(&w.k).unwrap().unwrap();
    assert_ne!(s.flags & flag::PASSTHROUGH, 0);
    let mut off = 1400;
    while off + 1400 <= 20_000 {
        assert_eq!(w.s(ss(off), srv_ack, F::ACK, &stream[off as usize..off as usize + 1400], "chunked body"), Steer::Pass);
        off += 1400;
        assert_eq!(w.c(cseq, ss(off - 700), F::ACK, b"", "client ACK"), Steer::Pass);
    }
    let v = w.e.fast_view(&w.key).unwrap();
    assert_eq!((v.srv_next, v.client_acked), (1400, 0), "the engine moves neither");
    assert_eq!(w.s(ss(off), srv_ack, F::ACK | F::FIN, &stream[off as usize..off as usize + 100], "FIN"), Steer::Slow);
}

/// A client that half-closed with its request (`shutdown(SHUT_WR)`): the server's first ACK of
/// the FIN is news (`srv_ack` counts one more), then the download passes as any; a failed
/// store (degraded, unprotected) sends everything to the slow path.
#[test]
fn half_closed_client_downloads_and_a_failed_store_goes_slow() {
    let Some(fp) = fast_path("half_closed_client_downloads_and_a_failed_store_goes_slow") else { return };
    drop(fp);
    let Start { mut w, stream, cseq, srv_ack, .. } = start(1, false, Config::default());
    let v = w.e.fast_view(&w.key).unwrap();
    assert_eq!((v.cli_fin, v.srv_ack), (Some(REQ.len() as u64), REQ.len() as u64 + 1));
    let passed = serve(&mut w, &stream, 1400, 14_000, srv_ack);
    assert!(passed >= 8, "{passed}");
    assert_eq!(w.c(cseq, ss(7000), F::ACK, b"", "client ACK"), Steer::Pass);
    // A progress store that fails: degraded, nothing passes any more.
    w.expire();
    assert_eq!(w.c(cseq, ss(14_000), F::ACK, b"", "the ACK of the first 14000 bytes"), Steer::Pass);
    let Start { mut w, stream, cseq, srv_ack, .. } = start(0, false, Config { progress_step: 4000, ..Config::default() });
    serve_until_slow(&mut w, &stream, srv_ack);
    w.store_all(false);
    assert!(w.e.is_protected(&w.key) == Some(false));
    assert_eq!(w.c(cseq, ss(2000), F::ACK, b"", "degraded: client ACK"), Steer::Slow);
    assert_eq!(w.s(ss(8400), srv_ack, F::ACK, &stream[8400..9800], "degraded: segment"), Steer::Slow);
}

/// Serves 1400-byte segments from 1400 until one goes slow (its store left pending).
fn serve_until_slow(w: &mut World, stream: &[u8], ack: u32) {
    let mut off = 1400;
    while w.s(ss(off), ack, F::ACK, &stream[off as usize..off as usize + 1400], "until slow") == Steer::Pass {
        off += 1400;
    }
}

/// A live download: the first response segment stored, one body segment passed.
fn live(v6: bool) -> World {
    live_with(v6, Object::load().unwrap())
}

fn live_with(v6: bool, fp: Object) -> World {
    let mut w = if v6 { World::v6(fp, Config::default()) } else { World::v4(fp, Config::default()) };
    let req_end = w.into_the_body();
    assert_eq!(w.s(ss(1400), cs(req_end), F::ACK, &body(1400, 1), "body"), Steer::Pass);
    w
}

/// Hostile and unusual packets on a live download, each an edit of a pure ACK or a body
/// segment that would pass: each goes through both paths on a fresh connection (so whatever
/// passes is the engine's answer), and all but the data offsets that still describe a
/// well-formed segment must go to the slow path, the kernel's kept fields untouched.
#[test]
fn hostile_packets_go_slow() {
    let Some(fp) = fast_path("hostile_packets_go_slow") else { return };
    drop(fp);
    let req_end = REQ.len() as u32;
    let mut w = live(false);
    let good_c = w.client_pkt(cs(req_end), ss(2000), F::ACK, b"");
    let good_s = w.server_pkt(ss(2800), cs(req_end), F::ACK, &body(1400, 2));
    let mac = w.mac;
    // (name, direction, packet, source MAC, may pass)
    type Case = (&'static str, Dir, Vec<u8>, [u8; 6], bool);
    let mut cases: Vec<Case> = vec![];
    for (fl, name) in [(F::SYN | F::ACK, "SYN"), (F::SYN, "bare SYN"), (F::FIN | F::ACK, "FIN"), (F::RST | F::ACK, "RST"), (F::RST, "bare RST"), (0, "no flags"), (F::SYN | F::FIN | F::RST | F::ACK, "every flag")] {
        cases.push((name, Dir::FromClient, w.client_pkt(cs(req_end), ss(2000), fl, b""), mac, false));
        let p = w.server_pkt(ss(2800), cs(req_end), fl, &body(10, 1));
        cases.push((name, Dir::ToClient, p, mac, false));
    }
    // Truncated: the IP length says less than a TCP header, or more than the frame; data
    // offsets below 5, past the segment, or taking payload bytes as options.
    let trunc = |p: &[u8], tot: u16| {
        let mut q = p.to_vec();
        q[2..4].copy_from_slice(&tot.to_be_bytes());
        q
    };
    cases.push(("IP length short of a TCP header", Dir::FromClient, trunc(&good_c, 30), mac, false));
    cases.push(("IP length short of a TCP header", Dir::ToClient, trunc(&good_s, 30), mac, false));
    cases.push(("IP length past the frame", Dir::FromClient, trunc(&good_c, 1500), mac, false));
    cases.push(("a frame cut short", Dir::ToClient, good_s[..good_s.len() - 100].to_vec(), mac, false));
    cases.push(("a frame cut inside the TCP header", Dir::FromClient, good_c[..30].to_vec(), mac, false));
    for doff in [0u8, 4, 9, 15] {
        let mut q = good_c.clone();
        q[20 + 12] = doff << 4;
        cases.push(("bad data offset", Dir::FromClient, q, mac, false));
        let mut q = good_s.clone();
        q[20 + 12] = doff << 4;
        cases.push(("data offset taking payload as options", Dir::ToClient, q, mac, doff > 8));
    }
    // IP options (IHL 6), fragments (MF, offset), another protocol, another IP version.
    for (name, edit) in [("IP options", 0usize), ("more fragments", 1), ("fragment offset", 2), ("UDP", 3), ("IP version 5", 4)] {
        for (dir, p) in [(Dir::FromClient, &good_c), (Dir::ToClient, &good_s)] {
            let mut q = p.clone();
            match edit {
                0 => {
                    q.splice(20..20, [1u8, 1, 1, 0]);
                    q[0] = 0x46;
                    let tot = q.len() as u16;
                    q[2..4].copy_from_slice(&tot.to_be_bytes());
                }
                1 => q[6] |= 0x20,
                2 => q[7] = 1,
                3 => q[9] = 17,
                _ => q[0] = 0x55,
            }
            cases.push((name, dir, q, mac, false));
        }
    }
    // A client ACK with a wrong checksum; with another bucket's marker; with data.
    let mut q = good_c.clone();
    let n = q.len();
    q[n - 1] ^= 1;
    cases.push(("wrong checksum", Dir::FromClient, q, mac, false));
    cases.push(("another bucket's marker", Dir::FromClient, good_c.clone(), marker_mac(BUCKET + 1), false));
    cases.push(("client data", Dir::FromClient, w.client_pkt(cs(req_end), ss(2000), F::ACK, b"x"), mac, false));
    // Zero bytes of data add nothing to the checksum: the header's sum alone verifies.
    cases.push(("client data that sums to zero", Dir::FromClient, w.client_pkt(cs(req_end), ss(2000), F::ACK, &[0, 0]), mac, false));
    // The client: ACK of bytes never sent, of the whole response, out of the window, before
    // the stream's position (a keepalive).
    cases.push(("ACK of unsent bytes", Dir::FromClient, w.client_pkt(cs(req_end), ss(2801), F::ACK, b""), mac, false));
    cases.push(("keepalive", Dir::FromClient, w.client_pkt(cs(req_end - 1), ss(2000), F::ACK, b""), mac, false));
    cases.push(("beyond the window", Dir::FromClient, w.client_pkt(cs(req_end + (1 << 20)), ss(2000), F::ACK, b""), mac, false));
    // The server: a SACK option, an unknown option, a truncated timestamp, two timestamps, a
    // gap, bytes past the body, a pure ACK past the hold, an ACK of client bytes it never had.
    let sack = Repr { seq: Seq(ss(2800)), ack: Seq(cs(req_end)), flags: F::ACK, window: 1000, timestamp: Some((5000, 77)), sack: [(Seq(cs(req_end + 5)), Seq(cs(req_end + 9))), (Seq(0), Seq(0)), (Seq(0), Seq(0)), (Seq(0), Seq(0))], sack_len: 1, ..Default::default() };
    cases.push(("server SACK", Dir::ToClient, w.build(Dir::ToClient, sack, &body(100, 3)), mac, false));
    for opts in [[1u8, 1, 30, 2], [8, 10, 0, 0], [8, 4, 0, 0]] {
        let mut q = good_s.clone();
        q.splice(40..40, opts);
        q[32] += 1 << 4;
        let tot = q.len() as u16;
        q[2..4].copy_from_slice(&tot.to_be_bytes());
        cases.push(("odd option", Dir::ToClient, q, mac, false));
    }
    let mut q = good_s.clone();
    q.splice(40..40, [1u8, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 2]);
    q[32] += 3 << 4;
    let tot = q.len() as u16;
    q[2..4].copy_from_slice(&tot.to_be_bytes());
    cases.push(("two timestamps", Dir::ToClient, q, mac, false));
    cases.push(("a gap", Dir::ToClient, w.server_pkt(ss(2900), cs(req_end), F::ACK, &body(100, 2)), mac, false));
    cases.push(("pure ACK past the hold", Dir::ToClient, w.server_pkt(ss(2800), cs(req_end), F::ACK, b""), mac, false));
    cases.push(("ACK of unseen client bytes (the engine lowers it as any)", Dir::ToClient, w.server_pkt(ss(2800), cs(req_end + 3), F::ACK, &body(100, 2)), mac, true));
    eprintln!("hostile packets: {} edits, and two more below", cases.len());
    for (i, (name, dir, p, mac, may_pass)) in cases.into_iter().enumerate() {
        let mut w = live(false);
        // (A packet the filter cannot parse names no connection: no entry is marked.)
        w.check_user = false;
        let before = w.fp.get(&w.k).unwrap().unwrap();
        let st = w.send_mac(dir, &p, mac, &format!("case {i}: {name} ({dir:?})"));
        if !may_pass {
            assert_eq!(st, Steer::Slow, "case {i}: {name} ({dir:?}) passed");
        }
        if st == Steer::Slow {
            let _ = before;
        }
    }
    // New bytes past the body: the next response's header (an entry, a store).
    let mut w = live(false);
    let end = hdr(BODY_LEN).len() as u32 + BODY_LEN;
    let mut off = 2800;
    while off + 1400 <= end {
        assert_eq!(w.s(ss(off), cs(req_end), F::ACK, &body(1400, 2), "body"), Steer::Pass);
        off += 1400;
    }
    let mut last = body((end - off) as usize, 3);
    last.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
    assert_eq!(w.s(ss(off), cs(req_end), F::ACK, &last, "past the body"), Steer::Slow);
    // IPv6 with a hop-by-hop extension header in front of TCP.
    let mut w6 = live(true);
    let p6 = w6.client_pkt(cs(req_end), ss(2000), F::ACK, b"");
    assert_eq!(w6.send(Dir::FromClient, &p6, "IPv6 ACK"), Steer::Pass);
    let mut q = w6.client_pkt(cs(req_end), ss(2100), F::ACK, b"");
    q[6] = 0; // next header: hop-by-hop
    q.splice(40..40, [6u8, 0, 1, 4, 0, 0, 0, 0]);
    let plen = (q.len() - 40) as u16;
    q[4..6].copy_from_slice(&plen.to_be_bytes());
    w6.check_user = false;
    assert_eq!(w6.send(Dir::FromClient, &q, "IPv6 extension header"), Steer::Slow);
}

/// Conn::in_window at its edges: a pure ACK at the stream's position plus the window the
/// server announced (its latest window field, scaled, at least 64 KiB) is outside, one before
/// it inside; one before the position is outside (a keepalive).
#[test]
fn window_edges_are_the_engines() {
    let Some(fp) = fast_path("window_edges_are_the_engines") else { return };
    drop(fp);
    let pos = cs(REQ.len() as u32);
    // (how far from the stream's position, in windows and bytes; the expected answer)
    for (windows, bytes, expect) in [(0u32, 0i64, Steer::Pass), (0, 1, Steer::Pass), (1, -1, Steer::Pass), (1, 0, Steer::Slow), (0, -1, Steer::Slow)] {
        let mut w = live(false);
        let win = ((w.e.fast_view(&w.key).unwrap().last_window as u32) << 9).max(1 << 16);
        let seq = pos.wrapping_add(windows * win).wrapping_add(bytes as u32);
        let p = w.client_pkt(seq, ss(2000), F::ACK, b"");
        assert_eq!(w.send(Dir::FromClient, &p, &format!("{windows} windows {bytes:+} bytes")), expect, "{windows} windows {bytes:+} bytes");
    }
}

/// A client ACK whose checksum the kernel has not computed (CHECKSUM_PARTIAL: its field holds
/// the pseudo-header's sum, as a Linux sender on this host or behind a veth leaves it), which
/// the engine trusts when NFQUEUE says so: slow by default (a socket filter cannot read
/// `ip_summed`), passed with `trust_partial_csum`, with the engine's state. The price: the same
/// field on a packet from the wire, which the engine verifies and drops, passes too.
#[test]
fn partial_checksums_pass_only_when_trusted() {
    let Some(fp) = fast_path("partial_checksums_pass_only_when_trusted") else { return };
    drop(fp);
    let req_end = REQ.len() as u32;
    let partial = |p: &mut Vec<u8>| {
        let info = IpInfo::parse(p).unwrap();
        let mut s = info.pseudo_sum(info.l4_len);
        while s >> 16 != 0 {
            s = (s & 0xffff) + (s >> 16);
        }
        p[info.l4_offset + 16..info.l4_offset + 18].copy_from_slice(&(s as u16).to_be_bytes());
    };
    for v6 in [false, true] {
        for trust in [false, true] {
            let fp = Object::load_with(object::Options { trust_partial_csum: trust, ..Default::default() }).unwrap();
            let mut w = live_with(v6, fp);
            w.csum_not_ready = true;
            let mut p = w.client_pkt(cs(req_end), ss(2000), F::ACK, b"");
            partial(&mut p);
            let expect = if trust { Steer::Pass } else { Steer::Slow };
            assert_eq!(w.send(Dir::FromClient, &p, &format!("partial, v6 {v6}, trusted {trust}")), expect);
            // A full checksum passes either way.
            let p = w.client_pkt(cs(req_end), ss(2400), F::ACK, b"");
            assert_eq!(w.send(Dir::FromClient, &p, "full"), Steer::Pass);
        }
    }
    let fp = Object::load_with(object::Options { trust_partial_csum: true, ..Default::default() }).unwrap();
    let w = live_with(false, fp);
    let mut p = w.client_pkt(cs(req_end), ss(2000), F::ACK, b"");
    partial(&mut p);
    assert_eq!(w.fp.run(Prog::FromClient, &p, w.mac, 0).unwrap().steer(), Steer::Pass, "the price");
    assert!(!trods::tcp_checksum_ok(&p), "the engine, verifying, drops it");
}

/// The tc program leaves alone what the slow path decided (the agent's verdict mark), and a
/// server packet whose ACK is already at or below the hold.
#[test]
fn tc_leaves_marked_and_lowered_packets_alone() {
    let Some(fp) = fast_path("tc_leaves_marked_and_lowered_packets_alone") else { return };
    let mut w = World::v4(fp, Config::default());
    let req_end = w.into_the_body();
    let p = w.server_pkt(ss(1400), cs(req_end), F::ACK, &body(1400, 1));
    let marked = w.fp.run(Prog::ToClientTc, &p, w.mac, object::DECIDED_MARK).unwrap();
    assert_eq!(hex(&marked.packet), hex(&p));
    // Another agent mark, set at load.
    let fp2 = Object::load_with(object::Options { agent_mark: 0x4242, ..Default::default() }).unwrap();
    let mut w2 = World { fp: fp2, ..w };
    w2.publish();
    let marked = w2.fp.run(Prog::ToClientTc, &p, w2.mac, 0x4242).unwrap();
    assert_eq!(hex(&marked.packet), hex(&p));
    let unmarked = w2.fp.run(Prog::ToClientTc, &p, w2.mac, object::DECIDED_MARK).unwrap();
    assert_ne!(hex(&unmarked.packet), hex(&p));
    let w = w2;
    let lowered = w.fp.run(Prog::ToClientTc, &p, w.mac, 0).unwrap();
    assert_ne!(hex(&lowered.packet), hex(&p));
    let again = w.fp.run(Prog::ToClientTc, &lowered.packet, w.mac, 0).unwrap();
    assert_eq!(hex(&again.packet), hex(&lowered.packet), "idempotent");
    let _ = IpAddr::from([0u8, 0, 0, 0]);
}

/// The hand-off against a program running on the other CPU: while one thread keeps passing
/// client ACKs that move `client_acked` (200 runs of a packet per call, each a write of the
/// kept fields), the other takes the entry (`Object::take`: `USER`, then a stable even write
/// sequence) at random moments. What it reads must be final: at least the ACK of every call
/// that completed before, at most the one in flight, and unchanged by every call after (they
/// all go slow); then it publishes the entry again and the ACKs pass again.
#[test]
fn handoff_take_is_final_while_another_cpu_passes_packets() {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::SeqCst};
    let Some(fp) = fast_path("handoff_take_is_final_while_another_cpu_passes_packets") else { return };
    let mut w = World::v4(fp, Config::default());
    let req_end = REQ.len() as u32;
    let fast = State {
        cli_next: req_end as u64,
        ack_wall: object::NONE,
        body_end: 0,
        sent_wall: object::NONE,
        ack_limit: 0,
        srv_ack: req_end as u64,
        srv_ack_cap: req_end as u64,
        told: 0,
        iss: S_ISN,
        irs: C_ISN,
        flags: flag::CLIENT_FAST | flag::NO_FENCE,
        server_ws: 9,
        last_window: 1000,
        sent_next: 100_000_000,
        ..State::default()
    };
    w.fp.insert(&w.k, &fast).unwrap();
    let packets: Vec<Vec<u8>> = (1..=40_000u32).map(|a| w.client_pkt(cs(req_end), ss(a * 10), F::ACK, b"")).collect();
    let (stop, attempted, completed, calls) = (AtomicBool::new(false), AtomicU32::new(0), AtomicU32::new(0), AtomicU32::new(0));
    let (fp, k, mac) = (&w.fp, w.k, [0x02, 0, 0, 0, 0, 9]);
    let mut takes = 0;
    std::thread::scope(|sc| {
        sc.spawn(|| {
            for (i, p) in packets.iter().enumerate() {
                if stop.load(SeqCst) {
                    break;
                }
                let a = (i as u32 + 1) * 10;
                attempted.store(a, SeqCst);
                fp.run_repeat(Prog::FromClient, p, mac, 200).unwrap();
                completed.store(a, SeqCst);
                calls.fetch_add(1, SeqCst);
            }
            stop.store(true, SeqCst);
        });
        let mut rng = Rng(7);
        // The last ACK taken, and the last call started before the entry was published again:
        // every call after it started with the entry fast.
        let (mut taken, mut started_before_publish) = (0u64, 0u64);
        while !stop.load(SeqCst) {
            std::thread::sleep(std::time::Duration::from_micros(rng.below(200)));
            let done = completed.load(SeqCst) as u64;
            let s = fp.take(&k).unwrap().unwrap();
            let in_flight = attempted.load(SeqCst) as u64;
            let before = if done > started_before_publish { done } else { taken };
            assert_eq!(s.wseq % 2, 0);
            assert!(s.client_acked >= before && s.client_acked <= in_flight, "took {} with calls done up to {before}, in flight {in_flight}", s.client_acked);
            taken = s.client_acked;
            // Two more calls: all slow, nothing written.
            let c = calls.load(SeqCst);
            while calls.load(SeqCst) < c + 2 && !stop.load(SeqCst) {
                std::hint::spin_loop();
            }
            let after = fp.get(&k).unwrap().unwrap();
            // (The write sequence may move: a run that read the flags before the take bails out
            // with two increments.)
            assert_eq!((after.client_acked, after.last_seen_ns), (s.client_acked, s.last_seen_ns), "written after the take");
            takes += 1;
            fp.publish(&k, &State { client_acked: s.client_acked, last_seen_ns: s.last_seen_ns, ..fast }).unwrap();
            started_before_publish = attempted.load(SeqCst) as u64;
        }
    });
    let c = w.fp.counters().unwrap();
    eprintln!("hand-off: {takes} takes, {} runs passed, {} slow", c.client_passed, c.client_slow);
    assert!(takes >= 5 && c.client_passed > 0 && c.client_slow > 0, "{takes} takes, {c:?}");
}

/// The kernel's cost per packet (BPF_PROG_TEST_RUN, mean of 100,000 runs): a passed client
/// ACK, a passed body segment through the filter and tc, and a slow packet.
#[test]
fn cost_per_packet() {
    let Some(fp) = fast_path("cost_per_packet") else { return };
    let mut w = World::v4(fp, Config::default());
    let req_end = w.into_the_body();
    let ack = w.client_pkt(cs(req_end), ss(1000), F::ACK, b"");
    let seg = w.server_pkt(ss(1400), cs(req_end), F::ACK, &body(1400, 1));
    let syn = w.client_pkt(cs(req_end), ss(1000), F::SYN, b"");
    let n = 100_000;
    let t_ack = w.fp.time_per_packet(Prog::FromClient, &ack, w.mac, n).unwrap();
    let t_seg = w.fp.time_per_packet(Prog::ToClient, &seg, w.mac, n).unwrap();
    let t_tc = w.fp.time_per_packet(Prog::ToClientTc, &seg, w.mac, n).unwrap();
    let t_slow = w.fp.time_per_packet(Prog::FromClient, &syn, w.mac, n).unwrap();
    eprintln!("object fast path, ns per packet: client ACK passed {}, body segment passed {} + tc {}, slow (SYN) {}", t_ack.as_nanos(), t_seg.as_nanos(), t_tc.as_nanos(), t_slow.as_nanos());
}
