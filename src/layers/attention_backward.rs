//! The backward of [`DistFlashAttention`] from its input, the rotated projections and the saved
//! attention output and lse: what a checkpointed layer runs instead of Burn's autodiff graph.

use burn::tensor::{Tensor, TensorPrimitive};

use super::attention::{merge_heads, split_heads, DistFlashAttention, Projected};
use super::linear_grad::linear_backward;
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

/// What the backward needs from the forward: the input, the projections and `(O, lse)`.
pub(crate) struct AttentionActivations<B: FlashAttentionBackend> {
    pub input: Tensor<B, 3>,
    pub projected: Projected<B>,
    pub out: Tensor<B, 4>,
    pub lse: Tensor<B, 3>,
}

impl<B: FlashAttentionBackend> DistFlashAttention<B> {
    /// `(dx, weight gradients)` for the gradient `grad` of the module's output. Runs the
    /// attention backward (distributed in a sharded context) from the saved O and lse, with the
    /// forward's mask (the same `documents`).
    pub(crate) fn backward(
        &self,
        acts: AttentionActivations<B>,
        grad: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> (Tensor<B, 3>, AttentionGrads<B>) {
        let merged = merge_heads(acts.out.clone());
        let from_output = linear_backward(&self.output, merged, grad);
        let grad_out = split_heads(from_output.input, self.n_heads);
        let p = acts.projected;
        let prim = |t: Tensor<B, 4>| t.into_primitive().tensor();
        let (q, k, v) = (prim(p.q), prim(p.k), prim(p.v));
        let (out, lse, grad_out) = (
            prim(acts.out),
            acts.lse.into_primitive().tensor(),
            prim(grad_out),
        );
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
        let dq = merge_heads(p.rope.apply_transpose(wrap(dq)));
        let dk = merge_heads(p.rope.apply_transpose(wrap(dk)));
        let dv = merge_heads(wrap(dv));
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
}
