//! The section 4 API on real loopback sockets, against the in-test guard (real engine logic
//! for commands; the handshake and the peer's ACKs are fed to the same engine as packets).

mod common;

use common::{packet, TestGuard, KEY_HEX};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::Duration;
use unbroken_engines::rtcp;
use unbroken_sdk::{self as sdk, status, ClientConfig, ConnRecord, Error, GuardClient, Key, Op};
use unbroken_wire::ctl::{flag, ConnOptions};
use unbroken_wire::{tcp, Seq};

/// A long first wait, so a busy machine does not cause retransmissions in tests that count
/// commands.
fn client(g: &TestGuard) -> GuardClient {
    client_with(g, ClientConfig::default())
}

fn client_with(g: &TestGuard, cfg: ClientConfig) -> GuardClient {
    let cfg = ClientConfig { initial_timeout: Duration::from_secs(1), ..cfg };
    GuardClient::with_config(g.addr, Key::from_hex(KEY_HEX).unwrap(), cfg).unwrap()
}

/// A real loopback connection; returns (server side = the application A, client side = B).
fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let b = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (a, _) = l.accept().unwrap();
    (a, b)
}

fn opts() -> ConnOptions {
    ConnOptions { peer_mss: 1460, peer_wscale: Some(7), app_wscale: Some(7), sack: true, timestamps: true }
}

#[test]
fn establish_on_a_real_connection() {
    let g = TestGuard::start();
    let (a, _b) = pair();
    let (app, peer) = (a.local_addr().unwrap(), a.peer_addr().unwrap());
    g.handshake(app, peer, 0x1000, 0xffff_fff0, true);
    let c = client(&g);
    let rec = sdk::establish(&a, &c).unwrap();
    assert_eq!((rec.app(), rec.peer()), (app, peer));
    assert_eq!(rec.ack_a0(), 0xffff_fff1, "peer ISN + 1");
    assert_eq!(rec.ack_b0(), 0x1001, "application ISN + 1");
    // Options come from the socket's TCP_INFO, not from the guard's (made-up) handshake.
    let info = sdk::tcp_info_options(&a).unwrap().unwrap();
    assert_eq!(rec.options(), Some(info));
    assert_eq!(ConnRecord::from_bytes(&rec.to_bytes()).unwrap(), rec);
    assert_eq!(g.ops(), [Op::Tell]);
}

/// The guard has not seen the handshake's last ACK at the first TELL; it arrives before the
/// second one.
#[test]
fn establish_retries_until_the_guard_saw_the_final_ack() {
    let g = TestGuard::start();
    let (a, _b) = pair();
    let (app, peer) = (a.local_addr().unwrap(), a.peer_addr().unwrap());
    g.handshake(app, peer, 0x1000, 0x2000, false);
    g.state().tell_hook = Some(Box::new(move |count, conn| {
        if count == 2 {
            let r = tcp::Repr { src_port: peer.port(), dst_port: app.port(), seq: Seq(0x2001), ack: Seq(0x1001), flags: tcp::flags::ACK, window: 100, ..Default::default() };
            let (mut buf, len) = packet(peer, app, &r);
            rtcp::incoming(conn, &mut buf, len).unwrap();
        }
    }));
    let c = client(&g);
    let rec = sdk::establish(&a, &c).unwrap();
    assert_eq!((rec.ack_a0(), rec.ack_b0()), (0x2001, 0x1001));
    assert_eq!(g.state().tells[&(app, peer)], 2);
}

