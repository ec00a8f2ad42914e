//! The verifying Redis client of replica mode's lab runs (issue 20): `unbroken
//! replica-check-client` (a hidden subcommand, run in the client namespace), speaking RESP over
//! plain `TcpStream`s, and the check of its acknowledged writes against a surviving server.
//!
//! K persistent connections (default 8), each on its own keys (replica mode needs a server that
//! is deterministic per connection: two connections writing one key are not), each doing a
//! seeded random mix of INCR of its counter (single or pipelined, 1-16 commands at once), SET of
//! one of its keys to random bytes of 1 KiB-1 MiB, and GET of one of its keys. Every reply is
//! known in advance (`+OK`, the value last set or `$-1`, the next integers) and compared byte
//! for byte as it arrives; nothing beyond the expected reply is ever read. A connection never
//! reconnects: an error, an EOF, a reset (ECONNRESET), a wrong byte or an operation longer than
//! the hang bound (default 10 s) ends it and is reported.
//!
//! Per connection it records the operations and bytes, the longest operation, the stall (the
//! longest time an operation was outstanding while the connection made no progress at all:
//! neither `tcpi_bytes_acked` nor `tcpi_bytes_received` grew, polled every 10 ms), its
//! retransmissions, the last INCR value acknowledged (and how many INCRs were sent without their
//! reply), and for each SET key the SHA-256 of the value last acknowledged (and of one sent
//! without its reply). It prints `ready` once every connection is open, then one JSON line
//! ([`ClientReport`]) at the end; exit status 0 only when every connection ran clean.
//!
//! [`lost_writes`] reads every connection's keys back from a server (through its host address,
//! outside the replicated service) and counts the acknowledged writes it lacks.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Barrier};
use std::time::{Duration, Instant};

/// splitmix64: a small seeded generator (runs replay from the printed seed).
use crate::common::Rng;

/// Options of the client (`unbroken replica-check-client`).
#[derive(Debug, Clone)]
pub struct Args {
    pub connect: SocketAddr,
    pub conns: usize,
    /// Operations start for this long (the last one finishes after).
    pub secs: f64,
    pub seed: u64,
    /// SET values are uniform in `min_value..=max_value` bytes; `max_value` 0: INCR only.
    pub min_value: u64,
    pub max_value: u64,
    /// INCRs sent at once: uniform in `1..=max_pipeline`.
    pub max_pipeline: u64,
    /// SET/GET keys per connection.
    pub set_keys: usize,
    /// An operation that takes longer is a hang (the connection stops, reported).
    pub hang_ms: u64,
    /// Also stop starting operations once stdin reaches EOF (the caller closes it).
    pub until_stdin_eof: bool,
    /// Key prefix (keys are `<prefix>:c<i>:n` and `<prefix>:c<i>:v<j>`).
    pub prefix: String,
}

impl Default for Args {
    fn default() -> Self {
        Args {
            connect: SocketAddr::from(([127, 0, 0, 1], 6379)),
            conns: 8,
            secs: 20.0,
            seed: 1,
            min_value: 1 << 10,
            max_value: 1 << 20,
            max_pipeline: 16,
            set_keys: 4,
            hang_ms: 10_000,
            until_stdin_eof: false,
            prefix: "chk".into(),
        }
    }
}

