//! [`MemoryPlanner::report`]: a plan as a person reads it (what `llama_train --plan` prints):
//! the setting, the bytes by kind, and against a GPU's memory whether the step fits, the longest
//! sequence that does with this offload policy, what `--memory auto` would train with, and the
//! longest sequence it can train.

use std::fmt::Write;

use std::fmt;

use super::{FittedMemory, MemoryPlanner, FIT_FRACTION};
use crate::{format_bytes, Error};

impl MemoryPlanner {
    /// The plan's text, and with `gpu_bytes` the fit against that memory; `choose_offload` as
    /// for [`fitting_memory`](Self::fitting_memory) (whether `--memory auto` may pick the
    /// offloaded layers).
    ///
    /// # Errors
    ///
    /// Those of [`plan`](Self::plan), [`longest_sequence`](Self::longest_sequence) and
    /// [`fitting_memory`](Self::fitting_memory) other than not fitting (which the text says).
    pub fn report(&self, gpu_bytes: Option<u64>, choose_offload: bool) -> Result<String, Error> {
        match gpu_bytes {
            Some(gpu) => self.on_gpu(gpu).report_on(gpu_bytes, choose_offload),
            None => self.report_on(None, choose_offload),
        }
    }

    /// [`report`](Self::report) with the pool classes, if any, already set.
    fn report_on(&self, gpu_bytes: Option<u64>, choose_offload: bool) -> Result<String, Error> {
        let (c, o) = (&self.config, &self.options);
        let plan = self.plan()?;
        let mut text = format!(
            "memory plan per GPU: {} layers, d_model {}, {} heads / {} kv, d_ff {}, vocab {}; \
             {} x {} tokens over {} GPU(s); {}-byte elements; ZeRO stage {}; checkpoint {:?}; \
             {} layer(s) per checkpoint; {} group(s) of heads; offload {:?}\n{plan}\n",
            c.n_layers,
            c.d_model,
            c.n_heads,
            c.n_kv_heads,
            c.d_ff,
            c.vocab_size,
            o.batch,
            o.seq_len,
            self.world,
            self.elem_bytes,
            o.zero,
            c.checkpoint,
            c.layers_per_checkpoint,
            c.attention_head_groups,
            c.offload,
        );
        let Some(gpu) = gpu_bytes else {
            return Ok(text);
        };
        let usable = format!("{:.0}% of {}", FIT_FRACTION * 100.0, format_bytes(gpu));
        let verdict = match plan.fits(gpu) {
            true => "fits",
            false => "does not fit",
        };
        let _ = writeln!(text, "this step {verdict} in {usable}");
        if let (Some(caps), Some(total)) = (self.chunk_caps()?, self.gpu_memory) {
            let pools = super::PoolClasses::cuda(total);
            let _ = writeln!(
                text,
                "chunks kept out of CubeCL's top pool class (pages of {}): loss at most {} rows \
                 (f32 logits within the largest sliced class's {} a buffer), feed-forward at \
                 most {} rows",
                format_bytes(pools.top().page),
                caps.loss_rows,
                format_bytes(pools.largest_sliced_slice()),
                caps.ffn_rows
            );
        }
        if let Err(refused) = self.check_chunks() {
            let _ = writeln!(text, "training refuses these chunks: {refused}");
        }
        if let Some(limit) = self.host_limit {
            let _ = writeln!(
                text,
                "host memory for offloaded checkpoints and optimizer state: at most {} per GPU",
                format_bytes(limit)
            );
        }
        let _ = match self.longest_sequence(gpu)? {
            Some(len) => writeln!(
                text,
                "longest sequence that fits (these chunks, this offload): {len} tokens ({} per \
                 GPU)",
                len / self.world
            ),
            None => writeln!(text, "{}", self.why_nothing_fits()?),
        };
        let _ = match self.fitting_memory(gpu, choose_offload) {
            Ok(fitted) => writeln!(text, "--memory auto: {}", Picked(&fitted)),
            Err(Error::Invalid { expected, got, .. }) => {
                writeln!(
                    text,
                    "--memory auto: nothing fits: {got}, against {expected}"
                )
            }
            Err(other) => return Err(other),
        };
        let _ = match self.longest_auto_sequence(gpu, choose_offload)? {
            Some((len, fitted)) => write!(
                text,
                "longest sequence --memory auto trains: {len} tokens ({} per GPU), with {}",
                len / self.world,
                Picked(&fitted)
            ),
            None => write!(text, "longest sequence --memory auto trains: none"),
        };
        Ok(text)
    }
}

/// What `--memory auto` picked, on one line.
struct Picked<'a>(&'a FittedMemory);

impl fmt::Display for Picked<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plan = &self.0.plan;
        write!(
            f,
            "loss chunks of {} rows, feed-forward chunks of {} rows, offload {:?}, {} layer(s) \
             per checkpoint, {} group(s) of heads (peak {}, host {})",
            plan.loss_rows,
            plan.ffn_rows,
            self.0.offload,
            self.0.layers_per_checkpoint,
            self.0.attention_head_groups,
            format_bytes(plan.peak),
            format_bytes(plan.host)
        )
    }
}
