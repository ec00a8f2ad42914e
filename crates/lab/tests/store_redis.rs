//! The store client (`unbroken_control::object::store`) against real redis-server processes, each test
//! starting its own on free loopback ports (killed on drop, also when a test panics). Skipped,
//! with a message, when redis-server is not installed (a failure with UNBROKEN_REQUIRE_LAB=1).
//!
//! `cargo test --release -p unbroken-control --test store_redis`; the ignored `latency_report`
//! prints SET round-trip percentiles (`-- --ignored --nocapture latency_report`).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};
use unbroken_control::object::store::{
    key_slot, Completion, Op, OpKind, Reply, Store, StoreConfig, StoreError, StoreHandle,
};

fn have_redis() -> bool {
    let ok = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        unbroken_lab::lab::skip_or_fail(
            std::thread::current().name().unwrap_or("store_redis"),
            "redis-server is not installed (apt-get install redis-server redis-tools)",
        );
    }
    ok
}

macro_rules! require_redis {
    () => {
        if !have_redis() {
            return;
        }
    };
}

/// A temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "ub-store-{}-{tag}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A free loopback port; for a cluster node also its bus port (+10000).
fn free_port(cluster: bool) -> u16 {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        if cluster && (p > 55_000 || TcpListener::bind(("127.0.0.1", p + 10_000)).is_err()) {
            continue;
        }
        return p;
    }
}

/// True if a redis-server answers PING with PONG on `port`.
fn pong(port: u16) -> bool {
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = [0u8; 64];
    s.write_all(b"*1\r\n$4\r\nPING\r\n").is_ok()
        && s.read(&mut buf)
            .is_ok_and(|n| buf[..n].starts_with(b"+PONG"))
}

/// A redis-server child process, killed and reaped on drop.
struct Redis {
    port: u16,
    dir: PathBuf,
    extra: Vec<String>,
    child: Option<Child>,
}

impl Redis {
    fn start(dir: &Path, port: u16, extra: &[String]) -> Redis {
        let mut r = Redis {
            port,
            dir: dir.to_path_buf(),
            extra: extra.to_vec(),
            child: None,
        };
        r.spawn();
        r
    }

