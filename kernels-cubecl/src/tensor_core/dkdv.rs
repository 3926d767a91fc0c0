//! The tensor-core dK/dV kernel (and, fused, dQ): a cube of 8 planes owns [`DKDV_KEYS`] keys and
//! walks the [`QUERY_ROWS`]-row query tiles of every query head of its group that can see them.
//!
//! The planes split each step's products three ways, as FlashAttention-2 does, so that every
//! `ldmatrix.x4` of a shared operand feeds four `mma`s and each plane reads a quarter to a half of
//! the tiles instead of all of them:
//! - S^T = K Q^T and dP^T = V dO^T: plane `w` takes key group `w / 2` (32 keys) against query
//!   half `w % 2` (32 queries). P^T and dS^T = P^T (dP^T - delta) go to shared memory.
//! - dV += P^T dO and dK += dS^T Q: plane `w` owns key group `w / 2` by head-dim half `w % 2`,
//!   reading the whole query tile's P^T and dS^T rows of its keys.
//! - fused dQ = dS K: plane `w` takes query half `w / 4` by head-dim quarter `w % 4` over all
//!   [`DKDV_KEYS`] keys, and adds it to the fragment-order scratch with f32 atomics (half the
//!   atomics per FLOP of a 64-key block).
//!
//! Two barriers per step: the wait for the step's query tile (every unit arrives on it, so it
//! also keeps the next step's copies out of buffers the step before still reads), and one
//! between storing P^T and dS^T and reading them back. The query tiles are
//! double-buffered as in the dQ kernel, and their rows' log-sum-exp and delta arrive with them
//! (4-byte asynchronous copies on the same barrier: no register holds them across a step); the
//! walk over (query head, query tile) advances by one step without a division, each head's tiles
//! from the last to the first (FlashAttention-2's order).
//!
//! Masks: each key sees one contiguous range of queries (`key_query_range`), both ends never
//! decreasing with the key, so a block walks only the query tiles from its first key's first
//! query to its last key's last (`geometry::BandTiles`), skipping the rest. The tiles at the band's two
//! edges (a causal diagonal, a window's far end, a document boundary) and the chunk's partial
//! last tile run masked against each key's range; the interior, seen whole by every key of the
//! block, runs unmasked (under windows and documents, a partial last block runs every tile
//! masked: its zero-filled keys past the chunk see nothing). Keys no query sees get zero
//! gradients.

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::barrier::{copy_async_checked, Barrier};
use cubecl::prelude::*;

use super::backward::{commit_to_buffer, wait_for_buffer, QUERY_ROWS};
use super::dq_fragments::tile_row_base;
use super::forward::slot_row;
use super::fragments::{accumulator_col, mma_definition, FRAG_COLS, FRAG_K, WARP_ROWS};
use super::tiles::{padded_stride, stage_rows_async, stage_tile_async, ROW_SLOTS};
use super::walk::LaneRanges;
use super::warp_tile::{
    load_fragments, multiply_by_row_columns, multiply_by_rows_transposed,
    store_accumulator_columns, store_to_tile, zero_accumulator,
};
use crate::attention_params::AttentionParams;
use crate::geometry::{band_tiles, BandTiles};
use crate::grid::paired_slice_block;
use crate::mask::key_query_range;
use crate::stats::{lse_log2, weight_log2, LOG2_E};

/// Planes (warps) of a dK/dV cube.
pub const DKDV_PLANES: usize = 8;
/// Units of a dK/dV cube.
pub const DKDV_UNITS: usize = DKDV_PLANES * 32;
/// Keys of a dK/dV cube: four groups of `GROUP_KEYS`, each shared by two planes.
pub const DKDV_KEYS: usize = 128;
/// Keys of one plane's group: two `mma` row tiles.
const GROUP_KEYS: usize = 2 * WARP_ROWS;
/// `mma` row tiles of a plane's share of every product.
const PLANE_TILES: usize = 2;
/// Queries of half a query tile: a plane's share of S^T's columns and of dQ's rows.
const HALF_QUERIES: usize = QUERY_ROWS / 2;
/// Keys the fused dQ reduces over per batch of dS fragments it holds.
const DQ_KEY_CHUNK: usize = 64;
/// Key rows the lane's accumulator values of one plane's S^T fall in.
const KEY_SLOTS: usize = PLANE_TILES * ROW_SLOTS;

