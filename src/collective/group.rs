//! [`DeviceGroup`]: one rank's handle on a group of devices, with a log of what it sent.

use crate::Error;
use std::sync::{Arc, Mutex};

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use super::{Exchange, Incoming, Outgoing, TensorLayout, Transport};

/// Messages and bytes one rank sent, one entry per exchange (step) since the last
/// [`DeviceGroup::take_traffic`]. Collectives are not logged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Messages sent, per exchange.
    pub messages: Vec<usize>,
    /// Bytes sent, per exchange.
    pub bytes: Vec<usize>,
}

impl Traffic {
    /// Total messages sent.
    pub fn total_messages(&self) -> usize {
        self.messages.iter().sum()
    }

    /// Total bytes sent.
    pub fn total_bytes(&self) -> usize {
        self.bytes.iter().sum()
    }
}

/// One rank of a group of devices that computes sequence-parallel attention together.
///
/// Cheap to clone (the transport is shared). Build one per rank with
/// [`DeviceGroup::in_process`] (threads of one process, any backend) or the NCCL constructors
/// (`DeviceGroup::nccl`, `DeviceGroup::nccl_from_env`), then hand each rank's handle to the thread
/// or process driving that rank's device.
pub struct DeviceGroup<B: Backend> {
    transport: Arc<dyn Transport<B>>,
    traffic: Arc<Mutex<Traffic>>,
}

impl<B: Backend> Clone for DeviceGroup<B> {
    fn clone(&self) -> Self {
        Self {
            transport: self.transport.clone(),
            traffic: self.traffic.clone(),
        }
    }
}

impl<B: Backend> core::fmt::Debug for DeviceGroup<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DeviceGroup")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("device", self.device())
            .finish()
    }
}

impl<B: Backend> DeviceGroup<B> {
    /// A rank of a group that moves tensors through `transport`.
    pub fn new(transport: impl Transport<B> + 'static) -> Self {
        Self {
            transport: Arc::new(transport),
            traffic: Arc::default(),
        }
    }

