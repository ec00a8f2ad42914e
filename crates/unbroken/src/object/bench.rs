//! `unbroken bench object`: object mode (TRODS-KV, seed 000) against unprotected nginx, in the
//! object lab ([`unbroken_lab::objlab`]): client namespace, nftables LB, three servers.
//!
//! Two systems are built side by side, identical but for object mode:
//!
//! * **unprotected**: the lab, nginx on every server, `unbroken lb`, and a heartbeat sender per
//!   server namespace ([`HeartbeatClient`], the agent's own sender, so the LB keeps every server
//!   alive exactly as with agents); no agent, no NFQUEUE rule, no Redis;
//! * **protected**: [`ObjectEnv`] as the demo runs it: Redis, nginx plus `unbroken agent` on
//!   every server, `unbroken lb`.
//!
//! Then, alternating between the two systems round by round:
//!
//! 1. **Requests per second**: `wrk -t2 -c32 -d{secs}s --latency` in the client namespace
//!    against the VIP for a 1-byte and a 16 KiB file, with keep-alive (wrk's default) and with a
//!    new connection per request (`-H "Connection: close"`); ratio protected / unprotected per
//!    round. The agents' engine counters are read around every protected run (a connection
//!    that went unprotected, e.g. because the store answered late, is reported). A pair of runs
//!    during which other processes used more than 0.05 CPUs is repeated.
//! 2. **First-byte latency**: serial requests from a Rust client in the client namespace, each
//!    over a new connection: time from the start of `connect()` to the first response byte;
//!    and, on one kept-alive connection, from the request's `write()` to the first byte.
//! 3. **Stall after a server death** (protected only): per trial, a Rust client downloads a
//!    large object (512 MiB, 256 with `--quick`, kept in tmpfs) as fast as it reads; once it
//!    has a random 16 MiB to 3/4 of it, the serving server loses power ([`ObjectEnv::crash`]).
//!    The client's stall is the longest gap between two reads that ends after the crash. Every
//!    byte is compared with the file, and RSTs to the download's port are counted by an
//!    iptables rule of its own. The server is then revived, and the next trial waits until the
//!    LB has every server alive and every bucket home (the system is rebuilt only if that
//!    fails).
//!
//! `wrk` must be installed (`apt-get install wrk`; `scripts/setup.sh`); the benchmark installs
//! nothing itself.

use crate::common::{med_min_max, median, round2, val};
use crate::object::demo::{make_object, EnvOpts, ObjectEnv};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use unbroken_lab::lab;
use unbroken_control::object::lb::HeartbeatClient;
use unbroken_lab::objlab::{addr, ObjectLab, ObjectOpts};

// ---------------------------------------------------------------------------------------------
// Options

/// Options of `unbroken bench object`.
#[derive(Debug, Clone)]
pub struct Opts {
    pub json: bool,
    pub quick: bool,
    /// wrk rounds (each round runs every variant once per configuration).
    pub runs: usize,
    /// Seconds per wrk run.
    pub secs: u64,
    /// wrk connections (`-c`); threads are fixed at 2.
    pub connections: usize,
    /// Serial requests per configuration and mode in the latency test.
    pub requests: usize,
    /// Server deaths (one per trial).
    pub trials: usize,
    /// Size of the object downloaded in the death trials (MiB).
    pub object_mib: u64,
    /// Hold /dev/cpu_dma_latency at 0 (idle vCPUs poll instead of halting).
    pub cpu_qos: bool,
    /// How often a wrk pair or latency block disturbed by other processes is repeated.
    pub retries: usize,
    /// Skip parts: `rps`, `latency`, `stall`.
    pub skip: Vec<String>,
    /// Also write the JSON report here.
    pub save: Option<PathBuf>,
    /// The protected system's configurations measured (issue 22): `[true, false]` (the
    /// agents' kernel fast path, then NFQUEUE only; the default), `[true]` or `[false]`.
    pub fast_path: Vec<bool>,
}

impl Opts {
    pub fn new(quick: bool) -> Opts {
        Opts {
            json: false,
            quick,
            runs: if quick { 1 } else { 3 },
            secs: if quick { 2 } else { 5 },
            connections: 32,
            requests: if quick { 500 } else { 2000 },
            trials: if quick { 10 } else { 50 },
            object_mib: if quick { 256 } else { 512 },
            cpu_qos: true,
            retries: if quick { 1 } else { 2 },
            skip: Vec::new(),
            save: None,
            fast_path: vec![true, false],
        }
    }

    /// Parses the arguments after `bench object`.
    pub fn parse(args: &[String]) -> Result<Opts, String> {
        let quick = args.iter().any(|a| a == "--quick");
        let mut o = Opts::new(quick);
        let mut it = args.iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                "object" | "--quick" => {}
                "--json" => o.json = true,
                "--runs" => o.runs = val(&mut it, "--runs")?,
                "--secs" => o.secs = val(&mut it, "--secs")?,
                "--connections" => o.connections = val(&mut it, "--connections")?,
                "--requests" => o.requests = val(&mut it, "--requests")?,
                "--trials" => o.trials = val(&mut it, "--trials")?,
                "--size" => o.object_mib = val(&mut it, "--size")?,
                "--no-cpu-qos" => o.cpu_qos = false,
                "--retries" => o.retries = val(&mut it, "--retries")?,
                "--skip" => {
                    o.skip = it
                        .next()
                        .ok_or("--skip needs rps,latency,bulk,stall")?
                        .split(',')
                        .map(|s| s.trim().to_string())
                        .collect()
                }
                "--save" => o.save = Some(it.next().ok_or("--save needs a FILE")?.into()),
                "--fast-path" => {
                    o.fast_path = match it.next().map(String::as_str) {
                        Some("both") => vec![true, false],
                        Some("on") => vec![true],
                        Some("off") => vec![false],
                        _ => return Err("--fast-path needs both, on or off".into()),
                    }
                }
                x => return Err(format!("bench object: unknown argument {x:?}")),
            }
        }
        if o.runs == 0 || o.secs == 0 || o.connections == 0 || o.requests == 0 {
            return Err(
                "bench object: --runs, --secs, --connections and --requests must be positive"
                    .into(),
            );
        }
        if o.object_mib < 64 {
            return Err("bench object: --size must be at least 64 (MiB): the crash lands between 16 MiB and 3/4 of the object".into());
        }
        if let Some(s) = o
            .skip
            .iter()
            .find(|s| !["rps", "latency", "bulk", "stall"].contains(&s.as_str()))
        {
            return Err(format!(
                "bench object: --skip: unknown part {s:?} (rps, latency, bulk, stall)"
            ));
        }
        Ok(o)
    }

    fn runs_part(&self, p: &str) -> bool {
        !self.skip.iter().any(|s| s == p)
    }
}

const USAGE: &str = "usage: unbroken bench object [--json] [--quick] [--trials N] [--secs S] [--runs N] [--requests N] [--connections C] [--size MIB] [--skip rps,latency,bulk,stall] [--fast-path both|on|off] [--retries N] [--no-cpu-qos] [--save FILE]";

/// `unbroken bench object ...` (the arguments after `bench`); returns the exit code.
pub fn main(args: Vec<String>) -> i32 {
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return 0;
    }
    let o = match Opts::parse(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("unbroken: {e}\n{USAGE}");
            return 2;
        }
    };
    match run(&o) {
        Ok(v) => {
            if let Some(f) = &o.save {
                if let Err(e) = std::fs::write(f, format!("{v}\n")) {
                    eprintln!("unbroken: bench object: --save {}: {e}", f.display());
                }
            }
            if o.json {
                println!("{v}");
            } else {
                print_table(&v);
            }
            if v["ok"].as_bool() == Some(true) {
                0
            } else {
                1
            }
        }
        Err(e) => {
            if o.json {
                println!("{}", json!({"ok": false, "error": e}));
            }
            eprintln!("unbroken: bench object: {e}");
            2
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Small helpers

fn find_in_path(bin: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(bin)).find(|p| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split(':').nth(1))
            .map(|s| s.trim().to_string())
    });
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .next()
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|k| k.parse::<f64>().ok())
        })
        .map(|kb| (kb / 1048576.0 * 10.0).round() / 10.0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .ok();
    let nginx = Command::new("/usr/sbin/nginx")
        .arg("-v")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stderr).trim().to_string());
    let wrk = find_in_path("wrk")
        .and_then(|p| Command::new(p).arg("-v").output().ok())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .to_string()
        });
    json!({ "cpu": cpu, "cpus": std::thread::available_parallelism().map(|n| n.get()).ok(), "mem_gib": mem, "kernel": kernel, "nginx": nginx, "wrk": wrk })
}

/// Nearest-rank percentile of sorted `v` (`q` in 0..=1).
fn pct(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let k = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[k - 1]
}

/// p50 / p90 / p99 / max / mean / n of `v` (any order).
fn dist(v: &[f64]) -> Value {
    if v.is_empty() {
        return Value::Null;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let mean = s.iter().sum::<f64>() / s.len() as f64;
    json!({ "n": s.len(), "p50": round2(pct(&s, 0.5)), "p90": round2(pct(&s, 0.9)), "p99": round2(pct(&s, 0.99)), "max": round2(s[s.len() - 1]), "min": round2(s[0]), "mean": round2(mean) })
}

/// Requests a CPU wakeup latency of 0 (PM QoS) while the returned file stays open.
fn cpu_latency_zero() -> Result<std::fs::File, String> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/cpu_dma_latency")
        .map_err(|e| format!("/dev/cpu_dma_latency: {e} (use --no-cpu-qos)"))?;
    f.write_all(&0i32.to_ne_bytes())
        .map_err(|e| format!("/dev/cpu_dma_latency: {e}"))?;
    Ok(f)
}

