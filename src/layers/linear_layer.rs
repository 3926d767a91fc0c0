//! [`linear`]: a Burn [`Linear`] layer applied through the backend's linear product (cuBLAS on
//! CUDA `CubeBackend` tensors, Burn's `matmul` elsewhere; see [`crate::matmul`]), and
//! [`project`], the same product with any weight tensor.

use burn::nn::Linear;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::extension::LayerOpsBackend;

/// `x W (+ bias)` of a [`Linear`] layer over `[batch, seq, d_in]` inputs, `[batch, seq, d_out]`,
/// through [`LayerOpsBackend::linear_product`]: on CUDA `CubeBackend` (and `Autodiff` of
/// it) the products run on cuBLAS (feature `cublas`), elsewhere they are Burn's `matmul`.
///
/// # Shapes
/// - `x`: `[batch, seq, d_in]`; the layer's weight is `[d_in, d_out]`.
/// - output: `[batch, seq, d_out]`.
pub fn linear<B: LayerOpsBackend>(linear: &Linear<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
    let y = project(x, linear.weight.val());
    match &linear.bias {
        Some(bias) => y + bias.val().unsqueeze::<3>(),
        None => y,
    }
}

/// `x W` for any weight tensor, a view too (a tied embedding's transpose as an output
/// projection), through [`LayerOpsBackend::linear_product`] as [`linear`] does; on
/// `Autodiff` the gradient reaches whatever `weight` is a view of.
///
/// # Shapes
/// - `x`: `[batch, seq, d_in]`; `weight`: `[d_in, d_out]`.
/// - output: `[batch, seq, d_out]`.
pub fn project<B: LayerOpsBackend>(x: Tensor<B, 3>, weight: Tensor<B, 2>) -> Tensor<B, 3> {
    let [batch, seq, d_in] = x.dims();
    let d_out = weight.dims()[1];
    let x = x.reshape([batch * seq, d_in]).into_primitive().tensor();
    let y = B::linear_product(x, weight.into_primitive().tensor());
    Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y)).reshape([batch, seq, d_out])
}
