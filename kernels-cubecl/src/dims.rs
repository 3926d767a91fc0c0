//! The dimensions of one attention call, checked once on the host.

use crate::kernel_error::{KernelError, SUPPORTED_HEAD_DIMS};

/// Sizes of an attention call: q is `[batch, q_heads, q_len, head_dim]`, k and v are
/// `[batch, kv_heads, kv_len, head_dim]`, the running state is `[batch, q_heads, q_len]` (+ `head_dim`
/// for the unnormalised output).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionDims {
    /// Batch size.
    pub batch: usize,
    /// Number of query heads.
    pub q_heads: usize,
    /// Number of key/value heads (query heads are grouped over them, GQA/MQA).
    pub kv_heads: usize,
    /// Query rows in this call.
    pub q_len: usize,
    /// Key rows in this call.
    pub kv_len: usize,
    /// Head dimension, shared by q, k and v.
    pub head_dim: usize,
}

fn rank4(name: &'static str, shape: &[usize]) -> Result<[usize; 4], KernelError> {
    shape.try_into().map_err(|_| KernelError::Rank {
        name,
        expected: 4,
        got: shape.to_vec(),
    })
}

impl AttentionDims {
    /// Validates q, k, v shapes and derives the dimensions.
    pub fn from_qkv(q: &[usize], k: &[usize], v: &[usize]) -> Result<Self, KernelError> {
        let [batch, q_heads, q_len, head_dim] = rank4("q", q)?;
        let [kb, kv_heads, kv_len, kd] = rank4("k", k)?;
        rank4("v", v)?;
        if kb != batch || kd != head_dim {
            return Err(KernelError::ShapeMismatch {
                what: "k against q (batch and head_dim must match)".into(),
                expected: vec![batch, kv_heads, kv_len, head_dim],
                got: k.to_vec(),
            });
        }
        if v != k {
            return Err(KernelError::ShapeMismatch {
                what: "v against k".into(),
                expected: k.to_vec(),
                got: v.to_vec(),
            });
        }
        if kv_heads == 0 || q_heads == 0 || q_heads % kv_heads != 0 {
            return Err(KernelError::HeadGrouping { q_heads, kv_heads });
        }
        if !SUPPORTED_HEAD_DIMS.contains(&head_dim) {
            return Err(KernelError::UnsupportedHeadDim { got: head_dim });
        }
        let dims = Self {
            batch,
            q_heads,
            kv_heads,
            q_len,
            kv_len,
            head_dim,
        };
        dims.check_indexable()?;
        Ok(dims)
    }

    fn check_indexable(&self) -> Result<(), KernelError> {
        if self.batch == 0 || self.q_len == 0 || self.kv_len == 0 {
            return Err(KernelError::BadLength {
                what: format!("batch, q_len and kv_len must be non-zero, got {self:?}"),
            });
        }
        let largest = (self.batch * self.q_heads * self.q_len.max(self.kv_len)) * self.head_dim;
        if largest > i32::MAX as usize {
            return Err(KernelError::BadLength {
                what: format!("{largest} elements in one tensor exceed 32-bit indexing"),
            });
        }
        Ok(())
    }

    /// Query heads sharing one key/value head.
    pub fn group_size(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// Shape of the query (and output) tensor.
    pub fn q_shape(&self) -> Vec<usize> {
        vec![self.batch, self.q_heads, self.q_len, self.head_dim]
    }

    /// Shape of the key and value tensors.
    pub fn kv_shape(&self) -> Vec<usize> {
        vec![self.batch, self.kv_heads, self.kv_len, self.head_dim]
    }

    /// Shape of per-row statistics (running max, running sum, lse, delta).
    pub fn row_shape(&self) -> Vec<usize> {
        vec![self.batch, self.q_heads, self.q_len]
    }

    /// Checks that `got` equals `expected`, naming the argument when it does not.
    pub fn expect_shape(name: &str, expected: &[usize], got: &[usize]) -> Result<(), KernelError> {
        if expected == got {
            Ok(())
        } else {
            Err(KernelError::ShapeMismatch {
                what: name.to_string(),
                expected: expected.to_vec(),
                got: got.to_vec(),
            })
        }
    }
}
