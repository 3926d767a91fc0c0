//! Tensor-core forward step, FlashAttention-2's shape: one cube of four planes takes 128 query
//! rows (32 per plane, two 16-row `mma` tiles, so every `ldmatrix` of K or V feeds four `mma`s),
//! walks the visible key/value tiles of 64 rows staged in shared memory, keeps scores,
//! probabilities and the output accumulator in registers, and folds them into the running state
//! `(o, m, l)` like the portable kernel. The tiles always run from the empty state; a stored state
//! is read only in the epilogue and merged there (read before the first tile, its 128 f32 per
//! lane were spilled to local memory across the whole loop). The epilogue has four forms (see
//! `forward_step_mma`): a step (read the state, merge, write it back), a first step (write the
//! state, read nothing: no kernel fills it first), a last step (read the state, merge, write the
//! finished output and log-sum-exp: no kernel finalises it after) and a whole attention (write
//! the finished output from this call's keys alone).
//!
//! Masks: every row sees one contiguous range of keys `[lo, hi)` whose ends never decrease with
//! the row (a band, see `Mask`), so the block walks only the key tiles from its first
//! row's `lo` to its last row's `hi` and skips the others (see `geometry::BandTiles`): first the interior
//! (tiles every row of the block sees whole), then the edge tiles in one loop (the trailing edge,
//! then the leading one). Each lane holds its rows' ranges, computed once per cube. Causal and
//! unmasked blocks start at tile 0 and bound their rows from above only; windows and documents
//! (`MaskKind::lower`, `MaskKind::documents`) also bound them from below, and their ranges come
//! from `mask::row_key_range` (one document search per lane, shared over the plane by shuffles).
//!
//! Cost structure, as in FlashAttention-2:
//! - key tiles every row of the block sees whole (the band's interior) run a loop with no mask;
//!   only the tiles at the band's two edges (the causal diagonal, a window's start, a document's
//!   bounds, the chunk's end) compare keys;
//! - the row max is taken over raw scores `q . k` and scaled once (the host sends only positive
//!   scales here), and kept in base-2 units, so a probability is one FMA and one `exp2`;
//! - under a causal mask the grid runs the heaviest query blocks (most keys) first.

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::fragments::{accumulator_col, accumulator_row, mma_definition, FRAG_COLS, WARP_ROWS};
use super::tiles::{
    padded_stride, quad_max, quad_sum, stage_rows_async, stage_tile_async, ROW_SLOTS,
};
use super::walk::{KeyWalk, LaneRanges};
use super::warp_tile::{
    accumulator_to_fragments, multiply_by_rows, multiply_by_rows_transposed, store_accumulator,
    update_rows, zero_accumulator,
};
use crate::attention_params::AttentionParams;
use crate::geometry::{band_tiles, query_block_at, row_key_limit, visible_key_end, BandTiles};
use crate::mask::{row_key_range, MaskKind};
use crate::stats::{
    log_sum_exp, negative_infinity, output_normaliser, rescale_factor_log2, weight_log2, LN_2,
    LOG2_E,
};

/// Planes per cube.
pub const PLANES: usize = 4;
/// 16-row `mma` tiles per plane.
pub const PLANE_TILES: usize = 2;
/// Query rows per cube.
pub const BLOCK_ROWS: usize = PLANES * PLANE_TILES * WARP_ROWS;
/// Key rows per shared-memory tile.
pub const BLOCK_KEYS: usize = 64;
/// Units per cube.
pub const UNITS: usize = PLANES * 32;
/// Query rows whose statistics one lane holds.
const LANE_ROWS: usize = PLANE_TILES * ROW_SLOTS;
/// Below every finite score: the running max of a row that has seen no key yet in a tile.
const NO_SCORE: f32 = -f32::MAX;
/// How far (base 2) a row's max may pass its stale reference before the plane rescales its
/// running output (FlashAttention-4's conditional rescale): weights stay below 2^8 = 256, far
/// from overflow in f32 sums and in bf16/f16 fragments alike. A stored state still gets each
/// row's exact max (it is part of the state's contract).
const LAZY_MAX_SLACK: f32 = 8.0;

