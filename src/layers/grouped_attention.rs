//! A checkpointed block's attention over groups of heads ([`super::head_groups`]): each group
//! projected and attended in turn, its output written into its columns of the whole output.

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
    /// and attended in turn, their outputs merged `[batch, seq, n_heads * head_dim]` and their
    /// lse `[batch, n_heads, seq]` joined. Counts one forward computation. With one group its
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
        let [batch, seq, _] = input.dims();
        let mut out = ColumnJoin::new([batch, seq, self.n_heads * self.head_dim]);
        let (mut lses, mut projected) = (Vec::new(), None);
        for group in groups {
            let p = self.project_heads(input.clone(), &rope, group);
            let (group_out, lse) = self.attend_heads(&p, context, documents)?;
            out.put(
                merge_heads(group_out),
                HeadGroup::columns(&group.query, self.head_dim),
            );
            lses.push(lse);
            projected = (groups.len() == 1).then_some(p);
        }
        Ok(AttentionActivations {
            input,
            rope,
            projected,
            out: out.finish(),
            lse: match lses.len() {
                1 => lses.pop().expect("one group"),
                _ => Tensor::cat(lses, 1),
            },
        })
    }
}
