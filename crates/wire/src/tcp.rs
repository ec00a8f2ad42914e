//! TCP segment view (RFC 9293) with the options RTCP-style middleboxes must understand:
//! MSS, window scale and timestamps (RFC 7323), SACK-permitted and SACK (RFC 2018).

use crate::seq::Seq;
use crate::{checksum, Error, Result};

mod field {
    use core::ops::Range;
    pub const SRC_PORT: Range<usize> = 0..2;
    pub const DST_PORT: Range<usize> = 2..4;
    pub const SEQ: Range<usize> = 4..8;
    pub const ACK: Range<usize> = 8..12;
    pub const OFF: usize = 12;
    pub const FLAGS: usize = 13;
    pub const WINDOW: Range<usize> = 14..16;
    pub const CHECKSUM: Range<usize> = 16..18;
    pub const URGENT: Range<usize> = 18..20;
}

pub const HEADER_LEN: usize = 20;
/// Largest header (data offset 15 words).
pub const MAX_HEADER_LEN: usize = 60;

/// TCP flag bits (byte 13).
pub mod flags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const PSH: u8 = 0x08;
    pub const ACK: u8 = 0x10;
    pub const URG: u8 = 0x20;
    pub const ECE: u8 = 0x40;
    pub const CWR: u8 = 0x80;
}

/// Option kinds.
pub mod kind {
    pub const EOL: u8 = 0;
    pub const NOP: u8 = 1;
    pub const MSS: u8 = 2;
    pub const WSCALE: u8 = 3;
    pub const SACK_PERM: u8 = 4;
    pub const SACK: u8 = 5;
    pub const TIMESTAMP: u8 = 8;
}

/// One parsed TCP option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcpOption<'a> {
    EndOfList,
    NoOp,
    Mss(u16),
    WindowScale(u8),
    SackPermitted,
    /// Up to four (left, right) edges.
    Sack([(Seq, Seq); 4], u8),
    Timestamp { tsval: u32, tsecr: u32 },
    Unknown { kind: u8, data: &'a [u8] },
}

/// Position of one option inside the header: byte offset from the start of the TCP header,
/// its kind and total length (1 for EOL/NOP).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionSlot {
    pub offset: usize,
    pub kind: u8,
    pub len: usize,
}

/// Walks the option area, validating lengths. Stops at EOL (reported once).
pub struct OptionSlots<'a> {
    opts: &'a [u8],
    pos: usize,
    done: bool,
}

impl<'a> Iterator for OptionSlots<'a> {
    type Item = Result<OptionSlot>;
    fn next(&mut self) -> Option<Self::Item> {
        if self.done || self.pos >= self.opts.len() {
            return None;
        }
        let k = self.opts[self.pos];
        let offset = HEADER_LEN + self.pos;
        let len = match k {
            kind::EOL => {
                self.done = true;
                1
            }
            kind::NOP => 1,
            _ => {
                if self.pos + 1 >= self.opts.len() {
                    self.done = true;
                    return Some(Err(Error::Malformed("tcp option length missing")));
                }
                let l = self.opts[self.pos + 1] as usize;
                if l < 2 || self.pos + l > self.opts.len() {
                    self.done = true;
                    return Some(Err(Error::Malformed("tcp option length")));
                }
                l
            }
        };
        self.pos += len;
        Some(Ok(OptionSlot { offset, kind: k, len }))
    }
}

