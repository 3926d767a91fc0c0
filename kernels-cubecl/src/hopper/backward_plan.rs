//! The Hopper attention backward's constants and what it covers, pure logic: which calls
//! `attention_backward.cu` takes (element types, head dims, masks, scales, determinism), the
//! switches of the variant compiled for a call, its shared memory, the order of its cubes, how
//! many cubes split a GQA group's query heads ([`head_parts`]), the buffers its row kernels
//! (`backward_rows.cu`) prepare, and the scalars they all read.

use super::band::{self, BandScalars};
use super::schedule::{DeterministicAdds, HeadSplit};
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
/// Cubes per multiprocessor below which a GQA/MQA backward splits each group's query heads over
/// several cubes ([`head_parts`]). One cube fits a multiprocessor (161 KiB of shared memory), and
/// the cubes start heaviest block first, so what the last of them leave idle is about the
/// longest cube's walk, which under a causal mask is twice the mean cube's: 2 / (cubes per
/// multiprocessor) of the pass at most. Measured on an H200 (BENCHMARKS.md, causal, head dim
/// 128): GQA 32 / 8 at 16K (7.8 cubes per multiprocessor) ran as fast against cuDNN as without
/// GQA (1.01x forward+backward), at 8K (3.9) at 0.88x against 0.97-0.99x; a list schedule of the
/// walks in launch order leaves 1% of the pass idle at 7.8 and 24% at 3.9.
pub const MIN_CUBES_PER_SM: usize = 6;
/// Multiprocessors assumed where the device does not say (an H100 SXM or H200 has 132).
pub const DEFAULT_MULTIPROCESSORS: usize = 132;

/// Shared memory one cube of the main kernel uses at `head_dim`: K and V (16-bit values),
/// `STAGES` tiles of Q, dO and dS^T, `STAGES` rows of log-sum-exps and deltas (f32),
/// `1 + 3 STAGES` barriers of 8 bytes, and up to 1023 bytes to align the tiles on the 128-byte
/// swizzle's 1024-byte period.
pub const fn shared_bytes(head_dim: usize) -> usize {
    shared_bytes_for(head_dim, false)
}

/// [`shared_bytes`], plus with `producer_adds` (the deterministic backward's dQ adds by a
/// producer warp, [`BackwardVariant::producer_adds`]) a buffer per dQ-computing warpgroup (one
/// per 64 columns of the head dim) for its 64 x 64 f32 dQ block, a 16-byte header and two
/// barriers: 32,832 bytes more at head dim 128 (198,776 in all), 16,416 at 64.
pub const fn shared_bytes_for(head_dim: usize, producer_adds: bool) -> usize {
    let tiles =
        2 * BLOCK_KEYS * head_dim + STAGES * (2 * TILE_ROWS * head_dim + BLOCK_KEYS * TILE_ROWS);
    let base = tiles * 2 + 2 * STAGES * TILE_ROWS * 4 + (1 + 3 * STAGES) * 8 + 1024;
    match producer_adds {
        true => base + (head_dim / 64) * (TILE_ROWS * 64 * 4 + 16 + 2 * 8),
        false => base,
    }
}

