//! [`MemoryReport`]: the bytes one rank holds for training, by kind and ZeRO stage, computed from
//! the model's parameters, beside what the device itself counts where the backend can tell.
//!
//! With `n` parameter elements whose float types take `w` bytes in all (`w = 2n` in bf16),
//! `P` ranks and `s = ceil(n / P)` elements per share:
//!
//! | stage | weights | gradients (backward) | summed f32 gradient kept | optimizer state |
//! |---|---|---|---|---|
//! | 0 | `w` | `w` | 0 (summed in place) | `2w`: both moments in the weights' types |
//! | 1 | `w` | `w` | `4 s`: the share, all-reduced bucket by bucket | `12 s`: f32 master and moments |
//! | 2 | `w` | `w` | `4 s`: the share, reduce-scattered bucket by bucket | `12 s` |
//!
//! On one rank (stages 1 and 2) the update's gradient is read from the parameters' gradients
//! chunk by chunk: no f32 copy of it is kept (0). With the sharded state in host memory
//! ([`StatePlacement::Host`]), the `12 s` bytes move to the host and the device holds two chunks
//! of it.
//!
//! Every rank holds the whole model and Burn's backward yields every parameter's whole gradient
//! in the weights' types, at every stage. Activations, and the transient buckets of f32 gradients
//! a sharded step gathers for its collectives, are not counted.

use std::fmt;

use super::{TrainBackend, Trainer};
use crate::byte_units::format_bytes as bytes;
use crate::device_memory::DeviceMemory;
use crate::optimizer::{
    chunk_elements, FlatLayout, StatePlacement, ZeroStage, STATE_BYTES_PER_ELEMENT,
};
use crate::TrainingKernels;

/// Bytes of f32.
const F32_BYTES: u64 = 4;

/// The bytes one rank holds for training (see the module's documentation for the formulas).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryReport {
    /// The optimizer's ZeRO stage.
    pub stage: ZeroStage,
    /// Ranks of the group.
    pub world: usize,
    /// Parameter elements.
    pub parameters: usize,
    /// The model's weights, in their own float types.
    pub weights: u64,
    /// Every parameter's gradient from the backward pass, in the weights' types.
    pub gradients: u64,
    /// The f32 sum of the gradients a sharded step keeps for its update (0 at stage 0 and on
    /// one rank, which reads the gradients themselves).
    pub summed_gradients: u64,
    /// The optimizer's state on the device: both moments in the weights' types (stage 0), or
    /// this rank's share of the f32 master weights and moments (stages 1 and 2), or with that
    /// share in host memory the two chunks of it streamed through the device.
    pub optimizer: u64,
    /// The optimizer's state in host memory ([`StatePlacement::Host`]; 0 on the device).
    pub host_optimizer: u64,
    /// What the device counts, `None` where the backend does not say (NdArray).
    pub device: Option<DeviceMemory>,
}

impl MemoryReport {
    /// The bytes a rank holds at `stage` for the parameters of `layout` (over its world size).
    pub fn estimate(layout: &FlatLayout, stage: ZeroStage) -> Self {
        let weights = layout.weight_bytes() as u64;
        Self::for_parameters(layout.len(), weights, layout.world(), stage)
    }

    /// The bytes a rank of `world` holds at `stage` for `parameters` elements whose weights
    /// take `weights` bytes: what [`estimate`](Self::estimate) counts for a model's layout, from
    /// the counts alone (the memory planner's prediction).
    pub fn for_parameters(parameters: usize, weights: u64, world: usize, stage: ZeroStage) -> Self {
        let world = world.max(1);
        let padded = parameters.div_ceil(world) * world;
        let share = (padded / world) as u64;
        // One rank reads its update's gradient straight from the parameters' gradients: no f32
        // sum is kept.
        let (summed_gradients, optimizer) = match stage {
            ZeroStage::Replicated => (0, 2 * weights),
            ZeroStage::OptimizerStates | ZeroStage::Gradients => match world {
                1 => (0, 3 * F32_BYTES * share),
                _ => (F32_BYTES * share, 3 * F32_BYTES * share),
            },
        };
        Self {
            stage,
            world,
            parameters,
            weights,
            gradients: weights,
            summed_gradients,
            optimizer,
            host_optimizer: 0,
            device: None,
        }
    }

    /// These counts with a sharded state (stages 1 and 2) in host memory, streamed through the
    /// device in chunks of `chunk_bytes` of state: two chunks of it on the device. Stage 0 is
    /// left as it is (its state is not sharded).
    pub fn with_state_on_host(self, chunk_bytes: u64) -> Self {
        if !self.stage.is_sharded() {
            return self;
        }
        let chunk = STATE_BYTES_PER_ELEMENT * chunk_elements(chunk_bytes) as u64;
        Self {
            optimizer: (2 * chunk).min(self.optimizer),
            host_optimizer: self.optimizer,
            ..self
        }
    }

    /// This report with the state at `placement` (chunks of `chunk_bytes` in host memory).
    pub fn placed(self, placement: StatePlacement, chunk_bytes: u64) -> Self {
        match placement {
            StatePlacement::Gpu => self,
            StatePlacement::Host => self.with_state_on_host(chunk_bytes),
        }
    }

    /// Weights, gradients, summed gradients and optimizer state together.
    pub fn total(&self) -> u64 {
        self.weights + self.gradients + self.summed_gradients + self.optimizer
    }
}

impl fmt::Display for MemoryReport {
    /// One line: the counts per rank, then the device's.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let optimizer = match (self.stage, self.host_optimizer) {
            (ZeroStage::Replicated, _) => "replicated moments".to_string(),
            (_, 0) => format!("f32 master + moments, 1/{}", self.world),
            (_, host) => format!(
                "two chunks of the f32 master + moments, 1/{}, whose {} are in host memory",
                self.world,
                bytes(host)
            ),
        };
        write!(
            f,
            "memory per rank (ZeRO stage {}, {} rank(s), {} parameters): weights {}, gradients \
             {}, summed f32 gradients {}, optimizer {} ({optimizer}); total {}; device ",
            self.stage,
            self.world,
            self.parameters,
            bytes(self.weights),
            bytes(self.gradients),
            bytes(self.summed_gradients),
            bytes(self.optimizer),
            bytes(self.total()),
        )?;
        match self.device {
            Some(d) => write!(
                f,
                "{} in use now, peak {} reserved by the pools",
                bytes(d.in_use),
                bytes(d.reserved)
            ),
            None => write!(f, "n/a (the backend does not count its memory)"),
        }
    }
}

impl<B: TrainBackend> Trainer<B> {
    /// What this rank holds for training: the estimate for its model, stage and group, and
    /// what its device counts now.
    pub fn memory_report(&self) -> MemoryReport {
        let layout = FlatLayout::of::<B, _>(&self.model, self.rank().1);
        let o = &self.options;
        let estimate = MemoryReport::estimate(&layout, o.zero);
        MemoryReport {
            device: <B::InnerBackend as TrainingKernels>::device_memory(&self.device()),
            ..estimate.placed(o.optimizer_state, o.state_chunk_bytes)
        }
    }
}
