//! [`ZeroStage`]: how much of the optimizer a group shards (ZeRO stages 0, 1 and 2).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::Error;

/// How the optimizer state and the gradients are split over the ranks of a group.
///
/// - [`Replicated`](Self::Replicated) (stage 0): every rank holds the whole AdamW state in the
///   weights' type and applies the whole update (the trainer's original optimizer).
/// - [`OptimizerStates`](Self::OptimizerStates) (stage 1): each rank owns `1/P` of the
///   flattened parameters as f32 master weights and f32 moments; the gradients are all-reduced
///   (bucket by bucket, each rank keeping its range of each bucket's sum) and each rank updates
///   its share.
/// - [`Gradients`](Self::Gradients) (stage 2): as stage 1, but each bucket is
///   reduce-scattered: a rank receives only its range of the sum (half the traffic, and a
///   bucket's sum of `1/P` the size).
///
/// Stages 1 and 2 compute the same update ([`ShardedAdamW`](super::ShardedAdamW)); in-process
/// groups and NCCL at two ranks give bitwise the same weights under both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ZeroStage {
    /// Stage 0: replicated optimizer state.
    Replicated,
    /// Stage 1: sharded f32 master weights and moments, gradients all-reduced.
    OptimizerStates,
    /// Stage 2: sharded f32 master weights and moments, gradients reduce-scattered.
    Gradients,
}

impl ZeroStage {
    /// The stage's number: 0, 1 or 2.
    pub fn number(self) -> u8 {
        match self {
            Self::Replicated => 0,
            Self::OptimizerStates => 1,
            Self::Gradients => 2,
        }
    }

    /// Whether each rank keeps only its share of the optimizer state (stages 1 and 2).
    pub fn is_sharded(self) -> bool {
        self != Self::Replicated
    }
}

impl fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.number())
    }
}

impl FromStr for ZeroStage {
    type Err = Error;

    /// `"0"`, `"1"` or `"2"`; anything else is an [`Error::Invalid`].
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "0" => Ok(Self::Replicated),
            "1" => Ok(Self::OptimizerStates),
            "2" => Ok(Self::Gradients),
            other => Err(Error::invalid(
                "the ZeRO stage",
                "0 (replicated optimizer), 1 (sharded optimizer state) or 2 (sharded optimizer \
                 state and gradients)",
                format!("{other:?}"),
            )),
        }
    }
}
