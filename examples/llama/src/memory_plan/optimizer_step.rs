//! [`OptimizerStepMemory`]: what one GPU holds at the busiest moment of an optimizer step, term
//! by term, from the state's counts alone (pure arithmetic, read off the optimizer's code), and
//! the step's single buffers by size.
//!
//! With `n` parameter elements padded to `P s` (`s` each rank's share), weights of `w` bytes
//! (`w = 2n` in bf16, `w/n` bytes an element on the wire), buckets of `k` elements of each share
//! (`min(bucket, s)`, the gradient sum's byte budget over `4P`) and chunks of `c` elements of
//! state (`min(chunk, s)`), a sharded step (`ShardedAdamW::step`) holds:
//!
//! | term | one GPU | a group |
//! |---|---|---|
//! | weights, and the updated weights beside them | `2w` | `2w` |
//! | the backward's gradients | `w` | `w` |
//! | f32 copies of one bucket's gradients (none of f32 ones) | 0 | `4Pk` |
//! | one bucket end to end, and its sum | 0 | `4Pk + 4k` |
//! | the summed share, one tensor a bucket | 0 | `4s` |
//! | optimizer state on the GPU: its chunks, or two of them when in host memory | `12s` or `24c` | `12s` or `24c` |
//! | a chunk's f32 gradient, its cast weights (gathered over the group) | `4c + (w/n) c` | `4c + (w/n) c P` |
//!
//! Where they come from: on a group the summed share is made bucket by bucket
//! (`summed_share`): for each bucket the same `k` elements of every rank's share are read from
//! the gradients in f32 (each parameter's part cast on its own: `4Pk`) and concatenated (`4Pk`);
//! stage 2 reduce-scatters that into `k` elements of its own (`4k`), stage 1 all-reduces it (in
//! place over NCCL, which gets the only handle) and copies its `k` out (`4k`); each bucket's sum
//! stays a tensor of its own (`4s` in all). On one GPU each chunk's gradient is read from the
//! parameters' gradients (no f32 share). The state is in chunks wherever it lives; the update
//! (`AdamWSettings::update_vectors`) is one fused CUDA kernel per chunk that writes the chunk's
//! master weights and moments over themselves, so it makes no vector beside the state and the
//! chunk's gradient. Under `DISTFLASH_UNFUSED_OPTIMIZER=1` Burn's element-wise operations run
//! instead, which make one temporary of the chunk (`4c` more than counted here). Each chunk's
//! updated weights are cast and on a group all-gathered, in pieces of at most
//! `MAX_STEP_BUFFER_BYTES` (`WeightWriter`), while the trainer still holds the old weights.
//!
//! No single buffer of the step is larger than `MAX_STEP_BUFFER_BYTES` (256 MiB) but the
//! model's own tensors: none reaches the top size class of CubeCL's CUDA pools on a GPU of 16 GiB
//! or more. The terms are added although some are never alive together (a bucket's copies are
//! freed once concatenated): CUDA's pools serve each size from pages of its own class and keep
//! freed pages, so memory freed by buffers of one size (a bucket's) does not serve the next
//! buffers of another (the model's). A replicated step (stage 0) updates one parameter at a
//! time, its transients the size of one parameter (not counted): its terms are the weights, the
//! gradients and the moments (`4w`).

use std::fmt;

use crate::optimizer::{bucket_elements, chunk_elements, gather_elements, MAX_STEP_BUFFER_BYTES};
use crate::train::MemoryReport;

/// Bytes of f32.
const F32: u64 = 4;

/// The bytes an optimizer step holds on one GPU at its busiest (see the module's
/// documentation for the terms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptimizerStepMemory {
    /// The weights the step starts from, held by the trainer until the step returns.
    pub weights: u64,
    /// The updated weights, made while the old ones are held (0 at stage 0: updated in place).
    pub updated_weights: u64,
    /// The backward's gradients, in the weights' types.
    pub gradients: u64,
    /// The f32 copies of one bucket's gradient pieces, made to lay them end to end.
    pub gradient_copies: u64,
    /// One bucket of the gradient sum: every rank's range of it end to end, and its sum.
    pub bucket: u64,
    /// The summed share of the gradients, one tensor a bucket (the update writes the state in
    /// place: no temporary of its size).
    pub share: u64,
    /// The optimizer state on the GPU: replicated moments, the f32 share's chunks, or two
    /// chunks of it.
    pub state: u64,
    /// One chunk's transients: its f32 gradient, its updated weights cast (and gathered over
    /// the group).
    pub chunk: u64,
    /// How a sharded step cuts its vectors (`None` at stage 0), for its single buffers.
    cuts: Option<Cuts>,
}

