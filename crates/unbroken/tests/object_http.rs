//! Object mode's HTTP behaviour end to end in network namespaces (TRODS, seed 000, sections
//! 3.1 to 3.3): Redis, nginx and `unbroken agent` on three servers behind `unbroken lb`, and an
//! unmodified client (curl, wget, or plain Rust sockets) in the client namespace. Each test
//! kills the serving server (power loss) at a chosen point of an HTTP exchange and checks what
//! the client saw: every byte (sha256 or a full compare), the client's exit status, no RST, and
//! the agents' counters. The longest stall the client saw is printed.
//!
//! Needs root; without it each test prints why and passes without running (fails instead with
//! UNBROKEN_REQUIRE_LAB=1).

use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use unbroken::object::demo::{make_object, receive, service, EnvOpts, ObjectEnv, Received};
use unbroken_lab::lab;

/// One lab at a time: each test builds a whole system, and the machine has two cores.
static LAB: Mutex<()> = Mutex::new(());

const MIB: u64 = 1 << 20;

fn lab_or_skip(name: &str) -> Option<MutexGuard<'static, ()>> {
    if !lab::lab_or_skip(name) {
        return None;
    }
    Some(LAB.lock().unwrap_or_else(|e| e.into_inner()))
}

/// The running system of one test; when the test fails, what the LB and the agents saw is
/// printed before the system is torn down.
struct Env {
    /// With `UB_PCAP=<dir>`: tcpdump on the client's link (stopped before the lab goes).
    _capture: Option<Capture>,
    env: ObjectEnv,
    name: &'static str,
}

impl std::ops::Deref for Env {
    type Target = ObjectEnv;
    fn deref(&self) -> &ObjectEnv {
        &self.env
    }
}

impl std::ops::DerefMut for Env {
    fn deref_mut(&mut self) -> &mut ObjectEnv {
        &mut self.env
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}: FAILED; {}", self.name, diag(&self.env));
        }
    }
}

fn start(name: &'static str) -> Env {
    let t = Instant::now();
    let env = ObjectEnv::start(EnvOpts {
        bin: PathBuf::from(env!("CARGO_BIN_EXE_unbroken")),
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("{name}: starting the object-mode system: {e}"));
    eprintln!(
        "{name}: system up in {} ms ({})",
        t.elapsed().as_millis(),
        env.dir.display()
    );
    Env {
        _capture: capture(&env, name),
        env,
        name,
    }
}

fn sha_hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// Waits (bounded) until the agents' status files report at least `n` failovers in total
/// (they are written every 500 ms); returns the sum.
fn wait_failovers(env: &ObjectEnv, n: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let f = env.agent_sum("failovers");
        if f >= n || Instant::now() > deadline {
            return f;
        }
        std::thread::sleep(Duration::from_millis(50)); // polling status files with a deadline
    }
}

/// What the LB and the agents saw, for the log: liveness events (server, kind, silence ms),
/// each agent's failovers, denials, mutes and recent refusals, and the RSTs at the client.
fn diag(env: &ObjectEnv) -> String {
    let events: Vec<String> = env
        .lb_status()
        .ok()
        .and_then(|s| s["events"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .map(|e| {
            format!(
                "{}@{}ms:{}:{}",
                e["kind"].as_str().unwrap_or("?"),
                e["t_ms"],
                e["server"],
                e["detect_ms"]
            )
        })
        .collect();
    let agents: Vec<String> = (1..=env.lab.n_servers())
        .map(|i| match env.agent_status(i) {
            Some(v) => {
                let a = &v["agent"];
                format!(
                    "{i}: failovers {} denied {} muted {} refused {} {}",
                    a["failovers"],
                    a["failovers_denied"],
                    a["muted"],
                    a["refused"],
                    a["recent_refusals"]
                )
            }
            None => format!("{i}: no status"),
        })
        .collect();
    format!(
        "LB events {events:?}; agents {agents:?}; client RSTs {}",
        env.client_rsts()
    )
}

/// Counters every test asserts and prints: failovers (at least `min_failovers`), no refusal,
/// no RST at the client.
fn check_counters(name: &str, env: &ObjectEnv, min_failovers: u64) -> u64 {
    let failovers = wait_failovers(env, min_failovers);
    let refused = env.agent_sum("refused");
    let rsts = env.client_rsts();
    eprintln!(
        "{name}: failovers {failovers} (longest trigger-to-socket {} us), refused {refused}, resume errors {}, resume mismatches {}, probes {}, unprotected {}, LB down detections {:?} ms, client RSTs {rsts}",
        (1..=env.lab.n_servers()).filter_map(|i| env.agent_status(i)).filter_map(|v| v["agent"]["failover_us_max"].as_u64()).max().unwrap_or(0),
        env.agent_sum("resume_errors"),
        env.agent_sum("resume_mismatch"),
        env.agent_sum("probes_sent"),
        env.engine_sum("unprotected"),
        env.lb_status().ok().and_then(|s| s["events"].as_array().map(|e| e.iter().filter(|x| x["kind"] == "down").filter_map(|x| x["detect_ms"].as_u64()).collect::<Vec<_>>())).unwrap_or_default(),
    );
    for i in 1..=env.lab.n_servers() {
        if let Some(v) = env
            .agent_status(i)
            .filter(|v| v["engine"]["unprotected"].as_u64().unwrap_or(0) > 0)
        {
            eprintln!(
                "{name}: server {i} left a connection unprotected: engine {}, agent {}",
                v["engine"], v["agent"]
            );
        }
    }
    eprintln!("{name}: {}", diag(env));
    assert_eq!(rsts, 0, "{name}: RSTs reached the client");
    assert!(
        failovers >= min_failovers,
        "{name}: {failovers} failovers, expected at least {min_failovers}"
    );
    assert_eq!(refused, 0, "{name}: the agents refused a failover");
    failovers
}

/// Once every client closed its connection: every connection a live agent rebuilt ended with
/// its client's (its worker gone: `rebuilt_serving` 0, its line out of the agent's rebuilt
/// list, which a restarted agent would probe again; these tests restart no agent, so nothing
/// is inherited), and no record is left in the store (a record left behind is
/// probed when its bucket moves, and a finished connection would be rebuilt from it; the
/// client, in TIME_WAIT, answers, and the kernel's RST to that answer reaches it).
fn check_finished(name: &str, env: &ObjectEnv) {
    let live: Vec<usize> = (1..=env.lab.n_servers()).filter(|&i| !env.is_crashed(i)).collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    let left = loop {
        let left: Vec<(usize, u64, Vec<String>)> = live.iter().map(|&i| (i, env.rebuilt_serving(i), env.rebuilt_listed(i))).filter(|(_, n, l)| *n > 0 || !l.is_empty()).collect();
        if left.is_empty() || Instant::now() >= deadline {
            break left;
        }
        std::thread::sleep(Duration::from_millis(50)); // polling the agents' rebuilt lists
    };
    assert!(left.is_empty(), "{name}: rebuilt connections still served or listed after the client was done (server, serving, listed): {left:?}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let stored = loop {
        let r = env.records_stored();
        if r.as_ref().is_some_and(|r| r.is_empty()) || Instant::now() >= deadline {
            break r;
        }
        std::thread::sleep(Duration::from_millis(50)); // polling the store
    };
    assert_eq!(stored, Some(vec![]), "{name}: records of finished connections left in the store");
}

/// The client's local port of its (only) established connection to port 80, if any.
fn client_port(env: &ObjectEnv) -> Option<u16> {
    let out = lab::run(
        env.lab.client(),
        Command::new("ss").args(["-Htn", "state", "established", "( dport = :80 )"]),
    )
    .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let local = text.lines().next()?.split_whitespace().nth(2)?.to_string();
    local.rsplit(':').next()?.parse().ok()
}

/// The live server holding the client's connection from `port`, polled with a deadline.
fn serving(env: &ObjectEnv, port: u16) -> usize {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        if let Some(i) = env.serving(port) {
            return i;
        }
        assert!(
            Instant::now() < deadline,
            "no live server holds the client's connection from port {port}"
        );
        std::thread::sleep(Duration::from_millis(10)); // polling `ss` with a deadline
    }
}

/// With `UB_PCAP=<dir>`, a packet capture of the client's link (`<dir>/<test>.pcap`) for the
/// test's duration: the first thing to look at when a test fails.
struct Capture(std::process::Child);

impl Drop for Capture {
    fn drop(&mut self) {
        unsafe { libc::kill(self.0.id() as i32, libc::SIGINT) };
        let _ = self.0.wait();
    }
}

fn capture(env: &ObjectEnv, name: &str) -> Option<Capture> {
    let dir = std::env::var_os("UB_PCAP")?;
    let file = PathBuf::from(dir).join(format!("{name}.pcap"));
    let mut child = lab::spawn(
        env.lab.client(),
        Command::new("tcpdump")
            .args([
                "-i",
                unbroken_lab::objlab::dev::CLIENT,
                "-s",
                "256",
                "-U",
                "-w",
            ])
            .arg(&file)
            .args(["tcp", "port", "80"])
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped()),
    )
    .ok()?;
    let mut err = child.stderr.take()?;
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while !line.ends_with(b"\n") && err.read(&mut b).ok()? == 1 {
        line.push(b[0]);
    }
    eprintln!("{name}: capturing to {}", file.display());
    Some(Capture(child))
}

