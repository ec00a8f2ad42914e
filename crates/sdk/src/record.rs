//! [`ConnRecord`]: what the application persists for each protected connection (RTCP
//! section 4: "a saved copy of its checkpointed acknowledgment, and B's acknowledgment of its
//! initial sequence number from RTCP_TELL").
//!
//! # Encoding, version 1
//!
//! [`RECORD_LEN`] = 64 bytes: magic `UBCR`, version, family, options, both endpoints, `ack_a0`,
//! `ack_b0`, the peer's MSS and window scales, the IPv6 scope id and a CRC-32. The layout (a
//! table of every byte) and its encoder and decoder are the wire crate's,
//! [`unbroken_wire::ckptrec`]; this module checks a record's parts and turns the decoder's
//! refusals into [`Error::BadRecord`]. Decoding refuses any other length, magic, version,
//! checksum, family, non-zero reserved byte or window scale above 14, so a record from a newer
//! SDK or a torn write is an error, never a wrong connection.

use crate::error::{Error, Result};
use std::net::SocketAddr;
use unbroken_wire::ckptrec::{self, Repr};
use unbroken_wire::ctl::ConnOptions;
use unbroken_wire::seq::unwrap_near;

pub(crate) use unbroken_wire::ckptrec::normalize;
#[cfg(test)]
use unbroken_wire::ckptrec::crc32;

/// Length of an encoded [`ConnRecord`].
pub const RECORD_LEN: usize = ckptrec::LEN;
/// Magic at the start of an encoded [`ConnRecord`].
pub const RECORD_MAGIC: [u8; 4] = ckptrec::MAGIC;
/// Version of the encoding written by [`ConnRecord::to_bytes`].
pub const RECORD_VERSION: u8 = ckptrec::VERSION;

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

    /// The version-1 encoding ([`unbroken_wire::ckptrec`]).
    pub fn to_bytes(&self) -> [u8; RECORD_LEN] {
        Repr { app: self.app, peer: self.peer, ack_a0: self.ack_a0, ack_b0: self.ack_b0, options: self.options }.emit()
    }

    /// Decodes and checks a version-1 encoding.
    pub fn from_bytes(b: &[u8]) -> Result<ConnRecord> {
        let r = Repr::parse(b).map_err(Error::BadRecord)?;
        Ok(ConnRecord { app: r.app, peer: r.peer, ack_a0: r.ack_a0, ack_b0: r.ack_b0, options: r.options })
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
