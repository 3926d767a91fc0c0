//! [`AdamWSettings`]: AdamW's hyperparameters, the constants of one step they give, and the
//! sharded optimizer's update of its f32 vectors from them: one fused pass in place on the CubeCL
//! backends ([`TrainingKernels::adamw_update`]), Burn tensor operations elsewhere.

use burn::tensor::Tensor;

use crate::training_kernels::AdamWStep;
use crate::TrainingKernels;

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

impl AdamWSettings {
    /// The update's constants at step `time` (the first step is 1) and learning rate `lr`:
    /// the bias corrections `1 - beta^time` in f32, the decay factor `1 - lr weight_decay`
    /// computed in f64 and rounded once.
    pub fn step_constants(&self, lr: f64, time: i32) -> AdamWStep {
        let (beta_1, beta_2) = (self.beta_1, self.beta_2);
        AdamWStep {
            beta_1,
            beta_2,
            bias_1: 1.0 - beta_1.powi(time),
            bias_2: 1.0 - beta_2.powi(time),
            epsilon: self.epsilon,
            decay: (1.0 - lr * f64::from(self.weight_decay)) as f32,
            lr: lr as f32,
        }
    }

    /// One AdamW update of master weights and moments `[p, m, v]` (any range of a shard: the
    /// update is element-wise) into step `time` from their (summed, clipped) f32 gradient `grad`,
    /// with Burn's `AdamW` formulas: `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g^2`,
    /// `p = p (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)`, through
    /// [`TrainingKernels::adamw_update`]: where the vectors are this call's alone, the CubeCL
    /// backends write the results over them.
    pub(crate) fn update_vectors<I: TrainingKernels>(
        &self,
        [master, moment_1, moment_2]: [Tensor<I, 1>; 3],
        grad: Tensor<I, 1>,
        lr: f64,
        time: i32,
    ) -> [Tensor<I, 1>; 3] {
        let step = self.step_constants(lr, time);
        I::adamw_update(master, grad, (moment_1, moment_2), &step)
    }
}
