//! AdamW with its per-parameter passes fused where the backend allows
//! ([`TrainingKernels`]):
//! on the CubeCL backends one kernel reads the parameter, its gradient and both moments once and
//! writes the three results once; elsewhere (and on the first step, and under
//! `DISTFLASH_UNFUSED_OPTIMIZER=1`) Burn's own `AdamW` runs. The state is Burn's `AdamWState`,
//! so checkpoints of either are the same records.
//!
//! [`ShardedAdamW`] is the mixed-precision alternative for groups: f32 master weights and
//! moments split over the ranks ([`ZeroStage`] 1 and 2). Its checkpoints are one file per rank
//! ([`write_shard_file`], [`ShardFile`]), read back at any world size ([`ShardSet`]). It sums the
//! gradients over the group in buckets of a byte budget and keeps its state in chunks, updated
//! and written back chunk by chunk: no buffer of its step is larger than
//! [`MAX_STEP_BUFFER_BYTES`] but the model's own tensors. Its state may live in host memory
//! instead of on the device ([`StatePlacement::Host`]), streamed through the device chunk by
//! chunk at every step, with bitwise the same results and the same files. Its update is the same
//! kernel, writing each chunk's master weights and moments over themselves ([`AdamWSettings`],
//! [`TrainingKernels::adamw_update`]).

mod adamw_settings;
mod device_shard;
mod flat;
mod flat_pieces;
mod host_shard;
mod optimizer_shard;
mod shard_file;
mod shard_set;
mod sharded;
mod state_chunks;
mod state_placement;
mod summed_share;
mod weight_writer;
mod zero_stage;

pub use crate::training_kernels::{unfused_optimizer_forced, AdamWStep, AdamWTensors};
pub use adamw_settings::AdamWSettings;
pub use flat::FlatLayout;
pub use optimizer_shard::OptimizerShard;
pub use shard_file::{
    shard_file_name, write_shard_file, ShardData, ShardFile, ShardHeader, ShardTensor,
};
pub use shard_set::ShardSet;
pub use sharded::ShardedAdamW;
pub use state_chunks::{
    bucket_elements, chunk_elements, gather_elements, DEFAULT_GRAD_BUCKET_BYTES,
    MAX_STEP_BUFFER_BYTES, STATE_BYTES_PER_ELEMENT,
};
pub use state_placement::{StatePlacement, DEFAULT_STATE_CHUNK_BYTES};
pub use zero_stage::ZeroStage;

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{
    AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState, LearningRate, SimpleOptimizer,
};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::TrainingKernels;

/// AdamW (decoupled weight decay, no AMSGrad) whose update runs as one fused pass per parameter
/// on backends that have one.
#[derive(Clone)]
pub struct FusedAdamW {
    settings: AdamWSettings,
    /// Burn's AdamW with the same settings: the first step and the portable path.
    reference: AdamW,
}

impl FusedAdamW {
    /// AdamW with these moment decays, epsilon and weight decay.
    pub fn new(beta_1: f32, beta_2: f32, epsilon: f32, weight_decay: f32) -> Self {
        let config = AdamWConfig::new()
            .with_beta_1(beta_1)
            .with_beta_2(beta_2)
            .with_epsilon(epsilon)
            .with_weight_decay(weight_decay);
        let settings = AdamWSettings {
            beta_1,
            beta_2,
            epsilon,
            weight_decay,
        };
        Self {
            settings,
            reference: config.build(),
        }
    }

    /// This optimizer as a Burn [`Optimizer`](burn::optim::Optimizer) of module `M`.
    pub fn into_optimizer<B, M>(self) -> OptimizerAdaptor<Self, M, B>
    where
        B: AutodiffBackend<InnerBackend: TrainingKernels>,
        M: AutodiffModule<B>,
    {
        OptimizerAdaptor::from(self)
    }
}

impl<B: TrainingKernels> SimpleOptimizer<B> for FusedAdamW {
    type State<const D: usize> = AdamWState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let Some(AdamWState { momentum }) = state.clone() else {
            return self.reference.step(lr, tensor, grad, state);
        };
        if momentum.max_moment_2.is_some() {
            return self.reference.step(lr, tensor, grad, state);
        }
        let constants = (self.settings).step_constants(lr, (momentum.time + 1) as i32);
        let moments = (
            momentum.moment_1.into_primitive().tensor(),
            momentum.moment_2.into_primitive().tensor(),
        );
        let fused = B::fused_adamw(
            tensor.clone().into_primitive().tensor(),
            grad.clone().into_primitive().tensor(),
            moments,
            &constants,
        );
        let Some((param, moment_1, moment_2)) = fused else {
            return self.reference.step(lr, tensor, grad, state);
        };
        let wrap = |t| Tensor::<B, D>::from_primitive(TensorPrimitive::Float(t));
        let momentum = AdaptiveMomentumState {
            time: momentum.time + 1,
            moment_1: wrap(moment_1),
            moment_2: wrap(moment_2),
            max_moment_2: None,
        };
        (wrap(param), Some(AdamWState { momentum }))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        <AdamW as SimpleOptimizer<B>>::to_device(state, device)
    }
}
