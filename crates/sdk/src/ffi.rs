//! The C ABI, declared in `include/unbroken.h` (see that header for the C documentation).
//!
//! Every function returns [`UB_OK`] (0) or a negative `UB_E*` code, checks its pointers for
//! null, and never lets a panic cross into C (it becomes [`UB_EINTERNAL`]). On [`UB_EIO`]
//! `errno` holds the failing system call's error. A `ub_client` may be used from several
//! threads (requests are serialized), except [`ub_client_set_timeouts`] and
//! [`ub_client_free`], which need exclusive access.

use crate::client::GuardClient;
use crate::error::{status, Error};
use crate::record::{ConnRecord, RECORD_LEN};
use std::ffi::{c_char, c_int, CStr};
use std::net::SocketAddr;
use std::os::fd::{BorrowedFd, IntoRawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

/// Success.
pub const UB_OK: c_int = 0;
/// Invalid argument: null pointer, unparsable address or key, bad `how`, negative fd.
pub const UB_EINVAL: c_int = -1;
/// The guard did not answer in time (also what a wrong key looks like).
pub const UB_ETIMEDOUT: c_int = -2;
/// The guard has no state for this connection.
pub const UB_ENOCONN: c_int = -3;
/// The guard found the command malformed.
pub const UB_EBADREQ: c_int = -4;
/// The guard answered with another non-zero status.
pub const UB_EREJECTED: c_int = -5;
/// The guard cannot (yet) recover this connection (no RECOVERABLE / ACK_ALLOWED).
pub const UB_ENOTRECOVERABLE: c_int = -6;
/// The record is corrupt, of another version, or does not match the guard's state.
pub const UB_ERECORD: c_int = -7;
/// The peer acknowledged more bytes than `sent`.
pub const UB_EDELIVERED: c_int = -8;
/// A system call failed; `errno` is set.
pub const UB_EIO: c_int = -9;
/// Internal error (a bug; a panic was caught).
pub const UB_EINTERNAL: c_int = -10;
/// The guard refused our key (its MAC check failed).
pub const UB_EKEY: c_int = -11;
/// The guard refused our clock (too far from its own).
pub const UB_ECLOCK: c_int = -12;

/// `ub_shutdown`: RTCP_SHUTDOWN_READING.
pub const UB_SHUT_RD: c_int = 0;
/// `ub_shutdown`: RTCP_SHUTDOWN_WRITING.
pub const UB_SHUT_WR: c_int = 1;
/// `ub_shutdown`: RTCP_SHUTDOWN (both).
pub const UB_SHUT_RDWR: c_int = 2;

/// `ub_record`: the [`ConnRecord`] encoding, `UB_RECORD_LEN` (64) bytes, to persist as is.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct UbRecord {
    /// [`ConnRecord::to_bytes`].
    pub bytes: [u8; RECORD_LEN],
}

/// `ub_client`: opaque to C.
pub struct UbClient {
    inner: GuardClient,
}

fn set_errno(e: c_int) {
    // SAFETY: the thread's errno location is always valid.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    unsafe {
        *libc::__errno_location() = e;
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = e;
}

/// The `UB_E*` code of an [`Error`] (setting `errno` for I/O errors).
pub fn error_code(e: &Error) -> c_int {
    match e {
        Error::Timeout { .. } => UB_ETIMEDOUT,
        Error::Refused { reason: unbroken_wire::ctl::refusal::CLOCK } => UB_ECLOCK,
        Error::Refused { .. } => UB_EKEY,
        Error::Rejected(status::NO_CONNECTION) => UB_ENOCONN,
        Error::Rejected(status::BAD_REQUEST) => UB_EBADREQ,
        Error::Rejected(_) => UB_EREJECTED,
        Error::NotRecoverable { .. } => UB_ENOTRECOVERABLE,
        Error::DeliveredBeyondSent { .. } => UB_EDELIVERED,
        Error::BadRecord(_) | Error::Inconsistent(_) => UB_ERECORD,
        Error::InvalidArgument(_) | Error::Wire(_) => UB_EINVAL,
        Error::Io(io) => {
            set_errno(io.raw_os_error().unwrap_or(libc::EIO));
            UB_EIO
        }
        // The code of the failed check's error: what is wrong is the same.
        Error::GuardCheckFailed(e) => error_code(e),
    }
}

