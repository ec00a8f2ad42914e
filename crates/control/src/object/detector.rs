//! The load balancer's failure detector and bucket ownership, with leases: no I/O, no clock.
//!
//! [`crate::object::lb`]'s monitor thread feeds it heartbeats and clock ticks (milliseconds of a
//! monotonic clock) and asks it for replies; its table programmer asks it which owners the
//! kernel table should hold ([`Detector::want`]) and reports what it installed
//! ([`Detector::applied`]). The deterministic tests drive it the same way, with faults.
//!
//! # Liveness
//!
//! A server that stays silent for `dead_after_ms` is declared dead. A dead server that beats
//! again is declared alive only after it has beaten without a silence of `dead_after_ms` for
//! the *revive hold* (`revive_hold_ms`, doubled for every further death within the last ten
//! minutes, at most [`MAX_HOLD_MS`]): a server that flaps (a wedged host, a lossy link) stops
//! pulling its buckets back and forth.
//!
//! # Leases (fencing)
//!
//! Every reply grants its server a lease on the buckets it lists as owned, for `lease_ms`
//! measured from when the server *sent* the heartbeat the reply answers (the agent times it
//! with its own clock: see [`crate::object::lb::HeartbeatClient`]). An agent sends on a connection only
//! while it holds a lease on the connection's bucket. The detector never lets the kernel table
//! give a bucket to a new owner before the old owner's last lease on it has run out:
//!
//! * a bucket about to move is no longer listed in the old owner's replies (nor in the new
//!   owner's until the kernel has it), and
//! * the move waits until `last reply to the old owner + lease_ms + LEASE_MARGIN_MS`.
//!
//! A heartbeat is sent before it is received and answered, so that bound is never earlier than
//! the end of the old owner's lease. When the old owner was declared dead its silence already
//! exceeded `dead_after_ms`, which the configuration keeps above `lease_ms + LEASE_MARGIN_MS`,
//! so failover after a death waits for nothing; a bucket handed back to a server that
//! returned waits one lease. So a falsely suspected server never sends alongside its
//! successor.

/// Added to every lease before a bucket may move (clock-rate differences between hosts,
/// rounding to milliseconds).
pub const LEASE_MARGIN_MS: u64 = 2;
/// The longest revive hold, however often a server flapped.
pub const MAX_HOLD_MS: u64 = 60_000;
/// Deaths within this window double the revive hold.
pub const FLAP_WINDOW_MS: u64 = 600_000;
/// Lower edges of the heartbeat-gap histogram, milliseconds (the last bin is open).
pub const GAP_EDGES_MS: [u64; 16] = [0, 5, 10, 15, 20, 25, 30, 40, 50, 75, 100, 150, 200, 300, 500, 1000];

/// What the detector needs to know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DetectorConfig {
    pub servers: usize,
    pub buckets: u16,
    pub dead_after_ms: u64,
    pub lease_ms: u64,
    pub revive_hold_ms: u64,
    pub startup_grace_ms: u64,
    pub failover_window_ms: u64,
}

impl DetectorConfig {
    /// Checks the relations the fencing argument needs.
    pub fn validate(&self) -> Result<(), String> {
        if self.servers == 0 || self.servers > self.buckets as usize {
            return Err(format!("{} servers for {} buckets (every server needs a home bucket)", self.servers, self.buckets));
        }
        if self.lease_ms == 0 {
            return Err("lease_ms must be at least 1".into());
        }
        if self.lease_ms.saturating_add(LEASE_MARGIN_MS) >= self.dead_after_ms {
            return Err(format!(
                "lease_ms ({}) + {LEASE_MARGIN_MS} ms must stay below dead_after_ms ({}): a dead server's lease must have run out when it is declared dead",
                self.lease_ms, self.dead_after_ms
            ));
        }
        if self.revive_hold_ms > MAX_HOLD_MS {
            return Err(format!("revive_hold_ms ({}) is above {MAX_HOLD_MS}", self.revive_hold_ms));
        }
        Ok(())
    }
}

/// A liveness change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Liveness {
    /// Server index (config order).
    pub server: usize,
    pub alive: bool,
    /// Down: the silence that killed it. Up: how long it was dead (its silence plus the hold).
    pub silence_ms: u64,
    /// Buckets whose desired owner changed.
    pub retargeted: usize,
    /// The `want` epoch after the change.
    pub epoch: u32,
}

