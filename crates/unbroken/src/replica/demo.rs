//! Replica mode end to end in the lab (issue 10 items 4 and 5): an unmodified redis-server on
//! the primary and on the backup of a [`ReplicaLab`] segment, `unbroken replica` on each, and
//! unmodified clients (redis-py, redis-cli, redis-benchmark) in the client namespace, beside our
//! own verifying client of large values ([`crate::replica::client`]).
//! [`ReplicaEnv`] is the running system (used by `unbroken demo replica` and the namespace tests
//! in `tests/replica_lab.rs`); [`run_replica`] is the demo: the primary host dies while the
//! clients run.
//!
//! Each redis-server listens on the service address (the replicated service) and on its host's
//! own address: the harness reads and writes a server's state through the host address, from the
//! client namespace, outside the replicated service and outside the daemons' rules (the backup's
//! server is otherwise unreachable: its answers on the service address are withheld).
//!
//! Fencing in the lab: each side's `fence_command` sets the other host's port of the switch down
//! (`ip -n <lan> link set dev <port> down`), only while its own port is up and under one lock (see
//! [`ReplicaEnv::fence_command`]); the namespace names are in the command and in the daemon's
//! environment (`UNBROKEN_LAB_LAN`, `UNBROKEN_LAB_PRIMARY`, `UNBROKEN_LAB_BACKUP`).
//! The run directory (configs, key, status files, daemon and redis logs) is removed on drop,
//! kept with `UNBROKEN_KEEP=1`.

use serde::Serialize;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use unbroken_lab::lab::{self, dev};
use unbroken_lab::replicalab::{addr, ReplicaLab};

/// The replicated service's port.
pub const REDIS_PORT: u16 = 6379;
/// The daemons' NFQUEUE number.
pub const QUEUE: u16 = 9;
/// The side channel's UDP port on each host.
pub const SIDE_PORT: u16 = 7790;
/// The lab's shared side-channel key (hex).
pub const KEY_HEX: &str = "6c61622d7265706c6963612d6b657921";
const CLIENT_PY: &str = include_str!("redis_incr.py");
/// The test table of [`ReplicaEnv::drop_backup_input`].
const LOSS_TABLE: &str = "unbroken-test-loss";

/// One of the two servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Primary,
    Backup,
}

impl Side {
    /// `primary` / `backup`: the role, the file names and the host's port of the switch.
    pub fn name(self) -> &'static str {
        match self {
            Side::Primary => "primary",
            Side::Backup => "backup",
        }
    }

    pub fn other(self) -> Side {
        match self {
            Side::Primary => Side::Backup,
            Side::Backup => Side::Primary,
        }
    }

    /// The host's own address.
    pub fn host_addr(self) -> std::net::Ipv4Addr {
        match self {
            Side::Primary => addr::PRIMARY_V4,
            Side::Backup => addr::BACKUP_V4,
        }
    }

    fn idx(self) -> usize {
        self as usize
    }
}

/// Options of [`ReplicaEnv::start`].
#[derive(Debug, Clone)]
pub struct RepOpts {
    /// The `unbroken` binary (the daemons run as processes of it).
    pub bin: PathBuf,
    pub strict: bool,
    pub heartbeat_interval_ms: u64,
    pub missed_beats: u64,
    pub max_lag_bytes: u64,
    pub max_lag_ms: u64,
    pub max_delay_fin_ms: u64,
    pub fence_timeout_ms: u64,
    /// Redis commands (one argument vector each) run against a side's server through its host
    /// address before the daemons start (state that differs between the two servers).
    pub preload: Vec<(Side, Vec<String>)>,
    /// Start the daemons (false only to check the harness itself: the harness then installs
    /// the backup's ARP suppression on its own).
    pub daemons: bool,
    /// Bound on each start-up step (ready line, `protecting`).
    pub start_timeout: Duration,
    /// More ports of the service address the daemons replicate beside redis's (a `[[service]]`
    /// each; the caller runs its own servers on them, e.g. `unbroken bench replica`).
    pub extra_ports: Vec<u16>,
    /// Leave the beats and the lag bounds (`heartbeat_interval_ms`, `missed_beats`,
    /// `max_lag_bytes`, `max_lag_ms`, `max_delay_fin_ms`) out of the configs: the daemon's own
    /// defaults apply, as for an operator who keeps them (`unbroken demo replica --chaos`).
    pub daemon_defaults: bool,
    /// The daemons' `fast_path` (issue 22 item 4): on unless the environment says
    /// `UNBROKEN_FAST_PATH=0`, so that every lab test and demo runs on either path (the
    /// daemon's own default is off; the primary says why it stays off).
    pub fast_path: bool,
}

/// `UNBROKEN_FAST_PATH=0` turns the daemons' fast path off in every lab run (default on).
pub fn fast_path_default() -> bool {
    std::env::var("UNBROKEN_FAST_PATH").map_or(true, |v| v != "0")
}

impl Default for RepOpts {
    fn default() -> Self {
        RepOpts {
            bin: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("unbroken")),
            strict: true,
            heartbeat_interval_ms: 10,
            missed_beats: 10,
            max_lag_bytes: 4 << 20,
            max_lag_ms: 5000,
            max_delay_fin_ms: 5000,
            fence_timeout_ms: 5000,
            preload: Vec::new(),
            daemons: true,
            start_timeout: Duration::from_secs(20),
            extra_ports: Vec::new(),
            daemon_defaults: false,
            fast_path: fast_path_default(),
        }
    }
}

/// The client's RST log ([`ReplicaEnv::log_client_rsts`]) and how many lines it keeps.
const RST_LOG: &str = "client-rsts.txt";
const RST_LOG_MAX: u32 = 50;

fn err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// The running replica-mode system.
pub struct ReplicaEnv {
    pub lab: ReplicaLab,
    pub dir: PathBuf,
    pub opts: RepOpts,
    redis: [Option<Child>; 2],
    daemons: [Option<Child>; 2],
    /// Without daemons: the harness's own suppression of the backup's ARP.
    suppress: Option<unbroken_drivers::segment::ArpSuppress>,
    /// `UNBROKEN_PCAP=1`: tcpdump on the client's and the backup's links (headers only) into
    /// `dir/client.pcap` and `dir/backup.pcap` (kept with `UNBROKEN_KEEP=1`).
    pcap: Vec<Child>,
}

