//! Gradient checkpointing of transformer blocks on the CPU: every gradient equal across the
//! three placements, on one device and on each rank of an in-process group (whose weight
//! gradients also sum to the single-device ones), with attention over all heads at once or over
//! groups of heads; attention's forward counted per step.

use std::time::Duration;

use crate::common::block_case::{
    assert_same_step, combine, in_head_groups, lift, random_blocks, relative_error, small_config,
    step, step_with_documents, StepResult,
};
use crate::common::within::within;
use crate::common::Rng;
use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Tensor, TensorData};
use burn_distflash::collective::on_each_rank;
use burn_distflash::layers::CheckpointPlacement;
use burn_distflash::layers::TransformerBlockConfig;
use burn_distflash::schedule::ScheduleKind;
use burn_distflash::sequence_parallel::shard_sequence;
use burn_distflash::{AttentionContext, DeviceGroup, DistFlashAttentionConfig, Documents, Error};

type Inner = NdArray<f32>;
type Cpu = Autodiff<Inner>;
const LIMIT: Duration = Duration::from_secs(300);
const PLACEMENTS: [CheckpointPlacement; 3] = [
    CheckpointPlacement::None,
    CheckpointPlacement::Layer,
    CheckpointPlacement::AttentionOutput,
];
/// f32 through two blocks; the placements differ only in the order of float operations.
const TOLERANCE: f64 = 2e-5;

fn random(rng: &mut Rng, dims: [usize; 3]) -> Tensor<Inner, 3> {
    let n = dims.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.uniform() as f32).collect();
    Tensor::from_data(TensorData::new(values, dims), &NdArrayDevice::Cpu)
}

fn single_device(
    placement: CheckpointPlacement,
    x: &Tensor<Inner, 3>,
    r: &Tensor<Inner, 3>,
) -> StepResult {
    grouped_on_one_device(&small_config(), 1, placement, x, r, None)
}

/// [`single_device`] for blocks of `config` whose attention runs over `groups` groups of heads,
/// within `documents` when given.
fn grouped_on_one_device(
    config: &TransformerBlockConfig,
    groups: usize,
    placement: CheckpointPlacement,
    x: &Tensor<Inner, 3>,
    r: &Tensor<Inner, 3>,
    documents: Option<&Documents>,
) -> StepResult {
    let blocks = random_blocks::<Cpu>(config, 7, &NdArrayDevice::Cpu);
    let copies = in_head_groups(lift(&blocks, placement, &[NdArrayDevice::Cpu]), groups);
    let context = AttentionContext::Local;
    step_with_documents(&copies[0], x.clone(), r.clone(), &context, documents)
}

#[test]
fn placements_give_the_same_gradients_on_one_device() {
    let mut rng = Rng::new(1);
    let (x, r) = (random(&mut rng, [2, 24, 64]), random(&mut rng, [2, 24, 64]));
    let none = single_device(CheckpointPlacement::None, &x, &r);
    for placement in [
        CheckpointPlacement::Layer,
        CheckpointPlacement::AttentionOutput,
    ] {
        let got = single_device(placement, &x, &r);
        assert_same_step(&format!("{placement:?}"), &got, &none, TOLERANCE);
    }
}

#[test]
fn attention_forward_runs_once_with_the_attention_output_placement_and_twice_per_layer() {
    let mut rng = Rng::new(2);
    let (x, r) = (random(&mut rng, [1, 16, 64]), random(&mut rng, [1, 16, 64]));
    let counts = |p| single_device(p, &x, &r).attention_forwards;
    assert_eq!(counts(CheckpointPlacement::None), vec![1, 1]);
    assert_eq!(counts(CheckpointPlacement::Layer), vec![2, 2]);
    assert_eq!(counts(CheckpointPlacement::AttentionOutput), vec![1, 1]);
}

/// Each rank's step on its shard of `x` and `r`.
fn sharded(
    world: usize,
    placement: CheckpointPlacement,
    schedule: ScheduleKind,
    x: &Tensor<Inner, 3>,
    r: &Tensor<Inner, 3>,
) -> Vec<StepResult> {
    let ranks = sharded_in_groups(world, placement, schedule, 1, x, r);
    ranks.into_iter().map(|(result, _)| result).collect()
}

/// [`sharded`] with attention over `head_groups` groups of heads; beside each rank's results,
/// how many exchanges it made.
fn sharded_in_groups(
    world: usize,
    placement: CheckpointPlacement,
    schedule: ScheduleKind,
    head_groups: usize,
    x: &Tensor<Inner, 3>,
    r: &Tensor<Inner, 3>,
) -> Vec<(StepResult, usize)> {
    let devices = vec![NdArrayDevice::Cpu; world];
    let blocks = random_blocks::<Cpu>(&small_config(), 7, &devices[0]);
    let shard = x.dims()[1] / world;
    let groups = DeviceGroup::<Inner>::in_process(devices.clone());
    let layout = schedule.resolve(world, true).layout();
    let rows = |t: &Tensor<Inner, 3>, rank| {
        assert_eq!(t.dims()[1], shard * world);
        shard_sequence(t.clone(), 1, layout, world, rank).unwrap()
    };
    let copies = in_head_groups(lift(&blocks, placement, &devices), head_groups);
    let per_rank = (groups.into_iter().zip(copies))
        .enumerate()
        .map(|(rank, (group, blocks))| (group, blocks, rows(x, rank), rows(r, rank)))
        .collect();
    on_each_rank(per_rank, |_, (group, blocks, x, r)| {
        let context = AttentionContext::sharded(group.clone()).with_schedule(schedule);
        let result = step(&blocks, x, r, &context);
        (result, group.take_traffic().messages.len())
    })
}

