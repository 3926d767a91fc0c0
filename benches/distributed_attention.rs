//! Sequence-parallel attention over NCCL, one process driving P GPUs (one thread per GPU).
//!
//! `cargo bench --bench distributed_attention -- [--worlds 2,4] [--tokens 8192,16384,32768]
//!  [--iters 3] [--no-single] [--window 4096]` (`-- --help` lists the options with their
//!  defaults)
//!
//! Causal bf16, batch 1, 32 heads, head dim 128, `tokens` per GPU. For each world size and
//! length: ring, balanced and zigzag schedules with overlap on and off, and the same schedules with
//! communication replaced by local buffers (the zero-communication ideal); then this project's
//! single-GPU attention on the whole sequence. Per-GPU TFLOP/s with FlashAttention's convention
//! over the whole causal sequence (4 N² H D / 2 forward, x3.5 forward+backward, divided by P).
//! An iteration's time is the slowest rank's; the median over iterations is reported.
//! `--window W` runs every row under a causal sliding window of `W` keys instead (the single GPU
//! too), with TFLOP/s counted on the visible (query, key) pairs only, and `steps` the number of
//! exchanges the schedule keeps (pairs of shards with nothing visible are neither computed nor
//! exchanged).

mod common;

use std::sync::{Arc, Barrier};
use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Distribution, FloatDType, Shape};
use burn_distflash::collective::on_each_rank;
use burn_distflash::collective::{Exchange, Incoming, Outgoing, Received, Transport};
use burn_distflash::schedule::{Schedule, ScheduleKind};
use burn_distflash::sequence_parallel::SequenceParallelOptions;
use burn_distflash::{
    AttentionBackend, DeviceGroup, Error, FlashAttentionOptions, Mask, SequenceParallelBackend,
    SlidingWindow,
};
use clap::{value_parser, Parser};
use common::{CargoBench, Sizes};
use cubecl::cuda::CudaDevice;

type Bf16 = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, half::bf16, i32, u8>;

const HEADS: usize = 32;
const HEAD_DIM: usize = 128;

/// The bench's command line.
#[derive(Parser)]
#[command(about = "Sequence-parallel attention over NCCL, one process driving P GPUs")]
struct Args {
    /// Numbers of GPUs (comma-separated; default: every GPU present)
    #[arg(long, value_name = "P,..")]
    worlds: Option<Sizes>,
    /// Tokens per GPU (comma-separated)
    #[arg(long, value_name = "TOKENS,..", default_value = "8192,16384,32768")]
    tokens: Sizes,
    /// Timed runs per row (the median of the slowest rank's is reported)
    #[arg(long, value_name = "N", value_parser = value_parser!(u64).range(1..), default_value_t = 3)]
    iters: u64,
    /// Skip the single-GPU rows over the whole sequence
    #[arg(long)]
    no_single: bool,
    /// Every row under a causal sliding window of this many keys (TFLOP/s on the visible pairs)
    #[arg(long, value_name = "KEYS", value_parser = value_parser!(u64).range(1..))]
    window: Option<u64>,
    #[command(flatten)]
    cargo_bench: CargoBench,
}

/// A transport that moves nothing: receives are local zero buffers of the right layout. Runs
/// a schedule's computation exactly, without its communication.
struct NoComm<B: Backend> {
    rank: usize,
    world: usize,
    device: B::Device,
}

struct Ready<B: Backend>(Vec<Received<B>>);

impl<B: Backend> Exchange<B> for Ready<B> {
    fn wait(self: Box<Self>) -> Result<Vec<Received<B>>, Error> {
        Ok(self.0)
    }
}

impl<B: Backend> Transport<B> for NoComm<B> {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn device(&self) -> &B::Device {
        &self.device
    }
    fn exchange(
        &self,
        _sends: Vec<Outgoing<B>>,
        receives: Vec<Incoming>,
    ) -> Result<Box<dyn Exchange<B> + '_>, Error> {
        let received = receives
            .into_iter()
            .map(|r| Received {
                peer: r.peer,
                kind: r.kind,
                tensors: (r.layouts.iter())
                    .map(|l| {
                        let dtype = FloatDType::from(l.dtype);
                        B::float_zeros(Shape::from(l.shape.clone()), &self.device, dtype)
                    })
                    .collect(),
            })
            .collect();
        Ok(Box::new(Ready(received)))
    }
    fn all_gather_values(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, Error> {
        Ok(vec![values.to_vec(); self.world])
    }
}

/// One measured configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Config {
    schedule: ScheduleKind,
    overlap: bool,
    communicate: bool,
}

fn configs() -> Vec<Config> {
    let mut all = Vec::new();
    for schedule in [
        ScheduleKind::Ring,
        ScheduleKind::Balanced,
        ScheduleKind::Zigzag,
    ] {
        for (overlap, communicate) in [(true, true), (false, true), (true, false)] {
            all.push(Config {
                schedule,
                overlap,
                communicate,
            });
        }
    }
    all
}

fn random(shape: [usize; 4], device: &CudaDevice) -> FloatTensor<Bf16> {
    burn::tensor::Tensor::<Bf16, 4>::random(shape, Distribution::Default, device)
        .into_primitive()
        .tensor()
}

