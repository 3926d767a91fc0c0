//! What one rank of a sequence-parallel group holds during attention's backward beyond what a
//! one-GPU backward over the same rows holds (the f32 `dq, dk, dv` accumulators and the row
//! deltas, which `activations` counts either way), per token of the rank's shard, read off the
//! distributed pass (`burn_distflash::sequence_parallel`: the step loop, the pair's blocks, the
//! backward's accumulators).
//!
//! The busiest moment is a pair whose key/value chunk is another rank's (ring and zigzag: every
//! step after the first). Each block's step adds into the f32 accumulators themselves
//! (`attention_backward_step_add`; the pass moves the rank's own accumulators into the step, so
//! nothing copies them), and the rank then holds:
//! - the received `k, v` (`2 kv` elements of the activations' type);
//! - the remote chunk's `dk, dv` in f32, the accumulators the pass starts from zeros and sends
//!   back to the owner;
//! - under a layout of several chunks per rank (zigzag), a block covers part of one shard's rows
//!   (the late queries against every key, or every query against the early keys): the kernels
//!   take contiguous buffers, and the rows of a chunk in `[batch, heads, seq, head_dim]` are
//!   `batch x heads` separate runs, so the block's rows of its inputs (`q` and `dO`, or `k` and
//!   `v`) are copied contiguous, and its rows of the f32 accumulators it adds into (`dq`, or
//!   `dk` and `dv`) are a contiguous copy written back in place; the larger of the two sides
//!   counts;
//! - with overlap over more than two ranks, the next step's `k, v` arriving and the previous
//!   step's `dk, dv` still on their way back to their owner.
//!
//! A helper of the balanced schedule instead receives another rank's query bundle (`q, dO` and
//! the f32 lse and delta) and makes its `dq` in f32, while the step adds its own rows' `dk, dv`
//! into the rank's accumulators; the larger of the two moments counts.

use super::activations::Widths;

/// Bytes of f32.
const F32: u64 = 4;

/// How a sequence is split over a group, as far as a rank's memory is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SequenceSplit {
    /// Ranks sharing the sequence.
    pub world: u64,
    /// Chunks of a rank's shard the schedule's layout cuts (1 contiguous, 2 zigzag).
    pub chunks: u64,
    /// Whether some rank computes a pair for another rank's queries (the balanced schedule).
    pub helpers: bool,
    /// Whether a step's inputs travel while the previous step computes.
    pub overlap: bool,
}

impl Widths {
    /// Bytes per token of the rank's shard that a sequence-parallel attention backward holds at
    /// its busiest beyond a one-GPU backward (0 on one GPU; see the module's documentation).
    pub fn sequence_parallel_backward(&self, split: SequenceSplit) -> u64 {
        if split.world <= 1 {
            return 0;
        }
        let (q, kv, e, h) = (self.query, self.key, self.elem, self.heads);
        let chunks = split.chunks.max(1);
        let received_kv = 2 * kv * e;
        let remote_kv_grads = 2 * kv * F32;
        let partial_rows = match chunks > 1 {
            true => {
                let query_rows = (2 * q * e + F32 * q) / chunks;
                let kv_rows = (2 * kv * e + 2 * F32 * kv) / chunks;
                query_rows.max(kv_rows)
            }
            false => 0,
        };
        let in_flight = match split.overlap && split.world > 2 {
            true => 2 * kv * e + 2 * kv * F32,
            false => 0,
        };
        let remote_pair = received_kv + remote_kv_grads + partial_rows + in_flight;
        let helper_pair = match split.helpers {
            true => (2 * q * e + 2 * F32 * h) + F32 * q,
            false => 0,
        };
        remote_pair.max(helper_pair)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 4 query heads of 8 (width 32), 2 key/value heads (width 16), bf16.
    fn widths() -> Widths {
        Widths {
            model: 32,
            query: 32,
            key: 16,
            head: 8,
            heads: 4,
            hidden: 64,
            vocab: 100,
            elem: 2,
        }
    }

    fn split(world: u64, chunks: u64, helpers: bool, overlap: bool) -> SequenceSplit {
        SequenceSplit {
            world,
            chunks,
            helpers,
            overlap,
        }
    }

    #[test]
    fn one_gpu_holds_nothing_more() {
        assert_eq!(
            widths().sequence_parallel_backward(split(1, 2, true, true)),
            0
        );
    }

    #[test]
    fn zigzag_on_two_ranks_counts_the_remote_pair_by_hand() {
        // k, v received: 2 x 16 x 2 = 64; dk, dv in f32: 2 x 16 x 4 = 128; the larger side of
        // a partial block: the late queries (q and dO rows 2 x 32 x 2 / 2 = 64, the dq rows'
        // copy 4 x 32 / 2 = 64) against every query and the early keys (k and v rows
        // 2 x 16 x 2 / 2 = 32, the dk and dv rows' copies 2 x 4 x 16 / 2 = 64). Two ranks:
        // nothing in flight.
        let zigzag = split(2, 2, false, true);
        assert_eq!(widths().sequence_parallel_backward(zigzag), 64 + 128 + 128);
        // Without overlap the same: the next step's inputs exist only from four ranks on.
        let quiet = split(2, 2, false, false);
        assert_eq!(widths().sequence_parallel_backward(quiet), 320);
        // Wide key/value heads make the early keys' side the larger.
        let wide = Widths {
            key: 64,
            ..widths()
        };
        // k, v 256; dk, dv 512; k and v rows 128 and their gradients' rows 256.
        assert_eq!(wide.sequence_parallel_backward(quiet), 256 + 512 + 384);
    }

    #[test]
    fn a_contiguous_ring_copies_nothing_and_overlap_adds_the_next_and_previous_steps() {
        // k, v 64 and dk, dv 128; dq is added into the rank's accumulator in place.
        let ring = split(4, 1, false, false);
        assert_eq!(widths().sequence_parallel_backward(ring), 64 + 128);
        // With overlap: the next k, v (64) and the previous dk, dv in f32 (128).
        let overlapped = split(4, 1, false, true);
        assert_eq!(
            widths().sequence_parallel_backward(overlapped),
            192 + 64 + 128
        );
    }

    #[test]
    fn a_helper_counts_the_larger_of_its_two_moments() {
        // A helper: q, dO (2 x 32 x 2 = 128), f32 lse, delta (2 x 4 x 4 = 32) and dq in f32
        // (128): 288, above the ring's 192.
        let balanced = split(4, 1, true, false);
        assert_eq!(widths().sequence_parallel_backward(balanced), 288);
        // Wide key/value heads make the remote pair the larger.
        let wide = Widths {
            key: 64,
            ..widths()
        };
        // k, v 256; dk, dv 512: 768, against the helper's 288.
        assert_eq!(wide.sequence_parallel_backward(balanced), 768);
    }
}
