//! Trains a Llama-shaped model with this project's attention and checkpointing.
//!
//! `cargo run --release -p distflash-llama` trains the tiny config on the CPU on Tiny
//! Shakespeare (byte-level tokens) for a few minutes, with a progress bar, and writes
//! `runs/llama-tiny/{metrics.jsonl,loss.svg,checkpoint/}`, then prints a short text sampled
//! from the trained model.
//!
//! Options (all optional):
//! - model: `--config tiny|llama-7b|llama-gqa|llama-33h|llama-16h|llama-8h|llama-4h|llama-2h|
//!   llama3-8b|FILE.json`, `--layers N` (override the layer count), `--weights HF_DIR` (load a
//!   Hugging Face Llama: config.json + safetensors; overrides --config),
//!   `--checkpoint none|layer|attention-output`, `--offload off|all|N` (the layers' checkpoints
//!   wait in host memory between forward and backward: every layer's, or all but the last N
//!   layers'; overrides the config's `offload`), `--window N` (sliding-window attention: each
//!   token sees itself and the N - 1 before it; overrides the config's `window`),
//!   `--save-config FILE.json`;
//! - data: `--data FILE.txt`, `--tokenizer tokenizer.json` (byte-level otherwise), `--pack`
//!   (the text is documents each ended by an end-of-text token, and no token attends across
//!   one: see `distflash_llama::data::Packing`), `--eot ID|TOKEN` (that token, by id or by
//!   name; default: byte 3, ASCII "end of text", for the byte tokenizer, else the tokenizer's
//!   `<|end_of_text|>`, `<|endoftext|>`, `</s>` or `<eos>`);
//! - devices: `--backend ndarray|wgpu|cuda`, `--gpus N` (CUDA, one process driving N GPUs, the
//!   sequence split across them), `--env` (one process per GPU from RANK/WORLD_SIZE/LOCAL_RANK/
//!   MASTER_ADDR/MASTER_PORT, e.g. under torchrun), `--dtype bf16|f32` (GPU), `--schedule
//!   auto|ring|balanced|zigzag`;
//! - optimisation: `--steps`, `--batch`, `--seq-len` (whole sequence), `--lr`, `--warmup`,
//!   `--grad-clip`, `--seed`, `--zero 0|1|2` (the optimizer: 0 replicated, 1 f32 master weights
//!   and moments sharded over the group, 2 also the gradients reduce-scattered; default 2 on
//!   several ranks, 0 on one; the memory each rank holds is printed after the first step);
//! - memory: `--loss-chunk N` (the output projection and loss take N tokens of a rank at a time:
//!   one chunk of logits exists at once), `--ffn-chunk N` (likewise every feed-forward block);
//!   by default each is as many tokens as fit a 1 GiB budget for its transient tensors; neither
//!   changes the results), `--memory auto` (the largest chunks the memory planner predicts to
//!   fit `--gpu-memory` and, unless `--offload` is given, the fewest layers to offload with
//!   them), `--plan` (print the planner's prediction of one GPU's memory and of the host
//!   memory the offloaded checkpoints take, for these options; with `--gpu-memory BYTES`, e.g.
//!   `139GiB`, also the longest sequence that fits with this offload, what `--memory auto`
//!   would pick, and the longest sequence it can train; then exit, touching no device),
//!   `--host-memory BYTES` (the host memory offloaded checkpoints may take on this host, shared
//!   by its GPUs; default: what the host has available now);
//! - validation: `--val-fraction F` (the last fraction of the corpus is held out, default 0.05),
//!   `--val-every N` (validation loss every N steps and at the end, in metrics.jsonl and on the
//!   plot; 0 turns it off);
//! - sample: `--prompt TEXT`, `--sample-tokens N` (0 turns the sample off);
//! - output: `--out DIR`, `--save-every N`, `--resume` (continue from DIR/checkpoint, at the
//!   same or another number of ranks, with the checkpoint's options; `--steps N` beside it sets
//!   a new total, and the learning-rate schedule's length with it), `--log-every N`, `--export-weights HF_DIR` (at the end,
//!   the final checkpoint's weights as a Hugging Face model that `--weights` loads: the f32
//!   master weights under `--zero 1|2`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::config::Config;
use burn::module::Module;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn_distflash::collective::on_each_rank;
use burn_distflash::layers::{replicate, CheckpointPlacement, Offload, RowChunks};
use burn_distflash::schedule::ScheduleKind;
use burn_distflash::{AttentionContext, DeviceGroup, Documents};
use distflash_llama::data::{Packing, TokenDataset};
use distflash_llama::generate::{generate, Sampling};
use distflash_llama::memory_plan::MemoryPlanner;
use distflash_llama::metrics::{read_metrics, write_loss_plot_svg, Curve, MetricsLog, StepMetrics};
use distflash_llama::optimizer::ZeroStage;
use distflash_llama::progress::ProgressBar;
use distflash_llama::tokenizer::{Tokenizer, END_OF_TEXT_NAMES};
use distflash_llama::train::{export_weights, TrainBackend, TrainOptions, Trainer};
use distflash_llama::weights::load_hf_llama;
use distflash_llama::{parse_bytes, Error, Llama, LlamaConfig};

