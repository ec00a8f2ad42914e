//! The heartbeat protocol between object mode's agents and the load balancer ([`crate::object::lb`]),
//! version 3: the I/O-free decisions on both ends. The byte layouts are
//! [`unbroken_wire::hb`]'s (see "Layouts" below).
//!
//! # What it promises
//!
//! * **Authenticated.** Every datagram but the NACK hint carries `mac` = the first 16 bytes of
//!   HMAC-SHA256(key, every byte before it). The key is shared by the balancer and its agents
//!   and is mandatory: at least [`MIN_KEY_LEN`] bytes ([`check_key`]).
//! * **Fresh, bound to its sender.** A beat names the agent's *boot* (a random 64-bit id drawn
//!   when its heartbeat sender starts) and a counter `seq` that grows by one per beat. The
//!   balancer ([`BeatGuard`]) binds each server to one (boot, source address) and accepts only
//!   a strictly larger `seq` from it: a replayed beat is refused and counted. A beat of another
//!   boot or from another source (an agent that restarted, moved, or a replay of an older run)
//!   is answered with a *challenge*: a cookie = HMAC(balancer secret, server, boot, source,
//!   time), the balancer secret being random per balancer start. The agent echoes the latest
//!   cookie in every beat; a beat whose cookie is valid, at most [`COOKIE_TTL_MS`] old and
//!   younger than the cookie of the current binding moves the binding. A replay of an older
//!   run's beats carries an older (or no) cookie and moves nothing; the cookies are stateless,
//!   so a flood of replays cannot crowd out a restarting agent's challenge.
//! * **Never an amplifier.** The balancer answers a beat only when its answer is no longer
//!   than the beat: agents pad their beats to the length of the reply they expect
//!   ([`reply_len`] for the bucket count of their last reply, [`MAX_BEAT_LEN`] before the
//!   first one), and a shorter authenticated beat gets no answer (counted `short_beats`). A
//!   challenge is [`HEARTBEAT_MIN_LEN`] bytes, the NACK hint 10.
//! * **Replies are bound to their beat.** A reply echoes the beat's boot and seq; an agent
//!   accepts only replies to its own boot and to a beat it sent recently, newer than the last
//!   one it accepted ([`ReplyCheck`]). An old reply replayed to a restarted agent (another boot)
//!   or to the same run (an older seq) extends no lease.
//! * **Misconfigurations are visible.** A beat that fails authentication draws (rate-limited, at
//!   most one per [`NACK_GAP_MS`] for the whole balancer) an unauthenticated NACK carrying the
//!   balancer's key id (4 bytes of SHA-256 over a label and the key): the agent can say "the
//!   balancer at X has another key" rather than "silence". Being unauthenticated, it only
//!   feeds the agent's diagnosis ([`HealthWatch`]), never its state.
//!
//! # Layouts
//!
//! Every byte of every datagram (the tables, encode/decode, the MAC and the NACK's key id)
//! lives in [`unbroken_wire::hb`]; its items are re-exported here, so `hbproto::Reply`,
//! `hbproto::decode_reply` etc. are the same items.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::net::{IpAddr, SocketAddr};

pub use unbroken_wire::hb::{
    decode_challenge, decode_heartbeat, decode_nack, decode_reply, encode_challenge, encode_heartbeat, encode_nack,
    encode_reply, key_id, looks_like_heartbeat, reply_len, Challenge, Heartbeat, Reply, CHALLENGE_LEN,
    HEARTBEAT_MIN_LEN, KIND_CHALLENGE, KIND_HEARTBEAT, KIND_NACK, KIND_REPLY, MAGIC, MAX_BEAT_LEN, MAX_BUCKETS,
    MIN_KEY_LEN, NACK_LEN, TAG_LEN, VERSION,
};
/// Why a datagram was refused ([`unbroken_wire::hb::Error`]).
pub use unbroken_wire::hb::Error as ProtoError;

