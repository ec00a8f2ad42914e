//! The ~100 lines of HTTP/1.x knowledge TRODS needs (seed 000, section 3: "this
//! application-specific HTTP knowledge constitutes about 100 lines of code"): where a request or
//! response header ends, which request headers select the object (the objectID), and how long
//! a response body is, so the byte position of every response in the connection is known.
//!
//! Parsing is strict and bounded: anything unusual (a request with a body, a chunked or
//! close-delimited response, multipart ranges, 1xx responses) is reported as
//! [`Unresumable`] so the caller stops protecting that connection instead of guessing.

/// Why a message cannot be resumed byte-exactly on another server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unresumable(pub &'static str);

/// Offset just past the `\r\n\r\n` that ends a header block, if `buf` holds it.
pub fn header_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4)
}

/// Request headers replayed to the recovering server's nginx: the ones that select the
/// response bytes. `Range`, `If-Range` and `Connection` are rebuilt by the resumer. No
/// credentials (issue 9 item 7): a request that carries one is not protected at all
/// ([`CREDENTIALS`]), so they never reach the store.
pub const OBJECT_HEADERS: &[&str] = &[
    "host",
    "accept",
    "accept-encoding",
    "accept-language",
    "if-match",
    "if-none-match",
    "if-modified-since",
    "if-unmodified-since",
];

/// Request headers that carry credentials. A request with one of them is not protected
/// (counted as `unprotected_credentials`): the store never holds them, and resuming without
/// them could fetch another representation than the client's.
pub const CREDENTIAL_HEADERS: &[&str] = &["authorization", "proxy-authorization", "cookie", "cookie2"];

/// Why a request with credentials is not protected.
pub const CREDENTIALS: Unresumable = Unresumable("request carries credentials (Authorization, Cookie)");
/// Why a request with control bytes is not protected (a replay must never carry them).
pub const CONTROL_BYTES: Unresumable = Unresumable("control byte in request");
/// Why a 200 or 206 response without a strong validator is not protected (issue 9 item 8):
/// resuming it could splice two versions of a changed object.
pub const NO_VALIDATOR: Unresumable = Unresumable("response without a strong validator (ETag or Last-Modified)");

/// Longest objectID a resumer replays (the engine's request header limit).
pub const MAX_OBJECT_ID: usize = 8 << 10;
/// Longest validator a resumer sends as If-Range.
pub const MAX_VALIDATOR: usize = 256;

/// Whether `b` may appear in a request line or header line: visible ASCII, space, tab and
/// obs-text; never CR, LF, NUL, other controls or DEL.
fn line_byte_ok(b: u8) -> bool {
    b == b'\t' || (b' '..=b'~').contains(&b) || b >= 0x80
}

/// A header field name: an RFC 9110 token.
fn is_token(s: &[u8]) -> bool {
    !s.is_empty() && s.iter().all(|&c| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c))
}

/// A parsed request header block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// `HEAD`: the response has a header only.
    pub head: bool,
    /// The objectID: the request line and the headers of [`OBJECT_HEADERS`], each ending in
    /// CRLF, without the blank line.
    pub object_id: Vec<u8>,
}

