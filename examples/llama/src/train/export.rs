//! [`export_weights`]: a checkpoint's weights merged into one Hugging Face Llama directory
//! (`config.json` + `model.safetensors`), which `--weights` and
//! [`load_hf_llama`](crate::weights::load_hf_llama) load.
//!
//! Under ZeRO stages 1 and 2 the f32 master weights are the truth (the working weights are their
//! rounding to the weights' float type), so they are exported, in F32, read from every rank's
//! shard file. Under the replicated optimizer the model's own weights are, exported in their
//! own float type (F32 when the parameters mix types): nothing is rounded either way.

use std::path::Path;

use burn::tensor::{DType, TensorData};

use super::checkpoint::{open_shards, read_model, read_state};
use super::TrainBackend;
use crate::config::LlamaConfig;
use crate::model::Llama;
use crate::optimizer::{FlatLayout, ShardTensor};
use crate::weights::{save_hf_llama, save_hf_llama_values};
use crate::Error;

/// Writes the weights of the checkpoint in `checkpoint` (written by
/// [`Trainer::save`](super::Trainer::save)) to the Hugging Face model directory `out` (see the
/// module's documentation for the float type). `model` is a model of `config` with the float
/// type of the run that saved (the trainer's own model does); its weights are not used. `out`
/// is created if needed; its `config.json` and `model.safetensors` are replaced.
///
/// # Errors
///
/// Those of [`Trainer::resume`](super::Trainer::resume) for the checkpoint's files, and those
/// of [`save_hf_llama`] for `config` and `out`.
pub fn export_weights<B: TrainBackend>(
    model: &Llama<B>,
    config: &LlamaConfig,
    checkpoint: &Path,
    out: &Path,
) -> Result<(), Error> {
    let state = read_state(checkpoint)?;
    if !state.options.zero.is_sharded() {
        let device = model.embedding.weight.val().device();
        let model = read_model(model.clone(), checkpoint, &device)?;
        let dtype = FlatLayout::of::<B, _>(&model, 1).wire_dtype();
        return save_hf_llama(&model, config, out, dtype);
    }
    let layout = FlatLayout::of::<B, _>(model, 1);
    let shards = open_shards(checkpoint, &state, &layout)?;
    save_hf_llama_values(model, config, out, DType::F32, |id, shape| {
        let (offset, _) = layout.place(id).ok_or_else(|| {
            Error::invalid(
                "a parameter of the model to export",
                "one of the model's float parameters",
                format!("{id:?}"),
            )
        })?;
        let len = shape.iter().product();
        let values = shards.read(ShardTensor::Master, offset, len);
        Ok(TensorData::new(values, shape.to_vec()))
    })
}
