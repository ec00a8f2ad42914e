//! Locks that outlive a panicking thread.
//!
//! A daemon's state is shared between its packet loop, its side-channel or worker threads and
//! its status writer. With `lock().unwrap()` a panic in any one of them while holding a lock
//! poisons it and every other thread then panics in turn: the daemon dies, or worse, keeps
//! running with a dead thread nobody notices. [`lock`] takes the state as the panicking
//! thread left it instead (every field of our cores is valid at any point: they hold counters,
//! maps and plain values, no invariant spans two fields that a panic could leave half done
//! beyond one connection's entry), counts it ([`poisoned`], reported in the status files) and
//! says so on stderr (the first time and at every power of two).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

static POISONED: AtomicU64 = AtomicU64::new(0);

/// Locks `m`, recovering it when another thread panicked while holding it.
pub fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> MutexGuard<'a, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => {
            let n = POISONED.fetch_add(1, Ordering::Relaxed) + 1;
            if n.is_power_of_two() {
                eprintln!("{what}: a thread panicked while holding this lock; going on with the state it left ({n} time(s) so far)");
            }
            poisoned.into_inner()
        }
    }
}

/// How many times [`lock`] recovered a poisoned lock in this process.
pub fn poisoned() -> u64 {
    POISONED.load(Ordering::Relaxed)
}

/// Runs `f`, turning a panic into `None` (counted in [`panics`], the first and every
/// power-of-two-th said on stderr with its message): one hostile input that trips a bug must
/// cost that input, not the thread that serves all the others.
pub fn catch<T>(what: &str, f: impl FnOnce() -> T) -> Option<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(v) => Some(v),
        Err(e) => {
            let n = PANICS.fetch_add(1, Ordering::Relaxed) + 1;
            if n.is_power_of_two() {
                let msg = e.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| e.downcast_ref::<String>().cloned()).unwrap_or_default();
                eprintln!("{what}: panicked ({msg}); the input was dropped and the thread goes on ({n} time(s) so far)");
            }
            None
        }
    }
}

static PANICS: AtomicU64 = AtomicU64::new(0);

/// How many panics [`catch`] absorbed in this process.
pub fn panics() -> u64 {
    PANICS.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn hostile_panicking_thread_does_not_take_the_lock_down() {
        let m = Arc::new(Mutex::new(5u32));
        let m2 = m.clone();
        let before = poisoned();
        let r = std::thread::spawn(move || {
            let mut g = m2.lock().unwrap();
            *g = 6;
            panic!("a bug reached by hostile input");
        })
        .join();
        assert!(r.is_err());
        assert!(m.lock().is_err(), "the lock is poisoned");
        assert_eq!(*lock(&m, "test"), 6, "the state the thread left");
        assert!(poisoned() > before);
        let p = panics();
        assert_eq!(catch("test", || -> u32 { panic!("boom") }), None);
        assert_eq!(catch("test", || 7), Some(7));
        assert_eq!(panics(), p + 1);
    }
}
