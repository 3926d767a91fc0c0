//! Errors returned by the host-side launch functions instead of launching a bad kernel.

use core::fmt;

/// Why a kernel call was refused before anything was launched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelError {
    /// A tensor does not have the rank the operation expects.
    Rank {
        /// Which argument (`"q"`, `"k"`, ...).
        name: &'static str,
        /// The rank that is required.
        expected: usize,
        /// The shape that was given.
        got: Vec<usize>,
    },
    /// Two tensors disagree on a dimension that must match.
    ShapeMismatch {
        /// What was compared, in words.
        what: String,
        /// The shape that was required.
        expected: Vec<usize>,
        /// The shape that was given.
        got: Vec<usize>,
    },
    /// The number of query heads is not a multiple of the number of key/value heads.
    HeadGrouping {
        /// Query heads.
        q_heads: usize,
        /// Key/value heads.
        kv_heads: usize,
    },
    /// The head dimension is not one the kernels are compiled for.
    UnsupportedHeadDim {
        /// The head dimension that was given.
        got: usize,
    },
    /// Tensors that must share an element type do not, or the type is not supported.
    DType {
        /// What was wrong, in words.
        what: String,
    },
    /// A dimension is zero or too large for 32-bit indexing.
    BadLength {
        /// What was wrong, in words.
        what: String,
    },
}

/// Head dimensions the kernels accept.
pub const SUPPORTED_HEAD_DIMS: [usize; 6] = [16, 32, 64, 96, 128, 256];

impl fmt::Display for KernelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KernelError::Rank {
                name,
                expected,
                got,
            } => write!(
                f,
                "`{name}` must have {expected} dimensions, got shape {got:?}"
            ),
            KernelError::ShapeMismatch {
                what,
                expected,
                got,
            } => write!(f, "shape mismatch for {what}: expected {expected:?}, got {got:?}"),
            KernelError::HeadGrouping { q_heads, kv_heads } => write!(
                f,
                "query heads ({q_heads}) must be a non-zero multiple of key/value heads ({kv_heads})"
            ),
            KernelError::UnsupportedHeadDim { got } => write!(
                f,
                "head dimension {got} is not supported; supported head dimensions are {SUPPORTED_HEAD_DIMS:?}"
            ),
            KernelError::DType { what } => write!(f, "dtype error: {what}"),
            KernelError::BadLength { what } => write!(f, "bad length: {what}"),
        }
    }
}

impl std::error::Error for KernelError {}
