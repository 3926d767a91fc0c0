//! Portable forward step: updates `(o, m, l)` of each query row with one key/value chunk.

use cubecl::prelude::*;

use super::{ROWS_PER_CUBE, TILE_ROWS};
use crate::attention_params::AttentionParams;
use crate::geometry::query_block;
use crate::mask::row_key_range;
use crate::stats::{rescale_factor, unnormalised_weight};

/// One cube = `ROWS_PER_CUBE` query rows of one (batch, query head); slices = batch * q_heads
/// (see [`crate::grid`]). Each row walks only its visible keys, one contiguous range under every
/// mask (see [`crate::mask`]): no key is compared against the mask.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn forward_step_portable<E: Float>(
    q: &Array<E>,
    k: &Array<E>,
    v: &Array<E>,
    o: &mut Array<f32>,
    m: &mut Array<f32>,
    l: &mut Array<f32>,
    docs: &Array<u32>,
    params: &AttentionParams,
    key_begin: u32,
    key_end: u32,
) {
    let head_dim = comptime!(params.head_dim);
    let mask = comptime!(params.mask_kind);
    let (scale, q_len, kv_len) = (params.scale, params.q_len, params.kv_len);
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
    let mut visible_begin = 0u32;
    let mut visible_end = 0u32;
    if active {
        let (lo, hi) = row_key_range(docs, &params.bounds, block.batch, row, kv_len, mask);
        visible_begin = lo;
        visible_end = hi;
    }

    let mut q_row = Array::<f32>::new(head_dim);
    let mut acc = Array::<f32>::new(head_dim);
    let mut scores = Array::<f32>::new(TILE_ROWS);
    let mut m_i = 0.0f32;
    let mut l_i = 0.0f32;
    if active {
        for d in 0..head_dim {
            q_row[d] = f32::cast_from(q[row_index * head_dim + d]) * scale;
            acc[d] = o[row_index * head_dim + d];
        }
        m_i = m[row_index];
        l_i = l[row_index];
    }

    // Keys are read straight from global memory (cached); this variant exists for portability,
    // not speed. The host bounds `[key_begin, key_end)` per launch (see `launch::portable_span`).
    let key_first = max(visible_begin, key_begin);
    let key_stop = min(visible_end, key_end);
    if active && key_first < key_stop {
        let num_tiles = (key_stop - key_first).div_ceil(TILE_ROWS as u32);
        for tile in 0..num_tiles {
            let tile_start = key_first + tile * TILE_ROWS as u32;
            // Runtime-bounded key loops: with a compile-time bound of 16, llvmpipe unrolls them
            // around the head_dim loops and compiles for half a minute at head dim 32.
            let tile_len = min(key_stop - tile_start, TILE_ROWS as u32);
            let mut tile_max = m_i;
            for j in 0..tile_len {
                let key = tile_start + j;
                let at = kv_base + key as usize * head_dim;
                let mut dot = 0.0f32;
                for d in 0..head_dim {
                    dot += q_row[d] * f32::cast_from(k[at + d]);
                }
                tile_max = max(tile_max, dot);
                scores[j as usize] = dot;
            }
            let alpha = rescale_factor(m_i, tile_max);
            l_i *= alpha;
            for d in 0..head_dim {
                acc[d] *= alpha;
            }
            for j in 0..tile_len {
                let key = tile_start + j;
                let p = unnormalised_weight(scores[j as usize], tile_max);
                l_i += p;
                let at = kv_base + key as usize * head_dim;
                for d in 0..head_dim {
                    acc[d] += p * f32::cast_from(v[at + d]);
                }
            }
            m_i = tile_max;
        }
    }

    if active {
        for d in 0..head_dim {
            o[row_index * head_dim + d] = acc[d];
        }
        m[row_index] = m_i;
        l[row_index] = l_i;
    }
}