/// How long a challenge's cookie can move a binding, milliseconds.
pub const COOKIE_TTL_MS: u64 = 2_000;
/// At most one NACK per this many milliseconds, for the whole balancer.
pub const NACK_GAP_MS: u64 = 100;

/// Parses a hex key (the empty string is the empty key, which [`check_key`] refuses).
pub fn parse_key_hex(s: &str) -> Result<Vec<u8>, String> {
    let s = s.trim();
    if !s.len().is_multiple_of(2) || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err("key must be an even number of hex digits".into());
    }
    Ok((0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap_or(0))
        .collect())
}

/// Parses the hex key of config field `field` and checks that it is long enough; the error
/// names the field and says what to do.
pub fn check_key(field: &str, hex: &str) -> Result<Vec<u8>, String> {
    let k = parse_key_hex(hex).map_err(|e| format!("{field}: {e}"))?;
    if k.is_empty() {
        return Err(format!(
            "{field} is missing or empty: the heartbeat key is mandatory ({MIN_KEY_LEN} bytes or more, \
             as {} hex digits, the same on the balancer and every agent; e.g. `openssl rand -hex 32`)",
            2 * MIN_KEY_LEN
        ));
    }
    if k.len() < MIN_KEY_LEN {
        return Err(format!(
            "{field} is {} bytes: the heartbeat key needs at least {MIN_KEY_LEN} bytes ({} hex digits; e.g. `openssl rand -hex 32`)",
            k.len(),
            2 * MIN_KEY_LEN
        ));
    }
    Ok(k)
}

// ---------------------------------------------------------------------------------------------
// The balancer's side: which beats count

/// What [`BeatGuard::check`] decided about an authenticated beat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BeatVerdict {
    /// Fresh, from the bound sender (or a valid cookie moved the binding: `rebound`). It
    /// counts for liveness and deserves a reply if it is long enough.
    Accept {
        /// The binding moved to this beat's boot or source.
        rebound: bool,
    },
    /// From the bound sender but not newer than its latest beat: a replay (or reordering).
    Replay,
    /// Another boot or source without a usable cookie: answer with this challenge (no
    /// liveness). `stale_cookie`: it carried a valid cookie, too old or older than the
    /// binding's (a replay of an earlier run).
    Challenge {
        /// The challenge to send to the beat's source.
        challenge: Challenge,
        /// The beat carried an authentic but stale cookie.
        stale_cookie: bool,
    },
}

#[derive(Debug, Clone, Copy, Default)]
struct Binding {
    boot: u64,
    seq: u32,
    cookie_t: u64,
    src: Option<SocketAddr>,
}

/// The balancer's replay and sender check (no I/O). Servers are indexed `0..n` (config order).
#[derive(Debug, Clone)]
pub struct BeatGuard {
    secret: [u8; 32],
    peers: Vec<Binding>,
    last_t: u64,
}

fn addr_bytes(a: SocketAddr) -> [u8; 18] {
    let mut b = [0u8; 18];
    let ip = match a.ip() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    b[..16].copy_from_slice(&ip.octets());
    b[16..].copy_from_slice(&a.port().to_be_bytes());
    b
}

impl BeatGuard {
    /// A guard for `servers` servers; `secret` must be random per balancer start (cookies of
    /// an earlier balancer must not verify).
    pub fn new(servers: usize, secret: [u8; 32]) -> BeatGuard {
        BeatGuard { secret, peers: vec![Binding::default(); servers], last_t: 0 }
    }