/// Everything the command line chose.
#[derive(Clone)]
struct Args {
    config: String,
    layers: Option<usize>,
    weights: Option<PathBuf>,
    checkpoint: Option<CheckpointPlacement>,
    offload: Option<Offload>,
    window: Option<usize>,
    save_config: Option<PathBuf>,
    data: PathBuf,
    tokenizer: Option<PathBuf>,
    pack: bool,
    eot: Option<String>,
    /// What `--pack` and `--eot` resolve to with the tokenizer and the model (set by `main`).
    packing: Option<Packing>,
    backend: String,
    gpus: usize,
    env: bool,
    dtype: String,
    schedule: ScheduleKind,
    options: TrainOptions,
    /// `--zero`, or `None` for the default of the group's size.
    zero: Option<ZeroStage>,
    out: PathBuf,
    save_every: u64,
    resume: bool,
    /// Whether `--steps` was given (with `--resume`, it replaces the checkpoint's total).
    steps_given: bool,
    /// Whether `--loss-chunk`, `--ffn-chunk` or `--memory auto` was given (with `--resume`, the
    /// chunks replace the checkpoint's).
    chunks_given: bool,
    /// `--plan`: print the memory plan and exit.
    plan: bool,
    /// `--memory auto`: the chunks come from the memory planner.
    memory_auto: bool,
    /// `--gpu-memory`: the bytes of one GPU, for `--plan` and `--memory auto`.
    gpu_memory: Option<u64>,
    /// `--host-memory`: the bytes of host memory offloaded checkpoints may take on this host
    /// (default: what the host has available now).
    host_memory: Option<u64>,
    export_weights: Option<PathBuf>,
    log_every: u64,
    val_fraction: f64,
    val_every: u64,
    prompt: String,
    sample_tokens: usize,
}

/// Batches averaged for one validation loss (the same batches every time).
const VALIDATION_BATCHES: u64 = 4;

/// Mixed into the seed of the validation batches, so they are not the training batches' draws.
const VALIDATION_SEED: u64 = 0x5641_4C49_4441_5445;

/// How the sample after training is drawn: top-10 at temperature 0.8.
const SAMPLE_TOP_K: usize = 10;
const SAMPLE_TEMPERATURE: f64 = 0.8;

fn fail(message: impl std::fmt::Display) -> ! {
    eprintln!("llama_train: {message}");
    std::process::exit(2)
}

