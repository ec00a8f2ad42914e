//! [`GuardClient`]: the application's end of the authenticated UDP side channel (RTCP
//! sections 2.3 and 3.1, commands C1-C6, wire format [`unbroken_wire::ctl`] v1).

use crate::error::{status, Error, Result};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use unbroken_wire::ctl::{self, Command, ConnOptions, Key, Op};

/// Tunables of a [`GuardClient`] and of the connection-level functions that use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientConfig {
    /// How long to wait for the first answer before retransmitting (default 50 ms). Each
    /// retransmission doubles the wait, up to [`max_timeout`](Self::max_timeout).
    pub initial_timeout: Duration,
    /// Longest wait for one try (default 2 s).
    pub max_timeout: Duration,
    /// Datagrams sent per request before giving up with [`Error::Timeout`] (default 6, i.e.
    /// about 3.2 s in all with the default timeouts). At least 1 is used.
    pub max_tries: u32,
    /// Local address of the UDP socket (default: the unspecified address of the guard's family,
    /// port chosen by the system). Set it when the guard only accepts commands from a given
    /// source address.
    pub bind: Option<SocketAddr>,
    /// [`establish`](crate::establish): how many TELLs to send until the guard reports both
    /// `RECOVERABLE` and `ACK_ALLOWED` (default 6). The guard may not have seen the final
    /// handshake ACK yet when the application is very fast.
    pub establish_tries: u32,
    /// [`establish`](crate::establish): pause before the second TELL, doubled before each
    /// further one (default 5 ms: 5 + 10 + 20 + 40 + 80 ms with the default tries).
    pub establish_backoff: Duration,
    /// [`recover`](crate::recover): how long `connect` may take (default 10 s). The guard
    /// normally answers the recovery SYN at once; a guard that lost its state needs one
    /// round trip to the peer, or the SYN's retransmission after about 1 s.
    pub connect_timeout: Duration,
}

