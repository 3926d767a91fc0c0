//! [`ShardedAdamW`]: mixed-precision AdamW sharded over a device group (ZeRO stages 1 and 2),
//! for any Burn module trained on a [`DeviceGroup`].
//!
//! The working weights stay in their own float type (bf16 on the GPU) on every rank. The
//! model's float parameters are laid end to end in a [`FlatLayout`]; rank `r` of `P` owns
//! elements `r * n .. (r + 1) * n` of it as f32 master weights and f32 moments. One step:
//!
//! 1. on a group, this rank's share of the gradients' sum is made bucket by bucket
//!    ([`summed_share`]): each bucket gathers the same range of every rank's share in f32 from
//!    the parameters' gradients, stage 2 reduce-scatters it (each rank receives only its range of
//!    the sum), stage 1 all-reduces it and keeps its range; each bucket's sum stays a tensor of
//!    its own. On one device the gradients are read in ranges straight from the parameters'
//!    gradients ([`FlatPieces`]);
//! 2. the global gradient norm comes from the shares' squares (summed in fixed blocks, each one
//!    pass of [`TrainingKernels::squared_norm`], then the blocks' sums) with one all-reduce of a
//!    scalar, and the gradient is scaled down when the norm exceeds the clipping norm;
//! 3. the state, in chunks of the same byte budget wherever it lives, is updated chunk by chunk
//!    in f32 (Burn's `AdamW` formulas, [`AdamWSettings::update_vectors`]): on the CubeCL backends
//!    one kernel pass that writes the chunk's master weights and moments over themselves,
//!    elsewhere (and under `DISTFLASH_UNFUSED_OPTIMIZER=1`) Burn tensor operations;
//! 4. each chunk's updated master weights, cast to the weights' type, are all-gathered (in
//!    pieces of at most [`MAX_STEP_BUFFER_BYTES`](super::MAX_STEP_BUFFER_BYTES)) and written
//!    into the parameters as they complete ([`WeightWriter`]).
//!
//! No buffer of the step is larger than
//! [`MAX_STEP_BUFFER_BYTES`](super::MAX_STEP_BUFFER_BYTES) but the model's own tensors (a
//! parameter, its gradient, its updated value): no f32 vector of the whole share, no vector of
//! the whole model. Every step runs on the device; only the norm comes to the host. The state
//! lives on the device ([`DeviceShard`]) or, with [`StatePlacement::Host`], in host memory
//! ([`HostShard`]), each chunk streamed through the device for its update: element-wise the same
//! operations, so bitwise the same results. The bucket size changes no number on in-process
//! groups, on one device and over NCCL at two ranks (see [`summed_share`]).

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor};
use burn_distflash::{DeviceGroup, Error as PluginError};

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Device, TensorData};
use burn_distflash::offload::HostOffload;

use super::adamw_settings::AdamWSettings;
use super::device_shard::{owned_f32, DeviceShard};
use super::flat::FlatLayout;
use super::flat_pieces::FlatPieces;
use super::host_shard::{HostShard, StateVectors};
use super::optimizer_shard::OptimizerShard;
use super::shard_file::{ShardData, ShardTensor};
use super::shard_set::ShardSet;
use super::state_chunks::{
    bucket_elements, chunk_elements, gather_elements, norm_blocks, ranges,
    DEFAULT_GRAD_BUCKET_BYTES, MAX_STEP_BUFFER_BYTES,
};
use super::state_placement::{StatePlacement, DEFAULT_STATE_CHUNK_BYTES};
use super::summed_share::{collective, primitive, summed_share, SummedShare};
use super::weight_writer::WeightWriter;
use super::zero_stage::ZeroStage;
use crate::{Error, TrainingKernels};

/// Where a [`ShardedAdamW`]'s state is, once made.
enum State<B: AutodiffBackend>
where
    B::InnerBackend: HostOffload + TrainingKernels,
{
    /// On the device.
    Device(DeviceShard<B::InnerBackend>),
    /// In host memory, streamed through the device.
    Host(HostShard<B::InnerBackend>),
}

