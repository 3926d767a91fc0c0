//! RMS-norm kernels: one cube per row for the forward and for the input gradient, and the weight
//! gradient as per-chunk column sums followed by a sum over the chunks (fixed order:
//! deterministic). Statistics in f32; arrays read as vectors of `N` elements, rows of `width`.

use cubecl::prelude::*;

use crate::cube_support::{cube_reduce, CUBE_UNITS};

/// `1 / sqrt(mean(x^2) + eps)` of row `row`, in every unit of the cube.
#[cube]
fn inverse_rms<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    base: usize,
    vectors: usize,
    width: u32,
    eps: f32,
) -> f32 {
    let mut squares = 0.0f32;
    let mut j = UNIT_POS as usize;
    while j < vectors {
        let v = Vector::<f32, N>::cast_from(x[base + j]);
        #[unroll]
        for lane in 0..v.vector_size() {
            squares += v[lane] * v[lane];
        }
        j += CUBE_UNITS;
    }
    let total = cube_reduce(squares, false);
    1.0 / Sqrt::sqrt(total / f32::cast_from(width) + eps)
}

/// `out = x r weight`, `r` the row's inverse RMS; cube `row` does row `row`.
#[cube(launch_unchecked)]
pub(crate) fn rms_norm_rows<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    weight: &Array<Vector<F, N>>,
    out: &mut Array<Vector<F, N>>,
    rows: u32,
    width: u32,
    eps: f32,
) {
    let row = CUBE_POS;
    if row >= rows as usize {
        terminate!();
    }
    let vectors = width as usize / N::value();
    let base = row * vectors;
    let r = Vector::new(inverse_rms::<F, N>(x, base, vectors, width, eps));
    let mut j = UNIT_POS as usize;
    while j < vectors {
        let v = Vector::<f32, N>::cast_from(x[base + j]);
        out[base + j] = Vector::cast_from(v * r * Vector::<f32, N>::cast_from(weight[j]));
        j += CUBE_UNITS;
    }
}

/// The input gradient of row `row` (cube `row`):
/// `dx = (dn - x r mean(dn x r)) r` with `dn = grad weight`; also keeps `r` in `inverse_rms`
/// for the weight gradient.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm_backward_rows<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    weight: &Array<Vector<F, N>>,
    grad: &Array<Vector<F, N>>,
    dx: &mut Array<Vector<F, N>>,
    inverse_rms_out: &mut Array<f32>,
    rows: u32,
    width: u32,
    eps: f32,
) {
    let row = CUBE_POS;
    if row >= rows as usize {
        terminate!();
    }
    let vectors = width as usize / N::value();
    let base = row * vectors;
    let r = inverse_rms::<F, N>(x, base, vectors, width, eps);
    let mut dot = 0.0f32;
    let mut j = UNIT_POS as usize;
    while j < vectors {
        let dn =
            Vector::<f32, N>::cast_from(grad[base + j]) * Vector::<f32, N>::cast_from(weight[j]);
        let normed = Vector::<f32, N>::cast_from(x[base + j]) * Vector::new(r);
        let p = dn * normed;
        #[unroll]
        for lane in 0..p.vector_size() {
            dot += p[lane];
        }
        j += CUBE_UNITS;
    }
    let projection = Vector::new(cube_reduce(dot, false) / f32::cast_from(width));
    let mut j = UNIT_POS as usize;
    while j < vectors {
        let dn =
            Vector::<f32, N>::cast_from(grad[base + j]) * Vector::<f32, N>::cast_from(weight[j]);
        let normed = Vector::<f32, N>::cast_from(x[base + j]) * Vector::new(r);
        dx[base + j] = Vector::cast_from((dn - normed * projection) * Vector::new(r));
        j += CUBE_UNITS;
    }
    if UNIT_POS == 0 {
        inverse_rms_out[row] = r;
    }
}

/// Unit `chunk * vectors + column` sums `grad x r` over the rows
/// `chunk * chunk_rows .. (chunk + 1) * chunk_rows` of one column vector into `partials`.
#[cube(launch_unchecked)]
pub(crate) fn rms_norm_weight_partials<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    grad: &Array<Vector<F, N>>,
    inverse_rms: &Array<f32>,
    partials: &mut Array<Vector<f32, N>>,
    rows: u32,
    width: u32,
    chunk_rows: u32,
) {
    let i = ABSOLUTE_POS;
    if i < partials.len() {
        let vectors = width as usize / N::value();
        let column = i % vectors;
        let first = (i / vectors) * chunk_rows as usize;
        let end = min(first + chunk_rows as usize, rows as usize);
        let mut sum = Vector::<f32, N>::new(0.0);
        let mut row = first;
        while row < end {
            let at = row * vectors + column;
            sum += Vector::<f32, N>::cast_from(grad[at])
                * Vector::<f32, N>::cast_from(x[at])
                * Vector::new(inverse_rms[row]);
            row += 1;
        }
        partials[i] = sum;
    }
}

/// `dweight[column] = sum over chunks of partials[chunk, column]`, in the weight's type.
#[cube(launch_unchecked)]
pub(crate) fn rms_norm_weight_sums<F: Float, N: Size>(
    partials: &Array<Vector<f32, N>>,
    dweight: &mut Array<Vector<F, N>>,
    chunks: u32,
) {
    let column = ABSOLUTE_POS;
    let vectors = dweight.len();
    if column < vectors {
        let mut sum = Vector::<f32, N>::new(0.0);
        let mut chunk = 0usize;
        while chunk < chunks as usize {
            sum += partials[chunk * vectors + column];
            chunk += 1;
        }
        dweight[column] = Vector::cast_from(sum);
    }
}
