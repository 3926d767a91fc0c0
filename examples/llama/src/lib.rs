//! Llama models trained with burn-distflash's attention: the model and its configuration,
//! loading Hugging Face weights, tokenizers, data, training (AdamW, schedule, clipping, gradient
//! all-reduce, checkpoints), the prediction of one GPU's memory for a training setting
//! ([`memory_plan`]), its logs, progress and loss plot, and the `llama_train` command line
//! ([`cli`]). The `llama_train` binary (`src/main.rs`) drives it.
//!
//! Every fallible function of this crate returns its one error type, [`Error`]; the model and
//! its configuration return the plugin's errors (`burn_distflash::Error`) as the
//! plugin's layers do.

#![warn(missing_docs)]
mod byte_units;
pub mod cli;
pub mod config;
pub mod data;
mod device_memory;
pub mod disk_space;
mod error;
pub mod generate;
pub mod hf_config;
pub mod host_usage;
pub mod loss;
pub mod loss_plot;
pub mod lr_schedule;
pub mod memory_plan;
pub mod metrics;
pub mod model;
pub mod optimizer;
pub mod progress;
mod rng;
pub mod safetensors;
pub mod safetensors_streamed;
mod staged_dir;
pub mod tokenizer;
pub mod train;
mod training_kernels;
pub mod weights;

pub use byte_units::{format_bytes, parse_bytes};
pub use config::{LlamaConfig, PRESETS};
pub use error::Error;
pub use model::{Llama, LlamaInput};
pub use training_kernels::TrainingKernels;
