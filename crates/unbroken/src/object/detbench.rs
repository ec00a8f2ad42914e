//! `unbroken bench detector`: how long the LB's heartbeat gaps get on this machine, idle or
//! fully loaded, over a long run; the figures behind the detector's defaults.
//!
//! It starts the object-mode system of the demo ([`ObjectEnv`]: Redis, three nginx with their
//! agents, the LB) with a death threshold far above any gap it may see, so nothing fails over
//! and the run measures only. With `--load`, it also keeps both cores busy: two busy loops at
//! normal priority, plus unthrottled curl downloads through the LB and the agents' packet
//! loops (`--clients N`, default 4). Every `--every` seconds it reads the LB's status: per
//! server, the histogram of gaps between consecutive heartbeats (bins from
//! `detector::GAP_EDGES_MS`) and the longest gap. A gap of `g` ms would have been a false
//! failover for every `dead_after_ms <= g`: the report counts them per threshold.

use crate::object::demo::{make_object, EnvOpts, ObjectEnv};
use serde_json::{json, Value};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use unbroken_control::object::detector::GAP_EDGES_MS;

/// Thresholds (ms) the report counts false failovers for.
const THRESHOLDS: [u64; 10] = [20, 25, 30, 50, 75, 100, 150, 200, 300, 500];

#[derive(Debug, Clone)]
pub struct Opts {
    pub secs: u64,
    pub load: bool,
    pub clients: usize,
    pub every: u64,
    pub json: bool,
    pub save: Option<std::path::PathBuf>,
}

impl Opts {
    pub fn parse(args: &[String]) -> Result<Opts, String> {
        let mut o = Opts { secs: 60, load: false, clients: 4, every: 60, json: false, save: None };
        let mut it = args.iter().skip(1);
        while let Some(a) = it.next() {
            let mut num = |f: &str| -> Result<u64, String> {
                it.next().ok_or(format!("{f} needs a value"))?.parse().map_err(|_| format!("{f}: not a number"))
            };
            match a.as_str() {
                "--secs" => o.secs = num("--secs")?,
                "--clients" => o.clients = num("--clients")? as usize,
                "--every" => o.every = num("--every")?.max(1),
                "--load" => o.load = true,
                "--json" => o.json = true,
                "--save" => o.save = Some(it.next().ok_or("--save needs a FILE")?.into()),
                x => return Err(format!("bench detector: unknown argument {x:?}")),
            }
        }
        if o.secs == 0 {
            return Err("--secs must be at least 1".into());
        }
        Ok(o)
    }
}

struct Hogs(Vec<Child>);

