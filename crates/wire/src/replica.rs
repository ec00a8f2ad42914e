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
//! 0  magic "UBRP"   4  version 4   5  role (1 primary, 2 backup)   6  flags ([`hdr`])   7  count
//! 8  beat (u64, the sender's counter within its boot, from 1)
//! 16 boot (u64, random per start of the sending process)          } [`Session`]: freshness
//! 24 nonce_t (u64, the sender's clock, ms, above 0)               } across restarts (a
//! 32 nonce (u64, the sender's challenge: a MAC of nonce_t under   } receiver binds the peer
//!    a secret random per start, opaque to the receiver)           } to one boot; a new boot
//! 40 echo_t (u64, the peer's nonce_t this sender echoes; 0: none) } counts once it echoed a
//! 48 echo (u64, that nonce)                                       } fresh nonce of the receiver)
//! 56 count records of 52 bytes:
//!    0 client address (16; IPv4 in the first 4, the rest zero, flag V6 clear)
//!    16 client port   18 server port
//!    20 rcv_nxt (client's sequence space)   24 rcv_edge (rcv_nxt + window, bytes)
//!    28 out_end (the server's output end, in the primary's sequence space)
//!    32 out_hash (u64: FNV-1a over the output bytes from the ISN + 1 to out_end; without
//!       strict output commit, [`hdr::RELAXED`], a backup computes none: `HASH_INIT`)
//!    40 last_ack (the client's latest ACK, primary's space; in the primary's records it is
//!       what the primary heard, which the backup relays to its server if it missed it)
//!    44 isn (the sender's server's ISN, in its own space; flag ISN_KNOWN. The backup checks
//!       the Δ it learned from the client's handshake ACK against the primary's: a forged ACK
//!       cannot align it unnoticed)
//!    48 flags   49 zero (3)
//! 56 + 52 * count: MAC (16)
//! ```
//!
//! Version 1 had no `isn` (records of 48 bytes, flags at 44); version 2 had no session (a
//! header of 16 bytes: a datagram captured before a restart counted as fresh afterwards);
//! version 3 had the same layout but no [`hdr::RELAXED`] (its relaxed backups digested their
//! output, and an absent flag could not mean strict); a
//! version mismatch is refused (`Unsupported`), so both hosts must run the same version. What
//! the receiver decides about the session fields is `unbroken_control::replica::core`'s.
//!
//! Fewer than 20 bytes per connection, as in ST-TCP, is not reached: the digest and the full
//! client address cost 52. [`MAX_RECORDS`] records fit one 1400-byte datagram.

use crate::ctl::Key;
use crate::{Error, Result, Seq};
use hmac::Mac;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

pub const MAGIC: [u8; 4] = *b"UBRP";
pub const VERSION: u8 = 4;
pub const HEADER_LEN: usize = 56;
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

/// Byte ranges of the header (see the module documentation).
pub mod field {
    pub type Field = core::ops::Range<usize>;
    pub const MAGIC: Field = 0..4;
    pub const VERSION: usize = 4;
    pub const ROLE: usize = 5;
    pub const FLAGS: usize = 6;
    pub const COUNT: usize = 7;
    pub const BEAT: Field = 8..16;
    pub const BOOT: Field = 16..24;
    pub const NONCE_T: Field = 24..32;
    pub const NONCE: Field = 32..40;
    pub const ECHO_T: Field = 40..48;
    pub const ECHO: Field = 48..56;
}

