//! The backup's fast-path half (issue 22 item 4): which of the backup engine's connections the
//! kernel's programs carry (`bpf/replica/rep_tc.c`: `rep_b_in`, `rep_b_out`) and the hand-off
//! of their fields between the programs and [`Core`], decided here; the map itself is behind
//! [`BackupMap`] (the daemon's is the kernel's, `crate::replica::fastmap`; tests emulate it).
//! The model is checkpoint mode's `checkpoint::guard::fast` (docs/architecture.md, "Fast path:
//! replica mode", "What attaching needs" 2-4).
//!
//! The protocol (`bpf/replica/rep_state.h`): a connection is *installed* (`BPF_NOEXIST`) once
//! the engine aligned it and it is [`Backup::fast_eligible`]; from then on the programs own its
//! fields and the engine's copy is stale. A program that leaves a packet of it to the slow path
//! freezes the entry, counts the packet and marks it [`MARK_SLOW`]. Before the engine decides
//! any packet or side-channel message that touches an installed connection, the core *takes*
//! the fields (`TAKE` for a marked packet, `FREEZE` otherwise) and loads them into the engine
//! when they were the newest; after deciding, it gives the connection back (*thaw*) while it is
//! eligible, which the kernel refuses until every counted packet was taken (then the core keeps
//! it, and the next packet's thaw succeeds). A connection a queued packet touched is given
//! back only after that packet's verdict left ([`Core::fast_after_flush`]), so that a packet
//! the programs claim after the thaw never overtakes it. A connection held for
//! [`HOLD_BOUND_MS`] (a counted packet lost before the queue) is given back anyway
//! (`THAW_FORCE`). A connection the engine forgets leaves the map.
//!
//! What the programs keep in collections reaches the engine as ring records
//! ([`Core::fast_records`], every loop round): checkpoints ([`Backup::push_checkpoint`]), the
//! copies kept for the take-over ([`Backup::push_kept`]), `CHANGED` (the connection's figures
//! are read with `COLLECT` and reported in the round's one progress message), and, in copy mode,
//! the server's packets the egress program declined and consumed ([`MapRecord::Slow`]: decided
//! by the engine as if they came from the queue).
//!
//! The take-over ([`Core::fast_take_over`], before [`Backup::take_over`]): the map's
//! [`BackupMap::promote`] (the daemon installs the OUTPUT queue rule, then tells the programs
//! to pass every packet), the ring drained, every entry frozen and loaded into the engine, the
//! map cleared.

use super::*;
use unbroken_engines::replica::{BFast, PFast};
use unbroken_wire::replica::{flag as rw_flag, ConnProgress};
use unbroken_wire::Seq;

/// A connection's fields as they cross between the engine and the map: the backup's or the
/// primary's (each daemon runs one of the two).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fields {
    Backup(BFast),
    Primary(PFast),
}

impl Fields {
    pub fn backup(self) -> Option<BFast> {
        match self {
            Fields::Backup(f) => Some(f),
            Fields::Primary(_) => None,
        }
    }

    pub fn primary(self) -> Option<PFast> {
        match self {
            Fields::Primary(f) => Some(f),
            Fields::Backup(_) => None,
        }
    }
}

/// How long the core holds an eligible connection at most, counted from when it began to hold
/// it, before it gives it back even though a counted packet never reached the queue (a full
/// queue dropped it): `THAW_FORCE`.
pub const HOLD_BOUND_MS: u64 = 1000;

/// After the map refused a new entry (full), no install is tried for this long.
pub const INSTALL_BACKOFF_MS: u64 = 1000;

/// `skb->mark` bits the programs set (`REP_MARK_*`): decided in the kernel / left to the slow
/// path and counted; the drivers' values, which the daemon's rules use too.
pub use unbroken_drivers::fastpath::replica::{EgressSeen, MARK_DONE, MARK_SLOW};

/// Where a connection's fields are, as the core knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fast {
    /// Not in the map: the engine's copy is the state.
    #[default]
    Off,
    /// In the map, the programs' (the engine's copy is stale until taken).
    Kernel,
    /// In the map, frozen, the engine's.
    Held,
}

/// A taken entry: its fields (the engine's form, clock converted), and whether they were the
/// newest (the programs owned them until now; otherwise the engine holds newer ones since an
/// earlier take).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Taken {
    pub newest: bool,
    pub fields: Fields,
}

/// What the core asks of the map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapOp {
    /// A new entry (`BPF_NOEXIST`): the programs own the connection from now on.
    Install(ConnKey, Fields),
    /// Give a held connection back, unless a counted packet is still on its way.
    Thaw(ConnKey, Fields),
    /// Give it back anyway ([`HOLD_BOUND_MS`]).
    ThawForce(ConnKey, Fields),
    Remove(ConnKey),
}

/// What became of a [`MapOp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapDone {
    /// The programs own the connection.
    Kernel,
    /// The entry stays frozen and the core's (a refused thaw).
    Held,
    /// No entry (removed, an install that found one, or the map failed: the slow path carries
    /// the connection).
    Gone,
}

/// A record the programs sent, whole (pieces put together by the map).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MapRecord {
    /// The connection's figures moved since they were last collected.
    Changed(ConnKey),
    /// `learn_output`'s checkpoint: the output end (primary's space) and its digest.
    Checkpoint(ConnKey, Seq, u64),
    /// A withheld segment kept for the take-over: its end in the backup's space, the packet.
    Kept(ConnKey, Seq, Vec<u8>),
    /// A packet of the backup's server that the egress program declined and consumed (copy
    /// mode): the engine decides it as if it came from the queue; `counted` as a packet marked
    /// [`MARK_SLOW`] (its connection had an entry).
    Slow { pkt: Vec<u8>, counted: bool },
    /// A client segment with bytes the ingress program passed to the backup's server: a copy
    /// for the primary ([`Backup::push_input`]).
    Input(ConnKey, Vec<u8>),
}

/// What became of a backup record applied in place ([`FastMap::report`], the primary's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reported {
    /// Applied; the programs keep the connection; its fields as they are now.
    Kernel(Fields),
    /// Applied, and frozen: the engine answers the record with a packet (a fresh ACK, the
    /// client's ACK relayed): the connection is the core's, these its newest fields.
    Taken(Fields),
    /// Not applied: frozen already, or the map cannot (the core takes it as for any message).
    Frozen,
    /// No entry.
    Gone,
}

