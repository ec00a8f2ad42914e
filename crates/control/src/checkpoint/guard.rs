//! The checkpoint guard: the RTCP engine driven by NFQUEUE, plus its authenticated UDP side
//! channel. [`Core`] holds every decision and is free of I/O (tested directly); [`run`] wires it
//! to the kernel: an NFQUEUE thread, a command thread per listen address, a status writer.

use crate::checkpoint::config::{Guard as Config, Prefix};
use crate::service::Service;
use serde::Serialize;
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{IpAddr, SocketAddr};
use unbroken_engines::rtcp::{self, Conn, Event};
use unbroken_engines::Verdict;
use unbroken_wire::ctl::{self, Command, Key, Status};
use unbroken_wire::ip::{self, IpInfo};
use unbroken_wire::tcp::Packet as Tcp;
use unbroken_wire::{Error, Seq};

pub mod fast;
pub use fast::{Fast, FastCounters, FastDone, FastMap, FastOp, FastState, FastTaken};

/// A protected connection: the application's endpoint and the peer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub app: SocketAddr,
    pub peer: SocketAddr,
}

struct Entry {
    conn: Conn,
    /// Monotonic milliseconds of the last packet or command.
    last_ms: u64,
    /// When the connection was first seen closed both ways.
    closed_ms: Option<u64>,
    /// An application claimed it with a TELL (or ADOPT walked past it): not offered by ADOPT.
    told: bool,
    /// The highest-ending data segment seen from the peer (its sequence space): start, end.
    peer_hi: Option<(u32, u32)>,
    /// A recovery SYN was answered: the application's TELL that follows sends the peer an ACK
    /// with a SACK block (see [`Core::command`], "nudge").
    nudge: bool,
    /// Until when (monotonic ms) a recovery SYN for this connection is expected: set by the
    /// application's authenticated ACKNOWLEDGE with the RECOVERY flag (the SDK's first step of
    /// every recovery), cleared by its TELL. A SYN from the application's address for a connection the guard
    /// could recover, outside this window, was not announced: dropped (issue 9, item 1).
    recovery_armed_until: Option<u64>,
    /// The distinct SYNs answered in the current recovery window, until the application's
    /// TCP proves which one was its own (issue 9, item 1: a forged SYN racing a genuine one).
    /// Empty (no allocation) outside a recovery.
    recovery_syns: Vec<Candidate>,
    /// The ISN of the SYN the engine was last keyed to.
    keyed_isn: u32,
    /// The end of the application's stream as the peer sees it (highest SEQ + length of a
    /// segment forwarded to the peer, after renumbering), known when this entry saw the
    /// connection's first SYN or SYN-ACK go out: the peer cannot acknowledge beyond it (RFC 5961
    /// section 5.2). `None` for an entry that did not witness the handshake (a restarted guard,
    /// an eviction): it cannot know what the application sent before.
    a_hi: Option<u32>,
    /// An authenticated command that protects this connection named it since this guard
    /// started (ACKNOWLEDGE, SHUTDOWN*, ADOPT; not TELL, which only asks): an application
    /// protects it, and the unprotected mark is refused.
    claimed: bool,
    /// The application marked the connection unprotected (its packets carry
    /// `ctl::UNPROTECTED_DSCP`) before any authenticated command: every packet of it passes
    /// untouched, as if the guard were not there (issue 9, checkpoint misconfiguration).
    unprotected: bool,
    /// Of an unprotected connection (which the engine no longer follows): 1 = the
    /// application's FIN passed, 2 = the peer's; both, or a RST, and it expires like a closed one.
    unprotected_fins: u8,
    /// Where its state is (see [`fast`]).
    fast: Fast,
}

impl Entry {
    fn new(now_ms: u64) -> Entry {
        Entry { conn: Conn::default(), last_ms: now_ms, closed_ms: None, told: false, peer_hi: None, nudge: false, recovery_armed_until: None, recovery_syns: Vec::new(), keyed_isn: 0, a_hi: None, claimed: false, unprotected: false, unprotected_fins: 0, fast: Fast::Off }
    }

    /// Closed both ways (or reset): forgotten after the grace period.
    fn closed(&self) -> bool {
        if self.unprotected {
            self.unprotected_fins == 3
        } else {
            self.conn.is_closed()
        }
    }

    /// The handshake completed at this state and the connection is not closed: what ADOPT
    /// offers and what eviction spares while half-open entries remain.
    fn established(&self) -> bool {
        use unbroken_engines::rtcp::flag;
        let need = flag::SYNCED | flag::RECOVERABLE | flag::ACK_ALLOWED;
        self.conn.flags & need == need && !self.conn.is_closed() && !self.unprotected
    }

    /// What ADOPT offers: an established connection, or one inside its handshake whose
    /// application's SYN-ACK went out here (the application's kernel accepted it) while the
    /// peer's handshake ACK has not arrived yet (issue 21, item 3). The engine knows ackB0
    /// there already (the SYN-ACK's SEQ + 1, the only ACK the peer's handshake can carry), and
    /// an application that died between its kernel's SYN-ACK and that ACK would otherwise listen
    /// again while the peer is established: its segments meet the new listener's RSTs, which
    /// O1 drops, and the peer hangs until its own timeout. Its recovery SYN is forwarded (O4)
    /// and the peer's answer (its challenge ACK, or its late handshake ACK) becomes the
    /// SYN-ACK (section 6).
    fn adoptable(&self) -> bool {
        use unbroken_engines::rtcp::flag;
        let answered = flag::SYNCED | flag::ACK_ALLOWED | flag::OPTS_KNOWN;
        let inside_handshake = self.conn.flags & answered == answered && self.conn.flags & (flag::RECOVERABLE | flag::SYN_PENDING | flag::ACK_EVERYTHING) == 0 && self.a_hi.is_some() && !self.conn.is_closed() && !self.unprotected;
        self.established() || inside_handshake
    }

    /// A recovery SYN for this connection is announced at `now_ms`.
    fn recovery_armed(&self, now_ms: u64) -> bool {
        self.recovery_armed_until.is_some_and(|t| now_ms <= t)
    }
}

/// Largest IP packet of a recovery SYN kept as a candidate (IPv6 header + TCP with 40 bytes of
/// options is 100).
const CANDIDATE_BYTES: usize = 128;
/// Distinct SYNs answered inside one announced recovery window before further ones are
/// dropped (the application's own retransmissions repeat its ISN and do not count).
pub const MAX_RECOVERY_SYNS: usize = 4;

/// A recovery SYN answered inside an announced window, kept until a packet of the application
/// proves which SYN was its own (see [`Core::recovery_race`]).
#[derive(Clone, Copy)]
struct Candidate {
    isn: u32,
    /// ackA when it was answered: the ACK the application's TCP sends for the SYN-ACK.
    proof_ack: u32,
    len: u16,
    pkt: [u8; CANDIDATE_BYTES],
}

enum Race {
    None,
    Candidate(Candidate),
    Done(Verdict, usize),
}

/// Keys an eviction looks at, at most (see [`Core::evict_one`]).
pub const EVICT_SCAN: usize = 1024;
/// Entries an eviction compares, at least (see [`Core::evict_one`]).
pub const EVICT_SAMPLE: usize = 64;

/// How long after an ACKNOWLEDGE the guard accepts the recovery SYN it announces: the SDK's
/// default connect timeout (10 s) plus margin.
pub const RECOVERY_WINDOW_MS: u64 = 15_000;

/// Counters exported in the status file. Every dropped or refused input lands in one of them.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Counters {
    /// Packets the fast path had decided that reached the queue anyway (see the guard's mode).
    pub fast_done_queued: u64,
    pub packets: u64,
    pub incoming: u64,
    pub outgoing: u64,
    pub forwarded: u64,
    pub modified: u64,
    pub dropped: u64,
    pub reflected: u64,
    /// Queued packets that were not IP/TCP of a protected service (passed untouched).
    pub unprotected: u64,
    /// Unparseable IP or TCP on a protected flow: dropped (never forwarded unrewritten).
    pub malformed: u64,
    /// IPv4 fragments, IPv6 extension headers on a protected flow: dropped.
    pub unsupported: u64,
    pub full_checksums: u64,
    pub rst_dropped: u64,
    pub spurious_fin_reset: u64,
    pub no_checkpoint_reset: u64,
    pub recovered: u64,
    pub recovery_syn_forwarded: u64,
    pub recovered_from_peer_ack: u64,
    pub pending_without_checkpoint: u64,
    pub bogus_flags: u64,
    /// I0: packets from the peer on a connection whose state was lost (a restart, an
    /// eviction), turned into an ACK-eliciting probe for the application's TCP.
    pub peer_without_state: u64,
    /// Packets from the peer whose TCP checksum does not verify: dropped, nothing learned
    /// (issue 9, item 2).
    pub hostile_peer_bad_checksum: u64,
    /// Packets from the peer outside the window the application's TCP could accept (RSTs
    /// included, RFC 5961), echoing a timestamp never sent, or SYN-ACKs answering no pending
    /// SYN: dropped, nothing learned (issue 9, item 2).
    pub hostile_peer_out_of_window: u64,
    /// Packets from the peer acknowledging beyond what the application sent through this
    /// guard (RFC 5961 section 5.2): dropped, nothing learned (issue 9, item 2).
    pub hostile_peer_ack_beyond: u64,
    /// SYNs from the peer on a synchronized connection: passed to the application's TCP
    /// (which answers with a challenge ACK), nothing learned.
    pub peer_syn_challenged: u64,
    pub commands: u64,
    pub commands_answered: u64,
    pub acks_injected: u64,
    /// ACKs with a SACK block of the peer's last segment sent at a recovered connection's TELL
    /// so that the peer retransmits what the dead socket lost at once (see [`Core::command`]).
    pub recovery_nudges: u64,
    pub cmd_rejected_source: u64,
    pub cmd_rejected_auth: u64,
    pub cmd_rejected_stale: u64,
    pub cmd_rejected_replay: u64,
    /// Of those, commands older than what the previous guard instance accepted from the same
    /// service address (the persisted high-water mark, [`ReplayFloor`]): replays across a restart.
    pub cmd_rejected_replay_restart: u64,
    pub cmd_malformed: u64,
    pub cmd_not_protected: u64,
    pub cmd_no_connection: u64,
    /// SYNs from the application's address for a recoverable connection that no authenticated
    /// ACKNOWLEDGE with the RECOVERY flag announced within [`RECOVERY_WINDOW_MS`]: dropped (a forged recovery SYN
    /// would re-key the connection; issue 9, item 1).
    pub hostile_recovery_syn: u64,
    /// Recoveries whose SYN the application's TCP proved (its first packet acknowledged the
    /// synthesized SYN-ACK), closing the window.
    pub recovery_proven: u64,
    /// Of those, how many had been re-keyed by another SYN inside the window (a forged SYN
    /// racing the genuine one): undone.
    pub recovery_race_undone: u64,
    /// Packets from the application's address while two or more recovery SYNs were unproven
    /// and that proved none: answered with a RST toward the application, never forwarded.
    pub hostile_recovery_unproven: u64,
    /// Refusals ([`ctl::Nak`]) sent for commands that failed their MAC or clock check.
    pub naks_sent: u64,
    /// Refusals not sent because the rate limit ([`NAK_PER_SEC`]) was reached.
    pub naks_rate_limited: u64,
    /// Connections an application marked unprotected (`ctl::UNPROTECTED_DSCP`, the SDK does
    /// it when it cannot protect a connection): from then on passed untouched.
    pub unprotected_released: u64,
    /// Connections released by an application's SHUTDOWN with the ABANDON flag that this guard
    /// could not protect (it did not see their handshake), and peers reset for them at once
    /// (issue 21, item 4).
    pub abandoned_released: u64,
    /// Connections this guard never saw begin and no application claimed for
    /// `unclaimed_reset_secs` after it first saw them, ended by passing the application host's
    /// RST to the peer (issue 21, item 4: the application died before its first TELL and the
    /// guard restarted before it was back; see [`Core::unclaimed_reset_ms`]).
    pub unclaimed_released: u64,
    /// The peer's first packets on a state that knew nothing of their connection, passed
    /// without the I0 probe (issue 21, item 4, see `Core::packet_with`).
    pub peer_first_unprobed: u64,
    pub abandoned_peer_reset: u64,
    /// Packets of such connections, passed untouched.
    pub unprotected_passed: u64,
    /// Packets marked unprotected on a connection that an authenticated command named, that
    /// needs renumbering, or whose handshake the guard did not see: the mark is ignored.
    pub hostile_unprotect_refused: u64,
    pub adopted: u64,
    /// Verdicts the queue refused (a replacement it could not carry) or packets whose handling
    /// panicked: dropped instead, so no packet waits in the kernel without a verdict.
    pub verdict_fallbacks: u64,
    /// Rewritten packets whose injection failed.
    pub inject_errors: u64,
    pub evicted_closed: u64,
    pub evicted_idle: u64,
    /// Evictions that found only unprotected connections within [`EVICT_SCAN`] keys: the
    /// table grew past `max_connections` (only by connections the application released).
    pub evict_nothing: u64,
    /// Packets from the peer for a connection the table does not hold that created no entry
    /// (issue 9, item 2): a failed checksum, a SYN-ACK answering no SYN, or a non-SYN while the
    /// table was full (the stateless I0 probe: nothing is evicted for it).
    pub peer_no_entry: u64,
    pub connections: u64,
}

/// Recently seen command nonces (replay protection within the clock-skew window).
struct ReplayCache {
    seen: HashSet<u64>,
    order: VecDeque<(u64, u64)>,
    cap: usize,
}

impl ReplayCache {
    fn new(cap: usize) -> Self {
        ReplayCache { seen: HashSet::new(), order: VecDeque::new(), cap }
    }
    /// Records `nonce` at `now`; false if it was already there.
    fn insert(&mut self, nonce: u64, now_ms: u64, window_ms: u64) -> bool {
        while let Some(&(t, n)) = self.order.front() {
            if now_ms.saturating_sub(t) > 2 * window_ms || self.order.len() >= self.cap {
                self.order.pop_front();
                self.seen.remove(&n);
            } else {
                break;
            }
        }
        if !self.seen.insert(nonce) {
            return false;
        }
        self.order.push_back((now_ms, nonce));
        true
    }
}

/// Nonces kept per service address at its high-water time (see [`ReplayFloor`]).
pub const FLOOR_NONCES: usize = 16;

/// The replay high-water mark of one service address, persisted across guard restarts (issue
/// 21, item 5): the replay cache of nonces lives in memory, so a datagram captured before a
/// restart and replayed to the new guard within the clock window was accepted once. A guard
/// restored with it refuses a command for that address whose clock is below `time_ms`, or
/// equal to it with a nonce in `nonces` (or any, once more than [`FLOOR_NONCES`] commands
/// shared that millisecond: `full`). A command's clock is its sender's, so each address is
/// compared with its own commands only: an application's clock need not agree with the guard's
/// or other hosts' beyond the allowed skew, only run forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayFloor {
    pub app_ip: IpAddr,
    pub time_ms: u64,
    pub nonces: Vec<u64>,
    pub full: bool,
}

impl ReplayFloor {
    /// Whether a command with this clock and nonce is at or below the mark (a replay).
    fn covers(&self, time_ms: u64, nonce: u64) -> bool {
        time_ms < self.time_ms || (time_ms == self.time_ms && (self.full || self.nonces.contains(&nonce)))
    }
    /// Raises the mark with an accepted command; true if it changed.
    fn raise(&mut self, time_ms: u64, nonce: u64) -> bool {
        if time_ms > self.time_ms {
            self.time_ms = time_ms;
            self.nonces.clear();
            self.full = false;
        } else if time_ms < self.time_ms || self.full {
            return false;
        }
        if self.nonces.len() < FLOOR_NONCES {
            self.nonces.push(nonce);
        } else {
            self.full = true;
        }
        true
    }
}

/// The persisted form of [`ReplayFloor`]s: one line per service address,
/// `<address> <time_ms> <full 0|1> <nonce hex,...>`, after a first line `unbroken-guard-replay 1`.
pub fn encode_replay_floors(floors: &[ReplayFloor]) -> String {
    let mut s = String::from("unbroken-guard-replay 1\n");
    for f in floors {
        let nonces: Vec<String> = f.nonces.iter().map(|n| format!("{n:016x}")).collect();
        s.push_str(&format!("{} {} {} {}\n", f.app_ip, f.time_ms, f.full as u8, if nonces.is_empty() { "-".to_string() } else { nonces.join(",") }));
    }
    s
}

