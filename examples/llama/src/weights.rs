//! Loading and saving [`Llama`] models in the Hugging Face layout: a directory with
//! `config.json` and `model.safetensors` (or sharded safetensors with an index), tensors named as
//! `transformers`' `LlamaForCausalLM` names them.
//!
//! Hugging Face stores a linear layer's weight as `[out, in]`; Burn's [`Linear`] stores
//! `[in, out]`, so every projection is transposed on the way in and on the way out. The embedding
//! and the norm scales keep their layout.
//!
//! Loading checks the whole checkpoint against the configuration (every tensor present, every
//! shape as the config implies, nothing unexpected) before any tensor is built. Each tensor then
//! goes from the memory-mapped file to its device in the dtype it is stored in (a bf16
//! checkpoint stays bf16 on the host, transposed in place of its bytes where needed); the
//! conversion to the model's float type happens as each tensor is placed.
//!
//! [`Linear`]: burn::nn::Linear

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

use burn::module::{Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

use super::config::LlamaConfig;
use super::hf_config::{read_hf_config, write_hf_config, HfLlamaConfig, HfRopeScaling};
use super::model::{load_param, Llama};
use super::safetensors::{write_safetensors, Checkpoint, StoredTensor, SINGLE_FILE_NAME};
use crate::Error;
use burn_distflash::Error as PluginError;
use burn_distflash::FlashAttentionBackend;

/// File name of the model configuration inside a model directory.
const CONFIG_FILE_NAME: &str = "config.json";

/// `max_position_embeddings` written by [`save_hf_llama`]: [`LlamaConfig`] has no context length
/// (RoPE is computed for any position), so the Llama 3.1 value is written.
const SAVED_MAX_POSITION_EMBEDDINGS: usize = 131072;

/// Name of the output projection; absent (or a copy of the embedding) in tied checkpoints.
const LM_HEAD: &str = "lm_head.weight";

/// Name of the token embedding.
const EMBED_TOKENS: &str = "model.embed_tokens.weight";

/// How many names an error lists before it only counts the rest.
const LISTED_NAMES: usize = 5;

/// The model weight a checkpoint tensor belongs to.
#[derive(Debug, Clone, Copy)]
enum Slot {
    Embedding,
    AttentionNorm(usize),
    Query(usize),
    Key(usize),
    Value(usize),
    Output(usize),
    FfnNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
    Norm,
    LmHead,
}

impl Slot {
    /// Whether the Hugging Face layout is the transpose of the Burn one (the linear layers).
    fn transposed(self) -> bool {
        !matches!(
            self,
            Slot::Embedding | Slot::AttentionNorm(_) | Slot::FfnNorm(_) | Slot::Norm
        )
    }
}

/// One tensor of a checkpoint: its name, its shape in Hugging Face layout, and where it goes.
struct Spec {
    name: String,
    shape: Vec<usize>,
    slot: Slot,
}

/// Every tensor a model of this shape has, in Hugging Face names and layout (`[out, in]` for
/// linear layers); `lm_head.weight` only when the output projection is not tied.
fn tensor_specs(config: &LlamaConfig) -> Result<Vec<Spec>, PluginError> {
    let (n_kv_heads, head_dim) = config.attention()?.resolved()?;
    let d = config.d_model;
    let q_out = config.n_heads * head_dim;
    let kv_out = n_kv_heads * head_dim;
    let ff = config.d_ff;
    let spec = |name: String, shape: Vec<usize>, slot: Slot| Spec { name, shape, slot };
    let mut specs = vec![spec(
        EMBED_TOKENS.to_string(),
        vec![config.vocab_size, d],
        Slot::Embedding,
    )];
    for i in 0..config.n_layers {
        let p = format!("model.layers.{i}");
        specs.extend([
            spec(
                format!("{p}.input_layernorm.weight"),
                vec![d],
                Slot::AttentionNorm(i),
            ),
            spec(
                format!("{p}.self_attn.q_proj.weight"),
                vec![q_out, d],
                Slot::Query(i),
            ),
            spec(
                format!("{p}.self_attn.k_proj.weight"),
                vec![kv_out, d],
                Slot::Key(i),
            ),
            spec(
                format!("{p}.self_attn.v_proj.weight"),
                vec![kv_out, d],
                Slot::Value(i),
            ),
            spec(
                format!("{p}.self_attn.o_proj.weight"),
                vec![d, q_out],
                Slot::Output(i),
            ),
            spec(
                format!("{p}.post_attention_layernorm.weight"),
                vec![d],
                Slot::FfnNorm(i),
            ),
            spec(
                format!("{p}.mlp.gate_proj.weight"),
                vec![ff, d],
                Slot::Gate(i),
            ),
            spec(format!("{p}.mlp.up_proj.weight"), vec![ff, d], Slot::Up(i)),
            spec(
                format!("{p}.mlp.down_proj.weight"),
                vec![d, ff],
                Slot::Down(i),
            ),
        ]);
    }
    specs.push(spec("model.norm.weight".to_string(), vec![d], Slot::Norm));
    if !config.tie_embeddings {
        specs.push(spec(
            LM_HEAD.to_string(),
            vec![config.vocab_size, d],
            Slot::LmHead,
        ));
    }
    Ok(specs)
}

/// Tensors some checkpoints carry that are derived from the config, not learned: the rotary
/// inverse frequencies older `transformers` versions saved as buffers.
fn is_ignorable(name: &str) -> bool {
    name.starts_with("model.") && name.ends_with(".rotary_emb.inv_freq")
}

/// Checks the whole checkpoint against the specs: missing tensors first, then shapes, then
/// unexpected extras and a tied `lm_head.weight` that is not a copy of the embedding.
fn check_checkpoint(
    dir: &Path,
    config: &LlamaConfig,
    specs: &[Spec],
    checkpoint: &Checkpoint,
) -> Result<(), Error> {
    let missing: Vec<&Spec> = specs
        .iter()
        .filter(|s| checkpoint.get(&s.name).is_none())
        .collect();
    if !missing.is_empty() {
        return Err(Error::MissingTensors {
            dir: dir.to_path_buf(),
            names: missing
                .iter()
                .take(LISTED_NAMES)
                .map(|s| s.name.clone())
                .collect(),
            total: missing.len(),
        });
    }
    let shape_error = |name: &str, got: &[usize], expected: &[usize]| Error::Shape {
        path: Some(dir.to_path_buf()),
        tensor: name.to_string(),
        expected: expected.to_vec(),
        got: got.to_vec(),
    };
    for spec in specs {
        let got = checkpoint.get(&spec.name).map_or(&[][..], |t| t.shape);
        if got != spec.shape {
            return Err(shape_error(&spec.name, got, &spec.shape));
        }
    }
    let head = checkpoint.get(LM_HEAD).filter(|_| config.tie_embeddings);
    let tied_head = head.is_some();
    let mut known: BTreeSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    if tied_head {
        known.insert(LM_HEAD);
    }
    let unexpected: Vec<&str> = checkpoint
        .names()
        .filter(|name| !known.contains(name) && !is_ignorable(name))
        .collect();
    if !unexpected.is_empty() {
        return Err(Error::UnexpectedTensors {
            dir: dir.to_path_buf(),
            names: unexpected
                .iter()
                .take(LISTED_NAMES)
                .map(|n| n.to_string())
                .collect(),
            total: unexpected.len(),
        });
    }
    if let (Some(head), Some(embedding)) = (head, checkpoint.get(EMBED_TOKENS)) {
        if head.shape != embedding.shape {
            return Err(shape_error(LM_HEAD, head.shape, embedding.shape));
        }
        if head.dtype != embedding.dtype || head.bytes != embedding.bytes {
            return Err(Error::Invalid {
                path: Some(dir.to_path_buf()),
                what: format!("`{LM_HEAD}`"),
                expected: format!(
                    "no `{LM_HEAD}` or an exact copy of `{EMBED_TOKENS}`, since \
                     {CONFIG_FILE_NAME} sets tie_word_embeddings (set tie_word_embeddings to \
                     false to load a separate output projection)"
                ),
                got: format!("a tensor that differs from `{EMBED_TOKENS}`"),
            });
        }
    }
    Ok(())
}

/// A row-major `[rows, cols]` matrix of `elem`-byte elements, transposed to `[cols, rows]`
/// without looking at the values (so in any dtype; in tiles, so large matrices stay
/// cache-friendly).
fn transpose_bytes(bytes: &[u8], rows: usize, cols: usize, elem: usize) -> Vec<u8> {
    const TILE: usize = 32;
    let mut out = vec![0u8; bytes.len()];
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    let (to, from) = ((c * rows + r) * elem, (r * cols + c) * elem);
                    out[to..to + elem].copy_from_slice(&bytes[from..from + elem]);
                }
            }
        }
    }
    out
}

