//! The replica daemon's I/O-free core (`replica::core::Core`): when the peer counts as present,
//! what the side channel accepts (authenticated, fresh across restarts), beats, fencing and its
//! results, takeover announcements, staleness, what the operator is told. No queue, socket or
//! clock: two cores talk through a scripted link, or one core talks to a scripted peer.

use std::net::SocketAddr;

use unbroken_control::daemon::{Mode, Outbox};
use unbroken_control::replica::core::{Boot, Core, Request, Settings, State, ANNOUNCE_SCHEDULE_MS, PEER_WARN_MS};
use unbroken_engines::replica::{Config, DetectorConfig, Why};
use unbroken_wire::ctl::Key;
use unbroken_wire::replica::{hdr, Progress, Role, Session};

fn key() -> Key {
    Key::from_hex("00112233445566778899aabbccddeeff").unwrap()
}

fn other_key() -> Key {
    Key::from_hex("ffeeddccbbaa99887766554433221100").unwrap()
}

/// The backup's address as the primary's core sees it, and the primary's as the backup's.
fn peer() -> SocketAddr {
    "10.77.3.12:7790".parse().unwrap()
}

fn boot(id: u64) -> Boot {
    Boot { id, secret: [id as u8; 32] }
}

fn settings(role: Role) -> Settings {
    Settings { role, detector: DetectorConfig { interval_ms: 10, misses: 3 }, engine: Config::default(), finished_grace_ms: 1000 }
}

fn core_at(role: Role, id: u64, now: u64) -> Core {
    Core::new(settings(role), key(), peer(), boot(id), now)
}

fn core(role: Role) -> Core {
    core_at(role, 0xc0de, 0)
}

fn tick(c: &mut Core, now: u64) -> Vec<Request> {
    let mut out = Outbox::default();
    c.tick(now, &mut out);
    c.collect(&mut out);
    out.requests
}

fn drain(c: &mut Core) -> Vec<Request> {
    let mut out = Outbox::default();
    c.collect(&mut out);
    out.requests
}

fn fences(r: &[Request]) -> usize {
    r.iter().filter(|r| **r == Request::Fence).count()
}

fn sides(r: &[Request]) -> Vec<Vec<u8>> {
    r.iter().filter_map(|r| if let Request::Side(d) = r { Some(d.clone()) } else { None }).collect()
}

fn logs(r: &[Request]) -> Vec<String> {
    r.iter().filter_map(|r| if let Request::Log(l) = r { Some(l.clone()) } else { None }).collect()
}

fn fatal(r: &[Request]) -> bool {
    r.iter().any(|r| matches!(r, Request::Fatal(_)))
}

/// A scripted peer: a boot of its own, numbers its messages, takes the core's challenge from
/// what the core sends and echoes it.
struct Peer {
    role: Role,
    boot: u64,
    beat: u64,
    echo: (u64, u64),
}

impl Peer {
    fn new(role: Role, boot: u64) -> Peer {
        Peer { role, boot, beat: 0, echo: (0, 0) }
    }

    /// Takes the latest challenge from the core's datagrams.
    fn hear(&mut self, reqs: &[Request]) {
        for d in sides(reqs) {
            let (_, s) = Progress::parse_session(&d, &key()).unwrap();
            self.echo = (s.nonce_t, s.nonce);
        }
    }

    fn msg(&mut self, flags: u8) -> Vec<u8> {
        self.beat += 1;
        let s = Session { boot: self.boot, nonce_t: self.beat, nonce: 0x5eed ^ self.beat, echo_t: self.echo.0, echo: self.echo.1 };
        Progress { role: self.role, beat: self.beat, flags, records: vec![] }.emit_session(&s, &key()).unwrap()
    }

    /// Binds `c` to this peer at `now`: hears its challenge, answers.
    fn bind(&mut self, c: &mut Core, now: u64) {
        let r = tick(c, now);
        self.hear(&r);
        let m = self.msg(0);
        c.side(now, peer(), &m);
    }
}

/// Two cores over a side channel that can be cut, one direction or both.
struct Pair {
    p: Core,
    b: Core,
    p_to_b: bool,
    b_to_p: bool,
    /// Every datagram each sent (for replays).
    sent_by_p: Vec<Vec<u8>>,
    sent_by_b: Vec<Vec<u8>>,
    /// Requests other than Side, per core, with their time.
    p_req: Vec<(u64, Request)>,
    b_req: Vec<(u64, Request)>,
}

impl Pair {
    fn new() -> Pair {
        Pair { p: core_at(Role::Primary, 0xaaaa, 0), b: core_at(Role::Backup, 0xbbbb, 0), p_to_b: true, b_to_p: true, sent_by_p: vec![], sent_by_b: vec![], p_req: vec![], b_req: vec![] }
    }

