//! The matrix products one plane (warp) computes on its 16 rows, shared by the forward and the
//! backward kernels. Operand tiles live in padded shared memory; results stay in `mma` registers.

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::*;

use super::fragments::{
    accumulator_col, accumulator_row, mma_accumulate, FRAG_COLS, FRAG_K, WARP_ROWS,
};
use super::tiles::{
    a_lane_offset, load_matrix_x4, padded_stride, pair_lane_offset, COPY_ELEMS, ROW_SLOTS,
};

/// `acc` tiles `acc_at` and the next one `+= a[a_at..] x` the two B fragments held back to back
/// in `pair` (one `ldmatrix.x4`).
#[cube]
pub fn accumulate_pair<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    a: &Array<Vector<E, NA>>,
    a_at: usize,
    pair: &Array<Vector<E, NB>>,
    acc: &mut Array<Vector<f32, NC>>,
    acc_at: usize,
) {
    let vb = def.vectors_per_lane(MatrixIdent::B);
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let mut b0 = Array::<Vector<E, NB>>::new(vb);
    let mut b1 = Array::<Vector<E, NB>>::new(vb);
    #[unroll]
    for i in 0..vb {
        b0[i] = pair[i];
        b1[i] = pair[vb + i];
    }
    mma_accumulate::<E, NA, NB, NC>(def, a, a_at, &b0, 0, acc, acc_at);
    mma_accumulate::<E, NA, NB, NC>(def, a, a_at, &b1, 0, acc, acc_at + vc);
}

/// `acc += A . T^T` for `m_tiles` 16-row tiles of `A` (rows `a_row0 + 16 * mt` of the staged
/// tile `a`) against `cols` staged rows `T` of length `head_dim` from row `t_row0` of `tile`
/// (scores against keys, or against queries in the dK/dV kernel). `acc` holds
/// `m_tiles x cols / 8` accumulator tiles (tile `(mt, c)` at `(mt * cols / 8 + c) * vc`) and must
/// be zeroed by the caller for a fresh product.
///
/// Each k-step loads the A fragments of every row tile once and each `ldmatrix.x4` of `T` feeds
/// `2 * m_tiles` `mma`s.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn multiply_by_rows_transposed<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    a: &SharedMemory<E>,
    a_row0: usize,
    tile: &SharedMemory<E>,
    t_row0: usize,
    acc: &mut Array<Vector<f32, NC>>,
    #[comptime] m_tiles: usize,
    #[comptime] cols: usize,
    #[comptime] head_dim: usize,
) {
    let va = def.vectors_per_lane(MatrixIdent::A);
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let k_steps = comptime!(head_dim / FRAG_K);
    let frags = comptime!(cols / FRAG_COLS);
    let stride = comptime!(padded_stride(head_dim));
    // Per-lane bases (see `a_lane_offset`, `pair_lane_offset`); every load below adds only a
    // compile-time offset to one of them.
    let a_base = a_row0 * stride + a_lane_offset(UNIT_POS_PLANE, head_dim);
    let t_base = t_row0 * stride + pair_lane_offset(UNIT_POS_PLANE, head_dim, false);
    #[unroll]
    for ks in 0..k_steps {
        let mut a_frags = Array::<Vector<E, NA>>::new(comptime!(m_tiles * va));
        #[unroll]
        for mt in 0..m_tiles {
            let regs = load_matrix_x4::<E, NA>(
                def,
                a,
                a_base + comptime!(mt * WARP_ROWS * stride + ks * FRAG_K),
                MatrixIdent::A,
                false,
            );
            #[unroll]
            for i in 0..va {
                a_frags[mt * va + i] = regs[i];
            }
        }
        #[unroll]
        for pair in 0..comptime!(cols / FRAG_COLS / 2) {
            // Registers 0-1: the B fragment of column tile 2 * pair, 2-3: of 2 * pair + 1.
            let regs = load_matrix_x4::<E, NB>(
                def,
                tile,
                t_base + comptime!(2 * pair * FRAG_COLS * stride + ks * FRAG_K),
                MatrixIdent::B,
                false,
            );
            #[unroll]
            for mt in 0..m_tiles {
                accumulate_pair::<E, NA, NB, NC>(
                    def,
                    &a_frags,
                    mt * va,
                    &regs,
                    acc,
                    (mt * frags + 2 * pair) * vc,
                );
            }
        }
    }
}

