//! The options of one attention step: which kernels run it, the mask, the scale, and whether
//! the backward may use atomics.

use crate::kernel_error::KernelError;
use distflash_schedule::Mask;

/// Which implementation runs a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Variant {
    /// The fastest variant that covers the call: on a Hopper GPU the Hopper forward and backward
    /// for the whole attentions and steps they cover (see [`Variant::Hopper`]; the deterministic
    /// backward under packed documents is not among them), elsewhere and for everything else the tensor-core variant
    /// where the runtime and shapes allow it, the portable one otherwise.
    #[default]
    Auto,
    /// Scalar kernels that run on every CubeCL runtime.
    Portable,
    /// Tensor-core kernels (CUDA with `mma.sync`); an error where unavailable.
    TensorCore,
    /// The Hopper kernels (`wgmma`, bulk tensor copies, warp specialisation; CUDA compute
    /// capability 9.0) for whole attentions, forward ([`crate::attention`]) and backward
    /// ([`crate::attention_backward`], dQ added with atomics, in a fixed order when
    /// deterministic), and for the steps
    /// ([`crate::forward_first_step`], [`crate::forward_step`], [`crate::forward_last_step`],
    /// [`crate::backward_step`]): f16 or bf16, head dim 64 or 128, every mask (causal, sliding
    /// windows, documents) at any offsets. An error where unavailable and for what they do not
    /// cover (other types, head dims and scales, the deterministic backward under packed
    /// documents).
    Hopper,
}

/// Options of one attention step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepOptions {
    /// Which keys each query sees.
    pub mask: Mask,
    /// Score scale; `None` means `1 / sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// Kernel variant.
    pub variant: Variant,
    /// A backward that gives bitwise the same gradients on every run: the tensor-core backward
    /// then computes dQ in its own kernel (recomputing scores, seven GEMMs instead of five); the
    /// Hopper backward keeps its five, its cubes adding to each dQ tile one after another in a
    /// fixed order (not under packed documents, which `Variant::Auto` then runs on the tensor
    /// cores). Off by default: dQ is added with f32 atomics in no fixed order, as
    /// FlashAttention-2 does. The portable kernels are always deterministic.
    pub deterministic: bool,
}

impl StepOptions {
    /// The scale actually applied to `q . k`.
    pub fn resolved_scale(&self, head_dim: usize) -> f32 {
        self.scale.unwrap_or(1.0 / (head_dim as f32).sqrt())
    }

    /// Errors unless the options can be used: a given scale must be finite.
    pub fn check(&self) -> Result<(), KernelError> {
        match self.scale {
            Some(scale) if !scale.is_finite() => Err(KernelError::BadOption {
                what: format!("the score scale must be finite, got {scale}"),
            }),
            _ => Ok(()),
        }
    }
}
