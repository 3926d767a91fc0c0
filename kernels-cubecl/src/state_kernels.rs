//! Element- and row-wise kernels on the running softmax state: fill, merge two partials,
//! finalise, the cast of f32 accumulators, and the backward's `delta = rowsum(dO * O)`.
//! The row-wise kernels give each row [`ROW_LANES`] units, unit `lane` taking elements `lane`,
//! `lane + ROW_LANES`, ...: the units of a warp read and write whole rows with contiguous
//! accesses (one unit per row would touch a different memory line with every unit). The
//! arithmetic is the shared [`crate::stats`] logic.

use cubecl::prelude::*;

use crate::stats::{log_sum_exp, output_normaliser, rescale_factor};

/// Units per cube of the element-wise kernels (fill, cast, the dQ scratch unpacking).
pub(crate) const ELEMENT_UNITS: usize = 256;
/// Units that share one row in the row-wise kernels (merge, finalize, delta).
pub const ROW_LANES: usize = 32;
/// Units per cube of the row-wise kernels: [`ROW_UNITS`] / [`ROW_LANES`] rows per cube.
pub const ROW_UNITS: usize = 256;

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

/// Merges the partial state `(o2, m2, l2)` into `(o1, m1, l1)` in place. Launched on
/// `rows * ROW_LANES` units in cubes of [`ROW_UNITS`].
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
    let row = ABSOLUTE_POS / ROW_LANES;
    let lane = ABSOLUTE_POS % ROW_LANES;
    let in_range = row < rows as usize;
    let mut m_new = 0.0f32;
    let mut l_new = 0.0f32;
    if in_range {
        let m_a = m1[row];
        let m_b = m2[row];
        m_new = max(m_a, m_b);
        let w_a = rescale_factor(m_a, m_new);
        let w_b = rescale_factor(m_b, m_new);
        l_new = w_a * l1[row] + w_b * l2[row];
        #[unroll]
        for j in 0..comptime!(head_dim.div_ceil(ROW_LANES)) {
            let d = lane + j * ROW_LANES;
            if d < head_dim {
                let at = row * head_dim + d;
                o1[at] = w_a * o1[at] + w_b * o2[at];
            }
        }
    }
    // Every unit of the row has read the old statistics before one of them overwrites them.
    sync_cube();
    if in_range && lane == 0 {
        m1[row] = m_new;
        l1[row] = l_new;
    }
}

/// `out = o / l` cast to the output element type, `lse = m + ln l`; rows that saw no key give
/// `out = 0`, `lse = -inf`. Launched on `rows * ROW_LANES` units in cubes of [`ROW_UNITS`].
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
    let row = ABSOLUTE_POS / ROW_LANES;
    let lane = ABSOLUTE_POS % ROW_LANES;
    if row < rows as usize {
        let l_i = l[row];
        let inv = output_normaliser(l_i);
        #[unroll]
        for j in 0..comptime!(head_dim.div_ceil(ROW_LANES)) {
            let d = lane + j * ROW_LANES;
            if d < head_dim {
                let at = row * head_dim + d;
                out[at] = E::cast_from(o[at] * inv);
            }
        }
        if lane == 0 {
            lse[row] = log_sum_exp(m[row], l_i);
        }
    }
}

/// `delta[row] = sum_d dO[row, d] * O[row, d]` in f32: each unit sums its share of the row, and
/// the row's first unit adds the [`ROW_LANES`] partial sums in a fixed order (deterministic).
/// Launched on `rows * ROW_LANES` units in cubes of [`ROW_UNITS`].
#[cube(launch)]
pub fn backward_delta<E: Float>(
    out: &Array<E>,
    grad_out: &Array<E>,
    delta: &mut Array<f32>,
    rows: u32,
    #[comptime] head_dim: usize,
) {
    let row = ABSOLUTE_POS / ROW_LANES;
    let lane = ABSOLUTE_POS % ROW_LANES;
    let in_range = row < rows as usize;
    let mut partials = SharedMemory::<f32>::new(ROW_UNITS);
    let mut sum = 0.0f32;
    if in_range {
        #[unroll]
        for j in 0..comptime!(head_dim.div_ceil(ROW_LANES)) {
            let d = lane + j * ROW_LANES;
            if d < head_dim {
                let at = row * head_dim + d;
                sum += f32::cast_from(out[at]) * f32::cast_from(grad_out[at]);
            }
        }
    }
    partials[UNIT_POS as usize] = sum;
    sync_cube();
    if in_range && lane == 0 {
        let mut total = 0.0f32;
        for i in 0..ROW_LANES {
            total += partials[UNIT_POS as usize + i];
        }
        delta[row] = total;
    }
}
