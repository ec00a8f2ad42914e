//! Injection of complete IP packets through raw sockets.
//!
//! IPv4 uses `socket(AF_INET, SOCK_RAW, IPPROTO_RAW)`, which implies `IP_HDRINCL`: the packet
//! goes out as given, except that the kernel always fills in the header checksum and the total
//! length, and picks an IP id when it is 0 (`raw_send_hdrinc`). IPv6 uses
//! `socket(AF_INET6, SOCK_RAW, IPPROTO_RAW)`; Linux sets the socket's `hdrincl` flag for that
//! protocol (`inet6_create`), and since 4.5 the flag is readable as `IPV6_HDRINCL`, which
//! [`RawSender`] checks and sets if needed. IPv6 headers are sent unchanged: the caller must
//! get the payload length right.
//!
//! Every packet carries the sender's `SO_MARK`, so an iptables rule such as
//! `-m mark --mark M -j RETURN` can keep injected packets out of the guard's own queue (see
//! [`crate::iptables`]). The mark lives on the socket buffer only: it survives delivery over
//! loopback inside one namespace, but a veth (or any device crossing namespaces) scrubs it.
//!
//! Packets go through the normal output path (routing, the OUTPUT and POSTROUTING hooks,
//! neighbour resolution). A packet larger than the route's MTU fails with `EMSGSIZE`: raw
//! sockets neither fragment header-included packets nor send GSO super-packets.

use std::ffi::CString;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, OwnedFd};

use crate::sys;

/// How to open a [`RawSender`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawSenderConfig {
    /// `SO_MARK` of every injected packet (0 leaves packets unmarked).
    pub mark: u32,
    /// Socket send buffer in bytes (`SO_SNDBUFFORCE`, falling back to `SO_SNDBUF`).
    pub sndbuf: usize,
    /// Bind both sockets to this interface (`SO_BINDTODEVICE`), e.g. to pick the interface
    /// for IPv6 link-local destinations.
    pub device: Option<String>,
    /// Fail [`RawSender::open`] unless both families open. When `false`, a family the kernel
    /// lacks (`EAFNOSUPPORT`) is skipped and sending such a packet fails instead.
    pub require_both: bool,
}

impl Default for RawSenderConfig {
    fn default() -> Self {
        RawSenderConfig {
            mark: 0,
            sndbuf: 4 << 20,
            device: None,
            require_both: false,
        }
    }
}

/// Sends complete IPv4 and IPv6 packets with a fixed mark.
#[derive(Debug)]
pub struct RawSender {
    v4: Option<OwnedFd>,
    v6: Option<OwnedFd>,
    mark: u32,
}

impl RawSender {
    /// Opens raw sockets for both families in the calling thread's network namespace, with
    /// `mark` as `SO_MARK` and the other settings at their defaults.
    pub fn new(mark: u32) -> io::Result<RawSender> {
        Self::open(&RawSenderConfig {
            mark,
            ..RawSenderConfig::default()
        })
    }

    /// Opens raw sockets as configured.
    pub fn open(cfg: &RawSenderConfig) -> io::Result<RawSender> {
        let v4 = open_family(libc::AF_INET, cfg, cfg.require_both)?;
        let v6 = open_family(libc::AF_INET6, cfg, cfg.require_both)?;
        if v4.is_none() && v6.is_none() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "neither IPv4 nor IPv6 raw sockets are available",
            ));
        }
        if let Some(fd) = &v6 {
            ensure_ipv6_hdrincl(fd)?;
        }
        Ok(RawSender {
            v4,
            v6,
            mark: cfg.mark,
        })
    }

    /// The mark injected packets carry.
    pub fn mark(&self) -> u32 {
        self.mark
    }

    /// Sends `packet`, a complete IPv4 or IPv6 packet (told apart by its version nibble), to
    /// the destination address in its header.
    pub fn send(&self, packet: &[u8]) -> io::Result<()> {
        self.send_scoped(packet, 0)
    }

    /// Like [`RawSender::send`]; for IPv6, `scope_id` (an interface index) selects the
    /// interface for link-local destinations. Ignored for IPv4.
    pub fn send_scoped(&self, packet: &[u8], scope_id: u32) -> io::Result<()> {
        match packet.first().map(|b| b >> 4) {
            Some(4) => self.send_v4(packet),
            Some(6) => self.send_v6(packet, scope_id),
            _ => Err(invalid("not an IPv4 or IPv6 packet")),
        }
    }

    fn send_v4(&self, packet: &[u8]) -> io::Result<()> {
        let fd = self.v4.as_ref().ok_or_else(|| unsupported("IPv4"))?;
        if packet.len() < 20 || usize::from(packet[0] & 0x0f) * 4 < 20 {
            return Err(invalid("truncated IPv4 header"));
        }
        let dst = Ipv4Addr::new(packet[16], packet[17], packet[18], packet[19]);
        // SAFETY: sockaddr_in is plain data; zeroed is valid.
        let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        sa.sin_family = libc::AF_INET as libc::sa_family_t;
        sa.sin_addr.s_addr = u32::from_ne_bytes(dst.octets());
        send_to(
            fd,
            packet,
            (&sa as *const libc::sockaddr_in).cast(),
            std::mem::size_of_val(&sa),
        )
    }

    fn send_v6(&self, packet: &[u8], scope_id: u32) -> io::Result<()> {
        let fd = self.v6.as_ref().ok_or_else(|| unsupported("IPv6"))?;
        if packet.len() < 40 {
            return Err(invalid("truncated IPv6 header"));
        }
        let mut octets = [0u8; 16];
        octets.copy_from_slice(&packet[24..40]);
        let dst = Ipv6Addr::from(octets);
        // SAFETY: sockaddr_in6 is plain data; zeroed is valid.
        let mut sa: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
        sa.sin6_family = libc::AF_INET6 as libc::sa_family_t;
        sa.sin6_addr.s6_addr = dst.octets();
        sa.sin6_scope_id = scope_id;
        // sin6_port must be 0 for IPPROTO_RAW (the kernel rejects anything else with EINVAL).
        send_to(
            fd,
            packet,
            (&sa as *const libc::sockaddr_in6).cast(),
            std::mem::size_of_val(&sa),
        )
    }
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what.to_string())
}