/// `acc (m_tiles x 16 x head_dim) += P . T` where `P` (`m_tiles x 16 x rows`) is given as A
/// fragments (see [`accumulator_to_fragments`]) and `T` is `rows` staged rows of length
/// `head_dim` from row `t_row0` of `tile` (P V in the forward, dS K for dQ). Each transposed
/// `ldmatrix.x4` of `T` feeds `2 * m_tiles` `mma`s.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn multiply_by_rows<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    p: &Array<Vector<E, NA>>,
    tile: &SharedMemory<E>,
    t_row0: usize,
    acc: &mut Array<Vector<f32, NC>>,
    #[comptime] m_tiles: usize,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
) {
    multiply_by_row_columns::<E, NA, NB, NC>(
        def, p, tile, t_row0, 0usize, acc, m_tiles, rows, head_dim, head_dim,
    );
}

/// [`multiply_by_rows`] on `cols` columns of `T` from column `t_col0` (a multiple of 16): `acc`
/// is `m_tiles x 16 x cols` (tile `(mt, c)` at `(mt * cols / 8 + c) * vc`), `T`'s staged rows
/// are `head_dim` long (P^T dO for a plane's share of dV, dS^T Q of dK, dS K of dQ).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn multiply_by_row_columns<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    p: &Array<Vector<E, NA>>,
    tile: &SharedMemory<E>,
    t_row0: usize,
    t_col0: usize,
    acc: &mut Array<Vector<f32, NC>>,
    #[comptime] m_tiles: usize,
    #[comptime] rows: usize,
    #[comptime] cols: usize,
    #[comptime] head_dim: usize,
) {
    let va = def.vectors_per_lane(MatrixIdent::A);
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let k_steps = comptime!(rows / FRAG_K);
    let out_frags = comptime!(cols / FRAG_COLS);
    let stride = comptime!(padded_stride(head_dim));
    let t_base = t_row0 * stride + t_col0 + pair_lane_offset(UNIT_POS_PLANE, head_dim, true);
    // k-steps outermost: two `mma`s into the same accumulator tile are `2 * m_tiles * cols / 8`
    // `mma`s apart, not `2 * m_tiles` (an `mma` waits on the previous one into its accumulator).
    #[unroll]
    for kk in 0..k_steps {
        #[unroll]
        for pair in 0..comptime!(cols / FRAG_COLS / 2) {
            // Registers 0-1: the B fragment of output tile 2 * pair, 2-3: of 2 * pair + 1.
            let regs = load_matrix_x4::<E, NB>(
                def,
                tile,
                t_base + comptime!(kk * FRAG_K * stride + 2 * pair * FRAG_COLS),
                MatrixIdent::B,
                true,
            );
            #[unroll]
            for mt in 0..m_tiles {
                accumulate_pair::<E, NA, NB, NC>(
                    def,
                    p,
                    (mt * k_steps + kk) * va,
                    &regs,
                    acc,
                    (mt * out_frags + 2 * pair) * vc,
                );
            }
        }
    }
}

/// A fragments of an `m_tiles x 16` by `k_steps x 16` matrix `A` staged in `tile` (rows
/// `width` elements long, padded), in the layout [`multiply_by_row_columns`] takes (fragment
/// `(mt, kk)` at `(mt * k_steps + kk) * va`). `A`'s element `(m, k)` is the staged element at
/// row `a_row0 + m`, column `a_col0 + k`; with `transposed`, at row `a_col0 + k`, column
/// `a_row0 + m` (the tile holds `A^T`; `.trans` loads).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn load_fragments<E: Float, NA: Size>(
    def: &MmaDefinition<E, E, f32>,
    tile: &SharedMemory<E>,
    a_row0: usize,
    a_col0: usize,
    #[comptime] m_tiles: usize,
    #[comptime] k_steps: usize,
    #[comptime] width: usize,
    #[comptime] transposed: bool,
) -> Array<Vector<E, NA>> {
    let va = def.vectors_per_lane(MatrixIdent::A);
    let stride = comptime!(padded_stride(width));
    let lane = UNIT_POS_PLANE;
    let mut frags = Array::<Vector<E, NA>>::new(comptime!(m_tiles * k_steps * va));
    let mut base = a_row0 * stride + a_col0 + a_lane_offset(lane, width);
    if transposed {
        base = a_col0 * stride + a_row0 + pair_lane_offset(lane, width, false);
    }
    #[unroll]
    for mt in 0..m_tiles {
        #[unroll]
        for kk in 0..k_steps {
            let offset = comptime!(if transposed {
                kk * FRAG_K * stride + mt * WARP_ROWS
            } else {
                mt * WARP_ROWS * stride + kk * FRAG_K
            });
            let regs =
                load_matrix_x4::<E, NA>(def, tile, base + offset, MatrixIdent::A, transposed);
            #[unroll]
            for i in 0..va {
                frags[(mt * k_steps + kk) * va + i] = regs[i];
            }
        }
    }
    frags
}

