//! Object mode end to end in the lab: Redis in the store namespace, nginx and `unbroken agent`
//! on every server, `unbroken lb` in the balancer namespace, and unmodified curl/wget in the
//! client namespace. [`ObjectEnv`] is the running system (used by `unbroken demo object` and
//! the namespace tests); [`run_object`] is the demo: one large download while the serving
//! servers lose power one after the other.

use serde::Serialize;
use sha2::{Digest, Sha256};
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use unbroken_lab::lab;
use unbroken_lab::objlab::{addr, ObjectLab, ObjectOpts};

/// Options of [`ObjectEnv::start`].
#[derive(Debug, Clone)]
pub struct EnvOpts {
    pub servers: usize,
    /// The `unbroken` binary (agents and the LB run as processes of it).
    pub bin: PathBuf,
    /// Store operation timeout (ms).
    pub store_timeout_ms: u64,
    /// LB: silence before a server is declared dead (ms).
    pub dead_after_ms: u64,
    /// Agent failover gate: `"lb"` or `"open"`.
    pub gate: String,
    /// Probe the clients of moved buckets (elicit their ACK).
    pub probe: bool,
    /// Start Redis.
    pub store: bool,
    /// The agents' kernel fast path (`agent.fast_path`; issue 22). Default on, off with
    /// `UNBROKEN_FAST_PATH=0` in the environment.
    pub fast_path: bool,
}

/// Whether the environment turns the agents' fast path off (`UNBROKEN_FAST_PATH=0`).
pub fn fast_path_default() -> bool {
    std::env::var("UNBROKEN_FAST_PATH").map_or(true, |v| v != "0")
}

impl Default for EnvOpts {
    fn default() -> Self {
        EnvOpts {
            servers: 3,
            bin: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("unbroken")),
            store_timeout_ms: 50,
            dead_after_ms: unbroken_control::object::lb::DEFAULT_DEAD_AFTER_MS,
            gate: "lb".into(),
            probe: true,
            store: true,
            fast_path: fast_path_default(),
        }
    }
}

/// The running object-mode system.
pub struct ObjectEnv {
    pub lab: ObjectLab,
    pub dir: PathBuf,
    pub docroot: PathBuf,
    opts: EnvOpts,
    lb: Option<Child>,
    redis: Option<Child>,
    nginx: Vec<Option<Child>>,
    agents: Vec<Option<Child>>,
    /// `UNBROKEN_PCAP=1`: tcpdump on the client's link (headers only) into `dir/client.pcap`
    /// (kept with `UNBROKEN_KEEP=1`), to see what a stall was waiting for.
    pcap: Option<Child>,
}

impl Drop for ObjectEnv {
    fn drop(&mut self) {
        if let Some(mut p) = self.pcap.take() {
            // SAFETY: a signal to our own child (tcpdump flushes and exits on SIGINT).
            unsafe { libc::kill(p.id() as i32, libc::SIGINT) };
            let _ = p.wait();
        }
        for c in self.agents.iter_mut().chain(self.nginx.iter_mut()).chain([&mut self.lb, &mut self.redis]).flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::env::var_os("UNBROKEN_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("kept {}", self.dir.display());
        }
    }
}

fn err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// Deterministic object content: no two MiB alike (a resume at a wrong offset shows in the
/// hash even when the offset is a multiple of the block size).
pub fn make_object(path: &Path, size: u64, seed: u64) -> io::Result<String> {
    const BLOCK: usize = 1 << 20;
    let mut base = vec![0u64; BLOCK / 8];
    let mut x = seed | 1;
    for w in base.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *w = x;
    }
    let mut f = io::BufWriter::with_capacity(4 << 20, std::fs::File::create(path)?);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; BLOCK];
    let mut left = size;
    let mut chunk = 0u64;
    while left > 0 {
        let k = chunk.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for (i, w) in base.iter().enumerate() {
            buf[i * 8..i * 8 + 8].copy_from_slice(&(w ^ k).to_le_bytes());
        }
        let n = left.min(BLOCK as u64) as usize;
        f.write_all(&buf[..n])?;
        h.update(&buf[..n]);
        left -= n as u64;
        chunk += 1;
    }
    f.flush()?;
    Ok(hex(&h.finalize()))
}

