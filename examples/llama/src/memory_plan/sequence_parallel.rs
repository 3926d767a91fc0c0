//! What one rank of a sequence-parallel group holds during attention's backward beyond what a
//! one-GPU backward over the same rows holds (the f32 `dq, dk, dv` accumulators and the row
//! deltas, which `activations` counts either way), per token of the rank's shard, read off the
//! distributed pass (`burn_distflash::sequence_parallel`: the step loop, the pair's blocks, the
//! backward's accumulators).
//!
//! The busiest moment is a pair whose key/value chunk is another rank's (ring and zigzag: every
//! step after the first). The rank then holds:
//! - the received `k, v` (`2 kv` elements of the activations' type);
//! - the remote chunk's `dk, dv` in f32 twice: the zeros the pass starts them from and the step's
//!   own accumulators (`GradAccumulators::zeros` of the backward step), summed into one another;
//! - the step's `dq` in f32 for the block's query rows (one chunk of the shard's `chunks`);
//! - under a layout of several chunks per rank (zigzag), the block covers part of the shard's
//!   rows: its `q` and `dO` rows are copied into contiguous buffers, and adding the block's `dq`
//!   into rows of the rank's accumulator copies the whole accumulator once (the pass still holds
//!   it, so the slice assignment cannot write in place);
//! - with overlap over more than two ranks, the next step's `k, v` arriving and the previous
//!   step's `dk, dv` still on their way back to their owner.
//!
//! A helper of the balanced schedule instead receives another rank's query bundle (`q, dO` and
//! the f32 lse and delta) and makes its `dq` in f32 (zeros and the step's), beside the step's
//! `dk, dv` of its own rows; the larger of the two moments counts.

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
        let partial_rows = chunks > 1;
        let received_kv = 2 * kv * e;
        let remote_kv_grads = 2 * (2 * kv * F32);
        let block_dq = F32 * q / chunks;
        let (accumulator_copy, operand_copies) = match partial_rows {
            true => (F32 * q, 2 * q * e / chunks),
            false => (0, 0),
        };
        let in_flight = match split.overlap && split.world > 2 {
            true => 2 * kv * e + 2 * kv * F32,
            false => 0,
        };
        let remote_pair = received_kv
            + remote_kv_grads
            + block_dq
            + accumulator_copy
            + operand_copies
            + in_flight;
        let helper_pair = match split.helpers {
            true => (2 * q * e + 2 * F32 * h) + 2 * F32 * q + 2 * kv * F32,
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
        // k, v received: 2 x 16 x 2 = 64; dk, dv in f32 twice: 2 x 2 x 16 x 4 = 256; the
        // step's dq over half the rows: 4 x 32 / 2 = 64; the dq accumulator's copy: 4 x 32 =
        // 128; q and dO rows copied: 2 x 32 x 2 / 2 = 64. Two ranks: nothing in flight.
        let zigzag = split(2, 2, false, true);
        assert_eq!(
            widths().sequence_parallel_backward(zigzag),
            64 + 256 + 64 + 128 + 64
        );
        // Without overlap the same: the next step's inputs exist only from four ranks on.
        let quiet = split(2, 2, false, false);
        assert_eq!(widths().sequence_parallel_backward(quiet), 576);
    }

    #[test]
    fn a_contiguous_ring_copies_nothing_and_overlap_adds_the_next_and_previous_steps() {
        // k, v 64, dk, dv twice 256, dq over all rows 128.
        let ring = split(4, 1, false, false);
        assert_eq!(widths().sequence_parallel_backward(ring), 64 + 256 + 128);
        // With overlap: the next k, v (64) and the previous dk, dv in f32 (128).
        let overlapped = split(4, 1, false, true);
        assert_eq!(
            widths().sequence_parallel_backward(overlapped),
            448 + 64 + 128
        );
    }

    #[test]
    fn a_helper_counts_the_larger_of_its_two_moments() {
        // A helper: q, dO (2 x 32 x 2 = 128) and f32 lse, delta (2 x 4 x 4 = 32), dq in f32
        // twice (256), its own rows' dk, dv from the step (128): 544, above the ring's 448.
        let balanced = split(4, 1, true, false);
        assert_eq!(widths().sequence_parallel_backward(balanced), 544);
        // Wide key/value heads make the remote pair the larger.
        let wide = Widths {
            key: 64,
            ..widths()
        };
        // k, v 256; dk, dv twice 1024; dq 128: 1408, against the helper's 160 + 256 + 512.
        assert_eq!(wide.sequence_parallel_backward(balanced), 1408);
    }
}
