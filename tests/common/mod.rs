//! Helpers shared by the integration tests: deterministic random data, the tolerance rule.
#![allow(dead_code)]

pub mod block_case;
pub mod burn_case;
pub mod distributed_case;
pub mod matrix;
pub mod modules;
pub mod repeated_case;
pub mod schedules;
pub mod within;

use distflash_kernels::reference::{self, Rounding};
use distflash_kernels::ElemType;

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
        let round = reference::rounding_of(elem);
        (0..n).map(|_| round(self.uniform() * amp)).collect()
    }
}

/// Converts to f32 for upload.
pub fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// Converts a download to f64.
pub fn to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// The tolerance rule: the kernel's error against the exact reference must be at most twice the
/// error of the naive computation in the kernel's precision, plus a small absolute slack scaled
/// by the magnitude of the reference.
pub fn assert_close(what: &str, got: &[f64], exact: &[f64], naive: &[f64], elem: ElemType) {
    let naive_err = reference::max_abs_diff(naive, exact);
    let err = reference::max_abs_diff(got, exact);
    let magnitude = exact
        .iter()
        .filter(|x| x.is_finite())
        .fold(1.0f64, |a, x| a.max(x.abs()));
    let atol = match elem {
        ElemType::F32 => 1e-5,
        ElemType::F16 | ElemType::BF16 => 1e-3,
    } * magnitude;
    assert!(
        err <= 2.0 * naive_err + atol,
        "{what} ({elem:?}): max error {err:.3e} exceeds 2 x naive {naive_err:.3e} + atol {atol:.1e}"
    );
}

/// Rounding used for the naive low-precision computation of `elem`.
pub fn naive_rounding(elem: ElemType) -> Rounding {
    reference::rounding_of(elem)
}