/// The map, as the core uses it (the backup's `rep_b_conns` or the primary's `rep_p_conns`).
/// Fields cross in the engine's form ([`Fields`]): the map converts the kernel's clock
/// (`b_ts_seen`, `client_heard_at`) to the engine's, given as `now_ms`.
pub trait FastMap: Send {
    /// Takes the fields of `key` (freezing its entry; `counted`: `TAKE`, the packet being
    /// decided was marked, else `FREEZE`). `None`: no entry.
    fn take(&mut self, key: &ConnKey, counted: bool, now_ms: u64) -> Option<Taken>;
    fn apply(&mut self, op: &MapOp, now_ms: u64) -> MapDone;
    /// `COLLECT`: the entry's fields as they are (`CHANGED` cleared), without taking it.
    fn collect(&mut self, key: &ConnKey, now_ms: u64) -> Option<Fields>;
    /// The records sent since the last call, in order.
    fn records(&mut self) -> Vec<MapRecord>;
    /// The take-over's first step: the server's packets go through the queue again (the
    /// OUTPUT queue rule), then the programs pass every packet. `Err`: the rule could not be
    /// installed; the programs keep copying the server's packets to the daemon (its engine
    /// translates them and the raw socket sends them).
    fn promote(&mut self) -> Result<(), String>;
    /// The egress watch's latest look ([`EgressSeen`]) and how many looks there were so far
    /// (`None`: none yet; `Err`: the kernel could not be asked that time). Never waits: the
    /// looks run elsewhere (the daemon's on a thread: they wait for the kernel's RTNL lock).
    fn egress_seen(&mut self) -> (u64, Option<Result<EgressSeen, String>>) {
        (0, None)
    }
    /// The egress filter is gone: the server's packets through the queue again (the OUTPUT
    /// rule's match), copy mode off.
    fn user_out(&mut self) -> Result<(), String> {
        Ok(())
    }
    /// The primary's: its server's output through the OUTPUT queue rule (`on`, the rule's
    /// match takes every packet; the egress program passes what the queue accepted and copies
    /// what slipped past the switch) or through the egress program alone (off). Switchable
    /// both ways: a packet that passed OUTPUT before the switch is either claimed by the
    /// program with the newest fields or copied to the daemon, never passed ungated.
    fn queue_out(&mut self, on: bool) -> Result<(), String> {
        let _ = on;
        Ok(())
    }
    /// The programs' own counters, for the status.
    fn stats(&mut self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
    /// The primary's: one record of the backup's report applied to the entry of `key` in
    /// place (`REP_OP_REPORT`): the backup's receive figures and alignment, and whether the
    /// engine would answer it with a packet, decided on the same fields.
    fn report(&mut self, key: &ConnKey, rec: &ConnProgress, now_ms: u64) -> Reported {
        let _ = (key, rec, now_ms);
        Reported::Frozen
    }
    /// The primary's: the daemon is alive; its programs may claim packets for another
    /// [`LEASE_MS`] (`rep_cfg.lease`: past it they claim nothing, a dead or stuck daemon's
    /// filter fails closed).
    fn renew_lease(&mut self) -> Result<(), String> {
        Ok(())
    }
    /// The primary's: when the programs last passed new output of its server (the engine's
    /// clock; `None`: never, or a backup's map).
    fn output_at(&mut self, now_ms: u64) -> Option<u64> {
        let _ = now_ms;
        None
    }
}

/// Counters of the hand-off (status `fast_path.handoff`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct FastCounters {
    pub installed: u64,
    pub taken: u64,
    pub thawed: u64,
    /// Thaws refused: a counted packet was still on its way.
    pub thaw_refused: u64,
    pub thaw_forced: u64,
    pub removed: u64,
    /// Entries found missing or lost (the slow path carries them).
    pub lost: u64,
    /// Installs the map refused ([`INSTALL_BACKOFF_MS`] without installs follows).
    pub install_refused: u64,
    /// Fields the engine refused ([`Backup::set_fast_state`]): the connection leaves the map.
    pub load_refused: u64,
    /// `CHANGED` records: connections collected for a progress message.
    pub collected: u64,
    pub checkpoints: u64,
    pub kept: u64,
    /// The server's packets the egress program declined and copied (copy mode).
    pub slow_copies: u64,
    /// Client segments with bytes the ingress program passed and copied for the primary.
    pub inputs: u64,
    /// Packets marked [`MARK_DONE`] that reached the queue anyway (a chain edited by hand):
    /// accepted as they are, never rewritten twice.
    pub fast_done_queued: u64,
    /// Backup records applied to the programs' entries in place (the primary's).
    pub reports_in_place: u64,
    /// Of those, records the engine answered differently than the programs foresaw (taken
    /// back after, the engine's answer kept).
    pub report_mismatch: u64,
    /// Copies that name no TCP connection (never sent).
    pub copies_unnamed: u64,
    /// Take-overs where the OUTPUT queue rule could not be installed.
    pub promote_failed: u64,
    /// Looks for the egress filter that could not be answered (no verdict those times).
    pub egress_check_failed: u64,
}