/// Parses [`encode_replay_floors`]'s text; the error says which line is wrong.
pub fn decode_replay_floors(text: &str) -> Result<Vec<ReplayFloor>, String> {
    let mut lines = text.lines();
    if lines.next() != Some("unbroken-guard-replay 1") {
        return Err("not an unbroken guard replay file (version 1)".into());
    }
    let mut out = Vec::new();
    for (i, l) in lines.enumerate() {
        let bad = || format!("line {}: {l:?}", i + 2);
        let f: Vec<&str> = l.split(' ').collect();
        if f.len() != 4 {
            return Err(bad());
        }
        let app_ip: IpAddr = f[0].parse().map_err(|_| bad())?;
        let time_ms: u64 = f[1].parse().map_err(|_| bad())?;
        let full = match f[2] {
            "0" => false,
            "1" => true,
            _ => return Err(bad()),
        };
        let nonces = if f[3] == "-" { vec![] } else { f[3].split(',').map(|n| u64::from_str_radix(n, 16).map_err(|_| bad())).collect::<Result<Vec<_>, _>>()? };
        if nonces.len() > FLOOR_NONCES {
            return Err(bad());
        }
        out.push(ReplayFloor { app_ip, time_ms, nonces, full });
    }
    Ok(out)
}

/// Every decision of the guard, without I/O.
pub struct Core {
    services: HashSet<(IpAddr, u16)>,
    table: HashMap<FlowKey, Entry>,
    /// The table's keys in insertion order, for eviction without sorting (see
    /// [`Core::evict_one`]): may hold keys since removed (skipped) and, after a key was removed
    /// and inserted again, duplicates; compacted when it outgrows the table.
    order: VecDeque<FlowKey>,
    key: Key,
    allowed: Vec<Prefix>,
    skew_ms: u64,
    grace_ms: u64,
    max_conns: usize,
    replay: ReplayCache,
    /// The high-water marks restored from the previous instance (see [`ReplayFloor`]).
    replay_restored: HashMap<IpAddr, ReplayFloor>,
    /// This instance's marks, to persist for the next ([`Core::take_replay_floors`]), and
    /// whether they changed since last taken.
    replay_floors: HashMap<IpAddr, ReplayFloor>,
    replay_floors_dirty: bool,
    /// Send the recovery nudge (config `recovery_nudge`; experimental, off by default).
    pub recovery_nudge: bool,
    /// Token bucket of refusals: tokens (in thousandths) and when it was last filled.
    nak_tokens: u64,
    nak_filled_ms: Option<u64>,
    /// When [`Core::expire`] last ran from [`crate::daemon::Mode::tick`].
    last_expire_ms: u64,
    /// Config `unclaimed_reset_secs` in ms (0: never): see [`Core::unclaimed_rst`].
    pub unclaimed_reset_ms: u64,
    /// When this instance first saw each connection it knows nothing of (not witnessed, not
    /// claimed), kept apart from the table so that an eviction does not restart the clock;
    /// bounded by `max_conns`, oldest first out ([`Core::unknown_order`]).
    unknown_since: HashMap<FlowKey, u64>,
    /// Insertion order of `unknown_since` as (key, since): entries since removed or replaced are
    /// skipped when met (lazy), and dropped when the deque outgrows the map.
    unknown_order: VecDeque<(FlowKey, u64)>,
    pub counters: Counters,
    /// The fast path's part (off unless [`Core::enable_fast_path`]).
    fast: fast::FastPart,
    /// Why the fast path is off, for the status (set by the daemon).
    pub fast_off_reason: Option<String>,
}

/// Default of `guard.unclaimed_reset_secs`, in ms.
pub const UNCLAIMED_RESET_MS: u64 = 120_000;

/// Reply to a command: the response datagram and, for ACKNOWLEDGE, a TCP ACK for the peer.
pub struct CommandOut {
    /// The response ([`ctl::LEN`] bytes) or a refusal ([`ctl::NAK_LEN`] bytes).
    pub reply: Vec<u8>,
    pub ack_len: Option<usize>,
}

/// Refusals ([`ctl::Nak`]) the guard sends per second at most (burst as many): a flood of
/// bad datagrams from an allowed source gets no more answers than that, each smaller than the
/// datagram it answers.
pub const NAK_PER_SEC: u64 = 10;

impl Core {
    pub fn new(services: &[Service], key: Key, allowed: Vec<Prefix>, skew_ms: u64, grace_ms: u64, max_conns: usize) -> Core {
        Core {
            services: services.iter().map(|s| (s.addr, s.port)).collect(),
            table: HashMap::new(),
            order: VecDeque::new(),
            key,
            allowed,
            skew_ms,
            grace_ms,
            max_conns: max_conns.max(1),
            replay: ReplayCache::new(1 << 18),
            replay_restored: HashMap::new(),
            replay_floors: HashMap::new(),
            replay_floors_dirty: false,
            recovery_nudge: false,
            nak_tokens: NAK_PER_SEC * 1000,
            nak_filled_ms: None,
            last_expire_ms: 0,
            unclaimed_reset_ms: UNCLAIMED_RESET_MS,
            unknown_since: HashMap::new(),
            unknown_order: VecDeque::new(),
            counters: Counters::default(),
            fast: fast::FastPart::default(),
            fast_off_reason: None,
        }
    }

    pub fn from_config(cfg: &Config) -> Core {
        let g = &cfg.raw.guard;
        let mut c = Core::new(&cfg.raw.services, cfg.key.clone(), cfg.allowed.clone(), g.max_clock_skew_ms, g.closed_grace_secs.saturating_mul(1000), g.max_connections);
        c.recovery_nudge = g.recovery_nudge;
        c.unclaimed_reset_ms = g.unclaimed_reset_secs.saturating_mul(1000);
        c
    }

    pub fn connections(&self) -> usize {
        self.table.len()
    }

    /// Restores the replay high-water marks the previous instance persisted (issue 21, item
    /// 5): commands at or below them are refused as replays (`cmd_rejected_replay_restart`).
    pub fn restore_replay_floors(&mut self, floors: Vec<ReplayFloor>) {
        for f in floors {
            self.replay_floors.insert(f.app_ip, f.clone());
            self.replay_restored.insert(f.app_ip, f);
        }
    }

    /// The replay high-water marks, when they changed since last taken: the daemon persists
    /// them before it acts on the command that raised them (injects its ACK, answers it), so a
    /// datagram whose effect anyone saw is refused by the next instance.
    pub fn take_replay_floors(&mut self) -> Option<Vec<ReplayFloor>> {
        if !std::mem::take(&mut self.replay_floors_dirty) {
            return None;
        }
        let mut v: Vec<ReplayFloor> = self.replay_floors.values().cloned().collect();
        v.sort_by_key(|f| f.app_ip);
        Some(v)
    }

    /// The engine state of a connection, if remembered.
    pub fn conn(&self, k: &FlowKey) -> Option<&Conn> {
        self.table.get(k).map(|e| &e.conn)
    }

    /// Whether an ACKNOWLEDGE announced a recovery of `k` whose SYN may still come (see
    /// `Entry::recovery_armed_until`).
    pub fn recovery_armed(&self, k: &FlowKey, now_ms: u64) -> bool {
        self.table.get(k).is_some_and(|e| e.recovery_armed(now_ms))
    }

    /// True when some remembered connection needs renumbering or timestamp translation: its
    /// packets must not bypass the guard.
    pub fn any_translated(&self) -> bool {
        self.table.values().any(|e| e.conn.delta != 0 || e.conn.ts_off != 0)
    }

    fn count(&mut self, ev: Event) {
        let c = &mut self.counters;
        match ev {
            Event::SpuriousRstDropped => c.rst_dropped += 1,
            Event::SpuriousFinReset => c.spurious_fin_reset += 1,
            Event::NoCheckpointReset => c.no_checkpoint_reset += 1,
            Event::Recovered => c.recovered += 1,
            Event::RecoverySynForwarded => c.recovery_syn_forwarded += 1,
            Event::RecoveredFromPeerAck => c.recovered_from_peer_ack += 1,
            Event::PendingWithoutCheckpoint => c.pending_without_checkpoint += 1,
            Event::BogusFlags => c.bogus_flags += 1,
            Event::PeerWithoutState => c.peer_without_state += 1,
            Event::PeerBadChecksum => c.hostile_peer_bad_checksum += 1,
            Event::PeerOutOfWindow => c.hostile_peer_out_of_window += 1,
            Event::PeerSynChallenged => c.peer_syn_challenged += 1,
        }
    }

    fn entry(&mut self, k: FlowKey, now_ms: u64) -> &mut Entry {
        if !self.table.contains_key(&k) {
            if self.table.len() >= self.max_conns {
                self.evict_one();
            }
            if self.order.len() > 2 * self.table.len() + 1024 {
                self.compact_order();
            }
            self.order.push_back(k);
        }
        let e = self.table.entry(k).or_insert_with(|| Entry::new(now_ms));
        e.last_ms = now_ms;
        e
    }

    /// Drops the stale and duplicate keys of `order` (linear, amortized over the removals that
    /// made them).
    fn compact_order(&mut self) {
        let mut seen = HashSet::with_capacity(self.table.len());
        let t = &self.table;
        self.order.retain(|k| t.contains_key(k) && seen.insert(*k));
    }

    /// Forgets one entry to make room (section 2.5: any state may be dropped; a live connection
    /// whose state is forgotten is recovered through its application), in bounded time: it
    /// walks the insertion order from the front, sending the keys it looks at to the back, until
    /// it has met [`EVICT_SAMPLE`] entries and at least one half-open or closed one (at most
    /// [`EVICT_SCAN`] keys), and forgets the idlest half-open or closed entry it met; only
    /// when it met none, the idlest established connection (a table of up to
    /// [`EVICT_SAMPLE`] entries is seen whole: the same choice as a sort). Other clients' SYNs (a SYN flood) then churn only each other, never a
    /// connection that completed its handshake: evicting one costs its application a recovery,
    /// and under a steady flood it would be evicted again at every idle moment (found by the
    /// guard's simulation: a close that never completes). An unprotected connection is never
    /// evicted: forgetting it would turn its packets into rewritten ones (I0, O6) that an
    /// application that gave up protection never recovers from; it leaves the table when it
    /// closes. (Before: the whole table was sorted under the lock at every eviction.)
    fn evict_one(&mut self) {
        let mut half: Option<(u64, FlowKey)> = None;
        let mut est: Option<(u64, FlowKey)> = None;
        let mut live = 0;
        for _ in 0..EVICT_SCAN {
            if half.is_some() && live >= EVICT_SAMPLE {
                break;
            }
            let Some(k) = self.order.pop_front() else { break };
            let Some(e) = self.table.get(&k) else { continue };
            live += 1;
            if !e.unprotected {
                let slot = if e.established() { &mut est } else { &mut half };
                // A connection the kernel's fast path carries: its packets do not reach the
                // core, so its last_ms says nothing of its activity; it ranks as the busiest.
                let t = if e.fast == Fast::Kernel { u64::MAX } else { e.last_ms };
                if slot.is_none_or(|(u, _)| t < u) {
                    *slot = Some((t, k));
                }
            }
            self.order.push_back(k);
        }
        match half.or(est) {
            Some((_, k)) => {
                if let Some(e) = self.table.remove(&k) {
                    self.fast_forget(k, e.fast);
                }
                self.counters.evicted_idle += 1;
            }
            None => self.counters.evict_nothing += 1,
        }
    }

    /// ADOPT: the first connection of `app` after `cursor` (by peer address and port) that no
    /// TELL claimed and that a recovery SYN could resynchronize ([`Entry::adoptable`]).
    fn next_unclaimed(&self, app: SocketAddr, cursor: SocketAddr) -> Option<SocketAddr> {
        let order = |a: SocketAddr| {
            let ip = match a.ip() {
                IpAddr::V4(v4) => v4.to_ipv6_mapped().into(),
                IpAddr::V6(v6) => u128::from(v6),
            };
            (ip, a.port())
        };
        self.table
            .iter()
            .filter(|(k, e)| k.app == app && !e.told && e.adoptable())
            .map(|(k, _)| k.peer)
            .filter(|p| order(*p) > order(cursor))
            .min_by_key(|p| order(*p))
    }

    /// Drops a packet that could not be processed, counted by why.
    pub fn refuse(&mut self, e: Error, len: usize) -> (Verdict, usize) {
        match e {
            Error::Unsupported(_) => self.counters.unsupported += 1,
            _ => self.counters.malformed += 1,
        }
        self.counters.dropped += 1;
        (Verdict::Drop, len)
    }

    /// Forgets connections closed both ways for longer than the grace period.
    pub fn expire(&mut self, now_ms: u64) {
        let grace = self.grace_ms;
        let mut gone = 0;
        let mut fast_gone = Vec::new();
        self.table.retain(|k, e| {
            if e.closed() {
                let since = *e.closed_ms.get_or_insert(now_ms);
                if now_ms.saturating_sub(since) >= grace {
                    gone += 1;
                    if e.fast != Fast::Off {
                        fast_gone.push(*k);
                    }
                    return false;
                }
            }
            true
        });
        self.counters.evicted_closed += gone;
        self.counters.connections = self.table.len() as u64;
        for k in fast_gone {
            self.fast_forget(k, Fast::Kernel);
        }
        self.fast_settle(now_ms);
    }

    /// The protected connection a packet belongs to, if any.
    fn flow_key(&self, pkt: &[u8]) -> Option<FlowKey> {
        let info = IpInfo::parse(pkt).ok()?;
        if info.protocol != ip::PROTO_TCP || info.l4_len < 4 {
            return None;
        }
        let l4 = &pkt[info.l4_offset..];
        let src = SocketAddr::new(info.src, u16::from_be_bytes([l4[0], l4[1]]));
        let dst = SocketAddr::new(info.dst, u16::from_be_bytes([l4[2], l4[3]]));
        if self.services.contains(&(src.ip(), src.port())) {
            Some(FlowKey { app: src, peer: dst })
        } else if self.services.contains(&(dst.ip(), dst.port())) {
            Some(FlowKey { app: dst, peer: src })
        } else {
            None
        }
    }

    /// [`packet_with`](Self::packet_with) with the fast path on: the connection's state is
    /// taken from the map first (`counted`: the programs counted the packet, see [`fast`]),
    /// and given back after if the connection is still the programs' to carry.
    pub fn packet_fast(&mut self, buf: &mut [u8], len: usize, now_ms: u64, csum_partial: bool, counted: bool) -> (Verdict, usize) {
        if self.fast.map.is_none() {
            return self.packet_with(buf, len, now_ms, csum_partial);
        }
        if let Some(key) = self.flow_key(&buf[..len]) {
            self.fast_take(key, counted, now_ms);
        }
        let r = self.packet_with(buf, len, now_ms, csum_partial);
        // The connections this packet touched are given back only once its verdict has left
        // (see `fast::FastPart::after_flush`).
        self.fast_defer();
        r
    }

    /// Decides a queued packet. `buf[..len]` is the IP packet; `buf` has room to grow (64 bytes
    /// is enough). Returns the action and the packet's new length.
    pub fn packet(&mut self, buf: &mut [u8], len: usize, now_ms: u64) -> (Verdict, usize) {
        self.packet_with(buf, len, now_ms, false)
    }

