//! Looking up one local TCP socket by its address pair through `NETLINK_SOCK_DIAG`
//! (`inet_diag`, what `ss` uses), without spawning a process: a few microseconds per lookup.
//!
//! The request is an `inet_diag_req_v2` (`include/uapi/linux/inet_diag.h`): family, protocol,
//! extensions, pad, the state mask, then an `inet_diag_sockid` (source port, destination port,
//! both big endian; source and destination address, 16 bytes each; interface; cookie, which
//! must be `INET_DIAG_NOCOOKIE` for a lookup by address). Without `NLM_F_DUMP` the kernel
//! answers one `inet_diag_msg` (family, state, timer, retrans, the sockid, expires, rqueue,
//! wqueue, uid, inode) or an `NLMSG_ERROR` (`ENOENT`: no such socket). Asked for the
//! `INET_DIAG_INFO` extension, a full socket's answer carries its `struct tcp_info` as an
//! attribute after the message: [`SockInfo::progress`].

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::netlink::{NLMSG_ERROR, NLMSG_HDRLEN, NLM_F_REQUEST};

const NETLINK_SOCK_DIAG: libc::c_int = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `TCP_ESTABLISHED` and `TCP_CLOSE_WAIT` (`include/net/tcp_states.h`).
pub const TCP_ESTABLISHED: u8 = 1;
pub const TCP_CLOSE_WAIT: u8 = 8;
/// A request socket: the server answered the SYN, the client's ACK has not arrived.
pub const TCP_SYN_RECV: u8 = 3;
/// A request socket as newer kernels report it.
pub const TCP_NEW_SYN_RECV: u8 = 12;
const TCP_LISTEN: u8 = 10;
const REQ_LEN: usize = 56;
const MSG_LEN: usize = 72;
/// `INET_DIAG_INFO` (`include/uapi/linux/inet_diag.h`): the attribute holding `tcp_info`.
const INET_DIAG_INFO: u16 = 2;
/// `INET_DIAG_SKMEMINFO`: the socket's memory (`u32[SK_MEMINFO_VARS]`,
/// `include/uapi/linux/sock_diag.h`), of which `SK_MEMINFO_SNDBUF` and `SK_MEMINFO_WMEM_QUEUED`.
const INET_DIAG_SKMEMINFO: u16 = 7;
const SK_MEMINFO_SNDBUF: usize = 3;
const SK_MEMINFO_WMEM_QUEUED: usize = 5;
/// Offsets in `struct tcp_info` (`include/uapi/linux/tcp.h`) of `tcpi_bytes_acked` and
/// `tcpi_bytes_received` (both `__u64`, since Linux 4.1/4.2).
const TCPI_BYTES_ACKED: usize = 120;
const TCPI_BYTES_RECEIVED: usize = 128;

/// How far a connection has gone, as its socket counts it (`tcp_info`): bytes of this side's
/// stream the peer acknowledged (`tcpi_bytes_acked`: `snd_una - iss - 1`, a FIN counted as
/// one) and bytes received in order from the peer (`tcpi_bytes_received`: `rcv_nxt - irs -
/// 1`, a FIN counted as one). No packet on the wire can change what the kernel says here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub bytes_acked: u64,
    pub bytes_received: u64,
}

/// What the kernel says about a socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SockInfo {
    /// TCP state (`TCP_ESTABLISHED` = 1, ...).
    pub state: u8,
    /// Inode of the socket; 0 for an orphan (closed by its process, still in the kernel).
    pub inode: u32,
    /// Its progress, when asked for ([`SockDiag::lookup_progress`]) and the socket is a full
    /// one (a request socket has no `tcp_info`).
    pub progress: Option<Progress>,
}

impl SockInfo {
    /// An open socket a process owns that still receives: established, or the peer closed
    /// its side (close-wait). An orphan (its process closed it, or died) is not.
    pub fn owned_and_receiving(&self) -> bool {
        self.inode != 0 && matches!(self.state, TCP_ESTABLISHED | TCP_CLOSE_WAIT)
    }

