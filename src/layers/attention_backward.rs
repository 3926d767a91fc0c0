//! The backward of [`DistFlashAttention`] from its input, the rotary tables and the saved
//! attention output and lse, over groups of heads ([`super::head_groups`]): what a checkpointed
//! layer runs instead of Burn's autodiff graph.

use burn::tensor::{Tensor, TensorPrimitive};

use super::attention::{merge_heads, split_heads, DistFlashAttention, Projected};
use super::head_groups::{ColumnJoin, HeadGroup};
use super::linear_grad::linear_backward;
use super::rope::RotaryTables;
use crate::extension::AttentionContext;
use crate::extension::FlashAttentionBackend;
use crate::options::Documents;

/// Gradients of the four projection weights of a [`DistFlashAttention`].
pub(crate) struct AttentionGrads<B: FlashAttentionBackend> {
    pub query: Tensor<B, 2>,
    pub key: Tensor<B, 2>,
    pub value: Tensor<B, 2>,
    pub output: Tensor<B, 2>,
}

/// What the backward needs from the forward: the normed input, the rotary tables, the
/// projections when one group of heads computed them (several groups project again, one group
/// at a time), and `(O, lse)`.
pub(crate) struct AttentionActivations<B: FlashAttentionBackend> {
    /// The attention input (the normed residual stream) `[batch, seq, d_model]`.
    pub input: Tensor<B, 3>,
    /// The rotary tables of the input's positions.
    pub rope: RotaryTables<B>,
    /// Every head's projections, kept by a forward over one group of heads.
    pub projected: Option<Projected<B>>,
    /// Attention's output, one tensor per group of heads as the kernel made it:
    /// `[batch, heads of the group, seq, head_dim]`.
    pub outs: Vec<Tensor<B, 4>>,
    /// Attention's lse `[batch, n_heads, seq]`.
    pub lse: Tensor<B, 3>,
}

impl<B: FlashAttentionBackend> DistFlashAttention<B> {
    /// `(dx, weight gradients)` for the gradient `grad` of the module's output. Runs the
    /// attention backward (distributed in a sharded context) from the saved O and lse, with the
    /// forward's mask (the same `documents`), one group of heads at a time (`groups`, in head
    /// order, covering every head): each group's `dq, dk, dv` written into their columns of the
    /// whole gradients, whose products then run once, as for all heads at once.
    pub(crate) fn backward(
        &self,
        mut acts: AttentionActivations<B>,
        grad: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
        groups: &[HeadGroup],
    ) -> (Tensor<B, 3>, AttentionGrads<B>) {
        let from_output = linear_backward(&self.output, self.merged_output(&acts.outs), grad);
        let [batch, seq, _] = from_output.input.dims();
        // The whole output gradient, handed by value to the last group's backward (and each
        // group its own output), so that the attention backward, which copies what it is given
        // into the layout it runs on, can drop them: a reference kept here would hold them
        // beside those copies for the whole pass.
        let mut whole_grad_out = Some(from_output.input);
        let widths = [self.n_heads, self.n_kv_heads, self.n_kv_heads].map(|h| h * self.head_dim);
        let mut grads = widths.map(|width| ColumnJoin::new([batch, seq, width]));
        let mut projected = acts.projected.take();
        let last = groups.len().saturating_sub(1);
        for (index, (group, out)) in groups.iter().zip(acts.outs.drain(..)).enumerate() {
            let p = (projected.take())
                .unwrap_or_else(|| self.project_heads(acts.input.clone(), &acts.rope, group));
            // The group's rows of the lse and columns of the output's gradient.
            let heads = group.query.clone();
            let lse = acts.lse.clone().slice([0..batch, heads.clone(), 0..seq]);
            let columns = HeadGroup::columns(&heads, self.head_dim);
            let grad_out = if index == last {
                whole_grad_out.take()
            } else {
                whole_grad_out.clone()
            }
            .expect("the output gradient is taken by the last group only");
            let grad_out = split_heads(grad_out.slice([0..batch, 0..seq, columns]), heads.len());
            let parts = self.heads_backward(p, out, lse, grad_out, context, documents);
            let heads = [&group.query, &group.key_value, &group.key_value];
            for ((join, part), heads) in grads.iter_mut().zip(parts).zip(heads) {
                join.put(part, HeadGroup::columns(heads, self.head_dim));
            }
        }
        let [dq, dk, dv] = grads.map(ColumnJoin::finish);
        let from_query = linear_backward(&self.query, acts.input.clone(), dq);
        let from_key = linear_backward(&self.key, acts.input.clone(), dk);
        let from_value = linear_backward(&self.value, acts.input, dv);
        (
            from_query.input + from_key.input + from_value.input,
            AttentionGrads {
                query: from_query.weight,
                key: from_key.weight,
                value: from_value.weight,
                output: from_output.weight,
            },
        )
    }

    /// `[dq, dk, dv]` of a group of heads, rotary embedding undone and heads merged
    /// (`[batch, seq, heads * head_dim]` each), from their projections `p`, their saved output
    /// `out` and lse `lse`, and their output's gradient `grad_out`.
    fn heads_backward(
        &self,
        p: Projected<B>,
        out: Tensor<B, 4>,
        lse: Tensor<B, 3>,
        grad_out: Tensor<B, 4>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> [Tensor<B, 3>; 3] {
        let prim = |t: Tensor<B, 4>| t.into_primitive().tensor();
        let (q, k, v) = (prim(p.q), prim(p.k), prim(p.v));
        let (out, grad_out) = (prim(out), prim(grad_out));
        let lse = lse.into_primitive().tensor();
        let options = self.options_with(documents);
        let (dq, dk, dv) = match context.sequence_parallel_options(options.clone()) {
            None => B::flash_attention_backward(q, k, v, out, lse, grad_out, options),
            Some((group, options)) => {
                B::sequence_parallel_backward(q, k, v, out, lse, grad_out, group, &options)
                    // A backward pass cannot return an error: a failed peer ends the step here.
                    .unwrap_or_else(|e| panic!("sequence-parallel attention backward: {e}"))
            }
        };
        let wrap = |t| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
        [
            merge_heads(p.rope.apply_transpose(wrap(dq))),
            merge_heads(p.rope.apply_transpose(wrap(dk))),
            merge_heads(wrap(dv)),
        ]
    }
}
