//! [`SavedTensors`]: what a checkpoint node keeps for its backward (the layer input and what the
//! segment kept), on the device or in host memory, as the segment's
//! [`offloads`](crate::layers::CheckpointSegment::offloads) says.

use std::sync::Arc;

use burn::tensor::ops::FloatTensor;

use super::capability::HostOffload;
use super::store::{OffloadEntry, OffloadStore};
use crate::Error;

/// A checkpoint node's saved tensors.
#[derive(Debug, Clone)]
pub(crate) enum SavedTensors<B: HostOffload> {
    /// On the device. Where this thread offloads other layers on the device, the store and this
    /// layer's position in it, so that its backward prefetches the offloaded layer before it.
    Device {
        tensors: Vec<FloatTensor<B>>,
        store: Option<(Arc<OffloadStore<B>>, u64)>,
    },
    /// In host memory.
    Host(Arc<OffloadEntry<B>>),
}

impl<B: HostOffload> SavedTensors<B> {
    /// Saves `tensors` (of `device`), moving them to host memory when `offload` is set.
    ///
    /// # Errors
    ///
    /// Those of [`HostOffload::offload_to_host`] when offloading.
    pub(crate) fn save(
        tensors: Vec<FloatTensor<B>>,
        device: &B::Device,
        offload: bool,
    ) -> Result<Self, Error> {
        if offload {
            let entry = OffloadStore::of_this_thread(device).push(tensors)?;
            return Ok(Self::Host(Arc::new(entry)));
        }
        let store = OffloadStore::find(device).map(|store| {
            // Earlier layers' finished copies free their device memory now.
            store.poll_copied();
            let position = store.position();
            (store, position)
        });
        Ok(Self::Device { tensors, store })
    }

    /// The tensors on the device, for the backward; starts the prefetch of the offloaded layer
    /// the backward visits next.
    pub(crate) fn take(self) -> Vec<FloatTensor<B>> {
        match self {
            Self::Device { tensors, store } => {
                if let Some((store, position)) = store {
                    store.prefetch_before(position);
                }
                tensors
            }
            Self::Host(entry) => entry.restore(),
        }
    }
}
