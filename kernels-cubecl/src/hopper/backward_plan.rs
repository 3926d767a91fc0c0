//! The Hopper attention backward's constants and what it covers, pure logic: which calls
//! `attention_backward.cu` takes (element types, head dims, masks, scales, determinism), the
//! switches of the variant compiled for a call, its shared memory, the order of its cubes, the
//! buffers its row kernels (`backward_rows.cu`) prepare, and the scalars all three read.

use super::band::{self, BandScalars};
use crate::dims::AttentionDims;
use crate::kernel_error::KernelError;
use crate::mask::{KernelMask, MaskKind};
use crate::stats::LOG2_E;
use crate::tensor::ElemType;
use crate::Mask;

/// Keys per cube (two consumer warpgroups of 64 keys).
pub const BLOCK_KEYS: usize = 128;
/// Query rows per tile of the walk (the `n` of the score products `wgmma.m64n64k16`); the row
/// kernels pad every slice to whole tiles.
pub const TILE_ROWS: usize = 64;
/// Pipeline stages of Q, dO (with their log-sum-exps and deltas) and dS in shared memory.
pub const STAGES: usize = 2;
/// Threads per cube of the main kernel: one producer and two consumer warpgroups.
pub const UNITS: usize = 384;
/// Threads per cube of the row kernels; the prepare kernel takes one row per warp.
pub const ROW_UNITS: usize = 256;
/// Bytes of queries, output gradients and dQ sums the cubes under way at one time should share:
/// as much of the 50 MB L2 of an H100 or H200 as the forward gives its keys and values.
pub const L2_BUDGET: usize = super::forward_plan::L2_BUDGET;

/// Shared memory one cube of the main kernel uses at `head_dim`: K and V (16-bit values),
/// `STAGES` tiles of Q, dO and dS^T, `STAGES` rows of log-sum-exps and deltas (f32),
/// `1 + 3 STAGES` barriers of 8 bytes, and up to 1023 bytes to align the tiles on the 128-byte
/// swizzle's 1024-byte period.
pub const fn shared_bytes(head_dim: usize) -> usize {
    let tiles =
        2 * BLOCK_KEYS * head_dim + STAGES * (2 * TILE_ROWS * head_dim + BLOCK_KEYS * TILE_ROWS);
    tiles * 2 + 2 * STAGES * TILE_ROWS * 4 + (1 + 3 * STAGES) * 8 + 1024
}

// Within the 227 KiB a Hopper cube may opt into.
const _: () = assert!(shared_bytes(128) <= 232_448);

/// One compiled form of the main kernel: what its switches select (the row kernels take the
/// head dim and the type).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BackwardVariant {
    /// 64 or 128.
    pub head_dim: usize,
    /// f16 or bf16 (q, k, v, dO and the gradients).
    pub elem: ElemType,
    /// The parts of the mask compiled in: an upper bound per row (causal, a window), a lower one
    /// (a window), documents (a table argument).
    pub mask: MaskKind,
    /// A backward step's: dK and dV added to f32 accumulators (and dQ, by the dQ kernel),
    /// else stored in the inputs' type (a whole attention's).
    pub accumulate: bool,
    /// The cubes add to each tile's dQ sum in a fixed order (bitwise the same gradients from
    /// run to run), else as they come.
    pub deterministic: bool,
}

impl BackwardVariant {
    /// The variant that computes the gradients of attention of `dims` in `elem` under `mask`
    /// with score `scale` (added to f32 accumulators where it is to `accumulate`; dQ added in a
    /// fixed order where `deterministic`), or why the kernel does not cover the call: another
    /// element type or head dim, or a scale that is not positive and finite.
    pub fn for_call(
        dims: &AttentionDims,
        elem: ElemType,
        (mask, scale): (&Mask, f32),
        deterministic: bool,
        accumulate: bool,
    ) -> Result<Self, KernelError> {
        super::coverage::check("the Hopper attention backward", dims, elem, scale)?;
        Ok(Self {
            head_dim: dims.head_dim,
            elem,
            mask: mask.kind(),
            accumulate,
            deterministic,
        })
    }

