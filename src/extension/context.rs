//! Where a layer's attention runs: over the whole sequence on one device, or over this rank's
//! shard of a sequence split across a [`DeviceGroup`]. It needs only the sequence-parallel
//! capability (a group of the backend's [`SequenceParallelBackend::Inner`]); checkpointed
//! segments take one.

use crate::Error;

use super::SequenceParallelBackend;
use crate::collective::DeviceGroup;
use crate::options::{FlashAttentionOptions, SequenceParallelOptions};
use crate::schedule::{Layout, ScheduleKind};

/// How attention sees the sequence, for a model on backend `B` (the backend you use:
/// `Autodiff<Cuda>` when training, for example). Pass the same context to every layer of a
/// forward pass.
#[derive(Debug, Clone)]
pub enum AttentionContext<B: SequenceParallelBackend> {
    /// The tensors hold the whole sequence, on one device.
    Local,
    /// The tensors hold rank `group.rank()`'s shard of a sequence of `world_size * shard_len`
    /// tokens, at the positions the schedule's layout gives it (see
    /// [`AttentionContext::positions`]; cut whole sequences with
    /// [`crate::sequence_parallel::shard_sequence`]): rotary embeddings use those positions and
    /// attention runs sequence-parallel over the group (every rank must run the same layers).
    Sharded {
        /// This rank's handle on the group, over the backend that computes and communicates
        /// ([`SequenceParallelBackend::Inner`]: the CubeCL or ndarray backend under `Autodiff`
        /// and `Fusion`).
        group: DeviceGroup<B::Inner>,
        /// Which schedule, and so which layout (`Auto`: see [`ScheduleKind::resolve`]).
        schedule: ScheduleKind,
        /// Prefetch the next chunk while computing (off only to measure what it saves).
        overlap: bool,
    },
}

impl<B: SequenceParallelBackend> AttentionContext<B> {
    /// This rank's shard of a sequence split across `group`, `Auto` schedule, overlap on.
    pub fn sharded(group: DeviceGroup<B::Inner>) -> Self {
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

    /// The same context for a model on backend `O`, which computes on the same inner backend:
    /// for example the context of an `Autodiff<B>` model for its `valid()` copy on `B`, which
    /// evaluates on the same group. The group is shared, not copied.
    pub fn for_backend<O>(&self) -> AttentionContext<O>
    where
        O: SequenceParallelBackend<Inner = B::Inner>,
    {
        match self {
            Self::Local => AttentionContext::Local,
            Self::Sharded {
                group,
                schedule,
                overlap,
            } => AttentionContext::Sharded {
                group: group.clone(),
                schedule: *schedule,
                overlap: *overlap,
            },
        }
    }

    /// Where each rank's `shard_len` tokens are under attention with `attention`'s mask
    /// (whose causal order and window, with the world size, decide the layout under `Auto`):
    /// contiguous locally, the schedule's layout when sharded (cut whole sequences with
    /// [`crate::sequence_parallel::shard_sequence`] for it).
    pub fn layout(&self, attention: FlashAttentionOptions, shard_len: usize) -> Layout {
        match self.sequence_parallel_options(attention) {
            None => Layout::Contiguous,
            Some((group, options)) => options.layout(group.world_size(), shard_len),
        }
    }

    /// The absolute position of each of this tensor's `shard_len` tokens under attention with
    /// `attention`'s mask (which, with the world size, decides the layout under `Auto`):
    /// `0..shard_len` locally; sharded, the rank's positions in the layout, or why the layout
    /// cannot split shards of that length.
    ///
    /// # Errors
    ///
    /// Sharded only: [`Error`] when `shard_len` is zero, or odd under the zigzag layout.
    pub fn positions(
        &self,
        shard_len: usize,
        attention: FlashAttentionOptions,
    ) -> Result<Vec<usize>, Error> {
        match self {
            Self::Local => Ok((0..shard_len).collect()),
            Self::Sharded { group, .. } => Ok((self.layout(attention, shard_len)).positions(
                group.world_size(),
                group.rank(),
                shard_len,
            )?),
        }
    }

    /// The sequence-parallel options for attention with `attention`'s masking and scale.
    pub(crate) fn sequence_parallel_options(
        &self,
        attention: FlashAttentionOptions,
    ) -> Option<(&DeviceGroup<B::Inner>, SequenceParallelOptions)> {
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
                    ..SequenceParallelOptions::default()
                },
            )),
        }
    }
}
