//! A tokenized text corpus that serves deterministic random training batches.
//!
//! Batches are windows of `seq_len + 1` consecutive tokens at positions drawn from a splitmix64
//! generator seeded with `(seed, step)` alone, so a run resumed from a checkpoint at step `k`
//! sees exactly the batches the uninterrupted run would have seen.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::rng::SplitMix64;
use super::tokenizer::{Tokenizer, TokenizerError};

/// A corpus of token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenDataset {
    tokens: Vec<u32>,
}

/// Everything that can go wrong building a dataset or drawing a batch.
#[derive(Debug)]
pub enum DataError {
    /// The text file could not be read (missing, unreadable, or not UTF-8).
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// The tokenizer could not encode the text.
    Tokenizer(TokenizerError),
    /// The corpus is shorter than one training window.
    TooFewTokens {
        /// Tokens available.
        tokens: usize,
        /// Tokens one window needs (`seq_len + 1`).
        needed: usize,
    },
    /// An argument is out of range.
    InvalidArgument {
        /// What was wrong and what is allowed.
        message: String,
    },
}

impl fmt::Display for DataError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io { path, source } => {
                write!(f, "cannot read text file {}: {source}", path.display())
            }
            Self::Tokenizer(e) => write!(f, "cannot tokenize the text: {e}"),
            Self::TooFewTokens { tokens, needed } => write!(
                f,
                "the text has {tokens} tokens but one training sequence needs {needed} \
                 (seq_len + 1); use more text or a shorter sequence"
            ),
            Self::InvalidArgument { message } => f.write_str(message),
        }
    }
}

impl std::error::Error for DataError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            Self::Tokenizer(e) => Some(e),
            _ => None,
        }
    }
}

impl From<TokenizerError> for DataError {
    fn from(e: TokenizerError) -> Self {
        DataError::Tokenizer(e)
    }
}

fn invalid(message: String) -> DataError {
    DataError::InvalidArgument { message }
}

impl TokenDataset {
    /// Wraps already tokenized ids.
    pub fn from_tokens(tokens: Vec<u32>) -> Self {
        Self { tokens }
    }

    /// Tokenizes `text` (no BOS/EOS added).
    pub fn from_text(text: &str, tokenizer: &Tokenizer) -> Result<Self, DataError> {
        Ok(Self::from_tokens(tokenizer.encode(text)?))
    }

    /// Reads and tokenizes a UTF-8 text file, requiring at least one window of `seq_len + 1`
    /// tokens.
    pub fn from_file(
        path: &Path,
        tokenizer: &Tokenizer,
        seq_len: usize,
    ) -> Result<Self, DataError> {
        let text = fs::read_to_string(path).map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let dataset = Self::from_text(&text, tokenizer)?;
        let needed = seq_len.saturating_add(1);
        if dataset.len() < needed {
            return Err(DataError::TooFewTokens {
                tokens: dataset.len(),
                needed,
            });
        }
        Ok(dataset)
    }

    /// The token ids.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Number of distinct windows of `seq_len + 1` tokens (0 if the corpus is too short).
    pub fn num_windows(&self, seq_len: usize) -> usize {
        self.len().saturating_sub(seq_len)
    }

    /// Splits into (train, validation): the validation part is the last
    /// `round(len * validation_fraction)` tokens.
    ///
    /// `validation_fraction` must be in `[0, 1)`; 0 gives an empty validation part, and any other
    /// value must leave both parts non-empty.
    pub fn split(&self, validation_fraction: f64) -> Result<(Self, Self), DataError> {
        if !(0.0..1.0).contains(&validation_fraction) {
            return Err(invalid(format!(
                "validation fraction {validation_fraction} is out of range; it must be at least 0 \
                 and below 1"
            )));
        }
        let n = self.len();
        // The fraction is below 1, so the product is at most n.
        let validation = (n as f64 * validation_fraction).round() as usize;
        if validation_fraction > 0.0 && (validation == 0 || validation >= n) {
            return Err(invalid(format!(
                "validation fraction {validation_fraction} of {n} tokens leaves an empty train or \
                 validation part; use a larger corpus or another fraction"
            )));
        }
        let (train, val) = self.tokens.split_at(n - validation);
        Ok((
            Self::from_tokens(train.to_vec()),
            Self::from_tokens(val.to_vec()),
        ))
    }