// The fused kernel's query tiles must not reach past a slice of the dQ scratch.
const _: () = assert!(super::dq_fragments::SCRATCH_ROW_ALIGN.is_multiple_of(QUERY_ROWS));
const _: () = assert!(DKDV_KEYS == (DKDV_PLANES / 2) * GROUP_KEYS);
const _: () = assert!(DKDV_KEYS.is_multiple_of(DQ_KEY_CHUNK));

/// Shared memory of the dK/dV kernel at `head_dim`, in bytes (each array 16-byte aligned, plus
/// 16 bytes of slack each, and the two barriers): K and V blocks, double-buffered Q and dO
/// tiles and their rows' f32 statistics, the P^T and dS^T tiles.
pub fn shared_memory_bytes(head_dim: usize) -> usize {
    let array = |bytes: usize| bytes.next_multiple_of(16) + 16;
    let rows = |rows: usize, width: usize| array(rows * padded_stride(width) * 2);
    2 * rows(DKDV_KEYS, head_dim)
        + 2 * rows(2 * QUERY_ROWS, head_dim)
        + 2 * array(2 * QUERY_ROWS * 4)
        + 2 * rows(DKDV_KEYS, QUERY_ROWS)
        + 2 * 16
}

/// dK/dV step, and with `fuse_dq` also dQ (added with f32 atomics to `dq`, a zeroed scratch in
/// fragment order, see `dq_fragments`; not touched otherwise). A step adds dK and dV
/// to the f32 `dk`, `dv`; with `one_shot` (a whole attention: the cube has seen every query)
/// it writes them to `dk_out`, `dv_out` in `E` instead, leaving `dk`, `dv` alone. Grid:
/// sliced (`grid::sliced`): key blocks of [`DKDV_KEYS`] by (batch, kv head) slices,
/// taken two slices at a time (`grid::paired_slice_block`): the cubes under way share at most two
/// heads' Q, dO and dQ scratch in L2, and under a causal mask each pair's first blocks (seen by
/// the most queries) start first, so the last wave is light; [`DKDV_UNITS`] units per cube.
/// Launched unchecked: global accesses are guarded against `q_len`/`kv_len` by the kernel.
/// Indices are 64-bit ([`super::KERNEL_ADDRESS`]).
#[cube(launch_unchecked, address_type = "u64", fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
pub fn backward_dkdv_mma<E: Float>(
    q: &Array<E>,
    k: &Array<E>,
    v: &Array<E>,
    grad_out: &Array<E>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    dk: &mut Array<f32>,
    dv: &mut Array<f32>,
    dq: &mut Array<Atomic<f32>>,
    dk_out: &mut Array<E>,
    dv_out: &mut Array<E>,
    docs: &Array<u32>,
    params: &AttentionParams,
    #[comptime] fuse_dq: bool,
    #[comptime] one_shot: bool,
    #[comptime] stmatrix: bool,
) {
    let head_dim = comptime!(params.head_dim);
    let mask = comptime!(params.mask_kind);
    let (scale, q_len, kv_len) = (params.scale, params.q_len, params.kv_len);
    let (kv_heads, group_size) = (params.heads, params.group_size);
    let bounds = &params.bounds;
    let shift = bounds.shift;
    // Windows and documents bound each key's queries on both sides (the band form,
    // `key_query_range`); causal and unmasked calls keep the causal bounds alone, compiled exactly
    // as before masks.
    let banded = comptime!(mask.lower || mask.documents);
    let causal = comptime!(mask.upper);
    let def = mma_definition::<E>();
    let size!(NA) = def.vector_size(MatrixIdent::A);
    let size!(NB) = def.vector_size(MatrixIdent::B);
    let size!(NC) = def.vector_size(MatrixIdent::Accumulator);
    let grad_frags = comptime!(PLANE_TILES * head_dim / 2 / FRAG_COLS);
    let stride = comptime!(padded_stride(head_dim));
    let ds_stride = comptime!(padded_stride(QUERY_ROWS));

    let lane = UNIT_POS_PLANE;
    let warp = UNIT_POS / 32;
    let (bkv, key_block) = paired_slice_block();
    let batch = bkv / kv_heads;
    let kv_head = bkv % kv_heads;
    let q_heads = kv_heads * group_size;
    let key_base = (bkv * kv_len) as usize;
    let block_start = key_block * DKDV_KEYS as u32;
    let shares = PlaneShares {
        key_row0: (warp / 2) as usize * GROUP_KEYS,
        query_col0: (warp % 2) as usize * HALF_QUERIES,
        dim_col0: (warp % 2) as usize * comptime!(head_dim / 2),
        dq_row0: (warp / 4) as usize * HALF_QUERIES,
        dq_col0: (warp % 4) as usize * comptime!(head_dim / 4),
    };

    let mut staged = KeyBlockTiles::<E> {
        k: SharedMemory::<E>::new_aligned(comptime!(DKDV_KEYS * stride), 16usize),
        v: SharedMemory::<E>::new_aligned(comptime!(DKDV_KEYS * stride), 16usize),
        q: SharedMemory::<E>::new_aligned(comptime!(2 * QUERY_ROWS * stride), 16usize),
        grad_out: SharedMemory::<E>::new_aligned(comptime!(2 * QUERY_ROWS * stride), 16usize),
        lse: SharedMemory::<f32>::new(comptime!(2 * QUERY_ROWS)),
        delta: SharedMemory::<f32>::new(comptime!(2 * QUERY_ROWS)),
        p: SharedMemory::<E>::new_aligned(comptime!(DKDV_KEYS * ds_stride), 16usize),
        ds: SharedMemory::<E>::new_aligned(comptime!(DKDV_KEYS * ds_stride), 16usize),
        ready_even: Barrier::shared(CUBE_DIM, UNIT_POS == 0),
        ready_odd: Barrier::shared(CUBE_DIM, UNIT_POS == 0),
    };
    sync_cube();
    stage_rows_async::<E>(
        k,
        key_base * head_dim,
        block_start,
        kv_len,
        &mut staged.k,
        0usize,
        DKDV_KEYS,
        head_dim,
        DKDV_UNITS,
        true,
    );
    stage_rows_async::<E>(
        v,
        key_base * head_dim,
        block_start,
        kv_len,
        &mut staged.v,
        0usize,
        DKDV_KEYS,
        head_dim,
        DKDV_UNITS,
        true,
    );

    // The queries `[ranges.lo, ranges.hi)` that see each of the lane's key rows in the plane's
    // S^T (without `banded`, `hi` is the chunk's end and not stored); keys past the chunk see
    // none (`lo = q_len`).
    let block_last = min(block_start + DKDV_KEYS as u32, kv_len) - 1;
    let mut ranges = LaneRanges::new(KEY_SLOTS, banded);
    #[unroll]
    for mt in 0..PLANE_TILES {
        #[unroll]
        for slot in 0..ROW_SLOTS {
            let key =
                block_start + (shares.key_row0 + mt * WARP_ROWS) as u32 + slot_row(lane, slot);
            let mut lo = 0u32;
            if banded {
                let (key_lo, key_hi) =
                    key_query_range(docs, bounds, batch, min(key, block_last), q_len, mask);
                lo = key_lo;
                ranges.hi[mt * ROW_SLOTS + slot] = key_hi;
            } else if causal {
                // Query i sees key j iff j <= i + shift.
                lo = max(key as i32 - shift, 0i32) as u32;
            }
            ranges.lo[mt * ROW_SLOTS + slot] = select(key < kv_len, lo, q_len);
        }
    }
    // Query tiles of each query head of the group (see `BandTiles`): [first, end) hold every
    // query a key of the block sees, [lead_end, trail_start) are seen whole by every key of the
    // block, the others run masked (the leading edge, where the block's last key starts seeing
    // queries; the trailing edge, where its first key stops, or the chunk's partial last tile).
    // The walk visits the `end - first` tiles per head, head after head.
    let tiles = if banded {
        let (first_lo, first_hi) = key_query_range(docs, bounds, batch, block_start, q_len, mask);
        let (last_lo, last_hi) = key_query_range(docs, bounds, batch, block_last, q_len, mask);
        // The zero-filled keys past the chunk of a partial last block see no query, so none of
        // its tiles is seen whole: run unmasked, such a key would get P = 2^-lse, which can
        // overflow `E` and turn the fused dQ's dS K into NaN.
        let partial = block_start + DKDV_KEYS as u32 > kv_len;
        let last_lo = select(partial, q_len, last_lo);
        band_tiles(first_lo, first_hi, last_lo, last_hi, QUERY_ROWS)
    } else {
        let num_tiles = q_len.div_ceil(QUERY_ROWS as u32);
        let whole_end = q_len / QUERY_ROWS as u32;
        let mut first = 0u32;
        let mut whole_from = 0u32;
        if causal {
            let last = block_start + DKDV_KEYS as u32 - 1;
            first = min(max(block_start as i32 - shift, 0i32) as u32, q_len) / QUERY_ROWS as u32;
            whole_from =
                min(max(last as i32 - shift, 0i32) as u32, q_len).div_ceil(QUERY_ROWS as u32);
        }
        // As under a band: a partial last block has no interior (its zero-filled keys see no
        // query; unmasked, their P = 2^-lse can overflow and reach the fused dQ as NaN).
        let partial = block_start + DKDV_KEYS as u32 > kv_len;
        BandTiles {
            first: min(first, num_tiles),
            lead_end: select(partial, whole_end, min(whole_from, whole_end)),
            trail_start: whole_end,
            end: num_tiles,
        }
    };
    let (first, lead_end, trail_start, end) =
        (tiles.first, tiles.lead_end, tiles.trail_start, tiles.end);
    let steps = group_size * (end - first);
    // The walk's position, advanced one step at a time by `BandTiles::step_back` (no division
    // per step): this step's (batch, query head) slice and query tile, and the next step's.
    // FlashAttention-2's order: each head's tiles from the last to the first, so the cubes under
    // way on one head read the same query tiles at about the same time.
    let mut slice = batch * q_heads + kv_head * group_size;
    let mut tile = select(steps > 0, end - 1, 0u32);
    let after = tiles.step_back(slice, tile);
    let mut next_slice = after.slice;
    let mut next_tile = after.tile;

    // The block's K and V and the first query tile arrive on the even barrier.
    if steps > 0 {
        stage_query_tile::<E>(
            q,
            grad_out,
            lse,
            delta,
            (slice * q_len) as usize,
            tile * QUERY_ROWS as u32,
            q_len,
            &mut staged,
            0u32,
            head_dim,
        );
    }
    staged.ready_even.commit_copy_async();

    let scale_log2 = scale * LOG2_E;
    let mut dk_acc = zero_accumulator::<E, NC>(&def, grad_frags);
    let mut dv_acc = zero_accumulator::<E, NC>(&def, grad_frags);
    for step in 0..steps {
        let masked = tile < lead_end || tile >= trail_start;
        // Every unit arrives on the buffer's barrier (`arrive_and_wait`) and its phase completes
        // only once all have: passing it, every plane is done with step - 1, so this step may
        // overwrite P^T and dS^T and issue step + 1's copies into step - 1's buffers. It is the
        // step's first barrier; a `sync_cube` before it would only repeat it.
        wait_for_buffer(&staged.ready_even, &staged.ready_odd, step % 2);
        let step_tile = StepTile {
            row0: (step % 2) as usize * QUERY_ROWS,
            q_start: tile * QUERY_ROWS as u32,
        };
        if masked {
            store_probabilities::<E, NA, NB, NC>(
                &def,
                &mut staged,
                &shares,
                &step_tile,
                &ranges,
                q_len,
                scale_log2,
                head_dim,
                true,
                stmatrix,
            );
        } else {
            store_probabilities::<E, NA, NB, NC>(
                &def,
                &mut staged,
                &shares,
                &step_tile,
                &ranges,
                q_len,
                scale_log2,
                head_dim,
                false,
                stmatrix,
            );
        }
        // Every plane was done with step - 1 at the step's first barrier: its buffers take
        // step + 1. Issued here, after the S and dP products, the copies do not compete with
        // their `ldmatrix` loads.
        if step + 1 < steps {
            stage_query_tile::<E>(
                q,
                grad_out,
                lse,
                delta,
                (next_slice * q_len) as usize,
                next_tile * QUERY_ROWS as u32,
                q_len,
                &mut staged,
                1 - step % 2,
                head_dim,
            );
            commit_to_buffer(&staged.ready_even, &staged.ready_odd, 1 - step % 2);
        }
        sync_cube();
        // FlashAttention-2's order: dV, then dQ, then dK. The dQ atomics drain while the dK
        // products run; issued last, the next step's first instructions wait on them.
        accumulate_key_grad::<E, NA, NB, NC>(
            &def,
            &staged.p,
            &staged.grad_out,
            &shares,
            step_tile.row0,
            &mut dv_acc,
            head_dim,
        );
        if fuse_dq {
            add_tile_dq::<E, NA, NB, NC>(
                &def,
                &staged.k,
                &staged.ds,
                dq,
                &shares,
                slice,
                step_tile.q_start,
                q_len,
                head_dim,
            );
        }
        accumulate_key_grad::<E, NA, NB, NC>(
            &def,
            &staged.ds,
            &staged.q,
            &shares,
            step_tile.row0,
            &mut dk_acc,
            head_dim,
        );
        slice = next_slice;
        tile = next_tile;
        let after = tiles.step_back(slice, tile);
        next_slice = after.slice;
        next_tile = after.tile;
    }
    // Keys no query sees never waited for their K and V copies: no cube exits with copies in
    // flight.
    if steps == 0 {
        staged.ready_even.arrive_and_wait();
    }

    let key_row = block_start + shares.key_row0 as u32;
    if one_shot {
        store_key_grads::<E, E, NC>(
            &def,
            &dk_acc,
            &dv_acc,
            dk_out,
            dv_out,
            key_base,
            key_row,
            kv_len,
            shares.dim_col0,
            scale,
            head_dim,
            false,
        );
    } else {
        store_key_grads::<E, f32, NC>(
            &def,
            &dk_acc,
            &dv_acc,
            dk,
            dv,
            key_base,
            key_row,
            kv_len,
            shares.dim_col0,
            scale,
            head_dim,
            true,
        );
    }
}

