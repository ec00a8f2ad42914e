//! `unbroken agent`: object mode (TRODS-KV, seed 000) beside an unmodified HTTP server.
//!
//! One packet loop runs the [`trods`](unbroken_engines::trods) engine over an NFQUEUE that
//! sees the service's packets both ways (mangle PREROUTING for the client's, OUTPUT for the
//! server's), and talks to the store through the asynchronous [`StoreHandle`]: a store that is
//! down or slow completes operations with errors, and the engine then lets the connection go
//! on unprotected (counted) instead of stalling it.
//!
//! A client packet of a connection this server does not know starts a failover (section 3.2)
//! when the load balancer says its bucket changed hands recently (section 5.1; the bucket is
//! read from the marker source MAC the LB writes, see [`crate::lb`]). A worker thread fetches
//! the record, plans with [`plan_recovery`], rebuilds the client's connection with TCP_REPAIR,
//! hands it to the engine (so it stays protected), resumes the interrupted responses from the
//! local server with Range requests, and then relays further requests to the local server.
//! The packets that arrived meanwhile wait in the queue and are released once the socket
//! exists. A refusal (no record, a position the record does not explain, a store error) lets
//! the packets reach the kernel, which has no socket for them and answers with a RST: the
//! client learns at once, and the refusal is counted.

use crate::lb::{bucket_of_mac, HeartbeatClient, LoopWatch};
use crate::store::{Op, OpKind, Reply, Store, StoreConfig, StoreHandle};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use unbroken_drivers::iptables::{BuiltinChain, RuleSpec, Rules, Service};
use unbroken_drivers::nfqueue::{Queue, QueueConfig, QueuedPacket, Verdict as QVerdict};
use unbroken_drivers::repair::{self, RepairSpec};
use unbroken_engines::trods::{self, plan_recovery, Action, Dir, Engine, Key, Plan, Record, Trigger, Verdict};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

// ---- configuration ------------------------------------------------------------------------------

/// `[agent]` of the agent's TOML file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AgentSection {
    /// This server's id in the LB's `[[server]]` list.
    pub server_id: u16,
    /// The shared service addresses, `"10.77.0.100:80"`, `"[fd77::100]:80"`.
    pub services: Vec<String>,
    /// The local HTTP server the agent resumes from (`127.0.0.1:80`).
    #[serde(default = "default_backend")]
    pub backend: String,
    /// NFQUEUE number.
    #[serde(default = "default_queue")]
    pub queue: u16,
    /// The LB's heartbeat address; without it no heartbeats are sent and `failover_gate`
    /// must be `"open"`.
    #[serde(default)]
    pub lb: Option<String>,
    #[serde(default = "default_hb_ms")]
    pub heartbeat_interval_ms: u64,
    /// Hex key shared with the LB (heartbeat MACs).
    #[serde(default)]
    pub key: String,
    /// `"lb"`: start failover only for buckets the LB moved to this server recently (TRODS
    /// section 5.1). `"open"`: for any unknown connection (labs without an LB).
    #[serde(default = "default_gate")]
    pub failover_gate: String,
    /// Status JSON written every 500 ms.
    #[serde(default)]
    pub status_file: Option<PathBuf>,
    /// Ask the clients of buckets that just moved here for an ACK instead of waiting for
    /// their retransmission timeout.
    #[serde(default = "default_true")]
    pub probe: bool,
    /// The packet loop counts as wedged (and heartbeats stop, so the LB moves this server's
    /// buckets) after this long in one iteration, milliseconds.
    #[serde(default = "default_wedged_ms")]
    pub wedged_after_ms: u64,
}

fn default_wedged_ms() -> u64 {
    50
}

fn default_backend() -> String {
    "127.0.0.1:80".into()
}
fn default_queue() -> u16 {
    7
}
fn default_hb_ms() -> u64 {
    5
}
fn default_gate() -> String {
    "lb".into()
}
fn default_true() -> bool {
    true
}

/// `[store]` of the agent's TOML file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StoreSection {
    /// Redis nodes (`host:port`); one plain Redis, or seeds of a Redis Cluster.
    pub nodes: Vec<String>,
    /// Per-operation timeout (ms). A store that answers later leaves the connection
    /// unprotected rather than stalling it.
    #[serde(default = "default_store_ms")]
    pub timeout_ms: u64,
    #[serde(default)]
    pub password: Option<String>,
    /// Key prefix.
    #[serde(default = "default_prefix")]
    pub prefix: String,
    /// Records expire after this long without an update (s), in case a delete is lost.
    #[serde(default = "default_ttl")]
    pub ttl_s: u64,
}

fn default_store_ms() -> u64 {
    50
}
fn default_prefix() -> String {
    "ub:".into()
}
fn default_ttl() -> u64 {
    24 * 3600
}

/// The agent's whole configuration file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    pub agent: AgentSection,
    pub store: StoreSection,
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Agent {
    pub raw: AgentConfig,
    pub services: Vec<SocketAddr>,
    pub backend: SocketAddr,
    pub lb: Option<SocketAddr>,
    pub key: Vec<u8>,
    pub gate_open: bool,
}

