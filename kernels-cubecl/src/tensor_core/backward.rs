//! Tensor-core backward step for one (query chunk, key chunk) pair, FlashAttention-2 style. The
//! dK/dV kernel owns a block of keys and walks the query tiles of every query head of its group.
//! Fused (the default), it also adds each tile's `dQ = dS K` to dQ with f32 atomics: five GEMMs
//! per (query tile, key block), sums in no fixed order. Deterministic, a separate dQ kernel owns
//! a block of queries and walks the key tiles, recomputing S and dP: seven GEMMs, bitwise
//! reproducible. All use the stored log-sum-exp and `delta = rowsum(dO * O)`; the forward is
//! never recomputed.
//!
//! As in the forward, tiles that every row of the block sees whole run with no mask and
//! unchecked staging, and probabilities are one FMA and one `exp2` from a base-2 log-sum-exp.
//! The walked tiles are double-buffered: the copies of tile `t + 1` are issued before tile `t` is
//! waited on, so they land while tile `t` computes.

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::dq_fragments::tile_row_base;
use super::forward::{slot_row, PLANES, UNITS};
use super::fragments::{
    accumulator_col, accumulator_row, mma_definition, FRAG_COLS, FRAG_K, WARP_ROWS,
};
use super::tiles::{
    load_matrix_x4, padded_stride, pair_lane_offset, stage_rows_async, stage_tile_async, ROW_SLOTS,
};
use super::warp_tile::{
    accumulator_to_fragments, multiply_by_rows, multiply_by_rows_transposed, store_accumulator,
    zero_accumulator,
};
use crate::geometry::{query_block_at, row_key_limit, visible_key_end};
use crate::stats::{lse_log2, weight_log2, LOG2_E};

/// Query rows per dQ cube, and per query tile of the dK/dV kernel (16 per plane).
pub const QUERY_ROWS: usize = PLANES * WARP_ROWS;
/// Key rows per dK/dV cube, and per key tile of the dQ kernel (16 per plane).
pub const KEY_ROWS: usize = PLANES * WARP_ROWS;

