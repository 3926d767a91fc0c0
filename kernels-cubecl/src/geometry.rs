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

// Tile spans under a band mask (the tensor-core backward's dQ and dK/dV walks).

/// The tiles a block walks under a band mask (see [`crate::mask`]): each row of the block sees
/// one contiguous range of the walked dimension, and both ends never decrease from row to row.
/// Tiles `[first, end)` hold every pair the block may see; of those, `[first, lead_end)` (the
/// leading edge, cut by the last row's start) and `[trail_start, end)` (the trailing edge, cut by
/// the first row's end) run masked, and the interior `[lead_end, trail_start)` is seen whole by
/// every row of the block. `first <= lead_end <= trail_start <= end`.
#[derive(CubeType)]
pub struct BandTiles {
    /// First tile any row of the block sees.
    pub first: u32,
    /// End of the leading edge's masked tiles.
    pub lead_end: u32,
    /// First tile of the trailing edge's masked tiles.
    pub trail_start: u32,
    /// End of the tiles any row of the block sees.
    pub end: u32,
}

/// The [`BandTiles`] of a block whose first valid row sees `[first_lo, first_hi)` and whose last
/// valid row sees `[last_lo, last_hi)` (ranges of a band: `first_lo <= last_lo`, `first_hi <=
/// last_hi`), in tiles of `tile` rows of the walked dimension. A block that sees nothing walks no
/// tile.
#[cube]
pub fn band_tiles(
    first_lo: u32,
    first_hi: u32,
    last_lo: u32,
    last_hi: u32,
    #[comptime] tile: usize,
) -> BandTiles {
    let tile = tile as u32;
    let first = first_lo / tile;
    // Every row's range lies in [first_lo, last_hi): none is seen when that is empty.
    let end = select(last_hi > first_lo, last_hi.div_ceil(tile), first);
    let lead_end = min(last_lo.div_ceil(tile), end);
    BandTiles {
        first,
        lead_end,
        trail_start: max(first_hi / tile, lead_end),
        end,
    }
}

// The tensor-core dK/dV walk: each (batch, query head) slice's tiles from the last to the first,
// slice after slice.

/// One position of a walk over several slices' band tiles: a slice and one of its tiles.
#[derive(CubeType)]
pub struct WalkPosition {
    /// The (batch, query head) slice.
    pub slice: u32,
    /// The tile of the slice, in `[first, end)` of its [`BandTiles`].
    pub tile: u32,
}

#[cube]
impl BandTiles {
    /// The position after `(slice, tile)` in a walk that takes each slice's tiles from the last
    /// (`end - 1`) down to `first`, slice after slice: one tile back, or, from a slice's `first`
    /// tile, the next slice's last tile.
    pub fn step_back(&self, slice: u32, tile: u32) -> WalkPosition {
        let wraps = tile == self.first;
        WalkPosition {
            slice: slice + select(wraps, 1u32, 0u32),
            tile: select(wraps, self.end, tile) - 1,
        }
    }
}

// The tensor-core forward's walk: the interior first, then every masked tile in one loop.

#[cube]
impl BandTiles {
    /// The end of a walk over the band's tiles that starts with the interior (positions
    /// `lead_end..walk_end()`, one per tile; see [`BandTiles::tile_at`]).
    pub fn walk_end(&self) -> u32 {
        self.lead_end + (self.end - self.first)
    }

    /// The tile at position `position` (`lead_end..walk_end()`) of a walk that takes the interior,
    /// then the trailing edge, then the leading edge: positions before `end` are their own tile,
    /// later ones wrap around to the leading edge (`first..lead_end`), so that every masked tile
    /// comes after the interior. Without `wraps` the position is the tile: only for a band with no
    /// leading edge (`first == lead_end`), whose positions all lie before `end`.
    pub fn tile_at(&self, position: u32, #[comptime] wraps: bool) -> u32 {
        let mut tile = position;
        if wraps {
            tile = select(
                position < self.end,
                position,
                position - (self.end - self.first),
            );
        }
        tile
    }
}
