//! Single-GPU attention throughput on CUDA: this project's kernels beside Burn 0.21's own
//! `attention`, in one run. Causal, batch 1, 32 query heads, head dim 128 by default; TFLOP/s
//! with FlashAttention's convention (forward `4 S^2 H D / 2` for causal, H query heads,
//! forward+backward 3.5x that).
//!
//! `cargo bench --bench kernel_attention -- [--seqs 8192,16384,32768] [--bwd-seqs 8192]
//! [--burn-seqs 8192,16384] [--iters 5] [--head-dim 128] [--kv-heads 32] [--chunks 4]
//! [--mask-seqs 32768] [--window 4096] [--variants auto,hopper,tensor-core]
//! [--chunk-variants hopper,tensor-core]
//! [--hopper-schedules overlap+pingpong+grouped,overlap+pingpong+grouped+persistent,plain]
//! [--hopper-head-splits auto,never,2,4] [--hopper-deterministic-adds consumers,producer]`
//! (`-- --help` lists them with their defaults).
//! `--variants` runs the whole-attention forward rows once per kernel variant (default `auto`),
//! each with its first call's time (compilation included); `--hopper-schedules` adds rows of
//! the Hopper forward with each of its schedules forced (see `hopper::ForwardSchedule`);
//! `--hopper-head-splits` adds, at the lengths of `--bwd-seqs`, backward rows of the Hopper
//! variant with the split of each GQA group's query heads over cubes forced (`auto`: the plan's
//! choice, `never`, or N parts: see `hopper::HeadSplit`), one after the other in one process;
//! `--hopper-deterministic-adds` adds, at the same lengths, forward+backward rows of the
//! deterministic Hopper backward with its ordered dQ adds made by each form forced (the consumer
//! warpgroups', or a producer warp's from shared memory: see `hopper::DeterministicAdds`).
//! `--chunks C` adds rows where the sequence is cut into C chunks and run pair by pair through
//! `forward_step` / `backward_step` with causal offsets, as the distributed pass does, and rows
//! where each query chunk's first and last key chunks go through `forward_first_step` /
//! `forward_last_step` (no fill or finalise kernels), once per variant of `--chunk-variants`
//! (default: those of `--variants`). At the lengths of
//! `--bwd-seqs`, each variant of `--variants` adds its backward rows: the first backward call
//! (compilation included, at the first of those lengths), forward+backward one call at a time
//! and queued, the backward alone queued (2.5 times the forward's FLOPs), and, where the variant
//! has one, the deterministic backward. `--mask-seqs 32768` adds the masks long-context training uses, both causal: a sliding
//! window of `--window` keys (4096) and packed documents of 2K-8K tokens (the lengths of
//! [`DOCUMENT_LENGTHS`], repeated and cut at the sequence's end), forward and forward+backward on
//! each variant of `--variants`, with TFLOP/s counted on the visible (query, key) pairs only
//! (forward `4 * pairs * H * D`). Prints a markdown table.

mod common;

use std::str::FromStr;
use std::time::Instant;

use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Distribution, Tensor};
use clap::{value_parser, Parser, ValueEnum};
use common::{CargoBench, Sizes};
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::*;
use distflash_kernels::hopper::{
    schedule, BackwardSchedule, DeterministicAdds, ForwardSchedule, HeadSplit,
};
use distflash_kernels::{
    DeviceTensor, Documents, ElemType, GradAccumulators, Mask, SlidingWindow, SoftmaxState,
    StepOptions, Variant,
};

const HEADS: usize = 32;

