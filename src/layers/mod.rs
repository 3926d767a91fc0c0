//! Burn modules built on this project's attention: [`DistFlashAttention`] (drop-in multi-head
//! attention, local or sequence-parallel) and [`TransformerBlock`] (a Llama decoder layer with a
//! choice of gradient-checkpoint placement, [`CheckpointPlacement`], and of host offload,
//! [`Offload`]), the pieces they are made of, [`BlockChain`] for running a model's blocks with
//! one checkpoint per one or two layers (two consecutive layer-checkpointed blocks as one
//! [`BlockPair`]: half the checkpoints, the same gradients), [`CheckpointSegment`] for running a
//! model part of your own as one gradient checkpoint, [`replicate`] for giving every rank its own
//! trainable copy of a model, and [`RowChunks`] for running sequence-wise parts (the feed-forward
//! block) a chunk of rows at a time. Both modules take one [`AttentionInput`] (the hidden states
//! and the documents packed into them) in one `forward` and one `try_forward`.

mod attention;
mod attention_backward;
mod block;
mod block_chain;
mod block_offload;
mod block_pair;
mod counter;
mod feed_forward;
mod grouped_attention;
mod head_groups;
mod input;
mod linear_grad;
mod linear_layer;
mod replicate;
mod rms_norm;
mod rope;
mod row_chunks;

pub use crate::extension::{CheckpointPlacement, CheckpointSegment};
pub use crate::matmul::Transposed;
pub use crate::offload::Offload;
pub use attention::{DistFlashAttention, DistFlashAttentionConfig};
pub use block::{TransformerBlock, TransformerBlockConfig};
pub use block_chain::BlockChain;
pub use block_pair::BlockPair;
pub use counter::ForwardCounter;
pub use feed_forward::{feed_forward_bytes_per_row, FeedForward, FeedForwardConfig};
pub use input::AttentionInput;
pub use linear_layer::{linear, matrix_product, project};
pub use replicate::replicate;
pub use rms_norm::{RmsNorm, RmsNormConfig};
pub use rope::{Llama3RopeScaling, RopeConfig, RotaryTables};
pub use row_chunks::RowChunks;
