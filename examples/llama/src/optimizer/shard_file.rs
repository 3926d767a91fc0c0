//! One rank's file of a sharded optimizer checkpoint, `optimizer-rank{r}-of-{P}.safetensors`:
//! the rank's [`OptimizerShard`] as three F32 tensors `[n]` (`master`, `moment_1`, `moment_2`,
//! `n = ceil(parameters / P)`) and, in the safetensors `__metadata__`, what they belong to
//! ([`ShardHeader`]: the layout's fingerprint and sizes, world size, rank, ZeRO stage, the
//! optimizer's and the trainer's step counts). Opening a file checks it against its own header;
//! [`ShardSet`](super::ShardSet) checks a checkpoint's files against each other and the model.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, TensorData};

use super::flat::FlatLayout;
use super::optimizer_shard::OptimizerShard;
use super::zero_stage::ZeroStage;
use crate::safetensors::Checkpoint;
use crate::safetensors_streamed::{write_safetensors_streamed, PieceSink, StreamedTensor};
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

/// Where a shard file's vectors come from: `pieces(vector, sink)` hands vector `vector`'s
/// elements ([`ShardTensor::ALL`]'s order) to `sink` in consecutive f32 pieces.
pub type VectorPieces<'a> = Box<dyn Fn(usize, &mut PieceSink<'_>) -> Result<(), Error> + 'a>;

/// One rank's optimizer shard as a shard file holds it, its vectors read piece by piece as the
/// file is written: no whole vector is made in host memory (at long sequences the state is tens
/// of GiB, in host memory already, and the host may not hold a second copy of it).
pub struct ShardData<'a> {
    /// The layout of the model's parameters over the group.
    pub layout: FlatLayout,
    /// Optimizer steps taken.
    pub time: i32,
    /// The master weights and both moments, each `[shard_len]`.
    pub vectors: VectorPieces<'a>,
}

impl ShardData<'static> {
    /// `shard`'s vectors, each read from the device (in f32) when the file takes it.
    pub fn of<B: AutodiffBackend>(shard: OptimizerShard<B>) -> Self {
        let (layout, time) = (shard.layout.clone(), shard.time);
        let vectors: VectorPieces<'static> = Box::new(move |vector, sink| {
            let tensor = [&shard.master, &shard.moment_1, &shard.moment_2][vector];
            sink(tensor.clone().into_data().convert_dtype(DType::F32))
        });
        Self {
            layout,
            time,
            vectors,
        }
    }
}

/// A vector of `len` f32 elements made whole from the pieces `pieces` hands over, for callers
/// that want a whole vector (a state copied to the device, tests).
///
/// # Panics
///
/// When the pieces are not f32 or do not make up `len` elements (a caller's bug).
pub fn whole_vector(
    len: usize,
    pieces: impl FnOnce(&mut PieceSink<'_>) -> Result<(), Error>,
) -> TensorData {
    let mut bytes = Vec::with_capacity(len * 4);
    pieces(&mut |piece: TensorData| {
        assert_eq!(piece.dtype, DType::F32, "a state vector's piece");
        bytes.extend_from_slice(&piece.bytes);
        Ok(())
    })
    .expect("collecting pieces does not fail");
    assert_eq!(bytes.len(), len * 4, "a state vector's pieces");
    TensorData::from_bytes_vec(bytes, [len], DType::F32)
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
/// leaves no file under `path`), each vector piece by piece as `shard` reads it.
///
/// # Errors
///
/// As [`write_safetensors_streamed`]: a vector whose pieces do not make up `[shard_len]` f32
/// elements, a failed write.
pub fn write_shard_file(
    path: &Path,
    header: &ShardHeader,
    shard: ShardData<'_>,
) -> Result<(), Error> {
    let tensors: Vec<StreamedTensor> = ShardTensor::ALL
        .into_iter()
        .map(|t| StreamedTensor {
            name: t.name().to_string(),
            dtype: DType::F32,
            shape: vec![header.shard_len()],
        })
        .collect();
    write_safetensors_streamed(path, &tensors, header.to_metadata(), &mut |i, sink| {
        (shard.vectors)(i, sink)
    })
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
