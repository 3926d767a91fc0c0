//! Sequence-parallel attention: one long sequence split across the ranks of a
//! [`DeviceGroup`], attention computed exactly (DistFlashAttn, paper §3.1-3.2).
//!
//! Rank `r` of `P` holds a shard of the queries, keys and values, all shards of one length,
//! at the positions the schedule's [`Layout`] gives it (the `r`-th contiguous shard, or two
//! zigzag chunks; [`shard_sequence`] and [`gather_sequence`] cut and join whole sequences).
//! [`sequence_parallel_attention`] returns the rank's shard of the output; under `Autodiff` its
//! backward runs the distributed backward, returning `dk, dv` of every chunk to its owner.
//! [`SequenceParallelOptions`] picks the mask and the schedule ([`ScheduleKind`]); the
//! [`Schedule`](crate::schedule::Schedule) decides who computes which (query chunk, key chunk)
//! pair; partial states and gradients stay f32 across hops.

mod backward;
mod forward;
mod kv_parts;
mod pair_steps;
mod pipeline;
mod sharding;

pub(crate) use backward::run as backward_pass;
pub(crate) use forward::run as forward_pass;

use crate::Error;

use std::hash::{DefaultHasher, Hash, Hasher};

use burn::tensor::{DType, Tensor, TensorPrimitive};

pub use crate::options::SequenceParallelOptions;
pub use crate::schedule::{Layout, ScheduleKind};
pub use sharding::{gather_sequence, shard_sequence};

use crate::collective::DeviceGroup;
use crate::extension::FlashAttentionBackend;
use crate::inputs::check_inputs;
use crate::options::{Documents, SlidingWindow};

fn dtype_code(dtype: DType) -> u64 {
    match dtype {
        DType::F16 => 1,
        DType::BF16 => 2,
        _ => 3,
    }
}

/// A sliding window's two reaches as agreed values (`u64::MAX` twice without a window).
fn window_code(window: Option<SlidingWindow>) -> [u64; 2] {
    window.map_or([u64::MAX; 2], |w| [w.before as u64, w.after as u64])
}

/// A fingerprint of the documents every rank must hold alike (0 without documents): a hash of
/// each batch row's boundaries, the same in every process of one build.
fn documents_fingerprint(documents: Option<&Documents>) -> u64 {
    documents.map_or(0, |d| {
        let mut hasher = DefaultHasher::new();
        d.batch_rows().hash(&mut hasher);
        for row in 0..d.batch_rows() {
            d.cu_seqlens(row).hash(&mut hasher);
        }
        hasher.finish()
    })
}

/// How many values each rank contributes to the agreement check of [`validate`].
const AGREED_VALUES: usize = 16;

/// What a rank that refused its own input contributes instead (no real first value, a batch
/// size, comes near it).
const REFUSED: u64 = u64::MAX;

