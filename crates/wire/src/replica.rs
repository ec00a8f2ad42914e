//! Replica mode's side channel (issue 10): the progress figures one host reports to the other
//! in every heartbeat, after ST-TCP section 3.6 (Marwah, seed 001): per connection, the last
//! client byte received, the right edge of the receive window, the output produced so far (its
//! end and a digest of its bytes, for Koch et al.'s strict output commit, seed 003) and the
//! FIN/RST flags. A heartbeat is a progress message, possibly without records.
//!
//! Layout (big-endian), authenticated with HMAC-SHA256 (truncated to 16 bytes) under the
//! side channel's [`Key`]:
//!
//! ```text
//! 0  magic "UBRP"   4  version 2   5  role (1 primary, 2 backup)   6  flags   7  count
//! 8  beat (u64, the sender's counter)
//! 16 count records of 52 bytes:
//!    0 client address (16; IPv4 in the first 4, the rest zero, flag V6 clear)
//!    16 client port   18 server port
//!    20 rcv_nxt (client's sequence space)   24 rcv_edge (rcv_nxt + window, bytes)
//!    28 out_end (the server's output end, in the primary's sequence space)
//!    32 out_hash (u64: FNV-1a over the output bytes from the ISN + 1 to out_end)
//!    40 last_ack (the client's latest ACK, primary's space; in the primary's records it is
//!       what the primary heard, which the backup relays to its server if it missed it)
//!    44 isn (the sender's server's ISN, in its own space; flag ISN_KNOWN. The backup checks
//!       the Δ it learned from the client's handshake ACK against the primary's: a forged ACK
//!       cannot align it unnoticed)
//!    48 flags   49 zero (3)
//! 16 + 52 * count: MAC (16)
//! ```
//!
//! Version 1 had no `isn` (records of 48 bytes, flags at 44); a version mismatch is refused
//! (`Unsupported`), so both hosts must run the same version.
//!
//! Fewer than 20 bytes per connection, as in ST-TCP, is not reached: the digest and the full
//! client address cost 52. [`MAX_RECORDS`] records fit one 1400-byte datagram.

use crate::ctl::Key;
use crate::{Error, Result, Seq};
use hmac::Mac;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

pub const MAGIC: [u8; 4] = *b"UBRP";
pub const VERSION: u8 = 2;
pub const HEADER_LEN: usize = 16;
pub const RECORD_LEN: usize = 52;
pub const MAC_LEN: usize = 16;
/// Records per datagram (1400 bytes at most).
pub const MAX_RECORDS: usize = (1400 - HEADER_LEN - MAC_LEN) / RECORD_LEN;

/// Who sent a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Primary = 1,
    Backup = 2,
}

/// Flag bits of a [`ConnProgress`].
pub mod flag {
    /// `rcv_nxt` and `rcv_edge` are known (the sender's server acknowledged something).
    pub const RCV_KNOWN: u8 = 1 << 0;
    /// The backup aligned its sequence space with the primary's (ST-TCP 3.3.0.1 step 3);
    /// `out_end` / `out_hash` are in the primary's space.
    pub const ALIGNED: u8 = 1 << 1;
    /// The sender's server sent a FIN, at `out_end`.
    pub const FIN_OUT: u8 = 1 << 2;
    /// The sender's server reset the connection.
    pub const RST_OUT: u8 = 1 << 3;
    /// The primary found the two outputs different: the backup must never answer on it.
    pub const DIVERGED: u8 = 1 << 4;
    /// The client address is IPv6.
    pub const V6: u8 = 1 << 5;
    /// `isn` is known (the sender saw its server's SYN-ACK).
    pub const ISN_KNOWN: u8 = 1 << 6;
    /// The backup aligned on a client ACK that did not acknowledge the primary's SYN-ACK (a
    /// forgery): its server's connection cannot be taken over.
    pub const MISALIGNED: u8 = 1 << 7;
    pub const ALL: u8 = 0xff;
}

/// One connection's figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnProgress {
    pub client: IpAddr,
    pub client_port: u16,
    pub server_port: u16,
    pub rcv_nxt: Seq,
    pub rcv_edge: Seq,
    pub out_end: Seq,
    pub out_hash: u64,
    pub last_ack: Seq,
    /// The sender's server's ISN, its own space (meaningful with [`flag::ISN_KNOWN`]).
    pub isn: Seq,
    /// [`flag`] bits (V6 is set from `client` on emit).
    pub flags: u8,
}

/// A heartbeat with its progress records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    pub role: Role,
    pub beat: u64,
    pub flags: u8,
    pub records: Vec<ConnProgress>,
}

