//! Object mode's records as they cross the store (issue 9 item 7), without I/O: every value the
//! agent writes is sealed ([`unbroken_wire::sealed`]: version, write time, HMAC-SHA256 under the
//! cluster key bound to the full store key), and every value it reads is opened, checked for
//! age and decoded before anything is planned or replayed from it. A value that fails any step
//! is a [`Refusal`]: the caller treats the connection exactly as one without a record (the
//! client gets the RST an unprotected server's death would give it) and counts the reason.
//! See docs/store.md for the whole layout.

use crate::object::store::{Op, OpKind};
use unbroken_engines::trods::Record;
use unbroken_wire::sealed::{self, RecordKey, Refused};

/// Records older than the store's TTL by more than this are refused (servers' clocks differ).
pub const CLOCK_SLACK_MS: u64 = 60_000;

/// Seals and opens records for one agent.
#[derive(Debug, Clone)]
pub struct Records {
    key: RecordKey,
    /// The store's key prefix: the MAC binds the key as stored.
    prefix: String,
    /// The store's TTL (0: records never expire, and age is not checked).
    ttl_ms: u64,
}

/// Why a stored value was not used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The envelope did not verify (see [`Refused`]).
    Sealed(Refused),
    /// Sealed longer ago than the store's TTL allows: a record put back (a rollback).
    Expired { age_ms: u64 },
    /// The MAC verified but the record does not decode (an agent bug, never input).
    Undecodable(&'static str),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Sealed(r) => write!(f, "{r}"),
            Refusal::Expired { age_ms } => write!(f, "record sealed {age_ms} ms ago, beyond the store's TTL"),
            Refusal::Undecodable(why) => write!(f, "authenticated record does not decode: {why}"),
        }
    }
}

impl Records {
    /// `prefix` and `ttl_ms` as the store client uses them.
    pub fn new(key: RecordKey, prefix: &str, ttl_ms: u64) -> Records {
        Records { key, prefix: prefix.to_string(), ttl_ms }
    }

