//! The matrix products of the linear layers: cuBLAS on CUDA `CubeBackend` tensors (feature
//! `cublas`, see `cublas.rs`), Burn's `matmul` on every other backend and whenever cuBLAS cannot
//! take the operands. Used by the backends' `linear_product` and by the checkpointed blocks'
//! hand-written backward.
//!
//! Burn's matmul is only ever handed row-major operands ([`matmul`]): Burn 0.21's CubeCL matmul
//! can return wrong values for a transposed view (seen on wgpu: `a [16, 40]` times the transpose
//! of `b [528, 40]` off by up to 3.9, exact on a row-major copy), so a transposed, permuted or
//! broadcast operand is copied to row-major memory first. cuBLAS takes transposes natively.

#[cfg(feature = "cublas")]
mod cublas;
#[cfg(feature = "cublas")]
mod device_order;
mod transposed;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

pub use transposed::Transposed;

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
        Transposed::Neither => matmul(lhs, rhs),
        Transposed::Lhs => matmul(lhs.transpose(), rhs),
        Transposed::Rhs => matmul(lhs, rhs.transpose()),
    }
}

/// Burn's `lhs.matmul(rhs)` on row-major copies of operands that are views (transposed,
/// permuted, broadcast); row-major operands go in as they are. Every Burn matmul of this crate
/// goes through here (see the module docs for why).
pub(crate) fn matmul<B: Backend, const D: usize>(
    lhs: Tensor<B, D>,
    rhs: Tensor<B, D>,
) -> Tensor<B, D> {
    row_major(lhs).matmul(row_major(rhs))
}

/// `t` in row-major memory: flattening a view that strides cannot describe makes every backend
/// copy it (CubeCL's and ndarray's reshape), and the second reshape only sets strides. A
/// row-major tensor comes back as it is, without a copy.
fn row_major<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    let dims = t.dims();
    t.reshape([dims.iter().product::<usize>()]).reshape(dims)
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
