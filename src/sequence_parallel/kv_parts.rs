//! The row parts in which the backward streams another rank's key/value shard
//! ([`SequenceParallelOptions::backward_parts`](crate::SequenceParallelOptions)): each layout
//! chunk of the shard cut into equal row parts, part `i` of every chunk travelling, computed
//! with and returned (`dk, dv`) in one exchange round of its own, so a rank holds one part of
//! the remote shard and of its f32 gradients at a time. With one part every method hands back
//! its input unchanged: the whole chunks, their cells and layouts as they are.

use core::ops::Range;

use burn::tensor::ops::FloatTensor;

use crate::collective::TensorLayout;
use crate::extension::FlashAttentionBackend;
use crate::schedule::Block;
use crate::step;

/// Each layout chunk of `chunk_len` rows cut into `count` equal row parts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvParts {
    /// Parts per chunk (at least 1, dividing `chunk_len`; checked with the options).
    pub count: usize,
    /// Rows of one layout chunk.
    pub chunk_len: usize,
}

impl KvParts {
    /// Whether a chunk is one part (the whole shard travels at once).
    pub fn whole(&self) -> bool {
        self.count == 1
    }

    /// Rows of part `part` within each chunk.
    pub fn rows(&self, part: usize) -> Range<usize> {
        let len = self.chunk_len / self.count;
        part * len..(part + 1) * len
    }

    /// Part `part` of each of `chunks` (views of their rows; the transport copies a sent view
    /// into a contiguous message).
    pub fn slice<B: FlashAttentionBackend>(
        &self,
        chunks: &[FloatTensor<B>],
        part: usize,
    ) -> Vec<FloatTensor<B>> {
        if self.whole() {
            return chunks.to_vec();
        }
        let rows = self.rows(part);
        (chunks.iter())
            .map(|t| B::float_slice(t.clone(), &step::row_slices::<B>(t, &rows)))
            .collect()
    }

    /// The layouts of one part of each of `chunks` (their float types, a part's rows), without
    /// making a tensor.
    pub fn layouts<'a, B: FlashAttentionBackend>(
        &self,
        chunks: impl IntoIterator<Item = &'a FloatTensor<B>>,
    ) -> Vec<TensorLayout> {
        (chunks.into_iter())
            .map(|t| {
                let mut layout = TensorLayout::of::<B>(t);
                layout.shape[2] = self.chunk_len / self.count;
                layout
            })
            .collect()
    }

    /// `cells` restricted to key/value part `part`: each cell's mask with its key offset moved
    /// to the part's first row, and the cells whose part no query of `batch` rows sees dropped.
    pub fn cells(&self, cells: &[Block], part: usize, batch: usize) -> Vec<Block> {
        if self.whole() {
            return cells.to_vec();
        }
        let rows = self.rows(part);
        (cells.iter())
            .map(|cell| {
                let mask = &cell.mask;
                let shifted = (mask.clone()).at(mask.q_offset, mask.kv_offset + rows.start as i64);
                Block {
                    mask: shifted,
                    ..cell.clone()
                }
            })
            .filter(|cell| {
                !cell
                    .mask
                    .hides_everything(self.chunk_len, rows.len(), batch)
            })
            .collect()
    }

    /// Received part `part` of each chunk's f32 gradient added into the rows of that part of
    /// the accumulator chunks `acc` (in place where the backend allows: the pass holds them
    /// alone).
    pub fn add_into<B: FlashAttentionBackend>(
        &self,
        acc: &mut Vec<FloatTensor<B>>,
        part: usize,
        received: impl Iterator<Item = FloatTensor<B>>,
    ) {
        let rows = self.rows(part);
        *acc = (core::mem::take(acc).into_iter().zip(received))
            .map(|(a, r)| step::add_into_rows::<B>(a, &rows, r))
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{Mask, SlidingWindow};

    fn cell(mask: Mask) -> Block {
        Block {
            query: 0..1,
            kv: 0..1,
            mask,
            cost: 0.5,
        }
    }

    #[test]
    fn one_part_is_the_whole_chunk() {
        let parts = KvParts {
            count: 1,
            chunk_len: 8,
        };
        assert_eq!(parts.rows(0), 0..8);
        let cells = vec![cell(Mask::causal().at(16, 16))];
        assert_eq!(parts.cells(&cells, 0, 1), cells);
    }

    #[test]
    fn a_part_moves_the_key_offset_and_keeps_only_what_some_query_sees() {
        let parts = KvParts {
            count: 4,
            chunk_len: 8,
        };
        assert_eq!(parts.rows(2), 4..6);
        // A diagonal causal cell at position 16: every part is seen by the last query.
        let diagonal = vec![cell(Mask::causal().at(16, 16))];
        let third = parts.cells(&diagonal, 2, 1);
        assert_eq!(third.len(), 1);
        assert_eq!((third[0].mask.q_offset, third[0].mask.kv_offset), (16, 20));
        // Queries 16..24 under a window of 2 before (keys 14..24 seen) against keys 8..16:
        // only the last part (keys 14, 15) is seen.
        let window = Mask::causal().with_window(SlidingWindow::causal(3).expect("a window"));
        let earlier = vec![cell(window.at(16, 8))];
        let seen: Vec<usize> = (0..4)
            .filter(|&p| !parts.cells(&earlier, p, 1).is_empty())
            .collect();
        assert_eq!(seen, vec![3]);
    }
}
