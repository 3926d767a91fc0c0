//! [`Trainer`]: one rank's training loop state (model, AdamW, step) and one training step:
//! forward and loss on this rank's shard of every sequence, backward, gradients summed over the
//! group (every rank holds the whole model), clipped by their global norm, AdamW with the
//! learning-rate schedule. The optimizer is replicated ([`ZeroStage::Replicated`]) or sharded
//! over the group with f32 master weights ([`ShardedAdamW`], ZeRO stages 1 and 2, chosen by
//! [`TrainOptions::zero`]). Checkpoints ([`Trainer::save`], [`Trainer::resume`], in
//! `checkpoint`) save and restore everything a step depends on, the sharded optimizer's f32
//! state as one file per rank, read back at any world size; [`export_weights`] writes a
//! checkpoint's weights as a Hugging Face model; [`Trainer::memory_report`] counts what a rank
//! holds.

mod backward_guard;
mod checkpoint;
mod device_guard;
mod export;
mod memory;
mod options_check;
mod options_defaults;

pub use crate::device_memory::DeviceMemory;
pub use checkpoint::TrainerState;
pub use export::export_weights;
pub use memory::MemoryReport;

use std::collections::HashMap;
use std::time::Instant;

use burn::config::Config;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData, TensorPrimitive};

use self::backward_guard::gradients_of;
use self::device_guard::{device_healthy, unless_device_failed};
use super::loss::CrossEntropyBackend;
use super::lr_schedule::learning_rate;
use super::model::{Llama, LlamaInput};
use super::optimizer::{AdamWSettings, FusedAdamW, ShardedAdamW, StatePlacement, ZeroStage};
use super::TrainingKernels;
use crate::Error;
use burn_distflash::layers::{RowChunks, TransformerBlockConfig};
use burn_distflash::offload::HostOffload;
use burn_distflash::sequence_parallel::shard_sequence;
use burn_distflash::{AttentionContext, Documents, Error as PluginError, FlashAttentionBackend};

/// Optimisation settings (saved with every checkpoint).
#[derive(Config, Debug)]
pub struct TrainOptions {
    /// Number of optimizer steps.
    pub steps: u64,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence (the whole sequence; each rank of a group holds `seq_len / P`).
    pub seq_len: usize,
    /// Peak learning rate.
    #[config(default = 3e-4)]
    pub lr: f64,
    /// Final learning rate as a fraction of the peak.
    #[config(default = 0.1)]
    pub min_lr_ratio: f64,
    /// Linear warm-up steps.
    #[config(default = 10)]
    pub warmup: u64,
    /// AdamW decoupled weight decay.
    #[config(default = 0.1)]
    pub weight_decay: f64,
    /// AdamW beta 1.
    #[config(default = 0.9)]
    pub beta_1: f64,
    /// AdamW beta 2.
    #[config(default = 0.95)]
    pub beta_2: f64,
    /// Gradients are scaled down when their global L2 norm exceeds this (0 disables).
    #[config(default = 1.0)]
    pub grad_clip: f64,
    /// Seed of the data order.
    #[config(default = 0)]
    pub seed: u64,
    /// How the optimizer is split over the group: 0 replicated (AdamW state in the weights'
    /// type on every rank), 1 or 2 sharded with f32 master weights and moments
    /// ([`ZeroStage`]). Checkpoints written before this option existed mean stage 0.
    #[config(default = "ZeroStage::Replicated")]
    pub zero: ZeroStage,
    /// How many rows (tokens of this rank's `batch * seq_len / P`) the output projection and
    /// loss take at a time ([`Llama::loss_chunks`]): a row count, or a memory budget for one
    /// chunk's logits ([`crate::loss::loss_bytes_per_row`]). Memory only: the loss and
    /// gradients do not depend on it.
    #[config(default = "crate::loss::DEFAULT_LOSS_CHUNKS")]
    pub loss_chunks: RowChunks,
    /// How many rows every block's feed-forward half takes at a time
    /// ([`TransformerBlock::ffn_chunks`](burn_distflash::layers::TransformerBlock::ffn_chunks)),
    /// a row count or a memory budget ([`burn_distflash::layers::feed_forward_bytes_per_row`]).
    /// Memory only.
    #[config(default = "TransformerBlockConfig::DEFAULT_FFN_CHUNKS")]
    pub ffn_chunks: RowChunks,
    /// Where a sharded optimizer (stages 1 and 2) keeps its f32 master weights and moments: on
    /// the device, or in host memory streamed through the device in chunks of
    /// [`state_chunk_bytes`](Self::state_chunk_bytes) ([`StatePlacement`]). Memory and speed
    /// only: the steps give bitwise the same results. Checkpoints written before this option
    /// existed mean the device.
    #[config(default = "StatePlacement::Gpu")]
    pub optimizer_state: StatePlacement,
    /// Bytes of state (12 per element) one chunk of a sharded optimizer's state holds: the
    /// unit it updates, and a host-resident state brings to the device at a time (each vector's
    /// chunk at most [`MAX_STEP_BUFFER_BYTES`](crate::optimizer::MAX_STEP_BUFFER_BYTES)).
    #[config(default = "crate::optimizer::DEFAULT_STATE_CHUNK_BYTES")]
    pub state_chunk_bytes: u64,
    /// Bytes of f32 one bucket of a sharded optimizer's gradient sum gathers (every rank's range
    /// of it together: one collective's input; [`ShardedAdamW::with_grad_bucket_bytes`]).
    /// Memory only: the steps give the same results. Checkpoints written before this option
    /// existed mean the default.
    #[config(default = "crate::optimizer::DEFAULT_GRAD_BUCKET_BYTES")]
    pub grad_bucket_bytes: u64,
}

