//! Root-mean-square layer norm as in Llama: statistics in f32, the learned scale applied in the
//! input's float type; with its backward, used when a checkpointed layer is recomputed.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

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

impl<B: Backend> RmsNorm<B> {
    /// Normalises `x` `[batch, seq, d_model]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let dtype = x.dtype();
        let (normed, _) = self.normalise(x);
        normed.cast(dtype) * self.weight.val().unsqueeze::<3>()
    }

    /// `(x * r, r)` in f32, `r = 1 / sqrt(mean(x^2) + eps)` per row `[batch, seq, 1]`.
    fn normalise(&self, x: Tensor<B, 3>) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let x = x.cast(DType::F32);
        let inv_rms = x
            .clone()
            .square()
            .mean_dim(2)
            .add_scalar(self.eps)
            .sqrt()
            .recip();
        (x * inv_rms.clone(), inv_rms)
    }

    /// `(dx, dweight)` of [`forward`](Self::forward) at input `x` for the output gradient `grad`.
    pub fn backward(&self, x: Tensor<B, 3>, grad: Tensor<B, 3>) -> (Tensor<B, 3>, Tensor<B, 1>) {
        let dtype = x.dtype();
        let weight = self.weight.val();
        let (normed, inv_rms) = self.normalise(x);
        let [batch, seq, d] = grad.dims();
        let dweight = (grad.clone().cast(DType::F32) * normed.clone())
            .reshape([batch * seq, d])
            .sum_dim(0)
            .reshape([d])
            .cast(weight.dtype());
        let dnormed = (grad * weight.unsqueeze::<3>()).cast(DType::F32);
        let projection = (dnormed.clone() * normed.clone()).mean_dim(2);
        let dx = (dnormed - normed * projection) * inv_rms;
        (dx.cast(dtype), dweight)
    }
}
