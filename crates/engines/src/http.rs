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
/// response bytes. `Range`, `If-Range` and `Connection` are rebuilt by the resumer.
const OBJECT_HEADERS: &[&str] = &[
    "host",
    "accept",
    "accept-encoding",
    "accept-language",
    "authorization",
    "cookie",
    "if-match",
    "if-none-match",
    "if-modified-since",
    "if-unmodified-since",
];

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
    let mut object_id = Vec::with_capacity(line.len() + 64);
    object_id.extend_from_slice(line.as_bytes());
    object_id.extend_from_slice(b"\r\n");
    for l in lines.filter(|l| !l.is_empty()) {
        let (name, value) = l.split_once(':').ok_or(Unresumable("malformed request header"))?;
        let name_lc = name.trim().to_ascii_lowercase();
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
