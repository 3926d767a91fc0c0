//! Searches over [`MemoryPlanner`] predictions: the longest sequence whose step fits a GPU, the
//! largest loss and feed-forward chunks that fit, and with them the fewest layers to offload and,
//! where nothing fits otherwise, two layers per checkpoint (what `llama_train --memory auto`
//! trains with). A peak grows with the chunks and falls with every offloaded layer, so those are
//! monotone searches. With the sequence it mostly grows, but a plan counted by CubeCL's pool pages
//! can fall where a buffer outgrows a class's slices and moves to the next class, so the longest
//! sequence is searched past the first length that does not fit ([`longest_fitting`]).

use burn_distflash::layers::{CheckpointPlacement, Offload, RowChunks};

use super::{MemoryPlan, MemoryPlanner};
use crate::format_bytes;
use crate::Error;

/// The share of a GPU's memory a plan may fill. The rest is for what the plan does not count:
/// the CUDA context and libraries (cuBLAS's workspace), the allocator's rounding of every
/// buffer and the free pages between them, small tensors (norm statistics, scalars).
pub const FIT_FRACTION: f64 = 0.9;

/// Sequences longer than this many tokens are not searched.
const LONGEST_SEARCHED: usize = 1 << 34;

/// Lengths [`longest_fitting`] tries past each first length that does not fit, evenly over the
/// next [`PROBED_FRACTION`] of it.
const PROBES: usize = 16;

/// How far past a length that does not fit [`longest_fitting`] looks for one that does, as a
/// share of that length (LLaMA-7B's plans on two H200s with every layer offloaded fall by 4.5
/// GiB at 212,992 tokens and by 8.5 GiB at 458,752; a gap longer than this hides what lies past
/// it).
const PROBED_FRACTION: f64 = 0.25;

/// The most groups of heads `--memory auto` splits attention into (8: a group of LLaMA-7B's
/// 32 heads is then 4 heads, whose products of `[tokens, 512]` still fill the GPU).
pub const AUTO_MAX_HEAD_GROUPS: usize = 8;

/// Rows per chunk below which [`MemoryPlanner::fitting_memory`] offloads one more layer rather
/// than chunk finer: a chunk of 4096 rows keeps the output projection's and the feed-forward's
/// products large enough for the tensor cores (their throughput falls off below a few thousand
/// rows), while offloading a layer costs a few percent of a step at most (its copy overlaps the
/// backward of the layer after it).
pub const AUTO_MIN_CHUNK_ROWS: u64 = 4096;

/// What [`MemoryPlanner::fitting_memory`] chose: the chunks, the offload policy, the layers per
/// checkpoint and their plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FittedMemory {
    /// Rows per chunk of the loss.
    pub loss_chunks: RowChunks,
    /// Rows per chunk of the feed-forward blocks.
    pub ffn_chunks: RowChunks,
    /// Which layers offload their checkpoints.
    pub offload: Offload,
    /// Layers per checkpoint.
    pub layers_per_checkpoint: usize,
    /// Groups of heads attention runs over.
    pub attention_head_groups: usize,
    /// The prediction with them.
    pub plan: MemoryPlan,
}

impl MemoryPlanner {
    /// This planner with `seq_len` as the whole sequence's length.
    fn at_length(&self, seq_len: usize) -> Self {
        let mut planner = self.clone();
        planner.options.seq_len = seq_len;
        planner
    }

    /// This planner with CubeCL's pool classes of a GPU of `gpu_bytes`, unless it has its own
    /// [`gpu_memory`](Self::gpu_memory).
    pub(super) fn on_gpu(&self, gpu_bytes: u64) -> Self {
        let mut planner = self.clone();
        planner.gpu_memory.get_or_insert(gpu_bytes);
        planner
    }

    /// This planner with `offload` as the model's offload policy.
    fn with_offload(&self, offload: Offload) -> Self {
        let mut planner = self.clone();
        planner.config.offload = offload;
        planner
    }

    /// This planner with `layers` layers per checkpoint.
    fn with_layers_per_checkpoint(&self, layers: usize) -> Self {
        let mut planner = self.clone();
        planner.config.layers_per_checkpoint = layers;
        planner
    }