/// `data`, a row-major `[rows, cols]` matrix, as its `[cols, rows]` transpose in the same dtype.
fn transposed(data: &TensorData) -> TensorData {
    let [rows, cols] = data.shape.as_slice()[..] else {
        return data.clone();
    };
    let bytes = transpose_bytes(data.as_bytes(), rows, cols, data.dtype.size());
    TensorData::from_bytes_vec(bytes, [cols, rows], data.dtype)
}

/// The data a checkpoint tensor is placed on its device from: Burn's layout (projections
/// transposed from Hugging Face's `[out, in]` to `[in, out]`), still in the stored dtype.
fn placement_data(tensor: StoredTensor<'_>, slot: Slot) -> TensorData {
    let data = tensor.to_data();
    // Hugging Face Llama's q_proj and k_proj rows are already in the "rotate half" order the
    // plugin's RoPE uses (`convert_llama_weights_to_hf.py` permuted Meta's interleaved layout
    // into it), so no further permutation of the heads is needed.
    match slot.transposed() {
        true => transposed(&data),
        false => data,
    }
}

/// Puts one checked checkpoint tensor into its place in `model`.
fn assign<B: Backend>(model: &mut Llama<B>, slot: Slot, data: TensorData, device: &B::Device) {
    let norm = match slot {
        Slot::AttentionNorm(i) => Some(&mut model.blocks[i].attention_norm),
        Slot::FfnNorm(i) => Some(&mut model.blocks[i].ffn_norm),
        Slot::Norm => Some(&mut model.norm),
        _ => None,
    };
    if let Some(norm) = norm {
        let weight = norm.weight.clone();
        norm.weight = load_param(weight, data, device);
        return;
    }
    let param = match slot {
        Slot::Embedding => &mut model.embedding.weight,
        Slot::Query(i) => &mut model.blocks[i].attention.query.weight,
        Slot::Key(i) => &mut model.blocks[i].attention.key.weight,
        Slot::Value(i) => &mut model.blocks[i].attention.value.weight,
        Slot::Output(i) => &mut model.blocks[i].attention.output.weight,
        Slot::Gate(i) => &mut model.blocks[i].ffn.gate.weight,
        Slot::Up(i) => &mut model.blocks[i].ffn.up.weight,
        Slot::Down(i) => &mut model.blocks[i].ffn.down.weight,
        Slot::LmHead => match &mut model.lm_head {
            Some(head) => &mut head.weight,
            None => return,
        },
        Slot::AttentionNorm(_) | Slot::FfnNorm(_) | Slot::Norm => return,
    };
    let old = param.clone();
    *param = load_param(old, data, device);
}

