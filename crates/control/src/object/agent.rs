//! `unbroken agent`: object mode (TRODS-KV, seed 000) beside an unmodified HTTP server.
//!
//! One packet loop runs the [`trods`](unbroken_engines::trods) engine over an NFQUEUE that
//! sees the service's packets both ways (mangle PREROUTING for the client's, OUTPUT for the
//! server's), and talks to the store through [`crate::object::kv::KvStore`] (Redis: the asynchronous [`crate::object::store::StoreHandle`]): a store that is
//! down or slow completes operations with errors, and the engine then lets the connection go
//! on unprotected (counted) instead of stalling it.
//!
//! A client packet of a connection this server does not know starts a failover (section 3.2)
//! when the load balancer says its bucket changed hands recently (section 5.1; the bucket is
//! read from the marker source MAC the LB writes, see [`crate::object::lb`]). A worker thread fetches
//! the record, plans with [`plan_recovery`], rebuilds the client's connection with TCP_REPAIR,
//! hands it to the engine (so it stays protected), resumes the interrupted responses from the
//! local server with Range requests, and then relays further requests to the local server.
//! The packets that arrived meanwhile wait in the queue and are released once the socket
//! exists. A refusal (no record, a position the record does not explain, a store error) lets
//! the packets reach the kernel, which has no socket for them and answers with a RST: the
//! client learns at once, and the refusal is counted.

use crate::object::agentcore::{store_key, Core, LbView, Out, Pkt};
use crate::daemon::{self, Wake};
use crate::object::lb::{bucket_of_mac, HeartbeatClient, LoopWatch};
use crate::object::kv::{KvStore, RedisKv};
use crate::object::records::{Records, Refusal};
use crate::object::store::StoreConfig;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use unbroken_drivers::iptables::{BuiltinChain, RuleSpec, Rules, Service};
use unbroken_drivers::nfqueue::{Queue, QueueConfig};
use unbroken_drivers::repair::{self, RepairSpec};
use unbroken_drivers::sockdiag::{Progress, SockDiag};
use unbroken_engines::resume::{self, Mismatch};
use unbroken_engines::trods::{self, Dir, Engine, Key, Plan, Record, Trigger};
use unbroken_wire::sealed::{RecordKey, Refused};

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
    /// Hex key shared with the LB (heartbeat MACs), at least 16 bytes; mandatory with `lb`.
    #[serde(default)]
    pub key: String,
    /// `"lb"`: start failover only for buckets the LB moved to this server recently (TRODS
    /// section 5.1). `"open"`: for any unknown connection (labs without an LB).
    #[serde(default = "default_gate")]
    pub failover_gate: String,
    /// Status JSON written every 500 ms.
    #[serde(default)]
    pub status_file: Option<PathBuf>,
    /// The list of connections this agent rebuilt, kept for the next agent on this server
    /// (their sockets die with this one; it rebuilds them from their records). Default: the
    /// status file's path with `.rebuilt` appended; none without a status file (then a
    /// restarted agent's predecessor's rebuilt connections are reset).
    #[serde(default)]
    pub rebuilt_file: Option<PathBuf>,
    /// Ask the clients of buckets that just moved here for an ACK instead of waiting for
    /// their retransmission timeout.
    #[serde(default = "default_true")]
    pub probe: bool,
    /// The packet loop counts as wedged (and heartbeats stop, so the LB moves this server's
    /// buckets) after this long in one iteration, milliseconds.
    #[serde(default = "default_wedged_ms")]
    pub wedged_after_ms: u64,
    /// Established packets of quiet connections (a response body being sent, the client's
    /// ACKs of it) stay in the kernel: tc-BPF and an `-m bpf` match on the queue rules (issue
    /// 22). Off, or when the kernel cannot (said once at start, and in the status's
    /// `fast_path.off_because`), every packet of a service goes through NFQUEUE.
    #[serde(default = "default_true")]
    pub fast_path: bool,
    /// With `fast_path`: a client packet whose checksum field holds only the pseudo-header's
    /// sum is taken as one the kernel has not checksummed yet (CHECKSUM_PARTIAL: clients in a
    /// local namespace or VM behind a veth or tap, as in the lab), as the slow path does. A
    /// socket filter cannot tell; a corrupted packet from the wire holding that value (one in
    /// 65,536 corrupted ones) then passes the fast path, and the kernel's TCP drops it. Off by
    /// default: clients behind real NICs never need it.
    #[serde(default)]
    pub fast_path_trust_partial_checksums: bool,
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
    /// A record expires after this long without being stored (s; 0: never). Records of live
    /// connections are stored again every third of it, so a record outlives its connection
    /// by at most this long when its delete is lost (a crash, a store outage). At least 30.
    #[serde(default = "default_ttl")]
    pub ttl_s: u64,
    /// The cluster key that authenticates records (hex, at least 16 bytes; the same on every
    /// agent of the cluster, different from `agent.key`). Give this or `record_key_file`.
    #[serde(default)]
    pub record_key: Option<String>,
    /// A file holding the cluster key as hex (kept out of the config file and `ps`).
    #[serde(default)]
    pub record_key_file: Option<PathBuf>,
}

fn default_store_ms() -> u64 {
    50
}
fn default_prefix() -> String {
    "ub:".into()
}
fn default_ttl() -> u64 {
    600
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
    /// The cluster key of the store's records (`store.record_key` or `store.record_key_file`).
    pub record_key: RecordKey,
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
        let key = match lb {
            Some(_) => crate::object::hbproto::check_key("agent.key", &a.key)?,
            None => crate::object::lb::parse_key_hex(&a.key).map_err(|e| format!("agent.key: {e}"))?,
        };
        if raw.store.nodes.is_empty() {
            return Err("store.nodes: at least one Redis address is needed".into());
        }
        if raw.store.timeout_ms == 0 || raw.store.timeout_ms > 60_000 {
            return Err("store.timeout_ms: 1..=60000".into());
        }
        if raw.store.ttl_s != 0 && !(30..=30 * 86_400).contains(&raw.store.ttl_s) {
            return Err(format!("store.ttl_s: {}: 0 (records never expire) or 30..=2592000 (records of live connections are stored again every third of it)", raw.store.ttl_s));
        }
        let record_key = record_key(&raw.store, &key)?;
        Ok(Agent { raw, services, backend, lb, key, gate_open, record_key })
    }

    /// Seals and opens this agent's records.
    pub fn records(&self) -> Records {
        Records::new(self.record_key.clone(), &self.raw.store.prefix, self.raw.store.ttl_s.saturating_mul(1000))
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

/// The cluster key of the store's records, from exactly one of `record_key` and
/// `record_key_file`; never the LB's heartbeat key.
fn record_key(s: &StoreSection, lb_key: &[u8]) -> Result<RecordKey, String> {
    let k = match (&s.record_key, &s.record_key_file) {
        (Some(_), Some(_)) => return Err("store.record_key and store.record_key_file: give one of them, not both".into()),
        (None, None) => {
            return Err("store.record_key (hex, at least 16 bytes) or store.record_key_file is missing: it is the cluster key that \
                        authenticates connection records in the store; give every agent of the cluster the same one, different from agent.key \
                        (e.g. `head -c 32 /dev/urandom | xxd -p -c 64`)"
                .into())
        }
        (Some(hex), None) => RecordKey::from_hex(hex).map_err(|e| format!("store.record_key: {e}"))?,
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("store.record_key_file: {}: {e}", path.display()))?;
            RecordKey::from_hex(&text).map_err(|e| format!("store.record_key_file: {}: {e}", path.display()))?
        }
    };
    if k.bytes() == lb_key {
        return Err("store.record_key: the same as agent.key; use a key of its own (whoever holds the LB's heartbeat key must not be able to forge records)".into());
    }
    Ok(k)
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
    /// Of `resume_mismatch`: the local server's object is not the one being sent (it answered
    /// 200 to If-Range, or another validator or length): the client got a RST, no byte of it.
    pub resume_object_changed: u64,
    /// Resumes refused before anything was sent to the local server: the record's objectID or
    /// validator failed the checks of `engines::resume` (never happens with genuine records).
    pub resume_refused: u64,
    /// Failovers refused because the stored value was not a valid record (counted below by
    /// reason): treated exactly as a connection without a record.
    pub refused_bad_record: u64,
    /// Values read from the store whose MAC did not verify (edited, moved to another key,
    /// another cluster key), of version 1 (no MAC), or sealed longer ago than the TTL.
    pub records_bad_mac: u64,
    pub records_unversioned: u64,
    pub records_expired: u64,
    pub records_invalid: u64,
    pub resume_errors: u64,
    pub resumed_bytes: u64,
    pub probes_sent: u64,
    /// Connections silenced because the LB gave their bucket to another server.
    pub muted: u64,
    /// Rebuilt connections rebuilt again because the client acknowledged bytes another server
    /// sent after this one planned (a stand-in that had not stopped yet).
    pub superseded: u64,
    /// Workers of rebuilt sockets stopped because their connection was muted or superseded.
    pub workers_stopped: u64,
    /// Connections rebuilt here whose worker still serves them (a gauge; the rebuilt list
    /// holds these, and while the restart grace lasts the predecessor's it inherited).
    pub rebuilt_serving: u64,
    /// Connections this agent never saw set up whose packets a local socket owns (the agent
    /// restarted under them): known again, protected from their record when it describes
    /// them (the engine's `relearned`), unprotected otherwise.
    pub passed_local_socket: u64,
    /// Of those, learned unprotected: their record did not describe them.
    pub relearn_failed: u64,
    /// Probes built from server packets of connections whose bucket was not known yet.
    pub elicited: u64,
    /// Local server sockets destroyed because their connection's bucket went to another server.
    pub muted_destroyed: u64,
    /// Lookups of local sockets that failed (the packet then waits at the gate as before).
    pub sockdiag_errors: u64,
    /// Times the store became unreachable (each logged once, and its return too).
    pub store_outages: u64,
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
    /// Log lines over their budget (per kind, [`crate::ratelog`]), counted instead of written.
    pub log_suppressed: u64,
    /// The last 16 refusals, written to the status as `"client: why"`: kept as the client and
    /// the reason the core gave (moved in, never formatted per refusal; issue 9 item 6).
    #[serde(serialize_with = "serialize_refusals")]
    pub recent_refusals: VecDeque<(SocketAddr, String)>,
    /// Failover lookups or relearns refused because the worker pool's queue was full (or a
    /// batch of socket destructions that then took a thread of its own).
    pub pool_full: u64,
    /// Local sockets that could not be destroyed (no pool slot and no thread): left to
    /// their muted entries.
    pub destroys_lost: u64,
    /// Threads the system would not start (a rebuilt connection then refused, a probe or a
    /// socket destruction skipped).
    pub spawn_failed: u64,
    /// The core's decisions (crate::object::agentcore::CoreCounters): failover admission (rate
    /// limits per source and bucket, lookups in flight, the negative cache), the gate's cap,
    /// client packets that could not plan against a record.
    pub core: crate::object::agentcore::CoreCounters,
    /// The kernel fast path (issue 22): on or why not, the hand-off's counters, the programs'.
    pub fast_path: FastStatus,
}

