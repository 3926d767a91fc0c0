//! Element-wise CubeCL kernels of the layer operations: SwiGLU forward and backward and the
//! rotary embedding. Each computes in f32 and rounds once to the stored type; arrays are read as
//! vectors of `N` elements.

use cubecl::prelude::*;

/// `1 / (1 + exp(-g))`.
#[cube]
fn sigmoid<N: Size>(g: Vector<f32, N>) -> Vector<f32, N> {
    Vector::new(1.0) / (Vector::new(1.0) + Exp::exp(Vector::new(0.0) - g))
}

/// `hidden = silu(gate) * up`.
#[cube(launch_unchecked)]
pub(crate) fn swiglu_forward<F: Float, N: Size>(
    gate: &Array<Vector<F, N>>,
    up: &Array<Vector<F, N>>,
    hidden: &mut Array<Vector<F, N>>,
) {
    let i = ABSOLUTE_POS;
    if i < hidden.len() {
        let g = Vector::<f32, N>::cast_from(gate[i]);
        let u = Vector::<f32, N>::cast_from(up[i]);
        hidden[i] = Vector::cast_from(g * sigmoid::<N>(g) * u);
    }
}

/// The hidden activation again (the down projection's weight gradient needs it) and the
/// gradients of gate and up: `dup = dh silu(g)`,
/// `dgate = dh u sig(g) (1 + g (1 - sig(g)))`.
#[cube(launch_unchecked)]
pub(crate) fn swiglu_backward<F: Float, N: Size>(
    gate: &Array<Vector<F, N>>,
    up: &Array<Vector<F, N>>,
    dhidden: &Array<Vector<F, N>>,
    hidden: &mut Array<Vector<F, N>>,
    dgate: &mut Array<Vector<F, N>>,
    dup: &mut Array<Vector<F, N>>,
) {
    let i = ABSOLUTE_POS;
    if i < hidden.len() {
        let g = Vector::<f32, N>::cast_from(gate[i]);
        let u = Vector::<f32, N>::cast_from(up[i]);
        let dh = Vector::<f32, N>::cast_from(dhidden[i]);
        let sig = sigmoid::<N>(g);
        let activated = g * sig;
        hidden[i] = Vector::cast_from(activated * u);
        dup[i] = Vector::cast_from(dh * activated);
        let one = Vector::new(1.0);
        dgate[i] = Vector::cast_from(dh * u * sig * (one + g * (one - sig)));
    }
}

/// The rotary embedding of `x` (logical `[batch, heads, len, head_dim]` with element strides
/// `stride_batch`, `stride_head`, `stride_row` and a contiguous last dimension) into the
/// contiguous `out`, with tables `cos`, `sin` `[len, head_dim]`, one vector per unit:
/// `out = x cos + rotate_half(x) sin`, `rotate_half([x1, x2]) = [-x2, x1]`; with `transpose`
/// the adjoint `out = x cos + rotate_half^T(x sin)`, `rotate_half^T([u1, u2]) = [u2, -u1]`.
/// `N` divides `head_dim / 2` and the strides.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn rotary<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    cos: &Array<Vector<F, N>>,
    sin: &Array<Vector<F, N>>,
    out: &mut Array<Vector<F, N>>,
    heads: u32,
    len: u32,
    head_dim: u32,
    stride_batch: u32,
    stride_head: u32,
    stride_row: u32,
    #[comptime] transpose: bool,
) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        let n = N::value();
        let vectors = head_dim as usize / n;
        let half = vectors / 2;
        let column = i % vectors;
        let rest = i / vectors;
        let row = rest % len as usize;
        let batch_head = rest / len as usize;
        let head = batch_head % heads as usize;
        let batch = batch_head / heads as usize;
        let base = (batch * stride_batch as usize
            + head * stride_head as usize
            + row * stride_row as usize)
            / n;
        let first = column < half;
        let partner = if first { column + half } else { column - half };
        let table = row * vectors;
        let own = Vector::<f32, N>::cast_from(x[base + column]);
        let other = Vector::<f32, N>::cast_from(x[base + partner]);
        let cos_own = Vector::<f32, N>::cast_from(cos[table + column]);
        // Forward: the partner enters with its sign flipped in the first half, at this column's
        // angle; transposed: with its sign flipped in the second half, at the partner's angle.
        let flip = if transpose { !first } else { first };
        let sin_at = if transpose { partner } else { column };
        let rotated = other * Vector::<f32, N>::cast_from(sin[table + sin_at]);
        // (An `if` expression choosing between -1.0 and 1.0 compiled to 1.0 in both arms in
        // cubecl 0.10; the branch below is what the tests check.)
        let mut result = own * cos_own + rotated;
        if flip {
            result = own * cos_own - rotated;
        }
        out[i] = Vector::cast_from(result);
    }
}
