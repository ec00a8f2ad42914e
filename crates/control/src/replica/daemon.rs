//! `unbroken replica` (issue 10): the daemon of replica mode on the primary or the backup host.
//! It only does I/O around [`crate::replica::core::Core`] on the shared packet loop
//! ([`crate::daemon::run`]): the queue (client packets in, its server's packets out), the UDP
//! side channel to the other host, the fencing command, and on the backup the segment
//! plumbing ([`unbroken_drivers::segment`]): ARP suppression for the service address until it
//! takes over, then the gratuitous ARP, and the receive rule ([`HubReceive`]) that hands its
//! stack the client's frames addressed to the primary's MAC (hub or mirror).
//!
//! ```toml
//! [replica]
//! role = "primary"                  # or "backup"
//! queue = 9                         # NFQUEUE number
//! interface = "eth0"                # the segment device (backup: ARP suppression, announcements)
//! listen = "10.77.3.11:7790"        # side channel: this host's UDP address
//! peer = "10.77.3.12:7790"          # the other host's (datagrams from elsewhere are dropped, counted)
//! key = "00112233445566778899aabbccddeeff"   # shared key, hex (or key_file = "/path")
//! heartbeat_interval_ms = 10
//! missed_beats = 10
//! fence_command = ["/usr/local/sbin/fence-peer"]   # required: exit 0 = the peer is fenced
//! fence_timeout_ms = 5000
//! strict = true                     # strict output commit (Koch 3.2)
//! max_lag_bytes = 4194304
//! max_lag_ms = 5000
//! max_delay_fin_ms = 5000
//! max_hang_ms = 150                 # a server reading nothing, using no CPU: hung (0: off)
//! max_connections = 65536
//! status_file = "/run/unbroken/replica.json"
//! fast_path = false                 # steady-state packets in tc-BPF (issue 22 item 4; primary: relaxed only)
//!
//! [[service]]                       # IPv4, one address (several ports)
//! addr = "10.77.3.10"
//! port = 6379
//! ```

use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Deserialize;
use unbroken_drivers::iptables::{BuiltinChain, RuleSpec, Rules, Service as RuleService};
use unbroken_drivers::nfqueue::{Queue, QueueConfig};
use unbroken_drivers::rawsend::RawSender;
use unbroken_drivers::segment::{
    Announcer, ArpSuppress, ArpSuppressSpec, HubReceive, HubReceiveSpec,
};
use unbroken_engines::replica::{
    BackupCounters, Config as EngineConfig, DetectorConfig, PrimaryCounters, ServerSocket,
};
use unbroken_wire::ctl::Key;
use unbroken_wire::replica::Role;

use crate::service::Service;
use crate::daemon::{self, Outbox, Wake};
use crate::replica::core::{Boot, Core, Counters, Request, Settings, State};
use crate::replica::fastmap::KernelMap;

/// Mark of the packets the daemon sends (released output, fresh ACKs, relayed client ACKs):
/// its queue rules let them pass.
pub const REPLICA_MARK: u32 = 0x7562_0003;

