//! Attention as Burn users train with it: forward + backward through `Autodiff` on burn-cuda,
//! this project's op (`flash_attention`, bf16) or Burn 0.21's own `attention` (f16). One
//! implementation per process, so the memory figure belongs to it alone.
//!
//! `cargo bench --bench op_training -- --impl distflash|burn [--seqs 8192,16384] [--iters 3]`
//! (`-- --help` lists the options with their defaults).
//! Causal, batch 1, 32 heads, head dim 128; TFLOP/s with FlashAttention's convention
//! (3.5 x 4 S^2 H D / 2). Memory: the device memory pool's reserved bytes after the run (the
//! pools keep their high-water mark, so this bounds the peak from above).

mod common;

use std::time::Instant;

use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Distribution, Tensor};
use burn_autodiff::Autodiff;
use burn_distflash::{flash_attention, FlashAttentionOptions};
use clap::{value_parser, Parser, ValueEnum};
use common::{CargoBench, Sizes};
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::Runtime;

const HEADS: usize = 32;
const HEAD_DIM: usize = 128;

type Ours = Autodiff<burn_cuda::Cuda<half::bf16, i32>>;
type Theirs = Autodiff<burn_cuda::Cuda<half::f16, i32>>;

/// The bench's command line.
#[derive(Parser)]
#[command(about = "Attention forward+backward through Autodiff on burn-cuda: ours or Burn's")]
struct Args {
    /// Which attention to train through
    #[arg(long = "impl", value_enum, value_name = "IMPL", default_value_t = Implementation::Distflash)]
    implementation: Implementation,
    /// Sequence lengths (comma-separated)
    #[arg(long, value_name = "TOKENS,..", default_value = "8192,16384")]
    seqs: Sizes,
    /// Timed runs per length after one warm-up (the median is reported)
    #[arg(long, value_name = "N", value_parser = value_parser!(u64).range(1..), default_value_t = 3)]
    iters: u64,
    #[command(flatten)]
    cargo_bench: CargoBench,
}

/// The attention a run trains through.
#[derive(Clone, Copy, ValueEnum)]
enum Implementation {
    /// This project's `flash_attention`, bf16
    Distflash,
    /// Burn 0.21's `attention`, f16
    Burn,
}

/// Median seconds of one forward + backward step over `iters` runs after one warm-up.
fn step_seconds<B: burn::tensor::backend::AutodiffBackend>(
    seq: usize,
    iters: usize,
    run: impl Fn(Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) -> Tensor<B, 4>,
) -> f64 {
    let device = Default::default();
    let shape = [1, HEADS, seq, HEAD_DIM];
    let make = || Tensor::<B, 4>::random(shape, Distribution::Default, &device).require_grad();
    let (q, k, v) = (make(), make(), make());
    let step = || {
        let out = run(q.clone(), k.clone(), v.clone());
        let grads = out.sum().backward();
        for t in [&q, &k, &v] {
            let _ = t.grad(&grads).expect("gradient");
        }
        B::sync(&device).expect("sync");
    };
    step();
    let mut times: Vec<f64> = (0..iters)
        .map(|_| {
            let start = Instant::now();
            step();
            start.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(|a, b| a.total_cmp(b));
    times[times.len() / 2]
}

fn main() {
    let args = Args::parse();
    let iters = args.iters as usize;
    for &seq in args.seqs.iter() {
        let (which, secs) = match args.implementation {
            Implementation::Distflash => (
                "distflash",
                step_seconds::<Ours>(seq, iters, |q, k, v| {
                    flash_attention(q, k, v, FlashAttentionOptions::causal()).expect("valid shapes")
                }),
            ),
            Implementation::Burn => (
                "burn",
                step_seconds::<Theirs>(seq, iters, |q, k, v| {
                    let options = AttentionModuleOptions {
                        is_causal: true,
                        ..Default::default()
                    };
                    attention(q, k, v, None, None, options)
                }),
            ),
        };
        let flops = 3.5 * 4.0 * (seq as f64).powi(2) * (HEADS * HEAD_DIM) as f64 / 2.0;
        let usage = CudaRuntime::client(&CudaDevice::new(0))
            .memory_usage()
            .expect("memory usage");
        println!(
            "| {which} (Autodiff<Cuda>) | fwd+bwd | {seq} | {:.2} ms | {:.1} TFLOP/s | {:.2} GiB reserved |",
            secs * 1e3,
            flops / secs / 1e12,
            usage.bytes_reserved as f64 / (1u64 << 30) as f64
        );
    }
}
