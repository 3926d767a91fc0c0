//! Options of the Burn-level attention op, one-shot or one step ([`FlashAttentionOptions`]: the
//! mask, the scale and determinism, carried unchanged from a module to the kernels' boundary),
//! and sequence-parallel ([`SequenceParallelOptions`]).

use crate::schedule::{Layout, Schedule, ScheduleKind};
use crate::Error;

use distflash_kernels::{AttentionDims, KernelError};
pub use distflash_schedule::{Documents, Mask, SlidingWindow};
use serde::{Deserialize, Serialize};

/// What one attention call computes: which keys each query sees ([`Mask`]), the score scale and
/// whether the backward must be bitwise reproducible. The one value every layer passes down, from
/// a module's configuration through the op and the sequence-parallel steps to the kernels (the
/// CubeCL backends turn it into the kernels' `StepOptions` at the crate boundary). Like Burn's
/// `AttentionModuleOptions`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct FlashAttentionOptions {
    /// Which keys each query sees: causal order, a sliding window, packed documents (they
    /// combine; see [`Mask`]), at absolute positions. A whole sequence's mask has offsets 0; a
    /// step's mask sits at its chunks' offsets ([`Mask::at`]). With `causal` only the keys before
    /// the query count: a window's `after` is then ignored (allowed, not an error). Key tiles
    /// outside every query's band are skipped, not masked. A one-shot call with documents needs
    /// `seq_q == seq_kv ==` [`Documents::len`] and one list for every batch row or one per batch
    /// row. The documents are per-call data, never serialized.
    pub mask: Mask,
    /// Score scale; `None` means `1 / sqrt(head_dim)`. In f32, the kernels' precision.
    #[serde(default)]
    pub scale: Option<f32>,
    /// Bitwise reproducible gradients. Off by default: on CUDA the backward then adds dQ with
    /// f32 atomics from one fused kernel (as FlashAttention-2 does; sums in no fixed order, so
    /// runs differ in the last bits). On, dQ gets its own kernel, which recomputes the scores
    /// (slower). The portable kernels are deterministic either way.
    #[serde(default)]
    pub deterministic: bool,
}

impl FlashAttentionOptions {
    /// Causal attention with the default scale.
    pub fn causal() -> Self {
        Self::masked(Mask::causal())
    }

    /// Attention under `mask` (build it with [`Mask::causal`], [`Mask::with_window`],
    /// [`Mask::with_documents`]), default scale, not deterministic.
    pub fn masked(mask: Mask) -> Self {
        Self {
            mask,
            ..Self::default()
        }
    }

    /// The same scale and determinism under another mask (a step's, at its chunks' offsets).
    pub fn with_mask(self, mask: Mask) -> Self {
        Self { mask, ..self }
    }

    /// These options for a step whose query rows start at absolute position `q_offset` and key
    /// rows at `kv_offset` (the mask at those offsets, [`Mask::at`]).
    pub fn at(self, q_offset: i64, kv_offset: i64) -> Self {
        let mask = self.mask.clone().at(q_offset, kv_offset);
        self.with_mask(mask)
    }

    /// These options with a score scale other than `1 / sqrt(head_dim)`.
    pub fn with_scale(self, scale: f32) -> Self {
        Self {
            scale: Some(scale),
            ..self
        }
    }

    /// These options with bitwise reproducible gradients on or off (see
    /// [`deterministic`](Self::deterministic)).
    pub fn with_deterministic(self, deterministic: bool) -> Self {
        Self {
            deterministic,
            ..self
        }
    }

    /// The scale applied to `q . k` for a given head dimension.
    pub fn resolved_scale(&self, head_dim: usize) -> f32 {
        self.scale.unwrap_or(1.0 / (head_dim as f32).sqrt())
    }

    /// Errors unless the options can be used: a given scale must be finite.
    ///
    /// # Errors
    ///
    /// [`Error::Kernel`] with [`KernelError::BadOption`] when `scale` is `Some` of a value that
    /// is not finite (NaN or infinite).
    pub fn check(&self) -> Result<(), Error> {
        match self.scale {
            Some(scale) if !scale.is_finite() => Err(Error::Kernel(KernelError::BadOption {
                what: format!("the score scale must be finite, got {scale}"),
            })),
            _ => Ok(()),
        }
    }

