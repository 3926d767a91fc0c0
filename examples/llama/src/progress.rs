//! A one-line text progress bar for training loops, e.g.
//! `[#########.....]  70/100  loss 2.314  1.2k tok/s  eta 0:42`.

use std::io::{self, IsTerminal, Write};
use std::time::{Duration, Instant};

/// Bar width used by [`ProgressBar::new`].
pub const DEFAULT_BAR_WIDTH: usize = 30;

/// Formats a duration as `m:ss`, or `h:mm:ss` from one hour on (rounded to whole seconds).
fn format_duration(duration: Duration) -> String {
    let secs = duration
        .as_secs()
        .saturating_add(u64::from(duration.subsec_millis() >= 500));
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    if h > 0 {
        format!("{h}:{m:02}:{s:02}")
    } else {
        format!("{m}:{s:02}")
    }
}

/// Formats a rate with a k/M/G suffix: `950`, `1.2k`, `3.4M`; `?` if negative or not finite.
fn format_rate(rate: f64) -> String {
    if !(rate.is_finite() && rate >= 0.0) {
        "?".to_string()
    } else if rate < 999.5 {
        format!("{rate:.0}")
    } else if rate < 999_950.0 {
        format!("{:.1}k", rate / 1e3)
    } else if rate < 999_950_000.0 {
        format!("{:.1}M", rate / 1e6)
    } else {
        format!("{:.1}G", rate / 1e9)
    }
}

