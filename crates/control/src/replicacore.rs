//! Replica mode's decisions (issue 10): the I/O-free core of `unbroken replica` on either host.
//! The engines ([`unbroken_engines::replica`]) decide each packet; this core decides everything
//! around them that the paper leaves to "the daemon": when the peer counts as present, what the
//! side channel accepts, when beats and progress go out, when the detector fences, what a
//! fence's result means, when a primary yields, when finished connections are forgotten. The
//! daemon ([`crate::replica`]) only does I/O: the queue, the UDP side channel, the fencing
//! command, the ARP suppression and announcement.
//!
//! States (one per host, [`State`]):
//! - `WaitingForPeer` until the first authenticated message of the other role. A primary passes
//!   its traffic untouched (those connections stay unprotected: the backup's server never saw
//!   their start); a backup follows connections from their SYN but never takes over: neither
//!   detector is armed before the peer was heard (a backup started before its primary must not
//!   fence it, a primary started alone must not fence a backup that is not there yet).
//! - `Protecting`: the engines gate and translate; beats go out every interval (the backup also
//!   sends its progress as soon as a round changed it: strict output commit and the primary's
//!   ACK wait for it, ST-TCP 3.6); the detector watches the peer's messages.
//! - `Fencing`: the peer missed its beats; the fencing command runs (ST-TCP 3.2.2: a live
//!   primary and an active backup must never both answer). Traffic is handled as in
//!   `Protecting` meanwhile (a primary keeps holding unverified output). A failed fence returns
//!   to `Protecting` and is retried after the next silence, no sooner than a backoff that
//!   doubles from 100 ms to 5 s (a live but cut-off peer's fence device is not hammered).
//! - `TookOver` (backup): the primary is fenced; withheld output is released and translated from
//!   now on; the daemon removes the ARP suppression and announces the address.
//! - `PeerFailed` (primary): the backup is fenced; the primary runs unprotected, reported.
//! - `Yielded` (primary): its own server failed on a connection where the backup's did not
//!   (ST-TCP Table 3.3 rows 2-3): it stops beating and drops every packet of the service, so
//!   the backup's detector fences it and takes over.
//!
//! Side-channel messages are accepted only from the configured peer address, authenticated
//! ([`unbroken_wire::replica`]), of the other role, and with a number above the highest accepted
//! (every datagram has its own, a beat's chunks too: a replay, even of the newest, is stale).
//! An authenticated message of this host's own role from the peer's address means both hosts
//! were given the same role: the daemon stops ([`Request::Fatal`]).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use unbroken_engines::replica::{Backup, Config as EngineConfig, ConnKey, Detector, DetectorAction, DetectorConfig, Notice, Primary, Why};
use unbroken_engines::Verdict;
use unbroken_wire::ctl::Key;
use unbroken_wire::replica::{Progress, Role};

use crate::daemon::{IoEvent, Meta, Mode, Outbox};

/// The first wait after a failed fence, and the longest.
pub const FENCE_BACKOFF_MIN_MS: u64 = 100;
pub const FENCE_BACKOFF_MAX_MS: u64 = 5_000;

/// Netfilter's LOCAL_OUT hook: a packet this host's server sends.
const HOOK_LOCAL_OUT: u8 = 3;

/// Where a replica host stands (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    WaitingForPeer,
    Protecting,
    Fencing,
    TookOver,
    PeerFailed,
    Yielded,
}

/// What the daemon must do for the core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Send this datagram to the peer's side-channel address.
    Side(Vec<u8>),
    /// Run the fencing command; report with [`Core::fence_done`].
    Fence,
    /// The backup took over: remove the ARP suppression, then announce the service address.
    Announce,
    /// A line for the log.
    Log(String),
    /// The daemon cannot go on (a configuration error only the peer's messages reveal): stop
    /// with this error.
    Fatal(String),
}

/// The core's settings.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub role: Role,
    pub detector: DetectorConfig,
    pub engine: EngineConfig,
    /// How long a connection finished on both sides is remembered before it is forgotten.
    pub finished_grace_ms: u64,
}

