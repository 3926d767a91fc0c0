//! The checkpointing capability of a backend: where a model's gradient checkpoints go
//! ([`CheckpointPlacement`]), what a checkpointed part of a model provides
//! ([`CheckpointSegment`]), and how a backend runs one ([`CheckpointBackend::checkpointed`]).
//!
//! Built for Burn 0.21, which has no `checkpoint(closure)` of its own. A checkpointed segment is
//! one node of the autodiff graph (`backends/checkpoint_node.rs`). Its forward runs on the inner
//! backend (no graph, no stored activations) and keeps only the segment input, plus attention's
//! output and lse when the boundary is at the attention output. Its backward recomputes the
//! segment's forward from those and runs the segment's hand-written backward, feeding the input
//! and weight gradients back into the outer graph.
//!
//! Why not a nested autodiff graph: burn-autodiff 0.21 holds the graph's lock for the whole
//! backward pass, and a `backward()` called from inside it deadlocks when it cleans up orphaned
//! graphs (it locks every graph, the outer one included). The recomputed segment therefore runs
//! its own backward, written with tensor ops, and the tests check it against Burn's autodiff of
//! the same block.

use burn::config::Config;
use burn::module::{Module, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::Tensor;

use super::{AttentionContext, FlashAttentionBackend};
use crate::offload::HostOffload;
use crate::options::Documents;
use crate::Error;

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

impl CheckpointPlacement {
    /// The placements' names on a command line, in the order of the variants (what
    /// [`CheckpointPlacement::from_str`](std::str::FromStr) reads).
    pub const NAMES: [&'static str; 3] = ["none", "layer", "attention-output"];
}

impl std::str::FromStr for CheckpointPlacement {
    type Err = String;

    /// `none`, `layer` or `attention-output`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(Self::None),
            "layer" => Ok(Self::Layer),
            "attention-output" => Ok(Self::AttentionOutput),
            other => Err(format!(
                "takes none, layer or attention-output, got {other:?}"
            )),
        }
    }
}

/// Running a [`CheckpointSegment`] as one gradient checkpoint: `Autodiff` builds one graph node;
/// the default (no autodiff, nothing to store) just runs the segment.
pub trait CheckpointBackend: Backend + HostOffload {
    /// `segment` applied to `x`, with its activations checkpointed at `placement`: on `Autodiff`
    /// one node of the graph that keeps only `x` (and, at [`CheckpointPlacement::AttentionOutput`],
    /// attention's output and lse) and recomputes the rest in the backward, with the same
    /// `documents` (the call's packed-document boundaries, if any); on backends without autodiff
    /// there is nothing to store and the segment simply runs. `x` is not checked first
    /// ([`TransformerBlock::try_forward`](crate::layers::TransformerBlock::try_forward) checks it,
    /// then calls this). On `Autodiff`, a failure while the backward pass recomputes the segment (a
    /// failed peer) panics there, since a backward pass cannot return an error.
    ///
    /// # Shapes
    ///
    /// - x: `[batch, seq, d_model]`
    /// - output: `[batch, seq, d_model]`
    ///
    /// # Errors
    ///
    /// The errors of the segment's forward (for a block, those of its attention).
    ///
    /// # Panics
    ///
    /// On `Autodiff`, when the segment does not have `PARENTS - 1` float parameters, or when
    /// its backward returns no gradient for one of them.
    fn checkpointed<S, const PARENTS: usize>(
        segment: &S,
        x: Tensor<Self, 3>,
        context: &AttentionContext<Self>,
        documents: Option<&Documents>,
        placement: CheckpointPlacement,
    ) -> Result<Tensor<Self, 3>, Error>
    where
        Self: FlashAttentionBackend,
        S: CheckpointSegment<Self, PARENTS>,
    {
        let _ = placement;
        segment.forward_stored(x, context, documents)
    }
}

/// A part of a model that [`CheckpointBackend::checkpointed`] can run as one gradient
/// checkpoint: on `Autodiff`, one node over the segment's input and its `PARENTS - 1` float
/// parameters (in the order [`Module::visit`] visits them). The plugin's
/// [`TransformerBlock`](crate::layers::TransformerBlock) is one; the node is built from the
/// segment's parameter list, so a segment's layers can change without touching the node. Each
/// method gets the call's `documents` (packed-document boundaries, or `None`), the same in the
/// forward and in the backward that recomputes it.
pub trait CheckpointSegment<B: FlashAttentionBackend, const PARENTS: usize>:
    Module<B> + 'static
{
    /// The same segment with its parameters on backend `O`.
    type On<O: FlashAttentionBackend<Inner = B::Inner>>: CheckpointSegment<O, PARENTS>;

    /// The forward through ordinary tensor operations (under autodiff, the graph stores every
    /// activation).
    ///
    /// # Errors
    ///
    /// The errors of the segment's attention.
    fn forward_stored(
        &self,
        x: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> Result<Tensor<B, 3>, Error>;

    /// The forward of a checkpoint: the output, and what the backward keeps besides `x` at
    /// `placement` (attention's output and lse at [`CheckpointPlacement::AttentionOutput`]).
    ///
    /// # Errors
    ///
    /// As [`forward_stored`](Self::forward_stored).
    #[allow(clippy::type_complexity)]
    fn forward_keeping(
        &self,
        x: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
        placement: CheckpointPlacement,
    ) -> Result<(Tensor<B, 3>, Vec<FloatTensor<B>>), Error>;

    /// The gradients of `x` and of every float parameter (by [`ParamId`]) for the output
    /// gradient `grad`, recomputing what the forward did not keep from `x` and `kept`.
    ///
    /// # Errors
    ///
    /// The errors of the recomputed attention (a failed peer).
    #[allow(clippy::type_complexity)]
    fn backward(
        &self,
        x: Tensor<B, 3>,
        kept: Vec<FloatTensor<B>>,
        grad: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> Result<(Tensor<B, 3>, Vec<(ParamId, FloatTensor<B>)>), Error>;

    /// Whether the checkpoint keeps what the backward needs (`x` and what
    /// [`forward_keeping`](Self::forward_keeping) returned) in host memory between the forward and
    /// the backward ([`crate::offload`]). Default: on the device.
    fn offloads(&self) -> bool {
        false
    }

    /// This segment on the backend under autodiff (Burn's `valid`), which the checkpoint node
    /// runs.
    fn valid_segment(&self) -> Self::On<B::InnerBackend>
    where
        B: AutodiffBackend,
        B::InnerBackend: FlashAttentionBackend<Inner = B::Inner>;
}

#[cfg(test)]
mod tests {
    use super::CheckpointPlacement;

    #[test]
    fn placements_read_their_names() {
        let read: Vec<CheckpointPlacement> = CheckpointPlacement::NAMES
            .iter()
            .map(|name| name.parse().unwrap())
            .collect();
        assert_eq!(
            read,
            [
                CheckpointPlacement::None,
                CheckpointPlacement::Layer,
                CheckpointPlacement::AttentionOutput
            ]
        );
        let err = "attention".parse::<CheckpointPlacement>().unwrap_err();
        assert!(err.contains("none, layer or attention-output"), "{err}");
    }
}
