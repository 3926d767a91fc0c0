//! `Autodiff<B>`: a checkpointed segment (a transformer block) is one graph node over the
//! segment's input and its float parameters, collected by visiting the module. The forward runs
//! on `B` and stores the input (and what the segment keeps at the placement), on the device or,
//! when the segment offloads, in host memory (`crate::offload`); the backward brings them back,
//! recomputes the rest, runs the segment's backward and hands each parameter's gradient to the
//! parent with that parameter's id.

use std::collections::HashMap;
use std::marker::PhantomData;

use burn::module::{ModuleVisitor, Param, ParamId};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::Autodiff;

use crate::extension::{
    AttentionContext, CheckpointPlacement, CheckpointSegment, FlashAttentionBackend,
};
use crate::offload::SavedTensors;
use crate::options::Documents;
use crate::Error;

/// The backward node of one checkpointed segment of type `S` (on the inner backend).
#[derive(Debug)]
struct SegmentNode<S>(PhantomData<S>);

/// What the backward keeps: the segment (its weights shared, not copied), its input followed by
/// what its forward kept (on the device or in host memory), the call's context and documents,
/// and the ids of the parameters in parent order.
#[derive(Debug, Clone)]
struct Kept<B: FlashAttentionBackend, S> {
    segment: S,
    saved: SavedTensors<B>,
    context: AttentionContext<B>,
    documents: Option<Documents>,
    parameters: Vec<ParamId>,
}

fn wrap<B: FlashAttentionBackend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

impl<B, S, const PARENTS: usize> Backward<B, PARENTS> for SegmentNode<S>
where
    B: FlashAttentionBackend,
    S: CheckpointSegment<B, PARENTS>,
{
    type State = Kept<B, S>;

    fn backward(
        self,
        ops: Ops<Self::State, PARENTS>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let kept = ops.state;
        let mut saved = kept.saved.take().into_iter();
        let input = saved.next().expect("a checkpoint saves its input");
        let (dx, parameter_grads) = kept
            .segment
            .backward(
                wrap(input),
                saved.collect(),
                wrap(grad),
                &kept.context,
                kept.documents.as_ref(),
            )
            // A backward pass cannot return an error: a failed peer ends the step here.
            .unwrap_or_else(|e| panic!("recomputing a checkpointed segment: {e}"));
        let mut by_id: HashMap<ParamId, FloatTensor<B>> = parameter_grads.into_iter().collect();
        let mut dx = Some(dx.into_primitive().tensor());
        for (i, parent) in ops.parents.into_iter().enumerate() {
            let grad = match i {
                0 => dx.take(),
                _ => by_id.remove(&kept.parameters[i - 1]),
            };
            match (parent, grad) {
                (Some(node), Some(grad)) => grads.register::<B>(node.id, grad),
                (Some(_), None) => panic!(
                    "the checkpointed segment's backward returned no gradient for its parameter \
                     {:?} (parent {i})",
                    kept.parameters[i - 1]
                ),
                (None, _) => {}
            }
        }
    }
}

/// Collects a module's float parameters (as autodiff tensors, whose nodes become parents) and
/// their ids, in visiting order.
struct Parents<B: FlashAttentionBackend, C: CheckpointStrategy> {
    tensors: Vec<FloatTensor<Autodiff<B, C>>>,
    ids: Vec<ParamId>,
}

impl<B: FlashAttentionBackend, C: CheckpointStrategy> ModuleVisitor<Autodiff<B, C>>
    for Parents<B, C>
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Autodiff<B, C>, D>>) {
        self.tensors.push(param.val().into_primitive().tensor());
        self.ids.push(param.id);
    }
}

/// `segment` applied to `x` as one checkpoint node (see
/// [`CheckpointBackend::checkpointed`](crate::CheckpointBackend::checkpointed)).
pub(crate) fn checkpointed<B, C, S, const PARENTS: usize>(
    segment: &S,
    x: Tensor<Autodiff<B, C>, 3>,
    context: &AttentionContext<Autodiff<B, C>>,
    documents: Option<&Documents>,
    placement: CheckpointPlacement,
) -> Result<Tensor<Autodiff<B, C>, 3>, Error>
where
    B: FlashAttentionBackend,
    C: CheckpointStrategy,
    S: CheckpointSegment<Autodiff<B, C>, PARENTS>,
{
    if placement == CheckpointPlacement::None {
        return segment.forward_stored(x, context, documents);
    }
    let inner = segment.valid_segment();
    let inner_context = context.for_backend::<B>();
    let input = x.clone().inner();
    let (out, kept) = inner.forward_keeping(input.clone(), &inner_context, documents, placement)?;
    let mut visited = Parents::<B, C> {
        tensors: vec![x.into_primitive().tensor()],
        ids: Vec::with_capacity(PARENTS),
    };
    segment.visit(&mut visited);
    let (found, parameters) = (visited.tensors.len(), visited.ids);
    let nodes: Vec<_> = visited.tensors.into_iter().map(|t| t.node).collect();
    let parents: [_; PARENTS] = nodes.try_into().unwrap_or_else(|_| {
        panic!(
            "a checkpoint segment declared {PARENTS} parents (its input and {} parameters) but \
             has {} float parameters",
            PARENTS - 1,
            found - 1
        )
    });
    let out = out.into_primitive().tensor();
    let out = match SegmentNode::<S::On<B>>(PhantomData)
        .prepare::<C>(parents)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let device = input.device();
            let tensors = std::iter::once(input.into_primitive().tensor()).chain(kept);
            let saved = SavedTensors::save(tensors.collect(), &device, segment.offloads())?;
            let kept = Kept {
                segment: inner,
                saved,
                context: inner_context,
                documents: documents.cloned(),
                parameters,
            };
            prep.finish(kept, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(out),
    };
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
}