/// Row `slot` (0 or 1) of the accumulator rows a lane holds, relative to its 16-row tile.
#[cube]
pub(crate) fn slot_row(lane: u32, #[comptime] slot: usize) -> u32 {
    lane / 4 + (slot * 8) as u32
}

/// Row (relative to the plane's first row) of the lane's statistics row `r`
/// (`r = tile * 2 + slot`).
#[cube]
fn lane_row(lane: u32, #[comptime] r: usize) -> u32 {
    (comptime!(r / ROW_SLOTS) * WARP_ROWS) as u32 + slot_row(lane, comptime!(r % ROW_SLOTS))
}

/// Whether a mask bounds rows' keys from below (a window's start, a document's): the block's
/// tiles then start past tile 0, and edge tiles compare keys against both ends.
fn has_lower_bound(mask: MaskKind) -> bool {
    mask.lower || mask.documents
}

/// A plane's running state over the key tiles, started empty: the output accumulator (the
/// lane's fragments of its [`PLANE_TILES`] row tiles) and, for each of the lane's rows, the
/// reference max (base 2), the exact max (kept for a state) and a lane-partial running sum.
#[derive(CubeType)]
struct RunningRows<NC: Size> {
    o_acc: Array<Vector<f32, NC>>,
    m_row: Array<f32>,
    m_exact: Array<f32>,
    l_row: Array<f32>,
}

/// The block's shared memory: its [`BLOCK_ROWS`] queries, one key and one value tile of
/// [`BLOCK_KEYS`] rows, and the barriers the key and value copies land on.
#[derive(CubeType)]
struct StagedTiles<E: Float> {
    q: SharedMemory<E>,
    k: SharedMemory<E>,
    v: SharedMemory<E>,
    k_ready: Shared<Barrier>,
    v_ready: Shared<Barrier>,
}

/// The key tiles of [`BLOCK_KEYS`] keys that the block of rows `block_start..=block_last` walks
/// (see [`BandTiles`]), from its first and last rows' visible keys. Causal and unmasked blocks
/// (no lower bound) start at tile 0 and have no leading edge; with documents this is two
/// document searches.
#[cube]
fn block_key_tiles(
    docs: &Array<u32>,
    params: &AttentionParams,
    batch: u32,
    block_start: u32,
    block_last: u32,
) -> BandTiles {
    let mask = comptime!(params.mask_kind);
    let (bounds, kv_len) = (&params.bounds, params.kv_len);
    if comptime!(has_lower_bound(mask)) {
        let (first_lo, first_hi) = row_key_range(docs, bounds, batch, block_start, kv_len, mask);
        let (last_lo, last_hi) = row_key_range(docs, bounds, batch, block_last, kv_len, mask);
        band_tiles(first_lo, first_hi, last_lo, last_hi, BLOCK_KEYS)
    } else {
        let causal = comptime!(mask.upper);
        let keys = BLOCK_KEYS as u32;
        BandTiles {
            first: 0u32,
            lead_end: 0u32,
            trail_start: visible_key_end(block_start, kv_len, bounds.shift, causal) / keys,
            end: visible_key_end(block_last, kv_len, bounds.shift, causal).div_ceil(keys),
        }
    }
}

/// The keys `[lo, hi)` that row `row` of the block ending at `block_last` sees in the edge tiles
/// compares; a row past `block_last` (past `q_len`) takes its range. Without a lower bound `lo`
/// is 0 and `hi` the causal limit (`key <= row + shift`) clamped to the block's last row's, or the
/// chunk's end; with one, the row's range ([`row_key_range`]: one document search under
/// `mask.documents`).
#[cube]
fn block_row_keys(
    docs: &Array<u32>,
    params: &AttentionParams,
    batch: u32,
    row: u32,
    block_last: u32,
) -> (u32, u32) {
    let mask = comptime!(params.mask_kind);
    let (bounds, kv_len) = (&params.bounds, params.kv_len);
    if comptime!(has_lower_bound(mask)) {
        row_key_range(docs, bounds, batch, min(row, block_last), kv_len, mask)
    } else {
        let causal = comptime!(mask.upper);
        let kv_end = visible_key_end(block_last, kv_len, bounds.shift, causal);
        let mut limit = kv_end;
        if causal {
            limit = row_key_limit(row, kv_end, bounds.shift);
        }
        (0u32, limit)
    }
}

