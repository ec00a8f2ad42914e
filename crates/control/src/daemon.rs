//! What every queue daemon shares (issue 10 item 0): the stop flag and the signal handlers, the
//! eventfd that wakes the packet loop, a poll over the queue and extra descriptors, the status
//! file writer, the packet verdict I/O, and the packet loop itself around a [`Mode`].
//!
//! A mode is two halves (see docs/architecture.md, "One queue daemon, modes as plug-ins"):
//! - its I/O-free core implements [`Mode`]: packets (bytes, in place) and time go in; a
//!   [`Verdict`] per packet, released packets and mode-specific requests come out;
//! - its [`Adapter`] executes the requests only the mode knows (store operations, failover
//!   workers, side-channel datagrams) and feeds back what its own descriptors bring (store
//!   completions, worker messages, heartbeats).
//!
//! [`run`] does everything else: receive a batch, give every packet exactly one verdict even
//! when the mode panics or the kernel refuses one ([`settle_each`]), complete checksums,
//! inject reflected packets, flush, send what the mode asked to send after the verdicts.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use unbroken_drivers::nfqueue::{Queue, QueuedPacket, Verdict as QVerdict};
use unbroken_drivers::rawsend::RawSender;
use unbroken_engines::Verdict;

// ---- stop flag and signals ----------------------------------------------------------------------

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Raises this process's soft limit on open files to its hard limit (as nginx's
/// `worker_rlimit_nofile` does): an agent holds a socket per connection it rebuilt, and a
/// systemd service starts with a soft limit of 1024, so a failover of more connections than
/// that would fail with EMFILE. Returns the limit now in force; says so once when it stays
/// below `want`.
pub fn raise_fd_limit(name: &str, want: u64) -> u64 {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain system calls on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return 0;
        }
        if r.rlim_cur < r.rlim_max {
            let raised = libc::rlimit { rlim_cur: r.rlim_max, rlim_max: r.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                r = raised;
            }
        }
    }
    let now = r.rlim_cur as u64;
    if now < want {
        eprintln!("{name}: open files limited to {now} (RLIMIT_NOFILE; raise LimitNOFILE=, or ulimit -Hn): fewer than {want} connections can be rebuilt at once");
    }
    now
}

/// Where [`lock_instance`] keeps its lock files.
pub const LOCK_DIR: &str = "/run/unbroken/lock";

/// An exclusive hold on one job of this host (an agent's queue in a network namespace, say),
/// kept for the process's life: the kernel lets go of it when the process ends, however it
/// ends (SIGKILL too), so a stale lock file never keeps a successor out.
#[derive(Debug)]
pub struct InstanceLock {
    _file: std::fs::File,
    pub path: PathBuf,
}

/// Takes the job `name` for this process (`flock(LOCK_EX | LOCK_NB)` on `LOCK_DIR/name`), or
/// says which process holds it. Two daemons started at once for the same job would otherwise
/// both pass the check of the rules' owner (made before either installed anything) and then
/// revoke, pin and install over each other. The file holds the holder's pid, for the message;
/// a symbolic link planted at its path is refused, never followed.
pub fn lock_instance(what: &str, name: &str) -> Result<InstanceLock, String> {
    lock_instance_in(Path::new(LOCK_DIR), what, name)
}

/// [`lock_instance`] in another directory (tests).
pub fn lock_instance_in(dir: &Path, what: &str, name: &str) -> Result<InstanceLock, String> {
    use std::io::{Read, Seek, Write};
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if name.is_empty() || name.contains('/') || name.starts_with('.') {
        return Err(format!("{what}: {name:?} cannot name a lock file"));
    }
    std::fs::DirBuilder::new().recursive(true).mode(0o755).create(dir).map_err(|e| format!("{what}: cannot create {}: {e}", dir.display()))?;
    let path = dir.join(format!("{name}.lock"));
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(|e| format!("{what}: cannot open the lock file {}: {e}", path.display()))?;
    // SAFETY: flock on a descriptor this function owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let mut held = String::new();
            let _ = file.read_to_string(&mut held);
            let who = match held.trim().parse::<u32>() {
                Ok(pid) => format!("process {pid}"),
                Err(_) => "another process".to_string(),
            };
            return Err(format!("{what}: {who} already runs this job (it holds {}); stop it first, or give this one another queue", path.display()));
        }
        return Err(format!("{what}: cannot lock {}: {e}", path.display()));
    }
    let mine = format!("{}\n", std::process::id());
    let written = file.set_len(0).and_then(|_| file.rewind()).and_then(|_| file.write_all(mine.as_bytes()));
    if let Err(e) = written {
        return Err(format!("{what}: cannot write {}: {e}", path.display()));
    }
    Ok(InstanceLock { _file: file, path })
}