/// Flag bits of a message's header ([`Progress::flags`]).
pub mod hdr {
    /// Backup: it fenced the primary and took over. A primary that reads it never sends on
    /// the service again.
    pub const TOOK_OVER: u8 = 1 << 0;
    /// Primary: this backup can no longer take over (it missed input the primary's server
    /// consumed, or the primary declared it failed and runs alone): it must never fence the
    /// primary nor take over.
    pub const STALE: u8 = 1 << 1;
    /// Either: the sender has stopped acting for good (a primary that yielded or learned of a
    /// takeover; a stale backup): its messages are no sign of an active peer.
    pub const PASSIVE: u8 = 1 << 2;
    /// Primary: client bytes the backup missed (ST-TCP 3.6's retransmission from the primary).
    /// One record names the connection, its `rcv_nxt` the client sequence number of the first
    /// byte; after the record come a length (u16) and the bytes ([`MAX_INPUT`] at most), then
    /// the MAC ([`Progress::emit_input`], [`Progress::parse_message`]).
    pub const INPUT: u8 = 1 << 3;
    /// Backup: its server is hung (it has read none of its input for the hang bound): a
    /// primary that holds output for it stops waiting ([`crate::replica`] users: the
    /// engines' `Primary::backup_hung`).
    pub const HUNG: u8 = 1 << 4;
    /// Either: the sender runs without strict output commit (`strict = false`). Its output is
    /// released without the peer's digest, so a backup's records carry none (`out_hash` stays
    /// at [`HASH_INIT`], no checkpoints before `out_end`): a receiver whose own setting differs
    /// refuses the message (the two configs disagree).
    pub const RELAXED: u8 = 1 << 5;
    pub const ALL: u8 = TOOK_OVER | STALE | PASSIVE | INPUT | HUNG | RELAXED;
}

/// Client bytes one input message carries at most (one 1400-byte datagram).
pub const MAX_INPUT: usize = 1400 - HEADER_LEN - RECORD_LEN - 2 - MAC_LEN;

/// A message's freshness fields (see the module documentation): the sender's boot and
/// challenge, and its echo of the receiver's challenge. All zero in [`Progress::emit`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Session {
    pub boot: u64,
    pub nonce_t: u64,
    pub nonce: u64,
    pub echo_t: u64,
    pub echo: u64,
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
    /// In an input message's record (whose other figures mean nothing): `out_hash` carries the
    /// client's timestamps ([`ConnProgress::input`]).
    pub const INPUT_TS: u8 = ALIGNED;
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

impl ConnProgress {
    /// An input message's one record: the connection, the client sequence number of the first
    /// byte (`rcv_nxt`), and what the sender knows of the client (a backup relaying to the
    /// primary): its newest timestamps (`out_hash` = TSval << 32 | TSecr, with
    /// [`flag::INPUT_TS`]) and its window field (`rcv_edge`).
    pub fn input(client: IpAddr, client_port: u16, server_port: u16, seq: Seq, ts: Option<(u32, u32)>, window: u16) -> ConnProgress {
        let out_hash = ts.map_or(0, |(v, e)| ((v as u64) << 32) | e as u64);
        let flags = if ts.is_some() { flag::INPUT_TS } else { 0 };
        ConnProgress { client, client_port, server_port, rcv_nxt: seq, rcv_edge: Seq(window as u32), out_end: Seq(0), out_hash, last_ack: Seq(0), isn: Seq(0), flags }
    }

    /// An input record's client timestamps and window field ([`ConnProgress::input`]).
    pub fn input_client(&self) -> (Option<(u32, u32)>, u16) {
        let ts = (self.flags & flag::INPUT_TS != 0).then_some(((self.out_hash >> 32) as u32, self.out_hash as u32));
        (ts, self.rcv_edge.0 as u16)
    }
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
    /// Serializes and authenticates, with a zero [`Session`]. At most [`MAX_RECORDS`] records.
    pub fn emit(&self, key: &Key) -> Result<Vec<u8>> {
        self.emit_session(&Session::default(), key)
    }