// ---- curl and wget ------------------------------------------------------------------------------

struct Download {
    exit: Option<i32>,
    recv: Received,
    stderr: String,
    /// (server, bytes received when it lost power).
    crashes: Vec<(usize, u64)>,
    ms: u64,
}

/// Runs an unmodified downloader in the client namespace, reading its stdout, and crashes the
/// serving server whenever the bytes received pass the next fraction of `size`.
fn download(
    name: &str,
    env: &mut ObjectEnv,
    cmd: &mut Command,
    size: u64,
    crash_at: &[f64],
) -> Download {
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(40);
    let mut child = env
        .client_cmd(cmd)
        .unwrap_or_else(|e| panic!("{name}: starting the client: {e}"));
    let progress = Arc::new(AtomicU64::new(0));
    let rx = receive(child.stdout.take().unwrap(), progress.clone());
    let mut err = child.stderr.take().unwrap();
    let errt = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut port = None;
    let mut crashes = Vec::new();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        if port.is_none() {
            port = client_port(env);
        }
        let got = progress.load(Ordering::Relaxed);
        if let (Some(p), Some(&f)) = (port, crash_at.get(crashes.len())) {
            if got as f64 >= f * size as f64 {
                let i = serving(env, p);
                env.crash(i)
                    .unwrap_or_else(|e| panic!("{name}: crashing server {i}: {e}"));
                eprintln!(
                    "{name}: {:>5} ms  server {i} loses power at {} of {} bytes",
                    t0.elapsed().as_millis(),
                    got,
                    size
                );
                crashes.push((i, got));
            }
        }
        std::thread::sleep(Duration::from_millis(5)); // polling progress to time the crashes
    };
    let recv = rx.join().unwrap();
    let stderr = errt.join().unwrap();
    let ms = t0.elapsed().as_millis() as u64;
    assert!(
        status.is_some(),
        "{name}: the client did not finish within 40 s ({} bytes; {stderr})",
        recv.bytes
    );
    Download {
        exit: status.and_then(|s| s.code()),
        recv,
        stderr,
        crashes,
        ms,
    }
}

/// Longest gap between the client's reads within 16 MiB after each crash point (curl's and
/// wget's own rate limiting pauses show too: they read in bursts).
fn stalls_after(d: &Download) -> Vec<u64> {
    d.crashes
        .iter()
        .map(|&(_, at)| {
            d.recv
                .gaps
                .iter()
                .filter(|&&(b, _)| b >= at && b < at + 16 * MIB)
                .map(|&(_, ms)| ms)
                .max()
                .unwrap_or(0)
        })
        .collect()
}

fn check_download(name: &str, d: &Download, want_sha: &str, want_len: u64, crashes: usize) {
    eprintln!(
        "{name}: exit {:?}, {} bytes in {} ms, crashes {:?}, longest gap {} ms, gap after each crash {:?} ms, gaps over 50 ms {:?}",
        d.exit,
        d.recv.bytes,
        d.ms,
        d.crashes,
        d.recv.max_gap_ms,
        stalls_after(d),
        d.recv.gaps
    );
    if d.exit != Some(0) || d.crashes.len() != crashes {
        eprintln!("{name}: the client said {:?}", d.stderr.trim());
    }
    assert_eq!(
        d.crashes.len(),
        crashes,
        "{name}: not every crash happened mid-transfer"
    );
    assert_eq!(
        d.exit,
        Some(0),
        "{name}: client exit status; it said: {}",
        d.stderr.trim()
    );
    assert_eq!(d.recv.bytes, want_len, "{name}: byte count");
    assert_eq!(
        d.recv.sha256, want_sha,
        "{name}: sha256 of the received bytes"
    );
}

fn curl(url: &str, rate: &str) -> Command {
    let mut c = Command::new("curl");
    c.args([
        "-sS",
        "-g",
        "--fail",
        "--max-time",
        "60",
        "-o",
        "-",
        "--limit-rate",
        rate,
        url,
    ]);
    c
}

