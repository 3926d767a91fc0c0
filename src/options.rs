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
}

impl FlashAttentionOptions {
    /// Causal attention with the default scale.
    pub fn causal() -> Self {
        Self {
            causal: true,
            scale: None,
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
}

/// Why the attention op refused its input.
#[derive(Debug, Clone, PartialEq)]
pub enum AttentionError {
    /// Shapes, head grouping or head dimension are not acceptable (see the message).
    Invalid(KernelError),
    /// The tensors' float type is not one the op supports.
    DType(String),
}

impl fmt::Display for AttentionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttentionError::Invalid(e) => write!(f, "flash attention: {e}"),
            AttentionError::DType(what) => write!(f, "flash attention: {what}"),
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