/// Decodes one option from the bytes of its slot.
pub fn parse_option(bytes: &[u8]) -> Result<TcpOption<'_>> {
    let k = bytes[0];
    Ok(match (k, bytes.len()) {
        (kind::EOL, _) => TcpOption::EndOfList,
        (kind::NOP, _) => TcpOption::NoOp,
        (kind::MSS, 4) => TcpOption::Mss(u16::from_be_bytes([bytes[2], bytes[3]])),
        (kind::WSCALE, 3) => TcpOption::WindowScale(bytes[2]),
        (kind::SACK_PERM, 2) => TcpOption::SackPermitted,
        (kind::SACK, l) if l >= 10 && (l - 2) % 8 == 0 && l <= 34 => {
            let n = (l - 2) / 8;
            let mut blocks = [(Seq(0), Seq(0)); 4];
            for (i, b) in blocks.iter_mut().enumerate().take(n) {
                let o = 2 + i * 8;
                b.0 = Seq(u32::from_be_bytes(bytes[o..o + 4].try_into().unwrap()));
                b.1 = Seq(u32::from_be_bytes(bytes[o + 4..o + 8].try_into().unwrap()));
            }
            TcpOption::Sack(blocks, n as u8)
        }
        (kind::TIMESTAMP, 10) => TcpOption::Timestamp {
            tsval: u32::from_be_bytes(bytes[2..6].try_into().unwrap()),
            tsecr: u32::from_be_bytes(bytes[6..10].try_into().unwrap()),
        },
        (kind::MSS | kind::WSCALE | kind::SACK_PERM | kind::SACK | kind::TIMESTAMP, _) => {
            return Err(Error::Malformed("tcp option size for its kind"))
        }
        (k, _) => TcpOption::Unknown { kind: k, data: &bytes[2..] },
    })
}

/// A read/write view of a TCP segment (header and payload). [`Packet::new_checked`] checks the
/// data offset against the buffer once.
#[derive(Debug)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

macro_rules! be16 {
    ($b:expr, $r:expr) => {
        u16::from_be_bytes([$b[$r.start], $b[$r.start + 1]])
    };
}
macro_rules! be32 {
    ($b:expr, $r:expr) => {
        u32::from_be_bytes([$b[$r.start], $b[$r.start + 1], $b[$r.start + 2], $b[$r.start + 3]])
    };
}