    /// [`packet`](Self::packet) for a packet whose transport checksum is partial
    /// (`csum_partial`: built on this host and handed over before the checksum was completed,
    /// NFQUEUE's `csum_not_ready`), so that it cannot be verified. Every other packet from the
    /// peer must carry a checksum that verifies (issue 9, item 2).
    pub fn packet_with(&mut self, buf: &mut [u8], len: usize, now_ms: u64, csum_partial: bool) -> (Verdict, usize) {
        self.counters.packets += 1;
        let info = match IpInfo::parse(&buf[..len]) {
            Ok(i) => i,
            // Without its TCP header a packet cannot be told apart from a protected one; the
            // rules queue only protected TCP, so refuse it (never forward unrewritten).
            Err(e) => return self.refuse(e, len),
        };
        if info.protocol != ip::PROTO_TCP || info.l4_len < 4 {
            self.counters.unprotected += 1;
            return (Verdict::Accept { modified: false }, len);
        }
        let l4 = &buf[info.l4_offset..];
        let sport = u16::from_be_bytes([l4[0], l4[1]]);
        let dport = u16::from_be_bytes([l4[2], l4[3]]);
        let src = SocketAddr::new(info.src, sport);
        let dst = SocketAddr::new(info.dst, dport);
        let (outgoing, key) = if self.services.contains(&(info.src, sport)) {
            (true, FlowKey { app: src, peer: dst })
        } else if self.services.contains(&(info.dst, dport)) {
            (false, FlowKey { app: dst, peer: src })
        } else {
            self.counters.unprotected += 1;
            return (Verdict::Accept { modified: false }, len);
        };
        if outgoing {
            self.counters.outgoing += 1;
        } else {
            self.counters.incoming += 1;
        }
        // A connection its application could not protect (issue 9, misconfiguration): its
        // packets pass untouched, so the peer sees what the application does (its close).
        if let Some(e) = self.table.get_mut(&key) {
            if e.unprotected {
                use unbroken_wire::tcp::flags as F;
                let f = if info.l4_len >= 14 { buf[info.l4_offset + 13] } else { 0 };
                if f & F::RST != 0 {
                    e.unprotected_fins = 3;
                } else if f & F::FIN != 0 {
                    e.unprotected_fins |= if outgoing { 1 } else { 2 };
                }
                e.last_ms = now_ms;
                self.counters.unprotected_passed += 1;
                self.counters.forwarded += 1;
                return (Verdict::Accept { modified: false }, len);
            }
            if outgoing && dscp(&buf[..len]) == Some(ctl::UNPROTECTED_DSCP) {
                use unbroken_engines::rtcp::flag;
                let c = &e.conn;
                // Only what cannot be a forger's way to unprotect a protected connection: no
                // authenticated command named it, its handshake was seen here (Δ = 0 is known,
                // not assumed), nothing is renumbered.
                if !e.claimed && c.flags & flag::SYNCED != 0 && c.flags & flag::SYN_PENDING == 0 && c.delta == 0 && c.ts_off == 0 {
                    e.unprotected = true;
                    e.last_ms = now_ms;
                    self.counters.unprotected_released += 1;
                    self.counters.unprotected_passed += 1;
                    self.counters.forwarded += 1;
                    return (Verdict::Accept { modified: false }, len);
                }
                // An SDK that gave up posts a SHUTDOWN besides the mark (either may be lost):
                // once that arrived, the FIN is genuine anyway and the mark is nobody's attack.
                let shut = flag::FIN_ALLOWED | flag::ACK_EVERYTHING;
                if c.flags & shut != shut {
                    self.counters.hostile_unprotect_refused += 1;
                }
            }
        }
        if self.unclaimed_rst(key, outgoing, &buf[..len], &info, csum_partial, now_ms) {
            return (Verdict::Accept { modified: false }, len);
        }
        // A recovery SYN must have been announced (issue 9, item 1): a SYN without ACK from the
        // application's address, for a live connection this state witnessed (SYNCED: a forged
        // SYN would re-key it), is answered (O5) only within the window an authenticated
        // ACKNOWLEDGE opened. A brand-new connection is not affected, nor a state that did not
        // witness the connection (a restarted guard: it cannot answer such a SYN itself, only
        // forward it to the peer, section 6, and the app's earlier ACKNOWLEDGE went to its
        // predecessor).
        if outgoing && info.l4_len >= 14 {
            use unbroken_engines::rtcp::flag;
            use unbroken_wire::tcp::flags as F;
            let syn_only = buf[info.l4_offset + 13] & (F::SYN | F::ACK) == F::SYN;
            let witnessed = |e: &Entry| e.conn.flags & flag::SYNCED != 0 && e.conn.flags & (flag::RECOVERABLE | flag::ACK_ALLOWED) != 0 && !e.conn.is_closed();
            if syn_only && self.table.get(&key).is_some_and(|e| witnessed(e) && !e.recovery_armed(now_ms)) {
                self.counters.hostile_recovery_syn += 1;
                self.counters.dropped += 1;
                return (Verdict::Drop, len);
            }
        }
        // The race inside an announced window (see `Entry::recovery_syns`).
        let mut candidate = None;
        if outgoing && info.l4_len >= 20 {
            match self.recovery_race(key, buf, &info, len, now_ms) {
                Race::None => {}
                Race::Candidate(c) => candidate = Some(c),
                Race::Done(action, n) => return (action, n),
            }
        }
        // A packet from the peer for a connection the table does not hold may make an entry
        // only with a valid checksum, and evict for it only if it is a SYN: see
        // `peer_without_entry`.
        if !outgoing && !self.table.contains_key(&key) {
            if let Some(r) = self.peer_without_entry(buf, len, &info, csum_partial) {
                return r;
            }
        }
        // The peer's highest data segment, for the recovery nudge.
        let e = self.entry(key, now_ms);
        let mss = if e.conn.b_mss != 0 { e.conn.b_mss } else { 1460 };
        let seg = (!outgoing).then(|| peer_segment(&buf[info.l4_offset..info.l4_offset + info.l4_len], mss)).flatten();
        // RFC 5961 section 5.2, which the engine's 32 bytes have no room for: the peer cannot
        // acknowledge what the application never sent. A blind forger who landed its SEQ in the
        // window would otherwise raise ackB (issue 9, item 2).
        let peer_syn_ack = if outgoing { None } else { tcp_flags_ack(&buf[info.l4_offset..info.l4_offset + info.l4_len]) };
        if !outgoing {
            if let (Some(hi), Some((f, ack))) = (e.a_hi, peer_syn_ack) {
                use unbroken_wire::tcp::flags as F;
                if f & F::ACK != 0 && f & (F::SYN | F::RST) == 0 && Seq(ack).gt(Seq(hi)) {
                    self.counters.hostile_peer_ack_beyond += 1;
                    self.counters.dropped += 1;
                    return (Verdict::Drop, len);
                }
            }
        }
        let csum = if csum_partial { rtcp::PeerChecksum::Partial } else { rtcp::PeerChecksum::Verify };
        // The peer's first packet on a state that knows nothing of the connection (a guard that
        // restarted, or forgot it): kept, see below.
        let first_seen = (!outgoing && e.conn.is_empty()).then(|| buf[..len].to_vec());
        // The IP header was parsed once, above: the engine reads the segment through that view.
        let mut res = if outgoing { rtcp::outgoing_parsed(&mut e.conn, buf, len, &info) } else { rtcp::incoming_parsed(&mut e.conn, buf, len, &info, csum) };
        // I0 would turn it into the out-of-window probe. But a guard that restarted inside the
        // handshake (the application's SYN-ACK out, the peer's ACK not yet in) meets the
        // peer's handshake ACK first: probed, the application's half-open socket answers, O6
        // resets it, and the application never sees the connection (nor can it tell the guard
        // to end it): the peer hung (issue 21, item 4). So the first packet passes as it is:
        // the handshake completes, the application accepts, and its failing TELL ends the
        // connection visibly (ABANDON). The next one is probed as before; on a connection
        // recovered before the restart (Δ ≠ 0) this costs at most one packet the application's
        // TCP drops, which the peer resends (its data stays unacknowledged), so the recovery
        // starts one retransmission later.
        let mut unprobed = false;
        if let (Some(orig), Ok(o)) = (&first_seen, &res) {
            if o.event == Some(Event::PeerWithoutState) {
                buf[..len].copy_from_slice(orig);
                unprobed = true;
                res = Ok(rtcp::Outcome { verdict: Verdict::Accept { modified: false }, len, event: None });
            }
        }
        if let Ok(o) = &res {
            if matches!(o.event, Some(Event::Recovered | Event::RecoveredFromPeerAck)) {
                e.nudge = true;
            }
            if o.event == Some(Event::Recovered) {
                if let Some(mut c) = candidate {
                    // A's TCP acknowledges the synthesized SYN-ACK (SEQ = ackA - 1) with ackA.
                    c.proof_ack = e.conn.ack_a;
                    if !e.recovery_syns.iter().any(|k| k.isn == c.isn) {
                        e.recovery_syns.push(c);
                    }
                    e.keyed_isn = c.isn;
                }
            }
            // The handshake, seen here, fixes where the application's stream begins: its own
            // SYN-ACK going out (it is the server), or the peer's SYN-ACK accepted for its SYN
            // (it is the client). Never its SYN alone: a guard that lost the state cannot tell
            // a recovery SYN from a first one. From then on every byte it sends passes here.
            use unbroken_wire::tcp::flags as F;
            if matches!(o.verdict, Verdict::Accept { .. }) && o.event.is_none() {
                if outgoing {
                    let seg = IpInfo::parse(&buf[..o.len]).ok().and_then(|i| Tcp::new_checked(&buf[i.l4_offset..i.l4_offset + i.l4_len]).ok()).map(|t| (t.seq() + t.seq_len(), t.flags()));
                    if let Some((end, f)) = seg {
                        match e.a_hi {
                            None if f & (F::SYN | F::ACK) == F::SYN | F::ACK => e.a_hi = Some(end.0),
                            Some(hi) if end.gt(Seq(hi)) => e.a_hi = Some(end.0),
                            _ => {}
                        }
                    }
                } else if let Some((f, ack)) = peer_syn_ack {
                    if f & (F::SYN | F::ACK | F::RST) == F::SYN | F::ACK && e.a_hi.is_none() {
                        e.a_hi = Some(ack);
                    }
                }
            }
            // Only what the engine accepted from the peer counts for the nudge.
            if !matches!(o.event, Some(Event::PeerBadChecksum | Event::PeerOutOfWindow)) {
                if let Some((start, end)) = seg {
                    if e.peer_hi.is_none_or(|(_, hi)| Seq(end).gt(Seq(hi))) {
                        e.peer_hi = Some((start, end));
                    }
                }
            }
        }
        if unprobed {
            self.counters.peer_first_unprobed += 1;
        }
        self.finish(res, len)
    }

    /// The double fault of issue 21, item 4: the application died before its first TELL and
    /// the guard restarted (or forgot the connection) before the application was back. Nobody
    /// but the peer holds the connection: the restarted application has no record and ADOPT
    /// offers nothing, and O1 drops its host's RSTs for the peer's segments, so the peer hung
    /// until its own timeout. Such a connection ends visibly once it stayed unclaimed for
    /// [`Core::unclaimed_reset_ms`] after this instance first saw it: the application host's
    /// RST passes (it answers one of the peer's segments, so it carries that segment's ACK as
    /// its SEQ: RFC 5961's exact match) and the connection is released (every later packet
    /// passes untouched). Unclaimed means: this state never witnessed its handshake or a
    /// recovery (neither SYNCED nor SYN_PENDING), no authenticated command named it (not even a
    /// TELL: an application that asks is alive and ends it itself, see ABANDON), and no
    /// recovery was announced for it. An application that holds a record of it and restarts
    /// slower than the bound loses it (it would have recovered it); an application that is
    /// alive never sends such a RST (its socket answers the probe with an ACK, and O6 starts
    /// its recovery). Returns true when the packet is to pass as it is.
    fn unclaimed_rst(&mut self, key: FlowKey, outgoing: bool, pkt: &[u8], info: &IpInfo, csum_partial: bool, now_ms: u64) -> bool {
        use unbroken_engines::rtcp::flag;
        use unbroken_wire::tcp::flags as F;
        if self.unclaimed_reset_ms == 0 || info.l4_len < 14 {
            return false;
        }
        let unclaimed = |e: &Entry| e.conn.flags & (flag::SYNCED | flag::SYN_PENDING) == 0 && !e.claimed && !e.told && !e.unprotected && e.recovery_syns.is_empty() && e.recovery_armed_until.is_none();
        let f = pkt[info.l4_offset + 13];
        if !self.table.get(&key).is_none_or(unclaimed) {
            // Witnessed or claimed: its clock, if any, is void (a later connection on the same
            // ports starts with a handshake this state sees).
            if !self.unknown_since.is_empty() {
                self.unknown_since.remove(&key);
            }
            return false;
        }
        // A SYN begins a handshake this state will witness; it starts no clock.
        if f & F::SYN != 0 {
            return false;
        }
        let Some(&since) = self.unknown_since.get(&key) else {
            // A packet from the peer's side starts the clock only with a valid checksum.
            let seg = &pkt[info.l4_offset..info.l4_offset + info.l4_len];
            if !outgoing && !csum_partial && !Tcp::new_checked(seg).is_ok_and(|t| t.verify_checksum(info.pseudo_sum(info.l4_len))) {
                return false;
            }
            // Bounded like the table: the oldest clock makes room (skipping stale order slots).
            while self.unknown_since.len() >= self.max_conns {
                let Some((old, at)) = self.unknown_order.pop_front() else { break };
                if self.unknown_since.get(&old) == Some(&at) {
                    self.unknown_since.remove(&old);
                }
            }
            if self.unknown_order.len() > 2 * self.unknown_since.len() + 1024 {
                let m = &self.unknown_since;
                self.unknown_order.retain(|(k, at)| m.get(k) == Some(at));
            }
            self.unknown_since.insert(key, now_ms);
            self.unknown_order.push_back((key, now_ms));
            return false;
        };
        if !outgoing || f & F::RST == 0 || now_ms.saturating_sub(since) < self.unclaimed_reset_ms {
            return false;
        }
        self.unknown_since.remove(&key);
        let e = self.entry(key, now_ms);
        e.unprotected = true;
        e.unprotected_fins = 3;
        self.counters.unclaimed_released += 1;
        self.counters.unprotected_passed += 1;
        self.counters.forwarded += 1;
        true
    }

    /// Issue 9, item 2: a packet from the peer for a connection the table does not hold.
    /// `None`: handled as before, making an entry — a SYN with a valid checksum (a handshake
    /// to witness; at the cap it evicts, half-open entries first), or another packet with a
    /// valid checksum while the table has room (what it teaches, e.g. ackB after a guard
    /// restart, is kept). Otherwise it is decided on a scratch state and leaves nothing:
    /// a bad checksum (dropped), a SYN-ACK answering no SYN the application sent (dropped,
    /// `hostile_peer_out_of_window`), a non-SYN when the table is full (the stateless I0
    /// probe; nothing is evicted for it). So spoofed packets never cost an entry unless they
    /// carry a valid checksum, never evict one unless they are SYNs (which evict half-open
    /// entries first), and are counted (`peer_no_entry`).
    fn peer_without_entry(&mut self, buf: &mut [u8], len: usize, info: &IpInfo, csum_partial: bool) -> Option<(Verdict, usize)> {
        use unbroken_wire::tcp::flags as F;
        let seg = &buf[info.l4_offset..info.l4_offset + info.l4_len];
        let f = if seg.len() >= 14 { seg[13] } else { 0 };
        if f & (F::SYN | F::ACK) == F::SYN | F::ACK {
            self.counters.peer_no_entry += 1;
            self.counters.hostile_peer_out_of_window += 1;
            self.counters.dropped += 1;
            return Some((Verdict::Drop, len));
        }
        let csum_ok = csum_partial || Tcp::new_checked(seg).is_ok_and(|t| t.verify_checksum(info.pseudo_sum(info.l4_len)));
        if csum_ok && (f & F::SYN != 0 || self.table.len() < self.max_conns) {
            return None;
        }
        self.counters.peer_no_entry += 1;
        let mut c = Conn::default();
        let csum = if csum_partial { rtcp::PeerChecksum::Partial } else { rtcp::PeerChecksum::Verify };
        let res = rtcp::incoming_parsed(&mut c, buf, len, info, csum);
        Some(self.finish(res, len))
    }

    /// The action for the engine's outcome, counted.
    fn finish(&mut self, res: unbroken_wire::Result<rtcp::Outcome>, len: usize) -> (Verdict, usize) {
        let o = match res {
            Ok(o) => o,
            Err(e) => return self.refuse(e, len),
        };
        if let Some(ev) = o.event {
            self.count(ev);
        }
        match o.verdict {
            Verdict::Accept { modified } => {
                self.counters.forwarded += 1;
                if modified {
                    self.counters.modified += 1;
                }
                (o.verdict, o.len)
            }
            Verdict::Inject => {
                self.counters.reflected += 1;
                (Verdict::Inject, o.len)
            }
            // The engine gives no other verdict; anything else is dropped.
            Verdict::Drop | Verdict::Held | Verdict::Unknown => {
                self.counters.dropped += 1;
                (Verdict::Drop, len)
            }
        }
    }

