//! The connection-level API of RTCP section 4 ("Writing a recoverable application").
//!
//! | moment | call | side-channel command |
//! |---|---|---|
//! | right after `accept` / `connect`, before sending | [`establish`] → persist the [`ConnRecord`] | RTCP_TELL |
//! | [`establish`] failed: the connection is not protected | [`decline`] (or serve it unprotected) | none |
//! | input safely stored or processed | [`acknowledge`] (or [`acknowledge_eof`] after `recv` returned 0) | RTCP_ACKNOWLEDGE |
//! | after the last `send` succeeded, before `close` | [`shutdown`] (or [`shutdown_writing`] / [`shutdown_reading`]) | RTCP_SHUTDOWN(_WRITING/_READING) |
//! | after the connection is fully closed (TIME-WAIT over) | [`clear`] | RTCP_CLEAR |
//! | after a crash or a reset from the guard | [`recover`] → resend journaled output from `delivered_total` | ACKNOWLEDGE, SYN, TELL |
//!
//! # Binding the recovered socket next to a listener
//!
//! [`recover`] reconnects *as a client from the original address and port*, even when the
//! application was the server and that port is its listening port. On Linux (tested for
//! real on loopback by this crate's tests) `bind()` to a port that has a socket in LISTEN
//! state **fails with `EADDRINUSE` unless both sockets have `SO_REUSEPORT`** (and belong to
//! the same effective user); `SO_REUSEADDR` alone is not enough for a listening port. So a
//! server that recovers connections while it listens must create its listener with
//! `SO_REUSEPORT` — [`reuseport_listener`] (C: `ub_listen`) does that — or recover all its
//! connections *before* it starts listening. A non-listening socket bound to the port does not
//! join the listener's reuseport group, so new connections still all go to the listener.
//! `connect` then needs the 4-tuple to be free of live connections: the crashed process's
//! socket is gone (the guard turns its kernel's FIN into a RST, section 2.4.2). A socket the
//! guard reset (the application got `ECONNRESET`, section 2.7) no longer holds the 4-tuple
//! even while its descriptor is open (checked on Linux), but close it anyway.

use crate::client::{GuardClient, Reply};
use crate::error::{status, Error, Result};
use crate::record::{normalize, ConnRecord};
use std::io::{self, Read};
use std::mem::{size_of, zeroed};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};
use unbroken_wire::ctl::ConnOptions;

/// Starts protecting a freshly established connection: reads its endpoints
/// (getsockname/getpeername), sends RTCP_TELL and returns the [`ConnRecord`] the application
/// must persist durably before relying on recovery.
///
/// Call it right after `accept` or `connect`, **before sending or acknowledging anything**:
/// the guard's ackB must still be the peer's acknowledgment of the SYN (`ack_b0`). The
/// guard's reply must have both `RECOVERABLE` and `ACK_ALLOWED`; TELL is repeated
/// ([`ClientConfig::establish_tries`](crate::ClientConfig::establish_tries), with backoff)
/// while it has not, or while the guard does not know the connection yet (a very fast
/// application may ask before the guard processed the handshake's last ACK). Gives up with
/// [`Error::NotRecoverable`] or [`Error::Rejected`]`(`[`status::NO_CONNECTION`]`)`.
///
/// The options stored are read from the socket's `TCP_INFO` (the ground truth of what the
/// kernel negotiated), falling back to the options the guard reports; see
/// [`tcp_info_options`].
///
/// Works with anything that has a socket file descriptor (`std::net::TcpStream`, tokio's
/// `TcpStream`, a `BorrowedFd`).
///
/// When it fails, the connection is not protected, and the guard would still hold back its
/// FIN (section 2.4.2): `establish` then posts an RTCP_SHUTDOWN for it (without waiting: the
/// side channel may be one-way, its TELLs may have arrived while the answers were lost) and
/// marks the socket unprotected ([`unprotect`]) before returning the error, so that whatever
/// the application does next (close it, or use it unprotected) reaches the peer as if there
/// were no guard. Either suffices: the SHUTDOWN makes the application's FIN genuine, the mark
/// releases a connection no protecting command named. The SHUTDOWN carries the ABANDON flag: a
/// guard that restarted before this TELL (it cannot protect the connection, and neither mark nor
/// FIN would pass it) releases the connection and resets the peer at once.
///
/// After a failed start-up check ([`GuardClient::probe`], until a probe succeeds again) it
/// sends nothing: it marks the socket unprotected and fails at once with
/// [`Error::GuardCheckFailed`]. Close such a connection with [`decline`], so that the peer sees
/// the end of the stream rather than a reset.
pub fn establish<S: AsFd>(stream: &S, client: &GuardClient) -> Result<ConnRecord> {
    if let Some(e) = client.failed_check() {
        // No TELL has named the connection: the mark alone releases it at the guard.
        let _ = unprotect(stream);
        return Err(Error::GuardCheckFailed(Box::new(e)));
    }
    let fd = stream.as_fd();
    let (app, peer) = match (sockname(fd, false), sockname(fd, true)) {
        (Ok(a), Ok(p)) => (normalize(a), normalize(p)),
        (Err(e), _) | (_, Err(e)) => {
            let _ = unprotect(stream);
            return Err(e.into());
        }
    };
    let res = establish_inner(&fd, app, peer, client);
    if res.is_err() {
        // ABANDON: a guard that cannot protect the connection either (it restarted before
        // this first TELL) releases it and resets the peer at once (issue 21, item 4).
        let _ = client.post_flags(unbroken_wire::ctl::Op::Shutdown, app, peer, 0, None, unbroken_wire::ctl::flag::ABANDON);
        let _ = unprotect(stream);
    }
    res
}

