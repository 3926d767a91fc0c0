//! Backends without autodiff: a checkpointed block is just the block.

use crate::Error;
use burn::tensor::Tensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::{Fusion, FusionBackend};
use burn_ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArray, NdArrayTensor, QuantElement, SharedArray,
};

use super::{CheckpointBackend, CheckpointPlacement};
use crate::backend::FlashAttentionBackend;
use crate::layers::{AttentionContext, TransformerBlock};

/// Implements the trait by running the block's ordinary forward.
macro_rules! runs_the_block {
    () => {
        fn checkpoint_block(
            block: &TransformerBlock<Self>,
            x: Tensor<Self, 3>,
            context: &AttentionContext<Self::Inner>,
            _placement: CheckpointPlacement,
        ) -> Result<Tensor<Self, 3>, Error> {
            block.forward_stored(x, context)
        }
    };
}

impl<R, F, I, BT> CheckpointBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    runs_the_block!();
}

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> CheckpointBackend
    for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>> + From<SharedArray<I>>,
{
    runs_the_block!();
}

impl<B> CheckpointBackend for Fusion<B>
where
    B: FusionBackend + FlashAttentionBackend<Inner = B>,
{
    runs_the_block!();
}
