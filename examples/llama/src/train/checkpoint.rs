//! A [`Trainer`]'s checkpoints. A checkpoint directory holds:
//!
//! - `model.bin`: the model (Burn's full-precision recorder: every weight widened to f32);
//! - `optimizer.bin`: the replicated optimizer's state (ZeRO stage 0), Burn's `AdamWState`;
//! - `optimizer-rank{r}-of-{P}.safetensors`, one per rank under ZeRO stages 1 and 2: the rank's
//!   f32 master weights and moments, with the layout's fingerprint, world size, rank, stage and
//!   step counts (see [`ShardFile`](crate::optimizer::ShardFile));
//! - `trainer.json`: the step, the options, and the number of shard files.
//!
//! A save writes everything into a staging sibling of the directory, then renames it into place
//! once every rank's part is written ([`StagedDir`]): the directory holds one whole checkpoint
//! or the previous one, never a mix. A resume reads only: it checks the whole checkpoint
//! against the model before it loads anything, and re-shards the sharded state when the world
//! size has changed ([`ShardSet`]).

use std::path::Path;

use burn::config::Config;
use burn::module::Module;
use burn::optim::Optimizer;
use burn::record::{BinFileRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::Backend;

use super::options_defaults::with_option_defaults;
use super::{replicated_adamw, sharded_adamw, StepOptimizer, TrainBackend, TrainOptions, Trainer};
use crate::byte_units::format_bytes;
use crate::disk_space;
use crate::optimizer::{
    shard_file_name, write_shard_file, FlatLayout, ShardHeader, ShardSet, StatePlacement,
};
use crate::staged_dir::StagedDir;
use crate::Error;

/// The file of the trainer's step and options inside a checkpoint directory.
pub(super) const TRAINER_FILE: &str = "trainer.json";

/// The model's file inside a checkpoint directory (Burn's recorder adds `.bin`).
const MODEL_FILE: &str = "model";

/// The replicated optimizer's file inside a checkpoint directory (Burn's recorder adds `.bin`).
const OPTIMIZER_FILE: &str = "optimizer";

/// What a checkpoint records besides the weights and the optimizer.
#[derive(Config, Debug)]
pub struct TrainerState {
    /// Steps done.
    pub step: u64,
    /// The options the run used.
    pub options: TrainOptions,
    /// Under ZeRO stages 1 and 2, the number of optimizer shard files: the world size of the
    /// run that saved. Absent for the replicated optimizer, and in checkpoints of sharded runs
    /// written before the sharded state was saved (which cannot be resumed).
    pub optimizer_shards: Option<usize>,
}

/// Reads `dir`'s `trainer.json`.
///
/// # Errors
///
/// [`Error::NotFound`] when there is none (naming what an interrupted save left beside `dir`,
/// if anything); [`Error::Checkpoint`] when it cannot be read. Options written before a
/// defaulted field existed read as that field's default.
pub(super) fn read_state(dir: &Path) -> Result<TrainerState, Error> {
    let path = dir.join(TRAINER_FILE);
    if !path.is_file() {
        let leftovers = StagedDir::leftovers(dir);
        let mut expected = format!("the {TRAINER_FILE} of a checkpoint that Trainer::save wrote");
        if !leftovers.is_empty() {
            let names: Vec<String> = leftovers.iter().map(|p| p.display().to_string()).collect();
            expected.push_str(&format!(
                "; a save was interrupted while it replaced the directory: {} holds the \
                 previous (.old) or the new (.partial) checkpoint",
                names.join(" and ")
            ));
        }
        return Err(Error::NotFound { path, expected });
    }
    let text =
        std::fs::read_to_string(&path).map_err(checkpoint_error("read trainer.json", dir))?;
    TrainerState::load_binary(with_option_defaults(&text).as_bytes())
        .map_err(checkpoint_error("read trainer.json", dir))
}

/// Opens the shard files a sharded checkpoint's `state` records in `dir`, checked against the
/// model's `layout` and against `state`'s stage and step.
pub(super) fn open_shards(
    dir: &Path,
    state: &TrainerState,
    layout: &FlatLayout,
) -> Result<ShardSet, Error> {
    let Some(world) = state.optimizer_shards else {
        return Err(Error::Unsupported {
            path: Some(dir.join(TRAINER_FILE)),
            what: "the sharded optimizer's state of the checkpoint".into(),
            expected: "checkpoints whose trainer.json records `optimizer_shards` (the sharded \
                       optimizer's files)"
                .into(),
            got: format!(
                "a ZeRO stage {} checkpoint written without them: it holds the model only",
                state.options.zero
            ),
        });
    };
    let shards = ShardSet::open(dir, world, layout)?;
    let header = shards.header();
    if (header.stage, header.trainer_step) != (state.options.zero, state.step) {
        return Err(Error::Invalid {
            path: Some(shards.first_path().to_path_buf()),
            what: "the shard's ZeRO stage and trainer step".into(),
            expected: format!(
                "those of {TRAINER_FILE}: stage {}, step {}",
                state.options.zero, state.step
            ),
            got: format!("stage {}, step {}", header.stage, header.trainer_step),
        });
    }
    Ok(shards)
}

impl<B: TrainBackend> Trainer<B> {
    /// Writes the model, the optimizer state and the step to `dir` (see the module's
    /// documentation for the files), replacing any checkpoint there only once the new one is
    /// whole. Every rank of the group calls it: under the replicated optimizer rank 0 writes
    /// everything (the other ranks hold the same state and return at once); under a sharded one
    /// each rank writes its shard, and the ranks wait for each other so that every rank
    /// returns the same outcome. `dir` must then be on a filesystem every rank writes to.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] before anything is written when the filesystem lacks the
    /// [`checkpoint_bytes`](Self::checkpoint_bytes); [`Error::Io`] or [`Error::Checkpoint`] when
    /// a file cannot be written (on every rank, naming the rank that failed), [`Error::Comm`]
    /// when the ranks cannot agree. The previous checkpoint in `dir`, if any, is kept then.
    pub fn save(&self, dir: &Path) -> Result<(), Error> {
        let (rank, world) = self.rank();
        let sharded = matches!(self.optim, StepOptimizer::Sharded(_));
        if rank != 0 && !sharded {
            return Ok(());
        }
        let staged = StagedDir::new(dir)?;
        let leader = |result: &dyn Fn(&StagedDir) -> Result<(), Error>| match rank {
            0 => result(&staged),
            _ => Ok(()),
        };
        let needed = self.checkpoint_bytes();
        let prepared = leader(&|s| {
            s.prepare()?;
            disk_space::check_room(s.staging(), needed)
        });
        self.agree(prepared, "prepare the checkpoint", dir)?;
        let written = self.write_parts(staged.staging(), rank, world);
        self.agree(written, "write the checkpoint", dir)?;
        let committed = leader(&|s| check_shards(s.staging()).and_then(|()| s.commit()));
        self.agree(committed, "move the checkpoint into place", dir)
    }

    /// Bytes a [`save`](Self::save) writes ([`disk_space::checkpoint_bytes`]): the model in f32
    /// and the optimizer's state, every rank's shard under ZeRO 1/2.
    pub fn checkpoint_bytes(&self) -> u64 {
        let (_, world) = self.rank();
        let sharded = matches!(self.optim, StepOptimizer::Sharded(_));
        disk_space::checkpoint_bytes(self.model.num_params() as u64, world, sharded)
    }

    /// Writes this rank's parts of the checkpoint into `staging`: its optimizer shard, and on
    /// rank 0 the model, the replicated optimizer and `trainer.json`.
    fn write_parts(&self, staging: &Path, rank: usize, world: usize) -> Result<(), Error> {
        if let StepOptimizer::Sharded(optim) = &self.optim {
            let shard = optim.shard_data(&self.model);
            let header = ShardHeader::of(&shard, rank, self.options.zero, self.step);
            write_shard_file(&staging.join(shard_file_name(rank, world)), &header, shard)?;
        }
        if rank != 0 {
            return Ok(());
        }
        let parameters = self.model.num_params() as u64;
        let available = burn_distflash::offload::host_memory_available();
        check_host_room_for_model(parameters, available).map_err(|why| Error::Invalid {
            path: Some(staging.to_path_buf()),
            what: "the host memory to write the model file".into(),
            expected: why.needed,
            got: why.available,
        })?;
        let recorder = BinFileRecorder::<FullPrecisionSettings>::new();
        self.model
            .clone()
            .save_file(staging.join(MODEL_FILE), &recorder)
            .map_err(checkpoint_error("write the model", staging))?;
        let shards = match &self.optim {
            StepOptimizer::Replicated(optim) => {
                recorder
                    .record(optim.to_record(), staging.join(OPTIMIZER_FILE))
                    .map_err(checkpoint_error("write the optimizer state", staging))?;
                None
            }
            StepOptimizer::Sharded(_) => Some(world),
        };
        let state = TrainerState {
            step: self.step,
            options: self.options.clone(),
            optimizer_shards: shards,
        };
        let path = staging.join(TRAINER_FILE);
        state
            .save(&path)
            .map_err(Error::io("write the trainer state", &path))
    }

    /// This rank's `mine`, once every rank of a sharded optimizer's group has reached this
    /// point: an error when any rank's failed (this rank's own, or one naming the rank).
    fn agree(
        &self,
        mine: Result<(), Error>,
        action: &'static str,
        dir: &Path,
    ) -> Result<(), Error> {
        let group = match &self.optim {
            StepOptimizer::Sharded(_) => super::group_of(&self.context),
            StepOptimizer::Replicated(_) => None,
        };
        let Some(group) = group else {
            return mine;
        };
        let flags = group
            .all_gather_values(&[u64::from(mine.is_ok())])
            .map_err(|source| Error::Comm {
                what: "the ranks' checkpoint progress",
                source,
            })?;
        mine?;
        match flags.iter().position(|flag| flag[0] == 0) {
            None => Ok(()),
            Some(peer) => Err(Error::Checkpoint {
                action,
                dir: dir.to_path_buf(),
                source: format!("rank {peer} failed (its own error says why)").into(),
            }),
        }
    }

    /// Restores a checkpoint written by [`save`](Self::save) into this trainer (built with the
    /// same model configuration and float type); training then continues where it stopped,
    /// with the checkpoint's options (its ZeRO stage included). Every rank of the group calls
    /// it. At the world size that saved, the next step is bitwise the uninterrupted run's.
    /// A sharded optimizer's state may be resumed at another world size: each rank reads its
    /// new range of the flat layout from the old shards, the f32 values exactly as stored.
    ///
    /// # Errors
    ///
    /// Naming the file, before anything is loaded: [`Error::NotFound`] for a missing
    /// `trainer.json` or shard file, the errors of [`ShardSet::open`] (shards of another model,
    /// of another rank or world, of another save, truncated or corrupt files),
    /// [`Error::Unsupported`] for a sharded checkpoint written without its optimizer state;
    /// [`Error::Checkpoint`] when Burn's recorder cannot read the model or the replicated
    /// optimizer. The checkpoint is only read.
    pub fn resume(self, dir: &Path) -> Result<Self, Error> {
        self.resume_with_state_at(dir, None)
    }

    /// [`resume`](Self::resume), a sharded optimizer's state then kept at `placement` (with
    /// chunks of that many bytes) instead of the checkpoint's placement where given: the state is
    /// read straight into that placement (into host memory chunk by chunk, never whole on the
    /// device), and the next checkpoint records it. The files are the same either way: a run
    /// whose state was on the device resumes with it in host memory and the other way round.
    ///
    /// # Errors
    ///
    /// As [`resume`](Self::resume), and those of
    /// [`ShardedAdamW::load`](crate::optimizer::ShardedAdamW::load).
    pub fn resume_with_state_at(
        mut self,
        dir: &Path,
        placement: Option<(StatePlacement, u64)>,
    ) -> Result<Self, Error> {
        let mut state = read_state(dir)?;
        if let Some((placement, chunk_bytes)) = placement {
            state.options.optimizer_state = placement;
            state.options.state_chunk_bytes = chunk_bytes;
        }
        let (_, world) = self.rank();
        let shards = match state.options.zero.is_sharded() {
            true => Some(open_shards(
                dir,
                &state,
                &FlatLayout::of::<B, _>(&self.model, world),
            )?),
            false => None,
        };
        let device = self.device();
        self.model = read_model(self.model, dir, &device)?;
        self.optim = match shards {
            None => {
                let record = BinFileRecorder::<FullPrecisionSettings>::new()
                    .load(dir.join(OPTIMIZER_FILE), &device)
                    .map_err(checkpoint_error("read the optimizer state", dir))?;
                StepOptimizer::Replicated(replicated_adamw(&state.options).load_record(record))
            }
            Some(shards) => {
                // The layout of the loaded model: its parameter ids are the checkpoint's.
                let layout = FlatLayout::of::<B, _>(&self.model, world);
                let mut optim = sharded_adamw(&state.options, &self.context);
                optim.load(&shards, layout, &device)?;
                StepOptimizer::Sharded(optim)
            }
        };
        self.step = state.step;
        self.model = (self.model).with_chunks(state.options.loss_chunks, state.options.ffn_chunks);
        self.options = state.options;
        Ok(self)
    }
}

/// `model` with the weights of the checkpoint in `dir` (its `model.bin`), on `device`.
///
/// # Errors
///
/// [`Error::Checkpoint`] naming `dir` when Burn's recorder cannot read the file or its
/// parameters do not fit `model`.
pub(super) fn read_model<B: Backend, M: Module<B>>(
    model: M,
    dir: &Path,
    device: &B::Device,
) -> Result<M, Error> {
    model
        .load_file(
            dir.join(MODEL_FILE),
            &BinFileRecorder::<FullPrecisionSettings>::new(),
            device,
        )
        .map_err(checkpoint_error("read the model", dir))
}

/// Refuses a staged sharded checkpoint that lacks a rank's shard (a rank whose filesystem is
/// not the leader's writes where the leader cannot see it).
fn check_shards(staging: &Path) -> Result<(), Error> {
    let world = read_state(staging)?.optimizer_shards.unwrap_or(0);
    for rank in 0..world {
        let path = staging.join(shard_file_name(rank, world));
        if !path.is_file() {
            return Err(Error::NotFound {
                path,
                expected: format!(
                    "rank {rank}'s optimizer shard, written before the checkpoint is moved into \
                     place: the checkpoint directory must be on a filesystem every rank shares"
                ),
            });
        }
    }
    Ok(())
}

/// An [`Error::Checkpoint`] for a failure of Burn's recorder or config files in `dir`.
/// What the model file's record needs of host memory and what the host has, where it is short.
#[derive(Debug)]
struct HostShort {
    needed: String,
    available: String,
}

/// Whether the host can hold the model file's record: Burn's full-precision recorder widens
/// every weight to f32 and holds them all before writing (`4 x parameters` bytes), and the
/// offload's [`HEADROOM`](burn_distflash::offload::HEADROOM) stays free. A host filled by
/// offloaded checkpoints and an optimizer state in host memory then ends the save with an error
/// instead of the out-of-memory killer; `available` `None` (not Linux) accepts.
fn check_host_room_for_model(parameters: u64, available: Option<u64>) -> Result<(), HostShort> {
    let needed = 4 * parameters;
    let headroom = burn_distflash::offload::HEADROOM;
    match available {
        Some(available) if needed + headroom > available => Err(HostShort {
            needed: format!(
                "{} for the weights in f32 ({parameters} parameters) and {} left to the machine",
                format_bytes(needed),
                format_bytes(headroom)
            ),
            available: format!(
                "{} available (MemAvailable); free host memory, or keep the optimizer state on \
                 the device (--optimizer-state gpu) or fewer checkpoints in host memory",
                format_bytes(available)
            ),
        }),
        _ => Ok(()),
    }
}

pub(super) fn checkpoint_error<'a, E: std::error::Error + Send + Sync + 'static>(
    action: &'static str,
    dir: &'a Path,
) -> impl FnOnce(E) -> Error + 'a {
    move |e| Error::Checkpoint {
        action,
        dir: dir.to_path_buf(),
        source: Box::new(e),
    }
}

#[cfg(test)]
mod tests {
    use super::check_host_room_for_model;

    #[test]
    fn the_model_file_is_refused_where_the_host_cannot_hold_its_f32_record() {
        let gib = 1u64 << 30;
        // 1 GiB of parameters: 4 GiB in f32, and 2 GiB of headroom.
        let parameters = gib;
        assert!(check_host_room_for_model(parameters, Some(6 * gib)).is_ok());
        assert!(check_host_room_for_model(parameters, None).is_ok());
        let short = check_host_room_for_model(parameters, Some(6 * gib - 1)).unwrap_err();
        assert!(
            short.needed.contains("4.00 GiB for the weights in f32"),
            "{short:?}"
        );
        assert!(
            short.available.contains("available (MemAvailable)"),
            "{short:?}"
        );
    }
}
