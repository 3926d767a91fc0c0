//! [`OptimizerStepMemory`]: what one GPU holds at the busiest moment of an optimizer step, term
//! by term, from the state's counts alone (pure arithmetic, read off the optimizer's code).
//!
//! With `n` parameter elements padded to `P s` (`s` each rank's share), weights of `w` bytes
//! (`w = 2n` in bf16), buckets of `k` elements of each share (`min(bucket, s)`, the gradient
//! sum's byte budget over `4P`) and chunks of `c` elements (`min(chunk, s)`), a sharded step
//! (`ShardedAdamW::step`) holds:
//!
//! | term | state on the GPU | state in host memory, one GPU | in host memory, a group |
//! |---|---|---|---|
//! | weights, and the updated weights beside them | `2w` | `2w` | `2w` |
//! | the backward's gradients | `w` | `w` | `w` |
//! | f32 copies of one bucket's gradients (none of f32 ones) | `4Pk` | 0 | `4Pk` |
//! | one bucket end to end, and its sum | `4Pk + 4k` (stage 2), `4Pk` (stage 1), `4k` (one GPU) | 0 | as on the GPU |
//! | the summed share | `4s` | 0 | `4s` |
//! | optimizer state | `12s` | two chunks, `24c` | `24c` |
//! | a chunk's gradient, cast weights | 0 | `4c + (w/n) c` | `4c + (w/n) c P` |
//!
//! Where they come from: the summed share is made bucket by bucket (`summed_share`): for each
//! bucket the same `k` elements of every rank's share are read from the gradients in f32 (each
//! parameter's part cast on its own: `4Pk`) and concatenated (`4Pk`); stage 2 reduce-scatters
//! that into `k` elements of its own (`4k`), stage 1 all-reduces it (in place over NCCL, which
//! gets the only handle) and keeps its `k`; on one GPU the concatenation is the bucket's share. Each bucket's sum is written into the share
//! (`4s`, allocated once); with a single bucket whose sum is a tensor of its own (one GPU, or
//! stage 2) that sum is the share. The update (`AdamWSettings::update`) is one fused CUDA kernel
//! that writes the master weights and moments over themselves (the optimizer holds their only
//! handles), so it makes no vector beside the state and the summed gradient (the clipping scales
//! the gradient in place too). Under `DISTFLASH_UNFUSED_OPTIMIZER=1` Burn's element-wise operations
//! run instead, which make one temporary of the share beside the summed gradient (`4s` more than
//! counted here). The updated weights are cast (and on a group all-gathered) into one new vector
//! of the model's size while the trainer still holds the old weights. A host-resident state
//! streams chunk by chunk: the same update over a chunk, in place, its f32 gradient read from
//! the parameters' gradients on one GPU (held whole until the pass ends) or from the summed share
//! on a group (a range of it, clipped into a chunk of its own), and its updated weights written parameter by parameter (`WeightWriter`).
//!
//! The terms are added although some are never alive together (a bucket's copies are freed once
//! concatenated, the temporaries before the updated weights are made): CUDA's pools serve each
//! size from pages of its own class and keep freed pages, so memory freed by buffers of one size
//! (a bucket's, the share's) does not serve the next buffers of another (the model's). A
//! replicated step (stage 0) updates one parameter at a time, its transients the size of one
//! parameter (not counted): its terms are the weights, the gradients and the moments (`4w`).

use std::fmt;

use crate::optimizer::{bucket_elements, chunk_elements, ZeroStage};
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
    /// The summed share of the gradients (the update writes the state in place: no temporary
    /// of its size).
    pub share: u64,
    /// The optimizer state on the GPU: replicated moments, the f32 share, or two chunks of it.
    pub state: u64,
    /// A host-resident state's chunk: its f32 gradient, its updated weights cast (and gathered
    /// over the group).
    pub chunk: u64,
}

