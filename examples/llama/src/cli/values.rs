//! The values of `llama_train`'s options that clap checks itself: the named choices (backend,
//! element type, schedule, ZeRO stage, optimizer state, memory mode) as `ValueEnum`s, and the
//! parsers of checkpoint placements, layers per checkpoint, sizes, fractions, rates, byte counts
//! and the offload policy, each refusing what is out of range with a message naming what is
//! allowed.

use burn_distflash::layers::{CheckpointPlacement, Offload};
use burn_distflash::schedule::ScheduleKind;
use clap::builder::{PossibleValuesParser, RangedU64ValueParser, TypedValueParser};
use clap::ValueEnum;

use crate::optimizer::{StatePlacement, ZeroStage};

/// The backend a run trains on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// The CPU, through Burn's ndarray backend (no GPU, no Vulkan)
    Ndarray,
    /// wgpu: Vulkan, Metal or DX12 on one device (Mesa's lavapipe on a machine without a GPU)
    Wgpu,
    /// NVIDIA GPUs through CubeCL's CUDA runtime (NCCL between GPUs)
    Cuda,
}

/// The element type of the weights and activations on CUDA (other backends train in f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Dtype {
    /// bfloat16, with f32 optimizer state and f32 reductions
    Bf16,
    /// 32-bit floats
    F32,
}

/// The sequence-parallel schedule over several GPUs (`ScheduleKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Schedule {
    /// The fastest layout the schedule model predicts for the GPUs, the shard length and the
    /// window: zigzag at an even number of GPUs under full causal attention, balanced at an odd
    /// one or under a window shorter than a shard
    Auto,
    /// The plain ring: every rank visits every earlier shard
    Ring,
    /// Load-balanced with helper ranks, on contiguous shards
    Balanced,
    /// The ring over zigzag shards: the same causal work on every rank at every step
    Zigzag,
}

impl From<Schedule> for ScheduleKind {
    fn from(schedule: Schedule) -> Self {
        match schedule {
            Schedule::Auto => ScheduleKind::Auto,
            Schedule::Ring => ScheduleKind::Ring,
            Schedule::Balanced => ScheduleKind::Balanced,
            Schedule::Zigzag => ScheduleKind::Zigzag,
        }
    }
}

/// The optimizer's ZeRO stage (`ZeroStage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Zero {
    /// Every rank keeps the whole AdamW state
    #[value(name = "0")]
    Replicated,
    /// Each rank keeps 1/P of the f32 master weights and moments
    #[value(name = "1")]
    OptimizerStates,
    /// As 1, and the gradients are reduce-scattered instead of all-reduced
    #[value(name = "2")]
    Gradients,
}

/// Where a sharded optimizer keeps its f32 state (`StatePlacement`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OptimizerState {
    /// On the GPU
    Gpu,
    /// In host memory (pinned on CUDA), streamed through the GPU in chunks at every step
    Host,
}

impl From<OptimizerState> for StatePlacement {
    fn from(state: OptimizerState) -> Self {
        match state {
            OptimizerState::Gpu => StatePlacement::Gpu,
            OptimizerState::Host => StatePlacement::Host,
        }
    }
}

impl From<Zero> for ZeroStage {
    fn from(zero: Zero) -> Self {
        match zero {
            Zero::Replicated => ZeroStage::Replicated,
            Zero::OptimizerStates => ZeroStage::OptimizerStates,
            Zero::Gradients => ZeroStage::Gradients,
        }
    }
}

/// How the loss and feed-forward chunks are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MemoryMode {
    /// The largest chunks the memory planner predicts to fit --gpu-memory
    Auto,
}

/// A checkpoint placement by name (`none`, `layer`, `attention-output`), its names listed in
/// the help.
pub fn placement() -> impl TypedValueParser<Value = CheckpointPlacement> {
    PossibleValuesParser::new(CheckpointPlacement::NAMES).try_map(|name| name.parse())
}

/// Layers per gradient checkpoint, `1` or `2`, its values listed in the help.
pub fn layers_per_checkpoint() -> impl TypedValueParser<Value = usize> {
    PossibleValuesParser::new(["1", "2"]).try_map(|n| n.parse::<usize>())
}

/// A count of at least 1 (layers, tokens, GPUs), as clap checks it.
pub fn at_least_one() -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(1..)
}

/// A finite number of at least 0 (a learning rate, a clipping norm).
pub fn non_negative(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(value) if value.is_finite() && value >= 0.0 => Ok(value),
        _ => Err(format!("takes a finite number >= 0, got {text:?}")),
    }
}

/// A fraction in `[0, 1)`.
pub fn fraction(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(value) if (0.0..1.0).contains(&value) => Ok(value),
        _ => Err(format!(
            "takes a fraction at least 0 and below 1, got {text:?}"
        )),
    }
}

/// A byte count with an optional unit (`139GiB`, `141GB`, `4096`), see [`crate::parse_bytes`].
pub fn bytes(text: &str) -> Result<u64, String> {
    crate::parse_bytes("the byte count", text).map_err(|e| e.to_string())
}

/// The offload policy: `off`, `all` or `N` (every layer but the last N), see [`Offload`].
pub fn offload(text: &str) -> Result<Offload, String> {
    text.parse()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_out_of_range_are_refused_with_what_is_allowed() {
        assert_eq!(non_negative("2e-3"), Ok(2e-3));
        assert_eq!(non_negative("0"), Ok(0.0));
        for bad in ["-1", "nan", "inf", "fast"] {
            assert!(non_negative(bad).unwrap_err().contains(">= 0"), "{bad}");
        }
        assert_eq!(fraction("0.05"), Ok(0.05));
        assert_eq!(fraction("0"), Ok(0.0));
        for bad in ["1", "-0.1", "half"] {
            assert!(fraction(bad).unwrap_err().contains("below 1"), "{bad}");
        }
        assert_eq!(bytes("2KiB"), Ok(2048));
        assert!(bytes("lots").unwrap_err().contains("80GiB"));
        assert_eq!(offload("3"), Ok(Offload::AllButLast(3)));
        assert!(offload("some").unwrap_err().contains("off, all, or N"));
    }

    #[test]
    fn choices_convert_to_the_library_types() {
        assert_eq!(ScheduleKind::from(Schedule::Zigzag), ScheduleKind::Zigzag);
        assert_eq!(ZeroStage::from(Zero::OptimizerStates), "1".parse().unwrap());
        let names: Vec<String> = Schedule::value_variants()
            .iter()
            .filter_map(|s| s.to_possible_value())
            .map(|s| s.get_name().to_string())
            .collect();
        assert_eq!(names, ["auto", "ring", "balanced", "zigzag"]);
    }
}