// ---- a plain-socket HTTP client -----------------------------------------------------------------

/// One read of the client: bytes received before it, its length, when it returned, and how
/// long the client waited in it (its own pacing excluded).
#[derive(Clone, Copy)]
struct ReadEv {
    before: u64,
    n: u64,
    at: Instant,
    wait_ms: u64,
}

#[derive(Default)]
struct RxState {
    buf: Vec<u8>,
    eof: bool,
    err: Option<String>,
    reads: Vec<ReadEv>,
}

/// A plain `TcpStream` to the VIP made in the client namespace, with a reader thread that
/// keeps everything received (optionally pacing itself to `rate` bytes/s, like a slow client,
/// so a crash lands mid-transfer).
struct Client {
    s: TcpStream,
    port: u16,
    st: Arc<(Mutex<RxState>, Condvar)>,
    rate: Arc<AtomicU64>,
    reader: Option<JoinHandle<()>>,
    /// Parse position in the received bytes.
    pos: usize,
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.s.shutdown(Shutdown::Both);
        if let Some(h) = self.reader.take() {
            let _ = h.join();
        }
    }
}

/// A parsed response.
struct Resp {
    status: u16,
    head: String,
    body: Vec<u8>,
    /// When its first byte arrived.
    first_byte: Instant,
    /// Longest wait for data after its first byte.
    stall_ms: u64,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.head
            .split("\r\n")
            .skip(1)
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim())
    }
}

impl Client {
    fn connect(env: &ObjectEnv, ipv6: bool) -> Client {
        let s = lab::in_ns(env.lab.client(), || {
            TcpStream::connect_timeout(&service(ipv6), Duration::from_secs(3))
        })
        .unwrap()
        .unwrap_or_else(|e| panic!("connecting to the VIP: {e}"));
        let port = s.local_addr().unwrap().port();
        let st: Arc<(Mutex<RxState>, Condvar)> = Arc::default();
        let rate = Arc::new(AtomicU64::new(0));
        let (mut r, st2, rate2) = (s.try_clone().unwrap(), st.clone(), rate.clone());
        let reader = std::thread::spawn(move || {
            let mut tmp = vec![0u8; 128 << 10];
            let mut total = 0u64;
            let mut paced_from: Option<(Instant, u64)> = None;
            loop {
                let rate = rate2.load(Ordering::Relaxed);
                if rate == 0 {
                    paced_from = None;
                } else if let Some((t, b)) = paced_from {
                    let due = Duration::from_secs_f64((total - b) as f64 / rate as f64);
                    if let Some(d) = due.checked_sub(t.elapsed()) {
                        std::thread::sleep(d); // pacing: a slow reader, not synchronisation
                    }
                } else {
                    paced_from = Some((Instant::now(), total));
                }
                let ready = Instant::now();
                let res = r.read(&mut tmp);
                let at = Instant::now();
                let (lock, cv) = &*st2;
                let mut g = lock.lock().unwrap_or_else(|e| e.into_inner());
                match res {
                    Ok(0) => g.eof = true,
                    Ok(n) => {
                        g.reads.push(ReadEv {
                            before: total,
                            n: n as u64,
                            at,
                            wait_ms: (at - ready).as_millis() as u64,
                        });
                        g.buf.extend_from_slice(&tmp[..n]);
                        total += n as u64;
                    }
                    Err(e) => g.err = Some(e.to_string()),
                }
                let done = g.eof || g.err.is_some();
                drop(g);
                cv.notify_all();
                if done {
                    return;
                }
            }
        });
        Client {
            s,
            port,
            st,
            rate,
            reader: Some(reader),
            pos: 0,
        }
    }

    fn set_rate(&self, bytes_per_s: u64) {
        self.rate.store(bytes_per_s, Ordering::Relaxed);
    }

    fn send(&mut self, b: &[u8]) -> Instant {
        self.s
            .write_all(b)
            .unwrap_or_else(|e| panic!("client write: {e}"));
        Instant::now()
    }

    /// Blocks (bounded) until `pred` holds for the received state.
    fn wait<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut pred: impl FnMut(&RxState) -> Option<T>,
    ) -> T {
        let deadline = Instant::now() + timeout;
        let (lock, cv) = &*self.st;
        let mut g = lock.lock().unwrap();
        loop {
            if let Some(v) = pred(&g) {
                return v;
            }
            let now = Instant::now();
            let fail = if let Some(e) = &g.err {
                Some(format!(
                    "client connection failed while waiting for {what}: {e}"
                ))
            } else if g.eof {
                Some(format!("client connection ended while waiting for {what}"))
            } else if now >= deadline {
                Some(format!("timeout waiting for {what}"))
            } else {
                None
            };
            if let Some(f) = fail {
                let n = g.buf.len();
                drop(g); // the reader thread must not find the lock poisoned
                panic!(
                    "{f} ({n} bytes received on the connection from port {})",
                    self.port
                );
            }
            g = cv.wait_timeout(g, deadline - now).unwrap().0;
        }
    }

    fn wait_bytes(&self, n: u64) {
        self.wait(&format!("{n} bytes"), Duration::from_secs(20), |s| {
            (s.buf.len() as u64 >= n).then_some(())
        });
    }

    fn received(&self) -> u64 {
        self.st.0.lock().unwrap().buf.len() as u64
    }

    /// Reads the next response (a `HEAD` one has no body).
    fn response(&mut self, head_req: bool) -> Resp {
        let pos = self.pos;
        let hl = self.wait("a response header", Duration::from_secs(20), |s| {
            s.buf
                .get(pos..)
                .and_then(unbroken_engines::http::header_end)
        });
        let head = self.st.0.lock().unwrap().buf[pos..pos + hl].to_vec();
        let head = String::from_utf8(head).expect("response header is text");
        let status: u16 = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line: {head:?}"));
        assert!(head.starts_with("HTTP/1.1 "), "bad status line: {head:?}");
        let mut r = Resp {
            status,
            head,
            body: Vec::new(),
            first_byte: Instant::now(),
            stall_ms: 0,
        };
        let len: u64 = if head_req || status == 304 || status == 204 {
            0
        } else {
            r.header("content-length")
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no Content-Length in {:?}", r.head))
        };
        let end = pos + hl + len as usize;
        self.wait("a response body", Duration::from_secs(30), |s| {
            (s.buf.len() >= end).then_some(())
        });
        let g = self.st.0.lock().unwrap();
        r.body = g.buf[pos + hl..end].to_vec();
        let (p, e) = (pos as u64, end as u64);
        if let Some(first) = g.reads.iter().find(|x| x.before + x.n > p) {
            r.first_byte = first.at;
        }
        r.stall_ms = g
            .reads
            .iter()
            .filter(|x| x.before > p && x.before < e)
            .map(|x| x.wait_ms)
            .max()
            .unwrap_or(0);
        drop(g);
        self.pos = end;
        r
    }

    /// Waits (bounded) for the server's FIN after everything parsed.
    fn expect_eof(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let (lock, cv) = &*self.st;
        let mut g = lock.lock().unwrap();
        while !g.eof && g.err.is_none() && Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            g = cv.wait_timeout(g, left).unwrap().0;
        }
        let (eof, err, n) = (g.eof, g.err.clone(), g.buf.len());
        drop(g); // the reader thread must not find the lock poisoned
        assert!(
            err.is_none(),
            "connection failed instead of closing: {err:?}"
        );
        assert!(eof, "the server did not close the connection");
        assert_eq!(n, self.pos, "bytes after the last response");
    }
}