/// Fills `ranges` with [`block_row_keys`] of the lane's statistics rows `r` (see [`lane_row`]) of
/// the plane whose first row is `plane_start`. Without a lower bound only `ranges.hi` is written
/// (arithmetic per row); with one, each lane finds the range of one row (the plane's row `lane`)
/// and the plane shares them by shuffles, one document search per lane.
#[cube]
fn lane_key_ranges(
    docs: &Array<u32>,
    params: &AttentionParams,
    batch: u32,
    plane_start: u32,
    block_last: u32,
    ranges: &mut LaneRanges,
) {
    let mask = comptime!(params.mask_kind);
    let lane = UNIT_POS_PLANE;
    if comptime!(has_lower_bound(mask)) {
        let (lo, hi) = block_row_keys(docs, params, batch, plane_start + lane, block_last);
        #[unroll]
        for r in 0..LANE_ROWS {
            ranges.lo[r] = plane_shuffle(lo, lane_row(lane, r));
            ranges.hi[r] = plane_shuffle(hi, lane_row(lane, r));
        }
    } else {
        #[unroll]
        for r in 0..LANE_ROWS {
            let row = plane_start + lane_row(lane, r);
            let (_lo, hi) = block_row_keys(docs, params, batch, row, block_last);
            ranges.hi[r] = hi;
        }
    }
}