    /// This planner with attention over `groups` groups of heads.
    fn with_attention_head_groups(&self, groups: usize) -> Self {
        let mut planner = self.clone();
        planner.config.attention_head_groups = groups;
        planner
    }

    /// The groups of heads [`fitting_memory`](Self::fitting_memory) tries, in order: the
    /// model's, then (with [`choose_attention_head_groups`](Self::choose_attention_head_groups))
    /// every larger divisor of the key/value heads up to [`AUTO_MAX_HEAD_GROUPS`].
    fn head_group_candidates(&self) -> Vec<usize> {
        let c = &self.config;
        let configured = c.attention_head_groups;
        match self.choose_attention_head_groups {
            false => vec![configured],
            true => (configured..=AUTO_MAX_HEAD_GROUPS.max(configured))
                .filter(|&g| g == configured || c.n_kv_heads.is_multiple_of(g))
                .collect(),
        }
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

    /// Whether this planner's step fits: its chunks out of the top pool class, its peak within
    /// [`FIT_FRACTION`] of `gpu_bytes` and its host memory (offloaded checkpoints, host-resident
    /// optimizer state) within the [`host_limit`](Self::host_limit).
    fn step_fits(&self, gpu_bytes: u64) -> Result<bool, Error> {
        let planner = self.on_gpu(gpu_bytes);
        let plan = planner.plan()?;
        if planner.check_chunks().is_err() {
            return Ok(false);
        }
        Ok(plan.fits(gpu_bytes) && self.host_limit.is_none_or(|limit| plan.host <= limit))
    }

    /// The longest whole sequence (a multiple of `2 * world`, which every layout splits) whose
    /// step fits `gpu_bytes` (and the host limit), with this planner's batch, chunks and
    /// offload; `None` when not even the shortest does.
    ///
    /// # Errors
    ///
    /// Those of [`plan`](Self::plan) other than the sequence's.
    pub fn longest_sequence(&self, gpu_bytes: u64) -> Result<Option<usize>, Error> {
        self.on_gpu(gpu_bytes)
            .longest_where(|planner| planner.step_fits(gpu_bytes))
    }

    /// The longest whole sequence `llama_train --memory auto` can train on a GPU of
    /// `gpu_bytes` ([`fitting_memory`](Self::fitting_memory) with `choose_offload`), and what it
    /// picks there; `None` when not even the shortest fits.
    ///
    /// # Errors
    ///
    /// Those of [`plan`](Self::plan) other than the sequence's.
    pub fn longest_auto_sequence(
        &self,
        gpu_bytes: u64,
        choose_offload: bool,
    ) -> Result<Option<(usize, FittedMemory)>, Error> {
        let this = self.on_gpu(gpu_bytes);
        let fitted = |planner: &Self| match planner.fitting_memory(gpu_bytes, choose_offload) {
            Ok(fitted) => Ok(Some(fitted)),
            Err(Error::Invalid { .. }) => Ok(None),
            Err(other) => Err(other),
        };
        let Some(longest) = this.longest_where(|planner| Ok(fitted(planner)?.is_some()))? else {
            return Ok(None);
        };
        let fitted = fitted(&this.at_length(longest))?.expect("the longest fits");
        Ok(Some((longest, fitted)))
    }

    /// The longest whole sequence (a multiple of `2 * world`) for which `fits` holds, searched
    /// as [`longest_fitting`] says.
    fn longest_where(
        &self,
        fits: impl Fn(&Self) -> Result<bool, Error>,
    ) -> Result<Option<usize>, Error> {
        let granule = 2 * self.world.max(1);
        let longest = longest_fitting(LONGEST_SEARCHED / granule, |units| {
            fits(&self.at_length(units * granule))
        })?;
        Ok(longest.map(|units| units * granule))
    }

    /// The largest rows per chunk of the loss, then of the feed-forward blocks (each the whole
    /// of a GPU's tokens or a power of two below it, and within the [`chunk_caps`](Self::chunk_caps)
    /// that keep their tensors out of the top pool class), whose step fits `gpu_bytes`, and the
    /// plan with them.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] when the step does not fit even with one row per chunk (or its
    /// offloaded checkpoints exceed the host limit), naming the predicted peak and the longest
    /// sequence that fits; those of [`plan`](Self::plan).
    pub fn fitting_chunks(
        &self,
        gpu_bytes: u64,
    ) -> Result<(RowChunks, RowChunks, MemoryPlan), Error> {
        let this = self.on_gpu(gpu_bytes);
        let tokens = this.with_chunk_rows(1, 1)?.plan()?.tokens;
        let smallest = this.with_chunk_rows(1, 1)?;
        if !smallest.step_fits(gpu_bytes)? {
            return Err(this.refusal(gpu_bytes, &smallest.plan()?)?);
        }
        let caps = this.chunk_caps()?;
        let (loss_cap, ffn_cap) = caps.map_or((u64::MAX, u64::MAX), |c| (c.loss_rows, c.ffn_rows));
        let largest = |cap: u64, fits: &dyn Fn(u64) -> Result<bool, Error>| -> Result<u64, Error> {
            let candidates = std::iter::once(tokens)
                .chain(
                    (0..u64::BITS)
                        .rev()
                        .map(|bit| 1u64 << bit)
                        .filter(|&c| c < tokens),
                )
                .filter(|&c| c <= cap);
            for rows in candidates {
                if fits(rows)? {
                    return Ok(rows);
                }
            }
            Ok(1)
        };
        let loss = largest(loss_cap, &|rows| {
            this.with_chunk_rows(rows, 1)?.step_fits(gpu_bytes)
        })?;
        let ffn = largest(ffn_cap, &|rows| {
            this.with_chunk_rows(loss, rows)?.step_fits(gpu_bytes)
        })?;
        let planner = this.with_chunk_rows(loss, ffn)?;
        let chunks = (planner.options.loss_chunks, planner.options.ffn_chunks);
        Ok((chunks.0, chunks.1, planner.plan()?))
    }

    /// Why no sequence fits: the host memory even the shortest needs is more than a GPU's share
    /// of the host, or the weights and optimizer state alone do not fit the GPU.
    pub(super) fn why_nothing_fits(&self) -> Result<String, Error> {
        let shortest = self.at_length(2 * self.world.max(1)).plan()?;
        Ok(
            match self.host_limit.filter(|&limit| shortest.host > limit) {
                Some(limit) => format!(
                "no sequence fits: the host memory even the shortest needs ({}) is more than a \
                 GPU's share of the host, {}",
                format_bytes(shortest.host),
                format_bytes(limit)
            ),
                None => "no sequence fits: the weights and optimizer state alone do not".into(),
            },
        )
    }

    /// Why a step whose smallest-chunk plan is `smallest` does not fit: the GPU's memory or the
    /// host's, with the longest sequence that fits.
    fn refusal(&self, gpu_bytes: u64, smallest: &MemoryPlan) -> Result<Error, Error> {
        let longest = match self.longest_sequence(gpu_bytes)? {
            Some(len) => format!("the longest sequence that fits is {len} tokens"),
            None => self.why_nothing_fits()?,
        };
        if let Some(limit) = self.host_limit.filter(|&limit| smallest.host > limit) {
            return Ok(Error::invalid(
                "the host memory of the offloaded checkpoints and optimizer state",
                format!("at most {} per GPU ({longest})", format_bytes(limit)),
                format_bytes(smallest.host),
            ));
        }
        Ok(Error::invalid(
            "the training step's memory",
            format!(
                "at most {:.0}% of the GPU's {} ({longest})",
                FIT_FRACTION * 100.0,
                format_bytes(gpu_bytes)
            ),
            format!(
                "a predicted peak of {} with 1-row chunks",
                format_bytes(smallest.peak)
            ),
        ))
    }

    /// The settings `llama_train --memory auto` trains with on a GPU of `gpu_bytes`: the largest
    /// chunks that fit ([`fitting_chunks`](Self::fitting_chunks)) and, when `choose_offload`
    /// (no policy was given), the fewest offloaded layers with which both chunks keep at least
    /// [`AUTO_MIN_CHUNK_ROWS`] rows (or all of a GPU's tokens, if fewer); failing that, the
    /// fewest offloaded layers with which any chunks fit. The last layers stay on the GPU (the
    /// backward needs them first); the offloaded checkpoints stay within the
    /// [`host_limit`](Self::host_limit). Without `choose_offload` the model's own policy is kept.
    /// Where nothing fits with one layer per checkpoint at the `Layer` placement (the host's
    /// memory too small for the offloaded checkpoints, typically) and
    /// [`choose_layers_per_checkpoint`](Self::choose_layers_per_checkpoint), the same with two
    /// layers per checkpoint (half the checkpoints). At each layers per checkpoint, with
    /// [`choose_attention_head_groups`](Self::choose_attention_head_groups), attention over more
    /// groups of heads is tried before two layers per checkpoint where fewer fit nothing
    /// (groups cost next to nothing; a pair recomputes its first block's non-attention forward).
    ///
    /// # Errors
    ///
    /// That of [`fitting_chunks`](Self::fitting_chunks) with the most offload tried at the
    /// model's layers per checkpoint, when nothing fits; those of [`plan`](Self::plan).
    pub fn fitting_memory(
        &self,
        gpu_bytes: u64,
        choose_offload: bool,
    ) -> Result<FittedMemory, Error> {
        let c = &self.config;
        let may_pair = self.choose_layers_per_checkpoint
            && c.checkpoint == CheckpointPlacement::Layer
            && c.layers_per_checkpoint == 1;
        let layers = match may_pair {
            true => vec![1, 2],
            false => vec![c.layers_per_checkpoint],
        };
        let groups = self.head_group_candidates();
        let mut refused = None;
        for layers in layers {
            for &groups in &groups {
                let planner =
                    (self.with_layers_per_checkpoint(layers)).with_attention_head_groups(groups);
                match planner.fitting_memory_as_configured(gpu_bytes, choose_offload) {
                    Err(e @ Error::Invalid { .. }) => {
                        refused.get_or_insert(e);
                    }
                    fitted => return fitted,
                }
            }
        }
        Err(refused.expect("at least one setting is tried"))
    }

    /// [`fitting_memory`](Self::fitting_memory) with the model's layers per checkpoint.
    fn fitting_memory_as_configured(
        &self,
        gpu_bytes: u64,
        choose_offload: bool,
    ) -> Result<FittedMemory, Error> {
        let this = self.on_gpu(gpu_bytes);
        let layers = self.config.n_layers;
        let choose = choose_offload && self.config.checkpoint != CheckpointPlacement::None;
        let policies: Vec<Offload> = match choose {
            true => (0..=layers)
                .rev()
                .map(|kept| match kept {
                    k if k == layers => Offload::Off,
                    0 => Offload::All,
                    k => Offload::AllButLast(k),
                })
                .collect(),
            false => vec![self.config.offload],
        };
        let wanted = AUTO_MIN_CHUNK_ROWS.min(this.with_chunk_rows(1, 1)?.plan()?.tokens);
        let mut fallback = None;
        let mut most_offload_tried = None;
        for offload in policies {
            let planner = this.with_offload(offload);
            most_offload_tried = Some(planner.clone());
            // The quick test first: one-row chunks (the smallest peak) must fit.
            if !planner.with_chunk_rows(1, 1)?.step_fits(gpu_bytes)? {
                continue;
            }
            let (loss_chunks, ffn_chunks, plan) = planner.fitting_chunks(gpu_bytes)?;
            let fitted = FittedMemory {
                loss_chunks,
                ffn_chunks,
                offload,
                layers_per_checkpoint: self.config.layers_per_checkpoint,
                attention_head_groups: self.config.attention_head_groups,
                plan,
            };
            if plan.loss_rows >= wanted && plan.ffn_rows >= wanted {
                return Ok(fitted);
            }
            fallback.get_or_insert(fitted);
        }
        match (fallback, most_offload_tried) {
            (Some(fitted), _) => Ok(fitted),
            (None, Some(planner)) => {
                let smallest = planner.with_chunk_rows(1, 1)?.plan()?;
                Err(planner.refusal(gpu_bytes, &smallest)?)
            }
            (None, None) => unreachable!("at least one offload policy is tried"),
        }
    }
}

/// The largest `units` in `1..=max_units` for which `fits` holds, `None` when 1 does not fit.
/// Doubling then bisection find where the lengths that fit end; then [`PROBES`] lengths spread
/// over the next [`PROBED_FRACTION`] are tried, and the search goes on from the longest of them
/// that fits. So a length that fits is found past a gap of lengths that do not, as long as the
/// gap is narrower than that fraction of where it starts and the lengths that fit past it span
/// more than the probes' spacing (a sixteenth of the fraction).
fn longest_fitting(
    max_units: usize,
    mut fits: impl FnMut(usize) -> Result<bool, Error>,
) -> Result<Option<usize>, Error> {
    if max_units == 0 || !fits(1)? {
        return Ok(None);
    }
    // `low` fits; `high` does not (or is past the search).
    let mut low = 1;
    loop {
        let mut high = low * 2;
        while high <= max_units && fits(high)? {
            low = high;
            high *= 2;
        }
        high = high.min(max_units + 1);
        while high - low > 1 {
            let middle = low + (high - low) / 2;
            match fits(middle)? {
                true => low = middle,
                false => high = middle,
            }
        }
        let reach = ((high as f64 * PROBED_FRACTION) as usize).max(PROBES);
        let probes = (1..=PROBES)
            .map(|i| high + reach * i / PROBES)
            .filter(|&units| units <= max_units);
        let mut beyond = None;
        for units in probes.rev() {
            if fits(units)? {
                beyond = Some(units);
                break;
            }
        }
        match beyond {
            Some(units) => low = units,
            None => return Ok(Some(low)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::TrainOptions;
    use crate::LlamaConfig;

    const H200: u64 = 139 << 30;

    fn planner(world: usize) -> MemoryPlanner {
        let config = LlamaConfig::llama_7b().with_checkpoint(CheckpointPlacement::AttentionOutput);
        MemoryPlanner::new(config, TrainOptions::new(1, 1, 65536), world, 2)
    }

    #[test]
    fn the_longest_sequence_fits_and_one_step_longer_does_not() {
        for world in [1, 2, 4, 8] {
            // On the H200's pool classes, as the search plans: the largest sliced class's
            // buffers are counted by pages there, and a plan without the classes differs.
            let planner = planner(world).on_gpu(H200);
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
    fn the_longest_search_ends_where_the_lengths_that_fit_end() {
        assert_eq!(
            longest_fitting(1 << 20, |u| Ok(u <= 1000)).unwrap(),
            Some(1000)
        );
        assert_eq!(longest_fitting(37, |_| Ok(true)).unwrap(), Some(37));
        assert_eq!(longest_fitting(1 << 20, |u| Ok(u == 0)).unwrap(), None);
        assert_eq!(longest_fitting(0, |_| Ok(true)).unwrap(), None);
        // Few plans: doubling, bisection and one round of probes.
        let mut calls = 0;
        let longest = longest_fitting(1 << 32, |u| {
            calls += 1;
            Ok(u <= 262_143)
        });
        assert_eq!(longest.unwrap(), Some(262_143));
        assert!(calls <= 2 * 19 + PROBES + 2, "{calls} plans");
    }

    #[test]
    fn the_longest_search_looks_past_a_gap_of_lengths_that_do_not_fit() {
        // Within a quarter past the first length that does not fit (which bisection alone,
        // landing on 96, 112, 104, 100, 102 and 101, stops at): found.
        let fits = |u: usize| Ok(u <= 100 || (118..=122).contains(&u));
        assert_eq!(longest_fitting(1 << 20, fits).unwrap(), Some(122));
        // Past it again: found too.
        let fits = |u: usize| Ok(u <= 100 || (118..=122).contains(&u) || (140..=145).contains(&u));
        assert_eq!(longest_fitting(1 << 20, fits).unwrap(), Some(145));
        // Beyond a gap longer than that: not searched.
        let fits = |u: usize| Ok(u <= 100 || (200..=300).contains(&u));
        assert_eq!(longest_fitting(1 << 20, fits).unwrap(), Some(100));
    }

    #[test]
    fn the_longest_sequence_is_found_past_a_fall_of_the_paged_plan() {
        use crate::optimizer::{StatePlacement, ZeroStage};
        // LLaMA-7B on two H200s, ZeRO 2 with the state in host memory, every layer's Layer
        // checkpoint offloaded: at 212,992 tokens the plan counted by pages falls by 4.5 GiB
        // (82.85 to 78.30), so with 80 GiB to fill the lengths that fit stop before 196,608
        // and start again.
        let mut planner = planner(2).on_gpu(H200);
        planner.config.checkpoint = CheckpointPlacement::Layer;
        planner.config.offload = Offload::All;
        planner.options = (planner.options.clone())
            .with_zero(ZeroStage::Gradients)
            .with_optimizer_state(StatePlacement::Host)
            .with_loss_chunks(RowChunks::rows(32768).unwrap())
            .with_ffn_chunks(RowChunks::rows(65536).unwrap());
        let gpu = (80.0 / FIT_FRACTION * (1u64 << 30) as f64) as u64;
        let fits = |tokens: usize| planner.at_length(tokens).step_fits(gpu).unwrap();
        assert!(fits(188_416) && !fits(196_608) && fits(212_992));
        let longest = planner.longest_sequence(gpu).unwrap().expect("some fit");
        assert!(longest > 212_992, "{longest}");
        assert!(fits(longest) && !fits(longest + 4), "{longest}");
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

    #[test]
    fn auto_offloads_the_fewest_layers_that_keep_the_chunks_large() {
        // 192K tokens per GPU: the checkpoints and attention's distributed backward outgrow
        // an H200.
        let planner = planner(2).at_length(3 << 17);
        assert!(
            planner.fitting_chunks(H200).is_err(),
            "fits without offload"
        );
        let fitted = planner.fitting_memory(H200, true).unwrap();
        let Offload::AllButLast(kept) = fitted.offload else {
            panic!("expected some layers kept on the GPU: {:?}", fitted.offload);
        };
        assert!(fitted.plan.fits(H200));
        assert!(fitted.plan.loss_rows >= AUTO_MIN_CHUNK_ROWS);
        assert!(fitted.plan.ffn_rows >= AUTO_MIN_CHUNK_ROWS);
        assert_eq!(fitted.plan.offloaded_checkpoints, 32 - kept as u64);
        // One more layer kept on the GPU does not fit with chunks that large.
        let large = |p: &MemoryPlan| {
            p.loss_rows >= AUTO_MIN_CHUNK_ROWS && p.ffn_rows >= AUTO_MIN_CHUNK_ROWS
        };
        let closer = planner.with_offload(Offload::AllButLast(kept + 1));
        assert!(!closer
            .fitting_chunks(H200)
            .is_ok_and(|(_, _, plan)| large(&plan)));
        // A short sequence offloads nothing.
        let short = planner
            .at_length(1 << 14)
            .fitting_memory(H200, true)
            .unwrap();
        assert_eq!(short.offload, Offload::Off);
        // A policy given is kept, and what does not fit with it is refused.
        assert!(planner.fitting_memory(H200, false).is_err());
        let all = planner.with_offload(Offload::All);
        assert_eq!(
            all.fitting_memory(H200, false).unwrap().offload,
            Offload::All
        );
        // A host too small for the checkpoints keeps more of them on the GPU.
        let mut small_host = planner.clone();
        small_host.host_limit = Some(fitted.plan.host / 2);
        let kept_more = small_host.fitting_memory(H200, true);
        assert!(kept_more.is_err(), "{kept_more:?}");
        let err = kept_more.unwrap_err().to_string();
        assert!(err.contains("host memory"), "{err}");
        small_host.host_limit = Some(fitted.plan.host);
        assert_eq!(small_host.fitting_memory(H200, true).unwrap(), fitted);
        // The longest sequence --memory auto trains is longer than without offload.
        let (auto, picked) = planner.longest_auto_sequence(H200, true).unwrap().unwrap();
        assert!(auto > planner.longest_sequence(H200).unwrap().unwrap());
        assert!(picked.plan.fits(H200));
        assert!(planner
            .at_length(auto + 4)
            .fitting_memory(H200, true)
            .is_err());
        // Nothing fits: the refusal with every layer offloaded names the longest that fits.
        let err = planner
            .at_length(1 << 26)
            .fitting_memory(H200, true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("the longest sequence that fits is"), "{err}");
    }

    #[test]
    fn auto_pairs_the_layers_only_where_nothing_fits_with_one_per_checkpoint() {
        // Layer checkpoints at 192K tokens per GPU: some layers must offload.
        let mut planner = planner(2).at_length(3 << 17);
        planner.config.checkpoint = CheckpointPlacement::Layer;
        let one = planner.fitting_memory(H200, true).unwrap();
        assert_eq!(one.layers_per_checkpoint, 1);
        assert!(one.plan.offloaded_checkpoints > 0, "{:?}", one.offload);
        // A host with half the memory: nothing fits with one layer per checkpoint, and
        // without the choice the refusal stands.
        planner.host_limit = Some(one.plan.host / 2);
        let refused = planner.fitting_memory(H200, true).unwrap_err().to_string();
        assert!(refused.contains("host memory"), "{refused}");
        planner.choose_layers_per_checkpoint = true;
        let paired = planner.fitting_memory(H200, true).unwrap();
        assert_eq!(paired.layers_per_checkpoint, 2);
        assert_eq!(paired.plan.layers_per_checkpoint, 2);
        assert!(paired.plan.fits(H200) && paired.plan.host <= one.plan.host / 2);
        // Where one layer per checkpoint fits, it is kept; at another placement too.
        planner.host_limit = None;
        assert_eq!(planner.fitting_memory(H200, true).unwrap(), one);
        planner.host_limit = Some(one.plan.host / 2);
        planner.config.checkpoint = CheckpointPlacement::AttentionOutput;
        let fitted = planner.fitting_memory(H200, true);
        assert!(fitted.is_err() || fitted.unwrap().layers_per_checkpoint == 1);
    }

    #[test]
    fn auto_runs_attention_in_more_head_groups_before_pairing_the_layers() {
        use crate::optimizer::{StatePlacement, ZeroStage};
        // 786,432 tokens over two GPUs, Layer checkpoints, ZeRO 2 with the state in host
        // memory: attention's backward over all heads at once does not fit an H200.
        let mut planner = planner(2).at_length(3 << 18);
        planner.config.checkpoint = CheckpointPlacement::Layer;
        planner.options = (planner.options.clone())
            .with_zero(ZeroStage::Gradients)
            .with_optimizer_state(StatePlacement::Host);
        planner.host_limit = Some(400 << 30);
        assert!(planner.fitting_memory(H200, true).is_err());
        // With the choice, more groups of heads, and one layer per checkpoint where the host
        // holds every layer's checkpoint.
        planner.choose_attention_head_groups = true;
        planner.choose_layers_per_checkpoint = true;
        let grouped = planner.fitting_memory(H200, true).unwrap();
        assert_eq!(grouped.layers_per_checkpoint, 1);
        assert!(grouped.attention_head_groups > 1, "{grouped:?}");
        assert_eq!(
            grouped.plan.sequence_parallel * grouped.attention_head_groups as u64,
            {
                let all_heads = planner
                    .with_attention_head_groups(1)
                    .with_offload(grouped.offload);
                all_heads.plan().unwrap().sequence_parallel
            }
        );
        assert!(grouped.plan.fits(H200));
        // A host of 121 GiB per GPU: two layers per checkpoint as well.
        planner.host_limit = Some(121 << 30);
        let paired = planner.fitting_memory(H200, true).unwrap();
        assert_eq!(paired.layers_per_checkpoint, 2);
        assert!(paired.attention_head_groups > 1, "{paired:?}");
        assert!(paired.plan.fits(H200) && paired.plan.host <= 121 << 30);
        // Only divisors of the key/value heads, at most AUTO_MAX_HEAD_GROUPS.
        assert_eq!(planner.head_group_candidates(), vec![1, 2, 4, 8]);
        planner.config.n_kv_heads = 12;
        assert_eq!(planner.head_group_candidates(), vec![1, 2, 3, 4, 6]);
    }
}
