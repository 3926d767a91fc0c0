//! Helpers for CubeCL kernels over Burn's `CubeBackend` tensors: kernel arguments of contiguous
//! buffers, vector widths, float types and a cube-wide reduction. Used by this crate's fused layer
//! operations and by the Llama example's training kernels.

mod args;
mod reduce;

pub use crate::with_float_type;
pub use args::{array, contiguous, empty_like, is_kernel_float, vector_size};
pub use half::{bf16, f16};
pub use reduce::{cube_reduce, CUBE_UNITS};