fn default_queue() -> u16 {
    9
}
fn default_interval() -> u64 {
    10
}
/// Ten missed beats of 10 ms: 100 ms of silence before the peer is suspected. Three (30 ms)
/// made both hosts suspect each other at once under load with no fault (issue 20 item 7): a
/// loaded two-core host delays the packet loop, which sends the beats, by tens of ms.
fn default_misses() -> u32 {
    10
}
fn default_fence_timeout() -> u64 {
    5_000
}
fn default_true() -> bool {
    true
}
fn default_lag_bytes() -> u32 {
    4 << 20
}
fn default_lag_ms() -> u64 {
    5_000
}
fn default_fin_ms() -> u64 {
    5_000
}
fn default_hang_ms() -> u64 {
    unbroken_engines::replica::DEFAULT_MAX_HANG_MS
}
fn default_max_conns() -> usize {
    unbroken_engines::replica::DEFAULT_MAX_CONNS
}
fn default_grace() -> u64 {
    60
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RoleName {
    Primary,
    Backup,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaSection {
    pub role: RoleName,
    #[serde(default = "default_queue")]
    pub queue: u16,
    pub interface: String,
    pub listen: SocketAddr,
    pub peer: SocketAddr,
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    #[serde(default = "default_interval")]
    pub heartbeat_interval_ms: u64,
    #[serde(default = "default_misses")]
    pub missed_beats: u32,
    #[serde(default)]
    pub fence_command: Vec<String>,
    #[serde(default = "default_fence_timeout")]
    pub fence_timeout_ms: u64,
    #[serde(default = "default_true")]
    pub strict: bool,
    #[serde(default = "default_lag_bytes")]
    pub max_lag_bytes: u32,
    #[serde(default = "default_lag_ms")]
    pub max_lag_ms: u64,
    #[serde(default = "default_fin_ms")]
    pub max_delay_fin_ms: u64,
    /// A server that reads none of its waiting input and uses no CPU for this long, while the
    /// other host's server went on, is hung: the failed one at once (0: only `max_lag_ms`).
    #[serde(default = "default_hang_ms")]
    pub max_hang_ms: u64,
    #[serde(default = "default_max_conns")]
    pub max_connections: usize,
    /// Seconds a connection closed on both sides is remembered.
    #[serde(default = "default_grace")]
    pub closed_grace_secs: u64,
    #[serde(default)]
    pub status_file: Option<PathBuf>,
    /// The kernel fast path (issue 22 item 4; docs/architecture.md, "Fast path: replica
    /// mode"): on the backup, an aligned connection's client packets are translated and its
    /// server's output digested and withheld by tc-BPF programs; on a primary without strict
    /// output commit, a protected connection's pure ACKs both ways and its server's output
    /// are gated in the kernel and the backup's reports written into the programs' map in
    /// place; the rest through the queue (or, for the primary's output, copied to the daemon)
    /// as before. Off by default while it is new.
    #[serde(default)]
    pub fast_path: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaConfig {
    pub replica: ReplicaSection,
    #[serde(rename = "service", default)]
    pub services: Vec<Service>,
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Replica {
    pub raw: ReplicaConfig,
    pub key: Key,
    pub role: Role,
    /// The service address (every service shares it).
    pub addr: Ipv4Addr,
}

impl Replica {
    pub fn load(path: &Path) -> Result<Replica, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("replica: config {}: {e}", path.display()))?;
        Replica::from_toml(&text).map_err(|e| format!("replica: {}: {e}", path.display()))
    }

    /// Parses and checks a configuration; every problem is one precise error.
    pub fn from_toml(text: &str) -> Result<Replica, String> {
        let raw: ReplicaConfig = toml::from_str(text).map_err(|e| format!("config: {e}"))?;
        let r = &raw.replica;
        let key = match (&r.key, &r.key_file) {
            (Some(k), None) => Key::from_hex(k).map_err(|e| format!("config: replica.key: {e} (give at least 32 hex digits)"))?,
            (None, Some(p)) => {
                let t = std::fs::read_to_string(p).map_err(|e| format!("config: replica.key_file {}: {e}", p.display()))?;
                Key::from_hex(t.trim()).map_err(|e| format!("config: replica.key_file {}: {e}", p.display()))?
            }
            _ => return Err("config: give exactly one of replica.key and replica.key_file (the side channel's shared key, the same on both hosts)".into()),
        };
        if raw.services.is_empty() {
            return Err("config: at least one [[service]] (addr, port) to replicate is required".into());
        }
        let mut addr = None;
        for s in &raw.services {
            let IpAddr::V4(a) = s.addr else {
                return Err(format!("config: service {}: IPv6 is not supported by replica mode yet (its takeover announces IPv4 addresses with ARP)", s.addr));
            };
            if s.port == 0 {
                return Err(format!("config: service {a}: port 0"));
            }
            if a.is_unspecified() || a.is_multicast() || a.is_broadcast() {
                return Err(format!("config: service {a}: not a unicast address"));
            }
            match addr {
                None => addr = Some(a),
                Some(b) if b != a => return Err(format!("config: services on {b} and {a}: replica mode protects one service address (several ports) per daemon")),
                _ => {}
            }
        }
        let addr = addr.expect("at least one service");
        unbroken_drivers::iptables::check_iface_name(&r.interface).map_err(|e| format!("config: replica.interface: {e}"))?;
        if r.listen.is_ipv4() != r.peer.is_ipv4() {
            return Err(format!("config: replica.listen {} and replica.peer {} are of different families", r.listen, r.peer));
        }
        if r.peer.port() == 0 || r.peer.ip().is_unspecified() {
            return Err(format!("config: replica.peer {}: give the other host's side-channel address and port", r.peer));
        }
        if r.peer == r.listen {
            return Err(format!("config: replica.peer {} is this host's own listen address", r.peer));
        }
        if r.peer.ip() == IpAddr::V4(addr) || r.listen.ip() == IpAddr::V4(addr) {
            return Err(format!("config: the side channel must use the hosts' own addresses, not the service address {addr} (both hosts hold it)"));
        }
        if r.heartbeat_interval_ms == 0 || r.heartbeat_interval_ms > 10_000 {
            return Err(format!("config: replica.heartbeat_interval_ms = {}: 1 to 10000", r.heartbeat_interval_ms));
        }
        if r.missed_beats == 0 || r.missed_beats > 1000 {
            return Err(format!("config: replica.missed_beats = {}: 1 to 1000", r.missed_beats));
        }
        if r.fence_command.is_empty() || r.fence_command[0].trim().is_empty() {
            return Err("config: replica.fence_command is required: the command (argv list) that cuts the other host off (power, switch port, its link) and exits 0 once it is: a live primary and an active backup must never both answer. [\"true\"] disables fencing at your own risk".into());
        }
        if r.fence_timeout_ms == 0 || r.fence_timeout_ms > 600_000 {
            return Err(format!("config: replica.fence_timeout_ms = {}: 1 to 600000", r.fence_timeout_ms));
        }
        if r.max_lag_bytes == 0 || r.max_lag_bytes > 1 << 30 {
            return Err(format!("config: replica.max_lag_bytes = {}: 1 to 1073741824", r.max_lag_bytes));
        }
        for (name, v) in [("max_lag_ms", r.max_lag_ms), ("max_delay_fin_ms", r.max_delay_fin_ms)] {
            if v == 0 || v > 3_600_000 {
                return Err(format!("config: replica.{name} = {v}: 1 to 3600000"));
            }
        }
        if r.max_hang_ms > 60_000 || (r.max_hang_ms > 0 && r.max_hang_ms < 2 * LISTEN_CHECK_MS) {
            return Err(format!("config: replica.max_hang_ms = {}: 0 (off) or {} to 60000 (the server is sampled every {LISTEN_CHECK_MS} ms)", r.max_hang_ms, 2 * LISTEN_CHECK_MS));
        }
        if r.max_connections == 0 || r.max_connections > 1 << 24 {
            return Err(format!("config: replica.max_connections = {}: 1 to {}", r.max_connections, 1 << 24));
        }
        if r.closed_grace_secs > 86_400 {
            return Err(format!("config: replica.closed_grace_secs = {}: at most 86400", r.closed_grace_secs));
        }
        let role = match r.role {
            RoleName::Primary => Role::Primary,
            RoleName::Backup => Role::Backup,
        };
        Ok(Replica { raw, key, role, addr })
    }

    pub fn settings(&self) -> Settings {
        let r = &self.raw.replica;
        Settings {
            role: self.role,
            detector: DetectorConfig { interval_ms: r.heartbeat_interval_ms, misses: r.missed_beats },
            engine: EngineConfig {
                strict: r.strict,
                max_lag_bytes: r.max_lag_bytes,
                max_lag_ms: r.max_lag_ms,
                max_delay_fin_ms: r.max_delay_fin_ms,
                max_hang_ms: r.max_hang_ms,
                max_conns: r.max_connections,
                ..EngineConfig::default()
            },
            finished_grace_ms: r.closed_grace_secs * 1000,
        }
    }

    /// This host's role as the config names it.
    pub fn role_name(&self) -> &'static str {
        crate::replica::core::role_name(self.role)
    }
}

/// Checks `replica.fence_command` at start: its program must exist and be executable (a
/// missing fencing command found only when the primary dies is an outage). `Ok(Some(line))`
/// is a warning to print: a command that fences nothing (`true`, `:`).
pub fn check_fence_command(argv: &[String]) -> Result<Option<String>, String> {
    use std::os::unix::fs::PermissionsExt;
    let Some(prog) = argv.first().filter(|p| !p.trim().is_empty()) else {
        return Err("replica.fence_command is empty".into());
    };
    let path = if prog.contains('/') {
        PathBuf::from(prog)
    } else {
        let dirs = std::env::var_os("PATH").unwrap_or_default();
        match std::env::split_paths(&dirs).map(|d| d.join(prog)).find(|p| p.is_file()) {
            Some(p) => p,
            None => return Err(format!("replica.fence_command: {prog:?} is not found in PATH ({}): give its full path", dirs.to_string_lossy())),
        }
    };
    let meta = std::fs::metadata(&path).map_err(|e| format!("replica.fence_command: {}: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("replica.fence_command: {} is not a file", path.display()));
    }
    if meta.permissions().mode() & 0o111 == 0 {
        return Err(format!("replica.fence_command: {} is not executable (chmod +x it)", path.display()));
    }
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if matches!(name, "true" | ":") {
        return Ok(Some(format!("replica: WARNING: fence_command = {argv:?} fences nothing: when the peer only seems dead (a cut side channel, a loaded host), both hosts will answer the clients and corrupt their connections. Use a command that cuts the other host off (power, switch port) and arbitrates, so that only one side can win")));
    }
    Ok(None)
}

/// Why the fast path (issue 22 item 4) is off for `cfg`, or `None` when it can run.
fn fast_path_off_because(cfg: &Replica) -> Option<String> {
    if !cfg.raw.replica.fast_path {
        return Some("replica.fast_path = false".into());
    }
    if cfg.role == Role::Primary && cfg.raw.replica.strict {
        return Some("the primary's half carries relaxed output commit only (replica.strict = true: its server's new output is held for the backup's digest, which the engine does)".into());
    }
    if let Err(e) = unbroken_drivers::fastpath::available() {
        return Some(e.to_string());
    }
    None
}

/// Loads the backup's programs and attaches them to `replica.interface` (copy mode, the
/// egress filter outliving it), or says why not. `spec`: the queue rules, whose OUTPUT jump the
/// take-over adds.
fn fast_path(cfg: &Replica, spec: &RuleSpec) -> Result<KernelMap, String> {
    use unbroken_drivers::fastpath::replica::Replica as Programs;
    if let Some(why) = fast_path_off_because(cfg) {
        return Err(why);
    }
    let r = &cfg.raw.replica;
    crate::checkpoint::runtime::mark_conflicts()?;
    if !unbroken_drivers::fastpath::is_ethernet(&r.interface) {
        return Err(format!("replica.interface {:?} is not an Ethernet device (the programs read an Ethernet header)", r.interface));
    }
    if cfg.role == Role::Primary {
        let mut fp = Programs::load().map_err(|e| e.to_string())?;
        for s in &cfg.raw.services {
            fp.add_service(SocketAddr::new(IpAddr::V4(cfg.addr), s.port)).map_err(|e| e.to_string())?;
        }
        fp.set_own_mark(REPLICA_MARK).map_err(|e| e.to_string())?;
        // Until the backup is heard the OUTPUT rule takes the output (the core switches).
        fp.set_queue_out(true).map_err(|e| e.to_string())?;
        // A lease from the start (the core renews it): a daemon that dies leaves its programs
        // claiming nothing after LEASE_MS.
        let now_ns = unbroken_drivers::fastpath::monotonic_ns();
        fp.set_lease(now_ns + crate::replica::core::LEASE_MS * 1_000_000).map_err(|e| e.to_string())?;
        fp.attach_primary(&r.interface).map_err(|e| e.to_string())?;
        let mut map = KernelMap::new_primary(fp, r.strict);
        map.watch_egress()?;
        return Ok(map);
    }
    // The server's packets reach tc egress only once their client's address is resolved: the
    // backup's ARP requests must name its host address (the service address's are suppressed).
    // The README has the operator set arp_announce = 2 on the device after the daemon started;
    // with the fast path it is needed from the first connection, so the daemon sets it now.
    let path = |dev: &str| format!("/proc/sys/net/ipv4/conf/{dev}/arp_announce");
    let announce = |dev: &str| std::fs::read_to_string(path(dev)).ok().and_then(|v| v.trim().parse::<u32>().ok()).unwrap_or(0);
    if announce("all").max(announce(&r.interface)) < 2 {
        std::fs::write(path(&r.interface), "2").map_err(|e| format!("net.ipv4.conf.{}.arp_announce must be 2 (this backup's ARP requests must name its host address: its server's packets reach tc egress only once their client's address is resolved) and setting it failed: {e}", r.interface))?;
        eprintln!("replica: set net.ipv4.conf.{}.arp_announce = 2 (the fast path needs the clients' addresses resolved before the take-over)", r.interface);
    }
    let mut fp = Programs::load().map_err(|e| e.to_string())?;
    for s in &cfg.raw.services {
        fp.add_service(SocketAddr::new(IpAddr::V4(cfg.addr), s.port)).map_err(|e| e.to_string())?;
    }
    // Our own raw sends pass the egress program untouched (a take-over whose OUTPUT rule
    // failed sends what the engine translated through the raw socket).
    fp.set_own_mark(REPLICA_MARK).map_err(|e| e.to_string())?;
    // A failure leaves a predecessor's filter (and ours, once attached) withholding: this run
    // then goes on without the fast path and removes them only after its OUTPUT jump is in
    // (`remove_egress_leftover`), never a moment with neither.
    fp.attach_backup(&r.interface).map_err(|e| e.to_string())?;
    let mut map = KernelMap::new(fp, r.strict, Some(spec.clone()));
    // Without its watch a removed filter would let the output out unseen (review finding 5):
    // no fast path then (the filter stays, withholding, until the OUTPUT jump is in).
    map.watch_egress()?;
    Ok(map)
}

/// The egress filter of an earlier backup daemon on this device (its fast path: it outlives
/// its daemon, fail closed): removed when this run does not take it over, else it would
/// consume the service's packets after this host takes over or serves as the primary.
fn remove_egress_leftover(cfg: &Replica) -> Result<(), String> {
    let r = &cfg.raw.replica;
    match unbroken_drivers::fastpath::replica::remove_egress(&r.interface) {
        Ok(0) => Ok(()),
        Ok(n) => {
            eprintln!("replica: removed the egress program of an earlier backup daemon on {} ({n} filter(s))", r.interface);
            Ok(())
        }
        // Not root, no such device: nothing of ours can be there.
        Err(unbroken_drivers::fastpath::Error::Unavailable(_)) => Ok(()),
        Err(e) => Err(format!("replica: the egress program of an earlier backup daemon on {} cannot be removed: {e}", r.interface)),
    }
}

/// This daemon's name on the host: its network namespace and queue (two lab hosts share one
/// BPF filesystem).
fn instance_name(queue: u16) -> String {
    use std::os::unix::fs::MetadataExt;
    let ns = std::fs::metadata("/proc/self/ns/net").map(|m| m.ino()).unwrap_or(0);
    format!("replica-net{ns}-q{queue}")
}

/// Where the backup of `queue` in this network namespace pins its queue rules' matches.
fn pin_dir(queue: u16) -> std::path::PathBuf {
    std::path::PathBuf::from(unbroken_drivers::fastpath::PIN_ROOT).join(instance_name(queue))
}

/// Removes an earlier daemon's pinned matches once no rule names them (said, never fatal).
fn unpin_matches(queue: u16) {
    if let Err(e) = unbroken_drivers::fastpath::replica::unpin_queue_matches(&pin_dir(queue)) {
        eprintln!("replica: cannot remove the pinned queue rule matches in {} ({e})", pin_dir(queue).display());
    }
}

/// The daemon's queue rules: client packets to the service (PREROUTING), its server's packets
/// back (OUTPUT).
fn rule_spec(cfg: &Replica) -> RuleSpec {
    let r = &cfg.raw.replica;
    let mut spec = RuleSpec::new(RuleSpec::chain_name("UNBROKEN-R", r.queue as u32), r.queue, REPLICA_MARK);
    spec.hooks = vec![BuiltinChain::Prerouting, BuiltinChain::Output];
    spec.services = cfg.raw.services.iter().map(|s| RuleService::tcp(s.addr, s.port)).collect();
    spec
}

fn arp_spec(cfg: &Replica) -> ArpSuppressSpec {
    ArpSuppressSpec::new(cfg.raw.replica.interface.clone(), cfg.addr)
}

/// The backup's receive rule: the client's frames it gets by mirroring (or from a hub) carry
/// the primary's MAC; without it the backup's stack ignores them.
fn rx_spec(cfg: &Replica) -> HubReceiveSpec {
    // Only TCP to the replicated ports: other ports and protocols of the address are the
    // primary's alone (a ping answered twice, a SYN to another port reset by the backup).
    HubReceiveSpec::tcp(cfg.raw.replica.interface.clone(), [IpAddr::V4(cfg.addr)], cfg.raw.services.iter().map(|s| s.port))
}

/// Removes what a stopped daemon left (`unbroken replica --remove-rules`): the queue rules and,
/// on a backup, the ARP suppression. Refused while a daemon still reads the queue.
pub fn remove_rules(cfg: &Replica) -> Result<(), String> {
    let r = &cfg.raw.replica;
    match Queue::open(&QueueConfig { queue_num: r.queue, ..QueueConfig::default() }) {
        Ok(q) => drop(q),
        Err(e) => return Err(format!("replica: NFQUEUE {} is in use ({e}): stop the daemon that reads it first", r.queue)),
    }
    Rules::remove_leftovers(&rule_spec(cfg)).map_err(|e| format!("replica: removing the queue rules: {e}"))?;
    unpin_matches(r.queue);
    if cfg.role == Role::Backup {
        ArpSuppress::remove_leftovers(&arp_spec(cfg)).map_err(|e| format!("replica: removing the ARP suppression: {e}"))?;
        HubReceive::remove_leftovers(&rx_spec(cfg)).map_err(|e| format!("replica: removing the receive rule: {e}"))?;
    }
    remove_egress_leftover(cfg)
}

/// What the status thread shows, copied from the core at the end of every round.
#[derive(Clone)]
struct View {
    state: State,
    counters: Counters,
    primary: Option<PrimaryCounters>,
    backup: Option<BackupCounters>,
    connections: usize,
    held_bytes: usize,
    peer_heard_at: Option<u64>,
    takeover_ms: Option<u64>,
    stale_why: Option<&'static str>,
    peer_problem: Option<&'static str>,
    peer_boot: Option<u64>,
    /// Backup: its server is hung (read and computed nothing while input waited).
    server_hung: bool,
    unprotected_by: Vec<(&'static str, u64)>,
    queue: unbroken_drivers::nfqueue::Stats,
    side_send_errors: u64,
    announce_errors: u64,
    /// The status's `fast_path` object (refreshed every [`FAST_STATUS_MS`]).
    fast: serde_json::Value,
}

/// How often the status's `fast_path` object is refreshed (it reads the programs' per-CPU
/// counters).
const FAST_STATUS_MS: u64 = 100;

struct ReplicaIo {
    sock: UdpSocket,
    wake: Arc<Wake>,
    fence_cmd: Vec<String>,
    fence_timeout: Duration,
    fence_tx: Sender<bool>,
    fence_rx: Receiver<bool>,
    arp: FailClosed<ArpSuppress>,
    announce: Option<(Announcer, Ipv4Addr)>,
    view: Arc<Mutex<View>>,
    dirty: Arc<AtomicBool>,
    last_state: State,
    side_send_errors: u64,
    announce_errors: u64,
    buf: Vec<u8>,
    /// Why the daemon stopped on its own (the exit status says so).
    fatal: Option<String>,
    /// This host's server, looked at every [`LISTEN_CHECK_MS`] by its own thread.
    server_looks: Option<Receiver<ServerLook>>,
    /// When the status's `fast_path` object was last refreshed.
    fast_status_at: Option<Instant>,
    /// The fast path's ring buffer (its records are drained every round).
    ring: Option<std::os::fd::RawFd>,
}

/// How often a host checks its server (its listeners, its sockets' input, its CPU time).
const LISTEN_CHECK_MS: u64 = 20;
/// How often the server's processes are looked up again (also whenever a listener changed or
/// one of them is gone): a walk of every process's descriptors.
const OWNER_SCAN_MS: u64 = 5_000;

/// The daemon's look at its own server (sock_diag and /proc; the verdicts are the core's):
/// its listening sockets (a server whose listener is gone has died or restarted: a primary
/// yields), the input its connections on the service address hold unread and its processes'
/// CPU time (a server that reads and computes nothing while input waits is hung:
/// [`Core::server_sample`]). It runs on a thread of its own ([`ServerCheck::spawn`]): a dump of
/// many sockets or a walk of `/proc` must never delay the packet loop and its beats.
struct ServerCheck {
    diag: unbroken_drivers::sockdiag::SockDiag,
    listen: Vec<std::net::SocketAddr>,
    /// The listeners' inodes at the last look, and the processes that hold them.
    inodes: Vec<u32>,
    pids: Vec<u32>,
    next_owner_scan: Instant,
}

/// One look of the [`ServerCheck`] thread: the listeners (`None`: the check failed), and the
/// server's sockets on the service address and CPU time (`None`: the dump failed, no verdict).
struct ServerLook {
    listening: Option<bool>,
    socks: Option<Vec<ServerSocket>>,
    cpu: Option<u64>,
}

impl ServerCheck {
    /// Looks every [`LISTEN_CHECK_MS`] on a thread of its own until the receiver is dropped.
    fn spawn(mut self) -> Receiver<ServerLook> {
        let (tx, rx) = channel();
        let spawned = std::thread::Builder::new().name("replica-check".into()).spawn(move || loop {
            if tx.send(self.look()).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(LISTEN_CHECK_MS)); // the sampling period
        });
        if let Err(e) = spawned {
            eprintln!("replica: cannot start the thread that watches this host's server ({e}): a crashed or hung server is found only through its connections, after max_lag_ms");
        }
        rx
    }

    fn look(&mut self) -> ServerLook {
        use unbroken_drivers::procfs;
        // An error of the check itself says nothing about the server: no verdict.
        let mut up = Some(true);
        let mut inodes = vec![];
        for a in self.listen.iter() {
            match self.diag.listener_inode(*a) {
                Ok(Some(i)) => inodes.push(i),
                Ok(None) => up = up.and(Some(false)),
                Err(_) => up = None,
            }
        }
        inodes.sort_unstable();
        inodes.dedup();
        let now = Instant::now();
        // The processes are looked up again when a listener changed, now and then, and (at
        // most that often) when one is gone; never with no listener (a walk for nothing).
        if !inodes.is_empty() && (inodes != self.inodes || now >= self.next_owner_scan) {
            self.pids = procfs::socket_owners(&inodes);
            self.next_owner_scan = now + Duration::from_millis(OWNER_SCAN_MS);
        }
        self.inodes = inodes;
        let cpu = if self.pids.is_empty() { None } else { procfs::cpu_ticks(&self.pids) };
        if cpu.is_none() && !self.pids.is_empty() {
            // A process gone: look again within a second.
            self.next_owner_scan = self.next_owner_scan.min(now + Duration::from_secs(1));
        }
        let mut socks = vec![];
        let mut ports: Vec<u16> = self.listen.iter().map(|a| a.port()).collect();
        ports.sort_unstable();
        ports.dedup();
        for port in ports {
            match self.diag.receive_queues(port) {
                // Only the service address's sockets: the ones both hosts share (a socket on
                // the host's own address or loopback exists on one host only).
                Ok(q) => socks.extend(q.into_iter().filter(|q| self.listen.iter().any(|a| a.ip() == q.local.ip())).map(|q| ServerSocket {
                    id: q.cookie,
                    key: unbroken_engines::replica::ConnKey { client: q.remote.ip(), client_port: q.remote.port(), server_port: q.local.port() },
                    unread: q.unread,
                    received: q.received,
                    send_queued: q.send_queued,
                    send_buf: q.send_buf,
                })),
                Err(_) => return ServerLook { listening: up, socks: None, cpu },
            }
        }
        ServerLook { listening: up, socks: Some(socks), cpu }
    }
}

/// What the backup installed to keep its stack from answering on its own (the ARP
/// suppression, the receive rule) and the queue rules that withhold its server's output:
/// left installed when the value goes away, whatever the reason (a start-up error after it was
/// installed, a panic in the loop, a clean stop), and said so unless `quiet`: fail closed. Only
/// [`FailClosed::remove`] (the takeover) removes the suppression.
trait LeaveInstalled {
    fn leave(self);
    fn what(&self) -> &'static str;
}

impl LeaveInstalled for ArpSuppress {
    fn leave(self) {
        self.leave_installed()
    }
    fn what(&self) -> &'static str {
        "the ARP suppression"
    }
}

impl LeaveInstalled for HubReceive {
    fn leave(self) {
        self.leave_installed()
    }
    fn what(&self) -> &'static str {
        "the receive rule"
    }
}

