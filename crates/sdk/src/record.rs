//! [`ConnRecord`]: what the application persists for each protected connection (RTCP
//! section 4: "a saved copy of its checkpointed acknowledgment, and B's acknowledgment of its
//! initial sequence number from RTCP_TELL").
//!
//! # Encoding, version 1
//!
//! [`RECORD_LEN`] = 64 bytes, integers big-endian:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `UBCR` |
//! | 4 | 1 | version, 1 |
//! | 5 | 1 | address family, 4 or 6 |
//! | 6 | 1 | option bits: bit 0 options known, bit 1 SACK permitted, bit 2 timestamps; others 0 |
//! | 7 | 1 | peer window scale (255 none) |
//! | 8 | 16 | application (local) address; IPv4 in the first 4 bytes, rest 0 |
//! | 24 | 16 | peer address |
//! | 40 | 2 | application port |
//! | 42 | 2 | peer port |
//! | 44 | 4 | ack_a0: checkpointed ack right after the handshake (peer's ISN + 1) |
//! | 48 | 4 | ack_b0: the peer's ack covering the application's ISN (application's ISN + 1) |
//! | 52 | 2 | peer MSS (0 unknown) |
//! | 54 | 1 | application window scale (255 none) |
//! | 55 | 1 | 0 |
//! | 56 | 4 | IPv6 scope id of both addresses (0 for IPv4 and global addresses) |
//! | 60 | 4 | CRC-32 (IEEE 802.3, as zlib's `crc32`) of bytes 0..60 |
//!
//! When options are unknown (bit 0 clear), bytes 6, 7, 52-54 are 0. Decoding refuses any
//! other length, magic, version, checksum, family, non-zero reserved byte or window scale
//! above 14, so a record from a newer SDK or a torn write is an error, never a wrong
//! connection. Later versions keep bytes 0..6 and grow or change the rest.

use crate::error::{Error, Result};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};
use unbroken_wire::ctl::ConnOptions;
use unbroken_wire::seq::unwrap_near;

/// Length of an encoded [`ConnRecord`].
pub const RECORD_LEN: usize = 64;
/// Magic at the start of an encoded [`ConnRecord`].
pub const RECORD_MAGIC: [u8; 4] = *b"UBCR";
/// Version of the encoding written by [`ConnRecord::to_bytes`].
pub const RECORD_VERSION: u8 = 1;

const OPT_KNOWN: u8 = 1;
const OPT_SACK: u8 = 2;
const OPT_TS: u8 = 4;
const WS_NONE: u8 = 255;

/// What the application must store durably, once, right after a protected connection is
/// established ([`establish`](crate::establish)): the two endpoints, the two initial
/// acknowledgments and the negotiated TCP options. Together with the application's own
/// byte counters (`consumed_total` of input safely processed, `sent_total` of output
/// journaled and written) it is everything [`recover`](crate::recover) needs.
///
/// Addresses are normalized: an IPv4-mapped IPv6 address (from a dual-stack socket) is
/// stored as IPv4, because that is what the guard sees on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnRecord {
    app: SocketAddr,
    peer: SocketAddr,
    ack_a0: u32,
    ack_b0: u32,
    options: Option<ConnOptions>,
}

impl ConnRecord {
    /// A record from its parts. Addresses are normalized (IPv4-mapped IPv6 becomes IPv4);
    /// both must then be of the same family. Window scales above 14 are refused.
    pub fn new(app: SocketAddr, peer: SocketAddr, ack_a0: u32, ack_b0: u32, options: Option<ConnOptions>) -> Result<ConnRecord> {
        let (app, peer) = (normalize(app), normalize(peer));
        if app.is_ipv4() != peer.is_ipv4() {
            return Err(Error::InvalidArgument("application and peer addresses of different families"));
        }
        if let (SocketAddr::V6(a), SocketAddr::V6(p)) = (app, peer) {
            if a.scope_id() != 0 && p.scope_id() != 0 && a.scope_id() != p.scope_id() {
                return Err(Error::InvalidArgument("application and peer in different IPv6 scopes"));
            }
        }
        if let Some(o) = options {
            if o.peer_wscale.is_some_and(|w| w > 14) || o.app_wscale.is_some_and(|w| w > 14) {
                return Err(Error::InvalidArgument("window scale above 14"));
            }
        }
        Ok(ConnRecord { app, peer, ack_a0, ack_b0, options })
    }