/// Status `fast_path`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FastStatus {
    pub on: bool,
    pub off_because: Option<String>,
    /// Where the tc egress program runs.
    pub interfaces: Vec<String>,
    pub handoff: crate::object::agentfast::FastCounters,
    /// The programs' own counts (all CPUs): packets passed in the kernel and sent to the
    /// queue, each way; server ACKs lowered by tc.
    pub client_passed: u64,
    pub client_slow: u64,
    pub server_passed: u64,
    pub server_slow: u64,
    pub acks_lowered: u64,
}

struct Shared {
    counters: Mutex<AgentCounters>,
    /// A failover or refusal happened: write the status file now, not at the next period.
    dirty: Arc<AtomicBool>,
}

impl Shared {
    fn count(&self, f: impl FnOnce(&mut AgentCounters)) {
        f(&mut crate::sync::lock(&self.counters, "agent: counters"));
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
    /// The store's answer to a failover lookup ([`Out::Failover`]): the core plans from it.
    Record { key: Key, bucket: Option<u16>, result: Result<Option<Record>, String> },
    /// A connection a local socket serves: its record describes it (`Ok`), or why not.
    Relearn { key: Key, bucket: Option<u16>, found: Result<Option<Record>, String>, sock: Result<Option<Progress>, String> },
    /// Connections with a record in buckets that moved here (listed to probe them).
    Listed { keys: Vec<(Key, u16)> },
}

/// Packets with this mark skip the agent's queue (its own probes).
const AGENT_MARK: u32 = 0x7562;


/// The agent's queue rules let packets with this mark pass (`-m mark --mark ... -j RETURN`):
/// the ACKs the engine builds ([`Engine::take_injected`]) are sent with it.
const INJECT_MARK: u32 = AGENT_MARK;



// ---- the packet loop ----------------------------------------------------------------------------

/// Runs the agent until SIGINT/SIGTERM (SIGHUP is ignored, see [`crate::signals`]). Prints one `ready` line once traffic is steered.
pub fn run(cfg: Agent) -> Result<(), String> {
    daemon::install_signals("agent", true);
    // A socket per rebuilt connection: a server death can bring thousands at once.
    daemon::raise_fd_limit("agent", 16384);
    let a = &cfg.raw.agent;
    let started = Instant::now();
    // The engine's clock in the kernel's (the fast path keeps CLOCK_MONOTONIC ns).
    let zero_ns = unbroken_drivers::fastpath::object::monotonic_ns();
    let mono_ms = || started.elapsed().as_millis() as u64;
    let a_status_file = a.status_file.clone();
    if let Some(path) = &a_status_file {
        prepare_status_file(path)?;
    }
    let store: Arc<dyn KvStore> = Arc::new(RedisKv::start(&cfg.store_config()).map_err(|e| format!("agent: store: {e}"))?);
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
    // One agent per queue and network namespace, for the whole of its life: two started at
    // once would both pass the owner check below and then revoke, pin and install over each
    // other.
    let _instance = daemon::lock_instance("agent", &instance_name(a.queue))?;
    // Another agent that still runs owns these rules: say which, before touching anything.
    let mut spec = rule_spec(&cfg);
    Rules::check_owner(&spec).map_err(|e| format!("agent: {e}"))?;
    // A predecessor killed here (its rules stay, naming its filters until ours replace them):
    // its filters pass nothing from now on, whatever this agent's own setting, so that every
    // packet of the connections whose rebuilt sockets died with it reaches this agent (a
    // client ACK its filters passed to the kernel would be answered with a RST).
    match unbroken_drivers::fastpath::object::revoke_pinned(&pin_dir(a.queue)) {
        Ok(true) => eprintln!("agent: the previous agent's fast path (pinned in {}) passes nothing from now on", pin_dir(a.queue).display()),
        Ok(false) if pin_dir(a.queue).join("obj_from_client").exists() => eprintln!("agent: the previous agent's fast path (pinned in {}) has no lease to revoke (an older version): its filters pass packets until this agent's rules replace them", pin_dir(a.queue).display()),
        Ok(false) => {}
        Err(e) => eprintln!("agent: could not revoke the previous agent's fast path in {} ({e}): its filters pass packets until its own lease lapses ({} ms after it stopped)", pin_dir(a.queue).display(), AGENT_ALIVE_NS / 1_000_000),
    }
    // The fast path before the rules: they name its pinned filters.
    let fast = match fast_path(&cfg, zero_ns) {
        Ok(f) => {
            eprintln!("agent: fast path on: established packets of quiet connections stay in the kernel (tc egress on {})", f.ifaces.join(", "));
            spec.bpf_match = Some(f.pins.clone());
            Ok(f)
        }
        Err(why) => {
            eprintln!("agent: fast path off: {why}; every packet of the services goes through NFQUEUE {}", a.queue);
            Err(why)
        }
    };
    let mut queue = Queue::open(&qcfg).map_err(|e| format!("agent: cannot bind NFQUEUE {}: {e}", a.queue))?;
    if fast.is_ok() {
        // tc egress leaves alone the server packets the slow path decided (docs: "Fast path:
        // object mode"); only those (LOCAL_OUT), never the clients'.
        queue.set_accept_mark(Some((AGENT_MARK, 3)));
    }
    let rules = Rules::install_or_replace(&spec).map_err(|e| format!("agent: installing rules: {e}"))?;
    // Without it a kept-alive client may wait for its retransmission timer between requests
    // (see the engine's docs), but it is served correctly.
    let inject = unbroken_drivers::rawsend::RawSender::new(INJECT_MARK).map_err(|e| eprintln!("agent: raw socket for injected ACKs: {e}")).ok();

    let shared = Arc::new(Shared { counters: Mutex::new(AgentCounters::default()), dirty: Arc::new(AtomicBool::new(false)) });
    let wake = Arc::new(Wake::new().map_err(|e| format!("agent: eventfd: {e}"))?);
    let (tx, rx): (Sender<Msg>, Receiver<Msg>) = channel();
    let engine = Engine::new(trods::Config { refresh_ms: cfg.raw.store.ttl_s * 1000 / 3, ..trods::Config::default() });
    let engine_view: Arc<Mutex<(trods::Counters, usize, usize)>> = Arc::new(Mutex::new(Default::default()));
    {
        // Always runs: it also says when the store or the LB's heartbeats go wrong.
        let hbw = hb.as_ref().zip(cfg.lb).map(|(h, lb)| (h.probe(), crate::object::hbproto::HealthWatch::new(lb, &cfg.key, 0)));
        let plan = daemon::StatusPlan { name: "agent", path: a_status_file, period: Duration::from_millis(500), dirty: shared.dirty.clone(), started };
        daemon::spawn_status(plan, status_fields(shared.clone(), engine_view.clone(), store.clone(), hbw)).map_err(|e| format!("agent: status thread: {e}"))?;
    }
    println!("unbroken agent: ready server={} queue={} services={:?} gate={}", a.server_id, a.queue, a.services, a.failover_gate);
    let _ = io::stdout().flush();

    let mut core = Core::new(engine, cfg.gate_open, a.probe);
    let (fast_fp, fast_status) = match fast {
        Ok(f) => {
            let fp = f.fp.clone();
            core.enable_fast_path(Box::new(f.map));
            (Some(fp), FastStatus { on: true, interfaces: f.ifaces, ..FastStatus::default() })
        }
        Err(why) => (None, FastStatus { off_because: Some(why), ..FastStatus::default() }),
    };
    shared.count(|c| c.fast_path = fast_status);
    let rebuilt_file = a.rebuilt_file.clone().or_else(|| {
        a.status_file.as_ref().map(|p| {
            let mut s = p.clone().into_os_string();
            s.push(".rebuilt");
            PathBuf::from(s)
        })
    });
    let mut inherited_keys = Vec::new();
    if let Some(path) = &rebuilt_file {
        let (keys, bad) = read_rebuilt(path);
        if !keys.is_empty() || bad > 0 {
            eprintln!("agent: {} connection(s) rebuilt by the previous agent ({}){}: rebuilt again from their records when their clients send", keys.len(), path.display(), if bad > 0 { format!(", {bad} unreadable line(s) skipped") } else { String::new() });
        }
        inherited_keys = keys.clone();
        core.inherit(keys);
    } else {
        eprintln!("agent: no agent.rebuilt_file and no agent.status_file: if this agent restarts, the connections it rebuilt (whose sockets die with it) are reset; set either to keep them");
    }
    let ctx = Arc::new(WorkerCtx {
        adopted: Mutex::new(HashMap::new()),
        rebuilt: RebuiltList::new(rebuilt_file, inherited_keys, Instant::now() + Duration::from_millis(crate::object::agentcore::RESTART_GRACE_MS)),
        next_gen: std::sync::atomic::AtomicU64::new(1),
        kv: store.clone(),
        records: cfg.records(),
        backend: cfg.backend,
        tx: tx.clone(),
        wake: wake.clone(),
        shared: shared.clone(),
        pool: Pool::start(POOL_THREADS, POOL_QUEUE).map_err(|e| format!("agent: starting the failover workers: {e}"))?,
    });
    {
        let c2 = ctx.clone();
        std::thread::Builder::new().name("ub-rebuilt-list".into()).spawn(move || RebuiltList::writer(c2)).map_err(|e| format!("agent: rebuilt-list thread: {e}"))?;
    }
    let diag = SockDiag::open().map_err(|e| format!("agent: sock_diag: {e}"))?;
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
    // The loop only does I/O (crate::daemon::run); every decision is the core's
    // (crate::object::agentcore), and AgentIo carries out its requests.
    let mode = Mutex::new(AgentMode { core, view: None, lease_ok: false, fresh: false, pkts: Vec::with_capacity(64), inject_errors: 0, fallbacks: 0 });
    let mut agent_io = AgentIo { ctx: ctx.clone(), store: store.clone(), rx, wake, diag, hb, watch, shared: shared.clone(), engine_view, completions: Vec::new(), protected_at: None, leases: fast_fp.clone().map(|fp| Leases { fp, counted_at: None, seen: None, held: Default::default(), held_epoch: 0, held_until: 0, last_epoch: None }) };
    // The agent's own lease, renewed by a thread of its own, not by the packet loop: what it
    // vouches for is that this process lives (a killed agent's filters must stop passing),
    // and a loop round that takes long under load must not send every lent connection to the
    // slow path, which would make the next rounds longer still.
    let alive_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let alive_thread = match &fast_fp {
        Some(fp) => {
            let (fp, stop) = (fp.clone(), alive_stop.clone());
            Some(
                std::thread::Builder::new()
                    .name("ub-alive".into())
                    .spawn(move || {
                        while !stop.load(Ordering::Relaxed) {
                            crate::sync::lock(&fp, "agent: fast path").set_alive(unbroken_drivers::fastpath::object::monotonic_ns() + AGENT_ALIVE_NS);
                            std::thread::sleep(ALIVE_EVERY); // the renewal period, not a synchronisation
                        }
                    })
                    .map_err(|e| format!("agent: fast path lease thread: {e}"))?,
            )
        }
        None => None,
    };
    let res = daemon::run(&mut daemon::PacketIo::new("agent", &mut queue, inject.as_ref()), &mode, &mut agent_io, mono_ms);
    daemon::stop();
    alive_stop.store(true, Ordering::Relaxed);
    if let Some(h) = alive_thread {
        let _ = h.join();
    }
    if let Some(fp) = &fast_fp {
        // The rules stay, with the filters they name: nothing lent and no lease, so no packet
        // passes the kernel once this agent is gone (the queue, unread, drops them: fail
        // closed).
        let fp = crate::sync::lock(fp, "agent: fast path");
        fp.set_alive(0);
        fp.take_all();
        for b in 0..=u16::MAX {
            let _ = fp.set_lease(b, 0);
        }
    }
    // Sockets rebuilt here must not say goodbye to their clients when the process exits (a FIN
    // would end the download, a RST the connection): in repair mode their close is silent, and
    // the next agent (here, or where the LB sends the bucket) rebuilds them from the store.
    let writing = crate::sync::lock(&ctx.rebuilt.writing, "agent: rebuilt list");
    let adopted = crate::sync::lock(&ctx.adopted, "agent: rebuilt sockets");
    if let Some(path) = &ctx.rebuilt.path {
        write_rebuilt(path, ctx.rebuilt.listed(&adopted).into_iter());
    }
    drop(writing);
    if !adopted.is_empty() {
        let failed = adopted.values().filter(|(_, fd, _)| repair::enter_repair(fd.as_raw_fd()).is_err()).count();
        eprintln!("agent: stopping: {} rebuilt connection(s) left silently{}", adopted.len(), if failed > 0 { format!(" ({failed} could not enter repair mode)") } else { String::new() });
    }
    drop(adopted);
    // The queue rules stay (fail closed, as when the agent is killed): until an agent reads
    // the queue again the kernel drops the service's packets. Removed, they would let the
    // server's TCP answer on its own: a RST for every rebuilt socket just closed silently, and
    // the local server sending with no lease while the LB, hearing no heartbeats, gives its
    // buckets to other servers that rebuild the same connections (two senders).
    rules.leave_installed();
    eprintln!("agent: stopping: queue rules left in place (the service's packets are dropped until an agent runs again; `unbroken agent --config FILE --remove-rules` removes them)");
    drop(queue);
    res
}

/// The LB's view for the core: none configured, none yet, or the latest reply.
fn lb_view(view: &Option<Option<crate::object::lb::BucketView>>, lease_ok: bool, fresh: bool) -> LbView<'_> {
    match view {
        None => LbView::NoLb,
        Some(None) => LbView::Waiting,
        Some(Some(v)) => LbView::View { v, lease_ok, fresh },
    }
}

