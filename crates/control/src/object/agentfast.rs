//! The agent's fast-path half (issue 22 item 3): which connections the kernel's programs
//! (`crates/drivers/bpf/object/obj_fast.c`) may carry, and the hand-off of what they kept,
//! decided here without I/O; the map itself is behind [`FastMap`] (the daemon's is the
//! kernel's, `crate::object::agent`; tests use an emulation).
//!
//! The protocol (docs/architecture.md, "Fast path: object mode"): an entry is *lent* to the
//! kernel when it was published with a fast flag (a quiet or passed-through connection); the
//! programs then pass the connection's unremarkable packets and keep what the engine would have
//! counted on them. Before the engine decides anything about a lent connection (a packet the
//! kernel left to the slow path, a store's completion, `expire`, a mute, an adoption …) the core
//! *takes* it ([`FastMap::take`]: from then on every packet of it goes slow) and the engine
//! absorbs what the kernel kept ([`unbroken_engines::trods::Engine::absorb`]); every connection the engine touched
//! is published again once the round's verdicts have left ([`FastPart`] via
//! `Core::fast_publish`), so that a packet the programs pass never overtakes one of the same
//! connection still waiting in the queue for its verdict.
//!
//! Fail safe: an entry whose kept fields the engine refuses (figures the fast path cannot have
//! produced) is counted (`absorb_refused`), the connection unprotected
//! ([`unbroken_engines::trods::Engine::abandon`]: its packets pass unparsed, never judged
//! against figures the engine knows to be stale) and never lent again; a map that refuses an entry
//! (full, an error) leaves the connection on the slow path; connections whose packets the core
//! itself holds (the fence, a failover) are never lent.

use std::collections::HashSet;

use unbroken_engines::trods::{FastKept, FastView, Key};

/// What the core asks of the kernel's map.
pub trait FastMap: Send {
    /// Takes the entry of `key` from the programs (every packet of the connection goes to the
    /// slow path from now on) once no program is writing it: what the kernel kept, `last_seen`
    /// in the engine's clock. `None`: no entry.
    fn take(&mut self, key: &Key) -> Option<FastKept>;
    /// Publishes `view` as the entry of `key`, creating it when there is none; with `lend`
    /// false, with no fast flag whatever the view. `Ok(true)`: the programs may now pass
    /// packets of it (it is lent). `Err`: refused (the map is full or failed); the connection
    /// stays on the slow path.
    fn publish(&mut self, key: &Key, view: &FastView, bucket: Option<u16>, lend: bool) -> Result<bool, String>;
    /// Removes the entry of `key` (every packet of it goes slow again).
    fn remove(&mut self, key: &Key);
}

/// Counters of the hand-off (status `fast_path`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct FastCounters {
    /// Entries created, published again, removed.
    pub created: u64,
    pub published: u64,
    pub removed: u64,
    /// Lent connections taken back before the engine acted on them.
    pub taken: u64,
    /// Taken entries whose kept fields the engine refused: those connections stay slow.
    pub absorb_refused: u64,
    /// Entries the map refused (full, an error): those connections stay slow.
    pub map_refused: u64,
    /// Connections lent to the kernel now.
    pub lent: u64,
}

/// The fast path's part of the core: off until a map is given.
#[derive(Default)]
pub struct FastPart {
    map: Option<Box<dyn FastMap>>,
    /// Connections with an entry.
    entries: HashSet<Key>,
    /// Connections whose entry lets the programs pass packets (the kernel may have moved them).
    lent: HashSet<Key>,
    /// Connections the engine acted on since the last publish.
    dirty: HashSet<Key>,
    /// Connections never to be lent again (their kept fields were refused).
    distrust: HashSet<Key>,
    /// No entry is created before this time (ms) after the map refused one.
    create_after: u64,
    pub counters: FastCounters,
}

/// An entry is created for a protected connection only when this much of a response body is
/// still to be sent (a few segments at least: an entry costs two system calls, created and
/// removed, about what the queue costs two packets).
pub const WORTH_BODY: u64 = 32 * 1024;

/// After the map refused an entry, no new one is tried for this long (ms).
pub const CREATE_BACKOFF_MS: u64 = 1000;

/// What the core tells [`FastPart::publish_all`] of one connection.
pub struct Publish {
    pub view: Option<FastView>,
    pub bucket: Option<u16>,
    /// The core holds packets of it (or it is being failed over): never lent now.
    pub held_by_core: bool,
}

impl FastPart {
    pub fn enable(&mut self, map: Box<dyn FastMap>) {
        self.map = Some(map);
    }