/// The lab's cluster key for store records (`[store] record_key` of every agent).
pub const LAB_RECORD_KEY: &str = "6c61622d7265636f72642d6b65792d30313233343536373839";

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl ObjectEnv {
    /// Builds the lab and starts Redis, nginx, the agents and the LB; returns when every
    /// server is alive at the LB.
    pub fn start(opts: EnvOpts) -> io::Result<ObjectEnv> {
        let lab = ObjectLab::build(ObjectOpts { servers: opts.servers, ..ObjectOpts::default() })?;
        let dir = std::env::temp_dir().join(format!("unbroken-obj-{}", lab.prefix()));
        let docroot = dir.join("www");
        std::fs::create_dir_all(&docroot)?;
        let n = opts.servers;
        let mut env = ObjectEnv { lab, dir, docroot, opts, lb: None, redis: None, nginx: (0..n).map(|_| None).collect(), agents: (0..n).map(|_| None).collect(), pcap: None };
        if std::env::var("UNBROKEN_PCAP").is_ok_and(|v| v == "1") {
            let client = env.lab.client().to_string();
            env.pcap = lab::spawn(&client, Command::new("tcpdump").args(["-i", unbroken_lab::objlab::dev::CLIENT, "-s", "96", "-U", "-w"]).arg(env.dir.join("client.pcap")).stdout(Stdio::null()).stderr(Stdio::null())).ok();
        }
        if env.opts.store {
            env.redis = Some(env.lab.start_redis(addr::REDIS_PORT)?);
        }
        let lbc = env.lab.lb_config();
        let mut lbc = lbc;
        lbc.dead_after_ms = env.opts.dead_after_ms;
        let lb_toml = toml::to_string(&lbc).map_err(err)?;
        std::fs::write(env.dir.join("lb.toml"), lb_toml)?;
        let lb_ns = env.lab.lb().to_string();
        env.lb = Some(lab::spawn(
            &lb_ns,
            Command::new(&env.opts.bin)
                .args(["lb", "--config"])
                .arg(env.dir.join("lb.toml"))
                .arg("--status-file")
                .arg(env.dir.join("lb.json"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(env.dir.join("lb.log"))?),
        )?);
        for i in 1..=n {
            env.start_server(i)?;
        }
        env.wait_alive(&(1..=n).collect::<Vec<_>>(), Duration::from_secs(20))?;
        if env.opts.store {
            env.wait_store(Duration::from_secs(10))?;
        }
        Ok(env)
    }

    fn agent_toml(&self, i: usize) -> String {
        let mut t = self.agent_toml_base(i);
        // The cluster key of the store's records (issue 9 item 7), the same on every agent.
        t.push_str(&format!("record_key = \"{LAB_RECORD_KEY}\"\n"));
        t
    }

    fn agent_toml_base(&self, i: usize) -> String {
        format!(
            "[agent]\nserver_id = {i}\nservices = [\"{}:80\", \"[{}]:80\"]\nbackend = \"127.0.0.1:80\"\nqueue = 7\nlb = \"{}\"\nkey = \"{}\"\nheartbeat_interval_ms = 5\nfailover_gate = \"{}\"\nstatus_file = \"{}\"\nprobe = {}\nfast_path = {}\nfast_path_trust_partial_checksums = true\n\n[store]\nnodes = [\"{}:{}\"]\ntimeout_ms = {}\n",
            addr::VIP_V4,
            addr::VIP_V6,
            addr::HEARTBEAT,
            unbroken_lab::objlab::KEY_HEX,
            self.opts.gate,
            self.agent_status_path(i).display(),
            self.opts.probe,
            self.opts.fast_path,
            addr::STORE_V4,
            addr::REDIS_PORT,
            self.opts.store_timeout_ms,
        )
    }

    /// Path of agent `i`'s status file.
    pub fn agent_status_path(&self, i: usize) -> PathBuf {
        self.dir.join(format!("agent{i}.json"))
    }

    /// The connections agent `i`'s rebuilt list names (its `.rebuilt` file, one line each;
    /// empty when there is none): those it rebuilt and still serves, and for the restart grace
    /// after it started those its predecessor had (a successor of the agent inherits them).
    pub fn rebuilt_listed(&self, i: usize) -> Vec<String> {
        let mut p = self.agent_status_path(i).into_os_string();
        p.push(".rebuilt");
        std::fs::read_to_string(p).map(|t| t.lines().filter(|l| !l.trim().is_empty()).map(str::to_string).collect()).unwrap_or_default()
    }

    /// Agent `i`'s `rebuilt_serving` gauge: connections it rebuilt whose worker still serves
    /// them (0 when its status cannot be read).
    pub fn rebuilt_serving(&self, i: usize) -> u64 {
        self.agent_status(i).and_then(|v| v["agent"]["rebuilt_serving"].as_u64()).unwrap_or(0)
    }

    /// The connection records in the store (their keys, `<prefix>b<bucket>/c/...`), read with
    /// redis-cli; None when it cannot be read.
    pub fn records_stored(&self) -> Option<Vec<String>> {
        let out = lab::run(self.lab.store(), Command::new("redis-cli").args(["-h", &addr::STORE_V4.to_string(), "-p", &addr::REDIS_PORT.to_string(), "--scan", "--pattern", "*/c/*"])).ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).lines().filter(|l| !l.trim().is_empty()).map(str::to_string).collect())
    }

    /// Starts (or restarts) nginx and the agent on server `i`.
    pub fn start_server(&mut self, i: usize) -> io::Result<()> {
        let run = self.dir.join(format!("nginx{i}"));
        self.nginx[i - 1] = Some(self.lab.start_nginx(i, &self.docroot, &run)?);
        self.start_agent(i)
    }

    /// Sends `sig` to agent `i` (false when it does not run).
    pub fn signal_agent(&self, i: usize, sig: i32) -> bool {
        // SAFETY: a signal to our own child.
        self.agents[i - 1].as_ref().is_some_and(|c| unsafe { libc::kill(c.id() as i32, sig) } == 0)
    }

    /// Restarts agent `i` alone (nginx keeps running): `sig` (SIGTERM, SIGKILL), a wait for
    /// its exit (bounded), then a new agent, returning once it is ready.
    pub fn restart_agent(&mut self, i: usize, sig: i32) -> io::Result<()> {
        self.stop_agent(i, sig)?;
        self.start_agent(i)
    }

    /// Stops agent `i` alone (nginx keeps running): `sig`, then a wait for its exit (bounded).
    pub fn stop_agent(&mut self, i: usize, sig: i32) -> io::Result<()> {
        if let Some(mut c) = self.agents[i - 1].take() {
            // SAFETY: a signal to our own child.
            unsafe { libc::kill(c.id() as i32, sig) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.try_wait()?.is_none() {
                if Instant::now() > deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    return Err(err(format!("agent {i} did not exit within 10 s of signal {sig}")));
                }
                std::thread::sleep(Duration::from_millis(2)); // polling a child's exit with a deadline
            }
        }
        Ok(())
    }

    /// Starts agent `i` (its status file is removed first); returns once it printed ready.
    pub fn start_agent(&mut self, i: usize) -> io::Result<()> {
        let conf = self.dir.join(format!("agent{i}.toml"));
        std::fs::write(&conf, self.agent_toml(i))?;
        let _ = std::fs::remove_file(self.agent_status_path(i));
        let ns = self.lab.server(i).to_string();
        let mut child = lab::spawn(
            &ns,
            Command::new(&self.opts.bin)
                .args(["agent", "--config"])
                .arg(&conf)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join(format!("agent{i}.log")))?),
        )?;
        // Ready once it printed its ready line (its rules are in place).
        let mut out = child.stdout.take().ok_or_else(|| err("agent stdout"))?;
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while !line.ends_with(b"\n") {
            match out.read(&mut b) {
                Ok(1) => line.push(b[0]),
                _ => {
                    let log = std::fs::read_to_string(self.dir.join(format!("agent{i}.log"))).unwrap_or_default();
                    return Err(err(format!("agent {i} did not start: {log}")));
                }
            }
        }
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = out.read_to_end(&mut sink);
        });
        self.agents[i - 1] = Some(child);
        Ok(())
    }

    /// Whether the agents are configured with the kernel fast path (`agent.fast_path`).
    pub fn opts_fast_path(&self) -> bool {
        self.opts.fast_path
    }

    /// Restarts every running agent with the kernel fast path on or off (`agent.fast_path`),
    /// then waits until the LB hears all of them again. Err when an agent's status does not
    /// say the fast path is as asked within 10 s (it logs why it is off).
    pub fn set_fast_path(&mut self, on: bool) -> io::Result<()> {
        self.opts.fast_path = on;
        let ids: Vec<usize> = (1..=self.servers()).filter(|&i| self.agents[i - 1].is_some()).collect();
        for &i in &ids {
            self.restart_agent(i, libc::SIGTERM)?;
        }
        self.wait_alive(&ids, Duration::from_secs(20))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let as_asked = ids.iter().all(|&i| self.agent_status(i).is_some_and(|s| s["agent"]["fast_path"]["on"] == on));
            if as_asked {
                return Ok(());
            }
            if Instant::now() > deadline {
                let why: Vec<String> = ids.iter().map(|&i| format!("agent {i}: {}", self.agent_status(i).map(|s| s["agent"]["fast_path"].to_string()).unwrap_or_default())).collect();
                return Err(err(format!("the agents' fast path is not {}: {}", if on { "on" } else { "off" }, why.join("; "))));
            }
            std::thread::sleep(Duration::from_millis(20)); // polling a status file with a deadline
        }
    }

    /// Waits until the LB reports every server of `ids` alive and heard from.
    pub fn wait_alive(&self, ids: &[usize], timeout: Duration) -> io::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(s) = self.lb_status() {
                let ok = ids.iter().all(|&i| {
                    s["servers"].as_array().is_some_and(|v| v.iter().any(|x| x["id"] == i as u64 && x["alive"] == true && x["heard"] != false && x["last_heartbeat_age_ms"].as_u64().is_some_and(|a| a < 1000)))
                });
                if ok {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err(err(format!("servers {ids:?} not alive at the LB: {:?}", self.lb_status().ok())));
            }
            std::thread::sleep(Duration::from_millis(20)); // polling a status file with a deadline
        }
    }

    /// Waits until every live agent reports its store connected.
    pub fn wait_store(&self, timeout: Duration) -> io::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let ok = (1..=self.opts.servers).filter(|&i| self.agents[i - 1].is_some()).all(|i| self.agent_status(i).is_some_and(|v| v["store_down"] == false));
            if ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(err("the agents did not report the store connected"));
            }
            std::thread::sleep(Duration::from_millis(20)); // polling status files with a deadline
        }
    }

    /// The LB's status JSON.
    pub fn lb_status(&self) -> io::Result<serde_json::Value> {
        let t = std::fs::read_to_string(self.dir.join("lb.json"))?;
        serde_json::from_str(&t).map_err(err)
    }

    /// Agent `i`'s status JSON (the last one written, also after a crash).
    pub fn agent_status(&self, i: usize) -> Option<serde_json::Value> {
        let t = std::fs::read_to_string(self.agent_status_path(i)).ok()?;
        serde_json::from_str(&t).ok()
    }

    /// Sum of an agent counter over all servers.
    pub fn agent_sum(&self, name: &str) -> u64 {
        (1..=self.opts.servers).filter_map(|i| self.agent_status(i)).map(|v| v["agent"][name].as_u64().unwrap_or(0)).sum()
    }

    /// Sum of an engine counter over all servers.
    pub fn engine_sum(&self, name: &str) -> u64 {
        (1..=self.opts.servers).filter_map(|i| self.agent_status(i)).map(|v| v["engine"][name].as_u64().unwrap_or(0)).sum()
    }

    /// The live server holding an established connection from the client's `port` on :80.
    pub fn serving(&self, client_port: u16) -> Option<usize> {
        let crashed: Vec<String> = self.lab.crashed().map(String::from).collect();
        (1..=self.opts.servers).find(|&i| {
            let ns = self.lab.server(i);
            if crashed.iter().any(|c| c == ns) {
                return false;
            }
            let out = lab::run(ns, Command::new("ss").args(["-Htn", "state", "established", "( sport = :80 )"])).ok();
            out.is_some_and(|o| String::from_utf8_lossy(&o.stdout).lines().any(|l| l.split_whitespace().any(|w| w.ends_with(&format!(":{client_port}")) && !w.starts_with("127.") && !w.starts_with("[::1]"))))
        })
    }

    /// Power loss of server `i`.
    pub fn crash(&mut self, i: usize) -> io::Result<()> {
        self.lab.crash_server(i)?;
        self.agents[i - 1] = None;
        self.nginx[i - 1] = None;
        Ok(())
    }

    /// Boots server `i` again (links, nginx, agent).
    pub fn revive(&mut self, i: usize) -> io::Result<()> {
        self.lab.revive_server(i)?;
        self.start_server(i)
    }

    /// Stops Redis (the store goes down).
    pub fn stop_store(&mut self) {
        if let Some(mut r) = self.redis.take() {
            let _ = r.kill();
            let _ = r.wait();
        }
    }

    /// Freezes (SIGSTOP, `pause = true`) or thaws (SIGCONT) Redis: a store that stops
    /// answering without closing its connections, as a stalled host would. False when no
    /// Redis runs.
    pub fn pause_store(&self, pause: bool) -> bool {
        let Some(r) = &self.redis else { return false };
        // SAFETY: a signal to our own child, which has not been reaped.
        unsafe { libc::kill(r.id() as i32, if pause { libc::SIGSTOP } else { libc::SIGCONT }) == 0 }
    }

    /// Sends `sig` to Redis (false when it does not run): SIGSTOP/SIGCONT make a store blip.
    pub fn signal_store(&self, sig: i32) -> bool {
        // SAFETY: a signal to our own child.
        self.redis.as_ref().is_some_and(|c| unsafe { libc::kill(c.id() as i32, sig) } == 0)
    }

    /// Whether server `i` is crashed (powered off and not revived).
    pub fn is_crashed(&self, i: usize) -> bool {
        let ns = self.lab.server(i);
        self.lab.crashed().any(|c| c == ns)
    }

    /// Number of servers.
    pub fn servers(&self) -> usize {
        self.opts.servers
    }

    /// RSTs that reached the client namespace so far.
    pub fn client_rsts(&self) -> u64 {
        lab::rsts_seen(self.lab.client()).unwrap_or(u64::MAX)
    }

    /// A URL of the service for `path`.
    pub fn url(&self, ipv6: bool, path: &str) -> String {
        if ipv6 {
            format!("http://[{}]{path}", addr::VIP_V6)
        } else {
            format!("http://{}{path}", addr::VIP_V4)
        }
    }

    /// Spawns a command in the client namespace with stdout piped.
    pub fn client_cmd(&self, cmd: &mut Command) -> io::Result<Child> {
        lab::spawn(self.lab.client(), cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()))
    }
}