    /// Serializes and authenticates with the session fields `s`.
    pub fn emit_session(&self, s: &Session, key: &Key) -> Result<Vec<u8>> {
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
        b[field::BEAT].copy_from_slice(&self.beat.to_be_bytes());
        b[field::BOOT].copy_from_slice(&s.boot.to_be_bytes());
        b[field::NONCE_T].copy_from_slice(&s.nonce_t.to_be_bytes());
        b[field::NONCE].copy_from_slice(&s.nonce.to_be_bytes());
        b[field::ECHO_T].copy_from_slice(&s.echo_t.to_be_bytes());
        b[field::ECHO].copy_from_slice(&s.echo.to_be_bytes());
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

    /// An input message ([`hdr::INPUT`]): this message's one record and `data` (at most
    /// [`MAX_INPUT`] bytes), authenticated with the session fields `s`.
    pub fn emit_input(&self, s: &Session, data: &[u8], key: &Key) -> Result<Vec<u8>> {
        if self.records.len() != 1 || data.len() > MAX_INPUT || data.is_empty() {
            return Err(Error::Malformed("input message"));
        }
        let mut m = self.clone();
        m.flags |= hdr::INPUT;
        let mut b = m.emit_session(s, &Key::new(&[0u8; 32]).expect("a 32-byte key"))?;
        let at = HEADER_LEN + RECORD_LEN;
        b.truncate(at);
        b.extend_from_slice(&(data.len() as u16).to_be_bytes());
        b.extend_from_slice(data);
        let tag = key.mac(&b).finalize().into_bytes();
        b.extend_from_slice(&tag[..MAC_LEN]);
        Ok(b)
    }

    /// Authenticates and parses any message: a progress message (no bytes), or an input
    /// message with its client bytes.
    pub fn parse_message(b: &[u8], key: &Key) -> Result<(Progress, Session, Vec<u8>)> {
        if b.len() < HEADER_LEN + RECORD_LEN + 2 + MAC_LEN || b[field::FLAGS] & hdr::INPUT == 0 {
            return Progress::parse_session(b, key).map(|(p, s)| (p, s, Vec::new()));
        }
        let at = HEADER_LEN + RECORD_LEN;
        let n = u16::from_be_bytes([b[at], b[at + 1]]) as usize;
        if b[field::COUNT] != 1 || n == 0 || n > MAX_INPUT || b.len() != at + 2 + n + MAC_LEN {
            return Err(Error::Malformed("input length"));
        }
        let end = at + 2 + n;
        key.mac(&b[..end]).verify_truncated_left(&b[end..]).map_err(|_| Error::Unauthenticated)?;
        // The header and record parse as a one-record progress message (MAC'd above; the
        // structural checks are the same): re-framed with a MAC under a throwaway key.
        let scratch = Key::new(&[0u8; 32]).expect("a 32-byte key");
        let mut framed = b[..at].to_vec();
        let tag = scratch.mac(&framed).finalize().into_bytes();
        framed.extend_from_slice(&tag[..MAC_LEN]);
        let (p, s) = Progress::parse_session(&framed, &scratch)?;
        Ok((p, s, b[at + 2..end].to_vec()))
    }

    /// Authenticates (constant time) and parses a datagram, dropping its session fields.
    pub fn parse(b: &[u8], key: &Key) -> Result<Progress> {
        Progress::parse_session(b, key).map(|(p, _)| p)
    }

    /// Authenticates (constant time) and parses a datagram with its session fields.
    pub fn parse_session(b: &[u8], key: &Key) -> Result<(Progress, Session)> {
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
        let u64at = |r: field::Field| u64::from_be_bytes(b[r].try_into().unwrap());
        let s = Session { boot: u64at(field::BOOT), nonce_t: u64at(field::NONCE_T), nonce: u64at(field::NONCE), echo_t: u64at(field::ECHO_T), echo: u64at(field::ECHO) };
        Ok((Progress { role, beat: u64at(field::BEAT), flags: b[field::FLAGS], records }, s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_message_roundtrips_and_is_authenticated() {
        let rec = ConnProgress { client: "10.0.0.2".parse().unwrap(), client_port: 4, server_port: 6379, rcv_nxt: Seq(77), rcv_edge: Seq(0), out_end: Seq(0), out_hash: 0, last_ack: Seq(0), isn: Seq(0), flags: 0 };
        let p = Progress { role: Role::Primary, beat: 9, flags: 0, records: vec![rec] };
        let s = Session { boot: 1, nonce_t: 2, nonce: 3, echo_t: 4, echo: 5 };
        let d = p.emit_input(&s, b"SET k v", &key()).unwrap();
        let (q, t, data) = Progress::parse_message(&d, &key()).unwrap();
        assert_eq!((q.records, t, data.as_slice(), q.flags & hdr::INPUT), (p.records.clone(), s, &b"SET k v"[..], hdr::INPUT));
        let mut bad = d.clone();
        bad[HEADER_LEN + RECORD_LEN + 3] ^= 1;
        assert_eq!(Progress::parse_message(&bad, &key()).unwrap_err(), Error::Unauthenticated, "a changed byte");
        assert!(Progress::parse_message(&d, &Key::new(&[8u8; 32]).unwrap()).is_err(), "another key");
        assert!(Progress::parse_message(&d[..d.len() - 1], &key()).is_err(), "truncated");
        assert!(p.emit_input(&s, &[0u8; MAX_INPUT + 1], &key()).is_err());
        // A progress message parses as one with no bytes.
        let plain = p.emit_session(&s, &key()).unwrap();
        assert!(Progress::parse_message(&plain, &key()).unwrap().2.is_empty());
    }

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

    fn session() -> Session {
        Session { boot: 0x0102_0304_0506_0708, nonce_t: 9, nonce: 0xa0a1_a2a3_a4a5_a6a7, echo_t: 0x10, echo: 0xb0b1_b2b3_b4b5_b6b7 }
    }

    #[test]
    fn session_roundtrips_and_is_authenticated() {
        let p = sample();
        let b = p.emit_session(&session(), &key()).unwrap();
        assert_eq!(Progress::parse_session(&b, &key()).unwrap().1, session());
        assert_eq!(Progress::parse(&b, &key()).unwrap().records.len(), 2);
        for i in field::BOOT.start..field::ECHO.end {
            let mut x = b.clone();
            x[i] ^= 0x80;
            assert_eq!(Progress::parse_session(&x, &key()).unwrap_err(), Error::Unauthenticated, "session byte {i}");
        }
        assert_eq!(Progress::parse_session(&p.emit(&key()).unwrap(), &key()).unwrap().1, Session::default());
    }

    /// The bytes of version 4, pinned: a change of layout or meaning must change this test and
    /// VERSION.
    #[test]
    fn layout_is_pinned() {
        let p = Progress { records: vec![sample().records[0]], flags: hdr::TOOK_OVER | hdr::PASSIVE, ..sample() };
        let b = p.emit_session(&session(), &key()).unwrap();
        assert_eq!(b.len(), 56 + 52 + 16);
        assert_eq!(b[..16], [b'U', b'B', b'R', b'P', 4, 2, 5, 1, 0, 0, 1, 0, 0, 0, 0, 0]);
        assert_eq!(b[16..56], [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0, 9, 0xa0, 0xa1, 0xa2, 0xa3, 0xa4, 0xa5, 0xa6, 0xa7, 0, 0, 0, 0, 0, 0, 0, 0x10, 0xb0, 0xb1, 0xb2, 0xb3, 0xb4, 0xb5, 0xb6, 0xb7]);
        assert_eq!((hdr::TOOK_OVER, hdr::STALE, hdr::PASSIVE, hdr::RELAXED), (1, 2, 4, 32));
        let h = hash_continue(HASH_INIT, b"+OK\r\n").to_be_bytes();
        let mut rec = vec![10, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        rec.extend([0x9c, 0x41, 0x18, 0xeb]); // ports 40001, 6379
        rec.extend([0xff, 0xff, 0xff, 0xfe, 0, 0, 0, 6, 0x80, 0, 0, 0]); // rcv_nxt, rcv_edge, out_end
        rec.extend(h);
        rec.extend([0, 0, 0, 77, 1, 2, 3, 5]); // last_ack, isn
        rec.extend([flag::RCV_KNOWN | flag::ALIGNED | flag::FIN_OUT | flag::ISN_KNOWN, 0, 0, 0]);
        assert_eq!(b[56..108], rec[..]);
        assert_eq!((MAX_RECORDS, VERSION), (25, 4));
        // Version 1 (48-byte records), 2 (no session) and 3 (no RELAXED) datagrams are
        // refused, not misread.
        for v in [1, 2, 3] {
            let mut old = b.clone();
            old[4] = v;
            assert_eq!(Progress::parse(&old, &key()).unwrap_err(), Error::Unsupported("progress version"));
        }
    }

    #[test]
    fn hash_continues_across_splits() {
        let whole = hash_continue(HASH_INIT, b"hello world");
        assert_eq!(hash_continue(hash_continue(HASH_INIT, b"hello"), b" world"), whole);
        assert_ne!(hash_continue(HASH_INIT, b"hello worle"), whole);
    }
}
