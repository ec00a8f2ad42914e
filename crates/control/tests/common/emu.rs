//! The emulated map of the replica fast-path hand-off tests (`replica_fast.rs`, the backup's;
//! `replica_fast_primary.rs`, the primary's): what `rep_op` and `rep_p_op`
//! (`bpf/replica/rep_tc.c`) do to an entry, one emulation for both roles' fields. A program's
//! claim is the test's edit of an entry ([`Entries::claim`]); a declined packet freezes its
//! entry and is counted ([`Entries::decline`]); a thaw is refused while a counted packet has
//! not been taken.
#![allow(dead_code)] // each test binary uses a different subset

use std::collections::HashMap;

use unbroken_control::replica::core::{Fields, MapDone, MapOp, Taken};
use unbroken_engines::replica::{BFast, ConnKey, PFast};

/// A role's fields in the core's hand-off.
pub trait Role: Copy {
    fn wrap(self) -> Fields;
    fn of(f: Fields) -> Option<Self>;
}

impl Role for BFast {
    fn wrap(self) -> Fields {
        Fields::Backup(self)
    }
    fn of(f: Fields) -> Option<Self> {
        f.backup()
    }
}

impl Role for PFast {
    fn wrap(self) -> Fields {
        Fields::Primary(self)
    }
    fn of(f: Fields) -> Option<Self> {
        f.primary()
    }
}

#[derive(Debug, Clone, Copy)]
pub struct E<F> {
    pub frozen: bool,
    pub user: bool,
    /// The backup's `CHANGED` (cleared by a collect or a thaw).
    pub changed: bool,
    pub slow: u32,
    pub seen: u32,
    pub f: F,
}

/// The entries and what the core asked of them, in order (`"take 40001"`, `"thaw 40001"`...).
pub struct Entries<F> {
    pub entries: HashMap<ConnKey, E<F>>,
    pub ops: Vec<String>,
}

impl<F> Default for Entries<F> {
    fn default() -> Self {
        Entries { entries: HashMap::new(), ops: vec![] }
    }
}

impl<F: Role> Entries<F> {
    /// A program declines a packet of `k`: frozen and counted if it has an entry (whether it
    /// had one).
    pub fn decline(&mut self, k: &ConnKey) -> bool {
        match self.entries.get_mut(k) {
            Some(e) => {
                e.frozen = true;
                e.slow += 1;
                true
            }
            None => false,
        }
    }

    /// A program claims a packet of `k` and learns from it.
    pub fn claim(&mut self, k: &ConnKey, learn: impl FnOnce(&mut F)) {
        let e = self.entries.get_mut(k).expect("an entry");
        assert!(!e.frozen, "a frozen entry is never claimed");
        learn(&mut e.f);
    }

    pub fn take(&mut self, key: &ConnKey, counted: bool) -> Option<Taken> {
        self.ops.push(format!("{} {}", if counted { "take" } else { "freeze" }, key.client_port));
        let e = self.entries.get_mut(key)?;
        if counted {
            e.seen += 1;
        }
        let newest = !e.user;
        e.frozen = true;
        e.user = true;
        Some(Taken { newest, fields: e.f.wrap() })
    }

    pub fn apply(&mut self, op: &MapOp) -> MapDone {
        match *op {
            MapOp::Install(k, f) => {
                let f = F::of(f).expect("this role's fields");
                self.ops.push(format!("install {}", k.client_port));
                if self.entries.remove(&k).is_some() {
                    return MapDone::Gone;
                }
                self.entries.insert(k, E { frozen: false, user: false, changed: false, slow: 0, seen: 0, f });
                MapDone::Kernel
            }
            MapOp::Thaw(k, f) | MapOp::ThawForce(k, f) => {
                let force = matches!(op, MapOp::ThawForce(..));
                self.ops.push(format!("{} {}", if force { "thaw_force" } else { "thaw" }, k.client_port));
                let Some(e) = self.entries.get_mut(&k) else { return MapDone::Gone };
                if !force && e.seen != e.slow {
                    return MapDone::Held;
                }
                e.seen = e.slow;
                (e.frozen, e.user, e.changed) = (false, false, false);
                e.f = F::of(f).expect("this role's fields");
                MapDone::Kernel
            }
            MapOp::Remove(k) => {
                self.ops.push(format!("remove {}", k.client_port));
                self.entries.remove(&k);
                MapDone::Gone
            }
        }
    }

    pub fn collect(&mut self, key: &ConnKey) -> Option<Fields> {
        self.ops.push(format!("collect {}", key.client_port));
        let e = self.entries.get_mut(key)?;
        e.changed = false;
        Some(e.f.wrap())
    }
}
