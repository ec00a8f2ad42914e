//! Replica mode's decisions (issue 10): the I/O-free core of `unbroken replica` on either host.
//! The engines ([`unbroken_engines::replica`]) decide each packet; this core decides everything
//! around them that the paper leaves to "the daemon": when the peer counts as present, what the
//! side channel accepts, when beats and progress go out, when the detector fences, what a
//! fence's result means, when a primary yields, when the address is announced, what to tell the
//! operator, when finished connections are forgotten. The daemon ([`crate::replica::daemon`]) only does
//! I/O: the queue, the UDP side channel, the fencing command, the ARP suppression and
//! announcement.
//!
//! States (one per host, [`State`]):
//! - `WaitingForPeer` until the first fresh authenticated message of the other role. A primary
//!   passes its traffic untouched (those connections stay unprotected: the backup's server
//!   never saw their start); a backup follows connections from their SYN but never takes over:
//!   neither detector is armed before the peer was heard (a backup started before its primary
//!   must not fence it, a primary started alone must not fence a backup that is not there yet).
//! - `Protecting`: the engines gate and translate; beats go out every interval (the backup also
//!   sends its progress as soon as a round changed it: strict output commit and the primary's
//!   ACK wait for it, ST-TCP 3.6); the detector watches the peer's messages.
//! - `Fencing`: the peer missed its beats; the fencing command runs (ST-TCP 3.2.2: a live
//!   primary and an active backup must never both answer). Traffic is handled as in
//!   `Protecting` meanwhile (a primary keeps holding unverified output). A failed fence returns
//!   to `Protecting` and is retried after the next silence, no sooner than a backoff that
//!   doubles from 100 ms to 5 s (a live but cut-off peer's fence device is not hammered).
//! - `TookOver` (backup): the primary is fenced; withheld output is released and translated from
//!   now on; the daemon removes the ARP suppression and announces the address, again and again
//!   on [`ANNOUNCE_SCHEDULE_MS`] (a link that still drops at the takeover misses one
//!   announcement). It keeps beating, flagged [`hdr::TOOK_OVER`]: a fenced primary that comes
//!   back (a port or link fence undone) hears that it lost and yields instead of suspecting
//!   this host and fencing it. A primary heard again (not passive) is fenced again, with the
//!   backoff; one silent since the fence is not.
//! - `PeerFailed` (primary): the backup is fenced; the primary runs unprotected, reported. It
//!   keeps beating, flagged [`hdr::STALE`] (the backup can no longer take over), and fences a
//!   backup heard again as the backup does.
//! - `PeerStale` (primary): the engine says the backup missed input the primary's server
//!   consumed (`Primary::backup_stale`): every connection runs unprotected on the primary, its
//!   messages carry [`hdr::STALE`]; the detector still fences a backup that dies.
//! - `Stale` (backup): the primary said [`hdr::STALE`]: this backup's server has diverged and
//!   must never take over. It never fences and never takes over, even when the primary dies
//!   later (it says so); for good.
//! - `Yielded` (primary): its own server failed on a connection where the backup's did not
//!   (ST-TCP Table 3.3 rows 2-3), or the backup said [`hdr::TOOK_OVER`]: it drops every packet
//!   of the service for good; its beats carry [`hdr::PASSIVE`] and count for nothing, so the
//!   backup's detector sees a silence, fences it and takes over (or, after a takeover, does
//!   not fence it again).
//!
//! Side-channel messages are accepted only from the configured peer address, authenticated
//! ([`unbroken_wire::replica`]), of the other role, and fresh. Freshness across restarts, after
//! the LB heartbeats ([`crate::object::hbproto`]): every process draws a random boot id and a random
//! secret ([`Boot`]); every message names its boot, numbers itself within it, carries a
//! challenge (a nonce: a MAC of the sender's clock under its secret) and echoes the latest
//! challenge of the peer it took. The receiver binds the peer to one boot and accepts from it
//! only numbers above the highest accepted (every datagram has its own, a beat's chunks too:
//! a replay, even of the newest, is stale). A message of another boot counts only once it
//! echoes a challenge of this process, at most [`echo_ttl_ms`] old and younger than any the
//! bound boot echoed: a datagram captured before either host restarted carries an echo of a
//! secret that no longer exists (counted `beats_unproven`, changes nothing). Until bound, a
//! host echoes the challenge of the latest authenticated message of another boot; once bound,
//! only its peer's. A datagram of this process's own boot (reflected) is counted
//! (`beats_reflected`) and ignored. An authenticated message of this host's own role, of
//! another boot, that echoes a fresh challenge of this process comes from a live host that
//! runs the same role: before the peer was heard the daemon stops ([`Request::Fatal`]);
//! anything short of that proof (an earlier run's own datagrams reflected) is counted and
//! ignored, never a stop.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use hmac::{Hmac, Mac};
use sha2::Sha256;
use unbroken_engines::replica::{
    Backup, Config as EngineConfig, ConnKey, Detector, DetectorAction, DetectorConfig, Notice,
    Primary, ReadWatch, Relay, RelayFrom, ServerSocket, Why,
};
use unbroken_engines::Verdict;
use unbroken_wire::ctl::Key;
use unbroken_wire::replica::{hdr, ConnProgress, Progress, Role, Session};

use crate::daemon::{IoEvent, Meta, Mode, Outbox};
use crate::ratelog::RateLimit;

mod fast;
pub use fast::*;

/// The first wait after a failed fence, and the longest.
pub const FENCE_BACKOFF_MIN_MS: u64 = 100;
pub const FENCE_BACKOFF_MAX_MS: u64 = 5_000;

/// When the backup announces the service address after its takeover, from the takeover:
/// at once, then again at these offsets (ms). A backup whose own link still drops when it wins
/// the fence, or a switch that lost the first frames, gets it within a second; a client that
/// missed every one of the first few gets one every 10 s for a minute. Twelve announcements in
/// all (two frames each): nothing that loads a segment.
pub const ANNOUNCE_SCHEDULE_MS: [u64; 12] = [0, 100, 300, 1_000, 2_000, 5_000, 10_000, 20_000, 30_000, 40_000, 50_000, 60_000];

