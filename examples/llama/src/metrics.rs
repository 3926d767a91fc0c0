//! Training metrics: a JSON-lines log (one object per step) and an SVG plot of the loss curves
//! (training loss, and validation loss where it was measured).
//!
//! Non-finite numbers are written as `null` (JSON has no NaN or infinity) and read back as NaN.

use std::fmt::Write as _;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

use crate::Error;

/// The metrics of one training step, one JSON object per log line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Training step (1-based or 0-based, as the caller counts).
    pub step: u64,
    /// Training loss of the step.
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    /// Learning rate used for the step.
    #[serde(deserialize_with = "nan_if_null")]
    pub lr: f64,
    /// Throughput in tokens per second.
    #[serde(deserialize_with = "nan_if_null")]
    pub tokens_per_s: f64,
    /// Global gradient norm (before clipping, as the caller defines it).
    #[serde(deserialize_with = "nan_if_null")]
    pub grad_norm: f64,
    /// Seconds since training started.
    #[serde(deserialize_with = "nan_if_null")]
    pub elapsed_s: f64,
    /// Loss on the held-out validation slice, on the steps where it was measured (absent from
    /// the line otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
}

fn nan_if_null<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(deserializer)?.unwrap_or(f64::NAN))
}

/// Parses log text. A last line without a newline that does not parse is an interrupted write
/// and is skipped; any other bad line is an error. Blank lines are ignored.
fn parse_log(path: &Path, text: &str) -> Result<Vec<StepMetrics>, Error> {
    let unterminated_tail = !text.is_empty() && !text.ends_with('\n');
    let lines: Vec<&str> = text.lines().collect();
    let mut records = Vec::with_capacity(lines.len());
    for (k, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(line) {
            Ok(record) => records.push(record),
            Err(_) if unterminated_tail && k + 1 == lines.len() => {}
            Err(e) => {
                return Err(Error::Format {
                    path: Some(path.to_path_buf()),
                    what: format!("line {} of the metrics log", k + 1),
                    expected: "a metrics object ({\"step\", \"loss\", \"lr\", \"tokens_per_s\", \
                               \"grad_norm\", \"elapsed_s\"})"
                        .to_string(),
                    source: Box::new(e),
                })
            }
        }
    }
    Ok(records)
}

/// Reads every record of a metrics log.
pub fn read_metrics(path: &Path) -> Result<Vec<StepMetrics>, Error> {
    let text = fs::read_to_string(path).map_err(Error::io("read the metrics log", path))?;
    parse_log(path, &text)
}

/// An open metrics log that appends one JSON line per [`MetricsLog::log`] call.
#[derive(Debug)]
pub struct MetricsLog {
    path: PathBuf,
    file: File,
}

