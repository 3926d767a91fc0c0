//! Orders CubeCL's work after a cuBLAS product on the device, so that the host does not wait for
//! the product to end.
//!
//! CubeCL hands out no `CUstream` to wait on an event, but it runs kernels on its stream of the
//! calling thread. After a product, the cuBLAS stream writes the product's epoch into a flag in
//! CubeCL's device memory (`cuMemsetD32Async`), and a one-unit CubeCL kernel spins until it reads
//! it: whatever CubeCL queues next (readers of the output, reuse of the inputs' memory) runs after
//! the product, while the host goes on queueing. The spinning kernel holds one unit of one SM
//! while the product runs on the others.
//!
//! The other direction (the product after CubeCL's writes of its inputs) stays a host wait:
//! `cuStreamWaitValue32` refuses CubeCL's memory (stream-ordered pool allocations;
//! `CUDA_ERROR_INVALID_VALUE` on an H200, driver 580), so the cuBLAS stream cannot wait on a flag
//! a CubeCL kernel raises. Each product waits for CubeCL's stream to drain first, so at most one
//! flag write is outstanding and an epoch is awaited by equality (no wrap-around limit).

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;
use cudarc::driver::{sys, DriverError};

/// Returns once the flag holds `epoch`.
#[cube(launch)]
fn await_flag(flag: &mut Array<Atomic<u32>>, epoch: u32) {
    loop {
        if flag[0].load() == epoch {
            break;
        }
    }
}

/// The flag of one thread's cuBLAS stream on one device, and the last epoch used.
pub(super) struct DeviceOrder {
    flag: Handle,
    address: sys::CUdeviceptr,
    epoch: u32,
}

impl DeviceOrder {
    /// A zeroed flag in CubeCL's memory on `client`'s device.
    pub(super) fn new(client: &ComputeClient<CudaRuntime>) -> Self {
        let flag = client.create_from_slice(&[0u8; 4]);
        let address = client
            .get_resource(flag.clone())
            .unwrap_or_else(|e| panic!("the device address of the cuBLAS ordering flag: {e}"))
            .resource()
            .ptr;
        // The zeros must have landed before the cuBLAS stream first writes the flag.
        cubecl::future::block_on(client.sync()).unwrap_or_else(|e| {
            panic!("CubeCL's stream failed making the cuBLAS ordering flag: {e}")
        });
        Self {
            flag,
            address,
            epoch: 0,
        }
    }

    /// Makes `stream` write the next epoch into the flag once its work so far is done.
    ///
    /// # Safety
    /// `stream` is a live stream of the flag's device, its context is current, and CubeCL's
    /// stream has drained since the flag was made and since the last [`DeviceOrder::await_signal`].
    pub(super) unsafe fn signal(&mut self, stream: sys::CUstream) -> Result<(), DriverError> {
        self.epoch = self.epoch.wrapping_add(1).max(1);
        // SAFETY: one u32 at the flag's address, which lives as long as `self.flag`; the caller
        // vouches for the stream.
        unsafe { sys::cuMemsetD32Async(self.address, self.epoch, 1, stream) }.result()
    }

    /// Queues on CubeCL's stream of this thread the kernel that waits until the flag holds the
    /// epoch of the last [`DeviceOrder::signal`].
    pub(super) fn await_signal(&self, client: &ComputeClient<CudaRuntime>) {
        // SAFETY: the flag was allocated for one u32 (`new`).
        let flag = unsafe { ArrayArg::from_raw_parts(self.flag.clone(), 1) };
        let (count, dim) = (CubeCount::Static(1, 1, 1), CubeDim::new_1d(1));
        await_flag::launch::<CudaRuntime>(client, count, dim, flag, self.epoch);
    }
}