/// What one step measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Mean next-token loss over the whole batch (all ranks).
    pub loss: f64,
    /// Global L2 norm of the summed gradients, before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
}

/// Wall time of a step's phases in seconds ([`Trainer::train_step_timed`]), each phase ended by
/// a device synchronisation so that its GPU work is counted in it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseTimes {
    /// Forward pass and loss.
    pub forward: f64,
    /// Backward pass (checkpoint recomputation included).
    pub backward: f64,
    /// Loss and gradient sums over the group, the gradients' global norm (the loss only, under
    /// a sharded optimizer).
    pub gradients: f64,
    /// Scaling the gradients down to the clipping norm (zero when they are not clipped, and
    /// under a sharded optimizer).
    pub clip: f64,
    /// The AdamW update of every parameter (under a sharded optimizer, the whole optimizer
    /// step: gradient sums, norm, clipping, update and the weights' all-gather).
    pub optimizer: f64,
}

/// Times the phases of one step on one device.
struct PhaseClock<B: Backend> {
    device: B::Device,
    last: Instant,
    times: PhaseTimes,
}

impl<B: Backend> PhaseClock<B> {
    fn start(device: B::Device) -> Self {
        Self::sync(&device);
        Self {
            device,
            last: Instant::now(),
            times: PhaseTimes::default(),
        }
    }

    /// Ends a phase: waits for the device, adds the time since the last lap to `phase`.
    fn lap(&mut self, phase: fn(&mut PhaseTimes) -> &mut f64) {
        Self::sync(&self.device);
        let now = Instant::now();
        *phase(&mut self.times) += (now - self.last).as_secs_f64();
        self.last = now;
    }

    fn sync(device: &B::Device) {
        // A failed synchronisation leaves the timing off, never the step: the step's own reads
        // report device errors.
        let _ = B::sync(device);
    }
}

/// The backends a [`Trainer`] runs on: autodiff over a backend that computes and communicates
/// itself, runs the optimizer's passes and the loss (CUDA and wgpu `CubeBackend`, ndarray).
pub trait TrainBackend:
    AutodiffBackend<InnerBackend: TrainingKernels + HostOffload>
    + FlashAttentionBackend<Inner = <Self as AutodiffBackend>::InnerBackend>
    + CrossEntropyBackend
{
}

impl<B> TrainBackend for B where
    B: AutodiffBackend<InnerBackend: TrainingKernels + HostOffload>
        + FlashAttentionBackend<Inner = <B as AutodiffBackend>::InnerBackend>
        + CrossEntropyBackend
{
}

