//! Sequence-parallel attention on the CubeCL backends (this project's kernels for every step),
//! in-process transport: wgpu on the CPU in CI; CUDA on the GPU machine (`--ignored`); windows
//! and documents through the kernels' masks. Tensors on a device other than their rank's (or
//! their module's) are refused before any work.

use std::time::Duration;

use crate::common::distributed_case::{check, Case};
use crate::common::within::within;
use burn::backend::Autodiff;
use burn_distflash::schedule::ScheduleKind;
use burn_distflash::SlidingWindow;
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

/// A window, documents, and both with per-row documents and no causal order, over the
/// contiguous and zigzag layouts: each step's mask at its blocks' positions.
#[test]
fn wgpu_kernels_across_ranks_under_windows_and_documents() {
    within(LIMIT, || {
        for case in [
            Case {
                window: Some(SlidingWindow::causal(5).unwrap()),
                ..Case::new(3, 8, ScheduleKind::Ring)
            },
            Case {
                documents: Some(&[&[3, 7]]),
                ..Case::new(4, 6, ScheduleKind::Zigzag)
            },
            Case {
                batch: 2,
                causal: false,
                window: Some(SlidingWindow::two_sided(2, 3)),
                documents: Some(&[&[9], &[4, 5]]),
                ..Case::new(2, 10, ScheduleKind::Balanced)
            },
        ] {
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

/// One GPU shared by every rank (the NCCL path has its own tests). Shard lengths whose f32 rows
/// are not a power-of-two number of bytes (100, 9) are where CUDA's pitched allocations show:
/// a state the kernels write must not be a copy.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_kernels_across_ranks() {
    within(LIMIT, || {
        let single = Case::new(1, 100, ScheduleKind::Ring);
        for case in cases(128).into_iter().chain([single]) {
            let devices = vec![cubecl::cuda::CudaDevice::new(0); case.world];
            check::<Autodiff<CudaF32>>(devices, case, ElemType::F32);
        }
    });
}

/// A second wgpu device (Mesa's software Vulkan again in CI, but another device to Burn).
fn other_device() -> cubecl::wgpu::WgpuDevice {
    cubecl::wgpu::WgpuDevice::DefaultDevice
}

#[test]
fn tensors_on_another_device_are_refused_before_any_work() {
    use burn::tensor::Tensor;
    use burn_distflash::sequence_parallel::{sequence_parallel_attention, SequenceParallelOptions};
    use burn_distflash::AttentionContext;
    use burn_distflash::{DeviceGroup, DistFlashAttentionConfig, Error};
    let here = cubecl::wgpu::WgpuDevice::Cpu;
    let group = DeviceGroup::<WgpuF32>::in_process(vec![here.clone()]).remove(0);
    let shard = |device| Tensor::<WgpuF32, 4>::ones([1, 2, 8, 16], device);
    let options = SequenceParallelOptions::causal();
    fn device_error<T>(result: Result<T, Error>, what: &str) {
        match result {
            Err(e @ Error::Device { .. }) => assert!(e.to_string().contains(what), "{e}"),
            Err(other) => panic!("expected a device error, got {other}"),
            Ok(_) => panic!("expected a device error"),
        }
    }
    let elsewhere = other_device();
    let mixed = sequence_parallel_attention(
        shard(&here),
        shard(&elsewhere),
        shard(&here),
        &group,
        &options,
    );
    device_error(mixed, "k is on");
    let away = sequence_parallel_attention(
        shard(&elsewhere),
        shard(&elsewhere),
        shard(&elsewhere),
        &group,
        &options,
    );
    device_error(away, "computes on");
    assert!(group.take_traffic().messages.is_empty());

    let module = DistFlashAttentionConfig::new(32, 2).init::<WgpuF32>(&here);
    let x = |device| Tensor::<WgpuF32, 3>::ones([1, 8, 32], device);
    device_error(
        module.try_forward(x(&elsewhere), &AttentionContext::Local),
        "the module weights' device",
    );
    let remote = DistFlashAttentionConfig::new(32, 2).init::<WgpuF32>(&elsewhere);
    let sharded = AttentionContext::sharded(group.clone());
    device_error(
        remote.try_forward(x(&elsewhere), &sharded),
        "of its group computes on",
    );
    assert_eq!(module.counter.get() + remote.counter.get(), 0);
}
