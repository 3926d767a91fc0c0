//! Stat-carrying flash-attention kernels in CubeCL.
//!
//! Every forward call reads and updates the online-softmax state `(o, m, l)` of its query rows,
//! so attention over a sequence split into key/value chunks (held by other GPUs, say) is computed
//! chunk after chunk, or as independent partials that are merged, and is exact. The backward step
//! uses the stored log-sum-exp and `delta = rowsum(dO * O)`, never the forward again.
//!
//! Two variants share the statistics logic of `stats`: `portable` scalar kernels that run on
//! every CubeCL runtime (wgpu on a CPU included), and [`tensor_core`] kernels using `mma.sync`
//! on CUDA. `launch` validates inputs, and `plan` picks a variant and its launch shapes
//! within the device's `limits`; a launch the runtime reports as failed is an error too.
//! [`hopper`] holds kernels for Hopper GPUs written as CUDA C++ with inline PTX (warpgroup MMA,
//! bulk tensor copies) and launched through CubeCL's CUDA runtime: the whole-attention forward
//! that `Variant::Hopper` and, where it covers the call, `Variant::Auto` run there, and a bf16
//! matrix product.
//!
//! The crate's integration tests check the kernels against an f64 host reference that lives in
//! the workspace's unpublished `distflash-test-support` crate, a dev-dependency, not shipped here.

#![warn(missing_docs)]
mod attention_params;
mod buffers;
mod dims;
mod edited_task;
mod geometry;
mod grid;
pub mod hopper;
mod inputs;
mod kernel_error;
mod launch;
mod limits;
mod mask;
mod plan;
mod state_kernels;
mod stats;
mod step_options;
mod tensor;
// Public for the `dump_cuda` example and kernel work, not part of the documented API: the
// kernels are reached through the entry points above.
#[doc(hidden)]
pub mod portable;
#[doc(hidden)]
pub mod tensor_core;

pub use dims::AttentionDims;
pub use kernel_error::{KernelError, SUPPORTED_HEAD_DIMS};
pub use launch::{
    attention, attention_backward, backward_delta, backward_step, cast_f32, fill, finalize,
    finalize_into, forward_first_step, forward_last_step, forward_step, merge,
    tensor_core_available, zeros_f32, GradAccumulators, SoftmaxState, StepOptions, Variant,
};
#[doc(hidden)]
pub use limits::scalar_fragment_stores;
pub use limits::DeviceLimits;
// The mask types are the schedule crate's (their host-side logic lives there); the kernels
// take them to the device (`mask`).
pub use distflash_schedule::{Documents, Mask, ScheduleError, SlidingWindow};
// The kernels' launch parameters and compile-time mask shape: public for the `dump_cuda`
// example, like `tensor_core`.
#[doc(hidden)]
pub use attention_params::AttentionParams;
#[doc(hidden)]
pub use mask::{MaskBounds, MaskKind};
pub use plan::check_launch;
pub use tensor::{DeviceTensor, ElemType};
