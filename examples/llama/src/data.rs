//! A tokenized text corpus that serves deterministic random training batches, and the document
//! boundaries of packed batches ([`Packing`]).
//!
//! Batches are windows of `seq_len + 1` consecutive tokens at positions drawn from a splitmix64
//! generator seeded with `(seed, step)` alone, so a run resumed from a checkpoint at step `k`
//! sees exactly the batches the uninterrupted run would have seen.

use std::fs;
use std::path::Path;

use burn_distflash::Documents;

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

/// Packed training: the corpus is a stream of documents, each ended by one end-of-text token
/// (EOT, see [`Tokenizer::end_of_text`] for the defaults), and a training row, a window of the
/// stream, holds the ends and starts of several. [`documents`](Self::documents) gives the
/// attention the boundaries of a batch's rows so that no token sees another document's.
///
/// The rule: an EOT is the last token of the document it ends, and the token after it starts
/// the next one. A row's first token starts its first document (usually the middle of one), so
/// a row of `n` positions holding `k` EOTs before its last position has `k + 1` documents, of
/// any length from 1 up; an EOT at the row's last position ends the row's last document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Packing {
    eot: u32,
}

impl Packing {
    /// Documents ended by the token `eot`, for a model of `vocab_size` tokens.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] when `eot` is not an id of that vocabulary (`0..vocab_size`).
    pub fn new(eot: u32, vocab_size: usize) -> Result<Self, Error> {
        if eot as usize >= vocab_size {
            return Err(Error::invalid(
                "the end-of-text token id",
                format!(
                    "an id of the model's vocabulary of {vocab_size} tokens (ids 0..{vocab_size})"
                ),
                eot,
            ));
        }
        Ok(Self { eot })
    }

    /// The end-of-text token id.
    pub fn eot(&self) -> u32 {
        self.eot
    }

    /// Cumulative document lengths `[0, ..., row.len()]` of one row of input tokens: a bound
    /// after every EOT but one at the row's last position (`[0]` for an empty row).
    pub fn cu_seqlens(&self, row: &[u32]) -> Vec<usize> {
        let mut cu = vec![0];
        cu.extend((1..row.len()).filter(|&p| row[p - 1] == self.eot));
        if !row.is_empty() {
            cu.push(row.len());
        }
        cu
    }

    /// The documents of a row-major `[batch, seq_len]` batch of input tokens (the `inputs` of
    /// [`TokenDataset::batch`]), one list per row, positions `0..seq_len` of the whole
    /// sequence: under sequence parallelism every rank passes these same documents.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] when `seq_len` is 0, `inputs` is empty or not whole rows of
    /// `seq_len` tokens, or `seq_len` exceeds 32-bit positions.
    pub fn documents(&self, inputs: &[u32], seq_len: usize) -> Result<Documents, Error> {
        if seq_len == 0 || inputs.is_empty() || !inputs.len().is_multiple_of(seq_len) {
            return Err(Error::invalid(
                "the tokens of a packed batch",
                format!(
                    "one or more whole rows of seq_len = {seq_len} tokens (seq_len at least 1)"
                ),
                format!("{} tokens", inputs.len()),
            ));
        }
        let rows: Vec<Vec<usize>> = inputs
            .chunks(seq_len)
            .map(|row| self.cu_seqlens(row))
            .collect();
        Documents::per_batch_row(&rows).map_err(|e| {
            Error::invalid(
                "the documents of a packed batch",
                "boundaries attention takes",
                e,
            )
        })
    }

    /// How many documents `tokens` holds: one more than its EOTs not at its end (0 when
    /// empty).
    pub fn count(&self, tokens: &[u32]) -> usize {
        self.cu_seqlens(tokens).len() - 1
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

    #[test]
    fn documents_end_after_each_end_of_text_token() {
        const E: u32 = 3;
        let packing = Packing::new(E, 256).unwrap();
        // No EOT: the row is one document.
        assert_eq!(packing.cu_seqlens(&[5, 6, 7]), [0, 3]);
        // An EOT at the row's first position: a one-token document at the window's edge.
        assert_eq!(packing.cu_seqlens(&[E, 6, 7]), [0, 1, 3]);
        // Consecutive EOTs: documents of one token.
        assert_eq!(packing.cu_seqlens(&[5, E, E, E, 7]), [0, 2, 3, 4, 5]);
        // An EOT at the last position ends the last document, and starts none in this row.
        assert_eq!(packing.cu_seqlens(&[5, 6, E]), [0, 3]);
        assert_eq!(packing.cu_seqlens(&[E]), [0, 1]);
        assert_eq!(packing.cu_seqlens(&[]), [0]);
        assert_eq!((packing.count(&[]), packing.count(&[5, E, 6, E])), (0, 2));

        // A batch: one list per row, all ending at seq_len.
        let inputs = [
            5, E, 6, 7, /* row 1 */ E, E, 8, E, /* row 2 */ 9, 9, 9, 9,
        ];
        let documents = packing.documents(&inputs, 4).unwrap();
        assert_eq!((documents.len(), documents.batch_rows()), (4, 3));
        assert_eq!(documents.cu_seqlens(0), [0, 2, 4]);
        assert_eq!(documents.cu_seqlens(1), [0, 1, 2, 4]);
        assert_eq!(documents.cu_seqlens(2), [0, 4]);
        assert_eq!(documents.document(1, 3), 2..4);
    }

    #[test]
    fn documents_of_a_drawn_batch_follow_its_rows() {
        // The corpus' EOTs are where the drawn rows' boundaries are.
        let tokens: Vec<u32> = (0..500u32)
            .map(|i| if i % 7 == 6 { 3 } else { 10 + i % 5 })
            .collect();
        let data = TokenDataset::from_tokens(tokens);
        let packing = Packing::new(3, 256).unwrap();
        let (inputs, _) = data.batch(4, 1, 6, 20).unwrap();
        let documents = packing.documents(&inputs, 20).unwrap();
        for (r, row) in inputs.chunks(20).enumerate() {
            for p in 1..20 {
                let starts = documents.document(r, p).start == p;
                assert_eq!(starts, row[p - 1] == 3, "row {r}, position {p}");
            }
        }
    }

    #[test]
    fn bad_packing_arguments() {
        let e = Packing::new(256, 256).unwrap_err();
        assert!(
            matches!(e, Error::Invalid { ref got, ref expected, .. }
                if got == "256" && expected.contains("ids 0..256")),
            "{e}"
        );
        let packing = Packing::new(255, 256).unwrap();
        assert_eq!(packing.eot(), 255);
        for (len, seq_len) in [(0, 4), (6, 4), (4, 0)] {
            let e = packing.documents(&vec![1; len], seq_len).unwrap_err();
            assert!(e.to_string().contains("whole rows"), "{e}");
        }
    }
}