// Within the 227 KiB a Hopper cube may opt into.
const _: () = assert!(shared_bytes_for(128, true) <= 232_448);

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
    /// A GQA group's query heads are walked by several cubes per block of keys ([`head_parts`]
    /// of them, a scalar), which add their dK and dV to f32 sums with atomics: a whole
    /// attention's zeroed sums, which a row kernel converts to the inputs' type (a step's
    /// accumulators would take them the same way, but the plan never splits a step). Never with
    /// `deterministic`.
    pub split: bool,
    /// The deterministic backward's ordered dQ adds are a producer warp's, from a buffer in
    /// shared memory ([`DeterministicAdds::Producer`]), not the consumers'. Only with
    /// `deterministic`.
    pub producer_adds: bool,
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
            split: false,
            producer_adds: false,
        })
    }

    /// This variant with the deterministic backward's dQ adds made by `adds` (nothing changes
    /// where the variant is not deterministic).
    pub fn with_deterministic_adds(self, adds: DeterministicAdds) -> Self {
        Self {
            producer_adds: self.deterministic && adds == DeterministicAdds::Producer,
            ..self
        }
    }

    /// The shared memory one cube of this variant's main kernel uses ([`shared_bytes_for`]).
    pub fn shared_bytes(&self) -> usize {
        shared_bytes_for(self.head_dim, self.producer_adds)
    }

    /// This variant with each group's query heads split over `head_parts` cubes (where more
    /// than one).
    pub fn with_head_parts(self, head_parts: usize) -> Self {
        debug_assert!(head_parts == 1 || !(self.deterministic || self.accumulate));
        Self {
            split: head_parts > 1,
            ..self
        }
    }

    /// The `#define` lines that select this variant in `attention_backward.cu` (the row
    /// kernels read the first two). A split variant's main kernel adds dK and dV to f32 sums
    /// (`DISTFLASH_ACCUMULATE`) with atomics (`DISTFLASH_SPLIT`), a whole attention's as a
    /// step's: one source for both.
    pub fn switches(&self) -> String {
        format!(
            "#define DISTFLASH_HEAD_DIM {}\n#define DISTFLASH_F16 {}\n{}\
             #define DISTFLASH_ACCUMULATE {}\n#define DISTFLASH_DETERMINISTIC {}\n\
             #define DISTFLASH_SPLIT {}\n{}",
            self.head_dim,
            u8::from(self.elem == ElemType::F16),
            band::switches(self.mask),
            u8::from(self.accumulate || self.split),
            u8::from(self.deterministic),
            u8::from(self.split),
            match self.producer_adds {
                true => "#define DISTFLASH_PRODUCER_ADDS 1\n",
                false => "",
            },
        )
    }
}

/// The cubes of the main kernel without a split: one per block of [`BLOCK_KEYS`] keys of each
/// key/value slice.
pub fn unsplit_cubes(dims: &AttentionDims) -> usize {
    dims.batch * dims.kv_heads * dims.kv_len.div_ceil(BLOCK_KEYS)
}

