//! The entry points' checks of their tensor inputs (shapes and element types against q's), shared
//! by the host API and the Hopper kernels' own entry points.

use crate::dims::AttentionDims;
use crate::kernel_error::KernelError;
use crate::tensor::{DeviceTensor, ElemType};

/// The dimensions of q, k and v (`[B, Hq, Sq, D]`, `[B, Hkv, Skv, D]` twice), once their shapes
/// agree and k and v have q's element type.
pub(crate) fn check_qkv(
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
) -> Result<AttentionDims, KernelError> {
    let dims = AttentionDims::from_qkv(&q.shape, &k.shape, &v.shape)?;
    k.expect_elem("k", q.elem)?;
    v.expect_elem("v", q.elem)?;
    Ok(dims)
}

/// The dimensions of a whole attention's backward inputs: [`check_qkv`], then the forward's
/// output `out` and the output gradient `grad_out` (q's shape and type) and its log-sum-exp
/// `lse` (`[B, Hq, Sq]`, f32).
pub(crate) fn check_backward(
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    out: &DeviceTensor,
    lse: &DeviceTensor,
    grad_out: &DeviceTensor,
) -> Result<AttentionDims, KernelError> {
    let dims = check_qkv(q, k, v)?;
    for (name, tensor) in [("out", out), ("grad_out", grad_out)] {
        AttentionDims::expect_shape(name, &dims.q_shape(), &tensor.shape)?;
        tensor.expect_elem(name, q.elem)?;
    }
    AttentionDims::expect_shape("lse", &dims.row_shape(), &lse.shape)?;
    lse.expect_elem("lse", ElemType::F32)?;
    Ok(dims)
}