/// Parses one request header block (`head` ends with the blank line).
pub fn parse_request(head: &[u8]) -> Result<Request, Unresumable> {
    let text = std::str::from_utf8(head).map_err(|_| Unresumable("request is not UTF-8"))?;
    let mut lines = text.split("\r\n");
    let line = lines.next().unwrap_or("");
    let mut parts = line.split(' ');
    let method = parts.next().unwrap_or("");
    let target = parts.next().unwrap_or("");
    let version = parts.next().unwrap_or("");
    if parts.next().is_some() || target.is_empty() || !version.starts_with("HTTP/1.") {
        return Err(Unresumable("malformed request line"));
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Err(Unresumable("method other than GET or HEAD")),
    };
    if !line.bytes().all(line_byte_ok) {
        return Err(CONTROL_BYTES);
    }
    // What a resumer will replay ([`check_object_id`]): an origin-form target, HTTP/1.0 or 1.1.
    if !target.starts_with('/') || !target.bytes().all(|b| (b'!'..=b'~').contains(&b)) || !matches!(version, "HTTP/1.0" | "HTTP/1.1") {
        return Err(Unresumable("malformed request target"));
    }
    let mut object_id = Vec::with_capacity(line.len() + 64);
    object_id.extend_from_slice(line.as_bytes());
    object_id.extend_from_slice(b"\r\n");
    for l in lines.filter(|l| !l.is_empty()) {
        if !l.bytes().all(line_byte_ok) {
            return Err(CONTROL_BYTES);
        }
        let (name, value) = l.split_once(':').ok_or(Unresumable("malformed request header"))?;
        if !is_token(name.as_bytes()) {
            return Err(Unresumable("malformed request header"));
        }
        let name_lc = name.to_ascii_lowercase();
        if CREDENTIAL_HEADERS.contains(&name_lc.as_str()) {
            return Err(CREDENTIALS);
        }
        match name_lc.as_str() {
            "content-length" if value.trim() != "0" => return Err(Unresumable("request body")),
            "transfer-encoding" => return Err(Unresumable("request body")),
            "expect" => return Err(Unresumable("Expect header")),
            "upgrade" => return Err(Unresumable("protocol upgrade")),
            _ => {}
        }
        if OBJECT_HEADERS.contains(&name_lc.as_str()) {
            object_id.extend_from_slice(l.as_bytes());
            object_id.extend_from_slice(b"\r\n");
        }
    }
    if object_id.len() > MAX_OBJECT_ID {
        return Err(Unresumable("request header too long"));
    }
    debug_assert!(check_object_id(&object_id).is_ok(), "an objectID the resumer would refuse");
    Ok(Request {
        head: head_only,
        object_id,
    })
}

/// A parsed response header block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    /// Body bytes that follow the header (0 for HEAD, 1xx, 204, 304).
    pub body_len: u64,
    /// First byte of the representation this body starts at (`Content-Range` of a 206).
    pub range_start: u64,
    /// `Content-Range` total (or the `Content-Length` of a 200).
    pub total: Option<u64>,
    pub etag: Vec<u8>,
    pub last_modified: Vec<u8>,
    /// The `Date` header (judges whether `Last-Modified` is a strong validator).
    pub date: Vec<u8>,
    /// The header sets a cookie or carries authentication data (`Set-Cookie`,
    /// `Authentication-Info`): it is stored byte for byte, so such a response is not protected.
    pub credentials: bool,
    /// The server closes the connection after this response.
    pub close: bool,
}