/// The dK/dV block's shared memory: its [`DKDV_KEYS`] keys' K and V rows, two buffers of query
/// tiles (Q, dO and their rows' log-sum-exp and delta: walk step `s` in buffer `s % 2`) with
/// each buffer's barrier, and the step's P^T and dS^T tiles (keys by queries).
#[derive(CubeType)]
struct KeyBlockTiles<E: Float> {
    k: SharedMemory<E>,
    v: SharedMemory<E>,
    q: SharedMemory<E>,
    grad_out: SharedMemory<E>,
    lse: SharedMemory<f32>,
    delta: SharedMemory<f32>,
    p: SharedMemory<E>,
    ds: SharedMemory<E>,
    ready_even: Shared<Barrier>,
    ready_odd: Shared<Barrier>,
}

/// Which part of each product a plane computes (see the module docs); rows and columns within
/// the cube's key block and the step's query tile.
#[derive(CubeType)]
struct PlaneShares {
    /// First of the plane's [`GROUP_KEYS`] keys (S^T, dP^T, dK, dV).
    key_row0: usize,
    /// First of the plane's [`HALF_QUERIES`] S^T columns.
    query_col0: usize,
    /// First of the plane's `head_dim / 2` dK/dV columns.
    dim_col0: usize,
    /// First of the plane's [`HALF_QUERIES`] dQ rows.
    dq_row0: usize,
    /// First of the plane's `head_dim / 4` dQ columns.
    dq_col0: usize,
}

