//! [`OptimizerStepMemory`]: what one GPU holds at the busiest moment of an optimizer step, term
//! by term, from the state's counts alone (pure arithmetic, read off the optimizer's code).
//!
//! With `n` parameter elements padded to `P s` (`s` each rank's share), weights of `w` bytes
//! (`w = 2n` in bf16) and chunks of `c` elements (`min(chunk, s)`), a sharded step
//! (`ShardedAdamW::step`) holds:
//!
//! | term | state on the GPU | state in host memory, one GPU | in host memory, a group |
//! |---|---|---|---|
//! | weights, and the updated weights beside them | `2w` | `2w` | `2w` |
//! | the backward's gradients | `w` | `w` | `w` |
//! | f32 copies of the gradients, one per parameter (none of f32 ones) | `4Ps` | 0 | `4Ps` |
//! | whole f32 vectors at once | `4Ps + 4s` | 0 | `4Ps` (stage 1), `4Ps + 4s` (stage 2) |
//! | optimizer state | `12s` | two chunks, `24c` | `24c` |
//! | a chunk's gradient, temporaries, cast weights | 0 | `8c + (w/n) c` | `8c + (w/n) c P` |
//!
//! Where they come from: the gradients are cast to f32 one parameter at a time and laid end to
//! end (`FlatLayout::gradients`: the pieces, `4Ps`, then their concatenation, `4Ps`); stage 1
//! all-reduces that vector in place and keeps its share as a view of it (the whole vector stays
//! alive through the update), stage 2 reduce-scatters it into a share of its own (`4s`) while it
//! is still held; on one GPU the vector is the share. The update (`AdamWSettings::update`) runs
//! Burn's element-wise operations, which write in place when they hold the only handle: beside
//! the state it makes one temporary of the share while the summed gradient is alive (its first
//! moment's increment), then two (the bias-corrected moments); so the whole vectors peak at the
//! summed gradient and one temporary (`4Ps + 4s` on the GPU; at `P = 1`, `8s`). The updated
//! weights are cast (and on a group all-gathered) into one new vector of the model's size while
//! the trainer still holds the old weights. A host-resident state streams chunk by chunk: the
//! same update over a chunk, its gradient read from the parameters' gradients on one GPU (held
//! whole until the pass ends) or from the summed share on a group, and its updated weights
//! written parameter by parameter (`WeightWriter`).
//!
//! The terms are added although some are never alive together (the gradients' f32 copies are
//! freed once concatenated, the temporaries before the updated weights are made): CUDA's pools
//! serve each size from pages of its own class and keep freed pages, so memory freed by buffers
//! of one size (a parameter's, the share's) does not serve the next buffers of another (the
//! model's, the whole vector's). A replicated step (stage 0) updates one parameter at a time,
//! its transients the size of one parameter (not counted): its terms are the weights, the
//! gradients and the moments (`4w`).

use std::fmt;

use crate::optimizer::chunk_elements;
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
    /// The f32 copy of each parameter's gradient, made to lay the gradients end to end.
    pub gradient_copies: u64,
    /// The whole f32 vectors alive at once: the gradients end to end, the summed share, the
    /// update's temporaries.
    pub whole_vectors: u64,
    /// The optimizer state on the GPU: replicated moments, the f32 share, or two chunks of it.
    pub state: u64,
    /// A host-resident state's chunk: its f32 gradient and the update's temporaries, its
    /// updated weights cast (and gathered over the group).
    pub chunk: u64,
}

impl OptimizerStepMemory {
    /// The step's terms for the counts of `report` (a sharded state in host memory when
    /// `report.host_optimizer > 0`), a host-resident state streamed in chunks of `chunk_bytes`
    /// of state.
    pub fn of(report: &MemoryReport, chunk_bytes: u64) -> Self {
        let w = report.weights;
        if !report.stage.is_sharded() {
            return Self {
                weights: w,
                updated_weights: 0,
                gradients: report.gradients,
                gradient_copies: 0,
                whole_vectors: 0,
                state: report.optimizer,
                chunk: 0,
            };
        }
        let world = report.world.max(1) as u64;
        let share = (report.parameters as u64).div_ceil(world);
        let padded = share * world;
        let on_host = report.host_optimizer > 0;
        let grouped = world > 1;
        // Bytes of one weight element as the updated weights travel (the weights' own type).
        let wire = w.div_ceil((report.parameters as u64).max(1));
        let reduce_scattered = report.stage == crate::optimizer::ZeroStage::Gradients;
        // A cast to the type a tensor already has is the tensor itself: f32 gradients are laid
        // end to end as they are.
        let copies = match wire < F32 {
            true => F32 * padded,
            false => 0,
        };
        let (gradient_copies, whole_vectors, chunk) = match (on_host, grouped) {
            (false, _) => (copies, F32 * padded + F32 * share, 0),
            (true, false) => (0, 0, chunk_transients(chunk_bytes, share, wire, 1)),
            (true, true) => (
                copies,
                F32 * padded + if reduce_scattered { F32 * share } else { 0 },
                chunk_transients(chunk_bytes, share, wire, world),
            ),
        };
        Self {
            weights: w,
            updated_weights: w,
            gradients: report.gradients,
            gradient_copies,
            whole_vectors,
            state: report.optimizer,
            chunk,
        }
    }

