//! [`ShardSet`]: the shard files of one sharded optimizer checkpoint, one per rank of the world
//! that wrote it, checked against each other and against a model, and read as the one flat
//! vector they split: any range of it, whatever world size reads it (re-sharding on load).
//!
//! The files hold the ranks' shares of a [`FlatLayout`] padded for the old world size; element
//! `i < parameters` lies in file `i / n` at `i % n` (`n = ceil(parameters / P)`), and elements
//! from `parameters` on are padding, zero in every vector (a padding element's gradient is
//! zero, so its master weight and moments stay zero through every AdamW step). A new world size
//! pads to its own multiple, so a read past `parameters` gives zeros: the values carried over
//! are exactly the stored f32 bits.

use std::path::Path;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};

use super::flat::FlatLayout;
use super::optimizer_shard::OptimizerShard;
use super::shard_file::{shard_file_name, ShardFile, ShardHeader, ShardTensor};
use crate::Error;

/// A checkpoint's shard files, in rank order (see the module's documentation).
pub struct ShardSet {
    files: Vec<ShardFile>,
}

impl ShardSet {
    /// Opens `dir`'s `world` shard files (`optimizer-rank{r}-of-{world}.safetensors`) and checks
    /// each against `layout`'s parameters (fingerprint, tensor and element counts; the layout's
    /// own world size does not matter) and against rank 0's file (stage and step counts).
    ///
    /// # Errors
    ///
    /// Naming the file: [`Error::NotFound`] for a missing shard; the errors of
    /// [`ShardFile::open`]; [`Error::Invalid`] for a file whose rank or world size is not the
    /// one its name gives, whose parameters are not `layout`'s (a shard of another model), or
    /// whose stage or step counts differ from rank 0's (files of different saves).
    pub fn open(dir: &Path, world: usize, layout: &FlatLayout) -> Result<Self, Error> {
        let mut files: Vec<ShardFile> = Vec::with_capacity(world);
        for rank in 0..world.max(1) {
            let path = dir.join(shard_file_name(rank, world));
            if !path.is_file() {
                return Err(Error::NotFound {
                    path,
                    expected: format!(
                        "the optimizer shard of rank {rank} of the {world} ranks that wrote the \
                         checkpoint"
                    ),
                });
            }
            let file = ShardFile::open(&path)?;
            let header = *file.header();
            let invalid = |what: &str, expected: String, got: String| Error::Invalid {
                path: Some(path.clone()),
                what: what.into(),
                expected,
                got,
            };
            if (header.rank, header.world) != (rank, world) {
                return Err(invalid(
                    "the shard's rank and world size",
                    format!("rank {rank} of {world}, as its file name says"),
                    format!("rank {} of {}", header.rank, header.world),
                ));
            }
            let theirs = (header.fingerprint, header.tensors, header.parameters);
            let ours = (layout.fingerprint(), layout.num_tensors(), layout.len());
            if theirs != ours {
                return Err(invalid(
                    "the optimizer shard's parameters",
                    format!("the model's: {}", layout.describe()),
                    format!(
                        "{} tensors, {} elements, layout fingerprint {:#018x} (a shard of \
                         another model)",
                        header.tensors, header.parameters, header.fingerprint
                    ),
                ));
            }
            if let Some(first) = files.first() {
                let first = first.header();
                let steps = |h: &ShardHeader| (h.stage, h.optimizer_step, h.trainer_step);
                if steps(&header) != steps(first) {
                    return Err(invalid(
                        "the shard's ZeRO stage and step counts",
                        format!(
                            "those of rank 0's shard: stage {}, optimizer step {}, trainer step \
                             {} (the files of one save)",
                            first.stage, first.optimizer_step, first.trainer_step
                        ),
                        format!(
                            "stage {}, optimizer step {}, trainer step {}",
                            header.stage, header.optimizer_step, header.trainer_step
                        ),
                    ));
                }
            }
            files.push(file);
        }
        Ok(Self { files })
    }

    /// Rank 0's header (every file's agrees with it but for the rank).
    pub fn header(&self) -> &ShardHeader {
        self.files[0].header()
    }

    /// Rank 0's file, which errors about the whole set name.
    pub fn first_path(&self) -> &Path {
        self.files[0].path()
    }

    /// Elements `start .. start + len` of the flat vector `tensor` the files split; zeros from
    /// `parameters` on (the padding of any world size).
    pub fn read(&self, tensor: ShardTensor, start: usize, len: usize) -> Vec<f32> {
        let header = self.header();
        let n = header.shard_len();
        let end = (start + len).min(header.parameters);
        let mut values = Vec::with_capacity(len);
        let mut i = start;
        while i < end {
            let (file, offset) = (i / n, i % n);
            let run = (n - offset).min(end - i);
            values.extend(self.files[file].values(tensor, offset..offset + run));
            i += run;
        }
        values.resize(len, 0.0);
        values
    }

    /// Rank `rank`'s share of `layout` (a layout of this set's model over any world size) as
    /// an optimizer shard on `device`: its ranges of the master weights and moments, in f32,
    /// and the optimizer's step count.
    pub fn shard<B: AutodiffBackend>(
        &self,
        layout: FlatLayout,
        rank: usize,
        device: &B::Device,
    ) -> OptimizerShard<B> {
        let n = layout.shard_len();
        let vector = |tensor| {
            let data = TensorData::new(self.read(tensor, rank * n, n), [n]);
            Tensor::<B::InnerBackend, 1>::from_data(data, (device, DType::F32))
        };
        OptimizerShard {
            master: vector(ShardTensor::Master),
            moment_1: vector(ShardTensor::Moment1),
            moment_2: vector(ShardTensor::Moment2),
            time: self.header().optimizer_step,
            layout,
        }
    }
}