impl Drop for Hogs {
    fn drop(&mut self) {
        for c in self.0.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs the measurement; the JSON report.
pub fn run(o: &Opts) -> Result<Value, String> {
    unbroken_lab::lab::lab_available()?;
    // Nothing may fail over during the run: a threshold far above any gap (the lease follows).
    let env = ObjectEnv::start(EnvOpts { dead_after_ms: 30_000, ..EnvOpts::default() }).map_err(|e| format!("lab: {e}"))?;
    let mut hogs = Hogs(Vec::new());
    if o.load {
        make_object(&env.docroot.join("load.bin"), 64 << 20, 7).map_err(|e| e.to_string())?;
        for _ in 0..2 {
            let c = Command::new("sh").args(["-c", "while :; do :; done"]).stdin(Stdio::null()).spawn().map_err(|e| e.to_string())?;
            hogs.0.push(c);
        }
        let url = env.url(false, "/load.bin");
        for _ in 0..o.clients {
            // A download loop, bounded by the run (the hogs' Drop kills it).
            let script = format!("end=$(( $(date +%s) + {} )); while [ $(date +%s) -lt $end ]; do curl -s -o /dev/null --max-time 120 {url}; done", o.secs + 5);
            let c = env.client_cmd(Command::new("sh").args(["-c", &script])).map_err(|e| e.to_string())?;
            hogs.0.push(c);
        }
    }
    let start = Instant::now();
    let mut samples = Vec::new();
    let end = start + Duration::from_secs(o.secs);
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        // Periodic sampling of a long measurement, not a synchronisation.
        std::thread::sleep(left.min(Duration::from_secs(o.every)));
        let s = env.lb_status().map_err(|e| format!("LB status: {e}"))?;
        let t = start.elapsed().as_secs();
        let max: Vec<u64> = s["servers"].as_array().map(|v| v.iter().map(|x| x["max_gap_ms"].as_u64().unwrap_or(0)).collect()).unwrap_or_default();
        let loadavg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        let skipped = env.agent_sum("heartbeats_skipped_wedged");
        eprintln!("[bench detector] {t:>5} s  max gap per server {max:?} ms  beats skipped (wedged loop) {skipped}  loadavg {}", loadavg.split_whitespace().take(3).collect::<Vec<_>>().join(" "));
        samples.push(json!({ "t_s": t, "max_gap_ms": max, "loadavg": loadavg.trim() }));
    }
    let s = env.lb_status().map_err(|e| format!("LB status: {e}"))?;
    let servers = s["servers"].as_array().cloned().unwrap_or_default();
    let mut hist = vec![0u64; GAP_EDGES_MS.len()];
    let mut max_gap = 0;
    let mut beats = 0;
    for x in &servers {
        for (k, c) in x["gap_histogram"].as_array().into_iter().flatten().enumerate() {
            if k < hist.len() {
                hist[k] += c.as_u64().unwrap_or(0);
            }
        }
        max_gap = max_gap.max(x["max_gap_ms"].as_u64().unwrap_or(0));
        beats += x["heartbeats"].as_u64().unwrap_or(0);
    }
    // Gaps at or above a threshold, from the histogram: exact when the threshold is a bin edge.
    let over = |th: u64| -> u64 { GAP_EDGES_MS.iter().zip(&hist).filter(|(e, _)| **e >= th).map(|(_, c)| c).sum() };
    let false_failovers: serde_json::Map<String, Value> = THRESHOLDS.iter().map(|&th| (th.to_string(), json!(over(th)))).collect();
    let downs = s["events"].as_array().map_or(0, |e| e.iter().filter(|x| x["kind"] == "down").count());
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|c| c.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string()));
    Ok(json!({
        "ok": downs == 0,
        "secs": o.secs,
        "load": o.load,
        "clients": if o.load { o.clients } else { 0 },
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu": cpu,
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
        "heartbeat_interval_ms": 5,
        "heartbeats": beats,
        "monitor_realtime": s["monitor_realtime"],
        "max_gap_ms": max_gap,
        "gap_edges_ms": GAP_EDGES_MS,
        "gap_histogram": hist,
        "false_failovers_at_dead_after_ms": false_failovers,
        "downs_during_run": downs,
        "agent_beats_skipped_wedged": env.agent_sum("heartbeats_skipped_wedged"),
        "samples": samples,
    }))
}

/// `unbroken bench detector ...`; the exit code.
pub fn main(args: Vec<String>) -> i32 {
    let o = match Opts::parse(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("unbroken: {e}");
            return 2;
        }
    };
    match run(&o) {
        Ok(v) => {
            if let Some(f) = &o.save {
                if let Err(e) = std::fs::write(f, format!("{v}\n")) {
                    eprintln!("unbroken: bench detector: --save {}: {e}", f.display());
                }
            }
            if o.json {
                println!("{v}");
            } else {
                println!("heartbeats {} over {} s ({}), max gap {} ms", v["heartbeats"], v["secs"], if o.load { "fully loaded" } else { "idle" }, v["max_gap_ms"]);
                println!("false failovers by dead_after_ms: {}", v["false_failovers_at_dead_after_ms"]);
                println!("gap histogram (edges {:?} ms): {}", GAP_EDGES_MS, v["gap_histogram"]);
            }
            if v["ok"].as_bool() == Some(true) {
                0
            } else {
                1
            }
        }
        Err(e) => {
            eprintln!("unbroken: bench detector: {e}");
            1
        }
    }
}
