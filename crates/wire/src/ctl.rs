//! The checkpoint-mode side channel (RTCP section 2.3 and 3.1, commands C1-C6): one fixed-size
//! UDP datagram per command and per response, authenticated with a shared key.
//!
//! Wire format version 1 (all integers big-endian), 96 bytes:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `UBRK` |
//! | 4 | 1 | version, 1 |
//! | 5 | 1 | op: 1 TELL, 2 ACKNOWLEDGE, 3 SHUTDOWN, 4 SHUTDOWN_READING, 5 SHUTDOWN_WRITING, 6 CLEAR, 7 ADOPT; responses set bit 7 |
//! | 6 | 1 | status (responses): 0 ok, 1 no such connection, 2 bad request |
//! | 7 | 1 | flags: bit 0 options present, bits 1-4 (responses) ack_allowed, recoverable, fin_allowed, ack_everything; bit 5 (ACKNOWLEDGE requests) recovery; bit 6 (SHUTDOWN requests) abandon |
//! | 8 | 8 | nonce, chosen by the sender of the request, echoed in the response |
//! | 16 | 8 | sender's clock, milliseconds since the Unix epoch (replay window) |
//! | 24 | 1 | address family, 4 or 6 |
//! | 25 | 3 | zero |
//! | 28 | 16 | application (protected) address; IPv4 in the first 4 bytes |
//! | 44 | 16 | peer address |
//! | 60 | 2 | application port |
//! | 62 | 2 | peer port |
//! | 64 | 4 | ackA: checkpointed acknowledgment (peer's sequence space) |
//! | 68 | 4 | ackB: the peer's latest acknowledgment (peer's view of the application's sequence space) |
//! | 72 | 2 | peer MSS (0 unknown) |
//! | 74 | 1 | peer window scale (255 none) |
//! | 75 | 1 | application window scale (255 none) |
//! | 76 | 1 | bit 0 SACK permitted, bit 1 timestamps |
//! | 77 | 3 | zero |
//! | 80 | 16 | HMAC-SHA256 over bytes 0..80 with the shared key, first 16 bytes |
//!
//! A datagram of any other size, magic, version or MAC is rejected before anything is parsed.
//!
//! ADOPT (7) is unbroken's addition to the paper's six commands: for an application that died
//! after its kernel accepted a connection but before it told the guard (so it holds no record of
//! it), the guard hands over, one per request, the connections of the application's address and
//! port that no TELL has claimed. The request's peer field is a cursor (the last peer returned,
//! or the unspecified address with port 0 to start); the response names the next such
//! connection in (address, port) order with its ackA, ackB and options, or status 1 when none
//! is left.

use crate::{Error, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

pub const MAGIC: [u8; 4] = *b"UBRK";
pub const VERSION: u8 = 1;
pub const LEN: usize = 96;
const MAC_AT: usize = 80;
const MAC_LEN: usize = 16;

/// Command codes (RTCP section 3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    Tell = 1,
    Acknowledge = 2,
    Shutdown = 3,
    ShutdownReading = 4,
    ShutdownWriting = 5,
    Clear = 6,
    Adopt = 7,
}

impl Op {
    pub fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            1 => Op::Tell,
            2 => Op::Acknowledge,
            3 => Op::Shutdown,
            4 => Op::ShutdownReading,
            5 => Op::ShutdownWriting,
            6 => Op::Clear,
            7 => Op::Adopt,
            _ => return None,
        })
    }
}

/// Response status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    Ok = 0,
    NoConnection = 1,
    BadRequest = 2,
}

pub mod flag {
    pub const OPTIONS: u8 = 1 << 0;
    pub const ACK_ALLOWED: u8 = 1 << 1;
    pub const RECOVERABLE: u8 = 1 << 2;
    pub const FIN_ALLOWED: u8 = 1 << 3;
    pub const ACK_EVERYTHING: u8 = 1 << 4;
    /// In an ACKNOWLEDGE request: it begins a recovery (the SDK's `recover`); the guard answers
    /// the recovery SYN that follows, and no unannounced one (issue 9, item 1).
    pub const RECOVERY: u8 = 1 << 5;
    /// In a SHUTDOWN request: the application gives up a connection it holds no record of
    /// (the SDK's `establish` failed). A guard that cannot protect it (it did not see the
    /// handshake: it restarted or forgot the connection before the first TELL) releases it and
    /// resets the peer, so the connection ends visibly instead of hanging (issue 21, item 4).
    /// Older guards ignore the bit (a plain SHUTDOWN).
    pub const ABANDON: u8 = 1 << 6;
}

/// TCP options negotiated on a connection, as the application's socket knows them
/// (TCP_INFO) or as the guard saw them in the handshake. Lets a restarted guard answer a
/// recovery SYN with the options the peer is really using.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConnOptions {
    pub peer_mss: u16,
    pub peer_wscale: Option<u8>,
    pub app_wscale: Option<u8>,
    pub sack: bool,
    pub timestamps: bool,
}