/// Parses one response header block, given whether the request was `HEAD`.
pub fn parse_response(head: &[u8], request_was_head: bool) -> Result<Response, Unresumable> {
    let text = std::str::from_utf8(head).map_err(|_| Unresumable("response is not UTF-8"))?;
    let mut lines = text.split("\r\n");
    let line = lines.next().unwrap_or("");
    let mut parts = line.splitn(3, ' ');
    let version = parts.next().unwrap_or("");
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or(Unresumable("malformed status line"))?;
    if !version.starts_with("HTTP/1.") || !(100..600).contains(&status) {
        return Err(Unresumable("malformed status line"));
    }
    if status < 200 {
        return Err(Unresumable("1xx response"));
    }
    let mut r = Response {
        status,
        close: version == "HTTP/1.0",
        ..Response::default()
    };
    let mut content_length = None;
    for l in lines.filter(|l| !l.is_empty()) {
        let (name, value) = l.split_once(':').ok_or(Unresumable("malformed response header"))?;
        let value = value.trim();
        match name.trim().to_ascii_lowercase().as_str() {
            "content-length" => {
                let n: u64 = value.parse().map_err(|_| Unresumable("bad Content-Length"))?;
                if content_length.is_some_and(|c| c != n) {
                    return Err(Unresumable("conflicting Content-Length"));
                }
                content_length = Some(n);
            }
            "transfer-encoding" => return Err(Unresumable("chunked or encoded transfer")),
            "content-type" if value.to_ascii_lowercase().starts_with("multipart/byteranges") => {
                return Err(Unresumable("multipart ranges"))
            }
            "content-range" => {
                let (start, total) = parse_content_range(value)?;
                r.range_start = start;
                r.total = total;
            }
            "etag" => r.etag = value.as_bytes().to_vec(),
            "last-modified" => r.last_modified = value.as_bytes().to_vec(),
            "date" => r.date = value.as_bytes().to_vec(),
            "set-cookie" | "set-cookie2" | "authentication-info" | "proxy-authentication-info" => r.credentials = true,
            "connection" => {
                let v = value.to_ascii_lowercase();
                if v.split(',').any(|t| t.trim() == "close") {
                    r.close = true;
                } else if v.split(',').any(|t| t.trim() == "keep-alive") {
                    r.close = false;
                }
            }
            _ => {}
        }
    }
    let bodyless = request_was_head || status == 204 || status == 304;
    r.body_len = if bodyless {
        0
    } else {
        content_length.ok_or(Unresumable("body delimited by connection close"))?
    };
    if status == 200 && r.total.is_none() {
        r.total = content_length;
    }
    Ok(r)
}

/// Whether `v` is a strong entity tag: `"` etagc* `"` (RFC 9110 8.8.3), not `W/"..."`.
pub fn is_strong_etag(v: &[u8]) -> bool {
    v.len() >= 2
        && v.len() <= MAX_VALIDATOR
        && v[0] == b'"'
        && v[v.len() - 1] == b'"'
        && v[1..v.len() - 1].iter().all(|&c| c == 0x21 || (0x23..=0x7e).contains(&c) || c >= 0x80)
}

