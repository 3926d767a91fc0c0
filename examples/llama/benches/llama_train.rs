//! Training throughput of a Llama-shaped model with sequence parallelism over P GPUs (one
//! process, one thread per GPU, NCCL), bf16, AdamW, gradient all-reduce, on random tokens.
//!
//! `cargo bench -p distflash-llama --bench llama_train -- --config llama-7b [--layers 4] --gpus 4
//!  --seq 32768 [--iters 2] [--checkpoint attention-output|layer|none] [--offload off|all|N]
//!  [--batch 1] [--zero 0|1|2] [--optimizer-state gpu|host] [--optimizer-chunk BYTES]
//!  [--grad-bucket BYTES] [--attention-groups N] [--layers-per-checkpoint 1|2]
//!  [--profile-last-step] [--phases]` (`-- --help` lists the options with their defaults)
//!
//! `--zero 1|2` trains with the sharded optimizer (f32 master weights and moments, 1/P per
//! rank); `--optimizer-state host` keeps that state in pinned host memory, streamed through the
//! GPU in chunks of `--optimizer-chunk` at every step: run it beside `--optimizer-state gpu` for
//! the step time and GPU memory of each (the pinned host line then counts the state too).
//! `--grad-bucket` sets the bytes of f32 one bucket of the sharded optimizer's gradient sum
//! gathers (256 MiB by default).
//!
//! `--offload all|N` keeps the layers' checkpoints in pinned host memory between forward and
//! backward (every layer's, or all but the last N layers'): run it beside `--offload off` (the
//! default) for the step time with and without offload; the row's checkpoint column says which,
//! and a line under it gives rank 0's pinned host memory and its device memory in use right
//! after one forward (the copies to host waited for), the offload's saving.
//!
//! Under the row, the memory planner's predicted peak for the setting (its `--zero`,
//! `--optimizer-state`, `--optimizer-chunk` and `--grad-bucket` included), the phase it falls in and the
//! optimizer step's terms stand beside rank 0's pool's reserved bytes: the peak of the timed
//! steps, as the pools give back what they hold free after the warm-up (the first step's
//! autotuning buffers, and a first step has no optimizer state during its backward); with
//! `--iters 0`, the first step's peak.
//!
//! `--phases` runs one more step after the timed ones with the device synchronised after each
//! phase and prints rank 0's phase times (forward and loss, backward, gradient sums and norm,
//! clipping, optimizer) under the row. `DISTFLASH_UNFUSED_OPTIMIZER=1` runs Burn's tensor-op
//! AdamW and gradient norm instead of the fused kernels, for side-by-side runs.
//!
//! `--profile-last-step` brackets rank 0's last step with `cuProfilerStart` / `cuProfilerStop`
//! (after a device sync on each side), so a profiler started with its collection off
//! (`ncu --profile-from-start off ...`) sees exactly one warmed-up step and no autotuning.
//!
//! One configuration per process (an out-of-memory error ends the process, so the longest
//! trainable sequence is found by a shell loop). Prints one table row: tokens/s over the whole
//! group, model TFLOP/s per GPU and MFU against the H200's dense bf16 peak (989 TFLOP/s), rank 0's
//! peak reserved memory on GPU 0 (its own pool plus the one holding the initial weights). Every
//! rank trains its own copy of one model (`replicate`). Model FLOPs per token: 6 x (non-embedding params + output projection)
//! + 6 x layers x d_model x S (causal attention, forward + backward), recomputation not counted.

use std::sync::{Arc, Barrier};
use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_distflash::collective::on_each_rank;
use burn_distflash::layers::{replicate, CheckpointPlacement, Offload};
use burn_distflash::offload::{finish_copies, pinned_bytes};
use burn_distflash::sequence_parallel::shard_sequence;
use burn_distflash::{AttentionContext, DeviceGroup};
use clap::Parser;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::Runtime;
use distflash_llama::cli::{at_least_one, bytes, offload, placement, OptimizerState, Zero};
use distflash_llama::memory_plan::MemoryPlanner;
use distflash_llama::optimizer::{DEFAULT_GRAD_BUCKET_BYTES, DEFAULT_STATE_CHUNK_BYTES};
use distflash_llama::train::{PhaseTimes, TrainOptions, Trainer};
use distflash_llama::LlamaConfig;

type Inner = burn_cubecl::CubeBackend<CudaRuntime, half::bf16, i32, u8>;
type Train = burn_autodiff::Autodiff<Inner>;

/// The total memory CubeCL's pools are cut from on the H200s measured (the quarter and 64th of
/// it are the pages they allocated), for the planner's pool classes.
const H200_POOL_MEMORY: u64 = 150_109_880_320;

