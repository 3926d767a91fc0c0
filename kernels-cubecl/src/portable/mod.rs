//! Scalar kernels that run on every CubeCL runtime (wgpu on a CPU included): one unit per row,
//! key/value (or query) tiles staged through shared memory (tile heights chosen on the host to
//! fit the device). They are the reference variant that CI tests and the fallback where
//! cooperative matrices are missing.

pub mod backward;
pub mod forward;

/// Rows handled by one cube (one unit per row).
pub const ROWS_PER_CUBE: usize = 32;
/// Keys the forward kernel scores per tile (held per unit, not in shared memory).
pub const TILE_ROWS: usize = 16;
/// Tile heights the backward kernels can stage in shared memory, largest first. The host takes
/// the largest whose shared memory fits the device (`portable::backward::dq_shared_bytes`,
/// `dkdv_shared_bytes`): at head dim 256, 16 rows of the dK/dV kernel need 32,896 bytes, over
/// the 32 KiB of Mesa's lavapipe. Every choice fills whole loads (`tile_rows * head_dim` is a
/// multiple of [`ROWS_PER_CUBE`] for every supported head dim) and the accumulation order is the
/// same for every choice.
pub const BACKWARD_TILE_ROWS: [usize; 4] = [16, 8, 4, 2];

/// The largest of [`BACKWARD_TILE_ROWS`] whose shared memory (`bytes(tile_rows)`) fits in
/// `max_shared` bytes.
pub fn backward_tile_rows(max_shared: usize, bytes: impl Fn(usize) -> usize) -> Option<usize> {
    BACKWARD_TILE_ROWS
        .into_iter()
        .find(|&rows| bytes(rows) <= max_shared)
}