fn unsupported(family: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!("no {family} raw socket (the kernel lacks the family)"),
    )
}

fn send_to(fd: &OwnedFd, packet: &[u8], sa: *const libc::sockaddr, salen: usize) -> io::Result<()> {
    loop {
        // SAFETY: `packet` is live for its length; `sa` points at a live sockaddr of `salen`.
        let n = unsafe {
            libc::sendto(
                fd.as_raw_fd(),
                packet.as_ptr().cast(),
                packet.len(),
                0,
                sa,
                salen as libc::socklen_t,
            )
        };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn open_family(
    domain: libc::c_int,
    cfg: &RawSenderConfig,
    required: bool,
) -> io::Result<Option<OwnedFd>> {
    let fd = match sys::socket(domain, libc::SOCK_RAW, libc::IPPROTO_RAW) {
        Ok(fd) => fd,
        Err(e) if !required && e.raw_os_error() == Some(libc::EAFNOSUPPORT) => return Ok(None),
        Err(e) => return Err(e),
    };
    let raw = fd.as_raw_fd();
    if cfg.mark != 0 {
        sys::setsockopt_int(
            raw,
            libc::SOL_SOCKET,
            libc::SO_MARK,
            cfg.mark as libc::c_int,
        )
        .map_err(|e| io::Error::new(e.kind(), format!("setting SO_MARK {:#x}: {e}", cfg.mark)))?;
    }
    sys::set_buffer(&fd, libc::SO_SNDBUFFORCE, libc::SO_SNDBUF, cfg.sndbuf)?;
    if let Some(dev) = &cfg.device {
        let name = CString::new(dev.as_bytes()).map_err(|_| invalid("device name contains NUL"))?;
        let bytes = name.as_bytes_with_nul();
        // SAFETY: `bytes` is a live NUL-terminated buffer of the given length.
        sys::cvt(unsafe {
            libc::setsockopt(
                raw,
                libc::SOL_SOCKET,
                libc::SO_BINDTODEVICE,
                bytes.as_ptr().cast(),
                bytes.len() as libc::socklen_t,
            )
        })
        .map_err(|e| io::Error::new(e.kind(), format!("binding raw socket to {dev}: {e}")))?;
    }
    Ok(Some(fd))
}

/// Makes sure the IPv6 raw socket takes the caller's header. `IPPROTO_RAW` implies it on
/// Linux; `IPV6_HDRINCL` (4.5+) lets us check, and set it if some kernel did not.
fn ensure_ipv6_hdrincl(fd: &OwnedFd) -> io::Result<()> {
    match sys::getsockopt_int(fd.as_raw_fd(), libc::IPPROTO_IPV6, libc::IPV6_HDRINCL) {
        Ok(0) => sys::setsockopt_int(fd.as_raw_fd(), libc::IPPROTO_IPV6, libc::IPV6_HDRINCL, 1),
        Ok(_) => Ok(()),
        // Kernels before 4.5 have no option but always imply it for IPPROTO_RAW.
        Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_garbage_before_any_syscall() {
        let s = RawSender {
            v4: None,
            v6: None,
            mark: 0,
        };
        for bad in [&[][..], &[0x00; 40][..], &[0x50; 40][..]] {
            assert_eq!(s.send(bad).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        }
        // Missing family is reported as such.
        assert_eq!(
            s.send(&[0x45; 20]).unwrap_err().kind(),
            io::ErrorKind::Unsupported
        );
    }

    // The skip rule of this crate's tests (UNBROKEN_REQUIRE_LAB=1 turns a skip into a failure).
    include!(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/common/require.rs"));

    /// Linux implies header inclusion for `AF_INET6`/`IPPROTO_RAW` sockets: the flag reads 1
    /// before anyone sets it. Needs CAP_NET_RAW; skipped without (fails with
    /// UNBROKEN_REQUIRE_LAB=1).
    #[test]
    fn ipv6_ipproto_raw_implies_hdrincl() {
        let fd = match sys::socket(libc::AF_INET6, libc::SOCK_RAW, libc::IPPROTO_RAW) {
            Ok(fd) => fd,
            Err(e) => {
                skip_or_fail(
                    "ipv6_ipproto_raw_implies_hdrincl",
                    &format!("no raw IPv6 socket: {e}"),
                );
                return;
            }
        };
        match sys::getsockopt_int(fd.as_raw_fd(), libc::IPPROTO_IPV6, libc::IPV6_HDRINCL) {
            Ok(v) => assert_eq!(v, 1),
            Err(e) => eprintln!("IPV6_HDRINCL not readable on this kernel: {e}"),
        }
    }

    #[test]
    fn sender_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<RawSender>();
    }
}