impl LeaveInstalled for Rules {
    fn leave(self) {
        self.leave_installed()
    }
    fn what(&self) -> &'static str {
        "the queue rules"
    }
}

struct FailClosed<T: LeaveInstalled> {
    inner: Option<T>,
    quiet: bool,
}

impl<T: LeaveInstalled> FailClosed<T> {
    fn new(t: Option<T>) -> FailClosed<T> {
        FailClosed { inner: t, quiet: false }
    }

    /// Takes it out (to remove it).
    fn take(&mut self) -> Option<T> {
        self.inner.take()
    }
}

impl<T: LeaveInstalled> Drop for FailClosed<T> {
    fn drop(&mut self) {
        if let Some(t) = self.inner.take() {
            if !self.quiet {
                eprintln!("replica: {} left installed (fail closed): `unbroken replica --config FILE --remove-rules` removes it", t.what());
            }
            t.leave();
        }
    }
}

/// Runs `argv` with a deadline, in a process group of its own: exit status 0 in time is
/// success; at the deadline the whole group is killed (a shell's children too).
fn run_fence(argv: &[String], timeout: Duration) -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    let mut child = std::process::Command::new(&argv[0]).args(&argv[1..]).stdin(std::process::Stdio::null()).process_group(0).spawn().map_err(|e| format!("cannot start {:?}: {e}", argv[0]))?;
    let t0 = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(st)) if st.success() => return Ok(()),
            Ok(Some(st)) => return Err(format!("{:?} exited with {st}", argv[0])),
            Ok(None) if t0.elapsed() >= timeout => {
                // SAFETY: a signal to the process group the child leads (its pid, set above).
                unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{:?} did not finish within {} ms (its process group killed)", argv[0], timeout.as_millis()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(2)), // polling a child's exit, not a synchronisation
            Err(e) => return Err(format!("waiting for {:?}: {e}", argv[0])),
        }
    }
}