/// The optimizer a [`Trainer`] steps with.
enum StepOptimizer<B: TrainBackend> {
    /// Stage 0: every rank holds the whole state and applies the whole update.
    Replicated(OptimizerAdaptor<FusedAdamW, Llama<B>, B>),
    /// Stages 1 and 2: f32 master weights and moments split over the group.
    Sharded(ShardedAdamW<B>),
}

impl<B: TrainBackend> StepOptimizer<B> {
    /// The optimizer `options` ask for, over `context`'s group, without state.
    fn new(options: &TrainOptions, context: &AttentionContext<B>) -> Self {
        match options.zero.is_sharded() {
            true => Self::Sharded(sharded_adamw(options, context)),
            false => Self::Replicated(replicated_adamw(options)),
        }
    }
}

/// The sharded AdamW of `options` (stage 1 or 2) over `context`'s group, without state.
fn sharded_adamw<B: TrainBackend>(
    options: &TrainOptions,
    context: &AttentionContext<B>,
) -> ShardedAdamW<B> {
    let sharded = ShardedAdamW::new(options.zero, adamw_settings(options), group_of(context));
    let sharded = sharded.expect("a sharded ZeRO stage");
    (sharded.with_state_placement(options.optimizer_state, options.state_chunk_bytes))
        .with_grad_bucket_bytes(options.grad_bucket_bytes)
}

/// `context`'s group, `None` on one device.
fn group_of<B: TrainBackend>(
    context: &AttentionContext<B>,
) -> Option<burn_distflash::DeviceGroup<B::InnerBackend>> {
    match context {
        AttentionContext::Local => None,
        AttentionContext::Sharded { group, .. } => Some(group.clone()),
    }
}

/// The AdamW settings of `options`.
fn adamw_settings(options: &TrainOptions) -> AdamWSettings {
    AdamWSettings {
        beta_1: options.beta_1 as f32,
        beta_2: options.beta_2 as f32,
        epsilon: 1e-8,
        weight_decay: options.weight_decay as f32,
    }
}

/// The replicated AdamW of `options` (stage 0), without state.
fn replicated_adamw<B: TrainBackend>(
    options: &TrainOptions,
) -> OptimizerAdaptor<FusedAdamW, Llama<B>, B> {
    let s = adamw_settings(options);
    FusedAdamW::new(s.beta_1, s.beta_2, s.epsilon, s.weight_decay).into_optimizer()
}

/// One rank's training state.
pub struct Trainer<B: TrainBackend> {
    /// The model (identical on every rank after every step).
    pub model: Llama<B>,
    optim: StepOptimizer<B>,
    /// Steps done.
    pub step: u64,
    /// Where attention runs (a sharded context for a group).
    pub context: AttentionContext<B>,
    /// Optimisation settings.
    pub options: TrainOptions,
}

impl<B: TrainBackend> Trainer<B> {
    /// A trainer at step 0, with the optimizer of `options.zero` (a sharded one creates its
    /// state at the first step, from the weights then), and the model's loss and feed-forward
    /// chunks set to `options`'.
    pub fn new(model: Llama<B>, context: AttentionContext<B>, options: TrainOptions) -> Self {
        let optim = StepOptimizer::new(&options, &context);
        Self {
            model: model.with_chunks(options.loss_chunks, options.ffn_chunks),
            optim,
            step: 0,
            context,
            options,
        }
    }

    /// Sets how many rows the loss and the feed-forward blocks take at a time, in the options
    /// (saved with the next checkpoint) and in the model. Memory only: steps give the same
    /// results.
    pub fn set_chunks(&mut self, loss: RowChunks, ffn: RowChunks) {
        self.options.loss_chunks = loss;
        self.options.ffn_chunks = ffn;
        self.model = self.model.clone().with_chunks(loss, ffn);
    }

    /// Sets the bytes of one bucket of a sharded optimizer's gradient sum, in the options (saved
    /// with the next checkpoint) and in the optimizer. Memory only: steps give the same results.
    pub fn set_grad_bucket_bytes(&mut self, bytes: u64) {
        self.options.grad_bucket_bytes = bytes;
        if let StepOptimizer::Sharded(sharded) = &mut self.optim {
            sharded.set_grad_bucket_bytes(bytes);
        }
    }