/// This rank's shapes, float type and options as the values every rank must agree on, or why
/// this rank's own shards or options are not valid.
fn local_values<B: FlashAttentionBackend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    group: &DeviceGroup<B::Inner>,
    options: &SequenceParallelOptions,
) -> Result<[u64; AGREED_VALUES], Error> {
    options.attention.check()?;
    for (name, t) in [("k", k), ("v", v)] {
        if t.device() != q.device() {
            return Err(Error::Device {
                tensor: name.into(),
                expected: format!(
                    "q's device {:?} (a rank's q, k and v are on its device)",
                    q.device()
                ),
                got: format!("{:?}", t.device()),
            });
        }
    }
    check_inputs(q, k, v, &options.attention)?;
    if B::inner_device(&q.device()) != *group.device() {
        return Err(Error::Device {
            tensor: "q".into(),
            expected: format!(
                "{:?}, the device rank {} of its group computes on",
                group.device(),
                group.rank()
            ),
            got: format!("{:?}", q.device()),
        });
    }
    let (qd, kd) = (q.dims(), k.dims());
    if qd[2] != kd[2] {
        return Err(Error::Shape {
            tensor: "k's shard".into(),
            expected: format!(
                "{} rows, the length of q's shard (each rank owns the same positions of q, k and v)",
                qd[2]
            ),
            got: format!("{kd:?}"),
        });
    }
    let world = group.world_size();
    let mask = &options.attention.mask;
    let schedule = options.resolved_schedule(world, qd[2]);
    (schedule.layout()).check_shard_len(world, qd[2])?;
    mask.check_sequence(world * qd[2])?;
    options.check_backward_parts(world, qd[2])?;
    let schedule = schedule as u64;
    let scale = (options.attention.scale).map_or(u64::MAX, |s| u64::from(s.to_bits()));
    let [before, after] = window_code(mask.window);
    Ok([
        qd[0] as u64,
        qd[1] as u64,
        kd[1] as u64,
        qd[2] as u64,
        kd[2] as u64,
        qd[3] as u64,
        dtype_code(q.dtype()),
        mask.causal as u64,
        scale,
        schedule,
        options.overlap as u64,
        before,
        after,
        documents_fingerprint(mask.documents.as_ref()),
        options.attention.deterministic as u64,
        options.backward_parts as u64,
    ])
}

/// Tells the other ranks of `group` that this rank refused its input before attention, so that
/// their [`validate`] fails at once instead of waiting for this rank until the group's timeout.
pub(crate) fn announce_refusal<I: burn::tensor::backend::Backend>(group: &DeviceGroup<I>) {
    // Every rank is in the same all-gather; its outcome adds nothing to this rank's own error.
    let _ = group.all_gather_values(&[REFUSED; AGREED_VALUES]);
}

/// Checks this rank's shards and options, then that every rank has the same shapes, float type
/// and options. A rank that refuses its own input still takes part in the agreement check, so
/// every other rank fails at once too (naming it) rather than waiting for it.
fn validate<B: FlashAttentionBackend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    group: &DeviceGroup<B::Inner>,
    options: &SequenceParallelOptions,
) -> Result<(), Error> {
    let local = local_values(q, k, v, group, options);
    let gathered = group.all_gather_values(local.as_ref().unwrap_or(&[REFUSED; AGREED_VALUES]));
    let mine = local?;
    let all = gathered?;
    if let Some(other) = all.iter().position(|m| m[0] == REFUSED) {
        return Err(Error::PeerRefused {
            rank: group.rank(),
            peer: other,
        });
    }
    let describe = |m: &[u64]| {
        let window = match (m[11], m[12]) {
            (u64::MAX, u64::MAX) => "none".to_string(),
            (before, after) => format!("{before} before, {after} after"),
        };
        format!(
            "q [{}, {}, {}, {}], k/v [{}, {}, {}, {}], dtype code {}, causal {}, scale bits {:#x}, \
             schedule {}, overlap {}, window {window}, documents fingerprint {:#x}, \
             deterministic {}, backward parts {}",
            m[0],
            m[1],
            m[3],
            m[5],
            m[0],
            m[2],
            m[4],
            m[5],
            m[6],
            m[7],
            m[8],
            m[9],
            m[10],
            m[13],
            m[14],
            m[15]
        )
    };
    if let Some((other, theirs)) = all.iter().enumerate().find(|(_, m)| m[..] != mine[..]) {
        return Err(Error::RanksDisagree {
            rank: group.rank(),
            peer: other,
            mine: describe(&mine),
            theirs: describe(theirs),
        });
    }
    Ok(())
}

