//! Replica mode's fast path in the kernel (issue 22 item 4): the programs of
//! [`unbroken_drivers::fastpath::replica`] loaded and attached to the segment device, behind
//! the core's [`FastMap`] (`crate::replica::core`'s fast half decides; this only carries its
//! operations to the map of the daemon's role, `rep_b_conns` or `rep_p_conns`, converts the
//! clocks, and puts the ring's pieces together).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use unbroken_drivers::fastpath::Error;
use unbroken_drivers::fastpath::replica::{ctl, EgressSeen, EgressWatch, Key, Op, OpResult, PState, PieceOf, Record, Replica, State};
use unbroken_drivers::iptables::{BuiltinChain, RuleSpec, Rules};
use unbroken_engines::replica::{BFast, ConnKey, PFast};
use unbroken_wire::Seq;

use crate::replica::core::{FastMap, Fields, MapDone, MapOp, MapRecord, Reported, Taken};
use unbroken_wire::replica::{flag as rw_flag, ConnProgress};

/// The kernel's clock as `bpf_ktime_get_ns` reads it (CLOCK_MONOTONIC, ns).
use unbroken_drivers::fastpath::monotonic_ns as kernel_ns;

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
    /// The primary's map (`rep_p_conns`) rather than the backup's.
    primary: bool,
    /// The pair's strict output commit (the programs' REP_B_STRICT).
    strict: bool,
    /// The queue rules whose OUTPUT jump the take-over adds: `None` when their OUTPUT rule is
    /// in from the start, gated by `rep_q_out` (the daemon's way; promoting is then one map
    /// write) and in tests.
    pub rules: Option<RuleSpec>,
    pieces: Pieces,
    /// The egress filter's watch ([`KernelMap::watch_egress`]; none in tests).
    watch: Option<EgressWatch>,
}

/// The ring's pieces put together: per kind of record and CPU (one packet's pieces are
/// consecutive in the ring, two CPUs' interleave) the packet being assembled: its number on
/// that CPU, its connection, the record's first word, the bytes so far. At most one per kind
/// and CPU, so unfinished packets cannot pile up.
#[derive(Default)]
pub struct Pieces {
    open: HashMap<(u8, u32), (u32, Key, u32, Vec<u8>)>,
    /// Pieces that did not fit together (a record lost: the ring was full).
    pub dropped: u64,
}

impl Pieces {
    /// A piece of a kept, copied or input packet (`kind`): the whole packet with the record's
    /// first word once its last piece came. A piece that does not continue the packet its CPU
    /// was writing (a lost record) drops that packet, counted: never joined to another's bytes.
    #[allow(clippy::too_many_arguments)]
    pub fn add(&mut self, kind: u8, key: Key, a: u32, total: u32, off: u32, of: PieceOf, bytes: Vec<u8>) -> Option<(u32, Vec<u8>)> {
        let slot = (kind, of.cpu);
        if off == 0 {
            if self.open.remove(&slot).is_some() {
                self.dropped += 1;
            }
            self.open.insert(slot, (of.id, key, a, Vec::with_capacity(total.min(1 << 16) as usize)));
        }
        let Some(p) = self.open.get_mut(&slot) else {
            self.dropped += 1;
            return None;
        };
        if p.0 != of.id || p.1 != key || p.3.len() != off as usize || off as usize + bytes.len() > total as usize {
            self.open.remove(&slot);
            self.dropped += 1;
            return None;
        }
        p.3.extend_from_slice(&bytes);
        if p.3.len() < total as usize {
            return None;
        }
        self.open.remove(&slot).map(|(_, _, a, b)| (a, b))
    }
}

impl KernelMap {
    pub fn new(fp: Replica, strict: bool, rules: Option<RuleSpec>) -> KernelMap {
        KernelMap { fp, primary: false, strict, rules, pieces: Pieces::default(), watch: None }
    }

    /// The primary's map (`rep_p_conns`, the programs `rep_p_in` and `rep_p_out`).
    pub fn new_primary(fp: Replica, strict: bool) -> KernelMap {
        KernelMap { fp, primary: true, strict, rules: None, pieces: Pieces::default(), watch: None }
    }

