//! Kernels for Hopper GPUs (CUDA compute capability 9.0): CUDA C++ with inline PTX for what
//! CubeCL 0.10 cannot express (warpgroup MMA `wgmma`, `setmaxnreg`, bulk tensor copies completing
//! on mbarriers, warp-specialised pipelines), compiled by the CUDA runtime's NVRTC for `sm_90a`
//! and launched through CubeCL like every other kernel ([`source_task`]): same stream, memory
//! pools and buffer handles. ARCHITECTURE.md ("Hopper kernels: the route") says why.
//!
//! Two kernels: the attention forward ([`attention_forward`], what `Variant::Hopper` and, where
//! it covers the call, `Variant::Auto` run for a whole attention), and a bf16 matrix product
//! ([`gemm`], the route's spike). Their PTX building blocks are one file, `ptx.cuh`.

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

pub use forward::{attention_forward, forward_source};
pub(crate) use forward::{
    choose as choose_forward, enqueue as enqueue_forward, plan as plan_forward, refuse_steps,
};
pub use forward_plan::{
    shared_bytes as forward_shared_bytes, ForwardVariant, BLOCK_KEYS, BLOCK_ROWS, HEAD_DIMS,
};
pub use gemm::{gemm, gemm_source};
pub use gemm_shape::{GemmLayout, SHARED_BYTES, TILE_K, TILE_M, TILE_N, UNITS};
pub use schedule::ForwardSchedule;

/// Whether `client` runs the Hopper kernels: a CUDA device of compute capability 9.0 exactly
/// (`wgmma` exists on sm_90a only; later GPUs have other instructions). cubecl-cuda 0.10 reports
/// no compute capability, so it is read off the features it enables by capability: the bulk
/// tensor copy engine from 9.0 on, its wide im2col mode from 10.0 on.
pub fn available<R: Runtime>(client: &ComputeClient<R>) -> bool {
    let tma = client.properties().features.tma;
    R::name(client) == "cuda" && tma.contains(Tma::Base) && !tma.contains(Tma::Im2colWide)
}
