//! The kernel side of a [`Mask`] (whose host side, with the types, is `distflash-schedule`'s):
//! the compile-time shape a kernel is built for ([`MaskKind`]), the run-time scalars it takes
//! ([`MaskBounds`]), the documents' table on the device ([`DocumentTable`]), and each row's
//! visible keys and each key's visible queries inside a kernel.
//!
//! Every mask is a *band*: query row `i` sees the keys of one contiguous range `[lo(i), hi(i))`,
//! and both ends never decrease as `i` grows. That is what lets a kernel skip every key tile
//! outside its block's range and mask only the tiles at its two edges.

use cubecl::prelude::*;
use cubecl::server::Handle;
use distflash_schedule::{Documents, Mask};

use crate::dims::AttentionDims;
use crate::kernel_error::KernelError;

/// What the kernels need of a [`Mask`] beyond its host logic: its check against a call, its
/// compile-time shape and its run-time scalars.
pub(crate) trait KernelMask {
    /// Errors unless the kernels can apply this mask to a call of `dims` (see
    /// [`Mask::check_call`]).
    fn check(&self, dims: &AttentionDims) -> Result<(), KernelError>;

    /// The compile-time shape of this mask in a kernel.
    fn kind(&self) -> MaskKind;

    /// The run-time values of this mask for a call of `dims` (see [`MaskBounds`]); values an
    /// unset part does not use are 0.
    fn bounds(&self, dims: &AttentionDims) -> MaskBounds;
}

impl KernelMask for Mask {
    fn check(&self, dims: &AttentionDims) -> Result<(), KernelError> {
        Ok(self.check_call(dims.batch, dims.q_len, dims.kv_len)?)
    }

    fn kind(&self) -> MaskKind {
        MaskKind {
            upper: self.causal || self.window.is_some(),
            lower: self.window.is_some(),
            documents: self.documents.is_some(),
        }
    }

    fn bounds(&self, dims: &AttentionDims) -> MaskBounds {
        let reach = (dims.q_len + dims.kv_len) as i64 + 1;
        let clamp = |x: i64| x.clamp(-reach, reach) as i32;
        let (before, after) = self.reach();
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
            doc_stride: docs.map_or(0, |d| {
                if d.batch_rows() == 1 {
                    0
                } else {
                    d.bounds_per_row() as u32
                }
            }),
            doc_count: docs.map_or(0, |d| d.bounds_per_row() as u32),
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
            .padded_bounds()
            .iter()
            .flat_map(|b| b.to_le_bytes())
            .collect();
        Self {
            handle: client.create_from_slice(&bytes),
            len: documents.padded_bounds().len(),
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