impl<T: AsRef<[u8]>> Packet<T> {
    pub fn new_checked(buffer: T) -> Result<Self> {
        let b = buffer.as_ref();
        if b.len() < HEADER_LEN {
            return Err(Error::Truncated);
        }
        let hl = ((b[field::OFF] >> 4) as usize) * 4;
        if hl < HEADER_LEN {
            return Err(Error::Malformed("tcp data offset"));
        }
        if hl > b.len() {
            return Err(Error::Truncated);
        }
        Ok(Packet { buffer })
    }
    #[inline]
    pub fn src_port(&self) -> u16 {
        be16!(self.buffer.as_ref(), field::SRC_PORT)
    }
    #[inline]
    pub fn dst_port(&self) -> u16 {
        be16!(self.buffer.as_ref(), field::DST_PORT)
    }
    #[inline]
    pub fn seq(&self) -> Seq {
        Seq(be32!(self.buffer.as_ref(), field::SEQ))
    }
    #[inline]
    pub fn ack(&self) -> Seq {
        Seq(be32!(self.buffer.as_ref(), field::ACK))
    }
    #[inline]
    pub fn header_len(&self) -> usize {
        ((self.buffer.as_ref()[field::OFF] >> 4) as usize) * 4
    }
    #[inline]
    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS]
    }
    #[inline]
    pub fn has(&self, f: u8) -> bool {
        self.flags() & f == f
    }
    #[inline]
    pub fn window(&self) -> u16 {
        be16!(self.buffer.as_ref(), field::WINDOW)
    }
    #[inline]
    pub fn checksum(&self) -> u16 {
        be16!(self.buffer.as_ref(), field::CHECKSUM)
    }
    #[inline]
    pub fn urgent(&self) -> u16 {
        be16!(self.buffer.as_ref(), field::URGENT)
    }
    /// The option area (between the fixed header and the data).
    #[inline]
    pub fn options(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..self.header_len()]
    }
    #[inline]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[self.header_len()..]
    }
    /// Sequence space the segment occupies: payload plus one for each of SYN and FIN.
    #[inline]
    pub fn seq_len(&self) -> u32 {
        let f = self.flags();
        self.payload().len() as u32 + (f & flags::SYN != 0) as u32 + (f & flags::FIN != 0) as u32
    }
    /// Iterates over option slots (positions), validating lengths.
    pub fn option_slots(&self) -> OptionSlots<'_> {
        OptionSlots { opts: self.options(), pos: 0, done: false }
    }
    /// Iterates over decoded options; the first malformed one ends the walk with an error.
    pub fn options_iter(&self) -> impl Iterator<Item = Result<TcpOption<'_>>> {
        let b = self.buffer.as_ref();
        self.option_slots()
            .map(move |s| s.and_then(|s| parse_option(&b[s.offset..s.offset + s.len])))
    }
    /// Verifies the checksum given the IP pseudo-header sum.
    pub fn verify_checksum(&self, pseudo: u32) -> bool {
        checksum::fold(checksum::data(pseudo, self.buffer.as_ref())) == 0xffff
    }
    pub fn into_inner(self) -> T {
        self.buffer
    }
    pub fn as_bytes(&self) -> &[u8] {
        self.buffer.as_ref()
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    #[inline]
    fn put16(&mut self, r: core::ops::Range<usize>, v: u16) {
        self.buffer.as_mut()[r].copy_from_slice(&v.to_be_bytes());
    }
    #[inline]
    fn put32(&mut self, r: core::ops::Range<usize>, v: u32) {
        self.buffer.as_mut()[r].copy_from_slice(&v.to_be_bytes());
    }
    #[inline]
    pub fn set_checksum(&mut self, c: u16) {
        self.put16(field::CHECKSUM, c)
    }
    #[inline]
    pub fn set_src_port(&mut self, p: u16) {
        self.put16(field::SRC_PORT, p)
    }
    #[inline]
    pub fn set_dst_port(&mut self, p: u16) {
        self.put16(field::DST_PORT, p)
    }
    #[inline]
    pub fn set_seq(&mut self, s: Seq) {
        self.put32(field::SEQ, s.0)
    }
    #[inline]
    pub fn set_ack(&mut self, s: Seq) {
        self.put32(field::ACK, s.0)
    }
    #[inline]
    pub fn set_window(&mut self, w: u16) {
        self.put16(field::WINDOW, w)
    }
    #[inline]
    pub fn set_flags(&mut self, f: u8) {
        self.buffer.as_mut()[field::FLAGS] = f;
    }
    #[inline]
    pub fn set_urgent(&mut self, u: u16) {
        self.put16(field::URGENT, u)
    }
    /// Sets the data offset (header length in bytes, a multiple of 4 in 20..=60).
    #[inline]
    pub fn set_header_len(&mut self, len: usize) {
        debug_assert!(len % 4 == 0 && (HEADER_LEN..=MAX_HEADER_LEN).contains(&len));
        let b = self.buffer.as_mut();
        b[field::OFF] = ((len / 4) as u8) << 4 | (b[field::OFF] & 0x0f);
    }

    // --- rewrites that keep the checksum right (RFC 1624) ---

    /// Rewrites SEQ, updating the checksum incrementally.
    #[inline]
    pub fn rewrite_seq(&mut self, s: Seq) {
        let (old, c) = (self.seq().0, self.checksum());
        self.set_seq(s);
        self.set_checksum(checksum::update_u32(c, old, s.0));
    }
    /// Rewrites ACK, updating the checksum incrementally.
    #[inline]
    pub fn rewrite_ack(&mut self, s: Seq) {
        let (old, c) = (self.ack().0, self.checksum());
        self.set_ack(s);
        self.set_checksum(checksum::update_u32(c, old, s.0));
    }
    /// Rewrites the window field, updating the checksum incrementally.
    #[inline]
    pub fn rewrite_window(&mut self, w: u16) {
        let (old, c) = (self.window(), self.checksum());
        self.set_window(w);
        self.set_checksum(checksum::update_u16(c, old, w));
    }
    /// Rewrites a 32-bit word at byte `offset` of the header (any alignment), keeping the
    /// checksum right. Used for option fields such as SACK edges and timestamps.
    pub fn rewrite_u32_at(&mut self, offset: usize, v: u32) {
        let c = self.checksum();
        // Work on the 16-bit-aligned span covering the word so RFC 1624 applies.
        let start = offset & !1;
        let end = (offset + 4 + 1) & !1;
        let mut old = [0u8; 6];
        let span = end - start;
        old[..span].copy_from_slice(&self.buffer.as_ref()[start..end]);
        self.buffer.as_mut()[offset..offset + 4].copy_from_slice(&v.to_be_bytes());
        let new = &self.buffer.as_ref()[start..end];
        let c2 = checksum::update_bytes(c, &old[..span], new);
        self.set_checksum(c2);
    }
    /// Overwrites the option in `slot` with NOPs, keeping the checksum right.
    pub fn nop_option(&mut self, slot: OptionSlot) {
        let c = self.checksum();
        let start = slot.offset & !1;
        let end = (slot.offset + slot.len + 1) & !1;
        let old_sum = checksum::fold(checksum::data(0, &self.buffer.as_ref()[start..end]));
        self.buffer.as_mut()[slot.offset..slot.offset + slot.len].fill(kind::NOP);
        let new_sum = checksum::fold(checksum::data(0, &self.buffer.as_ref()[start..end]));
        self.set_checksum(checksum::update_u16(c, old_sum, new_sum));
    }
    /// Recomputes the checksum from scratch given the pseudo-header sum.
    pub fn fill_checksum(&mut self, pseudo: u32) {
        self.set_checksum(0);
        let c = checksum::finish(checksum::data(pseudo, self.buffer.as_ref()));
        self.set_checksum(c);
    }
    #[inline]
    pub fn options_mut(&mut self) -> &mut [u8] {
        let hl = self.header_len();
        &mut self.buffer.as_mut()[HEADER_LEN..hl]
    }
}