/// FNV-1a, 64 bits: the output digest, continued byte by byte from [`HASH_INIT`]. Not a MAC:
/// it detects non-determinism of a crashed-or-correct server (ST-TCP's failure model), not an
/// adversary (the channel itself is authenticated).
pub const HASH_INIT: u64 = 0xcbf2_9ce4_8422_2325;
pub fn hash_continue(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl Progress {
    /// Serializes and authenticates. At most [`MAX_RECORDS`] records.
    pub fn emit(&self, key: &Key) -> Result<Vec<u8>> {
        if self.records.len() > MAX_RECORDS {
            return Err(Error::Malformed("too many progress records"));
        }
        let n = self.records.len();
        let mut b = vec![0u8; HEADER_LEN + n * RECORD_LEN + MAC_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.role as u8;
        b[6] = self.flags;
        b[7] = n as u8;
        b[8..16].copy_from_slice(&self.beat.to_be_bytes());
        for (i, r) in self.records.iter().enumerate() {
            let o = HEADER_LEN + i * RECORD_LEN;
            let x = &mut b[o..o + RECORD_LEN];
            let mut flags = r.flags & flag::ALL & !flag::V6;
            match r.client {
                IpAddr::V4(a) => x[0..4].copy_from_slice(&a.octets()),
                IpAddr::V6(a) => {
                    x[0..16].copy_from_slice(&a.octets());
                    flags |= flag::V6;
                }
            }
            x[16..18].copy_from_slice(&r.client_port.to_be_bytes());
            x[18..20].copy_from_slice(&r.server_port.to_be_bytes());
            x[20..24].copy_from_slice(&r.rcv_nxt.0.to_be_bytes());
            x[24..28].copy_from_slice(&r.rcv_edge.0.to_be_bytes());
            x[28..32].copy_from_slice(&r.out_end.0.to_be_bytes());
            x[32..40].copy_from_slice(&r.out_hash.to_be_bytes());
            x[40..44].copy_from_slice(&r.last_ack.0.to_be_bytes());
            x[44..48].copy_from_slice(&r.isn.0.to_be_bytes());
            x[48] = flags;
        }
        let at = HEADER_LEN + n * RECORD_LEN;
        let tag = key.mac(&b[..at]).finalize().into_bytes();
        b[at..].copy_from_slice(&tag[..MAC_LEN]);
        Ok(b)
    }

    /// Authenticates (constant time) and parses a datagram.
    pub fn parse(b: &[u8], key: &Key) -> Result<Progress> {
        if b.len() < HEADER_LEN + MAC_LEN {
            return Err(Error::Truncated);
        }
        if b[0..4] != MAGIC {
            return Err(Error::Malformed("progress magic"));
        }
        if b[4] != VERSION {
            return Err(Error::Unsupported("progress version"));
        }
        let n = b[7] as usize;
        if n > MAX_RECORDS || b.len() != HEADER_LEN + n * RECORD_LEN + MAC_LEN {
            return Err(Error::Malformed("progress length"));
        }
        let at = HEADER_LEN + n * RECORD_LEN;
        key.mac(&b[..at]).verify_truncated_left(&b[at..]).map_err(|_| Error::Unauthenticated)?;
        let role = match b[5] {
            1 => Role::Primary,
            2 => Role::Backup,
            _ => return Err(Error::Malformed("progress role")),
        };
        let u32at = |x: &[u8], o: usize| u32::from_be_bytes(x[o..o + 4].try_into().unwrap());
        let mut records = Vec::with_capacity(n);
        for i in 0..n {
            let o = HEADER_LEN + i * RECORD_LEN;
            let x = &b[o..o + RECORD_LEN];
            let flags = x[48];
            if x[49..52] != [0, 0, 0] {
                return Err(Error::Malformed("progress record reserved bits"));
            }
            let client = if flags & flag::V6 != 0 {
                IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&x[0..16]).unwrap()))
            } else {
                if x[4..16].iter().any(|&v| v != 0) {
                    return Err(Error::Malformed("ipv4 address padding"));
                }
                IpAddr::V4(Ipv4Addr::new(x[0], x[1], x[2], x[3]))
            };
            records.push(ConnProgress {
                client,
                client_port: u16::from_be_bytes([x[16], x[17]]),
                server_port: u16::from_be_bytes([x[18], x[19]]),
                rcv_nxt: Seq(u32at(x, 20)),
                rcv_edge: Seq(u32at(x, 24)),
                out_end: Seq(u32at(x, 28)),
                out_hash: u64::from_be_bytes(x[32..40].try_into().unwrap()),
                last_ack: Seq(u32at(x, 40)),
                isn: Seq(u32at(x, 44)),
                flags,
            });
        }
        Ok(Progress { role, beat: u64::from_be_bytes(b[8..16].try_into().unwrap()), flags: b[6], records })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Key {
        Key::new(&[7u8; 32]).unwrap()
    }

    fn sample() -> Progress {
        let r = |client: IpAddr, i: u32| ConnProgress {
            client,
            client_port: 40000 + i as u16,
            server_port: 6379,
            rcv_nxt: Seq(u32::MAX - i),
            rcv_edge: Seq(5 + i),
            out_end: Seq(1 << 31),
            out_hash: hash_continue(HASH_INIT, b"+OK\r\n"),
            last_ack: Seq(77),
            isn: Seq(0x0102_0304 + i),
            flags: flag::RCV_KNOWN | flag::ALIGNED | flag::FIN_OUT | flag::ISN_KNOWN,
        };
        Progress {
            role: Role::Backup,
            beat: 1 << 40,
            flags: 0,
            records: vec![r("10.0.0.9".parse().unwrap(), 1), r("fd00::9".parse().unwrap(), 2)],
        }
    }

    #[test]
    fn roundtrip_both_families() {
        let p = sample();
        let b = p.emit(&key()).unwrap();
        assert_eq!(b.len(), HEADER_LEN + 2 * RECORD_LEN + MAC_LEN);
        let mut q = Progress::parse(&b, &key()).unwrap();
        assert_eq!(q.records[1].flags & flag::V6, flag::V6);
        q.records[1].flags &= !flag::V6;
        assert_eq!(q, p);
        let empty = Progress { role: Role::Primary, beat: 0, flags: 0, records: vec![] };
        assert_eq!(Progress::parse(&empty.emit(&key()).unwrap(), &key()).unwrap(), empty);
    }

    #[test]
    fn forged_or_malformed_messages_are_errors() {
        let b = sample().emit(&key()).unwrap();
        let other = Key::new(&[8u8; 32]).unwrap();
        assert_eq!(Progress::parse(&b, &other).unwrap_err(), Error::Unauthenticated);
        for i in 0..b.len() {
            let mut x = b.clone();
            x[i] ^= 1;
            assert!(Progress::parse(&x, &key()).is_err(), "flipped byte {i} accepted");
        }
        assert!(Progress::parse(&b[..b.len() - 1], &key()).is_err());
        assert!(Progress::parse(&[], &key()).is_err());
        let too_many = Progress { records: vec![sample().records[0]; MAX_RECORDS + 1], ..sample() };
        assert!(too_many.emit(&key()).is_err());
        let full = Progress { records: vec![sample().records[0]; MAX_RECORDS], ..sample() };
        assert!(full.emit(&key()).unwrap().len() <= 1400);
    }

    /// The bytes of version 2, pinned: a change of layout must change this test and VERSION.
    #[test]
    fn layout_is_pinned() {
        let p = Progress { records: vec![sample().records[0]], ..sample() };
        let b = p.emit(&key()).unwrap();
        assert_eq!(b.len(), 16 + 52 + 16);
        assert_eq!(b[..16], [b'U', b'B', b'R', b'P', 2, 2, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0]);
        let h = hash_continue(HASH_INIT, b"+OK\r\n").to_be_bytes();
        let mut rec = vec![10, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        rec.extend([0x9c, 0x41, 0x18, 0xeb]); // ports 40001, 6379
        rec.extend([0xff, 0xff, 0xff, 0xfe, 0, 0, 0, 6, 0x80, 0, 0, 0]); // rcv_nxt, rcv_edge, out_end
        rec.extend(h);
        rec.extend([0, 0, 0, 77, 1, 2, 3, 5]); // last_ack, isn
        rec.extend([flag::RCV_KNOWN | flag::ALIGNED | flag::FIN_OUT | flag::ISN_KNOWN, 0, 0, 0]);
        assert_eq!(b[16..68], rec[..]);
        assert_eq!((MAX_RECORDS, VERSION), (26, 2));
        // A version 1 datagram (48-byte records) is refused, not misread.
        let mut v1 = b.clone();
        v1[4] = 1;
        assert_eq!(Progress::parse(&v1, &key()).unwrap_err(), Error::Unsupported("progress version"));
    }

    #[test]
    fn hash_continues_across_splits() {
        let whole = hash_continue(HASH_INIT, b"hello world");
        assert_eq!(hash_continue(hash_continue(HASH_INIT, b"hello"), b" world"), whole);
        assert_ne!(hash_continue(HASH_INIT, b"hello worle"), whole);
    }
}
