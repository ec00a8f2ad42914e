//! Rate-limited log lines for everything a packet (or a datagram, or a worker's failure) can
//! make a daemon say: a flood of hostile traffic must not become a flood of log lines, nor an
//! allocation per packet (issue 9, item 6).
//!
//! [`RateLimit`] is the I/O-free part (time is given): per *kind* of line (a `&'static str`),
//! at most `burst` lines per `interval_ms`; the first line let through after a suppressed
//! stretch is told how many were suppressed, so nothing disappears silently, and the total is
//! counted ([`RateLimit::suppressed`]). The line itself is built by a closure that only runs
//! when the line is let through, so a suppressed line costs no allocation. Kinds live in a
//! fixed table ([`MAX_KINDS`]; beyond it they share one slot), so the limiter never allocates
//! after construction either.
//!
//! [`Logger`] wraps it with a clock and a sink (stderr by default, anything in tests); the
//! daemons use the process-wide [`log`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// Distinct kinds of lines tracked separately.
pub const MAX_KINDS: usize = 32;
/// Default: at most this many lines of one kind...
pub const BURST: u32 = 5;
/// ...per this many milliseconds.
pub const INTERVAL_MS: u64 = 10_000;

#[derive(Debug, Clone, Copy)]
struct Slot {
    kind: &'static str,
    start: u64,
    emitted: u32,
    suppressed: u64,
}

/// Per-kind line budget; see the module documentation.
#[derive(Debug, Clone)]
pub struct RateLimit {
    burst: u32,
    interval_ms: u64,
    slots: [Option<Slot>; MAX_KINDS],
    suppressed: u64,
}

impl RateLimit {
    /// At most `burst` lines of each kind per `interval_ms` milliseconds.
    pub fn new(burst: u32, interval_ms: u64) -> RateLimit {
        RateLimit { burst, interval_ms: interval_ms.max(1), slots: [None; MAX_KINDS], suppressed: 0 }
    }

    /// Whether a line of `kind` may be written at `now_ms`: `Some(n)` when it may, `n` being
    /// how many lines of its kind were suppressed since the last one written (say so in the
    /// line); `None` when it is suppressed (and counted).
    pub fn check(&mut self, kind: &'static str, now_ms: u64) -> Option<u64> {
        let i = self
            .slots
            .iter()
            .position(|s| s.is_some_and(|s| std::ptr::eq(s.kind, kind) || s.kind == kind))
            .or_else(|| self.slots.iter().position(Option::is_none))
            .unwrap_or(MAX_KINDS - 1);
        let slot = self.slots[i].get_or_insert(Slot { kind, start: now_ms, emitted: 0, suppressed: 0 });
        if now_ms.saturating_sub(slot.start) >= self.interval_ms {
            slot.start = now_ms;
            slot.emitted = 0;
        }
        if slot.emitted < self.burst {
            slot.emitted += 1;
            Some(std::mem::take(&mut slot.suppressed))
        } else {
            slot.suppressed += 1;
            self.suppressed += 1;
            None
        }
    }

    /// Lines suppressed so far, all kinds.
    pub fn suppressed(&self) -> u64 {
        self.suppressed
    }
}

impl Default for RateLimit {
    fn default() -> Self {
        RateLimit::new(BURST, INTERVAL_MS)
    }
}

type Sink = Box<dyn Fn(&str) + Send + Sync>;

/// A [`RateLimit`] with a clock and a sink, shared between threads.
pub struct Logger {
    limit: Mutex<RateLimit>,
    start: Instant,
    sink: Sink,
    suppressed: AtomicU64,
}

impl Logger {
    /// Lines go to `sink`.
    pub fn new(limit: RateLimit, sink: impl Fn(&str) + Send + Sync + 'static) -> Logger {
        Logger { limit: Mutex::new(limit), start: Instant::now(), sink: Box::new(sink), suppressed: AtomicU64::new(0) }
    }

    /// Writes the line `line()` builds, unless lines of `kind` are over their budget (then
    /// `line` is not called: nothing is formatted or allocated).
    pub fn line(&self, kind: &'static str, line: impl FnOnce() -> String) {
        let now = self.start.elapsed().as_millis() as u64;
        let verdict = crate::sync::lock(&self.limit, "log limiter").check(kind, now);
        match verdict {
            Some(0) => (self.sink)(&line()),
            Some(n) => (self.sink)(&format!("{} ({n} more like it suppressed)", line())),
            None => {
                self.suppressed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Lines suppressed so far.
    pub fn suppressed(&self) -> u64 {
        self.suppressed.load(Ordering::Relaxed)
    }
}

/// The process-wide logger: stderr, [`BURST`] lines per kind per [`INTERVAL_MS`].
pub fn global() -> &'static Logger {
    static G: OnceLock<Logger> = OnceLock::new();
    G.get_or_init(|| Logger::new(RateLimit::default(), |l| eprintln!("{l}")))
}

/// A rate-limited line on stderr (see [`global`]).
pub fn log(kind: &'static str, line: impl FnOnce() -> String) {
    global().line(kind, line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn hostile_flood_of_lines_is_bounded_and_counted() {
        let mut r = RateLimit::new(3, 1000);
        let mut written = 0;
        for i in 0..100_000u64 {
            if r.check("refused", i / 100).is_some() {
                written += 1;
            }
        }
        // 100,000 lines over 1,000 ms: 3 written, the rest counted.
        assert_eq!(written, 3);
        assert_eq!(r.suppressed(), 100_000 - 3);
        // The next interval: the first line is told what was suppressed.
        assert_eq!(r.check("refused", 1000), Some(100_000 - 3));
        assert_eq!(r.check("refused", 1000), Some(0));
        // Kinds are independent.
        assert_eq!(r.check("other", 1000), Some(0));
        // More kinds than slots share the last one, still bounded.
        let names: Vec<&'static str> = (0..100).map(|i| &*Box::leak(format!("k{i}").into_boxed_str())).collect();
        let mut n = 0;
        for _ in 0..10 {
            for k in &names {
                n += r.check(k, 1001).is_some() as u32;
            }
        }
        assert!(n <= 3 * MAX_KINDS as u32, "{n}");
    }

    #[test]
    fn hostile_logger_formats_nothing_it_suppresses() {
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let sink = lines.clone();
        let l = Logger::new(RateLimit::new(2, 60_000), move |s| sink.lock().unwrap().push(s.to_string()));
        let built = AtomicU64::new(0);
        for i in 0..10_000 {
            l.line("refused", || {
                built.fetch_add(1, Ordering::Relaxed);
                format!("refused {i}")
            });
        }
        assert_eq!(*lines.lock().unwrap(), vec!["refused 0", "refused 1"]);
        assert_eq!(built.load(Ordering::Relaxed), 2, "suppressed lines are never formatted");
        assert_eq!(l.suppressed(), 9_998);
    }
}
