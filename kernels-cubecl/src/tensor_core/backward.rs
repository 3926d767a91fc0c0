//! Tensor-core backward, FlashAttention-2 style: the deterministic dQ kernel and what it shares
//! with the dK/dV kernel ([`super::dkdv`]). The dK/dV kernel owns a block of keys and walks the
//! query tiles of every query head of its group. Fused (the default), it also adds each tile's
//! `dQ = dS K` to dQ with f32 atomics: five GEMMs per (query tile, key block), sums in no fixed
//! order. Deterministic, the dQ kernel here owns a block of queries and walks the key tiles,
//! recomputing S and dP: seven GEMMs, bitwise reproducible. All use the stored log-sum-exp and
//! `delta = rowsum(dO * O)`; the forward is never recomputed.
//!
//! Masks: every mask is a band (see `Mask`), so a block walks only the tiles between
//! its first row's first visible column and its last row's last (`geometry::BandTiles`); tiles outside
//! are skipped, not masked. Of the walked tiles, those every row of the block sees whole (the
//! interior) run with no mask and unchecked staging; the tiles at the two edges of the band run
//! masked, each lane comparing against its rows' visible range (under causal masks and none only
//! the range's end, computed as before masks existed; windows and documents add its start). Rows
//! that see nothing (lse = -inf) get P = 0 everywhere. Probabilities are one FMA and one `exp2`
//! from a base-2 log-sum-exp. The walked tiles are double-buffered from the first walked tile on
//! (buffer `(t - first) % 2`): the copies of tile `t + 1` are issued before tile `t` is waited on,
//! so they land while tile `t` computes.

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::forward::{slot_row, PLANES, UNITS};
use super::fragments::{accumulator_col, mma_definition, FRAG_COLS, WARP_ROWS};
use super::tiles::{padded_stride, stage_rows_async, stage_tile_async, ROW_SLOTS};
use super::walk::{KeyWalk, LaneRanges};
use super::warp_tile::{
    accumulator_to_fragments, multiply_by_rows, multiply_by_rows_transposed, store_accumulator,
    zero_accumulator,
};
use crate::attention_params::AttentionParams;
use crate::geometry::{band_tiles, query_block_at, row_key_limit, visible_key_end, BandTiles};
use crate::mask::row_key_range;
use crate::stats::{lse_log2, weight_log2};

/// Query rows per dQ cube (16 per plane), and per query tile of the dK/dV kernel.
pub const QUERY_ROWS: usize = PLANES * WARP_ROWS;
/// Key rows per key tile of the dQ kernel (16 per plane).
pub const KEY_ROWS: usize = PLANES * WARP_ROWS;