/// Issue 21, item 4: a connection reset before `establish` (a restarted guard's probe made the
/// application's TCP reset it) has no peer for getpeername; `establish` still names it (Linux's
/// SO_PEERNAME) and posts its SHUTDOWN with ABANDON for that exact connection, so a guard that
/// cannot protect it resets the peer instead of leaving it to hang.
#[test]
fn establish_on_a_reset_connection_still_abandons_it_by_name() {
    let g = TestGuard::start();
    let (a, b) = pair();
    let (app, peer) = (a.local_addr().unwrap(), a.peer_addr().unwrap());
    // The peer resets the connection (SO_LINGER 0), and the application's socket learns it.
    let zero = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: a valid linger struct for a valid socket.
    assert_eq!(unsafe { libc::setsockopt(std::os::fd::AsRawFd::as_raw_fd(&b), libc::SOL_SOCKET, libc::SO_LINGER, (&zero as *const libc::linger).cast(), std::mem::size_of::<libc::linger>() as libc::socklen_t) }, 0);
    drop(b);
    assert_eq!((&a).read(&mut [0u8; 16]).unwrap_err().kind(), ErrorKind::ConnectionReset);
    assert_eq!(a.peer_addr().unwrap_err().raw_os_error(), Some(libc::ENOTCONN), "getpeername no longer names it");
    let c = client_with(&g, ClientConfig { establish_tries: 1, ..ClientConfig::default() });
    let r = sdk::establish(&a, &c);
    assert!(matches!(r, Err(Error::Rejected(status::NO_CONNECTION))), "{r:?}");
    // The posted SHUTDOWN follows the TELL; a blocking TELL after it is handled after it.
    let _ = c.tell(app, "127.0.0.1:9".parse().unwrap());
    let log = g.state().log.clone();
    assert!(log.iter().any(|cmd| cmd.op == Op::Shutdown && cmd.flags & flag::ABANDON != 0 && cmd.app == app && cmd.peer == peer), "{log:?}");
}

#[test]
fn establish_gives_up() {
    let g = TestGuard::start();
    let (a, _b) = pair();
    let (app, peer) = (a.local_addr().unwrap(), a.peer_addr().unwrap());
    let c = client_with(&g, ClientConfig { establish_tries: 3, establish_backoff: Duration::from_millis(1), ..ClientConfig::default() });
    // Unknown connection.
    assert!(matches!(sdk::establish(&a, &c), Err(Error::Rejected(status::NO_CONNECTION))));
    // Known, but the peer's ACK never seen: not recoverable.
    g.handshake(app, peer, 1, 2, false);
    match sdk::establish(&a, &c) {
        Err(Error::NotRecoverable { flags }) => assert_eq!(flags & (flag::RECOVERABLE | flag::ACK_ALLOWED), flag::ACK_ALLOWED),
        other => panic!("{other:?}"),
    }
    // Three TELLs each time, and on giving up a SHUTDOWN posted without waiting (a TELL may
    // have reached the guard on a one-way side channel; the SHUTDOWN makes the close genuine).
    let want = [Op::Tell, Op::Tell, Op::Tell, Op::Shutdown, Op::Tell, Op::Tell, Op::Tell, Op::Shutdown];
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while g.ops().len() < want.len() && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(g.ops(), want);
    // The SHUTDOWNs say the application gives the connection up (ABANDON): a guard that cannot
    // protect it either resets the peer (issue 21, item 4).
    assert!(g.state().log.iter().filter(|c| c.op == Op::Shutdown).all(|c| c.flags & flag::ABANDON != 0));
}

#[test]
fn acknowledge_shutdown_and_clear_drive_the_guard() {
    let g = TestGuard::start();
    let (app, peer): (SocketAddr, SocketAddr) = ("10.0.2.10:7000".parse().unwrap(), "10.0.1.2:41000".parse().unwrap());
    g.handshake(app, peer, 0x1000, 0xffff_fff0, true);
    let c = client(&g);
    let rec = ConnRecord::new(app, peer, 0xffff_fff1, 0x1001, Some(opts())).unwrap();
    let ack_a = |g: &TestGuard| g.conn(app, peer).unwrap().ack_a;

    let r = sdk::acknowledge(&rec, &c, 0x20).unwrap();
    assert_eq!(r.ack_a, 0x11);
    assert_eq!(ack_a(&g), 0x11, "wrapped past 2^32");
    // consumed_total is a 64-bit count: only its low 32 bits matter on the wire.
    sdk::acknowledge(&rec, &c, (1 << 32) + 0x30).unwrap();
    assert_eq!(ack_a(&g), 0x21);
    // Every ACKNOWLEDGE carries the record's options (a restarted guard learns them).
    assert!(g.state().log.iter().all(|c| c.options == Some(opts())));
    // End of input: the peer's FIN is covered too.
    sdk::acknowledge_eof(&rec, &c, (1 << 32) + 0x30).unwrap();
    assert_eq!(ack_a(&g), 0x22);

    let r = sdk::shutdown_writing(&rec, &c).unwrap();
    assert!(r.fin_allowed() && !r.ack_everything());
    let r = sdk::shutdown_reading(&rec, &c).unwrap();
    assert!(r.fin_allowed() && r.ack_everything());
    let r = sdk::shutdown(&rec, &c).unwrap();
    assert!(r.fin_allowed() && r.ack_everything());
    sdk::clear(&rec, &c).unwrap();
    assert!(g.conn(app, peer).unwrap().is_empty());
    assert!(matches!(c.tell(app, peer), Err(Error::Rejected(status::NO_CONNECTION))));
    assert_eq!(g.ops(), [Op::Acknowledge, Op::Acknowledge, Op::Acknowledge, Op::ShutdownWriting, Op::ShutdownReading, Op::Shutdown, Op::Clear, Op::Tell]);
}