impl ReplicaIo {
    fn execute(&mut self, out: &mut Outbox<Request>) {
        for r in out.requests.drain(..) {
            match r {
                Request::Side(d) => {
                    if self.sock.send(&d).is_err() {
                        // The peer's host unreachable (its link cut): its detector and ours
                        // decide; counted.
                        self.side_send_errors += 1;
                    }
                }
                Request::Fence => {
                    let (argv, timeout, tx, wake) = (self.fence_cmd.clone(), self.fence_timeout, self.fence_tx.clone(), self.wake.clone());
                    let spawned = std::thread::Builder::new().name("replica-fence".into()).spawn(move || {
                        let r = run_fence(&argv, timeout);
                        if let Err(e) = &r {
                            crate::ratelog::log("replica: fence", || format!("replica: fencing command: {e}"));
                        }
                        let _ = tx.send(r.is_ok());
                        wake.ring();
                    });
                    if let Err(e) = spawned {
                        crate::ratelog::log("replica: fence", || format!("replica: cannot start the fencing command's thread: {e}"));
                        let _ = self.fence_tx.send(false);
                        self.wake.ring();
                    }
                }
                Request::Announce => {
                    // Output is released already (the core took over before asking); the
                    // suppression goes, then the announcement (segment docs: in that order).
                    // The core asks again and again on a schedule: the suppression goes the first
                    // time.
                    if let Some(a) = self.arp.take() {
                        if let Err(e) = a.remove() {
                            self.announce_errors += 1;
                            crate::ratelog::log("replica: announce", || format!("replica: removing the ARP suppression: {e}"));
                        }
                    }
                    if let Some((ann, ip)) = &self.announce {
                        if let Err(e) = ann.announce(*ip) {
                            self.announce_errors += 1;
                            crate::ratelog::log("replica: announce", || format!("replica: announcing {ip}: {e}"));
                        }
                    }
                }
                Request::Log(line) => eprintln!("{line}"),
                Request::Fatal(why) => {
                    eprintln!("{why}");
                    self.fatal.get_or_insert(why);
                    daemon::stop();
                }
            }
        }
    }
}

