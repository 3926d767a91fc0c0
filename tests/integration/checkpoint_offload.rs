//! Host offload of layer checkpoints on the CPU backends (ndarray, and wgpu on lavapipe, both
//! through the synchronous default copies): a step with any offload policy gives bitwise the
//! loss, output and every gradient of the same step without offload, at both checkpoint
//! placements, on one device and on each rank of an in-process group; the host memory held
//! is what the blocks plan, and is freed by the backward or by dropping the graph; bad
//! configurations and a host without the memory are refused before any work.

use std::time::Duration;

use crate::common::block_case::{
    assert_bitwise, in_head_groups, lift_offloading, random, random_layers, small_config, step,
    StepResult,
};
use crate::common::within::within;
use crate::common::Rng;
use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use burn_distflash::collective::on_each_rank;
use burn_distflash::layers::{CheckpointPlacement, Offload, TransformerBlock};
use burn_distflash::offload::{held_bytes, HostOffload};
use burn_distflash::schedule::ScheduleKind;
use burn_distflash::sequence_parallel::shard_sequence;
use burn_distflash::{AttentionContext, DeviceGroup, Error, FlashAttentionBackend};
use distflash_test_support::exclusive_wgpu;

type Inner = NdArray<f32>;
type Cpu = Autodiff<Inner>;
type WgpuInner = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
type Wgpu = Autodiff<WgpuInner>;
const LIMIT: Duration = Duration::from_secs(300);
const PLACEMENTS: [CheckpointPlacement; 2] = [
    CheckpointPlacement::Layer,
    CheckpointPlacement::AttentionOutput,
];

/// One copy per device of `layers` random blocks checkpointed at `placement`, each layer
/// offloading as `policy` says.
pub(crate) fn model<B: AutodiffBackend + FlashAttentionBackend>(
    layers: usize,
    placement: CheckpointPlacement,
    policy: Offload,
    devices: &[B::Device],
) -> Vec<Vec<TransformerBlock<B>>> {
    let blocks = random_layers::<B>(&small_config(), 11, &devices[0], layers);
    lift_offloading(&blocks, placement, policy, devices)
}

/// Every policy against no offload, at both placements, on one device of backend `B`.
fn offload_changes_no_bit<B>(device: B::Device, layers: usize, policies: &[Offload])
where
    B: AutodiffBackend<InnerBackend: HostOffload> + FlashAttentionBackend,
{
    let mut rng = Rng::new(5);
    let x = random::<B::InnerBackend>(&mut rng, [2, 24, 64], &device);
    let r = random::<B::InnerBackend>(&mut rng, [2, 24, 64], &device);
    let context = AttentionContext::Local;
    for placement in PLACEMENTS {
        let off = &model::<B>(
            layers,
            placement,
            Offload::Off,
            std::slice::from_ref(&device),
        )[0];
        let expected = step(off, x.clone(), r.clone(), &context);
        for &policy in policies {
            let blocks = &model::<B>(layers, placement, policy, std::slice::from_ref(&device))[0];
            let got = step(blocks, x.clone(), r.clone(), &context);
            assert_bitwise(&format!("{placement:?}, {policy:?}"), &got, &expected);
            let held = held_bytes::<B::InnerBackend>(&device);
            assert_eq!(
                held, 0,
                "{placement:?}, {policy:?}: the backward took every entry"
            );
        }
    }
}

#[test]
fn offload_gives_bitwise_the_same_step_on_ndarray() {
    // A thread of its own: offload stores are per thread.
    within(LIMIT, || {
        offload_changes_no_bit::<Cpu>(
            NdArrayDevice::Cpu,
            4,
            &[
                Offload::All,
                Offload::AllButLast(1),
                Offload::AllButLast(3),
                Offload::AllButLast(4),
            ],
        )
    });
}

