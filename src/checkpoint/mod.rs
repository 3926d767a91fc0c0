//! Gradient checkpointing of [`TransformerBlock`]s (paper §3.3), built for Burn 0.21, which has
//! no `checkpoint(closure)` of its own.
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

mod autodiff;
mod plain;

use crate::Error;
use burn::config::Config;
use burn::tensor::Tensor;

use crate::backend::FlashAttentionBackend;
use crate::layers::{AttentionContext, TransformerBlock};

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

/// A backend on which [`TransformerBlock`]s can be checkpointed: on `Autodiff<B>` the block is
/// one node recomputed in the backward; on backends without autodiff there is nothing to store
/// and the block simply runs.
pub trait CheckpointBackend: FlashAttentionBackend {
    /// `block` applied to `x` with its activations checkpointed at `placement`. `x` is not
    /// checked first ([`TransformerBlock::try_forward`] checks it, then calls this). On
    /// `Autodiff`, a failure while the backward pass recomputes the block (a failed peer)
    /// panics there, since a backward pass cannot return an error.
    ///
    /// # Shapes
    ///
    /// - x: `[batch, seq, d_model]`
    /// - output: `[batch, seq, d_model]`
    ///
    /// # Errors
    ///
    /// The errors of the block's attention on the projected heads (those of
    /// [`TransformerBlock::try_forward`] after its input check).
    ///
    /// # Panics
    ///
    /// On most inputs that [`TransformerBlock::try_forward`] would refuse, in Burn's shape
    /// checks: call this through `try_forward` (or `forward`), which checks `x` first.
    fn checkpoint_block(
        block: &TransformerBlock<Self>,
        x: Tensor<Self, 3>,
        context: &AttentionContext<Self::Inner>,
        placement: CheckpointPlacement,
    ) -> Result<Tensor<Self, 3>, Error>;
}
