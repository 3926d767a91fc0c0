//! The next-token loss: the cross-entropy of logits `[rows, vocab]` against targets `[rows]`,
//! summed over the rows. Under `Autodiff` over a backend with fused kernels (the CubeCL backends)
//! one pass over the logits each way, in their element type, with each row's log-sum-exp kept
//! for the backward; elsewhere (and under `DISTFLASH_UNFUSED_LOSS=1`) Burn's log-softmax on an
//! f32 copy of the logits.
//!
//! The model's loss runs the output projection and the cross-entropy together over row chunks
//! ([`CrossEntropyBackend::projected_cross_entropy_sum`]): one chunk of logits exists at a time,
//! in the forward and in the backward, which recomputes them.

mod chunked;
mod chunked_node;
mod node;

pub use crate::training_kernels::{unfused_loss_forced, CrossEntropyRows};
pub use chunked::{loss_bytes_per_row, HeadLayout};

use std::num::NonZeroU64;
use std::ops::Range;

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor};
use burn_distflash::layers::RowChunks;

/// The default chunking of the loss: chunks whose logits take at most 1 GiB by
/// [`loss_bytes_per_row`] (about 2700 tokens of LLaMA-7B's 32000-token vocabulary in bf16, 680 of
/// Llama-3's 128256), one chunk for any sequence a CPU trains.
pub const DEFAULT_LOSS_CHUNKS: RowChunks = match NonZeroU64::new(1 << 30) {
    Some(bytes) => RowChunks::Budget(bytes),
    None => unreachable!(),
};

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

    /// [`cross_entropy_sum`](Self::cross_entropy_sum) of the logits `hidden W` (`hidden`
    /// `[rows, d_model]`, `weight` laid out as `layout` says), computed over row chunks as
    /// `chunks` says with [`loss_bytes_per_row`]: no more than one chunk of logits is alive. Under
    /// `Autodiff` one node whose backward recomputes each chunk's logits and sums the weight's
    /// gradient over the chunks in f32; elsewhere the chunks' losses through Burn's operations.
    fn projected_cross_entropy_sum(
        hidden: Tensor<Self, 2>,
        weight: Tensor<Self, 2>,
        layout: HeadLayout,
        targets: Tensor<Self, 1, Int>,
        chunks: &RowChunks,
    ) -> Tensor<Self, 1> {
        chunk_ranges(&hidden, &weight, layout, chunks)
            .into_iter()
            .map(|range| {
                let rows = hidden.clone().slice([range.clone()]);
                let logits = chunked::logits(rows, weight.clone(), layout);
                Self::cross_entropy_sum(logits, targets.clone().slice([range]))
            })
            .reduce(|a, b| a + b)
            .expect("the loss has at least one row")
    }
}

/// The chunks' row ranges of the loss of `hidden` through `weight`: the vocabulary from the
/// weight's layout, the element size from the hidden states.
fn chunk_ranges<B: Backend>(
    hidden: &Tensor<B, 2>,
    weight: &Tensor<B, 2>,
    layout: HeadLayout,
    chunks: &RowChunks,
) -> Vec<Range<usize>> {
    let [rows, _] = hidden.dims();
    let vocab = match layout {
        HeadLayout::Untied => weight.dims()[1],
        HeadLayout::Tied => weight.dims()[0],
    };
    chunks.ranges(rows, loss_bytes_per_row(vocab, hidden.dtype().size()))
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