/// What a reply carries (besides the echoed seq).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// Epoch of the kernel table.
    pub epoch: u32,
    /// Owned buckets, wire layout (bit `b % 8` of byte `b / 8`).
    pub owned: Vec<u8>,
    /// Owned buckets whose owner changed within the failover window.
    pub allowed: Vec<u8>,
    /// The lease, milliseconds from the heartbeat's sending.
    pub lease_ms: u64,
}

#[derive(Debug, Clone)]
struct Srv {
    alive: bool,
    heard: bool,
    /// Last valid heartbeat; before the first one, the start plus the grace.
    last_ms: u64,
    /// When its last reply was made (the basis of its lease).
    last_reply_ms: u64,
    /// Dead but beating again since then (without a silence of dead_after).
    returning_since: Option<u64>,
    downs: Vec<u64>,
    beats: u64,
    last_seq: Option<u32>,
    max_gap_ms: u64,
    gaps: [u64; GAP_EDGES_MS.len()],
}

/// Per-server figures for status pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerView {
    pub alive: bool,
    pub heard: bool,
    pub last_ms: u64,
    pub last_seq: Option<u32>,
    pub beats: u64,
    /// Dead, beating again, waiting out the revive hold (ms left).
    pub returning_hold_left_ms: Option<u64>,
    pub max_gap_ms: u64,
    /// Counts per [`GAP_EDGES_MS`] bin.
    pub gaps: Vec<u64>,
    pub recent_downs: usize,
}

/// The detector.
#[derive(Debug, Clone)]
pub struct Detector {
    cfg: DetectorConfig,
    srv: Vec<Srv>,
    /// Desired owner per bucket (server index), from liveness alone.
    target: Vec<u16>,
    /// Earliest time the kernel may give bucket b to `target[b]` (when it differs from `applied`).
    move_after: Vec<u64>,
    /// What the kernel should hold now, and its epoch.
    want: Vec<u16>,
    want_epoch: u32,
    /// What the kernel holds.
    applied: Vec<u16>,
    applied_epoch: u32,
    /// A want the programmer is installing (taken by [`Detector::take_want`]).
    inflight: Option<Vec<u16>>,
    common_mode_stalls: u64,
    changed_at: Vec<Option<u64>>,
}

fn set_bit(bytes: &mut [u8], b: usize) {
    bytes[b / 8] |= 1 << (b % 8);
}

/// Recomputes desired owners for the liveness vector `alive` (see [`crate::object::lb`]'s docs:
/// home when the home server lives; otherwise the current owner if it lives; otherwise
/// round-robin over the live servers; unchanged when none lives). Returns the changed buckets.
pub fn reassign(owners: &mut [u16], alive: &[bool]) -> Vec<u16> {
    let n = alive.len();
    let live: Vec<u16> = (0..n as u16).filter(|&i| alive[i as usize]).collect();
    let mut rr = 0usize;
    let mut changed = Vec::new();
    for (b, o) in owners.iter_mut().enumerate() {
        let home = (b % n) as u16;
        let new = if alive[home as usize] {
            home
        } else if alive[*o as usize] || live.is_empty() {
            *o
        } else {
            let s = live[rr % live.len()];
            rr += 1;
            s
        };
        if new != *o {
            *o = new;
            changed.push(b as u16);
        }
    }
    changed
}

impl Detector {
    /// A detector over the table `applied` (every bucket at home for a fresh table, or the
    /// owners read back from the kernel when a restarted balancer adopts its table). A server
    /// that owns its home bucket 0..n in `applied` starts alive (silent servers die after the
    /// startup grace); one that does not was dead for the previous balancer and comes back
    /// through the revive hold. Every server is assumed to hold a lease on what it owns until
    /// `now + lease`: a previous balancer may have granted one just now.
    pub fn new(cfg: DetectorConfig, applied: Vec<u16>, now: u64) -> Result<Detector, String> {
        cfg.validate()?;
        let n = cfg.servers;
        if applied.len() != cfg.buckets as usize || applied.iter().any(|&o| o as usize >= n) {
            return Err("the adopted table does not match the configured buckets and servers".into());
        }
        let srv = (0..n)
            .map(|i| {
                let alive = applied[i] as usize == i;
                Srv {
                    alive,
                    heard: false,
                    last_ms: if alive { now + cfg.startup_grace_ms } else { now },
                    last_reply_ms: now,
                    returning_since: None,
                    downs: Vec::new(),
                    beats: 0,
                    last_seq: None,
                    max_gap_ms: 0,
                    gaps: [0; GAP_EDGES_MS.len()],
                }
            })
            .collect::<Vec<_>>();
        let mut target = applied.clone();
        let alive: Vec<bool> = srv.iter().map(|s| s.alive).collect();
        let mut d = Detector {
            move_after: vec![0; applied.len()],
            want: applied.clone(),
            want_epoch: 1,
            applied_epoch: 1,
            inflight: None,
            common_mode_stalls: 0,
            changed_at: vec![None; applied.len()],
            applied,
            target: Vec::new(),
            srv,
            cfg,
        };
        // Buckets stranded on servers that start dead move to live ones (after the leases a
        // previous balancer may have granted).
        let moved = reassign(&mut target, &alive);
        d.target = target;
        for b in moved {
            d.move_after[b as usize] = now + d.cfg.lease_ms + LEASE_MARGIN_MS;
        }
        d.recompute_want(now);
        Ok(d)
    }