/// The agent as a queue daemon's mode ([`crate::daemon`]): its core ([`crate::object::agentcore`])
/// decides each batch; its verdicts come back as released packets, its injected ACKs and
/// elicitations as packets to send after the flush, everything else ([`Out`]) as requests
/// for [`AgentIo`].
struct AgentMode {
    core: Core,
    /// The heartbeat view of this round (one copy per round); `None` without an LB.
    view: Option<Option<crate::object::lb::BucketView>>,
    lease_ok: bool,
    fresh: bool,
    pkts: Vec<Pkt>,
    inject_errors: u64,
    fallbacks: u64,
}

impl daemon::Mode for AgentMode {
    type Request = Out;
    const BATCH: bool = true;

    fn packet(&mut self, _: u64, _: daemon::Meta, _: &mut [u8], len: usize, _: &mut daemon::Outbox<Out>) -> (unbroken_engines::Verdict, usize) {
        // Never called: the agent decides whole batches (`packets`).
        (unbroken_engines::Verdict::Drop, len)
    }

    fn packets(&mut self, now: u64, batch: &mut Vec<(daemon::Meta, Vec<u8>)>, _: &mut daemon::Outbox<Out>) {
        self.pkts.clear();
        for (m, data) in batch.drain(..) {
            let dir = if m.hook == 3 { Dir::ToClient } else { Dir::FromClient };
            self.pkts.push(Pkt { id: m.id, data, dir, bucket: m.hw_src.and_then(bucket_of_mac), csum_not_ready: m.csum_not_ready });
        }
        let lb = lb_view(&self.view, self.lease_ok, self.fresh);
        self.core.packets(now, lb, self.pkts.drain(..));
    }

    fn collect(&mut self, out: &mut daemon::Outbox<Out>) {
        use unbroken_engines::Verdict;
        while let Some(o) = self.core.poll() {
            match o {
                Out::Accept { id, data, modified, csum_not_ready } => out.released.push(daemon::Released { id, data, verdict: Verdict::Accept { modified }, csum_not_ready }),
                Out::Drop { id, data } => out.released.push(daemon::Released { id, data, verdict: Verdict::Drop, csum_not_ready: false }),
                // Sent like the injected ACKs (after the verdicts, outside the queue).
                Out::Inject(pkt) | Out::Elicit(pkt) => out.send.push(pkt),
                o => out.requests.push(o),
            }
        }
    }

    fn tick(&mut self, _: u64, _: &mut daemon::Outbox<Out>) {
        // The core's timers run in `AgentIo::service` (Core::after), after the store's and
        // the workers' news of this round.
    }

    fn after_flush(&mut self, now: u64) {
        // Connections go back to the kernel only once the verdicts of their queued packets
        // left: a packet the programs pass never overtakes one of them.
        self.core.fast_publish(now);
    }

    fn wait_ms(&self) -> u64 {
        self.core.wait_ms()
    }

    fn io_event(&mut self, ev: daemon::IoEvent) -> u64 {
        match ev {
            daemon::IoEvent::InjectFailed => {
                self.inject_errors += 1;
                self.inject_errors
            }
            daemon::IoEvent::VerdictFallback | daemon::IoEvent::Undecided => {
                self.fallbacks += 1;
                self.fallbacks
            }
            daemon::IoEvent::FullChecksum | daemon::IoEvent::Truncated(_) => 0,
        }
    }
}

/// Worker messages handled per round of the packet loop (the rest in the next round, at once).
const MSGS_PER_ROUND: usize = 32;

/// The agent's I/O beyond the queue: the store, the failover workers and their messages,
/// sock_diag for the gate, the LB's heartbeats, and the counters the status file shows.
struct AgentIo {
    ctx: Arc<WorkerCtx>,
    store: Arc<dyn KvStore>,
    rx: Receiver<Msg>,
    wake: Arc<Wake>,
    diag: SockDiag,
    hb: Option<HeartbeatClient>,
    watch: Arc<LoopWatch>,
    shared: Arc<Shared>,
    engine_view: Arc<Mutex<(trods::Counters, usize, usize)>>,
    completions: Vec<crate::object::store::Completion>,
    /// The kernel's fence (with the fast path).
    leases: Option<Leases>,
    /// When the engine's protected connections were last counted.
    protected_at: Option<Instant>,
}

// ---- the fast path's I/O ------------------------------------------------------------------------

type SharedFp = Arc<Mutex<unbroken_drivers::fastpath::object::Object>>;

/// The object programs, loaded, pinned and attached, and the core's map on them.
struct KernelFast {
    fp: SharedFp,
    map: KernelMap,
    pins: (PathBuf, PathBuf),
    ifaces: Vec<String>,
}

/// The kernel's map behind the core's [`crate::object::agentfast::FastMap`].
struct KernelMap {
    fp: SharedFp,
    /// CLOCK_MONOTONIC ns at the engine's time 0.
    zero_ns: u64,
    /// An LB is configured: server packets pass only under its lease.
    fenced: bool,
}