fn get(path: &str, close: bool) -> Vec<u8> {
    format!(
        "GET {path} HTTP/1.1\r\nHost: x\r\nUser-Agent: object_http\r\n{}\r\n",
        if close { "Connection: close\r\n" } else { "" }
    )
    .into_bytes()
}

fn read_file(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn assert_body(name: &str, what: &str, r: &Resp, want: &[u8]) {
    assert_eq!(r.body.len(), want.len(), "{name}: {what}: body length");
    if r.body != want {
        let at = r
            .body
            .iter()
            .zip(want)
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        panic!("{name}: {what}: body differs from the file at byte {at}");
    }
}

/// Crashes the server holding `c`'s connection; returns its number. A paced client reads at
/// full speed from then on, so the gap it sees is the failover's, not its own pacing's.
fn crash_serving(name: &str, env: &mut ObjectEnv, c: &Client) -> usize {
    let i = serving(env, c.port);
    env.crash(i)
        .unwrap_or_else(|e| panic!("{name}: crashing server {i}: {e}"));
    c.set_rate(0);
    eprintln!(
        "{name}: server {i} loses power after {} bytes received",
        c.received()
    );
    i
}

/// The kernel's `struct tcp_info` up to `tcpi_total_retrans` (glibc's libc crate lacks it).
#[repr(C)]
#[derive(Default)]
struct TcpInfo {
    state: u8,
    ca_state: u8,
    retransmits: u8,
    probes: u8,
    backoff: u8,
    options: u8,
    wscale: u8,
    flags: u8,
    rto: u32,
    ato: u32,
    snd_mss: u32,
    rcv_mss: u32,
    unacked: u32,
    rest: [u32; 18],
    total_retrans: u32,
}

/// `TCP_CLOSE` in `tcpi_state`.
const TCP_CLOSE: u8 = 7;

fn tcp_info(s: &TcpStream) -> TcpInfo {
    use std::os::fd::AsRawFd;
    let mut ti = TcpInfo::default();
    let mut len = std::mem::size_of::<TcpInfo>() as libc::socklen_t;
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            &mut ti as *mut TcpInfo as *mut libc::c_void,
            &mut len,
        )
    };
    assert_eq!(r, 0, "TCP_INFO: {}", std::io::Error::last_os_error());
    ti
}

/// Polls (bounded) the client socket's TCP_INFO until `pred` holds.
fn wait_tcp(
    name: &str,
    s: &TcpStream,
    what: &str,
    timeout: Duration,
    pred: impl Fn(&TcpInfo) -> bool,
) {
    let deadline = Instant::now() + timeout;
    loop {
        let ti = tcp_info(s);
        if pred(&ti) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name}: timeout waiting for {what} (state {}, unacked {}, retransmitted {})",
            ti.state,
            ti.unacked,
            ti.total_retrans
        );
        std::thread::sleep(Duration::from_millis(5)); // polling TCP_INFO with a deadline
    }
}

// ---- case ③: during download, with curl and wget ------------------------------------------------

/// Case ③ twice in one connection; the second crash hits the server that recovered it (the
/// second failure of a recovered connection).
#[test]
fn case3_download_curl_two_deaths_v4() {
    const NAME: &str = "case3_download_curl_two_deaths_v4";
    let Some(_g) = lab_or_skip(NAME) else { return };
    let mut env = start(NAME);
    let size = 128 * MIB;
    let want = make_object(&env.docroot.join("x"), size, 3).unwrap();
    let url = env.url(false, "/x");
    let d = download(NAME, &mut env, &mut curl(&url, "30M"), size, &[0.30, 0.65]);
    check_download(NAME, &d, &want, size, 2);
    assert_ne!(
        d.crashes[0].0, d.crashes[1].0,
        "{NAME}: the second crash must hit the recovering server"
    );
    let f = check_counters(NAME, &env, 2);
    // One per crash; more only when the LB saw a live server flap (an overloaded machine).
    assert!(f >= 2, "{NAME}: one failover per crash, got {f}");
    check_finished(NAME, &env);
}

#[test]
fn case3_download_ipv6() {
    const NAME: &str = "case3_download_ipv6";
    let Some(_g) = lab_or_skip(NAME) else { return };
    let mut env = start(NAME);
    let size = 64 * MIB;
    let want = make_object(&env.docroot.join("x"), size, 6).unwrap();
    let url = env.url(true, "/x");
    let d = download(NAME, &mut env, &mut curl(&url, "25M"), size, &[0.40]);
    check_download(NAME, &d, &want, size, 1);
    check_counters(NAME, &env, 1);
    check_finished(NAME, &env);
}

#[test]
fn case3_wget() {
    const NAME: &str = "case3_wget";
    let Some(_g) = lab_or_skip(NAME) else { return };
    let mut env = start(NAME);
    let size = 64 * MIB;
    let want = make_object(&env.docroot.join("w.bin"), size, 7).unwrap();
    let url = env.url(false, "/w.bin");
    let mut cmd = Command::new("wget");
    cmd.args([
        "-q",
        "-O",
        "-",
        "--tries=1",
        "--timeout=30",
        "--limit-rate=25m",
        &url,
    ]);
    let d = download(NAME, &mut env, &mut cmd, size, &[0.40]);
    check_download(NAME, &d, &want, size, 1);
    check_counters(NAME, &env, 1);
    check_finished(NAME, &env);
}

// ---- case ②: during setup -----------------------------------------------------------------------