/// Marks a connection that no authenticated command has named as not protected: its packets
/// carry DSCP [`ctl::UNPROTECTED_DSCP`](unbroken_wire::ctl::UNPROTECTED_DSCP) from now on
/// (`IP_TOS` / `IPV6_TCLASS`), and the guard, seeing that mark on a connection whose handshake
/// it saw and that no application claimed, lets all its packets through untouched: the peer
/// sees the application's close (FIN or RST) as it would without the guard. [`establish`]
/// calls it when it fails; call it yourself if you give up on protecting a connection before
/// `establish` (after `establish` succeeded, use [`shutdown`] instead: the guard ignores the
/// mark on a connection it was told about).
pub fn unprotect<S: AsFd>(stream: &S) -> io::Result<()> {
    let fd = stream.as_fd().as_raw_fd();
    let tos = (unbroken_wire::ctl::UNPROTECTED_DSCP << 2) as libc::c_int;
    let v4 = setsockopt_int(fd, libc::IPPROTO_IP, libc::IP_TOS, tos);
    let v6 = setsockopt_int(fd, libc::IPPROTO_IPV6, libc::IPV6_TCLASS, tos);
    v4.or(v6)
}

fn establish_inner(fd: &BorrowedFd<'_>, app: SocketAddr, peer: SocketAddr, client: &GuardClient) -> Result<ConnRecord> {
    let cfg = client.config();
    let tries = cfg.establish_tries.max(1);
    let mut pause = cfg.establish_backoff;
    let mut last = Error::Rejected(status::NO_CONNECTION);
    for attempt in 0..tries {
        if attempt > 0 {
            std::thread::sleep(pause);
            pause = pause.saturating_mul(2);
        }
        match client.tell(app, peer) {
            Ok(r) if r.recoverable() && r.ack_allowed() => {
                let options = match tcp_info_options(fd) {
                    Ok(Some(o)) => Some(o),
                    _ => r.options,
                };
                return ConnRecord::new(app, peer, r.ack_a, r.ack_b, options);
            }
            Ok(r) => last = Error::NotRecoverable { flags: r.flags },
            Err(Error::Rejected(status::NO_CONNECTION)) => last = Error::Rejected(status::NO_CONNECTION),
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

/// RTCP_ACKNOWLEDGE: `consumed_total` bytes of the peer's input have been safely stored or
/// processed; the guard may let them be acknowledged. Sends ackA = `ack_a0 + consumed_total`
/// (mod 2^32) together with the record's options (so a guard that restarted learns them,
/// section 2.7). The guard keeps the highest checkpoint it was given, so repeating or
/// reordering calls is harmless. Returns the guard's reply.
pub fn acknowledge(rec: &ConnRecord, client: &GuardClient, consumed_total: u64) -> Result<Reply> {
    client.acknowledge(rec.app(), rec.peer(), rec.ack_a(consumed_total), rec.options())
}

/// Like [`acknowledge`], but without waiting for the guard's answer: the application's read
/// loop never stalls on the side channel. Safe on the data path because checkpoints only grow:
/// a lost datagram is superseded by the next one, and the peer keeps (and resends) every byte
/// until a checkpoint covering it arrives. Use the blocking [`acknowledge`] where you must
/// know the guard has the checkpoint (before [`recover`] does that itself, for instance).
pub fn acknowledge_nowait(rec: &ConnRecord, client: &GuardClient, consumed_total: u64) -> Result<()> {
    client.post(unbroken_wire::ctl::Op::Acknowledge, rec.app(), rec.peer(), rec.ack_a(consumed_total), rec.options())
}

/// Like [`acknowledge`], but also covers the peer's FIN (ackA = `ack_a0 + consumed_total +
/// 1`): call it when `recv` returned 0 (end of input) and everything before it is persisted,
/// so the peer's FIN gets acknowledged while the guard still checkpoints. The application must
/// persist that it saw the end of input: after a [`recover`] the FIN is not delivered again
/// (call `acknowledge_eof` again right after recovering, in case the guard had restarted).
pub fn acknowledge_eof(rec: &ConnRecord, client: &GuardClient, consumed_total: u64) -> Result<Reply> {
    client.acknowledge(rec.app(), rec.peer(), rec.ack_a(consumed_total.wrapping_add(1)), rec.options())
}

/// RTCP_SHUTDOWN: call it after the last `send` succeeded and just before `close`; the
/// application's FIN is then genuine and acknowledgments stop being checkpointed. A
/// [`recover`] afterwards returns the guard to its default behavior (send it again when ready).
pub fn shutdown(rec: &ConnRecord, client: &GuardClient) -> Result<Reply> {
    client.shutdown(rec.app(), rec.peer())
}

/// RTCP_SHUTDOWN_WRITING (like `shutdown(SHUT_WR)`): the application will write no more;
/// its FIN is genuine. Send it after the last `send` succeeded, before `shutdown(SHUT_WR)`.
pub fn shutdown_writing(rec: &ConnRecord, client: &GuardClient) -> Result<Reply> {
    client.shutdown_writing(rec.app(), rec.peer())
}

/// RTCP_SHUTDOWN_READING (like `shutdown(SHUT_RD)`): the application expects no more input;
/// the guard stops checkpointing acknowledgments (the peer's FIN and data get acknowledged by
/// the TCP as usual).
pub fn shutdown_reading(rec: &ConnRecord, client: &GuardClient) -> Result<Reply> {
    client.shutdown_reading(rec.app(), rec.peer())
}

/// RTCP_CLEAR: the guard forgets the connection. Only once no packet of it can flow any more
/// (both FINs exchanged and TIME-WAIT over), or the guard would try to recover it.
pub fn clear(rec: &ConnRecord, client: &GuardClient) -> Result<Reply> {
    client.clear(rec.app(), rec.peer())
}

/// ADOPT (unbroken's addition to RTCP's commands): the connections to `app` (the service's
/// address and port) that the guard holds but no application has claimed with a TELL — those
/// whose application died after its kernel completed the handshake (or sent its SYN-ACK: the
/// guard then knows the peer's handshake ACK in advance) but before [`establish`].
/// Each comes back as a [`ConnRecord`] built from the guard's state, which is still the
/// initial one (nothing can have been consumed or sent before `establish`): persist it, then
/// [`recover`] it with `consumed_total = 0` and `sent_total = 0`.
///
/// Call it at start-up, before accepting, and only when this process is the sole owner of
/// `app` (several live workers sharing the port could take each other's fresh connections).
/// Skip peers you already hold a record for: a guard that restarted has forgotten which
/// connections were told about.
pub fn adopt(client: &GuardClient, app: SocketAddr) -> Result<Vec<ConnRecord>> {
    let mut cursor = SocketAddr::new(if app.is_ipv4() { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() }, 0);
    let mut out = Vec::new();
    // Bounded: the guard's table is finite, and each answer moves the cursor forward.
    for _ in 0..(1 << 20) {
        match client.request(unbroken_wire::ctl::Op::Adopt, app, cursor, 0, None) {
            Ok(r) => {
                out.push(ConnRecord::new(app, r.peer, r.ack_a, r.ack_b, r.options)?);
                cursor = r.peer;
            }
            Err(Error::Rejected(status::NO_CONNECTION)) => break,
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// Recovers a connection after the application (or the guard) failed (sections 2.7 and 4):
///
/// 1. RTCP_ACKNOWLEDGE with `ack_a0 + consumed_total` and the record's options, so a guard
///    that restarted learns the checkpoint and the negotiated options;
/// 2. a new socket with `SO_REUSEADDR` and `SO_REUSEPORT` bound to the record's application
///    address **and port** — even if that is the server's listening port (see the [module
///    documentation](self): the listener needs `SO_REUSEPORT` too);
/// 3. `connect` to the peer, bounded by
///    [`ClientConfig::connect_timeout`](crate::ClientConfig::connect_timeout) (the guard
///    answers the SYN itself, with the peer's sequence numbers);
/// 4. RTCP_TELL: the peer's latest acknowledgment gives `delivered_total`, the number of
///    bytes the peer has received, `ackB - ack_b0` (mod 2^32) disambiguated with `sent_total`
///    ([`delivered_total`](crate::delivered_total)).
///
/// Returns the connected stream (blocking, `SO_REUSEPORT` still set) and `delivered_total`
/// (`<= sent_total`). The application then resends its journaled output from byte
/// `delivered_total` on (output determinism, section 2.3.1) and expects input to resume at
/// byte `consumed_total`.
///
/// `consumed_total` is the application's persisted count of input bytes consumed (what it
/// last acknowledged or more); `sent_total` the count of output bytes it wrote to the old
/// socket (journaled before sending).
///
/// [`Error::DeliveredBeyondSent`] with `delivered == sent_total + 1` means the peer
/// acknowledged the application's FIN as well: the connection had finished before the crash
/// (the application died between its FIN being acknowledged and recording that).
pub fn recover(rec: &ConnRecord, client: &GuardClient, consumed_total: u64, sent_total: u64) -> Result<(TcpStream, u64)> {
    // (1) Checkpoint first: a restarted guard must know ackA before any packet of ours; the
    // RECOVERY flag announces the recovery SYN that follows (the guard drops unannounced ones).
    client.acknowledge_recovery(rec.app(), rec.peer(), rec.ack_a(consumed_total), rec.options())?;
    // (2) + (3)
    let stream = connect_retrying(rec.app(), rec.peer(), client.config().connect_timeout)?;
    // (4)
    let reply = client.tell(rec.app(), rec.peer())?;
    if !reply.recoverable() {
        return Err(Error::NotRecoverable { flags: reply.flags });
    }
    let delivered = rec.delivered(reply.ack_b, sent_total)?;
    Ok((stream, delivered))
}

/// Closes a connection the application will not serve — after [`establish`] failed — cleanly,
/// as a server without a guard would: `shutdown(SHUT_WR)` sends the FIN at once (the peer reads
/// the end of the stream), then the peer's input is read and discarded until its FIN, for at
/// most `linger`, and the socket is closed. (A plain `close` with input unread makes the kernel
/// answer with a RST instead of a FIN, and the peer sees a reset.) Blocks until the peer's FIN
/// or `linger`; call it where the connection would have been served (its own thread, say).
///
/// Returns the number of input bytes discarded. [`io::ErrorKind::TimedOut`] if `linger` passed
/// before the peer's FIN: the socket is closed all the same, with a RST if input is still
/// unread. Other errors are the socket's (a reset from the peer, for instance).
pub fn decline(stream: TcpStream, linger: Duration) -> io::Result<u64> {
    stream.shutdown(std::net::Shutdown::Write)?;
    stream.set_nonblocking(false)?;
    let deadline = Instant::now() + linger;
    let mut buf = [0u8; 16 << 10];
    let mut discarded = 0u64;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the peer did not close within the linger time"));
        }
        stream.set_read_timeout(Some(left))?;
        match (&stream).read(&mut buf) {
            Ok(0) => return Ok(discarded),
            Ok(n) => discarded += n as u64,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
            Err(e) => return Err(e),
        }
    }
}

/// A listening socket with `SO_REUSEADDR` and `SO_REUSEPORT`, so that [`recover`] can bind
/// recovered connections to the same port while it listens (see the [module
/// documentation](self)).
pub fn reuseport_listener(addr: SocketAddr, backlog: i32) -> io::Result<TcpListener> {
    let fd = reuse_socket(&addr)?;
    let (ss, len) = to_sockaddr(&addr);
    // SAFETY: ss/len describe a valid sockaddr of len bytes.
    cvt(unsafe { libc::bind(fd.as_raw_fd(), (&ss as *const libc::sockaddr_storage).cast(), len) })?;
    cvt(unsafe { libc::listen(fd.as_raw_fd(), backlog) })?;
    Ok(TcpListener::from(fd))
}

/// `TCP_INFO` bits (`tcpi_options`).
const TCPI_OPT_TIMESTAMPS: u8 = 1;
const TCPI_OPT_SACK: u8 = 2;
const TCPI_OPT_WSCALE: u8 = 4;
/// Bytes of TCP timestamp option the kernel subtracts from the MSS it sends with.
const TS_OPTION_LEN: u32 = 12;

/// The options the kernel negotiated on a connected TCP socket, from `TCP_INFO` (Linux):
/// `tcpi_options` (timestamps, SACK, window scaling), the window scales (`tcpi_snd_wscale`
/// is the peer's, `tcpi_rcv_wscale` the application's; 4-bit fields packed in one byte) and
/// the peer's MSS, estimated as `tcpi_snd_mss` plus the 12 bytes of timestamp option the
/// kernel reserves when timestamps are on. That estimate is `min(peer's announced MSS, path
/// MTU - 40)`: never above what the peer announced, so a guard that uses it in a synthesized
/// SYN-ACK is safe. `Ok(None)` on systems without `TCP_INFO`.
pub fn tcp_info_options<S: AsFd>(sock: &S) -> io::Result<Option<ConnOptions>> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        let mut b = [0u8; 256];
        let mut len = b.len() as libc::socklen_t;
        // SAFETY: the kernel writes at most len bytes into b.
        cvt(unsafe { libc::getsockopt(sock.as_fd().as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_INFO, b.as_mut_ptr().cast(), &mut len) })?;
        if (len as usize) < 20 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "TCP_INFO too short"));
        }
        Ok(Some(options_from_tcp_info(&b[..len as usize])))
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        let _ = sock;
        Ok(None)
    }
}

