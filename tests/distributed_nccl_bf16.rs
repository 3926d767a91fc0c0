//! Sequence-parallel attention over NCCL in bf16 (its own binary: Burn 0.21 fixes one default
//! float type per device and process), sliding windows and documents included. Run with
//! `--ignored` on a machine with several GPUs.

mod common;

use std::time::Duration;

use burn::backend::Autodiff;
use burn_distflash::collective::nccl;
use burn_distflash::schedule::ScheduleKind;
use burn_distflash::{DeviceGroup, SlidingWindow};
use common::distributed_case::{check_groups, Case};
use common::within::within;
use cubecl::cuda::CudaDevice;
use distflash_kernels::ElemType;

type CudaBf16 = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, half::bf16, i32, u8>;

#[test]
#[ignore = "needs 2 or more CUDA GPUs and NCCL"]
fn nccl_groups_in_bf16_match_f64_attention() {
    let available = nccl::device_count().expect("CUDA driver");
    within(Duration::from_secs(900), move || {
        for world in [2, 4] {
            if available < world {
                eprintln!("skipping world size {world}: {available} GPUs");
                continue;
            }
            for case in [
                Case {
                    head_dim: 128,
                    q_heads: 8,
                    kv_heads: 2,
                    ..Case::new(world, 96, ScheduleKind::Balanced)
                },
                Case {
                    head_dim: 64,
                    ..Case::new(world, 130, ScheduleKind::Ring)
                },
                // A window shorter than a zigzag chunk: only neighbours' keys are exchanged.
                Case {
                    head_dim: 128,
                    q_heads: 8,
                    kv_heads: 2,
                    window: Some(SlidingWindow::causal(40)),
                    ..Case::new(world, 96, ScheduleKind::Zigzag)
                },
                // Documents of odd lengths, across shard boundaries and longer than a shard.
                Case {
                    head_dim: 64,
                    documents: Some(&[&[37, 150, 5, 200]]),
                    ..Case::new(world, 130, ScheduleKind::Balanced)
                },
                // A two-sided window inside documents, without causal order.
                Case {
                    head_dim: 64,
                    causal: false,
                    window: Some(SlidingWindow::two_sided(20, 70)),
                    documents: Some(&[&[300, 11]]),
                    ..Case::new(world, 130, ScheduleKind::Ring)
                },
            ] {
                let devices: Vec<CudaDevice> = (0..world).map(CudaDevice::new).collect();
                let groups = DeviceGroup::<CudaBf16>::nccl(&devices).expect("NCCL group");
                check_groups::<Autodiff<CudaBf16>>(devices, groups, case, ElemType::BF16);
                eprintln!("ok: {case:?}");
            }
        }
    });
}
