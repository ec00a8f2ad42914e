//! The heartbeat datagrams between object mode's agents and the load balancer, protocol
//! version 3: every byte layout, the MAC over it and the key id of the NACK. What the two ends
//! decide about a datagram (which beats count, which replies extend a lease, what to tell the
//! operator) is not here but in `unbroken_control::object::hbproto`, which builds on this module.
//!
//! Each datagram is a `Repr` ([`Heartbeat`], [`Reply`], [`Challenge`]; the NACK is just its key
//! id) with `parse` (length, magic, version, kind, then the MAC, checked before any field is
//! read: a malformed or forged datagram is an [`Error`], never a panic) and `emit`. The byte
//! ranges are in [`field`].
//!
//! Every datagram but the NACK ends in `mac` = the first [`TAG_LEN`] bytes of
//! HMAC-SHA256(key, every byte before it). The key is shared by the balancer and its agents
//! (at least [`MIN_KEY_LEN`] bytes). The NACK is unauthenticated: it carries the balancer's
//! [`key_id`] so that an agent can tell "another key" from "silence".
//!
//! # Layouts (all integers big endian)
//!
//! Heartbeat, agent to balancer (kind 1), [`HEARTBEAT_MIN_LEN`] = 52 bytes plus padding:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `"UBHB"` |
//! | 4 | 1 | version = 3 |
//! | 5 | 1 | kind = 1 |
//! | 6 | 2 | server id |
//! | 8 | 8 | boot id |
//! | 16 | 4 | seq |
//! | 20 | 8 | cookie time (balancer milliseconds; 0: no cookie yet) |
//! | 28 | 8 | cookie |
//! | 36 | n | zero padding (any length up to [`MAX_BEAT_LEN`] in all) |
//! | 36 + n | 16 | mac |
//!
//! Reply, balancer to the beat's source (kind 2), `B = ceil(buckets / 8)`, [`reply_len`] bytes:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 6 | magic, version, kind = 2 |
//! | 6 | 2 | server id (echoed) |
//! | 8 | 8 | boot id (echoed) |
//! | 16 | 4 | seq (echoed) |
//! | 20 | 4 | table epoch |
//! | 24 | 2 | bucket count N |
//! | 26 | 2 | lease, milliseconds from the beat's sending, on the `owned` buckets |
//! | 28 | B | `owned`: bit `b % 8` of byte `b / 8` |
//! | 28 + B | B | `allowed`: owned buckets whose owner changed within the failover window |
//! | 28 + 2B | 16 | mac |
//!
//! Challenge (kind 3), 52 bytes: header, server id, boot id and seq echoed (offsets 6, 8, 16),
//! cookie time (20, 8 bytes), cookie (28, 8 bytes), mac (36, 16 bytes).
//!
//! NACK (kind 4), 10 bytes, unauthenticated: header, then the balancer's key id (4 bytes).

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// Magic of every heartbeat datagram.
pub const MAGIC: [u8; 4] = *b"UBHB";
/// Protocol version.
pub const VERSION: u8 = 3;
/// Kind of an agent's heartbeat.
pub const KIND_HEARTBEAT: u8 = 1;
/// Kind of the balancer's reply.
pub const KIND_REPLY: u8 = 2;
/// Kind of the balancer's challenge.
pub const KIND_CHALLENGE: u8 = 3;
/// Kind of the balancer's (unauthenticated) "your mac failed" hint.
pub const KIND_NACK: u8 = 4;
/// Length of the truncated HMAC-SHA256 tag.
pub const TAG_LEN: usize = 16;
/// Shortest heartbeat (no padding).
pub const HEARTBEAT_MIN_LEN: usize = field::BEAT_PAD + TAG_LEN;
/// Length of a challenge.
pub const CHALLENGE_LEN: usize = field::BEAT_PAD + TAG_LEN;
/// Length of a NACK.
pub const NACK_LEN: usize = field::KEY_ID.end;
/// Largest bucket count (the marker MAC and the reply bitmaps are sized for it).
pub const MAX_BUCKETS: u16 = 4096;
/// Longest heartbeat: as long as the longest reply.
pub const MAX_BEAT_LEN: usize = field::BITMAPS + 2 * (MAX_BUCKETS as usize).div_ceil(8) + TAG_LEN;
/// Shortest key accepted by the balancer and the agents, bytes.
pub const MIN_KEY_LEN: usize = 16;

