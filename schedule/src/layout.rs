//! Layouts: which positions of the sequence each rank holds.
//!
//! The sequence is cut into equal chunks and every rank holds the same number of them, its
//! local shard being its chunks one after the other:
//!
//! - [`Layout::Contiguous`]: `P` chunks, rank `r` holds chunk `r` (positions `r*S .. (r+1)*S`
//!   for shards of `S` tokens). Under causal attention rank `r` has `r + 1/2` chunk pairs of
//!   work, so a plain ring leaves the early ranks idle (the balanced schedule moves work instead).
//! - [`Layout::Zigzag`]: `2P` chunks of `S/2` tokens, rank `r` holds chunks `r` and `2P-1-r`, in
//!   that order. Every rank then holds one early and one late chunk and the same share of the
//!   causal triangle at every step of a plain ring (see [`crate::zigzag`]).
//!
//! ```text
//! P = 4, sequence of 8 chunks   0   1   2   3   4   5   6   7
//!   Contiguous                  [ 0 ]   [ 1 ]   [ 2 ]   [ 3 ]      (rank owning the chunks)
//!   Zigzag                      0   1   2   3   3   2   1   0
//!
//! Zigzag, local shards:  rank 0 = [c0 | c7], rank 1 = [c1 | c6], rank 2 = [c2 | c5],
//!                        rank 3 = [c3 | c4]
//! ```

use core::ops::Range;

use crate::ScheduleError;

/// Which positions of the sequence each rank holds (see the [module](self) for pictures).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Layout {
    /// Rank `r` of `P` holds positions `r*S .. (r+1)*S`.
    #[default]
    Contiguous,
    /// The sequence cut into `2P` chunks; rank `r` holds chunks `r` and `2P-1-r`, in that order.
    Zigzag,
}

impl Layout {
    /// Chunks each rank holds: 1 (contiguous) or 2 (zigzag).
    pub fn chunks_per_rank(self) -> usize {
        match self {
            Layout::Contiguous => 1,
            Layout::Zigzag => 2,
        }
    }

    /// Number of chunks the sequence is cut into for `world` ranks.
    pub fn num_chunks(self, world: usize) -> usize {
        world * self.chunks_per_rank()
    }

    /// The chunks `rank` holds, in local order.
    ///
    /// # Panics
    ///
    /// When `rank` is not below `world` ([`ranges`](Self::ranges) returns that as an error).
    pub fn chunks(self, world: usize, rank: usize) -> Vec<usize> {
        assert!(
            rank < world,
            "rank {rank} is not in a group of {world} ranks (ranks are 0..{world})"
        );
        match self {
            Layout::Contiguous => vec![rank],
            Layout::Zigzag => vec![rank, 2 * world - 1 - rank],
        }
    }

    /// Errors unless every rank can hold a shard of `shard_len` tokens (the sequence being
    /// `world * shard_len` tokens): zigzag needs an even shard length (a sequence length that
    /// is a multiple of `2P`), and no layout accepts empty shards.
    ///
    /// # Errors
    ///
    /// [`ScheduleError::Layout`] when `world` is zero, when `shard_len` is zero, or when it is
    /// odd under [`Layout::Zigzag`].
    pub fn check_shard_len(self, world: usize, shard_len: usize) -> Result<(), ScheduleError> {
        let error = |what: String| ScheduleError::Layout {
            layout: self,
            world,
            what,
        };
        if world == 0 {
            return Err(error("a group has at least one rank".into()));
        }
        let per_rank = self.chunks_per_rank();
        if shard_len == 0 || !shard_len.is_multiple_of(per_rank) {
            return Err(error(format!(
                "the sequence is cut into {} chunks ({per_rank} per rank), so each rank's shard \
                 must be a positive multiple of {per_rank} tokens (the sequence length a positive \
                 multiple of {}); got a shard of {shard_len} (a sequence of {})",
                self.num_chunks(world),
                self.num_chunks(world),
                shard_len * world,
            )));
        }
        Ok(())
    }

    /// Errors unless a sequence of `seq_len` tokens can be split over `world` ranks; returns
    /// the shard length.
    ///
    /// # Errors
    ///
    /// [`ScheduleError::Layout`] when `world` is zero, or when `seq_len` is zero or not a
    /// multiple of [`num_chunks`](Self::num_chunks)`(world)` (`world`, or `2 * world` for
    /// zigzag).
    pub fn shard_len(self, world: usize, seq_len: usize) -> Result<usize, ScheduleError> {
        let chunks = self.num_chunks(world.max(1));
        if world == 0 || seq_len == 0 || !seq_len.is_multiple_of(chunks) {
            return Err(ScheduleError::Layout {
                layout: self,
                world,
                what: format!(
                    "the sequence is cut into {chunks} equal chunks, so its length must be a \
                     positive multiple of {chunks}; got {seq_len}"
                ),
            });
        }
        Ok(seq_len / world)
    }

    /// The positions `rank` holds, as ranges in local order, for shards of `shard_len` tokens.
    ///
    /// # Errors
    ///
    /// As [`check_shard_len`](Self::check_shard_len), and [`ScheduleError::Layout`] when `rank`
    /// is not below `world`.
    pub fn ranges(
        self,
        world: usize,
        rank: usize,
        shard_len: usize,
    ) -> Result<Vec<Range<usize>>, ScheduleError> {
        self.check_shard_len(world, shard_len)?;
        if rank >= world {
            return Err(ScheduleError::Layout {
                layout: self,
                world,
                what: format!("rank {rank} is not in the group (ranks are 0..{world})"),
            });
        }
        let chunk = shard_len / self.chunks_per_rank();
        Ok((self.chunks(world, rank).into_iter())
            .map(|c| c * chunk..(c + 1) * chunk)
            .collect())
    }

    /// The position of every local row of `rank` (shards of `shard_len` tokens).
    ///
    /// # Errors
    ///
    /// As [`ranges`](Self::ranges).
    pub fn positions(
        self,
        world: usize,
        rank: usize,
        shard_len: usize,
    ) -> Result<Vec<usize>, ScheduleError> {
        Ok(self
            .ranges(world, rank, shard_len)?
            .into_iter()
            .flatten()
            .collect())
    }
}
