//! [`LlamaConfig`]: the shape of a Llama model, as an editable JSON file, with the paper's
//! presets and clear errors for shapes that cannot be built.

use std::path::Path;

use burn::config::Config;

use super::hf_config::HfLlamaConfig;
use burn_distflash::layers::{
    CheckpointPlacement, DistFlashAttentionConfig, Llama3RopeScaling, Offload, RopeConfig,
    TransformerBlockConfig,
};
use burn_distflash::{Error as PluginError, SlidingWindow};

/// The shape of a Llama model (`LlamaConfig::load("config.json")` / `config.save(..)`).
#[derive(Config, Debug)]
pub struct LlamaConfig {
    /// Vocabulary size (256 for the byte-level tokenizer).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Query heads per block.
    pub n_heads: usize,
    /// Key/value heads (GQA; equal to `n_heads` for plain multi-head attention).
    pub n_kv_heads: usize,
    /// Per-head width; `None` means `d_model / n_heads`.
    #[config(default = "None")]
    pub head_dim: Option<usize>,
    /// Hidden width of the SwiGLU feed-forward blocks.
    pub d_ff: usize,
    /// RMSNorm epsilon.
    #[config(default = 1e-5)]
    pub norm_eps: f64,
    /// Rotary embedding (theta, optional Llama-3 scaling).
    #[config(default = "RopeConfig::new()")]
    pub rope: RopeConfig,
    /// The output projection shares the embedding matrix.
    #[config(default = false)]
    pub tie_embeddings: bool,
    /// Where gradient checkpoints go in training.
    #[config(default = "CheckpointPlacement::AttentionOutput")]
    pub checkpoint: CheckpointPlacement,
    /// Which layers keep their checkpoints in host memory between the forward and the backward
    /// (`Off`, the default and what configs written before this field load as; `All`;
    /// `AllButLast(n)`: the last `n` layers keep theirs on the device). Needs a checkpoint
    /// placement other than `None`. Changes memory and speed, never the numbers.
    #[config(default = "Offload::Off")]
    pub offload: Offload,
    /// How many consecutive layers share one gradient checkpoint: 1 (the default, and what
    /// configs written before this field load as), or 2 with the `Layer` placement: each pair
    /// of blocks keeps only its input ([`BlockChain`](burn_distflash::layers::BlockChain)),
    /// half the checkpoints on the device or in host memory, for one more forward of each
    /// pair's first block without attention in the backward. A pair offloads when its first
    /// layer does. Changes memory and speed, never the numbers.
    #[config(default = 1)]
    pub layers_per_checkpoint: usize,
    /// Mistral-style sliding-window attention in every block: the token at position `i` sees
    /// the `window` tokens `i + 1 - window ..= i` (itself included, see
    /// [`SlidingWindow::causal`]), at absolute positions, also across the ranks of a group.
    /// `None` (the default, and what configs written before this field load as): full causal
    /// attention. Must be at least 1.
    #[config(default = "None")]
    pub window: Option<usize>,
    /// How many groups of heads each block's attention runs over, one after another, in a
    /// checkpointed block's forward, recomputation and backward
    /// ([`TransformerBlockConfig::attention_head_groups`]): attention's per-head backward tensors
    /// then exist for one group at a time. A divisor of `n_kv_heads`; 1 (the default, and what
    /// configs written before this field load as) runs every head at once. Changes memory and
    /// speed, not the results.
    #[config(default = 1)]
    pub attention_head_groups: usize,
}

impl LlamaConfig {
    /// A model small enough to train on a laptop CPU in minutes (byte vocabulary, GQA 4/2).
    pub fn tiny() -> Self {
        Self::new(256, 128, 4, 4, 2, 384).with_tie_embeddings(true)
    }

    /// LLaMA-7B: hidden 4096, 32 layers of 32 heads, FFN 11008, vocabulary 32000.
    pub fn llama_7b() -> Self {
        Self::new(32000, 4096, 32, 32, 32, 11008).with_norm_eps(1e-6)
    }

    /// LLaMA-GQA: LLaMA-7B with 8 key/value heads.
    pub fn llama_gqa() -> Self {
        Self {
            n_kv_heads: 8,
            ..Self::llama_7b()
        }
    }

