//! Example recoverable application for checkpoint mode ([`server`]) and its protocol, shared with the demo's unmodified peer so it can verify
//! every byte it gets back.
//!
//! The peer sends fixed-size records; for each record the server answers one fixed-size line
//! derived only from the record, so the output is determined by the input (RTCP's output
//! determinism, section 2.3.1, holds even though the server journals output before sending).

pub mod server;

/// Bytes in one input record (ends with `\n`).
pub const RECORD_LEN: usize = 100;
/// Bytes in one reply line (ends with `\n`).
pub const REPLY_LEN: usize = 34;

/// FNV-1a, 64 bits.
pub fn fnv1a64(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Record number `i` as the peer sends it: `rec NNNNNNNNNNNN ` then 82 pseudo-random
/// letters derived from `i` and `seed`, then `\n`.
pub fn record(i: u64, seed: u64, out: &mut [u8; RECORD_LEN]) {
    let head = format!("rec {:012} ", i);
    out[..head.len()].copy_from_slice(head.as_bytes());
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed ^ 0x5555_5555;
    for b in out[head.len()..RECORD_LEN - 1].iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = b'a' + (x % 26) as u8;
    }
    out[RECORD_LEN - 1] = b'\n';
}

/// The server's answer to a record: `ack NNNNNNNNNNNN HHHHHHHHHHHHHHHH\n` where N is the
/// record's own number (parsed from it, or 0 if unparseable) and H its FNV-1a hash.
pub fn reply(rec: &[u8]) -> [u8; REPLY_LEN] {
    let n = std::str::from_utf8(rec.get(4..16).unwrap_or(b"")).ok().and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    let s = format!("ack {:012} {:016x}\n", n, fnv1a64(rec));
    let mut out = [0u8; REPLY_LEN];
    out.copy_from_slice(s.as_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_and_reply_shapes() {
        let mut r = [0u8; RECORD_LEN];
        record(42, 7, &mut r);
        assert!(r.starts_with(b"rec 000000000042 "));
        assert_eq!(r[RECORD_LEN - 1], b'\n');
        let a = reply(&r);
        assert!(a.starts_with(b"ack 000000000042 "));
        assert_eq!(a[REPLY_LEN - 1], b'\n');
        let mut r2 = [0u8; RECORD_LEN];
        record(43, 7, &mut r2);
        assert_ne!(reply(&r2), a);
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
    }
}
