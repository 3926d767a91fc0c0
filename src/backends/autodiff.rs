//! `Autodiff<B>`: attention, local or sequence-parallel, as one compute-bound node whose backward
//! runs the backend's fused backward from the stored q, k, v, O and lse (no recomputation of the
//! forward); a local call is the world of one. The linear layers' products are one node each
//! (`linear_node.rs`), and so are the layers' element-wise operations (`layer_nodes.rs`).

use crate::Error;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Device, Tensor};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::Autodiff;

use distflash_kernels::AttentionDims;

use super::{checkpoint_node, layer_nodes, linear_node};
use crate::collective::DeviceGroup;
use crate::extension::{
    AttentionBackend, AttentionContext, CheckpointBackend, CheckpointPlacement, CheckpointSegment,
    FlashAttentionBackend, Grads, LayerOpsBackend, SequenceParallelBackend,
};
use crate::options::{Documents, FlashAttentionOptions};
use crate::sequence_parallel::SequenceParallelOptions;

/// The float tensor of `Autodiff<B, C>` (burn-autodiff's `AutodiffTensor`, whose module is private).
type AutodiffTensor<B, C> = FloatTensor<Autodiff<B, C>>;

/// The backward node of one attention call.
#[derive(Debug)]
struct AttentionNode;

/// Where the attention of a node ran: on this device alone, or over a group of ranks.
#[derive(Debug, Clone)]
enum Scope<B: FlashAttentionBackend> {
    Local(FlashAttentionOptions),
    Sharded(DeviceGroup<B::Inner>, SequenceParallelOptions),
}

/// What the backward needs: q, k, v, O, lse (this rank's shards when sharded) and the scope.
#[derive(Debug, Clone)]
struct NodeState<B: FlashAttentionBackend> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    scope: Scope<B>,
}

