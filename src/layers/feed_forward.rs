//! The SwiGLU feed-forward block of Llama: `down(silu(gate(x)) * up(x))`, with its backward.

use burn::config::Config;
use burn::module::Module;
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::tensor::activation::{sigmoid, silu};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use super::linear_grad::{linear_backward, LinearGrads};
use super::linear_layer::linear;
use crate::backend::FlashAttentionBackend;

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

impl<B: FlashAttentionBackend> FeedForward<B> {
    /// Applies the block to `x` `[batch, seq, d_model]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let hidden = silu(linear(&self.gate, x.clone())) * linear(&self.up, x);
        linear(&self.down, hidden)
    }

    /// `(dx, weight gradients)` at input `x` for the output gradient `grad` (recomputes the
    /// hidden activations).
    pub(crate) fn backward(
        &self,
        x: Tensor<B, 3>,
        grad: Tensor<B, 3>,
    ) -> (Tensor<B, 3>, FeedForwardGrads<B>) {
        let gate = linear(&self.gate, x.clone());
        let up = linear(&self.up, x.clone());
        let sig = sigmoid(gate.clone());
        let activated = gate.clone() * sig.clone();
        let LinearGrads {
            input: dhidden,
            weight: ddown,
        } = linear_backward(&self.down, activated.clone() * up.clone(), grad);
        let dup = dhidden.clone() * activated;
        // silu'(g) = sig(g) * (1 + g * (1 - sig(g)))
        let dsilu = sig.clone() * (gate * (sig.neg().add_scalar(1.0))).add_scalar(1.0);
        let dgate = dhidden * up * dsilu;
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
