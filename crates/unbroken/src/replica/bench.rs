//! `unbroken bench replica` (issue 10 item 6): ST-TCP's three workloads, unreplicated against
//! replicated with and without strict output commit, and the failover time for several
//! heartbeat intervals, on the replica lab ([`ReplicaEnv`]: client, primary, backup on one
//! segment).
//!
//! The replicated server is [`server_main`] (`unbroken bench-replica-server`), a small
//! deterministic server run unmodified on both hosts, bound to the service address
//! (`SERVICE:7000`). Its protocol is line-based, each request one line:
//! - `E...\n`: the same line back (the echo server);
//! - `R <n> <seed> ...\n`: `n` bytes of the pattern [`pattern`] for `seed` (the "reply N bytes"
//!   server; the request/reply and bulk workloads).
//!
//! Its output depends only on the bytes it read, never on how they were split into segments: it
//! is deterministic per connection, as replica mode needs. The client
//! ([`client_main`], `unbroken bench-replica-client`, run in the client namespace) compares
//! every byte it receives with what the server must have sent: a wrong, missing or extra byte
//! fails the run (a benchmark that delivers a wrong byte is a failure, not a number).
//!
//! Workloads, one connection each: echo (150 B line x N, total time and per-exchange latency),
//! request/reply (150 B request, 10 KB reply, x N), bulk (1, 5, 20, 100 MB from server to
//! client, Mbit/s). Configurations: `unreplicated` (the same lab and servers, no daemons: the
//! client talks to the primary alone), `strict` and `relaxed` (daemons with `strict = true` /
//! `false`). Failover: for each heartbeat interval (missed_beats 3) a fresh lab per trial, an
//! echo every 1 ms on one connection, the primary host dies (processes killed, link cut); the
//! backup's `takeover_ms` and the client's longest gap between two replies; a trial where a side
//! suspected the other before the crash counts as a false suspicion, and the interval is then
//! retried with more missed beats (the smallest stable setting is reported).

use crate::replica::demo::{RepOpts, ReplicaEnv, Side};
use crate::common::{med_min_max, round2, val};
use serde_json::{json, Value};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use unbroken_lab::lab;
use unbroken_lab::replicalab::addr;

/// The benchmark server's port on the service address.
pub const PORT: u16 = 7000;
/// Request size of the echo and request/reply workloads (ST-TCP: ~150 B).
pub const REQUEST_BYTES: usize = 150;
/// Reply size of the request/reply workload (ST-TCP: 10 KB).
pub const REPLY_BYTES: u64 = 10_240;
/// Longest request line the server accepts.
const MAX_LINE: usize = 4096;
/// A client read or write that takes longer fails the run (no hang).
const IO_TIMEOUT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// The byte pattern

/// Fills `buf` with the reply bytes at offsets `off..` of the reply for `seed`: every byte
/// depends on its offset (a lost, duplicated or reordered block shows) and on the seed (a reply
/// to another request shows).
pub fn pattern(seed: u64, off: u64, buf: &mut [u8]) {
    for (k, b) in buf.iter_mut().enumerate() {
        let x = off + k as u64;
        *b = (x ^ (x >> 8) ^ (x >> 16) ^ (x >> 24)).wrapping_add(seed.wrapping_mul(0x9e)) as u8;
    }
}

// ---------------------------------------------------------------------------------------------
// The server (`unbroken bench-replica-server --listen ADDR:PORT`)

/// `unbroken bench-replica-server --listen ADDR:PORT`: prints `listening` once bound, serves
/// each connection on its own thread until killed.
pub fn server_main(args: Vec<String>) -> i32 {
    let mut listen: Option<SocketAddr> = None;
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--listen" => listen = it.next().and_then(|v| v.parse().ok()),
            o => {
                eprintln!("bench-replica-server: unknown argument {o:?}");
                return 2;
            }
        }
    }
    let Some(listen) = listen else {
        eprintln!("bench-replica-server: --listen ADDR:PORT is required");
        return 2;
    };
    let l = match TcpListener::bind(listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("bench-replica-server: bind {listen}: {e}");
            return 1;
        }
    };
    println!("listening {listen}");
    let _ = io::stdout().flush();
    for s in l.incoming() {
        match s {
            Ok(s) => {
                std::thread::spawn(move || {
                    let _ = serve(s);
                });
            }
            Err(e) => eprintln!("bench-replica-server: accept: {e}"),
        }
    }
    0
}