    /// The application's (local) endpoint: the address and port the recovered socket binds.
    pub fn app(&self) -> SocketAddr {
        self.app
    }
    /// The peer's endpoint.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }
    /// The checkpointed acknowledgment right after the handshake: the peer's ISN + 1. The
    /// checkpoint after `consumed` bytes is `ack_a0 + consumed` (mod 2^32).
    pub fn ack_a0(&self) -> u32 {
        self.ack_a0
    }
    /// The peer's acknowledgment covering the application's SYN: the application's ISN + 1.
    /// The peer has received `ackB - ack_b0` (mod 2^32) bytes.
    pub fn ack_b0(&self) -> u32 {
        self.ack_b0
    }
    /// The options negotiated in the handshake, if known.
    pub fn options(&self) -> Option<ConnOptions> {
        self.options
    }

    /// The checkpointed acknowledgment after `consumed_total` bytes of input were safely
    /// consumed: `ack_a0 + consumed_total` (mod 2^32).
    pub fn ack_a(&self, consumed_total: u64) -> u32 {
        self.ack_a0.wrapping_add(consumed_total as u32)
    }

    /// How many bytes the peer received, given its latest acknowledgment `ack_b` (from a TELL)
    /// and the application's own count `sent_total`; see [`delivered_total`].
    pub fn delivered(&self, ack_b: u32, sent_total: u64) -> Result<u64> {
        delivered_total(self.ack_b0, ack_b, sent_total)
    }

    /// The version-1 encoding (see the [module documentation](self)).
    pub fn to_bytes(&self) -> [u8; RECORD_LEN] {
        let mut b = [0u8; RECORD_LEN];
        b[0..4].copy_from_slice(&RECORD_MAGIC);
        b[4] = RECORD_VERSION;
        b[5] = if self.app.is_ipv4() { 4 } else { 6 };
        if let Some(o) = self.options {
            b[6] = OPT_KNOWN | if o.sack { OPT_SACK } else { 0 } | if o.timestamps { OPT_TS } else { 0 };
            b[7] = o.peer_wscale.unwrap_or(WS_NONE);
            b[52..54].copy_from_slice(&o.peer_mss.to_be_bytes());
            b[54] = o.app_wscale.unwrap_or(WS_NONE);
        }
        put_ip(&mut b[8..24], self.app.ip());
        put_ip(&mut b[24..40], self.peer.ip());
        b[40..42].copy_from_slice(&self.app.port().to_be_bytes());
        b[42..44].copy_from_slice(&self.peer.port().to_be_bytes());
        b[44..48].copy_from_slice(&self.ack_a0.to_be_bytes());
        b[48..52].copy_from_slice(&self.ack_b0.to_be_bytes());
        b[56..60].copy_from_slice(&self.scope_id().to_be_bytes());
        let crc = crc32(&b[..60]);
        b[60..64].copy_from_slice(&crc.to_be_bytes());
        b
    }

    /// Decodes and checks a version-1 encoding.
    pub fn from_bytes(b: &[u8]) -> Result<ConnRecord> {
        if b.len() != RECORD_LEN {
            return Err(Error::BadRecord("length"));
        }
        if b[0..4] != RECORD_MAGIC {
            return Err(Error::BadRecord("magic"));
        }
        if b[4] != RECORD_VERSION {
            return Err(Error::BadRecord("unsupported version"));
        }
        if crc32(&b[..60]).to_be_bytes() != b[60..64] {
            return Err(Error::BadRecord("checksum"));
        }
        if b[55] != 0 {
            return Err(Error::BadRecord("reserved byte"));
        }
        let u16at = |o: usize| u16::from_be_bytes([b[o], b[o + 1]]);
        let u32at = |o: usize| u32::from_be_bytes(b[o..o + 4].try_into().unwrap());
        let scope = u32at(56);
        let (app_ip, peer_ip) = match b[5] {
            4 => {
                if scope != 0 || b[12..24].iter().chain(&b[28..40]).any(|&x| x != 0) {
                    return Err(Error::BadRecord("ipv4 padding"));
                }
                (IpAddr::V4(Ipv4Addr::new(b[8], b[9], b[10], b[11])), IpAddr::V4(Ipv4Addr::new(b[24], b[25], b[26], b[27])))
            }
            6 => (IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&b[8..24]).unwrap())), IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&b[24..40]).unwrap()))),
            _ => return Err(Error::BadRecord("address family")),
        };
        let sock = |ip: IpAddr, port: u16| match ip {
            IpAddr::V6(v6) => SocketAddr::V6(SocketAddrV6::new(v6, port, 0, scope)),
            v4 => SocketAddr::new(v4, port),
        };
        let options = if b[6] & OPT_KNOWN != 0 {
            if b[6] & !(OPT_KNOWN | OPT_SACK | OPT_TS) != 0 {
                return Err(Error::BadRecord("option bits"));
            }
            let ws = |v: u8| match v {
                WS_NONE => Ok(None),
                0..=14 => Ok(Some(v)),
                _ => Err(Error::BadRecord("window scale above 14")),
            };
            Some(ConnOptions { peer_mss: u16at(52), peer_wscale: ws(b[7])?, app_wscale: ws(b[54])?, sack: b[6] & OPT_SACK != 0, timestamps: b[6] & OPT_TS != 0 })
        } else {
            if b[6] != 0 || b[7] != 0 || b[52..55].iter().any(|&x| x != 0) {
                return Err(Error::BadRecord("options without the known bit"));
            }
            None
        };
        let r = ConnRecord {
            app: sock(app_ip, u16at(40)),
            peer: sock(peer_ip, u16at(42)),
            ack_a0: u32at(44),
            ack_b0: u32at(48),
            options,
        };
        if normalize(r.app) != r.app || normalize(r.peer) != r.peer {
            return Err(Error::BadRecord("ipv4-mapped address stored as ipv6"));
        }
        Ok(r)
    }

    fn scope_id(&self) -> u32 {
        match (self.app, self.peer) {
            (SocketAddr::V6(a), SocketAddr::V6(p)) => {
                if a.scope_id() != 0 {
                    a.scope_id()
                } else {
                    p.scope_id()
                }
            }
            _ => 0,
        }
    }
}

