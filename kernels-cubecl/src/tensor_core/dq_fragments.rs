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

use super::fragments::{FRAG_COLS, WARP_ROWS};

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

/// `dq += scale * scratch` (with `accumulate`) or `dq = scale * scratch` converted to `T`, for
/// a row-major `[slices, q_len, head_dim]` dQ of `len` elements; one unit per element of dQ.
/// The fused kernel adds unscaled `dS K` (one multiply fewer per atomic); `scale` is the
/// softmax scale.
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
    let at = ABSOLUTE_POS;
    if at < len as usize {
        let col = (at % head_dim) as u32;
        let slice_row = (at / head_dim) as u32;
        let (slice, row) = (slice_row / q_len, slice_row % q_len);
        let r = row % WARP_ROWS as u32;
        // The lane and value holding (r, col) in the accumulator layout.
        let lane = (r % 8) * 4 + (col % FRAG_COLS as u32) / 2;
        let n = (r / 8) * 2 + col % 2;
        let from = tile_row_base(slice, row - r, q_len, lane, head_dim)
            + (((col / FRAG_COLS as u32) * 4 + n) * 32) as usize;
        let value = T::cast_from(scratch[from] * scale);
        if accumulate {
            dq[at] += value;
        } else {
            dq[at] = value;
        }
    }
}
