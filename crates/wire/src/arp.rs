//! ARP over Ethernet for IPv4 (RFC 826), and the Ethernet frame that carries it: the gratuitous
//! ARP a replica backup sends when it takes the service address over (RFC 5227 section 3 calls
//! the request form an "ARP Announcement").
//!
//! ```text
//! frame:  dst MAC (6) | src MAC (6) | ethertype 0x0806 (2) | ARP (28) | zero padding to 60
//! ARP:    htype 1 (2) | ptype 0x0800 (2) | hlen 6 | plen 4 | oper (2)
//!         | sender MAC (6) | sender IPv4 (4) | target MAC (6) | target IPv4 (4)
//! ```
//!
//! Only Ethernet/IPv4 ARP is handled; any other hardware or protocol type is `Unsupported`.

use crate::{Error, Result};
use std::net::Ipv4Addr;

/// Length of the Ethernet/IPv4 ARP body.
pub const PACKET_LEN: usize = 28;
/// Length of an Ethernet header (no VLAN tag).
pub const ETH_HEADER_LEN: usize = 14;
/// The minimum Ethernet frame without its FCS: shorter frames are padded with zeros, since some
/// NICs and switches drop runts instead of padding them.
pub const MIN_FRAME_LEN: usize = 60;
/// EtherType of ARP.
pub const ETHERTYPE_ARP: u16 = 0x0806;
/// The Ethernet broadcast address.
pub const BROADCAST: [u8; 6] = [0xff; 6];

mod field {
    use core::ops::Range;
    pub const HTYPE: Range<usize> = 0..2;
    pub const PTYPE: Range<usize> = 2..4;
    pub const HLEN: usize = 4;
    pub const PLEN: usize = 5;
    pub const OPER: Range<usize> = 6..8;
    pub const SHA: Range<usize> = 8..14;
    pub const SPA: Range<usize> = 14..18;
    pub const THA: Range<usize> = 18..24;
    pub const TPA: Range<usize> = 24..28;
}

/// ARP operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    Request,
    Reply,
}

impl Operation {
    fn code(self) -> u16 {
        match self {
            Operation::Request => 1,
            Operation::Reply => 2,
        }
    }
}

/// A view of an Ethernet/IPv4 ARP body (the 28 bytes after the Ethernet header).
#[derive(Debug)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps `buffer` (at least [`PACKET_LEN`] bytes; more is padding and ignored) and checks the
    /// hardware and protocol types and lengths.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let b = buffer.as_ref();
        if b.len() < PACKET_LEN {
            return Err(Error::Truncated);
        }
        let p = Packet { buffer };
        if p.htype() != 1 || p.ptype() != 0x0800 {
            return Err(Error::Unsupported("arp: not ethernet/ipv4"));
        }
        if p.hlen() != 6 || p.plen() != 4 {
            return Err(Error::Malformed("arp: address lengths"));
        }
        Ok(p)
    }
    /// Hardware type (1: Ethernet).
    #[inline]
    pub fn htype(&self) -> u16 {
        let b = self.buffer.as_ref();
        u16::from_be_bytes([b[field::HTYPE.start], b[field::HTYPE.start + 1]])
    }
    /// Protocol type (0x0800: IPv4).
    #[inline]
    pub fn ptype(&self) -> u16 {
        let b = self.buffer.as_ref();
        u16::from_be_bytes([b[field::PTYPE.start], b[field::PTYPE.start + 1]])
    }
    /// Hardware address length.
    #[inline]
    pub fn hlen(&self) -> u8 {
        self.buffer.as_ref()[field::HLEN]
    }
    /// Protocol address length.
    #[inline]
    pub fn plen(&self) -> u8 {
        self.buffer.as_ref()[field::PLEN]
    }
    /// Operation code (1 request, 2 reply).
    #[inline]
    pub fn oper(&self) -> u16 {
        let b = self.buffer.as_ref();
        u16::from_be_bytes([b[field::OPER.start], b[field::OPER.start + 1]])
    }
    /// Sender hardware address.
    #[inline]
    pub fn sender_mac(&self) -> [u8; 6] {
        self.buffer.as_ref()[field::SHA]
            .try_into()
            .expect("6 bytes")
    }
    /// Sender protocol address.
    #[inline]
    pub fn sender_ip(&self) -> Ipv4Addr {
        let a: [u8; 4] = self.buffer.as_ref()[field::SPA]
            .try_into()
            .expect("4 bytes");
        Ipv4Addr::from(a)
    }
    /// Target hardware address.
    #[inline]
    pub fn target_mac(&self) -> [u8; 6] {
        self.buffer.as_ref()[field::THA]
            .try_into()
            .expect("6 bytes")
    }
    /// Target protocol address.
    #[inline]
    pub fn target_ip(&self) -> Ipv4Addr {
        let a: [u8; 4] = self.buffer.as_ref()[field::TPA]
            .try_into()
            .expect("4 bytes");
        Ipv4Addr::from(a)
    }
}