    pub fn config(&self) -> &DetectorConfig {
        &self.cfg
    }

    /// The revive hold of server `i` at `now`.
    pub fn hold_ms(&self, i: usize, now: u64) -> u64 {
        let k = self.srv[i].downs.iter().filter(|&&t| now.saturating_sub(t) < FLAP_WINDOW_MS).count();
        let doublings = k.saturating_sub(1).min(16) as u32;
        self.cfg.revive_hold_ms.saturating_mul(1u64 << doublings).min(MAX_HOLD_MS)
    }

    /// A valid heartbeat of server `i` at `now`. Returns the liveness change it causes.
    pub fn heartbeat(&mut self, i: usize, seq: u32, now: u64) -> Option<Liveness> {
        let dead_after = self.cfg.dead_after_ms;
        let s = &mut self.srv[i];
        let silence = now.saturating_sub(s.last_ms);
        if s.heard {
            s.max_gap_ms = s.max_gap_ms.max(silence);
            let k = GAP_EDGES_MS.iter().rposition(|&e| silence >= e).unwrap_or(0);
            s.gaps[k] += 1;
        }
        s.heard = true;
        s.last_ms = now;
        s.last_seq = Some(seq);
        s.beats += 1;
        if s.alive {
            return None;
        }
        let since = match s.returning_since {
            Some(t) if silence < dead_after => t,
            _ => now,
        };
        s.returning_since = Some(since);
        if since == now {
            // Beating again: its replies list the buckets it kept (nobody could take them)
            // from now on, during the revive hold too, and its connections there died with it.
            self.kept_buckets_allowed(i, now);
        }
        let s = &self.srv[i];
        let dead_for = s.downs.last().map_or(silence, |&t| now.saturating_sub(t));
        // The hold keeps a flapping server from taking connections back and forth while
        // others serve them; with no other server alive it would only leave every bucket
        // without an owner, so the returning server is taken at once.
        let others_alive = self.srv.iter().enumerate().any(|(j, o)| j != i && o.alive);
        if others_alive && now.saturating_sub(since) < self.hold_ms(i, now) {
            return None;
        }
        Some(self.set_alive(i, true, dead_for, now))
    }

    /// Deadlines at `now`: servers silent for `dead_after_ms` die, pending moves whose leases
    /// ran out become due. Returns the liveness changes.
    pub fn tick(&mut self, now: u64) -> Vec<Liveness> {
        let dead_after = self.cfg.dead_after_ms;
        for s in self.srv.iter_mut() {
            if !s.alive && s.returning_since.is_some() && now >= s.last_ms.saturating_add(dead_after) {
                s.returning_since = None;
            }
        }
        let alive: Vec<usize> = (0..self.srv.len()).filter(|&i| self.srv[i].alive).collect();
        let overdue: Vec<usize> = alive.iter().copied().filter(|&i| now >= self.srv[i].last_ms.saturating_add(dead_after)).collect();
        let mut out = Vec::new();
        // Common mode: when every live server is overdue at once, the silence is most likely
        // this balancer's own (its host stalled, its heartbeat network, its socket), and if it
        // is not, no server is left to take over anyway. Nobody is declared dead; the agents'
        // leases run out meanwhile, so nobody sends unfenced either. Unless a returning
        // server is heard meanwhile: then the balancer hears fine, and that server takes over.
        let returning_heard = self.srv.iter().any(|s| !s.alive && s.returning_since.is_some() && now < s.last_ms.saturating_add(dead_after));
        if !overdue.is_empty() && overdue.len() == alive.len() && alive.len() > 1 && !returning_heard {
            self.common_mode_stalls += 1;
        } else if !overdue.is_empty() {
            // Decide the deaths of one tick together, so that no bucket moves to a server
            // that dies in the same instant.
            for &i in &overdue {
                let silence = now.saturating_sub(self.srv[i].last_ms);
                self.srv[i].alive = false;
                out.push((i, silence));
            }
            let out: Vec<Liveness> = out.into_iter().map(|(i, silence)| self.set_alive(i, false, silence, now)).collect();
            self.recompute_want(now);
            return out;
        }
        self.recompute_want(now);
        Vec::new()
    }

