//! `unbroken guard` at run time: binds the queue, installs the steering rules, then runs the
//! packet loop, one command loop per listen address, and a status writer until SIGINT/SIGTERM.
//! SIGHUP is ignored (logged and counted, see [`crate::signals`]).

use crate::config::{Guard as Config, Placement};
use crate::guard::{fill_tcp_checksum, Action, Core};
use std::net::UdpSocket;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use unbroken_drivers::nfqueue::{Queue, QueueConfig, QueuedPacket, Verdict as QVerdict};
use unbroken_drivers::rawsend::RawSender;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Options of a run beyond the config file.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Remove the steering rules at exit even if connections still need renumbering (their
    /// packets will then bypass the guard; the peer drops them, or worse).
    pub force_remove_rules: bool,
}

/// Runs the guard until a signal arrives. Prints one `ready` line on stdout once traffic is
/// being steered.
pub fn run(cfg: Config, opts: RunOptions) -> Result<(), String> {
    let g = cfg.raw.guard.clone();
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    crate::signals::ignore_hangup("guard");
    let core = Arc::new(Mutex::new(Core::from_config(&cfg)));
    let started = Instant::now();
    let mono_ms = move || started.elapsed().as_millis() as u64;

    // The queue first, the rules second: rules without a bound consumer drop traffic.
    let qcfg = QueueConfig { queue_num: g.queue, ..QueueConfig::default() };
    let mut queue = Queue::open(&qcfg).map_err(|e| format!("guard: cannot bind NFQUEUE {}: {e}", g.queue))?;
    let raw = Arc::new(RawSender::new(g.injection_mark).map_err(|e| format!("guard: raw socket: {e} (root needed)"))?);
    let socks = g
        .control
        .iter()
        .map(|a| UdpSocket::bind(a).map_err(|e| format!("guard: side channel {a}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let chains: &[&str] = match g.placement {
        Placement::Gateway => &["FORWARD"],
        Placement::Local => &["OUTPUT", "INPUT"],
    };
    let rules = crate::steer::install(&cfg, chains).map_err(|e| format!("guard: installing rules: {e}"))?;

    let mut threads = Vec::new();
    for sock in socks {
        let core = core.clone();
        let raw = raw.clone();
        sock.set_read_timeout(Some(Duration::from_millis(200))).map_err(|e| e.to_string())?;
        threads.push(std::thread::spawn(move || command_loop(sock, core, raw, mono_ms)));
    }
    if let Some(path) = g.status_file.clone() {
        let core = core.clone();
        threads.push(std::thread::spawn(move || status_loop(path, core, started)));
    }
    println!("unbroken guard: ready queue={} placement={:?} services={} control={:?}", g.queue, g.placement, cfg.raw.services.len(), g.control);
    use std::io::Write;
    let _ = std::io::stdout().flush();

    let mut batch: Vec<QueuedPacket> = Vec::with_capacity(64);
    let mut last_expire = 0;
    let res = loop {
        if STOP.load(Ordering::SeqCst) {
            break Ok(());
        }
        match queue.recv_batch(&mut batch, 64, Some(Duration::from_millis(200))) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => break Err(format!("guard: queue receive: {e}")),
        }
        let now = mono_ms();
        let mut c = core.lock().unwrap();
        for p in batch.iter_mut() {
            let len = p.data.len();
            if p.truncated() {
                // Should not happen with a 64 KiB copy range; never forward a half-read packet
                // with a replacement, and never let a protected packet pass unrewritten.
                c.refuse(unbroken_wire::Error::Truncated, len);
                let _ = queue.set_verdict(p.id, QVerdict::Drop, None);
                continue;
            }
            p.data.resize(len + 64, 0);
            let (action, n) = c.packet_with(&mut p.data, len, now, p.csum_not_ready);
            let r = match action {
                Action::Accept { modified: false } => queue.set_verdict(p.id, QVerdict::Accept, None),
                Action::Accept { modified: true } => {
                    if p.csum_not_ready && fill_tcp_checksum(&mut p.data, n) {
                        c.counters.full_checksums += 1;
                    }
                    queue.set_verdict(p.id, QVerdict::Accept, Some(&p.data[..n]))
                }
                Action::Drop => queue.set_verdict(p.id, QVerdict::Drop, None),
                Action::Inject => {
                    let r = queue.set_verdict(p.id, QVerdict::Drop, None);
                    if let Err(e) = raw.send(&p.data[..n]) {
                        eprintln!("guard: inject failed: {e}");
                    }
                    r
                }
            };
            if let Err(e) = r {
                eprintln!("guard: verdict: {e}");
            }
        }
        if now.saturating_sub(last_expire) >= 1000 {
            c.expire(now);
            last_expire = now;
        }
        drop(c);
        if let Err(e) = queue.flush() {
            eprintln!("guard: verdict flush: {e}");
        }
    };
    STOP.store(true, Ordering::SeqCst);
    for t in threads {
        let _ = t.join();
    }
    let translated = core.lock().unwrap().any_translated();
    if translated && !opts.force_remove_rules {
        eprintln!("guard: leaving the steering rules in place: recovered connections need renumbering, and unrewritten packets must not reach their peers. Restart the guard to continue, or run with --remove-rules to remove them anyway.");
        std::mem::forget(rules);
    } else {
        drop(rules);
    }
    drop(queue);
    res
}

fn command_loop(sock: UdpSocket, core: Arc<Mutex<Core>>, raw: Arc<RawSender>, mono_ms: impl Fn() -> u64) {
    let mut buf = [0u8; 2048];
    let mut ack = [0u8; 128];
    while !STOP.load(Ordering::SeqCst) {
        let (n, src) = match sock.recv_from(&mut buf) {
            Ok(x) => x,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted) => continue,
            Err(e) => {
                eprintln!("guard: side channel receive: {e}");
                continue;
            }
        };
        let out = core.lock().unwrap().command(src, &buf[..n], wall_ms(), mono_ms(), &mut ack);
        if let Some(out) = out {
            if let Some(l) = out.ack_len {
                if let Err(e) = raw.send(&ack[..l]) {
                    eprintln!("guard: ACK inject failed: {e}");
                }
            }
            if let Err(e) = sock.send_to(&out.reply, src) {
                eprintln!("guard: reply to {src}: {e}");
            }
        }
    }
}

fn status_loop(path: PathBuf, core: Arc<Mutex<Core>>, started: Instant) {
    let tmp = path.with_extension("tmp");
    loop {
        let stop = STOP.load(Ordering::SeqCst);
        let (mut counters, conns) = {
            let c = core.lock().unwrap();
            (c.counters.clone(), c.connections())
        };
        counters.connections = conns as u64;
        let doc = serde_json::json!({
            "pid": std::process::id(),
            "uptime_ms": started.elapsed().as_millis() as u64,
            "stopped": stop,
            "sighup_ignored": crate::signals::hangups(),
            "counters": counters,
        });
        if std::fs::write(&tmp, doc.to_string()).and_then(|_| std::fs::rename(&tmp, &path)).is_err() {
            eprintln!("guard: cannot write status file {}", path.display());
        }
        if stop {
            return;
        }
        std::thread::sleep(Duration::from_millis(250)); // periodic status write, not a synchronisation
    }
}