/// A decoded command or response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Command {
    pub op: Op,
    pub response: bool,
    pub status: u8,
    pub flags: u8,
    pub nonce: u64,
    pub time_ms: u64,
    /// The protected application's endpoint.
    pub app: SocketAddr,
    /// The remote peer's endpoint.
    pub peer: SocketAddr,
    pub ack_a: u32,
    pub ack_b: u32,
    pub options: Option<ConnOptions>,
}

/// A shared key for the side channel (at least 16 bytes).
#[derive(Clone)]
pub struct Key(Vec<u8>);

impl core::fmt::Debug for Key {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "Key(<{} bytes>)", self.0.len())
    }
}

impl Key {
    pub fn new(bytes: &[u8]) -> Result<Key> {
        if bytes.len() < 16 {
            return Err(Error::Malformed("key shorter than 16 bytes"));
        }
        Ok(Key(bytes.to_vec()))
    }
    /// Parses a key written as hex (at least 32 hex digits).
    pub fn from_hex(s: &str) -> Result<Key> {
        let s = s.trim();
        if s.len() % 2 != 0 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(Error::Malformed("key is not hex"));
        }
        let bytes: Vec<u8> = (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect();
        Key::new(&bytes)
    }
    pub(crate) fn mac(&self, data: &[u8]) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("hmac takes any key length");
        m.update(data);
        m
    }
}

fn put_addr(b: &mut [u8], a: IpAddr) {
    b.fill(0);
    match a {
        IpAddr::V4(v) => b[..4].copy_from_slice(&v.octets()),
        IpAddr::V6(v) => b.copy_from_slice(&v.octets()),
    }
}

fn get_addr(b: &[u8], family: u8) -> Result<IpAddr> {
    match family {
        4 => {
            if b[4..].iter().any(|&x| x != 0) {
                return Err(Error::Malformed("ipv4 address padding"));
            }
            Ok(IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3])))
        }
        6 => Ok(IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(b).unwrap()))),
        _ => Err(Error::Malformed("address family")),
    }
}

impl Command {
    /// A request with everything but the operation zeroed.
    pub fn request(op: Op, app: SocketAddr, peer: SocketAddr, nonce: u64, time_ms: u64) -> Command {
        Command { op, response: false, status: 0, flags: 0, nonce, time_ms, app, peer, ack_a: 0, ack_b: 0, options: None }
    }

    /// Serializes and authenticates.
    pub fn encode(&self, key: &Key) -> Result<[u8; LEN]> {
        let mut b = [0u8; LEN];
        let family = match (self.app.ip(), self.peer.ip()) {
            (IpAddr::V4(_), IpAddr::V4(_)) => 4,
            (IpAddr::V6(_), IpAddr::V6(_)) => 6,
            _ => return Err(Error::Malformed("mixed address families")),
        };
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.op as u8 | if self.response { 0x80 } else { 0 };
        b[6] = self.status;
        let mut flags = self.flags & !flag::OPTIONS;
        if self.options.is_some() {
            flags |= flag::OPTIONS;
        }
        b[7] = flags;
        b[8..16].copy_from_slice(&self.nonce.to_be_bytes());
        b[16..24].copy_from_slice(&self.time_ms.to_be_bytes());
        b[24] = family;
        put_addr(&mut b[28..44], self.app.ip());
        put_addr(&mut b[44..60], self.peer.ip());
        b[60..62].copy_from_slice(&self.app.port().to_be_bytes());
        b[62..64].copy_from_slice(&self.peer.port().to_be_bytes());
        b[64..68].copy_from_slice(&self.ack_a.to_be_bytes());
        b[68..72].copy_from_slice(&self.ack_b.to_be_bytes());
        if let Some(o) = self.options {
            b[72..74].copy_from_slice(&o.peer_mss.to_be_bytes());
            b[74] = o.peer_wscale.unwrap_or(255);
            b[75] = o.app_wscale.unwrap_or(255);
            b[76] = o.sack as u8 | (o.timestamps as u8) << 1;
        }
        let tag = key.mac(&b[..MAC_AT]).finalize().into_bytes();
        b[MAC_AT..].copy_from_slice(&tag[..MAC_LEN]);
        Ok(b)
    }

