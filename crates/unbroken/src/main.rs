//! `unbroken`: TCP connections that outlive the server that serves them.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use unbroken::checkpoint::scenario::{self, Crash, Scenario};

const USAGE: &str = "\
unbroken: TCP connections that outlive the server that serves them

usage:
  unbroken demo [checkpoint] [--json] [--records N] [--rate N] [--crashes LIST] [--connections N] [--ipv6] [--echo] [--same-hosts] [--local-guard] [--nudge]
  unbroken demo checkpoint --chaos N [--seed S] [--json] [--records N] [--rate N] [--connections N]
        Run the checkpoint-mode demo in network namespaces (root): an unmodified peer streams to
        the example journal server while it is SIGKILLed and restarted, once on another host.
        LIST is comma-separated from app,host,guard,guard+app,guard-hup,app-in-recovery (the app
        killed again while it recovers), guard-in-recovery (the guard killed while the app
        recovers) (default app,app,host,app). --chaos N runs N trials instead, each on a fresh lab
        with one fault drawn at random (seeded; the seed is printed) from app kill, host crash,
        guard kill, guard+app kill, SIGHUP to the guard, app killed again during its recovery,
        guard killed during the app's recovery; --json prints ok, trials, byte_exact,
        resets_seen_by_client, hangs, stall_ms {p50,p99,max}, faults {kind: count}, seed.
        Exit status 1 unless every trial is byte-exact with 0 resets and no hang.
  unbroken guard --config FILE [--remove-rules]
        Run the checkpoint guard (RTCP) with the given TOML config.
  unbroken status --file STATUS.json [--json]
        Print a guard's, an agent's or a replica daemon's status file (agent: protected
        connections, failovers, failover times, refusals, store state; replica: state, peer,
        fencing, takeover time, unprotected connections; --json prints the file as it is).
  unbroken bench checkpoint [--json] [--quick] [--runs N] [--secs S] [--cycles N] [--save FILE]
        Benchmark checkpoint mode against unprotected TCP in the lab (root): the paper's
        TCP_STREAM, TCP_MAERTS, TCP_RR, recovery cycle and engine microbenchmark
        (docs/benchmarks.md lists every option).
  unbroken bench object [--json] [--quick] [--runs N] [--secs S] [--requests N] [--trials N] [--size MIB] [--skip rps,latency,stall] [--save FILE]
        Benchmark object mode against unprotected nginx in the lab (root, needs wrk): requests/s
        for 1 B and 16 KiB pages, first-byte latency, the stall after a server death.
  unbroken bench replica [--json] [--quick] [--runs N] [--exchanges N] [--bulk-mb LIST] [--intervals LIST] [--trials N] [--skip workloads,failover] [--save FILE]
        Benchmark replica mode in the lab (root): ST-TCP's echo (150 B x100), request/reply
        (150 B, 10 KB reply, x100) and bulk (1, 5, 20, 100 MB) workloads unreplicated against
        replicated with and without strict output commit (every byte checked), and the failover
        time (backup's takeover_ms, client stall) for heartbeats of 50, 10 and 2 ms.
  unbroken bench detector [--secs S] [--load] [--clients N] [--every S] [--json] [--save FILE]
        Measure the gaps between heartbeats at the LB on the object-mode lab (root), idle or
        with both cores loaded (busy loops plus curl downloads through the agents): how many
        false failovers each dead_after_ms would have caused.
  unbroken journal-server --listen A:P --guard A:P --key-file PATH --dir DIR [--fsync]
        The example recoverable application.
  unbroken peer --connect A:P --records N [--seed S] [--rate R]
        The demo's unmodified peer (plain sockets): streams records, verifies replies.
  unbroken demo object [--json] [--size MIB] [--client curl|wget] [--ipv6] [--crashes N] [--rate BYTES_PER_S] [--no-probe] [--revive]
        Run the object-mode demo in network namespaces (root): curl (or wget) downloads a 1 GiB
        file from unmodified nginx through the nftables LB; the serving server loses power twice
        mid-transfer; the download must finish byte-exact with 0 resets.
  unbroken demo object --chaos N [--seed S] [--faults LIST] [--size MIB] [--rate BYTES_PER_S] [--parts N] [--json]
        N trials: curl, wget and a python keep-alive Range client download concurrently (64 MiB
        at 8 MiB/s each by default) while 1-3 seeded random faults hit (server death, revive,
        false suspicion, store blip, agent restart). Reports byte-exact transfers, RSTs, hangs,
        stalls (p50/p99/max, per client), false failovers, two senders on one connection and
        the faults; exits 1 unless every transfer is byte-exact with 0 RSTs, 0 hangs and 0
        two-sender connections. The seed is printed; --seed replays the same fault draws.
        LIST: comma-separated among crash,revive,false_suspicion,store_blip,agent_restart
        (default all). --parts: Range GETs of the keep-alive client per download (default 4).
  unbroken demo replica [--json] [--incrs N] [--crash-at FRACTION] [--heartbeat-ms N] [--missed-beats N] [--no-strict] [--conns K]
        Run the replica-mode demo in network namespaces (root, needs redis-server, redis-tools and
        python3-redis): unmodified redis-server on a primary and a backup host, each behind
        `unbroken replica`; a redis-py client holding one connection does 100,000 INCRs on its own
        key while redis-cli, redis-benchmark and our verifying client (--conns K, default 4,
        connections of INCR and SET/GET of 1 KiB-1 MiB values) run beside it, and the primary host
        dies (processes killed, link cut) at 40 % of the INCRs. The final values must be exact, no client may see
        an error or a reconnect, 0 RSTs; --json prints ok, failovers, ops, errors_seen,
        resets_seen_by_client, max_stall_ms (and takeover_ms, values, large_values: the verifying
        client's ops, stall and lost acknowledged writes). Exit status 1 unless ok.
  unbroken demo replica --chaos N [--seed S] [--secs S] [--conns K] [--faults LIST] [--json]
        N trials, each on a fresh lab with the daemons' default beats and bounds: K (8)
        connections of a verifying client (INCR single and pipelined, SET/GET of 1 KiB-1 MiB
        values, every reply checked byte for byte, never reconnecting) for S (20) seconds, and
        one seeded fault between 20 % and 80 % of the run, among none, primary_host_crash,
        backup_host_crash, redis_kill_primary/_backup, redis_stop_primary/_backup (SIGSTOP, never
        continued), daemon_restart_primary/_backup (SIGKILL and start again),
        loss_toward_primary/_backup (200 ms), replayed_datagram (a captured side-channel datagram
        sent to the backup again). --json prints ok, trials, byte_exact, resets_seen_by_client,
        hangs, false_failovers, lost_acknowledged_writes, stall_ms {p50,p99,max}, faults, seed,
        takeovers, paws_estab and trial_log (per trial: takeover, paws_estab, the daemons'
        counters). Exit status 1 unless every trial is byte-exact with 0 RSTs, 0 hangs, 0 false
        failovers and 0 lost acknowledged writes.
  unbroken agent --config FILE [--remove-rules]
        Run object mode's server agent (TRODS-KV) beside the local HTTP server;
        configs/agent.example.toml shows every key. A stopped agent leaves its queue
        rules in place (the service's packets are dropped until an agent runs again);
        --remove-rules removes them (the service is then served unprotected).
  unbroken lb --config FILE [--status-file PATH] [--cleanup]
        Run object mode's load balancer and liveness monitor (nftables, root) until
        SIGINT/SIGTERM; configs/lb.example.toml shows every key. The table stays in the
        kernel on exit (traffic keeps flowing; the next run adopts it); --cleanup removes it.
        SIGHUP is ignored by lb, agent and guard (no reload).
  unbroken replica --config FILE [--role primary|backup] [--remove-rules]
        Run replica mode (ST-TCP / Koch et al.) on the primary or the backup host of an
        unmodified deterministic server; configs/replica.example.toml shows every key. --role,
        when given, must agree with the file. A stopped daemon leaves its queue rules (and a
        backup its ARP suppression and receive rule) in place; --remove-rules removes them.
        Refuses to start when the fence command is missing or not executable; state and
        counters: unbroken status --file <status_file>.
  unbroken lab cleanup
        Remove network namespaces left behind by crashed runs.
";

fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("unbroken: {msg}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() {
        eprint!("{USAGE}");
        return ExitCode::from(2);
    }
    let sub = args.remove(0);
    match sub.as_str() {
        "demo" => demo(args),
        "guard" => guard(args),
        "status" => status(args),
        "bench" => bench(args),
        "bench-app" => ExitCode::from(unbroken::checkpoint::bench::app_main(args) as u8),
        "bench-peer" => ExitCode::from(unbroken::checkpoint::bench::peer_main(args) as u8),
        "bench-replica-server" => ExitCode::from(unbroken::replica::bench::server_main(args) as u8),
        "bench-replica-client" => ExitCode::from(unbroken::replica::bench::client_main(args) as u8),
        "replica-check-client" => ExitCode::from(unbroken::replica::client::client_main(args) as u8),
        "bench-passthrough" => ExitCode::from(unbroken::checkpoint::bench::passthrough_main(args) as u8),
        "peer" => peer(args),
        "journal-server" => ExitCode::from(unbroken_journal::server::main_with_args(args.into_iter()) as u8),
        "lab" => lab(args),
        "lb" => ExitCode::from(unbroken::object::lbcmd::main(args) as u8),
        "agent" => agent(args),
        "replica" => replica(args),
        "-h" | "--help" | "help" => {
            print!("{USAGE}");
            ExitCode::SUCCESS
        }
        other => fail(format!("unknown command {other:?}\n\n{USAGE}")),
    }
}

/// `demo checkpoint --chaos N`: N trials, one random fault each (see `unbroken::checkpoint::chaos`).
fn demo_chaos(s: &Scenario, trials: usize, seed_given: bool, records_given: bool, rate_given: bool, json: bool) -> ExitCode {
    use unbroken::checkpoint::chaos::{run_chaos, ChaosOpts};
    let seed = if seed_given { s.seed } else { std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64 % 1_000_000_000).unwrap_or(1) };
    let o = ChaosOpts { trials, seed, records: records_given.then_some(s.records), rate: rate_given.then_some(s.rate), connections: s.connections, verbose: true, ..ChaosOpts::default() };
    let stream = match (o.records, o.rate) {
        (None, None) => "paced or bulk streams (drawn)".to_string(),
        (n, r) => format!("{} records at {}", n.map_or("default".into(), |n| n.to_string()), r.map_or("a drawn rate".into(), |r| if r == 0 { "full speed".into() } else { format!("{r}/s") })),
    };
    eprintln!("unbroken demo checkpoint --chaos {trials}: seed {seed} (replay with --seed {seed}), {stream}, {} connection(s)", o.connections);
    match run_chaos(&o) {
        Ok(r) => {
            if json {
                let mut v = serde_json::to_value(&r).unwrap_or_default();
                if let Some(m) = v.as_object_mut() {
                    m.remove("trial_log");
                }
                println!("{v}");
            } else {
                println!("\nchaos report (seed {})", r.seed);
                println!("  ok                      {}", r.ok);
                println!("  trials                  {} (byte-exact {}, hangs {})", r.trials, r.byte_exact, r.hangs);
                println!("  RSTs seen by the client {}", r.resets_seen_by_client);
                println!("  stall ms                p50 {} p99 {} max {}", r.stall_ms.p50, r.stall_ms.p99, r.stall_ms.max);
                println!("  faults                  {:?}", r.faults);
            }
            if r.ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => fail(e),
    }
}

fn parse_crashes(s: &str) -> Result<Vec<Crash>, String> {
    if s.trim().is_empty() {
        return Ok(Vec::new());
    }
    s.split(',')
        .map(|c| match c.trim() {
            "app" => Ok(Crash::App),
            "host" => Ok(Crash::Host),
            "guard" => Ok(Crash::Guard),
            "guard+app" | "both" => Ok(Crash::GuardAndApp),
            "guard-hup" => Ok(Crash::GuardHangup),
            "app-in-recovery" => Ok(Crash::AppDuringRecovery),
            "guard-in-recovery" => Ok(Crash::GuardDuringRecovery),
            o => Err(format!("unknown crash kind {o:?} (app, host, guard, guard+app, guard-hup, app-in-recovery, guard-in-recovery)")),
        })
        .collect()
}

fn num<T: std::str::FromStr>(flag: &str, v: Option<String>) -> Result<T, String> {
    let v = v.ok_or(format!("{flag} needs a value"))?;
    v.parse().map_err(|_| format!("{flag}: not a number: {v:?}"))
}

fn agent(args: Vec<String>) -> ExitCode {
    let mut it = args.into_iter();
    let mut config = None;
    let mut remove_rules = false;
    while let Some(a) = it.next() {
        match a.as_str() {
            "--config" => config = it.next(),
            "--remove-rules" => remove_rules = true,
            o => return fail(format!("agent: unknown argument {o:?}")),
        }
    }
    let Some(path) = config else { return fail("agent: --config FILE is required") };
    let cfg = match unbroken_control::object::agent::Agent::load(std::path::Path::new(&path)) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    if remove_rules {
        return match unbroken_control::object::agent::remove_rules(&cfg) {
            Ok(()) => {
                println!("unbroken agent: queue rules removed (the service is served unprotected)");
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        };
    }
    match unbroken_control::object::agent::run(cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("unbroken: {e}");
            ExitCode::from(1)
        }
    }
}

fn demo_object(args: Vec<String>) -> ExitCode {
    let mut s = unbroken::object::demo::ObjectScenario { live: true, ..Default::default() };
    let mut json = false;
    let mut chaos: Option<usize> = None;
    let mut seed: Option<u64> = None;
    let mut size_set = false;
    let mut kinds: Option<Vec<String>> = None;
    let mut parts: Option<u64> = None;
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let r: Result<(), String> = (|| {
            match a.as_str() {
                "--json" => json = true,
                "--size" => {
                    s.size = num::<u64>("--size", it.next())? << 20;
                    size_set = true;
                }
                "--chaos" => chaos = Some(num("--chaos", it.next())?),
                "--seed" => seed = Some(num("--seed", it.next())?),
                "--parts" => parts = Some(num("--parts", it.next())?),
                "--faults" => kinds = Some(it.next().ok_or("--faults needs a list")?.split(',').map(|k| k.trim().to_string()).collect()),
                "--client" => s.client = it.next().ok_or("--client needs curl or wget")?,
                "--ipv6" => s.ipv6 = true,
                "--rate" => s.rate = num("--rate", it.next())?,
                "--no-probe" => s.probe = false,
                "--revive" => s.revive = true,
                "--crashes" => {
                    let n: usize = num("--crashes", it.next())?;
                    s.crash_at = (1..=n).map(|k| k as f64 / (n + 1) as f64).collect();
                }
                "--timeout" => s.timeout = Duration::from_secs(num("--timeout", it.next())?),
                o => return Err(format!("demo object: unknown argument {o:?}")),
            }
            Ok(())
        })();
        if let Err(e) = r {
            return fail(e);
        }
    }
    if let Some(n) = chaos {
        return demo_object_chaos(n, seed, if size_set { Some(s.size) } else { None }, s.rate, kinds, parts, json);
    }
    if json {
        s.live = false;
    } else {
        eprintln!("unbroken demo object: {} downloads {} MiB through the LB; {} server deaths", s.client, s.size >> 20, s.crash_at.len());
    }
    match unbroken::object::demo::run_object(&s) {
        Ok(r) => {
            if json {
                println!("{}", serde_json::to_value(&r).unwrap_or_default());
            } else {
                println!("\nreport");
                println!("  ok                      {}", r.ok);
                if let Some(e) = &r.error {
                    println!("  error                   {e}");
                }
                for c in &r.crashes {
                    println!("  {:>7} ms  server {} lost power at {} MiB (LB detected after {:?} ms)", c.t_ms, c.server, c.at_bytes >> 20, c.detect_ms);
                }
                println!("  failovers               {} (refused {})", r.failovers, r.refused);
                if r.lb_false_deaths > 0 {
                    println!("  LB false deaths         {} (live servers declared dead)", r.lb_false_deaths);
                }
                println!("  bytes                   {} of {}", r.bytes, r.expected_bytes);
                println!("  sha256                  {}", if r.sha256_ok { "matches" } else { "MISMATCH" });
                println!("  client exit status      {:?}", r.client_exit);
                println!("  RSTs seen by the client {}", r.resets_seen_by_client);
                println!("  longest stall           {} ms", r.max_stall_ms);
                println!("  duration                {} ms", r.duration_ms);
            }
            if r.ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => fail(e),
    }
}

fn demo_replica(args: Vec<String>) -> ExitCode {
    let mut s = unbroken::replica::demo::ReplicaScenario { live: true, ..Default::default() };
    let mut json = false;
    let mut chaos = unbroken::replica::chaos::ChaosOpts { verbose: true, ..Default::default() };
    let (mut trials, mut seed): (Option<usize>, Option<u64>) = (None, None);
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let r: Result<(), String> = (|| {
            match a.as_str() {
                "--json" => json = true,
                "--chaos" => trials = Some(num("--chaos", it.next())?),
                "--seed" => seed = Some(num("--seed", it.next())?),
                "--secs" => chaos.client.secs = num("--secs", it.next())?,
                "--conns" => {
                    chaos.client.conns = num("--conns", it.next())?;
                    s.large_conns = chaos.client.conns;
                }
                "--faults" => {
                    let list = it.next().ok_or("--faults needs a list")?;
                    chaos.faults = list
                        .split(',')
                        .map(|k| unbroken::replica::chaos::Fault::parse(k.trim()).ok_or_else(|| format!("--faults: unknown fault {k:?} ({})", unbroken::replica::chaos::FAULTS.map(|f| f.name()).join(", "))))
                        .collect::<Result<_, _>>()?;
                }
                "--incrs" => s.incrs = num("--incrs", it.next())?,
                "--crash-at" => s.crash_at = num("--crash-at", it.next())?,
                "--heartbeat-ms" => s.heartbeat_interval_ms = num("--heartbeat-ms", it.next())?,
                "--missed-beats" => s.missed_beats = num("--missed-beats", it.next())?,
                "--no-strict" => s.strict = false,
                "--timeout" => s.timeout = Duration::from_secs(num("--timeout", it.next())?),
                o => return Err(format!("demo replica: unknown argument {o:?}")),
            }
            Ok(())
        })();
        if let Err(e) = r {
            return fail(e);
        }
    }
    if let Some(n) = trials {
        chaos.trials = n;
        chaos.seed = seed.unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64 % 1_000_000_000).unwrap_or(1));
        return demo_replica_chaos(&chaos, json);
    }
    if json {
        s.live = false;
    } else {
        eprintln!("unbroken demo replica: redis-server on a primary and a backup host; redis-py ({} INCRs on one connection), redis-cli and redis-benchmark run while the primary host dies", s.incrs);
    }
    match unbroken::replica::demo::run_replica(&s) {
        Ok(r) => {
            if json {
                let mut v = serde_json::to_value(&r).unwrap_or_default();
                if let Some(m) = v.as_object_mut() {
                    m.remove("clients");
                }
                println!("{v}");
            } else {
                println!("\nreport");
                println!("  ok                      {}", r.ok);
                if let Some(e) = &r.error {
                    println!("  error                   {e}");
                }
                println!("  primary host died after {} redis-py INCRs", r.crash_at_ops);
                println!("  failovers               {} (takeover {} after the primary's last beat)", r.failovers, r.takeover_ms.map_or("not reported".into(), |t| format!("{t} ms")));
                for (k, want, got) in &r.values {
                    println!("  {k:<23} {} (exact: {want})", got.map_or("unreadable".into(), |g| g.to_string()));
                }
                println!("  operations              {}", r.ops);
                if let Some(l) = &r.large_values {
                    println!("  large values            {} ({} connections, {} ops, {} MB, longest stall {} ms, lost acknowledged writes {}{})", if l.ok && l.lost_acknowledged_writes == 0 { "ok" } else { "FAILED" }, l.conns, l.ops, l.bytes / 1_000_000, l.stall_ms, l.lost_acknowledged_writes, l.failures.first().or(l.error.as_ref()).map(|f| format!("; {f}")).unwrap_or_default());
                }
                println!("  client runs with errors {} (of {})", r.errors_seen, r.clients.len());
                println!("  RSTs seen by the client {}", r.resets_seen_by_client);
                println!("  longest stall           {} ms", r.max_stall_ms);
                println!("  duration                {} ms", r.duration_ms);
            }
            if r.ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            if json {
                println!("{}", serde_json::json!({"ok": false, "error": e}));
            }
            fail(e)
        }
    }
}

