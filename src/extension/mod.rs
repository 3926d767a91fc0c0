//! The backend extension, one trait per capability: [`AttentionBackend`] (attention with its
//! softmax statistics and a fused backward, one-shot or step by step), [`SequenceParallelBackend`]
//! (the distributed passes over a [`DeviceGroup`](crate::DeviceGroup), and which backend computes
//! them), [`LayerOpsBackend`] (the linear layers' product and the layers' element-wise parts) and
//! [`CheckpointBackend`] (a model part run as one gradient checkpoint). [`FlashAttentionBackend`]
//! is all four at once, implemented for every backend that has them: the bound a model names.
//!
//! This module names nothing above it: the layers, the passes and the backends' implementations
//! (`crate::backends`) are written against these traits.

mod attention;
mod checkpoint;
mod context;
mod layer_ops;
mod sequence_parallel;

use burn::tensor::ops::FloatTensor;

pub use attention::AttentionBackend;
pub use checkpoint::{CheckpointBackend, CheckpointPlacement, CheckpointSegment};
pub use context::AttentionContext;
pub use layer_ops::LayerOpsBackend;
pub use sequence_parallel::SequenceParallelBackend;

/// Gradients of q, k and v.
pub(crate) type Grads<B> = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

/// The Burn backend extension of this crate, every capability at once: exact, memory-efficient
/// attention with its fused backward, step by step with the running softmax state
/// ([`AttentionBackend`]), sequence-parallel over a [`DeviceGroup`](crate::DeviceGroup) of
/// [`SequenceParallelBackend::Inner`] ([`SequenceParallelBackend`]), the layers' products and
/// element-wise operations ([`LayerOpsBackend`]) and gradient checkpoints
/// ([`CheckpointBackend`], whose checkpoints can wait in host memory). Implemented for every
/// backend implementing the four: `CubeBackend`
/// (CUDA, wgpu: this project's kernels), `NdArray` (Burn tensor ops), `Fusion<B>` and
/// `Autodiff<B>` of those; a model generic over `B: FlashAttentionBackend` runs on all of them.
pub trait FlashAttentionBackend:
    AttentionBackend + SequenceParallelBackend + LayerOpsBackend + CheckpointBackend
{
}

impl<B> FlashAttentionBackend for B where
    B: AttentionBackend + SequenceParallelBackend + LayerOpsBackend + CheckpointBackend
{
}