impl Default for ClientConfig {
    fn default() -> ClientConfig {
        ClientConfig {
            initial_timeout: Duration::from_millis(50),
            max_timeout: Duration::from_secs(2),
            max_tries: 6,
            bind: None,
            establish_tries: 6,
            establish_backoff: Duration::from_millis(5),
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// Counters of a [`GuardClient`], for monitoring and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Requests started (one per method call).
    pub requests: u64,
    /// Datagrams sent (first tries and retransmissions).
    pub datagrams_sent: u64,
    /// Datagrams sent because an earlier try got no acceptable answer in time.
    pub retransmissions: u64,
    /// Datagrams received and ignored: wrong size, bad MAC (wrong key), not a response, or
    /// another operation, nonce or connection (e.g. a late answer to an earlier request).
    pub ignored: u64,
    /// Requests that ended in [`Error::Timeout`].
    pub timeouts: u64,
}

/// The guard's answer to a command (C6): its state for the connection after the command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply {
    /// The operation answered.
    pub op: Op,
    /// The connection's peer: the request's, except for ADOPT, which names the connection
    /// it hands over.
    pub peer: SocketAddr,
    /// [`ctl::flag`] bits: `ACK_ALLOWED`, `RECOVERABLE`, `FIN_ALLOWED`, `ACK_EVERYTHING`.
    pub flags: u8,
    /// ackA: the checkpointed acknowledgment, in the peer's sequence space.
    pub ack_a: u32,
    /// ackB: the peer's latest acknowledgment, in the peer's view of the application's
    /// sequence space (meaningful when [`recoverable`](Self::recoverable)).
    pub ack_b: u32,
    /// The negotiated TCP options, if the guard knows them.
    pub options: Option<ConnOptions>,
}

impl Reply {
    /// The guard has seen an ACK from the peer: `ack_b` is meaningful and a recovery SYN can be
    /// answered.
    pub fn recoverable(&self) -> bool {
        self.flags & ctl::flag::RECOVERABLE != 0
    }
    /// The guard knows the checkpointed acknowledgment `ack_a`.
    pub fn ack_allowed(&self) -> bool {
        self.flags & ctl::flag::ACK_ALLOWED != 0
    }
    /// The application announced SHUTDOWN or SHUTDOWN_WRITING: its FINs pass.
    pub fn fin_allowed(&self) -> bool {
        self.flags & ctl::flag::FIN_ALLOWED != 0
    }
    /// The application announced SHUTDOWN or SHUTDOWN_READING: acknowledgments are no longer
    /// checkpointed.
    pub fn ack_everything(&self) -> bool {
        self.flags & ctl::flag::ACK_EVERYTHING != 0
    }
}

/// A client of one guard's side channel: a UDP socket, the guard's address and the shared
/// [`Key`].
///
/// Every request carries a fresh random nonce and the current time (the guard drops commands
/// more than 30 s off its clock and nonces it has seen recently). A request is retransmitted
/// with exponential backoff ([`ClientConfig`]); **each retransmission carries a new nonce**,
/// because the guard refuses a replayed one: if the first datagram arrived and only its
/// answer was lost, resending the same bytes would never be answered. An answer to any of the
/// request's datagrams is accepted. All commands are idempotent at the guard (TELL reads,
/// ACKNOWLEDGE never moves the checkpoint backward, the shutdowns and CLEAR set or clear
/// state), so the guard executing one request twice is harmless.
///
/// A datagram is accepted as the answer only if it authenticates with the key, is a
/// response, and has the request's operation, one of its nonces and the same connection;
/// or if it is a refusal ([`ctl::Nak`]: the guard rejects our key or clock) echoing the
/// request's operation and one of its nonces, which ends the request with
/// [`Error::Refused`]; anything else is counted in [`ClientStats::ignored`] and dropped. The source address of
/// the answer is not checked (the MAC and nonce are the authentication; a guard on a
/// multi-homed host may answer from another address).
///
/// The client is `Send + Sync`; requests from several threads are serialized (one socket,
/// one outstanding request). Use one client per thread for parallel requests.
pub struct GuardClient {
    sock: UdpSocket,
    guard: SocketAddr,
    key: Key,
    config: ClientConfig,
    lock: Mutex<()>,
    requests: AtomicU64,
    sent: AtomicU64,
    retransmissions: AtomicU64,
    ignored: AtomicU64,
    timeouts: AtomicU64,
    /// The error of the last probe, if it failed ([`GuardClient::failed_check`]).
    failed_check: Mutex<Option<Error>>,
}

impl core::fmt::Debug for GuardClient {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("GuardClient")
            .field("guard", &self.guard)
            .field("local", &self.sock.local_addr().ok())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Largest datagram read; anything but exactly [`ctl::LEN`] bytes is ignored.
const RECV_BUF: usize = 512;

impl GuardClient {
    /// A client for the guard at `guard` with the default [`ClientConfig`].
    pub fn new(guard: SocketAddr, key: Key) -> Result<GuardClient> {
        GuardClient::with_config(guard, key, ClientConfig::default())
    }

    /// Parses `guard` (`"ip:port"`, IPv6 as `"[addr]:port"`) and `key_hex` (at least 32 hex
    /// digits), then [`new`](Self::new).
    pub fn from_strs(guard: &str, key_hex: &str) -> Result<GuardClient> {
        let guard: SocketAddr = guard.trim().parse().map_err(|_| Error::InvalidArgument("guard address is not ip:port"))?;
        let key = Key::from_hex(key_hex).map_err(|_| Error::InvalidArgument("key is not at least 32 hex digits"))?;
        GuardClient::new(guard, key)
    }

    /// A client with explicit tunables.
    pub fn with_config(guard: SocketAddr, key: Key, config: ClientConfig) -> Result<GuardClient> {
        let local = config.bind.unwrap_or(match guard {
            SocketAddr::V4(_) => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
            SocketAddr::V6(_) => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
        });
        let sock = UdpSocket::bind(local)?;
        Ok(GuardClient {
            sock,
            guard,
            key,
            config,
            lock: Mutex::new(()),
            requests: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            retransmissions: AtomicU64::new(0),
            ignored: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            failed_check: Mutex::new(None),
        })
    }

    /// The guard's side-channel address.
    pub fn guard_addr(&self) -> SocketAddr {
        self.guard
    }

    /// The local address of the client's UDP socket.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.sock.local_addr()?)
    }

