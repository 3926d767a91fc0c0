//! [`RowChunks`]: how many rows of a sequence a sequence-chunked computation (the feed-forward
//! block, a model's output projection and loss) takes at a time, as a row count or as a memory
//! budget for one chunk's transient tensors, and the row ranges it cuts.

use std::num::{NonZeroU64, NonZeroUsize};
use std::ops::Range;

use burn::config::Config;

use crate::Error;

/// How many rows (tokens of `batch * seq`) a sequence-chunked computation takes at a time, so
/// that its transient tensors stay within one chunk's size whatever the sequence length.
/// Both forms are at least 1 by construction ([`RowChunks::rows`], [`RowChunks::budget`]).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum RowChunks {
    /// At most this many rows per chunk.
    Rows(NonZeroUsize),
    /// As many rows per chunk as keep the chunk's transient tensors within this many bytes
    /// (always at least one row, even where one row takes more).
    Budget(NonZeroU64),
}

impl RowChunks {
    /// Chunks of at most `rows` rows.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming `rows` when it is 0.
    pub fn rows(rows: usize) -> Result<Self, Error> {
        NonZeroUsize::new(rows)
            .map(Self::Rows)
            .ok_or_else(|| Error::config("chunk rows", "at least 1 row per chunk", rows))
    }

    /// Chunks whose transient tensors take at most `bytes` (at least one row each).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the budget when it is 0.
    pub fn budget(bytes: u64) -> Result<Self, Error> {
        NonZeroU64::new(bytes)
            .map(Self::Budget)
            .ok_or_else(|| Error::config("chunk memory budget", "at least 1 byte", bytes))
    }

    /// Rows per chunk for a computation whose transient tensors take `bytes_per_row` bytes per
    /// row: the row count, or as many rows as the budget holds (at least 1).
    pub fn chunk_rows(&self, bytes_per_row: u64) -> usize {
        match *self {
            Self::Rows(rows) => rows.get(),
            Self::Budget(bytes) => {
                let rows = bytes.get() / bytes_per_row.max(1);
                usize::try_from(rows).unwrap_or(usize::MAX).max(1)
            }
        }
    }

    /// The consecutive ranges that cut `total` rows into chunks of
    /// [`chunk_rows`](Self::chunk_rows)`(bytes_per_row)` rows (the last one shorter when the
    /// size does not divide `total`; none when `total` is 0).
    pub fn ranges(&self, total: usize, bytes_per_row: u64) -> Vec<Range<usize>> {
        let size = self.chunk_rows(bytes_per_row);
        (0..total)
            .step_by(size)
            .map(|start| start..total.min(start.saturating_add(size)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_every_row_once_in_order() {
        for total in [0, 1, 5, 7, 64, 100] {
            for rows in [1, 2, 3, 7, 64, 1000] {
                let ranges = RowChunks::rows(rows).unwrap().ranges(total, 1);
                let covered: Vec<usize> = ranges.iter().flat_map(|r| r.clone()).collect();
                assert_eq!(covered, (0..total).collect::<Vec<_>>(), "{total} by {rows}");
                assert!(ranges.iter().all(|r| !r.is_empty() && r.len() <= rows));
                assert_eq!(ranges.len(), total.div_ceil(rows));
            }
        }
    }

    #[test]
    fn a_budget_holds_whole_rows_and_at_least_one() {
        let budget = RowChunks::budget(1000).unwrap();
        assert_eq!(budget.chunk_rows(100), 10);
        assert_eq!(budget.chunk_rows(300), 3);
        assert_eq!(budget.chunk_rows(5000), 1, "one row even past the budget");
        assert_eq!(
            budget.chunk_rows(0),
            1000,
            "a zero-byte row counts as one byte"
        );
        assert_eq!(RowChunks::rows(8).unwrap().chunk_rows(1 << 40), 8);
    }

    #[test]
    fn zero_rows_or_bytes_are_refused_with_their_name() {
        let rows = RowChunks::rows(0).unwrap_err().to_string();
        assert!(
            rows.contains("chunk rows") && rows.contains("at least 1"),
            "{rows}"
        );
        let budget = RowChunks::budget(0).unwrap_err().to_string();
        assert!(budget.contains("budget"), "{budget}");
    }

    #[test]
    fn chunks_read_back_from_json_and_zero_is_refused_there_too() {
        let chunks = RowChunks::budget(1 << 30).unwrap();
        let json = burn::config::config_to_json(&chunks);
        assert_eq!(RowChunks::load_binary(json.as_bytes()).unwrap(), chunks);
        assert!(RowChunks::load_binary(br#"{"Rows":0}"#).is_err());
    }
}
