//! Checkpoint-mode scenarios on the lab: the guard, the example journal server and an unmodified
//! peer in their own network namespaces, with crashes injected while the peer streams. Used by
//! `unbroken demo checkpoint`, the integration tests and `unbroken bench checkpoint`.

use crate::checkpoint::peer::PeerResult;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};
use unbroken_lab::lab::{self, addr, CheckpointLab, CheckpointOpts, Lab};

/// A failure to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Crash {
    /// SIGKILL the application; restart it on the same host.
    App,
    /// Power loss of the application's host: every process killed, its link cut; the service
    /// address moves to the other app host and the application restarts there.
    Host,
    /// SIGKILL the guard; restart it (section 2.7).
    Guard,
    /// The guard and the application die at the same moment.
    GuardAndApp,
    /// A second crash during recovery: SIGKILL the application, restart it, and kill that
    /// instance again while it recovers its connections (at its `recovered` point: a recovered
    /// socket is connected through the guard, nothing is resent yet); then restart it again.
    AppDuringRecovery,
    /// The guard dies while the application recovers: SIGKILL the application, restart it and
    /// stop it at its `recovered` point (`JOURNAL_PAUSE_AT`), SIGKILL and restart the guard,
    /// then let the application go on. The new guard knows neither Δ nor the checkpoint.
    GuardDuringRecovery,
    /// Not a crash: SIGHUP to the guard, which must log it, count it (`sighup_ignored` in
    /// its status file) and keep running.
    GuardHangup,
}

#[derive(Debug, Clone)]
pub struct Scenario {
    pub records: u64,
    /// Records per second the peer sends (0: as fast as it can).
    pub rate: u64,
    /// Crashes, injected at evenly spaced points of the transfer.
    pub crashes: Vec<Crash>,
    pub ipv6: bool,
    /// App hosts that differ in TS clock and window scale (recovery "on another machine").
    pub heterogeneous: bool,
    pub seed: u64,
    /// Overall deadline.
    pub timeout: Duration,
    /// Print live progress on stderr.
    pub live: bool,
    /// Where each crash happens, as fractions of the reply bytes (default: evenly spaced).
    pub crash_at: Option<Vec<f64>>,
    /// Fault-injection point for the first application instance (`JOURNAL_CRASH_AT`): it kills
    /// itself there, and is restarted on the same host.
    pub app_crash_point: Option<String>,
    /// The server echoes the input (both directions carry the same volume).
    pub echo: bool,
    /// Run the guard on the application's own host (OUTPUT and INPUT chains, side channel on
    /// loopback) instead of on the gateway. Host crashes then take the guard along and are not
    /// supported.
    pub local_guard: bool,
    /// While the peer streams, spray the guard with hostile input (see [`hostile_traffic`]) and
    /// the connection with blind forgeries from the peer's side ([`forged_peer_traffic`]).
    pub hostile: bool,
    /// Protected connections, one peer process each (every one streams `records` records at
    /// `rate`); crashes are placed by the first one's progress.
    pub connections: usize,
    /// The guard's `recovery_nudge` (experimental, off by default).
    pub nudge: bool,
    /// While the peer streams, an attacker on the peer's side of a gateway guard sends it
    /// packets forged with the service's source address and the live connection's ports (see
    /// [`forge_app_source`]).
    pub forge_app_source: bool,
    /// The guard's `fast_path` (issue 22): on unless the environment says
    /// `UNBROKEN_FAST_PATH=0` (so that every lab test and demo runs on either path).
    pub fast_path: bool,
}

/// `UNBROKEN_FAST_PATH=0` turns the guard's fast path off in every scenario (default on).
pub fn fast_path_default() -> bool {
    std::env::var("UNBROKEN_FAST_PATH").map(|v| v != "0").unwrap_or(true)
}

impl Default for Scenario {
    fn default() -> Self {
        Scenario {
            records: 100_000,
            rate: 0,
            crashes: vec![Crash::App, Crash::App, Crash::Host, Crash::App],
            ipv6: false,
            heterogeneous: true,
            seed: 1,
            timeout: Duration::from_secs(300),
            live: false,
            crash_at: None,
            app_crash_point: None,
            echo: false,
            local_guard: false,
            hostile: false,
            connections: 1,
            nudge: false,
            forge_app_source: false,
            fast_path: fast_path_default(),
        }
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct CrashRecord {
    pub kind: Crash,
    /// The fault-injection point, when the application crashed itself.
    pub point: Option<String>,
    pub at_bytes_verified: u64,
    pub t_ms: u64,
    /// Host the application runs on after this crash.
    pub app_host: String,
}

/// A gap in one connection's replies of at least [`crate::checkpoint::peer::STALL_REPORT_MS`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct Stall {
    /// Which connection (peer process), from 0.
    pub conn: usize,
    pub ms: u64,
    /// When the stall ended, on the scenario's clock (as `CrashRecord::t_ms`).
    pub end_t_ms: u64,
    /// Reply bytes the connection had received when the stall began.
    pub at_bytes: u64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    pub ok: bool,
    pub error: Option<String>,
    pub crashes: usize,
    pub crash_log: Vec<CrashRecord>,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub bytes_verified: u64,
    pub sha256_ok: bool,
    pub resets_seen_by_peer: u64,
    pub max_stall_ms: u64,
    pub duration_ms: u64,
    /// The peer process's exit status (0 when it verified everything).
    pub peer_exit_code: Option<i32>,
    /// The first connection's peer.
    pub peer: Option<PeerResult>,
    /// Every peer, when there is more than one connection.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<PeerResult>,
    pub connections: usize,
    /// Every gap in the replies of any connection of at least 20 ms, in the order they ended.
    pub stalls: Vec<Stall>,
    /// The peer host's TCP counters that moved (its namespace is fresh): how its stalls were
    /// ended (`TCPTimeouts`: retransmission timer; `TCPLossProbes`: tail loss probes;
    /// `TCPSackRecovery`, `TCPFastRetrans`: loss recovery from SACKs; `RetransSegs`).
    pub peer_tcp: serde_json::Value,
    pub guard: serde_json::Value,
    /// Packets forged with the service's source sent from the peer's side
    /// ([`Scenario::forge_app_source`]), and how many the guard's rules dropped as forged (the
    /// packet counters of its chain's DROP rules).
    pub forged_sent: u64,
    pub forged_dropped: u64,
}

/// TCP counters of a namespace (`Tcp` and `TcpExt` of /proc/net/snmp and netstat), non-zero.
pub fn tcp_counters(ns: &str) -> serde_json::Value {
    let read = || {
        let mut m = serde_json::Map::new();
        for f in ["/proc/thread-self/net/snmp", "/proc/thread-self/net/netstat"] {
            let text = std::fs::read_to_string(f).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            for pair in lines.chunks(2) {
                let [names, values] = pair else { continue };
                let (Some((p, n)), Some((_, v))) = (names.split_once(':'), values.split_once(':')) else { continue };
                if p != "Tcp" && p != "TcpExt" {
                    continue;
                }
                for (k, x) in n.split_whitespace().zip(v.split_whitespace()) {
                    if let Ok(x) = x.parse::<i64>() {
                        if x != 0 && !matches!(k, "RtoAlgorithm" | "RtoMin" | "RtoMax" | "MaxConn" | "CurrEstab") {
                            m.insert(k.to_string(), x.into());
                        }
                    }
                }
            }
        }
        serde_json::Value::Object(m)
    };
    lab::in_ns(ns, read).unwrap_or(serde_json::Value::Null)
}

/// A child process whose stdout lines arrive on a channel.
pub(crate) struct Proc {
    pub(crate) child: Child,
    pub(crate) lines: Receiver<String>,
}

impl Proc {
    pub(crate) fn spawn(ns: &str, cmd: &mut Command) -> Result<Proc, String> {
        cmd.stdout(Stdio::piped()).stdin(Stdio::null());
        let mut child = lab::spawn(ns, cmd).map_err(|e| format!("spawn in {ns}: {e}"))?;
        let out = child.stdout.take().ok_or("no stdout")?;
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Ok(Proc { child, lines: rx })
    }
    /// Waits for a stdout line starting with `prefix`.
    pub(crate) fn wait_line(&mut self, prefix: &str, deadline: Duration) -> Result<String, String> {
        let end = Instant::now() + deadline;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return Ok(l),
                Ok(_) => continue,
                Err(_) => {
                    let status = self.child.try_wait().ok().flatten();
                    return Err(format!("no {prefix:?} line within {deadline:?} (exit status {status:?})"));
                }
            }
        }
    }
    /// The child and its lines, without the kill on drop.
    fn into_parts(self) -> (Child, Receiver<String>) {
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: `me` is never dropped; each field is moved out exactly once.
        unsafe { (std::ptr::read(&me.child), std::ptr::read(&me.lines)) }
    }
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Peer processes, killed if still running when dropped.
struct Peers(Vec<Child>);

