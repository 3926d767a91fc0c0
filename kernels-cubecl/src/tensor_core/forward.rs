//! Tensor-core forward step: FlashAttention-2 style, one cube of four planes takes 64 query rows
//! (16 per plane), walks the visible key/value tiles of 64 rows staged in shared memory, keeps
//! scores, probabilities and the output accumulator in `mma` registers, and reads/writes the
//! running state `(o, m, l)` like the portable kernel.

use cubecl::cmma::MatrixIdent;
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::fragments::{accumulator_col, mma_definition, FRAG_COLS, WARP_ROWS};
use super::tiles::{padded_stride, quad_max, quad_sum, stage_rows_async, ROW_SLOTS};
use super::warp_tile::{
    accumulator_to_fragments, load_accumulator, load_row_fragments, multiply_by_rows,
    multiply_by_rows_transposed, store_accumulator, zero_accumulator,
};
use crate::geometry::{query_block, row_key_limit};
use crate::stats::{rescale_factor, unnormalised_weight};

/// Planes per cube.
pub const PLANES: usize = 4;
/// Query rows per cube.
pub const BLOCK_ROWS: usize = PLANES * WARP_ROWS;
/// Key rows per shared-memory tile.
pub const BLOCK_KEYS: usize = 64;
/// Units per cube.
pub const UNITS: usize = PLANES * 32;

/// Row `slot` (0 or 1) of the accumulator rows a lane holds, relative to the plane's first row.
#[cube]
pub fn slot_row(lane: u32, #[comptime] slot: usize) -> u32 {
    lane / 4 + (slot * 8) as u32
}