/// This rank's shard of exact attention over the whole sequence split across `group`.
///
/// Each of the `P` ranks holds `shard_len` positions of a sequence of `P * shard_len` tokens,
/// which ones given by the schedule's [`Layout`] ([`SequenceParallelOptions::layout`]: rank `r`
/// holds `r * shard_len .. (r + 1) * shard_len` under the contiguous layout; [`shard_sequence`]
/// cuts a whole sequence for any layout). Every rank must call this with shards of one shape
/// (checked; zigzag needs an even `shard_len`). Returns O for the rank's positions.
///
/// The mask is `options.attention`'s over the whole sequence: causal order, a sliding window and
/// documents at absolute positions (`0..P * shard_len`). Every rank passes the same options,
/// documents included (each rank holds the documents of the whole sequence, not its shard's;
/// checked): from them every rank derives the same schedule, in which a pair of shards with no
/// visible score is neither computed nor exchanged. Differentiable under `Autodiff`: the backward
/// is distributed too, so every rank must run its backward (where a communication failure panics,
/// since a backward pass cannot return an error).
///
/// # Shapes
///
/// - q: `[batch, q_heads, shard_len, head_dim]`
/// - k: `[batch, kv_heads, shard_len, head_dim]`
/// - v: `[batch, kv_heads, shard_len, head_dim]`
/// - output: `[batch, q_heads, shard_len, head_dim]`
///
/// # Errors
///
/// - [`Error::Kernel`] with [`KernelError::BadOption`](crate::kernels::KernelError::BadOption)
///   when `options.attention.scale` is not a finite number.
/// - [`Error::Device`] when k or v is not on q's device, or q's device is not the
///   device of this rank of `group`.
/// - [`Error::Kernel`] or [`Error::DType`] when this rank's shards are not valid inputs of
///   [`crate::flash_attention`] (shapes, float types, the device's limits).
/// - [`Error::Shape`] when q and k have different `shard_len`s; [`Error::PeerRefused`] when
///   another rank refused its own input; [`Error::RanksDisagree`] when the ranks disagree on
///   shapes, float type or options.
/// - [`Error::Layout`] when `shard_len` does not fit the schedule's layout (zigzag:
///   an odd length); [`Error::Config`] when `options.backward_parts` is 0 or does not divide
///   the rows of a layout chunk.
/// - [`Error::Kernel`] with [`KernelError::BadMask`](crate::kernels::KernelError::BadMask)
///   when the documents do not cover exactly the `P * shard_len` positions of the sequence;
///   [`Error::RanksDisagree`] when ranks pass different windows or documents.
/// - The collective layer's errors ([`Error::is_collective`]: a timeout, a mismatch, a
///   departed peer, a broken group, NCCL) when the ranks' agreement check or the exchange of
///   chunks between the ranks fails.
///
/// # Panics
///
/// As [`crate::flash_attention`]: on the CubeCL backends, when a kernel launch fails after the
/// checks passed.
pub fn sequence_parallel_attention<B: FlashAttentionBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    group: &DeviceGroup<B::Inner>,
    options: &SequenceParallelOptions,
) -> Result<Tensor<B, 4>, Error> {
    sequence_parallel_attention_with_lse(q, k, v, group, options).map(|(out, _)| out)
}

/// [`sequence_parallel_attention`] that also returns the rank's rows' log-sum-exp (no
/// gradient).
///
/// # Shapes
///
/// - q: `[batch, q_heads, shard_len, head_dim]`
/// - k: `[batch, kv_heads, shard_len, head_dim]`
/// - v: `[batch, kv_heads, shard_len, head_dim]`
/// - output: `[batch, q_heads, shard_len, head_dim]`
/// - lse: `[batch, q_heads, shard_len]`
///
/// # Errors
///
/// As [`sequence_parallel_attention`].
///
/// # Panics
///
/// As [`sequence_parallel_attention`].
pub fn sequence_parallel_attention_with_lse<B: FlashAttentionBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    group: &DeviceGroup<B::Inner>,
    options: &SequenceParallelOptions,
) -> Result<(Tensor<B, 4>, Tensor<B, 3>), Error> {
    validate(&q, &k, &v, group, options)?;
    let (out, lse) = B::sequence_parallel_attention(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        group,
        options,
    )?;
    Ok((
        Tensor::from_primitive(TensorPrimitive::Float(out)),
        Tensor::from_primitive(TensorPrimitive::Float(lse)),
    ))
}