/// Grid: slice-major (`grid::slice_major`), x = batch * q_heads, y = query blocks of
/// [`BLOCK_ROWS`], taken last block first (the heaviest under a causal mask); cube = [`UNITS`]
/// units. With `reads_state` the keys are merged with the stored state `(o, m, l)`; without, they
/// start from the empty state and nothing is read. With `finishes` it writes
/// `out = o / l` (element type `E`) and `lse = m + ln l` (rows that see no key: 0 and `-inf`)
/// and leaves `o`, `m` and `l` alone; without, it writes the state `(o, m, l)` (every element of
/// the block's rows) and leaves `out` and `lse` alone. Launched unchecked: every global access is guarded by the kernel itself
/// (rows past `q_len` or `kv_len` are skipped or zero-filled) and shared-memory indices are in
/// range by construction. Indices are 64-bit ([`super::KERNEL_ADDRESS`]).
#[cube(launch_unchecked, address_type = "u64", fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn forward_step_mma<E: Float>(
    q: &Array<E>,
    k: &Array<E>,
    v: &Array<E>,
    o: &mut Array<f32>,
    m: &mut Array<f32>,
    l: &mut Array<f32>,
    out: &mut Array<E>,
    lse: &mut Array<f32>,
    docs: &Array<u32>,
    params: &AttentionParams,
    #[comptime] reads_state: bool,
    #[comptime] finishes: bool,
) {
    let head_dim = comptime!(params.head_dim);
    let lower_bound = comptime!(has_lower_bound(params.mask_kind));
    let (scale, q_len, kv_len) = (params.scale, params.q_len, params.kv_len);
    let def = mma_definition::<E>();
    let size!(NA) = def.vector_size(MatrixIdent::A);
    let size!(NB) = def.vector_size(MatrixIdent::B);
    let size!(NC) = def.vector_size(MatrixIdent::Accumulator);
    let stride = comptime!(padded_stride(head_dim));
    let out_frags = comptime!(head_dim / FRAG_COLS);

    let lane = UNIT_POS_PLANE;
    let warp = UNIT_POS / 32;
    let blocks = q_len.div_ceil(BLOCK_ROWS as u32);
    let block = query_block_at(
        CUBE_POS_X,
        blocks - 1 - CUBE_POS_Y,
        q_len,
        kv_len,
        params.heads,
        params.group_size,
        params.bounds.shift,
        BLOCK_ROWS,
        head_dim,
        false,
    );
    let (kv_base, row_base, block_start) = (block.kv_base, block.row_base, block.start);
    let block_last = min(block_start + BLOCK_ROWS as u32, q_len) - 1;
    let plane_row0 = (warp as usize) * PLANE_TILES * WARP_ROWS;
    let plane_start = block_start + plane_row0 as u32;

    let mut staged = StagedTiles::<E> {
        q: SharedMemory::<E>::new_aligned(comptime!(BLOCK_ROWS * stride), 16usize),
        k: SharedMemory::<E>::new_aligned(comptime!(BLOCK_KEYS * stride), 16usize),
        v: SharedMemory::<E>::new_aligned(comptime!(BLOCK_KEYS * stride), 16usize),
        k_ready: Barrier::shared(CUBE_DIM, UNIT_POS == 0),
        v_ready: Barrier::shared(CUBE_DIM, UNIT_POS == 0),
    };
    sync_cube();

    // The block's queries and its first key tile arrive on one barrier; the queries' copies are
    // issued before the band is found (a document search under `mask.documents`).
    stage_rows_async::<E>(
        q,
        row_base * head_dim,
        block_start,
        q_len,
        &mut staged.q,
        0usize,
        BLOCK_ROWS,
        head_dim,
        UNITS,
        true,
    );
    let tiles = block_key_tiles(docs, params, block.batch, block_start, block_last);
    if tiles.first < tiles.end {
        stage_tile_async::<E>(
            k,
            kv_base,
            tiles.tile_at(tiles.lead_end, lower_bound) * BLOCK_KEYS as u32,
            kv_len,
            &mut staged.k,
            0usize,
            BLOCK_KEYS,
            head_dim,
            UNITS,
        );
    }
    staged.k_ready.commit_copy_async();

    // Running state, started empty whether or not a stored state exists (the stored one is
    // merged in the epilogue, where the tiles no longer hold registers): the output accumulator
    // in registers, and for each of the lane's rows the running max and a lane-partial running
    // sum (reduced over the quad at the end).
    #[allow(clippy::manual_is_multiple_of)]
    let first_in_quad = lane % 4 == 0;
    let mut rows = RunningRows::<NC> {
        o_acc: zero_accumulator::<E, NC>(&def, comptime!(PLANE_TILES * out_frags)),
        m_row: Array::<f32>::new(LANE_ROWS),
        m_exact: Array::<f32>::new(LANE_ROWS),
        l_row: Array::<f32>::new(LANE_ROWS),
    };
    #[unroll]
    for r in 0..LANE_ROWS {
        rows.m_row[r] = negative_infinity();
        rows.m_exact[r] = negative_infinity();
        rows.l_row[r] = 0.0f32;
    }
    // The keys each row sees, `[ranges.lo[r], ranges.hi[r])`, used on the band's edge tiles only
    // (`lo` only with a lower bound). Causal and unmasked blocks find them before the
    // interior (as cheap as holding them); with a lower bound they are found after it, so that
    // nothing of them is held across the interior.
    let mut ranges = LaneRanges::new(LANE_ROWS, lower_bound);
    if !lower_bound {
        lane_key_ranges(
            docs,
            params,
            block.batch,
            plane_start,
            block_last,
            &mut ranges,
        );
    }

    // The interior first, then every edge tile in one loop: the trailing edge (the causal
    // diagonal, a window's or a document's end, the chunk's end), then the leading edge (a
    // window's or a document's start), see `BandTiles::tile_at`.
    let walk = KeyWalk::new(tiles, kv_base, kv_len, plane_row0, scale);
    for position in walk.tiles.lead_end..walk.tiles.trail_start {
        attend_tile::<E, NA, NB, NC>(
            &def,
            k,
            v,
            &mut staged,
            &walk,
            position,
            &mut rows,
            &ranges,
            head_dim,
            false,
            !finishes,
        );
    }
    let walk_end = walk.tiles.walk_end();
    if lower_bound {
        if walk.tiles.trail_start < walk_end {
            lane_key_ranges(
                docs,
                params,
                block.batch,
                plane_start,
                block_last,
                &mut ranges,
            );
        }
    }
    for position in walk.tiles.trail_start..walk_end {
        attend_tile::<E, NA, NB, NC>(
            &def,
            k,
            v,
            &mut staged,
            &walk,
            position,
            &mut rows,
            &ranges,
            head_dim,
            true,
            !finishes,
        );
    }

    // A block that sees no key never waited for its queries: no cube exits with copies in
    // flight.
    if walk.tiles.first >= walk.tiles.end {
        staged.k_ready.arrive_and_wait();
    }

    let mut totals = Array::<f32>::new(LANE_ROWS);
    #[unroll]
    for r in 0..LANE_ROWS {
        totals[r] = quad_sum(rows.l_row[r]);
    }
    // A state holds each row's exact max: the tiles weighed against a stale reference (see
    // `LAZY_MAX_SLACK`), so the sums and the output move to the exact max once, here.
    if !finishes {
        let mut to_exact = Array::<f32>::new(LANE_ROWS);
        let mut stale = false;
        #[unroll]
        for r in 0..LANE_ROWS {
            stale = stale || rows.m_exact[r] != rows.m_row[r];
            to_exact[r] = rescale_factor_log2(rows.m_row[r], rows.m_exact[r]);
            totals[r] *= to_exact[r];
            rows.m_row[r] = rows.m_exact[r];
        }
        if plane_any(stale) {
            scale_rows::<E, NC>(&def, &mut rows.o_acc, &to_exact, out_frags);
        }
    }
    // With a stored state: merge, `o = o_old 2^(m_old - m) + o_new 2^(m_new - m)` with
    // `m = max(m_old, m_new)` (base 2); `totals` and `m_row` become the merged rows'.
    let mut old_factor = Array::<f32>::new(LANE_ROWS);
    let mut new_factor = Array::<f32>::new(LANE_ROWS);
    if reads_state {
        #[unroll]
        for r in 0..LANE_ROWS {
            let row = plane_start + lane_row(lane, r);
            let mut m_old = negative_infinity();
            let mut l_old = 0.0f32;
            if row < q_len {
                m_old = m[row_base + row as usize] * LOG2_E;
                l_old = l[row_base + row as usize];
            }
            let merged = max(m_old, rows.m_row[r]);
            old_factor[r] = rescale_factor_log2(m_old, merged);
            new_factor[r] = rescale_factor_log2(rows.m_row[r], merged);
            totals[r] = l_old * old_factor[r] + totals[r] * new_factor[r];
            rows.m_row[r] = merged;
        }
    }
    if finishes {
        // The finished output and log-sum-exp.
        let mut inverse = Array::<f32>::new(LANE_ROWS);
        #[unroll]
        for r in 0..LANE_ROWS {
            inverse[r] = output_normaliser(totals[r]);
        }
        if reads_state {
            #[unroll]
            for r in 0..LANE_ROWS {
                old_factor[r] *= inverse[r];
                new_factor[r] *= inverse[r];
            }
            fold_stored_rows::<E, NC>(
                &def,
                &mut rows.o_acc,
                o,
                row_base,
                plane_start,
                q_len,
                &old_factor,
                &new_factor,
                head_dim,
            );
        } else {
            scale_rows::<E, NC>(&def, &mut rows.o_acc, &inverse, out_frags);
        }
        store_accumulator::<E, E, NC>(
            &def,
            &rows.o_acc,
            out,
            row_base,
            plane_start,
            q_len,
            1.0f32,
            PLANE_TILES,
            head_dim,
            false,
        );
        #[unroll]
        for r in 0..LANE_ROWS {
            let row = plane_start + lane_row(lane, r);
            if row < q_len && first_in_quad {
                lse[row_base + row as usize] = log_sum_exp(rows.m_row[r] * LN_2, totals[r]);
            }
        }
    } else {
        if reads_state {
            update_rows::<E, f32, NC>(
                &def,
                &rows.o_acc,
                o,
                row_base,
                plane_start,
                q_len,
                0usize,
                &old_factor,
                &new_factor,
                PLANE_TILES,
                head_dim,
                head_dim,
                true,
            );
        } else {
            // A first step: the state is this block's alone, every element written.
            store_accumulator::<E, f32, NC>(
                &def,
                &rows.o_acc,
                o,
                row_base,
                plane_start,
                q_len,
                1.0f32,
                PLANE_TILES,
                head_dim,
                false,
            );
        }
        #[unroll]
        for r in 0..LANE_ROWS {
            let row = plane_start + lane_row(lane, r);
            if row < q_len && first_in_quad {
                m[row_base + row as usize] = rows.m_row[r] * LN_2;
                l[row_base + row as usize] = totals[r];
            }
        }
    }
}