#[test]
fn offload_gives_bitwise_the_same_step_on_wgpu() {
    let _wgpu = exclusive_wgpu();
    within(LIMIT, || {
        offload_changes_no_bit::<Wgpu>(
            Default::default(),
            3,
            &[Offload::All, Offload::AllButLast(1)],
        )
    });
}

/// Each rank's step on its shard of `x` and `r`, over an in-process group of `world` ranks.
fn sharded(
    world: usize,
    placement: CheckpointPlacement,
    policy: Offload,
    x: &Tensor<Inner, 3>,
    r: &Tensor<Inner, 3>,
) -> Vec<(StepResult, u64)> {
    let devices = vec![NdArrayDevice::Cpu; world];
    let groups = DeviceGroup::<Inner>::in_process(devices.clone());
    let layout = ScheduleKind::Auto.resolve(world, true).layout();
    let rows = |t: &Tensor<Inner, 3>, rank| shard_sequence(t.clone(), 1, layout, world, rank);
    let per_rank = (groups
        .into_iter()
        .zip(model::<Cpu>(3, placement, policy, &devices)))
    .enumerate()
    .map(|(rank, (group, blocks))| {
        (
            group,
            blocks,
            rows(x, rank).unwrap(),
            rows(r, rank).unwrap(),
        )
    })
    .collect();
    on_each_rank(per_rank, |_, (group, blocks, x, r)| {
        let result = step(&blocks, x, r, &AttentionContext::sharded(group));
        (result, held_bytes::<Inner>(&NdArrayDevice::Cpu))
    })
}

#[test]
fn offload_gives_bitwise_the_same_step_on_every_rank_of_a_group() {
    within(LIMIT, || {
        let mut rng = Rng::new(6);
        let x = random::<Inner>(&mut rng, [2, 24, 64], &NdArrayDevice::Cpu);
        let r = random::<Inner>(&mut rng, [2, 24, 64], &NdArrayDevice::Cpu);
        for placement in PLACEMENTS {
            let expected = sharded(2, placement, Offload::Off, &x, &r);
            for policy in [Offload::All, Offload::AllButLast(1)] {
                let ranks = sharded(2, placement, policy, &x, &r);
                for (rank, ((got, held), (expected, _))) in ranks.iter().zip(&expected).enumerate()
                {
                    let what = format!("{placement:?}, {policy:?}, rank {rank}");
                    assert_bitwise(&what, got, expected);
                    assert_eq!(*held, 0, "{what}: host memory left behind");
                }
            }
        }
    });
}

#[test]
fn the_host_holds_what_the_blocks_plan_until_the_backward_or_the_graph_is_freed() {
    within(LIMIT, || {
        let device = NdArrayDevice::Cpu;
        let mut rng = Rng::new(7);
        let [batch, seq] = [2, 24];
        let x = random::<Inner>(&mut rng, [batch, seq, 64], &device);
        for placement in PLACEMENTS {
            let blocks = &model::<Cpu>(3, placement, Offload::AllButLast(1), &[device])[0];
            let planned: Vec<usize> = (blocks.iter())
                .flat_map(|b| b.offloaded_bytes(batch, seq))
                .collect();
            let per_layer = match placement {
                // The block input; attention's output [2, 4, 24, 16] and lse [2, 4, 24].
                CheckpointPlacement::AttentionOutput => vec![2 * 24 * 64 * 4, 3072 * 4, 192 * 4],
                _ => vec![2 * 24 * 64 * 4],
            };
            assert_eq!(
                planned,
                [per_layer.clone(), per_layer].concat(),
                "{placement:?}"
            );
            Cpu::prepare_host_offload(&device, &planned).expect("a few KB of host memory");
            let forward = || {
                let input = Tensor::<Cpu, 3>::from_inner(x.clone()).require_grad();
                let forward = blocks.iter().fold(input.clone(), |y, block| {
                    block.forward(y, &AttentionContext::Local)
                });
                (input, forward)
            };
            let (input, y) = forward();
            let total: usize = planned.iter().sum();
            assert_eq!(held_bytes::<Inner>(&device), total as u64, "{placement:?}");
            let grads = y.sum().backward();
            assert!(input.grad(&grads).is_some());
            assert_eq!(held_bytes::<Inner>(&device), 0, "{placement:?}: backward");
            // A graph dropped without its backward: Burn frees orphaned graphs at the next
            // backward, and their entries with them. That backward may be another test's, on
            // another thread of this process (Burn's graph cleanup is process-wide), so the
            // orphan's entries may already be gone when the next forward has run.
            let (_, y) = forward();
            assert_eq!(held_bytes::<Inner>(&device), total as u64, "{placement:?}");
            drop(y);
            let (_, y) = forward();
            let held = held_bytes::<Inner>(&device);
            assert!(
                held == 2 * total as u64 || held == total as u64,
                "{placement:?}: {held} bytes held, expected {} (the orphan's entries too) or {total}",
                2 * total
            );
            let _ = y.sum().backward();
            assert_eq!(
                held_bytes::<Inner>(&device),
                0,
                "{placement:?}: an orphaned graph's entries"
            );
        }
    });
}

