//! Reading and writing a Hugging Face Llama `config.json`.
//!
//! Reads both layouts in use: the classic one (`rope_theta` and `rope_scaling` at the top level,
//! `transformers` 4.x) and the `rope_parameters` object that `transformers` 5 writes. Writes the
//! classic layout, which both versions load.

use std::fs;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::Error;

/// The RoPE scaling of a Llama 3.1-style model (`rope_type == "llama3"`).
#[derive(Debug, Clone, PartialEq)]
pub struct HfRopeScaling {
    /// The scaling type; always `"llama3"` (a `"default"` entry means no scaling and is read as
    /// `rope_scaling: None`).
    pub rope_type: String,
    /// How much longer the extended context is than the original one.
    pub factor: f64,
    /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled fully.
    pub low_freq_factor: f64,
    /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are not scaled.
    pub high_freq_factor: f64,
    /// The context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
}

/// The architecture fields of a Hugging Face Llama `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct HfLlamaConfig {
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU feed-forward layer.
    pub intermediate_size: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (grouped-query attention); defaults to `num_attention_heads`.
    pub num_key_value_heads: usize,
    /// Number of transformer blocks.
    pub num_hidden_layers: usize,
    /// Number of rows of the embedding table.
    pub vocab_size: usize,
    /// Epsilon of the RMS norms; defaults to `1e-6`.
    pub rms_norm_eps: f64,
    /// RoPE base frequency; defaults to `10000.0`.
    pub rope_theta: f64,
    /// Llama 3 RoPE scaling, if any.
    pub rope_scaling: Option<HfRopeScaling>,
    /// Whether the output projection reuses the embedding table; defaults to `false`.
    pub tie_word_embeddings: bool,
    /// Longest sequence the model is meant for; defaults to `2048`.
    pub max_position_embeddings: usize,
    /// Per-head width when it is not `hidden_size / num_attention_heads`.
    pub head_dim: Option<usize>,
}

impl HfLlamaConfig {
    /// The per-head width: `head_dim` if given, else `hidden_size / num_attention_heads`
    /// (0 when there are no heads, which [`HfLlamaConfig::validate`] rejects).
    pub fn resolved_head_dim(&self) -> usize {
        self.head_dim.unwrap_or_else(|| {
            self.hidden_size
                .checked_div(self.num_attention_heads)
                .unwrap_or(0)
        })
    }

    /// Checks that the sizes are non-zero and consistent with each other.
    ///
    /// Requires: all sizes positive; `num_attention_heads` dividing `hidden_size` when `head_dim`
    /// is absent; an even head width (RoPE rotates pairs); `num_key_value_heads` dividing
    /// `num_attention_heads`; positive finite `rms_norm_eps` and `rope_theta`; and for Llama 3
    /// scaling a positive `factor`, `0 < low_freq_factor < high_freq_factor`, and a positive
    /// `original_max_position_embeddings`.
    pub fn validate(&self) -> Result<(), Error> {
        self.check(None)
    }

