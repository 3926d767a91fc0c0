//! One scheduled pair as step calls. The forward runs the pair's [`Block`]s, each on the rows
//! of the shards it covers (see [`crate::schedule::blocks`]); the backward runs its cells, one
//! call per visible chunk pair, on shards kept as one tensor per chunk. Partial states and
//! gradients stay f32.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Slice, TensorMetadata};

use crate::extension::FlashAttentionBackend;
use crate::options::FlashAttentionOptions;
use crate::options::SequenceParallelOptions;
use crate::schedule::Block;
use crate::step::{self, AttentionState, StepRows};

/// Where a pair's blocks cut its shards: `per_rank` chunks of `chunk` rows each.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Chunks {
    pub per_rank: usize,
    pub chunk: usize,
}

impl Chunks {
    /// Shards of `shard_len` rows cut into `per_rank` chunks.
    pub fn new(per_rank: usize, shard_len: usize) -> Self {
        Self {
            per_rank,
            chunk: shard_len / per_rank,
        }
    }

    fn whole(&self, range: &core::ops::Range<usize>) -> bool {
        range.start == 0 && range.end == self.per_rank
    }

    /// Rows `range` (in chunks) of `t` along dimension 2 (`[B, H, S, ..]`).
    fn rows<B: FlashAttentionBackend>(
        &self,
        t: &FloatTensor<B>,
        range: &core::ops::Range<usize>,
    ) -> FloatTensor<B> {
        if self.whole(range) {
            return t.clone();
        }
        B::float_slice(t.clone(), &self.slices::<B>(t, range))
    }

    /// `t` with rows `range` (in chunks) replaced by `value`.
    fn assign<B: FlashAttentionBackend>(
        &self,
        t: FloatTensor<B>,
        range: &core::ops::Range<usize>,
        value: FloatTensor<B>,
    ) -> FloatTensor<B> {
        if self.whole(range) {
            return value;
        }
        let slices = self.slices::<B>(&t, range);
        B::float_slice_assign(t, &slices, value)
    }

    /// Rows (along dimension 2) of the chunks `range`.
    fn row_range(&self, range: &core::ops::Range<usize>) -> core::ops::Range<usize> {
        range.start * self.chunk..range.end * self.chunk
    }

    fn slices<B: FlashAttentionBackend>(
        &self,
        t: &FloatTensor<B>,
        range: &core::ops::Range<usize>,
    ) -> Vec<Slice> {
        step::row_slices::<B>(t, &self.row_range(range))
    }
}

/// The options of one block: the call's scale and determinism under the block's mask (at its
/// rows' positions, or none).
fn block_step(block: &Block, options: &SequenceParallelOptions) -> FlashAttentionOptions {
    (options.attention.clone()).with_mask(block.mask.clone())
}

/// `state` (of the query shard's rows) with every block of a pair folded in. `None` is the
/// empty state: a first block over all the rows then writes a new state in one step
/// ([`attention_forward_first_step`](crate::AttentionBackend::attention_forward_first_step), no
/// fill, no state read), and a first block over some of them starts from an empty state of the
/// whole shard.
pub(crate) fn forward_pair<B: FlashAttentionBackend>(
    [q, k, v]: [&FloatTensor<B>; 3],
    mut state: Option<AttentionState<B>>,
    blocks: &[Block],
    chunks: Chunks,
    options: &SequenceParallelOptions,
) -> AttentionState<B> {
    let empty = || {
        let shape: [usize; 4] = q.shape().dims();
        B::attention_state_empty(shape, q.dtype(), &B::float_device(q))
    };
    for block in blocks {
        let (qs, ks, vs) = (
            chunks.rows::<B>(q, &block.query),
            chunks.rows::<B>(k, &block.kv),
            chunks.rows::<B>(v, &block.kv),
        );
        let step = block_step(block, options);
        let rows = &block.query;
        if chunks.whole(rows) {
            // The state itself, not a clone that would force the step to copy it.
            state = Some(match state {
                Some(state) => B::attention_forward_step(qs, ks, vs, state, step),
                None => B::attention_forward_first_step(qs, ks, vs, step),
            });
            continue;
        }
        let whole = state.unwrap_or_else(empty);
        let part = AttentionState {
            o: chunks.rows::<B>(&whole.o, rows),
            m: chunks.rows::<B>(&whole.m, rows),
            l: chunks.rows::<B>(&whole.l, rows),
        };
        let part = B::attention_forward_step(qs, ks, vs, part, step);
        state = Some(AttentionState {
            o: chunks.assign::<B>(whole.o, rows, part.o),
            m: chunks.assign::<B>(whole.m, rows, part.m),
            l: chunks.assign::<B>(whole.l, rows, part.l),
        });
    }
    state.unwrap_or_else(empty)
}