impl Drop for ReplicaEnv {
    fn drop(&mut self) {
        for mut p in self.pcap.drain(..) {
            // SAFETY: a signal to our own child (tcpdump flushes and exits on SIGINT).
            unsafe { libc::kill(p.id() as i32, libc::SIGINT) };
            let _ = p.wait();
        }
        for c in self.daemons.iter_mut().chain(self.redis.iter_mut()) {
            if let Some(mut c) = c.take() {
                // SIGKILL ends a stopped (SIGSTOP) redis too.
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        drop(self.suppress.take());
        if std::env::var_os("UNBROKEN_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("kept {}", self.dir.display());
        }
        // The lab (a field) deletes the namespaces after this, killing whatever is left.
    }
}

/// What is missing on this machine for the replica lab (tools and the redis-py module), if
/// anything.
pub fn tools_missing() -> Option<String> {
    let mut missing = Vec::new();
    for tool in ["redis-server", "redis-cli", "redis-benchmark", "nft", "iptables"] {
        let found = Command::new(tool).arg("--version").stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok();
        if !found {
            missing.push(format!("`{tool}`"));
        }
    }
    let py = Command::new(python()).args(["-c", "import redis"]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).status();
    if !py.is_ok_and(|s| s.success()) {
        missing.push(format!("the redis-py module for {} (Debian package python3-redis)", python()));
    }
    (!missing.is_empty()).then(|| format!("not installed: {}", missing.join(", ")))
}

/// The Python that has redis-py: the system's (Debian's python3-redis), not a user's shim.
pub fn python() -> &'static str {
    if Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3"
    } else {
        "python3"
    }
}

impl ReplicaEnv {
    /// Builds the segment, starts both redis servers and both daemons; returns once both
    /// daemons report `protecting`.
    pub fn start(opts: RepOpts) -> io::Result<ReplicaEnv> {
        let lab = ReplicaLab::build()?;
        let dir = std::env::temp_dir().join(format!("unbroken-rep-{}", lab.lab.prefix()));
        std::fs::create_dir_all(&dir)?;
        let mut env = ReplicaEnv { lab, dir, opts, redis: [None, None], daemons: [None, None], suppress: None, pcap: Vec::new() };
        {
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(env.key_path())?;
            f.write_all(KEY_HEX.as_bytes())?;
        }
        std::fs::write(env.dir.join("redis_incr.py"), CLIENT_PY)?;
        for side in [Side::Primary, Side::Backup] {
            std::fs::write(env.config_path(side), env.config_toml(side))?;
        }
        lab::install_rst_counter(&env.lab.client)?;
        env.pcap.extend(env.log_client_rsts());
        if std::env::var("UNBROKEN_PCAP").is_ok_and(|v| v == "1") {
            for (ns, name) in [(env.lab.client.clone(), "client"), (env.lab.backup.clone(), "backup")] {
                if let Ok(c) = lab::spawn(&ns, Command::new("tcpdump").args(["-i", dev::APP, "-s", "128", "-U", "-w"]).arg(env.dir.join(format!("{name}.pcap"))).stdout(Stdio::null()).stderr(Stdio::null())) {
                    env.pcap.push(c);
                }
            }
        }
        env.start_redis(Side::Primary)?;
        let t = env.opts.start_timeout;
        if env.opts.daemons {
            env.start_daemon(Side::Primary)?;
            env.start_daemon(Side::Backup)?;
        } else {
            let mut spec = unbroken_drivers::segment::ArpSuppressSpec::new(dev::APP, addr::SERVICE_V4);
            spec.netns = Some(env.lab.backup.clone());
            env.suppress = Some(unbroken_drivers::segment::ArpSuppress::install(&spec)?);
        }
        env.lab.add_backup_service_ip()?;
        env.start_redis(Side::Backup)?;
        for (side, args) in env.opts.preload.clone() {
            env.redis_cli(side, &args.iter().map(String::as_str).collect::<Vec<_>>())?;
        }
        if env.opts.daemons {
            for side in [Side::Primary, Side::Backup] {
                env.wait_state(side, &["protecting"], t).map_err(err)?;
            }
        }
        Ok(env)
    }

    pub fn key_path(&self) -> PathBuf {
        self.dir.join("key")
    }

    pub fn config_path(&self, side: Side) -> PathBuf {
        self.dir.join(format!("{}.toml", side.name()))
    }

    pub fn status_path(&self, side: Side) -> PathBuf {
        self.dir.join(format!("{}.json", side.name()))
    }

    pub fn log_path(&self, side: Side) -> PathBuf {
        self.dir.join(format!("{}.log", side.name()))
    }

    /// The namespace of `side`.
    pub fn ns(&self, side: Side) -> &str {
        match side {
            Side::Primary => &self.lab.primary,
            Side::Backup => &self.lab.backup,
        }
    }

    /// The command that fences the other side: its port of the switch goes down, but only
    /// while this side's own port is up, under one lock for both sides. A switch's management
    /// (or a power switch) is reached over the network: a host already cut off cannot cut off
    /// the other, so two hosts that suspect each other at once never fence each other both
    /// (without this arbitration both commands would reach the lab's switch namespace and the
    /// service would be dead). Exits 1 when this side is the one cut off.
    pub fn fence_command(&self, side: Side) -> Vec<String> {
        let script = format!(
            "ip -n {lan} -o link show dev {me} | grep -q '[<,]UP[,>]' && ip -n {lan} link set dev {other} down",
            lan = self.lab.lan,
            me = side.name(),
            other = side.other().name()
        );
        vec!["flock".into(), self.dir.join("fence.lock").display().to_string(), "sh".into(), "-c".into(), script]
    }

    /// The daemon's configuration for `side` (the spec's TOML).
    pub fn config_toml(&self, side: Side) -> String {
        let o = &self.opts;
        let fence = self.fence_command(side).iter().map(|a| format!("{a:?}")).collect::<Vec<_>>().join(", ");
        let tuned = if o.daemon_defaults {
            String::new()
        } else {
            format!(
                "heartbeat_interval_ms = {}\nmissed_beats = {}\nmax_lag_bytes = {}\nmax_lag_ms = {}\nmax_delay_fin_ms = {}\n",
                o.heartbeat_interval_ms, o.missed_beats, o.max_lag_bytes, o.max_lag_ms, o.max_delay_fin_ms
            )
        };
        format!(
            "[replica]\nrole = \"{}\"\nqueue = {QUEUE}\ninterface = \"{}\"\nlisten = \"{}:{SIDE_PORT}\"\npeer = \"{}:{SIDE_PORT}\"\nkey_file = {:?}\n{tuned}fence_command = [{fence}]\nfence_timeout_ms = {}\nstrict = {}\nfast_path = {}\nstatus_file = {:?}\n\n[[service]]\naddr = \"{}\"\nport = {REDIS_PORT}\n",
            side.name(),
            dev::APP,
            side.host_addr(),
            side.other().host_addr(),
            self.key_path().display().to_string(),
            o.fence_timeout_ms,
            o.strict,
            o.fast_path,
            self.status_path(side).display().to_string(),
            addr::SERVICE_V4,
        ) + &self.opts.extra_ports.iter().map(|p| format!("\n[[service]]\naddr = \"{}\"\nport = {p}\n", addr::SERVICE_V4)).collect::<String>()
    }