/// Runs `f`, turning errors into codes and panics into [`UB_EINTERNAL`].
fn guarded(f: impl FnOnce() -> Result<(), c_int>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => UB_OK,
        Ok(Err(code)) => code,
        Err(_) => UB_EINTERNAL,
    }
}

unsafe fn client<'a>(c: *const UbClient) -> Result<&'a GuardClient, c_int> {
    c.as_ref().map(|c| &c.inner).ok_or(UB_EINVAL)
}

unsafe fn record(r: *const UbRecord) -> Result<ConnRecord, c_int> {
    let r = r.as_ref().ok_or(UB_EINVAL)?;
    ConnRecord::from_bytes(&r.bytes).map_err(|e| error_code(&e))
}

unsafe fn c_str<'a>(s: *const c_char) -> Option<&'a str> {
    if s.is_null() {
        return None;
    }
    CStr::from_ptr(s).to_str().ok()
}

/// `ub_client *ub_client_new(const char *guard_addr, const char *key_hex)`: a client of
/// the guard at `guard_addr` (`"ip:port"`, IPv6 as `"[addr]:port"`) with the shared key
/// `key_hex` (at least 32 hex digits). NULL on error, with `errno` set (`EINVAL` for bad
/// arguments).
///
/// # Safety
/// Both arguments must be null or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn ub_client_new(guard_addr: *const c_char, key_hex: *const c_char) -> *mut UbClient {
    let r = catch_unwind(AssertUnwindSafe(|| {
        let (Some(addr), Some(key)) = (c_str(guard_addr), c_str(key_hex)) else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        match GuardClient::from_strs(addr, key) {
            Ok(inner) => Box::into_raw(Box::new(UbClient { inner })),
            Err(Error::Io(e)) => {
                set_errno(e.raw_os_error().unwrap_or(libc::EIO));
                std::ptr::null_mut()
            }
            Err(_) => {
                set_errno(libc::EINVAL);
                std::ptr::null_mut()
            }
        }
    }));
    r.unwrap_or(std::ptr::null_mut())
}

/// `void ub_client_free(ub_client *c)`: frees a client (NULL is ignored).
///
/// # Safety
/// `c` must be null or a pointer from `ub_client_new` not freed yet, used by no other thread.
#[no_mangle]
pub unsafe extern "C" fn ub_client_free(c: *mut UbClient) {
    if !c.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| drop(Box::from_raw(c))));
    }
}

/// `int ub_unprotect(int fd)`: [`unprotect`](crate::unprotect): marks connected TCP socket
/// `fd` (not closed) as not protected, so that the guard passes its packets untouched (only
/// honoured for a connection no command named). `UB_OK` or `UB_EIO`.
#[no_mangle]
pub extern "C" fn ub_unprotect(fd: c_int) -> c_int {
    guarded(|| {
        if fd < 0 {
            return Err(UB_EINVAL);
        }
        // SAFETY: fd is open for the duration of the call (caller's contract); never closed here.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        crate::unprotect(&fd).map_err(|e| error_code(&Error::Io(e)))
    })
}

/// `int ub_probe(const ub_client *c, const char *service_addr)`: checks at start-up that a
/// guard answers at the client's address, accepts its key and clock, and protects
/// `service_addr` (`"ip:port"`, the application's listening address). `UB_OK`;
/// `UB_EKEY` / `UB_ECLOCK` (the guard refused our key / clock); `UB_ETIMEDOUT` (nothing
/// answers at that address, or the guard drops our source); `UB_EBADREQ` (the guard does not
/// protect that service). The client remembers a failure: see [`ub_establish`].
///
/// # Safety
/// `c` must be a live client; `service_addr` null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn ub_probe(c: *const UbClient, service_addr: *const c_char) -> c_int {
    guarded(|| {
        let c = client(c)?;
        let svc: SocketAddr = c_str(service_addr).and_then(|s| s.trim().parse().ok()).ok_or(UB_EINVAL)?;
        c.probe(svc).map_err(|e| error_code(&e))
    })
}