/// Over how many cubes each (key/value slice, block of keys) splits its GQA group's query heads,
/// each cube walking `group / parts` consecutive heads: a divisor of the group size. Never for
/// the deterministic backward (the atomics' order would change dK's and dV's bits from run to
/// run) nor for a step (`accumulate`: its sums into the caller's accumulators stay one cube's,
/// reproducible), whatever `split` says; else [`HeadSplit::Never`] 1, [`HeadSplit::Parts`]
/// the largest divisor of the group not above its count, and [`HeadSplit::Auto`] 1 where the
/// unsplit grid gives each of the device's `multiprocessors` (132 where it does not say) at
/// least [`MIN_CUBES_PER_SM`] cubes, else the smallest divisor that does (the whole group where
/// none does). MHA (a group of one) never splits.
pub fn head_parts(
    dims: &AttentionDims,
    multiprocessors: Option<u32>,
    (deterministic, accumulate): (bool, bool),
    split: HeadSplit,
) -> usize {
    let group = dims.group_size();
    if deterministic || accumulate || group <= 1 {
        return 1;
    }
    let mut divisors = (1..=group).filter(|parts| group.is_multiple_of(*parts));
    match split {
        HeadSplit::Never => 1,
        HeadSplit::Parts(most) => divisors
            .take_while(|&parts| parts <= most)
            .last()
            .unwrap_or(1),
        HeadSplit::Auto => {
            let sms = multiprocessors.map_or(DEFAULT_MULTIPROCESSORS, |n| n.max(1) as usize);
            let wanted = MIN_CUBES_PER_SM * sms;
            let cubes = unsplit_cubes(dims);
            divisors
                .find(|parts| cubes * parts >= wanted)
                .unwrap_or(group)
        }
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

/// Slices per launch group: as many as share [`L2_BUDGET`] bytes of what their cubes read and
/// add to, the queries and output gradients (16-bit) and the dQ sums (f32) of their query heads;
/// at least one. With each group's heads split over `head_parts` cubes a slice is one part of a
/// key/value slice (its `group / head_parts` query heads), and there are `head_parts` times as
/// many.
pub fn slice_group(dims: &AttentionDims, head_parts: usize) -> usize {
    let per_query_head = (2 * 2 + 4) * dims.q_len * dims.head_dim;
    let per_slice = per_query_head * (dims.group_size() / head_parts);
    (L2_BUDGET / per_slice).clamp(1, dims.batch * dims.kv_heads * head_parts)
}

/// The f32 elements of each of a split backward's dK and dV sums: `[B * Hkv, Skv, D]`.
pub fn key_grad_elements(dims: &AttentionDims) -> usize {
    dims.batch * dims.kv_heads * dims.kv_len * dims.head_dim
}

/// The sixteen `u32` scalars the main kernel reads, in its `BackwardInfo` order: `q_len`,
/// `kv_len`, the key/value heads, the query heads per key/value head, the band's upper and lower
/// offsets from the diagonal ([`BandScalars`]), the scale times `log2(e)` and the scale (as `f32`
/// bits), the slices per launch group ([`slice_group`]), the key/value slices, the query tiles
/// per slice ([`query_tiles`]), the documents' four scalars, and the cubes each group's heads
/// are split over ([`head_parts`]; 1 unsplit).
pub fn scalars(dims: &AttentionDims, mask: &Mask, scale: f32, head_parts: usize) -> [u32; 16] {
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
        slice_group(dims, head_parts) as u32,
        (dims.batch * dims.kv_heads) as u32,
        query_tiles(dims) as u32,
        q_pos0,
        kv_pos0,
        doc_stride,
        doc_count,
        head_parts as u32,
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

/// The four `u32` scalars the conversion of a split backward's dK and dV sums reads, in the row
/// kernels' `RowsInfo` order: `kv_len` as the rows per slice, 0, the key/value slices, and the
/// scale (unused: dK's sum is scaled already).
pub fn key_row_scalars(dims: &AttentionDims, scale: f32) -> [u32; 4] {
    [
        dims.kv_len as u32,
        0,
        (dims.batch * dims.kv_heads) as u32,
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
                            split: false,
                            producer_adds: false,
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
            split: false,
            producer_adds: false,
        };
        assert_eq!(
            variant.switches(),
            "#define DISTFLASH_HEAD_DIM 64\n#define DISTFLASH_F16 1\n#define DISTFLASH_UPPER 1\n\
             #define DISTFLASH_LOWER 0\n#define DISTFLASH_DOCUMENTS 0\n\
             #define DISTFLASH_ACCUMULATE 0\n#define DISTFLASH_DETERMINISTIC 0\n\
             #define DISTFLASH_SPLIT 0\n"
        );
        let step = BackwardVariant {
            accumulate: true,
            deterministic: true,
            ..variant
        };
        assert!(step.switches().ends_with(
            "#define DISTFLASH_ACCUMULATE 1\n#define DISTFLASH_DETERMINISTIC 1\n\
             #define DISTFLASH_SPLIT 0\n"
        ));
        // A split whole attention's main kernel adds dK and dV to f32 sums as a step's does.
        let split = variant.with_head_parts(4);
        assert!(split.split && !split.accumulate);
        assert!(split.switches().ends_with(
            "#define DISTFLASH_ACCUMULATE 1\n#define DISTFLASH_DETERMINISTIC 0\n\
             #define DISTFLASH_SPLIT 1\n"
        ));
        assert_eq!(variant.with_head_parts(1), variant);
        // The producer's ordered dQ adds: only for the deterministic backward, one more switch
        // (and the consumers' form's switches as they were).
        let producer = step.with_deterministic_adds(DeterministicAdds::Producer);
        assert!(producer.producer_adds);
        assert_eq!(
            producer.switches(),
            format!("{}#define DISTFLASH_PRODUCER_ADDS 1\n", step.switches())
        );
        assert_eq!(
            step.with_deterministic_adds(DeterministicAdds::Consumers),
            step
        );
        assert_eq!(
            variant.with_deterministic_adds(DeterministicAdds::Producer),
            variant
        );
    }

    #[test]
    fn the_producers_dq_buffers_fit_beside_the_pipeline() {
        // A 64 x 64 f32 block, a 16-byte header and two barriers per 64 columns of the head dim.
        assert_eq!(
            shared_bytes_for(128, true),
            shared_bytes(128) + 2 * (16 * 1024 + 16 + 16)
        );
        assert_eq!(shared_bytes_for(128, true), 198_776);
        assert_eq!(
            shared_bytes_for(64, true),
            shared_bytes(64) + 16 * 1024 + 16 + 16
        );
        assert_eq!(shared_bytes_for(64, false), shared_bytes(64));
        assert!(shared_bytes_for(128, true) <= 232_448);
        let variant = BackwardVariant::for_call(
            &dims(128),
            ElemType::BF16,
            (&Mask::causal(), 0.1),
            true,
            false,
        )
        .unwrap();
        assert_eq!(variant.shared_bytes(), shared_bytes(128));
        assert_eq!(
            variant
                .with_deterministic_adds(DeterministicAdds::Producer)
                .shared_bytes(),
            198_776
        );
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
            scalars(&d, &mask, 0.125, 1);
        assert_eq!([q_len, kv_len, kv_heads, group], [300, 517, 2, 4]);
        let band = band::scalars(&d, &mask);
        assert_eq!([upper, lower], [band.upper, band.lower]);
        assert_eq!([upper as i32, lower as i32], [217, 217 - 63]);
        assert_eq!(f32::from_bits(scale_log2), 0.125 * LOG2_E);
        assert_eq!(f32::from_bits(scale), 0.125);
        // 300 rows: 5 tiles of 64, the last holding 44 rows; then the documents; no split.
        assert_eq!(rest, [4, 4, 5, 217, 0, 0, 4, 1]);
        // Split in two: twice the slices of half the group's heads (all in one launch group
        // here), the parts last.
        let split = scalars(&d, &mask, 0.125, 2);
        assert_eq!([split[8], split[9], split[15]], [8, 4, 2]);
        let [_, _, _, _, upper, ..] = scalars(&d, &Mask::causal().at(0, 40), 0.125, 1);
        assert_eq!(upper as i32, -40);
        assert_eq!(row_scalars(&d, 0.5), [300, 5, 16, 0.5f32.to_bits()]);
        assert_eq!(prepared_rows(&d), 16 * 5 * 64);
        assert_eq!(key_row_scalars(&d, 0.5), [517, 0, 4, 0.5f32.to_bits()]);
        assert_eq!(key_grad_elements(&d), 4 * 517 * 128);
    }

    /// One sequence of `len` tokens attending to itself, head dim 128.
    fn long(len: usize, q_heads: usize, kv_heads: usize) -> AttentionDims {
        AttentionDims {
            batch: 1,
            q_heads,
            kv_heads,
            q_len: len,
            kv_len: len,
            head_dim: 128,
        }
    }

    #[test]
    fn slice_groups_share_the_l2_budget_in_whole_slices() {
        // 8 MiB of Q, dO and dQ sums per query head at 8K: four slices; two at 16K; one at 32K.
        assert_eq!(slice_group(&long(8192, 32, 32), 1), 4);
        assert_eq!(slice_group(&long(16384, 32, 32), 1), 2);
        assert_eq!(slice_group(&long(32768, 32, 32), 1), 1);
        // GQA 32 / 8: a key/value slice reads four query heads; split in two, a part reads two
        // (two parts a group: one key/value slice's), in four one (all four parts of one).
        assert_eq!(slice_group(&long(8192, 32, 8), 1), 1);
        assert_eq!(slice_group(&long(8192, 32, 8), 2), 2);
        assert_eq!(slice_group(&long(8192, 32, 8), 4), 4);
        // At least one slice, at most all of them (parts included).
        assert_eq!(slice_group(&long(1 << 20, 32, 8), 1), 1);
        assert_eq!(slice_group(&long(128, 32, 32), 1), 32);
        assert_eq!(slice_group(&long(128, 32, 8), 4), 32);
    }

    #[test]
    fn few_cubes_split_a_gqa_group_and_nothing_else_does() {
        let auto = |d: &AttentionDims| head_parts(d, Some(132), (false, false), HeadSplit::Auto);
        // GQA 32 / 8 at 8K: 512 cubes, 3.9 per multiprocessor: split in two (7.8).
        assert_eq!(unsplit_cubes(&long(8192, 32, 8)), 512);
        assert_eq!(auto(&long(8192, 32, 8)), 2);
        // At 16K (7.8 per multiprocessor) and 32K: as they are.
        assert_eq!(auto(&long(16384, 32, 8)), 1);
        assert_eq!(auto(&long(32768, 32, 8)), 1);
        // MQA at 8K: 64 cubes; 16 parts give 1024 (7.8 per multiprocessor); at 32K, 4 parts.
        assert_eq!(auto(&long(8192, 32, 1)), 16);
        assert_eq!(auto(&long(32768, 32, 1)), 4);
        // Without GQA nothing splits, however few the cubes.
        assert_eq!(auto(&long(8192, 32, 32)), 1);
        assert_eq!(auto(&long(128, 1, 1)), 1);
        // Too few cubes for any split to reach the bound: one head per cube.
        assert_eq!(auto(&long(300, 4, 2)), 2);
        assert_eq!(auto(&long(512, 32, 8)), 4);
        // The device's multiprocessors: twice as many want twice the cubes; 132 when unknown.
        let d = long(16384, 32, 8);
        assert_eq!(
            head_parts(&d, Some(264), (false, false), HeadSplit::Auto),
            2
        );
        assert_eq!(head_parts(&d, None, (false, false), HeadSplit::Auto), 1);
        assert_eq!(head_parts(&d, Some(0), (false, false), HeadSplit::Auto), 1);
        // Batch rows count as cubes: 2 x 512 at 8K is 7.8 per multiprocessor.
        let two_rows = AttentionDims {
            batch: 2,
            ..long(8192, 32, 8)
        };
        assert_eq!(auto(&two_rows), 1);
        // Forced: never, or the largest divisor of the group not above the count asked.
        let gqa = long(32768, 32, 8);
        let forced = |split| head_parts(&gqa, Some(132), (false, false), split);
        assert_eq!(forced(HeadSplit::Never), 1);
        assert_eq!(forced(HeadSplit::Parts(0)), 1);
        assert_eq!(forced(HeadSplit::Parts(2)), 2);
        assert_eq!(forced(HeadSplit::Parts(3)), 2);
        assert_eq!(forced(HeadSplit::Parts(usize::MAX)), 4);
        let three = long(8192, 6, 2);
        assert_eq!(
            head_parts(&three, Some(132), (false, false), HeadSplit::Parts(2)),
            1
        );
        assert_eq!(
            head_parts(&three, Some(132), (false, false), HeadSplit::Parts(5)),
            3
        );
        // The deterministic backward and the steps never split, even forced.
        for split in [HeadSplit::Auto, HeadSplit::Parts(usize::MAX)] {
            for ends in [(true, false), (false, true), (true, true)] {
                assert_eq!(head_parts(&long(8192, 32, 1), Some(132), ends, split), 1);
            }
        }
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
        // With the producer's ordered dQ adds: a dQ block and a header per dQ warpgroup after
        // the deltas, a `dq_full` and a `dq_empty` barrier each after the pipeline's.
        assert!(source.contains("#define DF_DQ_BLOCK_BYTES (DF_BM * 64 * 4)\n"));
        assert_defines(
            "attention_backward.cu",
            source,
            &[("DF_DQ_HEADER_BYTES", 16)],
        );
        assert!(source.contains("at.dq_empty = at.dq_full + DF_DQ_WARPGROUPS * 8;"));
        assert_defines(
            "backward_rows.cu",
            include_str!("backward_rows.cu"),
            &[("DF_BM", TILE_ROWS), ("DF_ROW_UNITS", ROW_UNITS)],
        );
    }
}
