//! Portable forward step: updates `(o, m, l)` of each query row with one key/value chunk.

use cubecl::prelude::*;

use super::{ROWS_PER_CUBE, TILE_ROWS};
use crate::geometry::{key_visible, query_block};
use crate::stats::{rescale_factor, unnormalised_weight};

/// One cube = `ROWS_PER_CUBE` query rows of one (batch, query head); slices = batch * q_heads
/// (see [`crate::grid`]).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn forward_step_portable<E: Float>(
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
    key_begin: u32,
    key_end: u32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
) {
    let block = query_block(
        q_len,
        kv_len,
        q_heads,
        group_size,
        shift,
        ROWS_PER_CUBE,
        head_dim,
        causal,
    );
    let kv_base = block.kv_base;
    let kv_end = block.kv_end;
    let row = block.start + UNIT_POS;
    let active = row < q_len;
    let row_index = block.row_base + row as usize;

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
    let key_stop = min(kv_end, key_end);
    if active && key_begin < key_stop {
        let num_tiles = (key_stop - key_begin).div_ceil(TILE_ROWS as u32);
        for tile in 0..num_tiles {
            let tile_start = key_begin + tile * TILE_ROWS as u32;
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
                if key_visible(row, key, shift, causal) {
                    tile_max = max(tile_max, dot);
                }
                scores[j as usize] = dot;
            }
            let alpha = rescale_factor(m_i, tile_max);
            l_i *= alpha;
            for d in 0..head_dim {
                acc[d] *= alpha;
            }
            for j in 0..tile_len {
                let key = tile_start + j;
                if key_visible(row, key, shift, causal) {
                    let p = unnormalised_weight(scores[j as usize], tile_max);
                    l_i += p;
                    let at = kv_base + key as usize * head_dim;
                    for d in 0..head_dim {
                        acc[d] += p * f32::cast_from(v[at + d]);
                    }
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
