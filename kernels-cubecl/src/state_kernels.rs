//! Element- and row-wise kernels on the running softmax state: fill, merge two partials,
//! finalise, and the cast of f32 accumulators.
//! One unit per row; the arithmetic is the shared [`crate::stats`] logic.

use cubecl::prelude::*;

use crate::stats::{log_sum_exp, output_normaliser, rescale_factor};

/// Fills a f32 buffer with `value` (zeros for accumulators, `-inf` for an empty running max).
#[cube(launch)]
pub fn fill_f32(buffer: &mut Array<f32>, value: f32, len: u32) {
    if ABSOLUTE_POS < len as usize {
        buffer[ABSOLUTE_POS] = value;
    }
}

/// Casts an f32 accumulator to the element type of the tensors it belongs to.
#[cube(launch)]
pub fn cast_from_f32<E: Float>(input: &Array<f32>, output: &mut Array<E>, len: u32) {
    if ABSOLUTE_POS < len as usize {
        output[ABSOLUTE_POS] = E::cast_from(input[ABSOLUTE_POS]);
    }
}

/// Merges the partial state `(o2, m2, l2)` into `(o1, m1, l1)` in place.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn merge_states(
    o1: &mut Array<f32>,
    m1: &mut Array<f32>,
    l1: &mut Array<f32>,
    o2: &Array<f32>,
    m2: &Array<f32>,
    l2: &Array<f32>,
    rows: u32,
    #[comptime] head_dim: usize,
) {
    let row = ABSOLUTE_POS;
    if row < rows as usize {
        let m_a = m1[row];
        let m_b = m2[row];
        let m_new = max(m_a, m_b);
        let w_a = rescale_factor(m_a, m_new);
        let w_b = rescale_factor(m_b, m_new);
        l1[row] = w_a * l1[row] + w_b * l2[row];
        m1[row] = m_new;
        for d in 0..head_dim {
            let at = row * head_dim + d;
            o1[at] = w_a * o1[at] + w_b * o2[at];
        }
    }
}

/// `out = o / l` cast to the output element type, `lse = m + ln l`; rows that saw no key give
/// `out = 0`, `lse = -inf`.
#[cube(launch)]
pub fn finalize_state<E: Float>(
    o: &Array<f32>,
    m: &Array<f32>,
    l: &Array<f32>,
    out: &mut Array<E>,
    lse: &mut Array<f32>,
    rows: u32,
    #[comptime] head_dim: usize,
) {
    let row = ABSOLUTE_POS;
    if row < rows as usize {
        let l_i = l[row];
        let inv = output_normaliser(l_i);
        for d in 0..head_dim {
            let at = row * head_dim + d;
            out[at] = E::cast_from(o[at] * inv);
        }
        lse[row] = log_sum_exp(m[row], l_i);
    }
}