/// dQ step. Grid: slice-major ([`crate::grid::slice_major`]), x = batch * q_heads, y = query
/// blocks of [`QUERY_ROWS`], taken last block first.
/// Launched unchecked: global accesses are guarded against `q_len`/`kv_len` by the kernel.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
pub fn backward_dq_mma<E: Float>(
    q: &Array<E>,
    k: &Array<E>,
    v: &Array<E>,
    grad_out: &Array<E>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    dq: &mut Array<f32>,
    scale: f32,
    shift: i32,
    q_len: u32,
    kv_len: u32,
    q_heads: u32,
    group_size: u32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
) {
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
        q_heads,
        group_size,
        shift,
        QUERY_ROWS,
        head_dim,
        causal,
    );
    let (kv_base, row_base, block_start, kv_end) =
        (block.kv_base, block.row_base, block.start, block.kv_end);
    let plane_row0 = (warp as usize) * WARP_ROWS;
    let plane_start = block_start + plane_row0 as u32;

    let mut q_tile = SharedMemory::<E>::new_aligned(comptime!(QUERY_ROWS * stride), 16usize);
    let mut do_tile = SharedMemory::<E>::new_aligned(comptime!(QUERY_ROWS * stride), 16usize);
    // Two buffers of K and V tiles: key tile `t` in rows `(t % 2) * KEY_ROWS..`.
    let mut k_tiles = SharedMemory::<E>::new_aligned(comptime!(2 * KEY_ROWS * stride), 16usize);
    let mut v_tiles = SharedMemory::<E>::new_aligned(comptime!(2 * KEY_ROWS * stride), 16usize);
    let ready_even = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let ready_odd = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    sync_cube();
    // The block's Q and dO and the first key tile arrive on the even barrier.
    stage_rows_async::<E>(
        q,
        row_base * head_dim,
        block_start,
        q_len,
        &mut q_tile,
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
        &mut do_tile,
        0usize,
        QUERY_ROWS,
        head_dim,
        UNITS,
        true,
    );
    let num_tiles = kv_end.div_ceil(KEY_ROWS as u32);
    if num_tiles > 0 {
        stage_key_tile::<E>(
            k,
            v,
            kv_base,
            0u32,
            kv_len,
            &mut k_tiles,
            &mut v_tiles,
            0u32,
            head_dim,
        );
    }
    ready_even.commit_copy_async();

    let mut lse_row = Array::<f32>::new(ROW_SLOTS);
    let mut delta_row = Array::<f32>::new(ROW_SLOTS);
    let mut key_limit = Array::<u32>::new(ROW_SLOTS);
    #[unroll]
    for slot in 0..ROW_SLOTS {
        let row = plane_start + slot_row(lane, slot);
        let mut lv = 0.0f32;
        let mut dv = 0.0f32;
        let mut limit = 0u32;
        if row < q_len {
            lv = lse[row_base + row as usize];
            dv = delta[row_base + row as usize];
            limit = kv_end;
            if causal {
                limit = row_key_limit(row, kv_end, shift);
            }
        }
        lse_row[slot] = lse_log2(lv);
        delta_row[slot] = dv;
        key_limit[slot] = limit;
    }

    let scale_log2 = scale * LOG2_E;
    let mut dq_acc = zero_accumulator::<E, NC>(&def, out_frags);
    let whole_tiles = visible_key_end(block_start, kv_len, shift, causal) / KEY_ROWS as u32;
    for tile in 0..whole_tiles {
        dq_tile::<E, NA, NB, NC>(
            &def,
            k,
            v,
            kv_base,
            kv_len,
            &q_tile,
            &do_tile,
            &mut k_tiles,
            &mut v_tiles,
            &ready_even,
            &ready_odd,
            tile,
            num_tiles,
            plane_row0,
            &mut dq_acc,
            &lse_row,
            &delta_row,
            &key_limit,
            scale_log2,
            head_dim,
            false,
        );
    }
    for tile in whole_tiles..num_tiles {
        dq_tile::<E, NA, NB, NC>(
            &def,
            k,
            v,
            kv_base,
            kv_len,
            &q_tile,
            &do_tile,
            &mut k_tiles,
            &mut v_tiles,
            &ready_even,
            &ready_odd,
            tile,
            num_tiles,
            plane_row0,
            &mut dq_acc,
            &lse_row,
            &delta_row,
            &key_limit,
            scale_log2,
            head_dim,
            true,
        );
    }
    // A block that sees no key never waited for its Q and dO copies: no cube exits with copies
    // in flight.
    if num_tiles == 0 {
        ready_even.arrive_and_wait();
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
fn commit_to_buffer(ready_even: &Barrier, ready_odd: &Barrier, buffer: u32) {
    if buffer == 0 {
        ready_even.commit_copy_async();
    } else {
        ready_odd.commit_copy_async();
    }
}

/// Waits until the copies committed on the barrier of buffer `buffer` (0 or 1) have landed.
#[cube]
fn wait_for_buffer(ready_even: &Barrier, ready_odd: &Barrier, buffer: u32) {
    if buffer == 0 {
        ready_even.arrive_and_wait();
    } else {
        ready_odd.arrive_and_wait();
    }
}

/// One key tile of the dQ kernel: issue the next tile's K and V into the other buffer, wait for
/// this tile's (the block's Q and dO arrive with the first), then S = Q K^T, dP = dO V^T,
/// dS = P (dP - delta), dQ += dS K. With `masked`, keys a row may not see get P = 0.
#[cube]
#[allow(clippy::too_many_arguments)]
fn dq_tile<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    k: &Array<E>,
    v: &Array<E>,
    kv_base: usize,
    kv_len: u32,
    q_tile: &SharedMemory<E>,
    do_tile: &SharedMemory<E>,
    k_tiles: &mut SharedMemory<E>,
    v_tiles: &mut SharedMemory<E>,
    ready_even: &Barrier,
    ready_odd: &Barrier,
    tile: u32,
    num_tiles: u32,
    plane_row0: usize,
    dq_acc: &mut Array<Vector<f32, NC>>,
    lse_row: &Array<f32>,
    delta_row: &Array<f32>,
    key_limit: &Array<u32>,
    scale_log2: f32,
    #[comptime] head_dim: usize,
    #[comptime] masked: bool,
) {
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let key_frags = comptime!(KEY_ROWS / FRAG_COLS);
    let lane = UNIT_POS_PLANE;
    let key_start = tile * KEY_ROWS as u32;
    let buffer = tile % 2;
    let row0 = buffer as usize * KEY_ROWS;

    // Every plane is done with tile - 1: its buffer takes tile + 1.
    sync_cube();
    if tile + 1 < num_tiles {
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
                    p = select(key < key_limit[slot], p, 0.0f32);
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

// The fused kernel's query tiles must not reach past a slice of the dQ scratch.
const _: () = assert!(super::dq_fragments::SCRATCH_ROW_ALIGN.is_multiple_of(QUERY_ROWS));

/// Elements of the fused kernel's dS tile: [`KEY_ROWS`] rows of [`QUERY_ROWS`] columns, padded.
pub const fn ds_tile_elems(fuse_dq: bool) -> usize {
    if fuse_dq {
        KEY_ROWS * padded_stride(QUERY_ROWS)
    } else {
        // Unused: the smallest aligned allocation.
        8
    }
}

/// dK/dV step, and with `fuse_dq` also dQ (added with f32 atomics to `dq`, a zeroed scratch in
/// fragment order, see [`super::dq_fragments`]; not touched otherwise). A step adds dK and dV
/// to the f32 `dk`, `dv`; with `one_shot` (a whole attention: the cube has seen every query)
/// it writes them to `dk_out`, `dv_out` in `E` instead, leaving `dk`, `dv` alone. Grid: slice-major, x = batch * kv_heads, y = key blocks of [`KEY_ROWS`] (under a
/// causal mask the first blocks see the most queries and run first). Each plane owns 16 keys and
/// walks the query tiles (of every query head of its group) that can see them; fused, each plane
/// then owns 16 of the tile's queries for `dQ += dS K` over the block's keys. Launched unchecked:
/// global accesses are guarded against `q_len`/`kv_len` by the kernel.
#[cube(launch_unchecked, fast_math = FastMath::all())]
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
    scale: f32,
    shift: i32,
    q_len: u32,
    kv_len: u32,
    kv_heads: u32,
    group_size: u32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
    #[comptime] fuse_dq: bool,
    #[comptime] one_shot: bool,
) {
    let def = mma_definition::<E>();
    let size!(NA) = def.vector_size(MatrixIdent::A);
    let size!(NB) = def.vector_size(MatrixIdent::B);
    let size!(NC) = def.vector_size(MatrixIdent::Accumulator);
    let out_frags = comptime!(head_dim / FRAG_COLS);
    let stride = comptime!(padded_stride(head_dim));

    let lane = UNIT_POS_PLANE;
    let warp = UNIT_POS / 32;
    let bkv = CUBE_POS_X;
    let batch = bkv / kv_heads;
    let kv_head = bkv % kv_heads;
    let q_heads = kv_heads * group_size;
    let key_base = (bkv * kv_len) as usize;
    let block_start = CUBE_POS_Y * KEY_ROWS as u32;
    let plane_row0 = (warp as usize) * WARP_ROWS;
    let plane_start = block_start + plane_row0 as u32;

    let mut k_block = SharedMemory::<E>::new_aligned(comptime!(KEY_ROWS * stride), 16usize);
    let mut v_block = SharedMemory::<E>::new_aligned(comptime!(KEY_ROWS * stride), 16usize);
    // Two buffers of query tiles and their rows' statistics: walk step `s` in buffer `s % 2`.
    let mut q_tiles = SharedMemory::<E>::new_aligned(comptime!(2 * QUERY_ROWS * stride), 16usize);
    let mut do_tiles = SharedMemory::<E>::new_aligned(comptime!(2 * QUERY_ROWS * stride), 16usize);
    let mut lse_tiles = SharedMemory::<f32>::new(comptime!(2 * QUERY_ROWS));
    let mut delta_tiles = SharedMemory::<f32>::new(comptime!(2 * QUERY_ROWS));
    // Fused: this step's dS^T, keys by queries, read back by the planes as dS for dQ.
    let mut ds_tile = SharedMemory::<E>::new_aligned(comptime!(ds_tile_elems(fuse_dq)), 16usize);
    let ready_even = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let ready_odd = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    sync_cube();
    stage_rows_async::<E>(
        k,
        key_base * head_dim,
        block_start,
        kv_len,
        &mut k_block,
        0usize,
        KEY_ROWS,
        head_dim,
        UNITS,
        true,
    );
    stage_rows_async::<E>(
        v,
        key_base * head_dim,
        block_start,
        kv_len,
        &mut v_block,
        0usize,
        KEY_ROWS,
        head_dim,
        UNITS,
        true,
    );

    // First query each of the lane's two key rows is seen by (query i sees key j iff
    // j <= i + shift); keys past the chunk see nothing.
    let mut query_floor = Array::<u32>::new(ROW_SLOTS);
    #[unroll]
    for slot in 0..ROW_SLOTS {
        let key = plane_start + slot_row(lane, slot);
        let mut floor = 0u32;
        if causal {
            floor = max(key as i32 - shift, 0i32) as u32;
        }
        query_floor[slot] = select(key < kv_len, floor, q_len);
    }
    // Query tiles of each query head of the group: [first, whole_from) on the causal diagonal
    // (masked), [whole_from, whole_end) seen whole by every key of the block, [whole_end,
    // num_tiles) the chunk's partial last tile. The walk visits `tiles` of them per head,
    // head after head.
    let num_tiles = q_len.div_ceil(QUERY_ROWS as u32);
    let whole_end = q_len / QUERY_ROWS as u32;
    let mut first = 0u32;
    let mut whole_from = 0u32;
    if causal {
        let block_last = block_start + KEY_ROWS as u32 - 1;
        first = min(max(block_start as i32 - shift, 0i32) as u32, q_len) / QUERY_ROWS as u32;
        whole_from =
            min(max(block_last as i32 - shift, 0i32) as u32, q_len).div_ceil(QUERY_ROWS as u32);
    }
    whole_from = min(whole_from, whole_end);
    first = min(first, num_tiles);
    let walk = QueryWalk {
        head0: batch * q_heads + kv_head * group_size,
        q_len,
        first,
        tiles: num_tiles - first,
    };
    let steps = group_size * walk.tiles;

    // The block's K and V and the first query tile arrive on the even barrier.
    if steps > 0 {
        let q_start = walk.tile(0u32) * QUERY_ROWS as u32;
        stage_query_tile::<E>(
            q,
            grad_out,
            walk.row_base(0u32),
            q_start,
            q_len,
            &mut q_tiles,
            &mut do_tiles,
            0u32,
            head_dim,
        );
        let mut stats = Array::<f32>::new(2usize);
        load_row_stats(&mut stats, lse, delta, walk.row_base(0u32), q_start, q_len);
        store_row_stats(&stats, &mut lse_tiles, &mut delta_tiles, 0u32);
    }
    ready_even.commit_copy_async();

    let scale_log2 = scale * LOG2_E;
    let mut dk_acc = zero_accumulator::<E, NC>(&def, out_frags);
    let mut dv_acc = zero_accumulator::<E, NC>(&def, out_frags);
    for step in 0..steps {
        let tile = walk.tile(step);
        if tile < whole_from || tile >= whole_end {
            dkdv_tile::<E, NA, NB, NC>(
                &def,
                q,
                grad_out,
                lse,
                delta,
                &walk,
                &k_block,
                &v_block,
                &mut q_tiles,
                &mut do_tiles,
                &mut lse_tiles,
                &mut delta_tiles,
                &ready_even,
                &ready_odd,
                step,
                steps,
                plane_row0,
                &mut dk_acc,
                &mut dv_acc,
                &mut ds_tile,
                dq,
                &query_floor,
                scale,
                scale_log2,
                head_dim,
                true,
                fuse_dq,
            );
        } else {
            dkdv_tile::<E, NA, NB, NC>(
                &def,
                q,
                grad_out,
                lse,
                delta,
                &walk,
                &k_block,
                &v_block,
                &mut q_tiles,
                &mut do_tiles,
                &mut lse_tiles,
                &mut delta_tiles,
                &ready_even,
                &ready_odd,
                step,
                steps,
                plane_row0,
                &mut dk_acc,
                &mut dv_acc,
                &mut ds_tile,
                dq,
                &query_floor,
                scale,
                scale_log2,
                head_dim,
                false,
                fuse_dq,
            );
        }
    }
    // Keys no query sees never waited for their K and V copies: no cube exits with copies in
    // flight.
    if steps == 0 {
        ready_even.arrive_and_wait();
    }

    if one_shot {
        store_key_grads::<E, E, NC>(
            &def,
            &dk_acc,
            &dv_acc,
            dk_out,
            dv_out,
            key_base,
            plane_start,
            kv_len,
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
            plane_start,
            kv_len,
            scale,
            head_dim,
            true,
        );
    }
}

/// Stores a plane's dK (times `scale`) and dV accumulators to `dk`, `dv` in `T`, adding to what
/// is there with `accumulate`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_key_grads<E: Float, T: Float, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    dk_acc: &Array<Vector<f32, NC>>,
    dv_acc: &Array<Vector<f32, NC>>,
    dk: &mut Array<T>,
    dv: &mut Array<T>,
    key_base: usize,
    plane_start: u32,
    kv_len: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] accumulate: bool,
) {
    store_accumulator::<E, T, NC>(
        def,
        dk_acc,
        dk,
        key_base,
        plane_start,
        kv_len,
        scale,
        1usize,
        head_dim,
        accumulate,
    );
    store_accumulator::<E, T, NC>(
        def,
        dv_acc,
        dv,
        key_base,
        plane_start,
        kv_len,
        1.0f32,
        1usize,
        head_dim,
        accumulate,
    );
}