    fn step(&mut self, now: u64) {
        for r in tick(&mut self.p, now) {
            match r {
                Request::Side(d) => {
                    if self.p_to_b {
                        self.b.side(now, peer(), &d);
                    }
                    self.sent_by_p.push(d);
                }
                r => self.p_req.push((now, r)),
            }
        }
        for r in tick(&mut self.b, now) {
            match r {
                Request::Side(d) => {
                    if self.b_to_p {
                        self.p.side(now, peer(), &d);
                    }
                    self.sent_by_b.push(d);
                }
                r => self.b_req.push((now, r)),
            }
        }
        for r in drain(&mut self.p) {
            self.p_req.push((now, r));
        }
        for r in drain(&mut self.b) {
            self.b_req.push((now, r));
        }
    }

    fn run(&mut self, from: u64, to: u64) {
        for now in from..to {
            self.step(now);
        }
    }

    fn fences_of(req: &[(u64, Request)], since: u64) -> usize {
        req.iter().filter(|(t, r)| *t >= since && *r == Request::Fence).count()
    }
}

fn flags_of(d: &[u8]) -> u8 {
    Progress::parse(d, &key()).unwrap().flags
}

#[test]
fn a_host_that_never_heard_its_peer_never_fences_it() {
    for role in [Role::Primary, Role::Backup] {
        let mut c = core(role);
        for now in (0..60_000).step_by(5) {
            let r = tick(&mut c, now);
            assert_eq!(fences(&r), 0, "{role:?} fenced a peer it never heard");
        }
        assert_eq!(c.state(), State::WaitingForPeer);
        assert!(c.counters.beats_sent >= 5000, "beats go out while waiting: {}", c.counters.beats_sent);
    }
}

#[test]
fn beats_are_authenticated_progress_of_this_hosts_role_with_rising_numbers_and_its_boot() {
    let mut c = core(Role::Backup);
    let mut beats = vec![];
    for now in [0, 10, 20, 30] {
        for d in sides(&tick(&mut c, now)) {
            let (p, s) = Progress::parse_session(&d, &key()).expect("authenticated");
            assert_eq!((p.role, s.boot), (Role::Backup, 0xc0de));
            assert_ne!(s.nonce_t, 0, "every message carries a challenge");
            beats.push(p.beat);
        }
    }
    assert_eq!(beats, vec![1, 2, 3, 4], "one beat per interval, numbered from 1 within the boot");
    let d = sides(&tick(&mut c, 40)).remove(0);
    assert!(Progress::parse(&d, &other_key()).is_err(), "a wrong key must not verify");
}

#[test]
fn two_cores_bind_each_other_within_two_beats() {
    let mut x = Pair::new();
    x.run(0, 25);
    assert_eq!((x.p.state(), x.b.state()), (State::Protecting, State::Protecting));
    assert_eq!((x.p.peer_boot(), x.b.peer_boot()), (Some(0xbbbb), Some(0xaaaa)));
    x.run(25, 5_000);
    assert_eq!(Pair::fences_of(&x.p_req, 0) + Pair::fences_of(&x.b_req, 0), 0);
    assert_eq!((x.p.counters.beats_unproven, x.b.counters.beats_unproven, x.b.counters.beats_stale), (0, 1, 0), "only the primary's first beat came before it had the backup's challenge");
}

#[test]
fn hostile_side_channel_accepts_only_the_peer_authenticated_fresh_and_of_the_other_role() {
    let mut c = core(Role::Backup);
    let mut pr = Peer::new(Role::Primary, 77);
    pr.hear(&tick(&mut c, 0));
    let stranger: SocketAddr = "10.77.3.99:7790".parse().unwrap();
    let m = pr.msg(0);
    c.side(1, stranger, &m);
    assert_eq!((c.counters.beats_foreign, c.state()), (1, State::WaitingForPeer));
    let wrong = Progress { role: Role::Primary, beat: 9, flags: 0, records: vec![] }.emit(&other_key()).unwrap();
    c.side(2, peer(), &wrong);
    assert_eq!((c.counters.beats_bad, c.state()), (1, State::WaitingForPeer));
    c.side(3, peer(), b"garbage");
    assert_eq!(c.counters.beats_bad, 2);
    // Authenticated but echoing no challenge of this process: not fresh.
    let unproven = Progress { role: Role::Primary, beat: 50, flags: 0, records: vec![] }.emit_session(&Session { boot: 99, nonce_t: 1, ..Session::default() }, &key()).unwrap();
    c.side(4, peer(), &unproven);
    assert_eq!((c.counters.beats_unproven, c.state()), (1, State::WaitingForPeer));
    let m = pr.msg(0);
    c.side(5, peer(), &m);
    assert_eq!((c.counters.beats_received, c.state()), (1, State::Protecting));
    // Every datagram has its own number: a replay of the newest is as stale as an older one.
    c.side(6, peer(), &m);
    assert_eq!((c.counters.beats_received, c.counters.beats_stale), (1, 1));
    assert_eq!(c.peer_heard_at, Some(5), "a replay does not count as the peer being alive");
    // Bound to boot 77: another boot's message, even authenticated and numbered higher, is not
    // the peer until it echoes a fresh challenge.
    c.side(7, peer(), &unproven);
    assert_eq!((c.counters.beats_unproven, c.peer_heard_at), (2, Some(5)));
    let m = pr.msg(0);
    c.side(8, peer(), &m);
    assert_eq!((c.counters.beats_received, c.peer_heard_at), (2, Some(8)));
}

