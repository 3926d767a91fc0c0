//! Trains a Llama-shaped model with this project's attention and checkpointing.
//!
//! `cargo run --release -p distflash-llama` trains the tiny config on the CPU on Tiny
//! Shakespeare (byte-level tokens) for a few minutes, with a progress bar, and writes
//! `runs/llama-tiny/{metrics.jsonl,loss.svg,checkpoint/}`, then prints a short text sampled
//! from the trained model.
//!
//! `llama_train --help` lists every option, grouped (model, data, devices, processes,
//! optimisation, memory, output), with its default, units and allowed values; the command line
//! is `distflash_llama::cli::TrainArgs`. A usage error exits with code 2 and says what is wrong,
//! as does any check of the options against the model, the data or a checkpoint before work
//! starts.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use burn::config::Config;
use burn::module::Module;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn_distflash::collective::on_each_rank;
use burn_distflash::device_faults;
use burn_distflash::{AttentionContext, DeviceGroup, Documents};
use distflash_llama::cli::{BackendKind, Dtype, TrainArgs};
use distflash_llama::data::{Packing, TokenDataset};
use distflash_llama::disk_space;
use distflash_llama::format_bytes;
use distflash_llama::generate::{generate, Sampling};
use distflash_llama::loss_plot::{write_loss_plot_svg, Curve};
use distflash_llama::memory_plan::MemoryPlanner;
use distflash_llama::metrics::{read_metrics, MetricsLog, StepMetrics};
use distflash_llama::optimizer::{StatePlacement, ZeroStage};
use distflash_llama::progress::ProgressBar;
use distflash_llama::tokenizer::{Tokenizer, END_OF_TEXT_NAMES};
use distflash_llama::train::{export_weights, TrainBackend, TrainOptions, Trainer};
use distflash_llama::weights::load_hf_llama;
use distflash_llama::{Error, Llama, LlamaConfig};

/// The command line and what the run resolves from it.
struct Run {
    args: TrainArgs,
    /// The trainer's options: the command line's, with the chunks `--memory auto` picks.
    options: TrainOptions,
    /// What `--pack` and `--eot` resolve to with the tokenizer and the model (set by `main`).
    packing: Option<Packing>,
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
    exit_now(2)
}

/// Ends the process with `code` at once, its standard streams flushed, without C's `atexit`
/// handlers or any destructor: a failed run can leave other threads at work (a rank's, CubeCL's
/// device threads, the CUDA driver's), and running those handlers beside them corrupted the heap
/// on the way out (a GPU out of memory on two H200s: `malloc(): unaligned tcache chunk
/// detected`, exit code 134 instead of 1, after the error line).
fn exit_now(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: `_exit` ends the process on the spot; the metrics log is written unbuffered and
    // nothing else needs to run.
    unsafe { libc::_exit(code) }
}

/// Ends a run whose training step failed (a peer that went silent or died, a device error):
/// exit code 1, the step and the error on standard error.
/// A failed device thread (the GPU out of memory) is the cause of whatever the step then
/// reported, so its message replaces the step's.
fn fail_step(step: u64, message: impl std::fmt::Display) -> ! {
    let message = message.to_string();
    match device_faults::device_fault() {
        Some(fault) if !message.contains(&fault.to_string()) => {
            eprintln!("llama_train: step {step}: {fault}")
        }
        _ => eprintln!("llama_train: step {step}: {message}"),
    }
    exit_now(1)
}

/// The command line read, and its options that need no model or data checked.
fn parse() -> Run {
    let args = TrainArgs::from_command_line();
    if !args.devices.env && !args.process_options_given.is_empty() {
        fail(format!(
            "{} describe this process's place in a group of processes: add --env",
            args.process_options_given.join(", ")
        ));
    }
    let mut options = args.optimisation.train_options();
    let (loss_chunks, ffn_chunks) = args.memory.chunks();
    if let Some(chunks) = loss_chunks {
        options.loss_chunks = chunks;
    }
    if let Some(chunks) = ffn_chunks {
        options.ffn_chunks = chunks;
    }
    if let Some((placement, chunk_bytes)) = args.memory.optimizer_state() {
        options.optimizer_state = placement;
        options.state_chunk_bytes = chunk_bytes;
    }
    if let Some(bytes) = args.memory.grad_bucket {
        options.grad_bucket_bytes = bytes;
    }
    options.check().unwrap_or_else(|e| fail(e));
    Run {
        args,
        options,
        packing: None,
    }
}

