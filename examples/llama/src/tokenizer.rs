//! Text tokenizers: raw bytes, or the BPE tokenizers of Hugging Face `tokenizer.json` files.
//!
//! Two BPE families are supported, both encoded and decoded here without the `tokenizers` or
//! `regex` crates:
//!
//! - **Byte-level BPE** (GPT-2, Llama 3): a `ByteLevel` pre-tokenizer, optionally after a `Split`
//!   on the GPT-2 or the Llama 3 regex. Text is split into words, each word's UTF-8 bytes are
//!   mapped to GPT-2's printable "bytes-to-unicode" alphabet, and merges are applied by rank.
//! - **SentencePiece-style BPE** (Llama 2): `byte_fallback: true` and the `"▁"` metaspace, given
//!   either as the legacy normalizer (`Prepend("▁")` then `Replace(" ", "▁")`) or as a
//!   `Metaspace` pre-tokenizer. Characters missing from the vocabulary become `<0xXX>` byte tokens.
//!
//! Added tokens (such as `<|endoftext|>` or `<s>`) are matched in the raw text first, longest
//! first, as `tokenizers` does by default (their `lstrip`, `rstrip`, `single_word` and
//! `normalized` flags are ignored). `encode` adds no BOS/EOS: look them up with
//! [`token_id`](crate::tokenizer::Tokenizer::token_id) and add them yourself. `decode`
//! keeps special tokens' text.
//!
//! The word split is a hand-written matcher for the two regexes, not a regex engine, and it is
//! exact except for Unicode property tables: `\p{L}` is approximated by "alphabetic and not
//! numeric" ([`char::is_alphabetic`]), which also counts combining marks of some scripts (for
//! example Devanagari vowel signs) and circled letters such as `Ⓐ` as letters, where the regex
//! counts them as punctuation; `\p{N}` is [`char::is_numeric`] and `\s` is
//! [`char::is_whitespace`], which match the regex classes. The Llama 3 regex's case-insensitive
//! contractions are matched for ASCII letters only. Where a split differs, the ids can differ
//! from `tokenizers`' but still decode to the same text.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::Deserialize;
use serde_json::Value;

/// The GPT-2 pre-tokenizer regex (also used by `ByteLevel` with `use_regex: true`).
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The Llama 3 pre-tokenizer regex.
const LLAMA3_PATTERN: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// What the error message for unsupported tokenizers says is supported.
const SUPPORTED: &str = "supported are byte-level BPE (GPT-2 / Llama 3 style: a ByteLevel \
    pre-tokenizer, optionally after a Split on the GPT-2 or Llama 3 regex) and SentencePiece-style \
    BPE with byte_fallback and the \"▁\" metaspace (Llama 2 style)";

/// Vocabulary size of [`Tokenizer::Bytes`].
pub const BYTE_VOCAB_SIZE: usize = 256;

/// A text tokenizer.
// A program holds one tokenizer, so the size gap between the variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Tokenizer {
    /// One token per UTF-8 byte: token id = byte value, vocabulary size 256.
    Bytes,
    /// A BPE tokenizer loaded from a Hugging Face `tokenizer.json`.
    Bpe(BpeTokenizer),
}

impl Tokenizer {
    /// The byte-level tokenizer: each UTF-8 byte is one token.
    pub fn bytes() -> Self {
        Tokenizer::Bytes
    }

    /// Loads a Hugging Face `tokenizer.json` (see the module docs for the supported kinds).
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let text = fs::read_to_string(path).map_err(|source| TokenizerError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        BpeTokenizer::from_json_str(&text)
            .map(Tokenizer::Bpe)
            .map_err(|error| TokenizerError::InFile {
                path: path.to_path_buf(),
                error: Box::new(error),
            })
    }

    /// Encodes text into token ids (no BOS/EOS added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match self {
            Tokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::Bpe(bpe) => bpe.encode(text),
        }
    }

    /// Decodes token ids into text; invalid UTF-8 and unknown ids become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Tokenizer::Bytes => {
                let mut bytes = Vec::with_capacity(ids.len());
                for &id in ids {
                    match u8::try_from(id) {
                        Ok(b) => bytes.push(b),
                        Err(_) => bytes.extend_from_slice(REPLACEMENT.as_bytes()),
                    }
                }
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Tokenizer::Bpe(bpe) => bpe.decode(ids),
        }
    }

    /// Number of embedding rows a model needs: one more than the largest token id.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Bytes => BYTE_VOCAB_SIZE,
            Tokenizer::Bpe(bpe) => bpe.vocab_size,
        }
    }

    /// The id of a named token (added tokens first, then the vocabulary); `None` for
    /// [`Tokenizer::Bytes`], which has no named tokens.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::Bpe(bpe) => bpe
                .added
                .iter()
                .find(|(content, _)| content == token)
                .map(|&(_, id)| id)
                .or_else(|| bpe.vocab.get(token).copied()),
        }
    }
}

const REPLACEMENT: &str = "\u{FFFD}";

/// Everything that can go wrong loading a tokenizer or encoding text.
#[derive(Debug)]
pub enum TokenizerError {
    /// The tokenizer file could not be read.
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// A problem in a tokenizer file, with the file's path.
    InFile {
        /// The file involved.
        path: PathBuf,
        /// The problem.
        error: Box<TokenizerError>,
    },
    /// The tokenizer JSON is malformed or a field has the wrong type.
    Json {
        /// What was wrong, with serde's message.
        message: String,
    },
    /// The tokenizer JSON is well-formed but inconsistent (for example a merge of unknown tokens).
    Invalid {
        /// What was wrong.
        message: String,
    },
    /// The tokenizer is of a kind this module does not implement.
    Unsupported {
        /// What was found.
        what: String,
    },
    /// Text contains something the vocabulary cannot express (no byte tokens, no unk token).
    UnknownPiece {
        /// The character or byte that could not be encoded.
        what: String,
    },
}

impl fmt::Display for TokenizerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io { path, source } => {
                write!(f, "cannot read tokenizer file {}: {source}", path.display())
            }
            Self::InFile { path, error } => write!(f, "{}: {error}", path.display()),
            Self::Json { message } => write!(f, "malformed tokenizer.json: {message}"),
            Self::Invalid { message } => write!(f, "invalid tokenizer.json: {message}"),
            Self::Unsupported { what } => write!(f, "unsupported tokenizer: {what}; {SUPPORTED}"),
            Self::UnknownPiece { what } => write!(
                f,
                "cannot encode {what}: it is not in the vocabulary, and the tokenizer has neither \
                 byte tokens for it nor an unk_token"
            ),
        }
    }
}

