//! The collective layer: a group of Burn devices that exchange tensors step by step.
//!
//! A [`DeviceGroup`] is one rank's handle on a group. It moves tensors through a [`Transport`]:
//! [`local::LocalTransport`] (threads of one process, any Burn backend: tests and non-CUDA users)
//! or [`nccl`] (NCCL on CUDA, in one process or one process per GPU). A step's
//! sends and receives are posted together with [`Transport::exchange`] and completed later with
//! [`Exchange::wait`], so the next step's data travels while the current step computes.
//! Collectives ([`Transport::all_reduce`], [`Transport::reduce_scatter`],
//! [`Transport::all_gather`]) run on NCCL's own kernels over NCCL, and elsewhere on exchanges
//! (`collectives`: rank-ordered sums, bitwise the same on every rank).

mod collectives;
mod group;
pub mod local;
#[cfg(feature = "nccl")]
pub mod nccl;
mod ranks;
mod reduce;

use crate::Error;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::DType;

pub use collectives::COLLECTIVE_DTYPES;
pub use distflash_schedule::MessageKind;
pub use group::{DeviceGroup, Traffic};
pub use ranks::on_each_rank;
pub use reduce::BUCKET_BYTES;

/// Shape and float type of one tensor of a message (what a receiver allocates).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorLayout {
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Float type.
    pub dtype: DType,
}

impl TensorLayout {
    /// The layout of a tensor primitive.
    pub fn of<B: Backend>(tensor: &FloatTensor<B>) -> Self {
        use burn::tensor::TensorMetadata;
        Self {
            shape: tensor.shape().to_vec(),
            dtype: tensor.dtype(),
        }
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// A message this rank sends.
pub struct Outgoing<B: Backend> {
    /// Destination rank.
    pub peer: usize,
    /// What it is.
    pub kind: MessageKind,
    /// Its tensors, in the order the kind documents.
    pub tensors: Vec<FloatTensor<B>>,
}

/// A message this rank expects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Incoming {
    /// Source rank.
    pub peer: usize,
    /// What it is.
    pub kind: MessageKind,
    /// Layouts of its tensors, in order.
    pub layouts: Vec<TensorLayout>,
}

/// A message this rank received, its tensors on this rank's device.
pub struct Received<B: Backend> {
    /// Source rank.
    pub peer: usize,
    /// What it is.
    pub kind: MessageKind,
    /// Its tensors, in order.
    pub tensors: Vec<FloatTensor<B>>,
}

/// One step's posted sends and receives, completing in the background.
pub trait Exchange<B: Backend>: Send {
    /// Blocks until every send of the step has left and every receive has arrived (or the
    /// group's timeout passes). Received messages come back in the order they were expected.
    fn wait(self: Box<Self>) -> Result<Vec<Received<B>>, Error>;
}

/// Moves tensors between the ranks of a group. Every rank of the group must post the same
/// sequence of exchanges (matching sends with receives) and collectives, or they fail with
/// [`Error::Mismatch`] or [`Error::Timeout`], never hang; after such a failure the
/// rank refuses further work ([`Error::Broken`] in-process, [`Error::Nccl`] over NCCL).
///
/// Ownership, whatever the backend's streams: the sender may drop a sent tensor as soon as
/// [`exchange`](Transport::exchange) returns, and a received tensor is the receiver's own
/// memory, ready for kernels launched after [`Exchange::wait`] and droppable at any time. The
/// transport orders the sender's writes before the transfer and keeps the sender's memory until
/// the transfer has read it.
pub trait Transport<B: Backend>: Send + Sync {
    /// This rank, in `0..world_size`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// The device this rank computes on.
    fn device(&self) -> &B::Device;
    /// Posts one step's sends and receives together. Sent tensors must not be modified until
    /// the exchange is waited on (callers hand ownership over, so they cannot). A peer outside
    /// the group, or this rank itself, is refused before anything moves.
    fn exchange(
        &self,
        sends: Vec<Outgoing<B>>,
        receives: Vec<Incoming>,
    ) -> Result<Box<dyn Exchange<B> + '_>, Error>;
    /// Every rank's `values` (same length on every rank), indexed by rank; used to check that
    /// the ranks agree on shapes and options before any tensor moves.
    fn all_gather_values(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, Error>;

    /// The element-wise sum of `tensor` over all ranks (every rank passes the same shape and
    /// float type), returned on every rank once it is complete. Sum is the only reduction.
    ///
    /// Collectives follow the exchanges' ownership contract: the input is handed over (a
    /// transport may reduce in its memory when the caller held the only handle), and the
    /// result is this rank's own memory, ready for kernels launched after the call returns.
    /// The group's timeout bounds the call; a failure breaks the group as an exchange's does.
    ///
    /// The default implementation runs on [`exchange`](Self::exchange) (the in-process
    /// transport uses it): the ranks first check that they agree on the call (shape, float
    /// type, collective), then rank `j` sums the `j`-th of `P` near-equal chunks of the
    /// flattened tensor, adding the `P` contributions in rank order (f16 and bf16 in f32,
    /// rounded once), and every rank gathers the sums: bitwise the same result on every rank,
    /// and the same as a host sum in rank order.
    fn all_reduce(&self, tensor: FloatTensor<B>) -> Result<FloatTensor<B>, Error> {
        collectives::all_reduce(self, tensor)
    }

    /// This rank's share of the element-wise sum over all ranks: the input's first dimension
    /// (`P * n`) must divide by the world size `P`, and rank `r` gets rows `r * n .. (r + 1) * n`
    /// of the sum. Same contract and default implementation as
    /// [`all_reduce`](Self::all_reduce) (without the gathering).
    fn reduce_scatter(&self, tensor: FloatTensor<B>) -> Result<FloatTensor<B>, Error> {
        collectives::reduce_scatter(self, tensor)
    }

    /// Every rank's `tensor` (the same shape `[n, ...]` and float type on every rank),
    /// concatenated along the first dimension in rank order: `[P * n, ...]`. Same contract as
    /// [`all_reduce`](Self::all_reduce); the default implementation runs on
    /// [`exchange`](Self::exchange).
    fn all_gather(&self, tensor: FloatTensor<B>) -> Result<FloatTensor<B>, Error> {
        collectives::all_gather(self, tensor)
    }
}
