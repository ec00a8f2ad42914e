//! The agent's decisions without I/O (`control::agentcore::Core`): the failover gate (TRODS
//! section 5.1), learning connections of local sockets after a restart, the lease fence, and
//! muting connections whose bucket went elsewhere. Packets are built byte by byte; the LB's
//! view is a plain `BucketView`; the clock is a number.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};
use unbroken_control::object::agentcore::{AdmitConfig, Core, LbView, Out, Pkt, ADMIT_WAIT_MS, FENCE_MAX_MS, GATE_MAX_PACKETS, GATE_WAIT_MS, LISTED_WAIT_MS, PLAN_KEEP_MS, PLAN_WAIT_MS, RESTART_GRACE_MS};
use unbroken_control::object::lb::BucketView;
use unbroken_drivers::sockdiag::Progress;
use unbroken_engines::trods::{plan_recovery, Config, Dir, Engine, Entry, Handshake, Key, Record, Trigger};
use unbroken_wire::ip;
use unbroken_wire::tcp::{flags as F, Repr};
use unbroken_wire::Seq;

const C_ISN: u32 = 1_000_000;
const S_ISN: u32 = 7_000_000;
const B: u16 = 5; // the connection's bucket

fn c_ip() -> IpAddr {
    "10.77.0.2".parse().unwrap()
}
fn s_ip() -> IpAddr {
    "10.77.0.100".parse().unwrap()
}
fn key(port: u16) -> Key {
    Key { client: SocketAddr::new(c_ip(), port), service: SocketAddr::new(s_ip(), 80) }
}

fn build(src: IpAddr, dst: IpAddr, r: Repr, payload: &[u8]) -> Vec<u8> {
    ip::tcp_packet(src, dst, &r, payload).unwrap()
}

pub struct T {
    core: Core,
    id: u32,
    now: u64,
    view: Option<BucketView>,
    lease_ok: bool,
    outs: Vec<Out>,
}

fn view(epoch: u32, owned: &[u16], allowed: &[u16]) -> BucketView {
    let mut o = vec![0u64; 4];
    let mut a = vec![0u64; 4];
    for &b in owned {
        o[b as usize / 64] |= 1 << (b % 64);
    }
    for &b in allowed {
        a[b as usize / 64] |= 1 << (b % 64);
    }
    let now = Instant::now();
    BucketView { epoch, buckets: 256, owned: o, allowed: a, seq: 1, received_at: now, lease_until: now + Duration::from_secs(3600) }
}

/// The clock of a core that has run for a while (past its start's grace).
const T0: u64 = RESTART_GRACE_MS + 1000;

impl T {
    /// A core that started long ago (its first view's probes done, its grace over).
    fn new() -> T {
        let mut t = T::restarted();
        t.tick(false);
        t.take();
        t.now = T0;
        t
    }
    /// A core that just started (an agent restart): within its grace.
    fn restarted() -> T {
        T { core: Core::new(Engine::new(Config::default()), false, true), id: 0, now: 1000, view: Some(view(1, &[B], &[])), lease_ok: true, outs: vec![] }
    }
    fn relearns(&self) -> Vec<(Key, Option<u16>, Vec<u8>)> {
        self.outs.iter().filter_map(|o| if let Out::Relearn { key, bucket, trigger } = o { Some((*key, *bucket, trigger.clone())) } else { None }).collect()
    }
    fn pkt(&mut self, dir: Dir, port: u16, seq: u32, ack: u32, fl: u8, payload: &[u8]) -> u32 {
        self.id += 1;
        let data = match dir {
            Dir::FromClient => build(c_ip(), s_ip(), Repr { src_port: port, dst_port: 80, seq: Seq(seq), ack: Seq(ack), flags: fl, window: 500, ..Default::default() }, payload),
            Dir::ToClient => build(s_ip(), c_ip(), Repr { src_port: 80, dst_port: port, seq: Seq(seq), ack: Seq(ack), flags: fl, window: 500, ..Default::default() }, payload),
        };
        let p = Pkt { id: self.id, data, dir, bucket: (dir == Dir::FromClient).then_some(B), csum_not_ready: false };
        let (now, view, lease_ok) = (self.now, self.view.take(), self.lease_ok);
        {
            let lb = match &view {
                Some(v) => LbView::View { v, lease_ok, fresh: true },
                None => LbView::Waiting,
            };
            self.core.packets(now, lb, [p]);
        }
        self.view = view;
        self.collect();
        self.id
    }
    /// One loop iteration without packets: the fence, the gate (`local` answers sock_diag),
    /// and step 4.
    fn tick(&mut self, local: bool) {
        let (now, view, lease_ok) = (self.now, self.view.take(), self.lease_ok);
        {
            let lb = match &view {
                Some(v) => LbView::View { v, lease_ok, fresh: true },
                None => LbView::Waiting,
            };
            self.core.packets(now, lb, []);
            self.core.gate(now, lb, |_| Ok(local));
            self.core.after(now, lb);
        }
        self.view = view;
        self.collect();
    }
    fn collect(&mut self) {
        while let Some(o) = self.core.poll() {
            self.outs.push(o);
        }
    }
    fn take(&mut self) -> Vec<Out> {
        std::mem::take(&mut self.outs)
    }
    /// Answers every store request with success.
    fn store_ok(&mut self) {
        for o in self.take() {
            match o {
                Out::Store(op) => self.core.store_done(op.token, true),
                o => self.outs.push(o),
            }
        }
    }
    fn accepted(&self, id: u32) -> bool {
        self.outs.iter().any(|o| matches!(o, Out::Accept { id: i, .. } if *i == id))
    }
    fn dropped(&self, id: u32) -> bool {
        self.outs.iter().any(|o| matches!(o, Out::Drop { id: i, .. } if *i == id))
    }
    /// A connection set up through this core (so the engine knows it).
    fn connect(&mut self, port: u16) {
        let syn = self.pkt(Dir::FromClient, port, C_ISN, 0, F::SYN, b"");
        assert!(self.accepted(syn));
        let sa = self.pkt(Dir::ToClient, port, S_ISN, C_ISN + 1, F::SYN | F::ACK, b"");
        assert!(self.accepted(sa));
        let ack = self.pkt(Dir::FromClient, port, C_ISN + 1, S_ISN + 1, F::ACK, b"");
        assert!(self.accepted(ack));
        self.tick(false);
        self.store_ok();
        self.take();
    }
}

/// A packet of a connection this server does not know, whose bucket the LB did not move here:
/// it waits for the LB's news, then goes to the kernel (which answers it) and is counted. It
/// starts no failover.
#[test]
fn gate_denies_an_unknown_connection_after_the_wait() {
    let mut t = T::new();
    let id = t.pkt(Dir::FromClient, 40000, C_ISN + 100, S_ISN + 5000, F::ACK, b"");
    t.tick(false);
    assert!(!t.accepted(id), "it waits for the LB's view");
    t.now += GATE_WAIT_MS - 1;
    t.tick(false);
    assert!(!t.accepted(id));
    t.now += 1;
    t.tick(false);
    assert!(t.accepted(id), "after the wait, to the kernel");
    assert!(!t.outs.iter().any(|o| matches!(o, Out::Failover { .. })));
    assert_eq!((t.core.counters.failovers_denied, t.core.counters.failovers_started), (1, 0));
}

/// The LB moved the bucket here: a failover starts; the client's next packets wait with the
/// trigger, and go through the engine once the socket is rebuilt; a refusal lets them reach
/// the kernel, and so do later ones without waiting again.
#[test]
fn gate_starts_a_failover_in_a_moved_bucket_and_holds_the_connection() {
    let mut t = T::new();
    t.view = Some(view(2, &[B], &[B]));
    let id = t.pkt(Dir::FromClient, 40000, C_ISN + 100, S_ISN + 5000, F::ACK, b"");
    t.tick(false);
    let fo: Vec<_> = t.outs.iter().filter(|o| matches!(o, Out::Failover { .. })).collect();
    assert_eq!(fo.len(), 1);
    assert!(matches!(fo[0], Out::Failover { key: k, bucket: Some(B), .. } if *k == key(40000)));
    assert!(!t.accepted(id), "the trigger waits for the rebuild");
    let id2 = t.pkt(Dir::FromClient, 40000, C_ISN + 100, S_ISN + 5000, F::ACK, b"");
    t.tick(false);
    assert!(t.core.recovering(&key(40000)));
    assert!(!t.accepted(id2));
    assert_eq!(t.outs.iter().filter(|o| matches!(o, Out::Failover { .. })).count(), 1, "one failover per connection");
    t.core.refused(t.now, key(40000));
    t.collect();
    assert!(t.accepted(id) && t.accepted(id2), "refused: to the kernel");
    t.take();
    let id3 = t.pkt(Dir::FromClient, 40000, C_ISN + 100, S_ISN + 5000, F::ACK, b"");
    assert!(t.accepted(id3), "a refused connection's packets pass at once");
}

/// After an agent restart: a connection a local socket serves is known again on its first
/// packet. Its record is read (the packet waits meanwhile); when the record does not describe
/// it (missing, a tombstone, stale) it is learned unprotected, its packets pass and never
/// wait at the gate again.
#[test]
fn restart_a_local_socket_connection_without_a_usable_record_is_learned_unprotected() {
    let mut t = T::restarted();
    let id = t.pkt(Dir::FromClient, 40001, C_ISN + 100, S_ISN + 5000, F::ACK, b"");
    t.tick(true);
    assert!(!t.accepted(id), "waits for its record");
    let r = t.relearns();
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].0, r[0].1), (key(40001), Some(B)));
    assert!(!t.outs.iter().any(|o| matches!(o, Out::Failover { .. })), "a live local socket is never rebuilt");
    t.take();
    let why = t.core.relearn_found(t.now, key(40001), Some(B), Ok(None), Ok(Some(Progress { bytes_acked: 4999, bytes_received: 99 })));
    assert_eq!(why, Err("no record".to_string()));
    t.collect();
    assert!(t.accepted(id), "passed once the record was found wanting");
    assert_eq!((t.core.counters.passed_local_socket, t.core.counters.relearn_failed), (1, 1));
    assert_eq!(t.core.engine.counters.learned, 1);
    t.take();
    for k in 0..20 {
        let id = t.pkt(Dir::FromClient, 40001, C_ISN + 100, S_ISN + 5000 + k, F::ACK, b"");
        assert!(t.accepted(id), "packet {k} waited");
        let id = t.pkt(Dir::ToClient, 40001, S_ISN + 5000 + k, C_ISN + 100, F::ACK, b"x");
        assert!(t.accepted(id));
        t.take();
    }
    assert_eq!((t.core.counters.passed_local_socket, t.core.counters.failovers_denied), (1, 0));
    assert!(t.relearns().is_empty());
}