/// The query tiles one dK/dV cube walks: for each query head of its group (from `head0`), tiles
/// `first..first + tiles` of `QUERY_ROWS` rows, head after head.
#[derive(CubeType)]
struct QueryWalk {
    head0: u32,
    q_len: u32,
    first: u32,
    tiles: u32,
}

#[cube]
impl QueryWalk {
    /// Query tile (within its head) of walk step `step`.
    fn tile(&self, step: u32) -> u32 {
        self.first + step % self.tiles
    }

    /// (batch, query head) slice of walk step `step`.
    fn slice(&self, step: u32) -> u32 {
        self.head0 + step / self.tiles
    }

    /// First element row of walk step `step`'s query head.
    fn row_base(&self, step: u32) -> usize {
        (self.slice(step) * self.q_len) as usize
    }
}

/// Issues the copies of the query tile starting at row `q_start` of Q and dO (of the query head
/// whose rows start at `row_base`) into buffer `buffer` (0 or 1); the caller commits them.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_query_tile<E: Float>(
    q: &Array<E>,
    grad_out: &Array<E>,
    row_base: usize,
    q_start: u32,
    q_len: u32,
    q_tiles: &mut SharedMemory<E>,
    do_tiles: &mut SharedMemory<E>,
    buffer: u32,
    #[comptime] head_dim: usize,
) {
    let row0 = buffer as usize * QUERY_ROWS;
    stage_tile_async::<E>(
        q,
        row_base * head_dim,
        q_start,
        q_len,
        q_tiles,
        row0,
        QUERY_ROWS,
        head_dim,
        UNITS,
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
        UNITS,
    );
}