    /// `(rank, world size)` of this trainer's group.
    pub fn rank(&self) -> (usize, usize) {
        match &self.context {
            AttentionContext::Local => (0, 1),
            AttentionContext::Sharded { group, .. } => (group.rank(), group.world_size()),
        }
    }

    /// This rank's columns of a row-major `[batch, seq_len]` token batch, as a tensor: the
    /// positions the attention's layout gives the rank (contiguous or zigzag).
    fn shard(&self, tokens: &[u32]) -> Result<Tensor<B, 2, Int>, Error> {
        let (batch, seq) = (self.options.batch, self.options.seq_len);
        let (rank, world) = self.rank();
        if tokens.len() != batch * seq {
            return Err(Error::invalid(
                "the number of tokens in a batch",
                format!("batch x seq_len = {batch} x {seq} = {}", batch * seq),
                tokens.len(),
            ));
        }
        let vocab = self.model.embedding.weight.dims()[0];
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::invalid(
                "a token id",
                format!("an id of the model's vocabulary of {vocab} tokens (ids 0..{vocab})"),
                token,
            ));
        }
        let values: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
        let device = self.device();
        let whole = Tensor::<B, 2, Int>::from_data(TensorData::new(values, [batch, seq]), &device);
        // The attention's layout decides which positions this rank holds (contiguous, zigzag);
        // under `Auto` it depends on the model's window and the shard's length.
        let layout = (self.context).layout(self.model.attention_options(), seq / world);
        shard_sequence(whole, 1, layout, world, rank).map_err(|e| {
            Error::invalid(
                "seq_len",
                format!("a length that can be split over the group of {world}: {e}"),
                seq,
            )
        })
    }

    fn device(&self) -> B::Device {
        self.model.embedding.weight.val().device()
    }

    /// One optimizer step on `inputs` and next-token `targets` (row-major `[batch, seq_len]`,
    /// the same whole batch on every rank).
    pub fn train_step(&mut self, inputs: &[u32], targets: &[u32]) -> Result<StepStats, Error> {
        self.step_with(inputs, targets, None, None)
    }

    /// [`train_step`](Self::train_step) on packed rows when `documents` is given: each token
    /// attends only within its document ([`Llama::loss`] with a [`LlamaInput`]'s documents, which says why every
    /// target still counts). `documents` are those of the whole batch
    /// ([`Packing::documents`](crate::data::Packing::documents) of `inputs`), the same on
    /// every rank: each rank's attention takes its part. `None` is
    /// [`train_step`](Self::train_step).
    ///
    /// # Errors
    ///
    /// Those of [`train_step`](Self::train_step), and [`Error::Attention`] when the documents
    /// do not cover `seq_len` positions in one list or one per batch row.
    pub fn train_step_packed(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        documents: Option<&Documents>,
    ) -> Result<StepStats, Error> {
        self.step_with(inputs, targets, documents, None)
    }

    /// [`train_step`](Self::train_step) with the device synchronised after each phase, and the
    /// wall time of each phase. The synchronisations cost some speed: for profiling only.
    pub fn train_step_timed(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
    ) -> Result<(StepStats, PhaseTimes), Error> {
        let mut clock = PhaseClock::start(self.device());
        let stats = self.step_with(inputs, targets, None, Some(&mut clock))?;
        Ok((stats, clock.times))
    }

    fn step_with(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        documents: Option<&Documents>,
        clock: Option<&mut PhaseClock<B>>,
    ) -> Result<StepStats, Error> {
        unless_device_failed("the training step", || {
            self.unguarded_step(inputs, targets, documents, clock)
        })
    }

    fn unguarded_step(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        documents: Option<&Documents>,
        mut clock: Option<&mut PhaseClock<B>>,
    ) -> Result<StepStats, Error> {
        let mut lap = |phase: fn(&mut PhaseTimes) -> &mut f64| {
            if let Some(clock) = clock.as_mut() {
                clock.lap(phase);
            }
        };
        self.prepare_offload()?;
        if let StepOptimizer::Sharded(optim) = &mut self.optim {
            // A host-resident state is made (and its host memory had) before any work.
            optim.prepare(&self.model)?;
        }
        let loss = self.loss(inputs, targets, documents, "training step")?;
        lap(|t| &mut t.forward);
        let grads = GradientsParams::from_grads(gradients_of(&loss)?, &self.model);
        lap(|t| &mut t.backward);
        let loss = self.group_loss(loss)?;
        device_healthy("the forward and backward passes")?;
        let o = &self.options;
        let lr = learning_rate(self.step, o.steps, o.warmup, o.lr, o.min_lr_ratio);
        let clip = o.grad_clip;
        let grad_norm = match &mut self.optim {
            StepOptimizer::Sharded(optim) => {
                lap(|t| &mut t.gradients);
                let (model, grad_norm) = optim.step(lr, clip, self.model.clone(), grads)?;
                self.model = model;
                grad_norm
            }
            StepOptimizer::Replicated(_) => {
                let (mut grads, squared) = self.sum_gradients(grads)?;
                let grad_norm = squared.sqrt();
                lap(|t| &mut t.gradients);
                if clip > 0.0 && grad_norm > clip {
                    let mut scale = ScaleGrads {
                        grads,
                        factor: clip / grad_norm,
                    };
                    self.model.visit(&mut scale);
                    grads = scale.grads;
                }
                lap(|t| &mut t.clip);
                if let StepOptimizer::Replicated(optim) = &mut self.optim {
                    self.model = optim.step(lr, self.model.clone(), grads);
                }
                grad_norm
            }
        };
        lap(|t| &mut t.optimizer);
        device_healthy("the optimizer step")?;
        self.step += 1;
        Ok(StepStats {
            loss,
            grad_norm,
            lr,
        })
    }

    /// Gets the host memory ready for the checkpoints this step offloads
    /// ([`LlamaConfig::offload`](crate::LlamaConfig::offload)): checked against what the host
    /// has, and on CUDA pinned once (the first step's buffers serve every later step), so that a
    /// host without enough memory fails here, before the step's work.
    fn prepare_offload(&self) -> Result<(), Error> {
        let (_, world) = self.rank();
        let seq = self.options.seq_len / world;
        let sizes = self.model.offloaded_bytes(self.options.batch, seq);
        if sizes.is_empty() {
            return Ok(());
        }
        B::prepare_host_offload(&self.device(), &sizes).map_err(|source| Error::Attention {
            during: "preparing host memory for the offloaded checkpoints",
            source,
        })
    }

    /// Mean next-token loss of `inputs` and `targets` (row-major `[batch, seq_len]`, the same
    /// whole batch on every rank) under the current weights, changing nothing: no gradient, no
    /// step. Every rank of a group must call it, like [`train_step`](Self::train_step).
    pub fn evaluate(&self, inputs: &[u32], targets: &[u32]) -> Result<f64, Error> {
        self.evaluate_packed(inputs, targets, None)
    }

    /// [`evaluate`](Self::evaluate) on packed rows when `documents` is given (as in
    /// [`train_step_packed`](Self::train_step_packed)); `None` is
    /// [`evaluate`](Self::evaluate).
    pub fn evaluate_packed(
        &self,
        inputs: &[u32],
        targets: &[u32],
        documents: Option<&Documents>,
    ) -> Result<f64, Error> {
        // Weights that need no gradient build no graph: nothing is kept for a backward that
        // never comes (Burn frees a dropped graph only at the next backward), neither on the
        // device nor, for offloading layers, in host memory.
        let model = self.model.clone().no_grad();
        let loss = self.loss_of(&model, inputs, targets, documents, "evaluation")?;
        self.group_loss(loss)
    }

    /// This rank's share of the batch's mean loss, within `documents` when given.
    fn loss(
        &self,
        inputs: &[u32],
        targets: &[u32],
        documents: Option<&Documents>,
        during: &'static str,
    ) -> Result<Tensor<B, 1>, Error> {
        self.loss_of(&self.model, inputs, targets, documents, during)
    }

    /// [`loss`](Self::loss) under `model`'s weights.
    fn loss_of(
        &self,
        model: &Llama<B>,
        inputs: &[u32],
        targets: &[u32],
        documents: Option<&Documents>,
        during: &'static str,
    ) -> Result<Tensor<B, 1>, Error> {
        self.options.check()?;
        let (tokens, targets) = (self.shard(inputs)?, self.shard(targets)?);
        let normalizer = self.options.batch * self.options.seq_len;
        let input = LlamaInput {
            tokens,
            documents: documents.cloned(),
        };
        model
            .loss(input, targets, &self.context, normalizer)
            .map_err(|source| Error::Attention { during, source })
    }

    /// This rank's share of a loss, summed over the group, as a number.
    fn group_loss(&self, loss: Tensor<B, 1>) -> Result<f64, Error> {
        let loss = self
            .sum_over_group(vec![loss.inner().into_primitive().tensor()])
            .map_err(|source| Error::Comm {
                what: "the loss",
                source,
            })?;
        let loss = loss.into_iter().next().expect("one sum per tensor");
        Ok(
            Tensor::<B::InnerBackend, 1>::from_primitive(TensorPrimitive::Float(loss))
                .into_scalar()
                .elem::<f64>(),
        )
    }

    /// Every parameter's gradient summed over the group, and the squared global L2 norm of the
    /// sums. The gradients travel in flat buckets ([`DeviceGroup::all_reduce_sum`]): a few
    /// all-reduces per step, not one per parameter.
    ///
    /// [`DeviceGroup::all_reduce_sum`]: burn_distflash::DeviceGroup::all_reduce_sum
    fn sum_gradients(&self, mut grads: GradientsParams) -> Result<(GradientsParams, f64), Error> {
        let mut take = TakeGrads::<B::InnerBackend> {
            grads: &mut grads,
            taken: Vec::new(),
        };
        self.model.visit(&mut take);
        let (ids, tensors): (Vec<ParamId>, Vec<_>) = take.taken.into_iter().unzip();
        let sums = self.sum_over_group(tensors).map_err(|source| Error::Comm {
            what: "the gradients",
            source,
        })?;
        let mut put = PutGrads::<B::InnerBackend> {
            grads,
            sums: ids.into_iter().zip(sums).collect(),
            squared_norm: Vec::new(),
        };
        self.model.visit(&mut put);
        let squared = (put.squared_norm.into_iter())
            .reduce(|a, b| a + b)
            .map_or(0.0, |t| t.into_scalar().elem::<f64>());
        Ok((put.grads, squared))
    }

    /// `tensors` summed over the group (as they are on one device).
    fn sum_over_group(
        &self,
        tensors: Vec<FloatTensor<B::InnerBackend>>,
    ) -> Result<Vec<FloatTensor<B::InnerBackend>>, PluginError> {
        match &self.context {
            AttentionContext::Local => Ok(tensors),
            AttentionContext::Sharded { group, .. } => group.all_reduce_sum(tensors),
        }
    }
}