impl crate::object::agentfast::FastMap for KernelMap {
    fn take(&mut self, key: &Key) -> Option<trods::FastKept> {
        use unbroken_drivers::fastpath::object as fo;
        let s = crate::sync::lock(&self.fp, "agent: fast path").take(&fo::Key::new(key)).ok()??;
        let k = s.kept();
        Some(trods::FastKept { client_acked: k.client_acked, srv_next: k.srv_next, sent_next: k.sent_next, last_window: k.last_window, last_ts: k.last_ts, last_seen: s.last_seen_ns.saturating_sub(self.zero_ns) / 1_000_000 })
    }

    fn publish(&mut self, key: &Key, view: &trods::FastView, bucket: Option<u16>, lend: bool) -> Result<bool, String> {
        use unbroken_drivers::fastpath::object::{self as fo, flag};
        const FAST: u32 = flag::CLIENT_FAST | flag::SERVER_FAST | flag::PASSTHROUGH;
        let mut st = fo::State::publish(view, bucket, self.fenced, self.zero_ns + view.last_seen * 1_000_000);
        if !lend {
            st.flags &= !FAST;
        }
        crate::sync::lock(&self.fp, "agent: fast path").insert(&fo::Key::new(key), &st).map_err(|e| e.to_string())?;
        Ok(st.flags & FAST != 0)
    }

    fn remove(&mut self, key: &Key) {
        let _ = crate::sync::lock(&self.fp, "agent: fast path").remove(&unbroken_drivers::fastpath::object::Key::new(key));
    }
}

/// How long the kernel's filters may pass packets after the agent's lease thread last renewed
/// it: a killed (or stopped) agent's filters, which its queue rules keep using until a
/// successor's replace them, pass nothing after this (its successor must see every packet of
/// the connections it rebuilt, whose sockets died with it; a client ACK passed to the kernel
/// there is answered with a RST).
const AGENT_ALIVE_NS: u64 = 300_000_000;
/// How often the lease thread renews it.
const ALIVE_EVERY: Duration = Duration::from_millis(50);

/// Writes the LB's lease on each bucket into the kernel's fence at every new reply.
struct Leases {
    fp: SharedFp,
    /// When the programs' counters were last read (for the status).
    counted_at: Option<Instant>,
    /// The reply last written (its arrival) and the buckets then owned.
    seen: Option<(Instant, Vec<u64>)>,
    /// Buckets whose lease is held back until the core has acted on the reply of epoch
    /// `held_epoch` ([`Leases::commit_held`]): those the reply gave this server, and after
    /// tables this agent never saw (a skipped epoch) every owned bucket that changed hands
    /// recently. A connection of such a bucket may have been another server's meanwhile: the
    /// core takes its entry back (`may_have_moved`, muting) before the kernel may pass anything
    /// under the new lease. Until then its server packets go to the core's fence.
    held: std::collections::BTreeSet<u16>,
    held_epoch: u32,
    held_until: u64,
    /// The epoch of the reply last written.
    last_epoch: Option<u32>,
}

impl Leases {
    fn update(&mut self, v: &crate::object::lb::BucketView, now: Instant, mono_before: u64) {
        if self.seen.as_ref().is_some_and(|(at, _)| *at == v.received_at) {
            return;
        }
        // The lease's end in the kernel's clock (0: lapsed already).
        // (CLOCK_MONOTONIC read before `now` was: the kernel's lease ends no later than the
        // LB's.)
        let until = v.lease_until.checked_duration_since(now).map_or(0, |d| mono_before + d.as_nanos() as u64);
        let fp = crate::sync::lock(&self.fp, "agent: fast path");
        let before = self.seen.take().map(|(_, o)| o).unwrap_or_default();
        let skipped = self.last_epoch.is_some_and(|e| {
            let d = v.epoch.wrapping_sub(e);
            d > 1 && d < 1 << 31
        });
        self.last_epoch = Some(v.epoch);
        self.held_epoch = v.epoch;
        self.held_until = until;
        for b in 0..v.buckets {
            let had = before.get(b as usize / 64).is_some_and(|w| w & (1 << (b % 64)) != 0);
            if v.owns(b) && (!had || (skipped && v.allowed(b)) || self.held.contains(&b)) {
                self.held.insert(b);
            } else if v.owns(b) {
                let _ = fp.set_lease(b, until);
            } else {
                self.held.remove(&b);
                if had {
                    let _ = fp.set_lease(b, 0);
                }
            }
        }
        self.held.retain(|&b| b < v.buckets);
        // Buckets past a smaller table's end.
        for b in v.buckets as usize..before.len() * 64 {
            let _ = fp.set_lease(b as u16, 0);
        }
        self.seen = Some((v.received_at, v.owned.clone()));
    }

    /// Writes the held-back leases once the core has acted on their reply (`core_epoch`, the
    /// last table epoch it checked its connections against); otherwise they wait.
    fn commit_held(&mut self, core_epoch: u32) {
        if self.held.is_empty() || core_epoch != self.held_epoch {
            return;
        }
        let fp = crate::sync::lock(&self.fp, "agent: fast path");
        for b in std::mem::take(&mut self.held) {
            let _ = fp.set_lease(b, self.held_until);
        }
    }
}

/// Loads the object programs for `cfg`, pins the socket filters and attaches tc egress to
/// every Ethernet interface present at start (but loopback), or says why not.
fn fast_path(cfg: &Agent, zero_ns: u64) -> Result<KernelFast, String> {
    use unbroken_drivers::fastpath::{self, object as fo};
    let a = &cfg.raw.agent;
    if !a.fast_path {
        return Err("agent.fast_path = false".into());
    }
    fastpath::available().map_err(|e| e.to_string())?;
    let mut fp = fo::Object::load_with(fo::Options { agent_mark: AGENT_MARK, trust_partial_csum: a.fast_path_trust_partial_checksums }).map_err(|e| e.to_string())?;
    let mut ifaces: Vec<String> = fastpath::interfaces().map_err(|e| format!("listing the interfaces: {e}"))?.into_iter().filter(|n| n != "lo" && fastpath::is_ethernet(n)).collect();
    ifaces.sort();
    if ifaces.is_empty() {
        return Err("no Ethernet interface to attach tc egress to".into());
    }
    for i in &ifaces {
        fp.attach_egress(i).map_err(|e| e.to_string())?;
    }
    fo::ensure_bpffs().map_err(|e| e.to_string())?;
    let pins = fp.pin_filters(&pin_dir(a.queue)).map_err(|e| e.to_string())?;
    let fp = Arc::new(Mutex::new(fp));
    let map = KernelMap { fp: fp.clone(), zero_ns, fenced: cfg.lb.is_some() };
    Ok(KernelFast { fp, map, pins, ifaces })
}

/// The job of the agent of `queue` in this network namespace: its pins' directory and its
/// instance lock are named after it (namespaces share the BPF filesystem and `/run`, and labs
/// run agents of the same queue number side by side).
fn instance_name(queue: u16) -> String {
    use std::os::unix::fs::MetadataExt;
    let ns = std::fs::metadata("/proc/self/ns/net").map(|m| m.ino()).unwrap_or(0);
    format!("agent-net{ns}-q{queue}")
}

/// Where the agent of `queue` in this network namespace pins its filters.
fn pin_dir(queue: u16) -> PathBuf {
    PathBuf::from(unbroken_drivers::fastpath::PIN_ROOT).join(instance_name(queue))
}

impl AgentIo {
    /// Carries out the core's requests; local sockets to destroy (`ss -K` each) go in one job
    /// for the whole lot, never a thread per socket (a bucket that moves away mutes all of its
    /// connections at once).
    fn run(&self, out: &mut daemon::Outbox<Out>) {
        let mut destroy: Vec<Key> = Vec::new();
        for o in out.requests.drain(..) {
            execute(&self.ctx, &*self.store, o, &mut destroy);
        }
        destroy_batch(&self.ctx, destroy);
    }
}

impl daemon::Adapter<AgentMode> for AgentIo {
    fn fds(&self) -> Vec<std::os::fd::RawFd> {
        // (poll skips a negative fd: a store without a wake fd is drained every round)
        vec![self.store.wake_fd().unwrap_or(-1), self.wake.as_raw_fd()]
    }

    fn before_wait(&mut self) {
        self.watch.idle();
    }

    fn after_wait(&mut self, m: &mut AgentMode, _: u64) {
        self.watch.busy();
        m.view = self.hb.as_ref().map(|h| h.view());
        let mono_before = unbroken_drivers::fastpath::object::monotonic_ns();
        let now_i = Instant::now();
        if let Some(Some(v)) = &m.view {
            m.lease_ok = now_i < v.lease_until;
            m.fresh = v.received_at.elapsed() < Duration::from_millis(100);
            // The kernel's fence sees each reply before the core acts on it (a bucket that
            // moved away passes nothing from here on).
            if let Some(l) = &mut self.leases {
                l.update(v, now_i, mono_before);
            }
        }
    }