fn sync(device: &CudaDevice) {
    Bf16::sync(device).expect("device sync");
}

/// Seconds of each iteration of `run` on this rank (all ranks start together).
fn time_iters(iters: usize, barrier: &Barrier, device: &CudaDevice, run: impl Fn()) -> Vec<f64> {
    run();
    sync(device);
    (0..iters)
        .map(|_| {
            barrier.wait();
            let start = Instant::now();
            run();
            sync(device);
            start.elapsed().as_secs_f64()
        })
        .collect()
}

/// Seconds of each iteration of `forward` alone, then of `forward` followed by `backward` of
/// its result (both timed as [`time_iters`] says).
fn time_forward_backward<T>(
    iters: usize,
    barrier: &Barrier,
    device: &CudaDevice,
    forward: impl Fn() -> T,
    backward: impl Fn(T),
) -> (Vec<f64>, Vec<f64>) {
    let fwd = time_iters(iters, barrier, device, || {
        forward();
    });
    let fwd_bwd = time_iters(iters, barrier, device, || backward(forward()));
    (fwd, fwd_bwd)
}

/// Per-rank timings of every configuration, forward and forward+backward.
type RankTimes = Vec<(Config, Vec<f64>, Vec<f64>)>;

fn rank_main(
    group: DeviceGroup<Bf16>,
    tokens: usize,
    iters: usize,
    attention: &FlashAttentionOptions,
    barrier: Arc<Barrier>,
) -> RankTimes {
    let device = group.device().clone();
    let shape = [1, HEADS, tokens, HEAD_DIM];
    let [q, k, v, dout] = [(); 4].map(|()| random(shape, &device));
    let local = DeviceGroup::<Bf16>::new(NoComm {
        rank: group.rank(),
        world: group.world_size(),
        device: device.clone(),
    });
    configs()
        .into_iter()
        .map(|config| {
            let options = sequence_parallel_options(attention, config);
            let g = if config.communicate { &group } else { &local };
            let forward = || {
                Bf16::sequence_parallel_attention(q.clone(), k.clone(), v.clone(), g, &options)
                    .expect("forward")
            };
            let backward = |(out, lse)| {
                Bf16::sequence_parallel_backward(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    out,
                    lse,
                    dout.clone(),
                    g,
                    &options,
                )
                .expect("backward");
            };
            let (fwd, fwd_bwd) = time_forward_backward(iters, &barrier, &device, forward, backward);
            (config, fwd, fwd_bwd)
        })
        .collect()
}

/// The sequence-parallel options of `config` with the attention options `attention`.
fn sequence_parallel_options(
    attention: &FlashAttentionOptions,
    config: Config,
) -> SequenceParallelOptions {
    SequenceParallelOptions {
        attention: attention.clone(),
        ..SequenceParallelOptions::causal()
            .with_schedule(config.schedule)
            .with_overlap(config.overlap)
    }
}

/// Forward FLOPs of causal attention over `n` tokens (FlashAttention's `4 n^2 H D / 2`), or,
/// under a window of `w` keys, `4 H D` per visible (query, key) pair.
fn forward_flops(n: usize, window: Option<usize>) -> f64 {
    let width = (HEADS * HEAD_DIM) as f64;
    match window {
        None => 4.0 * (n as f64) * (n as f64) * width / 2.0,
        Some(w) => {
            let pairs: usize = (0..n).map(|i| (i + 1).min(w)).sum();
            4.0 * pairs as f64 * width
        }
    }
}

/// Median over iterations of the slowest rank's time.
fn slowest_median(per_rank: &[&Vec<f64>]) -> f64 {
    let iters = per_rank[0].len();
    let mut slowest: Vec<f64> = (0..iters)
        .map(|i| per_rank.iter().map(|t| t[i]).fold(0.0, f64::max))
        .collect();
    slowest.sort_by(|a, b| a.total_cmp(b));
    slowest[iters / 2]
}

/// Seconds of this project's single-GPU attention over `seq` tokens: (forward, forward+backward).
fn single_gpu(seq: usize, iters: usize, options: &FlashAttentionOptions) -> (f64, f64) {
    let device = CudaDevice::new(0);
    let shape = [1, HEADS, seq, HEAD_DIM];
    let [q, k, v, dout] = [(); 4].map(|()| random(shape, &device));
    let one = Barrier::new(1);
    let forward = || Bf16::flash_attention(q.clone(), k.clone(), v.clone(), options.clone());
    let median = |mut t: Vec<f64>| {
        t.sort_by(|a, b| a.total_cmp(b));
        t[t.len() / 2]
    };
    let backward = |(out, lse)| {
        Bf16::flash_attention_backward(
            q.clone(),
            k.clone(),
            v.clone(),
            out,
            lse,
            dout.clone(),
            options.clone(),
        );
    };
    let (fwd, fwd_bwd) = time_forward_backward(iters, &one, &device, forward, backward);
    (median(fwd), median(fwd_bwd))
}