/// The bench's command line.
#[derive(Parser)]
#[command(about = "Single-GPU attention throughput on CUDA: the kernels beside Burn's attention")]
struct Args {
    /// Sequence lengths of the forward rows (comma-separated, or none)
    #[arg(long, value_name = "TOKENS,..", default_value = "8192,16384,32768")]
    seqs: Sizes,
    /// Those of --seqs that also get forward+backward rows
    #[arg(long, value_name = "TOKENS,..", default_value = "8192")]
    bwd_seqs: Sizes,
    /// Sequence lengths of Burn's own attention (f16), or none
    #[arg(long, value_name = "TOKENS,..", default_value = "8192,16384")]
    burn_seqs: Sizes,
    /// Timed runs per row (the median is reported; forward+backward rows take at most 3)
    #[arg(long, value_name = "N", value_parser = value_parser!(u64).range(1..), default_value_t = 5)]
    iters: u64,
    /// Head dimension (64 or 128 for the tensor-core and Hopper kernels)
    #[arg(long, value_name = "D", value_parser = value_parser!(u64).range(1..), default_value_t = 128)]
    head_dim: u64,
    /// Key/value heads (GQA/MQA below 32; 32 query heads)
    #[arg(long, value_name = "N", value_parser = value_parser!(u64).range(1..), default_value_t = HEADS as u64)]
    kv_heads: u64,
    /// Also run the sequence cut into C chunks, pair by pair through the step kernels (1: no
    /// such rows)
    #[arg(long, value_name = "C", value_parser = value_parser!(u64).range(1..), default_value_t = 1)]
    chunks: u64,
    /// Sequence lengths of the masked rows (a sliding window, packed documents), or none
    #[arg(long, value_name = "TOKENS,..", default_value = "none")]
    mask_seqs: Sizes,
    /// Keys of the sliding window of the masked rows
    #[arg(long, value_name = "KEYS", value_parser = value_parser!(u64).range(1..), default_value_t = 4096)]
    window: u64,
    /// Kernel variants of the whole-attention forward rows, comma-separated
    #[arg(
        long,
        value_enum,
        value_name = "VARIANT,..",
        value_delimiter = ',',
        default_value = "auto"
    )]
    variants: Vec<ForwardVariant>,
    /// Kernel variants of the chunked rows (--chunks), comma-separated; default: --variants
    #[arg(long, value_enum, value_name = "VARIANT,..", value_delimiter = ',')]
    chunk_variants: Vec<ForwardVariant>,
    /// Extra Hopper forward rows, each with a forced schedule: `+`-joined overlap, pingpong,
    /// grouped, persistent, or plain for none; comma-separated
    #[arg(long, value_name = "SCHEDULE,..", value_delimiter = ',')]
    hopper_schedules: Vec<HopperSchedule>,
    /// Extra Hopper backward rows at the lengths of --bwd-seqs, each with the split of a GQA
    /// group's query heads over cubes forced: auto (the plan's), never, or a number of parts
    /// (the largest divisor of the group not above it); comma-separated
    #[arg(long, value_name = "SPLIT,..", value_delimiter = ',')]
    hopper_head_splits: Vec<HopperHeadSplit>,
    /// Extra deterministic Hopper forward+backward rows at the lengths of --bwd-seqs, each with
    /// who makes the ordered dQ adds forced: consumers or producer; comma-separated
    #[arg(long, value_enum, value_name = "ADDS,..", value_delimiter = ',')]
    hopper_deterministic_adds: Vec<HopperDeterministicAdds>,
    #[command(flatten)]
    cargo_bench: CargoBench,
}

/// A kernel variant of the whole-attention forward rows.
#[derive(Clone, Copy, ValueEnum)]
enum ForwardVariant {
    /// What `Variant::Auto` picks (Hopper on H100/H200)
    Auto,
    /// The Hopper kernel (wgmma, TMA)
    Hopper,
    /// The tensor-core kernels (mma.sync)
    TensorCore,
    /// The portable scalar kernels
    Portable,
}

/// Who makes the deterministic Hopper backward's ordered dQ adds in a row.
#[derive(Clone, Copy, ValueEnum)]
enum HopperDeterministicAdds {
    /// The consumer warpgroups, each waiting for its turn
    Consumers,
    /// A producer warp per warpgroup, from a buffer in shared memory (FlashAttention-3's form;
    /// the default)
    Producer,
}

impl HopperDeterministicAdds {
    fn forced(self) -> (&'static str, DeterministicAdds) {
        match self {
            Self::Consumers => ("consumers", DeterministicAdds::Consumers),
            Self::Producer => ("producer", DeterministicAdds::Producer),
        }
    }
}