/// Mixed-precision AdamW whose f32 master weights and moments are split over a group (see the
/// module's documentation). Every rank of the group must step with the same model structure;
/// the first step checks that they do.
pub struct ShardedAdamW<B: AutodiffBackend>
where
    B::InnerBackend: HostOffload + TrainingKernels,
{
    stage: ZeroStage,
    settings: AdamWSettings,
    group: Option<DeviceGroup<B::InnerBackend>>,
    placement: StatePlacement,
    chunk_bytes: u64,
    bucket_bytes: u64,
    gather_bytes: u64,
    state: Option<State<B>>,
}

impl<B: AutodiffBackend> ShardedAdamW<B>
where
    B::InnerBackend: HostOffload + TrainingKernels,
{
    /// A sharded AdamW at `stage` over `group` (`None`: one device, which owns everything), its
    /// state on the device. The state is created at the first [`step`](Self::step) (or
    /// [`prepare`](Self::prepare)), from the model's weights then.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for [`ZeroStage::Replicated`], which is not sharded (use
    /// [`FusedAdamW`](super::FusedAdamW)).
    pub fn new(
        stage: ZeroStage,
        settings: AdamWSettings,
        group: Option<DeviceGroup<B::InnerBackend>>,
    ) -> Result<Self, Error> {
        if !stage.is_sharded() {
            return Err(Error::invalid(
                "the ZeRO stage of a sharded optimizer",
                "1 or 2",
                stage,
            ));
        }
        Ok(Self {
            stage,
            settings,
            group,
            placement: StatePlacement::Gpu,
            chunk_bytes: DEFAULT_STATE_CHUNK_BYTES,
            bucket_bytes: DEFAULT_GRAD_BUCKET_BYTES,
            gather_bytes: MAX_STEP_BUFFER_BYTES,
            state: None,
        })
    }

    /// This optimizer with its state kept at `placement`, in chunks of `chunk_bytes` of state
    /// (12 bytes an element, rounded down to a multiple of 1024 elements, at least 1024, each
    /// vector's chunk at most [`MAX_STEP_BUFFER_BYTES`](super::MAX_STEP_BUFFER_BYTES)), updated
    /// chunk by chunk; under [`StatePlacement::Host`] streamed through the device chunk by
    /// chunk. Set before the state exists
    /// (the first step, [`prepare`](Self::prepare) or [`load`](Self::load)).
    pub fn with_state_placement(mut self, placement: StatePlacement, chunk_bytes: u64) -> Self {
        self.placement = placement;
        self.chunk_bytes = chunk_bytes;
        self
    }

    /// This optimizer summing the gradients over the group in buckets of `bytes` of f32 (every
    /// rank's range of a bucket together, the input of one collective: `bytes / (4 P)` elements
    /// of each share, rounded down to a multiple of 1024, at least 1024, the budget at most
    /// [`MAX_STEP_BUFFER_BYTES`](super::MAX_STEP_BUFFER_BYTES); default
    /// [`DEFAULT_GRAD_BUCKET_BYTES`](super::DEFAULT_GRAD_BUCKET_BYTES)). Memory only: the steps'
    /// numbers do not depend on it (but over NCCL at more than two ranks, see
    /// [`summed_share`]). May change between steps.
    pub fn with_grad_bucket_bytes(mut self, bytes: u64) -> Self {
        self.set_grad_bucket_bytes(bytes);
        self
    }

    /// Sets the bucket size of [`with_grad_bucket_bytes`](Self::with_grad_bucket_bytes).
    pub fn set_grad_bucket_bytes(&mut self, bytes: u64) {
        self.bucket_bytes = bytes;
    }

    /// This optimizer all-gathering the updated weights on a group in pieces of at most `bytes`
    /// (every rank's piece together; by default and at most
    /// [`MAX_STEP_BUFFER_BYTES`](super::MAX_STEP_BUFFER_BYTES)). Memory only: the weights are
    /// the same bits.
    pub fn with_weight_gather_bytes(mut self, bytes: u64) -> Self {
        self.gather_bytes = bytes;
        self
    }

    /// The stage.
    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// Where the state is kept.
    pub fn placement(&self) -> StatePlacement {
        self.placement
    }

    /// `(rank, world size)` of the group.
    fn rank(&self) -> (usize, usize) {
        self.group
            .as_ref()
            .map_or((0, 1), |g| (g.rank(), g.world_size()))
    }

    /// Bytes of host memory the state holds (0 on the device, or before it exists).
    pub fn host_bytes(&self) -> u64 {
        match &self.state {
            Some(State::Host(host)) => host.bytes(),
            _ => 0,
        }
    }

    /// This rank's f32 master weights, whole, on the device (`None` before the first step).
    pub fn master_weights(&self) -> Option<Tensor<B::InnerBackend, 1>> {
        match self.state.as_ref()? {
            State::Device(shard) => Some(shard.vector(0)),
            State::Host(host) => Some(host.vector(0)),
        }
    }

    /// This rank's share of the state on the device: the one the steps built, or before the
    /// first step the one the first step would start from (`model`'s weights, zero moments, no
    /// step taken), its vectors whole (the chunks concatenated, or a host-resident state copied
    /// to the device).
    pub fn shard<M: AutodiffModule<B>>(&self, model: &M) -> OptimizerShard<B> {
        let whole =
            |layout: &FlatLayout, time, vector: &dyn Fn(usize) -> Tensor<_, 1>| OptimizerShard {
                layout: layout.clone(),
                master: vector(0),
                moment_1: vector(1),
                moment_2: vector(2),
                time,
            };
        match &self.state {
            Some(State::Device(shard)) => whole(&shard.layout, shard.time, &|v| shard.vector(v)),
            Some(State::Host(host)) => whole(&host.layout, host.time, &|v| host.vector(v)),
            None => self.first_shard(model, FlatLayout::of::<B, M>(model, self.rank().1)),
        }
    }

    /// This rank's share of the state for a checkpoint, its vectors read chunk by chunk as the
    /// file takes them (never made whole, on the device or in host memory).
    pub fn shard_data<M: AutodiffModule<B>>(&self, model: &M) -> ShardData<'_> {
        match &self.state {
            Some(State::Host(host)) => ShardData {
                layout: host.layout.clone(),
                time: host.time,
                vectors: Box::new(|v, sink| host.pieces(v, sink)),
            },
            Some(State::Device(shard)) => ShardData {
                layout: shard.layout.clone(),
                time: shard.time,
                vectors: Box::new(|v, sink| shard.pieces(v, sink)),
            },
            None => ShardData::of(self.shard(model)),
        }
    }

    /// Replaces this rank's share of the state by `shard` (whole vectors, such as
    /// [`ShardSet::shard`] reads); the next [`step`](Self::step) continues from it. Its vectors
    /// are copied into the state's chunks, under [`StatePlacement::Host`] into host memory
    /// ([`load`](Self::load) reads a checkpoint chunk by chunk instead).
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] when the layout is not over this group's world size or a tensor is
    /// not `[shard_len]`; nothing changes then. Under [`StatePlacement::Host`], the errors of
    /// [`prepare`](Self::prepare).
    pub fn restore(&mut self, shard: OptimizerShard<B>) -> Result<(), Error> {
        let (n, world) = (shard.layout.shard_len(), self.rank().1);
        if shard.layout.world() != world {
            return Err(Error::invalid(
                "the world size of a restored optimizer shard's layout",
                format!("this group's, {world}"),
                shard.layout.world(),
            ));
        }
        for (name, tensor) in [
            ("master weights", &shard.master),
            ("first moment", &shard.moment_1),
            ("second moment", &shard.moment_2),
        ] {
            if tensor.dims() != [n] {
                return Err(Error::invalid(
                    format!("the shape of a restored optimizer shard's {name}"),
                    format!("[{n}], this rank's share of the layout"),
                    format!("{:?}", tensor.dims()),
                ));
            }
        }
        let device = shard.master.device();
        let vectors = [&shard.master, &shard.moment_1, &shard.moment_2];
        // Each chunk a copy of its own: a view would keep the whole vector allocated.
        let state = self.placed_state(shard.layout.clone(), shard.time, &device, |r| {
            vectors.map(|v| owned_f32(v.clone().narrow(0, r.start, r.len())))
        })?;
        self.state = Some(state);
        Ok(())
    }

    /// Replaces this rank's share of the state by its share of `layout` (the loaded model's,
    /// over this group's world size) in the checkpoint `set`, on `device`, chunk by chunk (into
    /// host memory under [`StatePlacement::Host`]), never whole on the device.
    ///
    /// # Errors
    ///
    /// As [`restore`](Self::restore).
    pub fn load(
        &mut self,
        set: &ShardSet,
        layout: FlatLayout,
        device: &Device<B::InnerBackend>,
    ) -> Result<(), Error> {
        let start = self.rank().0 * layout.shard_len();
        let time = set.header().optimizer_step;
        let state = self.placed_state(layout, time, device, |r| {
            ShardTensor::ALL.map(|t| {
                let values = set.read(t, start + r.start, r.len());
                let data = TensorData::new(values, [r.len()]);
                Tensor::from_data(data, (device, DType::F32))
            })
        })?;
        self.state = Some(state);
        Ok(())
    }

    /// Makes the state from `model`'s weights unless it exists, chunk by chunk: on the device,
    /// or under [`StatePlacement::Host`] in host memory, which is first checked against
    /// what the host has available (less the offload's headroom) and on CUDA pinned, so that a
    /// host without enough fails here, before a step's work. [`step`](Self::step) calls it;
    /// call it before the first step's forward to fail before any work.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] when the ranks' models differ in structure or the model has no float
    /// parameter (as [`step`](Self::step)); [`Error::Comm`] when the check's collective fails;
    /// [`Error::Attention`] wrapping the backend's offload error (the bytes wanted and what the
    /// host has), under [`StatePlacement::Host`].
    pub fn prepare<M: AutodiffModule<B>>(&mut self, model: &M) -> Result<(), Error> {
        if self.state.is_some() {
            return Ok(());
        }
        let (rank, world) = self.rank();
        let layout = FlatLayout::of::<B, M>(model, world);
        // Every rank's model has the same structure (one collective), before any state exists.
        self.check(&layout)?;
        let weights = FlatPieces::weights::<B, M>(model);
        let start = rank * layout.shard_len();
        let device = weights.device().clone();
        let state = self.placed_state(layout, 0, &device, |r| {
            let master = weights.range(start + r.start..start + r.end);
            // Two vectors of zeros, not one shared: the first update may then write over each.
            let [moment_1, moment_2] = [(); 2].map(|_| master.zeros_like());
            [master, moment_1, moment_2]
        })?;
        self.state = Some(state);
        Ok(())
    }

    /// A state of `layout`'s share at step `time` at this optimizer's placement, in chunks of
    /// its budget, each chunk made on `device` by `make`.
    fn placed_state(
        &self,
        layout: FlatLayout,
        time: i32,
        device: &Device<B::InnerBackend>,
        make: impl FnMut(Range<usize>) -> StateVectors<B::InnerBackend>,
    ) -> Result<State<B>, Error> {
        let chunk = chunk_elements(self.chunk_bytes);
        Ok(match self.placement {
            StatePlacement::Gpu => State::Device(DeviceShard::build(layout, time, chunk, make)),
            StatePlacement::Host => {
                State::Host(HostShard::build(layout, time, chunk, device, make)?)
            }
        })
    }

    /// One step: `model` updated from its gradients `grads` (this rank's, summed over the group
    /// here) at learning rate `lr`, the gradients first scaled down to a global L2 norm of
    /// `clip` when theirs is larger (`clip <= 0` never clips). Returns the updated model and
    /// the global norm of the summed gradients before clipping.
    ///
    /// # Errors
    ///
    /// - [`Error::Invalid`] when the ranks' models differ in structure (number, shapes or
    ///   float types of their parameters) or the model has changed since the first step, before
    ///   any gradient moves, or when the model has no float parameter.
    /// - [`Error::Comm`] when a collective fails (a peer that does not take part ends in the
    ///   group's timeout, never a hang).
    /// - The errors of [`prepare`](Self::prepare) at the first step.
    pub fn step<M: AutodiffModule<B>>(
        &mut self,
        lr: f64,
        clip: f64,
        model: M,
        grads: GradientsParams,
    ) -> Result<(M, f64), Error> {
        let world = self.rank().1;
        let layout = FlatLayout::of::<B, M>(&model, world);
        // At the first step `prepare` compares the ranks' layouts; later, `check` compares the
        // model's with the state's.
        self.prepare(&model)?;
        self.check(&layout)?;
        let mut state = self.state.take().expect("prepared");
        let (model, norm) = self.step_chunks(&mut state, lr, clip, model, grads)?;
        self.state = Some(state);
        Ok((model, norm))
    }

    /// [`step`](Self::step) of the state `state`: the gradient norm from the gradient's blocks,
    /// then each chunk of state updated with its chunk of the gradient (streamed through the
    /// device when in host memory), its updated weights (gathered over the group) written into
    /// the parameters as they complete ([`WeightWriter`]: no vector of the whole model's
    /// weights). On one device the gradient's chunks are read from the parameters' gradients (no
    /// f32 copy of the whole gradient); on a group from the summed share, made bucket by bucket.
    fn step_chunks<M: AutodiffModule<B>>(
        &self,
        state: &mut State<B>,
        lr: f64,
        clip: f64,
        model: M,
        mut grads: GradientsParams,
    ) -> Result<(M, f64), Error> {
        let (layout, time) = match state {
            State::Device(shard) => (shard.layout.clone(), shard.time + 1),
            State::Host(host) => (host.layout.clone(), host.time + 1),
        };
        let mut gradient = match &self.group {
            None => Gradient::Pieces(FlatPieces::gradients::<B, M>(&model, &mut grads)),
            Some(_) => Gradient::Share(self.summed_share(&layout, &model, &mut grads)?),
        };
        let n = layout.shard_len();
        let norm = self.global_norm(n, |r| gradient.range(r))?;
        let scale = clip_scale(clip, norm);
        let mut writer = WeightWriter::new(&layout);
        let mut update = |r: Range<usize>, vectors: StateVectors<B::InnerBackend>| {
            let grad = clipped(gradient.range(r.clone()), scale);
            // The chunks come in order: the gradients before this one's end are read for good,
            // and their memory can hold the new weights the writer is assembling.
            gradient.release_read(n, r.end);
            let updated = self.settings.update_vectors(vectors, grad, lr, time);
            self.write_weights(&mut writer, &layout, r, updated[0].clone())?;
            Ok::<_, Error>(updated)
        };
        match state {
            State::Device(shard) => {
                shard.stream(&mut update)?;
                shard.time = time;
            }
            State::Host(host) => {
                host.stream(&mut update)?;
                host.time = time;
            }
        }
        Ok((writer.into_model::<B, M>(model), norm))
    }

    /// Writes the updated master weights `master` of elements `range` of this rank's share into
    /// `writer`, cast to the weights' wire type; on a group every rank's same range, all-gathered
    /// in pieces of at most [`MAX_STEP_BUFFER_BYTES`](super::MAX_STEP_BUFFER_BYTES).
    fn write_weights(
        &self,
        writer: &mut WeightWriter<B::InnerBackend>,
        layout: &FlatLayout,
        range: Range<usize>,
        master: Tensor<B::InnerBackend, 1>,
    ) -> Result<(), Error> {
        let wire = layout.wire_dtype();
        let chunk = master.cast(wire);
        let Some(group) = &self.group else {
            writer.write(range.start, chunk);
            return Ok(());
        };
        let (world, n) = (group.world_size(), layout.shard_len());
        let gather = gather_elements(self.gather_bytes, wire.size(), world);
        let pieces = ranges(range.len(), gather);
        let whole = pieces.len() == 1;
        for piece in pieces {
            let (start, len) = (range.start + piece.start, piece.len());
            let mine = match whole {
                true => chunk.clone(),
                false => chunk.clone().narrow(0, piece.start, len),
            };
            let all = collective(group.all_gather(primitive(mine)), "the weights")?;
            for rank in 0..world {
                writer.write(rank * n + start, all.clone().narrow(0, rank * len, len));
            }
        }
        Ok(())
    }

    /// This rank's share of the gradients (taken out of `grads`) summed over the group, in f32,
    /// in buckets of the optimizer's size ([`summed_share`]).
    fn summed_share<M: AutodiffModule<B>>(
        &self,
        layout: &FlatLayout,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<SummedShare<B::InnerBackend>, Error> {
        let pieces = FlatPieces::gradients::<B, M>(model, grads);
        let bucket = bucket_elements(self.bucket_bytes, self.rank().1);
        summed_share(pieces, layout, self.group.as_ref(), self.stage, bucket)
    }

    /// The global L2 norm of the summed gradients, from this rank's share (`n` elements) read by
    /// `read`: each
    /// [`NORM_BLOCK`](super::state_chunks::NORM_BLOCK)-element block's sum of squares, those
    /// added, then over the group (one all-reduce of a scalar). The blocks are the same
    /// whatever the state's placement and chunks: the norm is the same number.
    fn global_norm(
        &self,
        n: usize,
        read: impl Fn(Range<usize>) -> Tensor<B::InnerBackend, 1>,
    ) -> Result<f64, Error> {
        let mut partials: Vec<_> = (norm_blocks(n).into_iter())
            .map(|r| B::InnerBackend::squared_norm(read(r)))
            .collect();
        let squared = match partials.len() {
            1 => partials.pop().expect("one block"),
            _ => Tensor::cat(partials, 0).sum(),
        };
        let squared = match &self.group {
            None => squared,
            Some(group) => collective(group.all_reduce(primitive(squared)), "the gradient norm")?,
        };
        Ok(squared.into_scalar().elem::<f64>().sqrt())
    }

    /// Refuses a model whose structure differs from the first step's on this rank, or (at the
    /// first step) from another rank's.
    fn check(&self, layout: &FlatLayout) -> Result<(), Error> {
        if layout.is_empty() {
            return Err(Error::invalid(
                "the model's float parameters",
                "at least one parameter element",
                "none",
            ));
        }
        let first = match &self.state {
            Some(State::Device(shard)) => Some(&shard.layout),
            Some(State::Host(host)) => Some(&host.layout),
            None => None,
        };
        if let Some(first) = first {
            if first != layout {
                return Err(Error::invalid(
                    "the model's parameters at this optimizer step",
                    format!("those of its first step: {}", first.describe()),
                    layout.describe(),
                ));
            }
            return Ok(());
        }
        let Some(group) = &self.group else {
            return Ok(());
        };
        let mine = [
            layout.num_tensors() as u64,
            layout.len() as u64,
            layout.fingerprint(),
        ];
        let all = collective_values(group.all_gather_values(&mine))?;
        match all.iter().position(|theirs| *theirs != mine) {
            None => Ok(()),
            Some(peer) => Err(Error::invalid(
                format!(
                    "the parameters of rank {} (sharded over {} ranks)",
                    group.rank(),
                    group.world_size()
                ),
                format!(
                    "the same as every rank's, but rank {peer} has {} tensors, {} elements, \
                     layout fingerprint {:#018x}",
                    all[peer][0], all[peer][1], all[peer][2]
                ),
                layout.describe(),
            )),
        }
    }

    /// This rank's share of the model's weights as f32 master weights, with zero moments.
    fn first_shard<M: AutodiffModule<B>>(
        &self,
        model: &M,
        layout: FlatLayout,
    ) -> OptimizerShard<B> {
        let (rank, _) = self.rank();
        let n = layout.shard_len();
        let master = FlatPieces::weights::<B, M>(model).range(rank * n..(rank + 1) * n);
        // Two vectors of zeros, not one shared: the first update may then write over each.
        let [moment_1, moment_2] = [(); 2].map(|_| master.zeros_like());
        OptimizerShard {
            layout,
            master,
            moment_1,
            moment_2,
            time: 0,
        }
    }
}