    /// The `#define` lines that select this variant in `attention_backward.cu` (the row
    /// kernels read the first two).
    pub fn switches(&self) -> String {
        format!(
            "#define DISTFLASH_HEAD_DIM {}\n#define DISTFLASH_F16 {}\n{}\
             #define DISTFLASH_ACCUMULATE {}\n#define DISTFLASH_DETERMINISTIC {}\n",
            self.head_dim,
            u8::from(self.elem == ElemType::F16),
            band::switches(self.mask),
            u8::from(self.accumulate),
            u8::from(self.deterministic),
        )
    }
}

/// Tiles of [`TILE_ROWS`] query rows per slice: the padded length of the row kernels' buffers
/// over [`TILE_ROWS`].
pub fn query_tiles(dims: &AttentionDims) -> usize {
    dims.q_len.div_ceil(TILE_ROWS)
}

/// The f32 elements of the buffers the prepare kernel writes: the base-2 log-sum-exp and the
/// delta of every padded query row, and the dQ sum (`head_dim` values a padded row).
pub fn prepared_rows(dims: &AttentionDims) -> usize {
    dims.batch * dims.q_heads * query_tiles(dims) * TILE_ROWS
}

/// The counters of the deterministic backward's ordered dQ adds: one per 64 columns of the
/// head dim of every padded query tile of every slice.
pub fn dq_turns(dims: &AttentionDims) -> usize {
    dims.batch * dims.q_heads * query_tiles(dims) * (dims.head_dim / 64)
}

/// Key/value slices per launch group: as many as share [`L2_BUDGET`] bytes of what their cubes
/// read and add to, the queries and output gradients (16-bit) and the dQ sums (f32) of their
/// query heads; at least one.
pub fn slice_group(dims: &AttentionDims) -> usize {
    let per_query_head = (2 * 2 + 4) * dims.q_len * dims.head_dim;
    let per_slice = per_query_head * dims.group_size();
    (L2_BUDGET / per_slice).clamp(1, dims.batch * dims.kv_heads)
}

/// The sixteen `u32` scalars the main kernel reads, in its `BackwardInfo` order: `q_len`,
/// `kv_len`, the key/value heads, the query heads per key/value head, the band's upper and lower
/// offsets from the diagonal ([`BandScalars`]), the scale times `log2(e)` and the scale (as `f32`
/// bits), the slices per launch group ([`slice_group`]), the key/value slices, the query tiles
/// per slice ([`query_tiles`]), the documents' four scalars, and 0.
pub fn scalars(dims: &AttentionDims, mask: &Mask, scale: f32) -> [u32; 16] {
    let BandScalars {
        upper,
        lower,
        documents: [q_pos0, kv_pos0, doc_stride, doc_count],
    } = band::scalars(dims, mask);
    [
        dims.q_len as u32,
        dims.kv_len as u32,
        dims.kv_heads as u32,
        dims.group_size() as u32,
        upper,
        lower,
        (scale * LOG2_E).to_bits(),
        scale.to_bits(),
        slice_group(dims) as u32,
        (dims.batch * dims.kv_heads) as u32,
        query_tiles(dims) as u32,
        q_pos0,
        kv_pos0,
        doc_stride,
        doc_count,
        0,
    ]
}

/// The four `u32` scalars the row kernels read, in their `RowsInfo` order: `q_len`, the query
/// tiles per slice, the (batch, query head) slices, and the scale (as `f32` bits).
pub fn row_scalars(dims: &AttentionDims, scale: f32) -> [u32; 4] {
    [
        dims.q_len as u32,
        query_tiles(dims) as u32,
        (dims.batch * dims.q_heads) as u32,
        scale.to_bits(),
    ]
}

