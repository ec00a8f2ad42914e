//! The envelope of an object-mode store record (issue 9 item 7): what the agents write to the
//! store around a connection's record (the encoding of [`crate::objrec::Record`]), so a
//! record that was edited, written by someone without the cluster key, or copied under
//! another store key is refused instead of being replayed.
//!
//! ```text
//! offset  size  field
//!      0     4  magic "UBR2" (version 2; version 1 was the bare record, "UBT1", with no MAC)
//!      4     8  written_ms: the writer's clock, Unix milliseconds, big-endian
//!     12     n  body: the record (opaque here)
//!   12+n    32  tag: HMAC-SHA256(cluster key, CONTEXT || u16 BE len(store key) || store key
//!               || bytes 0..12+n)
//! ```
//!
//! The tag covers the magic, the write time and the body, and is bound to the full store key
//! (the key prefix included), so a record moved to another connection's key, another bucket
//! or another cluster's prefix does not verify. It does not stop a record of the same key
//! from being put back later (a rollback): the write time lets the reader refuse records older
//! than the store's TTL ([`Sealed::age_ms`]), and the engine's recovery plan refuses positions
//! the record does not explain.
//!
//! Nothing here is secret: the body is readable by whoever reads the store. The records hold
//! no credentials (see docs/store.md).

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// First bytes of a sealed record (version 2).
pub const MAGIC: &[u8; 4] = b"UBR2";
/// First bytes of a record of version 1 (unauthenticated): refused.
pub const MAGIC_V1: &[u8; 4] = b"UBT1";
/// Bytes before the body.
pub const HEADER_LEN: usize = 12;
/// Length of the tag.
pub const TAG_LEN: usize = 32;
/// Shortest key accepted.
pub const MIN_KEY_LEN: usize = 16;
/// Longest store key a tag can bind (u16 length).
pub const MAX_STORE_KEY: usize = u16::MAX as usize;
/// Domain separation: a tag made for anything else with the same key never verifies here.
const CONTEXT: &[u8] = b"unbroken object-mode store record v2\0";

/// The cluster key that authenticates records (shared by every agent of a cluster).
#[derive(Clone, PartialEq, Eq)]
pub struct RecordKey(Vec<u8>);

impl core::fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "RecordKey(<{} bytes, redacted>)", self.0.len())
    }
}

/// Why a key was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyError {
    /// Not an even number of hex digits.
    NotHex,
    /// Fewer than [`MIN_KEY_LEN`] bytes (the value is the length given).
    TooShort(usize),
    /// Every byte is the same (a placeholder, not a key).
    Constant,
}

impl core::fmt::Display for KeyError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            KeyError::NotHex => write!(f, "not an even number of hex digits"),
            KeyError::TooShort(n) => write!(f, "{n} bytes; at least {MIN_KEY_LEN} bytes ({} hex digits) are needed", 2 * MIN_KEY_LEN),
            KeyError::Constant => write!(f, "every byte is the same: use a random key (e.g. `head -c 32 /dev/urandom | xxd -p -c 64`)"),
        }
    }
}

impl RecordKey {
    /// A key of at least [`MIN_KEY_LEN`] bytes that is not one byte repeated.
    pub fn new(bytes: &[u8]) -> Result<RecordKey, KeyError> {
        if bytes.len() < MIN_KEY_LEN {
            return Err(KeyError::TooShort(bytes.len()));
        }
        if bytes.iter().all(|&b| b == bytes[0]) {
            return Err(KeyError::Constant);
        }
        Ok(RecordKey(bytes.to_vec()))
    }

    /// A key written as hex digits (surrounding white space ignored).
    pub fn from_hex(s: &str) -> Result<RecordKey, KeyError> {
        let s = s.trim().as_bytes();
        if !s.len().is_multiple_of(2) || !s.iter().all(|c| c.is_ascii_hexdigit()) {
            return Err(KeyError::NotHex);
        }
        let digit = |c: u8| (c as char).to_digit(16).unwrap_or(0) as u8;
        let bytes: Vec<u8> = s.chunks(2).map(|p| digit(p[0]) << 4 | digit(p[1])).collect();
        RecordKey::new(&bytes)
    }

