//! Hugging Face Llama weights on the CPU: save/load round trips (untied, tied, BF16), the layout
//! mapping checked against a checkpoint written by hand in Hugging Face's `[out, in]` layout,
//! gradients of a loaded model, and the errors for broken directories and checkpoints.

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::modules::{float_params, require_grad_flags, ParamValues};
use crate::common::temp_dir::TempDir;
use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn::module::Param;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Int, Tensor, TensorData};
use burn_distflash::layers::{Llama3RopeScaling, RopeConfig};
use burn_distflash::AttentionContext;
use distflash_llama::hf_config::{write_hf_config, HfLlamaConfig};
use distflash_llama::safetensors::{write_safetensors, Checkpoint};
use distflash_llama::weights::{load_hf_llama, save_hf_llama};
use distflash_llama::{Error, Llama, LlamaConfig};

type Cpu = NdArray<f32>;
const DEVICE: NdArrayDevice = NdArrayDevice::Cpu;

/// vocab 64, d_model 64, 2 layers, 4 heads over 2 key/value heads (head_dim 16), d_ff 96.
fn small_config(tied: bool) -> LlamaConfig {
    LlamaConfig::new(64, 64, 2, 4, 2, 96).with_tie_embeddings(tied)
}

fn params<B: Backend>(model: &Llama<B>) -> Vec<ParamValues> {
    float_params(model)
}

fn random_1d(d: usize) -> Param<Tensor<Cpu, 1>> {
    Param::from_tensor(Tensor::random(
        [d],
        Distribution::Uniform(0.5, 1.5),
        &DEVICE,
    ))
}

/// A freshly initialised model whose norm scales are random too (they start at one).
fn random_model(config: &LlamaConfig) -> Llama<Cpu> {
    let mut model = config.try_init::<Cpu>(&DEVICE).unwrap();
    for block in &mut model.blocks {
        block.attention_norm.weight = random_1d(config.d_model);
        block.ffn_norm.weight = random_1d(config.d_model);
    }
    model.norm.weight = random_1d(config.d_model);
    model
}