impl std::error::Error for TokenizerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            Self::InFile { error, .. } => Some(error.as_ref()),
            _ => None,
        }
    }
}

fn json_err(message: String) -> TokenizerError {
    TokenizerError::Json { message }
}

fn invalid(message: String) -> TokenizerError {
    TokenizerError::Invalid { message }
}

fn unsupported(what: String) -> TokenizerError {
    TokenizerError::Unsupported { what }
}

// ---------------------------------------------------------------------------------------------
// GPT-2 bytes-to-unicode alphabet.

/// Byte → char of GPT-2's alphabet, and char (below U+0200) → byte.
struct ByteAlphabet {
    to_char: [char; 256],
    to_byte: [Option<u8>; 512],
}

fn byte_alphabet() -> &'static ByteAlphabet {
    static ALPHABET: OnceLock<ByteAlphabet> = OnceLock::new();
    ALPHABET.get_or_init(|| {
        let mut to_char = ['\0'; 256];
        let mut to_byte = [None; 512];
        let mut extra = 0u32;
        for b in 0..=255u8 {
            let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
            let code = if printable {
                u32::from(b)
            } else {
                extra += 1;
                255 + extra
            };
            // Codes are below 512, all valid scalar values.
            let c = char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER);
            to_char[usize::from(b)] = c;
            to_byte[code as usize] = Some(b);
        }
        ByteAlphabet { to_char, to_byte }
    })
}

fn char_to_byte(c: char) -> Option<u8> {
    byte_alphabet().to_byte.get(c as usize).copied().flatten()
}

// ---------------------------------------------------------------------------------------------
// Word splitting: hand-written matchers for the GPT-2 and Llama 3 regexes.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

fn class(c: char) -> Class {
    if c.is_whitespace() {
        Class::Space
    } else if c.is_numeric() {
        Class::Number
    } else if c.is_alphabetic() {
        Class::Letter
    } else {
        Class::Other
    }
}

/// Which regex a split follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pattern {
    Gpt2,
    Llama3,
}

impl Pattern {
    fn from_regex(regex: &str) -> Option<Self> {
        match regex {
            GPT2_PATTERN => Some(Pattern::Gpt2),
            LLAMA3_PATTERN => Some(Pattern::Llama3),
            _ => None,
        }
    }

    /// Splits `text` into the pieces `regex.find_iter` would return (they cover all of `text`).
    fn split(self, text: &str) -> Vec<&str> {
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        let classes: Vec<Class> = chars.iter().map(|&(_, c)| class(c)).collect();
        let mut pieces = Vec::new();
        let mut i = 0;
        while i < chars.len() {
            let end = match self {
                Pattern::Gpt2 => gpt2_match(&chars, &classes, i),
                Pattern::Llama3 => llama3_match(&chars, &classes, i),
            };
            let from = chars[i].0;
            let to = chars.get(end).map_or(text.len(), |&(offset, _)| offset);
            pieces.push(&text[from..to]);
            i = end;
        }
        pieces
    }
}

/// End (exclusive) of the run of `class` starting at `i`.
fn run_end(classes: &[Class], i: usize, class: Class) -> usize {
    classes[i..]
        .iter()
        .position(|&c| c != class)
        .map_or(classes.len(), |k| i + k)
}

/// Length of a contraction (`'s`, `'t`, `'re`, `'ve`, `'m`, `'ll`, `'d`) starting at `i`.
fn contraction(chars: &[(usize, char)], i: usize, ignore_case: bool) -> Option<usize> {
    if chars[i].1 != '\'' {
        return None;
    }
    let at = |k: usize| {
        chars.get(i + k).map(|&(_, c)| {
            if ignore_case {
                c.to_ascii_lowercase()
            } else {
                c
            }
        })
    };
    match (at(1), at(2)) {
        (Some('s' | 't' | 'm' | 'd'), _) => Some(2),
        (Some('r' | 'v'), Some('e')) | (Some('l'), Some('l')) => Some(3),
        _ => None,
    }
}

/// Whitespace rules shared by both regexes: `\s+(?!\S)|\s+`.
fn whitespace_match(classes: &[Class], i: usize) -> usize {
    let end = run_end(classes, i, Class::Space);
    if end < classes.len() && end - i >= 2 {
        end - 1
    } else {
        end
    }
}

/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
fn gpt2_match(chars: &[(usize, char)], classes: &[Class], i: usize) -> usize {
    if let Some(len) = contraction(chars, i, false) {
        return i + len;
    }
    let body = if chars[i].1 == ' ' && i + 1 < chars.len() && classes[i + 1] != Class::Space {
        i + 1
    } else {
        i
    };
    match classes[body] {
        Class::Space => whitespace_match(classes, i),
        class => run_end(classes, body, class),
    }
}

/// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|`
/// `\s*[\r\n]+|\s+(?!\S)|\s+`
fn llama3_match(chars: &[(usize, char)], classes: &[Class], i: usize) -> usize {
    let n = chars.len();
    let newline = |k: usize| matches!(chars[k].1, '\r' | '\n');
    if let Some(len) = contraction(chars, i, true) {
        return i + len;
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if classes[i] == Class::Letter {
        return run_end(classes, i, Class::Letter);
    }
    if classes[i] != Class::Number && !newline(i) && i + 1 < n && classes[i + 1] == Class::Letter {
        return run_end(classes, i + 1, Class::Letter);
    }
    // \p{N}{1,3}
    if classes[i] == Class::Number {
        return run_end(classes, i, Class::Number).min(i + 3);
    }
    // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    let body = if chars[i].1 == ' ' && i + 1 < n && classes[i + 1] == Class::Other {
        i + 1
    } else {
        i
    };
    if classes[body] == Class::Other {
        let mut end = run_end(classes, body, Class::Other);
        while end < n && newline(end) {
            end += 1;
        }
        return end;
    }
    // \s*[\r\n]+ : up to and including the last newline of the whitespace run.
    let run = run_end(classes, i, Class::Space);
    if let Some(last) = (i..run).rev().find(|&k| newline(k)) {
        return last + 1;
    }
    whitespace_match(classes, i)
}