/// Byte ranges of the fields (see the [module documentation](self) for which kinds have which).
pub mod field {
    /// A range of bytes.
    pub type Field = core::ops::Range<usize>;
    /// Every kind: `"UBHB"`.
    pub const MAGIC: Field = 0..4;
    /// Every kind: the protocol version.
    pub const VERSION: usize = 4;
    /// Every kind: the kind.
    pub const KIND: usize = 5;
    /// Beat, reply, challenge: the server id.
    pub const SERVER: Field = 6..8;
    /// Beat, reply, challenge: the agent's boot id.
    pub const BOOT: Field = 8..16;
    /// Beat, reply, challenge: the beat's counter.
    pub const SEQ: Field = 16..20;
    /// Beat, challenge: the cookie's time.
    pub const COOKIE_T: Field = 20..28;
    /// Beat, challenge: the cookie.
    pub const COOKIE: Field = 28..36;
    /// Beat: where the padding (then the mac) starts; challenge: where the mac starts.
    pub const BEAT_PAD: usize = 36;
    /// Reply: the table epoch.
    pub const EPOCH: Field = 20..24;
    /// Reply: the bucket count.
    pub const BUCKETS: Field = 24..26;
    /// Reply: the lease, milliseconds.
    pub const LEASE: Field = 26..28;
    /// Reply: where the `owned` bitmap starts (`allowed` follows it).
    pub const BITMAPS: usize = 28;
    /// NACK: the balancer's key id.
    pub const KEY_ID: Field = 6..10;
}

/// Why a datagram was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Error {
    /// Wrong length for its kind (or too short to have one).
    Length,
    /// Not `"UBHB"`.
    Magic,
    /// Another protocol version.
    Version,
    /// Not the expected kind.
    Kind,
    /// The tag does not match (wrong key or corrupted).
    Mac,
}

impl core::fmt::Display for Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Error::Length => "bad length",
            Error::Magic => "bad magic",
            Error::Version => "unsupported version",
            Error::Kind => "unexpected kind",
            Error::Mac => "bad mac",
        })
    }
}

impl std::error::Error for Error {}

/// A short public fingerprint of a key (4 bytes of SHA-256 over a label and the key), which
/// the balancer's NACK carries so that an agent can tell "another key" from "silence".
pub fn key_id(key: &[u8]) -> u32 {
    let mut h = Sha256::new();
    h.update(b"unbroken heartbeat key id\0");
    h.update(key);
    let d = h.finalize();
    u32::from_be_bytes([d[0], d[1], d[2], d[3]])
}

fn hmac(key: &[u8], data: &[u8]) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    m.update(data);
    m
}

/// The tag of `data`: the first [`TAG_LEN`] bytes of HMAC-SHA256(key, data).
pub fn tag(key: &[u8], data: &[u8]) -> [u8; TAG_LEN] {
    let full = hmac(key, data).finalize().into_bytes();
    let mut t = [0u8; TAG_LEN];
    t.copy_from_slice(&full[..TAG_LEN]);
    t
}

/// Checks magic, version and `kind` of `buf` (nothing else).
fn check_header(buf: &[u8], kind: u8) -> Result<(), Error> {
    if buf.len() < field::KIND + 1 {
        return Err(Error::Length);
    }
    if buf[field::MAGIC] != MAGIC {
        return Err(Error::Magic);
    }
    if buf[field::VERSION] != VERSION {
        return Err(Error::Version);
    }
    if buf[field::KIND] != kind {
        return Err(Error::Kind);
    }
    Ok(())
}

/// Verifies the tag at the end of `buf` (whose length the caller checked: at least `TAG_LEN`).
fn check_tag(key: &[u8], buf: &[u8]) -> Result<(), Error> {
    let (body, t) = buf.split_at(buf.len() - TAG_LEN);
    hmac(key, body).verify_truncated_left(t).map_err(|_| Error::Mac)
}

fn header(b: &mut Vec<u8>, kind: u8) {
    b.extend_from_slice(&MAGIC);
    b.push(VERSION);
    b.push(kind);
}

fn seal(key: &[u8], mut b: Vec<u8>) -> Vec<u8> {
    let t = tag(key, &b);
    b.extend_from_slice(&t);
    b
}

// The callers checked the length, so these never index out of range.
fn u16_at(b: &[u8], f: field::Field) -> u16 {
    u16::from_be_bytes([b[f.start], b[f.start + 1]])
}
fn u32_at(b: &[u8], f: field::Field) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[f.start..f.start + 4]);
    u32::from_be_bytes(a)
}
fn u64_at(b: &[u8], f: field::Field) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[f.start..f.start + 8]);
    u64::from_be_bytes(a)
}