/// After an agent restart: a connection a local socket serves whose record describes it is
/// protected again from that record (not left unprotected for a later fault to lose), and the
/// server packets that waited for its bucket leave once it is known.
#[test]
fn restart_a_local_socket_connection_is_protected_again_from_its_record() {
    let mut t = T::restarted();
    let hs = Handshake { iss: S_ISN, irs: C_ISN, client_mss: 1460, ..Handshake::default() };
    let header = b"HTTP/1.1 200 OK\r\nContent-Length: 10000\r\n\r\n".to_vec();
    let hl = header.len() as u32;
    let entry = Entry { req_off: 0, req_len: 50, resp_off: 0, status: 200, body_len: 10000, header, object_id: b"GET /x HTTP/1.1\r\n".to_vec(), ..Entry::default() };
    let rec = Record { hs, hold_off: 0, sent_off: 3000, entries: vec![entry], ..Record::default() };
    // The server's socket sends on; the client's ACK names the bucket.
    let s1 = t.pkt(Dir::ToClient, 40010, S_ISN + 1 + 4000, C_ISN + 51, F::ACK, &[7u8; 1000]);
    let c1 = t.pkt(Dir::FromClient, 40010, C_ISN + 51, S_ISN + 1 + 2500, F::ACK, b"");
    t.tick(true);
    assert!(!t.accepted(s1) && !t.accepted(c1), "both wait for the record");
    let r = t.relearns();
    assert_eq!(r.len(), 1);
    t.take();
    // The socket says the client acknowledged 2500 bytes and sent its 50-byte request.
    assert_eq!(t.core.relearn_found(t.now, key(40010), Some(B), Ok(Some(rec.clone())), Ok(Some(Progress { bytes_acked: 2500, bytes_received: 50 }))), Ok(()));
    t.collect();
    assert!(t.accepted(c1), "the waiting client packet passes");
    t.tick(true);
    assert!(t.accepted(s1), "the server packet leaves once the bucket is known");
    assert_eq!((t.core.engine.counters.relearned, t.core.engine.counters.learned, t.core.engine.protected()), (1, 0, 1));
    assert_eq!(t.core.counters.relearn_failed, 0);
    t.take();
    // The rest of the response passes; the connection's record moves on with its progress,
    // a full record (a later failover can plan from it), never a tombstone.
    let mut at = 5000u32;
    while at < 10000 + hl {
        let n = 1000.min(10000 + hl - at);
        let id = t.pkt(Dir::ToClient, 40010, S_ISN + 1 + at, C_ISN + 51, F::ACK, &vec![7u8; n as usize]);
        t.tick(true);
        assert!(t.accepted(id), "segment at {at}");
        at += n;
    }
    let stores: Vec<Record> = t.outs.iter().filter_map(|o| if let Out::Store(op) = o { Some(op) } else { None }).filter_map(|op| match &op.kind {
        unbroken_control::object::store::OpKind::Set { val, .. } => Record::decode(val).ok(),
        _ => None,
    }).collect();
    assert!(stores.iter().all(|r| !r.unprotected && r.entries.len() == 1), "{stores:?}");
}

/// The lease fence: while this server's lease has lapsed its server packets wait, in order,
/// and leave once the lease is renewed; after FENCE_MAX_MS they are dropped; a packet of a
/// bucket the view says is another server's is dropped at once; client packets are never
/// fenced.
#[test]
fn fence_holds_server_packets_while_the_lease_has_lapsed() {
    let mut t = T::new();
    t.connect(40002);
    t.lease_ok = false;
    let a = t.pkt(Dir::ToClient, 40002, S_ISN + 1, C_ISN + 1, F::ACK, b"");
    let b = t.pkt(Dir::ToClient, 40002, S_ISN + 1, C_ISN + 1, F::ACK, b"");
    let c = t.pkt(Dir::FromClient, 40002, C_ISN + 1, S_ISN + 1, F::ACK, b"");
    assert!(!t.accepted(a) && !t.accepted(b), "server packets wait");
    assert!(t.accepted(c), "client packets are not fenced");
    assert_eq!(t.core.counters.fenced_held, 2);
    t.take();
    t.now += 10;
    t.lease_ok = true;
    t.tick(false);
    let order: Vec<u32> = t.outs.iter().filter_map(|o| if let Out::Accept { id, .. } = o { Some(*id) } else { None }).collect();
    assert_eq!(order, vec![a, b], "released in order");
    t.take();
    // Lapsed for good: dropped after FENCE_MAX_MS.
    t.lease_ok = false;
    let d = t.pkt(Dir::ToClient, 40002, S_ISN + 1, C_ISN + 1, F::ACK, b"");
    t.now += FENCE_MAX_MS;
    t.tick(false);
    assert!(t.dropped(d));
    assert_eq!(t.core.counters.fenced_dropped, 1);
    t.take();
    // The bucket is another server's now: dropped at once, even under a valid lease.
    t.lease_ok = true;
    t.view = Some(view(3, &[], &[]));
    let e = t.pkt(Dir::ToClient, 40002, S_ISN + 1, C_ISN + 1, F::ACK, b"");
    assert!(t.dropped(e));
    // Without any reply yet (LB configured): server packets wait too.
    t.take();
    t.view = None;
    let f = t.pkt(Dir::ToClient, 40002, S_ISN + 1, C_ISN + 1, F::ACK, b"");
    assert!(!t.accepted(f) && !t.dropped(f));
}

/// The LB gave a live connection's bucket to another server (a revive, a false suspicion): at
/// the new epoch the connection is muted and a socket rebuilt for it is silenced.
#[test]
fn a_connection_whose_bucket_moved_away_is_muted_at_the_new_epoch() {
    let mut t = T::new();
    t.connect(40003);
    t.tick(false);
    assert!(!t.outs.iter().any(|o| matches!(o, Out::Silence { .. })));
    t.view = Some(view(2, &[], &[]));
    t.now += 1;
    t.tick(false);
    assert!(t.outs.iter().any(|o| matches!(o, Out::Silence { key: k } if *k == key(40003))));
    assert_eq!(t.core.counters.muted, 1);
    t.take();
    // Its server packets are dropped from now on (fence: bucket not owned).
    let id = t.pkt(Dir::ToClient, 40003, S_ISN + 1, C_ISN + 1, F::ACK, b"");
    assert!(t.dropped(id));
    t.now += 200;
    t.tick(false);
    assert_eq!(t.core.counters.muted, 1, "muted once");
}

/// Store requests carry the bucket in the key (probing lists a bucket's records by prefix).
#[test]
fn store_keys_carry_the_bucket() {
    let mut t = T::new();
    let syn = t.pkt(Dir::FromClient, 40004, C_ISN, 0, F::SYN, b"");
    assert!(t.accepted(syn));
    t.pkt(Dir::ToClient, 40004, S_ISN, C_ISN + 1, F::SYN | F::ACK, b"");
    t.tick(false);
    assert!(!t.outs.iter().any(|o| matches!(o, Out::Store(_))), "nothing is stored before the client acknowledges the SYN-ACK (issue 9 item 5)");
    t.pkt(Dir::FromClient, 40004, C_ISN + 1, S_ISN + 1, F::ACK, b"");
    t.tick(false);
    let keys: Vec<String> = t
        .outs
        .iter()
        .filter_map(|o| match o {
            Out::Store(op) => Some(String::from_utf8_lossy(op.kind.key()).into_owned()),
            _ => None,
        })
        .collect();
    assert_eq!(keys, vec![format!("b{B}/{}", key(40004).store_key())]);
}

/// A bucket that moved here is probed at once and again after PROBE_RETRY_MS (a lost probe, or
/// a client whose answer Linux rate-limits because another server probed it moments before,
/// must not leave a connection waiting for good); a retry skips connections already known
/// here and buckets that are no longer moved here.
#[test]
fn moved_buckets_are_probed_again_until_their_connections_show_up() {
    use unbroken_control::object::agentcore::PROBE_RETRY_MS;
    let mut t = T::new();
    t.connect(40005); // known here, in bucket B
    t.view = Some(view(2, &[B, 9], &[B, 9]));
    t.tick(false);
    let probes = |t: &mut T| -> Vec<(Vec<u16>, Vec<Key>)> {
        t.take().into_iter().filter_map(|o| if let Out::Probe { buckets, skip } = o { Some((buckets, skip)) } else { None }).collect()
    };
    let p = probes(&mut t);
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].0, vec![B, 9]);
    assert_eq!(p[0].1, vec![key(40005)], "the known connection is not probed");
    t.now += PROBE_RETRY_MS[0] - 1;
    t.tick(false);
    assert!(probes(&mut t).is_empty(), "not before the retry is due");
    t.now += 1;
    t.tick(false);
    assert_eq!(probes(&mut t).iter().map(|p| p.0.clone()).collect::<Vec<_>>(), vec![vec![B, 9]]);
    // Bucket 9 left the failover window (no longer allowed): later retries probe B only.
    t.view = Some(view(2, &[B, 9], &[B]));
    for &d in &PROBE_RETRY_MS[1..] {
        t.now = T0 + d;
        t.tick(false);
        assert_eq!(probes(&mut t).iter().map(|p| p.0.clone()).collect::<Vec<_>>(), vec![vec![B]]);
    }
    t.now += 10_000;
    t.tick(false);
    assert!(probes(&mut t).is_empty(), "as many retries as PROBE_RETRY_MS lists, no more");
}

/// A packet waiting at the gate whose bucket goes to another server meanwhile is dropped, not
/// given to the kernel: the kernel's RST would be a second server speaking on the connection
/// (found by the object-mode simulation, tests/object_sim.rs, `SIM_KIND=hb SIM_SEED=166`).
#[test]
fn gate_drops_a_waiting_packet_whose_bucket_moved_away() {
    let mut t = T::new();
    let id = t.pkt(Dir::FromClient, 40005, C_ISN + 100, S_ISN + 5000, F::ACK, b"");
    t.tick(false);
    t.view = Some(view(2, &[], &[]));
    t.now += GATE_WAIT_MS;
    t.tick(false);
    assert!(t.dropped(id) && !t.accepted(id), "to the kernel while another server owns the bucket");
    assert_eq!(t.core.counters.failovers_denied, 1);
    // Still owned: to the kernel, as before.
    t.view = Some(view(3, &[B], &[]));
    let id = t.pkt(Dir::FromClient, 40006, C_ISN + 100, S_ISN + 5000, F::ACK, b"");
    t.now += GATE_WAIT_MS;
    t.tick(false);
    assert!(t.accepted(id));
}