    /// The tunables in force.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// Changes the tunables (except [`ClientConfig::bind`], which only matters at creation).
    pub fn set_config(&mut self, config: ClientConfig) {
        self.config = config;
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ClientStats {
        ClientStats {
            requests: self.requests.load(Relaxed),
            datagrams_sent: self.sent.load(Relaxed),
            retransmissions: self.retransmissions.load(Relaxed),
            ignored: self.ignored.load(Relaxed),
            timeouts: self.timeouts.load(Relaxed),
        }
    }

    /// Checks, before any connection, that a guard answers at the configured address, accepts
    /// this client's key and clock, and protects `service` (the application's listening
    /// address and port): a TELL for a connection that cannot exist (peer = the unspecified
    /// address, port 0), which a working guard answers with "no such connection". Errors:
    /// [`Error::Refused`] (wrong key or clock), [`Error::Timeout`] (nothing answers at that
    /// address, or the guard does not accept our source address),
    /// [`Error::Rejected`]`(`[`status::BAD_REQUEST`]`)` (the guard does not protect `service`).
    ///
    /// The client remembers the outcome: after a failed probe, [`establish`](crate::establish)
    /// gives up at once, without a datagram, with [`Error::GuardCheckFailed`] (instead of
    /// spending the whole retry budget, about 3.2 s with the defaults, on every connection
    /// while it is misconfigured), until a probe succeeds again. An application that wants to
    /// notice a guard that appears later probes again (periodically, say).
    pub fn probe(&self, service: SocketAddr) -> Result<()> {
        let nobody = SocketAddr::new(if service.is_ipv4() { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() }, 0);
        let res = match self.tell(service, nobody) {
            Ok(_) | Err(Error::Rejected(status::NO_CONNECTION)) => Ok(()),
            Err(e) => Err(e),
        };
        *self.failed_check.lock().unwrap_or_else(|e| e.into_inner()) = res.as_ref().err().map(Error::copy);
        res
    }

    /// The error of the last [`probe`](Self::probe) if it failed; `None` if it succeeded or
    /// none was made. While it is `Some`, [`establish`](crate::establish) sends nothing and
    /// fails at once with [`Error::GuardCheckFailed`].
    pub fn failed_check(&self) -> Option<Error> {
        self.failed_check.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(Error::copy)
    }

    /// C1, RTCP_TELL: asks for the guard's state of connection `app` <-> `peer`, notably ackB.
    /// An unknown connection is [`Error::Rejected`]`(`[`status::NO_CONNECTION`]`)`.
    pub fn tell(&self, app: SocketAddr, peer: SocketAddr) -> Result<Reply> {
        self.request(Op::Tell, app, peer, 0, None)
    }

    /// C2, RTCP_ACKNOWLEDGE: the application has safely consumed the peer's bytes up to (not
    /// including) sequence number `ack_a`; the guard lets *A*'s TCP acknowledge that far and
    /// sends the peer a fresh ACK. `options` teach a restarted guard the connection's
    /// negotiated options (ignored by a guard that knows them).
    pub fn acknowledge(&self, app: SocketAddr, peer: SocketAddr, ack_a: u32, options: Option<ConnOptions>) -> Result<Reply> {
        self.request(Op::Acknowledge, app, peer, ack_a, options)
    }

    /// ACKNOWLEDGE that begins a recovery ([`crate::recover`]'s first step): the guard then
    /// answers the recovery SYN that follows (for 15 s, or until the TELL), and drops any SYN
    /// for the connection that no such announcement preceded.
    pub fn acknowledge_recovery(&self, app: SocketAddr, peer: SocketAddr, ack_a: u32, options: Option<ConnOptions>) -> Result<Reply> {
        self.request_flags(Op::Acknowledge, app, peer, ack_a, options, unbroken_wire::ctl::flag::RECOVERY)
    }

    /// C3 + C4, RTCP_SHUTDOWN: the application is about to close; its FIN is genuine and
    /// acknowledgments are no longer checkpointed.
    pub fn shutdown(&self, app: SocketAddr, peer: SocketAddr) -> Result<Reply> {
        self.request(Op::Shutdown, app, peer, 0, None)
    }

    /// C4, RTCP_SHUTDOWN_READING: the application expects no more input; the guard stops
    /// checkpointing acknowledgments (letting *A*'s TCP acknowledge the peer's FIN).
    pub fn shutdown_reading(&self, app: SocketAddr, peer: SocketAddr) -> Result<Reply> {
        self.request(Op::ShutdownReading, app, peer, 0, None)
    }

    /// C3, RTCP_SHUTDOWN_WRITING: the application will write no more; its FIN is genuine.
    pub fn shutdown_writing(&self, app: SocketAddr, peer: SocketAddr) -> Result<Reply> {
        self.request(Op::ShutdownWriting, app, peer, 0, None)
    }

    /// C5, RTCP_CLEAR: the guard forgets the connection. Send it only when no more packets of
    /// the connection will flow (after TIME-WAIT), or the guard will try to recover it.
    pub fn clear(&self, app: SocketAddr, peer: SocketAddr) -> Result<Reply> {
        self.request(Op::Clear, app, peer, 0, None)
    }

    /// Any command: sends it, retransmits on timeout, and returns the first acceptable answer.
    /// A non-zero status is [`Error::Rejected`].
    pub fn request(&self, op: Op, app: SocketAddr, peer: SocketAddr, ack_a: u32, options: Option<ConnOptions>) -> Result<Reply> {
        self.request_flags(op, app, peer, ack_a, options, 0)
    }

    /// [`request`](Self::request) with request flags (`ctl::flag::RECOVERY`).
    pub fn request_flags(&self, op: Op, app: SocketAddr, peer: SocketAddr, ack_a: u32, options: Option<ConnOptions>, flags: u8) -> Result<Reply> {
        if app.is_ipv4() != peer.is_ipv4() {
            return Err(Error::InvalidArgument("application and peer addresses of different families"));
        }
        let _one_at_a_time = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.requests.fetch_add(1, Relaxed);
        let tries = self.config.max_tries.max(1);
        let mut nonces: Vec<u64> = Vec::with_capacity(tries as usize);
        let mut wait = self.config.initial_timeout.max(Duration::from_millis(1));
        let mut buf = [0u8; RECV_BUF];
        for attempt in 0..tries {
            let nonce = random_u64()?;
            nonces.push(nonce);
            let mut cmd = Command::request(op, app, peer, nonce, now_ms());
            cmd.ack_a = ack_a;
            cmd.options = options;
            cmd.flags = flags;
            let bytes = cmd.encode(&self.key)?;
            if attempt > 0 {
                self.retransmissions.fetch_add(1, Relaxed);
            }
            self.sent.fetch_add(1, Relaxed);
            if let Err(e) = self.sock.send_to(&bytes, self.guard) {
                // A transiently unreachable guard is like a lost datagram; anything else is
                // a real error.
                if !transient(&e) {
                    return Err(e.into());
                }
            }
            let deadline = Instant::now() + wait;
            loop {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                self.sock.set_read_timeout(Some(deadline - now))?;
                match self.sock.recv_from(&mut buf) {
                    Ok((n, _from)) if n == ctl::NAK_LEN => match ctl::Nak::decode(&buf[..n]) {
                        Ok(nak) if nak.op == op as u8 && nonces.contains(&nak.nonce) => return Err(Error::Refused { reason: nak.refusal }),
                        _ => {
                            self.ignored.fetch_add(1, Relaxed);
                        }
                    },
                    Ok((n, _from)) => match self.accept(&buf[..n], &cmd, &nonces) {
                        Some(reply) if reply.status == status::OK => {
                            return Ok(Reply { op: reply.op, peer: reply.peer, flags: reply.flags, ack_a: reply.ack_a, ack_b: reply.ack_b, options: reply.options })
                        }
                        Some(reply) => return Err(Error::Rejected(reply.status)),
                        None => {
                            self.ignored.fetch_add(1, Relaxed);
                        }
                    },
                    Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted || transient(&e) => continue,
                    Err(e) => return Err(e.into()),
                }
            }
            wait = (wait * 2).min(self.config.max_timeout.max(wait));
        }
        self.timeouts.fetch_add(1, Relaxed);
        Err(Error::Timeout { tries })
    }

    /// The response to `req` if `dgram` is one (authenticated, response, same op, one of the
    /// request's nonces, same connection).
    /// Sends a command once and returns without waiting for the guard's answer (which a later
    /// request skips as `ignored`). For commands whose loss is harmless because a later one
    /// supersedes it: an ACKNOWLEDGE on the data path ([`crate::acknowledge_nowait`]). Answers
    /// to earlier posts still queued on the socket are discarded first, so they cannot pile up.
    pub fn post(&self, op: Op, app: SocketAddr, peer: SocketAddr, ack_a: u32, options: Option<ConnOptions>) -> Result<()> {
        self.post_flags(op, app, peer, ack_a, options, 0)
    }

    /// [`post`](Self::post) with request flags (`ctl::flag::ABANDON`).
    pub fn post_flags(&self, op: Op, app: SocketAddr, peer: SocketAddr, ack_a: u32, options: Option<ConnOptions>, flags: u8) -> Result<()> {
        if app.is_ipv4() != peer.is_ipv4() {
            return Err(Error::InvalidArgument("application and peer addresses of different families"));
        }
        let _one_at_a_time = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut buf = [0u8; RECV_BUF];
        self.sock.set_nonblocking(true)?;
        while self.sock.recv_from(&mut buf).is_ok() {
            self.ignored.fetch_add(1, Relaxed);
        }
        self.sock.set_nonblocking(false)?;
        let mut cmd = Command::request(op, app, peer, random_u64()?, now_ms());
        cmd.ack_a = ack_a;
        cmd.options = options;
        cmd.flags = flags;
        let bytes = cmd.encode(&self.key)?;
        self.sent.fetch_add(1, Relaxed);
        match self.sock.send_to(&bytes, self.guard) {
            Err(e) if !transient(&e) => Err(e.into()),
            _ => Ok(()),
        }
    }

    fn accept(&self, dgram: &[u8], req: &Command, nonces: &[u64]) -> Option<Command> {
        let c = Command::decode(dgram, &self.key).ok()?;
        let same = |a: SocketAddr, b: SocketAddr| a.ip() == b.ip() && a.port() == b.port();
        // ADOPT answers with another connection's peer (the one handed over).
        let peer_ok = req.op == Op::Adopt || same(c.peer, req.peer);
        (c.response && c.op == req.op && nonces.contains(&c.nonce) && same(c.app, req.app) && peer_ok).then_some(c)
    }
}

/// Errors a UDP socket may report because of an earlier ICMP error; not fatal for a request.
fn transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ECONNREFUSED) | Some(libc::EHOSTUNREACH) | Some(libc::ENETUNREACH) | Some(libc::EAGAIN) | Some(libc::ENOBUFS)
    )
}