/// A Hopper forward schedule forced for a row, as `+`-joined parts (`overlap+pingpong`).
#[derive(Clone)]
struct HopperSchedule {
    name: String,
    schedule: ForwardSchedule,
}

impl FromStr for HopperSchedule {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let mut schedule = ForwardSchedule {
            intra_overlap: false,
            pingpong: false,
            grouped_slices: false,
            persistent: false,
        };
        for part in text.split('+').filter(|part| *part != "plain") {
            match part {
                "overlap" => schedule.intra_overlap = true,
                "pingpong" => schedule.pingpong = true,
                "grouped" => schedule.grouped_slices = true,
                "persistent" => schedule.persistent = true,
                other => {
                    return Err(format!(
                        "takes `+`-joined overlap, pingpong, grouped, persistent, or plain; got \
                         {other:?}"
                    ))
                }
            }
        }
        Ok(Self {
            name: text.to_string(),
            schedule,
        })
    }
}

/// A split of the Hopper backward's GQA groups forced for a row: `auto`, `never` or a count.
#[derive(Clone)]
struct HopperHeadSplit {
    name: String,
    split: HeadSplit,
}

impl FromStr for HopperHeadSplit {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let split =
            match text {
                "auto" => HeadSplit::Auto,
                "never" => HeadSplit::Never,
                parts => HeadSplit::Parts(parts.parse().map_err(|_| {
                    format!("takes auto, never or a number of parts; got {parts:?}")
                })?),
            };
        Ok(Self {
            name: text.to_string(),
            split,
        })
    }
}

/// Heads and head dimension of one benchmark run.
#[derive(Clone, Copy)]
struct Shape {
    kv_heads: usize,
    head_dim: usize,
}

fn causal_forward_flops(seq: usize, shape: Shape) -> f64 {
    4.0 * (seq as f64).powi(2) * HEADS as f64 * shape.head_dim as f64 / 2.0
}

/// Lengths of the packed documents of the mask rows, in order, repeated and cut at the
/// sequence's end (`benches/mask_anchor.py` packs the same).
const DOCUMENT_LENGTHS: [usize; 6] = [3000, 7000, 2048, 5500, 8000, 4100];

/// Cumulative lengths of [`DOCUMENT_LENGTHS`] packed into `seq` positions.
fn packed_documents(seq: usize) -> Vec<usize> {
    let mut cu = vec![0];
    for &len in DOCUMENT_LENGTHS.iter().cycle() {
        let end = (cu[cu.len() - 1] + len).min(seq);
        cu.push(end);
        if end == seq {
            return cu;
        }
    }
    unreachable!("the cycle never ends")
}

/// Forward FLOPs of the (query, key) pairs `mask` leaves visible over `seq` positions:
/// `4 * pairs * H * D`.
fn visible_forward_flops(mask: &Mask, seq: usize, shape: Shape) -> f64 {
    let pairs: usize = (0..seq).map(|i| mask.visible_keys(0, i, seq).len()).sum();
    4.0 * pairs as f64 * HEADS as f64 * shape.head_dim as f64
}

/// Calls per timed run in the queued rows.
const QUEUED: usize = 8;

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
    (heads, seq, head_dim): (usize, usize, usize),
    seed: u64,
    elem: ElemType,
) -> DeviceTensor {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let data: Vec<f32> = (0..heads * seq * head_dim)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    DeviceTensor::from_f32(client, &data, vec![1, heads, seq, head_dim], elem)
}

/// Seconds per call of [`QUEUED`] whole-attention forwards queued back to back with one wait
/// for all of them (median of `iters`): what a training loop sees, without the host's
/// launch-and-wait latency of a single call.
fn queued_forward_seconds(
    client: &ComputeClient<CudaRuntime>,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    options: &StepOptions,
    iters: usize,
) -> f64 {
    median_seconds(iters, || {
        for _ in 0..QUEUED {
            let _ = distflash_kernels::attention(client, q, k, v, options).unwrap();
        }
        sync(client);
    }) / QUEUED as f64
}

fn sync(client: &ComputeClient<CudaRuntime>) {
    cubecl::future::block_on(client.sync()).expect("sync");
}