/// A client packet that waited for a failover and acknowledges bytes beyond the plan's resume
/// point (the client had them from another server, or out of order) is not given to the
/// rebuilt socket (whose kernel would discard it, its engine entry silenced): the connection
/// is rebuilt again from that ACK (found by the object-mode simulation, seed 15223, where it
/// hung).
#[test]
fn a_waiting_packet_acknowledging_beyond_the_plan_rebuilds_from_its_ack() {
    let mut t = T::new();
    t.view = Some(view(2, &[B], &[B]));
    let hs = Handshake { iss: S_ISN, irs: C_ISN, client_mss: 1460, ..Handshake::default() };
    let header = b"HTTP/1.1 200 OK\r\nContent-Length: 10000\r\n\r\n".to_vec();
    let entry = Entry { req_off: 0, req_len: 50, resp_off: 0, status: 200, body_len: 10000, header, object_id: b"GET /x HTTP/1.1\r\n".to_vec(), ..Entry::default() };
    let rec = Record { hs, hold_off: 0, sent_off: 5000, entries: vec![entry], ..Record::default() };
    let (seq, ack1, ack2) = (C_ISN + 51, S_ISN + 1 + 1000, S_ISN + 1 + 3000);
    let id1 = t.pkt(Dir::FromClient, 40007, seq, ack1, F::ACK, b"");
    t.tick(false);
    let trigger = t.outs.iter().find_map(|o| match o {
        Out::Failover { trigger, .. } => Some(trigger.clone()),
        _ => None,
    });
    let (_, trig) = Trigger::parse(&trigger.expect("a failover")).unwrap();
    let plan = plan_recovery(&rec, &trig).unwrap();
    t.take();
    let id2 = t.pkt(Dir::FromClient, 40007, seq, ack2, F::ACK, b"");
    assert!(!t.accepted(id2), "waits with the trigger");
    t.core.adopted(t.now, key(40007), Some(B), &rec, &plan);
    t.collect();
    assert!(t.accepted(id1), "the trigger goes through the rebuilt socket");
    assert!(!t.accepted(id2), "not to the rebuilt socket: it never sent what this acknowledges");
    assert!(t.outs.iter().any(|o| matches!(o, Out::Supersede { key: k } if *k == key(40007))));
    t.take();
    t.tick(false);
    let again: Vec<_> = t.outs.iter().filter_map(|o| match o {
        Out::Failover { key: k, trigger, .. } if *k == key(40007) => Trigger::parse(trigger).map(|(_, g)| g.ack),
        _ => None,
    }).collect();
    assert_eq!(again, vec![ack2], "rebuilt again from the later ACK");
}

/// After an agent restart the core does not know a connection's bucket until its client sends:
/// the kernel's packets of that connection wait for that packet (then pass under the lease and
/// owner checks), or are dropped after FENCE_MAX_MS; never sent under another bucket's lease
/// (found by the object-mode simulation, seeds 25 and 251).
#[test]
fn server_packets_of_a_connection_of_unknown_bucket_wait_for_its_client() {
    let mut t = T::restarted();
    let a = t.pkt(Dir::ToClient, 40008, S_ISN + 100, C_ISN + 1, F::ACK, b"data");
    assert!(!t.accepted(a) && !t.dropped(a), "it waits");
    // The client's packet names the bucket (B, owned here); the local socket owns it (no
    // usable record: learned unprotected).
    let c = t.pkt(Dir::FromClient, 40008, C_ISN + 1, S_ISN + 104, F::ACK, b"");
    t.tick(true);
    assert_eq!(t.relearns().len(), 1);
    t.core.relearn_failed(t.now, key(40008), Some(B), "no record");
    t.collect();
    assert!(t.accepted(c));
    t.tick(true);
    assert!(t.accepted(a), "released once the bucket is known");
    t.take();
    // Another connection's packet whose client never shows up: dropped after FENCE_MAX_MS.
    let d = t.pkt(Dir::ToClient, 40009, S_ISN + 100, C_ISN + 1, F::ACK, b"data");
    t.now += FENCE_MAX_MS;
    t.tick(false);
    assert!(t.dropped(d));
}

/// Just after a start, a connection the previous agent had rebuilt (listed for this one: its
/// socket died with it, silently) starts a failover from its record when its client sends,
/// in a bucket this server owns, instead of reaching the kernel (a RST); its bucket is probed
/// at the first view, since its client may have nothing to send. Any other unknown
/// connection of a bucket that did not move still waits at the gate and is denied (a bogus
/// ACK costs no store lookup), and so does an inherited one after the grace.
#[test]
fn restart_inherited_rebuilt_connections_are_failover_candidates_and_probed() {
    let mut t = T::restarted();
    t.core.inherit([(key(40011), Some(B)), (key(40013), Some(9))]);
    t.view = Some(view(1, &[B, 9, 12], &[]));
    t.tick(false);
    let probed: Vec<Vec<u16>> = t.take().into_iter().filter_map(|o| if let Out::Probe { buckets, .. } = o { Some(buckets) } else { None }).collect();
    assert_eq!(probed, vec![vec![B, 9, 12]], "every owned bucket probed at the first view");
    let id = t.pkt(Dir::FromClient, 40011, C_ISN + 100, S_ISN + 5000, F::ACK, b"");
    t.tick(false);
    assert!(t.outs.iter().any(|o| matches!(o, Out::Failover { key: k, .. } if *k == key(40011))), "a failover within the grace");
    assert!(!t.accepted(id));
    t.take();
    // Another unknown connection of the same bucket: the gate as ever.
    let other = t.pkt(Dir::FromClient, 40012, C_ISN + 100, S_ISN + 5000, F::ACK, b"");
    t.tick(false);
    assert!(!t.outs.iter().any(|o| matches!(o, Out::Failover { .. })), "not inherited: no failover");
    t.now += GATE_WAIT_MS;
    t.tick(false);
    assert!(t.accepted(other), "denied: to the kernel");
    assert_eq!(t.core.counters.failovers_denied, 1);
    // Retries of the first probe cover the buckets of inherited connections not known yet.
    t.take();
    t.now = 1000 + unbroken_control::object::agentcore::PROBE_RETRY_MS[0];
    t.tick(false);
    let retried: Vec<Vec<u16>> = t.take().into_iter().filter_map(|o| if let Out::Probe { buckets, .. } = o { Some(buckets) } else { None }).collect();
    assert_eq!(retried, vec![vec![B, 9]], "only the buckets of inherited connections not known yet (not 12)");
    // Past the grace an inherited connection is like any other.
    t.now = 1000 + RESTART_GRACE_MS;
    let late = t.pkt(Dir::FromClient, 40013, C_ISN + 100, S_ISN + 5000, F::ACK, b"");
    t.tick(false);
    assert!(!t.outs.iter().any(|o| matches!(o, Out::Failover { key: k, .. } if *k == key(40013))));
    t.now += GATE_WAIT_MS;
    t.tick(false);
    assert!(t.accepted(late));
}

/// Probes: one byte of data the client surely has (answered by Linux every time, unlike a
/// pure ACK out of the window, answered at most once per 500 ms), placed just before what the
/// record says the client acknowledged; a pure ACK at the SYN's sequence number when the
/// record cannot bound the client's receive point within 2^31 (a byte there could be new data
/// for the client after a wrap of a large object), or for a tombstone.
#[test]
fn probes_carry_an_old_byte_only_where_the_record_proves_it_old() {
    use unbroken_wire::ip::IpInfo;
    use unbroken_wire::tcp::Packet as Tcp;
    let hs = Handshake { iss: S_ISN, irs: C_ISN, client_mss: 1460, ..Handshake::default() };
    let probe = |rec: &Record| -> (u32, u32, usize) {
        let p = unbroken_control::object::agentcore::probe_packet(&key(40020), rec).unwrap();
        let info = IpInfo::parse(&p).unwrap();
        let t = Tcp::new_checked(&p[info.l4_offset..info.l4_offset + info.l4_len]).unwrap();
        assert!(t.verify_checksum(info.pseudo_sum(info.l4_len)));
        let r = Repr::parse(&t).unwrap();
        assert_eq!((r.src_port, r.dst_port, r.flags), (80, 40020, F::ACK));
        (r.seq.0, r.ack.0, info.l4_len - r.header_len())
    };
    let header = b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\n\r\n".to_vec();
    let entry = |resp_off: u64| Entry { req_off: 0, req_len: 50, resp_off, status: 200, body_len: 100_000_000, header: header.clone(), ..Entry::default() };
    // Acknowledged 5000 bytes: the byte at offset 4999, sequence number ISS + 1 + 4999.
    let r = Record { hs, hold_off: 50, sent_off: 9000, acked_off: 5000, entries: vec![entry(0)], ..Record::default() };
    assert_eq!(probe(&r), (S_ISN + 5000, C_ISN + 51, 1));
    // An older record (acked_off unknown): the start of its oldest response, here a second
    // response after a first one of 700 bytes, acknowledged in full.
    let r = Record { hs, hold_off: 50, sent_off: 9000, acked_off: 0, entries: vec![entry(700)], ..Record::default() };
    assert_eq!(probe(&r), (S_ISN + 700, C_ISN + 51, 1));
    // Nothing known acknowledged: the SYN's sequence number, with the byte.
    let r = Record { hs, sent_off: 9000, entries: vec![entry(0)], ..Record::default() };
    assert_eq!(probe(&r), (S_ISN, C_ISN + 1, 1));
    // No entries: sent_off is no proof (it counts held bytes): the SYN's number.
    let r = Record { hs, sent_off: 9000, ..Record::default() };
    assert_eq!(probe(&r).0, S_ISN);
    // 1.9 GiB sent, nothing known acknowledged: the receive point may be 2^31 past the SYN,
    // so no byte, a pure ACK at the SYN's sequence number.
    let r = Record { hs, sent_off: 19 << 27, entries: vec![entry(0)], ..Record::default() };
    assert_eq!(probe(&r), (S_ISN, C_ISN + 1, 0));
    // ... but with the client's acknowledgement close behind, the byte again (any wrap).
    let r = Record { hs, sent_off: 5 << 32, acked_off: (5 << 32) - 1000, entries: vec![entry(0)], ..Record::default() };
    assert_eq!(probe(&r), (S_ISN.wrapping_add(((5u64 << 32) - 1000) as u32), C_ISN + 1, 1));
    // A tombstone: the pure ACK.
    let r = Record { hs, sent_off: 9000, acked_off: 5000, unprotected: true, ..Record::default() };
    assert_eq!(probe(&r).2, 0);
}