    /// Authenticates (constant time) and parses a datagram.
    pub fn decode(b: &[u8], key: &Key) -> Result<Command> {
        if b.len() != LEN {
            return Err(Error::Malformed("command length"));
        }
        if b[0..4] != MAGIC {
            return Err(Error::Malformed("command magic"));
        }
        if b[4] != VERSION {
            return Err(Error::Unsupported("command version"));
        }
        key.mac(&b[..MAC_AT]).verify_truncated_left(&b[MAC_AT..]).map_err(|_| Error::Unauthenticated)?;
        let op = Op::from_u8(b[5] & 0x7f).ok_or(Error::Malformed("command op"))?;
        if b[25..28].iter().chain(&b[77..80]).any(|&x| x != 0) {
            return Err(Error::Malformed("command reserved bytes"));
        }
        let family = b[24];
        let app_ip = get_addr(&b[28..44], family)?;
        let peer_ip = get_addr(&b[44..60], family)?;
        let port = |o: usize| u16::from_be_bytes([b[o], b[o + 1]]);
        let u32at = |o: usize| u32::from_be_bytes(b[o..o + 4].try_into().unwrap());
        let options = if b[7] & flag::OPTIONS != 0 {
            let ws = |v: u8| -> Result<Option<u8>> {
                match v {
                    255 => Ok(None),
                    0..=14 => Ok(Some(v)),
                    _ => Err(Error::Malformed("window scale above 14")),
                }
            };
            if b[76] & !3 != 0 {
                return Err(Error::Malformed("option flags"));
            }
            Some(ConnOptions {
                peer_mss: port(72),
                peer_wscale: ws(b[74])?,
                app_wscale: ws(b[75])?,
                sack: b[76] & 1 != 0,
                timestamps: b[76] & 2 != 0,
            })
        } else {
            None
        };
        Ok(Command {
            op,
            response: b[5] & 0x80 != 0,
            status: b[6],
            flags: b[7],
            nonce: u64::from_be_bytes(b[8..16].try_into().unwrap()),
            time_ms: u64::from_be_bytes(b[16..24].try_into().unwrap()),
            app: SocketAddr::new(app_ip, port(60)),
            peer: SocketAddr::new(peer_ip, port(62)),
            ack_a: u32at(64),
            ack_b: u32at(68),
            options,
        })
    }
}

/// Length of a refusal ([`Nak`]): smaller than the 96-byte command it answers.
pub const NAK_LEN: usize = 24;

/// Why the guard refused a well-formed command from an allowed source (status byte of a
/// [`Nak`]). Numbered after [`Status`].
pub mod refusal {
    /// The MAC did not verify: the sender's key is not the guard's.
    pub const KEY: u8 = 3;
    /// The sender's clock is further from the guard's than `max_clock_skew_ms`.
    pub const CLOCK: u8 = 4;
}

/// A refusal: what the guard answers, at a limited rate, to a command that is well formed
/// (size, magic, version), comes from an allowed source, but fails its MAC or its clock check,
/// so that a misconfigured application can say what is wrong instead of timing out. It cannot
/// be authenticated (the two sides do not share a key), so it is bound to the request only by
/// echoing its nonce: an off-path forger cannot produce one that matches.
///
/// | offset | size | field |
/// |---|---|---|
/// | 0 | 4 | magic `UBRK` |
/// | 4 | 1 | version, 1 |
/// | 5 | 1 | the request's op with bit 7 set |
/// | 6 | 1 | [`refusal`]: 3 key, 4 clock |
/// | 7 | 1 | zero |
/// | 8 | 8 | the request's nonce |
/// | 16 | 8 | the guard's clock, milliseconds since the Unix epoch |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nak {
    pub op: u8,
    pub refusal: u8,
    pub nonce: u64,
    pub time_ms: u64,
}