const H200_BF16_PEAK: f64 = 989e12;

/// Untimed steps before the timed ones: the first tunes Burn's kernels and compiles ours, the
/// second is the first with an optimizer state (the fused AdamW update's first run).
const WARM_UP: usize = 2;

/// The bench's command line.
#[derive(Parser)]
#[command(about = "Llama training throughput with sequence parallelism over P GPUs (NCCL)")]
struct Args {
    /// The model: a preset (llama-7b, llama-gqa, llama-33h, llama-16h, llama-8h, llama-4h,
    /// llama-2h, llama3-8b, tiny)
    #[arg(long, value_name = "PRESET", default_value = "llama-7b")]
    config: String,
    /// Overrides the preset's number of layers
    #[arg(long, value_name = "N", value_parser = at_least_one())]
    layers: Option<usize>,
    /// GPUs, one thread each, the sequence split across them
    #[arg(long, value_name = "N", value_parser = at_least_one(), default_value_t = 4)]
    gpus: usize,
    /// Tokens per sequence (the whole sequence)
    #[arg(long, value_name = "TOKENS", value_parser = at_least_one(), default_value_t = 32768)]
    seq: usize,
    /// Sequences per step
    #[arg(long, value_name = "N", value_parser = at_least_one(), default_value_t = 1)]
    batch: usize,
    /// Timed steps after the two warm-up steps (0: warm-up only, for the memory)
    #[arg(long, value_name = "N", default_value_t = 2)]
    iters: usize,
    /// Where each layer keeps what its backward needs
    #[arg(long, value_name = "PLACEMENT", value_parser = placement(), default_value = "attention-output")]
    checkpoint: CheckpointPlacement,
    /// Checkpoints in pinned host memory between forward and backward: off, all, or N (all but
    /// the last N layers')
    #[arg(long, value_name = "off|all|N", value_parser = offload)]
    offload: Option<Offload>,
    /// Groups of heads each layer's attention runs over one after another (a divisor of the
    /// key/value heads)
    #[arg(long, value_name = "N", value_parser = at_least_one(), default_value_t = 1)]
    attention_groups: usize,
    /// Layers per checkpoint: 1, or 2 (pairs of layers keep one input; needs --checkpoint layer)
    #[arg(long, value_name = "N", value_parser = at_least_one(), default_value_t = 1)]
    layers_per_checkpoint: usize,
    /// The optimizer's ZeRO stage: 0 (replicated, moments in bf16), 1 or 2 (f32 master weights
    /// and moments, 1/P per rank)
    #[arg(long, value_enum, value_name = "STAGE", default_value = "0")]
    zero: Zero,
    /// Where --zero 1|2 keeps its f32 state: gpu, or host (pinned, streamed through the GPU)
    #[arg(long, value_enum, value_name = "gpu|host", default_value = "gpu")]
    optimizer_state: OptimizerState,
    /// Bytes of state one chunk of --optimizer-state host brings to the GPU [default: 512MiB]
    #[arg(long, value_name = "BYTES", value_parser = bytes)]
    optimizer_chunk: Option<u64>,
    /// Bytes of f32 one bucket of --zero 1|2's gradient sum gathers (every GPU's range of it)
    /// [default: 256MiB]
    #[arg(long, value_name = "BYTES", value_parser = bytes)]
    grad_bucket: Option<u64>,
    /// Bracket rank 0's last step with cuProfilerStart / cuProfilerStop
    #[arg(long)]
    profile_last_step: bool,
    /// One more step, synchronised after each phase, and rank 0's phase times
    #[arg(long)]
    phases: bool,
    /// The flag `cargo bench` appends (ignored).
    #[arg(long = "bench", hide = true)]
    cargo_bench: bool,
}

/// Turns the attached CUDA profiler's collection on or off for GPU 0's primary context (the
/// context CubeCL's CUDA runtime runs on), made current on this thread first.
fn profiler_collects(on: bool) {
    let context = cudarc::driver::CudaContext::new(0).expect("CUDA context of GPU 0");
    context.bind_to_thread().expect("bind the CUDA context");
    // SAFETY: plain driver calls on the context bound above; they take no pointers.
    let status = unsafe {
        if on {
            cudarc::driver::sys::cuProfilerStart()
        } else {
            cudarc::driver::sys::cuProfilerStop()
        }
    };
    if status != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        eprintln!("profiler start/stop returned {status:?}");
    }
}