/// A bucket handed back to this server after a stand-in served it (this agent was down past
/// the LB's deadline): the LB moves the bucket in its table before this server's view shows
/// it, so the client's packet can arrive while the view still names another owner. The local
/// socket is then a stale one (the stand-in sent on meanwhile): it must not be learned back
/// (the client would acknowledge bytes it never sent: a hang). The packet waits for the view,
/// which shows the bucket moved here, and the failover rebuilds the connection.
#[test]
fn restart_a_stale_local_socket_in_a_bucket_handed_back_is_rebuilt_not_learned() {
    let mut t = T::restarted();
    t.view = Some(view(1, &[], &[]));
    t.tick(true);
    t.take();
    let id = t.pkt(Dir::FromClient, 40020, C_ISN + 100, S_ISN + 5000, F::ACK, b"");
    t.tick(true);
    assert!(t.relearns().is_empty(), "learned back while the view names another owner: {:?}", t.outs);
    assert!(!t.accepted(id) && !t.dropped(id), "the packet waits for the view");
    t.now += GATE_WAIT_MS / 2;
    t.view = Some(view(2, &[B], &[B]));
    t.tick(true);
    assert!(t.relearns().is_empty(), "{:?}", t.outs);
    let fo = t.outs.iter().filter(|o| matches!(o, Out::Failover { key: k, bucket: Some(B), .. } if *k == key(40020))).count();
    assert_eq!(fo, 1, "the bucket moved here: rebuilt from its record: {:?}", t.outs);
    assert_eq!(t.core.counters.passed_local_socket, 0);
}

/// Just started, no view yet: a local socket's connection is learned back once the first view
/// says this server owns its bucket (and did not just get it).
#[test]
fn restart_a_local_socket_connection_waits_for_the_first_view() {
    let mut t = T::restarted();
    t.view = None;
    let id = t.pkt(Dir::FromClient, 40021, C_ISN + 100, S_ISN + 5000, F::ACK, b"");
    t.tick(true);
    assert!(t.relearns().is_empty() && !t.accepted(id), "{:?}", t.outs);
    t.now += 5;
    t.view = Some(view(1, &[B], &[]));
    t.tick(true);
    let r = t.relearns();
    assert_eq!(r.len(), 1, "{:?}", t.outs);
    assert_eq!((r[0].0, r[0].1), (key(40021), Some(B)));
    assert_eq!(t.core.counters.passed_local_socket, 1);
}

/// A connection muted when its bucket left (its local socket destroyed), whose bucket comes
/// back and whose failover is refused (no usable record): nobody serves it, and the kernel's
/// RST to the client's packet is its visible end. The muted entry used to drop that RST: the
/// client hung (object sim seeds 136, 5515).
#[test]
fn a_refused_failover_of_a_muted_connection_lets_the_kernels_reset_out() {
    let mut t = T::new();
    t.connect(40010);
    t.view = Some(view(2, &[], &[]));
    t.now += 1;
    t.tick(false);
    assert!(t.outs.iter().any(|o| matches!(o, Out::Silence { key: k } if *k == key(40010))));
    t.take();
    // The bucket comes back: the client's packet starts a failover (no local socket).
    t.view = Some(view(3, &[B], &[B]));
    t.now += 300;
    let id = t.pkt(Dir::FromClient, 40010, C_ISN + 1, S_ISN + 5000, F::ACK, b"");
    t.tick(false);
    assert!(t.outs.iter().any(|o| matches!(o, Out::Failover { key: k, .. } if *k == key(40010))));
    t.core.refused(t.now, key(40010));
    t.collect();
    assert!(t.accepted(id), "refused: the trigger goes to the kernel");
    t.take();
    let rst = t.pkt(Dir::ToClient, 40010, S_ISN + 5000, 0, F::RST, b"");
    assert!(t.accepted(rst), "the kernel's RST reaches the client");
}

/// A handshake in progress (the client's SYN seen, no SYN-ACK yet) when its bucket leaves is
/// muted like a connection: the local request socket is destroyed, and its late SYN-ACK never
/// leaves. When the bucket comes back, the client's packet (the handshake completed with the
/// new owner meanwhile) starts a failover instead of reaching the stale request socket, whose
/// ISN the client never saw (Linux would answer it with a RST; object sim seed 13544: a hang).
#[test]
fn a_pending_handshake_whose_bucket_leaves_is_muted_and_failed_over_when_it_returns() {
    let mut t = T::new();
    let syn = t.pkt(Dir::FromClient, 40011, C_ISN, 0, F::SYN, b"");
    assert!(t.accepted(syn));
    t.take();
    t.view = Some(view(2, &[], &[]));
    t.now += 1;
    t.tick(false);
    assert!(t.outs.iter().any(|o| matches!(o, Out::Silence { key: k } if *k == key(40011))), "the request socket is destroyed");
    t.take();
    let sa = t.pkt(Dir::ToClient, 40011, S_ISN, C_ISN + 1, F::SYN | F::ACK, b"");
    assert!(!t.accepted(sa), "the stale SYN-ACK never leaves");
    t.take();
    t.view = Some(view(3, &[B], &[B]));
    t.now += 300;
    let id = t.pkt(Dir::FromClient, 40011, C_ISN + 1, S_ISN + 777_000, F::ACK, b"");
    // sock_diag still lists a socket (the destroy raced the packet): the view moved the
    // bucket here, so this is a failover, not the local socket's packet.
    t.tick(true);
    assert!(t.outs.iter().any(|o| matches!(o, Out::Failover { key: k, .. } if *k == key(40011))), "{:?}", t.outs);
    assert!(!t.accepted(id));
}

/// Issue 9 item 6: a flood of bogus ACKs for connections nobody knows, in a bucket that did not
/// move (each one denied at the gate, each one a log line before), writes at most a handful of
/// lines per interval; the rest are counted, and the first line after says how many.
#[test]
fn hostile_flood_of_denied_packets_logs_a_bounded_number_of_lines() {
    use unbroken_control::ratelog::{BURST, INTERVAL_MS};
    let mut t = T::new();
    const N: u32 = 5000;
    for i in 0..N {
        t.pkt(Dir::FromClient, 10_000 + i as u16, C_ISN + i, S_ISN + i, F::ACK, b"");
    }
    t.now += GATE_WAIT_MS;
    t.tick(false);
    let logs = |t: &T| t.outs.iter().filter_map(|o| if let Out::Log(l) = o { Some(l.clone()) } else { None }).collect::<Vec<_>>();
    let lines = logs(&t);
    // Beyond the gate's cap (item 3) packets are dropped at once, counted, and not logged.
    let denied = t.core.counters.failovers_denied;
    assert_eq!(denied, GATE_MAX_PACKETS as u64, "every packet the gate held was denied and counted");
    assert_eq!(denied + t.core.counters.gate_full, N as u64, "every packet counted once");
    assert_eq!(lines.len(), BURST as usize, "{:?}...", &lines[..lines.len().min(3)]);
    assert_eq!(t.core.counters.log_suppressed, denied - BURST as u64);
    // The next interval's first line tells how many were suppressed.
    t.take();
    t.now += INTERVAL_MS;
    t.pkt(Dir::FromClient, 9_000, C_ISN, S_ISN, F::ACK, b"");
    t.now += GATE_WAIT_MS;
    t.tick(false);
    let lines = logs(&t);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains(&format!("({} more like it suppressed)", denied - BURST as u64)), "{}", lines[0]);
}

// ---- issue 9: hostile client packets (items 3, 4 and 5) -----------------------------------------

/// A record of a download in progress on `key(40010)`'s connection: a 100 kB response whose
/// first 60 kB were sent.
fn download_record() -> (Record, u32) {
    let hs = Handshake { iss: S_ISN, irs: C_ISN, client_mss: 1460, ..Handshake::default() };
    let header = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n".to_vec();
    let hl = header.len() as u32;
    let entry = Entry { req_off: 0, req_len: 50, resp_off: 0, status: 200, body_len: 100_000, header, object_id: b"GET /x HTTP/1.1\r\n".to_vec(), ..Entry::default() };
    (Record { hs, hold_off: 0, sent_off: 60_000, acked_off: 20_000, entries: vec![entry], ..Record::default() }, hl)
}

/// A client packet of `key(port)` from `src` (any address), bucket B.
fn pkt_from(t: &mut T, src: IpAddr, port: u16, seq: u32, ack: u32, bad_csum: bool) -> u32 {
    t.id += 1;
    let mut data = build(src, s_ip(), Repr { src_port: port, dst_port: 80, seq: Seq(seq), ack: Seq(ack), flags: F::ACK, window: 500, ..Default::default() }, b"");
    if bad_csum {
        data[20 + 16] ^= 0x5a;
    }
    let p = Pkt { id: t.id, data, dir: Dir::FromClient, bucket: Some(B), csum_not_ready: false };
    let (now, view, lease_ok) = (t.now, t.view.take(), t.lease_ok);
    {
        let v = view.as_ref().unwrap();
        t.core.packets(now, LbView::View { v, lease_ok, fresh: true }, [p]);
    }
    t.view = view;
    t.collect();
    t.id
}

fn failovers(t: &T) -> Vec<Key> {
    t.outs.iter().filter_map(|o| if let Out::Failover { key, .. } = o { Some(*key) } else { None }).collect()
}

/// Issue 9 item 4: a spoofed packet of a connection arrives first in a moved bucket (a valid
/// checksum, an acknowledgement the record does not describe), one with a wrong checksum
/// too; the genuine client's packet comes next. The plan comes from the genuine packet and
/// the record: the rebuilt socket resumes from the client's real position, byte-exact; the
/// forged packets are dropped, never handed to the kernel (whose RST would end the genuine
/// connection) and never the plan.
#[test]
fn hostile_forged_trigger_first_then_genuine_packet_resumes_from_the_right_offset() {
    let mut t = T::new();
    t.view = Some(view(2, &[B], &[B]));
    let (rec, hl) = download_record();
    let k = key(40010);
    let bad = pkt_from(&mut t, c_ip(), 40010, 0x1234_5678, 0x9abc_def0, true);
    t.tick(false);
    assert!(t.dropped(bad), "a wrong checksum proves nothing: dropped before any lookup");
    assert!(failovers(&t).is_empty());
    // Forged: in-window sequence number even, but acknowledging 2^31 past the record.
    let forged = pkt_from(&mut t, c_ip(), 40010, C_ISN + 51, S_ISN.wrapping_add(1 << 31), false);
    t.tick(false);
    assert_eq!(failovers(&t), vec![k], "the first packet only starts the lookup");
    let genuine_ack = S_ISN + 1 + 30_000;
    let genuine = pkt_from(&mut t, c_ip(), 40010, C_ISN + 51, genuine_ack, false);
    t.tick(false);
    assert!(!t.accepted(forged) && !t.accepted(genuine), "both wait for the record");
    t.take();
    assert_eq!(t.core.record(t.now, k, Some(B), Ok(Some(rec.clone()))), Ok(()));
    t.collect();
    assert!(t.dropped(forged), "the forged trigger is dropped");
    let rb: Vec<_> = t.outs.iter().filter_map(|o| if let Out::Rebuild { key, plan, trigger, .. } = o { Some((*key, plan.clone(), trigger.clone())) } else { None }).collect();
    assert_eq!(rb.len(), 1);
    let (key2, plan, trigger) = &rb[0];
    assert_eq!(*key2, k);
    assert_eq!(Trigger::parse(trigger).unwrap().1.ack, genuine_ack, "planned from the genuine packet");
    assert_eq!(plan.snd_nxt, genuine_ack);
    assert_eq!(plan.resume.len(), 1);
    assert_eq!(plan.resume[0].body_from, 30_000 - hl as u64, "resumed at the client's position");
    assert_eq!(t.core.counters.triggers_rejected, 2);
    // Rebuilt: the genuine packet goes through the engine.
    t.take();
    t.core.adopted(t.now, k, Some(B), &rec, plan);
    t.collect();
    assert!(t.accepted(genuine));
}