/// `int ub_client_set_timeouts(ub_client *c, uint32_t initial_ms, uint32_t tries, uint32_t
/// connect_timeout_ms)`: side-channel first wait (default 50 ms, doubling), datagrams per
/// request (default 6) and `ub_recover`'s connect timeout (default 10000 ms). 0 keeps a
/// value unchanged.
///
/// # Safety
/// `c` must be null or a live client, used by no other thread during the call.
#[no_mangle]
pub unsafe extern "C" fn ub_client_set_timeouts(c: *mut UbClient, initial_ms: u32, tries: u32, connect_timeout_ms: u32) -> c_int {
    guarded(|| {
        let c = c.as_mut().ok_or(UB_EINVAL)?;
        let mut cfg = c.inner.config().clone();
        if initial_ms != 0 {
            cfg.initial_timeout = Duration::from_millis(initial_ms.into());
        }
        if tries != 0 {
            cfg.max_tries = tries;
        }
        if connect_timeout_ms != 0 {
            cfg.connect_timeout = Duration::from_millis(connect_timeout_ms.into());
        }
        c.inner.set_config(cfg);
        Ok(())
    })
}

/// `int ub_establish(ub_client *c, int fd, ub_record *out)`: [`establish`](crate::establish)
/// on connected TCP socket `fd` (not closed); fills `*out` with the record to persist. On
/// failure the socket is marked unprotected ([`unprotect`](crate::unprotect): its IP_TOS /
/// IPV6_TCLASS), so its close reaches the peer. After a failed [`ub_probe`] (until one
/// succeeds) it sends nothing and fails at once with the probe's code
/// ([`Error::GuardCheckFailed`]).
///
/// # Safety
/// `c` null or live; `out` null or writable.
#[no_mangle]
pub unsafe extern "C" fn ub_establish(c: *const UbClient, fd: c_int, out: *mut UbRecord) -> c_int {
    guarded(|| {
        let c = client(c)?;
        let out = out.as_mut().ok_or(UB_EINVAL)?;
        if fd < 0 {
            return Err(UB_EINVAL);
        }
        // SAFETY: fd is open for the duration of the call (caller's contract); never closed here.
        let fd = BorrowedFd::borrow_raw(fd);
        let rec = crate::establish(&fd, c).map_err(|e| error_code(&e))?;
        out.bytes = rec.to_bytes();
        Ok(())
    })
}

/// `int ub_acknowledge(ub_client *c, const ub_record *rec, uint64_t consumed)`:
/// [`acknowledge`](crate::acknowledge).
///
/// # Safety
/// `c` null or live; `rec` null or readable.
#[no_mangle]
pub unsafe extern "C" fn ub_acknowledge(c: *const UbClient, rec: *const UbRecord, consumed: u64) -> c_int {
    guarded(|| {
        let (c, r) = (client(c)?, record(rec)?);
        crate::acknowledge(&r, c, consumed).map(drop).map_err(|e| error_code(&e))
    })
}

/// `int ub_acknowledge_eof(ub_client *c, const ub_record *rec, uint64_t consumed)`:
/// [`acknowledge_eof`](crate::acknowledge_eof).
///
/// # Safety
/// As [`ub_acknowledge`].
#[no_mangle]
pub unsafe extern "C" fn ub_acknowledge_eof(c: *const UbClient, rec: *const UbRecord, consumed: u64) -> c_int {
    guarded(|| {
        let (c, r) = (client(c)?, record(rec)?);
        crate::acknowledge_eof(&r, c, consumed).map(drop).map_err(|e| error_code(&e))
    })
}

/// `int ub_shutdown(ub_client *c, const ub_record *rec, int how)`: `UB_SHUT_RD` →
/// [`shutdown_reading`](crate::shutdown_reading), `UB_SHUT_WR` →
/// [`shutdown_writing`](crate::shutdown_writing), `UB_SHUT_RDWR` → [`shutdown`](crate::shutdown).
///
/// # Safety
/// As [`ub_acknowledge`].
#[no_mangle]
pub unsafe extern "C" fn ub_shutdown(c: *const UbClient, rec: *const UbRecord, how: c_int) -> c_int {
    guarded(|| {
        let (c, r) = (client(c)?, record(rec)?);
        let res = match how {
            UB_SHUT_RD => crate::shutdown_reading(&r, c),
            UB_SHUT_WR => crate::shutdown_writing(&r, c),
            UB_SHUT_RDWR => crate::shutdown(&r, c),
            _ => return Err(UB_EINVAL),
        };
        res.map(drop).map_err(|e| error_code(&e))
    })
}

