//! The backup's fast path in the kernel (issue 22 item 4): the programs of
//! [`unbroken_drivers::fastpath::replica`] loaded and attached to the segment device, behind
//! the core's [`BackupMap`] (`crate::replica::core`'s fast half decides; this only carries its
//! operations to the map, converts the clocks, and puts the ring's pieces together).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use unbroken_drivers::fastpath::replica::{ctl, Key, Op, OpResult, Record, Replica, State};
use unbroken_drivers::iptables::{BuiltinChain, RuleSpec, Rules};
use unbroken_engines::replica::{BFast, ConnKey};
use unbroken_wire::Seq;

use crate::replica::core::{BackupMap, MapDone, MapOp, MapRecord, Taken};

/// The kernel's clock as `bpf_ktime_get_ns` reads it (CLOCK_MONOTONIC, ns).
fn kernel_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime fills the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

pub fn key_of(k: &ConnKey) -> Key {
    Key::new(SocketAddr::new(k.client, k.client_port), k.server_port)
}

pub fn conn_of(k: &Key) -> ConnKey {
    let v6 = Ipv6Addr::from(k.client);
    let client = match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    };
    ConnKey { client, client_port: u16::from_be_bytes(k.client_port), server_port: u16::from_be_bytes(k.server_port) }
}

/// The loaded (and, in the daemon, attached) programs as the core's map.
pub struct KernelMap {
    pub fp: Replica,
    /// The pair's strict output commit (the programs' REP_B_STRICT).
    strict: bool,
    /// The queue rules: the take-over adds their OUTPUT jump (`None` in tests: nothing to add).
    rules: Option<RuleSpec>,
    /// Pieces of a kept or copied packet so far, per connection (a connection's records
    /// arrive in order; two connections' may interleave).
    pieces: HashMap<(bool, Key), (u32, bool, Vec<u8>)>,
    /// Pieces that did not fit together (a record lost: the ring was full).
    pub pieces_dropped: u64,
}

impl KernelMap {
    pub fn new(fp: Replica, strict: bool, rules: Option<RuleSpec>) -> KernelMap {
        KernelMap { fp, strict, rules, pieces: HashMap::new(), pieces_dropped: 0 }
    }

    /// The engine's form of an entry's state: `b_ts_seen`'s time from the kernel's clock to
    /// the engine's (`now_ms`).
    fn to_engine(&self, key: &ConnKey, s: &State, now_ms: u64) -> BFast {
        let age_ms = kernel_ns().saturating_sub(s.b_ts_at) / 1_000_000;
        s.to_engine(now_ms.saturating_sub(age_ms), key.client.is_ipv6())
    }

    fn from_engine(&self, f: &BFast, now_ms: u64) -> State {
        let at = f.b_ts_seen.map_or(0, |(_, t)| kernel_ns().saturating_sub(now_ms.saturating_sub(t).saturating_mul(1_000_000)));
        State::from_engine(f, self.strict, at)
    }

    fn log(what: &str, e: impl std::fmt::Display) {
        crate::ratelog::log("replica: fast path", || format!("replica: fast path: {what}: {e}"));
    }

    /// A piece of a kept (`keep`) or copied packet: the whole packet once its last piece came.
    fn piece(&mut self, keep: bool, key: Key, end_or_counted: u32, total: u32, off: u32, bytes: Vec<u8>) -> Option<(u32, bool, Vec<u8>)> {
        let slot = (keep, key);
        if off == 0 {
            if self.pieces.remove(&slot).is_some() {
                self.pieces_dropped += 1;
            }
            self.pieces.insert(slot, (end_or_counted, end_or_counted != 0, Vec::with_capacity(total as usize)));
        }
        let Some(p) = self.pieces.get_mut(&slot) else {
            self.pieces_dropped += 1;
            return None;
        };
        if p.2.len() != off as usize {
            self.pieces.remove(&slot);
            self.pieces_dropped += 1;
            return None;
        }
        p.2.extend_from_slice(&bytes);
        if p.2.len() < total as usize {
            return None;
        }
        let whole = self.pieces.remove(&slot)?;
        if whole.2.len() != total as usize {
            self.pieces_dropped += 1;
            return None;
        }
        Some(whole)
    }
}

