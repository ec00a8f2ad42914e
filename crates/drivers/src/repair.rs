//! Rebuilding established TCP connections as kernel sockets with `TCP_REPAIR`.
//!
//! [`rebuild`] turns a [`RepairSpec`] (the sequence numbers, negotiated options and windows of
//! one connection) into a connected, `ESTABLISHED` [`TcpStream`] without sending a SYN, so a
//! process or host that takes over a service address can carry on a connection whose socket
//! died elsewhere. [`close_silently`] drops a socket without a FIN or RST, and [`dump`] reads a
//! live socket back into a [`RepairSpec`].
//!
//! The restore order is the one measured on this kernel (`linux-facts.md`, TCP_REPAIR):
//!
//! 1. `socket`, `SO_MARK`, `SO_SNDBUFFORCE`, `TCP_MAXSEG` (see below);
//! 2. `TCP_REPAIR = 1` (also makes `bind` succeed beside a listener on the same port: repair
//!    mode sets `SK_FORCE_REUSE`, so no `SO_REUSEADDR` is needed);
//! 3. send queue: `TCP_QUEUE_SEQ = snd_nxt`; receive queue: `TCP_QUEUE_SEQ = rcv_nxt`;
//! 4. `bind(local)`, `connect(remote)`: in repair mode the kernel sends no SYN and the socket
//!    goes straight to `ESTABLISHED`;
//! 5. `TCP_REPAIR_OPTIONS` (MSS, window scales, SACK, timestamps), `TCP_TIMESTAMP`;
//! 6. `TCP_REPAIR_WINDOW`, no queue selected, `TCP_REPAIR = 0`.
//!
//! **Leaving repair mode with 0, not -1.** `TCP_REPAIR_OFF` (0) makes the kernel call
//! `tcp_send_window_probe()`: it sets `snd_wl1 = rcv_nxt - 1`, so the next ACK from the peer
//! updates our send window whatever it says, and sends a bare ACK with the old sequence number
//! `snd_una - 1`. The peer must answer an out-of-window segment with an ACK, so within one round
//! trip the rebuilt socket learns the peer's current window and cumulative ACK, and the peer
//! learns our window. Measured in the lab with a stale [`RepairSpec::snd_wnd`] of 0: the next
//! 4 MiB went out within 11 ms after leaving with 0, and only after 3.1-3.3 s (the zero-window
//! probe timer) after leaving with -1.
//! `TCP_REPAIR_OFF_NO_WP` (-1) sends nothing, which is right only for a read-only peek at a
//! live socket, as [`dump`] does.
//!
//! Kernel traps handled here:
//! - In repair mode `connect()` computes the MSS with the default clamp (536) and
//!   `TCP_REPAIR_OPTIONS` only changes the clamp, not the cached MSS, so the socket would send
//!   536-byte segments for its whole life. Setting `TCP_MAXSEG` to the spec's MSS before
//!   `connect()` makes the kernel compute the right MSS.
//! - Without window scaling the kernel still picks its own receive window scale at `connect()`
//!   (from the buffer sizes, 10 in the lab) and shifts every announced window by it, so a peer
//!   that never agreed to scaling is offered a window 2^scale times too small (measured: 63
//!   bytes instead of 64239). When [`RepairSpec::snd_wscale`] is `None`, `TCP_WINDOW_CLAMP` =
//!   65535 before `connect()` makes the kernel choose scale 0.
//! - The TCP header length a rebuilt socket assumes comes from the namespace's
//!   `net.ipv4.tcp_timestamps` sysctl, not from [`RepairSpec::timestamp`]; `TCP_INFO` then
//!   reports an MSS 12 bytes off when the two disagree, but the kernel corrects the difference
//!   per segment (`tcp_current_mss`). What is lost then is the receive fast path (header
//!   prediction), not correctness.
//! - Since 6.7 bit 0 of `TCP_TIMESTAMP` selects a microsecond clock; [`rebuild`] rounds an odd
//!   timestamp up to the next even value (a millisecond clock never goes backwards that way).
//!
//! Everything here needs `CAP_NET_ADMIN` in the socket's network namespace. The socket is
//! created in the calling thread's network namespace.

