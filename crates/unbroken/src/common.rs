//! What the modes' demos and benchmarks share: the seeded generator chaos trials draw their
//! faults from, percentiles, and the helpers of the JSON reports and of option parsing.

use serde_json::{json, Value};

/// A small seeded RNG (splitmix64): the same seed draws the same faults.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Fills `buf` with its next numbers' bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let x = self.next().to_le_bytes();
            c.copy_from_slice(&x[..c.len()]);
        }
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn pick<T: Copy>(&mut self, v: &[T]) -> Option<T> {
        (!v.is_empty()).then(|| v[self.next() as usize % v.len()])
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Percentiles {
    pub p50: u64,
    pub p99: u64,
    pub max: u64,
}

/// The nearest-rank percentile of sorted values.
pub fn pct(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// The value after option `f`, parsed; a precise error when it is missing or not a number.
pub(crate) fn val<T: std::str::FromStr>(it: &mut std::slice::Iter<String>, f: &str) -> Result<T, String> {
    let v = it.next().ok_or(format!("{f} needs a value"))?;
    v.parse().map_err(|_| format!("{f}: not a number: {v:?}"))
}

pub(crate) fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if s.is_empty() {
        0.0
    } else if s.len() % 2 == 1 {
        s[s.len() / 2]
    } else {
        (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
    }
}

/// `{runs, median, min, max}` of `v` (2 decimals); null when empty.
pub(crate) fn med_min_max(v: &[f64]) -> Value {
    if v.is_empty() {
        return Value::Null;
    }
    let min = v.iter().cloned().fold(f64::INFINITY, f64::min);
    let max = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    json!({ "runs": v.iter().map(|x| round2(*x)).collect::<Vec<_>>(), "median": round2(median(v)), "min": round2(min), "max": round2(max) })
}
