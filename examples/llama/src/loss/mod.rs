//! The next-token loss: the cross-entropy of logits `[rows, vocab]` against targets `[rows]`,
//! summed over the rows. Under `Autodiff` over a backend with fused kernels (the CubeCL backends)
//! one pass over the logits each way, in their element type, with each row's log-sum-exp kept
//! for the backward; elsewhere (and under `DISTFLASH_UNFUSED_LOSS=1`) Burn's log-softmax on an
//! f32 copy of the logits.

pub(crate) mod cube;
mod kernels;
mod node;

pub use cube::{unfused_loss_forced, CrossEntropyRows};

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor, TensorPrimitive};

/// Backends on which [`Llama::loss`](crate::Llama::loss) computes the cross-entropy.
pub trait CrossEntropyBackend: Backend {
    /// `sum_rows(-log softmax(logits[row])[targets[row]])` in f32: `logits` `[rows, vocab]`,
    /// `targets` `[rows]` with every id below `vocab`.
    fn cross_entropy_sum(
        logits: Tensor<Self, 2>,
        targets: Tensor<Self, 1, Int>,
    ) -> Tensor<Self, 1> {
        cross_entropy_sum_portable(logits, targets)
    }
}

/// The cross-entropy sum from Burn's operations: log-softmax of an f32 copy of the logits,
/// gathered at the targets.
pub fn cross_entropy_sum_portable<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
) -> Tensor<B, 1> {
    log_softmax(logits.cast(DType::F32), 1)
        .gather(1, targets.unsqueeze_dim(1))
        .sum()
        .neg()
}

/// `dlogits = grad[row] (exp(logits - lse[row]) - onehot(target))` in the logits' element type,
/// from the forward's `lse` and the rows' loss gradient `grad` (f32 `[rows]`), with Burn tensor
/// operations.
pub(crate) fn cross_entropy_backward_portable<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let logits = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(logits));
    let [_, vocab] = logits.dims();
    let dtype = logits.dtype();
    let lse = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(lse));
    let grad = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(grad));
    let onehot = Tensor::<B, 1, Int>::from_primitive(targets)
        .one_hot::<2>(vocab)
        .float()
        .cast(DType::F32);
    let softmax = (logits.cast(DType::F32) - lse.unsqueeze_dim(1)).exp();
    ((softmax - onehot) * grad.unsqueeze_dim(1))
        .cast(dtype)
        .into_primitive()
        .tensor()
}
