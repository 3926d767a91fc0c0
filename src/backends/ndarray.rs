//! The ndarray backend: the implementation from Burn tensor operations (`attention_tensor_ops`).

use burn::tensor::ops::FloatTensor;
use burn_ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArray, NdArrayTensor, QuantElement, SharedArray,
};

use crate::attention_tensor_ops;
use crate::extension::{
    AttentionBackend, CheckpointBackend, LayerOpsBackend, SequenceParallelBackend,
};
use crate::options::FlashAttentionOptions;

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> AttentionBackend
    for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>> + From<SharedArray<I>>,
{
    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        attention_tensor_ops::forward::<Self>(q, k, v, options)
    }

    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_out: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        attention_tensor_ops::backward::<Self>(q, k, v, out, lse, grad_out, options)
    }
}

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> SequenceParallelBackend
    for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>> + From<SharedArray<I>>,
{
    computes_itself!();
}

/// The layers' operations from Burn tensor operations (the trait's defaults).
impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> LayerOpsBackend
    for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>> + From<SharedArray<I>>,
{
}

/// No autodiff: a checkpointed segment just runs (the trait's default).
impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> CheckpointBackend
    for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>> + From<SharedArray<I>>,
{
}
