//! Checkpoint mode's connection record: what an application persists for each protected
//! connection (RTCP section 4: "a saved copy of its checkpointed acknowledgment, and B's
//! acknowledgment of its initial sequence number from RTCP_TELL"). The SDK's `ConnRecord`
//! (`unbroken_sdk::ConnRecord`, and `ub_record` of its C ABI) checks a record's parts and
//! encodes it with [`Repr::emit`]; applications store the 64 bytes as they are.
//!
//! # Encoding, version 1
//!
//! [`LEN`] = 64 bytes, integers big-endian:
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
//! When options are unknown (bit 0 clear), bytes 6, 7, 52-54 are 0. [`Repr::parse`] refuses
//! any other length, magic, version, checksum, family, non-zero reserved byte or window scale
//! above 14, and an IPv4-mapped address stored as IPv6, so a record from a newer SDK or a torn
//! write is an error, never a wrong connection. Later versions keep bytes 0..6 and grow or
//! change the rest.

use crate::ctl::ConnOptions;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

/// Length of an encoded record.
pub const LEN: usize = 64;
/// Magic at the start of an encoded record.
pub const MAGIC: [u8; 4] = *b"UBCR";
/// Version of the encoding written by [`Repr::emit`].
pub const VERSION: u8 = 1;

const OPT_KNOWN: u8 = 1;
const OPT_SACK: u8 = 2;
const OPT_TS: u8 = 4;
const WS_NONE: u8 = 255;

/// Byte ranges of the fields.
pub mod field {
    /// A range of bytes.
    pub type Field = core::ops::Range<usize>;
    /// `"UBCR"`.
    pub const MAGIC: Field = 0..4;
    /// The version.
    pub const VERSION: usize = 4;
    /// The address family (4 or 6).
    pub const FAMILY: usize = 5;
    /// Option bits.
    pub const OPTIONS: usize = 6;
    /// The peer's window scale.
    pub const PEER_WSCALE: usize = 7;
    /// The application's address.
    pub const APP_ADDR: Field = 8..24;
    /// The peer's address.
    pub const PEER_ADDR: Field = 24..40;
    /// The application's port.
    pub const APP_PORT: Field = 40..42;
    /// The peer's port.
    pub const PEER_PORT: Field = 42..44;
    /// The checkpointed ack right after the handshake.
    pub const ACK_A0: Field = 44..48;
    /// The peer's ack covering the application's ISN.
    pub const ACK_B0: Field = 48..52;
    /// The peer's MSS.
    pub const PEER_MSS: Field = 52..54;
    /// The application's window scale.
    pub const APP_WSCALE: usize = 54;
    /// Reserved, 0.
    pub const RESERVED: usize = 55;
    /// The IPv6 scope id.
    pub const SCOPE: Field = 56..60;
    /// CRC-32 of everything before it.
    pub const CRC: Field = 60..64;
}

/// A record's contents. [`Repr::emit`] writes what it holds; the SDK's `ConnRecord::new` is
/// where the parts are checked (same family, one scope, window scales up to 14, IPv4-mapped
/// addresses made IPv4), and [`Repr::parse`] accepts only what such a record encodes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// The application's (local) endpoint.
    pub app: SocketAddr,
    /// The peer's endpoint.
    pub peer: SocketAddr,
    /// The peer's ISN + 1.
    pub ack_a0: u32,
    /// The application's ISN + 1.
    pub ack_b0: u32,
    /// The options negotiated in the handshake, if known.
    pub options: Option<ConnOptions>,
}