/// Reads a child's stdout to the end: hashing, counting, and measuring the longest gap
/// between two reads (the stall the client's application saw).
#[derive(Debug, Default, Clone, Serialize)]
pub struct Received {
    pub bytes: u64,
    pub sha256: String,
    pub max_gap_ms: u64,
    /// Gaps over 50 ms: (at bytes, ms).
    pub gaps: Vec<(u64, u64)>,
}

/// Starts reading `out` in a thread; `progress` follows the byte count.
pub fn receive(mut out: impl Read + Send + 'static, progress: Arc<AtomicU64>) -> std::thread::JoinHandle<Received> {
    std::thread::spawn(move || {
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut r = Received::default();
        let mut last = Instant::now();
        loop {
            let n = match out.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let gap = last.elapsed().as_millis() as u64;
            last = Instant::now();
            if gap > 50 && r.bytes > 0 {
                r.gaps.push((r.bytes, gap));
            }
            if r.bytes > 0 {
                r.max_gap_ms = r.max_gap_ms.max(gap);
            }
            h.update(&buf[..n]);
            r.bytes += n as u64;
            progress.store(r.bytes, Ordering::Relaxed);
        }
        r.sha256 = hex(&h.finalize());
        r
    })
}

/// The demo's settings.
#[derive(Debug, Clone)]
pub struct ObjectScenario {
    pub size: u64,
    /// Fractions of the download at which the serving server loses power.
    pub crash_at: Vec<f64>,
    /// `curl` or `wget`.
    pub client: String,
    pub ipv6: bool,
    /// Client rate limit, bytes/s (0: none), so the crashes land mid-transfer.
    pub rate: u64,
    pub servers: usize,
    pub timeout: Duration,
    pub live: bool,
    pub probe: bool,
    /// Boot the first dead server again during the download (its buckets return to it, and
    /// the connection moves back if it was one of them).
    pub revive: bool,
    /// The `unbroken` binary for the agents and the LB (default: this executable).
    pub bin: Option<PathBuf>,
}