    fn full_key(&self, key: &[u8]) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.prefix.len() + key.len());
        k.extend_from_slice(self.prefix.as_bytes());
        k.extend_from_slice(key);
        k
    }

    /// The value to store for `body` under `key` (without the prefix), at `now_ms` (Unix).
    pub fn seal(&self, key: &[u8], body: &[u8], now_ms: u64) -> Vec<u8> {
        // A key too long to bind cannot come from `agent::store_key` (under 200 bytes); were
        // it to, the bare body is stored, and every reader refuses it as unversioned.
        sealed::seal(&self.key, &self.full_key(key), now_ms, body).unwrap_or_else(|_| body.to_vec())
    }

    /// `op` with its value sealed (writes); other operations unchanged.
    pub fn seal_op(&self, op: Op, now_ms: u64) -> Op {
        match op.kind {
            OpKind::Set { key, val } => {
                let val = self.seal(&key, &val, now_ms);
                Op { token: op.token, kind: OpKind::Set { key, val } }
            }
            kind => Op { token: op.token, kind },
        }
    }

    /// The record stored under `key` (without the prefix), read at `now_ms` (Unix).
    pub fn open(&self, key: &[u8], value: &[u8], now_ms: u64) -> Result<Record, Refusal> {
        let s = sealed::open(&self.key, &self.full_key(key), value).map_err(Refusal::Sealed)?;
        let age_ms = s.age_ms(now_ms);
        if self.ttl_ms > 0 && age_ms > self.ttl_ms.saturating_add(CLOCK_SLACK_MS) {
            return Err(Refusal::Expired { age_ms });
        }
        Record::decode(s.body).map_err(Refusal::Undecodable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use unbroken_engines::trods::{Entry, Handshake};

    fn records() -> Records {
        Records::new(RecordKey::from_hex("00112233445566778899aabbccddeeff").unwrap(), "ub:", 600_000)
    }

    fn rec() -> Record {
        Record {
            hs: Handshake { iss: 7, irs: 9, client_mss: 1400, client_ws: Some(7), server_ws: 9, sack: true, timestamps: true },
            hold_off: 40,
            sent_off: 5000,
            acked_off: 100,
            entries: vec![Entry {
                req_off: 0,
                req_len: 40,
                resp_off: 0,
                status: 200,
                body_len: 4000,
                header: b"HTTP/1.1 200 OK\r\nContent-Length: 4000\r\nETag: \"e\"\r\n\r\n".to_vec(),
                object_id: b"GET /a HTTP/1.1\r\nHost: x\r\n".to_vec(),
                etag: b"\"e\"".to_vec(),
                ..Entry::default()
            }],
            unprotected: false,
            client_fin: None,
        }
    }

    const K: &[u8] = b"b5/c/10.77.0.2:41000/10.77.0.100:80";
    const NOW: u64 = 1_795_593_600_000;

    #[test]
    fn a_sealed_record_round_trips() {
        let r = records();
        let v = r.seal(K, &rec().encode(), NOW);
        assert_eq!(r.open(K, &v, NOW + 5), Ok(rec()));
        let op = r.seal_op(Op { token: 3, kind: OpKind::Set { key: K.to_vec(), val: rec().encode() } }, NOW);
        let OpKind::Set { val, .. } = &op.kind else { panic!() };
        assert_eq!(r.open(K, val, NOW), Ok(rec()));
        let del = r.seal_op(Op { token: 4, kind: OpKind::Del { key: K.to_vec() } }, NOW);
        assert_eq!(del.kind, OpKind::Del { key: K.to_vec() });
    }

    #[test]
    fn hostile_record_edited_moved_or_foreign_is_refused() {
        let r = records();
        let v = r.seal(K, &rec().encode(), NOW);
        // Edited: the hold moved, one byte of the objectID changed.
        let mut edited = v.clone();
        let at = edited.windows(6).position(|w| w == b"GET /a").unwrap() + 5;
        edited[at] = b'b';
        assert_eq!(r.open(K, &edited, NOW), Err(Refusal::Sealed(Refused::BadMac)));
        // Copied under another connection's key, another bucket, another prefix.
        assert_eq!(r.open(b"b5/c/10.77.0.2:41001/10.77.0.100:80", &v, NOW), Err(Refusal::Sealed(Refused::BadMac)));
        assert_eq!(r.open(b"b6/c/10.77.0.2:41000/10.77.0.100:80", &v, NOW), Err(Refusal::Sealed(Refused::BadMac)));
        let other_prefix = Records::new(RecordKey::from_hex("00112233445566778899aabbccddeeff").unwrap(), "xx:", 600_000);
        assert_eq!(other_prefix.open(K, &v, NOW), Err(Refusal::Sealed(Refused::BadMac)));
        // Another cluster's key.
        let foreign = Records::new(RecordKey::from_hex("ff112233445566778899aabbccddeeff").unwrap(), "ub:", 600_000);
        assert_eq!(foreign.open(K, &v, NOW), Err(Refusal::Sealed(Refused::BadMac)));
        // A record of version 1, as older agents wrote it (and anyone can).
        assert_eq!(r.open(K, &rec().encode(), NOW), Err(Refusal::Sealed(Refused::Unversioned)));
    }

    #[test]
    fn hostile_record_put_back_after_its_ttl_is_refused() {
        let r = records();
        let v = r.seal(K, &rec().encode(), NOW);
        assert!(r.open(K, &v, NOW + 600_000 + CLOCK_SLACK_MS).is_ok());
        assert_eq!(r.open(K, &v, NOW + 600_001 + CLOCK_SLACK_MS), Err(Refusal::Expired { age_ms: 600_001 + CLOCK_SLACK_MS }));
        // Without a TTL records never expire, so age is not judged.
        let forever = Records::new(RecordKey::from_hex("00112233445566778899aabbccddeeff").unwrap(), "ub:", 0);
        let v = forever.seal(K, &rec().encode(), NOW);
        assert!(forever.open(K, &v, NOW + 86_400_000 * 365).is_ok());
    }
}