impl Repr {
    /// The version-1 encoding (see the [module documentation](self)).
    pub fn emit(&self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[field::MAGIC].copy_from_slice(&MAGIC);
        b[field::VERSION] = VERSION;
        b[field::FAMILY] = if self.app.is_ipv4() { 4 } else { 6 };
        if let Some(o) = self.options {
            b[field::OPTIONS] = OPT_KNOWN | if o.sack { OPT_SACK } else { 0 } | if o.timestamps { OPT_TS } else { 0 };
            b[field::PEER_WSCALE] = o.peer_wscale.unwrap_or(WS_NONE);
            b[field::PEER_MSS].copy_from_slice(&o.peer_mss.to_be_bytes());
            b[field::APP_WSCALE] = o.app_wscale.unwrap_or(WS_NONE);
        }
        put_ip(&mut b[field::APP_ADDR], self.app.ip());
        put_ip(&mut b[field::PEER_ADDR], self.peer.ip());
        b[field::APP_PORT].copy_from_slice(&self.app.port().to_be_bytes());
        b[field::PEER_PORT].copy_from_slice(&self.peer.port().to_be_bytes());
        b[field::ACK_A0].copy_from_slice(&self.ack_a0.to_be_bytes());
        b[field::ACK_B0].copy_from_slice(&self.ack_b0.to_be_bytes());
        b[field::SCOPE].copy_from_slice(&self.scope_id().to_be_bytes());
        let crc = crc32(&b[..field::CRC.start]);
        b[field::CRC].copy_from_slice(&crc.to_be_bytes());
        b
    }

    /// Decodes and checks a version-1 encoding; the error names what is wrong ("length",
    /// "magic", "unsupported version", "checksum", ...).
    pub fn parse(b: &[u8]) -> Result<Repr, &'static str> {
        if b.len() != LEN {
            return Err("length");
        }
        if b[field::MAGIC] != MAGIC {
            return Err("magic");
        }
        if b[field::VERSION] != VERSION {
            return Err("unsupported version");
        }
        if crc32(&b[..field::CRC.start]).to_be_bytes() != b[field::CRC] {
            return Err("checksum");
        }
        if b[field::RESERVED] != 0 {
            return Err("reserved byte");
        }
        let u16at = |f: field::Field| u16::from_be_bytes([b[f.start], b[f.start + 1]]);
        let u32at = |f: field::Field| u32::from_be_bytes([b[f.start], b[f.start + 1], b[f.start + 2], b[f.start + 3]]);
        let addr16 = |f: field::Field| {
            let mut a = [0u8; 16];
            a.copy_from_slice(&b[f]);
            a
        };
        let scope = u32at(field::SCOPE);
        let (app_ip, peer_ip) = match b[field::FAMILY] {
            4 => {
                if scope != 0 || b[12..24].iter().chain(&b[28..40]).any(|&x| x != 0) {
                    return Err("ipv4 padding");
                }
                (IpAddr::V4(Ipv4Addr::new(b[8], b[9], b[10], b[11])), IpAddr::V4(Ipv4Addr::new(b[24], b[25], b[26], b[27])))
            }
            6 => (IpAddr::V6(Ipv6Addr::from(addr16(field::APP_ADDR))), IpAddr::V6(Ipv6Addr::from(addr16(field::PEER_ADDR)))),
            _ => return Err("address family"),
        };
        let sock = |ip: IpAddr, port: u16| match ip {
            IpAddr::V6(v6) => SocketAddr::V6(SocketAddrV6::new(v6, port, 0, scope)),
            v4 => SocketAddr::new(v4, port),
        };
        let opt = b[field::OPTIONS];
        let options = if opt & OPT_KNOWN != 0 {
            if opt & !(OPT_KNOWN | OPT_SACK | OPT_TS) != 0 {
                return Err("option bits");
            }
            let ws = |v: u8| match v {
                WS_NONE => Ok(None),
                0..=14 => Ok(Some(v)),
                _ => Err("window scale above 14"),
            };
            Some(ConnOptions {
                peer_mss: u16at(field::PEER_MSS),
                peer_wscale: ws(b[field::PEER_WSCALE])?,
                app_wscale: ws(b[field::APP_WSCALE])?,
                sack: opt & OPT_SACK != 0,
                timestamps: opt & OPT_TS != 0,
            })
        } else {
            if opt != 0 || b[field::PEER_WSCALE] != 0 || b[52..55].iter().any(|&x| x != 0) {
                return Err("options without the known bit");
            }
            None
        };
        let r = Repr {
            app: sock(app_ip, u16at(field::APP_PORT)),
            peer: sock(peer_ip, u16at(field::PEER_PORT)),
            ack_a0: u32at(field::ACK_A0),
            ack_b0: u32at(field::ACK_B0),
            options,
        };
        if normalize(r.app) != r.app || normalize(r.peer) != r.peer {
            return Err("ipv4-mapped address stored as ipv6");
        }
        Ok(r)
    }

    /// The scope id both addresses share (the application's, else the peer's).
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