/// Where a step reads this rank's share of the summed gradients.
enum Gradient<I: Backend> {
    /// One device's: the parameters' gradients, read in ranges.
    Pieces(FlatPieces<I>),
    /// A group's: the summed share, in buckets.
    Share(SummedShare<I>),
}

impl<I: Backend> Gradient<I> {
    /// Elements `range` of the share, in f32.
    fn range(&self, range: Range<usize>) -> Tensor<I, 1> {
        match self {
            Self::Pieces(pieces) => pieces.range(range),
            Self::Share(share) => share.range(range),
        }
    }

    /// Lets go of what lies wholly before offset `end` of the share (`n` elements), read for
    /// good.
    fn release_read(&mut self, n: usize, end: usize) {
        match self {
            Self::Pieces(pieces) => pieces.release_read(n, end),
            Self::Share(share) => share.release_before(end),
        }
    }
}

/// `grad` scaled by `scale`, when there is one.
fn clipped<I: Backend>(grad: Tensor<I, 1>, scale: Option<f64>) -> Tensor<I, 1> {
    match scale {
        Some(scale) => grad.mul_scalar(scale),
        None => grad,
    }
}

/// The factor that scales gradients of global norm `norm` down to `clip`, when they exceed it
/// (`clip <= 0` never clips).
fn clip_scale(clip: f64, norm: f64) -> Option<f64> {
    (clip > 0.0 && norm > clip).then(|| clip / norm)
}

