//! `Autodiff<B>`: the layers' element-wise operations (SwiGLU, RMS norm, rotary embedding) as one
//! graph node each, whose forward and backward are `B`'s (one CubeCL pass each on `CubeBackend`)
//! instead of the graph of Burn's tensor operations.

use burn::tensor::ops::FloatTensor;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::Autodiff;

use crate::extension::FlashAttentionBackend;

type AutodiffTensor<B, C> = FloatTensor<Autodiff<B, C>>;

/// The backward node of `silu(gate) * up`.
#[derive(Debug)]
struct SwigluNode;

impl<B: FlashAttentionBackend> Backward<B, 2> for SwigluNode {
    /// `gate` and `up`.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dhidden = grads.consume::<B>(&ops.node);
        let (gate, up) = ops.state;
        let (_, dgate, dup) = B::swiglu_backward(gate, up, dhidden);
        let [gate_node, up_node] = ops.parents;
        for (node, grad) in [(gate_node, dgate), (up_node, dup)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// `silu(gate) * up` on `Autodiff<B>`.
pub(crate) fn swiglu<B: FlashAttentionBackend, C: CheckpointStrategy>(
    gate: AutodiffTensor<B, C>,
    up: AutodiffTensor<B, C>,
) -> AutodiffTensor<B, C> {
    let out = B::swiglu(gate.primitive.clone(), up.primitive.clone());
    match SwigluNode
        .prepare::<C>([gate.node.clone(), up.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((gate.primitive, up.primitive), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

/// The backward node of an RMS norm.
#[derive(Debug)]
struct RmsNormNode;

impl<B: FlashAttentionBackend> Backward<B, 2> for RmsNormNode {
    /// `x`, `weight` and `eps`.
    type State = (FloatTensor<B>, FloatTensor<B>, f64);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, weight, eps) = ops.state;
        let (dx, dweight) = B::rms_norm_backward(x, weight, grad, eps);
        let [x_node, weight_node] = ops.parents;
        for (node, grad) in [(x_node, dx), (weight_node, dweight)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// The RMS norm of `x` with `weight` on `Autodiff<B>`.
pub(crate) fn rms_norm<B: FlashAttentionBackend, C: CheckpointStrategy>(
    x: AutodiffTensor<B, C>,
    weight: AutodiffTensor<B, C>,
    eps: f64,
) -> AutodiffTensor<B, C> {
    let out = B::rms_norm(x.primitive.clone(), weight.primitive.clone(), eps);
    match RmsNormNode
        .prepare::<C>([x.node.clone(), weight.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((x.primitive, weight.primitive, eps), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

/// The backward node of a rotary embedding: the adjoint rotation of the output gradient (the
/// tables are constants).
#[derive(Debug)]
struct RotaryNode;

impl<B: FlashAttentionBackend> Backward<B, 1> for RotaryNode {
    /// `cos`, `sin` and whether the forward was the adjoint.
    type State = (FloatTensor<B>, FloatTensor<B>, bool);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (cos, sin, transpose) = ops.state;
        if let [Some(node)] = ops.parents {
            grads.register::<B>(node.id, B::rotary(grad, cos, sin, !transpose));
        }
    }
}

/// The rotary embedding (or its adjoint) of `x` on `Autodiff<B>`; no gradient reaches the tables.
pub(crate) fn rotary<B: FlashAttentionBackend, C: CheckpointStrategy>(
    x: AutodiffTensor<B, C>,
    cos: AutodiffTensor<B, C>,
    sin: AutodiffTensor<B, C>,
    transpose: bool,
) -> AutodiffTensor<B, C> {
    let (cos, sin) = (cos.primitive, sin.primitive);
    let out = B::rotary(x.primitive, cos.clone(), sin.clone(), transpose);
    match RotaryNode
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((cos, sin, transpose), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Distribution, Tensor, TensorPrimitive, Tolerance};
    use burn_autodiff::Autodiff;
    use burn_ndarray::NdArray;

    use crate::extension::LayerOpsBackend;
    use crate::layer_ops::tensor_ops;

    type Train = Autodiff<NdArray<f32>>;
    type Prim = burn::tensor::ops::FloatTensor<Train>;

    fn leaf<const D: usize>(shape: [usize; D]) -> Tensor<Train, D> {
        Tensor::random(shape, Distribution::Normal(0.0, 1.5), &Default::default()).require_grad()
    }

    fn prim<const D: usize>(t: &Tensor<Train, D>) -> Prim {
        t.clone().into_primitive().tensor()
    }

    /// The node's output and the gradients of `inputs` for `sum(y * r)` against those of Burn's
    /// autodiff of the same operation written with tensor operations.
    fn assert_same_gradients<const D: usize, const I: usize>(
        inputs: [Tensor<Train, D>; I],
        node: impl Fn([Prim; I]) -> Prim,
        tensor_ops: impl Fn([Prim; I]) -> Prim,
    ) {
        let r = Tensor::<Train, D>::random(
            inputs[0].dims(),
            Distribution::Default,
            &Default::default(),
        );
        let run = |op: &dyn Fn([Prim; I]) -> Prim| {
            let fresh = inputs
                .clone()
                .map(|t| Tensor::<Train, D>::from_inner(t.inner()).require_grad());
            let y = Tensor::<Train, D>::from_primitive(TensorPrimitive::Float(op(fresh
                .each_ref()
                .map(prim))));
            let grads = (y.clone() * r.clone()).sum().backward();
            let mut out = vec![y.into_data()];
            out.extend(
                fresh
                    .iter()
                    .map(|t| t.grad(&grads).expect("input gradient").into_data()),
            );
            out
        };
        for (ours, burns) in run(&node).into_iter().zip(run(&tensor_ops)) {
            ours.assert_approx_eq::<f32>(&burns, Tolerance::default());
        }
    }

    #[test]
    fn swiglu_node_matches_burns_autodiff() {
        assert_same_gradients(
            [leaf([2, 5, 12]), leaf([2, 5, 12])],
            |[g, u]| Train::swiglu(g, u),
            |[g, u]| tensor_ops::swiglu::<Train>(g, u),
        );
    }

    #[test]
    fn rms_norm_node_matches_burns_autodiff() {
        let (x, weight) = (leaf([2, 5, 12]), leaf([12]));
        let r = Tensor::<Train, 3>::random([2, 5, 12], Distribution::Default, &Default::default());
        let run = |ours: bool| {
            let x = Tensor::<Train, 3>::from_inner(x.clone().inner()).require_grad();
            let weight = Tensor::<Train, 1>::from_inner(weight.clone().inner()).require_grad();
            let y = if ours {
                Train::rms_norm(prim(&x), prim(&weight), 1e-5)
            } else {
                tensor_ops::rms_norm::<Train>(prim(&x), prim(&weight), 1e-5)
            };
            let y = Tensor::<Train, 3>::from_primitive(TensorPrimitive::Float(y));
            let grads = (y.clone() * r.clone()).sum().backward();
            [
                y.into_data(),
                x.grad(&grads).expect("input gradient").into_data(),
                weight.grad(&grads).expect("weight gradient").into_data(),
            ]
        };
        for (ours, burns) in run(true).into_iter().zip(run(false)) {
            ours.assert_approx_eq::<f32>(&burns, Tolerance::default());
        }
    }

    #[test]
    fn rotary_node_matches_burns_autodiff_both_ways() {
        let table =
            || Tensor::<Train, 4>::random([1, 1, 5, 8], Distribution::Default, &Default::default());
        let (cos, sin) = (table(), table());
        for transpose in [false, true] {
            let (c, s) = (cos.clone(), sin.clone());
            let (c2, s2) = (cos.clone(), sin.clone());
            assert_same_gradients(
                [leaf([2, 3, 5, 8])],
                move |[x]| Train::rotary(x, prim(&c), prim(&s), transpose),
                move |[x]| tensor_ops::rotary::<Train>(x, prim(&c2), prim(&s2), transpose),
            );
        }
    }
}