    /// Starts redis-server (unmodified, no persistence) on `side`, listening on the service
    /// address and the host's own; returns once it listens on both.
    fn start_redis(&mut self, side: Side) -> io::Result<()> {
        let ns = self.ns(side).to_string();
        let log = self.dir.join(format!("redis-{}.log", side.name()));
        let child = lab::spawn(
            &ns,
            Command::new("redis-server")
                .args(["--bind", &addr::SERVICE_V4.to_string(), &side.host_addr().to_string()])
                .args(["--port", &REDIS_PORT.to_string()])
                .args(["--save", ""])
                .args(["--appendonly", "no"])
                // Redis 7 refuses other hosts without a password otherwise, bind or not.
                .args(["--protected-mode", "no"])
                .args(["--daemonize", "no"])
                .arg("--dir")
                .arg(&self.dir)
                .arg("--logfile")
                .arg(&log)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        )
        .map_err(|e| io::Error::new(e.kind(), format!("starting redis-server in {ns}: {e}")))?;
        self.redis[side.idx()] = Some(child);
        // Listening is enough (no traffic to the service address before the clients').
        let deadline = Instant::now() + Duration::from_secs(10);
        let want = [format!("{}:{REDIS_PORT}", addr::SERVICE_V4), format!("{}:{REDIS_PORT}", side.host_addr())];
        loop {
            let out = lab::run(&ns, Command::new("ss").args(["-Hltn"]))?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            if want.iter().all(|w| text.split_whitespace().any(|x| x == w)) {
                return Ok(());
            }
            if let Some(c) = self.redis[side.idx()].as_mut() {
                if let Some(st) = c.try_wait()? {
                    self.redis[side.idx()] = None;
                    return Err(err(format!("redis-server on the {} exited ({st}): {}", side.name(), std::fs::read_to_string(&log).unwrap_or_default())));
                }
            }
            if Instant::now() > deadline {
                return Err(err(format!("redis-server on the {} does not listen on {want:?} within 10 s: {text}", side.name())));
            }
            std::thread::sleep(Duration::from_millis(10)); // polling a listener with a deadline
        }
    }