/// The fast path's part of [`Core`].
#[derive(Default)]
pub struct FastPart {
    /// Why the fast path is off (the status's `fast_path.off_because`); `None` while on.
    pub off_because: Option<String>,
    map: Option<Box<dyn FastMap>>,
    /// Connections in the map, as the core knows them.
    conns: HashMap<ConnKey, Fast>,
    /// Connections held by the core, and since when (ms).
    held: HashMap<ConnKey, u64>,
    /// Connections to settle once the current packet or message is decided.
    dirty: Vec<ConnKey>,
    /// Connections a queued packet touched whose verdict has not been sent yet.
    deferred: Vec<ConnKey>,
    install_after_ms: u64,
    /// The map was cleared (the take-over, or the egress filter lost): nothing is installed
    /// again.
    retired: bool,
    /// The egress filter was found gone ([`BackupMap::egress_present`]): the fast path is off.
    egress_lost: bool,
    /// When the egress watch was last read, how many looks it had made then, and reads in a
    /// row without a good answer.
    watch_at: u64,
    watch_looks: u64,
    watch_unknown: u32,
    /// The take-over's promote failed: the egress program still copies and consumes the
    /// server's packets, which the engine now translates and the raw socket sends.
    copying: bool,
    /// The primary's server output goes through the OUTPUT queue rule (its match told so,
    /// [`FastMap::queue_out`]): before the pair protects, and for good once it no longer can.
    /// Starts on: the daemon installs the rule taking the output until the backup is heard.
    queue_out: bool,
    /// When the primary's timed connections were last read ([`TIMED_REFRESH_MS`]), and every
    /// connection looked at ([`SCAN_MS`]).
    timed_at: u64,
    scan_at: u64,
    lease_at: Option<u64>,
    /// When the programs' loss counters were last read, and what they said (review finding 8:
    /// counted, never said).
    losses_at: u64,
    losses: Vec<(&'static str, u64)>,
    pub counters: FastCounters,
}

/// How often the primary's timers get the programs' figures of the connections they look at
/// (a `COLLECT` each): the lag bounds are seconds, the nudges tens of milliseconds.
pub const TIMED_REFRESH_MS: u64 = 20;

/// The primary's lease ([`FastMap::renew_lease`]) and how often the core renews it: a daemon
/// that stops (killed, hung) leaves its programs claiming for at most this long.
pub const LEASE_MS: u64 = 1_000;
pub const LEASE_RENEW_MS: u64 = 100;

/// How often every connection in the map is looked at (forgotten by the engine, or no longer
/// protected): a walk of the whole table, not every loop round.
pub const SCAN_MS: u64 = 50;

/// How often the programs' loss counters are read for the log (a syscall per CPU each).
const LOSS_CHECK_MS: u64 = 1_000;

/// How often the core reads the egress watch's answer (the daemon's watch thread looks as
/// often): about the longest a removed filter lets the backup's server's output reach the wire.
pub const EGRESS_WATCH_MS: u64 = 100;

/// Reads in a row without a good answer (errors, or no new look: the watch waits for the
/// kernel) after which the filter counts as gone: the safe side (the fast path off) after
/// about two seconds of not knowing.
pub const EGRESS_UNKNOWN_MAX: u32 = 20;

/// The programs' counters whose rise means something was lost, and what it costs.
const LOSS_KINDS: [(&str, &str); 3] = [
    ("kernel_records_lost", "ring records did not fit (the ring was full): copies for the take-over or for the primary may be missing on those connections (a resend or the client's retransmission fills them)"),
    ("pieces_dropped", "copied packets could not be put together from their pieces: those copies are missing (as above)"),
    ("kernel_unparsed_dropped", "packets from the service address the programs could not parse were dropped (fail closed): the backup may fall behind on those connections and say so"),
];

/// The connection of a TCP packet: the client's end, as the engine keys it (`outgoing`: a
/// packet of the backup's server).
pub fn conn_key(pkt: &[u8], outgoing: bool) -> Option<ConnKey> {
    let info = unbroken_wire::ip::IpInfo::parse(pkt).ok()?;
    if info.protocol != 6 || info.l4_len < 4 || pkt.len() < info.l4_offset + 4 {
        return None;
    }
    let t = &pkt[info.l4_offset..];
    let (sport, dport) = (u16::from_be_bytes([t[0], t[1]]), u16::from_be_bytes([t[2], t[3]]));
    Some(if outgoing {
        ConnKey { client: info.dst, client_port: dport, server_port: sport }
    } else {
        ConnKey { client: info.src, client_port: sport, server_port: dport }
    })
}

impl Core {
    /// Hands the engine's connections to `map` from now on: the backup's aligned ones, or
    /// the primary's protected ones (relaxed output commit only: in strict mode nearly every
    /// connection holds output, which the engine keeps).
    pub fn enable_fast_path(&mut self, map: Box<dyn FastMap>) {
        if self.backup.is_some() || self.primary.is_some() {
            self.fast.map = Some(map);
            self.fast.off_because = None;
            // The primary's daemon starts with the OUTPUT rule taking its server's output
            // ([`Core::fast_primary_mode`] switches once the backup is heard).
            self.fast.queue_out = self.primary.is_some();
        }
    }

    // -- The engine, whichever role this daemon runs (the map's fields are its). --

    fn eng_follows(&self, key: &ConnKey) -> bool {
        match (&self.primary, &self.backup) {
            (Some(p), _) => p.follows(key),
            (_, Some(b)) => b.follows(key),
            _ => false,
        }
    }

    /// The programs may carry `key` now. The primary's only while the pair protects (a
    /// primary waiting for its backup or yielded decides every packet itself).
    fn eng_eligible(&self, key: &ConnKey) -> bool {
        match (&self.primary, &self.backup) {
            (Some(p), _) => matches!(self.state, State::Protecting | State::Fencing) && p.fast_eligible(key),
            (_, Some(b)) => b.fast_eligible(key),
            _ => false,
        }
    }

    /// The programs will never carry `key` again (the primary no longer protects it).
    fn eng_never(&self, key: &ConnKey) -> bool {
        match (&self.primary, &self.backup) {
            (Some(p), _) => p.fast_never(key),
            _ => false,
        }
    }

    fn eng_state(&self, key: &ConnKey) -> Option<Fields> {
        match (&self.primary, &self.backup) {
            (Some(p), _) => p.fast_state(key).map(Fields::Primary),
            (_, Some(b)) => b.fast_state(key).map(Fields::Backup),
            _ => None,
        }
    }

    fn eng_load(&mut self, key: &ConnKey, f: &Fields) -> bool {
        match (self.primary.as_mut(), self.backup.as_mut(), f) {
            (Some(p), _, Fields::Primary(f)) => p.set_fast_state(key, f),
            (None, Some(b), Fields::Backup(f)) => b.set_fast_state(key, f),
            _ => false,
        }
    }

    /// The fast path is off for this reason (said once at start, shown in the status).
    pub fn fast_off(&mut self, why: String) {
        self.fast.map = None;
        self.fast.off_because = Some(why);
    }

    pub fn fast_path_on(&self) -> bool {
        self.fast.map.is_some() && !self.fast.egress_lost
    }