/// The server dies after the handshake is stored and before the request is sent: the request
/// goes to a new server, which rebuilds the connection from the stored handshake.
#[test]
fn case2_during_setup() {
    const NAME: &str = "case2_during_setup";
    let Some(_g) = lab_or_skip(NAME) else { return };
    let mut env = start(NAME);
    let size = 16 * MIB;
    let want = make_object(&env.docroot.join("obj"), size, 2).unwrap();
    let mut c = Client::connect(&env, false);
    let i = serving(&env, c.port);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let engine = env
            .agent_status(i)
            .map(|v| v["engine"].clone())
            .unwrap_or_default();
        if engine["stores_ok"].as_u64().unwrap_or(0) >= 1 {
            break;
        }
        assert_eq!(engine["stores_failed"].as_u64().unwrap_or(0), 0, "{NAME}: server {i} could not store the handshake in time (store timeout; overloaded machine?)");
        assert!(
            Instant::now() < deadline,
            "{NAME}: server {i} never stored the handshake"
        );
        std::thread::sleep(Duration::from_millis(20)); // polling the status file with a deadline
    }
    env.crash(i).unwrap();
    eprintln!("{NAME}: server {i} loses power after the handshake, before the request");
    let sent = c.send(b"GET /obj HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let r = c.response(false);
    let latency = r.first_byte.duration_since(sent).as_millis();
    assert_eq!(r.status, 200, "{NAME}: {}", r.head);
    assert_eq!(r.body.len() as u64, size, "{NAME}: body length");
    assert_eq!(sha_hex(&r.body), want, "{NAME}: body sha256");
    c.expect_eof();
    eprintln!(
        "{NAME}: request to first byte {latency} ms (the stall), longest gap in the body {} ms",
        r.stall_ms
    );
    check_counters(NAME, &env, 1);
    assert_ne!(env.serving(c.port), Some(i));
    drop(c);
    check_finished(NAME, &env);
}

// ---- case ④: after download, on a keep-alive connection -----------------------------------------

#[test]
fn case4_after_download_keepalive() {
    const NAME: &str = "case4_after_download_keepalive";
    let Some(_g) = lab_or_skip(NAME) else { return };
    let mut env = start(NAME);
    let a = env.docroot.join("a");
    let b = env.docroot.join("b");
    make_object(&a, 16 * MIB + 12345, 41).unwrap();
    make_object(&b, 16 * MIB + 777, 42).unwrap();
    let (fa, fb) = (read_file(&a), read_file(&b));
    let mut c = Client::connect(&env, false);
    c.send(&get("/a", false));
    let r1 = c.response(false);
    assert_eq!(r1.status, 200, "{NAME}: {}", r1.head);
    assert_body(NAME, "GET /a", &r1, &fa);
    let i = crash_serving(NAME, &mut env, &c);
    let sent = c.send(&get("/b", false));
    let r2 = c.response(false);
    let latency = r2.first_byte.duration_since(sent).as_millis();
    assert_eq!(r2.status, 200, "{NAME}: {}", r2.head);
    assert_body(NAME, "GET /b after the crash", &r2, &fb);
    c.send(&get("/a", true));
    let r3 = c.response(false);
    assert_eq!(r3.status, 200, "{NAME}: {}", r3.head);
    assert_body(NAME, "third request", &r3, &fa);
    c.expect_eof();
    eprintln!("{NAME}: GET /b after the crash: request to first byte {latency} ms (the stall), longest gap in its body {} ms", r2.stall_ms);
    check_counters(NAME, &env, 1);
    assert_ne!(env.serving(c.port), Some(i));
    drop(c);
    check_finished(NAME, &env);
}

// ---- extensions (section 3.3) -------------------------------------------------------------------

/// Two pipelined requests in one segment; the server dies during the first response.
#[test]
fn extension_pipelined() {
    const NAME: &str = "extension_pipelined";
    let Some(_g) = lab_or_skip(NAME) else { return };
    let mut env = start(NAME);
    let big_len = 64 * MIB + 3;
    let (big, small) = (env.docroot.join("big"), env.docroot.join("small"));
    make_object(&big, big_len, 61).unwrap();
    make_object(&small, 300_001, 62).unwrap();
    let (fbig, fsmall) = (read_file(&big), read_file(&small));
    let mut c = Client::connect(&env, false);
    c.set_rate(32 * MIB);
    let mut req = get("/big", false);
    req.extend_from_slice(&get("/small", true));
    c.send(&req);
    c.wait_bytes(big_len * 3 / 10);
    crash_serving(NAME, &mut env, &c);
    let r1 = c.response(false);
    assert_eq!(r1.status, 200, "{NAME}: {}", r1.head);
    assert_body(NAME, "GET /big", &r1, &fbig);
    let r2 = c.response(false);
    assert_eq!(r2.status, 200, "{NAME}: {}", r2.head);
    assert_body(NAME, "GET /small", &r2, &fsmall);
    c.expect_eof();
    eprintln!(
        "{NAME}: longest gap in /big's body {} ms (the stall)",
        r1.stall_ms
    );
    check_counters(NAME, &env, 1);
    drop(c);
    check_finished(NAME, &env);
}

/// The client asks for a range itself (a 206 response is resumed inside its range).
#[test]
fn extension_client_range() {
    const NAME: &str = "extension_client_range";
    let Some(_g) = lab_or_skip(NAME) else { return };
    let mut env = start(NAME);
    let size = 64 * MIB;
    let path = env.docroot.join("r.bin");
    make_object(&path, size, 71).unwrap();
    let want = sha_hex(&read_file(&path)[1_000_000..]);
    let url = env.url(false, "/r.bin");
    let mut cmd = curl(&url, "25M");
    cmd.args(["-r", "1000000-"]);
    let d = download(NAME, &mut env, &mut cmd, size - 1_000_000, &[0.40]);
    check_download(NAME, &d, &want, size - 1_000_000, 1);
    check_counters(NAME, &env, 1);
    check_finished(NAME, &env);
}