impl daemon::Adapter<Core> for ReplicaIo {
    fn fds(&self) -> Vec<std::os::fd::RawFd> {
        let mut v = vec![self.sock.as_raw_fd(), self.wake.as_raw_fd()];
        v.extend(self.ring);
        v
    }

    fn after_wait(&mut self, core: &mut Core, now: u64) {
        // The programs' records before the queue's packets (a server's SYN-ACK the egress
        // program copied comes before the client's ACK that answers the primary's).
        core.fast_records(now);
    }

    fn service(&mut self, core: &mut Core, now: u64, ready: &[bool], out: &mut Outbox<Request>) {
        use daemon::Mode;
        self.execute(out);
        if ready.get(1) == Some(&true) {
            self.wake.clear();
        }
        // Side-channel datagrams: at most 256 a round (the packets come first).
        for _ in 0..256 {
            match self.sock.recv_from(&mut self.buf) {
                Ok((n, from)) => core.side(now, from, &self.buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                // ICMP errors of earlier sends (the peer's port closed): nothing to read.
                Err(_) => break,
            }
        }
        while let Ok(ok) = self.fence_rx.try_recv() {
            core.fence_done(ok, now);
        }
        if let Some(rx) = self.server_looks.as_ref() {
            while let Ok(look) = rx.try_recv() {
                if let Some(up) = look.listening {
                    core.server_listening(up);
                }
                match look.socks {
                    Some(socks) => core.server_sample(now, &socks, look.cpu),
                    None => core.server_sample_failed(),
                }
            }
        }
        core.collect(out);
        self.execute(out);
    }

    fn execute(&mut self, _: &mut Core, _: u64, out: &mut Outbox<Request>) {
        self.execute(out);
    }

    fn end_round(&mut self, core: &mut Core, queue: unbroken_drivers::nfqueue::Stats) {
        let state = core.state();
        if state != self.last_state {
            self.last_state = state;
            self.dirty.store(true, Ordering::Relaxed);
        }
        let mut v = crate::sync::lock(&self.view, "replica: view");
        v.state = state;
        v.counters = core.counters;
        v.primary = core.primary().map(|p| p.counters);
        v.backup = core.backup().map(|b| b.counters);
        v.connections = core.connections();
        v.held_bytes = core.primary().map_or(0, |p| p.held_bytes());
        v.peer_heard_at = core.peer_heard_at;
        v.takeover_ms = core.takeover_ms;
        v.stale_why = core.stale_why();
        v.peer_problem = core.peer_problem();
        v.peer_boot = core.peer_boot();
        v.server_hung = core.server_hung();
        if v.unprotected_by.len() != core.unprotected_by.len()
            || v.counters.unprotected != core.counters.unprotected
        {
            v.unprotected_by = core.unprotected_by.iter().map(|(k, n)| (*k, *n)).collect();
        }
        v.queue = queue;
        v.side_send_errors = self.side_send_errors;
        v.announce_errors = self.announce_errors;
        if self.fast_status_at.is_none_or(|t| t.elapsed() >= Duration::from_millis(FAST_STATUS_MS)) {
            self.fast_status_at = Some(Instant::now());
            v.fast = core.fast_status();
        }
    }
}

fn status_fields(view: Arc<Mutex<View>>, role: &'static str, started: Instant) -> impl FnMut(bool, u64) -> serde_json::Map<String, serde_json::Value> + Send + 'static {
    move |_, _| {
        let v = crate::sync::lock(&view, "replica: view").clone();
        let now = started.elapsed().as_millis() as u64;
        let mut m = serde_json::Map::new();
        let j = serde_json::json!({
            "role": role,
            "state": v.state,
            "peer_last_beat_age_ms": v.peer_heard_at.map(|t| now.saturating_sub(t)),
            "takeover_ms": v.takeover_ms,
            "stale_why": v.stale_why,
            "peer_problem": v.peer_problem,
            "server_hung": v.server_hung,
            "peer_boot": v.peer_boot.map(|b| format!("{b:016x}")),
            "connections": v.connections,
            "held_bytes": v.held_bytes,
            "unprotected": v.counters.unprotected,
            "unprotected_by": v.unprotected_by.iter().map(|(k, n)| (k.to_string(), serde_json::json!(n))).collect::<serde_json::Map<_, _>>(),
            "diverged": v.counters.diverged,
            "side_send_errors": v.side_send_errors,
            "announce_errors": v.announce_errors,
            "queue_errors": v.queue.enobufs + v.queue.verdict_errors,
            "fast_path": v.fast,
            "engine": match (v.primary, v.backup) {
                (Some(p), _) => serde_json::to_value(p).unwrap_or_default(),
                (_, Some(b)) => serde_json::to_value(b).unwrap_or_default(),
                _ => serde_json::Value::Null,
            },
        });
        if let serde_json::Value::Object(o) = j {
            m.extend(o);
        }
        if let Ok(serde_json::Value::Object(c)) = serde_json::to_value(v.counters) {
            m.extend(c);
        }
        m
    }
}

/// A random boot id and challenge secret for this process (the kernel's CSPRNG).
fn new_boot() -> Result<Boot, String> {
    let secret = crate::daemon::random_secret().map_err(|e| format!("replica: getrandom: {e}"))?;
    let more = crate::daemon::random_secret().map_err(|e| format!("replica: getrandom: {e}"))?;
    let id = u64::from_be_bytes(more[..8].try_into().expect("8 bytes")).max(1);
    Ok(Boot { id, secret })
}

/// A primary that was a backup before (restarted with the other role after a failover) may
/// find its own ARP suppression and receive rule still installed (a backup leaves them when it
/// stops): with them, this host cannot answer ARP for the service address. Removed, said so.
fn remove_backup_leftovers(cfg: &Replica) -> Result<(), String> {
    let r = &cfg.raw.replica;
    match ArpSuppress::owner(&arp_spec(cfg)) {
        Ok(None) => {}
        Ok(Some(_)) => {
            ArpSuppress::remove_leftovers(&arp_spec(cfg)).map_err(|e| format!("replica: a leftover ARP suppression on {} (this host was a backup): cannot remove it: {e}", r.interface))?;
            eprintln!("replica: removed a leftover ARP suppression on {} (this host was a backup before): it answers ARP for {} again", r.interface, cfg.addr);
        }
        // No nft on this host: nothing of a backup's can be there.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(format!("replica: checking for a leftover ARP suppression on {}: {e}", r.interface)),
    }
    if let Ok(Some(_)) = HubReceive::owner(&rx_spec(cfg)) {
        HubReceive::remove_leftovers(&rx_spec(cfg)).map_err(|e| format!("replica: a leftover receive rule on {} (this host was a backup): cannot remove it: {e}", r.interface))?;
        eprintln!("replica: removed a leftover receive rule on {} (this host was a backup before)", r.interface);
    }
    // A predecessor's egress filter goes once this run's own rules are in (`run`).
    Ok(())
}

/// Runs the daemon until SIGINT/SIGTERM. Prints one `ready` line once its rules, side channel
/// and (backup) ARP suppression are in place.
pub fn run(cfg: Replica) -> Result<(), String> {
    daemon::install_signals("replica", true);
    let r = cfg.raw.replica.clone();
    let role = cfg.role_name();
    let started = Instant::now();
    if let Some(path) = &r.status_file {
        crate::status::prepare(path, "replica: status_file")?;
    }
    // A fencing command that cannot run is found now, not when the peer dies.
    if let Some(warning) = check_fence_command(&r.fence_command).map_err(|e| format!("replica: {e}"))? {
        eprintln!("{warning}");
    }
    let boot = new_boot()?;
    // The backup's suppression first: its server must never answer ARP for the address. From
    // here on, whatever stops the daemon (an error below, a panic in the loop) leaves it and
    // the receive rule installed (fail closed).
    let mut spec = rule_spec(&cfg);
    Rules::check_owner(&spec).map_err(|e| format!("replica: {e}"))?;
    // The backup's fast path before the queue rules (issue 22 item 4): its egress program
    // withholds the server's output from now on (copy mode); claimed client packets skip the
    // queue (fast mark RETURN). The OUTPUT rule is in from the start, its match (`rep_q_out`)
    // taking the server's packets only after the take-over or once the egress filter is found
    // gone: each one map write, no iptables command in the packet loop (review findings 4, 5).
    // Without the pinned matches the take-over adds the OUTPUT jump itself.
    //
    // The primary's fast path the same way: its egress program gates its server's output in
    // copy mode, its ingress program learns from the client's pure ACKs; the OUTPUT rule's
    // match takes the output while the pair does not protect (`Core::fast_primary_mode`).
    // Without the pinned matches a primary runs without the fast path (its filter goes once
    // the OUTPUT jump is in, below).
    let fast = match fast_path(&cfg, &spec) {
        Ok(mut map) => {
            let pinned = unbroken_drivers::fastpath::object::ensure_bpffs().and_then(|()| map.fp.pin_queue_matches(&pin_dir(r.queue)));
            match pinned {
                Ok(m) => {
                    spec.fast_mark = Some(unbroken_drivers::fastpath::replica::MARK_DONE);
                    spec.bpf_match = Some(m);
                    map.rules = None;
                    Ok(map)
                }
                Err(e) if cfg.role == Role::Primary => {
                    unpin_matches(r.queue);
                    Err(format!("cannot pin the queue rules' matches ({e}): the primary switches its OUTPUT rule through them"))
                }
                Err(e) => {
                    eprintln!("replica: fast path: cannot pin the queue rules' matches ({e}): the take-over installs the OUTPUT queue rule itself (iptables in the packet loop)");
                    // Whichever of the two got pinned: no rule names it.
                    unpin_matches(r.queue);
                    spec.fast_mark = Some(unbroken_drivers::fastpath::replica::MARK_DONE);
                    spec.hooks = vec![BuiltinChain::Prerouting];
                    Ok(map)
                }
            }
        }
        Err(why) => Err(why),
    };
    let (arp, mut rx, announce) = if cfg.role == Role::Backup {
        let arp = FailClosed::new(Some(ArpSuppress::install(&arp_spec(&cfg)).map_err(|e| format!("replica: ARP suppression on {}: {e}", r.interface))?));
        let rx = FailClosed::new(Some(HubReceive::install(&rx_spec(&cfg)).map_err(|e| format!("replica: receive rule on {}: {e}", r.interface))?));
        let ann = Announcer::open(&r.interface).map_err(|e| format!("replica: announcer on {}: {e}", r.interface))?;
        (arp, rx, Some((ann, cfg.addr)))
    } else {
        remove_backup_leftovers(&cfg)?;
        (FailClosed::new(None), FailClosed::new(None), None)
    };
    let sock = UdpSocket::bind(r.listen).map_err(|e| format!("replica: side channel on {}: {e}", r.listen))?;
    sock.set_nonblocking(true).map_err(|e| format!("replica: side channel: {e}"))?;
    // Only the peer's datagrams reach the socket (the kernel drops the rest: a flood from
    // elsewhere cannot crowd the peer's beats out of the buffer), and room for a burst of full
    // beats of a large table.
    sock.connect(r.peer).map_err(|e| format!("replica: side channel to {}: {e}", r.peer))?;
    {
        let bytes: libc::c_int = 4 << 20;
        // SAFETY: a plain int option on a socket we own.
        unsafe { libc::setsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, &bytes as *const libc::c_int as *const libc::c_void, std::mem::size_of::<libc::c_int>() as libc::socklen_t) };
    }
    // Both queues take GSO super-packets whole: one crossing for up to 64 KiB of a server's
    // output. The backup only digests and withholds them before a take-over; its engine leaves
    // a checkpoint every CHECKPOINT_STEP inside them (with one at their ends only, the primary
    // stalled under large values), and the take-over cuts kept copies to the client's MSS
    // (docs/benchmarks.md, "GSO on the backup's queue"). The primary holds them as they came;
    // what it releases later goes out through a raw socket, which cannot send a 64 KiB packet:
    // its engine cuts released output into wire segments of the handshake's MSS.
    let qcfg = QueueConfig { queue_num: r.queue, max_len: 16384, rcvbuf: 64 << 20, gso: true, ..QueueConfig::default() };
    let mut queue = Queue::open(&qcfg).map_err(|e| format!("replica: cannot bind NFQUEUE {}: {e}", r.queue))?;
    if fast.is_ok() {
        // After the take-over `rep_b_out` passes only what the queue accepted (this mark, its
        // raw socket's too): a server packet that passed OUTPUT before the switch is copied to
        // this daemon instead of leaving untranslated. Only LOCAL_OUT (its server's packets).
        queue.set_accept_mark(Some((REPLICA_MARK, 3)));
    }
    let mut rules = FailClosed::new(Some(Rules::install_or_replace(&spec).map_err(|e| format!("replica: installing the queue rules: {e}"))?));
    if fast.is_ok() {
        if !spec.hooks.contains(&BuiltinChain::Output) {
            // A predecessor's OUTPUT jump (without the fast path): the egress program withholds now.
            Rules::remove_jump(&spec, BuiltinChain::Output).map_err(|e| format!("replica: removing the OUTPUT jump: {e}"))?;
        }
    } else {
        // A predecessor's egress filter (with the fast path, either role) goes only now that
        // the OUTPUT jump takes the server's output: never a moment with neither (a backup's
        // withholds; a primary's copies declined packets to a ring no one reads any more).
        // Its pinned matches too: the rules that named them are replaced.
        remove_egress_leftover(&cfg)?;
        unpin_matches(r.queue);
    }
    let raw = RawSender::new(REPLICA_MARK).map_err(|e| format!("replica: raw socket: {e}"))?;
    let wake = Arc::new(Wake::new().map_err(|e| format!("replica: eventfd: {e}"))?);
    let now_ms = move || started.elapsed().as_millis() as u64;
    let mut core = Core::new(cfg.settings(), cfg.key.clone(), r.peer, boot, now_ms());
    let ring = match fast {
        Err(why) => {
            eprintln!("replica: fast path off: {why}; every packet of the service goes through NFQUEUE {}", r.queue);
            core.fast_off(why);
            None
        }
        Ok(map) => {
            let what = if cfg.role == Role::Primary { "protected connections' pure ACKs and output stay in the kernel while the backup follows" } else { "aligned connections' client packets and server output stay in the kernel" };
            eprintln!("replica: fast path on: {what} (tc-BPF on {}; the egress filter outlives this daemon)", r.interface);
            let fd = map.fp.ring_fd();
            core.enable_fast_path(Box::new(map));
            Some(fd)
        }
    };
    let view = Arc::new(Mutex::new(View {
        state: core.state(),
        counters: core.counters,
        primary: None,
        backup: None,
        connections: 0,
        held_bytes: 0,
        peer_heard_at: None,
        takeover_ms: None,
        stale_why: None,
        peer_problem: None,
        peer_boot: None,
        server_hung: false,
        unprotected_by: Vec::new(),
        queue: Default::default(),
        side_send_errors: 0,
        announce_errors: 0,
        fast: serde_json::Value::Null,
    }));
    let dirty = Arc::new(AtomicBool::new(true));
    let plan = daemon::StatusPlan { name: "replica", path: r.status_file.clone(), period: Duration::from_millis(100), dirty: dirty.clone(), started };
    daemon::spawn_status(plan, status_fields(view.clone(), role, started)).map_err(|e| format!("replica: status thread: {e}"))?;
    let (fence_tx, fence_rx) = channel();
    let mut io = ReplicaIo {
        sock,
        wake,
        fence_cmd: r.fence_command.clone(),
        fence_timeout: Duration::from_millis(r.fence_timeout_ms),
        fence_tx,
        fence_rx,
        arp,
        announce,
        view,
        dirty,
        last_state: State::WaitingForPeer,
        side_send_errors: 0,
        announce_errors: 0,
        buf: vec![0u8; 2048],
        fatal: None,
        server_looks: match unbroken_drivers::sockdiag::SockDiag::open() {
            Ok(diag) => {
                let listen = cfg.raw.services.iter().map(|s| std::net::SocketAddr::new(IpAddr::V4(cfg.addr), s.port)).collect();
                Some(ServerCheck { diag, listen, inodes: vec![], pids: vec![], next_owner_scan: Instant::now() }.spawn())
            }
            Err(e) => {
                eprintln!("replica: cannot open sock_diag to watch this host's server ({e}): a crashed or hung server is found only through its connections, after max_lag_ms");
                None
            }
        },
        fast_status_at: None,
        ring,
    };
    println!(
        "unbroken replica: ready role={role} service={}:{:?} queue={} side={}->{} strict={} beat={}ms x{}",
        cfg.addr,
        cfg.raw.services.iter().map(|s| s.port).collect::<Vec<_>>(),
        r.queue,
        r.listen,
        r.peer,
        r.strict,
        r.heartbeat_interval_ms,
        r.missed_beats
    );
    let _ = io::stdout().flush();
    // The beats vouch for this loop (they are sent from it): on a loaded host a loop that waits
    // for the CPU looks dead to the peer, which then fences this host. Nice -10 as the agent's
    // loop (SCHED_FIFO starves the local server on a 2-core host, see agent.rs).
    // SAFETY: plain system calls on the calling thread.
    let raised = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::syscall(libc::SYS_gettid) as libc::id_t, -10) == 0 };
    if !raised {
        eprintln!("replica: cannot raise the packet loop's priority (nice -10): under CPU load its beats may be late and the peer may suspect this host");
    }
    let mode = Mutex::new(core);
    let res = daemon::run(&mut daemon::PacketIo::new("replica", &mut queue, Some(&raw)), &mode, &mut io, now_ms);
    daemon::stop();
    // The queue rules stay (fail closed, as when the daemon is killed): a backup whose rules
    // went would let its server answer the clients on its own. `--remove-rules` removes them.
    // The suppression and the receive rule stay too: a backup that stops without taking over
    // must never start answering ARP for the address. A clean stop leaves them quietly (as
    // documented); any other way out of this function says so (FailClosed's drop).
    if res.is_ok() && io.fatal.is_none() {
        rules.quiet = true;
        io.arp.quiet = true;
        rx.quiet = true;
    }
    match io.fatal.take() {
        Some(why) => Err(why),
        None => res,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    static LEFT: AtomicU32 = AtomicU32::new(0);

    struct Table;

    impl LeaveInstalled for Table {
        fn leave(self) {
            LEFT.fetch_add(1, Ordering::SeqCst);
        }
        fn what(&self) -> &'static str {
            "a test table"
        }
    }

    /// Issue 20 item 14: a panic in the loop (or a start-up error after the tables went in)
    /// unwinds through their owners; they must stay installed (fail closed), not be removed.
    /// Only taking one out (the takeover) lets it go.
    #[test]
    fn hostile_panic_leaves_the_backup_tables_installed() {
        let r = std::panic::catch_unwind(|| {
            let _arp = FailClosed::new(Some(Table));
            let _rx = FailClosed::new(Some(Table));
            panic!("a bug reached by a hostile datagram");
        });
        assert!(r.is_err());
        assert_eq!(LEFT.load(Ordering::SeqCst), 2);
        let mut taken = FailClosed::new(Some(Table));
        assert!(taken.take().is_some());
        drop(taken);
        assert_eq!(LEFT.load(Ordering::SeqCst), 2, "taken out: the caller removes it");
    }

    /// Issue 20 item 14: at the deadline the fencing command's whole process group is killed,
    /// not only the direct child (a shell's `sleep` used to live on).
    #[test]
    fn hostile_fence_timeout_kills_the_whole_process_group() {
        let dir = std::env::temp_dir().join(format!("unbroken-fence-pg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pidfile = dir.join("pid");
        let script = format!("sleep 600 & echo $! > {}.tmp && mv {0}.tmp {0}; wait", pidfile.display());
        let argv: Vec<String> = vec!["sh".into(), "-c".into(), script];
        // A fence timeout the shell outlasts after starting its child; on a host so loaded that
        // it had not started it yet, again with a longer one (never a guess at how long it takes).
        let mut pid = None;
        for timeout_ms in [1_000, 4_000, 16_000] {
            let e = run_fence(&argv, Duration::from_millis(timeout_ms)).unwrap_err();
            assert!(e.contains("process group killed"), "{e}");
            if let Ok(t) = std::fs::read_to_string(&pidfile) {
                pid = Some(t.trim().parse::<u32>().unwrap());
                break;
            }
        }
        let pid = pid.expect("the shell started its child within 16 s");
        let deadline = Instant::now() + Duration::from_secs(30);
        // Wait (bounded) for the grandchild to be gone or a zombie awaiting its reaper.
        let gone = loop {
            match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
                Err(_) => break true,
                Ok(st) if st.rsplit(')').next().is_some_and(|r| r.trim_start().starts_with('Z')) => break true,
                Ok(_) if Instant::now() > deadline => break false,
                Ok(_) => std::thread::yield_now(),
            }
        };
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(gone, "the fencing command's child {pid} outlived its deadline");
    }
}
