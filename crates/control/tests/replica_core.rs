//! The replica daemon's I/O-free core (`replicacore::Core`): when the peer counts as present,
//! what the side channel accepts, beats, fencing and its results. No queue, socket or clock.

use std::net::SocketAddr;

use unbroken_control::daemon::{Mode, Outbox};
use unbroken_control::replicacore::{Core, Request, Settings, State};
use unbroken_engines::replica::{Config, DetectorConfig};
use unbroken_wire::ctl::Key;
use unbroken_wire::replica::{Progress, Role};

fn key() -> Key {
    Key::from_hex("00112233445566778899aabbccddeeff").unwrap()
}

fn peer() -> SocketAddr {
    "10.77.3.12:7790".parse().unwrap()
}

fn core(role: Role) -> Core {
    let s = Settings { role, detector: DetectorConfig { interval_ms: 10, misses: 3 }, engine: Config::default(), finished_grace_ms: 1000 };
    Core::new(s, key(), peer(), 1000, 0)
}

fn msg(role: Role, beat: u64, k: &Key) -> Vec<u8> {
    Progress { role, beat, flags: 0, records: vec![] }.emit(k).unwrap()
}

fn tick(c: &mut Core, now: u64) -> Vec<Request> {
    let mut out = Outbox::default();
    c.tick(now, &mut out);
    c.collect(&mut out);
    out.requests
}

fn fences(r: &[Request]) -> usize {
    r.iter().filter(|r| **r == Request::Fence).count()
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
fn beats_are_authenticated_progress_of_this_hosts_role_with_rising_numbers() {
    let mut c = core(Role::Backup);
    let mut beats = vec![];
    for now in [0, 10, 20, 30] {
        for r in tick(&mut c, now) {
            if let Request::Side(d) = r {
                let p = Progress::parse(&d, &key()).expect("authenticated");
                assert_eq!(p.role, Role::Backup);
                beats.push(p.beat);
            }
        }
    }
    assert_eq!(beats.len(), 4, "one beat per interval: {beats:?}");
    assert!(beats.windows(2).all(|w| w[1] > w[0]), "{beats:?}");
    let other = Key::from_hex("ffeeddccbbaa99887766554433221100").unwrap();
    if let Some(Request::Side(d)) = tick(&mut c, 40).into_iter().find(|r| matches!(r, Request::Side(_))) {
        assert!(Progress::parse(&d, &other).is_err(), "a wrong key must not verify");
    }
}

#[test]
fn hostile_side_channel_accepts_only_the_peer_authenticated_of_the_other_role_and_not_older() {
    let mut c = core(Role::Backup);
    let stranger: SocketAddr = "10.77.3.99:7790".parse().unwrap();
    c.side(1, stranger, &msg(Role::Primary, 5, &key()));
    assert_eq!((c.counters.beats_foreign, c.state()), (1, State::WaitingForPeer));
    let other = Key::from_hex("ffeeddccbbaa99887766554433221100").unwrap();
    c.side(2, peer(), &msg(Role::Primary, 5, &other));
    assert_eq!((c.counters.beats_bad, c.state()), (1, State::WaitingForPeer));
    c.side(3, peer(), b"garbage");
    assert_eq!(c.counters.beats_bad, 2);
    // Its own role reflected back at it.
    c.side(4, peer(), &msg(Role::Backup, 5, &key()));
    assert_eq!((c.counters.beats_foreign, c.state()), (2, State::WaitingForPeer));
    c.side(5, peer(), &msg(Role::Primary, 5, &key()));
    assert_eq!((c.counters.beats_received, c.state()), (1, State::Protecting));
    // Every datagram has its own number: a replay of the newest is as stale as an older one.
    c.side(6, peer(), &msg(Role::Primary, 5, &key()));
    c.side(7, peer(), &msg(Role::Primary, 4, &key()));
    assert_eq!((c.counters.beats_received, c.counters.beats_stale), (1, 2));
    assert_eq!(c.peer_heard_at, Some(5), "a replay does not count as the peer being alive");
    c.side(8, peer(), &msg(Role::Primary, 6, &key()));
    assert_eq!((c.counters.beats_received, c.peer_heard_at), (2, Some(8)));
}

#[test]
fn hostile_replayed_messages_do_not_keep_a_dead_primary_alive() {
    let mut c = core(Role::Backup);
    // The newest datagram, replayed for ever (the rule used to accept a beat's number twice).
    let old = msg(Role::Primary, 8, &key());
    c.side(0, peer(), &msg(Role::Primary, 8, &key()));
    let mut fenced_at = None;
    for now in (1..200).step_by(1) {
        c.side(now, peer(), &old);
        if fences(&tick(&mut c, now)) > 0 {
            fenced_at = Some(now);
            break;
        }
    }
    assert_eq!(fenced_at, Some(31), "silence of 3 x 10 ms since the last fresh beat (at 0)");
}

#[test]
fn backup_takes_over_only_after_a_successful_fence_and_retries_a_failed_one() {
    let mut c = core(Role::Backup);
    c.side(100, peer(), &msg(Role::Primary, 1, &key()));
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
    let mut out = Outbox::default();
    c.collect(&mut out);
    assert!(!out.requests.contains(&Request::Announce), "a failed fence never takes over");
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
    let mut out = Outbox::default();
    c.collect(&mut out);
    assert!(out.requests.contains(&Request::Announce));
    // The fenced primary's messages change nothing any more.
    c.side(450, peer(), &msg(Role::Primary, 2, &key()));
    assert_eq!(c.state(), State::TookOver);
    assert_eq!(fences(&tick(&mut c, 10_000)), 0);
}

#[test]
fn primary_runs_unprotected_once_the_backup_is_fenced() {
    let mut c = core(Role::Primary);
    c.side(0, peer(), &msg(Role::Backup, 1, &key()));
    assert_eq!(c.state(), State::Protecting);
    let at = (1..100).find(|&t| fences(&tick(&mut c, t)) > 0);
    assert_eq!(at, Some(31));
    c.fence_done(true, 35);
    assert_eq!(c.state(), State::PeerFailed);
    let mut out = Outbox::default();
    c.collect(&mut out);
    assert!(!out.requests.contains(&Request::Announce), "only a backup announces");
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

/// Both hosts given the same role: the first authenticated message of that role from the peer's
/// address (not a reflection of this host's own numbers) stops the daemon with a precise error;
/// a reflection changes nothing.
#[test]
fn a_peer_configured_with_the_same_role_stops_the_daemon() {
    let mut c = core(Role::Primary);
    // A reflection of this host's own first message (numbers 1000.. here).
    let _ = tick(&mut c, 0);
    c.side(1, peer(), &msg(Role::Primary, 1000, &key()));
    let mut out = Outbox::default();
    c.collect(&mut out);
    assert!(!out.requests.iter().any(|r| matches!(r, Request::Fatal(_))), "a reflection is not a second primary");
    c.side(2, peer(), &msg(Role::Primary, 5_000_000, &key()));
    let mut out = Outbox::default();
    c.collect(&mut out);
    let fatal: Vec<&Request> = out.requests.iter().filter(|r| matches!(r, Request::Fatal(_))).collect();
    assert_eq!(fatal.len(), 1);
    assert!(matches!(fatal[0], Request::Fatal(m) if m.contains("also runs as the primary")));
    assert_eq!(c.state(), State::WaitingForPeer);
}
