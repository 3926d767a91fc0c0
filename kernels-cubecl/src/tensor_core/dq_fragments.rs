//! The fused backward's dQ scratch, kept in `mma` fragment order so that its atomics coalesce.
//!
//! Adding a plane's dQ accumulator straight into a row-major `[rows, head_dim]` matrix makes each
//! warp-wide atomic touch 8 rows (8 memory lines, 16 bytes in each). In fragment order, value `n`
//! (0..4) of every lane's share of one 16 x 8 accumulator tile sits in 32 consecutive floats, so
//! each atomic instruction of the warp covers exactly one 128-byte line. Per (batch, query head)
//! slice the scratch holds the rows rounded up to [`SCRATCH_ROW_ALIGN`]; tile `(row / 16, col / 8)` is 128 floats
//! at `((row / 16) * head_dim / 8 + col / 8) * 128`, its value `n` of lane `l` at `n * 32 + l`
//! (lane `l` holds rows `l / 4` and `l / 4 + 8`, columns `2 * (l % 4) + {0, 1}`; see
//! [`super::fragments`]). A linear kernel then adds the scratch to the row-major f32 dQ of a
//! step, or writes it as a whole attention's dQ in the inputs' element type.

use cubecl::prelude::*;

use super::fragments::WARP_ROWS;

/// Rows of each slice of the scratch are a multiple of this: a multiple of the query tile of
/// every kernel that adds into it, so a tile reaching past the chunk stays inside its slice.
pub const SCRATCH_ROW_ALIGN: usize = 64;

/// Rows of one slice of the scratch: `q_len` rounded up to [`SCRATCH_ROW_ALIGN`].
pub fn scratch_rows(q_len: usize) -> usize {
    q_len.div_ceil(SCRATCH_ROW_ALIGN) * SCRATCH_ROW_ALIGN
}

/// Index, in the scratch, of value 0 of `lane` in the first column tile of the 16-row tile
/// starting at row `row` (a multiple of 16) of slice `slice`: `(slice * rows + row) * head_dim
/// + lane`. Value `n` of column tile `t` is `(t * 4 + n) * 32` further.
#[cube]
pub fn tile_row_base(
    slice: u32,
    row: u32,
    q_len: u32,
    lane: u32,
    #[comptime] head_dim: usize,
) -> usize {
    let rows = q_len.div_ceil(SCRATCH_ROW_ALIGN as u32) * SCRATCH_ROW_ALIGN as u32;
    (slice * rows + row) as usize * head_dim + lane as usize
}

/// Columns one warp of the unpacking kernel covers per store: 32 consecutive elements of a row.
pub const UNPACK_COLS: usize = 32;

/// `dq += scale * scratch` (with `accumulate`) or `dq = scale * scratch` converted to `T`, for
/// a row-major `[slices, q_len, head_dim]` dQ of `len` elements. One warp per row: unit `i`
/// takes columns `i`, `i + 32`, ..., so each store of the warp covers 32 consecutive elements,
/// the slice and row are decoded once per `head_dim / 32` values, and every value is loaded
/// before the first store (the compiler may not move a load of `scratch` past a store to `dq`).
/// The fused kernel adds unscaled `dS K` (one multiply fewer per atomic); `scale` is the softmax
/// scale.
#[cube(launch)]
pub fn unpack_fragment_scratch<T: Float>(
    scratch: &Array<f32>,
    dq: &mut Array<T>,
    scale: f32,
    q_len: u32,
    len: u32,
    #[comptime] head_dim: usize,
    #[comptime] accumulate: bool,
) {
    let groups = comptime!(head_dim / UNPACK_COLS);
    let unit = ABSOLUTE_POS as u32;
    let slice_row = unit / UNPACK_COLS as u32;
    if slice_row < len / head_dim as u32 {
        let i = unit % UNPACK_COLS as u32;
        let (slice, row) = (slice_row / q_len, slice_row % q_len);
        let r = row % WARP_ROWS as u32;
        // Column `c = 32k + i` of row `r` is value `(r / 8) * 2 + c % 2` of lane
        // `(r % 8) * 4 + (c % 8) / 2` in column tile `c / 8` (see the module docs): `k` adds a
        // compile-time `4 * 128` per group.
        let lane = (r % 8) * 4 + (i % 8) / 2;
        let from = tile_row_base(slice, row - r, q_len, lane, head_dim)
            + ((i / 8) * 128 + ((r / 8) * 2 + i % 2) * 32) as usize;
        let to = slice_row as usize * head_dim + i as usize;
        let mut values = Array::<f32>::new(groups);
        #[unroll]
        for k in 0..groups {
            values[k] = scratch[from + comptime!(k * 4 * 128)] * scale;
        }
        if accumulate {
            let mut sums = Array::<T>::new(groups);
            #[unroll]
            for k in 0..groups {
                sums[k] = dq[to + comptime!(k * UNPACK_COLS)] + T::cast_from(values[k]);
            }
            #[unroll]
            for k in 0..groups {
                dq[to + comptime!(k * UNPACK_COLS)] = sums[k];
            }
        } else {
            #[unroll]
            for k in 0..groups {
                dq[to + comptime!(k * UNPACK_COLS)] = T::cast_from(values[k]);
            }
        }
    }
}