impl Agent {
    /// Parses and validates a TOML text.
    pub fn from_toml(text: &str) -> Result<Agent, String> {
        let raw: AgentConfig = toml::from_str(text).map_err(|e| format!("agent config: {e}"))?;
        let a = &raw.agent;
        let services = a
            .services
            .iter()
            .map(|s| s.parse::<SocketAddr>().map_err(|e| format!("agent.services: {s:?}: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        if services.is_empty() {
            return Err("agent.services: at least one service address is needed".into());
        }
        let backend = a.backend.parse().map_err(|e| format!("agent.backend: {:?}: {e}", a.backend))?;
        let lb = match &a.lb {
            Some(s) => Some(s.parse().map_err(|e| format!("agent.lb: {s:?}: {e}"))?),
            None => None,
        };
        let gate_open = match a.failover_gate.as_str() {
            "lb" => false,
            "open" => true,
            g => return Err(format!("agent.failover_gate: {g:?}: expected \"lb\" or \"open\"")),
        };
        if !gate_open && lb.is_none() {
            return Err("agent.failover_gate = \"lb\" needs agent.lb (or use \"open\" without an LB)".into());
        }
        if a.wedged_after_ms == 0 || a.wedged_after_ms > 60_000 {
            return Err("agent.wedged_after_ms: 1..=60000".into());
        }
        if a.heartbeat_interval_ms == 0 || a.heartbeat_interval_ms > 10_000 {
            return Err("agent.heartbeat_interval_ms: 1..=10000".into());
        }
        let key = crate::lb::parse_key_hex(&a.key).map_err(|e| format!("agent.key: {e}"))?;
        if raw.store.nodes.is_empty() {
            return Err("store.nodes: at least one Redis address is needed".into());
        }
        if raw.store.timeout_ms == 0 || raw.store.timeout_ms > 60_000 {
            return Err("store.timeout_ms: 1..=60000".into());
        }
        Ok(Agent { raw, services, backend, lb, key, gate_open })
    }

    /// Reads and validates a file.
    pub fn load(path: &std::path::Path) -> Result<Agent, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::from_toml(&text)
    }

    fn store_config(&self) -> StoreConfig {
        let s = &self.raw.store;
        StoreConfig {
            nodes: s.nodes.clone(),
            timeout: Duration::from_millis(s.timeout_ms),
            password: s.password.clone(),
            ttl: (s.ttl_s > 0).then(|| Duration::from_secs(s.ttl_s)),
            key_prefix: s.prefix.clone(),
            ..StoreConfig::default()
        }
    }
}

/// The store key of a connection: its LB bucket first, so the clients of a bucket can be
/// found when it moves (`b<bucket>/c/<client>/<service>`; `b-` without an LB).
pub fn store_key(bucket: Option<u16>, key: &Key) -> String {
    match bucket {
        Some(b) => format!("b{b}/{}", key.store_key()),
        None => format!("b-/{}", key.store_key()),
    }
}

// ---- counters and status ------------------------------------------------------------------------

/// What the agent itself counts (the engine's counters are reported beside these).
#[derive(Debug, Clone, Default, Serialize)]
pub struct AgentCounters {
    pub failovers_started: u64,
    pub failovers: u64,
    pub failovers_denied: u64,
    pub refused: u64,
    pub refused_no_record: u64,
    pub refused_store: u64,
    pub refused_plan: u64,
    pub refused_rebuild: u64,
    pub resume_mismatch: u64,
    pub resume_errors: u64,
    pub resumed_bytes: u64,
    pub probes_sent: u64,
    /// Probes sent again for connections not rebuilt here yet (see `probe_buckets`).
    #[serde(default)]
    pub probes_repeated: u64,
    /// Connections silenced because the LB gave their bucket to another server.
    pub muted: u64,
    /// Rebuilt connections rebuilt again because the client acknowledged bytes another server
    /// sent after this one planned (a stand-in that had not stopped yet).
    pub superseded: u64,
    /// Workers of rebuilt sockets stopped because their connection was muted or superseded.
    pub workers_stopped: u64,
    /// Connections this agent never saw set up whose packets a local socket owns (the agent
    /// restarted under them): passed at once and known from then on, unprotected.
    pub passed_local_socket: u64,
    /// Lookups of local sockets that failed (the packet then waits at the gate as before).
    pub sockdiag_errors: u64,
    /// Trigger packet to rebuilt socket, microseconds.
    pub failover_us_last: u64,
    pub failover_us_max: u64,
    /// Queue overflows (each lost one or more packets) and rejected verdicts.
    pub queue_errors: u64,
    pub store_submitted: u64,
    /// Server packets held because this server's lease from the LB had lapsed (fencing).
    pub fenced_held: u64,
    /// Server packets dropped by the fence: their bucket belongs to another server now, or
    /// the lease stayed lapsed for FENCE_MAX_MS.
    pub fenced_dropped: u64,
    /// Heartbeats not sent because the packet loop was wedged.
    pub heartbeats_skipped_wedged: u64,
    /// The packet loop runs at nice -10.
    pub loop_realtime: bool,
    pub recent_refusals: Vec<String>,
}

struct Shared {
    counters: Mutex<AgentCounters>,
    /// A failover or refusal happened: write the status file now, not at the next period.
    dirty: AtomicBool,
}

impl Shared {
    fn count(&self, f: impl FnOnce(&mut AgentCounters)) {
        f(&mut self.counters.lock().unwrap());
    }
}

// ---- messages from failover workers -------------------------------------------------------------

enum Msg {
    /// The socket is rebuilt: adopt, release the waiting packets, then tell the worker.
    Adopt { key: Key, bucket: Option<u16>, rec: Box<Record>, plan: Box<Plan>, started: Instant, go: Sender<()> },
    /// A stale local socket holds the connection's address pair (e.g. nginx's socket, muted
    /// when the bucket went elsewhere): make sure the engine drops whatever it sends, then
    /// answer, so the worker can destroy it.
    Quiesce { key: Key, go: Sender<()> },
    /// Give up on this connection: the waiting packets reach the kernel (RST).
    Refuse { key: Key, why: String },
}

/// Packets with this mark skip the agent's queue (its own probes).
const AGENT_MARK: u32 = 0x7562;

/// How long a packet refused by the failover gate waits for the LB's news (ms).
const GATE_WAIT_MS: u64 = 100;

/// How long a server packet waits for this server's lease to be renewed before it is dropped
/// (its TCP sends it again), milliseconds; and how many may wait.
const FENCE_MAX_MS: u64 = 1000;
const FENCE_MAX_PACKETS: usize = 4096;

/// A server packet held by the fence.
struct Fenced {
    since: u64,
    p: QueuedPacket,
}

/// The agent's queue rules let packets with this mark pass (`-m mark --mark ... -j RETURN`):
/// the ACKs the engine builds ([`Engine::take_injected`]) are sent with it.
const INJECT_MARK: u32 = AGENT_MARK;

struct GateWait {
    key: Key,
    id: u32,
    data: Vec<u8>,
    bucket: Option<u16>,
    since: u64,
}

struct Recovering {
    held: Vec<(u32, Vec<u8>)>,
}

/// A Linux eventfd used to wake the packet loop from other threads.
struct Wake(std::os::fd::OwnedFd);

impl Wake {
    fn new() -> io::Result<Wake> {
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Wake(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }))
    }
    fn ring(&self) {
        let one: u64 = 1;
        unsafe { libc::write(self.0.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
    }
    fn clear(&self) {
        let mut v: u64 = 0;
        unsafe { libc::read(self.0.as_raw_fd(), &mut v as *mut u64 as *mut libc::c_void, 8) };
    }
}

fn poll_fds(fds: &[i32], timeout_ms: i32) -> Vec<bool> {
    let mut p: Vec<libc::pollfd> = fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    let n = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, timeout_ms) };
    if n <= 0 {
        return vec![false; fds.len()];
    }
    p.iter().map(|x| x.revents != 0).collect()
}

// ---- the packet loop ----------------------------------------------------------------------------