impl Args {
    /// The command-line form (after the subcommand) that [`client_main`] parses.
    pub fn to_argv(&self) -> Vec<String> {
        let mut v: Vec<String> = [
            ("--connect", self.connect.to_string()),
            ("--conns", self.conns.to_string()),
            ("--secs", self.secs.to_string()),
            ("--seed", self.seed.to_string()),
            ("--min-value", self.min_value.to_string()),
            ("--max-value", self.max_value.to_string()),
            ("--max-pipeline", self.max_pipeline.to_string()),
            ("--set-keys", self.set_keys.to_string()),
            ("--hang-ms", self.hang_ms.to_string()),
            ("--prefix", self.prefix.clone()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect();
        if self.until_stdin_eof {
            v.push("--until-stdin-eof".into());
        }
        v
    }

    fn parse(args: Vec<String>) -> Result<Args, String> {
        let mut a = Args::default();
        let mut it = args.into_iter();
        while let Some(x) = it.next() {
            if x == "--until-stdin-eof" {
                a.until_stdin_eof = true;
                continue;
            }
            let v = it.next().ok_or_else(|| format!("{x} needs a value"))?;
            let bad = |_| format!("{x}: bad value {v:?}");
            match x.as_str() {
                "--connect" => a.connect = v.parse().map_err(|_| format!("--connect: bad address {v:?}"))?,
                "--conns" => a.conns = v.parse().map_err(bad)?,
                "--secs" => a.secs = v.parse().map_err(|_| format!("--secs: bad value {v:?}"))?,
                "--seed" => a.seed = v.parse().map_err(bad)?,
                "--min-value" => a.min_value = v.parse().map_err(bad)?,
                "--max-value" => a.max_value = v.parse().map_err(bad)?,
                "--max-pipeline" => a.max_pipeline = v.parse().map_err(bad)?,
                "--set-keys" => a.set_keys = v.parse().map_err(bad)?,
                "--hang-ms" => a.hang_ms = v.parse().map_err(bad)?,
                "--prefix" => a.prefix = v,
                _ => return Err(format!("unknown argument {x:?}")),
            }
        }
        if a.conns == 0 || a.max_pipeline == 0 || a.set_keys == 0 || (a.max_value > 0 && (a.min_value == 0 || a.min_value > a.max_value)) {
            return Err("need --conns, --max-pipeline, --set-keys >= 1 and 1 <= --min-value <= --max-value".into());
        }
        Ok(a)
    }
}

/// One SET key of a connection at the end.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SetKey {
    pub key: String,
    /// SHA-256 (hex) and length of the value last acknowledged (`+OK`); None: never set.
    pub acked: Option<String>,
    pub acked_len: u64,
    /// SHA-256 of a value sent whose `+OK` never came (the server may hold either).
    pub pending: Option<String>,
}

/// What one connection did and saw.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ConnReport {
    pub conn: usize,
    pub local_port: u16,
    /// Replies received and verified (each INCR of a pipeline counts).
    pub ops: u64,
    pub incrs: u64,
    pub sets: u64,
    pub gets: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// The longest time an operation was outstanding with no progress on the connection, ms.
    pub stall_ms: u64,
    /// The longest operation (request written to reply verified), ms.
    pub max_op_ms: u64,
    /// The kernel's count of retransmitted segments on this connection.
    pub retrans: u32,
    pub incr_key: String,
    /// The counter's value as last acknowledged (every INCR before it answered).
    pub incr_acked: u64,
    /// INCRs sent whose reply never came (the server may have applied them).
    pub incr_pending: u64,
    pub set_keys: Vec<SetKey>,
    /// What ended the connection early: `reset`, `eof`, `wrong`, `hang`, `io`, `connect`.
    pub failure: Option<String>,
    pub error: Option<String>,
}

/// The client's JSON line.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClientReport {
    pub ok: bool,
    pub conns: Vec<ConnReport>,
    pub ops: u64,
    pub bytes: u64,
    pub resets: u64,
    pub eofs: u64,
    pub wrong: u64,
    pub hangs: u64,
    pub errors: u64,
    /// The longest stall and operation over the connections, ms.
    pub stall_ms: u64,
    pub max_op_ms: u64,
    pub secs: f64,
}

/// A RESP command (an array of bulk strings).
fn resp(parts: &[&[u8]]) -> Vec<u8> {
    let mut v = Vec::with_capacity(parts.iter().map(|p| p.len() + 16).sum::<usize>() + 16);
    v.extend_from_slice(format!("*{}\r\n", parts.len()).as_bytes());
    for p in parts {
        v.extend_from_slice(format!("${}\r\n", p.len()).as_bytes());
        v.extend_from_slice(p);
        v.extend_from_slice(b"\r\n");
    }
    v
}

fn sha_hex(b: &[u8]) -> String {
    Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

/// Why an operation failed; `matched`: the reply bytes verified before it.
struct Fail {
    kind: &'static str,
    msg: String,
    matched: usize,
}

/// `tcpi_bytes_acked + tcpi_bytes_received` and `tcpi_total_retrans` of a socket.
fn tcp_progress(fd: i32) -> (u64, u32) {
    // SAFETY: getsockopt writes at most `len` bytes into a zeroed tcp_info.
    let mut ti: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    let r = unsafe { libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, (&mut ti as *mut libc::tcp_info).cast(), &mut len) };
    if r != 0 {
        return (0, 0);
    }
    (ti.tcpi_bytes_acked.wrapping_add(ti.tcpi_bytes_received), ti.tcpi_total_retrans)
}