    /// A packet from the application's address while a recovery is announced or its SYNs are
    /// unproven (issue 9, item 1: a forged SYN racing a genuine recovery). Every SYN inside the
    /// window is answered (any may be the application's), up to [`MAX_RECOVERY_SYNS`] distinct
    /// ones; the engine is keyed to the last. The application's TCP then acknowledges the
    /// synthesized SYN-ACK: its first packet carries SEQ = its ISN + 1 and ACK = that SYN-ACK's
    /// SEQ + 1 (ackA), which only a receiver of the SYN-ACK (sent toward the application, never
    /// toward a forger on the peer's side) can know. That packet proves which SYN was genuine:
    /// the engine is re-keyed to it if a later SYN had taken over, the candidates are
    /// forgotten and the window closes. While two or more candidates are unproven, any other
    /// packet from the application's address is answered with a RST toward it (the
    /// application recovers again) and never forwarded.
    fn recovery_race(&mut self, key: FlowKey, buf: &mut [u8], info: &IpInfo, len: usize, now_ms: u64) -> Race {
        use unbroken_wire::tcp::flags as F;
        let Some(e) = self.table.get_mut(&key) else { return Race::None };
        let seg = &buf[info.l4_offset..info.l4_offset + info.l4_len];
        let f = seg[13];
        let seq = u32::from_be_bytes(seg[4..8].try_into().unwrap());
        let ack = u32::from_be_bytes(seg[8..12].try_into().unwrap());
        if f & (F::SYN | F::ACK) == F::SYN {
            // Every SYN inside the window is a candidate, including one a restarted guard
            // answers for a connection it did not witness (it becomes SYNCED by answering).
            if !e.recovery_armed(now_ms) {
                return Race::None;
            }
            if !e.recovery_syns.iter().any(|c| c.isn == seq) && e.recovery_syns.len() >= MAX_RECOVERY_SYNS {
                self.counters.hostile_recovery_syn += 1;
                self.counters.dropped += 1;
                return Race::Done(Verdict::Drop, len);
            }
            if len > CANDIDATE_BYTES {
                return Race::None;
            }
            let mut c = Candidate { isn: seq, proof_ack: 0, len: len as u16, pkt: [0; CANDIDATE_BYTES] };
            c.pkt[..len].copy_from_slice(&buf[..len]);
            return Race::Candidate(c);
        }
        if e.recovery_syns.is_empty() || f & (F::SYN | F::RST) != 0 {
            return Race::None;
        }
        let proven = e.recovery_syns.iter().position(|c| f & F::ACK != 0 && ack == c.proof_ack && seq == c.isn.wrapping_add(1));
        match proven {
            Some(i) => {
                let c = e.recovery_syns[i];
                if c.isn != e.keyed_isn {
                    // A later SYN (forged) had re-keyed the connection: undo it by answering
                    // the proven one again (the SYN-ACK it produces is not sent: A has it).
                    let mut scratch = [0u8; CANDIDATE_BYTES + 64];
                    scratch[..c.len as usize].copy_from_slice(&c.pkt[..c.len as usize]);
                    let ok = matches!(rtcp::outgoing(&mut e.conn, &mut scratch, c.len as usize), Ok(o) if o.event == Some(Event::Recovered));
                    e.keyed_isn = c.isn;
                    if ok {
                        self.counters.recovery_race_undone += 1;
                    }
                }
                let e = self.table.get_mut(&key).expect("present");
                e.recovery_syns.clear();
                e.recovery_armed_until = None;
                self.counters.recovery_proven += 1;
                Race::None
            }
            None if e.recovery_syns.len() >= 2 => {
                // Which SYN is the application's is still open: nothing of A's passes, and A's
                // socket is reset (as if by the peer) so the application recovers afresh.
                let (src, dst) = (info.src, info.dst);
                let (sport, dport) = (u16::from_be_bytes([seg[0], seg[1]]), u16::from_be_bytes([seg[2], seg[3]]));
                let r = unbroken_wire::tcp::Repr { src_port: dport, dst_port: sport, seq: Seq(ack), flags: F::RST, ..Default::default() };
                self.counters.hostile_recovery_unproven += 1;
                match emit_bare(buf, dst, src, &r) {
                    Some(n) => {
                        self.counters.reflected += 1;
                        Race::Done(Verdict::Inject, n)
                    }
                    None => {
                        self.counters.dropped += 1;
                        Race::Done(Verdict::Drop, len)
                    }
                }
            }
            None => Race::None,
        }
    }

    /// A refusal of `dgram` (well formed, from an allowed source, failing its MAC or clock
    /// check), within the rate limit: the application learns that the guard is there and what
    /// it refuses, instead of timing out. Nothing for garbage or beyond the limit.
    fn refusal(&mut self, dgram: &[u8], why: u8, wall_ms: u64, now_ms: u64) -> Option<CommandOut> {
        let nak = ctl::Nak::refuse(dgram, why, wall_ms)?;
        let cap = NAK_PER_SEC * 1000;
        let last = *self.nak_filled_ms.get_or_insert(now_ms);
        self.nak_tokens = (self.nak_tokens + now_ms.saturating_sub(last) * NAK_PER_SEC).min(cap);
        self.nak_filled_ms = Some(now_ms);
        if self.nak_tokens < 1000 {
            self.counters.naks_rate_limited += 1;
            return None;
        }
        self.nak_tokens -= 1000;
        self.counters.naks_sent += 1;
        Some(CommandOut { reply: nak.encode().to_vec(), ack_len: None })
    }

    /// Handles one side-channel datagram from `src`. `None` means "no answer" (refused and
    /// counted: wrong source, bad MAC, stale clock, replay, malformed). A bad MAC or a stale
    /// clock from an allowed source is answered with a refusal ([`ctl::Nak`], rate-limited).
    pub fn command(&mut self, src: SocketAddr, dgram: &[u8], wall_ms: u64, now_ms: u64, ack_buf: &mut [u8]) -> Option<CommandOut> {
        let out = self.command_inner(src, dgram, wall_ms, now_ms, ack_buf);
        self.fast_settle(now_ms);
        out
    }

    fn command_inner(&mut self, src: SocketAddr, dgram: &[u8], wall_ms: u64, now_ms: u64, ack_buf: &mut [u8]) -> Option<CommandOut> {
        self.counters.commands += 1;
        let sip = match src.ip() {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(src.ip()),
            v4 => v4,
        };
        if !self.allowed.iter().any(|p| p.contains(sip)) {
            self.counters.cmd_rejected_source += 1;
            return None;
        }
        let cmd = match Command::decode(dgram, &self.key) {
            Ok(c) => c,
            Err(Error::Unauthenticated) => {
                self.counters.cmd_rejected_auth += 1;
                return self.refusal(dgram, ctl::refusal::KEY, wall_ms, now_ms);
            }
            Err(_) => {
                self.counters.cmd_malformed += 1;
                return None;
            }
        };
        if cmd.response {
            self.counters.cmd_malformed += 1;
            return None;
        }
        if wall_ms.abs_diff(cmd.time_ms) > self.skew_ms {
            self.counters.cmd_rejected_stale += 1;
            return self.refusal(dgram, ctl::refusal::CLOCK, wall_ms, now_ms);
        }
        if !self.replay.insert(cmd.nonce, wall_ms, self.skew_ms) {
            self.counters.cmd_rejected_replay += 1;
            return None;
        }
        let key = FlowKey { app: cmd.app, peer: cmd.peer };
        let status_reply = |status: Status, k: &Key| {
            let r = Command { response: true, status: status as u8, flags: 0, time_ms: wall_ms, ack_a: 0, ack_b: 0, options: None, ..cmd };
            r.encode(k).ok().map(|reply| CommandOut { reply: reply.to_vec(), ack_len: None })
        };
        if !self.services.contains(&(cmd.app.ip(), cmd.app.port())) {
            self.counters.cmd_not_protected += 1;
            return status_reply(Status::BadRequest, &self.key);
        }
        // Across restarts (issue 21, item 5): at or below what the previous instance accepted
        // for this service address, a replay of a datagram captured before the restart.
        if self.replay_restored.get(&cmd.app.ip()).is_some_and(|f| f.covers(cmd.time_ms, cmd.nonce)) {
            self.counters.cmd_rejected_replay += 1;
            self.counters.cmd_rejected_replay_restart += 1;
            return None;
        }
        if self.replay_floors.entry(cmd.app.ip()).or_insert_with(|| ReplayFloor { app_ip: cmd.app.ip(), time_ms: 0, nonces: Vec::new(), full: false }).raise(cmd.time_ms, cmd.nonce) {
            self.replay_floors_dirty = true;
        }
        // Accepted: every later decision reads the connection's newest state (a checkpoint
        // raised in the kernel in place, or the connection taken from it). Never before the
        // refusals above: a refused command changes nothing, not even in the kernel.
        if cmd.op != ctl::Op::Adopt && !self.fast_acknowledge(key, &cmd) {
            self.fast_take(key, false, now_ms);
        }
        if cmd.op == ctl::Op::Adopt {
            return match self.next_unclaimed(cmd.app, cmd.peer) {
                Some(peer) => {
                    let mut ack = [0u8; 0];
                    let k = FlowKey { app: cmd.app, peer };
                    self.fast_take(k, false, now_ms);
                    let e = self.table.get_mut(&k).expect("just found");
                    e.claimed = true;
                    let res = rtcp::command(&mut e.conn, &Command { peer, ..cmd }, &mut ack);
                    self.counters.adopted += 1;
                    self.counters.commands_answered += 1;
                    Command { time_ms: wall_ms, ..res.reply }.encode(&self.key).ok().map(|reply| CommandOut { reply: reply.to_vec(), ack_len: None })
                }
                None => {
                    self.counters.cmd_no_connection += 1;
                    status_reply(Status::NoConnection, &self.key)
                }
            };
        }
        if cmd.op == ctl::Op::Tell && !self.table.contains_key(&key) {
            self.counters.cmd_no_connection += 1;
            return status_reply(Status::NoConnection, &self.key);
        }
        let nudging = self.recovery_nudge;
        let e = self.entry(key, now_ms);
        // Only a command that protects claims the connection (its checkpoint, its shutdown, a
        // recovery). A TELL only asks: an SDK whose TELL arrived but whose answer was lost (a
        // one-way or lossy side channel) gives up and marks the socket unprotected, and that
        // mark must still be honoured, or the guard would hold the application's FIN and the
        // peer hang (issue 9, checkpoint misconfiguration).
        let claimed_before = e.claimed;
        if cmd.op != ctl::Op::Tell {
            e.claimed = true;
        }
        if cmd.op == ctl::Op::Tell {
            e.told = true;
            e.recovery_armed_until = None;
        }
        if cmd.op == ctl::Op::Acknowledge && cmd.flags & ctl::flag::RECOVERY != 0 {
            e.recovery_armed_until = Some(now_ms + RECOVERY_WINDOW_MS);
            e.recovery_syns.clear();
        }
        // An application gives up a connection it has no record of (the SDK's `establish`
        // failed), and this guard cannot protect it either: it did not see the handshake (it
        // restarted, or forgot the connection, between the peer's SYN and the first TELL), so
        // nobody knows the checkpoint and the connection cannot be recovered. Before, the
        // application's close met O6 (its FIN reset, its RSTs dropped) and the peer waited for
        // its own timeout (issue 21, item 4). Now the connection is released (every packet
        // passes untouched: the application's kernel answers the peer's next segment with a RST
        // that reaches it) and, when the peer's latest ACK is known (its RCV.NXT, the SEQ its
        // TCP accepts a RST at, RFC 5961), a RST goes to the peer at once. Only for a state that
        // no protecting command named before and that never witnessed the connection (Δ = 0 is
        // then the application's word: it holds no record, so this socket was never
        // recovered); a guard that did see the handshake keeps the plain SHUTDOWN's meaning.
        if cmd.op == ctl::Op::Shutdown && cmd.flags & ctl::flag::ABANDON != 0 && !claimed_before && !e.unprotected {
            use unbroken_engines::rtcp::flag;
            let witnessed = e.conn.flags & (flag::SYNCED | flag::ACK_ALLOWED) == flag::SYNCED | flag::ACK_ALLOWED;
            if !witnessed {
                e.unprotected = true;
                let rst = (e.conn.flags & flag::RECOVERABLE != 0).then(|| {
                    let r = unbroken_wire::tcp::Repr { src_port: cmd.app.port(), dst_port: cmd.peer.port(), seq: Seq(e.conn.ack_b), flags: unbroken_wire::tcp::flags::RST, ..Default::default() };
                    emit_bare(ack_buf, cmd.app.ip(), cmd.peer.ip(), &r)
                });
                let reply = rtcp::command(&mut Conn::default(), &cmd, &mut []).reply;
                self.counters.abandoned_released += 1;
                self.counters.commands_answered += 1;
                let ack_len = rst.flatten();
                if ack_len.is_some() {
                    self.counters.abandoned_peer_reset += 1;
                }
                let reply = Command { time_ms: wall_ms, ..reply };
                return reply.encode(&self.key).ok().map(|reply| CommandOut { reply: reply.to_vec(), ack_len });
            }
        }
        let res = rtcp::command(&mut e.conn, &cmd, ack_buf);
        if cmd.op == ctl::Op::Tell && std::mem::take(&mut e.nudge) && nudging {
            if let Some(n) = nudge(&e.conn, e.peer_hi, cmd.app, cmd.peer, ack_buf) {
                self.counters.recovery_nudges += 1;
                self.counters.commands_answered += 1;
                let reply = Command { time_ms: wall_ms, ..res.reply };
                return reply.encode(&self.key).ok().map(|reply| CommandOut { reply: reply.to_vec(), ack_len: Some(n) });
            }
        }
        if cmd.op == ctl::Op::Clear {
            if let Some(e) = self.table.remove(&key) {
                self.fast_forget(key, e.fast);
            }
        }
        if res.ack_len.is_some() {
            self.counters.acks_injected += 1;
        }
        let reply = Command { time_ms: wall_ms, ..res.reply };
        self.counters.commands_answered += 1;
        reply.encode(&self.key).ok().map(|reply| CommandOut { reply: reply.to_vec(), ack_len: res.ack_len })
    }
}

/// What a segment from the peer tells about the end of its data: a data segment's start and
/// end; a pure ACK's SEQ is the peer's SND.NXT (its challenge ACK to a recovery SYN included,
/// the only thing a restarted guard may see of it before its RTO), standing for a last segment
/// of `mss` bytes ending there.
fn peer_segment(seg: &[u8], mss: u16) -> Option<(u32, u32)> {
    use unbroken_wire::tcp::flags as F;
    let t = Tcp::new_checked(seg).ok()?;
    let len = t.payload().len() as u32;
    let seq = t.seq().0;
    if len > 0 {
        return Some((seq, seq.wrapping_add(len)));
    }
    let f = t.flags();
    (f & F::ACK != 0 && f & (F::SYN | F::FIN | F::RST) == 0).then(|| (seq.wrapping_sub(mss.max(536) as u32), seq))
}

/// The recovery nudge. When the application dies, the bytes its kernel had received beyond the
/// checkpoint are lost with it, and the peer resends them only when its retransmission timer
/// fires: its tail loss probe went out (and was lost) while the application was down, and pure
/// duplicate ACKs do not count on a SACK connection, so nothing else makes it resend. That was
/// the slow half of the recoveries (a further 60-390 ms: the peer's RTO, at least 200 ms on
/// Linux). Once the recovered socket is connected (its TELL), an ACK of the checkpoint with a
/// SACK block naming the peer's last segment makes the peer's loss detection (RACK, RFC 6675)
/// mark everything before it lost and resend it at once. That block claims one segment the
/// application has not got: the peer keeps it in its retransmission queue (SACKed bytes are
/// released only when cumulatively acknowledged), and when the cumulative ACK reaches it the
/// peer sees the SACK reneged and resends it (Linux: after max(srtt/16, 10 ms)). No byte is
/// skipped or changed. Only on SACK connections, and only when the peer has data in flight
/// beyond the checkpoint.
fn nudge(c: &Conn, peer_hi: Option<(u32, u32)>, app: SocketAddr, peer: SocketAddr, buf: &mut [u8]) -> Option<usize> {
    use unbroken_engines::rtcp::flag;
    use unbroken_wire::tcp::{flags as F, Repr};
    let need = flag::SACK_OK | flag::RECOVERABLE | flag::ACK_ALLOWED | flag::SYNCED;
    if c.flags & need != need || c.flags & (flag::SYN_PENDING | flag::ACK_EVERYTHING) != 0 {
        return None;
    }
    let (start, end) = peer_hi?;
    let ack = Seq(c.ack_a);
    if !Seq(end).gt(ack + 1) {
        return None;
    }
    let start = if Seq(start).gt(ack) { Seq(start) } else { ack + 1 };
    let ts = (c.flags & (flag::TS_OK | flag::TS_A_KNOWN | flag::TS_B_KNOWN) == flag::TS_OK | flag::TS_A_KNOWN | flag::TS_B_KNOWN).then_some((c.ts_a, c.ts_b));
    let mut sack = [(Seq(0), Seq(0)); 4];
    sack[0] = (start, Seq(end));
    // A restarted guard may get the TELL before the new socket's first ACK: then announce the
    // 64 KB a new Linux socket opens with (in the scale the peer applies); the socket's own
    // ACKs follow at once.
    let window = if c.flags & flag::A_WIN_KNOWN != 0 {
        c.a_win
    } else {
        let ws = c.options().and_then(|o| o.app_wscale).unwrap_or(0);
        (0xffff_u32 >> ws.min(14)) as u16
    };
    let r = Repr { src_port: app.port(), dst_port: peer.port(), seq: Seq(c.ack_b), ack, flags: F::ACK, window, timestamp: ts, sack, sack_len: 1, ..Default::default() };
    let tl = r.header_len();
    let hl = ip::emit_header(buf, app.ip(), peer.ip(), ip::PROTO_TCP, tl).ok()?;
    r.emit(&mut buf[hl..hl + tl]).ok()?;
    Tcp::new_checked(&mut buf[hl..hl + tl]).ok()?.fill_checksum(ip::pseudo_sum(app.ip(), peer.ip(), ip::PROTO_TCP, tl));
    Some(hl + tl)
}

