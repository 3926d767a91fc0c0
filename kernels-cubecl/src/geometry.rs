//! Where a cube of query rows sits and which keys it may see: shared by every kernel variant.

use cubecl::prelude::*;

use crate::grid::cube_slice;

/// The query block a cube handles: grid x = blocks of `rows` query rows, slices = batch *
/// q_heads spread over grid y and z (see [`crate::grid`]).
#[derive(CubeType)]
pub struct QueryBlock {
    /// Batch row of the block.
    pub batch: u32,
    /// Element offset of this (batch, kv head)'s key/value rows.
    pub kv_base: usize,
    /// Row offset of this (batch, q head)'s query rows (multiply by `head_dim` for elements).
    pub row_base: usize,
    /// First query row of the block.
    pub start: u32,
    /// Exclusive end of the keys any row of the block may see.
    pub kv_end: u32,
}

/// The [`QueryBlock`] of the calling cube in a sliced grid: x counts query blocks, y and z the
/// `batch * q_heads` slices (see [`crate::grid`]).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn query_block(
    q_len: u32,
    kv_len: u32,
    q_heads: u32,
    group_size: u32,
    shift: i32,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
) -> QueryBlock {
    query_block_at(
        cube_slice(),
        CUBE_POS_X,
        q_len,
        kv_len,
        q_heads,
        group_size,
        shift,
        rows,
        head_dim,
        causal,
    )
}

/// The [`QueryBlock`] number `index` (of `rows` query rows) of (batch, query head) `bh`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn query_block_at(
    bh: u32,
    index: u32,
    q_len: u32,
    kv_len: u32,
    q_heads: u32,
    group_size: u32,
    shift: i32,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
) -> QueryBlock {
    let batch = bh / q_heads;
    let kv_head = (bh % q_heads) / group_size;
    let kv_heads = q_heads / group_size;
    let start = index * rows as u32;
    let block_last = min(start + rows as u32, q_len) - 1;
    QueryBlock {
        batch,
        kv_base: ((batch * kv_heads + kv_head) * kv_len) as usize * head_dim,
        row_base: (bh * q_len) as usize,
        start,
        kv_end: visible_key_end(block_last, kv_len, shift, causal),
    }
}

/// Exclusive end of the keys that any row up to `block_last_row` may see (with the block's first
/// row instead: the keys every row of the block sees).
#[cube]
pub fn visible_key_end(
    block_last_row: u32,
    kv_len: u32,
    shift: i32,
    #[comptime] causal: bool,
) -> u32 {
    let mut end = kv_len;
    if causal {
        end = row_key_limit(block_last_row, kv_len, shift);
    }
    end
}

/// Exclusive end of the keys query row `row` sees under the causal mask (`key <= row + shift`),
/// clamped to `[0, limit]`.
#[cube]
pub fn row_key_limit(row: u32, limit: u32, shift: i32) -> u32 {
    min(max(row as i32 + shift + 1, 0i32) as u32, limit)
}