impl Drop for Peers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The `unbroken` executable to run in the namespaces.
pub fn self_exe() -> PathBuf {
    if let Ok(p) = std::env::var("UNBROKEN_BIN") {
        return PathBuf::from(p);
    }
    std::env::current_exe().unwrap_or_else(|_| PathBuf::from("unbroken"))
}

pub const KEY_HEX: &str = "6c61622d6f6e6c792d6b65792d2d6e6f742d666f722d70726f64756374696f6e";
const GUARD_PORT: u16 = 7900;
const SERVICE_PORT: u16 = 7000;
const QUEUE: u16 = 7;

pub(crate) struct World {
    pub(crate) lab: CheckpointLab,
    pub(crate) dir: PathBuf,
    pub(crate) exe: PathBuf,
    pub(crate) ipv6: bool,
    pub(crate) echo: bool,
    pub(crate) local_guard: bool,
    pub(crate) nudge: bool,
    /// The guard's `fast_path`.
    pub(crate) fast_path: bool,
}

impl World {
    pub(crate) fn service(&self) -> SocketAddr {
        let ip: IpAddr = if self.ipv6 { addr::SERVICE_V6.into() } else { addr::SERVICE_V4.into() };
        SocketAddr::new(ip, SERVICE_PORT)
    }
    pub(crate) fn guard_ctl(&self) -> SocketAddr {
        if self.local_guard {
            return SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), GUARD_PORT);
        }
        let ip: IpAddr = if self.ipv6 { addr::GUARD_LAN_V6.into() } else { addr::GUARD_LAN_V4.into() };
        SocketAddr::new(ip, GUARD_PORT)
    }
    pub(crate) fn status_path(&self) -> PathBuf {
        self.dir.join("guard-status.json")
    }
    pub(crate) fn write_config(&self) -> Result<PathBuf, String> {
        let (placement, control, allowed) = if self.local_guard {
            ("local", format!("\"127.0.0.1:{GUARD_PORT}\""), "\"127.0.0.0/8\"".to_string())
        } else {
            ("gateway", format!("\"{}:{GUARD_PORT}\", \"[{}]:{GUARD_PORT}\"", addr::GUARD_LAN_V4, addr::GUARD_LAN_V6), "\"10.77.2.0/24\", \"fd77:2::/64\"".to_string())
        };
        let app_interface = if self.local_guard { String::new() } else { format!("app_interface = \"{}\"\n", lab::dev::GUARD_LAN) };
        let cfg = format!(
            "[guard]\nqueue = {QUEUE}\nplacement = \"{placement}\"\n{app_interface}control = [{control}]\nkey = \"{KEY_HEX}\"\nallowed_sources = [{allowed}]\nstatus_file = \"{}\"\nrecovery_nudge = {}\nfast_path = {}\n\n[[service]]\naddr = \"{}\"\nport = {SERVICE_PORT}\n\n[[service]]\naddr = \"{}\"\nport = {SERVICE_PORT}\n",
            self.status_path().display(),
            self.nudge,
            self.fast_path,
            addr::SERVICE_V4,
            addr::SERVICE_V6,
        );
        let p = self.dir.join("guard.toml");
        std::fs::write(&p, cfg).map_err(|e| format!("write config: {e}"))?;
        write_key_file(&self.key_file(), KEY_HEX)?;
        Ok(p)
    }
    /// The application's key file (journal-server --key-file: a key on the command line is
    /// visible to every user through `ps`).
    pub(crate) fn key_file(&self) -> PathBuf {
        self.dir.join("app.key")
    }
    fn start_guard(&self, cfg: &Path) -> Result<Proc, String> {
        let mut cmd = Command::new(&self.exe);
        cmd.arg("guard").arg("--config").arg(cfg);
        let ns = if self.local_guard { self.lab.app(1) } else { &self.lab.guard };
        let mut p = Proc::spawn(ns, &mut cmd)?;
        p.wait_line("unbroken guard: ready", Duration::from_secs(10)).map_err(|e| format!("guard: {e}"))?;
        Ok(p)
    }
    fn start_app(&self, ns: &str, crash_point: Option<&str>) -> Result<Proc, String> {
        let mut p = self.spawn_app(ns, crash_point, None)?;
        p.wait_line("journal-server: listening", Duration::from_secs(10)).map_err(|e| format!("app: {e}"))?;
        Ok(p)
    }
    /// Starts the application and waits until it kills itself at `point` during its recovery,
    /// or stops itself there when `pause` (then it is returned stopped: SIGCONT it). A point
    /// not reached within 10 s (the connection had finished: the peer had acknowledged all of
    /// it before the crash, so the restarted app only records that) returns the app running;
    /// the caller's fault then hits it wherever it is, and the peer's result still judges.
    fn start_app_at(&self, ns: &str, point: &str, pause: bool) -> Result<Proc, String> {
        let mut p = if pause { self.spawn_app(ns, None, Some(point))? } else { self.spawn_app(ns, Some(point), None)? };
        let end = Instant::now() + Duration::from_secs(10);
        if pause {
            if let Err(e) = p.wait_line(&format!("journal-server: paused at {point}"), Duration::from_secs(10)) {
                if !matches!(p.child.try_wait(), Ok(None)) {
                    return Err(format!("app: {e}"));
                }
                eprintln!("scenario: the app did not reach {point} within 10 s (nothing left to recover?): going on");
            }
            return Ok(p);
        }
        while matches!(p.child.try_wait(), Ok(None)) {
            if Instant::now() > end {
                eprintln!("scenario: the app did not reach {point} within 10 s (nothing left to recover?): going on");
                return Ok(p);
            }
            // Nothing to recover (every connection had finished): the point cannot be reached.
            if let Ok(l) = p.lines.try_recv() {
                if l.starts_with("journal-server: listening") && l.contains("(0 connection(s) recovering)") {
                    return Err(format!("app: nothing to recover, so no crash at {point}"));
                }
            }
            std::thread::sleep(Duration::from_millis(2)); // polling a child's exit with a deadline
        }
        Ok(p)
    }
    fn spawn_app(&self, ns: &str, crash_point: Option<&str>, pause_point: Option<&str>) -> Result<Proc, String> {
        let mut cmd = Command::new(&self.exe);
        if let Some(p) = crash_point {
            cmd.env("JOURNAL_CRASH_AT", p);
        }
        if let Some(p) = pause_point {
            cmd.env("JOURNAL_PAUSE_AT", p);
        }
        cmd.arg("journal-server");
        if self.echo {
            cmd.arg("--echo");
        }
        cmd
            .arg("--listen")
            .arg(self.service().to_string())
            .arg("--guard")
            .arg(self.guard_ctl().to_string())
            .arg("--key-file")
            .arg(self.key_file())
            .arg("--dir")
            .arg(self.dir.join("journal"));
        Proc::spawn(ns, &mut cmd)
    }
}

