//! `unbroken guard` at run time: binds the queue, installs the steering rules, then runs the
//! packet loop ([`crate::daemon::run`] around [`Core`], the guard's mode), one command loop per
//! listen address, and the status writer ([`crate::daemon::spawn_status`]) until SIGINT/SIGTERM.
//! SIGHUP is ignored (logged and counted, see [`crate::signals`]).

use crate::checkpoint::config::{Guard as Config, Placement};
use crate::checkpoint::guard::{Core, FastDone, FastMap, FastOp, FastState, FastTaken, ReplayFloor};
use std::net::UdpSocket;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use unbroken_drivers::nfqueue::{Queue, QueueConfig};
use unbroken_drivers::rawsend::RawSender;

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
    crate::daemon::install_signals("guard", false);
    let mut c = Core::from_config(&cfg);
    // The previous instance's replay high-water marks (issue 21, item 5), before any command.
    let replay = match cfg.replay_file() {
        Some(path) => {
            let (store, floors) = ReplayStore::open(path)?;
            c.restore_replay_floors(floors);
            Some(Arc::new(Mutex::new(store)))
        }
        None => {
            eprintln!("guard: no replay_file (nor status_file): a command captured before a restart can be replayed once to the next guard within max_clock_skew_ms");
            None
        }
    };
    // The fast path (issue 22) before the rules: its programs claim nothing until the core
    // installs a connection, and the rules then carry the RETURN for what they claimed.
    let fast_on = match fast_path(&cfg) {
        Ok(map) => {
            eprintln!("guard: fast path on: established packets of protected connections stay in the kernel (tc-BPF on {})", map.ifaces.join(", "));
            c.enable_fast_path(Box::new(map));
            true
        }
        Err(why) => {
            eprintln!("guard: fast path off: {why}; every protected packet goes through NFQUEUE {}", g.queue);
            c.fast_off_reason = Some(why);
            false
        }
    };
    let core = Arc::new(Mutex::new(c));
    let started = Instant::now();
    let mono_ms = move || started.elapsed().as_millis() as u64;

    let chains: &[&str] = match g.placement {
        Placement::Gateway => &["FORWARD"],
        Placement::Local => &["OUTPUT", "INPUT"],
    };
    // Another guard that still runs owns these rules: say which, before touching anything.
    let mut spec = crate::checkpoint::steer::spec(&cfg, chains);
    if fast_on {
        spec.fast_mark = Some(unbroken_drivers::fastpath::checkpoint::MARK_DONE);
    }
    unbroken_drivers::iptables::Rules::check_owner(&spec).map_err(|e| format!("guard: {e}"))?;
    crate::checkpoint::steer::check_app_interface(&cfg).map_err(|e| format!("guard: config: {e}"))?;
    // The queue first, the rules second: rules without a bound consumer drop traffic.
    let qcfg = QueueConfig { queue_num: g.queue, ..QueueConfig::default() };
    let mut queue = Queue::open(&qcfg).map_err(|e| format!("guard: cannot bind NFQUEUE {}: {e}", g.queue))?;
    let raw = Arc::new(RawSender::new(g.injection_mark).map_err(|e| format!("guard: raw socket: {e} (root needed)"))?);
    let socks = g
        .control
        .iter()
        .map(|a| UdpSocket::bind(a).map_err(|e| format!("guard: side channel {a}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let rules = unbroken_drivers::iptables::Rules::install_or_replace(&spec).map_err(|e| format!("guard: installing rules: {e}"))?;

    let mut threads = Vec::new();
    for sock in socks {
        let core = core.clone();
        let raw = raw.clone();
        let replay = replay.clone();
        sock.set_read_timeout(Some(Duration::from_millis(200))).map_err(|e| e.to_string())?;
        threads.push(std::thread::spawn(move || command_loop(sock, core, raw, replay, mono_ms)));
    }
    if let Some(path) = g.status_file.clone() {
        let plan = crate::daemon::StatusPlan { name: "guard", path: Some(path), period: Duration::from_millis(250), dirty: Default::default(), started };
        threads.push(crate::daemon::spawn_status(plan, status_fields(core.clone(), spec.clone())).map_err(|e| format!("guard: status thread: {e}"))?);
    }
    println!("unbroken guard: ready queue={} placement={:?} services={} control={:?}", g.queue, g.placement, cfg.raw.services.len(), g.control);
    use std::io::Write;
    let _ = std::io::stdout().flush();

    // The packet loop (crate::daemon): the core decides, the daemon does the verdict I/O.
    let res = crate::daemon::run(&mut crate::daemon::PacketIo::new("guard", &mut queue, Some(&raw)), &core, &mut crate::daemon::NoAdapter, mono_ms);
    crate::daemon::stop();
    for t in threads {
        let _ = t.join();
    }
    let translated = crate::sync::lock(&core, "guard: core").any_translated();
    if translated && !opts.force_remove_rules {
        eprintln!("guard: leaving the steering rules in place: recovered connections need renumbering, and unrewritten packets must not reach their peers. Restart the guard to continue, or run with --remove-rules to remove them anyway.");
        std::mem::forget(rules);
    } else {
        drop(rules);
    }
    drop(queue);
    res
}

/// The kernel's map behind the core's [`FastMap`] (see `crate::checkpoint::guard::fast`), with the
/// programs attached: `ckpt_outgoing` at the ingress of `guard.app_interface`, `ckpt_incoming`
/// at the ingress of every other interface (but loopback) present at start (a packet arriving on
/// one added later goes through the queue). Detached when dropped.
struct KernelMap {
    fp: unbroken_drivers::fastpath::checkpoint::Checkpoint,
    ifaces: Vec<String>,
}

/// Loads and attaches the fast path for `cfg`, or says why not.
fn fast_path(cfg: &Config) -> Result<KernelMap, String> {
    use unbroken_drivers::fastpath::checkpoint::{Checkpoint, Direction};
    let g = &cfg.raw.guard;
    if !g.fast_path {
        return Err("guard.fast_path = false".into());
    }
    let app_if = match (g.placement, &g.app_interface) {
        (Placement::Gateway, Some(i)) => i.clone(),
        _ => return Err("placement = \"local\" is not on the fast path yet (tc egress runs after netfilter's OUTPUT chain, where the queue rule decides)".into()),
    };
    mark_conflicts()?;
    if !unbroken_drivers::fastpath::is_ethernet(&app_if) {
        return Err(format!("guard.app_interface {app_if:?} is not an Ethernet device (the programs read an Ethernet header)"));
    }
    let mut fp = Checkpoint::load().map_err(|e| e.to_string())?;
    // Only Ethernet devices (the programs find the IP header after 14 bytes); a packet from the
    // peers arriving on another kind (a tunnel) goes through the queue.
    let mut others: Vec<String> = unbroken_drivers::fastpath::interfaces().map_err(|e| format!("listing the interfaces: {e}"))?.into_iter().filter(|n| n != "lo" && *n != app_if && unbroken_drivers::fastpath::is_ethernet(n)).collect();
    others.sort();
    fp.attach(Direction::Outgoing, &app_if).map_err(|e| e.to_string())?;
    let mut ifaces = vec![format!("{app_if} (from the applications)")];
    for i in &others {
        fp.attach(Direction::Incoming, i).map_err(|e| e.to_string())?;
        ifaces.push(format!("{i} (from the peers)"));
    }
    Ok(KernelMap { fp, ifaces })
}

/// The mark bits the programs set must reach FORWARD as they left them: a rule of the raw or
/// mangle table that sets or restores the packet mark over those bits (policy routing often
/// does, e.g. `CONNMARK --restore-mark` without a mask) would make a claimed packet be
/// rewritten a second time, or a declined one pass unrewritten. Such a rule turns the fast path
/// off, named. (nftables rules that set `meta mark` are not inspected: see docs.)
pub(crate) fn mark_conflicts() -> Result<(), String> {
    use unbroken_drivers::fastpath::checkpoint::{MARK_DONE, MARK_SLOW};
    let ours = MARK_DONE | MARK_SLOW;
    for bin in ["iptables-save", "ip6tables-save"] {
        for table in ["raw", "mangle"] {
            let Ok(out) = std::process::Command::new(bin).args(["-t", table]).env("LC_ALL", "C").output() else { continue };
            if !out.status.success() {
                continue;
            }
            let text = String::from_utf8_lossy(&out.stdout);
            if let Some(rule) = text.lines().find(|l| sets_mark_bits(l, ours)) {
                return Err(format!("{bin} -t {table} has a rule that sets the packet mark over bits {ours:#x}, which the fast path uses: {rule:?} (give it a mask without them)"));
            }
        }
    }
    Ok(())
}

/// Whether an `iptables-save` line sets or restores mark bits in `bits`.
fn sets_mark_bits(line: &str, bits: u32) -> bool {
    let w: Vec<&str> = line.split_whitespace().collect();
    let num = |s: &str| u32::from_str_radix(s.trim_start_matches("0x"), if s.starts_with("0x") { 16 } else { 10 }).ok();
    let after = |flag: &str| w.iter().position(|x| *x == flag).and_then(|i| w.get(i + 1)).copied();
    if w.windows(2).any(|p| p == ["-j", "MARK"]) {
        // iptables-save writes every MARK form as --set-xmark value/mask.
        // Unreadable: taken as a conflict.
        let mask = after("--set-xmark").and_then(|v| v.split_once('/')).and_then(|(_, m)| num(m));
        return mask.is_none_or(|m| m & bits != 0);
    }
    if w.windows(2).any(|p| p == ["-j", "CONNMARK"]) && w.contains(&"--restore-mark") {
        return after("--nfmask").and_then(num).is_none_or(|m| m & bits != 0);
    }
    false
}

fn fast_key(k: &crate::checkpoint::guard::FlowKey) -> unbroken_drivers::fastpath::checkpoint::Key {
    unbroken_drivers::fastpath::checkpoint::Key::new(k.app, k.peer)
}

impl FastMap for KernelMap {
    fn take(&mut self, key: &crate::checkpoint::guard::FlowKey, counted: bool) -> Option<FastTaken> {
        use unbroken_drivers::fastpath::checkpoint::{ctl, Op, OpResult};
        match self.fp.op(if counted { Op::Take } else { Op::Freeze }, &fast_key(key), None) {
            Ok(a) if a.result == OpResult::Done => Some(FastTaken { newest: a.ctl_before & ctl::USER == 0, state: FastState { conn: a.entry.conn(), a_hi: a.entry.a_hi(), peer_hi: a.entry.peer() } }),
            Ok(_) => None,
            Err(e) => {
                crate::ratelog::log("guard: fast path", || format!("guard: fast path: taking {key:?}: {e}"));
                None
            }
        }
    }

    fn apply(&mut self, op: &FastOp) -> FastDone {
        use unbroken_drivers::fastpath::checkpoint::{Entry, Op, OpResult};
        let entry = |s: &FastState| Entry::new(&s.conn, s.a_hi, s.peer_hi);
        let res = match op {
            FastOp::Install(k, s) => match self.fp.install(&fast_key(k), &entry(s)) {
                Ok(true) => Ok(FastDone::Kernel),
                // An entry the core did not know of (a failed take): neither copy is sure to
                // be the newest; the slow path carries the connection until it is installed again.
                Ok(false) => self.fp.remove(&fast_key(k)).map(|_| FastDone::Gone),
                Err(e) => Err(e),
            },
            FastOp::Thaw(k, s) | FastOp::ThawForce(k, s) => {
                let o = if matches!(op, FastOp::Thaw(..)) { Op::Thaw } else { Op::ThawForce };
                self.fp.op(o, &fast_key(k), Some(&entry(s))).map(|a| match a.result {
                    OpResult::Done => FastDone::Kernel,
                    OpResult::Stale | OpResult::Refused => FastDone::Held,
                    OpResult::NoEntry => FastDone::Gone,
                })
            }
            FastOp::Remove(k) => self.fp.remove(&fast_key(k)).map(|_| FastDone::Gone),
        };
        res.unwrap_or_else(|e| {
            crate::ratelog::log("guard: fast path", || format!("guard: fast path: {op:?}: {e}"));
            // A thaw that failed leaves the entry frozen: held. Anything else: the slow path.
            if matches!(op, FastOp::Thaw(..) | FastOp::ThawForce(..)) {
                FastDone::Held
            } else {
                FastDone::Gone
            }
        })
    }

    fn acknowledge(&mut self, key: &crate::checkpoint::guard::FlowKey, ack_a: u32) -> Option<FastState> {
        use unbroken_drivers::fastpath::checkpoint::{Entry, Op, OpResult};
        let mut req = Entry::default();
        req.state.ack_a = ack_a;
        match self.fp.op(Op::Acknowledge, &fast_key(key), Some(&req)) {
            Ok(a) if a.result == OpResult::Done => Some(FastState { conn: a.entry.conn(), a_hi: a.entry.a_hi(), peer_hi: a.entry.peer() }),
            Ok(_) => None,
            Err(e) => {
                crate::ratelog::log("guard: fast path", || format!("guard: fast path: acknowledging {key:?}: {e}"));
                None
            }
        }
    }

    fn stats(&mut self) -> Vec<(&'static str, u64)> {
        match self.fp.counters() {
            Ok(c) => vec![("kernel_outgoing", c.outgoing), ("kernel_incoming", c.incoming), ("kernel_slow", c.slow), ("kernel_dropped", c.dropped)],
            Err(_) => vec![],
        }
    }
}

/// The replay file (`guard.replay_file`): the side channel's high-water marks
/// ([`ReplayFloor`]), written whenever the core raised them, before the command that raised
/// them has any effect outside the guard; synced to disk at most every [`REPLAY_SYNC_MS`], so a
/// process restart loses nothing and a host crash at most that much.
///
/// Every accepted command raises a mark, so the write is on every command's path: it is one
/// `pwrite` into a file kept open (a few µs), not a new file and a rename (tens to hundreds of
/// µs on ext4, which made each ACKNOWLEDGE round trip several times slower). Two slots, the
/// file and the file + ".b", are written in turn, each a numbered, hashed record
/// (`seq N`, the marks, `end <FNV-1a 64>`; bytes after `end` are a longer earlier record's
/// leftovers): a write torn by a host crash leaves the other slot's record, one write older,
/// which the next guard reads. A file of the earlier format (the marks alone) is read as
/// record 0.
struct ReplayStore {
    path: std::path::PathBuf,
    slots: [std::fs::File; 2],
    seq: u64,
    unsynced_since: Option<Instant>,
}

/// How long the replay file may stay written but not synced to disk.
const REPLAY_SYNC_MS: u64 = 250;

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// One slot's record: its number and marks; `None` when it holds none (empty, torn, not ours).
fn read_slot(text: &str) -> Option<Result<(u64, Vec<ReplayFloor>), String>> {
    if text.starts_with("unbroken-guard-replay 1\n") && !text.contains("\nend ") {
        // The earlier format: the marks alone, written whole by a rename.
        return Some(crate::checkpoint::guard::decode_replay_floors(text).map(|f| (0, f)));
    }
    let (head, rest) = text.split_once('\n')?;
    let seq: u64 = head.strip_prefix("seq ")?.parse().ok()?;
    let at = rest.find("\nend ")? + 1;
    let (body, tail) = rest.split_at(at);
    let hash = u64::from_str_radix(tail.strip_prefix("end ")?.lines().next()?, 16).ok()?;
    if hash != fnv1a(format!("{head}\n{body}").as_bytes()) {
        return None;
    }
    Some(crate::checkpoint::guard::decode_replay_floors(body).map(|f| (seq, f)))
}

impl ReplayStore {
    fn open(path: std::path::PathBuf) -> Result<(ReplayStore, Vec<ReplayFloor>), String> {
        let what = |e: &dyn std::fmt::Display| format!("guard: replay_file {}: {e}", path.display());
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| what(&e))?;
        }
        let mut b = path.clone().into_os_string();
        b.push(".b");
        let paths = [path.clone(), std::path::PathBuf::from(b)];
        let mut best: Option<(u64, Vec<ReplayFloor>)> = None;
        let mut found = false;
        for p in &paths {
            let text = match std::fs::read(p) {
                Ok(t) => String::from_utf8_lossy(&t).into_owned(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(what(&e)),
            };
            if text.is_empty() {
                continue;
            }
            found = true;
            match read_slot(&text) {
                Some(Ok((seq, f))) if best.as_ref().is_none_or(|(s, _)| seq > *s) => best = Some((seq, f)),
                Some(Ok(_)) | None => {}
                Some(Err(e)) => return Err(what(&format!("{e} (remove the file and {}.b to start without the previous guard's replay marks)", path.display()))),
            }
        }
        if found && best.is_none() {
            return Err(what(&format!("no readable record (remove the file and {}.b to start without the previous guard's replay marks)", path.display())));
        }
        let open = |p: &std::path::Path| std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(p).map_err(|e| what(&e));
        let slots = [open(&paths[0])?, open(&paths[1])?];
        let (seq, floors) = best.unwrap_or((0, vec![]));
        Ok((ReplayStore { path, slots, seq, unsynced_since: None }, floors))
    }

    fn write(&mut self, floors: &[ReplayFloor]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        self.seq += 1;
        let body = format!("seq {}\n{}", self.seq, crate::checkpoint::guard::encode_replay_floors(floors));
        let rec = format!("{body}end {:016x}\n", fnv1a(body.as_bytes()));
        // The slot not holding the newest record.
        self.slots[(self.seq % 2) as usize].write_all_at(rec.as_bytes(), 0)?;
        self.unsynced_since.get_or_insert_with(Instant::now);
        self.sync_due()
    }

    fn sync_due(&mut self) -> std::io::Result<()> {
        if self.unsynced_since.is_some_and(|t| t.elapsed() >= Duration::from_millis(REPLAY_SYNC_MS)) {
            self.unsynced_since = None;
            for f in &self.slots {
                f.sync_data()?;
            }
            if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::File::open(dir)?.sync_all()?;
            }
        }
        Ok(())
    }
}