// ---------------------------------------------------------------------------------------------
// Pipeline configuration parsed from tokenizer.json.

#[derive(Debug, Clone, PartialEq, Eq)]
enum Normalizer {
    Prepend(String),
    Replace { from: String, to: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PrependScheme {
    Always,
    First,
    Never,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum PreTokenizer {
    Split(Pattern),
    ByteLevel {
        add_prefix_space: bool,
        use_regex: bool,
    },
    Metaspace {
        replacement: char,
        prepend: PrependScheme,
        split: bool,
    },
}

fn get_str<'a>(obj: &'a Value, key: &str, what: &str) -> Result<&'a str, TokenizerError> {
    obj.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| json_err(format!("{what} needs a string `{key}`")))
}

fn get_bool(obj: &Value, key: &str, default: bool, what: &str) -> Result<bool, TokenizerError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(json_err(format!("{what}: `{key}` must be true or false"))),
    }
}

fn parse_normalizers(value: &Value, out: &mut Vec<Normalizer>) -> Result<(), TokenizerError> {
    if value.is_null() {
        return Ok(());
    }
    let kind = get_str(value, "type", "a normalizer")?;
    match kind {
        "Sequence" => {
            let list = value
                .get("normalizers")
                .and_then(Value::as_array)
                .ok_or_else(|| {
                    json_err("a Sequence normalizer needs a `normalizers` list".into())
                })?;
            for item in list {
                parse_normalizers(item, out)?;
            }
        }
        "Prepend" => out.push(Normalizer::Prepend(
            get_str(value, "prepend", "the Prepend normalizer")?.to_string(),
        )),
        "Replace" => {
            let pattern = value.get("pattern").unwrap_or(&Value::Null);
            let Some(from) = pattern.get("String").and_then(Value::as_str) else {
                return Err(unsupported(
                    "a Replace normalizer with a regex pattern (only plain strings are)".into(),
                ));
            };
            let to = get_str(value, "content", "the Replace normalizer")?;
            if from.is_empty() {
                return Err(invalid("a Replace normalizer has an empty pattern".into()));
            }
            out.push(Normalizer::Replace {
                from: from.to_string(),
                to: to.to_string(),
            });
        }
        other => return Err(unsupported(format!("normalizer `{other}`"))),
    }
    Ok(())
}

fn parse_pre_tokenizers(value: &Value, out: &mut Vec<PreTokenizer>) -> Result<(), TokenizerError> {
    if value.is_null() {
        return Ok(());
    }
    let kind = get_str(value, "type", "a pre-tokenizer")?;
    match kind {
        "Sequence" => {
            let list = value
                .get("pretokenizers")
                .and_then(Value::as_array)
                .ok_or_else(|| {
                    json_err("a Sequence pre-tokenizer needs a `pretokenizers` list".into())
                })?;
            for item in list {
                parse_pre_tokenizers(item, out)?;
            }
        }
        "ByteLevel" => out.push(PreTokenizer::ByteLevel {
            add_prefix_space: get_bool(value, "add_prefix_space", true, "ByteLevel")?,
            use_regex: get_bool(value, "use_regex", true, "ByteLevel")?,
        }),
        "Split" => {
            let pattern = value.get("pattern").unwrap_or(&Value::Null);
            let Some(regex) = pattern.get("Regex").and_then(Value::as_str) else {
                return Err(unsupported(
                    "a Split pre-tokenizer without a `Regex` pattern".into(),
                ));
            };
            let behavior = value.get("behavior").and_then(Value::as_str);
            if behavior != Some("Isolated") || get_bool(value, "invert", false, "Split")? {
                return Err(unsupported(format!(
                    "a Split pre-tokenizer with behavior {behavior:?} (only \"Isolated\", not \
                     inverted, is)"
                )));
            }
            let pattern = Pattern::from_regex(regex).ok_or_else(|| {
                unsupported(format!(
                    "Split regex `{regex}` (only the GPT-2 and Llama 3 regexes are)"
                ))
            })?;
            out.push(PreTokenizer::Split(pattern));
        }
        "Metaspace" => {
            let replacement = get_str(value, "replacement", "the Metaspace pre-tokenizer")?;
            let mut chars = replacement.chars();
            let (Some(replacement), None) = (chars.next(), chars.next()) else {
                return Err(invalid(format!(
                    "the Metaspace replacement `{replacement}` must be one character"
                )));
            };
            let prepend = match value.get("prepend_scheme").and_then(Value::as_str) {
                Some("always") => PrependScheme::Always,
                Some("first") => PrependScheme::First,
                Some("never") => PrependScheme::Never,
                Some(other) => {
                    return Err(unsupported(format!("Metaspace prepend_scheme `{other}`")))
                }
                None if get_bool(value, "add_prefix_space", true, "Metaspace")? => {
                    PrependScheme::Always
                }
                None => PrependScheme::Never,
            };
            out.push(PreTokenizer::Metaspace {
                replacement,
                prepend,
                split: get_bool(value, "split", true, "Metaspace")?,
            });
        }
        other => return Err(unsupported(format!("pre-tokenizer `{other}`"))),
    }
    Ok(())
}

#[derive(Deserialize)]
#[serde(untagged)]
enum MergeJson {
    Line(String),
    Pair(String, String),
}

#[derive(Deserialize)]
struct ModelJson {
    vocab: HashMap<String, u32>,
    merges: Vec<MergeJson>,
    #[serde(default)]
    byte_fallback: bool,
    #[serde(default)]
    unk_token: Option<String>,
    #[serde(default)]
    fuse_unk: bool,
    #[serde(default)]
    ignore_merges: bool,
    #[serde(default)]
    dropout: Option<f64>,
    #[serde(default)]
    continuing_subword_prefix: Option<String>,
    #[serde(default)]
    end_of_word_suffix: Option<String>,
}

#[derive(Deserialize)]
struct AddedTokenJson {
    id: u32,
    content: String,
}

// ---------------------------------------------------------------------------------------------
// The BPE tokenizer.

