//! What the tile steps of a tensor-core kernel's walk read and no step changes, grouped once per
//! block: the visible ranges of the lane's rows (every kernel), and, for the kernels that own a
//! block of queries and walk its key tiles (the forward and dQ kernels), where those tiles are.

use cubecl::prelude::*;

use crate::geometry::BandTiles;
use crate::stats::LOG2_E;

/// The visible range `[lo[r], hi[r])` along the walked dimension of each row `r` the lane holds
/// (keys of a query row, queries of a key row), compared on the band's edge tiles only.
#[derive(CubeType)]
pub(crate) struct LaneRanges {
    /// First visible row of each of the lane's rows; read only when `banded`.
    pub lo: Array<u32>,
    /// End of the visible rows of each of the lane's rows.
    pub hi: Array<u32>,
    /// Whether the mask bounds the ranges from below (windows and documents, compiled in):
    /// without, every range starts at the first row the block may see.
    #[cube(comptime)]
    pub banded: bool,
}

/// Where the key tiles of a query block's walk are, and how its scores are scaled.
#[derive(CubeType)]
pub(crate) struct KeyWalk {
    /// The key tiles the block walks.
    pub tiles: BandTiles,
    /// Element offset of the (batch, key/value head) slice's keys and values.
    pub kv_base: usize,
    /// Key rows of the call.
    pub kv_len: u32,
    /// The plane's first query row within the block.
    pub plane_row0: usize,
    /// The softmax scale in base 2 (`scale * log2(e)`).
    pub scale_log2: f32,
}

#[cube]
impl LaneRanges {
    /// Unwritten ranges for `rows` rows of the lane.
    pub fn new(#[comptime] rows: usize, #[comptime] banded: bool) -> LaneRanges {
        LaneRanges {
            lo: Array::<u32>::new(rows),
            hi: Array::<u32>::new(rows),
            banded,
        }
    }
}

#[cube]
impl KeyWalk {
    /// The walk over `tiles` of the keys at `kv_base` (of `kv_len`) for the plane whose first
    /// query row in the block is `plane_row0`, scores scaled by `scale`.
    pub fn new(
        tiles: BandTiles,
        kv_base: usize,
        kv_len: u32,
        plane_row0: usize,
        scale: f32,
    ) -> KeyWalk {
        KeyWalk {
            tiles,
            kv_base,
            kv_len,
            plane_row0,
            scale_log2: scale * LOG2_E,
        }
    }
}
