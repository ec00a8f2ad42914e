//! The guard's fast-path half (issue 22): which connections the kernel's programs carry
//! (`bpf/checkpoint/ckpt_tc.c`) and the hand-off of their state between the programs and
//! [`Core`], decided here; the map itself is behind [`FastMap`] (the daemon's is the kernel's,
//! `crate::checkpoint::runtime`; the simulation's an emulation).
//!
//! The protocol (`bpf/checkpoint/rtcp_state.h`): a connection is *installed* once it is
//! [`eligible`] (synchronized, checkpointed, no recovery under way, protected, open); from then
//! on the programs own its state and the core's copy is stale. A packet the programs leave to
//! the slow path freezes the entry; before the core decides any packet or command of an
//! installed connection it *takes* the state (the entry freezes, and the programs' copy is
//! merged into the core's when it was the newest); after deciding, it gives the connection back
//! (*thaw*) when still eligible, which the kernel refuses while a counted packet is still on its
//! way to the queue (then the core keeps the state, and the next packet's thaw succeeds); a
//! connection that closed or was released leaves the map. A frozen entry whose counted packet
//! never arrives (a full queue) is given back [`STALE_THAW_MS`] after the core began to hold it.
//! A connection a packet touched is given back only after that packet's verdict was sent
//! ([`Core::fast_after_flush`]: the queue's verdicts leave in batches), so that a packet the
//! programs claim after the thaw never overtakes one still waiting for its verdict.

use super::*;

/// How long the core holds an eligible connection at most, counted from when it began to hold
/// it (not from its last packet: a busy connection whose one counted packet was lost on its
/// way would otherwise never be given back), before it gives it back even though a counted
/// packet never reached the queue (a full queue dropped it). A counted packet that arrives
/// later is taken as any other (the kernel does not count it twice).
pub const STALE_THAW_MS: u64 = 200;

/// After the map refused a new entry (full), no install is tried for this long.
pub const INSTALL_BACKOFF_MS: u64 = 1000;

/// Where a connection's state is, as the core knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fast {
    /// Not in the map: the core's copy is the state.
    #[default]
    Off,
    /// In the map, the programs' (the core's copy is stale until taken).
    Kernel,
    /// In the map, frozen, the core's.
    Held,
}

/// What the fast path keeps of a connection: the engine's state and the guard's own beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastState {
    pub conn: Conn,
    pub a_hi: Option<u32>,
    pub peer_hi: Option<(u32, u32)>,
}

/// A taken entry: its state, and whether it was the newest (the programs owned it until now;
/// otherwise the core holds a newer copy since an earlier take).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastTaken {
    pub newest: bool,
    pub state: FastState,
}

/// What the core asks of the map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastOp {
    /// A new entry: the programs own the connection from now on.
    Install(FlowKey, FastState),
    /// Give a held connection back, unless a counted packet is still on its way.
    Thaw(FlowKey, FastState),
    /// Give it back anyway (see [`STALE_THAW_MS`]).
    ThawForce(FlowKey, FastState),
    Remove(FlowKey),
}

/// What became of a [`FastOp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastDone {
    /// The programs own the connection.
    Kernel,
    /// The entry stays frozen and the core's (a refused thaw, or an install that found one).
    Held,
    /// No entry (removed, or the map failed: the slow path carries the connection).
    Gone,
}

/// The map, as the core uses it.
pub trait FastMap: Send {
    /// Takes the state of `key` (freezing its entry); `counted`: the packet being decided was
    /// counted by the programs (marked). `None`: no entry.
    fn take(&mut self, key: &FlowKey, counted: bool) -> Option<FastTaken>;
    fn apply(&mut self, op: &FastOp) -> FastDone;
    /// RTCP C2 in place for a connection the programs own: the checkpoint raised to `ack_a`
    /// as ACKNOWLEDGE does, without taking the connection; the state after. `None`: refused
    /// (frozen, or C2 would change more), the core takes the connection instead.
    fn acknowledge(&mut self, key: &FlowKey, ack_a: u32) -> Option<FastState> {
        let _ = (key, ack_a);
        None
    }
    /// The programs' own counters, for the status.
    fn stats(&mut self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
}

/// Counters of the hand-off (status `fast_path`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct FastCounters {
    pub installed: u64,
    pub taken: u64,
    pub thawed: u64,
    /// Thaws refused: a counted packet was still on its way.
    pub thaw_refused: u64,
    pub thaw_forced: u64,
    pub removed: u64,
    /// Checkpoints (ACKNOWLEDGE) raised in the kernel without taking the connection.
    pub acknowledged_in_place: u64,
    /// Entries found missing or that the map would not create (the slow path carries them).
    pub lost: u64,
    /// Installs the map refused (full: [`INSTALL_BACKOFF_MS`] without installs follows).
    pub install_refused: u64,
}

