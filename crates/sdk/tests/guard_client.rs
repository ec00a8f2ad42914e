//! GuardClient against the in-test guard (real engine logic): round trips, retransmission
//! with fresh nonces, authentication, and everything a client must ignore.

mod common;

use common::{Decoy, TestGuard, KEY_HEX, WRONG_KEY_HEX};
use std::net::SocketAddr;
use std::time::Duration;
use unbroken_sdk::{status, ClientConfig, Error, GuardClient, Key, Op};
use unbroken_wire::ctl::{flag, ConnOptions};

fn app() -> SocketAddr {
    "10.0.2.10:7000".parse().unwrap()
}
fn peer() -> SocketAddr {
    "10.0.1.2:41000".parse().unwrap()
}

/// Short waits so the failing cases end quickly: 4 tries, 20 + 40 + 80 + 160 ms.
fn fast() -> ClientConfig {
    ClientConfig { initial_timeout: Duration::from_millis(20), max_tries: 4, ..ClientConfig::default() }
}

/// Long first wait: tests that count datagrams exactly must not see a retransmission just
/// because the machine is busy.
fn patient() -> ClientConfig {
    ClientConfig { initial_timeout: Duration::from_secs(1), ..ClientConfig::default() }
}

fn client(g: &TestGuard) -> GuardClient {
    GuardClient::with_config(g.addr, Key::from_hex(KEY_HEX).unwrap(), patient()).unwrap()
}

#[test]
fn acknowledge_then_tell_round_trip() {
    let g = TestGuard::start();
    g.handshake(app(), peer(), 5000, 0xffff_fff0, true);
    let c = client(&g);
    let r = c.tell(app(), peer()).unwrap();
    assert_eq!(r.op, Op::Tell);
    assert_eq!((r.ack_a, r.ack_b), (0xffff_fff1, 5001));
    assert!(r.recoverable() && r.ack_allowed() && !r.fin_allowed() && !r.ack_everything());
    let o = r.options.unwrap();
    assert_eq!((o.peer_mss, o.peer_wscale, o.app_wscale, o.sack, o.timestamps), (1460, Some(7), Some(7), true, true));

    // A's TCP sends an ACK: the guard learns A's window and can build fresh ACKs (C2).
    g.app_ack(app(), peer(), 5001, 0xffff_fff1, 512);
    // Wraps past 2^32 in the peer's sequence space.
    let r = c.acknowledge(app(), peer(), 0x0000_0010, None).unwrap();
    assert_eq!(r.op, Op::Acknowledge);
    assert_eq!(r.ack_a, 0x10);
    assert_eq!(g.conn(app(), peer()).unwrap().ack_a, 0x10);
    // The guard built a fresh ACK for the peer (C2) once it knew A's window.
    assert_eq!(g.state().acks_built, 1);
    // A lower checkpoint never moves the guard's back.
    assert_eq!(c.acknowledge(app(), peer(), 0xffff_fff5, None).unwrap().ack_a, 0x10);

    let r = c.shutdown_writing(app(), peer()).unwrap();
    assert!(r.fin_allowed() && !r.ack_everything());
    let r = c.shutdown_reading(app(), peer()).unwrap();
    assert!(r.fin_allowed() && r.ack_everything());
    let r = c.shutdown(app(), peer()).unwrap();
    assert_eq!(r.flags & (flag::FIN_ALLOWED | flag::ACK_EVERYTHING), flag::FIN_ALLOWED | flag::ACK_EVERYTHING);
    let r = c.clear(app(), peer()).unwrap();
    assert_eq!(r.flags, 0);
    assert!(g.conn(app(), peer()).unwrap().is_empty());

    let s = c.stats();
    assert_eq!((s.requests, s.datagrams_sent, s.retransmissions, s.ignored, s.timeouts), (7, 7, 0, 0, 0));
    assert_eq!(g.ops(), [Op::Tell, Op::Acknowledge, Op::Acknowledge, Op::ShutdownWriting, Op::ShutdownReading, Op::Shutdown, Op::Clear]);
}

