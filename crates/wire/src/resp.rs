//! RESP2, the protocol of Redis (<https://redis.io/docs/latest/develop/reference/protocol-spec/>),
//! as object mode's store client (`unbroken_control::object::store`) speaks it: commands out (an array
//! of bulk strings), replies in. The client's connections, pipelining, cluster routing and
//! retries are the store module's; the bytes are here.
//!
//! | type byte | reply | line | then |
//! |---|---|---|---|
//! | `+` | status | text | |
//! | `-` | error | text | |
//! | `:` | integer | decimal `i64` | |
//! | `$` | bulk string | length n (`-1`: null) | n bytes, CRLF |
//! | `*` | array | count n (`-1`: null) | n replies |
//!
//! Every line ends in CRLF. [`parse_reply`] takes a prefix of a byte stream: `Ok(None)` while
//! it is incomplete, an `Err` (never a panic) for anything malformed or beyond the limits
//! ([`MAX_LINE`], [`MAX_BULK`], [`MAX_DEPTH`]).

/// Longest RESP line (status, error, length header) accepted.
pub const MAX_LINE: usize = 1 << 20;
/// Largest bulk string accepted (Redis's own `proto-max-bulk-len` default).
pub const MAX_BULK: usize = 512 << 20;
/// Deepest RESP array nesting accepted (`CLUSTER SLOTS` needs 3).
pub const MAX_DEPTH: usize = 8;

/// A RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `+text`
    Status(String),
    /// `-text` (as a value; the store client returns it as an error).
    Error(String),
    /// `:n`
    Int(i64),
    /// `$n` bulk string; `None` is the null bulk (`$-1`).
    Bulk(Option<Vec<u8>>),
    /// `*n` array; `None` is the null array (`*-1`).
    Array(Option<Vec<Reply>>),
}

fn push_usize(out: &mut Vec<u8>, mut n: usize) {
    let mut tmp = [0u8; 20];
    let mut i = tmp.len();
    loop {
        i -= 1;
        tmp[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&tmp[i..]);
}

/// Appends a type byte and a length line (`*3\r\n`, `$5\r\n`): the head of an array of
/// `n` items or of a bulk string of `n` bytes.
pub fn push_header(out: &mut Vec<u8>, kind: u8, n: usize) {
    out.push(kind);
    push_usize(out, n);
    out.extend_from_slice(b"\r\n");
}

/// Appends one bulk string made of `parts` concatenated (a prefix and a key, say).
pub fn push_bulk(out: &mut Vec<u8>, parts: &[&[u8]]) {
    push_header(out, b'$', parts.iter().map(|p| p.len()).sum());
    for p in parts {
        out.extend_from_slice(p);
    }
    out.extend_from_slice(b"\r\n");
}

/// Appends a command (an array of bulk strings).
pub fn encode_command(out: &mut Vec<u8>, args: &[&[u8]]) {
    push_header(out, b'*', args.len());
    for a in args {
        push_bulk(out, &[a]);
    }
}

fn find_crlf(buf: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    loop {
        let nl = i + buf.get(i..)?.iter().position(|&b| b == b'\n')?;
        if nl > from && buf[nl - 1] == b'\r' {
            return Some(nl - 1);
        }
        i = nl + 1;
    }
}

fn parse_int(line: &[u8]) -> Result<i64, String> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            format!(
                "bad integer {:?}",
                String::from_utf8_lossy(&line[..line.len().min(40)])
            )
        })
}

/// Parses one reply at the start of `buf`: `Ok(None)` while incomplete, else the reply and the
/// number of bytes it took.
pub fn parse_reply(buf: &[u8]) -> Result<Option<(Reply, usize)>, String> {
    parse_at(buf, 0, 0)
}

