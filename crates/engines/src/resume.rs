//! Resuming one interrupted response from the recovering server's local HTTP server (TRODS
//! section 3.2, case ③), sans-I/O: the request the agent sends and the check of the local
//! server's answer before a single body byte reaches the client.
//!
//! Issue 9 items 7 and 8:
//! - the objectID and the validator come from the store: they are checked again
//!   ([`http::check_object_id`], [`http::check_validator`]) before they are written to the
//!   local server, so a record can never inject a header line;
//! - a 200 or 206 body resumes only under a validator ([`http::if_range`]), sent as
//!   `If-Range` with the `Range`: the local server answers 206 only if the object is the one
//!   the old server was sending; a 200 (it changed), or a 206 with another validator,
//!   length or range, is a [`Mismatch`] and not one byte of it is sent.

use crate::http::{self, Response, Unresumable};
use crate::trods::Entry;

/// What the local server's answer must be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    /// A Range request (200 and 206 responses) or the whole response again (skip `skip`).
    pub ranged: bool,
    pub status: u16,
    /// Body bytes the local server must announce.
    pub body_len: u64,
    /// For a ranged request: the first representation byte asked for.
    pub range_start: u64,
    /// The representation's length, when the old response said it.
    pub total: Option<u64>,
    pub etag: Vec<u8>,
    pub last_modified: Vec<u8>,
    /// Body bytes of the local answer to discard before sending (unranged only).
    pub skip: u64,
    /// Body bytes to send to the client.
    pub send: u64,
}

/// The local server's answer does not continue the old response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    /// The object changed: a 200 to the `If-Range` request, or another validator.
    Changed(String),
    /// Any other difference (status, length, range, unparsable answer).
    Other(String),
}

/// Builds the request that fetches the body of `e` from body byte `body_from` on.
pub fn request(e: &Entry, body_from: u64) -> Result<(Vec<u8>, Expected), Unresumable> {
    http::check_object_id(&e.object_id)?;
    if body_from >= e.body_len {
        return Err(Unresumable("nothing to resume"));
    }
    let old = http::parse_response(&e.header, e.head)?;
    let mut req = Vec::with_capacity(e.object_id.len() + 128);
    req.extend_from_slice(&e.object_id);
    let ranged = matches!(e.status, 200 | 206);
    let x = if ranged {
        let v = http::if_range(&old.etag, &old.last_modified, &old.date).ok_or(http::NO_VALIDATOR)?;
        http::check_validator(v)?;
        let first = e.range_start.checked_add(body_from).ok_or(Unresumable("range overflow"))?;
        let last = e.range_start.checked_add(e.body_len - 1).ok_or(Unresumable("range overflow"))?;
        req.extend_from_slice(format!("Range: bytes={first}-{last}\r\nIf-Range: ").as_bytes());
        req.extend_from_slice(v);
        req.extend_from_slice(b"\r\n");
        Expected {
            ranged,
            status: 206,
            body_len: e.body_len - body_from,
            range_start: first,
            total: if e.status == 200 { Some(e.body_len) } else { old.total },
            etag: old.etag.clone(),
            last_modified: old.last_modified.clone(),
            skip: 0,
            send: e.body_len - body_from,
        }
    } else {
        Expected {
            ranged,
            status: e.status,
            body_len: e.body_len,
            range_start: 0,
            total: None,
            etag: old.etag.clone(),
            last_modified: old.last_modified.clone(),
            skip: body_from,
            send: e.body_len - body_from,
        }
    };
    req.extend_from_slice(b"Connection: keep-alive\r\n\r\n");
    Ok((req, x))
}

