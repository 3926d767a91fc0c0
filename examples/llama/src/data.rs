//! A tokenized text corpus that serves deterministic random training batches.
//!
//! Batches are windows of `seq_len + 1` consecutive tokens at positions drawn from a splitmix64
//! generator seeded with `(seed, step)` alone, so a run resumed from a checkpoint at step `k`
//! sees exactly the batches the uninterrupted run would have seen.

use std::fs;
use std::path::Path;

use super::rng::SplitMix64;
use super::tokenizer::Tokenizer;
use crate::Error;

/// A corpus of token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenDataset {
    tokens: Vec<u32>,
}

/// The error of a corpus shorter than one training window of `seq_len + 1` tokens.
fn too_few_tokens(tokens: usize, seq_len: usize) -> Error {
    Error::invalid(
        "the number of tokens in the text",
        format!(
            "at least {} (seq_len + 1, one training sequence); use more text or a shorter \
             sequence",
            seq_len.saturating_add(1)
        ),
        tokens,
    )
}

impl TokenDataset {
    /// Wraps already tokenized ids.
    pub fn from_tokens(tokens: Vec<u32>) -> Self {
        Self { tokens }
    }

    /// Tokenizes `text` (no BOS/EOS added).
    pub fn from_text(text: &str, tokenizer: &Tokenizer) -> Result<Self, Error> {
        Ok(Self::from_tokens(tokenizer.encode(text)?))
    }

    /// Reads and tokenizes a UTF-8 text file, requiring at least one window of `seq_len + 1`
    /// tokens.
    pub fn from_file(path: &Path, tokenizer: &Tokenizer, seq_len: usize) -> Result<Self, Error> {
        let text = fs::read_to_string(path).map_err(Error::io("read the text file", path))?;
        let dataset = Self::from_text(&text, tokenizer)?;
        if dataset.num_windows(seq_len) == 0 {
            return Err(too_few_tokens(dataset.len(), seq_len));
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
    pub fn split(&self, validation_fraction: f64) -> Result<(Self, Self), Error> {
        if !(0.0..1.0).contains(&validation_fraction) {
            return Err(Error::invalid(
                "the validation fraction",
                "at least 0 and below 1",
                validation_fraction,
            ));
        }
        let n = self.len();
        // The fraction is below 1, so the product is at most n.
        let validation = (n as f64 * validation_fraction).round() as usize;
        if validation_fraction > 0.0 && (validation == 0 || validation >= n) {
            return Err(Error::invalid(
                format!("the validation part (fraction {validation_fraction} of {n} tokens)"),
                format!(
                    "1 to {} tokens, so that neither the train nor the validation part is \
                     empty; use a larger corpus or another fraction",
                    n.saturating_sub(1)
                ),
                format!("{validation} tokens"),
            ));
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
    ) -> Result<(Vec<u32>, Vec<u32>), Error> {
        if batch == 0 || seq_len == 0 {
            return Err(Error::invalid(
                "the batch size and sequence length",
                "both at least 1",
                format!("{batch} and {seq_len}"),
            ));
        }
        let total = batch.checked_mul(seq_len).ok_or_else(|| {
            Error::invalid(
                "batch size x sequence length",
                "a product that fits in usize",
                format!("{batch} x {seq_len}"),
            )
        })?;
        let windows = self.num_windows(seq_len);
        if windows == 0 {
            return Err(too_few_tokens(self.len(), seq_len));
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
        assert!(
            matches!(err, Error::Invalid { ref got, ref expected, .. }
                if got == "10" && expected.starts_with("at least 11 (seq_len + 1")),
            "{err}"
        );
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
        assert!(matches!(err, Error::Io { .. }), "{err}");
        assert!(err.to_string().contains("corpus.txt"), "{err}");
        fs::write(&path, "abcd").unwrap();
        let err = TokenDataset::from_file(&path, &tok, 4).unwrap_err();
        assert!(
            matches!(err, Error::Invalid { ref got, ref expected, .. }
                if got == "4" && expected.starts_with("at least 5 (seq_len + 1")),
            "{err}"
        );
        fs::write(&path, "abcde").unwrap();
        assert_eq!(TokenDataset::from_file(&path, &tok, 4).unwrap().len(), 5);
        let _ = fs::remove_dir_all(&dir);
    }
}
