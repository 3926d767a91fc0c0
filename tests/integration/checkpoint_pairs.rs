//! Two layers per gradient checkpoint ([`BlockChain`], [`BlockPair`]) on the CPU backends: a
//! step's output, input gradient and every weight gradient are bitwise those of one layer
//! checkpoint per block, with and without packed documents, on one device and on each rank of
//! an in-process group, with the checkpoints on the device or offloaded to host memory (ndarray,
//! and wgpu on lavapipe); attention's forward runs twice per layer, as with layer checkpoints;
//! the host holds one input per offloaded pair, as the chain plans; blocks that cannot be paired
//! run alone, and what cannot be chained is refused.

use std::time::Duration;

use crate::checkpoint_offload::model;
use crate::common::block_case::{assert_bitwise, random, step_chained, StepResult};
use crate::common::within::within;
use crate::common::Rng;
use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use burn_distflash::collective::on_each_rank;
use burn_distflash::layers::{BlockChain, BlockPair, CheckpointPlacement, Offload};
use burn_distflash::offload::{held_bytes, HostOffload};
use burn_distflash::schedule::ScheduleKind;
use burn_distflash::sequence_parallel::shard_sequence;
use burn_distflash::{
    AttentionContext, CheckpointBackend, DeviceGroup, Documents, Error, FlashAttentionBackend,
};
use distflash_test_support::exclusive_wgpu;

type Inner = NdArray<f32>;
type Cpu = Autodiff<Inner>;
type WgpuInner = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
type Wgpu = Autodiff<WgpuInner>;
const LIMIT: Duration = Duration::from_secs(300);
const DEVICE: NdArrayDevice = NdArrayDevice::Cpu;
const DIMS: [usize; 3] = [2, 24, 64];

/// Documents of unequal lengths in each row of a `[2, 24]` batch.
fn documents() -> Documents {
    Documents::per_batch_row(&[vec![0, 5, 17, 24], vec![0, 11, 24]]).unwrap()
}

/// `layers` layer-checkpointed blocks offloading as `policy` says, one step on `device` with
/// `layers_per_checkpoint`.
fn one_device<B: AutodiffBackend + FlashAttentionBackend>(
    layers: usize,
    policy: Offload,
    layers_per_checkpoint: usize,
    device: &B::Device,
    documents: Option<&Documents>,
) -> StepResult {
    let mut rng = Rng::new(31);
    let x = random::<B::InnerBackend>(&mut rng, DIMS, device);
    let r = random::<B::InnerBackend>(&mut rng, DIMS, device);
    let devices = std::slice::from_ref(device);
    let blocks = &model::<B>(layers, CheckpointPlacement::Layer, policy, devices)[0];
    let context = AttentionContext::Local;
    step_chained(blocks, layers_per_checkpoint, x, r, &context, documents)
}

#[test]
fn pairs_give_bitwise_the_step_of_layer_checkpoints_with_and_without_documents() {
    let documents = documents();
    for layers in [2, 3, 4] {
        for docs in [None, Some(&documents)] {
            let run = |chained| one_device::<Cpu>(layers, Offload::Off, chained, &DEVICE, docs);
            let what = format!("{layers} layers, documents {}", docs.is_some());
            let (alone, paired) = (run(1), run(2));
            assert_bitwise(&what, &paired, &alone);
            // Twice per layer: the forward, and the backward's recomputation (the first block
            // of a pair at the attention output, which its own backward then reuses).
            assert_eq!(paired.attention_forwards, vec![2; layers], "{what}");
        }
    }
}

/// Offloading pairs against the same blocks with one checkpoint each and none offloaded, on
/// one device of backend `B`: bitwise, and the host empty after each backward.
fn offloaded_pairs_change_no_bit<B>(device: B::Device, policies: &[Offload])
where
    B: AutodiffBackend<InnerBackend: HostOffload> + FlashAttentionBackend,
{
    let expected = one_device::<B>(3, Offload::Off, 1, &device, None);
    for &policy in policies {
        let got = one_device::<B>(3, policy, 2, &device, None);
        assert_bitwise(&format!("{policy:?}"), &got, &expected);
        let held = held_bytes::<B::InnerBackend>(&device);
        assert_eq!(held, 0, "{policy:?}: the backward took every entry");
    }
}

#[test]
fn offloaded_pairs_give_bitwise_the_same_step_on_ndarray() {
    // A thread of its own: offload stores are per thread.
    within(LIMIT, || {
        let policies = [Offload::All, Offload::AllButLast(1), Offload::AllButLast(2)];
        offloaded_pairs_change_no_bit::<Cpu>(DEVICE, &policies)
    });
}

#[test]
fn offloaded_pairs_give_bitwise_the_same_step_on_wgpu() {
    let _wgpu = exclusive_wgpu();
    within(LIMIT, || {
        offloaded_pairs_change_no_bit::<Wgpu>(Default::default(), &[Offload::All])
    });
}

#[test]
fn the_host_holds_one_input_per_offloaded_pair_as_the_chain_plans() {
    within(LIMIT, || {
        let [batch, seq, d_model] = DIMS;
        let input = batch * seq * d_model * 4;
        let x = random::<Inner>(&mut Rng::new(7), DIMS, &DEVICE);
        // Three layers: a pair (whose first block says whether it offloads), then one alone.
        for (policy, planned) in [
            (Offload::All, vec![input, input]),
            (Offload::AllButLast(1), vec![input]),
            (Offload::AllButLast(2), vec![input]),
            (Offload::AllButLast(3), vec![]),
        ] {
            let blocks = &model::<Cpu>(3, CheckpointPlacement::Layer, policy, &[DEVICE])[0];
            let chain = BlockChain::try_new(blocks, 2).unwrap();
            assert_eq!(chain.offloaded_bytes(batch, seq), planned, "{policy:?}");
            Cpu::prepare_host_offload(&DEVICE, &planned).expect("a few KB of host memory");
            let input = Tensor::<Cpu, 3>::from_inner(x.clone()).require_grad();
            let y = chain
                .try_forward(input.clone(), &AttentionContext::Local)
                .unwrap();
            let total: usize = planned.iter().sum();
            assert_eq!(held_bytes::<Inner>(&DEVICE), total as u64, "{policy:?}");
            let grads = y.sum().backward();
            assert!(input.grad(&grads).is_some());
            assert_eq!(held_bytes::<Inner>(&DEVICE), 0, "{policy:?}: backward");
        }
    });
}