/// Writes `hex` to `path`, readable by its owner only.
pub(crate) fn write_key_file(path: &Path, hex: &str) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    writeln!(f, "{hex}").map_err(|e| format!("{}: {e}", path.display()))
}

/// How the application is misconfigured in [`run_misconfigured`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Misconfig {
    /// Nothing: the control run.
    None,
    /// The application's key is not the guard's.
    WrongKey,
    /// Nothing listens at the guard address the application was given.
    WrongGuardAddress,
    /// The side channel is one-way: the application's commands reach the guard, the guard's
    /// answers are dropped (an iptables rule in the application's namespace, like a firewall
    /// that lets only outgoing UDP through).
    OneWaySideChannel,
    /// Not a misconfiguration: the guard is SIGKILLed and restarted between the peer's
    /// handshake and the application's first TELL (the application stopped at its `accepted`
    /// point meanwhile). Nobody knows the checkpoint: the connection cannot be protected, and
    /// the peer must see its end, not hang (issue 21, item 4).
    GuardRestartBeforeFirstTell,
}

/// What [`run_misconfigured`] saw.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MisconfigReport {
    /// The application's start-up line about the guard (`journal-server: guard check ...`).
    pub guard_check: String,
    /// Its `listening` line.
    pub listening: String,
    /// Everything it wrote to stderr (its per-connection log).
    pub app_log: String,
    /// What the peer saw of its connection: `eof` (the application's FIN), `reset`, `hung`
    /// (nothing within `peer_wait_ms`), or, for the control run, `protected` (a reply to its
    /// record, and the connection still open seconds later).
    pub peer: String,
    /// How long the peer waited for that.
    pub peer_ms: u64,
    pub peer_wait_ms: u64,
    /// The guard's status after the run.
    pub guard: serde_json::Value,
}

/// Issue 9, checkpoint misconfiguration: the guard and the journal server in the lab, the
/// server given a wrong key or a wrong guard address (or neither), and one peer connection
/// made with plain sockets from the peer's namespace. For a misconfiguration the peer sends a
/// few bytes (less than a record) and waits (bounded) for the server to close; for the control
/// run it sends one record and expects its reply, and the connection to stay open.
pub fn run_misconfigured(m: Misconfig) -> Result<MisconfigReport, String> {
    lab::lab_available()?;
    let lab = Lab::checkpoint(CheckpointOpts::default()).map_err(|e| format!("lab: {e}"))?;
    let dir = std::env::temp_dir().join(format!("unbroken-misconf-{}-{}", lab.prefix(), std::process::id()));
    std::fs::create_dir_all(dir.join("journal")).map_err(|e| format!("{}: {e}", dir.display()))?;
    let w = World { lab, dir: dir.clone(), exe: self_exe(), ipv6: false, echo: false, local_guard: false, nudge: false, fast_path: fast_path_default() };
    let res = misconfigured_in(&w, m);
    drop(w);
    let _ = std::fs::remove_dir_all(&dir);
    res
}

fn misconfigured_in(w: &World, m: Misconfig) -> Result<MisconfigReport, String> {
    let cfg = w.write_config()?;
    let mut guard = w.start_guard(&cfg)?;
    let key_file = w.dir.join("given.key");
    write_key_file(&key_file, if m == Misconfig::WrongKey { "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff" } else { KEY_HEX })?;
    let mut guard_addr = w.guard_ctl();
    if m == Misconfig::WrongGuardAddress {
        guard_addr.set_port(guard_addr.port() + 1);
    }
    if m == Misconfig::OneWaySideChannel {
        let ctl = w.guard_ctl();
        let tool = if ctl.is_ipv4() { "iptables" } else { "ip6tables" };
        let (ip, port) = (ctl.ip().to_string(), ctl.port().to_string());
        lab::run_ok(w.lab.app(1), Command::new(tool).args(["-w", "-A", "INPUT", "-p", "udp", "-s", &ip, "--sport", &port, "-j", "DROP"])).map_err(|e| format!("{tool}: {e}"))?;
    }
    let log_path = w.dir.join("app.stderr");
    let log = std::fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    let mut cmd = Command::new(&w.exe);
    cmd.arg("journal-server")
        .arg("--listen")
        .arg(w.service().to_string())
        .arg("--guard")
        .arg(guard_addr.to_string())
        .arg("--key-file")
        .arg(&key_file)
        .arg("--dir")
        .arg(w.dir.join("journal"))
        .stderr(log);
    let restart = m == Misconfig::GuardRestartBeforeFirstTell;
    if restart {
        cmd.env("JOURNAL_PAUSE_AT", "accepted");
    }
    let mut app = Proc::spawn(w.lab.app(1), &mut cmd)?;
    // The probe of a silent address takes the SDK's whole retry budget (about 3 s).
    let guard_check = app.wait_line("journal-server: guard check", Duration::from_secs(30)).map_err(|e| format!("app: {e}"))?;
    let listening = app.wait_line("journal-server: listening", Duration::from_secs(30)).map_err(|e| format!("app: {e}"))?;
    let service = w.service();
    let wait = Duration::from_secs(30);
    let control = m == Misconfig::None;
    let (peer, peer_ms) = if restart {
        let ns = w.lab.peer.clone();
        let peer = std::thread::spawn(move || lab::in_ns(&ns, move || peer_sees(service, wait, false)));
        app.wait_line("journal-server: paused at accepted", Duration::from_secs(10)).map_err(|e| format!("app: {e}"))?;
        guard.kill();
        guard = w.start_guard(&cfg)?;
        // The peer's retransmitted input meets the new guard, which cannot translate it: its
        // probe makes the application's TCP answer, and that answer is turned into a reset of
        // the socket the application has not told the guard about yet (getpeername then fails
        // on it; `establish` must still name it).
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let v = read_status(&w.status_path());
            if v["pid"].as_u64() == Some(guard.child.id() as u64) && v["counters"]["no_checkpoint_reset"].as_u64().unwrap_or(0) >= 1 {
                break;
            }
            if !matches!(guard.child.try_wait(), Ok(None)) || Instant::now() > end {
                return Err(format!("the new guard never reset the application's socket (status {v})"));
            }
            std::thread::sleep(Duration::from_millis(10)); // polling the status file with a deadline
        }
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(app.child.id() as i32, libc::SIGCONT) };
        peer.join().map_err(|_| "peer thread panicked".to_string())?.map_err(|e| format!("peer namespace: {e}"))?
    } else {
        lab::in_ns(&w.lab.peer, move || peer_sees(service, wait, control)).map_err(|e| format!("peer namespace: {e}"))?
    };
    let status = settled_status(&w.status_path(), &mut guard).unwrap_or(serde_json::Value::Null);
    drop(app);
    let app_log = std::fs::read_to_string(&log_path).unwrap_or_default();
    Ok(MisconfigReport { guard_check, listening, app_log, peer, peer_ms, peer_wait_ms: wait.as_millis() as u64, guard: status })
}