fn printable(b: &[u8]) -> String {
    let s: String = b.iter().take(48).flat_map(|&c| std::ascii::escape_default(c)).map(char::from).collect();
    if b.len() > 48 {
        format!("{s}...")
    } else {
        s
    }
}

/// One connection's socket and counters.
struct Conn {
    s: TcpStream,
    rep: ConnReport,
    hang: Duration,
    buf: Vec<u8>,
}

/// The progress clock of one operation.
struct Clock {
    start: Instant,
    last: Instant,
    seen: u64,
}

impl Conn {
    /// Samples the connection's progress: a stall is time with none.
    fn tick(&mut self, c: &mut Clock) -> Result<(), Fail> {
        let now = Instant::now();
        let (p, retrans) = tcp_progress(self.s.as_raw_fd());
        self.rep.retrans = retrans;
        let gap = now.duration_since(c.last).as_millis() as u64;
        self.rep.stall_ms = self.rep.stall_ms.max(gap);
        if p != c.seen {
            c.seen = p;
            c.last = now;
        }
        if now.duration_since(c.start) > self.hang {
            return Err(Fail { kind: "hang", msg: format!("an operation outstanding for more than {} ms (the last {gap} ms without any progress)", self.hang.as_millis()), matched: 0 });
        }
        Ok(())
    }

    fn io_fail(e: io::Error, what: &str) -> Fail {
        let kind = match e.kind() {
            io::ErrorKind::ConnectionReset => "reset",
            io::ErrorKind::UnexpectedEof | io::ErrorKind::BrokenPipe => "eof",
            _ => "io",
        };
        Fail { kind, msg: format!("{what}: {e}"), matched: 0 }
    }

    /// Sends `req`, then reads exactly the concatenation of `want` and compares it byte for
    /// byte. Returns once it matched; the stall and hang clocks run meanwhile.
    fn op(&mut self, req: &[u8], want: &[&[u8]]) -> Result<(), Fail> {
        let now = Instant::now();
        let mut c = Clock { start: now, last: now, seen: tcp_progress(self.s.as_raw_fd()).0 };
        let mut off = 0;
        while off < req.len() {
            match self.s.write(&req[off..]) {
                Ok(0) => return Err(Fail { kind: "eof", msg: "the connection refused more bytes".into(), matched: 0 }),
                Ok(n) => {
                    off += n;
                    self.rep.bytes_sent += n as u64;
                }
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted) => {}
                Err(e) => return Err(Self::io_fail(e, "sending")),
            }
            self.tick(&mut c)?;
        }
        let total: usize = want.iter().map(|w| w.len()).sum();
        let mut matched = 0;
        for part in want {
            let mut i = 0;
            while i < part.len() {
                let room = (part.len() - i).min(self.buf.len());
                let got = match self.s.read(&mut self.buf[..room]) {
                    Ok(0) => return Err(Fail { kind: "eof", msg: format!("EOF after {matched} of {total} reply bytes"), matched }),
                    Ok(n) => n,
                    Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted) => {
                        self.tick(&mut c).map_err(|f| Fail { matched, ..f })?;
                        continue;
                    }
                    Err(e) => return Err(Fail { matched, ..Self::io_fail(e, &format!("receiving after {matched} of {total} reply bytes")) }),
                };
                self.rep.bytes_received += got as u64;
                if self.buf[..got] != part[i..i + got] {
                    let k = (0..got).find(|&k| self.buf[k] != part[i + k]).unwrap_or(0);
                    let at = matched + k;
                    return Err(Fail {
                        kind: "wrong",
                        msg: format!("wrong byte at reply offset {at} of {total}: got \"{}\", expected \"{}\"", printable(&self.buf[k..got]), printable(&part[i + k..(i + got).min(part.len())])),
                        matched: at,
                    });
                }
                i += got;
                matched += got;
                self.tick(&mut c).map_err(|f| Fail { matched, ..f })?;
            }
        }
        self.rep.max_op_ms = self.rep.max_op_ms.max(c.start.elapsed().as_millis() as u64);
        Ok(())
    }
}

