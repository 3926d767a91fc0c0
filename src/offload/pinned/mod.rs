//! The asynchronous host offload of CUDA `CubeBackend` tensors: pinned host memory (a pool per
//! device, `pool.rs`) and a copy stream per device (`copy_stream.rs`) beside CubeCL's streams.
//!
//! CubeCL hands out no `CUstream` and no events, so the copy stream is ordered against CubeCL's
//! stream of the calling thread on the host, as the cuBLAS products are (`matmul/cublas.rs`):
//!
//! 1. **Device to host** ([`offload`], after a layer's forward). The tensor is made contiguous,
//!    CubeCL's stream is drained (`client.sync()`: every kernel that writes it has run), and the
//!    copy is queued on the copy stream, followed by an event. The tensor (its handle) is held
//!    until that event has completed: CubeCL's pool does not reuse memory a live handle holds,
//!    and no in-place operation writes a buffer held twice. The holder lets it go when a later
//!    layer finds the event complete ([`PinnedTensor::poll_copied`]), or waits for it at the next
//!    layer's offload (so at most one layer's copies are under way) or before the copy back.
//! 2. **Host to device** ([`restore`], the prefetch one layer ahead of the backward). The
//!    destination is a fresh CubeCL buffer, whose memory may be a slice the pool took back from a
//!    tensor whose last kernels are still queued on CubeCL's stream (the pool reuses memory in
//!    its own stream's order, which the copy stream is not part of): CubeCL's stream is drained
//!    after the allocation and before the copy is queued, so the copy writes memory nothing else
//!    uses. The copy is followed by an event.
//! 3. **Compute** reads the restored tensor only after [`RestoringTensor::finish`] has waited on
//!    the host for that event: no kernel that reads it is queued before its bytes have landed.
//!
//! A pinned buffer goes back to its pool only after the copy back's event (or, for a tensor
//! dropped unrestored, after the copy to host's), so no copy ever writes a buffer another tensor
//! holds. The drains cost one host wait per layer in the forward and one in the backward, next
//! to the several per layer the cuBLAS products already take.

mod copy_stream;
mod pool;

use std::any::Any;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, TensorData, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::ComputeClient;
use cudarc::driver::CudaEvent;

use crate::Error;
use copy_stream::CopyStream;
use pool::Lease;

type CudaTensor = CubeTensor<CudaRuntime>;

/// `tensor` as a CUDA `CubeBackend` tensor, or itself when it is another backend's.
pub(crate) fn as_cuda<T: 'static>(tensor: T) -> Result<CudaTensor, T> {
    let any: Box<dyn Any> = Box::new(tensor);
    match any.downcast::<CudaTensor>() {
        Ok(cuda) => Ok(*cuda),
        Err(any) => Err(*any
            .downcast::<T>()
            .unwrap_or_else(|_| unreachable!("the box holds a T"))),
    }
}

/// A CUDA tensor as backend `B`'s float primitive (`B` is a CUDA `CubeBackend`: only its
/// tensors are offloaded through pinned memory).
pub(crate) fn into_primitive<B: Backend>(tensor: CudaTensor) -> FloatTensor<B> {
    let any: Box<dyn Any> = Box::new(tensor);
    *any.downcast::<FloatTensor<B>>()
        .unwrap_or_else(|_| unreachable!("pinned tensors come from a CUDA CubeBackend"))
}

/// `device` as a CUDA device, when it is one.
pub(crate) fn as_cuda_device<D: 'static>(device: &D) -> Option<&CudaDevice> {
    (device as &dyn Any).downcast_ref::<CudaDevice>()
}

/// Allocates what `device`'s pinned pool lacks to serve tensors of `sizes` bytes at once.
///
/// # Errors
///
/// [`Error::Offload`] when the host has too little memory available, or pinning fails.
pub(crate) fn reserve(device: &CudaDevice, sizes: &[usize]) -> Result<(), Error> {
    let stream = copy_stream(device.index, sizes.iter().sum())?;
    pool::reserve(&stream.context, device.index, sizes)
}

/// Bytes of pinned host memory allocated for `device` so far (the pool, free or lent).
pub(crate) fn pinned_bytes(device: &CudaDevice) -> u64 {
    pool::allocated(device.index)
}