    fn service(&mut self, m: &mut AgentMode, now: u64, ready: &[bool], out: &mut daemon::Outbox<Out>) {
        use daemon::Mode;
        self.run(out);
        // 2. the failover gate (TRODS section 5.1)
        let diag = &mut self.diag;
        m.core.gate(now, lb_view(&m.view, m.lease_ok, m.fresh), |k| diag.lookup(k.service, k.client).map(|i| i.is_some_and(|i| i.serves_connection())).map_err(|e| e.to_string()));
        m.collect(out);
        self.run(out);
        // 3. worker messages, store completions
        if ready.get(1) == Some(&true) {
            self.wake.clear();
        }
        let shared = &self.shared;
        // At most MSGS_PER_ROUND per round: a mass failover sends hundreds at once, and the
        // packets (and the heartbeats, which vouch for the loop's progress) come first.
        for n in 0.. {
            if n == MSGS_PER_ROUND {
                self.wake.ring();
                break;
            }
            let Ok(msg) = self.rx.try_recv() else { break };
            match msg {
                Msg::Adopt { key, bucket, rec, plan, started: t0, go } => {
                    m.core.adopted(now, key, bucket, &rec, &plan);
                    m.collect(out);
                    self.run(out);
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
                    m.core.quiesce(now, key);
                    m.collect(out);
                    self.run(out);
                    let _ = go.send(());
                }
                Msg::Relearn { key, bucket, found, sock } => {
                    let _ = m.core.relearn_found(now, key, bucket, found, sock);
                    shared.dirty.store(true, Ordering::Relaxed);
                    m.collect(out);
                    self.run(out);
                }
                Msg::Refuse { key, why } => {
                    m.core.refused(now, key);
                    note_refusal(shared, key, why);
                }
                Msg::Record { key, bucket, result } => {
                    if let Err(why) = m.core.record(now, key, bucket, result) {
                        note_refusal(shared, key, why);
                    }
                    m.collect(out);
                    self.run(out);
                }
                Msg::Listed { keys } => m.core.records_listed(keys),
            }
        }
        self.store.drain(&mut self.completions);
        for c in self.completions.drain(..) {
            m.core.store_done(c.token, c.result.is_ok());
        }
        // 4. store requests, housekeeping, muting, probes, injected ACKs
        m.core.after(now, lb_view(&m.view, m.lease_ok, m.fresh));
        m.collect(out);
        self.run(out);
        if let Some(l) = &mut self.leases {
            l.commit_held(m.core.owner_epoch());
        }
    }

    fn execute(&mut self, _: &mut AgentMode, _: u64, out: &mut daemon::Outbox<Out>) {
        self.run(out);
    }

    fn end_round(&mut self, m: &mut AgentMode, qs: unbroken_drivers::nfqueue::Stats) {
        let skipped = self.hb.as_ref().map_or(0, |h| h.stats().skipped_wedged);
        let cc = m.core.counters;
        let fc = m.core.fast.counters;
        // The programs' counters are per-CPU map reads (system calls): twice a second is
        // what the status file shows.
        let kc = match &mut self.leases {
            Some(l) if l.counted_at.is_none_or(|t| t.elapsed() >= Duration::from_millis(500)) => {
                l.counted_at = Some(Instant::now());
                crate::sync::lock(&l.fp, "agent: fast path").counters().ok()
            }
            _ => None,
        };
        self.shared.count(|c| {
            c.fast_path.handoff = fc;
            if let Some(k) = kc {
                (c.fast_path.client_passed, c.fast_path.client_slow, c.fast_path.server_passed, c.fast_path.server_slow, c.fast_path.acks_lowered) = (k.client_passed, k.client_slow, k.server_passed, k.server_slow, k.acks_lowered);
            }
            c.queue_errors = qs.enobufs + qs.verdict_errors;
            c.heartbeats_skipped_wedged = skipped;
            c.failovers_started = cc.failovers_started;
            c.failovers_denied = cc.failovers_denied;
            c.passed_local_socket = cc.passed_local_socket;
            c.relearn_failed = cc.relearn_failed;
            c.elicited = cc.elicited;
            c.sockdiag_errors = cc.sockdiag_errors;
            c.muted = cc.muted;
            c.fenced_held = cc.fenced_held;
            c.fenced_dropped = cc.fenced_dropped;
            c.store_submitted = cc.store_submitted;
            c.log_suppressed = cc.log_suppressed + crate::ratelog::global().suppressed();
            c.core = cc;
        });
        // `protected()` walks every connection: for the status (written every 500 ms), not
        // every round.
        let mut ev = crate::sync::lock(&self.engine_view, "agent: engine view");
        let protected = match self.protected_at {
            Some(t) if t.elapsed() < Duration::from_millis(100) => ev.2,
            _ => {
                self.protected_at = Some(Instant::now());
                m.core.engine.protected()
            }
        };
        *ev = (m.core.engine.counters, m.core.engine.connections(), protected);
    }
}

/// A refused failover: logged and counted (its packets went to the kernel).
fn serialize_refusals<S: serde::Serializer>(r: &VecDeque<(SocketAddr, String)>, s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(r.iter().map(|(client, why)| format!("{client}: {why}")))
}

fn note_refusal(shared: &Shared, key: Key, why: String) {
    shared.dirty.store(true, Ordering::Relaxed);
    crate::ratelog::log("agent: refused", || format!("agent: refused {} -> {}: {why}", key.client, key.service));
    shared.count(|c| {
        c.refused += 1;
        // The core reports a failed lookup as "store: <why>".
        if why.starts_with("record refused") || why.starts_with("store: record refused") {
            // Issue 9 item 7: not this cluster's record for this key (edited, moved, foreign,
            // unversioned, expired): treated as no record at all.
            c.refused_bad_record += 1;
        } else if why.starts_with("no record") {
            c.refused_no_record += 1;
        } else if why.starts_with("store") {
            c.refused_store += 1;
        } else if why.starts_with("plan") || why.starts_with("record") {
            c.refused_plan += 1;
        }
        if c.recent_refusals.len() >= 16 {
            c.recent_refusals.pop_front();
        }
        c.recent_refusals.push_back((key.client, why));
    });
}

/// Failover lookups and relearns run on a fixed pool of threads with a bounded queue (issue 9
/// item 3): a flood of unknown connections never costs a thread each (a failed
/// `thread::spawn` panics), and their store reads share the store's pooled clients
/// ([`crate::object::kv::RedisKv`]). The core admits at most `AdmitConfig::max_in_flight` lookups at
/// once, fewer than the queue holds; a full queue refuses the job (counted, `pool_full`).
struct Pool {
    tx: std::sync::mpsc::SyncSender<Box<dyn FnOnce() + Send>>,
}

/// Worker threads of the failover pool, and jobs its queue holds.
pub const POOL_THREADS: usize = 4;
pub const POOL_QUEUE: usize = 256;

impl Pool {
    fn start(threads: usize, queue: usize) -> io::Result<Pool> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Box<dyn FnOnce() + Send>>(queue);
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads {
            let rx = rx.clone();
            std::thread::Builder::new().name(format!("ub-failover-{i}")).spawn(move || {
                // Failover work runs below normal traffic (TRODS section 5.1).
                // SAFETY: plain system calls on the calling thread.
                unsafe {
                    let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                    libc::setpriority(libc::PRIO_PROCESS, tid, 5);
                }
                loop {
                    let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                    match job {
                        // A panicking job must not take the worker with it.
                        Ok(job) => {
                            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                        }
                        Err(_) => return,
                    }
                }
            })?;
        }
        Ok(Pool { tx })
    }

    /// Queues a job; false (and the job dropped) when the queue is full.
    fn submit(&self, job: Box<dyn FnOnce() + Send>) -> bool {
        self.tx.try_send(job).is_ok()
    }
}

/// Starts a thread, counting (never panicking) when the system has none to give.
fn spawn_counted(ctx: &WorkerCtx, name: &str, f: impl FnOnce() + Send + 'static) -> bool {
    match std::thread::Builder::new().name(name.into()).spawn(f) {
        Ok(_) => true,
        Err(e) => {
            ctx.shared.count(|c| c.spawn_failed += 1);
            eprintln!("agent: cannot start a thread ({name}): {e}");
            false
        }
    }
}

/// The agent's queue rules.
fn rule_spec(cfg: &Agent) -> RuleSpec {
    let a = &cfg.raw.agent;
    let mut spec = RuleSpec::new(RuleSpec::chain_name("UNBROKEN-A", a.queue as u32), a.queue, AGENT_MARK);
    spec.hooks = vec![BuiltinChain::Prerouting, BuiltinChain::Output];
    spec.services = cfg.services.iter().map(|s| Service::tcp(s.ip(), s.port())).collect();
    spec
}

/// Removes the queue rules a stopped agent left in place (`unbroken agent --remove-rules`):
/// the service's packets reach the local server directly again, unprotected. Refused while an
/// agent of this configuration still reads the queue (its rules are its own).
pub fn remove_rules(cfg: &Agent) -> Result<(), String> {
    let a = &cfg.raw.agent;
    let qcfg = QueueConfig { queue_num: a.queue, ..QueueConfig::default() };
    match Queue::open(&qcfg) {
        Ok(q) => drop(q),
        Err(e) => return Err(format!("agent: NFQUEUE {} is in use ({e}): stop the agent that reads it first", a.queue)),
    }
    unbroken_drivers::iptables::Rules::remove_leftovers(&rule_spec(cfg)).map_err(|e| format!("agent: removing the queue rules: {e}"))?;
    // The fast path's filters, which only those rules named.
    unbroken_drivers::fastpath::object::unpin_filters(&pin_dir(a.queue)).map_err(|e| format!("agent: removing the fast path's pinned filters: {e}"))
}

/// Destroys the local sockets of `keys` in one pool job (or, when the pool is full, one
/// thread); counted in `destroys_lost` when neither can run.
fn destroy_batch(ctx: &Arc<WorkerCtx>, keys: Vec<Key>) {
    if keys.is_empty() {
        return;
    }
    let keys = Arc::new(keys);
    let k2 = keys.clone();
    if ctx.pool.submit(Box::new(move || k2.iter().for_each(destroy_socket))) {
        return;
    }
    let n = keys.len() as u64;
    ctx.shared.count(|c| c.pool_full += 1);
    if !spawn_counted(ctx, "ub-destroy", move || keys.iter().for_each(destroy_socket)) {
        ctx.shared.count(|c| c.destroys_lost += n);
    }
}

