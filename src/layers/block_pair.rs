//! [`BlockPair`]: two consecutive [`TransformerBlock`]s run as one gradient checkpoint at the
//! pair's input, so that a model keeps one checkpoint per two layers (half the checkpoints, on
//! the device or in host memory).
//!
//! The pair's backward recomputes the first block at the attention output, which gives the
//! second block's input and the first block's attention output and lse; runs the second
//! block's backward, which recomputes that block from its input as a layer checkpoint does; then
//! the first block's backward from the pair's input and the kept attention output, without
//! running attention's forward again. Attention's forward thus runs twice per layer and step, as
//! with one layer checkpoint per block, and every float operation is the one two layer
//! checkpoints run, in the same order: the gradients are bitwise theirs. The cost is one more
//! forward of the first block's projections and feed-forward per pair, and, during the second
//! block's backward, its recomputed input and the first block's attention output and lse beside
//! that backward's own tensors.

use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::Tensor;

use super::block::{TransformerBlock, BLOCK_PARENTS};
use super::input::AttentionInput;
use crate::extension::{
    AttentionContext, CheckpointPlacement, CheckpointSegment, FlashAttentionBackend,
};
use crate::options::Documents;
use crate::Error;

/// The pair's input and both blocks' weights: the parents of its checkpoint node.
const PAIR_PARENTS: usize = 2 * BLOCK_PARENTS - 1;

/// Two consecutive blocks checkpointed together at [`CheckpointPlacement::Layer`]: the
/// checkpoint keeps only the pair's input, in host memory when the first block offloads
/// ([`TransformerBlock::offload`]).
#[derive(Module, Debug)]
pub struct BlockPair<B: Backend> {
    /// The block the forward runs first (checkpointed at `Layer`).
    first: TransformerBlock<B>,
    /// The block after it (checkpointed at `Layer`).
    second: TransformerBlock<B>,
}

impl<B: FlashAttentionBackend> BlockPair<B> {
    /// `first` then `second` as one checkpoint. The pair holds clones sharing the blocks'
    /// weights (the blocks' lazily initialised weights are initialised first, in the blocks
    /// themselves, so that the clones hold them too): its gradients are the blocks' own.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when either block is not checkpointed at
    /// [`CheckpointPlacement::Layer`].
    pub fn try_new(
        first: &TransformerBlock<B>,
        second: &TransformerBlock<B>,
    ) -> Result<Self, Error> {
        for block in [first, second] {
            if block.checkpoint != CheckpointPlacement::Layer {
                return Err(Error::config(
                    "checkpoint",
                    "CheckpointPlacement::Layer for both blocks of a pair (a pair keeps only its \
                     input)",
                    format!("{:?}", block.checkpoint),
                ));
            }
            block.visit(&mut ReadEveryWeight);
        }
        Ok(Self {
            first: first.clone(),
            second: second.clone(),
        })
    }

    /// Both blocks applied to `input` as one checkpoint (see
    /// [`TransformerBlock::forward`] for the input and its documents). The input is checked
    /// before any work.
    ///
    /// # Shapes
    ///
    /// As [`TransformerBlock::forward`].
    ///
    /// # Errors
    ///
    /// As [`TransformerBlock::try_forward`].
    pub fn try_forward(
        &self,
        input: impl Into<AttentionInput<B>>,
        context: &AttentionContext<B>,
    ) -> Result<Tensor<B, 3>, Error> {
        let AttentionInput { x, documents } = input.into();
        let documents = documents.as_ref();
        self.first.attention.check_input(&x, context, documents)?;
        B::checkpointed(self, x, context, documents, CheckpointPlacement::Layer)
    }

    /// The bytes of each tensor the pair's checkpoint moves to host memory in one training step
    /// on `[batch, seq, d_model]` inputs: the pair's input when the first block offloads,
    /// nothing otherwise (see [`TransformerBlock::offloaded_bytes`]).
    pub fn offloaded_bytes(&self, batch: usize, seq: usize) -> Vec<usize> {
        // A layer checkpoint of the first block keeps its input, which the pair's is.
        self.first.offloaded_bytes(batch, seq)
    }
}

impl<B: FlashAttentionBackend> CheckpointSegment<B, PAIR_PARENTS> for BlockPair<B> {
    type On<O: FlashAttentionBackend<Inner = B::Inner>> = BlockPair<O>;

    fn forward_stored(
        &self,
        x: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> Result<Tensor<B, 3>, Error> {
        let h = self.first.forward_stored(x, context, documents)?;
        self.second.forward_stored(h, context, documents)
    }

    fn forward_keeping(
        &self,
        x: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
        placement: CheckpointPlacement,
    ) -> Result<(Tensor<B, 3>, Vec<FloatTensor<B>>), Error> {
        if placement != CheckpointPlacement::Layer {
            return Err(Error::config(
                "placement",
                "CheckpointPlacement::Layer (a pair of blocks keeps only its input)",
                format!("{placement:?}"),
            ));
        }
        let (h, _) = self
            .first
            .forward_keeping(x, context, documents, placement)?;
        self.second
            .forward_keeping(h, context, documents, placement)
    }

    fn backward(
        &self,
        x: Tensor<B, 3>,
        _kept: Vec<FloatTensor<B>>,
        grad: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> Result<(Tensor<B, 3>, Vec<(ParamId, FloatTensor<B>)>), Error> {
        let (h, attention) = (self.first).forward_keeping(
            x.clone(),
            context,
            documents,
            CheckpointPlacement::AttentionOutput,
        )?;
        let (dh, second) = CheckpointSegment::<B, BLOCK_PARENTS>::backward(
            &self.second,
            h,
            Vec::new(),
            grad,
            context,
            documents,
        )?;
        let (dx, mut grads) = CheckpointSegment::<B, BLOCK_PARENTS>::backward(
            &self.first,
            x,
            attention,
            dh,
            context,
            documents,
        )?;
        grads.extend(second);
        Ok((dx, grads))
    }

    fn offloads(&self) -> bool {
        self.first.offload
    }

    fn valid_segment(&self) -> BlockPair<B::InnerBackend>
    where
        B: AutodiffBackend,
        B::InnerBackend: FlashAttentionBackend<Inner = B::Inner>,
    {
        self.valid()
    }
}

/// Reads every float weight of a module once, which initialises the lazy ones in the module
/// itself (a clone of a weight not yet initialised would draw values of its own).
struct ReadEveryWeight;

impl<B: Backend> ModuleVisitor<B> for ReadEveryWeight {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let _ = param.val();
    }
}
