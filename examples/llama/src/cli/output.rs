//! `llama_train`'s output options: where a run writes, how often it logs, validates and saves,
//! resuming, exporting the weights, and the sample at the end.

use std::path::PathBuf;

use clap::Args;

/// The run's directory, logs, checkpoints, export and sample.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Output")]
pub struct OutputArgs {
    /// The run's directory: metrics.jsonl, loss.svg and checkpoint/ (default:
    /// runs/llama-CONFIG)
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,

    /// Steps between progress lines when standard error is not a terminal
    #[arg(long, value_name = "STEPS", value_parser = clap::value_parser!(u64).range(1..),
          default_value_t = 10)]
    pub log_every: u64,

    /// Steps between validation losses on the held-out slice, and one at the end (0: none)
    #[arg(long, value_name = "STEPS", default_value_t = 50)]
    pub val_every: u64,

    /// Steps between checkpoints, and one at the end (0: only at the end)
    #[arg(long, value_name = "STEPS", default_value_t = 100)]
    pub save_every: u64,

    /// Write no checkpoint, not even at the end (a run that measures, or tries options); without
    /// it the run first checks that the checkpoint's filesystem has room for one
    #[arg(long, conflicts_with_all = ["save_every", "export_weights"])]
    pub no_checkpoint: bool,

    /// Continue from DIR/checkpoint with its options, at the same or another number of ranks
    /// (--steps sets a new total; the chunk options replace the checkpoint's)
    #[arg(long)]
    pub resume: bool,

    /// At the end, write the final checkpoint's weights as a Hugging Face directory that
    /// --weights loads (the f32 master weights under --zero 1|2)
    #[arg(long, value_name = "HF_DIR")]
    pub export_weights: Option<PathBuf>,

    /// The text the sample at the end continues
    #[arg(long, value_name = "TEXT", default_value = "ROMEO:")]
    pub prompt: String,

    /// Tokens sampled after --prompt at the end, top-10 at temperature 0.8 (0: no sample)
    #[arg(long, value_name = "N", default_value_t = 200)]
    pub sample_tokens: usize,
}