/// Loads a Hugging Face Llama model directory: `config.json` and the safetensors weights
/// (`model.safetensors`, or the shards `model.safetensors.index.json` lists; F32, F16 or BF16,
/// each tensor kept in its dtype until it is placed on `device`).
///
/// Returns the configuration [`LlamaConfig::from_hf`] derives from `config.json` and a model of
/// that shape holding the checkpoint's weights, converted to the device's float type and
/// requiring gradients (on autodiff backends) so it can be fine-tuned. Projections are
/// transposed from Hugging Face's `[out, in]` to Burn's `[in, out]`; with
/// `tie_word_embeddings` the output projection is the embedding, and `lm_head.weight`, if
/// present, must equal it.
///
/// Everything is checked before any tensor is built: the directory and `config.json` exist, the
/// config describes a model this crate can build, every tensor the config implies is present
/// with the implied shape, and no other tensors are present (except rotary `inv_freq` buffers,
/// which are ignored).
pub fn load_hf_llama<B: FlashAttentionBackend>(
    dir: &Path,
    device: &B::Device,
) -> Result<(LlamaConfig, Llama<B>), Error> {
    let model_dir = || {
        format!(
            "a model directory holding {CONFIG_FILE_NAME} and {SINGLE_FILE_NAME} (or sharded \
             safetensors)"
        )
    };
    if !dir.exists() {
        return Err(Error::NotFound {
            path: dir.to_path_buf(),
            expected: model_dir(),
        });
    }
    if !dir.is_dir() {
        return Err(Error::Invalid {
            path: Some(dir.to_path_buf()),
            what: "the model path".to_string(),
            expected: model_dir(),
            got: "not a directory".to_string(),
        });
    }
    let config_path = dir.join(CONFIG_FILE_NAME);
    if !config_path.exists() {
        return Err(Error::NotFound {
            path: config_path,
            expected: format!(
                "the {CONFIG_FILE_NAME} a Hugging Face model directory holds next to the \
                 safetensors weights"
            ),
        });
    }
    let hf = read_hf_config(&config_path)?;
    let config = LlamaConfig::from_hf(&hf);
    let invalid = |source| Error::Config {
        path: Some(config_path.clone()),
        source,
    };
    config.validate().map_err(invalid)?;
    let specs = tensor_specs(&config).map_err(invalid)?;
    let checkpoint = Checkpoint::open_dir(dir)?;
    check_checkpoint(dir, &config, &specs, &checkpoint)?;

    let mut model = config.try_init::<B>(device).map_err(invalid)?;
    for spec in &specs {
        // Present: `check_checkpoint` found every spec's tensor.
        let Some(tensor) = checkpoint.get(&spec.name) else {
            return Err(Error::MissingTensors {
                dir: dir.to_path_buf(),
                names: vec![spec.name.clone()],
                total: 1,
            });
        };
        assign(
            &mut model,
            spec.slot,
            placement_data(tensor, spec.slot),
            device,
        );
    }
    Ok((config, model))
}