/// Installs the daemon `name`'s signal handlers: SIGINT and SIGTERM set the stop flag
/// ([`stopping`]); SIGHUP is ignored with one log line and counted ([`crate::signals`]);
/// SIGPIPE too when `ignore_pipe` (a daemon writing to sockets its peers may close).
pub fn install_signals(name: &str, ignore_pipe: bool) {
    // SAFETY: installs handlers that only store to an atomic (or ignore the signal).
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        if ignore_pipe {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
    }
    crate::signals::ignore_hangup(name);
}

/// Whether a stop was asked (a signal, or [`stop`]).
pub fn stopping() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// Asks every loop of the daemon to stop (its threads see [`stopping`]).
pub fn stop() {
    STOP.store(true, Ordering::SeqCst);
}

// ---- wake-ups and polling -----------------------------------------------------------------------

/// A Linux eventfd that wakes the packet loop from other threads.
pub struct Wake(OwnedFd);

impl Wake {
    pub fn new() -> io::Result<Wake> {
        // SAFETY: plain system call; the fd is owned from here on.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Wake(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }))
    }
    /// Makes the descriptor readable (wakes a [`poll_fds`] on it).
    pub fn ring(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an owned eventfd.
        unsafe { libc::write(self.0.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
    }
    /// Consumes the wake-ups so far.
    pub fn clear(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from an owned, non-blocking eventfd.
        unsafe { libc::read(self.0.as_raw_fd(), &mut v as *mut u64 as *mut libc::c_void, 8) };
    }
}

impl AsRawFd for Wake {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Waits up to `timeout_ms` for any of `fds` to be readable; which ones are (all false on a
/// timeout or an interruption). A negative fd is skipped (never readable).
pub fn poll_fds(fds: &[RawFd], timeout_ms: i32) -> Vec<bool> {
    let mut p: Vec<libc::pollfd> = fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    // SAFETY: `p` is a live array of `p.len()` pollfds.
    let n = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, timeout_ms) };
    if n <= 0 {
        return vec![false; fds.len()];
    }
    p.iter().map(|x| x.revents != 0).collect()
}

// ---- status files -------------------------------------------------------------------------------

/// A status file written atomically ([`crate::status::write_atomic`]: a new temporary file
/// beside it, never one found there, then a rename: a reader never sees half a document). A
/// failure is said once, and its end too.
pub struct StatusFile {
    name: String,
    path: PathBuf,
    failed: bool,
}

impl StatusFile {
    /// The status file of the daemon `name` (the prefix of its log lines) at `path`.
    pub fn new(name: &str, path: PathBuf) -> StatusFile {
        StatusFile { name: name.into(), path, failed: false }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Replaces the file's content with `bytes` atomically.
    pub fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        let r = crate::status::write_atomic(&self.path, bytes);
        match &r {
            Ok(()) if self.failed => {
                self.failed = false;
                eprintln!("{}: status file {} written again", self.name, self.path.display());
            }
            Ok(()) => {}
            Err(e) if !self.failed => {
                self.failed = true;
                eprintln!("{}: cannot write status file {}: {e} (said once; retried at every write)", self.name, self.path.display());
            }
            Err(_) => {}
        }
        r
    }
}

/// The fields every daemon's status file carries, whatever its mode: `pid`, `uptime_ms`,
/// `stopped`, `sighup_ignored`, `locks_recovered`, `panics_caught`, `log_suppressed` (the
/// process-wide rate-limited log's count).
pub fn common_fields(started: Instant, stopped: bool) -> serde_json::Map<String, serde_json::Value> {
    let mut m = serde_json::Map::new();
    m.insert("pid".into(), std::process::id().into());
    m.insert("uptime_ms".into(), (started.elapsed().as_millis() as u64).into());
    m.insert("stopped".into(), stopped.into());
    m.insert("sighup_ignored".into(), crate::signals::hangups().into());
    m.insert("locks_recovered".into(), crate::sync::poisoned().into());
    m.insert("panics_caught".into(), crate::sync::panics().into());
    m.insert("log_suppressed".into(), crate::ratelog::global().suppressed().into());
    m
}

/// How the status thread writes: how often, and the flag that asks for an early write.
#[derive(Clone)]
pub struct StatusPlan {
    /// The daemon's name (thread name and log prefix).
    pub name: &'static str,
    /// Where to write; `None` runs the thread for the mode's side effects only (e.g. the
    /// agent saying a store outage).
    pub path: Option<PathBuf>,
    /// The period of the writes.
    pub period: Duration,
    /// Set by the daemon (e.g. after a failover) to write within about 10 ms.
    pub dirty: Arc<AtomicBool>,
    /// When the daemon started (`uptime_ms`).
    pub started: Instant,
}

/// Starts the status thread: until [`stopping`], every `period` (or soon after `dirty` is
/// set), it asks `fields(stopped, uptime_ms)` for the mode's own fields, adds the
/// [`common_fields`] (which win on a clash) and writes the document; a last one with
/// `stopped: true` when the daemon stops.
pub fn spawn_status<F>(plan: StatusPlan, mut fields: F) -> io::Result<std::thread::JoinHandle<()>>
where
    F: FnMut(bool, u64) -> serde_json::Map<String, serde_json::Value> + Send + 'static,
{
    std::thread::Builder::new().name(format!("{}-status", plan.name)).spawn(move || {
        let mut file = plan.path.clone().map(|p| StatusFile::new(plan.name, p));
        loop {
            let stop = stopping();
            let mut doc = fields(stop, plan.started.elapsed().as_millis() as u64);
            doc.extend(common_fields(plan.started, stop));
            if let Some(f) = &mut file {
                let _ = f.write(serde_json::Value::Object(doc).to_string().as_bytes());
            }
            if stop {
                return;
            }
            let ticks = (plan.period.as_millis() / 10).max(1);
            for _ in 0..ticks {
                std::thread::sleep(Duration::from_millis(10)); // periodic status write, not a synchronisation
                if stopping() {
                    break;
                }
                if plan.dirty.swap(false, Ordering::Relaxed) {
                    // Let the packet loop finish what it is handling (a burst of failovers is
                    // one write).
                    std::thread::sleep(Duration::from_millis(5)); // coalescing, not a synchronisation
                    break;
                }
            }
        }
    })
}

// ---- packet verdicts ----------------------------------------------------------------------------

/// Gives every packet of a batch its verdict, whatever happens (issue 9, item 11): `decide`
/// sets it; when `decide` panics (a bug a hostile packet trips; caught, see
/// [`crate::sync::catch`]) or fails (a verdict the queue refuses, e.g. a replacement it cannot
/// carry), `fallback` gets the packet's id and why, and must drop it. A packet already given a
/// verdict before a panic gets a second one, which the kernel refuses harmlessly.
pub fn settle_each<C, P>(what: &str, ctx: &mut C, pkts: &mut [P], id_of: impl Fn(&P) -> u32, decide: impl Fn(&mut C, &mut P) -> io::Result<()>, fallback: impl Fn(&mut C, u32, &dyn std::fmt::Display)) {
    for p in pkts.iter_mut() {
        let id = id_of(p);
        match crate::sync::catch(what, || decide(ctx, p)) {
            Some(Ok(())) => {}
            Some(Err(e)) => fallback(ctx, id, &format_args!("verdict refused ({e})")),
            None => fallback(ctx, id, &"handling the packet panicked"),
        }
    }
}

/// What the verdict I/O reports back to the mode (for its counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoEvent {
    /// A rewritten packet with a partial checksum got its full checksum computed.
    FullChecksum,
    /// Sending an injected packet failed.
    InjectFailed,
    /// A packet got a drop because its handling panicked or its verdict was refused.
    VerdictFallback,
    /// A packet the queue copied only in part (of this length): dropped, never decided.
    Truncated(usize),
    /// The mode answered `Unknown` or `Held` where it must decide (not a deferred packet).
    Undecided,
}

/// The kernel verdict for `pkt[..n]` (`id`), with the I/O a [`Verdict`] implies: a full
/// checksum for a rewritten packet whose checksum was partial, a raw send of an injected one
/// (its original is dropped). `Held` does nothing (the mode releases the packet later);
/// `Unknown` is a drop (a mode resolves it before answering). `event` counts.
pub fn apply(queue: &mut Queue, raw: Option<&RawSender>, id: u32, pkt: &mut [u8], n: usize, verdict: Verdict, csum_not_ready: bool, event: &mut dyn FnMut(IoEvent, Option<&io::Error>)) -> io::Result<()> {
    match verdict {
        Verdict::Accept { modified: false } => queue.set_verdict(id, QVerdict::Accept, None),
        Verdict::Accept { modified: true } => {
            if csum_not_ready && unbroken_wire::ip::fill_tcp_checksum(pkt, n) {
                event(IoEvent::FullChecksum, None);
            }
            queue.set_verdict(id, QVerdict::Accept, Some(&pkt[..n]))
        }
        Verdict::Drop => queue.set_verdict(id, QVerdict::Drop, None),
        Verdict::Held => Ok(()),
        Verdict::Unknown => {
            event(IoEvent::Undecided, None);
            queue.set_verdict(id, QVerdict::Drop, None)
        }
        Verdict::Inject => {
            let r = queue.set_verdict(id, QVerdict::Drop, None);
            let sent = match raw {
                Some(raw) => raw.send(&pkt[..n]),
                None => Err(io::Error::other("no raw socket")),
            };
            if let Err(e) = sent {
                event(IoEvent::InjectFailed, Some(&e));
            }
            r
        }
    }
}

// ---- the mode interface -------------------------------------------------------------------------

/// What a queued packet brings besides its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Meta {
    pub id: u32,
    /// Netfilter hook (3 LOCAL_OUT: sent by this host).
    pub hook: u8,
    /// The sender's link-layer address (an LB's bucket is encoded there in object mode).
    pub hw_src: Option<[u8; 6]>,
    /// The TCP checksum is partial (GSO): a rewritten packet needs a full one.
    pub csum_not_ready: bool,
    /// `skb->mark` as the queue reports it (0 when none): a fast path's marks.
    pub mark: u32,
}