/// How many bytes the peer has received: its acknowledgment `ack_b` minus `ack_b0` (mod
/// 2^32), disambiguated with the application's count of bytes sent, `sent_total`, by choosing
/// the value within 2^31 of it (RTCP section 2.3.1: "within a window of the last four
/// gigabytes"). A result above `sent_total` is [`Error::DeliveredBeyondSent`]; one below
/// zero (the peer acknowledging less than the application's SYN: the record does not belong
/// to the connection the guard knows) is [`Error::Inconsistent`].
pub fn delivered_total(ack_b0: u32, ack_b: u32, sent_total: u64) -> Result<u64> {
    let low = ack_b.wrapping_sub(ack_b0);
    let delivered = unwrap_near(low, sent_total);
    if delivered as u32 != low {
        // unwrap_near clamped a negative count to 0.
        return Err(Error::Inconsistent("peer acknowledgment precedes the application's initial sequence number"));
    }
    if delivered > sent_total {
        return Err(Error::DeliveredBeyondSent { delivered, sent: sent_total });
    }
    Ok(delivered)
}

/// IPv4-mapped IPv6 (`::ffff:a.b.c.d`) becomes IPv4; everything else is unchanged.
pub(crate) fn normalize(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => a,
        },
        v4 => v4,
    }
}

fn put_ip(b: &mut [u8], ip: IpAddr) {
    match ip {
        IpAddr::V4(v) => b[..4].copy_from_slice(&v.octets()),
        IpAddr::V6(v) => b.copy_from_slice(&v.octets()),
    }
}

