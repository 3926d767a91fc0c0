//! The matrix products of the linear layers: cuBLAS on CUDA `CubeBackend` tensors (feature
//! `cublas`, see [`super::cublas`]), Burn's `matmul` on every other backend and whenever cuBLAS
//! cannot take the operands.

use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};

use super::transposed::Transposed;
use crate::distributed::SequenceParallelBackend;

/// The product of two matrices as [`Transposed`] says, `[m, n]`.
pub(crate) fn product<B: Backend>(
    lhs: Tensor<B, 2>,
    rhs: Tensor<B, 2>,
    transposed: Transposed,
) -> Tensor<B, 2> {
    #[cfg(feature = "cublas")]
    if let Some(out) = super::cublas::product(&lhs, &rhs, transposed) {
        return out;
    }
    match transposed {
        Transposed::Neither => lhs.matmul(rhs),
        Transposed::Lhs => lhs.transpose().matmul(rhs),
        Transposed::Rhs => lhs.matmul(rhs.transpose()),
    }
}

/// `x W (+ bias)` of a [`Linear`] layer over `[batch, seq, d_in]` inputs, `[batch, seq, d_out]`,
/// through [`SequenceParallelBackend::linear_product`]: on CUDA `CubeBackend` (and `Autodiff` of
/// it) the products run on cuBLAS (feature `cublas`), elsewhere they are Burn's `matmul`.
///
/// # Shapes
/// - `x`: `[batch, seq, d_in]`; the layer's weight is `[d_in, d_out]`.
/// - output: `[batch, seq, d_out]`.
pub fn linear<B: SequenceParallelBackend>(linear: &Linear<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Distribution, Tolerance};
    use burn_ndarray::NdArray;

    type Cpu = NdArray<f32>;

    #[test]
    fn each_layout_multiplies_the_operands_it_names() {
        let device = Default::default();
        let normal = Distribution::Normal(0.0, 1.0);
        let a = Tensor::<Cpu, 2>::random([5, 3], normal, &device);
        let b = Tensor::<Cpu, 2>::random([3, 4], normal, &device);
        let expected = a.clone().matmul(b.clone());
        let cases = [
            (a.clone(), b.clone(), Transposed::Neither),
            (a.clone().transpose(), b.clone(), Transposed::Lhs),
            (a, b.transpose(), Transposed::Rhs),
        ];
        for (lhs, rhs, transposed) in cases {
            product(lhs, rhs, transposed)
                .into_data()
                .assert_approx_eq::<f32>(&expected.to_data(), Tolerance::default());
        }
    }
}