/// One connection: answers each request line until the client closes (or sends a bad line:
/// the connection is closed, deterministically on both hosts).
fn serve(s: TcpStream) -> io::Result<()> {
    let _ = s.set_nodelay(true);
    let mut w = s.try_clone()?;
    let mut r = BufReader::with_capacity(64 << 10, s);
    let mut line = Vec::with_capacity(256);
    let mut buf = vec![0u8; 64 << 10];
    loop {
        line.clear();
        let n = (&mut r).take(MAX_LINE as u64).read_until(b'\n', &mut line)?;
        if n == 0 || line.last() != Some(&b'\n') {
            return Ok(());
        }
        match line.first() {
            Some(b'E') => w.write_all(&line)?,
            Some(b'R') => {
                let text = String::from_utf8_lossy(&line).into_owned();
                let mut f = text.split_whitespace().skip(1);
                let (Some(n), Some(seed)) = (f.next().and_then(|v| v.parse::<u64>().ok()), f.next().and_then(|v| v.parse::<u64>().ok())) else {
                    return Ok(());
                };
                let mut off = 0;
                while off < n {
                    let k = ((n - off) as usize).min(buf.len());
                    pattern(seed, off, &mut buf[..k]);
                    w.write_all(&buf[..k])?;
                    off += k as u64;
                }
            }
            _ => return Ok(()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The client (`unbroken bench-replica-client --connect ADDR:PORT --work echo|rr|bulk|paced ...`)

/// The client's settings.
#[derive(Debug, Clone)]
pub struct ClientArgs {
    pub connect: SocketAddr,
    /// `echo`, `rr`, `bulk` or `paced`.
    pub work: String,
    /// Exchanges (echo, rr).
    pub count: usize,
    /// Bulk sizes, bytes, one after the other on the connection.
    pub sizes: Vec<u64>,
    /// Paced: one echo every `every` for `secs`.
    pub every: Duration,
    pub secs: f64,
}

/// The request line `prefix`, padded with `.` to [`REQUEST_BYTES`] with its `\n`.
fn request(prefix: &str) -> Vec<u8> {
    let mut v = prefix.as_bytes().to_vec();
    v.resize(REQUEST_BYTES - 1, b'.');
    v.push(b'\n');
    v
}

/// Reads `n` bytes and compares them with the pattern for `seed`.
fn read_reply(s: &mut TcpStream, seed: u64, n: u64, buf: &mut [u8], want: &mut [u8]) -> Result<(), String> {
    let mut off = 0;
    while off < n {
        let k = ((n - off) as usize).min(buf.len());
        s.read_exact(&mut buf[..k]).map_err(|e| format!("reading reply {seed} at byte {off} of {n}: {e}"))?;
        pattern(seed, off, &mut want[..k]);
        if buf[..k] != want[..k] {
            let i = buf[..k].iter().zip(&want[..k]).position(|(a, b)| a != b).unwrap_or(0);
            return Err(format!("reply {seed}: wrong byte at offset {} (got {}, expected {})", off + i as u64, buf[i], want[i]));
        }
        off += k as u64;
    }
    Ok(())
}

fn connect(a: SocketAddr) -> Result<TcpStream, String> {
    let s = TcpStream::connect_timeout(&a, Duration::from_secs(10)).map_err(|e| format!("connect {a}: {e}"))?;
    let _ = s.set_nodelay(true);
    s.set_read_timeout(Some(IO_TIMEOUT)).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(IO_TIMEOUT)).map_err(|e| e.to_string())?;
    Ok(s)
}

/// The percentile `p` (0..1) of sorted `v` (nearest rank).
fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let i = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// Runs one workload; the JSON report (`ok`, figures, `error`).
pub fn client_run(a: &ClientArgs, on_ready: &mut dyn FnMut()) -> Value {
    match client_work(a, on_ready) {
        Ok(mut v) => {
            v["ok"] = json!(true);
            v
        }
        Err(e) => json!({ "ok": false, "error": e }),
    }
}

fn client_work(a: &ClientArgs, on_ready: &mut dyn FnMut()) -> Result<Value, String> {
    let mut s = connect(a.connect)?;
    let mut buf = vec![0u8; 64 << 10];
    let mut want = vec![0u8; 64 << 10];
    let t0 = Instant::now();
    let v = match a.work.as_str() {
        "echo" | "rr" => {
            let mut lat = Vec::with_capacity(a.count);
            for i in 0..a.count {
                let t = Instant::now();
                if a.work == "echo" {
                    let req = request(&format!("E {i}"));
                    s.write_all(&req).map_err(|e| format!("echo {i}: write: {e}"))?;
                    s.read_exact(&mut buf[..req.len()]).map_err(|e| format!("echo {i}: read: {e}"))?;
                    if buf[..req.len()] != req[..] {
                        return Err(format!("echo {i}: the reply differs from the request"));
                    }
                } else {
                    let seed = i as u64 + 1;
                    s.write_all(&request(&format!("R {REPLY_BYTES} {seed} "))).map_err(|e| format!("request {i}: write: {e}"))?;
                    read_reply(&mut s, seed, REPLY_BYTES, &mut buf, &mut want)?;
                }
                lat.push(t.elapsed().as_secs_f64() * 1e6);
            }
            let total_ms = t0.elapsed().as_secs_f64() * 1e3;
            lat.sort_by(|x, y| x.partial_cmp(y).unwrap());
            json!({ "exchanges": a.count, "total_ms": total_ms, "p50_us": pct(&lat, 0.5), "p99_us": pct(&lat, 0.99), "max_us": lat.last().copied().unwrap_or(0.0) })
        }
        "bulk" => {
            let mut out = Vec::new();
            for (k, &n) in a.sizes.iter().enumerate() {
                let seed = 1000 + k as u64;
                let t = Instant::now();
                s.write_all(&request(&format!("R {n} {seed} "))).map_err(|e| format!("bulk {n}: write: {e}"))?;
                read_reply(&mut s, seed, n, &mut buf, &mut want)?;
                let secs = t.elapsed().as_secs_f64();
                out.push(json!({ "bytes": n, "secs": secs, "mbit_s": n as f64 * 8.0 / secs / 1e6 }));
            }
            json!({ "transfers": out })
        }
        "paced" => {
            let mut last = Instant::now();
            let mut max_gap = Duration::ZERO;
            let mut i = 0u64;
            let mut next = Instant::now();
            while t0.elapsed().as_secs_f64() < a.secs {
                let req = request(&format!("E {i}"));
                s.write_all(&req).map_err(|e| format!("paced echo {i}: write: {e}"))?;
                s.read_exact(&mut buf[..req.len()]).map_err(|e| format!("paced echo {i}: read: {e}"))?;
                if buf[..req.len()] != req[..] {
                    return Err(format!("paced echo {i}: the reply differs from the request"));
                }
                let now = Instant::now();
                if i > 0 {
                    max_gap = max_gap.max(now - last);
                } else {
                    on_ready();
                }
                last = now;
                i += 1;
                next += a.every;
                if let Some(d) = next.checked_duration_since(Instant::now()) {
                    std::thread::sleep(d); // the pace of the workload
                } else {
                    next = Instant::now();
                }
            }
            json!({ "exchanges": i, "max_gap_ms": max_gap.as_secs_f64() * 1e3 })
        }
        w => return Err(format!("unknown workload {w:?}")),
    };
    // An orderly close: the server sees EOF and closes too (no RST).
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut rest = [0u8; 16];
    match s.read(&mut rest) {
        Ok(0) => {}
        Ok(_) => return Err("the server sent bytes nobody asked for".into()),
        Err(e) => return Err(format!("closing: {e}")),
    }
    Ok(v)
}

/// `unbroken bench-replica-client --connect A:P --work W [--count N] [--sizes B,B] [--every-ms M]
/// [--secs S]`: prints `ready` after the first paced reply, then one JSON line; exit 1 unless ok.
pub fn client_main(args: Vec<String>) -> i32 {
    let mut a = ClientArgs { connect: SocketAddr::from((addr::SERVICE_V4, PORT)), work: "echo".into(), count: 100, sizes: vec![1_000_000], every: Duration::from_millis(1), secs: 2.0 };
    let mut it = args.into_iter();
    while let Some(x) = it.next() {
        let v = it.next();
        let ok = match (x.as_str(), v) {
            ("--connect", Some(v)) => v.parse().map(|c| a.connect = c).is_ok(),
            ("--work", Some(v)) => {
                a.work = v;
                true
            }
            ("--count", Some(v)) => v.parse().map(|c| a.count = c).is_ok(),
            ("--sizes", Some(v)) => v.split(',').map(|s| s.parse::<u64>()).collect::<Result<Vec<_>, _>>().map(|s| a.sizes = s).is_ok(),
            ("--every-ms", Some(v)) => v.parse::<f64>().map(|m| a.every = Duration::from_secs_f64(m / 1e3)).is_ok(),
            ("--secs", Some(v)) => v.parse().map(|s| a.secs = s).is_ok(),
            _ => false,
        };
        if !ok {
            eprintln!("bench-replica-client: bad argument {x:?}");
            return 2;
        }
    }
    let v = client_run(&a, &mut || {
        println!("ready");
        let _ = io::stdout().flush();
    });
    println!("{v}");
    if v["ok"] == true {
        0
    } else {
        1
    }
}

// ---------------------------------------------------------------------------------------------
// Options

/// Options of `unbroken bench replica`.
#[derive(Debug, Clone)]
pub struct Opts {
    pub json: bool,
    pub quick: bool,
    /// Rounds of the three workloads per configuration (medians over them).
    pub runs: usize,
    /// Exchanges of the echo and request/reply workloads.
    pub exchanges: usize,
    /// Bulk sizes, MB (10^6 bytes).
    pub bulk_mb: Vec<f64>,
    /// Heartbeat intervals of the failover part, ms.
    pub intervals: Vec<u64>,
    /// Failover trials per interval.
    pub trials: usize,
    /// The paced echo's run before the crash, s (also how long no side may suspect the other).
    pub before_crash_s: f64,
    /// Missed beats tried after a false suspicion, in order (3 is always tried first).
    pub escalate: Vec<u64>,
    /// Skip parts: `workloads`, `failover`.
    pub skip: Vec<String>,
    pub save: Option<PathBuf>,
    /// The `unbroken` binary (daemons, servers and clients run as processes of it).
    pub bin: PathBuf,
}

impl Opts {
    pub fn new(quick: bool) -> Opts {
        Opts {
            json: false,
            quick,
            runs: if quick { 1 } else { 3 },
            exchanges: if quick { 20 } else { 100 },
            bulk_mb: if quick { vec![1.0] } else { vec![1.0, 5.0, 20.0, 100.0] },
            intervals: if quick { vec![10] } else { vec![50, 10, 2] },
            trials: if quick { 1 } else { 5 },
            before_crash_s: if quick { 0.5 } else { 2.0 },
            escalate: vec![5, 10, 20],
            skip: Vec::new(),
            save: None,
            bin: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("unbroken")),
        }
    }

    /// Parses the arguments after `bench` (`replica ...`).
    pub fn parse(args: &[String]) -> Result<Opts, String> {
        let quick = args.iter().any(|a| a == "--quick");
        let mut o = Opts::new(quick);
        let mut it = args.iter();
        fn list<T: std::str::FromStr>(it: &mut std::slice::Iter<String>, f: &str) -> Result<Vec<T>, String> {
            let v = it.next().ok_or(format!("{f} needs a comma-separated list"))?;
            v.split(',').map(|x| x.trim().parse().map_err(|_| format!("{f}: not a number: {x:?}"))).collect()
        }
        while let Some(a) = it.next() {
            match a.as_str() {
                "replica" | "--quick" => {}
                "--json" => o.json = true,
                "--runs" => o.runs = val(&mut it, "--runs")?,
                "--exchanges" => o.exchanges = val(&mut it, "--exchanges")?,
                "--bulk-mb" => o.bulk_mb = list(&mut it, "--bulk-mb")?,
                "--intervals" => o.intervals = list(&mut it, "--intervals")?,
                "--trials" => o.trials = val(&mut it, "--trials")?,
                "--before-crash" => o.before_crash_s = val(&mut it, "--before-crash")?,
                "--skip" => o.skip = it.next().ok_or("--skip needs workloads,failover")?.split(',').map(|s| s.trim().to_string()).collect(),
                "--save" => o.save = Some(it.next().ok_or("--save needs a FILE")?.into()),
                x => return Err(format!("bench replica: unknown argument {x:?}\n{USAGE}")),
            }
        }
        if o.runs == 0 || o.exchanges == 0 || o.trials == 0 || o.bulk_mb.iter().any(|m| *m <= 0.0) || o.intervals.contains(&0) || o.before_crash_s <= 0.0 {
            return Err("bench replica: --runs, --exchanges, --trials, --before-crash, bulk sizes and intervals must be positive".into());
        }
        if let Some(s) = o.skip.iter().find(|s| !["workloads", "failover"].contains(&s.as_str())) {
            return Err(format!("bench replica: --skip: unknown part {s:?} (workloads, failover)"));
        }
        Ok(o)
    }

    fn runs_part(&self, p: &str) -> bool {
        !self.skip.iter().any(|s| s == p)
    }
}

pub const USAGE: &str = "usage: unbroken bench replica [--json] [--quick] [--runs N] [--exchanges N] [--bulk-mb LIST] [--intervals LIST] [--trials N] [--before-crash S] [--skip workloads,failover] [--save FILE]";

/// `unbroken bench replica ...` (the arguments after `bench`); the exit code.
pub fn main(args: Vec<String>) -> i32 {
    let o = match Opts::parse(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("unbroken: {e}");
            return 2;
        }
    };
    let v = match run(&o) {
        Ok(v) => v,
        Err(e) => json!({ "ok": false, "error": e }),
    };
    if let Some(f) = &o.save {
        if let Err(e) = std::fs::write(f, format!("{}\n", serde_json::to_string_pretty(&v).unwrap_or_default())) {
            eprintln!("unbroken: bench: --save {}: {e}", f.display());
        }
    }
    if o.json {
        println!("{v}");
    } else {
        print_table(&v);
    }
    if v["ok"] == true {
        0
    } else {
        if let Some(e) = v["error"].as_str() {
            eprintln!("unbroken: bench replica: {e}");
        }
        1
    }
}

// ---------------------------------------------------------------------------------------------
// The orchestrator

/// The benchmark servers of one env (killed on drop, before the env goes).
struct Servers(Vec<Child>);

impl Drop for Servers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts the benchmark server on both hosts, bound to the service address.
fn start_servers(env: &ReplicaEnv) -> Result<Servers, String> {
    let mut servers = Servers(Vec::new());
    for side in [Side::Primary, Side::Backup] {
        let mut c = lab::spawn(env.ns(side), Command::new(&env.opts.bin).args(["bench-replica-server", "--listen", &format!("{}:{PORT}", addr::SERVICE_V4)]).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit()))
            .map_err(|e| format!("starting the server on the {}: {e}", side.name()))?;
        let out = c.stdout.take();
        servers.0.push(c);
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            if let Some(o) = out {
                let mut r = BufReader::new(o);
                let _ = r.read_line(&mut line);
                let _ = tx.send(line);
                let mut sink = Vec::new();
                let _ = r.read_to_end(&mut sink);
            }
        });
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(l) if l.starts_with("listening") => {}
            other => return Err(format!("the server on the {} did not start: {other:?}", side.name())),
        }
    }
    Ok(servers)
}

