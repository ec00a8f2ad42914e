//! Thin, checked wrappers over the few libc calls the drivers share.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

/// Turns a `-1` return into the current `errno`.
pub(crate) fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// `socket(2)` with `SOCK_CLOEXEC`, owned.
pub(crate) fn socket(
    domain: libc::c_int,
    ty: libc::c_int,
    proto: libc::c_int,
) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; on success we own the returned descriptor.
    let fd = cvt(unsafe { libc::socket(domain, ty | libc::SOCK_CLOEXEC, proto) })?;
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `setsockopt(2)` for an `int` option.
pub(crate) fn setsockopt_int(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    v: libc::c_int,
) -> io::Result<()> {
    // SAFETY: we pass a pointer to a live c_int and its exact size.
    cvt(unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// `getsockopt(2)` for an `int` option.
pub(crate) fn getsockopt_int(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are live and sized for an int option.
    cvt(unsafe {
        libc::getsockopt(
            fd,
            level,
            name,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    })?;
    Ok(v)
}

/// Sets a socket buffer size: first the privileged `*FORCE` option (ignores `rmem_max` /
/// `wmem_max`), falling back to the ordinary one (capped by the sysctl) without privilege.
pub(crate) fn set_buffer(
    fd: &OwnedFd,
    force: libc::c_int,
    plain: libc::c_int,
    bytes: usize,
) -> io::Result<()> {
    let v = bytes.min(libc::c_int::MAX as usize / 2) as libc::c_int;
    match setsockopt_int(fd.as_raw_fd(), libc::SOL_SOCKET, force, v) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
            setsockopt_int(fd.as_raw_fd(), libc::SOL_SOCKET, plain, v)
        }
        Err(e) => Err(e),
    }
}

/// Waits until `fd` is readable (or has an error pending). `None` waits forever. Returns
/// `false` on timeout. Retries `EINTR` against the original deadline.
pub(crate) fn wait_readable(fd: RawFd, timeout: Option<Duration>) -> io::Result<bool> {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let ms: libc::c_int = match deadline {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                // Round up so a 0.5 ms timeout does not become a busy 0 ms poll loop.
                let ms = left.as_micros().div_ceil(1000);
                ms.min(libc::c_int::MAX as u128) as libc::c_int
            }
        };
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        match cvt(unsafe { libc::poll(&mut pfd, 1, ms) }) {
            Ok(0) => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Ok(false);
                }
            }
            Ok(_) => return Ok(true),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Whether the calling thread's effective capability set holds `cap` (capabilities are per
/// thread; read from `/proc/thread-self/status`). `None` when it cannot be told.
pub(crate) fn has_capability(cap: u32) -> Option<bool> {
    let status = std::fs::read_to_string("/proc/thread-self/status")
        .or_else(|_| std::fs::read_to_string("/proc/self/status"))
        .ok()?;
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))?
        .trim();
    let bits = u64::from_str_radix(hex, 16).ok()?;
    Some(bits & (1u64 << cap) != 0)
}

/// `CAP_NET_ADMIN` from `linux/capability.h`.
pub(crate) const CAP_NET_ADMIN: u32 = 12;