/// Decodes the start of `struct tcp_info` (at least 20 bytes, native byte order).
fn options_from_tcp_info(b: &[u8]) -> ConnOptions {
    let opts = b[5];
    // `__u8 tcpi_snd_wscale : 4, tcpi_rcv_wscale : 4;` — the first field takes the low bits
    // on little-endian ABIs and the high bits on big-endian ones.
    let (snd_ws, rcv_ws) = if cfg!(target_endian = "little") { (b[6] & 0x0f, b[6] >> 4) } else { (b[6] >> 4, b[6] & 0x0f) };
    let snd_mss = u32::from_ne_bytes(b[16..20].try_into().unwrap());
    let ts = opts & TCPI_OPT_TIMESTAMPS != 0;
    let ws = opts & TCPI_OPT_WSCALE != 0;
    let mss = if snd_mss == 0 { 0 } else { (snd_mss + if ts { TS_OPTION_LEN } else { 0 }).min(0xffff) as u16 };
    ConnOptions {
        peer_mss: mss,
        peer_wscale: ws.then_some(snd_ws.min(14)),
        app_wscale: ws.then_some(rcv_ws.min(14)),
        sack: opts & TCPI_OPT_SACK != 0,
        timestamps: ts,
    }
}

/// A socket of `addr`'s family with close-on-exec, `SO_REUSEADDR` and `SO_REUSEPORT`.
fn reuse_socket(addr: &SocketAddr) -> io::Result<OwnedFd> {
    let family = if addr.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: plain socket(2); the result is owned exactly once below. Close-on-exec set
    // atomically: a fork+exec on another thread between socket() and fcntl() would leak it.
    let raw = cvt(unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) })?;
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let r = fd.as_raw_fd();
    setsockopt_int(r, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    setsockopt_int(r, libc::SOL_SOCKET, libc::SO_REUSEPORT, 1)?;
    Ok(fd)
}