use crate::sys::{cvt, getsockopt_int as get_int, setsockopt_int as set_int};
use std::io;
use std::mem::{size_of, MaybeUninit};
use std::net::{SocketAddr, SocketAddrV4, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};

/// `SOL_TCP` option: enter (1) or leave (0, or -1 without window probe) repair mode.
pub const TCP_REPAIR: libc::c_int = 19;
/// `SOL_TCP` option: select the queue that `TCP_QUEUE_SEQ` and send/recv act on.
pub const TCP_REPAIR_QUEUE: libc::c_int = 20;
/// `SOL_TCP` option: the sequence number of the selected queue (`write_seq` or `rcv_nxt`).
pub const TCP_QUEUE_SEQ: libc::c_int = 21;
/// `SOL_TCP` option: set connection-time negotiated options (array of `{u32 code, u32 val}`).
pub const TCP_REPAIR_OPTIONS: libc::c_int = 22;
/// `SOL_TCP` option: the TSval clock (offset applied to the kernel's clock).
pub const TCP_TIMESTAMP: libc::c_int = 24;
/// `SOL_TCP` option: the windows ([`RepairWindow`]).
pub const TCP_REPAIR_WINDOW: libc::c_int = 29;
/// `SOL_TCP` option `TCP_INFO`.
pub const TCP_INFO: libc::c_int = 11;
/// `SOL_TCP` option `TCP_MAXSEG` (in repair mode `getsockopt` returns the MSS clamp).
pub const TCP_MAXSEG: libc::c_int = 2;
/// `SOL_TCP` option `TCP_WINDOW_CLAMP`.
pub const TCP_WINDOW_CLAMP: libc::c_int = 10;

/// `TCP_REPAIR` value: enter repair mode.
pub const TCP_REPAIR_ON: libc::c_int = 1;
/// `TCP_REPAIR` value: leave repair mode and send a window probe.
pub const TCP_REPAIR_OFF: libc::c_int = 0;
/// `TCP_REPAIR` value: leave repair mode without sending anything.
pub const TCP_REPAIR_OFF_NO_WP: libc::c_int = -1;

/// `TCP_REPAIR_QUEUE` value: no queue.
pub const TCP_NO_QUEUE: libc::c_int = 0;
/// `TCP_REPAIR_QUEUE` value: the receive queue.
pub const TCP_RECV_QUEUE: libc::c_int = 1;
/// `TCP_REPAIR_QUEUE` value: the send queue.
pub const TCP_SEND_QUEUE: libc::c_int = 2;

/// `TCP_REPAIR_OPTIONS` code: MSS clamp (value: the MSS).
pub const TCPOPT_MSS: u32 = 2;
/// `TCP_REPAIR_OPTIONS` code: window scales (value: `snd_wscale | rcv_wscale << 16`).
pub const TCPOPT_WINDOW: u32 = 3;
/// `TCP_REPAIR_OPTIONS` code: SACK permitted (value 0).
pub const TCPOPT_SACK_PERM: u32 = 4;
/// `TCP_REPAIR_OPTIONS` code: timestamps (value 0).
pub const TCPOPT_TIMESTAMP: u32 = 8;

/// ioctl: bytes in the receive queue not yet read.
pub const SIOCINQ: libc::c_ulong = 0x541B;
/// ioctl: bytes in the send queue not yet acknowledged (`write_seq - snd_una`).
pub const SIOCOUTQ: libc::c_ulong = 0x5411;
/// ioctl: bytes in the send queue not yet sent (`write_seq - snd_nxt`).
pub const SIOCOUTQNSD: libc::c_ulong = 0x894B;

