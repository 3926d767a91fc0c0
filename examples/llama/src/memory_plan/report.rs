//! [`MemoryPlanner::report`]: a plan as a person reads it (what `llama_train --plan` prints):
//! the setting, the bytes by kind, and against a GPU's memory whether the step fits, the longest
//! sequence that does, and the largest chunks that do.

use std::fmt::Write;

use super::{MemoryPlanner, FIT_FRACTION};
use crate::{format_bytes, Error};

impl MemoryPlanner {
    /// The plan's text, and with `gpu_bytes` the fit against that memory.
    ///
    /// # Errors
    ///
    /// Those of [`plan`](Self::plan), [`longest_sequence`](Self::longest_sequence) and
    /// [`fitting_chunks`](Self::fitting_chunks) other than not fitting (which the text says).
    pub fn report(&self, gpu_bytes: Option<u64>) -> Result<String, Error> {
        let (c, o) = (&self.config, &self.options);
        let plan = self.plan()?;
        let mut text = format!(
            "memory plan per GPU: {} layers, d_model {}, {} heads / {} kv, d_ff {}, vocab {}; \
             {} x {} tokens over {} GPU(s); {}-byte elements; ZeRO stage {}; checkpoint {:?}; \
             {} layer(s) offloaded\n{plan}\n",
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
            self.offloaded_layers,
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
        let _ = match self.longest_sequence(gpu)? {
            Some(len) => writeln!(
                text,
                "longest sequence that fits (these chunks): {len} tokens ({} per GPU)",
                len / self.world
            ),
            None => writeln!(
                text,
                "no sequence fits: the weights and optimizer state alone do not"
            ),
        };
        let _ = match self.fitting_chunks(gpu) {
            Ok((_, _, fitted)) => write!(
                text,
                "largest chunks that fit: loss {} rows, feed-forward {} rows (peak {})",
                fitted.loss_rows,
                fitted.ffn_rows,
                format_bytes(fitted.peak)
            ),
            Err(Error::Invalid { expected, got, .. }) => {
                write!(text, "no chunks fit: {got}, against {expected}")
            }
            Err(other) => return Err(other),
        };
        Ok(text)
    }
}
