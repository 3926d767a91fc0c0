//! Which keys a query may see: causal order, a sliding window and document boundaries, at the
//! absolute positions of a call's query and key chunks. The host side (`Mask`, its checks and
//! the scalars a kernel takes) and the kernel side (each row's visible keys, each key's
//! visible queries) of one rule.
//!
//! Every mask of this crate is a *band*: query row `i` sees the keys of one contiguous range
//! `[lo(i), hi(i))`, and both ends never decrease as `i` grows. That is what lets a kernel skip
//! every key tile outside its block's range and mask only the tiles at its two edges.

use std::ops::Range;
use std::sync::Arc;

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::dims::AttentionDims;
use crate::kernel_error::KernelError;

/// A sliding window around each query, FlashAttention's `window_size = (left, right)`: the query
/// at absolute position `i` sees keys at positions `i - before ..= i + after`. Combined with a
/// causal mask, `after` is 0 whatever it says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SlidingWindow {
    /// Keys before the query that it sees.
    pub before: usize,
    /// Keys after the query that it sees.
    pub after: usize,
}

impl SlidingWindow {
    /// The causal window of `size` keys, Mistral-style: the query at position `i` sees keys
    /// `(i - size, i]` (itself and the `size - 1` keys before it). Use with a causal mask.
    ///
    /// # Errors
    ///
    /// [`KernelError::BadMask`] when `size` is 0: a window of no key would hide every key from
    /// every query, which is a configuration mistake, not a window (the smallest window, 1,
    /// lets each query see itself).
    pub fn causal(size: usize) -> Result<Self, KernelError> {
        match size.checked_sub(1) {
            Some(before) => Ok(Self { before, after: 0 }),
            None => Err(KernelError::BadMask {
                what: "a causal sliding window of 0 keys: the size counts the keys each query \
                       sees, itself included, so it must be at least 1"
                    .into(),
            }),
        }
    }