/// The flags and ACK field of a TCP segment, if it is long enough.
fn tcp_flags_ack(seg: &[u8]) -> Option<(u8, u32)> {
    (seg.len() >= 20).then(|| (seg[13], u32::from_be_bytes([seg[8], seg[9], seg[10], seg[11]])))
}

/// The DSCP of an IPv4 or IPv6 packet.
fn dscp(pkt: &[u8]) -> Option<u8> {
    match pkt.first()? >> 4 {
        4 => Some(pkt.get(1)? >> 2),
        6 => Some((((pkt[0] & 0x0f) << 4) | (pkt.get(1)? >> 4)) >> 2),
        _ => None,
    }
}

/// Writes a TCP segment without payload `src -> dst` into `buf`, checksums filled, without
/// allocating. Returns its length.
fn emit_bare(buf: &mut [u8], src: IpAddr, dst: IpAddr, r: &unbroken_wire::tcp::Repr) -> Option<usize> {
    let tl = r.header_len();
    let hl = ip::emit_header(buf, src, dst, ip::PROTO_TCP, tl).ok()?;
    r.emit(buf.get_mut(hl..hl + tl)?).ok()?;
    Tcp::new_checked(&mut buf[hl..hl + tl]).ok()?.fill_checksum(ip::pseudo_sum(src, dst, ip::PROTO_TCP, tl));
    Some(hl + tl)
}

pub use crate::checkpoint::runtime::run;

/// The guard as a queue daemon's mode ([`crate::daemon`]): a packet is [`Core::packet_with`],
/// time expires closed connections once a second; it asks nothing of an adapter (its side
/// channel runs on threads of its own that share the core).
impl crate::daemon::Mode for Core {
    type Request = ();

    fn packet(&mut self, now_ms: u64, meta: crate::daemon::Meta, pkt: &mut [u8], len: usize, _: &mut crate::daemon::Outbox<()>) -> (Verdict, usize) {
        use unbroken_drivers::fastpath::checkpoint::{MARK_DONE, MARK_SLOW};
        // Decided on the fast path already (the steering chain RETURNs such packets; were it
        // changed by hand): never rewritten twice.
        if meta.mark & MARK_DONE != 0 && self.fast_path_on() {
            self.counters.fast_done_queued += 1;
            return (Verdict::Accept { modified: false }, len);
        }
        let counted = meta.mark & MARK_SLOW != 0;
        self.packet_fast(pkt, len, now_ms, meta.csum_not_ready, counted)
    }

    fn after_flush(&mut self, now_ms: u64) {
        self.fast_after_flush(now_ms);
    }

    fn tick(&mut self, now_ms: u64, _: &mut crate::daemon::Outbox<()>) {
        self.fast_tick(now_ms);
        if now_ms.saturating_sub(self.last_expire_ms) >= 1000 {
            self.expire(now_ms);
            self.last_expire_ms = now_ms;
        }
    }

    fn io_event(&mut self, ev: crate::daemon::IoEvent) -> u64 {
        use crate::daemon::IoEvent;
        let c = &mut self.counters;
        match ev {
            IoEvent::FullChecksum => {
                c.full_checksums += 1;
                c.full_checksums
            }
            IoEvent::InjectFailed => {
                c.inject_errors += 1;
                c.inject_errors
            }
            // The core gives neither Held nor Unknown; were it to, the packet is dropped.
            IoEvent::VerdictFallback | IoEvent::Undecided => {
                c.verdict_fallbacks += 1;
                c.verdict_fallbacks
            }
            IoEvent::Truncated(len) => {
                self.refuse(Error::Truncated, len);
                self.counters.malformed
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use unbroken_wire::ctl::Op;
    use unbroken_wire::tcp::{flags as F, Repr};
    use unbroken_wire::Seq;

    fn key() -> Key {
        Key::from_hex("00112233445566778899aabbccddeeff").unwrap()
    }
    fn core() -> Core {
        let svc = [Service { addr: "10.0.2.10".parse().unwrap(), port: 7000 }];
        Core::new(&svc, key(), vec![Prefix::parse("10.0.2.0/24").unwrap()], 30_000, 1000, 1000)
    }
    fn app() -> SocketAddr {
        "10.0.2.10:7000".parse().unwrap()
    }
    fn peer() -> SocketAddr {
        "10.0.1.2:41000".parse().unwrap()
    }
    fn from_app() -> SocketAddr {
        "10.0.2.11:5555".parse().unwrap()
    }
    fn pkt(src: SocketAddr, dst: SocketAddr, r: Repr) -> (Vec<u8>, usize) {
        let r = Repr { src_port: src.port(), dst_port: dst.port(), ..r };
        let tl = r.header_len();
        let mut b = vec![0u8; 20 + tl + 64];
        ip::emit_header(&mut b, src.ip(), dst.ip(), 6, tl).unwrap();
        r.emit(&mut b[20..]).unwrap();
        Tcp::new_checked(&mut b[20..20 + tl]).unwrap().fill_checksum(ip::pseudo_sum(src.ip(), dst.ip(), 6, tl));
        (b, 20 + tl)
    }
    /// The recovering app's ACKNOWLEDGE (the SDK's first step: announces the recovery SYN).
    fn recovery_ack(nonce: u64, ack_a: u32) -> Vec<u8> {
        let mut c = Command::request(Op::Acknowledge, app(), peer(), nonce, 1);
        c.ack_a = ack_a;
        c.flags = ctl::flag::RECOVERY;
        c.encode(&key()).unwrap().to_vec()
    }
    fn cmd(op: Op, nonce: u64, t: u64) -> Vec<u8> {
        let mut c = Command::request(op, app(), peer(), nonce, t);
        c.ack_a = 1001;
        c.encode(&key()).unwrap().to_vec()
    }

    #[test]
    fn commands_are_authenticated_fresh_unique_and_from_allowed_sources() {
        let mut c = core();
        let mut ack = [0u8; 128];
        let now = 1_000_000;
        assert!(c.command("10.9.9.9:1".parse().unwrap(), &cmd(Op::Acknowledge, 1, now), now, 0, &mut ack).is_none());
        assert_eq!(c.counters.cmd_rejected_source, 1);
        // A bad MAC or a stale clock is refused: no response, only a small unauthenticated
        // refusal naming the reason (see hostile_wrong_key_or_clock_gets_a_small_rate_limited_refusal).
        let mut bad = cmd(Op::Acknowledge, 2, now);
        bad[70] ^= 1;
        let out = c.command(from_app(), &bad, now, 0, &mut ack).expect("a refusal");
        assert!(Command::decode(&out.reply, &key()).is_err() && out.ack_len.is_none());
        assert_eq!(c.counters.cmd_rejected_auth, 1);
        let out = c.command(from_app(), &cmd(Op::Acknowledge, 3, now - 60_000), now, 0, &mut ack).expect("a refusal");
        assert!(Command::decode(&out.reply, &key()).is_err());
        assert_eq!(c.counters.cmd_rejected_stale, 1);
        let ok = c.command(from_app(), &cmd(Op::Acknowledge, 4, now), now, 0, &mut ack).expect("answered");
        let r = Command::decode(&ok.reply, &key()).unwrap();
        assert!(r.response && r.nonce == 4 && r.ack_a == 1001 && r.status == 0);
        assert!(c.command(from_app(), &cmd(Op::Acknowledge, 4, now), now, 0, &mut ack).is_none(), "replayed nonce");
        assert_eq!(c.counters.cmd_rejected_replay, 1);
        assert!(c.command(from_app(), b"short garbage", now, 0, &mut ack).is_none());
        assert_eq!(c.counters.cmd_malformed, 1);
        // A response datagram sent back at the guard is not a command.
        assert!(c.command(from_app(), &ok.reply, now, 0, &mut ack).is_none());
    }

    /// Issue 9, checkpoint misconfiguration: an application with the wrong key (or clock) learns
    /// why the guard refuses it from a refusal no larger than its request, bound to its nonce,
    /// at most NAK_PER_SEC per second; nothing is answered to garbage or to a source outside
    /// allowed_sources; the refusal changes no state.
    #[test]
    fn hostile_wrong_key_or_clock_gets_a_small_rate_limited_refusal() {
        let mut c = core();
        let now = 1_000_000;
        let wrong = Key::from_hex("ffeeddccbbaa99887766554433221100").unwrap();
        let req = |nonce: u64, t: u64| Command::request(Op::Tell, app(), peer(), nonce, t).encode(&wrong).unwrap();
        let out = c.command(from_app(), &req(7, now), now, 0, &mut [0u8; 128]).expect("a refusal");
        assert!(out.reply.len() <= ctl::LEN && out.reply.len() == ctl::NAK_LEN);
        let nak = ctl::Nak::decode(&out.reply).unwrap();
        assert_eq!((nak.op, nak.refusal, nak.nonce), (Op::Tell as u8, ctl::refusal::KEY, 7));
        // The right key but a clock 60 s off: refused for the clock.
        let stale = Command::request(Op::Tell, app(), peer(), 8, now - 60_000).encode(&key()).unwrap();
        let nak = ctl::Nak::decode(&c.command(from_app(), &stale, now, 0, &mut [0u8; 128]).unwrap().reply).unwrap();
        assert_eq!((nak.refusal, nak.nonce), (ctl::refusal::CLOCK, 8));
        // Garbage and strangers get nothing.
        assert!(c.command(from_app(), &[0x55u8; 96], now, 0, &mut [0u8; 128]).is_none());
        assert!(c.command("10.9.9.9:1".parse().unwrap(), &req(9, now), now, 0, &mut [0u8; 128]).is_none());
        // A flood: at most NAK_PER_SEC answers (the two above included), then again a second later.
        let answered = (0..100).filter(|i| c.command(from_app(), &req(100 + i, now), now, 0, &mut [0u8; 128]).is_some()).count();
        assert_eq!(answered as u64, NAK_PER_SEC - 2);
        assert_eq!(c.counters.naks_rate_limited, 100 - (NAK_PER_SEC - 2));
        assert!(c.command(from_app(), &req(500, now), now, 1000, &mut [0u8; 128]).is_some());
        assert_eq!(c.connections(), 0, "no state created");
    }

    /// Issue 9, checkpoint misconfiguration: an application that could not protect a connection
    /// (wrong key or guard address) marks it (UNPROTECTED_DSCP); its FIN then reaches the peer
    /// instead of being turned into a RST for the application, and everything passes
    /// untouched. The mark cannot unprotect a connection an authenticated command named, or one
    /// that needs renumbering.
    #[test]
    fn hostile_unprotected_mark_releases_only_an_unclaimed_connection() {
        let handshake = |c: &mut Core, p: SocketAddr| {
            let (mut b, n) = pkt(p, app(), Repr { seq: Seq(100), flags: F::SYN, mss: Some(1460), ..Default::default() });
            c.packet(&mut b, n, 0);
            let (mut b, n) = pkt(app(), p, Repr { seq: Seq(5000), ack: Seq(101), flags: F::SYN | F::ACK, mss: Some(1460), ..Default::default() });
            c.packet(&mut b, n, 0);
            let (mut b, n) = pkt(p, app(), Repr { seq: Seq(101), ack: Seq(5001), flags: F::ACK, window: 100, ..Default::default() });
            c.packet(&mut b, n, 0);
        };
        let marked_fin = |c: &mut Core, p: SocketAddr| {
            let (mut b, n) = pkt(app(), p, Repr { seq: Seq(5001), ack: Seq(101), flags: F::FIN | F::ACK, window: 50, ..Default::default() });
            b[1] = ctl::UNPROTECTED_DSCP << 2;
            unbroken_wire::ipv4::Packet::new_checked(&mut b[..n]).unwrap().fill_checksum();
            let (a, len) = c.packet(&mut b, n, 1);
            (a, b[..len].to_vec())
        };
        let mut c = core();
        handshake(&mut c, peer());
        let (a, out) = marked_fin(&mut c, peer());
        assert_eq!(a, Verdict::Accept { modified: false }, "the FIN goes to the peer");
        assert_eq!(IpInfo::parse(&out).unwrap().dst, peer().ip());
        assert_eq!(c.counters.unprotected_released, 1);
        // From then on the connection is not the guard's: the peer's FIN and the app's RST pass.
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(101), ack: Seq(5002), flags: F::FIN | F::ACK, window: 100, ..Default::default() });
        assert_eq!(c.packet(&mut b, n, 2).0, Verdict::Accept { modified: false });
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(5002), flags: F::RST, ..Default::default() });
        assert_eq!(c.packet(&mut b, n, 3).0, Verdict::Accept { modified: false });
        let adopt = Command::request(Op::Adopt, app(), "0.0.0.0:0".parse().unwrap(), 90, 1).encode(&key()).unwrap();
        let r = Command::decode(&c.command(from_app(), &adopt, 1, 4, &mut [0u8; 128]).unwrap().reply, &key()).unwrap();
        assert_eq!(r.status, Status::NoConnection as u8, "not offered for adoption");

        // TELLs only ask: after TELLs whose answers were lost (a one-way side channel), the mark
        // still releases the connection. (The journal lab test no longer shows this end to end:
        // after its failed start-up check the SDK sends no TELL for a connection.)
        let mut c = core();
        handshake(&mut c, peer());
        c.command(from_app(), &cmd(Op::Tell, 90, 1), 1, 0, &mut [0u8; 128]).unwrap();
        c.command(from_app(), &cmd(Op::Tell, 91, 1), 1, 0, &mut [0u8; 128]).unwrap();
        assert_eq!(marked_fin(&mut c, peer()).0, Verdict::Accept { modified: false });
        assert_eq!((c.counters.unprotected_released, c.counters.hostile_unprotect_refused), (1, 0));