/// Grid: x = query blocks of [`BLOCK_ROWS`], slices = batch * q_heads over y and z
/// ([`crate::grid`]); cube = [`UNITS`] units.
/// Launched unchecked: every global access is guarded by the kernel itself (rows past `q_len`
/// or `kv_len` are skipped or zero-filled) and shared-memory indices are in range by construction.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn forward_step_mma<E: Float>(
    q: &Array<E>,
    k: &Array<E>,
    v: &Array<E>,
    o: &mut Array<f32>,
    m: &mut Array<f32>,
    l: &mut Array<f32>,
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
    let k_ready = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    let v_ready = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    sync_cube();

    // Query fragments: stage the block's rows through the key tile, then `ldmatrix`.
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
    k_ready.commit_copy_async();
    k_ready.arrive_and_wait();
    let q_frag = load_row_fragments::<E, NA>(&def, &k_tile, (warp as usize) * WARP_ROWS, head_dim);

    // Running state: the output accumulator in registers, and for each of the lane's two rows
    // the running max and a lane-partial running sum (reduced over the quad at the end).
    #[allow(clippy::manual_is_multiple_of)]
    let first_in_quad = lane % 4 == 0;
    let mut o_acc = load_accumulator::<E, NC>(&def, o, row_base, warp_start, q_len, head_dim);
    let mut m_row = Array::<f32>::new(ROW_SLOTS);
    let mut l_row = Array::<f32>::new(ROW_SLOTS);
    // Exclusive bound on the keys each of the lane's two rows sees: one compare per score.
    let mut key_limit = Array::<u32>::new(ROW_SLOTS);
    #[unroll]
    for slot in 0..ROW_SLOTS {
        let row = warp_start + slot_row(lane, slot);
        let mut mv = 0.0f32;
        let mut lv = 0.0f32;
        if row < q_len {
            mv = m[row_base + row as usize];
            if first_in_quad {
                lv = l[row_base + row as usize];
            }
        }
        m_row[slot] = mv;
        l_row[slot] = lv;
        let mut limit = kv_end;
        if causal {
            limit = row_key_limit(row, kv_end, shift);
        }
        key_limit[slot] = limit;
    }

    // Software pipeline over key tiles (two mbarriers, one per operand):
    //   wait K(t) | issue V(t) | S = Q K(t)^T | sync | issue K(t+1) | softmax | wait V(t) | O += P V
    // so the copy of V overlaps the score matmul and the copy of the next K the softmax and P V.
    let num_tiles = kv_end.div_ceil(BLOCK_KEYS as u32);
    sync_cube();
    if num_tiles > 0 {
        stage_rows_async::<E>(
            k,
            kv_base,
            0,
            kv_len,
            &mut k_tile,
            BLOCK_KEYS,
            head_dim,
            UNITS,
        );
        k_ready.commit_copy_async();
    }
    for tile in 0..num_tiles {
        let key_start = tile * BLOCK_KEYS as u32;
        // Every unit arrives here after its P V of the previous tile: V's buffer is free.
        k_ready.arrive_and_wait();
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
        v_ready.commit_copy_async();

        let mut s_acc = zero_accumulator::<E, NC>(&def, key_frags);
        multiply_by_rows_transposed::<E, NA, NB, NC>(
            &def, &q_frag, &k_tile, &mut s_acc, BLOCK_KEYS, head_dim,
        );

        // Every plane is done reading K(t): prefetch K(t + 1) while the softmax and P V run.
        sync_cube();
        if tile + 1 < num_tiles {
            stage_rows_async::<E>(
                k,
                kv_base,
                key_start + BLOCK_KEYS as u32,
                kv_len,
                &mut k_tile,
                BLOCK_KEYS,
                head_dim,
                UNITS,
            );
            k_ready.commit_copy_async();
        }

        // Scale, and the new running max of each row over its visible keys (branch-free: a
        // divergent `if` per score costs more than the compare).
        let mut new_max = Array::<f32>::new(ROW_SLOTS);
        #[unroll]
        for slot in 0..ROW_SLOTS {
            new_max[slot] = m_row[slot];
        }
        #[unroll]
        for nt in 0..key_frags {
            #[unroll]
            for i in 0..vc {
                let mut reg = s_acc[nt * vc + i];
                #[unroll]
                for e in 0..sc {
                    let n = i * sc + e;
                    let slot = n / 2;
                    let key = key_start + (nt * FRAG_COLS) as u32 + accumulator_col(lane, n);
                    let val = reg[e] * scale;
                    reg[e] = val;
                    new_max[slot] = select(
                        key < key_limit[slot],
                        max(new_max[slot], val),
                        new_max[slot],
                    );
                }
                s_acc[nt * vc + i] = reg;
            }
        }
        let mut alpha = Array::<f32>::new(ROW_SLOTS);
        #[unroll]
        for slot in 0..ROW_SLOTS {
            let reduced = quad_max(new_max[slot]);
            alpha[slot] = rescale_factor(m_row[slot], reduced);
            l_row[slot] *= alpha[slot];
            m_row[slot] = reduced;
        }
        #[unroll]
        for t in 0..out_frags {
            #[unroll]
            for i in 0..vc {
                let mut reg = o_acc[t * vc + i];
                #[unroll]
                for e in 0..sc {
                    reg[e] *= alpha[(i * sc + e) / 2];
                }
                o_acc[t * vc + i] = reg;
            }
        }

        // Probabilities in place of the scores, then into A fragments.
        #[unroll]
        for nt in 0..key_frags {
            #[unroll]
            for i in 0..vc {
                let mut reg = s_acc[nt * vc + i];
                #[unroll]
                for e in 0..sc {
                    let n = i * sc + e;
                    let slot = n / 2;
                    let key = key_start + (nt * FRAG_COLS) as u32 + accumulator_col(lane, n);
                    let p = select(
                        key < key_limit[slot],
                        unnormalised_weight(reg[e], m_row[slot]),
                        0.0f32,
                    );
                    l_row[slot] += p;
                    reg[e] = p;
                }
                s_acc[nt * vc + i] = reg;
            }
        }
        let p_frag = accumulator_to_fragments::<E, NA, NC>(&def, &s_acc, BLOCK_KEYS);

        v_ready.arrive_and_wait();
        multiply_by_rows::<E, NA, NB, NC>(&def, &p_frag, &v_tile, &mut o_acc, BLOCK_KEYS, head_dim);
    }

    // Write the state back.
    store_accumulator::<E, NC>(
        &def, &o_acc, o, row_base, warp_start, q_len, 1.0f32, head_dim, false,
    );
    #[unroll]
    for slot in 0..ROW_SLOTS {
        let total = quad_sum(l_row[slot]);
        let row = warp_start + slot_row(lane, slot);
        if row < q_len && first_in_quad {
            m[row_base + row as usize] = m_row[slot];
            l[row_base + row as usize] = total;
        }
    }
}