/// How long without the peer's authenticated messages (at start or after bad datagrams)
/// before the operator is told, and how often the line repeats while it lasts.
pub const PEER_WARN_MS: u64 = 5_000;
pub const PEER_WARN_REPEAT_MS: u64 = 30_000;

/// How old an echoed challenge may be (ms) to prove a new boot live: two seconds, or four
/// beats when beats are slower.
pub fn echo_ttl_ms(interval_ms: u64) -> u64 {
    (4 * interval_ms).max(2_000)
}

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
    PeerStale,
    Stale,
    Yielded,
}

/// What the daemon must do for the core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Send this datagram to the peer's side-channel address.
    Side(Vec<u8>),
    /// Run the fencing command; report with [`Core::fence_done`].
    Fence,
    /// The backup took over: remove the ARP suppression (the first time), then announce the
    /// service address (every time: [`ANNOUNCE_SCHEDULE_MS`]).
    Announce,
    /// A line for the log (already rate-limited by the core where a packet or a datagram can
    /// cause it).
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

/// This process's identity on the side channel: both random per process start (the daemon
/// draws them from the kernel's CSPRNG).
#[derive(Clone)]
pub struct Boot {
    /// Names this run in every message (0 is not used: a zero session is none).
    pub id: u64,
    /// Keys the challenges this run issues; never leaves the process.
    pub secret: [u8; 32],
}

/// What the core counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
    pub beats_sent: u64,
    pub beats_received: u64,
    /// Messages that failed authentication or parsing.
    pub beats_bad: u64,
    /// Authenticated messages of the bound boot not newer than the newest accepted (replays).
    pub beats_stale: u64,
    /// Datagrams from an address other than the peer's, or of this host's own role.
    pub beats_foreign: u64,
    /// Datagrams of this process's own boot (reflected back at it).
    pub beats_reflected: u64,
    /// Authenticated messages of a peer whose `strict` setting differs from this host's.
    pub beats_mismatched: u64,
    /// Authenticated messages of another boot that did not echo a fresh challenge of this
    /// process (a replay of an earlier run, or a restarted peer before its proof).
    pub beats_unproven: u64,
    /// The peer bound to a new boot after it proved itself (it restarted).
    pub peer_restarts: u64,
    /// Messages that could not be built (never expected; counted, not sent).
    pub beats_unsent: u64,
    pub fences_run: u64,
    pub fences_failed: u64,
    /// Fences run after a failover because the fenced peer was heard again.
    pub refences: u64,
    /// Announcements of the service address requested after a takeover.
    pub announces: u64,
    /// Packets passed untouched because the peer was not there yet (primary) or had failed.
    pub passed_unprotected: u64,
    /// Packets dropped by a primary that yielded.
    pub yielded_dropped: u64,
    /// Yields not done because the backup was not heard within a detector window (or is
    /// stale).
    pub yields_refused: u64,
    /// Connections that became unprotected (engine notices), and those by divergence.
    pub unprotected: u64,
    pub diverged: u64,
    /// Client ACKs relayed into the backup's own stack.
    pub acks_injected: u64,
    /// Input messages (client bytes the backup missed) sent by the primary, and injected into
    /// its server by the backup.
    pub input_sent: u64,
    pub input_injected: u64,
    /// Finished connections forgotten after their grace period.
    pub forgotten: u64,
    /// Packets whose checksum was left for the NIC (GSO/veth): completed before the engine.
    pub checksums_completed: u64,
    /// Verdict I/O events (the daemon's): fallbacks, failed injections.
    pub verdict_fallbacks: u64,
    pub inject_failed: u64,
    /// Log lines the core's rate limiter suppressed.
    pub log_suppressed: u64,
    /// The longest gap between two ticks of the packet loop (ms), and the gaps longer than a
    /// beat interval: beats are sent from the loop, so a late tick is a late beat.
    pub tick_gap_max_ms: u64,
    pub tick_gaps_over_interval: u64,
}

/// The peer this process accepts messages from: one boot, its newest number, the newest of
/// this process's challenges it echoed.
#[derive(Debug, Clone, Copy)]
struct Binding {
    boot: u64,
    beat: u64,
    echo_t: u64,
}

/// Where a successful fence leaves the fenced peer after a failover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FenceRun {
    /// No fencing command running.
    Idle,
    /// The detector's fence (state `Fencing`).
    Detector,
    /// After a failover: the fenced peer was heard again.
    Again,
}

/// The I/O-free core of one replica host.
pub struct Core {
    s: Settings,
    key: Key,
    peer: SocketAddr,
    boot: Boot,
    state: State,
    primary: Option<Primary>,
    backup: Option<Backup>,
    det: Option<Detector>,
    /// This host's message counter within its boot (from 1).
    beat: u64,
    next_beat_at: u64,
    /// The backup's progress changed in this round: send it without waiting for the beat.
    dirty: bool,
    /// The peer's boot this process accepts.
    bound: Option<Binding>,
    /// The peer's challenge echoed in every message (time, nonce); (0, 0): none yet.
    echo: (u64, u64),
    /// This process's latest challenge (time, nonce), computed at most once a millisecond.
    nonce: (u64, u64),
    /// When the peer's latest active message (not passive) was accepted (monotonic ms).
    pub peer_heard_at: Option<u64>,
    /// Backup: from the primary's last message to the takeover.
    pub takeover_ms: Option<u64>,
    /// Why the backup can no longer take over (primary: `peer_stale` / `peer_failed`; backup:
    /// `stale`).
    stale_why: Option<&'static str>,
    /// Which fence runs, if any.
    fence: FenceRun,
    /// A stale backup said that the primary is silent (once per silence).
    stale_silence_said: bool,
    finished_since: HashMap<ConnKey, u64>,
    next_sweep_at: u64,
    /// After a failed fence, the next may run no sooner than this (backoff doubling from
    /// [`FENCE_BACKOFF_MIN_MS`] to [`FENCE_BACKOFF_MAX_MS`]): a peer that is alive but cut off, or
    /// a fence device that refuses, is not hammered every few beats.
    fence_backoff_ms: u64,
    next_fence_at: u64,
    /// The takeover's time and the next announcement's place in [`ANNOUNCE_SCHEDULE_MS`].
    took_over_at: u64,
    announce_next: usize,
    /// The peer diagnosis: counters at the last look, the problem seen, when it was said.
    diag_at: u64,
    diag_seen: Counters,
    peer_problem: Option<&'static str>,
    peer_problem_said_at: Option<u64>,
    started_at: u64,
    last_tick: Option<u64>,
    /// This host's server: whether it reads ([`Core::server_sample`]); backup: hung (its
    /// messages say so, [`hdr::HUNG`]) and when that was logged.
    watch: ReadWatch,
    hung: bool,
    limit: RateLimit,
    requests: Vec<Request>,
    send: Vec<Vec<u8>>,
    /// The latest time passed in.
    clock: u64,
    pub counters: Counters,
    /// Connections that became unprotected, by reason (as the engine names it).
    pub unprotected_by: HashMap<&'static str, u64>,
    /// The backup's fast path (off unless the daemon enables it).
    fast: FastPart,
}