/// IPv4-mapped IPv6 (`::ffff:a.b.c.d`) becomes IPv4; everything else is unchanged. Records
/// hold addresses this way, because that is what the guard sees on the wire.
pub fn normalize(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => a,
        },
        v4 => v4,
    }
}

/// `b` is 16 bytes: an IPv4 address fills the first 4.
fn put_ip(b: &mut [u8], ip: IpAddr) {
    match ip {
        IpAddr::V4(v) => b[..4].copy_from_slice(&v.octets()),
        IpAddr::V6(v) => b.copy_from_slice(&v.octets()),
    }
}

/// CRC-32/ISO-HDLC (reflected, polynomial 0xEDB88320; zlib's `crc32`), bitwise: the record is
/// 60 bytes.
pub fn crc32(data: &[u8]) -> u32 {
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

    fn v4() -> Repr {
        let o = ConnOptions { peer_mss: 1460, peer_wscale: Some(7), app_wscale: Some(9), sack: true, timestamps: true };
        Repr { app: "10.0.2.10:7000".parse().unwrap(), peer: "10.0.1.2:41000".parse().unwrap(), ack_a0: 0xffff_fff0, ack_b0: 0x1234_5678, options: Some(o) }
    }

    #[test]
    fn crc_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    /// The same vector as the SDK's `layout_is_stable`: the layout is a stable format.
    #[test]
    fn layout_is_stable() {
        let b = v4().emit();
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        let want = concat!(
            "55424352", "01", "04", "07", "07",
            "0a00020a000000000000000000000000",
            "0a000102000000000000000000000000",
            "1b58", "a028", "fffffff0", "12345678", "05b4", "09", "00", "00000000"
        );
        assert_eq!(&hex[..120], want);
        assert_eq!(u32::from_be_bytes(b[60..64].try_into().unwrap()), crc32(&b[..60]));
        assert_eq!(Repr::parse(&b), Ok(v4()));
    }

    #[test]
    fn roundtrip_v6_with_scope_and_no_options() {
        let r = Repr { app: "[fe80::1%3]:7000".parse().unwrap(), peer: "[fe80::2%3]:5".parse().unwrap(), ack_a0: 1, ack_b0: 2, options: None };
        assert_eq!(Repr::parse(&r.emit()), Ok(r));
    }

    #[test]
    fn refusals_name_the_field() {
        let b = v4().emit();
        assert_eq!(Repr::parse(&b[..63]), Err("length"));
        let reseal = |mut t: [u8; LEN]| {
            let crc = crc32(&t[..60]);
            t[60..].copy_from_slice(&crc.to_be_bytes());
            t
        };
        let mut t = b;
        t[4] = 2;
        assert_eq!(Repr::parse(&t), Err("unsupported version"));
        let mut t = b;
        t[0] = b'X';
        assert_eq!(Repr::parse(&t), Err("magic"));
        let mut t = b;
        t[59] ^= 1;
        assert_eq!(Repr::parse(&t), Err("checksum"));
        let mut t = b;
        t[55] = 1;
        assert_eq!(Repr::parse(&reseal(t)), Err("reserved byte"));
        let mut t = b;
        t[5] = 5;
        assert_eq!(Repr::parse(&reseal(t)), Err("address family"));
        let mut t = b;
        t[7] = 15;
        assert_eq!(Repr::parse(&reseal(t)), Err("window scale above 14"));
        let mapped = Repr { app: "[::ffff:10.0.0.1]:1".parse().unwrap(), peer: "[::ffff:10.0.0.2]:2".parse().unwrap(), ..v4() };
        assert_eq!(Repr::parse(&mapped.emit()), Err("ipv4-mapped address stored as ipv6"));
        for i in 0..LEN {
            for bit in 0..8 {
                let mut t = b;
                t[i] ^= 1 << bit;
                assert!(Repr::parse(&t).is_err(), "flip of byte {i} bit {bit} accepted");
            }
        }
    }
}
