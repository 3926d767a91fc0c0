//! `Autodiff<B>`: attention as one compute-bound node whose backward runs the backend's fused
//! backward from the stored q, k, v, O and lse (no recomputation of the forward).

use burn::tensor::ops::FloatTensor;
use burn::tensor::DType;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::Autodiff;

use distflash_kernels::AttentionDims;

use crate::backend::FlashAttentionBackend;
use crate::options::AttentionError;

/// The float tensor of `Autodiff<B, C>` (burn-autodiff's `AutodiffTensor`, whose module is private).
type AutodiffTensor<B, C> = FloatTensor<Autodiff<B, C>>;
use crate::options::FlashAttentionOptions;

/// The backward node of one attention call.
#[derive(Debug)]
struct FlashAttentionNode;

impl<B: FlashAttentionBackend> Backward<B, 3> for FlashAttentionNode {
    /// q, k, v, O, lse and the options.
    #[allow(clippy::type_complexity)]
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FlashAttentionOptions,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad_out = grads.consume::<B>(&ops.node);
        let (q, k, v, out, lse, options) = ops.state;
        let (dq, dk, dv) = B::flash_attention_backward(q, k, v, out, lse, grad_out, options);
        for (parent, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: FlashAttentionBackend, C: CheckpointStrategy> FlashAttentionBackend for Autodiff<B, C> {
    fn lse_dtype(input: DType) -> DType {
        B::lse_dtype(input)
    }

    fn check_attention_limits(
        dims: &AttentionDims,
        dtype: DType,
        device: &B::Device,
    ) -> Result<(), AttentionError> {
        B::check_attention_limits(dims, dtype, device)
    }

    fn flash_attention(
        q: AutodiffTensor<B, C>,
        k: AutodiffTensor<B, C>,
        v: AutodiffTensor<B, C>,
        options: FlashAttentionOptions,
    ) -> (AutodiffTensor<B, C>, AutodiffTensor<B, C>) {
        let (out, lse) = B::flash_attention(
            q.primitive.clone(),
            k.primitive.clone(),
            v.primitive.clone(),
            options,
        );
        // lse is returned as a constant (it carries no gradient of its own).
        let lse_out = AutodiffTensor::<B, C>::new(lse.clone());
        let out = match FlashAttentionNode
            .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                (
                    q.primitive,
                    k.primitive,
                    v.primitive,
                    out.clone(),
                    lse,
                    options,
                ),
                out,
            ),
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        (out, lse_out)
    }

    fn flash_attention_backward(
        q: AutodiffTensor<B, C>,
        k: AutodiffTensor<B, C>,
        v: AutodiffTensor<B, C>,
        out: AutodiffTensor<B, C>,
        lse: AutodiffTensor<B, C>,
        grad_out: AutodiffTensor<B, C>,
        options: FlashAttentionOptions,
    ) -> (
        AutodiffTensor<B, C>,
        AutodiffTensor<B, C>,
        AutodiffTensor<B, C>,
    ) {
        // Second-order gradients are not supported: the result is a constant.
        let (dq, dk, dv) = B::flash_attention_backward(
            q.primitive,
            k.primitive,
            v.primitive,
            out.primitive,
            lse.primitive,
            grad_out.primitive,
            options,
        );
        (
            AutodiffTensor::<B, C>::new(dq),
            AutodiffTensor::<B, C>::new(dk),
            AutodiffTensor::<B, C>::new(dv),
        )
    }
}
