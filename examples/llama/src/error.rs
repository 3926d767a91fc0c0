//! [`Error`]: the one error type of this crate, grouped by what went wrong. Where the crate
//! knows what it expected and what it was given, the variant carries both.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use burn_distflash::Error as PluginError;

/// Everything that can go wrong in this crate: files, formats, values, checkpoints, the
/// tokenizer, and the attention and collectives of the plugin.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A file or directory could not be read, written, created, mapped or renamed.
    Io {
        /// What was being done, as a verb phrase ("read the text file").
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        source: io::Error,
    },
    /// A file or directory that must exist does not.
    NotFound {
        /// The path looked for.
        path: PathBuf,
        /// What should be there.
        expected: String,
    },
    /// Text or bytes are not in the format they must have (JSON, `tokenizer.json`,
    /// safetensors, a metrics log line), as its parser reports; or data to be written cannot
    /// be put in that format.
    Format {
        /// The file, or `None` for text given directly.
        path: Option<PathBuf>,
        /// The part that is wrong ("the text", "field `hidden_size`", "line 3 of the metrics
        /// log").
        what: String,
        /// The format it must have.
        expected: String,
        /// The parser's or serialiser's error, which says what it found.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A required field of a JSON file is absent or `null`.
    MissingField {
        /// The file.
        path: PathBuf,
        /// The field's name (`rope_scaling.factor` for nested fields).
        field: String,
    },
    /// A value is out of range, or disagrees with another value it must match.
    Invalid {
        /// The file the value comes from or goes to, if any.
        path: Option<PathBuf>,
        /// The value ("the validation fraction", "`vocab_size`").
        what: String,
        /// What is allowed.
        expected: String,
        /// What was given.
        got: String,
    },
    /// A value is well-formed but names something this crate does not implement (another
    /// model type, activation, RoPE scaling or dtype).
    Unsupported {
        /// The file the value comes from or goes to, if any.
        path: Option<PathBuf>,
        /// The value ("`model_type`", "the dtype of tensor `x`").
        what: String,
        /// What this crate supports.
        expected: String,
        /// What was given.
        got: String,
    },
    /// A tensor's shape differs from the one the model configuration implies.
    Shape {
        /// The checkpoint directory, or `None` for a model in memory.
        path: Option<PathBuf>,
        /// The tensor's Hugging Face name.
        tensor: String,
        /// The shape the configuration implies (Hugging Face layout).
        expected: Vec<usize>,
        /// The tensor's shape (Hugging Face layout).
        got: Vec<usize>,
    },
    /// Tensors the configuration requires are absent from a checkpoint.
    MissingTensors {
        /// The model directory.
        dir: PathBuf,
        /// The first missing names (at most five).
        names: Vec<String>,
        /// How many are missing in all.
        total: usize,
    },
    /// A checkpoint holds tensors that no part of the model takes.
    UnexpectedTensors {
        /// The model directory.
        dir: PathBuf,
        /// The first unexpected names (at most five).
        names: Vec<String>,
        /// How many are unexpected in all.
        total: usize,
    },
    /// The configuration describes a model the plugin's layers cannot build (for instance a
    /// head width the attention kernels do not support).
    Config {
        /// The `config.json` read or to be written, if any.
        path: Option<PathBuf>,
        /// What the plugin reported.
        source: PluginError,
    },
    /// The `tokenizers` library could not encode the text or decode the ids.
    Tokenizer {
        /// What was being done ("encode the text").
        action: &'static str,
        /// The library's error.
        source: tokenizers::Error,
    },
    /// Writing or reading a training checkpoint (model, optimizer state, `trainer.json`)
    /// failed.
    Checkpoint {
        /// What was being done ("write the model").
        action: &'static str,
        /// The checkpoint directory.
        dir: PathBuf,
        /// Burn's recorder or config error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The model or its attention refused its input, or a peer of its group failed.
    Attention {
        /// What was running ("training step", "generation").
        during: &'static str,
        /// The plugin's error.
        source: PluginError,
    },
    /// The backward pass failed (Burn's backward cannot return an error: a sequence-parallel
    /// attention whose peer died or went silent panics with the group's error, which this
    /// carries).
    Backward {
        /// What the failed pass said.
        message: String,
    },
    /// A device thread failed during a step (above all, the GPU ran out of memory): the step's
    /// numbers are not valid ([`burn_distflash::device_faults`]).
    Device {
        /// The phase whose end found it ("the forward", "the backward", "the optimizer step").
        during: &'static str,
        /// The first fault.
        fault: burn_distflash::device_faults::DeviceFault,
    },
    /// Summing over the device group failed.
    Comm {
        /// What was being summed ("the gradients").
        what: &'static str,
        /// The plugin's error.
        source: PluginError,
    },
}

impl Error {
    /// An [`Error::Io`] on `path`.
    pub(crate) fn io<'a>(
        action: &'static str,
        path: &'a Path,
    ) -> impl FnOnce(io::Error) -> Self + 'a {
        move |source| Self::Io {
            action,
            path: path.to_path_buf(),
            source,
        }
    }

    /// An [`Error::Invalid`] with no file.
    pub(crate) fn invalid(
        what: impl Into<String>,
        expected: impl Into<String>,
        got: impl fmt::Display,
    ) -> Self {
        Self::Invalid {
            path: None,
            what: what.into(),
            expected: expected.into(),
            got: got.to_string(),
        }
    }
}