    /// A socket the local server will serve the connection with: an owned one that still
    /// receives, one waiting in its listener's accept queue (no process yet: inode 0), or a
    /// request socket whose handshake the client's next packet completes. An orphan (closing:
    /// FIN-WAIT, LAST-ACK, CLOSING, TIME-WAIT) is not.
    pub fn serves_connection(&self) -> bool {
        matches!(self.state, TCP_ESTABLISHED | TCP_CLOSE_WAIT | TCP_SYN_RECV | TCP_NEW_SYN_RECV)
    }
}

fn addr_bytes(ip: IpAddr) -> (u8, [u8; 16]) {
    let mut b = [0u8; 16];
    match ip {
        IpAddr::V4(a) => {
            b[..4].copy_from_slice(&a.octets());
            (libc::AF_INET as u8, b)
        }
        IpAddr::V6(a) => match a.to_ipv4_mapped() {
            Some(v4) => addr_bytes(IpAddr::V4(v4)),
            None => (libc::AF_INET6 as u8, a.octets()),
        },
    }
}

/// The request message for the socket `local` <-> `remote` (any state).
pub fn request(local: SocketAddr, remote: SocketAddr, seq: u32) -> Option<Vec<u8>> {
    request_ext(local, remote, seq, false)
}

/// [`request`], asking for `tcp_info` too when `info`.
fn request_ext(local: SocketAddr, remote: SocketAddr, seq: u32, info: bool) -> Option<Vec<u8>> {
    let (fam, src) = addr_bytes(local.ip());
    let (fam2, dst) = addr_bytes(remote.ip());
    if fam != fam2 {
        return None;
    }
    let len = NLMSG_HDRLEN + REQ_LEN;
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(len as u32).to_ne_bytes());
    m.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    m.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    let ext = if info { 1u8 << (INET_DIAG_INFO - 1) } else { 0 };
    m.extend_from_slice(&[fam, libc::IPPROTO_TCP as u8, ext, 0]);
    m.extend_from_slice(&u32::MAX.to_ne_bytes()); // every state
    m.extend_from_slice(&local.port().to_be_bytes());
    m.extend_from_slice(&remote.port().to_be_bytes());
    m.extend_from_slice(&src);
    m.extend_from_slice(&dst);
    m.extend_from_slice(&0u32.to_ne_bytes()); // interface
    m.extend_from_slice(&[0xff; 8]); // INET_DIAG_NOCOOKIE
    debug_assert_eq!(m.len(), len);
    Some(m)
}

/// The kernel's answer to request `seq` in `buf`: `Some(Some(body))` of its socket message,
/// `Some(None)` for no socket (`ENOENT`), `None` when `buf` holds no answer to it.
fn answer(buf: &[u8], seq: u32) -> io::Result<Option<Option<&[u8]>>> {
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "sock_diag: malformed reply");
    let mut at = 0;
    while at + NLMSG_HDRLEN <= buf.len() {
        let h = &buf[at..];
        let len = u32::from_ne_bytes([h[0], h[1], h[2], h[3]]) as usize;
        let ty = u16::from_ne_bytes([h[4], h[5]]);
        let s = u32::from_ne_bytes([h[8], h[9], h[10], h[11]]);
        if len < NLMSG_HDRLEN || at + len > buf.len() {
            return Err(bad());
        }
        let body = &h[NLMSG_HDRLEN..len];
        if s == seq {
            if ty == NLMSG_ERROR {
                let e = body.get(..4).map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]])).ok_or_else(bad)?;
                return match -e {
                    0 | libc::ENOENT => Ok(Some(None)),
                    e => Err(io::Error::from_raw_os_error(e)),
                };
            }
            if ty == SOCK_DIAG_BY_FAMILY {
                return Ok(Some(Some(body)));
            }
        }
        at += (len + 3) & !3;
    }
    Ok(None)
}

