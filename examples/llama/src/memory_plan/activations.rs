//! What a training step keeps and makes per token, in bytes, from a Llama's shape alone: the
//! activations a block keeps for its backward at each checkpoint placement, what the model keeps
//! beside the blocks, and the transient tensors of a block's backward and of the loss (pure
//! arithmetic over the tokens of a rank, `rows = batch * seq_len / world`, and its positions,
//! `seq_len / world`, which the rotary tables are made for).
//!
//! The counts follow the code: a checkpointed block keeps its input (and, at the attention
//! output, attention's output and f32 log-sum-exp), a pair of blocks checkpointed together its
//! input; without checkpoints Burn's graph keeps what each node's backward reads (the norms'
//! inputs, the linear layers' inputs, the rotary tables, attention's q, k, v, output and lse,
//! SwiGLU's gate and up). Transients are the tensors alive at once at the busiest moment of a
//! block's backward (attention's backward, or the feed-forward's chunk; in a pair's backward,
//! the second block's with what the first block's backward needs beside it) and of the loss's
//! backward (one chunk of logits and its gradient, the weight's f32 gradient sum, the hidden
//! states' gradient).

use burn_distflash::layers::{feed_forward_bytes_per_row, CheckpointPlacement};

use crate::loss::loss_bytes_per_row;

/// Bytes of f32 (log-sum-exp, loss rows, gradient accumulators) and of a token id.
const F32: u64 = 4;

/// A Llama's widths, as the planner needs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Widths {
    /// `d_model`.
    pub model: u64,
    /// Query width `n_heads * head_dim`.
    pub query: u64,
    /// Key (and value) width `n_kv_heads * head_dim`.
    pub key: u64,
    /// `head_dim`.
    pub head: u64,
    /// Query heads.
    pub heads: u64,
    /// `d_ff`.
    pub hidden: u64,
    /// Vocabulary.
    pub vocab: u64,
    /// Bytes of one element of the activations and weights.
    pub elem: u64,
    /// Groups of heads attention runs over one after another in a checkpointed block
    /// (`LlamaConfig::attention_head_groups`): its per-head backward tensors are one group's.
    pub head_groups: u64,
}

impl Widths {
    /// Bytes of the rotary tables (cos and sin, `[positions, head_dim]` each) of one block.
    fn rotary_tables(&self, positions: u64) -> u64 {
        2 * self.head * self.elem * positions
    }

    /// Bytes one block keeps for its backward under `placement`, over `rows` tokens at
    /// `positions` positions.
    pub fn kept_per_layer(&self, placement: CheckpointPlacement, rows: u64, positions: u64) -> u64 {
        let (d, q, kv, e) = (self.model, self.query, self.key, self.elem);
        let (f, h) = (self.hidden, self.heads);
        match placement {
            CheckpointPlacement::Layer => d * e * rows,
            CheckpointPlacement::AttentionOutput => ((d + q) * e + F32 * h) * rows,
            // Both norms' inputs and outputs, attention's q, k, v and output, the merged output
            // (the output projection's input), SwiGLU's gate and up and the down projection's
            // input; attention's lse in f32; the rotary tables.
            CheckpointPlacement::None => {
                ((4 * d + 3 * q + 2 * kv + 3 * f) * e + F32 * h) * rows
                    + self.rotary_tables(positions)
            }
        }
    }

    /// Bytes a pair's backward (two layers per checkpoint) holds beside its second block's
    /// backward over `rows` tokens at `positions` positions: the second block's recomputed
    /// input, and the first block's attention output and f32 lse, kept for its own backward
    /// (what an attention-output checkpoint keeps).
    pub fn pair_backward_kept(&self, rows: u64, positions: u64) -> u64 {
        self.kept_per_layer(CheckpointPlacement::AttentionOutput, rows, positions)
    }

    /// Bytes one token keeps beside the blocks: the final norm's input and output (the
    /// loss's hidden states), the loss's per-row log-sum-exp, the token and target ids.
    pub fn kept_beside_blocks(&self) -> u64 {
        2 * self.model * self.elem + 3 * F32
    }

    /// Bytes of the two busiest moments of one block's backward over `rows` tokens at
    /// `positions` positions, beyond its checkpoint, with `ffn_rows` rows per feed-forward
    /// chunk, each with the rotary tables: attention's backward over the groups of heads (with
    /// `sequence_parallel` bytes per token more on a group, for all heads at once:
    /// [`sequence_parallel_backward`](Self::sequence_parallel_backward)) and the
    /// feed-forward's. The larger is the block's transient.
    pub fn layer_backward_halves(
        &self,
        placement: CheckpointPlacement,
        rows: u64,
        positions: u64,
        ffn_rows: u64,
        sequence_parallel: u64,
    ) -> (u64, u64) {
        let (d, q, kv, e) = (self.model, self.query, self.key, self.elem);
        let (h, groups) = (self.heads, self.head_groups.max(1));
        // The recomputed attention half: the norm's output, rotated q and k, v (one group's at a
        // time in groups), and (unless kept) attention's output and lse. Without checkpoints
        // nothing is recomputed: Burn's graph kept them, and `kept_per_layer` counts them.
        let projections = (q + 2 * kv) * e / groups;
        let half = match placement {
            CheckpointPlacement::None => 0,
            CheckpointPlacement::AttentionOutput => d * e + projections,
            CheckpointPlacement::Layer => d * e + projections + q * e + F32 * h,
        };
        // Attention's backward: the output's and residual's gradients (2d) and the merged
        // output's (q); one group's output and its gradient (q), f32 accumulators of dq, dk, dv
        // and the row deltas, and sequence-parallel buffers (`sequence_parallel`, a whole
        // group's); in groups, the whole dq, dk, dv the groups write their columns of.
        let whole_gradients = match groups > 1 {
            true => (q + 2 * kv) * e,
            false => 0,
        };
        let per_group = q * e + F32 * (q + 2 * kv + h) + sequence_parallel;
        let attention = half + (2 * d + q) * e + whole_gradients + per_group / groups;
        // The feed-forward's: h, its norm, the incoming gradient, the input gradient's chunks
        // and their concatenation; one chunk's activations apart (below).
        let ffn = half + 5 * d * e;
        let chunk =
            feed_forward_bytes_per_row(self.hidden as usize, e as usize) * ffn_rows.min(rows);
        let tables = self.rotary_tables(positions);
        (
            attention * rows + tables,
            ffn * rows + chunk + self.ffn_weight_sums(rows, ffn_rows) + tables,
        )
    }

    /// Bytes of the feed-forward's weight gradients while they are summed over chunks: the f32
    /// sums and one chunk's gradients (nothing extra with one chunk).
    fn ffn_weight_sums(&self, rows: u64, ffn_rows: u64) -> u64 {
        match ffn_rows >= rows {
            true => 0,
            false => 3 * self.model * self.hidden * (F32 + self.elem),
        }
    }

    /// Bytes of the busiest moment of the loss's backward over `rows` tokens with `loss_rows`
    /// rows per chunk: one chunk's logits and gradient, the weight's f32 gradient sum and one
    /// chunk's weight gradient, and the hidden states' gradient (its chunks and their
    /// concatenation).
    pub fn loss_backward(&self, rows: u64, loss_rows: u64) -> u64 {
        let chunk =
            loss_bytes_per_row(self.vocab as usize, self.elem as usize) * loss_rows.min(rows);
        chunk + self.vocab * self.model * (F32 + self.elem) + 2 * rows * self.model * self.elem
    }
}
