//! [`AttentionInput`]: what one forward call of a layer takes, the hidden states and, for packed
//! sequences, their documents (as burn-nn's `MhaInput` bundles a call's tensors and masks).

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::options::Documents;

/// The input of [`DistFlashAttention`](super::DistFlashAttention)'s and
/// [`TransformerBlock`](super::TransformerBlock)'s `forward` / `try_forward`: `x`, the whole
/// sequence or this rank's shard, and optionally the documents packed into it.
///
/// Documents are per-call data, like `x` (each batch brings its own boundaries), so they travel
/// with the input rather than in the configuration or the
/// [`AttentionContext`](crate::AttentionContext) (which says where attention runs, the same for
/// every batch). A plain tensor converts into an input without documents, so
/// `layer.forward(x, &context)` needs no wrapping.
///
/// # Shapes
///
/// - x: `[batch, seq, d_model]`
/// - documents: boundaries of the whole sequence (`seq` positions locally; `world_size * seq`
///   when sharded), one list for every batch row or one per batch row
#[derive(Debug, Clone)]
pub struct AttentionInput<B: Backend> {
    /// The hidden states.
    pub x: Tensor<B, 3>,
    /// The documents packed into each row: a token attends only within its own (on top of the
    /// layer's causal mask and window). `None`: one sequence per row.
    pub documents: Option<Documents>,
}

impl<B: Backend> AttentionInput<B> {
    /// `x`, one sequence per row.
    pub fn new(x: Tensor<B, 3>) -> Self {
        Self { x, documents: None }
    }

    /// The same input with the documents packed into its rows.
    pub fn documents(self, documents: Documents) -> Self {
        Self {
            documents: Some(documents),
            ..self
        }
    }
}

impl<B: Backend> From<Tensor<B, 3>> for AttentionInput<B> {
    fn from(x: Tensor<B, 3>) -> Self {
        Self::new(x)
    }
}