#[cfg(test)]
mod tests {
    use super::super::coverage::{test_dims as dims, HEAD_DIMS};
    use super::*;
    use crate::hopper::source_task::assert_defines;
    use crate::{Documents, SlidingWindow};

    fn refusal(d: AttentionDims, elem: ElemType, mask: Mask, scale: f32) -> KernelError {
        BackwardVariant::for_call(&d, elem, (&mask, scale), true, true).unwrap_err()
    }

    #[test]
    fn both_head_dims_16_bit_types_and_every_mask_are_covered() {
        let documents = Documents::from_cu_seqlens(&[0, 1, 200, 517, 700]).unwrap();
        let masks = [
            Mask::none(),
            Mask::causal().at(40, 0),
            Mask::causal().with_window(SlidingWindow::causal(64).unwrap()),
            Mask::none().with_documents(documents.clone()),
            Mask::causal()
                .with_window(SlidingWindow::causal(100).unwrap())
                .with_documents(documents)
                .at(100, 50),
        ];
        for head_dim in HEAD_DIMS {
            for elem in [ElemType::BF16, ElemType::F16] {
                for (mask, accumulate) in masks.iter().zip([false, true].into_iter().cycle()) {
                    let variant = BackwardVariant::for_call(
                        &dims(head_dim),
                        elem,
                        (mask, 0.1),
                        false,
                        accumulate,
                    )
                    .unwrap();
                    assert_eq!(
                        variant,
                        BackwardVariant {
                            head_dim,
                            elem,
                            mask: mask.kind(),
                            accumulate,
                            deterministic: false,
                        }
                    );
                    // Deterministic under every mask, packed documents included.
                    let deterministic = BackwardVariant::for_call(
                        &dims(head_dim),
                        elem,
                        (mask, 0.1),
                        true,
                        accumulate,
                    );
                    assert!(deterministic.unwrap().deterministic);
                }
            }
        }
    }

    #[test]
    fn what_the_kernel_does_not_cover_is_refused_by_name() {
        let cases = [
            (
                refusal(dims(128), ElemType::F32, Mask::none(), 0.1),
                "got F32",
            ),
            (
                refusal(dims(96), ElemType::BF16, Mask::none(), 0.1),
                "got 96",
            ),
        ];
        for (err, what) in cases {
            let message = err.to_string();
            assert!(matches!(err, KernelError::Unsupported { .. }), "{message}");
            assert!(message.contains(what), "{what}: {message}");
        }
        for scale in [0.0, -0.5, f32::INFINITY, f32::NAN] {
            let err = refusal(dims(128), ElemType::BF16, Mask::causal(), scale);
            assert!(
                matches!(err, KernelError::BadOption { .. }) && err.to_string().contains("scale"),
                "{err}"
            );
        }
    }

    /// The query rows that see key `key` of batch row 0, `[from, until)`, clamped to the call's
    /// rows as the kernel's `rows_seeing_key` clamps them (a key no row sees gets an empty range
    /// at 0 or at `q_len`).
    fn rows_seeing_key(mask: &Mask, key: usize, q_len: usize) -> (usize, usize) {
        let (before, after) = mask.reach();
        let position = key as i64 + mask.kv_offset;
        let mut lo = position - after - mask.q_offset;
        let mut hi = position + before + 1 - mask.q_offset;
        if let Some(documents) = &mask.documents {
            let document = documents.document(0, position as usize);
            lo = lo.max(document.start as i64 - mask.q_offset);
            hi = hi.min(document.end as i64 - mask.q_offset);
        }
        let clamp = |row: i64| row.clamp(0, q_len as i64) as usize;
        let from = clamp(lo);
        (from, clamp(hi).max(from))
    }

