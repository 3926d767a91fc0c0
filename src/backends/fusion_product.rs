//! `Fusion<B>`: the linear layers' matrix products as a custom operation of the fusion stream,
//! run by `B::matrix_product` on the inner backend's tensors when the stream executes (cuBLAS on
//! CUDA). Burn 0.21's fused matmul is bypassed: on an H200 it gave a wrong weight gradient
//! `x^T dy` (32 rows, 40 -> 528, f32 and bf16) where the same product on the inner backend is
//! exact.

use core::marker::PhantomData;

use burn::tensor::ops::FloatTensor;
use burn::tensor::Shape;
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use crate::extension::LayerOpsBackend;
use crate::matmul::Transposed;

/// Inputs lhs, rhs; output their product as `transposed` says.
#[derive(Debug)]
struct ProductOp<B> {
    desc: CustomOpIr,
    transposed: Transposed,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + LayerOpsBackend> Operation<B::FusionRuntime> for ProductOp<B> {
    fn execute(&self, handles: &mut HandleContainer<B::Handle>) {
        let ([lhs, rhs], [out]) = self.desc.as_fixed::<2, 1>();
        let product = B::matrix_product(
            handles.get_float_tensor::<B>(lhs),
            handles.get_float_tensor::<B>(rhs),
            self.transposed,
        );
        handles.register_float_tensor::<B>(&out.id, product);
    }
}

/// `[m, n]` of the operands' shapes as `transposed` says (see [`Transposed`]).
fn product_shape(lhs: &Shape, rhs: &Shape, transposed: Transposed) -> Shape {
    let (lhs, rhs) = (lhs.dims::<2>(), rhs.dims::<2>());
    let m = match transposed {
        Transposed::Lhs => lhs[1],
        Transposed::Neither | Transposed::Rhs => lhs[0],
    };
    let n = match transposed {
        Transposed::Rhs => rhs[0],
        Transposed::Neither | Transposed::Lhs => rhs[1],
    };
    Shape::new([m, n])
}

/// [`LayerOpsBackend::matrix_product`] of `Fusion<B>`: registered on the fusion stream, run by
/// `B`.
pub(super) fn matrix_product<B: FusionBackend + LayerOpsBackend>(
    lhs: FloatTensor<Fusion<B>>,
    rhs: FloatTensor<Fusion<B>>,
    transposed: Transposed,
) -> FloatTensor<Fusion<B>> {
    let streams = OperationStreams::with_inputs([&lhs, &rhs]);
    let client = lhs.client.clone();
    let shape = product_shape(&lhs.shape, &rhs.shape, transposed);
    let out = TensorIr::uninit(client.create_empty_handle(), shape, lhs.dtype);
    let desc = CustomOpIr::new(
        "distflash_matrix_product",
        &[lhs.into_ir(), rhs.into_ir()],
        &[out],
    );
    let op = ProductOp::<B> {
        desc: desc.clone(),
        transposed,
        _backend: PhantomData,
    };
    let [out]: [FusionTensor<B::FusionRuntime>; 1] = client
        .register(streams, OperationIr::Custom(desc), op)
        .try_into()
        .expect("one output");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_product_shape_follows_the_transposed_operand() {
        let shape = |dims: [usize; 2]| Shape::new(dims);
        let cases = [
            (shape([5, 3]), shape([3, 4]), Transposed::Neither),
            (shape([3, 5]), shape([3, 4]), Transposed::Lhs),
            (shape([5, 3]), shape([4, 3]), Transposed::Rhs),
        ];
        for (lhs, rhs, transposed) in cases {
            assert_eq!(product_shape(&lhs, &rhs, transposed), shape([5, 4]));
        }
    }
}
