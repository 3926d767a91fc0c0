//! The largest loss and feed-forward chunks whose big tensors stay out of the top class of
//! CubeCL's pools ([`PoolClasses`]): a chunk's f32 logits (`rows x vocab x 4` bytes) and its
//! `[rows, d_ff]` feed-forward tensors within the largest sliced class's largest slice. A larger
//! chunk takes a page of the top class (a quarter of the GPU) that only buffers as large can
//! reuse, which the rest of the step cannot use.

use burn_distflash::layers::CheckpointPlacement;

use super::activations::Widths;
use super::pool_classes::PoolClasses;
use super::MemoryPlanner;
use crate::{format_bytes, Error};

/// Bytes of f32.
const F32: u64 = 4;

/// The most rows per chunk of the loss and of the feed-forward blocks that keep their largest
/// tensors out of the top class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkCaps {
    /// Rows per chunk of the loss: f32 logits of `rows x vocab`.
    pub loss_rows: u64,
    /// Rows per chunk of the feed-forward blocks: `[rows, d_ff]` tensors of the activations'
    /// type.
    pub ffn_rows: u64,
}

impl ChunkCaps {
    /// The caps for `widths` on `pools`; `None` when the device has no sliced class (every
    /// buffer goes to the top class).
    pub(crate) fn of(pools: &PoolClasses, widths: &Widths) -> Option<Self> {
        let slice = pools.largest_sliced()?.max_slice;
        Some(Self {
            loss_rows: (slice / (F32 * widths.vocab).max(1)).max(1),
            ffn_rows: (slice / (widths.elem * widths.hidden).max(1)).max(1),
        })
    }
}

impl MemoryPlanner {
    /// The chunk caps on a GPU of [`gpu_memory`](Self::gpu_memory); `None` without it (or on a
    /// device with no sliced class).
    ///
    /// # Errors
    ///
    /// Those of an unbuildable configuration (as [`plan`](Self::plan)'s).
    pub fn chunk_caps(&self) -> Result<Option<ChunkCaps>, Error> {
        let Some(pools) = self.pool_classes() else {
            return Ok(None);
        };
        Ok(ChunkCaps::of(&pools, &self.widths()?))
    }

    /// Refuses this planner's chunks where their largest tensors land in the top pool class of
    /// a GPU of [`gpu_memory`](Self::gpu_memory) (nothing to refuse without it), naming the
    /// option and the most rows allowed: what training checks before it starts.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for such chunks; those of [`plan`](Self::plan).
    pub fn check_chunks(&self) -> Result<(), Error> {
        let Some(pools) = self.pool_classes() else {
            return Ok(());
        };
        self.check()?;
        let widths = self.widths()?;
        let rows = (self.options.batch * self.options.seq_len / self.world) as u64;
        let (loss, ffn) = (self.loss_rows(&widths, rows), self.ffn_rows(&widths, rows));
        self.check_chunk_classes(&pools, &widths, loss, ffn)
    }

