//! The memory planner against what can be counted without a GPU: its weights, gradients and
//! optimizer state equal the trainer's [`MemoryReport`] of a built model exactly (every
//! configuration kind, world size, ZeRO stage and placement of the optimizer state); on wgpu,
//! whose allocator counts its live bytes, the activations a forward keeps for the backward (at
//! every checkpoint placement, and with two layers per checkpoint) and the gradients a backward
//! leaves match the prediction within the allocator's rounding; the host memory planned for
//! offloaded checkpoints is what the model asks the host for (with one or two layers per
//! checkpoint).

use crate::common::exclusive_wgpu;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_autodiff::Autodiff;
use burn_distflash::layers::{CheckpointPlacement, Offload};
use burn_distflash::AttentionContext;
use distflash_llama::memory_plan::MemoryPlanner;
use distflash_llama::optimizer::{FlatLayout, StatePlacement, ZeroStage};
use distflash_llama::train::{MemoryReport, TrainOptions};
use distflash_llama::{Llama, LlamaConfig, TrainingKernels};

type Cpu = Autodiff<burn::backend::NdArray<f32>>;
type WgpuInner = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
type Wgpu = Autodiff<WgpuInner>;

#[test]
fn the_plans_state_is_the_trainers_memory_report() {
    let configs = [
        LlamaConfig::tiny(),
        LlamaConfig::new(300, 64, 3, 4, 4, 160),
        LlamaConfig::new(1000, 96, 2, 6, 2, 200).with_head_dim(Some(32)),
    ];
    for config in configs {
        let model: Llama<Cpu> = config.try_init(&Default::default()).unwrap();
        for world in [1, 2, 3, 4, 7] {
            for stage in [
                ZeroStage::Replicated,
                ZeroStage::OptimizerStates,
                ZeroStage::Gradients,
            ] {
                for placement in [StatePlacement::Gpu, StatePlacement::Host] {
                    let options = (TrainOptions::new(1, 1, 2 * world).with_zero(stage))
                        .with_optimizer_state(placement)
                        .with_state_chunk_bytes(12 * 4096);
                    let planner = MemoryPlanner::new(config.clone(), options, world, 4);
                    let predicted = planner.plan().unwrap().state;
                    let layout = FlatLayout::of::<Cpu, _>(&model, world);
                    let counted =
                        MemoryReport::estimate(&layout, stage).placed(placement, 12 * 4096);
                    let what =
                        format!("{config:?} on {world}, stage {stage}, state on the {placement}");
                    assert_eq!(predicted, counted, "{what}");
                }
            }
        }
    }
}

#[test]
fn the_plans_host_memory_is_what_the_model_offloads() {
    let (batch, seq) = (2, 48);
    for world in [1, 2, 3] {
        for (placement, offload, layers_per_checkpoint) in [
            (CheckpointPlacement::Layer, Offload::All, 1),
            (
                CheckpointPlacement::AttentionOutput,
                Offload::AllButLast(1),
                1,
            ),
            (CheckpointPlacement::AttentionOutput, Offload::Off, 1),
            // A pair (layers 0 and 1), then layer 2 alone.
            (CheckpointPlacement::Layer, Offload::All, 2),
            (CheckpointPlacement::Layer, Offload::AllButLast(1), 2),
            (CheckpointPlacement::Layer, Offload::AllButLast(2), 2),
        ] {
            let config = LlamaConfig::new(300, 64, 3, 4, 2, 96)
                .with_checkpoint(placement)
                .with_offload(offload)
                .with_layers_per_checkpoint(layers_per_checkpoint);
            let model: Llama<Cpu> = config.try_init(&Default::default()).unwrap();
            let options = TrainOptions::new(1, batch, seq);
            let plan = MemoryPlanner::new(config, options, world, 4)
                .plan()
                .unwrap();
            // What the trainer pins before a step: each rank's share of the sequence.
            let asked = model.offloaded_bytes(batch, seq / world);
            let what = format!("{placement:?}, {offload:?}, {layers_per_checkpoint}, {world}");
            assert_eq!(plan.host, asked.iter().sum::<usize>() as u64, "{what}");
            assert_eq!(
                plan.offloaded_checkpoints * plan.per_checkpoint,
                plan.host,
                "{what}"
            );
            let checkpoints = 3usize.div_ceil(layers_per_checkpoint) as u64;
            assert_eq!(
                plan.checkpoints,
                (checkpoints - plan.offloaded_checkpoints) * plan.per_checkpoint,
                "{what}"
            );
        }
    }
}