fn command_loop(sock: UdpSocket, core: Arc<Mutex<Core>>, raw: Arc<RawSender>, replay: Option<Arc<Mutex<ReplayStore>>>, mono_ms: impl Fn() -> u64) {
    let mut buf = [0u8; 2048];
    let mut ack = [0u8; 128];
    while !crate::daemon::stopping() {
        let (n, src) = match sock.recv_from(&mut buf) {
            Ok(x) => x,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted) => {
                if let Some(r) = &replay {
                    if let Err(e) = crate::sync::lock(r, "guard: replay file").sync_due() {
                        crate::ratelog::log("guard: replay file", || format!("guard: replay file: {e}"));
                    }
                }
                continue;
            }
            Err(e) => {
                crate::ratelog::log("guard: side channel receive", || format!("guard: side channel receive: {e}"));
                continue;
            }
        };
        // A datagram that trips a bug costs that datagram, not the side channel.
        // The replay file's lock first, then the core's: commands are persisted in the order the
        // core took them, and the packet path never waits for the file.
        let mut store = replay.as_ref().map(|r| crate::sync::lock(r, "guard: replay file"));
        let Some((out, floors)) = crate::sync::catch("guard: side channel", || {
            let mut c = crate::sync::lock(&core, "guard: core");
            let out = c.command(src, &buf[..n], wall_ms(), mono_ms(), &mut ack);
            (out, c.take_replay_floors())
        }) else {
            continue;
        };
        if let (Some(s), Some(f)) = (store.as_mut(), floors) {
            if let Err(e) = s.write(&f) {
                crate::ratelog::log("guard: replay file", || format!("guard: replay file {}: {e}", s.path.display()));
            }
        }
        drop(store);
        if let Some(out) = out {
            if let Some(l) = out.ack_len {
                if let Err(e) = raw.send(&ack[..l]) {
                    crate::ratelog::log("guard: ACK inject", || format!("guard: ACK inject failed: {e}"));
                }
            }
            if let Err(e) = sock.send_to(&out.reply, src) {
                crate::ratelog::log("guard: reply", || format!("guard: reply to {src}: {e}"));
            }
        }
    }
}