/// A client in the client namespace; `ready` is sent the first line of its stdout (`ready`).
struct ClientProc {
    child: Child,
    lines: mpsc::Receiver<String>,
}

fn spawn_client(env: &ReplicaEnv, args: &[String]) -> Result<ClientProc, String> {
    let mut c = lab::spawn(&env.lab.client, Command::new(&env.opts.bin).arg("bench-replica-client").args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped())).map_err(|e| format!("starting the client: {e}"))?;
    let out = c.stdout.take().ok_or("client stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    Ok(ClientProc { child: c, lines: rx })
}

impl ClientProc {
    /// Waits (bounded) for the JSON report; kills the client on timeout.
    fn report(mut self, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with('{') => {
                    let _ = self.child.wait();
                    return serde_json::from_str(&l).unwrap_or_else(|e| json!({ "ok": false, "error": format!("unreadable report {l:?}: {e}") }));
                }
                Ok(_) => {}
                Err(_) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    let mut err = String::new();
                    if let Some(mut e) = self.child.stderr.take() {
                        let _ = e.read_to_string(&mut err);
                    }
                    return json!({ "ok": false, "error": format!("the client gave no report within {timeout:?}: {}", err.trim()) });
                }
            }
        }
    }
}

/// Runs one workload to its end in the client namespace.
fn client(env: &ReplicaEnv, args: &[String], timeout: Duration) -> Value {
    match spawn_client(env, args) {
        Ok(c) => c.report(timeout),
        Err(e) => json!({ "ok": false, "error": e }),
    }
}