/// dQ step. Grid: slice-major (`grid::slice_major`), x = batch * q_heads, y = query
/// blocks of [`QUERY_ROWS`], taken last block first.
/// Launched unchecked: global accesses are guarded against `q_len`/`kv_len` by the kernel.
/// Indices are 64-bit ([`super::KERNEL_ADDRESS`]).
#[cube(launch_unchecked, address_type = "u64", fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
pub fn backward_dq_mma<E: Float>(
    q: &Array<E>,
    k: &Array<E>,
    v: &Array<E>,
    grad_out: &Array<E>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    dq: &mut Array<f32>,
    docs: &Array<u32>,
    params: &AttentionParams,
) {
    let head_dim = comptime!(params.head_dim);
    let mask = comptime!(params.mask_kind);
    let (scale, q_len, kv_len) = (params.scale, params.q_len, params.kv_len);
    let bounds = &params.bounds;
    let shift = bounds.shift;
    // Windows and documents bound each row's keys on both sides (the band form, `row_key_range`);
    // causal and unmasked calls keep the causal bounds alone, compiled exactly as before masks.
    let banded = comptime!(mask.lower || mask.documents);
    let causal = comptime!(mask.upper);
    let def = mma_definition::<E>();
    let size!(NA) = def.vector_size(MatrixIdent::A);
    let size!(NB) = def.vector_size(MatrixIdent::B);
    let size!(NC) = def.vector_size(MatrixIdent::Accumulator);
    let out_frags = comptime!(head_dim / FRAG_COLS);
    let stride = comptime!(padded_stride(head_dim));

    let lane = UNIT_POS_PLANE;
    let warp = UNIT_POS / 32;
    let blocks = q_len.div_ceil(QUERY_ROWS as u32);
    let block = query_block_at(
        CUBE_POS_X,
        blocks - 1 - CUBE_POS_Y,
        q_len,
        kv_len,
        params.heads,
        params.group_size,
        shift,
        QUERY_ROWS,
        head_dim,
        causal,
    );
    let (batch, kv_base, row_base, block_start, kv_end) = (
        block.batch,
        block.kv_base,
        block.row_base,
        block.start,
        block.kv_end,
    );
    let plane_row0 = (warp as usize) * WARP_ROWS;
    let plane_start = block_start + plane_row0 as u32;

    let mut staged = DqTiles::<E> {
        q: SharedMemory::<E>::new_aligned(comptime!(QUERY_ROWS * stride), 16usize),
        grad_out: SharedMemory::<E>::new_aligned(comptime!(QUERY_ROWS * stride), 16usize),
        k: SharedMemory::<E>::new_aligned(comptime!(2 * KEY_ROWS * stride), 16usize),
        v: SharedMemory::<E>::new_aligned(comptime!(2 * KEY_ROWS * stride), 16usize),
        ready_even: Barrier::shared(CUBE_DIM, UNIT_POS == 0),
        ready_odd: Barrier::shared(CUBE_DIM, UNIT_POS == 0),
    };
    sync_cube();
    // The block's Q and dO and its first key tile arrive on the even barrier.
    stage_rows_async::<E>(
        q,
        row_base * head_dim,
        block_start,
        q_len,
        &mut staged.q,
        0usize,
        QUERY_ROWS,
        head_dim,
        UNITS,
        true,
    );
    stage_rows_async::<E>(
        grad_out,
        row_base * head_dim,
        block_start,
        q_len,
        &mut staged.grad_out,
        0usize,
        QUERY_ROWS,
        head_dim,
        UNITS,
        true,
    );
    // The key tiles the block walks: from its first row's first key to its last row's last.
    let tiles = if banded {
        let block_last = min(block_start + QUERY_ROWS as u32, q_len) - 1;
        let (first_lo, first_hi) = row_key_range(docs, bounds, batch, block_start, kv_len, mask);
        let (last_lo, last_hi) = row_key_range(docs, bounds, batch, block_last, kv_len, mask);
        band_tiles(first_lo, first_hi, last_lo, last_hi, KEY_ROWS)
    } else {
        BandTiles {
            first: 0u32,
            lead_end: 0u32,
            trail_start: visible_key_end(block_start, kv_len, shift, causal) / KEY_ROWS as u32,
            end: kv_end.div_ceil(KEY_ROWS as u32),
        }
    };
    if tiles.first < tiles.end {
        stage_key_tile::<E>(
            k,
            v,
            kv_base,
            tiles.first * KEY_ROWS as u32,
            kv_len,
            &mut staged.k,
            &mut staged.v,
            0u32,
            head_dim,
        );
    }
    staged.ready_even.commit_copy_async();

    // Each of the lane's rows' keys `[ranges.lo, ranges.hi)`; rows past the chunk see none.
    let mut lse_row = Array::<f32>::new(ROW_SLOTS);
    let mut delta_row = Array::<f32>::new(ROW_SLOTS);
    let mut ranges = LaneRanges::new(ROW_SLOTS, banded);
    #[unroll]
    for slot in 0..ROW_SLOTS {
        let row = plane_start + slot_row(lane, slot);
        let mut lv = 0.0f32;
        let mut dv = 0.0f32;
        let mut lo = 0u32;
        let mut hi = 0u32;
        if row < q_len {
            lv = lse[row_base + row as usize];
            dv = delta[row_base + row as usize];
            if banded {
                let (row_lo, row_hi) = row_key_range(docs, bounds, batch, row, kv_len, mask);
                lo = row_lo;
                hi = row_hi;
            } else {
                hi = kv_end;
                if causal {
                    hi = row_key_limit(row, kv_end, shift);
                }
            }
        }
        lse_row[slot] = lse_log2(lv);
        delta_row[slot] = dv;
        ranges.lo[slot] = lo;
        ranges.hi[slot] = hi;
    }

    let walk = KeyWalk::new(tiles, kv_base, kv_len, plane_row0, scale);
    let mut dq_acc = zero_accumulator::<E, NC>(&def, out_frags);
    // Leading edge (masked), interior (whole tiles, unmasked), trailing edge (masked).
    if banded {
        for tile in walk.tiles.first..walk.tiles.lead_end {
            dq_tile::<E, NA, NB, NC>(
                &def,
                k,
                v,
                &mut staged,
                &walk,
                tile,
                &mut dq_acc,
                &lse_row,
                &delta_row,
                &ranges,
                head_dim,
                true,
            );
        }
    }
    for tile in walk.tiles.lead_end..walk.tiles.trail_start {
        dq_tile::<E, NA, NB, NC>(
            &def,
            k,
            v,
            &mut staged,
            &walk,
            tile,
            &mut dq_acc,
            &lse_row,
            &delta_row,
            &ranges,
            head_dim,
            false,
        );
    }
    for tile in walk.tiles.trail_start..walk.tiles.end {
        dq_tile::<E, NA, NB, NC>(
            &def,
            k,
            v,
            &mut staged,
            &walk,
            tile,
            &mut dq_acc,
            &lse_row,
            &delta_row,
            &ranges,
            head_dim,
            true,
        );
    }
    // A block that sees no key never waited for its Q and dO copies: no cube exits with copies
    // in flight.
    if walk.tiles.first == walk.tiles.end {
        staged.ready_even.arrive_and_wait();
    }

    store_accumulator::<E, f32, NC>(
        &def,
        &dq_acc,
        dq,
        row_base,
        plane_start,
        q_len,
        scale,
        1usize,
        head_dim,
        true,
    );
}