        // A connection its application protects (an authenticated checkpoint): the mark is
        // ignored, the FIN is still a spurious one (a RST for the app), and counted.
        let mut c = core();
        handshake(&mut c, peer());
        c.command(from_app(), &cmd(Op::Tell, 90, 1), 1, 0, &mut [0u8; 128]).unwrap();
        c.command(from_app(), &cmd_ack(Op::Acknowledge, 91, 101), 1, 0, &mut [0u8; 128]).unwrap();
        assert_eq!(marked_fin(&mut c, peer()).0, Verdict::Inject);
        assert_eq!((c.counters.unprotected_released, c.counters.hostile_unprotect_refused), (0, 1));
        // A recovered connection (renumbered) after a guard restart, not yet claimed: ignored.
        let mut c = core();
        let (_, ack_a) = announced_recovery(&mut c);
        assert_eq!(syn_from_app(&mut c, 77, 20), Verdict::Inject);
        let k = FlowKey { app: app(), peer: peer() };
        c.table.get_mut(&k).unwrap().claimed = false;
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(78), ack: Seq(ack_a), flags: F::FIN | F::ACK, window: 50, ..Default::default() });
        b[1] = ctl::UNPROTECTED_DSCP << 2;
        unbroken_wire::ipv4::Packet::new_checked(&mut b[..n]).unwrap().fill_checksum();
        assert_eq!(c.packet(&mut b, n, 30).0, Verdict::Inject);
        assert_eq!(c.counters.hostile_unprotect_refused, 1);
    }

    /// Issue 9, checkpoint misconfiguration: a one-way or lossy side channel. The SDK's TELL
    /// reached the guard, its answer did not; the SDK gave up and marked the socket
    /// unprotected. The mark must release the connection (a TELL does not protect anything),
    /// or the guard holds the application's FIN and the peer hangs.
    #[test]
    fn hostile_tell_whose_answer_was_lost_then_mark_releases_the_connection() {
        let mut c = core();
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(100), flags: F::SYN, mss: Some(1460), ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(5000), ack: Seq(101), flags: F::SYN | F::ACK, mss: Some(1460), ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(101), ack: Seq(5001), flags: F::ACK, window: 100, ..Default::default() });
        c.packet(&mut b, n, 0);
        // Three TELLs (the SDK's retries), every answer lost on the way back.
        for nonce in 40..43 {
            assert!(c.command(from_app(), &cmd(Op::Tell, nonce, 1), 1, 0, &mut [0u8; 128]).is_some());
        }
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(5001), ack: Seq(101), flags: F::FIN | F::ACK, window: 50, ..Default::default() });
        b[1] = ctl::UNPROTECTED_DSCP << 2;
        unbroken_wire::ipv4::Packet::new_checked(&mut b[..n]).unwrap().fill_checksum();
        let (a, len) = c.packet(&mut b, n, 1);
        assert_eq!(a, Verdict::Accept { modified: false }, "the application's FIN reaches the peer");
        assert_eq!(IpInfo::parse(&b[..len]).unwrap().dst, peer().ip());
        assert_eq!((c.counters.unprotected_released, c.counters.hostile_unprotect_refused), (1, 0));
    }

    #[test]
    fn tell_for_unknown_connection_and_unprotected_app() {
        let mut c = core();
        let mut ack = [0u8; 128];
        let out = c.command(from_app(), &cmd(Op::Tell, 9, 5), 5, 0, &mut ack).unwrap();
        assert_eq!(Command::decode(&out.reply, &key()).unwrap().status, Status::NoConnection as u8);
        assert_eq!(c.connections(), 0, "TELL does not create state");
        let mut other = Command::request(Op::Shutdown, "10.0.2.10:22".parse().unwrap(), peer(), 10, 5);
        other.ack_a = 1;
        let out = c.command(from_app(), &other.encode(&key()).unwrap(), 5, 0, &mut ack).unwrap();
        assert_eq!(Command::decode(&out.reply, &key()).unwrap().status, Status::BadRequest as u8);
    }

    #[test]
    fn adopt_hands_over_unclaimed_connections_in_order() {
        let mut c = core();
        let mut ack = [0u8; 128];
        // Two peers complete handshakes with the service; nobody TELLs.
        for port in [41001u16, 41000] {
            let p = SocketAddr::new(peer().ip(), port);
            let (mut b, n) = pkt(p, app(), Repr { seq: Seq(100), flags: F::SYN, mss: Some(1400), ..Default::default() });
            c.packet(&mut b, n, 0);
            let (mut b, n) = pkt(app(), p, Repr { seq: Seq(900), ack: Seq(101), flags: F::SYN | F::ACK, mss: Some(1400), ..Default::default() });
            c.packet(&mut b, n, 0);
            let (mut b, n) = pkt(p, app(), Repr { seq: Seq(101), ack: Seq(901), flags: F::ACK, window: 5, ..Default::default() });
            c.packet(&mut b, n, 0);
        }
        let adopt = |c: &mut Core, cursor: SocketAddr, nonce: u64| {
            let cmd = Command::request(Op::Adopt, app(), cursor, nonce, 1);
            let out = c.command(from_app(), &cmd.encode(&key()).unwrap(), 1, 0, &mut [0u8; 128]).unwrap();
            Command::decode(&out.reply, &key()).unwrap()
        };
        let r1 = adopt(&mut c, "0.0.0.0:0".parse().unwrap(), 20);
        assert_eq!((r1.status, r1.peer.port(), r1.ack_a, r1.ack_b), (0, 41000, 101, 901));
        let r2 = adopt(&mut c, r1.peer, 21);
        assert_eq!(r2.peer.port(), 41001);
        assert_eq!(adopt(&mut c, r2.peer, 22).status, Status::NoConnection as u8);
        // A TELL claims 41000: ADOPT no longer offers it.
        let tell = Command::request(Op::Tell, app(), r1.peer, 23, 1);
        c.command(from_app(), &tell.encode(&key()).unwrap(), 1, 0, &mut ack).unwrap();
        assert_eq!(adopt(&mut c, "0.0.0.0:0".parse().unwrap(), 24).peer.port(), 41001);
    }

    /// Issue 21, item 3: the application's kernel answered the peer's SYN, the application died
    /// before the peer's handshake ACK arrived. ADOPT offers the connection with ackB0 = the
    /// SYN-ACK's SEQ + 1 (not one whose SYN-ACK never went out); the recovery SYN is forwarded
    /// and the peer's challenge ACK comes back as the SYN-ACK the new socket waits for.
    #[test]
    fn adopt_offers_a_connection_inside_its_handshake_and_recovers_it() {
        let mut c = core();
        let adopt = |c: &mut Core, nonce: u64| {
            let cmd = Command::request(Op::Adopt, app(), "0.0.0.0:0".parse().unwrap(), nonce, 1);
            let out = c.command(from_app(), &cmd.encode(&key()).unwrap(), 1, 0, &mut [0u8; 128]).unwrap();
            Command::decode(&out.reply, &key()).unwrap()
        };
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(100), flags: F::SYN, mss: Some(1400), ..Default::default() });
        c.packet(&mut b, n, 0);
        assert_eq!(adopt(&mut c, 20).status, Status::NoConnection as u8, "no SYN-ACK went out: the peer resends its SYN to the new listener");
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(900), ack: Seq(101), flags: F::SYN | F::ACK, mss: Some(1400), ..Default::default() });
        c.packet(&mut b, n, 0);
        let r = adopt(&mut c, 21);
        assert_eq!((r.status, r.peer, r.ack_a, r.ack_b), (0, peer(), 101, 901));
        // The SDK's recover: ACKNOWLEDGE (announces the SYN), connect, TELL.
        assert!(c.command(from_app(), &recovery_ack(22, 101), 1, 0, &mut [0u8; 128]).is_some());
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(5000), flags: F::SYN, mss: Some(1400), ..Default::default() });
        let (v, n) = c.packet(&mut b, n, 1);
        assert_eq!(v, Verdict::Accept { modified: true }, "forwarded: the peer's answer says where it is");
        assert_eq!(Tcp::new_checked(&b[20..n]).unwrap().seq(), Seq(900), "with the old ISN, whatever the peer got");
        // The peer, established, answers with a challenge ACK: it becomes the SYN-ACK.
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(101), ack: Seq(901), flags: F::ACK, window: 5, ..Default::default() });
        let (v, n) = c.packet(&mut b, n, 2);
        assert_eq!(v, Verdict::Accept { modified: true });
        let t = Tcp::new_checked(&b[20..n]).unwrap();
        assert_eq!((t.flags(), t.seq(), t.ack()), (F::SYN | F::ACK, Seq(100), Seq(5001)));
        assert_eq!(c.counters.recovered_from_peer_ack, 1);
        let tell = Command::request(Op::Tell, app(), peer(), 23, 1);
        let out = c.command(from_app(), &tell.encode(&key()).unwrap(), 1, 0, &mut [0u8; 128]).unwrap();
        let r = Command::decode(&out.reply, &key()).unwrap();
        assert_eq!((r.ack_a, r.ack_b), (101, 901), "delivered = ackB - ackB0 = 0");
    }

    /// Issue 21, item 4: a guard that restarted between the peer's SYN and the first TELL cannot
    /// protect the connection; the application's failing `establish` sends SHUTDOWN with
    /// ABANDON. The guard releases the connection (the application's RST passes) and resets the
    /// peer at once, at the SEQ of the peer's latest ACK. On a connection whose handshake the
    /// guard saw, or that a protecting command named, the flag changes nothing (a plain SHUTDOWN).
    #[test]
    fn hostile_abandon_releases_only_a_connection_the_guard_cannot_protect() {
        use unbroken_engines::rtcp::flag;
        let abandon = |nonce: u64| {
            let mut c = Command::request(Op::Shutdown, app(), peer(), nonce, 1);
            c.flags = ctl::flag::ABANDON;
            c.encode(&key()).unwrap().to_vec()
        };
        // A restarted guard: the peer's data arrives (the I0 probe), then the application's TELL
        // finds no checkpoint and it gives up.
        let mut c = core();
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(101), ack: Seq(901), flags: F::ACK, window: 5, ..Default::default() });
        c.packet(&mut b, n, 0);
        let mut ack = [0u8; 128];
        let out = c.command(from_app(), &abandon(30), 1, 0, &mut ack).unwrap();
        let n = out.ack_len.expect("a RST for the peer");
        let t = Tcp::new_checked(&ack[20..n]).unwrap();
        assert_eq!((t.src_port(), t.dst_port(), t.flags(), t.seq()), (7000, 41000, F::RST, Seq(901)));
        assert_eq!((c.counters.abandoned_released, c.counters.abandoned_peer_reset), (1, 1));
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(901), flags: F::RST, ..Default::default() });
        assert_eq!(c.packet(&mut b, n, 2).0, Verdict::Accept { modified: false }, "the application's RST reaches the peer");
        // A guard that saw the handshake: a plain SHUTDOWN (the mark or the FIN end it).
        let mut c = core();
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(100), flags: F::SYN, ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(900), ack: Seq(101), flags: F::SYN | F::ACK, ..Default::default() });
        c.packet(&mut b, n, 0);
        let out = c.command(from_app(), &abandon(31), 1, 0, &mut ack).unwrap();
        assert!(out.ack_len.is_none());
        assert_ne!(c.conn(&FlowKey { app: app(), peer: peer() }).unwrap().flags & flag::FIN_ALLOWED, 0);
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(901), flags: F::RST, ..Default::default() });
        assert_eq!(c.packet(&mut b, n, 2).0, Verdict::Drop, "O1 as before");
        // A connection an application checkpointed (it has a record): never released.
        let mut c = core();
        assert!(c.command(from_app(), &recovery_ack(32, 101), 1, 0, &mut ack).is_some());
        assert!(c.command(from_app(), &abandon(33), 1, 0, &mut ack).unwrap().ack_len.is_none());
        assert_eq!(c.counters.abandoned_released, 0);
    }

    /// Issue 21, item 4: a guard that restarted inside a handshake meets the peer's handshake
    /// ACK first. It passes unprobed (so the application's half-open socket completes and the
    /// application gets to see, and give up, the connection); the peer's next packet gets the
    /// I0 probe as before.
    #[test]
    fn the_peers_first_packet_on_an_unknown_connection_passes_unprobed() {
        let mut c = core();
        let hs = Repr { seq: Seq(101), ack: Seq(901), flags: F::ACK, window: 5, ..Default::default() };
        let (mut b, n) = pkt(peer(), app(), hs);
        let orig = b[..n].to_vec();
        assert_eq!(c.packet(&mut b, n, 0), (Verdict::Accept { modified: false }, n));
        assert_eq!(&b[..n], &orig[..], "untouched");
        assert_eq!(c.counters.peer_first_unprobed, 1);
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(101), ack: Seq(901), flags: F::ACK | F::PSH, window: 5, ..Default::default() });
        let (v, m) = c.packet(&mut b, n, 1);
        assert_eq!(v, Verdict::Accept { modified: true });
        assert_eq!(Tcp::new_checked(&b[20..m]).unwrap().seq(), Seq(101) + 0x8000_0000, "the I0 probe");
        assert_eq!((c.counters.peer_first_unprobed, c.counters.peer_without_state), (1, 1));
    }

    /// Issue 21, item 4's double fault: the application died before its first TELL and the guard
    /// restarted before it was back; the restarted application has no record. Its host's RSTs
    /// for the peer's segments are dropped (O1) until the connection stayed unclaimed for
    /// `unclaimed_reset_ms` after this guard first saw it; the first one after passes (its
    /// SEQ is the peer's segment's ACK) and the connection is released. An eviction does not
    /// restart the clock; 0 turns it off.
    #[test]
    fn unclaimed_connection_ends_with_the_app_hosts_reset_after_the_bound() {
        let bound = UNCLAIMED_RESET_MS;
        let peer_data = |c: &mut Core, at: u64| {
            let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(101), ack: Seq(901), flags: F::ACK | F::PSH, window: 5, ..Default::default() });
            c.packet(&mut b, n, at).0
        };
        let app_rst = |c: &mut Core, at: u64| {
            let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(901), flags: F::RST, ..Default::default() });
            c.packet(&mut b, n, at)
        };
        let mut c = core();
        peer_data(&mut c, 1_000);
        assert_eq!(app_rst(&mut c, 1_000).0, Verdict::Drop, "O1: the application may still recover it");
        assert_eq!(app_rst(&mut c, 1_000 + bound - 1).0, Verdict::Drop);
        // The table forgets the entry (a SYN flood, max_connections): the clock goes on.
        c.table.clear();
        peer_data(&mut c, 1_000 + bound - 1);
        let (v, n) = app_rst(&mut c, 1_000 + bound);
        assert_eq!((v, n), (Verdict::Accept { modified: false }, 40), "the reset reaches the peer");
        assert_eq!(c.counters.unclaimed_released, 1);
        assert_eq!(peer_data(&mut c, 1_000 + bound + 1), Verdict::Accept { modified: false }, "released: untouched from now on");
        // The clocks are bounded like the table (max_connections 1000 here): a flood of forged
        // packets for other 4-tuples pushes out the oldest, whose clock then starts again.
        let mut c = core();
        peer_data(&mut c, 0);
        for port in 0..3000u16 {
            let (mut b, n) = pkt(SocketAddr::new(peer().ip(), 20_000 + port), app(), Repr { seq: Seq(7), ack: Seq(9), flags: F::ACK, window: 5, ..Default::default() });
            c.packet(&mut b, n, 1);
        }
        assert!(c.unknown_since.len() <= 1000 && c.unknown_order.len() <= 2 * 1000 + 1024 + 1, "{} {}", c.unknown_since.len(), c.unknown_order.len());
        peer_data(&mut c, 2);
        assert_eq!(app_rst(&mut c, bound).0, Verdict::Drop, "its clock started again at 2 ms");
        assert_eq!(app_rst(&mut c, bound + 2).0, Verdict::Accept { modified: false });
        // A packet with a bad checksum starts no clock.
        let mut c = core();
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(101), ack: Seq(901), flags: F::ACK | F::PSH, window: 5, ..Default::default() });
        b[20 + 16] ^= 0xff;
        c.packet(&mut b, n, 0);
        assert!(c.unknown_since.is_empty());
        // Off: never.
        let mut c = core();
        c.unclaimed_reset_ms = 0;
        peer_data(&mut c, 0);
        assert_eq!(app_rst(&mut c, 10 * bound).0, Verdict::Drop);
        assert_eq!(c.counters.unclaimed_released, 0);
    }

    /// What the bound must never release: a connection whose handshake this guard saw (the
    /// application crashed: it recovers through its record, O1 holds its host's RSTs however
    /// long it takes), one an authenticated command named (a checkpoint, a recovery announced)
    /// or that the application asked about (TELL: it is alive and ends it itself). Forged peer
    /// packets change none of that: they can only start the clock of a connection nobody holds.
    #[test]
    fn hostile_unclaimed_bound_never_releases_a_claimed_or_witnessed_connection() {
        let bound = UNCLAIMED_RESET_MS;
        let app_rst = |c: &mut Core, at: u64| {
            let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(901), flags: F::RST, ..Default::default() });
            c.packet(&mut b, n, at).0
        };
        let forged_peer = |c: &mut Core, at: u64| {
            let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(7), ack: Seq(12345), flags: F::ACK, window: 5, ..Default::default() });
            c.packet(&mut b, n, at);
        };
        // Witnessed: the handshake went through this guard; the application crashed after.
        let mut c = core();
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(100), flags: F::SYN, ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(900), ack: Seq(101), flags: F::SYN | F::ACK, ..Default::default() });
        c.packet(&mut b, n, 0);
        forged_peer(&mut c, 1);
        assert_eq!(app_rst(&mut c, 3 * bound), Verdict::Drop);
        // Claimed by a recovery announcement, or asked about by a TELL, on a restarted guard.
        for cmd in [recovery_ack(40, 101), Command::request(Op::Tell, app(), peer(), 41, 1).encode(&key()).unwrap().to_vec()] {
            let mut c = core();
            forged_peer(&mut c, 0);
            let _ = c.command(from_app(), &cmd, 1, 0, &mut [0u8; 128]);
            forged_peer(&mut c, 1);
            assert_eq!(app_rst(&mut c, 3 * bound), Verdict::Drop);
        }
        assert_eq!(c.counters.unclaimed_released, 0);
    }

    /// Issue 21, item 5: the nonce cache dies with the guard; a datagram captured before a
    /// restart, replayed to the new guard inside the clock window, was accepted once. The new
    /// guard restored from the persisted high-water marks refuses it (and every older one of
    /// that service address, and one of the same millisecond whose nonce was seen), and accepts
    /// the application's next command. The marks survive their text form; a damaged file is an
    /// error, never a silent start without them.
    #[test]
    fn hostile_command_replayed_to_a_restarted_guard_is_refused() {
        let mut ack = [0u8; 128];
        let t = 1_000_000;
        let mut c1 = core();
        let shutdown = cmd(Op::Shutdown, 40, t);
        let earlier = cmd(Op::Acknowledge, 41, t - 5);
        assert!(c1.command(from_app(), &earlier, t, 0, &mut ack).is_some());
        assert!(c1.command(from_app(), &shutdown, t, 0, &mut ack).is_some());
        let same_ms = cmd(Op::Tell, 42, t);
        assert!(c1.command(from_app(), &same_ms, t, 0, &mut ack).is_some());
        let floors = c1.take_replay_floors().expect("raised");
        assert!(c1.take_replay_floors().is_none(), "taken once");
        assert_eq!(floors.len(), 1);
        assert_eq!((floors[0].app_ip, floors[0].time_ms, floors[0].nonces.clone()), (app().ip(), t, vec![40, 42]));
        let text = encode_replay_floors(&floors);
        assert_eq!(decode_replay_floors(&text).unwrap(), floors);
        assert!(decode_replay_floors(&text.replace(" 0 ", " 7 ")).is_err());
        assert!(decode_replay_floors("").is_err());

        // The restart: a new core, restored from the file; the replays come 10 s later.
        let mut c2 = core();
        c2.restore_replay_floors(decode_replay_floors(&text).unwrap());
        for d in [&shutdown, &earlier, &same_ms] {
            assert!(c2.command(from_app(), d, t + 10_000, 0, &mut ack).is_none());
        }
        assert_eq!((c2.counters.cmd_rejected_replay, c2.counters.cmd_rejected_replay_restart), (3, 3));
        assert!(c2.conn(&FlowKey { app: app(), peer: peer() }).is_none(), "nothing changed");
        // Another datagram of that millisecond whose nonce the old guard never saw, and the
        // application's next commands, pass.
        assert!(c2.command(from_app(), &cmd(Op::Tell, 43, t), t + 10_000, 0, &mut ack).is_some());
        assert!(c2.command(from_app(), &cmd(Op::Acknowledge, 44, t + 10_000), t + 10_000, 0, &mut ack).is_some());
        assert_eq!(c2.counters.cmd_rejected_replay, 3);
        // Without the marks (before): the captured SHUTDOWN was accepted by the new guard.
        let mut c3 = core();
        assert!(c3.command(from_app(), &shutdown, t + 10_000, 0, &mut ack).is_some());
    }

    #[test]
    fn packets_of_other_flows_pass_and_garbage_is_dropped() {
        let mut c = core();
        let (mut b, n) = pkt("10.0.1.2:1".parse().unwrap(), "10.0.2.11:2".parse().unwrap(), Repr { flags: F::ACK, ..Default::default() });
        assert_eq!(c.packet(&mut b, n, 0).0, Verdict::Accept { modified: false });
        let mut junk = vec![0x45u8, 0, 0, 10, 0, 0, 0, 0, 64, 6];
        junk.resize(80, 0);
        assert_eq!(c.packet(&mut junk, 10, 0).0, Verdict::Drop);
        assert_eq!(c.counters.malformed, 1);
    }

    /// A packet the fast path already decided (its mark bit) that reaches the queue anyway (a
    /// steering chain edited by hand, or a forged mark on this host) passes as it is: the
    /// engine never rewrites a packet a second time.
    #[test]
    fn hostile_packet_the_fast_path_decided_is_never_rewritten_again() {
        use crate::daemon::{Meta, Mode, Outbox};
        use unbroken_drivers::fastpath::checkpoint::MARK_DONE;
        /// A map that holds nothing.
        struct Empty;
        impl FastMap for Empty {
            fn take(&mut self, _: &FlowKey, _: bool) -> Option<FastTaken> {
                None
            }
            fn apply(&mut self, _: &FastOp) -> FastDone {
                FastDone::Gone
            }
        }
        // Without the fast path the bit means nothing: whoever set it (another tool on this
        // host), the engine decides the packet.
        let mut off = core();
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(5001), ack: Seq(101), flags: F::ACK, window: 50, ..Default::default() });
        let meta = Meta { id: 1, hook: 2, hw_src: None, csum_not_ready: false, mark: MARK_DONE };
        let (v, _) = Mode::packet(&mut off, 0, meta, &mut b, n, &mut Outbox::default());
        assert_ne!(v, Verdict::Accept { modified: false });
        assert_eq!((off.counters.fast_done_queued, off.counters.packets), (0, 1));
        let mut c = core();
        c.enable_fast_path(Box::new(Empty));
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(5001), ack: Seq(101), flags: F::ACK, window: 50, ..Default::default() });
        let orig = b.clone();
        let meta = Meta { id: 1, hook: 2, hw_src: None, csum_not_ready: false, mark: MARK_DONE | 0x42 };
        let (v, len) = Mode::packet(&mut c, 0, meta, &mut b, n, &mut Outbox::default());
        assert_eq!((v, len), (Verdict::Accept { modified: false }, n));
        assert_eq!(b, orig);
        assert_eq!((c.counters.fast_done_queued, c.counters.packets, c.connections()), (1, 0, 0));
        // Without the bit the same packet is the engine's (no checkpoint: O6 resets A).
        let meta = Meta { mark: 0x42, ..meta };
        let (v, _) = Mode::packet(&mut c, 0, meta, &mut b, n, &mut Outbox::default());
        assert_ne!(v, Verdict::Accept { modified: false });
        assert_eq!(c.counters.packets, 1);
    }

    #[test]
    fn crash_and_recovery_through_the_core() {
        let mut c = core();
        let syn = Repr { seq: Seq(100), flags: F::SYN, mss: Some(1460), wscale: Some(7), ..Default::default() };
        let (mut b, n) = pkt(peer(), app(), syn);
        assert_eq!(c.packet(&mut b, n, 0).0, Verdict::Accept { modified: false });
        let synack = Repr { seq: Seq(5000), ack: Seq(101), flags: F::SYN | F::ACK, mss: Some(1460), wscale: Some(7), ..Default::default() };
        let (mut b, n) = pkt(app(), peer(), synack);
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(101), ack: Seq(5001), flags: F::ACK, window: 100, ..Default::default() });
        c.packet(&mut b, n, 0);
        // The app dies: its kernel sends FIN: turned into a RST for the app.
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(5001), ack: Seq(101), flags: F::FIN | F::ACK, window: 50, ..Default::default() });
        assert_eq!(c.packet(&mut b, n, 0).0, Verdict::Inject);
        // The recovering app announces itself (ACKNOWLEDGE, the SDK's first step); its
        // recovery SYN is answered with a SYN-ACK injected toward the app.
        c.command(from_app(), &recovery_ack(50, 1001), 1, 0, &mut [0u8; 128]).unwrap();
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(77), flags: F::SYN, mss: Some(1460), wscale: Some(7), ..Default::default() });
        let (a, len) = c.packet(&mut b, n, 0);
        assert_eq!(a, Verdict::Inject);
        let info = IpInfo::parse(&b[..len]).unwrap();
        assert_eq!(info.dst, app().ip());
        assert_eq!((c.counters.recovered, c.counters.spurious_fin_reset), (1, 1));
        assert!(c.any_translated());
    }

    /// Issue 9, item 1: a SYN that looks like the app's recovery SYN (its address and port,
    /// e.g. spoofed from the wire in front of a bump-in-the-wire guard) is not answered, and
    /// does not re-key the connection, unless the app announced the recovery with an
    /// authenticated ACKNOWLEDGE within the window; the TELL that ends the recovery closes it.
    #[test]
    fn hostile_recovery_syn_needs_an_announced_recovery() {
        let mut c = core();
        let syn = Repr { seq: Seq(100), flags: F::SYN, mss: Some(1460), ..Default::default() };
        let (mut b, n) = pkt(peer(), app(), syn);
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(5000), ack: Seq(101), flags: F::SYN | F::ACK, mss: Some(1460), ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(101), ack: Seq(5001), flags: F::ACK, window: 100, ..Default::default() });
        c.packet(&mut b, n, 0);
        let k = FlowKey { app: app(), peer: peer() };
        let before = *c.conn(&k).unwrap();
        let forged = |c: &mut Core, isn: u32, now: u64| {
            let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(isn), flags: F::SYN, mss: Some(1460), ..Default::default() });
            c.packet(&mut b, n, now).0
        };
        // Unannounced: dropped, counted, state untouched.
        assert_eq!(forged(&mut c, 0xdead_0000, 10), Verdict::Drop);
        assert_eq!(c.counters.hostile_recovery_syn, 1);
        assert_eq!(*c.conn(&k).unwrap(), before, "no re-keying");
        assert!(!c.any_translated());
        // A plain ACKNOWLEDGE (a checkpoint, sent all the time) announces nothing.
        c.command(from_app(), &cmd(Op::Acknowledge, 59, 1), 1, 15, &mut [0u8; 128]).unwrap();
        assert_eq!(forged(&mut c, 0xdead_0001, 16), Verdict::Drop);
        // Announced: answered.
        c.command(from_app(), &recovery_ack(60, 1001), 1, 20, &mut [0u8; 128]).unwrap();
        assert_eq!(forged(&mut c, 77, 30), Verdict::Inject);
        assert_eq!(c.counters.recovered, 1);
        // The TELL ends the recovery: a later SYN is unannounced again.
        c.command(from_app(), &cmd(Op::Tell, 61, 1), 1, 40, &mut [0u8; 128]).unwrap();
        assert_eq!(forged(&mut c, 0xbeef_0000, 50), Verdict::Drop);
        // And the window closes on its own.
        c.command(from_app(), &recovery_ack(62, 1001), 1, 60, &mut [0u8; 128]).unwrap();
        assert_eq!(forged(&mut c, 0xbeef_0000, 60 + RECOVERY_WINDOW_MS + 1), Verdict::Drop);
        assert_eq!(c.counters.hostile_recovery_syn, 4);
        // A brand-new connection of the app (no state) is not affected.
        let other = SocketAddr::new(peer().ip(), 42_000);
        let (mut b, n) = pkt(app(), other, Repr { seq: Seq(1), flags: F::SYN, ..Default::default() });
        assert_eq!(c.packet(&mut b, n, 70).0, Verdict::Accept { modified: false });
    }

    /// An established connection (peer ISN 100, app ISN 5000), the app dies (its FIN becomes a
    /// RST) and announces its recovery. Returns the state's ackB and ackA.
    fn announced_recovery(c: &mut Core) -> (u32, u32) {
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(100), flags: F::SYN, mss: Some(1460), ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(5000), ack: Seq(101), flags: F::SYN | F::ACK, mss: Some(1460), ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(101), ack: Seq(5001), flags: F::ACK, window: 100, ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(5001), ack: Seq(101), flags: F::FIN | F::ACK, window: 50, ..Default::default() });
        assert_eq!(c.packet(&mut b, n, 0).0, Verdict::Inject);
        c.command(from_app(), &recovery_ack(70, 101), 1, 10, &mut [0u8; 128]).unwrap();
        (5001, 101)
    }

    fn syn_from_app(c: &mut Core, isn: u32, now: u64) -> Verdict {
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(isn), flags: F::SYN, mss: Some(1460), ..Default::default() });
        c.packet(&mut b, n, now).0
    }

    /// A's packet: returns the action and the SEQ the peer would see.
    fn from_app_seq(c: &mut Core, seq: u32, ack: u32, now: u64) -> (Verdict, Seq) {
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(seq), ack: Seq(ack), flags: F::ACK, window: 100, ..Default::default() });
        let (a, len) = c.packet(&mut b, n, now);
        let info = IpInfo::parse(&b[..len]).unwrap();
        (a, Tcp::new_checked(&b[info.l4_offset..len]).unwrap().seq())
    }

    /// Issue 9, item 1, the race: a forged SYN inside the announced window, after the genuine
    /// SYN was answered and before A's TCP acknowledged the SYN-ACK, re-keys the connection; A's
    /// handshake ACK (SEQ = its ISN + 1, ACK = ackA, which only a receiver of the SYN-ACK knows)
    /// proves the genuine SYN, undoes the forged re-keying and closes the window.
    #[test]
    fn hostile_recovery_syn_racing_a_genuine_one_is_undone() {
        for forged_first in [false, true] {
            let mut c = core();
            let (ack_b, ack_a) = announced_recovery(&mut c);
            let k = FlowKey { app: app(), peer: peer() };
            let (genuine, forged) = (77u32, 0xdead_0000u32);
            let order = if forged_first { [forged, genuine] } else { [genuine, forged] };
            for isn in order {
                assert_eq!(syn_from_app(&mut c, isn, 20), Verdict::Inject, "either may be the app's: both answered");
            }
            // Keyed to the last SYN answered.
            assert_eq!(c.conn(&k).unwrap().delta, order[1].wrapping_add(1).wrapping_sub(ack_b));
            // The forger cannot prove its SYN without ackA (it never saw the SYN-ACK): a guess
            // is not forwarded, and A's socket is reset so that the app recovers afresh.
            let (a, _) = from_app_seq(&mut c, forged + 1, ack_a + 12345, 25);
            assert_eq!(a, Verdict::Inject);
            assert_eq!(c.counters.hostile_recovery_unproven, 1);
            // A's handshake ACK proves the genuine SYN: the peer sees A's stream where it was.
            let (a, seq) = from_app_seq(&mut c, genuine + 1, ack_a, 30);
            assert!(matches!(a, Verdict::Accept { .. }));
            assert_eq!(seq, Seq(ack_b), "renumbered with the genuine SYN's Δ (forged first: {forged_first})");
            assert_eq!(c.conn(&k).unwrap().delta, (genuine + 1).wrapping_sub(ack_b));
            assert_eq!(c.counters.recovery_race_undone, u64::from(!forged_first));
            assert_eq!(c.counters.recovery_proven, 1);
            // The window is closed: a later forged SYN is dropped and changes nothing.
            let before = *c.conn(&k).unwrap();
            assert_eq!(syn_from_app(&mut c, 0xbeef_0000, 40), Verdict::Drop);
            assert_eq!(*c.conn(&k).unwrap(), before);
        }
    }

    /// Issue 9, item 2 (RFC 5961 section 5.2): a forged packet of the peer with an in-window
    /// SEQ but acknowledging data the app never sent does not move ackB; the peer's genuine
    /// ACKs do.
    #[test]
    fn hostile_peer_ack_beyond_what_the_app_sent_moves_nothing() {
        let mut c = core();
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(100), flags: F::SYN, mss: Some(1460), ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(5000), ack: Seq(101), flags: F::SYN | F::ACK, mss: Some(1460), ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(101), ack: Seq(5001), flags: F::ACK, window: 100, ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt_data(app(), peer(), Repr { seq: Seq(5001), ack: Seq(101), flags: F::ACK, window: 100, ..Default::default() }, &[1u8; 300]);
        assert!(matches!(c.packet(&mut b, n, 1).0, Verdict::Accept { .. }));
        let k = FlowKey { app: app(), peer: peer() };
        let before = *c.conn(&k).unwrap();
        // In the window (SEQ 101), checksummed, but acknowledging 1 MB the app never sent.
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(101), ack: Seq(5001 + 1_000_000), flags: F::ACK, window: 100, ..Default::default() });
        assert_eq!(c.packet(&mut b, n, 2).0, Verdict::Drop);
        assert_eq!(c.counters.hostile_peer_ack_beyond, 1);
        assert_eq!(*c.conn(&k).unwrap(), before, "ackB unchanged");
        // The genuine ACK of the 300 bytes.
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(101), ack: Seq(5301), flags: F::ACK, window: 100, ..Default::default() });
        assert!(matches!(c.packet(&mut b, n, 3).0, Verdict::Accept { .. }));
        assert_eq!(c.conn(&k).unwrap().ack_b, 5301);
        // The app as the client: its stream begins at the ISN the peer's SYN-ACK acknowledges.
        let mut c = core();
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(7000), flags: F::SYN, mss: Some(1460), ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(300), ack: Seq(7001), flags: F::SYN | F::ACK, mss: Some(1460), ..Default::default() });
        assert!(matches!(c.packet(&mut b, n, 0).0, Verdict::Accept { .. }));
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(301), ack: Seq(9_000_000), flags: F::ACK, window: 100, ..Default::default() });
        assert_eq!(c.packet(&mut b, n, 1).0, Verdict::Drop);
        assert_eq!(c.counters.hostile_peer_ack_beyond, 1);
    }

    /// A single answered SYN (no race) works as before; its retransmissions are answered again
    /// without counting as another candidate; at most MAX_RECOVERY_SYNS distinct SYNs are
    /// answered per window.
    #[test]
    fn hostile_recovery_syns_per_window_are_bounded() {
        let mut c = core();
        let (ack_b, ack_a) = announced_recovery(&mut c);
        assert_eq!(syn_from_app(&mut c, 77, 20), Verdict::Inject);
        assert_eq!(syn_from_app(&mut c, 77, 21), Verdict::Inject, "a retransmission");
        for i in 1..MAX_RECOVERY_SYNS as u32 {
            assert_eq!(syn_from_app(&mut c, 1000 * i, 22), Verdict::Inject);
        }
        let n0 = c.counters.hostile_recovery_syn;
        assert_eq!(syn_from_app(&mut c, 999_999, 23), Verdict::Drop);
        assert_eq!(c.counters.hostile_recovery_syn, n0 + 1);
        assert_eq!(syn_from_app(&mut c, 77, 24), Verdict::Inject, "the genuine one still answered");
        let (_, seq) = from_app_seq(&mut c, 78, ack_a, 30);
        assert_eq!(seq, Seq(ack_b));
    }

    fn pkt_data(src: SocketAddr, dst: SocketAddr, r: Repr, data: &[u8]) -> (Vec<u8>, usize) {
        let r = Repr { src_port: src.port(), dst_port: dst.port(), ..r };
        let tl = r.header_len();
        let mut b = vec![0u8; 20 + tl + data.len() + 64];
        ip::emit_header(&mut b, src.ip(), dst.ip(), 6, tl + data.len()).unwrap();
        r.emit(&mut b[20..]).unwrap();
        b[20 + tl..20 + tl + data.len()].copy_from_slice(data);
        Tcp::new_checked(&mut b[20..20 + tl + data.len()]).unwrap().fill_checksum(ip::pseudo_sum(src.ip(), dst.ip(), 6, tl + data.len()));
        (b, 20 + tl + data.len())
    }

    /// A SACK connection with 1000 bytes from the peer in two segments (101..601, 601..1101),
    /// checkpointed at 401; the app dies (its FIN becomes a RST) and its recovery SYN is answered.
    fn crashed_and_recovered(c: &mut Core) {
        let syn = Repr { seq: Seq(100), flags: F::SYN, mss: Some(1460), sack_perm: true, ..Default::default() };
        let (mut b, n) = pkt(peer(), app(), syn);
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(5000), ack: Seq(101), flags: F::SYN | F::ACK, mss: Some(1460), sack_perm: true, ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(101), ack: Seq(5001), flags: F::ACK, window: 100, ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(5001), ack: Seq(101), flags: F::ACK, window: 100, ..Default::default() });
        c.packet(&mut b, n, 0);
        for start in [101u32, 601] {
            let (mut b, n) = pkt_data(peer(), app(), Repr { seq: Seq(start), ack: Seq(5001), flags: F::ACK, window: 100, ..Default::default() }, &[7u8; 500]);
            assert_eq!(c.packet(&mut b, n, 0).0, Verdict::Accept { modified: false });
        }
        let mut ack = [0u8; 128];
        c.command(from_app(), &recovery_ack(30, 401), 1, 0, &mut ack).unwrap();
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(5001), ack: Seq(401), flags: F::FIN | F::ACK, window: 50, ..Default::default() });
        assert_eq!(c.packet(&mut b, n, 0).0, Verdict::Inject);
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(77), flags: F::SYN, mss: Some(1460), sack_perm: true, ..Default::default() });
        assert_eq!(c.packet(&mut b, n, 0).0, Verdict::Inject);
    }
    fn cmd_ack(op: Op, nonce: u64, ack_a: u32) -> Vec<u8> {
        let mut c = Command::request(op, app(), peer(), nonce, 1);
        c.ack_a = ack_a;
        c.encode(&key()).unwrap().to_vec()
    }

    #[test]
    fn recovery_nudge_sacks_the_peers_last_segment_at_tell() {
        let mut c = core();
        c.recovery_nudge = true;
        crashed_and_recovered(&mut c);
        let mut ack = [0u8; 128];
        let out = c.command(from_app(), &cmd_ack(Op::Tell, 31, 0), 1, 0, &mut ack).unwrap();
        assert_eq!(Command::decode(&out.reply, &key()).unwrap().ack_a, 401, "the TELL is answered as usual");
        let n = out.ack_len.expect("a nudge for the peer");
        let info = IpInfo::parse(&ack[..n]).unwrap();
        assert_eq!((info.src, info.dst), (app().ip(), peer().ip()));
        let t = Tcp::new_checked(&ack[info.l4_offset..n]).unwrap();
        let r = Repr::parse(&t).unwrap();
        assert_eq!((r.flags, r.ack, r.seq), (F::ACK, Seq(401), Seq(5001)), "acknowledges the checkpoint, nothing more");
        assert_eq!((r.sack_len, r.sack[0]), (1, (Seq(601), Seq(1101))), "the peer's last segment");
        assert_eq!(c.counters.recovery_nudges, 1);
        // Once per recovery: a second TELL sends no nudge.
        assert!(c.command(from_app(), &cmd_ack(Op::Tell, 32, 0), 1, 0, &mut ack).unwrap().ack_len.is_none());
    }

    #[test]
    fn recovery_nudge_only_when_enabled_and_data_is_in_flight() {
        let mut c = core();
        assert!(!c.recovery_nudge, "off by default");
        crashed_and_recovered(&mut c);
        let mut ack = [0u8; 128];
        assert!(c.command(from_app(), &cmd_ack(Op::Tell, 31, 0), 1, 0, &mut ack).unwrap().ack_len.is_none());
        assert_eq!(c.counters.recovery_nudges, 0);
        // Everything the peer sent is checkpointed: nothing to resend, no nudge.
        let mut c = core();
        c.recovery_nudge = true;
        crashed_and_recovered(&mut c);
        c.command(from_app(), &cmd_ack(Op::Acknowledge, 33, 1101), 1, 0, &mut ack).unwrap();
        assert!(c.command(from_app(), &cmd_ack(Op::Tell, 34, 0), 1, 0, &mut ack).unwrap().ack_len.is_none());
    }

    #[test]
    fn recovery_nudge_after_a_guard_restart_learns_the_peers_end_from_its_challenge_ack() {
        // Guard and app died together: the new guard learns the checkpoint from ACKNOWLEDGE,
        // forwards the recovery SYN, and the peer's challenge ACK (SEQ = its SND.NXT, 1101)
        // becomes the SYN-ACK (section 6). The nudge names a last segment ending there.
        let mut c = core();
        c.recovery_nudge = true;
        let mut ack = [0u8; 128];
        let mut a = Command::request(Op::Acknowledge, app(), peer(), 40, 1);
        a.ack_a = 401;
        a.options = Some(ctl::ConnOptions { peer_mss: 200, peer_wscale: None, app_wscale: None, sack: true, timestamps: false });
        c.command(from_app(), &a.encode(&key()).unwrap(), 1, 0, &mut ack).unwrap();
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(77), flags: F::SYN, mss: Some(1460), sack_perm: true, ..Default::default() });
        assert_eq!(c.packet(&mut b, n, 0).0, Verdict::Accept { modified: false });
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(1101), ack: Seq(5001), flags: F::ACK, window: 100, ..Default::default() });
        assert_eq!(c.packet(&mut b, n, 0).0, Verdict::Accept { modified: true });
        assert_eq!(c.counters.recovered_from_peer_ack, 1);
        let out = c.command(from_app(), &cmd_ack(Op::Tell, 41, 0), 1, 0, &mut ack).unwrap();
        let n = out.ack_len.expect("a nudge");
        let info = IpInfo::parse(&ack[..n]).unwrap();
        let r = Repr::parse(&Tcp::new_checked(&ack[info.l4_offset..n]).unwrap()).unwrap();
        assert_eq!((r.ack, r.sack_len, r.sack[0]), (Seq(401), 1, (Seq(1101 - 536), Seq(1101))), "a last segment of the peer's MSS, at least 536");
    }

    #[test]
    fn a_syn_flood_evicts_half_open_entries_not_an_established_connection() {
        let svc = [Service { addr: "10.0.2.10".parse().unwrap(), port: 7000 }];
        let mut c = Core::new(&svc, key(), vec![], 30_000, 1000, 8);
        // An established connection, idle since t=0.
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(100), flags: F::SYN, ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(900), ack: Seq(101), flags: F::SYN | F::ACK, ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(101), ack: Seq(901), flags: F::ACK, window: 5, ..Default::default() });
        c.packet(&mut b, n, 0);
        let k = FlowKey { app: app(), peer: peer() };
        // 1000 SYNs from other ports, each newer than the connection's last packet.
        for i in 0..1000u16 {
            let p = SocketAddr::new("10.0.1.3".parse().unwrap(), 20_000 + i);
            let (mut b, n) = pkt(p, app(), Repr { seq: Seq(1), flags: F::SYN, ..Default::default() });
            c.packet(&mut b, n, 1 + i as u64);
        }
        assert!(c.connections() <= 8);
        assert!(c.counters.evicted_idle >= 990, "{}", c.counters.evicted_idle);
        assert!(c.conn(&k).is_some(), "the established connection survived the flood");
    }

    /// Eviction ranks connections by the last packet the core saw; one the kernel's fast path
    /// carries looks idle there (its packets stay in the kernel), so it ranks as the busiest:
    /// an idle connection the core decides is evicted first.
    #[test]
    fn eviction_spares_a_connection_the_kernel_carries() {
        /// A map of room for one entry.
        #[derive(Default)]
        struct One(Option<(FlowKey, FastState)>);
        impl FastMap for One {
            fn take(&mut self, key: &FlowKey, _: bool) -> Option<FastTaken> {
                self.0.filter(|(k, _)| k == key).map(|(_, state)| FastTaken { newest: true, state })
            }
            fn apply(&mut self, op: &FastOp) -> FastDone {
                match *op {
                    FastOp::Install(k, s) if self.0.is_none() => {
                        self.0 = Some((k, s));
                        FastDone::Kernel
                    }
                    FastOp::Thaw(k, s) | FastOp::ThawForce(k, s) if self.0.is_some_and(|(x, _)| x == k) => {
                        self.0 = Some((k, s));
                        FastDone::Kernel
                    }
                    FastOp::Remove(k) if self.0.is_some_and(|(x, _)| x == k) => {
                        self.0 = None;
                        FastDone::Gone
                    }
                    _ => FastDone::Gone,
                }
            }
        }
        let svc = [Service { addr: "10.0.2.10".parse().unwrap(), port: 7000 }];
        let mut c = Core::new(&svc, key(), vec![], 30_000, 1000, 2);
        c.enable_fast_path(Box::<One>::default());
        let handshake = |c: &mut Core, peer: SocketAddr, t: u64| {
            for (src, dst, r) in [
                (peer, app(), Repr { seq: Seq(100), flags: F::SYN, ..Default::default() }),
                (app(), peer, Repr { seq: Seq(900), ack: Seq(101), flags: F::SYN | F::ACK, ..Default::default() }),
                (peer, app(), Repr { seq: Seq(101), ack: Seq(901), flags: F::ACK, window: 5, ..Default::default() }),
            ] {
                let (mut b, n) = pkt(src, dst, r);
                c.packet_fast(&mut b, n, t, false, false);
                c.fast_after_flush(t);
            }
        };
        let carried = peer();
        let decided: SocketAddr = "10.0.1.2:41001".parse().unwrap();
        handshake(&mut c, carried, 0);
        assert_eq!(c.fast_counters().installed, 1);
        // The second finds the map full: the core decides its packets.
        handshake(&mut c, decided, 10);
        assert_eq!((c.fast_counters().installed, c.fast_counters().install_refused), (1, 1));
        // A third connection needs room: the one the core saw last at t=10 goes, not the one
        // the kernel carries (last seen by the core at t=0).
        let (mut b, n) = pkt("10.0.1.2:41002".parse().unwrap(), app(), Repr { seq: Seq(1), flags: F::SYN, ..Default::default() });
        c.packet_fast(&mut b, n, 20, false, false);
        assert_eq!(c.counters.evicted_idle, 1);
        assert!(c.conn(&FlowKey { app: app(), peer: carried }).is_some(), "the connection the kernel carries was evicted");
        assert!(c.conn(&FlowKey { app: app(), peer: decided }).is_none());
    }

    /// An established connection between app() and peer() on a core of `cap` entries.
    fn core_with_one(cap: usize) -> Core {
        let svc = [Service { addr: "10.0.2.10".parse().unwrap(), port: 7000 }];
        let mut c = Core::new(&svc, key(), vec![], 30_000, 1000, cap);
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(100), flags: F::SYN, ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(900), ack: Seq(101), flags: F::SYN | F::ACK, ..Default::default() });
        c.packet(&mut b, n, 0);
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(101), ack: Seq(901), flags: F::ACK, window: 5, ..Default::default() });
        c.packet(&mut b, n, 0);
        c
    }

    /// Issue 9, item 2: spoofed peer packets for 4-tuples the guard does not hold. Bad
    /// checksums (data, SYNs) and SYN-ACKs answering nothing create no entry at all; packets
    /// with valid checksums (data: the I0 probe, RSTs) fill the table at most up to its cap and
    /// never evict anything. All counted.
    #[test]
    fn hostile_spoofed_peer_packets_for_unknown_connections_create_no_entries() {
        let mut c = core_with_one(8);
        let k = FlowKey { app: app(), peer: peer() };
        let spoof = |c: &mut Core, i: u32, flags: u8, good_csum: bool| {
            let p = SocketAddr::new(std::net::Ipv4Addr::from(0x0a00_0100 + (i % 200)).into(), 1024 + i as u16);
            let (mut b, n) = pkt_data(p, app(), Repr { seq: Seq(i.wrapping_mul(7919)), ack: Seq(i), flags, window: 100, ..Default::default() }, if flags == F::ACK { &[1u8; 40] } else { &[] });
            if !good_csum {
                b[20 + 16] ^= 0x55;
            }
            let (a, _) = c.packet(&mut b, n, 1 + i as u64);
            assert_ne!(a, Verdict::Inject, "packet {i}");
        };
        // Failing their checks: nothing at all.
        let kinds: [(u8, bool); 3] = [(F::ACK, false), (F::SYN | F::ACK, true), (F::SYN, false)];
        for i in 0..1500u32 {
            let (flags, good) = kinds[i as usize % 3];
            spoof(&mut c, i, flags, good);
        }
        assert_eq!(c.connections(), 1, "no entry for any of them");
        let ct = &c.counters;
        assert_eq!((ct.peer_no_entry, ct.hostile_peer_bad_checksum, ct.hostile_peer_out_of_window, ct.evicted_idle), (1500, 1000, 500, 0));
        // Checksummed data and RSTs: entries while there is room, then the stateless I0 probe.
        for i in 2000..3000u32 {
            spoof(&mut c, i, if i % 2 == 0 { F::ACK } else { F::RST | F::ACK }, true);
        }
        assert_eq!(c.connections(), 8, "up to the cap");
        assert!(c.conn(&k).is_some(), "the established connection is still there");
        let ct = &c.counters;
        assert_eq!(ct.evicted_idle, 0, "nothing evicted for them");
        assert_eq!(ct.peer_no_entry, 1500 + 1000 - 7);
    }

    /// Issue 9, item 2: a connection the application released (unprotected) is never evicted
    /// by a flood of SYNs, so its packets keep passing untouched (an evicted one would have
    /// been rewritten by I0 and O6, which an application that gave up protection never
    /// recovers from); it leaves the table when it has closed both ways.
    #[test]
    fn hostile_syn_flood_never_evicts_an_unprotected_connection() {
        let mut c = core_with_one(8);
        let k = FlowKey { app: app(), peer: peer() };
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(901), ack: Seq(101), flags: F::ACK, window: 50, ..Default::default() });
        b[1] = ctl::UNPROTECTED_DSCP << 2;
        unbroken_wire::ipv4::Packet::new_checked(&mut b[..n]).unwrap().fill_checksum();
        assert_eq!(c.packet(&mut b, n, 1).0, Verdict::Accept { modified: false });
        assert_eq!(c.counters.unprotected_released, 1);
        for i in 0..1000u16 {
            let p = SocketAddr::new("10.0.1.3".parse().unwrap(), 20_000 + i);
            let (mut b, n) = pkt(p, app(), Repr { seq: Seq(1), flags: F::SYN, ..Default::default() });
            c.packet(&mut b, n, 2 + i as u64);
        }
        assert!(c.connections() <= 8, "{}", c.connections());
        assert!(c.counters.evicted_idle >= 990, "{}", c.counters.evicted_idle);
        let (mut b, n) = pkt_data(peer(), app(), Repr { seq: Seq(101), ack: Seq(901), flags: F::ACK, window: 100, ..Default::default() }, b"still here");
        let before = b[..n].to_vec();
        assert_eq!(c.packet(&mut b, n, 2000).0, Verdict::Accept { modified: false }, "passes untouched");
        assert_eq!(b[..n], before[..]);
        assert_eq!(c.counters.peer_without_state, 0);
        // Both FINs pass: it expires like any closed connection.
        let (mut b, n) = pkt(app(), peer(), Repr { seq: Seq(901), ack: Seq(111), flags: F::FIN | F::ACK, window: 50, ..Default::default() });
        assert_eq!(c.packet(&mut b, n, 2001).0, Verdict::Accept { modified: false });
        let (mut b, n) = pkt(peer(), app(), Repr { seq: Seq(111), ack: Seq(902), flags: F::FIN | F::ACK, window: 50, ..Default::default() });
        assert_eq!(c.packet(&mut b, n, 2002).0, Verdict::Accept { modified: false });
        c.expire(2003);
        assert!(c.conn(&k).is_some(), "within the grace period");
        c.expire(2003 + 1000);
        assert!(c.conn(&k).is_none(), "gone after it");
    }

    #[test]
    fn closed_connections_expire_after_grace_and_table_is_bounded() {
        let svc = [Service { addr: "10.0.2.10".parse().unwrap(), port: 7000 }];
        let mut c = Core::new(&svc, key(), vec![], 30_000, 1000, 16);
        for i in 0..40u16 {
            let p: SocketAddr = SocketAddr::new("10.0.1.2".parse().unwrap(), 1000 + i);
            let (mut b, n) = pkt(p, app(), Repr { seq: Seq(1), flags: F::SYN, ..Default::default() });
            c.packet(&mut b, n, i as u64);
        }
        assert!(c.connections() <= 16, "{}", c.connections());
        assert!(c.counters.evicted_idle > 0);
    }
}
