//! `unbroken lb --config FILE [--status-file PATH] [--cleanup]`: object mode's load balancer
//! and liveness monitor ([`unbroken_control::object::lb`]) as a command.
//!
//! Prints `ready ...` once the table is installed (`adopted=true` when it took over the table
//! a previous `unbroken lb` left), then one line per liveness event
//! (`down server=2 t_ms=... detect_ms=... buckets_moved=85 epoch=2`), until SIGINT or SIGTERM.
//! SIGHUP is ignored (one log line). The status JSON ([`unbroken_control::object::lb::LbStatus`]) is
//! written atomically (temporary file plus rename) on every change and every 500 ms.
//!
//! On SIGINT or SIGTERM the nft table stays in the kernel: traffic keeps flowing to the
//! current owners, and the next `unbroken lb` adopts it, so a restart or an upgrade is no
//! outage (nothing watches liveness in between). `--cleanup` removes the config's table and
//! exits, for when the balancer is taken away for good. Exit codes: 0 after a signal (or a
//! cleanup), 1 when the balancer cannot start or stop cleanly (or the cleanup fails), 2 for
//! usage and config errors.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use unbroken_control::daemon::{self, StatusFile};
use unbroken_control::object::lb::{EventKind, Lb, LbConfig, LbEvent, LbStatus};

/// How often the status file is rewritten without a change.
const STATUS_PERIOD: Duration = Duration::from_millis(500);
/// Longest wait between checks of the stop flag.
const TICK: Duration = Duration::from_millis(50);

const USAGE: &str = "usage: unbroken lb --config FILE [--status-file PATH] [--cleanup]";

fn usage(msg: &str) -> i32 {
    eprintln!("unbroken lb: {msg}\n{USAGE}");
    2
}

/// Write `s` as JSON to its status file atomically (temporary file in the same directory +
/// rename; the daemons' one writer, [`StatusFile`], which says a failure once and its end).
pub fn write_status(file: &mut StatusFile, s: &LbStatus) -> std::io::Result<()> {
    let text = serde_json::to_vec_pretty(s).map_err(std::io::Error::other)?;
    file.write(&text)
}

/// Creates the status file's directory and checks that a file can be written there: a wrong
/// `--status-file` is one clear error at start.
pub fn prepare_status_file(path: &Path) -> Result<(), String> {
    unbroken_control::status::prepare(path, "--status-file")
}

/// One line for an event.
pub fn event_line(e: &LbEvent) -> String {
    let kind = match e.kind {
        EventKind::Down => "down",
        EventKind::Up => "up",
    };
    let detect = e
        .detect_ms
        .map(|d| d.to_string())
        .unwrap_or_else(|| "-".into());
    format!(
        "{kind} server={} t_ms={} detect_ms={detect} buckets_moved={} epoch={}",
        e.server, e.t_ms, e.buckets_moved, e.epoch
    )
}