/// Runs the agent until SIGINT/SIGTERM (SIGHUP is ignored, see [`crate::signals`]). Prints one `ready` line once traffic is steered.
pub fn run(cfg: Agent) -> Result<(), String> {
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    crate::signals::ignore_hangup("agent");
    let a = &cfg.raw.agent;
    let started = Instant::now();
    let mono_ms = || started.elapsed().as_millis() as u64;
    let store = Arc::new(StoreHandle::start(&cfg.store_config()).map_err(|e| format!("agent: store: {e}"))?);
    let watch = Arc::new(LoopWatch::new(Duration::from_millis(a.wedged_after_ms)));
    let hb = match cfg.lb {
        Some(lb) => Some(
            HeartbeatClient::start_watched(a.server_id, lb, Duration::from_millis(a.heartbeat_interval_ms), &cfg.key, Some(watch.clone()))
                .map_err(|e| format!("agent: heartbeats to {lb}: {e}"))?,
        ),
        None => None,
    };
    // Room for bursts of 64 KiB GSO segments from hundreds of connections: a packet the
    // kernel cannot queue is dropped before it is sent (the engine then drops what follows
    // until the server's TCP resends it).
    let qcfg = QueueConfig { queue_num: a.queue, max_len: 16384, rcvbuf: 128 << 20, ..QueueConfig::default() };
    let mut queue = Queue::open(&qcfg).map_err(|e| format!("agent: cannot bind NFQUEUE {}: {e}", a.queue))?;
    let mut spec = RuleSpec::new(RuleSpec::chain_name("UNBROKEN-A", a.queue as u32), a.queue, AGENT_MARK);
    spec.hooks = vec![BuiltinChain::Prerouting, BuiltinChain::Output];
    spec.services = cfg.services.iter().map(|s| Service::tcp(s.ip(), s.port())).collect();
    let rules = Rules::install_or_replace(&spec).map_err(|e| format!("agent: installing rules: {e}"))?;
    // Without it a kept-alive client may wait for its retransmission timer between requests
    // (see the engine's docs), but it is served correctly.
    let inject = unbroken_drivers::rawsend::RawSender::new(INJECT_MARK).map_err(|e| eprintln!("agent: raw socket for injected ACKs: {e}")).ok();
    let mut inject_errors = 0u64;

    let shared = Arc::new(Shared { counters: Mutex::new(AgentCounters::default()), dirty: AtomicBool::new(false) });
    let wake = Arc::new(Wake::new().map_err(|e| format!("agent: eventfd: {e}"))?);
    let (tx, rx): (Sender<Msg>, Receiver<Msg>) = channel();
    let mut engine = Engine::new(trods::Config::default());
    let engine_view: Arc<Mutex<(trods::Counters, usize, usize)>> = Arc::new(Mutex::new(Default::default()));
    if let Some(path) = a.status_file.clone() {
        let (shared, ev) = (shared.clone(), engine_view.clone());
        let store = store.clone();
        std::thread::spawn(move || status_loop(path, shared, ev, store, started));
    }
    println!("unbroken agent: ready server={} queue={} services={:?} gate={}", a.server_id, a.queue, a.services, a.failover_gate);
    let _ = io::stdout().flush();

    let mut batch: Vec<QueuedPacket> = Vec::with_capacity(64);
    let mut buckets: HashMap<Key, Option<u16>> = HashMap::new();
    let mut recovering: HashMap<Key, Recovering> = HashMap::new();
    let mut refused: HashMap<Key, u64> = HashMap::new();
    let mut csum: HashMap<u64, bool> = HashMap::new();
    let mut completions = Vec::new();
    let mut last_expire = 0;
    let mut probed_epoch = 0u32;
    let ctx = Arc::new(WorkerCtx {
        adopted: Mutex::new(HashMap::new()),
        next_gen: std::sync::atomic::AtomicU64::new(1),
        store_cfg: cfg.store_config(),
        backend: cfg.backend,
        tx: tx.clone(),
        wake: wake.clone(),
        shared: shared.clone(),
    });
    let fds = [queue.as_raw_fd(), store.wake_fd(), wake.0.as_raw_fd()];
    let mut gate_wait: Vec<GateWait> = Vec::new();
    let mut diag = unbroken_drivers::sockdiag::SockDiag::open().map_err(|e| format!("agent: sock_diag: {e}"))?;
    let mut last_owner_check = 0u64;
    let mut fenced: Vec<Fenced> = Vec::new();
    // The packet loop is the data path and its progress is what the heartbeats vouch for
    // (LoopWatch): ordinary work must not starve it. Nice -10 (weight ~9x a normal thread);
    // SCHED_FIFO was tried and starves the agent's own store thread and Redis on a 2-core host
    // at full speed (a connection went unprotected on a store timeout). Failover workers set
    // their own lower priority.
    let loop_realtime = {
        // SAFETY: plain system call on the calling thread.
        unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, tid, -10) == 0
        }
    };
    if !loop_realtime {
        eprintln!("agent: cannot raise the packet loop's priority (nice -10): under CPU load its heartbeats may stop and the LB may move this server's buckets");
    }
    shared.count(|c| c.loop_realtime = loop_realtime);
    let mut owner_epoch = 0u32;
    let res: Result<(), String> = loop {
        if STOP.load(Ordering::SeqCst) {
            break Ok(());
        }
        watch.idle();
        let wait = if !gate_wait.is_empty() || !fenced.is_empty() { 2 } else { 100 };
        let ready = poll_fds(&fds, wait);
        watch.busy();
        let now = mono_ms();
        // 0. The fence (leases, see crate::detector): this server sends on a connection only
        // while the LB's lease on its bucket holds. While the lease has lapsed (the LB may be
        // moving this server's buckets) server packets wait; once it is renewed they go on in
        // order, or are dropped if their bucket went to another server meanwhile.
        // The view of this iteration (one copy per iteration; the owner check and the probes
        // below use it too).
        let lease = hb.as_ref().map(|h| h.view());
        let now_i = Instant::now();
        let lease_ok = match &lease {
            None => true, // no LB: no fencing
            Some(v) => v.as_ref().is_some_and(|v| now_i < v.lease_until),
        };
        if !fenced.is_empty() {
            let (old, keep): (Vec<Fenced>, Vec<Fenced>) = fenced.drain(..).partition(|f| now.saturating_sub(f.since) >= FENCE_MAX_MS);
            for f in old {
                let _ = queue.set_verdict(f.p.id, QVerdict::Drop, None);
                shared.count(|c| c.fenced_dropped += 1);
            }
            fenced = keep;
        }
        let mut released: Vec<QueuedPacket> = Vec::new();
        if lease_ok && !fenced.is_empty() {
            released = fenced.drain(..).map(|f| f.p).collect();
        }
        // 1. packets
        if ready[0] || !released.is_empty() {
            if ready[0] {
                match queue.recv_batch(&mut batch, 64, Some(Duration::ZERO)) {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => break Err(format!("agent: queue receive: {e}")),
                }
            } else {
                batch.clear();
            }
            if !released.is_empty() {
                batch.splice(0..0, released.drain(..));
            }
            for p in batch.iter_mut() {
                if p.truncated() {
                    let _ = queue.set_verdict(p.id, QVerdict::Drop, None);
                    continue;
                }
                let dir = if p.hook == 3 { Dir::ToClient } else { Dir::FromClient };
                let bucket = p.hw_src.and_then(bucket_of_mac);
                let key = Trigger::parse(&p.data).map(|(k, _)| k);
                let key = match (key, dir) {
                    (Some(k), Dir::FromClient) => Some(k),
                    (Some(k), Dir::ToClient) => Some(Key { client: k.service, service: k.client }),
                    (None, _) => None,
                };
                if let (Dir::ToClient, Some(lease)) = (dir, &lease) {
                    if !lease_ok {
                        if fenced.len() < FENCE_MAX_PACKETS {
                            fenced.push(Fenced { since: now, p: std::mem::take(p) });
                            shared.count(|c| c.fenced_held += 1);
                        } else {
                            let _ = queue.set_verdict(p.id, QVerdict::Drop, None);
                            shared.count(|c| c.fenced_dropped += 1);
                        }
                        continue;
                    }
                    let b = key.and_then(|k| buckets.get(&k).copied().flatten());
                    if let (Some(v), Some(b)) = (lease, b) {
                        if !v.owns(b) {
                            // Another server speaks for this connection now.
                            let _ = queue.set_verdict(p.id, QVerdict::Drop, None);
                            shared.count(|c| c.fenced_dropped += 1);
                            continue;
                        }
                    }
                }
                if let (Some(k), Dir::FromClient) = (key, dir) {
                    if let Some(r) = recovering.get_mut(&k) {
                        r.held.push((p.id, std::mem::take(&mut p.data)));
                        continue;
                    }
                    if refused.contains_key(&k) && !engine.knows(&k) {
                        let _ = queue.set_verdict(p.id, QVerdict::Accept, None);
                        continue;
                    }
                }
                let v = engine.packet(p.id as u64, &mut p.data, dir, now);
                flush_released(&mut engine, &mut queue, &mut csum);
                match v {
                    Verdict::Accept { modified } => {
                        if let (Some(k), Dir::FromClient, Some(b)) = (key, dir, bucket) {
                            buckets.insert(k, Some(b));
                        }
                        accept(&mut queue, p.id, &mut p.data, modified, p.csum_not_ready);
                    }
                    Verdict::Drop => {
                        let _ = queue.set_verdict(p.id, QVerdict::Drop, None);
                    }
                    Verdict::Held => {
                        csum.insert(p.id as u64, p.csum_not_ready);
                    }
                    Verdict::Unknown => {
                        let k = key.expect("unknown packets parse");
                        if silence_adopted(&ctx, &k) {
                            // The engine found the client acknowledging bytes this server's
                            // rebuilt socket never sent (another server sent them after the
                            // plan): stop that socket; this packet rebuilds it from its ACK.
                            eprintln!("agent: {} acknowledged bytes not sent from here: rebuilding from its ACK", k.client);
                            shared.count(|c| c.superseded += 1);
                        }
                        gate_wait.push(GateWait { key: k, id: p.id, data: std::mem::take(&mut p.data), bucket, since: now });
                    }
                }
            }
        }
        // 1b. the failover gate (TRODS section 5.1). A packet of a connection this server does
        // not know starts a failover only if the LB moved its bucket here recently. The LB's
        // table can reach the kernel a few milliseconds before its news reaches this agent, so
        // a refused packet waits up to GATE_WAIT_MS for the view to catch up; then it goes to
        // the kernel, which answers it (RST) unless a socket of its own knows it.
        if !gate_wait.is_empty() {
            let view = hb.as_ref().and_then(|h| h.view());
            let mut keep = Vec::new();
            for g in gate_wait.drain(..) {
                if let Some(r) = recovering.get_mut(&g.key) {
                    r.held.push((g.id, g.data));
                    continue;
                }
                if engine.knows(&g.key) {
                    let _ = queue.set_verdict(g.id, QVerdict::Accept, None);
                    continue;
                }
                let allowed = cfg.gate_open || matches!((g.bucket, &view), (Some(b), Some(v)) if v.allowed(b));
                // Not a failover candidate, and a socket of the local server owns the address
                // pair: a connection set up before this agent started (a restart). It passes at
                // once and is known, unprotected, from now on (never held at the gate again).
                let local = !allowed
                    && g.since == now
                    && !engine.tracks(&g.key)
                    && match diag.lookup(g.key.service, g.key.client) {
                        Ok(i) => i.is_some_and(|i| i.owned_and_receiving()),
                        Err(e) => {
                            shared.count(|c| c.sockdiag_errors += 1);
                            eprintln!("agent: sock_diag lookup of {}: {e}", g.key.client);
                            false
                        }
                    };
                if local {
                    engine.learn_unprotected(g.key, now);
                    buckets.insert(g.key, g.bucket);
                    let mut n = 0;
                    shared.count(|c| {
                        c.passed_local_socket += 1;
                        n = c.passed_local_socket;
                    });
                    if n <= 10 {
                        eprintln!("agent: {} -> {} is served by a local socket set up before this agent started: passed, unprotected{}", g.key.client, g.key.service, if n == 10 { " (further ones are only counted)" } else { "" });
                    }
                    let _ = queue.set_verdict(g.id, QVerdict::Accept, None);
                } else if allowed {
                    shared.count(|c| c.failovers_started += 1);
                    let trigger_pkt = g.data.clone();
                    recovering.insert(g.key, Recovering { held: vec![(g.id, g.data)] });
                    let ctx = ctx.clone();
                    let (k, bucket) = (g.key, g.bucket);
                    let t0 = Instant::now();
                    std::thread::spawn(move || failover(ctx, k, bucket, trigger_pkt, t0));
                } else if now.saturating_sub(g.since) >= GATE_WAIT_MS {
                    eprintln!("agent: failover denied for {} (bucket {:?}): not a recently moved bucket", g.key.client, g.bucket);
                    shared.count(|c| c.failovers_denied += 1);
                    let _ = queue.set_verdict(g.id, QVerdict::Accept, None);
                } else {
                    keep.push(g);
                }
            }
            gate_wait = keep;
        }
        // 2. worker messages
        if ready[2] {
            wake.clear();
        }
        while let Ok(m) = rx.try_recv() {
            match m {
                Msg::Adopt { key, bucket, rec, plan, started: t0, go } => {
                    engine.adopt(key, &rec, &plan, now);
                    buckets.insert(key, bucket);
                    if let Some(r) = recovering.remove(&key) {
                        for (id, mut data) in r.held {
                            let v = engine.packet(id as u64, &mut data, Dir::FromClient, now);
                            let modified = matches!(v, Verdict::Accept { modified: true });
                            accept(&mut queue, id, &mut data, modified, false);
                        }
                    }
                    let us = t0.elapsed().as_micros() as u64;
                    shared.count(|c| {
                        c.failovers += 1;
                        c.failover_us_last = us;
                        c.failover_us_max = c.failover_us_max.max(us);
                    });
                    shared.dirty.store(true, Ordering::Relaxed);
                    let _ = go.send(());
                }
                Msg::Quiesce { key, go } => {
                    engine.mute_or_insert(key, now);
                    flush_released(&mut engine, &mut queue, &mut csum);
                    let _ = go.send(());
                }
                Msg::Refuse { key, why } => {
                    if let Some(r) = recovering.remove(&key) {
                        for (id, _) in r.held {
                            let _ = queue.set_verdict(id, QVerdict::Accept, None);
                        }
                    }
                    refused.insert(key, now);
                    shared.dirty.store(true, Ordering::Relaxed);
                    eprintln!("agent: refused {} -> {}: {why}", key.client, key.service);
                    shared.count(|c| {
                        c.refused += 1;
                        if c.recent_refusals.len() >= 16 {
                            c.recent_refusals.remove(0);
                        }
                        c.recent_refusals.push(format!("{}: {why}", key.client));
                    });
                }
            }
        }
        // 3. store completions
        store.drain(&mut completions);
        for c in completions.drain(..) {
            engine.store_done(c.token, c.result.is_ok());
        }
        flush_released(&mut engine, &mut queue, &mut csum);
        // 4. store actions
        while let Some(act) = engine.poll_action() {
            let (token, kind) = match act {
                Action::Store { token, conn, value, .. } => {
                    let b = buckets.get(&conn).copied().flatten();
                    (token, OpKind::Set { key: store_key(b, &conn).into_bytes(), val: value })
                }
                Action::Delete { token, conn, .. } => {
                    let b = buckets.get(&conn).copied().flatten();
                    (token, OpKind::Del { key: store_key(b, &conn).into_bytes() })
                }
            };
            store.submit(Op { token, kind });
            shared.count(|c| c.store_submitted += 1);
        }
        // 5. housekeeping
        if now.saturating_sub(last_expire) >= 250 {
            engine.expire(now);
            refused.retain(|_, t| now.saturating_sub(*t) < 10_000);
            // Keep the bucket of every connection the engine still tracks (also between the
            // client's SYN and the SYN-ACK, whose store needs it, and while muted).
            buckets.retain(|k, _| engine.tracks(k));
            last_expire = now;
        }
        // Connections whose bucket the LB gave to another server while this one lives (it
        // came back, or a failure was falsely detected): the new owner speaks for them now.
        // They are silenced as soon as a fresh view shows it (checked at every new table epoch,
        // and every 100 ms): the client's packets already go to the new owner, and every byte
        // sent from here after that point would only race the new owner's rebuild.
        let view = lease.as_ref().and_then(|v| v.as_ref()).filter(|v| v.received_at.elapsed() < Duration::from_millis(100));
        if view.as_ref().is_some_and(|v| v.epoch != owner_epoch) || now.saturating_sub(last_owner_check) >= 100 {
            last_owner_check = now;
            if let Some(v) = view {
                owner_epoch = v.epoch;
                for (k, b) in buckets.iter() {
                    if let Some(b) = *b {
                        if !v.owns(b) && engine.knows(k) && engine.mute(*k) {
                            // A socket this agent rebuilt: stop its worker (whatever the socket
                            // still sends is dropped: muted).
                            silence_adopted(&ctx, k);
                            eprintln!("agent: {} moved to another server (bucket {b}): muted", k.client);
                            shared.count(|c| c.muted += 1);
                        }
                    }
                }
            }
            flush_released(&mut engine, &mut queue, &mut csum);
        }
        if let (true, Some(v)) = (a.probe, lease.as_ref().and_then(|v| v.as_ref())) {
            if v.epoch != probed_epoch {
                probed_epoch = v.epoch;
                let moved = v.allowed_buckets();
                if !moved.is_empty() {
                    let ctx = ctx.clone();
                    std::thread::spawn(move || probe_buckets(ctx, moved));
                }
            }
        }
        let qs = queue.stats();
        let skipped = hb.as_ref().map_or(0, |h| h.stats().skipped_wedged);
        shared.count(|c| {
            c.queue_errors = qs.enobufs + qs.verdict_errors;
            c.heartbeats_skipped_wedged = skipped;
        });
        {
            let mut ev = engine_view.lock().unwrap();
            *ev = (engine.counters, engine.connections(), engine.protected());
        }
        if let Err(e) = queue.flush() {
            eprintln!("agent: verdict flush: {e}");
        }
        // After the verdicts: an injected ACK never overtakes the segments released with it.
        while let Some(pkt) = engine.take_injected() {
            // The fence holds for injected ACKs too: only under a lease on the bucket.
            if let Some(lease) = &lease {
                let b = Trigger::parse(&pkt).and_then(|(k, _)| buckets.get(&Key { client: k.service, service: k.client }).copied().flatten());
                let may = lease_ok && match (lease, b) {
                    (Some(v), Some(b)) => v.owns(b),
                    _ => true,
                };
                if !may {
                    shared.count(|c| c.fenced_dropped += 1);
                    continue;
                }
            }
            if let Some(Err(e)) = inject.as_ref().map(|r| r.send(&pkt)) {
                inject_errors += 1;
                if inject_errors.is_power_of_two() {
                    eprintln!("agent: injecting an ACK ({inject_errors} failures): {e}");
                }
            }
        }
    };
    STOP.store(true, Ordering::SeqCst);
    // Sockets rebuilt here must not say goodbye to their clients when the process exits (a FIN
    // would end the download, a RST the connection): in repair mode their close is silent, and
    // the next agent (here, or where the LB sends the bucket) rebuilds them from the store.
    let adopted = ctx.adopted.lock().unwrap();
    if !adopted.is_empty() {
        let failed = adopted.values().filter(|(_, fd)| repair::enter_repair(fd.as_raw_fd()).is_err()).count();
        eprintln!("agent: stopping: {} rebuilt connection(s) left silently{}", adopted.len(), if failed > 0 { format!(" ({failed} could not enter repair mode)") } else { String::new() });
    }
    drop(adopted);
    drop(rules);
    drop(queue);
    res
}

