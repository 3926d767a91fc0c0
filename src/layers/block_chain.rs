//! [`BlockChain`]: a model's blocks applied one after the other with one gradient checkpoint per
//! one or two layers: consecutive blocks checkpointed at [`CheckpointPlacement::Layer`] run as
//! [`BlockPair`]s when two layers share a checkpoint.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use super::block::TransformerBlock;
use super::block_pair::BlockPair;
use super::input::AttentionInput;
use crate::extension::{AttentionContext, CheckpointPlacement, FlashAttentionBackend};
use crate::Error;

/// A model's blocks in forward order, run with `layers_per_checkpoint` layers per gradient
/// checkpoint: 1, each block as it is configured; 2, blocks `0-1`, `2-3`, ... as one
/// [`BlockPair`] each where both are checkpointed at [`CheckpointPlacement::Layer`] (half the
/// checkpoints, the same gradients bit for bit; see [`BlockPair`] for the cost), every other
/// block (an odd last one, one at another placement and its partner) as it is configured.
#[derive(Debug, Clone, Copy)]
pub struct BlockChain<'a, B: Backend> {
    blocks: &'a [TransformerBlock<B>],
    layers_per_checkpoint: usize,
}

/// One checkpoint's worth of a chain: a pair, or a block alone.
enum Segment<'a, B: Backend> {
    Pair(&'a TransformerBlock<B>, &'a TransformerBlock<B>),
    Alone(&'a TransformerBlock<B>),
}

impl<'a, B: FlashAttentionBackend> BlockChain<'a, B> {
    /// `blocks` with `layers_per_checkpoint` layers per checkpoint.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a `layers_per_checkpoint` other than 1 or 2.
    pub fn try_new(
        blocks: &'a [TransformerBlock<B>],
        layers_per_checkpoint: usize,
    ) -> Result<Self, Error> {
        if !matches!(layers_per_checkpoint, 1 | 2) {
            return Err(Error::config(
                "layers_per_checkpoint",
                "1 (a checkpoint per block) or 2 (one per pair of blocks)",
                layers_per_checkpoint,
            ));
        }
        Ok(Self {
            blocks,
            layers_per_checkpoint,
        })
    }

    /// The blocks applied to `input` one after the other (see [`TransformerBlock::forward`] for
    /// the input and its documents, which every block attends within). The input is checked
    /// before any work (by the first checkpoint, as [`TransformerBlock::try_forward`] checks it).
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
        let AttentionInput { mut x, documents } = input.into();
        for segment in self.segments() {
            let input = AttentionInput {
                x,
                documents: documents.clone(),
            };
            x = match segment {
                Segment::Pair(first, second) => {
                    BlockPair::try_new(first, second)?.try_forward(input, context)?
                }
                Segment::Alone(block) => block.try_forward(input, context)?,
            };
        }
        Ok(x)
    }

    /// The bytes of each tensor the blocks' checkpoints move to host memory in one training
    /// step on `[batch, seq, d_model]` inputs (`seq` this rank's tokens): a pair's
    /// ([`BlockPair::offloaded_bytes`]) and every block's alone
    /// ([`TransformerBlock::offloaded_bytes`]). The sizes to hand
    /// [`prepare_host_offload`](crate::offload::HostOffload::prepare_host_offload) before a step.
    pub fn offloaded_bytes(&self, batch: usize, seq: usize) -> Vec<usize> {
        (self.segments())
            .flat_map(|segment| match segment {
                // A pair's checkpoint is its first block's layer checkpoint: the input.
                Segment::Pair(first, _) => first.offloaded_bytes(batch, seq),
                Segment::Alone(block) => block.offloaded_bytes(batch, seq),
            })
            .collect()
    }

    /// The chain's checkpoints in forward order.
    fn segments(&self) -> impl Iterator<Item = Segment<'a, B>> {
        let layer = |block: &TransformerBlock<B>| block.checkpoint == CheckpointPlacement::Layer;
        (self.blocks.chunks(self.layers_per_checkpoint)).flat_map(move |group| match group {
            [first, second] if layer(first) && layer(second) => vec![Segment::Pair(first, second)],
            blocks => blocks.iter().map(Segment::Alone).collect(),
        })
    }
}
