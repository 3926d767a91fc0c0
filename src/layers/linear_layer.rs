//! [`linear`]: a Burn [`Linear`] layer applied through the backend's linear product (cuBLAS on
//! CUDA `CubeBackend` tensors, Burn's `matmul` elsewhere; see [`crate::matmul`]), and
//! [`project`], the same product with any weight tensor, and [`matrix_product`], a product with
//! either operand transposed (what the layers' backward passes run).

use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::extension::LayerOpsBackend;
use crate::matmul::{product, Transposed};

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

/// `lhs rhs`, `lhs^T rhs` or `lhs rhs^T` as `transposed` says, `[m, n]`, for any backend: cuBLAS
/// on CUDA `CubeBackend` tensors with contiguous rows (taking the transpose natively, no copy),
/// Burn's `matmul` on row-major operands elsewhere. For the products of a hand-written backward
/// (`dy W^T`, `x^T dy`) and of a weight used transposed (a tied embedding `[vocab, d]` as the
/// output projection: `h E^T`), outside the autodiff graph.
///
/// # Shapes
/// - [`Transposed::Neither`]: `lhs` `[m, k]`, `rhs` `[k, n]`;
/// - [`Transposed::Lhs`]: `lhs` `[k, m]`, `rhs` `[k, n]`;
/// - [`Transposed::Rhs`]: `lhs` `[m, k]`, `rhs` `[n, k]`.
pub fn matrix_product<B: Backend>(
    lhs: Tensor<B, 2>,
    rhs: Tensor<B, 2>,
    transposed: Transposed,
) -> Tensor<B, 2> {
    product(lhs, rhs, transposed)
}