/// Only forged packets wait for a found record: nothing plans, the genuine client never
/// speaks: after PLAN_WAIT_MS the client is probed and a stale local socket destroyed, the
/// connection keeps waiting; after PLAN_KEEP_MS the failover is refused and the client asked
/// once more; nothing forged reached the kernel.
#[test]
fn hostile_forged_triggers_alone_never_plan_and_end_in_a_refusal() {
    let mut t = T::new();
    t.view = Some(view(2, &[B], &[B]));
    let (rec, _) = download_record();
    let k = key(40011);
    let forged = pkt_from(&mut t, c_ip(), 40011, C_ISN + 51, S_ISN.wrapping_add(1 << 31), false);
    t.tick(false);
    t.take();
    assert_eq!(t.core.record(t.now, k, Some(B), Ok(Some(rec))), Ok(()));
    t.collect();
    assert!(t.dropped(forged));
    t.now += PLAN_WAIT_MS;
    t.tick(false);
    assert!(t.outs.iter().any(|o| matches!(o, Out::Destroy { key } if *key == k)));
    assert_eq!(t.core.counters.plan_timeouts, 1);
    assert_eq!(elicits(&t), 1, "the client is asked for a packet that plans");
    assert!(t.core.recovering(&k), "the record exists: still waiting");
    t.now += PLAN_KEEP_MS - PLAN_WAIT_MS;
    t.tick(false);
    assert_eq!(t.core.counters.plan_refused, 1);
    assert!(!t.core.recovering(&k));
    assert!(!t.accepted(forged));
    // Object sim seed 16858: a client waiting for data sends nothing more; asked once again
    // at the refusal, its answer meets the refusal and goes to the kernel (its exact RST).
    assert_eq!(elicits(&t), 2, "probed once more at the refusal");
    let answer = pkt_from(&mut t, c_ip(), 40011, C_ISN + 51, S_ISN.wrapping_add(1), false);
    t.tick(false);
    assert!(t.accepted(answer), "the client's answer reaches the kernel");
}

/// Issue 9 item 3: a flood of bogus ACKs from 20,000 spoofed sources in a bucket that just
/// moved here. Lookups in flight never exceed the admission's cap, the gate holds at most
/// GATE_MAX_PACKETS, the lookups over the whole window stay within the bucket's budget, and
/// every refusal is counted. A genuine client of that bucket still fails over once the flood
/// is spent.
#[test]
fn hostile_bogus_ack_flood_in_a_failover_window_stays_bounded_and_genuine_failovers_complete() {
    let mut t = T::new();
    t.view = Some(view(2, &[B], &[B]));
    let cfg = AdmitConfig::default();
    let mut rng = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut lookups = 0usize;
    let start = t.now;
    for round in 0..60u64 {
        for _ in 0..400 {
            let r = next();
            let src = IpAddr::from([10, 66, (r >> 8) as u8, r as u8]);
            pkt_from(&mut t, src, 20000 + (r >> 16) as u16 % 10000, (r >> 20) as u32, (r >> 32) as u32, false);
        }
        t.tick(false);
        let keys = failovers(&t);
        lookups += keys.len();
        assert!(t.core.admission.in_flight() <= cfg.max_in_flight);
        t.take();
        // The store finds no record for any of them (each answered 20 ms later).
        for k in keys {
            let _ = t.core.record(t.now, k, Some(B), Ok(None));
        }
        t.collect();
        t.take();
        t.now += 20;
        let _ = round;
    }
    let c = t.core.counters;
    let secs = (t.now - start).div_ceil(1000);
    assert!(lookups as u64 <= cfg.per_bucket_burst + cfg.per_bucket_rate * secs, "{lookups} lookups: {c:?}");
    assert!(c.gate_full > 0 && c.admit_dropped > 0 && (c.admit_bucket_limited + c.admit_busy) > 0, "{c:?}");
    let (sources, buckets) = t.core.admission.tracked();
    assert!(sources <= cfg.max_sources && buckets <= 1);
    // The flood stops; the bucket's budget refills; a genuine client's packet fails over.
    t.now += 4000;
    t.tick(false);
    for k in failovers(&t) {
        let _ = t.core.record(t.now, k, Some(B), Ok(None));
    }
    t.take();
    assert_eq!(t.core.admission.in_flight(), 0);
    let (rec, _) = download_record();
    let g = pkt_from(&mut t, c_ip(), 40012, C_ISN + 51, S_ISN + 1 + 30_000, false);
    t.tick(false);
    assert_eq!(failovers(&t), vec![key(40012)], "{:?} in flight {} dropped {}", t.core.counters, t.core.admission.in_flight(), t.dropped(g));
    t.take();
    assert_eq!(t.core.record(t.now, key(40012), Some(B), Ok(Some(rec))), Ok(()));
    t.collect();
    assert!(t.outs.iter().any(|o| matches!(o, Out::Rebuild { key: k2, .. } if *k2 == key(40012))));
    assert!(!t.dropped(g));
}

/// One spoofed source is held to its own budget, and a second request for the same key
/// within the negative cache's life costs no lookup.
#[test]
fn hostile_one_source_is_rate_limited_and_refused_keys_are_remembered() {
    let mut t = T::new();
    t.view = Some(view(2, &[B], &[B]));
    let cfg = AdmitConfig::default();
    let src: IpAddr = "10.66.1.1".parse().unwrap();
    let mut lookups = 0;
    for i in 0..1000u32 {
        pkt_from(&mut t, src, 20000 + (i % 5000) as u16, i, i, false);
    }
    t.tick(false);
    for _ in 0..30 {
        let keys = failovers(&t);
        lookups += keys.len();
        t.take();
        for k in keys {
            let _ = t.core.record(t.now, k, Some(B), Ok(None));
        }
        t.collect();
        t.take();
        t.tick(false);
    }
    assert_eq!(lookups as u64, cfg.per_source_burst, "one source: its burst, no more (no time passed)");
    assert!(t.core.counters.admit_source_limited > 0);
    // A refused key's next packet passes at once (to the kernel), no lookup.
    let id = pkt_from(&mut t, src, 20000, 5, 5, false);
    assert!(t.accepted(id));
    assert!(failovers(&t).is_empty());
    assert!(t.core.counters.negative_hits >= 1);
}

/// Issue 9 item 5 through the core: a SYN flood (SYN and SYN-ACK for each of 3000 ports)
/// issues no store request; a genuine connection set up before stays protected.
#[test]
fn hostile_syn_flood_through_the_core_issues_no_store_request() {
    let mut t = T::new();
    // The genuine connection's handshake is stored once its client acknowledges the SYN-ACK
    // (`connect` answers that store).
    t.connect(40020);
    assert_eq!(t.core.counters.store_submitted, 1);
    for port in 1000..4000u16 {
        t.pkt(Dir::FromClient, port, port as u32 * 7919, 0, F::SYN, b"");
        t.pkt(Dir::ToClient, port, port as u32, port as u32 * 7919 + 1, F::SYN | F::ACK, b"");
    }
    t.tick(false);
    assert!(!t.outs.iter().any(|o| matches!(o, Out::Store(_))), "no store request for the flood");
    assert_eq!(t.core.engine.is_protected(&key(40020)), Some(true));
}

/// After an agent restart, a packet with a wrong checksum for a connection a local socket
/// serves relearns nothing (a forged one would otherwise leave the connection learned
/// unprotected when its record did not plan); the genuine packet then does.
#[test]
fn hostile_bad_checksum_packet_never_relearns_a_local_connection() {
    let mut t = T::restarted();
    let bad = pkt_from(&mut t, c_ip(), 40030, C_ISN + 51, S_ISN + 1 + 2500, true);
    t.tick(true);
    assert!(t.dropped(bad));
    // Its buffer comes back with the drop, for the queue to reuse (issue 9 item 6).
    assert!(t.outs.iter().any(|o| matches!(o, Out::Drop { id, data } if *id == bad && data.len() == 40)), "{:?}", t.outs);
    assert!(t.relearns().is_empty());
    let good = pkt_from(&mut t, c_ip(), 40030, C_ISN + 51, S_ISN + 1 + 2500, false);
    t.tick(true);
    assert!(!t.dropped(good));
    assert_eq!(t.relearns().len(), 1);
}

fn rebuilds(t: &T) -> Vec<(Key, Vec<u8>)> {
    t.outs.iter().filter_map(|o| if let Out::Rebuild { key, trigger, .. } = o { Some((*key, trigger.clone())) } else { None }).collect()
}

fn elicits(t: &T) -> usize {
    t.outs.iter().filter(|o| matches!(o, Out::Elicit(_))).count()
}

/// Issue 9, object review item 1: during a failover a blind attacker sends one SYN (right
/// checksum, any sequence number) on the address pair of a protected download whose bucket
/// just moved here. It is not filed as a handshake nor passed to the kernel (which would
/// answer the client's next ACK with a RST): it is a failover candidate; the record is found,
/// the SYN never plans and draws a challenge (a probe from the record); the client's genuine
/// ACK plans the rebuild, and nothing of the connection reaches the kernel. A SYN with a wrong
/// checksum is dropped before anything.
#[test]
fn hostile_blind_syn_before_the_failover_never_resets_the_download() {
    let mut t = T::new();
    t.view = Some(view(2, &[B], &[B]));
    let (rec, _) = download_record();
    let k = key(40040);
    t.id += 1;
    let mut bad = build(c_ip(), s_ip(), Repr { src_port: 40040, dst_port: 80, seq: Seq(0x0bad_5eed), flags: F::SYN, window: 500, ..Default::default() }, b"");
    bad[20 + 16] ^= 0x5a;
    let bad_id = t.id;
    {
        let v = t.view.take().unwrap();
        t.core.packets(t.now, LbView::View { v: &v, lease_ok: true, fresh: true }, [Pkt { id: bad_id, data: bad, dir: Dir::FromClient, bucket: Some(B), csum_not_ready: false }]);
        t.view = Some(v);
    }
    t.collect();
    assert!(t.dropped(bad_id), "a SYN with a wrong checksum proves nothing");
    let syn = t.pkt(Dir::FromClient, 40040, 0x0bad_5eed, 0, F::SYN, b"");
    assert!(!t.accepted(syn), "a SYN in a moved bucket for an unknown connection never goes straight to the kernel");
    t.tick(false);
    assert_eq!(failovers(&t), vec![k], "it is a failover candidate");
    t.take();
    assert_eq!(t.core.record(t.now, k, Some(B), Ok(Some(rec.clone()))), Ok(()));
    t.collect();
    assert!(t.dropped(syn), "the SYN never plans");
    assert_eq!(elicits(&t), 1, "a challenge: the record's probe");
    assert!(rebuilds(&t).is_empty());
    t.take();
    t.now += 10;
    // The client's genuine ACK (answering the probe, or its own retransmission).
    let genuine_ack = S_ISN + 1 + 30_000;
    let g = pkt_from(&mut t, c_ip(), 40040, C_ISN + 51, genuine_ack, false);
    let rb = rebuilds(&t);
    assert_eq!(rb.len(), 1, "{:?}", t.core.counters);
    assert_eq!(Trigger::parse(&rb[0].1).unwrap().1.ack, genuine_ack);
    assert!(!t.accepted(g), "the genuine ACK waits for the rebuild, never the kernel");
    assert_eq!(t.core.counters.syn_challenged, 1);
}