/// What the core counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
    pub beats_sent: u64,
    pub beats_received: u64,
    /// Messages that failed authentication or parsing.
    pub beats_bad: u64,
    /// Authenticated messages older than the newest accepted (replays).
    pub beats_stale: u64,
    /// Datagrams from an address other than the peer's, or of this host's own role.
    pub beats_foreign: u64,
    /// Messages that could not be built (never expected; counted, not sent).
    pub beats_unsent: u64,
    pub fences_run: u64,
    pub fences_failed: u64,
    /// Packets passed untouched because the peer was not there yet (primary) or had failed.
    pub passed_unprotected: u64,
    /// Packets dropped by a primary that yielded.
    pub yielded_dropped: u64,
    /// Yields not done because the backup was not heard within a detector window.
    pub yields_refused: u64,
    /// Connections that became unprotected (engine notices), and those by divergence.
    pub unprotected: u64,
    pub diverged: u64,
    /// Client ACKs relayed into the backup's own stack.
    pub acks_injected: u64,
    /// Finished connections forgotten after their grace period.
    pub forgotten: u64,
    /// Packets whose checksum was left for the NIC (GSO/veth): completed before the engine.
    pub checksums_completed: u64,
    /// Verdict I/O events (the daemon's): fallbacks, failed injections.
    pub verdict_fallbacks: u64,
    pub inject_failed: u64,
}

/// The I/O-free core of one replica host.
pub struct Core {
    s: Settings,
    key: Key,
    peer: SocketAddr,
    state: State,
    primary: Option<Primary>,
    backup: Option<Backup>,
    det: Option<Detector>,
    /// This host's beat counter (the daemon starts it from the wall clock in microseconds, so a
    /// restarted host is never taken for a replay).
    beat: u64,
    next_beat_at: u64,
    /// The backup's progress changed in this round: send it without waiting for the beat.
    dirty: bool,
    /// Newest accepted beat of the peer, and when (monotonic ms).
    peer_beat: Option<u64>,
    pub peer_heard_at: Option<u64>,
    /// Backup: from the primary's last message to the takeover.
    pub takeover_ms: Option<u64>,
    finished_since: HashMap<ConnKey, u64>,
    next_sweep_at: u64,
    /// After a failed fence, the next may run no sooner than this (backoff doubling from
    /// [`FENCE_BACKOFF_MIN_MS`] to [`FENCE_BACKOFF_MAX_MS`]): a peer that is alive but cut off, or
    /// a fence device that refuses, is not hammered every few beats.
    fence_backoff_ms: u64,
    next_fence_at: u64,
    requests: Vec<Request>,
    send: Vec<Vec<u8>>,
    /// The latest time passed in.
    clock: u64,
    /// This host's first message number (its own numbers are `first_beat..beat`).
    first_beat: u64,
    pub counters: Counters,
    /// Connections that became unprotected, by reason (as the engine names it).
    pub unprotected_by: HashMap<&'static str, u64>,
}

/// How a role is named in configs, status files and logs.
pub fn role_name(r: Role) -> &'static str {
    match r {
        Role::Primary => "primary",
        Role::Backup => "backup",
    }
}

fn why_name(w: Why) -> &'static str {
    match w {
        Why::BackupFailed => "backup_failed",
        Why::BackupLagging => "backup_lagging",
        Why::BackupFinAlone => "backup_fin_alone",
        Why::BackupRst => "backup_rst",
        Why::FinTimeout => "fin_timeout",
        Why::Diverged => "diverged",
        Why::HeldTotal => "held_total",
        Why::BackupMisaligned => "backup_misaligned",
        Why::PrimaryFailed => "primary_failed",
        Why::BackupStale => "backup_stale",
    }
}

/// What failed on the primary, for a log line: a connection, or its server as a whole.
fn yield_text(key: &Option<ConnKey>) -> String {
    match key {
        Some(k) => key_text(k),
        None => "its listening socket (the server is gone)".to_string(),
    }
}

fn key_text(k: &ConnKey) -> String {
    match k.client {
        IpAddr::V4(a) => format!("{a}:{} -> :{}", k.client_port, k.server_port),
        IpAddr::V6(a) => format!("[{a}]:{} -> :{}", k.client_port, k.server_port),
    }
}

impl Core {
    /// A core for `settings.role`, talking to `peer` under `key`; `first_beat` numbers its
    /// first message; `now_ms` is the monotonic clock.
    pub fn new(settings: Settings, key: Key, peer: SocketAddr, first_beat: u64, now_ms: u64) -> Core {
        let (primary, backup) = match settings.role {
            Role::Primary => (Some(Primary::new(settings.engine)), None),
            Role::Backup => (None, Some(Backup::with_capacity(settings.engine.max_conns))),
        };
        Core {
            s: settings,
            key,
            peer,
            state: State::WaitingForPeer,
            primary,
            backup,
            det: None,
            beat: first_beat.max(1),
            next_beat_at: now_ms,
            dirty: false,
            peer_beat: None,
            peer_heard_at: None,
            takeover_ms: None,
            finished_since: HashMap::new(),
            next_sweep_at: now_ms + 1000,
            fence_backoff_ms: 0,
            next_fence_at: 0,
            requests: Vec::new(),
            send: Vec::new(),
            clock: now_ms,
            first_beat: first_beat.max(1),
            counters: Counters::default(),
            unprotected_by: HashMap::new(),
        }
    }

