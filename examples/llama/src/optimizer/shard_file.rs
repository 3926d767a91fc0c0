//! One rank's file of a sharded optimizer checkpoint, `optimizer-rank{r}-of-{P}.safetensors`:
//! the rank's [`OptimizerShard`] as three F32 tensors `[n]` (`master`, `moment_1`, `moment_2`,
//! `n = ceil(parameters / P)`) and, in the safetensors `__metadata__`, what they belong to
//! ([`ShardHeader`]: the layout's fingerprint and sizes, world size, rank, ZeRO stage, the
//! optimizer's and the trainer's step counts). Opening a file checks it against its own header;
//! [`ShardSet`](super::ShardSet) checks a checkpoint's files against each other and the model.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};

use super::flat::FlatLayout;
use super::optimizer_shard::OptimizerShard;
use super::zero_stage::ZeroStage;
use crate::safetensors::{write_safetensors_with_metadata, Checkpoint};
use crate::Error;

/// The `format` this crate writes in a shard file's `__metadata__` (safetensors readers that
/// expect a model see that it is not one).
const FORMAT: &str = "distflash-optimizer-shard";

/// One of the three vectors a shard file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardTensor {
    /// The f32 master weights.
    Master,
    /// AdamW's first moment.
    Moment1,
    /// AdamW's second moment.
    Moment2,
}

impl ShardTensor {
    /// All three, in the order of [`OptimizerShard`]'s fields.
    pub const ALL: [Self; 3] = [Self::Master, Self::Moment1, Self::Moment2];

    /// The tensor's name in the file.
    pub fn name(self) -> &'static str {
        match self {
            Self::Master => "master",
            Self::Moment1 => "moment_1",
            Self::Moment2 => "moment_2",
        }
    }
}

/// One rank's optimizer shard read into host memory, as a shard file holds it.
#[derive(Debug, Clone)]
pub struct ShardData {
    /// The layout of the model's parameters over the group.
    pub layout: FlatLayout,
    /// Optimizer steps taken.
    pub time: i32,
    /// The master weights and both moments, in [`ShardTensor::ALL`]'s order, `[shard_len]`.
    pub vectors: [TensorData; 3],
}

impl ShardData {
    /// `shard`'s vectors read from the device, in f32.
    pub fn of<B: AutodiffBackend>(shard: &OptimizerShard<B>) -> Self {
        let read = |t: &Tensor<B::InnerBackend, 1>| t.clone().into_data().convert_dtype(DType::F32);
        Self {
            layout: shard.layout.clone(),
            time: shard.time,
            vectors: [&shard.master, &shard.moment_1, &shard.moment_2].map(read),
        }
    }
}

/// What a shard file records about its vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardHeader {
    /// [`FlatLayout::fingerprint`](super::FlatLayout::fingerprint) of the model's parameters.
    pub fingerprint: u64,
    /// Number of parameter tensors.
    pub tensors: usize,
    /// Number of parameter elements (padding excluded).
    pub parameters: usize,
    /// World size of the group that wrote the checkpoint (the number of shard files).
    pub world: usize,
    /// This file's rank.
    pub rank: usize,
    /// ZeRO stage of the run (1 or 2).
    pub stage: ZeroStage,
    /// Optimizer steps the moments hold.
    pub optimizer_step: i32,
    /// The trainer's step when the checkpoint was written.
    pub trainer_step: u64,
}

impl ShardHeader {
    /// The header of rank `rank`'s `shard` (its world size is its layout's) of a run at
    /// `stage`, written at trainer step `trainer_step`.
    pub fn of(shard: &ShardData, rank: usize, stage: ZeroStage, trainer_step: u64) -> Self {
        Self {
            fingerprint: shard.layout.fingerprint(),
            tensors: shard.layout.num_tensors(),
            parameters: shard.layout.len(),
            world: shard.layout.world(),
            rank,
            stage,
            optimizer_step: shard.time,
            trainer_step,
        }
    }

    /// Elements of each vector: `ceil(parameters / world)`.
    pub fn shard_len(&self) -> usize {
        self.parameters.div_ceil(self.world.max(1))
    }