/// Carries out one of the core's requests (the verdicts and the packets to send are the
/// daemon's, see [`AgentMode`]); local sockets to destroy are collected in `destroy`.
fn execute(ctx: &Arc<WorkerCtx>, store: &dyn KvStore, o: Out, destroy: &mut Vec<Key>) {
    match o {
        // The daemon's (AgentMode::collect never hands them here); never lost if they were.
        Out::Accept { .. } | Out::Drop { .. } | Out::Inject(_) | Out::Elicit(_) => {}
        Out::Failover { key, bucket, trigger: _ } => {
            let c2 = ctx.clone();
            if !ctx.pool.submit(Box::new(move || {
                let result = lookup(&c2, key, bucket);
                c2.send(Msg::Record { key, bucket, result });
            })) {
                ctx.shared.count(|c| c.pool_full += 1);
                ctx.send(Msg::Record { key, bucket, result: Err("the failover worker pool is full".into()) });
            }
        }
        Out::Rebuild { key, bucket, rec, plan, trigger } => {
            let c2 = ctx.clone();
            let t0 = Instant::now();
            // A thread per rebuilt connection: it serves the connection for its lifetime.
            // Only a connection with a record and a packet that planned against it gets
            // here (never a bogus ACK).
            if !spawn_counted(ctx, "ub-rebuilt", move || rebuild(c2, key, bucket, *rec, *plan, trigger, t0)) {
                ctx.send(Msg::Refuse { key, why: "rebuild: no thread to serve it".into() });
            }
        }
        Out::Destroy { key } => {
            if !silence_adopted(ctx, &key) {
                destroy.push(key);
            }
        }
        Out::Relearn { key, bucket, trigger: _ } => {
            let c2 = ctx.clone();
            if !ctx.pool.submit(Box::new(move || {
                let (found, sock) = relearn(&c2, key, bucket);
                c2.send(Msg::Relearn { key, bucket, found, sock });
            })) {
                ctx.shared.count(|c| c.pool_full += 1);
                ctx.send(Msg::Relearn { key, bucket, found: Err("the failover worker pool is full".into()), sock: Ok(None) });
            }
        }
        Out::Supersede { key } => {
            if silence_adopted(ctx, &key) {
                eprintln!("agent: {} acknowledged bytes not sent from here: rebuilding from its ACK", key.client);
                ctx.shared.count(|c| c.superseded += 1);
            }
        }
        Out::Silence { key } => {
            // A socket this agent rebuilt: stop its worker (whatever the socket still
            // sends is dropped: muted). The local server's own socket: destroy it (its RST
            // goes through the queue, where the muted entry drops it). Left alive it would
            // retransmit for minutes after its muted entry expired, long after its client
            // finished with the server that took the connection over, and the client's
            // answers would draw RSTs from there (the object chaos demo counted one).
            if !silence_adopted(ctx, &key) {
                ctx.shared.count(|c| c.muted_destroyed += 1);
                destroy.push(key);
            }
        }
        Out::Store(op) => {
            let _ = store.submit(ctx.records.seal_op(op, unix_ms()));
        }
        Out::Probe { buckets, skip } => {
            let c2 = ctx.clone();
            spawn_counted(ctx, "ub-probe", move || probe_buckets(c2, buckets, skip));
        }
        Out::Log(line) => eprintln!("{line}"),
    }
}

/// Creates the status file's directory and checks that the file can be written there: a
/// wrong path is one clear error at start, not a complaint every 500 ms.
fn prepare_status_file(path: &std::path::Path) -> Result<(), String> {
    crate::status::prepare(path, "agent: status_file")
}

/// Says when something outside the agent stays wrong (no I/O): `Some(true)` when the
/// condition has held for `after_ms` (said once), `Some(false)` when it ends after having
/// been said, `None` otherwise. A blip shorter than `after_ms` (the store connecting at start)
/// says nothing.
#[derive(Debug, Clone)]
pub struct OutageWatch {
    after_ms: u64,
    since: Option<u64>,
    said: bool,
}

impl OutageWatch {
    /// A watch that speaks after `after_ms` of a lasting condition.
    pub fn new(after_ms: u64) -> OutageWatch {
        OutageWatch { after_ms, since: None, said: false }
    }

    /// Whether the condition holds at `now_ms`; returns what to say.
    pub fn observe(&mut self, bad: bool, now_ms: u64) -> Option<bool> {
        if !bad {
            self.since = None;
            return std::mem::take(&mut self.said).then_some(false);
        }
        let since = *self.since.get_or_insert(now_ms);
        if !self.said && now_ms.saturating_sub(since) >= self.after_ms {
            self.said = true;
            return Some(true);
        }
        None
    }
}

/// The agent's own status fields (the daemon adds the common ones, see
/// [`crate::daemon::common_fields`]); also says when the store or the LB's heartbeats go
/// wrong, with or without a status file.
fn status_fields(
    shared: Arc<Shared>,
    ev: Arc<Mutex<(trods::Counters, usize, usize)>>,
    store: Arc<dyn KvStore>,
    mut hbw: Option<(crate::object::lb::HeartbeatProbe, crate::object::hbproto::HealthWatch)>,
) -> impl FnMut(bool, u64) -> serde_json::Map<String, serde_json::Value> + Send + 'static {
    let mut store_watch = OutageWatch::new(1_000);
    move |_, now_ms| {
        let (engine, conns, protected) = *crate::sync::lock(&ev, "agent: engine view");
        // A store outage is said once when it has lasted a second (at start too) and once when
        // it ends: connections whose store fails run unprotected meanwhile, and are protected
        // again when it answers.
        let down = store.is_down();
        match store_watch.observe(down, now_ms) {
            Some(true) => {
                shared.count(|c| c.store_outages += 1);
                eprintln!(
                    "agent: store unreachable ({}): connections whose record cannot be stored run unprotected until it answers again (a death then resets them); {protected} of {conns} protected now",
                    store.describe()
                );
            }
            Some(false) => {
                eprintln!(
                    "agent: store reachable again: protection re-arms ({} connection(s) left unprotected by store failures so far, {} re-armed)",
                    engine.unprotected_store, engine.rearmed
                );
            }
            None => {}
        }
        // Heartbeats nobody accepts (a wrong key or LB address): said within seconds.
        let lb = hbw.as_mut().map(|(probe, w)| {
            let st = probe.stats();
            if let Some(line) = w.observe(&st, now_ms) {
                eprintln!("{line}");
            }
            serde_json::json!({
                "state": w.state(),
                "detail": w.describe(),
                "last_reply_age_ms": w.last_ok_age_ms(now_ms),
                "stats": st,
            })
        });
        let agent = crate::sync::lock(&shared.counters, "agent: counters").clone();
        let doc = serde_json::json!({
            "wall_ms": SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0),
            "connections": conns,
            "protected": protected,
            "agent": agent,
            "engine": engine,
            "store": store.describe(),
            "store_down": down,
            "lb_heartbeats": lb,
        });
        doc.as_object().cloned().unwrap_or_default()
    }
}

// ---- failover -----------------------------------------------------------------------------------

struct WorkerCtx {
    /// Rebuilt sockets being served (with the generation of their worker), so a muted or
    /// superseded connection's worker can be stopped.
    adopted: Mutex<HashMap<Key, (u64, std::os::fd::OwnedFd, Option<u16>)>>,
    /// The list of rebuilt connections kept across restarts.
    rebuilt: RebuiltList,
    next_gen: std::sync::atomic::AtomicU64,
    kv: Arc<dyn KvStore>,
    records: Records,
    backend: SocketAddr,
    tx: Sender<Msg>,
    wake: Arc<Wake>,
    shared: Arc<Shared>,
    pool: Pool,
}

impl WorkerCtx {
    fn send(&self, m: Msg) {
        let _ = self.tx.send(m);
        self.wake.ring();
    }
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Opens the value read under `skey` (see [`Records::open`]), counting a refusal by reason.
fn open_record(ctx: &WorkerCtx, skey: &str, value: &[u8]) -> Result<Record, Refusal> {
    ctx.records.open(skey.as_bytes(), value, unix_ms()).inspect_err(|r| {
        ctx.shared.count(|c| match r {
            Refusal::Sealed(Refused::BadMac) => c.records_bad_mac += 1,
            Refusal::Sealed(Refused::Unversioned) => c.records_unversioned += 1,
            Refusal::Expired { .. } => c.records_expired += 1,
            _ => c.records_invalid += 1,
        })
    })
}

/// Reads `skey` from the store, retrying a failed read for up to `budget` (a transient error
/// should not cost a connection its protection).
fn get_retrying(ctx: &WorkerCtx, skey: &str, budget: Duration) -> Result<Option<Vec<u8>>, crate::object::store::StoreError> {
    let deadline = Instant::now() + budget;
    loop {
        match ctx.kv.get(skey.as_bytes()) {
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)), // back-off between store retries
            r => return r,
        }
    }
}

/// Reads the record of a connection a local socket serves, then the socket's progress (after
/// the record: the connection's client packets wait meanwhile, so the socket's position does
/// not move past what the record was read against). Its packets wait, so a store that does not
/// answer is given only a moment. The core decides ([`Core::relearn_found`]).
fn relearn(ctx: &WorkerCtx, key: Key, bucket: Option<u16>) -> (Result<Option<Record>, String>, Result<Option<Progress>, String>) {
    let skey = store_key(bucket, &key);
    let found = match get_retrying(ctx, &skey, Duration::from_millis(300)) {
        Err(e) => Err(e.to_string()),
        Ok(None) => Ok(None),
        Ok(Some(v)) => open_record(ctx, &skey, &v).map(Some).map_err(|e| format!("record refused: {e}")),
    };
    let sock = SockDiag::open().and_then(|mut d| d.lookup_progress(key.service, key.client)).map(|i| i.and_then(|i| i.progress)).map_err(|e| e.to_string());
    (found, sock)
}

/// A failover lookup (on the pool): the record of `key`, with retries for a moment (many
/// connections of a dead server fail over at once; a transient error should not reset one).
fn lookup(ctx: &WorkerCtx, key: Key, bucket: Option<u16>) -> Result<Option<Record>, String> {
    let skey = store_key(bucket, &key);
    match get_retrying(ctx, &skey, Duration::from_millis(1500)).map_err(|e| e.to_string())? {
        None => Ok(None),
        // Issue 9 item 7: a value that is not this cluster's record for this key is refused
        // (the client gets the RST an unprotected server's death gives).
        Some(v) => open_record(ctx, &skey, &v).map(Some).map_err(|e| format!("record refused: {e}")),
    }
}