#[test]
fn tell_of_unknown_connection_is_rejected() {
    let g = TestGuard::start();
    let c = client(&g);
    match c.tell(app(), peer()) {
        Err(Error::Rejected(s)) => assert_eq!(s, status::NO_CONNECTION),
        other => panic!("{other:?}"),
    }
    // An ACKNOWLEDGE creates the state (a restarted guard learns the checkpoint and options).
    let o = ConnOptions { peer_mss: 1400, peer_wscale: Some(8), app_wscale: Some(6), sack: true, timestamps: false };
    let r = c.acknowledge(app(), peer(), 77, Some(o)).unwrap();
    assert!(r.ack_allowed() && !r.recoverable());
    assert_eq!(r.options, Some(o));
    assert_eq!(g.state().log[1].options, Some(o));
}

#[test]
fn retransmits_when_the_request_is_lost() {
    let g = TestGuard::start();
    g.handshake(app(), peer(), 1, 2, true);
    g.state().drop_requests = 2;
    let c = GuardClient::with_config(g.addr, Key::from_hex(KEY_HEX).unwrap(), fast()).unwrap();
    let r = c.tell(app(), peer()).unwrap();
    assert_eq!(r.ack_b, 2);
    let s = c.stats();
    assert!(s.retransmissions >= 2 && s.timeouts == 0, "{s:?}");
    assert_eq!(s.datagrams_sent, 1 + s.retransmissions);
    // Every datagram carried its own nonce (none was refused as a replay).
    let st = g.state();
    assert_eq!(st.nonces.len() as u64, s.datagrams_sent);
    assert_eq!(st.replayed, 0);
}

/// The first request arrives and is executed, only its answer is lost: a retransmission with
/// the same nonce would be refused as a replay, so each try needs a fresh one.
#[test]
fn retransmits_with_a_fresh_nonce_when_the_answer_is_lost() {
    let g = TestGuard::start();
    g.handshake(app(), peer(), 1, 2, true);
    g.state().lose_replies = 1;
    let c = GuardClient::with_config(g.addr, Key::from_hex(KEY_HEX).unwrap(), fast()).unwrap();
    let r = c.acknowledge(app(), peer(), 500, None).unwrap();
    assert_eq!(r.ack_a, 500);
    let st = g.state();
    assert_eq!(st.replayed, 0);
    assert!(st.log.len() >= 2);
    assert_ne!(st.log[0].nonce, st.log[1].nonce);
    assert!(c.stats().retransmissions >= 1);
}

#[test]
fn wrong_key_times_out() {
    let g = TestGuard::start();
    g.handshake(app(), peer(), 1, 2, true);
    let c = GuardClient::with_config(g.addr, Key::from_hex(WRONG_KEY_HEX).unwrap(), fast()).unwrap();
    match c.acknowledge(app(), peer(), 999, None) {
        Err(Error::Timeout { tries }) => assert_eq!(tries, 4),
        other => panic!("{other:?}"),
    }
    assert_eq!(c.stats().timeouts, 1);
    let st = g.state();
    assert!(st.unauthenticated >= 1);
    assert!(st.log.is_empty(), "nothing was executed");
    assert_eq!(st.conns[&(app(), peer())].ack_a, 3, "checkpoint unchanged");
}

/// An impostor answering with another key is never believed.
#[test]
fn answers_signed_with_another_key_are_never_accepted() {
    let g = TestGuard::start();
    g.handshake(app(), peer(), 1, 2, true);
    g.state().reply_key = Some(Key::from_hex(WRONG_KEY_HEX).unwrap());
    let c = GuardClient::with_config(g.addr, Key::from_hex(KEY_HEX).unwrap(), fast()).unwrap();
    assert!(matches!(c.tell(app(), peer()), Err(Error::Timeout { tries: 4 })));
    assert_eq!(c.stats().ignored, 4);
}

#[test]
fn decoys_are_ignored_and_counted() {
    let g = TestGuard::start();
    g.handshake(app(), peer(), 1, 2, true);
    let decoys = vec![Decoy::WrongNonce, Decoy::WrongOp, Decoy::WrongConnection, Decoy::NotResponse, Decoy::WrongKey, Decoy::Garbage];
    g.state().decoys = decoys.clone();
    let c = client(&g);
    let r = c.acknowledge(app(), peer(), 42, None).unwrap();
    assert_eq!(r.ack_a, 42);
    let s = c.stats();
    assert_eq!(s.ignored, decoys.len() as u64);
    assert_eq!(s.retransmissions, 0);
}