    /// (Re)starts the server on its port and waits until it answers PING (bounded).
    fn spawn(&mut self) {
        assert!(self.child.is_none());
        let log = self.dir.join(format!("redis-{}.log", self.port));
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .args(["--enable-debug-command", "local"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(&log)
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !pong(self.port) {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                panic!("redis-server on port {} exited ({st}):\n{log}", self.port);
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} not ready after 10 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn config(port: u16) -> StoreConfig {
    StoreConfig {
        nodes: vec![format!("127.0.0.1:{port}")],
        timeout: Duration::from_millis(500),
        connect_timeout: Duration::from_millis(200),
        ..StoreConfig::default()
    }
}

fn poll_readable(fd: RawFd, wait: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    unsafe { libc::poll(&mut p, 1, wait.as_millis() as libc::c_int) > 0 }
}

/// Waits on the wake fd and drains until `n` completions are in or `limit` passes.
fn collect(h: &StoreHandle, n: usize, limit: Duration) -> Vec<Completion> {
    let deadline = Instant::now() + limit;
    let mut out = Vec::new();
    while out.len() < n && Instant::now() < deadline {
        poll_readable(h.wake_fd(), Duration::from_millis(10));
        h.drain(&mut out);
    }
    out
}

fn set(key: &[u8], val: &[u8]) -> OpKind {
    OpKind::Set {
        key: key.to_vec(),
        val: val.to_vec(),
    }
}

fn get(key: &[u8]) -> OpKind {
    OpKind::Get { key: key.to_vec() }
}

/// Submits ops and checks that each completes exactly once, recording when.
#[derive(Default)]
struct Tracker {
    next: u64,
    sent: HashMap<u64, Instant>,
    done: HashMap<u64, (Completion, Duration)>,
    refused_at_submit: u64,
}

impl Tracker {
    fn submit(&mut self, h: &StoreHandle, kind: OpKind) -> u64 {
        let t = self.next;
        self.next += 1;
        self.sent.insert(t, Instant::now());
        if !h.submit(Op { token: t, kind }) {
            self.refused_at_submit += 1;
        }
        t
    }

    fn drain(&mut self, h: &StoreHandle) {
        let mut v = Vec::new();
        h.drain(&mut v);
        let now = Instant::now();
        for c in v {
            let sent = *self
                .sent
                .get(&c.token)
                .unwrap_or_else(|| panic!("unknown token {}", c.token));
            let token = c.token;
            assert!(
                self.done.insert(token, (c, now - sent)).is_none(),
                "token {token} completed twice"
            );
        }
    }

    fn wait_all(&mut self, h: &StoreHandle, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.done.len() < self.sent.len() {
            assert!(
                Instant::now() < deadline,
                "{} ops never completed",
                self.sent.len() - self.done.len()
            );
            poll_readable(h.wake_fd(), Duration::from_millis(5));
            self.drain(h);
        }
    }

    /// Submits SETs every few ms until one succeeds; returns how long that took.
    fn until_ok(&mut self, h: &StoreHandle, limit: Duration) -> Duration {
        let t0 = Instant::now();
        loop {
            let t = self.submit(h, set(b"probe", b"x"));
            self.wait_all(h, Duration::from_secs(2));
            if self.done[&t].0.result.is_ok() {
                return t0.elapsed();
            }
            assert!(
                t0.elapsed() < limit,
                "store did not recover within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

#[test]
fn round_trip_binary_blocking_and_async() {
    require_redis!();
    let dir = TempDir::new("rt");
    let r = Redis::start(&dir.0, free_port(false), &[]);
    let cfg = config(r.port);

    let mut s = Store::connect(&cfg).unwrap();
    assert!(!s.is_cluster());
    s.ping().unwrap();
    let big: Vec<u8> = (0..65_536u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let mut big_crlf = big.clone();
    big_crlf.extend_from_slice(b"\r\n\0\r\n");
    let mut nasty = b"a\r\nb\0c\r\n\r\n$3\r\n*1\r\n-ERR\r\n".to_vec();
    nasty.extend([0u8; 16]);
    let cases: Vec<(Vec<u8>, Vec<u8>)> = vec![
        (b"k\r\n\0key".to_vec(), nasty.clone()),
        (b"empty".to_vec(), vec![]),
        (vec![0, 255, 13, 10], big.clone()),
        (b"big\r\n".to_vec(), big_crlf.clone()),
        ([0u8; 300].to_vec(), b"\0".to_vec()),
    ];
    for (k, v) in &cases {
        s.set(k, v).unwrap();
        assert_eq!(s.get(k).unwrap().as_deref(), Some(&v[..]));
    }
    // The prefix is applied to every key.
    let mut full = b"ub:".to_vec();
    full.extend_from_slice(&cases[0].0);
    assert_eq!(
        s.command(&[b"GET", &full]).unwrap(),
        Reply::Bulk(Some(nasty.clone()))
    );
    assert_eq!(
        s.command(&[b"STRLEN", b"ub:big\r\n"]).unwrap(),
        Reply::Int(big_crlf.len() as i64)
    );
    for (k, _) in &cases {
        assert!(s.del(k).unwrap());
        assert_eq!(s.get(k).unwrap(), None);
        assert!(!s.del(k).unwrap());
    }
    assert!(
        matches!(s.command(&[b"NOSUCHCOMMAND"]), Err(StoreError::Server(m)) if m.contains("unknown command"))
    );
    s.ping().unwrap();

    let h = StoreHandle::start(&cfg).unwrap();
    assert!(!h.is_down() && !h.is_cluster());
    for (k, v) in &cases {
        let ops = [set(k, v), get(k), OpKind::Del { key: k.clone() }, get(k)];
        for (t, kind) in ops.into_iter().enumerate() {
            assert!(h.submit(Op {
                token: t as u64,
                kind
            }));
        }
        let got = collect(&h, 4, Duration::from_secs(5));
        let tokens: Vec<u64> = got.iter().map(|c| c.token).collect();
        assert_eq!(tokens, [0, 1, 2, 3], "one node answers in order");
        assert_eq!(got[0].result, Ok(None));
        assert_eq!(got[1].result.as_ref().unwrap().as_deref(), Some(&v[..]));
        assert_eq!(got[2].result, Ok(None));
        assert_eq!(got[3].result, Ok(None), "deleted");
    }
    let st = h.stats();
    assert_eq!((st.ops, st.completed, st.errors), (20, 20, 0), "{st:?}");
    assert!(h.try_recv().is_none());
}

#[test]
fn ttl_expires_keys() {
    require_redis!();
    let dir = TempDir::new("ttl");
    let r = Redis::start(&dir.0, free_port(false), &[]);
    let ttl = Duration::from_millis(400);
    let cfg = StoreConfig {
        ttl: Some(ttl),
        ..config(r.port)
    };

    let mut plain = Store::connect(&config(r.port)).unwrap();
    plain.set(b"forever", b"v").unwrap();
    assert_eq!(
        plain.command(&[b"PTTL", b"ub:forever"]).unwrap(),
        Reply::Int(-1)
    );

    let t0 = Instant::now();
    let mut s = Store::connect(&cfg).unwrap();
    s.set(b"ttl-sync", b"v").unwrap();
    let h = StoreHandle::start(&cfg).unwrap();
    h.submit(Op {
        token: 7,
        kind: set(b"ttl-async", b"w"),
    });
    assert_eq!(collect(&h, 1, Duration::from_secs(5))[0].result, Ok(None));
    for key in [&b"ub:ttl-sync"[..], b"ub:ttl-async"] {
        let Reply::Int(ms) = s.command(&[b"PTTL", key]).unwrap() else {
            panic!("PTTL reply")
        };
        assert!(
            ms > 0 && ms <= ttl.as_millis() as i64,
            "PTTL {key:?} = {ms}"
        );
    }
    // Gone after the TTL (bounded wait), and not before it.
    let deadline = t0 + ttl + Duration::from_secs(5);
    while s.get(b"ttl-sync").unwrap().is_some() || s.get(b"ttl-async").unwrap().is_some() {
        assert!(Instant::now() < deadline, "keys did not expire");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        t0.elapsed() >= ttl,
        "expired after {:?}, before the TTL",
        t0.elapsed()
    );
    assert_eq!(
        s.command(&[b"PTTL", b"ub:ttl-sync"]).unwrap(),
        Reply::Int(-2)
    );
    assert_eq!(plain.get(b"forever").unwrap().as_deref(), Some(&b"v"[..]));
}

#[test]
fn async_10k_pipelined_sets_complete_exactly_once() {
    require_redis!();
    let dir = TempDir::new("pipe");
    let r = Redis::start(&dir.0, free_port(false), &[]);
    // Generous timeout: this test is about completeness, not timing, on a shared 2-core box.
    let cfg = StoreConfig {
        timeout: Duration::from_secs(10),
        ..config(r.port)
    };
    let h = StoreHandle::start(&cfg).unwrap();
    let n = 10_000u64;
    let t0 = Instant::now();
    for t in 0..n {
        let key = format!("p/{t}");
        let val = format!("value-{t}-").repeat(1 + (t % 7) as usize);
        assert!(
            h.submit(Op {
                token: t,
                kind: set(key.as_bytes(), val.as_bytes())
            }),
            "op {t} refused"
        );
    }
    let got = collect(&h, n as usize, Duration::from_secs(30));
    let elapsed = t0.elapsed();
    let mut seen = vec![0u32; n as usize];
    for c in &got {
        assert_eq!(c.result, Ok(None), "token {}", c.token);
        seen[c.token as usize] += 1;
    }
    let missing = seen.iter().filter(|&&x| x == 0).count();
    let twice = seen.iter().filter(|&&x| x > 1).count();
    assert_eq!(
        (missing, twice),
        (0, 0),
        "each of {n} tokens must complete exactly once"
    );
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        h.try_recv().is_none(),
        "no completion beyond the ops submitted"
    );
    eprintln!(
        "10000 pipelined SETs: {elapsed:?}, max latency {:?}",
        h.stats().max_latency
    );

    // Read them back through the handle too.
    for t in 0..n {
        h.submit(Op {
            token: n + t,
            kind: get(format!("p/{t}").as_bytes()),
        });
    }
    let got = collect(&h, n as usize, Duration::from_secs(30));
    assert_eq!(got.len(), n as usize);
    for c in got {
        let t = c.token - n;
        let want = format!("value-{t}-").repeat(1 + (t % 7) as usize);
        assert_eq!(c.result.unwrap().as_deref(), Some(want.as_bytes()));
    }
    let st = h.stats();
    assert_eq!(
        (st.ops, st.completed, st.errors, st.fast_fails),
        (2 * n, 2 * n, 0, 0),
        "{st:?}"
    );
    assert_eq!(cli(r.port, &["dbsize"]), n.to_string());
}

/// Many small rounds of submit-then-wait, the consumer blocking on the wake fd alone: a lost
/// wake-up (of the worker or of the consumer) shows as a round stuck for a second or more.
#[test]
fn no_lost_wakeups() {
    require_redis!();
    let dir = TempDir::new("wake");
    let r = Redis::start(&dir.0, free_port(false), &[]);
    let cfg = StoreConfig {
        timeout: Duration::from_secs(5),
        ..config(r.port)
    };
    let h = StoreHandle::start(&cfg).unwrap();
    // CPU hogs, so that the worker and this thread get preempted at arbitrary points (the
    // narrow windows in which a wake-up could be lost).
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hogs: Vec<_> = (0..2)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let mut token = 0u64;
    let mut worst = Duration::ZERO;
    let mut out = Vec::new();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for round in 0..3000 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let k = 1 + (rng % 64) as usize;
        let t0 = Instant::now();
        for j in 0..k {
            assert!(h.submit(Op {
                token,
                kind: set(b"w", &token.to_le_bytes())
            }));
            token += 1;
            // Spread the burst over the worker's wake-up, where the races are.
            let spin = Instant::now() + Duration::from_nanos((rng >> (j % 32)) % 3000);
            while Instant::now() < spin {
                std::hint::spin_loop();
            }
        }
        out.clear();
        while out.len() < k {
            assert!(
                poll_readable(h.wake_fd(), Duration::from_secs(3)),
                "round {round}: {} of {k} completions, then no wake-up for 3 s",
                out.len()
            );
            h.drain(&mut out);
        }
        assert_eq!(out.len(), k);
        // The worker's poll wakes at least every second anyway: a lost wake-up costs ~1 s
        // (and, with the flag stuck, every round after it too).
        let took = t0.elapsed();
        assert!(
            took < Duration::from_millis(700),
            "round {round} took {took:?}: a lost wake-up"
        );
        worst = worst.max(took);
        if rng & 7 == 0 {
            std::thread::sleep(Duration::from_micros(rng % 300));
        }
    }
    stop.store(true, Ordering::Relaxed);
    for t in hogs {
        t.join().unwrap();
    }
    let st = h.stats();
    eprintln!("{token} ops in 3000 rounds: worst round {worst:?}; {st:?}");
    assert_eq!(st.errors, 0);
    assert!(st.max_latency < Duration::from_millis(700), "{st:?}");
}

#[test]
fn store_down_fails_fast_then_recovers() {
    require_redis!();
    let dir = TempDir::new("down");
    let mut r = Redis::start(&dir.0, free_port(false), &[]);
    let timeout = Duration::from_millis(50);
    let slack = Duration::from_millis(200);
    let cfg = StoreConfig {
        timeout,
        connect_timeout: Duration::from_millis(50),
        ..config(r.port)
    };
    let h = StoreHandle::start(&cfg).unwrap();
    let mut tr = Tracker::default();
    for i in 0..200u32 {
        tr.submit(&h, set(format!("before/{i}").as_bytes(), b"v"));
    }
    tr.wait_all(&h, Duration::from_secs(5));
    assert!(tr.done.values().all(|(c, _)| c.result.is_ok()));
    let before = tr.next;

    // A burst in flight, then SIGKILL, then keep submitting for 300 ms.
    let val = vec![b'x'; 1024];
    for i in 0..3000u32 {
        tr.submit(&h, set(format!("burst/{i}").as_bytes(), &val));
    }
    tr.drain(&h);
    let killed = Instant::now();
    r.kill();
    while killed.elapsed() < Duration::from_millis(300) {
        for i in 0..20u32 {
            tr.submit(&h, set(format!("after/{i}").as_bytes(), b"v"));
        }
        std::thread::sleep(Duration::from_millis(2));
        tr.drain(&h);
    }
    tr.wait_all(&h, Duration::from_secs(2));
    assert!(h.is_down());

    let (mut ok, mut down, mut timeouts, mut other) = (0, 0, 0, 0);
    let (mut max_latency, mut max_wall) = (Duration::ZERO, Duration::ZERO);
    for t in before..tr.next {
        let (c, wall) = &tr.done[&t];
        max_latency = max_latency.max(c.latency);
        max_wall = max_wall.max(*wall);
        match &c.result {
            Ok(_) => ok += 1,
            Err(StoreError::Down(_)) => down += 1,
            Err(StoreError::Timeout) => timeouts += 1,
            Err(_) => other += 1,
        }
    }
    let st = h.stats();
    eprintln!(
        "kill: {ok} ok, {down} down, {timeouts} timeouts, {other} other; {} refused at submit; \
         max latency {max_latency:?}, max wall {max_wall:?}; {st:?}",
        tr.refused_at_submit
    );
    assert!(down > 0 && other == 0);
    assert!(
        st.fast_fails > 0 && tr.refused_at_submit > 0,
        "the fast-fail path must be taken"
    );
    assert!(
        max_latency <= timeout + slack,
        "a completion took {max_latency:?}"
    );
    assert!(
        max_wall <= timeout + slack,
        "a completion was seen after {max_wall:?}"
    );

    // Same port again: the handle reconnects by itself.
    r.spawn();
    let took = tr.until_ok(&h, Duration::from_secs(5));
    eprintln!("recovered {took:?} after the restart");
    assert!(!h.is_down());
    assert!(h.stats().reconnects >= 1);
    let from = tr.next;
    for i in 0..1000u32 {
        tr.submit(&h, set(format!("again/{i}").as_bytes(), b"v"));
    }
    tr.wait_all(&h, Duration::from_secs(5));
    assert!((from..tr.next).all(|t| tr.done[&t].0.result.is_ok()));
    assert_eq!(tr.done.len(), tr.sent.len());
}

#[test]
fn start_while_down_then_store_comes_up() {
    require_redis!();
    let dir = TempDir::new("late");
    let port = free_port(false);
    let cfg = StoreConfig {
        timeout: Duration::from_millis(50),
        connect_timeout: Duration::from_millis(100),
        ..config(port)
    };
    assert!(matches!(Store::connect(&cfg), Err(StoreError::Down(_))));
    let t0 = Instant::now();
    let h = StoreHandle::start(&cfg).unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "start took {:?}",
        t0.elapsed()
    );
    assert!(h.is_down());
    let mut tr = Tracker::default();
    let t = tr.submit(&h, set(b"k", b"v"));
    assert_eq!(tr.refused_at_submit, 1);
    assert!(
        poll_readable(h.wake_fd(), Duration::ZERO),
        "wake fd set by the fast failure"
    );
    tr.drain(&h);
    assert!(
        matches!(tr.done[&t].0.result, Err(StoreError::Down(_))),
        "completed at once"
    );
    assert!(
        !poll_readable(h.wake_fd(), Duration::ZERO),
        "drain resets the wake fd"
    );
    let _r = Redis::start(&dir.0, port, &[]);
    let took = tr.until_ok(&h, Duration::from_secs(5));
    eprintln!("up {took:?} after redis started");
}

#[test]
fn slow_store_times_out_never_hangs() {
    require_redis!();
    let dir = TempDir::new("slow");
    let r = Redis::start(&dir.0, free_port(false), &[]);
    let timeout = Duration::from_millis(20);
    let slack = Duration::from_millis(200);
    let cfg = StoreConfig {
        timeout,
        connect_timeout: Duration::from_millis(500),
        ..config(r.port)
    };
    let h = StoreHandle::start(&cfg).unwrap();
    let mut tr = Tracker::default();
    tr.until_ok(&h, Duration::from_secs(2));

    // Stall redis for 200 ms, and make sure it is stalled: a PING on a third connection goes
    // unanswered for 15 ms.
    let mut dbg = TcpStream::connect(r.addr()).unwrap();
    dbg.write_all(b"*3\r\n$5\r\nDEBUG\r\n$5\r\nSLEEP\r\n$3\r\n0.2\r\n")
        .unwrap();
    let mut check = TcpStream::connect(r.addr()).unwrap();
    check
        .set_read_timeout(Some(Duration::from_millis(15)))
        .unwrap();
    let mut stalled = false;
    for _ in 0..100 {
        check.write_all(b"*1\r\n$4\r\nPING\r\n").unwrap();
        let mut buf = [0u8; 16];
        match check.read(&mut buf) {
            // Answered: not asleep yet.
            Ok(n) => assert!(n > 0, "connection closed"),
            Err(_) => {
                stalled = true;
                break;
            }
        }
    }
    assert!(stalled, "DEBUG SLEEP did not stall redis");

    let first = tr.next;
    for i in 0..50u32 {
        tr.submit(&h, set(format!("slow/{i}").as_bytes(), b"v"));
    }
    let first_end = tr.next;
    // Keep submitting until redis answers the DEBUG SLEEP.
    dbg.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 16];
    let t0 = Instant::now();
    loop {
        match dbg.read(&mut buf) {
            Ok(n) if n > 0 => break,
            _ => {}
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "DEBUG SLEEP never returned"
        );
        tr.submit(&h, set(b"during", b"v"));
        std::thread::sleep(Duration::from_millis(3));
        tr.drain(&h);
    }
    tr.wait_all(&h, Duration::from_secs(2));
    let st = h.stats();
    for t in first..first_end {
        assert_eq!(
            tr.done[&t].0.result,
            Err(StoreError::Timeout),
            "op {t} on the stalled store"
        );
    }
    let mut max = Duration::ZERO;
    let mut fast = 0;
    for t in first..tr.next {
        let (c, wall) = &tr.done[&t];
        max = max.max(c.latency).max(*wall);
        if matches!(c.result, Err(StoreError::Down(_))) {
            fast += 1;
        }
    }
    eprintln!("stall: max completion {max:?}, {fast} failed fast; {st:?}");
    assert!(max <= timeout + slack, "an op took {max:?}");
    assert!(st.timeouts >= 50 && st.fast_fails > 0);
    let took = tr.until_ok(&h, Duration::from_secs(3));
    eprintln!("recovered {took:?} after the stall ended");
}

/// The slot ranges `cluster nodes` lists for the node itself.
fn my_slots(port: u16) -> Vec<std::ops::RangeInclusive<u16>> {
    let nodes = cli(port, &["cluster", "nodes"]);
    let me = nodes
        .lines()
        .find(|l| l.contains("myself"))
        .expect("myself line");
    me.split_whitespace()
        .skip(8)
        .filter(|f| !f.starts_with('['))
        .map(|r| {
            let (a, b) = r.split_once('-').unwrap_or((r, r));
            a.parse::<u16>().unwrap()..=b.parse::<u16>().unwrap()
        })
        .collect()
}

fn owns(port: u16, slot: u16) -> bool {
    my_slots(port).iter().any(|r| r.contains(&slot))
}

#[test]
fn cluster_routing_moved_and_ask_from_one_seed() {
    require_redis!();
    let dir = TempDir::new("cluster");
    let mut ports: Vec<u16> = Vec::new();
    while ports.len() < 3 {
        let p = free_port(true);
        if !ports.contains(&p) {
            ports.push(p);
        }
    }
    // A short node timeout and partial coverage: when one master dies below, the others keep
    // serving their slots, and it can rejoin quickly.
    let mut nodes: Vec<Redis> = ports
        .iter()
        .map(|&p| {
            let conf = dir.0.join(format!("nodes-{p}.conf"));
            let extra = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                conf.to_str().unwrap(),
                "--cluster-node-timeout",
                "2000",
                "--cluster-require-full-coverage",
                "no",
            ];
            Redis::start(&dir.0, p, &extra.map(String::from))
        })
        .collect();
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let out = Command::new("redis-cli")
        .arg("--cluster")
        .arg("create")
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .expect("redis-cli --cluster create");
    assert!(
        out.status.success(),
        "cluster create failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ports
        .iter()
        .all(|&p| cli(p, &["cluster", "info"]).contains("cluster_state:ok"))
    {
        assert!(Instant::now() < deadline, "cluster_state never ok");
        std::thread::sleep(Duration::from_millis(50));
    }

    // Seeded with one node only.
    let cfg = StoreConfig {
        timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_millis(500),
        ..config(ports[0])
    };
    let h = StoreHandle::start(&cfg).unwrap();
    assert!(h.is_cluster() && !h.is_down());
    let n = 1000u64;
    let key = |i: u64| {
        if matches!(i % 10, 0) {
            format!("{{tag}}/{i}")
        } else {
            format!("c/{i}")
        }
    };
    for i in 0..n {
        h.submit(Op {
            token: i,
            kind: set(key(i).as_bytes(), format!("v{i}").as_bytes()),
        });
    }
    let got = collect(&h, n as usize, Duration::from_secs(20));
    assert_eq!(got.len(), n as usize);
    assert!(
        got.iter().all(|c| c.result == Ok(None)),
        "{:?}",
        got.iter().find(|c| c.result.is_err())
    );
    for i in 0..n {
        h.submit(Op {
            token: n + i,
            kind: get(key(i).as_bytes()),
        });
    }
    let got = collect(&h, n as usize, Duration::from_secs(20));
    assert_eq!(got.len(), n as usize);
    for c in got {
        let i = c.token - n;
        assert_eq!(
            c.result.unwrap(),
            Some(format!("v{i}").into_bytes()),
            "key {}",
            key(i)
        );
    }
    assert_eq!(
        h.stats().redirects,
        0,
        "routed by the slot map, no redirection needed"
    );
    let per_node: Vec<u64> = ports
        .iter()
        .map(|&p| cli(p, &["dbsize"]).parse().unwrap())
        .collect();
    assert_eq!(per_node.iter().sum::<u64>(), n);
    assert!(
        per_node.iter().all(|&k| k > 0),
        "keys on every node: {per_node:?}"
    );

    // Our CRC16 agrees with redis, hash tags included.
    let mut s = Store::connect(&cfg).unwrap();
    assert!(s.is_cluster());
    let masters = s.masters();
    assert_eq!(masters.len(), 3);
    for i in 0..200u32 {
        let k: Vec<u8> = match i % 4 {
            0 => format!("ub:{{user{i}}}.x").into_bytes(),
            1 => vec![i as u8, 0, b'\r', b'\n', (i >> 3) as u8],
            2 => format!("k{{}}{{{i}}}").into_bytes(),
            _ => format!("ub:c/{i}").into_bytes(),
        };
        let r = s
            .command_at(masters[0], &[b"CLUSTER", b"KEYSLOT", &k])
            .unwrap();
        assert_eq!(r, Reply::Int(key_slot(&k) as i64), "{k:?}");
    }
    for i in 0..300u32 {
        s.set(format!("sync/{i}").as_bytes(), &i.to_be_bytes())
            .unwrap();
    }
    for i in 0..300u32 {
        assert_eq!(
            s.get(format!("sync/{i}").as_bytes()).unwrap(),
            Some(i.to_be_bytes().to_vec())
        );
    }

    // Migrate the (empty) slot of one key from its owner A to B: ASK during the migration,
    // MOVED after it, both followed by the handle and by the blocking client.
    let k = b"migrating-key";
    let slot = key_slot(b"ub:migrating-key");
    let a = *ports.iter().find(|&&p| owns(p, slot)).expect("an owner");
    let b = *ports.iter().find(|&&p| p != a).unwrap();
    let id = |p: u16| cli(p, &["cluster", "myid"]);
    let slot_s = slot.to_string();
    assert_eq!(
        cli(b, &["cluster", "setslot", &slot_s, "importing", &id(a)]),
        "OK"
    );
    assert_eq!(
        cli(a, &["cluster", "setslot", &slot_s, "migrating", &id(b)]),
        "OK"
    );
    let before = h.stats().redirects;
    h.submit(Op {
        token: 1,
        kind: set(k, b"moved-value"),
    });
    assert_eq!(collect(&h, 1, Duration::from_secs(5))[0].result, Ok(None));
    h.submit(Op {
        token: 2,
        kind: get(k),
    });
    assert_eq!(
        collect(&h, 1, Duration::from_secs(5))[0].result,
        Ok(Some(b"moved-value".to_vec()))
    );
    assert_eq!(h.stats().redirects, before + 2, "two -ASK followed");
    assert_eq!(
        cli(b, &["cluster", "countkeysinslot", &slot_s]),
        "1",
        "the key went to B"
    );
    assert_eq!(
        s.get(k).unwrap(),
        Some(b"moved-value".to_vec()),
        "blocking client follows ASK"
    );
    for p in [b, a, *ports.iter().find(|&&p| p != a && p != b).unwrap()] {
        assert_eq!(
            cli(p, &["cluster", "setslot", &slot_s, "node", &id(b)]),
            "OK"
        );
    }
    h.submit(Op {
        token: 3,
        kind: get(k),
    });
    assert_eq!(
        collect(&h, 1, Duration::from_secs(5))[0].result,
        Ok(Some(b"moved-value".to_vec()))
    );
    assert_eq!(h.stats().redirects, before + 3, "one -MOVED followed");
    h.submit(Op {
        token: 4,
        kind: get(k),
    });
    assert_eq!(
        collect(&h, 1, Duration::from_secs(5))[0].result,
        Ok(Some(b"moved-value".to_vec()))
    );
    assert_eq!(h.stats().redirects, before + 3, "the map was updated");
    assert_eq!(
        s.get(k).unwrap(),
        Some(b"moved-value".to_vec()),
        "blocking client follows MOVED"
    );
    let st = h.stats();
    assert_eq!(
        (st.errors, st.ops, st.completed),
        (0, st.completed, 2 * n + 4),
        "{st:?}"
    );

    // A master dies: the keys of its slots fail fast, the other masters' keys still work. It
    // restarts (same port and cluster config, no data) and the handle uses it again.
    let dead = ports[2];
    let dead_slots = my_slots(dead);
    let on_dead = |i: u64| {
        dead_slots
            .iter()
            .any(|r| r.contains(&key_slot(format!("ub:{}", key(i)).as_bytes())))
    };
    nodes[2].kill();
    let deadline = Instant::now() + Duration::from_secs(2);
    while !h.is_down() {
        assert!(Instant::now() < deadline, "the dead master was not noticed");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut tr = Tracker::default();
    for i in 0..300 {
        tr.submit(&h, set(key(i).as_bytes(), b"after"));
    }
    tr.wait_all(&h, Duration::from_secs(5));
    let (mut dead_n, mut live_n) = (0, 0);
    for i in 0..300 {
        let r = &tr.done[&i].0.result;
        if on_dead(i) {
            dead_n += 1;
            assert!(
                matches!(r, Err(StoreError::Down(_))),
                "key {} on the dead master: {r:?}",
                key(i)
            );
        } else {
            live_n += 1;
            assert_eq!(*r, Ok(None), "key {} on a live master", key(i));
        }
    }
    assert!(dead_n > 0 && live_n > 0);
    assert_eq!(
        tr.refused_at_submit, dead_n,
        "the dead master's keys fail fast at submit"
    );
    nodes[2].spawn();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut tr = Tracker::default();
        for i in 0..300 {
            tr.submit(&h, set(key(i).as_bytes(), b"back"));
        }
        tr.wait_all(&h, Duration::from_secs(5));
        if tr.done.values().all(|(c, _)| c.result.is_ok()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the restarted master was not used again"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!h.is_down() && h.stats().reconnects >= 1, "{:?}", h.stats());
    drop(nodes);
}

fn percentiles(mut v: Vec<Duration>) -> String {
    v.sort();
    let p = |q: f64| v[((v.len() as f64 * q) as usize).min(v.len() - 1)];
    format!(
        "p50 {:?}  p99 {:?}  p99.9 {:?}  max {:?}",
        p(0.5),
        p(0.99),
        p(0.999),
        v[v.len() - 1]
    )
}

/// Not a timed test: prints round-trip latencies of single SETs on loopback.
#[test]
#[ignore]
fn latency_report() {
    require_redis!();
    let dir = TempDir::new("lat");
    let r = Redis::start(&dir.0, free_port(false), &[]);
    let cfg = config(r.port);
    let n = 10_000u32;
    let val = [7u8; 100];

    let mut s = Store::connect(&cfg).unwrap();
    let mut v = Vec::with_capacity(n as usize);
    for i in 0..n {
        let t = Instant::now();
        s.set(format!("lat/{i}").as_bytes(), &val).unwrap();
        v.push(t.elapsed());
    }
    eprintln!(
        "blocking Store::set, 100 B, {n} ops:       {}",
        percentiles(v)
    );

    let h = StoreHandle::start(&cfg).unwrap();
    let (mut lat, mut wall) = (Vec::new(), Vec::new());
    for i in 0..n {
        let t = Instant::now();
        h.submit(Op {
            token: i as u64,
            kind: set(format!("lat/{i}").as_bytes(), &val),
        });
        let c = collect(&h, 1, Duration::from_secs(1)).pop().unwrap();
        wall.push(t.elapsed());
        assert!(c.result.is_ok());
        lat.push(c.latency);
    }
    eprintln!(
        "StoreHandle SET, one at a time (latency):    {}",
        percentiles(lat)
    );
    eprintln!(
        "StoreHandle SET, one at a time (poll+drain): {}",
        percentiles(wall)
    );

    let m = 100_000u64;
    let t = Instant::now();
    let mut got = 0;
    let mut out = Vec::new();
    for i in 0..m {
        // Keep at most 8192 in flight, below the queue's capacity.
        while i as usize - got >= 8192 {
            poll_readable(h.wake_fd(), Duration::from_millis(10));
            got += h.drain(&mut out);
        }
        assert!(h.submit(Op {
            token: i,
            kind: set(b"tp", &val)
        }));
    }
    while got < m as usize {
        poll_readable(h.wake_fd(), Duration::from_millis(10));
        got += h.drain(&mut out);
    }
    assert!(out.iter().all(|c| c.result.is_ok()));
    let el = t.elapsed();
    eprintln!(
        "StoreHandle pipelined: {m} SETs in {el:?} ({:.0} ops/s); {:?}",
        m as f64 / el.as_secs_f64(),
        h.stats()
    );
}