#[test]
fn hostile_replayed_messages_do_not_keep_a_dead_primary_alive() {
    let mut c = core(Role::Backup);
    let mut pr = Peer::new(Role::Primary, 5);
    pr.bind(&mut c, 0);
    assert_eq!(c.state(), State::Protecting);
    // The newest datagram, replayed for ever.
    let old = pr.msg(0);
    c.side(0, peer(), &old);
    let mut fenced_at = None;
    for now in 1..200 {
        c.side(now, peer(), &old);
        if fences(&tick(&mut c, now)) > 0 {
            fenced_at = Some(now);
            break;
        }
    }
    assert_eq!(fenced_at, Some(31), "silence of 3 x 10 ms since the last fresh beat (at 0)");
}

/// Issue 20 item 8: one datagram captured from the live primary, replayed to a backup that
/// restarted, made it take the primary for present, fence it when the replays stopped and take
/// over with an empty table. A restarted backup has a new secret: the captured datagram's echo
/// proves nothing; likewise for a restarted primary.
#[test]
fn hostile_datagram_replayed_to_a_restarted_host_counts_for_nothing() {
    for restarted in [Role::Backup, Role::Primary] {
        let mut x = Pair::new();
        x.run(0, 1_000);
        assert_eq!(x.b.state(), State::Protecting);
        let captured = if restarted == Role::Backup { x.sent_by_p.clone() } else { x.sent_by_b.clone() };
        // The host restarts (a new process: another boot and secret) while its peer is dead;
        // an attacker replays everything it captured, again and again.
        let mut c = core_at(restarted, 0xfeed, 1_000);
        let mut fenced = 0;
        for (i, now) in (1_000..61_000).enumerate() {
            c.side(now, peer(), &captured[i % captured.len()]);
            fenced += fences(&tick(&mut c, now));
        }
        assert_eq!(fenced, 0, "{restarted:?} fenced a peer it only heard in replays");
        assert_eq!(c.state(), State::WaitingForPeer, "{restarted:?}: a replay is not the peer");
        assert_eq!(c.counters.beats_received, 0);
        assert_eq!(c.counters.beats_unproven, 60_000);
        assert_eq!(c.peer_problem(), Some("unproven"), "and the operator is told");
    }
}

#[test]
fn a_restarted_peer_is_bound_again_once_it_answers_and_its_earlier_run_stays_out() {
    let mut x = Pair::new();
    x.run(0, 500);
    let old_backup = x.sent_by_b.clone();
    // The backup's daemon restarts; the primary keeps running.
    x.b = core_at(Role::Backup, 0xbbb2, 500);
    x.run(500, 530);
    assert_eq!(x.p.peer_boot(), Some(0xbbb2));
    assert_eq!(x.p.counters.peer_restarts, 1);
    assert!(x.p_req.iter().any(|(_, r)| matches!(r, Request::Log(l) if l.contains("the backup restarted"))));
    // Its daemon lost every connection's state: it can no longer take any over, and says so
    // (stale for good) instead of looking like a spare.
    assert_eq!(x.p.state(), State::PeerStale);
    assert_eq!(x.b.state(), State::Stale);
    // The earlier run's datagrams, replayed: unproven (their echoes are older than the new
    // boot's), the binding stays.
    let before = x.p.counters.beats_received;
    for d in &old_backup {
        x.p.side(540, peer(), d);
    }
    assert_eq!((x.p.counters.beats_received, x.p.peer_boot()), (before, Some(0xbbb2)));
    assert_eq!(Pair::fences_of(&x.p_req, 0), 0);
}

/// Issue 20 item 8: reflecting a host's own datagram at it stopped its daemon (taken for a
/// second primary). Its own boot's datagrams are counted and ignored; an earlier run's
/// (another boot, but no fresh echo of this process's challenge) likewise.
#[test]
fn hostile_reflected_own_datagram_is_counted_and_never_stops_the_daemon() {
    let mut earlier = core_at(Role::Primary, 0x01d, 0);
    let old: Vec<Vec<u8>> = (0..50).flat_map(|t| sides(&tick(&mut earlier, t * 10))).collect();
    let mut c = core_at(Role::Primary, 0x2e2, 1_000);
    for now in 1_000..3_000 {
        for d in sides(&tick(&mut c, now)) {
            c.side(now, peer(), &d);
        }
        c.side(now, peer(), &old[(now as usize) % old.len()]);
        assert!(!fatal(&drain(&mut c)), "a reflection stopped the daemon at {now}");
    }
    assert_eq!(c.state(), State::WaitingForPeer);
    assert_eq!(c.counters.beats_reflected, 200);
    assert_eq!(c.counters.beats_foreign, 2_000);
}

