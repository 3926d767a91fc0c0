//! The layer operations as Burn tensor operations: what every backend runs unless it has a fused
//! kernel (and what `Autodiff` records, so its graph differentiates them).

use burn::tensor::activation::{sigmoid, silu};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorPrimitive};

fn wrap<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn unwrap<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// `silu(gate) * up`.
pub(crate) fn swiglu<B: Backend>(gate: FloatTensor<B>, up: FloatTensor<B>) -> FloatTensor<B> {
    let (gate, up) = (wrap::<B, 3>(gate), wrap::<B, 3>(up));
    unwrap(silu(gate) * up)
}

/// `(hidden, dgate, dup)` of [`swiglu`] for the hidden gradient `dhidden`.
pub(crate) fn swiglu_backward<B: Backend>(
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
    dhidden: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let (gate, up, dhidden) = (wrap::<B, 3>(gate), wrap::<B, 3>(up), wrap::<B, 3>(dhidden));
    let sig = sigmoid(gate.clone());
    let activated = gate.clone() * sig.clone();
    let hidden = activated.clone() * up.clone();
    let dup = dhidden.clone() * activated;
    // silu'(g) = sig(g) * (1 + g * (1 - sig(g)))
    let dsilu = sig.clone() * (gate * (sig.neg().add_scalar(1.0))).add_scalar(1.0);
    let dgate = dhidden * up * dsilu;
    (unwrap(hidden), unwrap(dgate), unwrap(dup))
}

/// `(x * r, r)` in f32, `r = 1 / sqrt(mean(x^2) + eps)` per row `[batch, seq, 1]`.
fn normalise<B: Backend>(x: Tensor<B, 3>, eps: f64) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let x = x.cast(DType::F32);
    let inv_rms = x
        .clone()
        .square()
        .mean_dim(2)
        .add_scalar(eps)
        .sqrt()
        .recip();
    (x * inv_rms.clone(), inv_rms)
}

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension, statistics in f32.
pub(crate) fn rms_norm<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    eps: f64,
) -> FloatTensor<B> {
    let x = wrap::<B, 3>(x);
    let dtype = x.dtype();
    let (normed, _) = normalise(x, eps);
    unwrap(normed.cast(dtype) * wrap::<B, 1>(weight).unsqueeze::<3>())
}

/// `(dx, dweight)` of [`rms_norm`] for the output gradient `grad`.
pub(crate) fn rms_norm_backward<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
    eps: f64,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (x, grad) = (wrap::<B, 3>(x), wrap::<B, 3>(grad));
    let weight = wrap::<B, 1>(weight);
    let dtype = x.dtype();
    let (normed, inv_rms) = normalise(x, eps);
    let [batch, seq, d] = grad.dims();
    let dweight = (grad.clone().cast(DType::F32) * normed.clone())
        .reshape([batch * seq, d])
        .sum_dim(0)
        .reshape([d])
        .cast(weight.dtype());
    let dnormed = (grad * weight.unsqueeze::<3>()).cast(DType::F32);
    let projection = (dnormed.clone() * normed.clone()).mean_dim(2);
    let dx = (dnormed - normed * projection) * inv_rms;
    (unwrap(dx.cast(dtype)), unwrap(dweight))
}

/// `x * cos + rotate_half(x) * sin` (or, with `transpose`, its adjoint
/// `x * cos + rotate_half^T(x * sin)`) over `[batch, heads, len, head_dim]`.
pub(crate) fn rotary<B: Backend>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    transpose: bool,
) -> FloatTensor<B> {
    let (x, cos, sin) = (wrap::<B, 4>(x), wrap::<B, 4>(cos), wrap::<B, 4>(sin));
    let out = if transpose {
        x.clone() * cos + rotate_half(x * sin, true)
    } else {
        x.clone() * cos + rotate_half(x, false) * sin
    };
    unwrap(out)
}

/// `[x1, x2] -> [-x2, x1]` over the last dimension, or its transpose `[u1, u2] -> [u2, -u1]`.
fn rotate_half<B: Backend>(x: Tensor<B, 4>, transpose: bool) -> Tensor<B, 4> {
    let half = x.dims()[3] / 2;
    let first = x.clone().narrow(3, 0, half);
    let second = x.narrow(3, half, half);
    if transpose {
        Tensor::cat(vec![second, first.neg()], 3)
    } else {
        Tensor::cat(vec![second.neg(), first], 3)
    }
}