/// HEAD, a 304 and a 404 on one keep-alive connection, the server dying after the 304.
#[test]
fn extension_head_304_404() {
    const NAME: &str = "extension_head_304_404";
    let Some(_g) = lab_or_skip(NAME) else { return };
    let mut env = start(NAME);
    let a = env.docroot.join("a");
    make_object(&a, 4 * MIB + 5, 81).unwrap();
    let fa = read_file(&a);
    // The 404 as served before any crash, on a connection of its own.
    let want_404 = {
        let mut c0 = Client::connect(&env, false);
        c0.send(&get("/missing", true));
        let r = c0.response(false);
        assert_eq!(r.status, 404, "{NAME}: {}", r.head);
        c0.expect_eof();
        r.body
    };
    let mut c = Client::connect(&env, false);
    c.send(b"HEAD /a HTTP/1.1\r\nHost: x\r\n\r\n");
    let h = c.response(true);
    assert_eq!(h.status, 200, "{NAME}: {}", h.head);
    assert_eq!(
        h.header("content-length"),
        Some(fa.len().to_string().as_str()),
        "{NAME}: HEAD Content-Length"
    );
    let etag = h
        .header("etag")
        .unwrap_or_else(|| panic!("{NAME}: no ETag in {:?}", h.head))
        .to_string();
    c.send(format!("GET /a HTTP/1.1\r\nHost: x\r\nIf-None-Match: {etag}\r\n\r\n").as_bytes());
    let n = c.response(false);
    assert_eq!(n.status, 304, "{NAME}: {}", n.head);
    assert_eq!(n.header("etag"), Some(etag.as_str()), "{NAME}: 304 ETag");
    let i = crash_serving(NAME, &mut env, &c);
    let sent = c.send(&get("/missing", false));
    let m = c.response(false);
    let latency = m.first_byte.duration_since(sent).as_millis();
    assert_eq!(m.status, 404, "{NAME}: {}", m.head);
    assert_eq!(
        m.body, want_404,
        "{NAME}: the 404 body differs from the one served before the crash"
    );
    c.send(&get("/a", true));
    let g = c.response(false);
    assert_eq!(g.status, 200, "{NAME}: {}", g.head);
    assert_eq!(
        g.header("etag"),
        Some(etag.as_str()),
        "{NAME}: ETag after the failover"
    );
    assert_body(NAME, "GET /a after the crash", &g, &fa);
    c.expect_eof();
    eprintln!(
        "{NAME}: GET /missing after the crash: request to first byte {latency} ms (the stall)"
    );
    check_counters(NAME, &env, 1);
    assert_ne!(env.serving(c.port), Some(i));
    drop(c);
    check_finished(NAME, &env);
}

/// A request header of ~3000 bytes in three segments, the server dying mid-download.
#[test]
fn extension_headers_spanning_segments() {
    const NAME: &str = "extension_headers_spanning_segments";
    let Some(_g) = lab_or_skip(NAME) else { return };
    let mut env = start(NAME);
    let size = 64 * MIB;
    let path = env.docroot.join("h.bin");
    let want = make_object(&path, size, 91).unwrap();
    let mut req = b"GET /h.bin HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".to_vec();
    let mut k = 0;
    while req.len() < 3000 {
        req.extend_from_slice(format!("X-Pad-{k}: {}\r\n", "p".repeat(40)).as_bytes());
        k += 1;
    }
    req.extend_from_slice(b"\r\n");
    let mut c = Client::connect(&env, false);
    c.s.set_nodelay(true).unwrap();
    c.set_rate(32 * MIB);
    let third = req.len() / 3;
    for part in [&req[..third], &req[third..2 * third], &req[2 * third..]] {
        c.send(part);
    }
    c.wait_bytes(size * 4 / 10);
    crash_serving(NAME, &mut env, &c);
    let r = c.response(false);
    assert_eq!(r.status, 200, "{NAME}: {}", r.head);
    assert_eq!(r.body.len() as u64, size, "{NAME}: body length");
    assert_eq!(sha_hex(&r.body), want, "{NAME}: body sha256");
    c.expect_eof();
    eprintln!(
        "{NAME}: {} request bytes in 3 writes; longest gap in the body {} ms (the stall)",
        req.len(),
        r.stall_ms
    );
    check_counters(NAME, &env, 1);
    drop(c);
    check_finished(NAME, &env);
}

/// Case ④ after the server's FIN: the server closed after its response (`Connection: close`),
/// the client has not closed yet, and its request, which TRODS keeps unacknowledged until the
/// response is received, is retransmitted after the FIN. The server's ACK for it carries the
/// sequence number after the FIN. Then the server dies and the client closes: the new server
/// should send the FIN again (`Plan::refin`) and the client see no RST.
#[test]

fn case4_after_server_fin() {
    const NAME: &str = "case4_after_server_fin";
    let Some(_g) = lab_or_skip(NAME) else { return };
    let mut env = start(NAME);
    let path = env.docroot.join("f");
    make_object(&path, 100_000, 44).unwrap();
    let f = read_file(&path);
    let mut c = Client::connect(&env, false);
    let i = serving(&env, c.port);
    c.send(&get("/f", true));
    let r = c.response(false);
    assert_eq!(r.status, 200, "{NAME}: {}", r.head);
    assert_body(NAME, "GET /f", &r, &f);
    c.expect_eof();
    // The request is acknowledged once the client has the whole response and the moved hold
    // is stored (by an ACK the engine injects; before, only by the server's answer to the
    // client's retransmission of it).
    wait_tcp(
        NAME,
        &c.s,
        "the ACK of the request",
        Duration::from_secs(5),
        |t| t.unacked == 0,
    );
    // The status file is rewritten every 500 ms: wait for one written after the ACK.
    let acked_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let deadline = Instant::now() + Duration::from_secs(3);
    let engine = loop {
        let v = env.agent_status(i).unwrap_or_default();
        if v["wall_ms"].as_u64().is_some_and(|w| w > acked_ms + 20) {
            break v["engine"].clone();
        }
        assert!(
            Instant::now() < deadline,
            "{NAME}: server {i}'s status file is not updated"
        );
        std::thread::sleep(Duration::from_millis(20)); // polling the status file with a deadline
    };
    eprintln!(
        "{NAME}: server {i} before the crash: unprotected {}, unprotected_http {}, deletes {}",
        engine["unprotected"], engine["unprotected_http"], engine["deletes"]
    );
    env.crash(i).unwrap();
    c.s.shutdown(Shutdown::Write).unwrap();
    wait_tcp(
        NAME,
        &c.s,
        "the connection to close",
        Duration::from_secs(10),
        |t| t.state == TCP_CLOSE,
    );
    let failovers = wait_failovers(&env, 1);
    let refusals: Vec<_> = (1..=env.lab.n_servers())
        .filter_map(|k| env.agent_status(k))
        .map(|v| v["agent"]["recent_refusals"].clone())
        .collect();
    eprintln!("{NAME}: after the client's FIN: failovers {failovers}, refusals {refusals:?}, client RSTs {}", env.client_rsts());
    assert_eq!(
        engine["unprotected"].as_u64(),
        Some(0),
        "{NAME}: the server stopped protecting the connection after its FIN"
    );
    check_counters(NAME, &env, 1);
    drop(c);
    check_finished(NAME, &env);
}