/// Busy and total jiffies of all CPUs (/proc/stat).
fn cpu_jiffies() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let l = s.lines().next().unwrap_or("");
    let v: Vec<u64> = l
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// CPU ticks (user + system) of every process but this one, by pid, with a label:
/// `<role>/<command>` for processes in the lab's namespaces (`servers/nginx`,
/// `servers/unbroken`, `store/redis-server`, `lb/unbroken`), `kernel` for kernel threads
/// (softirq work lands partly there), `other` for every other process on the machine.
fn proc_ticks(nss: &[(String, String)]) -> HashMap<i32, (u64, String)> {
    use std::os::unix::fs::MetadataExt;
    let ids: Vec<((u64, u64), &str)> = nss
        .iter()
        .filter_map(|(ns, role)| {
            std::fs::metadata(format!("/run/netns/{ns}"))
                .ok()
                .map(|m| ((m.dev(), m.ino()), role.as_str()))
        })
        .collect();
    let me = std::process::id() as i32;
    let mut m = HashMap::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return m;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(st) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let (Some(a), Some(b)) = (st.find('('), st.rfind(')')) else {
            continue;
        };
        let comm = &st[a + 1..b];
        let f: Vec<&str> = st[b + 2..].split_whitespace().collect();
        let (Some(u), Some(s)) = (
            f.get(11).and_then(|x| x.parse::<u64>().ok()),
            f.get(12).and_then(|x| x.parse::<u64>().ok()),
        ) else {
            continue;
        };
        let ns = std::fs::metadata(format!("/proc/{pid}/ns/net"))
            .ok()
            .map(|m| (m.dev(), m.ino()));
        let label = match ids.iter().find(|(id, _)| Some(*id) == ns) {
            Some((_, role)) => format!("{role}/{comm}"),
            None if std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| c.is_empty())
                .unwrap_or(true) =>
            {
                "kernel".to_string()
            }
            None => "other".to_string(),
        };
        m.insert(pid, (u + s, label));
    }
    m
}

/// CPU seconds of this process and of its waited-for children (wrk, run to completion).
fn rusage_secs(who: i32) -> f64 {
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(who, &mut r) } != 0 {
        return 0.0;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(r.ru_utime) + t(r.ru_stime)
}

/// The namespaces of a lab with their roles (server namespaces share the role `servers`).
fn roles(l: &ObjectLab) -> Vec<(String, String)> {
    let mut v = vec![
        (l.client().to_string(), "client".to_string()),
        (l.lb().to_string(), "lb".to_string()),
        (l.store().to_string(), "store".to_string()),
    ];
    for i in 1..=l.n_servers() {
        v.push((l.server(i).to_string(), "servers".to_string()));
    }
    v
}

/// The namespaces of the measured system (`<role>`) and of the idle one (`idle/<role>`).
fn both(measured: &ObjectLab, idle: &ObjectLab) -> Vec<(String, String)> {
    let mut v = roles(measured);
    v.extend(
        roles(idle)
            .into_iter()
            .map(|(ns, r)| (ns, format!("idle/{r}"))),
    );
    v
}

/// CPU use (in CPUs) between two snapshots: of the lab's processes by `<role>/<command>`, of
/// this process's finished children (`children`: wrk during a wrk run; ip, ss and iptables
/// in the crash trials), of this process (`bench`: the latency and download clients), of other
/// processes (`other`: anything else running on the machine disturbs the numbers), of kernel
/// threads, and of the whole machine (including softirq work not charged to any process).
struct CpuWatch {
    nss: Vec<(String, String)>,
    ticks: HashMap<i32, (u64, String)>,
    jiffies: (u64, u64),
    children: f64,
    me: f64,
    t: Instant,
}

impl CpuWatch {
    fn start(nss: Vec<(String, String)>) -> CpuWatch {
        let ticks = proc_ticks(&nss);
        CpuWatch {
            nss,
            ticks,
            jiffies: cpu_jiffies(),
            children: rusage_secs(libc::RUSAGE_CHILDREN),
            me: rusage_secs(libc::RUSAGE_SELF),
            t: Instant::now(),
        }
    }

    fn stop(self) -> Value {
        let secs = self.t.elapsed().as_secs_f64().max(1e-3);
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let after = proc_ticks(&self.nss);
        let mut by: BTreeMap<String, f64> = BTreeMap::new();
        for (pid, (t, label)) in &after {
            let t0 = self.ticks.get(pid).map(|x| x.0).unwrap_or(0);
            *by.entry(label.clone()).or_insert(0.0) += t.saturating_sub(t0) as f64 / hz / secs;
        }
        by.insert(
            "client/wrk".into(),
            (rusage_secs(libc::RUSAGE_CHILDREN) - self.children) / secs,
        );
        by.insert(
            "bench".into(),
            (rusage_secs(libc::RUSAGE_SELF) - self.me) / secs,
        );
        let (b1, t1) = cpu_jiffies();
        let ncpu = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1) as f64;
        let busy = if t1 > self.jiffies.1 {
            (b1 - self.jiffies.0) as f64 / (t1 - self.jiffies.1) as f64 * ncpu
        } else {
            0.0
        };
        let other = by.get("other").copied().unwrap_or(0.0);
        let by: serde_json::Map<String, Value> = by
            .into_iter()
            .filter(|(_, v)| *v >= 0.005)
            .map(|(k, v)| (k, json!(round2(v))))
            .collect();
        json!({ "machine_busy_cpus": round2(busy), "other_cpus": round2(other), "by_process": by })
    }
}

/// Processes outside the lab may use this much CPU during a measurement before it is flagged.
const OTHER_LIMIT: f64 = 0.05;

// ---------------------------------------------------------------------------------------------
// The unprotected system

/// The object lab with nginx and the LB but no agents: heartbeats come from a
/// [`HeartbeatClient`] per server namespace (the agent's sender).
struct PlainEnv {
    lab: ObjectLab,
    dir: PathBuf,
    docroot: PathBuf,
    lb: Option<Child>,
    nginx: Vec<Child>,
    heartbeats: Vec<HeartbeatClient>,
}

impl Drop for PlainEnv {
    fn drop(&mut self) {
        self.heartbeats.clear();
        for c in self.nginx.iter_mut().chain(self.lb.iter_mut()) {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl PlainEnv {
    fn start(servers: usize) -> io::Result<PlainEnv> {
        let lab = ObjectLab::build(ObjectOpts {
            servers,
            ..ObjectOpts::default()
        })?;
        let dir = std::env::temp_dir().join(format!("unbroken-objbench-{}", lab.prefix()));
        let docroot = dir.join("www");
        std::fs::create_dir_all(&docroot)?;
        let mut env = PlainEnv {
            lab,
            dir,
            docroot,
            lb: None,
            nginx: Vec::new(),
            heartbeats: Vec::new(),
        };
        // The same LB settings as ObjectEnv (the default dead_after, the lab's config otherwise).
        let mut lbc = env.lab.lb_config();
        lbc.dead_after_ms = EnvOpts::default().dead_after_ms;
        std::fs::write(
            env.dir.join("lb.toml"),
            toml::to_string(&lbc).map_err(io::Error::other)?,
        )?;
        let lb_ns = env.lab.lb().to_string();
        env.lb = Some(lab::spawn(
            &lb_ns,
            Command::new(std::env::current_exe()?)
                .args(["lb", "--config"])
                .arg(env.dir.join("lb.toml"))
                .arg("--status-file")
                .arg(env.dir.join("lb.json"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(env.dir.join("lb.log"))?),
        )?);
        let key = lbc.key_bytes().map_err(io::Error::other)?;
        for i in 1..=servers {
            let run = env.dir.join(format!("nginx{i}"));
            let n = env.lab.start_nginx(i, &env.docroot, &run)?;
            env.nginx.push(n);
            let ns = env.lab.server(i).to_string();
            let hb = lab::in_ns(&ns, || {
                HeartbeatClient::start(i as u16, addr::HEARTBEAT, Duration::from_millis(5), &key)
            })??;
            env.heartbeats.push(hb);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ok = std::fs::read_to_string(env.dir.join("lb.json"))
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                .is_some_and(|s| {
                    s["servers"].as_array().is_some_and(|v| {
                        v.len() == servers
                            && v.iter().all(|x| {
                                x["alive"] == true
                                    && x["last_heartbeat_age_ms"]
                                        .as_u64()
                                        .is_some_and(|a| a < 1000)
                            })
                    })
                });
            if ok {
                return Ok(env);
            }
            if Instant::now() > deadline {
                return Err(io::Error::other(
                    "unprotected system: servers not alive at the LB after 20 s",
                ));
            }
            std::thread::sleep(Duration::from_millis(20)); // polling a status file with a deadline
        }
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP over plain sockets (the latency and stall clients)

const VIP: SocketAddr = SocketAddr::new(IpAddr::V4(addr::VIP_V4), 80);
const SMALL: &str = "/1b";
const PAGE: &str = "/16k";
const BIG: &str = "/big.bin";

fn request(path: &str, close: bool) -> Vec<u8> {
    format!(
        "GET {path} HTTP/1.1\r\nHost: {}\r\nUser-Agent: unbroken-bench\r\n{}\r\n",
        addr::VIP_V4,
        if close { "Connection: close\r\n" } else { "" }
    )
    .into_bytes()
}

/// Reads one response head (into `buf`, which may then also hold body bytes); returns the
/// time of the first byte, the head's length and the Content-Length.
fn read_head(s: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<(Instant, usize, u64)> {
    buf.clear();
    let mut first = None;
    let mut chunk = [0u8; 16384];
    loop {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed before the response head",
            ));
        }
        first.get_or_insert_with(Instant::now);
        buf.extend_from_slice(&chunk[..n]);
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..p]).to_string();
            if !head.starts_with("HTTP/1.1 200") {
                return Err(io::Error::other(format!(
                    "unexpected response: {}",
                    head.lines().next().unwrap_or("")
                )));
            }
            let cl = head.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse::<u64>().ok())
                    .flatten()
            });
            let cl = cl.ok_or_else(|| io::Error::other("no Content-Length"))?;
            return Ok((first.unwrap_or_else(Instant::now), p + 4, cl));
        }
        if buf.len() > 65536 {
            return Err(io::Error::other("response head over 64 KiB"));
        }
    }
}

/// Reads the rest of a body of `cl` bytes of which `have` are already read; with `to_eof`,
/// then expects the server's FIN.
fn read_body(s: &mut TcpStream, have: u64, cl: u64, to_eof: bool) -> io::Result<()> {
    let mut left = cl
        .checked_sub(have)
        .ok_or_else(|| io::Error::other("more body bytes than Content-Length"))?;
    let mut chunk = [0u8; 65536];
    while left > 0 {
        let n = s.read(&mut chunk[..left.min(65536) as usize])?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "short body"));
        }
        left -= n as u64;
    }
    if to_eof && s.read(&mut chunk)? != 0 {
        return Err(io::Error::other("bytes after the body"));
    }
    Ok(())
}

/// One sample of the latency test, microseconds.
#[derive(Debug, Clone, Copy)]
struct Sample {
    connect: f64,
    first_byte: f64,
    total: f64,
}