    /// This rank, in `0..world_size`.
    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.transport.world_size()
    }

    /// The device this rank computes on.
    pub fn device(&self) -> &B::Device {
        self.transport.device()
    }

    /// Posts one step's sends and receives (see [`Transport::exchange`]) and, once the
    /// transport has taken them, logs the sends ([`take_traffic`](Self::take_traffic)).
    ///
    /// # Errors
    ///
    /// - Refused before anything moves (the group stays usable): [`Error::GroupSetup`] for a
    ///   peer outside the group, [`Error::Mismatch`] for this rank itself as a peer.
    /// - [`Error::Broken`] (in-process) or [`Error::Nccl`] (NCCL) once an earlier call
    ///   has broken the group.
    /// - A failure while posting: in-process, [`Error::GroupSetup`] (the device failed) or
    ///   [`Error::Disconnected`] (a peer's end is gone); over NCCL, [`Error::GroupSetup`] (a
    ///   tensor not on this rank's device, or not a float), [`Error::Timeout`] or
    ///   [`Error::Nccl`].
    ///
    /// The receives' own failures come from [`Exchange::wait`].
    pub fn exchange(
        &self,
        sends: Vec<Outgoing<B>>,
        receives: Vec<Incoming>,
    ) -> Result<Box<dyn Exchange<B> + '_>, Error> {
        let messages = sends.len();
        let bytes = sends
            .iter()
            .flat_map(|m| m.tensors.iter())
            .map(|t| TensorLayout::of::<B>(t).bytes())
            .sum();
        // Logged once the transport has taken the exchange: a refused one moved nothing.
        let exchange = self.transport.exchange(sends, receives)?;
        let mut traffic = self.traffic.lock().expect("traffic log poisoned");
        traffic.messages.push(messages);
        traffic.bytes.push(bytes);
        Ok(exchange)
    }

    /// Every rank's `values`, indexed by rank.
    ///
    /// # Errors
    ///
    /// - [`Error::Mismatch`] when the ranks pass different numbers of values.
    /// - [`Error::Timeout`] when a peer does not take part within the group's timeout.
    /// - [`Error::Disconnected`] (in-process) when a peer's end is gone.
    /// - [`Error::Broken`] (in-process) or [`Error::Nccl`] (NCCL) once an earlier call
    ///   has broken the group; [`Error::Nccl`] also when an NCCL or CUDA call fails.
    pub fn all_gather_values(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, Error> {
        self.transport.all_gather_values(values)
    }

    /// The element-wise sum of `tensor` over all ranks, on every rank (see
    /// [`Transport::all_reduce`]: in-process, added in rank order and bitwise the same on every
    /// rank; over NCCL, NCCL's sum, in place when the caller held the only handle). Sum is the
    /// only reduction. Not logged in [`take_traffic`](Self::take_traffic).
    ///
    /// # Shapes
    ///
    /// - tensor: any shape, the same on every rank
    /// - output: the sum, of the same shape
    ///
    /// # Errors
    ///
    /// See [`all_gather`](Self::all_gather).
    pub fn all_reduce(&self, tensor: FloatTensor<B>) -> Result<FloatTensor<B>, Error> {
        self.transport.all_reduce(tensor)
    }

    /// This rank's share of the element-wise sum of `tensor` over all ranks: rank `r` gets rows
    /// `r * n .. (r + 1) * n` (see [`Transport::reduce_scatter`]).
    ///
    /// # Shapes
    ///
    /// - tensor: `[P * n, ...]`, the same on every rank (`P` the world size)
    /// - output: `[n, ...]`
    ///
    /// # Errors
    ///
    /// See [`all_gather`](Self::all_gather), and [`Error::Shape`] when `P` does not divide the
    /// first dimension.
    pub fn reduce_scatter(&self, tensor: FloatTensor<B>) -> Result<FloatTensor<B>, Error> {
        self.transport.reduce_scatter(tensor)
    }

    /// Every rank's `tensor`, concatenated along the first dimension in rank order (see
    /// [`Transport::all_gather`]).
    ///
    /// # Shapes
    ///
    /// - tensor: `[n, ...]`, the same on every rank
    /// - output: `[P * n, ...]`
    ///
    /// # Errors
    ///
    /// Those of every collective:
    ///
    /// - [`Error::DType`] for a float type outside
    ///   [`COLLECTIVE_DTYPES`](super::COLLECTIVE_DTYPES) (F32, BF16, F16, F64), [`Error::Shape`]
    ///   for a tensor without dimensions (reduce-scatter and all-gather); every rank refuses
    ///   before anything moves.
    /// - In-process, [`Error::RanksDisagree`] when the ranks' calls differ (collective, shape or
    ///   float type), on every rank, before anything moves (the group stays usable). NCCL does
    ///   not compare calls: ranks that disagree fail with [`Error::Timeout`] or a wrong result.
    /// - [`Error::Timeout`] when a peer does not take part within the group's timeout (over NCCL
    ///   it names the next rank, since NCCL does not say which peer is silent), then
    ///   [`Error::Broken`] (in-process) or [`Error::Nccl`] (NCCL) for every later call, as
    ///   after a failed [`exchange`](Self::exchange); [`Error::Disconnected`] (in-process) when
    ///   a peer's end is gone; over NCCL, [`Error::GroupSetup`] for a tensor on another device
    ///   and [`Error::Nccl`] when an NCCL or CUDA call fails.
    pub fn all_gather(&self, tensor: FloatTensor<B>) -> Result<FloatTensor<B>, Error> {
        self.transport.all_gather(tensor)
    }

    /// What this rank sent since the last call, and resets the log.
    pub fn take_traffic(&self) -> Traffic {
        std::mem::take(&mut *self.traffic.lock().expect("traffic log poisoned"))
    }
}