/// Parses the kernel's answer: `Ok(Some)` for a socket, `Ok(None)` for `ENOENT`.
pub fn parse_reply(buf: &[u8], seq: u32) -> io::Result<Option<SockInfo>> {
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "sock_diag: malformed reply");
    let Some(found) = answer(buf, seq)? else { return Err(bad()) };
    let Some(body) = found else { return Ok(None) };
    if body.len() < MSG_LEN {
        return Err(bad());
    }
    let inode = u32::from_ne_bytes([body[68], body[69], body[70], body[71]]);
    // The kernel's lookup falls back to a listener: not this pair's socket.
    if body[1] == TCP_LISTEN {
        return Ok(None);
    }
    Ok(Some(SockInfo { state: body[1], inode, progress: progress(&body[MSG_LEN..]) }))
}

/// The state and inode of the socket in the kernel's answer to request `seq`:
/// `Some(Some((state, inode)))`, or `Some(None)` for no socket (`ENOENT`); `None` when the
/// message answers another request.
fn reply_state(buf: &[u8], seq: u32) -> io::Result<Option<Option<(u8, u32)>>> {
    match answer(buf, seq)? {
        Some(Some(body)) if body.len() >= MSG_LEN => Ok(Some(Some((
            body[1],
            u32::from_ne_bytes([body[68], body[69], body[70], body[71]]),
        )))),
        Some(Some(_)) => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "sock_diag: malformed reply",
        )),
        Some(None) => Ok(Some(None)),
        None => Ok(None),
    }
}

/// The payload of attribute `want` among `attrs` (netlink attributes: length, type, payload,
/// padded to 4 bytes), if present.
fn attribute(mut attrs: &[u8], want: u16) -> Option<&[u8]> {
    while attrs.len() >= 4 {
        let len = u16::from_ne_bytes([attrs[0], attrs[1]]) as usize;
        let ty = u16::from_ne_bytes([attrs[2], attrs[3]]);
        if len < 4 || len > attrs.len() {
            return None;
        }
        if ty == want {
            return Some(&attrs[4..len]);
        }
        attrs = attrs.get((len + 3) & !3..).unwrap_or(&[]);
    }
    None
}

/// The `INET_DIAG_INFO` attribute's counts, if present and long enough.
fn progress(attrs: &[u8]) -> Option<Progress> {
    let info = attribute(attrs, INET_DIAG_INFO)?;
    let at = |o: usize| info.get(o..o + 8).map(|b| u64::from_ne_bytes(b.try_into().unwrap()));
    Some(Progress { bytes_acked: at(TCPI_BYTES_ACKED)?, bytes_received: at(TCPI_BYTES_RECEIVED)? })
}

/// The `INET_DIAG_SKMEMINFO` attribute's queued output memory and send buffer size.
fn send_buffer(attrs: &[u8]) -> Option<(u32, u32)> {
    let m = attribute(attrs, INET_DIAG_SKMEMINFO)?;
    let at = |i: usize| m.get(i * 4..i * 4 + 4).map(|b| u32::from_ne_bytes(b.try_into().unwrap()));
    Some((at(SK_MEMINFO_WMEM_QUEUED)?, at(SK_MEMINFO_SNDBUF)?))
}

/// One socket's receive side (issue 20, a hung server): the bytes the kernel holds that its
/// process has not read (`idiag_rqueue`: `rcv_nxt - copied_seq` for an established socket)
/// and every byte received in order so far (`tcpi_bytes_received`, 0 without `tcp_info`).
/// `received - unread` is what the process consumed. And its send buffer: the memory its
/// queued output takes (`sk_wmem_queued`) and the buffer's size (`sk_sndbuf`), both 0 when the
/// kernel did not say: the socket is not writable while the first is above two thirds of the
/// second (`sk_stream_is_writeable`), so a process that writes to it waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvQueue {
    /// The kernel's socket cookie: one socket's name for as long as it lives.
    pub cookie: u64,
    /// Its addresses (an IPv4-mapped IPv6 address as IPv4).
    pub local: SocketAddr,
    pub remote: SocketAddr,
    pub unread: u32,
    pub received: u64,
    pub send_queued: u32,
    pub send_buf: u32,
}

