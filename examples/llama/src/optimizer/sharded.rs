//! [`ShardedAdamW`]: mixed-precision AdamW sharded over a device group (ZeRO stages 1 and 2),
//! for any Burn module trained on a [`DeviceGroup`].
//!
//! The working weights stay in their own float type (bf16 on the GPU) on every rank. The
//! model's float parameters are laid end to end in a [`FlatLayout`]; rank `r` of `P` owns
//! elements `r * n .. (r + 1) * n` of it as f32 master weights and f32 moments. One step:
//!
//! 1. the gradients are gathered into one f32 vector;
//! 2. stage 2 reduce-scatters it (each rank receives only its share of the sum); stage 1
//!    all-reduces it and keeps its share;
//! 3. the global gradient norm comes from the shares' squares with one all-reduce of a scalar,
//!    and the share is scaled down when the norm exceeds the clipping norm;
//! 4. AdamW updates the share in f32 (Burn's `AdamW` formulas);
//! 5. the updated shares, cast to the weights' type, are all-gathered and written back into the
//!    parameters.
//!
//! Every step is Burn tensor operations on the device; only the norm comes to the host.

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor, TensorPrimitive};
use burn_distflash::{DeviceGroup, Error as PluginError};

use super::flat::FlatLayout;
use super::zero_stage::ZeroStage;
use crate::Error;

/// AdamW's settings (decoupled weight decay, no AMSGrad).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWSettings {
    /// Decay of the first moment.
    pub beta_1: f32,
    /// Decay of the second moment.
    pub beta_2: f32,
    /// Added to the corrected second moment's square root.
    pub epsilon: f32,
    /// Decoupled weight decay (the weights shrink by `lr * weight_decay` each step).
    pub weight_decay: f32,
}

/// One rank's share of a [`ShardedAdamW`]'s state, in f32: elements
/// `rank * n .. (rank + 1) * n` of the model's [`FlatLayout`] (`n` its
/// [`shard_len`](FlatLayout::shard_len)).
#[derive(Clone)]
pub struct OptimizerShard<B: AutodiffBackend> {
    /// The layout of the model's parameters over the group.
    pub layout: FlatLayout,
    /// The f32 master weights, `[n]` (zeros where the share covers the padding).
    pub master: Tensor<B::InnerBackend, 1>,
    /// AdamW's first moment, `[n]`.
    pub moment_1: Tensor<B::InnerBackend, 1>,
    /// AdamW's second moment, `[n]`.
    pub moment_2: Tensor<B::InnerBackend, 1>,
    /// Optimizer steps taken.
    pub time: i32,
}

/// Mixed-precision AdamW whose f32 master weights and moments are split over a group (see the
/// module's documentation). Every rank of the group must step with the same model structure;
/// the first step checks that they do.
pub struct ShardedAdamW<B: AutodiffBackend> {
    stage: ZeroStage,
    settings: AdamWSettings,
    group: Option<DeviceGroup<B::InnerBackend>>,
    shard: Option<OptimizerShard<B>>,
}

