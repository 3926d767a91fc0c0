//! `Autodiff<B>`'s chunked output projection and cross-entropy: one graph node from the hidden
//! states and the projection weight to the rows' losses, whose forward and backward run the chunks
//! outside the graph ([`ChunkedInputs`]); the backward recomputes each chunk's logits, so the
//! graph keeps no logits at all, only the hidden states, the weight, the targets and each row's
//! log-sum-exp.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Int, Tensor, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::Autodiff;
use burn_distflash::layers::RowChunks;

use super::chunk_ranges;
use super::chunked::{ChunkedInputs, HeadLayout};
use crate::TrainingKernels;

/// The backward node of `loss[row] = lse[row] - (hidden[row] W)[target[row]]`.
#[derive(Debug)]
struct ProjectedCrossEntropy;

/// What the node keeps: its inputs, each chunk's log-sum-exp and whether the fused kernels ran.
#[derive(Clone, Debug)]
struct Kept<B: TrainingKernels> {
    inputs: ChunkedInputs<B>,
    lse: Vec<FloatTensor<B>>,
    fused: bool,
}

impl<B: TrainingKernels> Backward<B, 2> for ProjectedCrossEntropy {
    type State = Kept<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let Kept { inputs, lse, fused } = ops.state;
        let [dhidden, dweight] = inputs.backward(&lse, fused, grad);
        let [hidden, weight] = ops.parents;
        if let Some(node) = hidden {
            grads.register::<B>(node.id, dhidden);
        }
        if let Some(node) = weight {
            grads.register::<B>(node.id, dweight);
        }
    }
}

/// The rows' summed loss through the node (see
/// [`CrossEntropyBackend::projected_cross_entropy_sum`](super::CrossEntropyBackend::projected_cross_entropy_sum)).
pub(super) fn projected_cross_entropy_sum<B: TrainingKernels, C: CheckpointStrategy>(
    hidden: Tensor<Autodiff<B, C>, 2>,
    weight: Tensor<Autodiff<B, C>, 2>,
    layout: HeadLayout,
    targets: Tensor<Autodiff<B, C>, 1, Int>,
    chunks: &RowChunks,
) -> Tensor<Autodiff<B, C>, 1> {
    let ranges = chunk_ranges(&hidden, &weight, layout, chunks);
    let (hidden, weight) = (
        hidden.into_primitive().tensor(),
        weight.into_primitive().tensor(),
    );
    let inputs = ChunkedInputs {
        hidden: hidden.primitive.clone(),
        weight: weight.primitive.clone(),
        layout,
        targets: targets.into_primitive(),
        ranges,
    };
    let rows = inputs.forward();
    let loss = match ProjectedCrossEntropy
        .prepare::<C>([hidden.node.clone(), weight.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            Kept {
                inputs,
                lse: rows.lse,
                fused: rows.fused,
            },
            rows.loss,
        ),
        OpsKind::UnTracked(prep) => prep.finish(rows.loss),
    };
    Tensor::<Autodiff<B, C>, 1>::from_primitive(TensorPrimitive::Float(loss)).sum()
}
