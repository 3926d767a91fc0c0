//! The matrix products of the linear layers: cuBLAS on CUDA `CubeBackend` tensors (feature
//! `cublas`, see `cublas.rs`), Burn's `matmul` on every other backend and whenever cuBLAS cannot
//! take the operands. Used by the backends' `linear_product` and by the checkpointed blocks'
//! hand-written backward.

#[cfg(feature = "cublas")]
mod cublas;
#[cfg(feature = "cublas")]
mod device_order;
mod transposed;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

pub(crate) use transposed::Transposed;

/// The product of two matrices as [`Transposed`] says, `[m, n]`.
pub(crate) fn product<B: Backend>(
    lhs: Tensor<B, 2>,
    rhs: Tensor<B, 2>,
    transposed: Transposed,
) -> Tensor<B, 2> {
    #[cfg(feature = "cublas")]
    if let Some(out) = cublas::product(&lhs, &rhs, transposed) {
        return out;
    }
    match transposed {
        Transposed::Neither => lhs.matmul(rhs),
        Transposed::Lhs => lhs.transpose().matmul(rhs),
        Transposed::Rhs => lhs.matmul(rhs.transpose()),
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
