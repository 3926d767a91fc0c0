//! [`HostOffload`]: the backend capability of moving a checkpoint tensor to host memory and
//! back. The defaults (synchronous `into_data` / `from_data`) work on every backend; CUDA
//! `CubeBackend` overrides them with pinned memory and a copy stream (`backends/host_offload.rs`).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use super::host_memory;
use super::host_tensor::{HostTensor, Restoring};
use crate::Error;

/// A backend whose tensors can wait in host memory: what a checkpointed layer keeps for its
/// backward goes to the host when [`offload`](crate::layers::TransformerBlock::offload) is on.
/// Every [`FlashAttentionBackend`](crate::FlashAttentionBackend) is one (a supertrait); the
/// defaults copy synchronously (`into_data` after the forward, `from_data` one layer before the
/// backward), which gives bitwise the same tensors back. CUDA `CubeBackend` copies
/// asynchronously through pinned memory on a copy stream of its own (feature `pinned-offload`).
pub trait HostOffload: Backend {
    /// Starts moving `tensor` to host memory. Its device memory is released once the copy is
    /// done (at once for the default, which waits for the copy).
    ///
    /// # Errors
    ///
    /// [`Error::Offload`] when the host has too little memory available, host memory cannot
    /// be allocated (pinned), or the copy cannot start.
    fn offload_to_host(tensor: FloatTensor<Self>) -> Result<HostTensor<Self>, Error> {
        HostTensor::read(tensor)
    }

    /// Starts bringing `tensor` back to its device; [`Restoring::finish`] hands it out.
    ///
    /// # Panics
    ///
    /// When the device refuses the copy (a backward pass, where this runs, cannot return an
    /// error).
    fn restore_from_host(tensor: HostTensor<Self>) -> Restoring<Self> {
        tensor.restore()
    }

    /// Gets host memory ready, before a step, for offloading tensors of `sizes` bytes from
    /// `device` (the whole step's: every offloaded layer's kept tensors), so that a step that
    /// cannot get it fails here, before any work, and not mid-step. The default checks that the
    /// host has that much available (`MemAvailable` less
    /// [`HEADROOM`](super::HEADROOM)); CUDA also allocates the pinned buffers (kept and reused
    /// by later steps: a pool sized by the first step).
    ///
    /// # Errors
    ///
    /// [`Error::Offload`], naming the bytes asked for and what the host has.
    fn prepare_host_offload(device: &Self::Device, sizes: &[usize]) -> Result<(), Error> {
        let _ = device;
        check_host_memory(sizes)
    }
}

/// The default [`HostOffload::prepare_host_offload`]: the host has `sizes` bytes in all
/// available.
pub(crate) fn check_host_memory(sizes: &[usize]) -> Result<(), Error> {
    host_memory::check_available(sizes.iter().map(|&s| s as u64).sum())
}