    /// Draws a batch for training step `step`: `batch` random windows of `seq_len + 1` tokens,
    /// returned as (inputs, targets), each row-major `[batch, seq_len]`, where targets are the
    /// inputs shifted by one token.
    ///
    /// The windows depend only on `(seed, step)` and the dataset, never on earlier calls. Window
    /// starts are uniform over all `len - seq_len` positions.
    pub fn batch(
        &self,
        step: u64,
        seed: u64,
        batch: usize,
        seq_len: usize,
    ) -> Result<(Vec<u32>, Vec<u32>), DataError> {
        if batch == 0 || seq_len == 0 {
            return Err(invalid(format!(
                "batch size {batch} and sequence length {seq_len} must both be at least 1"
            )));
        }
        let total = batch.checked_mul(seq_len).ok_or_else(|| {
            invalid(format!(
                "batch size {batch} times sequence length {seq_len} overflows usize"
            ))
        })?;
        let windows = self.num_windows(seq_len);
        if windows == 0 {
            return Err(DataError::TooFewTokens {
                tokens: self.len(),
                needed: seq_len.saturating_add(1),
            });
        }
        let mut rng = SplitMix64::for_step(seed, step);
        let mut inputs = Vec::with_capacity(total);
        let mut targets = Vec::with_capacity(total);
        for _ in 0..batch {
            // `below(windows)` is less than `windows`, a usize.
            let start = rng.below(windows as u64) as usize;
            let window = &self.tokens[start..start + seq_len + 1];
            inputs.extend_from_slice(&window[..seq_len]);
            targets.extend_from_slice(&window[1..]);
        }
        Ok((inputs, targets))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tokens equal to their positions, so a window's start can be read off its first token.
    fn positions(n: u32) -> TokenDataset {
        TokenDataset::from_tokens((0..n).collect())
    }

    #[test]
    fn targets_are_inputs_shifted_by_one() {
        let data = positions(1000);
        let (batch, seq_len) = (4, 16);
        let (inputs, targets) = data.batch(7, 42, batch, seq_len).unwrap();
        assert_eq!(
            (inputs.len(), targets.len()),
            (batch * seq_len, batch * seq_len)
        );
        for row in 0..batch {
            let x = &inputs[row * seq_len..(row + 1) * seq_len];
            let y = &targets[row * seq_len..(row + 1) * seq_len];
            for t in 0..seq_len {
                // Consecutive corpus tokens, and the target is the next one.
                assert_eq!(x[t], x[0] + t as u32);
                assert_eq!(y[t], x[t] + 1);
            }
            assert!(y[seq_len - 1] < 1000);
        }
    }

    #[test]
    fn same_seed_and_step_give_same_batch() {
        let a = positions(5000);
        let b = positions(5000);
        for step in [0, 1, 999, u64::MAX] {
            assert_eq!(
                a.batch(step, 3, 8, 32).unwrap(),
                b.batch(step, 3, 8, 32).unwrap()
            );
        }
        // Drawing other batches in between does not change the result.
        let first = a.batch(5, 3, 8, 32).unwrap();
        let _ = a.batch(6, 3, 8, 32).unwrap();
        assert_eq!(a.batch(5, 3, 8, 32).unwrap(), first);
    }

    #[test]
    fn different_steps_and_seeds_differ() {
        let data = positions(100_000);
        let base = data.batch(0, 1, 8, 64).unwrap();
        assert_ne!(data.batch(1, 1, 8, 64).unwrap(), base);
        assert_ne!(data.batch(0, 2, 8, 64).unwrap(), base);
        // Rows within one batch are not all the same window.
        let starts: Vec<u32> = base.0.chunks(64).map(|row| row[0]).collect();
        assert!(starts.windows(2).any(|w| w[0] != w[1]), "{starts:?}");
    }

    #[test]
    fn every_window_is_reachable() {
        // 12 tokens, windows of 5: starts 0..=7.
        let data = positions(12);
        assert_eq!(data.num_windows(4), 8);
        let mut seen = [false; 8];
        for step in 0..200 {
            let (inputs, _) = data.batch(step, 9, 4, 4).unwrap();
            for row in inputs.chunks(4) {
                seen[row[0] as usize] = true;
            }
        }
        assert!(seen.iter().all(|&s| s), "{seen:?}");
    }

    #[test]
    fn too_short_and_bad_arguments() {
        let data = positions(10);
        assert!(data.batch(0, 0, 1, 9).is_ok());
        let err = data.batch(0, 0, 1, 10).unwrap_err();
        assert!(matches!(
            err,
            DataError::TooFewTokens {
                tokens: 10,
                needed: 11
            }
        ));
        assert!(err.to_string().contains("needs 11"), "{err}");
        assert!(data.batch(0, 0, 0, 4).is_err());
        assert!(data.batch(0, 0, 2, 0).is_err());
        assert!(data.batch(0, 0, usize::MAX, 2).is_err());
    }

    #[test]
    fn split_keeps_order_and_sizes() {
        let data = positions(100);
        let (train, val) = data.split(0.1).unwrap();
        assert_eq!(train.tokens(), (0..90).collect::<Vec<_>>());
        assert_eq!(val.tokens(), (90..100).collect::<Vec<_>>());
        let (train, val) = data.split(0.0).unwrap();
        assert_eq!((train.len(), val.len()), (100, 0));
        assert!(val.is_empty());
        for bad in [1.0, -0.1, f64::NAN, 0.001, 0.999] {
            assert!(data.split(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn from_text_and_file() {
        let tok = Tokenizer::bytes();
        let data = TokenDataset::from_text("héllo", &tok).unwrap();
        assert_eq!(data.tokens(), [104, 0xC3, 0xA9, 108, 108, 111]);

        let dir = std::env::temp_dir().join(format!("llama-data-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("corpus.txt");
        let err = TokenDataset::from_file(&path, &tok, 4).unwrap_err();
        assert!(matches!(err, DataError::Io { .. }));
        assert!(err.to_string().contains("corpus.txt"), "{err}");
        fs::write(&path, "abcd").unwrap();
        let err = TokenDataset::from_file(&path, &tok, 4).unwrap_err();
        assert!(
            matches!(
                err,
                DataError::TooFewTokens {
                    tokens: 4,
                    needed: 5
                }
            ),
            "{err}"
        );
        fs::write(&path, "abcde").unwrap();
        assert_eq!(TokenDataset::from_file(&path, &tok, 4).unwrap().len(), 5);
        let _ = fs::remove_dir_all(&dir);
    }
}