impl<B: FlashAttentionBackend> Backward<B, 3> for AttentionNode {
    type State = NodeState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad_out = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let (dq, dk, dv) = match s.scope {
            Scope::Local(options) => {
                B::flash_attention_backward(s.q, s.k, s.v, s.out, s.lse, grad_out, options)
            }
            Scope::Sharded(group, options) => B::sequence_parallel_backward(
                s.q, s.k, s.v, s.out, s.lse, grad_out, &group, &options,
            )
            // A backward pass cannot return an error; a failed peer ends the training step here.
            .unwrap_or_else(|e| panic!("sequence-parallel attention backward: {e}")),
        };
        for (parent, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// `(O, lse)` of `Autodiff<B>` from `B`'s `(out, lse)` of the inner tensors of q, k, v: O tracked
/// by one [`AttentionNode`] (when any input is), lse a constant (it carries no gradient of its
/// own).
fn track<B: FlashAttentionBackend, C: CheckpointStrategy>(
    [q, k, v]: [AutodiffTensor<B, C>; 3],
    (out, lse): (FloatTensor<B>, FloatTensor<B>),
    scope: Scope<B>,
) -> (AutodiffTensor<B, C>, AutodiffTensor<B, C>) {
    let lse_out = AutodiffTensor::<B, C>::new(lse.clone());
    let out = match AttentionNode
        .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let state = NodeState {
                q: q.primitive,
                k: k.primitive,
                v: v.primitive,
                out: out.clone(),
                lse,
                scope,
            };
            prep.finish(state, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(out),
    };
    (out, lse_out)
}

/// The inner tensors of autodiff tensors (the results are constants: second-order gradients are
/// not supported).
fn inner<B: FlashAttentionBackend, C: CheckpointStrategy, const N: usize>(
    tensors: [AutodiffTensor<B, C>; N],
) -> [FloatTensor<B>; N] {
    tensors.map(|t| t.primitive)
}

/// Constant autodiff tensors of `B`'s gradients.
fn constants<B: FlashAttentionBackend, C: CheckpointStrategy>(
    (dq, dk, dv): Grads<B>,
) -> Grads<Autodiff<B, C>> {
    (
        AutodiffTensor::<B, C>::new(dq),
        AutodiffTensor::<B, C>::new(dk),
        AutodiffTensor::<B, C>::new(dv),
    )
}

impl<B: FlashAttentionBackend, C: CheckpointStrategy> AttentionBackend for Autodiff<B, C> {
    fn lse_dtype(input: DType) -> DType {
        B::lse_dtype(input)
    }

    fn check_attention_limits(
        dims: &AttentionDims,
        dtype: DType,
        device: &B::Device,
        options: &FlashAttentionOptions,
    ) -> Result<(), Error> {
        B::check_attention_limits(dims, dtype, device, options)
    }

    fn flash_attention(
        q: AutodiffTensor<B, C>,
        k: AutodiffTensor<B, C>,
        v: AutodiffTensor<B, C>,
        options: FlashAttentionOptions,
    ) -> (AutodiffTensor<B, C>, AutodiffTensor<B, C>) {
        let [qi, ki, vi] = inner::<B, C, 3>([q.clone(), k.clone(), v.clone()]);
        let result = B::flash_attention(qi, ki, vi, options.clone());
        track::<B, C>([q, k, v], result, Scope::Local(options))
    }

    fn flash_attention_backward(
        q: AutodiffTensor<B, C>,
        k: AutodiffTensor<B, C>,
        v: AutodiffTensor<B, C>,
        out: AutodiffTensor<B, C>,
        lse: AutodiffTensor<B, C>,
        grad_out: AutodiffTensor<B, C>,
        options: FlashAttentionOptions,
    ) -> Grads<Self> {
        let [q, k, v, out, lse, grad_out] = inner::<B, C, 6>([q, k, v, out, lse, grad_out]);
        constants::<B, C>(B::flash_attention_backward(
            q, k, v, out, lse, grad_out, options,
        ))
    }
}

impl<B: FlashAttentionBackend, C: CheckpointStrategy> SequenceParallelBackend for Autodiff<B, C> {
    type Inner = B::Inner;

    fn inner_device(device: &B::Device) -> Device<B::Inner> {
        B::inner_device(device)
    }

    fn sequence_parallel_attention(
        q: AutodiffTensor<B, C>,
        k: AutodiffTensor<B, C>,
        v: AutodiffTensor<B, C>,
        group: &DeviceGroup<B::Inner>,
        options: &SequenceParallelOptions,
    ) -> Result<(AutodiffTensor<B, C>, AutodiffTensor<B, C>), Error> {
        let [qi, ki, vi] = inner::<B, C, 3>([q.clone(), k.clone(), v.clone()]);
        let result = B::sequence_parallel_attention(qi, ki, vi, group, options)?;
        let scope = Scope::Sharded(group.clone(), options.clone());
        Ok(track::<B, C>([q, k, v], result, scope))
    }

    fn sequence_parallel_backward(
        q: AutodiffTensor<B, C>,
        k: AutodiffTensor<B, C>,
        v: AutodiffTensor<B, C>,
        out: AutodiffTensor<B, C>,
        lse: AutodiffTensor<B, C>,
        grad_out: AutodiffTensor<B, C>,
        group: &DeviceGroup<B::Inner>,
        options: &SequenceParallelOptions,
    ) -> Result<Grads<Self>, Error> {
        let [q, k, v, out, lse, grad_out] = inner::<B, C, 6>([q, k, v, out, lse, grad_out]);
        let grads = B::sequence_parallel_backward(q, k, v, out, lse, grad_out, group, options)?;
        Ok(constants::<B, C>(grads))
    }
}

impl<B: FlashAttentionBackend, C: CheckpointStrategy> LayerOpsBackend for Autodiff<B, C> {
    fn linear_product(x: AutodiffTensor<B, C>, weight: AutodiffTensor<B, C>) -> FloatTensor<Self> {
        linear_node::linear_product::<B, C>(x, weight)
    }

    fn swiglu(gate: AutodiffTensor<B, C>, up: AutodiffTensor<B, C>) -> FloatTensor<Self> {
        layer_nodes::swiglu::<B, C>(gate, up)
    }

    fn rms_norm(
        x: AutodiffTensor<B, C>,
        weight: AutodiffTensor<B, C>,
        eps: f64,
    ) -> FloatTensor<Self> {
        layer_nodes::rms_norm::<B, C>(x, weight, eps)
    }

    fn rotary(
        x: AutodiffTensor<B, C>,
        cos: AutodiffTensor<B, C>,
        sin: AutodiffTensor<B, C>,
        transpose: bool,
    ) -> FloatTensor<Self> {
        layer_nodes::rotary::<B, C>(x, cos, sin, transpose)
    }
}

impl<B: FlashAttentionBackend, C: CheckpointStrategy> CheckpointBackend for Autodiff<B, C> {
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
        checkpoint_node::checkpointed::<B, C, S, PARENTS>(segment, x, context, documents, placement)
    }
}