/// The dQ block's shared memory: its queries' Q and dO rows, two buffers each of K and V tiles
/// (key tile `t` of the walk in rows `((t - first) % 2) * KEY_ROWS..`), and each buffer's
/// barrier.
#[derive(CubeType)]
struct DqTiles<E: Float> {
    q: SharedMemory<E>,
    grad_out: SharedMemory<E>,
    k: SharedMemory<E>,
    v: SharedMemory<E>,
    ready_even: Shared<Barrier>,
    ready_odd: Shared<Barrier>,
}

/// Issues the copies of key tile `key_start` of K and V into buffer `buffer` (0 or 1) of the
/// double-buffered tiles; the caller commits them on that buffer's barrier.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_key_tile<E: Float>(
    k: &Array<E>,
    v: &Array<E>,
    kv_base: usize,
    key_start: u32,
    kv_len: u32,
    k_tiles: &mut SharedMemory<E>,
    v_tiles: &mut SharedMemory<E>,
    buffer: u32,
    #[comptime] head_dim: usize,
) {
    let row0 = buffer as usize * KEY_ROWS;
    stage_tile_async::<E>(
        k, kv_base, key_start, kv_len, k_tiles, row0, KEY_ROWS, head_dim, UNITS,
    );
    stage_tile_async::<E>(
        v, kv_base, key_start, kv_len, v_tiles, row0, KEY_ROWS, head_dim, UNITS,
    );
}

/// Commits the calling unit's pending copies on the barrier of buffer `buffer` (0 or 1).
#[cube]
pub(super) fn commit_to_buffer(ready_even: &Barrier, ready_odd: &Barrier, buffer: u32) {
    if buffer == 0 {
        ready_even.commit_copy_async();
    } else {
        ready_odd.commit_copy_async();
    }
}

/// Waits until the copies committed on the barrier of buffer `buffer` (0 or 1) have landed.
#[cube]
pub(super) fn wait_for_buffer(ready_even: &Barrier, ready_odd: &Barrier, buffer: u32) {
    if buffer == 0 {
        ready_even.arrive_and_wait();
    } else {
        ready_odd.arrive_and_wait();
    }
}

