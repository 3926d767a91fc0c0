//! [`DeviceMemory`]: what a device's allocator counts, where the backend exposes it
//! ([`TrainingKernels::device_memory`](crate::TrainingKernels::device_memory)).

/// What the device's allocator counts, where the backend exposes it (CubeCL's memory pools on
/// CUDA and wgpu). CubeCL keeps no peak: these are the numbers when the report was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes of the live allocations.
    pub in_use: u64,
    /// Bytes the pools hold on the device (live allocations, padding and free pages kept for
    /// reuse): at least the largest use since the pools last released pages.
    pub reserved: u64,
}