/// Waits for the device on CubeCL's device-runner thread instead of the calling thread. A
/// diagnostic for the single-call rows: CubeCL 0.10's runner, idle while the host waits, falls
/// back to sleeping in 150 us steps, so the next call's launch waits for it to wake up. Waiting
/// on the runner keeps it busy; the difference between the two rows is that wake-up.
fn sync_on_runner(client: &ComputeClient<CudaRuntime>) {
    client
        .exclusive(|| cubecl::future::block_on(client.sync()))
        .expect("runner")
        .expect("sync");
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
    let shape = [1, HEADS, seq, 128];
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
    let shape = [1, HEADS, seq, 128];
    let make =
        || Tensor::<BurnAutodiff, 4>::random(shape, Distribution::Default, &device).require_grad();
    let (q, k, v) = (make(), make(), make());
    median_seconds(iters, || {
        let out = attention(q.clone(), k.clone(), v.clone(), None, None, burn_options());
        let grads = out.sum().backward();
        let _ = q.grad(&grads).map(|g| g.into_data());
    })
}

/// Query, key and value chunks of a sequence cut into `chunks` pieces, and the kernel variant
/// their steps run on.
struct Chunks {
    q: Vec<DeviceTensor>,
    k: Vec<DeviceTensor>,
    v: Vec<DeviceTensor>,
    grad_out: Vec<DeviceTensor>,
    len: usize,
    variant: Variant,
}

impl Chunks {
    fn new(
        client: &ComputeClient<CudaRuntime>,
        seq: usize,
        chunks: usize,
        shape: Shape,
        elem: ElemType,
    ) -> Self {
        let len = seq / chunks;
        let make = |heads: usize, seed: u64| -> Vec<DeviceTensor> {
            (0..chunks)
                .map(|c| {
                    random_tensor(
                        client,
                        (heads, len, shape.head_dim),
                        seed * 100 + c as u64,
                        elem,
                    )
                })
                .collect()
        };
        Chunks {
            q: make(HEADS, 1),
            k: make(shape.kv_heads, 2),
            v: make(shape.kv_heads, 3),
            grad_out: make(HEADS, 4),
            len,
            variant: Variant::Auto,
        }
    }

    fn options(&self, i: usize, j: usize) -> StepOptions {
        StepOptions {
            mask: Mask::causal().at((i * self.len) as i64, (j * self.len) as i64),
            scale: None,
            variant: self.variant,
            deterministic: false,
        }
    }

    /// Causal forward over every (query chunk, earlier-or-same key chunk) pair: `(O, lse)` per
    /// query chunk.
    fn forward(
        &self,
        client: &ComputeClient<CudaRuntime>,
        shape: Shape,
    ) -> Vec<(DeviceTensor, DeviceTensor)> {
        (0..self.q.len())
            .map(|i| {
                let state =
                    SoftmaxState::empty(client, 1, HEADS, self.len, shape.head_dim).unwrap();
                for j in 0..=i {
                    distflash_kernels::forward_step(
                        client,
                        &self.q[i],
                        &self.k[j],
                        &self.v[j],
                        &state,
                        &self.options(i, j),
                    )
                    .unwrap();
                }
                distflash_kernels::finalize(client, &state, self.q[i].elem).unwrap()
            })
            .collect()
    }

    /// [`Chunks::forward`] with each query chunk's first key chunk starting its state
    /// (`forward_first_step`) and its last one finishing it (`forward_last_step`): no state is
    /// filled, read back or finalised by kernels of its own. A query chunk with one key chunk is
    /// one `attention` call.
    fn forward_fused_ends(
        &self,
        client: &ComputeClient<CudaRuntime>,
    ) -> Vec<(DeviceTensor, DeviceTensor)> {
        (0..self.q.len())
            .map(|i| {
                let q = &self.q[i];
                if i == 0 {
                    let options = self.options(0, 0);
                    return distflash_kernels::attention(
                        client, q, &self.k[0], &self.v[0], &options,
                    )
                    .unwrap();
                }
                let state = distflash_kernels::forward_first_step(
                    client,
                    q,
                    &self.k[0],
                    &self.v[0],
                    &self.options(i, 0),
                )
                .unwrap();
                for j in 1..i {
                    distflash_kernels::forward_step(
                        client,
                        q,
                        &self.k[j],
                        &self.v[j],
                        &state,
                        &self.options(i, j),
                    )
                    .unwrap();
                }
                distflash_kernels::forward_last_step(
                    client,
                    q,
                    &self.k[i],
                    &self.v[i],
                    state,
                    &self.options(i, i),
                )
                .unwrap()
            })
            .collect()
    }

