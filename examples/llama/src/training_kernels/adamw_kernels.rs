//! The CubeCL kernels behind [`super::backend`]: one pass per parameter for the AdamW update and
//! one for a gradient's squared norm, both computing in f32 whatever the stored element type.
//! Every array is contiguous and read as vectors of `N` elements.

use cubecl::prelude::*;

use burn_distflash::cube_support::cube_reduce;

/// AdamW's constants for one step, as the update kernel takes them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Decay of the first moment.
    pub beta_1: f32,
    /// Decay of the second moment.
    pub beta_2: f32,
    /// `1 - beta_1^t` at step `t` (bias correction of the first moment).
    pub bias_1: f32,
    /// `1 - beta_2^t` at step `t`.
    pub bias_2: f32,
    /// Added to the corrected second moment's square root.
    pub epsilon: f32,
    /// `1 - lr * weight_decay`: the decoupled weight decay's factor on the parameter.
    pub decay: f32,
    /// Learning rate.
    pub lr: f32,
}

/// One AdamW update of a parameter, element by element, with Burn's `AdamW` formulas:
/// `m = m b1 + g (1 - b1)`, `v = v b2 + g^2 (1 - b2)`,
/// `p = p decay - lr (m / bias_1) / (sqrt(v / bias_2) + eps)`, reading each input and writing
/// each output once (Burn's tensor-op AdamW runs 15 passes). An output may alias its input (the
/// launcher passes CubeCL's `ArrayArg::Alias`): unit `i` reads every input's element `i` before
/// it writes any output's.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw_update<F: Float, N: Size>(
    param: &Array<Vector<F, N>>,
    grad: &Array<Vector<F, N>>,
    moment_1: &Array<Vector<F, N>>,
    moment_2: &Array<Vector<F, N>>,
    param_out: &mut Array<Vector<F, N>>,
    moment_1_out: &mut Array<Vector<F, N>>,
    moment_2_out: &mut Array<Vector<F, N>>,
    beta_1: f32,
    beta_2: f32,
    bias_1: f32,
    bias_2: f32,
    epsilon: f32,
    decay: f32,
    lr: f32,
) {
    let i = ABSOLUTE_POS;
    if i < param.len() {
        let g = Vector::<f32, N>::cast_from(grad[i]);
        let m = Vector::<f32, N>::cast_from(moment_1[i]) * Vector::new(beta_1)
            + g * Vector::new(1.0 - beta_1);
        let v = Vector::<f32, N>::cast_from(moment_2[i]) * Vector::new(beta_2)
            + g * g * Vector::new(1.0 - beta_2);
        let step = (m / Vector::new(bias_1))
            / (Sqrt::sqrt(v / Vector::new(bias_2)) + Vector::new(epsilon));
        let p = Vector::<f32, N>::cast_from(param[i]) * Vector::new(decay) - step * Vector::new(lr);
        param_out[i] = Vector::cast_from(p);
        moment_1_out[i] = Vector::cast_from(m);
        moment_2_out[i] = Vector::cast_from(v);
    }
}

/// Partial sums of squares: unit `u` of the `units` launched adds `x^2` (in f32) over vectors
/// `u`, `u + units`, ..., and cube `c` writes the sum of its units' partials to `partials[c]`
/// (a fixed-order tree: deterministic). Launched in cubes of
/// [`CUBE_UNITS`](crate::cube_reduce::CUBE_UNITS).
#[cube(launch_unchecked)]
pub(crate) fn sum_of_squares<F: Float, N: Size>(
    input: &Array<Vector<F, N>>,
    partials: &mut Array<f32>,
    units: u32,
) {
    let mut acc = Vector::<f32, N>::new(0.0);
    let mut i = ABSOLUTE_POS;
    while i < input.len() {
        let x = Vector::<f32, N>::cast_from(input[i]);
        acc += x * x;
        i += units as usize;
    }
    let mut sum = 0.0f32;
    #[unroll]
    for lane in 0..acc.vector_size() {
        sum += acc[lane];
    }
    let total = cube_reduce(sum, false);
    if UNIT_POS == 0 {
        partials[CUBE_POS] = total;
    }
}
