//! Minimal netlink framing: building messages with attributes into a byte buffer and walking
//! received buffers message by message and attribute by attribute. Only what the NFQUEUE client
//! needs; no allocation beyond the caller's buffer, no panics on malformed input.
//!
//! Layout reminders (`include/uapi/linux/netlink.h`): a message is a 16-byte `nlmsghdr`
//! (`u32 len, u16 type, u16 flags, u32 seq, u32 pid`, host byte order) followed by the payload,
//! padded to 4 bytes. An attribute is a 4-byte `nlattr` (`u16 len, u16 type`, host byte order;
//! `len` counts the header but not the padding) followed by the value, padded to 4 bytes.

/// Size of `struct nlmsghdr`.
pub(crate) const NLMSG_HDRLEN: usize = 16;
/// Size of `struct nlattr`.
pub(crate) const NLA_HDRLEN: usize = 4;
/// Largest value an attribute can carry: `nla_len` is a `u16` that includes the header.
pub(crate) const NLA_MAX_PAYLOAD: usize = u16::MAX as usize - NLA_HDRLEN;

/// `nlmsg_flags`: a request to the kernel.
pub(crate) const NLM_F_REQUEST: u16 = 0x1;
/// `nlmsg_flags`: ask for an acknowledgement (an `NLMSG_ERROR` with error 0).
pub(crate) const NLM_F_ACK: u16 = 0x4;
/// `nlmsg_flags` of an `NLMSG_ERROR`: the echoed request was cut to its header.
pub(crate) const NLM_F_CAPPED: u16 = 0x100;
/// `nlmsg_flags` of an `NLMSG_ERROR`: extended-ack attributes follow.
pub(crate) const NLM_F_ACK_TLVS: u16 = 0x200;

/// Control message type of errors and acknowledgements. (Other control types below
/// `NLMSG_MIN_TYPE`, 0x10, such as `NLMSG_NOOP` and `NLMSG_DONE`, are ignored by the reader.)
pub(crate) const NLMSG_ERROR: u16 = 0x2;

/// Extended ack attribute: a NUL-terminated human-readable message.
pub(crate) const NLMSGERR_ATTR_MSG: u16 = 1;

/// Attribute type bits that are flags rather than type (`NLA_F_NESTED`, `NLA_F_NET_BYTEORDER`).
const NLA_TYPE_MASK: u16 = !(0x8000 | 0x4000);

/// Round up to the 4-byte netlink alignment.
#[inline]
pub(crate) const fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// Why a received buffer could not be walked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ParseError {
    /// Shorter than a header or than the length a header announces.
    Truncated,
    /// A length field smaller than its own header.
    BadLength,
    /// A required attribute is absent or has the wrong size.
    Missing(&'static str),
}

impl core::fmt::Display for ParseError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            ParseError::Truncated => write!(f, "truncated netlink data"),
            ParseError::BadLength => write!(f, "netlink length field smaller than its header"),
            ParseError::Missing(what) => write!(f, "missing or malformed attribute {what}"),
        }
    }
}

/// Appends one netlink message to a buffer; [`MsgWriter::finish`] patches its length.
pub(crate) struct MsgWriter<'a> {
    buf: &'a mut Vec<u8>,
    start: usize,
}

impl<'a> MsgWriter<'a> {
    /// Starts a message at the end of `buf` (which is first padded to 4 bytes).
    pub(crate) fn begin(buf: &'a mut Vec<u8>, ty: u16, flags: u16, seq: u32) -> Self {
        buf.resize(align4(buf.len()), 0);
        let start = buf.len();
        buf.extend_from_slice(&0u32.to_ne_bytes()); // length, patched by finish()
        buf.extend_from_slice(&ty.to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: 0 = the kernel fills it in
        MsgWriter { buf, start }
    }

    /// Appends raw bytes to the message payload (no padding).
    pub(crate) fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(bytes);
        self
    }

    /// Appends an attribute. `data` must not exceed [`NLA_MAX_PAYLOAD`]; callers check this
    /// (the builder truncates rather than panics if they do not).
    pub(crate) fn attr(&mut self, ty: u16, data: &[u8]) -> &mut Self {
        let data = &data[..data.len().min(NLA_MAX_PAYLOAD)];
        self.buf.resize(align4(self.buf.len()), 0);
        let len = (NLA_HDRLEN + data.len()) as u16;
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.buf.resize(align4(self.buf.len()), 0);
        self
    }

    /// Appends a big-endian `u32` attribute (the netfilter convention).
    pub(crate) fn attr_be32(&mut self, ty: u16, v: u32) -> &mut Self {
        self.attr(ty, &v.to_be_bytes())
    }

    /// Patches the length field; returns the message's total length (padded).
    pub(crate) fn finish(self) -> usize {
        self.buf.resize(align4(self.buf.len()), 0);
        let len = self.buf.len() - self.start;
        self.buf[self.start..self.start + 4].copy_from_slice(&(len as u32).to_ne_bytes());
        len
    }
}