    /// [`validate`](Self::validate), naming `path` (the file read or to be written) in errors.
    fn check(&self, path: Option<&Path>) -> Result<(), Error> {
        let invalid = |what: &str, expected: &str, got: String| Error::Invalid {
            path: path.map(Path::to_path_buf),
            what: format!("the Llama config's {what}"),
            expected: expected.to_string(),
            got,
        };
        let sizes = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("num_hidden_layers", self.num_hidden_layers),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("head_dim", self.head_dim.unwrap_or(1)),
        ];
        for (name, value) in sizes {
            if value == 0 {
                return Err(invalid(&format!("`{name}`"), "at least 1", "0".into()));
            }
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(invalid(
                "`hidden_size` / `num_attention_heads`",
                "a whole number (`num_attention_heads` must divide `hidden_size` unless \
                 `head_dim` is given)",
                format!("{} / {}", self.hidden_size, self.num_attention_heads),
            ));
        }
        let head_dim = self.resolved_head_dim();
        if !head_dim.is_multiple_of(2) {
            return Err(invalid(
                "head width",
                "an even number, because rotary embeddings rotate pairs of dimensions",
                head_dim.to_string(),
            ));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(invalid(
                "`num_attention_heads` / `num_key_value_heads`",
                "a whole number (`num_key_value_heads` must divide `num_attention_heads`: each \
                 key/value head serves the same number of query heads)",
                format!(
                    "{} / {}",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        let positive = "a finite number above 0";
        for (name, value) in [
            ("rms_norm_eps", self.rms_norm_eps),
            ("rope_theta", self.rope_theta),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(invalid(&format!("`{name}`"), positive, value.to_string()));
            }
        }
        if let Some(s) = &self.rope_scaling {
            if s.rope_type != "llama3" {
                return Err(Error::Unsupported {
                    path: path.map(Path::to_path_buf),
                    what: "the Llama config's `rope_scaling.rope_type`".to_string(),
                    expected: "\"llama3\" (use no rope_scaling for the default)".to_string(),
                    got: format!("\"{}\"", s.rope_type),
                });
            }
            if !(s.factor.is_finite() && s.factor > 0.0) {
                return Err(invalid(
                    "`rope_scaling.factor`",
                    positive,
                    s.factor.to_string(),
                ));
            }
            let ordered = s.low_freq_factor > 0.0
                && s.high_freq_factor.is_finite()
                && s.low_freq_factor < s.high_freq_factor;
            if !ordered {
                return Err(invalid(
                    "`rope_scaling` low_freq_factor and high_freq_factor",
                    "0 < low_freq_factor < high_freq_factor",
                    format!("{} and {}", s.low_freq_factor, s.high_freq_factor),
                ));
            }
            if s.original_max_position_embeddings == 0 {
                return Err(invalid(
                    "`rope_scaling.original_max_position_embeddings`",
                    "at least 1",
                    "0".into(),
                ));
            }
        }
        Ok(())
    }
}

/// Typed access to the fields of one JSON object, with errors naming the field.
struct Fields<'a> {
    path: &'a Path,
    object: &'a Map<String, Value>,
    prefix: &'a str,
}

impl Fields<'_> {
    /// The field's value; `None` when absent or `null`.
    fn optional<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>, Error> {
        match self.object.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => T::deserialize(value).map(Some).map_err(|e| Error::Format {
                path: Some(self.path.to_path_buf()),
                what: format!("field `{}{key}`", self.prefix),
                expected: format!("a value of type {}", short_type_name::<T>()),
                source: Box::new(e),
            }),
        }
    }

    fn required<T: DeserializeOwned>(&self, key: &str) -> Result<T, Error> {
        self.optional(key)?.ok_or_else(|| Error::MissingField {
            path: self.path.to_path_buf(),
            field: format!("{}{key}", self.prefix),
        })
    }
}

/// `T`'s name without its module path (`usize`, `String`).
fn short_type_name<T>() -> &'static str {
    let name = std::any::type_name::<T>();
    name.rsplit("::").next().unwrap_or(name)
}

/// The JSON type of `value`, for errors.
fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// RoPE settings read from `rope_scaling` or `rope_parameters`.
struct RopeSettings {
    theta: Option<f64>,
    scaling: Option<HfRopeScaling>,
}

