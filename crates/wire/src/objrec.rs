//! Object mode's store record: what the agents keep in the store for each protected connection
//! (TRODS-KV's objectID and objectISN, generalised to every response not yet acknowledged), the
//! body of the [`crate::sealed`] envelope. What the fields mean to a connection, and how a
//! recovery is planned from them, is `unbroken_engines::trods`'s; it re-exports these types.
//!
//! # Layout (all integers big endian; the same in docs/store.md)
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `UBT1` |
//! | 4 | 1 | flags: bit 0 SACK, bit 1 timestamps, bit 2 window scaling, bit 3 tombstone (`unprotected`), bit 4 `acked_off` present, bit 5 `client_fin` present |
//! | 5 | 2 | the client's MSS |
//! | 7 | 1 | the client's window scale (0 without window scaling) |
//! | 8 | 1 | the server's window scale |
//! | 9 | 4 | `iss`: the server's initial sequence number |
//! | 13 | 4 | `irs`: the client's initial sequence number |
//! | 17 | 8 | `hold_off` |
//! | 25 | 8 | `sent_off` |
//! | 33 | 8 | `acked_off` (only with flag bit 4; a record without it decodes with 0) |
//! | 41 | 8 | `client_fin` (only with flag bit 5, i.e. only in a record of a connection whose client sent its FIN; a record without it decodes with `None`) |
//! | 41 or 49 | 2 | number of entries |
//!
//! 43 bytes (51 with `client_fin`), then each [`Entry`]. A record without `client_fin` is
//! byte for byte what writers before it stored; a reader older than the field refuses one
//! with it (its bytes are not where that reader looks: a "trailing bytes" or "out of order"
//! error), so a mixed cluster refuses such a failover (a visible reset) rather than
//! resuming without knowing the client closed.
//!
//! | size | field |
//! |---|---|
//! | 8 | `req_off` |
//! | 4 | `req_len` |
//! | 8 | `resp_off` |
//! | 2 | `status` |
//! | 1 | flags: bit 0 `head`, bit 1 `close` |
//! | 8 | `body_len` |
//! | 8 | `range_start` |
//! | 4 + h | `header` (length, bytes) |
//! | 4 + o | `object_id` |
//! | 4 + e | `etag` |
//! | 4 + l | `last_modified` |
//!
//! [`Record::decode`] refuses, as an `Err` and never a panic: another magic, a window scale
//! over 14, a length field over 1 MiB, a truncated or over-long record, and entries that do not
//! follow each other (a response must start where the previous one ends, a request after the
//! previous one).

/// What was negotiated in the three-way handshake: what a rebuilt socket needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Handshake {
    /// The server's initial sequence number.
    pub iss: u32,
    /// The client's initial sequence number.
    pub irs: u32,
    pub client_mss: u16,
    /// The client's window scale; `None` when window scaling is off.
    pub client_ws: Option<u8>,
    /// The server's window scale as announced in the SYN-ACK.
    pub server_ws: u8,
    pub sack: bool,
    pub timestamps: bool,
}

/// One response of the connection (objectID + objectISN, generalised).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Entry {
    /// Client stream offset of the request (from irs+1).
    pub req_off: u64,
    pub req_len: u32,
    /// Server stream offset of the response's first byte (from iss+1): the objectISN minus
    /// the header length.
    pub resp_off: u64,
    pub status: u16,
    pub head: bool,
    /// The server closed the connection after this response.
    pub close: bool,
    pub body_len: u64,
    /// The representation byte the body starts at (206 responses).
    pub range_start: u64,
    /// The response header as sent, byte for byte.
    pub header: Vec<u8>,
    /// The request line and the headers that select the object.
    pub object_id: Vec<u8>,
    pub etag: Vec<u8>,
    pub last_modified: Vec<u8>,
}

impl Entry {
    /// Server stream offset of the objectISN (first body byte).
    pub fn body_off(&self) -> u64 {
        self.resp_off + self.header.len() as u64
    }
    /// Server stream offset just past the response.
    pub fn end_off(&self) -> u64 {
        self.body_off() + self.body_len
    }
}

/// What the store holds for one connection, inside the sealed envelope the agent adds
/// ([`crate::sealed`]; every field and its size: the [module documentation](self) and docs/store.md).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Record {
    pub hs: Handshake,
    /// Client stream offset the recovered socket expects next: the client has been told of
    /// nothing beyond it, and every request before it has been answered.
    pub hold_off: u64,
    /// Server stream offset sent when this record was written (places 32-bit ACKs).
    pub sent_off: u64,
    /// Server stream offset the client had acknowledged when this record was written (0:
    /// unknown, e.g. a record of an older version). With `sent_off` it bounds where the
    /// client's receive point can be, which a probe needs (see the agent's `probe_packet`).
    pub acked_off: u64,
    /// Responses not yet known to be fully acknowledged, in order.
    pub entries: Vec<Entry>,
    /// A tombstone: the connection stopped being protected (e.g. a chunked response). A new
    /// server that finds it resets the client at once instead of leaving it waiting.
    pub unprotected: bool,
    /// Client stream offset of the client's FIN (it closed its side, or half-closed and still
    /// reads), once the server saw it at the end of the client's stream. The record outlives
    /// that FIN until the connection no longer needs it. The FIN is acknowledged to the client
    /// only once a record naming it is stored and every response is acknowledged; a rebuilt
    /// socket expects it again (the client resends an unacknowledged FIN) and, when the FIN
    /// follows the last answered request, closes after the resumed responses.
    pub client_fin: Option<u64>,
}

