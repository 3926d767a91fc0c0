//! Searches over [`MemoryPlanner`] predictions: the longest sequence whose step fits a GPU, and
//! the largest loss and feed-forward chunks that fit (what `llama_train --memory auto` trains
//! with). A peak grows with the sequence and with the chunks, so both are monotone searches.

use burn_distflash::layers::RowChunks;

use super::{MemoryPlan, MemoryPlanner};
use crate::format_bytes;
use crate::Error;

/// The share of a GPU's memory a plan may fill. The rest is for what the plan does not count:
/// the CUDA context and libraries (cuBLAS's workspace), the allocator's rounding of every
/// buffer and the free pages between them, small tensors (norm statistics, scalars).
pub const FIT_FRACTION: f64 = 0.9;

/// Sequences longer than this many tokens are not searched.
const LONGEST_SEARCHED: usize = 1 << 34;

impl MemoryPlanner {
    /// This planner with `seq_len` as the whole sequence's length.
    fn at_length(&self, seq_len: usize) -> Self {
        let mut planner = self.clone();
        planner.options.seq_len = seq_len;
        planner
    }

    /// This planner with `loss` and `ffn` rows per chunk.
    fn with_chunk_rows(&self, loss: u64, ffn: u64) -> Result<Self, Error> {
        let rows = |n: u64| {
            RowChunks::rows(n as usize).map_err(|e| Error::invalid("chunk rows", "at least 1", e))
        };
        let mut planner = self.clone();
        planner.options.loss_chunks = rows(loss)?;
        planner.options.ffn_chunks = rows(ffn)?;
        Ok(planner)
    }

    /// The longest whole sequence (a multiple of `2 * world`, which every layout splits) whose
    /// step [`fits`](MemoryPlan::fits) `gpu_bytes`, with this planner's batch, chunks and
    /// offload; `None` when not even the shortest does.
    ///
    /// # Errors
    ///
    /// Those of [`plan`](Self::plan) other than the sequence's.
    pub fn longest_sequence(&self, gpu_bytes: u64) -> Result<Option<usize>, Error> {
        let granule = 2 * self.world.max(1);
        let fits = |units: usize| -> Result<bool, Error> {
            Ok(self.at_length(units * granule).plan()?.fits(gpu_bytes))
        };
        if !fits(1)? {
            return Ok(None);
        }
        // `low` fits, `high` does not (or is past the search).
        let (mut low, mut high) = (1, 2);
        while high * granule <= LONGEST_SEARCHED && fits(high)? {
            low = high;
            high *= 2;
        }
        while high - low > 1 {
            let middle = low + (high - low) / 2;
            match fits(middle)? {
                true => low = middle,
                false => high = middle,
            }
        }
        Ok(Some(low * granule))
    }

    /// The largest rows per chunk of the loss, then of the feed-forward blocks (each the whole
    /// of a GPU's tokens or a power of two below it), whose step fits `gpu_bytes`, and the plan
    /// with them.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] when the step does not fit even with one row per chunk, naming the
    /// predicted peak and the longest sequence that fits; those of [`plan`](Self::plan).
    pub fn fitting_chunks(
        &self,
        gpu_bytes: u64,
    ) -> Result<(RowChunks, RowChunks, MemoryPlan), Error> {
        let tokens = self.plan()?.tokens;
        let smallest = self.with_chunk_rows(1, 1)?.plan()?;
        if !smallest.fits(gpu_bytes) {
            let longest = match self.longest_sequence(gpu_bytes)? {
                Some(len) => format!("the longest sequence that fits is {len} tokens"),
                None => "no sequence fits: the weights and optimizer state alone do not".into(),
            };
            return Err(Error::invalid(
                "the training step's memory",
                format!(
                    "at most {:.0}% of the GPU's {} ({longest})",
                    super::FIT_FRACTION * 100.0,
                    format_bytes(gpu_bytes)
                ),
                format!(
                    "a predicted peak of {} with 1-row chunks",
                    format_bytes(smallest.peak)
                ),
            ));
        }
        let largest = |fits: &dyn Fn(u64) -> Result<bool, Error>| -> Result<u64, Error> {
            let candidates = std::iter::once(tokens).chain(
                (0..u64::BITS)
                    .rev()
                    .map(|bit| 1u64 << bit)
                    .filter(|&c| c < tokens),
            );
            for rows in candidates {
                if fits(rows)? {
                    return Ok(rows);
                }
            }
            Ok(1)
        };
        let loss = largest(&|rows| Ok(self.with_chunk_rows(rows, 1)?.plan()?.fits(gpu_bytes)))?;
        let ffn = largest(&|rows| Ok(self.with_chunk_rows(loss, rows)?.plan()?.fits(gpu_bytes)))?;
        let planner = self.with_chunk_rows(loss, ffn)?;
        let chunks = (planner.options.loss_chunks, planner.options.ffn_chunks);
        Ok((chunks.0, chunks.1, planner.plan()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::TrainOptions;
    use crate::LlamaConfig;
    use burn_distflash::layers::CheckpointPlacement;

    const H200: u64 = 139 << 30;

    fn planner(world: usize) -> MemoryPlanner {
        let config = LlamaConfig::llama_7b().with_checkpoint(CheckpointPlacement::AttentionOutput);
        MemoryPlanner::new(config, TrainOptions::new(1, 1, 65536), world, 2)
    }

    #[test]
    fn the_longest_sequence_fits_and_one_step_longer_does_not() {
        for world in [1, 2, 4, 8] {
            let planner = planner(world);
            let longest = planner.longest_sequence(H200).unwrap().expect("some fit");
            assert_eq!(longest % (2 * world), 0);
            assert!(planner.at_length(longest).plan().unwrap().fits(H200));
            let next = planner.at_length(longest + 2 * world).plan().unwrap();
            assert!(
                !next.fits(H200),
                "{world} GPUs: {longest} + {} fits too",
                2 * world
            );
        }
        let more = planner(4).longest_sequence(H200).unwrap().unwrap();
        assert!(more > planner(2).longest_sequence(H200).unwrap().unwrap());
        assert_eq!(
            planner(1).longest_sequence(1 << 30).unwrap(),
            None,
            "7B in 1 GiB"
        );
    }

    #[test]
    fn fitting_chunks_are_the_largest_that_fit() {
        let planner = planner(2);
        let (loss, ffn, plan) = planner.fitting_chunks(H200).unwrap();
        assert!(plan.fits(H200));
        assert_eq!(loss, RowChunks::rows(plan.loss_rows as usize).unwrap());
        assert_eq!(ffn, RowChunks::rows(plan.ffn_rows as usize).unwrap());
        for (loss_rows, ffn_rows) in [
            (2 * plan.loss_rows, plan.ffn_rows),
            (plan.loss_rows, 2 * plan.ffn_rows),
        ] {
            if loss_rows <= plan.tokens && ffn_rows <= plan.tokens {
                let bigger = planner
                    .with_chunk_rows(loss_rows, ffn_rows)
                    .unwrap()
                    .plan()
                    .unwrap();
                assert!(!bigger.fits(H200), "{loss_rows}, {ffn_rows} rows fit too");
            }
        }
        let too_long = planner.at_length(1 << 22).fitting_chunks(H200);
        let err = too_long.unwrap_err().to_string();
        assert!(
            err.contains("predicted peak") && err.contains("the longest sequence that fits is"),
            "{err}"
        );
        let err = planner.fitting_chunks(20 << 30).unwrap_err().to_string();
        assert!(err.contains("no sequence fits"), "{err}");
    }
}
