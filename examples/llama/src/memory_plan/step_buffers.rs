//! The buffers of each phase of a step one by one, by size, as far as the planner counts them
//! as single tensors (`activations` and `optimizer_step` count their bytes): what
//! [`PoolClasses`] places into size classes. The per-parameter tensors (weights, gradients,
//! replicated moments, a bucket's pieces) and the pool slack are left out: each is at most one
//! parameter's matrix, and what the fitted slack stands for has no shape.

use burn_distflash::layers::CheckpointPlacement;

use super::activations::Widths;
use super::pool_classes::PoolClasses;
use super::OptimizerStepMemory;

/// Bytes of f32.
const F32: u64 = 4;

/// The single buffers of one phase, by size (a size repeated once per buffer).
pub(crate) type Buffers = Vec<u64>;

/// What a step's phases hold as single buffers, beside the bytes the planner counts.
#[derive(Debug, Clone, Default)]
pub(crate) struct StepBuffers {
    /// The loss's backward.
    pub loss: Buffers,
    /// A block's backward.
    pub block: Buffers,
    /// The optimizer step.
    pub optimizer: Buffers,
}

/// The sizes a step's activations take, for [`StepBuffers`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct ActivationShapes {
    /// The model's widths.
    pub widths: Widths,
    /// Where the blocks keep their checkpoints.
    pub placement: CheckpointPlacement,
    /// Tokens of the rank.
    pub rows: u64,
    /// Checkpoints on the GPU in the loss's backward.
    pub checkpoints_on_gpu: u64,
    /// Checkpoints on the GPU in a block's backward (with the prefetched).
    pub checkpoints_in_backward: u64,
    /// Whether two layers share a checkpoint: a pair's backward holds the second block's input
    /// and the first block's attention output and lse beside the second block's backward.
    pub pairs: bool,
    /// Rows per chunk of the loss.
    pub loss_rows: u64,
    /// Rows per chunk of the feed-forward blocks.
    pub ffn_rows: u64,
}

impl ActivationShapes {
    /// `[rows, width]` of `bytes` a element, `count` times.
    fn rows_of(&self, rows: u64, width: u64, bytes: u64, count: usize) -> Buffers {
        vec![rows * width * bytes; count]
    }

    /// One checkpoint (a block's, or a pair's: its input), tensor by tensor.
    fn checkpoint(&self) -> Buffers {
        let w = &self.widths;
        let (r, e) = (self.rows, w.elem);
        match self.placement {
            CheckpointPlacement::Layer => self.rows_of(r, w.model, e, 1),
            CheckpointPlacement::AttentionOutput => self.input_and_attention_output(),
            CheckpointPlacement::None => [
                self.rows_of(r, w.model, e, 4),
                self.rows_of(r, w.query, e, 3),
                self.rows_of(r, w.key, e, 2),
                self.rows_of(r, w.hidden, e, 3),
                self.rows_of(r, w.heads, F32, 1),
            ]
            .concat(),
        }
    }

    /// A block's input, attention's output (one buffer per group of heads) and its f32 lse: an
    /// attention-output checkpoint, and what a pair's backward holds beside its second block's
    /// backward.
    fn input_and_attention_output(&self) -> Buffers {
        let w = &self.widths;
        let groups = w.head_groups.max(1);
        [
            self.rows_of(self.rows, w.model, w.elem, 1),
            self.rows_of(self.rows, w.query / groups, w.elem, groups as usize),
            self.rows_of(self.rows, w.heads, F32, 1),
        ]
        .concat()
    }

    /// `count` checkpoints.
    fn checkpoints(&self, count: u64) -> Buffers {
        (0..count).flat_map(|_| self.checkpoint()).collect()
    }

    /// What the model keeps beside the blocks: the final norm's input and output.
    fn kept_beside_blocks(&self) -> Buffers {
        self.rows_of(self.rows, self.widths.model, self.widths.elem, 2)
    }

    /// The loss's backward as CUDA's fused kernels run it (the only backend whose pools are
    /// classed): one chunk's logits and their gradient (`cross_entropy_backward` makes the
    /// gradient in the logits' type, no f32 row), the weight's f32 gradient sum beside one
    /// chunk's f32 gradient (both alive in `sum + chunk`) and that chunk's gradient in the
    /// weight's type, the hidden states' gradient (its chunks and their concatenation). The two
    /// f32 rows of the vocabulary that [`loss_bytes_per_row`](crate::loss::loss_bytes_per_row)
    /// counts per row are Burn's unfused backward's: counted in the phase's bytes, never a
    /// buffer here.
    fn loss_backward(&self) -> Buffers {
        let w = &self.widths;
        [
            self.rows_of(self.loss_rows, w.vocab, w.elem, 2),
            vec![w.vocab * w.model * F32; 2],
            vec![w.vocab * w.model * w.elem],
            self.rows_of(self.rows, w.model, w.elem, 2),
        ]
        .concat()
    }

