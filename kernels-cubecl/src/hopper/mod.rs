//! Kernels for Hopper GPUs (CUDA compute capability 9.0): CUDA C++ with inline PTX for what
//! CubeCL 0.10 cannot express (warpgroup MMA `wgmma`, `setmaxnreg`, bulk tensor copies completing
//! on mbarriers, warp-specialised pipelines), compiled by the CUDA runtime's NVRTC for `sm_90a`
//! and launched through CubeCL like every other kernel ([`source_task`]): same stream, memory
//! pools and buffer handles. ARCHITECTURE.md ("Hopper kernels: the route") says why.
//!
//! Three kernels: the attention forward ([`attention_forward`]) and backward
//! ([`attention_backward`]), what `Variant::Hopper` and, where they cover the call,
//! `Variant::Auto` run for a whole attention and for the steps of the stat-carrying contract
//! (`forward_step`, `forward_first_step`, `forward_last_step`, `backward_step`), and a bf16
//! matrix product ([`gemm`], the route's spike). Their PTX building blocks are one file, `ptx.cuh`; what the attention kernels share
//! on top of it another, `attention.cuh`.

mod backward;
mod backward_plan;
mod band;
mod coverage;
mod forward;
mod forward_plan;
mod gemm;
mod gemm_shape;
#[doc(hidden)]
pub mod schedule;
#[doc(hidden)]
pub mod source_task;

use cubecl::features::Tma;
use cubecl::prelude::*;

use crate::kernel_error::KernelError;
use crate::limits::DeviceLimits;

pub use backward::{attention_backward, backward_rows_source, backward_source};
pub(crate) use backward::{
    choose as choose_backward, choose_step as choose_backward_step, enqueue as enqueue_backward,
    enqueue_step as enqueue_backward_step, ForwardTensors,
};
pub use backward_plan::{
    head_parts as backward_head_parts, shared_bytes as backward_shared_bytes,
    shared_bytes_for as backward_shared_bytes_for, BackwardVariant,
};
pub use coverage::HEAD_DIMS;
pub use forward::{attention_forward, forward_source};
pub(crate) use forward::{
    choose as choose_forward, enqueue as enqueue_forward, plan as plan_forward,
};
pub use forward_plan::{
    shared_bytes as forward_shared_bytes, shared_bytes_for as forward_shared_bytes_for,
    ForwardEnds, ForwardVariant, BLOCK_KEYS, BLOCK_ROWS,
};
pub use gemm::{gemm, gemm_source};
pub use gemm_shape::{GemmLayout, SHARED_BYTES, TILE_K, TILE_M, TILE_N, UNITS};
pub use schedule::{BackwardSchedule, DeterministicAdds, ForwardSchedule, HeadSplit};

/// Whether `client` runs the Hopper kernels: a CUDA device of compute capability 9.0 exactly
/// (`wgmma` exists on sm_90a only; later GPUs have other instructions). cubecl-cuda 0.10 reports
/// no compute capability, so it is read off the features it enables by capability: the bulk
/// tensor copy engine from 9.0 on, its wide im2col mode from 10.0 on.
pub fn available<R: Runtime>(client: &ComputeClient<R>) -> bool {
    let tma = client.properties().features.tma;
    R::name(client) == "cuda" && tma.contains(Tma::Base) && !tma.contains(Tma::Im2colWide)
}

/// The one-dimensional grid of `cubes.0` cubes (`cubes.1` says what they are) for `kernel`, a
/// Hopper kernel with cubes of `units` threads and `shared_bytes` of shared memory, once
/// `client` is known to run the Hopper kernels ([`available`]) and the launch to fit its limits.
pub(crate) fn device_grid<R: Runtime>(
    client: &ComputeClient<R>,
    kernel: &str,
    units: usize,
    shared_bytes: usize,
    cubes: (usize, &str),
) -> Result<CubeCount, KernelError> {
    if !available(client) {
        return Err(KernelError::DeviceLimit {
            what: format!(
                "{kernel} needs a CUDA GPU of compute capability 9.0 (wgmma and the bulk tensor \
                 copy engine); Variant::Auto runs elsewhere"
            ),
        });
    }
    let limits = DeviceLimits::of(client);
    limits.expect_units(kernel, units)?;
    limits.expect_shared(kernel, shared_bytes)?;
    // x holds 2^31 - 1 cubes on CUDA.
    let (count, what) = cubes;
    let max_x = limits.max_cube_count.0 as usize;
    if count > max_x {
        return Err(KernelError::DeviceLimit {
            what: format!(
                "{kernel} needs {count} cubes ({what}); the device's grid allows {max_x}"
            ),
        });
    }
    Ok(CubeCount::Static(count as u32, 1, 1))
}