/// What one rank measured.
struct RankRun {
    /// Each step's wall time, seconds.
    times: Vec<f64>,
    /// Its pool's reserved bytes at the end: the timed steps' peak (the pool is cleaned up after
    /// the warm-up steps), or with `--iters 0` the first step's.
    reserved: u64,
    /// The last step's loss.
    loss: f64,
    /// One synchronised step's phase times, with `--phases`.
    phases: Option<PhaseTimes>,
    /// Bytes in use right after one forward ([`in_use_after_forward`]).
    in_use_after_forward: u64,
}

fn main() {
    // A failed device thread (the GPU out of memory) ends its step with that error, not NaN.
    burn_distflash::device_faults::watch_device_faults();
    std::env::set_var("NCCL_NVLS_ENABLE", "0");
    let args = Args::parse();
    let mut config = LlamaConfig::preset(&args.config).unwrap_or_else(|e| {
        eprintln!("--config: {e}");
        std::process::exit(2)
    });
    if let Some(layers) = args.layers {
        config.n_layers = layers;
    }
    config.checkpoint = args.checkpoint;
    if let Some(offload) = args.offload {
        config.offload = offload;
    }
    config.attention_head_groups = args.attention_groups;
    config.layers_per_checkpoint = args.layers_per_checkpoint;
    if let Err(e) = config.validate() {
        eprintln!("{e}");
        std::process::exit(2)
    }
    let (profile_last_step, phases) = (args.profile_last_step, args.phases);
    let (gpus, seq, iters, batch) = (args.gpus, args.seq, args.iters, args.batch);
    let devices: Vec<CudaDevice> = (0..gpus).map(CudaDevice::new).collect();
    let contexts: Vec<AttentionContext<Train>> = if gpus == 1 {
        vec![AttentionContext::Local]
    } else {
        DeviceGroup::<Inner>::nccl(&devices)
            .expect("NCCL")
            .into_iter()
            .map(AttentionContext::sharded)
            .collect()
    };
    let options = TrainOptions::new((WARM_UP + iters + 1) as u64, batch, seq)
        .with_warmup(1)
        .with_zero(args.zero.into())
        .with_optimizer_state(args.optimizer_state.into())
        .with_state_chunk_bytes(args.optimizer_chunk.unwrap_or(DEFAULT_STATE_CHUNK_BYTES))
        .with_grad_bucket_bytes(args.grad_bucket.unwrap_or(DEFAULT_GRAD_BUCKET_BYTES));
    let barrier = Arc::new(Barrier::new(gpus));
    // Every rank starts from the same weights (initialised on GPU 0 by this thread).
    let model = config.try_init::<Train>(&devices[0]).expect("model");
    let models = replicate(&model, &devices);
    drop(model);
    let per_rank = devices.iter().cloned().zip(contexts).zip(models).collect();
    let ranks: Vec<RankRun> = on_each_rank(per_rank, |_, ((device, context), model)| {
        let mut trainer = Trainer::new(model, context, options.clone());
        let tokens: Vec<u32> = (0..batch * seq)
            .map(|i| ((i * 7919 + 13) % config.vocab_size) as u32)
            .collect();
        let mut times = Vec::new();
        let mut loss = 0.0;
        let steps = if iters == 0 { 1 } else { WARM_UP + iters };
        for step in 0..steps {
            let profiled = profile_last_step && step + 1 == steps && device.index == 0;
            if step == WARM_UP {
                // The pools give back what they hold free (the first step's autotuning buffers
                // among it), so the reserved bytes at the end are the timed steps' peak.
                Train::sync(&device).expect("sync");
                CudaRuntime::client(&device).memory_cleanup();
                Train::sync(&device).expect("sync");
            }
            barrier.wait();
            if profiled {
                Train::sync(&device).expect("sync");
                profiler_collects(true);
            }
            let start = Instant::now();
            loss = trainer.train_step(&tokens, &tokens).expect("step").loss;
            Train::sync(&device).expect("sync");
            times.push(start.elapsed().as_secs_f64());
            if profiled {
                profiler_collects(false);
            }
        }
        let phase_times = phases.then(|| {
            barrier.wait();
            let (_, times) = trainer.train_step_timed(&tokens, &tokens).expect("step");
            times
        });
        let reserved = CudaRuntime::client(&device)
            .memory_usage()
            .expect("memory")
            .bytes_reserved;
        let in_use_after_forward = in_use_after_forward(&trainer, &tokens, batch, &device);
        RankRun {
            times,
            reserved,
            loss,
            phases: phase_times,
            in_use_after_forward,
        }
    });
    // The initial weights were allocated by this thread's stream, whose pool is counted too.
    let initial_reserved = CudaRuntime::client(&devices[0])
        .memory_usage()
        .expect("memory")
        .bytes_reserved;
    // With --iters 0 the only step (which includes the first-use autotuning) is reported.
    let timed = if iters == 0 {
        0..1
    } else {
        WARM_UP..WARM_UP + iters
    };
    let mut steps: Vec<f64> = timed
        .map(|i| ranks.iter().map(|r| r.times[i]).fold(0.0, f64::max))
        .collect();
    steps.sort_by(f64::total_cmp);
    let secs = steps[steps.len() / 2];
    let tokens = (batch * seq) as f64;
    let embedding = (config.vocab_size * config.d_model) as f64;
    let dense = config.num_params() as f64 - embedding;
    let attention = 6.0 * (config.n_layers * config.n_heads * 128 * seq) as f64 / 2.0 * 2.0;
    let flops_per_token = 6.0 * dense + attention;
    let per_gpu = flops_per_token * tokens / secs / gpus as f64;
    let name = &args.config;
    let mut checkpoint = match config.offload {
        Offload::Off => format!("{:?}", config.checkpoint),
        offload => format!("{:?}, offload {offload:?}", config.checkpoint),
    };
    if config.attention_head_groups > 1 {
        checkpoint += &format!(", {} head groups", config.attention_head_groups);
    }
    if config.layers_per_checkpoint > 1 {
        checkpoint += &format!(", {} layers per checkpoint", config.layers_per_checkpoint);
    }
    if options.zero.is_sharded() {
        let state = options.optimizer_state;
        checkpoint += &format!(", ZeRO {}, state on the {state}", options.zero);
    }
    println!(
        "| {name} ({} layers) | {gpus} | {seq} | {checkpoint} | {:.0} | {:.1} | {:.1}% | {:.1} | {:.3} |",
        config.n_layers,
        tokens / secs,
        per_gpu / 1e12,
        100.0 * per_gpu / H200_BF16_PEAK,
        (ranks[0].reserved + initial_reserved) as f64 / (1u64 << 30) as f64,
        ranks[0].loss,
    );
    let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
    println!(
        "memory (rank 0): in use after one forward {:.2} GiB (its own pool); pinned host {:.2} GiB",
        gib(ranks[0].in_use_after_forward),
        gib(pinned_bytes(&devices[0])),
    );
    // The planner's prediction for this setting beside what rank 0's pool reserved (its peak:
    // the weights' replica, gradients, optimizer state and the step's activations).
    let mut planner = MemoryPlanner::new(config.clone(), options.clone(), gpus, 2);
    planner.gpu_memory = Some(H200_POOL_MEMORY);
    match planner.plan() {
        Ok(plan) => println!(
            "memory planner (rank 0's pool): predicted peak {:.2} GiB ({}), reserved {:.2} GiB \
             ({:+.1}%); predicted host {:.2} GiB; optimizer step {}",
            gib(plan.peak),
            plan.peak_phase,
            gib(ranks[0].reserved),
            100.0 * (gib(plan.peak) / gib(ranks[0].reserved) - 1.0),
            gib(plan.host),
            plan.optimizer_step,
        ),
        Err(e) => println!("memory planner: {e}"),
    }
    if let Some(t) = ranks[0].phases {
        let ms = |s: f64| s * 1e3;
        println!(
            "phases (rank 0, one synchronised step, ms): forward+loss {:.1} | backward {:.1} | \
             gradient sums+norm {:.1} | clip {:.1} | optimizer {:.1} | total {:.1}",
            ms(t.forward),
            ms(t.backward),
            ms(t.gradients),
            ms(t.clip),
            ms(t.optimizer),
            ms(t.forward + t.backward + t.gradients + t.clip + t.optimizer),
        );
    }
}

/// Device bytes in use on this rank's pool right after one forward and loss, the copies to host
/// finished, while the autodiff graph (and the checkpoints it keeps) is alive: what the
/// checkpoints hold on the device when the backward starts. The graph is dropped unused.
fn in_use_after_forward(
    trainer: &Trainer<Train>,
    tokens: &[u32],
    batch: usize,
    device: &CudaDevice,
) -> u64 {
    let (rank, world) = trainer.rank();
    let seq = tokens.len() / batch;
    let values: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
    let whole = Tensor::<Train, 2, Int>::from_data(TensorData::new(values, [batch, seq]), device);
    let layout = (trainer.context).layout(trainer.model.attention_options(), seq / world);
    let shard = shard_sequence(whole, 1, layout, world, rank).expect("a shard per rank");
    let loss = (trainer.model)
        .loss(shard.clone(), shard, &trainer.context, batch * seq)
        .expect("forward");
    finish_copies::<Inner>(device);
    Train::sync(device).expect("sync");
    let in_use = CudaRuntime::client(device)
        .memory_usage()
        .expect("memory")
        .bytes_in_use;
    drop(loss);
    in_use
}