/// The peer's side of [`run_misconfigured`]: (what it saw, after how many ms).
fn peer_sees(service: SocketAddr, wait: Duration, control: bool) -> (String, u64) {
    use std::io::{ErrorKind, Read, Write};
    let start = Instant::now();
    let ms = |s: Instant| s.elapsed().as_millis() as u64;
    let mut s = match std::net::TcpStream::connect_timeout(&service, Duration::from_secs(10)) {
        Ok(s) => s,
        Err(e) => return (format!("connect failed: {e}"), ms(start)),
    };
    let mut buf = vec![0u8; 4096];
    if control {
        let rec = vec![7u8; unbroken_journal::RECORD_LEN];
        if let Err(e) = s.write_all(&rec) {
            return (format!("write failed: {e}"), ms(start));
        }
        let _ = s.set_read_timeout(Some(wait));
        let mut got = 0;
        while got < unbroken_journal::REPLY_LEN {
            match s.read(&mut buf) {
                Ok(0) => return ("eof".into(), ms(start)),
                Ok(n) => got += n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return ("hung".into(), ms(start)),
                Err(e) => return (format!("reset: {e}"), ms(start)),
            }
        }
        // Still open a while later (the server keeps a protected connection): a read times out.
        let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
        return match s.read(&mut buf) {
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => ("protected".into(), ms(start)),
            Ok(0) => ("eof".into(), ms(start)),
            Ok(_) => ("unexpected data".into(), ms(start)),
            Err(e) => (format!("reset: {e}"), ms(start)),
        };
    }
    // Input the application never reads: closing the connection with it unread would send a
    // RST instead of a FIN (the SDK's `decline` drains it).
    if let Err(e) = s.write_all(b"input the server will not read") {
        return (format!("write failed: {e}"), ms(start));
    }
    let _ = s.set_read_timeout(Some(wait));
    match s.read(&mut buf) {
        Ok(0) => ("eof".into(), ms(start)),
        Ok(_) => ("unexpected data".into(), ms(start)),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => ("hung".into(), ms(start)),
        Err(e) => (format!("reset: {e}"), ms(start)),
    }
}

/// How long a transfer may make no progress before its state is dumped (see `run_in`).
const STUCK_DUMP_AFTER: Duration = Duration::from_secs(20);

/// What a stuck transfer looks like from every side: `ss -tinoe` in the peer's and the
/// application host's namespaces, the guard's NFQUEUE statistics and its status counters.
fn stuck_diagnostics(w: &World, app_host: &str, verified: u64, total: u64) -> String {
    let mut out = format!("diagnostics: no progress for {STUCK_DUMP_AFTER:?} at {verified} of {total} bytes verified (app on {app_host})\n");
    let mut run = |ns: &str, what: &str, cmd: &mut Command| {
        let text = match lab::run(ns, cmd) {
            Ok(o) => String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr),
            Err(e) => format!("({e})"),
        };
        out.push_str(&format!("--- {what} in {ns}:\n{text}"));
    };
    for ns in [w.lab.peer.as_str(), app_host] {
        run(ns, "ss -tinoe", Command::new("ss").args(["-tinoe"]));
    }
    run(&w.lab.guard, "nfnetlink_queue", Command::new("cat").arg("/proc/net/netfilter/nfnetlink_queue"));
    out.push_str(&format!("--- guard status: {}\n", read_status(&w.status_path())));
    out
}

fn read_status(p: &Path) -> serde_json::Value {
    std::fs::read_to_string(p).ok().and_then(|s| serde_json::from_str(&s).ok()).unwrap_or(serde_json::Value::Null)
}

/// The guard's status as written after this call: the file is rewritten every 250 ms, so the
/// one on disk may predate the last packets and commands the guard handled. Waits (generous
/// deadline) for the next write, told apart by its pid and uptime.
fn fresh_status(p: &Path, guard: &mut Proc) -> Result<serde_json::Value, String> {
    let stamp = |v: &serde_json::Value| (v["pid"].as_u64(), v["uptime_ms"].as_u64());
    let before = stamp(&read_status(p));
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let v = read_status(p);
        if !v.is_null() && stamp(&v) != before {
            return Ok(v);
        }
        if !matches!(guard.child.try_wait(), Ok(None)) || Instant::now() > end {
            return Err(format!("the guard wrote no status file within 20 s (exit status {:?})", guard.child.try_wait()));
        }
        std::thread::sleep(Duration::from_millis(10)); // polling the status file with a deadline
    }
}

/// The guard's status once its counters stopped moving: two fresh writes in a row (250 ms
/// apart) with the same counters (generous deadline). The peer seeing the close does not mean
/// the guard is done with the connection (it releases it when the close completes): a single
/// fresh write could come before (`unprotected_released` read as 0 in one CI run).
fn settled_status(p: &Path, guard: &mut Proc) -> Result<serde_json::Value, String> {
    let end = Instant::now() + Duration::from_secs(20);
    let mut last = fresh_status(p, guard)?;
    loop {
        let v = fresh_status(p, guard)?;
        if v["counters"] == last["counters"] {
            return Ok(v);
        }
        if Instant::now() > end {
            return Err("the guard's counters kept moving for 20 s".into());
        }
        last = v;
    }
}

/// Runs a scenario end to end. Needs root (network namespaces); see [`lab::lab_available`].
pub fn run_checkpoint(s: &Scenario) -> Result<Report, String> {
    lab::lab_available()?;
    let opts = if s.heterogeneous { CheckpointOpts::heterogeneous() } else { CheckpointOpts::default() };
    let lab = Lab::checkpoint(opts).map_err(|e| format!("lab: {e}"))?;
    let dir = std::env::temp_dir().join(format!("unbroken-{}-{}", lab.prefix(), std::process::id()));
    std::fs::create_dir_all(dir.join("journal")).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut w = World { lab, dir: dir.clone(), exe: self_exe(), ipv6: s.ipv6, echo: s.echo, local_guard: s.local_guard, nudge: s.nudge, fast_path: s.fast_path };
    let res = run_in(&mut w, s);
    drop(w);
    let _ = std::fs::remove_dir_all(&dir);
    res
}

