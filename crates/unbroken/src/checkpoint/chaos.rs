//! `unbroken demo checkpoint --chaos N`: N trials on the checkpoint demo's topology, each a fresh
//! lab with one fault drawn at random (seeded) and injected at a random point of the transfer:
//! an application kill, a host crash, a guard kill, guard and application together, SIGHUP to
//! the guard, the application killed again during its recovery, or the guard killed during the
//! application's recovery. A trial's stream is paced or bulk (drawn too). Every trial checks what the peer saw (byte-exact, exit status, RSTs,
//! no hang, stall); the summary is `ok` only when every trial passed all of them.

use crate::checkpoint::scenario::{run_checkpoint, Crash, Scenario};
use crate::common::{pct, Percentiles};
use std::collections::BTreeMap;
use std::time::Duration;

/// The faults a trial draws from, with their names in the summary.
pub const FAULTS: [(Crash, &str); 7] = [
    (Crash::App, "app_kill"),
    (Crash::Host, "host_crash"),
    (Crash::Guard, "guard_kill"),
    (Crash::GuardAndApp, "guard_and_app_kill"),
    (Crash::GuardHangup, "guard_sighup"),
    (Crash::AppDuringRecovery, "app_kill_during_recovery"),
    (Crash::GuardDuringRecovery, "guard_kill_during_recovery"),
];

#[derive(Debug, Clone)]
pub struct ChaosOpts {
    pub trials: usize,
    pub seed: u64,
    /// Records each peer streams per trial, at `rate` per second; `None`: each trial draws a
    /// paced stream (30 000 records at 20 000/s) or a bulk one (1 000 000 records, as fast as the
    /// path allows: the peer's window full, the most bytes in flight at the fault).
    pub records: Option<u64>,
    pub rate: Option<u64>,
    pub connections: usize,
    /// Deadline of one trial (a trial that misses it counts as a hang).
    pub trial_timeout: Duration,
    /// One line per trial on stderr.
    pub verbose: bool,
}

impl Default for ChaosOpts {
    fn default() -> Self {
        ChaosOpts { trials: 10, seed: 1, records: None, rate: None, connections: 1, trial_timeout: Duration::from_secs(180), verbose: false }
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Trial {
    pub fault: &'static str,
    /// Where the fault was injected, as a fraction of the reply bytes.
    pub at: f64,
    /// Records per second (0: bulk).
    pub rate: u64,
    pub ok: bool,
    pub byte_exact: bool,
    pub resets_seen_by_client: u64,
    pub hang: bool,
    pub stall_ms: u64,
    pub error: Option<String>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct ChaosReport {
    pub ok: bool,
    pub trials: usize,
    /// Trials whose every connection received exactly the expected bytes (sha256) and exited 0.
    pub byte_exact: usize,
    pub resets_seen_by_client: u64,
    pub hangs: usize,
    /// Longest reply gap of each trial (the fault's stall), over the trials.
    pub stall_ms: Percentiles,
    pub faults: BTreeMap<&'static str, usize>,
    pub seed: u64,
    pub trial_log: Vec<Trial>,
}

/// splitmix64: a small seeded generator (the trials must replay from the printed seed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Runs the trials (root, network namespaces). A trial whose lab cannot be built is an error of
/// the whole run, not a failed trial.
pub fn run_chaos(o: &ChaosOpts) -> Result<ChaosReport, String> {
    let mut rng = Rng(o.seed);
    let mut log = Vec::new();
    let mut faults = BTreeMap::new();
    for i in 0..o.trials {
        let (kind, name) = FAULTS[rng.below(FAULTS.len() as u64) as usize];
        // Between 20 % and 80 % of the transfer.
        let at = 0.2 + rng.below(601) as f64 / 1000.0;
        let bulk = rng.below(2) == 1;
        let rate = o.rate.unwrap_or(if bulk { 0 } else { 20_000 });
        let records = o.records.unwrap_or(if rate == 0 { 1_000_000 } else { 30_000 });
        let s = Scenario {
            records,
            rate,
            crashes: vec![kind],
            crash_at: Some(vec![at]),
            seed: rng.next() % 1_000_000,
            timeout: o.trial_timeout,
            connections: o.connections,
            ..Scenario::default()
        };
        *faults.entry(name).or_insert(0) += 1;
        let t = match run_checkpoint(&s) {
            Ok(r) => {
                let hang = r.error.as_deref().is_some_and(|e| e.contains("no reply for") || e.contains("never closed"));
                let byte_exact = r.sha256_ok && r.peer_exit_code == Some(0);
                Trial { fault: name, at, rate, ok: r.ok && byte_exact, byte_exact, resets_seen_by_client: r.resets_seen_by_peer, hang, stall_ms: r.max_stall_ms, error: r.error }
            }
            Err(e) if e.starts_with("lab") || e.contains("needs root") => return Err(e),
            Err(e) => {
                let hang = e.contains("timed out");
                Trial { fault: name, at, rate, ok: false, byte_exact: false, resets_seen_by_client: 0, hang, stall_ms: 0, error: Some(e) }
            }
        };
        if o.verbose {
            eprintln!(
                "chaos trial {:>3}/{}: {:<27} at {:>4.1} % {}  {}  stall {:>4} ms  RSTs {}{}",
                i + 1,
                o.trials,
                name,
                at * 100.0,
                if rate == 0 { "bulk " } else { "paced" },
                if t.ok { "ok  " } else { "FAIL" },
                t.stall_ms,
                t.resets_seen_by_client,
                t.error.as_deref().map(|e| format!("  ({e})")).unwrap_or_default()
            );
        }
        log.push(t);
    }
    let mut stalls: Vec<u64> = log.iter().map(|t| t.stall_ms).collect();
    stalls.sort_unstable();
    let byte_exact = log.iter().filter(|t| t.byte_exact).count();
    let resets: u64 = log.iter().map(|t| t.resets_seen_by_client).sum();
    let hangs = log.iter().filter(|t| t.hang).count();
    Ok(ChaosReport {
        ok: log.iter().all(|t| t.ok) && byte_exact == o.trials && resets == 0 && hangs == 0,
        trials: o.trials,
        byte_exact,
        resets_seen_by_client: resets,
        hangs,
        stall_ms: Percentiles { p50: pct(&stalls, 0.5), p99: pct(&stalls, 0.99), max: stalls.last().copied().unwrap_or(0) },
        faults,
        seed: o.seed,
        trial_log: log,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trials_replay_from_the_seed() {
        let draw = |seed| {
            let mut r = Rng(seed);
            (0..20).map(|_| r.below(FAULTS.len() as u64)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        let all = draw(7).into_iter().chain(draw(9)).collect::<std::collections::HashSet<_>>();
        assert!(all.len() >= 5, "the faults are drawn from the whole list: {all:?}");
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!((pct(&v, 0.5), pct(&v, 0.99), pct(&[], 0.5), pct(&[5], 0.99)), (50, 99, 0, 5));
    }
}
