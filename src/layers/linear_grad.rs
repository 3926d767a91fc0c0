//! The backward of a bias-free [`Linear`] layer `y = x W` over `[batch, seq, d_in]` inputs.

use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::extension::LayerOpsBackend;
use crate::matmul::Transposed;

/// Gradients of a linear layer's input and weight.
pub(crate) struct LinearGrads<B: Backend> {
    /// `dx = dy W^T` `[batch, seq, d_in]`.
    pub input: Tensor<B, 3>,
    /// `dW = x^T dy` summed over batch and sequence `[d_in, d_out]`.
    pub weight: Tensor<B, 2>,
}

/// `(dx, dW)` of `y = x W` at input `x` for the output gradient `grad`.
pub(crate) fn linear_backward<B: LayerOpsBackend>(
    linear: &Linear<B>,
    x: Tensor<B, 3>,
    grad: Tensor<B, 3>,
) -> LinearGrads<B> {
    LinearGrads {
        input: linear_input_grad(linear, grad.clone()),
        weight: linear_weight_grad(x, grad),
    }
}

/// `dx = dy W^T` `[batch, seq, d_in]` of `y = x W` for the output gradient `grad`.
pub(crate) fn linear_input_grad<B: LayerOpsBackend>(
    linear: &Linear<B>,
    grad: Tensor<B, 3>,
) -> Tensor<B, 3> {
    let [batch, seq, d_out] = grad.dims();
    let weight = linear.weight.val();
    let d_in = weight.dims()[0];
    let grad = grad.reshape([batch * seq, d_out]);
    product(grad, weight, Transposed::Rhs).reshape([batch, seq, d_in])
}

/// `dW = x^T dy` `[d_in, d_out]` of `y = x W` at input `x` for the output gradient `grad`,
/// summed over batch and sequence.
pub(crate) fn linear_weight_grad<B: LayerOpsBackend>(
    x: Tensor<B, 3>,
    grad: Tensor<B, 3>,
) -> Tensor<B, 2> {
    let [batch, seq, d_in] = x.dims();
    let d_out = grad.dims()[2];
    let rows = batch * seq;
    product(
        x.reshape([rows, d_in]),
        grad.reshape([rows, d_out]),
        Transposed::Lhs,
    )
}

/// [`LayerOpsBackend::matrix_product`] of Burn tensors.
fn product<B: LayerOpsBackend>(
    lhs: Tensor<B, 2>,
    rhs: Tensor<B, 2>,
    transposed: Transposed,
) -> Tensor<B, 2> {
    let prim = |t: Tensor<B, 2>| t.into_primitive().tensor();
    let out = B::matrix_product(prim(lhs), prim(rhs), transposed);
    Tensor::from_primitive(TensorPrimitive::Float(out))
}