fn accept(queue: &mut Queue, id: u32, data: &mut Vec<u8>, modified: bool, csum_not_ready: bool) {
    let r = if modified {
        if csum_not_ready {
            let n = data.len();
            crate::guard::fill_tcp_checksum(data, n);
        }
        queue.set_verdict(id, QVerdict::Accept, Some(data))
    } else {
        queue.set_verdict(id, QVerdict::Accept, None)
    };
    if let Err(e) = r {
        eprintln!("agent: verdict: {e}");
    }
}

fn flush_released(engine: &mut Engine, queue: &mut Queue, csum: &mut HashMap<u64, bool>) {
    while let Some(id) = engine.take_dropped() {
        csum.remove(&id);
        let _ = queue.set_verdict(id as u32, QVerdict::Drop, None);
    }
    while let Some((id, mut bytes, modified)) = engine.take_released() {
        let cnr = csum.remove(&id).unwrap_or(false);
        accept(queue, id as u32, &mut bytes, modified, cnr);
    }
}

fn status_loop(
    path: PathBuf,
    shared: Arc<Shared>,
    ev: Arc<Mutex<(trods::Counters, usize, usize)>>,
    store: Arc<StoreHandle>,
    started: Instant,
) {
    let tmp = path.with_extension("tmp");
    loop {
        let stop = STOP.load(Ordering::SeqCst);
        let agent = shared.counters.lock().unwrap().clone();
        let (engine, conns, protected) = *ev.lock().unwrap();
        let doc = serde_json::json!({
            "pid": std::process::id(),
            "uptime_ms": started.elapsed().as_millis() as u64,
            "wall_ms": SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0),
            "stopped": stop,
            "sighup_ignored": crate::signals::hangups(),
            "connections": conns,
            "protected": protected,
            "agent": agent,
            "engine": engine,
            "store": format!("{:?}", store.stats()),
            "store_down": store.is_down(),
        });
        if std::fs::write(&tmp, doc.to_string()).and_then(|_| std::fs::rename(&tmp, &path)).is_err() {
            eprintln!("agent: cannot write status file {}", path.display());
        }
        if stop {
            return;
        }
        // Every 500 ms, or within 10 ms of a failover or refusal.
        for _ in 0..50 {
            std::thread::sleep(Duration::from_millis(10)); // periodic status write, not a synchronisation
            if shared.dirty.swap(false, Ordering::Relaxed) {
                // Let the engine view catch up with the failover the loop just handled.
                std::thread::sleep(Duration::from_millis(5)); // coalesce a burst of failovers into one write
                break;
            }
        }
    }
}