fn s(v: impl ToString) -> String {
    v.to_string()
}

/// The three configurations of the workload part.
const CONFIGS: [&str; 3] = ["unreplicated", "strict", "relaxed"];

fn env_opts(o: &Opts, daemons: bool, strict: bool, interval: u64, missed: u64) -> RepOpts {
    RepOpts { bin: o.bin.clone(), daemons, strict, heartbeat_interval_ms: interval, missed_beats: missed, extra_ports: vec![PORT], ..RepOpts::default() }
}

/// The workloads in one configuration: `runs` rounds of echo, request/reply and bulk, each on
/// its own connection. Errors are a failed benchmark (a wrong byte, a reset, a timeout).
fn workloads(o: &Opts, config: &str, say: &dyn Fn(String)) -> Result<Value, String> {
    // Beats every 10 ms (the default) but suspected after 10 missed (as the lab tests): the
    // detection bound costs nothing on the data path, and a false suspicion mid-run would fence
    // a side (the state check below refuses such figures).
    let eo = env_opts(o, config != "unreplicated", config != "relaxed", 10, 10);
    let env = ReplicaEnv::start(eo).map_err(|e| format!("{config}: starting the lab: {e}"))?;
    let _servers = start_servers(&env)?;
    let target = s(format!("{}:{PORT}", addr::SERVICE_V4));
    let sizes: Vec<u64> = o.bulk_mb.iter().map(|m| (m * 1e6) as u64).collect();
    let rst0 = env.client_rsts();
    let (mut echo_total, mut echo_p50, mut echo_p99) = (Vec::new(), Vec::new(), Vec::new());
    let (mut rr_total, mut rr_p50, mut rr_p99) = (Vec::new(), Vec::new(), Vec::new());
    let mut bulk: Vec<Vec<f64>> = vec![Vec::new(); sizes.len()];
    let big = sizes.iter().sum::<u64>();
    let daemons = config != "unreplicated";
    // Connections the primary stopped protecting, per workload (read from a fresh status after
    // each connection): figures of such a run are partly unprotected ones and are marked so.
    let mut unprotected = json!({ "echo": 0, "rr": 0, "bulk": 0 });
    let unprot = |env: &ReplicaEnv| fresh_status(env, Side::Primary)["unprotected"].as_u64().unwrap_or(0);
    let mut before = if daemons { unprot(&env) } else { 0 };
    for r in 0..o.runs {
        for work in ["echo", "rr", "bulk"] {
            let mut args = vec![s("--connect"), target.clone(), s("--work"), s(work), s("--count"), s(o.exchanges)];
            args.extend([s("--sizes"), sizes.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")]);
            // Bounded: 60 s plus 1 s per 10 MB of bulk (10 Mbit/s would be a failure anyway).
            let v = client(&env, &args, Duration::from_secs(60 + big / 10_000_000));
            if v["ok"] != true {
                return Err(format!("{config} run {} {work}: {}\n{}", r + 1, v["error"], env.diagnostics()));
            }
            if daemons {
                let now = unprot(&env);
                unprotected[work] = json!(unprotected[work].as_u64().unwrap_or(0) + now.saturating_sub(before));
                before = now;
            }
            match work {
                "echo" => {
                    echo_total.push(v["total_ms"].as_f64().unwrap_or(0.0));
                    echo_p50.push(v["p50_us"].as_f64().unwrap_or(0.0));
                    echo_p99.push(v["p99_us"].as_f64().unwrap_or(0.0));
                }
                "rr" => {
                    rr_total.push(v["total_ms"].as_f64().unwrap_or(0.0));
                    rr_p50.push(v["p50_us"].as_f64().unwrap_or(0.0));
                    rr_p99.push(v["p99_us"].as_f64().unwrap_or(0.0));
                }
                _ => {
                    for (k, t) in v["transfers"].as_array().into_iter().flatten().enumerate() {
                        if let Some(b) = bulk.get_mut(k) {
                            b.push(t["mbit_s"].as_f64().unwrap_or(0.0));
                        }
                    }
                }
            }
        }
        say(format!("{config}: run {} of {} done (echo {:.1} ms, rr {:.1} ms, bulk {:?} Mbit/s)", r + 1, o.runs, echo_total.last().unwrap_or(&0.0), rr_total.last().unwrap_or(&0.0), bulk.iter().map(|b| b.last().copied().unwrap_or(0.0).round()).collect::<Vec<_>>()));
    }
    let rsts = env.client_rsts().saturating_sub(rst0);
    // With daemons, both must still be protecting: a fenced side would make the figures those
    // of an unreplicated run.
    let mut states = json!(null);
    if daemons {
        let p = fresh_status(&env, Side::Primary);
        let b = fresh_status(&env, Side::Backup);
        if p["state"] != "protecting" || b["state"] != "protecting" {
            return Err(format!("{config}: a side left `protecting` during the workloads (primary {}, backup {}): the figures would not be replicated ones\n{}", p["state"], b["state"], env.diagnostics()));
        }
        // A deterministic server never diverges: a divergence is a bug to look at, not a figure.
        if p["diverged"] != 0 || b["diverged"] != 0 {
            return Err(format!("{config}: connections diverged (primary {}, backup {}) with a deterministic server\n{}", p["diverged"], b["diverged"], env.diagnostics()));
        }
        states = json!({ "primary": p, "backup": b });
    }
    if rsts != 0 {
        return Err(format!("{config}: {rsts} RSTs reached the client"));
    }
    Ok(json!({
        "echo": { "total_ms": med_min_max(&echo_total), "p50_us": med_min_max(&echo_p50), "p99_us": med_min_max(&echo_p99) },
        "rr": { "total_ms": med_min_max(&rr_total), "p50_us": med_min_max(&rr_p50), "p99_us": med_min_max(&rr_p99) },
        "bulk": sizes.iter().zip(&bulk).map(|(n, b)| json!({ "mb": *n as f64 / 1e6, "mbit_s": med_min_max(b) })).collect::<Vec<_>>(),
        "resets_seen_by_client": rsts,
        // Connections (one per workload and run) the primary stopped protecting, and why.
        "unprotected": if daemons { unprotected } else { Value::Null },
        "unprotected_by": states["primary"]["unprotected_by"].clone(),
        "daemons": states,
    }))
}

/// `side`'s status written after this call (its counters include everything done before): the
/// daemon rewrites the file every 100 ms; waits (bounded, 2 s) for one composed 200 ms after the
/// one on disk now.
fn fresh_status(env: &ReplicaEnv, side: Side) -> Value {
    let up = |v: &Value| v["uptime_ms"].as_u64().unwrap_or(0);
    let u0 = env.status(side).map_or(0, |v| up(&v));
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let v = env.status(side).unwrap_or(Value::Null);
        if up(&v) >= u0 + 200 || Instant::now() > deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(20)); // polling a status file with a deadline
    }
}