fn run_in(w: &mut World, s: &Scenario) -> Result<Report, String> {
    let start = Instant::now();
    if s.local_guard && s.crashes.contains(&Crash::Host) {
        return Err("a host crash takes a local guard along: use a gateway guard for host crashes".into());
    }
    let cfg = w.write_config()?;
    let mut guard = w.start_guard(&cfg)?;
    let mut app_host = w.lab.app(1).to_string();
    let mut app = w.start_app(&app_host, s.app_crash_point.as_deref())?;

    let nconn = s.connections.max(1);
    let (peer_tx, peer_lines) = channel::<(usize, String)>();
    let mut peers = Peers(Vec::new());
    for i in 0..nconn {
        let mut cmd = Command::new(&w.exe);
        cmd.arg("peer")
            .arg("--connect")
            .arg(w.service().to_string())
            .arg("--records")
            .arg(s.records.to_string())
            .arg("--seed")
            .arg((s.seed + i as u64).to_string())
            .arg("--rate")
            .arg(s.rate.to_string());
        if s.echo {
            cmd.arg("--echo");
        }
        let p = Proc::spawn(&w.lab.peer, &mut cmd)?;
        let tx = peer_tx.clone();
        let (child, lines) = p.into_parts();
        std::thread::spawn(move || {
            for l in lines.iter() {
                if tx.send((i, l)).is_err() {
                    break;
                }
            }
        });
        peers.0.push(child);
    }
    drop(peer_tx);
    let mut results: Vec<Option<PeerResult>> = vec![None; nconn];
    let mut stalls = Vec::new();
    let (hostile_tx, hostile_app_side) = channel();
    let hostile = s.hostile.then(|| hostile_traffic(w.lab.app(1).to_string(), w.lab.peer.clone(), w.guard_ctl(), w.service(), hostile_tx));
    let mut hostile_pending = s.hostile;
    let forger = if s.forge_app_source {
        if s.local_guard {
            return Err("forge_app_source needs a gateway guard".into());
        }
        let guard_mac = w.lab.mac(&w.lab.guard, lab::dev::GUARD_WAN).map_err(|e| format!("guard MAC: {e}"))?;
        Some(forge_app_source(w.lab.peer.clone(), w.service(), guard_mac))
    } else {
        None
    };
    let forged = s.hostile.then(|| forged_peer_traffic(w.lab.peer.clone(), w.service()));

    let unit = if s.echo { unbroken_journal::RECORD_LEN } else { unbroken_journal::REPLY_LEN };
    let total = s.records * unit as u64;
    let n = s.crashes.len() as u64;
    let thresholds: Vec<u64> = match &s.crash_at {
        Some(f) if f.len() == s.crashes.len() => f.iter().map(|x| (total as f64 * x.clamp(0.0, 1.0)) as u64).collect(),
        Some(_) => return Err("crash_at needs one fraction per crash".into()),
        None => (1..=n).map(|i| total * i / (n + 1)).collect(),
    };
    let mut self_crashes = 0usize;
    let mut next = 0usize;
    let mut log = Vec::new();
    let mut last_verified = 0;
    let deadline = start + s.timeout;
    // A transfer that stops moving is dumped once, while it is still stuck (the peer reports
    // the hang only after its idle timeout and then closes): the sockets on both ends, the
    // guard's queue and counters. Issue 21 item 1's hang left nothing else to read.
    let mut moved_at = (Instant::now(), 0u64);
    let mut dumped = false;
    loop {
        if last_verified != moved_at.1 {
            moved_at = (Instant::now(), last_verified);
        } else if !dumped && moved_at.0.elapsed() >= STUCK_DUMP_AFTER {
            dumped = true;
            eprintln!("{}", stuck_diagnostics(w, &app_host, last_verified, total));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("scenario timed out after {:?} at {} of {} bytes verified", s.timeout, last_verified, total));
        }
        // An application that crashed itself at its injection point is restarted on its host.
        if let Ok(Some(_)) = app.child.try_wait() {
            if s.app_crash_point.is_some() && self_crashes == 0 {
                self_crashes += 1;
                app = w.start_app(&app_host, None)?;
                log.push(CrashRecord { kind: Crash::App, point: s.app_crash_point.clone(), at_bytes_verified: last_verified, t_ms: start.elapsed().as_millis() as u64, app_host: app_host.clone() });
            } else {
                return Err(format!("the application exited unexpectedly: {:?}", app.child.try_wait()));
            }
        }
        let (from, line) = match peer_lines.recv_timeout(left.min(Duration::from_millis(50))) {
            Ok(l) => l,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
            Err(_) => {
                let missing: Vec<usize> = (0..nconn).filter(|i| results[*i].is_none()).collect();
                return Err(format!("peer(s) {missing:?} exited without a result (status {:?})", missing.iter().map(|i| peers.0[*i].try_wait().ok().flatten()).collect::<Vec<_>>()));
            }
        };
        let v: serde_json::Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(_) => continue,
        };
        if let Some(st) = v.get("stall") {
            stalls.push(Stall { conn: from, ms: st["ms"].as_u64().unwrap_or(0), end_t_ms: start.elapsed().as_millis() as u64, at_bytes: st["at_bytes"].as_u64().unwrap_or(0) });
        } else if let (Some(p), 0) = (v.get("progress"), from) {
            last_verified = p["bytes_verified"].as_u64().unwrap_or(0);
            if s.live {
                eprint!("\r  {:>6.1} s  verified {:>12} / {} bytes  crashes {}/{}  longest stall {} ms   ", start.elapsed().as_secs_f64(), last_verified, total, next, n, p["max_stall_ms"]);
            }
            while next < thresholds.len() && last_verified >= thresholds[next] {
                let kind = s.crashes[next];
                // The hostile sender's datagrams from the app host must all have reached the
                // guard before that host loses power or the guard (and its counters) restarts.
                if hostile_pending && matches!(kind, Crash::Host | Crash::Guard | Crash::GuardAndApp) {
                    let _ = hostile_app_side.recv_timeout(Duration::from_secs(120));
                    hostile_pending = false;
                }
                match kind {
                    Crash::App => {
                        app.kill();
                        app = w.start_app(&app_host, None)?;
                    }
                    Crash::Host => {
                        let from = app_host.clone();
                        let to = w.lab.apps.iter().find(|a| **a != from).cloned().ok_or("a second app host is needed")?;
                        w.lab.crash_host(&from).map_err(|e| format!("crash {from}: {e}"))?;
                        app.kill();
                        w.lab.move_service_ip(&from, &to).map_err(|e| format!("move service address to {to}: {e}"))?;
                        app_host = to;
                        app = w.start_app(&app_host, None)?;
                    }
                    Crash::Guard => {
                        guard.kill();
                        guard = w.start_guard(&cfg)?;
                    }
                    Crash::GuardAndApp => {
                        guard.kill();
                        app.kill();
                        guard = w.start_guard(&cfg)?;
                        app = w.start_app(&app_host, None)?;
                    }
                    Crash::AppDuringRecovery => {
                        app.kill();
                        let mut dying = w.start_app_at(&app_host, "recovered", false)?;
                        dying.kill();
                        app = w.start_app(&app_host, None)?;
                    }
                    Crash::GuardDuringRecovery => {
                        app.kill();
                        app = w.start_app_at(&app_host, "recovered", true)?;
                        guard.kill();
                        guard = w.start_guard(&cfg)?;
                        // SAFETY: a signal to our own child.
                        unsafe { libc::kill(app.child.id() as i32, libc::SIGCONT) };
                    }
                    Crash::GuardHangup => {
                        let before = read_status(&w.status_path())["sighup_ignored"].as_u64().unwrap_or(0);
                        // SAFETY: a signal to our own child.
                        unsafe { libc::kill(guard.child.id() as i32, libc::SIGHUP) };
                        let end = Instant::now() + Duration::from_secs(10);
                        while read_status(&w.status_path())["sighup_ignored"].as_u64().unwrap_or(0) <= before {
                            if !matches!(guard.child.try_wait(), Ok(None)) || Instant::now() > end {
                                return Err(format!("SIGHUP: the guard did not count it (exit status {:?})", guard.child.try_wait()));
                            }
                            std::thread::sleep(Duration::from_millis(10)); // polling the status file with a deadline
                        }
                    }
                }
                log.push(CrashRecord { kind, point: None, at_bytes_verified: last_verified, t_ms: start.elapsed().as_millis() as u64, app_host: app_host.clone() });
                next += 1;
            }
        } else if v.get("ok").is_some() {
            results[from] = Some(serde_json::from_value(v).map_err(|e| format!("peer result: {e}"))?);
            if results.iter().all(Option::is_some) {
                break;
            }
        }
    }
    let results: Vec<PeerResult> = results.into_iter().flatten().collect();
    if s.live {
        eprintln!();
    }
    let codes: Vec<Option<i32>> = peers.0.iter_mut().map(|c| c.wait().ok().and_then(|st| st.code())).collect();
    let peer_exit_code = codes.iter().copied().find(|c| *c != Some(0)).unwrap_or(Some(0));
    let result = PeerResult {
        ok: results.iter().all(|r| r.ok),
        error: results.iter().enumerate().find_map(|(i, r)| r.error.as_ref().map(|e| if nconn > 1 { format!("connection {i}: {e}") } else { e.clone() })),
        records: results.iter().map(|r| r.records).sum(),
        bytes_sent: results.iter().map(|r| r.bytes_sent).sum(),
        bytes_received: results.iter().map(|r| r.bytes_received).sum(),
        bytes_verified: results.iter().map(|r| r.bytes_verified).sum(),
        sha256_received: String::new(),
        sha256_expected: String::new(),
        max_stall_ms: results.iter().map(|r| r.max_stall_ms).max().unwrap_or(0),
        duration_ms: results.iter().map(|r| r.duration_ms).max().unwrap_or(0),
    };
    let sha256_ok = results.iter().all(|r| r.sha256_received == r.sha256_expected && r.bytes_verified == total);
    if let Some(h) = hostile {
        h.join().map_err(|_| "hostile traffic thread panicked".to_string())??;
    }
    if let Some(h) = forged {
        h.join().map_err(|_| "forged peer traffic thread panicked".to_string())??;
    }
    // A self-crash at a late point (after-fin) may come after the peer's last progress line.
    if s.app_crash_point.is_some() && self_crashes == 0 {
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end && matches!(app.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(10)); // polling a child's exit with a deadline
        }
        if let Ok(Some(_)) = app.child.try_wait() {
            log.push(CrashRecord { kind: Crash::App, point: s.app_crash_point.clone(), at_bytes_verified: last_verified, t_ms: start.elapsed().as_millis() as u64, app_host: app_host.clone() });
        }
    }
    let forged_sent = match forger {
        Some(h) => h.join().map_err(|_| "forging thread panicked".to_string())??,
        None => 0,
    };
    let forged_dropped = if s.forge_app_source { rule_drops(&w.lab.guard)? } else { 0 };
    let rsts = lab::rsts_seen(&w.lab.peer).map_err(|e| format!("rst counter: {e}"))?;
    if !matches!(guard.child.try_wait(), Ok(None)) {
        return Err(format!("the guard exited during the transfer: {:?}", guard.child.try_wait()));
    }
    // The guard reads its rules' counters once a second: wait (generous deadline) until its
    // status shows every forged packet the rules dropped.
    if forged_dropped > 0 {
        let end = Instant::now() + Duration::from_secs(20);
        while read_status(&w.status_path())["forged_source_dropped"].as_u64().unwrap_or(0) < forged_dropped && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(20)); // polling the status file with a deadline
        }
    }
    let status = fresh_status(&w.status_path(), &mut guard)?;
    drop(app);
    drop(guard);
    let crashes_done = log.len();
    let crashes_wanted = s.crashes.len() + s.app_crash_point.is_some() as usize;
    let ok = result.ok && rsts == 0 && crashes_done == crashes_wanted && peer_exit_code == Some(0);
    let error = if !result.ok {
        result.error.clone()
    } else if rsts != 0 {
        Some(format!("{rsts} RST(s) reached the peer"))
    } else if crashes_done != crashes_wanted {
        Some(format!("only {crashes_done} of {crashes_wanted} crashes were injected before the transfer ended"))
    } else if peer_exit_code != Some(0) {
        Some(format!("the peer exited with {peer_exit_code:?}"))
    } else {
        None
    };
    Ok(Report {
        ok,
        error,
        crashes: crashes_done,
        crash_log: log,
        bytes_sent: result.bytes_sent,
        bytes_received: result.bytes_received,
        bytes_verified: result.bytes_verified,
        sha256_ok,
        resets_seen_by_peer: rsts,
        max_stall_ms: result.max_stall_ms,
        duration_ms: start.elapsed().as_millis() as u64,
        peer_exit_code,
        peer: results.first().cloned(),
        peers: if nconn > 1 { results } else { Vec::new() },
        connections: nconn,
        stalls,
        peer_tcp: tcp_counters(&w.lab.peer),
        guard: status,
        forged_sent,
        forged_dropped,
    })
}