    /// Errors unless the mask applies to a call of `dims` whose rows may be chunks of a longer
    /// sequence (a rank's shards): documents must have one list for every batch row or one per
    /// batch row, and cover the call's positions.
    ///
    /// # Errors
    ///
    /// [`Error::Kernel`] with [`KernelError::BadMask`] naming what was wrong.
    pub(crate) fn check_mask(&self, dims: &AttentionDims) -> Result<(), Error> {
        Ok((self.mask).check_call(dims.batch, dims.q_len, dims.kv_len)?)
    }

    /// Errors unless the mask applies to a one-shot call of `dims`, whose query and key rows are
    /// the whole sequence: with documents, `seq_q == seq_kv ==` [`Documents::len`], and the
    /// checks of [`check_mask`](Self::check_mask).
    ///
    /// # Errors
    ///
    /// [`Error::Kernel`] with [`KernelError::BadMask`] when documents are given and `seq_q`
    /// differs from `seq_kv`, when they end at another length than the sequence's, or when
    /// their batch rows are neither 1 nor the call's `batch`.
    pub(crate) fn check_one_shot_mask(&self, dims: &AttentionDims) -> Result<(), Error> {
        if let Some(documents) = &self.mask.documents {
            let bad = |what: String| Err(Error::Kernel(KernelError::BadMask { what }));
            if dims.q_len != dims.kv_len {
                return bad(format!(
                    "documents split one packed sequence attending to itself: a one-shot call \
                     with documents needs seq_q == seq_kv, got seq_q {} and seq_kv {} (for \
                     chunks of a sequence, use the step operations with the mask at the \
                     chunks' offsets, Mask::at)",
                    dims.q_len, dims.kv_len
                ));
            }
            if documents.len() != dims.q_len {
                return bad(format!(
                    "the documents end at position {}, the sequence has {} positions (the last \
                     cumulative length must be the sequence length)",
                    documents.len(),
                    dims.q_len
                ));
            }
        }
        self.check_mask(dims)
    }
}

/// Options of
/// [`sequence_parallel_attention`](crate::sequence_parallel::sequence_parallel_attention).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SequenceParallelOptions {
    /// The mask over the whole sequence (causal order, a sliding window, documents at absolute
    /// positions `0..world * shard_len`, offsets 0), the score scale and determinism. Every rank
    /// passes the same options, documents included: each rank holds the documents of the whole
    /// sequence, from which every rank derives the same schedule (pairs of shards with no
    /// visible score are neither computed nor exchanged).
    pub attention: FlashAttentionOptions,
    /// Which schedule, and so which [`Layout`] the shards must have (see
    /// [`SequenceParallelOptions::layout`]); `Auto` picks by world size and mask.
    pub schedule: ScheduleKind,
    /// Overlap communication with computation (prefetch the next step's chunk). Off only to
    /// measure what the overlap saves.
    pub overlap: bool,
    /// Row parts in which the backward streams another rank's key/value shard: each of its
    /// layout chunks travels, is computed with and has its `dk, dv` returned in this many equal
    /// row parts, one exchange each, so a rank holds a part of the remote `k, v` and of their
    /// f32 gradients instead of the whole shard (more, smaller messages and step calls). 1 (the
    /// default) sends the whole shard at once. Must divide the rows of each layout chunk
    /// (checked, [`SequenceParallelOptions::check_backward_parts`]); every rank passes the same
    /// value. The forward and the query bundles of helpers are never cut.
    #[serde(default = "one_part")]
    pub backward_parts: usize,
}

/// The serialized default of [`SequenceParallelOptions::backward_parts`].
fn one_part() -> usize {
    1
}

impl Default for SequenceParallelOptions {
    /// No mask, `Auto` schedule, overlap off, the backward's remote shard whole.
    fn default() -> Self {
        Self {
            attention: FlashAttentionOptions::default(),
            schedule: ScheduleKind::default(),
            overlap: false,
            backward_parts: one_part(),
        }
    }
}

