//! [`Error`]: the one error type of this crate. Where the crate knows what it expected and what
//! it was given, the variant carries both.

use core::fmt;
use std::time::Duration;

use distflash_kernels::KernelError;
use distflash_schedule::{Layout, MessageKind, ScheduleError};

/// Everything the plugin can refuse or fail at: bad input to the op, the module or the
/// sequence-parallel pass, a configuration that cannot be built, and the collective layer's
/// failures (a peer that did not answer or disagrees, a group that cannot be set up).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// The kernels' checks refused the call: shapes, head grouping, head dimension, lengths,
    /// options, or a limit of the device. The kernels' error says what was expected and given.
    Kernel(KernelError),
    /// A tensor's float type is not one the call accepts.
    DType {
        /// The tensor ("k", "the attention input").
        tensor: String,
        /// What is allowed ("f16, bf16 or f32", "q's float type BF16").
        expected: String,
        /// The tensor's float type.
        got: String,
    },
    /// A tensor is not on the device the call needs.
    Device {
        /// The tensor ("k", "the attention input").
        tensor: String,
        /// The device it must be on, and why.
        expected: String,
        /// The device it is on.
        got: String,
    },
    /// A tensor's shape is not the one the module or pass was built for.
    Shape {
        /// The tensor ("the attention input", "k's shard").
        tensor: String,
        /// The shape that is allowed.
        expected: String,
        /// The tensor's shape.
        got: String,
    },
    /// The ranks of a group disagree on what they run: shard shapes, float types, options or
    /// the schedule.
    RanksDisagree {
        /// This rank.
        rank: usize,
        /// A rank holding something else.
        peer: usize,
        /// What this rank holds.
        mine: String,
        /// What the peer holds.
        theirs: String,
    },
    /// Another rank of the group refused its own input (its error says why), so this rank
    /// stops instead of waiting for it.
    PeerRefused {
        /// This rank.
        rank: usize,
        /// The rank that refused its input.
        peer: usize,
    },
    /// A shard length, sequence length or rank does not fit the schedule's [`Layout`].
    Layout {
        /// The layout asked for.
        layout: Layout,
        /// Number of ranks.
        world: usize,
        /// What is wrong and what is allowed.
        what: String,
    },
    /// A layer or model configuration cannot be built.
    Config {
        /// The setting ("n_kv_heads", "head_dim").
        field: String,
        /// What is allowed.
        expected: String,
        /// What was given.
        got: String,
    },
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
    /// The device group cannot be built as asked (bad rank, world size, devices, environment).
    GroupSetup(String),
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
    /// Tensors cannot be offloaded to host memory (layer checkpoints, or a sharded optimizer's
    /// state): the host has too little available, pinned memory could not be allocated, or a
    /// copy failed.
    Offload {
        /// Bytes of host memory asked for.
        needed: u64,
        /// What stood in the way, and what to do about it.
        why: String,
    },
}

impl Error {
    /// An [`Error::Config`]: setting `field` must be `expected` but is `got`.
    pub fn config(
        field: impl Into<String>,
        expected: impl Into<String>,
        got: impl fmt::Display,
    ) -> Self {
        Error::Config {
            field: field.into(),
            expected: expected.into(),
            got: got.to_string(),
        }
    }

    /// Whether this error comes from the collective layer (a peer, the transport or the
    /// group), as opposed to this rank's own input or configuration.
    pub fn is_collective(&self) -> bool {
        matches!(
            self,
            Error::Timeout { .. }
                | Error::Mismatch { .. }
                | Error::Disconnected { .. }
                | Error::GroupSetup(_)
                | Error::Broken { .. }
                | Error::Nccl(_)
        )
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Kernel(e) => write!(f, "attention: {e}"),
            Error::DType {
                tensor,
                expected,
                got,
            } => write!(f, "{tensor} is {got}; expected {expected}"),
            Error::Device {
                tensor,
                expected,
                got,
            } => write!(f, "{tensor} is on {got}; expected {expected}"),
            Error::Shape {
                tensor,
                expected,
                got,
            } => write!(f, "{tensor} has shape {got}; expected {expected}"),
            Error::RanksDisagree {
                rank,
                peer,
                mine,
                theirs,
            } => write!(
                f,
                "every rank must hold shards of one shape with the same float type and options; \
                 rank {rank} has {mine} but rank {peer} has {theirs}"
            ),
            Error::PeerRefused { rank, peer } => write!(
                f,
                "rank {peer} refused its own input (its error says why), so rank {rank} cannot \
                 go on"
            ),
            Error::Layout {
                layout,
                world,
                what,
            } => write!(f, "{layout:?} layout over {world} ranks: {what}"),
            Error::Config {
                field,
                expected,
                got,
            } => write!(
                f,
                "invalid configuration: {field} is {got}; expected {expected}"
            ),
            Error::Timeout {
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
            Error::Mismatch { rank, peer, detail } => {
                write!(f, "rank {rank}: rank {peer} disagrees: {detail}")
            }
            Error::Disconnected { rank, peer } => {
                write!(f, "rank {rank}: rank {peer} left the group")
            }
            Error::GroupSetup(what) => write!(f, "device group setup: {what}"),
            Error::Broken { rank, cause } => write!(
                f,
                "rank {rank}: the group failed earlier and cannot be used any more (build a new \
                 one); the failure: {cause}"
            ),
            Error::Nccl(what) => write!(f, "NCCL: {what}"),
            Error::Offload { needed, why } => write!(
                f,
                "offloading to host memory ({:.2} GiB asked for): {why}",
                *needed as f64 / (1u64 << 30) as f64
            ),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Kernel(e) => Some(e),
            _ => None,
        }
    }
}

impl From<KernelError> for Error {
    fn from(e: KernelError) -> Self {
        Error::Kernel(e)
    }
}

/// A mask's refusal as the kernels' ([`Error::Kernel`] with
/// [`KernelError::BadMask`]), a layout's as [`Error::Layout`]: the same words either way.
impl From<ScheduleError> for Error {
    fn from(e: ScheduleError) -> Self {
        match e {
            ScheduleError::BadMask { what } => Error::Kernel(KernelError::BadMask { what }),
            ScheduleError::Layout {
                layout,
                world,
                what,
            } => Error::Layout {
                layout,
                world,
                what,
            },
        }
    }
}
