//! The backend extension: attention with its softmax statistics and a fused backward, as an
//! operation every supported Burn backend implements.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::DType;

use crate::options::FlashAttentionOptions;

/// A Burn backend that can run exact, memory-efficient attention and its fused backward.
///
/// Shapes: q `[B, Hq, Sq, D]`, k and v `[B, Hkv, Skv, D]` (`Hq` a multiple of `Hkv`), O like q,
/// lse `[B, Hq, Sq]` (f32 where the backend allows it). Callers validate shapes first
/// (the public functions do); implementations may panic on invalid input.
pub trait FlashAttentionBackend: Backend {
    /// Float type of the lse returned for inputs of type `input` (f32 on the kernel backends).
    fn lse_dtype(input: DType) -> DType {
        input
    }

    /// `(O, lse)` of softmax attention of q against k, v.
    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `(dq, dk, dv)` from the forward's O and lse and the output gradient, without recomputing
    /// the forward and without materialising the score matrix (on the kernel backends). GQA
    /// gradients are summed into the shared key/value heads.
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_out: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}