    /// Starts `unbroken replica` on `side` (its status file removed first); returns once it
    /// printed its ready line.
    fn start_daemon(&mut self, side: Side) -> io::Result<()> {
        let _ = std::fs::remove_file(self.status_path(side));
        let ns = self.ns(side).to_string();
        let log = self.log_path(side);
        let mut child = lab::spawn(
            &ns,
            Command::new(&self.opts.bin)
                .args(["replica", "--config"])
                .arg(self.config_path(side))
                .args(["--role", side.name()])
                .env("UNBROKEN_LAB_LAN", &self.lab.lan)
                .env("UNBROKEN_LAB_PRIMARY", &self.lab.primary)
                .env("UNBROKEN_LAB_BACKUP", &self.lab.backup)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(std::fs::OpenOptions::new().create(true).append(true).open(&log)?),
        )?;
        let out = child.stdout.take().ok_or_else(|| err("daemon stdout"))?;
        self.daemons[side.idx()] = Some(child);
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(out);
            let mut line = String::new();
            let _ = r.read_line(&mut line);
            let _ = tx.send(line);
            let mut sink = Vec::new();
            let _ = r.read_to_end(&mut sink);
        });
        let line = rx.recv_timeout(self.opts.start_timeout).unwrap_or_default();
        if line.starts_with("unbroken replica: ready") {
            return Ok(());
        }
        Err(err(format!(
            "unbroken replica on the {} did not print its ready line within {:?} (stdout: {:?}); its log: {}",
            side.name(),
            self.opts.start_timeout,
            line.trim(),
            std::fs::read_to_string(&log).unwrap_or_default()
        )))
    }

    /// `side`'s status file, the last one written (also after the daemon died).
    pub fn status(&self, side: Side) -> Option<serde_json::Value> {
        let t = std::fs::read_to_string(self.status_path(side)).ok()?;
        serde_json::from_str(&t).ok()
    }

    /// `side`'s state (`protecting`, `took_over`, ...).
    pub fn state(&self, side: Side) -> Option<String> {
        self.status(side)?["state"].as_str().map(String::from)
    }

    /// Waits (bounded) until `side` reports one of `states`; the status, or an error with both
    /// status files and the daemon's log.
    pub fn wait_state(&self, side: Side, states: &[&str], timeout: Duration) -> Result<serde_json::Value, String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(v) = self.status(side) {
                if v["state"].as_str().is_some_and(|s| states.contains(&s)) {
                    return Ok(v);
                }
            }
            if Instant::now() > deadline {
                return Err(format!("the {} did not reach {states:?} within {timeout:?}\n{}", side.name(), self.diagnostics()));
            }
            std::thread::sleep(Duration::from_millis(10)); // polling a status file with a deadline
        }
    }

    /// Both status files and both daemons' logs, for a failure message.
    pub fn diagnostics(&self) -> String {
        let mut s = String::new();
        for side in [Side::Primary, Side::Backup] {
            s.push_str(&format!("--- {} status: {}\n", side.name(), std::fs::read_to_string(self.status_path(side)).unwrap_or_else(|e| e.to_string())));
            let log = std::fs::read_to_string(self.log_path(side)).unwrap_or_else(|e| e.to_string());
            // The tail: the last 40 lines.
            let lines: Vec<&str> = log.lines().collect();
            s.push_str(&format!("--- {} log (last {} of {} lines):\n{}\n", side.name(), lines.len().min(40), lines.len(), lines[lines.len().saturating_sub(40)..].join("\n")));
        }
        s.push_str(&format!("--- RSTs at the client: {}; run dir {} (UNBROKEN_KEEP=1 keeps it)\n", self.client_rsts(), self.dir.display()));
        if let Some(t) = std::fs::read_to_string(self.dir.join(RST_LOG)).ok().map(|t| t.trim().to_string()).filter(|t| !t.is_empty()) {
            s.push_str(&format!("--- the RSTs (time, MACs, addresses, flags, seq/ack; the first {RST_LOG_MAX}):\n{t}\n"));
        }
        s
    }

    /// Every RST that reaches the client, one text line each (`tcpdump -e`: which host's MAC
    /// sent it, the flow, its sequence numbers), in `dir/client-rsts.txt`, shown by
    /// [`Self::diagnostics`]: a failure that counted a RST names it. Only where tcpdump is
    /// installed (`scripts/setup.sh` installs it); returned once tcpdump listens.
    fn log_client_rsts(&self) -> Option<Child> {
        let out = std::fs::File::create(self.dir.join(RST_LOG)).ok()?;
        let err_path = self.dir.join("client-rsts.err");
        let err = std::fs::File::create(&err_path).ok()?;
        let filter = "(tcp[tcpflags] & tcp-rst != 0) or (ip6 and ip6[6] == 6 and ip6[53] & 4 != 0)";
        let mut cmd = Command::new("tcpdump");
        cmd.args(["-i", dev::APP, "-l", "-nn", "-e", "-tt", "-c", &RST_LOG_MAX.to_string(), filter]).stdout(out).stderr(err);
        let mut c = lab::spawn(&self.lab.client, &mut cmd).ok()?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if std::fs::read_to_string(&err_path).is_ok_and(|t| t.contains("listening on")) {
                return Some(c);
            }
            if !matches!(c.try_wait(), Ok(None)) {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
        None
    }

    /// Whether the daemon of `side` still runs.
    pub fn daemon_running(&mut self, side: Side) -> bool {
        match self.daemons[side.idx()].as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Power loss of `side`'s host: its port of the switch goes down and so do its own links
    /// (nothing it sends leaves any more, not even a FIN or RST of a dying process), then every
    /// process in its namespace is SIGKILLed (its daemon and its redis).
    pub fn crash_host(&mut self, side: Side) -> io::Result<()> {
        let lan = self.lab.lan.clone();
        lab::run_ok(&lan, Command::new("ip").args(["link", "set", "dev", side.name(), "down"]))?;
        let ns = self.ns(side).to_string();
        self.lab.lab.crash_host(&ns)?;
        for c in [self.daemons[side.idx()].take(), self.redis[side.idx()].take()].into_iter().flatten() {
            let mut c = c;
            let _ = c.wait();
        }
        Ok(())
    }

    /// Whether `side`'s port of the switch is up (false once fenced or crashed).
    pub fn port_up(&self, side: Side) -> bool {
        lab::run(&self.lab.lan, Command::new("ip").args(["-o", "link", "show", "dev", side.name()])).is_ok_and(|o| {
            let t = String::from_utf8_lossy(&o.stdout).into_owned();
            t.split_once('<').and_then(|(_, r)| r.split_once('>')).is_some_and(|(flags, _)| flags.split(',').any(|f| f == "UP"))
        })
    }

    /// The pid of `side`'s redis-server, if it runs.
    pub fn redis_pid(&self, side: Side) -> Option<u32> {
        self.redis[side.idx()].as_ref().map(|c| c.id())
    }

    /// Sends `sig` to `side`'s redis-server (false when it does not run). SIGKILL: the kernel
    /// closes its sockets (a FIN on an idle connection, an RST where unread input was left);
    /// the process is reaped. SIGSTOP: it stops answering and closes nothing; SIGCONT thaws it.
    pub fn signal_redis(&mut self, side: Side, sig: i32) -> bool {
        let Some(c) = self.redis[side.idx()].as_mut() else { return false };
        // SAFETY: a signal to our own child, not yet reaped.
        let ok = unsafe { libc::kill(c.id() as i32, sig) } == 0;
        if sig == libc::SIGKILL {
            let _ = c.wait();
            self.redis[side.idx()] = None;
        }
        ok
    }

    /// ST-TCP Table 3.3 row 5, temporary loss at the backup: see [`ReplicaEnv::drop_input`].
    pub fn drop_backup_input(&self, dur: Duration) -> io::Result<u64> {
        self.drop_input(Side::Backup, dur)
    }

    /// Temporary loss toward `side`: every packet to the service address is dropped on its
    /// interface (nftables netdev ingress at priority -500, before anything of the daemon's)
    /// for `dur`, then the rule is removed. Returns how many were dropped.
    pub fn drop_input(&self, side: Side, dur: Duration) -> io::Result<u64> {
        let ns = self.ns(side);
        nft_stdin(
            ns,
            &format!(
                "table netdev {LOSS_TABLE} {{\n  chain c {{\n    type filter hook ingress device \"{}\" priority -500; policy accept;\n    ip daddr {} counter drop\n  }}\n}}\n",
                dev::APP,
                addr::SERVICE_V4
            ),
        )?;
        std::thread::sleep(dur); // the fault's duration, not a synchronisation
        let out = lab::run_ok(ns, Command::new("nft").args(["list", "table", "netdev", LOSS_TABLE]))?;
        lab::run_ok(ns, Command::new("nft").args(["delete", "table", "netdev", LOSS_TABLE]))?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        Ok(text.split_once("counter packets ").and_then(|(_, a)| a.split_whitespace().next()?.parse().ok()).unwrap_or(0))
    }

    /// Kills `side`'s daemon (SIGKILL: a crash, not a clean stop; its rules, its pinned
    /// programs and a backup's ARP suppression stay, as they do when it dies) and starts it
    /// again with the same config; returns once the new one printed its ready line.
    pub fn restart_daemon(&mut self, side: Side) -> io::Result<()> {
        self.kill_daemon(side);
        self.start_daemon(side)
    }

    /// Kills `side`'s daemon (SIGKILL) and reaps it; nothing is started in its place.
    pub fn kill_daemon(&mut self, side: Side) {
        if let Some(mut c) = self.daemons[side.idx()].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// One authenticated side-channel datagram from the primary to the backup, as it was on the
    /// wire (Ethernet frame), captured in the client namespace within `timeout`: the lab's switch
    /// is a hub, so every frame between the two hosts reaches the client's interface too (as it
    /// would an attacker's on the same segment).
    pub fn capture_side_datagram(&self, timeout: Duration) -> io::Result<Vec<u8>> {
        let (src, dst) = (addr::PRIMARY_V4.octets(), addr::BACKUP_V4.octets());
        lab::capture_frame(&self.lab.client, dev::APP, timeout, move |f| {
            let ihl = f.get(14).map_or(0, |b| usize::from(b & 0xf) * 4);
            ihl >= 20
                && f.len() >= 14 + ihl + 8
                && f[12..14] == [0x08, 0x00]
                && f[23] == 17
                && f[26..30] == src
                && f[30..34] == dst
                && f[14 + ihl..16 + ihl] == SIDE_PORT.to_be_bytes()
                && f[16 + ihl..18 + ihl] == SIDE_PORT.to_be_bytes()
        })
    }

    /// Sends a captured frame again from the client's interface (it reaches the host its
    /// destination MAC names, through the hub), unchanged but for an IPv4 UDP checksum that
    /// the sender left to offload: veths carry such a packet across namespaces with the
    /// checksum field holding only the pseudo-header's sum, so the capture is completed as a
    /// real NIC would have put it on the wire (else the receiver's kernel drops the replay as
    /// corrupt and it never reaches the daemon).
    pub fn replay_frame(&self, frame: &[u8]) -> io::Result<()> {
        let mut f = frame.to_vec();
        complete_udp_checksum(&mut f);
        lab::send_frame(&self.lab.client, dev::APP, &f)
    }

    /// The client namespace's `TcpExtPAWSEstab`: segments of established connections it
    /// discarded by PAWS (a timestamp older than one already seen).
    pub fn client_paws_estab(&self) -> io::Result<u64> {
        lab::netstat_counter(&self.lab.client, "TcpExt", "PAWSEstab")
    }

    /// `side`'s redis-server through its host address (outside the replicated service).
    pub fn redis_host_addr(&self, side: Side) -> std::net::SocketAddr {
        std::net::SocketAddr::from((side.host_addr(), REDIS_PORT))
    }

    /// RSTs that reached the client namespace so far (`u64::MAX` when unreadable).
    pub fn client_rsts(&self) -> u64 {
        lab::rsts_seen(&self.lab.client).unwrap_or(u64::MAX)
    }

    /// Runs `redis-cli` in the client namespace against `side`'s server through its host
    /// address (outside the replicated service); its stdout, trimmed.
    pub fn redis_cli(&self, side: Side, args: &[&str]) -> io::Result<String> {
        redis_cli_at(&self.lab.client, &side.host_addr().to_string(), args)
    }

    /// Runs `redis-cli` in the client namespace against the service address (a new
    /// connection of the replicated service); its stdout, trimmed.
    pub fn service_cli(&self, args: &[&str]) -> io::Result<String> {
        redis_cli_at(&self.lab.client, &addr::SERVICE_V4.to_string(), args)
    }

    /// Spawns a command in the client namespace, stdout and stderr piped.
    pub fn client_cmd(&self, cmd: &mut Command) -> io::Result<Child> {
        lab::spawn(&self.lab.client, cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()))
    }

    /// The redis-py client (`redis_incr.py`): one connection, `n` INCRs of `key` at `rate`
    /// ops/s (0: unpaced), every reply checked.
    pub fn py_incr(&self, key: &str, n: u64, rate: u64) -> io::Result<ClientRun> {
        let child = self.client_cmd(Command::new(python()).arg(self.dir.join("redis_incr.py")).args([&addr::SERVICE_V4.to_string(), &REDIS_PORT.to_string(), key, &n.to_string(), &rate.to_string()]))?;
        Ok(ClientRun::start("redis-py", child, Parse::Py))
    }

    /// `redis-cli -r n INCR key` on one connection: every reply must be the next integer
    /// after `start` (the key's value before).
    pub fn cli_incr(&self, key: &str, n: u64, start: u64) -> io::Result<ClientRun> {
        self.spawner().cli_incr(key, n, start)
    }

    /// `redis-benchmark` of SET, GET and PING (replies independent of the order in which the
    /// servers interleave its connections, so both servers answer alike) with `clients`
    /// connections and `n` requests per test.
    pub fn benchmark(&self, n: u64, clients: u64) -> io::Result<ClientRun> {
        self.spawner().benchmark(n, clients)
    }

    /// The local ports of the client namespace's established connections to the service.
    pub fn client_ports(&self) -> Vec<u16> {
        let out = lab::run(&self.lab.client, Command::new("ss").args(["-Htn", "state", "established"])).ok();
        let svc = format!("{}:{REDIS_PORT}", addr::SERVICE_V4);
        out.map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.split_whitespace().any(|w| w == svc))
                .filter_map(|l| l.split_whitespace().find(|w| w.starts_with(&format!("{}:", addr::CLIENT_V4)))?.rsplit_once(':')?.1.parse().ok())
                .collect()
        })
        .unwrap_or_default()
    }
}

