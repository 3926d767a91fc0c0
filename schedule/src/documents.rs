//! [`Documents`]: the boundaries of documents packed into one sequence, in the `cu_seqlens`
//! convention; a query sees only the keys of its own document.

use std::ops::Range;
use std::sync::Arc;

use crate::ScheduleError;

/// Document boundaries of packed sequences, in the `cu_seqlens` convention: `[0, l0, l0 + l1,
/// ..., len]`, the cumulative lengths of the documents packed into one sequence of `len`
/// positions. A query sees a key only if both are in the same document. One list for every
/// batch row, or one per batch row (all of the same `len`). Cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Documents {
    /// `rows` lists of `per_row` bounds each; a row with fewer documents than the longest is
    /// padded with `len` (empty trailing documents no position falls in).
    bounds: Arc<[u32]>,
    rows: usize,
    per_row: usize,
    len: usize,
}

impl Documents {
    /// The same documents in every batch row, from cumulative lengths `[0, ..., len]`.
    ///
    /// # Errors
    ///
    /// [`ScheduleError::BadMask`] unless the list starts at 0, strictly increases and has at
    /// least two entries, and `len` fits 32 bits.
    pub fn from_cu_seqlens(cu_seqlens: &[usize]) -> Result<Self, ScheduleError> {
        Self::per_batch_row(&[cu_seqlens.to_vec()])
    }

    /// One list of cumulative lengths per batch row; every list ends at the same `len`.
    ///
    /// # Errors
    ///
    /// [`ScheduleError::BadMask`] when there is no row, a list does not start at 0, does not
    /// strictly increase or has fewer than two entries, the lists end at different lengths, or
    /// the length does not fit 32 bits.
    pub fn per_batch_row(rows: &[Vec<usize>]) -> Result<Self, ScheduleError> {
        let bad = |what: String| Err(ScheduleError::BadMask { what });
        let Some(first) = rows.first() else {
            return bad("document boundaries need at least one batch row".into());
        };
        let len = *first.last().unwrap_or(&0);
        for (row, cu) in rows.iter().enumerate() {
            if cu.len() < 2 || cu[0] != 0 {
                return bad(format!(
                    "batch row {row}: cumulative document lengths must start at 0 and hold at \
                     least [0, len], got {cu:?}"
                ));
            }
            if let Some(at) = cu.windows(2).position(|w| w[1] <= w[0]) {
                return bad(format!(
                    "batch row {row}: cumulative document lengths must strictly increase, got \
                     {} then {} at index {}",
                    cu[at],
                    cu[at + 1],
                    at + 1
                ));
            }
            if cu[cu.len() - 1] != len {
                return bad(format!(
                    "batch row {row}: documents end at {}, batch row 0's at {len}: every row \
                     must end at the sequence length",
                    cu[cu.len() - 1]
                ));
            }
        }
        if len > i32::MAX as usize {
            return bad(format!(
                "a sequence of {len} positions exceeds 32-bit positions"
            ));
        }
        let per_row = rows.iter().map(Vec::len).max().unwrap_or(2);
        let mut bounds = Vec::with_capacity(rows.len() * per_row);
        for cu in rows {
            bounds.extend(cu.iter().map(|&b| b as u32));
            bounds.extend(std::iter::repeat_n(len as u32, per_row - cu.len()));
        }
        Ok(Self {
            bounds: bounds.into(),
            rows: rows.len(),
            per_row,
            len,
        })
    }

    /// Documents from per-position segment ids (one list per batch row, each of the sequence's
    /// length): a new document starts wherever the id changes. Ids need not be sorted or
    /// distinct across documents, only equal within one.
    ///
    /// # Errors
    ///
    /// As [`Documents::per_batch_row`]: rows of different or zero lengths.
    pub fn from_segment_ids<T: PartialEq>(rows: &[Vec<T>]) -> Result<Self, ScheduleError> {
        let cu: Vec<Vec<usize>> = rows
            .iter()
            .map(|ids| {
                let mut cu = vec![0];
                cu.extend((1..ids.len()).filter(|&p| ids[p] != ids[p - 1]));
                cu.push(ids.len());
                cu
            })
            .collect();
        Self::per_batch_row(&cu)
    }

    /// Positions of the packed sequence (the last cumulative length).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the sequence has no position (never: construction refuses it).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Batch rows with their own boundaries: 1 when every row shares them.
    pub fn batch_rows(&self) -> usize {
        self.rows
    }

    /// Cumulative lengths of batch row `batch` (of row 0 when shared), without padding.
    pub fn cu_seqlens(&self, batch: usize) -> Vec<usize> {
        let row = self.row(batch);
        let mut cu: Vec<usize> = row.iter().map(|&b| b as usize).collect();
        while cu.len() > 2 && cu[cu.len() - 2] == self.len {
            cu.pop();
        }
        cu
    }

    /// The document (a range of positions) that position `pos` of batch row `batch` is in.
    ///
    /// # Panics
    ///
    /// When `pos >= len()`.
    pub fn document(&self, batch: usize, pos: usize) -> Range<usize> {
        assert!(pos < self.len, "position {pos} past {} positions", self.len);
        let row = self.row(batch);
        let d = row.partition_point(|&b| b as usize <= pos) - 1;
        row[d] as usize..row[d + 1] as usize
    }

    /// Entries per batch row of [`padded_bounds`](Self::padded_bounds): the most documents
    /// of any row, plus one.
    pub fn bounds_per_row(&self) -> usize {
        self.per_row
    }

    /// Every batch row's cumulative lengths as `u32`, one row after the other, each padded with
    /// [`len`](Self::len) to [`bounds_per_row`](Self::bounds_per_row) entries (empty trailing
    /// documents no position falls in): the table a kernel searches for a position's document.
    pub fn padded_bounds(&self) -> &[u32] {
        &self.bounds
    }

    fn row(&self, batch: usize) -> &[u32] {
        let r = if self.rows == 1 { 0 } else { batch };
        &self.bounds[r * self.per_row..][..self.per_row]
    }
}
