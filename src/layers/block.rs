//! [`TransformerBlock`]: a Llama decoder layer (pre-norm attention and SwiGLU feed-forward, both
//! residual), with a per-model choice of where gradient checkpointing puts its boundary and of
//! how many rows the feed-forward half takes at a time.

use crate::Error;
use burn::config::Config;
use burn::module::{AutodiffModule, Module, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use super::attention::{DistFlashAttention, DistFlashAttentionConfig};
use super::attention_backward::{AttentionActivations, AttentionGrads};
use super::feed_forward::{FeedForward, FeedForwardConfig, FeedForwardGrads};
use super::head_groups::{check_head_groups, head_groups, HeadGroup};
use super::input::AttentionInput;
use super::linear_layer::linear;
use super::rms_norm::{RmsNorm, RmsNormConfig};
use super::row_chunks::RowChunks;
use crate::extension::{
    AttentionContext, CheckpointPlacement, CheckpointSegment, FlashAttentionBackend,
};
use crate::options::Documents;

/// Configuration of [`TransformerBlock`].
#[derive(Config, Debug)]
pub struct TransformerBlockConfig {
    /// The attention (width, heads, rotary embedding).
    pub attention: DistFlashAttentionConfig,
    /// Hidden width of the feed-forward block (11008 for Llama-7B).
    pub d_ff: usize,
    /// Epsilon of both RMS norms.
    #[config(default = 1e-5)]
    pub norm_eps: f64,
    /// Where gradient checkpointing cuts the graph.
    #[config(default = "CheckpointPlacement::None")]
    pub checkpoint: CheckpointPlacement,
    /// Keep the checkpoint in host memory between the forward and the backward
    /// ([`crate::offload`]; a model sets it per layer from its [`Offload`](crate::layers::Offload)
    /// policy). Needs a checkpoint placement other than `None`.
    #[config(default = false)]
    pub offload: bool,
    /// How many rows (`batch * seq` tokens) the feed-forward half takes at a time in the
    /// forward, a checkpoint's recomputation and the backward, so that its `[rows, d_ff]`
    /// activations exist one chunk at a time ([`feed_forward_bytes_per_row`] is what a budget
    /// is divided by). The gradients are those of the whole sequence at once. Without a
    /// checkpoint, in an autodiff graph (which keeps every activation anyway), the feed-forward
    /// runs whole.
    ///
    /// [`feed_forward_bytes_per_row`]: super::feed_forward_bytes_per_row
    #[config(default = "TransformerBlockConfig::DEFAULT_FFN_CHUNKS")]
    pub ffn_chunks: RowChunks,
    /// How many groups of heads attention runs over, one after another, in the forward, a
    /// checkpoint's recomputation and the backward: the per-head tensors of attention's
    /// backward (projections, f32 gradient accumulators, a sequence-parallel group's received
    /// shards) then exist for one group at a time. A divisor of the key/value heads; each
    /// group's output and `dq, dk, dv` are written into their columns of whole tensors, whose
    /// products then run once, so the outputs and gradients are those of all heads at once.
    /// Default 1.
    #[config(default = 1)]
    pub attention_head_groups: usize,
}

impl TransformerBlockConfig {
    /// The default [`ffn_chunks`](Self::ffn_chunks): chunks whose feed-forward activations take
    /// at most 1 GiB, about 8K tokens of LLaMA-7B in bf16 (products of that many rows keep a
    /// GPU's matrix units busy), one chunk for any sequence a CPU trains.
    pub const DEFAULT_FFN_CHUNKS: RowChunks = match std::num::NonZeroU64::new(1 << 30) {
        Some(bytes) => RowChunks::Budget(bytes),
        None => unreachable!(),
    };

    /// The block, or what is wrong with the configuration.
    ///
    /// # Errors
    ///
    /// As [`check`](Self::check).
    pub fn try_init<B: FlashAttentionBackend>(
        &self,
        device: &B::Device,
    ) -> Result<TransformerBlock<B>, Error> {
        self.check()?;
        let d_model = self.attention.d_model;
        let norm = RmsNormConfig::new(d_model).with_eps(self.norm_eps);
        Ok(TransformerBlock {
            attention_norm: norm.init(device),
            attention: self.attention.try_init(device)?,
            ffn_norm: norm.init(device),
            ffn: FeedForwardConfig::new(d_model, self.d_ff)
                .with_initializer(self.attention.initializer.clone())
                .init(device),
            checkpoint: self.checkpoint,
            offload: self.offload,
            ffn_chunks: self.ffn_chunks,
            attention_head_groups: self.attention_head_groups,
        })
    }

    /// What is wrong with the configuration, before anything is allocated.
    ///
    /// # Errors
    ///
    /// [`Error`] when `d_ff` is zero, when offload is on without a checkpoint, when
    /// `attention_head_groups` does not divide the key/value heads, or where
    /// [`DistFlashAttentionConfig::resolved`] errs for `attention`.
    pub fn check(&self) -> Result<(), Error> {
        if self.d_ff == 0 {
            return Err(Error::config("d_ff", "positive", 0));
        }
        check_offload(self.offload, self.checkpoint)?;
        let (n_kv_heads, _) = self.attention.resolved()?;
        check_head_groups(self.attention_head_groups, n_kv_heads)
    }

    /// The block.
    ///
    /// # Panics
    ///
    /// With the configuration error where [`try_init`](Self::try_init) returns one.
    pub fn init<B: FlashAttentionBackend>(&self, device: &B::Device) -> TransformerBlock<B> {
        self.try_init(device).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// Refuses offload without a checkpoint: the autodiff graph then holds every activation itself,
/// and there is nothing for the block to move.
fn check_offload(offload: bool, placement: CheckpointPlacement) -> Result<(), Error> {
    match (offload, placement) {
        (true, CheckpointPlacement::None) => Err(Error::config(
            "offload",
            "a checkpoint placement of Layer or AttentionOutput with offload on (without \
             checkpoints the autodiff graph keeps every activation on the device)",
            "offload on with CheckpointPlacement::None",
        )),
        _ => Ok(()),
    }
}

/// `h = x + attention(norm(x))`, `y = h + ffn(norm(h))`.
#[derive(Module, Debug)]
pub struct TransformerBlock<B: Backend> {
    /// Norm before attention.
    pub attention_norm: RmsNorm<B>,
    /// Self-attention.
    pub attention: DistFlashAttention<B>,
    /// Norm before the feed-forward block.
    pub ffn_norm: RmsNorm<B>,
    /// SwiGLU feed-forward block.
    pub ffn: FeedForward<B>,
    /// Where gradient checkpointing cuts the graph.
    #[module(skip)]
    pub checkpoint: CheckpointPlacement,
    /// Whether the checkpoint waits in host memory between the forward and the backward (no
    /// effect with [`CheckpointPlacement::None`]).
    #[module(skip)]
    pub offload: bool,
    /// How many rows the feed-forward half takes at a time
    /// ([`TransformerBlockConfig::ffn_chunks`]).
    #[module(skip)]
    pub ffn_chunks: RowChunks,
    /// How many groups of heads attention runs over, one after another
    /// ([`TransformerBlockConfig::attention_head_groups`]).
    #[module(skip)]
    pub attention_head_groups: usize,
}

/// The attention half of a block's forward: what its backward starts from.
pub(crate) struct AttentionHalf<B: FlashAttentionBackend> {
    /// Input and projections of attention, its output and lse.
    pub attention: AttentionActivations<B>,
    /// The block input.
    pub x: Tensor<B, 3>,
    /// The residual stream after attention.
    pub h: Tensor<B, 3>,
}

/// Gradients of a block's input and of its weights.
pub(crate) struct BlockGrads<B: FlashAttentionBackend> {
    pub input: Tensor<B, 3>,
    pub attention_norm: Tensor<B, 1>,
    pub attention: AttentionGrads<B>,
    pub ffn_norm: Tensor<B, 1>,
    pub ffn: FeedForwardGrads<B>,
}

impl<B: FlashAttentionBackend> TransformerBlock<B> {
    /// The block applied to `input` (the whole sequence or this rank's shard, and the documents
    /// packed into it if any: tokens then attend only within their own document; a plain
    /// tensor converts into an input without documents), checkpointed as
    /// [`checkpoint`](Self::checkpoint) says. A checkpointed block recomputes its attention with
    /// the same documents.
    ///
    /// # Shapes
    ///
    /// - input.x: `[batch, seq, d_model]`
    /// - input.documents: boundaries of the whole sequence (`seq` positions locally;
    ///   `world_size * seq` when sharded), one list for every batch row or one per batch row
    /// - output: `[batch, seq, d_model]`
    ///
    /// # Panics
    ///
    /// With a clear message where [`try_forward`](Self::try_forward) errs.
    pub fn forward(
        &self,
        input: impl Into<AttentionInput<B>>,
        context: &AttentionContext<B>,
    ) -> Tensor<B, 3> {
        self.try_forward(input, context)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`forward`](Self::forward), or why it cannot run. The input is checked before any work.
    ///
    /// # Shapes
    ///
    /// As [`forward`](Self::forward).
    ///
    /// # Errors
    ///
    /// As [`DistFlashAttention::try_forward`] of the block's attention: the input is checked the
    /// same way, and the attention's errors are returned.
    pub fn try_forward(
        &self,
        input: impl Into<AttentionInput<B>>,
        context: &AttentionContext<B>,
    ) -> Result<Tensor<B, 3>, Error> {
        let AttentionInput { x, documents } = input.into();
        let documents = documents.as_ref();
        self.attention.check_input(&x, context, documents)?;
        match self.checkpoint {
            CheckpointPlacement::None => self.forward_stored(x, context, documents),
            placement => B::checkpointed(self, x, context, documents, placement),
        }
    }
}

impl<B: FlashAttentionBackend> TransformerBlock<B> {
    /// The forward through ordinary tensor ops: under autodiff, the graph keeps every activation.
    /// Unlike [`try_forward`](Self::try_forward), `x` is not checked first: callers check it.
    ///
    /// # Shapes
    ///
    /// - x: `[batch, seq, d_model]`
    /// - output: `[batch, seq, d_model]`
    ///
    /// # Errors
    ///
    /// The errors of the block's attention on the projected heads:
    /// [`Error::Kernel`] or [`Error::DType`] locally; sharded, those of
    /// [`crate::sequence_parallel::sequence_parallel_attention`].
    ///
    /// # Panics
    ///
    /// On most inputs that [`try_forward`](Self::try_forward) refuses, in Burn's shape checks:
    /// for example a last dimension other than `d_model`, or (sharded) a `seq` the layout cannot
    /// split.
    pub(crate) fn forward_stored(
        &self,
        x: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> Result<Tensor<B, 3>, Error> {
        let half = self.attention_half(x, context, documents, None)?;
        Ok(self.feed_forward_half(half.h))
    }

    /// `h + ffn(norm(h))`, the feed-forward over row chunks as [`Self::ffn_chunks`] says, except
    /// in an autodiff graph: there (no checkpoint) the graph keeps every chunk's activations
    /// anyway, and chunks would only add slices and a concatenation to its backward.
    fn feed_forward_half(&self, h: Tensor<B, 3>) -> Tensor<B, 3> {
        let ffn_input = self.ffn_norm.forward(h.clone());
        let out = match B::ad_enabled(&h.device()) {
            true => self.ffn.forward(ffn_input),
            false => self.ffn.forward_chunked(ffn_input, &self.ffn_chunks),
        };
        h + out
    }

    /// Runs the attention half (within `documents` when given) over the block's groups of
    /// heads; with `saved` `(O, lse)` (O as one tensor per group of heads) attention itself is
    /// not recomputed.
    pub(crate) fn attention_half(
        &self,
        x: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
        saved: Option<(Vec<Tensor<B, 4>>, Tensor<B, 3>)>,
    ) -> Result<AttentionHalf<B>, Error> {
        let input = self.attention_norm.forward(x.clone());
        let rope = self.attention.rotary(&input, context, documents);
        let attention = match saved {
            Some((outs, lse)) => AttentionActivations {
                input,
                rope,
                projected: None,
                outs,
                lse,
            },
            None => (self.attention).attend_in_groups(
                input,
                rope,
                context,
                documents,
                &self.head_groups(),
            )?,
        };
        let merged = self.attention.merged_output(&attention.outs);
        let h = x.clone() + linear(&self.attention.output, merged);
        Ok(AttentionHalf { attention, x, h })
    }

    /// The groups of heads attention runs over ([`Self::attention_head_groups`]).
    fn head_groups(&self) -> Vec<HeadGroup> {
        let a = &self.attention;
        head_groups(a.n_heads, a.n_kv_heads, self.attention_head_groups)
    }

    /// Gradients of the input and weights for the output gradient `grad`, from the attention
    /// half of the forward (the feed-forward half is recomputed from `h`), whose `documents`
    /// the attention backward masks with again.
    pub(crate) fn backward(
        &self,
        half: AttentionHalf<B>,
        grad: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> BlockGrads<B> {
        let ffn_input = self.ffn_norm.forward(half.h.clone());
        let (dffn_input, ffn) =
            (self.ffn).backward_chunked(ffn_input, grad.clone(), &self.ffn_chunks);
        let (dh_norm, ffn_norm) = self.ffn_norm.backward(half.h, dffn_input);
        let dh = grad + dh_norm;
        let (dattention_input, attention) = (self.attention).backward(
            half.attention,
            dh.clone(),
            context,
            documents,
            &self.head_groups(),
        );
        let (dx_norm, attention_norm) = self.attention_norm.backward(half.x, dattention_input);
        BlockGrads {
            input: dh + dx_norm,
            attention_norm,
            attention,
            ffn_norm,
            ffn,
        }
    }
}

/// The block input and its nine weights: the parents of a checkpointed block's node.
pub(crate) const BLOCK_PARENTS: usize = 10;

impl<B: FlashAttentionBackend> BlockGrads<B> {
    /// The input's gradient, and the weights' gradients by parameter id: the list a
    /// checkpointed block's node hands out. A weight added to the block gets its line here (and
    /// [`BLOCK_PARENTS`] grows by one).
    #[allow(clippy::type_complexity)]
    fn by_parameter(
        self,
        block: &TransformerBlock<B>,
    ) -> (Tensor<B, 3>, Vec<(ParamId, FloatTensor<B>)>) {
        let (a, f) = (&block.attention, &block.ffn);
        let weights = vec![
            (
                block.attention_norm.weight.id,
                primitive(self.attention_norm),
            ),
            (a.query.weight.id, primitive(self.attention.query)),
            (a.key.weight.id, primitive(self.attention.key)),
            (a.value.weight.id, primitive(self.attention.value)),
            (a.output.weight.id, primitive(self.attention.output)),
            (block.ffn_norm.weight.id, primitive(self.ffn_norm)),
            (f.gate.weight.id, primitive(self.ffn.gate)),
            (f.up.weight.id, primitive(self.ffn.up)),
            (f.down.weight.id, primitive(self.ffn.down)),
        ];
        (self.input, weights)
    }
}

fn primitive<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

fn tensor<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

impl<B: FlashAttentionBackend> CheckpointSegment<B, BLOCK_PARENTS> for TransformerBlock<B> {
    type On<O: FlashAttentionBackend<Inner = B::Inner>> = TransformerBlock<O>;

    fn forward_stored(
        &self,
        x: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> Result<Tensor<B, 3>, Error> {
        TransformerBlock::forward_stored(self, x, context, documents)
    }

    fn forward_keeping(
        &self,
        x: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
        placement: CheckpointPlacement,
    ) -> Result<(Tensor<B, 3>, Vec<FloatTensor<B>>), Error> {
        let half = self.attention_half(x, context, documents, None)?;
        let out = self.feed_forward_half(half.h);
        let kept = match placement {
            // Each group's output, then the lse.
            CheckpointPlacement::AttentionOutput => (half.attention.outs.into_iter())
                .map(primitive)
                .chain([primitive(half.attention.lse)])
                .collect(),
            CheckpointPlacement::None | CheckpointPlacement::Layer => Vec::new(),
        };
        Ok((out, kept))
    }

    fn backward(
        &self,
        x: Tensor<B, 3>,
        kept: Vec<FloatTensor<B>>,
        grad: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> Result<(Tensor<B, 3>, Vec<(ParamId, FloatTensor<B>)>), Error> {
        // Each group's output, then the lse (nothing at the layer placement).
        let mut kept = kept;
        let attention = kept
            .pop()
            .map(|lse| (kept.into_iter().map(tensor).collect(), tensor(lse)));
        let half = self.attention_half(x, context, documents, attention)?;
        Ok(TransformerBlock::backward(self, half, grad, context, documents).by_parameter(self))
    }

    fn offloads(&self) -> bool {
        self.offload
    }

    fn valid_segment(&self) -> TransformerBlock<B::InnerBackend>
    where
        B: AutodiffBackend,
        B::InnerBackend: FlashAttentionBackend<Inner = B::Inner>,
    {
        self.valid()
    }
}
