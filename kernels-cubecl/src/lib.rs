//! Stat-carrying flash-attention kernels in CubeCL.
//!
//! Every forward call reads and updates the online-softmax state `(o, m, l)` of its query rows,
//! so attention over a sequence split into key/value chunks (held by other GPUs, say) is computed
//! chunk after chunk, or as independent partials that are merged, and is exact. The backward step
//! uses the stored log-sum-exp and `delta = rowsum(dO * O)`, never the forward again.
//!
//! Two variants share the statistics logic of [`stats`]: [`portable`] scalar kernels that run on
//! every CubeCL runtime (wgpu on a CPU included), and [`tensor_core`] kernels using `mma.sync`
//! on CUDA. [`launch`] validates inputs, and [`plan`] picks a variant and its launch shapes
//! within the device's [`limits`]; a launch the runtime reports as failed is an error too.

mod buffers;
pub mod dims;
pub mod error;
pub mod geometry;
pub mod grid;
pub mod launch;
pub mod limits;
mod options;
pub mod plan;
pub mod portable;
pub mod reference;
pub mod state_kernels;
pub mod stats;
pub mod tensor;
pub mod tensor_core;

pub use dims::{AttentionDims, Mask};
pub use error::{KernelError, SUPPORTED_HEAD_DIMS};
pub use launch::{
    attention, attention_backward, backward_delta, backward_step, cast_f32, fill, finalize,
    finalize_into, forward_step, merge, tensor_core_available, zeros_f32, GradAccumulators,
    SoftmaxState, StepOptions, Variant,
};
pub use limits::DeviceLimits;
pub use plan::check_launch;
pub use tensor::{DeviceTensor, ElemType};
