//! The online-softmax statistics shared by every kernel variant.
//!
//! A row's partial state is `(o, m, l)`: `o` the unnormalised output `sum_j e^(s_j - m) v_j`, `m` the
//! running max of the scores seen, `l = sum_j e^(s_j - m)`. A row that has seen no key has
//! `m = -inf, l = 0, o = 0`. None of these helpers uses an infinite literal (WGSL rejects them): the
//! `-inf` of an empty row only ever comes from data written by the host.

use cubecl::prelude::*;

/// Scores below this are treated as "no key seen" when they come back as a log-sum-exp.
const FINITE_FLOOR: f32 = -3.0e38;

/// Factor that rescales a state kept relative to `m_old` so it is relative to `m_new >= m_old`.
/// Equal maxima (including two empty rows) give exactly 1, never `exp(-inf + inf)` (that NaN
/// is computed but not selected; the select keeps the kernels branch-free).
#[cube]
pub fn rescale_factor(m_old: f32, m_new: f32) -> f32 {
    select(m_new != m_old, f32::exp(m_old - m_new), 1.0f32)
}

/// Probability weight of a visible key with score `score` relative to the running max `m`
/// (`m >= score`, and `m` is finite whenever a key is visible).
#[cube]
pub fn unnormalised_weight(score: f32, m: f32) -> f32 {
    f32::exp(score - m)
}

/// Normalised probability of a key from its score and the row's log-sum-exp (used by the
/// backward). A row that saw no key anywhere (`lse = -inf`) gives 0, not `exp(+inf)`.
#[cube]
pub fn probability_from_lse(score: f32, lse: f32) -> f32 {
    select(lse >= FINITE_FLOOR, f32::exp(score - lse), 0.0f32)
}

/// Reciprocal of the running sum for the final normalisation; 0 for a row that saw no key, so its
/// output is 0 instead of `0 / 0`.
#[cube]
pub fn output_normaliser(l: f32) -> f32 {
    let mut inv = 0.0f32;
    if l > 0.0f32 {
        inv = 1.0f32 / l;
    }
    inv
}

/// Log-sum-exp of a finished row: `m + ln l`, or `m` (which is `-inf`) for a row that saw no key.
#[cube]
pub fn log_sum_exp(m: f32, l: f32) -> f32 {
    let mut lse = m;
    if l > 0.0f32 {
        lse = m + f32::ln(l);
    }
    lse
}

/// `log2(e)`: the tensor-core kernels keep row maxima and log-sum-exps in base-2 units
/// (`m * log2(e)`), so a probability is one fused multiply-add and one `exp2`.
pub const LOG2_E: f32 = core::f32::consts::LOG2_E;

/// `ln(2)`: converts a base-2 row max back to the natural units of the state contract.
pub const LN_2: f32 = core::f32::consts::LN_2;

/// `2^x`: one `MUFU.EX2` (plus its denormal guard) in a kernel compiled with fast math, where
/// `f32::exp` costs one multiply more.
#[cube]
pub fn exp2(x: f32) -> f32 {
    f32::powf(2.0f32, x)
}

/// `-inf`, computed as `ln 0` (`lg2.approx(+0) = -inf` in PTX, exact in IEEE): cubecl 0.10's
/// CUDA code generator writes an `f32::NEG_INFINITY` constant as the undefined identifier `inf`,
/// and a constant bit pattern as an invalid `reinterpret_cast`.
#[cube]
pub fn negative_infinity() -> f32 {
    f32::ln(0.0f32)
}

/// [`rescale_factor`] for maxima in base-2 units: equal maxima (two empty rows included) give
/// exactly 1.
#[cube]
pub fn rescale_factor_log2(m_old: f32, m_new: f32) -> f32 {
    select(m_new != m_old, exp2(m_old - m_new), 1.0f32)
}

/// Probability weight `2^(raw * scale_log2 - m)` of a raw score `q . k` against a base-2 row max
/// or log-sum-exp `m`, with `scale_log2 = scale * log2(e)`: one fused multiply-add and one `exp2`.
#[cube]
pub fn weight_log2(raw: f32, scale_log2: f32, m: f32) -> f32 {
    exp2(raw * scale_log2 - m)
}

/// A row's log-sum-exp prepared for [`weight_log2`]: `lse * log2(e)`, or the largest finite
/// float for a row that saw no key (`lse = -inf`), whose weights then underflow to exactly 0 with
/// no per-score test (the backward's [`probability_from_lse`] without its select).
#[cube]
pub fn lse_log2(lse: f32) -> f32 {
    select(lse >= FINITE_FLOOR, lse * LOG2_E, f32::MAX)
}