/// The states [`SockDiag::receive_queues`] reports: established and close-wait (the peer
/// closed its side; the process may still have input to read).
const QUEUE_STATES: u32 = (1 << TCP_ESTABLISHED) | (1 << TCP_CLOSE_WAIT);
/// `NLMSG_DONE`: the end of a dump.
const NLMSG_DONE: u16 = 3;
/// `NLM_F_DUMP` (`NLM_F_ROOT | NLM_F_MATCH`).
const NLM_F_DUMP: u16 = 0x300;

/// The dump request for every TCP socket of `family` in [`QUEUE_STATES`], with `tcp_info`.
fn dump_request(family: u8, seq: u32) -> Vec<u8> {
    let len = NLMSG_HDRLEN + REQ_LEN;
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(len as u32).to_ne_bytes());
    m.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    m.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.extend_from_slice(&[
        family,
        libc::IPPROTO_TCP as u8,
        (1u8 << (INET_DIAG_INFO - 1)) | (1u8 << (INET_DIAG_SKMEMINFO - 1)),
        0,
    ]);
    m.extend_from_slice(&QUEUE_STATES.to_ne_bytes());
    m.resize(len, 0); // the socket id: unused by a dump without a filter
    m
}

/// Adds the sockets with local port `port` of one buffer of dump `seq` to `out`; `Ok(true)`
/// once the dump's end (`NLMSG_DONE`) was in it. Messages of other requests are skipped.
fn parse_dump(buf: &[u8], seq: u32, port: u16, out: &mut Vec<RecvQueue>) -> io::Result<bool> {
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "sock_diag: malformed dump");
    for m in crate::netlink::messages(buf) {
        let m = m.map_err(|_| bad())?;
        let (ty, body) = (m.ty, m.payload);
        if m.seq != seq {
            continue;
        }
        match ty {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => {
                let e = body
                    .get(..4)
                    .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                    .ok_or_else(bad)?;
                return Err(io::Error::from_raw_os_error(-e));
            }
            SOCK_DIAG_BY_FAMILY => {
                if body.len() < MSG_LEN {
                    return Err(bad());
                }
                if u16::from_be_bytes([body[4], body[5]]) != port {
                    continue;
                }
                let cookie = u64::from_ne_bytes(body[44..52].try_into().unwrap());
                let unread = u32::from_ne_bytes([body[56], body[57], body[58], body[59]]);
                let received = progress(&body[MSG_LEN..]).map_or(0, |p| p.bytes_received);
                let (send_queued, send_buf) = send_buffer(&body[MSG_LEN..]).unwrap_or((0, 0));
                let ip = |b: &[u8]| -> IpAddr {
                    if body[0] == libc::AF_INET as u8 {
                        IpAddr::from([b[0], b[1], b[2], b[3]])
                    } else {
                        let v6 = std::net::Ipv6Addr::from(<[u8; 16]>::try_from(&b[..16]).unwrap());
                        v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
                    }
                };
                let local = SocketAddr::new(ip(&body[8..24]), port);
                let remote = SocketAddr::new(ip(&body[24..40]), u16::from_be_bytes([body[6], body[7]]));
                out.push(RecvQueue { cookie, local, remote, unread, received, send_queued, send_buf });
            }
            _ => {}
        }
    }
    Ok(false)
}

/// A `NETLINK_SOCK_DIAG` socket for repeated lookups.
pub struct SockDiag {
    fd: OwnedFd,
    seq: u32,
}