#[test]
fn in_groups_of_heads_the_host_holds_each_groups_output_as_the_blocks_plan() {
    within(LIMIT, || {
        let device = NdArrayDevice::Cpu;
        let mut rng = Rng::new(8);
        let [batch, seq] = [2, 24];
        let x = random::<Inner>(&mut rng, [batch, seq, 64], &device);
        let placement = CheckpointPlacement::AttentionOutput;
        let copies = model::<Cpu>(2, placement, Offload::All, &[device]);
        let blocks = &in_head_groups(copies, 2)[0];
        let planned: Vec<usize> = (blocks.iter())
            .flat_map(|b| b.offloaded_bytes(batch, seq))
            .collect();
        // The block input; each group's output [2, 2, 24, 16], then the lse [2, 4, 24].
        let per_layer = vec![2 * 24 * 64 * 4, 1536 * 4, 1536 * 4, 192 * 4];
        assert_eq!(planned, [per_layer.clone(), per_layer].concat());
        Cpu::prepare_host_offload(&device, &planned).expect("a few KB of host memory");
        let input = Tensor::<Cpu, 3>::from_inner(x).require_grad();
        let y = (blocks.iter()).fold(input.clone(), |y, block| {
            block.forward(y, &AttentionContext::Local)
        });
        let total: usize = planned.iter().sum();
        assert_eq!(held_bytes::<Inner>(&device), total as u64);
        let grads = y.sum().backward();
        assert!(input.grad(&grads).is_some());
        assert_eq!(held_bytes::<Inner>(&device), 0);
    });
}

#[test]
fn offload_without_checkpoints_and_a_host_without_the_memory_are_refused() {
    let config = small_config().with_offload(true);
    let err = config.try_init::<Cpu>(&NdArrayDevice::Cpu).unwrap_err();
    assert!(
        matches!(&err, Error::Config { field, .. } if field == "offload"),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("CheckpointPlacement::None"),
        "{err}"
    );
    let config = config.with_checkpoint(CheckpointPlacement::Layer);
    assert!(config.try_init::<Cpu>(&NdArrayDevice::Cpu).is_ok());
    if burn_distflash::offload::host_memory_available().is_some() {
        let sizes = [usize::MAX / 4, usize::MAX / 4];
        let err = Cpu::prepare_host_offload(&NdArrayDevice::Cpu, &sizes).unwrap_err();
        let Error::Offload { needed, why } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(*needed, (usize::MAX / 4 * 2) as u64);
        assert!(why.contains("available (MemAvailable)"), "{why}");
        assert!(
            err.to_string().contains("offloading to host memory"),
            "{err}"
        );
    }
    assert_eq!(
        <Cpu as HostOffload>::prepare_host_offload(&NdArrayDevice::Cpu, &[]),
        Ok(())
    );
}