    pub fn fast_counters(&self) -> &FastCounters {
        &self.fast.counters
    }

    /// Where `key`'s fields are, as the core knows it.
    pub fn fast_where(&self, key: &ConnKey) -> Fast {
        self.fast.conns.get(key).copied().unwrap_or_default()
    }

    /// The status's `fast_path` object: on or off (and why), the hand-off's counters, the
    /// programs'.
    pub fn fast_status(&mut self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        m.insert("on".into(), (self.fast.map.is_some() && !self.fast.egress_lost).into());
        if let Some(why) = &self.fast.off_because {
            m.insert("off_because".into(), why.clone().into());
        }
        if self.fast.map.is_some() {
            m.insert("handoff".into(), serde_json::to_value(self.fast.counters).unwrap_or_default());
            m.insert("installed_now".into(), (self.fast.conns.len() as u64).into());
            m.insert("held".into(), (self.fast.held.len() as u64).into());
            m.insert("promoted".into(), (self.fast.retired && !self.fast.egress_lost).into());
            m.insert("egress_lost".into(), self.fast.egress_lost.into());
        }
        if let Some(map) = self.fast.map.as_mut() {
            for (k, v) in map.stats() {
                m.insert(k.into(), v.into());
            }
        }
        serde_json::Value::Object(m)
    }

    /// Before a packet (`counted`: marked by the programs) or a message touching `key` is
    /// decided: its fields from the map into the engine, if the map holds the newest.
    fn fast_take(&mut self, key: ConnKey, counted: bool, now_ms: u64) {
        if self.fast.retired {
            return;
        }
        let Some(map) = self.fast.map.as_mut() else { return };
        let known = self.fast.conns.get(&key).copied().unwrap_or_default();
        if !counted && known != Fast::Kernel {
            // Not in the map: installed after if the engine aligned it. Or held: frozen, the
            // engine has its newest fields already (the programs never change a frozen entry).
            self.fast.dirty.push(key);
            return;
        }
        match map.take(&key, counted, now_ms) {
            Some(t) => {
                self.fast.counters.taken += 1;
                if t.newest || known != Fast::Held {
                    let loaded = self.eng_load(&key, &t.fields);
                    if !loaded {
                        // The engine no longer follows it (forgotten, evicted) or cannot take
                        // these fields: the entry stays frozen until it is removed below.
                        self.fast.counters.load_refused += 1;
                    }
                }
                self.fast.conns.insert(key, Fast::Held);
                self.fast.held.entry(key).or_insert(now_ms);
            }
            None => {
                if known != Fast::Off {
                    self.fast.counters.lost += 1;
                }
                self.fast.conns.remove(&key);
                self.fast.held.remove(&key);
            }
        }
        self.fast.dirty.push(key);
    }

    /// After a packet or message was decided: what the map must do for the connections it
    /// touched, carried out (install, thaw, remove).
    fn fast_settle(&mut self, now_ms: u64) {
        if self.fast.retired {
            self.fast.dirty.clear();
            return;
        }
        let Some(mut map) = self.fast.map.take() else { return };
        let mut dirty = std::mem::take(&mut self.fast.dirty);
        dirty.sort_by_key(|k| (k.client_port, k.server_port, k.client));
        dirty.dedup();
        for key in dirty.drain(..) {
            if self.fast.deferred.contains(&key) {
                continue;
            }
            let known = self.fast.conns.get(&key).copied().unwrap_or_default();
            // The primary's connections leave the map whenever the engine must decide them
            // (held output, its server's FIN): kept frozen, their pure ACKs would pass unlearned
            // for good. Installed again once eligible.
            let gone_for_now = self.primary.is_some() && !self.eng_eligible(&key);
            if !self.eng_follows(&key) || (known != Fast::Off && (self.eng_never(&key) || gone_for_now)) {
                if known == Fast::Kernel && self.eng_follows(&key) {
                    // The programs' fields are the newest: into the engine before the entry goes.
                    if let Some(t) = map.take(&key, false, now_ms) {
                        self.fast.counters.taken += 1;
                        self.eng_load(&key, &t.fields);
                    }
                }
                if known != Fast::Off {
                    map.apply(&MapOp::Remove(key), now_ms);
                    self.fast.counters.removed += 1;
                    self.fast.conns.remove(&key);
                    self.fast.held.remove(&key);
                }
                continue;
            }
            // Not eligible (output beyond a gap, held output): it stays the engine's, frozen.
            if !self.eng_eligible(&key) {
                continue;
            }
            let Some(f) = self.eng_state(&key) else { continue };
            let op = match known {
                Fast::Kernel => continue,
                Fast::Off if now_ms < self.fast.install_after_ms => continue,
                Fast::Off => MapOp::Install(key, f),
                Fast::Held => MapOp::Thaw(key, f),
            };
            let done = map.apply(&op, now_ms);
            let c = &mut self.fast.counters;
            match (&op, done) {
                (MapOp::Install(..), MapDone::Kernel) => c.installed += 1,
                (MapOp::Install(..), _) => {
                    c.install_refused += 1;
                    self.fast.install_after_ms = now_ms + INSTALL_BACKOFF_MS;
                }
                (MapOp::Thaw(..), MapDone::Kernel) => c.thawed += 1,
                (MapOp::Thaw(..), MapDone::Held) => c.thaw_refused += 1,
                (_, MapDone::Gone) => c.lost += 1,
                _ => {}
            }
            match done {
                MapDone::Kernel => {
                    self.fast.conns.insert(key, Fast::Kernel);
                    self.fast.held.remove(&key);
                }
                MapDone::Held => {
                    self.fast.conns.insert(key, Fast::Held);
                    self.fast.held.entry(key).or_insert(now_ms);
                }
                MapDone::Gone => {
                    self.fast.conns.remove(&key);
                    self.fast.held.remove(&key);
                }
            }
        }
        self.fast.dirty = dirty;
        self.fast.map = Some(map);
    }

