//! [`CopyStream`]: one CUDA stream per device (of the primary context CubeCL runs on) that
//! carries the offload's copies between CubeCL's device buffers and pinned host memory, each
//! copy followed by an event its waiters synchronise on.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream, DriverError};

/// The copy stream of one device.
pub(super) struct CopyStream {
    pub(super) context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

impl CopyStream {
    /// `device`'s copy stream, made at the first call.
    pub(super) fn of(device: usize) -> Result<Arc<Self>, DriverError> {
        static STREAMS: OnceLock<Mutex<HashMap<usize, Arc<CopyStream>>>> = OnceLock::new();
        let streams = STREAMS.get_or_init(Default::default);
        let mut streams = streams.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(stream) = streams.get(&device) {
            return Ok(stream.clone());
        }
        let context = CudaContext::new(device)?;
        let stream = Arc::new(Self {
            stream: context.new_stream()?,
            context,
        });
        streams.insert(device, stream.clone());
        Ok(stream)
    }

    /// Queues a copy of `bytes` from device address `from` to pinned host memory `to`, and
    /// returns the event that completes with it.
    ///
    /// # Safety
    /// `from` holds `bytes` bytes whose writers are done, and stays allocated (its buffer held)
    /// until the event completes; `to` is pinned memory of at least `bytes` bytes that nothing
    /// else touches until then.
    pub(super) unsafe fn to_host(
        &self,
        to: *mut c_void,
        from: sys::CUdeviceptr,
        bytes: usize,
    ) -> Result<CudaEvent, DriverError> {
        self.context.bind_to_thread()?;
        // SAFETY: as the caller vouches; the stream belongs to the bound context.
        unsafe { sys::cuMemcpyDtoHAsync_v2(to, from, bytes, self.stream.cu_stream()) }.result()?;
        self.stream.record_event(None)
    }

    /// Queues a copy of `bytes` from pinned host memory `from` to device address `to`, and
    /// returns the event that completes with it.
    ///
    /// # Safety
    /// `to` is a buffer of at least `bytes` bytes, held until the event completes, that no
    /// earlier work still uses and no work reads before the event completes; `from` is pinned
    /// memory holding `bytes` bytes, unchanged until then.
    pub(super) unsafe fn to_device(
        &self,
        to: sys::CUdeviceptr,
        from: *const c_void,
        bytes: usize,
    ) -> Result<CudaEvent, DriverError> {
        self.context.bind_to_thread()?;
        // SAFETY: as the caller vouches; the stream belongs to the bound context.
        unsafe { sys::cuMemcpyHtoDAsync_v2(to, from, bytes, self.stream.cu_stream()) }.result()?;
        self.stream.record_event(None)
    }
}