/// Both hosts given the same role: a live host of that role answers this process's challenge;
/// its message stops the daemon with a precise error before the peer was heard.
#[test]
fn a_peer_configured_with_the_same_role_stops_the_daemon() {
    let mut c = core(Role::Primary);
    let mut other = Peer::new(Role::Primary, 0x5a5a);
    let first = other.msg(0);
    c.side(0, peer(), &first);
    assert!(!fatal(&drain(&mut c)), "no proof yet: it could be a reflection of an earlier run");
    other.bind(&mut c, 1);
    let r = drain(&mut c);
    let f: Vec<&Request> = r.iter().filter(|r| matches!(r, Request::Fatal(_))).collect();
    assert_eq!(f.len(), 1);
    assert!(matches!(f[0], Request::Fatal(m) if m.contains("also runs as the primary")));
    assert_eq!(c.state(), State::WaitingForPeer);
}

/// The two hosts disagree on `strict` (a relaxed backup digests nothing, so a strict primary
/// would find every connection diverged; a strict backup's relaxed primary would not wait for
/// it): a fresh message of the other setting stops the daemon with a precise error before the
/// peer was heard (a replay cannot: it proves nothing); after the pair formed, a peer that
/// restarted with the other setting is a restart (its connections unprotected, or this backup
/// stale), said, and otherwise counts for nothing. Messages say this host's setting.
#[test]
fn a_peer_configured_with_the_other_strict_setting_stops_the_daemon() {
    for peer_relaxed in [true, false] {
        let mut s = settings(Role::Primary);
        s.engine.strict = peer_relaxed;
        let mut c = Core::new(s, key(), peer(), boot(0xc0de), 0);
        let sent = tick(&mut c, 0);
        assert!(!sides(&sent).is_empty(), "a beat at the start");
        assert!(sides(&sent).iter().all(|d| (Progress::parse_session(d, &key()).unwrap().0.flags & hdr::RELAXED == 0) == peer_relaxed), "this host's own setting in its messages");
        let mut b = Peer::new(Role::Backup, 0x5a5a);
        let flags = if peer_relaxed { hdr::RELAXED } else { 0 };
        let first = b.msg(flags);
        c.side(1, peer(), &first);
        assert!(!fatal(&drain(&mut c)), "no proof yet: a replay of an earlier run");
        let r = tick(&mut c, 20);
        b.hear(&r);
        let m = b.msg(flags);
        c.side(21, peer(), &m);
        let r = drain(&mut c);
        let f: Vec<&Request> = r.iter().filter(|r| matches!(r, Request::Fatal(_))).collect();
        assert_eq!(f.len(), 1, "peer relaxed {peer_relaxed}: {r:?}");
        assert!(matches!(f[0], Request::Fatal(m) if m.contains(&format!("strict = {}, this host with strict = {}", !peer_relaxed, peer_relaxed))), "{f:?}");
        assert_eq!((c.state(), c.counters.beats_received), (State::WaitingForPeer, 0));
        assert_eq!(c.counters.beats_mismatched, 1, "the fresh one; the replay was unproven");
    }
    // Paired, then the peer restarts with the other setting: the restart's steps (a primary
    // runs the backup's connections unprotected; a backup is stale and never fences), said,
    // its messages count for nothing else, and this host's echo lets it prove this one.
    for role in [Role::Primary, Role::Backup] {
        let other = if role == Role::Primary { Role::Backup } else { Role::Primary };
        let mut c = core(role);
        let mut p1 = Peer::new(other, 1);
        p1.bind(&mut c, 1);
        assert_eq!(c.state(), State::Protecting);
        let mut p2 = Peer::new(other, 2);
        // (Its first message proves nothing yet: it has not heard this host.)
        let early = p2.msg(hdr::RELAXED);
        c.side(10, peer(), &early);
        let r = tick(&mut c, 20);
        p2.hear(&r);
        let m = p2.msg(hdr::RELAXED);
        c.side(21, peer(), &m);
        let r = drain(&mut c);
        assert!(!fatal(&r), "{role:?}");
        assert!(logs(&r).iter().any(|l| l.contains("set the same `strict` in both configs")), "{role:?}: {r:?}");
        assert_eq!((c.counters.peer_restarts, c.counters.beats_received, c.counters.beats_mismatched), (1, 1, 1), "{role:?}");
        let want = if role == Role::Primary { State::PeerStale } else { State::Stale };
        assert_eq!(c.state(), want, "{role:?}");
        // Its next message echoes the restarted host's challenge (so that host can stop too).
        let r40 = tick(&mut c, 40);
        let d = sides(&r40);
        assert!(!d.is_empty());
        assert_eq!(p2.beat, 2);
        assert!(d.iter().all(|d| Progress::parse_session(d, &key()).unwrap().1.echo_t == 2), "{role:?}");
        // Nothing more from it counts: silence, then (a backup: stale, never) a fence.
        let fenced: usize = fences(&r40) + (41..400).map(|t| fences(&tick(&mut c, t))).sum::<usize>();
        assert_eq!(fenced, usize::from(role == Role::Primary), "{role:?}: the primary fences a backup it no longer hears; a stale backup never fences");
    }
}