/// Packets the DROP rules of the guard's chain dropped (in namespace `ns`).
fn rule_drops(ns: &str) -> Result<u64, String> {
    let chain = format!("UNBROKEN-Q{QUEUE}");
    let out = lab::run(ns, Command::new("iptables").args(["-w", "-t", "mangle", "-L", &chain, "-v", "-x", "-n"])).map_err(|e| format!("iptables: {e}"))?;
    if !out.status.success() {
        return Err(format!("iptables -L {chain}: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(2) == Some(&"DROP")).then(|| f[0].parse::<u64>().ok()).flatten()
        })
        .sum())
}

/// An attacker on the peer's side of a gateway guard (IPv4): once the peer's connection to
/// `service` is established, sends the guard (link layer, to `guard_mac` on the peer's
/// segment) 100 SYNs and 100 data segments with the service's address and port as source and
/// the peer's end of the live connection as destination, as the application would send them:
/// a forged recovery SYN would re-key the connection, a forged segment would be renumbered as
/// the application's. Returns how many were sent (0 for an IPv6 service: not covered).
pub fn forge_app_source(peer_ns: String, service: SocketAddr, guard_mac: [u8; 6]) -> std::thread::JoinHandle<Result<u64, String>> {
    std::thread::spawn(move || {
        let IpAddr::V4(src) = service.ip() else { return Ok(0) };
        // The peer's end of the live connection.
        let end = Instant::now() + Duration::from_secs(30);
        let peer = loop {
            let out = lab::run(&peer_ns, Command::new("ss").args(["-Htn", "state", "established"])).map_err(|e| format!("ss: {e}"))?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let found = text.lines().find_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                let local: SocketAddr = f.get(2)?.parse().ok()?;
                let remote: SocketAddr = f.get(3)?.parse().ok()?;
                (remote == service).then_some(local)
            });
            if let Some(p) = found {
                break p;
            }
            if Instant::now() > end {
                return Err("forging: the peer had no connection to the service within 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(20)); // polling for the connection with a deadline
        };
        let IpAddr::V4(dst) = peer.ip() else { return Ok(0) };
        lab::in_ns(&peer_ns, || -> std::io::Result<u64> {
            let ifname = std::ffi::CString::new(lab::dev::PEER).expect("name");
            // SAFETY: a valid NUL-terminated name.
            let ifindex = unsafe { libc::if_nametoindex(ifname.as_ptr()) };
            if ifindex == 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: plain syscall; the descriptor is owned right away.
            let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, (libc::ETH_P_IP as u16).to_be() as i32) };
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
            // SAFETY: sockaddr_ll is plain data.
            let mut sa: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            sa.sll_family = libc::AF_PACKET as u16;
            sa.sll_protocol = (libc::ETH_P_IP as u16).to_be();
            sa.sll_ifindex = ifindex as i32;
            sa.sll_halen = 6;
            sa.sll_addr[..6].copy_from_slice(&guard_mac);
            let mut n = 0;
            let mut x: u32 = 0x2545_f491;
            for i in 0..200u32 {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                let syn = i % 2 == 0;
                let data: &[u8] = if syn { b"" } else { b"forged bytes 0123" };
                let tcp_len = 20 + data.len();
                let mut b = vec![0u8; 20 + tcp_len];
                unbroken_wire::ipv4::emit_header(&mut b, src.octets(), dst.octets(), 6, tcp_len);
                let t = &mut b[20..];
                t[0..2].copy_from_slice(&service.port().to_be_bytes());
                t[2..4].copy_from_slice(&peer.port().to_be_bytes());
                t[4..8].copy_from_slice(&x.to_be_bytes());
                t[8..12].copy_from_slice(&x.rotate_left(7).to_be_bytes());
                t[12] = 5 << 4;
                t[13] = if syn { 0x02 } else { 0x18 };
                t[14..16].copy_from_slice(&65535u16.to_be_bytes());
                t[20..].copy_from_slice(data);
                unbroken_wire::tcp::Packet::new_checked(&mut t[..]).map_err(std::io::Error::other)?.fill_checksum(unbroken_wire::checksum::pseudo_v4(src.octets(), dst.octets(), 6, tcp_len as u32));
                // SAFETY: `b` and `sa` are live for the call.
                let r = unsafe { libc::sendto(std::os::fd::AsRawFd::as_raw_fd(&sock), b.as_ptr().cast(), b.len(), 0, (&sa as *const libc::sockaddr_ll).cast(), std::mem::size_of::<libc::sockaddr_ll>() as u32) };
                if r < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                n += 1;
            }
            Ok(n)
        })
        .and_then(|r| r)
        .map_err(|e| format!("forging: {e}"))
    })
}

