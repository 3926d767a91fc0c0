//! Where a layer's attention runs: over the whole sequence on one device, or over this rank's
//! shard of a sequence split across a [`DeviceGroup`].

use burn::tensor::backend::Backend;

use crate::collective::DeviceGroup;
use crate::options::FlashAttentionOptions;
use crate::schedule::ScheduleKind;
use crate::SequenceParallelOptions;

/// How attention sees the sequence. Pass the same context to every layer of a forward pass.
#[derive(Debug, Clone)]
pub enum AttentionContext<I: Backend> {
    /// The tensors hold the whole sequence, on one device.
    Local,
    /// The tensors hold rank `group.rank()`'s contiguous shard of a sequence of
    /// `world_size * shard_len` tokens: rotary positions start at `rank * shard_len` and attention
    /// runs sequence-parallel over the group (every rank must run the same layers).
    Sharded {
        /// This rank's handle on the group.
        group: DeviceGroup<I>,
        /// Which schedule (`Auto`: load-balanced when causal).
        schedule: ScheduleKind,
        /// Prefetch the next chunk while computing (off only to measure what it saves).
        overlap: bool,
    },
}

impl<I: Backend> AttentionContext<I> {
    /// This rank's shard of a sequence split across `group`, load-balanced schedule, overlap on.
    pub fn sharded(group: DeviceGroup<I>) -> Self {
        Self::Sharded {
            group,
            schedule: ScheduleKind::Auto,
            overlap: true,
        }
    }

    /// The same context with another schedule (no effect on a local context).
    pub fn with_schedule(self, kind: ScheduleKind) -> Self {
        match self {
            Self::Sharded { group, overlap, .. } => Self::Sharded {
                group,
                schedule: kind,
                overlap,
            },
            local => local,
        }
    }

    /// The absolute position of this tensor's first token, for shards of `shard_len` tokens.
    pub fn position_offset(&self, shard_len: usize) -> usize {
        match self {
            Self::Local => 0,
            Self::Sharded { group, .. } => group.rank() * shard_len,
        }
    }

    /// The sequence-parallel options for attention with `attention`'s masking and scale.
    pub(crate) fn sequence_parallel_options(
        &self,
        attention: FlashAttentionOptions,
    ) -> Option<(&DeviceGroup<I>, SequenceParallelOptions)> {
        match self {
            Self::Local => None,
            Self::Sharded {
                group,
                schedule,
                overlap,
            } => Some((
                group,
                SequenceParallelOptions {
                    attention,
                    schedule: *schedule,
                    overlap: *overlap,
                },
            )),
        }
    }
}