fn parse() -> Args {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let value = |name: &str| -> Option<String> {
        raw.iter().position(|a| a == name).map(|i| {
            raw.get(i + 1)
                .cloned()
                .unwrap_or_else(|| fail(format!("{name} needs a value")))
        })
    };
    let number = |name: &str, default: f64| -> f64 {
        value(name).map_or(default, |v| match v.parse::<f64>() {
            Ok(x) if x.is_finite() => x,
            _ => fail(format!("{name} takes a finite number, got {v:?}")),
        })
    };
    // Counts and sizes: a whole number, never a fraction or a negative value cut to fit.
    let count = |name: &str, default: u64| -> u64 {
        value(name).map_or(default, |v| {
            v.parse().unwrap_or_else(|_| {
                fail(format!(
                    "{name} takes a whole number from 0 to {}, got {v:?}",
                    u64::MAX
                ))
            })
        })
    };
    let size = |name: &str, default: u64| -> usize {
        usize::try_from(count(name, default))
            .unwrap_or_else(|_| fail(format!("{name} does not fit this machine's sizes")))
    };
    let known = [
        "--config",
        "--layers",
        "--weights",
        "--checkpoint",
        "--offload",
        "--window",
        "--save-config",
        "--data",
        "--tokenizer",
        "--pack",
        "--eot",
        "--backend",
        "--gpus",
        "--env",
        "--dtype",
        "--schedule",
        "--steps",
        "--batch",
        "--seq-len",
        "--lr",
        "--warmup",
        "--grad-clip",
        "--seed",
        "--zero",
        "--loss-chunk",
        "--ffn-chunk",
        "--memory",
        "--gpu-memory",
        "--host-memory",
        "--plan",
        "--out",
        "--save-every",
        "--resume",
        "--export-weights",
        "--log-every",
        "--val-fraction",
        "--val-every",
        "--prompt",
        "--sample-tokens",
    ];
    if let Some(bad) = raw
        .iter()
        .find(|a| a.starts_with("--") && !known.contains(&a.as_str()))
    {
        fail(format!(
            "unknown option {bad}; options: {}",
            known.join(" ")
        ));
    }
    let config = value("--config").unwrap_or_else(|| "tiny".into());
    let checkpoint = value("--checkpoint").map(|c| match c.as_str() {
        "none" => CheckpointPlacement::None,
        "layer" => CheckpointPlacement::Layer,
        "attention-output" => CheckpointPlacement::AttentionOutput,
        other => fail(format!(
            "--checkpoint takes none, layer or attention-output, got {other}"
        )),
    });
    let schedule = match value("--schedule").as_deref().unwrap_or("auto") {
        "auto" => ScheduleKind::Auto,
        "ring" => ScheduleKind::Ring,
        "balanced" => ScheduleKind::Balanced,
        "zigzag" => ScheduleKind::Zigzag,
        other => fail(format!(
            "--schedule takes auto, ring, balanced or zigzag, got {other}"
        )),
    };
    // Tokens per chunk: at least 1; absent, the default memory budget.
    let chunks = |name: &str| {
        value(name).map(|_| {
            RowChunks::rows(size(name, 0)).unwrap_or_else(|e| fail(format!("{name}: {e}")))
        })
    };
    let (loss_chunk, ffn_chunk) = (chunks("--loss-chunk"), chunks("--ffn-chunk"));
    let mut options = TrainOptions::new(
        count("--steps", 600),
        size("--batch", 8),
        size("--seq-len", 128),
    )
    .with_lr(number("--lr", 2e-3))
    .with_warmup(count("--warmup", 20))
    .with_grad_clip(number("--grad-clip", 1.0))
    .with_seed(count("--seed", 0));
    let memory_auto = match value("--memory").as_deref() {
        None => false,
        Some("auto") => true,
        Some(other) => fail(format!("--memory takes auto, got {other:?}")),
    };
    if memory_auto && (loss_chunk.is_some() || ffn_chunk.is_some()) {
        fail("--memory auto picks the chunks itself: drop --loss-chunk and --ffn-chunk");
    }
    if let Some(chunks) = loss_chunk {
        options.loss_chunks = chunks;
    }
    if let Some(chunks) = ffn_chunk {
        options.ffn_chunks = chunks;
    }
    Args {
        out: value("--out").map_or_else(
            || PathBuf::from(format!("runs/llama-{config}")),
            PathBuf::from,
        ),
        config,
        layers: value("--layers").map(|_| size("--layers", 0)),
        weights: value("--weights").map(PathBuf::from),
        checkpoint,
        offload: value("--offload")
            .map(|o| o.parse().unwrap_or_else(|e| fail(format!("--offload {e}")))),
        window: value("--window").map(|_| size("--window", 0)),
        save_config: value("--save-config").map(PathBuf::from),
        data: value("--data").map_or_else(
            || Path::new(env!("CARGO_MANIFEST_DIR")).join("data/tiny_shakespeare.txt"),
            PathBuf::from,
        ),
        tokenizer: value("--tokenizer").map(PathBuf::from),
        pack: raw.iter().any(|a| a == "--pack"),
        eot: value("--eot"),
        packing: None,
        backend: value("--backend").unwrap_or_else(|| "ndarray".into()),
        gpus: size("--gpus", 1),
        env: raw.iter().any(|a| a == "--env"),
        dtype: value("--dtype").unwrap_or_else(|| "bf16".into()),
        schedule,
        options,
        zero: value("--zero").map(|z| z.parse().unwrap_or_else(|e| fail(format!("--zero: {e}")))),
        save_every: count("--save-every", 100),
        resume: raw.iter().any(|a| a == "--resume"),
        steps_given: raw.iter().any(|a| a == "--steps"),
        chunks_given: memory_auto
            || raw
                .iter()
                .any(|a| a == "--loss-chunk" || a == "--ffn-chunk"),
        plan: raw.iter().any(|a| a == "--plan"),
        memory_auto,
        gpu_memory: value("--gpu-memory")
            .map(|v| parse_bytes("--gpu-memory", &v).unwrap_or_else(|e| fail(e))),
        host_memory: value("--host-memory")
            .map(|v| parse_bytes("--host-memory", &v).unwrap_or_else(|e| fail(e))),
        export_weights: value("--export-weights").map(PathBuf::from),
        log_every: count("--log-every", 10),
        val_fraction: number("--val-fraction", 0.05),
        val_every: count("--val-every", 50),
        prompt: value("--prompt").unwrap_or_else(|| "ROMEO:".into()),
        sample_tokens: size("--sample-tokens", 200),
    }
}

