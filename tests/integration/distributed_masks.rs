//! Sequence-parallel attention under sliding windows and documents on ndarray (in-process
//! transport): P = 1..8, contiguous and zigzag layouts, forward and every gradient
//! against f64 attention over the whole sequence with the same mask, each rank's messages per
//! exchange as its schedule predicts; a short window's traffic is the neighbours' chunks only
//! (counted from the transport's log); documents that do not cover the sequence, or that
//! differ across ranks, are refused.

use std::time::Duration;

use crate::common::distributed_case::{
    assert_messages, check, disagreements, in_process_groups, train_on_rank, with_devices, Case,
    CaseData,
};
use crate::common::within::within;
use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn::tensor::Tensor;
use burn_distflash::collective::on_each_rank;
use burn_distflash::kernels::KernelError;
use burn_distflash::schedule::ScheduleKind;
use burn_distflash::sequence_parallel::{sequence_parallel_attention, SequenceParallelOptions};
use burn_distflash::{DeviceGroup, Documents, Error, SlidingWindow};
use distflash_kernels::ElemType;

type Cpu = Autodiff<NdArray<f32>>;
const LIMIT: Duration = Duration::from_secs(600);

/// World sizes of the runs.
const WORLDS: std::ops::RangeInclusive<usize> = 1..=8;
/// Every layout: contiguous (ring, balanced) and zigzag.
const SCHEDULES: [ScheduleKind; 3] = [
    ScheduleKind::Ring,
    ScheduleKind::Balanced,
    ScheduleKind::Zigzag,
];
/// Tokens per shard: zigzag chunks of 3.
const SHARD: usize = 6;

fn cpu(world: usize) -> Vec<NdArrayDevice> {
    vec![NdArrayDevice::Cpu; world]
}

/// Runs `case` for every world size and schedule.
fn everywhere(case: impl Fn(Case) -> Case) {
    let cases: Vec<Case> = WORLDS
        .flat_map(|world| SCHEDULES.map(|schedule| case(Case::new(world, SHARD, schedule))))
        .collect();
    within(LIMIT, move || {
        for case in cases {
            check::<Cpu>(cpu(case.world), case, ElemType::F32);
        }
    });
}

#[test]
fn causal_windows_of_one_key_shorter_than_a_chunk_between_a_chunk_and_a_shard() {
    for size in [1, 2, 5] {
        everywhere(|case| Case {
            window: Some(SlidingWindow::causal(size).unwrap()),
            ..case
        });
    }
}

#[test]
fn a_causal_window_longer_than_a_shard() {
    everywhere(|case| Case {
        window: Some(SlidingWindow::causal(2 * SHARD - 3).unwrap()),
        ..case
    });
}

#[test]
fn two_sided_windows_without_causal_order() {
    for (before, after) in [(1, 2), (4, 7)] {
        everywhere(|case| Case {
            causal: false,
            window: Some(SlidingWindow::two_sided(before, after)),
            ..case
        });
    }
}

#[test]
fn documents_of_one_token() {
    everywhere(|case| Case {
        documents: Some(&[&[1]]),
        ..case
    });
}

#[test]
fn documents_of_odd_lengths_across_shard_boundaries() {
    const ODD: [&[&[usize]]; 2] = [&[&[5]], &[&[1, 4, 7]]];
    for documents in ODD {
        everywhere(|case| Case {
            documents: Some(documents),
            ..case
        });
    }
}

#[test]
fn documents_per_batch_row_with_a_window_and_without_causal_order() {
    everywhere(|case| Case {
        batch: 2,
        documents: Some(&[&[5], &[2, 9]]),
        ..case
    });
    everywhere(|case| Case {
        window: Some(SlidingWindow::causal(4).unwrap()),
        documents: Some(&[&[7, 2]]),
        ..case
    });
    everywhere(|case| Case {
        causal: false,
        documents: Some(&[&[3, 8]]),
        ..case
    });
}

#[test]
fn overlap_off_gives_the_same_results_under_masks() {
    within(LIMIT, || {
        for (world, schedule) in [(3, ScheduleKind::Balanced), (4, ScheduleKind::Zigzag)] {
            let case = Case {
                overlap: false,
                window: Some(SlidingWindow::causal(4).unwrap()),
                documents: Some(&[&[5, 8]]),
                ..Case::new(world, SHARD, schedule)
            };
            check::<Cpu>(cpu(world), case, ElemType::F32);
        }
    });
}