    /// The query tiles (of `TILE_ROWS`) each key block (of `BLOCK_KEYS`) walks, as the kernel's
    /// `block_walk` takes them: from the tile of the first row that sees the block's first key
    /// to the tile of the last row that sees its last key; none where that is empty.
    fn walks(mask: &Mask, q_len: usize, kv_len: usize) -> Vec<std::ops::Range<usize>> {
        (0..kv_len.div_ceil(BLOCK_KEYS))
            .map(|block| {
                let first_key = block * BLOCK_KEYS;
                let last_key = (first_key + BLOCK_KEYS).min(kv_len) - 1;
                let (first_from, _) = rows_seeing_key(mask, first_key, q_len);
                let (_, last_until) = rows_seeing_key(mask, last_key, q_len);
                let first = first_from / TILE_ROWS;
                match last_until > first_from {
                    true => first..last_until.div_ceil(TILE_ROWS),
                    false => first..first,
                }
            })
            .collect()
    }

    /// Whether, for every query tile, the key blocks that walk it are consecutive: what the
    /// deterministic backward's order of dQ adds takes for granted.
    fn walkers_are_runs(walks: &[std::ops::Range<usize>]) -> bool {
        let tiles = walks.iter().map(|w| w.end).max().unwrap_or(0);
        (0..tiles).all(|tile| {
            let walkers: Vec<usize> = (0..walks.len())
                .filter(|&b| walks[b].contains(&tile))
                .collect();
            walkers.windows(2).all(|pair| pair[1] == pair[0] + 1)
        })
    }

    #[test]
    fn the_blocks_that_walk_a_query_tile_are_consecutive() {
        // Causal at offsets (keys ahead of the queries, queries ahead of the keys), windows
        // (one key, short, wider than the sequence, two-sided), no mask, and packed documents
        // (one-token ones, documents that hold no query row of the call before and after those
        // that do, under a window, bidirectional); odd lengths.
        let documents = Documents::from_cu_seqlens(&[0, 1, 40, 300, 301, 700, 1500, 2600]).unwrap();
        let masks = [
            Mask::none(),
            Mask::causal(),
            Mask::causal().at(300, 0),
            Mask::causal().at(0, 200),
            Mask::causal().at(517, 900),
            Mask::causal().with_window(SlidingWindow::causal(1).unwrap()),
            Mask::causal().with_window(SlidingWindow::causal(100).unwrap()),
            Mask::causal().with_window(SlidingWindow::causal(5000).unwrap()),
            Mask::causal()
                .with_window(SlidingWindow::causal(150).unwrap())
                .at(250, 0),
            Mask::none().with_window(SlidingWindow::two_sided(70, 130)),
            Mask::causal().with_documents(documents.clone()),
            Mask::causal().with_documents(documents.clone()).at(400, 0),
            Mask::causal()
                .with_documents(documents.clone())
                .at(1000, 300),
            Mask::none().with_documents(documents.clone()).at(350, 0),
            Mask::causal()
                .with_window(SlidingWindow::causal(90).unwrap())
                .with_documents(documents)
                .at(600, 250),
        ];
        for mask in &masks {
            for (q_len, kv_len) in [(700, 700), (383, 1100), (1100, 383), (64, 513)] {
                let walks = walks(mask, q_len, kv_len);
                assert!(
                    walkers_are_runs(&walks),
                    "{mask:?} {q_len} x {kv_len}: {walks:?}"
                );
            }
        }
        // The check itself: a block that walks nothing between two that walk tile 1.
        assert!(!walkers_are_runs(&[0..2, 0..0, 1..2]));
    }

    #[test]
    fn switches_select_the_variant() {
        let variant = BackwardVariant {
            head_dim: 64,
            elem: ElemType::F16,
            mask: Mask::causal().kind(),
            accumulate: false,
            deterministic: false,
        };
        assert_eq!(
            variant.switches(),
            "#define DISTFLASH_HEAD_DIM 64\n#define DISTFLASH_F16 1\n#define DISTFLASH_UPPER 1\n\
             #define DISTFLASH_LOWER 0\n#define DISTFLASH_DOCUMENTS 0\n\
             #define DISTFLASH_ACCUMULATE 0\n#define DISTFLASH_DETERMINISTIC 0\n"
        );
        let step = BackwardVariant {
            accumulate: true,
            deterministic: true,
            ..variant
        };
        assert!(step
            .switches()
            .ends_with("#define DISTFLASH_ACCUMULATE 1\n#define DISTFLASH_DETERMINISTIC 1\n"));
    }