    /// The `__metadata__` entries.
    fn to_metadata(self) -> HashMap<String, String> {
        [
            ("format", FORMAT.to_string()),
            ("layout_fingerprint", format!("{:#018x}", self.fingerprint)),
            ("parameter_tensors", self.tensors.to_string()),
            ("parameters", self.parameters.to_string()),
            ("world_size", self.world.to_string()),
            ("rank", self.rank.to_string()),
            ("zero_stage", self.stage.to_string()),
            ("optimizer_step", self.optimizer_step.to_string()),
            ("trainer_step", self.trainer_step.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// The header in `metadata`, the `__metadata__` of the file at `path`.
    fn from_metadata(path: &Path, metadata: &HashMap<String, String>) -> Result<Self, Error> {
        let field = |key: &str| {
            metadata.get(key).ok_or_else(|| Error::MissingField {
                path: path.to_path_buf(),
                field: format!("__metadata__.{key}"),
            })
        };
        let format = field("format")?;
        if format != FORMAT {
            return Err(Error::Invalid {
                path: Some(path.to_path_buf()),
                what: "the file's `__metadata__.format`".into(),
                expected: format!("\"{FORMAT}\" (an optimizer shard this crate wrote)"),
                got: format!("{format:?}"),
            });
        }
        fn parse<T: FromStr>(path: &Path, key: &str, text: &str) -> Result<T, Error> {
            text.parse().map_err(|_| Error::Invalid {
                path: Some(path.to_path_buf()),
                what: format!("`__metadata__.{key}`"),
                expected: "a whole number".into(),
                got: format!("{text:?}"),
            })
        }
        let number = |key: &str| -> Result<usize, Error> { parse(path, key, field(key)?) };
        let fingerprint = field("layout_fingerprint")?;
        let hex = fingerprint.strip_prefix("0x").unwrap_or(fingerprint);
        let stage = field("zero_stage")?;
        Ok(Self {
            fingerprint: u64::from_str_radix(hex, 16).map_err(|_| Error::Invalid {
                path: Some(path.to_path_buf()),
                what: "`__metadata__.layout_fingerprint`".into(),
                expected: "a hexadecimal number".into(),
                got: format!("{fingerprint:?}"),
            })?,
            tensors: number("parameter_tensors")?,
            parameters: number("parameters")?,
            world: number("world_size")?,
            rank: number("rank")?,
            stage: stage.parse().map_err(|e| Error::Invalid {
                path: Some(path.to_path_buf()),
                what: "`__metadata__.zero_stage`".into(),
                expected: format!("1 or 2 ({e})"),
                got: format!("{stage:?}"),
            })?,
            optimizer_step: parse(path, "optimizer_step", field("optimizer_step")?)?,
            trainer_step: parse(path, "trainer_step", field("trainer_step")?)?,
        })
    }
}

/// The file name of rank `rank`'s shard of a world of `world`.
pub fn shard_file_name(rank: usize, world: usize) -> String {
    format!("optimizer-rank{rank}-of-{world}.safetensors")
}

/// Writes `shard` with `header` to `path` (through a temporary name: an interrupted write
/// leaves no file under `path`).
pub fn write_shard_file(path: &Path, header: &ShardHeader, shard: ShardData) -> Result<(), Error> {
    let tensors: BTreeMap<String, _> = (ShardTensor::ALL.into_iter())
        .zip(shard.vectors)
        .map(|(t, data)| (t.name().to_string(), data))
        .collect();
    write_safetensors_with_metadata(path, &tensors, header.to_metadata())
}

/// One shard file, mapped, its header read and its three vectors checked against it.
pub struct ShardFile {
    path: PathBuf,
    header: ShardHeader,
    file: Checkpoint,
}

impl ShardFile {
    /// Maps and checks the file at `path`.
    ///
    /// # Errors
    ///
    /// Naming the file: [`Error::Io`] when it cannot be read, [`Error::Format`] when it is not
    /// a whole safetensors file (truncated, corrupt), [`Error::MissingField`] or
    /// [`Error::Invalid`] when its metadata is not a shard's, [`Error::Invalid`] when a vector
    /// is missing, not F32 or not `[ceil(parameters / world)]`.
    pub fn open(path: &Path) -> Result<Self, Error> {
        let file = Checkpoint::open_file(path)?;
        let no_metadata = HashMap::new();
        let metadata = (file.names().next())
            .and_then(|name| file.metadata_of(name))
            .unwrap_or(&no_metadata);
        let header = ShardHeader::from_metadata(path, metadata)?;
        let n = header.shard_len();
        for tensor in ShardTensor::ALL {
            let stored = file.get(tensor.name());
            let found = stored.map(|s| (s.dtype, s.shape.to_vec()));
            if found != Some((DType::F32, vec![n])) {
                return Err(Error::Invalid {
                    path: Some(path.to_path_buf()),
                    what: format!("tensor `{}`", tensor.name()),
                    expected: format!(
                        "F32 of shape [{n}] (ceil({} parameters / {} ranks))",
                        header.parameters, header.world
                    ),
                    got: found.map_or("absent".into(), |(d, s)| format!("{d:?} of shape {s:?}")),
                });
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            header,
            file,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What the file records about its vectors.
    pub fn header(&self) -> &ShardHeader {
        &self.header
    }

    /// Elements `range` of one of the file's vectors (a range within `[0, shard_len)`).
    pub fn values(&self, tensor: ShardTensor, range: Range<usize>) -> Vec<f32> {
        // Present, F32 and `[shard_len]`: checked in `open`.
        let bytes = self.file.get(tensor.name()).map_or(&[][..], |s| s.bytes);
        bytes[range.start * 4..range.end * 4]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }
}
