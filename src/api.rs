//! The functions Burn users call, shaped like `burn::tensor::module::attention`.

use burn::tensor::{DType, Tensor, TensorPrimitive};
use distflash_kernels::AttentionDims;

use crate::backend::FlashAttentionBackend;
use crate::options::{check_shapes, AttentionError, FlashAttentionOptions};

/// q's float type is one the op supports and its device supports; k and v share q's float type
/// and device.
fn check_types_and_devices<B: FlashAttentionBackend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
) -> Result<(), AttentionError> {
    let (dtype, device) = (q.dtype(), q.device());
    if !matches!(dtype, DType::F16 | DType::BF16 | DType::F32) {
        return Err(AttentionError::DType(format!(
            "q is {dtype:?}; supported float types are f16, bf16 and f32"
        )));
    }
    for (name, t) in [("k", k), ("v", v)] {
        if t.dtype() != dtype {
            return Err(AttentionError::DType(format!(
                "{name} is {:?} but q is {dtype:?}; q, k and v must share one float type",
                t.dtype()
            )));
        }
        if t.device() != device {
            return Err(AttentionError::Device(format!(
                "{name} is on {:?} but q is on {device:?}; q, k and v must share one device",
                t.device()
            )));
        }
    }
    if !B::supports_dtype(&device, dtype) {
        return Err(AttentionError::DType(format!(
            "{dtype:?} is not supported on {device:?}"
        )));
    }
    Ok(())
}

/// Checks everything about one attention call before any work: shapes, float types (and that
/// the device supports them), devices, options, and the backend's limits on the device for the
/// forward and the backward (grid, shared memory; see
/// [`FlashAttentionBackend::check_attention_limits`]).
pub(crate) fn check_inputs<B: FlashAttentionBackend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    options: &FlashAttentionOptions,
) -> Result<AttentionDims, AttentionError> {
    let dims = check_shapes(&q.dims(), &k.dims(), &v.dims())?;
    check_types_and_devices(q, k, v)?;
    options.check()?;
    B::check_attention_limits(&dims, q.dtype(), &q.device())?;
    Ok(dims)
}

/// Exact softmax attention: q `[B, Hq, Sq, D]`, k and v `[B, Hkv, Skv, D]` with `Hq` a multiple
/// of `Hkv` (GQA/MQA without repeating k and v), returns O `[B, Hq, Sq, D]`. Differentiable under
/// `Autodiff`, with a fused backward. Every input is checked before any work (see
/// [`AttentionError`]): bad shapes, float types, devices or options, or a call beyond the
/// device's limits, are errors, never panics.
pub fn flash_attention<B: FlashAttentionBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    options: FlashAttentionOptions,
) -> Result<Tensor<B, 4>, AttentionError> {
    flash_attention_with_lse(q, k, v, options).map(|(out, _)| out)
}

/// [`flash_attention`] that also returns the log-sum-exp of each query row `[B, Hq, Sq]`
/// (`-inf` for a row that sees no key). The lse carries no gradient.
pub fn flash_attention_with_lse<B: FlashAttentionBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    options: FlashAttentionOptions,
) -> Result<(Tensor<B, 4>, Tensor<B, 3>), AttentionError> {
    check_inputs(&q, &k, &v, &options)?;
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
