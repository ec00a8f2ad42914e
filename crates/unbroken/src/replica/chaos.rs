//! `unbroken demo replica --chaos N` (issue 20): N trials, each on a fresh [`ReplicaEnv`]
//! (redis-server on both hosts, both daemons with their own defaults for beats and lag bounds),
//! the verifying client ([`crate::replica::client`]: 8 connections of INCR and 1 KiB-1 MiB SET/GET,
//! every reply checked byte for byte) for a bounded time, and one fault drawn from the seed at a
//! random time between 20 % and 80 % of the trial. [`run_trial`] is one trial on a running
//! system (also used by the namespace tests in `tests/replica_lab.rs`).
//!
//! The faults ([`Fault`]): the primary's host crashes; redis SIGKILLed on the primary or the
//! backup; redis SIGSTOPped on the primary or the backup (an application hang, ST-TCP Table 3.3
//! row 2: it is never continued, a hung server stays hung as in the lab tests of that row);
//! the backup's host crashes; a daemon restart on either host (SIGKILL, then the same command
//! and config again: a crash and a restart, not a clean stop); 200 ms of loss of every packet to
//! the service address toward the primary or toward the backup (nftables netdev ingress on its
//! interface); a replayed side-channel datagram (one authenticated primary-to-backup datagram
//! captured in the client namespace before the client starts, where the lab's hub floods it,
//! and sent again unchanged at the fault's time: the backup must refuse it, counted as
//! `beats_stale`/`beats_bad`/`beats_foreign`); and no fault.
//!
//! After each trial (and a settling window in which a takeover the run caused may still come):
//! the client's report, RSTs at the client (`lab::install_rst_counter`), the
//! takeover (the backup's state `took_over`), the client namespace's `TcpExtPAWSEstab` delta,
//! and the acknowledged writes the surviving server lacks (the backup's server after a
//! takeover, else the primary's; every counter and SET key read through its host address). A
//! takeover is a false failover when the primary was healthy: no fault, loss, a replay, a
//! backup-side fault or a restart of the backup's daemon. A restart of the primary's daemon is a
//! primary fault: while it is down its host's service packets wait in a queue nobody reads, and
//! the restarted daemon has lost every connection's state (held output, alignment), so the
//! backup taking over is the protection working, not a false failover.

use crate::common::{pct, Percentiles, Rng};
use crate::replica::client::{lost_writes, Args, CheckClient, ClientReport};
use crate::replica::demo::{tools_missing, RepOpts, ReplicaEnv, Side, REDIS_PORT};
use serde::Serialize;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use unbroken_lab::lab;
use unbroken_lab::replicalab::addr;

/// One trial's fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    None,
    PrimaryHostCrash,
    BackupHostCrash,
    RedisKill(Side),
    RedisStop(Side),
    DaemonRestart(Side),
    /// 200 ms of loss toward that host.
    Loss(Side),
    /// A captured primary-to-backup side-channel datagram sent to the backup again.
    Replay,
}

/// Every fault, in the order the seed draws from.
pub const FAULTS: [Fault; 12] = [
    Fault::None,
    Fault::PrimaryHostCrash,
    Fault::BackupHostCrash,
    Fault::RedisKill(Side::Primary),
    Fault::RedisKill(Side::Backup),
    Fault::RedisStop(Side::Primary),
    Fault::RedisStop(Side::Backup),
    Fault::DaemonRestart(Side::Primary),
    Fault::DaemonRestart(Side::Backup),
    Fault::Loss(Side::Primary),
    Fault::Loss(Side::Backup),
    Fault::Replay,
];

/// The loss faults' duration.
pub const LOSS: Duration = Duration::from_millis(200);

impl Fault {
    pub fn name(self) -> &'static str {
        use Side::{Backup as B, Primary as P};
        match self {
            Fault::None => "none",
            Fault::PrimaryHostCrash => "primary_host_crash",
            Fault::BackupHostCrash => "backup_host_crash",
            Fault::RedisKill(P) => "redis_kill_primary",
            Fault::RedisKill(B) => "redis_kill_backup",
            Fault::RedisStop(P) => "redis_stop_primary",
            Fault::RedisStop(B) => "redis_stop_backup",
            Fault::DaemonRestart(P) => "daemon_restart_primary",
            Fault::DaemonRestart(B) => "daemon_restart_backup",
            Fault::Loss(P) => "loss_toward_primary",
            Fault::Loss(B) => "loss_toward_backup",
            Fault::Replay => "replayed_datagram",
        }
    }

    pub fn parse(name: &str) -> Option<Fault> {
        FAULTS.into_iter().find(|f| f.name() == name)
    }

    /// Whether the primary stays healthy (its host and its server): a takeover is then a false
    /// failover.
    pub fn primary_healthy(self) -> bool {
        !matches!(self, Fault::PrimaryHostCrash | Fault::RedisKill(Side::Primary) | Fault::RedisStop(Side::Primary) | Fault::DaemonRestart(Side::Primary))
    }
}