/// One message of a received buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Msg<'a> {
    pub ty: u16,
    pub flags: u16,
    pub seq: u32,
    /// Everything after the `nlmsghdr`, up to `nlmsg_len`.
    pub payload: &'a [u8],
}

/// Iterates over the messages of a datagram; yields one `Err` and stops on malformed framing.
pub(crate) struct Msgs<'a> {
    rest: &'a [u8],
}

pub(crate) fn messages(buf: &[u8]) -> Msgs<'_> {
    Msgs { rest: buf }
}

fn ne_u16(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}

fn ne_u32(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

impl<'a> Iterator for Msgs<'a> {
    type Item = Result<Msg<'a>, ParseError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let b = self.rest;
        if b.len() < NLMSG_HDRLEN {
            self.rest = &[];
            return Some(Err(ParseError::Truncated));
        }
        let len = ne_u32(b, 0) as usize;
        if len < NLMSG_HDRLEN {
            self.rest = &[];
            return Some(Err(ParseError::BadLength));
        }
        if len > b.len() {
            self.rest = &[];
            return Some(Err(ParseError::Truncated));
        }
        let msg = Msg {
            ty: ne_u16(b, 4),
            flags: ne_u16(b, 6),
            seq: ne_u32(b, 8),
            payload: &b[NLMSG_HDRLEN..len],
        };
        self.rest = &b[align4(len).min(b.len())..];
        Some(Ok(msg))
    }
}

/// Iterates over attributes as `(type without flag bits, value)`; yields one `Err` and stops on
/// malformed framing.
pub(crate) struct Attrs<'a> {
    rest: &'a [u8],
}

pub(crate) fn attributes(buf: &[u8]) -> Attrs<'_> {
    Attrs { rest: buf }
}

impl<'a> Iterator for Attrs<'a> {
    type Item = Result<(u16, &'a [u8]), ParseError>;

    fn next(&mut self) -> Option<Self::Item> {
        // Trailing padding shorter than a header is tolerated.
        if self.rest.len() < NLA_HDRLEN {
            self.rest = &[];
            return None;
        }
        let b = self.rest;
        let len = ne_u16(b, 0) as usize;
        if len < NLA_HDRLEN {
            self.rest = &[];
            return Some(Err(ParseError::BadLength));
        }
        if len > b.len() {
            self.rest = &[];
            return Some(Err(ParseError::Truncated));
        }
        let ty = ne_u16(b, 2) & NLA_TYPE_MASK;
        let value = &b[NLA_HDRLEN..len];
        self.rest = &b[align4(len).min(b.len())..];
        Some(Ok((ty, value)))
    }
}

/// A decoded `NLMSG_ERROR` message: `error == 0` is an acknowledgement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ErrorMsg {
    /// Positive errno (the kernel sends it negated), 0 for an ack.
    pub errno: i32,
    /// Sequence number of the request this answers.
    pub request_seq: u32,
    /// Extended-ack text (`NLMSGERR_ATTR_MSG`), if the kernel gave one.
    pub text: Option<String>,
}