/// Gathered values, or the failure as an [`Error::Comm`].
fn collective_values(result: Result<Vec<Vec<u64>>, PluginError>) -> Result<Vec<Vec<u64>>, Error> {
    result.map_err(|source| Error::Comm {
        what: "the parameter layouts",
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};
    use burn::nn::Linear;

    use crate::optimizer::summed_share::tests::{linears, on_ranks};

    type Cpu = Autodiff<NdArray<f32>>;
    type Layers = (Linear<Cpu>, Linear<Cpu>);

    /// Two linear layers (64 x 48 + 48, then 48 x 40 + 40: 5080 elements) of set values (no
    /// draw from NdArray's shared generator).
    fn layers() -> Layers {
        linears([(64, 48), (48, 40)], |e| {
            ((e * 37) % 101) as f32 / 400.0 - 0.125
        })
    }

    /// Rank `rank`'s inputs at `step`: 5 rows of 64.
    fn inputs(rank: usize, step: usize) -> Tensor<Cpu, 2> {
        let x: Vec<f32> = (0..5 * 64)
            .map(|e| ((e * 13 + rank * 7 + step * 3) % 17) as f32 / 8.0 - 1.0)
            .collect();
        Tensor::<Cpu, 1>::from_floats(x.as_slice(), &Default::default()).reshape([5, 64])
    }

    /// Every rank's weights' bits after two steps of `sum((x W1 W2)^2)` at stage 2 over `world`
    /// in-process ranks, the state on the device in chunks of 2048 elements, the updated
    /// weights gathered in pieces of `gather_bytes`.
    fn weights_after_steps(world: usize, gather_bytes: u64) -> Vec<Vec<u32>> {
        let settings = AdamWSettings {
            beta_1: 0.9,
            beta_2: 0.99,
            epsilon: 1e-8,
            weight_decay: 0.01,
        };
        on_ranks(world, |rank, group| {
            let optim = ShardedAdamW::<Cpu>::new(ZeroStage::Gradients, settings, Some(group));
            let optim = optim.unwrap();
            let optim = optim.with_state_placement(StatePlacement::Gpu, 12 * 2048);
            let mut optim = optim.with_weight_gather_bytes(gather_bytes);
            let mut model = layers();
            for step in 0..2 {
                let y = model.1.forward(model.0.forward(inputs(rank, step)));
                let loss = y.powf_scalar(2.0).sum();
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(1e-2, 0.0, model, grads).unwrap().0;
            }
            let flat = FlatLayout::of::<Cpu, _>(&model, 1).weights::<Cpu, _>(&model);
            let flat = flat.into_data().to_vec::<f32>().unwrap();
            flat.iter().map(|v| v.to_bits()).collect()
        })
    }

    #[test]
    fn weights_gathered_in_pieces_are_bitwise_those_gathered_whole_on_every_rank() {
        for world in [2, 3] {
            let whole = weights_after_steps(world, MAX_STEP_BUFFER_BYTES);
            assert!(whole.iter().all(|w| *w == whole[0]), "{world} ranks agree");
            // Pieces of 1024 elements of each share: two a chunk of 2048 (shares of 2540 and
            // 1694 elements: the last chunk one piece, or two of which the last is short).
            let pieces = weights_after_steps(world, (4 * 1024 * world) as u64);
            assert!(
                pieces == whole,
                "{world} ranks, gathers of 1024 elements a share"
            );
        }
    }
}