/// The smallest MSS the kernel accepts (`TCP_MIN_MSS`).
const TCP_MIN_MSS: u16 = 88;
/// `tcpi_options` bits of `TCP_INFO`.
const TCPI_OPT_TIMESTAMPS: u8 = 1;
const TCPI_OPT_SACK: u8 = 2;
const TCPI_OPT_WSCALE: u8 = 4;
/// `tcpi_state` of an established connection.
const TCP_ESTABLISHED: u8 = 1;

/// `struct tcp_repair_window` of `linux/tcp.h`, the argument of [`TCP_REPAIR_WINDOW`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RepairWindow {
    /// Sequence number of the segment that last updated the send window.
    pub snd_wl1: u32,
    /// The peer's receive window, bytes (scaled).
    pub snd_wnd: u32,
    /// The largest window the peer ever offered.
    pub max_window: u32,
    /// Our receive window as last announced, bytes, counted from `rcv_wup`.
    pub rcv_wnd: u32,
    /// `rcv_nxt` when the window was last announced.
    pub rcv_wup: u32,
}

/// `struct tcp_repair_opt` of `linux/tcp.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RepairOpt {
    code: u32,
    val: u32,
}

/// Everything needed to rebuild one established TCP connection as a kernel socket on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepairSpec {
    /// The service address and port. It must be assigned on this host (in the calling thread's
    /// network namespace), e.g. a VIP on `lo` or on the interface.
    pub local: SocketAddr,
    /// The client's address and port.
    pub remote: SocketAddr,
    /// Our next sequence number to send, which must be the client's cumulative ACK (bytes the
    /// client has not acknowledged are not part of the spec: send them again).
    pub snd_nxt: u32,
    /// The next sequence number we expect from the client.
    pub rcv_nxt: u32,
    /// The MSS to send with (the client's advertised MSS, or a smaller clamp).
    pub mss: u16,
    /// The client's window scale; `None`: window scaling was not negotiated.
    pub snd_wscale: Option<u8>,
    /// Our window scale as announced in the original SYN-ACK (ignored when `snd_wscale` is
    /// `None`: then no scaling applies either way).
    pub rcv_wscale: u8,
    /// SACK permitted on both sides.
    pub sack: bool,
    /// `Some(ts)`: timestamps were negotiated, and our TSval clock continues at `ts` or later
    /// (at least the last TSval the client saw, which its TSecr tells). Use an even value: since
    /// Linux 6.7 bit 0 selects microsecond timestamps; [`rebuild`] rounds an odd value up.
    pub timestamp: Option<u32>,
    /// The client's current receive window in bytes (already scaled).
    pub snd_wnd: u32,
    /// The window in bytes we had announced, counted from `rcv_nxt`. The rebuilt socket never
    /// announces a right edge left of `rcv_nxt + rcv_wnd` (a smaller one would make the kernel
    /// drop segments the client may send in the window it was given).
    pub rcv_wnd: u32,
    /// `SO_MARK` for the socket's packets (0: none), set before `connect()` so it also applies
    /// to the route lookup.
    pub mark: u32,
    /// `SO_SNDBUFFORCE` bytes when `Some` (this also ends send buffer autotuning).
    pub sndbuf: Option<usize>,
}

/// Attach the failed step to an error, keeping its kind: `"TCP_REPAIR_OPTIONS: Operation not
/// permitted (os error 1)"`.
fn step(name: impl std::fmt::Display) -> impl FnOnce(io::Error) -> io::Error {
    move |e| io::Error::new(e.kind(), format!("{name}: {e}"))
}

fn setsockopt<T>(fd: RawFd, level: libc::c_int, name: libc::c_int, v: &T) -> io::Result<()> {
    // SAFETY: `v` is a live `T` and we pass its exact size.
    cvt(unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (v as *const T).cast(),
            size_of::<T>() as libc::socklen_t,
        )
    })
    .map(drop)
}

fn setsockopt_slice<T>(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    v: &[T],
) -> io::Result<()> {
    // SAFETY: `v` is a live slice and we pass its exact size in bytes.
    cvt(unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            v.as_ptr().cast(),
            std::mem::size_of_val(v) as libc::socklen_t,
        )
    })
    .map(drop)
}