impl MetricsLog {
    /// Creates the log, emptying any existing file.
    pub fn create(path: &Path) -> Result<Self, Error> {
        let file = File::create(path).map_err(Error::io("create the metrics log", path))?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
        })
    }

    /// Opens the log for appending, creating it if missing. An unterminated last line (an
    /// interrupted write) is removed first so new records start on a line of their own.
    pub fn append(path: &Path) -> Result<Self, Error> {
        match fs::read(path) {
            Ok(bytes) if !bytes.is_empty() && bytes.last() != Some(&b'\n') => {
                let keep = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |k| k + 1);
                fs::write(path, &bytes[..keep]).map_err(Error::io(
                    "cut the unterminated last line of the metrics log",
                    path,
                ))?;
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("read the metrics log", path)(e)),
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(Error::io("open the metrics log for appending", path))?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
        })
    }

    /// Opens the log to continue a run resumed from a checkpoint taken after `last_step`:
    /// records with a larger step (written after that checkpoint) are dropped, then new records
    /// are appended. A missing file starts an empty log.
    pub fn resume(path: &Path, last_step: u64) -> Result<Self, Error> {
        let kept: Vec<StepMetrics> = match fs::read_to_string(path) {
            Ok(text) => parse_log(path, &text)?
                .into_iter()
                .filter(|r| r.step <= last_step)
                .collect(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(Error::io("read the metrics log", path)(e)),
        };
        let mut log = Self::create(path)?;
        for record in &kept {
            log.log(record)?;
        }
        Ok(log)
    }

    /// Appends one record as a single JSON line.
    pub fn log(&mut self, metrics: &StepMetrics) -> Result<(), Error> {
        let mut line = serde_json::to_string(metrics).map_err(|e| Error::Format {
            path: Some(self.path.clone()),
            what: format!("the record of step {}", metrics.step),
            expected: "serialisable as JSON".to_string(),
            source: Box::new(e),
        })?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .map_err(Error::io("write to the metrics log", &self.path))
    }

    /// The log's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

// ---------------------------------------------------------------------------------------------
// SVG loss plot.

const WIDTH: f64 = 800.0;
const HEIGHT: f64 = 500.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;
const MAX_TICKS: usize = 50;

/// A "nice" tick spacing (1, 2 or 5 times a power of ten) giving about `target` ticks.
fn nice_step(range: f64, target: f64) -> f64 {
    let raw = range / target;
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    let magnitude = 10f64.powf(raw.log10().floor());
    let nice = match raw / magnitude {
        r if r <= 1.0 => 1.0,
        r if r <= 2.0 => 2.0,
        r if r <= 5.0 => 5.0,
        _ => 10.0,
    };
    nice * magnitude
}

/// Decimals needed to print multiples of `step` exactly enough.
fn decimals_for(step: f64) -> usize {
    if step >= 1.0 {
        0
    } else {
        ((-step.log10()).ceil() as usize).min(12)
    }
}

/// Tick values: the multiples of `step` in `[lo, hi]` (at most `MAX_TICKS`).
fn ticks(lo: f64, hi: f64, step: f64) -> Vec<f64> {
    let first = (lo / step).ceil();
    (0..MAX_TICKS)
        .map(|k| (first + k as f64) * step)
        .take_while(|&t| t <= hi + step * 1e-9)
        .collect()
}

fn format_tick(value: f64, decimals: usize) -> String {
    let text = format!("{value:.decimals$}");
    // Avoid "-0" / "-0.00" for values that round to zero.
    if text
        .trim_start_matches('-')
        .chars()
        .all(|c| c == '0' || c == '.')
    {
        text.trim_start_matches('-').to_string()
    } else {
        text
    }
}

fn escape_xml(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

/// One named curve of a loss plot: `(step, loss)` points.
#[derive(Debug, Clone, Copy)]
pub struct Curve<'a> {
    /// The legend's text for the curve.
    pub label: &'a str,
    /// The points, in any order.
    pub points: &'a [(u64, f64)],
}

/// Line colours, one per curve in order (repeating after the last).
const COLORS: [&str; 3] = ["#1f77b4", "#ff7f0e", "#2ca02c"];

/// Renders a self-contained SVG line chart of one loss curve against step (see
/// [`loss_curves_svg`]).
pub fn loss_plot_svg(points: &[(u64, f64)], title: &str) -> String {
    loss_curves_svg(
        &[Curve {
            label: "loss",
            points,
        }],
        title,
    )
}

/// Renders a self-contained SVG line chart of loss curves against step, with a legend when
/// there is more than one curve.
///
/// Non-finite losses are skipped and points are drawn in step order. Axes get "nice" ticks
/// (integer steps on x) covering every curve; a single point or a constant loss gets a padded
/// range, and a lone point is also drawn as a dot. With no finite point the chart says so.
pub fn loss_curves_svg(curves: &[Curve<'_>], title: &str) -> String {
    let series: Vec<Vec<(f64, f64)>> = curves
        .iter()
        .map(|curve| {
            let mut pts: Vec<(f64, f64)> = curve
                .points
                .iter()
                .filter(|(_, loss)| loss.is_finite())
                .map(|&(step, loss)| (step as f64, loss))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            pts
        })
        .collect();
    let all: Vec<(f64, f64)> = series.iter().flatten().copied().collect();

    let (mut x_lo, mut x_hi, mut y_lo, mut y_hi) = (0.0, 1.0, 0.0, 1.0);
    if !all.is_empty() {
        x_lo = all.iter().map(|p| p.0).fold(f64::INFINITY, f64::min);
        x_hi = all.iter().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
        if x_hi - x_lo < 1.0 {
            x_lo = (x_lo - 1.0).max(0.0);
            x_hi = x_lo + 2.0;
        }
        y_lo = all.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
        y_hi = all.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
        if y_hi - y_lo <= f64::EPSILON * y_hi.abs().max(1.0) {
            let pad = if y_lo == 0.0 { 1.0 } else { y_lo.abs() * 0.1 };
            (y_lo, y_hi) = (y_lo - pad, y_hi + pad);
        }
    }
    let x_step = nice_step(x_hi - x_lo, 8.0).max(1.0);
    let y_step = nice_step(y_hi - y_lo, 6.0);
    // Extend the y range to whole ticks, so the curve sits between labelled lines.
    let (y_lo, y_hi) = {
        let (lo, hi) = (
            (y_lo / y_step).floor() * y_step,
            (y_hi / y_step).ceil() * y_step,
        );
        if lo.is_finite() && hi.is_finite() && hi > lo {
            (lo, hi)
        } else {
            (y_lo, y_hi)
        }
    };
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let px = |x: f64| LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w;
    let py = |y: f64| TOP + plot_h - (y - y_lo) / (y_hi - y_lo) * plot_h;

    let mut svg = String::new();
    // Writing to a String cannot fail.
    let _ = write!(
        svg,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{HEIGHT}\" \
         viewBox=\"0 0 {WIDTH} {HEIGHT}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"28\" text-anchor=\"middle\" font-size=\"16\">{}</text>\n",
        WIDTH / 2.0,
        escape_xml(title)
    );
    let (bottom, right) = (TOP + plot_h, LEFT + plot_w);
    let x_decimals = decimals_for(x_step);
    for t in ticks(x_lo, x_hi, x_step) {
        let x = px(t);
        let _ = writeln!(
            svg,
            "<line x1=\"{x:.2}\" y1=\"{TOP}\" x2=\"{x:.2}\" y2=\"{bottom}\" stroke=\"#e0e0e0\"/>\
             <text x=\"{x:.2}\" y=\"{:.2}\" text-anchor=\"middle\">{}</text>",
            bottom + 18.0,
            format_tick(t, x_decimals)
        );
    }
    let y_decimals = decimals_for(y_step);
    for t in ticks(y_lo, y_hi, y_step) {
        let y = py(t);
        let _ = writeln!(
            svg,
            "<line x1=\"{LEFT}\" y1=\"{y:.2}\" x2=\"{right}\" y2=\"{y:.2}\" stroke=\"#e0e0e0\"/>\
             <text x=\"{:.2}\" y=\"{:.2}\" text-anchor=\"end\">{}</text>",
            LEFT - 8.0,
            y + 4.0,
            format_tick(t, y_decimals)
        );
    }
    let _ = write!(
        svg,
        "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{plot_w}\" height=\"{plot_h}\" fill=\"none\" \
         stroke=\"black\"/>\n\
         <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>\n\
         <text x=\"20\" y=\"{}\" text-anchor=\"middle\" \
         transform=\"rotate(-90 20 {})\">loss</text>\n",
        LEFT + plot_w / 2.0,
        HEIGHT - 15.0,
        TOP + plot_h / 2.0,
        TOP + plot_h / 2.0
    );
    if all.is_empty() {
        let _ = writeln!(
            svg,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">no finite loss values</text>",
            LEFT + plot_w / 2.0,
            TOP + plot_h / 2.0
        );
    }
    for (i, (curve, pts)) in curves.iter().zip(&series).enumerate() {
        let color = COLORS[i % COLORS.len()];
        if curves.len() > 1 {
            let y = TOP + 16.0 + 16.0 * i as f64;
            let _ = writeln!(
                svg,
                "<line x1=\"{:.2}\" y1=\"{y:.2}\" x2=\"{:.2}\" y2=\"{y:.2}\" stroke=\"{color}\" \
                 stroke-width=\"2\"/><text x=\"{:.2}\" y=\"{:.2}\">{}</text>",
                right - 150.0,
                right - 130.0,
                right - 124.0,
                y + 4.0,
                escape_xml(curve.label)
            );
        }
        if pts.is_empty() {
            continue;
        }
        let coords: Vec<String> = pts
            .iter()
            .map(|&(x, y)| format!("{:.2},{:.2}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            svg,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"/>",
            coords.join(" ")
        );
        if let [(x, y)] = pts[..] {
            let _ = writeln!(
                svg,
                "<circle cx=\"{:.2}\" cy=\"{:.2}\" r=\"3\" fill=\"{color}\"/>",
                px(x),
                py(y)
            );
        }
    }
    svg.push_str("</svg>\n");
    svg
}

/// Writes [`loss_curves_svg`] of `curves` to `path`.
pub fn write_loss_plot_svg(curves: &[Curve<'_>], path: &Path, title: &str) -> Result<(), Error> {
    fs::write(path, loss_curves_svg(curves, title)).map_err(Error::io("write the loss plot", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    use distflash_test_support::TempDir;

    fn record(step: u64, loss: f64) -> StepMetrics {
        StepMetrics {
            step,
            loss,
            lr: 3e-4,
            tokens_per_s: 1234.5,
            grad_norm: 0.75,
            elapsed_s: step as f64 * 0.5,
            val_loss: None,
        }
    }

    /// The coordinates of the polyline, or `None` without one.
    fn polyline_points(svg: &str) -> Option<Vec<(f64, f64)>> {
        let start = svg.find("<polyline")?;
        let rest = &svg[start..];
        let attr = rest.find("points=\"")? + "points=\"".len();
        let end = rest[attr..].find('"')?;
        Some(
            rest[attr..attr + end]
                .split_whitespace()
                .map(|p| {
                    let (x, y) = p.split_once(',').expect("x,y");
                    (x.parse().expect("x"), y.parse().expect("y"))
                })
                .collect(),
        )
    }

    #[test]
    fn write_read_round_trip_and_line_format() {
        let tmp = TempDir::new("round-trip");
        let path = tmp.path().join("metrics.jsonl");
        let records: Vec<StepMetrics> = (1..=3).map(|s| record(s, 4.0 / s as f64)).collect();
        let mut log = MetricsLog::create(&path).unwrap();
        for r in &records {
            log.log(r).unwrap();
        }
        assert_eq!(read_metrics(&path).unwrap(), records);
        let text = fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 3);
        let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        for key in [
            "step",
            "loss",
            "lr",
            "tokens_per_s",
            "grad_norm",
            "elapsed_s",
        ] {
            assert!(first.get(key).is_some(), "missing {key}");
        }
        // `create` truncates.
        MetricsLog::create(&path).unwrap();
        assert!(read_metrics(&path).unwrap().is_empty());
    }

    #[test]
    fn nan_is_written_as_null_and_read_as_nan() {
        let tmp = TempDir::new("nan");
        let path = tmp.path().join("m.jsonl");
        let mut log = MetricsLog::create(&path).unwrap();
        log.log(&record(1, f64::NAN)).unwrap();
        assert!(fs::read_to_string(&path).unwrap().contains("\"loss\":null"));
        assert!(read_metrics(&path).unwrap()[0].loss.is_nan());
    }

    #[test]
    fn append_and_resume() {
        let tmp = TempDir::new("append");
        let path = tmp.path().join("m.jsonl");
        let mut log = MetricsLog::append(&path).unwrap();
        log.log(&record(1, 3.0)).unwrap();
        drop(log);
        let mut log = MetricsLog::append(&path).unwrap();
        log.log(&record(2, 2.0)).unwrap();
        drop(log);
        let steps = |p: &Path| {
            read_metrics(p)
                .unwrap()
                .iter()
                .map(|r| r.step)
                .collect::<Vec<_>>()
        };
        assert_eq!(steps(&path), [1, 2]);

        // An interrupted write leaves a partial line: reading skips it, appending removes it.
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(b"{\"step\":3,\"lo").unwrap();
        drop(file);
        assert_eq!(steps(&path), [1, 2]);
        let mut log = MetricsLog::append(&path).unwrap();
        log.log(&record(3, 1.5)).unwrap();
        drop(log);
        assert_eq!(steps(&path), [1, 2, 3]);

        // Resuming from a checkpoint after step 2 drops step 3.
        let mut log = MetricsLog::resume(&path, 2).unwrap();
        log.log(&record(3, 1.4)).unwrap();
        drop(log);
        let records = read_metrics(&path).unwrap();
        assert_eq!(
            records.iter().map(|r| r.step).collect::<Vec<_>>(),
            [1, 2, 3]
        );
        assert_eq!(records[2].loss, 1.4);
    }

    #[test]
    fn bad_lines_are_reported_with_line_numbers() {
        let tmp = TempDir::new("bad");
        let path = tmp.path().join("m.jsonl");
        let good = serde_json::to_string(&record(1, 1.0)).unwrap();
        fs::write(&path, format!("{good}\n\n{{\"step\": 2}}\n{good}\n")).unwrap();
        let err = read_metrics(&path).unwrap_err();
        assert!(
            matches!(err, Error::Format { ref what, .. } if what == "line 3 of the metrics log"),
            "{err}"
        );
        assert!(
            err.to_string().contains("line 3") && err.to_string().contains("loss"),
            "{err}"
        );
        let err = read_metrics(&tmp.path().join("absent.jsonl")).unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err}");
    }

    #[test]
    fn svg_has_one_point_per_finite_loss() {
        let points: Vec<(u64, f64)> = (0..50).map(|s| (s * 10, 5.0 / (1.0 + s as f64))).collect();
        let svg = loss_plot_svg(&points, "loss <tiny> & \"llama\"");
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains("loss &lt;tiny&gt; &amp; &quot;llama&quot;"));
        let coords = polyline_points(&svg).unwrap();
        assert_eq!(coords.len(), 50);
        // x increases with step; y (downwards) increases as loss falls.
        assert!(coords
            .windows(2)
            .all(|w| w[0].0 < w[1].0 && w[0].1 < w[1].1));
        // All points lie inside the plot area.
        let inside = |&(x, y): &(f64, f64)| {
            (LEFT..=WIDTH - RIGHT).contains(&x) && (TOP..=HEIGHT - BOTTOM).contains(&y)
        };
        assert!(coords.iter().all(inside), "{coords:?}");
        // The step axis runs 0..490 with ticks every 100; the loss axis ticks are 0..=5.
        assert!(
            svg.contains(">400</text>") && !svg.contains(">450</text>"),
            "{svg}"
        );
        assert!(svg.contains(">5</text>"));

        let with_bad = [(1, 2.0), (2, f64::NAN), (3, f64::INFINITY), (4, 1.0)];
        assert_eq!(
            polyline_points(&loss_plot_svg(&with_bad, "t"))
                .unwrap()
                .len(),
            2
        );
    }

    #[test]
    fn svg_edge_cases() {
        // One point: drawn as a dot, inside the plot, with finite coordinates.
        let svg = loss_plot_svg(&[(0, 2.5)], "one");
        let coords = polyline_points(&svg).unwrap();
        assert_eq!(coords.len(), 1);
        assert!(coords[0].0.is_finite() && coords[0].1.is_finite());
        assert!(svg.contains("<circle"));
        // Constant loss: a flat line in the middle band, no NaN anywhere.
        let svg = loss_plot_svg(&[(1, 3.0), (2, 3.0), (3, 3.0)], "flat");
        let coords = polyline_points(&svg).unwrap();
        assert!(coords
            .iter()
            .all(|c| c.1 == coords[0].1 && c.1 > TOP && c.1 < HEIGHT - BOTTOM));
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
        // Constant zero loss.
        assert!(!loss_plot_svg(&[(1, 0.0), (2, 0.0)], "zero").contains("NaN"));
        // No finite points: no polyline, a message instead.
        let svg = loss_plot_svg(&[(1, f64::NAN)], "none");
        assert!(polyline_points(&svg).is_none());
        assert!(svg.contains("no finite loss values"));
        assert!(polyline_points(&loss_plot_svg(&[], "empty")).is_none());
    }

    #[test]
    fn tick_helpers() {
        assert_eq!(nice_step(10.0, 5.0), 2.0);
        assert!((nice_step(0.3, 6.0) - 0.05).abs() < 1e-12);
        assert_eq!(nice_step(700.0, 8.0), 100.0);
        assert_eq!(decimals_for(0.05), 2);
        assert_eq!(decimals_for(0.2), 1);
        assert_eq!(decimals_for(5.0), 0);
        assert_eq!(ticks(0.1, 0.5, 0.2), vec![0.2, 0.4]);
        assert_eq!(format_tick(-0.0001, 2), "0.00");
        assert_eq!(format_tick(2.26, 1), "2.3");
        assert_eq!(format_tick(1500.0, 0), "1500");
    }

    #[test]
    fn validation_loss_is_written_only_where_measured() {
        let tmp = TempDir::new("val");
        let path = tmp.path().join("m.jsonl");
        let mut log = MetricsLog::create(&path).unwrap();
        let measured = StepMetrics {
            val_loss: Some(2.5),
            ..record(2, 3.0)
        };
        log.log(&record(1, 3.5)).unwrap();
        log.log(&measured).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(!lines[0].contains("val_loss"), "{}", lines[0]);
        assert!(lines[1].contains("\"val_loss\":2.5"), "{}", lines[1]);
        let read = read_metrics(&path).unwrap();
        assert_eq!(read[0].val_loss, None);
        assert_eq!(read[1], measured);
    }

    #[test]
    fn two_curves_get_two_lines_and_a_legend() {
        let train = [(1, 3.0), (2, 2.0), (3, 1.5)];
        let val = [(2, 2.5), (3, 2.0)];
        let svg = loss_curves_svg(
            &[
                Curve {
                    label: "training",
                    points: &train,
                },
                Curve {
                    label: "validation",
                    points: &val,
                },
            ],
            "t",
        );
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains(">training</text>") && svg.contains(">validation</text>"));
        assert!(svg.contains(COLORS[0]) && svg.contains(COLORS[1]));
        // A legend entry is a short thick line; one curve has none.
        assert_eq!(svg.matches("stroke-width=\"2\"").count(), 2);
        assert!(!loss_plot_svg(&train, "t").contains("stroke-width=\"2\""));
    }

    #[test]
    fn svg_file_is_written() {
        let tmp = TempDir::new("svg");
        let path = tmp.path().join("loss.svg");
        let points = [(1, 2.0), (2, 1.0)];
        let curve = Curve {
            label: "loss",
            points: &points,
        };
        write_loss_plot_svg(&[curve], &path, "t").unwrap();
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            loss_plot_svg(&[(1, 2.0), (2, 1.0)], "t")
        );
    }
}
