//! Sequence numbers modulo 2^32 (RFC 793 section 3.3, RFC 1982 serial arithmetic).

use core::fmt;
use core::ops::{Add, Sub};

/// A TCP sequence number. Comparisons are modular: `a < b` when `b - a` (mod 2^32) is in
/// `1..2^31`. There is deliberately no `Ord`: the relation is not transitive over the whole ring.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Seq(pub u32);

impl Seq {
    /// Signed distance `self - other`, valid when the two are within 2^31 of each other.
    #[inline]
    pub fn diff(self, other: Seq) -> i32 {
        self.0.wrapping_sub(other.0) as i32
    }
    #[inline]
    pub fn lt(self, other: Seq) -> bool {
        self.diff(other) < 0
    }
    #[inline]
    pub fn le(self, other: Seq) -> bool {
        self.diff(other) <= 0
    }
    #[inline]
    pub fn gt(self, other: Seq) -> bool {
        self.diff(other) > 0
    }
    #[inline]
    pub fn ge(self, other: Seq) -> bool {
        self.diff(other) >= 0
    }
    /// The later of the two (modular).
    #[inline]
    pub fn max(self, other: Seq) -> Seq {
        if self.lt(other) { other } else { self }
    }
}

impl Add<u32> for Seq {
    type Output = Seq;
    #[inline]
    fn add(self, rhs: u32) -> Seq {
        Seq(self.0.wrapping_add(rhs))
    }
}

impl Sub<u32> for Seq {
    type Output = Seq;
    #[inline]
    fn sub(self, rhs: u32) -> Seq {
        Seq(self.0.wrapping_sub(rhs))
    }
}

/// `a - b` as an unsigned modular distance (bytes from `b` forward to `a`).
impl Sub<Seq> for Seq {
    type Output = u32;
    #[inline]
    fn sub(self, rhs: Seq) -> u32 {
        self.0.wrapping_sub(rhs.0)
    }
}

impl fmt::Debug for Seq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Seq({})", self.0)
    }
}

/// Recovers a 64-bit byte count from its low 32 bits, choosing the value within 2^31 of
/// `reference` (RTCP section 2.3.1: "within a window of the last four gigabytes").
#[inline]
pub fn unwrap_near(low: u32, reference: u64) -> u64 {
    let delta = low.wrapping_sub(reference as u32) as i32 as i64;
    (reference as i64 + delta).max(0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn wraps_at_2_pow_32() {
        let a = Seq(u32::MAX - 10);
        let b = a + 20;
        assert_eq!(b, Seq(9));
        assert!(a.lt(b));
        assert!(b.gt(a));
        assert_eq!(b - a, 20);
        assert_eq!(b.diff(a), 20);
        assert_eq!(a.diff(b), -20);
        assert_eq!(a.max(b), b);
        assert_eq!(b - 20u32, a);
    }

    #[test]
    fn half_ring_boundary() {
        let a = Seq(0);
        assert!(a.lt(Seq(0x7fff_ffff)));
        assert!(a.gt(Seq(0x8000_0001)));
    }

    #[test]
    fn unwrap_near_crosses_4gib() {
        let reference = (1u64 << 32) + 100;
        assert_eq!(unwrap_near(50, reference), (1u64 << 32) + 50);
        assert_eq!(unwrap_near(u32::MAX - 5, reference), (1u64 << 32) - 6);
        assert_eq!(unwrap_near(300, 200), 300);
        assert_eq!(unwrap_near(u32::MAX, 0), 0);
    }

    proptest! {
        #[test]
        fn ordering_is_antisymmetric(a in any::<u32>(), d in 1u32..0x7fff_ffff) {
            let x = Seq(a);
            let y = x + d;
            prop_assert!(x.lt(y) && y.gt(x) && !y.lt(x) && x.le(y) && y.ge(x));
            prop_assert_eq!(y - x, d);
        }

        #[test]
        fn unwrap_recovers_counts(count in 0u64..(1u64 << 40), back in 0u64..(1u64 << 30)) {
            let reference = count + back;
            prop_assert_eq!(unwrap_near(count as u32, reference), count);
        }
    }
}