impl SequenceParallelOptions {
    /// Causal attention, `Auto` schedule (zigzag at even world sizes, balanced at odd ones),
    /// overlap on.
    pub fn causal() -> Self {
        Self {
            attention: FlashAttentionOptions::causal(),
            schedule: ScheduleKind::Auto,
            overlap: true,
            backward_parts: one_part(),
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

    /// The same options with the backward streaming another rank's key/value shard in `parts`
    /// row parts (see [`SequenceParallelOptions::backward_parts`]).
    pub fn with_backward_parts(self, parts: usize) -> Self {
        Self {
            backward_parts: parts,
            ..self
        }
    }

    /// Errors unless [`SequenceParallelOptions::backward_parts`] cuts each layout chunk of a
    /// shard of `shard_len` tokens on `world` ranks into equal row parts.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming `backward_parts` and the values allowed (the divisors of a
    /// chunk's rows) when it is 0 or does not divide them.
    pub fn check_backward_parts(&self, world: usize, shard_len: usize) -> Result<(), Error> {
        let chunks = self.layout(world, shard_len).chunks_per_rank();
        let rows = shard_len / chunks.max(1);
        let parts = self.backward_parts;
        if parts > 0 && rows.is_multiple_of(parts) {
            return Ok(());
        }
        let allowed: Vec<String> = (1..=rows)
            .filter(|&d| rows.is_multiple_of(d))
            .map(|d| d.to_string())
            .collect();
        Err(Error::config(
            "backward_parts",
            format!(
                "a divisor of the {rows} rows of each of a shard's {chunks} layout chunk(s): one \
                 of {}",
                allowed.join(", ")
            ),
            parts,
        ))
    }

    /// The schedule these options mean on `world` ranks holding shards of `shard_len` tokens
    /// (see [`Schedule::for_mask`]).
    ///
    /// # Errors
    ///
    /// As [`Schedule::for_mask`]: a zero `world` or `shard_len`, an odd `shard_len` under
    /// zigzag, or documents that do not cover exactly the `world * shard_len` positions.
    pub fn schedule_for(&self, world: usize, shard_len: usize) -> Result<Schedule, Error> {
        Ok(Schedule::for_mask(
            self.schedule,
            world,
            shard_len,
            &self.attention.mask,
        )?)
    }

    /// The concrete schedule these options mean on `world` ranks holding shards of
    /// `shard_len` tokens: `Auto` resolved for the mask's causal order and window
    /// ([`ScheduleKind::resolve_for`]).
    pub fn resolved_schedule(&self, world: usize, shard_len: usize) -> ScheduleKind {
        (self.schedule).resolve_for(world, shard_len, &self.attention.mask)
    }

    /// Where each rank's shard of `shard_len` tokens must come from on `world` ranks: shard
    /// the sequence with [`crate::sequence_parallel::shard_sequence`] (and gather outputs with
    /// [`crate::sequence_parallel::gather_sequence`]) for this layout.
    pub fn layout(&self, world: usize, shard_len: usize) -> Layout {
        self.resolved_schedule(world, shard_len).layout()
    }
}

/// Validates the shapes of q, k and v before anything runs, and returns the call's dimensions.
///
/// # Shapes
///
/// - q: `[batch, q_heads, seq_q, head_dim]`
/// - k: `[batch, kv_heads, seq_kv, head_dim]`
/// - v: `[batch, kv_heads, seq_kv, head_dim]`
///
/// # Errors
///
/// [`Error::Kernel`] with:
/// - [`KernelError::Rank`] when q, k or v does not have 4 dimensions;
/// - [`KernelError::ShapeMismatch`] when k's `batch` or `head_dim` differs from q's, or v's
///   shape differs from k's;
/// - [`KernelError::HeadGrouping`] when `q_heads` or `kv_heads` is zero, or `q_heads` is not a
///   multiple of `kv_heads`;
/// - [`KernelError::UnsupportedHeadDim`] when `head_dim` is not in
///   [`SUPPORTED_HEAD_DIMS`](crate::kernels::SUPPORTED_HEAD_DIMS);
/// - [`KernelError::BadLength`] when `batch`, `seq_q` or `seq_kv` is zero, or
///   `batch * q_heads * max(seq_q, seq_kv) * head_dim` exceeds `i32::MAX` (32-bit indexing).
pub(crate) fn check_shapes(q: &[usize], k: &[usize], v: &[usize]) -> Result<AttentionDims, Error> {
    Ok(AttentionDims::from_qkv(q, k, v)?)
}