/// The Hugging Face `config.json` describing `config`.
fn hf_config(config: &LlamaConfig) -> HfLlamaConfig {
    HfLlamaConfig {
        hidden_size: config.d_model,
        intermediate_size: config.d_ff,
        num_attention_heads: config.n_heads,
        num_key_value_heads: config.n_kv_heads,
        num_hidden_layers: config.n_layers,
        vocab_size: config.vocab_size,
        rms_norm_eps: config.norm_eps,
        rope_theta: config.rope.theta,
        rope_scaling: config.rope.scaling.as_ref().map(|s| HfRopeScaling {
            rope_type: "llama3".to_string(),
            factor: s.factor,
            low_freq_factor: s.low_freq_factor,
            high_freq_factor: s.high_freq_factor,
            original_max_position_embeddings: s.original_max_position,
        }),
        tie_word_embeddings: config.tie_embeddings,
        max_position_embeddings: SAVED_MAX_POSITION_EMBEDDINGS,
        head_dim: config.head_dim,
    }
}

/// The parameter of `model` a spec names, with its Burn shape; `None` for a missing `lm_head`.
fn model_param<B: Backend>(model: &Llama<B>, slot: Slot) -> Option<ModelParam<'_, B>> {
    let block = |i: usize| model.blocks.get(i);
    Some(match slot {
        Slot::Embedding => ModelParam::Matrix(&model.embedding.weight),
        Slot::AttentionNorm(i) => ModelParam::Vector(&block(i)?.attention_norm.weight),
        Slot::Query(i) => ModelParam::Matrix(&block(i)?.attention.query.weight),
        Slot::Key(i) => ModelParam::Matrix(&block(i)?.attention.key.weight),
        Slot::Value(i) => ModelParam::Matrix(&block(i)?.attention.value.weight),
        Slot::Output(i) => ModelParam::Matrix(&block(i)?.attention.output.weight),
        Slot::FfnNorm(i) => ModelParam::Vector(&block(i)?.ffn_norm.weight),
        Slot::Gate(i) => ModelParam::Matrix(&block(i)?.ffn.gate.weight),
        Slot::Up(i) => ModelParam::Matrix(&block(i)?.ffn.up.weight),
        Slot::Down(i) => ModelParam::Matrix(&block(i)?.ffn.down.weight),
        Slot::Norm => ModelParam::Vector(&model.norm.weight),
        Slot::LmHead => ModelParam::Matrix(&model.lm_head.as_ref()?.weight),
    })
}