    #[test]
    fn scalars_carry_the_band_the_scales_and_the_padded_tiles() {
        let d = dims(128);
        let documents = Documents::from_cu_seqlens(&[0, 1, 200, 700]).unwrap();
        let mask = Mask::causal()
            .with_window(SlidingWindow::causal(64).unwrap())
            .with_documents(documents)
            .at(217, 0);
        let [q_len, kv_len, kv_heads, group, upper, lower, scale_log2, scale, rest @ ..] =
            scalars(&d, &mask, 0.125);
        assert_eq!([q_len, kv_len, kv_heads, group], [300, 517, 2, 4]);
        let band = band::scalars(&d, &mask);
        assert_eq!([upper, lower], [band.upper, band.lower]);
        assert_eq!([upper as i32, lower as i32], [217, 217 - 63]);
        assert_eq!(f32::from_bits(scale_log2), 0.125 * LOG2_E);
        assert_eq!(f32::from_bits(scale), 0.125);
        // 300 rows: 5 tiles of 64, the last holding 44 rows; then the documents.
        assert_eq!(rest, [4, 4, 5, 217, 0, 0, 4, 0]);
        let [_, _, _, _, upper, ..] = scalars(&d, &Mask::causal().at(0, 40), 0.125);
        assert_eq!(upper as i32, -40);
        assert_eq!(row_scalars(&d, 0.5), [300, 5, 16, 0.5f32.to_bits()]);
        assert_eq!(prepared_rows(&d), 16 * 5 * 64);
    }

    #[test]
    fn slice_groups_share_the_l2_budget_in_whole_slices() {
        let long = |len, q_heads, kv_heads| AttentionDims {
            batch: 1,
            q_heads,
            kv_heads,
            q_len: len,
            kv_len: len,
            head_dim: 128,
        };
        // 8 MiB of Q, dO and dQ sums per query head at 8K: four slices; two at 16K; one at 32K.
        assert_eq!(slice_group(&long(8192, 32, 32)), 4);
        assert_eq!(slice_group(&long(16384, 32, 32)), 2);
        assert_eq!(slice_group(&long(32768, 32, 32)), 1);
        // GQA 32 / 8: a key/value slice reads four query heads.
        assert_eq!(slice_group(&long(8192, 32, 8)), 1);
        // At least one slice, at most all of them.
        assert_eq!(slice_group(&long(1 << 20, 32, 8)), 1);
        assert_eq!(slice_group(&long(128, 32, 32)), 32);
    }

    #[test]
    fn the_device_source_agrees_with_these_constants() {
        let source = include_str!("attention_backward.cu");
        assert_defines(
            "attention_backward.cu",
            source,
            &[
                ("DF_BM", TILE_ROWS),
                ("DF_BN", BLOCK_KEYS),
                ("DF_STAGES", STAGES),
                ("DF_THREADS", UNITS),
            ],
        );
        // The kernel's shared memory: K, V, the stages of Q, dO and dS^T, of lse and delta, then
        // seven barriers.
        assert!(source.contains("at.empty = at.do_full + DF_STAGES * 8;"));
        assert!(source.contains("#define DF_DS_BYTES (DF_BN * DF_BM * 2)\n"));
        assert_eq!(shared_bytes(128), 160 * 1024 + 1024 + 56 + 1024);
        assert_defines(
            "backward_rows.cu",
            include_str!("backward_rows.cu"),
            &[("DF_BM", TILE_ROWS), ("DF_ROW_UNITS", ROW_UNITS)],
        );
    }
}