/// `n` serial requests for `path`, each over a new connection (`Connection: close`).
fn serial_new_conns(n: usize, path: &str) -> Serial {
    let req = request(path, true);
    let mut buf = Vec::new();
    let mut out = Serial::default();
    for _ in 0..n {
        let t0 = Instant::now();
        let mut one = || -> io::Result<Sample> {
            let mut s = TcpStream::connect_timeout(&VIP, Duration::from_secs(5))?;
            let tc = Instant::now();
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            s.write_all(&req)?;
            let (first, hl, cl) = read_head(&mut s, &mut buf)?;
            read_body(&mut s, (buf.len() - hl) as u64, cl, true)?;
            let end = Instant::now();
            let us = |t: Instant| (t - t0).as_secs_f64() * 1e6;
            Ok(Sample {
                connect: us(tc),
                first_byte: us(first),
                total: us(end),
            })
        };
        match one() {
            Ok(x) => out.samples.push(x),
            Err(e) => out.errors.push(e.to_string()),
        }
    }
    out
}

/// `n` serial requests for `path` on one kept-alive connection: request written to first byte.
/// A failed request is counted and the connection opened again.
fn serial_keepalive(n: usize, path: &str) -> Serial {
    let req = request(path, false);
    let mut buf = Vec::new();
    let mut out = Serial::default();
    let mut conn: Option<TcpStream> = None;
    for _ in 0..n {
        let r = (|| -> io::Result<Sample> {
            if conn.is_none() {
                let s = TcpStream::connect_timeout(&VIP, Duration::from_secs(5))?;
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(Duration::from_secs(5)))?;
                conn = Some(s);
            }
            let s = conn
                .as_mut()
                .ok_or_else(|| io::Error::other("no connection"))?;
            let t0 = Instant::now();
            s.write_all(&req)?;
            let (first, hl, cl) = read_head(s, &mut buf)?;
            read_body(s, (buf.len() - hl) as u64, cl, false)?;
            let end = Instant::now();
            let us = |t: Instant| (t - t0).as_secs_f64() * 1e6;
            Ok(Sample {
                connect: 0.0,
                first_byte: us(first),
                total: us(end),
            })
        })();
        match r {
            Ok(x) => out.samples.push(x),
            Err(e) => {
                out.errors.push(e.to_string());
                conn = None;
            }
        }
    }
    out
}

/// Samples of a serial run, and the requests that failed.
#[derive(Debug, Default)]
struct Serial {
    samples: Vec<Sample>,
    errors: Vec<String>,
}

// ---------------------------------------------------------------------------------------------
// wrk

/// Parses a wrk duration (`812.00us`, `1.20ms`, `2.01s`) into microseconds.
fn wrk_us(s: &str) -> Option<f64> {
    let s = s.trim();
    for (suf, mul) in [("us", 1.0), ("ms", 1e3), ("m", 60e6), ("s", 1e6)] {
        if let Some(x) = s.strip_suffix(suf) {
            return x.parse::<f64>().ok().map(|v| v * mul);
        }
    }
    None
}

/// The numbers of one wrk run.
fn parse_wrk(out: &str) -> Result<Value, String> {
    let mut rps = None;
    let mut requests = None;
    let mut lat = serde_json::Map::new();
    let mut errors = json!({ "connect": 0, "read": 0, "write": 0, "timeout": 0 });
    let mut non2xx = 0u64;
    let mut in_dist = false;
    for l in out.lines() {
        let t = l.trim();
        if let Some(v) = t.strip_prefix("Requests/sec:") {
            rps = v.trim().parse::<f64>().ok();
        } else if t.contains(" requests in ") {
            requests = t
                .split_whitespace()
                .next()
                .and_then(|x| x.parse::<u64>().ok());
        } else if t.starts_with("Latency Distribution") {
            in_dist = true;
            continue;
        } else if let Some(v) = t.strip_prefix("Socket errors:") {
            for part in v.split(',') {
                let mut w = part.split_whitespace();
                if let (Some(k), Some(n)) = (w.next(), w.next().and_then(|x| x.parse::<u64>().ok()))
                {
                    errors[k] = json!(n);
                }
            }
        } else if let Some(v) = t.strip_prefix("Non-2xx or 3xx responses:") {
            non2xx = v.trim().parse().unwrap_or(0);
        } else if t.starts_with("Latency ") && !in_dist {
            // Thread Stats: Latency avg stdev max
            let f: Vec<&str> = t.split_whitespace().collect();
            if let (Some(a), Some(m)) = (
                f.get(1).and_then(|x| wrk_us(x)),
                f.get(3).and_then(|x| wrk_us(x)),
            ) {
                lat.insert("mean".into(), json!(round2(a)));
                lat.insert("max".into(), json!(round2(m)));
            }
        }
        if in_dist {
            let f: Vec<&str> = t.split_whitespace().collect();
            match (
                f.first().and_then(|p| p.strip_suffix('%')),
                f.get(1).and_then(|x| wrk_us(x)),
            ) {
                (Some(p), Some(us)) if f.len() == 2 => {
                    lat.insert(format!("p{p}"), json!(round2(us)));
                }
                _ => in_dist = false,
            }
        }
    }
    let rps = rps.ok_or_else(|| format!("wrk printed no Requests/sec:\n{out}"))?;
    Ok(
        json!({ "rps": round2(rps), "requests": requests, "latency_us": lat, "socket_errors": errors, "non_2xx": non2xx }),
    )
}