/// The client ports of the connections established on server `i`.
fn established_ports(env: &ObjectEnv, i: usize) -> Vec<u16> {
    let out = lab::run(
        env.lab.server(i),
        Command::new("ss").args(["-Htn", "state", "established", "( sport = :80 )"]),
    )
    .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            l.split_whitespace()
                .nth(3)?
                .rsplit(':')
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// Section 2.1 ("if [the LB] sends the subsequent packets of an existing connection to a new
/// server, the connection is dealt with as a normal case of failover"), then a real failure.
/// Connections opened while server 1 is down land on servers 2 and 3; when server 1 comes back
/// the LB gives its home buckets back and those connections fail over to it while their
/// original sockets on 2 and 3 live on (muted). Then server 1 dies: the buckets return to 2
/// and 3, which must rebuild the connections although their own original sockets still hold
/// the address pair. The same happens after a falsely detected death (an agent descheduled for
/// longer than `dead_after_ms` on a loaded machine): seen in `extension_pipelined` under load.
#[test]

fn reassigned_connection_fails_back_after_a_crash() {
    const NAME: &str = "reassigned_connection_fails_back_after_a_crash";
    let Some(_g) = lab_or_skip(NAME) else { return };
    let mut env = start(NAME);
    let path = env.docroot.join("s");
    make_object(&path, 200_001, 12).unwrap();
    let f = read_file(&path);
    env.crash(1).unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    while !env.lb_status().is_ok_and(|s| {
        s["servers"]
            .as_array()
            .is_some_and(|v| v.iter().any(|x| x["id"] == 1 && x["alive"] == false))
    }) {
        assert!(
            Instant::now() < deadline,
            "{NAME}: the LB did not notice server 1's death"
        );
        std::thread::sleep(Duration::from_millis(10)); // polling the LB's status with a deadline
    }
    // Whether a connection's bucket is homed on server 1 depends on its port: with 12, none was
    // in about one run of 130 ((2/3)^12); with 36, one in two million.
    let mut clients: Vec<Client> = (0..36).map(|_| Client::connect(&env, false)).collect();
    for c in clients.iter_mut() {
        c.send(&get("/s", false));
        let r = c.response(false);
        assert_eq!(r.status, 200, "{NAME}: {}", r.head);
        assert_body(NAME, "GET /s before", &r, &f);
    }
    env.revive(1).unwrap();
    env.wait_alive(&[1], Duration::from_secs(10)).unwrap();
    // Every connection asks again: those whose bucket went home fail over to server 1.
    for c in clients.iter_mut() {
        c.send(&get("/s", false));
        let r = c.response(false);
        assert_eq!(r.status, 200, "{NAME}: {}", r.head);
        assert_body(NAME, "GET /s after server 1 came back", &r, &f);
    }
    let on1 = established_ports(&env, 1);
    let moved: Vec<usize> = (0..clients.len())
        .filter(|&k| on1.contains(&clients[k].port))
        .collect();
    assert!(
        !moved.is_empty(),
        "{NAME}: none of {} connections' buckets was homed on server 1 (about one run in two million)",
        clients.len()
    );
    let deadline = Instant::now() + Duration::from_secs(3);
    while env.agent_sum("muted") < moved.len() as u64 {
        assert!(
            Instant::now() < deadline,
            "{NAME}: the original sockets were not muted"
        );
        std::thread::sleep(Duration::from_millis(50)); // polling status files with a deadline
    }
    eprintln!(
        "{NAME}: {} of {} connections moved to server 1 and were muted on their first server",
        moved.len(),
        clients.len()
    );
    env.crash(1).unwrap();
    for &k in &moved {
        let c = &mut clients[k];
        let sent = c.send(&get("/s", false));
        let r = c.response(false);
        assert_eq!(r.status, 200, "{NAME}: {}", r.head);
        assert_body(NAME, "GET /s after server 1 died", &r, &f);
        eprintln!(
            "{NAME}: port {}: request to first byte {} ms",
            c.port,
            r.first_byte.duration_since(sent).as_millis()
        );
    }
    check_counters(NAME, &env, 2 * moved.len() as u64);
    drop(clients);
    check_finished(NAME, &env);
}

// ---- revive: a dead server comes back during a download -------------------------------------------

/// A keep-alive client: two consecutive Range GETs (first half, second half) on one
/// `http.client` connection, both bodies to stdout, read as fast as they come. Exits 3 if
/// http.client had to open a second connection, 2 on a status other than 206, 4 on a short
/// body (http.client's read(n) takes an early end of the connection for the body's end).
const PY_TWO_RANGES: &str = r#"
import http.client, sys, hashlib
H = hashlib.sha256()
host, path, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
c = http.client.HTTPConnection(host, 80, timeout=60)
out = sys.stdout.buffer
half = size // 2
ports, total = [], 0
for first, last in ((0, half - 1), (half, size - 1)):
    c.request("GET", path, headers={"Range": "bytes=%d-%d" % (first, last)})
    ports.append(c.sock.getsockname()[1])
    r = c.getresponse()
    if r.status != 206:
        sys.stderr.write("status %d\n" % r.status)
        sys.exit(2)
    want, n = last - first + 1, 0
    while True:
        b = r.read(256 * 1024)
        if not b:
            break
        out.write(b)
        out.flush()
        H.update(b)
        n += len(b)
    if n != want:
        sys.stderr.write("short body: %d of %d bytes (range %d-%d)\n" % (n, want, first, last))
        sys.exit(4)
    total += n
if len(set(ports)) != 1:
    sys.stderr.write("reconnected: ports %r\n" % ports)
    sys.exit(3)
sys.stderr.write("CLIENT bytes %d sha256 %s\n" % (total, H.hexdigest()))
"#;

/// Runs `cmd` (a download of `size` bytes, read as fast as it comes: the stand-in must be
/// sending at full speed when the bucket goes home) in the client namespace; when 15 % has
/// arrived, the serving server loses power; once the LB has declared it dead and the
/// connection failed over to a stand-in, it boots again, its buckets return home, and the connection must
/// move back to it (the stand-in stops, the home server rebuilds it). Checks what the client
/// saw: exit 0, every byte (sha256), no RST, no hang (a generous deadline), the stalls; and
/// that the connection really went home (muted on the stand-in, established on the home
/// server).
fn revive_during_download(name: &'static str, size: u64, seed: u64, cmd: impl FnOnce(&ObjectEnv) -> Command) {
    let mut env_ = start(name);
    let env = &mut *env_;
    let want = make_object(&env.docroot.join("r.bin"), size, seed).unwrap();
    let mut cmd = cmd(env);
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(60);
    let mut child = env.client_cmd(&mut cmd).unwrap_or_else(|e| panic!("{name}: starting the client: {e}"));
    let progress = Arc::new(AtomicU64::new(0));
    let rx = receive(child.stdout.take().unwrap(), progress.clone());
    let mut err = child.stderr.take().unwrap();
    let errt = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let wait_until = |what: &str, child: &mut std::process::Child, f: &mut dyn FnMut() -> bool| {
        while !f() {
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("{name}: timeout waiting for {what} ({} bytes received)", progress.load(Ordering::Relaxed));
            }
            if let Ok(Some(st)) = child.try_wait() {
                panic!("{name}: the client ended ({st}) while waiting for {what}");
            }
            std::thread::sleep(Duration::from_millis(5)); // polling with a deadline
        }
    };
    wait_until("15 % of the object", &mut child, &mut || progress.load(Ordering::Relaxed) >= size * 15 / 100);
    let port = client_port(env).unwrap_or_else(|| panic!("{name}: no client connection"));
    let home = serving(env, port);
    let at_crash = progress.load(Ordering::Relaxed);
    env.crash(home).unwrap_or_else(|e| panic!("{name}: crashing server {home}: {e}"));
    eprintln!("{name}: {:>5} ms  server {home} loses power at {at_crash} bytes", t0.elapsed().as_millis());
    wait_until("the LB to declare the death", &mut child, &mut || {
        env.lb_status().is_ok_and(|s| s["events"].as_array().is_some_and(|e| e.iter().any(|x| x["server"] == home as u64 && x["kind"] == "down")))
    });
    wait_until("the failover to a stand-in", &mut child, &mut || env.agent_sum("failovers") >= 1 && env.serving(port).is_some());
    let stand_in = env.serving(port).unwrap();
    // The client pauses while the server's links come back (so this machine's speed cannot
    // let the download end first) and reads at full speed again before nginx and the agent
    // start: the bucket goes home while the stand-in is sending as fast as it can.
    let pid = child.id() as i32;
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let revived = env.lab.revive_server(home);
    unsafe { libc::kill(pid, libc::SIGCONT) };
    if let Err(e) = revived.and_then(|_| env.start_server(home)) {
        let _ = child.kill();
        panic!("{name}: reviving server {home}: {e}");
    }
    env.wait_alive(&[home], Duration::from_secs(10)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let at_revive = progress.load(Ordering::Relaxed);
    eprintln!("{name}: {:>5} ms  server {home} is back at {at_revive} bytes (stand-in {stand_in})", t0.elapsed().as_millis());
    assert!(at_revive < size, "{name}: the download ended before the revive (a faster machine: use a larger object)");
    wait_until("the connection to move home", &mut child, &mut || env.agent_sum("muted") >= 1 && env.serving(port) == Some(home));
    eprintln!("{name}: {:>5} ms  the connection is home again", t0.elapsed().as_millis());
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{name}: HANG: the client did not finish within 60 s ({} of {size} bytes)", progress.load(Ordering::Relaxed));
        }
        std::thread::sleep(Duration::from_millis(10)); // polling the client's exit with a deadline
    };
    let recv = rx.join().unwrap();
    let stderr = errt.join().unwrap();
    eprintln!(
        "{name}: exit {:?}, {} bytes in {} ms, longest gap {} ms, gaps over 50 ms {:?}, superseded {}",
        status.code(),
        recv.bytes,
        t0.elapsed().as_millis(),
        recv.max_gap_ms,
        recv.gaps,
        env.agent_sum("superseded")
    );
    assert_eq!(status.code(), Some(0), "{name}: client exit status; it said: {}", stderr.trim());
    // A client that hashes what it received itself (`CLIENT bytes N sha256 H` on stderr) is
    // judged by that: the pipe from python to this test delivered 128-192 KiB less than python
    // wrote in most runs (python's own count and hash of the same bytes were exact every
    // time; the loss is in the test's plumbing, not yet explained), so the pipe only measures
    // the stalls here.
    let (bytes, sha) = match stderr.lines().find_map(|l| l.strip_prefix("CLIENT bytes ")) {
        Some(rest) => {
            let mut w = rest.split_whitespace();
            let n: u64 = w.next().and_then(|n| n.parse().ok()).unwrap_or(0);
            let h = w.nth(1).unwrap_or("").to_string();
            if recv.bytes != n {
                eprintln!("{name}: note: the pipe delivered {} of the {n} bytes the client wrote (test plumbing)", recv.bytes);
            }
            (n, h)
        }
        None => (recv.bytes, recv.sha256.clone()),
    };
    assert_eq!(bytes, size, "{name}: byte count");
    assert_eq!(sha, want, "{name}: sha256 of the received bytes");
    check_counters(name, env, 2);
    check_finished(name, env);
    // The stall: a failover (crash) or a move home costs a probe round trip plus a rebuild,
    // tens of milliseconds; waiting for the client's retransmission timer instead would cost
    // seconds this late in a download, and the bug this guards against never ended.
    let worst = recv.gaps.iter().filter(|&&(b, _)| b >= at_crash).map(|&(_, ms)| ms).max().unwrap_or(0);
    assert!(worst < 1500, "{name}: a stall of {worst} ms after the crash or the revive");
}