/// A BPE tokenizer read from a Hugging Face `tokenizer.json` (see the module docs).
#[derive(Debug, Clone)]
pub struct BpeTokenizer {
    vocab: HashMap<String, u32>,
    id_to_token: HashMap<u32, String>,
    /// (left id, right id) → (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// Added tokens as (content, id), longest content first.
    added: Vec<(String, u32)>,
    /// Indices into `added` by the content's first byte.
    added_by_first_byte: HashMap<u8, Vec<usize>>,
    added_by_id: HashMap<u32, String>,
    normalizers: Vec<Normalizer>,
    pre_tokenizers: Vec<PreTokenizer>,
    /// Byte-level (GPT-2 alphabet) rather than SentencePiece-style.
    byte_level: bool,
    /// Byte-level: id of each byte's alphabet character; SentencePiece: id of `<0xXX>`.
    byte_ids: [Option<u32>; 256],
    byte_fallback: bool,
    unk: Option<u32>,
    fuse_unk: bool,
    ignore_merges: bool,
    /// SentencePiece: the character standing for a space.
    space_char: char,
    /// SentencePiece: drop one leading space when decoding (undoes the prepended `▁`).
    strip_leading_space: bool,
    vocab_size: usize,
}

/// A stretch of input: an added token, or text to normalize and split.
enum Segment<'a> {
    Added(u32),
    Text { text: &'a str, at_start: bool },
}

impl BpeTokenizer {
    /// Parses the contents of a `tokenizer.json`.
    pub fn from_json_str(json: &str) -> Result<Self, TokenizerError> {
        let root: Value = serde_json::from_str(json).map_err(|e| json_err(e.to_string()))?;
        if !root.is_object() {
            return Err(json_err("the top level must be a JSON object".into()));
        }
        let model_value = root
            .get("model")
            .filter(|m| m.is_object())
            .ok_or_else(|| json_err("there is no `model` object".into()))?;
        match model_value.get("type").and_then(Value::as_str) {
            Some("BPE") | None => {}
            Some(other) => return Err(unsupported(format!("model type `{other}`"))),
        }
        let model =
            ModelJson::deserialize(model_value).map_err(|e| json_err(format!("`model`: {e}")))?;
        if model.dropout.is_some_and(|d| d > 0.0) {
            return Err(unsupported("BPE dropout".into()));
        }
        for (name, value) in [
            (
                "continuing_subword_prefix",
                &model.continuing_subword_prefix,
            ),
            ("end_of_word_suffix", &model.end_of_word_suffix),
        ] {
            if value.as_deref().is_some_and(|s| !s.is_empty()) {
                return Err(unsupported(format!("BPE with a `{name}`")));
            }
        }

        let mut normalizers = Vec::new();
        parse_normalizers(
            root.get("normalizer").unwrap_or(&Value::Null),
            &mut normalizers,
        )?;
        let mut pre_tokenizers = Vec::new();
        parse_pre_tokenizers(
            root.get("pre_tokenizer").unwrap_or(&Value::Null),
            &mut pre_tokenizers,
        )?;
        let byte_level = pre_tokenizers
            .iter()
            .any(|p| matches!(p, PreTokenizer::ByteLevel { .. }));
        let metaspace = pre_tokenizers.iter().find_map(|p| match p {
            PreTokenizer::Metaspace {
                replacement,
                prepend,
                ..
            } => Some((*replacement, *prepend)),
            _ => None,
        });
        let replaced_space = normalizers.iter().find_map(|n| match n {
            Normalizer::Replace { from, to } if from == " " => Some(to.clone()),
            _ => None,
        });
        let (space_char, strip_leading_space) = if byte_level {
            if metaspace.is_some() {
                return Err(unsupported("ByteLevel combined with Metaspace".into()));
            }
            (' ', false)
        } else if let (true, Some((replacement, prepend))) = (model.byte_fallback, metaspace) {
            (replacement, prepend != PrependScheme::Never)
        } else if let (true, Some(to)) = (model.byte_fallback, &replaced_space) {
            let mut chars = to.chars();
            let (Some(space), None) = (chars.next(), chars.next()) else {
                return Err(unsupported(format!("replacing spaces with `{to}`")));
            };
            let prepends = normalizers
                .iter()
                .any(|n| matches!(n, Normalizer::Prepend(p) if p == to));
            (space, prepends)
        } else {
            return Err(unsupported(
                "BPE with neither a ByteLevel pre-tokenizer nor byte_fallback with the \"▁\" \
                 metaspace"
                    .into(),
            ));
        };

        let mut id_to_token = HashMap::with_capacity(model.vocab.len());
        for (token, &id) in &model.vocab {
            if let Some(other) = id_to_token.insert(id, token.clone()) {
                return Err(invalid(format!(
                    "the vocabulary gives id {id} to both `{other}` and `{token}`"
                )));
            }
        }
        let mut merges = HashMap::with_capacity(model.merges.len());
        for (rank, merge) in model.merges.iter().enumerate() {
            let (left, right) = match merge {
                MergeJson::Pair(a, b) => (a.as_str(), b.as_str()),
                MergeJson::Line(line) => {
                    let mut parts = line.split(' ');
                    match (parts.next(), parts.next(), parts.next()) {
                        (Some(a), Some(b), None) => (a, b),
                        _ => {
                            return Err(invalid(format!(
                                "merge {rank} `{line}` must be two tokens separated by one space"
                            )))
                        }
                    }
                }
            };
            let id = |token: &str| {
                model.vocab.get(token).copied().ok_or_else(|| {
                    invalid(format!(
                        "merge {rank} (`{left}` + `{right}`) uses `{token}`, which is not in the \
                         vocabulary"
                    ))
                })
            };
            let pair = (id(left)?, id(right)?);
            let merged = id(&format!("{left}{right}"))?;
            let rank = u32::try_from(rank).map_err(|_| invalid("too many merges".into()))?;
            merges.insert(pair, (rank, merged));
        }

        let mut added: Vec<(String, u32)> = Vec::new();
        if let Some(list) = root.get("added_tokens").filter(|v| !v.is_null()) {
            let list = Vec::<AddedTokenJson>::deserialize(list)
                .map_err(|e| json_err(format!("`added_tokens`: {e}")))?;
            added = list
                .into_iter()
                .filter(|t| !t.content.is_empty())
                .map(|t| (t.content, t.id))
                .collect();
        }
        added.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        let mut added_by_first_byte: HashMap<u8, Vec<usize>> = HashMap::new();
        for (k, (content, _)) in added.iter().enumerate() {
            if let Some(&first) = content.as_bytes().first() {
                added_by_first_byte.entry(first).or_default().push(k);
            }
        }
        let added_by_id: HashMap<u32, String> =
            added.iter().map(|(c, id)| (*id, c.clone())).collect();

        let mut byte_ids = [None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            let name = if byte_level {
                byte_alphabet().to_char[b].to_string()
            } else {
                format!("<0x{b:02X}>")
            };
            *slot = model.vocab.get(&name).copied();
        }
        let unk = match &model.unk_token {
            Some(token) => Some(model.vocab.get(token).copied().ok_or_else(|| {
                invalid(format!("the unk_token `{token}` is not in the vocabulary"))
            })?),
            None => None,
        };
        let max_id = model
            .vocab
            .values()
            .chain(added.iter().map(|(_, id)| id))
            .max()
            .copied()
            .ok_or_else(|| invalid("the vocabulary is empty".into()))?;

        Ok(Self {
            vocab: model.vocab,
            id_to_token,
            merges,
            added,
            added_by_first_byte,
            added_by_id,
            normalizers,
            pre_tokenizers,
            byte_level,
            byte_ids,
            byte_fallback: model.byte_fallback,
            unk,
            fuse_unk: model.fuse_unk,
            ignore_merges: model.ignore_merges,
            space_char,
            strip_leading_space,
            vocab_size: max_id as usize + 1,
        })
    }