/// A high-level representation of a TCP header, for building segments (tests, synthesized
/// answers). Options are emitted in Linux's order, padded with NOPs to a multiple of 4.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Repr {
    pub src_port: u16,
    pub dst_port: u16,
    pub seq: Seq,
    pub ack: Seq,
    pub flags: u8,
    pub window: u16,
    pub mss: Option<u16>,
    pub wscale: Option<u8>,
    pub sack_perm: bool,
    pub timestamp: Option<(u32, u32)>,
    pub sack: [(Seq, Seq); 4],
    pub sack_len: u8,
}

impl Repr {
    /// Parses the fixed header and the known options; unknown options are skipped.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr> {
        let mut r = Repr {
            src_port: p.src_port(),
            dst_port: p.dst_port(),
            seq: p.seq(),
            ack: p.ack(),
            flags: p.flags(),
            window: p.window(),
            ..Default::default()
        };
        for o in p.options_iter() {
            match o? {
                TcpOption::Mss(m) => r.mss = Some(m),
                TcpOption::WindowScale(s) => r.wscale = Some(s),
                TcpOption::SackPermitted => r.sack_perm = true,
                TcpOption::Timestamp { tsval, tsecr } => r.timestamp = Some((tsval, tsecr)),
                TcpOption::Sack(b, n) => {
                    r.sack = b;
                    r.sack_len = n
                }
                _ => {}
            }
        }
        Ok(r)
    }
    /// Bytes the options take once padded.
    pub fn options_len(&self) -> usize {
        let mut n = 0;
        if self.mss.is_some() {
            n += 4;
        }
        if self.sack_perm && self.timestamp.is_some() {
            n += 12; // SACK_PERM + TS packed as in Linux: 2 + 10
        } else {
            if self.sack_perm {
                n += 4;
            }
            if self.timestamp.is_some() {
                n += 12;
            }
        }
        if self.wscale.is_some() {
            n += 4;
        }
        if self.sack_len > 0 {
            n += 4 + 8 * self.sack_len as usize;
        }
        n
    }
    pub fn header_len(&self) -> usize {
        HEADER_LEN + self.options_len()
    }
    /// Writes the header into `buf[..self.header_len()]` with checksum zero; the caller fills
    /// it in once the payload is in place ([`Packet::fill_checksum`]).
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let hl = self.header_len();
        if hl > MAX_HEADER_LEN {
            return Err(Error::Malformed("tcp options exceed 40 bytes"));
        }
        if buf.len() < hl {
            return Err(Error::Truncated);
        }
        buf[..hl].fill(0);
        buf[0..2].copy_from_slice(&self.src_port.to_be_bytes());
        buf[2..4].copy_from_slice(&self.dst_port.to_be_bytes());
        buf[4..8].copy_from_slice(&self.seq.0.to_be_bytes());
        buf[8..12].copy_from_slice(&self.ack.0.to_be_bytes());
        buf[12] = ((hl / 4) as u8) << 4;
        buf[13] = self.flags;
        buf[14..16].copy_from_slice(&self.window.to_be_bytes());
        let mut o = HEADER_LEN;
        if let Some(m) = self.mss {
            buf[o..o + 4].copy_from_slice(&[kind::MSS, 4, (m >> 8) as u8, m as u8]);
            o += 4;
        }
        match (self.sack_perm, self.timestamp) {
            (true, Some(_)) => {
                buf[o..o + 2].copy_from_slice(&[kind::SACK_PERM, 2]);
                o += 2;
            }
            (true, None) => {
                buf[o..o + 4].copy_from_slice(&[kind::NOP, kind::NOP, kind::SACK_PERM, 2]);
                o += 4;
            }
            (false, Some(_)) => {
                buf[o..o + 2].copy_from_slice(&[kind::NOP, kind::NOP]);
                o += 2;
            }
            (false, None) => {}
        }
        if let Some((v, e)) = self.timestamp {
            buf[o] = kind::TIMESTAMP;
            buf[o + 1] = 10;
            buf[o + 2..o + 6].copy_from_slice(&v.to_be_bytes());
            buf[o + 6..o + 10].copy_from_slice(&e.to_be_bytes());
            o += 10;
        }
        if let Some(s) = self.wscale {
            buf[o..o + 4].copy_from_slice(&[kind::NOP, kind::WSCALE, 3, s]);
            o += 4;
        }
        if self.sack_len > 0 {
            let n = self.sack_len as usize;
            buf[o..o + 4].copy_from_slice(&[kind::NOP, kind::NOP, kind::SACK, (2 + 8 * n) as u8]);
            o += 4;
            for &(l, r) in &self.sack[..n] {
                buf[o..o + 4].copy_from_slice(&l.0.to_be_bytes());
                buf[o + 4..o + 8].copy_from_slice(&r.0.to_be_bytes());
                o += 8;
            }
        }
        debug_assert_eq!(o, hl);
        Ok(hl)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SYN laid out the way Linux builds one (MSS 1460, SACK_PERM, TS, NOP, WS 7); the
    /// checksum field is filled in by the tests. Kernel-captured vectors live in tests/.
    pub(crate) const LINUX_SYN: [u8; 40] = [
        0xb2, 0x6e, 0x1b, 0x58, 0x8c, 0x1c, 0x2f, 0x84, 0x00, 0x00, 0x00, 0x00, 0xa0, 0x02, 0xfa,
        0xf0, 0x14, 0x2f, 0x00, 0x00, 0x02, 0x04, 0x05, 0xb4, 0x04, 0x02, 0x08, 0x0a, 0x5b, 0x1e,
        0x8e, 0x51, 0x00, 0x00, 0x00, 0x00, 0x01, 0x03, 0x03, 0x07,
    ];

    #[test]
    fn parse_linux_syn_options() {
        let p = Packet::new_checked(&LINUX_SYN[..]).unwrap();
        assert!(p.has(flags::SYN) && !p.has(flags::ACK));
        let r = Repr::parse(&p).unwrap();
        assert_eq!(r.mss, Some(1460));
        assert_eq!(r.wscale, Some(7));
        assert!(r.sack_perm);
        assert_eq!(r.timestamp, Some((0x5b1e8e51, 0)));
        assert_eq!(p.seq_len(), 1);
    }

    #[test]
    fn malformed_options_are_errors_not_panics() {
        let mut b = LINUX_SYN;
        b[21] = 0; // MSS length 0
        let p = Packet::new_checked(&b[..]).unwrap();
        assert!(p.options_iter().any(|o| o.is_err()));
        let mut b = LINUX_SYN;
        b[21] = 30; // runs past the option area
        let p = Packet::new_checked(&b[..]).unwrap();
        assert!(Repr::parse(&p).is_err());
        let mut b = LINUX_SYN;
        b[38] = 4; // WS with length 4: wrong size for its kind
        b[39] = 0;
        let p = Packet::new_checked(&b[..]).unwrap();
        assert!(Repr::parse(&p).is_err());
        let mut b = [0u8; 20];
        b[12] = 0x40; // data offset 16 bytes
        assert!(Packet::new_checked(&b[..]).is_err());
        b[12] = 0xf0; // 60 bytes, buffer only 20
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::Truncated);
    }

    #[test]
    fn repr_roundtrip_all_options() {
        let r = Repr {
            src_port: 1,
            dst_port: 2,
            seq: Seq(u32::MAX),
            ack: Seq(7),
            flags: flags::ACK,
            window: 512,
            mss: None,
            wscale: None,
            sack_perm: false,
            timestamp: Some((1, 2)),
            sack: [(Seq(10), Seq(20)), (Seq(30), Seq(40)), (Seq(0), Seq(0)), (Seq(0), Seq(0))],
            sack_len: 2,
        };
        let mut buf = [0u8; 60];
        let n = r.emit(&mut buf).unwrap();
        let p = Packet::new_checked(&buf[..n]).unwrap();
        assert_eq!(Repr::parse(&p).unwrap(), r);
        let syn = Repr { flags: flags::SYN, mss: Some(1460), wscale: Some(7), sack_perm: true, timestamp: Some((5, 0)), ..Default::default() };
        let n = syn.emit(&mut buf).unwrap();
        assert_eq!(n, 40);
        assert_eq!(Repr::parse(&Packet::new_checked(&buf[..n]).unwrap()).unwrap(), syn);
    }

    #[test]
    fn rewrites_keep_checksum_valid() {
        let pseudo = checksum::pseudo_v4([10, 0, 0, 1], [10, 0, 0, 2], 6, 40);
        let mut b = LINUX_SYN;
        let mut p = Packet::new_checked(&mut b[..]).unwrap();
        p.fill_checksum(pseudo);
        assert!(p.verify_checksum(pseudo));
        p.rewrite_seq(Seq(0xdead_beef));
        p.rewrite_ack(Seq(0x0000_0001));
        p.rewrite_window(1);
        assert!(p.verify_checksum(pseudo));
        // TS value sits at offset 30: an odd-aligned-within-option, even-in-header word.
        p.rewrite_u32_at(30, 0x1234_5678);
        assert!(p.verify_checksum(pseudo));
        // And an odd offset.
        p.rewrite_u32_at(21, 0x0a0b_0c0d);
        assert!(p.verify_checksum(pseudo));
        let slot = p.option_slots().next().unwrap().unwrap();
        p.nop_option(slot);
        assert!(p.verify_checksum(pseudo));
    }
}
