//! How a launch's cubes are laid out on the device grid, within the device's per-axis limits
//! (65535 along y and z on CUDA, along every axis on Vulkan): the host-side folds and the
//! kernel-side decode, one contract for every kernel.
//!
//! **Sliced kernels** (attention kernels: a cube is one block of rows of one (batch, head)
//! slice): x = the block, and the slice is spread over y and z with `y * z == slices`
//! exactly, so no cube falls outside a slice and kernels need no guard for it. The kernel reads
//! its slice with [`cube_slice`] (`CUBE_POS_Z * CUBE_COUNT_Y + CUBE_POS_Y`), its block with
//! `CUBE_POS_X`. Unfolded grids (z = 1) decode the same way.
//!
//! **Slice-major kernels** (the tensor-core forward and dQ kernels, [`slice_major`]): x = the
//! slice, y = the block, no fold. The device starts cubes in x-fastest order, so every slice's
//! block `y` is under way before any slice's block `y + 1`: the kernels take their heaviest
//! causal blocks at `y = 0`, and the light ones fill the last wave. CUDA's x axis holds 2^31 - 1 slices.
//!
//! **Linear kernels** (one unit per element or row, indexed by `ABSOLUTE_POS`, which CubeCL
//! linearises over x, y and z): the cube count is folded over x, y and z, possibly with a few
//! extra cubes, which the kernels' `ABSOLUTE_POS < len` check already skips.

use cubecl::prelude::*;

use crate::dims::AttentionDims;
use crate::kernel_error::KernelError;
use crate::limits::DeviceLimits;

/// The (batch, head) slice of the calling cube in a sliced grid (see the module docs).
#[cube]
pub fn cube_slice() -> u32 {
    CUBE_POS_Z * CUBE_COUNT_Y + CUBE_POS_Y
}

/// The `(slice, block)` of the calling cube in a sliced grid taken **two slices at a time**: the
/// device starts cubes in launch order (x fastest, then y, then z), and this decode hands out
/// that order as block 0 of slices `2p` and `2p + 1`, then block 1 of both, and so on, before
/// the next pair (a last odd slice alone). Kernels whose first blocks are their heaviest
/// (causal dK/dV: the first keys are seen by every query) then run each pair's heavy blocks
/// early and its light ones last: the final wave is light, where slice after slice would leave
/// the last slice's heaviest blocks to start late (a tail of about 20% at 8K tokens with 8 kv
/// heads on 132 SMs, by list scheduling), while the cubes under way still share at most two
/// slices' data in L2.
#[cube]
pub fn paired_slice_block() -> (u32, u32) {
    let blocks = CUBE_COUNT_X;
    let slices = CUBE_COUNT_Y * CUBE_COUNT_Z;
    let launch = cube_slice() * blocks + CUBE_POS_X;
    let first = launch / (2 * blocks) * 2;
    let width = min(2u32, slices - first);
    let rest = launch - first * blocks;
    (first + rest % width, rest / width)
}

/// `(y, z)` with `y * z == slices`, `y <= max_y`, `z <= max_z`, the largest such `y`.
fn split_exactly(slices: usize, max_y: usize, max_z: usize) -> Option<(usize, usize)> {
    if slices <= max_y {
        return Some((slices, 1));
    }
    let mut best = None;
    let mut i = 1;
    while i * i <= slices {
        if slices.is_multiple_of(i) {
            for (y, z) in [(i, slices / i), (slices / i, i)] {
                if y <= max_y && z <= max_z && best.is_none_or(|(by, _)| y > by) {
                    best = Some((y, z));
                }
            }
        }
        i += 1;
    }
    best
}

/// Grid of a sliced kernel: `blocks` cubes along x for each of `slices` slices.
pub(crate) fn sliced(
    kernel: &str,
    blocks: usize,
    slices: usize,
    limits: &DeviceLimits,
) -> Result<CubeCount, KernelError> {
    let (max_x, max_y, max_z) = limits.max_cube_count;
    if blocks > max_x as usize {
        return Err(KernelError::DeviceLimit {
            what: format!(
                "{kernel} needs {blocks} blocks of rows per (batch, head); the device's grid \
                 allows {max_x} along x"
            ),
        });
    }
    let (y, z) = split_exactly(slices, max_y as usize, max_z as usize).ok_or_else(|| {
        KernelError::DeviceLimit {
            what: format!(
                "{kernel}: batch x heads = {slices} is not a product y x z with y <= {max_y} \
                 and z <= {max_z} (the device's grid)"
            ),
        }
    })?;
    Ok(CubeCount::Static(blocks as u32, y as u32, z as u32))
}