    /// Splits out added tokens, longest match first at the earliest position.
    fn split_added<'a>(&self, text: &'a str) -> Vec<Segment<'a>> {
        let bytes = text.as_bytes();
        let mut segments = Vec::new();
        let (mut start, mut i) = (0, 0);
        while i < bytes.len() {
            let found = self
                .added_by_first_byte
                .get(&bytes[i])
                .and_then(|candidates| {
                    candidates
                        .iter()
                        .map(|&k| &self.added[k])
                        .find(|(content, _)| bytes[i..].starts_with(content.as_bytes()))
                });
            match found {
                // A match starts with a UTF-8 lead byte and ends after a whole character, so
                // `start..i` and the match are on character boundaries.
                Some((content, id)) => {
                    if start < i {
                        segments.push(Segment::Text {
                            text: &text[start..i],
                            at_start: start == 0,
                        });
                    }
                    segments.push(Segment::Added(*id));
                    i += content.len();
                    start = i;
                }
                None => i += 1,
            }
        }
        if start < bytes.len() {
            segments.push(Segment::Text {
                text: &text[start..],
                at_start: start == 0,
            });
        }
        segments
    }

    fn normalize(&self, text: &str) -> String {
        let mut text = text.to_string();
        for normalizer in &self.normalizers {
            match normalizer {
                Normalizer::Prepend(prefix) if !text.is_empty() => text.insert_str(0, prefix),
                Normalizer::Prepend(_) => {}
                Normalizer::Replace { from, to } => text = text.replace(from.as_str(), to),
            }
        }
        text
    }

    /// Applies the pre-tokenizers to one normalized segment; the flag marks the piece that
    /// starts the whole input.
    fn pre_tokenize(&self, text: String, at_start: bool) -> Vec<(String, bool)> {
        let mut pieces = vec![(text, at_start)];
        for step in &self.pre_tokenizers {
            let mut next = Vec::with_capacity(pieces.len());
            for (piece, first) in pieces {
                match *step {
                    PreTokenizer::Split(pattern) => push_split(&mut next, &piece, first, pattern),
                    PreTokenizer::ByteLevel {
                        add_prefix_space,
                        use_regex,
                    } => {
                        let piece = if add_prefix_space && !piece.starts_with(' ') {
                            format!(" {piece}")
                        } else {
                            piece
                        };
                        if use_regex {
                            push_split(&mut next, &piece, first, Pattern::Gpt2);
                        } else {
                            next.push((piece, first));
                        }
                    }
                    PreTokenizer::Metaspace {
                        replacement,
                        prepend,
                        split,
                    } => {
                        let mut piece: String = piece
                            .chars()
                            .map(|c| if c == ' ' { replacement } else { c })
                            .collect();
                        let wants = prepend == PrependScheme::Always
                            || (prepend == PrependScheme::First && first);
                        if wants && !piece.starts_with(replacement) {
                            piece.insert(0, replacement);
                        }
                        if split {
                            let mut starts: Vec<usize> = piece
                                .match_indices(replacement)
                                .map(|(k, _)| k)
                                .filter(|&k| k > 0)
                                .collect();
                            starts.insert(0, 0);
                            starts.push(piece.len());
                            for (n, w) in starts.windows(2).enumerate() {
                                if w[0] < w[1] {
                                    next.push((piece[w[0]..w[1]].to_string(), first && n == 0));
                                }
                            }
                        } else {
                            next.push((piece, first));
                        }
                    }
                }
            }
            pieces = next;
        }
        pieces
    }

    /// Pushes `symbol`, or the unk token (fused with a preceding unk if configured), or fails.
    fn push_unknown(
        &self,
        symbols: &mut Vec<u32>,
        last_was_unk: &mut bool,
        what: impl FnOnce() -> String,
    ) -> Result<(), TokenizerError> {
        let unk = self
            .unk
            .ok_or_else(|| TokenizerError::UnknownPiece { what: what() })?;
        if !(self.fuse_unk && *last_was_unk) {
            symbols.push(unk);
        }
        *last_was_unk = true;
        Ok(())
    }

    /// Encodes one pre-tokenized piece: initial symbols, then merges.
    fn encode_piece(&self, piece: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut symbols = Vec::with_capacity(piece.len());
        let mut last_was_unk = false;
        if self.byte_level {
            if self.ignore_merges {
                let to_char = &byte_alphabet().to_char;
                let mapped: String = piece.bytes().map(|b| to_char[usize::from(b)]).collect();
                if let Some(&id) = self.vocab.get(&mapped) {
                    return Ok(vec![id]);
                }
            }
            for b in piece.bytes() {
                match self.byte_ids[usize::from(b)] {
                    Some(id) => {
                        symbols.push(id);
                        last_was_unk = false;
                    }
                    None => self.push_unknown(&mut symbols, &mut last_was_unk, || {
                        format!("byte 0x{b:02X}")
                    })?,
                }
            }
        } else {
            if self.ignore_merges {
                if let Some(&id) = self.vocab.get(piece) {
                    return Ok(vec![id]);
                }
            }
            let mut buf = [0u8; 4];
            for c in piece.chars() {
                let s = c.encode_utf8(&mut buf);
                if let Some(&id) = self.vocab.get(&*s) {
                    symbols.push(id);
                    last_was_unk = false;
                    continue;
                }
                if self.byte_fallback {
                    let ids: Option<Vec<u32>> =
                        s.bytes().map(|b| self.byte_ids[usize::from(b)]).collect();
                    if let Some(ids) = ids {
                        symbols.extend(ids);
                        last_was_unk = false;
                        continue;
                    }
                }
                self.push_unknown(&mut symbols, &mut last_was_unk, || {
                    format!("character {c:?} (U+{:04X})", u32::from(c))
                })?;
            }
        }
        Ok(self.merge(symbols))
    }

    /// Applies merges lowest rank first (leftmost first among equal ranks) until none applies.
    fn merge(&self, mut ids: Vec<u32>) -> Vec<u32> {
        const NONE: usize = usize::MAX;
        let n = ids.len();
        if n < 2 {
            return ids;
        }
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut next: Vec<usize> = (1..=n).map(|i| if i == n { NONE } else { i }).collect();
        prev[0] = NONE;
        let mut alive = vec![true; n];
        let mut heap = BinaryHeap::new();
        let pair_rank = |ids: &[u32], i: usize, j: usize| {
            self.merges.get(&(ids[i], ids[j])).map(|&(rank, _)| rank)
        };
        for i in 0..n - 1 {
            if let Some(rank) = pair_rank(&ids, i, i + 1) {
                heap.push(Reverse((rank, i)));
            }
        }
        while let Some(Reverse((rank, i))) = heap.pop() {
            let j = next[i];
            if !alive[i] || j == NONE {
                continue;
            }
            // Ranks are unique per pair, so a matching rank means the entry is still current.
            let Some(&(current, merged)) = self.merges.get(&(ids[i], ids[j])) else {
                continue;
            };
            if current != rank {
                continue;
            }
            ids[i] = merged;
            alive[j] = false;
            next[i] = next[j];
            if next[j] != NONE {
                prev[next[j]] = i;
            }
            if prev[i] != NONE {
                if let Some(r) = pair_rank(&ids, prev[i], i) {
                    heap.push(Reverse((r, prev[i])));
                }
            }
            if next[i] != NONE {
                if let Some(r) = pair_rank(&ids, i, next[i]) {
                    heap.push(Reverse((r, i)));
                }
            }
        }
        ids.into_iter()
            .zip(alive)
            .filter_map(|(id, alive)| alive.then_some(id))
            .collect()
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::new();
        let mut cache: HashMap<String, Vec<u32>> = HashMap::new();
        for segment in self.split_added(text) {
            let (text, at_start) = match segment {
                Segment::Added(id) => {
                    out.push(id);
                    continue;
                }
                Segment::Text { text, at_start } => (text, at_start),
            };
            for (piece, _) in self.pre_tokenize(self.normalize(text), at_start) {
                if let Some(ids) = cache.get(&piece) {
                    out.extend_from_slice(ids);
                    continue;
                }
                let ids = self.encode_piece(&piece)?;
                out.extend_from_slice(&ids);
                cache.insert(piece, ids);
            }
        }
        Ok(out)
    }

    fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for id in ids {
            let Some(token) = self
                .added_by_id
                .get(id)
                .or_else(|| self.id_to_token.get(id))
            else {
                bytes.extend_from_slice(REPLACEMENT.as_bytes());
                continue;
            };
            if self.byte_level {
                // As `tokenizers`' ByteLevel decoder: a token outside the alphabet stays as is.
                match token.chars().map(char_to_byte).collect::<Option<Vec<u8>>>() {
                    Some(mapped) => bytes.extend(mapped),
                    None => bytes.extend_from_slice(token.as_bytes()),
                }
            } else if let Some(b) = self
                .byte_fallback
                .then(|| byte_token_value(token))
                .flatten()
            {
                bytes.push(b);
            } else {
                let mut buf = [0u8; 4];
                for c in token.chars() {
                    let c = if c == self.space_char { ' ' } else { c };
                    bytes.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
            }
        }
        let text = String::from_utf8_lossy(&bytes);
        match text.strip_prefix(' ') {
            Some(rest) if self.strip_leading_space => rest.to_string(),
            _ => text.into_owned(),
        }
    }
}

