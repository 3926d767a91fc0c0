//! [`linear`]: a Burn [`Linear`] layer applied through the backend's linear product (cuBLAS on
//! CUDA `CubeBackend` tensors, Burn's `matmul` elsewhere; see [`crate::matmul`]).

use burn::nn::Linear;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::backend::FlashAttentionBackend;

/// `x W (+ bias)` of a [`Linear`] layer over `[batch, seq, d_in]` inputs, `[batch, seq, d_out]`,
/// through [`FlashAttentionBackend::linear_product`]: on CUDA `CubeBackend` (and `Autodiff` of
/// it) the products run on cuBLAS (feature `cublas`), elsewhere they are Burn's `matmul`.
///
/// # Shapes
/// - `x`: `[batch, seq, d_in]`; the layer's weight is `[d_in, d_out]`.
/// - output: `[batch, seq, d_out]`.
pub fn linear<B: FlashAttentionBackend>(linear: &Linear<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
    let [batch, seq, d_in] = x.dims();
    let weight = linear.weight.val();
    let d_out = weight.dims()[1];
    let x = x.reshape([batch * seq, d_in]).into_primitive().tensor();
    let y = B::linear_product(x, weight.into_primitive().tensor());
    let y = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y)).reshape([batch, seq, d_out]);
    match &linear.bias {
        Some(bias) => y + bias.val().unsqueeze::<3>(),
        None => y,
    }
}
