//! The memory tests' wgpu helpers: random f32 tensors on lavapipe's device and the bytes its
//! pools reserve on the calling thread's stream (wgpu's pools count their bytes per stream, one
//! stream per thread; pages are never given back without an explicit cleanup, so the bytes a
//! call makes them reserve, from pools cleaned up before it, bound its peak from below).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Distribution, Tensor};
use cubecl::Runtime;

/// The f32 wgpu backend the memory tests measure.
pub type WgpuF32 = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;

/// Lavapipe's device.
pub fn device() -> cubecl::wgpu::WgpuDevice {
    cubecl::wgpu::WgpuDevice::Cpu
}

/// Uniform values in [-1, 1) of `shape`.
pub fn random(shape: [usize; 4]) -> FloatTensor<WgpuF32> {
    let t = Tensor::<WgpuF32, 4>::random(shape, Distribution::Uniform(-1.0, 1.0), &device());
    t.into_primitive().tensor()
}

/// The pools' reserved bytes on this thread's stream, after finishing what is queued.
pub fn reserved() -> u64 {
    WgpuF32::sync(&device()).unwrap();
    let client = cubecl::wgpu::WgpuRuntime::client(&device());
    client.memory_usage().unwrap().bytes_reserved
}

/// Frees the pools' unused pages on this thread's stream, after finishing what is queued.
pub fn clean_up() {
    WgpuF32::sync(&device()).unwrap();
    cubecl::wgpu::WgpuRuntime::client(&device()).memory_cleanup();
}