impl Nak {
    /// The refusal of `request` (a datagram of [`LEN`] bytes with the right magic and version;
    /// `None` otherwise: nothing is answered to garbage).
    pub fn refuse(request: &[u8], refusal: u8, time_ms: u64) -> Option<Nak> {
        if request.len() != LEN || request[0..4] != MAGIC || request[4] != VERSION || request[5] & 0x80 != 0 {
            return None;
        }
        Some(Nak { op: request[5], refusal, nonce: u64::from_be_bytes(request[8..16].try_into().unwrap()), time_ms })
    }
    pub fn encode(&self) -> [u8; NAK_LEN] {
        let mut b = [0u8; NAK_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.op | 0x80;
        b[6] = self.refusal;
        b[8..16].copy_from_slice(&self.nonce.to_be_bytes());
        b[16..24].copy_from_slice(&self.time_ms.to_be_bytes());
        b
    }
    pub fn decode(b: &[u8]) -> Result<Nak> {
        if b.len() != NAK_LEN || b[0..4] != MAGIC || b[4] != VERSION || b[5] & 0x80 == 0 || b[7] != 0 {
            return Err(Error::Malformed("refusal"));
        }
        if !matches!(b[6], refusal::KEY | refusal::CLOCK) {
            return Err(Error::Malformed("refusal reason"));
        }
        Ok(Nak { op: b[5] & 0x7f, refusal: b[6], nonce: u64::from_be_bytes(b[8..16].try_into().unwrap()), time_ms: u64::from_be_bytes(b[16..24].try_into().unwrap()) })
    }
}

/// The DSCP an application sets on a connection's packets (IP_TOS / IPV6_TCLASS = DSCP << 2)
/// to tell the guard that the connection is not protected (its application could not reach
/// the guard, e.g. a wrong key or address): the guard then lets the connection's packets
/// through untouched, as if it were not there, so the peer sees the application's close. It
/// is honoured only for a connection the guard saw from its handshake, that no authenticated
/// command ever named, and that needs no renumbering. 0x0b: from RFC 2474's pool 2
/// (experimental or local use).
pub const UNPROTECTED_DSCP: u8 = 0x0b;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn nak_round_trip_and_is_smaller_than_the_request() {
        let req = Command::request(Op::Tell, "10.0.2.10:7000".parse().unwrap(), "10.0.1.2:41000".parse().unwrap(), 0xfeed, 5).encode(&Key::new(&[9u8; 16]).unwrap()).unwrap();
        let n = Nak::refuse(&req, refusal::KEY, 77).unwrap();
        assert_eq!((n.op, n.nonce, n.time_ms), (Op::Tell as u8, 0xfeed, 77));
        let b = n.encode();
        assert!(b.len() < req.len());
        assert_eq!(Nak::decode(&b).unwrap(), n);
        assert!(Nak::refuse(&req[..50], refusal::KEY, 1).is_none(), "nothing for garbage");
        assert!(Command::decode(&b, &Key::new(&[9u8; 16]).unwrap()).is_err());
    }

    fn key() -> Key {
        Key::from_hex("00112233445566778899aabbccddeeff").unwrap()
    }

    fn sample() -> Command {
        let mut c = Command::request(Op::Acknowledge, "10.0.2.10:7000".parse().unwrap(), "10.0.1.2:41000".parse().unwrap(), 0x0102030405060708, 1_700_000_000_000);
        c.ack_a = 0xfffffff0;
        c.options = Some(ConnOptions { peer_mss: 1460, peer_wscale: Some(7), app_wscale: None, sack: true, timestamps: true });
        c
    }

    #[test]
    fn roundtrip_v4_and_v6() {
        let c = sample();
        let b = c.encode(&key()).unwrap();
        assert_eq!(Command::decode(&b, &key()).unwrap().ack_a, c.ack_a);
        assert_eq!(Command::decode(&b, &key()).unwrap(), Command { flags: flag::OPTIONS, ..c });
        let mut c6 = Command::request(Op::Tell, "[fd00::10]:7000".parse().unwrap(), "[fd00::2]:5".parse().unwrap(), 9, 9);
        c6.response = true;
        c6.flags = flag::RECOVERABLE | flag::ACK_ALLOWED;
        let b = c6.encode(&key()).unwrap();
        assert_eq!(Command::decode(&b, &key()).unwrap(), c6);
    }

    /// Shared test vector (testdata/ctl_v1_vectors.json, computed independently with Python's
    /// hmac): SDKs in other languages must produce exactly these bytes.
    #[test]
    fn test_vector_is_stable() {
        let b = sample().encode(&key()).unwrap();
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        let file = include_str!("../../../testdata/ctl_v1_vectors.json");
        let want = file.split("\"hex\": \"").nth(1).unwrap().split('"').next().unwrap();
        assert_eq!(hex, want);
        assert_eq!(Command::decode(&b, &key()).unwrap().nonce, 0x0102030405060708);
    }

    #[test]
    fn rejects_wrong_key_and_tampering() {
        let b = sample().encode(&key()).unwrap();
        let other = Key::from_hex("ffeeddccbbaa99887766554433221100").unwrap();
        assert_eq!(Command::decode(&b, &other).unwrap_err(), Error::Unauthenticated);
        let mut t = b;
        t[64] ^= 1;
        assert_eq!(Command::decode(&t, &key()).unwrap_err(), Error::Unauthenticated);
        assert!(Command::decode(&b[..95], &key()).is_err());
        assert!(Key::from_hex("0011").is_err());
        assert!(Key::from_hex("zz112233445566778899aabbccddeeff").is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Command::decode(&bytes, &key());
        }

        #[test]
        fn authenticated_garbage_is_checked(mut body in proptest::collection::vec(any::<u8>(), 80)) {
            // Even with a valid MAC (an insider with the key), bad fields are errors, not panics.
            body[0..4].copy_from_slice(&MAGIC);
            body[4] = VERSION;
            let mut b = [0u8; LEN];
            b[..80].copy_from_slice(&body);
            let tag = key().mac(&b[..80]).finalize().into_bytes();
            b[80..].copy_from_slice(&tag[..16]);
            let _ = Command::decode(&b, &key());
        }
    }
}
