//! Sequence-parallel attention on the in-process transport: world sizes 1-8, every schedule,
//! forward and every gradient against f64 attention over the whole sequence; messages per step
//! counted; bad input (shapes, float types, options, disagreeing ranks) and silent peers give
//! errors, not hangs, and a group that failed refuses further calls at once.

use std::time::Duration;

use crate::common::distributed_case::{check, disagreements, Case};
use crate::common::within::within;
use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn::tensor::{DType, Tensor};
use burn_distflash::collective::on_each_rank;
use burn_distflash::schedule::ScheduleKind;
use burn_distflash::sequence_parallel::{sequence_parallel_attention, SequenceParallelOptions};
use burn_distflash::{DeviceGroup, Error};
use distflash_kernels::{ElemType, KernelError};

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
fn zigzag_and_auto_at_every_world_size_match_single_device_attention() {
    within(LIMIT, || {
        for world in 1..=8 {
            for schedule in [ScheduleKind::Zigzag, ScheduleKind::Auto] {
                check::<Cpu>(cpu(world), Case::new(world, 6, schedule), ElemType::F32);
            }
        }
    });
}

#[test]
fn overlap_off_gives_the_same_results() {
    within(LIMIT, || {
        for (world, schedule) in [
            (3, ScheduleKind::Balanced),
            (4, ScheduleKind::Ring),
            (3, ScheduleKind::Zigzag),
        ] {
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
        let odd_zigzag = Case {
            batch: 2,
            q_heads: 3,
            kv_heads: 1,
            head_dim: 32,
            ..Case::new(5, 14, ScheduleKind::Zigzag)
        };
        check::<Cpu>(cpu(5), odd_zigzag, ElemType::F32);
        let full_zigzag = Case {
            causal: false,
            ..Case::new(3, 10, ScheduleKind::Zigzag)
        };
        check::<Cpu>(cpu(3), full_zigzag, ElemType::F32);
    });
}

#[test]
fn an_odd_shard_under_zigzag_is_refused_with_what_is_allowed() {
    let results = within(LIMIT, || {
        let groups = DeviceGroup::<NdArray<f32>>::in_process(cpu(2));
        on_each_rank(groups, |_, group| {
            let options = SequenceParallelOptions::causal().with_schedule(ScheduleKind::Zigzag);
            sequence_parallel_attention(shard(7), shard(7), shard(7), &group, &options).map(|_| ())
        })
    });
    for result in results {
        match result {
            Err(e @ Error::Layout { world: 2, .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("multiple of 2") && msg.contains("7"), "{msg}");
            }
            other => panic!("expected a layout error, got {other:?}"),
        }
    }
}

fn shard(len: usize) -> Tensor<NdArray<f32>, 4> {
    Tensor::ones([1, 2, len, 16], &NdArrayDevice::Cpu)
}

/// The `RanksDisagree` error each of two ranks gets when rank `r` passes shards of `len(r)` rows with
/// `options(r)`.
fn shard_errors(
    len: fn(usize) -> usize,
    options: fn(usize) -> SequenceParallelOptions,
) -> Vec<String> {
    disagreements(within(LIMIT, move || {
        let groups = DeviceGroup::<NdArray<f32>>::in_process(cpu(2));
        on_each_rank(groups, move |rank, group| {
            let n = len(rank);
            sequence_parallel_attention(shard(n), shard(n), shard(n), &group, &options(rank))
                .map(|_| ())
        })
    }))
}

#[test]
fn shards_of_unequal_length_are_refused_on_every_rank() {
    let balanced = |_| SequenceParallelOptions::causal().with_schedule(ScheduleKind::Balanced);
    for msg in shard_errors(|rank| 8 + rank, balanced) {
        assert!(
            msg.contains("q [1, 2, 8, 16]") && msg.contains("q [1, 2, 9, 16]"),
            "{msg}"
        );
    }
}

#[test]
fn options_that_differ_across_ranks_are_refused_on_every_rank() {
    let options = |rank| SequenceParallelOptions::causal().with_overlap(rank == 0);
    for msg in shard_errors(|_| 8, options) {
        assert!(
            msg.contains("overlap 1") && msg.contains("overlap 0"),
            "{msg}"
        );
    }
    // One rank asking for the deterministic backward and the other not would sum dK/dV in
    // different orders on different ranks.
    let options = |rank| {
        let mut options = SequenceParallelOptions::causal();
        options.attention = options.attention.with_deterministic(rank == 1);
        options
    };
    for msg in shard_errors(|_| 8, options) {
        assert!(
            msg.contains("deterministic 1") && msg.contains("deterministic 0"),
            "{msg}"
        );
    }
}

#[test]
fn a_rank_that_refuses_its_shards_makes_every_rank_fail_at_once() {
    let start = std::time::Instant::now();
    let results = within(LIMIT, || {
        let groups = DeviceGroup::<NdArray<f32>>::in_process_with_timeout(cpu(2), LIMIT);
        on_each_rank(groups, |rank, group| {
            let k = match rank {
                0 => shard(8).cast(DType::F64),
                _ => shard(8),
            };
            sequence_parallel_attention(
                shard(8),
                k,
                shard(8),
                &group,
                &SequenceParallelOptions::causal(),
            )
            .map(|_| ())
        })
    });
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "a rank waited for the timeout"
    );
    match &results[0] {
        Err(Error::DType { tensor, .. }) => assert_eq!(tensor, "k"),
        other => panic!("rank 0: expected its own float-type error, got {other:?}"),
    }
    match &results[1] {
        Err(Error::PeerRefused { rank: 1, peer: 0 }) => {}
        other => panic!("rank 1: expected to hear of rank 0's refusal, got {other:?}"),
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
        let call = || {
            sequence_parallel_attention(
                shard(8),
                shard(8),
                shard(8),
                &group,
                &SequenceParallelOptions::causal(),
            )
            .map(|_| ())
        };
        let first = call();
        // The group is out of step now: the next call refuses at once.
        let start = std::time::Instant::now();
        let second = call();
        assert!(
            start.elapsed() < Duration::from_millis(500),
            "the second call waited"
        );
        drop(silent);
        (first, second)
    });
    match result.0 {
        Err(Error::Timeout {
            rank: 0, peer: 1, ..
        }) => {}
        other => panic!("expected a timeout waiting for rank 1, got {other:?}"),
    }
    match result.1 {
        Err(Error::Broken { rank: 0, .. }) => {}
        other => panic!("expected the broken group to refuse, got {other:?}"),
    }
}

