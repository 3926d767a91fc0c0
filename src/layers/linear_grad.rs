//! The backward of a bias-free [`Linear`] layer `y = x W` over `[batch, seq, d_in]` inputs.

use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::matmul::{product, Transposed};

/// Gradients of a linear layer's input and weight.
pub(crate) struct LinearGrads<B: Backend> {
    /// `dx = dy W^T` `[batch, seq, d_in]`.
    pub input: Tensor<B, 3>,
    /// `dW = x^T dy` summed over batch and sequence `[d_in, d_out]`.
    pub weight: Tensor<B, 2>,
}

/// `(dx, dW)` of `y = x W` at input `x` for the output gradient `grad`.
pub(crate) fn linear_backward<B: Backend>(
    linear: &Linear<B>,
    x: Tensor<B, 3>,
    grad: Tensor<B, 3>,
) -> LinearGrads<B> {
    let [batch, seq, d_in] = x.dims();
    let d_out = grad.dims()[2];
    let rows = batch * seq;
    let grad = grad.reshape([rows, d_out]);
    let weight = product(x.reshape([rows, d_in]), grad.clone(), Transposed::Lhs);
    let input = product(grad, linear.weight.val(), Transposed::Rhs).reshape([batch, seq, d_in]);
    LinearGrads { input, weight }
}
