//! `llama_train`'s optimisation options: steps, batch, sequence, AdamW's learning rate
//! schedule, clipping, the seed and the ZeRO stage, and the [`TrainOptions`] they make.

use clap::Args;

use super::values::{at_least_one, non_negative, Zero};
use crate::train::TrainOptions;

/// What a step trains on and how the optimizer updates.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Optimisation")]
pub struct OptimisationArgs {
    /// Training steps in all (beside --resume: the new total, at least the checkpoint's step)
    #[arg(long, value_name = "N", default_value_t = 600)]
    pub steps: u64,

    /// Sequences per step
    #[arg(long, value_name = "N", value_parser = at_least_one(), default_value_t = 8)]
    pub batch: usize,

    /// Tokens per sequence, the whole sequence (split across the GPUs of a group)
    #[arg(long, value_name = "TOKENS", value_parser = at_least_one(), default_value_t = 128)]
    pub seq_len: usize,

    /// Peak learning rate of AdamW, reached after --warmup steps, then cosine decay
    #[arg(long, value_name = "RATE", value_parser = non_negative, allow_negative_numbers = true,
          default_value_t = 2e-3)]
    pub lr: f64,

    /// Steps of linear learning-rate warm-up
    #[arg(long, value_name = "STEPS", default_value_t = 20)]
    pub warmup: u64,

    /// Global gradient-norm clipping threshold (0: no clipping)
    #[arg(long, value_name = "NORM", value_parser = non_negative, allow_negative_numbers = true,
          default_value_t = 1.0)]
    pub grad_clip: f64,

    /// Seed of the initial weights, the batches and the sample
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,

    /// The optimizer's ZeRO stage across ranks (default: 2 on several ranks, 0 on one)
    #[arg(long, value_enum, value_name = "STAGE")]
    pub zero: Option<Zero>,
}

impl OptimisationArgs {
    /// The trainer's options for these settings (chunks by default budget, ZeRO unset).
    pub fn train_options(&self) -> TrainOptions {
        TrainOptions::new(self.steps, self.batch, self.seq_len)
            .with_lr(self.lr)
            .with_warmup(self.warmup)
            .with_grad_clip(self.grad_clip)
            .with_seed(self.seed)
    }
}
