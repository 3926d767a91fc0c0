//! [`Mask`]: which keys a query may see, causal order, a sliding window and document boundaries
//! at the absolute positions of a call's query and key rows; its host-side logic (visibility of a
//! pair of positions, the key range of a query row, whether a call can be skipped, whether it
//! fits a call).
//!
//! Every mask is a *band*: query row `i` sees the keys of one contiguous range `[lo(i), hi(i))`,
//! and both ends never decrease as `i` grows. That is what lets a kernel skip every key tile
//! outside its block's range and mask only the tiles at its two edges, and a schedule count the
//! visible scores of a rectangle in closed form ([`crate::visibility`]).

use std::ops::Range;

use crate::documents::Documents;
use crate::window::SlidingWindow;
use crate::ScheduleError;

/// Which keys a query may see. Positions are absolute: the call's query rows start at position
/// `q_offset` of the sequence and its key rows at `kv_offset`, so query row `i` (local to the
/// call) is at `i + q_offset` and key row `j` at `j + kv_offset`. It sees that key iff every
/// part of the mask that is set allows it:
/// - `causal`: `key position <= query position`;
/// - `window`: `query - before <= key <= query + after` (see [`SlidingWindow`]);
/// - `documents`: both positions in the same document (see [`Documents`]).
///
/// The default sees everything at offsets 0. Serialized (feature `serde`) without its
/// documents, which are per-call data.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
pub struct Mask {
    /// Keys after the query are hidden.
    pub causal: bool,
    /// Keys outside a window around the query are hidden.
    pub window: Option<SlidingWindow>,
    /// Keys of other documents are hidden.
    #[cfg_attr(feature = "serde", serde(skip))]
    pub documents: Option<Documents>,
    /// Absolute position of the call's first query row.
    pub q_offset: i64,
    /// Absolute position of the call's first key row.
    pub kv_offset: i64,
}

impl Mask {
    /// Every query sees every key.
    pub fn none() -> Self {
        Self::default()
    }

    /// Plain causal attention of a sequence with itself.
    pub fn causal() -> Self {
        Self {
            causal: true,
            ..Self::default()
        }
    }

    /// This mask for a query chunk starting at absolute position `q_offset` and a key chunk at
    /// `kv_offset`.
    pub fn at(self, q_offset: i64, kv_offset: i64) -> Self {
        Self {
            q_offset,
            kv_offset,
            ..self
        }
    }

    /// This mask with a sliding window.
    pub fn with_window(self, window: SlidingWindow) -> Self {
        Self {
            window: Some(window),
            ..self
        }
    }

    /// This mask with document boundaries.
    pub fn with_documents(self, documents: Documents) -> Self {
        Self {
            documents: Some(documents),
            ..self
        }
    }

    /// Whether any key can be hidden (causal, a window or documents).
    pub fn is_masked(&self) -> bool {
        self.causal || self.window.is_some() || self.documents.is_some()
    }

    /// Whether query row `i` sees key row `j` (both local to the call) in batch row `batch`.
    /// Positions outside the documents' sequence see nothing.
    pub fn visible(&self, batch: usize, i: usize, j: usize) -> bool {
        let (qp, kp) = (i as i64 + self.q_offset, j as i64 + self.kv_offset);
        let (lo, hi) = self.reach();
        if kp < qp - lo || kp > qp + hi {
            return false;
        }
        match &self.documents {
            None => true,
            Some(d) => {
                let inside = |p: i64| p >= 0 && (p as usize) < d.len();
                inside(qp) && inside(kp) && d.document(batch, qp as usize).contains(&(kp as usize))
            }
        }
    }

    /// How far before and after its own position a query sees, `(before, after)`, with
    /// `i64::MAX / 4` for no bound (far beyond any position, and safe to add to one).
    pub fn reach(&self) -> (i64, i64) {
        let before = self
            .window
            .map_or(i64::MAX / 4, |w| w.before.min(i64::MAX as usize / 4) as i64);
        let window_after = self
            .window
            .map_or(i64::MAX / 4, |w| w.after.min(i64::MAX as usize / 4) as i64);
        let after = if self.causal { 0 } else { window_after };
        (before, after)
    }