/// One connection's run; its report.
fn run_conn(a: &Args, i: usize, start: &Barrier, stop: &AtomicBool) -> ConnReport {
    let mut rep = ConnReport { conn: i, incr_key: format!("{}:c{i}:n", a.prefix), ..Default::default() };
    let keys: Vec<String> = (0..a.set_keys).map(|j| format!("{}:c{i}:v{j}", a.prefix)).collect();
    rep.set_keys = keys.iter().map(|k| SetKey { key: k.clone(), ..Default::default() }).collect();
    let connected = TcpStream::connect_timeout(&a.connect, Duration::from_secs(10)).and_then(|s| {
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_millis(10)))?;
        s.set_write_timeout(Some(Duration::from_millis(10)))?;
        Ok(s)
    });
    start.wait();
    let s = match connected {
        Ok(s) => s,
        Err(e) => {
            rep.failure = Some("connect".into());
            rep.error = Some(format!("connecting to {}: {e}", a.connect));
            return rep;
        }
    };
    rep.local_port = s.local_addr().map(|l| l.port()).unwrap_or(0);
    let mut c = Conn { s, rep, hang: Duration::from_millis(a.hang_ms), buf: vec![0u8; 256 << 10] };
    let mut rng = Rng::new(a.seed ^ (i as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
    let mut values: Vec<Option<Vec<u8>>> = vec![None; a.set_keys];
    let t0 = Instant::now();
    let secs = Duration::from_secs_f64(a.secs);
    while t0.elapsed() < secs && !stop.load(Ordering::Relaxed) {
        let pick = if a.max_value == 0 { 0 } else { rng.below(4) };
        let r = match pick {
            // INCR, half of the operations: 1 to max_pipeline at once.
            0 | 1 => {
                let n = rng.range(1, a.max_pipeline);
                let one = resp(&[b"INCR", c.rep.incr_key.as_bytes()]);
                let req: Vec<u8> = (0..n).flat_map(|_| one.iter().copied()).collect();
                let from = c.rep.incr_acked;
                let replies: Vec<Vec<u8>> = (1..=n).map(|k| format!(":{}\r\n", from + k).into_bytes()).collect();
                let want: Vec<&[u8]> = replies.iter().map(Vec::as_slice).collect();
                c.rep.incr_pending = n;
                let r = c.op(&req, &want);
                // Replies fully verified before a failure were acknowledged.
                let upto = match &r {
                    Ok(()) => usize::MAX,
                    Err(f) => f.matched,
                };
                let mut acc = 0;
                let done = replies.iter().take_while(|x| {
                    acc += x.len();
                    acc <= upto
                });
                let k = done.count() as u64;
                c.rep.incr_acked += k;
                c.rep.incr_pending = n - k;
                c.rep.incrs += k;
                c.rep.ops += k;
                r
            }
            2 => {
                let j = rng.below(a.set_keys as u64) as usize;
                let mut v = vec![0u8; rng.range(a.min_value, a.max_value) as usize];
                rng.fill(&mut v);
                c.rep.set_keys[j].pending = Some(sha_hex(&v));
                let r = c.op(&resp(&[b"SET", keys[j].as_bytes(), &v]), &[b"+OK\r\n"]);
                if r.is_ok() {
                    let k = &mut c.rep.set_keys[j];
                    k.acked = k.pending.take();
                    k.acked_len = v.len() as u64;
                    values[j] = Some(v);
                    c.rep.sets += 1;
                    c.rep.ops += 1;
                }
                r
            }
            _ => {
                let j = rng.below(a.set_keys as u64) as usize;
                let head = values[j].as_ref().map_or(b"$-1\r\n".to_vec(), |v| format!("${}\r\n", v.len()).into_bytes());
                let want: Vec<&[u8]> = match &values[j] {
                    Some(v) => vec![&head, v, b"\r\n"],
                    None => vec![&head],
                };
                let r = c.op(&resp(&[b"GET", keys[j].as_bytes()]), &want);
                if r.is_ok() {
                    c.rep.gets += 1;
                    c.rep.ops += 1;
                }
                r
            }
        };
        if let Err(f) = r {
            c.rep.failure = Some(f.kind.into());
            c.rep.error = Some(f.msg);
            break;
        }
    }
    c.rep.retrans = tcp_progress(c.s.as_raw_fd()).1;
    c.rep
}

/// Runs the client: `on_ready` once every connection is open (or failed to open).
pub fn run(a: &Args, on_ready: impl FnOnce()) -> ClientReport {
    let stop = Arc::new(AtomicBool::new(false));
    if a.until_stdin_eof {
        let s = stop.clone();
        std::thread::spawn(move || {
            let mut sink = [0u8; 256];
            while !matches!(io::stdin().read(&mut sink), Ok(0) | Err(_)) {}
            s.store(true, Ordering::Relaxed);
        });
    }
    let barrier = Arc::new(Barrier::new(a.conns + 1));
    let t0 = Instant::now();
    let handles: Vec<_> = (0..a.conns)
        .map(|i| {
            let (a, b, s) = (a.clone(), barrier.clone(), stop.clone());
            std::thread::spawn(move || run_conn(&a, i, &b, &s))
        })
        .collect();
    barrier.wait();
    on_ready();
    let conns: Vec<ConnReport> = handles
        .into_iter()
        .enumerate()
        .map(|(i, h)| h.join().unwrap_or_else(|_| ConnReport { conn: i, failure: Some("io".into()), error: Some("the connection's thread panicked".into()), ..Default::default() }))
        .collect();
    let count = |k: &str| conns.iter().filter(|c| c.failure.as_deref() == Some(k)).count() as u64;
    ClientReport {
        ok: conns.iter().all(|c| c.failure.is_none()),
        ops: conns.iter().map(|c| c.ops).sum(),
        bytes: conns.iter().map(|c| c.bytes_sent + c.bytes_received).sum(),
        resets: count("reset"),
        eofs: count("eof"),
        wrong: count("wrong"),
        hangs: count("hang"),
        errors: conns.iter().filter(|c| c.failure.is_some()).count() as u64,
        stall_ms: conns.iter().map(|c| c.stall_ms).max().unwrap_or(0),
        max_op_ms: conns.iter().map(|c| c.max_op_ms).max().unwrap_or(0),
        secs: t0.elapsed().as_secs_f64(),
        conns,
    }
}

/// `unbroken replica-check-client [--connect A:P] [--conns K] [--secs S] [--seed N]
/// [--min-value B] [--max-value B] [--max-pipeline N] [--set-keys N] [--hang-ms MS]
/// [--prefix P] [--until-stdin-eof]`: prints `ready`, then the report; exit 0 when ok, 1 when
/// not, 2 on bad arguments.
pub fn client_main(args: Vec<String>) -> i32 {
    let a = match Args::parse(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("replica-check-client: {e}");
            return 2;
        }
    };
    let r = run(&a, || {
        println!("ready");
        let _ = io::stdout().flush();
    });
    println!("{}", serde_json::to_string(&r).unwrap_or_default());
    i32::from(!r.ok)
}

