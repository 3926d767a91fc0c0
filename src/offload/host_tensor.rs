//! [`HostTensor`] (a checkpoint tensor held in host memory) and [`Restoring`] (one on its way
//! back to the device): the values a [`HostOffload`](super::HostOffload) backend hands out.
//! Two kinds each: read synchronously into a [`TensorData`] (every backend), or copied
//! asynchronously through pinned memory on a copy stream (CUDA `CubeBackend`, `pinned/`).

use core::fmt;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{TensorData, TensorMetadata};

use super::host_memory;
#[cfg(feature = "pinned-offload")]
use super::pinned::{self, PinnedTensor, RestoringTensor};
use crate::Error;

/// A tensor held in host memory until its backward needs it.
pub struct HostTensor<B: Backend> {
    kind: HostKind<B>,
}

enum HostKind<B: Backend> {
    /// Read into host memory (the host waited for it); comes back through `from_data`.
    Data { data: TensorData, device: B::Device },
    /// Being copied, or copied, into pinned memory on CUDA's copy stream.
    #[cfg(feature = "pinned-offload")]
    Pinned(Box<PinnedTensor>),
}

impl<B: Backend> HostTensor<B> {
    /// `tensor` read into host memory now, the host waiting for the device (the default of
    /// [`HostOffload::offload_to_host`](super::HostOffload::offload_to_host)): its device memory
    /// is released when this returns.
    ///
    /// # Errors
    ///
    /// [`Error::Offload`] when the host has too little memory available for it (checked before
    /// reading), or when reading it fails.
    pub fn read(tensor: FloatTensor<B>) -> Result<Self, Error> {
        let device = B::float_device(&tensor);
        let needed = (tensor.shape().num_elements() * tensor.dtype().size()) as u64;
        host_memory::check_available(needed)?;
        let data =
            cubecl::future::block_on(B::float_into_data(tensor)).map_err(|e| Error::Offload {
                needed,
                why: format!("reading the tensor from the device failed: {e:?}"),
            })?;
        Ok(Self {
            kind: HostKind::Data { data, device },
        })
    }

    #[cfg(feature = "pinned-offload")]
    pub(crate) fn pinned(tensor: PinnedTensor) -> Self {
        Self {
            kind: HostKind::Pinned(Box::new(tensor)),
        }
    }

    /// Bytes of host memory holding the tensor.
    pub fn bytes(&self) -> usize {
        match &self.kind {
            HostKind::Data { data, .. } => data.bytes.len(),
            #[cfg(feature = "pinned-offload")]
            HostKind::Pinned(tensor) => tensor.bytes(),
        }
    }

    /// Starts bringing the tensor back to its device (the default of
    /// [`HostOffload::restore_from_host`](super::HostOffload::restore_from_host)): a read one
    /// through `from_data` at once, a pinned one on the copy stream.
    ///
    /// # Panics
    ///
    /// When CUDA fails to start the copy back (a backward pass cannot return an error).
    pub fn restore(self) -> Restoring<B> {
        match self.kind {
            HostKind::Data { data, device } => Restoring::ready(B::float_from_data(data, &device)),
            #[cfg(feature = "pinned-offload")]
            HostKind::Pinned(tensor) => Restoring {
                kind: RestoringKind::Pinned(Box::new(pinned::restore(*tensor))),
            },
        }
    }

    /// The tensor's values, read from host memory (after waiting for its copy there); the tensor
    /// stays where it is.
    pub fn to_data(&self) -> TensorData {
        match &self.kind {
            HostKind::Data { data, .. } => data.clone(),
            #[cfg(feature = "pinned-offload")]
            HostKind::Pinned(tensor) => tensor.to_data(),
        }
    }

    /// Releases the device memory of a tensor whose copy to the host has finished, without
    /// waiting; `true` when no copy is under way any more.
    pub(crate) fn poll_copied(&mut self) -> bool {
        match &mut self.kind {
            HostKind::Data { .. } => true,
            #[cfg(feature = "pinned-offload")]
            HostKind::Pinned(tensor) => tensor.poll_copied(),
        }
    }

    /// Waits for the copy to the host, then releases the tensor's device memory (a copy still
    /// under way otherwise keeps it until the tensor is restored or dropped).
    pub fn wait_copied(&mut self) {
        match &mut self.kind {
            HostKind::Data { .. } => {}
            #[cfg(feature = "pinned-offload")]
            HostKind::Pinned(tensor) => tensor.wait_copied(),
        }
    }
}

impl<B: Backend> fmt::Debug for HostTensor<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            HostKind::Data { .. } => "read",
            #[cfg(feature = "pinned-offload")]
            HostKind::Pinned(_) => "pinned",
        };
        write!(f, "HostTensor({kind}, {} bytes)", self.bytes())
    }
}

/// A tensor on its way back from host memory: [`finish`](Restoring::finish) hands it out once
/// its copy has landed.
pub struct Restoring<B: Backend> {
    kind: RestoringKind<B>,
}

enum RestoringKind<B: Backend> {
    Ready(FloatTensor<B>),
    #[cfg(feature = "pinned-offload")]
    Pinned(Box<RestoringTensor>),
}

impl<B: Backend> Restoring<B> {
    /// A tensor already back on its device.
    pub fn ready(tensor: FloatTensor<B>) -> Self {
        Self {
            kind: RestoringKind::Ready(tensor),
        }
    }

    /// The tensor, once its copy has landed (the host waits for it): from here on, work on
    /// the device may read it.
    ///
    /// # Panics
    ///
    /// When the copy failed on the device.
    pub fn finish(self) -> FloatTensor<B> {
        match self.kind {
            RestoringKind::Ready(tensor) => tensor,
            #[cfg(feature = "pinned-offload")]
            RestoringKind::Pinned(tensor) => pinned::into_primitive::<B>(tensor.finish()),
        }
    }
}

impl<B: Backend> fmt::Debug for Restoring<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            RestoringKind::Ready(_) => write!(f, "Restoring(ready)"),
            #[cfg(feature = "pinned-offload")]
            RestoringKind::Pinned(_) => write!(f, "Restoring(copying)"),
        }
    }
}
