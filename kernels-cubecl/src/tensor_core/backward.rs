//! Tensor-core backward step for one (query chunk, key chunk) pair, FlashAttention-2 style and
//! without atomics: one kernel accumulates dQ per query block (walking key tiles), another dK and
//! dV per key block (walking the query tiles of every query head of its group). Both use the
//! stored log-sum-exp and `delta = rowsum(dO * O)`; the forward is never recomputed.

use cubecl::cmma::MatrixIdent;
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::forward::{slot_row, BLOCK_KEYS, BLOCK_ROWS, UNITS};
use super::fragments::{accumulator_col, mma_definition, FRAG_COLS, WARP_ROWS};
use super::tiles::{padded_stride, stage_rows_async, ROW_SLOTS};
use super::warp_tile::{
    accumulator_to_fragments, load_row_fragments, multiply_by_rows, multiply_by_rows_transposed,
    store_accumulator, zero_accumulator,
};
use crate::geometry::{query_block, row_key_limit};
use crate::grid::cube_slice;
use crate::stats::probability_from_lse;

/// dQ step. Grid: x = query blocks of [`BLOCK_ROWS`], slices = batch * q_heads over y and z
/// ([`crate::grid`]). Launched unchecked: global accesses are guarded against `q_len`/`kv_len`
/// by the kernel.
#[cube(launch_unchecked)]
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
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let key_frags = comptime!(BLOCK_KEYS / FRAG_COLS);
    let out_frags = comptime!(head_dim / FRAG_COLS);
    let stride = comptime!(padded_stride(head_dim));

    let lane = UNIT_POS_PLANE;
    let warp = UNIT_POS / 32;
    let block = query_block(
        q_len, kv_len, q_heads, group_size, shift, BLOCK_ROWS, head_dim, causal,
    );
    let (kv_base, row_base, block_start, kv_end) =
        (block.kv_base, block.row_base, block.start, block.kv_end);
    let warp_start = block_start + warp * WARP_ROWS as u32;

    let mut k_tile = SharedMemory::<E>::new_aligned(comptime!(BLOCK_KEYS * stride), 16usize);
    let mut v_tile = SharedMemory::<E>::new_aligned(comptime!(BLOCK_KEYS * stride), 16usize);
    let ready = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    sync_cube();

    // Query and output-gradient fragments, staged through the key and value tiles.
    stage_rows_async::<E>(
        q,
        row_base * head_dim,
        block_start,
        q_len,
        &mut k_tile,
        BLOCK_ROWS,
        head_dim,
        UNITS,
    );
    stage_rows_async::<E>(
        grad_out,
        row_base * head_dim,
        block_start,
        q_len,
        &mut v_tile,
        BLOCK_ROWS,
        head_dim,
        UNITS,
    );
    ready.commit_copy_async();
    ready.arrive_and_wait();
    let q_frag = load_row_fragments::<E, NA>(&def, &k_tile, (warp as usize) * WARP_ROWS, head_dim);
    let do_frag = load_row_fragments::<E, NA>(&def, &v_tile, (warp as usize) * WARP_ROWS, head_dim);

    let mut lse_row = Array::<f32>::new(ROW_SLOTS);
    let mut delta_row = Array::<f32>::new(ROW_SLOTS);
    let mut key_limit = Array::<u32>::new(ROW_SLOTS);
    #[unroll]
    for slot in 0..ROW_SLOTS {
        let row = warp_start + slot_row(lane, slot);
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
        lse_row[slot] = lv;
        delta_row[slot] = dv;
        key_limit[slot] = limit;
    }

    let mut dq_acc = zero_accumulator::<E, NC>(&def, out_frags);
    let num_tiles = kv_end.div_ceil(BLOCK_KEYS as u32);
    for tile in 0..num_tiles {
        let key_start = tile * BLOCK_KEYS as u32;
        sync_cube();
        stage_rows_async::<E>(
            k,
            kv_base,
            key_start,
            kv_len,
            &mut k_tile,
            BLOCK_KEYS,
            head_dim,
            UNITS,
        );
        stage_rows_async::<E>(
            v,
            kv_base,
            key_start,
            kv_len,
            &mut v_tile,
            BLOCK_KEYS,
            head_dim,
            UNITS,
        );
        ready.commit_copy_async();
        ready.arrive_and_wait();

        let mut s_acc = zero_accumulator::<E, NC>(&def, key_frags);
        multiply_by_rows_transposed::<E, NA, NB, NC>(
            &def, &q_frag, &k_tile, &mut s_acc, BLOCK_KEYS, head_dim,
        );
        let mut dp_acc = zero_accumulator::<E, NC>(&def, key_frags);
        multiply_by_rows_transposed::<E, NA, NB, NC>(
            &def,
            &do_frag,
            &v_tile,
            &mut dp_acc,
            BLOCK_KEYS,
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
                    let key = key_start + (nt * FRAG_COLS) as u32 + accumulator_col(lane, n);
                    let p = select(
                        key < key_limit[slot],
                        probability_from_lse(s_reg[e] * scale, lse_row[slot]),
                        0.0f32,
                    );
                    dp_reg[e] = p * (dp_reg[e] - delta_row[slot]);
                }
                dp_acc[nt * vc + i] = dp_reg;
            }
        }
        let ds_frag = accumulator_to_fragments::<E, NA, NC>(&def, &dp_acc, BLOCK_KEYS);
        multiply_by_rows::<E, NA, NB, NC>(
            &def,
            &ds_frag,
            &k_tile,
            &mut dq_acc,
            BLOCK_KEYS,
            head_dim,
        );
    }

    store_accumulator::<E, NC>(
        &def, &dq_acc, dq, row_base, warp_start, q_len, scale, head_dim, true,
    );
}