/// How a role is named in configs, status files and logs.
pub fn role_name(r: Role) -> &'static str {
    match r {
        Role::Primary => "primary",
        Role::Backup => "backup",
    }
}

/// How the status file and the logs name an engine's reason.
pub fn why_name(w: Why) -> &'static str {
    match w {
        Why::BackupFailed => "backup_failed",
        Why::BackupLagging => "backup_lagging",
        Why::BackupFinAlone => "backup_fin_alone",
        Why::BackupClosedEarly => "backup_closed_early",
        Why::PrimaryClosedEarly => "primary_closed_early",
        Why::BackupRst => "backup_rst",
        Why::FinTimeout => "fin_timeout",
        Why::Diverged => "diverged",
        Why::HeldTotal => "held_total",
        Why::BackupMisaligned => "backup_misaligned",
        Why::PrimaryFailed => "primary_failed",
        Why::BackupStale => "backup_stale",
        Why::BackupRestarted => "backup_restarted",
        Why::BackupHung => "backup_hung",
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

/// Whether the backup can no longer take over, as the primary engine says (issue 20 item 5).
fn engine_backup_stale(p: &Primary) -> Option<Why> {
    p.backup_stale()
}

impl Core {
    /// A core for `settings.role`, talking to `peer` under `key` as the process `boot`;
    /// `now_ms` is the monotonic clock.
    pub fn new(settings: Settings, key: Key, peer: SocketAddr, boot: Boot, now_ms: u64) -> Core {
        let (primary, backup) = match settings.role {
            Role::Primary => (Some(Primary::new(settings.engine)), None),
            Role::Backup => (None, Some({
                let mut b = Backup::with_capacity(settings.engine.max_conns);
                b.set_strict(settings.engine.strict);
                b
            })),
        };
        Core {
            s: settings,
            key,
            peer,
            boot: Boot { id: boot.id.max(1), secret: boot.secret },
            state: State::WaitingForPeer,
            primary,
            backup,
            det: None,
            beat: 1,
            next_beat_at: now_ms,
            dirty: false,
            bound: None,
            echo: (0, 0),
            nonce: (0, 0),
            peer_heard_at: None,
            takeover_ms: None,
            stale_why: None,
            fence: FenceRun::Idle,
            stale_silence_said: false,
            finished_since: HashMap::new(),
            next_sweep_at: now_ms + 1000,
            watch: ReadWatch::default(),
            hung: false,
            fence_backoff_ms: 0,
            next_fence_at: 0,
            took_over_at: 0,
            announce_next: ANNOUNCE_SCHEDULE_MS.len(),
            diag_at: now_ms + 1000,
            diag_seen: Counters::default(),
            peer_problem: None,
            peer_problem_said_at: None,
            started_at: now_ms,
            last_tick: None,
            limit: RateLimit::default(),
            requests: Vec::new(),
            send: Vec::new(),
            clock: now_ms,
            counters: Counters::default(),
            unprotected_by: HashMap::new(),
            fast: FastPart::default(),
        }
    }

    pub fn state(&self) -> State {
        self.state
    }

    pub fn role(&self) -> Role {
        self.s.role
    }

    /// This process's boot id.
    pub fn boot_id(&self) -> u64 {
        self.boot.id
    }

    /// The peer's boot this process accepts messages from (None: not bound yet).
    pub fn peer_boot(&self) -> Option<u64> {
        self.bound.map(|b| b.boot)
    }

    /// Why the backup can no longer take over: the engine's reason on the primary
    /// (`PeerStale`, `PeerFailed`), "primary_says_stale" on a `Stale` backup.
    pub fn stale_why(&self) -> Option<&'static str> {
        self.stale_why
    }

    /// What keeps the peer from being heard, while it lasts: `bad_datagrams` (they fail
    /// authentication: another key or version), `same_role`, `unproven` (authenticated but not
    /// fresh: replays, or a peer that does not echo this host's challenge), `no_peer` (nothing
    /// at all for [`PEER_WARN_MS`] since the start).
    pub fn peer_problem(&self) -> Option<&'static str> {
        self.peer_problem
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

    /// A line of a state change (a few in a daemon's life): always written.
    fn log(&mut self, line: String) {
        self.requests.push(Request::Log(line));
    }

    /// The daemon's sample of this host's server (every few tens of ms): its sockets on the
    /// service ports and its processes' CPU time. The primary's engine compares a stall with
    /// the backup's progress; the backup says in its messages that its server is hung (it has
    /// read and computed nothing while input waited, for the hang bound).
    pub fn server_sample(&mut self, now_ms: u64, socks: &[ServerSocket], cpu: Option<u64>) {
        self.clock = self.clock.max(now_ms);
        let since = self.watch.sample(now_ms, socks, cpu);
        if let Some(p) = self.primary.as_mut() {
            p.server_reading(since, self.watch.waiting());
            return;
        }
        let bound = self.s.engine.max_hang_ms;
        let hung = bound > 0 && since.is_some_and(|t| now_ms >= t + bound);
        if hung != self.hung {
            self.hung = hung;
            self.dirty = true;
            let line = if hung {
                format!("replica: this host's server has read none of its waiting input and used no CPU for {bound} ms: hung; the primary stops waiting for it (this backup goes stale when the primary's server went on)")
            } else {
                "replica: this host's server reads again".to_string()
            };
            self.log_limited("hung", || line);
        }
    }

    /// The daemon could not sample its server (sock_diag failed): no verdict, so none stands
    /// (a stall seen before must not grow into a hang while nobody looks).
    pub fn server_sample_failed(&mut self) {
        self.watch = ReadWatch::default();
        if let Some(p) = self.primary.as_mut() {
            p.server_reading(None, &Default::default());
        } else if self.hung {
            self.hung = false;
            self.dirty = true;
        }
    }

    /// Backup: its server is hung (its messages say so).
    pub fn server_hung(&self) -> bool {
        self.hung
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

    /// A line a packet or a datagram can cause: at most [`crate::ratelog::BURST`] of `kind`
    /// per [`crate::ratelog::INTERVAL_MS`]; `line` is built only when written.
    fn log_limited(&mut self, kind: &'static str, line: impl FnOnce() -> String) {
        match self.limit.check(kind, self.clock) {
            Some(0) => self.requests.push(Request::Log(line())),
            Some(n) => self.requests.push(Request::Log(format!("{} ({n} more like it suppressed)", line()))),
            None => self.counters.log_suppressed += 1,
        }
    }

    // ------------------------------------------------------------------------------------
    // Freshness (boot, challenge, echo)

    fn challenge_at(&self, t: u64) -> u64 {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.boot.secret).expect("HMAC takes any key length");
        m.update(b"unbroken replica challenge\0");
        m.update(&self.boot.id.to_be_bytes());
        m.update(&t.to_be_bytes());
        let d = m.finalize().into_bytes();
        u64::from_be_bytes(d[..8].try_into().expect("8 bytes"))
    }

    /// This process's current challenge (time above 0).
    fn nonce(&mut self) -> (u64, u64) {
        let t = self.clock + 1;
        if self.nonce.0 != t {
            self.nonce = (t, self.challenge_at(t));
        }
        self.nonce
    }

    /// Whether `s` echoes a challenge this process issued at most [`echo_ttl_ms`] ago.
    fn echo_fresh(&self, s: &Session) -> bool {
        s.echo_t != 0 && s.echo_t <= self.clock + 1 && self.clock + 1 - s.echo_t <= echo_ttl_ms(self.s.detector.interval_ms) && s.echo == self.challenge_at(s.echo_t)
    }

    fn session(&mut self) -> Session {
        let (nonce_t, nonce) = self.nonce();
        Session { boot: self.boot.id, nonce_t, nonce, echo_t: self.echo.0, echo: self.echo.1 }
    }

    // ------------------------------------------------------------------------------------

    /// The primary engine's packets to send and notices, and whether it finds the backup
    /// stale.
    fn drain_primary(&mut self) {
        let Some(p) = self.primary.as_mut() else { return };
        self.send.extend(p.take_transmit());
        // Duplicate ACKs in the client's name for this host's own server (to the service
        // address, which is local: the raw sender delivers them to it).
        self.send.extend(p.take_inject());
        let relay = p.take_relay();
        let stale = engine_backup_stale(p);
        for n in p.take_notices() {
            match n {
                Notice::Unprotected { key, why } => {
                    // The programs never carry it again: it leaves the map once decided.
                    self.fast_never_again(key);
                    self.counters.unprotected += 1;
                    if why == Why::Diverged {
                        self.counters.diverged += 1;
                    }
                    *self.unprotected_by.entry(why_name(why)).or_default() += 1;
                    if why != Why::BackupFailed && self.stale_why.is_none() {
                        self.log_limited("replica: unprotected", || format!("replica: {} runs unprotected from now on: {}", key_text(&key), why_name(why)));
                    }
                }
                Notice::YieldToBackup { key } => {
                    // Only to a backup that is there and can take over: one silent for a
                    // detector window (dead, or being fenced) or stale would never take over,
                    // and a yielded primary drops everything: an outage for every client. That
                    // connection stays held until the backup is heard again or declared failed
                    // (then it goes out alone).
                    let window = self.s.detector.interval_ms * self.s.detector.misses as u64;
                    let backup_alive = self.state == State::Protecting && self.peer_heard_at.is_some_and(|t| self.clock.saturating_sub(t) <= window);
                    if !backup_alive {
                        self.counters.yields_refused += 1;
                        if let Some(p) = self.primary.as_mut() {
                            // Asked again at the next evidence (the backup may be heard again).
                            p.yield_refused();
                        }
                        let why = if self.stale_why.is_some() { "is stale" } else { "is not heard" };
                        self.log_limited("replica: yield refused", || format!("replica: the primary's server failed on {} but the backup {why}: not yielding", yield_text(&key)));
                        continue;
                    }
                    if self.state != State::Yielded {
                        self.state = State::Yielded;
                        let line = format!("replica: the primary's server failed on {} where the backup's did not: yielding (the service's packets dropped, beats marked passive) so that the backup fences this host and takes over", yield_text(&key));
                        self.log(line);
                    }
                }
                // Said (once) by `backup_stale` below.
                Notice::BackupStale { .. } => {}
            }
        }
        if let Some(why) = stale {
            self.backup_stale(why);
        }
        // Client bytes the backup missed (ST-TCP 3.6): input messages, each its own number.
        self.send_input(relay.into_iter().map(|(k, seq, d)| (k, seq, d, None)));
    }

    /// Input messages, each its own number: client bytes one host relays to the other. The
    /// one record names the connection and the first byte; from the backup it also carries
    /// what it knows of the client ([`ConnProgress::input`]).
    fn send_input(&mut self, relay: impl IntoIterator<Item = Relay>) {
        for (key, seq, data, from) in relay {
            let f = from.unwrap_or_default();
            let rec = ConnProgress::input(key.client, key.client_port, key.server_port, seq, f.ts, f.window);
            let m = Progress { role: self.s.role, beat: self.beat, flags: self.flags(), records: vec![rec] };
            self.beat += 1;
            let session = self.session();
            match m.emit_input(&session, &data, &self.key) {
                Ok(d) => {
                    self.counters.input_sent += 1;
                    self.requests.push(Request::Side(d));
                }
                Err(_) => self.counters.beats_unsent += 1,
            }
        }
    }

    /// The primary engine says the backup missed input the primary's server consumed: the
    /// backup can no longer take over (every connection runs unprotected on the primary).
    /// Said once; from now on every message carries [`hdr::STALE`]. (The engine's answer comes
    /// through here; tests call it directly.)
    pub fn backup_stale(&mut self, why: Why) {
        if self.primary.is_none() || self.stale_why.is_some() {
            return;
        }
        self.stale_why = Some(why_name(why));
        if self.state == State::Protecting {
            self.state = State::PeerStale;
        }
        let line = format!("replica: the backup can no longer take over ({}: it missed input this host's server consumed): every connection runs unprotected here; restart the backup's server and daemon to protect new connections again", why_name(why));
        self.log(line);
    }

    /// The flags of this host's messages in its current state.
    fn flags(&self) -> u8 {
        let relaxed = if self.s.engine.strict { 0 } else { hdr::RELAXED };
        relaxed
            | match self.state {
                State::TookOver => hdr::TOOK_OVER,
                State::Yielded | State::Stale => hdr::PASSIVE,
                _ if self.primary.is_some() && self.stale_why.is_some() => hdr::STALE,
                _ if self.backup.is_some() && self.hung => hdr::HUNG,
                _ => 0,
            }
    }

    /// Sends this host's progress now: a beat (`full`: every connection), or the backup's
    /// connections a packet touched since its last message. After a failover, in `Stale` or
    /// `Yielded`, beats carry no records (nothing the peer could use), only the flags.
    fn send_beat(&mut self, now_ms: u64, full: bool) {
        let flags = self.flags();
        let role = self.s.role;
        let records = !matches!(self.state, State::TookOver | State::PeerFailed | State::Yielded | State::Stale);
        if records && (full || self.primary.is_some()) {
            self.fast_refresh(now_ms);
        }
        let msgs = match (&self.primary, &mut self.backup) {
            _ if !records => vec![Progress { role, beat: 0, flags: 0, records: vec![] }],
            (Some(p), _) => p.report(self.beat),
            (_, Some(b)) if full => b.progress(self.beat),
            (_, Some(b)) => b.progress_changed(self.beat),
            _ => return,
        };
        let session = self.session();
        // Every datagram its own number (a beat's chunks too), so a receiver accepts each at
        // most once: a replayed datagram, even the newest, is stale.
        for mut m in msgs {
            m.beat = self.beat;
            m.flags = flags;
            self.beat += 1;
            match m.emit_session(&session, &self.key) {
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
        let (p, s, input) = match Progress::parse_message(dgram, &self.key) {
            Ok(x) => x,
            Err(_) => {
                self.counters.beats_bad += 1;
                return;
            }
        };
        if s.boot == self.boot.id {
            // This process's own datagram, reflected: it says nothing about the peer.
            self.counters.beats_reflected += 1;
            return;
        }
        let proven = self.echo_fresh(&s);
        if p.role == self.s.role {
            self.counters.beats_foreign += 1;
            if self.bound.is_none() {
                // A live host of the same role can prove itself only by echoing ours.
                self.echo = (s.nonce_t, s.nonce);
            }
            if !proven {
                // An earlier run's own datagram reflected, or a replay: ignored.
                return;
            }
            // A live host at the peer's address, under the shared key, that answered this
            // process's challenge, runs the same role. Two primaries both answer; two backups
            // leave the service with none. Stop, loudly (before the peer was heard; after, the
            // daemon keeps what it has and says so).
            let role = role_name(self.s.role);
            let line = format!("replica: the peer {} also runs as the {role} (an authenticated, fresh message of that role from its address): fix the role in one of the two configs", self.peer);
            if self.state == State::WaitingForPeer {
                self.requests.push(Request::Fatal(line));
            } else {
                self.log_limited("replica: same role", || line);
            }
            return;
        }
        match self.bound {
            Some(b) if b.boot == s.boot => {
                if p.beat <= b.beat {
                    self.counters.beats_stale += 1;
                    return;
                }
                let echo_t = if proven { s.echo_t.max(b.echo_t) } else { b.echo_t };
                self.bound = Some(Binding { boot: b.boot, beat: p.beat, echo_t });
            }
            bound => {
                if !proven || bound.is_some_and(|b| s.echo_t <= b.echo_t) {
                    self.counters.beats_unproven += 1;
                    if bound.is_none() {
                        self.echo = (s.nonce_t, s.nonce);
                    }
                    return;
                }
                if let Some(b) = bound {
                    self.counters.peer_restarts += 1;
                    let line = format!("replica: the {} restarted (boot {:016x}, was {:016x}): its messages count from now on", self.peer_role(), s.boot, b.boot);
                    self.log(line);
                    // A restarted backup daemon lost every connection's state (alignment, what
                    // its server received and produced): it can no longer take over any of
                    // them. At once, rather than after the lag bound with the output held.
                    if let Some(pr) = self.primary.as_mut() {
                        pr.backup_restarted();
                        self.drain_primary();
                    } else if matches!(self.state, State::Protecting | State::Fencing) {
                        // A restarted primary daemon no longer follows the connections its
                        // predecessor did (it passes them unprotected: their input is no longer
                        // held for this backup): this backup can take none of them over.
                        self.state = State::Stale;
                        self.stale_why = Some("primary_restarted");
                        self.log("replica: the primary's daemon restarted: the connections it followed are no longer protected, so this backup is stale for good, it never fences the primary nor takes over; restart this host's server and daemon to protect new connections again".to_string());
                    }
                }
                self.bound = Some(Binding { boot: s.boot, beat: p.beat, echo_t: s.echo_t });
            }
        }
        self.echo = (s.nonce_t, s.nonce);
        if (p.flags & hdr::RELAXED == 0) != self.s.engine.strict {
            // The two hosts disagree on strict output commit: a relaxed backup digests nothing
            // for a strict primary (which would find every connection diverged), a strict
            // backup's primary would not wait for it. Neither pairs with the other. Only a
            // fresh message gets here (a replay of an earlier run proves nothing), and a boot's
            // setting never changes, so it is a new boot: before the pair formed, stop, loudly.
            // After it (the peer restarted with another config): the restart's steps ran above
            // (this backup stale, or the backup's connections unprotected), its messages count
            // for nothing else (not even liveness), and the echo above lets the restarted host
            // prove this one and stop in turn; a fenced peer heard again is fenced again.
            self.counters.beats_mismatched += 1;
            let (mine, theirs) = (self.s.engine.strict, p.flags & hdr::RELAXED == 0);
            let line = format!("replica: the {} at {} runs with strict = {theirs}, this host with strict = {mine}: set the same `strict` in both configs", self.peer_role(), self.peer);
            if self.state == State::WaitingForPeer {
                self.requests.push(Request::Fatal(line));
            } else {
                self.log_limited("replica: strict mismatch", || line);
                if matches!(self.state, State::TookOver | State::PeerFailed) && p.flags & hdr::PASSIVE == 0 {
                    self.fence_again(now_ms);
                }
            }
            return;
        }
        self.counters.beats_received += 1;
        if p.flags & hdr::INPUT != 0 {
            // An authenticated, fresh message of the peer: it is alive.
            if p.flags & hdr::PASSIVE == 0 && matches!(self.state, State::Protecting | State::Fencing) {
                self.peer_heard_at = Some(now_ms);
                if let Some(d) = self.det.as_mut() {
                    d.beat(now_ms);
                }
            }
            // Client bytes this primary's host missed, from the backup (loss toward the
            // primary): into this host's server, as the client would have sent them.
            if let (Role::Backup, true, Some(r)) = (p.role, self.state == State::Protecting, p.records.first()) {
                let key = ConnKey { client: r.client, client_port: r.client_port, server_port: r.server_port };
                // Built from the client's latest figures: the programs' if they own it.
                self.fast_before_message(std::iter::once(key), now_ms);
                if self.primary.as_mut().is_some_and(|pe| pe.backup_input(&key, r.rcv_nxt, &input, {
                    let (ts, window) = r.input_client();
                    RelayFrom { ts, window }
                })) {
                    self.counters.input_injected += 1;
                }
                self.drain_primary();
                self.fast_after_message(now_ms);
                return;
            }
            // Client bytes the backup missed, from the primary: into the backup's server, as
            // the client would have sent them. Nothing else in such a message counts (its one
            // record names the connection, not its figures).
            if let (true, true, Some(r)) = (self.backup.is_some(), matches!(self.state, State::Protecting | State::Fencing), p.records.first()) {
                let key = ConnKey { client: r.client, client_port: r.client_port, server_port: r.server_port };
                // Built from the connection's latest figures: the programs' if they own it.
                self.fast_before_message(std::iter::once(key), now_ms);
                if let Some(pkt) = self.backup.as_mut().and_then(|b| b.relayed_input(&key, r.rcv_nxt, &input)) {
                    self.counters.input_injected += 1;
                    self.send.push(pkt);
                }
                self.fast_after_message(now_ms);
            }
            return;
        }
        self.accepted(now_ms, &p);
    }

    /// A fresh authenticated message of the peer.
    fn accepted(&mut self, now_ms: u64, p: &Progress) {
        // A passive primary (yielded) is no sign of a primary that serves: the backup's
        // detector must see a silence and fence it. A passive backup (stale) still vouches for
        // itself: the primary need not fence a backup that will never take over.
        let passive = p.flags & hdr::PASSIVE != 0 && p.role == Role::Primary;
        if !passive {
            self.peer_heard_at = Some(now_ms);
        } else if self.s.role == Role::Backup && self.state == State::Protecting && now_ms >= self.next_fence_at {
            // The primary says it yielded (its server failed): fence it now rather than after a
            // detector window of silence.
            if let Some(DetectorAction::RunFence) = self.det.as_mut().and_then(|d| d.peer_yielded()) {
                self.state = State::Fencing;
                self.fence = FenceRun::Detector;
                self.counters.fences_run += 1;
                self.log(format!("replica: the {} says it yielded: running the fencing command", self.peer_role()));
                self.requests.push(Request::Fence);
            }
        }
        self.stale_silence_said = false;
        if self.state == State::WaitingForPeer {
            self.state = State::Protecting;
            self.det = Some(Detector::new(self.s.detector, self.s.role, now_ms));
            let line = format!("replica: the {} is there (first authenticated message from {}): protecting new connections", self.peer_role(), self.peer);
            self.log(line);
        }
        if let (Some(pe), Role::Backup) = (self.primary.as_mut(), p.role) {
            pe.backup_hung(p.flags & hdr::HUNG != 0);
        }
        if self.s.role == Role::Primary
            && p.flags & hdr::TOOK_OVER != 0
            && self.state != State::Yielded
        {
            // The backup fenced this host and serves the clients: whatever this host believed
            // (its fence failed, it was cut off, it fenced the backup too), it never sends on
            // the service again.
            let was = self.state;
            self.state = State::Yielded;
            self.log(format!("replica: the backup at {} says it took over (this host was {was:?}): yielded for good, the service's packets are dropped; restart both daemons to reintegrate this host", self.peer));
            return;
        }
        if self.s.role == Role::Backup && p.flags & hdr::STALE != 0 && matches!(self.state, State::Protecting | State::Fencing) {
            self.state = State::Stale;
            self.stale_why = Some("primary_says_stale");
            self.log(format!("replica: the primary at {} says this backup missed input its server consumed: this backup is stale for good, it never fences the primary nor takes over; restart this host's server and daemon to protect new connections again", self.peer));
        }
        match self.state {
            State::TookOver | State::PeerFailed => {
                // Fenced, yet heard: the fence did not hold (a port or link back up). Fenced
                // again unless it says it stopped acting.
                if p.flags & hdr::PASSIVE == 0 {
                    self.fence_again(now_ms);
                }
                return;
            }
            State::Yielded => return,
            State::Stale => {
                if let Some(d) = self.det.as_mut() {
                    d.beat(now_ms);
                }
                return;
            }
            State::WaitingForPeer | State::Protecting | State::Fencing | State::PeerStale => {}
        }
        if !passive {
            if let Some(d) = self.det.as_mut() {
                d.beat(now_ms);
            }
        }
        if self.primary.is_some() {
            // The report moves what the programs read (the backup's RCV.NXT and window edge,
            // its alignment): written into their entries in place where that is all it does;
            // a record that may release, answer or unprotect takes its connection first (given
            // back after).
            let applied = self.fast_before_report(&p.records, now_ms);
            if let Some(pr) = self.primary.as_mut() {
                pr.backup_progress(p, now_ms);
            }
            self.fast_after_report(applied, now_ms);
            self.drain_primary();
            self.fast_after_message(now_ms);
        } else if self.backup.is_some() {
            // The report moves what the programs keep (p_out, last_ack, acked_b): the
            // connections it names are taken from them first and given back after.
            self.fast_before_message(p.records.iter().map(|r| ConnKey { client: r.client, client_port: r.client_port, server_port: r.server_port }), now_ms);
            let mut relay = vec![];
            if let Some(b) = self.backup.as_mut() {
                let acks = b.primary_report(p);
                self.counters.acks_injected += acks.len() as u64;
                self.send.extend(acks);
                relay = b.take_relay();
            }
            self.fast_after_message(now_ms);
            // Client bytes the primary's host missed (loss toward it).
            self.send_input(relay);
        }
    }

    /// After a failover: the fenced peer is heard again; fence it again, no sooner than the
    /// backoff (a fence that does not hold is not hammered every beat).
    fn fence_again(&mut self, now_ms: u64) {
        if self.fence != FenceRun::Idle || now_ms < self.next_fence_at {
            return;
        }
        self.fence = FenceRun::Again;
        self.counters.refences += 1;
        self.counters.fences_run += 1;
        self.fence_backoff_ms = (self.fence_backoff_ms * 2).clamp(FENCE_BACKOFF_MIN_MS, FENCE_BACKOFF_MAX_MS);
        self.next_fence_at = now_ms + self.fence_backoff_ms;
        let role = self.peer_role();
        self.log_limited("replica: fence again", || format!("replica: the fenced {role} is heard again (its fence did not hold): running the fencing command again"));
        self.requests.push(Request::Fence);
    }

    /// The fencing command's result.
    pub fn fence_done(&mut self, ok: bool, now_ms: u64) {
        self.clock = self.clock.max(now_ms);
        let run = std::mem::replace(&mut self.fence, FenceRun::Idle);
        match run {
            FenceRun::Idle => return,
            FenceRun::Again => {
                if !ok {
                    self.counters.fences_failed += 1;
                }
                let role = self.peer_role();
                self.log_limited("replica: fence again", || format!("replica: fencing the {role} again {}", if ok { "succeeded" } else { "failed (tried again when it is heard again, after the backoff)" }));
                return;
            }
            FenceRun::Detector => {}
        }
        if self.state != State::Fencing {
            let line = match self.state {
                State::Stale if ok => "replica: the primary is fenced but this backup is stale: it does not take over (the service is down until an operator restarts it)".to_string(),
                st => format!("replica: the fencing command finished ({}) after this host became {st:?}: nothing taken over", if ok { "ok" } else { "failed" }),
            };
            self.log(line);
            if let Some(d) = self.det.as_mut() {
                let _ = d.fence_result(false, now_ms);
            }
            return;
        }
        let Some(d) = self.det.as_mut() else { return };
        match d.fence_result(ok, now_ms) {
            Some(DetectorAction::TakeOver) => {
                self.state = State::TookOver;
                // The fast path first: every connection's fields back in the engine, the
                // programs passing the server's packets to the queue again.
                self.fast_take_over(now_ms);
                if let Some(b) = self.backup.as_mut() {
                    b.take_over();
                    // Its withheld output the client lacks goes out at once (Backup::take_over).
                    self.send.extend(b.take_transmit());
                }
                self.takeover_ms = self.peer_heard_at.map(|t| now_ms.saturating_sub(t));
                let n = self.connections();
                let line = format!("replica: the primary is fenced: took over {n} connection(s), {} ms after its last message; announcing the address now and {} more times within a minute", self.takeover_ms.unwrap_or(0), ANNOUNCE_SCHEDULE_MS.len() - 1);
                self.log(line);
                self.took_over_at = now_ms;
                self.announce_next = 0;
                self.announce(now_ms);
                self.after_failover(now_ms);
            }
            Some(DetectorAction::BackupFailed) => {
                self.state = State::PeerFailed;
                self.stale_why = Some(why_name(Why::BackupFailed));
                if let Some(p) = self.primary.as_mut() {
                    p.backup_failed();
                }
                self.drain_primary();
                let n = self.connections();
                self.log(format!("replica: the backup is fenced: {n} connection(s) run unprotected from now on (no backup)"));
                self.after_failover(now_ms);
            }
            _ => {
                self.counters.fences_failed += 1;
                self.state = if self.stale_why.is_some() && self.primary.is_some() { State::PeerStale } else { State::Protecting };
                self.fence_backoff_ms = (self.fence_backoff_ms * 2).clamp(FENCE_BACKOFF_MIN_MS, FENCE_BACKOFF_MAX_MS);
                self.next_fence_at = now_ms + self.fence_backoff_ms;
                let line = format!("replica: the fencing command failed ({} time(s) so far): {} not taken over; tried again after the next silence, not before {} ms", self.counters.fences_failed, if self.s.role == Role::Backup { "the primary's connections are" } else { "the backup is" }, self.fence_backoff_ms);
                self.log(line);
            }
        }
    }

    /// A successful fence: beats go on at once (the fenced peer, if it comes back, hears
    /// that it lost), and a fence again waits for the peer to be heard.
    fn after_failover(&mut self, now_ms: u64) {
        self.fence_backoff_ms = 0;
        self.next_fence_at = now_ms;
        self.next_beat_at = now_ms;
    }

    /// The announcements due by `now_ms`.
    fn announce(&mut self, now_ms: u64) {
        while self.announce_next < ANNOUNCE_SCHEDULE_MS.len() && now_ms >= self.took_over_at + ANNOUNCE_SCHEDULE_MS[self.announce_next] {
            self.announce_next += 1;
            // Several due at once (a late tick): one announcement does for all of them.
            if self.announce_next == ANNOUNCE_SCHEDULE_MS.len() || now_ms < self.took_over_at + ANNOUNCE_SCHEDULE_MS[self.announce_next] {
                self.counters.announces += 1;
                self.requests.push(Request::Announce);
            }
        }
    }

    /// The side channel's health, once a second: what keeps the peer from being heard, told
    /// when it appears and every [`PEER_WARN_REPEAT_MS`] while it lasts.
    fn diagnose(&mut self, now_ms: u64) {
        if now_ms < self.diag_at {
            return;
        }
        self.diag_at = now_ms + 1000;
        let (c, o) = (self.counters, std::mem::replace(&mut self.diag_seen, self.counters));
        let silent = self.state == State::WaitingForPeer || self.peer_heard_at.is_none_or(|t| now_ms.saturating_sub(t) >= 1000);
        let problem = if c.beats_received > o.beats_received || !silent {
            None
        } else if c.beats_bad > o.beats_bad {
            Some("bad_datagrams")
        } else if c.beats_foreign > o.beats_foreign {
            Some("same_role")
        } else if c.beats_unproven > o.beats_unproven || c.beats_reflected > o.beats_reflected {
            Some("unproven")
        } else if self.state == State::WaitingForPeer && now_ms.saturating_sub(self.started_at) >= PEER_WARN_MS {
            Some("no_peer")
        } else {
            None
        };
        let changed = problem != self.peer_problem;
        self.peer_problem = problem;
        let Some(what) = problem else {
            self.peer_problem_said_at = None;
            return;
        };
        if !changed && self.peer_problem_said_at.is_some_and(|t| now_ms.saturating_sub(t) < PEER_WARN_REPEAT_MS) {
            return;
        }
        self.peer_problem_said_at = Some(now_ms);
        let (peer, role) = (self.peer, self.peer_role());
        let unprotected = if self.primary.is_some() && self.state == State::WaitingForPeer { ": new connections run unprotected meanwhile" } else { "" };
        let line = match what {
            "bad_datagrams" => format!("replica: datagrams from {peer} fail authentication ({} so far): replica.key differs between the hosts, or they run different versions of unbroken{unprotected}", c.beats_bad),
            "same_role" => format!("replica: datagrams from {peer} are of this host's own role ({role} expected): check replica.role on both hosts{unprotected}"),
            "unproven" => format!("replica: authenticated datagrams from {peer} are not fresh ({} so far: replays of an earlier run, reflections, or a peer that does not echo this host's challenge){unprotected}", c.beats_unproven + c.beats_reflected),
            _ => format!("replica: no authenticated message from the {role} at {peer} for {} s since the start: check replica.peer on this host, replica.listen on the other, that its daemon runs, and the firewall{unprotected}", now_ms.saturating_sub(self.started_at) / 1000),
        };
        self.log_limited("replica: peer", || line);
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
                self.fast_forget(k, now_ms);
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
        // The fast path: a packet the programs decided is never decided again, and a
        // connection they carry is taken from them first.
        if let Some(v) = self.fast_before_packet(&meta, &pkt[..len], outgoing, now_ms) {
            return (v, len);
        }
        // The engines check and update checksums: one the kernel left for the NIC (veth, GSO)
        // is completed first (a released copy goes out through a raw socket, with no NIC to
        // complete it).
        let mut modified = false;
        if meta.csum_not_ready && unbroken_wire::ip::fill_tcp_checksum(pkt, len) {
            self.counters.checksums_completed += 1;
            modified = true;
        }
        let v = if let Some(p) = self.primary.as_mut() {
            let v = if outgoing { p.outgoing(&mut pkt[..len], now_ms) } else { p.incoming(&pkt[..len]) };
            self.drain_primary();
            self.fast_after_packet();
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
            self.fast_after_packet();
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
        if let Some(t) = self.last_tick {
            let gap = now_ms.saturating_sub(t);
            self.counters.tick_gap_max_ms = self.counters.tick_gap_max_ms.max(gap);
            if gap > self.s.detector.interval_ms {
                self.counters.tick_gaps_over_interval += 1;
            }
        }
        self.last_tick = Some(now_ms);
        if self.primary.is_some() {
            let run = self.state != State::WaitingForPeer && self.state != State::Yielded;
            if run {
                self.fast_before_primary_tick(now_ms);
            }
            if let Some(p) = self.primary.as_mut() {
                if run {
                    p.tick(now_ms);
                }
            }
            self.drain_primary();
            if run {
                self.fast_after_message(now_ms);
            }
        }
        if let Some(b) = self.backup.as_mut() {
            b.tick(now_ms);
            // Copies for the primary only while this backup may relay them (its reports trim
            // them); a stale or fenced-out backup drops them.
            b.set_input_copies(matches!(self.state, State::WaitingForPeer | State::Protecting | State::Fencing));
        }
        self.fast_tick(now_ms);
        self.fast_primary_mode(now_ms);
        if matches!(self.state, State::Protecting | State::PeerStale | State::Stale) && now_ms >= self.next_fence_at {
            if let Some(DetectorAction::RunFence) = self.det.as_mut().and_then(|d| d.tick(now_ms)) {
                let silent = self.peer_heard_at.map_or(0, |t| now_ms.saturating_sub(t));
                if self.state == State::Stale {
                    // It could not take over anyway: fencing would only take the service down.
                    if let Some(d) = self.det.as_mut() {
                        let _ = d.fence_result(false, now_ms);
                    }
                    if !self.stale_silence_said {
                        self.stale_silence_said = true;
                        self.log_limited("replica: stale silence", || format!("replica: no message from the primary for {silent} ms, but this backup is stale: it neither fences the primary nor takes over"));
                    }
                } else {
                    self.state = State::Fencing;
                    self.fence = FenceRun::Detector;
                    self.counters.fences_run += 1;
                    self.log(format!("replica: no message from the {} for {silent} ms: running the fencing command", self.peer_role()));
                    self.requests.push(Request::Fence);
                }
            }
        }
        // Beats go out in every state: after a failover too (a fenced peer that comes back
        // hears that it lost), and from a yielded or stale host (flagged passive).
        if now_ms >= self.next_beat_at {
            self.send_beat(now_ms, true);
        } else if self.dirty && self.backup.is_some() && matches!(self.state, State::WaitingForPeer | State::Protecting | State::Fencing) {
            self.send_beat(now_ms, false);
        }
        if self.state == State::TookOver {
            self.announce(now_ms);
        }
        self.diagnose(now_ms);
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

    fn after_flush(&mut self, now_ms: u64) {
        self.fast_after_flush(now_ms);
    }
}