/// Time left if `done` of `remaining + done` steps took `elapsed`; `None` before any step.
fn estimate(elapsed: Duration, done: u64, remaining: u64) -> Option<Duration> {
    if remaining == 0 {
        return Some(Duration::ZERO);
    }
    if done == 0 {
        return None;
    }
    let secs = elapsed.as_secs_f64() * remaining as f64 / done as f64;
    // Saturates instead of panicking on absurd estimates.
    Some(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
}

fn render(
    step: u64,
    total: u64,
    loss: f64,
    tokens_per_s: f64,
    eta: Option<Duration>,
    width: usize,
) -> String {
    let done = step.min(total);
    let filled = if total == 0 {
        width
    } else {
        // Below `width`, so the cast back is lossless.
        (width as u128 * u128::from(done) / u128::from(total)) as usize
    };
    let digits = total.to_string().len();
    let eta = eta.map_or_else(|| "--:--".to_string(), format_duration);
    format!(
        "[{}{}]  {step:>digits$}/{total}  loss {loss:.3}  {} tok/s  eta {eta}",
        "#".repeat(filled),
        ".".repeat(width - filled),
        format_rate(tokens_per_s),
    )
}

/// Renders one progress line: a `width`-character bar (`#` done, `.` to do), `step/total`,
/// the loss to 3 decimals, the throughput with a k/M/G suffix, and the time left, extrapolated
/// from `elapsed` over `step` steps (`--:--` at step 0). A `total` of 0 shows a full bar.
pub fn render_progress(
    step: u64,
    total: u64,
    loss: f64,
    tokens_per_s: f64,
    elapsed: Duration,
    width: usize,
) -> String {
    let eta = estimate(elapsed, step, total.saturating_sub(step));
    render(step, total, loss, tokens_per_s, eta, width)
}

/// A progress bar on stderr: redrawn in place with `\r` when stderr is a terminal, otherwise
/// printed as a plain line every `print_every` steps and at the last step.
///
/// Write errors are ignored: progress output must never stop training. Dropping the bar ends
/// its line.
#[derive(Debug)]
pub struct ProgressBar {
    total: u64,
    print_every: u64,
    width: usize,
    start: Instant,
    first_step: u64,
    terminal: bool,
    /// Length of the line currently drawn in terminal mode (0: none).
    drawn: usize,
}

impl ProgressBar {
    /// A bar for `total` steps that prints every `print_every` steps when stderr is not a
    /// terminal (0 counts as 1). The clock starts now.
    pub fn new(total: u64, print_every: u64) -> Self {
        Self {
            total,
            print_every: print_every.max(1),
            width: DEFAULT_BAR_WIDTH,
            start: Instant::now(),
            first_step: 0,
            terminal: io::stderr().is_terminal(),
            drawn: 0,
        }
    }

    /// Sets the bar's width in characters.
    pub fn with_width(mut self, width: usize) -> Self {
        self.width = width;
        self
    }

    /// Overrides terminal detection (in-place redraws if true, plain lines if false).
    pub fn with_terminal(mut self, terminal: bool) -> Self {
        self.terminal = terminal;
        self
    }

    /// Marks a run resumed at `step`: the time left is extrapolated from the steps run since.
    pub fn resumed_from(mut self, step: u64) -> Self {
        self.first_step = step;
        self
    }

    /// Reports that `step` steps are done.
    pub fn update(&mut self, step: u64, loss: f64, tokens_per_s: f64) {
        let elapsed = self.start.elapsed();
        if let Some(text) = self.output(step, loss, tokens_per_s, elapsed) {
            write_stderr(&text);
        }
    }

    /// Prints a message on its own line without garbling the bar.
    pub fn message(&mut self, text: &str) {
        let out = self.message_output(text);
        write_stderr(&out);
    }

    /// Ends the bar's line (terminal mode); call after the last update.
    pub fn finish(&mut self) {
        if self.drawn > 0 {
            self.drawn = 0;
            write_stderr("\n");
        }
    }

    /// What [`ProgressBar::update`] writes, if anything.
    fn output(
        &mut self,
        step: u64,
        loss: f64,
        tokens_per_s: f64,
        elapsed: Duration,
    ) -> Option<String> {
        let done = step.saturating_sub(self.first_step);
        let eta = estimate(elapsed, done, self.total.saturating_sub(step));
        let line = render(step, self.total, loss, tokens_per_s, eta, self.width);
        if self.terminal {
            // Pad with spaces to cover a longer previous line.
            let pad = self.drawn.saturating_sub(line.len());
            self.drawn = line.len();
            Some(format!("\r{line}{}", " ".repeat(pad)))
        } else if step.is_multiple_of(self.print_every) || step == self.total {
            Some(format!("{line}\n"))
        } else {
            None
        }
    }

    fn message_output(&mut self, text: &str) -> String {
        if self.drawn > 0 {
            let clear = " ".repeat(self.drawn);
            self.drawn = 0;
            format!("\r{clear}\r{text}\n")
        } else {
            format!("{text}\n")
        }
    }
}

impl Drop for ProgressBar {
    fn drop(&mut self) {
        self.finish();
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
    fn renders_the_documented_example() {
        let line = render_progress(70, 100, 2.3141, 1234.0, Duration::from_secs(98), 14);
        // 70% of 14 is 9.8 → 9 filled; 98 s for 70 steps → 42 s for the remaining 30.
        assert_eq!(
            line,
            "[#########.....]   70/100  loss 2.314  1.2k tok/s  eta 0:42"
        );
    }

    #[test]
    fn bar_fractions() {
        let bar = |step, total| {
            let line = render_progress(step, total, 1.0, 1.0, Duration::from_secs(1), 10);
            line[1..11].to_string()
        };
        assert_eq!(bar(0, 100), "..........");
        assert_eq!(bar(1, 100), "..........");
        assert_eq!(bar(10, 100), "#.........");
        assert_eq!(bar(99, 100), "#########.");
        assert_eq!(bar(100, 100), "##########");
        assert_eq!(bar(150, 100), "##########");
        assert_eq!(bar(1, 3), "###.......");
        assert_eq!(bar(u64::MAX - 1, u64::MAX), "#########.");
        assert_eq!(bar(0, 0), "##########");
        assert_eq!(
            render_progress(1, 2, 1.0, 1.0, Duration::ZERO, 0)[..2],
            *"[]"
        );
    }

    #[test]
    fn eta_at_start_middle_and_end() {
        let eta = |step, total, secs| {
            let line = render_progress(step, total, 0.5, 10.0, Duration::from_secs(secs), 5);
            line.rsplit("eta ").next().unwrap().to_string()
        };
        assert_eq!(eta(0, 100, 0), "--:--");
        assert_eq!(eta(0, 100, 50), "--:--");
        assert_eq!(eta(100, 100, 3600), "0:00");
        assert_eq!(eta(1, 2, 61), "1:01");
        assert_eq!(eta(1, 3, 3600), "2:00:00");
        assert_eq!(eta(10, 11, 5), "0:01"); // 0.5 s rounds up
        assert_eq!(eta(1, u64::MAX, 1_000_000), eta(1, u64::MAX, 1_000_000)); // no panic
    }

    #[test]
    fn rate_and_step_formatting() {
        assert_eq!(format_rate(0.0), "0");
        assert_eq!(format_rate(999.4), "999");
        assert_eq!(format_rate(999.6), "1.0k");
        assert_eq!(format_rate(12_345.0), "12.3k");
        assert_eq!(format_rate(2_500_000.0), "2.5M");
        assert_eq!(format_rate(3.2e9), "3.2G");
        assert_eq!(format_rate(f64::NAN), "?");
        assert_eq!(format_rate(-1.0), "?");
        let line = render_progress(5, 1000, f64::NAN, 5.0, Duration::from_secs(5), 4);
        assert!(line.contains("     5/1000  loss NaN  5 tok/s"), "{line}");
    }

    #[test]
    fn terminal_mode_redraws_in_place() {
        let mut bar = ProgressBar::new(10, 5).with_terminal(true).with_width(4);
        let first = bar.output(1, 2.0, 1500.0, Duration::from_secs(1)).unwrap();
        assert_eq!(first, "\r[....]   1/10  loss 2.000  1.5k tok/s  eta 0:09");
        // Every step redraws; a shorter line is padded to erase the previous one.
        let second = bar.output(3, 2.0, 15.0, Duration::from_secs(3)).unwrap();
        assert!(second.starts_with("\r[#...]   3/10"), "{second:?}");
        assert_eq!(second.len(), first.len());
        assert!(second.ends_with("eta 0:07  "), "{second:?}");
        // The message clears the drawn line (the bar without its padding) first.
        let drawn = second.trim_end().len() - 1;
        let expected = format!("\r{}\rval loss 1.9\n", " ".repeat(drawn));
        assert_eq!(bar.message_output("val loss 1.9"), expected);
        assert_eq!(bar.message_output("again"), "again\n");
        bar.drawn = 0; // nothing to finish on drop
    }

    #[test]
    fn plain_mode_prints_every_n_steps_and_the_last() {
        let mut bar = ProgressBar::new(7, 3).with_terminal(false).with_width(7);
        let printed: Vec<u64> = (1..=7)
            .filter(|&s| bar.output(s, 1.0, 1.0, Duration::from_secs(s)).is_some())
            .collect();
        assert_eq!(printed, [3, 6, 7]);
        let line = bar.output(3, 1.0, 1.0, Duration::from_secs(3)).unwrap();
        assert_eq!(line, "[###....]  3/7  loss 1.000  1 tok/s  eta 0:04\n");
        assert!(ProgressBar::new(5, 0)
            .with_terminal(false)
            .output(1, 1.0, 1.0, Duration::ZERO)
            .is_some());
    }

    #[test]
    fn resumed_bar_extrapolates_from_steps_since_resume() {
        let mut bar = ProgressBar::new(100, 1)
            .with_terminal(false)
            .resumed_from(90);
        // 5 steps in 10 s since resuming at 90 → 5 left take 10 s.
        let line = bar.output(95, 1.0, 1.0, Duration::from_secs(10)).unwrap();
        assert!(line.ends_with("eta 0:10\n"), "{line}");
        let line = bar.output(90, 1.0, 1.0, Duration::ZERO).unwrap();
        assert!(line.ends_with("eta --:--\n"), "{line}");
    }
}
