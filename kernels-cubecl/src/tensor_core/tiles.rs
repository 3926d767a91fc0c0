//! Shared-memory staging (16-byte asynchronous copies), `ldmatrix` fragment loads and quad
//! reductions used by the tensor-core kernels.

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::barrier::{copy_async, copy_async_checked};
use cubecl::prelude::*;

/// Rows of the accumulator layout a lane holds values of (`lane / 4` and `lane / 4 + 8`).
pub const ROW_SLOTS: usize = 2;

/// Row stride of a staged tile: `head_dim` plus 8 elements of padding, so the rows read by the
/// 8 lane groups of a fragment load fall in different shared-memory banks.
pub const fn padded_stride(head_dim: usize) -> usize {
    head_dim + 8
}

/// Elements moved by one asynchronous copy (16 bytes of f16/bf16).
pub const COPY_ELEMS: usize = 8;

/// Issues asynchronous 16-byte copies of rows `[first, first + rows)` of a `[len, head_dim]`
/// matrix starting at element `base` into a padded shared tile, from its row `dest_row0` on.
/// With `checked`, rows at or past `len` copy nothing and are zero-filled; without, every row
/// must be below `len` (interior tiles: no bounds arithmetic at all). All `units` units take
/// part (`units` a multiple of the 16-byte chunks of a row); the caller commits and waits on a
/// barrier.
///
/// Each unit copies the same chunk column of every `units / chunks per row`-th row, so its
/// source and destination are one per-unit base plus a compile-time offset per copy: under
/// 64-bit indices the offsets fold into the copies' immediates (no address arithmetic per copy,
/// and no per-copy offset held in a register across a kernel's loop).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn stage_rows_async<E: Float>(
    src: &Array<E>,
    base: usize,
    first: u32,
    len: u32,
    tile: &mut SharedMemory<E>,
    dest_row0: usize,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] units: usize,
    #[comptime] checked: bool,
) {
    let stride = comptime!(padded_stride(head_dim));
    let chunks_per_row = comptime!(head_dim / COPY_ELEMS);
    comptime!(assert!(
        units.is_multiple_of(chunks_per_row) && rows.is_multiple_of(units / chunks_per_row),
        "a staging pass covers whole rows"
    ));
    let rows_per_pass = comptime!(units / chunks_per_row);
    let unit = UNIT_POS as usize;
    let unit_row = unit / chunks_per_row;
    let unit_col = (unit % chunks_per_row) * COPY_ELEMS;
    let src_base = base + (first as usize + unit_row) * head_dim + unit_col;
    let dest_base = (dest_row0 + unit_row) * stride + unit_col;
    #[unroll]
    for pass in 0..comptime!(rows / rows_per_pass) {
        let at = dest_base + comptime!(pass * rows_per_pass * stride);
        let mut destination = tile.slice_mut(at, at + COPY_ELEMS);
        let start = src_base + comptime!(pass * rows_per_pass * head_dim);
        if checked {
            // Branch-free: rows past `len` copy nothing and are zero-filled.
            let row = (unit_row + comptime!(pass * rows_per_pass)) as u32;
            let valid = first + row < len;
            let start = select(valid, start, 0usize);
            let count = select(valid, COPY_ELEMS, 0usize);
            copy_async_checked(
                &src.slice(start, start + count),
                &mut destination,
                COPY_ELEMS as u32,
            );
        } else {
            copy_async(
                &src.slice(start, start + COPY_ELEMS),
                &mut destination,
                COPY_ELEMS as u32,
            );
        }
    }
}

/// [`stage_rows_async`] of a tile that checks bounds only when it reaches past `len`: interior
/// tiles take the unchecked path (one uniform branch per tile).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn stage_tile_async<E: Float>(
    src: &Array<E>,
    base: usize,
    first: u32,
    len: u32,
    tile: &mut SharedMemory<E>,
    dest_row0: usize,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] units: usize,
) {
    if first + rows as u32 <= len {
        stage_rows_async::<E>(
            src, base, first, len, tile, dest_row0, rows, head_dim, units, false,
        );
    } else {
        stage_rows_async::<E>(
            src, base, first, len, tile, dest_row0, rows, head_dim, units, true,
        );
    }
}

/// `ldmatrix.x4` from a padded shared tile at element `at`: each lane gives the address of its
/// own row (8 contiguous elements) and gets back 4 registers, one per 8x8 matrix. Callers pass
/// `at` as a per-lane base (computed once) plus a compile-time offset, so the address of every
/// load in an unrolled loop is that base plus an immediate.
#[cube]
pub fn load_matrix_x4<E: Float, N: Size>(
    def: &MmaDefinition<E, E, f32>,
    tile: &SharedMemory<E>,
    at: usize,
    #[comptime] ident: MatrixIdent,
    #[comptime] transpose: bool,
) -> Array<Vector<E, N>> {
    def.load_matrix::<E, N>(&tile.slice(at, at + COPY_ELEMS), ident, 4usize, transpose)
}

/// Element offset, within a padded tile, of the row a lane addresses in an `ldmatrix.x4` of one
/// 16 x 16 `A` fragment at the tile's origin: lanes 0-15 rows 0-15 at column 0, lanes 16-31 the
/// same rows at column 8.
#[cube]
pub fn a_lane_offset(lane: u32, #[comptime] head_dim: usize) -> usize {
    let lane = lane as usize;
    (lane % 16) * comptime!(padded_stride(head_dim)) + (lane / 16) * 8
}

/// Element offset of the row a lane addresses in an `ldmatrix.x4` of two `B` fragments of
/// 16 x 8 side by side at the tile's origin. Untransposed (`T^T`: rows of the tile are the
/// fragments' columns): lane `l` row `((l / 8) / 2) * 8 + l % 8` at column `((l / 8) % 2) * 8`,
/// registers 0-1 the first fragment, 2-3 the second. With `transpose` (`T` itself, `.trans`
/// load): lane `l` row `((l / 8) % 2) * 8 + l % 8` at column `((l / 8) / 2) * 8`.
#[cube]
pub fn pair_lane_offset(
    lane: u32,
    #[comptime] head_dim: usize,
    #[comptime] transpose: bool,
) -> usize {
    let lane = lane as usize;
    let quarter = lane / 8;
    let stride = comptime!(padded_stride(head_dim));
    if transpose {
        ((quarter % 2) * 8 + lane % 8) * stride + (quarter / 2) * 8
    } else {
        ((quarter / 2) * 8 + lane % 8) * stride + (quarter % 2) * 8
    }
}

/// Max over the four lanes of a quad (the lanes sharing a row in the accumulator layout).
#[cube]
pub fn quad_max(value: f32) -> f32 {
    let a = max(value, plane_shuffle_xor(value, 1));
    max(a, plane_shuffle_xor(a, 2))
}

/// Sum over the four lanes of a quad.
#[cube]
pub fn quad_sum(value: f32) -> f32 {
    let a = value + plane_shuffle_xor(value, 1);
    a + plane_shuffle_xor(a, 2)
}