// ---- failover -----------------------------------------------------------------------------------

struct WorkerCtx {
    /// Rebuilt sockets being served (with the generation of their worker), so a muted or
    /// superseded connection's worker can be stopped.
    adopted: Mutex<HashMap<Key, (u64, std::os::fd::OwnedFd)>>,
    next_gen: std::sync::atomic::AtomicU64,
    store_cfg: StoreConfig,
    backend: SocketAddr,
    tx: Sender<Msg>,
    wake: Arc<Wake>,
    shared: Arc<Shared>,
}

impl WorkerCtx {
    fn send(&self, m: Msg) {
        let _ = self.tx.send(m);
        self.wake.ring();
    }
}

fn failover(ctx: Arc<WorkerCtx>, key: Key, bucket: Option<u16>, pkt: Vec<u8>, t0: Instant) {
    // TRODS section 5.1: failover work runs below normal traffic (the packet loop keeps the
    // default priority), so a flood of failover attempts cannot starve protected connections.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 5);
    }
    let refuse = |why: String, f: fn(&mut AgentCounters)| {
        ctx.shared.count(f);
        ctx.send(Msg::Refuse { key, why });
    };
    let Some((_, trig)) = Trigger::parse(&pkt) else {
        return refuse("unparsable trigger".into(), |c| c.refused_plan += 1);
    };
    // Many connections of a dead server fail over at once: retry the store for a moment
    // rather than reset a connection for a transient error.
    let skey = store_key(bucket, &key);
    let deadline = Instant::now() + Duration::from_millis(1500);
    let got = loop {
        match Store::connect(&ctx.store_cfg).and_then(|mut s| s.get(skey.as_bytes())) {
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20)); // back-off between store retries
            }
            r => break r,
        }
    };
    let value = match got {
        Ok(Some(v)) => v,
        Ok(None) => return refuse("no record: the connection was not protected".into(), |c| c.refused_no_record += 1),
        Err(e) => return refuse(format!("store: {e}"), |c| c.refused_store += 1),
    };
    let rec = match Record::decode(&value) {
        Ok(r) => r,
        Err(e) => return refuse(format!("record: {e}"), |c| c.refused_plan += 1),
    };
    let plan = match plan_recovery(&rec, &trig) {
        Ok(p) => p,
        Err(r) => return refuse(format!("plan: {}", r.0), |c| c.refused_plan += 1),
    };
    let hs = rec.hs;
    let ws = hs.client_ws.unwrap_or(0);
    let spec = RepairSpec {
        local: key.service,
        remote: key.client,
        snd_nxt: plan.snd_nxt,
        rcv_nxt: plan.rcv_nxt,
        mss: hs.client_mss,
        snd_wscale: hs.client_ws,
        rcv_wscale: hs.server_ws,
        sack: hs.sack,
        timestamp: if hs.timestamps { Some(trig.tsecr.unwrap_or(0).wrapping_add(1000) & !1) } else { None },
        snd_wnd: (trig.window as u32) << ws,
        rcv_wnd: (65535u32 << hs.server_ws.min(14)).min(1 << 20),
        mark: 0,
        sndbuf: None,
    };
    // A socket of this connection muted here earlier may take a moment to go (its worker
    // closes it): retry while the address pair is still taken. A socket that stays (one the
    // local server owns) is destroyed, its RST dropped by the muted engine entry.
    let deadline = Instant::now() + Duration::from_millis(500);
    let mut destroyed = false;
    let sock = loop {
        match repair::rebuild(&spec) {
            Ok(s) => break s,
            Err(e) if e.kind() == io::ErrorKind::AddrNotAvailable && Instant::now() < deadline => {
                if !destroyed && Instant::now() + Duration::from_millis(450) > deadline {
                    destroyed = true;
                    let (go_tx, go_rx) = channel();
                    ctx.send(Msg::Quiesce { key, go: go_tx });
                    if go_rx.recv_timeout(Duration::from_secs(2)).is_ok() {
                        destroy_socket(&key);
                    }
                }
                std::thread::sleep(Duration::from_millis(5)); // waiting for the old socket to close
            }
            Err(e) => return refuse(format!("rebuild: {e}"), |c| c.refused_rebuild += 1),
        }
    };
    let (go_tx, go_rx) = channel();
    ctx.send(Msg::Adopt { key, bucket, rec: Box::new(rec.clone()), plan: Box::new(plan.clone()), started: t0, go: go_tx });
    if go_rx.recv_timeout(Duration::from_secs(5)).is_err() {
        let _ = repair::close_silently(sock);
        return;
    }
    let gen = ctx.next_gen.fetch_add(1, Ordering::Relaxed);
    if let Ok(dup) = sock.try_clone() {
        ctx.adopted.lock().unwrap().insert(key, (gen, dup.into()));
    }
    serve_recovered(&ctx, sock, &rec, &plan, key, gen);
    // Only this worker's entry: a silenced socket's entry is gone already, and a new failover
    // of the same connection may have put its own there.
    let mut adopted = ctx.adopted.lock().unwrap();
    if adopted.get(&key).is_some_and(|(g, _)| *g == gen) {
        adopted.remove(&key);
    }
}

