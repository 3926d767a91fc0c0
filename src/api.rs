//! The functions Burn users call, shaped like `burn::tensor::module::attention`.

use crate::Error;
use burn::tensor::{Tensor, TensorPrimitive};
use distflash_kernels::AttentionDims;

use crate::extension::AttentionBackend;
use crate::inputs::check_inputs;
use crate::options::{check_shapes, FlashAttentionOptions};

/// [`check_inputs`] for a one-shot call, whose q and k rows are the whole sequence: the mask's
/// documents must then span exactly that sequence
/// ([`FlashAttentionOptions::check_one_shot_mask`]), checked before the rest.
fn check_one_shot_inputs<B: AttentionBackend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    options: &FlashAttentionOptions,
) -> Result<AttentionDims, Error> {
    options.check_one_shot_mask(&check_shapes(&q.dims(), &k.dims(), &v.dims())?)?;
    check_inputs(q, k, v, options)
}

/// Exact softmax attention of `q` against `k` and `v`, with `q_heads` a multiple of `kv_heads`
/// (GQA/MQA without repeating k and v). Differentiable under `Autodiff`, with a fused backward.
/// Every input is checked before any work: bad shapes, float types, devices or options, or a
/// call beyond the device's limits, are errors, never panics.
///
/// `options` may mask keys (causal, a [`SlidingWindow`](crate::SlidingWindow), packed
/// [`Documents`](crate::Documents); they combine). A query row that sees no key gets an output
/// of 0 and an lse of `-inf` (never NaN), and passes no gradient.
///
/// # Shapes
///
/// - q: `[batch, q_heads, seq_q, head_dim]`
/// - k: `[batch, kv_heads, seq_kv, head_dim]`
/// - v: `[batch, kv_heads, seq_kv, head_dim]`
/// - output: `[batch, q_heads, seq_q, head_dim]`
///
/// # Errors
///
/// - [`Error::Kernel`] when the shapes are refused (q, k or v not 4-D, k's batch or head_dim
///   not q's, v's shape not k's, `q_heads` not a multiple of `kv_heads`, a head dim outside
///   [`SUPPORTED_HEAD_DIMS`](crate::kernels::SUPPORTED_HEAD_DIMS), an empty or too long
///   sequence: the [`KernelError`](crate::kernels::KernelError) says which); when
///   `options.scale` is not finite
///   ([`KernelError::BadOption`](crate::kernels::KernelError::BadOption)); when
///   `options.mask.documents` is set and `seq_q != seq_kv`, the documents do not end at the
///   sequence length, or they have neither one list nor one per batch row
///   ([`KernelError::BadMask`](crate::kernels::KernelError::BadMask)); on the CubeCL
///   backends, when the call exceeds the device's limits
///   ([`KernelError::DeviceLimit`](crate::kernels::KernelError::DeviceLimit)) or the device runs
///   no kernels on q's float type ([`KernelError::DType`](crate::kernels::KernelError::DType)).
/// - [`Error::DType`] when q is not f16, bf16 or f32, when k or v has another float
///   type than q, or when the backend does not support q's float type on q's device.
/// - [`Error::Device`] when k or v is not on q's device.
///
/// # Panics
///
/// On the CubeCL backends, when the runtime reports a kernel launch as failed after the checks
/// passed (the output is never silently wrong).
pub fn flash_attention<B: AttentionBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    options: FlashAttentionOptions,
) -> Result<Tensor<B, 4>, Error> {
    flash_attention_with_lse(q, k, v, options).map(|(out, _)| out)
}

/// [`flash_attention`] that also returns the log-sum-exp of each query row (`-inf` for a row
/// that sees no key). The lse carries no gradient.
///
/// # Shapes
///
/// - q: `[batch, q_heads, seq_q, head_dim]`
/// - k: `[batch, kv_heads, seq_kv, head_dim]`
/// - v: `[batch, kv_heads, seq_kv, head_dim]`
/// - output: `[batch, q_heads, seq_q, head_dim]`
/// - lse: `[batch, q_heads, seq_q]`, of float type
///   [`AttentionBackend::lse_dtype`] (f32 on the CubeCL backends)
///
/// # Errors
///
/// As [`flash_attention`].
///
/// # Panics
///
/// As [`flash_attention`].
pub fn flash_attention_with_lse<B: AttentionBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    options: FlashAttentionOptions,
) -> Result<(Tensor<B, 4>, Tensor<B, 3>), Error> {
    check_one_shot_inputs(&q, &k, &v, &options)?;
    let (out, lse) = B::flash_attention(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        options,
    );
    Ok((
        Tensor::from_primitive(TensorPrimitive::Float(out)),
        Tensor::from_primitive(TensorPrimitive::Float(lse)),
    ))
}
