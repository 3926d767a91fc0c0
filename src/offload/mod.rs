//! Host offload of layer checkpoints: what a checkpointed layer keeps for its backward (its
//! input, and attention's output and lse under
//! [`CheckpointPlacement::AttentionOutput`](crate::layers::CheckpointPlacement)) moves to host
//! memory as soon as the layer's forward ends, and comes back one layer ahead of the backward
//! that needs it, so that the device holds the checkpoints of a layer or two instead of every
//! layer's. Which layers offload is the model's [`Offload`](crate::layers::Offload) policy,
//! applied per block (`TransformerBlockConfig::offload`).
//!
//! - [`HostOffload`] is the backend capability (a supertrait of
//!   [`FlashAttentionBackend`](crate::FlashAttentionBackend)): the default copies synchronously
//!   (`into_data`, `from_data`: bitwise the same tensors back) on every backend; CUDA
//!   `CubeBackend` copies asynchronously through pinned host memory on a copy stream of its own
//!   (feature `pinned-offload`, on by default; `pinned/` says exactly how the copies are ordered
//!   against CubeCL's stream).
//! - The checkpoint node (`backends/checkpoint_node.rs`) keeps its tensors as `SavedTensors`:
//!   on the device, or as an entry of its thread's `OffloadStore` for the device, a stack in
//!   forward order. A layer's backward takes its own entry and starts bringing back the entry
//!   pushed before it, the layer the backward visits next, so that copy runs under this layer's
//!   backward. Layers that keep their checkpoints on the device prefetch the same way.
//! - [`HostOffload::prepare_host_offload`], called before a step with the sizes the step will
//!   offload (`TransformerBlock::offloaded_bytes`), fails with [`Error::Offload`] when the host
//!   has too little memory available or pinned memory cannot be allocated, before any work; a
//!   step that was not prepared checks the same way before each allocation and returns the error
//!   from the layer's forward. Nothing is allocated in the backward but the device buffers the
//!   checkpoints come back into.

mod capability;
mod host_memory;
mod host_tensor;
#[cfg(feature = "pinned-offload")]
pub(crate) mod pinned;
mod policy;
mod saved;
mod store;

pub(crate) use capability::check_host_memory;
pub use capability::HostOffload;
pub use host_memory::{available as host_memory_available, HEADROOM};
pub use host_tensor::{HostTensor, Restoring};
pub use policy::Offload;
pub(crate) use saved::SavedTensors;

use store::OffloadStore;

/// Bytes of host memory that this thread's offloaded checkpoints on `device` hold now (the
/// layers whose forward has run and whose backward has not yet brought them back). `B` is the
/// backend the checkpoints live on: the one under `Autodiff`.
pub fn held_bytes<B: HostOffload>(device: &B::Device) -> u64 {
    OffloadStore::<B>::find(device).map_or(0, |store| store.held_bytes())
}

/// Waits until every copy to host memory of this thread's checkpoints on `device` has finished,
/// and releases the device memory the copied tensors held (later layers do this without waiting
/// as they go; call this to measure the device memory after a forward). `B` as in
/// [`held_bytes`].
pub fn finish_copies<B: HostOffload>(device: &B::Device) {
    if let Some(store) = OffloadStore::<B>::find(device) {
        store.wait_copied();
    }
}

/// Bytes of pinned host memory allocated for offloads from `device` (the pool, in use or free;
/// sized by the first step that offloads, or by its
/// [`prepare_host_offload`](HostOffload::prepare_host_offload)).
#[cfg(feature = "pinned-offload")]
pub fn pinned_bytes(device: &cubecl::cuda::CudaDevice) -> u64 {
    pinned::pinned_bytes(device)
}