    /// Ticks at which every live server was overdue at once and nobody was declared dead.
    pub fn common_mode_stalls(&self) -> u64 {
        self.common_mode_stalls
    }

    fn set_alive(&mut self, i: usize, alive: bool, silence_ms: u64, now: u64) -> Liveness {
        let s = &mut self.srv[i];
        s.alive = alive;
        s.returning_since = None;
        if !alive {
            s.downs.retain(|&t| now.saturating_sub(t) < FLAP_WINDOW_MS);
            s.downs.push(now);
        } else {
            self.kept_buckets_allowed(i, now);
        }
        let alive_v: Vec<bool> = self.srv.iter().map(|s| s.alive).collect();
        let before = self.target.clone();
        let moved = reassign(&mut self.target, &alive_v);
        for &b in &moved {
            let b = b as usize;
            let applied_owner = self.applied[b] as usize;
            if before[b] == self.applied[b] {
                // Listed to its owner until now: the move waits for that owner's lease.
                self.move_after[b] = self.srv[applied_owner].last_reply_ms + self.cfg.lease_ms + LEASE_MARGIN_MS;
            }
        }
        self.recompute_want(now);
        Liveness { server: i, alive, silence_ms, retargeted: moved.len(), epoch: self.want_epoch }
    }

    /// Buckets a dead server still holds in the kernel table (nobody could take them: every
    /// other server was dead too) come back with it. Their connections died with it and are
    /// unknown to it now: they may fail over there, like those of a bucket that moved (without
    /// this the gate denies them and the kernel resets them).
    fn kept_buckets_allowed(&mut self, i: usize, now: u64) {
        for b in 0..self.applied.len() {
            if self.applied[b] as usize == i {
                self.changed_at[b] = Some(now);
            }
        }
    }

    fn recompute_want(&mut self, now: u64) {
        let mut changed = false;
        for b in 0..self.want.len() {
            let w = if self.target[b] != self.applied[b] && now >= self.move_after[b] { self.target[b] } else { self.applied[b] };
            if w != self.want[b] {
                self.want[b] = w;
                changed = true;
            }
        }
        if changed {
            self.want_epoch = self.want_epoch.wrapping_add(1);
        }
    }

    /// The reply to server `i`'s heartbeat at `now`; it starts a lease.
    pub fn grant(&mut self, i: usize, now: u64) -> Grant {
        let bl = (self.cfg.buckets as usize).div_ceil(8);
        let (mut owned, mut allowed) = (vec![0u8; bl], vec![0u8; bl]);
        for b in 0..self.applied.len() {
            let stays = self.inflight.as_ref().is_none_or(|f| f[b] as usize == i);
            if self.applied[b] as usize == i && self.target[b] as usize == i && stays {
                set_bit(&mut owned, b);
                if self.changed_at[b].is_some_and(|t| now.saturating_sub(t) < self.cfg.failover_window_ms) {
                    set_bit(&mut allowed, b);
                }
            }
        }
        self.srv[i].last_reply_ms = self.srv[i].last_reply_ms.max(now);
        Grant { epoch: self.applied_epoch, owned, allowed, lease_ms: self.cfg.lease_ms }
    }

    /// What the kernel table should hold, and its epoch.
    pub fn want(&self) -> (u32, &[u16]) {
        (self.want_epoch, &self.want)
    }

    /// The programmer takes the want to install it: from now until [`Detector::applied`] or
    /// [`Detector::apply_failed`], no reply lists a bucket the installation moves. None when
    /// the kernel already holds the want or an installation is under way.
    pub fn take_want(&mut self) -> Option<(u32, Vec<u16>)> {
        if self.inflight.is_some() || self.want_epoch == self.applied_epoch {
            return None;
        }
        self.inflight = Some(self.want.clone());
        Some((self.want_epoch, self.want.clone()))
    }

    /// The installation taken by [`Detector::take_want`] failed: the kernel table is unchanged
    /// (one `nft` transaction).
    pub fn apply_failed(&mut self) {
        self.inflight = None;
    }