/// Loads the log-sum-exp and delta of the query tile's row `UNIT_POS` (units below
/// [`QUERY_ROWS`]) from global memory into `stats` (`[lse, delta]`); zeros for the other units
/// and for rows past the chunk.
#[cube]
fn load_row_stats(
    stats: &mut Array<f32>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    row_base: usize,
    q_start: u32,
    q_len: u32,
) {
    let row = q_start + UNIT_POS;
    stats[0] = 0.0f32;
    stats[1] = 0.0f32;
    if UNIT_POS < QUERY_ROWS as u32 && row < q_len {
        stats[0] = lse[row_base + row as usize];
        stats[1] = delta[row_base + row as usize];
    }
}

/// Stores row `UNIT_POS`'s statistics (from [`load_row_stats`]) into buffer `buffer`, the
/// log-sum-exp in base 2 as [`weight_log2`] takes it (plain stores: visible after the next
/// `sync_cube`).
#[cube]
fn store_row_stats(
    stats: &Array<f32>,
    lse_tiles: &mut SharedMemory<f32>,
    delta_tiles: &mut SharedMemory<f32>,
    buffer: u32,
) {
    if UNIT_POS < QUERY_ROWS as u32 {
        let at = buffer as usize * QUERY_ROWS + UNIT_POS as usize;
        lse_tiles[at] = lse_log2(stats[0]);
        delta_tiles[at] = stats[1];
    }
}