    /// Starts the egress filter's watch (a thread looking every `EGRESS_WATCH_MS`).
    pub fn watch_egress(&mut self) -> Result<(), String> {
        let w = self.fp.watch_egress(std::time::Duration::from_millis(crate::replica::core::EGRESS_WATCH_MS)).map_err(|e| e.to_string())?;
        self.watch = Some(w);
        Ok(())
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

    /// The primary's: `client_heard_at` between the two clocks.
    fn p_to_engine(&self, s: &PState, now_ms: u64) -> PFast {
        let age_ms = kernel_ns().saturating_sub(s.heard_at) / 1_000_000;
        s.to_engine(now_ms.saturating_sub(age_ms))
    }

    fn p_from_engine(&self, f: &PFast, now_ms: u64) -> PState {
        let at = kernel_ns().saturating_sub(now_ms.saturating_sub(f.client_heard_at).saturating_mul(1_000_000));
        PState::from_engine(f, self.strict, at)
    }

    /// Whether the fields are this role's (the core builds only its role's; any other is
    /// treated as no fields: the connection leaves the map).
    fn fits(&self, f: &Fields) -> bool {
        matches!((self.primary, f), (true, Fields::Primary(_)) | (false, Fields::Backup(_)))
    }

    /// The three map operations, each the one place that tells the two roles' maps apart
    /// (`rep_b_conns` or `rep_p_conns`, and their state's conversion); the caller checked
    /// [`Self::fits`].
    fn install(&mut self, key: &ConnKey, f: &Fields, now_ms: u64) -> Result<bool, Error> {
        match f {
            Fields::Primary(p) => {
                let st = self.p_from_engine(p, now_ms);
                self.fp.p_install(&key_of(key), &st)
            }
            Fields::Backup(b) => {
                let st = self.from_engine(b, now_ms);
                self.fp.install(&key_of(key), &st)
            }
        }
    }

    fn remove(&mut self, key: &ConnKey) -> Result<(), Error> {
        if self.primary {
            self.fp.p_remove(&key_of(key))
        } else {
            self.fp.remove(&key_of(key))
        }
    }

    /// An op program run on the role's map: its result, the control word before it, and the
    /// entry's fields after it in the engine's form.
    fn op(&mut self, op: Op, key: &ConnKey, value: Option<&Fields>, now_ms: u64) -> Result<(OpResult, u32, Fields), Error> {
        if self.primary {
            let v = match value {
                Some(Fields::Primary(p)) => Some(self.p_from_engine(p, now_ms)),
                _ => None,
            };
            let (r, ctl_before, e) = self.fp.p_op(op, &key_of(key), v.as_ref())?;
            return Ok((r, ctl_before, Fields::Primary(self.p_to_engine(&e.state, now_ms))));
        }
        let v = match value {
            Some(Fields::Backup(b)) => Some(self.from_engine(b, now_ms)),
            _ => None,
        };
        let a = self.fp.op(op, &key_of(key), v.as_ref())?;
        Ok((a.result, a.ctl_before, Fields::Backup(self.to_engine(key, &a.entry.state, now_ms))))
    }

    fn log(what: &str, e: impl std::fmt::Display) {
        crate::ratelog::log("replica: fast path", || format!("replica: fast path: {what}: {e}"));
    }
}

impl FastMap for KernelMap {
    fn take(&mut self, key: &ConnKey, counted: bool, now_ms: u64) -> Option<Taken> {
        let op = if counted { Op::Take } else { Op::Freeze };
        match self.op(op, key, None, now_ms) {
            Ok((OpResult::Done, ctl_before, fields)) => Some(Taken { newest: ctl_before & ctl::USER == 0, fields }),
            Ok(_) => None,
            Err(e) => {
                Self::log("taking an entry", e);
                None
            }
        }
    }

