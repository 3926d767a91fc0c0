//! Options and errors of the Burn-level attention op.

use core::fmt;

pub use distflash_kernels::Mask;
use distflash_kernels::{AttentionDims, KernelError};
use serde::{Deserialize, Serialize};

/// Options of [`crate::flash_attention`], like Burn's `AttentionModuleOptions`.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct FlashAttentionOptions {
    /// Causal masking (query `i` sees keys `j <= i`, aligned at the start of both sequences).
    pub causal: bool,
    /// Score scale; `None` means `1 / sqrt(head_dim)`.
    pub scale: Option<f64>,
    /// Bitwise reproducible gradients. Off by default: on CUDA the backward then adds dQ with
    /// f32 atomics from one fused kernel (as FlashAttention-2 does; sums in no fixed order, so
    /// runs differ in the last bits). On, dQ gets its own kernel, which recomputes the scores
    /// (slower). The portable kernels are deterministic either way.
    #[serde(default)]
    pub deterministic: bool,
}

impl FlashAttentionOptions {
    /// Causal attention with the default scale.
    pub fn causal() -> Self {
        Self {
            causal: true,
            ..Self::default()
        }
    }

    /// The kernel-level mask these options mean.
    pub fn mask(&self) -> Mask {
        if self.causal {
            Mask::causal()
        } else {
            Mask::None
        }
    }

    /// The scale applied to `q . k` for a given head dimension.
    pub fn resolved_scale(&self, head_dim: usize) -> f64 {
        self.scale.unwrap_or(1.0 / (head_dim as f64).sqrt())
    }

    /// Errors unless the options can be used: a given scale must be finite (also in f32, the
    /// kernels' precision).
    pub fn check(&self) -> Result<(), AttentionError> {
        match self.scale {
            Some(scale) if !(scale as f32).is_finite() => {
                Err(AttentionError::Invalid(KernelError::BadOption {
                    what: format!("the score scale must be finite, got {scale}"),
                }))
            }
            _ => Ok(()),
        }
    }
}

/// Why the attention op refused its input.
#[derive(Debug, Clone, PartialEq)]
pub enum AttentionError {
    /// Shapes, head grouping, head dimension or options are not acceptable, or the call exceeds
    /// a limit of the device (see the message).
    Invalid(KernelError),
    /// The tensors' float type is not one the op (or the device) supports.
    DType(String),
    /// The tensors are not all on one device.
    Device(String),
}

impl fmt::Display for AttentionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttentionError::Invalid(e) => write!(f, "flash attention: {e}"),
            AttentionError::DType(what) | AttentionError::Device(what) => {
                write!(f, "flash attention: {what}")
            }
        }
    }
}

impl std::error::Error for AttentionError {}

impl From<KernelError> for AttentionError {
    fn from(e: KernelError) -> Self {
        AttentionError::Invalid(e)
    }
}

/// Validates q `[B, Hq, Sq, D]`, k and v `[B, Hkv, Skv, D]` before anything runs.
pub fn check_shapes(
    q: &[usize],
    k: &[usize],
    v: &[usize],
) -> Result<AttentionDims, AttentionError> {
    Ok(AttentionDims::from_qkv(q, k, v)?)
}