/// One failover trial: a fresh lab, the paced echo, the primary host dies after
/// `before_crash_s`. `Ok(Err(why))` for a false suspicion before the crash (or during start-up).
fn failover_trial(o: &Opts, interval: u64, missed: u64) -> Result<Result<Value, String>, String> {
    let env = ReplicaEnv::start(env_opts(o, true, true, interval, missed)).map_err(|e| format!("starting the lab: {e}"));
    let mut env = match env {
        Ok(e) => e,
        // A side that suspects the other while the daemons start is a false suspicion too.
        Err(e) if e.contains("did not reach") => return Ok(Err(format!("during start-up: {}", e.lines().next().unwrap_or("")))),
        Err(e) => return Err(e),
    };
    let servers = start_servers(&env)?;
    let secs = o.before_crash_s + 3.0 + (interval * missed) as f64 / 1e3 * 4.0;
    let c = spawn_client(&env, &[s("--connect"), format!("{}:{PORT}", addr::SERVICE_V4), s("--work"), s("paced"), s("--every-ms"), s("1"), s("--secs"), s(secs)])?;
    match c.lines.recv_timeout(Duration::from_secs(10)) {
        Ok(l) if l == "ready" => {}
        other => return Err(format!("the paced client did not start: {other:?}\n{}", env.diagnostics())),
    }
    std::thread::sleep(Duration::from_secs_f64(o.before_crash_s)); // the run before the fault (its timing, not a synchronisation)
    let (p, b) = (env.state(Side::Primary), env.state(Side::Backup));
    let suspected = env.status(Side::Primary).map_or(0, |v| v["fences_run"].as_u64().unwrap_or(0)) + env.status(Side::Backup).map_or(0, |v| v["fences_run"].as_u64().unwrap_or(0));
    if p.as_deref() != Some("protecting") || b.as_deref() != Some("protecting") || suspected > 0 {
        let _ = c.report(Duration::from_secs_f64(secs + 30.0));
        return Ok(Err(format!("before the crash: primary {p:?}, backup {b:?}, fences run {suspected}")));
    }
    env.crash_host(Side::Primary).map_err(|e| format!("crash: {e}"))?;
    let v = c.report(Duration::from_secs_f64(secs + 30.0));
    let st = env.wait_state(Side::Backup, &["took_over"], Duration::from_secs(5));
    let rsts = env.client_rsts();
    drop(servers);
    let st = st?;
    if v["ok"] != true {
        return Err(format!("the paced client failed: {}\n{}", v["error"], env.diagnostics()));
    }
    if rsts != 0 {
        return Err(format!("{rsts} RSTs reached the client"));
    }
    Ok(Ok(json!({
        "takeover_ms": st["takeover_ms"],
        "stall_ms": round2(v["max_gap_ms"].as_f64().unwrap_or(0.0)),
        "exchanges": v["exchanges"],
        "byte_exact": true,
        "resets_seen_by_client": rsts,
    })))
}