impl Meta {
    pub fn of(p: &QueuedPacket) -> Meta {
        Meta { id: p.id, hook: p.hook, hw_src: p.hw_src, csum_not_ready: p.csum_not_ready, mark: p.mark }
    }
}

/// A packet a mode kept (`Verdict::Held`) and now gives its verdict, with its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    pub id: u32,
    pub data: Vec<u8>,
    pub verdict: Verdict,
    pub csum_not_ready: bool,
}

/// What a mode's core hands back besides per-packet verdicts.
#[derive(Debug)]
pub struct Outbox<R> {
    /// Held packets whose verdict is now known; given before the queue is flushed.
    pub released: Vec<Released>,
    /// Packets to send after the verdicts are flushed (so they never overtake a released
    /// segment): pure ACKs, elicitations, replies.
    pub send: Vec<Vec<u8>>,
    /// Requests for the mode's [`Adapter`].
    pub requests: Vec<R>,
}

impl<R> Default for Outbox<R> {
    fn default() -> Self {
        Outbox { released: Vec::new(), send: Vec::new(), requests: Vec::new() }
    }
}

/// The I/O-free core of a mode: every decision of a queue daemon lives here, so that a test
/// or a simulation drives it without a queue, a socket or a clock.
pub trait Mode {
    /// Mode-specific requests its [`Adapter`] carries out (`()` when none).
    type Request;
    /// Decides `pkt[..len]` at `now_ms` (monotonic). It may rewrite the packet in place and
    /// grow it up to `pkt.len()`; returns the verdict and the packet's new length. `Held`
    /// means the mode copied it and gives its verdict later through [`Outbox::released`].
    fn packet(&mut self, now_ms: u64, meta: Meta, pkt: &mut [u8], len: usize, out: &mut Outbox<Self::Request>) -> (Verdict, usize);
    /// Time passes (expiry, timers, retries); called after every batch, and at least every
    /// [`Mode::wait_ms`].
    fn tick(&mut self, now_ms: u64, out: &mut Outbox<Self::Request>);
    /// The longest the daemon may wait for packets before calling [`Mode::tick`].
    fn wait_ms(&self) -> u64 {
        200
    }
    /// Counts what the verdict I/O reports; returns the running count of that kind (for
    /// rate-limited log lines).
    fn io_event(&mut self, ev: IoEvent) -> u64;
    /// Whether the mode decides a whole batch at once ([`Mode::packets`]) instead of packet by
    /// packet ([`Mode::packet`]).
    const BATCH: bool = false;
    /// A batch mode's decision: takes the packets (their bytes moved out of the queue's
    /// buffers) and gives every one its verdict through [`Outbox::released`], now or later.
    /// When it panics, the daemon drops every packet of the batch after giving the verdicts
    /// [`Mode::collect`] still hands over (a second verdict is refused harmlessly).
    fn packets(&mut self, now_ms: u64, batch: &mut Vec<(Meta, Vec<u8>)>, out: &mut Outbox<Self::Request>) {
        let _ = (now_ms, out);
        batch.clear();
    }
    /// Moves what the mode decided since the last call into `out` (a mode that queues its
    /// decisions internally; the daemon calls it after every step).
    fn collect(&mut self, out: &mut Outbox<Self::Request>) {
        let _ = out;
    }
    /// The round's verdicts have been sent to the kernel (e.g. a fast path may now hand
    /// connections back to the kernel without letting later packets overtake them).
    fn after_flush(&mut self, now_ms: u64) {
        let _ = now_ms;
    }
}