/// First bytes of a record (inside the sealed envelope).
pub const MAGIC: &[u8; 4] = b"UBT1";

impl Record {
    /// Binary encoding (version 1): magic, handshake, offsets, entries.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.entries.iter().map(|e| 64 + e.header.len() + e.object_id.len()).sum::<usize>());
        b.extend_from_slice(MAGIC);
        let h = &self.hs;
        // Bit 4: `acked_off` follows `sent_off` (records without it decode with 0).
        // Bit 5: `client_fin` follows `acked_off` (only when there is one).
        let fl = (h.sack as u8) | (h.timestamps as u8) << 1 | (h.client_ws.is_some() as u8) << 2 | (self.unprotected as u8) << 3 | 1 << 4 | (self.client_fin.is_some() as u8) << 5;
        b.push(fl);
        b.extend_from_slice(&h.client_mss.to_be_bytes());
        b.push(h.client_ws.unwrap_or(0));
        b.push(h.server_ws);
        b.extend_from_slice(&h.iss.to_be_bytes());
        b.extend_from_slice(&h.irs.to_be_bytes());
        b.extend_from_slice(&self.hold_off.to_be_bytes());
        b.extend_from_slice(&self.sent_off.to_be_bytes());
        b.extend_from_slice(&self.acked_off.to_be_bytes());
        if let Some(f) = self.client_fin {
            b.extend_from_slice(&f.to_be_bytes());
        }
        b.extend_from_slice(&(self.entries.len() as u16).to_be_bytes());
        for e in &self.entries {
            b.extend_from_slice(&e.req_off.to_be_bytes());
            b.extend_from_slice(&e.req_len.to_be_bytes());
            b.extend_from_slice(&e.resp_off.to_be_bytes());
            b.extend_from_slice(&e.status.to_be_bytes());
            b.push(e.head as u8 | (e.close as u8) << 1);
            b.extend_from_slice(&e.body_len.to_be_bytes());
            b.extend_from_slice(&e.range_start.to_be_bytes());
            for f in [&e.header, &e.object_id, &e.etag, &e.last_modified] {
                b.extend_from_slice(&(f.len() as u32).to_be_bytes());
                b.extend_from_slice(f);
            }
        }
        b
    }

    /// Decodes [`Record::encode`]'s output; anything else is an error, never a panic.
    pub fn decode(b: &[u8]) -> Result<Record, &'static str> {
        let mut r = Reader { b, pos: 0 };
        if r.take(4)? != MAGIC {
            return Err("bad record magic");
        }
        let fl = r.u8()?;
        let client_mss = r.u16()?;
        let ws = r.u8()?;
        let server_ws = r.u8()?;
        if ws > 14 || server_ws > 14 {
            return Err("window scale over 14");
        }
        let hs = Handshake {
            iss: r.u32()?,
            irs: r.u32()?,
            client_mss,
            client_ws: (fl & 4 != 0).then_some(ws),
            server_ws,
            sack: fl & 1 != 0,
            timestamps: fl & 2 != 0,
        };
        let hold_off = r.u64()?;
        let sent_off = r.u64()?;
        let acked_off = if fl & 16 != 0 { r.u64()? } else { 0 };
        let client_fin = if fl & 32 != 0 { Some(r.u64()?) } else { None };
        let n = r.u16()? as usize;
        let mut entries = Vec::with_capacity(n.min(64));
        for _ in 0..n {
            let mut e = Entry {
                req_off: r.u64()?,
                req_len: r.u32()?,
                resp_off: r.u64()?,
                status: r.u16()?,
                ..Entry::default()
            };
            let f = r.u8()?;
            e.head = f & 1 != 0;
            e.close = f & 2 != 0;
            e.body_len = r.u64()?;
            e.range_start = r.u64()?;
            e.header = r.field()?;
            e.object_id = r.field()?;
            e.etag = r.field()?;
            e.last_modified = r.field()?;
            entries.push(e);
        }
        if r.pos != b.len() {
            return Err("trailing bytes in record");
        }
        for w in entries.windows(2) {
            if w[1].resp_off != w[0].end_off() || w[1].req_off < w[0].req_off + w[0].req_len as u64 {
                return Err("record entries out of order");
            }
        }
        Ok(Record {
            hs,
            hold_off,
            sent_off,
            acked_off,
            entries,
            unprotected: fl & 8 != 0,
            client_fin,
        })
    }
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len()).ok_or("truncated record")?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, &'static str> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, &'static str> {
        Ok(u16::from_be_bytes(self.take(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32, &'static str> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, &'static str> {
        Ok(u64::from_be_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn field(&mut self) -> Result<Vec<u8>, &'static str> {
        let n = self.u32()? as usize;
        if n > 1 << 20 {
            return Err("record field over 1 MiB");
        }
        Ok(self.take(n)?.to_vec())
    }
}


#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Record {
        let hs = Handshake { iss: 0x01020304, irs: 0xa0b0c0d0, client_mss: 1460, client_ws: Some(7), server_ws: 9, sack: true, timestamps: false };
        let e1 = Entry { req_off: 0, req_len: 20, resp_off: 0, status: 200, head: false, close: false, body_len: 5, range_start: 0, header: b"HTTP/1.1 200 OK\r\n\r\n".to_vec(), object_id: b"GET /a".to_vec(), etag: b"\"e\"".to_vec(), last_modified: vec![] };
        let e2 = Entry { req_off: 20, req_len: 10, resp_off: e1.end_off(), status: 206, head: true, close: true, body_len: 0, range_start: 7, header: b"H".to_vec(), object_id: b"HEAD /b".to_vec(), etag: vec![], last_modified: b"lm".to_vec() };
        Record { hs, hold_off: 30, sent_off: 0x1_0000_0001, acked_off: 3, entries: vec![e1, e2], unprotected: true, client_fin: None }
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    /// Records outlive the agent that wrote them (another server reads them after a failover,
    /// maybe of another build): pin the bytes of one (captured from the encoder before it moved
    /// to this crate).
    const GOLDEN: &str = concat!(
        "55425431", "1d", "05b4", "07", "09", "01020304", "a0b0c0d0",
        "000000000000001e", "0000000100000001", "0000000000000003", "0002",
        "0000000000000000", "00000014", "0000000000000000", "00c8", "00", "0000000000000005", "0000000000000000",
        "00000013", "485454502f312e3120323030204f4b0d0a0d0a", "00000006", "474554202f61", "00000003", "226522", "00000000",
        "0000000000000014", "0000000a", "0000000000000018", "00ce", "03", "0000000000000000", "0000000000000007",
        "00000001", "48", "00000007", "48454144202f62", "00000000", "00000002", "6c6d",
    );

    #[test]
    fn layout_is_stable() {
        assert_eq!(sample().encode(), unhex(GOLDEN));
        assert_eq!(Record::decode(&unhex(GOLDEN)), Ok(sample()));
    }

    #[test]
    fn a_record_without_acked_off_decodes_with_0() {
        // Flag bit 4 clear and no acked_off field: what an older writer stored.
        let mut b = unhex(GOLDEN);
        b[4] &= !16;
        b.drain(33..41);
        assert_eq!(Record::decode(&b), Ok(Record { acked_off: 0, ..sample() }));
    }

    #[test]
    fn client_fin_is_stored_only_when_there_is_one() {
        // Without it: the golden bytes (what writers before the field stored).
        assert_eq!(Record { client_fin: None, ..sample() }.encode(), unhex(GOLDEN));
        let r = Record { client_fin: Some(0x0102_0304_0506), ..sample() };
        let b = r.encode();
        assert_eq!(b.len(), unhex(GOLDEN).len() + 8);
        assert_eq!(b[4] & 32, 32);
        assert_eq!(&b[41..49], &0x0102_0304_0506u64.to_be_bytes());
        assert_eq!(Record::decode(&b), Ok(r));
        // A reader that does not know bit 5 (it reads the entry count at 41) refuses it.
        let mut old_view = b.clone();
        old_view[4] &= !32;
        assert!(Record::decode(&old_view).is_err());
    }

    #[test]
    fn refusals() {
        let b = sample().encode();
        for cut in 0..b.len() {
            assert!(Record::decode(&b[..cut]).is_err(), "cut at {cut}");
        }
        assert_eq!(Record::decode(&[b.as_slice(), &[0]].concat()), Err("trailing bytes in record"));
        let mut m = b.clone();
        m[0] = b'X';
        assert_eq!(Record::decode(&m), Err("bad record magic"));
        let mut ws = b.clone();
        ws[8] = 15;
        assert_eq!(Record::decode(&ws), Err("window scale over 14"));
        let mut r = sample();
        r.entries[1].resp_off += 1;
        assert_eq!(Record::decode(&r.encode()), Err("record entries out of order"));
        // The first entry's header length (43 bytes of record, 39 of fixed entry fields).
        let mut big = b.clone();
        big[82..86].copy_from_slice(&((1u32 << 20) + 1).to_be_bytes());
        assert_eq!(Record::decode(&big), Err("record field over 1 MiB"));
        for len in 0..300 {
            let junk: Vec<u8> = b"UBT1".iter().copied().chain((0..len).map(|i| (i * 37 % 251) as u8)).collect();
            let _ = Record::decode(&junk);
        }
    }
}