/// The client side of a trial.
#[derive(Debug, Clone)]
pub struct TrialOpts {
    /// How long the client starts operations, s.
    pub secs: f64,
    pub conns: usize,
    /// The client's seed (its mix of operations and values).
    pub seed: u64,
    /// SET values, bytes (`max_value` 0: INCR only).
    pub min_value: u64,
    pub max_value: u64,
    /// An operation longer than this is a hang.
    pub hang_ms: u64,
    /// After the client ends, how long a takeover is still waited for (and counted): a primary
    /// yields when a connection's output is held beyond `max_lag_ms`, or a lone FIN beyond
    /// `max_delay_fin_ms` (5 s each by default), so the client's last operations and its
    /// closing can still move the service after it ended. The window ends early at a takeover.
    pub settle: Duration,
}

impl Default for TrialOpts {
    fn default() -> Self {
        let a = Args::default();
        TrialOpts { secs: 20.0, conns: a.conns, seed: 1, min_value: a.min_value, max_value: a.max_value, hang_ms: a.hang_ms, settle: Duration::from_secs(6) }
    }
}

/// What one trial saw.
#[derive(Debug, Clone, Serialize)]
pub struct Trial {
    pub fault: &'static str,
    /// When the fault hit, as a fraction of the client's run.
    pub at: f64,
    pub ok: bool,
    /// Every connection ran its whole time, every reply byte-exact.
    pub byte_exact: bool,
    pub resets_seen_by_client: u64,
    /// Operations beyond the hang bound (or the client killed at its deadline).
    pub hangs: u64,
    /// The backup took over.
    pub takeover: bool,
    pub false_failover: bool,
    pub lost_acknowledged_writes: u64,
    /// Keys of the surviving server that could not be read.
    pub unreadable_keys: u64,
    /// The surviving server read back (`primary` or `backup`).
    pub checked_on: &'static str,
    /// The longest stall of any connection, and the longest operation, ms.
    pub stall_ms: u64,
    pub max_op_ms: u64,
    /// The client namespace's `TcpExtPAWSEstab` after minus before (None: unreadable).
    pub paws_estab: Option<u64>,
    /// Packets the kernel dropped before any socket saw them (`/proc/net/softnet_stat`'s
    /// second column, all CPUs, after minus before: backlog overflows, for every namespace of
    /// this host): the side channel's beats are among what such drops can take.
    pub softnet_dropped: Option<u64>,
    pub ops: u64,
    pub bytes: u64,
    /// Segments the client's connections retransmitted.
    pub client_retrans: u64,
    /// What the fault did (packets dropped, the replay refused, ...).
    pub fault_detail: String,
    /// Loss: the packets dropped; replay: the datagrams the backup refused (its bad, stale and
    /// foreign counters' growth).
    pub fault_packets: u64,
    /// Each connection's failure, if any.
    pub client_failures: Vec<String>,
    pub lost_details: Vec<String>,
    /// The daemons' state and main counters at the end, and the primary's log lines about
    /// yielding.
    pub daemons: serde_json::Value,
    pub yield_log: Vec<String>,
    /// The backup's log lines about fencing (why it fenced: how long the primary was silent).
    pub fence_log: Vec<String>,
    /// Each daemon's slow loop rounds ("a loop round took ..." lines, the first 3 of each).
    pub slow_rounds: Vec<String>,
    pub error: Option<String>,
    /// The client's whole report (per connection), for tests.
    #[serde(skip)]
    pub client: Option<ClientReport>,
    /// Both status files at the end, for tests.
    #[serde(skip)]
    pub status: [Option<serde_json::Value>; 2],
}