/// The fast path's part of [`Core`].
#[derive(Default)]
pub struct FastPart {
    pub map: Option<Box<dyn FastMap>>,
    /// Connections whose entry may need an operation once the current packet or command is decided.
    dirty: Vec<FlowKey>,
    /// Connections in the map that left the table (expired, evicted, released).
    gone: Vec<FlowKey>,
    /// Connections held by the core, and since when (ms).
    held: HashMap<FlowKey, u64>,
    /// Connections a packet touched whose verdict has not been sent yet: settled after the
    /// flush.
    deferred: Vec<FlowKey>,
    /// No install before this time (ms): the map refused one (full).
    install_after_ms: u64,
    pub counters: FastCounters,
}

/// A connection the programs can carry: the engine's state lets them translate both ways
/// (synchronized, a checkpoint or everything acknowledged, no recovery in progress), its
/// handshake is complete (the peer's ACK was seen: a spoofed SYN never gets an entry in the
/// kernel's map, which is smaller than the guard's table), the guard has no decision pending on
/// it (no recovery SYN race, no nudge to send), it is protected and open.
fn eligible(e: &Entry, now_ms: u64) -> bool {
    use unbroken_engines::rtcp::flag;
    let c = &e.conn;
    c.flags & (flag::SYNCED | flag::RECOVERABLE) == flag::SYNCED | flag::RECOVERABLE
        && c.flags & (flag::SYN_PENDING | flag::ORIGIN_PINNED) == 0
        && c.flags & (flag::ACK_ALLOWED | flag::ACK_EVERYTHING) != 0
        && !c.is_closed()
        && c.flags & (flag::FIN_A_SEEN | flag::FIN_B_SEEN) == 0
        && !e.unprotected
        && e.recovery_syns.is_empty()
        && !e.recovery_armed(now_ms)
        && !e.nudge
}

fn state_of(e: &Entry) -> FastState {
    FastState { conn: e.conn, a_hi: e.a_hi, peer_hi: e.peer_hi }
}

impl Core {
    /// Hands connections to `map` from now on.
    pub fn enable_fast_path(&mut self, map: Box<dyn FastMap>) {
        self.fast.map = Some(map);
    }

    pub fn fast_counters(&self) -> &FastCounters {
        &self.fast.counters
    }

    pub fn fast_path_on(&self) -> bool {
        self.fast.map.is_some()
    }

    /// The status's `fast_path` object: on or off (and why), the hand-off's counters, the
    /// programs'.
    pub fn fast_status(&mut self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        m.insert("on".into(), self.fast.map.is_some().into());
        if let Some(why) = &self.fast_off_reason {
            m.insert("off_because".into(), why.clone().into());
        }
        m.insert("handoff".into(), serde_json::to_value(&self.fast.counters).unwrap_or_default());
        m.insert("held".into(), (self.fast.held.len() as u64).into());
        if let Some(map) = self.fast.map.as_mut() {
            for (k, v) in map.stats() {
                m.insert(k.into(), v.into());
            }
        }
        serde_json::Value::Object(m)
    }

    /// Before a packet (`counted`: marked by the programs) or a command of `key` is decided:
    /// its state from the map, if the map holds it.
    pub(super) fn fast_take(&mut self, key: FlowKey, counted: bool, now_ms: u64) {
        let Some(map) = self.fast.map.as_mut() else { return };
        let known = self.table.get(&key).map(|e| e.fast).unwrap_or_default();
        if !counted && known == Fast::Off {
            // Not in the map: installed after if it became eligible.
            self.fast.dirty.push(key);
            return;
        }
        match map.take(&key, counted) {
            Some(t) => {
                self.fast.counters.taken += 1;
                let e = self.entry(key, now_ms);
                if t.newest || e.fast != Fast::Held {
                    e.conn = t.state.conn;
                    e.a_hi = t.state.a_hi;
                    e.peer_hi = t.state.peer_hi;
                }
                e.fast = Fast::Held;
                self.fast.held.entry(key).or_insert(now_ms);
                self.fast.dirty.push(key);
            }
            None => {
                if known != Fast::Off {
                    self.fast.counters.lost += 1;
                }
                if let Some(e) = self.table.get_mut(&key) {
                    e.fast = Fast::Off;
                }
                self.fast.held.remove(&key);
                // Installed again below if eligible.
                self.fast.dirty.push(key);
            }
        }
    }