    /// Refuses loss chunks of `loss_rows` rows or feed-forward chunks of `ffn_rows` rows whose
    /// largest tensors land in `pools`' top class, naming the option and the most rows allowed.
    fn check_chunk_classes(
        &self,
        pools: &PoolClasses,
        widths: &Widths,
        loss_rows: u64,
        ffn_rows: u64,
    ) -> Result<(), Error> {
        let Some(caps) = ChunkCaps::of(pools, widths) else {
            return Ok(());
        };
        let gpu = format_bytes(self.gpu_memory.unwrap_or(0));
        let slice = format_bytes(pools.largest_sliced_slice());
        let top = format_bytes(pools.top().page);
        let refuse = |what: &str, flag: &str, cap: u64, rows: u64, tensor: String| {
            Error::invalid(
                format!("the {what} chunk"),
                format!(
                    "at most {cap} rows on a GPU of {gpu} ({flag} {cap} or fewer, or --memory \
                     auto): {tensor} must stay within CubeCL's largest sliced pool class ({slice} \
                     a buffer); a larger one takes a top-class page of {top} that only buffers as \
                     large reuse"
                ),
                format!("{rows} rows"),
            )
        };
        if loss_rows > caps.loss_rows {
            let tensor = format!(
                "its f32 logits (rows x vocab {} x 4 bytes, {} here)",
                widths.vocab,
                format_bytes(loss_rows * widths.vocab * F32)
            );
            return Err(refuse(
                "loss",
                "--loss-chunk",
                caps.loss_rows,
                loss_rows,
                tensor,
            ));
        }
        // Without checkpoints the graph runs the feed-forward whole: no chunk to choose.
        let chunked = self.config.checkpoint != CheckpointPlacement::None;
        if chunked && ffn_rows > caps.ffn_rows {
            let tensor = format!(
                "its [rows, d_ff {}] tensors ({} here)",
                widths.hidden,
                format_bytes(ffn_rows * widths.hidden * widths.elem)
            );
            return Err(refuse(
                "feed-forward",
                "--ffn-chunk",
                caps.ffn_rows,
                ffn_rows,
                tensor,
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::TrainOptions;
    use crate::LlamaConfig;
    use burn_distflash::layers::RowChunks;

    const GPU: u64 = 139 << 30;

    /// LLaMA-7B over two GPUs at `seq_len`, chunks of `loss` and `ffn` rows.
    fn planner(seq_len: usize, loss: usize, ffn: usize, gpu: Option<u64>) -> MemoryPlanner {
        let config = LlamaConfig::llama_7b().with_checkpoint(CheckpointPlacement::AttentionOutput);
        let mut options = TrainOptions::new(1, 1, seq_len);
        options.loss_chunks = RowChunks::rows(loss).unwrap();
        options.ffn_chunks = RowChunks::rows(ffn).unwrap();
        let mut planner = MemoryPlanner::new(config, options, 2, 2);
        planner.gpu_memory = gpu;
        planner
    }

    #[test]
    fn the_caps_keep_the_f32_logits_and_the_feed_forward_rows_within_the_largest_slice() {
        let caps = planner(1 << 17, 1, 1, Some(GPU))
            .chunk_caps()
            .unwrap()
            .unwrap();
        let slice = PoolClasses::cuda(GPU).largest_sliced_slice();
        assert_eq!(caps.loss_rows, slice / (4 * 32000));
        assert_eq!(caps.ffn_rows, slice / (2 * 11008));
        assert!(caps.loss_rows * 32000 * 4 <= slice && (caps.loss_rows + 1) * 32000 * 4 > slice);
        assert_eq!(planner(1 << 17, 1, 1, None).chunk_caps().unwrap(), None);
    }

    #[test]
    fn chunks_in_the_top_class_are_refused_naming_the_option_and_the_cap() {
        let caps = planner(1 << 17, 1, 1, Some(GPU))
            .chunk_caps()
            .unwrap()
            .unwrap();
        // 65,536 rows of f32 logits: 7.81 GiB, beyond the largest slice.
        let err = planner(1 << 17, 65536, 1, Some(GPU))
            .check_chunks()
            .unwrap_err()
            .to_string();
        let cap = format!("at most {} rows", caps.loss_rows);
        assert!(err.contains("--loss-chunk") && err.contains(&cap), "{err}");
        assert!(
            err.contains("65536 rows") && err.contains("top-class page"),
            "{err}"
        );
        // The loss's cap itself passes; the feed-forward's chunk is refused above its cap.
        let loss_ok = planner(1 << 17, caps.loss_rows as usize, 1, Some(GPU));
        loss_ok.check_chunks().unwrap();
        let tokens = 2 * (caps.ffn_rows as usize + 2);
        let err = planner(tokens, 1024, tokens, Some(GPU))
            .check_chunks()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--ffn-chunk") && err.contains("d_ff 11008"),
            "{err}"
        );
        // Without checkpoints the feed-forward runs whole: nothing to choose, nothing refused.
        let mut whole = planner(tokens, 1024, tokens, Some(GPU));
        whole.config = whole.config.with_checkpoint(CheckpointPlacement::None);
        whole.check_chunks().unwrap();
        // Without the GPU's memory the classes are unknown: nothing refused.
        planner(1 << 17, 65536, 65536, None).check_chunks().unwrap();
    }

    #[test]
    fn memory_auto_picks_chunks_within_the_caps() {
        for seq in [1 << 16, 1 << 17, 1 << 18] {
            let planner = planner(seq, 1, 1, None);
            let fitted = planner.fitting_memory(GPU, true).unwrap();
            let caps = planner.on_gpu(GPU).chunk_caps().unwrap().unwrap();
            assert!(fitted.plan.loss_rows <= caps.loss_rows, "{seq}: {fitted:?}");
            assert!(fitted.plan.ffn_rows <= caps.ffn_rows, "{seq}: {fitted:?}");
            assert_eq!(fitted.plan.class_pages.largest_top_buffer, 0, "{seq}");
            let report = planner.report(Some(GPU), true).unwrap();
            let line = format!("loss at most {} rows", caps.loss_rows);
            assert!(report.contains(&line), "{report}");
            assert!(!report.contains("training refuses"), "{report}");
        }
        let refused = planner(1 << 17, 65536, 1, None)
            .report(Some(GPU), true)
            .unwrap();
        assert!(
            refused.contains("training refuses these chunks"),
            "{refused}"
        );
    }
}