/// `demo replica --chaos N`: N trials, one random fault each (see `unbroken::replica::chaos`).
fn demo_replica_chaos(o: &unbroken::replica::chaos::ChaosOpts, json: bool) -> ExitCode {
    eprintln!(
        "unbroken demo replica --chaos {}: seed {} (replay with --seed {}); {} connections of INCR and 1 KiB-1 MiB SET/GET for {} s a trial, faults among {}",
        o.trials,
        o.seed,
        o.seed,
        o.client.conns,
        o.client.secs,
        o.faults.iter().map(|f| f.name()).collect::<Vec<_>>().join(", ")
    );
    match unbroken::replica::chaos::run_chaos(o) {
        Ok(r) => {
            if json {
                println!("{}", serde_json::to_value(&r).unwrap_or_default());
            } else {
                println!("\nreplica chaos report (seed {})", r.seed);
                println!("  ok                       {}", r.ok);
                println!("  trials                   {} (byte-exact {}, hangs {})", r.trials, r.byte_exact, r.hangs);
                println!("  RSTs seen by the client  {}", r.resets_seen_by_client);
                println!("  takeovers                {} (false failovers {})", r.takeovers, r.false_failovers);
                println!("  lost acknowledged writes {}", r.lost_acknowledged_writes);
                println!("  stall ms                 p50 {} p99 {} max {}", r.stall_ms.p50, r.stall_ms.p99, r.stall_ms.max);
                println!("  PAWS discards (client)   {}", r.paws_estab);
                println!("  faults                   {:?}", r.faults);
            }
            if r.ok {
                ExitCode::SUCCESS
            } else {
                eprintln!("unbroken demo replica --chaos: NOT ok (seed {})", r.seed);
                ExitCode::from(1)
            }
        }
        Err(e) => {
            if json {
                println!("{}", serde_json::json!({"ok": false, "seed": o.seed, "error": e}));
            }
            fail(e)
        }
    }
}