fn parse_rope(path: &Path, name: &str, value: &Value) -> Result<RopeSettings, Error> {
    let Value::Object(object) = value else {
        return Err(Error::Invalid {
            path: Some(path.to_path_buf()),
            what: format!("field `{name}`"),
            expected: "an object or null".to_string(),
            got: json_type(value).to_string(),
        });
    };
    let prefix = format!("{name}.");
    let fields = Fields {
        path,
        object,
        prefix: &prefix,
    };
    let rope_type = match fields.optional::<String>("rope_type")? {
        Some(t) => t,
        None => fields
            .optional::<String>("type")?
            .unwrap_or_else(|| "default".to_string()),
    };
    let theta = fields.optional("rope_theta")?;
    let scaling = match rope_type.as_str() {
        "default" => None,
        "llama3" => Some(HfRopeScaling {
            rope_type,
            factor: fields.required("factor")?,
            low_freq_factor: fields.required("low_freq_factor")?,
            high_freq_factor: fields.required("high_freq_factor")?,
            original_max_position_embeddings: fields
                .required("original_max_position_embeddings")?,
        }),
        _ => {
            return Err(Error::Unsupported {
                path: Some(path.to_path_buf()),
                what: format!("the RoPE scaling type in `{name}`"),
                expected: "\"llama3\" and \"default\"".to_string(),
                got: format!("\"{rope_type}\""),
            })
        }
    };
    Ok(RopeSettings { theta, scaling })
}

fn parse_config(path: &Path, text: &str) -> Result<HfLlamaConfig, Error> {
    let value: Value = serde_json::from_str(text).map_err(|e| Error::Format {
        path: Some(path.to_path_buf()),
        what: "the text".to_string(),
        expected: "JSON".to_string(),
        source: Box::new(e),
    })?;
    let Value::Object(object) = &value else {
        return Err(Error::Invalid {
            path: Some(path.to_path_buf()),
            what: "the top level".to_string(),
            expected: "a JSON object".to_string(),
            got: json_type(&value).to_string(),
        });
    };
    let fields = Fields {
        path,
        object,
        prefix: "",
    };
    let unsupported = |key: &str, expected: &str, got: String| Error::Unsupported {
        path: Some(path.to_path_buf()),
        what: format!("`{key}`"),
        expected: expected.to_string(),
        got,
    };
    if let Some(model_type) = fields.optional::<String>("model_type")? {
        if model_type != "llama" {
            return Err(unsupported(
                "model_type",
                "\"llama\"",
                format!("\"{model_type}\""),
            ));
        }
    }
    if let Some(act) = fields.optional::<String>("hidden_act")? {
        if act != "silu" {
            return Err(unsupported(
                "hidden_act",
                "\"silu\" (SwiGLU)",
                format!("\"{act}\""),
            ));
        }
    }
    for key in ["attention_bias", "mlp_bias"] {
        if fields.optional::<bool>(key)? == Some(true) {
            return Err(unsupported(
                key,
                "false (bias-free Llama projections)",
                "true".to_string(),
            ));
        }
    }

    // `rope_parameters` (transformers 5) takes precedence over `rope_scaling` (transformers 4).
    let rope = match (object.get("rope_parameters"), object.get("rope_scaling")) {
        (Some(v), _) if !v.is_null() => parse_rope(path, "rope_parameters", v)?,
        (_, Some(v)) if !v.is_null() => parse_rope(path, "rope_scaling", v)?,
        _ => RopeSettings {
            theta: None,
            scaling: None,
        },
    };
    let num_attention_heads = fields.required("num_attention_heads")?;
    let config = HfLlamaConfig {
        hidden_size: fields.required("hidden_size")?,
        intermediate_size: fields.required("intermediate_size")?,
        num_attention_heads,
        num_key_value_heads: fields
            .optional("num_key_value_heads")?
            .unwrap_or(num_attention_heads),
        num_hidden_layers: fields.required("num_hidden_layers")?,
        vocab_size: fields.required("vocab_size")?,
        rms_norm_eps: fields.optional("rms_norm_eps")?.unwrap_or(1e-6),
        rope_theta: match rope.theta {
            Some(theta) => theta,
            None => fields.optional("rope_theta")?.unwrap_or(10000.0),
        },
        rope_scaling: rope.scaling,
        tie_word_embeddings: fields.optional("tie_word_embeddings")?.unwrap_or(false),
        max_position_embeddings: fields.optional("max_position_embeddings")?.unwrap_or(2048),
        head_dim: fields.optional("head_dim")?,
    };
    config.check(Some(path))?;
    Ok(config)
}