/// How a sharded step cuts its flat vectors, in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cuts {
    /// Ranks of the group.
    world: u64,
    /// Each rank's share.
    share: u64,
    /// A bucket of each share (0 on one GPU: no bucket).
    bucket: u64,
    /// A chunk of state.
    chunk: u64,
    /// A piece of a chunk's updated weights, one all-gather.
    gather: u64,
    /// Bytes of a weight element on the wire.
    wire: u64,
    /// Whether the state lives in host memory (two chunks on the GPU).
    on_host: bool,
}

impl OptimizerStepMemory {
    /// The step's terms for the counts of `report` (a sharded state in host memory when
    /// `report.host_optimizer > 0`), the state in chunks of `chunk_bytes` of state, the
    /// gradients summed in buckets of `bucket_bytes` of f32.
    pub fn of(report: &MemoryReport, chunk_bytes: u64, bucket_bytes: u64) -> Self {
        let w = report.weights;
        if !report.stage.is_sharded() {
            return Self {
                weights: w,
                updated_weights: 0,
                gradients: report.gradients,
                gradient_copies: 0,
                bucket: 0,
                share: 0,
                state: report.optimizer,
                chunk: 0,
                cuts: None,
            };
        }
        let world = report.world.max(1) as u64;
        let share = (report.parameters as u64).div_ceil(world);
        // Bytes of one weight element as the updated weights travel (the weights' own type).
        let wire = w.div_ceil((report.parameters as u64).max(1));
        let summed = match world > 1 {
            true => SummedShare::of(world, share, bucket_bytes, wire),
            false => SummedShare::NONE,
        };
        let chunk = (chunk_elements(chunk_bytes) as u64).min(share);
        let cuts = Cuts {
            world,
            share,
            bucket: summed.k,
            chunk,
            gather: (gather_elements(MAX_STEP_BUFFER_BYTES, wire as usize, world as usize) as u64)
                .min(chunk),
            wire,
            on_host: report.host_optimizer > 0,
        };
        Self {
            weights: w,
            updated_weights: w,
            gradients: report.gradients,
            gradient_copies: summed.copies,
            bucket: summed.bucket,
            share: summed.share,
            state: report.optimizer,
            chunk: F32 * chunk + wire * chunk * world,
            cuts: Some(cuts),
        }
    }

    /// The step's f32 vectors of the gradient sum (a bucket's copies, the bucket and its sum,
    /// the summed share): the buffers whose pool
    /// pages the next backward inherits (see the planner's pool slack).
    pub fn f32_vectors(&self) -> u64 {
        self.gradient_copies + self.bucket + self.share
    }

    /// Every term together: the step's bytes on the GPU.
    pub fn total(&self) -> u64 {
        self.weights
            + self.updated_weights
            + self.gradients
            + self.gradient_copies
            + self.bucket
            + self.share
            + self.state
            + self.chunk
    }

    /// The single buffers of a sharded state on the GPU, by size: each chunk's three f32
    /// vectors, or two chunks' when the state lives in host memory (none at stage 0: per
    /// parameter).
    pub(crate) fn state_buffers(&self) -> Vec<u64> {
        let Some(cuts) = self.cuts else {
            return Vec::new();
        };
        let chunks = match cuts.on_host {
            true => vec![cuts.chunk; 2],
            false => lengths(cuts.share, cuts.chunk),
        };
        (chunks.into_iter()).flat_map(|c| [F32 * c; 3]).collect()
    }

