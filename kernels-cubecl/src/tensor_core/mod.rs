//! Tensor-core kernels (CUDA `mma.sync` through CubeCL's manual MMA).

use cubecl::prelude::*;

use crate::dims::AttentionDims;
use crate::error::KernelError;
use crate::launch::{GradAccumulators, SoftmaxState};
use crate::tensor::{DeviceTensor, ElemType};

/// Head dimensions the tensor-core kernels are compiled for.
pub const HEAD_DIMS: [usize; 2] = [64, 128];

/// Whether this client can run the tensor-core kernels for `elem` and `head_dim`.
pub fn supports<R: Runtime>(_client: &ComputeClient<R>, _elem: ElemType, _head_dim: usize) -> bool {
    false
}

/// Tensor-core forward step (see [`crate::forward_step`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_step<R: Runtime>(
    _client: &ComputeClient<R>,
    _q: &DeviceTensor,
    _k: &DeviceTensor,
    _v: &DeviceTensor,
    _state: &SoftmaxState,
    _dims: &AttentionDims,
    _scale: f32,
    _shift: Option<i32>,
) -> Result<(), KernelError> {
    unreachable!("supports() is false")
}

/// Tensor-core backward step (see [`crate::backward_step`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_step<R: Runtime>(
    _client: &ComputeClient<R>,
    _q: &DeviceTensor,
    _k: &DeviceTensor,
    _v: &DeviceTensor,
    _grad_out: &DeviceTensor,
    _lse: &DeviceTensor,
    _delta: &DeviceTensor,
    _grads: &GradAccumulators,
    _dims: &AttentionDims,
    _scale: f32,
    _shift: Option<i32>,
) -> Result<(), KernelError> {
    unreachable!("supports() is false")
}