fn run_wrk(
    wrk: &Path,
    client_ns: &str,
    conns: usize,
    secs: u64,
    path: &str,
    close: bool,
) -> Result<Value, String> {
    let mut c = Command::new(wrk);
    c.args([
        "-t2",
        &format!("-c{conns}"),
        &format!("-d{secs}s"),
        "--latency",
    ]);
    if close {
        c.args(["-H", "Connection: close"]);
    }
    c.arg(format!("http://{}{path}", addr::VIP_V4));
    c.stdin(Stdio::null());
    let out = lab::run(client_ns, &mut c).map_err(|e| format!("wrk: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "wrk failed ({}): {}{}",
            out.status,
            text,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    parse_wrk(&text)
}

/// The agents' engine and agent counters, summed over the servers.
fn counters(env: &ObjectEnv) -> BTreeMap<String, i64> {
    let mut m = BTreeMap::new();
    for i in 1..=env.lab.n_servers() {
        let Some(v) = env.agent_status(i) else {
            continue;
        };
        for sec in ["engine", "agent"] {
            if let Some(o) = v[sec].as_object() {
                for (k, x) in o {
                    if let Some(n) = x.as_i64() {
                        *m.entry(format!("{sec}.{k}")).or_insert(0) += n;
                    }
                }
            }
        }
    }
    m
}

fn counters_delta(a: &BTreeMap<String, i64>, b: &BTreeMap<String, i64>) -> Value {
    let mut o = serde_json::Map::new();
    for (k, v) in b {
        let d = v - a.get(k).copied().unwrap_or(0);
        if d != 0 && !k.ends_with("_us_last") && !k.ends_with("_us_max") {
            o.insert(k.clone(), json!(d));
        }
    }
    Value::Object(o)
}

/// The agents write their status every 500 ms.
const STATUS_SETTLE: Duration = Duration::from_millis(650);

// ---------------------------------------------------------------------------------------------
// The benchmark

struct Systems {
    plain: Option<PlainEnv>,
    prot: ObjectEnv,
    big: BigObject,
}

/// The large object of the crash trials, in tmpfs (`/dev/shm`): writing it to the disk-backed
/// temporary directory caused writeback stalls long enough for the LB to declare live
/// servers dead. Removed when dropped.
struct BigObject {
    dir: PathBuf,
    path: PathBuf,
    data: Arc<Vec<u8>>,
}

impl BigObject {
    fn create(mib: u64) -> io::Result<BigObject> {
        let dir = PathBuf::from(format!("/dev/shm/unbroken-objbench-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join(BIG.trim_start_matches('/'));
        make_object(&path, mib << 20, 42)?;
        let data = Arc::new(std::fs::read(&path)?);
        Ok(BigObject { dir, path, data })
    }
}

impl Drop for BigObject {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The small pages, and the large object as a symbolic link (nginx follows it).
fn write_files(docroot: &Path, big: Option<&BigObject>) -> io::Result<()> {
    std::fs::write(docroot.join(SMALL.trim_start_matches('/')), b"x")?;
    let page: Vec<u8> = (0..16384u32).map(|i| b'a' + (i % 26) as u8).collect();
    std::fs::write(docroot.join(PAGE.trim_start_matches('/')), page)?;
    if let Some(b) = big {
        std::os::unix::fs::symlink(&b.path, docroot.join(BIG.trim_start_matches('/')))?;
    }
    Ok(())
}

fn start_protected(big: &BigObject) -> Result<ObjectEnv, String> {
    let env = ObjectEnv::start(EnvOpts::default())
        .map_err(|e| format!("starting the protected system: {e}"))?;
    write_files(&env.docroot, Some(big)).map_err(|e| format!("writing the objects: {e}"))?;
    Ok(env)
}

/// Runs `unbroken bench object` and returns its report as one JSON object.
pub fn run(o: &Opts) -> Result<Value, String> {
    let wrk = find_in_path("wrk");
    if o.runs_part("rps") && wrk.is_none() {
        return Err("wrk is not installed: `apt-get install -y wrk` (scripts/setup.sh installs it), or --skip rps".into());
    }
    lab::lab_available()?;
    let _qos = if o.cpu_qos {
        Some(cpu_latency_zero()?)
    } else {
        None
    };
    let t_start = Instant::now();
    let log = |m: String| {
        if !o.json {
            eprintln!(
                "[bench object {:>5.1} s] {m}",
                t_start.elapsed().as_secs_f64()
            );
        }
    };
    log(format!(
        "writing the {} MiB object to /dev/shm",
        o.object_mib
    ));
    let big = BigObject::create(o.object_mib).map_err(|e| format!("writing the object: {e}"))?;
    log("starting the unprotected and the protected system".into());
    let plain = PlainEnv::start(3).map_err(|e| format!("starting the unprotected system: {e}"))?;
    write_files(&plain.docroot, Some(&big)).map_err(|e| format!("writing the objects: {e}"))?;
    let prot = start_protected(&big)?;
    let mut sys = Systems {
        plain: Some(plain),
        prot,
        big,
    };
    let mut problems: Vec<String> = Vec::new();
    let mut warnings: Vec<String> = Vec::new();

    let mut phases = serde_json::Map::new();
    phases.insert("rps".into(), json!(round2(t_start.elapsed().as_secs_f64())));
    // Each configuration of the protected system in turn (the agents restarted between):
    // the fast path's figures are the report's `rps` and `latency`, NFQUEUE only's
    // `rps_nfqueue` and `latency_nfqueue` (the first measured configuration's are `rps` and
    // `latency` when only one is).
    let mut measured: Vec<(bool, Option<Value>, Option<Value>, Option<Value>)> = Vec::new();
    for &fast in &o.fast_path {
        if o.runs_part("rps") || o.runs_part("latency") || o.runs_part("bulk") {
            log(format!("protected system: agents with the fast path {}", if fast { "on" } else { "off (NFQUEUE only)" }));
            sys.prot.set_fast_path(fast).map_err(|e| format!("switching the agents' fast path: {e}"))?;
        }
        let rps = if o.runs_part("rps") {
            Some(bench_rps(o, wrk.as_deref().unwrap_or(Path::new("wrk")), &sys, &mut warnings, &log)?)
        } else {
            None
        };
        let latency = if o.runs_part("latency") {
            Some(bench_latency(o, &sys, &mut warnings, &log)?)
        } else {
            None
        };
        let bulk = if o.runs_part("bulk") {
            Some(bench_bulk(o, &sys, &mut warnings, &log)?)
        } else {
            None
        };
        measured.push((fast, rps, latency, bulk));
    }
    phases.insert(
        "latency".into(),
        json!(round2(t_start.elapsed().as_secs_f64())),
    );
    let pick = |fast: bool| measured.iter().find(|m| m.0 == fast).cloned();
    let (main, slow) = match (pick(true), pick(false)) {
        (Some(f), s) => (Some(f), s),
        (None, s) => (s, None),
    };
    let rps = main.as_ref().and_then(|m| m.1.clone());
    let latency = main.as_ref().and_then(|m| m.2.clone());
    let rps_nfqueue = slow.as_ref().and_then(|m| m.1.clone());
    let latency_nfqueue = slow.as_ref().and_then(|m| m.2.clone());
    let bulk = main.as_ref().and_then(|m| m.3.clone());
    let bulk_nfqueue = slow.as_ref().and_then(|m| m.3.clone());
    let mut fast_summary = fast_path_summary(main.as_ref().is_some_and(|m| m.0), rps.as_ref(), rps_nfqueue.as_ref(), latency.as_ref(), latency_nfqueue.as_ref());
    fast_summary["bulk"] = json!({ "median_ratio": bulk.as_ref().and_then(|b| b["ratio"]["median"].as_f64()), "nfqueue_median_ratio": bulk_nfqueue.as_ref().and_then(|b| b["ratio"]["median"].as_f64()) });
    // The crash trials with the fast path unless only NFQUEUE was asked for.
    let stall_fast = o.fast_path.contains(&true);
    if sys.prot.opts_fast_path() != stall_fast {
        sys.prot.set_fast_path(stall_fast).map_err(|e| format!("switching the agents' fast path: {e}"))?;
    }
    // A server declared dead while nobody killed it (heartbeats late on a busy machine) moves
    // its buckets: unprotected connections of those buckets are reset, protected ones fail over.
    let (_, plain_ev) = sys
        .plain
        .as_ref()
        .map(|p| lb_downs(&p.dir.join("lb.json"), t_start))
        .unwrap_or_default();
    let (_, prot_ev) = lb_downs(&sys.prot.dir.join("lb.json"), t_start);
    // Those while the systems were being built (before the first measurement) do not matter.
    let t_rps = phases.get("rps").and_then(|x| x.as_f64()).unwrap_or(0.0);
    let during = |v: &[Value]| {
        v.iter()
            .filter(|e| e[0].as_f64().unwrap_or(0.0) >= t_rps)
            .count()
    };
    let (plain_downs, prot_downs) = (during(&plain_ev), during(&prot_ev));
    if plain_downs + prot_downs > 0 {
        warnings.push(format!(
            "the LB declared live servers dead during the throughput and latency tests: {plain_downs} time(s) in the unprotected system, {prot_downs} in the protected one (lb_false_deaths lists them)"
        ));
    }
    // The crash trials run alone.
    sys.plain = None;
    phases.insert(
        "stall".into(),
        json!(round2(t_start.elapsed().as_secs_f64())),
    );
    let stall = if o.runs_part("stall") {
        Some(bench_stall(o, &mut sys, &mut problems, &log)?)
    } else {
        None
    };
    let ok = problems.is_empty();
    Ok(json!({
        "ok": ok,
        "bench": "object",
        "machine": machine(),
        "config": {
            "quick": o.quick, "runs": o.runs, "secs": o.secs, "wrk": format!("wrk -t2 -c{} -d{}s --latency [-H 'Connection: close'] http://{}/{{1b,16k}}", o.connections, o.secs, addr::VIP_V4),
            "requests": o.requests, "trials": o.trials, "object_mib": o.object_mib, "cpu_dma_latency_0": o.cpu_qos, "servers": 3,
            "fast_path": o.fast_path, "stall_fast_path": stall_fast, "dead_after_ms": EnvOpts::default().dead_after_ms, "store_timeout_ms": EnvOpts::default().store_timeout_ms,
        },
        "rps": rps,
        "latency": latency,
        "rps_nfqueue": rps_nfqueue,
        "bulk": bulk,
        "bulk_nfqueue": bulk_nfqueue,
        "latency_nfqueue": latency_nfqueue,
        "fast_path": fast_summary,
        "stall": stall,
        "lb_false_deaths": { "unprotected": plain_downs, "protected": prot_downs, "events_unprotected": plain_ev, "events_protected": prot_ev, "phase_times_s": phases },
        "problems": problems,
        "warnings": warnings,
        "duration_s": t_start.elapsed().as_secs(),
        "paper": { "added_first_byte_us": 119, "rps_ratio_1b": 0.70, "failover": "under 1 s" },
        "targets": { "added_first_byte_us": 50, "rps_ratio": 0.95, "stall_p50_ms": 100 },
    }))
}

/// The fast path's figures beside the unprotected system's and NFQUEUE only's (issue 22):
/// per wrk variant the median req/s ratio to the unprotected system with the fast path
/// (`median_ratio`) and with NFQUEUE only (`nfqueue_median_ratio`); the first byte added on a
/// new and a kept-alive connection (p50), both ways.
fn fast_path_summary(on: bool, rps: Option<&Value>, rps_slow: Option<&Value>, lat: Option<&Value>, lat_slow: Option<&Value>) -> Value {
    let mut v = serde_json::Map::new();
    v.insert("on".into(), json!(on));
    for (name, _, _) in VARIANTS {
        let r = |x: Option<&Value>| x.and_then(|x| x[name]["ratio"]["median"].as_f64());
        v.insert(name.to_string(), json!({ "median_ratio": r(rps), "nfqueue_median_ratio": r(rps_slow) }));
    }
    for m in ["new_connection", "keepalive"] {
        let a = |x: Option<&Value>| x.and_then(|x| x[m]["added_first_byte_us"]["p50"].as_f64());
        v.insert(format!("{m}_added_first_byte_us_p50"), json!({ "fast_path": a(lat), "nfqueue": a(lat_slow) }));
    }
    Value::Object(v)
}

const VARIANTS: [(&str, &str, bool); 4] = [
    ("1b_keepalive", SMALL, false),
    ("16k_keepalive", PAGE, false),
    ("1b_close", SMALL, true),
    ("16k_close", PAGE, true),
];

fn bench_rps(
    o: &Opts,
    wrk: &Path,
    sys: &Systems,
    warnings: &mut Vec<String>,
    log: &dyn Fn(String),
) -> Result<Value, String> {
    let plain = sys.plain.as_ref().ok_or("no unprotected system")?;
    let prot = &sys.prot;
    let pc = plain.lab.client().to_string();
    let xc = prot.lab.client().to_string();
    // Warm-up: nginx's open-file and page caches, the ARP entries, Redis's first connections.
    for ns in [&pc, &xc] {
        run_wrk(wrk, ns, o.connections, 1, SMALL, false)?;
        run_wrk(wrk, ns, o.connections, 1, PAGE, true)?;
    }
    let mut res: BTreeMap<&str, (Vec<Value>, Vec<Value>)> = BTreeMap::new();
    let mut repeated = 0;
    for r in 0..o.runs {
        for (name, path, close) in VARIANTS {
            // Alternate which configuration goes first.
            let order: [bool; 2] = if r % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            // A pair during which other processes used the CPU is repeated (the unprotected
            // system, which needs the CPU most, would otherwise be handicapped by chance).
            let mut attempt = 0;
            let pair = loop {
                let mut pair: [Option<Value>; 2] = [None, None];
                for protected in order {
                    let v = if protected {
                        std::thread::sleep(STATUS_SETTLE);
                        let before = counters(prot);
                        let cpu = CpuWatch::start(both(&prot.lab, &plain.lab));
                        let mut v = run_wrk(wrk, &xc, o.connections, o.secs, path, close)?;
                        v["cpu"] = cpu.stop();
                        std::thread::sleep(STATUS_SETTLE);
                        v["counters"] = counters_delta(&before, &counters(prot));
                        v
                    } else {
                        let cpu = CpuWatch::start(both(&plain.lab, &prot.lab));
                        let mut v = run_wrk(wrk, &pc, o.connections, o.secs, path, close)?;
                        v["cpu"] = cpu.stop();
                        v
                    };
                    log(format!(
                        "run {} {name:<14} {:<11} {:>9.0} req/s  p50 {} us  (other processes {} CPUs)",
                        r + 1,
                        if protected { "protected" } else { "unprotected" },
                        v["rps"].as_f64().unwrap_or(0.0),
                        v["latency_us"]["p50"],
                        v["cpu"]["other_cpus"]
                    ));
                    pair[protected as usize] = Some(v);
                }
                let other = pair
                    .iter()
                    .flatten()
                    .map(|v| v["cpu"]["other_cpus"].as_f64().unwrap_or(0.0))
                    .fold(0.0, f64::max);
                if other <= OTHER_LIMIT || attempt >= o.retries {
                    if other > OTHER_LIMIT {
                        warnings.push(format!("rps {name} run {}: other processes used up to {other:.2} CPUs (still after {attempt} repetition(s))", r + 1));
                    }
                    break pair;
                }
                attempt += 1;
                repeated += 1;
                log(format!(
                    "other processes used {other:.2} CPUs: repeating the pair"
                ));
                std::thread::sleep(Duration::from_secs(2));
            };
            for (protected, v) in pair.into_iter().enumerate() {
                let Some(mut v) = v else { continue };
                let cfg = if protected == 1 {
                    "protected"
                } else {
                    "unprotected"
                };
                v["attempts"] = json!(attempt + 1);
                let unprot = v["counters"]["engine.unprotected"].as_i64().unwrap_or(0);
                if unprot > 0 {
                    warnings.push(format!(
                        "rps {name} run {}: {unprot} connection(s) went unprotected ({})",
                        r + 1,
                        v["counters"]
                    ));
                }
                let errs: u64 = ["connect", "read", "write", "timeout"]
                    .iter()
                    .map(|k| v["socket_errors"][k].as_u64().unwrap_or(0))
                    .sum();
                if errs > 0 || v["non_2xx"].as_u64().unwrap_or(0) > 0 {
                    warnings.push(format!("rps {name} {cfg} run {}: wrk saw socket errors {} and {} non-2xx responses", r + 1, v["socket_errors"], v["non_2xx"]));
                }
                let e = res.entry(name).or_default();
                if protected == 1 {
                    e.1.push(v);
                } else {
                    e.0.push(v);
                }
            }
        }
    }
    if repeated > 0 {
        warnings.push(format!(
            "{repeated} wrk pair(s) were repeated because other processes used the CPU"
        ));
    }
    let mut out = serde_json::Map::new();
    for (name, path, close) in VARIANTS {
        let Some((u, p)) = res.get(name) else {
            continue;
        };
        let f = |v: &Vec<Value>, k: &str| {
            v.iter()
                .map(|x| x[k].as_f64().unwrap_or(0.0))
                .collect::<Vec<_>>()
        };
        let (ur, pr) = (f(u, "rps"), f(p, "rps"));
        let ratios: Vec<f64> = ur
            .iter()
            .zip(&pr)
            .map(|(a, b)| if *a > 0.0 { b / a } else { 0.0 })
            .collect();
        let lat = |v: &Vec<Value>, q: &str| {
            median(
                &v.iter()
                    .map(|x| x["latency_us"][q].as_f64().unwrap_or(0.0))
                    .collect::<Vec<_>>(),
            )
        };
        out.insert(
            name.to_string(),
            json!({
                "path": path, "connection_close": close,
                "unprotected": med_min_max(&ur), "protected": med_min_max(&pr),
                "ratio": { "median": round2(median(&ratios) * 100.0) / 100.0, "per_run": ratios.iter().map(|x| (x * 1000.0).round() / 1000.0).collect::<Vec<_>>() },
                "protected_connections_gone_unprotected": { "per_run": p.iter().map(|x| json!([x["counters"]["engine.unprotected"].as_i64().unwrap_or(0), x["counters"]["engine.syns"].as_i64().unwrap_or(0)])).collect::<Vec<_>>() },
                "wrk_latency_p50_us": { "unprotected": lat(u, "p50"), "protected": lat(p, "p50") },
                "wrk_latency_p99_us": { "unprotected": lat(u, "p99"), "protected": lat(p, "p99") },
                "runs": { "unprotected": u, "protected": p },
            }),
        );
    }
    Ok(Value::Object(out))
}

fn bench_latency(
    o: &Opts,
    sys: &Systems,
    warnings: &mut Vec<String>,
    log: &dyn Fn(String),
) -> Result<Value, String> {
    let plain = sys.plain.as_ref().ok_or("no unprotected system")?;
    let pc = plain.lab.client().to_string();
    let xc = sys.prot.lab.client().to_string();
    let block = (o.requests / 10).max(1);
    let mut res: [[Serial; 2]; 2] = Default::default(); // [mode][protected]
    let mut done = 0;
    let mut k = 0;
    let before = {
        std::thread::sleep(STATUS_SETTLE);
        counters(&sys.prot)
    };
    // Warm-up.
    for ns in [&pc, &xc] {
        lab::in_ns(ns, || serial_new_conns(20, SMALL)).map_err(|e| e.to_string())?;
    }
    let mut nss: Vec<(String, String)> = roles(&plain.lab)
        .into_iter()
        .map(|(ns, r)| (ns, format!("unprotected/{r}")))
        .collect();
    nss.extend(
        roles(&sys.prot.lab)
            .into_iter()
            .map(|(ns, r)| (ns, format!("protected/{r}"))),
    );
    let cpu_all = CpuWatch::start(nss.clone());
    let mut repeated = 0;
    while done < o.requests {
        let n = block.min(o.requests - done);
        let order = if k % 2 == 0 { [0usize, 1] } else { [1, 0] };
        // A block pair during which other processes used the CPU is repeated.
        let mut attempt = 0;
        loop {
            let cpu = CpuWatch::start(nss.clone());
            let mut got: [[Serial; 2]; 2] = Default::default();
            for p in order {
                let ns = if p == 1 { &xc } else { &pc };
                got[0][p] =
                    lab::in_ns(ns, || serial_new_conns(n, SMALL)).map_err(|e| e.to_string())?;
                got[1][p] =
                    lab::in_ns(ns, || serial_keepalive(n, SMALL)).map_err(|e| e.to_string())?;
            }
            let other = cpu.stop()["other_cpus"].as_f64().unwrap_or(0.0);
            if other <= OTHER_LIMIT || attempt >= o.retries {
                for (m, g) in got.into_iter().enumerate() {
                    for (p, x) in g.into_iter().enumerate() {
                        res[m][p].samples.extend(x.samples);
                        res[m][p].errors.extend(x.errors);
                    }
                }
                break;
            }
            attempt += 1;
            repeated += 1;
            std::thread::sleep(Duration::from_millis(500));
        }
        done += n;
        k += 1;
    }
    let cpu = cpu_all.stop();
    let other = cpu["other_cpus"].as_f64().unwrap_or(0.0);
    if other > OTHER_LIMIT {
        warnings.push(format!("latency: other processes used {other:.2} CPUs during the test ({repeated} block(s) repeated for it)"));
    }
    std::thread::sleep(STATUS_SETTLE);
    let d = counters_delta(&before, &counters(&sys.prot));
    let unprot = d["engine.unprotected"].as_i64().unwrap_or(0);
    if unprot > 0 {
        warnings.push(format!(
            "latency: {unprot} protected-side connection(s) went unprotected ({d})"
        ));
    }
    let side = |r: &Serial, conn: bool| {
        let s = &r.samples;
        let mut v = json!({
            "first_byte_us": dist(&s.iter().map(|x| x.first_byte).collect::<Vec<_>>()),
            "total_us": dist(&s.iter().map(|x| x.total).collect::<Vec<_>>()),
            "failed_requests": r.errors.len(),
            "some_errors": r.errors.iter().take(5).collect::<Vec<_>>(),
        });
        if conn {
            v["connect_us"] = dist(&s.iter().map(|x| x.connect).collect::<Vec<_>>());
        }
        v
    };
    let mut out = serde_json::Map::new();
    for (m, name) in [(0usize, "new_connection"), (1, "keepalive")] {
        let u = side(&res[m][0], m == 0);
        let p = side(&res[m][1], m == 0);
        for (x, cfg) in [(&u, "unprotected"), (&p, "protected")] {
            let f = x["failed_requests"].as_u64().unwrap_or(0);
            if f > 0 {
                warnings.push(format!(
                    "latency {name} {cfg}: {f} request(s) failed, e.g. {}",
                    x["some_errors"]
                ));
            }
        }
        let add = |q: &str| {
            round2(
                p["first_byte_us"][q].as_f64().unwrap_or(0.0)
                    - u["first_byte_us"][q].as_f64().unwrap_or(0.0),
            )
        };
        log(format!(
            "latency {name:<15} first byte p50 {} / {} us (unprotected / protected), added {} us",
            u["first_byte_us"]["p50"],
            p["first_byte_us"]["p50"],
            add("p50")
        ));
        out.insert(name.to_string(), json!({ "unprotected": u, "protected": p, "added_first_byte_us": { "p50": add("p50"), "p99": add("p99"), "mean": add("mean") } }));
    }
    out.insert("path".into(), json!(SMALL));
    out.insert("protected_counters".into(), d);
    out.insert("cpu".into(), cpu);
    Ok(Value::Object(out))
}

/// Downloads of the large object, one at a time, through the unprotected and the protected
/// system in turn (order alternating; `o.runs` + 1 each): goodput in MB/s (10^6 bytes), every
/// byte checked, and the CPU each side's processes used.
fn bench_bulk(o: &Opts, sys: &Systems, warnings: &mut Vec<String>, log: &dyn Fn(String)) -> Result<Value, String> {
    let plain = sys.plain.as_ref().ok_or("no unprotected system")?;
    let (pc, xc) = (plain.lab.client().to_string(), sys.prot.lab.client().to_string());
    let size = sys.big.data.len() as u64;
    let mut res: [Vec<f64>; 2] = Default::default();
    let mut cpus: [Vec<Value>; 2] = Default::default();
    for r in 0..o.runs + 1 {
        let order = if r % 2 == 0 { [0usize, 1] } else { [1, 0] };
        for p in order {
            let (ns, lab_, other) = if p == 1 { (&xc, &sys.prot.lab, &plain.lab) } else { (&pc, &plain.lab, &sys.prot.lab) };
            let cpu = CpuWatch::start(both(lab_, other));
            let t0 = Instant::now();
            let s = lab::in_ns(ns, || TcpStream::connect_timeout(&VIP, Duration::from_secs(5))).map_err(|e| e.to_string())?.map_err(|e| format!("bulk: connect: {e}"))?;
            let (tx, _rx) = mpsc::channel();
            let d = download(s, t0, sys.big.data.clone(), u64::MAX, tx);
            let secs = t0.elapsed().as_secs_f64();
            let cpu = cpu.stop();
            let cfg = if p == 1 { "protected" } else { "unprotected" };
            if d.bytes != size || d.mismatch.is_some() || d.error.is_some() {
                warnings.push(format!("bulk {cfg} run {}: {} of {size} bytes, mismatch at {:?}, error {:?}", r + 1, d.bytes, d.mismatch, d.error));
                continue;
            }
            let mbps = size as f64 / secs / 1e6;
            log(format!("bulk run {} {cfg:<11} {mbps:>8.1} MB/s", r + 1));
            res[p].push(round2(mbps));
            cpus[p].push(cpu);
        }
    }
    let ratios: Vec<f64> = res[0].iter().zip(&res[1]).map(|(a, b)| if *a > 0.0 { round2(b / a * 1000.0) / 1000.0 } else { 0.0 }).collect();
    Ok(json!({
        "object_bytes": size, "path": BIG,
        "mb_per_s": { "unprotected": med_min_max(&res[0]), "protected": med_min_max(&res[1]) },
        "ratio": { "median": round2(median(&ratios) * 1000.0) / 1000.0, "per_run": ratios },
        "cpu": { "unprotected": cpus[0], "protected": cpus[1] },
    }))
}

/// The download client gives up after this long without a byte (a failover that does not
/// happen; they take well under a second).
const READ_TIMEOUT_S: u64 = 10;

/// What the stall client saw in one trial.
struct Download {
    /// (ns since the request, bytes so far) after every read of the body.
    reads: Vec<(u64, u64)>,
    bytes: u64,
    /// First mismatching byte offset, if any.
    mismatch: Option<u64>,
    error: Option<String>,
}

fn download(
    mut s: TcpStream,
    t0: Instant,
    want: Arc<Vec<u8>>,
    crash_at: u64,
    at: mpsc::Sender<()>,
) -> Download {
    let mut d = Download {
        reads: Vec::with_capacity(8192),
        bytes: 0,
        mismatch: None,
        error: None,
    };
    let r: io::Result<()> = (|| {
        s.set_read_timeout(Some(Duration::from_secs(READ_TIMEOUT_S)))?;
        s.write_all(&request(BIG, true))?;
        let mut head = Vec::new();
        let (_, hl, cl) = read_head(&mut s, &mut head)?;
        if cl != want.len() as u64 {
            return Err(io::Error::other(format!(
                "Content-Length {cl}, file {}",
                want.len()
            )));
        }
        let check = |chunk: &[u8], d: &mut Download| {
            let off = d.bytes as usize;
            let end = (off + chunk.len()).min(want.len());
            if d.mismatch.is_none()
                && (off + chunk.len() > want.len() || chunk[..end - off] != want[off..end])
            {
                let i = chunk
                    .iter()
                    .zip(&want[off.min(want.len())..end])
                    .position(|(a, b)| a != b)
                    .unwrap_or(end - off);
                d.mismatch = Some((off + i) as u64);
            }
            d.bytes += chunk.len() as u64;
            d.reads.push((t0.elapsed().as_nanos() as u64, d.bytes));
        };
        check(&head[hl..], &mut d);
        let mut buf = vec![0u8; 256 << 10];
        let mut signalled = false;
        loop {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            check(&buf[..n], &mut d);
            if !signalled && d.bytes >= crash_at {
                signalled = true;
                let _ = at.send(());
            }
        }
        Ok(())
    })();
    if let Err(e) = r {
        d.error = Some(format!("{e} (kind {:?}, at {} bytes)", e.kind(), d.bytes));
    }
    d
}

/// Wait (bounded) for the LB to have every server alive, the table applied, and every server
/// owning its home buckets.
fn wait_settled(env: &ObjectEnv, n: usize, within: Duration) -> Result<(), String> {
    // The LB holds a returning server out longer after each of its recent deaths (flap
    // damping: the crash trials kill servers again and again): the deadline follows the
    // longest hold it reports.
    let mut end = Instant::now() + within;
    loop {
        if let Ok(s) = env.lb_status() {
            let servers = s["servers"].as_array().cloned().unwrap_or_default();
            let alive = (1..=n).all(|i| servers.iter().any(|x| x["id"] == i as u64 && x["alive"] == true && x["last_heartbeat_age_ms"].as_u64().is_some_and(|a| a < 1000)));
            let applied = s["epoch"] == s["applied_epoch"];
            let home = servers.iter().all(|x| x["buckets_owned"] == x["home_buckets"]);
            if alive && applied && home {
                return Ok(());
            }
            let hold = servers.iter().filter_map(|x| x["returning_hold_left_ms"].as_u64()).max().unwrap_or(0);
            end = end.max(Instant::now() + Duration::from_millis(hold) + within);
        }
        if Instant::now() > end {
            return Err(format!("LB table not settled within {within:?} of the longest hold it reported: {:?}", env.lb_status().ok()));
        }
        std::thread::sleep(Duration::from_millis(20)); // polling a status file with a deadline
    }
}

/// The "down" events in an LB status file: their number, and each as
/// `[seconds since the benchmark started, server, detect_ms]`.
fn lb_downs(path: &Path, t_start: Instant) -> (u64, Vec<Value>) {
    let Some(s) = std::fs::read_to_string(path)
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
    else {
        return (0, Vec::new());
    };
    // The LB's clock starts with it: place its events on the benchmark's.
    let lb_t0 = t_start.elapsed().as_secs_f64() - s["uptime_ms"].as_f64().unwrap_or(0.0) / 1e3;
    let downs: Vec<Value> = s["events"]
        .as_array()
        .map(|v| {
            v.iter()
                .filter(|e| {
                    e["kind"]
                        .as_str()
                        .is_some_and(|k| k.eq_ignore_ascii_case("down"))
                })
                .map(|e| {
                    json!([
                        round2(lb_t0 + e["t_ms"].as_f64().unwrap_or(0.0) / 1e3),
                        e["server"],
                        e["detect_ms"]
                    ])
                })
                .collect()
        })
        .unwrap_or_default();
    (downs.len() as u64, downs)
}

fn max_event(env: &ObjectEnv) -> u64 {
    env.lb_status()
        .ok()
        .and_then(|s| {
            s["events"]
                .as_array()
                .map(|v| v.iter().filter_map(|e| e["n"].as_u64()).max().unwrap_or(0))
        })
        .unwrap_or(0)
}

fn bench_stall(
    o: &Opts,
    sys: &mut Systems,
    problems: &mut Vec<String>,
    log: &dyn Fn(String),
) -> Result<Value, String> {
    let n_srv = sys.prot.lab.n_servers();
    let size = o.object_mib << 20;
    let mut trials = Vec::new();
    let mut rebuilds = 0;
    let mut rng: u64 = 0x9e37_79b9_7f4a_7c15;
    wait_settled(&sys.prot, n_srv, Duration::from_secs(10))?;
    let keys_before = store_keys(&sys.prot);
    let cpu = CpuWatch::start(roles(&sys.prot.lab));
    for t in 0..o.trials {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        // Anywhere from 16 MiB to 3/4 of the object: from a few milliseconds to about a
        // second after the request, before and after the client's first retransmission of
        // its (deliberately unacknowledged) request.
        let crash_at = (16 << 20) + rng % (size * 3 / 4 - (16 << 20));
        let r = stall_trial(sys, crash_at, size);
        let ok = r["ok"].as_bool() == Some(true);
        log(format!(
            "trial {:>3}: {} server {} at {} MiB, stall {} ms, LB detect {} ms, failover {} us{}",
            t + 1,
            if ok { "ok  " } else { "FAIL" },
            r["server"],
            r["crash_at_bytes"].as_u64().unwrap_or(0) >> 20,
            r["stall_ms"],
            r["lb_detect_ms"],
            r["failover_us"],
            r["error"]
                .as_str()
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        ));
        if !ok {
            problems.push(format!(
                "stall trial {}: {}",
                t + 1,
                r["error"].as_str().unwrap_or("failed")
            ));
        }
        trials.push(r);
        // Revive the dead server and wait until the LB has it back; rebuild the system if
        // that does not work.
        let revived = (|| -> Result<(), String> {
            let crashed: Vec<usize> = (1..=n_srv)
                .filter(|&i| sys.prot.lab.crashed().any(|c| c == sys.prot.lab.server(i)))
                .collect();
            for i in crashed {
                sys.prot.revive(i).map_err(|e| format!("revive {i}: {e}"))?;
            }
            wait_settled(&sys.prot, n_srv, Duration::from_secs(10))?;
            // Let the revived agent settle (its store connection, its first status file).
            std::thread::sleep(Duration::from_millis(300));
            Ok(())
        })();
        if let Err(e) = revived {
            problems.push(format!(
                "after stall trial {}: {e}; rebuilt the system",
                t + 1
            ));
            log(format!("rebuilding the system: {e}"));
            rebuilds += 1;
            sys.prot = start_protected(&sys.big)?;
            wait_settled(&sys.prot, n_srv, Duration::from_secs(10))?;
        }
    }
    let okv: Vec<&Value> = trials
        .iter()
        .filter(|r| r["ok"].as_bool() == Some(true))
        .collect();
    let col = |k: &str, all: bool| {
        trials
            .iter()
            .filter(|r| all || r["ok"].as_bool() == Some(true))
            .filter_map(|r| r[k].as_f64())
            .collect::<Vec<_>>()
    };
    Ok(json!({
        "trials": trials.len(),
        "byte_exact_zero_rst": okv.len(),
        "failed": trials.len() - okv.len(),
        "rebuilds": rebuilds,
        "object_mib": o.object_mib,
        "stall_ms": dist(&col("stall_ms", true)),
        "crash_to_resume_ms": dist(&col("crash_to_resume_ms", true)),
        "request_to_crash_ms": dist(&col("request_to_crash_ms", true)),
        "baseline_max_gap_ms": dist(&col("baseline_max_gap_ms", true)),
        "lb_detect_ms": dist(&col("lb_detect_ms", true)),
        "lb_applied_ms": dist(&col("lb_applied_ms", true)),
        "failover_us": dist(&col("failover_us", true)),
        "throughput_mib_s": dist(&col("throughput_mib_s", true)),
        "disturbed_by_false_deaths": trials.iter().filter(|r| r["lb_other_events"].as_u64().unwrap_or(0) > 0).count(),
        "trials_with_other_failovers": trials.iter().filter(|r| r["failovers_on_survivors"].as_i64().unwrap_or(1) > 1).count(),
        "other_failovers": trials.iter().map(|r| (r["failovers_on_survivors"].as_i64().unwrap_or(1) - 1).max(0)).sum::<i64>(),
        "unprotected_before_crash": trials.iter().filter(|r| r["record_before_crash"] == json!(false)).count(),
        "rsts_on_download": trials.iter().map(|r| r["rsts"].as_u64().unwrap_or(0)).sum::<u64>(),
        "rsts_in_client_namespace": trials.iter().map(|r| r["rsts_client_ns"].as_u64().unwrap_or(0)).sum::<u64>(),
        "refusals_by_survivors": trials.iter().map(|r| r["refusals"].as_i64().unwrap_or(0)).sum::<i64>(),
        "store_before": keys_before,
        "store_after": store_keys(&sys.prot),
        "cpu": cpu.stop(),
        "per_trial": trials,
    }))
}

/// Counts RSTs to the client's `port` in the client namespace (an iptables rule of its own,
/// so RSTs for other, older 4-tuples are told apart from RSTs on the download).
fn port_rst_rule(ns: &str, port: u16, op: &str) -> io::Result<()> {
    let c = format!("ub-objbench-{port}");
    let p = port.to_string();
    let mut args = vec!["-w", op, "INPUT"];
    if op == "-I" {
        args.push("1");
    }
    args.extend([
        "-p",
        "tcp",
        "--dport",
        &p,
        "--tcp-flags",
        "RST",
        "RST",
        "-m",
        "comment",
        "--comment",
        &c,
        "-j",
        "ACCEPT",
    ]);
    lab::run_ok(ns, Command::new("iptables").args(&args)).map(|_| ())
}

fn port_rsts(ns: &str, port: u16) -> Option<u64> {
    let out = lab::run_ok(
        ns,
        Command::new("iptables").args(["-w", "-L", "INPUT", "-v", "-n", "-x"]),
    )
    .ok()?;
    let c = format!("ub-objbench-{port} ");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.contains(&c) || l.ends_with(&format!("ub-objbench-{port} */")))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
}

/// Keys in the store (Redis `DBSIZE`) and up to 20 of them.
fn store_keys(env: &ObjectEnv) -> Value {
    let host = addr::STORE_V4.to_string();
    let port = addr::REDIS_PORT.to_string();
    let run = |args: &[&str]| {
        lab::run(
            env.lab.store(),
            Command::new("redis-cli")
                .args(["-h", &host, "-p", &port])
                .args(args),
        )
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let n = run(&["DBSIZE"]).and_then(|s| s.parse::<u64>().ok());
    let keys: Vec<String> = run(&["--scan"])
        .map(|s| s.lines().take(20).map(String::from).collect())
        .unwrap_or_default();
    json!({ "dbsize": n, "some_keys": keys })
}

/// The live servers holding an established socket on :80 from the client's `port`.
fn servers_with_port(env: &ObjectEnv, port: u16) -> Vec<usize> {
    let crashed: Vec<String> = env.lab.crashed().map(String::from).collect();
    let peer = format!("{}:{port}", addr::CLIENT_V4);
    let mapped = format!("[::ffff:{}]:{port}", addr::CLIENT_V4);
    (1..=env.lab.n_servers())
        .filter(|&i| !crashed.iter().any(|c| c == env.lab.server(i)))
        .filter(|&i| {
            lab::run(
                env.lab.server(i),
                Command::new("ss").args(["-Htn", "state", "established", "( sport = :80 )"]),
            )
            .is_ok_and(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .any(|l| l.split_whitespace().any(|w| w == peer || w == mapped))
            })
        })
        .collect()
}

/// Whether the store holds a record for the client's `port` (None: the store did not answer).
fn has_record(env: &ObjectEnv, port: u16) -> Option<bool> {
    let host = addr::STORE_V4.to_string();
    let rport = addr::REDIS_PORT.to_string();
    let pat = format!("*c/{}:{port}/*", addr::CLIENT_V4);
    let out = lab::run_ok(
        env.lab.store(),
        Command::new("redis-cli").args(["-h", &host, "-p", &rport, "--scan", "--pattern", &pat]),
    )
    .ok()?;
    Some(!String::from_utf8_lossy(&out.stdout).trim().is_empty())
}

/// One server death under a download.
fn stall_trial(sys: &mut Systems, crash_at: u64, size: u64) -> Value {
    let env = &mut sys.prot;
    let n_srv = env.lab.n_servers();
    let rsts0 = env.client_rsts();
    let ev0 = max_event(env);
    let agent = |env: &ObjectEnv, i: usize, k: &str| {
        env.agent_status(i)
            .and_then(|v| v["agent"][k].as_i64())
            .unwrap_or(0)
    };
    let fo0: Vec<i64> = (1..=n_srv).map(|i| agent(env, i, "failovers")).collect();
    let rf0: Vec<i64> = (1..=n_srv).map(|i| agent(env, i, "refused")).collect();
    let client = env.lab.client().to_string();
    let mut r = json!({ "ok": false, "crash_at_bytes": crash_at, "server": null, "stall_ms": null, "lb_detect_ms": null, "failover_us": null, "error": null });
    // The serving server is the one with an established socket from the client's port. A
    // server may also hold a socket from an older connection of the same port (rebuilt for a
    // finished connection whose client answered a probe): then that port is not used.
    let mut found = None;
    let mut ambiguous = 0;
    for _ in 0..5 {
        let s = match lab::in_ns(&client, || {
            TcpStream::connect_timeout(&VIP, Duration::from_secs(5))
        }) {
            Ok(Ok(s)) => s,
            Ok(Err(e)) | Err(e) => {
                r["error"] = json!(format!("connect: {e}"));
                return r;
            }
        };
        let port = s.local_addr().map(|a| a.port()).unwrap_or(0);
        let holders = servers_with_port(env, port);
        if holders.len() == 1 {
            found = Some((s, port, holders[0]));
            break;
        }
        ambiguous += 1;
        r["ambiguous_ports"] = json!(ambiguous);
        r["last_ambiguous"] = json!([port, holders]);
    }
    let Some((s, port, srv)) = found else {
        r["error"] = json!("could not find the serving server");
        return r;
    };
    r["client_port"] = json!(port);
    let rule = port_rst_rule(&client, port, "-I").is_ok();
    r["server"] = json!(srv);
    let (tx, rx) = mpsc::channel();
    let t0 = Instant::now();
    let want = sys.big.data.clone();
    let h = std::thread::spawn(move || download(s, t0, want, crash_at, tx));
    let mut tc = 0u64;
    let mut errors = Vec::new();
    match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(()) => {
            // Is the connection still protected (its record in the store)? A store that answered
            // late leaves it unprotected by design, and then its server's death resets it.
            r["record_before_crash"] = json!(has_record(env, port));
            tc = t0.elapsed().as_nanos() as u64;
            if let Err(e) = env.crash(srv) {
                errors.push(format!("crash: {e}"));
            }
            r["crash_call_ms"] = json!(round2((t0.elapsed().as_nanos() as u64 - tc) as f64 / 1e6));
            r["request_to_crash_ms"] = json!(round2(tc as f64 / 1e6));
        }
        Err(_) => errors.push("the download never reached the crash point".into()),
    }
    let d = h.join().unwrap_or(Download {
        reads: Vec::new(),
        bytes: 0,
        mismatch: None,
        error: Some("reader panicked".into()),
    });
    // Gaps between consecutive reads; the stall is the longest one that ends after the crash.
    let (mut stall, mut resume, mut base) = (0u64, 0u64, 0u64);
    for w in d.reads.windows(2) {
        let gap = w[1].0 - w[0].0;
        if tc > 0 && w[1].0 > tc {
            if gap > stall {
                stall = gap;
                resume = w[1].0 - tc;
            }
        } else {
            base = base.max(gap);
        }
    }
    let ms = |ns: u64| round2(ns as f64 / 1e6);
    r["bytes"] = json!(d.bytes);
    r["stall_ms"] = json!(ms(stall));
    r["crash_to_resume_ms"] = json!(ms(resume));
    r["baseline_max_gap_ms"] = json!(ms(base));
    if let (Some(f), Some(l)) = (d.reads.first(), d.reads.last()) {
        let secs = (l.0 - f.0) as f64 / 1e9;
        if secs > 0.0 {
            r["throughput_mib_s"] = json!(round2(d.bytes as f64 / secs / 1048576.0));
        }
    }
    if let Some(e) = &d.error {
        errors.push(format!("client: {e}"));
    }
    if let Some(m) = d.mismatch {
        errors.push(format!("byte {m} differs from the file"));
    }
    if d.bytes != size {
        errors.push(format!("{} of {size} bytes", d.bytes));
    }
    // The LB's detection and the adopting agent's failover time (its status file is written
    // every 500 ms: wait for it).
    let end = Instant::now() + Duration::from_secs(3);
    let mut fo = None;
    let mut ev = None;
    while Instant::now() < end && (fo.is_none() || ev.is_none()) {
        if ev.is_none() {
            ev = env.lb_status().ok().and_then(|s| {
                s["events"].as_array().and_then(|v| {
                    v.iter()
                        .find(|e| {
                            e["n"].as_u64().unwrap_or(0) > ev0
                                && e["server"] == srv as u64
                                && e["kind"]
                                    .as_str()
                                    .is_some_and(|k| k.eq_ignore_ascii_case("down"))
                                && !e["applied_ms"].is_null()
                        })
                        .cloned()
                })
            });
        }
        if fo.is_none() {
            fo = (1..=n_srv).filter(|&i| i != srv).find_map(|i| {
                let v = env.agent_status(i)?;
                let n = v["agent"]["failovers"].as_i64().unwrap_or(0) - fo0[i - 1];
                (n > 0).then(|| (i, v["agent"]["failover_us_last"].as_u64().unwrap_or(0), n))
            });
        }
        std::thread::sleep(Duration::from_millis(20)); // polling status files with a deadline
    }
    // Other liveness events during the trial: the LB declared a live server dead (late
    // heartbeats), which moves buckets and may move this connection too.
    let others = env
        .lb_status()
        .ok()
        .and_then(|s| {
            s["events"].as_array().map(|v| {
                v.iter()
                    .filter(|e| e["n"].as_u64().unwrap_or(0) > ev0)
                    .filter(|e| ev.as_ref().is_none_or(|d: &Value| d["n"] != e["n"]))
                    .count()
            })
        })
        .unwrap_or(0);
    r["lb_other_events"] = json!(others);
    match ev {
        Some(e) => {
            r["lb_detect_ms"] = e["detect_ms"].clone();
            r["lb_applied_ms"] = e["applied_ms"].clone();
            r["buckets_moved"] = e["buckets_moved"].clone();
        }
        None => errors.push("no LB down event".into()),
    }
    match fo {
        Some((i, us, n)) => {
            // Failovers of other connections (finished ones whose clients answered a probe)
            // may happen at the same time; then failover_us_last is not known to be ours.
            let all: i64 = (1..=n_srv)
                .filter(|&j| j != srv)
                .map(|j| (agent(env, j, "failovers") - fo0[j - 1]).max(0))
                .sum();
            r["failovers_on_survivors"] = json!(all);
            if all == 1 {
                r["adopted_by"] = json!(i);
                r["failover_us"] = json!(us);
            } else {
                r["failover_us_ambiguous"] = json!([i, us, n]);
            }
        }
        None => errors.push("no failover reported by a surviving agent".into()),
    }
    // Refusals by the survivors (for other, finished connections whose clients were probed).
    r["refusals"] = json!((1..=n_srv)
        .filter(|&i| i != srv)
        .map(|i| (agent(env, i, "refused") - rf0[i - 1]).max(0))
        .sum::<i64>());
    let rsts = env.client_rsts().saturating_sub(rsts0);
    r["rsts_client_ns"] = json!(rsts);
    let on_conn = if rule { port_rsts(&client, port) } else { None };
    if rule {
        let _ = port_rst_rule(&client, port, "-D");
    }
    r["rsts"] = json!(on_conn);
    match on_conn {
        Some(0) => {}
        Some(n) => errors.push(format!(
            "{n} RST(s) reached the client on the download's connection"
        )),
        None => errors.push("could not count the RSTs on the download's connection".into()),
    }
    if tc > 0 && errors.is_empty() && stall < EnvOpts::default().dead_after_ms * 1_000_000 {
        errors.push(format!("a stall of {} ms is shorter than the LB's detection time: the crashed server was probably not serving this download", ms(stall)));
    }
    if !errors.is_empty() && r["record_before_crash"] == json!(false) {
        errors.push("the store held no record of the connection just before the crash (it had gone unprotected)".into());
    }
    r["ok"] = json!(errors.is_empty());
    if !errors.is_empty() {
        r["error"] = json!(errors.join("; "));
    }
    r
}

// ---------------------------------------------------------------------------------------------
// Report

/// The human-readable report.
pub fn print_table(v: &Value) {
    let m = &v["machine"];
    let c = &v["config"];
    println!(
        "\nunbroken bench object: {} x {}, {} GiB, Linux {}; {}, {}",
        m["cpus"],
        m["cpu"].as_str().unwrap_or("?"),
        m["mem_gib"],
        m["kernel"].as_str().unwrap_or("?"),
        m["nginx"].as_str().unwrap_or("?"),
        m["wrk"].as_str().unwrap_or("?")
    );
    println!(
        "CPU idle states: {}",
        if c["cpu_dma_latency_0"].as_bool() == Some(true) {
            "polling (/dev/cpu_dma_latency held at 0)"
        } else {
            "as configured (halting)"
        }
    );
    let f0 = |x: &Value| {
        x.as_f64()
            .map(|f| format!("{f:.0}"))
            .unwrap_or_else(|| "-".into())
    };
    let f1 = |x: &Value| {
        x.as_f64()
            .map(|f| format!("{f:.1}"))
            .unwrap_or_else(|| "-".into())
    };
    if let Some(r) = v["rps"].as_object() {
        println!("\nrequests/s: {}; {} run(s), median [min..max]; ratio = protected / unprotected per run", c["wrk"].as_str().unwrap_or(""), c["runs"]);
        println!(
            "  {:<16} {:>24} {:>24} {:>16} {:>20} {:>16}",
            "variant",
            "unprotected",
            "protected",
            "ratio (median)",
            "wrk p50 µs (u / p)",
            "went unprot."
        );
        for (name, x) in r {
            let mm = |y: &Value| {
                format!(
                    "{} [{}..{}]",
                    f0(&y["median"]),
                    f0(&y["min"]),
                    f0(&y["max"])
                )
            };
            let (gone, conns) = x["protected_connections_gone_unprotected"]["per_run"]
                .as_array()
                .map(|v| {
                    v.iter().fold((0, 0), |(a, b), r| {
                        (
                            a + r[0].as_i64().unwrap_or(0),
                            b + r[1].as_i64().unwrap_or(0),
                        )
                    })
                })
                .unwrap_or((0, 0));
            println!(
                "  {:<16} {:>24} {:>24} {:>15.1}% {:>20} {:>16}",
                name,
                mm(&x["unprotected"]),
                mm(&x["protected"]),
                x["ratio"]["median"].as_f64().unwrap_or(0.0) * 100.0,
                format!(
                    "{} / {}",
                    f0(&x["wrk_latency_p50_us"]["unprotected"]),
                    f0(&x["wrk_latency_p50_us"]["protected"])
                ),
                format!("{gone} / {conns}")
            );
        }
    }
    if let Some(l) = v["latency"].as_object() {
        println!(
            "\nfirst-byte latency, {} serial requests of {} per configuration (µs, p50 / p99)",
            c["requests"],
            l.get("path").and_then(|p| p.as_str()).unwrap_or("?")
        );
        println!(
            "  {:<34} {:>18} {:>18} {:>18}",
            "", "unprotected", "protected", "added"
        );
        for (k, name) in [
            ("new_connection", "new connection: connect() -> byte"),
            ("keepalive", "kept-alive: write() -> byte"),
        ] {
            let x = &l[k];
            let pp = |y: &Value| format!("{} / {}", f0(&y["p50"]), f0(&y["p99"]));
            println!(
                "  {:<34} {:>18} {:>18} {:>18}",
                name,
                pp(&x["unprotected"]["first_byte_us"]),
                pp(&x["protected"]["first_byte_us"]),
                pp(&x["added_first_byte_us"])
            );
            if k == "new_connection" {
                println!(
                    "  {:<34} {:>18} {:>18}",
                    "  of which connect()",
                    pp(&x["unprotected"]["connect_us"]),
                    pp(&x["protected"]["connect_us"])
                );
            }
        }
    }
    let s = &v["stall"];
    if !s.is_null() {
        println!("\nserver death during a {} MiB download: {} trials, {} byte-exact with 0 RSTs, {} failed, {} rebuild(s)", s["object_mib"], s["trials"], s["byte_exact_zero_rst"], s["failed"], s["rebuilds"]);
        println!(
            "  {:<40} {:>8} {:>8} {:>8} {:>8}",
            "", "p50", "p90", "p99", "max"
        );
        for (k, name) in [
            ("stall_ms", "client stall (longest gap), ms"),
            ("crash_to_resume_ms", "crash -> data again, ms"),
            ("request_to_crash_ms", "request -> crash, ms"),
            ("baseline_max_gap_ms", "longest gap before the crash, ms"),
            ("lb_detect_ms", "LB detection (detect_ms), ms"),
            ("lb_applied_ms", "LB table applied after, ms"),
            ("failover_us", "agent failover (failover_us_last), µs"),
            ("throughput_mib_s", "download MiB/s (with the stall)"),
        ] {
            let d = &s[k];
            println!(
                "  {:<40} {:>8} {:>8} {:>8} {:>8}",
                name,
                f1(&d["p50"]),
                f1(&d["p90"]),
                f1(&d["p99"]),
                f1(&d["max"])
            );
        }
        println!(
            "  RSTs on the downloads' connections: {}; RSTs into the client namespace (any 4-tuple): {}; refusals by surviving agents: {}",
            s["rsts_on_download"], s["rsts_in_client_namespace"], s["refusals_by_survivors"]
        );
        println!(
            "  records in the store: {} before the trials, {} after; downloads without a record just before the crash: {}",
            s["store_before"]["dbsize"], s["store_after"]["dbsize"], s["unprotected_before_crash"]
        );
        println!(
            "  trials during which the LB also declared a live server dead (late heartbeats): {}",
            s["disturbed_by_false_deaths"]
        );
        println!(
            "  failovers of other (finished) connections during the trials: {} in {} trial(s) (failover µs above: only trials with exactly one)",
            s["other_failovers"], s["trials_with_other_failovers"]
        );
    }
    if let Some(p) = v["warnings"].as_array().filter(|p| !p.is_empty()) {
        println!("\nwarnings:");
        for x in p {
            println!("  - {}", x.as_str().unwrap_or(""));
        }
    }
    if let Some(p) = v["problems"].as_array().filter(|p| !p.is_empty()) {
        println!("\nproblems:");
        for x in p {
            println!("  - {}", x.as_str().unwrap_or(""));
        }
    }
    println!("\nok: {}   ({} s)", v["ok"], v["duration_s"]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_wrk_output() {
        let out = "Running 5s test @ http://10.77.0.100/1b
  2 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   812.34us  200.00us   5.20ms   90.00%
    Req/Sec    19.50k     1.00k   21.00k    70.00%
  Latency Distribution
     50%  790.00us
     75%    0.90ms
     90%    1.10ms
     99%    2.50ms
  194000 requests in 5.00s, 45.00MB read
  Socket errors: connect 0, read 3, write 0, timeout 1
  Non-2xx or 3xx responses: 2
Requests/sec:  38800.12
Transfer/sec:      9.00MB
";
        let v = parse_wrk(out).unwrap();
        assert_eq!(v["rps"], json!(38800.12));
        assert_eq!(v["requests"], json!(194000));
        assert_eq!(v["latency_us"]["p50"], json!(790.0));
        assert_eq!(v["latency_us"]["p99"], json!(2500.0));
        assert_eq!(v["latency_us"]["mean"], json!(812.34));
        assert_eq!(v["socket_errors"]["read"], json!(3));
        assert_eq!(v["socket_errors"]["timeout"], json!(1));
        assert_eq!(v["non_2xx"], json!(2));
        assert!(parse_wrk("nothing").is_err());
    }

    #[test]
    fn percentiles() {
        let v: Vec<f64> = (1..=50).map(|x| x as f64).collect();
        assert_eq!(pct(&v, 0.5), 25.0);
        assert_eq!(pct(&v, 0.99), 50.0);
        assert_eq!(pct(&v, 0.9), 45.0);
        assert_eq!(median(&[3.0, 1.0, 2.0, 10.0]), 2.5);
    }

    #[test]
    fn options() {
        let a = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        let o = Opts::parse(&a("object --quick --json")).unwrap();
        assert!(o.quick && o.json && o.trials == 10);
        let o = Opts::parse(&a("object --trials 60 --secs 3")).unwrap();
        assert_eq!((o.trials, o.secs, o.runs), (60, 3, 3));
        assert!(Opts::parse(&a("object --bogus")).is_err());
        assert!(Opts::parse(&a("object --skip foo")).is_err());
    }
}