/// `getsockopt` into a zeroed `T`; returns the value and the length the kernel wrote.
fn getsockopt<T: Copy>(fd: RawFd, level: libc::c_int, name: libc::c_int) -> io::Result<(T, usize)> {
    let mut v = MaybeUninit::<T>::zeroed();
    let mut len = size_of::<T>() as libc::socklen_t;
    // SAFETY: `v` has room for `len` bytes; `T` is plain old data (all callers use integers,
    // `#[repr(C)]` structs of integers or byte arrays), so every bit pattern is valid.
    cvt(unsafe { libc::getsockopt(fd, level, name, v.as_mut_ptr().cast(), &mut len) })?;
    Ok((unsafe { v.assume_init() }, len as usize))
}

fn ioctl_int(fd: RawFd, req: libc::c_ulong) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    // SAFETY: these ioctls write one int through the pointer.
    cvt(unsafe { libc::ioctl(fd, req as _, &mut v as *mut libc::c_int) })?;
    Ok(v)
}

/// A v4-mapped IPv6 socket address as the IPv4 one it stands for.
fn unmap(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::V4(SocketAddrV4::new(v4, v6.port())),
            None => a,
        },
        v4 => v4,
    }
}

/// A `sockaddr_storage` holding `a`, and its length.
fn sockaddr(a: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all-zero is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in6.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// Rebuild: returns a connected, `ESTABLISHED`, non-repair-mode socket whose next write is
/// sent at `spec.snd_nxt` and which accepts the client's bytes from `spec.rcv_nxt` on.
///
/// Sends exactly one packet, the window probe of leaving repair mode (see the module docs).
/// The socket is created in the calling thread's network namespace, in blocking mode. Fails
/// with the name of the failed step in the message, e.g. `connect(10.0.0.1:5000):
/// Cannot assign requested address (os error 99)`, which is what the kernel answers while the
/// old connection's socket still exists in this namespace. On failure the half-built socket is
/// closed in repair mode, so nothing is sent.
pub fn rebuild(spec: &RepairSpec) -> io::Result<TcpStream> {
    let (local, remote) = match (unmap(spec.local), unmap(spec.remote)) {
        (l @ SocketAddr::V4(_), r @ SocketAddr::V4(_)) => (l, r),
        (l @ SocketAddr::V6(_), r @ SocketAddr::V6(_)) => (l, r),
        _ => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "rebuild: local {} and remote {} are of different address families",
                    spec.local, spec.remote
                ),
            ))
        }
    };
    if let Some(ws) = spec.snd_wscale {
        if ws > 14 || spec.rcv_wscale > 14 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "rebuild: window scales {ws}/{} exceed 14 (RFC 7323)",
                    spec.rcv_wscale
                ),
            ));
        }
    }
    if spec.mss < TCP_MIN_MSS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "rebuild: MSS {} below the kernel's minimum {TCP_MIN_MSS}",
                spec.mss
            ),
        ));
    }
    let domain = match local {
        SocketAddr::V4(_) => libc::AF_INET,
        SocketAddr::V6(_) => libc::AF_INET6,
    };
    // SAFETY: plain syscall; on success we own the descriptor.
    let fd = cvt(unsafe {
        libc::socket(
            domain,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            libc::IPPROTO_TCP,
        )
    })
    .map_err(step("socket"))?;
    // SAFETY: `fd` is a fresh descriptor nobody else owns. Dropping it before leaving repair
    // mode closes it silently (tcp_close of a repair socket only disconnects).
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let fd = sock.as_raw_fd();

    if spec.mark != 0 {
        set_int(
            fd,
            libc::SOL_SOCKET,
            libc::SO_MARK,
            spec.mark as libc::c_int,
        )
        .map_err(step("SO_MARK"))?;
    }
    if let Some(b) = spec.sndbuf {
        let v = b.min(libc::c_int::MAX as usize / 2) as libc::c_int;
        set_int(fd, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, v).map_err(step("SO_SNDBUFFORCE"))?;
    }
    // Before connect(): the MSS the kernel caches at connect time (see the module docs).
    set_int(fd, libc::SOL_TCP, TCP_MAXSEG, spec.mss as libc::c_int)
        .map_err(step(format_args!("TCP_MAXSEG={}", spec.mss)))?;
    if spec.snd_wscale.is_none() {
        set_int(fd, libc::SOL_TCP, TCP_WINDOW_CLAMP, 65535).map_err(step("TCP_WINDOW_CLAMP"))?;
    }

    set_int(fd, libc::SOL_TCP, TCP_REPAIR, TCP_REPAIR_ON).map_err(step("TCP_REPAIR=1"))?;
    set_int(fd, libc::SOL_TCP, TCP_REPAIR_QUEUE, TCP_SEND_QUEUE)
        .map_err(step("TCP_REPAIR_QUEUE=send"))?;
    set_int(
        fd,
        libc::SOL_TCP,
        TCP_QUEUE_SEQ,
        spec.snd_nxt as libc::c_int,
    )
    .map_err(step("TCP_QUEUE_SEQ(send)"))?;
    set_int(fd, libc::SOL_TCP, TCP_REPAIR_QUEUE, TCP_RECV_QUEUE)
        .map_err(step("TCP_REPAIR_QUEUE=recv"))?;
    set_int(
        fd,
        libc::SOL_TCP,
        TCP_QUEUE_SEQ,
        spec.rcv_nxt as libc::c_int,
    )
    .map_err(step("TCP_QUEUE_SEQ(recv)"))?;

    let (sa, len) = sockaddr(&local);
    // SAFETY: `sa` holds a valid sockaddr of `len` bytes.
    cvt(unsafe { libc::bind(fd, (&sa as *const libc::sockaddr_storage).cast(), len) })
        .map_err(step(format_args!("bind({local})")))?;
    let (sa, len) = sockaddr(&remote);
    // SAFETY: as above. In repair mode connect() sends nothing and completes at once.
    cvt(unsafe { libc::connect(fd, (&sa as *const libc::sockaddr_storage).cast(), len) })
        .map_err(step(format_args!("connect({remote})")))?;

    let mut opts = vec![RepairOpt {
        code: TCPOPT_MSS,
        val: spec.mss as u32,
    }];
    if let Some(ws) = spec.snd_wscale {
        opts.push(RepairOpt {
            code: TCPOPT_WINDOW,
            val: ws as u32 | (spec.rcv_wscale as u32) << 16,
        });
    }
    if spec.sack {
        opts.push(RepairOpt {
            code: TCPOPT_SACK_PERM,
            val: 0,
        });
    }
    if spec.timestamp.is_some() {
        opts.push(RepairOpt {
            code: TCPOPT_TIMESTAMP,
            val: 0,
        });
    }
    setsockopt_slice(fd, libc::SOL_TCP, TCP_REPAIR_OPTIONS, &opts)
        .map_err(step("TCP_REPAIR_OPTIONS"))?;
    if let Some(ts) = spec.timestamp {
        // Even: a millisecond clock (bit 0 would select microseconds since 6.7).
        let ts = ts.wrapping_add(ts & 1);
        set_int(fd, libc::SOL_TCP, TCP_TIMESTAMP, ts as libc::c_int)
            .map_err(step("TCP_TIMESTAMP"))?;
    }
    let win = RepairWindow {
        snd_wl1: spec.rcv_nxt,
        snd_wnd: spec.snd_wnd,
        max_window: spec.snd_wnd,
        rcv_wnd: spec.rcv_wnd,
        rcv_wup: spec.rcv_nxt,
    };
    setsockopt(fd, libc::SOL_TCP, TCP_REPAIR_WINDOW, &win).map_err(step("TCP_REPAIR_WINDOW"))?;
    set_int(fd, libc::SOL_TCP, TCP_REPAIR_QUEUE, TCP_NO_QUEUE)
        .map_err(step("TCP_REPAIR_QUEUE=none"))?;
    set_int(fd, libc::SOL_TCP, TCP_REPAIR, TCP_REPAIR_OFF).map_err(step("TCP_REPAIR=0"))?;

    let stream = TcpStream::from(sock);
    stream
        .set_nonblocking(false)
        .map_err(step("set blocking"))?;
    Ok(stream)
}