/// Stops the worker of a socket this agent rebuilt for `key`, if any: repair mode first, so
/// nothing it still does reaches the wire and its close is silent and frees the address pair
/// at once (tcp_close in repair mode); then shutdown, which wakes the worker (EPIPE, EOF) and
/// makes it close the socket. Returns whether there was one.
fn silence_adopted(ctx: &WorkerCtx, key: &Key) -> bool {
    let Some((_, fd)) = ctx.adopted.lock().unwrap().remove(key) else { return false };
    if let Err(e) = repair::enter_repair(fd.as_raw_fd()) {
        eprintln!("agent: silencing {}: {e}", key.client);
    }
    unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR) };
    true
}

/// Whether the worker of generation `gen` still serves `key` (it was not silenced).
fn still_adopted(ctx: &WorkerCtx, key: &Key, gen: u64) -> bool {
    ctx.adopted.lock().unwrap().get(key).is_some_and(|(g, _)| *g == gen)
}

/// Destroys the local TCP socket of `key` (`ss -K`, SOCK_DESTROY).
fn destroy_socket(key: &Key) {
    let (s, c) = (key.service, key.client);
    let filter = format!("src {} and sport = :{} and dst {} and dport = :{}", bracket(s.ip()), s.port(), bracket(c.ip()), c.port());
    match std::process::Command::new("ss").args(["-K", "-tn", "state", "all"]).arg(&filter).output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => eprintln!("agent: ss -K {filter}: {}", String::from_utf8_lossy(&o.stderr).trim()),
        Err(e) => eprintln!("agent: ss -K: {e}"),
    }
}