/// Stores `m_tiles x 16 x cols` accumulators (laid out as in [`multiply_by_rows_transposed`]),
/// converted to `E`, into a staged tile with rows `width` elements long (padded), from row
/// `row0` and column `col0`. With `stmatrix` (sm_90 and later) each 16 x 16 block is one
/// `stmatrix.x4` of its A fragment (see [`accumulator_to_fragments`]), the inverse of the
/// `ldmatrix.x4` that reads it back, at the same per-lane address: one instruction per 8 values
/// of a lane; without, the values are stored one by one.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn store_to_tile<E: Float, NA: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    acc: &Array<Vector<f32, NC>>,
    tile: &mut SharedMemory<E>,
    row0: usize,
    col0: usize,
    #[comptime] m_tiles: usize,
    #[comptime] cols: usize,
    #[comptime] width: usize,
    #[comptime] stmatrix: bool,
) {
    let stride = comptime!(padded_stride(width));
    let lane = UNIT_POS_PLANE;
    if stmatrix {
        let va = def.vectors_per_lane(MatrixIdent::A);
        let steps = comptime!(cols / FRAG_K);
        let frags = accumulator_to_fragments::<E, NA, NC>(def, acc, m_tiles, cols);
        let base = row0 * stride + col0 + a_lane_offset(lane, width);
        #[unroll]
        for mt in 0..m_tiles {
            #[unroll]
            for kk in 0..steps {
                let mut regs = Array::<Vector<E, NA>>::new(va);
                #[unroll]
                for i in 0..va {
                    regs[i] = frags[(mt * steps + kk) * va + i];
                }
                let at = base + comptime!(mt * WARP_ROWS * stride + kk * FRAG_K);
                def.store_matrix::<E, NA>(
                    &mut tile.slice_mut(at, at + COPY_ELEMS),
                    &regs,
                    MatrixIdent::A,
                    4usize,
                    false,
                );
            }
        }
    } else {
        let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
        let sc = def.vector_size(MatrixIdent::Accumulator);
        let frags = comptime!(cols / FRAG_COLS);
        let base = row0 * stride + col0;
        #[unroll]
        for mt in 0..m_tiles {
            #[unroll]
            for nt in 0..frags {
                #[unroll]
                for i in 0..vc {
                    let reg = acc[(mt * frags + nt) * vc + i];
                    #[unroll]
                    for e in 0..sc {
                        let n = i * sc + e;
                        let at = base
                            + (mt * WARP_ROWS + accumulator_row(lane, n) as usize) * stride
                            + nt * FRAG_COLS
                            + accumulator_col(lane, n) as usize;
                        tile[at] = E::cast_from(reg[e]);
                    }
                }
            }
        }
    }
}

/// Converts `m_tiles` 16 x `cols` f32 accumulators into A fragments of element type `E` covering
/// the same matrices (fragment `(mt, kk)` at `(mt * cols / 16 + kk) * va`): two adjacent 8-column
/// accumulator tiles make one 16-column A fragment (see the layout facts in [`super::fragments`]).
#[cube]
pub fn accumulator_to_fragments<E: Float, NA: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    acc: &Array<Vector<f32, NC>>,
    #[comptime] m_tiles: usize,
    #[comptime] cols: usize,
) -> Array<Vector<E, NA>> {
    let va = def.vectors_per_lane(MatrixIdent::A);
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sa = def.vector_size(MatrixIdent::A);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let steps = comptime!(cols / FRAG_K);
    let frags = comptime!(cols / FRAG_COLS);
    let mut out = Array::<Vector<E, NA>>::new(comptime!(m_tiles * steps * va));
    #[unroll]
    for mt in 0..m_tiles {
        #[unroll]
        for kk in 0..steps {
            #[unroll]
            for i in 0..va {
                let mut reg = Vector::<E, NA>::empty();
                #[unroll]
                for e in 0..sa {
                    let n = i * sa + e;
                    let src_tile = mt * frags + 2 * kk + n / 4;
                    let src_n = n % 4;
                    reg[e] = E::cast_from(acc[src_tile * vc + src_n / sc][src_n % sc]);
                }
                out[(mt * steps + kk) * va + i] = reg;
            }
        }
    }
    out
}

/// A zeroed accumulator of `frags` 8-column tiles.
#[cube]
pub fn zero_accumulator<E: Float, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    #[comptime] frags: usize,
) -> Array<Vector<f32, NC>> {
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let mut acc = Array::<Vector<f32, NC>>::new(comptime!(frags * vc));
    #[unroll]
    for i in 0..comptime!(frags * vc) {
        acc[i] = Vector::new(0.0f32);
    }
    acc
}

