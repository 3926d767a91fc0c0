//! `Autodiff<B>`: a linear layer's product `x W` as one graph node whose forward and backward
//! products take `B`'s path (`B::matrix_product`: cuBLAS on CUDA `CubeBackend` tensors), not
//! Burn's autodiff matmul.

use burn::tensor::ops::FloatTensor;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::Autodiff;

use crate::extension::FlashAttentionBackend;
use crate::matmul::Transposed;

/// The backward node of `y = x W`.
#[derive(Debug)]
struct LinearProduct;

impl<B: FlashAttentionBackend> Backward<B, 2> for LinearProduct {
    /// `x` `[rows, d_in]` and `W` `[d_in, d_out]`.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, weight) = ops.state;
        let [x_node, weight_node] = ops.parents;
        if let Some(node) = weight_node {
            let dweight = B::matrix_product(x, grad.clone(), Transposed::Lhs);
            grads.register::<B>(node.id, dweight);
        }
        if let Some(node) = x_node {
            let dx = B::matrix_product(grad, weight, Transposed::Rhs);
            grads.register::<B>(node.id, dx);
        }
    }
}

/// `x W` on `Autodiff<B>`: `x` `[rows, d_in]`, `weight` `[d_in, d_out]`.
pub(crate) fn linear_product<B: FlashAttentionBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    weight: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    let out = B::linear_product(x.primitive.clone(), weight.primitive.clone());
    match LinearProduct
        .prepare::<C>([x.node.clone(), weight.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((x.primitive, weight.primitive), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::LinearConfig;
    use burn::tensor::{Distribution, Tensor, Tolerance};
    use burn_autodiff::Autodiff;
    use burn_ndarray::NdArray;

    use crate::layers::linear;

    type Train = Autodiff<NdArray<f32>>;

    #[test]
    fn the_node_gives_the_gradients_of_burns_linear_layer() {
        let device = Default::default();
        let layer = LinearConfig::new(6, 5).init::<Train>(&device);
        let x = Tensor::<Train, 3>::random([2, 3, 6], Distribution::Default, &device);
        let r = Tensor::<Train, 3>::random([2, 3, 5], Distribution::Default, &device);
        let run = |ours: bool| {
            let x = Tensor::from_inner(x.clone().inner()).require_grad();
            let y = if ours {
                linear(&layer, x.clone())
            } else {
                layer.forward(x.clone())
            };
            let grads = (y.clone() * r.clone()).sum().backward();
            let bias = layer
                .bias
                .as_ref()
                .unwrap()
                .grad(&grads)
                .expect("bias gradient");
            let dx = x.grad(&grads).expect("input gradient");
            let dweight = layer.weight.grad(&grads).expect("weight gradient");
            [
                y.into_data(),
                dx.into_data(),
                dweight.into_data(),
                bias.into_data(),
            ]
        };
        let (ours, burns) = (run(true), run(false));
        for (ours, burns) in ours.into_iter().zip(burns) {
            ours.assert_approx_eq::<f32>(&burns, Tolerance::default());
        }
    }
}