/// CRC-32/ISO-HDLC (reflected, polynomial 0xEDB88320), bitwise: the record is 60 bytes.
fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= byte as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> ConnOptions {
        ConnOptions { peer_mss: 1460, peer_wscale: Some(7), app_wscale: Some(9), sack: true, timestamps: true }
    }

    fn v4() -> ConnRecord {
        ConnRecord::new("10.0.2.10:7000".parse().unwrap(), "10.0.1.2:41000".parse().unwrap(), 0xffff_fff0, 0x1234_5678, Some(opts())).unwrap()
    }

    #[test]
    fn crc_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn roundtrip_v4_v6_and_unknown_options() {
        let r = v4();
        let b = r.to_bytes();
        assert_eq!(b.len(), RECORD_LEN);
        assert_eq!(ConnRecord::from_bytes(&b).unwrap(), r);
        let r6 = ConnRecord::new("[fe80::1%3]:7000".parse().unwrap(), "[fe80::2%3]:5".parse().unwrap(), 1, 2, None).unwrap();
        let back = ConnRecord::from_bytes(&r6.to_bytes()).unwrap();
        assert_eq!(back, r6);
        match back.app() {
            SocketAddr::V6(a) => assert_eq!(a.scope_id(), 3),
            _ => panic!("family"),
        }
        let none_ws = ConnOptions { peer_mss: 0, peer_wscale: None, app_wscale: None, sack: false, timestamps: false };
        let r = ConnRecord::new("10.0.0.1:1".parse().unwrap(), "10.0.0.2:2".parse().unwrap(), 0, 0, Some(none_ws)).unwrap();
        assert_eq!(ConnRecord::from_bytes(&r.to_bytes()).unwrap().options(), Some(none_ws));
    }

    /// The layout is a stable format: pin the bytes of one record.
    #[test]
    fn layout_is_stable() {
        let b = v4().to_bytes();
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        let want = concat!(
            "55424352", "01", "04", "07", "07",
            "0a00020a000000000000000000000000",
            "0a000102000000000000000000000000",
            "1b58", "a028", "fffffff0", "12345678", "05b4", "09", "00", "00000000"
        );
        assert_eq!(&hex[..120], want);
        assert_eq!(u32::from_be_bytes(b[60..64].try_into().unwrap()), crc32(&b[..60]));
    }

    #[test]
    fn mapped_addresses_are_normalized() {
        let r = ConnRecord::new("[::ffff:10.0.0.1]:80".parse().unwrap(), "10.0.0.2:9".parse().unwrap(), 0, 0, None).unwrap();
        assert_eq!(r.app(), "10.0.0.1:80".parse().unwrap());
        assert!(ConnRecord::new("10.0.0.1:80".parse().unwrap(), "[fd00::2]:9".parse().unwrap(), 0, 0, None).is_err());
        let bad_ws = ConnOptions { peer_wscale: Some(15), ..opts() };
        assert!(ConnRecord::new("10.0.0.1:80".parse().unwrap(), "10.0.0.2:9".parse().unwrap(), 0, 0, Some(bad_ws)).is_err());
    }

    #[test]
    fn corruption_is_detected() {
        let b = v4().to_bytes();
        assert!(matches!(ConnRecord::from_bytes(&b[..63]), Err(Error::BadRecord("length"))));
        for i in 0..RECORD_LEN {
            for bit in 0..8 {
                let mut t = b;
                t[i] ^= 1 << bit;
                assert!(ConnRecord::from_bytes(&t).is_err(), "flip of byte {i} bit {bit} accepted");
            }
        }
        let mut v2 = b;
        v2[4] = 2;
        assert!(matches!(ConnRecord::from_bytes(&v2), Err(Error::BadRecord("unsupported version"))));
    }

    #[test]
    fn ack_a_wraps() {
        let r = v4();
        assert_eq!(r.ack_a(0), 0xffff_fff0);
        assert_eq!(r.ack_a(0x10), 0);
        assert_eq!(r.ack_a(0x20), 0x10);
        assert_eq!(r.ack_a((1 << 32) + 0x20), 0x10);
    }

    #[test]
    fn delivered_simple_and_bounded() {
        assert_eq!(delivered_total(1000, 1000, 0).unwrap(), 0);
        assert_eq!(delivered_total(1000, 1500, 600).unwrap(), 500);
        assert_eq!(delivered_total(1000, 1600, 600).unwrap(), 600);
        assert!(matches!(delivered_total(1000, 1601, 600), Err(Error::DeliveredBeyondSent { delivered: 601, sent: 600 })));
        // ackB before the application's ISN + 1: the record is not this connection's.
        assert!(matches!(delivered_total(1000, 999, 0), Err(Error::Inconsistent(_))));
        assert!(matches!(delivered_total(1000, 999, 10), Err(Error::Inconsistent(_))));
    }

    /// The 4 GiB wrap of delivered: 5 GiB + 10 bytes delivered out of 5 GiB + 100 sent, with
    /// ack_b0 close to the top of the sequence space.
    #[test]
    fn delivered_wraps_at_4gib() {
        let ack_b0 = 0xffff_ff00u32;
        for (delivered, sent) in [
            ((5u64 << 30) + 10, (5u64 << 30) + 100),
            (1u64 << 32, 1u64 << 32),
            ((1u64 << 32) - 1, (1u64 << 32) + 5),
            ((1u64 << 32) + 1, (1u64 << 32) + 1),
            ((1u64 << 32) + (1 << 30), (1u64 << 32) + (1 << 31) - 1),
            (0, (1u64 << 31) - 1),
            (3u64 << 32, (3u64 << 32) + (1 << 30)),
        ] {
            let ack_b = ack_b0.wrapping_add(delivered as u32);
            assert_eq!(delivered_total(ack_b0, ack_b, sent).unwrap(), delivered, "delivered {delivered} sent {sent}");
            let r = ConnRecord::new("10.0.0.1:1".parse().unwrap(), "10.0.0.2:2".parse().unwrap(), 0, ack_b0, None).unwrap();
            assert_eq!(r.delivered(ack_b, sent).unwrap(), delivered);
        }
    }
}