/// One key tile `tile` of the dQ kernel's walk, in buffer `(tile - first) % 2`: issue the next
/// tile's K and V into the other buffer, wait for this tile's (the block's Q and dO arrive with
/// the first), then S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K. With `masked`, keys
/// outside a row's `[ranges.lo, ranges.hi)` get P = 0 (the lower bound is read only when
/// `ranges.banded`: without, the walk's first tile is 0 and every row's keys start at 0).
#[cube]
#[allow(clippy::too_many_arguments)]
fn dq_tile<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    k: &Array<E>,
    v: &Array<E>,
    staged: &mut DqTiles<E>,
    walk: &KeyWalk,
    tile: u32,
    dq_acc: &mut Array<Vector<f32, NC>>,
    lse_row: &Array<f32>,
    delta_row: &Array<f32>,
    ranges: &LaneRanges,
    #[comptime] head_dim: usize,
    #[comptime] masked: bool,
) {
    let banded = comptime!(ranges.banded);
    let q_tile = &staged.q;
    let do_tile = &staged.grad_out;
    let k_tiles = &mut staged.k;
    let v_tiles = &mut staged.v;
    let ready_even = &staged.ready_even;
    let ready_odd = &staged.ready_odd;
    let tiles = &walk.tiles;
    let (kv_base, kv_len) = (walk.kv_base, walk.kv_len);
    let (plane_row0, scale_log2) = (walk.plane_row0, walk.scale_log2);
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let key_frags = comptime!(KEY_ROWS / FRAG_COLS);
    let lane = UNIT_POS_PLANE;
    let key_start = tile * KEY_ROWS as u32;
    let buffer = if banded {
        (tile - tiles.first) % 2
    } else {
        tile % 2
    };
    let row0 = buffer as usize * KEY_ROWS;

    // Every plane is done with tile - 1: its buffer takes tile + 1.
    sync_cube();
    if tile + 1 < tiles.end {
        stage_key_tile::<E>(
            k,
            v,
            kv_base,
            key_start + KEY_ROWS as u32,
            kv_len,
            k_tiles,
            v_tiles,
            1 - buffer,
            head_dim,
        );
        commit_to_buffer(ready_even, ready_odd, 1 - buffer);
    }
    wait_for_buffer(ready_even, ready_odd, buffer);

    let mut s_acc = zero_accumulator::<E, NC>(def, key_frags);
    multiply_by_rows_transposed::<E, NA, NB, NC>(
        def, q_tile, plane_row0, k_tiles, row0, &mut s_acc, 1usize, KEY_ROWS, head_dim,
    );
    let mut dp_acc = zero_accumulator::<E, NC>(def, key_frags);
    multiply_by_rows_transposed::<E, NA, NB, NC>(
        def,
        do_tile,
        plane_row0,
        v_tiles,
        row0,
        &mut dp_acc,
        1usize,
        KEY_ROWS,
        head_dim,
    );

    // dS = P * (dP - delta), in place of dP.
    #[unroll]
    for nt in 0..key_frags {
        #[unroll]
        for i in 0..vc {
            let s_reg = s_acc[nt * vc + i];
            let mut dp_reg = dp_acc[nt * vc + i];
            #[unroll]
            for e in 0..sc {
                let n = i * sc + e;
                let slot = n / 2;
                let mut p = weight_log2(s_reg[e], scale_log2, lse_row[slot]);
                if masked {
                    let key = key_start + (nt * FRAG_COLS) as u32 + accumulator_col(lane, n);
                    let mut visible = key < ranges.hi[slot];
                    if banded {
                        visible = visible && key >= ranges.lo[slot];
                    }
                    p = select(visible, p, 0.0f32);
                }
                dp_reg[e] = p * (dp_reg[e] - delta_row[slot]);
            }
            dp_acc[nt * vc + i] = dp_reg;
        }
    }
    let ds_frag = accumulator_to_fragments::<E, NA, NC>(def, &dp_acc, 1usize, KEY_ROWS);
    multiply_by_rows::<E, NA, NB, NC>(
        def, &ds_frag, k_tiles, row0, dq_acc, 1usize, KEY_ROWS, head_dim,
    );
}