    pub fn state(&self) -> State {
        self.state
    }

    pub fn role(&self) -> Role {
        self.s.role
    }

    /// The other host's role, as logs name it.
    fn peer_role(&self) -> &'static str {
        role_name(match self.s.role {
            Role::Primary => Role::Backup,
            Role::Backup => Role::Primary,
        })
    }

    pub fn primary(&self) -> Option<&Primary> {
        self.primary.as_ref()
    }

    pub fn backup(&self) -> Option<&Backup> {
        self.backup.as_ref()
    }

    /// Connections the engine follows.
    pub fn connections(&self) -> usize {
        self.primary.as_ref().map_or(0, |p| p.connections()) + self.backup.as_ref().map_or(0, |b| b.connections())
    }

    fn log(&mut self, line: String) {
        self.requests.push(Request::Log(line));
    }

    /// The primary's check of its server's listening sockets (every few beats, by the daemon):
    /// a listener gone is a sick host (the engine asks to yield).
    pub fn server_listening(&mut self, up: bool) {
        if let Some(p) = self.primary.as_mut() {
            if self.state != State::WaitingForPeer {
                p.server_listening(up);
            }
        }
        self.drain_primary();
    }

    /// The primary engine's packets to send and notices.
    fn drain_primary(&mut self) {
        let Some(p) = self.primary.as_mut() else { return };
        self.send.extend(p.take_transmit());
        // Duplicate ACKs in the client's name for this host's own server (to the service
        // address, which is local: the raw sender delivers them to it).
        self.send.extend(p.take_inject());
        for n in p.take_notices() {
            match n {
                Notice::Unprotected { key, why } => {
                    self.counters.unprotected += 1;
                    if why == Why::Diverged {
                        self.counters.diverged += 1;
                    }
                    *self.unprotected_by.entry(why_name(why)).or_default() += 1;
                    if why != Why::BackupFailed {
                        let line = format!("replica: {} runs unprotected from now on: {}", key_text(&key), why_name(why));
                        self.log(line);
                    }
                }
                Notice::YieldToBackup { key } => {
                    // Only to a backup that is there: one silent for a detector window (dead,
                    // or being fenced) would never take over, and a yielded primary drops
                    // everything: an outage for every client. That connection stays held until
                    // the backup is heard again or declared failed (then it goes out alone).
                    let window = self.s.detector.interval_ms * self.s.detector.misses as u64;
                    let backup_alive = self.state == State::Protecting && self.peer_heard_at.is_some_and(|t| self.clock.saturating_sub(t) <= window);
                    if !backup_alive {
                        self.counters.yields_refused += 1;
                        let line = format!("replica: the primary's server failed on {} but the backup is not heard: not yielding (the backup may be dead)", yield_text(&key));
                        self.log(line);
                        continue;
                    }
                    if self.state != State::Yielded {
                        self.state = State::Yielded;
                        let line = format!("replica: the primary's server failed on {} where the backup's did not: yielding (no more beats, the service's packets dropped) so that the backup fences this host and takes over", yield_text(&key));
                        self.log(line);
                    }
                }
                Notice::BackupStale { why } => {
                    let line = format!("replica: the backup missed input this host's server consumed ({}): it can no longer take over; every connection runs unprotected until both are restarted", why_name(why));
                    self.log(line);
                }
            }
        }
    }

    /// Sends this host's progress now: a beat (`full`: every connection), or the backup's
    /// connections a packet touched since its last message.
    fn send_beat(&mut self, now_ms: u64, full: bool) {
        let msgs = match (&self.primary, &mut self.backup) {
            (Some(p), _) => p.report(self.beat),
            (_, Some(b)) if full => b.progress(self.beat),
            (_, Some(b)) => b.progress_changed(self.beat),
            _ => return,
        };
        // Every datagram its own number (a beat's chunks too), so a receiver accepts each at
        // most once: a replayed datagram, even the newest, is stale.
        for mut m in msgs {
            m.beat = self.beat;
            self.beat += 1;
            match m.emit(&self.key) {
                Ok(d) => {
                    self.counters.beats_sent += 1;
                    self.requests.push(Request::Side(d));
                }
                Err(_) => self.counters.beats_unsent += 1,
            }
        }
        self.dirty = false;
        if full {
            self.next_beat_at = now_ms + self.s.detector.interval_ms;
        }
    }

    /// A datagram from `from` on the side channel.
    pub fn side(&mut self, now_ms: u64, from: SocketAddr, dgram: &[u8]) {
        self.clock = self.clock.max(now_ms);
        if from != self.peer {
            self.counters.beats_foreign += 1;
            return;
        }
        let p = match Progress::parse(dgram, &self.key) {
            Ok(p) => p,
            Err(_) => {
                self.counters.beats_bad += 1;
                return;
            }
        };
        if p.role == self.s.role {
            self.counters.beats_foreign += 1;
            // From the peer's address, under the shared key, and not a reflection of this
            // host's own numbers: the other host runs the same role. Two primaries both
            // answer; two backups leave the service with none. Stop, loudly.
            if !(self.first_beat..self.beat).contains(&p.beat) && self.state == State::WaitingForPeer {
                let role = role_name(self.s.role);
                self.requests.push(Request::Fatal(format!("replica: the peer {} also runs as the {role} (an authenticated message of that role from its address): fix the role in one of the two configs", self.peer)));
            }
            return;
        }
        if self.peer_beat.is_some_and(|b| p.beat <= b) {
            self.counters.beats_stale += 1;
            return;
        }
        self.peer_beat = Some(p.beat);
        self.peer_heard_at = Some(now_ms);
        self.counters.beats_received += 1;
        match self.state {
            State::WaitingForPeer => {
                self.state = State::Protecting;
                self.det = Some(Detector::new(self.s.detector, self.s.role, now_ms));
                let line = format!("replica: the {} is there (first authenticated message from {}): protecting new connections", self.peer_role(), self.peer);
                self.log(line);
            }
            // After a failover the peer is fenced: whatever it still sends changes nothing.
            State::TookOver | State::PeerFailed | State::Yielded => return,
            State::Protecting | State::Fencing => {}
        }
        if let Some(d) = self.det.as_mut() {
            d.beat(now_ms);
        }
        if let Some(pr) = self.primary.as_mut() {
            pr.backup_progress(&p, now_ms);
            self.drain_primary();
        } else if let Some(b) = self.backup.as_mut() {
            let acks = b.primary_report(&p);
            self.counters.acks_injected += acks.len() as u64;
            self.send.extend(acks);
        }
    }

    /// The fencing command's result.
    pub fn fence_done(&mut self, ok: bool, now_ms: u64) {
        self.clock = self.clock.max(now_ms);
        let Some(d) = self.det.as_mut() else { return };
        if self.state != State::Fencing {
            return;
        }
        match d.fence_result(ok, now_ms) {
            Some(DetectorAction::TakeOver) => {
                self.state = State::TookOver;
                if let Some(b) = self.backup.as_mut() {
                    b.take_over();
                    // Its withheld output the client lacks goes out at once (Backup::take_over).
                    self.send.extend(b.take_transmit());
                }
                self.takeover_ms = self.peer_heard_at.map(|t| now_ms.saturating_sub(t));
                let n = self.connections();
                let line = format!("replica: the primary is fenced: took over {n} connection(s), {} ms after its last message", self.takeover_ms.unwrap_or(0));
                self.log(line);
                self.requests.push(Request::Announce);
            }
            Some(DetectorAction::BackupFailed) => {
                self.state = State::PeerFailed;
                if let Some(p) = self.primary.as_mut() {
                    p.backup_failed();
                }
                self.drain_primary();
                let n = self.connections();
                self.log(format!("replica: the backup is fenced: {n} connection(s) run unprotected from now on (no backup)"));
            }
            _ => {
                self.counters.fences_failed += 1;
                self.state = State::Protecting;
                self.fence_backoff_ms = (self.fence_backoff_ms * 2).clamp(FENCE_BACKOFF_MIN_MS, FENCE_BACKOFF_MAX_MS);
                self.next_fence_at = now_ms + self.fence_backoff_ms;
                let line = format!("replica: the fencing command failed ({} time(s) so far): {} not taken over; tried again after the next silence, not before {} ms", self.counters.fences_failed, if self.s.role == Role::Backup { "the primary's connections are" } else { "the backup is" }, self.fence_backoff_ms);
                self.log(line);
            }
        }
    }

    /// Forgets connections finished on both sides for longer than the grace period.
    fn sweep(&mut self, now_ms: u64) {
        if now_ms < self.next_sweep_at {
            return;
        }
        self.next_sweep_at = now_ms + 1000;
        let fin = match (&self.primary, &self.backup) {
            (Some(p), _) => p.finished(),
            (_, Some(b)) => b.finished(),
            _ => return,
        };
        let mut live: HashMap<ConnKey, u64> = HashMap::with_capacity(fin.len());
        for k in fin {
            let since = self.finished_since.get(&k).copied().unwrap_or(now_ms);
            if now_ms.saturating_sub(since) >= self.s.finished_grace_ms {
                if let Some(p) = self.primary.as_mut() {
                    p.forget(&k);
                }
                if let Some(b) = self.backup.as_mut() {
                    b.forget(&k);
                }
                self.counters.forgotten += 1;
            } else {
                live.insert(k, since);
            }
        }
        self.finished_since = live;
    }
}

