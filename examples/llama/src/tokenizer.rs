//! Text tokenizers: raw bytes (the zero-download default), or any Hugging Face `tokenizer.json`
//! through the `tokenizers` crate, the library that wrote the file.
//!
//! `encode` adds no BOS/EOS (the `add_special_tokens` flag of `tokenizers` is off): look them up
//! with [`Tokenizer::token_id`] and add them yourself. `decode` keeps special tokens' text.

use std::path::Path;
use std::str::FromStr;

use crate::Error;

/// Vocabulary size of [`Tokenizer::Bytes`].
pub const BYTE_VOCAB_SIZE: usize = 256;

/// The byte [`Tokenizer::end_of_text`] gives: ASCII 3, "end of text" (ETX), a control character
/// that ordinary text does not contain.
pub const BYTE_END_OF_TEXT: u32 = 0x03;

/// The named tokens [`Tokenizer::end_of_text`] looks for in a Hugging Face tokenizer, in this
/// order: Llama 3's, GPT-2's (and many BPE models'), Llama 2's and SentencePiece models'.
pub const END_OF_TEXT_NAMES: [&str; 4] = ["<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>"];

/// The text the byte tokenizer decodes an id above 255 to, and invalid UTF-8 to.
const REPLACEMENT: &str = "\u{FFFD}";

/// A text tokenizer.
#[derive(Debug, Clone)]
pub enum Tokenizer {
    /// One token per UTF-8 byte: token id = byte value, vocabulary size 256.
    Bytes,
    /// A Hugging Face tokenizer (any model, normalizer, pre-tokenizer and decoder that
    /// `tokenizers` supports).
    HuggingFace(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// The byte-level tokenizer: each UTF-8 byte is one token.
    pub fn bytes() -> Self {
        Tokenizer::Bytes
    }

    /// Loads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self, Error> {
        let text =
            std::fs::read_to_string(path).map_err(Error::io("read the tokenizer file", path))?;
        Self::parse(&text, Some(path))
    }

    /// Parses the contents of a Hugging Face `tokenizer.json`.
    pub fn from_json(json: &str) -> Result<Self, Error> {
        Self::parse(json, None)
    }

    /// Parses `tokenizer.json` text, read from `path` if given.
    fn parse(json: &str, path: Option<&Path>) -> Result<Self, Error> {
        tokenizers::Tokenizer::from_str(json)
            .map(|t| Tokenizer::HuggingFace(Box::new(t)))
            .map_err(|source| Error::Format {
                path: path.map(Path::to_path_buf),
                what: "the text".to_string(),
                expected: "a tokenizer.json that the `tokenizers` library loads".to_string(),
                source,
            })
    }

    /// Encodes text into token ids (no BOS/EOS added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, Error> {
        match self {
            Tokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::HuggingFace(t) => t
                .encode(text, false)
                .map(|encoding| encoding.get_ids().to_vec())
                .map_err(|source| Error::Tokenizer {
                    action: "encode the text",
                    source,
                }),
        }
    }

    /// Decodes token ids into text; the byte tokenizer turns invalid UTF-8 and ids above 255
    /// into U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, Error> {
        match self {
            Tokenizer::Bytes => {
                let mut bytes = Vec::with_capacity(ids.len());
                for &id in ids {
                    match u8::try_from(id) {
                        Ok(b) => bytes.push(b),
                        Err(_) => bytes.extend_from_slice(REPLACEMENT.as_bytes()),
                    }
                }
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Tokenizer::HuggingFace(t) => t.decode(ids, false).map_err(|source| Error::Tokenizer {
                action: "decode the ids",
                source,
            }),
        }
    }

    /// Number of embedding rows a model needs: one more than the largest token id (added
    /// tokens included).
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Bytes => BYTE_VOCAB_SIZE,
            Tokenizer::HuggingFace(t) => t
                .get_vocab(true)
                .values()
                .max()
                .map_or(0, |&id| id as usize + 1),
        }
    }

    /// The id of a named token (added tokens included); `None` for [`Tokenizer::Bytes`], which
    /// has no named tokens.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::HuggingFace(t) => t.token_to_id(token),
        }
    }

    /// The token that ends a document in a packed corpus (see [`crate::data::Packing`]) unless
    /// the caller names one: [`BYTE_END_OF_TEXT`] for [`Tokenizer::Bytes`]; for a Hugging Face
    /// tokenizer the first of [`END_OF_TEXT_NAMES`] it knows, or `None` when it knows none.
    pub fn end_of_text(&self) -> Option<u32> {
        match self {
            Tokenizer::Bytes => Some(BYTE_END_OF_TEXT),
            Tokenizer::HuggingFace(_) => END_OF_TEXT_NAMES
                .iter()
                .find_map(|name| self.token_id(name)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_tokenizer_round_trips_and_replaces_what_it_cannot_decode() {
        let tok = Tokenizer::bytes();
        let text = "héllo, नमस्ते";
        let ids = tok.encode(text).unwrap();
        assert_eq!(ids.len(), text.len());
        assert_eq!(ids[..2], [104, 195]);
        assert_eq!(tok.decode(&ids).unwrap(), text);
        assert_eq!(tok.decode(&[104, 300, 105]).unwrap(), "h\u{FFFD}i");
        assert_eq!(tok.decode(&[0xC3]).unwrap(), "\u{FFFD}");
        assert_eq!(tok.vocab_size(), 256);
        assert_eq!(tok.token_id("a"), None);
    }

    #[test]
    fn bad_files_and_json_are_errors_naming_the_problem() {
        let missing = Path::new("no/such/tokenizer.json");
        let e = Tokenizer::from_file(missing).unwrap_err();
        assert!(matches!(e, Error::Io { .. }), "{e:?}");
        assert!(e.to_string().contains("no/such/tokenizer.json"), "{e}");
        let e = Tokenizer::from_json("{ not json").unwrap_err();
        assert!(matches!(e, Error::Format { path: None, .. }), "{e:?}");
        let e = Tokenizer::from_json(r#"{"model": {"type": "NoSuchModel"}}"#).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("the text is not a tokenizer.json that the `tokenizers` library"),
            "{e}"
        );
    }

    #[test]
    fn end_of_text_defaults() {
        assert_eq!(Tokenizer::bytes().end_of_text(), Some(BYTE_END_OF_TEXT));
        let word_level = |vocab: &str| {
            Tokenizer::from_json(&format!(
                r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
                    "normalizer": null, "pre_tokenizer": null, "post_processor": null,
                    "decoder": null,
                    "model": {{"type": "WordLevel", "vocab": {vocab}, "unk_token": "a"}}}}"#
            ))
            .unwrap()
        };
        let llama2 = word_level(r#"{"a": 0, "</s>": 1, "<eos>": 2}"#);
        assert_eq!(llama2.end_of_text(), Some(1));
        let gpt2 = word_level(r#"{"a": 0, "</s>": 1, "<|endoftext|>": 2}"#);
        assert_eq!(gpt2.end_of_text(), Some(2));
        assert_eq!(word_level(r#"{"a": 0}"#).end_of_text(), None);
    }
}