#[test]
fn backup_takes_over_only_after_a_successful_fence_and_retries_a_failed_one() {
    let mut c = core(Role::Backup);
    let mut pr = Peer::new(Role::Primary, 1);
    pr.bind(&mut c, 100);
    for now in 101..=130 {
        assert_eq!(fences(&tick(&mut c, now)), 0, "suspected too early at {now}");
    }
    assert_eq!(fences(&tick(&mut c, 131)), 1);
    assert_eq!(c.state(), State::Fencing);
    // Nothing else is asked while the fence runs.
    for now in 132..400 {
        assert_eq!(fences(&tick(&mut c, now)), 0);
    }
    c.fence_done(false, 400);
    assert_eq!((c.state(), c.counters.fences_failed), (State::Protecting, 1));
    assert!(!drain(&mut c).contains(&Request::Announce), "a failed fence never takes over");
    // Retried after another silence, and not before the backoff (100 ms, then 200 ms).
    let again = (401..1000).find(|&t| fences(&tick(&mut c, t)) > 0);
    assert_eq!(again, Some(500));
    c.fence_done(false, 510);
    let third = (511..2000).find(|&t| fences(&tick(&mut c, t)) > 0);
    assert_eq!(third, Some(710));
    assert_eq!(c.counters.fences_failed, 2);
    c.fence_done(true, 720);
    assert_eq!(c.state(), State::TookOver);
    assert_eq!(c.takeover_ms, Some(620), "from the primary's last message (at 100)");
    assert!(drain(&mut c).contains(&Request::Announce));
}

#[test]
fn primary_runs_unprotected_once_the_backup_is_fenced_and_says_so_in_its_beats() {
    let mut c = core(Role::Primary);
    Peer::new(Role::Backup, 1).bind(&mut c, 0);
    assert_eq!(c.state(), State::Protecting);
    let at = (1..100).find(|&t| fences(&tick(&mut c, t)) > 0);
    assert_eq!(at, Some(31));
    c.fence_done(true, 35);
    assert_eq!((c.state(), c.stale_why()), (State::PeerFailed, Some("backup_failed")));
    assert!(!drain(&mut c).contains(&Request::Announce), "only a backup announces");
    // It keeps beating, flagged STALE: a backup that comes back must not take over.
    let beats: Vec<Vec<u8>> = (36..1_000).flat_map(|t| sides(&tick(&mut c, t))).collect();
    assert!(beats.len() >= 90, "{}", beats.len());
    assert!(beats.iter().all(|d| flags_of(d) == hdr::STALE));
}

#[test]
fn a_primary_waiting_for_its_backup_passes_traffic_untouched_and_counts_it() {
    use unbroken_control::daemon::Meta;
    let mut c = core(Role::Primary);
    let rep = unbroken_wire::tcp::Repr { src_port: 40000, dst_port: 6379, seq: unbroken_wire::Seq(1), flags: unbroken_wire::tcp::flags::SYN, window: 65535, ..Default::default() };
    let mut pkt = unbroken_wire::ip::tcp_packet("10.77.3.2".parse().unwrap(), "10.77.3.10".parse().unwrap(), &rep, &[]).unwrap();
    let len = pkt.len();
    pkt.resize(len + 64, 0);
    let mut out = Outbox::default();
    let (v, n) = c.packet(0, Meta { hook: 0, ..Meta::default() }, &mut pkt, len, &mut out);
    assert_eq!((v, n), (unbroken_engines::Verdict::PASS, len));
    assert_eq!(c.counters.passed_unprotected, 1);
    assert_eq!(c.connections(), 0, "a connection opened before the backup came is not followed");
}

/// Issue 20 item 11: the side channel cut both ways, both suspect; the backup's fence wins, the
/// primary's is refused (an arbitrating fence: its own port is down). The link comes back: the
/// primary hears that the backup took over before its retry and yields for good, never
/// fencing the winner; the winner fences the loser again once (it was heard, active), then not
/// again (its beats say passive).
#[test]
fn hostile_fenced_primary_that_comes_back_yields_instead_of_cutting_the_winner() {
    let mut x = Pair::new();
    x.run(0, 500);
    x.p_to_b = false;
    x.b_to_p = false;
    let mut now = 500;
    while Pair::fences_of(&x.p_req, 500) == 0 || Pair::fences_of(&x.b_req, 500) == 0 {
        x.step(now);
        now += 1;
    }
    x.b.fence_done(true, now);
    x.p.fence_done(false, now);
    assert_eq!((x.b.state(), x.p.state()), (State::TookOver, State::Protecting));
    // The primary's retry waits for its backoff (100 ms) after the next silence: the link
    // returns within it.
    x.run(now, now + 50);
    // The primary's datagrams get through first: the winner hears an active loser.
    x.p_to_b = true;
    let back = now + 50;
    x.run(back, back + 20);
    x.b_to_p = true;
    x.run(back + 20, back + 10_000);
    assert_eq!(x.p.state(), State::Yielded, "the loser yields once it hears the winner");
    assert_eq!(Pair::fences_of(&x.p_req, back), 0, "the loser never fences the winner");
    assert!(x.p_req.iter().any(|(_, r)| matches!(r, Request::Log(l) if l.contains("says it took over"))));
    assert_eq!(Pair::fences_of(&x.b_req, back), 1, "the winner fences the active loser it hears again, once");
    x.b.fence_done(true, back + 10_000);
    x.run(back + 10_000, back + 20_000);
    assert_eq!(Pair::fences_of(&x.b_req, back), 1, "a passive loser is not fenced again");
    assert_eq!(x.b.state(), State::TookOver);
    assert!(x.sent_by_p.iter().rev().take(100).all(|d| flags_of(d) == hdr::PASSIVE));
}

