//! Burn modules built on this project's attention: [`DistFlashAttention`] (drop-in multi-head
//! attention, local or sequence-parallel) and [`TransformerBlock`] (a Llama decoder layer with a
//! choice of gradient-checkpoint placement), the pieces they are made of, and [`replicate`] for
//! giving every rank its own trainable copy of a model.

mod attention;
mod attention_backward;
mod block;
mod context;
mod counter;
mod feed_forward;
mod linear_grad;
mod linear_layer;
mod replicate;
mod rms_norm;
mod rope;

pub use attention::{DistFlashAttention, DistFlashAttentionConfig};
pub use block::{TransformerBlock, TransformerBlockConfig};
pub use context::AttentionContext;
pub use counter::ForwardCounter;
pub use feed_forward::{FeedForward, FeedForwardConfig};
pub use linear_layer::linear;
pub use replicate::replicate;
pub use rms_norm::{RmsNorm, RmsNormConfig};
pub use rope::{Llama3RopeScaling, RopeConfig, RotaryTables};
