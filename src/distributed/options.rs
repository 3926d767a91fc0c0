//! [`SequenceParallelOptions`]: what a sequence-parallel attention call is asked to do.

use serde::{Deserialize, Serialize};

use crate::options::FlashAttentionOptions;
use crate::schedule::{Layout, Schedule, ScheduleKind};

/// Options of [`crate::sequence_parallel_attention`].
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SequenceParallelOptions {
    /// Causal masking (over the whole sequence) and score scale.
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

    /// The schedule these options mean on `world` ranks.
    ///
    /// # Panics
    ///
    /// When `world` is zero.
    pub fn schedule_for(&self, world: usize) -> Schedule {
        Schedule::new(self.schedule, world, self.attention.causal)
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