impl OptimizerStepMemory {
    /// The step's terms for the counts of `report` (a sharded state in host memory when
    /// `report.host_optimizer > 0`), a host-resident state streamed in chunks of `chunk_bytes`
    /// of state, the gradients summed in buckets of `bucket_bytes` of f32.
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
            };
        }
        let world = report.world.max(1) as u64;
        let share = (report.parameters as u64).div_ceil(world);
        let on_host = report.host_optimizer > 0;
        // Bytes of one weight element as the updated weights travel (the weights' own type).
        let wire = w.div_ceil((report.parameters as u64).max(1));
        let summed = SummedShare::of(report.stage, world, share, bucket_bytes, wire);
        let (gradient_copies, bucket, share_vectors, chunk) = match (on_host, world > 1) {
            (false, _) => (summed.copies, summed.bucket, summed.share, 0),
            (true, false) => (0, 0, 0, chunk_transients(chunk_bytes, share, wire, 1)),
            (true, true) => (
                summed.copies,
                summed.bucket,
                summed.share,
                chunk_transients(chunk_bytes, share, wire, world),
            ),
        };
        Self {
            weights: w,
            updated_weights: w,
            gradients: report.gradients,
            gradient_copies,
            bucket,
            share: share_vectors,
            state: report.optimizer,
            chunk,
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
}

/// The bytes of making the summed share bucket by bucket (see the module's documentation).
struct SummedShare {
    /// One bucket's f32 copies of the gradient pieces.
    copies: u64,
    /// One bucket end to end and its sum.
    bucket: u64,
    /// The share the buckets' sums are written into (0 when the one bucket's sum is it).
    share: u64,
}

impl SummedShare {
    /// The summed share of `share` elements over `world` ranks at `stage`, in buckets of
    /// `bucket_bytes`, from gradients of `wire` bytes an element.
    fn of(stage: ZeroStage, world: u64, share: u64, bucket_bytes: u64, wire: u64) -> Self {
        let k = (bucket_elements(bucket_bytes, world as usize) as u64).min(share);
        let gathered = F32 * world * k;
        // A cast to the type a tensor already has is the tensor itself: f32 gradients are laid
        // end to end as they are.
        let copies = if wire < F32 { gathered } else { 0 };
        // Stage 2's reduce-scatter writes a bucket's share of its own; stage 1's all-reduce sums
        // in place.
        let all_reduced = world > 1 && stage != ZeroStage::Gradients;
        let sum = match world > 1 && !all_reduced {
            true => F32 * k,
            false => 0,
        };
        let share_is_the_sum = k == share && !all_reduced;
        Self {
            copies,
            bucket: gathered + sum,
            share: if share_is_the_sum { 0 } else { F32 * share },
        }
    }
}