/// The status fields a trial reports of each daemon (those present).
const STATUS_FIELDS: [&str; 18] = [
    "state",
    "connections",
    "unprotected",
    "unprotected_by",
    "diverged",
    "fences_run",
    "fences_failed",
    "takeover_ms",
    "beats_stale",
    "beats_bad",
    "beats_foreign",
    "yields_refused",
    "yielded_dropped",
    "held_bytes",
    // The longest gap between two rounds of the daemon's loop, and how many exceeded a beat
    // interval: a late loop beats late (and may see its peer's beats late).
    "tick_gap_max_ms",
    "tick_gaps_over_interval",
    // Client bytes relayed over the side channel (either way) and injected.
    "input_sent",
    "input_injected",
];
/// The engine counters a trial reports (those present).
const ENGINE_FIELDS: [&str; 16] = ["held", "released", "retrans_dropped", "nudges", "acks_lowered", "kept_dropped", "takeover_resent", "withheld", "acks_relayed", "acks_unheard", "diverged_reset", "acks_from_backup", "relayed_to_primary", "input_copy_full", "backup_input", "backup_input_redundant"];

fn compact(s: &Option<serde_json::Value>) -> serde_json::Value {
    let Some(s) = s else { return serde_json::Value::Null };
    let mut m = serde_json::Map::new();
    for f in STATUS_FIELDS {
        if !s[f].is_null() {
            m.insert(f.into(), s[f].clone());
        }
    }
    for f in ENGINE_FIELDS {
        if !s["engine"][f].is_null() {
            m.insert(f.into(), s["engine"][f].clone());
        }
    }
    serde_json::Value::Object(m)
}

/// The kernel's backlog drops so far, all CPUs (`/proc/net/softnet_stat`, hex, column 2).
fn softnet_dropped() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/net/softnet_stat").ok()?;
    text.lines().map(|l| l.split_whitespace().nth(1).and_then(|v| u64::from_str_radix(v, 16).ok())).sum()
}

fn refused(env: &ReplicaEnv) -> u64 {
    env.status(Side::Backup).map_or(0, |s| ["beats_stale", "beats_bad", "beats_foreign"].iter().map(|f| s[*f].as_u64().unwrap_or(0)).sum())
}

/// Injects `fault`; what it did, and the packets it touched (see [`Trial::fault_packets`]).
/// `frame`: the captured datagram of [`Fault::Replay`].
fn inject(env: &mut ReplicaEnv, fault: Fault, frame: Option<&[u8]>) -> Result<(String, u64), String> {
    let none = |_| (String::new(), 0);
    match fault {
        Fault::None => Ok((String::new(), 0)),
        Fault::PrimaryHostCrash => env.crash_host(Side::Primary).map(none).map_err(|e| format!("crashing the primary: {e}")),
        Fault::BackupHostCrash => env.crash_host(Side::Backup).map(none).map_err(|e| format!("crashing the backup: {e}")),
        Fault::RedisKill(s) | Fault::RedisStop(s) => {
            let sig = if matches!(fault, Fault::RedisKill(_)) { libc::SIGKILL } else { libc::SIGSTOP };
            if env.signal_redis(s, sig) {
                Ok((String::new(), 0))
            } else {
                Err(format!("the {}'s redis-server is not running", s.name()))
            }
        }
        Fault::DaemonRestart(s) => {
            let t = Instant::now();
            env.restart_daemon(s).map_err(|e| format!("restarting the {}'s daemon: {e}", s.name()))?;
            Ok((format!("the new daemon ready after {} ms", t.elapsed().as_millis()), 0))
        }
        Fault::Loss(s) => env.drop_input(s, LOSS).map(|n| (format!("{n} packets dropped toward the {}", s.name()), n)).map_err(|e| format!("loss toward the {}: {e}", s.name())),
        Fault::Replay => {
            let frame = frame.ok_or("no datagram captured")?;
            let before = refused(env);
            env.replay_frame(frame).map_err(|e| format!("replaying: {e}"))?;
            // The refusal is counted in the backup's status (written every few hundred ms).
            let end = Instant::now() + Duration::from_secs(3);
            while refused(env) == before && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(20)); // polling a status file with a deadline
            }
            let after = refused(env);
            let detail = if after > before { format!("the backup refused it (bad/stale/foreign +{})", after - before) } else { "the backup did not count it as refused within 3 s".into() };
            Ok((detail, after.saturating_sub(before)))
        }
    }
}