    fn cookie(&self, server: u16, boot: u64, src: SocketAddr, t: u64) -> u64 {
        // Opaque to the agents (they echo it): only this balancer computes and checks it.
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.secret).expect("HMAC takes any key length");
        m.update(b"unbroken heartbeat cookie\0");
        m.update(&server.to_be_bytes());
        m.update(&boot.to_be_bytes());
        m.update(&addr_bytes(src));
        m.update(&t.to_be_bytes());
        let d = m.finalize().into_bytes();
        let mut a = [0u8; 8];
        a.copy_from_slice(&d[..8]);
        u64::from_be_bytes(a)
    }

    /// Decides about authenticated beat `hb` of server `i` from `src` at `now_ms` (the
    /// balancer's monotonic clock, above 0).
    pub fn check(&mut self, i: usize, hb: &Heartbeat, src: SocketAddr, now_ms: u64) -> BeatVerdict {
        let cur = self.peers[i];
        if cur.src == Some(src) && cur.boot == hb.boot {
            if hb.seq > cur.seq {
                self.peers[i].seq = hb.seq;
                return BeatVerdict::Accept { rebound: false };
            }
            return BeatVerdict::Replay;
        }
        let authentic = hb.cookie_t != 0 && hb.cookie == self.cookie(hb.server, hb.boot, src, hb.cookie_t);
        let fresh = authentic
            && now_ms.saturating_sub(hb.cookie_t) <= COOKIE_TTL_MS
            && (cur.src.is_none() || hb.cookie_t > cur.cookie_t);
        if fresh {
            if cur.src.is_some() && cur.boot == hb.boot && hb.seq <= cur.seq {
                // The bound boot seen from another source must still move forward.
                return BeatVerdict::Replay;
            }
            self.peers[i] = Binding { boot: hb.boot, seq: hb.seq, cookie_t: hb.cookie_t, src: Some(src) };
            return BeatVerdict::Accept { rebound: true };
        }
        // Not throttled: a challenge is no longer than the beat that drew it, and only an
        // authenticated beat draws one; a throttle would let a stream of replays crowd out a
        // restarting agent's challenge.
        // Unique and increasing cookie times, so that "younger than the binding's" is strict.
        let t = now_ms.max(self.last_t + 1);
        self.last_t = t;
        let challenge = Challenge { server: hb.server, boot: hb.boot, seq: hb.seq, cookie_t: t, cookie: self.cookie(hb.server, hb.boot, src, t) };
        BeatVerdict::Challenge { challenge, stale_cookie: authentic }
    }

    /// The address server `i`'s beats are bound to (None: not bound yet).
    pub fn source(&self, i: usize) -> Option<SocketAddr> {
        self.peers[i].src
    }
}

// ---------------------------------------------------------------------------------------------
// The agent's side: which replies count, how long beats are, what to tell the operator

/// How many recent beats an agent remembers (a reply to an older one is refused).
pub const SENT_RING: usize = 256;

/// What [`ReplyCheck::reply`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyVerdict {
    /// A reply to a recent beat of this boot, newer than the last accepted: the lease runs
    /// from that beat's send time (the value, in the caller's clock).
    Accept(u64),
    /// For another server, another boot, an unknown or old beat, or not newer than the last
    /// accepted reply.
    Stale,
}

/// The agent's record of what it sent (no I/O; times are the caller's, e.g. microseconds).
#[derive(Debug, Clone)]
pub struct ReplyCheck {
    server: u16,
    boot: u64,
    seq: u32,
    sent_at: Vec<(u32, u64)>,
    last_accepted: Option<u32>,
    cookie: (u64, u64),
    /// The seq of the beat the held cookie's challenge answered.
    cookie_seq: u32,
    buckets: Option<u16>,
}

impl ReplyCheck {
    /// A fresh sender for `server` with boot id `boot` (random per start).
    pub fn new(server: u16, boot: u64) -> ReplyCheck {
        ReplyCheck { server, boot, seq: 0, sent_at: vec![(0, 0); SENT_RING], last_accepted: None, cookie: (0, 0), cookie_seq: 0, buckets: None }
    }

    /// The boot id.
    pub fn boot(&self) -> u64 {
        self.boot
    }