impl BackupMap for KernelMap {
    fn take(&mut self, key: &ConnKey, counted: bool, now_ms: u64) -> Option<Taken> {
        match self.fp.op(if counted { Op::Take } else { Op::Freeze }, &key_of(key), None) {
            Ok(a) if a.result == OpResult::Done => Some(Taken { newest: a.ctl_before & ctl::USER == 0, fields: self.to_engine(key, &a.entry.state, now_ms) }),
            Ok(_) => None,
            Err(e) => {
                Self::log("taking an entry", e);
                None
            }
        }
    }

    fn apply(&mut self, op: &MapOp, now_ms: u64) -> MapDone {
        let res = match op {
            MapOp::Install(k, f) => {
                let st = self.from_engine(f, now_ms);
                match self.fp.install(&key_of(k), &st) {
                    Ok(true) => Ok(MapDone::Kernel),
                    // An entry the core did not know of: neither copy is sure to be the newest;
                    // the slow path carries the connection until it is installed again.
                    Ok(false) => self.fp.remove(&key_of(k)).map(|_| MapDone::Gone),
                    Err(e) => Err(e),
                }
            }
            MapOp::Thaw(k, f) | MapOp::ThawForce(k, f) => {
                let o = if matches!(op, MapOp::Thaw(..)) { Op::Thaw } else { Op::ThawForce };
                let st = self.from_engine(f, now_ms);
                self.fp.op(o, &key_of(k), Some(&st)).map(|a| match a.result {
                    OpResult::Done => MapDone::Kernel,
                    OpResult::Stale => MapDone::Held,
                    OpResult::NoEntry => MapDone::Gone,
                })
            }
            MapOp::Remove(k) => self.fp.remove(&key_of(k)).map(|_| MapDone::Gone),
        };
        res.unwrap_or_else(|e| {
            Self::log(&format!("{op:?}"), e);
            // A thaw that failed leaves the entry frozen: held. Anything else: the slow path.
            if matches!(op, MapOp::Thaw(..) | MapOp::ThawForce(..)) {
                MapDone::Held
            } else {
                MapDone::Gone
            }
        })
    }

    fn collect(&mut self, key: &ConnKey, now_ms: u64) -> Option<BFast> {
        match self.fp.op(Op::Collect, &key_of(key), None) {
            Ok(a) if a.result == OpResult::Done => Some(self.to_engine(key, &a.entry.state, now_ms)),
            Ok(_) => None,
            Err(e) => {
                Self::log("collecting an entry", e);
                None
            }
        }
    }

    fn records(&mut self) -> Vec<MapRecord> {
        let mut out = vec![];
        for r in self.fp.records() {
            match r {
                Record::Changed(k) => out.push(MapRecord::Changed(conn_of(&k))),
                Record::Checkpoint { key, end, hash } => out.push(MapRecord::Checkpoint(conn_of(&key), Seq(end), hash)),
                Record::Keep { key, end_b, total, off, bytes } => {
                    if let Some((end_b, _, pkt)) = self.piece(true, key, end_b, total, off, bytes) {
                        out.push(MapRecord::Kept(conn_of(&key), Seq(end_b), pkt));
                    }
                }
                Record::Slow { key, counted, total, off, bytes } => {
                    if let Some((_, counted, pkt)) = self.piece(false, key, counted as u32, total, off, bytes) {
                        out.push(MapRecord::Slow { pkt, counted });
                    }
                }
                Record::Unknown(_) => self.pieces_dropped += 1,
            }
        }
        out
    }

    fn promote(&mut self) -> Result<(), String> {
        // The queue first: from the moment the programs pass the server's packets, the OUTPUT
        // rule must already send them through the engine.
        if let Some(spec) = &self.rules {
            Rules::add_jump(spec, BuiltinChain::Output).map_err(|e| format!("installing the OUTPUT queue rule: {e}"))?;
        }
        self.fp.set_promoted(true).map_err(|e| format!("promoting rep_b_out: {e}"))
    }

    fn stats(&mut self) -> Vec<(&'static str, u64)> {
        let mut v = vec![("pieces_dropped", self.pieces_dropped)];
        if let Ok(c) = self.fp.counters() {
            v.extend([
                ("kernel_incoming", c.incoming),
                ("kernel_withheld", c.withheld),
                ("kernel_slow", c.slow),
                ("kernel_dropped", c.dropped),
                ("kernel_dropped_beyond", c.dropped_beyond),
                ("kernel_records_lost", c.records_lost),
                ("kernel_unacceptable", c.unacceptable),
                ("kernel_ack_unverified", c.ack_unverified),
                ("kernel_ack_clamped", c.ack_clamped),
            ]);
        }
        v
    }
}