/// The I/O half of a mode beyond the queue: its own descriptors and requests.
pub trait Adapter<M: Mode> {
    /// Descriptors to poll beside the queue (store completions, a worker wake-up, a side
    /// channel). None: the loop blocks on the queue alone.
    fn fds(&self) -> Vec<RawFd> {
        Vec::new()
    }
    /// Before the loop waits for packets (e.g. a watchdog: the loop is idle).
    fn before_wait(&mut self) {}
    /// After the wait, before the batch, with the mode locked (e.g. the latest heartbeat view).
    fn after_wait(&mut self, mode: &mut M, now_ms: u64) {
        let _ = (mode, now_ms);
    }
    /// After each batch, with the mode locked: carries out `out.requests` and feeds the mode
    /// what the descriptors brought (`ready[i]` for `fds()[i]`); anything it adds to `out`
    /// goes out in this round.
    fn service(&mut self, mode: &mut M, now_ms: u64, ready: &[bool], out: &mut Outbox<M::Request>);
    /// After the tick: carries out the requests it made.
    fn execute(&mut self, mode: &mut M, now_ms: u64, out: &mut Outbox<M::Request>) {
        self.service(mode, now_ms, &[], out)
    }
    /// At the end of a round, before the flush (e.g. publishing counters for the status).
    fn end_round(&mut self, mode: &mut M, queue: unbroken_drivers::nfqueue::Stats) {
        let _ = (mode, queue);
    }
}