    /// LLaMA-33H: LLaMA-7B with 33 heads of width 128 (hidden 4224).
    pub fn llama_33h() -> Self {
        Self::new(32000, 33 * 128, 32, 33, 33, 11008).with_norm_eps(1e-6)
    }

    /// LLaMA-16H/8H/4H/2H: `heads` heads of width 128 per block, layers scaled up so the model
    /// size stays comparable (32 x 32 / heads), FFN kept at 11008 (paper §4.1).
    pub fn llama_few_heads(heads: usize) -> Self {
        Self::new(32000, heads * 128, 32 * 32 / heads, heads, heads, 11008).with_norm_eps(1e-6)
    }

    /// Llama-3-8B: hidden 4096, 32 layers, 32 query over 8 key/value heads, FFN 14336,
    /// vocabulary 128256, rope theta 500000 with Llama-3.1 scaling.
    pub fn llama3_8b() -> Self {
        let rope = RopeConfig::new()
            .with_theta(500000.0)
            .with_scaling(Some(Llama3RopeScaling::new(8.0, 1.0, 4.0, 8192)));
        Self::new(128256, 4096, 32, 32, 8, 14336).with_rope(rope)
    }

    /// A preset by name: `tiny`, `llama-7b`, `llama-gqa`, `llama-33h`, `llama-16h`, `llama-8h`,
    /// `llama-4h`, `llama-2h`, `llama3-8b`.
    pub fn preset(name: &str) -> Result<Self, PluginError> {
        Ok(match name {
            "tiny" => Self::tiny(),
            "llama-7b" => Self::llama_7b(),
            "llama-gqa" => Self::llama_gqa(),
            "llama-33h" => Self::llama_33h(),
            "llama-16h" => Self::llama_few_heads(16),
            "llama-8h" => Self::llama_few_heads(8),
            "llama-4h" => Self::llama_few_heads(4),
            "llama-2h" => Self::llama_few_heads(2),
            "llama3-8b" => Self::llama3_8b(),
            other => {
                return Err(PluginError::config(
                    "preset",
                    format!("one of {}", PRESETS.join(", ")),
                    format!("{other:?}"),
                ))
            }
        })
    }

    /// A preset name or the path of a JSON config file. A file needs the fields
    /// [`LlamaConfig::new`] takes; every other field it lacks (one written before that field
    /// existed) takes its default.
    pub fn from_name_or_file(name: &str) -> Result<Self, PluginError> {
        if !Path::new(name).exists() {
            return Self::preset(name);
        }
        let unreadable =
            |e| PluginError::config("config file", "a readable Llama configuration (JSON)", e);
        let text = std::fs::read_to_string(name).map_err(|e| unreadable(e.to_string()))?;
        Self::load_binary(with_defaults(&text).as_bytes()).map_err(|e| unreadable(e.to_string()))
    }

    /// The attention configuration of every block.
    ///
    /// # Errors
    ///
    /// [`PluginError::Config`] for a `window` of 0 keys.
    pub fn attention(&self) -> Result<DistFlashAttentionConfig, PluginError> {
        let window = self
            .window
            .map(|size| {
                SlidingWindow::causal(size).map_err(|_| {
                    PluginError::config(
                        "window",
                        "at least 1 (the keys each token sees, itself included) or none",
                        size,
                    )
                })
            })
            .transpose()?;
        Ok(DistFlashAttentionConfig::new(self.d_model, self.n_heads)
            .with_n_kv_heads(Some(self.n_kv_heads))
            .with_head_dim(self.head_dim)
            .with_rope(self.rope.clone())
            .with_window(window))
    }

