//! Portable backward step for one (query chunk, key chunk) pair, using the stored log-sum-exp:
//! the forward is never recomputed. `dq` is accumulated per query row, `dk`/`dv` per key row
//! (summed over the query heads of its group), all in f32.

use cubecl::prelude::*;

use super::ROWS_PER_CUBE;
use crate::attention_params::AttentionParams;
use crate::geometry::query_block;
use crate::grid::cube_slice;
use crate::mask::{key_query_range, row_key_range};
use crate::stats::probability_from_lse;

/// Shared memory of [`backward_dq_portable`] with tiles of `tile_rows` keys: the K and V tiles.
pub fn dq_shared_bytes(tile_rows: usize, head_dim: usize) -> usize {
    2 * tile_rows * head_dim * size_of::<f32>()
}

/// Shared memory of [`backward_dkdv_portable`] with tiles of `tile_rows` queries: the Q and dO
/// tiles and the tile's lse and delta.
pub fn dkdv_shared_bytes(tile_rows: usize, head_dim: usize) -> usize {
    (2 * tile_rows * head_dim + 2 * tile_rows) * size_of::<f32>()
}

/// dQ step: one unit per query row, key/value tiles of `tile_rows` keys in shared memory (the
/// host picks the tile to fit the device, see [`dq_shared_bytes`]). Grid: see [`crate::grid`].
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn backward_dq_portable<E: Float>(
    q: &Array<E>,
    k: &Array<E>,
    v: &Array<E>,
    grad_out: &Array<E>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    dq: &mut Array<f32>,
    docs: &Array<u32>,
    params: &AttentionParams,
    key_begin: u32,
    key_end: u32,
    #[comptime] tile_rows: usize,
) {
    let head_dim = comptime!(params.head_dim);
    let mask = comptime!(params.mask_kind);
    let (scale, q_len, kv_len) = (params.scale, params.q_len, params.kv_len);
    let bounds = &params.bounds;
    let block = query_block(
        q_len,
        kv_len,
        params.heads,
        params.group_size,
        0i32,
        ROWS_PER_CUBE,
        head_dim,
        false,
    );
    let kv_base = block.kv_base;
    let row = block.start + UNIT_POS;
    let active = row < q_len;
    let row_index = block.row_base + row as usize;
    // Each row's visible keys, and the cube's: from its first row's first key to its last row's
    // last (both ends never decrease with the row).
    let last_row = min(block.start + ROWS_PER_CUBE as u32, q_len) - 1;
    let (cube_begin, _) = row_key_range(docs, bounds, block.batch, block.start, kv_len, mask);
    let (_, cube_end) = row_key_range(docs, bounds, block.batch, last_row, kv_len, mask);
    let (row_begin, row_end) =
        row_key_range(docs, bounds, block.batch, min(row, last_row), kv_len, mask);

    let mut q_row = Array::<f32>::new(head_dim);
    let mut do_row = Array::<f32>::new(head_dim);
    let mut acc = Array::<f32>::new(head_dim);
    let mut lse_i = 0.0f32;
    let mut delta_i = 0.0f32;
    if active {
        for d in 0..head_dim {
            let at = row_index * head_dim + d;
            q_row[d] = f32::cast_from(q[at]) * scale;
            do_row[d] = f32::cast_from(grad_out[at]);
            acc[d] = 0.0f32;
        }
        lse_i = lse[row_index];
        delta_i = delta[row_index];
    }

    let mut k_tile = SharedMemory::<f32>::new(tile_rows * head_dim);
    let mut v_tile = SharedMemory::<f32>::new(tile_rows * head_dim);
    // The host bounds `[key_begin, key_end)` per launch (see `launch::portable_span`).
    let key_first = max(cube_begin, key_begin);
    let key_stop = min(cube_end, key_end);
    let mut num_tiles = 0u32;
    if key_first < key_stop {
        num_tiles = (key_stop - key_first).div_ceil(tile_rows as u32);
    }
    let loads_per_unit = comptime!(tile_rows * head_dim / ROWS_PER_CUBE);

    for tile in 0..num_tiles {
        let tile_start = key_first + tile * tile_rows as u32;
        sync_cube();
        for r in 0..loads_per_unit {
            let idx = r * ROWS_PER_CUBE + UNIT_POS as usize;
            let key = tile_start as usize + idx / head_dim;
            let mut kval = 0.0f32;
            let mut vval = 0.0f32;
            if key < kv_len as usize {
                let at = kv_base + key * head_dim + idx % head_dim;
                kval = f32::cast_from(k[at]);
                vval = f32::cast_from(v[at]);
            }
            k_tile[idx] = kval;
            v_tile[idx] = vval;
        }
        sync_cube();

        if active {
            for j in 0..tile_rows {
                let key = tile_start + j as u32;
                if key < key_stop && key >= row_begin && key < row_end {
                    let mut score = 0.0f32;
                    let mut dp = 0.0f32;
                    for d in 0..head_dim {
                        score += q_row[d] * k_tile[j * head_dim + d];
                        dp += do_row[d] * v_tile[j * head_dim + d];
                    }
                    let p = probability_from_lse(score, lse_i);
                    let ds = p * (dp - delta_i) * scale;
                    for d in 0..head_dim {
                        acc[d] += ds * k_tile[j * head_dim + d];
                    }
                }
            }
        }
    }

    if active {
        for d in 0..head_dim {
            dq[row_index * head_dim + d] += acc[d];
        }
    }
}