/// Issue 9, object review item 1: a blind SYN while the record is being looked up (a genuine
/// ACK started it) cancels nothing: the genuine packet still plans the rebuild.
#[test]
fn hostile_blind_syn_during_the_lookup_cancels_nothing() {
    let mut t = T::new();
    t.view = Some(view(2, &[B], &[B]));
    let (rec, _) = download_record();
    let k = key(40041);
    let genuine_ack = S_ISN + 1 + 30_000;
    let g = pkt_from(&mut t, c_ip(), 40041, C_ISN + 51, genuine_ack, false);
    t.tick(false);
    assert_eq!(failovers(&t), vec![k]);
    let syn = t.pkt(Dir::FromClient, 40041, 0x0bad_5eed, 0, F::SYN, b"");
    t.tick(false);
    assert!(!t.accepted(syn) && !t.dropped(g));
    t.take();
    assert_eq!(t.core.record(t.now, k, Some(B), Ok(Some(rec))), Ok(()));
    t.collect();
    let rb = rebuilds(&t);
    assert_eq!(rb.len(), 1, "the lookup went on: {:?}", t.core.counters);
    assert_eq!(Trigger::parse(&rb[0].1).unwrap().1.ack, genuine_ack);
    assert!(!t.dropped(g) && !t.accepted(g));
}

/// The other side of item 1: a client that really opens a new connection on an address pair
/// whose stale record is still in the store (in a bucket that just moved here). Its SYN draws
/// the record's probe; the client (in SYN-SENT) answers with a RST at the probe's exact
/// acknowledgement number, which clears the record's claim; its retransmitted SYN is then a
/// new connection, protected. A blind RST at another number clears nothing.
#[test]
fn a_new_connection_on_a_pair_with_a_stale_record_is_cleared_by_the_clients_rst() {
    let mut t = T::new();
    t.view = Some(view(2, &[B], &[B]));
    let (rec, _) = download_record();
    let k = key(40042);
    let syn = t.pkt(Dir::FromClient, 40042, 0x5000, 0, F::SYN, b"");
    t.tick(false);
    assert_eq!(failovers(&t), vec![k]);
    t.take();
    assert_eq!(t.core.record(t.now, k, Some(B), Ok(Some(rec.clone()))), Ok(()));
    t.collect();
    assert!(t.dropped(syn));
    assert_eq!(elicits(&t), 1);
    t.take();
    let blind = t.pkt(Dir::FromClient, 40042, 0x1234, 0, F::RST, b"");
    assert!(t.dropped(blind));
    assert!(t.core.recovering(&k), "a blind RST clears nothing");
    let exact = t.pkt(Dir::FromClient, 40042, rec.hs.irs.wrapping_add(1).wrapping_add(rec.hold_off as u32), 0, F::RST, b"");
    assert!(t.dropped(exact));
    assert!(!t.core.recovering(&k));
    assert_eq!(t.core.counters.records_cleared, 1);
    t.take();
    t.now += 1000;
    let syn2 = t.pkt(Dir::FromClient, 40042, 0x5000, 0, F::SYN, b"");
    assert!(t.accepted(syn2), "the retransmitted SYN is a new connection");
    let sa = t.pkt(Dir::ToClient, 40042, 0x9000, 0x5001, F::SYN | F::ACK, b"");
    assert!(t.accepted(sa));
    assert_eq!(t.core.engine.is_protected(&k), Some(true));
}

/// A new connection in a bucket that just moved here, its pair without a record: its SYN
/// costs one lookup, then passes through the engine (protected).
#[test]
fn a_syn_in_a_moved_bucket_without_a_record_is_a_new_protected_connection() {
    let mut t = T::new();
    t.view = Some(view(2, &[B], &[B]));
    let k = key(40043);
    let syn = t.pkt(Dir::FromClient, 40043, 0x5000, 0, F::SYN, b"");
    t.tick(false);
    assert_eq!(failovers(&t), vec![k]);
    assert_eq!(t.core.record(t.now, k, Some(B), Ok(None)), Ok(()), "a new connection, not a refused failover");
    t.collect();
    assert!(t.accepted(syn));
    assert_eq!(t.core.counters.syn_new_connections, 1);
    let sa = t.pkt(Dir::ToClient, 40043, 0x9000, 0x5001, F::SYN | F::ACK, b"");
    assert!(t.accepted(sa));
    assert_eq!(t.core.engine.is_protected(&k), Some(true));
}

/// Issue 9, object review item 2: a flood of ACKs spoofed from the victim client's own
/// address (random ports, no records) spends that address's admission budget. The victim's
/// connection has a record in the moved bucket (the agent listed it to probe it): its
/// failover is admitted outside the budgets, at once, while the flood goes on; the flood's
/// lookups stay within the source's budget.
#[test]
fn hostile_flood_spoofed_from_the_victims_address_never_blocks_its_failover() {
    let mut t = T::new();
    t.view = Some(view(2, &[B], &[B]));
    let cfg = AdmitConfig::default();
    let victim = key(40050);
    t.core.records_listed([(victim, B), (key(40051), B + 1)]);
    let (rec, _) = download_record();
    let mut lookups = 0u64;
    for round in 0..10u32 {
        for i in 0..200u32 {
            pkt_from(&mut t, c_ip(), 20000 + ((round * 200 + i) % 10000) as u16, i, i, false);
        }
        t.tick(false);
        let keys = failovers(&t);
        lookups += keys.len() as u64;
        t.take();
        for k in keys {
            let _ = t.core.record(t.now, k, Some(B), Ok(None));
        }
        t.collect();
        t.take();
        t.now += 5;
    }
    assert!(t.core.counters.admit_source_limited > 0, "the flood is over the source's budget: {:?}", t.core.counters);
    assert!(lookups <= cfg.per_source_burst + cfg.per_source_rate, "{lookups} lookups");
    // The victim's genuine packet, in the middle of the flood.
    for i in 0..50u32 {
        pkt_from(&mut t, c_ip(), 30000 + i as u16, i, i, false);
    }
    let g = pkt_from(&mut t, c_ip(), 40050, C_ISN + 51, S_ISN + 1 + 30_000, false);
    t.tick(false);
    assert!(failovers(&t).contains(&victim), "the victim's failover starts at once: {:?}", t.core.counters);
    assert_eq!(t.core.counters.admit_listed, 1);
    t.take();
    assert_eq!(t.core.record(t.now, victim, Some(B), Ok(Some(rec))), Ok(()));
    t.collect();
    assert_eq!(rebuilds(&t).len(), 1);
    assert!(!t.dropped(g) && !t.accepted(g));
}

/// Issue 9, object review item 3: a forged trigger starts the lookup, the record is found, the
/// forged packet does not plan, and the genuine client's retransmission comes only after
/// PLAN_WAIT_MS (its RTO backed off). It still plans the rebuild: the connection stayed
/// waiting against its record, never in the negative cache that handed the retransmission to
/// the kernel (RST).
#[test]
fn hostile_forged_trigger_then_a_late_genuine_retransmission_still_fails_over() {
    let mut t = T::new();
    t.view = Some(view(2, &[B], &[B]));
    let (rec, _) = download_record();
    let k = key(40060);
    let forged = pkt_from(&mut t, c_ip(), 40060, C_ISN + 51, S_ISN.wrapping_add(1 << 31), false);
    t.tick(false);
    assert_eq!(failovers(&t), vec![k]);
    t.take();
    assert_eq!(t.core.record(t.now, k, Some(B), Ok(Some(rec))), Ok(()));
    t.collect();
    assert!(t.dropped(forged));
    t.take();
    t.now += PLAN_WAIT_MS;
    t.tick(false);
    t.take();
    t.now += 2000;
    t.tick(false);
    let genuine_ack = S_ISN + 1 + 30_000;
    let g = pkt_from(&mut t, c_ip(), 40060, C_ISN + 51, genuine_ack, false);
    t.tick(false);
    assert!(!t.accepted(g), "never to the kernel: {:?}", t.core.counters);
    let rb = rebuilds(&t);
    assert_eq!(rb.len(), 1, "{:?}", t.core.counters);
    assert_eq!(Trigger::parse(&rb[0].1).unwrap().1.ack, genuine_ack);
}

/// A mass failover (issue 22 item 3): 300 connections of a bucket that just moved here are
/// listed (their records are in the store) and their clients' triggers arrive at once; the
/// store is slow, and those beyond the lookup slots wait past ADMIT_WAIT_MS. They keep their
/// place (a dropped trigger leaves its client to its retransmission timer: seconds, growing),
/// and every one is looked up, once each, as slots free. An unlisted trigger that finds no
/// slot is still dropped after ADMIT_WAIT_MS (a flood cannot use the listing), and a listed
/// one after LISTED_WAIT_MS.
#[test]
fn mass_failover_listed_triggers_wait_for_a_lookup_slot_instead_of_being_dropped() {
    let mut t = T::new();
    t.view = Some(view(2, &[B], &[B]));
    let cfg = AdmitConfig::default();
    let n = 300u16;
    t.core.records_listed((0..n).map(|i| (key(42000 + i), B)));
    for i in 0..n {
        pkt_from(&mut t, c_ip(), 42000 + i, C_ISN + 51, S_ISN.wrapping_add(1), false);
    }
    pkt_from(&mut t, c_ip(), 43000, C_ISN + 51, S_ISN.wrapping_add(1), false);
    t.view = Some(view(2, &[B], &[B]));
    t.tick(false);
    let first = failovers(&t);
    assert_eq!(first.len(), cfg.max_in_flight, "{:?}", t.core.counters);
    t.take();
    // No lookup answers for longer than ADMIT_WAIT_MS.
    t.now += ADMIT_WAIT_MS + 100;
    t.view = Some(view(2, &[B], &[B]));
    t.tick(false);
    assert!(failovers(&t).is_empty());
    t.take();
    assert_eq!(t.core.counters.admit_dropped, 1, "only the unlisted trigger is dropped: {:?}", t.core.counters);
    // The lookups answer (no record: refused, which frees the slot as a found one does).
    let mut looked: Vec<Key> = first;
    let mut pending = looked.clone();
    for _ in 0..20 {
        for k in pending.drain(..) {
            let _ = t.core.record(t.now, k, Some(B), Ok(None));
        }
        t.now += 5;
        t.view = Some(view(2, &[B], &[B]));
        t.tick(false);
        pending = failovers(&t);
        t.take();
        looked.extend(pending.iter().copied());
    }
    looked.sort_by_key(|k| k.client.port());
    let ports: Vec<u16> = looked.iter().map(|k| k.client.port()).collect();
    assert_eq!(ports, (42000..42000 + n).collect::<Vec<_>>(), "every listed key looked up once");
    assert_eq!(t.core.counters.admit_dropped, 1, "{:?}", t.core.counters);
    // A listed trigger waits no longer than LISTED_WAIT_MS for a slot.
    let mut t = T::new();
    t.view = Some(view(2, &[B], &[B]));
    t.core.records_listed((0..n).map(|i| (key(44000 + i), B)));
    for i in 0..n {
        pkt_from(&mut t, c_ip(), 44000 + i, C_ISN + 51, S_ISN.wrapping_add(1), false);
    }
    t.tick(false);
    t.take();
    t.now += LISTED_WAIT_MS;
    t.view = Some(view(2, &[B], &[B]));
    t.tick(false);
    assert_eq!(t.core.counters.admit_dropped, (n as usize - cfg.max_in_flight) as u64, "{:?}", t.core.counters);
}