fn demo_object_chaos(trials: usize, seed: Option<u64>, size: Option<u64>, rate: u64, kinds: Option<Vec<String>>, parts: Option<u64>, json: bool) -> ExitCode {
    let seed = seed.unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64 % 1_000_000_000).unwrap_or(1));
    let mut o = unbroken::object::chaos::ChaosOpts { trials, seed, live: !json, ..Default::default() };
    if let Some(s) = size {
        o.size = s;
    }
    if rate > 0 {
        o.rate = rate;
    }
    if let Some(k) = kinds {
        o.kinds = k;
    }
    if let Some(p) = parts {
        o.parts = p.max(1);
    }
    eprintln!("unbroken demo object --chaos {trials}: seed {seed} (replay with --seed {seed}); curl, wget and a python keep-alive client download {} MiB each at {} KiB/s", o.size >> 20, o.rate >> 10);
    match unbroken::object::chaos::run_chaos(&o) {
        Ok(v) => {
            if json {
                println!("{v}");
            } else {
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            }
            if v["ok"] == true {
                ExitCode::SUCCESS
            } else {
                eprintln!("unbroken demo object --chaos: NOT ok (seed {seed})");
                ExitCode::from(1)
            }
        }
        Err(e) => {
            if json {
                println!("{}", serde_json::json!({"ok": false, "seed": seed, "error": e}));
            }
            fail(e)
        }
    }
}