/// Takes every parameter's gradient out of `grads`, in the model's visiting order (the same on
/// every rank).
struct TakeGrads<'a, I: Backend> {
    grads: &'a mut GradientsParams,
    taken: Vec<(ParamId, FloatTensor<I>)>,
}

impl<B: TrainBackend> ModuleVisitor<B> for TakeGrads<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            self.taken.push((param.id, grad.into_primitive().tensor()));
        }
    }
}

/// Puts the summed gradients back and accumulates their squared norms.
struct PutGrads<I: Backend> {
    grads: GradientsParams,
    sums: HashMap<ParamId, FloatTensor<I>>,
    squared_norm: Vec<Tensor<I, 1>>,
}

impl<B: TrainBackend> ModuleVisitor<B> for PutGrads<B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(sum) = self.sums.remove(&param.id) {
            let grad = Tensor::<B::InnerBackend, D>::from_primitive(TensorPrimitive::Float(sum));
            self.squared_norm
                .push(B::InnerBackend::squared_norm(grad.clone()));
            self.grads.register(param.id, grad);
        }
    }
}

/// Multiplies every gradient by `factor`.
struct ScaleGrads {
    grads: GradientsParams,
    factor: f64,
}

impl<B: TrainBackend> ModuleVisitor<B> for ScaleGrads {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            self.grads.register(param.id, grad.mul_scalar(self.factor));
        }
    }
}
