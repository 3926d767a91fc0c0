//! Training progress on standard error: on a terminal an indicatif bar redrawn in place
//! (`[####......]  70/100  loss 2.314  1,234 tok/s  eta 42s`); elsewhere (CI logs, files) one
//! plain line every few steps and at the last, whose fields a program can read:
//! `step 70/100  loss 2.3141  tokens/s 1234  eta 00:00:42`.

use std::io::{self, IsTerminal, Write};
use std::time::Duration;

use indicatif::{FormattedDuration, HumanCount, ProgressDrawTarget, ProgressStyle};

/// One plain progress line (no newline): `step S/T  loss L  tokens/s R  eta E`, the loss to 4
/// decimals, the throughput a whole number, the time left as `HH:MM:SS` (`?` before it can be
/// estimated).
pub fn progress_line(
    step: u64,
    total: u64,
    loss: f64,
    tokens_per_s: f64,
    eta: Option<Duration>,
) -> String {
    let eta = eta.map_or_else(|| "?".to_string(), |eta| FormattedDuration(eta).to_string());
    format!("step {step}/{total}  loss {loss:.4}  tokens/s {tokens_per_s:.0}  eta {eta}")
}

/// Training progress on standard error: a bar redrawn in place when standard error is a
/// terminal, otherwise a [`progress_line`] every `print_every` steps and at the last. A group
/// shows one: the leader's (the caller makes the bar on rank 0 only).
///
/// Write errors are ignored: progress output must never stop training.
#[derive(Debug)]
pub struct ProgressBar {
    bar: indicatif::ProgressBar,
    total: u64,
    print_every: u64,
    terminal: bool,
}

impl ProgressBar {
    /// A bar for `total` steps that prints a line every `print_every` steps (0 counts as 1)
    /// when standard error is not a terminal. The clock starts now.
    pub fn new(total: u64, print_every: u64) -> Self {
        Self::with_terminal(total, print_every, io::stderr().is_terminal())
    }

    /// [`ProgressBar::new`] drawing in place if `terminal` is true, plain lines if false.
    pub fn with_terminal(total: u64, print_every: u64, terminal: bool) -> Self {
        let target = match terminal {
            true => ProgressDrawTarget::stderr(),
            false => ProgressDrawTarget::hidden(),
        };
        // The bar, the step, the message (loss and throughput), the time left.
        let digits = total.to_string().len();
        let template = format!("[{{bar:30}}] {{pos:>{digits}}}/{{len}}  {{msg}}  eta {{eta}}");
        let style = ProgressStyle::with_template(&template)
            .expect("the template is valid")
            .progress_chars("#.");
        let bar = indicatif::ProgressBar::with_draw_target(Some(total), target).with_style(style);
        Self {
            bar,
            total,
            print_every: print_every.max(1),
            terminal,
        }
    }

    /// Marks a run resumed at `step`: the time left is estimated from the steps run since.
    pub fn resumed_from(self, step: u64) -> Self {
        self.bar.set_position(step);
        self.bar.reset_eta();
        self
    }

    /// Reports that `step` steps are done, the last one's loss and throughput.
    pub fn update(&mut self, step: u64, loss: f64, tokens_per_s: f64) {
        self.bar.set_message(format!(
            "loss {loss:.3}  {} tok/s",
            HumanCount(tokens_per_s as u64)
        ));
        self.bar.set_position(step);
        if !self.terminal && (step.is_multiple_of(self.print_every) || step == self.total) {
            // indicatif estimates nothing before it has seen a step's time.
            let eta = Some(self.bar.eta()).filter(|eta| !eta.is_zero() || step >= self.total);
            let line = progress_line(step, self.total, loss, tokens_per_s, eta);
            write_stderr(&format!("{line}\n"));
        }
    }

    /// Prints a message on its own line, above the bar on a terminal.
    pub fn message(&self, text: &str) {
        match self.terminal {
            true => self.bar.println(text),
            false => write_stderr(&format!("{text}\n")),
        }
    }

    /// Leaves the bar drawn at its last step (terminal); call after the last update.
    pub fn finish(&mut self) {
        self.bar.abandon();
    }
}

fn write_stderr(text: &str) {
    let mut err = io::stderr().lock();
    let _ = err.write_all(text.as_bytes());
    let _ = err.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_line_has_every_field() {
        let line = progress_line(70, 100, 2.31414, 1234.4, Some(Duration::from_secs(42)));
        assert_eq!(
            line,
            "step 70/100  loss 2.3141  tokens/s 1234  eta 00:00:42"
        );
        let line = progress_line(1, 5, f64::NAN, 5.0, None);
        assert_eq!(line, "step 1/5  loss NaN  tokens/s 5  eta ?");
        let line = progress_line(1, 1000, 1.0, 1.0, Some(Duration::from_secs(3 * 3600)));
        assert!(line.ends_with("eta 03:00:00"), "{line}");
    }

    #[test]
    fn the_bar_follows_the_steps_of_a_resumed_run() {
        let mut bar = ProgressBar::with_terminal(100, 10, false).resumed_from(90);
        assert_eq!(bar.bar.position(), 90);
        bar.update(95, 1.0, 10.0);
        assert_eq!(bar.bar.position(), 95);
        assert_eq!(bar.bar.length(), Some(100));
        bar.finish();
    }
}