/// `` `a`, `b`, `c` `` followed by "and N more" when only some of `total` names are listed.
fn name_list(names: &[String], total: usize) -> String {
    let mut out = names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if total > names.len() {
        out.push_str(&format!(" and {} more", total - names.len()));
    }
    out
}

/// `"{path}: "`, or nothing without a path.
fn prefix(path: &Option<PathBuf>) -> String {
    path.as_ref()
        .map_or_else(String::new, |p| format!("{}: ", p.display()))
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io {
                action,
                path,
                source,
            } => write!(f, "cannot {action} {}: {source}", path.display()),
            Self::NotFound { path, expected } => {
                write!(f, "{} does not exist; expected {expected}", path.display())
            }
            Self::Format {
                path,
                what,
                expected,
                source,
            } => write!(f, "{}{what} is not {expected}: {source}", prefix(path)),
            Self::MissingField { path, field } => write!(
                f,
                "{} lacks the required field `{field}` (or it is null)",
                path.display()
            ),
            Self::Invalid {
                path,
                what,
                expected,
                got,
            } => write!(f, "{}{what} is {got}; expected {expected}", prefix(path)),
            Self::Unsupported {
                path,
                what,
                expected,
                got,
            } => write!(
                f,
                "{}{what} is {got}; this crate supports only {expected}",
                prefix(path)
            ),
            Self::Shape {
                path: Some(dir),
                tensor,
                expected,
                got,
            } => write!(
                f,
                "tensor `{tensor}` in {} has shape {got:?}, but config.json implies {expected:?}",
                dir.display()
            ),
            Self::Shape {
                path: None,
                tensor,
                expected,
                got,
            } => write!(
                f,
                "the model's `{tensor}` has shape {got:?} (Hugging Face layout), but its config \
                 implies {expected:?}"
            ),
            Self::MissingTensors { dir, names, total } => write!(
                f,
                "the safetensors weights in {} lack {total} tensor(s) the config requires: {}",
                dir.display(),
                name_list(names, *total)
            ),
            Self::UnexpectedTensors { dir, names, total } => write!(
                f,
                "the safetensors weights in {} hold {total} tensor(s) a Llama model with this \
                 config does not have: {}; expected only Hugging Face Llama names \
                 (model.embed_tokens, model.layers.<i>.*, model.norm, lm_head) for the configured \
                 number of layers",
                dir.display(),
                name_list(names, *total)
            ),
            Self::Config { path, source } => write!(f, "{}{source}", prefix(path)),
            Self::Tokenizer { action, source } => write!(f, "cannot {action}: {source}"),
            Self::Checkpoint {
                action,
                dir,
                source,
            } => write!(f, "checkpoint {}: cannot {action}: {source}", dir.display()),
            Self::Attention { during, source } => write!(f, "{during}: {source}"),
            Self::Backward { message } => write!(f, "the backward pass failed: {message}"),
            Self::Device { during, fault } => write!(f, "during {during}, {fault}"),
            Self::Comm { what, source } => {
                write!(f, "summing {what} over the group: {source}")
            }
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            Self::Format { source, .. } | Self::Checkpoint { source, .. } => Some(source.as_ref()),
            Self::Config { source, .. } => Some(source),
            Self::Tokenizer { source, .. } => Some(source.as_ref()),
            Self::Attention { source, .. } => Some(source),
            Self::Comm { source, .. } => Some(source),
            Self::NotFound { .. }
            | Self::Backward { .. }
            | Self::Device { .. }
            | Self::MissingField { .. }
            | Self::Invalid { .. }
            | Self::Unsupported { .. }
            | Self::Shape { .. }
            | Self::MissingTensors { .. }
            | Self::UnexpectedTensors { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn messages_say_what_was_expected_and_what_was_given() {
        let e = Error::invalid("the context length", "at least 1", 0);
        assert_eq!(
            e.to_string(),
            "the context length is 0; expected at least 1"
        );
        assert!(e.source().is_none());
        let e = Error::Unsupported {
            path: Some("config.json".into()),
            what: "`model_type`".into(),
            expected: "\"llama\"".into(),
            got: "\"mistral\"".into(),
        };
        assert_eq!(
            e.to_string(),
            "config.json: `model_type` is \"mistral\"; this crate supports only \"llama\""
        );
        let names = ["a", "b"].map(String::from).to_vec();
        assert_eq!(name_list(&names, 2), "`a`, `b`");
        assert_eq!(name_list(&names, 5), "`a`, `b` and 3 more");
    }

    #[test]
    fn wrapped_errors_are_sources() {
        let missing = io::Error::new(io::ErrorKind::NotFound, "gone");
        let e = Error::io("read the text file", Path::new("a.txt"))(missing);
        assert_eq!(e.to_string(), "cannot read the text file a.txt: gone");
        assert_eq!(e.source().unwrap().to_string(), "gone");
        let json = serde_json::from_str::<serde_json::Value>("{").unwrap_err();
        let e = Error::Format {
            path: None,
            what: "the text".into(),
            expected: "JSON".into(),
            source: json.into(),
        };
        assert!(e.source().unwrap().to_string().contains("EOF"), "{e}");
    }
}