/// Blind forgeries on the protected connection's own 4-tuple (issue 9, item 2), from the peer's
/// namespace while the transfer runs: the forger knows the addresses and ports (it reads them
/// from the peer's socket table, as anyone on the path's wire side could) but not the sequence
/// numbers. Five rounds, 50 ms apart, each of: SYNs, SYN-ACKs, RSTs, FINs and ACKs with random
/// SEQ and ACK, and ACKs with a broken checksum. IPv4 only (a raw IPPROTO_RAW socket). Returns how
/// many packets were sent (0 if the connection was not found within 30 s).
pub fn forged_peer_traffic(peer_ns: String, service: SocketAddr) -> std::thread::JoinHandle<Result<u64, String>> {
    std::thread::spawn(move || {
        let (IpAddr::V4(dst), true) = (service.ip(), true) else { return Ok(0) };
        let res = lab::in_ns(&peer_ns, move || -> std::io::Result<u64> {
            // The connection's local address and port: /proc/net/tcp, ESTABLISHED (01), remote
            // = the service.
            let want = format!("{:08X}:{:04X}", u32::from_le_bytes(dst.octets()), service.port());
            let end = Instant::now() + Duration::from_secs(30);
            let (src, sport) = loop {
                let table = std::fs::read_to_string("/proc/thread-self/net/tcp").unwrap_or_default();
                let found = table.lines().skip(1).find_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    if f.len() > 3 && f[2] == want && f[3] == "01" {
                        let (a, p) = f[1].split_once(':')?;
                        let a = u32::from_str_radix(a, 16).ok()?.to_le_bytes();
                        Some((std::net::Ipv4Addr::from(a), u16::from_str_radix(p, 16).ok()?))
                    } else {
                        None
                    }
                });
                if let Some(x) = found {
                    break x;
                }
                if Instant::now() > end {
                    return Ok(0);
                }
                std::thread::sleep(Duration::from_millis(20)); // polling the socket table with a deadline
            };
            let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
            let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
            let mut rnd = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u32
            };
            use unbroken_wire::tcp::flags as F;
            let mut n = 0;
            for round in 0..5 {
                if round > 0 {
                    std::thread::sleep(Duration::from_millis(50)); // pacing the rounds over the transfer
                }
                for (flags, bad_csum) in [(F::SYN, false), (F::SYN | F::ACK, false), (F::RST, false), (F::FIN | F::ACK, false), (F::ACK, false), (F::ACK, true)] {
                    for _ in 0..50 {
                        let r = unbroken_wire::tcp::Repr { src_port: sport, dst_port: service.port(), seq: unbroken_wire::Seq(rnd()), ack: unbroken_wire::Seq(if flags & F::ACK != 0 { rnd() } else { 0 }), flags, window: 1000, ..Default::default() };
                        let mut pkt = unbroken_wire::ip::tcp_packet(IpAddr::V4(src), IpAddr::V4(dst), &r, b"").map_err(std::io::Error::other)?;
                        if bad_csum {
                            pkt[20 + 16] ^= 0x5a;
                        }
                        let sa = libc::sockaddr_in { sin_family: libc::AF_INET as u16, sin_port: 0, sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(dst.octets()) }, sin_zero: [0; 8] };
                        let r = unsafe { libc::sendto(std::os::fd::AsRawFd::as_raw_fd(&sock), pkt.as_ptr().cast(), pkt.len(), 0, (&sa as *const libc::sockaddr_in).cast(), std::mem::size_of::<libc::sockaddr_in>() as u32) };
                        if r < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        n += 1;
                    }
                }
            }
            Ok(n)
        });
        res.and_then(|r| r).map_err(|e| format!("forged peer traffic: {e}"))
    })
}

