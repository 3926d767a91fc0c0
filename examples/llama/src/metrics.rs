//! Training metrics: a JSON-lines log, one object per step (its loss curves are drawn by
//! [`crate::loss_plot`]).
//!
//! Non-finite numbers are written as `null` (JSON has no NaN or infinity) and read back as NaN.

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
}