    /// The step's own single buffers, by size (none at stage 0): on a group the summed share's
    /// buckets, one bucket end to end and its sum; one chunk's f32 gradient and cast weights;
    /// the updated weights' pieces (gathered over the group). The per-parameter tensors (a
    /// bucket's f32 copies, a parameter's updated value) are left out.
    pub(crate) fn step_buffers(&self) -> Vec<u64> {
        let Some(cuts) = self.cuts else {
            return Vec::new();
        };
        let mut buffers = Vec::new();
        if cuts.bucket > 0 {
            let buckets = lengths(cuts.share, cuts.bucket);
            buffers.extend(buckets.iter().map(|k| F32 * k));
            buffers.extend([F32 * cuts.world * cuts.bucket, F32 * cuts.bucket]);
        }
        buffers.extend([F32 * cuts.chunk, cuts.wire * cuts.chunk]);
        for chunk in lengths(cuts.share, cuts.chunk) {
            let pieces = lengths(chunk, cuts.gather);
            buffers.extend(pieces.iter().map(|g| cuts.wire * g * cuts.world));
        }
        buffers
    }
}

/// The lengths of `len` elements cut into pieces of `piece` (the last one shorter).
fn lengths(len: u64, piece: u64) -> Vec<u64> {
    let piece = piece.max(1);
    (0..len.div_ceil(piece))
        .map(|i| piece.min(len - i * piece))
        .collect()
}

/// The bytes of making the summed share bucket by bucket on a group (see the module's
/// documentation).
struct SummedShare {
    /// Elements of each share a bucket sums (0: no bucket, one GPU).
    k: u64,
    /// One bucket's f32 copies of the gradient pieces.
    copies: u64,
    /// One bucket end to end and its sum.
    bucket: u64,
    /// The share, its buckets' sums.
    share: u64,
}

impl SummedShare {
    /// One GPU's: none (its chunks' gradients are read from the parameters' gradients).
    const NONE: Self = Self {
        k: 0,
        copies: 0,
        bucket: 0,
        share: 0,
    };

    /// The summed share of `share` elements over `world` ranks, in buckets of `bucket_bytes`,
    /// from gradients of `wire` bytes an element.
    fn of(world: u64, share: u64, bucket_bytes: u64, wire: u64) -> Self {
        let k = (bucket_elements(bucket_bytes, world as usize) as u64).min(share);
        let gathered = F32 * world * k;
        // A cast to the type a tensor already has is the tensor itself: f32 gradients are laid
        // end to end as they are.
        let copies = if wire < F32 { gathered } else { 0 };
        // Stage 2's reduce-scatter writes a bucket's share of its own; stage 1's all-reduce sums
        // in place and its share is copied out.
        Self {
            k,
            copies,
            bucket: gathered + F32 * k,
            share: F32 * share,
        }
    }
}