    /// The key's bytes (to compare keys that must differ).
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }

    fn tag(&self, store_key: &[u8], sealed: &[u8]) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(CONTEXT);
        m.update(&(store_key.len() as u16).to_be_bytes());
        m.update(store_key);
        m.update(sealed);
        m
    }
}

/// Why a stored value was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// A record of version 1: written without a MAC (by an older agent, or by anyone).
    Unversioned,
    /// Neither version 2 nor version 1.
    UnknownVersion,
    /// Shorter than an empty sealed record.
    Truncated,
    /// The tag does not verify: edited, moved to another key, or sealed with another key.
    BadMac,
    /// The store key is longer than a tag can bind.
    KeyTooLong,
}

impl Refused {
    /// One line for logs.
    pub fn as_str(&self) -> &'static str {
        match self {
            Refused::Unversioned => "record of version 1 (no MAC)",
            Refused::UnknownVersion => "record of an unknown version",
            Refused::Truncated => "truncated record",
            Refused::BadMac => "record MAC does not verify (edited, moved to another key, or another cluster key)",
            Refused::KeyTooLong => "store key too long",
        }
    }
}

impl core::fmt::Display for Refused {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Seals `body` for `store_key` (the full key as stored, prefix included), written at
/// `written_ms`.
pub fn seal(key: &RecordKey, store_key: &[u8], written_ms: u64, body: &[u8]) -> Result<Vec<u8>, Refused> {
    if store_key.len() > MAX_STORE_KEY {
        return Err(Refused::KeyTooLong);
    }
    let mut out = Vec::with_capacity(HEADER_LEN + body.len() + TAG_LEN);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&written_ms.to_be_bytes());
    out.extend_from_slice(body);
    let tag = key.tag(store_key, &out).finalize().into_bytes();
    out.extend_from_slice(&tag);
    Ok(out)
}

/// A value whose tag verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sealed<'a> {
    /// The writer's clock when it sealed the record (Unix ms).
    pub written_ms: u64,
    /// The record.
    pub body: &'a [u8],
}

impl Sealed<'_> {
    /// How old the record is at `now_ms` (0 if written "later" than now: clocks differ).
    pub fn age_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.written_ms)
    }
}