fn main() {
    std::env::set_var("NCCL_NVLS_ENABLE", "0");
    let args = Args::parse();
    let available = burn_distflash::collective::nccl::device_count().expect("CUDA driver");
    let worlds = args.worlds.clone().unwrap_or(Sizes(vec![available]));
    let tokens_list = &args.tokens;
    let (iters, single) = (args.iters as usize, !args.no_single);
    let window = args.window.map(|w| w as usize);
    let attention =
        match window {
            Some(w) => FlashAttentionOptions::masked(Mask::causal().with_window(
                SlidingWindow::causal(w).expect("--window takes a size of at least 1"),
            )),
            None => FlashAttentionOptions::causal(),
        };
    if let Some(w) = window {
        println!("causal sliding window of {w} keys; TFLOP/s on the visible pairs\n");
    }
    println!(
        "| P | tokens/GPU | schedule | overlap | comm | steps | fwd ms | fwd TFLOP/s/GPU | \
         fwd+bwd ms | fwd+bwd TFLOP/s/GPU |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut summary = Vec::new();
    for &world in worlds.iter() {
        assert!(
            world <= available,
            "{world} GPUs asked, {available} present"
        );
        let devices: Vec<CudaDevice> = (0..world).map(CudaDevice::new).collect();
        let groups = DeviceGroup::<Bf16>::nccl(&devices).expect("NCCL group");
        for &tokens in tokens_list.iter() {
            let barrier = Arc::new(Barrier::new(world));
            let mut per_rank: Vec<(usize, RankTimes)> = on_each_rank(groups.clone(), |_, group| {
                let rank = group.rank();
                (
                    rank,
                    rank_main(group, tokens, iters, &attention, barrier.clone()),
                )
            });
            per_rank.sort_by_key(|(r, _)| *r);
            let flops = forward_flops(world * tokens, window);
            let per_gpu = |secs: f64, factor: f64| factor * flops / world as f64 / secs / 1e12;
            let mut rows = Vec::new();
            for (i, config) in configs().into_iter().enumerate() {
                let fwd =
                    slowest_median(&per_rank.iter().map(|(_, t)| &t[i].1).collect::<Vec<_>>());
                let both =
                    slowest_median(&per_rank.iter().map(|(_, t)| &t[i].2).collect::<Vec<_>>());
                let steps = sequence_parallel_options(&attention, config)
                    .schedule_for(world, tokens)
                    .expect("schedule")
                    .num_steps();
                println!(
                    "| {world} | {tokens} | {:?} | {} | {} | {steps} | {:.1} | {:.1} | {:.1} | {:.1} |",
                    config.schedule,
                    if config.overlap { "on" } else { "off" },
                    if config.communicate { "NCCL" } else { "none" },
                    fwd * 1e3,
                    per_gpu(fwd, 1.0),
                    both * 1e3,
                    per_gpu(both, 3.5),
                );
                rows.push((config, fwd, both));
            }
            let single_times = single.then(|| single_gpu(world * tokens, iters, &attention));
            if let Some((fwd, both)) = single_times {
                println!(
                    "| 1 | {} | single GPU | - | - | - | {:.1} | {:.1} | {:.1} | {:.1} |",
                    world * tokens,
                    fwd * 1e3,
                    flops / fwd / 1e12,
                    both * 1e3,
                    3.5 * flops / both / 1e12
                );
            }
            summary.push((world, tokens, rows, single_times));
        }
    }
    println!();
    println!(
        "| P | tokens/GPU | ring→balanced speedup (fwd+bwd) | theory | overhead fwd+bwd, overlap \
         on | overlap off | balanced speedup vs 1 GPU | per-GPU efficiency |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for (world, tokens, rows, single_times) in summary {
        let find = |schedule, overlap, communicate| {
            rows.iter()
                .find(|(c, _, _)| {
                    *c == Config {
                        schedule,
                        overlap,
                        communicate,
                    }
                })
                .map(|r| r.2)
                .unwrap()
        };
        let ring = find(ScheduleKind::Ring, true, true);
        let balanced = find(ScheduleKind::Balanced, true, true);
        let ideal = find(ScheduleKind::Balanced, true, false);
        let off = find(ScheduleKind::Balanced, false, true);
        let model = |kind| match window {
            None => Schedule::new(kind, world, true).time(),
            Some(_) => sequence_parallel_options(
                &attention,
                Config {
                    schedule: kind,
                    overlap: true,
                    communicate: true,
                },
            )
            .schedule_for(world, tokens)
            .expect("schedule")
            .time(),
        };
        let theory = model(ScheduleKind::Ring) / model(ScheduleKind::Balanced);
        let (speedup, efficiency) = match single_times {
            Some((_, one)) => (
                format!("{:.2}x", one / balanced),
                format!("{:.0}%", 100.0 * one / balanced / world as f64),
            ),
            None => ("-".into(), "-".into()),
        };
        println!(
            "| {world} | {tokens} | {:.2}x | {theory:.2}x | {:.1}% | {:.1}% | {speedup} | {efficiency} |",
            ring / balanced,
            100.0 * (balanced - ideal) / ideal,
            100.0 * (off - ideal) / ideal,
        );
    }
}
