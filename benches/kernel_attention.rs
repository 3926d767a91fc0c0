//! Single-GPU attention throughput on CUDA: this project's kernels beside Burn 0.21's own
//! `attention`, in one run. Causal, batch 1, 32 heads, head dim 128; TFLOP/s with
//! FlashAttention's convention (forward `4 S^2 H D / 2` for causal, forward+backward 3.5x that).
//!
//! `cargo bench --bench kernel_attention -- [--seqs 8192,16384,32768] [--bwd-seqs 8192]
//! [--burn-seqs 8192,16384] [--iters 5]`. Prints a markdown table.

use std::time::Instant;

use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Distribution, Tensor};
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::*;
use distflash_kernels::{DeviceTensor, ElemType, Mask, StepOptions, Variant};

const HEADS: usize = 32;
const HEAD_DIM: usize = 128;

fn arg_list(args: &[String], name: &str, default: &[usize]) -> Vec<usize> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| default.to_vec())
}

fn causal_forward_flops(seq: usize) -> f64 {
    4.0 * (seq as f64).powi(2) * HEADS as f64 * HEAD_DIM as f64 / 2.0
}

/// Median seconds of `iters` timed runs after two warm-ups; `run` must block until done.
fn median_seconds(iters: usize, mut run: impl FnMut()) -> f64 {
    run();
    run();
    let mut times: Vec<f64> = (0..iters)
        .map(|_| {
            let start = Instant::now();
            run();
            start.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(|a, b| a.total_cmp(b));
    times[times.len() / 2]
}

fn random_tensor(
    client: &ComputeClient<CudaRuntime>,
    seq: usize,
    seed: u64,
    elem: ElemType,
) -> DeviceTensor {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let data: Vec<f32> = (0..HEADS * seq * HEAD_DIM)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    DeviceTensor::from_f32(client, &data, vec![1, HEADS, seq, HEAD_DIM], elem)
}

fn sync(client: &ComputeClient<CudaRuntime>) {
    cubecl::future::block_on(client.sync()).expect("sync");
}

type BurnCuda = burn_cuda::Cuda<half::f16, i32>;
type BurnAutodiff = burn_autodiff::Autodiff<BurnCuda>;

fn burn_options() -> AttentionModuleOptions {
    AttentionModuleOptions {
        is_causal: true,
        ..Default::default()
    }
}

fn burn_forward(seq: usize, iters: usize) -> f64 {
    let device = burn_cuda::CudaDevice::new(0);
    let shape = [1, HEADS, seq, HEAD_DIM];
    let q = Tensor::<BurnCuda, 4>::random(shape, Distribution::Default, &device);
    let k = Tensor::<BurnCuda, 4>::random(shape, Distribution::Default, &device);
    let v = Tensor::<BurnCuda, 4>::random(shape, Distribution::Default, &device);
    median_seconds(iters, || {
        let out = attention(q.clone(), k.clone(), v.clone(), None, None, burn_options());
        let _ = out.into_data();
    })
}

fn burn_forward_backward(seq: usize, iters: usize) -> f64 {
    let device = burn_cuda::CudaDevice::new(0);
    let shape = [1, HEADS, seq, HEAD_DIM];
    let make =
        || Tensor::<BurnAutodiff, 4>::random(shape, Distribution::Default, &device).require_grad();
    let (q, k, v) = (make(), make(), make());
    median_seconds(iters, || {
        let out = attention(q.clone(), k.clone(), v.clone(), None, None, burn_options());
        let grads = out.sum().backward();
        let _ = q.grad(&grads).map(|g| g.into_data());
    })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let seqs = arg_list(&args, "--seqs", &[8192, 16384, 32768]);
    let bwd_seqs = arg_list(&args, "--bwd-seqs", &[8192]);
    let burn_seqs = arg_list(&args, "--burn-seqs", &[8192, 16384]);
    let iters = arg_list(&args, "--iters", &[5])[0];
    let client = CudaRuntime::client(&CudaDevice::new(0));
    let elem = ElemType::BF16;
    let options = StepOptions {
        mask: Mask::causal(),
        scale: None,
        variant: Variant::Auto,
    };
    println!(
        "tensor cores used for the forward: {}",
        distflash_kernels::tensor_core_available(&client, elem, HEAD_DIM)
    );
    println!("| implementation | pass | S | ms | TFLOP/s |");
    println!("| --- | --- | --- | --- | --- |");
    let row = |name: &str, pass: &str, seq: usize, secs: f64, flops: f64| {
        println!(
            "| {name} | {pass} | {seq} | {:.2} | {:.1} |",
            secs * 1e3,
            flops / secs / 1e12
        );
    };
    for &seq in &seqs {
        let (q, k, v) = (
            random_tensor(&client, seq, 1, elem),
            random_tensor(&client, seq, 2, elem),
            random_tensor(&client, seq, 3, elem),
        );
        let secs = median_seconds(iters, || {
            let _ = distflash_kernels::attention(&client, &q, &k, &v, &options).unwrap();
            sync(&client);
        });
        row(
            "distflash (bf16)",
            "fwd",
            seq,
            secs,
            causal_forward_flops(seq),
        );
        if bwd_seqs.contains(&seq) {
            let grad_out = random_tensor(&client, seq, 4, elem);
            let secs = median_seconds(iters.min(3), || {
                let (out, lse) =
                    distflash_kernels::attention(&client, &q, &k, &v, &options).unwrap();
                let _ = distflash_kernels::attention_backward(
                    &client, &q, &k, &v, &out, &lse, &grad_out, &options,
                )
                .unwrap();
                sync(&client);
            });
            row(
                "distflash (bf16)",
                "fwd+bwd",
                seq,
                secs,
                3.5 * causal_forward_flops(seq),
            );
        }
    }
    for &seq in &burn_seqs {
        row(
            "burn attention (f16)",
            "fwd",
            seq,
            burn_forward(seq, iters),
            causal_forward_flops(seq),
        );
        if bwd_seqs.contains(&seq) {
            row(
                "burn attention (f16, autodiff)",
                "fwd+bwd",
                seq,
                burn_forward_backward(seq, iters.min(3)),
                3.5 * causal_forward_flops(seq),
            );
        }
    }
}
