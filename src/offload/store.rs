//! [`OffloadStore`]: the checkpoints of one thread's layers on one device that wait in host
//! memory, in the order their forwards pushed them, and [`OffloadEntry`], one layer's handle on
//! its own.
//!
//! The backward visits checkpointed layers in the reverse order of the forward, so the store is
//! a stack: when a layer's backward takes its entry, the store starts bringing back the newest
//! entry pushed before it (the layer the backward visits next), so that its copy runs while
//! this layer's backward computes. A layer that keeps its checkpoint on the device records its
//! position in the store at its forward and prefetches the same way in its backward. Each layer
//! takes its own entry by position, so an order the stack did not foresee (another model's
//! layers in between, a graph dropped without a backward) costs overlap, never correctness.
//!
//! One store per thread and device, because CubeCL's streams are per thread (and the ranks of an
//! in-process group, threads sharing a CPU device, each have their own).

use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use burn::tensor::backend::DeviceOps;
use burn::tensor::ops::FloatTensor;

use super::capability::HostOffload;
use super::host_tensor::{HostTensor, Restoring};
use crate::Error;

thread_local! {
    /// This thread's stores: an `Arc<OffloadStore<B>>` per backend type and device.
    static STORES: RefCell<Vec<(TypeId, Box<dyn Any>)>> = const { RefCell::new(Vec::new()) };
}

/// One pushed layer's tensors.
enum Slot<B: HostOffload> {
    /// In host memory (or on their way there).
    OnHost(Vec<HostTensor<B>>),
    /// On their way back to the device (prefetched).
    Restoring(Vec<Restoring<B>>),
}

/// The slots by position (the order of the pushes), and the next position.
struct Slots<B: HostOffload> {
    next: u64,
    by_position: BTreeMap<u64, Slot<B>>,
}

/// This thread's offloaded checkpoints on one device.
pub(crate) struct OffloadStore<B: HostOffload> {
    device: B::Device,
    slots: Mutex<Slots<B>>,
}

impl<B: HostOffload> OffloadStore<B> {
    /// This thread's store for `device`, made at the first call.
    pub(crate) fn of_this_thread(device: &B::Device) -> Arc<Self> {
        Self::find(device).unwrap_or_else(|| {
            let store = Arc::new(Self {
                device: device.clone(),
                slots: Mutex::new(Slots {
                    next: 0,
                    by_position: BTreeMap::new(),
                }),
            });
            let entry: Box<dyn Any> = Box::new(store.clone());
            STORES.with(|stores| stores.borrow_mut().push((TypeId::of::<B>(), entry)));
            store
        })
    }

    /// This thread's store for `device`, if a layer has offloaded there.
    pub(crate) fn find(device: &B::Device) -> Option<Arc<Self>> {
        STORES.with(|stores| {
            stores.borrow().iter().find_map(|(type_id, store)| {
                let store = store.downcast_ref::<Arc<Self>>()?;
                (*type_id == TypeId::of::<B>() && store.device.id() == device.id())
                    .then(|| store.clone())
            })
        })
    }

    fn slots(&self) -> MutexGuard<'_, Slots<B>> {
        // A panic elsewhere while the lock was held leaves whole slots behind: keep going.
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The position the next push gets: where a layer that keeps its checkpoint on the device
    /// stands among the offloaded ones.
    pub(crate) fn position(&self) -> u64 {
        self.slots().next
    }

    /// Moves one layer's `tensors` to host memory, after waiting for the copies of the layers
    /// pushed before it (at most one layer's copies are under way, so a copy that falls
    /// behind the compute holds the device memory of one layer, not of all).
    ///
    /// # Errors
    ///
    /// Those of [`HostOffload::offload_to_host`]; what was already moved is dropped.
    pub(crate) fn push(
        self: &Arc<Self>,
        tensors: Vec<FloatTensor<B>>,
    ) -> Result<OffloadEntry<B>, Error> {
        self.wait_copied();
        let host = (tensors.into_iter())
            .map(B::offload_to_host)
            .collect::<Result<Vec<_>, _>>()?;
        let mut slots = self.slots();
        let position = slots.next;
        slots.next += 1;
        slots.by_position.insert(position, Slot::OnHost(host));
        Ok(OffloadEntry {
            store: self.clone(),
            position,
        })
    }

    /// Releases the device memory of every tensor whose copy to the host has finished, without
    /// waiting.
    pub(crate) fn poll_copied(&self) {
        for slot in self.slots().by_position.values_mut() {
            if let Slot::OnHost(tensors) = slot {
                tensors.iter_mut().for_each(|t| {
                    t.poll_copied();
                });
            }
        }
    }

    /// Waits for every copy to the host under way, releasing the copied tensors' device memory.
    pub(crate) fn wait_copied(&self) {
        for slot in self.slots().by_position.values_mut() {
            if let Slot::OnHost(tensors) = slot {
                tensors.iter_mut().for_each(HostTensor::wait_copied);
            }
        }
    }

    /// Starts bringing back the newest entry pushed before `position`, if it is still in host
    /// memory (one layer ahead: an entry already on its way back means nothing more to do).
    pub(crate) fn prefetch_before(&self, position: u64) {
        let mut slots = self.slots();
        let Some((_, slot)) = slots.by_position.range_mut(..position).next_back() else {
            return;
        };
        if let Slot::OnHost(_) = slot {
            let Slot::OnHost(tensors) = std::mem::replace(slot, Slot::Restoring(Vec::new())) else {
                unreachable!("matched above")
            };
            *slot = Slot::Restoring(tensors.into_iter().map(B::restore_from_host).collect());
        }
    }