/// Reads and validates a Hugging Face Llama `config.json`.
///
/// Defaults follow `transformers`' `LlamaConfig`. Besides the errors of
/// [`HfLlamaConfig::validate`], rejects a `model_type` other than `"llama"`, a `hidden_act` other
/// than `"silu"`, and `attention_bias` or `mlp_bias` set to true.
pub fn read_hf_config(path: &Path) -> Result<HfLlamaConfig, Error> {
    let text = fs::read_to_string(path).map_err(Error::io("read the config file", path))?;
    parse_config(path, &text)
}

/// Writes a `config.json` that [`read_hf_config`] and `transformers`' `LlamaConfig` both load.
///
/// Validates the config first, and writes `"model_type": "llama"`,
/// `"architectures": ["LlamaForCausalLM"]`, `"hidden_act": "silu"`, no biases, and `rope_theta`
/// with `rope_scaling` at the top level; `head_dim` is written only when set.
pub fn write_hf_config(path: &Path, config: &HfLlamaConfig) -> Result<(), Error> {
    config.check(Some(path))?;
    let mut object = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "num_hidden_layers": config.num_hidden_layers,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
    });
    if let Value::Object(map) = &mut object {
        if let Some(head_dim) = config.head_dim {
            map.insert("head_dim".to_string(), head_dim.into());
        }
        if let Some(s) = &config.rope_scaling {
            map.insert(
                "rope_scaling".to_string(),
                serde_json::json!({
                    "rope_type": s.rope_type,
                    "factor": s.factor,
                    "low_freq_factor": s.low_freq_factor,
                    "high_freq_factor": s.high_freq_factor,
                    "original_max_position_embeddings": s.original_max_position_embeddings,
                }),
            );
        }
    }
    let mut text = serde_json::to_string_pretty(&object).map_err(|e| Error::Format {
        path: Some(path.to_path_buf()),
        what: "the config to write".to_string(),
        expected: "JSON".to_string(),
        source: Box::new(e),
    })?;
    text.push('\n');
    fs::write(path, text).map_err(Error::io("write the config file", path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;

    use distflash_test_support::TempDir;

    const LLAMA_32_1B: &str = r#"{
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_hidden_layers": 16, "vocab_size": 128256,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "head_dim": 64,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": true, "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16", "attention_bias": false, "mlp_bias": false
    }"#;

    /// Parses `text` as if read from a file named `config.json`.
    fn parse(text: &str) -> Result<HfLlamaConfig, Error> {
        parse_config(Path::new("config.json"), text)
    }

    /// `LLAMA_32_1B` with one top-level field replaced (or removed, for `None`).
    fn edited(key: &str, value: Option<Value>) -> String {
        let mut v: Value = serde_json::from_str(LLAMA_32_1B).unwrap();
        let map = v.as_object_mut().unwrap();
        match value {
            Some(value) => map.insert(key.to_string(), value),
            None => map.remove(key),
        };
        v.to_string()
    }

    #[test]
    fn parses_llama_3_2_config() {
        let c = parse(LLAMA_32_1B).unwrap();
        assert_eq!(c.hidden_size, 2048);
        assert_eq!(c.intermediate_size, 8192);
        assert_eq!((c.num_attention_heads, c.num_key_value_heads), (32, 8));
        assert_eq!((c.num_hidden_layers, c.vocab_size), (16, 128256));
        assert_eq!((c.rms_norm_eps, c.rope_theta), (1e-5, 500000.0));
        assert!(c.tie_word_embeddings);
        assert_eq!(c.max_position_embeddings, 131072);
        assert_eq!(c.head_dim, Some(64));
        let s = c.rope_scaling.unwrap();
        assert_eq!(s.rope_type, "llama3");
        assert_eq!(
            (s.factor, s.low_freq_factor, s.high_freq_factor),
            (32.0, 1.0, 4.0)
        );
        assert_eq!(s.original_max_position_embeddings, 8192);
    }

    #[test]
    fn defaults_apply_to_minimal_config() {
        let c = parse(
            r#"{"hidden_size": 64, "intermediate_size": 172, "num_attention_heads": 4,
                "num_hidden_layers": 2, "vocab_size": 256, "num_key_value_heads": null}"#,
        )
        .unwrap();
        assert_eq!(c.num_key_value_heads, 4);
        assert_eq!(c.rms_norm_eps, 1e-6);
        assert_eq!(c.rope_theta, 10000.0);
        assert_eq!(c.rope_scaling, None);
        assert!(!c.tie_word_embeddings);
        assert_eq!(c.max_position_embeddings, 2048);
        assert_eq!(c.head_dim, None);
        assert_eq!(c.resolved_head_dim(), 16);
    }

    #[test]
    fn rope_variants() {
        // The older "type" key and the "default" type (no scaling).
        let legacy = serde_json::json!({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = parse(&edited("rope_scaling", Some(legacy))).unwrap();
        assert_eq!(c.rope_scaling.unwrap().factor, 8.0);
        let c = parse(&edited(
            "rope_scaling",
            Some(serde_json::json!({"rope_type": "default"})),
        ));
        assert_eq!(c.unwrap().rope_scaling, None);

        // transformers 5 layout: theta inside rope_parameters, which wins over rope_scaling.
        let params = serde_json::json!({"rope_type": "default", "rope_theta": 1234.0});
        let c = parse(&edited("rope_parameters", Some(params))).unwrap();
        assert_eq!((c.rope_theta, c.rope_scaling), (1234.0, None));

        let err = parse(&edited(
            "rope_scaling",
            Some(serde_json::json!({"rope_type": "yarn"})),
        ));
        let err = err.unwrap_err();
        assert!(
            matches!(err, Error::Unsupported { ref got, .. } if got == "\"yarn\""),
            "{err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("\"yarn\"") && msg.contains("\"llama3\" and \"default\""),
            "{msg}"
        );

        let incomplete = serde_json::json!({"rope_type": "llama3", "factor": 8.0});
        let err = parse(&edited("rope_scaling", Some(incomplete))).unwrap_err();
        assert!(
            matches!(err, Error::MissingField { ref field, .. } if field == "rope_scaling.low_freq_factor"),
            "{err}"
        );
        let reversed = serde_json::json!({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 4.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 8192});
        let err = parse(&edited("rope_scaling", Some(reversed))).unwrap_err();
        assert!(
            err.to_string()
                .contains("low_freq_factor < high_freq_factor"),
            "{err}"
        );
    }

    #[test]
    fn missing_and_mistyped_fields() {
        for field in [
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_hidden_layers",
            "vocab_size",
        ] {
            let err = parse(&edited(field, None)).unwrap_err();
            assert!(
                matches!(err, Error::MissingField { field: ref f, .. } if f == field),
                "{field}: {err}"
            );
            assert!(err.to_string().contains(field));
        }
        let err = parse(&edited("hidden_size", Some("2048".into()))).unwrap_err();
        assert!(
            matches!(err, Error::Format { ref what, .. } if what == "field `hidden_size`"),
            "{err}"
        );
        assert!(
            err.to_string().contains(
                "field `hidden_size` is not a value of type usize: invalid type: string \"2048\""
            ),
            "{err}"
        );
    }

    #[test]
    fn bad_json_reports_serde_message() {
        let err = parse(r#"{"hidden_size": 64,"#).unwrap_err();
        assert!(matches!(err, Error::Format { .. }), "{err}");
        assert!(err.to_string().contains("EOF while parsing"), "{err}");
        let err = parse("[1, 2]").unwrap_err();
        assert!(
            matches!(err, Error::Invalid { ref expected, ref got, .. }
                if expected == "a JSON object" && got == "an array"),
            "{err}"
        );
    }

    #[test]
    fn wrong_model_type_and_unsupported_variants() {
        let err = parse(&edited("model_type", Some("mistral".into()))).unwrap_err();
        assert!(
            matches!(err, Error::Unsupported { ref what, ref got, .. }
                if what == "`model_type`" && got == "\"mistral\""),
            "{err}"
        );
        assert!(err.to_string().contains("only \"llama\""));
        let err = parse(&edited("hidden_act", Some("gelu".into()))).unwrap_err();
        assert!(err.to_string().contains("only \"silu\""), "{err}");
        let err = parse(&edited("attention_bias", Some(true.into()))).unwrap_err();
        assert!(
            err.to_string().contains("`attention_bias` is true"),
            "{err}"
        );
    }

    #[test]
    fn inconsistent_values() {
        let expect = |text: String, needle: &str| {
            let err = parse(&text).unwrap_err();
            assert!(matches!(err, Error::Invalid { .. }), "{err}");
            assert!(
                err.to_string().contains(needle),
                "expected `{needle}` in: {err}"
            );
        };
        // 2048 / 24 is not whole; with head_dim present the split need not be exact.
        let mut v: Value = serde_json::from_str(&edited("head_dim", None)).unwrap();
        v["num_attention_heads"] = 24.into();
        v["num_key_value_heads"] = 8.into();
        expect(v.to_string(), "must divide `hidden_size`");
        v["head_dim"] = 64.into();
        assert_eq!(parse(&v.to_string()).unwrap().resolved_head_dim(), 64);

        expect(
            edited("num_key_value_heads", Some(5.into())),
            "must divide `num_attention_heads`",
        );
        expect(edited("vocab_size", Some(0.into())), "`vocab_size` is 0");
        expect(
            edited("num_hidden_layers", Some(0.into())),
            "`num_hidden_layers` is 0",
        );
        expect(edited("head_dim", Some(0.into())), "`head_dim` is 0");
        expect(
            edited("head_dim", Some(63.into())),
            "is 63; expected an even number",
        );
        expect(
            edited("rms_norm_eps", Some((-1.0).into())),
            "`rms_norm_eps` is -1",
        );
    }

    #[test]
    fn missing_file_error() {
        let tmp = TempDir::new("missing");
        let err = read_hf_config(&tmp.path().join("config.json")).unwrap_err();
        assert!(
            matches!(err, Error::Io { ref source, .. } if source.kind() == io::ErrorKind::NotFound),
            "{err}"
        );
        assert!(
            err.to_string().contains("cannot read the config file"),
            "{err}"
        );
    }

    #[test]
    fn write_read_round_trip() {
        let tmp = TempDir::new("round-trip");
        let path = tmp.path().join("config.json");
        let mut config = parse(LLAMA_32_1B).unwrap();
        config.rms_norm_eps = 1.2345678901234e-7;
        write_hf_config(&path, &config).unwrap();
        assert_eq!(read_hf_config(&path).unwrap(), config);
        let written: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(written["model_type"], "llama");
        assert_eq!(
            written["architectures"],
            serde_json::json!(["LlamaForCausalLM"])
        );
        assert_eq!(written["rope_scaling"]["rope_type"], "llama3");

        let small = HfLlamaConfig {
            hidden_size: 48,
            intermediate_size: 128,
            num_attention_heads: 3,
            num_key_value_heads: 1,
            num_hidden_layers: 1,
            vocab_size: 256,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scaling: None,
            tie_word_embeddings: false,
            max_position_embeddings: 64,
            head_dim: None,
        };
        write_hf_config(&path, &small).unwrap();
        assert_eq!(read_hf_config(&path).unwrap(), small);
        let written: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        assert!(written.get("head_dim").is_none() && written.get("rope_scaling").is_none());

        let bad = HfLlamaConfig {
            num_key_value_heads: 2,
            ..small
        };
        assert!(bad.validate().is_err());
        assert!(matches!(
            write_hf_config(&path, &bad),
            Err(Error::Invalid { path: Some(_), .. })
        ));
    }
}
