//! Register fragments of the `m16n8k16` `mma.sync` instruction and the few layout facts the
//! kernels rely on (PTX ISA, "Matrix Fragments for mma.m16n8k16"):
//!
//! - accumulator (16 x 8, f32): each lane holds 4 values; values 0-1 are in row `lane / 4`,
//!   values 2-3 in row `lane / 4 + 8`, columns `2 * (lane % 4) + {0, 1}`;
//! - A (16 x 16): 8 values per lane, the first 4 laid out like the accumulator over columns 0-7,
//!   the last 4 over columns 8-15. So the accumulators of two adjacent 8-column tiles, converted,
//!   are exactly the A fragment of the 16-column slice they cover (the FlashAttention-2 trick that
//!   keeps probabilities in registers).
//!
//! Positions are still taken from [`MmaDefinition::position_of_nth`] wherever data is loaded or
//! stored, so only the two facts above are assumed; the CUDA test suite checks them.

use cubecl::cmma::MatrixIdent;
use cubecl::cmma::MmaDefinition;
use cubecl::prelude::*;

/// Rows of the tile one plane (warp) computes.
pub const WARP_ROWS: usize = 16;
/// Columns of one accumulator fragment.
pub const FRAG_COLS: usize = 8;
/// Reduction depth of one `mma`.
pub const FRAG_K: usize = 16;

/// The `m16n8k16` definition for inputs `E` and f32 accumulation.
#[cube]
pub fn mma_definition<E: Float>() -> MmaDefinition<E, E, f32> {
    MmaDefinition::<E, E, f32>::new(WARP_ROWS, FRAG_COLS, FRAG_K)
}

/// `acc[acc_at..] += a[a_at..] x b[b_at..]` on fragments stored back to back in flat arrays.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn mma_accumulate<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    a: &Array<Vector<E, NA>>,
    a_at: usize,
    b: &Array<Vector<E, NB>>,
    b_at: usize,
    acc: &mut Array<Vector<f32, NC>>,
    acc_at: usize,
) {
    let va = def.vectors_per_lane(MatrixIdent::A);
    let vb = def.vectors_per_lane(MatrixIdent::B);
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let mut fa = Array::<Vector<E, NA>>::new(va);
    let mut fb = Array::<Vector<E, NB>>::new(vb);
    let mut fc = Array::<Vector<f32, NC>>::new(vc);
    #[unroll]
    for i in 0..va {
        fa[i] = a[a_at + i];
    }
    #[unroll]
    for i in 0..vb {
        fb[i] = b[b_at + i];
    }
    #[unroll]
    for i in 0..vc {
        fc[i] = acc[acc_at + i];
    }
    let fd = def.execute(&fa, &fb, &fc);
    #[unroll]
    for i in 0..vc {
        acc[acc_at + i] = fd[i];
    }
}

/// Row (0..16) of accumulator value `n` (0..4) held by `lane`: `lane / 4`, or 8 rows below for
/// values 2 and 3.
#[cube]
pub fn accumulator_row(lane: u32, n: usize) -> u32 {
    lane / 4 + ((n / 2) * 8) as u32
}

/// Column (0..8) of accumulator value `n` (0..4) held by `lane`: `2 * (lane % 4)`, plus 1 for the
/// odd values.
#[cube]
pub fn accumulator_col(lane: u32, n: usize) -> u32 {
    (lane % 4) * 2 + (n % 2) as u32
}