fn copy_stream(device: usize, bytes: usize) -> Result<Arc<CopyStream>, Error> {
    CopyStream::of(device).map_err(|e| Error::Offload {
        needed: bytes as u64,
        why: format!("creating the CUDA copy stream failed: {e:?}"),
    })
}

/// A CUDA tensor in pinned host memory, or on its way there.
pub(crate) struct PinnedTensor {
    lease: Lease,
    bytes: usize,
    shape: Shape,
    dtype: DType,
    client: ComputeClient<CudaRuntime>,
    device: CudaDevice,
    stream: Arc<CopyStream>,
    /// The copy to host under way and the tensor it reads, held until the copy has completed.
    in_flight: Option<(CudaEvent, CudaTensor)>,
}

impl PinnedTensor {
    /// Bytes of host memory holding the tensor.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Lets the device tensor go if its copy has completed; `true` when no copy is under way.
    pub(crate) fn poll_copied(&mut self) -> bool {
        let done = match &self.in_flight {
            None => return true,
            Some((event, _)) => event.try_is_complete(),
        };
        // An error is reported by the wait that follows (the next offload or the copy back).
        if done == Ok(true) {
            self.in_flight = None;
        }
        self.in_flight.is_none()
    }

    /// Waits for the copy to host, then lets the device tensor go.
    ///
    /// # Panics
    ///
    /// When the copy failed on the device.
    pub(crate) fn wait_copied(&mut self) {
        if let Some((event, source)) = self.in_flight.take() {
            event.synchronize().unwrap_or_else(|e| {
                panic!("copying a checkpoint to host memory failed on the GPU: {e:?}")
            });
            drop(source);
        }
    }
}

impl PinnedTensor {
    /// The tensor's values, copied out of pinned memory once the copy there has completed.
    ///
    /// # Panics
    ///
    /// When the copy failed on the device.
    pub(crate) fn to_data(&self) -> TensorData {
        if let Some((event, _)) = &self.in_flight {
            event.synchronize().unwrap_or_else(|e| {
                panic!("copying a tensor to host memory failed on the GPU: {e:?}")
            });
        }
        let bytes = match self.bytes {
            0 => Vec::new(),
            // SAFETY: the lease holds `bytes` bytes that the completed copy wrote and that
            // nothing writes while `self` holds the lease.
            n => {
                unsafe { std::slice::from_raw_parts(self.lease.address().cast::<u8>(), n) }.to_vec()
            }
        };
        TensorData::from_bytes_vec(bytes, self.shape.clone(), self.dtype)
    }
}

impl Drop for PinnedTensor {
    fn drop(&mut self) {
        // The buffer goes back to the pool and the device tensor is let go only once the copy
        // has stopped using them.
        if let Some((event, _source)) = self.in_flight.take() {
            if let Err(e) = event.synchronize() {
                eprintln!("burn-distflash: a checkpoint's copy to host memory failed: {e:?}");
            }
        }
    }
}

/// `tensor` in a contiguous buffer: itself, or a row-major copy (never Burn's `copy()`, which can
/// come back pitched on CUDA).
fn contiguous(tensor: CudaTensor) -> CudaTensor {
    if tensor.is_contiguous() {
        return tensor;
    }
    let (client, device, dtype) = (tensor.client.clone(), tensor.device.clone(), tensor.dtype);
    let copy = cubecl::std::tensor::into_contiguous(&client, tensor.binding(), dtype.into());
    CudaTensor::new(client, copy.handle, *copy.metadata, device, dtype)
}

/// Starts copying `tensor` to pinned host memory (see the module docs for the ordering).
///
/// # Errors
///
/// [`Error::Offload`] when pinned memory cannot be had (see [`reserve`]), CubeCL's stream has
/// failed, or the copy cannot be queued.
pub(crate) fn offload(tensor: CudaTensor) -> Result<PinnedTensor, Error> {
    let tensor = contiguous(tensor);
    let (shape, dtype) = (tensor.shape(), tensor.dtype);
    let bytes = shape.num_elements() * dtype.size();
    let failed = |why: String| Error::Offload {
        needed: bytes as u64,
        why,
    };
    let stream = copy_stream(tensor.device.index, bytes)?;
    let lease = pool::lease(&stream.context, tensor.device.index, bytes)?;
    let client = tensor.client.clone();
    let mut pinned = PinnedTensor {
        lease,
        bytes,
        shape,
        dtype,
        client: client.clone(),
        device: tensor.device.clone(),
        stream: stream.clone(),
        in_flight: None,
    };
    if bytes == 0 {
        return Ok(pinned);
    }
    let address = (client.get_resource(tensor.handle.clone()))
        .map_err(|e| failed(format!("the device address of the tensor: {e}")))?
        .resource()
        .ptr;
    cubecl::future::block_on(client.sync())
        .map_err(|e| failed(format!("CubeCL's stream failed before the copy: {e}")))?;
    // SAFETY: CubeCL has drained (the tensor's writers are done); `pinned` holds the tensor until
    // the event completes and its lease of at least `bytes` bytes until then too.
    let event = unsafe { stream.to_host(pinned.lease.address(), address, bytes) }
        .map_err(|e| failed(format!("cuMemcpyDtoHAsync: {e:?}")))?;
    pinned.in_flight = Some((event, tensor));
    Ok(pinned)
}