/// dK/dV step: one unit per key row, looping over the query heads of its group and over query
/// tiles of `tile_rows` rows (q, dO, lse, delta) staged in shared memory (see
/// [`dkdv_shared_bytes`]). Grid: x = key blocks, slices = batch * kv_heads (see [`crate::grid`]).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn backward_dkdv_portable<E: Float>(
    q: &Array<E>,
    k: &Array<E>,
    v: &Array<E>,
    grad_out: &Array<E>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    dk: &mut Array<f32>,
    dv: &mut Array<f32>,
    docs: &Array<u32>,
    params: &AttentionParams,
    query_begin: u32,
    query_end: u32,
    #[comptime] tile_rows: usize,
) {
    let head_dim = comptime!(params.head_dim);
    let mask = comptime!(params.mask_kind);
    let (scale, q_len, kv_len) = (params.scale, params.q_len, params.kv_len);
    let (kv_heads, group_size) = (params.heads, params.group_size);
    let bounds = &params.bounds;
    let bkv = cube_slice();
    let batch = bkv / kv_heads;
    let kv_head = bkv % kv_heads;
    let q_heads = kv_heads * group_size;

    let block_start = CUBE_POS_X * ROWS_PER_CUBE as u32;
    let key = block_start + UNIT_POS;
    let active = key < kv_len;
    let key_index = (bkv * kv_len + key) as usize;

    // The queries that see each key, and the cube's: from its first key's first query to its
    // last key's last (both ends never decrease with the key).
    let last_key = min(block_start + ROWS_PER_CUBE as u32, kv_len) - 1;
    let (q_begin, _) = key_query_range(docs, bounds, batch, block_start, q_len, mask);
    let (_, q_end) = key_query_range(docs, bounds, batch, last_key, q_len, mask);
    let (key_q_begin, key_q_end) =
        key_query_range(docs, bounds, batch, min(key, last_key), q_len, mask);

    let mut k_row = Array::<f32>::new(head_dim);
    let mut v_row = Array::<f32>::new(head_dim);
    let mut dk_acc = Array::<f32>::new(head_dim);
    let mut dv_acc = Array::<f32>::new(head_dim);
    if active {
        for d in 0..head_dim {
            let at = key_index * head_dim + d;
            k_row[d] = f32::cast_from(k[at]) * scale;
            v_row[d] = f32::cast_from(v[at]);
            dk_acc[d] = 0.0f32;
            dv_acc[d] = 0.0f32;
        }
    }

    let mut q_tile = SharedMemory::<f32>::new(tile_rows * head_dim);
    let mut do_tile = SharedMemory::<f32>::new(tile_rows * head_dim);
    let mut lse_tile = SharedMemory::<f32>::new(tile_rows);
    let mut delta_tile = SharedMemory::<f32>::new(tile_rows);
    let loads_per_unit = comptime!(tile_rows * head_dim / ROWS_PER_CUBE);
    // The host bounds `[query_begin, query_end)` per launch (see `launch::portable_span`).
    let q_first = max(q_begin, query_begin);
    let q_stop = min(q_end, query_end);
    let mut num_tiles = 0u32;
    if q_first < q_stop {
        num_tiles = (q_stop - q_first).div_ceil(tile_rows as u32);
    }

    for g in 0..group_size {
        let q_bh = batch * q_heads + kv_head * group_size + g;
        let q_base = (q_bh * q_len) as usize;
        for tile in 0..num_tiles {
            let tile_start = q_first + tile * tile_rows as u32;
            sync_cube();
            for r in 0..loads_per_unit {
                let idx = r * ROWS_PER_CUBE + UNIT_POS as usize;
                let qrow = tile_start as usize + idx / head_dim;
                let mut qval = 0.0f32;
                let mut doval = 0.0f32;
                if qrow < q_stop as usize {
                    let at = (q_base + qrow) * head_dim + idx % head_dim;
                    qval = f32::cast_from(q[at]);
                    doval = f32::cast_from(grad_out[at]);
                }
                q_tile[idx] = qval;
                do_tile[idx] = doval;
            }
            if UNIT_POS < tile_rows as u32 {
                let qrow = tile_start + UNIT_POS;
                let mut lse_val = 0.0f32;
                let mut delta_val = 0.0f32;
                if qrow < q_stop {
                    lse_val = lse[q_base + qrow as usize];
                    delta_val = delta[q_base + qrow as usize];
                }
                lse_tile[UNIT_POS as usize] = lse_val;
                delta_tile[UNIT_POS as usize] = delta_val;
            }
            sync_cube();

            if active {
                for i in 0..tile_rows {
                    let qrow = tile_start + i as u32;
                    if qrow < q_stop && qrow >= key_q_begin && qrow < key_q_end {
                        let mut score = 0.0f32;
                        let mut dp = 0.0f32;
                        for d in 0..head_dim {
                            score += q_tile[i * head_dim + d] * k_row[d];
                            dp += do_tile[i * head_dim + d] * v_row[d];
                        }
                        let p = probability_from_lse(score, lse_tile[i]);
                        let ds = p * (dp - delta_tile[i]) * scale;
                        for d in 0..head_dim {
                            dv_acc[d] += p * do_tile[i * head_dim + d];
                            dk_acc[d] += ds * q_tile[i * head_dim + d];
                        }
                    }
                }
            }
        }
    }

    if active {
        for d in 0..head_dim {
            let at = key_index * head_dim + d;
            dk[at] += dk_acc[d];
            dv[at] += dv_acc[d];
        }
    }
}