/// Issue 9, object review item 5 (the plan-timeout line): forged triggers for 200 connections
/// whose records exist, none planning. The plan-timeout lines go through the core's rate
/// limiter: a bounded number is written, the rest counted.
#[test]
fn hostile_many_plan_timeouts_log_a_bounded_number_of_lines() {
    let mut t = T::new();
    t.view = Some(view(2, &[B], &[B]));
    let (rec, _) = download_record();
    t.core.records_listed((0..200u16).map(|i| (key(41000 + i), B)));
    for i in 0..200u16 {
        pkt_from(&mut t, c_ip(), 41000 + i, C_ISN + 51, S_ISN.wrapping_add(1 << 31), false);
        t.tick(false);
        for k in failovers(&t) {
            let _ = t.core.record(t.now, k, Some(B), Ok(Some(rec.clone())));
        }
        t.take();
    }
    t.now += PLAN_WAIT_MS;
    t.tick(false);
    assert_eq!(t.core.counters.plan_timeouts, 200);
    let lines = t.outs.iter().filter(|o| matches!(o, Out::Log(l) if l.contains("planned against its record"))).count();
    assert!(lines <= 20, "{lines} lines");
    assert!(t.core.counters.log_suppressed >= 180, "{:?}", t.core.counters);
}

/// A SYN flood on random ports in a bucket that just moved here (each SYN a failover
/// candidate): the gate holds at most GATE_MAX_PACKETS of them, the rest are dropped and
/// counted; lookups stay within the bucket's budget.
#[test]
fn hostile_syn_flood_in_a_moved_bucket_stays_bounded() {
    let mut t = T::new();
    t.view = Some(view(2, &[B], &[B]));
    let cfg = AdmitConfig::default();
    for i in 0..(GATE_MAX_PACKETS as u32 + 2000) {
        t.pkt(Dir::FromClient, 1000 + (i % 60000) as u16, i.wrapping_mul(7919), 0, F::SYN, b"");
    }
    assert!(t.core.counters.gate_full >= 2000, "{:?}", t.core.counters);
    t.tick(false);
    assert!(failovers(&t).len() as u64 <= cfg.per_bucket_burst);
}

/// The record of the download the relearn tests below find: a 50-byte request, a 10,000-byte
/// body of which 3,000 bytes were recorded as sent.
fn relearn_record() -> Record {
    let hs = Handshake { iss: S_ISN, irs: C_ISN, client_mss: 1460, ..Handshake::default() };
    let header = b"HTTP/1.1 200 OK\r\nContent-Length: 10000\r\n\r\n".to_vec();
    let entry = Entry { req_off: 0, req_len: 50, resp_off: 0, status: 200, body_len: 10000, header, object_id: b"GET /x HTTP/1.1\r\n".to_vec(), ..Entry::default() };
    Record { hs, hold_off: 0, sent_off: 3000, entries: vec![entry], ..Record::default() }
}

fn tombstones(t: &T) -> usize {
    t.outs
        .iter()
        .filter(|o| match o {
            Out::Store(op) => match &op.kind {
                unbroken_control::object::store::OpKind::Set { val, .. } => Record::decode(val).is_ok_and(|r| r.unprotected),
                _ => false,
            },
            _ => false,
        })
        .count()
}

/// Issue 9 item 4, the relearn path: after an agent restart, a blind attacker sends the first
/// packet of a connection a local socket serves: right checksum, numbers the record does not
/// explain (an ACK far past anything sent). It starts the relearn and waits with the genuine
/// packet that follows; the decision comes from the record and the socket's own progress
/// (`tcp_info`), which no packet can forge: the connection is protected again (no tombstone,
/// nothing learned unprotected), the genuine packet passes and the forged one teaches the
/// engine nothing. The old core planned from the forged packet and learned the connection
/// unprotected, its record a tombstone.
#[test]
fn hostile_forged_first_packet_after_a_restart_never_unprotects_a_local_connection() {
    let mut t = T::restarted();
    let forged = pkt_from(&mut t, c_ip(), 40040, C_ISN + 51 + 3_000_000, S_ISN + 1 + 9_000_000, false);
    let genuine = pkt_from(&mut t, c_ip(), 40040, C_ISN + 51, S_ISN + 1 + 2500, false);
    t.tick(true);
    assert!(!t.accepted(forged) && !t.accepted(genuine), "both wait for the decision");
    assert_eq!(t.relearns().len(), 1, "one relearn for the connection");
    t.take();
    let r = t.core.relearn_found(t.now, key(40040), Some(B), Ok(Some(relearn_record())), Ok(Some(Progress { bytes_acked: 2500, bytes_received: 50 })));
    assert_eq!(r, Ok(()));
    t.collect();
    assert!(t.accepted(genuine), "the genuine packet passes");
    // The forged one is judged by the engine like any packet of a protected connection: out
    // of the window, it teaches nothing (the kernel answers it with a duplicate ACK).
    assert_eq!(t.core.engine.counters.out_of_window, 1);
    assert!(t.accepted(forged));
    assert_eq!((t.core.engine.counters.relearned, t.core.engine.counters.learned, t.core.engine.protected()), (1, 0, 1));
    assert_eq!(t.core.counters.relearn_failed, 0);
    t.tick(true);
    assert_eq!(tombstones(&t), 0, "{:?}", t.outs);
}

/// The socket decides both ways: a record its progress shows stale (the client acknowledged
/// bytes past the recorded response, served while the agent was down) is learned unprotected
/// with a tombstone, even when the packet that started the relearn would have planned against
/// it; a socket gone meanwhile, or a record that aliases past 4 GiB, the same.
#[test]
fn relearn_is_decided_by_the_sockets_progress_not_by_the_packet() {
    let mut t = T::restarted();
    let p = pkt_from(&mut t, c_ip(), 40041, C_ISN + 51, S_ISN + 1 + 2500, false);
    t.tick(true);
    assert_eq!(t.relearns().len(), 1);
    t.take();
    let why = t.core.relearn_found(t.now, key(40041), Some(B), Ok(Some(relearn_record())), Ok(Some(Progress { bytes_acked: 12_000, bytes_received: 50 }))).unwrap_err();
    assert!(why.starts_with("plan: "), "{why}");
    t.collect();
    assert!(t.accepted(p), "passed, unprotected");
    assert_eq!((t.core.engine.counters.relearned, t.core.engine.counters.learned, t.core.counters.relearn_failed), (0, 1, 1));
    t.tick(true);
    assert_eq!(tombstones(&t), 1, "a failover elsewhere must refuse, not guess");

    let mut t = T::restarted();
    pkt_from(&mut t, c_ip(), 40042, C_ISN + 51, S_ISN + 1 + 2500, false);
    t.tick(true);
    let why = t.core.relearn_found(t.now, key(40042), Some(B), Ok(Some(relearn_record())), Ok(None)).unwrap_err();
    assert!(why.starts_with("socket: "), "{why}");
    let why = trods_plan_err(relearn_record(), (1u64 << 32) + 2500, 50);
    assert!(why.contains("aliases"), "{why}");
}

fn trods_plan_err(rec: Record, acked: u64, received: u64) -> String {
    unbroken_engines::trods::plan_relearn(&rec, acked, received).unwrap_err().0.to_string()
}

// ---- the fast path's hand-off (issue 22 item 3; crate::object::agentfast) ----------------------

mod fast {
    use super::*;
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    use unbroken_control::object::agentfast::FastMap;
    use unbroken_engines::trods::{FastKept, FastView};

    /// The kernel's map as the core sees it: each entry's kept fields and whether it is lent;
    /// a test moves the kept fields as the programs would on the packets they pass.
    #[derive(Default)]
    pub struct Kernel {
        pub entries: HashMap<Key, (FastKept, bool)>,
        pub takes: u32,
        pub refuse: bool,
        /// Every publish: (key, lent).
        pub published: Vec<(Key, bool)>,
    }

    pub struct Model(pub Arc<Mutex<Kernel>>);

    fn kept_of(v: &FastView) -> FastKept {
        FastKept { client_acked: v.client_acked, srv_next: v.srv_next, sent_next: v.sent_next, last_window: v.last_window, last_ts: v.last_ts, last_seen: v.last_seen }
    }

    impl FastMap for Model {
        fn take(&mut self, key: &Key) -> Option<FastKept> {
            let mut k = self.0.lock().unwrap();
            k.takes += 1;
            let e = k.entries.get_mut(key)?;
            e.1 = false;
            Some(e.0)
        }
        fn publish(&mut self, key: &Key, view: &FastView, _: Option<u16>, lend: bool) -> Result<bool, String> {
            use unbroken_drivers::fastpath::object::{passthrough, quiet};
            let mut k = self.0.lock().unwrap();
            if k.refuse {
                return Err("full".into());
            }
            let fast = lend && (quiet(view) || passthrough(view));
            k.entries.insert(*key, (kept_of(view), fast));
            k.published.push((*key, fast));
            Ok(fast)
        }
        fn remove(&mut self, key: &Key) {
            self.0.lock().unwrap().entries.remove(key);
        }
    }

    pub const BODY: u32 = 100_000;
    pub const REQ: &[u8] = b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n";

    pub fn header() -> Vec<u8> {
        format!("HTTP/1.1 200 OK\r\nContent-Length: {BODY}\r\nETag: \"v1\"\r\n\r\n").into_bytes()
    }

