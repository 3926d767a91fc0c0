//! Tensor-core kernels (CUDA `mma.sync` m16n8k16 through CubeCL's manual MMA): forward step,
//! and the backward step as a dQ kernel and a dK/dV kernel.

pub mod backward;
pub mod forward;
pub mod fragments;
pub mod tiles;
pub mod warp_tile;

use cubecl::features::MmaConfig;
use cubecl::prelude::*;

use crate::dims::AttentionDims;
use crate::error::KernelError;
use crate::launch::{GradAccumulators, SoftmaxState};
use crate::tensor::{DeviceTensor, ElemType};
use forward::{BLOCK_KEYS, BLOCK_ROWS, UNITS};

/// Head dimensions the tensor-core kernels are compiled for.
pub const HEAD_DIMS: [usize; 2] = [64, 128];

/// Whether this client can run the tensor-core kernels for `elem` and `head_dim`: f16 or bf16
/// inputs, a supported head dimension, planes of 32, asynchronous copies and `m16n8k16` manual
/// MMA with f32 accumulation.
pub fn supports<R: Runtime>(client: &ComputeClient<R>, elem: ElemType, head_dim: usize) -> bool {
    let storage = match elem {
        ElemType::F16 => half::f16::as_type_native_unchecked().storage_type(),
        ElemType::BF16 => half::bf16::as_type_native_unchecked().storage_type(),
        ElemType::F32 => return false,
    };
    let properties = client.properties();
    let config = MmaConfig {
        a_type: storage,
        b_type: storage,
        cd_type: f32::as_type_native_unchecked().storage_type(),
        m: 16,
        n: 8,
        k: 16,
    };
    HEAD_DIMS.contains(&head_dim)
        && properties.hardware.plane_size_min == 32
        && properties.hardware.plane_size_max == 32
        && properties.features.copy_async
        && properties.features.matmul.mma.contains(&config)
}

/// Tensor-core forward step (see [`crate::forward_step`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_step<R: Runtime>(
    client: &ComputeClient<R>,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    state: &SoftmaxState,
    dims: &AttentionDims,
    scale: f32,
    shift: Option<i32>,
) -> Result<(), KernelError> {
    let count = CubeCount::Static(
        dims.q_len.div_ceil(BLOCK_ROWS) as u32,
        (dims.batch * dims.q_heads) as u32,
        1,
    );
    let dim = CubeDim::new_1d(UNITS as u32);
    // SAFETY: shapes were validated by `launch::forward_step`; the kernel guards every global
    // access against `q_len`/`kv_len` (see `forward_step_mma`).
    crate::launch::with_elem_type!(q.elem, E => unsafe { forward::forward_step_mma::launch_unchecked::<E, R>(
        client,
        count,
        dim,
        q.array_arg(),
        k.array_arg(),
        v.array_arg(),
        state.o.array_arg(),
        state.m.array_arg(),
        state.l.array_arg(),
        scale,
        shift.unwrap_or(0),
        dims.q_len as u32,
        dims.kv_len as u32,
        dims.q_heads as u32,
        dims.group_size() as u32,
        dims.head_dim,
        shift.is_some(),
    ) });
    Ok(())
}

/// Tensor-core backward step (see [`crate::backward_step`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_step<R: Runtime>(
    client: &ComputeClient<R>,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    grad_out: &DeviceTensor,
    lse: &DeviceTensor,
    delta: &DeviceTensor,
    grads: &GradAccumulators,
    dims: &AttentionDims,
    scale: f32,
    shift: Option<i32>,
) -> Result<(), KernelError> {
    let dim = CubeDim::new_1d(UNITS as u32);
    let query_blocks = CubeCount::Static(
        dims.q_len.div_ceil(BLOCK_ROWS) as u32,
        (dims.batch * dims.q_heads) as u32,
        1,
    );
    // SAFETY: shapes were validated by `launch::backward_step`; the kernels guard every global
    // access against `q_len`/`kv_len`.
    crate::launch::with_elem_type!(q.elem, E => unsafe { backward::backward_dq_mma::launch_unchecked::<E, R>(
        client,
        query_blocks,
        dim,
        q.array_arg(),
        k.array_arg(),
        v.array_arg(),
        grad_out.array_arg(),
        lse.array_arg(),
        delta.array_arg(),
        grads.dq.array_arg(),
        scale,
        shift.unwrap_or(0),
        dims.q_len as u32,
        dims.kv_len as u32,
        dims.q_heads as u32,
        dims.group_size() as u32,
        dims.head_dim,
        shift.is_some(),
    ) });
    let key_blocks = CubeCount::Static(
        dims.kv_len.div_ceil(BLOCK_KEYS) as u32,
        (dims.batch * dims.kv_heads) as u32,
        1,
    );
    // SAFETY: as above.
    crate::launch::with_elem_type!(q.elem, E => unsafe { backward::backward_dkdv_mma::launch_unchecked::<E, R>(
        client,
        key_blocks,
        dim,
        q.array_arg(),
        k.array_arg(),
        v.array_arg(),
        grad_out.array_arg(),
        lse.array_arg(),
        delta.array_arg(),
        grads.dk.array_arg(),
        grads.dv.array_arg(),
        scale,
        shift.unwrap_or(0),
        dims.q_len as u32,
        dims.kv_len as u32,
        dims.kv_heads as u32,
        dims.group_size() as u32,
        dims.head_dim,
        shift.is_some(),
    ) });
    Ok(())
}