/// Hostile input for the guard while a protected transfer runs; returns how many datagrams and
/// packets were sent. From an allowed source (the app host): garbage datagrams, commands under
/// a wrong key, stale commands, and one TELL replayed 200 times. From the peer's side (not an
/// allowed source): correctly keyed CLEARs for the service, the way an insider holding the key
/// but sitting in the wrong place would try to kill connections. And TCP segments toward the
/// service with a malformed option (MSS of length 0), which pass iptables' tcp match and reach
/// the engine.
///
/// Refused datagrams get no answer, and a burst of thousands overflows the guard's socket buffer
/// when its command thread is slow (the kernel drops them silently): so the datagrams go in
/// batches, each followed by a keyed probe from the app host (a TELL for a connection that does
/// not exist) whose answer shows the guard has handled everything sent before it. The replayed
/// TELL is sent only once the guard answered the original. `app_side_done` is told when nothing
/// more will be sent from the app host (a host crash of it must wait for that).
pub fn hostile_traffic(app_ns: String, peer_ns: String, guard: SocketAddr, service: SocketAddr, app_side_done: std::sync::mpsc::Sender<()>) -> std::thread::JoinHandle<Result<u64, String>> {
    use std::net::UdpSocket;
    use unbroken_wire::ctl::{Command, Key, Op};
    std::thread::spawn(move || {
        let key = Key::from_hex(KEY_HEX).map_err(|e| e.to_string())?;
        let wrong = Key::from_hex("00112233445566778899aabbccddeeff").map_err(|e| e.to_string())?;
        let now = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
        let peer_ip: IpAddr = if service.is_ipv4() { addr::PEER_V4.into() } else { addr::PEER_V6.into() };
        let any = if service.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
        let io = |what: &'static str| move |e: std::io::Error| format!("hostile traffic ({what}): {e}");
        // Sockets keep the namespace they were made in.
        let inside = lab::in_ns(&app_ns, || UdpSocket::bind(any)).and_then(|r| r).map_err(io("app side"))?;
        let outside = lab::in_ns(&peer_ns, || UdpSocket::bind(any)).and_then(|r| r).map_err(io("peer side"))?;
        inside.set_read_timeout(Some(Duration::from_millis(500))).map_err(io("app side"))?;
        let mut nonce = 1u64 << 62;
        // Sends a fresh keyed TELL for a connection that does not exist and waits for its answer
        // (resent with a new nonce when none came), within a generous deadline.
        let mut probe = |s: &UdpSocket| -> Result<(), String> {
            let end = Instant::now() + Duration::from_secs(60);
            while Instant::now() < end {
                nonce += 1;
                let c = Command::request(Op::Tell, service, SocketAddr::new(peer_ip, 2), nonce, now()).encode(&key).map_err(|e| e.to_string())?;
                s.send_to(&c, guard).map_err(io("probe"))?;
                let mut b = [0u8; 256];
                while let Ok((n, _)) = s.recv_from(&mut b) {
                    if Command::decode(&b[..n], &key).is_ok_and(|r| r.response && r.nonce == nonce) {
                        return Ok(());
                    }
                }
            }
            Err("hostile traffic: the guard answered no probe within 60 s".into())
        };
        let mut n = 0;
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for i in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let junk: Vec<u8> = (0..(x % 200) as usize).map(|k| (x >> (k % 56)) as u8).collect();
            let fake = SocketAddr::new(peer_ip, 1 + (x % 60000) as u16);
            let wrong_key = Command::request(Op::Clear, service, fake, x, now()).encode(&wrong).map_err(|e| e.to_string())?;
            let stale = Command::request(Op::Shutdown, service, fake, x ^ 1, now() - 120_000).encode(&key).map_err(|e| e.to_string())?;
            for d in [&junk[..], &wrong_key[..], &stale[..]] {
                inside.send_to(d, guard).map_err(io("app side"))?;
                n += 1;
            }
            if i % 16 == 15 {
                probe(&inside)?;
            }
        }
        // The original TELL is answered (no such connection) after its nonce was recorded.
        let tell = Command::request(Op::Tell, service, SocketAddr::new(peer_ip, 1), 42, now()).encode(&key).map_err(|e| e.to_string())?;
        let end = Instant::now() + Duration::from_secs(60);
        'answered: loop {
            inside.send_to(&tell, guard).map_err(io("app side"))?;
            n += 1;
            let mut b = [0u8; 256];
            while let Ok((k, _)) = inside.recv_from(&mut b) {
                if Command::decode(&b[..k], &key).is_ok_and(|r| r.response && r.nonce == 42) {
                    break 'answered;
                }
            }
            if Instant::now() > end {
                return Err("hostile traffic: the guard never answered the TELL to be replayed".into());
            }
        }
        for i in 0..200 {
            inside.send_to(&tell, guard).map_err(io("app side"))?;
            n += 1;
            if i % 32 == 31 {
                probe(&inside)?;
            }
        }
        probe(&inside)?;
        let mut p = 0u16;
        while p < 500 {
            let c = Command::request(Op::Clear, service, SocketAddr::new(peer_ip, 1024 + p), 7000 + p as u64, now()).encode(&key).map_err(|e| e.to_string())?;
            outside.send_to(&c, guard).map_err(io("peer side"))?;
            n += 1;
            p += 1;
            if p % 32 == 0 {
                probe(&inside)?;
            }
        }
        probe(&inside)?;
        let _ = app_side_done.send(());
        // Malformed TCP options toward the service (IPv4 only: a raw IPPROTO_RAW socket).
        let raw = lab::in_ns(&peer_ns, || -> std::io::Result<u64> {
            let mut n = 0;
            if let (IpAddr::V4(src), IpAddr::V4(dst)) = (peer_ip, service.ip()) {
                let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
                for p in 0..500u16 {
                    let mut b = [0u8; 44];
                    unbroken_wire::ipv4::emit_header(&mut b, src.octets(), dst.octets(), 6, 24);
                    let t = &mut b[20..];
                    t[0..2].copy_from_slice(&(20000 + p).to_be_bytes());
                    t[2..4].copy_from_slice(&service.port().to_be_bytes());
                    t[12] = 6 << 4; // 24-byte header: 4 bytes of options
                    t[13] = 0x10; // ACK
                    t[14..16].copy_from_slice(&1000u16.to_be_bytes());
                    t[20..24].copy_from_slice(&[2, 0, 0, 0]); // MSS with length 0: malformed
                    unbroken_wire::tcp::Packet::new_checked(&mut t[..]).map_err(std::io::Error::other)?.fill_checksum(unbroken_wire::checksum::pseudo_v4(src.octets(), dst.octets(), 6, 24));
                    let sa = libc::sockaddr_in { sin_family: libc::AF_INET as u16, sin_port: 0, sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(dst.octets()) }, sin_zero: [0; 8] };
                    let r = unsafe { libc::sendto(std::os::fd::AsRawFd::as_raw_fd(&sock), b.as_ptr().cast(), b.len(), 0, (&sa as *const libc::sockaddr_in).cast(), std::mem::size_of::<libc::sockaddr_in>() as u32) };
                    if r < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    n += 1;
                }
            }
            Ok(n)
        });
        let b = raw.and_then(|r| r).map_err(io("peer side"))?;
        Ok(n + b)
    })
}
