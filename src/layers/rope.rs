//! Rotary position embedding (RoPE) in the "rotate half" layout of Hugging Face Llama, with the
//! Llama-3 frequency scaling, applied at absolute positions so a rank's shard of a long sequence
//! rotates exactly as the same rows of the whole sequence would.

use core::f64::consts::PI;

use burn::config::Config;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};

use crate::extension::LayerOpsBackend;

/// Llama-3's rescaling of the rotary frequencies for long contexts (`rope_scaling` of type
/// `llama3` in a Hugging Face config).
#[derive(Config, Debug, PartialEq)]
pub struct Llama3RopeScaling {
    /// How much longer the target context is than the original one (8 for Llama 3.1).
    pub factor: f64,
    /// Wavelengths longer than `original_max_position / low_freq_factor` are divided by `factor`.
    pub low_freq_factor: f64,
    /// Wavelengths shorter than `original_max_position / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context length the model was first trained with (8192 for Llama 3).
    pub original_max_position: usize,
}

/// Configuration of the rotary embedding.
#[derive(Config, Debug, PartialEq)]
pub struct RopeConfig {
    /// Base of the geometric frequency sequence (`rope_theta`).
    #[config(default = 10000.0)]
    pub theta: f64,
    /// Optional Llama-3 frequency scaling.
    #[config(default = "None")]
    pub scaling: Option<Llama3RopeScaling>,
}

impl RopeConfig {
    /// The `head_dim / 2` inverse frequencies, scaled when `scaling` is set (the same formula as
    /// Hugging Face's `_compute_llama3_parameters`).
    pub fn inverse_frequencies(&self, head_dim: usize) -> Vec<f64> {
        (0..head_dim / 2)
            .map(|i| {
                let base = 1.0 / self.theta.powf((2 * i) as f64 / head_dim as f64);
                match &self.scaling {
                    Some(s) => s.scale(base),
                    None => base,
                }
            })
            .collect()
    }
}

impl Llama3RopeScaling {
    /// One scaled inverse frequency: long wavelengths divided by `factor`, short ones kept, the
    /// band in between interpolated smoothly.
    pub fn scale(&self, inv_freq: f64) -> f64 {
        let original = self.original_max_position as f64;
        let wavelen = 2.0 * PI / inv_freq;
        if wavelen < original / self.high_freq_factor {
            inv_freq
        } else if wavelen > original / self.low_freq_factor {
            inv_freq / self.factor
        } else {
            let smooth = (original / wavelen - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * inv_freq / self.factor + smooth * inv_freq
        }
    }
}

/// cos and sin of every (position, frequency) angle for a list of positions (a run of
/// consecutive ones, or a rank's zigzag chunks), laid out `[1, 1, len, head_dim]` to broadcast
/// over `[batch, heads, len, head_dim]`.
#[derive(Debug, Clone)]
pub struct RotaryTables<B: Backend> {
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
}

impl<B: Backend> RotaryTables<B> {
    /// Tables for positions `start .. start + len` (angles in f32 like Hugging Face, then cast to
    /// `dtype`).
    pub fn new(
        config: &RopeConfig,
        head_dim: usize,
        start: usize,
        len: usize,
        dtype: DType,
        device: &B::Device,
    ) -> Self {
        let positions: Vec<usize> = (start..start + len).collect();
        Self::at_positions(config, head_dim, &positions, dtype, device)
    }

    /// Tables for the given positions, in order (row `i` rotates by `positions[i]`).
    pub fn at_positions(
        config: &RopeConfig,
        head_dim: usize,
        positions: &[usize],
        dtype: DType,
        device: &B::Device,
    ) -> Self {
        let len = positions.len();
        let freqs: Vec<f32> = config
            .inverse_frequencies(head_dim)
            .into_iter()
            .map(|f| f as f32)
            .collect();
        let half = freqs.len();
        let f32_on_device = (device, DType::F32);
        let freqs = Tensor::<B, 2>::from_data(TensorData::new(freqs, [1, half]), f32_on_device);
        let positions: Vec<f32> = positions.iter().map(|&p| p as f32).collect();
        let positions =
            Tensor::<B, 2>::from_data(TensorData::new(positions, [len, 1]), f32_on_device);
        // An element-wise product in f32, not a matmul: Burn's matmul may run f32 in TF32 on
        // CUDA, where positions past 2048 would lose their last bits.
        let angles = positions * freqs;
        let angles = Tensor::cat(vec![angles.clone(), angles], 1).reshape([1, 1, len, head_dim]);
        Self {
            cos: angles.clone().cos().cast(dtype),
            sin: angles.sin().cast(dtype),
        }
    }
}

impl<B: LayerOpsBackend> RotaryTables<B> {
    /// Rotates `x` `[batch, heads, len, head_dim]`: `x * cos + rotate_half(x) * sin`
    /// ([`LayerOpsBackend::rotary`]: one pass on `CubeBackend`, any strides of `x`).
    pub fn apply(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.rotate(x, false)
    }

    /// The adjoint of [`apply`](Self::apply) (rotation by the opposite angle): maps the gradient
    /// of the rotated tensor to the gradient of its input.
    pub fn apply_transpose(&self, grad: Tensor<B, 4>) -> Tensor<B, 4> {
        self.rotate(grad, true)
    }

    fn rotate(&self, x: Tensor<B, 4>, transpose: bool) -> Tensor<B, 4> {
        let prim = |t: Tensor<B, 4>| t.into_primitive().tensor();
        let (cos, sin) = (prim(self.cos.clone()), prim(self.sin.clone()));
        Tensor::from_primitive(TensorPrimitive::Float(B::rotary(
            prim(x),
            cos,
            sin,
            transpose,
        )))
    }
}