/// Runs the client for `o.secs` on `env` with `fault` at `at` (a fraction of the run) and checks
/// everything (see the module docs). Never panics on what it observes: a failure is in the
/// trial.
pub fn run_trial(env: &mut ReplicaEnv, fault: Fault, at: f64, o: &TrialOpts) -> Trial {
    let mut t = Trial::new(fault, at);
    let paws0 = env.client_paws_estab().ok();
    let softnet0 = softnet_dropped();
    let frame = if fault == Fault::Replay {
        match env.capture_side_datagram(Duration::from_secs(5)) {
            Ok(f) => Some(f),
            Err(e) => {
                t.error = Some(format!("capturing a side-channel datagram: {e}"));
                None
            }
        }
    } else {
        None
    };
    let args = Args { connect: SocketAddr::from((addr::SERVICE_V4, REDIS_PORT)), conns: o.conns, secs: o.secs, seed: o.seed, min_value: o.min_value, max_value: o.max_value, hang_ms: o.hang_ms, ..Args::default() };
    let client = match CheckClient::start(&env.lab.client, &env.opts.bin, args, Duration::from_secs(30)) {
        Ok(c) => c,
        Err(e) => {
            t.error = Some(format!("starting the client: {e}"));
            return t;
        }
    };
    let t0 = Instant::now();
    let fault_at = t0 + Duration::from_secs_f64(o.secs * at);
    if let Some(d) = fault_at.checked_duration_since(Instant::now()) {
        std::thread::sleep(d); // the fault's scheduled time, not a synchronisation
    }
    if t.error.is_none() {
        match inject(env, fault, frame.as_deref()) {
            Ok((d, n)) => {
                t.fault_detail = d;
                t.fault_packets = n;
            }
            Err(e) => t.error = Some(e),
        }
    }
    // The client's own bound: its run, one operation at the hang bound, and a margin.
    let deadline = t0 + Duration::from_secs_f64(o.secs) + Duration::from_millis(o.hang_ms) + Duration::from_secs(20);
    let report = client.finish(deadline);
    // A takeover the run caused may come after the client ended (see `TrialOpts::settle`).
    let settled = Instant::now() + o.settle;
    while env.state(Side::Backup).as_deref() != Some("took_over") && Instant::now() < settled {
        std::thread::sleep(Duration::from_millis(20)); // polling a status file with a deadline
    }
    t.takeover = env.state(Side::Backup).as_deref() == Some("took_over");
    t.false_failover = t.takeover && fault.primary_healthy();
    t.resets_seen_by_client = env.client_rsts();
    t.softnet_dropped = softnet0.zip(softnet_dropped()).map(|(a, b)| b.saturating_sub(a));
    t.paws_estab = match (paws0, env.client_paws_estab().ok()) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    t.status = [env.status(Side::Primary), env.status(Side::Backup)];
    t.daemons = serde_json::json!({"primary": compact(&t.status[0]), "backup": compact(&t.status[1])});
    t.yield_log = std::fs::read_to_string(env.log_path(Side::Primary)).unwrap_or_default().lines().filter(|l| l.contains("yield")).take(5).map(String::from).collect();
    t.fence_log = std::fs::read_to_string(env.log_path(Side::Backup)).unwrap_or_default().lines().filter(|l| l.contains("fenc")).take(5).map(String::from).collect();
    for side in [Side::Primary, Side::Backup] {
        let log = std::fs::read_to_string(env.log_path(side)).unwrap_or_default();
        t.slow_rounds.extend(log.lines().filter(|l| l.contains("a loop round took")).take(3).map(|l| format!("{}: {l}", side.name())));
    }
    match report {
        Ok(r) => {
            t.byte_exact = r.ok;
            t.hangs = r.hangs;
            t.stall_ms = r.stall_ms;
            t.max_op_ms = r.max_op_ms;
            t.ops = r.ops;
            t.bytes = r.bytes;
            t.client_retrans = r.conns.iter().map(|c| u64::from(c.retrans)).sum();
            t.client_failures = r.conns.iter().filter_map(|c| Some(format!("conn {} (port {}): {}: {}", c.conn, c.local_port, c.failure.as_deref()?, c.error.as_deref().unwrap_or("")))).collect();
            let side = if t.takeover { Side::Backup } else { Side::Primary };
            t.checked_on = side.name();
            let l = lost_writes(&env.lab.client, env.redis_host_addr(side), &r);
            t.lost_acknowledged_writes = l.lost;
            t.unreadable_keys = l.unreadable;
            t.lost_details = l.details;
            t.client = Some(r);
        }
        Err(e) => {
            t.hangs = u64::from(e.contains("deadline"));
            t.error.get_or_insert(e);
        }
    }
    t.ok = t.error.is_none() && t.byte_exact && t.resets_seen_by_client == 0 && t.hangs == 0 && !t.false_failover && t.lost_acknowledged_writes == 0 && t.unreadable_keys == 0;
    t
}