/// Steps (2) and (3) of [`recover`]: bind `local` (with SO_REUSEADDR + SO_REUSEPORT), connect
/// to `remote` within `timeout`, return a blocking stream.
/// [`connect_from`], retried while the kernel still holds the dead incarnation's socket on the
/// same four-tuple (`EADDRNOTAVAIL`: its RST from the guard may still be on the way when the
/// application recovers at once), within `timeout` overall. Measured: 18 of 600 immediate
/// `close()`+`recover()` cycles needed it (docs/benchmarks.md).
fn connect_retrying(local: SocketAddr, remote: SocketAddr, timeout: Duration) -> Result<TcpStream> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_micros(200);
    loop {
        match connect_from(local, remote, deadline.saturating_duration_since(Instant::now())) {
            Err(Error::Io(e)) if e.raw_os_error() == Some(libc::EADDRNOTAVAIL) && Instant::now() + pause < deadline => {
                // A retry delay while the old socket goes away, not a synchronisation.
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            other => return other,
        }
    }
}

pub(crate) fn connect_from(local: SocketAddr, remote: SocketAddr, timeout: Duration) -> Result<TcpStream> {
    if local.is_ipv4() != remote.is_ipv4() {
        return Err(Error::InvalidArgument("application and peer addresses of different families"));
    }
    let fd = reuse_socket(&local)?;
    let r = fd.as_raw_fd();
    let (ss, len) = to_sockaddr(&local);
    // SAFETY: ss/len describe a valid sockaddr.
    cvt(unsafe { libc::bind(r, (&ss as *const libc::sockaddr_storage).cast(), len) })?;
    let flags = cvt(unsafe { libc::fcntl(r, libc::F_GETFL) })?;
    cvt(unsafe { libc::fcntl(r, libc::F_SETFL, flags | libc::O_NONBLOCK) })?;
    let (ss, len) = to_sockaddr(&remote);
    // SAFETY: as above.
    if unsafe { libc::connect(r, (&ss as *const libc::sockaddr_storage).cast(), len) } != 0 {
        let e = io::Error::last_os_error();
        if !matches!(e.raw_os_error(), Some(libc::EINPROGRESS) | Some(libc::EINTR)) {
            return Err(e.into());
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out").into());
            }
            let mut p = libc::pollfd { fd: r, events: libc::POLLOUT, revents: 0 };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
            // SAFETY: one valid pollfd.
            let n = unsafe { libc::poll(&mut p, 1, ms) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e.into());
            }
            if n > 0 {
                break;
            }
        }
        let mut err: libc::c_int = 0;
        let mut elen = size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: err is a c_int of elen bytes.
        cvt(unsafe { libc::getsockopt(r, libc::SOL_SOCKET, libc::SO_ERROR, (&mut err as *mut libc::c_int).cast(), &mut elen) })?;
        if err != 0 {
            return Err(io::Error::from_raw_os_error(err).into());
        }
    }
    cvt(unsafe { libc::fcntl(r, libc::F_SETFL, flags & !libc::O_NONBLOCK) })?;
    Ok(TcpStream::from(fd))
}