    pub fn on(&self) -> bool {
        self.map.is_some()
    }

    /// Before the engine acts on `key`: a lent entry is taken back, and what the kernel kept
    /// returned for the engine to absorb ([`unbroken_engines::trods::Engine::absorb`]; [`FastPart::refused`] when
    /// it will not). The connection is published again at the next [`FastPart::publish_all`].
    pub fn take(&mut self, key: &Key) -> Option<FastKept> {
        self.map.as_ref()?;
        self.dirty.insert(*key);
        if !self.lent.remove(key) {
            return None;
        }
        self.counters.lent = self.lent.len() as u64;
        let kept = self.map.as_mut()?.take(key)?;
        self.counters.taken += 1;
        Some(kept)
    }

    /// The engine refused what the kernel kept of `key`: it is never lent again. The line to log.
    pub fn refused(&mut self, key: &Key, kept: &FastKept) -> String {
        self.counters.absorb_refused += 1;
        self.distrust.insert(*key);
        format!("agent: fast path: the kernel's state of {} refused by the engine ({kept:?}): the connection is unprotected from now on and stays on the slow path", key.client)
    }

    /// Whether any connection waits to be published ([`FastPart::publish_all`]).
    pub fn dirty(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// Every lent connection (before an engine call that may act on any of them).
    pub fn lent(&self) -> Vec<Key> {
        self.lent.iter().copied().collect()
    }

    /// Marks the connections with an entry for which `gone` holds (the engine no longer
    /// tracks them) to be published, that is removed.
    pub fn sweep(&mut self, gone: impl Fn(&Key) -> bool) {
        for k in &self.entries {
            if gone(k) {
                self.dirty.insert(*k);
            }
        }
    }

    /// After the round's verdicts left: every connection the engine acted on is published
    /// again (`state(key)` says how), created when it may be lent, removed when the engine
    /// forgot it. Returns lines to log.
    pub fn publish_all(&mut self, now: u64, mut state: impl FnMut(&Key) -> Publish) -> Vec<String> {
        let mut logs = Vec::new();
        let Some(map) = self.map.as_mut() else {
            self.dirty.clear();
            return logs;
        };
        for k in self.dirty.drain() {
            let p = state(&k);
            // A closed connection is never carried again: its entry goes now, not when the
            // engine forgets it after its linger (a burst of removals then, one system call
            // each, stalled the loop for milliseconds after a wave of short connections).
            let Some(view) = p.view.filter(|v| !v.closed) else {
                if self.entries.remove(&k) {
                    map.remove(&k);
                    self.counters.removed += 1;
                }
                self.lent.remove(&k);
                self.distrust.remove(&k);
                continue;
            };
            let lend = !p.held_by_core && !self.distrust.contains(&k);
            let fast = lend && (unbroken_drivers::fastpath::object::quiet(&view) || unbroken_drivers::fastpath::object::passthrough(&view));
            if !fast {
                // Nothing to publish: an entry that may not pass anything is as good taken (or
                // published without fast flags before) as published again, and the kernel
                // writes nothing into it. (Most of a small request's packets end here: a
                // publication per packet cost the agent's loop about a tenth of its requests.)
                continue;
            }
            let exists = self.entries.contains(&k);
            // An entry is created only where the kernel has something to carry: a response
            // body not sent yet, or an unprotected connection passed through. A small
            // response went out whole with its header (held until stored), and its client's
            // ACK of its end must come to the engine anyway: an entry would cost two system
            // calls (created, removed) for nothing.
            let worth = view.body_left >= WORTH_BODY || unbroken_drivers::fastpath::object::passthrough(&view);
            if !exists && (!worth || now < self.create_after) {
                continue;
            }
            match map.publish(&k, &view, p.bucket, lend) {
                Ok(lent) => {
                    if exists {
                        self.counters.published += 1;
                    } else {
                        self.entries.insert(k);
                        self.counters.created += 1;
                    }
                    if lent {
                        self.lent.insert(k);
                    } else {
                        self.lent.remove(&k);
                    }
                }
                Err(why) => {
                    self.counters.map_refused += 1;
                    self.lent.remove(&k);
                    if exists {
                        // Not published: every packet of it must go slow from now on.
                        self.entries.remove(&k);
                        map.remove(&k);
                    } else {
                        self.create_after = now + CREATE_BACKOFF_MS;
                    }
                    logs.push(format!("agent: fast path: entry of {} refused ({why}): the connection stays on the slow path", k.client));
                }
            }
        }
        self.counters.lent = self.lent.len() as u64;
        logs
    }
}
