//! The output projection and cross-entropy over row chunks, outside any autodiff graph: each
//! chunk's logits `[chunk, vocab]` are made, used and dropped before the next chunk's, in the
//! forward and again in the backward (which recomputes them), so no more than one chunk of logits
//! (and of their gradient) is ever alive. The weight's gradient is summed over the chunks in f32.
//! The fused loss kernels serve where the backend has them ([`TrainingKernels`]), Burn tensor
//! operations elsewhere.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Int, Tensor, TensorPrimitive};
use burn_distflash::layers::{matrix_product, Transposed};

use crate::training_kernels::{cross_entropy_backward_portable, cross_entropy_rows_portable};
use crate::TrainingKernels;

/// Bytes of f32.
const F32_BYTES: u64 = 4;

/// How the output projection's weight is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadLayout {
    /// `[d_model, vocab]`: `logits = h W` (an output projection of its own).
    Untied,
    /// `[vocab, d_model]`: `logits = h E^T` (the embedding table, tied).
    Tied,
}

/// Bytes per row of what one chunk of the loss holds at once, logits of `vocab` elements of
/// `elem_bytes` bytes: the logits and their gradient in their element type, and two f32 rows
/// (the softmax and its difference from the one-hot target in Burn's backward; the fused
/// kernels need less). What a [`RowChunks::Budget`](burn_distflash::layers::RowChunks) of the
/// loss is divided by.
pub fn loss_bytes_per_row(vocab: usize, elem_bytes: usize) -> u64 {
    vocab as u64 * (2 * elem_bytes as u64 + 2 * F32_BYTES)
}

/// The logits `[rows, vocab]` of `hidden` `[rows, d_model]` through `weight` laid out as `layout`.
pub(crate) fn logits<B: Backend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    layout: HeadLayout,
) -> Tensor<B, 2> {
    let transposed = match layout {
        HeadLayout::Untied => Transposed::Neither,
        HeadLayout::Tied => Transposed::Rhs,
    };
    matrix_product(hidden, weight, transposed)
}

/// What the chunked forward gives: the rows' losses, and what its backward needs.
pub(crate) struct ChunkedRows<B: Backend> {
    /// Each row's `lse - logits[target]`, f32 `[rows]`.
    pub loss: FloatTensor<B>,
    /// Each chunk's rows' log-sum-exp, f32 `[chunk]`.
    pub lse: Vec<FloatTensor<B>>,
    /// Whether the fused kernels computed the forward (then they compute the backward too).
    pub fused: bool,
}

/// The inputs of the chunked loss: the hidden states `[rows, d_model]`, the projection weight,
/// its layout, the targets `[rows]` and the chunks' row ranges (at least one, covering the rows
/// in order).
#[derive(Clone, Debug)]
pub(crate) struct ChunkedInputs<B: Backend> {
    pub hidden: FloatTensor<B>,
    pub weight: FloatTensor<B>,
    pub layout: HeadLayout,
    pub targets: burn::tensor::ops::IntTensor<B>,
    pub ranges: Vec<Range<usize>>,
}

fn float<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn primitive<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

impl<B: TrainingKernels> ChunkedInputs<B> {
    /// Chunk `range`'s hidden states, targets and logits.
    fn chunk(&self, range: Range<usize>) -> (Tensor<B, 2>, Tensor<B, 1, Int>, FloatTensor<B>) {
        let hidden = float::<B, 2>(self.hidden.clone()).slice([range.clone()]);
        let targets = Tensor::<B, 1, Int>::from_primitive(self.targets.clone()).slice([range]);
        let logits = logits(hidden.clone(), float(self.weight.clone()), self.layout);
        (hidden, targets, primitive(logits))
    }

    /// Per row, the loss, and per chunk the log-sum-exp, one chunk of logits at a time.
    pub fn forward(&self) -> ChunkedRows<B> {
        let (mut losses, mut lse, mut fused) = (Vec::new(), Vec::new(), true);
        for range in &self.ranges {
            let (_, targets, logits) = self.chunk(range.clone());
            let targets = targets.into_primitive();
            let (loss, chunk_lse) = match B::cross_entropy_forward(logits.clone(), targets.clone())
            {
                Some(rows) => rows,
                None => {
                    fused = false;
                    cross_entropy_rows_portable::<B>(logits, targets)
                }
            };
            losses.push(float::<B, 1>(loss));
            lse.push(chunk_lse);
        }
        ChunkedRows {
            loss: primitive(Tensor::cat(losses, 0)),
            lse,
            fused,
        }
    }

    /// `[dhidden, dweight]` for the rows' loss gradient `grad` (f32 `[rows]`), from the
    /// forward's per-chunk `lse` and whether it was `fused`: each chunk's logits recomputed,
    /// their gradient taken to the hidden states (written per chunk) and to the weight (summed
    /// in f32 over the chunks, returned in the weight's type).
    pub fn backward(
        &self,
        lse: &[FloatTensor<B>],
        fused: bool,
        grad: FloatTensor<B>,
    ) -> [FloatTensor<B>; 2] {
        let grad = float::<B, 1>(grad);
        let weight = float::<B, 2>(self.weight.clone());
        let (mut dhidden, mut dweight) = (Vec::with_capacity(self.ranges.len()), None);
        for (range, lse) in self.ranges.iter().zip(lse) {
            let (hidden, targets, logits) = self.chunk(range.clone());
            let (targets, lse) = (targets.into_primitive(), lse.clone());
            let grad = primitive(grad.clone().slice([range.clone()]));
            let dlogits = match fused {
                true => B::cross_entropy_backward(logits, targets, lse, grad),
                false => cross_entropy_backward_portable::<B>(logits, targets, lse, grad),
            };
            let dlogits = float::<B, 2>(dlogits);
            let (to_hidden, to_weight) = match self.layout {
                HeadLayout::Untied => (
                    matrix_product(dlogits.clone(), weight.clone(), Transposed::Rhs),
                    matrix_product(hidden, dlogits, Transposed::Lhs),
                ),
                HeadLayout::Tied => (
                    matrix_product(dlogits.clone(), weight.clone(), Transposed::Neither),
                    matrix_product(dlogits, hidden, Transposed::Lhs),
                ),
            };
            dhidden.push(to_hidden);
            let to_weight = to_weight.cast(DType::F32);
            dweight = Some(match dweight {
                None => to_weight,
                Some(sum) => sum + to_weight,
            });
        }
        let dweight = dweight.expect("the chunked loss has at least one row");
        [
            primitive(Tensor::cat(dhidden, 0)),
            primitive(dweight.cast(weight.dtype())),
        ]
    }
}