/// Options of `unbroken demo replica --chaos`.
#[derive(Debug, Clone)]
pub struct ChaosOpts {
    pub trials: usize,
    pub seed: u64,
    /// The faults drawn from (default: all of [`FAULTS`]).
    pub faults: Vec<Fault>,
    pub client: TrialOpts,
    /// The `unbroken` binary (daemons and client run as processes of it).
    pub bin: PathBuf,
    /// One line per trial on stderr.
    pub verbose: bool,
}

impl Default for ChaosOpts {
    fn default() -> Self {
        ChaosOpts { trials: 10, seed: 1, faults: FAULTS.to_vec(), client: TrialOpts::default(), bin: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("unbroken")), verbose: false }
    }
}

/// The summary (`--json` prints it, `trial_log` included).
#[derive(Debug, Clone, Serialize)]
pub struct ChaosReport {
    /// Every trial byte-exact, 0 RSTs, 0 hangs, 0 false failovers, 0 lost writes (and no
    /// unreadable key, no trial error).
    pub ok: bool,
    pub trials: usize,
    pub byte_exact: usize,
    pub resets_seen_by_client: u64,
    pub hangs: u64,
    pub false_failovers: usize,
    pub lost_acknowledged_writes: u64,
    /// Each trial's longest stall, over the trials.
    pub stall_ms: Percentiles,
    pub faults: BTreeMap<&'static str, usize>,
    pub seed: u64,
    /// Takeovers over all trials, and the PAWS discards at the client.
    pub takeovers: usize,
    pub paws_estab: u64,
    pub trial_log: Vec<Trial>,
}

/// The draws of trial `i`'s fault, time and client seed come from one generator seeded with
/// the run's seed, in order.
pub fn draw(rng: &mut Rng, faults: &[Fault]) -> (Fault, f64, u64) {
    let f = faults[rng.below(faults.len() as u64) as usize];
    // Between 20 % and 80 % of the trial.
    let at = 0.2 + rng.below(601) as f64 / 1000.0;
    (f, at, rng.next() % 1_000_000)
}

