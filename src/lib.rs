//! burn-distflash: exact, memory-efficient attention for Burn, with the softmax statistics that
//! sequence parallelism needs.
//!
//! The root holds what most users need:
//!
//! - [`flash_attention`] / [`flash_attention_with_lse`]: the op Burn users call, on any backend
//!   implementing [`FlashAttentionBackend`]: the CubeCL backends (CUDA, wgpu) run this project's
//!   kernels, ndarray runs an implementation from Burn tensor operations, and `Autodiff<B>` of
//!   either adds a fused backward. [`FlashAttentionOptions`] (with [`Mask`], [`SlidingWindow`]
//!   and [`Documents`]) says what the call computes; every failure is an [`Error`].
//! - [`FlashAttentionBackend`], the bound a model names, is one trait per capability at once:
//!   [`AttentionBackend`] (attention, one-shot and step by step), [`SequenceParallelBackend`]
//!   (the distributed passes), [`LayerOpsBackend`] (linear products, SwiGLU, RMS norm, rotary)
//!   and [`CheckpointBackend`] (gradient checkpoints); each Burn backend implements the four.
//! - [`DistFlashAttention`] / [`DistFlashAttentionConfig`]: a drop-in multi-head attention
//!   module, run locally or sequence-parallel over a [`DeviceGroup`] as its
//!   [`AttentionContext`] says, on an [`AttentionInput`] (the hidden states and the documents
//!   packed into them).
//! - [`kernels`]: the CubeCL kernels themselves (`distflash-kernels`), step by step.
//!
//! The rest is in modules named for what they are for:
//!
//! - [`sequence_parallel`]: attention over one sequence split across the ranks of a group, and
//!   cutting and joining the shards;
//! - [`layers`]: the transformer block, its parts and gradient checkpointing;
//! - [`offload`]: layer checkpoints kept in host memory between the forward and the backward;
//! - [`collective`]: device groups and the transports that move tensors between ranks;
//! - [`schedule`]: which rank computes which part of sequence-parallel attention, step by step;
//! - [`step`]: the running softmax state of the extension trait's step-by-step methods.
//! - [`cube_support`]: building blocks for CubeCL kernels over Burn's `CubeBackend` tensors
//!   (kernel arguments, vector widths, float types, a cube-wide reduction), as this crate's
//!   fused layer operations and the Llama example's training kernels use them.

#![warn(missing_docs)]
mod api;
mod attention_tensor_ops;
mod backends;
pub mod collective;
pub mod cube_support;
pub mod device_faults;
mod error;
mod extension;
mod inputs;
mod layer_ops;
pub mod layers;
mod matmul;
pub mod offload;
mod options;
pub mod sequence_parallel;
pub mod step;

pub use api::{flash_attention, flash_attention_with_lse};
pub use collective::DeviceGroup;
pub use distflash_kernels as kernels;
pub use distflash_schedule as schedule;
pub use error::Error;
pub use extension::{
    AttentionBackend, AttentionContext, CheckpointBackend, FlashAttentionBackend, LayerOpsBackend,
    SequenceParallelBackend,
};
pub use layers::{AttentionInput, DistFlashAttention, DistFlashAttentionConfig};
pub use options::{Documents, FlashAttentionOptions, Mask, SlidingWindow};
