//! Shared-memory staging and quad reductions used by the tensor-core kernels.

use cubecl::prelude::*;

/// Rows of the accumulator layout a lane holds values of (`lane / 4` and `lane / 4 + 8`).
pub const ROW_SLOTS: usize = 2;

/// Row stride of a staged tile: `head_dim` plus 8 elements of padding, so the rows read by the
/// 8 lane groups of a fragment load fall in different shared-memory banks.
pub fn padded_stride(head_dim: usize) -> usize {
    head_dim + 8
}

/// Copies rows `[first, first + rows)` of a `[len, head_dim]` matrix starting at `base` into a
/// padded shared tile; rows at or past `len` are zero. All `planes * 32` units take part.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn load_rows_to_shared<E: Float>(
    src: &Array<E>,
    base: usize,
    first: u32,
    len: u32,
    tile: &mut SharedMemory<E>,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] planes: usize,
) {
    let stride = comptime!(padded_stride(head_dim));
    let units = comptime!(planes * 32);
    let per_unit = comptime!(rows * head_dim / units);
    #[unroll]
    for it in 0..per_unit {
        let idx = it * units + UNIT_POS as usize;
        let row = idx / head_dim;
        let col = idx % head_dim;
        let mut val = E::cast_from(0.0f32);
        if first + (row as u32) < len {
            val = src[base + (first as usize + row) * head_dim + col];
        }
        tile[row * stride + col] = val;
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