    /// The visible key rows of query row `i` in batch row `batch`: a contiguous range, possibly
    /// empty (see the module docs).
    pub fn visible_keys(&self, batch: usize, i: usize, kv_len: usize) -> Range<usize> {
        let qp = i as i64 + self.q_offset;
        let (before, after) = self.reach();
        let mut lo = qp - before;
        let mut hi = qp.saturating_add(after).saturating_add(1);
        if let Some(d) = &self.documents {
            if qp < 0 || qp as usize >= d.len() {
                return 0..0;
            }
            let doc = d.document(batch, qp as usize);
            lo = lo.max(doc.start as i64);
            hi = hi.min(doc.end as i64);
        }
        let clamp = |p: i64| (p - self.kv_offset).clamp(0, kv_len as i64) as usize;
        let (lo, hi) = (clamp(lo), clamp(hi));
        lo..hi.max(lo)
    }

    /// Whether no (query, key) pair of a `q_len` by `kv_len` call is visible in any batch row:
    /// a caller can skip the call. Exact (not a bound): it looks at each row's range.
    pub fn hides_everything(&self, q_len: usize, kv_len: usize, batch: usize) -> bool {
        let rows = self
            .documents
            .as_ref()
            .map_or(1, |d| d.batch_rows().min(batch));
        (0..rows).all(|b| (0..q_len).all(|i| self.visible_keys(b, i, kv_len).is_empty()))
    }

    /// Errors unless this mask applies to a call of `batch` rows of `q_len` queries and `kv_len`
    /// keys at its offsets: documents must have one list for every batch row or one per batch
    /// row, and cover every query and key position of the call.
    ///
    /// # Errors
    ///
    /// [`ScheduleError::BadMask`] naming what was wrong.
    pub fn check_call(
        &self,
        batch: usize,
        q_len: usize,
        kv_len: usize,
    ) -> Result<(), ScheduleError> {
        let Some(docs) = &self.documents else {
            return Ok(());
        };
        let bad = |what: String| Err(ScheduleError::BadMask { what });
        if docs.batch_rows() != 1 && docs.batch_rows() != batch {
            return bad(format!(
                "documents are given for {} batch rows, the call has {} (give one list for all \
                 rows or one per row)",
                docs.batch_rows(),
                batch
            ));
        }
        for (what, offset, len) in [
            ("query", self.q_offset, q_len),
            ("key", self.kv_offset, kv_len),
        ] {
            if offset < 0 || offset as u64 + len as u64 > docs.len() as u64 {
                return bad(format!(
                    "the call's {what} rows are at positions {offset}..{}, the documents cover \
                     0..{}",
                    offset + len as i64,
                    docs.len()
                ));
            }
        }
        Ok(())
    }

    /// Errors unless this mask can be a whole sequence's mask for a schedule over `seq_len`
    /// positions: offsets 0 (the sequence starts at position 0), and documents, when given,
    /// covering exactly the sequence (every rank holds the documents of the whole sequence, not
    /// its shard's).
    ///
    /// # Errors
    ///
    /// [`ScheduleError::BadMask`] naming what was wrong.
    pub fn check_sequence(&self, seq_len: usize) -> Result<(), ScheduleError> {
        let bad = |what: String| Err(ScheduleError::BadMask { what });
        if self.q_offset != 0 || self.kv_offset != 0 {
            return bad(format!(
                "a sequence-parallel mask is the whole sequence's, at offsets 0 (the schedule \
                 gives each step its offsets); got q_offset {} and kv_offset {}",
                self.q_offset, self.kv_offset
            ));
        }
        match &self.documents {
            Some(documents) if documents.len() != seq_len => bad(format!(
                "the documents cover positions 0..{}, the sequence split over the ranks is \
                 0..{seq_len} (ranks x shard length): give every rank the documents of the whole \
                 sequence",
                documents.len()
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_masks_must_start_at_zero_and_cover_the_sequence() {
        let documents = Documents::from_cu_seqlens(&[0, 3, 12]).unwrap();
        let mask = Mask::causal().with_documents(documents);
        assert_eq!(mask.check_sequence(12), Ok(()));
        let short = mask.check_sequence(16).unwrap_err().to_string();
        assert!(
            short.contains("0..12") && short.contains("0..16"),
            "{short}"
        );
        let moved = Mask::causal().at(4, 4).check_sequence(16).unwrap_err();
        assert!(moved.to_string().contains("offsets 0"), "{moved}");
    }
}