/// Close a socket without sending anything (no FIN, no RST): enter repair mode, then close.
///
/// The connection simply ceases to exist on this host (its 4-tuple is free for [`rebuild`] at
/// once). If repair mode cannot be entered (no `CAP_NET_ADMIN`, or `s` listens), the error is
/// returned and the socket is deliberately left open — its descriptor leaked — because a normal
/// close would send the FIN or RST this function promises never to send; the connection then
/// stays intact. Other descriptors of the same socket (from `try_clone`) keep it open.
pub fn close_silently(s: TcpStream) -> io::Result<()> {
    let fd = s.as_raw_fd();
    match enter_repair(fd) {
        Ok(()) => {
            drop(s);
            Ok(())
        }
        Err(e) => {
            let _ = s.into_raw_fd();
            Err(step("close_silently: TCP_REPAIR=1 (socket left open)")(e))
        }
    }
}

/// Puts the socket `fd` (any descriptor of it) in repair mode: from then on it sends nothing,
/// and its last close is silent (no FIN, no RST) and frees the address pair at once. The agent
/// uses it on a socket whose worker still holds other descriptors, before shutting it down.
pub fn enter_repair(fd: RawFd) -> io::Result<()> {
    set_int(fd, libc::SOL_TCP, TCP_REPAIR, TCP_REPAIR_ON)
}

