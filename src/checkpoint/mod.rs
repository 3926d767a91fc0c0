//! Gradient checkpointing of [`TransformerBlock`](crate::layers::TransformerBlock)s (paper §3.3),
//! built for Burn 0.21, which has no `checkpoint(closure)` of its own: where the checkpoints go
//! ([`CheckpointPlacement`]) and which layers keep theirs in host memory ([`Offload`], the
//! mechanism in `crate::offload`); the backends run a
//! [`CheckpointSegment`](crate::layers::CheckpointSegment) through
//! [`FlashAttentionBackend::checkpointed`](crate::FlashAttentionBackend::checkpointed), and
//! `Autodiff`'s node lives with the other nodes in `backends/checkpoint_node.rs`.
//!
//! A checkpointed block is one node of the autodiff graph. Its forward runs on the inner backend
//! (no graph, no stored activations) and keeps only the block input, plus attention's output and
//! lse when the boundary is at the attention output. Its backward recomputes the block's forward
//! from those and runs the block's backward, feeding the input and weight gradients back into the
//! outer graph.
//!
//! Why not a nested autodiff graph: burn-autodiff 0.21 holds the graph's lock for the whole
//! backward pass, and a `backward()` called from inside it deadlocks when it cleans up orphaned
//! graphs (it locks every graph, the outer one included). The recomputed block therefore runs its
//! own backward, written with tensor ops (`layers::*::backward`), and the tests check it against
//! Burn's autodiff of the same block.

use burn::config::Config;

mod offload;
pub use offload::Offload;

/// Where a model's gradient checkpoints go.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum CheckpointPlacement {
    /// No checkpointing: the autodiff graph stores every activation.
    None,
    /// At the transformer layer input (the usual placement): the backward recomputes the whole
    /// layer, attention's forward included.
    Layer,
    /// Rematerialization-aware, at the attention output: the layer input, attention's output and
    /// its lse are kept; the backward recomputes the projections and the feed-forward half and
    /// runs attention's backward from the kept output, so attention's forward runs once.
    AttentionOutput,
}