/// Issue 20 item 11: the winner keeps beating (flagged TOOK_OVER) and never fences a peer
/// that stayed silent since its fence.
#[test]
fn winner_keeps_beating_and_does_not_fence_a_silent_peer_again() {
    let mut c = core(Role::Backup);
    Peer::new(Role::Primary, 1).bind(&mut c, 0);
    let at = (1..100).find(|&t| fences(&tick(&mut c, t)) > 0).unwrap();
    c.fence_done(true, at + 5);
    let mut beats = 0;
    for now in at + 5..at + 60_000 {
        let r = tick(&mut c, now);
        assert_eq!(fences(&r), 0, "a silent fenced primary fenced again at {now}");
        for d in sides(&r) {
            assert_eq!(flags_of(&d), hdr::TOOK_OVER);
            beats += 1;
        }
    }
    assert!(beats >= 5_900, "{beats}");
}

/// Issue 20 item 11: a fenced peer heard again (its fence did not hold) is fenced again, with
/// the backoff, not at every beat.
#[test]
fn hostile_fenced_peer_heard_again_is_fenced_again_with_backoff() {
    let mut c = core(Role::Primary);
    let mut b = Peer::new(Role::Backup, 1);
    b.bind(&mut c, 0);
    let at = (1..100).find(|&t| fences(&tick(&mut c, t)) > 0).unwrap();
    c.fence_done(true, at);
    assert_eq!(c.state(), State::PeerFailed);
    let mut asked = vec![];
    for now in at..at + 1_000 {
        let r = tick(&mut c, now);
        b.hear(&r);
        let m = b.msg(0);
        c.side(now, peer(), &m);
        if fences(&drain(&mut c)) > 0 {
            asked.push(now);
            c.fence_done(true, now + 1);
        }
    }
    assert_eq!(asked.len(), 4, "at once, then after 100, 200, 400 ms: {asked:?}");
    assert_eq!(c.counters.refences, 4);
}

/// Issue 20 item 6: after the takeover the address is announced at once and again on the
/// schedule (a link that still dropped at the takeover gets a later one); a late tick does not
/// burst.
#[test]
fn takeover_announces_again_and_again_on_the_schedule() {
    let mut c = core(Role::Backup);
    Peer::new(Role::Primary, 1).bind(&mut c, 0);
    let at = (1..100).find(|&t| fences(&tick(&mut c, t)) > 0).unwrap();
    c.fence_done(true, at);
    let mut times: Vec<u64> = drain(&mut c).iter().filter(|r| **r == Request::Announce).map(|_| 0).collect();
    for now in at..at + 120_000 {
        for r in tick(&mut c, now) {
            if r == Request::Announce {
                times.push(now - at);
            }
        }
    }
    assert_eq!(times, ANNOUNCE_SCHEDULE_MS.to_vec());
    assert_eq!(c.counters.announces, ANNOUNCE_SCHEDULE_MS.len() as u64);
    // Ticks 3 s apart (a wedged loop): one announcement per tick at most.
    let mut c = core(Role::Backup);
    Peer::new(Role::Primary, 1).bind(&mut c, 0);
    let at = (1..100).find(|&t| fences(&tick(&mut c, t)) > 0).unwrap();
    c.fence_done(true, at);
    drain(&mut c);
    let per_tick: Vec<usize> = (1..40).map(|i| tick(&mut c, at + i * 3_000).iter().filter(|r| **r == Request::Announce).count()).collect();
    assert!(per_tick.iter().all(|&n| n <= 1), "{per_tick:?}");
    assert_eq!(per_tick.iter().sum::<usize>(), 8, "{per_tick:?}");
}