/// Leaves repair mode without a window probe when dropped.
struct RepairGuard(RawFd);

impl Drop for RepairGuard {
    fn drop(&mut self) {
        let _ = set_int(self.0, libc::SOL_TCP, TCP_REPAIR_QUEUE, TCP_NO_QUEUE);
        let _ = set_int(self.0, libc::SOL_TCP, TCP_REPAIR, TCP_REPAIR_OFF_NO_WP);
    }
}

/// Read a live, `ESTABLISHED` socket's state: enter repair mode, read the queue sequence
/// numbers, the options (`TCP_INFO`, `TCP_MAXSEG`, `TCP_TIMESTAMP`) and the windows
/// (`TCP_REPAIR_WINDOW`), leave repair mode without a window probe. Sends nothing. Used by
/// tests and diagnostics.
///
/// The result describes the connection as [`rebuild`] needs it:
/// - `snd_nxt` is `snd_una`, the client's cumulative ACK: bytes still unacknowledged (`SIOCOUTQ`)
///   are not counted, a rebuilt socket must send them again;
/// - `rcv_nxt` is the kernel's, so it counts bytes received but not yet read (`SIOCINQ`): read
///   them before the old socket goes;
/// - `rcv_wnd` is what is left of the announced window past `rcv_nxt`;
/// - `timestamp` is the socket's TSval clock now (even for a millisecond clock);
/// - v4-mapped IPv6 addresses (a dual-stack listener's IPv4 connections) come back as IPv4;
/// - `sndbuf` is `None` (a buffer size is not connection state).
pub fn dump(s: &TcpStream) -> io::Result<RepairSpec> {
    let local = unmap(s.local_addr().map_err(step("dump: getsockname"))?);
    let remote = unmap(s.peer_addr().map_err(step("dump: getpeername"))?);
    let fd = s.as_raw_fd();

    let (info, n) =
        getsockopt::<[u8; 104]>(fd, libc::SOL_TCP, TCP_INFO).map_err(step("dump: TCP_INFO"))?;
    if n < 20 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("dump: TCP_INFO returned {n} bytes"),
        ));
    }
    if info[0] != TCP_ESTABLISHED {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("dump: TCP state {} is not ESTABLISHED (1)", info[0]),
        ));
    }
    let options = info[5];
    let (snd_ws, rcv_ws) = (info[6] & 0x0f, info[6] >> 4);

    set_int(fd, libc::SOL_TCP, TCP_REPAIR, TCP_REPAIR_ON).map_err(step("dump: TCP_REPAIR=1"))?;
    let _guard = RepairGuard(fd);
    set_int(fd, libc::SOL_TCP, TCP_REPAIR_QUEUE, TCP_SEND_QUEUE)
        .map_err(step("dump: TCP_REPAIR_QUEUE=send"))?;
    let write_seq = get_int(fd, libc::SOL_TCP, TCP_QUEUE_SEQ)
        .map_err(step("dump: TCP_QUEUE_SEQ(send)"))? as u32;
    let outq = ioctl_int(fd, SIOCOUTQ).map_err(step("dump: SIOCOUTQ"))? as u32;
    set_int(fd, libc::SOL_TCP, TCP_REPAIR_QUEUE, TCP_RECV_QUEUE)
        .map_err(step("dump: TCP_REPAIR_QUEUE=recv"))?;
    let rcv_nxt = get_int(fd, libc::SOL_TCP, TCP_QUEUE_SEQ)
        .map_err(step("dump: TCP_QUEUE_SEQ(recv)"))? as u32;
    let mss = get_int(fd, libc::SOL_TCP, TCP_MAXSEG).map_err(step("dump: TCP_MAXSEG"))?;
    let timestamp = if options & TCPI_OPT_TIMESTAMPS != 0 {
        Some(get_int(fd, libc::SOL_TCP, TCP_TIMESTAMP).map_err(step("dump: TCP_TIMESTAMP"))? as u32)
    } else {
        None
    };
    let (win, _) = getsockopt::<RepairWindow>(fd, libc::SOL_TCP, TCP_REPAIR_WINDOW)
        .map_err(step("dump: TCP_REPAIR_WINDOW"))?;
    let mark = get_int(fd, libc::SOL_SOCKET, libc::SO_MARK).map_err(step("dump: SO_MARK"))? as u32;

    let wscale = options & TCPI_OPT_WSCALE != 0;
    Ok(RepairSpec {
        local,
        remote,
        snd_nxt: write_seq.wrapping_sub(outq),
        rcv_nxt,
        mss: mss.clamp(0, u16::MAX as libc::c_int) as u16,
        snd_wscale: wscale.then_some(snd_ws),
        rcv_wscale: if wscale { rcv_ws } else { 0 },
        sack: options & TCPI_OPT_SACK != 0,
        timestamp,
        snd_wnd: win.snd_wnd,
        rcv_wnd: (win.rcv_wup.wrapping_add(win.rcv_wnd).wrapping_sub(rcv_nxt) as i32).max(0) as u32,
        mark,
        sndbuf: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_sizes_match_the_kernel() {
        assert_eq!(size_of::<RepairWindow>(), 20);
        assert_eq!(size_of::<RepairOpt>(), 8);
    }

    #[test]
    fn unmap_turns_mapped_addresses_into_v4() {
        let m: SocketAddr = "[::ffff:10.1.2.3]:80".parse().unwrap();
        assert_eq!(unmap(m), "10.1.2.3:80".parse().unwrap());
        let v6: SocketAddr = "[fd00::1]:80".parse().unwrap();
        assert_eq!(unmap(v6), v6);
    }

    #[test]
    fn mixed_families_are_refused_before_any_syscall() {
        let spec = RepairSpec {
            local: "10.0.0.1:80".parse().unwrap(),
            remote: "[fd00::2]:4000".parse().unwrap(),
            snd_nxt: 1,
            rcv_nxt: 1,
            mss: 1460,
            snd_wscale: None,
            rcv_wscale: 0,
            sack: false,
            timestamp: None,
            snd_wnd: 65535,
            rcv_wnd: 65535,
            mark: 0,
            sndbuf: None,
        };
        let e = rebuild(&spec).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("address families"), "{e}");
    }
}