fn bracket(ip: std::net::IpAddr) -> String {
    match ip {
        std::net::IpAddr::V6(a) => format!("[{a}]"),
        a => a.to_string(),
    }
}

/// Resume the interrupted responses, then relay further requests to the local server.
fn serve_recovered(ctx: &WorkerCtx, mut sock: TcpStream, rec: &Record, plan: &Plan, key: Key, gen: u64) {
    let _ = sock.set_nodelay(true);
    if plan.refin {
        let _ = sock.shutdown(std::net::Shutdown::Write);
        drain_until_eof(&mut sock);
        return;
    }
    let mut backend: Option<BufConn> = None;
    for r in &plan.resume {
        let e = &rec.entries[r.entry];
        match resume_entry(ctx, &mut sock, &mut backend, e, r.header_from, r.body_from) {
            Ok(n) => ctx.shared.count(|c| c.resumed_bytes += n),
            Err(ResumeError::Mismatch(why)) => {
                eprintln!("agent: resume refused: {why}");
                ctx.shared.count(|c| c.resume_mismatch += 1);
                reset(sock);
                return;
            }
            Err(ResumeError::Io(_)) if !still_adopted(ctx, &key, gen) => {
                // Silenced (muted or superseded): the socket is in repair mode, its close is
                // silent; another server serves the client now.
                eprintln!("agent: {}: stopped resuming (the connection is served elsewhere now)", key.client);
                ctx.shared.count(|c| c.workers_stopped += 1);
                reset(sock);
                return;
            }
            Err(ResumeError::Io(e)) => {
                eprintln!("agent: resume: {e}");
                ctx.shared.count(|c| c.resume_errors += 1);
                reset(sock);
                return;
            }
        }
    }
    if plan.close_after {
        let _ = sock.shutdown(std::net::Shutdown::Write);
        drain_until_eof(&mut sock);
        return;
    }
    relay(ctx, sock, plan.skip_client);
}

fn reset(sock: TcpStream) {
    let l = libc::linger { l_onoff: 1, l_linger: 0 };
    unsafe {
        libc::setsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_LINGER, &l as *const _ as *const libc::c_void, std::mem::size_of::<libc::linger>() as u32);
    }
    drop(sock);
}

fn drain_until_eof(sock: &mut TcpStream) {
    let _ = sock.set_read_timeout(Some(Duration::from_secs(120)));
    let mut buf = [0u8; 4096];
    while matches!(sock.read(&mut buf), Ok(n) if n > 0) {}
}

enum ResumeError {
    Mismatch(String),
    Io(io::Error),
}

impl From<io::Error> for ResumeError {
    fn from(e: io::Error) -> Self {
        ResumeError::Io(e)
    }
}

/// A connection to the local server with a read buffer (response headers are read with
/// lookahead; the body that follows stays in the buffer).
struct BufConn {
    s: TcpStream,
    buf: Vec<u8>,
}

impl BufConn {
    fn read_head(&mut self) -> io::Result<Vec<u8>> {
        loop {
            if let Some(n) = unbroken_engines::http::header_end(&self.buf) {
                let head = self.buf[..n].to_vec();
                self.buf.drain(..n);
                return Ok(head);
            }
            if self.buf.len() > 64 << 10 {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "local response header over 64 KiB"));
            }
            let mut tmp = [0u8; 16 << 10];
            let n = self.s.read(&mut tmp)?;
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "local server closed"));
            }
            self.buf.extend_from_slice(&tmp[..n]);
        }
    }
    /// Copies exactly `n` body bytes to `out` after discarding `skip`.
    fn copy_body(&mut self, mut skip: u64, mut n: u64, out: &mut TcpStream) -> io::Result<u64> {
        let total = n;
        let mut tmp = vec![0u8; 256 << 10];
        loop {
            if !self.buf.is_empty() {
                let k = (skip.min(self.buf.len() as u64)) as usize;
                self.buf.drain(..k);
                skip -= k as u64;
                let m = (n.min(self.buf.len() as u64)) as usize;
                if m > 0 {
                    out.write_all(&self.buf[..m])?;
                    self.buf.drain(..m);
                    n -= m as u64;
                }
            }
            if n == 0 {
                return Ok(total);
            }
            let r = self.s.read(&mut tmp)?;
            if r == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "local server closed mid-body"));
            }
            self.buf.extend_from_slice(&tmp[..r]);
        }
    }
}

/// Sends the rest of one response: the stored header from `header_from`, then the body from
/// `body_from`, fetched from the local server and checked to be the same representation.
fn resume_entry(ctx: &WorkerCtx, sock: &mut TcpStream, backend: &mut Option<BufConn>, e: &trods::Entry, header_from: usize, body_from: u64) -> Result<u64, ResumeError> {
    let mut sent = 0u64;
    if header_from < e.header.len() {
        sock.write_all(&e.header[header_from..])?;
        sent += (e.header.len() - header_from) as u64;
    }
    if body_from >= e.body_len {
        return Ok(sent);
    }
    if backend.is_none() {
        let s = TcpStream::connect_timeout(&ctx.backend, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        *backend = Some(BufConn { s, buf: Vec::new() });
    }
    let b = backend.as_mut().unwrap();
    let ranged = matches!(e.status, 200 | 206);
    let mut req = e.object_id.clone();
    let (skip, want_status) = if ranged {
        let first = e.range_start + body_from;
        let last = e.range_start + e.body_len - 1;
        req.extend_from_slice(format!("Range: bytes={first}-{last}\r\n").as_bytes());
        (0, 206)
    } else {
        (body_from, e.status)
    };
    req.extend_from_slice(b"Connection: keep-alive\r\n\r\n");
    b.s.write_all(&req)?;
    let head = b.read_head()?;
    let r = unbroken_engines::http::parse_response(&head, false).map_err(|u| ResumeError::Mismatch(format!("local response: {}", u.0)))?;
    if r.status != want_status {
        return Err(ResumeError::Mismatch(format!("local server answered {} where {want_status} was expected", r.status)));
    }
    let expect_len = if ranged { e.body_len - body_from } else { e.body_len };
    if r.body_len != expect_len {
        return Err(ResumeError::Mismatch(format!("local body is {} bytes, expected {expect_len}", r.body_len)));
    }
    if ranged && r.range_start != e.range_start + body_from {
        return Err(ResumeError::Mismatch("local Content-Range starts elsewhere".into()));
    }
    if ranged && e.status == 200 && r.total != Some(e.body_len) {
        return Err(ResumeError::Mismatch("the local object has another length".into()));
    }
    if !e.etag.is_empty() && r.etag != e.etag {
        return Err(ResumeError::Mismatch("the local object has another ETag".into()));
    }
    if e.etag.is_empty() && !e.last_modified.is_empty() && r.last_modified != e.last_modified {
        return Err(ResumeError::Mismatch("the local object has another Last-Modified".into()));
    }
    sent += b.copy_body(skip, e.body_len - body_from, sock)?;
    if r.close {
        *backend = None;
    }
    Ok(sent)
}

/// After the resumed responses: skip the client's requests already answered, then relay both
/// ways between the client and a fresh connection to the local server.
fn relay(ctx: &WorkerCtx, client: TcpStream, mut skip: u64) {
    let Ok(server) = TcpStream::connect_timeout(&ctx.backend, Duration::from_secs(2)) else {
        reset(client);
        return;
    };
    let (Ok(mut c_rd), Ok(mut s_wr)) = (client.try_clone(), server.try_clone()) else { return };
    let up = std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match c_rd.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let k = skip.min(n as u64) as usize;
            skip -= k as u64;
            if n > k && s_wr.write_all(&buf[k..n]).is_err() {
                break;
            }
        }
        let _ = s_wr.shutdown(std::net::Shutdown::Write);
    });
    let (mut s_rd, mut c_wr) = (server, client);
    let mut buf = vec![0u8; 256 << 10];
    loop {
        let n = match s_rd.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if c_wr.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = c_wr.shutdown(std::net::Shutdown::Write);
    let _ = up.join();
}