/// Decodes the payload of an `NLMSG_ERROR` (`struct nlmsgerr` plus optional ext-ack TLVs).
pub(crate) fn parse_error(msg: &Msg<'_>) -> Result<ErrorMsg, ParseError> {
    let p = msg.payload;
    if p.len() < 4 + NLMSG_HDRLEN {
        return Err(ParseError::Truncated);
    }
    let error = i32::from_ne_bytes([p[0], p[1], p[2], p[3]]);
    let request_seq = ne_u32(p, 4 + 8);
    let mut text = None;
    if msg.flags & NLM_F_ACK_TLVS != 0 {
        // Without NLM_F_CAPPED the whole request is echoed before the TLVs.
        let echoed = if msg.flags & NLM_F_CAPPED != 0 {
            NLMSG_HDRLEN
        } else {
            (ne_u32(p, 4) as usize).max(NLMSG_HDRLEN)
        };
        if let Some(tlvs) = p.get(4 + align4(echoed)..) {
            for (ty, value) in attributes(tlvs).flatten() {
                if ty == NLMSGERR_ATTR_MSG {
                    let s = value.split(|&c| c == 0).next().unwrap_or(&[]);
                    text = Some(String::from_utf8_lossy(s).into_owned());
                }
            }
        }
    }
    Ok(ErrorMsg {
        errno: error.saturating_neg(),
        request_seq,
        text,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_message_with_padded_attributes() {
        let mut buf = vec![];
        let mut w = MsgWriter::begin(&mut buf, 0x0302, NLM_F_REQUEST | NLM_F_ACK, 7);
        w.raw(&[0, 0, 0, 5]);
        w.attr(1, &[1, 0, 0, 0]);
        w.attr(2, &[0xaa, 0xbb, 0xcc, 0xdd, 0xee]);
        let len = w.finish();
        assert_eq!(len, 16 + 4 + 8 + 12);
        assert_eq!(buf.len(), len);
        assert_eq!(&buf[0..4], &(len as u32).to_ne_bytes());
        assert_eq!(&buf[4..6], &0x0302u16.to_ne_bytes());
        assert_eq!(&buf[6..8], &5u16.to_ne_bytes());
        assert_eq!(&buf[8..12], &7u32.to_ne_bytes());
        // The second attribute's length excludes padding, the padding is zeroed.
        assert_eq!(&buf[28..30], &9u16.to_ne_bytes());
        assert_eq!(&buf[32..40], &[0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0, 0, 0]);

        let msgs: Vec<_> = messages(&buf).collect();
        assert_eq!(msgs.len(), 1);
        let m = msgs[0].unwrap();
        assert_eq!((m.ty, m.flags, m.seq), (0x0302, 5, 7));
        let attrs: Vec<_> = attributes(&m.payload[4..]).map(Result::unwrap).collect();
        assert_eq!(
            attrs,
            vec![
                (1, &[1u8, 0, 0, 0][..]),
                (2, &[0xaa, 0xbb, 0xcc, 0xdd, 0xee][..])
            ]
        );
    }

    #[test]
    fn several_messages_in_one_buffer() {
        let mut buf = vec![];
        for seq in 0..3 {
            let mut w = MsgWriter::begin(&mut buf, 0x0301, NLM_F_REQUEST, seq);
            w.attr(1, &[seq as u8; 3]);
            w.finish();
        }
        let seqs: Vec<u32> = messages(&buf).map(|m| m.unwrap().seq).collect();
        assert_eq!(seqs, vec![0, 1, 2]);
    }

    #[test]
    fn malformed_framing_is_an_error_not_a_panic() {
        assert_eq!(
            messages(&[1, 2, 3]).next(),
            Some(Err(ParseError::Truncated))
        );
        let mut short_len = [0u8; 16];
        short_len[0] = 8;
        assert_eq!(
            messages(&short_len).next(),
            Some(Err(ParseError::BadLength))
        );
        let mut long_len = [0u8; 16];
        long_len[0] = 200;
        assert_eq!(messages(&long_len).next(), Some(Err(ParseError::Truncated)));
        assert_eq!(
            attributes(&[2, 0, 1, 0]).next(),
            Some(Err(ParseError::BadLength))
        );
        assert_eq!(
            attributes(&[9, 0, 1, 0, 1]).next(),
            Some(Err(ParseError::Truncated))
        );
        // Short trailing garbage after a valid attribute is ignored, as the kernel does.
        assert_eq!(attributes(&[4, 0, 1, 0, 0, 0]).count(), 1);
        // Every prefix of a valid buffer walks without panicking.
        let mut buf = vec![];
        let mut w = MsgWriter::begin(&mut buf, 1, 0, 0);
        w.attr(1, &[1; 10]).attr(2, &[2; 3]);
        w.finish();
        for cut in 0..buf.len() {
            for m in messages(&buf[..cut]).flatten() {
                attributes(m.payload).for_each(drop);
            }
        }
    }

    impl PartialEq for Msg<'_> {
        fn eq(&self, o: &Self) -> bool {
            (self.ty, self.flags, self.seq, self.payload) == (o.ty, o.flags, o.seq, o.payload)
        }
    }

    #[test]
    fn decodes_acks_errors_and_ext_ack_text() {
        // An ack for seq 9, capped.
        let mut buf = vec![];
        let mut w = MsgWriter::begin(&mut buf, NLMSG_ERROR, NLM_F_CAPPED, 9);
        w.raw(&0i32.to_ne_bytes());
        let mut echoed = vec![];
        MsgWriter::begin(&mut echoed, 0x0302, NLM_F_REQUEST | NLM_F_ACK, 9).finish();
        w.raw(&echoed);
        w.finish();
        let m = messages(&buf).next().unwrap().unwrap();
        assert_eq!(
            parse_error(&m).unwrap(),
            ErrorMsg {
                errno: 0,
                request_seq: 9,
                text: None
            }
        );

        // EPERM with an ext-ack message.
        let mut buf = vec![];
        let mut w = MsgWriter::begin(&mut buf, NLMSG_ERROR, NLM_F_CAPPED | NLM_F_ACK_TLVS, 3);
        w.raw(&(-libc::EPERM).to_ne_bytes());
        let mut echoed = vec![];
        MsgWriter::begin(&mut echoed, 0x0302, NLM_F_REQUEST | NLM_F_ACK, 3).finish();
        w.raw(&echoed);
        w.attr(NLMSGERR_ATTR_MSG, b"queue busy\0");
        w.finish();
        let m = messages(&buf).next().unwrap().unwrap();
        assert_eq!(
            parse_error(&m).unwrap(),
            ErrorMsg {
                errno: libc::EPERM,
                request_seq: 3,
                text: Some("queue busy".into())
            }
        );
        assert_eq!(
            parse_error(&Msg {
                ty: 2,
                flags: 0,
                seq: 0,
                payload: &[0; 8]
            }),
            Err(ParseError::Truncated)
        );
    }
}