    /// The next beat to send at `now`, `padded` to the length of the reply it expects
    /// (the last reply's bucket count) or, with `padded_max`, to [`MAX_BEAT_LEN`] (use it
    /// when no reply came for a while: the balancer may have another bucket count now). The
    /// seq never wraps within a boot: at `u32::MAX` the boot id changes to `next_boot`.
    pub fn next_beat(&mut self, now: u64, padded_max: bool, next_boot: impl FnOnce() -> u64) -> Heartbeat {
        if self.seq == u32::MAX {
            *self = ReplyCheck { buckets: self.buckets, ..ReplyCheck::new(self.server, next_boot()) };
        }
        self.seq += 1;
        self.sent_at[self.seq as usize % SENT_RING] = (self.seq, now);
        let len = match self.buckets {
            Some(n) if !padded_max => reply_len(n),
            _ => MAX_BEAT_LEN,
        };
        Heartbeat { server: self.server, boot: self.boot, seq: self.seq, cookie_t: self.cookie.0, cookie: self.cookie.1, len }
    }

    /// A verified reply.
    pub fn reply(&mut self, r: &Reply) -> ReplyVerdict {
        if r.server != self.server || r.boot != self.boot || r.seq == 0 || r.seq > self.seq {
            return ReplyVerdict::Stale;
        }
        if self.last_accepted.is_some_and(|l| r.seq <= l) {
            return ReplyVerdict::Stale;
        }
        let (s, at) = self.sent_at[r.seq as usize % SENT_RING];
        if s != r.seq {
            return ReplyVerdict::Stale;
        }
        self.last_accepted = Some(r.seq);
        self.buckets = Some(r.buckets);
        ReplyVerdict::Accept(at)
    }

    /// A verified challenge: true when it is for this boot and a beat of it; its cookie is
    /// echoed from the next beat on unless the held one answers a later beat (a replayed old
    /// challenge changes nothing). The cookie's time is the balancer's and says nothing here: a
    /// restarted balancer's clock starts again.
    pub fn challenge(&mut self, c: &Challenge) -> bool {
        if c.server != self.server || c.boot != self.boot || c.seq == 0 || c.seq > self.seq {
            return false;
        }
        if c.seq >= self.cookie_seq {
            self.cookie = (c.cookie_t, c.cookie);
            self.cookie_seq = c.seq;
        }
        true
    }
}

/// Counters of an agent's heartbeat sender (what [`HealthWatch`] diagnoses from).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct HeartbeatStats {
    /// Heartbeats sent.
    pub sent: u64,
    /// Valid replies accepted.
    pub replies: u64,
    /// Replies refused (bad mac, wrong server or boot, stale seq, malformed).
    pub bad_replies: u64,
    /// Valid challenges received (one per agent start, or after the balancer restarted).
    pub challenges: u64,
    /// NACKs received: the balancer could not authenticate our beats.
    pub nacks: u64,
    /// The key id in the latest NACK (0: none yet).
    pub lb_key_id: u32,
    /// Send or receive errors (e.g. ICMP unreachable while the balancer is down).
    pub errors: u64,
    /// Heartbeats not sent because the packet loop was wedged.
    pub skipped_wedged: u64,
}

/// What an agent's heartbeats look like from its side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HbState {
    /// Not yet long enough to tell.
    Starting,
    /// Valid replies arrive.
    Ok,
    /// The balancer says it cannot authenticate our beats (NACK with another key id).
    WrongKey,
    /// Replies arrive but fail authentication or do not match what we sent.
    BadReplies,
    /// Sending or receiving fails (ICMP port/host unreachable: nothing listens at that address).
    Unreachable,
    /// Nothing comes back at all.
    Silent,
}

/// Watches an agent's heartbeat counters (no I/O) and says, within [`HealthWatch::AFTER_MS`]
/// of the last valid reply (or of the start), what is wrong: once when it starts, then at most
/// every [`HealthWatch::REPEAT_MS`] while it lasts, and once when it ends.
#[derive(Debug, Clone)]
pub struct HealthWatch {
    lb: SocketAddr,
    own_key_id: u32,
    started_ms: u64,
    last_ok_ms: Option<u64>,
    prev: HeartbeatStats,
    state: HbState,
    last_log_ms: Option<u64>,
    /// Counters over the current bad stretch.
    window: HeartbeatStats,
}

impl HealthWatch {
    /// No valid reply for this long is a problem.
    pub const AFTER_MS: u64 = 2_000;
    /// A lasting problem is said again at most this often.
    pub const REPEAT_MS: u64 = 30_000;