/// The client running as a process (in the client namespace).
pub struct CheckClient {
    child: Child,
    lines: mpsc::Receiver<String>,
    stderr: Option<std::thread::JoinHandle<String>>,
    pub args: Args,
}

impl CheckClient {
    /// Starts `bin replica-check-client` in `ns` and waits (bounded by `timeout`) for its
    /// `ready` line: every connection open.
    pub fn start(ns: &str, bin: &std::path::Path, args: Args, timeout: Duration) -> io::Result<CheckClient> {
        let mut cmd = Command::new(bin);
        cmd.arg("replica-check-client").args(args.to_argv()).stdin(if args.until_stdin_eof { Stdio::piped() } else { Stdio::null() }).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = unbroken_lab::lab::spawn(ns, &mut cmd)?;
        let out = child.stdout.take().ok_or_else(|| io::Error::other("client stdout"))?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let stderr = child.stderr.take().map(|mut e| {
            std::thread::spawn(move || {
                let mut t = String::new();
                let _ = e.read_to_string(&mut t);
                t
            })
        });
        let mut c = CheckClient { child, lines, stderr, args };
        match c.lines.recv_timeout(timeout) {
            Ok(l) if l == "ready" => Ok(c),
            other => {
                let _ = c.child.kill();
                let _ = c.child.wait();
                let err = c.stderr.take().and_then(|h| h.join().ok()).unwrap_or_default();
                Err(io::Error::other(format!("replica-check-client did not print ready within {timeout:?} ({other:?}): {err}")))
            }
        }
    }

    /// Asks it to start no more operations (with `until_stdin_eof`; else it stops at `secs`).
    pub fn stop(&mut self) {
        drop(self.child.stdin.take());
    }