/// A float parameter of rank 1 or 2.
enum ModelParam<'a, B: Backend> {
    Vector(&'a Param<Tensor<B, 1>>),
    Matrix(&'a Param<Tensor<B, 2>>),
}

impl<B: Backend> ModelParam<'_, B> {
    /// The shape in Hugging Face layout, without reading the values.
    fn hf_shape(&self, transposed: bool) -> Vec<usize> {
        match self {
            ModelParam::Vector(p) => p.lazy_shape().to_vec(),
            ModelParam::Matrix(p) => {
                let dims = p.lazy_shape().to_vec();
                if transposed && dims.len() == 2 {
                    vec![dims[1], dims[0]]
                } else {
                    dims
                }
            }
        }
    }

    /// The parameter's id.
    fn id(&self) -> ParamId {
        match self {
            ModelParam::Vector(p) => p.id,
            ModelParam::Matrix(p) => p.id,
        }
    }

    /// The values in Burn's layout, in the parameter's float type.
    fn data(&self) -> TensorData {
        match self {
            ModelParam::Vector(p) => p.val().into_data(),
            ModelParam::Matrix(p) => p.val().into_data(),
        }
    }
}

/// The error of a tensor of `spec` whose shape (Hugging Face layout) is `got`.
fn shape_error(spec: &Spec, got: Vec<usize>) -> Error {
    Error::Shape {
        path: None,
        tensor: spec.name.clone(),
        expected: spec.shape.clone(),
        got,
    }
}

/// The error of a model whose output projection disagrees with its config's `tie_embeddings`.
fn head_mismatch(tied: bool) -> Error {
    let (expected, got) = match tied {
        true => (
            "None, since the config ties the output projection to the embedding",
            "a separate output projection",
        ),
        false => (
            "an output projection of shape [d_model, vocab_size], since the config does not tie \
             it to the embedding",
            "None",
        ),
    };
    Error::invalid("the model's lm_head", expected, got)
}

/// Saves `model` as a Hugging Face Llama directory that [`load_hf_llama`] and `transformers`
/// both load: `dir/config.json` (the fields of `config`; `max_position_embeddings` 131072, since
/// [`LlamaConfig`] has no context length) and `dir/model.safetensors` with every tensor in
/// `dtype` (F32, F16 or BF16), under Hugging Face names and in Hugging Face layout (projections
/// transposed back to `[out, in]`; no `lm_head.weight` when the embeddings are tied), with the
/// `format: "pt"` metadata `transformers` expects.
///
/// `dir` is created if needed; existing files of the same names are replaced. The model is
/// checked against `config` (every shape, and `lm_head` present exactly when untied) before
/// anything is written.
pub fn save_hf_llama<B: FlashAttentionBackend>(
    model: &Llama<B>,
    config: &LlamaConfig,
    dir: &Path,
    dtype: DType,
) -> Result<(), Error> {
    save_hf_tensors(model, config, dir, dtype, |param| Ok(param.data()))
}

/// [`save_hf_llama`] with each parameter's values taken from `values(id, shape)` instead of the
/// model (which then gives only the structure and the parameter ids): the parameter's values
/// in Burn's layout (`[in, out]` for projections), of that shape, in any float type (they are
/// converted to `dtype`). A sharded optimizer's f32 master weights are saved this way.
///
/// # Errors
///
/// Those of [`save_hf_llama`], those `values` returns, and [`Error::Shape`] when it returns
/// values of another shape.
pub fn save_hf_llama_values<B: FlashAttentionBackend>(
    model: &Llama<B>,
    config: &LlamaConfig,
    dir: &Path,
    dtype: DType,
    mut values: impl FnMut(ParamId, &[usize]) -> Result<TensorData, Error>,
) -> Result<(), Error> {
    save_hf_tensors(model, config, dir, dtype, |param| {
        values(param.id(), &param.hf_shape(false))
    })
}