    /// A watch for heartbeats to `lb` with our key `key`, started at `now_ms`.
    pub fn new(lb: SocketAddr, key: &[u8], now_ms: u64) -> HealthWatch {
        HealthWatch { lb, own_key_id: key_id(key), started_ms: now_ms, last_ok_ms: None, prev: HeartbeatStats::default(), state: HbState::Starting, last_log_ms: None, window: HeartbeatStats::default() }
    }

    /// The current state.
    pub fn state(&self) -> HbState {
        self.state
    }

    /// Milliseconds since the last valid reply at `now_ms` (None: never).
    pub fn last_ok_age_ms(&self, now_ms: u64) -> Option<u64> {
        self.last_ok_ms.map(|t| now_ms.saturating_sub(t))
    }

    /// One line describing the current state (for the status file and the log).
    pub fn describe(&self) -> String {
        let lb = self.lb;
        let w = &self.window;
        match self.state {
            HbState::Starting => format!("heartbeats to the LB at {lb}: waiting for the first reply"),
            HbState::Ok => format!("heartbeats to the LB at {lb}: accepted"),
            HbState::WrongKey => format!(
                "heartbeats to the LB at {lb} are NOT accepted: the LB cannot authenticate them ({} NACK(s); its key id {:08x}, ours {:08x}): agent.key differs from the LB's key",
                w.nacks, w.lb_key_id, self.own_key_id
            ),
            HbState::BadReplies => format!(
                "heartbeats to the LB at {lb} are NOT accepted: {} repl(ies) failed authentication or did not match our beats (another key on the LB, or forged replies)",
                w.bad_replies
            ),
            HbState::Unreachable => format!(
                "heartbeats to the LB at {lb} are NOT accepted: {} send/receive error(s) (ICMP unreachable: nothing listens there): wrong agent.lb, or the LB is down",
                w.errors
            ),
            HbState::Silent => format!(
                "heartbeats to the LB at {lb} are NOT accepted: no answer at all to {} beat(s): wrong agent.lb, a firewall, or the LB is down",
                w.sent
            ),
        }
    }

