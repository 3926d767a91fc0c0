//! `Autodiff<B>`: a checkpointed block is one graph node over the block input and its nine
//! weights. The forward runs on `B` and stores the input (and attention's output and lse at the
//! attention-output placement); the backward recomputes the rest and runs the block's backward.

use crate::Error;
use burn::module::{AutodiffModule, Param};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::Autodiff;

use super::{CheckpointBackend, CheckpointPlacement};
use crate::backend::FlashAttentionBackend;
use crate::layers::{AttentionContext, BlockGrads, TransformerBlock};

/// The block input and its nine weights, in the order of [`weight_gradients`].
const PARENTS: usize = 10;

/// The backward node of one checkpointed block.
#[derive(Debug)]
struct CheckpointedBlock;

/// What the backward keeps: the block's weights (shared, not copied), its input, and attention's
/// `(O, lse)` at the attention-output placement.
#[derive(Debug, Clone)]
struct Kept<B: FlashAttentionBackend> {
    block: TransformerBlock<B>,
    input: FloatTensor<B>,
    attention: Option<(FloatTensor<B>, FloatTensor<B>)>,
    context: AttentionContext<B::Inner>,
}

fn wrap<B: FlashAttentionBackend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn unwrap<B: FlashAttentionBackend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// The gradients of the parents, input first, then the weights in the block's field order.
fn weight_gradients<B: FlashAttentionBackend>(g: BlockGrads<B>) -> [FloatTensor<B>; PARENTS] {
    [
        unwrap(g.input),
        unwrap(g.attention_norm),
        unwrap(g.attention.query),
        unwrap(g.attention.key),
        unwrap(g.attention.value),
        unwrap(g.attention.output),
        unwrap(g.ffn_norm),
        unwrap(g.ffn.gate),
        unwrap(g.ffn.up),
        unwrap(g.ffn.down),
    ]
}

impl<B: FlashAttentionBackend> Backward<B, PARENTS> for CheckpointedBlock {
    type State = Kept<B>;

    fn backward(
        self,
        ops: Ops<Self::State, PARENTS>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let kept = ops.state;
        let attention = kept.attention.map(|(out, lse)| (wrap(out), wrap(lse)));
        let half = kept
            .block
            .attention_half(wrap(kept.input), &kept.context, attention)
            // A backward pass cannot return an error: a failed peer ends the step here.
            .unwrap_or_else(|e| panic!("recomputing a checkpointed block: {e}"));
        let block_grads = kept.block.backward(half, wrap(grad), &kept.context);
        for (parent, grad) in ops.parents.into_iter().zip(weight_gradients(block_grads)) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// A weight of the autodiff block as its autodiff tensor (whose node becomes a parent).
fn weight<B: FlashAttentionBackend, C: CheckpointStrategy, const D: usize>(
    param: &Param<Tensor<Autodiff<B, C>, D>>,
) -> FloatTensor<Autodiff<B, C>> {
    param.val().into_primitive().tensor()
}

impl<B: FlashAttentionBackend, C: CheckpointStrategy> CheckpointBackend for Autodiff<B, C> {
    fn checkpoint_block(
        block: &TransformerBlock<Self>,
        x: Tensor<Self, 3>,
        context: &AttentionContext<B::Inner>,
        placement: CheckpointPlacement,
    ) -> Result<Tensor<Self, 3>, Error> {
        if placement == CheckpointPlacement::None {
            return block.forward_stored(x, context);
        }
        let inner = block.valid();
        let input = x.clone().inner();
        let half = inner.attention_half(input.clone(), context, None)?;
        let h = half.h;
        let out = unwrap(h.clone() + inner.ffn.forward(inner.ffn_norm.forward(h)));
        let attention = match placement {
            CheckpointPlacement::AttentionOutput => {
                Some((unwrap(half.attention.out), unwrap(half.attention.lse)))
            }
            _ => None,
        };
        let (a, f) = (&block.attention, &block.ffn);
        let parents = [
            x.into_primitive().tensor().node,
            weight(&block.attention_norm.weight).node,
            weight(&a.query.weight).node,
            weight(&a.key.weight).node,
            weight(&a.value.weight).node,
            weight(&a.output.weight).node,
            weight(&block.ffn_norm.weight).node,
            weight(&f.gate.weight).node,
            weight(&f.up.weight).node,
            weight(&f.down.weight).node,
        ];
        let out = match CheckpointedBlock
            .prepare::<C>(parents)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                Kept {
                    block: inner,
                    input: unwrap(input),
                    attention,
                    context: context.clone(),
                },
                out,
            ),
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        Ok(wrap(out))
    }
}