/// `acc = acc * new[r] + stored * old[r]` over the plane's valid rows (from `row0`, of `len`)
/// of the row-major f32 `[.., head_dim]` matrix `stored` starting at row `base`, in the
/// accumulator layout of `multiply_by_rows` (`r = tile * 2 + slot`). Reads only: the loads of a
/// row tile are all issued before its first use.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fold_stored_rows<E: Float, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    acc: &mut Array<Vector<f32, NC>>,
    stored: &Array<f32>,
    base: usize,
    row0: u32,
    len: u32,
    old: &Array<f32>,
    new: &Array<f32>,
    #[comptime] head_dim: usize,
) {
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let frags = comptime!(head_dim / FRAG_COLS);
    let lane = UNIT_POS_PLANE;
    #[unroll]
    for mt in 0..PLANE_TILES {
        #[unroll]
        for t in 0..frags {
            #[unroll]
            for i in 0..vc {
                let mut reg = acc[(mt * frags + t) * vc + i];
                #[unroll]
                for e in 0..sc {
                    let n = i * sc + e;
                    let r = mt * ROW_SLOTS + n / 2;
                    let row = row0 + (mt * WARP_ROWS) as u32 + accumulator_row(lane, n);
                    let col = t * FRAG_COLS + accumulator_col(lane, n) as usize;
                    // Rows past `len` read the matrix's first element (never stored).
                    let at = select(row < len, (base + row as usize) * head_dim + col, 0usize);
                    reg[e] = reg[e] * new[r] + stored[at] * old[r];
                }
                acc[(mt * frags + t) * vc + i] = reg;
            }
        }
    }
}