#[test]
fn revive_during_download_curl() {
    // 1 GiB: after the revive the LB holds the server back for its revive hold (500 ms) and
    // the stand-in's lease before the bucket goes home; the download must still be running.
    const NAME: &str = "revive_during_download_curl";
    let Some(_g) = lab_or_skip(NAME) else { return };
    revive_during_download(NAME, 1024 * MIB, 21, |env| curl(&env.url(false, "/r.bin"), "100G"));
}

#[test]
fn revive_during_download_wget() {
    const NAME: &str = "revive_during_download_wget";
    let Some(_g) = lab_or_skip(NAME) else { return };
    revive_during_download(NAME, 1024 * MIB, 22, |env| {
        let mut cmd = Command::new("wget");
        cmd.args(["-q", "-O", "-", "--tries=1", "--timeout=30", &env.url(false, "/r.bin")]);
        cmd
    });
}

/// Two Range GETs on one kept-alive connection (python3 `http.client`); the revive lands in
/// the first, the second is relayed by the server the connection went home to. Python hashes
/// every body byte it receives and the test checks that hash.
#[test]
fn revive_keepalive_two_range_gets_python() {
    const NAME: &str = "revive_keepalive_two_range_gets_python";
    let Some(_g) = lab_or_skip(NAME) else { return };
    let size = 1024 * MIB;
    revive_during_download(NAME, size, 23, |_| {
        let mut cmd = Command::new("python3");
        cmd.args(["-c", PY_TWO_RANGES, &unbroken_lab::objlab::addr::VIP_V4.to_string(), "/r.bin", &size.to_string()]);
        cmd
    });
}
