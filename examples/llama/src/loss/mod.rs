//! The next-token loss: the cross-entropy of logits `[rows, vocab]` against targets `[rows]`,
//! summed over the rows. Under `Autodiff` over a backend with fused kernels (the CubeCL backends)
//! one pass over the logits each way, in their element type, with each row's log-sum-exp kept
//! for the backward; elsewhere (and under `DISTFLASH_UNFUSED_LOSS=1`) Burn's log-softmax on an
//! f32 copy of the logits.

mod node;

pub use crate::training_kernels::{unfused_loss_forced, CrossEntropyRows};

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor};

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
