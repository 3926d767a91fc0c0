//! The backward streaming another rank's key/value shard in row parts
//! ([`SequenceParallelOptions::backward_parts`]) on ndarray and wgpu (in-process transport):
//! ring, balanced and zigzag at P = 2..4, 2 and 4 parts, causal, under a window and documents,
//! with and without overlap, forward and every gradient against f64 attention over the whole
//! sequence, each rank's messages per exchange as the schedule predicts with the parts counted
//! (the key/value chunks and their gradients once per part). Parts that do not cut a layout
//! chunk evenly, and ranks that pass different parts, are refused.

use std::time::Duration;

use crate::common::distributed_case::{check, disagreements, Case};
use crate::common::within::within;
use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn::tensor::Tensor;
use burn_distflash::collective::on_each_rank;
use burn_distflash::schedule::ScheduleKind;
use burn_distflash::sequence_parallel::{sequence_parallel_attention, SequenceParallelOptions};
use burn_distflash::{DeviceGroup, Error, SlidingWindow};
use distflash_kernels::ElemType;

type Cpu = Autodiff<NdArray<f32>>;
type WgpuF32 = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
const LIMIT: Duration = Duration::from_secs(600);

/// Tokens per shard: zigzag chunks of 4, cut into 2 or 4 parts.
const SHARD: usize = 8;

fn cpu(world: usize) -> Vec<NdArrayDevice> {
    vec![NdArrayDevice::Cpu; world]
}

/// `case(world, schedule)` in 2 and 4 parts at P = 2..4, ring, balanced and zigzag, on ndarray.
fn in_parts_everywhere(case: impl Fn(Case) -> Case) {
    let mut cases = Vec::new();
    for world in 2..=4 {
        for schedule in [
            ScheduleKind::Ring,
            ScheduleKind::Balanced,
            ScheduleKind::Zigzag,
        ] {
            for parts in [2, 4] {
                cases.push(case(Case::new(world, SHARD, schedule).in_parts(parts)));
            }
        }
    }
    within(LIMIT, move || {
        for case in cases {
            check::<Cpu>(cpu(case.world), case, ElemType::F32);
        }
    });
}

#[test]
fn causal_attention_in_parts_matches_single_device_attention() {
    in_parts_everywhere(|case| case);
}

#[test]
fn in_parts_without_overlap() {
    in_parts_everywhere(|case| Case {
        overlap: false,
        ..case
    });
}

#[test]
fn a_window_in_parts_skips_the_parts_no_query_sees() {
    for size in [2, 5] {
        in_parts_everywhere(|case| Case {
            window: Some(SlidingWindow::causal(size).unwrap()),
            ..case
        });
    }
}

#[test]
fn documents_in_parts() {
    in_parts_everywhere(|case| Case {
        documents: Some(&[&[3, 7]]),
        ..case
    });
    in_parts_everywhere(|case| Case {
        batch: 2,
        causal: false,
        window: Some(SlidingWindow::two_sided(2, 3)),
        documents: Some(&[&[9], &[4, 5]]),
        ..case
    });
}

#[test]
fn wgpu_kernels_in_parts() {
    within(Duration::from_secs(900), || {
        for case in [
            Case::new(2, SHARD, ScheduleKind::Zigzag).in_parts(4),
            Case::new(3, SHARD, ScheduleKind::Ring).in_parts(2),
            Case {
                window: Some(SlidingWindow::causal(5).unwrap()),
                ..Case::new(4, SHARD, ScheduleKind::Zigzag).in_parts(2)
            },
            Case {
                documents: Some(&[&[3, 7]]),
                ..Case::new(3, SHARD, ScheduleKind::Balanced).in_parts(4)
            },
        ] {
            let devices = vec![cubecl::wgpu::WgpuDevice::Cpu; case.world];
            check::<Autodiff<WgpuF32>>(devices, case, ElemType::F32);
        }
    });
}

fn shard(len: usize) -> Tensor<NdArray<f32>, 4> {
    Tensor::ones([1, 2, len, 16], &NdArrayDevice::Cpu)
}

/// What each of two ranks gets from attention over shards of `SHARD` rows with `options(rank)`.
fn two_ranks(options: fn(usize) -> SequenceParallelOptions) -> Vec<Result<(), Error>> {
    within(LIMIT, move || {
        let groups = DeviceGroup::<NdArray<f32>>::in_process(cpu(2));
        on_each_rank(groups, move |rank, group| {
            let (q, k, v) = (shard(SHARD), shard(SHARD), shard(SHARD));
            sequence_parallel_attention(q, k, v, &group, &options(rank)).map(|_| ())
        })
    })
}

#[test]
fn parts_that_do_not_cut_a_chunk_evenly_are_refused_with_what_is_allowed() {
    // Zigzag chunks of 4 rows: 1, 2 or 4 parts.
    fn zigzag(parts: usize) -> SequenceParallelOptions {
        (SequenceParallelOptions::causal())
            .with_schedule(ScheduleKind::Zigzag)
            .with_backward_parts(parts)
    }
    for results in [two_ranks(|_| zigzag(0)), two_ranks(|_| zigzag(3))] {
        for result in results {
            match result {
                Err(e @ Error::Config { .. }) => {
                    let msg = e.to_string();
                    assert!(
                        msg.contains("backward_parts") && msg.contains("one of 1, 2, 4"),
                        "{msg}"
                    );
                }
                other => panic!("expected a configuration error, got {other:?}"),
            }
        }
    }
    // A contiguous shard of 8 rows is one chunk: 8 parts cut it.
    let ring = |_| {
        (SequenceParallelOptions::causal())
            .with_schedule(ScheduleKind::Ring)
            .with_backward_parts(8)
    };
    for result in two_ranks(ring) {
        result.expect("8 parts of a contiguous shard of 8 rows");
    }
}

#[test]
fn ranks_that_pass_different_parts_are_refused_on_every_rank() {
    let options = |rank| SequenceParallelOptions::causal().with_backward_parts(1 + rank);
    for msg in disagreements(two_ranks(options)) {
        assert!(
            msg.contains("backward parts 1") && msg.contains("backward parts 2"),
            "{msg}"
        );
    }
}