fn logits<B: burn_distflash::FlashAttentionBackend>(model: &Llama<B>) -> Vec<f32> {
    let tokens: Vec<i64> = vec![3, 17, 0, 63, 42, 42, 8, 25, 1, 60];
    let n = tokens.len();
    let tokens =
        Tensor::<B, 2, Int>::from_data(TensorData::new(tokens, [1, n]), &B::Device::default());
    let out = model.forward(tokens, &AttentionContext::Local).unwrap();
    assert_eq!(out.dims(), [1, n, 64]);
    out.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

fn assert_same_params(a: &Llama<Cpu>, b: &Llama<Cpu>) {
    let (a, b) = (params(a), params(b));
    assert_eq!(a.len(), b.len(), "number of parameters");
    for (i, ((da, va), (db, vb))) in a.iter().zip(&b).enumerate() {
        assert_eq!(da, db, "shape of parameter {i}");
        assert!(va == vb, "values of parameter {i} {da:?} differ");
    }
}

fn assert_same_logits(a: &Llama<Cpu>, b: &Llama<Cpu>) {
    let (la, lb) = (logits(a), logits(b));
    assert!(la.iter().any(|v| *v != 0.0), "logits are all zero");
    let max_diff = la
        .iter()
        .zip(&lb)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(max_diff <= 1e-6, "logits differ by {max_diff}");
}

#[test]
fn untied_round_trip_keeps_every_weight_and_the_config() {
    let rope = RopeConfig::new()
        .with_theta(500000.0)
        .with_scaling(Some(Llama3RopeScaling::new(8.0, 1.0, 4.0, 8192)));
    let config = small_config(false).with_rope(rope).with_norm_eps(1e-6);
    let model = random_model(&config);
    let tmp = TempDir::new("untied");
    let dir = tmp.path().join("model");
    save_hf_llama(&model, &config, &dir, DType::F32).unwrap();

    let written = Checkpoint::open_file(&dir.join("model.safetensors")).unwrap();
    assert_eq!(written.len(), 1 + 2 * 9 + 1 + 1);
    let shape = |name: &str| written.get(name).unwrap().shape.to_vec();
    assert_eq!(shape("model.layers.0.self_attn.k_proj.weight"), [32, 64]);
    assert_eq!(shape("model.layers.1.mlp.down_proj.weight"), [64, 96]);
    assert_eq!(shape("lm_head.weight"), [64, 64]);
    let format = written.metadata_of("lm_head.weight").unwrap().get("format");
    assert_eq!(
        format.map(String::as_str),
        Some("pt"),
        "transformers needs format: pt"
    );

    let (loaded_config, loaded) = load_hf_llama::<Cpu>(&dir, &DEVICE).unwrap();
    assert_eq!(loaded_config.to_string(), config.to_string());
    assert!(loaded.lm_head.is_some());
    assert_same_params(&model, &loaded);
    assert_same_logits(&model, &loaded);
}

#[test]
fn tied_round_trip_omits_lm_head() {
    let config = small_config(true);
    let model = random_model(&config);
    assert!(model.lm_head.is_none());
    let tmp = TempDir::new("tied");
    save_hf_llama(&model, &config, tmp.path(), DType::F32).unwrap();
    let written = Checkpoint::open_file(&tmp.path().join("model.safetensors")).unwrap();
    assert!(written.get("lm_head.weight").is_none());
    assert_eq!(written.len(), 1 + 2 * 9 + 1);

    let (loaded_config, loaded) = load_hf_llama::<Cpu>(tmp.path(), &DEVICE).unwrap();
    assert!(loaded_config.tie_embeddings);
    assert!(loaded.lm_head.is_none());
    assert_same_params(&model, &loaded);
    assert_same_logits(&model, &loaded);
}

#[test]
fn bf16_round_trip_rounds_each_weight() {
    let config = small_config(false);
    let model = random_model(&config);
    let tmp = TempDir::new("bf16");
    save_hf_llama(&model, &config, tmp.path(), DType::BF16).unwrap();
    let written = Checkpoint::open_file(&tmp.path().join("model.safetensors")).unwrap();
    assert!(written
        .names()
        .all(|name| written.get(name).unwrap().dtype == DType::BF16));
    let (_, loaded) = load_hf_llama::<Cpu>(tmp.path(), &DEVICE).unwrap();
    for ((_, original), (_, back)) in params(&model).iter().zip(&params(&loaded)) {
        let rounded: Vec<f32> = original
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect();
        assert!(rounded == *back);
    }
}

#[test]
fn bf16_checkpoint_loads_without_an_f32_copy_on_the_host() {
    // A hand-written bf16 checkpoint: every value a bf16 (so the expected f32 values are exact).
    let tmp = TempDir::new("bf16-load");
    let tensors: BTreeMap<String, TensorData> = hf_tensors(false)
        .into_iter()
        .map(|(name, data)| (name, data.convert_dtype(DType::BF16)))
        .collect();
    write_checkpoint(tmp.path(), &hf_config(false), &tensors);
    // The checkpoint hands out each tensor as it is stored: bf16, the file's own bytes.
    let checkpoint = Checkpoint::open_dir(tmp.path()).unwrap();
    for (name, data) in &tensors {
        let stored = checkpoint.get(name).unwrap();
        assert_eq!(stored.dtype, DType::BF16, "{name}");
        assert_eq!(stored.bytes, data.as_bytes(), "{name}");
        assert_eq!(stored.to_data().dtype, DType::BF16, "{name}");
    }
    drop(checkpoint);
    let (_, model) = load_hf_llama::<Cpu>(tmp.path(), &DEVICE).unwrap();
    for (name, data) in &tensors {
        let ((dims, burn), transposed) = burn_weight(&model, name);
        let hf = f32_values(data);
        let shape = data.shape.as_slice();
        let expected: Vec<f32> = match transposed {
            false => hf,
            true => (0..shape[1])
                .flat_map(|i| (0..shape[0]).map(move |o| (o, i)))
                .map(|(o, i)| hf[o * shape[1] + i])
                .collect(),
        };
        assert_eq!(dims.iter().product::<usize>(), expected.len(), "{name}");
        assert!(
            burn == expected,
            "{name}: values differ from the bf16 checkpoint's"
        );
    }
}

/// The config of the hand-written checkpoint: the same shape as [`small_config`].
fn hf_config(tied: bool) -> HfLlamaConfig {
    HfLlamaConfig {
        hidden_size: 64,
        intermediate_size: 96,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        num_hidden_layers: 2,
        vocab_size: 64,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        tie_word_embeddings: tied,
        max_position_embeddings: 2048,
        head_dim: None,
    }
}

/// Every tensor of a Hugging Face Llama checkpoint in its own layout (`[out, in]` for
/// projections), each filled with distinct values `k + j / 65536` (tensor `k`, element `j`).
fn hf_tensors(tied: bool) -> BTreeMap<String, TensorData> {
    let (d, ff, vocab, q, kv) = (64, 96, 64, 64, 32);
    let mut shapes: Vec<(String, Vec<usize>)> =
        vec![("model.embed_tokens.weight".into(), vec![vocab, d])];
    for i in 0..2 {
        let p = format!("model.layers.{i}");
        shapes.extend([
            (format!("{p}.input_layernorm.weight"), vec![d]),
            (format!("{p}.self_attn.q_proj.weight"), vec![q, d]),
            (format!("{p}.self_attn.k_proj.weight"), vec![kv, d]),
            (format!("{p}.self_attn.v_proj.weight"), vec![kv, d]),
            (format!("{p}.self_attn.o_proj.weight"), vec![d, q]),
            (format!("{p}.post_attention_layernorm.weight"), vec![d]),
            (format!("{p}.mlp.gate_proj.weight"), vec![ff, d]),
            (format!("{p}.mlp.up_proj.weight"), vec![ff, d]),
            (format!("{p}.mlp.down_proj.weight"), vec![d, ff]),
        ]);
    }
    shapes.push(("model.norm.weight".into(), vec![d]));
    if !tied {
        shapes.push(("lm_head.weight".into(), vec![vocab, d]));
    }
    shapes
        .into_iter()
        .enumerate()
        .map(|(k, (name, shape))| {
            let n = shape.iter().product::<usize>();
            let data: Vec<f32> = (0..n).map(|j| k as f32 + j as f32 / 65536.0).collect();
            (name, TensorData::new(data, shape))
        })
        .collect()
}

/// Writes `config.json` and `model.safetensors` into `dir`.
fn write_checkpoint(dir: &Path, config: &HfLlamaConfig, tensors: &BTreeMap<String, TensorData>) {
    write_hf_config(&dir.join("config.json"), config).unwrap();
    write_safetensors(&dir.join("model.safetensors"), tensors).unwrap();
}

/// A checkpoint tensor's values as `f32`.
fn f32_values(data: &TensorData) -> Vec<f32> {
    data.clone().convert::<f32>().to_vec::<f32>().unwrap()
}

fn values<const D: usize>(param: &Param<Tensor<Cpu, D>>) -> (Vec<usize>, Vec<f32>) {
    let value = param.val();
    (
        value.dims().to_vec(),
        value.into_data().to_vec::<f32>().unwrap(),
    )
}

/// The loaded weight a Hugging Face name maps to, in Burn's layout, and whether that layout is
/// the transpose of Hugging Face's (written out field by field, independently of the loader).
fn burn_weight(model: &Llama<Cpu>, name: &str) -> ((Vec<usize>, Vec<f32>), bool) {
    if name == "model.embed_tokens.weight" {
        return (values(&model.embedding.weight), false);
    }
    if name == "model.norm.weight" {
        return (values(&model.norm.weight), false);
    }
    if name == "lm_head.weight" {
        return (values(&model.lm_head.as_ref().unwrap().weight), true);
    }
    let rest = name.strip_prefix("model.layers.").unwrap();
    let (i, field) = rest.split_once('.').unwrap();
    let block = &model.blocks[i.parse::<usize>().unwrap()];
    match field {
        "input_layernorm.weight" => (values(&block.attention_norm.weight), false),
        "post_attention_layernorm.weight" => (values(&block.ffn_norm.weight), false),
        "self_attn.q_proj.weight" => (values(&block.attention.query.weight), true),
        "self_attn.k_proj.weight" => (values(&block.attention.key.weight), true),
        "self_attn.v_proj.weight" => (values(&block.attention.value.weight), true),
        "self_attn.o_proj.weight" => (values(&block.attention.output.weight), true),
        "mlp.gate_proj.weight" => (values(&block.ffn.gate.weight), true),
        "mlp.up_proj.weight" => (values(&block.ffn.up.weight), true),
        "mlp.down_proj.weight" => (values(&block.ffn.down.weight), true),
        other => panic!("unknown field {other}"),
    }
}

#[test]
fn hand_written_checkpoint_maps_to_burn_layout() {
    let tmp = TempDir::new("by-hand");
    let mut tensors = hf_tensors(false);
    // A buffer older transformers versions saved; ignored.
    tensors.insert(
        "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        TensorData::new(vec![1.0f32; 8], [8]),
    );
    write_checkpoint(tmp.path(), &hf_config(false), &tensors);
    let (config, model) = load_hf_llama::<Cpu>(tmp.path(), &DEVICE).unwrap();
    assert_eq!((config.d_model, config.d_ff, config.n_layers), (64, 96, 2));
    assert_eq!(
        (config.n_heads, config.n_kv_heads, config.norm_eps),
        (4, 2, 1e-5)
    );

    // q_proj of block 0 spelled out: Burn's [in, out] element (i, o) is HF's (o, i).
    let q_hf = f32_values(&tensors["model.layers.0.self_attn.q_proj.weight"]);
    let (q_dims, q_burn) = values(&model.blocks[0].attention.query.weight);
    assert_eq!(q_dims, [64, 64]);
    assert_eq!(q_burn[64 + 2], q_hf[2 * 64 + 1]);
    assert_ne!(
        q_burn[64 + 2],
        q_hf[64 + 2],
        "query weight was not transposed"
    );

    tensors.remove("model.layers.0.self_attn.rotary_emb.inv_freq");
    for (name, hf) in &tensors {
        let ((dims, burn), transposed) = burn_weight(&model, name);
        let (hf_shape, hf_values) = (hf.shape.as_slice(), f32_values(hf));
        if transposed {
            let (out, inp) = (hf_shape[0], hf_shape[1]);
            assert_eq!(dims, [inp, out], "{name}");
            for i in 0..inp {
                for o in 0..out {
                    assert_eq!(
                        burn[i * out + o],
                        hf_values[o * inp + i],
                        "{name} at [{i}, {o}]"
                    );
                }
            }
        } else {
            assert_eq!(dims, hf_shape, "{name}");
            assert!(burn == hf_values, "{name} differs");
        }
    }
}

#[test]
fn tied_checkpoint_accepts_a_copy_of_the_embedding_only() {
    let tmp = TempDir::new("tied-copy");
    let mut tensors = hf_tensors(true);
    let head = tensors["model.embed_tokens.weight"].clone();
    tensors.insert("lm_head.weight".into(), head.clone());
    write_checkpoint(tmp.path(), &hf_config(true), &tensors);
    let (_, model) = load_hf_llama::<Cpu>(tmp.path(), &DEVICE).unwrap();
    assert!(model.lm_head.is_none());

    let mut changed = f32_values(&head);
    changed[5] += 1.0;
    tensors.insert(
        "lm_head.weight".into(),
        TensorData::new(changed, head.shape),
    );
    write_checkpoint(tmp.path(), &hf_config(true), &tensors);
    let err = load_hf_llama::<Cpu>(tmp.path(), &DEVICE).unwrap_err();
    assert!(
        matches!(err, Error::Invalid { ref what, ref got, .. }
            if what == "`lm_head.weight`" && got.contains("differs from")),
        "{err}"
    );
    assert!(err.to_string().contains("tie_word_embeddings"), "{err}");
}

#[test]
fn loaded_model_requires_gradients_and_trains() {
    type Ad = Autodiff<Cpu>;
    let tmp = TempDir::new("grad");
    write_checkpoint(tmp.path(), &hf_config(false), &hf_tensors(false));
    let (_, model) = load_hf_llama::<Ad>(tmp.path(), &DEVICE).unwrap();
    let flags = require_grad_flags(&model);
    assert_eq!(flags.len(), 1 + 2 * 9 + 1 + 1);
    assert!(flags.iter().all(|f| *f), "{flags:?}");

    let tokens: Vec<i64> = vec![1, 2, 3, 4, 5, 6];
    let targets: Vec<i64> = vec![2, 3, 4, 5, 6, 7];
    let tokens = Tensor::<Ad, 2, Int>::from_data(TensorData::new(tokens, [1, 6]), &DEVICE);
    let targets = Tensor::<Ad, 2, Int>::from_data(TensorData::new(targets, [1, 6]), &DEVICE);
    let loss = model
        .loss(tokens, targets, &AttentionContext::Local, 6)
        .unwrap();
    let grads = loss.backward();
    let grad = model.blocks[0].attention.query.weight.grad(&grads);
    let grad = grad.expect("the loaded query weight gets a gradient");
    assert_eq!(grad.dims(), [64, 64]);
    assert!(model
        .lm_head
        .as_ref()
        .unwrap()
        .weight
        .grad(&grads)
        .is_some());
}

fn load_err(dir: &Path) -> Error {
    match load_hf_llama::<Cpu>(dir, &DEVICE) {
        Ok(_) => panic!("loading {} succeeded", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn missing_directory_and_config() {
    let tmp = TempDir::new("missing");
    let nowhere = tmp.path().join("nowhere");
    let err = load_err(&nowhere);
    assert!(
        matches!(err, Error::NotFound { ref path, .. } if path == &nowhere),
        "{err}"
    );
    assert!(err.to_string().contains("nowhere"), "{err}");

    write_safetensors(&tmp.path().join("model.safetensors"), &hf_tensors(false)).unwrap();
    let err = load_err(tmp.path());
    assert!(
        matches!(err, Error::NotFound { ref path, .. } if path == &tmp.path().join("config.json")),
        "{err}"
    );
    assert!(err.to_string().contains("config.json"), "{err}");

    // A file where the directory should be.
    let err = load_err(&tmp.path().join("model.safetensors"));
    assert!(
        matches!(err, Error::Invalid { ref got, .. } if got == "not a directory"),
        "{err}"
    );
}

#[test]
fn missing_tensor_is_named() {
    let tmp = TempDir::new("missing-tensor");
    let mut tensors = hf_tensors(false);
    tensors.remove("model.layers.1.mlp.up_proj.weight").unwrap();
    write_checkpoint(tmp.path(), &hf_config(false), &tensors);
    let err = load_err(tmp.path());
    let msg = err.to_string();
    assert!(
        matches!(err, Error::MissingTensors { ref names, total: 1, .. }
            if names == &["model.layers.1.mlp.up_proj.weight".to_string()]),
        "{msg}"
    );
    assert!(msg.contains("`model.layers.1.mlp.up_proj.weight`"), "{msg}");
    assert!(msg.contains(&tmp.path().display().to_string()), "{msg}");

    // An untied config needs lm_head.weight.
    write_checkpoint(tmp.path(), &hf_config(false), &hf_tensors(true));
    let msg = load_err(tmp.path()).to_string();
    assert!(msg.contains("`lm_head.weight`"), "{msg}");
}

#[test]
fn wrong_shape_is_named_with_got_and_expected() {
    let tmp = TempDir::new("shape");
    let mut tensors = hf_tensors(false);
    tensors.insert(
        "model.layers.0.self_attn.k_proj.weight".into(),
        TensorData::new(vec![0.5f32; 16 * 64], [16, 64]),
    );
    write_checkpoint(tmp.path(), &hf_config(false), &tensors);
    let err = load_err(tmp.path());
    let msg = err.to_string();
    match &err {
        Error::Shape {
            path: Some(_),
            tensor: name,
            got,
            expected,
        } => {
            assert_eq!(name, "model.layers.0.self_attn.k_proj.weight");
            assert_eq!(
                (got.as_slice(), expected.as_slice()),
                (&[16, 64][..], &[32, 64][..])
            );
        }
        other => panic!("expected a shape mismatch, got {other}"),
    }
    assert!(
        msg.contains("`model.layers.0.self_attn.k_proj.weight`"),
        "{msg}"
    );
    assert!(
        msg.contains("[16, 64]") && msg.contains("[32, 64]"),
        "{msg}"
    );

    // A 1-D tensor in place of a matrix is a shape error too, not a panic.
    tensors = hf_tensors(false);
    tensors.insert(
        "model.embed_tokens.weight".into(),
        TensorData::new(vec![0.0f32; 64], [64]),
    );
    write_checkpoint(tmp.path(), &hf_config(false), &tensors);
    assert!(matches!(
        load_err(tmp.path()),
        Error::Shape { path: Some(_), .. }
    ));
}

#[test]
fn unexpected_tensors_are_listed() {
    let tmp = TempDir::new("unexpected");
    let mut tensors = hf_tensors(false);
    let extra = TensorData::new(vec![0.0f32, 1.0], [2]);
    // A third layer the config does not have, and a bias Llama has no place for.
    tensors.insert("model.layers.2.mlp.up_proj.weight".into(), extra.clone());
    tensors.insert("model.layers.0.self_attn.q_proj.bias".into(), extra);
    write_checkpoint(tmp.path(), &hf_config(false), &tensors);
    let err = load_err(tmp.path());
    let msg = err.to_string();
    assert!(
        matches!(err, Error::UnexpectedTensors { total: 2, .. }),
        "{msg}"
    );
    assert!(msg.contains("`model.layers.2.mlp.up_proj.weight`"), "{msg}");
    assert!(
        msg.contains("`model.layers.0.self_attn.q_proj.bias`"),
        "{msg}"
    );
}

#[test]
fn unbuildable_config_and_inconsistent_model_are_refused() {
    let tmp = TempDir::new("config");
    // head_dim 10 is valid for Hugging Face but not for the attention kernels.
    let config = HfLlamaConfig {
        hidden_size: 40,
        ..hf_config(false)
    };
    write_checkpoint(tmp.path(), &config, &hf_tensors(false));
    let err = load_err(tmp.path());
    assert!(matches!(err, Error::Config { path: Some(_), .. }), "{err}");
    assert!(err.to_string().contains("head_dim is 10"), "{err}");

    // Saving an untied model under a tied config.
    let model = small_config(false).try_init::<Cpu>(&DEVICE).unwrap();
    let err = save_hf_llama(&model, &small_config(true), tmp.path(), DType::F32).unwrap_err();
    assert!(
        matches!(err, Error::Invalid { ref what, ref got, .. }
            if what == "the model's lm_head" && got == "a separate output projection"),
        "{err}"
    );
    // A model wider than its config.
    let wide = LlamaConfig::new(64, 128, 2, 4, 2, 96);
    let err = save_hf_llama(&model, &wide, tmp.path(), DType::F32).unwrap_err();
    assert!(matches!(err, Error::Shape { path: None, .. }), "{err}");
}