fn demo(args: Vec<String>) -> ExitCode {
    if args.first().map(String::as_str) == Some("object") {
        return demo_object(args[1..].to_vec());
    }
    if args.first().map(String::as_str) == Some("replica") {
        return demo_replica(args[1..].to_vec());
    }
    let mut s = Scenario { rate: 20_000, live: true, ..Scenario::default() };
    let mut json = false;
    let mut chaos: Option<usize> = None;
    let (mut seed_given, mut records_given, mut rate_given) = (false, false, false);
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let r: Result<(), String> = (|| {
            match a.as_str() {
                "checkpoint" => {}
                "--json" => json = true,
                "--records" => {
                    s.records = num("--records", it.next())?;
                    records_given = true;
                }
                "--rate" => {
                    s.rate = num("--rate", it.next())?;
                    rate_given = true;
                }
                "--crashes" => s.crashes = parse_crashes(&it.next().ok_or("--crashes needs a value")?)?,
                "--ipv6" => s.ipv6 = true,
                "--echo" => s.echo = true,
                "--same-hosts" => s.heterogeneous = false,
                "--local-guard" => s.local_guard = true,
                "--seed" => {
                    s.seed = num("--seed", it.next())?;
                    seed_given = true;
                }
                "--chaos" => chaos = Some(num("--chaos", it.next())?),
                "--connections" => s.connections = num("--connections", it.next())?,
                "--nudge" => s.nudge = true,
                "--timeout" => s.timeout = Duration::from_secs(num("--timeout", it.next())?),
                o => return Err(format!("demo: unknown argument {o:?}")),
            }
            Ok(())
        })();
        if let Err(e) = r {
            return fail(e);
        }
    }
    if let Some(trials) = chaos {
        return demo_chaos(&s, trials, seed_given, records_given, rate_given, json);
    }
    if !json {
        eprintln!("unbroken demo checkpoint: {} records through the guard, crashes: {:?}", s.records, s.crashes);
    }
    match scenario::run_checkpoint(&s) {
        Ok(r) => {
            if json {
                let mut v = serde_json::to_value(&r).unwrap_or_default();
                if let Some(o) = v.as_object_mut() {
                    o.remove("peer");
                }
                println!("{v}");
            } else {
                println!("\nreport");
                println!("  ok                    {}", r.ok);
                if let Some(e) = &r.error {
                    println!("  error                 {e}");
                }
                println!("  crashes               {}", r.crashes);
                for c in &r.crash_log {
                    println!("    {:>7} ms  {:<12} at {:>10} bytes verified, app now on {}", c.t_ms, format!("{:?}", c.kind), c.at_bytes_verified, c.app_host);
                }
                println!("  bytes sent by peer    {}", r.bytes_sent);
                println!("  reply bytes verified  {} (sha256 {})", r.bytes_verified, if r.sha256_ok { "matches" } else { "MISMATCH" });
                println!("  RSTs seen by the peer {}", r.resets_seen_by_peer);
                println!("  longest stall         {} ms", r.max_stall_ms);
                println!("  duration              {} ms", r.duration_ms);
                let c = &r.guard["counters"];
                if !c.is_null() {
                    println!("  guard                 recovered {} (+{} from the peer's ACK), spurious FIN->RST {}, RST dropped {}, commands {}", c["recovered"], c["recovered_from_peer_ack"], c["spurious_fin_reset"], c["rst_dropped"], c["commands_answered"]);
                }
            }
            if r.ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            if json {
                println!("{}", serde_json::json!({"ok": false, "error": e}));
            }
            fail(e)
        }
    }
}

