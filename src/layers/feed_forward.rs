//! The SwiGLU feed-forward block of Llama: `down(silu(gate(x)) * up(x))`, with its backward, both
//! also over row chunks of the sequence ([`RowChunks`]) so that the `[rows, d_ff]` activations
//! exist one chunk at a time.

use burn::config::Config;
use burn::module::Module;
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorPrimitive};

use super::linear_grad::{linear_backward, linear_input_grad, linear_weight_grad};
use super::linear_layer::linear;
use super::row_chunks::RowChunks;
use crate::extension::FlashAttentionBackend;

/// Configuration of [`FeedForward`].
#[derive(Config, Debug)]
pub struct FeedForwardConfig {
    /// Width of the residual stream.
    pub d_model: usize,
    /// Width of the hidden layer (11008 for Llama-7B).
    pub d_ff: usize,
    /// Initialiser of the weights (Llama: normal, std 0.02).
    #[config(default = "Initializer::Normal { mean: 0.0, std: 0.02 }")]
    pub initializer: Initializer,
}

impl FeedForwardConfig {
    /// The module.
    pub fn init<B: Backend>(&self, device: &B::Device) -> FeedForward<B> {
        let linear = |d_in: usize, d_out: usize| {
            LinearConfig::new(d_in, d_out)
                .with_bias(false)
                .with_initializer(self.initializer.clone())
                .init(device)
        };
        FeedForward {
            gate: linear(self.d_model, self.d_ff),
            up: linear(self.d_model, self.d_ff),
            down: linear(self.d_ff, self.d_model),
        }
    }
}

/// SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`.
#[derive(Module, Debug)]
pub struct FeedForward<B: Backend> {
    /// Gate projection `[d_model, d_ff]`.
    pub gate: Linear<B>,
    /// Up projection `[d_model, d_ff]`.
    pub up: Linear<B>,
    /// Down projection `[d_ff, d_model]`.
    pub down: Linear<B>,
}

/// Gradients of the three weights of a [`FeedForward`].
pub(crate) struct FeedForwardGrads<B: Backend> {
    pub gate: Tensor<B, 2>,
    pub up: Tensor<B, 2>,
    pub down: Tensor<B, 2>,
}

impl<B: Backend> FeedForwardGrads<B> {
    /// Each gradient as `dtype`.
    fn cast(self, dtype: DType) -> Self {
        Self {
            gate: self.gate.cast(dtype),
            up: self.up.cast(dtype),
            down: self.down.cast(dtype),
        }
    }

    /// The element-wise sums with `other`'s gradients.
    fn add(self, other: Self) -> Self {
        Self {
            gate: self.gate + other.gate,
            up: self.up + other.up,
            down: self.down + other.down,
        }
    }
}

/// Bytes per row of the `[rows, d_ff]` tensors the feed-forward backward holds at once (the
/// gate and up activations, the hidden activation and its gradient, the gate's and up's
/// gradients: six) with elements of `elem_bytes` bytes: what a [`RowChunks::Budget`] of the
/// feed-forward block is divided by. The forward holds half as many.
pub fn feed_forward_bytes_per_row(d_ff: usize, elem_bytes: usize) -> u64 {
    6 * d_ff as u64 * elem_bytes as u64
}