/// The model configuration (before any tensor exists), checked against the tokenizer.
fn model_config(args: &Args, tokenizer: &Tokenizer) -> LlamaConfig {
    let mut config = match &args.weights {
        Some(dir) => {
            let hf = distflash_llama::hf_config::read_hf_config(&dir.join("config.json"))
                .unwrap_or_else(|e| fail(e));
            LlamaConfig::from_hf(&hf)
        }
        None => LlamaConfig::from_name_or_file(&args.config).unwrap_or_else(|e| fail(e)),
    };
    if let Some(layers) = args.layers {
        config.n_layers = layers;
    }
    if let Some(placement) = args.checkpoint {
        config.checkpoint = placement;
    }
    if let Some(offload) = args.offload {
        config.offload = offload;
    }
    if let Some(window) = args.window {
        config.window = Some(window);
    }
    config.validate().unwrap_or_else(|e| fail(e));
    if tokenizer.vocab_size() > config.vocab_size {
        fail(format!(
            "the tokenizer has {} tokens but the model's vocabulary is {}; use a config whose \
             vocab_size covers the tokenizer",
            tokenizer.vocab_size(),
            config.vocab_size
        ));
    }
    if let Some(path) = &args.save_config {
        config
            .save(path)
            .unwrap_or_else(|e| fail(format!("writing {}: {e}", path.display())));
    }
    config
}

/// What `--pack` and `--eot` ask for: documents ended by the named token or the tokenizer's
/// default end-of-text token, checked against the model's vocabulary.
fn packing(args: &Args, tokenizer: &Tokenizer, config: &LlamaConfig) -> Option<Packing> {
    if !args.pack {
        if args.eot.is_some() {
            fail("--eot names the token that ends documents under --pack; add --pack");
        }
        return None;
    }
    let eot = match &args.eot {
        Some(eot) => eot
            .parse()
            .ok()
            .or_else(|| tokenizer.token_id(eot))
            .unwrap_or_else(|| {
                fail(format!(
                    "--eot takes a token id or a named token of the tokenizer, got {eot:?}"
                ))
            }),
        None => tokenizer.end_of_text().unwrap_or_else(|| {
            fail(format!(
                "--pack: the tokenizer has none of the end-of-text tokens {END_OF_TEXT_NAMES:?}; \
                 name the one that ends documents with --eot ID|TOKEN"
            ))
        }),
    };
    Some(Packing::new(eot, config.vocab_size).unwrap_or_else(|e| fail(format!("--eot: {e}"))))
}

/// The documents of a batch's `inputs` under `--pack`; `None` without it.
fn documents(args: &Args, inputs: &[u32], seq_len: usize) -> Result<Option<Documents>, Error> {
    args.packing
        .map(|packing| packing.documents(inputs, seq_len))
        .transpose()
}

/// A Hugging Face directory's weights (`--weights`) as bytes, read on the CPU, so every rank
/// (thread or process) starts from them; `None` for a fresh model, which is drawn on the
/// training device ([`load_model`]).
fn initial_weights(args: &Args) -> Option<Vec<u8>> {
    type Cpu = burn::backend::NdArray<f32>;
    let dir = args.weights.as_ref()?;
    let model: Llama<Cpu> = load_hf_llama::<Cpu>(dir, &Default::default())
        .unwrap_or_else(|e| fail(e))
        .1;
    let bytes = BinBytesRecorder::<FullPrecisionSettings>::new()
        .record(model.into_record(), ())
        .unwrap_or_else(|e| fail(format!("serialising the initial weights: {e}")));
    Some(bytes)
}

