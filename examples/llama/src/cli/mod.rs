//! `llama_train`'s command line, parsed by clap: every option with its default, units and
//! allowed values, under the headings `--help` shows (model, data, devices, processes,
//! optimisation, memory, output). clap refuses unknown options, values out of range and names
//! outside a choice with exit code 2; what it cannot check alone (a preset or a file, options
//! against the model or the checkpoint) the binary checks where it uses them. An option given
//! twice takes its last value.

mod data;
mod devices;
mod memory;
mod model;
mod optimisation;
mod output;
mod values;

use std::ffi::OsString;
use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser};

pub use data::DataArgs;
pub use devices::{DeviceArgs, ProcessArgs};
pub use memory::MemoryArgs;
pub use model::ModelArgs;
pub use optimisation::OptimisationArgs;
pub use output::OutputArgs;
pub use values::{
    at_least_one, bytes, fraction, layers_per_checkpoint, non_negative, offload, placement,
    BackendKind, Dtype, MemoryMode, OptimizerState, Schedule, Zero,
};

/// Everything `llama_train`'s command line chose.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "llama_train",
    args_override_self = true,
    about = "Trains a Llama-shaped model with burn-distflash's attention and checkpointing",
    long_about = "Trains a Llama-shaped model with burn-distflash's attention and \
                  checkpointing. Without options: the tiny model on the CPU on Tiny Shakespeare \
                  (raw bytes) for 600 steps, writing runs/llama-tiny/{metrics.jsonl,loss.svg,\
                  checkpoint/} and printing a short sample at the end.",
    after_help = "Examples:\n  \
                  llama_train --steps 100 --log-every 20\n  \
                  llama_train --backend cuda --gpus 4 --config llama-7b --layers 4 \
                  --seq-len 32768 --batch 1 --checkpoint layer\n  \
                  llama_train --plan --config llama-7b --backend cuda --gpus 2 --seq-len 262144 \
                  --batch 1 --gpu-memory 139GiB\n  \
                  torchrun --nproc-per-node 4 ... llama_train --backend cuda --env ..."
)]
pub struct TrainArgs {
    /// The model and its overrides.
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text, its tokenizer, packing and the validation slice.
    #[command(flatten)]
    pub data: DataArgs,
    /// Where the run computes.
    #[command(flatten)]
    pub devices: DeviceArgs,
    /// What a step trains on and how the optimizer updates.
    #[command(flatten)]
    pub optimisation: OptimisationArgs,
    /// Checkpoints, offload, chunks and the memory planner.
    #[command(flatten)]
    pub memory: MemoryArgs,
    /// The run's directory, logs, checkpoints, export and sample.
    #[command(flatten)]
    pub output: OutputArgs,
    /// Whether `--steps` was on the command line (beside `--resume` it replaces the
    /// checkpoint's total).
    #[arg(skip)]
    pub steps_given: bool,
    /// The `--rank`, `--world-size`, ... options given on the command line (not from the
    /// environment); they mean something only under `--env`.
    #[arg(skip)]
    pub process_options_given: Vec<String>,
}

impl TrainArgs {
    /// Parses the process's command line; on `--help` prints the help and exits with code 0,
    /// on a usage error prints it and exits with code 2.
    pub fn from_command_line() -> Self {
        Self::try_parse_args(std::env::args_os()).unwrap_or_else(|e| e.exit())
    }