/// The failover part for one interval: `trials` trials with missed_beats 3, then (after a
/// false suspicion) with each of `escalate` until a setting has none.
fn failover(o: &Opts, interval: u64, say: &dyn Fn(String)) -> Result<Value, String> {
    let mut settings = Vec::new();
    for missed in std::iter::once(3).chain(o.escalate.iter().copied()) {
        let mut trials = Vec::new();
        let mut false_suspicions = Vec::new();
        for t in 0..o.trials {
            match failover_trial(o, interval, missed)? {
                Ok(v) => {
                    say(format!("failover {interval} ms x{missed}: trial {} takeover {} ms, stall {} ms", t + 1, v["takeover_ms"], v["stall_ms"]));
                    trials.push(v);
                }
                Err(why) => {
                    say(format!("failover {interval} ms x{missed}: trial {}: false suspicion {why}", t + 1));
                    false_suspicions.push(why);
                }
            }
        }
        let take: Vec<f64> = trials.iter().filter_map(|v| v["takeover_ms"].as_f64()).collect();
        let stall: Vec<f64> = trials.iter().filter_map(|v| v["stall_ms"].as_f64()).collect();
        let stable = false_suspicions.is_empty();
        settings.push(json!({
            "heartbeat_interval_ms": interval,
            "missed_beats": missed,
            "detection_ms": interval * missed,
            "trials": trials,
            "false_suspicions": false_suspicions.len(),
            "false_suspicion_detail": false_suspicions,
            "takeover_ms": med_min_max(&take),
            "stall_ms": med_min_max(&stall),
            "stable": stable,
        }));
        if stable {
            break;
        }
    }
    let stable = settings.last().is_some_and(|s| s["stable"] == true);
    Ok(json!({ "heartbeat_interval_ms": interval, "settings": settings, "smallest_stable_missed_beats": if stable { settings.last().map(|s| s["missed_beats"].clone()) } else { None } }))
}

fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|t| t.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split_once(':')).map(|(_, m)| m.trim().to_string()));
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok().map(|k| k.trim().to_string());
    json!({ "nproc": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0), "cpu": cpu, "kernel": kernel })
}

/// The whole benchmark; the JSON report.
pub fn run(o: &Opts) -> Result<Value, String> {
    lab::lab_available().map_err(|e| format!("the lab is not available: {e}"))?;
    if let Some(m) = crate::replica::demo::tools_missing() {
        return Err(m);
    }
    let say = |m: String| {
        if !o.json {
            eprintln!("[bench replica] {m}");
        }
    };
    let t0 = Instant::now();
    let mut out = json!({
        "machine": machine(),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "runs": o.runs,
        "exchanges": o.exchanges,
        "request_bytes": REQUEST_BYTES,
        "reply_bytes": REPLY_BYTES,
    });
    if o.runs_part("workloads") {
        let mut w = serde_json::Map::new();
        for c in CONFIGS {
            say(format!("{c}: starting"));
            w.insert(c.into(), workloads(o, c, &say)?);
        }
        let ratio = |c: &str, f: &dyn Fn(&Value) -> Option<f64>| -> Option<f64> {
            let base = f(&w["unreplicated"])?;
            let x = f(&w[c])?;
            (base > 0.0 && x > 0.0).then(|| round2(x / base * 100.0))
        };
        let mut ratios = serde_json::Map::new();
        for c in ["strict", "relaxed"] {
            // Throughput relative to unreplicated, %: time ratios inverted for echo and rr.
            let echo = ratio(c, &|v| v["echo"]["total_ms"]["median"].as_f64().map(|t| 1.0 / t));
            let rr = ratio(c, &|v| v["rr"]["total_ms"]["median"].as_f64().map(|t| 1.0 / t));
            let bulk: Vec<Value> = (0..o.bulk_mb.len()).map(|k| json!({ "mb": o.bulk_mb[k], "percent": ratio(c, &|v| v["bulk"][k]["mbit_s"]["median"].as_f64()) })).collect();
            ratios.insert(c.into(), json!({ "echo_percent": echo, "rr_percent": rr, "bulk": bulk }));
        }
        out["workloads"] = Value::Object(w);
        out["throughput_vs_unreplicated"] = Value::Object(ratios);
    }
    if o.runs_part("failover") {
        let mut f = Vec::new();
        for &i in &o.intervals {
            f.push(failover(o, i, &say)?);
        }
        out["failover"] = json!(f);
    }
    out["byte_exact"] = json!(true);
    out["resets_seen_by_client"] = json!(0);
    out["duration_s"] = json!(round2(t0.elapsed().as_secs_f64()));
    out["ok"] = json!(true);
    Ok(out)
}