/// Checks `value` read under `store_key` and returns its body; anything else is a refusal,
/// never a panic. The tag is compared in constant time.
pub fn open<'a>(key: &RecordKey, store_key: &[u8], value: &'a [u8]) -> Result<Sealed<'a>, Refused> {
    if store_key.len() > MAX_STORE_KEY {
        return Err(Refused::KeyTooLong);
    }
    match value.get(..4) {
        Some(m) if m == MAGIC => {}
        Some(m) if m == MAGIC_V1 => return Err(Refused::Unversioned),
        Some(_) => return Err(Refused::UnknownVersion),
        None => return Err(Refused::Truncated),
    }
    if value.len() < HEADER_LEN + TAG_LEN {
        return Err(Refused::Truncated);
    }
    let (sealed, tag) = value.split_at(value.len() - TAG_LEN);
    key.tag(store_key, sealed).verify_slice(tag).map_err(|_| Refused::BadMac)?;
    let mut ms = [0u8; 8];
    ms.copy_from_slice(&sealed[4..HEADER_LEN]);
    Ok(Sealed { written_ms: u64::from_be_bytes(ms), body: &sealed[HEADER_LEN..] })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> RecordKey {
        RecordKey::from_hex("000102030405060708090a0b0c0d0e0f1011").unwrap()
    }

    const SKEY: &[u8] = b"ub:b5/c/10.77.0.2:41000/10.77.0.100:80";

    #[test]
    fn sealed_record_opens_under_its_key() {
        let v = seal(&key(), SKEY, 1234, b"UBT1 body").unwrap();
        assert_eq!(v.len(), HEADER_LEN + 9 + TAG_LEN);
        assert_eq!(&v[..4], MAGIC);
        let s = open(&key(), SKEY, &v).unwrap();
        assert_eq!((s.written_ms, s.body), (1234, &b"UBT1 body"[..]));
        assert_eq!(s.age_ms(1500), 266);
        assert_eq!(s.age_ms(1000), 0);
        let empty = seal(&key(), SKEY, 0, b"").unwrap();
        assert_eq!(open(&key(), SKEY, &empty).unwrap().body, b"");
    }

    #[test]
    fn hostile_record_tampered_anywhere_is_refused() {
        let v = seal(&key(), SKEY, 99, b"UBT1 some record bytes").unwrap();
        for i in 0..v.len() {
            for bit in [0x01u8, 0x80] {
                let mut t = v.clone();
                t[i] ^= bit;
                let r = open(&key(), SKEY, &t);
                assert!(r.is_err(), "byte {i} bit {bit:#x} flipped: accepted");
            }
        }
        for cut in 0..v.len() {
            assert!(open(&key(), SKEY, &v[..cut]).is_err(), "cut at {cut}: accepted");
        }
        let mut longer = v.clone();
        longer.push(0);
        assert_eq!(open(&key(), SKEY, &longer), Err(Refused::BadMac));
    }

    #[test]
    fn hostile_record_moved_to_another_key_is_refused() {
        let v = seal(&key(), SKEY, 99, b"UBT1 record").unwrap();
        for other in [
            &b"ub:b5/c/10.77.0.2:41001/10.77.0.100:80"[..],
            b"ub:b6/c/10.77.0.2:41000/10.77.0.100:80",
            b"xx:b5/c/10.77.0.2:41000/10.77.0.100:80",
            b"b5/c/10.77.0.2:41000/10.77.0.100:80",
            b"",
        ] {
            assert_eq!(open(&key(), other, &v), Err(Refused::BadMac), "{}", String::from_utf8_lossy(other));
        }
    }

    #[test]
    fn hostile_record_sealed_with_another_key_is_refused() {
        let other = RecordKey::from_hex("ff0102030405060708090a0b0c0d0e0f1011").unwrap();
        let v = seal(&other, SKEY, 99, b"UBT1 record").unwrap();
        assert_eq!(open(&key(), SKEY, &v), Err(Refused::BadMac));
        // A MAC made by someone who knows the layout but not the key.
        let mut forged = v[..v.len() - TAG_LEN].to_vec();
        forged.extend_from_slice(&[0u8; TAG_LEN]);
        assert_eq!(open(&key(), SKEY, &forged), Err(Refused::BadMac));
    }

    #[test]
    fn hostile_unversioned_record_is_refused_not_misread() {
        assert_eq!(open(&key(), SKEY, b"UBT1\x13\x05\xb4\x07\x07"), Err(Refused::Unversioned));
        assert_eq!(open(&key(), SKEY, b"UBR3xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"), Err(Refused::UnknownVersion));
        assert_eq!(open(&key(), SKEY, b"UB"), Err(Refused::Truncated));
        assert_eq!(open(&key(), SKEY, b"UBR2short"), Err(Refused::Truncated));
    }

    /// Values outlive the agent that sealed them (another server, maybe of another build,
    /// opens them after a failover): pin the bytes of one.
    #[test]
    fn layout_is_stable() {
        let v = seal(&key(), SKEY, 0x0102_0304_0506, b"UBT1 body").unwrap();
        let hex: String = v.iter().map(|x| format!("{x:02x}")).collect();
        // Checked against the definition above with Python's hmac module.
        let want = concat!(
            "55425232", "0000010203040506", "5542543120626f6479",
            "2ac0ac158be9562f139e1d54c3ff853922fa2d23c981a91f60e53c7f64b55465"
        );
        assert_eq!(hex, want);
    }

    #[test]
    fn keys_are_checked() {
        assert_eq!(RecordKey::from_hex("0011"), Err(KeyError::TooShort(2)));
        assert_eq!(RecordKey::from_hex("xyz"), Err(KeyError::NotHex));
        assert_eq!(RecordKey::from_hex("001"), Err(KeyError::NotHex));
        assert_eq!(RecordKey::from_hex(&"00".repeat(16)), Err(KeyError::Constant));
        assert!(RecordKey::from_hex(" 000102030405060708090a0b0c0d0e0f \n").is_ok());
        assert!(!format!("{:?}", key()).contains("0102"), "Debug must not print the key");
        assert_eq!(seal(&key(), &vec![b'k'; MAX_STORE_KEY + 1], 0, b""), Err(Refused::KeyTooLong));
    }
}