    /// Checks the shape before anything is allocated.
    pub fn validate(&self) -> Result<(), PluginError> {
        for (name, value) in [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("n_layers", self.n_layers),
            ("d_ff", self.d_ff),
        ] {
            if value == 0 {
                return Err(PluginError::config(name, "positive", value));
            }
        }
        match (self.layers_per_checkpoint, self.checkpoint) {
            (1, _) | (2, CheckpointPlacement::Layer) => {}
            (layers, placement) => {
                return Err(PluginError::config(
                    "layers_per_checkpoint",
                    "1, or 2 with the layer checkpoint placement (a pair of layers keeps only its \
                     input; use --checkpoint layer)",
                    format!("{layers} with checkpoint {placement:?}"),
                ))
            }
        }
        if self.offload.is_on(self.n_layers) && self.checkpoint == CheckpointPlacement::None {
            return Err(PluginError::config(
                "offload",
                "off without checkpoints (offload moves the checkpoints to host memory; use \
                 --checkpoint layer or attention-output)",
                format!("{:?} with checkpoint None", self.offload),
            ));
        }
        self.block()?.check()
    }

    /// The configuration of every block (its attention, feed-forward width, norm epsilon,
    /// checkpoint placement and groups of heads; offload is set per layer).
    pub fn block(&self) -> Result<TransformerBlockConfig, PluginError> {
        Ok(TransformerBlockConfig::new(self.attention()?, self.d_ff)
            .with_norm_eps(self.norm_eps)
            .with_checkpoint(self.checkpoint)
            .with_attention_head_groups(self.attention_head_groups))
    }

    /// Parameters of the model (embedding, blocks, final norm, output projection if untied).
    pub fn num_params(&self) -> usize {
        let (n_kv, head_dim) = self
            .attention()
            .and_then(|attention| attention.resolved())
            .unwrap_or((self.n_kv_heads, 0));
        let attention = self.d_model * head_dim * (2 * self.n_heads + 2 * n_kv);
        let block = attention + 3 * self.d_model * self.d_ff + 2 * self.d_model;
        let head = if self.tie_embeddings { 0 } else { 1 };
        (1 + head) * self.vocab_size * self.d_model + self.n_layers * block + self.d_model
    }

    /// The shape described by a Hugging Face `config.json`.
    pub fn from_hf(hf: &HfLlamaConfig) -> Self {
        let rope =
            RopeConfig::new()
                .with_theta(hf.rope_theta)
                .with_scaling(hf.rope_scaling.as_ref().map(|s| {
                    Llama3RopeScaling::new(
                        s.factor,
                        s.low_freq_factor,
                        s.high_freq_factor,
                        s.original_max_position_embeddings,
                    )
                }));
        Self::new(
            hf.vocab_size,
            hf.hidden_size,
            hf.num_hidden_layers,
            hf.num_attention_heads,
            hf.num_key_value_heads,
            hf.intermediate_size,
        )
        .with_head_dim(hf.head_dim)
        .with_norm_eps(hf.rms_norm_eps)
        .with_rope(rope)
        .with_tie_embeddings(hf.tie_word_embeddings)
    }
}

/// `text` (a config file's JSON) with every field [`LlamaConfig::new`] does not take filled
/// with its default where the file lacks it (Burn's `Config` deserialisation requires every
/// field); `text` itself where it is not a JSON object holding the fields `new` takes (reading it
/// then says what is wrong).
fn with_defaults(text: &str) -> String {
    let Ok(serde_json::Value::Object(mut fields)) = serde_json::from_str(text) else {
        return text.to_string();
    };
    let number = |field: &str| Some(fields.get(field)?.as_u64()? as usize);
    let required = [
        "vocab_size",
        "d_model",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "d_ff",
    ]
    .map(number);
    let [Some(vocab), Some(d_model), Some(layers), Some(heads), Some(kv_heads), Some(d_ff)] =
        required
    else {
        return text.to_string();
    };
    let defaults = LlamaConfig::new(vocab, d_model, layers, heads, kv_heads, d_ff);
    let Ok(serde_json::Value::Object(defaults)) = serde_json::to_value(defaults) else {
        return text.to_string();
    };
    for (field, default) in defaults {
        fields.entry(field).or_insert(default);
    }
    serde_json::Value::Object(fields).to_string()
}

/// The preset names [`LlamaConfig::preset`] knows.
pub const PRESETS: [&str; 9] = [
    "tiny",
    "llama-7b",
    "llama-gqa",
    "llama-33h",
    "llama-16h",
    "llama-8h",
    "llama-4h",
    "llama-2h",
    "llama3-8b",
];