    /// Causal backward over the same pairs, from the forward's results.
    fn backward(
        &self,
        client: &ComputeClient<CudaRuntime>,
        outputs: &[(DeviceTensor, DeviceTensor)],
        shape: Shape,
    ) {
        let n = self.q.len();
        let q_shape = vec![1, HEADS, self.len, shape.head_dim];
        let kv_shape = vec![1, shape.kv_heads, self.len, shape.head_dim];
        let dk: Vec<_> = (0..n)
            .map(|_| distflash_kernels::zeros_f32(client, kv_shape.clone()).unwrap())
            .collect();
        let dv: Vec<_> = (0..n)
            .map(|_| distflash_kernels::zeros_f32(client, kv_shape.clone()).unwrap())
            .collect();
        for (i, (out, lse)) in outputs.iter().enumerate() {
            let delta = distflash_kernels::backward_delta(client, out, &self.grad_out[i]).unwrap();
            let dq = distflash_kernels::zeros_f32(client, q_shape.clone()).unwrap();
            for j in 0..=i {
                let grads = GradAccumulators {
                    dq: dq.clone(),
                    dk: dk[j].clone(),
                    dv: dv[j].clone(),
                };
                distflash_kernels::backward_step(
                    client,
                    &self.q[i],
                    &self.k[j],
                    &self.v[j],
                    &self.grad_out[i],
                    lse,
                    &delta,
                    &grads,
                    &self.options(i, j),
                )
                .unwrap();
            }
        }
    }
}

/// One set of whole-attention forward rows: a variant, a forced Hopper schedule or none.
struct ForwardRun {
    name: String,
    variant: Variant,
    schedule: Option<ForwardSchedule>,
}

/// The rows of each of `variants` (Auto's rows keep their name, `distflash (bf16)`), no
/// schedule forced.
fn variant_runs(variants: &[ForwardVariant]) -> impl Iterator<Item = ForwardRun> + '_ {
    variants.iter().map(|variant| {
        let (name, variant) = match variant {
            ForwardVariant::Auto => ("distflash (bf16)", Variant::Auto),
            ForwardVariant::Hopper => ("distflash hopper (bf16)", Variant::Hopper),
            ForwardVariant::TensorCore => ("distflash tensor-core (bf16)", Variant::TensorCore),
            ForwardVariant::Portable => ("distflash portable (bf16)", Variant::Portable),
        };
        ForwardRun {
            name: name.into(),
            variant,
            schedule: None,
        }
    })
}

/// The forward rows of `--variants` and of `--hopper-schedules` (the Hopper variant with that
/// schedule forced).
fn forward_runs(args: &Args) -> Vec<ForwardRun> {
    let variants = variant_runs(&args.variants);
    let schedules = args.hopper_schedules.iter().map(|hopper| ForwardRun {
        name: format!("distflash hopper {} (bf16)", hopper.name),
        variant: Variant::Hopper,
        schedule: Some(hopper.schedule),
    });
    variants.chain(schedules).collect()
}

/// The backward rows of one kernel variant at one length: its inputs and how to name the rows.
struct BackwardRows<'a> {
    client: &'a ComputeClient<CudaRuntime>,
    /// q, k, v and the output gradient.
    inputs: (
        &'a DeviceTensor,
        &'a DeviceTensor,
        &'a DeviceTensor,
        &'a DeviceTensor,
    ),
    name: &'a str,
    seq: usize,
    /// The forward's FLOPs (the backward is 2.5 times, forward+backward 3.5 times).
    flops: f64,
    iters: usize,
    /// Whether to time the first backward call in the process (compilation included).
    first: bool,
}