/// Writes the correct UDP checksum into an Ethernet + IPv4 + UDP frame (no-op for anything
/// else or a zero, "no checksum", field).
fn complete_udp_checksum(f: &mut [u8]) {
    let ihl = f.get(14).map_or(0, |b| usize::from(b & 0xf) * 4);
    if ihl < 20 || f.len() < 14 + ihl + 8 || f[12..14] != [0x08, 0x00] || f[23] != 17 {
        return;
    }
    let u = 14 + ihl;
    let len = usize::from(u16::from_be_bytes([f[u + 4], f[u + 5]]));
    if len < 8 || u + len > f.len() || f[u + 6..u + 8] == [0, 0] {
        return;
    }
    f[u + 6] = 0;
    f[u + 7] = 0;
    let mut sum: u32 = 0;
    let mut add = |b: &[u8]| {
        for c in b.chunks(2) {
            sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
        }
    };
    add(&f[26..34]);
    add(&[0, 17]);
    add(&(len as u16).to_be_bytes());
    add(&f[u..u + len]);
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    let c = match !(sum as u16) {
        0 => 0xffff,
        c => c,
    };
    f[u + 6..u + 8].copy_from_slice(&c.to_be_bytes());
}

fn redis_cli_at(ns: &str, host: &str, args: &[&str]) -> io::Result<String> {
    let out = lab::run_ok(ns, Command::new("timeout").args(["10", "redis-cli", "-h", host, "-p", &REDIS_PORT.to_string()]).args(args))?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn nft_stdin(ns: &str, rules: &str) -> io::Result<()> {
    let mut c = Command::new("nft");
    c.args(["-f", "-"]).stdin(Stdio::piped()).stdout(Stdio::null()).stderr(Stdio::piped());
    let mut child = lab::spawn(ns, &mut c)?;
    child.stdin.take().ok_or_else(|| err("nft stdin"))?.write_all(rules.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        return Err(err(format!("nft -f in {ns}: {}\n{rules}", String::from_utf8_lossy(&out.stderr))));
    }
    Ok(())
}

/// How a client's stdout is checked.
#[derive(Debug, Clone, Copy)]
enum Parse {
    /// `redis_incr.py`: `progress I` lines, then one JSON line.
    Py,
    /// One integer a line, each the next.
    Seq { next: u64 },
    /// redis-benchmark `-q`: `TEST: N requests per second` lines.
    Bench,
}

/// A client running in the client namespace; [`ClientRun::finish`] collects what it saw.
pub struct ClientRun {
    pub name: &'static str,
    child: Child,
    /// Operations answered so far (INCRs, lines).
    pub progress: Arc<AtomicU64>,
    out: Option<std::thread::JoinHandle<Seen>>,
    err: Option<std::thread::JoinHandle<String>>,
}

#[derive(Debug, Default)]
struct Seen {
    ops: u64,
    wrong: Option<String>,
    json: Option<serde_json::Value>,
    max_gap_ms: u64,
}

/// What one client saw.
#[derive(Debug, Clone, Serialize)]
pub struct ClientResult {
    pub name: String,
    pub exit: Option<i32>,
    pub timed_out: bool,
    /// Operations answered correctly (INCRs, replies in sequence, benchmark tests completed).
    pub ops: u64,
    /// The first wrong reply or the client's own error report, if any.
    pub wrong: Option<String>,
    pub stderr: String,
    /// redis-py's report (`redis_incr.py`).
    pub report: Option<serde_json::Value>,
    /// Longest time between two answers on stdout (redis-py: the longest INCR), ms.
    pub max_gap_ms: u64,
}

impl ClientResult {
    /// Exit 0, no timeout, nothing on stderr, no wrong reply, and for redis-py `ok` with no
    /// reconnect.
    pub fn clean(&self) -> bool {
        self.exit == Some(0)
            && !self.timed_out
            && self.stderr.trim().is_empty()
            && self.wrong.is_none()
            && self.report.as_ref().map_or(true, |r| r["ok"] == true && r["reconnects"] == 0 && r["port_start"] == r["port_end"])
    }
}

impl ClientRun {
    fn start(name: &'static str, mut child: Child, parse: Parse) -> ClientRun {
        let progress = Arc::new(AtomicU64::new(0));
        let out = child.stdout.take().map(|o| {
            let p = progress.clone();
            std::thread::spawn(move || read_stdout(o, parse, &p))
        });
        let err = child.stderr.take().map(|mut e| {
            std::thread::spawn(move || {
                let mut t = String::new();
                let _ = e.read_to_string(&mut t);
                t
            })
        });
        ClientRun { name, child, progress, out, err }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it has exited.
    pub fn done(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits until it exits or `deadline` passes (then it is killed: `timed_out`).
    pub fn finish(mut self, deadline: Instant) -> ClientResult {
        let mut timed_out = false;
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) if Instant::now() > deadline => {
                    timed_out = true;
                    let _ = self.child.kill();
                    break self.child.wait().ok();
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)), // polling a child's exit with a deadline
                Err(_) => break None,
            }
        };
        let seen = self.out.take().and_then(|h| h.join().ok()).unwrap_or_default();
        let stderr = self.err.take().and_then(|h| h.join().ok()).unwrap_or_default();
        let mut wrong = seen.wrong;
        if let Some(j) = &seen.json {
            if wrong.is_none() {
                wrong = j["error"].as_str().map(String::from);
            }
        }
        ClientResult {
            name: self.name.to_string(),
            exit: status.and_then(|s| s.code()),
            timed_out,
            ops: seen.json.as_ref().and_then(|j| j["ops"].as_u64()).unwrap_or(seen.ops),
            wrong,
            stderr,
            max_gap_ms: seen.json.as_ref().and_then(|j| j["max_gap_ms"].as_u64()).unwrap_or(seen.max_gap_ms),
            report: seen.json,
        }
    }
}

