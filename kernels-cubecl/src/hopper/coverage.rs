//! What the Hopper attention kernels cover, pure logic the forward and the backward share:
//! f16 or bf16, head dim 64 or 128, a positive and finite score scale, and every mask (causal,
//! sliding windows, documents, combined, at any offsets). Each refusal names the kernel and says
//! what runs such calls instead.

use crate::dims::AttentionDims;
use crate::kernel_error::KernelError;
use crate::tensor::ElemType;

/// Head dimensions the Hopper attention kernels are compiled for.
pub const HEAD_DIMS: [usize; 2] = [64, 128];

/// Errors unless `kernel` (its name in the messages) covers attention of `dims` in `elem` with
/// score `scale`: [`KernelError::Unsupported`] for another element type or head dim;
/// [`KernelError::BadOption`] for a scale that is not positive and finite. Every mask is covered.
pub(crate) fn check(
    kernel: &str,
    dims: &AttentionDims,
    elem: ElemType,
    scale: f32,
) -> Result<(), KernelError> {
    let unsupported = |what: String| Err(KernelError::Unsupported { what });
    if !matches!(elem, ElemType::BF16 | ElemType::F16) {
        return unsupported(format!(
            "{kernel} takes bf16 or f16 q, k and v, got {elem:?}"
        ));
    }
    if !HEAD_DIMS.contains(&dims.head_dim) {
        return unsupported(format!(
            "{kernel} is built for head dims {HEAD_DIMS:?}, got {}",
            dims.head_dim
        ));
    }
    if !(scale > 0.0 && scale.is_finite()) {
        return Err(KernelError::BadOption {
            what: format!(
                "{kernel} needs a positive, finite score scale; got {scale} (Variant::Auto runs \
                 other scales on the portable kernels)"
            ),
        });
    }
    Ok(())
}

/// A call of GQA 8/2 over batch 2 with odd lengths (300 queries, 517 keys) at `head_dim`: the
/// plans' tests' fixture.
#[cfg(test)]
pub(crate) fn test_dims(head_dim: usize) -> AttentionDims {
    AttentionDims {
        batch: 2,
        q_heads: 8,
        kv_heads: 2,
        q_len: 300,
        kv_len: 517,
        head_dim,
    }
}