/// Bytes wgpu's allocator holds in live buffers now.
fn in_use(device: &cubecl::wgpu::WgpuDevice) -> u64 {
    WgpuInner::sync(device).unwrap();
    WgpuInner::device_memory(device)
        .expect("wgpu counts its memory")
        .in_use
}

/// `(predicted, measured)` bytes of the activations one forward keeps, then of the gradients
/// the backward leaves, for a small Llama on wgpu at `placement` with `layers_per_checkpoint`
/// (GQA, a batch of two rows: the rotary tables are per position, the rest per token).
fn measure(
    placement: CheckpointPlacement,
    tied: bool,
    layers_per_checkpoint: usize,
) -> [(u64, u64); 2] {
    let device = Default::default();
    let config = LlamaConfig::new(300, 64, 2, 4, 2, 96)
        .with_checkpoint(placement)
        .with_tie_embeddings(tied)
        .with_layers_per_checkpoint(layers_per_checkpoint);
    let (batch, seq) = (2, 48);
    let model: Llama<Wgpu> = config.try_init_seeded(&device, 3).unwrap();
    let plan = MemoryPlanner::new(config, TrainOptions::new(1, batch, seq), 1, 4)
        .plan()
        .unwrap();
    let ids = |offset: usize| {
        let ids: Vec<i64> = (0..batch * seq)
            .map(|i| ((i * 31 + offset) % 300) as i64)
            .collect();
        Tensor::<Wgpu, 2, Int>::from_data(TensorData::new(ids, [batch, seq]), &device)
    };
    let base = in_use(&device);
    let loss = model
        .loss(ids(1), ids(2), &AttentionContext::Local, batch * seq)
        .unwrap();
    let kept = in_use(&device) - base;
    let grads = loss.backward();
    let gradients = in_use(&device) - base;
    drop(grads);
    [
        (plan.checkpoints + plan.kept, kept),
        (plan.state.gradients, gradients),
    ]
}

/// What the prediction may miss: buffers the allocator rounds up to its alignment, and the
/// scalars of a step (the loss), a few hundred bytes; measured here within 32 bytes.
const SLACK: u64 = 512;

#[test]
fn wgpu_kept_activations_and_gradients_are_as_planned() {
    let _wgpu = exclusive_wgpu();
    for (placement, tied, layers_per_checkpoint) in [
        (CheckpointPlacement::Layer, true, 1),
        (CheckpointPlacement::Layer, false, 2),
        (CheckpointPlacement::AttentionOutput, false, 1),
        (CheckpointPlacement::None, true, 1),
    ] {
        let what = format!("{placement:?}, tied {tied}, {layers_per_checkpoint} per checkpoint");
        let [(kept, measured_kept), (grads, measured_grads)] =
            measure(placement, tied, layers_per_checkpoint);
        eprintln!(
            "{what}: kept {measured_kept} bytes ({kept} predicted), gradients {measured_grads} \
             ({grads} predicted)"
        );
        assert!(
            kept.abs_diff(measured_kept) <= SLACK,
            "{what}: the forward kept {measured_kept} bytes, {kept} predicted"
        );
        assert!(
            grads.abs_diff(measured_grads) <= SLACK,
            "{what}: the backward left {measured_grads} bytes, {grads} predicted"
        );
    }
}
