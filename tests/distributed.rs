//! Sequence-parallel attention on the in-process transport: world sizes 1-8, both schedules,
//! forward and every gradient against f64 attention over the whole sequence; messages per step
//! counted; bad input and silent peers give errors, not hangs.

mod common;

use std::thread;
use std::time::Duration;

use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn::tensor::Tensor;
use burn_distflash::schedule::ScheduleKind;
use burn_distflash::{
    sequence_parallel_attention, CommError, DeviceGroup, DistributedError, SequenceParallelOptions,
};
use common::distributed_case::{check, within, Case};
use distflash_kernels::ElemType;

type Cpu = Autodiff<NdArray<f32>>;
const LIMIT: Duration = Duration::from_secs(300);

fn cpu(world: usize) -> Vec<NdArrayDevice> {
    vec![NdArrayDevice::Cpu; world]
}

#[test]
fn every_world_size_and_schedule_matches_single_device_attention() {
    within(LIMIT, || {
        for world in 1..=8 {
            for schedule in [ScheduleKind::Ring, ScheduleKind::Balanced] {
                check::<Cpu>(cpu(world), Case::new(world, 5, schedule), ElemType::F32);
            }
        }
    });
}

#[test]
fn overlap_off_gives_the_same_results() {
    within(LIMIT, || {
        for (world, schedule) in [(3, ScheduleKind::Balanced), (4, ScheduleKind::Ring)] {
            let case = Case {
                overlap: false,
                ..Case::new(world, 6, schedule)
            };
            check::<Cpu>(cpu(world), case, ElemType::F32);
        }
    });
}

#[test]
fn odd_shapes_mqa_and_non_causal() {
    within(LIMIT, || {
        let odd = Case {
            batch: 2,
            q_heads: 3,
            kv_heads: 1,
            head_dim: 32,
            ..Case::new(5, 13, ScheduleKind::Balanced)
        };
        check::<Cpu>(cpu(5), odd, ElemType::F32);
        let full = Case {
            causal: false,
            ..Case::new(4, 7, ScheduleKind::Auto)
        };
        check::<Cpu>(cpu(4), full, ElemType::F32);
    });
}

/// Runs `body(rank, group)` on one thread per rank and returns each rank's result.
fn on_ranks<T: Send + 'static>(
    groups: Vec<DeviceGroup<NdArray<f32>>>,
    body: impl Fn(usize, DeviceGroup<NdArray<f32>>) -> T + Send + Sync + Copy + 'static,
) -> Vec<T> {
    let handles: Vec<_> = groups
        .into_iter()
        .enumerate()
        .map(|(rank, group)| thread::spawn(move || body(rank, group)))
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn shard(len: usize) -> Tensor<NdArray<f32>, 4> {
    Tensor::ones([1, 2, len, 16], &NdArrayDevice::Cpu)
}

#[test]
fn shards_of_unequal_length_are_refused_on_every_rank() {
    let results = within(LIMIT, || {
        let groups = DeviceGroup::<NdArray<f32>>::in_process(cpu(2));
        on_ranks(groups, |rank, group| {
            let len = 8 + rank;
            sequence_parallel_attention(
                shard(len),
                shard(len),
                shard(len),
                &group,
                &SequenceParallelOptions::causal(),
            )
            .map(|_| ())
        })
    });
    for result in results {
        match result {
            Err(DistributedError::Shards(msg)) => {
                assert!(
                    msg.contains("q [1, 2, 8, 16]") && msg.contains("q [1, 2, 9, 16]"),
                    "{msg}"
                )
            }
            other => panic!("expected a shard mismatch, got {other:?}"),
        }
    }
}

#[test]
fn a_silent_peer_gives_a_timeout_not_a_hang() {
    let result = within(LIMIT, || {
        let mut groups = DeviceGroup::<NdArray<f32>>::in_process_with_timeout(
            cpu(2),
            Duration::from_millis(500),
        );
        let silent = groups.pop().unwrap();
        let group = groups.pop().unwrap();
        let result = sequence_parallel_attention(
            shard(8),
            shard(8),
            shard(8),
            &group,
            &SequenceParallelOptions::causal(),
        );
        drop(silent);
        result.map(|_| ())
    });
    match result {
        Err(DistributedError::Comm(CommError::Timeout {
            rank: 0, peer: 1, ..
        })) => {}
        other => panic!("expected a timeout waiting for rank 1, got {other:?}"),
    }
}

#[test]
fn bad_shards_are_refused_before_any_exchange() {
    let group = DeviceGroup::<NdArray<f32>>::in_process(cpu(1)).remove(0);
    let q = Tensor::<NdArray<f32>, 4>::ones([1, 3, 8, 16], &NdArrayDevice::Cpu);
    let k = Tensor::<NdArray<f32>, 4>::ones([1, 2, 8, 16], &NdArrayDevice::Cpu);
    let err =
        sequence_parallel_attention(q, k.clone(), k, &group, &SequenceParallelOptions::causal())
            .unwrap_err();
    assert!(matches!(err, DistributedError::Attention(_)), "{err}");
    assert!(group.take_traffic().messages.is_empty());
}