fn guard(args: Vec<String>) -> ExitCode {
    let mut cfg: Option<PathBuf> = None;
    let mut opts = unbroken_control::checkpoint::runtime::RunOptions::default();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--config" => cfg = it.next().map(PathBuf::from),
            "--remove-rules" => opts.force_remove_rules = true,
            o => return fail(format!("guard: unknown argument {o:?}")),
        }
    }
    let Some(path) = cfg else { return fail("guard: --config FILE is required") };
    let cfg = match unbroken_control::checkpoint::config::Guard::load(&path) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    match unbroken_control::checkpoint::runtime::run(cfg, opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

fn replica(args: Vec<String>) -> ExitCode {
    let mut it = args.into_iter();
    let (mut config, mut role, mut remove_rules) = (None, None, false);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--config" => config = it.next(),
            "--role" => role = it.next(),
            "--remove-rules" => remove_rules = true,
            "-h" | "--help" => {
                // The replica part of the usage, from its line to the next command's.
                let from = USAGE.find("  unbroken replica ").unwrap_or(0);
                let to = USAGE[from + 2..].find("\n  unbroken ").map_or(USAGE.len(), |i| from + 2 + i + 1);
                print!("{}", &USAGE[from..to]);
                return ExitCode::SUCCESS;
            }
            o => return fail(format!("replica: unknown argument {o:?}")),
        }
    }
    let Some(path) = config else { return fail("replica: --config FILE is required") };
    let cfg = match unbroken_control::replica::daemon::Replica::load(std::path::Path::new(&path)) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    if let Some(r) = role {
        let file = cfg.role_name();
        if r != "primary" && r != "backup" {
            return fail(format!("replica: --role {r:?}: primary or backup"));
        }
        if r != file {
            return fail(format!("replica: --role {r} but {path} says role = \"{file}\""));
        }
    }
    if remove_rules {
        return match unbroken_control::replica::daemon::remove_rules(&cfg) {
            Ok(()) => {
                println!("unbroken replica: queue rules (and a backup's ARP suppression) removed");
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        };
    }
    match unbroken_control::replica::daemon::run(cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("unbroken: {e}");
            ExitCode::from(1)
        }
    }
}

