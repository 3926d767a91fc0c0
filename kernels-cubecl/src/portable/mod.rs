//! Scalar kernels that run on every CubeCL runtime (wgpu on a CPU included): one unit per row,
//! key/value (or query) tiles staged through shared memory. They are the reference variant that
//! CI tests and the fallback where cooperative matrices are missing.

pub mod backward;
pub mod forward;

/// Rows handled by one cube (one unit per row).
pub const ROWS_PER_CUBE: usize = 32;
/// Rows of the other operand staged per tile in shared memory.
pub const TILE_ROWS: usize = 16;
