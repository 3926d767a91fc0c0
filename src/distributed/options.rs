//! [`SequenceParallelOptions`]: what a sequence-parallel attention call is asked to do.

use serde::{Deserialize, Serialize};

use crate::options::FlashAttentionOptions;
use crate::schedule::{Layout, Schedule, ScheduleKind};
use crate::Error;

/// Options of [`crate::sequence_parallel_attention`].
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SequenceParallelOptions {
    /// The mask over the whole sequence (causal order, a sliding window, documents at absolute
    /// positions `0..world * shard_len`) and the score scale. Every rank passes the same
    /// options, documents included: each rank holds the documents of the whole sequence, from
    /// which every rank derives the same schedule (pairs of shards with no visible score are
    /// neither computed nor exchanged).
    pub attention: FlashAttentionOptions,
    /// Which schedule, and so which [`Layout`] the shards must have (see
    /// [`SequenceParallelOptions::layout`]); `Auto` picks by world size and mask.
    pub schedule: ScheduleKind,
    /// Overlap communication with computation (prefetch the next step's chunk). Off only to
    /// measure what the overlap saves.
    pub overlap: bool,
}

impl SequenceParallelOptions {
    /// Causal attention, `Auto` schedule (zigzag at even world sizes, balanced at odd ones),
    /// overlap on.
    pub fn causal() -> Self {
        Self {
            attention: FlashAttentionOptions::causal(),
            schedule: ScheduleKind::Auto,
            overlap: true,
        }
    }

    /// The same options with another schedule.
    pub fn with_schedule(self, schedule: ScheduleKind) -> Self {
        Self { schedule, ..self }
    }

    /// The same options with overlap switched on or off.
    pub fn with_overlap(self, overlap: bool) -> Self {
        Self { overlap, ..self }
    }

    /// The schedule these options mean on `world` ranks holding shards of `shard_len` tokens
    /// (see [`Schedule::for_mask`]).
    ///
    /// # Errors
    ///
    /// As [`Schedule::for_mask`]: a zero `world` or `shard_len`, an odd `shard_len` under
    /// zigzag, or documents that do not cover exactly the `world * shard_len` positions.
    pub fn schedule_for(&self, world: usize, shard_len: usize) -> Result<Schedule, Error> {
        Schedule::for_mask(self.schedule, world, shard_len, &self.attention.mask())
    }

    /// Where each rank's shard must come from on `world` ranks: shard the sequence with
    /// [`crate::shard_sequence`] (and gather outputs with [`crate::gather_sequence`]) for this
    /// layout.
    pub fn layout(&self, world: usize) -> Layout {
        (self.schedule)
            .resolve(world, self.attention.causal)
            .layout()
    }
}
