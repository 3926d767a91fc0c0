//! burn-distflash: exact, memory-efficient attention for Burn, with the softmax statistics that
//! sequence parallelism needs.
//!
//! - [`flash_attention`] / [`flash_attention_with_lse`]: the op Burn users call, on any backend
//!   implementing [`FlashAttentionBackend`]: the CubeCL backends (CUDA, wgpu) run this project's
//!   kernels, ndarray runs an implementation from Burn tensor operations (`tensor_ops`), and `Autodiff<B>` of either adds a
//!   fused backward.
//! - [`kernels`]: the CubeCL kernels themselves (`distflash-kernels`), step by step.

#![warn(missing_docs)]
mod api;
mod backend;
mod backends;
mod checkpoint;
pub mod collective;
#[doc(hidden)]
pub mod cube_support;
mod distributed;
mod error;
mod layer_ops;
pub mod layers;
mod matmul;
mod options;
pub mod schedule;
mod state;
mod tensor_ops;

pub use api::{flash_attention, flash_attention_with_lse};
pub use backend::{CheckpointSegment, FlashAttentionBackend};
pub use checkpoint::CheckpointPlacement;
pub use collective::{on_each_rank, DeviceGroup};
pub use distflash_kernels as kernels;
pub use distributed::{
    gather_sequence, sequence_parallel_attention, sequence_parallel_attention_with_lse,
    shard_sequence, SequenceParallelOptions,
};
pub use error::Error;
pub use layers::{
    replicate, AttentionContext, DistFlashAttention, DistFlashAttentionConfig, TransformerBlock,
    TransformerBlockConfig,
};
pub use options::{Documents, FlashAttentionOptions, Mask, SlidingWindow};
pub use schedule::{Layout, ScheduleKind};
pub use state::{AttentionState, StepMask};