/// `int ub_clear(ub_client *c, const ub_record *rec)`: [`clear`](crate::clear).
///
/// # Safety
/// As [`ub_acknowledge`].
#[no_mangle]
pub unsafe extern "C" fn ub_clear(c: *const UbClient, rec: *const UbRecord) -> c_int {
    guarded(|| {
        let (c, r) = (client(c)?, record(rec)?);
        crate::clear(&r, c).map(drop).map_err(|e| error_code(&e))
    })
}

/// `int ub_recover(ub_client *c, const ub_record *rec, uint64_t consumed, uint64_t sent, int
/// *fd_out, uint64_t *delivered_out)`: [`recover`](crate::recover); on success `*fd_out` is
/// the new connected socket (blocking, close-on-exec, owned by the caller) and
/// `*delivered_out` the number of bytes the peer has received.
///
/// # Safety
/// As [`ub_acknowledge`]; `fd_out` and `delivered_out` null or writable.
#[no_mangle]
pub unsafe extern "C" fn ub_recover(c: *const UbClient, rec: *const UbRecord, consumed: u64, sent: u64, fd_out: *mut c_int, delivered_out: *mut u64) -> c_int {
    guarded(|| {
        if fd_out.is_null() || delivered_out.is_null() {
            return Err(UB_EINVAL);
        }
        let (c, r) = (client(c)?, record(rec)?);
        let (stream, delivered) = crate::recover(&r, c, consumed, sent).map_err(|e| error_code(&e))?;
        *fd_out = stream.into_raw_fd();
        *delivered_out = delivered;
        Ok(())
    })
}

/// `int ub_adopt(ub_client *c, const char *app_addr, ub_record *out, size_t max, size_t *count)`:
/// ADOPT ([`adopt`](crate::adopt)): the connections to `app_addr` (`"ip:port"`, the service)
/// that the guard holds but no application has told about, written as records into
/// `out[0..max]`; `*count` is how many the guard offered (may exceed `max`: call again with a
/// larger array). Persist each, then `ub_recover` it with `consumed = 0` and `sent = 0`.
///
/// # Safety
/// `c` from `ub_client_new`; `app_addr` a NUL-terminated string; `out` writable for `max`
/// records (may be null when `max` is 0); `count` writable.
#[no_mangle]
pub unsafe extern "C" fn ub_adopt(c: *const UbClient, app_addr: *const c_char, out: *mut UbRecord, max: usize, count: *mut usize) -> c_int {
    guarded(|| {
        let c = client(c)?;
        let app: SocketAddr = c_str(app_addr).and_then(|s| s.trim().parse().ok()).ok_or(UB_EINVAL)?;
        let count = count.as_mut().ok_or(UB_EINVAL)?;
        if out.is_null() && max > 0 {
            return Err(UB_EINVAL);
        }
        let recs = crate::adopt(c, app).map_err(|e| error_code(&e))?;
        *count = recs.len();
        for (i, r) in recs.iter().take(max).enumerate() {
            (*out.add(i)).bytes = r.to_bytes();
        }
        Ok(())
    })
}

/// `int ub_listen(const char *addr, int backlog, int *fd_out)`: a listening socket on
/// `addr` (`"ip:port"`) with `SO_REUSEADDR` and `SO_REUSEPORT`
/// ([`reuseport_listener`](crate::reuseport_listener)), so that `ub_recover` can bind its
/// port while it listens.
///
/// # Safety
/// `addr` null or a NUL-terminated string; `fd_out` null or writable.
#[no_mangle]
pub unsafe extern "C" fn ub_listen(addr: *const c_char, backlog: c_int, fd_out: *mut c_int) -> c_int {
    guarded(|| {
        let addr: SocketAddr = c_str(addr).and_then(|s| s.trim().parse().ok()).ok_or(UB_EINVAL)?;
        let fd_out = fd_out.as_mut().ok_or(UB_EINVAL)?;
        let l = crate::reuseport_listener(addr, backlog).map_err(|e| error_code(&Error::Io(e)))?;
        *fd_out = l.into_raw_fd();
        Ok(())
    })
}