/// A heartbeat (kind 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heartbeat {
    /// The sender's server id.
    pub server: u16,
    /// The sender's boot id (random per start of its heartbeat sender).
    pub boot: u64,
    /// The sender's counter (grows by one per beat within a boot).
    pub seq: u32,
    /// The time of the cookie it echoes (0: none).
    pub cookie_t: u64,
    /// The cookie it echoes.
    pub cookie: u64,
    /// The datagram's length (padding included).
    pub len: usize,
}

impl Heartbeat {
    /// Parses and authenticates a heartbeat datagram.
    pub fn parse(key: &[u8], buf: &[u8]) -> Result<Heartbeat, Error> {
        check_header(buf, KIND_HEARTBEAT)?;
        if buf.len() < HEARTBEAT_MIN_LEN || buf.len() > MAX_BEAT_LEN {
            return Err(Error::Length);
        }
        check_tag(key, buf)?;
        Ok(Heartbeat {
            server: u16_at(buf, field::SERVER),
            boot: u64_at(buf, field::BOOT),
            seq: u32_at(buf, field::SEQ),
            cookie_t: u64_at(buf, field::COOKIE_T),
            cookie: u64_at(buf, field::COOKIE),
            len: buf.len(),
        })
    }

    /// The datagram, `len` bytes (clamped to [`HEARTBEAT_MIN_LEN`]..=[`MAX_BEAT_LEN`]).
    pub fn emit(&self, key: &[u8]) -> Vec<u8> {
        let len = self.len.clamp(HEARTBEAT_MIN_LEN, MAX_BEAT_LEN);
        let mut b = Vec::with_capacity(len);
        header(&mut b, KIND_HEARTBEAT);
        b.extend_from_slice(&self.server.to_be_bytes());
        b.extend_from_slice(&self.boot.to_be_bytes());
        b.extend_from_slice(&self.seq.to_be_bytes());
        b.extend_from_slice(&self.cookie_t.to_be_bytes());
        b.extend_from_slice(&self.cookie.to_be_bytes());
        b.resize(len - TAG_LEN, 0);
        seal(key, b)
    }
}

/// Builds a heartbeat datagram ([`Heartbeat::emit`]).
pub fn encode_heartbeat(key: &[u8], hb: &Heartbeat) -> Vec<u8> {
    hb.emit(key)
}

/// Parses and authenticates a heartbeat datagram ([`Heartbeat::parse`]).
pub fn decode_heartbeat(key: &[u8], buf: &[u8]) -> Result<Heartbeat, Error> {
    Heartbeat::parse(key, buf)
}

/// Whether `buf` looks like a heartbeat of this version (header and length; the MAC is not
/// checked), so that a failed mac deserves a NACK and anything else no answer at all.
pub fn looks_like_heartbeat(buf: &[u8]) -> bool {
    check_header(buf, KIND_HEARTBEAT).is_ok() && (HEARTBEAT_MIN_LEN..=MAX_BEAT_LEN).contains(&buf.len())
}

/// Length of a reply for `buckets` buckets.
pub fn reply_len(buckets: u16) -> usize {
    field::BITMAPS + 2 * (buckets as usize).div_ceil(8) + TAG_LEN
}

/// A reply (kind 2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// The server id the reply is for.
    pub server: u16,
    /// The heartbeat's boot id, echoed.
    pub boot: u64,
    /// The heartbeat's seq, echoed.
    pub seq: u32,
    /// The kernel table's epoch.
    pub epoch: u32,
    /// Number of buckets.
    pub buckets: u16,
    /// Owned buckets, wire layout (bit `b % 8` of byte `b / 8`).
    pub owned: Vec<u8>,
    /// Allowed buckets, wire layout.
    pub allowed: Vec<u8>,
    /// The lease on `owned`, milliseconds from the heartbeat's sending.
    pub lease_ms: u16,
}