    /// A packet from the queue, before the engine: `None` to go on (its connection taken from
    /// the map if needed), or the verdict of a packet the programs already decided
    /// ([`MARK_DONE`]): accepted as it is, never rewritten twice.
    pub(super) fn fast_before_packet(&mut self, meta: &Meta, pkt: &[u8], outgoing: bool, now_ms: u64) -> Option<Verdict> {
        self.fast.map.as_ref()?;
        if !outgoing && meta.mark & MARK_DONE != 0 {
            self.fast.counters.fast_done_queued += 1;
            return Some(Verdict::Accept { modified: false });
        }
        if let Some(key) = conn_key(pkt, outgoing) {
            self.fast_take(key, meta.mark & MARK_SLOW != 0, now_ms);
        }
        None
    }

    /// The primary, before its engine reads a report of the backup: each record of a
    /// connection the programs own is applied to the entry in place when it carries only
    /// receive figures and alignment (the common case: the gate follows the backup without a
    /// freeze), and the fields loaded into the engine; anything else (FIN, RST, MISALIGNED,
    /// DIVERGED, a record the engine will answer with a packet) takes the connection as for
    /// any message. Returns the records applied in place, with the fields loaded.
    pub(super) fn fast_before_report(&mut self, recs: &[ConnProgress], now_ms: u64) -> Vec<(ConnKey, Fields)> {
        let mut applied = vec![];
        if self.fast.map.is_none() || self.fast.retired {
            return applied;
        }
        let simple = rw_flag::ISN_KNOWN | rw_flag::ALIGNED | rw_flag::RCV_KNOWN | rw_flag::V6;
        // A connection's records come together, its checkpoints first, its own figures last
        // (the same receive figures in each): one operation per connection, with the last.
        let mut last: Vec<&ConnProgress> = Vec::with_capacity(recs.len());
        for r in recs {
            match last.last_mut() {
                Some(l) if (l.client, l.client_port, l.server_port) == (r.client, r.client_port, r.server_port) => *l = r,
                _ => last.push(r),
            }
        }
        let mut seen: std::collections::HashSet<ConnKey> = std::collections::HashSet::with_capacity(last.len());
        for r in last {
            let key = ConnKey { client: r.client, client_port: r.client_port, server_port: r.server_port };
            if !seen.insert(key) {
                continue;
            }
            match self.fast_where(&key) {
                Fast::Off => continue,
                Fast::Held => {
                    self.fast_take(key, false, now_ms);
                    continue;
                }
                Fast::Kernel => {}
            }
            if r.flags & !simple != 0 {
                self.fast_take(key, false, now_ms);
                continue;
            }
            let Some(map) = self.fast.map.as_mut() else { return applied };
            match map.report(&key, r, now_ms) {
                Reported::Kernel(f) => {
                    self.fast.counters.reports_in_place += 1;
                    if self.eng_load(&key, &f) {
                        applied.push((key, f));
                    } else {
                        self.fast.counters.load_refused += 1;
                        self.fast_take(key, false, now_ms);
                    }
                }
                Reported::Taken(f) => {
                    self.fast.counters.taken += 1;
                    if !self.eng_load(&key, &f) {
                        self.fast.counters.load_refused += 1;
                    }
                    self.fast.conns.insert(key, Fast::Held);
                    self.fast.held.entry(key).or_insert(now_ms);
                    self.fast.dirty.push(key);
                }
                Reported::Frozen => self.fast_take(key, false, now_ms),
                Reported::Gone => {
                    self.fast.counters.lost += 1;
                    self.fast.conns.remove(&key);
                    self.fast.held.remove(&key);
                }
            }
        }
        applied
    }

    /// After the engine read the report: a record applied in place that the engine answered
    /// otherwise than the programs foresaw (its fields moved: a fresh ACK or a relayed ACK the
    /// programs' clock did not see coming) takes the connection now, the programs' newest
    /// fields with what the engine sent (the ACK it sent, the client's ACK it relayed: both
    /// only grow) kept.
    pub(super) fn fast_after_report(&mut self, applied: Vec<(ConnKey, Fields)>, now_ms: u64) {
        if applied.is_empty() {
            return;
        }
        let pending = self.primary.as_ref().map(|p| p.pending_keys()).unwrap_or_default();
        for (key, before) in applied {
            let Some(after) = self.eng_state(&key) else { continue };
            // Packets the engine built for it (duplicate ACKs of its timers, on these fields)
            // are stamped with its newest timestamp when they leave: taken first, so that it
            // is the programs' newest, and given back after the sends.
            let sends = pending.contains(&key);
            if (after == before && !sends) || self.fast_where(&key) != Fast::Kernel {
                continue;
            }
            self.fast.counters.report_mismatch += 1;
            let Some(map) = self.fast.map.as_mut() else { return };
            let Some(t) = map.take(&key, false, now_ms) else {
                self.fast.conns.remove(&key);
                self.fast.held.remove(&key);
                continue;
            };
            self.fast.counters.taken += 1;
            let merged = match (t.fields, after) {
                (Fields::Primary(mut k), Fields::Primary(e)) => {
                    k.sent_ack = match (k.sent_ack, e.sent_ack) {
                        (Some(a), Some(b)) => Some(if b.gt(a) { b } else { a }),
                        (a, b) => a.or(b),
                    };
                    if e.client_ack.gt(k.client_ack) {
                        k.client_ack = e.client_ack;
                    }
                    k.ts_max = match (k.ts_max, e.ts_max) {
                        (Some(a), Some(b)) => Some(if (b.wrapping_sub(a) as i32) > 0 { b } else { a }),
                        (a, b) => a.or(b),
                    };
                    Fields::Primary(k)
                }
                (k, _) => k,
            };
            self.eng_load(&key, &merged);
            self.fast.conns.insert(key, Fast::Held);
            self.fast.held.entry(key).or_insert(now_ms);
            self.fast.dirty.push(key);
        }
    }

    /// The engine stopped protecting `key`: its entry goes when the connection is settled.
    pub(super) fn fast_never_again(&mut self, key: ConnKey) {
        if self.fast.map.is_some() && self.fast.conns.contains_key(&key) {
            self.fast.dirty.push(key);
        }
    }

    /// After the engine decided a packet from the queue: the connections it touched wait for
    /// its verdict to leave ([`Core::fast_after_flush`]).
    pub(super) fn fast_after_packet(&mut self) {
        if self.fast.map.is_none() {
            return;
        }
        let d = std::mem::take(&mut self.fast.dirty);
        self.fast.deferred.extend(d);
    }