    /// Every term together: the step's bytes on the GPU.
    pub fn total(&self) -> u64 {
        self.weights
            + self.updated_weights
            + self.gradients
            + self.gradient_copies
            + self.whole_vectors
            + self.state
            + self.chunk
    }
}

/// Bytes of one chunk's transients (`min(chunk, share)` elements): its f32 gradient and one
/// temporary of the update (or two temporaries), and its updated weights cast to `wire` bytes an
/// element, gathered over `world` ranks.
fn chunk_transients(chunk_bytes: u64, share: u64, wire: u64, world: u64) -> u64 {
    let c = (chunk_elements(chunk_bytes) as u64).min(share);
    2 * F32 * c + wire * c * world
}

impl fmt::Display for OptimizerStepMemory {
    /// `total = weights + ...`, the terms that are not zero, named.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = crate::format_bytes;
        write!(f, "{} = weights {}", b(self.total()), b(self.weights))?;
        let terms = [
            ("updated weights", self.updated_weights),
            ("gradients", self.gradients),
            ("their f32 copies", self.gradient_copies),
            ("whole f32 vectors", self.whole_vectors),
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

    /// 10,000 bf16 parameters (20,000 bytes) over `world` ranks at `stage`, the state at
    /// `placement` in chunks of 12 x 1024 bytes (1024 elements).
    fn step(world: usize, stage: ZeroStage, placement: StatePlacement) -> OptimizerStepMemory {
        let report =
            MemoryReport::for_parameters(10_000, 20_000, world, stage).placed(placement, 12 * 1024);
        OptimizerStepMemory::of(&report, 12 * 1024)
    }

    #[test]
    fn a_replicated_step_holds_weights_gradients_and_moments() {
        let s = step(2, ZeroStage::Replicated, StatePlacement::Gpu);
        assert_eq!((s.weights, s.gradients, s.state), (20_000, 20_000, 40_000));
        assert_eq!(s.total(), 80_000);
    }

    #[test]
    fn a_device_state_adds_the_f32_copies_the_whole_vectors_and_the_updated_weights() {
        // One GPU: share 10,000; copies 40,000, whole vectors 40,000 + 40,000, state 120,000.
        let one = step(1, ZeroStage::OptimizerStates, StatePlacement::Gpu);
        assert_eq!((one.gradient_copies, one.whole_vectors), (40_000, 80_000));
        assert_eq!(one.total(), 3 * 20_000 + 40_000 + 80_000 + 120_000);
        // Three GPUs: share 3334, padded 10,002; the whole vector and one share beside it.
        for stage in [ZeroStage::OptimizerStates, ZeroStage::Gradients] {
            let three = step(3, stage, StatePlacement::Gpu);
            assert_eq!(three.gradient_copies, 40_008, "{stage}");
            assert_eq!(three.whole_vectors, 40_008 + 13_336, "{stage}");
            assert_eq!(three.state, 12 * 3334, "{stage}");
            assert_eq!(three.total(), 60_000 + 40_008 + 53_344 + 40_008, "{stage}");
        }
    }

    #[test]
    fn a_host_state_streams_chunks_and_on_a_group_still_sums_the_whole_gradient() {
        // One GPU: no f32 copy; two chunks of 1024 elements on the device, one chunk's
        // gradient and temporary (8 x 1024) and its bf16 weights (2 x 1024).
        let one = step(1, ZeroStage::OptimizerStates, StatePlacement::Host);
        assert_eq!((one.gradient_copies, one.whole_vectors), (0, 0));
        assert_eq!((one.state, one.chunk), (24_576, 8192 + 2048));
        assert_eq!(one.total(), 60_000 + 24_576 + 10_240);
        // Two GPUs, share 5000: stage 1 keeps the all-reduced vector, stage 2 the vector
        // beside its reduce-scattered share; each chunk's weights gathered from both.
        let first = step(2, ZeroStage::OptimizerStates, StatePlacement::Host);
        let second = step(2, ZeroStage::Gradients, StatePlacement::Host);
        assert_eq!(
            (first.gradient_copies, first.whole_vectors),
            (40_000, 40_000)
        );
        assert_eq!(
            (second.gradient_copies, second.whole_vectors),
            (40_000, 60_000)
        );
        assert_eq!((second.state, second.chunk), (24_576, 8192 + 4096));
        assert_eq!(second.total(), 60_000 + 40_000 + 60_000 + 24_576 + 12_288);
    }

    #[test]
    fn f32_gradients_need_no_f32_copies() {
        let report = MemoryReport::for_parameters(10_000, 40_000, 2, ZeroStage::Gradients);
        let s = OptimizerStepMemory::of(&report, 12 * 1024);
        assert_eq!((s.gradient_copies, s.whole_vectors), (0, 40_000 + 20_000));
        assert_eq!(s.total(), 3 * 40_000 + 60_000 + 12 * 5000);
    }

    #[test]
    fn the_report_names_every_term_held() {
        let text = step(1, ZeroStage::OptimizerStates, StatePlacement::Gpu).to_string();
        for name in [
            "weights",
            "updated weights",
            "f32 copies",
            "whole f32",
            "state",
        ] {
            assert!(text.contains(name), "{name}: {text}");
        }
        assert!(!text.contains("chunk"), "{text}");
    }
}