    /// A download on `port` through a core with the model map: the handshake, the request,
    /// the response's header and first 1000 body bytes, every store done, and the round's
    /// publish: the connection is lent to the kernel. Returns the header's length.
    pub fn lent_download(t: &mut T, kernel: &Arc<Mutex<Kernel>>, port: u16) -> u32 {
        t.connect(port);
        t.core.fast_publish(t.now);
        let rq = REQ.len() as u32;
        let r = t.pkt(Dir::FromClient, port, C_ISN + 1, S_ISN + 1, F::ACK | F::PSH, REQ);
        t.tick(false);
        t.store_ok();
        t.tick(false);
        assert!(t.accepted(r), "the request reaches the server");
        let h = header();
        let hl = h.len() as u32;
        let mut seg = h;
        seg.extend_from_slice(&[7u8; 1000]);
        let s = t.pkt(Dir::ToClient, port, S_ISN + 1, C_ISN + 1 + rq, F::ACK, &seg);
        t.tick(false);
        t.store_ok();
        t.tick(false);
        assert!(t.accepted(s), "the response's first segment leaves once stored");
        let a = t.pkt(Dir::FromClient, port, C_ISN + 1 + rq, S_ISN + 1 + hl + 1000, F::ACK, b"");
        t.tick(false);
        t.store_ok();
        t.tick(false);
        assert!(t.accepted(a));
        t.take();
        t.core.fast_publish(t.now);
        assert_eq!(kernel.lock().unwrap().entries.get(&key(port)).map(|e| e.1), Some(true), "a quiet download is lent: {:?}", t.core.engine.fast_view(&key(port)));
        hl
    }

    pub fn with_model() -> (T, Arc<Mutex<Kernel>>) {
        let mut t = T::new();
        let k = Arc::new(Mutex::new(Kernel::default()));
        t.core.enable_fast_path(Box::new(Model(k.clone())));
        (t, k)
    }
}

/// The hand-off both ways: a quiet download is lent to the kernel; what the programs kept as
/// they passed body segments and the client's ACKs is taken back and absorbed before the
/// engine decides the next packet the kernel leaves to it, which the engine then judges from
/// the kernel's figures (a segment continuing them, not a gap); published again after the round.
#[test]
fn fast_path_lends_a_quiet_download_and_absorbs_what_the_kernel_kept_before_deciding() {
    let (mut t, kernel) = fast::with_model();
    let port = 40100;
    let hl = fast::lent_download(&mut t, &kernel, port);
    let rq = fast::REQ.len() as u32;
    // The kernel passed 3000 more body bytes and the client's ACK of 2000 of them.
    {
        let mut k = kernel.lock().unwrap();
        let e = k.entries.get_mut(&key(port)).unwrap();
        e.0.srv_next += 3000;
        e.0.sent_next += 3000;
        e.0.client_acked += 2000;
        e.0.last_seen += 5;
    }
    let before = t.core.engine.fast_view(&key(port)).unwrap();
    let (takes, taken) = (kernel.lock().unwrap().takes, t.core.fast.counters.taken);
    t.now += 5;
    // The next body segment comes to the queue (a SACK option, say): the engine sees it
    // continue what the kernel passed, not a gap it would drop.
    let next = S_ISN + 1 + hl + 1000 + 3000;
    let s = t.pkt(Dir::ToClient, port, next, C_ISN + 1 + rq, F::ACK, &[7u8; 1000]);
    assert!(t.accepted(s), "continues the kernel's stream: {:?}", t.outs);
    let v = t.core.engine.fast_view(&key(port)).unwrap();
    assert_eq!((v.srv_next, v.sent_next, v.client_acked), (before.srv_next + 4000, before.sent_next + 4000, before.client_acked + 2000));
    assert_eq!(v.body_left, before.body_left - 4000);
    assert_eq!(kernel.lock().unwrap().takes, takes + 1);
    assert_eq!(kernel.lock().unwrap().entries[&key(port)].1, false, "taken: every packet goes slow until published");
    t.tick(false);
    t.core.fast_publish(t.now);
    assert_eq!(kernel.lock().unwrap().entries[&key(port)].1, true, "lent again after the round");
    assert_eq!((t.core.fast.counters.taken, t.core.fast.counters.absorb_refused, t.core.fast.counters.lent), (taken + 1, 0, 1));
    // Without the hand-off the engine would have dropped that segment as a gap.
    let (mut u, uk) = fast::with_model();
    fast::lent_download(&mut u, &uk, port);
    u.core.fast.counters = Default::default();
    let s = u.pkt(Dir::ToClient, port, next, C_ISN + 1 + rq, F::ACK, &[7u8; 1000]);
    assert!(u.dropped(s), "with nothing moved by the kernel, a gap");
}

/// Hostile: the kernel's entry holds figures the fast path cannot have produced (the client's
/// ACK going back, the server's stream past the body's end): the engine keeps its own, the
/// refusal is counted and said, the connection is unprotected (a tombstone: its packets pass
/// unparsed from then on, never judged against figures known to be stale, so no later segment
/// looks like a gap) and never lent again (every packet of it through the queue).
#[test]
fn hostile_kernel_state_the_engine_refuses_is_never_lent_again() {
    for (name, forge) in [
        ("client ACK going back", Box::new(|k: &mut unbroken_engines::trods::FastKept| k.client_acked -= 1) as Box<dyn Fn(&mut unbroken_engines::trods::FastKept)>),
        ("stream past the body", Box::new(|k: &mut unbroken_engines::trods::FastKept| {
            k.srv_next += 10 * fast::BODY as u64;
            k.sent_next += 10 * fast::BODY as u64;
        })),
    ] {
        let (mut t, kernel) = fast::with_model();
        let port = 40101;
        let hl = fast::lent_download(&mut t, &kernel, port);
        let rq = fast::REQ.len() as u32;
        forge(&mut kernel.lock().unwrap().entries.get_mut(&key(port)).unwrap().0);
        let before = t.core.engine.fast_view(&key(port)).unwrap();
        let s = t.pkt(Dir::ToClient, port, S_ISN + 1 + hl + 1000, C_ISN + 1 + rq, F::ACK, &[7u8; 1000]);
        assert!(t.accepted(s), "{name}: still decided by the engine");
        let v = t.core.engine.fast_view(&key(port)).unwrap();
        assert_eq!(v.client_acked, before.client_acked, "{name}: the engine's own figures");
        assert_eq!(t.core.engine.is_protected(&key(port)), Some(false), "{name}: unprotected");
        assert_eq!(t.core.engine.counters.unprotected_fast, 1, "{name}");
        assert!(t.outs.iter().any(|o| matches!(o, Out::Log(l) if l.contains("refused by the engine"))), "{name}: said");
        t.tick(false);
        assert!(t.outs.iter().any(|o| matches!(o, Out::Store(_))), "{name}: its tombstone is stored");
        t.store_ok();
        t.tick(false);
        // A later segment past a gap the kernel's figures would explain passes (unparsed).
        let far = t.pkt(Dir::ToClient, port, S_ISN + 1 + hl + 50_000, C_ISN + 1 + rq, F::ACK, &[7u8; 1000]);
        t.tick(false);
        assert!(t.accepted(far), "{name}: never dropped as a gap: {:?}", t.outs);
        assert_eq!(t.core.fast.counters.absorb_refused, 1, "{name}");
        for _ in 0..3 {
            t.tick(false);
            t.core.fast_publish(t.now);
            assert_eq!(kernel.lock().unwrap().entries[&key(port)].1, false, "{name}: never lent again");
        }
    }
}

/// The fence and the hand-off: while the lease has lapsed the core holds the server's packets
/// of the connection, and the connection is not lent (the kernel must not pass a later segment
/// past them); once they left, it is lent again.
#[test]
fn fast_path_never_lends_a_connection_whose_packets_the_core_holds() {
    let (mut t, kernel) = fast::with_model();
    let port = 40102;
    let hl = fast::lent_download(&mut t, &kernel, port);
    let rq = fast::REQ.len() as u32;
    t.lease_ok = false;
    let s = t.pkt(Dir::ToClient, port, S_ISN + 1 + hl + 1000, C_ISN + 1 + rq, F::ACK, &[7u8; 1000]);
    t.tick(false);
    assert!(!t.accepted(s), "fenced");
    t.core.fast_publish(t.now);
    assert_eq!(kernel.lock().unwrap().entries[&key(port)].1, false, "its packet waits in the core");
    t.lease_ok = true;
    t.tick(false);
    assert!(t.accepted(s), "the lease is back");
    t.core.fast_publish(t.now);
    assert_eq!(kernel.lock().unwrap().entries[&key(port)].1, true, "lent again");
}

/// A map that refuses an entry (full, an error) leaves the connection on the slow path,
/// counted and said; a connection the engine forgets (the client's RST) loses its entry; idle
/// expiry takes every lent connection back first (it reads the kernel's last_seen).
#[test]
fn fast_path_entries_follow_the_engine_and_a_refusing_map_leaves_connections_slow() {
    let (mut t, kernel) = fast::with_model();
    let hl = fast::lent_download(&mut t, &kernel, 40103);
    let rq = fast::REQ.len() as u32;
    // Expiry, every EXPIRE_EVERY_MS: the lent connection is taken first.
    let takes = kernel.lock().unwrap().takes;
    t.now += 1000;
    t.tick(false);
    assert_eq!(kernel.lock().unwrap().takes, takes + 1, "expire takes what it may act on");
    t.core.fast_publish(t.now);
    assert_eq!(kernel.lock().unwrap().entries[&key(40103)].1, true);
    // The client's RST: forgotten by the engine, removed from the kernel.
    let r = t.pkt(Dir::FromClient, 40103, C_ISN + 1 + rq, S_ISN + 1 + hl + 1000, F::RST, b"");
    assert!(t.accepted(r));
    t.core.fast_publish(t.now);
    assert!(!kernel.lock().unwrap().entries.contains_key(&key(40103)), "removed with the connection");
    assert_eq!(t.core.fast.counters.removed, 1);
    // A map that refuses (full, an error): the entry goes, the connection stays on the slow
    // path, counted and said.
    let (mut u, uk) = fast::with_model();
    let hl = fast::lent_download(&mut u, &uk, 40104);
    uk.lock().unwrap().refuse = true;
    let s = u.pkt(Dir::ToClient, 40104, S_ISN + 1 + hl + 1000, C_ISN + 1 + rq, F::ACK, &[7u8; 1000]);
    assert!(u.accepted(s));
    u.core.fast_publish(u.now);
    u.collect();
    assert!(!uk.lock().unwrap().entries.contains_key(&key(40104)), "no entry: every packet slow");
    assert_eq!((u.core.fast.counters.map_refused, u.core.fast.counters.lent), (1, 0));
    assert!(u.outs.iter().any(|o| matches!(o, Out::Log(l) if l.contains("stays on the slow path"))));
}
