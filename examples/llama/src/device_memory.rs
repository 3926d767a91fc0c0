//! [`DeviceMemory`]: what a device's allocator counts, where the backend exposes it
//! ([`TrainingKernels::device_memory`](crate::TrainingKernels::device_memory)).

/// What the device's allocator counts, where the backend exposes it (CubeCL's memory pools on
/// CUDA and wgpu). CubeCL 0.10's pools release pages only on an explicit
/// `Backend::memory_cleanup`, which training never calls, so `reserved` is the peak of what the
/// pools took from the device since it was first used (PyTorch's `max_memory_reserved`). On
/// CUDA the pools belong to a stream and each thread has its own: these are the calling
/// thread's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes of the live allocations.
    pub in_use: u64,
    /// Bytes the pools hold on the device (live allocations, padding and free pages kept for
    /// reuse): the peak since the device was first used, the pools never releasing pages
    /// unasked.
    pub reserved: u64,
}
