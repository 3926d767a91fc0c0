//! The sequence-parallel capability of a backend: which backend computes and communicates, and
//! this rank's forward and backward over a [`DeviceGroup`] of it.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::Device;

use super::{FlashAttentionBackend, Grads};
use crate::collective::DeviceGroup;
use crate::options::SequenceParallelOptions;
use crate::Error;

/// Attention over one sequence split across the ranks of a [`DeviceGroup`] of
/// [`SequenceParallelBackend::Inner`], the backend that computes and communicates: `Self` for the
/// CubeCL and ndarray backends, `B` for `Fusion<B>`, and for `Autodiff<B>` that of `B`. The
/// passes themselves (`crate::sequence_parallel`) are written once over the
/// [`AttentionBackend`](super::AttentionBackend) step operations; a backend says here how its
/// tensors reach them.
pub trait SequenceParallelBackend: Backend {
    /// The backend that computes and communicates in sequence-parallel calls.
    type Inner: FlashAttentionBackend;

    /// `device` as the inner backend's device.
    fn inner_device(device: &Self::Device) -> Device<Self::Inner>;

    /// `(O, lse)` of this rank's shards (validated by the caller).
    ///
    /// # Shapes
    ///
    /// - q: `[batch, q_heads, shard_len, head_dim]`
    /// - k, v: `[batch, kv_heads, shard_len, head_dim]`
    /// - O: `[batch, q_heads, shard_len, head_dim]`
    /// - lse: `[batch, q_heads, shard_len]`
    ///
    /// # Errors
    ///
    /// A [`Error`] when moving tensors between the ranks fails (a peer that stays silent,
    /// disagrees or has left, or a group broken by an earlier failure).
    fn sequence_parallel_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        group: &DeviceGroup<Self::Inner>,
        options: &SequenceParallelOptions,
    ) -> Result<(FloatTensor<Self>, FloatTensor<Self>), Error>;

    /// `(dq, dk, dv)` of this rank's shards from the forward's O and lse.
    ///
    /// # Shapes
    ///
    /// - q, out, grad_out: `[batch, q_heads, shard_len, head_dim]`
    /// - k, v: `[batch, kv_heads, shard_len, head_dim]`
    /// - lse: `[batch, q_heads, shard_len]`
    /// - dq: like q; dk, dv: like k
    ///
    /// # Errors
    ///
    /// A [`Error`] when moving tensors between the ranks fails, as for
    /// [`sequence_parallel_attention`](Self::sequence_parallel_attention).
    #[allow(clippy::too_many_arguments)]
    fn sequence_parallel_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_out: FloatTensor<Self>,
        group: &DeviceGroup<Self::Inner>,
        options: &SequenceParallelOptions,
    ) -> Result<Grads<Self>, Error>;
}