/// The model on `device`: with the initial `weights`, or a fresh one drawn on the device from
/// `--seed` ([`LlamaConfig::try_init_on_device`]: the same seed gives the same weights on the
/// same backend, in every process of a multi-process run too).
fn load_model<B: TrainBackend>(
    args: &Args,
    config: &LlamaConfig,
    weights: Option<&[u8]>,
    device: &B::Device,
) -> Llama<B> {
    let Some(weights) = weights else {
        return config
            .try_init_on_device::<B>(device, args.options.seed)
            .unwrap_or_else(|e| fail(e));
    };
    let record = BinBytesRecorder::<FullPrecisionSettings>::new()
        .load(weights.to_vec(), device)
        .unwrap_or_else(|e| fail(format!("loading the initial weights: {e}")));
    config
        .try_init::<B>(device)
        .unwrap_or_else(|e| fail(e))
        .load_record(record)
}

/// `--zero`, or by default: several ranks shard the optimizer (f32 master weights, 1/P of the
/// memory each), one rank keeps the replicated optimizer.
fn zero_stage(args: &Args, world: usize) -> ZeroStage {
    args.zero.unwrap_or(match world {
        1 => ZeroStage::Replicated,
        _ => ZeroStage::Gradients,
    })
}

/// The memory planner for what the command line asks: the group's size from `--gpus` (or, under
/// `--env`, `WORLD_SIZE`), the elements' size from `--dtype` on CUDA (f32 elsewhere).
fn memory_planner(args: &Args, config: &LlamaConfig) -> MemoryPlanner {
    let world = match (args.env, args.backend.as_str()) {
        (true, _) => std::env::var("WORLD_SIZE")
            .ok()
            .and_then(|w| w.parse().ok())
            .unwrap_or_else(|| fail("--env: WORLD_SIZE is not set to a number of processes")),
        (false, "cuda") => args.gpus,
        (false, _) => 1,
    };
    let elem_bytes = match (args.backend.as_str(), args.dtype.as_str()) {
        ("cuda", "bf16") => 2,
        _ => 4,
    };
    let options = args.options.clone().with_zero(zero_stage(args, world));
    let mut planner = MemoryPlanner::new(config.clone(), options, world, elem_bytes);
    planner.host_limit = host_limit_per_gpu(args);
    planner
}

/// The host memory one GPU's offloaded checkpoints may take: `--host-memory` (or, by default,
/// what this host has available now) less the offload's headroom, shared by the GPUs this host
/// drives (`--gpus` in one process; under `--env`, `LOCAL_WORLD_SIZE` processes, as torchrun
/// sets it, else one). `None` where the host does not say what it has.
fn host_limit_per_gpu(args: &Args) -> Option<u64> {
    let host = args
        .host_memory
        .or_else(burn_distflash::offload::host_memory_available)?;
    let ranks_here = match args.env {
        true => std::env::var("LOCAL_WORLD_SIZE")
            .ok()
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(1),
        false => args.gpus as u64,
    };
    Some(host.saturating_sub(burn_distflash::offload::HEADROOM) / ranks_here.max(1))
}

/// `--plan`: prints the plan and exits; `--memory auto`: sets the largest chunks that fit and,
/// unless `--offload` was given, the fewest layers to offload with them.
fn plan_memory(args: &mut Args, config: &mut LlamaConfig) {
    let planner = memory_planner(args, config);
    let choose_offload = args.offload.is_none();
    if args.plan {
        let report = planner
            .report(args.gpu_memory, choose_offload)
            .unwrap_or_else(|e| fail(format!("--plan: {e}")));
        println!("{report}");
        if args.gpu_memory.is_none() {
            println!("(give --gpu-memory BYTES, e.g. 139GiB, for the longest sequence that fits)");
        }
        std::process::exit(0);
    }
    if args.memory_auto {
        let gpu = args.gpu_memory.unwrap_or_else(|| {
            fail("--memory auto needs --gpu-memory BYTES: the memory of one GPU, e.g. 139GiB")
        });
        let fitted = planner
            .fitting_memory(gpu, choose_offload)
            .unwrap_or_else(|e| fail(format!("--memory auto: {e}")));
        eprintln!(
            "--memory auto: loss chunks of {} rows, feed-forward chunks of {} rows, offload {:?}",
            fitted.plan.loss_rows, fitted.plan.ffn_rows, fitted.offload,
        );
        args.options.loss_chunks = fitted.loss_chunks;
        args.options.ffn_chunks = fitted.ffn_chunks;
        config.offload = fitted.offload;
    }
    if args.backend == "cuda" {
        // Printed for every CUDA run, to stand beside the memory report after the first step.
        match memory_planner(args, config).plan() {
            Ok(plan) => eprintln!(
                "memory planner: predicted peak {} per GPU, {} of checkpoints in host memory",
                distflash_llama::format_bytes(plan.peak),
                distflash_llama::format_bytes(plan.host)
            ),
            Err(e) => fail(format!("the memory planner: {e}")),
        }
    }
}

