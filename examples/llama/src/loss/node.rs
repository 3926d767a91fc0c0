//! `Autodiff<B>`'s fused cross-entropy: one graph node from the logits to the rows' losses, whose
//! backward runs [`TrainingKernels::cross_entropy_backward`] from the saved log-sum-exp; and its
//! chunked projected cross-entropy (`chunked_node`).

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::Autodiff;

use super::chunked::HeadLayout;
use super::{chunked_node, cross_entropy_sum_portable, CrossEntropyBackend};
use crate::TrainingKernels;
use burn_distflash::layers::RowChunks;

/// The backward node of `loss[row] = lse[row] - logits[row, target[row]]`.
#[derive(Debug)]
struct CrossEntropyRows;

impl<B: TrainingKernels> Backward<B, 1> for CrossEntropyRows {
    /// The logits `[rows, vocab]`, the targets `[rows]` and the rows' log-sum-exp `[rows]`.
    type State = (FloatTensor<B>, IntTensor<B>, FloatTensor<B>);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (logits, targets, lse) = ops.state;
        if let [Some(node)] = ops.parents {
            let dlogits = B::cross_entropy_backward(logits, targets, lse, grad);
            grads.register::<B>(node.id, dlogits);
        }
    }
}

impl<B: TrainingKernels, C: CheckpointStrategy> CrossEntropyBackend for Autodiff<B, C> {
    fn cross_entropy_sum(
        logits: Tensor<Self, 2>,
        targets: Tensor<Self, 1, Int>,
    ) -> Tensor<Self, 1> {
        let primitive = logits.clone().into_primitive().tensor();
        let target_rows: IntTensor<B> = targets.clone().into_primitive();
        let Some((loss, lse)) =
            B::cross_entropy_forward(primitive.primitive.clone(), target_rows.clone())
        else {
            return cross_entropy_sum_portable(logits, targets);
        };
        let rows = match CrossEntropyRows
            .prepare::<C>([primitive.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((primitive.primitive, target_rows, lse), loss),
            OpsKind::UnTracked(prep) => prep.finish(loss),
        };
        Tensor::<Self, 1>::from_primitive(TensorPrimitive::Float(rows)).sum()
    }

    fn projected_cross_entropy_sum(
        hidden: Tensor<Self, 2>,
        weight: Tensor<Self, 2>,
        layout: HeadLayout,
        targets: Tensor<Self, 1, Int>,
        chunks: &RowChunks,
    ) -> Tensor<Self, 1> {
        chunked_node::projected_cross_entropy_sum(hidden, weight, layout, targets, chunks)
    }
}