impl<B: FlashAttentionBackend> FeedForward<B> {
    /// Applies the block to `x` `[batch, seq, d_model]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let gate = linear(&self.gate, x.clone()).into_primitive().tensor();
        let up = linear(&self.up, x).into_primitive().tensor();
        let hidden = Tensor::from_primitive(TensorPrimitive::Float(B::swiglu(gate, up)));
        linear(&self.down, hidden)
    }

    /// [`forward`](Self::forward) over row chunks of `x`'s `batch * seq` rows as `chunks` says
    /// (the `[rows, d_ff]` activations exist one chunk at a time); one chunk is
    /// [`forward`](Self::forward) itself.
    pub(crate) fn forward_chunked(&self, x: Tensor<B, 3>, chunks: &RowChunks) -> Tensor<B, 3> {
        let ranges = self.row_ranges(&x, chunks);
        if ranges.len() <= 1 {
            return self.forward(x);
        }
        let [batch, seq, d_model] = x.dims();
        let rows = x.reshape([1, batch * seq, d_model]);
        let outputs = ranges
            .into_iter()
            .map(|range| self.forward(rows.clone().slice([0..1, range])))
            .collect();
        Tensor::cat(outputs, 1).reshape([batch, seq, d_model])
    }

    /// [`backward`](Self::backward) over row chunks of the `batch * seq` rows as `chunks` says:
    /// each chunk's activations are recomputed, used and dropped before the next; the weight
    /// gradients are summed over the chunks in f32 and returned in the type one chunk gives.
    pub(crate) fn backward_chunked(
        &self,
        x: Tensor<B, 3>,
        grad: Tensor<B, 3>,
        chunks: &RowChunks,
    ) -> (Tensor<B, 3>, FeedForwardGrads<B>) {
        let ranges = self.row_ranges(&x, chunks);
        if ranges.len() <= 1 {
            return self.backward(x, grad);
        }
        let [batch, seq, d_model] = x.dims();
        let x = x.reshape([1, batch * seq, d_model]);
        let grad = grad.reshape([1, batch * seq, d_model]);
        let (mut dx, mut sum, mut dtype) = (Vec::with_capacity(ranges.len()), None, None);
        for range in ranges {
            let rows = [0..1, range];
            let (dx_chunk, grads) =
                self.backward(x.clone().slice(rows.clone()), grad.clone().slice(rows));
            dx.push(dx_chunk);
            dtype.get_or_insert(grads.down.dtype());
            let grads = grads.cast(DType::F32);
            sum = Some(match sum {
                None => grads,
                Some(sum) => grads.add(sum),
            });
        }
        let sum = sum.expect("at least two chunks");
        let dtype = dtype.expect("at least two chunks");
        (
            Tensor::cat(dx, 1).reshape([batch, seq, d_model]),
            sum.cast(dtype),
        )
    }

    /// The chunks' row ranges for input `x`, from the bytes one row of its activations takes.
    fn row_ranges(&self, x: &Tensor<B, 3>, chunks: &RowChunks) -> Vec<std::ops::Range<usize>> {
        let [batch, seq, _] = x.dims();
        let d_ff = self.up.weight.dims()[1];
        chunks.ranges(
            batch * seq,
            feed_forward_bytes_per_row(d_ff, x.dtype().size()),
        )
    }

    /// `(dx, weight gradients)` at input `x` for the output gradient `grad` (recomputes the
    /// hidden activations).
    pub(crate) fn backward(
        &self,
        x: Tensor<B, 3>,
        grad: Tensor<B, 3>,
    ) -> (Tensor<B, 3>, FeedForwardGrads<B>) {
        let prim = |t: Tensor<B, 3>| t.into_primitive().tensor();
        let wrap = |t| Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(t));
        let gate = prim(linear(&self.gate, x.clone()));
        let up = prim(linear(&self.up, x.clone()));
        // The down projection's input gradient needs only its weight, so the hidden activation
        // (its weight gradient's input) is recomputed with the SwiGLU gradients in one pass.
        let dhidden = prim(linear_input_grad(&self.down, grad.clone()));
        let (hidden, dgate, dup) = B::swiglu_backward(gate, up, dhidden);
        let ddown = linear_weight_grad(wrap(hidden), grad);
        let (dgate, dup) = (wrap(dgate), wrap(dup));
        let from_gate = linear_backward(&self.gate, x.clone(), dgate);
        let from_up = linear_backward(&self.up, x, dup);
        (
            from_gate.input + from_up.input,
            FeedForwardGrads {
                gate: from_gate.weight,
                up: from_up.weight,
                down: ddown,
            },
        )
    }
}
