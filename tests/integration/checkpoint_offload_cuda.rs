//! Host offload of layer checkpoints on CUDA (run with `--ignored` on a GPU machine), through
//! pinned memory and the copy stream: bf16 steps with offload give bitwise the output and every
//! gradient of the same step without it, and the device memory in use after a forward drops by
//! what the offloaded layers keep.

use crate::common::block_case::{lift_offloading, random_layers, step, StepResult};
use crate::common::Rng;
use burn::tensor::{Tensor, TensorData};
use burn_autodiff::Autodiff;
use burn_distflash::layers::{
    CheckpointPlacement, Offload, TransformerBlock, TransformerBlockConfig,
};
use burn_distflash::offload::{finish_copies, held_bytes, pinned_bytes, HostOffload};
use burn_distflash::{AttentionContext, DistFlashAttentionConfig};
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::Runtime;

type Inner = burn_cubecl::CubeBackend<CudaRuntime, half::bf16, i32, u8>;
type Gpu = Autodiff<Inner>;
const PLACEMENTS: [CheckpointPlacement; 2] = [
    CheckpointPlacement::Layer,
    CheckpointPlacement::AttentionOutput,
];

/// Heads of width 64 (the tensor-core kernels), the deterministic attention backward (no dQ
/// atomics), so that two runs of one step agree bit for bit.
fn config(d_model: usize, d_ff: usize) -> TransformerBlockConfig {
    let attention = DistFlashAttentionConfig::new(d_model, d_model / 64)
        .with_n_kv_heads(Some(d_model / 128))
        .with_causal(true)
        .with_deterministic(true);
    TransformerBlockConfig::new(attention, d_ff)
}

fn random(seed: u64, dims: [usize; 3], device: &CudaDevice) -> Tensor<Inner, 3> {
    let mut rng = Rng::new(seed);
    let n = dims.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.uniform() as f32).collect();
    Tensor::from_data(TensorData::new(values, dims), device)
}

fn layers(
    config: &TransformerBlockConfig,
    count: usize,
    placement: CheckpointPlacement,
    policy: Offload,
    device: &CudaDevice,
) -> Vec<TransformerBlock<Gpu>> {
    let blocks = random_layers::<Gpu>(config, 3, device, count);
    lift_offloading(&blocks, placement, policy, std::slice::from_ref(device)).remove(0)
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Whether two steps agree bit for bit, and if not where first.
fn first_difference(got: &StepResult, expected: &StepResult) -> Option<String> {
    if bits(&got.output) != bits(&expected.output) {
        return Some("the output".into());
    }
    if bits(&got.input_grad) != bits(&expected.input_grad) {
        return Some("the input gradient".into());
    }
    (got.weight_grads.iter().zip(&expected.weight_grads))
        .position(|(g, e)| bits(g) != bits(e))
        .map(|i| format!("the gradient of weight {i}"))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_bf16_offload_gives_bitwise_the_same_step() {
    let device = CudaDevice::new(0);
    let config = config(256, 512);
    let (x, r) = (
        random(1, [2, 512, 256], &device),
        random(2, [2, 512, 256], &device),
    );
    let context = AttentionContext::Local;
    for placement in PLACEMENTS {
        let run = |policy| {
            let blocks = layers(&config, 4, placement, policy, &device);
            step(&blocks, x.clone(), r.clone(), &context)
        };
        let expected = run(Offload::Off);
        let again = run(Offload::Off);
        if let Some(what) = first_difference(&again, &expected) {
            panic!(
                "{placement:?}: two runs of the same step without offload differ in {what}, so \
                 this GPU's step is not deterministic and offload cannot be compared bit for bit"
            );
        }
        for policy in [Offload::All, Offload::AllButLast(1), Offload::AllButLast(2)] {
            let got = run(policy);
            if let Some(what) = first_difference(&got, &expected) {
                panic!("{placement:?}, {policy:?}: {what} differs from the step without offload");
            }
            assert_eq!(held_bytes::<Inner>(&device), 0, "{placement:?}, {policy:?}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_offload_frees_the_checkpoints_device_memory_after_the_forward() {
    let device = CudaDevice::new(0);
    let client = CudaRuntime::client(&device);
    let in_use = || client.memory_usage().expect("memory usage").bytes_in_use;
    let config = config(512, 1024);
    let [batch, seq, count] = [1, 8192, 4];
    let x = random(4, [batch, seq, 512], &device);
    for placement in PLACEMENTS {
        let after_forward = |policy| {
            let blocks = layers(&config, count, placement, policy, &device);
            let planned: usize = (blocks.iter())
                .flat_map(|b| b.offloaded_bytes(batch, seq))
                .sum();
            let sizes: Vec<usize> = (blocks.iter())
                .flat_map(|b| b.offloaded_bytes(batch, seq))
                .collect();
            Gpu::prepare_host_offload(&device, &sizes).expect("pinned host memory");
            let before = in_use();
            let input = Tensor::<Gpu, 3>::from_inner(x.clone()).require_grad();
            let y = (blocks.iter()).fold(input, |y, b| b.forward(y, &AttentionContext::Local));
            finish_copies::<Inner>(&device);
            let grown = in_use().saturating_sub(before);
            let held = held_bytes::<Inner>(&device);
            let _ = y.sum().backward();
            (grown, planned as u64, held)
        };
        let (off, _, _) = after_forward(Offload::Off);
        let (all, planned, held) = after_forward(Offload::All);
        println!(
            "{placement:?}: in use after the forward grew by {off} bytes without offload, {all} \
             with; {planned} bytes planned, {held} held on the host"
        );
        assert_eq!(
            held, planned,
            "{placement:?}: every planned byte waits on the host"
        );
        assert!(
            pinned_bytes(&device) >= planned,
            "{placement:?}: the pinned pool"
        );
        // The first layer's input is `x`, whose memory the test holds either way.
        let freed = planned - (batch * seq * 512 * 2) as u64;
        assert!(
            off >= all + freed * 9 / 10,
            "{placement:?}: offload saved {} of the {freed} bytes the checkpoints hold",
            off.saturating_sub(all)
        );
    }
}