impl Drop for ClientRun {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn read_stdout(o: impl Read, parse: Parse, progress: &AtomicU64) -> Seen {
    let mut s = Seen::default();
    let mut next = match parse {
        Parse::Seq { next } => next,
        _ => 0,
    };
    let mut last = Instant::now();
    // redis-benchmark rewrites its progress line with '\r': split on both.
    let mut r = BufReader::new(o);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match r.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        for raw in buf.split(|&b| b == b'\r' || b == b'\n') {
            let line = String::from_utf8_lossy(raw).trim().to_string();
            if line.is_empty() {
                continue;
            }
            match parse {
                Parse::Py => {
                    if let Some(n) = line.strip_prefix("progress ").and_then(|n| n.parse().ok()) {
                        progress.store(n, Ordering::Relaxed);
                    } else if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                        s.json = Some(v);
                    } else if s.wrong.is_none() {
                        s.wrong = Some(format!("unexpected output {line:?}"));
                    }
                }
                Parse::Seq { .. } => {
                    let gap = last.elapsed().as_millis() as u64;
                    last = Instant::now();
                    if s.ops > 0 {
                        s.max_gap_ms = s.max_gap_ms.max(gap);
                    }
                    if line.parse::<u64>().ok() == Some(next) {
                        next += 1;
                        s.ops += 1;
                        progress.store(s.ops, Ordering::Relaxed);
                    } else if s.wrong.is_none() {
                        s.wrong = Some(format!("reply {} was {line:?}, expected {next}", s.ops + 1));
                    }
                }
                Parse::Bench => {
                    if line.contains("requests per second") {
                        s.ops += 1;
                        progress.store(s.ops, Ordering::Relaxed);
                    } else if line.contains("rror") || line.contains("eset") || line.contains("losed") {
                        if s.wrong.is_none() {
                            s.wrong = Some(line);
                        }
                    }
                }
            }
        }
    }
    s
}

/// Runs a client again and again (each run its own process and connections) until stopped:
/// one is always running while faults hit. Every run's result is kept.
pub struct Repeat {
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<Vec<ClientResult>>,
    /// Operations answered so far over every run.
    pub progress: Arc<AtomicU64>,
}

impl Repeat {
    /// `make(k)` starts run `k` (from 0); each run gets `per_run` to finish.
    pub fn start(make: impl Fn(u64) -> io::Result<ClientRun> + Send + 'static, per_run: Duration) -> Repeat {
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(AtomicU64::new(0));
        let (s, p) = (stop.clone(), progress.clone());
        let handle = std::thread::spawn(move || {
            let mut results: Vec<ClientResult> = Vec::new();
            let mut k = 0;
            while !s.load(Ordering::Relaxed) {
                let base = p.load(Ordering::Relaxed);
                let run = match make(k) {
                    Ok(r) => r,
                    Err(e) => {
                        results.push(ClientResult { name: format!("run {k}"), exit: None, timed_out: false, ops: 0, wrong: Some(format!("could not start: {e}")), stderr: String::new(), report: None, max_gap_ms: 0 });
                        break;
                    }
                };
                let rp = run.progress.clone();
                let deadline = Instant::now() + per_run;
                let mut run = run;
                while !run.done() && Instant::now() < deadline {
                    p.store(base + rp.load(Ordering::Relaxed), Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(10)); // following a child's progress
                }
                let r = run.finish(deadline);
                p.store(base + r.ops, Ordering::Relaxed);
                let bad = !r.clean();
                results.push(r);
                if bad {
                    break;
                }
                k += 1;
            }
            results
        });
        Repeat { stop, handle, progress }
    }

    /// Lets the current run finish, starts no other; every run's result.
    pub fn stop(self) -> Vec<ClientResult> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().unwrap_or_default()
    }
}

