//! Attention from Burn tensor operations, for backends without this project's kernels (ndarray,
//! or any other): exact and differentiable-free (the backward is explicit), but it materialises
//! the `[B, H, Sq, Skv]` score matrix, so it is slower and uses memory quadratic in the length.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Bool, Int, Tensor, TensorData, TensorMetadata, TensorPrimitive};

use crate::matmul::matmul;
use crate::options::{FlashAttentionOptions, Mask};
use crate::step::{self, AttentionState};

/// Large negative finite value standing in for `-inf` where `-inf - -inf` would give NaN.
const FLOOR: f64 = -1e30;

fn tensor<B: Backend>(primitive: FloatTensor<B>) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

fn primitive<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> FloatTensor<B> {
    tensor.into_primitive().tensor()
}

/// Repeats each key/value head for the `group` query heads that share it.
fn expand_heads<B: Backend>(t: Tensor<B, 4>, group: usize) -> Tensor<B, 4> {
    if group == 1 {
        return t;
    }
    let [b, h, s, d] = t.dims();
    t.unsqueeze_dim::<5>(2)
        .expand([b, h, group, s, d])
        .reshape([b, h * group, s, d])
}

/// Sums the gradients of the `group` query heads that share a key/value head.
fn sum_heads<B: Backend>(t: Tensor<B, 4>, group: usize) -> Tensor<B, 4> {
    if group == 1 {
        return t;
    }
    let [b, h, s, d] = t.dims();
    t.reshape([b, h / group, group, s, d])
        .sum_dim(2)
        .reshape([b, h / group, s, d])
}

/// `[rows, Sq, Skv]` mask of the (query, key) pairs `mask` hides in a `batch`-row call, or
/// `None` when it hides none. `rows` is `batch` when the documents differ per batch row, 1
/// otherwise (broadcast over the batch). Each query row's visible keys are one contiguous range
/// (see [`Mask::visible_keys`]), so the host computes two bounds per row and the device compares
/// key indices against them: `O(rows * Sq)` host work, whatever the mask's parts.
fn hidden_pairs<B: Backend>(
    mask: &Mask,
    batch: usize,
    q_len: usize,
    kv_len: usize,
    device: &B::Device,
) -> Option<Tensor<B, 3, Bool>> {
    if !mask.is_masked() {
        return None;
    }
    let rows = match &mask.documents {
        Some(documents) if documents.batch_rows() > 1 => batch,
        _ => 1,
    };
    let (mut starts, mut ends) = (
        Vec::with_capacity(rows * q_len),
        Vec::with_capacity(rows * q_len),
    );
    for b in 0..rows {
        for i in 0..q_len {
            let visible = mask.visible_keys(b, i, kv_len);
            starts.push(visible.start as i64);
            ends.push(visible.end as i64);
        }
    }
    if starts.iter().all(|&s| s == 0) && ends.iter().all(|&e| e == kv_len as i64) {
        return None;
    }
    let shape = [rows, q_len, kv_len];
    let bound = |values: Vec<i64>| {
        Tensor::<B, 3, Int>::from_data(TensorData::new(values, [rows, q_len, 1]), device)
            .expand(shape)
    };
    let keys = Tensor::<B, 1, Int>::arange(0..kv_len as i64, device)
        .reshape([1, 1, kv_len])
        .expand(shape);
    let before = keys.clone().lower(bound(starts));
    let after = keys.greater_equal(bound(ends));
    Some(before.bool_or(after))
}

/// The score scale of `options` for head dim `head_dim`, in f64 (the default computed in f64, so
/// f64 tensors keep their precision).
fn scale(options: &FlashAttentionOptions, head_dim: usize) -> f64 {
    options
        .scale
        .map_or(1.0 / (head_dim as f64).sqrt(), f64::from)
}

/// Masked, scaled scores `[B, Hq, Sq, Skv]`, the expanded k, v and the group size.
fn scores<B: Backend>(
    q: &Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    options: &FlashAttentionOptions,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>, usize) {
    let [b, hq, sq, d] = q.dims();
    let [_, hkv, skv, _] = k.dims();
    let group = hq / hkv;
    let (k, v) = (expand_heads(k, group), expand_heads(v, group));
    let mut s = matmul(q.clone(), k.clone().swap_dims(2, 3)).mul_scalar(scale(options, d));
    if let Some(hidden) = hidden_pairs::<B>(&options.mask, b, sq, skv, &q.device()) {
        let hidden = hidden.unsqueeze_dim::<4>(1).expand([b, hq, sq, skv]);
        s = s.mask_fill(hidden, f64::NEG_INFINITY);
    }
    (s, k, v, group)
}

/// The partial state `(m, l, o)` of q against one key/value chunk: running max (`-inf` for rows
/// that see no key of the chunk), running sum (0 for those rows) and unnormalised output (0).
pub fn partial<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    options: &FlashAttentionOptions,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let q = tensor::<B>(q);
    let (s, _, v, _) = scores(&q, tensor::<B>(k), tensor::<B>(v), options);
    let max = s.clone().max_dim(3);
    let p = (s - max.clone().clamp_min(FLOOR)).exp();
    let sum = p.clone().sum_dim(3);
    let out = matmul(p, v);
    (
        primitive(max.squeeze_dim::<3>(3)),
        primitive(sum.squeeze_dim::<3>(3)),
        primitive(out),
    )
}

/// Folds one key/value chunk into the state, as the merge of the state with the chunk's own
/// partial (computed from tensor operations).
pub fn forward_step<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    state: AttentionState<B>,
    options: FlashAttentionOptions,
) -> AttentionState<B> {
    let (m, l, o) = partial::<B>(q, k, v, &options);
    step::merge(state, AttentionState { o, m, l })
}

/// `(O, lse)`; a row that sees no key gets `O = 0`, `lse = -inf`.
pub fn forward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    options: FlashAttentionOptions,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let dtype = q.dtype();
    let (m, l, o) = partial::<B>(q, k, v, &options);
    step::finalize::<B>(AttentionState { o, m, l }, dtype)
}

/// One (query chunk, key chunk) pair's `(dq, dk, dv)` from the full rows' lse and delta.
#[allow(clippy::too_many_arguments)]
pub fn gradients<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    grad_out: FloatTensor<B>,
    lse: FloatTensor<B>,
    delta: FloatTensor<B>,
    options: FlashAttentionOptions,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let q = tensor::<B>(q);
    let resolved = scale(&options, q.dims()[3]);
    let (s, k, v, group) = scores(&q, tensor::<B>(k), tensor::<B>(v), &options);
    let lse = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(lse))
        .clamp_min(FLOOR)
        .unsqueeze_dim::<4>(3);
    let delta = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(delta)).unsqueeze_dim::<4>(3);
    let p = (s - lse).exp();
    let grad_out = tensor::<B>(grad_out);
    let dv = matmul(p.clone().swap_dims(2, 3), grad_out.clone());
    let dp = matmul(grad_out, v.swap_dims(2, 3));
    let ds = p * (dp - delta);
    let dq = matmul(ds.clone(), k).mul_scalar(resolved);
    let dk = matmul(ds.swap_dims(2, 3), q).mul_scalar(resolved);
    (
        primitive(dq),
        primitive(sum_heads(dk, group)),
        primitive(sum_heads(dv, group)),
    )
}

/// `(dq, dk, dv)` from O, lse and dO.
#[allow(clippy::too_many_arguments)]
pub fn backward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    grad_out: FloatTensor<B>,
    options: FlashAttentionOptions,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let delta = step::delta::<B>(out, grad_out.clone());
    gradients::<B>(q, k, v, grad_out, lse, delta, options)
}
