//! Version-independent access to an IP packet carrying TCP or UDP: addresses, the transport
//! segment and its pseudo-header, and in-place changes that keep the IP header consistent.

use crate::{ipv4, ipv6, Error, Result};
use std::net::IpAddr;

pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;

/// IP version of a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V4,
    V6,
}

/// Parsed location of the transport segment inside an IP packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpInfo {
    pub version: Version,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub protocol: u8,
    /// Offset of the transport header from the start of the packet.
    pub l4_offset: usize,
    /// Length of the transport segment (header + payload) per the IP header.
    pub l4_len: usize,
}

impl IpInfo {
    /// Parses the IP header of `pkt`. Fragments and IPv6 extension headers are reported as
    /// `Unsupported` (the guard passes them through untouched and counts them).
    pub fn parse(pkt: &[u8]) -> Result<IpInfo> {
        match pkt.first().map(|b| b >> 4) {
            Some(4) => {
                let p = ipv4::Packet::new_checked(pkt)?;
                if p.is_fragment() {
                    return Err(Error::Unsupported("ipv4 fragment"));
                }
                Ok(IpInfo {
                    version: Version::V4,
                    src: IpAddr::from(p.src()),
                    dst: IpAddr::from(p.dst()),
                    protocol: p.protocol(),
                    l4_offset: p.header_len(),
                    l4_len: p.total_len() - p.header_len(),
                })
            }
            Some(6) => {
                let p = ipv6::Packet::new_checked(pkt)?;
                let nh = p.next_header();
                if nh != PROTO_TCP && nh != PROTO_UDP {
                    return Err(Error::Unsupported("ipv6 extension header"));
                }
                Ok(IpInfo {
                    version: Version::V6,
                    src: IpAddr::from(p.src()),
                    dst: IpAddr::from(p.dst()),
                    protocol: nh,
                    l4_offset: ipv6::HEADER_LEN,
                    l4_len: p.payload_len(),
                })
            }
            Some(_) => Err(Error::Malformed("ip version")),
            None => Err(Error::Truncated),
        }
    }

    /// Pseudo-header sum for a transport segment of `l4_len` bytes between these addresses.
    pub fn pseudo_sum(&self, l4_len: usize) -> u32 {
        pseudo_sum(self.src, self.dst, self.protocol, l4_len)
    }
}

/// Pseudo-header sum for any address pair of the same family.
pub fn pseudo_sum(src: IpAddr, dst: IpAddr, proto: u8, l4_len: usize) -> u32 {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => crate::checksum::pseudo_v4(s.octets(), d.octets(), proto, l4_len as u32),
        (IpAddr::V6(s), IpAddr::V6(d)) => crate::checksum::pseudo_v6(s.octets(), d.octets(), proto, l4_len as u32),
        _ => 0,
    }
}