impl Mode for Core {
    type Request = Request;

    fn packet(&mut self, now_ms: u64, meta: Meta, pkt: &mut [u8], len: usize, out: &mut Outbox<Request>) -> (Verdict, usize) {
        self.clock = self.clock.max(now_ms);
        let _ = out;
        let outgoing = meta.hook == HOOK_LOCAL_OUT;
        if self.state == State::Yielded {
            self.counters.yielded_dropped += 1;
            return (Verdict::Drop, len);
        }
        if self.primary.is_some() && matches!(self.state, State::WaitingForPeer) {
            self.counters.passed_unprotected += 1;
            return (Verdict::PASS, len);
        }
        // The engines check and update checksums: one the kernel left for the NIC (veth, GSO)
        // is completed first (a released copy goes out through a raw socket, with no NIC to
        // complete it).
        let mut modified = false;
        if meta.csum_not_ready && crate::daemon::fill_tcp_checksum(pkt, len) {
            self.counters.checksums_completed += 1;
            modified = true;
        }
        let v = if let Some(p) = self.primary.as_mut() {
            let v = if outgoing { p.outgoing(&mut pkt[..len], now_ms) } else { p.incoming(&pkt[..len]) };
            self.drain_primary();
            match v {
                // The engine keeps a copy and sends it when the backup has verified it.
                Verdict::Held => Verdict::Drop,
                v => v,
            }
        } else if let Some(b) = self.backup.as_mut() {
            // Its server's packets move the figures the primary waits for (ACK, window,
            // output): sent at the end of the round.
            self.dirty |= outgoing;
            let v = if outgoing { b.outgoing(&mut pkt[..len]) } else { b.incoming(&mut pkt[..len]) };
            // After a take-over: the RSTs of connections the primary found diverged.
            self.send.extend(b.take_transmit());
            v
        } else {
            Verdict::PASS
        };
        let v = match v {
            Verdict::Accept { modified: m } => Verdict::Accept { modified: m || modified },
            v => v,
        };
        (v, len)
    }