/// The guard's own status fields (the daemon adds the common ones, see
/// [`crate::daemon::common_fields`]): `forged_source_dropped` and `counters`.
fn status_fields(core: Arc<Mutex<Core>>, spec: unbroken_drivers::iptables::RuleSpec) -> impl FnMut(bool, u64) -> serde_json::Map<String, serde_json::Value> + Send + 'static {
    let mut forged: u64 = 0;
    let mut round: u64 = 0;
    move |_, _| {
        // The rules' DROP counters (forged service sources from the peers' side): read once a
        // second, not at every write (it runs iptables).
        if spec.app_iface.is_some() && round % 4 == 0 {
            if let Ok(n) = unbroken_drivers::iptables::dropped_by_rules(&spec) {
                forged = n;
            }
        }
        round += 1;
        let (mut counters, conns, fast) = {
            let mut c = crate::sync::lock(&core, "guard: core");
            (c.counters.clone(), c.connections(), c.fast_status())
        };
        counters.connections = conns as u64;
        let mut m = serde_json::Map::new();
        m.insert("fast_path".into(), fast);
        m.insert("forged_source_dropped".into(), forged.into());
        m.insert("counters".into(), serde_json::to_value(counters).unwrap_or_default());
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rules that would clear or forge the fast path's mark bits are recognised in
    /// iptables-save's forms; those that leave them alone are not.
    #[test]
    fn hostile_mark_rules_that_touch_the_fast_path_bits() {
        let bits = 0x3000_0000;
        for conflict in [
            "-A PREROUTING -j MARK --set-xmark 0x1/0xffffffff",
            "-A PREROUTING -i eth0 -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff",
            "-A FORWARD -j MARK --set-xmark 0x0/0x30000000",
            "-A PREROUTING -j CONNMARK --restore-mark",
        ] {
            assert!(sets_mark_bits(conflict, bits), "{conflict}");
        }
        for fine in [
            "-A PREROUTING -j MARK --set-xmark 0x1/0xff",
            "-A PREROUTING -j CONNMARK --restore-mark --nfmask 0xffff --ctmask 0xffff",
            "-A PREROUTING -j CONNMARK --save-mark --nfmask 0xffffffff --ctmask 0xffffffff",
            "-A UNBROKEN-Q7 -m mark --mark 0x20000000/0x20000000 -i lan0 -j RETURN",
            "-A POSTROUTING -j MASQUERADE",
        ] {
            assert!(!sets_mark_bits(fine, bits), "{fine}");
        }
    }

    /// The replay file survives a restart: written, reopened, the same marks, also after many
    /// writes that shrink the record; a slot torn by a host crash leaves the other one's, one
    /// write older; a file of the earlier format is read; damage in both slots is an error
    /// naming the file, a missing one an empty start.
    #[test]
    fn replay_file_round_trip() {
        let dir = std::env::temp_dir().join(format!("unbroken-replay-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("sub/guard.replay");
        let b = dir.join("sub/guard.replay.b");
        let (mut store, floors) = ReplayStore::open(path.clone()).unwrap();
        assert!(floors.is_empty());
        let f = |t: u64, n: usize| vec![ReplayFloor { app_ip: "10.0.2.10".parse().unwrap(), time_ms: t, nonces: (0..n as u64).collect(), full: false }];
        store.write(&f(1234, 16)).unwrap();
        assert_eq!(ReplayStore::open(path.clone()).unwrap().1, f(1234, 16));
        for t in 1235..1300 {
            store.write(&f(t, (t % 5) as usize)).unwrap();
        }
        assert_eq!(ReplayStore::open(path.clone()).unwrap().1, f(1299, 4));
        // The newest record (seq 66, in the file: even) torn: the other slot's is read.
        let newest = if store.seq % 2 == 0 { &path } else { &b };
        let mut t = std::fs::read(newest).unwrap();
        t[20] ^= 1;
        std::fs::write(newest, &t).unwrap();
        assert_eq!(ReplayStore::open(path.clone()).unwrap().1, f(1298, 3));
        // A file of the earlier format.
        std::fs::remove_file(&b).unwrap();
        std::fs::write(&path, crate::checkpoint::guard::encode_replay_floors(&f(7, 2))).unwrap();
        let (mut again, old) = ReplayStore::open(path.clone()).unwrap();
        assert_eq!(old, f(7, 2));
        again.write(&f(8, 1)).unwrap();
        assert_eq!(ReplayStore::open(path.clone()).unwrap().1, f(8, 1));
        // Both slots damaged.
        std::fs::write(&path, "garbage").unwrap();
        std::fs::write(&b, "garbage").unwrap();
        let e = ReplayStore::open(path.clone()).err().unwrap();
        assert!(e.contains("guard.replay") && e.contains("remove the file"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