    /// The kernel now holds `owners` (epoch `epoch`), installed at `now`.
    pub fn applied(&mut self, epoch: u32, owners: &[u16], now: u64) {
        self.inflight = None;
        for (b, &o) in owners.iter().enumerate() {
            if o != self.applied[b] {
                self.changed_at[b] = Some(now);
            }
        }
        self.applied.copy_from_slice(owners);
        self.applied_epoch = epoch;
        self.recompute_want(now);
    }

    /// No move is pending: the kernel holds every desired owner.
    pub fn settled(&self) -> bool {
        self.inflight.is_none() && self.target == self.applied
    }

    /// The kernel table as far as the detector knows, and its epoch.
    pub fn applied_table(&self) -> (u32, &[u16]) {
        (self.applied_epoch, &self.applied)
    }

    /// When each bucket's owner last changed in the kernel.
    /// Continues an adopted table's history: its epoch (the next change gets `epoch + 1`) and
    /// per bucket the time of its last owner change (None: never; entries beyond the table
    /// are ignored).
    pub fn adopt_history(&mut self, epoch: u32, changed_at: Vec<Option<u64>>) {
        let epoch = epoch.max(1);
        let bump = self.want_epoch != self.applied_epoch;
        self.applied_epoch = epoch;
        self.want_epoch = if bump { epoch.wrapping_add(1) } else { epoch };
        for (c, t) in self.changed_at.iter_mut().zip(changed_at) {
            *c = t;
        }
    }

    pub fn changed_at(&self) -> &[Option<u64>] {
        &self.changed_at
    }

    /// The next time [`Detector::tick`] has something to do.
    pub fn next_deadline(&self, now: u64) -> u64 {
        let mut next = u64::MAX;
        for s in &self.srv {
            let due = s.last_ms.saturating_add(self.cfg.dead_after_ms);
            // An overdue server (common mode: nobody declared dead) is looked at again when
            // a heartbeat arrives; its past deadline must not make the caller spin.
            if (s.alive || s.returning_since.is_some()) && due > now {
                next = next.min(due);
            }
        }
        for b in 0..self.target.len() {
            if self.target[b] != self.applied[b] && self.want[b] == self.applied[b] && self.move_after[b] > now {
                next = next.min(self.move_after[b]);
            }
        }
        next
    }

    pub fn alive(&self, i: usize) -> bool {
        self.srv[i].alive
    }

