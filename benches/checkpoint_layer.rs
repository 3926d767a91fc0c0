//! One Llama-7B-shaped transformer block (hidden 4096, 32 heads, FFN 11008, bf16, causal), one
//! training step (forward + backward) per iteration, for each gradient-checkpoint placement, on
//! one GPU and sequence-parallel over P GPUs (one thread per GPU, NCCL).
//!
//! `cargo bench --bench checkpoint_layer -- [--worlds 1,4] [--tokens 8192,16384,32768]
//!  [--iters 3] [--placements none,layer,attention-output] [--fusion]` (`-- --help` lists the
//!  options with their defaults)
//!
//! `tokens` is per GPU. Reported per placement: the median step time (an iteration's time is the
//! slowest rank's), the memory the step keeps between forward and backward (bytes in use on rank
//! 0 right after the forward, the block input excluded), and the peak (bytes reserved by rank 0's
//! memory pool over the placement's iterations, the pool emptied before: an upper bound of the
//! peak in use). Model TFLOP/s per GPU counts the block's matmuls (6 x params x tokens) and
//! causal attention (3.5 x 4 x S_total^2 x d / 2 / P), recomputation not counted.

mod common;

use std::sync::{Arc, Barrier};
use std::time::Instant;

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Distribution, Tensor};
use burn_autodiff::Autodiff;
use burn_distflash::collective::on_each_rank;
use burn_distflash::layers::{CheckpointPlacement, TransformerBlockConfig};
use burn_distflash::{
    AttentionContext, DeviceGroup, DistFlashAttentionConfig, FlashAttentionBackend,
};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{value_parser, Parser};
use common::{CargoBench, Sizes};
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::Runtime;

type Inner = burn_cubecl::CubeBackend<CudaRuntime, half::bf16, i32, u8>;
type Train = Autodiff<Inner>;
type FusedTrain = Autodiff<burn_fusion::Fusion<Inner>>;

const HIDDEN: usize = 4096;
const HEADS: usize = 32;
const FFN: usize = 11008;
const GIB: f64 = (1u64 << 30) as f64;

/// The bench's command line.
#[derive(Parser)]
#[command(
    about = "One Llama-7B-shaped block's training step per checkpoint placement, on 1 or P GPUs"
)]
struct Args {
    /// Numbers of GPUs (comma-separated; 1: one GPU, no group)
    #[arg(long, value_name = "P,..", default_value = "1,4")]
    worlds: Sizes,
    /// Tokens per GPU (comma-separated)
    #[arg(long, value_name = "TOKENS,..", default_value = "8192,16384,32768")]
    tokens: Sizes,
    /// Timed steps per row (the median is reported)
    #[arg(long, value_name = "N", value_parser = value_parser!(u64).range(1..), default_value_t = 3)]
    iters: u64,
    /// Checkpoint placements, comma-separated
    #[arg(long, value_name = "PLACEMENT,..", value_delimiter = ',',
          value_parser = PossibleValuesParser::new(CheckpointPlacement::NAMES)
              .try_map(|name| name.parse::<CheckpointPlacement>()),
          default_value = "none,layer,attention-output")]
    placements: Vec<CheckpointPlacement>,
    /// Run the block on Burn's fusion backend over CubeCL (memory not reported)
    #[arg(long)]
    fusion: bool,
    #[command(flatten)]
    cargo_bench: CargoBench,
}

/// What one rank measured for one placement.
struct Measured {
    step_seconds: Vec<f64>,
    kept_bytes: u64,
    reserved_bytes: u64,
}

