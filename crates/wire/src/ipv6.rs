//! IPv6 fixed header view (RFC 8200). Extension headers are not walked: a packet whose next
//! header is not the transport protocol itself is reported as such and left to the caller.

use crate::{checksum, Error, Result};

pub const HEADER_LEN: usize = 40;

#[derive(Debug)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps `buffer` after checking version and that the payload length fits.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let b = buffer.as_ref();
        if b.len() < HEADER_LEN {
            return Err(Error::Truncated);
        }
        if b[0] >> 4 != 6 {
            return Err(Error::Malformed("ipv6 version"));
        }
        let plen = u16::from_be_bytes([b[4], b[5]]) as usize;
        if HEADER_LEN + plen > b.len() {
            return Err(Error::Truncated);
        }
        Ok(Packet { buffer })
    }
    #[inline]
    pub fn payload_len(&self) -> usize {
        let b = self.buffer.as_ref();
        u16::from_be_bytes([b[4], b[5]]) as usize
    }
    #[inline]
    pub fn next_header(&self) -> u8 {
        self.buffer.as_ref()[6]
    }
    #[inline]
    pub fn hop_limit(&self) -> u8 {
        self.buffer.as_ref()[7]
    }
    #[inline]
    pub fn src(&self) -> [u8; 16] {
        self.buffer.as_ref()[8..24].try_into().unwrap()
    }
    #[inline]
    pub fn dst(&self) -> [u8; 16] {
        self.buffer.as_ref()[24..40].try_into().unwrap()
    }
    #[inline]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..HEADER_LEN + self.payload_len()]
    }
    #[inline]
    pub fn pseudo_sum(&self) -> u32 {
        checksum::pseudo_v6(self.src(), self.dst(), self.next_header(), self.payload_len() as u32)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    #[inline]
    pub fn set_payload_len(&mut self, len: u16) {
        self.buffer.as_mut()[4..6].copy_from_slice(&len.to_be_bytes());
    }
    #[inline]
    pub fn set_src(&mut self, a: [u8; 16]) {
        self.buffer.as_mut()[8..24].copy_from_slice(&a);
    }
    #[inline]
    pub fn set_dst(&mut self, a: [u8; 16]) {
        self.buffer.as_mut()[24..40].copy_from_slice(&a);
    }
    #[inline]
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let n = self.payload_len();
        &mut self.buffer.as_mut()[HEADER_LEN..HEADER_LEN + n]
    }
}

/// Writes a 40-byte IPv6 header (hop limit 64, no flow label) into `buf[..40]`.
pub fn emit_header(buf: &mut [u8], src: [u8; 16], dst: [u8; 16], next: u8, payload_len: usize) {
    buf[..HEADER_LEN].fill(0);
    buf[0] = 0x60;
    buf[4..6].copy_from_slice(&(payload_len as u16).to_be_bytes());
    buf[6] = next;
    buf[7] = 64;
    buf[8..24].copy_from_slice(&src);
    buf[24..40].copy_from_slice(&dst);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emit_then_parse_and_reject() {
        let mut b = [0u8; 48];
        let s = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        let d = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
        emit_header(&mut b, s, d, 6, 8);
        let p = Packet::new_checked(&b[..]).unwrap();
        assert_eq!((p.src(), p.dst(), p.next_header(), p.payload().len()), (s, d, 6, 8));
        assert_eq!(Packet::new_checked(&b[..44]).unwrap_err(), Error::Truncated);
        b[0] = 0x40;
        assert!(Packet::new_checked(&b[..]).is_err());
    }
}