/// Seconds since the Unix epoch of an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`, the
/// only form a server may send, RFC 9110 5.6.7); other forms are `None`.
pub fn parse_http_date(v: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(v).ok()?;
    let b = s.as_bytes();
    if b.len() != 29 || &b[3..5] != b", " || b[7] != b' ' || b[11] != b' ' || b[16] != b' ' || b[19] != b':' || b[22] != b':' || &b[25..] != b" GMT" {
        return None;
    }
    if !["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"].contains(&&s[..3]) {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<u64> {
        let t = &s[r];
        if !t.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        t.parse().ok()
    };
    let day = num(5..7)?;
    const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    let month = MONTHS.iter().position(|m| *m == &s[8..11])? as u64 + 1;
    let year = num(12..16)?;
    let (h, m, sec) = (num(17..19)?, num(20..22)?, num(23..25)?);
    if !(1..=31).contains(&day) || year < 1970 || h > 23 || m > 59 || sec > 60 {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm), years from 1970 on.
    let (y, mo) = if month <= 2 { (year - 1, month + 9) } else { (year, month - 3) };
    let era = y / 400;
    let yoe = y - era * 400;
    let doy = (153 * mo + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = (era * 146_097 + doe).checked_sub(719_468)?;
    Some(days * 86_400 + h * 3600 + m * 60 + sec)
}

/// The validator a resumed Range request sends as `If-Range` for a response with these
/// headers, if there is one good enough to rule out splicing two versions of the object
/// (issue 9 item 8): a strong ETag, or else a `Last-Modified` at least one second before the
/// response's `Date` (RFC 9110 8.8.2.2: a modification within that second would not change
/// it). A weak ETag (`W/`) is never enough.
pub fn if_range<'a>(etag: &'a [u8], last_modified: &'a [u8], date: &[u8]) -> Option<&'a [u8]> {
    if is_strong_etag(etag) {
        return Some(etag);
    }
    let lm = parse_http_date(last_modified)?;
    let d = parse_http_date(date)?;
    (d >= lm.checked_add(1)?).then_some(last_modified)
}

/// Whether a response must carry a validator to be protected: a body of the object (200 or
/// 206) that a failover would fetch again with a Range request.
pub fn needs_validator(r: &Response, request_was_head: bool) -> bool {
    !request_was_head && matches!(r.status, 200 | 206) && r.body_len > 0
}

/// Checks an objectID read from a record before it is replayed to the local server: a
/// `GET` or `HEAD` request line with an origin-form target, then only [`OBJECT_HEADERS`]
/// lines, each ending in CRLF; no control byte, at most [`MAX_OBJECT_ID`] bytes.
pub fn check_object_id(id: &[u8]) -> Result<(), Unresumable> {
    let bad = Unresumable("objectID refused");
    let body = match id.strip_suffix(b"\r\n") {
        Some(b) if id.len() <= MAX_OBJECT_ID => b,
        _ => return Err(bad),
    };
    for (i, l) in split_crlf(body).enumerate() {
        // A CR or LF left inside a line (not part of a CRLF) fails here too.
        if l.is_empty() || !l.iter().all(|&b| line_byte_ok(b)) {
            return Err(CONTROL_BYTES);
        }
        if i == 0 {
            let t = std::str::from_utf8(l).map_err(|_| bad)?;
            let mut p = t.split(' ');
            let (m, target, v) = (p.next().unwrap_or(""), p.next().unwrap_or(""), p.next().unwrap_or(""));
            if p.next().is_some() || !matches!(m, "GET" | "HEAD") || !matches!(v, "HTTP/1.0" | "HTTP/1.1") {
                return Err(bad);
            }
            if !target.starts_with('/') || !target.bytes().all(|b| (b'!'..=b'~').contains(&b)) {
                return Err(bad);
            }
            continue;
        }
        let colon = l.iter().position(|&b| b == b':').ok_or(bad)?;
        let name = std::str::from_utf8(&l[..colon]).map_err(|_| bad)?;
        if !is_token(name.as_bytes()) || !OBJECT_HEADERS.contains(&name.to_ascii_lowercase().as_str()) {
            return Err(bad);
        }
    }
    Ok(())
}

/// The lines of `b` separated by CRLF.
fn split_crlf(b: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = Some(b);
    std::iter::from_fn(move || {
        let r = rest?;
        match r.windows(2).position(|w| w == b"\r\n") {
            Some(p) => {
                rest = Some(&r[p + 2..]);
                Some(&r[..p])
            }
            None => {
                rest = None;
                Some(r)
            }
        }
    })
}

/// Checks a validator read from a record before it is sent as `If-Range`.
pub fn check_validator(v: &[u8]) -> Result<(), Unresumable> {
    if v.is_empty() || v.len() > MAX_VALIDATOR || !v.iter().all(|&b| b != b'\t' && line_byte_ok(b)) {
        return Err(Unresumable("validator refused"));
    }
    Ok(())
}

/// `bytes a-b/total` (total may be `*`): returns (a, total).
fn parse_content_range(v: &str) -> Result<(u64, Option<u64>), Unresumable> {
    let bad = Unresumable("bad Content-Range");
    let rest = v.strip_prefix("bytes ").ok_or(bad)?;
    let (range, total) = rest.split_once('/').ok_or(bad)?;
    let total = if total == "*" {
        None
    } else {
        Some(total.parse().map_err(|_| bad)?)
    };
    if range == "*" {
        return Ok((0, total));
    }
    let (a, _b) = range.split_once('-').ok_or(bad)?;
    Ok((a.parse().map_err(|_| bad)?, total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_object_id_keeps_selecting_headers_only() {
        let r = parse_request(
            b"GET /a.bin HTTP/1.1\r\nHost: x\r\nUser-Agent: curl\r\nRange: bytes=5-\r\nAccept-Encoding: gzip\r\n\r\n",
        )
        .unwrap();
        assert!(!r.head);
        assert_eq!(
            r.object_id,
            b"GET /a.bin HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n".to_vec()
        );
        assert!(parse_request(b"HEAD / HTTP/1.0\r\n\r\n").unwrap().head);
        assert_eq!(
            parse_request(b"POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\n"),
            Err(Unresumable("method other than GET or HEAD"))
        );
        assert!(parse_request(b"GET / HTTP/1.1\r\nContent-Length: 3\r\n\r\n").is_err());
        assert!(parse_request(b"GET /\r\n\r\n").is_err());
        assert!(parse_request(&[0xff, b'\r', b'\n', b'\r', b'\n']).is_err());
    }

    #[test]
    fn hostile_request_with_credentials_is_not_protected() {
        for h in ["Authorization: Bearer s3cret", "authorization: Basic YTpi", "Cookie: session=s3cret", "Proxy-Authorization: Basic YTpi", "COOKIE2: $Version=1"] {
            let req = format!("GET /a.bin HTTP/1.1\r\nHost: x\r\n{h}\r\n\r\n");
            assert_eq!(parse_request(req.as_bytes()), Err(CREDENTIALS), "{h}");
        }
        let r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nSet-Cookie: s=s3cret\r\n\r\n", false).unwrap();
        assert!(r.credentials);
        assert!(!parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n", false).unwrap().credentials);
        // Headers that are not credentials and do not select the object are dropped, not refused.
        let r = parse_request(b"GET /a HTTP/1.1\r\nHost: x\r\nX-Api-Key: k\r\n\r\n").unwrap();
        assert_eq!(r.object_id, b"GET /a HTTP/1.1\r\nHost: x\r\n".to_vec());
    }

    #[test]
    fn hostile_request_with_control_bytes_is_not_protected() {
        for req in [
            &b"GET /a HTTP/1.1\r\nHost: x\nX-Evil: 1\r\n\r\n"[..],
            b"GET /a HTTP/1.1\r\nHost: x\rX-Evil: 1\r\n\r\n",
            b"GET /a HTTP/1.1\r\nHost: x\0\r\n\r\n",
            b"GET /a\x01 HTTP/1.1\r\nHost: x\r\n\r\n",
            b"GET /a HTTP/1.1\r\nAccept: \x1b\r\n\r\n",
            b"GET /a HTTP/1.1\r\nAccept: \x7f\r\n\r\n",
        ] {
            assert!(parse_request(req).is_err(), "{:?}", String::from_utf8_lossy(req));
        }
        assert!(parse_request(b"GET /a HTTP/1.1\r\nHost : x\r\n\r\n").is_err());
        // Only what a resumer replays is protected: origin-form targets, HTTP/1.0 and 1.1, an
        // objectID of at most MAX_OBJECT_ID bytes; every objectID kept passes check_object_id.
        for req in [&b"GET http://evil/a HTTP/1.1\r\n\r\n"[..], b"GET * HTTP/1.1\r\n\r\n", b"GET /a HTTP/1.9\r\n\r\n"] {
            assert!(parse_request(req).is_err(), "{:?}", String::from_utf8_lossy(req));
        }
        let long = format!("GET /a HTTP/1.1\r\nAccept: {}\r\n\r\n", "a".repeat(MAX_OBJECT_ID));
        assert_eq!(parse_request(long.as_bytes()), Err(Unresumable("request header too long")));
        let ok = parse_request(b"HEAD /a?b=c HTTP/1.0\r\nHost: x\r\nAccept: */*\r\nIf-None-Match: \"e\"\r\n\r\n").unwrap();
        assert_eq!(check_object_id(&ok.object_id), Ok(()));
        assert!(parse_request(b"GET /a HTTP/1.1\r\nAccept: a\tb\r\n\r\n").is_ok());
    }

    #[test]
    fn http_dates_and_validators() {
        assert_eq!(parse_http_date(b"Sun, 06 Nov 1994 08:49:37 GMT"), Some(784_111_777));
        assert_eq!(parse_http_date(b"Thu, 01 Jan 1970 00:00:00 GMT"), Some(0));
        assert_eq!(parse_http_date(b"Wed, 25 Nov 2026 08:00:00 GMT"), Some(1_795_593_600));
        for bad in [&b"Sunday, 06-Nov-94 08:49:37 GMT"[..], b"Sun Nov  6 08:49:37 1994", b"Sun, 06 Nov 1994 08:49:37 UTC", b"Sun, 6 Nov 1994 08:49:37 GMT", b"Xyz, 06 Nov 1994 08:49:37 GMT", b"Sun, 06 Nov 1994 25:49:37 GMT", b"Sun, 06 Foo 1994 08:49:37 GMT", b"Sun, +6 Nov 1994 08:49:37 GMT"] {
            assert_eq!(parse_http_date(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
        assert!(is_strong_etag(b"\"5f-3e8\""));
        assert!(is_strong_etag(b"\"\""));
        assert!(!is_strong_etag(b"W/\"5f-3e8\""));
        assert!(!is_strong_etag(b"5f-3e8"));
        assert!(!is_strong_etag(b"\"a\"b\""));
        let lm = b"Sun, 06 Nov 1994 08:49:37 GMT";
        assert_eq!(if_range(b"\"e\"", lm, b""), Some(&b"\"e\""[..]));
        assert_eq!(if_range(b"W/\"e\"", lm, b"Sun, 06 Nov 1994 08:49:38 GMT"), Some(&lm[..]));
        assert_eq!(if_range(b"", lm, b"Sun, 06 Nov 1994 08:49:37 GMT"), None, "same second");
        assert_eq!(if_range(b"", lm, b""), None, "no Date");
        assert_eq!(if_range(b"W/\"e\"", b"", b""), None);
    }

    #[test]
    fn response_lengths() {
        let r = parse_response(
            b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\nETag: \"abc\"\r\n\r\n",
            false,
        )
        .unwrap();
        assert_eq!((r.status, r.body_len, r.total, r.close), (200, 1234, Some(1234), false));
        assert_eq!(r.etag, b"\"abc\"".to_vec());
        let r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n", true).unwrap();
        assert_eq!(r.body_len, 0);
        let r = parse_response(
            b"HTTP/1.1 206 Partial Content\r\nContent-Length: 10\r\nContent-Range: bytes 100-109/5000\r\nConnection: close\r\n\r\n",
            false,
        )
        .unwrap();
        assert_eq!((r.body_len, r.range_start, r.total, r.close), (10, 100, Some(5000), true));
        let r = parse_response(b"HTTP/1.1 304 Not Modified\r\n\r\n", false).unwrap();
        assert_eq!(r.body_len, 0);
        let big = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 6000000000\r\n\r\n", false);
        assert_eq!(big.unwrap().body_len, 6_000_000_000);
    }

    #[test]
    fn unresumable_responses() {
        for (h, why) in [
            (&b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"[..], "chunked or encoded transfer"),
            (b"HTTP/1.1 200 OK\r\n\r\n", "body delimited by connection close"),
            (b"HTTP/1.1 100 Continue\r\n\r\n", "1xx response"),
            (b"HTTP/1.1 206 P\r\nContent-Type: multipart/byteranges; boundary=x\r\n\r\n", "multipart ranges"),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "conflicting Content-Length"),
            (b"HTTP/1.1 2x0 OK\r\n\r\n", "malformed status line"),
        ] {
            assert_eq!(parse_response(h, false), Err(Unresumable(why)), "{h:?}");
        }
    }

    #[test]
    fn header_end_found_across_whole_buffer() {
        assert_eq!(header_end(b"GET / HTTP/1.1\r\n\r\nrest"), Some(18));
        assert_eq!(header_end(b"GET / HTTP/1.1\r\n\r"), None);
    }
}