    /// The tensors of the entry at `position`, back on the device, after starting the prefetch
    /// of the entry before it (so that the next layer's copy overlaps this layer's backward).
    ///
    /// # Panics
    ///
    /// When the entry was taken already.
    fn take(&self, position: u64) -> Vec<FloatTensor<B>> {
        let slot = self.slots().by_position.remove(&position);
        let restoring: Vec<Restoring<B>> = match slot {
            Some(Slot::Restoring(tensors)) => tensors,
            Some(Slot::OnHost(tensors)) => tensors.into_iter().map(B::restore_from_host).collect(),
            None => panic!("an offloaded checkpoint was restored twice (entry {position})"),
        };
        self.prefetch_before(position);
        restoring.into_iter().map(Restoring::finish).collect()
    }

    /// Drops the entry at `position` if it is still held (its layer's backward never ran).
    fn discard(&self, position: u64) {
        let slot = self.slots().by_position.remove(&position);
        drop(slot);
    }

    /// Bytes of host memory the entries still in host memory hold.
    pub(crate) fn held_bytes(&self) -> u64 {
        let slots = self.slots();
        let on_host = slots.by_position.values().filter_map(|slot| match slot {
            Slot::OnHost(tensors) => Some(tensors.iter().map(|t| t.bytes() as u64).sum::<u64>()),
            Slot::Restoring(_) => None,
        });
        on_host.sum()
    }

    /// What each slot holds, oldest first: `true` in host memory, `false` on its way back.
    #[cfg(test)]
    fn states(&self) -> Vec<(u64, bool)> {
        let slots = self.slots();
        let states = slots.by_position.iter();
        states
            .map(|(&p, s)| (p, matches!(s, Slot::OnHost(_))))
            .collect()
    }
}

impl<B: HostOffload> fmt::Debug for OffloadStore<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let slots = self.slots();
        write!(
            f,
            "OffloadStore({:?}, {} entries, next {})",
            self.device,
            slots.by_position.len(),
            slots.next
        )
    }
}

/// One layer's checkpoint in its thread's [`OffloadStore`]; dropped without a
/// [`restore`](OffloadEntry::restore) (a graph dropped before its backward), it frees its slot.
pub(crate) struct OffloadEntry<B: HostOffload> {
    store: Arc<OffloadStore<B>>,
    position: u64,
}

impl<B: HostOffload> OffloadEntry<B> {
    /// The layer's tensors back on the device (see [`OffloadStore`]: this also starts the
    /// prefetch of the layer before it).
    pub(crate) fn restore(&self) -> Vec<FloatTensor<B>> {
        self.store.take(self.position)
    }
}

impl<B: HostOffload> Drop for OffloadEntry<B> {
    fn drop(&mut self) {
        self.store.discard(self.position);
    }
}

impl<B: HostOffload> fmt::Debug for OffloadEntry<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OffloadEntry({})", self.position)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Tensor, TensorData};
    use burn_ndarray::NdArray;

    type Cpu = NdArray<f32>;

    fn tensor(value: f32) -> FloatTensor<Cpu> {
        let data = TensorData::new(vec![value; 6], [2, 3]);
        Tensor::<Cpu, 2>::from_data(data, &Default::default())
            .into_primitive()
            .tensor()
    }

    fn value(t: FloatTensor<Cpu>) -> f32 {
        Tensor::<Cpu, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(t))
            .into_data()
            .to_vec::<f32>()
            .unwrap()[0]
    }

    #[test]
    fn the_backward_order_brings_back_one_layer_ahead() {
        // A thread of its own: the store is per thread.
        std::thread::spawn(|| {
            let store = OffloadStore::<Cpu>::of_this_thread(&Default::default());
            let entries: Vec<_> = (0..3)
                .map(|l| store.push(vec![tensor(l as f32), tensor(10.0 + l as f32)]))
                .collect::<Result<_, _>>()
                .unwrap();
            assert_eq!(store.held_bytes(), 3 * 2 * 6 * 4);
            let kept_layer = store.position();
            assert_eq!(kept_layer, 3);
            // The last layer keeps its checkpoint on the device; its backward prefetches layer 2.
            store.prefetch_before(kept_layer);
            assert_eq!(store.states(), [(0, true), (1, true), (2, false)]);
            store.prefetch_before(kept_layer);
            assert_eq!(
                store.states(),
                [(0, true), (1, true), (2, false)],
                "one ahead only"
            );
            let got: Vec<f32> = entries[2].restore().into_iter().map(value).collect();
            assert_eq!(got, [2.0, 12.0]);
            assert_eq!(store.states(), [(0, true), (1, false)]);
            assert_eq!(
                entries[1].restore().into_iter().map(value).next(),
                Some(1.0)
            );
            assert_eq!(store.states(), [(0, false)]);
            assert_eq!(store.held_bytes(), 0);
            assert_eq!(
                entries[0].restore().into_iter().map(value).next(),
                Some(0.0)
            );
            assert!(store.states().is_empty());
        })
        .join()
        .unwrap();
    }

    #[test]
    fn entries_out_of_order_or_dropped_unused_give_their_own_tensors_and_free_their_slots() {
        std::thread::spawn(|| {
            let device = Default::default();
            let store = OffloadStore::<Cpu>::of_this_thread(&device);
            assert!(Arc::ptr_eq(&store, &OffloadStore::find(&device).unwrap()));
            let a = store.push(vec![tensor(1.0)]).unwrap();
            let b = store.push(vec![tensor(2.0)]).unwrap();
            let c = store.push(vec![tensor(3.0)]).unwrap();
            assert_eq!(a.restore().into_iter().map(value).next(), Some(1.0));
            drop(b);
            assert_eq!(store.states(), [(2, true)]);
            assert_eq!(c.restore().into_iter().map(value).next(), Some(3.0));
            drop(c);
            assert!(store.states().is_empty());
        })
        .join()
        .unwrap();
    }
}