/// Rebuilds `key` from `rec` as the core planned it from `trigger`, then serves it.
fn rebuild(ctx: Arc<WorkerCtx>, key: Key, bucket: Option<u16>, rec: Record, plan: Plan, trigger: Vec<u8>, t0: Instant) {
    // TRODS section 5.1: failover work runs below normal traffic.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 5);
    }
    let refuse = |why: String, f: fn(&mut AgentCounters)| {
        ctx.shared.count(f);
        ctx.send(Msg::Refuse { key, why });
    };
    let Some((_, trig)) = Trigger::parse(&trigger) else {
        return refuse("unparsable trigger".into(), |c| c.refused_plan += 1);
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
        let mut adopted = crate::sync::lock(&ctx.adopted, "agent: rebuilt sockets");
        adopted.insert(key, (gen, dup.into(), bucket));
        // Rebuilt here now: listed as this agent's from here on, and not again once it ends.
        crate::sync::lock(&ctx.rebuilt.inherited, "agent: rebuilt list").remove(&key);
        save_rebuilt(&ctx);
    }
    serve_recovered(&ctx, sock, &rec, &plan, key, gen);
    // Only this worker's entry: a silenced socket's entry is gone already, and a new failover
    // of the same connection may have put its own there.
    let mut adopted = crate::sync::lock(&ctx.adopted, "agent: rebuilt sockets");
    if adopted.get(&key).is_some_and(|(g, _, _)| *g == gen) {
        adopted.remove(&key);
        save_rebuilt(&ctx);
    }
}

/// The list of connections this agent rebuilt, kept in a file (one line each: client,
/// service, bucket or `-`) replaced atomically after every change: their sockets die with the
/// agent, and the next agent on this server rebuilds them from their records
/// ([`Core::inherit`]). Written by its own thread ([`RebuiltList::writer`]), never by the
/// packet loop or under the `adopted` lock: a mass failover silences and adopts hundreds of
/// connections, and one file write per change under that lock kept the packet loop waiting
/// for up to 700 ms behind low-priority workers (its heartbeats stopped, the LB declared a
/// live server dead, and the failovers cascaded). Not rewritten once the agent is stopping
/// (its workers end then, and their connections must stay listed; the loop writes the final
/// list itself).
struct RebuiltList {
    path: Option<PathBuf>,
    /// Changes not yet written.
    changed: Mutex<bool>,
    cv: std::sync::Condvar,
    /// Held while a list is written: the final write at stop never races the writer's.
    writing: Mutex<()>,
    /// The predecessor's list, inherited: still listed until `grace_until` (the core's
    /// restart grace), so that a successor of this agent started meanwhile inherits them too;
    /// written out of the list once it ends (a revived server's agent that rebuilds nothing
    /// used to leave its dead predecessor's list in place for good, and every later
    /// successor probed those long-finished connections again).
    inherited: Mutex<HashMap<Key, Option<u16>>>,
    grace_until: Instant,
}

impl RebuiltList {
    fn new(path: Option<PathBuf>, inherited: Vec<(Key, Option<u16>)>, grace_until: Instant) -> RebuiltList {
        RebuiltList { path, changed: Mutex::new(false), cv: std::sync::Condvar::new(), writing: Mutex::new(()), inherited: Mutex::new(inherited.into_iter().collect()), grace_until }
    }

    /// What the file lists: the connections rebuilt here and still served, and while the
    /// grace lasts the inherited ones not rebuilt again here.
    fn listed(&self, adopted: &HashMap<Key, (u64, std::os::fd::OwnedFd, Option<u16>)>) -> Vec<(Key, Option<u16>)> {
        let mut keys: Vec<(Key, Option<u16>)> = adopted.iter().map(|(k, v)| (*k, v.2)).collect();
        if Instant::now() < self.grace_until {
            keys.extend(crate::sync::lock(&self.inherited, "agent: rebuilt list").iter().filter(|(k, _)| !adopted.contains_key(k)).map(|(k, b)| (*k, *b)));
        }
        keys
    }

    /// The set of rebuilt connections changed: the writer writes it soon (changes coalesce).
    fn changed(&self) {
        *crate::sync::lock(&self.changed, "agent: rebuilt list") = true;
        self.cv.notify_one();
    }

    /// Writes the list after each change until the agent stops (and keeps the
    /// `rebuilt_serving` gauge, with or without a file).
    fn writer(ctx: Arc<WorkerCtx>) {
        let list = &ctx.rebuilt;
        // The inherited entries leave the file once the grace ends.
        let mut grace_due = !crate::sync::lock(&list.inherited, "agent: rebuilt list").is_empty();
        while !daemon::stopping() {
            {
                let mut c = crate::sync::lock(&list.changed, "agent: rebuilt list");
                if !*c {
                    c = list.cv.wait_timeout(c, Duration::from_millis(200)).map(|(g, _)| g).unwrap_or_else(|e| e.into_inner().0);
                }
                let grace_over = grace_due && Instant::now() >= list.grace_until;
                if !std::mem::take(&mut *c) && !grace_over {
                    continue;
                }
                grace_due &= !grace_over;
            }
            let _w = crate::sync::lock(&list.writing, "agent: rebuilt list");
            if daemon::stopping() {
                return;
            }
            let (keys, serving) = {
                let adopted = crate::sync::lock(&ctx.adopted, "agent: rebuilt sockets");
                (list.listed(&adopted), adopted.len() as u64)
            };
            ctx.shared.count(|c| c.rebuilt_serving = serving);
            if let Some(path) = &list.path {
                write_rebuilt(path, keys.into_iter());
            }
        }
    }
}

fn save_rebuilt(ctx: &WorkerCtx) {
    ctx.rebuilt.changed();
}

fn write_rebuilt(path: &std::path::Path, keys: impl Iterator<Item = (Key, Option<u16>)>) {
    let mut text = String::new();
    for (k, b) in keys {
        text.push_str(&format!("{} {} {}\n", k.client, k.service, b.map_or("-".to_string(), |b| b.to_string())));
    }
    if let Err(e) = crate::status::write_atomic(path, text.as_bytes()) {
        eprintln!("agent: keeping the list of rebuilt connections in {}: {e}", path.display());
    }
}

/// Reads [`write_rebuilt`]'s list (a missing file is an empty list; bad lines are skipped and
/// counted in the returned error text).
fn read_rebuilt(path: &std::path::Path) -> (Vec<(Key, Option<u16>)>, usize) {
    let Ok(text) = std::fs::read_to_string(path) else { return (Vec::new(), 0) };
    let mut bad = 0;
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut f = line.split_whitespace();
        let parsed = (|| {
            let client = f.next()?.parse().ok()?;
            let service = f.next()?.parse().ok()?;
            let bucket = match f.next()? {
                "-" => None,
                b => Some(b.parse().ok()?),
            };
            Some((Key { client, service }, bucket))
        })();
        match parsed {
            Some(x) => out.push(x),
            None => bad += 1,
        }
    }
    (out, bad)
}

/// Stops the worker of a socket this agent rebuilt for `key`, if any: repair mode first, so
/// nothing it still does reaches the wire and its close is silent and frees the address pair
/// at once (tcp_close in repair mode); then shutdown, which wakes the worker (EPIPE, EOF) and
/// makes it close the socket. Returns whether there was one.
fn silence_adopted(ctx: &WorkerCtx, key: &Key) -> bool {
    let mut adopted = crate::sync::lock(&ctx.adopted, "agent: rebuilt sockets");
    let Some((_, fd, _)) = adopted.remove(key) else { return false };
    save_rebuilt(ctx);
    drop(adopted);
    if let Err(e) = repair::enter_repair(fd.as_raw_fd()) {
        eprintln!("agent: silencing {}: {e}", key.client);
    }
    unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR) };
    true
}