/// An adapter with nothing of its own (all of the mode's I/O is the daemon's).
pub struct NoAdapter;

impl<M: Mode> Adapter<M> for NoAdapter {
    fn service(&mut self, _: &mut M, _: u64, _: &[bool], out: &mut Outbox<M::Request>) {
        out.requests.clear();
    }
}

/// The verdict I/O of one daemon: its name (log prefix), queue and raw sender.
pub struct PacketIo<'a> {
    name: &'static str,
    queue: &'a mut Queue,
    raw: Option<&'a RawSender>,
    /// Rate-limited log kinds: `<name>: verdict`, `<name>: inject`, `<name>: verdict flush`,
    /// `<name>: slow round`.
    kinds: [&'static str; 4],
}

/// A loop round longer than this (from waking to its last send), or a wake this much later
/// than asked, is logged with where its time went: a late round beats late, and a peer may
/// suspect this host (replica mode's detector allows 100 ms by default).
pub const SLOW_ROUND_MS: u64 = 40;

/// Where one round of [`run`] spent its time (for the slow-round log line).
struct RoundClock {
    asked_ms: u64,
    waited_from: Instant,
    marks: [(&'static str, Instant); 9],
    n: usize,
    packets: usize,
}

impl RoundClock {
    fn start(asked_ms: u64) -> RoundClock {
        let now = Instant::now();
        RoundClock { asked_ms, waited_from: now, marks: [("", now); 9], n: 0, packets: 0 }
    }

    fn mark(&mut self, phase: &'static str) {
        if self.n < self.marks.len() {
            self.marks[self.n] = (phase, Instant::now());
            self.n += 1;
        }
    }

    /// The line to log when the round was slow or woke late, else None.
    fn slow(&self, name: &str) -> Option<String> {
        if self.n == 0 {
            return None;
        }
        let woke = self.marks[0].1;
        let waited = woke.duration_since(self.waited_from).as_millis() as u64;
        let late = waited.saturating_sub(self.asked_ms);
        let took = self.marks[self.n - 1].1.duration_since(woke).as_millis() as u64;
        if took < SLOW_ROUND_MS && late < SLOW_ROUND_MS {
            return None;
        }
        let mut parts = Vec::with_capacity(self.n);
        for w in self.marks[..self.n].windows(2) {
            let ms = w[1].1.duration_since(w[0].1).as_secs_f64() * 1000.0;
            parts.push(format!("{} {ms:.1}", w[1].0));
        }
        Some(format!(
            "{name}: a loop round took {took} ms after waking {late} ms later than asked ({waited} of {} ms; {} packet(s); ms per phase: {}): a late loop beats late (check the CPU, memory and I/O pressure of this host, /proc/pressure/*)",
            self.asked_ms,
            self.packets,
            parts.join(", ")
        ))
    }
}

impl<'a> PacketIo<'a> {
    /// The verdict I/O of the daemon `name` on `queue`; `raw` sends injected packets.
    pub fn new(name: &'static str, queue: &'a mut Queue, raw: Option<&'a RawSender>) -> PacketIo<'a> {
        // Once per daemon: the rate-limited log keys its kinds by static strings.
        let kind = |k: &str| -> &'static str { Box::leak(format!("{name}: {k}").into_boxed_str()) };
        PacketIo { name, queue, raw, kinds: [kind("verdict"), kind("inject"), kind("verdict flush"), kind("slow round")] }
    }

    fn settle<M: Mode>(&mut self, mode: &mut M, id: u32, pkt: &mut [u8], n: usize, v: Verdict, csum_not_ready: bool) -> io::Result<()> {
        let (name, kind) = (self.name, self.kinds[1]);
        apply(self.queue, self.raw, id, pkt, n, v, csum_not_ready, &mut |ev, e| {
            let count = mode.io_event(ev);
            if let (IoEvent::InjectFailed, Some(e)) = (ev, e) {
                crate::ratelog::log(kind, || format!("{name}: inject failed ({count} time(s) so far): {e}"));
            }
        })
    }

    fn fallback<M: Mode>(&mut self, mode: &mut M, id: u32, why: &dyn std::fmt::Display) {
        let n = mode.io_event(IoEvent::VerdictFallback);
        let name = self.name;
        crate::ratelog::log(self.kinds[0], || format!("{name}: {why}; the packet is dropped instead ({n} time(s) so far)"));
        let _ = self.queue.set_verdict(id, QVerdict::Drop, None);
    }
}

/// Runs the packet loop until [`stopping`]: receives a batch (up to 64), lets the mode decide
/// each packet and gives its verdict (room for 64 bytes of growth), ticks the mode, gives the
/// released packets their verdicts, lets the adapter serve, flushes, then sends. `mode` is
/// locked for a batch at a time (other threads, e.g. a side channel, may share it).
pub fn run<M: Mode, A: Adapter<M>>(io: &mut PacketIo<'_>, mode: &Mutex<M>, adapter: &mut A, now_ms: impl Fn() -> u64) -> Result<(), String> {
    let name = io.name;
    let core = format!("{name}: core");
    let packet = format!("{name}: packet");
    let mut batch: Vec<QueuedPacket> = Vec::with_capacity(64);
    let mut out: Outbox<M::Request> = Outbox::default();
    let extra = adapter.fds();
    let mut fds = vec![io.queue.as_raw_fd()];
    fds.extend(&extra);
    let mut taken: Vec<(Meta, Vec<u8>)> = Vec::with_capacity(64);
    let mut ids: Vec<u32> = Vec::with_capacity(64);
    loop {
        if stopping() {
            return Ok(());
        }
        adapter.before_wait();
        let mut clock;
        let ready = if extra.is_empty() {
            let wait = crate::sync::lock(mode, &core).wait_ms().min(200);
            clock = RoundClock::start(wait);
            match io.queue.recv_batch(&mut batch, 64, Some(Duration::from_millis(wait))) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(format!("{name}: queue receive: {e}")),
            }
            Vec::new()
        } else {
            let wait = crate::sync::lock(mode, &core).wait_ms().min(i32::MAX as u64) as i32;
            clock = RoundClock::start(wait.max(0) as u64);
            let ready = poll_fds(&fds, wait);
            batch.clear();
            if ready[0] {
                match io.queue.recv_batch(&mut batch, 64, Some(Duration::ZERO)) {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(format!("{name}: queue receive: {e}")),
                }
            }
            ready[1..].to_vec()
        };
        clock.mark("woke");
        clock.packets = batch.len();
        let now = now_ms();
        let mut m = crate::sync::lock(mode, &core);
        clock.mark("lock");
        adapter.after_wait(&mut m, now);
        if M::BATCH {
            ids.clear();
            for p in batch.iter_mut() {
                if p.truncated() {
                    m.io_event(IoEvent::Truncated(p.data.len()));
                    let _ = io.queue.set_verdict(p.id, QVerdict::Drop, None);
                    continue;
                }
                ids.push(p.id);
                taken.push((Meta::of(p), std::mem::take(&mut p.data)));
            }
            let decided = crate::sync::catch(&packet, || m.packets(now, &mut taken, &mut out)).is_some();
            taken.clear();
            m.collect(&mut out);
            release(io, &mut *m, &mut out);
            if !decided {
                // A bug tripped by one of these packets: what the mode decided went out above;
                // every packet still gets a verdict (a second one is refused, harmless).
                for &id in &ids {
                    let _ = io.queue.set_verdict(id, QVerdict::Drop, None);
                }
            }
        } else {
            let mut ctx = (&mut *m, &mut *io, &mut out);
            settle_each(
                &packet,
                &mut ctx,
                &mut batch,
                |p| p.id,
                |(m, io, out), p| {
                    let len = p.data.len();
                    if p.truncated() {
                        // Should not happen with a 64 KiB copy range; never forward a half-read
                        // packet with a replacement, never let a protected one pass unrewritten.
                        m.io_event(IoEvent::Truncated(len));
                        return io.queue.set_verdict(p.id, QVerdict::Drop, None);
                    }
                    p.data.resize(len + 64, 0);
                    let (v, n) = m.packet(now, Meta::of(p), &mut p.data, len, out);
                    io.settle(&mut **m, p.id, &mut p.data, n, v, p.csum_not_ready)
                },
                |(m, io, _), id, why| io.fallback(&mut **m, id, why),
            );
        }
        clock.mark("packets");
        adapter.service(&mut m, now, &ready, &mut out);
        m.collect(&mut out);
        clock.mark("service");
        m.tick(now, &mut out);
        m.collect(&mut out);
        clock.mark("tick");
        if !out.requests.is_empty() {
            adapter.execute(&mut m, now, &mut out);
            m.collect(&mut out);
        }
        release(io, &mut *m, &mut out);
        adapter.end_round(&mut m, io.queue.stats());
        drop(m);
        clock.mark("requests and verdicts");
        let flushed = match io.queue.flush() {
            Ok(()) => true,
            Err(e) => {
                crate::ratelog::log(io.kinds[2], || format!("{name}: verdict flush: {e} (the verdicts are kept as drops and sent again)"));
                false
            }
        };
        clock.mark("flush");
        // After the verdicts: a packet sent here never overtakes a segment released with it.
        for pkt in out.send.drain(..) {
            if let Some(Err(e)) = io.raw.map(|r| r.send(&pkt)) {
                let count = crate::sync::lock(mode, &core).io_event(IoEvent::InjectFailed);
                crate::ratelog::log(io.kinds[1], || format!("{name}: inject failed ({count} time(s) so far): {e}"));
            }
        }
        clock.mark("sends");
        // After the verdicts and the sends: a connection a fast path gives back to the kernel
        // now never has a later packet of it overtake them.
        if flushed {
            crate::sync::lock(mode, &core).after_flush(now);
        }
        if let Some(line) = clock.slow(name) {
            crate::ratelog::log(io.kinds[3], || line);
        }
    }
}

/// Gives the released packets their verdicts and hands their buffers back to the queue.
fn release<M: Mode>(io: &mut PacketIo<'_>, m: &mut M, out: &mut Outbox<M::Request>) {
    for mut r in out.released.drain(..) {
        let n = r.data.len();
        let v = match r.verdict {
            // A released packet is decided: never held twice.
            Verdict::Held => Verdict::Drop,
            v => v,
        };
        if let Err(e) = io.settle(m, r.id, &mut r.data, n, v, r.csum_not_ready) {
            io.fallback(m, r.id, &format_args!("verdict refused ({e})"));
        }
        io.queue.recycle(r.data);
    }
}

// ---- secrets ------------------------------------------------------------------------------------

/// 32 bytes from the kernel's CSPRNG (getrandom(2)).
pub(crate) fn random_secret() -> io::Result<[u8; 32]> {
    let mut b = [0u8; 32];
    let mut got = 0;
    while got < b.len() {
        // SAFETY: writes at most `len - got` bytes into our buffer.
        let r = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), b.len() - got, 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        got += r as usize;
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_or_late_round_is_named_with_where_its_time_went() {
        let base = Instant::now();
        let at = |ms: u64| base + Duration::from_millis(ms);
        let round = |asked_ms: u64, marks: &[(&'static str, u64)]| {
            let mut c = RoundClock { asked_ms, waited_from: base, marks: [("", base); 9], n: marks.len(), packets: 3 };
            for (i, (p, ms)) in marks.iter().enumerate() {
                c.marks[i] = (p, at(*ms));
            }
            c.slow("replica")
        };
        // An ordinary round: woke when asked, done in a few ms.
        assert_eq!(round(10, &[("woke", 10), ("lock", 10), ("packets", 12), ("tick", 13), ("sends", 14)]), None);
        // Woke 120 ms after a 10 ms wait: the late wake is said, with the phases.
        let late = round(10, &[("woke", 130), ("lock", 130), ("packets", 131), ("sends", 132)]).expect("late");
        assert!(late.contains("after waking 120 ms later than asked (130 of 10 ms"), "{late}");
        assert!(late.contains("3 packet(s)"), "{late}");
        // A round that spent 90 ms in one phase names it.
        let slow = round(10, &[("woke", 5), ("lock", 5), ("packets", 95), ("tick", 96), ("sends", 97)]).expect("slow");
        assert!(slow.contains("took 92 ms") && slow.contains("packets 90.0"), "{slow}");
        // No marks (the round never woke): nothing to say.
        assert_eq!(round(10, &[]), None);
    }

    #[test]
    fn hostile_a_second_instance_of_a_job_is_refused_and_named() {
        let dir = std::env::temp_dir().join(format!("ub-lock-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = lock_instance_in(&dir, "agent", "agent-net1-q7").expect("the first takes the job");
        // Another descriptor of the same file (what a second daemon would open) is refused,
        // and the message names the holder.
        let second = lock_instance_in(&dir, "agent", "agent-net1-q7").unwrap_err();
        assert!(second.contains(&format!("process {}", std::process::id())), "{second}");
        assert!(second.contains("agent-net1-q7.lock"), "{second}");
        // Another job is independent.
        let other = lock_instance_in(&dir, "agent", "agent-net1-q8").expect("another queue");
        drop(first);
        // Released with its holder (a dead process's file stays, and does not keep anyone out).
        let again = lock_instance_in(&dir, "agent", "agent-net1-q7").expect("free again");
        assert_eq!(std::fs::read_to_string(&again.path).unwrap().trim(), std::process::id().to_string());
        drop((again, other));
        // A planted symbolic link is refused, never followed; names that leave the directory too.
        let target = dir.join("target");
        std::fs::write(&target, b"keep").unwrap();
        std::os::unix::fs::symlink(&target, dir.join("planted.lock")).unwrap();
        assert!(lock_instance_in(&dir, "agent", "planted").is_err());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        for bad in ["", "../x", ".hidden", "a/b"] {
            assert!(lock_instance_in(&dir, "agent", bad).is_err(), "{bad:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn hostile_every_packet_gets_a_verdict_even_when_handling_fails() {
        // Issue 9 item 11: a batch where handling one packet panics and another's verdict is
        // refused: each still gets exactly one verdict from the fallback (a drop), the others
        // theirs, and the loop goes on.
        #[derive(Default)]
        struct Io {
            verdicts: Vec<(u32, &'static str)>,
            fallbacks: u32,
        }
        let mut pkts: Vec<u32> = (1..=8).collect();
        let mut io = Io::default();
        settle_each(
            "test: packet",
            &mut io,
            &mut pkts,
            |p| *p,
            |io, p| match *p {
                3 => panic!("a bug reached by packet 3"),
                5 => Err(std::io::Error::other("replacement too large")),
                id => {
                    io.verdicts.push((id, "accept"));
                    Ok(())
                }
            },
            |io, id, why| {
                assert!(!why.to_string().is_empty());
                io.fallbacks += 1;
                io.verdicts.push((id, "drop"));
            },
        );
        let mut ids: Vec<u32> = io.verdicts.iter().map(|v| v.0).collect();
        ids.sort();
        assert_eq!(ids, (1..=8).collect::<Vec<_>>(), "every packet exactly one verdict: {:?}", io.verdicts);
        assert_eq!(io.fallbacks, 2);
        assert!(io.verdicts.contains(&(3, "drop")) && io.verdicts.contains(&(5, "drop")));
    }

    #[test]
    fn status_file_is_replaced_whole_and_a_failure_recovers() {
        let dir = std::env::temp_dir().join(format!("ub-daemon-status-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.json");
        let mut f = StatusFile::new("test", path.clone());
        f.write(b"{\"a\":1}").unwrap();
        f.write(b"{\"a\":2}").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"{\"a\":2}");
        // No temporary file is left beside it.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        // Its directory gone: refused (said once), then written again once it is back.
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(f.write(b"{}").is_err());
        assert!(f.failed);
        std::fs::create_dir_all(&dir).unwrap();
        f.write(b"{\"a\":3}").unwrap();
        assert!(!f.failed);
        assert_eq!(std::fs::read(&path).unwrap(), b"{\"a\":3}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Issue 20 item 14: the temporary file was `<path>.tmp<pid>`, opened with O_TRUNC and
    /// following symlinks: a local user who planted a symlink there had the root daemon
    /// overwrite any file with its status. Now the status is still written and the target is
    /// untouched.
    #[test]
    fn hostile_status_file_does_not_follow_a_planted_temp_symlink() {
        let d = crate::status::tests::Scratch::new("daemon-status-symlink");
        let path = d.0.join("s.json");
        let mut old = path.as_os_str().to_owned();
        old.push(format!(".tmp{}", std::process::id()));
        let victim = d.plant(std::path::Path::new(&old));
        let mut f = StatusFile::new("test", path.clone());
        f.write(b"{\"a\":1}").expect("the status is written");
        assert_eq!(std::fs::read(&path).unwrap(), b"{\"a\":1}");
        assert!(!std::fs::symlink_metadata(&path).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious", "the symlink's target is untouched");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777 & !0o022, 0o644);
    }

    #[test]
    fn common_fields_carry_every_name_status_readers_use() {
        let m = common_fields(Instant::now(), true);
        for k in ["pid", "uptime_ms", "stopped", "sighup_ignored", "locks_recovered", "panics_caught", "log_suppressed"] {
            assert!(m.contains_key(k), "{k}");
        }
        assert_eq!(m["stopped"], serde_json::Value::Bool(true));
        assert_eq!(m["pid"].as_u64(), Some(std::process::id() as u64));
    }

    #[test]
    fn a_wake_rung_from_another_thread_makes_poll_return() {
        let w = Arc::new(Wake::new().unwrap());
        assert_eq!(poll_fds(&[w.as_raw_fd()], 0), vec![false]);
        let w2 = w.clone();
        std::thread::spawn(move || w2.ring()).join().unwrap();
        assert_eq!(poll_fds(&[w.as_raw_fd(), -1], 10_000), vec![true, false]);
        w.clear();
        assert_eq!(poll_fds(&[w.as_raw_fd()], 0), vec![false]);
    }
}