/// The rows whose blocks a sliced attention kernel's cubes take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rows {
    /// Query rows: slices = batch * q_heads.
    Query,
    /// Key rows: slices = batch * kv_heads.
    Key,
}

impl Rows {
    /// Blocks of `per_block` rows per slice, and the number of (batch, head) slices.
    fn blocks_and_slices(self, dims: &AttentionDims, per_block: usize) -> (usize, usize) {
        let (len, heads) = match self {
            Rows::Query => (dims.q_len, dims.q_heads),
            Rows::Key => (dims.kv_len, dims.kv_heads),
        };
        (len.div_ceil(per_block), dims.batch * heads)
    }
}

/// Grid of a sliced attention kernel whose cubes take blocks of `per_block` rows of `rows`.
pub(crate) fn blocks(
    kernel: &str,
    dims: &AttentionDims,
    rows: Rows,
    per_block: usize,
    limits: &DeviceLimits,
) -> Result<CubeCount, KernelError> {
    let (blocks, slices) = rows.blocks_and_slices(dims, per_block);
    sliced(kernel, blocks, slices, limits)
}

/// Grid of a slice-major attention kernel (see the module docs): x = the (batch, head) slice,
/// y = the block of `per_block` rows of `rows`.
pub(crate) fn slice_major(
    kernel: &str,
    dims: &AttentionDims,
    rows: Rows,
    per_block: usize,
    limits: &DeviceLimits,
) -> Result<CubeCount, KernelError> {
    let (blocks, slices) = rows.blocks_and_slices(dims, per_block);
    let (max_x, max_y, _) = limits.max_cube_count;
    if slices > max_x as usize || blocks > max_y as usize {
        return Err(KernelError::DeviceLimit {
            what: format!(
                "{kernel} needs batch x heads = {slices} slices (grid x, at most {max_x}) of \
                 {blocks} blocks of {per_block} rows (grid y, at most {max_y}); split the \
                 sequence into chunks (forward_step/backward_step)"
            ),
        });
    }
    Ok(CubeCount::Static(slices as u32, blocks as u32, 1))
}

/// Grid of a linear kernel: at least `cubes` cubes, folded over x, y and z.
pub(crate) fn linear(
    kernel: &str,
    cubes: usize,
    limits: &DeviceLimits,
) -> Result<CubeCount, KernelError> {
    let (max_x, max_y, max_z) = limits.max_cube_count;
    let x = cubes.clamp(1, max_x as usize);
    let rest = cubes.div_ceil(x);
    let y = rest.clamp(1, max_y as usize);
    let z = rest.div_ceil(y);
    if z > max_z as usize {
        return Err(KernelError::DeviceLimit {
            what: format!(
                "{kernel} needs {cubes} cubes; the device's grid allows {max_x} x {max_y} x {max_z}"
            ),
        });
    }
    Ok(CubeCount::Static(x as u32, y as u32, z as u32))
}