/// The application's listener (with SO_REUSEPORT) stays open on the port; the peer B is a
/// plain listener standing in for the guard that would answer the recovery SYN.
struct RecoverySetup {
    g: TestGuard,
    a_listener: TcpListener,
    b_listener: TcpListener,
    rec: ConnRecord,
}

#[test]
fn acknowledge_nowait_moves_the_checkpoint_without_waiting() {
    let g = TestGuard::start();
    let (app, peer): (SocketAddr, SocketAddr) = ("10.0.2.10:7000".parse().unwrap(), "10.0.1.2:41001".parse().unwrap());
    g.handshake(app, peer, 0x1000, 0x5000, true);
    let c = client(&g);
    let rec = ConnRecord::new(app, peer, 0x5001, 0x1001, Some(opts())).unwrap();
    for consumed in [100u64, 250, 4000] {
        sdk::acknowledge_nowait(&rec, &c, consumed).unwrap();
    }
    // A blocking TELL after the posts: the guard handles datagrams in order, so it has them.
    let r = c.tell(app, peer).unwrap();
    assert_eq!(r.ack_a, 0x5001 + 4000);
    assert_eq!(g.ops(), [Op::Acknowledge, Op::Acknowledge, Op::Acknowledge, Op::Tell]);
    // The three unanswered replies were skimmed, not mistaken for the TELL's answer.
    assert!(c.stats().ignored >= 2, "{:?}", c.stats());
}

fn setup(ack_b0: u32, delivered_low: u32) -> RecoverySetup {
    let g = TestGuard::start();
    let a_listener = sdk::reuseport_listener("127.0.0.1:0".parse().unwrap(), 16).unwrap();
    let b_listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let (app, peer) = (a_listener.local_addr().unwrap(), b_listener.local_addr().unwrap());
    let (isn_a, isn_b) = (ack_b0.wrapping_sub(1), 0x7000_0000u32);
    g.handshake(app, peer, isn_a, isn_b, true);
    // Later the peer acknowledged `delivered_low` bytes (mod 2^32) of A's output.
    if delivered_low != 0 {
        g.peer_ack(app, peer, isn_b + 1, ack_b0.wrapping_add(delivered_low));
    }
    let rec = ConnRecord::new(app, peer, isn_b + 1, ack_b0, Some(opts())).unwrap();
    RecoverySetup { g, a_listener, b_listener, rec }
}

#[test]
fn recover_binds_the_listening_port_and_reports_delivered() {
    let s = setup(0x0100_0000, 1000);
    let c = client(&s.g);
    let (mut stream, delivered) = sdk::recover(&s.rec, &c, 500, 1200).unwrap();
    assert_eq!(delivered, 1000);
    // Same address and port as the listener that is still open.
    assert_eq!(stream.local_addr().unwrap(), s.rec.app());
    assert_eq!(stream.peer_addr().unwrap(), s.rec.peer());
    let (mut b, from) = s.b_listener.accept().unwrap();
    assert_eq!(from, s.rec.app());
    stream.write_all(b"resent").unwrap();
    let mut got = [0u8; 6];
    b.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"resent");
    // (1) ACKNOWLEDGE with the checkpoint and the options, then (4) TELL.
    let st = s.g.state();
    assert_eq!(st.log.iter().map(|c| c.op).collect::<Vec<_>>(), [Op::Acknowledge, Op::Tell]);
    assert_eq!(st.log[0].ack_a, s.rec.ack_a0() + 500);
    assert_eq!(st.log[0].options, Some(opts()));
    drop(st);
    // The listener still gets new connections.
    let _n = TcpStream::connect(s.rec.app()).unwrap();
    let (_x, _) = s.a_listener.accept().unwrap();
}