/// Milliseconds since the Unix epoch (the command's `time_ms`).
fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// 8 bytes from the kernel's CSPRNG (getrandom(2), else /dev/urandom).
pub(crate) fn random_u64() -> io::Result<u64> {
    let mut b = [0u8; 8];
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        let mut got = 0;
        while got < b.len() {
            // SAFETY: writes at most b.len() - got bytes into b[got..].
            let r = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), b.len() - got, 0) };
            if r < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::ENOSYS) => return urandom(),
                    _ => return Err(e),
                }
            }
            got += r as usize;
        }
        Ok(u64::from_ne_bytes(b))
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        let _ = &mut b;
        urandom()
    }
}

fn urandom() -> io::Result<u64> {
    use std::io::Read;
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(u64::from_ne_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonces_differ() {
        let a = random_u64().unwrap();
        let b = random_u64().unwrap();
        assert_ne!(a, b);
        assert_ne!(urandom().unwrap(), urandom().unwrap());
    }

    #[test]
    fn from_strs_validates() {
        assert!(matches!(GuardClient::from_strs("nonsense", "00112233445566778899aabbccddeeff"), Err(Error::InvalidArgument(_))));
        assert!(matches!(GuardClient::from_strs("127.0.0.1:9", "0011"), Err(Error::InvalidArgument(_))));
        let c = GuardClient::from_strs("127.0.0.1:9", "00112233445566778899aabbccddeeff").unwrap();
        assert_eq!(c.guard_addr(), "127.0.0.1:9".parse().unwrap());
        assert!(format!("{c:?}").contains("127.0.0.1:9"));
        assert!(!format!("{c:?}").contains("0011"));
    }

    #[test]
    fn mixed_families_refused_before_sending() {
        let c = GuardClient::from_strs("127.0.0.1:9", "00112233445566778899aabbccddeeff").unwrap();
        let r = c.tell("127.0.0.1:1".parse().unwrap(), "[::1]:2".parse().unwrap());
        assert!(matches!(r, Err(Error::InvalidArgument(_))));
        assert_eq!(c.stats().datagrams_sent, 0);
    }
}