// ---- eliciting the client's ACK -----------------------------------------------------------------

/// TRODS waits for the client's retransmission to start a failover; with exponential backoff
/// that can take seconds. For buckets that just moved here, find their connections in the
/// store and send each client an old-sequence segment: the client answers with a duplicate
/// ACK (RFC 9293 section 3.10.7.4), which reaches this server and starts the failover at once.
fn probe_buckets(ctx: Arc<WorkerCtx>, buckets: Vec<u16>) {
    let Ok(mut store) = Store::connect(&ctx.store_cfg) else { return };
    // Marked to skip this agent's own queue: a probe is not the server's TCP speaking, and a
    // muted entry of the connection (left from when its bucket went to another server) would
    // drop it.
    let raw = match unbroken_drivers::rawsend::RawSender::new(AGENT_MARK) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("agent: probe: raw socket: {e}");
            return;
        }
    };
    let t0 = Instant::now();
    let mut sent: Vec<(Key, Vec<u8>)> = Vec::new();
    for b in buckets {
        let pattern = format!("b{b}/c/*");
        let Ok(keys) = scan(&mut store, &ctx.store_cfg.key_prefix, &pattern) else { continue };
        for k in keys {
            let Ok(Some(v)) = store.get(&k) else { continue };
            let Ok(rec) = Record::decode(&v) else { continue };
            let Some(conn) = parse_store_key(&k) else { continue };
            eprintln!("agent: probing {} (bucket {b})", conn.client);
            if let Some(pkt) = probe_packet(&conn, &rec) {
                if raw.send(&pkt).is_ok() {
                    ctx.shared.count(|c| c.probes_sent += 1);
                    sent.push((conn, pkt));
                }
            }
        }
    }
    // A probe can go unanswered: the client's answer may reach the old owner when the probe
    // overtook the kernel table's change, and the client's kernel answers at most one such
    // segment per connection every 500 ms (net.ipv4.tcp_invalid_ratelimit), so the next
    // epoch's probe is often ignored. A client that is itself waiting (its window reopened
    // toward the dead server, nothing unacknowledged) then never sends again: the download
    // hangs. So probes are repeated, spaced beyond the rate limit, until the connection has
    // been rebuilt here (or the last retry).
    for at in PROBE_RETRY_MS {
        if STOP.load(Ordering::Relaxed) {
            return;
        }
        let due = t0 + Duration::from_millis(at);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait); // the retry schedule (the client's rate limit), not synchronisation
        }
        sent.retain(|(k, _)| !ctx.adopted.lock().unwrap().contains_key(k));
        for (_, pkt) in &sent {
            if raw.send(pkt).is_ok() {
                ctx.shared.count(|c| {
                    c.probes_sent += 1;
                    c.probes_repeated += 1;
                });
            }
        }
    }
}

/// When probes of connections not yet rebuilt here are sent again, milliseconds after the
/// first (beyond the client's 500 ms limit on answering old segments).
const PROBE_RETRY_MS: [u64; 3] = [600, 1250, 2500];

/// Every key matching `pattern` (without the prefix; returned without it too), on every
/// master of a Redis Cluster, or on the one Redis.
fn scan(store: &mut Store, prefix: &str, pattern: &str) -> Result<Vec<Vec<u8>>, crate::store::StoreError> {
    if store.is_cluster() {
        let mut out = Vec::new();
        for node in store.masters() {
            out.extend(scan_node(store, Some(node), prefix, pattern)?);
        }
        return Ok(out);
    }
    scan_node(store, None, prefix, pattern)
}

fn scan_node(store: &mut Store, node: Option<SocketAddr>, prefix: &str, pattern: &str) -> Result<Vec<Vec<u8>>, crate::store::StoreError> {
    let full = format!("{prefix}{pattern}");
    let mut cursor = b"0".to_vec();
    let mut out = Vec::new();
    for _ in 0..100_000 {
        let args: [&[u8]; 6] = [b"SCAN", &cursor, b"MATCH", full.as_bytes(), b"COUNT", b"1000"];
        let r = match node {
            Some(n) => store.command_at(n, &args)?,
            None => store.command(&args)?,
        };
        let Reply::Array(Some(parts)) = r else { break };
        let (Some(Reply::Bulk(Some(c))), Some(Reply::Array(Some(keys)))) = (parts.first(), parts.get(1)) else { break };
        for k in keys {
            if let Reply::Bulk(Some(k)) = k {
                out.push(k[prefix.len().min(k.len())..].to_vec());
            }
        }
        if c == b"0" {
            break;
        }
        cursor = c.clone();
    }
    Ok(out)
}

fn parse_store_key(k: &[u8]) -> Option<Key> {
    let s = std::str::from_utf8(k).ok()?;
    let rest = s.split_once("/c/")?.1;
    let (client, service) = rest.split_once('/')?;
    Some(Key { client: client.parse().ok()?, service: service.parse().ok()? })
}

/// An ACK with the server's SYN sequence number (always old for the client, so answered with
/// an ACK), acknowledging no more than the stored hold.
fn probe_packet(key: &Key, rec: &Record) -> Option<Vec<u8>> {
    use unbroken_wire::ip;
    use unbroken_wire::tcp::{flags, Packet, Repr};
    use unbroken_wire::Seq;
    let hs = rec.hs;
    let r = Repr {
        src_port: key.service.port(),
        dst_port: key.client.port(),
        seq: Seq(hs.iss),
        ack: Seq(hs.irs.wrapping_add(1).wrapping_add(rec.hold_off as u32)),
        flags: flags::ACK,
        window: 65535,
        ..Default::default()
    };
    let tl = r.header_len();
    let mut buf = vec![0u8; 60 + tl];
    let hl = ip::emit_header(&mut buf, key.service.ip(), key.client.ip(), ip::PROTO_TCP, tl).ok()?;
    r.emit(&mut buf[hl..]).ok()?;
    Packet::new_checked(&mut buf[hl..hl + tl]).ok()?.fill_checksum(ip::pseudo_sum(key.service.ip(), key.client.ip(), ip::PROTO_TCP, tl));
    buf.truncate(hl + tl);
    Some(buf)
}