/// The fact the module documentation states: without SO_REUSEPORT on the listener, the
/// recovered socket cannot bind the listening port (SO_REUSEADDR is not enough).
#[test]
fn recover_needs_reuseport_on_the_listener() {
    let g = TestGuard::start();
    let plain = TcpListener::bind("127.0.0.1:0").unwrap(); // std sets SO_REUSEADDR only
    let b_listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let (app, peer) = (plain.local_addr().unwrap(), b_listener.local_addr().unwrap());
    g.handshake(app, peer, 10, 20, true);
    let rec = ConnRecord::new(app, peer, 21, 11, None).unwrap();
    match sdk::recover(&rec, &client(&g), 0, 0) {
        Err(Error::Io(e)) => assert_eq!(e.kind(), ErrorKind::AddrInUse),
        other => panic!("{other:?}"),
    }
    // Recovering before listening works.
    drop(plain);
    let (_s, delivered) = sdk::recover(&rec, &client(&g), 0, 0).unwrap();
    assert_eq!(delivered, 0);
}

#[test]
fn recover_unwraps_delivered_past_4gib() {
    let delivered = (5u64 << 30) + 10;
    let s = setup(0xffff_ff00, delivered as u32);
    let (_stream, got) = sdk::recover(&s.rec, &client(&s.g), 0, (5u64 << 30) + 100).unwrap();
    assert_eq!(got, delivered);
}