/// Where one walk step's query tile is: its buffer's first row and its first query row.
#[derive(CubeType)]
struct StepTile {
    row0: usize,
    q_start: u32,
}

/// The plane's share of S^T = K Q^T and dP^T = V dO^T, turned into P^T and dS^T = P^T (dP^T -
/// delta) and stored into the P^T and dS^T tiles. With `masked`, queries outside a key's
/// `[ranges.lo, ranges.hi)` (`hi` read only when `ranges.banded`, else the chunk's end `q_len`)
/// get P = 0: the causal diagonal, a window's or a document's bounds, rows past the chunk.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_probabilities<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    staged: &mut KeyBlockTiles<E>,
    shares: &PlaneShares,
    step_tile: &StepTile,
    ranges: &LaneRanges,
    q_len: u32,
    scale_log2: f32,
    #[comptime] head_dim: usize,
    #[comptime] masked: bool,
    #[comptime] stmatrix: bool,
) {
    let banded = comptime!(ranges.banded);
    let k_block = &staged.k;
    let v_block = &staged.v;
    let q_tiles = &staged.q;
    let do_tiles = &staged.grad_out;
    let lse_tiles = &staged.lse;
    let delta_tiles = &staged.delta;
    let p_tile = &mut staged.p;
    let ds_tile = &mut staged.ds;
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let frags = comptime!(HALF_QUERIES / FRAG_COLS);
    let lane = UNIT_POS_PLANE;
    let row0 = step_tile.row0;
    let mut s_acc = zero_accumulator::<E, NC>(def, comptime!(PLANE_TILES * frags));
    multiply_by_rows_transposed::<E, NA, NB, NC>(
        def,
        k_block,
        shares.key_row0,
        q_tiles,
        row0 + shares.query_col0,
        &mut s_acc,
        PLANE_TILES,
        HALF_QUERIES,
        head_dim,
    );
    let mut dp_acc = zero_accumulator::<E, NC>(def, comptime!(PLANE_TILES * frags));
    multiply_by_rows_transposed::<E, NA, NB, NC>(
        def,
        v_block,
        shares.key_row0,
        do_tiles,
        row0 + shares.query_col0,
        &mut dp_acc,
        PLANE_TILES,
        HALF_QUERIES,
        head_dim,
    );
    // Column-major over the fragments: a lane's two query columns of fragment column `nt` share
    // one lse (in base 2) and one delta across the row tiles, read and converted once.
    #[unroll]
    for nt in 0..frags {
        let mut lse_cols = Array::<f32>::new(2usize);
        let mut delta_cols = Array::<f32>::new(2usize);
        #[unroll]
        for c in 0..2usize {
            let col = shares.query_col0 + nt * FRAG_COLS + accumulator_col(lane, c) as usize;
            lse_cols[c] = lse_log2(lse_tiles[row0 + col]);
            delta_cols[c] = delta_tiles[row0 + col];
        }
        #[unroll]
        for mt in 0..PLANE_TILES {
            #[unroll]
            for i in 0..vc {
                let at = (mt * frags + nt) * vc + i;
                let mut s_reg = s_acc[at];
                let mut dp_reg = dp_acc[at];
                #[unroll]
                for e in 0..sc {
                    let n = i * sc + e;
                    let mut p = weight_log2(s_reg[e], scale_log2, lse_cols[n % 2]);
                    if masked {
                        let col =
                            shares.query_col0 + nt * FRAG_COLS + accumulator_col(lane, n) as usize;
                        let query = step_tile.q_start + col as u32;
                        let key_slot = mt * ROW_SLOTS + n / 2;
                        let mut query_end = q_len;
                        if banded {
                            query_end = ranges.hi[key_slot];
                        }
                        p = select(query >= ranges.lo[key_slot] && query < query_end, p, 0.0f32);
                    }
                    s_reg[e] = p;
                    dp_reg[e] = p * (dp_reg[e] - delta_cols[n % 2]);
                }
                s_acc[at] = s_reg;
                dp_acc[at] = dp_reg;
            }
        }
    }
    store_to_tile::<E, NA, NC>(
        def,
        &s_acc,
        p_tile,
        shares.key_row0,
        shares.query_col0,
        PLANE_TILES,
        HALF_QUERIES,
        QUERY_ROWS,
        stmatrix,
    );
    store_to_tile::<E, NA, NC>(
        def,
        &dp_acc,
        ds_tile,
        shares.key_row0,
        shares.query_col0,
        PLANE_TILES,
        HALF_QUERIES,
        QUERY_ROWS,
        stmatrix,
    );
}