impl Reply {
    /// Parses and authenticates a reply datagram: 1 to [`MAX_BUCKETS`] buckets, exactly
    /// [`reply_len`] bytes.
    pub fn parse(key: &[u8], buf: &[u8]) -> Result<Reply, Error> {
        check_header(buf, KIND_REPLY)?;
        if buf.len() < field::BITMAPS + TAG_LEN {
            return Err(Error::Length);
        }
        let buckets = u16_at(buf, field::BUCKETS);
        if buckets == 0 || buckets > MAX_BUCKETS || buf.len() != reply_len(buckets) {
            return Err(Error::Length);
        }
        check_tag(key, buf)?;
        let bl = (buckets as usize).div_ceil(8);
        let at = field::BITMAPS;
        Ok(Reply {
            server: u16_at(buf, field::SERVER),
            boot: u64_at(buf, field::BOOT),
            seq: u32_at(buf, field::SEQ),
            epoch: u32_at(buf, field::EPOCH),
            buckets,
            lease_ms: u16_at(buf, field::LEASE),
            owned: buf[at..at + bl].to_vec(),
            allowed: buf[at + bl..at + 2 * bl].to_vec(),
        })
    }

    /// The datagram, [`reply_len`] bytes.
    ///
    /// # Panics
    /// When `owned` or `allowed` is not `ceil(buckets / 8)` bytes long (a bug of the caller,
    /// which builds them from its own table).
    pub fn emit(&self, key: &[u8]) -> Vec<u8> {
        let bl = (self.buckets as usize).div_ceil(8);
        assert!(self.owned.len() == bl && self.allowed.len() == bl, "bitmap length must be ceil(buckets / 8)");
        let mut b = Vec::with_capacity(reply_len(self.buckets));
        header(&mut b, KIND_REPLY);
        b.extend_from_slice(&self.server.to_be_bytes());
        b.extend_from_slice(&self.boot.to_be_bytes());
        b.extend_from_slice(&self.seq.to_be_bytes());
        b.extend_from_slice(&self.epoch.to_be_bytes());
        b.extend_from_slice(&self.buckets.to_be_bytes());
        b.extend_from_slice(&self.lease_ms.to_be_bytes());
        b.extend_from_slice(&self.owned);
        b.extend_from_slice(&self.allowed);
        seal(key, b)
    }
}

/// Builds a reply datagram ([`Reply::emit`]; `owned` and `allowed` must be
/// `ceil(buckets / 8)` bytes).
pub fn encode_reply(key: &[u8], r: &Reply) -> Vec<u8> {
    r.emit(key)
}

/// Parses and authenticates a reply datagram ([`Reply::parse`]).
pub fn decode_reply(key: &[u8], buf: &[u8]) -> Result<Reply, Error> {
    Reply::parse(key, buf)
}

/// A challenge (kind 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Challenge {
    /// The server id the challenge is for.
    pub server: u16,
    /// The boot id of the beat it answers.
    pub boot: u64,
    /// The seq of the beat it answers.
    pub seq: u32,
    /// The cookie's time (balancer milliseconds).
    pub cookie_t: u64,
    /// The cookie to echo.
    pub cookie: u64,
}

impl Challenge {
    /// Parses and authenticates a challenge datagram ([`CHALLENGE_LEN`] bytes).
    pub fn parse(key: &[u8], buf: &[u8]) -> Result<Challenge, Error> {
        check_header(buf, KIND_CHALLENGE)?;
        if buf.len() != CHALLENGE_LEN {
            return Err(Error::Length);
        }
        check_tag(key, buf)?;
        Ok(Challenge {
            server: u16_at(buf, field::SERVER),
            boot: u64_at(buf, field::BOOT),
            seq: u32_at(buf, field::SEQ),
            cookie_t: u64_at(buf, field::COOKIE_T),
            cookie: u64_at(buf, field::COOKIE),
        })
    }

    /// The datagram, [`CHALLENGE_LEN`] bytes.
    pub fn emit(&self, key: &[u8]) -> Vec<u8> {
        let mut b = Vec::with_capacity(CHALLENGE_LEN);
        header(&mut b, KIND_CHALLENGE);
        b.extend_from_slice(&self.server.to_be_bytes());
        b.extend_from_slice(&self.boot.to_be_bytes());
        b.extend_from_slice(&self.seq.to_be_bytes());
        b.extend_from_slice(&self.cookie_t.to_be_bytes());
        b.extend_from_slice(&self.cookie.to_be_bytes());
        seal(key, b)
    }
}

/// Builds a challenge datagram ([`Challenge::emit`]).
pub fn encode_challenge(key: &[u8], c: &Challenge) -> Vec<u8> {
    c.emit(key)
}

/// Parses and authenticates a challenge datagram ([`Challenge::parse`]).
pub fn decode_challenge(key: &[u8], buf: &[u8]) -> Result<Challenge, Error> {
    Challenge::parse(key, buf)
}

