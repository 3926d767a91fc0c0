//! What launches over `CubeBackend` tensors share: contiguous buffers, their kernel arguments, the
//! vector width and the Rust type of a float dtype.

use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

/// Runs `$launch!(T)` with the Rust float type `T` of a float dtype (bf16, f16, else f32).
#[macro_export]
macro_rules! with_float_type {
    ($dtype:expr, $launch:ident) => {
        match $dtype {
            burn::tensor::DType::BF16 => $launch!($crate::cube_support::bf16),
            burn::tensor::DType::F16 => $launch!($crate::cube_support::f16),
            _ => $launch!(f32),
        }
    };
}

/// Whether the kernels take this element type (f32, f16, bf16).
pub fn is_kernel_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// The widest vector (up to 16 bytes) whose width divides `len` elements of `dtype`.
pub fn vector_size(len: usize, dtype: DType) -> usize {
    let widest = (16 / dtype.size()).max(1);
    [widest, widest / 2, widest / 4]
        .into_iter()
        .find(|&v| v >= 1 && len.is_multiple_of(v))
        .unwrap_or(1)
}

/// `tensor` itself when contiguous, else a contiguous copy.
pub fn contiguous<R: CubeRuntime>(tensor: CubeTensor<R>) -> CubeTensor<R> {
    if tensor.is_contiguous() {
        return tensor;
    }
    let (client, device, dtype) = (tensor.client.clone(), tensor.device.clone(), tensor.dtype);
    let copy = cubecl::std::tensor::into_contiguous(&client, tensor.binding(), dtype.into());
    CubeTensor::new(client, copy.handle, *copy.metadata, device, dtype)
}

/// An uninitialised contiguous tensor of `shape` and `dtype` on the device of `like`.
pub fn empty_like<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: Shape,
    dtype: DType,
) -> CubeTensor<R> {
    burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        shape,
        dtype,
    )
}

/// A contiguous tensor's buffer as a kernel array of `len` elements (a kernel reading it as
/// vectors of `N` sees `len / N` of them).
///
/// # Safety
/// The tensor is contiguous and holds at least `len` elements.
pub unsafe fn array<R: CubeRuntime>(tensor: &CubeTensor<R>, len: usize) -> ArrayArg<R> {
    // SAFETY: as the caller vouches.
    unsafe { ArrayArg::from_raw_parts(tensor.handle.clone(), len) }
}