/// One of the plane's key gradients over the whole query tile in buffer rows `row0..`, for its
/// keys and head-dim half: dV += P^T dO (`weights` the P^T tile, `rows` the dO tiles) or
/// dK += dS^T Q (the dS^T tile and the Q tiles).
#[cube]
#[allow(clippy::too_many_arguments)]
fn accumulate_key_grad<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    weights: &SharedMemory<E>,
    rows: &SharedMemory<E>,
    shares: &PlaneShares,
    row0: usize,
    acc: &mut Array<Vector<f32, NC>>,
    #[comptime] head_dim: usize,
) {
    let frags = load_fragments::<E, NA>(
        def,
        weights,
        shares.key_row0,
        0usize,
        PLANE_TILES,
        comptime!(QUERY_ROWS / FRAG_K),
        QUERY_ROWS,
        false,
    );
    multiply_by_row_columns::<E, NA, NB, NC>(
        def,
        &frags,
        rows,
        row0,
        shares.dim_col0,
        acc,
        PLANE_TILES,
        QUERY_ROWS,
        comptime!(head_dim / 2),
        head_dim,
    );
}

/// The fused kernel's dQ for one query tile: the plane's [`HALF_QUERIES`] queries by
/// `head_dim / 4` columns of `dS K` over the block's [`DKDV_KEYS`] keys, added to the
/// fragment-order scratch `dq` of slice `slice` with f32 atomics, one 128-byte line per
/// warp-wide atomic (the softmax scale is applied once, when the scratch is unpacked). The A fragments of dS are transposed loads of the dS^T tile.
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_tile_dq<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    k_block: &SharedMemory<E>,
    ds_tile: &SharedMemory<E>,
    dq: &mut Array<Atomic<f32>>,
    shares: &PlaneShares,
    slice: u32,
    q_start: u32,
    q_len: u32,
    #[comptime] head_dim: usize,
) {
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let cols = comptime!(head_dim / 4);
    let frags = comptime!(cols / FRAG_COLS);
    let lane = UNIT_POS_PLANE;
    let mut dq_acc = zero_accumulator::<E, NC>(def, comptime!(PLANE_TILES * frags));
    #[unroll]
    for chunk in 0..comptime!(DKDV_KEYS / DQ_KEY_CHUNK) {
        let ds_frags = load_fragments::<E, NA>(
            def,
            ds_tile,
            shares.dq_row0,
            chunk * DQ_KEY_CHUNK,
            PLANE_TILES,
            comptime!(DQ_KEY_CHUNK / FRAG_K),
            QUERY_ROWS,
            true,
        );
        multiply_by_row_columns::<E, NA, NB, NC>(
            def,
            &ds_frags,
            k_block,
            chunk * DQ_KEY_CHUNK,
            shares.dq_col0,
            &mut dq_acc,
            PLANE_TILES,
            DQ_KEY_CHUNK,
            cols,
            head_dim,
        );
    }
    // Row tiles wholly past the chunk add nothing; rows past it in a tile that straddles the
    // end (dS = 0) land in the scratch's padding.
    let first_col_tile = shares.dq_col0 / FRAG_COLS;
    #[unroll]
    for mt in 0..PLANE_TILES {
        let row = q_start + (shares.dq_row0 + mt * WARP_ROWS) as u32;
        if row < q_len {
            let base = tile_row_base(slice, row, q_len, lane, head_dim) + first_col_tile * 128;
            #[unroll]
            for t in 0..frags {
                #[unroll]
                for i in 0..vc {
                    let reg = dq_acc[(mt * frags + t) * vc + i];
                    #[unroll]
                    for e in 0..sc {
                        let offset = comptime!((t * 4 + i * sc + e) * 32);
                        dq[base + offset].fetch_add(reg[e]);
                    }
                }
            }
        }
    }
}

