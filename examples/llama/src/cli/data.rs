//! `llama_train`'s data options: the text, its tokenizer, document packing and the held-out
//! slice.

use std::path::{Path, PathBuf};

use clap::Args;

use super::values::fraction;

/// The training text, its tokenizer, packing and the validation slice.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Data")]
pub struct DataArgs {
    /// The training text (default: the bundled Tiny Shakespeare, 1.1 MB)
    #[arg(long, value_name = "FILE.txt")]
    pub data: Option<PathBuf>,

    /// A Hugging Face tokenizer.json (default: raw bytes, 256 tokens)
    #[arg(long, value_name = "FILE.json")]
    pub tokenizer: Option<PathBuf>,

    /// The text is documents, each ended by an end-of-text token (--eot): no token attends
    /// across one
    #[arg(long)]
    pub pack: bool,

    /// The token that ends a document under --pack, by id or by name (default: byte 3, ASCII
    /// "end of text", for raw bytes; else the tokenizer's <|end_of_text|>, <|endoftext|>, </s>
    /// or <eos>)
    #[arg(long, value_name = "ID|TOKEN", requires = "pack")]
    pub eot: Option<String>,

    /// The fraction of the text, at its end, held out for the validation loss
    #[arg(long, value_name = "F", value_parser = fraction, default_value_t = 0.05)]
    pub val_fraction: f64,
}

impl DataArgs {
    /// The training text: `--data`, or the bundled Tiny Shakespeare.
    pub fn text_path(&self) -> PathBuf {
        self.data.clone().unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("data/tiny_shakespeare.txt")
        })
    }
}