/// A parsed Ethernet/IPv4 ARP body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Repr {
    pub operation: Operation,
    pub sender_mac: [u8; 6],
    pub sender_ip: Ipv4Addr,
    pub target_mac: [u8; 6],
    pub target_ip: Ipv4Addr,
}

impl Repr {
    /// Reads a checked view; an operation other than request or reply is `Unsupported`.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr> {
        let operation = match p.oper() {
            1 => Operation::Request,
            2 => Operation::Reply,
            _ => return Err(Error::Unsupported("arp: operation")),
        };
        Ok(Repr {
            operation,
            sender_mac: p.sender_mac(),
            sender_ip: p.sender_ip(),
            target_mac: p.target_mac(),
            target_ip: p.target_ip(),
        })
    }

    /// Writes the 28-byte body into the start of `buf`; `Truncated` when it is shorter.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        let b = buf.get_mut(..PACKET_LEN).ok_or(Error::Truncated)?;
        b[field::HTYPE].copy_from_slice(&1u16.to_be_bytes());
        b[field::PTYPE].copy_from_slice(&0x0800u16.to_be_bytes());
        b[field::HLEN] = 6;
        b[field::PLEN] = 4;
        b[field::OPER].copy_from_slice(&self.operation.code().to_be_bytes());
        b[field::SHA].copy_from_slice(&self.sender_mac);
        b[field::SPA].copy_from_slice(&self.sender_ip.octets());
        b[field::THA].copy_from_slice(&self.target_mac);
        b[field::TPA].copy_from_slice(&self.target_ip.octets());
        Ok(())
    }

    /// A gratuitous ARP for `ip` at `mac` (sender = target = `ip`). The request form (RFC 5227's
    /// announcement, what `arping -U` sends) has a zero target MAC; the reply form names `mac`
    /// as the target MAC too, which Linux requires before it treats a reply as gratuitous
    /// (`arp_is_garp`: a gratuitous ARP overrides the neighbour entry's lock time).
    pub fn gratuitous(operation: Operation, mac: [u8; 6], ip: Ipv4Addr) -> Repr {
        Repr {
            operation,
            sender_mac: mac,
            sender_ip: ip,
            target_mac: match operation {
                Operation::Request => [0; 6],
                Operation::Reply => mac,
            },
            target_ip: ip,
        }
    }

    /// The whole Ethernet frame carrying this ARP body from `src_mac` to `dst_mac`, padded with
    /// zeros to [`MIN_FRAME_LEN`].
    pub fn to_frame(&self, dst_mac: [u8; 6], src_mac: [u8; 6]) -> [u8; MIN_FRAME_LEN] {
        let mut f = [0u8; MIN_FRAME_LEN];
        f[0..6].copy_from_slice(&dst_mac);
        f[6..12].copy_from_slice(&src_mac);
        f[12..14].copy_from_slice(&ETHERTYPE_ARP.to_be_bytes());
        self.emit(&mut f[ETH_HEADER_LEN..])
            .expect("frame has room for the body");
        f
    }

    /// Parses an Ethernet frame carrying ARP: (destination MAC, source MAC, body).
    pub fn from_frame(frame: &[u8]) -> Result<([u8; 6], [u8; 6], Repr)> {
        if frame.len() < ETH_HEADER_LEN {
            return Err(Error::Truncated);
        }
        if u16::from_be_bytes([frame[12], frame[13]]) != ETHERTYPE_ARP {
            return Err(Error::Unsupported("ethertype: not arp"));
        }
        let dst = frame[0..6].try_into().expect("6 bytes");
        let src = frame[6..12].try_into().expect("6 bytes");
        let repr = Repr::parse(&Packet::new_checked(&frame[ETH_HEADER_LEN..])?)?;
        Ok((dst, src, repr))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: [u8; 6] = [0x02, 0x00, 0x5e, 0x10, 0x20, 0x30];
    const IP: Ipv4Addr = Ipv4Addr::new(10, 77, 3, 10);

    #[test]
    fn gratuitous_request_frame_bytes() {
        let f = Repr::gratuitous(Operation::Request, MAC, IP).to_frame(BROADCAST, MAC);
        #[rustfmt::skip]
        let want: [u8; 42] = [
            0xff, 0xff, 0xff, 0xff, 0xff, 0xff,   // dst: broadcast
            0x02, 0x00, 0x5e, 0x10, 0x20, 0x30,   // src
            0x08, 0x06,                           // ARP
            0x00, 0x01, 0x08, 0x00, 6, 4,         // Ethernet, IPv4
            0x00, 0x01,                           // request
            0x02, 0x00, 0x5e, 0x10, 0x20, 0x30,   // sender MAC
            10, 77, 3, 10,                        // sender IP
            0, 0, 0, 0, 0, 0,                     // target MAC: unknown
            10, 77, 3, 10,                        // target IP = sender IP
        ];
        assert_eq!(f[..42], want);
        assert_eq!(f[42..], [0u8; 18], "zero padding to 60 bytes");
    }

    #[test]
    fn gratuitous_reply_names_itself_as_target() {
        let f = Repr::gratuitous(Operation::Reply, MAC, IP).to_frame(BROADCAST, MAC);
        assert_eq!(f[20..22], [0x00, 0x02], "reply");
        assert_eq!(f[22..28], MAC);
        assert_eq!(
            f[32..38],
            MAC,
            "target MAC = sender MAC (Linux arp_is_garp)"
        );
        assert_eq!(f[28..32], f[38..42], "target IP = sender IP");
    }

    #[test]
    fn frame_round_trip() {
        for op in [Operation::Request, Operation::Reply] {
            let r = Repr::gratuitous(op, MAC, IP);
            let f = r.to_frame(BROADCAST, MAC);
            assert_eq!(Repr::from_frame(&f), Ok((BROADCAST, MAC, r)));
            // Without padding too (veth does not pad what it receives).
            assert_eq!(Repr::from_frame(&f[..42]), Ok((BROADCAST, MAC, r)));
        }
    }

    #[test]
    fn hostile_arp() {
        let good = Repr::gratuitous(Operation::Request, MAC, IP).to_frame(BROADCAST, MAC);
        for n in 0..42 {
            assert_eq!(
                Repr::from_frame(&good[..n]).unwrap_err(),
                Error::Truncated,
                "length {n}"
            );
        }
        let bad = |i: usize, v: u8| {
            let mut f = good;
            f[i] = v;
            Repr::from_frame(&f).unwrap_err()
        };
        assert_eq!(bad(13, 0x00), Error::Unsupported("ethertype: not arp"));
        assert_eq!(bad(15, 6), Error::Unsupported("arp: not ethernet/ipv4")); // htype 6 (IEEE 802)
        assert_eq!(bad(16, 0x86), Error::Unsupported("arp: not ethernet/ipv4")); // IPv6
        assert_eq!(bad(18, 8), Error::Malformed("arp: address lengths"));
        assert_eq!(bad(19, 16), Error::Malformed("arp: address lengths"));
        assert_eq!(bad(21, 3), Error::Unsupported("arp: operation")); // RARP request
        let mut short = [0u8; 27];
        assert_eq!(
            Repr::gratuitous(Operation::Reply, MAC, IP).emit(&mut short),
            Err(Error::Truncated)
        );
    }
}
