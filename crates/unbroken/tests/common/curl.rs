//! A client's received bytes and a curl download in the object lab's client namespace, shared by
//! the object-mode lab tests (`object_safety`, `object_records`), which include this file with
//! `#[path]`: every byte compared with the original object as it arrives, the reads paced, the
//! stalls measured; and the bounded polling those tests wait with.
#![allow(dead_code)]

use std::io::Read;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use unbroken::object::demo::ObjectEnv;

/// What a client received, compared byte by byte with the original object.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    pub bytes: u64,
    /// First offset where a received byte differs from the original (or lies beyond its end).
    pub wrong_at: Option<u64>,
    pub first_byte_ms: Option<u64>,
    pub max_gap_ms: u64,
    /// Gaps over 50 ms between reads: (at bytes, ms).
    pub gaps: Vec<(u64, u64)>,
}

pub fn first_diff(got: &[u8], want: &[u8]) -> Option<usize> {
    let n = got.len().min(want.len());
    if got[..n] != want[..n] {
        return got[..n].iter().zip(&want[..n]).position(|(a, b)| a != b);
    }
    (got.len() > want.len()).then_some(want.len())
}

/// Reads a client's output, comparing every byte with `want`. With `rate` > 0 the reads are
/// paced to that many bytes/s (the pipe, then TCP flow control, slow the download down). The
/// stall is the time one read waited for data.
pub fn watch(
    mut out: impl Read + Send + 'static,
    want: Arc<Vec<u8>>,
    progress: Arc<AtomicU64>,
    t0: Instant,
    rate: u64,
) -> JoinHandle<Seen> {
    std::thread::spawn(move || {
        let mut s = Seen::default();
        let mut buf = vec![0u8; 256 << 10];
        let paced = Instant::now();
        loop {
            if rate > 0 {
                let due = paced + Duration::from_secs_f64(s.bytes as f64 / rate as f64);
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now); // pacing the reader, not synchronisation
                }
            }
            let asked = Instant::now();
            let n = match out.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let now = Instant::now();
            if s.bytes == 0 {
                s.first_byte_ms = Some(now.duration_since(t0).as_millis() as u64);
            } else {
                let gap = now.duration_since(asked).as_millis() as u64;
                s.max_gap_ms = s.max_gap_ms.max(gap);
                if gap > 50 {
                    s.gaps.push((s.bytes, gap));
                }
            }
            if s.wrong_at.is_none() {
                let from = (s.bytes as usize).min(want.len());
                if let Some(d) = first_diff(&buf[..n], &want[from..]) {
                    s.wrong_at = Some(s.bytes + d as u64);
                }
            }
            s.bytes += n as u64;
            progress.store(s.bytes, Ordering::Relaxed);
        }
        s
    })
}

/// A curl download running in the client namespace.
pub struct Curl {
    pub child: Child,
    pub port: u16,
    pub progress: Arc<AtomicU64>,
    pub seen: JoinHandle<Seen>,
    pub stderr: JoinHandle<String>,
}

pub struct Done {
    pub exit: Option<i32>,
    pub timed_out: bool,
    pub seen: Seen,
    pub stderr: String,
}

/// Starts curl for `path` from client port `port`, with `headers`, read at `rate` bytes/s (0:
/// as fast as it comes).
pub fn curl(env: &ObjectEnv, path: &str, port: u16, rate: u64, headers: &[&str], want: Arc<Vec<u8>>) -> Curl {
    let mut c = Command::new("curl");
    c.args(["-sS", "--fail", "--max-time", "90", "-o", "-", "--local-port", &port.to_string()]);
    for h in headers {
        c.args(["-H", h]);
    }
    c.arg(env.url(false, path));
    let t0 = Instant::now();
    let mut child = env.client_cmd(&mut c).expect("start curl");
    let progress = Arc::new(AtomicU64::new(0));
    let seen = watch(
        child.stdout.take().unwrap(),
        want,
        progress.clone(),
        t0,
        rate,
    );
    let mut err = child.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut t = String::new();
        let _ = err.read_to_string(&mut t);
        t
    });
    Curl {
        child,
        port,
        progress,
        seen,
        stderr,
    }
}

impl Curl {
    pub fn got(&self) -> u64 {
        self.progress.load(Ordering::Relaxed)
    }
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
    /// Waits (bounded) until curl has received `n` bytes; false if it ended first.
    pub fn wait_bytes(&mut self, n: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.got() < n {
            if !self.running() || Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2)); // polling the byte count to time a crash
        }
        true
    }
    /// The live server holding this download's connection.
    pub fn server(&self, env: &ObjectEnv) -> usize {
        let mut found = None;
        assert!(wait_for(Duration::from_secs(3), || {
            found = env.serving(self.port);
            found.is_some()
        }));
        found.unwrap()
    }
    pub fn finish(mut self, timeout: Duration) -> Done {
        let deadline = Instant::now() + timeout;
        let mut timed_out = false;
        let status = loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                break Some(st);
            }
            if Instant::now() > deadline {
                timed_out = true;
                let _ = self.child.kill();
                break self.child.wait().ok();
            }
            std::thread::sleep(Duration::from_millis(10)); // polling the child with a deadline
        };
        let seen = self.seen.join().unwrap_or_default();
        let stderr = self.stderr.join().unwrap_or_default();
        Done {
            exit: status.and_then(|s| s.code()),
            timed_out,
            seen,
            stderr,
        }
    }
}

/// Polls `f` until it holds or `timeout` passes (status files and Redis have no events).
pub fn wait_for(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20)); // polling with a deadline
    }
}
