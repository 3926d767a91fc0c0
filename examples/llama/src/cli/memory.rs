//! `llama_train`'s memory options: checkpoint placement, layers per checkpoint and host offload,
//! where the sharded optimizer's state lives and the buckets of its gradient sum, the loss and
//! feed-forward chunks, and the memory planner (`--plan`, `--memory auto`, `--gpu-memory`,
//! `--host-memory`).

use burn_distflash::layers::{CheckpointPlacement, Offload, RowChunks};
use clap::Args;

use super::values::{
    at_least_one, bytes, layers_per_checkpoint, offload, placement, MemoryMode, OptimizerState,
};
use crate::optimizer::{StatePlacement, DEFAULT_STATE_CHUNK_BYTES};

/// What one GPU holds: checkpoints, offload, chunks, and the planner's prediction.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Memory")]
pub struct MemoryArgs {
    /// Where each layer keeps what its backward needs: none (the autodiff graph keeps every
    /// activation), layer (its input: the backward recomputes the layer), attention-output (its
    /// input, attention's output and lse: attention's forward runs once); default: the
    /// configuration's
    #[arg(long, value_name = "PLACEMENT", value_parser = placement())]
    pub checkpoint: Option<CheckpointPlacement>,

    /// Layers per checkpoint: 1, or 2 with --checkpoint layer (each pair of layers keeps only
    /// its input: half the checkpoints on the GPU or in host memory, for one more forward of the
    /// pair's first layer without attention; a pair offloads when its first layer does; the same
    /// numbers) (default: the configuration's)
    #[arg(long, value_name = "1|2", value_parser = layers_per_checkpoint())]
    pub layers_per_checkpoint: Option<usize>,

    /// Checkpoints wait in host memory between forward and backward: off, all (every layer's),
    /// or N (all but the last N layers'); needs --checkpoint layer|attention-output (default:
    /// the configuration's)
    #[arg(long, value_name = "off|all|N", value_parser = offload)]
    pub offload: Option<Offload>,

    /// Groups of heads each layer's attention runs over one after another in the forward and
    /// backward, so that attention's per-head backward tensors (projections, f32 gradient
    /// accumulators, the sequence-parallel buffers) exist for one group at a time: a divisor of
    /// the key/value heads; memory and speed only (default: the configuration's, 1)
    #[arg(long, value_name = "N", value_parser = at_least_one())]
    pub attention_groups: Option<usize>,

    /// Where the sharded optimizer (--zero 1|2) keeps its f32 master weights and moments: gpu,
    /// or host (host memory, pinned on CUDA, streamed through the GPU in chunks of
    /// --optimizer-chunk at every step: bitwise the same steps, GPU memory for two chunks)
    /// (default: gpu, or beside --resume the checkpoint's)
    #[arg(long, value_enum, value_name = "gpu|host")]
    pub optimizer_state: Option<OptimizerState>,

    /// Bytes of optimizer state one chunk of the sharded optimizer holds (12 per parameter of
    /// the rank's share; the unit it updates, and --optimizer-state host brings to the GPU; at
    /// most 768MiB): bytes, or with a unit (512MiB, 1GiB) [default: 512MiB]
    #[arg(long, value_name = "BYTES", value_parser = bytes)]
    pub optimizer_chunk: Option<u64>,

    /// Bytes of f32 one bucket of the sharded optimizer's (--zero 1|2) gradient sum gathers,
    /// every GPU's range of it together (one collective's input): memory only, the steps'
    /// numbers do not change; at most 256MiB; bytes, or with a unit (64MiB, 1GiB) (default:
    /// 256MiB, or beside --resume the checkpoint's)
    #[arg(long, value_name = "BYTES", value_parser = bytes)]
    pub grad_bucket: Option<u64>,

    /// Tokens of a rank the output projection and the loss take at a time (default: as many as
    /// fit 1 GiB of their transient tensors)
    #[arg(long, value_name = "TOKENS", value_parser = at_least_one(), conflicts_with = "memory")]
    pub loss_chunk: Option<usize>,

    /// Tokens of a rank each feed-forward block takes at a time (default: as many as fit 1 GiB
    /// of their transient tensors)
    #[arg(long, value_name = "TOKENS", value_parser = at_least_one(), conflicts_with = "memory")]
    pub ffn_chunk: Option<usize>,

    /// How the loss and feed-forward chunks are chosen (default: --loss-chunk and --ffn-chunk);
    /// auto: the largest that fit 90% of --gpu-memory and, unless --offload is given, the
    /// fewest layers to offload with them (within the host's memory); with --checkpoint layer
    /// and no --layers-per-checkpoint, 2 layers per checkpoint where nothing fits with 1
    #[arg(long, value_enum, value_name = "MODE", requires = "gpu_memory")]
    pub memory: Option<MemoryMode>,

    /// The memory of one GPU, for --plan and --memory auto: bytes, or with a unit (139GiB,
    /// 141GB, 512MiB)
    #[arg(long, value_name = "BYTES", value_parser = bytes)]
    pub gpu_memory: Option<u64>,

    /// The host memory offloaded checkpoints may take on this host, shared by the GPUs it
    /// drives: bytes, or with a unit (250GiB) (default: what the host has available now)
    #[arg(long, value_name = "BYTES", value_parser = bytes)]
    pub host_memory: Option<u64>,

    /// Print the planner's prediction of one GPU's memory and of the host memory offloaded
    /// checkpoints take, for these options (with --gpu-memory also the longest sequence that
    /// fits them, what --memory auto picks and the longest sequence it trains), then exit
    /// without reading data or touching a device
    #[arg(long)]
    pub plan: bool,
}

impl MemoryArgs {
    /// `--loss-chunk` and `--ffn-chunk` as row chunks; `None` where absent.
    pub fn chunks(&self) -> (Option<RowChunks>, Option<RowChunks>) {
        let rows = |tokens: Option<usize>| tokens.and_then(|n| RowChunks::rows(n).ok());
        (rows(self.loss_chunk), rows(self.ffn_chunk))
    }

    /// `--optimizer-state` and `--optimizer-chunk` when either is given (the other one's
    /// default beside it).
    pub fn optimizer_state(&self) -> Option<(StatePlacement, u64)> {
        if self.optimizer_state.is_none() && self.optimizer_chunk.is_none() {
            return None;
        }
        let placement = self.optimizer_state.map_or(StatePlacement::Gpu, Into::into);
        Some((
            placement,
            self.optimizer_chunk.unwrap_or(DEFAULT_STATE_CHUNK_BYTES),
        ))
    }

    /// Whether `--memory auto` was given.
    pub fn auto(&self) -> bool {
        self.memory == Some(MemoryMode::Auto)
    }

    /// Whether the command line sets the chunks (beside `--resume` they replace the
    /// checkpoint's).
    pub fn chunks_given(&self) -> bool {
        self.auto() || self.loss_chunk.is_some() || self.ffn_chunk.is_some()
    }
}