impl Default for ObjectScenario {
    fn default() -> Self {
        ObjectScenario { size: 1 << 30, crash_at: vec![0.3, 0.65], client: "curl".into(), ipv6: false, rate: 0, servers: 3, timeout: Duration::from_secs(300), live: false, probe: true, revive: false, bin: None }
    }
}

/// One server death during the demo.
#[derive(Debug, Clone, Serialize)]
pub struct CrashLog {
    pub t_ms: u64,
    pub server: usize,
    pub at_bytes: u64,
    /// LB: silence observed before declaring the death.
    pub detect_ms: Option<u64>,
}

/// The demo's report (`--json` prints it).
#[derive(Debug, Clone, Serialize)]
pub struct ObjectReport {
    pub ok: bool,
    pub error: Option<String>,
    pub client: String,
    pub client_exit: Option<i32>,
    pub failovers: u64,
    pub refused: u64,
    pub bytes: u64,
    pub expected_bytes: u64,
    pub sha256_ok: bool,
    pub resets_seen_by_client: u64,
    pub max_stall_ms: u64,
    pub stalls: Vec<(u64, u64)>,
    pub crashes: Vec<CrashLog>,
    pub duration_ms: u64,
    pub unprotected: u64,
    /// Servers booted again during the download.
    pub revived: Vec<usize>,
    /// Connections silenced on a server whose bucket went back home.
    pub muted: u64,
    /// Deaths the LB declared beyond the crashes (live servers it falsely took for dead, e.g.
    /// heartbeats late on an overloaded machine): each may move the connection once more.
    pub lb_false_deaths: u64,
}