/// The error of a one-rank call with these shards and options, checking that nothing moved.
fn refused(
    q: Tensor<NdArray<f32>, 4>,
    k: Tensor<NdArray<f32>, 4>,
    options: SequenceParallelOptions,
) -> Error {
    let group = DeviceGroup::<NdArray<f32>>::in_process(cpu(1)).remove(0);
    let err = sequence_parallel_attention(q, k.clone(), k, &group, &options).unwrap_err();
    assert!(group.take_traffic().messages.is_empty(), "{err}");
    err
}

#[test]
fn mixed_float_types_are_refused_before_any_exchange() {
    let err = refused(
        shard(8),
        shard(8).cast(DType::F64),
        SequenceParallelOptions::causal(),
    );
    assert!(
        matches!(&err, Error::DType { tensor, expected, got }
            if tensor == "k" && expected.contains("F32") && got == "F64"),
        "{err}"
    );
}

#[test]
fn a_score_scale_that_is_not_a_finite_number_is_refused_before_any_exchange() {
    for scale in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut options = SequenceParallelOptions::causal();
        options.attention.scale = Some(scale);
        let err = refused(shard(8), shard(8), options);
        assert!(
            matches!(&err, Error::Kernel(KernelError::BadOption { what }) if what.contains("finite")),
            "{err}"
        );
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
    assert!(
        matches!(err, Error::Kernel(KernelError::HeadGrouping { .. })),
        "{err}"
    );
    assert!(group.take_traffic().messages.is_empty());
}