/// A CUDA tensor on its way back from pinned memory.
pub(crate) struct RestoringTensor {
    tensor: Option<CudaTensor>,
    /// The copy back, and the buffer it reads, given back to the pool once it has completed.
    in_flight: Option<(CudaEvent, Lease)>,
}

impl RestoringTensor {
    /// The tensor, once the host has seen its copy complete.
    ///
    /// # Panics
    ///
    /// When the copy failed on the device.
    pub(crate) fn finish(mut self) -> CudaTensor {
        if let Some((event, lease)) = self.in_flight.take() {
            event.synchronize().unwrap_or_else(|e| {
                panic!("copying a checkpoint back from host memory failed on the GPU: {e:?}")
            });
            drop(lease);
        }
        self.tensor.take().expect("finished once")
    }
}

impl Drop for RestoringTensor {
    fn drop(&mut self) {
        // Neither buffer may be reused while the copy writes the one and reads the other.
        if let Some((event, _lease)) = self.in_flight.take() {
            if let Err(e) = event.synchronize() {
                eprintln!("burn-distflash: a checkpoint's copy back to the GPU failed: {e:?}");
            }
        }
    }
}

/// Starts copying a pinned tensor back into a fresh buffer on its device (see the module docs for
/// the ordering).
///
/// # Panics
///
/// When CubeCL's stream has failed or the copy cannot be queued (a backward pass, where this
/// runs, cannot return an error).
pub(crate) fn restore(mut pinned: PinnedTensor) -> RestoringTensor {
    pinned.wait_copied();
    let client = pinned.client.clone();
    let handle = client.empty(pinned.bytes);
    let tensor = CudaTensor::new_contiguous(
        client.clone(),
        pinned.device.clone(),
        pinned.shape.clone(),
        handle,
        pinned.dtype,
    );
    let lease = std::mem::replace(&mut pinned.lease, Lease::none(pinned.device.index));
    if pinned.bytes == 0 {
        return RestoringTensor {
            tensor: Some(tensor),
            in_flight: None,
        };
    }
    let failed =
        |what: &str| -> ! { panic!("restoring an offloaded checkpoint on the GPU: {what}") };
    let address = (client.get_resource(tensor.handle.clone()))
        .unwrap_or_else(|e| failed(&format!("the device address of the buffer: {e}")))
        .resource()
        .ptr;
    cubecl::future::block_on(client.sync())
        .unwrap_or_else(|e| failed(&format!("CubeCL's stream failed before the copy: {e}")));
    // SAFETY: the buffer is fresh and CubeCL has drained past its allocation (no earlier work
    // uses its memory); the tensor is handed out only after the event (`finish`); the lease holds
    // the pinned bytes until then.
    let event =
        unsafe { (pinned.stream).to_device(address, lease.address().cast_const(), pinned.bytes) }
            .unwrap_or_else(|e| failed(&format!("cuMemcpyHtoDAsync: {e:?}")));
    RestoringTensor {
        tensor: Some(tensor),
        in_flight: Some((event, lease)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_cuda_tensors_and_devices_take_the_pinned_path() {
        assert_eq!(as_cuda(7u32).err(), Some(7));
        let cpu = burn_ndarray::NdArrayDevice::Cpu;
        assert!(as_cuda_device(&cpu).is_none());
        assert_eq!(
            as_cuda_device(&CudaDevice::new(3)).map(|d| d.index),
            Some(3)
        );
    }
}