/// dK/dV step. Grid: x = key blocks of [`BLOCK_KEYS`], slices = batch * kv_heads over y and z
/// ([`crate::grid`]). Each plane owns 16 keys and walks the query tiles (of every query head of its group) that can see them. Launched
/// unchecked: global accesses are guarded against `q_len`/`kv_len` by the kernel.
#[cube(launch_unchecked)]
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
    scale: f32,
    shift: i32,
    q_len: u32,
    kv_len: u32,
    kv_heads: u32,
    group_size: u32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
) {
    let def = mma_definition::<E>();
    let size!(NA) = def.vector_size(MatrixIdent::A);
    let size!(NB) = def.vector_size(MatrixIdent::B);
    let size!(NC) = def.vector_size(MatrixIdent::Accumulator);
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let query_frags = comptime!(BLOCK_ROWS / FRAG_COLS);
    let out_frags = comptime!(head_dim / FRAG_COLS);
    let stride = comptime!(padded_stride(head_dim));

    let lane = UNIT_POS_PLANE;
    let warp = UNIT_POS / 32;
    let bkv = cube_slice();
    let batch = bkv / kv_heads;
    let kv_head = bkv % kv_heads;
    let q_heads = kv_heads * group_size;
    let key_base = (bkv * kv_len) as usize;
    let block_start = CUBE_POS_X * BLOCK_KEYS as u32;
    let warp_start = block_start + warp * WARP_ROWS as u32;

    let mut k_block = SharedMemory::<E>::new_aligned(comptime!(BLOCK_KEYS * stride), 16usize);
    let mut v_block = SharedMemory::<E>::new_aligned(comptime!(BLOCK_KEYS * stride), 16usize);
    let mut q_tile = SharedMemory::<E>::new_aligned(comptime!(BLOCK_ROWS * stride), 16usize);
    let mut do_tile = SharedMemory::<E>::new_aligned(comptime!(BLOCK_ROWS * stride), 16usize);
    let mut lse_tile = SharedMemory::<f32>::new(BLOCK_ROWS);
    let mut delta_tile = SharedMemory::<f32>::new(BLOCK_ROWS);
    let ready = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    sync_cube();
    stage_rows_async::<E>(
        k,
        key_base * head_dim,
        block_start,
        kv_len,
        &mut k_block,
        BLOCK_KEYS,
        head_dim,
        UNITS,
    );
    stage_rows_async::<E>(
        v,
        key_base * head_dim,
        block_start,
        kv_len,
        &mut v_block,
        BLOCK_KEYS,
        head_dim,
        UNITS,
    );

    // First query each of the lane's two key rows is seen by (query i sees key j iff
    // j <= i + shift), and the first query tile any key of the block is seen by.
    let mut query_floor = Array::<u32>::new(ROW_SLOTS);
    #[unroll]
    for slot in 0..ROW_SLOTS {
        let key = warp_start + slot_row(lane, slot);
        let mut floor = 0u32;
        if causal {
            floor = max(key as i32 - shift, 0i32) as u32;
        }
        // Keys past the chunk see nothing.
        query_floor[slot] = select(key < kv_len, floor, q_len);
    }
    let mut first_tile = 0u32;
    if causal {
        first_tile = min(max(block_start as i32 - shift, 0i32) as u32, q_len) / BLOCK_ROWS as u32;
    }
    let num_tiles = q_len.div_ceil(BLOCK_ROWS as u32);

    let mut dk_acc = zero_accumulator::<E, NC>(&def, out_frags);
    let mut dv_acc = zero_accumulator::<E, NC>(&def, out_frags);
    for g in 0..group_size {
        let q_bh = batch * q_heads + kv_head * group_size + g;
        let row_base = (q_bh * q_len) as usize;
        for tile in first_tile..num_tiles {
            let q_start = tile * BLOCK_ROWS as u32;
            sync_cube();
            stage_rows_async::<E>(
                q,
                row_base * head_dim,
                q_start,
                q_len,
                &mut q_tile,
                BLOCK_ROWS,
                head_dim,
                UNITS,
            );
            stage_rows_async::<E>(
                grad_out,
                row_base * head_dim,
                q_start,
                q_len,
                &mut do_tile,
                BLOCK_ROWS,
                head_dim,
                UNITS,
            );
            if UNIT_POS < BLOCK_ROWS as u32 {
                let row = q_start + UNIT_POS;
                let mut lv = 0.0f32;
                let mut dl = 0.0f32;
                if row < q_len {
                    lv = lse[row_base + row as usize];
                    dl = delta[row_base + row as usize];
                }
                lse_tile[UNIT_POS as usize] = lv;
                delta_tile[UNIT_POS as usize] = dl;
            }
            ready.commit_copy_async();
            ready.arrive_and_wait();
            sync_cube();

            // S^T = K Q^T and dP^T = V dO^T for the plane's 16 keys against the tile's queries.
            let k_frag =
                load_row_fragments::<E, NA>(&def, &k_block, (warp as usize) * WARP_ROWS, head_dim);
            let mut s_acc = zero_accumulator::<E, NC>(&def, query_frags);
            multiply_by_rows_transposed::<E, NA, NB, NC>(
                &def, &k_frag, &q_tile, &mut s_acc, BLOCK_ROWS, head_dim,
            );
            let v_frag =
                load_row_fragments::<E, NA>(&def, &v_block, (warp as usize) * WARP_ROWS, head_dim);
            let mut dp_acc = zero_accumulator::<E, NC>(&def, query_frags);
            multiply_by_rows_transposed::<E, NA, NB, NC>(
                &def,
                &v_frag,
                &do_tile,
                &mut dp_acc,
                BLOCK_ROWS,
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
                        let slot = n / 2;
                        let col = nt * FRAG_COLS + accumulator_col(lane, n) as usize;
                        let query = q_start + col as u32;
                        let visible = query >= query_floor[slot] && query < q_len;
                        let p = select(
                            visible,
                            probability_from_lse(s_reg[e] * scale, lse_tile[col]),
                            0.0f32,
                        );
                        s_reg[e] = p;
                        dp_reg[e] = p * (dp_reg[e] - delta_tile[col]);
                    }
                    s_acc[nt * vc + i] = s_reg;
                    dp_acc[nt * vc + i] = dp_reg;
                }
            }
            let p_frag = accumulator_to_fragments::<E, NA, NC>(&def, &s_acc, BLOCK_ROWS);
            multiply_by_rows::<E, NA, NB, NC>(
                &def,
                &p_frag,
                &do_tile,
                &mut dv_acc,
                BLOCK_ROWS,
                head_dim,
            );
            let ds_frag = accumulator_to_fragments::<E, NA, NC>(&def, &dp_acc, BLOCK_ROWS);
            multiply_by_rows::<E, NA, NB, NC>(
                &def,
                &ds_frag,
                &q_tile,
                &mut dk_acc,
                BLOCK_ROWS,
                head_dim,
            );
        }
    }

    store_accumulator::<E, NC>(
        &def, &dk_acc, dk, key_base, warp_start, kv_len, scale, head_dim, true,
    );
    store_accumulator::<E, NC>(
        &def, &dv_acc, dv, key_base, warp_start, kv_len, 1.0f32, head_dim, true,
    );
}
