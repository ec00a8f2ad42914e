//! IPv4 header view (RFC 791).

use crate::{checksum, Error, Result};

mod field {
    use core::ops::Range;
    pub const VER_IHL: usize = 0;
    pub const LENGTH: Range<usize> = 2..4;
    pub const FLG_OFF: Range<usize> = 6..8;
    pub const TTL: usize = 8;
    pub const PROTOCOL: usize = 9;
    pub const CHECKSUM: Range<usize> = 10..12;
    pub const SRC: Range<usize> = 12..16;
    pub const DST: Range<usize> = 16..20;
}

/// Minimum header length.
pub const HEADER_LEN: usize = 20;

/// A read/write view of an IPv4 packet in a buffer. [`Packet::new_checked`] validates version,
/// header length and total length once, so the accessors below cannot go out of bounds.
#[derive(Debug)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps `buffer` after checking that it holds a whole IPv4 header and the declared length.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let b = buffer.as_ref();
        if b.len() < HEADER_LEN {
            return Err(Error::Truncated);
        }
        if b[field::VER_IHL] >> 4 != 4 {
            return Err(Error::Malformed("ipv4 version"));
        }
        let hl = ((b[field::VER_IHL] & 0x0f) as usize) * 4;
        let total = u16::from_be_bytes([b[2], b[3]]) as usize;
        if hl < HEADER_LEN || hl > total {
            return Err(Error::Malformed("ipv4 header length"));
        }
        if total > b.len() {
            return Err(Error::Truncated);
        }
        Ok(Packet { buffer })
    }
    /// Header length in bytes.
    #[inline]
    pub fn header_len(&self) -> usize {
        ((self.buffer.as_ref()[field::VER_IHL] & 0x0f) as usize) * 4
    }
    /// Total length field (header + payload).
    #[inline]
    pub fn total_len(&self) -> usize {
        let b = self.buffer.as_ref();
        u16::from_be_bytes([b[field::LENGTH.start], b[field::LENGTH.start + 1]]) as usize
    }
    #[inline]
    pub fn protocol(&self) -> u8 {
        self.buffer.as_ref()[field::PROTOCOL]
    }
    #[inline]
    pub fn ttl(&self) -> u8 {
        self.buffer.as_ref()[field::TTL]
    }
    #[inline]
    pub fn src(&self) -> [u8; 4] {
        self.buffer.as_ref()[field::SRC].try_into().unwrap()
    }
    #[inline]
    pub fn dst(&self) -> [u8; 4] {
        self.buffer.as_ref()[field::DST].try_into().unwrap()
    }
    #[inline]
    pub fn checksum(&self) -> u16 {
        let b = self.buffer.as_ref();
        u16::from_be_bytes([b[field::CHECKSUM.start], b[field::CHECKSUM.start + 1]])
    }
    /// True when this is a fragment (MF set or nonzero offset): transport headers may be absent.
    #[inline]
    pub fn is_fragment(&self) -> bool {
        let b = self.buffer.as_ref();
        let v = u16::from_be_bytes([b[field::FLG_OFF.start], b[field::FLG_OFF.start + 1]]);
        v & 0x3fff != 0
    }
    /// True when the header checksum verifies.
    pub fn verify_checksum(&self) -> bool {
        checksum::fold(checksum::data(0, &self.buffer.as_ref()[..self.header_len()])) == 0xffff
    }
    /// The payload (transport segment), bounded by the total length field.
    #[inline]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[self.header_len()..self.total_len()]
    }
    /// Pseudo-header sum for the transport checksum.
    #[inline]
    pub fn pseudo_sum(&self) -> u32 {
        let len = (self.total_len() - self.header_len()) as u32;
        checksum::pseudo_v4(self.src(), self.dst(), self.protocol(), len)
    }
    pub fn into_inner(self) -> T {
        self.buffer
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    #[inline]
    pub fn set_total_len(&mut self, len: u16) {
        self.buffer.as_mut()[field::LENGTH].copy_from_slice(&len.to_be_bytes());
    }
    #[inline]
    pub fn set_src(&mut self, a: [u8; 4]) {
        self.buffer.as_mut()[field::SRC].copy_from_slice(&a);
    }
    #[inline]
    pub fn set_dst(&mut self, a: [u8; 4]) {
        self.buffer.as_mut()[field::DST].copy_from_slice(&a);
    }
    #[inline]
    pub fn set_ttl(&mut self, ttl: u8) {
        self.buffer.as_mut()[field::TTL] = ttl;
    }
    /// Recomputes the header checksum from scratch.
    pub fn fill_checksum(&mut self) {
        let hl = self.header_len();
        let b = self.buffer.as_mut();
        b[field::CHECKSUM].copy_from_slice(&[0, 0]);
        let c = checksum::finish(checksum::data(0, &b[..hl]));
        b[field::CHECKSUM].copy_from_slice(&c.to_be_bytes());
    }
    /// Mutable payload, bounded by the total length field.
    #[inline]
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let (hl, tl) = (self.header_len(), self.total_len());
        &mut self.buffer.as_mut()[hl..tl]
    }
}

/// Writes a minimal 20-byte IPv4 header (no options, DF set, TTL 64) into `buf[..20]`,
/// with a correct header checksum.
pub fn emit_header(buf: &mut [u8], src: [u8; 4], dst: [u8; 4], proto: u8, payload_len: usize) {
    let total = (HEADER_LEN + payload_len) as u16;
    buf[..HEADER_LEN].fill(0);
    buf[0] = 0x45;
    buf[2..4].copy_from_slice(&total.to_be_bytes());
    buf[6] = 0x40; // DF
    buf[8] = 64;
    buf[9] = proto;
    buf[12..16].copy_from_slice(&src);
    buf[16..20].copy_from_slice(&dst);
    let c = checksum::finish(checksum::data(0, &buf[..HEADER_LEN]));
    buf[10..12].copy_from_slice(&c.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_headers() {
        assert_eq!(Packet::new_checked(&[0x45u8; 10][..]).unwrap_err(), Error::Truncated);
        let mut b = [0u8; 20];
        b[0] = 0x65;
        assert!(Packet::new_checked(&b[..]).is_err());
        b[0] = 0x44; // IHL 4 words < 20 bytes
        b[3] = 20;
        assert!(Packet::new_checked(&b[..]).is_err());
        b[0] = 0x45;
        b[2..4].copy_from_slice(&100u16.to_be_bytes()); // claims more than the buffer
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::Truncated);
    }

    #[test]
    fn emit_then_parse() {
        let mut b = [0u8; 28];
        emit_header(&mut b, [10, 0, 0, 1], [10, 0, 0, 2], 17, 8);
        let p = Packet::new_checked(&b[..]).unwrap();
        assert!(p.verify_checksum());
        assert_eq!(p.src(), [10, 0, 0, 1]);
        assert_eq!(p.dst(), [10, 0, 0, 2]);
        assert_eq!(p.protocol(), 17);
        assert_eq!(p.payload().len(), 8);
        assert!(!p.is_fragment());
    }
}
