//! Many sequence-parallel calls on one in-process group, forward-only (inference) and training
//! calls mixed, P = 2..8, every schedule, overlap on and off, every call checked against f64
//! attention: on wgpu (CI), fused wgpu and ndarray; CUDA with `--ignored`.
//!
//! Forward-only calls are the exposed ones: nothing keeps a rank's shards alive after its call
//! returns, so memory another rank still reads can be freed and reused by its owner.

use std::time::Duration;

use crate::common::distributed_case::{in_process_groups, Case};
use crate::common::repeated_case::{check_repeated, MIXED};
use crate::common::within::within;
use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::AutodiffBackend;
use burn_distflash::schedule::{Layout, ScheduleKind};
use burn_distflash::FlashAttentionBackend;
use distflash_kernels::ElemType;

type WgpuF32 = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
type FusedWgpuF32 = burn_fusion::Fusion<WgpuF32>;
type CudaF32 = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

const LIMIT: Duration = Duration::from_secs(900);

/// For every world size: every schedule with overlap, and `Auto` without. Schedules over the
/// zigzag layout (zigzag, and `Auto` at even P) need an even shard: `shard` is rounded up there.
fn cases(head_dim: usize, shard: usize) -> Vec<Case> {
    (2..=8)
        .flat_map(|world| {
            let case = |schedule: ScheduleKind, overlap| {
                let zigzag = schedule.resolve(world, true).layout() == Layout::Zigzag;
                let shard = if zigzag { shard + shard % 2 } else { shard };
                Case {
                    head_dim,
                    overlap,
                    ..Case::new(world, shard, schedule)
                }
            };
            [
                case(ScheduleKind::Ring, true),
                case(ScheduleKind::Balanced, true),
                case(ScheduleKind::Zigzag, true),
                case(ScheduleKind::Auto, false),
            ]
        })
        .collect()
}

/// Every case on an in-process group with every rank on `device`.
fn run_all<B>(device: B::Device, cases: Vec<Case>)
where
    B: AutodiffBackend + FlashAttentionBackend,
    B::InnerBackend: FlashAttentionBackend<Inner = B::Inner>,
{
    for case in cases {
        let devices = vec![device.clone(); case.world];
        let groups = in_process_groups::<B>(&devices);
        check_repeated::<B>(devices, groups, case, ElemType::F32, &MIXED);
    }
}

#[test]
fn wgpu_repeated_forward_and_training_calls() {
    within(LIMIT, || {
        run_all::<Autodiff<WgpuF32>>(cubecl::wgpu::WgpuDevice::Cpu, cases(16, 5))
    });
}

#[test]
fn fused_wgpu_repeated_forward_and_training_calls() {
    within(LIMIT, || {
        let cases = vec![
            Case::new(4, 5, ScheduleKind::Ring),
            Case::new(5, 4, ScheduleKind::Balanced),
        ];
        run_all::<Autodiff<FusedWgpuF32>>(cubecl::wgpu::WgpuDevice::Cpu, cases)
    });
}

#[test]
fn ndarray_repeated_forward_and_training_calls() {
    within(LIMIT, || {
        run_all::<Autodiff<NdArray<f32>>>(NdArrayDevice::Cpu, cases(16, 5))
    });
}

/// Every rank on one GPU (the NCCL path has its own repeated test in `distributed_nccl.rs`).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_repeated_forward_and_training_calls() {
    within(LIMIT, || {
        run_all::<Autodiff<CudaF32>>(cubecl::cuda::CudaDevice::new(0), cases(128, 64))
    });
}