/// A shard's f32 gradient accumulators, one tensor per chunk (local order) of the query shard
/// (`dq`) and of the key/value shard (`dk`, `dv`).
pub(crate) struct ChunkGrads<B: FlashAttentionBackend> {
    /// `dq` of each query chunk.
    pub dq: Vec<FloatTensor<B>>,
    /// `dk` of each key/value chunk.
    pub dk: Vec<FloatTensor<B>>,
    /// `dv` of each key/value chunk.
    pub dv: Vec<FloatTensor<B>>,
}

/// A pair's `(dq, dk, dv)` added into the f32 accumulators `acc`, every tensor one chunk of its
/// shard: `[q, dO, lse, delta]` of the query shard and `[k, v]` of the key/value shard, each as
/// its chunks. One step call per cell (a query chunk against a key/value chunk,
/// [`Schedule::cells`](crate::schedule::Schedule::cells)), each on whole tensors and adding into
/// its chunks' accumulators themselves
/// ([`attention_backward_step_add`](crate::AttentionBackend::attention_backward_step_add) over
/// all their rows): the caller hands over accumulators it holds alone, so the kernel backends
/// write them in place and copy nothing.
pub(crate) fn backward_pair<B: FlashAttentionBackend>(
    [q, grad_out, lse, delta]: [&[FloatTensor<B>]; 4],
    [k, v]: [&[FloatTensor<B>]; 2],
    acc: ChunkGrads<B>,
    cells: &[Block],
    options: &SequenceParallelOptions,
) -> ChunkGrads<B> {
    let slots = |chunks: Vec<FloatTensor<B>>| chunks.into_iter().map(Some).collect::<Vec<_>>();
    let (mut dq, mut dk, mut dv) = (slots(acc.dq), slots(acc.dk), slots(acc.dv));
    let moved = |slot: &mut Option<FloatTensor<B>>| {
        slot.take()
            .expect("a chunk's accumulator is back after each call")
    };
    for cell in cells {
        let (i, j) = (cell.query.start, cell.kv.start);
        debug_assert_eq!(
            (cell.query.len(), cell.kv.len()),
            (1, 1),
            "a cell is one chunk pair"
        );
        let rows = StepRows::whole(q[i].shape()[2], k[j].shape()[2]);
        let (gq, gk, gv) = B::attention_backward_step_add(
            q[i].clone(),
            k[j].clone(),
            v[j].clone(),
            grad_out[i].clone(),
            lse[i].clone(),
            delta[i].clone(),
            (moved(&mut dq[i]), moved(&mut dk[j]), moved(&mut dv[j])),
            &rows,
            block_step(cell, options),
        );
        (dq[i], dk[j], dv[j]) = (Some(gq), Some(gk), Some(gv));
    }
    let back =
        |mut slots: Vec<Option<FloatTensor<B>>>| slots.iter_mut().map(moved).collect::<Vec<_>>();
    ChunkGrads {
        dq: back(dq),
        dk: back(dk),
        dv: back(dv),
    }
}
