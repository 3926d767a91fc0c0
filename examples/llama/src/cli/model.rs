//! `llama_train`'s model options: which configuration (a preset, a file, or a Hugging Face
//! directory's) and what the command line overrides in it.

use std::path::PathBuf;

use clap::Args;

use super::values::at_least_one;

/// The model: a preset, a configuration file or Hugging Face weights, and overrides.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Model")]
pub struct ModelArgs {
    /// The model configuration: a preset (tiny, llama-7b, llama-gqa, llama-33h, llama-16h,
    /// llama-8h, llama-4h, llama-2h, llama3-8b) or a JSON file (--save-config writes one)
    #[arg(long, value_name = "PRESET|FILE.json", default_value = "tiny")]
    pub config: String,

    /// Overrides the configuration's number of layers
    #[arg(long, value_name = "N", value_parser = at_least_one())]
    pub layers: Option<usize>,

    /// Starts from a Hugging Face Llama directory (config.json and safetensors files);
    /// replaces --config
    #[arg(long, value_name = "HF_DIR")]
    pub weights: Option<PathBuf>,

    /// Sliding-window attention: each token sees itself and the N - 1 tokens before it, in
    /// every layer (overrides the configuration's `window`; default: full causal attention)
    #[arg(long, value_name = "N", value_parser = at_least_one())]
    pub window: Option<usize>,

    /// Writes the configuration, overrides applied, to this JSON file (to edit and pass back
    /// to --config)
    #[arg(long, value_name = "FILE.json")]
    pub save_config: Option<PathBuf>,
}