impl BackwardRows<'_> {
    /// The forward's `(O, lse)` with `options`.
    fn forward(&self, options: &StepOptions) -> (DeviceTensor, DeviceTensor) {
        let (q, k, v, _) = self.inputs;
        distflash_kernels::attention(self.client, q, k, v, options).unwrap()
    }

    /// The backward from the forward's `(O, lse)` with `options`.
    fn backward(&self, (out, lse): &(DeviceTensor, DeviceTensor), options: &StepOptions) {
        let (q, k, v, grad_out) = self.inputs;
        let _ = distflash_kernels::attention_backward(
            self.client,
            q,
            k,
            v,
            out,
            lse,
            grad_out,
            options,
        )
        .unwrap();
    }

    /// One forward and one backward with `options`.
    fn forward_backward(&self, options: &StepOptions) {
        self.backward(&self.forward(options), options);
    }

    /// Seconds per forward+backward: one call at a time, or (`queued`) [`QUEUED`] back to back
    /// with one wait, as a training loop issues them (the anchor times with CUDA events).
    fn forward_backward_seconds(&self, options: &StepOptions, queued: bool) -> f64 {
        let calls = if queued { QUEUED } else { 1 };
        median_seconds(self.iters.min(3), || {
            (0..calls).for_each(|_| self.forward_backward(options));
            sync(self.client);
        }) / calls as f64
    }

    /// Prints forward+backward one call at a time and queued.
    fn print_forward_backward(
        &self,
        options: &StepOptions,
        row: &dyn Fn(&str, &str, usize, f64, f64),
    ) {
        let (name, seq, flops) = (self.name, self.seq, 3.5 * self.flops);
        let secs = self.forward_backward_seconds(options, false);
        row(name, "fwd+bwd", seq, secs, flops);
        let secs = self.forward_backward_seconds(options, true);
        row(&format!("{name}, queued"), "fwd+bwd", seq, secs, flops);
    }

    /// Prints the variant's rows: the first backward call (compilation included, where asked),
    /// forward+backward one call at a time and queued, and the backward alone, queued.
    fn print(&self, options: &StepOptions, row: &dyn Fn(&str, &str, usize, f64, f64)) {
        let (name, seq, flops) = (self.name, self.seq, self.flops);
        let forward = self.forward(options);
        sync(self.client);
        let backward = || self.backward(&forward, options);
        if self.first {
            let start = Instant::now();
            backward();
            sync(self.client);
            let secs = start.elapsed().as_secs_f64();
            println!("| {name} | first bwd call | {seq} | {:.0} | |", secs * 1e3);
        }
        self.print_forward_backward(options, row);
        let secs = median_seconds(self.iters.min(3), || {
            (0..QUEUED).for_each(|_| backward());
            sync(self.client);
        }) / QUEUED as f64;
        row(&format!("{name}, queued"), "bwd", seq, secs, 2.5 * flops);
    }
}