fn status(args: Vec<String>) -> ExitCode {
    let mut it = args.into_iter();
    let mut file = None;
    let mut json = false;
    while let Some(a) = it.next() {
        match a.as_str() {
            "--file" => file = it.next(),
            "--json" => json = true,
            o => return fail(format!("status: unknown argument {o:?}")),
        }
    }
    let Some(f) = file else { return fail("status: --file STATUS.json is required") };
    match std::fs::read_to_string(&f).map_err(|e| e.to_string()).and_then(|t| serde_json::from_str::<serde_json::Value>(&t).map_err(|e| e.to_string())) {
        Ok(v) if !json && v.get("agent").is_some() && v.get("engine").is_some() => {
            let (a, e) = (&v["agent"], &v["engine"]);
            let n = |x: &serde_json::Value| x.as_u64().unwrap_or(0);
            println!("unbroken agent (pid {}, up {} s{})", v["pid"], n(&v["uptime_ms"]) / 1000, if v["stopped"] == true { ", stopped" } else { "" });
            println!("  connections            {} ({} protected)", n(&v["connections"]), n(&v["protected"]));
            println!("  unprotected so far     {} (store {}, http {}, no SYN seen {})", n(&e["unprotected"]), n(&e["unprotected_store"]), n(&e["unprotected_http"]), n(&e["unprotected_no_syn"]));
            println!("    of which http:       credentials {}, no strong validator {}", n(&e["unprotected_credentials"]), n(&e["unprotected_no_validator"]));
            println!("  records refused        {} failovers (bad MAC {}, version 1 {}, expired {}, invalid {})", n(&a["refused_bad_record"]), n(&a["records_bad_mac"]), n(&a["records_unversioned"]), n(&a["records_expired"]), n(&a["records_invalid"]));
            println!("  records stored         {} ok, {} failed; held packets {}", n(&e["stores_ok"]), n(&e["stores_failed"]), n(&e["held"]));
            println!("  failovers              {} done, {} started, {} refused, {} denied by the LB gate", n(&a["failovers"]), n(&a["failovers_started"]), n(&a["refused"]), n(&a["failovers_denied"]));
            println!("  failover time          last {} us, max {} us (client packet to rebuilt socket)", n(&a["failover_us_last"]), n(&a["failover_us_max"]));
            println!("  resumed bytes          {} (mismatches {} of which object changed {}, refused requests {}, errors {})", n(&a["resumed_bytes"]), n(&a["resume_mismatch"]), n(&a["resume_object_changed"]), n(&a["resume_refused"]), n(&a["resume_errors"]));
            println!("  probes sent            {}", n(&a["probes_sent"]));
            println!("  store                  {}{}", v["store"].as_str().unwrap_or("?"), if v["store_down"] == true { " DOWN" } else { "" });
            if let Some(d) = v["lb_heartbeats"]["detail"].as_str() {
                println!("  LB heartbeats          {} ({})", v["lb_heartbeats"]["state"].as_str().unwrap_or("?"), d);
            }
            if let Some(r) = a["recent_refusals"].as_array().filter(|r| !r.is_empty()) {
                println!("  recent refusals");
                for x in r {
                    println!("    {}", x.as_str().unwrap_or(""));
                }
            }
            ExitCode::SUCCESS
        }
        Ok(v) if !json && v.get("role").is_some() && v.get("state").is_some() => {
            let n = |x: &serde_json::Value| x.as_u64().unwrap_or(0);
            let e = &v["engine"];
            println!("unbroken replica, {} (pid {}, up {} s{})", v["role"].as_str().unwrap_or("?"), v["pid"], n(&v["uptime_ms"]) / 1000, if v["stopped"] == true { ", stopped" } else { "" });
            println!("  state                  {}", v["state"].as_str().unwrap_or("?"));
            let age = v["peer_last_beat_age_ms"].as_u64().map_or("never".to_string(), |a| format!("{a} ms ago"));
            println!("  peer                   last heard {age}; beats sent {}, received {}, refused: bad {} stale {} foreign {}", n(&v["beats_sent"]), n(&v["beats_received"]), n(&v["beats_bad"]), n(&v["beats_stale"]), n(&v["beats_foreign"]));
            println!("  fencing                {} run, {} failed{}", n(&v["fences_run"]), n(&v["fences_failed"]), v["takeover_ms"].as_u64().map_or(String::new(), |t| format!("; took over {t} ms after the primary's last message")));
            println!("  connections            {} followed; {} became unprotected ({} diverged) {}", n(&v["connections"]), n(&v["unprotected"]), n(&v["diverged"]), v["unprotected_by"]);
            if v["role"] == "primary" {
                println!("  output                 {} held, {} released, {} bytes held now; {} ACKs lowered, {} fresh ACKs", n(&e["held"]), n(&e["released"]), n(&v["held_bytes"]), n(&e["acks_lowered"]), n(&e["fresh_acks"]));
                println!("  passed unprotected     {} packets (no backup yet or any more)", n(&v["passed_unprotected"]));
            } else {
                println!("  followed               {} aligned, {} output packets withheld, {} client ACKs relayed, {} diverged connections reset", n(&e["aligned"]), n(&e["withheld"]), n(&e["acks_relayed"]), n(&e["diverged_reset"]));
            }
            ExitCode::SUCCESS
        }
        Ok(v) => {
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Err(e) => fail(format!("status: {f}: {e}")),
    }
}

fn bench(args: Vec<String>) -> ExitCode {
    use unbroken::checkpoint::bench;
    if args.first().map(String::as_str) == Some("object") {
        return ExitCode::from(unbroken::object::bench::main(args) as u8);
    }
    if args.first().map(String::as_str) == Some("replica") {
        return ExitCode::from(unbroken::replica::bench::main(args) as u8);
    }
    if args.first().map(String::as_str) == Some("detector") {
        return ExitCode::from(unbroken::object::detbench::main(args) as u8);
    }
    if args.first().map(String::as_str) != Some("checkpoint") {
        return fail("bench: usage: unbroken bench checkpoint [--json] [--quick] [--runs N] [--secs S] [--cycles N] [--read BYTES] [--sweep|--no-sweep] [--no-micro] [--micro-only] [--micro-iters N] [--no-passthrough] [--no-cpu-qos] [--tests LIST] [--retries N] [--save FILE]");
    }
    let o = match bench::Opts::parse(&args) {
        Ok(o) => o,
        Err(e) => return fail(e),
    };
    match bench::run_checkpoint(&o) {
        Ok(v) => {
            if let Some(f) = &o.save {
                if let Err(e) = std::fs::write(f, format!("{v}\n")) {
                    eprintln!("unbroken: bench: --save {}: {e}", f.display());
                }
            }
            if o.json {
                println!("{v}");
            } else {
                bench::print_table(&v);
            }
            if v["ok"].as_bool() == Some(true) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            if o.json {
                println!("{}", serde_json::json!({"ok": false, "error": e}));
            }
            fail(e)
        }
    }
}

fn peer(args: Vec<String>) -> ExitCode {
    let mut a = unbroken::checkpoint::peer::PeerArgs {
        connect: "127.0.0.1:7000".parse().unwrap(),
        records: 1000,
        seed: 1,
        rate: 0,
        idle_timeout: Duration::from_secs(60),
        progress_every: Duration::from_millis(100),
        echo: false,
    };
    let mut it = args.into_iter();
    while let Some(x) = it.next() {
        let r: Result<(), String> = (|| {
            match x.as_str() {
                "--connect" => a.connect = it.next().ok_or("--connect needs ADDR:PORT")?.parse().map_err(|e| format!("--connect: {e}"))?,
                "--records" => a.records = num("--records", it.next())?,
                "--seed" => a.seed = num("--seed", it.next())?,
                "--rate" => a.rate = num("--rate", it.next())?,
                "--idle-timeout" => a.idle_timeout = Duration::from_secs(num("--idle-timeout", it.next())?),
                "--echo" => a.echo = true,
                o => return Err(format!("peer: unknown argument {o:?}")),
            }
            Ok(())
        })();
        if let Err(e) = r {
            return fail(e);
        }
    }
    let res = unbroken::checkpoint::peer::run(&a, &mut |v| println!("{v}"));
    println!("{}", serde_json::to_string(&res).unwrap_or_default());
    if res.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn lab(args: Vec<String>) -> ExitCode {
    match args.first().map(String::as_str) {
        Some("cleanup") => match unbroken_lab::lab::cleanup_orphans() {
            Ok(n) => {
                println!("removed {n} leftover namespace(s)");
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
        _ => fail("lab: usage: unbroken lab cleanup"),
    }
}