/// Stores a plane's dK (times `scale`) and dV accumulators (its [`GROUP_KEYS`] keys from
/// `key_row`, `head_dim / 2` columns from `col0`) to `dk`, `dv` in `T`, adding to what is there
/// with `accumulate`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_key_grads<E: Float, T: Float, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    dk_acc: &Array<Vector<f32, NC>>,
    dv_acc: &Array<Vector<f32, NC>>,
    dk: &mut Array<T>,
    dv: &mut Array<T>,
    key_base: usize,
    key_row: u32,
    kv_len: u32,
    col0: usize,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] accumulate: bool,
) {
    store_accumulator_columns::<E, T, NC>(
        def,
        dk_acc,
        dk,
        key_base,
        key_row,
        kv_len,
        col0,
        scale,
        PLANE_TILES,
        comptime!(head_dim / 2),
        head_dim,
        accumulate,
    );
    store_accumulator_columns::<E, T, NC>(
        def,
        dv_acc,
        dv,
        key_base,
        key_row,
        kv_len,
        col0,
        1.0f32,
        PLANE_TILES,
        comptime!(head_dim / 2),
        head_dim,
        accumulate,
    );
}

/// Issues the copies of the query tile starting at row `q_start` of Q and dO (of the query head
/// whose rows start at `row_base`), and of its rows' log-sum-exp and delta, into buffer `buffer`
/// (0 or 1); the caller commits them. Statistics of rows past the chunk are zero-filled.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_query_tile<E: Float>(
    q: &Array<E>,
    grad_out: &Array<E>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    row_base: usize,
    q_start: u32,
    q_len: u32,
    staged: &mut KeyBlockTiles<E>,
    buffer: u32,
    #[comptime] head_dim: usize,
) {
    let q_tiles = &mut staged.q;
    let do_tiles = &mut staged.grad_out;
    let lse_tiles = &mut staged.lse;
    let delta_tiles = &mut staged.delta;
    let row0 = buffer as usize * QUERY_ROWS;
    if UNIT_POS < QUERY_ROWS as u32 {
        // One 4-byte copy per statistic and row, on the same barrier as the tiles.
        let row = q_start + UNIT_POS;
        let valid = row < q_len;
        let start = select(valid, row_base + row as usize, 0usize);
        let count = select(valid, 1usize, 0usize);
        let at = row0 + UNIT_POS as usize;
        copy_async_checked(
            &lse.slice(start, start + count),
            &mut lse_tiles.slice_mut(at, at + 1),
            1u32,
        );
        copy_async_checked(
            &delta.slice(start, start + count),
            &mut delta_tiles.slice_mut(at, at + 1),
            1u32,
        );
    }
    stage_tile_async::<E>(
        q,
        row_base * head_dim,
        q_start,
        q_len,
        q_tiles,
        row0,
        QUERY_ROWS,
        head_dim,
        DKDV_UNITS,
    );
    stage_tile_async::<E>(
        grad_out,
        row_base * head_dim,
        q_start,
        q_len,
        do_tiles,
        row0,
        QUERY_ROWS,
        head_dim,
        DKDV_UNITS,
    );
}