    /// The queue's verdicts were sent: the connections the packets touched are settled now.
    pub fn fast_after_flush(&mut self, now_ms: u64) {
        if self.fast.deferred.is_empty() {
            return;
        }
        let d = std::mem::take(&mut self.fast.deferred);
        self.fast.dirty.extend(d);
        self.fast_settle(now_ms);
    }

    /// Before a side-channel message of the primary is decided: the connections it names
    /// that the programs own are taken (`FREEZE`).
    pub(super) fn fast_before_message(&mut self, keys: impl Iterator<Item = ConnKey>, now_ms: u64) {
        if self.fast.map.is_none() || self.fast.retired {
            return;
        }
        for key in keys {
            if self.fast.conns.contains_key(&key) {
                self.fast_take(key, false, now_ms);
            }
        }
    }

    /// After the message was decided: given back at once (no verdict waits).
    pub(super) fn fast_after_message(&mut self, now_ms: u64) {
        if self.fast.map.is_none() {
            return;
        }
        if self.primary.is_some() && !self.send.is_empty() {
            // The primary answered with packets for the client (a fresh ACK, a release): its
            // connections go back only after the round's sends, or a segment the programs
            // pass meanwhile would overtake them (an older timestamp behind a newer: PAWS).
            let d = std::mem::take(&mut self.fast.dirty);
            self.fast.deferred.extend(d);
            return;
        }
        self.fast_settle(now_ms);
    }

    /// The engine forgot `key` (its grace period ended): its entry goes.
    pub(super) fn fast_forget(&mut self, key: ConnKey, now_ms: u64) {
        if self.fast.conns.contains_key(&key) {
            self.fast.dirty.push(key);
            self.fast_settle(now_ms);
        }
    }

    /// The programs' loss counters: a rise since the last reading is logged (rate-limited),
    /// with what it costs.
    fn fast_losses(&mut self) {
        let Some(map) = self.fast.map.as_mut() else { return };
        let now = map.stats();
        for (name, what) in LOSS_KINDS {
            let Some(&(_, v)) = now.iter().find(|(n, _)| *n == name) else { continue };
            let before = self.fast.losses.iter().find(|(n, _)| *n == name).map_or(0, |(_, b)| *b);
            if v > before {
                self.log_limited("replica: fast path loss", || format!("replica: fast path: {} more {name}: {what}", v - before));
            }
        }
        self.fast.losses = now;
    }

    /// The records the programs sent since the last call, into the engine: every loop round,
    /// before the queue's packets.
    pub fn fast_records(&mut self, now_ms: u64) {
        let Some(map) = self.fast.map.as_mut() else { return };
        let recs = map.records();
        for r in recs {
            self.fast_record(r, now_ms);
        }
    }

    fn fast_record(&mut self, r: MapRecord, now_ms: u64) {
        match r {
            MapRecord::Changed(key) => {
                self.fast.counters.collected += 1;
                if self.fast_where(&key) == Fast::Kernel && !self.fast.retired {
                    // The engine's copy is stale: the report is built from the programs'.
                    if let Some(f) = self.fast.map.as_mut().and_then(|m| m.collect(&key, now_ms)) {
                        self.eng_load(&key, &f);
                    }
                }
                if let Some(b) = self.backup.as_mut() {
                    b.mark_changed(&key);
                }
                self.dirty = true;
            }
            MapRecord::Checkpoint(key, end, hash) => {
                self.fast.counters.checkpoints += 1;
                if let Some(b) = self.backup.as_mut() {
                    b.push_checkpoint(&key, end, hash);
                }
                self.dirty = true;
            }
            MapRecord::Kept(key, end_b, mut pkt) => {
                self.fast.counters.kept += 1;
                // The kernel left the sum for the NIC (CHECKSUM_PARTIAL): the take-over sends
                // the copy through a raw socket, with nobody to complete it.
                let n = pkt.len();
                unbroken_wire::ip::fill_tcp_checksum(&mut pkt, n);
                if let Some(b) = self.backup.as_mut() {
                    b.push_kept(&key, end_b, pkt);
                }
            }
            MapRecord::Input(key, pkt) => {
                self.fast.counters.inputs += 1;
                if let Some(b) = self.backup.as_mut() {
                    b.push_input(&key, &pkt);
                }
            }
            MapRecord::Slow { mut pkt, counted } => {
                self.fast.counters.slow_copies += 1;
                let n = pkt.len();
                unbroken_wire::ip::fill_tcp_checksum(&mut pkt, n);
                if self.primary.is_some() {
                    self.fast_primary_copy(pkt, counted, now_ms);
                    return;
                }
                let key = conn_key(&pkt, true);
                if let Some(k) = key {
                    self.fast_take(k, counted, now_ms);
                }
                let Some(b) = self.backup.as_mut() else { return };
                self.dirty = true;
                // Consumed in the kernel already: only what the engine makes of it counts.
                // Before the take-over it is withheld; after it (a copy that crossed the
                // promotion, or a promotion without the OUTPUT rule) it goes out translated.
                let v = b.outgoing(&mut pkt);
                self.send.extend(b.take_transmit());
                if matches!(v, Verdict::Accept { .. }) {
                    self.send.extend(split_for_raw(pkt));
                }
                self.fast_settle(now_ms);
            }
        }
    }

    /// The primary: a packet of its server that `rep_p_out` declined and consumed (copy mode),
    /// decided as the same packet from the queue would be ([`Mode::packet`]'s rules: dropped
    /// by a yielded primary, passed by one still waiting for its backup), and what the engine
    /// lets out sent by the raw socket, cut to wire segments. Its connection goes back to the
    /// kernel only after the round's sends ([`Core::fast_after_flush`]): a packet the programs
    /// claim later never overtakes it.
    fn fast_primary_copy(&mut self, mut pkt: Vec<u8>, counted: bool, now_ms: u64) {
        // The programs copy only packets they parsed from the service's address; anything else
        // here is no packet of a connection: never sent.
        let Some(k) = conn_key(&pkt, true) else {
            self.fast.counters.copies_unnamed += 1;
            return;
        };
        if self.state == State::Yielded {
            self.counters.yielded_dropped += 1;
            return;
        }
        if self.state == State::WaitingForPeer {
            self.counters.passed_unprotected += 1;
            self.send.extend(split_for_raw(pkt));
            return;
        }
        self.fast_take(k, counted, now_ms);
        let Some(p) = self.primary.as_mut() else { return };
        let v = p.outgoing(&mut pkt, now_ms);
        let pieces = if matches!(v, Verdict::Accept { .. }) { p.wire_segments(pkt) } else { vec![] };
        self.drain_primary();
        self.send.extend(pieces);
        let d = std::mem::take(&mut self.fast.dirty);
        self.fast.deferred.extend(d);
    }