/// Bytes of one chunk's transients (`min(chunk, share)` elements): its f32 gradient (the update
/// runs in place) and its updated weights cast to `wire` bytes an element, gathered over `world`
/// ranks.
fn chunk_transients(chunk_bytes: u64, share: u64, wire: u64, world: u64) -> u64 {
    let c = (chunk_elements(chunk_bytes) as u64).min(share);
    F32 * c + wire * c * world
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
    use crate::optimizer::StatePlacement;

    /// 16 KiB of f32 per bucket: 4096 elements of the share on one GPU, 2048 on two, 1024 on
    /// three (1365 rounded down to the alignment).
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
    }

    #[test]
    fn a_device_state_adds_one_bucket_the_share_and_the_updated_weights() {
        // One GPU, share 10,000, buckets of 4096: the bucket's copies and its concatenation
        // (4 x 4096 each, no collective), the share (40,000); the update in place, no
        // temporary.
        let one = step(1, ZeroStage::OptimizerStates, StatePlacement::Gpu, BUCKET);
        assert_eq!((one.gradient_copies, one.bucket), (16_384, 16_384));
        assert_eq!((one.share, one.state), (40_000, 120_000));
        assert_eq!(one.total(), 3 * 20_000 + 32_768 + 40_000 + 120_000);
        // One bucket of the whole share: the concatenation is the share.
        let whole = step(1, ZeroStage::OptimizerStates, StatePlacement::Gpu, 1 << 30);
        assert_eq!((whole.gradient_copies, whole.bucket), (40_000, 40_000));
        assert_eq!(whole.share, 0);
        assert_eq!(whole.total(), 3 * 20_000 + 80_000 + 120_000);
        // Three GPUs: share 3334, buckets of 1024 of every share (4 x 3 x 1024 = 12,288 end to
        // end), summed into 1024 of its own (stage 2) or in place (stage 1).
        let second = step(3, ZeroStage::Gradients, StatePlacement::Gpu, BUCKET);
        let first = step(3, ZeroStage::OptimizerStates, StatePlacement::Gpu, BUCKET);
        for s in [&first, &second] {
            assert_eq!(s.gradient_copies, 12_288);
            assert_eq!((s.share, s.state), (13_336, 12 * 3334));
        }
        assert_eq!((second.bucket, first.bucket), (12_288 + 4096, 12_288));
        assert_eq!(second.total(), 60_000 + 12_288 + 16_384 + 13_336 + 40_008);
        assert_eq!(first.total(), second.total() - 4096);
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
        // into 2048 (stage 2) or in place (stage 1); the share (20,000); each chunk's
        // gradient and its weights gathered from both.
        let first = step(2, ZeroStage::OptimizerStates, StatePlacement::Host, BUCKET);
        let second = step(2, ZeroStage::Gradients, StatePlacement::Host, BUCKET);
        assert_eq!((first.gradient_copies, first.bucket), (16_384, 16_384));
        assert_eq!((second.gradient_copies, second.bucket), (16_384, 24_576));
        assert_eq!((first.share, second.share), (20_000, 20_000));
        assert_eq!((second.state, second.chunk), (24_576, 4096 + 4096));
        assert_eq!(
            second.total(),
            60_000 + 16_384 + 24_576 + 20_000 + 24_576 + 8192
        );
    }

    #[test]
    fn f32_gradients_need_no_f32_copies_and_one_bucket_reduce_scattered_is_the_share() {
        let report = MemoryReport::for_parameters(10_000, 40_000, 2, ZeroStage::Gradients);
        let s = OptimizerStepMemory::of(&report, 12 * 1024, 1 << 30);
        // Both shares end to end (40,000) and the reduce-scattered sum (20,000), which is the
        // share; no temporary beside it (the update runs in place).
        assert_eq!((s.gradient_copies, s.bucket, s.share), (0, 60_000, 0));
        assert_eq!(s.total(), 3 * 40_000 + 60_000 + 12 * 5000);
    }

    #[test]
    fn seven_b_on_two_gpus_holds_half_a_gib_of_buckets_instead_of_the_whole_f32_gradient() {
        // LLaMA-7B's 6,738,415,616 bf16 parameters at ZeRO 2 on two GPUs, the default 256 MiB
        // buckets: 32 Mi elements of each share; a share of 3,369,207,808.
        let n: u64 = 6_738_415_616;
        let report = MemoryReport::for_parameters(n as usize, 2 * n, 2, ZeroStage::Gradients);
        let s = OptimizerStepMemory::of(&report, 512 << 20, 256 << 20);
        let (share, k) = (n / 2, 32u64 << 20);
        assert_eq!((s.gradient_copies, s.bucket), (8 * k, 8 * k + 4 * k));
        // The share (13.48 GB), no temporary beside it: the fused update runs in place.
        assert_eq!(s.share, 4 * share);
        assert_eq!(s.share, 13_476_831_232);
        assert_eq!(s.total(), 6 * n + 20 * k + 4 * share + 12 * share);
        // 138.06 GiB with the whole vector's f32 copies and concatenation (4n each) and the
        // reduce-scattered share beside them; now 88.48 GiB.
        let before = 6 * n + 4 * n + 4 * n + 4 * share + 12 * share;
        assert_eq!(before - s.total(), 8 * n - 20 * k);
        assert_eq!(before - s.total(), 53_236_236_288);
    }

    #[test]
    fn the_report_names_every_term_held() {
        let text = step(1, ZeroStage::OptimizerStates, StatePlacement::Gpu, BUCKET).to_string();
        for name in [
            "weights",
            "updated weights",
            "f32 copies",
            "f32 bucket",
            "summed f32 share",
            "state",
        ] {
            assert!(text.contains(name), "{name}: {text}");
        }
        assert!(!text.contains("chunk"), "{text}");
    }
}