/// Trains `model` on one rank (the only one, or rank `context`'s of a group).
fn train_rank<B: TrainBackend>(
    args: &Args,
    config: &LlamaConfig,
    model: Llama<B>,
    context: AttentionContext<B>,
) {
    let world = match &context {
        AttentionContext::Local => 1,
        AttentionContext::Sharded { group, .. } => group.world_size(),
    };
    let options = args.options.clone().with_zero(zero_stage(args, world));
    let mut trainer = Trainer::new(model, context, options);
    let (rank, world) = trainer.rank();
    let leader = rank == 0;
    let checkpoint_dir = args.out.join("checkpoint");
    if args.resume {
        trainer = trainer.resume(&checkpoint_dir).unwrap_or_else(|e| fail(e));
        if args.steps_given {
            if args.options.steps < trainer.step {
                fail(format!(
                    "--steps {} is below the checkpoint's step {}: give a total of at least {}",
                    args.options.steps, trainer.step, trainer.step
                ));
            }
            trainer.options.steps = args.options.steps;
        }
        if args.chunks_given {
            // Memory only: the checkpoint's run continues identically with other chunks.
            trainer.set_chunks(args.options.loss_chunks, args.options.ffn_chunks);
        }
    }
    let tokenizer = tokenizer(args);
    let o = trainer.options.clone();
    let corpus =
        TokenDataset::from_file(&args.data, &tokenizer, o.seq_len).unwrap_or_else(|e| fail(e));
    let (data, validation) = corpus
        .split(args.val_fraction)
        .unwrap_or_else(|e| fail(format!("--val-fraction: {e}")));
    if args.val_every > 0 && validation.num_windows(o.seq_len) == 0 {
        fail(format!(
            "the held-out slice (--val-fraction {}) has {} tokens, fewer than one sequence of \
             {} + 1; raise --val-fraction or turn validation off with --val-every 0",
            args.val_fraction,
            validation.len(),
            o.seq_len
        ));
    }
    let metrics_path = args.out.join("metrics.jsonl");
    let mut log = leader.then(|| {
        std::fs::create_dir_all(&args.out).unwrap_or_else(|e| fail(e));
        match args.resume {
            true => MetricsLog::resume(&metrics_path, trainer.step),
            false => MetricsLog::create(&metrics_path),
        }
        .unwrap_or_else(|e| fail(e))
    });
    if leader {
        eprintln!(
            "training {} params ({} layers, d_model {}, {} heads / {} kv) on {world} {} rank(s), \
             {} x {} tokens per step, checkpoint {:?}, offload {:?}, ZeRO stage {}",
            config.num_params(),
            config.n_layers,
            config.d_model,
            config.n_heads,
            config.n_kv_heads,
            args.backend,
            o.batch,
            o.seq_len,
            config.checkpoint,
            config.offload,
            trainer.options.zero
        );
        if let Some(packing) = args.packing {
            let (documents, eot) = (packing.count(data.tokens()), packing.eot());
            match documents {
                0 | 1 => eprintln!(
                    "packed: the training text holds no end-of-text token (id {eot}) before its \
                     end, so it is one document and --pack changes nothing"
                ),
                _ => eprintln!(
                    "packed: {documents} documents in the training text, each ended by token id \
                     {eot}; no token attends across one"
                ),
            }
        }
        if let Some(window) = config.window {
            eprintln!(
                "sliding window: each token sees itself and the {} before it",
                window - 1
            );
        }
    }
    let mut bar =
        leader.then(|| ProgressBar::new(o.steps, args.log_every).resumed_from(trainer.step));
    let start = Instant::now();
    // The step of this run's last checkpoint (none yet), and its first step.
    let (mut saved_at, first_step) = (None, trainer.step);
    while trainer.step < o.steps {
        let step_start = Instant::now();
        let (x, y) = data
            .batch(trainer.step, o.seed, o.batch, o.seq_len)
            .unwrap_or_else(|e| fail(e));
        let documents = documents(args, &x, o.seq_len).unwrap_or_else(|e| fail(e));
        let stats =
            (trainer.train_step_packed(&x, &y, documents.as_ref())).unwrap_or_else(|e| fail(e));
        let tokens_per_s = (o.batch * o.seq_len) as f64 / step_start.elapsed().as_secs_f64();
        if leader && trainer.step == first_step + 1 {
            // After the first step, so that the device's count includes the optimizer's state.
            eprintln!("{}", trainer.memory_report());
        }
        let last = trainer.step == o.steps;
        let validate = args.val_every > 0 && (last || trainer.step.is_multiple_of(args.val_every));
        let val_loss = validate.then(|| {
            validation_loss(args, &trainer, &validation)
                .unwrap_or_else(|e| fail(format!("validation loss: {e}")))
        });
        if let (Some(bar), Some(log)) = (bar.as_mut(), log.as_mut()) {
            bar.update(trainer.step, stats.loss, tokens_per_s);
            log.log(&StepMetrics {
                step: trainer.step,
                loss: stats.loss,
                lr: stats.lr,
                tokens_per_s,
                grad_norm: stats.grad_norm,
                elapsed_s: start.elapsed().as_secs_f64(),
                val_loss,
            })
            .unwrap_or_else(|e| fail(e));
        }
        if last || (args.save_every > 0 && trainer.step.is_multiple_of(args.save_every)) {
            trainer.save(&checkpoint_dir).unwrap_or_else(|e| fail(e));
            saved_at = Some(trainer.step);
        }
    }
    if let Some(out) = &args.export_weights {
        if saved_at != Some(trainer.step) && !args.resume {
            trainer.save(&checkpoint_dir).unwrap_or_else(|e| fail(e));
        }
        if leader {
            export_weights(&trainer.model, config, &checkpoint_dir, out)
                .unwrap_or_else(|e| fail(format!("--export-weights: {e}")));
            eprintln!("weights exported to {}", out.display());
        }
    }
    if let Some(mut bar) = bar {
        bar.finish();
        let records = read_metrics(&metrics_path).unwrap_or_else(|e| fail(e));
        let points: Vec<(u64, f64)> = records.iter().map(|m| (m.step, m.loss)).collect();
        let val_points: Vec<(u64, f64)> = records
            .iter()
            .filter_map(|m| Some((m.step, m.val_loss?)))
            .collect();
        let plot = args.out.join("loss.svg");
        let curves = [
            Curve {
                label: "training",
                points: &points,
            },
            Curve {
                label: "validation (held out)",
                points: &val_points,
            },
        ];
        write_loss_plot_svg(&curves, &plot, "loss").unwrap_or_else(|e| fail(e));
        let validation = val_points
            .last()
            .map_or(String::new(), |p| format!(", validation loss {:.3}", p.1));
        eprintln!(
            "done: {} steps, final loss {:.3}{validation}; {}, {}, {}",
            trainer.step,
            points.last().map_or(f64::NAN, |p| p.1),
            metrics_path.display(),
            plot.display(),
            checkpoint_dir.display()
        );
        print_sample(args, &trainer, &tokenizer);
    }
}