/// `const char *ub_strerror(int code)`: a static, NUL-terminated English description of a
/// return code (never NULL).
#[no_mangle]
pub extern "C" fn ub_strerror(code: c_int) -> *const c_char {
    let s: &'static [u8] = match code {
        UB_OK => b"success\0",
        UB_EINVAL => b"invalid argument\0",
        UB_ETIMEDOUT => b"the guard did not answer (unreachable, or wrong key)\0",
        UB_ENOCONN => b"the guard has no such connection\0",
        UB_EBADREQ => b"the guard rejected the command as malformed\0",
        UB_EREJECTED => b"the guard rejected the command\0",
        UB_ENOTRECOVERABLE => b"the guard cannot recover this connection\0",
        UB_ERECORD => b"connection record corrupt, of another version, or not matching the guard\0",
        UB_EDELIVERED => b"the peer acknowledged more bytes than were sent\0",
        UB_EIO => b"system call failed (see errno)\0",
        UB_EINTERNAL => b"internal error\0",
        UB_EKEY => b"the guard rejected the side-channel key\0",
        UB_ECLOCK => b"the guard rejected our clock (too far from its own)\0",
        _ => b"unknown error code\0",
    };
    s.as_ptr().cast()
}

// The header's UB_RECORD_LEN must match.
const _: () = assert!(RECORD_LEN == 64 && std::mem::size_of::<UbRecord>() == 64);

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;

    #[test]
    fn strerror_covers_all_codes() {
        for code in [UB_OK, UB_EINVAL, UB_ETIMEDOUT, UB_ENOCONN, UB_EBADREQ, UB_EREJECTED, UB_ENOTRECOVERABLE, UB_ERECORD, UB_EDELIVERED, UB_EIO, UB_EINTERNAL] {
            let s = unsafe { CStr::from_ptr(ub_strerror(code)) }.to_str().unwrap();
            assert!(!s.starts_with("unknown"), "{code}");
        }
        assert_eq!(unsafe { CStr::from_ptr(ub_strerror(-99)) }.to_str().unwrap(), "unknown error code");
    }

    #[test]
    fn null_pointers_are_einval() {
        unsafe {
            assert!(ub_client_new(std::ptr::null(), std::ptr::null()).is_null());
            let a = CString::new("127.0.0.1:9").unwrap();
            let bad = CString::new("zz").unwrap();
            assert!(ub_client_new(a.as_ptr(), bad.as_ptr()).is_null());
            let key = CString::new("00112233445566778899aabbccddeeff").unwrap();
            let c = ub_client_new(a.as_ptr(), key.as_ptr());
            assert!(!c.is_null());
            let rec = UbRecord { bytes: [0; RECORD_LEN] };
            assert_eq!(ub_acknowledge(std::ptr::null(), &rec, 0), UB_EINVAL);
            assert_eq!(ub_acknowledge(c, std::ptr::null(), 0), UB_EINVAL);
            assert_eq!(ub_acknowledge(c, &rec, 0), UB_ERECORD);
            assert_eq!(ub_establish(c, -1, &mut UbRecord { bytes: [0; RECORD_LEN] }), UB_EINVAL);
            assert_eq!(ub_establish(c, 0, std::ptr::null_mut()), UB_EINVAL);
            assert_eq!(ub_recover(c, &rec, 0, 0, std::ptr::null_mut(), std::ptr::null_mut()), UB_EINVAL);
            assert_eq!(ub_listen(std::ptr::null(), 1, std::ptr::null_mut()), UB_EINVAL);
            assert_eq!(ub_client_set_timeouts(std::ptr::null_mut(), 1, 1, 1), UB_EINVAL);
            assert_eq!(ub_client_set_timeouts(c, 10, 2, 0), UB_OK);
            ub_client_free(c);
            ub_client_free(std::ptr::null_mut());
        }
    }

    #[test]
    fn shutdown_how_is_checked() {
        let r = ConnRecord::new("127.0.0.1:1".parse().unwrap(), "127.0.0.1:2".parse().unwrap(), 0, 0, None).unwrap();
        let rec = UbRecord { bytes: r.to_bytes() };
        let a = CString::new("127.0.0.1:9").unwrap();
        let key = CString::new("00112233445566778899aabbccddeeff").unwrap();
        unsafe {
            let c = ub_client_new(a.as_ptr(), key.as_ptr());
            assert_eq!(ub_shutdown(c, &rec, 3), UB_EINVAL);
            assert_eq!(ub_shutdown(c, &rec, -1), UB_EINVAL);
            ub_client_free(c);
        }
    }
}