    /// Before a full beat (the backup's) or a report (the primary's): the fields of the
    /// connections the programs own, so that it reports them as they are (a client packet the
    /// programs claim sets no `CHANGED`).
    pub(super) fn fast_refresh(&mut self, now_ms: u64) {
        if self.fast.retired {
            return;
        }
        // The primary's report takes the programs' figures of every connection they own at
        // every report, not less often: the backup injects the client's ACK its own host missed
        // from them (ST-TCP 3.6's LastAckReceived), and read every 50 ms instead, a backup
        // behind in relaxed mode, whose client had stopped acknowledging, crawled a window per
        // read and was taken for hung (2 of 3 benchmark runs). A `COLLECT` per connection and
        // report: what a large table costs is open.
        let Some(mut map) = self.fast.map.take() else { return };
        let keys: Vec<ConnKey> = self.fast.conns.iter().filter(|(_, w)| **w == Fast::Kernel).map(|(k, _)| *k).collect();
        for key in keys {
            if let Some(f) = map.collect(&key, now_ms) {
                self.eng_load(&key, &f);
            }
        }
        self.fast.map = Some(map);
    }

    /// The primary, before its engine's timers run ([`Primary::tick`]), every
    /// [`TIMED_REFRESH_MS`]: the fields of the connections they look at that the programs own,
    /// read (`COLLECT`, not frozen: for a connection the programs may carry the timers only
    /// read them, the lag bounds in particular; between two reads they see older, smaller
    /// figures, which can only delay a verdict of lag, never make one), and when the programs
    /// last passed new output (the engine's stall evidence).
    pub(super) fn fast_before_primary_tick(&mut self, now_ms: u64) {
        if self.fast.map.is_none() || self.fast.retired || now_ms < self.fast.timed_at + TIMED_REFRESH_MS {
            return;
        }
        self.fast.timed_at = now_ms;
        if let (Some(at), Some(p)) = (self.fast.map.as_mut().and_then(|m| m.output_at(now_ms)), self.primary.as_mut()) {
            p.output_seen(at);
        }
        let keys = self.primary.as_ref().map(|p| p.timed_keys()).unwrap_or_default();
        let Some(mut map) = self.fast.map.take() else { return };
        for key in keys {
            if self.fast_where(&key) == Fast::Kernel {
                if let Some(f) = map.collect(&key, now_ms) {
                    self.eng_load(&key, &f);
                }
            }
        }
        self.fast.map = Some(map);
    }

    /// The primary's fast path runs only while the pair protects: until its backup is first
    /// heard its server's output goes through the queue (the OUTPUT rule's match,
    /// [`FastMap::queue_out`]); once the primary yielded or no longer protects any connection
    /// (its backup failed or is stale) every connection leaves the map for good and the queue
    /// carries the output again. Called at the loop's top-level steps (never while a packet is
    /// being decided).
    pub fn fast_primary_mode(&mut self, now_ms: u64) {
        if self.primary.is_none() || self.fast.map.is_none() || self.fast.egress_lost {
            return;
        }
        let gone = self.state == State::Yielded || self.primary.as_ref().is_some_and(|p| p.unprotected().is_some());
        if gone && !self.fast.retired {
            self.fast_retire(now_ms);
        }
        let want_queue = self.fast.retired || !matches!(self.state, State::Protecting | State::Fencing);
        if want_queue != self.fast.queue_out {
            let Some(map) = self.fast.map.as_mut() else { return };
            match map.queue_out(want_queue) {
                Ok(()) => self.fast.queue_out = want_queue,
                Err(e) => self.log_limited("replica: fast path queue", || format!("replica: fast path: cannot switch the OUTPUT rule's match ({e}): the egress program keeps copying the server's output to this daemon")),
            }
        }
    }

    /// Time passes: a connection held for [`HOLD_BOUND_MS`] is given back if eligible, even
    /// though a counted packet never arrived; a connection the engine no longer follows
    /// leaves the map.
    pub fn fast_tick(&mut self, now_ms: u64) {
        if self.fast.map.is_none() || self.fast.retired {
            return;
        }
        if now_ms >= self.fast.losses_at + LOSS_CHECK_MS {
            self.fast.losses_at = now_ms;
            self.fast_losses();
        }
        if self.primary.is_some() && self.fast.lease_at.is_none_or(|t| now_ms >= t + LEASE_RENEW_MS) {
            self.fast.lease_at = Some(now_ms);
            if let Some(Err(e)) = self.fast.map.as_mut().map(|m| m.renew_lease()) {
                self.log_limited("replica: fast path lease", || format!("replica: fast path: cannot renew the programs' lease ({e}): they stop claiming packets within {LEASE_MS} ms (the slow path carries every connection)"));
            }
        }
        if now_ms >= self.fast.watch_at + EGRESS_WATCH_MS {
            self.fast.watch_at = now_ms;
            self.fast_watch(now_ms);
            if self.fast.retired {
                return;
            }
        }
        if now_ms >= self.fast.scan_at + SCAN_MS {
            self.fast.scan_at = now_ms;
            let gone: Vec<ConnKey> = self.fast.conns.keys().filter(|k| !self.eng_follows(k) || self.eng_never(k)).copied().collect();
            if !gone.is_empty() {
                self.fast.dirty.extend(gone);
                self.fast_settle(now_ms);
            }
        }
        let deferred = &self.fast.deferred;
        let stale: Vec<ConnKey> = self.fast.held.iter().filter(|(k, t)| now_ms.saturating_sub(**t) >= HOLD_BOUND_MS && !deferred.contains(k)).map(|(k, _)| *k).collect();
        if stale.is_empty() {
            return;
        }
        let Some(mut map) = self.fast.map.take() else { return };
        for key in stale {
            if !self.eng_eligible(&key) || self.fast_where(&key) != Fast::Held {
                // Stays the engine's (output beyond a gap); looked at again after the bound.
                self.fast.held.insert(key, now_ms);
                continue;
            }
            let Some(f) = self.eng_state(&key) else { continue };
            match map.apply(&MapOp::ThawForce(key, f), now_ms) {
                MapDone::Kernel => {
                    self.fast.counters.thaw_forced += 1;
                    self.fast.conns.insert(key, Fast::Kernel);
                    self.fast.held.remove(&key);
                }
                MapDone::Held => {
                    self.fast.held.insert(key, now_ms);
                }
                MapDone::Gone => {
                    self.fast.counters.lost += 1;
                    self.fast.conns.remove(&key);
                    self.fast.held.remove(&key);
                }
            }
        }
        self.fast.map = Some(map);
    }

