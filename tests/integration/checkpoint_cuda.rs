//! Gradient checkpointing on CUDA (run with `--ignored` on a GPU machine): the three placements
//! give the same gradients on one GPU, with attention over all heads at once or in groups of
//! heads, and with two layers per checkpoint, and on two GPUs over NCCL the ranks together equal
//! one GPU.

use crate::checkpoint_offload::model;
use crate::common::block_case::{
    assert_same_step, in_head_groups, lift, random as block_random, random_blocks, small_config,
    step, step_chained, StepResult,
};
use crate::common::Rng;
use burn::tensor::{Tensor, TensorData};
use burn_autodiff::Autodiff;
use burn_distflash::collective::on_each_rank;
use burn_distflash::layers::{CheckpointPlacement, Offload};
use burn_distflash::sequence_parallel::{shard_sequence, ScheduleKind};
use burn_distflash::{AttentionContext, DeviceGroup};
use cubecl::cuda::{CudaDevice, CudaRuntime};

type Inner = burn_cubecl::CubeBackend<CudaRuntime, f32, i32, u8>;
type Gpu = Autodiff<Inner>;
/// The GPU's f32 results differ from the CPU's by more than the CPU suite's 2e-5 (Burn's f32
/// matmul, which the linear layers used until they moved to cuBLAS, is TF32-like: about 1e-3
/// relative against f64), so the GPU comparison allows 1e-3; the CPU suite
/// (`checkpoint.rs`) holds 2e-5.
const GPU_TOLERANCE: f64 = 1e-3;

fn random(seed: u64, dims: [usize; 3], device: &CudaDevice) -> Tensor<Inner, 3> {
    let mut rng = Rng::new(seed);
    let n = dims.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.uniform() as f32).collect();
    Tensor::from_data(TensorData::new(values, dims), device)
}

fn one_gpu(placement: CheckpointPlacement) -> StepResult {
    one_gpu_in_groups(placement, 1)
}

/// [`one_gpu`] with attention over `groups` groups of heads.
fn one_gpu_in_groups(placement: CheckpointPlacement, groups: usize) -> StepResult {
    let device = CudaDevice::new(0);
    let blocks = random_blocks::<Gpu>(&small_config(), 7, &device);
    let (x, r) = (
        random(1, [2, 64, 64], &device),
        random(2, [2, 64, 64], &device),
    );
    let copies = in_head_groups(lift(&blocks, placement, &[device]), groups);
    step(&copies[0], x, r, &AttentionContext::Local)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn placements_give_the_same_gradients_on_one_gpu() {
    let none = one_gpu(CheckpointPlacement::None);
    assert_eq!(none.attention_forwards, vec![1, 1]);
    for placement in [
        CheckpointPlacement::Layer,
        CheckpointPlacement::AttentionOutput,
    ] {
        for groups in [1, 2] {
            let got = one_gpu_in_groups(placement, groups);
            let what = format!("{placement:?}, {groups} groups of heads");
            assert_same_step(&what, &got, &none, GPU_TOLERANCE);
        }
    }
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn two_gpus_over_nccl_agree_with_one_gpu_at_every_placement() {
    let single = one_gpu(CheckpointPlacement::None);
    let placements = [
        CheckpointPlacement::None,
        CheckpointPlacement::Layer,
        CheckpointPlacement::AttentionOutput,
    ];
    for (placement, head_groups) in placements.into_iter().flat_map(|p| [(p, 1), (p, 2)]) {
        let devices = [CudaDevice::new(0), CudaDevice::new(1)];
        let groups = DeviceGroup::<Inner>::nccl(&devices).expect("NCCL on two GPUs");
        let blocks = random_blocks::<Gpu>(&small_config(), 7, &devices[0]);
        let copies = in_head_groups(lift(&blocks, placement, &devices), head_groups);
        let per_rank = groups.into_iter().zip(devices).zip(copies).collect();
        let ranks: Vec<StepResult> = on_each_rank(per_rank, |rank, ((group, device), blocks)| {
            let layout = ScheduleKind::Auto.resolve(2, true).layout();
            let shard = |t| shard_sequence(t, 1, layout, 2, rank).unwrap();
            let x = shard(random(1, [2, 64, 64], &device));
            let r = shard(random(2, [2, 64, 64], &device));
            step(&blocks, x, r, &AttentionContext::sharded(group))
        });
        let combined = crate::common::block_case::combine(
            &ranks,
            2,
            ScheduleKind::Auto.resolve(ranks.len(), true).layout(),
        );
        assert_same_step(
            &format!("2 GPUs, {head_groups} groups of heads, {placement:?}"),
            &combined,
            &single,
            GPU_TOLERANCE,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pairs_of_layers_in_head_groups_agree_with_one_layer_per_checkpoint_on_one_gpu() {
    let device = CudaDevice::new(0);
    let run = |layers_per_checkpoint: usize, head_groups: usize| {
        let mut rng = Rng::new(31);
        let x = block_random::<Inner>(&mut rng, [2, 64, 64], &device);
        let r = block_random::<Inner>(&mut rng, [2, 64, 64], &device);
        let copies = model::<Gpu>(
            3,
            CheckpointPlacement::Layer,
            Offload::Off,
            std::slice::from_ref(&device),
        );
        let blocks = &in_head_groups(copies, head_groups)[0];
        let context = AttentionContext::Local;
        step_chained(blocks, layers_per_checkpoint, x, r, &context, None)
    };
    let reference = run(1, 1);
    for (layers_per_checkpoint, head_groups) in [(2, 1), (2, 2), (1, 2)] {
        let got = run(layers_per_checkpoint, head_groups);
        let what = format!("{layers_per_checkpoint} layers per checkpoint, {head_groups} groups");
        assert_same_step(&what, &got, &reference, GPU_TOLERANCE);
        assert_eq!(got.attention_forwards, vec![2; 3], "{what}");
    }
}
