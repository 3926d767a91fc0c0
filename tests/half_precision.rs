//! The Burn op and the in-process collectives in f16 on wgpu. Burn 0.21 fixes one default float
//! type per device and process, and every other wgpu test runs in f32 on the same device, so
//! these run in their own test binary.

use std::time::Duration;

use burn::backend::Autodiff;
use burn::tensor::DType;
use burn_distflash::DeviceGroup;
use cubecl::wgpu::WgpuDevice;
use distflash_kernels::ElemType;
use distflash_test_support::burn_case::{check_backend, check_steps};
use distflash_test_support::collective_case::check_collectives;
use distflash_test_support::within;

type WgpuF16 = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, half::f16, i32, u32>;

#[test]
fn wgpu_f16_matches_reference() {
    check_backend::<Autodiff<WgpuF16>>(&WgpuDevice::Cpu, ElemType::F16);
}

/// f16 takes the path of bf16 (summed in f32, rounded once), which no CPU backend holds.
#[test]
fn collectives_in_f16_on_wgpu_equal_a_rank_ordered_host_sum_for_one_to_eight_ranks() {
    within(Duration::from_secs(480), || {
        for world in 1..=8 {
            let groups = DeviceGroup::<WgpuF16>::in_process(vec![WgpuDevice::Cpu; world]);
            check_collectives(groups, DType::F16);
        }
    });
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn cuda_f16_matches_reference() {
    type CudaF16 = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, half::f16, i32, u8>;
    check_backend::<Autodiff<CudaF16>>(&cubecl::cuda::CudaDevice::new(0), ElemType::F16);
    check_steps::<CudaF16>(&cubecl::cuda::CudaDevice::new(0), ElemType::F16);
}