#[test]
fn recover_refuses_delivered_beyond_sent() {
    let s = setup(0x10, 2000);
    match sdk::recover(&s.rec, &client(&s.g), 0, 1200) {
        Err(Error::DeliveredBeyondSent { delivered, sent }) => assert_eq!((delivered, sent), (2000, 1200)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn recover_needs_a_recoverable_guard() {
    // The guard lost its state and never saw the peer's ACK since: ACKNOWLEDGE restores
    // the checkpoint, but TELL cannot report ackB.
    let g = TestGuard::start();
    let a_listener = sdk::reuseport_listener("127.0.0.1:0".parse().unwrap(), 4).unwrap();
    let b_listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let rec = ConnRecord::new(a_listener.local_addr().unwrap(), b_listener.local_addr().unwrap(), 100, 200, Some(opts())).unwrap();
    match sdk::recover(&rec, &client(&g), 7, 0) {
        Err(Error::NotRecoverable { flags }) => assert_eq!(flags & flag::RECOVERABLE, 0),
        other => panic!("{other:?}"),
    }
    let conn = g.conn(rec.app(), rec.peer()).unwrap();
    assert_eq!(conn.ack_a, 107);
    assert_eq!(conn.options(), Some(opts()), "the restarted guard learned the options");
}

#[test]
fn recover_without_a_guard_fails_before_touching_the_network() {
    let silent = UdpSocket::bind("127.0.0.1:0").unwrap();
    let c = GuardClient::with_config(silent.local_addr().unwrap(), Key::from_hex(KEY_HEX).unwrap(), ClientConfig { initial_timeout: Duration::from_millis(10), max_tries: 2, ..ClientConfig::default() }).unwrap();
    let b_listener = TcpListener::bind("127.0.0.1:0").unwrap();
    b_listener.set_nonblocking(true).unwrap();
    let rec = ConnRecord::new("127.0.0.1:1".parse().unwrap(), b_listener.local_addr().unwrap(), 1, 2, None).unwrap();
    assert!(matches!(sdk::recover(&rec, &c, 0, 0), Err(Error::Timeout { tries: 2 })));
    assert_eq!(b_listener.accept().unwrap_err().kind(), ErrorKind::WouldBlock, "no SYN was sent");
}

/// A loopback TCP port that refuses connections for as long as the returned socket lives: it
/// is bound (without SO_REUSEADDR or SO_REUSEPORT, so no other socket can bind the port, not
/// even one that sets both) and never listens, so a SYN to it is answered with a RST.
fn refusing_port() -> (std::os::fd::OwnedFd, SocketAddr) {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: plain socket(2); the descriptor is owned exactly once.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(raw >= 0, "{}", std::io::Error::last_os_error());
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: sockaddr_in is plain data; all-zero is valid, then filled in.
    let mut sin: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    sin.sin_family = libc::AF_INET as libc::sa_family_t;
    sin.sin_addr = libc::in_addr { s_addr: u32::from_ne_bytes([127, 0, 0, 1]) };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: sin is a sockaddr_in of len bytes, for bind to read and getsockname to write.
    let p = (&mut sin as *mut libc::sockaddr_in).cast::<libc::sockaddr>();
    assert_eq!(unsafe { libc::bind(fd.as_raw_fd(), p, len) }, 0, "{}", std::io::Error::last_os_error());
    assert_eq!(unsafe { libc::getsockname(fd.as_raw_fd(), p, &mut len) }, 0, "{}", std::io::Error::last_os_error());
    (fd, SocketAddr::from(([127, 0, 0, 1], u16::from_be(sin.sin_port))))
}

/// The peer's port refuses the recovery SYN: `recover` reports the connect error.
///
/// The port is held, not freed: this test once failed with `NotRecoverable { flags: 2 }` (1 of
/// 582 tests in a `.ci/run`) when it took a listener's port and closed it. Any `bind(0)` on the
/// host could then take that port, including `recover`'s own bind of the record's
/// `127.0.0.1:0` (a self-connection: both binds set SO_REUSEADDR, and Linux picks such ports
/// from the same half of the ephemeral range; 6 in 20 000 pairs of such binds in a loop, 0 in
/// 12 000 runs of this test alone) or a listener of a test running beside it; `connect` then
/// succeeded, and the guard, which has only the checkpoint from
/// `recover`'s ACKNOWLEDGE (ACK_ALLOWED, 2) and never saw the peer, rightly said the connection
/// is not recoverable. With the ephemeral range narrowed to 10 ports in a network namespace,
/// the old test failed that way 43 times in 50.
#[test]
fn recover_reports_connect_errors() {
    let g = TestGuard::start();
    let (_held, peer) = refusing_port();
    let rec = ConnRecord::new("127.0.0.1:0".parse().unwrap(), peer, 1, 2, None).unwrap();
    match sdk::recover(&rec, &client(&g), 0, 0) {
        Err(Error::Io(e)) => assert_eq!(e.kind(), ErrorKind::ConnectionRefused),
        other => panic!("{other:?}"),
    }
}

/// The socket's IP_TOS byte.
fn tos(s: &TcpStream) -> u8 {
    use std::os::fd::AsRawFd;
    let mut v: libc::c_int = 0;
    let mut l = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: v is a c_int of l bytes.
    assert_eq!(unsafe { libc::getsockopt(s.as_raw_fd(), libc::IPPROTO_IP, libc::IP_TOS, (&mut v as *mut libc::c_int).cast(), &mut l) }, 0);
    v as u8
}

/// Issue 9, checkpoint misconfiguration: when `establish` fails (here: nothing answers at the
/// guard's address), the socket is marked unprotected (DSCP UNPROTECTED_DSCP) so the guard lets
/// its close through; when it succeeds, the socket is left alone.
#[test]
fn hostile_establish_failure_marks_the_socket_unprotected() {
    let silent = UdpSocket::bind("127.0.0.1:0").unwrap();
    let cfg = ClientConfig { initial_timeout: Duration::from_millis(10), max_tries: 2, ..ClientConfig::default() };
    let c = GuardClient::with_config(silent.local_addr().unwrap(), Key::from_hex(KEY_HEX).unwrap(), cfg).unwrap();
    let (a, _b) = pair();
    assert_eq!(tos(&a) >> 2, 0);
    assert!(matches!(sdk::establish(&a, &c), Err(Error::Timeout { .. })));
    assert_eq!(tos(&a) >> 2, unbroken_wire::ctl::UNPROTECTED_DSCP, "marked unprotected");
    // A protected connection keeps its TOS.
    let g = TestGuard::start();
    let (a, _b) = pair();
    let (app, peer) = (a.local_addr().unwrap(), a.peer_addr().unwrap());
    g.handshake(app, peer, 5000, 9000, true);
    sdk::establish(&a, &client(&g)).unwrap();
    assert_eq!(tos(&a), 0);
}

/// Issue 21, item 8: once the start-up check has failed (here the guard drops the probe, as a
/// silent wrong address would), `establish` sends nothing and fails at once, marking the socket
/// unprotected. Before, every connection spent the side channel's whole retry budget on a TELL
/// (3.2 s with the default timeouts) before it was closed. A probe that succeeds ends it.
#[test]
fn hostile_establish_after_a_failed_guard_check_sends_nothing() {
    let g = TestGuard::start();
    let cfg = ClientConfig { initial_timeout: Duration::from_millis(20), max_tries: 2, ..ClientConfig::default() };
    let c = GuardClient::with_config(g.addr, Key::from_hex(KEY_HEX).unwrap(), cfg).unwrap();
    let (a, _b) = pair();
    let (app, peer) = (a.local_addr().unwrap(), a.peer_addr().unwrap());
    g.handshake(app, peer, 0x1000, 0x2000, true);
    g.state().drop_requests = 2;
    assert!(matches!(c.probe(app), Err(Error::Timeout { tries: 2 })));
    assert!(matches!(c.failed_check(), Some(Error::Timeout { tries: 2 })));
    let before = c.stats();

    let t0 = std::time::Instant::now();
    match sdk::establish(&a, &c) {
        Err(e @ Error::GuardCheckFailed(_)) => {
            assert!(matches!(&e, Error::GuardCheckFailed(inner) if matches!(**inner, Error::Timeout { tries: 2 })), "{e:?}");
            assert!(e.to_string().contains("nothing answered"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.stats(), before, "no request, no datagram, no retransmission");
    assert!(g.ops().is_empty(), "the guard saw nothing: {:?}", g.ops());
    assert_eq!(tos(&a) >> 2, unbroken_wire::ctl::UNPROTECTED_DSCP, "marked unprotected");
    // A sanity bound only (the counts above are the test): nothing near the retry budget.
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());

    // The guard answers again: a successful probe lifts it, and connections are protected.
    assert!(c.probe(app).is_ok());
    assert!(c.failed_check().is_none());
    let (a2, _b2) = pair();
    let (app2, peer2) = (a2.local_addr().unwrap(), a2.peer_addr().unwrap());
    g.handshake(app2, peer2, 0x3000, 0x4000, true);
    sdk::establish(&a2, &c).unwrap();
    assert_eq!(tos(&a2), 0);
}

/// Issue 21, item 8: a connection the application will not serve, whose input it never read.
/// Closed plainly, the kernel answers with a RST and the peer sees a reset; `decline` sends the
/// FIN at once, so the peer reads the end of the stream, and discards the input until the
/// peer's FIN, so that no RST follows.
#[test]
fn decline_closes_with_a_fin_where_close_would_reset() {
    // Waits until the peer's bytes are in the application's receive queue (unread).
    let queued = |a: &TcpStream| {
        let mut one = [0u8; 1];
        assert_eq!(a.peek(&mut one).unwrap(), 1);
    };
    let (a, mut b) = pair();
    b.write_all(b"a request").unwrap();
    queued(&a);
    drop(a);
    let mut buf = [0u8; 64];
    assert_eq!(b.read(&mut buf).unwrap_err().kind(), ErrorKind::ConnectionReset, "what a plain close does");

    let (a, mut b) = pair();
    b.write_all(b"a request").unwrap();
    queued(&a);
    let app = std::thread::spawn(move || sdk::decline(a, Duration::from_secs(60)));
    assert_eq!(b.read(&mut buf).unwrap(), 0, "the peer reads the end of the stream");
    b.write_all(b" and more").unwrap();
    drop(b); // the peer closes in turn: its FIN ends the lingering
    assert_eq!(app.join().unwrap().unwrap(), 18, "all the peer's input discarded, then its FIN");
}