/// Checks the local server's response header (parsed with [`http::parse_response`]) against
/// what the resumed body must be.
pub fn check(x: &Expected, r: &Response) -> Result<(), Mismatch> {
    if x.ranged && r.status == 200 {
        return Err(Mismatch::Changed("the local server answered 200 to If-Range: the object changed".into()));
    }
    if r.status != x.status {
        return Err(Mismatch::Other(format!("local server answered {} where {} was expected", r.status, x.status)));
    }
    if !x.etag.is_empty() && r.etag != x.etag {
        return Err(Mismatch::Changed("the local object has another ETag".into()));
    }
    if !x.last_modified.is_empty() && r.last_modified != x.last_modified {
        return Err(Mismatch::Changed("the local object has another Last-Modified".into()));
    }
    if r.body_len != x.body_len {
        return Err(Mismatch::Other(format!("local body is {} bytes, expected {}", r.body_len, x.body_len)));
    }
    if x.ranged && r.range_start != x.range_start {
        return Err(Mismatch::Other("local Content-Range starts elsewhere".into()));
    }
    if x.ranged && x.total.is_some() && r.total != x.total {
        return Err(Mismatch::Changed("the local object has another length".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LM: &str = "Tue, 24 Nov 2026 10:00:00 GMT";
    const LATER: &str = "Wed, 25 Nov 2026 08:00:00 GMT";

    fn entry(header: &str, object_id: &[u8]) -> Entry {
        let r = http::parse_response(header.as_bytes(), false).unwrap();
        Entry {
            status: r.status,
            body_len: r.body_len,
            range_start: r.range_start,
            header: header.as_bytes().to_vec(),
            object_id: object_id.to_vec(),
            etag: r.etag,
            last_modified: r.last_modified,
            ..Entry::default()
        }
    }

    fn h200(extra: &str) -> String {
        format!("HTTP/1.1 200 OK\r\nDate: {LATER}\r\nContent-Length: 1000\r\n{extra}\r\n")
    }

    const ID: &[u8] = b"GET /a.bin HTTP/1.1\r\nHost: x\r\n";

    #[test]
    fn resume_sends_range_with_if_range() {
        let e = entry(&h200("ETag: \"5f-3e8\"\r\nLast-Modified: Tue, 24 Nov 2026 10:00:00 GMT\r\n"), ID);
        let (req, x) = request(&e, 400).unwrap();
        assert_eq!(
            String::from_utf8(req).unwrap(),
            "GET /a.bin HTTP/1.1\r\nHost: x\r\nRange: bytes=400-999\r\nIf-Range: \"5f-3e8\"\r\nConnection: keep-alive\r\n\r\n"
        );
        assert_eq!((x.status, x.body_len, x.range_start, x.total, x.send), (206, 600, 400, Some(1000), 600));
        let ok = format!("HTTP/1.1 206 Partial Content\r\nContent-Length: 600\r\nContent-Range: bytes 400-999/1000\r\nETag: \"5f-3e8\"\r\nLast-Modified: {LM}\r\n\r\n");
        assert_eq!(check(&x, &http::parse_response(ok.as_bytes(), false).unwrap()), Ok(()));
        // Last-Modified alone, a second or more before Date: sent as If-Range.
        let e = entry(&h200(&format!("Last-Modified: {LM}\r\n")), ID);
        let (req, _) = request(&e, 1).unwrap();
        assert!(String::from_utf8(req).unwrap().contains(&format!("If-Range: {LM}\r\n")));
    }

    #[test]
    fn hostile_resume_of_a_changed_object_is_a_mismatch() {
        let e = entry(&h200("ETag: \"5f-3e8\"\r\n"), ID);
        let (_, x) = request(&e, 400).unwrap();
        for (answer, changed) in [
            // If-Range failed: the whole new object.
            ("HTTP/1.1 200 OK\r\nContent-Length: 1000\r\nETag: \"60-3e8\"\r\n\r\n", true),
            ("HTTP/1.1 206 Partial Content\r\nContent-Length: 600\r\nContent-Range: bytes 400-999/1000\r\nETag: \"60-3e8\"\r\n\r\n", true),
            ("HTTP/1.1 206 Partial Content\r\nContent-Length: 600\r\nContent-Range: bytes 400-999/1000\r\nETag: W/\"5f-3e8\"\r\n\r\n", true),
            ("HTTP/1.1 206 Partial Content\r\nContent-Length: 600\r\nContent-Range: bytes 400-999/1000\r\n\r\n", true),
            ("HTTP/1.1 206 Partial Content\r\nContent-Length: 600\r\nContent-Range: bytes 400-999/2000\r\nETag: \"5f-3e8\"\r\n\r\n", true),
            ("HTTP/1.1 206 Partial Content\r\nContent-Length: 600\r\nContent-Range: bytes 401-1000/1000\r\nETag: \"5f-3e8\"\r\n\r\n", false),
            ("HTTP/1.1 206 Partial Content\r\nContent-Length: 599\r\nContent-Range: bytes 400-998/1000\r\nETag: \"5f-3e8\"\r\n\r\n", false),
            ("HTTP/1.1 416 Range Not Satisfiable\r\nContent-Length: 0\r\n\r\n", false),
        ] {
            let r = http::parse_response(answer.as_bytes(), false).unwrap();
            match check(&x, &r) {
                Err(Mismatch::Changed(_)) if changed => {}
                Err(Mismatch::Other(_)) if !changed => {}
                other => panic!("{answer:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn hostile_resume_without_a_strong_validator_is_refused() {
        for extra in [
            String::new(),
            "ETag: W/\"5f-3e8\"\r\n".to_string(),
            // Modified within the second of the response: another change in that second
            // would keep the same Last-Modified (and nginx's ETag, made of it).
            "Last-Modified: Wed, 25 Nov 2026 08:00:00 GMT\r\n".to_string(),
            "Last-Modified: Thu, 26 Nov 2026 08:00:00 GMT\r\n".to_string(),
            "Last-Modified: Tuesday, 24-Nov-26 10:00:00 GMT\r\n".to_string(),
        ] {
            let e = entry(&h200(&extra), ID);
            assert_eq!(request(&e, 10).map(|_| ()), Err(http::NO_VALIDATOR), "{extra:?}");
        }
        // Without Date, a Last-Modified cannot be judged.
        let e = entry(&format!("HTTP/1.1 200 OK\r\nContent-Length: 10\r\nLast-Modified: {LM}\r\n\r\n"), ID);
        assert_eq!(request(&e, 1).map(|_| ()), Err(http::NO_VALIDATOR));
    }

    #[test]
    fn hostile_record_header_injection_is_refused() {
        let h = h200("ETag: \"5f-3e8\"\r\n");
        for id in [
            &b"GET /a.bin HTTP/1.1\r\nHost: x\r\nX-Evil: 1\r\n"[..],
            b"GET /a.bin HTTP/1.1\r\nHost: x\nX-Evil: 1\r\n",
            b"GET /a.bin HTTP/1.1\r\nHost: x\rX-Evil: 1\r\n",
            b"GET /a.bin HTTP/1.1\r\nHost: x\0\r\n",
            b"GET /a.bin HTTP/1.1\r\nHost: x\x1b[2J\r\n",
            b"GET /a.bin HTTP/1.1\r\nHost: x\x7f\r\n",
            b"GET /a.bin HTTP/1.1\r\nAuthorization: Basic YTpi\r\n",
            b"GET /a.bin HTTP/1.1\r\nCookie: s=1\r\n",
            b"GET /a.bin HTTP/1.1\r\n\r\nGET /other HTTP/1.1\r\n",
            b"GET /a.bin HTTP/1.1\r\nHost: x",
            b"GET /a b HTTP/1.1\r\n",
            b"GET http://evil/ HTTP/1.1\r\n",
            b"POST /a.bin HTTP/1.1\r\n",
            b"GET /a.bin HTTP/1.1 x\r\n",
            b"",
        ] {
            let e = entry(&h, id);
            assert!(request(&e, 10).is_err(), "{:?} accepted", String::from_utf8_lossy(id));
        }
        let mut long = b"GET /".to_vec();
        long.extend(std::iter::repeat_n(b'a', http::MAX_OBJECT_ID));
        long.extend_from_slice(b" HTTP/1.1\r\n");
        assert!(request(&entry(&h, &long), 10).is_err(), "over MAX_OBJECT_ID accepted");
        // A validator with a line break is refused too (a record can be written by anyone
        // with the key only, but the replay is checked all the same).
        assert!(http::check_validator(b"\"a\"\r\nX-Evil: 1").is_err());
        assert!(http::check_validator(b"").is_err());
        assert!(http::check_validator(LM.as_bytes()).is_ok());
        assert!(request(&entry(&h, ID), 10).is_ok());
    }

    #[test]
    fn unranged_responses_are_fetched_whole_and_skipped() {
        let e = entry("HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\n", ID);
        let (req, x) = request(&e, 2).unwrap();
        assert_eq!(req, b"GET /a.bin HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n".to_vec());
        assert_eq!((x.ranged, x.status, x.body_len, x.skip, x.send), (false, 404, 5, 2, 3));
        let r = http::parse_response(b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\n", false).unwrap();
        assert_eq!(check(&x, &r), Ok(()));
    }
}