/// A late answer to an earlier request (timed out) is ignored by the next one.
#[test]
fn stale_answers_are_ignored() {
    let g = TestGuard::start();
    g.handshake(app(), peer(), 1, 2, true);
    let c = GuardClient::with_config(g.addr, Key::from_hex(KEY_HEX).unwrap(), fast()).unwrap();
    // Every answer is sent twice: the copy of the first answer stays queued in the client's
    // socket and must not satisfy the second request.
    g.state().duplicate_replies = true;
    let r1 = c.acknowledge(app(), peer(), 10, None).unwrap();
    assert_eq!(r1.ack_a, 10);
    let r2 = c.acknowledge(app(), peer(), 20, None).unwrap();
    assert_eq!(r2.ack_a, 20);
    assert_eq!(c.stats().ignored, 1);
}

#[test]
fn shared_between_threads() {
    let g = TestGuard::start();
    g.handshake(app(), peer(), 1, 2, true);
    let c = std::sync::Arc::new(client(&g));
    let hs: Vec<_> = (0..4u32)
        .map(|t| {
            let c = c.clone();
            std::thread::spawn(move || {
                for i in 0..25u32 {
                    let r = c.acknowledge(app(), peer(), 3 + t * 100 + i, None).unwrap();
                    assert_eq!(r.op, Op::Acknowledge);
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    let s = c.stats();
    assert_eq!((s.requests, s.ignored, s.timeouts), (100, 0, 0));
    assert_eq!(g.conn(app(), peer()).unwrap().ack_a, 3 + 300 + 24);
}

#[test]
fn ipv6_commands() {
    let g = TestGuard::start();
    let (a6, p6): (SocketAddr, SocketAddr) = ("[fd00::10]:7000".parse().unwrap(), "[fd00::2]:41000".parse().unwrap());
    let c = client(&g);
    let r = c.acknowledge(a6, p6, 9, None).unwrap();
    assert_eq!(r.ack_a, 9);
    assert_eq!(g.conn(a6, p6).unwrap().ack_a, 9);
}

/// Issue 9, checkpoint misconfiguration: a guard that refuses our key says so (a NAK bound to
/// the request's nonce), and the client reports it at once instead of timing out.
#[test]
fn hostile_wrong_key_is_reported_as_a_refusal() {
    let g = TestGuard::start();
    g.handshake(app(), peer(), 1, 2, true);
    g.state().refuse_bad_mac = true;
    let c = GuardClient::with_config(g.addr, Key::from_hex(WRONG_KEY_HEX).unwrap(), patient()).unwrap();
    match c.tell(app(), peer()) {
        Err(e @ Error::Refused { reason: unbroken_wire::ctl::refusal::KEY }) => assert!(e.to_string().contains("key"), "{e}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(c.stats().datagrams_sent, 1, "no retransmission: the refusal answered the first");
    // The probe at start-up says the same.
    assert!(matches!(c.probe(app()), Err(Error::Refused { reason: unbroken_wire::ctl::refusal::KEY })));
}

/// A refusal that does not echo one of the request's nonces (a blind forger's) is ignored.
#[test]
fn hostile_forged_refusals_are_ignored() {
    let g = TestGuard::start();
    g.handshake(app(), peer(), 1, 2, true);
    g.state().decoys = vec![Decoy::ForgedRefusal];
    let c = client(&g);
    assert!(c.tell(app(), peer()).is_ok());
    assert!(c.stats().ignored >= 1);
}

/// The start-up probe: Ok with a working guard (even with no connection yet), a timeout that
/// says nothing answers when no guard listens at the address.
#[test]
fn hostile_probe_tells_a_wrong_address_from_a_working_guard() {
    let g = TestGuard::start();
    assert!(client(&g).probe(app()).is_ok());
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let c = GuardClient::with_config(silent.local_addr().unwrap(), Key::from_hex(KEY_HEX).unwrap(), fast()).unwrap();
    match c.probe(app()) {
        Err(e @ Error::Timeout { .. }) => assert!(e.to_string().contains("nothing answered"), "{e}"),
        other => panic!("{other:?}"),
    }
}
