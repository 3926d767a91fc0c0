//! Why a collective operation failed.

use core::fmt;
use std::time::Duration;

use super::MessageKind;

/// A failure of the collective layer: a peer that did not answer, a peer that disagrees, or a
/// transport that could not be set up. Every variant says which rank and what was expected.
#[derive(Debug, Clone, PartialEq)]
pub enum CommError {
    /// A peer did not deliver an expected message within the group's timeout.
    Timeout {
        /// This rank.
        rank: usize,
        /// The peer that stayed silent.
        peer: usize,
        /// What was expected from it.
        kind: MessageKind,
        /// How long this rank waited.
        waited: Duration,
    },
    /// A peer sent something other than what this rank expected (a different step, kind or
    /// tensor layout): the ranks are not running the same program.
    Mismatch {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// What differed.
        detail: String,
    },
    /// A peer's end of the group is gone (its thread or process ended).
    Disconnected {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
    },
    /// The group cannot be built as asked (bad rank, world size, devices, environment).
    Setup(String),
    /// An earlier call of this rank failed while messages were moving (a silent or departed
    /// peer, ranks out of step, a failed device): the ranks can no longer pair their messages,
    /// so the group refuses further work. Build a new group.
    Broken {
        /// This rank.
        rank: usize,
        /// The earlier failure.
        cause: String,
    },
    /// The NCCL library could not be loaded or an NCCL/CUDA call failed.
    Nccl(String),
}

impl fmt::Display for CommError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommError::Timeout {
                rank,
                peer,
                kind,
                waited,
            } => write!(
                f,
                "rank {rank}: no {kind:?} message from rank {peer} after {:.1} s (the peer is \
                 stuck, crashed, or running a different step; raise the group timeout if steps \
                 are legitimately this slow)",
                waited.as_secs_f64()
            ),
            CommError::Mismatch { rank, peer, detail } => {
                write!(f, "rank {rank}: rank {peer} disagrees: {detail}")
            }
            CommError::Disconnected { rank, peer } => {
                write!(f, "rank {rank}: rank {peer} left the group")
            }
            CommError::Setup(what) => write!(f, "device group setup: {what}"),
            CommError::Broken { rank, cause } => write!(
                f,
                "rank {rank}: the group failed earlier and cannot be used any more (build a new \
                 one); the failure: {cause}"
            ),
            CommError::Nccl(what) => write!(f, "NCCL: {what}"),
        }
    }
}

impl std::error::Error for CommError {}