/// Mean loss over the same [`VALIDATION_BATCHES`] batches of the held-out slice (every rank of a
/// group takes part).
fn validation_loss<B: TrainBackend>(
    args: &Args,
    trainer: &Trainer<B>,
    validation: &TokenDataset,
) -> Result<f64, Error> {
    let o = &trainer.options;
    let mut total = 0.0;
    for i in 0..VALIDATION_BATCHES {
        let (x, y) = validation.batch(i, o.seed ^ VALIDATION_SEED, o.batch, o.seq_len)?;
        let documents = documents(args, &x, o.seq_len)?;
        total += trainer.evaluate_packed(&x, &y, documents.as_ref())?;
    }
    Ok(total / VALIDATION_BATCHES as f64)
}

/// Prints a text sampled from the trained model after `args.prompt`.
fn print_sample<B: TrainBackend>(args: &Args, trainer: &Trainer<B>, tokenizer: &Tokenizer) {
    if args.sample_tokens == 0 {
        return;
    }
    let prompt = tokenizer
        .encode(&args.prompt)
        .unwrap_or_else(|e| fail(format!("--prompt: {e}")));
    let sampling = Sampling::TopK {
        k: SAMPLE_TOP_K,
        temperature: SAMPLE_TEMPERATURE,
        seed: trainer.options.seed,
    };
    let context = trainer.options.seq_len;
    // Weights that need gradients would build a graph per token that no backward ever frees.
    let tokens = generate(
        &trainer.model.clone().no_grad(),
        &prompt,
        args.sample_tokens,
        context,
        sampling,
    )
    .unwrap_or_else(|e| fail(e));
    let text = tokenizer.decode(&tokens).unwrap_or_else(|e| fail(e));
    eprintln!(
        "sample ({} tokens after the prompt, top-{SAMPLE_TOP_K} at temperature \
         {SAMPLE_TEMPERATURE}):",
        args.sample_tokens
    );
    println!("{text}");
}