fn parse_at(buf: &[u8], pos: usize, depth: usize) -> Result<Option<(Reply, usize)>, String> {
    if pos >= buf.len() {
        return Ok(None);
    }
    let Some(eol) = find_crlf(buf, pos + 1) else {
        if buf.len() - pos > MAX_LINE {
            return Err("reply line too long".into());
        }
        return Ok(None);
    };
    let line = &buf[pos + 1..eol];
    let next = eol + 2;
    let text = || String::from_utf8_lossy(line).into_owned();
    match buf[pos] {
        b'+' => Ok(Some((Reply::Status(text()), next))),
        b'-' => Ok(Some((Reply::Error(text()), next))),
        b':' => Ok(Some((Reply::Int(parse_int(line)?), next))),
        b'$' => {
            let n = parse_int(line)?;
            if n == -1 {
                return Ok(Some((Reply::Bulk(None), next)));
            }
            if n < 0 || n as u64 > MAX_BULK as u64 {
                return Err(format!("bad bulk length {n}"));
            }
            let n = n as usize;
            if buf.len() < next + n + 2 {
                return Ok(None);
            }
            if &buf[next + n..next + n + 2] != b"\r\n" {
                return Err("bulk string not terminated by CRLF".into());
            }
            Ok(Some((
                Reply::Bulk(Some(buf[next..next + n].to_vec())),
                next + n + 2,
            )))
        }
        b'*' => {
            let n = parse_int(line)?;
            if n == -1 {
                return Ok(Some((Reply::Array(None), next)));
            }
            if !(0..=(1 << 24)).contains(&n) {
                return Err(format!("bad array length {n}"));
            }
            if depth >= MAX_DEPTH {
                return Err("arrays nested too deep".into());
            }
            let mut items = Vec::with_capacity((n as usize).min(1024));
            let mut p = next;
            for _ in 0..n {
                match parse_at(buf, p, depth + 1)? {
                    Some((r, np)) => {
                        items.push(r);
                        p = np;
                    }
                    None => return Ok(None),
                }
            }
            Ok(Some((Reply::Array(Some(items)), p)))
        }
        b => Err(format!("unexpected RESP type byte 0x{b:02x}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resp_round_trip_and_incomplete_input() {
        let mut out = Vec::new();
        encode_command(&mut out, &[b"SET", b"k\r\n", b""]);
        assert_eq!(out, b"*3\r\n$3\r\nSET\r\n$3\r\nk\r\n\r\n$0\r\n\r\n");
        let wire = b"+OK\r\n-ERR x\r\n:-7\r\n$-1\r\n$4\r\na\r\nb\r\n*2\r\n$1\r\nz\r\n*-1\r\n*0\r\n";
        let mut pos = 0;
        let mut got = Vec::new();
        while let Some((r, used)) = parse_reply(&wire[pos..]).unwrap() {
            got.push(r);
            pos += used;
        }
        assert_eq!(pos, wire.len());
        assert_eq!(
            got,
            vec![
                Reply::Status("OK".into()),
                Reply::Error("ERR x".into()),
                Reply::Int(-7),
                Reply::Bulk(None),
                Reply::Bulk(Some(b"a\r\nb".to_vec())),
                Reply::Array(Some(vec![
                    Reply::Bulk(Some(b"z".to_vec())),
                    Reply::Array(None)
                ])),
                Reply::Array(Some(vec![])),
            ]
        );
        // Every strict prefix is incomplete, never an error.
        for cut in 0..wire.len() {
            let r = parse_reply(&wire[..cut]).unwrap();
            if let Some((_, used)) = r {
                assert!(used <= cut);
            }
        }
        assert!(parse_reply(b"$3\r\nabcXY").is_err());
        assert!(parse_reply(b"?\r\n").is_err());
        assert!(parse_reply(b"$-2\r\n").is_err());
    }

    #[test]
    fn junk_is_an_error_or_incomplete_never_a_panic() {
        let alphabet = b"+-:$*0123456789\r\n-1xyz";
        let mut x: u32 = 0x2545_f491;
        for len in 0..400 {
            let junk: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    alphabet[x as usize % alphabet.len()]
                })
                .collect();
            if let Ok(Some((_, used))) = parse_reply(&junk) {
                assert!(used <= junk.len());
            }
        }
        // Nesting beyond MAX_DEPTH is refused, not recursed into.
        let deep = b"*1\r\n".repeat(MAX_DEPTH + 1);
        assert!(parse_reply(&deep).is_err());
    }
}