/// Issue 20 items 5 and 11: a backup told STALE never fences and never takes over, even when
/// the primary dies later (it says so); its beats say passive.
#[test]
fn hostile_stale_backup_never_fences_nor_takes_over() {
    let mut c = core(Role::Backup);
    let mut pr = Peer::new(Role::Primary, 1);
    pr.bind(&mut c, 0);
    let r = tick(&mut c, 1);
    pr.hear(&r);
    let m = pr.msg(hdr::STALE);
    c.side(2, peer(), &m);
    assert_eq!((c.state(), c.stale_why()), (State::Stale, Some("primary_says_stale")));
    let said: Vec<String> = logs(&drain(&mut c));
    assert!(said.iter().any(|l| l.contains("stale for good")), "{said:?}");
    // The primary dies.
    let mut all = vec![];
    for now in 3..60_000 {
        all.extend(tick(&mut c, now));
    }
    assert_eq!(fences(&all), 0);
    assert!(!all.contains(&Request::Announce));
    assert_eq!(c.state(), State::Stale);
    assert!(logs(&all).iter().any(|l| l.contains("stale: it neither fences")));
    assert_eq!(logs(&all).len(), 1, "said once per silence: {:?}", logs(&all));
    assert!(sides(&all).iter().all(|d| flags_of(d) == hdr::PASSIVE));
}

/// Issue 20 item 5 (plumbing): once the engine finds the backup stale, the primary's state is
/// `peer_stale` with the reason, said once, and every message carries STALE; the backup that
/// receives it is stale for good.
#[test]
fn primary_with_a_stale_backup_flags_every_message_and_the_backup_turns_stale() {
    let mut x = Pair::new();
    x.run(0, 100);
    x.p.backup_stale(Why::BackupLagging);
    x.p.backup_stale(Why::BackupLagging);
    assert_eq!((x.p.state(), x.p.stale_why()), (State::PeerStale, Some("backup_lagging")));
    let n = x.sent_by_p.len();
    x.run(100, 1_000);
    assert!(x.sent_by_p[n..].iter().all(|d| flags_of(d) == hdr::STALE));
    assert_eq!(x.b.state(), State::Stale);
    let said = x.p_req.iter().filter(|(_, r)| matches!(r, Request::Log(l) if l.contains("can no longer take over"))).count();
    assert_eq!(said, 1);
    // The primary dies: the stale backup stays put.
    x.p_to_b = false;
    x.run(1_000, 20_000);
    assert_eq!(Pair::fences_of(&x.b_req, 0), 0);
    assert_eq!(x.b.state(), State::Stale);
}

/// Issue 20 item 15: a wrong key leaves both hosts `waiting_for_peer` while the primary runs
/// unprotected: said (rate-limited) and shown; as is a peer that never speaks.
#[test]
fn hostile_wrong_key_or_missing_peer_is_said_and_shown_not_silent() {
    let mut c = core(Role::Primary);
    let wrong = Core::new(settings(Role::Backup), other_key(), peer(), boot(9), 0);
    let mut wrong = wrong;
    let mut said = vec![];
    for now in 0..120_000 {
        for d in sides(&tick(&mut wrong, now)) {
            c.side(now, peer(), &d);
        }
        said.extend(logs(&tick(&mut c, now)));
    }
    assert_eq!(c.peer_problem(), Some("bad_datagrams"));
    let about: Vec<&String> = said.iter().filter(|l| l.contains("fail authentication")).collect();
    assert!(!about.is_empty() && about.len() <= 5, "{about:?}");
    assert!(about[0].contains("replica.key differs") && about[0].contains("unprotected"), "{}", about[0]);
    // Nobody there at all: told after PEER_WARN_MS, then every 30 s.
    let mut c = core(Role::Backup);
    let mut at = vec![];
    for now in 0..70_000 {
        if logs(&tick(&mut c, now)).iter().any(|l| l.contains("no authenticated message from the primary")) {
            at.push(now);
        }
    }
    assert_eq!(c.peer_problem(), Some("no_peer"));
    assert_eq!(at, vec![PEER_WARN_MS, PEER_WARN_MS + 30_000, PEER_WARN_MS + 60_000]);
    // Once the peer is heard, the problem is gone.
    Peer::new(Role::Primary, 3).bind(&mut c, 70_000);
    for now in 70_001..72_500 {
        tick(&mut c, now);
    }
    assert_eq!(c.peer_problem(), None);
}

/// Issue 20 item 14: every line a datagram can cause goes through the core's rate limiter.
#[test]
fn hostile_flood_of_same_role_datagrams_is_bounded_in_the_log() {
    let mut c = core(Role::Primary);
    Peer::new(Role::Backup, 1).bind(&mut c, 0);
    drain(&mut c);
    let mut same = Peer::new(Role::Primary, 0x5a5a);
    let r = tick(&mut c, 10);
    same.hear(&r);
    let mut lines = 0;
    for i in 0..10_000 {
        let m = same.msg(0);
        c.side(10 + i / 1000, peer(), &m);
        lines += logs(&drain(&mut c)).len();
    }
    assert!(lines <= 5, "{lines} lines");
    assert!(c.counters.log_suppressed >= 9_990);
    assert_eq!(c.state(), State::Protecting, "a live peer, the daemon keeps what it has");
}

/// Issue 20 item 7: the loop's lateness is measured (beats are sent from it).
#[test]
fn late_ticks_are_counted() {
    let mut c = core(Role::Backup);
    for now in [0, 5, 10, 45, 50] {
        tick(&mut c, now);
    }
    assert_eq!((c.counters.tick_gap_max_ms, c.counters.tick_gaps_over_interval), (35, 1));
}