    /// Feeds the counters at `now_ms`; returns a line to log, if any.
    pub fn observe(&mut self, s: &HeartbeatStats, now_ms: u64) -> Option<String> {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        let p = self.prev;
        self.prev = *s;
        if s.replies > p.replies {
            self.last_ok_ms = Some(now_ms);
            self.window = HeartbeatStats::default();
            let was = self.state;
            self.state = HbState::Ok;
            self.last_log_ms = None;
            return matches!(was, HbState::WrongKey | HbState::BadReplies | HbState::Unreachable | HbState::Silent)
                .then(|| format!("agent: heartbeats to the LB at {} accepted again", self.lb));
        }
        self.window.sent += d(s.sent, p.sent);
        self.window.nacks += d(s.nacks, p.nacks);
        self.window.bad_replies += d(s.bad_replies, p.bad_replies);
        self.window.errors += d(s.errors, p.errors);
        if s.nacks > p.nacks {
            self.window.lb_key_id = s.lb_key_id;
        }
        let since = self.last_ok_ms.unwrap_or(self.started_ms);
        if now_ms.saturating_sub(since) < Self::AFTER_MS {
            return None;
        }
        let w = &self.window;
        let state = if w.nacks > 0 && w.lb_key_id != self.own_key_id {
            HbState::WrongKey
        } else if w.bad_replies > 0 {
            HbState::BadReplies
        } else if w.errors > 0 {
            HbState::Unreachable
        } else {
            HbState::Silent
        };
        let changed = state != self.state;
        self.state = state;
        let due = self.last_log_ms.is_none_or(|t| now_ms.saturating_sub(t) >= Self::REPEAT_MS);
        if changed || due {
            self.last_log_ms = Some(now_ms);
            return Some(format!("agent: {}", self.describe()));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn src(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 78, 0, 11], port))
    }

    fn beat(c: &mut ReplyCheck) -> Heartbeat {
        c.next_beat(0, false, || 99)
    }

    /// Runs the handshake of a fresh agent: first beat challenged, second accepted.
    fn bind(g: &mut BeatGuard, c: &mut ReplyCheck, from: SocketAddr, now: u64) {
        let hb = beat(c);
        let BeatVerdict::Challenge { challenge, .. } = g.check(0, &hb, from, now) else { panic!("first beat must be challenged") };
        assert!(c.challenge(&challenge));
        let hb = beat(c);
        assert_eq!(g.check(0, &hb, from, now + 1), BeatVerdict::Accept { rebound: true });
    }

    #[test]
    fn hostile_key_is_mandatory_and_long() {
        let e = check_key("agent.key", "").unwrap_err();
        assert!(e.contains("agent.key") && e.contains("mandatory"), "{e}");
        let e = check_key("key", "00112233").unwrap_err();
        assert!(e.starts_with("key is 4 bytes") && e.contains("at least 16"), "{e}");
        let e = check_key("key", "xyz").unwrap_err();
        assert!(e.starts_with("key: "), "{e}");
        assert_eq!(check_key("key", "00112233445566778899aabbccddeeff").unwrap().len(), 16);
    }

    #[test]
    fn hostile_replayed_beat_is_refused() {
        let mut g = BeatGuard::new(1, [7; 32]);
        let mut c = ReplyCheck::new(1, 0xb007);
        bind(&mut g, &mut c, src(4000), 10);
        let hb = beat(&mut c);
        assert_eq!(g.check(0, &hb, src(4000), 12), BeatVerdict::Accept { rebound: false });
        // The same beat again, and an older one: replays.
        assert_eq!(g.check(0, &hb, src(4000), 13), BeatVerdict::Replay);
        let old = Heartbeat { seq: hb.seq - 1, ..hb };
        assert_eq!(g.check(0, &old, src(4000), 13), BeatVerdict::Replay);
        // The same beat from another source: challenged (not accepted), and its challenge is
        // bound to that source, so echoing it from the real agent's source moves nothing.
        let v = g.check(0, &hb, src(5000), 14);
        let BeatVerdict::Challenge { challenge, stale_cookie } = v else { panic!("{v:?}") };
        assert!(!stale_cookie);
        let forged = Heartbeat { seq: hb.seq + 100, cookie_t: challenge.cookie_t, cookie: challenge.cookie, ..hb };
        let v = g.check(0, &forged, src(5001), 20);
        assert!(matches!(v, BeatVerdict::Challenge { stale_cookie: false, .. }), "{v:?}");
        // The real agent goes on.
        let hb = beat(&mut c);
        assert_eq!(g.check(0, &hb, src(4000), 21), BeatVerdict::Accept { rebound: false });
    }

    #[test]
    fn hostile_beats_of_an_earlier_run_are_refused_after_a_restart() {
        let mut g = BeatGuard::new(1, [7; 32]);
        let mut old = ReplyCheck::new(1, 0x01d);
        bind(&mut g, &mut old, src(4000), 10);
        let mut captured = Vec::new();
        for _ in 0..5 {
            let hb = beat(&mut old);
            assert_eq!(g.check(0, &hb, src(4000), 12), BeatVerdict::Accept { rebound: false });
            captured.push(hb);
        }
        // The agent restarts (new boot, new source port) and binds again.
        let mut new = ReplyCheck::new(1, 0x2e2);
        bind(&mut g, &mut new, src(4100), 100);
        // Every captured beat of the old run, replayed from its old source: challenged (its
        // cookie is authentic but older than the new binding's), never accepted.
        for hb in &captured {
            let v = g.check(0, hb, src(4000), 150);
            assert!(matches!(v, BeatVerdict::Challenge { stale_cookie: true, .. }), "{v:?}");
        }
        // Also long after the cookie's lifetime.
        let v = g.check(0, &captured[0], src(4000), 150 + COOKIE_TTL_MS + 10);
        assert!(matches!(v, BeatVerdict::Challenge { stale_cookie: true, .. }), "{v:?}");
        // The new run is still bound.
        let hb = beat(&mut new);
        assert_eq!(g.check(0, &hb, src(4100), 200), BeatVerdict::Accept { rebound: false });
        // A cookie of an earlier balancer (another secret) binds nothing.
        let mut g2 = BeatGuard::new(1, [8; 32]);
        let hb = beat(&mut new);
        assert!(matches!(g2.check(0, &hb, src(4100), 300), BeatVerdict::Challenge { stale_cookie: false, .. }));
    }

    #[test]
    fn a_restarted_balancer_binds_the_running_agent_again() {
        // The first balancer ran long (its cookie times are large); the next one starts its
        // clock again: the agent must take its challenge all the same.
        let mut g1 = BeatGuard::new(1, [1; 32]);
        let mut c = ReplyCheck::new(1, 0xc0ffee);
        bind(&mut g1, &mut c, src(4000), 50_000_000);
        let mut g2 = BeatGuard::new(1, [2; 32]);
        bind(&mut g2, &mut c, src(4000), 10);
        // A replay of the first balancer's challenge does not make the agent forget the new
        // cookie.
        let old = Challenge { server: 1, boot: 0xc0ffee, seq: 1, cookie_t: 50_000_000, cookie: g1.cookie(1, 0xc0ffee, src(4000), 50_000_000) };
        assert!(c.challenge(&old));
        let hb = beat(&mut c);
        assert_eq!(g2.check(0, &hb, src(4000), 20), BeatVerdict::Accept { rebound: false });
        // Another source (the agent's address changed): rebound by a fresh cookie.
        let hb = beat(&mut c);
        let BeatVerdict::Challenge { challenge, .. } = g2.check(0, &hb, src(4001), 30) else { panic!() };
        assert!(c.challenge(&challenge));
        let hb = beat(&mut c);
        assert_eq!(g2.check(0, &hb, src(4001), 31), BeatVerdict::Accept { rebound: true });
        assert_eq!(g2.source(0), Some(src(4001)));
    }

    #[test]
    fn hostile_replay_stream_does_not_crowd_out_a_restarting_agent() {
        let mut g = BeatGuard::new(1, [7; 32]);
        let mut old = ReplyCheck::new(1, 1);
        bind(&mut g, &mut old, src(4000), 10);
        let captured: Vec<Heartbeat> = (0..50).map(|_| beat(&mut old)).collect();
        // The agent restarts while replays of its old beats arrive, in the same millisecond.
        let mut new = ReplyCheck::new(1, 2);
        for hb in &captured {
            let _ = g.check(0, hb, src(5000), 500);
        }
        let hb = beat(&mut new);
        let BeatVerdict::Challenge { challenge, .. } = g.check(0, &hb, src(4001), 500) else { panic!("no challenge") };
        for hb in &captured {
            let _ = g.check(0, hb, src(5000), 500);
        }
        assert!(new.challenge(&challenge));
        let hb = beat(&mut new);
        assert_eq!(g.check(0, &hb, src(4001), 500), BeatVerdict::Accept { rebound: true });
    }

    #[test]
    fn hostile_replayed_reply_extends_no_lease() {
        let mut c = ReplyCheck::new(1, 0xaaa);
        for _ in 0..3 {
            beat(&mut c);
        }
        let r = Reply { server: 1, boot: 0xaaa, seq: 2, epoch: 1, buckets: 8, owned: vec![1], allowed: vec![0], lease_ms: 100 };
        assert!(matches!(c.reply(&r), ReplyVerdict::Accept(_)));
        assert_eq!(c.reply(&r), ReplyVerdict::Stale, "the same reply again");
        assert_eq!(c.reply(&Reply { seq: 1, ..r.clone() }), ReplyVerdict::Stale, "an older reply");
        assert_eq!(c.reply(&Reply { seq: 9, ..r.clone() }), ReplyVerdict::Stale, "a reply to a beat not sent");
        assert_eq!(c.reply(&Reply { server: 2, seq: 3, ..r.clone() }), ReplyVerdict::Stale, "another server's");
        // After a restart (another boot), replies of the earlier run count for nothing.
        let mut n = ReplyCheck::new(1, 0xbbb);
        for _ in 0..5 {
            beat(&mut n);
        }
        assert_eq!(n.reply(&Reply { seq: 3, ..r.clone() }), ReplyVerdict::Stale);
        assert!(matches!(n.reply(&Reply { seq: 3, boot: 0xbbb, ..r }), ReplyVerdict::Accept(_)));
    }

    #[test]
    fn hostile_answers_are_never_larger_than_the_beat() {
        // The agent pads each beat to the reply it expects; before any reply (and after a
        // silence) to the largest reply. Whatever the bucket count, the balancer's answers
        // (reply, challenge, NACK) fit in the beat that draws them.
        for n in 1..=MAX_BUCKETS {
            let mut c = ReplyCheck::new(1, 5);
            let first = c.next_beat(0, false, || 6);
            assert!(reply_len(n) <= encode_heartbeat(KEY, &first).len());
            let bl = (n as usize).div_ceil(8);
            let r = Reply { server: 1, boot: 5, seq: 1, epoch: 1, buckets: n, owned: vec![0; bl], allowed: vec![0; bl], lease_ms: 1 };
            let wire = encode_reply(KEY, &r);
            assert_eq!(wire.len(), reply_len(n));
            assert!(matches!(c.reply(&decode_reply(KEY, &wire).unwrap()), ReplyVerdict::Accept(_)));
            let next = encode_heartbeat(KEY, &c.next_beat(1, false, || 6));
            assert!(wire.len() <= next.len(), "n={n}: reply {} > beat {}", wire.len(), next.len());
            assert!(CHALLENGE_LEN <= next.len() && NACK_LEN <= next.len());
        }
    }

    #[test]
    fn hostile_health_watch_names_the_misconfiguration() {
        let lb = SocketAddr::from(([10, 78, 0, 1], 7950));
        // Wrong key: NACKs with another key id.
        let mut w = HealthWatch::new(lb, KEY, 0);
        let mut s = HeartbeatStats { sent: 100, nacks: 3, lb_key_id: key_id(b"the LB's key, 16+ bytes"), ..Default::default() };
        assert_eq!(w.observe(&s, 500), None, "too early to tell");
        s.sent = 400;
        let line = w.observe(&s, 2_100).expect("said within a few seconds");
        assert!(line.contains("agent.key differs"), "{line}");
        assert_eq!(w.state(), HbState::WrongKey);
        s.sent = 500;
        assert_eq!(w.observe(&s, 2_600), None, "said once, not every tick");
        assert!(w.observe(&s, 2_100 + HealthWatch::REPEAT_MS).is_some(), "repeated, rate-limited");
        s.replies = 1;
        let line = w.observe(&s, 40_000).unwrap();
        assert!(line.contains("accepted again"), "{line}");
        assert_eq!(w.state(), HbState::Ok);
        // Wrong address: ICMP unreachable.
        let mut w = HealthWatch::new(lb, KEY, 0);
        let s = HeartbeatStats { sent: 400, errors: 200, ..Default::default() };
        assert!(w.observe(&s, 2_500).unwrap().contains("nothing listens there"));
        assert_eq!(w.state(), HbState::Unreachable);
        // Silence.
        let mut w = HealthWatch::new(lb, KEY, 0);
        let s = HeartbeatStats { sent: 400, ..Default::default() };
        assert!(w.observe(&s, 2_500).unwrap().contains("no answer at all"));
        // Healthy: nothing to say.
        let mut w = HealthWatch::new(lb, KEY, 0);
        for t in 1..20u64 {
            let s = HeartbeatStats { sent: t * 100, replies: t * 100, ..Default::default() };
            assert_eq!(w.observe(&s, t * 500), None);
        }
        assert_eq!(w.state(), HbState::Ok);
    }
}
