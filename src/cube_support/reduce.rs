//! A cube-wide reduction through shared memory (row norms, the Llama example's loss and gradient
//! norm).

// `#[cube]` generates an undocumented module and function beside `cube_reduce`.
#![allow(missing_docs)]

use cubecl::prelude::*;

/// Units per cube of the kernels that reduce with [`cube_reduce`](fn@cube_reduce).
pub const CUBE_UNITS: usize = 256;

/// Sums (`take_max == false`) or maximises the cube's `value`s; every unit gets the result. The
/// tree adds in a fixed order: deterministic. Every unit of the cube must call it.
#[cube]
pub fn cube_reduce(value: f32, #[comptime] take_max: bool) -> f32 {
    let mut shared = SharedMemory::<f32>::new(CUBE_UNITS);
    shared[UNIT_POS as usize] = value;
    sync_cube();
    #[unroll]
    for level in 1..=comptime!(CUBE_UNITS.trailing_zeros() as usize) {
        let width = comptime!(CUBE_UNITS) >> level;
        if (UNIT_POS as usize) < width {
            let other = shared[UNIT_POS as usize + width];
            let mine = shared[UNIT_POS as usize];
            shared[UNIT_POS as usize] = if take_max {
                max(mine, other)
            } else {
                mine + other
            };
        }
        sync_cube();
    }
    let result = shared[0];
    sync_cube();
    result
}