fn tokenizer(args: &Args) -> Tokenizer {
    match &args.tokenizer {
        Some(path) => Tokenizer::from_file(path).unwrap_or_else(|e| fail(e)),
        None => Tokenizer::bytes(),
    }
}

type CudaInner<F> = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, F, i32, u8>;
type Cuda<F> = burn_autodiff::Autodiff<CudaInner<F>>;

/// Runs one rank per GPU of `devices` in this process (threads), or this process's rank.
fn train_cuda<F: burn_cubecl::FloatElement>(
    args: &Args,
    config: &LlamaConfig,
    weights: Option<&[u8]>,
) where
    Cuda<F>: TrainBackend<Device = cubecl::cuda::CudaDevice>
        + burn::tensor::backend::AutodiffBackend<InnerBackend = CudaInner<F>>,
    CudaInner<F>: burn::tensor::backend::Backend<Device = cubecl::cuda::CudaDevice>,
{
    let context = |group: DeviceGroup<CudaInner<F>>| {
        AttentionContext::sharded(group).with_schedule(args.schedule)
    };
    if args.env {
        // One process per GPU: every process loads the same initial weights.
        let group = DeviceGroup::<CudaInner<F>>::nccl_from_env().unwrap_or_else(|e| fail(e));
        let model = load_model::<Cuda<F>>(args, config, weights, group.device());
        return train_rank(args, config, model, context(group));
    }
    let devices: Vec<_> = (0..args.gpus).map(cubecl::cuda::CudaDevice::new).collect();
    let model = load_model::<Cuda<F>>(args, config, weights, &devices[0]);
    if devices.len() == 1 {
        return train_rank(args, config, model, AttentionContext::Local);
    }
    let groups = DeviceGroup::<CudaInner<F>>::nccl(&devices).unwrap_or_else(|e| fail(e));
    // One trainable copy of the model per GPU, all with the same weights.
    let models = replicate(&model, &devices);
    drop(model);
    on_each_rank(
        groups.into_iter().zip(models).collect(),
        |_, (group, model)| train_rank(args, config, model, context(group)),
    );
}

fn main() {
    let mut args = parse();
    args.options.check().unwrap_or_else(|e| fail(e));
    let tokenizer = tokenizer(&args);
    let mut config = model_config(&args, &tokenizer);
    plan_memory(&mut args, &mut config);
    args.packing = packing(&args, &tokenizer, &config);
    if args.resume && !args.out.join("checkpoint").join("trainer.json").exists() {
        fail(format!(
            "--resume: no checkpoint in {}",
            args.out.join("checkpoint").display()
        ));
    }
    if !args.data.exists() {
        fail(format!(
            "the training text {} does not exist (--data)",
            args.data.display()
        ));
    }
    let weights = initial_weights(&args);
    let weights = weights.as_deref();
    match (args.backend.as_str(), args.dtype.as_str()) {
        ("ndarray", _) => {
            type Cpu = burn_autodiff::Autodiff<burn::backend::NdArray<f32>>;
            let model = load_model::<Cpu>(&args, &config, weights, &Default::default());
            train_rank(&args, &config, model, AttentionContext::Local)
        }
        ("wgpu", _) => {
            type Wgpu = burn_autodiff::Autodiff<
                burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>,
            >;
            let model = load_model::<Wgpu>(&args, &config, weights, &Default::default());
            train_rank(&args, &config, model, AttentionContext::Local)
        }
        ("cuda", "bf16") => train_cuda::<half::bf16>(&args, &config, weights),
        ("cuda", "f32") => train_cuda::<f32>(&args, &config, weights),
        (backend, dtype) => fail(format!(
            "--backend takes ndarray, wgpu or cuda and --dtype bf16 or f32 (GPU); got {backend} / {dtype}"
        )),
    }
}