fn setsockopt_int(fd: RawFd, level: libc::c_int, name: libc::c_int, v: libc::c_int) -> io::Result<()> {
    // SAFETY: v is a c_int of the given size.
    cvt(unsafe { libc::setsockopt(fd, level, name, (&v as *const libc::c_int).cast(), size_of::<libc::c_int>() as libc::socklen_t) }).map(|_| ())
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// getsockname (peer = false) or getpeername (peer = true).
fn sockname(fd: BorrowedFd<'_>, peer: bool) -> io::Result<SocketAddr> {
    // SAFETY: sockaddr_storage is plain data, all-zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { zeroed() };
    let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let p = (&mut ss as *mut libc::sockaddr_storage).cast();
    // SAFETY: the kernel writes at most len bytes into ss.
    let r = cvt(unsafe { if peer { libc::getpeername(fd.as_raw_fd(), p, &mut len) } else { libc::getsockname(fd.as_raw_fd(), p, &mut len) } });
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if peer && r.as_ref().is_err_and(|e| e.raw_os_error() == Some(libc::ENOTCONN)) {
        // A connection reset before `establish` (e.g. by a guard that restarted before its
        // first TELL) has no peer for getpeername, but SO_PEERNAME still names it, so that
        // `establish` can tell the guard it gives that connection up (ABANDON: the peer is
        // reset instead of hanging; issue 21, item 4).
        // The kernel wants a length no larger than the address: IPv6's, else IPv4's.
        for want in [size_of::<libc::sockaddr_in6>(), size_of::<libc::sockaddr_in>()] {
            len = want as libc::socklen_t;
            // SAFETY: the kernel writes at most len bytes into ss.
            match cvt(unsafe { libc::getsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERNAME, p.cast(), &mut len) }) {
                Ok(_) => return from_sockaddr(&ss, len),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => continue,
                Err(e) => return Err(e),
            }
        }
    }
    r?;
    from_sockaddr(&ss, len)
}