impl fmt::Display for OptimizerStepMemory {
    /// `total = weights + ...`, the terms that are not zero, named.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = crate::format_bytes;
        write!(f, "{} = weights {}", b(self.total()), b(self.weights))?;
        let terms = [
            ("updated weights", self.updated_weights),
            ("gradients", self.gradients),
            ("a bucket's f32 copies", self.gradient_copies),
            ("f32 bucket and its sum", self.bucket),
            ("summed f32 share", self.share),
            ("state", self.state),
            ("chunk transients", self.chunk),
        ];
        for (name, bytes) in terms.into_iter().filter(|&(_, bytes)| bytes > 0) {
            write!(f, " + {name} {}", b(bytes))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optimizer::{StatePlacement, ZeroStage};

    /// 16 KiB of f32 per bucket: 2048 elements of each share on two GPUs, 1024 on three (1365
    /// rounded down to the alignment).
    const BUCKET: u64 = 16 << 10;

    /// 10,000 bf16 parameters (20,000 bytes) over `world` ranks at `stage`, the state at
    /// `placement` in chunks of 12 x 1024 bytes (1024 elements), buckets of `bucket` bytes.
    fn step(
        world: usize,
        stage: ZeroStage,
        placement: StatePlacement,
        bucket: u64,
    ) -> OptimizerStepMemory {
        let report =
            MemoryReport::for_parameters(10_000, 20_000, world, stage).placed(placement, 12 * 1024);
        OptimizerStepMemory::of(&report, 12 * 1024, bucket)
    }

    #[test]
    fn a_replicated_step_holds_weights_gradients_and_moments() {
        let s = step(2, ZeroStage::Replicated, StatePlacement::Gpu, BUCKET);
        assert_eq!((s.weights, s.gradients, s.state), (20_000, 20_000, 40_000));
        assert_eq!(s.total(), 80_000);
        assert!(s.state_buffers().is_empty() && s.step_buffers().is_empty());
    }

    #[test]
    fn a_device_state_adds_the_updated_weights_a_chunk_and_on_a_group_a_bucket_and_the_share() {
        // One GPU, share 10,000: no bucket and no share (each chunk's gradient read from the
        // parameters' gradients); one chunk's f32 gradient (4 x 1024) and bf16 weights (2 x
        // 1024); the update in place, no temporary.
        for bucket in [BUCKET, 1 << 30] {
            let one = step(1, ZeroStage::OptimizerStates, StatePlacement::Gpu, bucket);
            assert_eq!((one.gradient_copies, one.bucket, one.share), (0, 0, 0));
            assert_eq!((one.state, one.chunk), (120_000, 6144));
            assert_eq!(one.total(), 3 * 20_000 + 120_000 + 6144);
        }
        // Three GPUs: share 3334, buckets of 1024 of every share (4 x 3 x 1024 = 12,288 end to
        // end), summed into 1024 of its own (stage 2) or copied out of the all-reduced bucket
        // (stage 1); a chunk's weights gathered from the three ranks (2 x 3 x 1024).
        let second = step(3, ZeroStage::Gradients, StatePlacement::Gpu, BUCKET);
        let first = step(3, ZeroStage::OptimizerStates, StatePlacement::Gpu, BUCKET);
        assert_eq!(first, second, "the stages hold the same");
        assert_eq!(
            (second.gradient_copies, second.bucket),
            (12_288, 12_288 + 4096)
        );
        assert_eq!((second.share, second.state), (13_336, 12 * 3334));
        assert_eq!(second.chunk, 4096 + 6144);
        assert_eq!(
            second.total(),
            60_000 + 12_288 + 16_384 + 13_336 + 40_008 + 10_240
        );
    }

    #[test]
    fn a_host_state_streams_chunks_and_on_a_group_sums_its_share_in_buckets() {
        // One GPU: no f32 copy; two chunks of 1024 elements on the device, one chunk's
        // gradient (4 x 1024; the update in place) and its bf16 weights (2 x 1024).
        let one = step(1, ZeroStage::OptimizerStates, StatePlacement::Host, BUCKET);
        assert_eq!((one.gradient_copies, one.bucket, one.share), (0, 0, 0));
        assert_eq!((one.state, one.chunk), (24_576, 4096 + 2048));
        assert_eq!(one.total(), 60_000 + 24_576 + 6144);
        // Two GPUs, share 5000, buckets of 2048: 4 x 2 x 2048 copied and end to end, summed
        // into 2048 (or copied out of it); the share (20,000); each chunk's gradient and its
        // weights gathered from both.
        let second = step(2, ZeroStage::Gradients, StatePlacement::Host, BUCKET);
        assert_eq!((second.gradient_copies, second.bucket), (16_384, 24_576));
        assert_eq!(second.share, 20_000);
        assert_eq!((second.state, second.chunk), (24_576, 4096 + 4096));
        assert_eq!(
            second.total(),
            60_000 + 16_384 + 24_576 + 20_000 + 24_576 + 8192
        );
    }

    #[test]
    fn f32_gradients_need_no_f32_copies() {
        let report = MemoryReport::for_parameters(10_000, 40_000, 2, ZeroStage::Gradients);
        let s = OptimizerStepMemory::of(&report, 12 * 1024, 1 << 30);
        // One bucket of each 5000-element share: both shares end to end (40,000) and the
        // reduce-scattered sum (20,000), kept as the share's one bucket (20,000).
        assert_eq!((s.gradient_copies, s.bucket, s.share), (0, 60_000, 20_000));
        assert_eq!(s.chunk, 4096 + 4 * 1024 * 2);
        assert_eq!(s.total(), 3 * 40_000 + 60_000 + 20_000 + 12 * 5000 + 12_288);
    }

    #[test]
    fn the_single_buffers_are_the_chunks_the_buckets_and_the_gathered_pieces() {
        // Three GPUs, share 3334: chunks of 1024 (three full, one of 262), buckets of 1024.
        let s = step(3, ZeroStage::Gradients, StatePlacement::Gpu, BUCKET);
        let state = s.state_buffers();
        assert_eq!(state.len(), 12);
        assert_eq!(state.iter().sum::<u64>(), s.state);
        assert_eq!(state[9..], [4 * 262; 3]);
        let own = s.step_buffers();
        // The share's four buckets, the bucket end to end and its sum, a chunk's gradient and
        // cast weights, and each chunk's weights gathered from the three ranks.
        let buckets = [4096, 4096, 4096, 4 * 262];
        let gathered = [6 * 1024, 6 * 1024, 6 * 1024, 6 * 262];
        let want = [&buckets[..], &[12_288, 4096, 4096, 2048], &gathered[..]].concat();
        assert_eq!(own, want);
        assert_eq!(own[..4].iter().sum::<u64>(), s.share);
        // In host memory: two chunks of the state.
        let host = step(3, ZeroStage::Gradients, StatePlacement::Host, BUCKET);
        assert_eq!(host.state_buffers(), [4096; 6]);
    }

    #[test]
    fn seven_b_keeps_every_buffer_of_its_step_within_the_bound_at_any_world_size() {
        // LLaMA-7B's 6,738,415,616 bf16 parameters, the default 512 MiB chunks of state and
        // 256 MiB buckets.
        let n: u64 = 6_738_415_616;
        let c = chunk_elements(512 << 20) as u64;
        for world in [1, 2, 4, 8] {
            for placement in [StatePlacement::Gpu, StatePlacement::Host] {
                let report =
                    MemoryReport::for_parameters(n as usize, 2 * n, world, ZeroStage::Gradients)
                        .placed(placement, 512 << 20);
                let s = OptimizerStepMemory::of(&report, 512 << 20, 256 << 20);
                let buffers = [s.state_buffers(), s.step_buffers()].concat();
                let largest = buffers.iter().copied().max().unwrap();
                assert!(
                    largest <= MAX_STEP_BUFFER_BYTES,
                    "{world} GPU(s), {placement}"
                );
                let share = n.div_ceil(world as u64);
                let f32_state = match placement {
                    StatePlacement::Gpu => 12 * share,
                    StatePlacement::Host => 24 * c,
                };
                assert_eq!(s.state, f32_state);
                assert_eq!(s.chunk, 4 * c + 2 * c * world as u64);
            }
        }
        // Two GPUs, the state on the GPU: 32 Mi elements of each share a bucket; the share
        // (13.48 GB) in 100 buckets of 128 MiB (and a bucket's sum as large) and one of
        // 52.5 MiB, the state in chunks of 170.66 MiB a vector.
        let report = MemoryReport::for_parameters(n as usize, 2 * n, 2, ZeroStage::Gradients);
        let s = OptimizerStepMemory::of(&report, 512 << 20, 256 << 20);
        let (share, k) = (n / 2, 32u64 << 20);
        assert_eq!((s.gradient_copies, s.bucket), (8 * k, 8 * k + 4 * k));
        assert_eq!(s.share, 4 * share);
        assert_eq!(s.share, 13_476_831_232);
        assert_eq!(s.total(), 6 * n + 20 * k + 16 * share + 8 * c);
        assert_eq!(
            s.step_buffers().iter().filter(|&&b| b == 4 * k).count(),
            100 + 1
        );
    }

    #[test]
    fn the_report_names_every_term_held() {
        let text = step(3, ZeroStage::OptimizerStates, StatePlacement::Gpu, BUCKET).to_string();
        for name in [
            "weights",
            "updated weights",
            "f32 copies",
            "f32 bucket",
            "summed f32 share",
            "state",
            "chunk transients",
        ] {
            assert!(text.contains(name), "{name}: {text}");
        }
        let one = step(1, ZeroStage::OptimizerStates, StatePlacement::Gpu, BUCKET).to_string();
        assert!(!one.contains("bucket") && !one.contains("share"), "{one}");
    }
}