/// Runs the subcommand; returns the exit code.
pub fn main(args: Vec<String>) -> i32 {
    let mut config: Option<PathBuf> = None;
    let mut status_file: Option<PathBuf> = None;
    let mut remove = false;
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--config" => match it.next() {
                Some(v) => config = Some(v.into()),
                None => return usage("--config needs a FILE"),
            },
            "--status-file" => match it.next() {
                Some(v) => status_file = Some(v.into()),
                None => return usage("--status-file needs a PATH"),
            },
            "--cleanup" => remove = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return 0;
            }
            o => return usage(&format!("unknown argument {o:?}")),
        }
    }
    let Some(config) = config else {
        return usage("--config FILE is required");
    };
    let cfg = match LbConfig::load(&config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("unbroken lb: {e}");
            return 2;
        }
    };
    if remove {
        return match unbroken_control::object::lb::cleanup(&cfg.table) {
            Ok(true) => {
                println!("removed table {}", cfg.table);
                0
            }
            Ok(false) => {
                println!("no table {}", cfg.table);
                0
            }
            Err(e) => {
                eprintln!("unbroken lb: removing table {}: {e}", cfg.table);
                1
            }
        };
    }
    if let Some(p) = &status_file {
        if let Err(e) = prepare_status_file(p) {
            eprintln!("unbroken lb: {e}");
            return 2;
        }
    }
    daemon::install_signals("unbroken lb", false);
    let table = cfg.table.clone();
    let mut lb = match Lb::start(cfg) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("unbroken lb: cannot start: {e}");
            return 1;
        }
    };
    let s = lb.status();
    println!(
        "ready table={table} buckets={} servers={} heartbeats={} epoch={} monitor_realtime={} adopted={}",
        s.buckets,
        s.servers.len(),
        lb.heartbeat_addr(),
        s.epoch,
        s.monitor_realtime,
        s.adopted
    );
    let mut printed = 0u64;
    let mut gen = 0u64;
    let mut last_write: Option<Instant> = None;
    let mut status_file = status_file.map(|p| StatusFile::new("unbroken lb", p));
    while !daemon::stopping() {
        let g = lb.wait_change(gen, TICK);
        let changed = g != gen;
        gen = g;
        let due = last_write.is_none_or(|t| t.elapsed() >= STATUS_PERIOD);
        if !changed && !due {
            continue;
        }
        let s = lb.status();
        let from = printed;
        for e in s.events.iter().filter(|e| e.n > from) {
            println!("{}", event_line(e));
            printed = e.n;
        }
        if let Some(f) = &mut status_file {
            // A failure is said once (and its end), by the writer.
            let _ = write_status(f, &s);
        }
        last_write = Some(Instant::now());
    }
    let s = lb.status();
    for e in s.events.iter().filter(|e| e.n > printed) {
        println!("{}", event_line(e));
    }
    let r = lb.stop();
    if let Some(f) = &mut status_file {
        let _ = write_status(f, &lb.status());
    }
    match r {
        Ok(()) => {
            println!("stopped: table {table} left in the kernel (traffic keeps flowing to the current owners; the next unbroken lb adopts it, unbroken lb --cleanup removes it)");
            0
        }
        Err(e) => {
            eprintln!("unbroken lb: stopping: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_lines_and_atomic_status() {
        let e = LbEvent {
            n: 1,
            t_ms: 12,
            server: 2,
            kind: EventKind::Down,
            buckets_moved: 85,
            detect_ms: Some(25),
            epoch: 2,
            applied_ms: None,
        };
        assert_eq!(
            event_line(&e),
            "down server=2 t_ms=12 detect_ms=25 buckets_moved=85 epoch=2"
        );
        let dir = std::env::temp_dir().join(format!("ub-lbcmd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("lb.json");
        let s = LbStatus {
            table: "t".into(),
            buckets: 1,
            epoch: 1,
            applied_epoch: 1,
            uptime_ms: 0,
            monitor_realtime: false,
            programmer_realtime: false,
            lease_ms: 90,
            gap_edges_ms: vec![0, 5],
            servers: Vec::new(),
            owners: vec![1],
            owner_changed_ms_ago: vec![None],
            events: vec![e],
            counters: Default::default(),
            last_nft_error: None,
            adopted: false,
        };
        let mut f = StatusFile::new("test", p.clone());
        write_status(&mut f, &s).unwrap();
        write_status(&mut f, &s).unwrap();
        let back: LbStatus = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        assert_eq!(back.events, s.events);
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "temporary file left: {names:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[cfg(test)]
mod hostile {
    use super::*;

    #[test]
    fn hostile_lb_status_directory_missing_is_created_or_refused_once() {
        let dir = std::env::temp_dir().join(format!("ub-lbcmd-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let p = dir.join("not/yet/lb.json");
        prepare_status_file(&p).unwrap();
        assert!(p.parent().unwrap().is_dir());
        assert!(!p.exists(), "only the directory, no file yet");
        std::fs::write(dir.join("f"), b"x").unwrap();
        let e = prepare_status_file(&dir.join("f/lb.json")).unwrap_err();
        assert!(e.starts_with("--status-file") && e.contains("cannot create its directory"), "{e}");
        // The command says it once and exits 2 (before touching the network).
        let cfg = dir.join("lb.toml");
        std::fs::write(&cfg, include_str!("../../../../configs/lb.example.toml")).unwrap();
        let code = main(vec!["--config".into(), cfg.display().to_string(), "--status-file".into(), dir.join("f/lb.json").display().to_string()]);
        assert_eq!(code, 2);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
