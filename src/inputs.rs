//! The checks of an attention call's q, k, v and options before any work, shared by the one-shot
//! op ([`crate::flash_attention`]) and the sequence-parallel one.

use burn::tensor::{DType, Tensor};
use distflash_kernels::AttentionDims;

use crate::extension::AttentionBackend;
use crate::options::{check_shapes, FlashAttentionOptions};
use crate::Error;

/// q's float type is one the op supports and its device supports; k and v share q's float type
/// and device.
fn check_types_and_devices<B: AttentionBackend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
) -> Result<(), Error> {
    let (dtype, device) = (q.dtype(), q.device());
    if !matches!(dtype, DType::F16 | DType::BF16 | DType::F32) {
        return Err(Error::DType {
            tensor: "q".into(),
            expected: "f16, bf16 or f32".into(),
            got: format!("{dtype:?}"),
        });
    }
    for (name, t) in [("k", k), ("v", v)] {
        if t.dtype() != dtype {
            return Err(Error::DType {
                tensor: name.into(),
                expected: format!("q's float type {dtype:?} (q, k and v share one)"),
                got: format!("{:?}", t.dtype()),
            });
        }
        if t.device() != device {
            return Err(Error::Device {
                tensor: name.into(),
                expected: format!("q's device {device:?} (q, k and v share one)"),
                got: format!("{:?}", t.device()),
            });
        }
    }
    if !B::supports_dtype(&device, dtype) {
        return Err(Error::DType {
            tensor: "q".into(),
            expected: format!("a float type the backend supports on {device:?}"),
            got: format!("{dtype:?}"),
        });
    }
    Ok(())
}

/// Checks everything about one attention call before any work: shapes, float types (and that
/// the device supports them), devices, options (the mask as for rows that may be chunks of a
/// longer sequence, see [`FlashAttentionOptions::check_mask`]), and the backend's limits on the
/// device for the forward and the backward (grid, shared memory; see
/// [`AttentionBackend::check_attention_limits`](crate::AttentionBackend::check_attention_limits)).
pub(crate) fn check_inputs<B: AttentionBackend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    options: &FlashAttentionOptions,
) -> Result<AttentionDims, Error> {
    let dims = check_shapes(&q.dims(), &k.dims(), &v.dims())?;
    check_types_and_devices(q, k, v)?;
    options.check()?;
    options.check_mask(&dims)?;
    B::check_attention_limits(&dims, q.dtype(), &q.device(), options)?;
    Ok(dims)
}