/// One key tile of the software pipeline (two mbarriers, one per operand):
///   wait K(t) | issue V(t) | S = Q K(t)^T | sync | issue K(t+1) | softmax | wait V(t) | O += P V
/// so the copy of V overlaps the score matmul and the copy of the next K the softmax and P V.
/// The tile is the one at `position` of the block's walk (see [`BandTiles::tile_at`]; with a lower
/// bound, `ranges.banded`, the walk may wrap), and the next one is prefetched unless the walk
/// ends. With `masked`, scores of keys a row may not see are dropped (the band's edge tiles only):
/// those at or past `ranges.hi[r]`, and with a lower bound those before `ranges.lo[r]`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn attend_tile<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    k: &Array<E>,
    v: &Array<E>,
    staged: &mut StagedTiles<E>,
    walk: &KeyWalk,
    position: u32,
    rows: &mut RunningRows<NC>,
    ranges: &LaneRanges,
    #[comptime] head_dim: usize,
    #[comptime] masked: bool,
    #[comptime] tracks_exact: bool,
) {
    let lower_bound = comptime!(ranges.banded);
    let tiles = &walk.tiles;
    let (kv_base, kv_len) = (walk.kv_base, walk.kv_len);
    let (plane_row0, scale_log2) = (walk.plane_row0, walk.scale_log2);
    let o_acc = &mut rows.o_acc;
    let m_row = &mut rows.m_row;
    let m_exact = &mut rows.m_exact;
    let l_row = &mut rows.l_row;
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let key_frags = comptime!(BLOCK_KEYS / FRAG_COLS);
    let out_frags = comptime!(head_dim / FRAG_COLS);
    let lane = UNIT_POS_PLANE;
    let key_start = tiles.tile_at(position, lower_bound) * BLOCK_KEYS as u32;

    // Every unit arrives here after its P V of the previous tile: V's buffer is free.
    staged.k_ready.arrive_and_wait();
    stage_tile_async::<E>(
        v,
        kv_base,
        key_start,
        kv_len,
        &mut staged.v,
        0usize,
        BLOCK_KEYS,
        head_dim,
        UNITS,
    );
    staged.v_ready.commit_copy_async();

    let mut s_acc = zero_accumulator::<E, NC>(def, comptime!(PLANE_TILES * key_frags));
    multiply_by_rows_transposed::<E, NA, NB, NC>(
        def,
        &staged.q,
        plane_row0,
        &staged.k,
        0usize,
        &mut s_acc,
        PLANE_TILES,
        BLOCK_KEYS,
        head_dim,
    );

    // Every plane is done reading K(t): prefetch K(t + 1) while the softmax and P V run.
    sync_cube();
    if position + 1 < tiles.walk_end() {
        // The next tile; with `lower_bound` the walk may wrap to the leading edge.
        let mut next_start = key_start + BLOCK_KEYS as u32;
        if lower_bound {
            next_start = tiles.tile_at(position + 1, true) * BLOCK_KEYS as u32;
        }
        stage_tile_async::<E>(
            k,
            kv_base,
            next_start,
            kv_len,
            &mut staged.k,
            0usize,
            BLOCK_KEYS,
            head_dim,
            UNITS,
        );
        staged.k_ready.commit_copy_async();
    }

    // On an edge tile, scores of keys a row may not see become `NO_SCORE` once: one compare
    // (two with `lower_bound`) against a compile-time column per score. Counted from this lane's
    // first column of the tile, row `r` sees the columns before `visible[r]` (none when
    // negative), and with `lower_bound` only those from `visible_from[r]` on.
    if masked {
        let mut visible = Array::<i32>::new(LANE_ROWS);
        let mut visible_from = Array::<i32>::new(LANE_ROWS);
        #[unroll]
        for r in 0..LANE_ROWS {
            visible[r] =
                ranges.hi[r] as i32 - key_start as i32 - accumulator_col(lane, 0usize) as i32;
            if lower_bound {
                visible_from[r] =
                    ranges.lo[r] as i32 - key_start as i32 - accumulator_col(lane, 0usize) as i32;
            }
        }
        #[unroll]
        for mt in 0..PLANE_TILES {
            #[unroll]
            for nt in 0..key_frags {
                #[unroll]
                for i in 0..vc {
                    let mut reg = s_acc[(mt * key_frags + nt) * vc + i];
                    #[unroll]
                    for e in 0..sc {
                        let n = i * sc + e;
                        let r = mt * ROW_SLOTS + n / 2;
                        let col = (nt * FRAG_COLS + n % 2) as i32;
                        let mut seen = col < visible[r];
                        if lower_bound {
                            seen = seen && col >= visible_from[r];
                        }
                        reg[e] = select(seen, reg[e], NO_SCORE);
                    }
                    s_acc[(mt * key_frags + nt) * vc + i] = reg;
                }
            }
        }
    }

    // The tile's max of each row over its visible raw scores (`q . k`).
    let mut tile_max = Array::<f32>::new(LANE_ROWS);
    #[unroll]
    for r in 0..LANE_ROWS {
        tile_max[r] = NO_SCORE;
    }
    #[unroll]
    for mt in 0..PLANE_TILES {
        #[unroll]
        for nt in 0..key_frags {
            #[unroll]
            for i in 0..vc {
                let reg = s_acc[(mt * key_frags + nt) * vc + i];
                #[unroll]
                for e in 0..sc {
                    let r = mt * ROW_SLOTS + (i * sc + e) / 2;
                    tile_max[r] = max(tile_max[r], reg[e]);
                }
            }
        }
    }
    // The rows keep a stale reference max (`m_row`) until one of the plane's rows passes it by
    // more than `LAZY_MAX_SLACK` (weights then stay below 2^LAZY_MAX_SLACK, far from any
    // overflow): past the first tiles a plane almost never rescales its output. When one does,
    // every row of the plane moves to its exact max. With `tracks_exact`, `m_exact` follows each
    // row's exact max for the state.
    let mut m_next = Array::<f32>::new(LANE_ROWS);
    let mut max_moved = false;
    #[unroll]
    for r in 0..LANE_ROWS {
        m_next[r] = tile_row_max(m_row[r], tile_max[r], scale_log2, masked);
        max_moved = max_moved || m_next[r] > m_row[r] + LAZY_MAX_SLACK;
        if tracks_exact {
            m_exact[r] = max(m_exact[r], m_next[r]);
        }
    }
    if plane_any(max_moved) {
        let mut alpha = Array::<f32>::new(LANE_ROWS);
        #[unroll]
        for r in 0..LANE_ROWS {
            alpha[r] = rescale_factor_log2(m_row[r], m_next[r]);
            l_row[r] *= alpha[r];
            m_row[r] = m_next[r];
        }
        scale_rows::<E, NC>(def, o_acc, &alpha, out_frags);
    }

    // Probabilities in place of the scores, then into A fragments. A masked score is `NO_SCORE`
    // and weighs exactly 0 against any finite max; a row that has seen no key at all (max
    // `-inf`) is weighed against `f32::MAX` instead, so every one of its weights is 0 too.
    let mut m_weigh = Array::<f32>::new(LANE_ROWS);
    #[unroll]
    for r in 0..LANE_ROWS {
        m_weigh[r] = m_row[r];
        if masked {
            m_weigh[r] = select(m_row[r] > NO_SCORE, m_row[r], f32::MAX);
        }
    }
    #[unroll]
    for mt in 0..PLANE_TILES {
        #[unroll]
        for nt in 0..key_frags {
            #[unroll]
            for i in 0..vc {
                let mut reg = s_acc[(mt * key_frags + nt) * vc + i];
                #[unroll]
                for e in 0..sc {
                    let r = mt * ROW_SLOTS + (i * sc + e) / 2;
                    let p = weight_log2(reg[e], scale_log2, m_weigh[r]);
                    l_row[r] += p;
                    reg[e] = p;
                }
                s_acc[(mt * key_frags + nt) * vc + i] = reg;
            }
        }
    }
    let p_frag = accumulator_to_fragments::<E, NA, NC>(def, &s_acc, PLANE_TILES, BLOCK_KEYS);

    staged.v_ready.arrive_and_wait();
    multiply_by_rows::<E, NA, NB, NC>(
        def,
        &p_frag,
        &staged.v,
        0usize,
        o_acc,
        PLANE_TILES,
        BLOCK_KEYS,
        head_dim,
    );
}