#[test]
fn placements_agree_on_every_rank_and_the_ranks_together_equal_one_device() {
    within(LIMIT, || {
        let mut rng = Rng::new(3);
        let (x, r) = (random(&mut rng, [2, 24, 64]), random(&mut rng, [2, 24, 64]));
        let single = single_device(CheckpointPlacement::None, &x, &r);
        for (world, schedule) in [
            (2, ScheduleKind::Auto),
            (3, ScheduleKind::Balanced),
            (4, ScheduleKind::Ring),
            (3, ScheduleKind::Zigzag),
        ] {
            let reference = sharded(world, CheckpointPlacement::None, schedule, &x, &r);
            for placement in PLACEMENTS {
                let ranks = sharded(world, placement, schedule, &x, &r);
                for (rank, (got, expected)) in ranks.iter().zip(&reference).enumerate() {
                    let what = format!("{world} ranks, {placement:?}, rank {rank}");
                    assert_same_step(&what, got, expected, TOLERANCE);
                    let expected_forwards = if placement == CheckpointPlacement::Layer {
                        2
                    } else {
                        1
                    };
                    assert_eq!(got.attention_forwards, vec![expected_forwards; 2], "{what}");
                }
                let what = format!("{world} ranks, {placement:?}, against one device");
                let layout = schedule.resolve(world, true).layout();
                assert_same_step(&what, &combine(&ranks, 2, layout), &single, 1e-4);
            }
        }
    });
}

#[test]
fn the_rotary_positions_of_a_shard_are_absolute() {
    // Same blocks, same data: a shard's rows must not match the first rows of the sequence.
    within(LIMIT, || {
        let mut rng = Rng::new(4);
        let (x, r) = (random(&mut rng, [2, 24, 64]), random(&mut rng, [2, 24, 64]));
        let ranks = sharded(2, CheckpointPlacement::None, ScheduleKind::Auto, &x, &r);
        let single = single_device(CheckpointPlacement::None, &x, &r);
        let combined = combine(&ranks, 2, ScheduleKind::Auto.resolve(2, true).layout());
        assert!(relative_error(&combined.output, &single.output) < 1e-5);
    });
}

/// Attention forwards per block and step at `placement`: twice when the layer is recomputed.
fn forwards(placement: CheckpointPlacement) -> usize {
    match placement {
        CheckpointPlacement::Layer => 2,
        _ => 1,
    }
}

#[test]
fn head_groups_give_the_same_gradients_and_forward_counts_as_all_heads_at_once() {
    within(LIMIT, || {
        let mut rng = Rng::new(5);
        let (x, r) = (random(&mut rng, [2, 24, 64]), random(&mut rng, [2, 24, 64]));
        let gqa = small_config();
        let mha = TransformerBlockConfig::new(DistFlashAttentionConfig::new(64, 4), 96);
        let documents = Documents::from_cu_seqlens(&[0, 7, 17, 24]).unwrap();
        for (config, groups, documents) in [
            (&gqa, 2, None),
            (&mha, 2, None),
            (&mha, 4, None),
            (&gqa, 2, Some(&documents)),
        ] {
            let all_heads = |p| grouped_on_one_device(config, 1, p, &x, &r, documents);
            let reference = all_heads(CheckpointPlacement::None);
            for placement in PLACEMENTS {
                let got = grouped_on_one_device(config, groups, placement, &x, &r, documents);
                let what = format!(
                    "{groups} groups of {} heads, {placement:?}, documents {}",
                    config.attention.n_heads,
                    documents.is_some()
                );
                assert_same_step(&what, &got, &reference, TOLERANCE);
                assert_eq!(
                    got.attention_forwards,
                    vec![forwards(placement); 2],
                    "{what}"
                );
            }
        }
    });
}

#[test]
fn head_groups_on_every_rank_equal_all_heads_at_once() {
    within(LIMIT, || {
        let mut rng = Rng::new(6);
        let (x, r) = (random(&mut rng, [2, 24, 64]), random(&mut rng, [2, 24, 64]));
        for (world, schedule) in [(2, ScheduleKind::Zigzag), (3, ScheduleKind::Balanced)] {
            let reference = sharded(world, CheckpointPlacement::None, schedule, &x, &r);
            for placement in [
                CheckpointPlacement::Layer,
                CheckpointPlacement::AttentionOutput,
            ] {
                let all_heads = sharded_in_groups(world, placement, schedule, 1, &x, &r);
                let ranks = sharded_in_groups(world, placement, schedule, 2, &x, &r);
                for (rank, ((got, exchanges), expected)) in ranks.iter().zip(&reference).enumerate()
                {
                    let what = format!("{world} ranks, 2 head groups, {placement:?}, rank {rank}");
                    assert_same_step(&what, got, expected, TOLERANCE);
                    assert_eq!(
                        got.attention_forwards,
                        vec![forwards(placement); 2],
                        "{what}"
                    );
                    // Each group of heads makes its own ring passes.
                    assert_eq!(*exchanges, 2 * all_heads[rank].1, "{what}: exchanges");
                }
            }
        }
    });
}

#[test]
fn head_groups_that_split_a_key_value_head_are_refused() {
    for groups in [0, 3, 4] {
        let config = small_config().with_attention_head_groups(groups);
        let err = config.try_init::<Cpu>(&NdArrayDevice::Cpu).unwrap_err();
        assert!(matches!(err, Error::Config { .. }), "{err}");
        let message = err.to_string();
        assert!(
            message.contains("a divisor of the key/value heads (2)"),
            "{message}"
        );
    }
}
