//! A checkpointed block's attention over groups of heads ([`super::head_groups`]): each group
//! projected and attended in turn, and the groups' outputs merged for the output projection.

use burn::tensor::Tensor;

use super::attention::{merge_heads, DistFlashAttention};
use super::attention_backward::AttentionActivations;
use super::head_groups::{ColumnJoin, HeadGroup};
use super::rope::RotaryTables;
use crate::extension::{AttentionContext, FlashAttentionBackend};
use crate::options::Documents;
use crate::Error;

impl<B: FlashAttentionBackend> DistFlashAttention<B> {
    /// Attention of the normed input `input` `[batch, seq, d_model]` over `groups` (in head
    /// order, covering every head), within `documents` when given: each group's heads projected
    /// and attended in turn, each group's output kept as the kernel made it
    /// (`[batch, heads of the group, seq, head_dim]`) and their lse joined
    /// (`[batch, n_heads, seq]`). Counts one forward computation. With one group its
    /// projections are kept for the backward; with several, the backward projects each group
    /// again.
    ///
    /// # Errors
    ///
    /// Those of [`attend`](Self::attend), for any group.
    pub(crate) fn attend_in_groups(
        &self,
        input: Tensor<B, 3>,
        rope: RotaryTables<B>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
        groups: &[HeadGroup],
    ) -> Result<AttentionActivations<B>, Error> {
        self.counter.record();
        let (mut outs, mut lses, mut projected) = (Vec::new(), Vec::new(), None);
        for group in groups {
            let p = self.project_heads(input.clone(), &rope, group);
            let (out, lse) = self.attend_heads(&p, context, documents)?;
            outs.push(out);
            lses.push(lse);
            projected = (groups.len() == 1).then_some(p);
        }
        Ok(AttentionActivations {
            input,
            rope,
            projected,
            outs,
            lse: match lses.len() {
                1 => lses.pop().expect("one group"),
                _ => Tensor::cat(lses, 1),
            },
        })
    }

    /// The groups' outputs `outs` (in head order, covering every head) with their heads merged:
    /// `[batch, seq, n_heads * head_dim]`, what the output projection takes; each group written
    /// into its columns in place.
    pub(crate) fn merged_output(&self, outs: &[Tensor<B, 4>]) -> Tensor<B, 3> {
        let [batch, _, seq, _] = outs[0].dims();
        let mut merged = ColumnJoin::new([batch, seq, self.n_heads * self.head_dim]);
        let mut first_head = 0;
        for out in outs {
            let heads = out.dims()[1];
            let columns = HeadGroup::columns(&(first_head..first_head + heads), self.head_dim);
            merged.put(merge_heads(out.clone()), columns);
            first_head += heads;
        }
        merged.finish()
    }
}