/// [`save_hf_llama`] with each parameter's values in Burn's layout from `data` (checked to have
/// the parameter's shape).
fn save_hf_tensors<B: FlashAttentionBackend>(
    model: &Llama<B>,
    config: &LlamaConfig,
    dir: &Path,
    dtype: DType,
    mut data: impl FnMut(&ModelParam<'_, B>) -> Result<TensorData, Error>,
) -> Result<(), Error> {
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(Error::Unsupported {
            path: Some(dir.to_path_buf()),
            what: "the dtype to save the weights as".to_string(),
            expected: "F32, F16 and BF16 (what save_hf_llama writes)".to_string(),
            got: format!("{dtype:?}"),
        });
    }
    let config_path = dir.join(CONFIG_FILE_NAME);
    let invalid = |source| Error::Config {
        path: Some(config_path.clone()),
        source,
    };
    config.validate().map_err(invalid)?;
    let specs = tensor_specs(config).map_err(invalid)?;
    if model.blocks.len() != config.n_layers {
        return Err(Error::invalid(
            "the model's number of blocks",
            format!(
                "its config's n_layers, {}; they must agree",
                config.n_layers
            ),
            model.blocks.len(),
        ));
    }
    if model.lm_head.is_some() == config.tie_embeddings {
        return Err(head_mismatch(config.tie_embeddings));
    }
    let mut params = Vec::with_capacity(specs.len());
    for spec in &specs {
        let transposed = spec.slot.transposed();
        // Present: the block count and lm_head were checked above.
        let Some(param) = model_param(model, spec.slot) else {
            return Err(head_mismatch(config.tie_embeddings));
        };
        let got = param.hf_shape(transposed);
        if got != spec.shape {
            return Err(shape_error(spec, got));
        }
        params.push((spec, param));
    }

    let mut tensors = BTreeMap::new();
    for (spec, param) in params {
        let values = data(&param)?.convert_dtype(dtype);
        let values = match spec.slot.transposed() {
            true => transposed(&values),
            false => values,
        };
        if values.shape.as_slice() != spec.shape.as_slice() {
            return Err(shape_error(spec, values.shape.to_vec()));
        }
        tensors.insert(spec.name.clone(), values);
    }
    fs::create_dir_all(dir).map_err(Error::io("create the model directory", dir))?;
    write_hf_config(&config_path, &hf_config(config))?;
    write_safetensors(&dir.join(SINGLE_FILE_NAME), &tensors)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn transposing_bytes_moves_whole_elements() {
        // [2, 3] of 2-byte elements: element (r, c) is the pair [10 r + c, 100].
        let bytes: Vec<u8> = (0..2u8)
            .flat_map(|r| (0..3u8).flat_map(move |c| [10 * r + c, 100]))
            .collect();
        let out = transpose_bytes(&bytes, 2, 3, 2);
        let expected: Vec<u8> = (0..3u8)
            .flat_map(|c| (0..2u8).flat_map(move |r| [10 * r + c, 100]))
            .collect();
        assert_eq!(out, expected);
        // Larger than one tile in both directions, 4-byte elements.
        let (rows, cols) = (37, 70);
        let values: Vec<u32> = (0..(rows * cols) as u32).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let out = transpose_bytes(&bytes, rows, cols, 4);
        let at = |i: usize| u32::from_le_bytes(out[4 * i..4 * i + 4].try_into().unwrap());
        assert_eq!(at(5 * rows + 3), (3 * cols + 5) as u32);
        assert_eq!(at(cols * rows - 1), (rows * cols - 1) as u32);
    }

    #[test]
    fn a_bf16_projection_reaches_placement_as_bf16_in_burn_layout() {
        // HF q_proj [out 2, in 3] in bf16; Burn wants [in 3, out 2], still bf16.
        let values = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0].map(bf16::from_f32);
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let stored = StoredTensor {
            dtype: DType::BF16,
            shape: &[2, 3],
            bytes: &bytes,
        };
        let data = placement_data(stored, Slot::Query(0));
        assert_eq!(data.dtype, DType::BF16);
        assert_eq!(data.shape.as_slice(), [3, 2]);
        let placed: Vec<f32> = data
            .as_slice::<bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_f32())
            .collect();
        assert_eq!(placed, [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        // A norm scale keeps its layout and its bytes.
        let stored = StoredTensor {
            dtype: DType::BF16,
            shape: &[6],
            bytes: &bytes,
        };
        let data = placement_data(stored, Slot::Norm);
        assert_eq!((data.dtype, data.as_bytes()), (DType::BF16, &bytes[..]));
    }
}
