//! Tensor-core kernels (CUDA `mma.sync` m16n8k16 through CubeCL's manual MMA): forward step,
//! and the backward step as one dK/dV kernel that also adds dQ with atomics, or (deterministic)
//! a dQ kernel and a dK/dV kernel.

pub mod backward;
pub mod dq_fragments;
pub mod forward;
pub mod fragments;
pub mod tiles;
pub mod warp_tile;

use cubecl::features::MmaConfig;
use cubecl::prelude::*;

use crate::dims::AttentionDims;
use crate::error::KernelError;
use crate::grid::{self, Rows};
use crate::launch::{GradAccumulators, SoftmaxState};
use crate::limits::DeviceLimits;
use crate::tensor::{DeviceTensor, ElemType};
use backward::{KEY_ROWS, QUERY_ROWS};
use forward::{BLOCK_KEYS, BLOCK_ROWS, UNITS};
use tiles::padded_stride;

/// Head dimensions the tensor-core kernels are compiled for.
pub const HEAD_DIMS: [usize; 2] = [64, 128];

/// Whether this client can run the tensor-core kernels for `elem` and `head_dim`: f16 or bf16
/// inputs, a supported head dimension, planes of 32, asynchronous copies and `m16n8k16` manual
/// MMA with f32 accumulation (shared memory is checked with the launch plan, [`grids`]).
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

/// Shared memory of the hungriest of the three kernels at `head_dim`, in bytes (f16/bf16 tiles,
/// rows padded to [`padded_stride`], each 16-byte aligned, plus barriers): the forward's
/// [`BLOCK_ROWS`] query rows and two [`BLOCK_KEYS`]-row key/value tiles, the dQ kernel's Q and
/// dO tiles and double-buffered K and V tiles, the dK/dV kernel's K and V tiles and
/// double-buffered Q and dO tiles, f32 lse and delta rows and (fused) its dS tile. Must
/// cover every kernel's `SharedMemory` declarations: the host checks it against the device
/// before choosing this variant.
pub(crate) fn shared_memory_bytes(head_dim: usize) -> usize {
    let tile = |rows: usize| (rows * padded_stride(head_dim) * 2).next_multiple_of(16) + 16;
    let barrier = 16;
    let forward = tile(BLOCK_ROWS) + 2 * tile(BLOCK_KEYS) + 2 * barrier;
    let dq = 2 * tile(QUERY_ROWS) + 2 * tile(2 * KEY_ROWS) + 2 * barrier;
    let ds = (backward::ds_tile_elems(true) * 2).next_multiple_of(16) + 16;
    let dkdv = 2 * tile(KEY_ROWS)
        + 2 * tile(2 * QUERY_ROWS)
        + 2 * (2 * QUERY_ROWS * 4 + 16)
        + ds
        + 2 * barrier;
    forward.max(dq).max(dkdv)
}

/// The grids of the three kernels for one call, slice-major (see [`crate::grid::slice_major`]:
/// x = the (batch, head) slice, y = block of rows), so that every slice's first blocks (the
/// heaviest under a causal mask, where the kernels take blocks in that order) start first.
#[derive(Debug, Clone)]
pub(crate) struct Grids {
    /// Forward: blocks of [`BLOCK_ROWS`] query rows, slices = batch * q_heads.
    pub forward: CubeCount,
    /// dQ: blocks of [`QUERY_ROWS`] query rows, slices = batch * q_heads.
    pub dq: CubeCount,
    /// dK/dV: blocks of [`KEY_ROWS`] keys, slices = batch * kv_heads.
    pub dkdv: CubeCount,
}

/// The kernels' grids for `dims`, once their cubes, shared memory and grids are known to fit
/// `limits`.
pub(crate) fn grids(dims: &AttentionDims, limits: &DeviceLimits) -> Result<Grids, KernelError> {
    limits.expect_units("the tensor-core kernels", UNITS)?;
    limits.expect_shared(
        "the tensor-core kernels",
        shared_memory_bytes(dims.head_dim),
    )?;
    let blocks = |kernel, rows, per_block| grid::slice_major(kernel, dims, rows, per_block, limits);
    Ok(Grids {
        forward: blocks("the tensor-core forward", Rows::Query, BLOCK_ROWS)?,
        dq: blocks("the tensor-core dQ kernel", Rows::Query, QUERY_ROWS)?,
        dkdv: blocks("the tensor-core dK/dV kernel", Rows::Key, KEY_ROWS)?,
    })
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
    grids: &Grids,
    scale: f32,
    shift: Option<i32>,
) {
    let dim = CubeDim::new_1d(UNITS as u32);
    // SAFETY: shapes were validated by `launch::forward_step`; the kernel guards every global
    // access against `q_len`/`kv_len` (see `forward_step_mma`).
    crate::launch::with_elem_type!(q.elem, E => unsafe { forward::forward_step_mma::launch_unchecked::<E, R>(
        client,
        grids.forward.clone(),
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
}

/// Tensor-core backward step (see [`crate::backward_step`]): given a zeroed `dq_scratch` (see
/// [`dq_fragments`]), the dK/dV kernel alone, adding dQ to the scratch with f32 atomics (the
/// caller then adds the scratch to `grads.dq`); without, the dQ kernel and the dK/dV kernel.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_step<R: Runtime>(
    client: &ComputeClient<R>,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    grad_out: &DeviceTensor,
    lse: &DeviceTensor,
    delta: &DeviceTensor,
    grads: &GradAccumulators,
    dims: &AttentionDims,
    grids: &Grids,
    scale: f32,
    shift: Option<i32>,
    dq_scratch: Option<&DeviceTensor>,
) {
    let dim = CubeDim::new_1d(UNITS as u32);
    // SAFETY: shapes were validated by `launch::backward_step`; the kernels guard every global
    // access against `q_len`/`kv_len`.
    if dq_scratch.is_none() {
        crate::launch::with_elem_type!(q.elem, E => unsafe { backward::backward_dq_mma::launch_unchecked::<E, R>(
        client,
        grids.dq.clone(),
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
    }
    // SAFETY: as above.
    crate::launch::with_elem_type!(q.elem, E => unsafe { backward::backward_dkdv_mma::launch_unchecked::<E, R>(
        client,
        grids.dkdv.clone(),
        dim,
        q.array_arg(),
        k.array_arg(),
        v.array_arg(),
        grad_out.array_arg(),
        lse.array_arg(),
        delta.array_arg(),
        grads.dk.array_arg(),
        grads.dv.array_arg(),
        dq_scratch.unwrap_or(&grads.dq).array_arg(),
        scale,
        shift.unwrap_or(0),
        dims.q_len as u32,
        dims.kv_len as u32,
        dims.kv_heads as u32,
        dims.group_size() as u32,
        dims.head_dim,
        shift.is_some(),
        dq_scratch.is_some(),
    ) });
}
