//! `Autodiff<B>`: sequence-parallel attention as one compute-bound node whose backward runs the
//! distributed backward from the stored shards, O and lse (no forward recomputation).

use burn::tensor::ops::FloatTensor;
use burn::tensor::Device;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::Autodiff;

use super::backend::SequenceParallelBackend;
use super::Grads;
use super::SequenceParallelOptions;
use crate::collective::{CommError, DeviceGroup};

/// The backward node of one rank's sequence-parallel attention call.
#[derive(Debug)]
struct SequenceParallelNode;

/// What the backward needs: this rank's q, k, v, O, lse, its group and the options.
#[derive(Debug, Clone)]
struct NodeState<B: SequenceParallelBackend> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    group: DeviceGroup<B::Inner>,
    options: SequenceParallelOptions,
}

impl<B: SequenceParallelBackend> Backward<B, 3> for SequenceParallelNode {
    type State = NodeState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad_out = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let (dq, dk, dv) = B::sequence_parallel_backward(
            s.q, s.k, s.v, s.out, s.lse, grad_out, &s.group, &s.options,
        )
        // A backward pass cannot return an error; a failed peer ends the training step here.
        .unwrap_or_else(|e| panic!("sequence-parallel attention backward: {e}"));
        for (parent, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: SequenceParallelBackend, C: CheckpointStrategy> SequenceParallelBackend for Autodiff<B, C> {
    type Inner = B::Inner;

    fn inner_device(device: &B::Device) -> Device<B::Inner> {
        B::inner_device(device)
    }

    fn linear_product(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::layers::autodiff_linear_product::<B, C>(x, weight)
    }

    fn sequence_parallel_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        group: &DeviceGroup<B::Inner>,
        options: &SequenceParallelOptions,
    ) -> Result<(FloatTensor<Self>, FloatTensor<Self>), CommError> {
        let (out, lse) = B::sequence_parallel_attention(
            q.primitive.clone(),
            k.primitive.clone(),
            v.primitive.clone(),
            group,
            options,
        )?;
        // lse is returned as a constant (it carries no gradient of its own).
        let lse_out = FloatTensor::<Self>::new(lse.clone());
        let out = match SequenceParallelNode
            .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                NodeState::<B> {
                    q: q.primitive,
                    k: k.primitive,
                    v: v.primitive,
                    out: out.clone(),
                    lse,
                    group: group.clone(),
                    options: *options,
                },
                out,
            ),
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        Ok((out, lse_out))
    }

    /// Second-order gradients are not supported: the results are constants.
    fn sequence_parallel_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_out: FloatTensor<Self>,
        group: &DeviceGroup<B::Inner>,
        options: &SequenceParallelOptions,
    ) -> Result<Grads<Self>, CommError> {
        let (dq, dk, dv) = B::sequence_parallel_backward(
            q.primitive,
            k.primitive,
            v.primitive,
            out.primitive,
            lse.primitive,
            grad_out.primitive,
            group,
            options,
        )?;
        Ok((
            FloatTensor::<Self>::new(dq),
            FloatTensor::<Self>::new(dk),
            FloatTensor::<Self>::new(dv),
        ))
    }
}