/// Writes an IP header for `src -> dst` carrying `l4_len` bytes of protocol `proto` at the
/// start of `buf`; returns the header length. Both addresses must be of the same family.
pub fn emit_header(buf: &mut [u8], src: IpAddr, dst: IpAddr, proto: u8, l4_len: usize) -> Result<usize> {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            if buf.len() < ipv4::HEADER_LEN + l4_len || ipv4::HEADER_LEN + l4_len > 0xffff {
                return Err(Error::Truncated);
            }
            ipv4::emit_header(buf, s.octets(), d.octets(), proto, l4_len);
            Ok(ipv4::HEADER_LEN)
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            if buf.len() < ipv6::HEADER_LEN + l4_len || l4_len > 0xffff {
                return Err(Error::Truncated);
            }
            ipv6::emit_header(buf, s.octets(), d.octets(), proto, l4_len);
            Ok(ipv6::HEADER_LEN)
        }
        _ => Err(Error::Malformed("mixed address families")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A super-packet split as the kernel segments it: every piece a valid segment, the pieces'
    /// payloads the whole in order, the flags and lengths right; both families.
    #[test]
    fn split_tcp_cuts_a_super_packet_into_wire_segments() {
        use crate::tcp::{flags as F, Packet, Repr};
        use crate::Seq;
        for (src, dst) in [("10.0.0.1", "10.0.0.2"), ("fd00::1", "fd00::2")] {
            let (src, dst): (IpAddr, IpAddr) = (src.parse().unwrap(), dst.parse().unwrap());
            let payload: Vec<u8> = (0..10_000u32).map(|x| (x * 7) as u8).collect();
            let r = Repr { src_port: 6379, dst_port: 40000, seq: Seq(u32::MAX - 3000), ack: Seq(5), flags: F::ACK | F::PSH | F::FIN | F::CWR, window: 300, timestamp: Some((7, 8)), ..Default::default() };
            let big = tcp_packet(src, dst, &r, &payload).unwrap();
            let parts = split_tcp(&big, 1448).unwrap();
            assert_eq!(parts.len(), 7);
            let mut got = vec![];
            for (i, p) in parts.iter().enumerate() {
                let info = IpInfo::parse(p).unwrap();
                assert_eq!(info.l4_offset + info.l4_len, p.len(), "lengths");
                let t = Packet::new_checked(&p[info.l4_offset..]).unwrap();
                assert!(t.verify_checksum(info.pseudo_sum(info.l4_len)), "checksum of part {i}");
                let rr = Repr::parse(&t).unwrap();
                assert_eq!(rr.seq, r.seq + (i * 1448) as u32);
                assert_eq!((rr.ack, rr.window, rr.timestamp), (r.ack, r.window, r.timestamp));
                let last = i + 1 == parts.len();
                assert_eq!(rr.flags & (F::FIN | F::PSH) != 0, last, "FIN/PSH only on the last");
                assert_eq!(rr.flags & F::CWR != 0, i == 0, "CWR only on the first");
                assert!(t.payload().len() <= 1448);
                if info.version == Version::V4 {
                    let h = ipv4::Packet::new_checked(&p[..]).unwrap();
                    assert!(h.verify_checksum());
                    assert_eq!(u16::from_be_bytes([p[4], p[5]]), u16::from_be_bytes([big[4], big[5]]).wrapping_add(i as u16));
                }
                got.extend_from_slice(t.payload());
            }
            assert_eq!(got, payload);
            // One that fits comes back whole; not TCP, or no room for payload, is an error.
            let small = tcp_packet(src, dst, &r, &payload[..100]).unwrap();
            assert_eq!(split_tcp(&small, 1448).unwrap(), vec![small.clone()]);
            assert!(split_tcp(&big, 0).is_err());
        }
        let mut b = [0u8; 28];
        let n = emit_header(&mut b, "10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap(), PROTO_UDP, 8).unwrap();
        assert!(split_tcp(&b[..n + 8], 1448).is_err());
    }

    #[test]
    fn parse_both_versions() {
        let mut b = [0u8; 60];
        let n = emit_header(&mut b, "10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap(), PROTO_TCP, 20).unwrap();
        let i = IpInfo::parse(&b[..n + 20]).unwrap();
        assert_eq!((i.version, i.l4_offset, i.l4_len, i.protocol), (Version::V4, 20, 20, PROTO_TCP));
        let n = emit_header(&mut b, "fd00::1".parse().unwrap(), "fd00::2".parse().unwrap(), PROTO_UDP, 8).unwrap();
        let i = IpInfo::parse(&b[..n + 8]).unwrap();
        assert_eq!((i.version, i.l4_offset, i.l4_len), (Version::V6, 40, 8));
        assert!(IpInfo::parse(&[]).is_err());
        assert!(IpInfo::parse(&[0x10]).is_err());
        assert!(emit_header(&mut b, "10.0.0.1".parse().unwrap(), "fd00::2".parse().unwrap(), 6, 0).is_err());
    }

    #[test]
    fn fragments_are_unsupported() {
        let mut b = [0u8; 40];
        ipv4::emit_header(&mut b, [1, 1, 1, 1], [2, 2, 2, 2], PROTO_TCP, 20);
        b[6] = 0x20; // MF
        assert_eq!(IpInfo::parse(&b).unwrap_err(), Error::Unsupported("ipv4 fragment"));
    }
}

/// A complete IP packet (IPv4 or IPv6, by the addresses) carrying the TCP header `r` and
/// `payload`, with both checksums filled in: what injected ACKs, probes and tests send.
pub fn tcp_packet(src: IpAddr, dst: IpAddr, r: &crate::tcp::Repr, payload: &[u8]) -> Result<Vec<u8>> {
    let tl = r.header_len() + payload.len();
    let mut buf = vec![0u8; ipv6::HEADER_LEN + tl];
    let hl = emit_header(&mut buf, src, dst, PROTO_TCP, tl)?;
    r.emit(&mut buf[hl..])?;
    buf[hl + r.header_len()..hl + tl].copy_from_slice(payload);
    crate::tcp::Packet::new_checked(&mut buf[hl..hl + tl])?.fill_checksum(pseudo_sum(src, dst, PROTO_TCP, tl));
    buf.truncate(hl + tl);
    Ok(buf)
}

/// Splits a TCP segment whose payload exceeds `max_payload` bytes (a GSO super-packet the kernel
/// handed over whole) into wire segments of at most that much payload each, as the kernel's
/// segmentation would: the IP and TCP headers (options included) copied, the sequence number
/// advanced, FIN and PSH on the last segment only, CWR on the first only, IPv4 identification
/// counted up, lengths and checksums computed. A segment that fits comes back as it is.
pub fn split_tcp(pkt: &[u8], max_payload: usize) -> Result<Vec<Vec<u8>>> {
    let info = IpInfo::parse(pkt)?;
    if info.protocol != PROTO_TCP {
        return Err(Error::Malformed("not TCP"));
    }
    let t = crate::tcp::Packet::new_checked(&pkt[info.l4_offset..info.l4_offset + info.l4_len])?;
    let hdr = info.l4_offset + t.header_len();
    let payload = &pkt[hdr..info.l4_offset + info.l4_len];
    if payload.len() <= max_payload {
        return Ok(vec![pkt[..info.l4_offset + info.l4_len].to_vec()]);
    }
    if max_payload == 0 {
        return Err(Error::Malformed("a maximum payload of 0"));
    }
    let seq = t.seq();
    let flags = pkt[info.l4_offset + 13];
    let n = payload.len().div_ceil(max_payload);
    let mut out = Vec::with_capacity(n);
    for (i, chunk) in payload.chunks(max_payload).enumerate() {
        let mut b = Vec::with_capacity(hdr + chunk.len());
        b.extend_from_slice(&pkt[..hdr]);
        b.extend_from_slice(chunk);
        let mut f = flags;
        if i + 1 < n {
            f &= !(crate::tcp::flags::FIN | crate::tcp::flags::PSH);
        }
        if i > 0 {
            f &= !crate::tcp::flags::CWR;
        }
        b[info.l4_offset + 13] = f;
        let s = seq + (i * max_payload) as u32;
        b[info.l4_offset + 4..info.l4_offset + 8].copy_from_slice(&s.0.to_be_bytes());
        let len = b.len();
        match info.version {
            Version::V4 => {
                let id = u16::from_be_bytes([b[4], b[5]]).wrapping_add(i as u16);
                b[4..6].copy_from_slice(&id.to_be_bytes());
                b[2..4].copy_from_slice(&(len as u16).to_be_bytes());
                ipv4::Packet::new_checked(&mut b[..])?.fill_checksum();
            }
            Version::V6 => {
                b[4..6].copy_from_slice(&((len - ipv6::HEADER_LEN) as u16).to_be_bytes());
            }
        }
        if !fill_tcp_checksum(&mut b, len) {
            return Err(Error::Malformed("TCP checksum"));
        }
        out.push(b);
    }
    Ok(out)
}

/// Recomputes the TCP checksum of the IP packet in `buf[..len]` from scratch (needed after
/// rewriting a packet the kernel handed over with a partial checksum, e.g. GSO); false if it
/// is not TCP or is too short.
pub fn fill_tcp_checksum(buf: &mut [u8], len: usize) -> bool {
    let Ok(info) = IpInfo::parse(&buf[..len]) else { return false };
    if info.protocol != PROTO_TCP {
        return false;
    }
    let pseudo = info.pseudo_sum(info.l4_len);
    match crate::tcp::Packet::new_checked(&mut buf[info.l4_offset..info.l4_offset + info.l4_len]) {
        Ok(mut t) => {
            t.fill_checksum(pseudo);
            true
        }
        Err(_) => false,
    }
}
