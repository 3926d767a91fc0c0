//! Root-mean-square layer norm as in Llama: statistics in f32, the learned scale applied in the
//! input's float type; with its backward, used when a checkpointed layer is recomputed. Both run
//! as the backend's [`LayerOpsBackend::rms_norm`] operations.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::extension::LayerOpsBackend;

/// Configuration of [`RmsNorm`].
#[derive(Config, Debug)]
pub struct RmsNormConfig {
    /// Size of the normalised (last) dimension.
    pub d_model: usize,
    /// Added to the mean square before the square root.
    #[config(default = 1e-5)]
    pub eps: f64,
}

impl RmsNormConfig {
    /// A norm with its scale initialised to one.
    pub fn init<B: Backend>(&self, device: &B::Device) -> RmsNorm<B> {
        RmsNorm {
            weight: Param::from_tensor(Tensor::ones([self.d_model], device)),
            eps: self.eps,
        }
    }
}

/// `y = x / sqrt(mean(x^2) + eps) * weight` over the last dimension.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// The learned scale `[d_model]`.
    pub weight: Param<Tensor<B, 1>>,
    /// Added to the mean square.
    pub eps: f64,
}

impl<B: LayerOpsBackend> RmsNorm<B> {
    /// Normalises `x` `[batch, seq, d_model]` ([`LayerOpsBackend::rms_norm`]: one pass on
    /// `CubeBackend`).
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let (x, weight) = (
            x.into_primitive().tensor(),
            self.weight.val().into_primitive().tensor(),
        );
        Tensor::from_primitive(TensorPrimitive::Float(B::rms_norm(x, weight, self.eps)))
    }

    /// `(dx, dweight)` of [`forward`](Self::forward) at input `x` for the output gradient `grad`.
    pub fn backward(&self, x: Tensor<B, 3>, grad: Tensor<B, 3>) -> (Tensor<B, 3>, Tensor<B, 1>) {
        let (dx, dweight) = B::rms_norm_backward(
            x.into_primitive().tensor(),
            self.weight.val().into_primitive().tensor(),
            grad.into_primitive().tensor(),
            self.eps,
        );
        (
            Tensor::from_primitive(TensorPrimitive::Float(dx)),
            Tensor::from_primitive(TensorPrimitive::Float(dweight)),
        )
    }
}