/// One step of the dK/dV kernel's walk: issue the next step's query tile into the other buffer,
/// wait for this one's (the block's K and V arrive with the first), then S^T = K Q^T,
/// dP^T = V dO^T, dV += P^T dO, dK += dS^T Q, and with `fuse_dq` dQ += dS K (see
/// [`add_tile_dq`]). With `masked`, queries that may not see a key (causal diagonal, rows past
/// the chunk) get P = 0.
#[cube]
#[allow(clippy::too_many_arguments)]
fn dkdv_tile<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    q: &Array<E>,
    grad_out: &Array<E>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    walk: &QueryWalk,
    k_block: &SharedMemory<E>,
    v_block: &SharedMemory<E>,
    q_tiles: &mut SharedMemory<E>,
    do_tiles: &mut SharedMemory<E>,
    lse_tiles: &mut SharedMemory<f32>,
    delta_tiles: &mut SharedMemory<f32>,
    ready_even: &Barrier,
    ready_odd: &Barrier,
    step: u32,
    steps: u32,
    plane_row0: usize,
    dk_acc: &mut Array<Vector<f32, NC>>,
    dv_acc: &mut Array<Vector<f32, NC>>,
    ds_tile: &mut SharedMemory<E>,
    dq: &mut Array<Atomic<f32>>,
    query_floor: &Array<u32>,
    scale: f32,
    scale_log2: f32,
    #[comptime] head_dim: usize,
    #[comptime] masked: bool,
    #[comptime] fuse_dq: bool,
) {
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let query_frags = comptime!(QUERY_ROWS / FRAG_COLS);
    let lane = UNIT_POS_PLANE;
    let q_len = walk.q_len;
    let q_start = walk.tile(step) * QUERY_ROWS as u32;
    let buffer = step % 2;
    let row0 = buffer as usize * QUERY_ROWS;

    // Every plane is done with step - 1: its buffer takes step + 1. The sync also publishes
    // this step's statistics, stored at the end of step - 1.
    sync_cube();
    let has_next = step + 1 < steps;
    let mut next_stats = Array::<f32>::new(2usize);
    if has_next {
        let next_start = walk.tile(step + 1) * QUERY_ROWS as u32;
        stage_query_tile::<E>(
            q,
            grad_out,
            walk.row_base(step + 1),
            next_start,
            q_len,
            q_tiles,
            do_tiles,
            1 - buffer,
            head_dim,
        );
        commit_to_buffer(ready_even, ready_odd, 1 - buffer);
        // Loaded now, stored after this step's products: the loads' latency hides behind them.
        load_row_stats(
            &mut next_stats,
            lse,
            delta,
            walk.row_base(step + 1),
            next_start,
            q_len,
        );
    }
    wait_for_buffer(ready_even, ready_odd, buffer);

    // S^T = K Q^T and dP^T = V dO^T for the plane's 16 keys against the tile's queries.
    let mut s_acc = zero_accumulator::<E, NC>(def, query_frags);
    multiply_by_rows_transposed::<E, NA, NB, NC>(
        def, k_block, plane_row0, q_tiles, row0, &mut s_acc, 1usize, QUERY_ROWS, head_dim,
    );
    let mut dp_acc = zero_accumulator::<E, NC>(def, query_frags);
    multiply_by_rows_transposed::<E, NA, NB, NC>(
        def,
        v_block,
        plane_row0,
        do_tiles,
        row0,
        &mut dp_acc,
        1usize,
        QUERY_ROWS,
        head_dim,
    );

    // P^T in place of S^T, dS^T = P^T * (dP^T - delta) in place of dP^T.
    #[unroll]
    for nt in 0..query_frags {
        #[unroll]
        for i in 0..vc {
            let mut s_reg = s_acc[nt * vc + i];
            let mut dp_reg = dp_acc[nt * vc + i];
            #[unroll]
            for e in 0..sc {
                let n = i * sc + e;
                let col = nt * FRAG_COLS + accumulator_col(lane, n) as usize;
                let mut p = weight_log2(s_reg[e], scale_log2, lse_tiles[row0 + col]);
                if masked {
                    let query = q_start + col as u32;
                    let visible = query >= query_floor[n / 2] && query < q_len;
                    p = select(visible, p, 0.0f32);
                }
                s_reg[e] = p;
                dp_reg[e] = p * (dp_reg[e] - delta_tiles[row0 + col]);
            }
            s_acc[nt * vc + i] = s_reg;
            dp_acc[nt * vc + i] = dp_reg;
        }
    }
    let p_frag = accumulator_to_fragments::<E, NA, NC>(def, &s_acc, 1usize, QUERY_ROWS);
    multiply_by_rows::<E, NA, NB, NC>(
        def, &p_frag, do_tiles, row0, dv_acc, 1usize, QUERY_ROWS, head_dim,
    );
    if fuse_dq {
        store_ds_transposed::<E, NC>(def, &dp_acc, ds_tile, plane_row0, scale);
    }
    let ds_frag = accumulator_to_fragments::<E, NA, NC>(def, &dp_acc, 1usize, QUERY_ROWS);
    multiply_by_rows::<E, NA, NB, NC>(
        def, &ds_frag, q_tiles, row0, dk_acc, 1usize, QUERY_ROWS, head_dim,
    );
    if fuse_dq {
        add_tile_dq::<E, NA, NB, NC>(
            def,
            k_block,
            ds_tile,
            dq,
            walk.slice(step),
            q_start + plane_row0 as u32,
            q_len,
            head_dim,
        );
    }
    if has_next {
        store_row_stats(&next_stats, lse_tiles, delta_tiles, 1 - buffer);
    }
}

