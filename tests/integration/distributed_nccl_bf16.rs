//! Sequence-parallel attention over NCCL in bf16 (run in its own process, as
//! `.ci/gpu-tests` does: Burn 0.21 fixes one default float type per device and process), sliding windows and documents included. Run with
//! `--ignored` on a machine with several GPUs.

use std::time::Duration;

use crate::common::distributed_case::Case;
use crate::common::nccl_case::check_nccl_worlds;
use crate::common::within::within;
use burn_distflash::schedule::ScheduleKind;
use burn_distflash::SlidingWindow;
use distflash_kernels::ElemType;

#[test]
#[ignore = "needs 2 or more CUDA GPUs and NCCL"]
fn nccl_groups_in_bf16_match_f64_attention() {
    within(Duration::from_secs(900), || {
        check_nccl_worlds::<half::bf16>(&[2, 4], ElemType::BF16, |world| {
            vec![
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
                    window: Some(SlidingWindow::causal(40).unwrap()),
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
            ]
        });
    });
}
