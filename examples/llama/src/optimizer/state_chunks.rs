//! How a sharded optimizer's flat vectors are cut: into chunks of a byte budget for its state (on
//! the device or streamed through it from host memory), into buckets of a byte budget for summing
//! the gradients over the group, into pieces for gathering the updated weights, and into fixed
//! blocks for the gradient norm's partial sums (the same blocks whatever the state's placement,
//! chunk and bucket sizes, so that the norm is the same number). No buffer these cuts make is
//! larger than [`MAX_STEP_BUFFER_BYTES`]. Pure arithmetic.

use std::ops::Range;

/// Bytes one element of the optimizer state takes: f32 master weight and two f32 moments.
pub const STATE_BYTES_PER_ELEMENT: u64 = 12;

/// Bytes of f32 one bucket of the gradients' sum gathers (every rank's range of the bucket
/// together, the input of one collective), by default: 256 MiB.
pub const DEFAULT_GRAD_BUCKET_BYTES: u64 = 256 << 20;

/// The most bytes any single buffer of a sharded optimizer step takes, but the model's own
/// tensors (a parameter, its gradient, its updated value): a chunk's vector, a bucket of the
/// gradients' sum (every rank's range together), one all-gather of the updated weights. 256 MiB:
/// CubeCL's CUDA pools put a buffer above their largest sliced class's largest slice (1/32 of the
/// device's memory: 512 MiB on a 16 GiB GPU, 4.34 GiB on an H200) into pages of a quarter of the
/// device that only buffers as large reuse; this bound is half of that slice on any GPU of 16 GiB
/// or more, whatever the model's size.
pub const MAX_STEP_BUFFER_BYTES: u64 = 256 << 20;

/// Chunks start at multiples of this many elements (4 KiB of f32), so that every chunk's
/// first element is as aligned as the whole vector's.
const CHUNK_ALIGN: usize = 1024;

/// Elements of each block whose squares the gradient norm sums on its own before adding the
/// blocks' sums (16 Mi elements, 64 MiB of f32).
pub const NORM_BLOCK: usize = 1 << 24;

/// Elements of one chunk of state of `budget` bytes: `budget / 12` (each of the three f32
/// vectors at most [`MAX_STEP_BUFFER_BYTES`]) rounded down to a multiple of 1024, at least 1024.
pub fn chunk_elements(budget: u64) -> usize {
    let elements = (budget / STATE_BYTES_PER_ELEMENT).min(MAX_STEP_BUFFER_BYTES / 4);
    aligned(elements)
}

/// Elements of each rank's share that one bucket of `budget` bytes of f32 sums over `world`
/// ranks (the bucket gathers that many from every rank's share): `budget / (4 world)` (the budget
/// at most [`MAX_STEP_BUFFER_BYTES`]) rounded down to a multiple of 1024, at least 1024.
pub fn bucket_elements(budget: u64, world: usize) -> usize {
    let budget = budget.min(MAX_STEP_BUFFER_BYTES);
    aligned(budget / (4 * world.max(1) as u64))
}

/// Elements of each rank's share that one all-gather of the updated weights carries, the weights
/// travelling in `wire_bytes` bytes an element over `world` ranks: at most `budget` bytes
/// gathered (the budget at most [`MAX_STEP_BUFFER_BYTES`]), rounded down to a multiple of 1024,
/// at least 1024.
pub fn gather_elements(budget: u64, wire_bytes: usize, world: usize) -> usize {
    let budget = budget.min(MAX_STEP_BUFFER_BYTES);
    aligned(budget / (wire_bytes.max(1) * world.max(1)) as u64)
}

/// `elements` rounded down to a multiple of [`CHUNK_ALIGN`], at least one.
fn aligned(elements: u64) -> usize {
    (elements as usize / CHUNK_ALIGN).max(1) * CHUNK_ALIGN
}

/// `0..len` cut into consecutive ranges of `chunk` elements (the last one shorter when `chunk`
/// does not divide `len`); none for `len == 0`.
pub fn ranges(len: usize, chunk: usize) -> Vec<Range<usize>> {
    let chunk = chunk.max(1);
    (0..len.div_ceil(chunk))
        .map(|i| i * chunk..((i + 1) * chunk).min(len))
        .collect()
}

/// The gradient norm's blocks of a vector of `len` elements.
pub fn norm_blocks(len: usize) -> Vec<Range<usize>> {
    ranges(len, NORM_BLOCK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_the_vector_once_in_order() {
        assert_eq!(ranges(10, 4), [0..4, 4..8, 8..10]);
        assert_eq!(ranges(8, 4), [0..4, 4..8]);
        assert_eq!(ranges(3, 4), vec![Range { start: 0, end: 3 }]);
        assert!(ranges(0, 4).is_empty());
        assert_eq!(
            norm_blocks(NORM_BLOCK + 1),
            [0..NORM_BLOCK, NORM_BLOCK..NORM_BLOCK + 1]
        );
    }

    #[test]
    fn a_chunk_is_its_budget_in_aligned_elements() {
        assert_eq!(chunk_elements(512 << 20), (512 << 20) / 12 / 1024 * 1024);
        assert_eq!(chunk_elements(12 * 5000), 4096);
        assert_eq!(chunk_elements(0), 1024, "at least one aligned block");
        assert_eq!(chunk_elements(12 * 1024), 1024);
        // A vector of a chunk stays within the bound: 64 Mi elements of f32.
        assert_eq!(chunk_elements(12 << 30), 64 << 20);
    }

    #[test]
    fn a_gather_of_the_updated_weights_stays_within_its_budget_and_the_bound() {
        let max = MAX_STEP_BUFFER_BYTES;
        assert_eq!(gather_elements(max, 2, 2), 64 << 20);
        assert_eq!(gather_elements(max, 2, 8), 16 << 20);
        assert_eq!(gather_elements(max, 4, 3), (256 << 20) / 12 / 1024 * 1024);
        assert_eq!(
            gather_elements(max, 2, 1 << 20),
            1024,
            "at least one aligned block"
        );
        assert_eq!(gather_elements(4 * 2 * 3000, 4, 2), 2048);
        assert_eq!(gather_elements(1 << 40, 2, 2), 64 << 20, "within the bound");
        for (wire, world) in [(2, 1), (2, 3), (4, 7), (2, 64)] {
            let gathered = (gather_elements(1 << 40, wire, world) * wire * world) as u64;
            assert!(gathered <= max, "{wire} bytes, {world} ranks");
        }
    }

    #[test]
    fn a_bucket_is_its_budget_shared_by_the_ranks_in_aligned_elements() {
        assert_eq!(bucket_elements(256 << 20, 2), 32 << 20);
        assert_eq!(
            bucket_elements(256 << 20, 3),
            (256 << 20) / 12 / 1024 * 1024
        );
        assert_eq!(bucket_elements(4 * 3 * 2048 + 5, 1), 6144);
        assert_eq!(bucket_elements(4 * 3 * 2048 + 5, 3), 2048);
        assert_eq!(bucket_elements(0, 2), 1024, "at least one aligned block");
        assert_eq!(bucket_elements(4096, 0), 1024, "a world of 0 counts as 1");
        // A bucket's budget stays within the bound.
        assert_eq!(bucket_elements(4 << 30, 2), 32 << 20);
    }
}
