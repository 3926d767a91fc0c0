//! How a sharded optimizer's flat vectors are cut: into chunks of a byte budget for streaming a
//! host-resident state through the device, into buckets of a byte budget for summing the
//! gradients over the group, and into fixed blocks for the gradient norm's partial sums (the same
//! blocks whatever the state's placement, chunk and bucket sizes, so that the norm is the same
//! number). Pure arithmetic.

use std::ops::Range;

/// Bytes one element of the optimizer state takes: f32 master weight and two f32 moments.
pub const STATE_BYTES_PER_ELEMENT: u64 = 12;

/// Bytes of f32 one bucket of the gradients' sum gathers (every rank's range of the bucket
/// together, the input of one collective), by default: 256 MiB.
pub const DEFAULT_GRAD_BUCKET_BYTES: u64 = 256 << 20;

/// Chunks start at multiples of this many elements (4 KiB of f32), so that every chunk's
/// first element is as aligned as the whole vector's.
const CHUNK_ALIGN: usize = 1024;

/// Elements of each block whose squares the gradient norm sums on its own before adding the
/// blocks' sums (16 Mi elements, 64 MiB of f32).
pub const NORM_BLOCK: usize = 1 << 24;

/// Elements of one chunk of state of `budget` bytes: `budget / 12` rounded down to a multiple
/// of 1024, at least 1024.
pub fn chunk_elements(budget: u64) -> usize {
    let elements = (budget / STATE_BYTES_PER_ELEMENT) as usize;
    (elements / CHUNK_ALIGN).max(1) * CHUNK_ALIGN
}

/// Elements of each rank's share that one bucket of `budget` bytes of f32 sums over `world`
/// ranks (the bucket gathers that many from every rank's share): `budget / (4 world)` rounded
/// down to a multiple of 1024, at least 1024.
pub fn bucket_elements(budget: u64, world: usize) -> usize {
    let elements = (budget / (4 * world.max(1) as u64)) as usize;
    (elements / CHUNK_ALIGN).max(1) * CHUNK_ALIGN
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
    }
}