impl<B: AutodiffBackend> ShardedAdamW<B> {
    /// A sharded AdamW at `stage` over `group` (`None`: one device, which owns everything). The
    /// state is created at the first [`step`](Self::step), from the model's weights then.
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
            shard: None,
        })
    }

    /// The stage.
    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// `(rank, world size)` of the group.
    fn rank(&self) -> (usize, usize) {
        self.group
            .as_ref()
            .map_or((0, 1), |g| (g.rank(), g.world_size()))
    }

    /// This rank's f32 master weights (`None` before the first step).
    pub fn master_weights(&self) -> Option<Tensor<B::InnerBackend, 1>> {
        self.shard.as_ref().map(|s| s.master.clone())
    }

    /// This rank's share of the state: the one the steps built, or before the first step the
    /// one the first step would start from (`model`'s weights, zero moments, no step taken).
    pub fn shard<M: AutodiffModule<B>>(&self, model: &M) -> OptimizerShard<B> {
        match &self.shard {
            Some(shard) => shard.clone(),
            None => self.first_shard(model, FlatLayout::of::<B, M>(model, self.rank().1)),
        }
    }

    /// Replaces this rank's share of the state by `shard` (read from a checkpoint); the next
    /// [`step`](Self::step) continues from it.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] when the layout is not over this group's world size or a tensor is
    /// not `[shard_len]`; nothing changes then.
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
        self.shard = Some(shard);
        Ok(())
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
    pub fn step<M: AutodiffModule<B>>(
        &mut self,
        lr: f64,
        clip: f64,
        model: M,
        mut grads: GradientsParams,
    ) -> Result<(M, f64), Error> {
        let (rank, world) = self.rank();
        let layout = FlatLayout::of::<B, M>(&model, world);
        self.check(&layout)?;
        let shard = match self.shard.take() {
            Some(shard) => shard,
            None => self.first_shard(&model, layout.clone()),
        };
        let flat = layout.gradients::<B, M>(&model, &mut grads);
        let n = layout.shard_len();
        let grad = match (&self.group, self.stage) {
            (None, _) => flat,
            (Some(group), ZeroStage::Gradients) => {
                collective(group.reduce_scatter(primitive(flat)), "the gradients")?
            }
            (Some(group), _) => collective(group.all_reduce(primitive(flat)), "the gradients")?
                .narrow(0, rank * n, n),
        };
        let squared = grad.clone().square().sum();
        let squared = match &self.group {
            None => squared,
            Some(group) => collective(group.all_reduce(primitive(squared)), "the gradient norm")?,
        };
        let grad_norm = squared.into_scalar().elem::<f64>().sqrt();
        let grad = if clip > 0.0 && grad_norm > clip {
            grad.mul_scalar(clip / grad_norm)
        } else {
            grad
        };
        let shard = self.settings.update(shard, grad, lr);
        let update = shard.master.clone().cast(layout.wire_dtype());
        let weights = match &self.group {
            None => update,
            Some(group) => collective(group.all_gather(primitive(update)), "the weights")?,
        };
        let model = layout.write_back::<B, M>(model, weights);
        self.shard = Some(shard);
        Ok((model, grad_norm))
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
        if let Some(shard) = &self.shard {
            if shard.layout != *layout {
                return Err(Error::invalid(
                    "the model's parameters at this optimizer step",
                    format!("those of its first step: {}", shard.layout.describe()),
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
        let master = layout.weights::<B, M>(model).narrow(0, rank * n, n);
        let zeros = master.zeros_like();
        OptimizerShard {
            layout,
            master,
            moment_1: zeros.clone(),
            moment_2: zeros,
            time: 0,
        }
    }
}

impl AdamWSettings {
    /// One AdamW update of `shard` from its (summed, clipped) f32 gradient `grad`, with Burn's
    /// `AdamW` formulas: `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g^2`,
    /// `p = p (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)`.
    fn update<B: AutodiffBackend>(
        &self,
        shard: OptimizerShard<B>,
        grad: Tensor<B::InnerBackend, 1>,
        lr: f64,
    ) -> OptimizerShard<B> {
        let time = shard.time + 1;
        let moment_1 =
            shard.moment_1.mul_scalar(self.beta_1) + grad.clone().mul_scalar(1.0 - self.beta_1);
        let moment_2 =
            shard.moment_2.mul_scalar(self.beta_2) + grad.square().mul_scalar(1.0 - self.beta_2);
        let corrected_1 = moment_1.clone().div_scalar(1.0 - self.beta_1.powi(time));
        let corrected_2 = moment_2.clone().div_scalar(1.0 - self.beta_2.powi(time));
        let delta = corrected_1 / corrected_2.sqrt().add_scalar(self.epsilon);
        let decayed = shard
            .master
            .mul_scalar(1.0 - lr * f64::from(self.weight_decay));
        OptimizerShard {
            layout: shard.layout,
            master: decayed - delta.mul_scalar(lr),
            moment_1,
            moment_2,
            time,
        }
    }
}

/// A tensor's primitive, for the collectives.
fn primitive<I: burn::tensor::backend::Backend>(
    tensor: Tensor<I, 1>,
) -> burn::tensor::ops::FloatTensor<I> {
    tensor.into_primitive().tensor()
}

/// A collective's result as a tensor, or its failure as an [`Error::Comm`] about `what`.
fn collective<I: burn::tensor::backend::Backend>(
    result: Result<burn::tensor::ops::FloatTensor<I>, PluginError>,
    what: &'static str,
) -> Result<Tensor<I, 1>, Error> {
    result
        .map(|t| Tensor::from_primitive(TensorPrimitive::Float(t)))
        .map_err(|source| Error::Comm { what, source })
}

/// Gathered values, or the failure as an [`Error::Comm`].
fn collective_values(result: Result<Vec<Vec<u64>>, PluginError>) -> Result<Vec<Vec<u64>>, Error> {
    result.map_err(|source| Error::Comm {
        what: "the parameter layouts",
        source,
    })
}