/// A primary whose server failed says so (its beats turn PASSIVE): the backup fences it at once
/// instead of waiting a detector window of silence (the client's stall is that much shorter).
/// A stale backup never does (it cannot take over).
#[test]
fn backup_fences_at_once_when_the_primary_says_it_yielded() {
    let mut b = core(Role::Backup);
    let mut p = Peer::new(Role::Primary, 0xaaaa);
    p.bind(&mut b, 0);
    assert_eq!(b.state(), State::Protecting);
    let r = tick(&mut b, 1);
    p.hear(&r);
    let m = p.msg(hdr::PASSIVE);
    b.side(2, peer(), &m);
    let r = drain(&mut b);
    assert_eq!(fences(&r), 1, "fenced at the yield, not after 30 ms of silence");
    assert_eq!(b.state(), State::Fencing);
    b.fence_done(true, 5);
    assert_eq!(b.state(), State::TookOver);

    let mut s = core(Role::Backup);
    let mut q = Peer::new(Role::Primary, 0xaaab);
    q.bind(&mut s, 0);
    let r = tick(&mut s, 1);
    q.hear(&r);
    let m = q.msg(hdr::STALE);
    s.side(2, peer(), &m);
    assert_eq!(s.state(), State::Stale);
    let r = tick(&mut s, 3);
    q.hear(&r);
    let m = q.msg(hdr::PASSIVE);
    s.side(4, peer(), &m);
    assert_eq!(fences(&drain(&mut s)), 0, "a stale backup never fences");
}

/// A restarted primary daemon no longer follows its predecessor's connections (they pass
/// unprotected): the backup, which could not continue them without wrong input, turns stale
/// instead of looking like a spare.
#[test]
fn backup_turns_stale_when_the_primarys_daemon_restarts() {
    let mut x = Pair::new();
    x.run(0, 500);
    assert_eq!(x.b.state(), State::Protecting);
    x.p = core_at(Role::Primary, 0xaaa2, 500);
    x.run(500, 530);
    assert_eq!(x.b.counters.peer_restarts, 1);
    assert_eq!(x.b.state(), State::Stale);
    assert!(x.b_req.iter().any(|(_, r)| matches!(r, Request::Log(l) if l.contains("primary's daemon restarted"))));
}

/// Issue 20 (a stopped server): the backup's daemon samples its server; once it has read and
/// computed nothing while input waited for the hang bound, the backup's messages say HUNG
/// (said once in the log), and stop saying it when the server reads again. A server with
/// nothing to read, or busy computing, is never hung.
#[test]
fn backup_says_its_server_is_hung_in_every_message_until_it_reads_again() {
    use unbroken_engines::replica::ServerSocket;
    let sock = |unread: u32, received: u64| {
        [ServerSocket {
            id: 7,
            key: unbroken_engines::replica::ConnKey { client: "10.77.3.2".parse().unwrap(), client_port: 40000, server_port: 6379 },
            unread,
            received,
            send_queued: 0,
            send_buf: 0,
        }]
    };
    let mut x = Pair::new();
    x.run(0, 100);
    // Idle (nothing waits) for a long time, then busy computing with input waiting: not hung.
    for now in (100..1_000).step_by(20) {
        x.b.server_sample(now, &sock(0, 500), Some(3));
    }
    for now in (1_000..2_000).step_by(20) {
        x.b.server_sample(now, &sock(40, 540), Some(now));
    }
    x.run(100, 2_000);
    assert!(x.sent_by_b.iter().all(|d| flags_of(d) & hdr::HUNG == 0));
    // Stopped: input waits, no CPU. Hung after 150 ms.
    let n = x.sent_by_b.len();
    for now in (2_000..2_400).step_by(20) {
        x.b.server_sample(now, &sock(40, 540), Some(5_000));
        x.run(now, now + 20);
    }
    let flagged: Vec<bool> = x.sent_by_b[n..]
        .iter()
        .map(|d| flags_of(d) & hdr::HUNG != 0)
        .collect();
    let first = flagged.iter().position(|&f| f).expect("HUNG said");
    assert!(
        flagged[first..].iter().all(|&f| f),
        "every message after the first: {flagged:?}"
    );
    // Beats every 10 ms: hung at 2 140-2 160 ms, said at the next message.
    assert!(
        (12..=18).contains(&first),
        "said after the bound and within a beat or two: {flagged:?}"
    );
    let said = x
        .b_req
        .iter()
        .filter(|(_, r)| matches!(r, Request::Log(l) if l.contains("hung")))
        .count();
    assert_eq!(said, 1);
    // It reads again: no longer said.
    x.b.server_sample(2_400, &sock(0, 540), Some(5_000));
    let n = x.sent_by_b.len();
    x.run(2_400, 2_500);
    assert!(x.sent_by_b[n..]
        .iter()
        .all(|d| flags_of(d) & hdr::HUNG == 0));
    assert_eq!(
        (x.p.state(), x.b.state()),
        (State::Protecting, State::Protecting),
        "no connection: nothing stale"
    );
}