/// Runs warm-up + `iters` steps of one block on this rank. Memory is read from this thread's
/// stream, so it is only meaningful without fusion (whose kernels run on its own thread).
fn run_rank<B: AutodiffBackend<Device = CudaDevice> + FlashAttentionBackend<Inner = Inner>>(
    device: CudaDevice,
    context: AttentionContext<B>,
    tokens: usize,
    placement: CheckpointPlacement,
    iters: usize,
    barrier: Arc<Barrier>,
) -> Measured {
    let config = TransformerBlockConfig::new(DistFlashAttentionConfig::new(HIDDEN, HEADS), FFN)
        .with_checkpoint(placement);
    // Timing one block does not need the ranks to agree on its weights (training does: see
    // `replicate`); initialised here, the weights count in this thread's memory pool.
    let block = config.init::<B>(&device);
    let x =
        Tensor::<B, 3>::random([1, tokens, HIDDEN], Distribution::Default, &device).require_grad();
    let client = CudaRuntime::client(&device);
    let step = |record: bool| -> (f64, u64) {
        barrier.wait();
        let start = Instant::now();
        let before = client.memory_usage().expect("memory usage").bytes_in_use;
        let y = block.forward(x.clone(), &context);
        B::sync(&device).expect("sync");
        let kept = if record {
            client.memory_usage().expect("memory usage").bytes_in_use - before
        } else {
            0
        };
        let grads = y.sum().backward();
        let _ = x.grad(&grads).expect("input gradient");
        drop(grads);
        B::sync(&device).expect("sync");
        (start.elapsed().as_secs_f64(), kept)
    };
    step(false);
    Inner::memory_cleanup(&device);
    let mut kept_bytes = 0;
    let step_seconds = (0..iters)
        .map(|_| {
            let (secs, kept) = step(true);
            kept_bytes = kept;
            secs
        })
        .collect();
    let reserved_bytes = client.memory_usage().expect("memory usage").bytes_reserved;
    // Each thread's stream has its own memory pool, which outlives the thread: empty it.
    drop((block, x));
    B::memory_cleanup(&device);
    Inner::memory_cleanup(&device);
    Measured {
        step_seconds,
        kept_bytes,
        reserved_bytes,
    }
}

fn main() {
    std::env::set_var("NCCL_NVLS_ENABLE", "0");
    let args = Args::parse();
    let (worlds, tokens_list) = (&args.worlds, &args.tokens);
    let (iters, fused) = (args.iters as usize, args.fusion);
    let placements = &args.placements;
    println!(
        "| GPUs | tokens/GPU | placement | step ms | model TFLOP/s/GPU | kept for backward GiB | peak reserved GiB |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for &world in worlds.iter() {
        for &tokens in tokens_list.iter() {
            for &placement in placements {
                let devices: Vec<CudaDevice> = (0..world).map(CudaDevice::new).collect();
                let contexts: Vec<AttentionContext<Train>> = if world == 1 {
                    vec![AttentionContext::Local]
                } else {
                    DeviceGroup::<Inner>::nccl(&devices)
                        .expect("NCCL group")
                        .into_iter()
                        .map(AttentionContext::sharded)
                        .collect()
                };
                let barrier = Arc::new(Barrier::new(world));
                let per_rank = devices.into_iter().zip(contexts).collect();
                let ranks: Vec<Measured> = on_each_rank(per_rank, |_, (device, context)| {
                    let barrier = barrier.clone();
                    if fused {
                        run_rank::<FusedTrain>(
                            device,
                            context.for_backend(),
                            tokens,
                            placement,
                            iters,
                            barrier,
                        )
                    } else {
                        run_rank::<Train>(device, context, tokens, placement, iters, barrier)
                    }
                });
                let mut steps: Vec<f64> = (0..iters)
                    .map(|i| ranks.iter().map(|r| r.step_seconds[i]).fold(0.0, f64::max))
                    .collect();
                steps.sort_by(f64::total_cmp);
                let secs = steps[steps.len() / 2];
                let params = (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN) as f64;
                let total = (tokens * world) as f64;
                let flops = 6.0 * params * tokens as f64
                    + 3.5 * 4.0 * total * total * HIDDEN as f64 / 2.0 / world as f64;
                let memory = |bytes: u64| match fused {
                    true => "-".to_string(),
                    false => format!("{:.2}", bytes as f64 / GIB),
                };
                println!(
                    "| {world} | {tokens} | {placement:?}{} | {:.1} | {:.1} | {} | {} |",
                    if fused { " (fusion)" } else { "" },
                    secs * 1e3,
                    flops / secs / 1e12,
                    memory(ranks[0].kept_bytes),
                    memory(ranks[0].reserved_bytes),
                );
            }
        }
    }
}