/// The demo's settings.
#[derive(Debug, Clone)]
pub struct ReplicaScenario {
    /// INCRs of the redis-py client.
    pub incrs: u64,
    /// Fraction of the redis-py client's INCRs after which the primary host dies.
    pub crash_at: f64,
    /// INCRs per redis-cli run.
    pub cli_incrs: u64,
    /// Requests per test per redis-benchmark run.
    pub bench_requests: u64,
    pub timeout: Duration,
    pub live: bool,
    /// The `unbroken` binary for the daemons (default: this executable).
    pub bin: Option<PathBuf>,
    pub strict: bool,
    pub heartbeat_interval_ms: u64,
    pub missed_beats: u64,
    /// Connections of the verifying client ([`crate::replica::client`]: INCR and SET/GET of
    /// 1 KiB-1 MiB values, every reply checked) running beside the others from start to end;
    /// 0: none.
    pub large_conns: usize,
}

impl Default for ReplicaScenario {
    fn default() -> Self {
        ReplicaScenario { incrs: 100_000, crash_at: 0.4, cli_incrs: 2000, bench_requests: 2000, timeout: Duration::from_secs(300), live: false, bin: None, strict: true, heartbeat_interval_ms: 10, missed_beats: 10, large_conns: 4 }
    }
}

/// What the verifying client of large values saw in the demo.
#[derive(Debug, Clone, Serialize)]
pub struct LargeValues {
    pub conns: usize,
    /// Every connection ran to the end, every reply byte-exact.
    pub ok: bool,
    pub ops: u64,
    pub bytes: u64,
    pub stall_ms: u64,
    pub max_op_ms: u64,
    /// Each connection's failure (reset, EOF, wrong byte, hang), if any.
    pub failures: Vec<String>,
    /// Acknowledged writes the surviving server lacks, and keys it could not be read for.
    pub lost_acknowledged_writes: u64,
    pub unreadable_keys: u64,
    pub lost_details: Vec<String>,
    pub error: Option<String>,
}

/// The demo's report (`--json` prints it).
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaReport {
    pub ok: bool,
    pub error: Option<String>,
    /// Takeovers by the backup (1 when the primary's death was handled).
    pub failovers: u64,
    /// Operations answered: redis-py INCRs, redis-cli INCRs, redis-benchmark requests.
    pub ops: u64,
    /// Client runs that saw an error, a wrong reply, a reconnect or a timeout.
    pub errors_seen: u64,
    pub resets_seen_by_client: u64,
    /// Longest time one redis-py INCR (or one redis-cli reply) took, ms.
    pub max_stall_ms: u64,
    /// The backup's figure: the primary's last beat to the announcement, ms.
    pub takeover_ms: Option<u64>,
    /// The final values read through the service address: (key, expected, got).
    pub values: Vec<(String, u64, Option<u64>)>,
    pub clients: Vec<ClientResult>,
    pub crash_at_ops: u64,
    pub duration_ms: u64,
    /// The verifying client of large values (None when `large_conns` is 0).
    pub large_values: Option<LargeValues>,
}

/// `unbroken demo replica`.
pub fn run_replica(s: &ReplicaScenario) -> Result<ReplicaReport, String> {
    lab::lab_available().map_err(|e| format!("the lab is not available: {e}"))?;
    if let Some(m) = tools_missing() {
        return Err(m);
    }
    let mut opts = RepOpts { strict: s.strict, heartbeat_interval_ms: s.heartbeat_interval_ms, missed_beats: s.missed_beats, ..RepOpts::default() };
    if let Some(b) = &s.bin {
        opts.bin = b.clone();
    }
    let say = |m: String| {
        if s.live {
            eprintln!("[demo] {m}");
        }
    };
    let t0 = Instant::now();
    let mut env = ReplicaEnv::start(opts).map_err(|e| format!("starting the system: {e}"))?;
    say(format!("{:>6} ms  both daemons protecting; clients start ({})", t0.elapsed().as_millis(), env.dir.display()));
    let deadline = Instant::now() + s.timeout;
    let large_args = crate::replica::client::Args {
        connect: std::net::SocketAddr::from((addr::SERVICE_V4, REDIS_PORT)),
        conns: s.large_conns,
        secs: s.timeout.as_secs_f64(),
        until_stdin_eof: true,
        prefix: "demo:large".into(),
        ..Default::default()
    };
    let large = if s.large_conns > 0 {
        let c = crate::replica::client::CheckClient::start(&env.lab.client, &env.opts.bin, large_args, Duration::from_secs(30)).map_err(|e| format!("starting the verifying client: {e}"))?;
        say(format!("{:>6} ms  the verifying client runs {} connections of INCR and 1 KiB-1 MiB SET/GET", t0.elapsed().as_millis(), s.large_conns));
        Some(c)
    } else {
        None
    };
    let py = env.py_incr("demo:redis-py", s.incrs, 0).map_err(|e| format!("starting the redis-py client: {e}"))?;
    let env_cli = CliSpawner { ns: env.lab.client.clone() };
    let cli_n = s.cli_incrs;
    let cli_total = Arc::new(Mutex::new(0u64));
    let ct = cli_total.clone();
    let cli = Repeat::start(
        move |_| {
            let start = *ct.lock().unwrap();
            let r = env_cli.cli_incr("demo:redis-cli", cli_n, start);
            *ct.lock().unwrap() = start + cli_n;
            r
        },
        s.timeout,
    );
    let env_bench = CliSpawner { ns: env.lab.client.clone() };
    let bn = s.bench_requests;
    let bench = Repeat::start(move |_| env_bench.benchmark(bn, 4), s.timeout);
    let crash_at = (s.crash_at * s.incrs as f64) as u64;
    let mut crashed_at = None;
    let mut error = None;
    let mut last_print = Instant::now();
    let mut py = Some(py);
    while let Some(p) = py.as_mut() {
        let got = p.progress.load(Ordering::Relaxed);
        if crashed_at.is_none() && got >= crash_at {
            say(format!("{:>6} ms  {got} INCRs answered: the primary host dies (processes killed, link cut)", t0.elapsed().as_millis()));
            if let Err(e) = env.crash_host(Side::Primary) {
                error = Some(format!("crash: {e}"));
            }
            crashed_at = Some(got);
        }
        if p.done() || Instant::now() > deadline {
            break;
        }
        if s.live && last_print.elapsed() > Duration::from_secs(1) {
            last_print = Instant::now();
            say(format!("{:>6} ms  redis-py {got} / {} INCRs, redis-cli {}, redis-benchmark {} tests", t0.elapsed().as_millis(), s.incrs, cli.progress.load(Ordering::Relaxed), bench.progress.load(Ordering::Relaxed)));
        }
        std::thread::sleep(Duration::from_millis(5)); // polling progress to time the crash
    }
    let pyr = py.take().map(|p| p.finish(deadline));
    let large = large.map(|mut c| {
        c.stop();
        let hang = Duration::from_millis(c.args.hang_ms);
        c.finish(Instant::now() + hang + Duration::from_secs(20))
    });
    let mut clients: Vec<ClientResult> = pyr.into_iter().collect();
    let cli_runs = cli.stop();
    let bench_runs = bench.stop();
    let cli_ops: u64 = cli_runs.iter().map(|r| r.ops).sum();
    let bench_tests: u64 = bench_runs.iter().map(|r| r.ops).sum();
    clients.extend(cli_runs);
    clients.extend(bench_runs);
    if crashed_at.is_none() && error.is_none() {
        error = Some("the redis-py client finished before the crash point".into());
    }
    let backup = env.wait_state(Side::Backup, &["took_over"], Duration::from_secs(5)).ok();
    let failovers = u64::from(backup.is_some());
    let takeover_ms = backup.as_ref().and_then(|b| b["takeover_ms"].as_u64());
    let read = |k: &str| env.service_cli(&["GET", k]).ok().and_then(|v| v.parse::<u64>().ok());
    let py_ops = clients.first().map_or(0, |c| c.ops);
    let values = vec![("demo:redis-py".to_string(), s.incrs, read("demo:redis-py")), ("demo:redis-cli".to_string(), cli_ops, read("demo:redis-cli"))];
    let errors_seen = clients.iter().filter(|c| !c.clean()).count() as u64;
    let rsts = env.client_rsts();
    let max_stall_ms = clients.iter().filter(|c| c.name != "redis-benchmark").map(|c| c.max_gap_ms).max().unwrap_or(0);
    let exact = values.iter().all(|(_, want, got)| Some(*want) == *got) && py_ops == s.incrs;
    // The verifying client's writes, read back from the server that serves now.
    let serving = if failovers == 1 { Side::Backup } else { Side::Primary };
    let large_values = large.map(|r| match r {
        Ok(r) => {
            let l = crate::replica::client::lost_writes(&env.lab.client, env.redis_host_addr(serving), &r);
            LargeValues {
                conns: r.conns.len(),
                ok: r.ok,
                ops: r.ops,
                bytes: r.bytes,
                stall_ms: r.stall_ms,
                max_op_ms: r.max_op_ms,
                failures: r.conns.iter().filter_map(|c| Some(format!("conn {} (port {}): {}: {}", c.conn, c.local_port, c.failure.as_deref()?, c.error.as_deref().unwrap_or("")))).collect(),
                lost_acknowledged_writes: l.lost,
                unreadable_keys: l.unreadable,
                lost_details: l.details,
                error: None,
            }
        }
        Err(e) => LargeValues { conns: s.large_conns, ok: false, ops: 0, bytes: 0, stall_ms: 0, max_op_ms: 0, failures: Vec::new(), lost_acknowledged_writes: 0, unreadable_keys: 0, lost_details: Vec::new(), error: Some(e) },
    });
    let large_ok = large_values.as_ref().map_or(true, |l| l.ok && l.error.is_none() && l.lost_acknowledged_writes == 0 && l.unreadable_keys == 0);
    let ok = error.is_none() && exact && errors_seen == 0 && rsts == 0 && failovers == 1 && large_ok;
    if !ok && error.is_none() {
        error = Some(format!("values {values:?}, {errors_seen} client runs saw an error, {rsts} RSTs, failovers {failovers}, large values {large_values:?}\n{}", env.diagnostics()));
    }
    Ok(ReplicaReport {
        ok,
        error,
        failovers,
        ops: py_ops + cli_ops + bench_tests * s.bench_requests,
        errors_seen,
        resets_seen_by_client: rsts,
        max_stall_ms,
        takeover_ms,
        values,
        clients,
        crash_at_ops: crashed_at.unwrap_or(0),
        duration_ms: t0.elapsed().as_millis() as u64,
        large_values,
    })
}