/// Messages each rank sent in the forward and in the backward of one training call (from the
/// transport's log), after checking the results and the messages per exchange.
fn messages_sent(case: Case) -> (Vec<usize>, Vec<usize>) {
    within(LIMIT, move || {
        let devices = cpu(case.world);
        let data = CaseData::new(case, ElemType::F32);
        let options = case.options();
        let groups = in_process_groups::<Cpu>(&devices);
        let per_rank = with_devices(&data, devices)
            .into_iter()
            .zip(groups)
            .collect();
        let results = on_each_rank(per_rank, |_, ((inputs, device), group)| {
            train_on_rank::<Cpu>(&inputs, &group, &device, &options)
        });
        data.assert_training(&format!("{case:?}"), &data.expected(), &results);
        assert_messages(&case, &results);
        let total = |log: &Vec<usize>| log.iter().sum::<usize>();
        (
            results.iter().map(|r| total(&r.forward_messages)).collect(),
            results
                .iter()
                .map(|r| total(&r.backward_messages))
                .collect(),
        )
    })
}

#[test]
fn a_short_window_moves_only_the_neighbours_chunks() {
    let window = |schedule| Case {
        window: Some(SlidingWindow::causal(3).unwrap()),
        ..Case::new(4, SHARD, schedule)
    };
    // Contiguous: rank r sends its keys and values to r + 1, which returns dk, dv.
    for schedule in [ScheduleKind::Ring, ScheduleKind::Balanced] {
        let (forward, backward) = messages_sent(window(schedule));
        assert_eq!(forward, [1, 1, 1, 0], "{schedule:?}");
        assert_eq!(backward, [1, 2, 2, 1], "{schedule:?}");
    }
    // Zigzag: rank r's early chunk goes to r + 1, its late chunk to r - 1, each returning
    // dk, dv.
    let (forward, backward) = messages_sent(window(ScheduleKind::Zigzag));
    assert_eq!(forward, [1, 2, 2, 1]);
    assert_eq!(backward, [2, 4, 4, 2]);
    // Documents inside the shards: nothing moves.
    let alone = Case {
        documents: Some(&[&[2, 1]]),
        ..Case::new(4, SHARD, ScheduleKind::Zigzag)
    };
    assert_eq!(messages_sent(alone), (vec![0; 4], vec![0; 4]));
}

fn shard(len: usize) -> Tensor<NdArray<f32>, 4> {
    Tensor::ones([1, 2, len, 16], &NdArrayDevice::Cpu)
}

/// What each of two ranks with shards of 8 tokens gets from a call with `options(rank)`.
fn two_ranks(
    options: impl Fn(usize) -> SequenceParallelOptions + Send + Sync + 'static,
) -> Vec<Result<(), Error>> {
    within(LIMIT, move || {
        let groups = DeviceGroup::<NdArray<f32>>::in_process(cpu(2));
        on_each_rank(groups, |rank, group| {
            sequence_parallel_attention(shard(8), shard(8), shard(8), &group, &options(rank))
                .map(|_| ())
        })
    })
}

fn with_documents(cu_seqlens: &[usize]) -> SequenceParallelOptions {
    let mut options = SequenceParallelOptions::causal();
    options.attention.mask.documents = Some(Documents::from_cu_seqlens(cu_seqlens).unwrap());
    options
}

#[test]
fn documents_that_do_not_cover_the_sequence_are_refused_on_every_rank() {
    // A shard's documents, and a longer sequence's, for a sequence of 2 x 8 tokens.
    for cu_seqlens in [[0, 5, 12], [0, 9, 20]] {
        let options = with_documents(&cu_seqlens);
        for result in two_ranks(move |_| options.clone()) {
            match result {
                Err(Error::Kernel(KernelError::BadMask { what })) => assert!(
                    what.contains(&format!("0..{}", cu_seqlens[2])) && what.contains("0..16"),
                    "{what}"
                ),
                other => panic!("expected a mask error, got {other:?}"),
            }
        }
    }
}

#[test]
fn ranks_with_different_windows_or_documents_are_refused() {
    let windows = |rank: usize| {
        let mut options = SequenceParallelOptions::causal();
        options.attention.mask.window = Some(SlidingWindow::causal(2 + rank).unwrap());
        options
    };
    for msg in disagreements(two_ranks(windows)) {
        assert!(
            msg.contains("window 1 before, 0 after") && msg.contains("window 2 before, 0 after"),
            "{msg}"
        );
    }
    let documents = |rank: usize| with_documents(&[0, 4 + rank, 16]);
    for msg in disagreements(two_ranks(documents)) {
        assert!(msg.contains("documents fingerprint"), "{msg}");
    }
}