fn main() {
    let args = Args::parse();
    let forward_runs = forward_runs(&args);
    let chunk_runs: Vec<ForwardRun> = if args.chunk_variants.is_empty() {
        variant_runs(&args.variants).collect()
    } else {
        variant_runs(&args.chunk_variants).collect()
    };
    let (seqs, bwd_seqs, burn_seqs) = (&args.seqs, &args.bwd_seqs, &args.burn_seqs);
    let (iters, chunks) = (args.iters as usize, args.chunks as usize);
    let shape = Shape {
        kv_heads: args.kv_heads as usize,
        head_dim: args.head_dim as usize,
    };
    let client = CudaRuntime::client(&CudaDevice::new(0));
    let elem = ElemType::BF16;
    let options = StepOptions {
        mask: Mask::causal(),
        scale: None,
        variant: Variant::Auto,
        deterministic: false,
    };
    println!(
        "# {HEADS} query heads, {} kv heads, head dim {}; tensor cores used: {}; Hopper kernels \
         available: {}",
        shape.kv_heads,
        shape.head_dim,
        distflash_kernels::tensor_core_available(&client, elem, shape.head_dim),
        distflash_kernels::hopper::available(&client)
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
    for &seq in seqs.iter() {
        let q_dims = (HEADS, seq, shape.head_dim);
        let kv_dims = (shape.kv_heads, seq, shape.head_dim);
        let (q, k, v) = (
            random_tensor(&client, q_dims, 1, elem),
            random_tensor(&client, kv_dims, 2, elem),
            random_tensor(&client, kv_dims, 3, elem),
        );
        let flops = causal_forward_flops(seq, shape);
        for run in &forward_runs {
            schedule::force(run.schedule);
            let options = StepOptions {
                variant: run.variant,
                ..options.clone()
            };
            let name = &run.name;
            if seq == seqs[0] {
                // The first call in the process: compilation (NVRTC, the driver's JIT) included.
                let start = Instant::now();
                let _ = distflash_kernels::attention(&client, &q, &k, &v, &options).unwrap();
                sync(&client);
                let secs = start.elapsed().as_secs_f64();
                println!("| {name} | first call | {seq} | {:.0} | |", secs * 1e3);
            }
            let secs = median_seconds(iters, || {
                let _ = distflash_kernels::attention(&client, &q, &k, &v, &options).unwrap();
                sync(&client);
            });
            row(name, "fwd", seq, secs, flops);
            let secs = median_seconds(iters, || {
                let _ = distflash_kernels::attention(&client, &q, &k, &v, &options).unwrap();
                sync_on_runner(&client);
            });
            row(
                &format!("{name}, waited on the runner"),
                "fwd",
                seq,
                secs,
                flops,
            );
            let secs = queued_forward_seconds(&client, (&q, &k, &v), &options, iters);
            row(&format!("{name}, queued"), "fwd", seq, secs, flops);
        }
        schedule::force(None);
        if bwd_seqs.contains(&seq) {
            let grad_out = random_tensor(&client, q_dims, 4, elem);
            for run in forward_runs.iter().filter(|run| run.schedule.is_none()) {
                let options = StepOptions {
                    variant: run.variant,
                    ..options.clone()
                };
                let backward_rows = BackwardRows {
                    client: &client,
                    inputs: (&q, &k, &v, &grad_out),
                    name: &run.name,
                    seq,
                    flops,
                    iters,
                    first: seq == bwd_seqs[0],
                };
                backward_rows.print(&options, &row);
                // The deterministic backward: dQ in its own kernel on the tensor cores, dQ
                // added in a fixed order on Hopper.
                let exact = StepOptions {
                    deterministic: true,
                    ..options.clone()
                };
                let secs = backward_rows.forward_backward_seconds(&exact, false);
                let name = format!("{}, deterministic", run.name);
                row(&name, "fwd+bwd", seq, secs, 3.5 * flops);
            }
            // The Hopper backward with each forced split of the GQA groups' heads.
            for forced in &args.hopper_head_splits {
                schedule::force_backward(Some(BackwardSchedule {
                    head_split: forced.split,
                    ..BackwardSchedule::default()
                }));
                let name = format!("distflash hopper, head split {} (bf16)", forced.name);
                let backward_rows = BackwardRows {
                    client: &client,
                    inputs: (&q, &k, &v, &grad_out),
                    name: &name,
                    seq,
                    flops,
                    iters,
                    first: false,
                };
                let hopper = StepOptions {
                    variant: Variant::Hopper,
                    ..options.clone()
                };
                backward_rows.print(&hopper, &row);
            }
            // The deterministic Hopper backward with each form of its ordered dQ adds forced.
            for forced in &args.hopper_deterministic_adds {
                let (adds_name, adds) = forced.forced();
                schedule::force_backward(Some(BackwardSchedule {
                    deterministic_adds: adds,
                    ..BackwardSchedule::default()
                }));
                let backward_rows = BackwardRows {
                    client: &client,
                    inputs: (&q, &k, &v, &grad_out),
                    name: "",
                    seq,
                    flops,
                    iters,
                    first: false,
                };
                let exact = StepOptions {
                    variant: Variant::Hopper,
                    deterministic: true,
                    ..options.clone()
                };
                // A first call out of the timing (the form's kernels compile on it).
                backward_rows.forward_backward(&exact);
                sync(&client);
                let secs = backward_rows.forward_backward_seconds(&exact, false);
                let name = format!("distflash hopper, deterministic, {adds_name} adds (bf16)");
                row(&name, "fwd+bwd", seq, secs, 3.5 * flops);
            }
            schedule::force_backward(None);
        }
        drop((q, k, v));
        if chunks > 1 {
            let mut parts = Chunks::new(&client, seq, chunks, shape, elem);
            // The steps on each variant of `--chunk-variants` (Auto's rows keep their names).
            for run in &chunk_runs {
                parts.variant = run.variant;
                let label = run.name.trim_end_matches(" (bf16)");
                let name = format!("{label} steps, {chunks} chunks (bf16)");
                let secs = median_seconds(iters, || {
                    let _ = parts.forward(&client, shape);
                    sync(&client);
                });
                row(&name, "fwd", seq, secs, flops);
                let secs = median_seconds(iters, || {
                    let _ = parts.forward_fused_ends(&client);
                    sync(&client);
                });
                let fused_name = format!("{label} steps, {chunks} chunks, first/last fused (bf16)");
                row(&fused_name, "fwd", seq, secs, flops);
                if bwd_seqs.contains(&seq) {
                    let secs = median_seconds(iters.min(3), || {
                        let outputs = parts.forward(&client, shape);
                        parts.backward(&client, &outputs, shape);
                        sync(&client);
                    });
                    row(&name, "fwd+bwd", seq, secs, 3.5 * flops);
                    let secs = median_seconds(iters.min(3), || {
                        let outputs = parts.forward_fused_ends(&client);
                        parts.backward(&client, &outputs, shape);
                        sync(&client);
                    });
                    row(&fused_name, "fwd+bwd", seq, secs, 3.5 * flops);
                }
            }
        }
    }
    let window = args.window as usize;
    for &seq in args.mask_seqs.iter() {
        let documents = Documents::from_cu_seqlens(&packed_documents(seq)).expect("documents");
        let masks = [
            (
                format!("window {window}"),
                Mask::causal().with_window(
                    SlidingWindow::causal(window).expect("--window takes a size of at least 1"),
                ),
            ),
            (
                "documents 2K-8K".to_string(),
                Mask::causal().with_documents(documents),
            ),
        ];
        let q_dims = (HEADS, seq, shape.head_dim);
        let kv_dims = (shape.kv_heads, seq, shape.head_dim);
        let (q, k, v, grad_out) = (
            random_tensor(&client, q_dims, 1, elem),
            random_tensor(&client, kv_dims, 2, elem),
            random_tensor(&client, kv_dims, 3, elem),
            random_tensor(&client, q_dims, 4, elem),
        );
        // Each mask on each variant of `--variants` (Auto's rows keep their name).
        let runs = || forward_runs.iter().filter(|run| run.schedule.is_none());
        for ((name, mask), run) in masks.iter().flat_map(|m| runs().map(move |run| (m, run))) {
            let flops = visible_forward_flops(mask, seq, shape);
            let options = StepOptions {
                mask: mask.clone(),
                variant: run.variant,
                ..options.clone()
            };
            let name = format!("{}, {name}", run.name);
            let secs = median_seconds(iters, || {
                let _ = distflash_kernels::attention(&client, &q, &k, &v, &options).unwrap();
                sync(&client);
            });
            row(&name, "fwd", seq, secs, flops);
            let secs = queued_forward_seconds(&client, (&q, &k, &v), &options, iters);
            row(&format!("{name}, queued"), "fwd", seq, secs, flops);
            let backward_rows = BackwardRows {
                client: &client,
                inputs: (&q, &k, &v, &grad_out),
                name: &name,
                seq,
                flops,
                iters,
                first: false,
            };
            backward_rows.print_forward_backward(&options, &row);
        }
    }
    for &seq in burn_seqs.iter() {
        let flops = causal_forward_flops(seq, shape);
        row(
            "burn attention (f16)",
            "fwd",
            seq,
            burn_forward(seq, iters),
            flops,
        );
        if bwd_seqs.contains(&seq) {
            row(
                "burn attention (f16, autodiff)",
                "fwd+bwd",
                seq,
                burn_forward_backward(seq, iters.min(3)),
                3.5 * flops,
            );
        }
    }
}
