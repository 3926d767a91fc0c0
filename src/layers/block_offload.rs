//! What a [`TransformerBlock`] offloads to host memory: the bytes of each tensor its checkpoint
//! keeps, for
//! [`HostOffload::prepare_host_offload`](crate::offload::HostOffload::prepare_host_offload)
//! before a step.

use super::block::TransformerBlock;
use crate::extension::CheckpointPlacement;
use crate::extension::FlashAttentionBackend;

impl<B: FlashAttentionBackend> TransformerBlock<B> {
    /// The bytes of each tensor this block's checkpoint moves to host memory in one training
    /// step on `[batch, seq, d_model]` inputs (`seq` this rank's tokens), in the block's float
    /// type: the block input, and at [`CheckpointPlacement::AttentionOutput`] attention's output
    /// (one `[batch, heads of the group, seq, head_dim]` tensor per group of heads) and lse
    /// `[batch, heads, seq]`. Empty when the block does not offload. The sizes to hand
    /// [`prepare_host_offload`](crate::offload::HostOffload::prepare_host_offload) before a step.
    pub fn offloaded_bytes(&self, batch: usize, seq: usize) -> Vec<usize> {
        if !self.offload || self.checkpoint == CheckpointPlacement::None {
            return Vec::new();
        }
        let dtype = self.attention.query.weight.val().dtype();
        let d_model = self.attention_norm.weight.dims()[0];
        let mut sizes = vec![batch * seq * d_model * dtype.size()];
        if self.checkpoint == CheckpointPlacement::AttentionOutput {
            let group_heads = self.attention.n_heads / self.attention_head_groups.max(1);
            let group_rows = batch * group_heads * seq;
            let out = group_rows * self.attention.head_dim * dtype.size();
            sizes.extend(std::iter::repeat_n(out, self.attention_head_groups.max(1)));
            let rows = batch * self.attention.n_heads * seq;
            sizes.push(rows * B::lse_dtype(dtype).size());
        }
        sizes
    }
}