    fn tick(&mut self, now_ms: u64, out: &mut Outbox<Request>) {
        self.clock = self.clock.max(now_ms);
        let _ = out;
        if let Some(p) = self.primary.as_mut() {
            if self.state != State::WaitingForPeer && self.state != State::Yielded {
                p.tick(now_ms);
            }
            self.drain_primary();
        }
        if let Some(b) = self.backup.as_mut() {
            b.tick(now_ms);
        }
        if matches!(self.state, State::Protecting) && now_ms >= self.next_fence_at {
            if let Some(DetectorAction::RunFence) = self.det.as_mut().and_then(|d| d.tick(now_ms)) {
                self.state = State::Fencing;
                self.counters.fences_run += 1;
                let silent = self.peer_heard_at.map_or(0, |t| now_ms.saturating_sub(t));
                self.log(format!("replica: no message from the {} for {silent} ms: running the fencing command", self.peer_role()));
                self.requests.push(Request::Fence);
            }
        }
        // After a failover the peer is fenced: nothing to tell it.
        if !matches!(self.state, State::Yielded | State::TookOver | State::PeerFailed) {
            if now_ms >= self.next_beat_at {
                self.send_beat(now_ms, true);
            } else if self.dirty && self.backup.is_some() {
                self.send_beat(now_ms, false);
            }
        }
        self.sweep(now_ms);
    }

    fn wait_ms(&self) -> u64 {
        // Beats are due every interval; the engine's timers (lag, MaxDelayFIN, nudges) need
        // a few milliseconds' resolution.
        self.s.detector.interval_ms.clamp(1, 10)
    }

    fn io_event(&mut self, ev: IoEvent) -> u64 {
        match ev {
            IoEvent::VerdictFallback => {
                self.counters.verdict_fallbacks += 1;
                self.counters.verdict_fallbacks
            }
            IoEvent::InjectFailed => {
                self.counters.inject_failed += 1;
                self.counters.inject_failed
            }
            _ => 0,
        }
    }

    fn collect(&mut self, out: &mut Outbox<Request>) {
        out.send.append(&mut self.send);
        out.requests.append(&mut self.requests);
    }
}