/// The human-readable summary.
pub fn print_table(v: &Value) {
    if v["ok"] != true {
        println!("bench replica failed: {}", v["error"].as_str().unwrap_or("?"));
        return;
    }
    let m = &v["machine"];
    println!("machine: {} cores, {}, kernel {}", m["nproc"], m["cpu"].as_str().unwrap_or("?"), m["kernel"].as_str().unwrap_or("?"));
    if let Some(w) = v["workloads"].as_object() {
        println!("\nworkloads ({} run(s), medians; every byte checked, 0 RSTs)", v["runs"]);
        println!("{:<14}{:>12}{:>10}{:>10}{:>12}{:>10}{:>10}  bulk Mbit/s", "config", "echo ms", "p50 us", "p99 us", "rr ms", "p50 us", "p99 us");
        for c in CONFIGS {
            let x = &w[c];
            let f = |y: &Value| y["median"].as_f64().unwrap_or(0.0);
            let bulk: Vec<String> = x["bulk"].as_array().into_iter().flatten().map(|b| format!("{} MB {:.0}", b["mb"], f(&b["mbit_s"]))).collect();
            let mark = |w: &str| if x["unprotected"][w].as_u64().unwrap_or(0) > 0 { "*" } else { "" };
            let bulk: Vec<String> = bulk.into_iter().map(|b| format!("{b}{}", mark("bulk"))).collect();
            println!(
                "{:<14}{:>12.1}{:>10.0}{:>10.0}{:>12.1}{:>10.0}{:>10.0}  {}",
                c,
                f(&x["echo"]["total_ms"]),
                f(&x["echo"]["p50_us"]),
                f(&x["echo"]["p99_us"]),
                f(&x["rr"]["total_ms"]),
                f(&x["rr"]["p50_us"]),
                f(&x["rr"]["p99_us"]),
                bulk.join(", ")
            );
        }
        println!("throughput vs unreplicated (%): {}", v["throughput_vs_unreplicated"]);
        for c in ["strict", "relaxed"] {
            if w[c]["unprotected"].as_object().is_some_and(|u| u.values().any(|n| n != 0)) {
                println!("* {c}: connections the primary stopped protecting: {} ({})", w[c]["unprotected"], w[c]["unprotected_by"]);
            }
        }
    }
    for f in v["failover"].as_array().into_iter().flatten() {
        for st in f["settings"].as_array().into_iter().flatten() {
            println!(
                "failover {} ms x {}: takeover ms median {} max {}, client stall ms median {} max {}, false suspicions {}",
                st["heartbeat_interval_ms"], st["missed_beats"], st["takeover_ms"]["median"], st["takeover_ms"]["max"], st["stall_ms"]["median"], st["stall_ms"]["max"], st["false_suspicions"]
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn options() {
        let o = Opts::parse(&a("replica --quick --json")).unwrap();
        assert!(o.quick && o.json && o.runs == 1 && o.intervals == vec![10]);
        let o = Opts::parse(&a("replica --runs 5 --intervals 50,10,2 --bulk-mb 1,100")).unwrap();
        assert_eq!((o.runs, o.intervals, o.bulk_mb), (5, vec![50, 10, 2], vec![1.0, 100.0]));
        assert!(Opts::parse(&a("replica --runs 0")).is_err());
        assert!(Opts::parse(&a("replica --intervals 10,0")).is_err());
        assert!(Opts::parse(&a("replica --skip rps")).is_err());
        assert!(Opts::parse(&a("replica --bogus")).is_err());
    }

    #[test]
    fn pattern_depends_on_offset_and_seed() {
        let mut a1 = vec![0u8; 1 << 17];
        pattern(1, 0, &mut a1);
        // Offsets continue across calls: two halves are the whole.
        let mut h = vec![0u8; 1 << 17];
        pattern(1, 0, &mut h[..5000]);
        pattern(1, 5000, &mut h[5000..]);
        assert_eq!(a1, h);
        let mut b = vec![0u8; 1 << 17];
        pattern(2, 0, &mut b);
        assert_ne!(a1, b);
        // A block moved by 256 bytes (a lost or repeated segment) differs.
        assert_ne!(a1[..4096], a1[256..4352]);
        assert_ne!(a1[..1460], a1[1460..2920]);
    }

    #[test]
    fn server_and_client_over_loopback() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                std::thread::spawn(move || serve(s));
            }
        });
        for work in ["echo", "rr", "bulk"] {
            let c = ClientArgs { connect: at, work: work.into(), count: 5, sizes: vec![1, 70_000], every: Duration::from_millis(1), secs: 0.05 };
            let v = client_run(&c, &mut || {});
            assert_eq!(v["ok"], true, "{work}: {v}");
        }
        let mut ready = 0;
        let c = ClientArgs { connect: at, work: "paced".into(), count: 0, sizes: vec![], every: Duration::from_millis(1), secs: 0.05 };
        let v = client_run(&c, &mut || ready += 1);
        assert_eq!((v["ok"].clone(), ready), (json!(true), 1), "{v}");
        assert!(v["exchanges"].as_u64().unwrap() > 1);
    }

    #[test]
    fn a_wrong_byte_fails_the_client() {
        // A server that answers the request with one byte off.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            let mut buf = vec![0u8; 1000];
            pattern(1000, 0, &mut buf);
            buf[777] ^= 1;
            s.write_all(&buf).unwrap();
        });
        let c = ClientArgs { connect: at, work: "bulk".into(), count: 0, sizes: vec![1000], every: Duration::from_millis(1), secs: 0.0 };
        let v = client_run(&c, &mut || {});
        assert_eq!(v["ok"], false);
        assert!(v["error"].as_str().unwrap().contains("offset 777"), "{v}");
    }
}