/// Splits `piece` with `pattern`, marking only the first part as the input's start.
fn push_split(out: &mut Vec<(String, bool)>, piece: &str, first: bool, pattern: Pattern) {
    for (n, part) in pattern.split(piece).into_iter().enumerate() {
        out.push((part.to_string(), first && n == 0));
    }
}

/// The byte a `<0xXX>` token stands for.
fn byte_token_value(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The alphabet character of byte `b` as a string.
    fn bc(b: u8) -> String {
        byte_alphabet().to_char[usize::from(b)].to_string()
    }

    /// A byte-level tokenizer.json: ids 0..=255 are the bytes' alphabet characters, then
    /// 256 "Ġt", 257 "he", 258 "Ġthe", 259 "lo", 260 "ab", 261 "bc"; 262 is `<|endoftext|>`.
    fn byte_level_json(pair_merges: bool, pre_tokenizer: Value) -> String {
        let mut vocab = serde_json::Map::new();
        for b in 0..=255u8 {
            vocab.insert(bc(b), json!(b));
        }
        for (k, t) in ["Ġt", "he", "Ġthe", "lo", "ab", "bc"].iter().enumerate() {
            vocab.insert(t.to_string(), json!(256 + k));
        }
        let merges = [
            ("Ġ", "t"),
            ("h", "e"),
            ("Ġt", "he"),
            ("l", "o"),
            ("a", "b"),
            ("b", "c"),
        ];
        let merges: Vec<Value> = merges
            .iter()
            .map(|(a, b)| {
                if pair_merges {
                    json!([a, b])
                } else {
                    json!(format!("{a} {b}"))
                }
            })
            .collect();
        json!({
            "version": "1.0",
            "added_tokens": [{"id": 262, "content": "<|endoftext|>", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "decoder": {"type": "ByteLevel"},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "byte_fallback": false,
                "vocab": vocab, "merges": merges}
        })
        .to_string()
    }

    fn gpt2_pre() -> Value {
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})
    }

    fn llama3_pre() -> Value {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]})
    }

    fn bpe(json: &str) -> Tokenizer {
        Tokenizer::Bpe(BpeTokenizer::from_json_str(json).expect("valid tokenizer"))
    }

    #[test]
    fn alphabet_matches_gpt2() {
        assert_eq!(bc(b' '), "Ġ");
        assert_eq!(bc(b'\n'), "Ċ");
        assert_eq!(bc(b'A'), "A");
        assert_eq!(bc(0xAD), "Ń");
        assert_eq!(bc(0), "Ā");
        let mut seen: Vec<char> = byte_alphabet().to_char.to_vec();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 256);
        assert!(
            (0..=255u8).all(|b| char_to_byte(byte_alphabet().to_char[usize::from(b)]) == Some(b))
        );
    }

    #[test]
    fn gpt2_split_by_hand() {
        let pieces = Pattern::Gpt2.split("Hello world's  123 foo!!\n\n bar ");
        assert_eq!(
            pieces,
            ["Hello", " world", "'s", " ", " 123", " foo", "!!", "\n\n", " bar", " "]
        );
        assert_eq!(
            Pattern::Gpt2.split("it'S x'll"),
            ["it", "'", "S", " x", "'ll"]
        );
        assert_eq!(Pattern::Gpt2.split("  "), ["  "]);
        assert!(Pattern::Gpt2.split("").is_empty());
    }

    #[test]
    fn llama3_split_by_hand() {
        let pieces = Pattern::Llama3.split("I'VE 12345 tokens\n\n\tx,y  \n");
        assert_eq!(
            pieces,
            ["I", "'VE", " ", "123", "45", " tokens", "\n\n", "\tx", ",y", "  \n"]
        );
        assert_eq!(
            Pattern::Llama3.split("a !?\n\nb  c"),
            ["a", " !?\n\n", "b", " ", " c"]
        );
        assert_eq!(Pattern::Llama3.split("día 1½"), ["día", " ", "1½"]);
    }

    #[test]
    fn byte_level_encode_by_hand() {
        let tok = bpe(&byte_level_json(false, gpt2_pre()));
        assert_eq!(tok.vocab_size(), 263);
        // "the" → t + he; " hello" → Ġ he l lo ("h e" outranks "l o"); " the" → Ġthe.
        let ids = tok.encode("the hello<|endoftext|> the").unwrap();
        assert_eq!(ids, [116, 257, 32, 257, 108, 259, 262, 258]);
        assert_eq!(tok.decode(&ids), "the hello<|endoftext|> the");
        // "a b" (rank 4) wins over "b c" (rank 5).
        assert_eq!(tok.encode("abc").unwrap(), [260, 99]);
        assert_eq!(tok.encode("bcd").unwrap(), [261, 100]);
        // Non-ASCII text goes byte by byte: é = C3 A9.
        assert_eq!(tok.encode("é").unwrap(), [0xC3, 0xA9]);
        assert_eq!(tok.token_id("<|endoftext|>"), Some(262));
        assert_eq!(tok.token_id("Ġthe"), Some(258));
        // Pair-style merges give the same tokenizer.
        let pairs = bpe(&byte_level_json(true, gpt2_pre()));
        assert_eq!(
            pairs.encode("the hello the").unwrap(),
            tok.encode("the hello the").unwrap()
        );
    }

    #[test]
    fn byte_level_round_trips() {
        for pre in [gpt2_pre(), llama3_pre()] {
            let tok = bpe(&byte_level_json(false, pre));
            for text in [
                "",
                "The  cat's hat\n\n\tis 12345 ¿qué? 日本語 ✓\r\n",
                "<|endoftext|><|endoftext|>x",
            ] {
                assert_eq!(tok.decode(&tok.encode(text).unwrap()), text);
            }
        }
        // An unknown id decodes to U+FFFD.
        let tok = bpe(&byte_level_json(false, gpt2_pre()));
        assert_eq!(tok.decode(&[116, 9999]), "t\u{FFFD}");
    }

    #[test]
    fn add_prefix_space_and_ignore_merges() {
        let pre = json!({"type": "ByteLevel", "add_prefix_space": true, "use_regex": true});
        let tok = bpe(&byte_level_json(false, pre));
        assert_eq!(tok.encode("the").unwrap(), [258]);
        let mut v: Value = serde_json::from_str(&byte_level_json(false, gpt2_pre())).unwrap();
        // With ignore_merges, a word in the vocabulary is taken whole even if merges would not
        // build it: "ab" + "c" is the merge result, but "abc" is in the vocabulary.
        v["model"]["vocab"]["abc"] = json!(263);
        v["model"]["ignore_merges"] = json!(true);
        let tok = bpe(&v.to_string());
        assert_eq!(tok.encode("abc abc").unwrap(), [263, 32, 260, 99]);
    }

    /// A Llama 2 style tokenizer: 0 `<unk>`, 1 `<s>`, 2 `</s>`, 3..=258 `<0x00>`..`<0xFF>`, then
    /// 259 "▁", 260 "h", 261 "e", 262 "l", 263 "o", 264 "▁h", 265 "ll", 266 "▁he", 267 "llo".
    fn sentencepiece_json(normalizer: Value, pre_tokenizer: Value) -> String {
        let mut vocab = serde_json::Map::new();
        for (k, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
            vocab.insert(t.to_string(), json!(k));
        }
        for b in 0..=255u32 {
            vocab.insert(format!("<0x{b:02X}>"), json!(3 + b));
        }
        for (k, t) in ["▁", "h", "e", "l", "o", "▁h", "ll", "▁he", "llo"]
            .iter()
            .enumerate()
        {
            vocab.insert(t.to_string(), json!(259 + k));
        }
        json!({
            "added_tokens": [
                {"id": 0, "content": "<unk>", "special": true},
                {"id": 1, "content": "<s>", "special": true},
                {"id": 2, "content": "</s>", "special": true}],
            "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer,
            "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": true, "byte_fallback": true,
                "vocab": vocab, "merges": ["▁ h", "l l", "▁h e", "ll o"]}
        })
        .to_string()
    }

    fn legacy_normalizer() -> Value {
        json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]})
    }

    fn metaspace(split: bool) -> Value {
        json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": split})
    }

    #[test]
    fn sentencepiece_encode_by_hand() {
        let legacy = bpe(&sentencepiece_json(legacy_normalizer(), Value::Null));
        // "▁hello▁hello\n": ▁h, ll, ▁he, llo at both places; "\n" falls back to <0x0A> = 3 + 10.
        let ids = legacy.encode("hello hello\n").unwrap();
        assert_eq!(ids, [266, 267, 266, 267, 13]);
        assert_eq!(legacy.decode(&ids), "hello hello\n");
        // é is not in the vocabulary: bytes C3 A9 → 3 + 0xC3, 3 + 0xA9.
        assert_eq!(legacy.encode("é").unwrap(), [259, 198, 172]);
        assert_eq!(legacy.decode(&[259, 198, 172]), "é");
        // The legacy normalizer prepends "▁" to text after an added token too.
        assert_eq!(legacy.encode("<s>hello").unwrap(), [1, 266, 267]);

        for split in [false, true] {
            let meta = bpe(&sentencepiece_json(Value::Null, metaspace(split)));
            assert_eq!(meta.encode("hello hello\n").unwrap(), ids);
            // prepend_scheme "first": no "▁" after the leading added token.
            assert_eq!(meta.encode("<s>hello").unwrap(), [1, 260, 261, 267]);
            assert_eq!(meta.decode(&[1, 260, 261, 267]), "<s>hello");
        }
        assert_eq!(legacy.token_id("</s>"), Some(2));
        assert_eq!(legacy.vocab_size(), 268);
    }

    #[test]
    fn unknown_pieces_use_unk_or_fail() {
        // Byte-level vocabulary with only printable ASCII and no unk token.
        let mut vocab = serde_json::Map::new();
        for b in b'!'..=b'~' {
            vocab.insert(bc(b), json!(b));
        }
        let mut v = json!({"pre_tokenizer": gpt2_pre(),
            "model": {"type": "BPE", "vocab": vocab, "merges": []}});
        let tok = bpe(&v.to_string());
        assert_eq!(tok.encode("ok!").unwrap(), [111, 107, 33]);
        let err = tok.encode("é").unwrap_err();
        assert!(matches!(err, TokenizerError::UnknownPiece { .. }));
        assert!(err.to_string().contains("byte 0xC3"), "{err}");

        // With an unk token (fused), the two unknown bytes of é become one unk.
        v["model"]["vocab"]["<unk>"] = json!(200);
        v["model"]["unk_token"] = json!("<unk>");
        v["model"]["fuse_unk"] = json!(true);
        assert_eq!(bpe(&v.to_string()).encode("aé").unwrap(), [97, 200]);
    }

    #[test]
    fn bytes_tokenizer_round_trip() {
        let tok = Tokenizer::bytes();
        let text = "héllo wörld ✓ 日本\n";
        let ids = tok.encode(text).unwrap();
        assert_eq!(ids.len(), text.len());
        assert_eq!(&ids[..3], [104, 0xC3, 0xA9]);
        assert_eq!(tok.decode(&ids), text);
        assert_eq!(tok.vocab_size(), 256);
        assert_eq!(tok.decode(&[104, 300, 105]), "h\u{FFFD}i");
        // A lone continuation byte is invalid UTF-8 and decodes lossily.
        assert_eq!(tok.decode(&[0xA9]), "\u{FFFD}");
        assert_eq!(tok.token_id("a"), None);
    }

    #[test]
    fn malformed_and_unsupported_files() {
        let err = |json: &str| BpeTokenizer::from_json_str(json).unwrap_err();
        assert!(matches!(err("{\"model\": "), TokenizerError::Json { .. }));
        assert!(matches!(err("{}"), TokenizerError::Json { .. }));
        let e = err(r#"{"model": {"type": "Unigram", "vocab": []}}"#);
        assert!(matches!(e, TokenizerError::Unsupported { .. }));
        assert!(
            e.to_string().contains("`Unigram`") && e.to_string().contains("Llama 2 style"),
            "{e}"
        );

        let mut v: Value = serde_json::from_str(&byte_level_json(false, gpt2_pre())).unwrap();
        v["model"]["merges"] = json!(["x yz"]);
        let e = err(&v.to_string());
        assert!(
            e.to_string()
                .contains("`yz`, which is not in the vocabulary"),
            "{e}"
        );
        v["model"]["merges"] = json!(["a b c"]);
        assert!(err(&v.to_string())
            .to_string()
            .contains("two tokens separated by one space"));
        v["model"]["merges"] = json!([]);
        v["model"]["vocab"]["dup"] = json!(5);
        assert!(err(&v.to_string())
            .to_string()
            .contains("gives id 5 to both"));

        let no_pre = byte_level_json(false, Value::Null);
        assert!(matches!(err(&no_pre), TokenizerError::Unsupported { .. }));
        let other_regex = json!({"type": "Split", "pattern": {"Regex": "\\w+"}, "behavior": "Isolated", "invert": false});
        let e = err(&byte_level_json(
            false,
            json!({"type": "Sequence", "pretokenizers": [other_regex, gpt2_pre()]}),
        ));
        assert!(e.to_string().contains("Split regex `\\w+`"), "{e}");
        let e = err(&sentencepiece_json(json!({"type": "NFKC"}), Value::Null));
        assert!(e.to_string().contains("normalizer `NFKC`"), "{e}");
    }

    #[test]
    fn from_file_errors_name_the_file() {
        let dir = std::env::temp_dir().join(format!("llama-tokenizer-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let missing = Tokenizer::from_file(&dir.join("absent.json")).unwrap_err();
        assert!(matches!(missing, TokenizerError::Io { .. }));
        let path = dir.join("tokenizer.json");
        fs::write(&path, "not json").unwrap();
        let err = Tokenizer::from_file(&path).unwrap_err();
        assert!(matches!(err, TokenizerError::InFile { .. }));
        assert!(
            err.to_string().contains("tokenizer.json: malformed"),
            "{err}"
        );
        fs::write(&path, byte_level_json(false, gpt2_pre())).unwrap();
        assert_eq!(
            Tokenizer::from_file(&path).unwrap().encode(" the").unwrap(),
            [258]
        );
        let _ = fs::remove_dir_all(&dir);
    }
}