/// The model configuration (before any tensor exists), checked against the tokenizer.
fn model_config(args: &TrainArgs, tokenizer: &Tokenizer) -> LlamaConfig {
    let model = &args.model;
    let mut config = match &model.weights {
        Some(dir) => {
            let hf = distflash_llama::hf_config::read_hf_config(&dir.join("config.json"))
                .unwrap_or_else(|e| fail(e));
            LlamaConfig::from_hf(&hf)
        }
        None => LlamaConfig::from_name_or_file(&model.config).unwrap_or_else(|e| fail(e)),
    };
    if let Some(layers) = model.layers {
        config.n_layers = layers;
    }
    if let Some(placement) = args.memory.checkpoint {
        config.checkpoint = placement;
    }
    if let Some(offload) = args.memory.offload {
        config.offload = offload;
    }
    if let Some(groups) = args.memory.attention_groups {
        config.attention_head_groups = groups;
    }
    if let Some(layers) = args.memory.layers_per_checkpoint {
        config.layers_per_checkpoint = layers;
    }
    if let Some(window) = model.window {
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
    if let Some(path) = &model.save_config {
        config
            .save(path)
            .unwrap_or_else(|e| fail(format!("writing {}: {e}", path.display())));
    }
    config
}

/// What `--pack` and `--eot` ask for: documents ended by the named token or the tokenizer's
/// default end-of-text token, checked against the model's vocabulary.
fn packing(args: &TrainArgs, tokenizer: &Tokenizer, config: &LlamaConfig) -> Option<Packing> {
    if !args.data.pack {
        return None;
    }
    let eot = match &args.data.eot {
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
fn documents(run: &Run, inputs: &[u32], seq_len: usize) -> Result<Option<Documents>, Error> {
    run.packing
        .map(|packing| packing.documents(inputs, seq_len))
        .transpose()
}

/// A Hugging Face directory's weights (`--weights`) as bytes, read on the CPU, so every rank
/// (thread or process) starts from them; `None` for a fresh model, which is drawn on the
/// training device ([`load_model`]).
fn initial_weights(run: &Run) -> Option<Vec<u8>> {
    type Cpu = burn::backend::NdArray<f32>;
    let dir = run.args.model.weights.as_ref()?;
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
    run: &Run,
    config: &LlamaConfig,
    weights: Option<&[u8]>,
    device: &B::Device,
) -> Llama<B> {
    let Some(weights) = weights else {
        return config
            .try_init_on_device::<B>(device, run.options.seed)
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

/// The CUDA device of `model`, whose offload pool's pinned bytes the log reports after the first
/// step (`None` on the other backends).
fn pinned_memory_device<B: TrainBackend>(model: &Llama<B>) -> Option<cubecl::cuda::CudaDevice> {
    let device = model.devices().into_iter().next()?;
    (&device as &dyn std::any::Any)
        .downcast_ref::<cubecl::cuda::CudaDevice>()
        .cloned()
}

/// `--zero`, or by default: several ranks shard the optimizer (f32 master weights, 1/P of the
/// memory each), one rank keeps the replicated optimizer.
fn zero_stage(args: &TrainArgs, world: usize) -> ZeroStage {
    args.optimisation
        .zero
        .map(ZeroStage::from)
        .unwrap_or(match world {
            1 => ZeroStage::Replicated,
            _ => ZeroStage::Gradients,
        })
}

/// Refuses `--optimizer-state host` without a sharded optimizer, whose state it places.
fn check_optimizer_state(options: &TrainOptions) {
    if options.optimizer_state == StatePlacement::Host && !options.zero.is_sharded() {
        fail(
            "--optimizer-state host places the sharded optimizer's f32 state (ZeRO stages 1 and \
             2): add --zero 1 or --zero 2 (one GPU trains with stage 0 unless told)",
        );
    }
}

/// The memory planner for what the command line asks: the group's size from `--gpus` (or, under
/// `--env`, `--world-size` or `WORLD_SIZE`), the elements' size from `--dtype` on CUDA (f32
/// elsewhere), the host's memory for offloaded checkpoints ([`host_limit_per_gpu`]).
fn memory_planner(run: &Run, config: &LlamaConfig) -> MemoryPlanner {
    let devices = &run.args.devices;
    let world = match (devices.env, devices.backend) {
        (true, _) => {
            devices
                .processes
                .group()
                .unwrap_or_else(|e| fail(format!("--env: {e}")))
                .world_size
        }
        (false, BackendKind::Cuda) => devices.gpus,
        (false, _) => 1,
    };
    let elem_bytes = match (devices.backend, devices.dtype) {
        (BackendKind::Cuda, Dtype::Bf16) => 2,
        _ => 4,
    };
    let options = run.options.clone().with_zero(zero_stage(&run.args, world));
    check_optimizer_state(&options);
    let mut planner = MemoryPlanner::new(config.clone(), options, world, elem_bytes);
    planner.host_limit = host_limit_per_gpu(run);
    planner.gpu_memory = run.args.memory.gpu_memory;
    planner.schedule = devices.schedule.into();
    planner.choose_layers_per_checkpoint = run.args.memory.layers_per_checkpoint.is_none();
    planner.choose_attention_head_groups = run.args.memory.attention_groups.is_none();
    planner
}

/// The host memory one GPU's offloaded checkpoints and host-resident optimizer state may take: `--host-memory` (or, by default,
/// what this host has available now) less the offload's headroom, shared by the GPUs this host
/// drives (`--gpus` in one process; under `--env`, `LOCAL_WORLD_SIZE` processes, as torchrun
/// sets it, else one). `None` where the host does not say what it has.
fn host_limit_per_gpu(run: &Run) -> Option<u64> {
    let host =
        (run.args.memory.host_memory).or_else(burn_distflash::offload::host_memory_available)?;
    let ranks_here = match run.args.devices.env {
        true => std::env::var("LOCAL_WORLD_SIZE")
            .ok()
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(1),
        false => run.args.devices.gpus as u64,
    };
    Some(host.saturating_sub(burn_distflash::offload::HEADROOM) / ranks_here.max(1))
}

/// `--plan`: prints the plan and exits; `--memory auto`: sets the largest chunks that fit and,
/// unless `--offload` was given, the fewest layers to offload with them (and, unless
/// `--layers-per-checkpoint` was given, two layers per checkpoint where nothing fits with one).
fn plan_memory(run: &mut Run, config: &mut LlamaConfig) {
    let planner = memory_planner(run, config);
    let memory = &run.args.memory;
    let choose_offload = memory.offload.is_none();
    if memory.plan {
        let report = planner
            .report(memory.gpu_memory, choose_offload)
            .unwrap_or_else(|e| fail(format!("--plan: {e}")));
        println!("{report}");
        if memory.gpu_memory.is_none() {
            println!("(give --gpu-memory BYTES, e.g. 139GiB, for the longest sequence that fits)");
        }
        std::process::exit(0);
    }
    if memory.auto() {
        let gpu = memory.gpu_memory.unwrap_or_else(|| {
            fail("--memory auto needs --gpu-memory BYTES: the memory of one GPU, e.g. 139GiB")
        });
        let fitted = planner
            .fitting_memory(gpu, choose_offload)
            .unwrap_or_else(|e| fail(format!("--memory auto: {e}")));
        eprintln!(
            "--memory auto: loss chunks of {} rows, feed-forward chunks of {} rows, offload {:?}, \
             {} layer(s) per checkpoint, {} group(s) of heads",
            fitted.plan.loss_rows,
            fitted.plan.ffn_rows,
            fitted.offload,
            fitted.layers_per_checkpoint,
            fitted.attention_head_groups,
        );
        run.options.loss_chunks = fitted.loss_chunks;
        run.options.ffn_chunks = fitted.ffn_chunks;
        config.offload = fitted.offload;
        config.layers_per_checkpoint = fitted.layers_per_checkpoint;
        config.attention_head_groups = fitted.attention_head_groups;
    }
    if run.args.devices.backend == BackendKind::Cuda {
        // Chunks whose tensors would take pages of CubeCL's top class are refused before the
        // step (with --gpu-memory, which the classes are cut from).
        let planner = memory_planner(run, config);
        if let Err(e) = planner.check_chunks() {
            fail(format!("--loss-chunk / --ffn-chunk: {e}"));
        }
        // Printed for every CUDA run, to stand beside the memory report after the first step.
        match planner.plan() {
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
    run: &Run,
    config: &LlamaConfig,
    model: Llama<B>,
    context: AttentionContext<B>,
) {
    let world = match &context {
        AttentionContext::Local => 1,
        AttentionContext::Sharded { group, .. } => group.world_size(),
    };
    let args = &run.args;
    let (output, out) = (&args.output, args.out_dir());
    let options = run.options.clone().with_zero(zero_stage(args, world));
    check_optimizer_state(&options);
    let pinned_device = pinned_memory_device(&model);
    let mut trainer = Trainer::new(model, context, options);
    let (rank, world) = trainer.rank();
    let leader = rank == 0;
    let checkpoint_dir = out.join("checkpoint");
    if output.resume {
        let placement = args.memory.optimizer_state();
        trainer =
            (trainer.resume_with_state_at(&checkpoint_dir, placement)).unwrap_or_else(|e| fail(e));
        if args.steps_given {
            if run.options.steps < trainer.step {
                fail(format!(
                    "--steps {} is below the checkpoint's step {}: give a total of at least {}",
                    run.options.steps, trainer.step, trainer.step
                ));
            }
            trainer.options.steps = run.options.steps;
        }
        if args.memory.chunks_given() {
            // Memory only: the checkpoint's run continues identically with other chunks.
            trainer.set_chunks(run.options.loss_chunks, run.options.ffn_chunks);
        }
        if let Some(bytes) = args.memory.grad_bucket {
            trainer.set_grad_bucket_bytes(bytes);
        }
    }
    if !output.no_checkpoint {
        // Every rank: the directory is on a filesystem they all write to (Trainer::save).
        disk_space::check_room(&checkpoint_dir, trainer.checkpoint_bytes())
            .unwrap_or_else(|e| fail(e));
    }
    let tokenizer = tokenizer(args);
    let o = trainer.options.clone();
    let corpus = TokenDataset::from_file(&args.data.text_path(), &tokenizer, o.seq_len)
        .unwrap_or_else(|e| fail(e));
    let (data, validation) = corpus
        .split(args.data.val_fraction)
        .unwrap_or_else(|e| fail(format!("--val-fraction: {e}")));
    if output.val_every > 0 && validation.num_windows(o.seq_len) == 0 {
        fail(format!(
            "the held-out slice (--val-fraction {}) has {} tokens, fewer than one sequence of \
             {} + 1; raise --val-fraction or turn validation off with --val-every 0",
            args.data.val_fraction,
            validation.len(),
            o.seq_len
        ));
    }
    let metrics_path = out.join("metrics.jsonl");
    let mut log = leader.then(|| {
        std::fs::create_dir_all(&out).unwrap_or_else(|e| fail(e));
        match output.resume {
            true => MetricsLog::resume(&metrics_path, trainer.step),
            false => MetricsLog::create(&metrics_path),
        }
        .unwrap_or_else(|e| fail(e))
    });
    if leader {
        eprintln!(
            "training {} params ({} layers, d_model {}, {} heads / {} kv) on {world} {} rank(s), \
             {} x {} tokens per step, checkpoint {:?} ({} layer(s) per checkpoint), offload {:?}, \
             ZeRO stage {}, optimizer state on the {}",
            config.num_params(),
            config.n_layers,
            config.d_model,
            config.n_heads,
            config.n_kv_heads,
            backend_name(args.devices.backend),
            o.batch,
            o.seq_len,
            config.checkpoint,
            config.layers_per_checkpoint,
            config.offload,
            trainer.options.zero,
            trainer.options.optimizer_state
        );
        if let Some(packing) = run.packing {
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
        leader.then(|| ProgressBar::new(o.steps, output.log_every).resumed_from(trainer.step));
    let start = Instant::now();
    // The step of this run's last checkpoint (none yet), and its first step.
    let (mut saved_at, first_step) = (None, trainer.step);
    while trainer.step < o.steps {
        let step_start = Instant::now();
        let (x, y) = data
            .batch(trainer.step, o.seed, o.batch, o.seq_len)
            .unwrap_or_else(|e| fail(e));
        let documents = documents(run, &x, o.seq_len).unwrap_or_else(|e| fail(e));
        let stats = (trainer.train_step_packed(&x, &y, documents.as_ref()))
            .unwrap_or_else(|e| fail_step(trainer.step + 1, e));
        if !stats.loss.is_finite() {
            fail_step(
                trainer.step,
                format!(
                    "the loss is {}, not a finite number: the run stops here (the last checkpoint \
                     is unchanged; a lower --lr or a --grad-clip may help)",
                    stats.loss
                ),
            );
        }
        let tokens_per_s = (o.batch * o.seq_len) as f64 / step_start.elapsed().as_secs_f64();
        if let (Some(bar), true) = (bar.as_ref(), trainer.step == first_step + 1) {
            // After the first step, so that the device's count includes the optimizer's state.
            bar.message(&trainer.memory_report().to_string());
            if let Some(host) = distflash_llama::host_usage::host_usage_line() {
                let pinned = pinned_device
                    .as_ref()
                    .map(burn_distflash::offload::pinned_bytes);
                let pinned = pinned.map_or(String::new(), |b| {
                    format!("; {} pinned by the offload pool", format_bytes(b))
                });
                bar.message(&format!("{host}{pinned}"));
            }
        }
        let last = trainer.step == o.steps;
        let validate =
            output.val_every > 0 && (last || trainer.step.is_multiple_of(output.val_every));
        let val_loss = validate.then(|| {
            validation_loss(run, &trainer, &validation)
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
        let due = last || (output.save_every > 0 && trainer.step.is_multiple_of(output.save_every));
        if due && !output.no_checkpoint {
            trainer.save(&checkpoint_dir).unwrap_or_else(|e| fail(e));
            saved_at = Some(trainer.step);
        }
    }
    if let Some(bar) = bar.as_mut() {
        bar.finish();
    }
    if let Some(export) = &output.export_weights {
        if saved_at != Some(trainer.step) && !output.resume {
            trainer.save(&checkpoint_dir).unwrap_or_else(|e| fail(e));
        }
        if leader {
            export_weights(&trainer.model, config, &checkpoint_dir, export)
                .unwrap_or_else(|e| fail(format!("--export-weights: {e}")));
            eprintln!("weights exported to {}", export.display());
        }
    }
    if leader {
        let records = read_metrics(&metrics_path).unwrap_or_else(|e| fail(e));
        let points: Vec<(u64, f64)> = records.iter().map(|m| (m.step, m.loss)).collect();
        let val_points: Vec<(u64, f64)> = records
            .iter()
            .filter_map(|m| Some((m.step, m.val_loss?)))
            .collect();
        let plot = out.join("loss.svg");
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
        let checkpoint = match output.no_checkpoint {
            true => "no checkpoint (--no-checkpoint)".to_string(),
            false => checkpoint_dir.display().to_string(),
        };
        eprintln!(
            "done: {} steps, final loss {:.3}{validation}; {}, {}, {checkpoint}",
            trainer.step,
            points.last().map_or(f64::NAN, |p| p.1),
            metrics_path.display(),
            plot.display(),
        );
        print_sample(args, &trainer, &tokenizer);
    }
}

/// Mean loss over the same [`VALIDATION_BATCHES`] batches of the held-out slice (every rank of a
/// group takes part).
fn validation_loss<B: TrainBackend>(
    run: &Run,
    trainer: &Trainer<B>,
    validation: &TokenDataset,
) -> Result<f64, Error> {
    let o = &trainer.options;
    let mut total = 0.0;
    for i in 0..VALIDATION_BATCHES {
        let (x, y) = validation.batch(i, o.seed ^ VALIDATION_SEED, o.batch, o.seq_len)?;
        let documents = documents(run, &x, o.seq_len)?;
        total += trainer.evaluate_packed(&x, &y, documents.as_ref())?;
    }
    Ok(total / VALIDATION_BATCHES as f64)
}

/// Prints a text sampled from the trained model after `--prompt`.
fn print_sample<B: TrainBackend>(args: &TrainArgs, trainer: &Trainer<B>, tokenizer: &Tokenizer) {
    let output = &args.output;
    if output.sample_tokens == 0 {
        return;
    }
    let prompt = tokenizer
        .encode(&output.prompt)
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
        output.sample_tokens,
        context,
        sampling,
    )
    .unwrap_or_else(|e| fail(e));
    let text = tokenizer.decode(&tokens).unwrap_or_else(|e| fail(e));
    eprintln!(
        "sample ({} tokens after the prompt, top-{SAMPLE_TOP_K} at temperature \
         {SAMPLE_TEMPERATURE}):",
        output.sample_tokens
    );
    println!("{text}");
}

fn tokenizer(args: &TrainArgs) -> Tokenizer {
    match &args.data.tokenizer {
        Some(path) => Tokenizer::from_file(path).unwrap_or_else(|e| fail(e)),
        None => Tokenizer::bytes(),
    }
}

type CudaInner<F> = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, F, i32, u8>;
type Cuda<F> = burn_autodiff::Autodiff<CudaInner<F>>;

/// Runs one rank per GPU of `devices` in this process (threads), or this process's rank.
fn train_cuda<F: burn_cubecl::FloatElement>(run: &Run, config: &LlamaConfig, weights: Option<&[u8]>)
where
    Cuda<F>: TrainBackend<Device = cubecl::cuda::CudaDevice>
        + burn::tensor::backend::AutodiffBackend<InnerBackend = CudaInner<F>>,
    CudaInner<F>: burn::tensor::backend::Backend<Device = cubecl::cuda::CudaDevice>,
{
    let context = |group: DeviceGroup<CudaInner<F>>| {
        AttentionContext::sharded(group).with_schedule(run.args.devices.schedule.into())
    };
    if run.args.devices.env {
        // One process per GPU: every process loads the same initial weights.
        let env = run.args.devices.processes.group();
        let env = env.unwrap_or_else(|e| fail(format!("--env: {e}")));
        let group = DeviceGroup::<CudaInner<F>>::nccl_with_rendezvous(
            env.rank,
            env.world_size,
            cubecl::cuda::CudaDevice::new(env.local_rank),
            env.master.as_deref().unwrap_or(""),
            run.args.devices.group_timeout(),
        )
        .unwrap_or_else(|e| fail(e));
        let model = load_model::<Cuda<F>>(run, config, weights, group.device());
        return train_rank(run, config, model, context(group));
    }
    let devices: Vec<_> = (0..run.args.devices.gpus)
        .map(cubecl::cuda::CudaDevice::new)
        .collect();
    if devices.len() == 1 {
        let model = load_model::<Cuda<F>>(run, config, weights, &devices[0]);
        return train_rank(run, config, model, AttentionContext::Local);
    }
    let groups =
        DeviceGroup::<CudaInner<F>>::nccl_with_timeout(&devices, run.args.devices.group_timeout())
            .unwrap_or_else(|e| fail(e));
    // Each rank makes its copy of the model on its own thread. CubeCL's CUDA memory pools belong
    // to a stream, and each thread has a stream of its own: weights made on this thread would
    // keep pages in pools that no rank allocates from again (LLaMA-7B over two H200s: the
    // device held 32-44 GiB beyond the rank's pools; made here, 2.2 GiB).
    // The backend's generator is shared by the process, so the ranks draw one at a time, each
    // from the seed: every rank gets the same weights.
    let one_at_a_time = Mutex::new(());
    on_each_rank(groups, |_, group| {
        let model = {
            let _drawing = one_at_a_time.lock().unwrap_or_else(PoisonError::into_inner);
            load_model::<Cuda<F>>(run, config, weights, group.device())
        };
        train_rank(run, config, model, context(group))
    });
}

/// The backend's name as `--backend` spells it.
fn backend_name(backend: BackendKind) -> &'static str {
    match backend {
        BackendKind::Ndarray => "ndarray",
        BackendKind::Wgpu => "wgpu",
        BackendKind::Cuda => "cuda",
    }
}

/// How long a step that met a failed device thread has to end by itself (with its error)
/// before the process ends: a read of a buffer the failure left missing may wait forever.
const DEVICE_FAULT_GRACE: Duration = Duration::from_secs(30);

/// Ends the process (exit code 1) once a device thread has failed and [`DEVICE_FAULT_GRACE`]
/// has passed without the step ending on its own error.
fn end_runs_stuck_on_device_faults() {
    device_faults::watch_device_faults();
    std::thread::spawn(|| loop {
        std::thread::sleep(Duration::from_secs(1));
        if let Some(fault) = device_faults::device_fault() {
            std::thread::sleep(DEVICE_FAULT_GRACE);
            eprintln!(
                "llama_train: {fault} (the step did not end within {} s of it)",
                DEVICE_FAULT_GRACE.as_secs()
            );
            exit_now(1);
        }
    });
}

fn main() {
    end_runs_stuck_on_device_faults();
    let mut run = parse();
    let tokenizer = tokenizer(&run.args);
    let mut config = model_config(&run.args, &tokenizer);
    plan_memory(&mut run, &mut config);
    run.packing = packing(&run.args, &tokenizer, &config);
    let checkpoint = run.args.out_dir().join("checkpoint");
    if run.args.output.resume && !checkpoint.join("trainer.json").exists() {
        fail(format!(
            "--resume: no checkpoint in {}",
            checkpoint.display()
        ));
    }
    let text = run.args.data.text_path();
    if !text.exists() {
        fail(format!(
            "the training text {} does not exist (--data)",
            text.display()
        ));
    }
    let weights = initial_weights(&run);
    let weights = weights.as_deref();
    let devices = &run.args.devices;
    match (devices.backend, devices.dtype) {
        (BackendKind::Ndarray, _) => {
            type Cpu = burn_autodiff::Autodiff<burn::backend::NdArray<f32>>;
            let model = load_model::<Cpu>(&run, &config, weights, &Default::default());
            train_rank(&run, &config, model, AttentionContext::Local)
        }
        (BackendKind::Wgpu, _) => {
            type Wgpu = burn_autodiff::Autodiff<
                burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>,
            >;
            let model = load_model::<Wgpu>(&run, &config, weights, &Default::default());
            train_rank(&run, &config, model, AttentionContext::Local)
        }
        (BackendKind::Cuda, Dtype::Bf16) => train_cuda::<half::bf16>(&run, &config, weights),
        (BackendKind::Cuda, Dtype::F32) => train_cuda::<f32>(&run, &config, weights),
    }
}