/// Stores `scale` times the plane's dS^T accumulator (its 16 keys from `plane_row0` by the
/// tile's [`QUERY_ROWS`] queries) into rows `plane_row0..` of the dS tile, converted to `E`.
#[cube]
fn store_ds_transposed<E: Float, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    ds_acc: &Array<Vector<f32, NC>>,
    ds_tile: &mut SharedMemory<E>,
    plane_row0: usize,
    scale: f32,
) {
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let stride = comptime!(padded_stride(QUERY_ROWS));
    let lane = UNIT_POS_PLANE;
    let base = plane_row0 * stride;
    #[unroll]
    for nt in 0..comptime!(QUERY_ROWS / FRAG_COLS) {
        #[unroll]
        for i in 0..vc {
            let reg = ds_acc[nt * vc + i];
            #[unroll]
            for e in 0..sc {
                let n = i * sc + e;
                let at = base
                    + accumulator_row(lane, n) as usize * stride
                    + nt * FRAG_COLS
                    + accumulator_col(lane, n) as usize;
                ds_tile[at] = E::cast_from(reg[e] * scale);
            }
        }
    }
}

/// The fused kernel's dQ for one query tile: once every plane has stored its (scaled) dS^T rows,
/// each plane computes `dS K` for its 16 queries (rows from `q_row`, tile columns from `q_row %
/// QUERY_ROWS`) over the block's [`KEY_ROWS`] keys and adds it to the fragment-order scratch
/// `dq` of slice `slice` with f32 atomics, one 128-byte line per warp-wide atomic.
/// The A fragments of dS are transposed `ldmatrix` loads of the keys-by-queries tile.
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_tile_dq<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    k_block: &SharedMemory<E>,
    ds_tile: &SharedMemory<E>,
    dq: &mut Array<Atomic<f32>>,
    slice: u32,
    q_row: u32,
    q_len: u32,
    #[comptime] head_dim: usize,
) {
    let va = def.vectors_per_lane(MatrixIdent::A);
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let k_steps = comptime!(KEY_ROWS / FRAG_K);
    let stride = comptime!(padded_stride(QUERY_ROWS));
    let lane = UNIT_POS_PLANE;
    sync_cube();
    // Queries are the tile's columns: the plane's 16 start at column `q_row % QUERY_ROWS`.
    let base = pair_lane_offset(lane, QUERY_ROWS, false) + (q_row % QUERY_ROWS as u32) as usize;
    let mut ds_frags = Array::<Vector<E, NA>>::new(comptime!(k_steps * va));
    #[unroll]
    for kk in 0..k_steps {
        let regs = load_matrix_x4::<E, NA>(
            def,
            ds_tile,
            base + comptime!(kk * FRAG_K * stride),
            MatrixIdent::A,
            true,
        );
        #[unroll]
        for i in 0..va {
            ds_frags[kk * va + i] = regs[i];
        }
    }
    let mut dq_acc = zero_accumulator::<E, NC>(def, comptime!(head_dim / FRAG_COLS));
    multiply_by_rows::<E, NA, NB, NC>(
        def,
        &ds_frags,
        k_block,
        0usize,
        &mut dq_acc,
        1usize,
        KEY_ROWS,
        head_dim,
    );
    // Planes wholly past the chunk add nothing; rows past it in a plane that straddles the end
    // (dS = 0) land in the scratch's padding.
    if q_row < q_len {
        let base = tile_row_base(slice, q_row, q_len, lane, head_dim);
        #[unroll]
        for t in 0..comptime!(head_dim / FRAG_COLS) {
            #[unroll]
            for i in 0..vc {
                let reg = dq_acc[t * vc + i];
                #[unroll]
                for e in 0..sc {
                    let offset = comptime!((t * 4 + i * sc + e) * 32);
                    dq[base + offset].fetch_add(reg[e]);
                }
            }
        }
    }
}