    /// Its report, waiting until `deadline` (then it is killed and this is an error).
    pub fn finish(mut self, deadline: Instant) -> Result<ClientReport, String> {
        let mut report = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    if let Ok(r) = serde_json::from_str::<ClientReport>(&l) {
                        report = Some(r);
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err(format!("the client did not finish by its deadline (killed): a hang beyond its own bound of {} ms", self.args.hang_ms));
                }
            }
        }
        let status = self.child.wait().map_err(|e| e.to_string())?;
        let err = self.stderr.take().and_then(|h| h.join().ok()).unwrap_or_default();
        match report {
            Some(r) if status.success() == r.ok && err.trim().is_empty() => Ok(r),
            Some(r) if err.trim().is_empty() => Err(format!("the client exited {status} with ok = {}", r.ok)),
            Some(_) | None => Err(format!("the client exited {status} without a report or with stderr: {}", err.trim())),
        }
    }
}

impl Drop for CheckClient {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A GET over a fresh connection to `at` from the namespace `ns`: the value, None for nil.
pub fn get_value(ns: &str, at: SocketAddr, key: &str) -> io::Result<Option<Vec<u8>>> {
    let key = key.to_string();
    unbroken_lab::lab::in_ns(ns, move || -> io::Result<Option<Vec<u8>>> {
        let mut s = TcpStream::connect_timeout(&at, Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(&resp(&[b"GET", key.as_bytes()]))?;
        let mut r = BufReader::new(s);
        let mut head = String::new();
        r.read_line(&mut head)?;
        let head = head.trim_end();
        if head == "$-1" {
            return Ok(None);
        }
        let n: usize = head.strip_prefix('$').and_then(|n| n.parse().ok()).ok_or_else(|| io::Error::other(format!("GET {key}: reply {head:?}")))?;
        let mut v = vec![0u8; n + 2];
        r.read_exact(&mut v)?;
        v.truncate(n);
        Ok(Some(v))
    })?
}

/// The acknowledged writes a server lacks (see [`lost_writes`]).
#[derive(Debug, Clone, Default, Serialize)]
pub struct LostWrites {
    /// INCRs acknowledged beyond the counter's value, plus SET keys holding neither the value
    /// last acknowledged nor one sent without its reply.
    pub lost: u64,
    pub incr_keys: u64,
    pub set_keys: u64,
    /// Keys that could not be read (the server unreachable).
    pub unreadable: u64,
    /// One line per key found short or unreadable.
    pub details: Vec<String>,
}

/// Reads every connection's counter and SET keys from the server at `at` (from `ns`) and
/// compares them with what the client was acknowledged. After the first key that cannot be
/// read (the server unreachable, or not answering within 5 s: a stopped server), the remaining
/// keys count as unreadable without trying again.
pub fn lost_writes(ns: &str, at: SocketAddr, r: &ClientReport) -> LostWrites {
    let mut l = LostWrites::default();
    let mut down: Option<String> = None;
    let mut get = |key: &str| -> io::Result<Option<Vec<u8>>> {
        if let Some(e) = &down {
            return Err(io::Error::other(format!("not tried: {e}")));
        }
        get_value(ns, at, key).map_err(|e| {
            down = Some(format!("{at} did not answer ({e})"));
            e
        })
    };
    for c in &r.conns {
        if c.local_port == 0 {
            continue;
        }
        l.incr_keys += 1;
        match get(&c.incr_key) {
            Ok(v) => {
                let got = v.as_deref().map_or(Some(0), |b| std::str::from_utf8(b).ok().and_then(|s| s.parse::<u64>().ok()));
                match got {
                    Some(g) if g < c.incr_acked => {
                        l.lost += c.incr_acked - g;
                        l.details.push(format!("{}: {g}, acknowledged {}", c.incr_key, c.incr_acked));
                    }
                    Some(g) if g > c.incr_acked + c.incr_pending => l.details.push(format!("{}: {g}, more than the {} acknowledged + {} unanswered", c.incr_key, c.incr_acked, c.incr_pending)),
                    Some(_) => {}
                    None => l.details.push(format!("{}: not a counter", c.incr_key)),
                }
            }
            Err(e) => {
                l.unreadable += 1;
                l.details.push(format!("{}: unreadable: {e}", c.incr_key));
            }
        }
        for k in &c.set_keys {
            l.set_keys += 1;
            match get(&k.key) {
                Ok(v) => {
                    let got = v.as_deref().map(sha_hex);
                    let fine = got == k.acked || (got.is_some() && got == k.pending);
                    if !fine {
                        l.lost += 1;
                        l.details.push(format!("{}: holds {}, acknowledged {}", k.key, got.as_deref().map_or("nothing", |g| &g[..12]), k.acked.as_deref().map_or("nothing", |g| &g[..12])));
                    }
                }
                Err(e) => {
                    l.unreadable += 1;
                    l.details.push(format!("{}: unreadable: {e}", k.key));
                }
            }
        }
    }
    l
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resp_encodes_bulk_arrays() {
        assert_eq!(resp(&[b"SET", b"k", b"a\r\nb"]), b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\na\r\nb\r\n".to_vec());
    }

    #[test]
    fn arguments_round_trip() {
        let a = Args { conns: 3, secs: 1.5, seed: 9, until_stdin_eof: true, prefix: "x".into(), ..Args::default() };
        let b = Args::parse(a.to_argv()).unwrap();
        assert_eq!((b.conns, b.secs, b.seed, b.until_stdin_eof, b.prefix, b.max_value), (3, 1.5, 9, true, "x".to_string(), 1 << 20));
        assert!(Args::parse(vec!["--min-value".into(), "0".into()]).is_err());
    }

    /// The client against a tiny in-process RESP server that answers as redis would: every
    /// reply verified, the counters and SET digests reported.
    #[test]
    fn verifies_every_reply_against_a_correct_server() {
        let (addr, _server) = fake_redis(false);
        let a = Args { connect: addr, conns: 2, secs: 0.5, min_value: 1, max_value: 4096, ..Args::default() };
        let r = run(&a, || {});
        assert!(r.ok, "{r:?}");
        for c in &r.conns {
            assert!(c.incrs > 0 && c.sets > 0 && c.gets > 0, "{c:?}");
            assert_eq!((c.incr_acked, c.incr_pending), (c.incrs, 0));
        }
    }

    #[test]
    fn a_wrong_byte_is_reported() {
        let (addr, _server) = fake_redis(true);
        let a = Args { connect: addr, conns: 1, secs: 5.0, max_value: 0, ..Args::default() };
        let r = run(&a, || {});
        assert!(!r.ok);
        assert_eq!(r.wrong, 1, "{r:?}");
        assert!(r.conns[0].error.as_deref().unwrap_or("").contains("wrong byte"), "{r:?}");
    }

    /// A RESP server good enough for the client's commands; `lie`: the 100th INCR is answered
    /// one too high.
    fn fake_redis(lie: bool) -> (SocketAddr, std::thread::JoinHandle<()>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let h = std::thread::spawn(move || {
            let db = Arc::new(std::sync::Mutex::new(std::collections::HashMap::<Vec<u8>, Vec<u8>>::new()));
            for s in l.incoming().flatten() {
                let db = db.clone();
                std::thread::spawn(move || {
                    let mut r = BufReader::new(s.try_clone().unwrap());
                    let mut w = s;
                    let mut incrs = 0;
                    loop {
                        let mut line = String::new();
                        if r.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        let n: usize = line.trim()[1..].parse().unwrap();
                        let mut parts = Vec::new();
                        for _ in 0..n {
                            let mut h = String::new();
                            r.read_line(&mut h).unwrap();
                            let len: usize = h.trim()[1..].parse().unwrap();
                            let mut b = vec![0u8; len + 2];
                            r.read_exact(&mut b).unwrap();
                            b.truncate(len);
                            parts.push(b);
                        }
                        let mut db = db.lock().unwrap();
                        let out = match parts[0].as_slice() {
                            b"INCR" => {
                                incrs += 1;
                                let v = db.get(&parts[1]).map_or(0, |v| String::from_utf8_lossy(v).parse::<u64>().unwrap()) + 1;
                                db.insert(parts[1].clone(), v.to_string().into_bytes());
                                format!(":{}\r\n", v + u64::from(lie && incrs == 100)).into_bytes()
                            }
                            b"SET" => {
                                db.insert(parts[1].clone(), parts[2].clone());
                                b"+OK\r\n".to_vec()
                            }
                            _ => match db.get(&parts[1]) {
                                Some(v) => [format!("${}\r\n", v.len()).as_bytes(), v, b"\r\n"].concat(),
                                None => b"$-1\r\n".to_vec(),
                            },
                        };
                        drop(db);
                        if w.write_all(&out).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, h)
    }
}