/// A row's running max (base 2) after a tile whose lane-partial max of raw scores is
/// `tile_max`: the quad's max, scaled, against `m_row`. With `masked`, a row that sees no key of
/// the tile keeps its max (`-inf` if it has seen none).
#[cube]
fn tile_row_max(m_row: f32, tile_max: f32, scale_log2: f32, #[comptime] masked: bool) -> f32 {
    let reduced = quad_max(tile_max);
    let mut m_new = max(m_row, reduced * scale_log2);
    if masked {
        m_new = select(reduced > NO_SCORE, m_new, m_row);
    }
    m_new
}

/// Multiplies each accumulator row the lane holds (of [`PLANE_TILES`] tiles of `frags` 8-column
/// fragments) by its factor: row `r` of [`lane_row`] by `factors[r]`.
#[cube]
fn scale_rows<E: Float, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    acc: &mut Array<Vector<f32, NC>>,
    factors: &Array<f32>,
    #[comptime] frags: usize,
) {
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    #[unroll]
    for mt in 0..PLANE_TILES {
        #[unroll]
        for t in 0..frags {
            #[unroll]
            for i in 0..vc {
                let mut reg = acc[(mt * frags + t) * vc + i];
                #[unroll]
                for e in 0..sc {
                    reg[e] *= factors[mt * ROW_SLOTS + (i * sc + e) / 2];
                }
                acc[(mt * frags + t) * vc + i] = reg;
            }
        }
    }
}