impl SockDiag {
    /// Opens the socket (in the calling thread's network namespace).
    pub fn open() -> io::Result<SockDiag> {
        // SAFETY: plain system call; the fd is owned below.
        let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, NETLINK_SOCK_DIAG) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let tv = libc::timeval { tv_sec: 0, tv_usec: 200_000 };
        // SAFETY: a valid timeval for SO_RCVTIMEO.
        unsafe {
            libc::setsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVTIMEO, &tv as *const _ as *const libc::c_void, std::mem::size_of::<libc::timeval>() as u32);
        }
        Ok(SockDiag { fd, seq: 0 })
    }

    /// The local TCP socket whose local address is `local` and peer `remote`, if any (a
    /// listener on `local` is not reported).
    pub fn lookup(&mut self, local: SocketAddr, remote: SocketAddr) -> io::Result<Option<SockInfo>> {
        self.ask(local, remote, false)
    }

    /// [`SockDiag::lookup`] with the socket's [`Progress`] (`None` in it for a request socket).
    pub fn lookup_progress(&mut self, local: SocketAddr, remote: SocketAddr) -> io::Result<Option<SockInfo>> {
        self.ask(local, remote, true)
    }

    /// Whether a TCP socket listens on `local` (its address or the wildcard): the kernel's
    /// exact lookup with no peer falls back to the listener. A server whose process died, or
    /// that closed its listener, has none.
    pub fn listening(&mut self, local: SocketAddr) -> io::Result<bool> {
        Ok(self.listener_inode(local)?.is_some())
    }

    /// The inode of the TCP socket listening on `local` (its address or the wildcard), if
    /// any: what names the server's processes in `/proc/PID/fd` ([`crate::procfs`]).
    pub fn listener_inode(&mut self, local: SocketAddr) -> io::Result<Option<u32>> {
        let unspecified: IpAddr = match local.ip() {
            IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        };
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let Some(req) = request_ext(local, SocketAddr::new(unspecified, 0), seq, false) else {
            return Ok(None);
        };
        self.send(&req)?;
        let mut buf = [0u8; 8192];
        loop {
            // SAFETY: a valid buffer.
            let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            match reply_state(&buf[..n as usize], seq)? {
                Some(Some((TCP_LISTEN, inode))) => return Ok(Some(inode)),
                Some(_) => return Ok(None),
                None => continue, // an answer to an earlier request
            }
        }
    }

    /// Every established or close-wait TCP socket (IPv4 and IPv6) whose local port is `port`,
    /// with its [`RecvQueue`]: one dump per family, of the sockets in these states only (the
    /// port is matched here, not by the kernel). A dump costs about 400 bytes per socket.
    pub fn receive_queues(&mut self, port: u16) -> io::Result<Vec<RecvQueue>> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 32 << 10];
        for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
            self.seq = self.seq.wrapping_add(1);
            let seq = self.seq;
            self.send(&dump_request(family, seq))?;
            loop {
                // SAFETY: a valid buffer.
                let n = unsafe {
                    libc::recv(
                        self.fd.as_raw_fd(),
                        buf.as_mut_ptr() as *mut libc::c_void,
                        buf.len(),
                        0,
                    )
                };
                if n < 0 {
                    return Err(io::Error::last_os_error());
                }
                if parse_dump(&buf[..n as usize], seq, port, &mut out)? {
                    break;
                }
            }
        }
        Ok(out)
    }

    fn send(&mut self, req: &[u8]) -> io::Result<()> {
        let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        sa.nl_family = libc::AF_NETLINK as u16;
        // SAFETY: a valid buffer and address.
        let n = unsafe { libc::sendto(self.fd.as_raw_fd(), req.as_ptr() as *const libc::c_void, req.len(), 0, &sa as *const _ as *const libc::sockaddr, std::mem::size_of::<libc::sockaddr_nl>() as u32) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn ask(
        &mut self,
        local: SocketAddr,
        remote: SocketAddr,
        info: bool,
    ) -> io::Result<Option<SockInfo>> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let Some(req) = request_ext(local, remote, seq, info) else {
            return Ok(None);
        };
        self.send(&req)?;
        let mut buf = [0u8; 8192];
        loop {
            // SAFETY: a valid buffer.
            let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            match parse_reply(&buf[..n as usize], seq) {
                // an answer to an earlier (timed out) request: read on
                Err(e) if e.kind() == io::ErrorKind::InvalidData && !buf[..n as usize].is_empty() && u32::from_ne_bytes([buf[8], buf[9], buf[10], buf[11]]) != seq => continue,
                r => return r,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn finds_a_connected_socket_and_not_others() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, peer) = l.accept().unwrap();
        let mut d = SockDiag::open().unwrap();
        let got = d.lookup(s.local_addr().unwrap(), peer).unwrap().unwrap();
        assert_eq!(got.state, TCP_ESTABLISHED);
        assert!(got.inode != 0 && got.owned_and_receiving() && got.serves_connection(), "{got:?}");
        // A connection in the accept queue: no process owns it yet, the server will serve it.
        let c2 = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let queued = d.lookup(l.local_addr().unwrap(), c2.local_addr().unwrap()).unwrap().unwrap();
        assert!(queued.inode == 0 && !queued.owned_and_receiving() && queued.serves_connection(), "{queued:?}");
        let mut other = peer;
        other.set_port(if peer.port() == 1 { 2 } else { 1 });
        assert_eq!(d.lookup(s.local_addr().unwrap(), other).unwrap(), None);
        // the peer closes: close-wait, still receiving
        drop(c);
        let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let got = d.lookup(s.local_addr().unwrap(), peer).unwrap().unwrap();
            if got.state == TCP_CLOSE_WAIT {
                assert!(got.owned_and_receiving());
                break;
            }
            assert!(std::time::Instant::now() < end, "{got:?}");
        }
        // garbage never panics
        for n in 0..100 {
            let _ = parse_reply(&vec![0x41; n], 1);
        }
    }

    /// A server socket whose peer reads nothing, written to until the kernel refuses more:
    /// the dump shows it not writable (its queued output above two thirds of its send buffer),
    /// as a process writing to it would wait. Before, with nothing written, writable.
    #[test]
    fn receive_queues_show_a_send_buffer_that_does_not_take_more() {
        use std::io::Write;
        let mut d = SockDiag::open().unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let _c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        let q = d.receive_queues(port).unwrap();
        assert_eq!(q.len(), 1, "{q:?}");
        assert!(q[0].send_buf > 0 && q[0].send_queued * 3 <= q[0].send_buf * 2, "nothing written: writable: {q:?}");
        s.set_nonblocking(true).unwrap();
        let chunk = vec![7u8; 1 << 16];
        let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            // Until the kernel takes no more (the peer's window closes: no ACK frees anything).
            loop {
                match s.write(&chunk) {
                    Ok(_) => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => panic!("{e}"),
                }
            }
            let q = d.receive_queues(port).unwrap();
            assert_eq!(q.len(), 1, "{q:?}");
            if q[0].send_queued as u64 * 3 > q[0].send_buf as u64 * 2 {
                assert!(q[0].send_queued < 1 << 30, "{q:?}");
                break;
            }
            assert!(std::time::Instant::now() < end, "never shown full: {q:?}");
        }
    }

    /// The receive queues of a port's sockets (a hung server's evidence): unread bytes and
    /// bytes received, per socket (IPv4 and IPv6), and nothing of other ports.
    #[test]
    fn receive_queues_count_unread_and_received_bytes() {
        use std::io::{Read, Write};
        let mut d = SockDiag::open().unwrap();
        for any in ["127.0.0.1:0", "[::1]:0"] {
            let l = TcpListener::bind(any).unwrap();
            let port = l.local_addr().unwrap().port();
            let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let (mut s, _) = l.accept().unwrap();
            let other = TcpListener::bind(any).unwrap();
            let mut c2 = TcpStream::connect(other.local_addr().unwrap()).unwrap();
            let (_s2, _) = other.accept().unwrap();
            c2.write_all(&[9u8; 77]).unwrap();
            c.write_all(&[1u8; 500]).unwrap();
            let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
            let wait = |d: &mut SockDiag, unread: u32, received: u64| loop {
                let q = d.receive_queues(port).unwrap();
                // the client's own socket has a different local port: only the server's
                assert_eq!(q.len(), 1, "{any}: {q:?}");
                if q[0].unread == unread && q[0].received == received {
                    return q[0];
                }
                assert!(
                    std::time::Instant::now() < end,
                    "{any}: {q:?}, waiting for {unread}/{received}"
                );
            };
            let a = wait(&mut d, 500, 500);
            assert_eq!((a.local, a.remote), (s.local_addr().unwrap(), c.local_addr().unwrap()), "{any}: the socket's own addresses");
            assert!(a.send_buf > 0 && a.send_queued * 3 <= a.send_buf * 2, "{any}: it wrote nothing: writable: {a:?}");
            s.read_exact(&mut [0u8; 200]).unwrap();
            let b = wait(&mut d, 300, 500);
            assert_eq!(a.cookie, b.cookie, "one socket, one cookie");
            // The peer closes: close-wait still counts (its input may be unread).
            drop(c);
            let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
            loop {
                let q = d.receive_queues(port).unwrap();
                if q.len() == 1 && q[0].received == 501 {
                    assert_eq!(q[0].unread, 301, "the FIN counts one in both: {q:?}");
                    break;
                }
                assert!(std::time::Instant::now() < end, "{any}: {q:?}");
            }
            s.read_exact(&mut [0u8; 300]).unwrap();
            assert_eq!(s.read(&mut [0u8; 1]).unwrap(), 0);
        }
        // Malformed dumps are errors, never a panic; another request's messages are skipped.
        let mut out = vec![];
        assert!(parse_dump(
            &[40, 0, 0, 0, 20, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0],
            1,
            80,
            &mut out
        )
        .is_err());
        let mut done = vec![0u8; 20];
        done[..4].copy_from_slice(&20u32.to_ne_bytes());
        done[4..6].copy_from_slice(&NLMSG_DONE.to_ne_bytes());
        done[8..12].copy_from_slice(&7u32.to_ne_bytes());
        assert!(!parse_dump(&done, 8, 80, &mut out).unwrap());
        assert!(parse_dump(&done, 7, 80, &mut out).unwrap());
        assert!(out.is_empty());
    }

    /// `tcp_info`'s byte counts as the relearn path reads them: what the peer acknowledged and
    /// what was received from it, exactly (checked against bytes moved both ways), and never
    /// for a request socket.
    #[test]
    fn progress_counts_bytes_acked_and_received() {
        use std::io::{Read, Write};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, peer) = l.accept().unwrap();
        let local = s.local_addr().unwrap();
        let mut d = SockDiag::open().unwrap();
        assert_eq!(d.lookup_progress(local, peer).unwrap().unwrap().progress, Some(Progress { bytes_acked: 0, bytes_received: 0 }));
        assert_eq!(d.lookup(local, peer).unwrap().unwrap().progress, None, "not asked for");
        s.write_all(&[1u8; 1000]).unwrap();
        c.read_exact(&mut [0u8; 1000]).unwrap();
        c.write_all(&[2u8; 700]).unwrap();
        s.read_exact(&mut [0u8; 700]).unwrap();
        let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let p = d.lookup_progress(local, peer).unwrap().unwrap().progress.unwrap();
            assert_eq!(p.bytes_received, 700, "{p:?}");
            if p.bytes_acked == 1000 {
                break;
            }
            assert!(p.bytes_acked < 1000 && std::time::Instant::now() < end, "{p:?}");
        }
        // The server's FIN, acknowledged, counts one.
        s.shutdown(std::net::Shutdown::Write).unwrap();
        assert_eq!(c.read(&mut [0u8; 1]).unwrap(), 0);
        loop {
            let p = d.lookup_progress(local, peer).unwrap().unwrap().progress.unwrap();
            if p.bytes_acked == 1001 {
                break;
            }
            assert!(p.bytes_acked == 1000 && std::time::Instant::now() < end, "{p:?}");
        }
        // A truncated or malformed attribute gives none.
        assert_eq!(progress(&[8, 0, 2, 0, 0, 0, 0, 0]), None);
        assert_eq!(progress(&[3, 0, 2, 0]), None);
    }
}