    /// A two-sided window: `before` keys before the query and `after` keys after it.
    pub fn two_sided(before: usize, after: usize) -> Self {
        Self { before, after }
    }
}

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
    /// [`KernelError::BadMask`] unless the list starts at 0, strictly increases and has at
    /// least two entries, and `len` fits 32 bits.
    pub fn from_cu_seqlens(cu_seqlens: &[usize]) -> Result<Self, KernelError> {
        Self::per_batch_row(&[cu_seqlens.to_vec()])
    }

    /// One list of cumulative lengths per batch row; every list ends at the same `len`.
    ///
    /// # Errors
    ///
    /// [`KernelError::BadMask`] when there is no row, a list does not start at 0, does not
    /// strictly increase or has fewer than two entries, the lists end at different lengths, or
    /// the length does not fit 32 bits.
    pub fn per_batch_row(rows: &[Vec<usize>]) -> Result<Self, KernelError> {
        let bad = |what: String| Err(KernelError::BadMask { what });
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
    pub fn from_segment_ids<T: PartialEq>(rows: &[Vec<T>]) -> Result<Self, KernelError> {
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

    fn row(&self, batch: usize) -> &[u32] {
        let r = if self.rows == 1 { 0 } else { batch };
        &self.bounds[r * self.per_row..][..self.per_row]
    }
}

/// Which keys a query may see. Positions are absolute: the call's query rows start at position
/// `q_offset` of the sequence and its key rows at `kv_offset`, so query row `i` (local to the
/// call) is at `i + q_offset` and key row `j` at `j + kv_offset`. It sees that key iff every
/// part of the mask that is set allows it:
/// - `causal`: `key position <= query position`;
/// - `window`: `query - before <= key <= query + after` (see [`SlidingWindow`]);
/// - `documents`: both positions in the same document (see [`Documents`]).
///
/// The default sees everything at offsets 0.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Mask {
    /// Keys after the query are hidden.
    pub causal: bool,
    /// Keys outside a window around the query are hidden.
    pub window: Option<SlidingWindow>,
    /// Keys of other documents are hidden.
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
        let (lo, hi) = self.band();
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

    /// How far before and after its own position a query sees (`i64::MAX` for unbounded).
    fn band(&self) -> (i64, i64) {
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
        let (before, after) = self.band();
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

    /// Errors unless the kernels can apply this mask to a call of `dims`: documents must have
    /// one row or one per batch row, and cover every query and key position of the call.
    ///
    /// # Errors
    ///
    /// [`KernelError::BadMask`] naming what was wrong.
    pub fn check(&self, dims: &AttentionDims) -> Result<(), KernelError> {
        let Some(docs) = &self.documents else {
            return Ok(());
        };
        let bad = |what: String| Err(KernelError::BadMask { what });
        if docs.batch_rows() != 1 && docs.batch_rows() != dims.batch {
            return bad(format!(
                "documents are given for {} batch rows, the call has {} (give one list for all \
                 rows or one per row)",
                docs.batch_rows(),
                dims.batch
            ));
        }
        for (what, offset, len) in [
            ("query", self.q_offset, dims.q_len),
            ("key", self.kv_offset, dims.kv_len),
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

    /// The compile-time shape of this mask in a kernel.
    pub(crate) fn kind(&self) -> MaskKind {
        MaskKind {
            upper: self.causal || self.window.is_some(),
            lower: self.window.is_some(),
            documents: self.documents.is_some(),
        }
    }

    /// The run-time values of this mask for a call of `dims` (see [`MaskBounds`]); values an
    /// unset part does not use are 0.
    pub(crate) fn bounds(&self, dims: &AttentionDims) -> MaskBounds {
        let reach = (dims.q_len + dims.kv_len) as i64 + 1;
        let clamp = |x: i64| x.clamp(-reach, reach) as i32;
        let (before, after) = self.band();
        let kind = self.kind();
        let docs = self.documents.as_ref();
        MaskBounds {
            shift: clamp(self.q_offset.saturating_sub(self.kv_offset)),
            before: if kind.lower { clamp(before) } else { 0 },
            after: if kind.upper { clamp(after) } else { 0 },
            q_pos0: if kind.documents {
                self.q_offset as u32
            } else {
                0
            },
            kv_pos0: if kind.documents {
                self.kv_offset as u32
            } else {
                0
            },
            doc_stride: docs.map_or(0, |d| if d.rows == 1 { 0 } else { d.per_row as u32 }),
            doc_count: docs.map_or(0, |d| d.per_row as u32),
        }
    }
}

/// Which parts of a [`Mask`] a kernel is compiled with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct MaskKind {
    /// Each query row's keys end at `i + shift + after + 1` (causal, or a window).
    pub upper: bool,
    /// Each query row's keys start at `i + shift - before` (a window).
    pub lower: bool,
    /// Each query row's keys lie in its document (a document-table argument).
    pub documents: bool,
}

/// The run-time values of a mask in a kernel, in rows local to the call (see
/// [`row_key_range`] and [`key_query_range`]).
#[derive(CubeType, CubeLaunch, Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaskBounds {
    /// `q_offset - kv_offset`, clamped to `±(q_len + kv_len + 1)`.
    pub shift: i32,
    /// Keys before its own position a query sees (with [`MaskKind::lower`]), clamped likewise.
    pub before: i32,
    /// Keys after its own position a query sees (with [`MaskKind::upper`]; 0 when causal).
    pub after: i32,
    /// Absolute position of query row 0 (with [`MaskKind::documents`]).
    pub q_pos0: u32,
    /// Absolute position of key row 0 (with [`MaskKind::documents`]).
    pub kv_pos0: u32,
    /// Entries between two batch rows' document bounds (0 when all rows share them).
    pub doc_stride: u32,
    /// Document bounds per batch row (documents + 1).
    pub doc_count: u32,
}

/// A [`Documents`]' bounds on the device, as the kernels read them (`u32`, `doc_count` per
/// batch row).
#[derive(Debug, Clone)]
pub(crate) struct DocumentTable {
    /// The device memory.
    pub handle: Handle,
    /// Entries.
    pub len: usize,
}

impl DocumentTable {
    /// Uploads `documents`' bounds.
    pub(crate) fn upload<R: Runtime>(client: &ComputeClient<R>, documents: &Documents) -> Self {
        let bytes: Vec<u8> = documents
            .bounds
            .iter()
            .flat_map(|b| b.to_le_bytes())
            .collect();
        Self {
            handle: client.create_from_slice(&bytes),
            len: documents.bounds.len(),
        }
    }

    /// The table of `mask`'s documents, or, without documents, a one-entry view of
    /// `placeholder` (any live buffer: a kernel compiled without documents never reads it).
    pub(crate) fn of<R: Runtime>(
        client: &ComputeClient<R>,
        mask: &Mask,
        placeholder: &Handle,
    ) -> Self {
        match &mask.documents {
            Some(d) => Self::upload(client, d),
            None => Self {
                handle: placeholder.clone(),
                len: 1,
            },
        }
    }

    /// Kernel argument viewing the table as a flat `u32` array.
    pub(crate) fn array_arg<R: Runtime>(&self) -> ArrayArg<R> {
        // SAFETY: the handle holds at least `len` four-byte entries (both constructors; a
        // placeholder holds at least one element of at least two bytes and is never read).
        unsafe { ArrayArg::from_raw_parts(self.handle.clone(), self.len) }
    }
}

/// The document `[start, end)` (absolute positions) of absolute position `pos` in batch row
/// `batch`: a binary search of that row's bounds. `pos` must lie before the sequence's end.
#[cube]
pub(crate) fn document_of(
    docs: &Array<u32>,
    bounds: &MaskBounds,
    batch: u32,
    pos: u32,
) -> (u32, u32) {
    let base = batch * bounds.doc_stride;
    // Invariant: docs[base + lo] <= pos < docs[base + hi].
    let mut lo = 0u32;
    let mut hi = bounds.doc_count - 1;
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if docs[(base + mid) as usize] <= pos {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    (docs[(base + lo) as usize], docs[(base + hi) as usize])
}

/// The keys query row `row` (local, `< q_len`) sees: `[lo, hi)` within `[0, kv_len]`, with
/// `lo <= hi` (empty when equal). Both ends never decrease as `row` grows.
#[cube]
pub(crate) fn row_key_range(
    docs: &Array<u32>,
    bounds: &MaskBounds,
    batch: u32,
    row: u32,
    kv_len: u32,
    #[comptime] kind: MaskKind,
) -> (u32, u32) {
    let mut lo = 0i32;
    let mut hi = kv_len as i32;
    if kind.upper {
        hi = min(hi, row as i32 + bounds.shift + bounds.after + 1);
    }
    if kind.lower {
        lo = max(lo, row as i32 + bounds.shift - bounds.before);
    }
    if kind.documents {
        let (start, end) = document_of(docs, bounds, batch, row + bounds.q_pos0);
        lo = max(lo, start as i32 - bounds.kv_pos0 as i32);
        hi = min(hi, end as i32 - bounds.kv_pos0 as i32);
    }
    let lo = min(lo, kv_len as i32);
    (lo as u32, max(hi, lo) as u32)
}

/// The query rows that see key row `key` (local, `< kv_len`): `[lo, hi)` within `[0, q_len]`,
/// `lo <= hi`. The inverse of [`row_key_range`]: query `i` sees key `j` iff `j` lies in `i`'s
/// range iff `i` lies in `j`'s. Both ends never decrease as `key` grows.
#[cube]
pub(crate) fn key_query_range(
    docs: &Array<u32>,
    bounds: &MaskBounds,
    batch: u32,
    key: u32,
    q_len: u32,
    #[comptime] kind: MaskKind,
) -> (u32, u32) {
    let mut lo = 0i32;
    let mut hi = q_len as i32;
    if kind.upper {
        lo = max(lo, key as i32 - bounds.shift - bounds.after);
    }
    if kind.lower {
        hi = min(hi, key as i32 - bounds.shift + bounds.before + 1);
    }
    if kind.documents {
        let (start, end) = document_of(docs, bounds, batch, key + bounds.kv_pos0);
        lo = max(lo, start as i32 - bounds.q_pos0 as i32);
        hi = min(hi, end as i32 - bounds.q_pos0 as i32);
    }
    let lo = min(lo, q_len as i32);
    (lo as u32, max(hi, lo) as u32)
}
