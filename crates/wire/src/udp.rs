//! UDP datagram view (RFC 768).

use crate::{checksum, Error, Result};

pub const HEADER_LEN: usize = 8;

#[derive(Debug)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps `buffer`, checking the length field against it.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let b = buffer.as_ref();
        if b.len() < HEADER_LEN {
            return Err(Error::Truncated);
        }
        let l = u16::from_be_bytes([b[4], b[5]]) as usize;
        if l < HEADER_LEN {
            return Err(Error::Malformed("udp length"));
        }
        if l > b.len() {
            return Err(Error::Truncated);
        }
        Ok(Packet { buffer })
    }
    #[inline]
    pub fn src_port(&self) -> u16 {
        let b = self.buffer.as_ref();
        u16::from_be_bytes([b[0], b[1]])
    }
    #[inline]
    pub fn dst_port(&self) -> u16 {
        let b = self.buffer.as_ref();
        u16::from_be_bytes([b[2], b[3]])
    }
    #[inline]
    pub fn len(&self) -> usize {
        let b = self.buffer.as_ref();
        u16::from_be_bytes([b[4], b[5]]) as usize
    }
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == HEADER_LEN
    }
    #[inline]
    pub fn checksum(&self) -> u16 {
        let b = self.buffer.as_ref();
        u16::from_be_bytes([b[6], b[7]])
    }
    #[inline]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..self.len()]
    }
    /// Verifies the checksum; a zero checksum means "none" over IPv4 and passes.
    pub fn verify_checksum(&self, pseudo: u32) -> bool {
        self.checksum() == 0
            || checksum::fold(checksum::data(pseudo, &self.buffer.as_ref()[..self.len()])) == 0xffff
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Recomputes the checksum (a computed 0 is sent as 0xffff, RFC 768).
    pub fn fill_checksum(&mut self, pseudo: u32) {
        let l = self.len();
        let b = self.buffer.as_mut();
        b[6..8].copy_from_slice(&[0, 0]);
        let mut c = checksum::finish(checksum::data(pseudo, &b[..l]));
        if c == 0 {
            c = 0xffff;
        }
        b[6..8].copy_from_slice(&c.to_be_bytes());
    }
    #[inline]
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let l = self.len();
        &mut self.buffer.as_mut()[HEADER_LEN..l]
    }
}

/// Writes a UDP header for `payload_len` bytes of payload (checksum zero).
pub fn emit_header(buf: &mut [u8], src_port: u16, dst_port: u16, payload_len: usize) {
    buf[0..2].copy_from_slice(&src_port.to_be_bytes());
    buf[2..4].copy_from_slice(&dst_port.to_be_bytes());
    buf[4..6].copy_from_slice(&((HEADER_LEN + payload_len) as u16).to_be_bytes());
    buf[6..8].copy_from_slice(&[0, 0]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emit_fill_verify() {
        let mut b = [0u8; 12];
        emit_header(&mut b, 5000, 53, 4);
        b[8..].copy_from_slice(b"abcd");
        let pseudo = checksum::pseudo_v4([127, 0, 0, 1], [127, 0, 0, 1], 17, 12);
        let mut p = Packet::new_checked(&mut b[..]).unwrap();
        p.fill_checksum(pseudo);
        assert!(p.verify_checksum(pseudo));
        assert_eq!(p.payload(), b"abcd");
        p.payload_mut()[0] = b'z';
        assert!(!p.verify_checksum(pseudo));
        assert!(Packet::new_checked(&b[..7]).is_err());
        let mut short = [0u8; 8];
        short[5] = 4;
        assert!(Packet::new_checked(&short[..]).is_err());
    }
}