/// Starts clients in the client namespace from another thread (the env stays with its owner).
#[derive(Clone)]
pub struct CliSpawner {
    pub ns: String,
}

impl CliSpawner {
    fn cmd(&self, cmd: &mut Command) -> io::Result<Child> {
        lab::spawn(&self.ns, cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()))
    }

    /// As [`ReplicaEnv::cli_incr`].
    pub fn cli_incr(&self, key: &str, n: u64, start: u64) -> io::Result<ClientRun> {
        let child = self.cmd(Command::new("redis-cli").args(["-h", &addr::SERVICE_V4.to_string(), "-p", &REDIS_PORT.to_string(), "-r", &n.to_string(), "INCR", key]))?;
        Ok(ClientRun::start("redis-cli", child, Parse::Seq { next: start + 1 }))
    }

    /// As [`ReplicaEnv::benchmark`].
    pub fn benchmark(&self, n: u64, clients: u64) -> io::Result<ClientRun> {
        let child = self.cmd(Command::new("redis-benchmark").args(["-h", &addr::SERVICE_V4.to_string(), "-p", &REDIS_PORT.to_string(), "-c", &clients.to_string(), "-n", &n.to_string(), "-t", "set,get,ping", "-q"]))?;
        Ok(ClientRun::start("redis-benchmark", child, Parse::Bench))
    }
}

impl ReplicaEnv {
    /// A [`CliSpawner`] for this env's client namespace.
    pub fn spawner(&self) -> CliSpawner {
        CliSpawner { ns: self.lab.client.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A UDP checksum completed over the pseudo-header and the datagram sums, with itself, to
    /// 0xffff (RFC 768); a zero field ("no checksum") and other protocols stay as they are.
    #[test]
    fn udp_checksum_is_completed() {
        let mut f = vec![0u8; 14 + 20 + 8 + 5];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        f[14] = 0x45;
        f[23] = 17;
        f[26..30].copy_from_slice(&[10, 77, 3, 11]);
        f[30..34].copy_from_slice(&[10, 77, 3, 12]);
        f[34..36].copy_from_slice(&7790u16.to_be_bytes());
        f[36..38].copy_from_slice(&7790u16.to_be_bytes());
        f[38..40].copy_from_slice(&13u16.to_be_bytes());
        f[40..42].copy_from_slice(&[0x12, 0x34]); // a partial (pseudo-header) sum
        f[42..].copy_from_slice(b"hello");
        complete_udp_checksum(&mut f);
        let mut sum: u32 = 0;
        let mut add = |b: &[u8]| b.chunks(2).for_each(|c| sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])));
        add(&f[26..34]);
        add(&[0, 17, 0, 13]);
        add(&f[34..]);
        while sum >> 16 != 0 {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        assert_eq!(sum, 0xffff);
        let mut z = f.clone();
        z[40..42].copy_from_slice(&[0, 0]);
        let before = z.clone();
        complete_udp_checksum(&mut z);
        assert_eq!(z, before, "no checksum stays no checksum");
        let mut tcp = f.clone();
        tcp[23] = 6;
        let before = tcp.clone();
        complete_udp_checksum(&mut tcp);
        assert_eq!(tcp, before);
    }
}