    /// Parses `args`, the program's name first.
    ///
    /// # Errors
    ///
    /// clap's error for an unknown option, a missing or malformed value, a value out of range
    /// or outside its choices, or options that exclude or require each other (and for
    /// `--help`, whose text the error holds).
    pub fn try_parse_args<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let mut command = Self::command();
        let matches = command.try_get_matches_from_mut(args)?;
        let mut parsed = Self::from_arg_matches(&matches).map_err(|e| e.format(&mut command))?;
        let on_command_line = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
        parsed.steps_given = on_command_line("steps");
        parsed.process_options_given = ProcessArgs::IDS
            .iter()
            .filter(|id| on_command_line(id))
            .map(|id| format!("--{}", id.replace('_', "-")))
            .collect();
        Ok(parsed)
    }

    /// The run's directory: `--out`, or `runs/llama-CONFIG`.
    pub fn out_dir(&self) -> PathBuf {
        self.output
            .out
            .clone()
            .unwrap_or_else(|| PathBuf::from(format!("runs/llama-{}", self.model.config)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::PRESETS;

    fn parse(args: &[&str]) -> Result<TrainArgs, clap::Error> {
        TrainArgs::try_parse_args(std::iter::once("llama_train").chain(args.iter().copied()))
    }

    #[test]
    fn the_definition_is_consistent() {
        TrainArgs::command().debug_assert();
    }

    #[test]
    fn defaults_are_the_documented_run() {
        let args = parse(&[]).unwrap();
        assert_eq!(args.model.config, "tiny");
        assert_eq!(args.devices.backend, BackendKind::Ndarray);
        let options = args.optimisation.train_options();
        assert_eq!(
            (options.steps, options.batch, options.seq_len),
            (600, 8, 128)
        );
        assert_eq!((options.lr, options.grad_clip), (2e-3, 1.0));
        assert_eq!(args.out_dir(), PathBuf::from("runs/llama-tiny"));
        assert!(!args.steps_given && args.process_options_given.is_empty());
        assert!(args.data.text_path().ends_with("data/tiny_shakespeare.txt"));
    }

    #[test]
    fn options_are_read_into_their_groups() {
        let args = parse(&[
            "--config",
            "llama-7b",
            "--layers",
            "4",
            "--backend",
            "cuda",
            "--gpus",
            "4",
            "--checkpoint",
            "attention-output",
            "--offload",
            "2",
            "--steps",
            "10",
            "--zero",
            "1",
            "--loss-chunk",
            "64",
            "--schedule",
            "balanced",
            "--rank",
            "1",
        ])
        .unwrap();
        assert_eq!(args.model.layers, Some(4));
        assert_eq!(args.devices.gpus, 4);
        assert_eq!(
            args.memory.checkpoint,
            Some(burn_distflash::layers::CheckpointPlacement::AttentionOutput)
        );
        assert_eq!(
            args.memory.offload,
            Some(burn_distflash::layers::Offload::AllButLast(2))
        );
        assert_eq!(
            args.memory.layers_per_checkpoint, None,
            "the configuration's"
        );
        let paired = parse(&["--layers-per-checkpoint", "2"]).unwrap();
        assert_eq!(paired.memory.layers_per_checkpoint, Some(2));
        assert_eq!(args.optimisation.zero, Some(Zero::OptimizerStates));
        assert_eq!(args.devices.schedule, Schedule::Balanced);
        assert!(args.memory.chunks().0.is_some() && args.memory.chunks_given());
        assert!(args.steps_given);
        assert_eq!(args.process_options_given, ["--rank"]);
        assert_eq!(args.out_dir(), PathBuf::from("runs/llama-llama-7b"));
        // An option given again replaces its earlier value.
        let again = parse(&["--steps", "10", "--steps", "20"]).unwrap();
        assert_eq!(again.optimisation.steps, 20);
        assert_eq!(
            again.memory.optimizer_state(),
            None,
            "the checkpoint's, or gpu"
        );
        let host = parse(&["--optimizer-state", "host", "--optimizer-chunk", "1GiB"]).unwrap();
        let placement = crate::optimizer::StatePlacement::Host;
        assert_eq!(host.memory.optimizer_state(), Some((placement, 1 << 30)));
        let chunk = parse(&["--optimizer-chunk", "64MiB"]).unwrap();
        let gpu = crate::optimizer::StatePlacement::Gpu;
        assert_eq!(chunk.memory.optimizer_state(), Some((gpu, 64 << 20)));
        assert_eq!(
            again.memory.grad_bucket, None,
            "the checkpoint's, or 256MiB"
        );
        let bucket = parse(&["--grad-bucket", "64MiB"]).unwrap();
        assert_eq!(bucket.memory.grad_bucket, Some(64 << 20));
        assert!(parse(&["--grad-bucket", "lots"]).is_err());
    }

    #[test]
    fn the_help_names_every_preset() {
        let help = TrainArgs::command().render_long_help().to_string();
        for preset in PRESETS {
            assert!(help.contains(preset), "{preset} missing from the help");
        }
    }

    #[test]
    fn process_options_read_as_torchrun_variables() {
        let args = parse(&[
            "--env",
            "--rank",
            "1",
            "--world-size",
            "2",
            "--local-rank",
            "1",
            "--master-addr",
            "node0",
            "--master-port",
            "29500",
        ])
        .unwrap();
        let group = args.devices.processes.group().unwrap();
        assert_eq!((group.rank, group.world_size, group.local_rank), (1, 2, 1));
        assert_eq!(group.master.as_deref(), Some("node0:29500"));
        let mut out_of_range = args.clone();
        out_of_range.devices.processes.rank = Some("2".into());
        let message = out_of_range
            .devices
            .processes
            .group()
            .unwrap_err()
            .to_string();
        assert!(message.contains("RANK=2"), "{message}");
    }

    #[test]
    fn bad_command_lines_are_usage_errors() {
        use clap::error::ErrorKind;
        let kind = |args: &[&str]| parse(args).unwrap_err().kind();
        assert_eq!(kind(&["--no-such-option"]), ErrorKind::UnknownArgument);
        assert_eq!(kind(&["--batch", "0"]), ErrorKind::ValueValidation);
        assert_eq!(kind(&["--lr", "-1"]), ErrorKind::ValueValidation);
        assert_eq!(kind(&["--backend", "tpu"]), ErrorKind::InvalidValue);
        assert_eq!(
            kind(&["--checkpoint", "attention"]),
            ErrorKind::InvalidValue
        );
        for layers in ["0", "3", "two"] {
            let args = ["--layers-per-checkpoint", layers];
            assert_eq!(kind(&args), ErrorKind::InvalidValue, "{layers}");
        }
        assert_eq!(kind(&["--eot", "3"]), ErrorKind::MissingRequiredArgument);
        assert_eq!(
            kind(&["--memory", "auto"]),
            ErrorKind::MissingRequiredArgument
        );
        let both = [
            "--memory",
            "auto",
            "--gpu-memory",
            "8GiB",
            "--ffn-chunk",
            "4",
        ];
        assert_eq!(kind(&both), ErrorKind::ArgumentConflict);
        assert_eq!(kind(&["--help"]), ErrorKind::DisplayHelp);
    }
}
