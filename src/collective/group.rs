//! [`DeviceGroup`]: one rank's handle on a group of devices, with a log of what it sent.

use crate::Error;
use std::sync::{Arc, Mutex};

use burn::tensor::backend::Backend;

use super::{Exchange, Incoming, Outgoing, TensorLayout, Transport};

/// Messages and bytes one rank sent, one entry per exchange (step) since the last
/// [`DeviceGroup::take_traffic`].
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

    /// What this rank sent since the last call, and resets the log.
    pub fn take_traffic(&self) -> Traffic {
        std::mem::take(&mut *self.traffic.lock().expect("traffic log poisoned"))
    }
}
