//! Sequence-parallel attention over NCCL on 2 and 4 GPUs (the backward's remote shard whole and
//! in row parts), and many calls (forward-only and
//! training mixed) on every world size from 2 to the number of GPUs, at most 8 (run with
//! `--ignored` on a machine with several CUDA GPUs; a world size the machine has no GPUs for is
//! skipped with a message, and a machine without two GPUs fails the test).

use std::time::Duration;

use crate::common::distributed_case::Case;
use crate::common::nccl_case::{check_nccl_worlds, Cuda};
use crate::common::repeated_case::{check_repeated, MIXED};
use crate::common::within::within;
use burn::backend::Autodiff;
use burn_distflash::collective::nccl;
use burn_distflash::schedule::ScheduleKind;
use burn_distflash::{DeviceGroup, SlidingWindow};
use cubecl::cuda::CudaDevice;
use distflash_kernels::ElemType;

type CudaF32 = Cuda<f32>;

#[test]
#[ignore = "needs 2 or more CUDA GPUs and NCCL"]
fn nccl_groups_match_single_device_attention() {
    within(Duration::from_secs(900), || {
        check_nccl_worlds::<f32>(&[2, 4], ElemType::F32, |world| {
            vec![
                Case::new(world, 100, ScheduleKind::Balanced),
                Case::new(world, 64, ScheduleKind::Ring),
                Case {
                    overlap: false,
                    head_dim: 128,
                    q_heads: 8,
                    kv_heads: 2,
                    ..Case::new(world, 77, ScheduleKind::Balanced)
                },
                Case {
                    window: Some(SlidingWindow::causal(9).unwrap()),
                    documents: Some(&[&[1, 40, 23]]),
                    ..Case::new(world, 64, ScheduleKind::Auto)
                },
                // The backward streaming the remote key/value shard in row parts.
                Case::new(world, 64, ScheduleKind::Zigzag).in_parts(4),
                Case {
                    documents: Some(&[&[1, 40, 23]]),
                    ..Case::new(world, 96, ScheduleKind::Ring).in_parts(2)
                },
                Case {
                    overlap: false,
                    ..Case::new(world, 64, ScheduleKind::Balanced).in_parts(2)
                },
            ]
        });
    });
}

#[test]
#[ignore = "needs 2 or more CUDA GPUs and NCCL"]
fn nccl_groups_stay_exact_over_repeated_forward_and_training_calls() {
    let available = nccl::device_count().expect("CUDA driver");
    assert!(available >= 2, "needs 2 or more GPUs, found {available}");
    within(Duration::from_secs(900), move || {
        for world in 2..=available.min(8) {
            for case in [
                Case::new(world, 64, ScheduleKind::Ring),
                Case::new(world, 64, ScheduleKind::Balanced),
                Case {
                    overlap: false,
                    ..Case::new(world, 64, ScheduleKind::Auto)
                },
            ] {
                let devices: Vec<CudaDevice> = (0..world).map(CudaDevice::new).collect();
                let groups = DeviceGroup::<CudaF32>::nccl(&devices).expect("NCCL group");
                check_repeated::<Autodiff<CudaF32>>(devices, groups, case, ElemType::F32, &MIXED);
                eprintln!("ok: {case:?}");
            }
        }
    });
}