    /// An ACKNOWLEDGE (without the RECOVERY flag) of a connection the programs own: the
    /// checkpoint is raised in the map in place (C2, see [`FastMap::acknowledge`]) and the
    /// core's copy refreshed from it, so that the command then decided on that copy (C2 again:
    /// nothing changes) builds its answer and fresh ACK from the newest state. False when the
    /// core must take the connection instead.
    pub(super) fn fast_acknowledge(&mut self, key: FlowKey, cmd: &Command) -> bool {
        let Some(map) = self.fast.map.as_mut() else { return false };
        if cmd.op != ctl::Op::Acknowledge || cmd.flags & ctl::flag::RECOVERY != 0 {
            return false;
        }
        let Some(e) = self.table.get_mut(&key) else { return false };
        if e.fast != Fast::Kernel {
            return false;
        }
        let Some(s) = map.acknowledge(&key, cmd.ack_a) else { return false };
        e.conn = s.conn;
        e.a_hi = s.a_hi;
        e.peer_hi = s.peer_hi;
        self.fast.counters.acknowledged_in_place += 1;
        true
    }

    /// A connection the table forgets (expired, evicted, released).
    pub(super) fn fast_forget(&mut self, key: FlowKey, was: Fast) {
        if was != Fast::Off {
            self.fast.gone.push(key);
        }
    }

    /// After a packet or command was decided: what the map must do for the connections it
    /// touched, carried out.
    pub(super) fn fast_settle(&mut self, now_ms: u64) {
        let Some(mut map) = self.fast.map.take() else { return };
        for key in std::mem::take(&mut self.fast.gone) {
            self.fast.held.remove(&key);
            if !self.table.contains_key(&key) {
                map.apply(&FastOp::Remove(key));
                self.fast.counters.removed += 1;
            }
        }
        let mut dirty = std::mem::take(&mut self.fast.dirty);
        dirty.dedup();
        for key in dirty.drain(..) {
            // A packet of it still waits for its verdict: after the flush.
            if self.fast.deferred.contains(&key) {
                continue;
            }
            let Some(e) = self.table.get_mut(&key) else {
                if self.fast.held.remove(&key).is_some() {
                    map.apply(&FastOp::Remove(key));
                    self.fast.counters.removed += 1;
                }
                continue;
            };
            let op = if eligible(e, now_ms) {
                match e.fast {
                    Fast::Off if now_ms < self.fast.install_after_ms => continue,
                    Fast::Off => FastOp::Install(key, state_of(e)),
                    Fast::Held => FastOp::Thaw(key, state_of(e)),
                    Fast::Kernel => continue,
                }
            } else if e.fast != Fast::Off && (e.closed() || e.unprotected) {
                FastOp::Remove(key)
            } else {
                // Stays the core's (a recovery under way): every packet goes slow.
                continue;
            };
            let done = map.apply(&op);
            let c = &mut self.fast.counters;
            match (&op, done) {
                (FastOp::Install(..), FastDone::Kernel) => c.installed += 1,
                (FastOp::Thaw(..), FastDone::Kernel) => c.thawed += 1,
                (FastOp::Thaw(..), FastDone::Held) => c.thaw_refused += 1,
                (FastOp::Remove(_), _) => c.removed += 1,
                (FastOp::Install(..), FastDone::Gone) => {
                    c.install_refused += 1;
                    self.fast.install_after_ms = now_ms + INSTALL_BACKOFF_MS;
                }
                (_, FastDone::Gone) => c.lost += 1,
                _ => {}
            }
            e.fast = match (op, done) {
                (FastOp::Remove(_), _) | (_, FastDone::Gone) => Fast::Off,
                (_, d) => {
                    if d == FastDone::Kernel {
                        Fast::Kernel
                    } else {
                        Fast::Held
                    }
                }
            };
            if e.fast == Fast::Held {
                self.fast.held.entry(key).or_insert(now_ms);
            } else {
                self.fast.held.remove(&key);
            }
        }
        self.fast.dirty = dirty;
        self.fast.map = Some(map);
    }

    /// After a packet was decided: the connections it touched wait for its verdict to leave
    /// ([`Core::fast_after_flush`]).
    pub(super) fn fast_defer(&mut self) {
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

    /// Time passes: a connection held for [`STALE_THAW_MS`] since the core began to hold it is
    /// given back if eligible, even though a counted packet never arrived.
    pub fn fast_tick(&mut self, now_ms: u64) {
        if self.fast.map.is_none() || self.fast.held.is_empty() {
            return;
        }
        let deferred = &self.fast.deferred;
        let stale: Vec<FlowKey> = self.fast.held.iter().filter(|(k, t)| now_ms.saturating_sub(**t) >= STALE_THAW_MS && !deferred.contains(k)).map(|(k, _)| *k).collect();
        let Some(mut map) = self.fast.map.take() else { return };
        for key in stale {
            self.fast.held.remove(&key);
            let Some(e) = self.table.get_mut(&key) else { continue };
            if e.fast != Fast::Held || !eligible(e, now_ms) {
                continue;
            }
            e.fast = match map.apply(&FastOp::ThawForce(key, state_of(e))) {
                FastDone::Kernel => {
                    self.fast.counters.thaw_forced += 1;
                    Fast::Kernel
                }
                FastDone::Held => Fast::Held,
                FastDone::Gone => Fast::Off,
            };
        }
        self.fast.map = Some(map);
    }
}
