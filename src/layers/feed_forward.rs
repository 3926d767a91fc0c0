//! The SwiGLU feed-forward block of Llama: `down(silu(gate(x)) * up(x))`, with its backward.

use burn::config::Config;
use burn::module::Module;
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};

use super::linear_grad::{linear_backward, linear_input_grad, linear_weight_grad};
use super::linear_layer::linear;
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

impl<B: FlashAttentionBackend> FeedForward<B> {
    /// Applies the block to `x` `[batch, seq, d_model]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let gate = linear(&self.gate, x.clone()).into_primitive().tensor();
        let up = linear(&self.up, x).into_primitive().tensor();
        let hidden = Tensor::from_primitive(TensorPrimitive::Float(B::swiglu(gate, up)));
        linear(&self.down, hidden)
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
