//! The CubeCL kernels of the fused cross-entropy: per row of logits, the log-sum-exp and the
//! target's loss in f32; backward, `dlogits = g (softmax - onehot)` written in the logits'
//! element type. The logits are read as vectors of `N` elements; `vocab` is a multiple of `N`.

use cubecl::prelude::*;

use burn_distflash::cube_support::{cube_reduce, CUBE_UNITS};

/// Cube `row` computes `lse[row] = log(sum_j exp(x_j))` over its row of `logits` and
/// `loss[row] = lse[row] - x[target]`, or `invalid` (the launcher passes NaN) when the target is
/// not below the vocabulary size.
#[cube(launch_unchecked)]
pub(crate) fn cross_entropy_rows<F: Float, N: Size, I: Int>(
    logits: &Array<Vector<F, N>>,
    targets: &Array<I>,
    loss: &mut Array<f32>,
    lse: &mut Array<f32>,
    rows: u32,
    vocab: u32,
    invalid: f32,
) {
    let row = CUBE_POS;
    if row >= rows as usize {
        terminate!();
    }
    let n = N::value();
    let vectors = vocab as usize / n;
    let base = row * vectors;
    let mut local_max = f32::new(-1.0e38);
    let mut j = UNIT_POS as usize;
    while j < vectors {
        let x = Vector::<f32, N>::cast_from(logits[base + j]);
        #[unroll]
        for lane in 0..x.vector_size() {
            local_max = max(local_max, x[lane]);
        }
        j += CUBE_UNITS;
    }
    let row_max = cube_reduce(local_max, true);
    let mut local_sum = 0.0f32;
    let mut j = UNIT_POS as usize;
    while j < vectors {
        let x = Vector::<f32, N>::cast_from(logits[base + j]) - Vector::new(row_max);
        let e = Exp::exp(x);
        #[unroll]
        for lane in 0..e.vector_size() {
            local_sum += e[lane];
        }
        j += CUBE_UNITS;
    }
    let row_sum = cube_reduce(local_sum, false);
    if UNIT_POS == 0 {
        let row_lse = row_max + Log::ln(row_sum);
        let target = u32::cast_from(targets[row]);
        let mut row_loss = invalid;
        if target < vocab {
            let x = Vector::<f32, N>::cast_from(logits[base + target as usize / n]);
            row_loss = row_lse - x[target as usize % n];
        }
        lse[row] = row_lse;
        loss[row] = row_loss;
    }
}

/// `dlogits[row, j] = grad[row] exp(x_j - lse[row])`, one vector per unit; the target's
/// element is rewritten by [`cross_entropy_target_grad`].
#[cube(launch_unchecked)]
pub(crate) fn cross_entropy_grad<F: Float, N: Size>(
    logits: &Array<Vector<F, N>>,
    lse: &Array<f32>,
    grad: &Array<f32>,
    dlogits: &mut Array<Vector<F, N>>,
    vocab: u32,
) {
    let i = ABSOLUTE_POS;
    if i < logits.len() {
        let row = i / (vocab as usize / N::value());
        let x = Vector::<f32, N>::cast_from(logits[i]) - Vector::new(lse[row]);
        dlogits[i] = Vector::cast_from(Exp::exp(x) * Vector::new(grad[row]));
    }
}

/// `dlogits[row, target] = grad[row] (exp(x_target - lse[row]) - 1)`, one unit per row, after
/// [`cross_entropy_grad`] (targets not below the vocabulary size are skipped: their loss is NaN).
#[cube(launch_unchecked)]
pub(crate) fn cross_entropy_target_grad<F: Float, I: Int>(
    logits: &Array<F>,
    targets: &Array<I>,
    lse: &Array<f32>,
    grad: &Array<f32>,
    dlogits: &mut Array<F>,
    rows: u32,
    vocab: u32,
) {
    let row = ABSOLUTE_POS;
    if row < rows as usize {
        let target = u32::cast_from(targets[row]);
        if target < vocab {
            let at = row * vocab as usize + target as usize;
            let p = Exp::exp(f32::cast_from(logits[at]) - lse[row]);
            dlogits[at] = F::cast_from(grad[row] * (p - 1.0));
        }
    }
}