/// Runs the trials (root, network namespaces); an error only when the lab cannot run at all.
pub fn run_chaos(o: &ChaosOpts) -> Result<ChaosReport, String> {
    lab::lab_available().map_err(|e| format!("the lab is not available: {e}"))?;
    if let Some(m) = tools_missing() {
        return Err(m);
    }
    if o.faults.is_empty() {
        return Err("no fault to draw from".into());
    }
    let mut rng = Rng::new(o.seed);
    let mut log = Vec::new();
    let mut faults = BTreeMap::new();
    for i in 0..o.trials {
        let (fault, at, seed) = draw(&mut rng, &o.faults);
        *faults.entry(fault.name()).or_insert(0) += 1;
        let opts = RepOpts { bin: o.bin.clone(), daemon_defaults: true, ..RepOpts::default() };
        let trial = match ReplicaEnv::start(opts) {
            Ok(mut env) => run_trial(&mut env, fault, at, &TrialOpts { seed, ..o.client.clone() }),
            Err(e) => {
                let mut t = Trial::new(fault, at);
                t.error = Some(format!("starting the system: {e}"));
                t
            }
        };
        if o.verbose {
            eprintln!(
                "replica chaos trial {:>3}/{}: {:<22} at {:>4.1} %  {}  takeover {:<3}  stall {:>5} ms  PAWS {:>5}  RSTs {}  lost {}  {} ops{}{}",
                i + 1,
                o.trials,
                trial.fault,
                at * 100.0,
                if trial.ok { "ok  " } else { "FAIL" },
                if trial.takeover { "yes" } else { "no" },
                trial.stall_ms,
                trial.paws_estab.map_or("?".into(), |p| p.to_string()),
                trial.resets_seen_by_client,
                trial.lost_acknowledged_writes,
                trial.ops,
                if trial.fault_detail.is_empty() { String::new() } else { format!("  ({})", trial.fault_detail) },
                match (&trial.error, trial.client_failures.first()) {
                    (Some(e), _) => format!("  error: {}", e.lines().next().unwrap_or("")),
                    (None, Some(f)) => format!("  {f}"),
                    _ => String::new(),
                }
            );
            if trial.false_failover {
                eprintln!(
                    "    false failover: {}; loop gaps (max ms) primary {} backup {}; kernel backlog drops {}",
                    trial.fence_log.first().map_or("(no fencing line in the backup's log)", String::as_str),
                    trial.daemons["primary"]["tick_gap_max_ms"],
                    trial.daemons["backup"]["tick_gap_max_ms"],
                    trial.softnet_dropped.map_or("?".into(), |d| d.to_string()),
                );
                for l in &trial.slow_rounds {
                    eprintln!("    {l}");
                }
            }
        }
        log.push(trial);
    }
    let mut stalls: Vec<u64> = log.iter().map(|t| t.stall_ms).collect();
    stalls.sort_unstable();
    let byte_exact = log.iter().filter(|t| t.byte_exact).count();
    let resets: u64 = log.iter().map(|t| t.resets_seen_by_client).sum();
    let hangs: u64 = log.iter().map(|t| t.hangs).sum();
    let false_failovers = log.iter().filter(|t| t.false_failover).count();
    let lost: u64 = log.iter().map(|t| t.lost_acknowledged_writes).sum();
    Ok(ChaosReport {
        ok: log.iter().all(|t| t.ok) && byte_exact == o.trials && resets == 0 && hangs == 0 && false_failovers == 0 && lost == 0,
        trials: o.trials,
        byte_exact,
        resets_seen_by_client: resets,
        hangs,
        false_failovers,
        lost_acknowledged_writes: lost,
        stall_ms: Percentiles { p50: pct(&stalls, 0.5), p99: pct(&stalls, 0.99), max: stalls.last().copied().unwrap_or(0) },
        faults,
        seed: o.seed,
        takeovers: log.iter().filter(|t| t.takeover).count(),
        paws_estab: log.iter().filter_map(|t| t.paws_estab).sum(),
        trial_log: log,
    })
}

impl Trial {
    /// A trial of `fault` at `at` that saw nothing yet (not ok).
    fn new(fault: Fault, at: f64) -> Trial {
        Trial {
            fault: fault.name(),
            at,
            ok: false,
            byte_exact: false,
            resets_seen_by_client: 0,
            hangs: 0,
            takeover: false,
            false_failover: false,
            lost_acknowledged_writes: 0,
            unreadable_keys: 0,
            checked_on: "primary",
            stall_ms: 0,
            max_op_ms: 0,
            paws_estab: None,
            softnet_dropped: None,
            ops: 0,
            bytes: 0,
            client_retrans: 0,
            fault_detail: String::new(),
            fault_packets: 0,
            client_failures: Vec::new(),
            lost_details: Vec::new(),
            daemons: serde_json::Value::Null,
            yield_log: Vec::new(),
            fence_log: Vec::new(),
            slow_rounds: Vec::new(),
            error: None,
            client: None,
            status: [None, None],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trials_replay_from_the_seed() {
        let run = |seed| {
            let mut r = Rng::new(seed);
            (0..30).map(|_| draw(&mut r, &FAULTS)).map(|(f, at, s)| (f.name(), (at * 1000.0) as u64, s)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        let kinds: std::collections::HashSet<_> = run(7).into_iter().chain(run(9)).map(|x| x.0).collect();
        assert!(kinds.len() >= 8, "the faults are drawn from the whole list: {kinds:?}");
        assert!(run(7).iter().all(|&(_, at, _)| (200..=800).contains(&at)));
    }

    #[test]
    fn names_parse_back_and_say_whether_the_primary_is_healthy() {
        for f in FAULTS {
            assert_eq!(Fault::parse(f.name()), Some(f));
        }
        let unhealthy: Vec<_> = FAULTS.iter().filter(|f| !f.primary_healthy()).map(|f| f.name()).collect();
        assert_eq!(unhealthy, ["primary_host_crash", "redis_kill_primary", "redis_stop_primary", "daemon_restart_primary"]);
    }
}