fn to_sockaddr(a: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; it is large and aligned enough for both
    // sockaddr_in and sockaddr_in6.
    let mut ss: libc::sockaddr_storage = unsafe { zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = v4.port().to_be();
            sin.sin_addr = libc::in_addr { s_addr: u32::from_ne_bytes(v4.ip().octets()) };
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = v6.port().to_be();
            sin6.sin6_flowinfo = v6.flowinfo();
            sin6.sin6_addr = libc::in6_addr { s6_addr: v6.ip().octets() };
            sin6.sin6_scope_id = v6.scope_id();
            size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

fn from_sockaddr(ss: &libc::sockaddr_storage, len: libc::socklen_t) -> io::Result<SocketAddr> {
    match ss.ss_family as libc::c_int {
        libc::AF_INET if len as usize >= size_of::<libc::sockaddr_in>() => {
            // SAFETY: family and length say it is a sockaddr_in.
            let sin = unsafe { &*(ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            Ok(SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()), u16::from_be(sin.sin_port))))
        }
        libc::AF_INET6 if len as usize >= size_of::<libc::sockaddr_in6>() => {
            // SAFETY: family and length say it is a sockaddr_in6.
            let sin6 = unsafe { &*(ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            Ok(SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(sin6.sin6_addr.s6_addr), u16::from_be(sin6.sin6_port), sin6.sin6_flowinfo, sin6.sin6_scope_id)))
        }
        _ => Err(io::Error::new(io::ErrorKind::InvalidInput, "not an IPv4 or IPv6 socket")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockaddr_roundtrip() {
        for a in ["10.1.2.3:4567", "[fe80::1%7]:80", "[2001:db8::1]:65535", "0.0.0.0:0"] {
            let a: SocketAddr = a.parse().unwrap();
            let (ss, len) = to_sockaddr(&a);
            assert_eq!(from_sockaddr(&ss, len).unwrap(), a);
        }
    }

    #[test]
    fn tcp_info_decoding() {
        let mut b = [0u8; 24];
        b[5] = TCPI_OPT_TIMESTAMPS | TCPI_OPT_SACK | TCPI_OPT_WSCALE;
        b[6] = if cfg!(target_endian = "little") { 0x97 } else { 0x79 }; // snd 7, rcv 9
        b[16..20].copy_from_slice(&1448u32.to_ne_bytes());
        let o = options_from_tcp_info(&b);
        assert_eq!(o, ConnOptions { peer_mss: 1460, peer_wscale: Some(7), app_wscale: Some(9), sack: true, timestamps: true });
        b[5] = 0;
        let o = options_from_tcp_info(&b);
        assert_eq!(o, ConnOptions { peer_mss: 1448, peer_wscale: None, app_wscale: None, sack: false, timestamps: false });
    }

    #[test]
    fn tcp_info_on_a_real_loopback_connection() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let a = tcp_info_options(&c).unwrap().unwrap();
        let b = tcp_info_options(&s).unwrap().unwrap();
        // Both ends agree on what was negotiated, mirrored.
        assert_eq!((a.sack, a.timestamps), (b.sack, b.timestamps));
        assert_eq!(a.peer_wscale, b.app_wscale);
        assert_eq!(a.app_wscale, b.peer_wscale);
        assert!(a.peer_mss >= 536, "{a:?}");
        let sysctl = |name: &str| std::fs::read_to_string(format!("/proc/sys/net/ipv4/{name}")).ok().map(|s| s.trim() != "0");
        if let Some(ts) = sysctl("tcp_timestamps") {
            assert_eq!(a.timestamps, ts);
        }
        if let Some(sack) = sysctl("tcp_sack") {
            assert_eq!(a.sack, sack);
        }
    }
}