/// Each rank's step on its shard of the same data, within `documents` (boundaries of the whole
/// sequence), over an in-process group of `world` ranks.
fn sharded(
    world: usize,
    schedule: ScheduleKind,
    policy: Offload,
    layers_per_checkpoint: usize,
    documents: &Documents,
) -> Vec<StepResult> {
    let mut rng = Rng::new(32);
    let x = random::<Inner>(&mut rng, DIMS, &DEVICE);
    let r = random::<Inner>(&mut rng, DIMS, &DEVICE);
    let devices = vec![DEVICE; world];
    let groups = DeviceGroup::<Inner>::in_process(devices.clone());
    let layout = schedule.resolve(world, true).layout();
    let rows = |t: &Tensor<Inner, 3>, rank| shard_sequence(t.clone(), 1, layout, world, rank);
    let copies = model::<Cpu>(3, CheckpointPlacement::Layer, policy, &devices);
    let per_rank = (groups.into_iter().zip(copies))
        .enumerate()
        .map(|(rank, (group, blocks))| {
            let shards = (rows(&x, rank).unwrap(), rows(&r, rank).unwrap());
            (group, blocks, shards)
        })
        .collect();
    on_each_rank(per_rank, |_, (group, blocks, (x, r))| {
        let context = AttentionContext::sharded(group).with_schedule(schedule);
        let result = step_chained(
            &blocks,
            layers_per_checkpoint,
            x,
            r,
            &context,
            Some(documents),
        );
        assert_eq!(held_bytes::<Inner>(&DEVICE), 0, "host memory left behind");
        result
    })
}

#[test]
fn pairs_give_bitwise_the_step_of_layer_checkpoints_on_every_rank_of_a_group() {
    within(LIMIT, || {
        let documents = documents();
        for (world, schedule) in [(2, ScheduleKind::Auto), (3, ScheduleKind::Balanced)] {
            let expected = sharded(world, schedule, Offload::Off, 1, &documents);
            for policy in [Offload::Off, Offload::All] {
                let ranks = sharded(world, schedule, policy, 2, &documents);
                for (rank, (got, expected)) in ranks.iter().zip(&expected).enumerate() {
                    let what = format!("{world} ranks, {schedule:?}, {policy:?}, rank {rank}");
                    assert_bitwise(&what, got, expected);
                    assert_eq!(got.attention_forwards, vec![2; 3], "{what}");
                }
            }
        }
    });
}

#[test]
fn blocks_at_other_placements_run_alone() {
    for placement in [
        CheckpointPlacement::None,
        CheckpointPlacement::AttentionOutput,
    ] {
        let mut rng = Rng::new(33);
        let x = random::<Inner>(&mut rng, DIMS, &DEVICE);
        let r = random::<Inner>(&mut rng, DIMS, &DEVICE);
        let blocks = &model::<Cpu>(2, placement, Offload::Off, &[DEVICE])[0];
        let run = |chained| {
            let context = AttentionContext::Local;
            step_chained(blocks, chained, x.clone(), r.clone(), &context, None)
        };
        let (alone, chained) = (run(1), run(2));
        assert_bitwise(&format!("{placement:?}"), &chained, &alone);
        assert_eq!(chained.attention_forwards, vec![1, 1], "{placement:?}");
    }
}

#[test]
fn what_cannot_be_chained_is_refused_before_any_work() {
    let blocks = &model::<Cpu>(2, CheckpointPlacement::Layer, Offload::Off, &[DEVICE])[0];
    let config_field = |result: Result<_, Error>| match result {
        Err(Error::Config { field, .. }) => field,
        other => panic!("expected a configuration error, got {other:?}"),
    };
    for layers in [0, 3] {
        let refused = BlockChain::try_new(blocks, layers).map(|_| ());
        assert_eq!(config_field(refused), "layers_per_checkpoint", "{layers}");
    }
    let chain = BlockChain::try_new(blocks, 2).unwrap();
    let narrow = Tensor::<Cpu, 3>::zeros([2, 24, 32], &DEVICE);
    let err = chain
        .try_forward(narrow, &AttentionContext::Local)
        .unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err:?}");
    assert!(blocks.iter().all(|b| b.attention.counter.get() == 0));

    let at_output = &model::<Cpu>(
        2,
        CheckpointPlacement::AttentionOutput,
        Offload::Off,
        &[DEVICE],
    )[0];
    let refused = BlockPair::try_new(&at_output[0], &at_output[1]).map(|_| ());
    assert_eq!(config_field(refused), "checkpoint");
    let pair = BlockPair::try_new(&blocks[0], &blocks[1]).unwrap();
    let x = Tensor::<Cpu, 3>::zeros(DIMS, &DEVICE);
    let refused = Cpu::checkpointed(
        &pair,
        x,
        &AttentionContext::Local,
        None,
        CheckpointPlacement::AttentionOutput,
    );
    let err = refused.unwrap_err();
    assert!(
        err.to_string().contains("CheckpointPlacement::Layer"),
        "{err}"
    );
}