/// Builds a NACK datagram ([`NACK_LEN`] bytes) carrying the balancer's key id.
pub fn encode_nack(key_id: u32) -> [u8; NACK_LEN] {
    let mut b = [0u8; NACK_LEN];
    b[field::MAGIC].copy_from_slice(&MAGIC);
    b[field::VERSION] = VERSION;
    b[field::KIND] = KIND_NACK;
    b[field::KEY_ID].copy_from_slice(&key_id.to_be_bytes());
    b
}

/// The key id of a NACK datagram (unauthenticated: a hint, never a decision).
pub fn decode_nack(buf: &[u8]) -> Result<u32, Error> {
    check_header(buf, KIND_NACK)?;
    if buf.len() != NACK_LEN {
        return Err(Error::Length);
    }
    Ok(u32_at(buf, field::KEY_ID))
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn wire_roundtrips_and_refusals() {
        let hb = Heartbeat { server: 7, boot: 0x1122334455667788, seq: 9, cookie_t: 5, cookie: 6, len: 100 };
        let b = encode_heartbeat(KEY, &hb);
        assert_eq!(b.len(), 100);
        assert_eq!(decode_heartbeat(KEY, &b), Ok(hb));
        assert_eq!(decode_heartbeat(b"another key of sixteen", &b), Err(Error::Mac));
        assert_eq!(decode_heartbeat(KEY, &b[..HEARTBEAT_MIN_LEN - 1]), Err(Error::Length));
        let mut v2 = b.clone();
        v2[4] = 2;
        assert_eq!(decode_heartbeat(KEY, &v2), Err(Error::Version));
        let c = Challenge { server: 7, boot: 1, seq: 2, cookie_t: 3, cookie: 4 };
        assert_eq!(decode_challenge(KEY, &encode_challenge(KEY, &c)), Ok(c));
        assert_eq!(decode_nack(&encode_nack(0xdeadbeef)), Ok(0xdeadbeef));
        assert!(looks_like_heartbeat(&b) && !looks_like_heartbeat(&b[..20]));
        for len in 0..200 {
            let junk: Vec<u8> = (0..len).map(|i| (i * 37 % 251) as u8).collect();
            let _ = decode_heartbeat(KEY, &junk);
            let _ = decode_reply(KEY, &junk);
            let _ = decode_challenge(KEY, &junk);
            let _ = decode_nack(&junk);
        }
    }

    /// The layouts are a protocol between hosts that may run different builds: pin the bytes
    /// of one datagram of each kind (captured from the encoder before it moved to this crate).
    #[test]
    fn layouts_are_stable() {
        let hb = Heartbeat { server: 7, boot: 0x1122334455667788, seq: 9, cookie_t: 0x0102030405060708, cookie: 0xa1a2a3a4a5a6a7a8, len: 60 };
        assert_eq!(hex(&hb.emit(KEY)), "55424842030100071122334455667788000000090102030405060708a1a2a3a4a5a6a7a800000000000000002a2b637d3a9b97383260df4f83ee2409");
        let r = Reply { server: 7, boot: 0x1122334455667788, seq: 9, epoch: 0xdeadbeef, buckets: 10, owned: vec![0x05, 0x02], allowed: vec![0x01, 0x00], lease_ms: 300 };
        assert_eq!(hex(&r.emit(KEY)), "5542484203020007112233445566778800000009deadbeef000a012c05020100dbd9bfd8ecb786d328cc898b188a23ec");
        let c = Challenge { server: 7, boot: 0x1122334455667788, seq: 9, cookie_t: 0x0102030405060708, cookie: 0xa1a2a3a4a5a6a7a8 };
        assert_eq!(hex(&c.emit(KEY)), "55424842030300071122334455667788000000090102030405060708a1a2a3a4a5a6a7a8b9e36f9b3e1f39e848b563b3ea97aabd");
        assert_eq!(hex(&encode_nack(0xdeadbeef)), "554248420304deadbeef");
        assert_eq!(key_id(KEY), 0x7669e393);
    }

    #[test]
    fn every_single_bit_flip_is_refused() {
        let b = Heartbeat { server: 1, boot: 2, seq: 3, cookie_t: 4, cookie: 5, len: 70 }.emit(KEY);
        for i in 0..b.len() {
            for bit in 0..8 {
                let mut t = b.clone();
                t[i] ^= 1 << bit;
                assert!(decode_heartbeat(KEY, &t).is_err(), "flip of byte {i} bit {bit} accepted");
            }
        }
    }
}