    /// Figures of server `i` at `now`.
    pub fn server(&self, i: usize, now: u64) -> ServerView {
        let s = &self.srv[i];
        ServerView {
            alive: s.alive,
            heard: s.heard,
            last_ms: s.last_ms,
            last_seq: s.last_seq,
            beats: s.beats,
            returning_hold_left_ms: s.returning_since.map(|t| (t + self.hold_ms(i, now)).saturating_sub(now)),
            max_gap_ms: s.max_gap_ms,
            gaps: s.gaps.to_vec(),
            recent_downs: s.downs.iter().filter(|&&t| now.saturating_sub(t) < FLAP_WINDOW_MS).count(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> DetectorConfig {
        DetectorConfig { servers: 3, buckets: 12, dead_after_ms: 100, lease_ms: 60, revive_hold_ms: 500, startup_grace_ms: 1000, failover_window_ms: 60_000 }
    }

    fn home(c: &DetectorConfig) -> Vec<u16> {
        (0..c.buckets as usize).map(|b| (b % c.servers) as u16).collect()
    }

    fn owned(g: &Grant) -> Vec<u16> {
        (0..g.owned.len() * 8).filter(|&b| g.owned[b / 8] & (1 << (b % 8)) != 0).map(|b| b as u16).collect()
    }

    /// Beats every server every 5 ms from `from` to `to` (except `skip`), ticking as it goes;
    /// the programmer applies every want at once.
    fn run(d: &mut Detector, from: u64, to: u64, skip: &[usize]) -> Vec<Liveness> {
        let mut ev = Vec::new();
        let mut t = from;
        while t < to {
            for i in 0..d.cfg.servers {
                if !skip.contains(&i) {
                    ev.extend(d.heartbeat(i, t as u32, t));
                    d.grant(i, t);
                }
            }
            ev.extend(d.tick(t));
            if let Some((e, w)) = d.take_want() {
                d.applied(e, &w, t);
            }
            t += 5;
        }
        ev
    }

    #[test]
    fn config_keeps_the_lease_below_the_death_threshold() {
        let mut c = cfg();
        c.lease_ms = 99;
        assert!(c.validate().unwrap_err().contains("lease_ms"));
        c.lease_ms = 0;
        assert!(c.validate().is_err());
        c.lease_ms = 60;
        assert!(c.validate().is_ok());
        assert!(Detector::new(c.clone(), vec![0; 3], 0).is_err(), "wrong table length");
    }

    #[test]
    fn steady_beats_never_kill() {
        let c = cfg();
        let mut d = Detector::new(c.clone(), home(&c), 0).unwrap();
        let ev = run(&mut d, 0, 10_000, &[]);
        assert!(ev.is_empty(), "{ev:?}");
        let v = d.server(0, 10_000);
        assert_eq!(v.max_gap_ms, 5);
        assert_eq!(v.gaps[1], v.beats - 1, "every gap in the 5 ms bin");
    }

    #[test]
    fn a_silent_server_dies_after_dead_after_and_its_buckets_move_at_once() {
        let c = cfg();
        let mut d = Detector::new(c.clone(), home(&c), 0).unwrap();
        run(&mut d, 0, 2000, &[]);
        // Server 1 falls silent at 2000 (its last beat at 1995).
        let ev = run(&mut d, 2000, 2090, &[1]);
        assert!(ev.is_empty(), "not dead before 100 ms of silence: {ev:?}");
        let ev = run(&mut d, 2090, 2100, &[1]);
        assert_eq!(ev.len(), 1);
        assert!(!ev[0].alive && ev[0].server == 1 && ev[0].silence_ms >= 100);
        assert_eq!(ev[0].retargeted, 4);
        // Its lease ran out before it was declared dead: the kernel has the move at once.
        let (_, table) = d.applied_table();
        assert!(table.iter().all(|&o| o != 1), "{table:?}");
        let g = d.grant(1, 2100);
        assert!(owned(&g).is_empty(), "a dead server owns nothing");
    }

    #[test]
    fn a_returning_server_waits_out_the_hold_and_then_gets_its_buckets_after_the_stand_ins_lease() {
        let c = cfg();
        let mut d = Detector::new(c.clone(), home(&c), 0).unwrap();
        run(&mut d, 0, 2000, &[]);
        run(&mut d, 2000, 2200, &[1]);
        assert!(!d.alive(1));
        // It beats again from 3000: not alive before the hold (500 ms).
        let ev = run(&mut d, 3000, 3500, &[]);
        assert!(ev.is_empty(), "{ev:?}");
        assert!(d.server(1, 3495).returning_hold_left_ms.is_some());
        // Step by hand now (the last replies were at 3495): beat 1 at 3500 ends the hold.
        let up = d.heartbeat(1, 0, 3500).expect("alive after the hold");
        assert!(up.alive && up.retargeted == 4);
        // Bucket 1 (home 1) is with a stand-in whose last reply was at 3495: it is listed to
        // nobody, and the kernel keeps it there until 3495 + 60 + 2.
        let b1_owner = d.applied_table().1[1] as usize;
        assert_ne!(b1_owner, 1);
        assert!(!owned(&d.grant(b1_owner, 3500)).contains(&1), "revoked from the stand-in");
        assert!(!owned(&d.grant(1, 3500)).contains(&1), "not granted before the kernel has it");
        d.tick(3556);
        assert_eq!(d.want().1[1] as usize, b1_owner, "waits for the stand-in's lease (last listed at 3495)");
        assert_eq!(d.next_deadline(3556), 3557);
        d.tick(3557);
        assert_eq!(d.want().1[1], 1, "moves once the lease ran out");
        let (e, w) = d.take_want().unwrap();
        assert!(d.take_want().is_none(), "one installation at a time");
        assert!(!owned(&d.grant(1, 3560)).contains(&1), "not listed while the kernel change is under way");
        d.applied(e, &w, 3575);
        let g = d.grant(1, 3576);
        assert!(owned(&g).contains(&1));
        assert!(g.allowed[0] & 0b10 != 0, "a recently moved bucket is allowed");
    }

    #[test]
    fn when_every_server_falls_silent_at_once_nobody_is_declared_dead() {
        let c = cfg();
        let mut d = Detector::new(c.clone(), home(&c), 0).unwrap();
        run(&mut d, 0, 2000, &[]);
        // The balancer's host stalls for 300 ms: every server overdue together.
        let ev = d.tick(2300);
        assert!(ev.is_empty(), "{ev:?}");
        assert_eq!(d.common_mode_stalls(), 1);
        assert!(d.next_deadline(2300) > 2300, "an overdue server must not make the monitor spin");
        assert!(run(&mut d, 2300, 3000, &[]).is_empty());
        // Two of three silent at once (one still heard): both die, and their buckets all go
        // to the survivor, none to each other.
        let ev = run(&mut d, 3000, 3200, &[0, 1]);
        assert_eq!(ev.len(), 2, "{ev:?}");
        assert!(d.applied_table().1.iter().all(|&o| o == 2));
    }

    #[test]
    fn the_only_server_beating_is_taken_without_its_revive_hold() {
        // Server 2 flaps four times (its hold grows to 8 s), then returns while 0 and 1 serve;
        // 0 and 1 fall silent and die during its hold: it is taken at once instead of
        // leaving every bucket without an owner.
        let c = cfg();
        let mut d = Detector::new(c.clone(), home(&c), 0).unwrap();
        run(&mut d, 0, 1000, &[]);
        let mut t = 1000;
        for _ in 0..4 {
            run(&mut d, t, t + 200, &[2]);
            t += 200;
            while !d.alive(2) {
                run(&mut d, t, t + 5, &[]);
                t += 5;
            }
        }
        run(&mut d, t, t + 200, &[2]);
        t += 200;
        assert!(!d.alive(2));
        run(&mut d, t, t + 50, &[]);
        t += 50;
        assert!(d.server(2, t).returning_hold_left_ms.is_some_and(|h| h > 2000), "{:?}", d.server(2, t));
        let start = t;
        while !d.alive(2) && t < start + 2000 {
            run(&mut d, t, t + 5, &[0, 1]);
            t += 5;
        }
        assert!(d.alive(2) && !d.alive(0) && !d.alive(1), "server 2 alive at {t}: {}", d.alive(2));
        assert!(t <= start + c.dead_after_ms + 20, "taken {} ms after the others fell silent", t - start);
    }

    #[test]
    fn a_flapping_server_waits_longer_each_time() {
        let c = cfg();
        let mut d = Detector::new(c.clone(), home(&c), 0).unwrap();
        run(&mut d, 0, 1000, &[]);
        let mut t = 1000;
        let mut holds = Vec::new();
        for _ in 0..4 {
            run(&mut d, t, t + 200, &[2]);
            assert!(!d.alive(2));
            t += 200;
            let start = t;
            while !d.alive(2) {
                run(&mut d, t, t + 5, &[]);
                t += 5;
            }
            holds.push(t - start);
        }
        assert!(holds[0] >= 500 && holds[0] < 520, "{holds:?}");
        assert!(holds[1] >= 1000 && holds[2] >= 2000 && holds[3] >= 4000, "{holds:?}");
    }

    /// The last live server dies while another is already dead; it returns to the buckets
    /// it kept: allowed from its first beat (object sim seeds 166 and 9085).
    #[test]
    fn the_last_server_to_die_returns_to_its_kept_buckets_allowed() {
        let c = DetectorConfig { servers: 2, buckets: 4, ..cfg() };
        let mut d = Detector::new(c.clone(), home(&c), 0).unwrap();
        run(&mut d, 0, 2000, &[]);
        run(&mut d, 2000, 2200, &[1]);
        assert!(!d.alive(1) && d.applied_table().1.iter().all(|&o| o == 0));
        // Server 0 falls silent too: the only live server, so it is declared dead.
        let ev = run(&mut d, 2200, 2400, &[0, 1]);
        assert!(ev.iter().any(|e| e.server == 0 && !e.alive), "{ev:?}");
        assert!(d.applied_table().1.iter().all(|&o| o == 0), "nobody to move them to");
        // Its first beat: with no other server alive there is no revive hold (it would only
        // leave every bucket without a live owner); the buckets it kept are listed and
        // allowed at once.
        let up = d.heartbeat(0, 1, 2400).expect("alive at once: nobody else is");
        assert!(up.alive);
        let g = d.grant(0, 2400);
        assert_eq!(owned(&g), vec![0, 1, 2, 3]);
        assert_eq!(g.allowed, g.owned, "its connections died with it: they may fail over");
        run(&mut d, 2405, 3000, &[1]);
        assert!(d.alive(0));
        let g = d.grant(0, 3000);
        assert_eq!(owned(&g), vec![0, 1, 2, 3]);
        assert_eq!(g.allowed, g.owned, "its connections died with it: they may fail over");
    }

    #[test]
    fn an_adopted_table_keeps_dead_servers_dead_and_live_ones_leased() {
        let c = cfg();
        // The previous balancer had server 2 dead: its home buckets on 0 and 1.
        let mut t = home(&c);
        for b in (2..12).step_by(3) {
            t[b] = (b % 2) as u16;
        }
        let mut d = Detector::new(c.clone(), t.clone(), 50).unwrap();
        assert!(d.alive(0) && d.alive(1) && !d.alive(2));
        assert_eq!(d.want().1, &t[..], "nothing moves at adoption");
        // Server 2 beats: back after the hold, its buckets after the leases.
        let ev = run(&mut d, 50, 700, &[]);
        assert!(ev.iter().any(|e| e.server == 2 && e.alive));
        assert_eq!(d.applied_table().1, &home(&c)[..]);
    }

    /// A seeded simulation: three agents beat every 5 ms over a lossy, delaying, reordering
    /// network to the detector; each agent holds a lease per bucket from the send time of the
    /// heartbeat a reply answers; the programmer applies the detector's wants after a delay.
    /// At every millisecond no bucket may be leased to two servers.
    #[test]
    fn never_two_lease_holders_under_loss_delay_and_stalls() {
        let (mut downs, mut ups) = (0, 0);
        for seed in 1..=300u64 {
            let (d, u) = sim(seed);
            downs += d;
            ups += u;
        }
        assert!(downs > 300 && ups > 300, "the faults must kill and revive servers: {downs} downs, {ups} ups");
    }

    fn sim(seed: u64) -> (usize, usize) {
        let (mut downs, mut ups) = (0, 0);
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut rnd = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let c = DetectorConfig { servers: 3, buckets: 16, dead_after_ms: 40, lease_ms: 30, revive_hold_ms: 100, startup_grace_ms: 200, failover_window_ms: 60_000 };
        let mut d = Detector::new(c.clone(), home(&c), 0).unwrap();
        // In flight: (arrival, to_lb, server, send_time, grant)
        let mut net: Vec<(u64, bool, usize, u64, Option<Grant>)> = Vec::new();
        let mut lease: Vec<Vec<u64>> = vec![vec![0; 16]; 3]; // until, per bucket
        let mut stalled_until = [0u64; 3];
        let mut pending: Option<(u64, u32, Vec<u16>)> = None;
        for now in 0..6000u64 {
            // Faults: an agent stalls (wedged loop, lost beats) for up to 150 ms.
            for (i, st) in stalled_until.iter_mut().enumerate() {
                if now >= *st && rnd(3000) == 0 {
                    *st = now + 10 + rnd(150);
                }
                if now % 5 == 0 && now >= *st && rnd(20) != 0 {
                    net.push((now + rnd(8) + if rnd(50) == 0 { rnd(60) } else { 0 }, true, i, now, None));
                }
            }
            let mut arrived = Vec::new();
            net.retain(|m| {
                if m.0 <= now {
                    arrived.push(m.clone());
                    false
                } else {
                    true
                }
            });
            for (_, to_lb, i, sent, grant) in arrived {
                if to_lb {
                    if d.heartbeat(i, 0, now).is_some() {
                        ups += 1;
                    }
                    let g = d.grant(i, now);
                    if rnd(20) != 0 {
                        net.push((now + rnd(8), false, i, sent, Some(g)));
                    }
                } else if let Some(g) = grant {
                    // The agent: the reply's buckets are leased from the heartbeat's send time;
                    // buckets it does not list are given up at once.
                    for b in 0..16 {
                        if g.owned[b / 8] & (1 << (b % 8)) != 0 {
                            lease[i][b] = lease[i][b].max(sent + g.lease_ms);
                        } else {
                            lease[i][b] = 0;
                        }
                    }
                }
            }
            downs += d.tick(now).len();
            match &pending {
                Some((at, e, w)) if *at <= now => {
                    let (e, w) = (*e, w.clone());
                    d.applied(e, &w, now);
                    pending = None;
                }
                None => {
                    if let Some((e, w)) = d.take_want() {
                        if rnd(10) == 0 {
                            d.apply_failed();
                        } else {
                            pending = Some((now + 5 + rnd(30), e, w));
                        }
                    }
                }
                _ => {}
            }
            for b in 0..16 {
                let holders: Vec<usize> = (0..3).filter(|&i| lease[i][b] > now).collect();
                assert!(holders.len() <= 1, "seed {seed}: bucket {b} leased to {holders:?} at {now} ms");
                if let [h] = holders[..] {
                    assert_eq!(d.applied_table().1[b] as usize, h, "seed {seed}: bucket {b} leased to {h} but the kernel sends it elsewhere at {now}");
                }
            }
        }
        (downs, ups)
    }
}