/// Writes `scale * acc`, converted to `T`, over (or, with `accumulate`, adds it to) the plane's
/// `m_tiles x 16` valid rows (from `row0`, of `len`) of a row-major matrix with `cols` columns
/// starting at row `base`, in the accumulator layout of [`multiply_by_rows`].
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn store_accumulator<E: Float, T: Float, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    acc: &Array<Vector<f32, NC>>,
    dst: &mut Array<T>,
    base: usize,
    row0: u32,
    len: u32,
    scale: f32,
    #[comptime] m_tiles: usize,
    #[comptime] cols: usize,
    #[comptime] accumulate: bool,
) {
    store_accumulator_columns::<E, T, NC>(
        def, acc, dst, base, row0, len, 0usize, scale, m_tiles, cols, cols, accumulate,
    );
}

/// [`store_accumulator`] of an `m_tiles x 16 x cols` accumulator into columns `col0..col0 +
/// cols` of a row-major matrix with rows `width` long.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn store_accumulator_columns<E: Float, T: Float, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    acc: &Array<Vector<f32, NC>>,
    dst: &mut Array<T>,
    base: usize,
    row0: u32,
    len: u32,
    col0: usize,
    scale: f32,
    #[comptime] m_tiles: usize,
    #[comptime] cols: usize,
    #[comptime] width: usize,
    #[comptime] accumulate: bool,
) {
    let mut keep = Array::<f32>::new(comptime!(m_tiles * ROW_SLOTS));
    let mut add = Array::<f32>::new(comptime!(m_tiles * ROW_SLOTS));
    #[unroll]
    for r in 0..comptime!(m_tiles * ROW_SLOTS) {
        keep[r] = 1.0f32;
        add[r] = scale;
    }
    update_rows::<E, T, NC>(
        def, acc, dst, base, row0, len, col0, &keep, &add, m_tiles, cols, width, accumulate,
    );
}

/// Accumulator fragments per batch of [`update_rows`]: the loads of a batch are all issued before
/// any of its stores (32 values per lane).
const UPDATE_BATCH_FRAGS: usize = 8;

/// `dst = T(acc * add[r])`, or with `read` `dst = T(dst * keep[r] + acc * add[r])`, over the
/// plane's valid rows (from `row0`, of `len`) of columns `col0..col0 + cols` of a row-major
/// matrix with rows `width` long starting at row `base`, in the accumulator layout of
/// [`multiply_by_rows`]; `r = tile * 2 + slot` is the lane's row (see
/// [`super::fragments::accumulator_row`]). Reading and writing the same array, each batch loads
/// all of its values first: a load may not pass an earlier store to `dst`, so element-wise
/// read-modify-write would pay one memory round trip per pair of values.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn update_rows<E: Float, T: Float, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    acc: &Array<Vector<f32, NC>>,
    dst: &mut Array<T>,
    base: usize,
    row0: u32,
    len: u32,
    col0: usize,
    keep: &Array<f32>,
    add: &Array<f32>,
    #[comptime] m_tiles: usize,
    #[comptime] cols: usize,
    #[comptime] width: usize,
    #[comptime] read: bool,
) {
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let frags = comptime!(cols / FRAG_COLS);
    let batch = comptime!(if frags < UPDATE_BATCH_FRAGS {
        frags
    } else {
        UPDATE_BATCH_FRAGS
    });
    let lane = UNIT_POS_PLANE;
    #[unroll]
    for mt in 0..m_tiles {
        #[unroll]
        for b in 0..comptime!(frags / batch) {
            let mut old = Array::<f32>::new(comptime!(batch * 4));
            if read {
                #[unroll]
                for tt in 0..batch {
                    #[unroll]
                    for i in 0..vc {
                        #[unroll]
                        for e in 0..sc {
                            let n = i * sc + e;
                            let row = row0 + (mt * WARP_ROWS) as u32 + accumulator_row(lane, n);
                            let col = col0
                                + (b * batch + tt) * FRAG_COLS
                                + accumulator_col(lane, n) as usize;
                            // Rows past `len` read the matrix's first element (never stored).
                            let at = select(row < len, (base + row as usize) * width + col, 0usize);
                            old[tt * 4 + n] = f32::cast_from(dst[at]);
                        }
                    }
                }
            }
            #[unroll]
            for tt in 0..batch {
                #[unroll]
                for i in 0..vc {
                    let reg = acc[(mt * frags + b * batch + tt) * vc + i];
                    #[unroll]
                    for e in 0..sc {
                        let n = i * sc + e;
                        let r = mt * ROW_SLOTS + n / 2;
                        let row = row0 + (mt * WARP_ROWS) as u32 + accumulator_row(lane, n);
                        if row < len {
                            let col = col0
                                + (b * batch + tt) * FRAG_COLS
                                + accumulator_col(lane, n) as usize;
                            let mut value = reg[e] * add[r];
                            if read {
                                value += old[tt * 4 + n] * keep[r];
                            }
                            dst[(base + row as usize) * width + col] = T::cast_from(value);
                        }
                    }
                }
            }
        }
    }
}