    fn apply(&mut self, op: &MapOp, now_ms: u64) -> MapDone {
        let res = match op {
            MapOp::Install(k, f) if self.fits(f) => match self.install(k, f, now_ms) {
                Ok(true) => Ok(MapDone::Kernel),
                // An entry the core did not know of: neither copy is sure to be the newest;
                // the slow path carries the connection until it is installed again.
                Ok(false) => self.remove(k).map(|_| MapDone::Gone),
                Err(e) => Err(e),
            },
            MapOp::Thaw(k, f) | MapOp::ThawForce(k, f) if self.fits(f) => {
                let o = if matches!(op, MapOp::Thaw(..)) { Op::Thaw } else { Op::ThawForce };
                self.op(o, k, Some(f), now_ms).map(|(r, _, _)| match r {
                    OpResult::Done => MapDone::Kernel,
                    OpResult::Stale => MapDone::Held,
                    OpResult::NoEntry | OpResult::Taken => MapDone::Gone,
                })
            }
            MapOp::Remove(k) | MapOp::Install(k, _) | MapOp::Thaw(k, _) | MapOp::ThawForce(k, _) => self.remove(k).map(|_| MapDone::Gone),
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

    fn collect(&mut self, key: &ConnKey, now_ms: u64) -> Option<Fields> {
        match self.op(Op::Collect, key, None, now_ms) {
            Ok((OpResult::Done, _, fields)) => Some(fields),
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
                Record::Keep { key, end_b, total, off, of, bytes } => {
                    if let Some((end_b, pkt)) = self.pieces.add(0, key, end_b, total, off, of, bytes) {
                        out.push(MapRecord::Kept(conn_of(&key), Seq(end_b), pkt));
                    }
                }
                Record::Slow { key, counted, total, off, of, bytes } => {
                    if let Some((counted, pkt)) = self.pieces.add(1, key, counted as u32, total, off, of, bytes) {
                        out.push(MapRecord::Slow { pkt, counted: counted != 0 });
                    }
                }
                Record::Input { key, total, off, of, bytes } => {
                    if let Some((_, pkt)) = self.pieces.add(2, key, 0, total, off, of, bytes) {
                        out.push(MapRecord::Input(conn_of(&key), pkt));
                    }
                }
                Record::Unknown(_) => self.pieces.dropped += 1,
            }
        }
        out
    }

    fn promote(&mut self) -> Result<(), String> {
        // The queue first: from the moment the programs pass the server's packets, the OUTPUT
        // rule must already send them through the engine. Gated by `rep_q_out`, the rule is in
        // already, and the one write below switches both (review finding 4).
        if let Some(spec) = &self.rules {
            Rules::add_jump(spec, BuiltinChain::Output).map_err(|e| format!("installing the OUTPUT queue rule: {e}"))?;
        }
        self.fp.set_promoted(true).map_err(|e| format!("promoting rep_b_out: {e}"))
    }

    fn egress_seen(&mut self) -> (u64, Option<Result<EgressSeen, String>>) {
        match &self.watch {
            // Started, no look yet: no answer (counted: a watch stuck from the start decides).
            Some(w) => {
                let (n, last) = w.seen();
                (n, Some(last.unwrap_or_else(|| Err("no look yet".into()))))
            }
            None => (0, None),
        }
    }

    fn user_out(&mut self) -> Result<(), String> {
        self.fp.set_user_out().map_err(|e| e.to_string())
    }

    fn queue_out(&mut self, on: bool) -> Result<(), String> {
        self.fp.set_queue_out(on).map_err(|e| e.to_string())
    }

    fn report(&mut self, key: &ConnKey, rec: &ConnProgress, now_ms: u64) -> Reported {
        if !self.primary {
            return Reported::Frozen;
        }
        let rcv = (rec.flags & rw_flag::RCV_KNOWN != 0).then_some((rec.rcv_nxt, rec.rcv_edge));
        match self.fp.p_report(&key_of(key), rcv, rec.flags & rw_flag::ALIGNED != 0, rec.last_ack) {
            Ok((OpResult::Done, e)) => Reported::Kernel(Fields::Primary(self.p_to_engine(&e.state, now_ms))),
            Ok((OpResult::Taken, e)) => Reported::Taken(Fields::Primary(self.p_to_engine(&e.state, now_ms))),
            Ok((OpResult::Stale, _)) => Reported::Frozen,
            Ok((OpResult::NoEntry, _)) => Reported::Gone,
            Err(e) => {
                Self::log("a report in place", e);
                Reported::Frozen
            }
        }
    }

    fn renew_lease(&mut self) -> Result<(), String> {
        if !self.primary {
            return Ok(());
        }
        self.fp.set_lease(kernel_ns() + crate::replica::core::LEASE_MS * 1_000_000).map_err(|e| e.to_string())
    }

    fn output_at(&mut self, now_ms: u64) -> Option<u64> {
        if !self.primary {
            return None;
        }
        let at = self.fp.p_clock().ok().filter(|t| *t != 0)?;
        Some(now_ms.saturating_sub(kernel_ns().saturating_sub(at) / 1_000_000))
    }

    fn stats(&mut self) -> Vec<(&'static str, u64)> {
        let mut v = vec![("pieces_dropped", self.pieces.dropped)];
        if self.primary {
            if let Ok(c) = self.fp.p_counters() {
                v.extend([("kernel_incoming", c.incoming), ("kernel_outgoing", c.outgoing), ("kernel_slow", c.slow), ("kernel_dropped", c.dropped), ("kernel_acks_lowered", c.acks_lowered), ("kernel_ts_raised", c.ts_raised), ("kernel_unlearned", c.unlearned)]);
            }
            if let Ok(c) = self.fp.counters() {
                v.extend([("kernel_records_lost", c.records_lost), ("kernel_unparsed_dropped", c.unparsed_dropped)]);
            }
            return v;
        }
        if let Ok(c) = self.fp.counters() {
            v.extend([
                ("kernel_incoming", c.incoming),
                ("kernel_withheld", c.withheld),
                ("kernel_slow", c.slow),
                ("kernel_dropped", c.dropped),
                ("kernel_dropped_beyond", c.dropped_beyond),
                ("kernel_records_lost", c.records_lost),
                ("kernel_unparsed_dropped", c.unparsed_dropped),
                ("kernel_unacceptable", c.unacceptable),
                ("kernel_ack_unverified", c.ack_unverified),
                ("kernel_ack_clamped", c.ack_clamped),
            ]);
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(port: u16) -> Key {
        Key::new(SocketAddr::new("10.0.9.2".parse().unwrap(), port), 6379)
    }

    /// Review finding (issue 22): pieces of two packets were joined when their records
    /// interleaved. Two CPUs' pieces interleave and each packet comes out whole; a lost piece
    /// drops its packet, and the next packet of that CPU is never glued to what was left.
    #[test]
    fn hostile_pieces_of_two_packets_are_never_joined() {
        let mut p = Pieces::default();
        let (a, b) = (PieceOf { cpu: 0, id: 7 }, PieceOf { cpu: 1, id: 3 });
        assert_eq!(p.add(2, key(1), 0, 4, 0, a, vec![1, 1]), None);
        assert_eq!(p.add(2, key(1), 0, 4, 0, b, vec![2, 2]), None);
        assert_eq!(p.add(2, key(1), 0, 4, 2, a, vec![1, 1]), Some((0, vec![1, 1, 1, 1])));
        assert_eq!(p.add(2, key(1), 0, 4, 2, b, vec![2, 2]), Some((0, vec![2, 2, 2, 2])));
        assert_eq!(p.dropped, 0);
        // CPU 0's packet 8 loses its first piece: its second matches nothing open.
        assert_eq!(p.add(2, key(1), 0, 4, 2, PieceOf { cpu: 0, id: 8 }, vec![9, 9]), None);
        // Packet 9 loses its last piece; packet 10's second piece (same offset, same length)
        // must not complete packet 9.
        assert_eq!(p.add(2, key(1), 0, 4, 0, PieceOf { cpu: 0, id: 9 }, vec![3, 3]), None);
        assert_eq!(p.add(2, key(1), 0, 4, 2, PieceOf { cpu: 0, id: 10 }, vec![4, 4]), None);
        // Another kind on the same CPU, another connection: kept apart.
        assert_eq!(p.add(0, key(2), 77, 2, 0, PieceOf { cpu: 0, id: 11 }, vec![5, 5]), Some((77, vec![5, 5])));
        assert_eq!(p.dropped, 2);
        assert!(p.open.is_empty());
    }
}
