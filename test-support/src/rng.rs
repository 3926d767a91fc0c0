//! Deterministic random test data.

use distflash_kernels::ElemType;

use crate::rounding::rounding_of;

/// SplitMix64: small, deterministic, good enough for test data.
pub struct Rng(u64);

impl Rng {
    /// A generator; each test uses its own seed so failures reproduce.
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }

    /// `n` values uniform in [-amp, amp), already rounded to `elem` so host and device see the
    /// same numbers.
    pub fn tensor(&mut self, n: usize, amp: f64, elem: ElemType) -> Vec<f64> {
        let round = rounding_of(elem);
        (0..n).map(|_| round(self.uniform() * amp)).collect()
    }
}