    /// A block's backward at its busiest: attention's (the recomputed half, the gradients of
    /// the output, the residual and the merged output, the f32 accumulators) or the
    /// feed-forward's (the half, five `[rows, d_model]` tensors and one chunk's six `[rows,
    /// d_ff]` ones), whichever [`Widths::layer_backward_halves`] counts larger; in a pair, with
    /// what the first block's backward needs beside it.
    fn block_backward(&self, attention_is_busiest: bool) -> Buffers {
        let w = &self.widths;
        let (r, e) = (self.rows, w.elem);
        // One group of heads' widths (all heads' with one group).
        let g = w.head_groups.max(1);
        let (group_query, group_key, group_heads) = (w.query / g, w.key / g, w.heads / g);
        let mut half = match self.placement {
            CheckpointPlacement::None => Vec::new(),
            _ => [
                self.rows_of(r, w.model, e, 1),
                self.rows_of(r, group_query, e, 1),
                self.rows_of(r, group_key, e, 2),
            ]
            .concat(),
        };
        if self.placement == CheckpointPlacement::Layer {
            half.extend(self.rows_of(r, w.query, e, 1));
            half.extend(self.rows_of(r, w.heads, F32, 1));
        }
        let whole_gradients = match g > 1 {
            true => [self.rows_of(r, w.query, e, 1), self.rows_of(r, w.key, e, 2)].concat(),
            false => Vec::new(),
        };
        let rest = match attention_is_busiest {
            true => [
                self.rows_of(r, w.model, e, 2),
                self.rows_of(r, w.query, e, 1),
                self.rows_of(r, group_query, e, 1),
                self.rows_of(r, group_query, F32, 1),
                self.rows_of(r, group_key, F32, 2),
                self.rows_of(r, group_heads, F32, 1),
                whole_gradients,
            ]
            .concat(),
            false => [
                self.rows_of(r, w.model, e, 5),
                self.rows_of(self.ffn_rows.min(r), w.hidden, e, 6),
            ]
            .concat(),
        };
        let pair = match self.pairs {
            true => self.input_and_attention_output(),
            false => Vec::new(),
        };
        [half, rest, pair].concat()
    }
}

impl StepBuffers {
    /// The buffers of a step with these activations, `attention_is_busiest` saying which half
    /// of a block's backward the planner counted, and the optimizer step `step` (a sharded
    /// state's chunks in every phase, the step's own buffers in its phase).
    pub fn of(
        shapes: &ActivationShapes,
        attention_is_busiest: bool,
        step: &OptimizerStepMemory,
    ) -> Self {
        let (state, vectors) = (step.state_buffers(), step.step_buffers());
        let loss = [
            state.clone(),
            shapes.checkpoints(shapes.checkpoints_on_gpu),
            shapes.kept_beside_blocks(),
            shapes.loss_backward(),
        ]
        .concat();
        let block = [
            state.clone(),
            shapes.checkpoints(shapes.checkpoints_in_backward),
            shapes.block_backward(attention_is_busiest),
        ]
        .concat();
        Self {
            loss,
            block,
            optimizer: [state, vectors].concat(),
        }
    }
}

/// What CubeCL's pools reserve for a step's buffers, class by class, against the bytes the
/// planner counts for those buffers in each phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClassPages {
    /// Bytes of the pages the classes hold for the listed buffers at the steady state: for each
    /// class, its most pages in any phase (the pools keep every page they allocate, and a
    /// class's pages serve only its buffers).
    pub reserved: u64,
    /// Pages of the top class among them.
    pub top_pages: u64,
    /// Bytes of one top page.
    pub top_page: u64,
    /// The largest buffer in the top class (0 when none is); one larger than a top page
    /// cannot be allocated.
    pub largest_top_buffer: u64,
}

impl ClassPages {
    /// The pages `pools` reserve for `buffers`, and for each phase the bytes of those buffers
    /// (what `reserved` replaces in the phase's count), in the order loss, block, optimizer.
    /// A buffer larger than a top page, which CubeCL refuses, is counted in the top class (the
    /// plan then does not fit).
    pub(crate) fn of(pools: &PoolClasses, buffers: &StepBuffers) -> (Self, [u64; 3]) {
        let phases = [&buffers.loss, &buffers.block, &buffers.optimizer];
        let top = pools.classes().len() - 1;
        let class_of = |size: u64| pools.class_of(size).unwrap_or(top);
        // Every listed buffer is counted by its class's pages: each phase's count gives up all
        // of their bytes.
        let counted = phases.map(|sizes| sizes.iter().sum());
        let mut pages = Self {
            top_page: pools.top().page,
            ..Self::default()
        };
        for class in 0..pools.classes().len() {
            let mut most = 0;
            for sizes in phases {
                let mine: Vec<u64> = (sizes.iter().copied())
                    .filter(|&s| class_of(s) == class)
                    .collect();
                most = most.max(pools.pages_reserved(class, &mine));
                if pools.is_top(class) {
                    let largest = mine.iter().copied().max().unwrap_or(0);
                    pages.largest_top_buffer = pages.largest_top_buffer.max(largest);
                }
            }
            pages.reserved += most;
            if pools.is_top(class) {
                pages.top_pages = most / pools.top().page.max(1);
            }
        }
        (pages, counted)
    }
}
