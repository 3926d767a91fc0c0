//! Sequence-parallel attention on the CubeCL backends (this project's kernels for every step),
//! in-process transport: wgpu on the CPU in CI; CUDA on the GPU machine (`--ignored`).

mod common;

use std::time::Duration;

use burn::backend::Autodiff;
use burn_distflash::schedule::ScheduleKind;
use common::distributed_case::{check, within, Case};
use distflash_kernels::ElemType;

type WgpuF32 = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
type FusedWgpuF32 = burn_fusion::Fusion<WgpuF32>;
type CudaF32 = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

const LIMIT: Duration = Duration::from_secs(900);

fn cases(head_dim: usize) -> [Case; 3] {
    let with_dim = |c: Case| Case { head_dim, ..c };
    [
        with_dim(Case::new(3, 9, ScheduleKind::Balanced)),
        with_dim(Case::new(4, 8, ScheduleKind::Balanced)),
        Case {
            overlap: false,
            ..with_dim(Case::new(2, 11, ScheduleKind::Ring))
        },
    ]
}

#[test]
fn wgpu_kernels_across_ranks() {
    within(LIMIT, || {
        for case in cases(32) {
            let devices = vec![cubecl::wgpu::WgpuDevice::Cpu; case.world];
            check::<Autodiff<WgpuF32>>(devices, case, ElemType::F32);
        }
    });
}

#[test]
fn fused_wgpu_across_ranks() {
    within(LIMIT, || {
        let case = Case::new(3, 7, ScheduleKind::Balanced);
        let devices = vec![cubecl::wgpu::WgpuDevice::Cpu; case.world];
        check::<Autodiff<FusedWgpuF32>>(devices, case, ElemType::F32);
    });
}

/// One GPU shared by every rank (the NCCL path has its own tests).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_kernels_across_ranks() {
    within(LIMIT, || {
        for case in cases(128) {
            let devices = vec![cubecl::cuda::CudaDevice::new(0); case.world];
            check::<Autodiff<CudaF32>>(devices, case, ElemType::F32);
        }
    });
}