    /// The take-over, before [`Backup::take_over`] (docs/architecture.md, "What attaching
    /// needs" 2): the server's packets through the queue again and the programs passing every
    /// packet ([`BackupMap::promote`]), the records still in the ring into the engine, every
    /// entry frozen and loaded into the engine, the map cleared.
    pub(super) fn fast_take_over(&mut self, now_ms: u64) {
        if self.fast.retired {
            return;
        }
        let Some(map) = self.fast.map.as_mut() else { return };
        if let Err(e) = map.promote() {
            self.fast.counters.promote_failed += 1;
            self.fast.copying = true;
            self.log(format!("replica: fast path: {e}: the server's packets keep reaching this daemon as copies from tc egress, translated and sent through the raw socket"));
        }
        self.fast_retire(now_ms);
    }

    /// Review finding 5: the egress filter that withholds the backup's server's output must
    /// still be there. Gone (a `tc qdisc del`, a recreated device, another tool's cleanup): the
    /// server's packets go through the queue again (one map write, [`BackupMap::user_out`]),
    /// every connection back to the engine, the fast path off for the rest of this run, said
    /// once. A look that could not be answered decides nothing (counted, logged).
    fn fast_watch(&mut self, now_ms: u64) {
        let Some(map) = self.fast.map.as_mut() else { return };
        let (looks, last) = map.egress_seen();
        let fresh = looks != self.fast.watch_looks;
        self.fast.watch_looks = looks;
        let gone = match last {
            None => None,
            Some(Ok(EgressSeen::Present)) if fresh => {
                self.fast.watch_unknown = 0;
                None
            }
            Some(Ok(EgressSeen::Gone(why))) => Some(why),
            Some(Ok(EgressSeen::Present)) | Some(Err(_)) => {
                self.fast.watch_unknown += 1;
                self.fast.counters.egress_check_failed += 1;
                let why = match &last {
                    Some(Err(e)) if fresh => e.clone(),
                    _ => "no new look (the watch waits for the kernel)".into(),
                };
                let n = self.fast.watch_unknown;
                if n >= EGRESS_UNKNOWN_MAX {
                    Some(format!("the egress filter could not be looked for {EGRESS_UNKNOWN_MAX} times in a row ({why})"))
                } else {
                    self.log_limited("replica: fast path watch", || format!("replica: fast path: no answer about the egress filter ({why}): {n} of {EGRESS_UNKNOWN_MAX} before the fast path goes off"));
                    None
                }
            }
        };
        let Some(why) = gone else { return };
        let Some(map) = self.fast.map.as_mut() else { return };
        let switched = map.user_out();
        self.fast.egress_lost = true;
        let prog = if self.primary.is_some() { "rep_p_out" } else { "rep_b_out" };
        self.fast.off_because = Some(format!("the egress filter of {prog}: {why}"));
        let whose = if self.primary.is_some() { "this primary's server's output (no longer gated in the kernel)" } else { "this backup's server's output" };
        match switched {
            Ok(()) => self.log(format!("replica: fast path: {why}: {whose} goes through NFQUEUE again, the fast path is off until the daemon restarts")),
            Err(e) => self.log(format!("replica: fast path: {why}, and the queue rule's match could not be switched ({e}): {whose} may reach the clients: stop this daemon and its server")),
        }
        self.fast_retire(now_ms);
    }

    /// Every connection from the map into the engine, the map cleared, nothing installed
    /// again: the take-over (after [`BackupMap::promote`]) and a lost egress filter.
    fn fast_retire(&mut self, now_ms: u64) {
        self.fast_records(now_ms);
        let mut keys: Vec<ConnKey> = self.fast.conns.keys().copied().collect();
        keys.sort_by_key(|k| (k.client_port, k.server_port, k.client));
        for key in &keys {
            self.fast_take(*key, false, now_ms);
        }
        // Copies the programs sent between the freeze and now.
        self.fast_records(now_ms);
        self.fast.dirty.clear();
        self.fast.deferred.clear();
        let Some(map) = self.fast.map.as_mut() else { return };
        for key in keys {
            map.apply(&MapOp::Remove(key), now_ms);
            self.fast.counters.removed += 1;
        }
        self.fast.conns.clear();
        self.fast.held.clear();
        self.fast.retired = true;
    }
}

/// A packet for the raw socket: a GSO super-packet cut to segments that fit any Ethernet MTU
/// (the backup's copy that crossed the take-over, and a primary's copy while it waits for its
/// backup; the engines' own sends cut to the client's MSS, `Primary::wire_segments`).
fn split_for_raw(pkt: Vec<u8>) -> Vec<Vec<u8>> {
    if pkt.len() <= 1500 {
        return vec![pkt];
    }
    let Ok(info) = unbroken_wire::ip::IpInfo::parse(&pkt) else { return vec![pkt] };
    let hdr = pkt.get(info.l4_offset + 12).map_or(20, |b| ((b >> 4) as usize) * 4);
    let room = 1500usize.saturating_sub(info.l4_offset + hdr).max(536);
    unbroken_wire::ip::split_tcp(&pkt, room).unwrap_or_else(|_| vec![pkt])
}
