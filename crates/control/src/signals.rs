//! Signals shared by the daemons (`unbroken agent`, `unbroken lb`, `unbroken guard`).
//!
//! SIGHUP must never kill a daemon: its default action would end the process (and, for the
//! guard, every connection it renumbers). None of the daemons reloads its configuration, so
//! SIGHUP is ignored with one log line on stderr (`<name>: SIGHUP: reload not supported,
//! ignored`) and counted ([`hangups`]; the agent's and the guard's status files report it as
//! `sighup_ignored`).

use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

static HANGUPS: AtomicU64 = AtomicU64::new(0);
/// The whole log line, set once by [`ignore_hangup`] (a leaked, NUL-free byte string).
static LINE: AtomicPtr<Vec<u8>> = AtomicPtr::new(std::ptr::null_mut());

extern "C" fn on_hangup(_: libc::c_int) {
    HANGUPS.fetch_add(1, Ordering::Relaxed);
    let p = LINE.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: `p` points to a leaked Vec that is never freed or changed after it was
        // published; write(2) is async-signal-safe.
        unsafe {
            let l = &*p;
            libc::write(2, l.as_ptr() as *const libc::c_void, l.len());
        }
    }
}

/// Installs the SIGHUP handler of the daemon `name` (the prefix of its log line).
pub fn ignore_hangup(name: &str) {
    let line = Box::new(format!("{name}: SIGHUP: reload not supported, ignored\n").into_bytes());
    // An earlier line (a second call) may still be read by a running handler: it is leaked.
    LINE.swap(Box::into_raw(line), Ordering::AcqRel);
    // SAFETY: installs a handler that only touches atomics and calls write(2).
    unsafe {
        libc::signal(libc::SIGHUP, on_hangup as *const () as libc::sighandler_t);
    }
}

/// How many SIGHUPs were ignored since the process started.
pub fn hangups() -> u64 {
    HANGUPS.load(Ordering::Relaxed)
}