/// `unbroken demo object`.
pub fn run_object(s: &ObjectScenario) -> Result<ObjectReport, String> {
    lab::lab_available().map_err(|e| format!("the lab is not available: {e}"))?;
    let mut opts = EnvOpts { servers: s.servers, probe: s.probe, ..EnvOpts::default() };
    if let Some(b) = &s.bin {
        opts.bin = b.clone();
    }
    let mut env = ObjectEnv::start(opts).map_err(|e| format!("starting the system: {e}"))?;
    if s.live {
        eprintln!("[demo] writing a {} MiB object", s.size >> 20);
    }
    let want = make_object(&env.docroot.join("big.bin"), s.size, 42).map_err(|e| e.to_string())?;
    let url = env.url(s.ipv6, "/big.bin");
    let port = 40000 + (std::process::id() % 20000) as u16;
    let mut cmd = match s.client.as_str() {
        "curl" => {
            let mut c = Command::new("curl");
            c.args(["-sS", "--fail", "-o", "-", "--local-port", &port.to_string()]);
            if s.rate > 0 {
                c.args(["--limit-rate", &s.rate.to_string()]);
            }
            c.arg(&url);
            c
        }
        "wget" => {
            let mut c = Command::new("wget");
            c.args(["-q", "-O", "-", "--tries=1", "--bind-address", if s.ipv6 { "fd77::2" } else { "10.77.0.2" }]);
            if s.rate > 0 {
                c.arg(format!("--limit-rate={}", s.rate));
            }
            c.arg(&url);
            c
        }
        o => return Err(format!("unknown client {o:?} (curl, wget)")),
    };
    let t0 = Instant::now();
    let mut child = env.client_cmd(&mut cmd).map_err(|e| format!("starting {}: {e}", s.client))?;
    let progress = Arc::new(AtomicU64::new(0));
    let rx = receive(child.stdout.take().unwrap(), progress.clone());
    let mut stderr = child.stderr.take().unwrap();
    let errtext = Arc::new(Mutex::new(String::new()));
    let et = errtext.clone();
    std::thread::spawn(move || {
        let mut t = String::new();
        let _ = stderr.read_to_string(&mut t);
        *et.lock().unwrap() = t;
    });
    let mut crashes: Vec<CrashLog> = Vec::new();
    let mut error = None;
    let mut next = 0;
    let mut last_print = Instant::now();
    let mut revived = Vec::new();
    let status = loop {
        if s.revive && revived.is_empty() && !crashes.is_empty() && next < s.crash_at.len() {
            let dead = crashes[0].server;
            let down = env.lb_status().ok().is_some_and(|l| l["events"].as_array().is_some_and(|e| e.iter().any(|x| x["server"] == dead as u64 && x["kind"] == "down")));
            if down {
                if s.live {
                    eprintln!("[demo] {:>6} ms  server {dead} boots again", t0.elapsed().as_millis());
                }
                match env.revive(dead).and_then(|_| env.wait_alive(&[dead], Duration::from_secs(10))) {
                    Ok(()) => revived.push(dead),
                    Err(e) => {
                        error = Some(format!("revive: {e}"));
                        revived.push(dead);
                    }
                }
            }
        }
        if let Ok(Some(st)) = child.try_wait() {
            break Some(st);
        }
        if t0.elapsed() > s.timeout {
            let _ = child.kill();
            error = Some(format!("timeout after {:?}", s.timeout));
            break child.wait().ok();
        }
        let got = progress.load(Ordering::Relaxed);
        if next < s.crash_at.len() && got as f64 >= s.crash_at[next] * s.size as f64 {
            // wget picks its own port: find the connection by the client side instead.
            let serving = if s.client == "curl" { env.serving(port) } else { (1..=s.servers).find(|&i| env.agent_status(i).is_some_and(|v| v["protected"].as_u64().unwrap_or(0) > 0) && env.serving_any(i)) };
            match serving {
                Some(i) => {
                    if s.live {
                        eprintln!("[demo] {:>6} ms  {:>5} MiB received: server {i} loses power", t0.elapsed().as_millis(), got >> 20);
                    }
                    if let Err(e) = env.crash(i) {
                        error = Some(format!("crash: {e}"));
                    }
                    crashes.push(CrashLog { t_ms: t0.elapsed().as_millis() as u64, server: i, at_bytes: got, detect_ms: None });
                }
                None => {
                    error = Some("could not find the serving server".into());
                }
            }
            next += 1;
        }
        if s.live && last_print.elapsed() > Duration::from_secs(1) {
            last_print = Instant::now();
            eprintln!("[demo] {:>6} ms  {:>5} / {} MiB", t0.elapsed().as_millis(), got >> 20, s.size >> 20);
        }
        std::thread::sleep(Duration::from_millis(5)); // polling progress to time the crashes
    };
    let recv = rx.join().unwrap_or_default();
    let duration_ms = t0.elapsed().as_millis() as u64;
    let mut lb_false_deaths = 0;
    if let Ok(lbs) = env.lb_status() {
        if let Some(evs) = lbs["events"].as_array() {
            for c in crashes.iter_mut() {
                // The last down event: earlier ones of a server that flapped were false.
                c.detect_ms = evs.iter().rev().find(|e| e["server"] == c.server as u64 && e["kind"] == "down").and_then(|e| e["detect_ms"].as_u64());
            }
            // A crashed server stays dead (a revived one is not crashed again): one true down
            // event per crash, every other one is false.
            let downs = evs.iter().filter(|e| e["kind"] == "down").count() as u64;
            lb_false_deaths = downs.saturating_sub(crashes.len() as u64) + lbs["counters"]["events_dropped"].as_u64().unwrap_or(0);
        }
    }
    // The agents write their status within 10 ms of a failover: poll (bounded) until every
    // crash's failover shows, rather than sleeping for a guessed time.
    let deadline = Instant::now() + Duration::from_secs(2);
    while env.agent_sum("failovers") < crashes.len() as u64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10)); // polling status files with a deadline
    }
    let code = status.and_then(|s| s.code());
    let rsts = env.client_rsts();
    let sha_ok = recv.sha256 == want && recv.bytes == s.size;
    let failovers = env.agent_sum("failovers");
    let ok = error.is_none() && code == Some(0) && sha_ok && rsts == 0 && crashes.len() == s.crash_at.len();
    if !ok && error.is_none() {
        let e = errtext.lock().unwrap().clone();
        error = Some(format!("client exit {code:?}, sha256 {}, {rsts} RSTs; client said: {}", if sha_ok { "ok" } else { "MISMATCH" }, e.trim()));
    }
    Ok(ObjectReport {
        ok,
        error,
        client: s.client.clone(),
        client_exit: code,
        failovers,
        refused: env.agent_sum("refused"),
        bytes: recv.bytes,
        expected_bytes: s.size,
        sha256_ok: sha_ok,
        resets_seen_by_client: rsts,
        max_stall_ms: recv.max_gap_ms,
        stalls: recv.gaps,
        crashes,
        duration_ms,
        unprotected: env.engine_sum("unprotected"),
        revived,
        muted: env.agent_sum("muted"),
        lb_false_deaths,
    })
}

impl ObjectEnv {
    /// Whether live server `i` has any established connection on :80 from the client.
    pub fn serving_any(&self, i: usize) -> bool {
        let ns = self.lab.server(i);
        let out = lab::run(ns, Command::new("ss").args(["-Htn", "state", "established", "( sport = :80 )"])).ok();
        let c4 = addr::CLIENT_V4.to_string();
        let c6 = addr::CLIENT_V6.to_string();
        out.is_some_and(|o| String::from_utf8_lossy(&o.stdout).lines().any(|l| l.contains(&c4) || l.contains(&c6)))
    }
}

/// The service address for the client's connections.
pub fn service(ipv6: bool) -> SocketAddr {
    if ipv6 {
        SocketAddr::new(IpAddr::V6(addr::VIP_V6), 80)
    } else {
        SocketAddr::new(IpAddr::V4(addr::VIP_V4), 80)
    }
}