/// Whether the worker of generation `gen` still serves `key` (it was not silenced).
fn still_adopted(ctx: &WorkerCtx, key: &Key, gen: u64) -> bool {
    crate::sync::lock(&ctx.adopted, "agent: rebuilt sockets").get(key).is_some_and(|(g, _, _)| *g == gen)
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
            Err(ResumeError::Mismatch(m)) => {
                let changed = matches!(m, Mismatch::Changed(_));
                let (Mismatch::Changed(why) | Mismatch::Other(why)) = m;
                eprintln!("agent: resume refused: {why}");
                ctx.shared.count(|c| {
                    c.resume_mismatch += 1;
                    c.resume_object_changed += changed as u64;
                });
                reset(sock);
                return;
            }
            Err(ResumeError::Refused(why)) => {
                eprintln!("agent: resume refused: the record's request: {why}");
                ctx.shared.count(|c| c.resume_refused += 1);
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
    Mismatch(Mismatch),
    /// The record's objectID or validator failed the replay checks.
    Refused(&'static str),
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
/// `body_from`, fetched from the local server with the request [`resume::request`] builds
/// (checked objectID, `Range` with `If-Range`) and sent only if [`resume::check`] finds the
/// local answer is the same representation.
fn resume_entry(ctx: &WorkerCtx, sock: &mut TcpStream, backend: &mut Option<BufConn>, e: &trods::Entry, header_from: usize, body_from: u64) -> Result<u64, ResumeError> {
    let mut sent = 0u64;
    // Checked before the first byte goes to the client.
    let fetch = if body_from < e.body_len { Some(resume::request(e, body_from).map_err(|u| ResumeError::Refused(u.0))?) } else { None };
    if header_from < e.header.len() {
        sock.write_all(&e.header[header_from..])?;
        sent += (e.header.len() - header_from) as u64;
    }
    let Some((req, expect)) = fetch else { return Ok(sent) };
    if backend.is_none() {
        let s = TcpStream::connect_timeout(&ctx.backend, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        *backend = Some(BufConn { s, buf: Vec::new() });
    }
    let b = backend.as_mut().unwrap();
    b.s.write_all(&req)?;
    let head = b.read_head()?;
    let r = unbroken_engines::http::parse_response(&head, false).map_err(|u| ResumeError::Mismatch(Mismatch::Other(format!("local response: {}", u.0))))?;
    resume::check(&expect, &r).map_err(ResumeError::Mismatch)?;
    sent += b.copy_body(expect.skip, expect.send, sock)?;
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
    let up = std::thread::Builder::new().name("ub-relay".into()).spawn(move || {
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
    let up = match up {
        Ok(h) => h,
        Err(e) => {
            ctx.shared.count(|c| c.spawn_failed += 1);
            eprintln!("agent: relay: cannot start a thread: {e}");
            reset(client);
            return;
        }
    };
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
fn probe_buckets(ctx: Arc<WorkerCtx>, buckets: Vec<u16>, skip: Vec<Key>) {
    let skip: std::collections::HashSet<Key> = skip.into_iter().collect();
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
    // A few buckets (a death): one scan each. Many (every owned bucket, after a start): one
    // scan of every bucket's records, filtered (each scan walks the whole keyspace).
    let scans: Vec<(String, Option<u16>)> = if buckets.len() <= 4 {
        buckets.iter().map(|b| (format!("b{b}/c/"), Some(*b))).collect()
    } else {
        vec![("b".to_string(), None)]
    };
    let wanted: std::collections::HashSet<u16> = buckets.iter().copied().collect();
    for (prefix, one) in scans {
        let Ok(keys) = ctx.kv.keys_with_prefix(&prefix) else { continue };
        // The core first: these connections' failover lookups bypass the admission budgets.
        let listed: Vec<(Key, u16)> = keys.iter().filter_map(|k| Some((parse_store_key(k)?, one.or_else(|| parse_store_bucket(k)).filter(|b| wanted.contains(b))?))).collect();
        if !listed.is_empty() {
            ctx.send(Msg::Listed { keys: listed });
        }
        for k in keys {
            let Some(b) = one.or_else(|| parse_store_bucket(&k)).filter(|b| wanted.contains(b)) else { continue };
            let Some(conn) = parse_store_key(&k) else { continue };
            if skip.contains(&conn) {
                continue;
            }
            let Ok(Some(v)) = ctx.kv.get(&k) else { continue };
            let Ok(rec) = open_record(&ctx, &String::from_utf8_lossy(&k), &v) else { continue };
            eprintln!("agent: probing {} (bucket {b})", conn.client);
            if let Some(pkt) = crate::object::agentcore::probe_packet(&conn, &rec) {
                if raw.send(&pkt).is_ok() {
                    ctx.shared.count(|c| c.probes_sent += 1);
                }
            }
        }
    }
}

/// The bucket of a record's key (`b{bucket}/c/...`).
fn parse_store_bucket(k: &[u8]) -> Option<u16> {
    let s = std::str::from_utf8(k).ok()?;
    s.strip_prefix('b')?.split_once("/c/")?.0.parse().ok()
}

fn parse_store_key(k: &[u8]) -> Option<Key> {
    let s = std::str::from_utf8(k).ok()?;
    let rest = s.split_once("/c/")?.1;
    let (client, service) = rest.split_once('/')?;
    Some(Key { client: client.parse().ok()?, service: service.parse().ok()? })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Refusals are kept as they came (client, reason) and written to the status as
    /// "client: why", at most the last 16.
    #[test]
    fn recent_refusals_keep_the_last_16_and_read_as_client_and_reason() {
        let mut c = AgentCounters::default();
        for n in 0..20u16 {
            if c.recent_refusals.len() >= 16 {
                c.recent_refusals.pop_front();
            }
            c.recent_refusals.push_back((SocketAddr::from(([10, 77, 0, 2], 40000 + n)), format!("no record {n}")));
        }
        let v = serde_json::to_value(&c).unwrap();
        let r = v["recent_refusals"].as_array().unwrap();
        assert_eq!(r.len(), 16);
        assert_eq!(r[0], "10.77.0.2:40004: no record 4");
        assert_eq!(r[15], "10.77.0.2:40019: no record 19");
    }

    const BASE: &str = "[agent]\nserver_id = 1\nservices = [\"10.77.0.100:80\"]\nlb = \"10.78.0.1:7950\"\nkey = \"00112233445566778899aabbccddeeff\"\n\n[store]\nnodes = [\"10.78.0.2:6379\"]\n";
    const RKEY: &str = "8f1e2d3c4b5a69788796a5b4c3d2e1f0";

    fn with(extra: &str) -> Result<Agent, String> {
        Agent::from_toml(&format!("{BASE}{extra}"))
    }

    #[test]
    fn the_record_key_comes_from_the_config_or_a_file() {
        let a = with(&format!("record_key = \"{RKEY}\"\n")).unwrap();
        assert_eq!(a.record_key, RecordKey::from_hex(RKEY).unwrap());
        let dir = std::env::temp_dir().join(format!("ub-agent-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("record.key");
        std::fs::write(&f, format!("{RKEY}\n")).unwrap();
        let b = with(&format!("record_key_file = \"{}\"\n", f.display())).unwrap();
        assert_eq!(b.record_key, a.record_key);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn hostile_agent_config_without_a_good_key_is_refused() {
        // The example config, with its record key given inline instead of from a file.
        let example = include_str!("../../../../configs/agent.example.toml");
        let file_line = "record_key_file = \"/etc/unbroken/record.key\"";
        assert!(example.contains(file_line));
        let base = &example.replace(file_line, &format!("record_key = \"{RKEY}\""));
        Agent::from_toml(base).unwrap();
        let good = "key = \"00112233445566778899aabbccddeeff\"";
        assert!(base.contains(good));
        let e = Agent::from_toml(&base.replace(good, "")).unwrap_err();
        assert!(e.starts_with("agent.key is missing or empty"), "{e}");
        let e = Agent::from_toml(&base.replace(good, "key = \"0011\"")).unwrap_err();
        assert!(e.starts_with("agent.key is 2 bytes") && e.contains("at least 16"), "{e}");
        // Without an LB (gate "open") no key is needed.
        let open = base.replace(good, "").replace("failover_gate = \"lb\"", "failover_gate = \"open\"").replace("lb = \"10.78.0.1:7950\"", "");
        Agent::from_toml(&open).unwrap();
    }

    #[test]
    fn hostile_status_directory_missing_is_created_or_refused_once() {
        let dir = std::env::temp_dir().join(format!("unbroken-agent-status-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("deep/er/agent.json");
        prepare_status_file(&path).unwrap();
        assert!(path.parent().unwrap().is_dir());
        // A path under a regular file cannot be created: one clear error naming it.
        std::fs::write(dir.join("file"), b"x").unwrap();
        let e = prepare_status_file(&dir.join("file/agent.json")).unwrap_err();
        assert!(e.contains("status_file") && e.contains("cannot create its directory"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Issue 20 item 14: the list of rebuilt connections went through `<path>.tmp`, written
    /// following symlinks: a planted one had the root agent overwrite any file. Now the list is
    /// written and the target is untouched.
    #[test]
    fn hostile_rebuilt_list_does_not_follow_a_planted_temp_symlink() {
        let d = crate::status::tests::Scratch::new("agent-rebuilt-symlink");
        let path = d.0.join("rebuilt.list");
        let victim = d.plant(&path.with_extension("tmp"));
        let k = Key {
            client: SocketAddr::from(([10, 77, 0, 2], 40000)),
            service: SocketAddr::from(([10, 77, 0, 10], 6379)),
        };
        write_rebuilt(&path, [(k, Some(7))].into_iter());
        assert_eq!(read_rebuilt(&path), (vec![(k, Some(7))], 0), "the list is written");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious", "the symlink's target is untouched");
    }

    #[test]
    fn hostile_config_without_a_usable_record_key_is_refused() {
        let e = with("").unwrap_err();
        assert!(e.starts_with("store.record_key (hex, at least 16 bytes) or store.record_key_file is missing"), "{e}");
        let e = with(&format!("record_key = \"{RKEY}\"\nrecord_key_file = \"/x\"\n")).unwrap_err();
        assert!(e.contains("give one of them, not both"), "{e}");
        let e = with("record_key = \"0011\"\n").unwrap_err();
        assert_eq!(e, "store.record_key: 2 bytes; at least 16 bytes (32 hex digits) are needed");
        let e = with("record_key = \"not hex at all\"\n").unwrap_err();
        assert_eq!(e, "store.record_key: not an even number of hex digits");
        let e = with(&format!("record_key = \"{}\"\n", "ab".repeat(16))).unwrap_err();
        assert!(e.starts_with("store.record_key: every byte is the same"), "{e}");
        let e = with("record_key = \"00112233445566778899aabbccddeeff\"\n").unwrap_err();
        assert!(e.starts_with("store.record_key: the same as agent.key"), "{e}");
        let e = with("record_key_file = \"/nonexistent/unbroken/record.key\"\n").unwrap_err();
        assert!(e.starts_with("store.record_key_file: /nonexistent/unbroken/record.key: "), "{e}");
    }

    #[test]
    fn hostile_store_down_at_start_is_said_within_a_second_and_its_return_too() {
        let mut w = OutageWatch::new(1_000);
        assert_eq!(w.observe(true, 0), None);
        assert_eq!(w.observe(true, 500), None);
        assert_eq!(w.observe(true, 1_000), Some(true), "said once it lasted a second");
        assert_eq!(w.observe(true, 1_500), None, "said once");
        assert_eq!(w.observe(false, 2_000), Some(false), "and when it ends");
        assert_eq!(w.observe(false, 2_500), None);
        // A blip (the store connecting at start) says nothing.
        assert_eq!(w.observe(true, 3_000), None);
        assert_eq!(w.observe(false, 3_100), None);
    }
}
