//! `llama_train`'s device options: the backend, the GPUs of one process or one process per GPU
//! (`--env`, torchrun-style, its variables also given as options), the element type and the
//! sequence-parallel schedule.

use burn_distflash::collective::nccl::{EnvConfig, RENDEZVOUS_PORT_VAR};
use clap::Args;
use std::time::Duration;

use super::values::{at_least_one, BackendKind, Dtype, Schedule};

/// Where a run computes.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Devices")]
pub struct DeviceArgs {
    /// The backend
    #[arg(long, value_enum, value_name = "BACKEND", default_value_t = BackendKind::Ndarray)]
    pub backend: BackendKind,

    /// CUDA GPUs this process drives, one thread each, the sequence split across them
    #[arg(long, value_name = "N", value_parser = at_least_one(), default_value_t = 1)]
    pub gpus: usize,

    /// One process per GPU, on one host or many: this process is one rank of the group the
    /// options below (or torchrun's environment) describe
    #[arg(long)]
    pub env: bool,

    /// The element type on CUDA (the CPU and wgpu train in f32)
    #[arg(long, value_enum, value_name = "DTYPE", default_value_t = Dtype::Bf16)]
    pub dtype: Dtype,

    /// The sequence-parallel schedule across GPUs
    #[arg(long, value_enum, value_name = "SCHEDULE", default_value_t = Schedule::Auto)]
    pub schedule: Schedule,

    /// Seconds a rank waits for its peers (the rendezvous, an exchange, a gradient sum) before
    /// the run stops with an error naming the rank it waited for
    #[arg(long, value_name = "SECONDS", value_parser = at_least_one(), default_value_t = 300)]
    pub group_timeout: usize,

    /// This process's place in a group of processes (`--env`).
    #[command(flatten)]
    pub processes: ProcessArgs,
}

impl DeviceArgs {
    /// How long a rank waits for its peers (`--group-timeout`).
    pub fn group_timeout(&self) -> Duration {
        Duration::from_secs(self.group_timeout as u64)
    }
}

/// This process's place in a group of one process per GPU (`--env`), as torchrun's
/// environment gives it; each option falls back to its variable.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Processes (with --env)")]
pub struct ProcessArgs {
    /// This process's rank, in 0..WORLD_SIZE
    #[arg(long, value_name = "RANK", env = "RANK")]
    pub rank: Option<String>,

    /// The number of processes
    #[arg(long, value_name = "N", env = "WORLD_SIZE")]
    pub world_size: Option<String>,

    /// The CUDA device this process computes on
    #[arg(long, value_name = "ORDINAL", env = "LOCAL_RANK")]
    pub local_rank: Option<String>,

    /// The host of rank 0, which hands out the NCCL id
    #[arg(long, value_name = "HOST", env = "MASTER_ADDR")]
    pub master_addr: Option<String>,

    /// The TCP port rank 0 listens on
    #[arg(long, value_name = "PORT", env = "MASTER_PORT")]
    pub master_port: Option<String>,

    /// A port that replaces --master-port for the NCCL id (under torchrun, whose own store
    /// listens on MASTER_PORT)
    #[arg(long, value_name = "PORT", env = RENDEZVOUS_PORT_VAR)]
    pub rendezvous_port: Option<String>,
}

impl ProcessArgs {
    /// The option ids, for telling a value given on the command line from one read from the
    /// environment.
    pub const IDS: [&'static str; 6] = [
        "rank",
        "world_size",
        "local_rank",
        "master_addr",
        "master_port",
        "rendezvous_port",
    ];

    /// The group these values describe, checked as the plugin checks torchrun's environment
    /// (the messages name the variables).
    ///
    /// # Errors
    ///
    /// The plugin's `Error::GroupSetup` naming the value that is missing or out of range.
    pub fn group(&self) -> Result<EnvConfig, burn_distflash::Error> {
        EnvConfig::from_lookup(|name| match name {
            "RANK" => self.rank.clone(),
            "WORLD_SIZE" => self.world_size.clone(),
            "LOCAL_RANK" => self.local_rank.clone(),
            "MASTER_ADDR" => self.master_addr.clone(),
            "MASTER_PORT" => self.master_port.clone(),
            RENDEZVOUS_PORT_VAR => self.rendezvous_port.clone(),
            _ => None,
        })
    }
}
