//! The Burn op in half precision on wgpu (its own process: Burn 0.21 fixes one default float type
//! per device and process, see `burn_op.rs`).

mod common;

use burn::backend::Autodiff;
use common::burn_case::{check_backend, check_steps};
use distflash_kernels::ElemType;

type WgpuF16 = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, half::f16, i32, u32>;

#[test]
fn wgpu_f16_matches_reference() {
    check_backend::<Autodiff<WgpuF16>>(&cubecl::wgpu::WgpuDevice::Cpu, ElemType::F16);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn cuda_f16_matches_reference() {
    type CudaF16 = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, half::f16, i32, u8>;
    check_backend::<Autodiff<CudaF16>>(&cubecl::cuda::CudaDevice::new(0), ElemType::F16);
    check_steps::<CudaF16>(&cubecl::cuda::CudaDevice::new(0), ElemType::F16);
}
