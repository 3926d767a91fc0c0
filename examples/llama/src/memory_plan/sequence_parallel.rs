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
//! - with overlap over more than two ranks, the next step's `k, v` arriving and the previous
//!   step's `dk, dv` still on their way back to their owner.
//!
//! Under a layout of several chunks per rank (zigzag) nothing more: the backward keeps each of
//! a rank's tensors as one tensor per chunk for the whole pass (cut on entry, before the
//! accumulators exist; joined on exit, after the remote chunk's tensors are gone), and every
//! step call is one query chunk against one key/value chunk, on whole tensors, so no rows are
//! copied.
//!
//! With the remote shard streamed in row parts (`SequenceParallelOptions::backward_parts`),
//! the received `k, v` and the remote `dk, dv` are one part of the shard each, and so are the
//! next part arriving and the previous part's gradients on their way back, which overlap keeps
//! in flight from two ranks on (the next part is of the same shard).
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
    /// Whether some rank computes a pair for another rank's queries (the balanced schedule).
    pub helpers: bool,
    /// Whether a step's inputs travel while the previous step computes.
    pub overlap: bool,
    /// Row parts in which the backward streams another rank's key/value shard (1: whole).
    pub parts: u64,
}

impl Widths {
    /// Bytes per token of the rank's shard that a sequence-parallel attention backward holds at
    /// its busiest beyond a one-GPU backward (0 on one GPU; see the module's documentation).
    pub fn sequence_parallel_backward(&self, split: SequenceSplit) -> u64 {
        if split.world <= 1 {
            return 0;
        }
        let (q, kv, e, h) = (self.query, self.key, self.elem, self.heads);
        let parts = split.parts.max(1);
        // The received k, v and their f32 dk, dv: one part of the shard.
        let part = (2 * kv * e + 2 * kv * F32).div_ceil(parts);
        let in_flight = match split.overlap && (split.world > 2 || parts > 1) {
            true => part,
            false => 0,
        };
        let remote_pair = part + in_flight;
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
            head_groups: 1,
        }
    }

    fn split(world: u64, helpers: bool, overlap: bool) -> SequenceSplit {
        SequenceSplit {
            world,
            helpers,
            overlap,
            parts: 1,
        }
    }

    #[test]
    fn one_gpu_holds_nothing_more() {
        assert_eq!(widths().sequence_parallel_backward(split(1, true, true)), 0);
    }

    #[test]
    fn zigzag_on_two_ranks_counts_the_remote_pair_by_hand() {
        // k, v received: 2 x 16 x 2 = 64; dk, dv in f32: 2 x 16 x 4 = 128; the chunks' own
        // tensors copy no rows. Two ranks: nothing in flight.
        let zigzag = split(2, false, true);
        assert_eq!(widths().sequence_parallel_backward(zigzag), 64 + 128);
        // Without overlap the same: the next step's inputs exist only from four ranks on.
        let quiet = split(2, false, false);
        assert_eq!(widths().sequence_parallel_backward(quiet), 192);
        // Wide key/value heads: k, v 256; dk, dv 512.
        let wide = Widths {
            key: 64,
            ..widths()
        };
        assert_eq!(wide.sequence_parallel_backward(quiet), 256 + 512);
    }

    #[test]
    fn a_contiguous_ring_copies_nothing_and_overlap_adds_the_next_and_previous_steps() {
        // k, v 64 and dk, dv 128; dq is added into the rank's accumulator in place.
        let ring = split(4, false, false);
        assert_eq!(widths().sequence_parallel_backward(ring), 64 + 128);
        // With overlap: the next k, v (64) and the previous dk, dv in f32 (128).
        let overlapped = split(4, false, true);
        assert_eq!(
            widths().sequence_parallel_backward(overlapped),
            192 + 64 + 128
        );
    }

    #[test]
    fn a_helper_counts_the_larger_of_its_two_moments() {
        // A helper: q, dO (2 x 32 x 2 = 128), f32 lse, delta (2 x 4 x 4 = 32) and dq in f32
        // (128): 288, above the ring's 192.
        let balanced = split(4, true, false);
        assert_eq!(widths().sequence_parallel_backward(balanced), 288);
        // Wide key/value heads make the remote pair the larger.
        let wide = Widths {
            key: 64,
            ..widths()
        };
        // k, v 256; dk, dv 512: 768, against the helper's 288.
        assert_eq!(wide.sequence_parallel_backward(balanced), 768);
    }

    #[test]
    fn parts_divide_the_remote_pair_and_keep_a_part_in_flight() {
        let in_parts = |parts, overlap| SequenceSplit {
            parts,
            ..split(2, false, overlap)
        };
        // Whole on two ranks: k, v 64 and dk, dv 128, nothing in flight (see above).
        assert_eq!(widths().sequence_parallel_backward(in_parts(1, true)), 192);
        // In 4 parts: 48 held, and with overlap the next part's k, v and the previous part's
        // dk, dv (48 more), even on two ranks.
        assert_eq!(widths().sequence_parallel_backward(in_parts(4, false)), 48);
        assert_eq!(widths().sequence_parallel_backward(in_parts(4, true)), 96);
        // A ring of four with overlap: (192 + 192) / 4.
        let ring = SequenceSplit {
            parts: 4,
            ..split(4, false, true)
        };
        assert_eq!(widths().sequence_parallel_backward(ring), 96);
        // A helper's moment is not cut: it becomes the larger one.
        let balanced = SequenceSplit {
            parts: 4,
            ..split(4, true, false)
        };
        assert_eq!(widths().sequence_parallel_backward(balanced), 288);
    }
}