/// Grid and cube of a linear kernel over `len` items, `per_cube` per cube.
pub(crate) fn linear_launch(
    kernel: &str,
    len: usize,
    per_cube: usize,
    limits: &DeviceLimits,
) -> Result<(CubeCount, CubeDim), KernelError> {
    limits.expect_units(kernel, per_cube)?;
    Ok((
        linear(kernel, len.div_ceil(per_cube), limits)?,
        CubeDim::new_1d(per_cube as u32),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes each cube's `(slice, block)` from [`paired_slice_block`] at its launch position.
    #[cube(launch)]
    fn record_paired(out: &mut Array<u32>) {
        let (slice, block) = paired_slice_block();
        let launch = (cube_slice() * CUBE_COUNT_X + CUBE_POS_X) as usize;
        if UNIT_POS == 0 {
            out[2 * launch] = slice;
            out[2 * launch + 1] = block;
        }
    }

    #[test]
    fn paired_order_takes_two_slices_block_by_block() {
        use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
        let client = WgpuRuntime::client(&WgpuDevice::Cpu);
        for (blocks, y, z) in [(3, 1, 1), (3, 5, 1), (4, 2, 3), (1, 7, 1), (5, 3, 3)] {
            let cubes = blocks * y * z;
            let out = client.empty(2 * cubes * 4);
            unsafe {
                record_paired::launch::<WgpuRuntime>(
                    &client,
                    CubeCount::Static(blocks as u32, y as u32, z as u32),
                    CubeDim::new_1d(1),
                    ArrayArg::from_raw_parts(out.clone(), 2 * cubes),
                );
            }
            let bytes = client.read_one(out).unwrap();
            let got: Vec<(u32, u32)> = pairs_of(&bytes);
            // Expected: pair after pair, block by block, the pair's slices in order.
            let slices = y * z;
            let mut expected = Vec::new();
            for first in (0..slices).step_by(2) {
                for block in 0..blocks {
                    for slice in first..(first + 2).min(slices) {
                        expected.push((slice as u32, block as u32));
                    }
                }
            }
            assert_eq!(got, expected, "grid {blocks} x {y} x {z}");
        }
    }

    fn pairs_of(bytes: &[u8]) -> Vec<(u32, u32)> {
        let word = |c: &[u8]| u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        bytes
            .chunks(8)
            .map(|c| (word(&c[..4]), word(&c[4..])))
            .collect()
    }

    fn limits(max: u32) -> DeviceLimits {
        DeviceLimits {
            max_shared_memory: 32768,
            max_cube_count: (max, max, max),
            max_units_per_cube: 256,
            max_cube_dim_x: 256,
            f16: true,
            bf16: false,
            stmatrix: false,
        }
    }

    fn dims(count: CubeCount) -> (usize, usize, usize) {
        match count {
            CubeCount::Static(x, y, z) => (x as usize, y as usize, z as usize),
            CubeCount::Dynamic(_) => unreachable!(),
        }
    }

    #[test]
    fn sliced_grids_cover_every_slice_exactly() {
        let l = limits(65535);
        assert_eq!(dims(sliced("k", 3, 65535, &l).unwrap()), (3, 65535, 1));
        for slices in [
            65536,
            2 * 65535,
            65535 * 65535,
            3 * 5 * 7 * 11 * 13 * 17 * 19,
        ] {
            let (x, y, z) = dims(sliced("k", 7, slices, &l).unwrap());
            assert_eq!((x, y * z), (7, slices), "{slices}");
            assert!(y <= 65535 && z <= 65535, "{slices}: {y} x {z}");
        }
        // 65537 is prime: no exact split under 65535.
        let err = sliced("k", 1, 65537, &l).unwrap_err().to_string();
        assert!(
            err.contains("65537") && err.contains("device limit"),
            "{err}"
        );
        let err = sliced("k", 65536, 1, &l).unwrap_err().to_string();
        assert!(err.contains("65536 blocks"), "{err}");
    }

    #[test]
    fn slice_major_grids_put_slices_on_x_and_blocks_on_y() {
        let l = DeviceLimits {
            max_cube_count: (u32::MAX >> 1, 65535, 65535),
            ..limits(0)
        };
        let d = |batch, q_heads, kv_heads, q_len, kv_len| AttentionDims {
            batch,
            q_heads,
            kv_heads,
            q_len,
            kv_len,
            head_dim: 64,
        };
        let count = slice_major("k", &d(2, 8, 2, 300, 129), Rows::Query, 128, &l).unwrap();
        assert_eq!(dims(count), (16, 3, 1));
        let count = slice_major("k", &d(2, 8, 2, 300, 129), Rows::Key, 64, &l).unwrap();
        assert_eq!(dims(count), (4, 3, 1));
        // 65,537 slices (prime) fit on x; 65,536 blocks do not fit on y.
        let count = slice_major("k", &d(65537, 1, 1, 10, 10), Rows::Query, 64, &l).unwrap();
        assert_eq!(dims(count), (65537, 1, 1));
        let err = slice_major("k", &d(1, 1, 1, 65536 * 64, 10), Rows::Query, 64, &l)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("65536 blocks") && err.contains("chunks"),
            "{err}"
        );
    }

    #[test]
    fn linear_grids_cover_every_cube() {
        let l = limits(100);
        for cubes in [
            1,
            99,
            100,
            101,
            100 * 100,
            100 * 100 + 1,
            999_999,
            1_000_000,
        ] {
            let (x, y, z) = dims(linear("k", cubes, &l).unwrap());
            assert!(
                x * y * z >= cubes && x <= 100 && y <= 100 && z <= 100,
                "{cubes}"
            );
            // Little waste: less than one x-y plane plus one x row.
            assert!(x * y * z < cubes + x * y + x, "{cubes}: {x} x {y} x {z}");
        }
        assert!(linear("k", 1_000_001, &l).is_err());
    }
}
