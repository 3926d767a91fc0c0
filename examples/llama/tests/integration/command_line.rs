//! `llama_train` as a user runs it, on ndarray with a one-layer model: `--help` lists every
//! option under its heading with its default and allowed values; an unknown option, a value
//! out of range or outside its choices, and a check of ours exit with code 2 naming what is
//! wrong; a run whose standard error is not a terminal prints one plain progress line per
//! `--log-every` steps, with the loss metrics.jsonl records, and draws loss.svg; a run with
//! `--no-checkpoint` writes no checkpoint (and refuses `--export-weights`); a resumed run
//! takes `--steps` as its new total (and refuses one below the checkpoint's step), a run
//! without validation ends without a validation loss; the chunk options change no loss, and 0
//! or a word for one exits with code 2; `--plan` prints the memory plan with no data file and
//! no device; `--memory auto` trains with the chunks the planner picks, and refuses to run
//! without a GPU memory, with one too small, or beside explicit chunks.

use std::path::Path;
use std::process::Output;

use crate::common::temp_dir::TempDir;
use distflash_llama::metrics::read_metrics;

/// Options of a short test run: no validation, no sample, progress every step.
pub(crate) const QUIET: [&str; 6] = [
    "--val-every",
    "0",
    "--sample-tokens",
    "0",
    "--log-every",
    "1",
];

/// Runs `llama_train` on the bundled text with a small model and batch, writing to `out`.
pub(crate) fn llama_train(out: &Path, extra: &[&str]) -> Output {
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/data/tiny_shakespeare.txt");
    std::process::Command::new(env!("CARGO_BIN_EXE_llama_train"))
        .args([
            "--backend",
            "ndarray",
            "--layers",
            "1",
            "--batch",
            "2",
            "--seq-len",
            "32",
        ])
        .args(QUIET)
        .args(["--data", data, "--out"])
        .arg(out)
        .args(extra)
        .output()
        .expect("llama_train starts")
}

/// The run's standard error, after checking its exit code.
pub(crate) fn stderr_of(output: &Output, code: i32) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(code), "{stderr}");
    stderr
}

/// `llama_train` with `args` only.
fn bare_llama_train(args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_llama_train"))
        .args(args)
        .output()
        .expect("llama_train starts")
}

/// One plain progress line: `step S/T  loss L  tokens/s R  eta HH:MM:SS`.
#[derive(Debug, PartialEq)]
struct ProgressLine {
    step: u64,
    total: u64,
    loss: f64,
}

/// The plain progress lines of a run's standard error, each checked field by field.
fn progress_lines(stderr: &str) -> Vec<ProgressLine> {
    stderr
        .lines()
        .filter(|line| line.starts_with("step "))
        .map(|line| {
            let fields: Vec<&str> = line.split("  ").collect();
            let [step, loss, rate, eta] = fields[..] else {
                panic!("not a progress line: {line:?}");
            };
            let (step, total) = step["step ".len()..].split_once('/').expect("S/T");
            let rate: f64 = rate
                .strip_prefix("tokens/s ")
                .expect("rate")
                .parse()
                .unwrap();
            assert!(rate > 0.0, "{line}");
            let eta = eta.strip_prefix("eta ").expect("eta");
            assert!(
                eta == "?"
                    || eta
                        .split(':')
                        .all(|p| p.len() == 2 && p.parse::<u8>().is_ok()),
                "{line}"
            );
            ProgressLine {
                step: step.parse().unwrap(),
                total: total.parse().unwrap(),
                loss: loss.strip_prefix("loss ").expect("loss").parse().unwrap(),
            }
        })
        .collect()
}

#[test]
fn help_lists_every_option_under_its_heading_with_defaults_and_choices() {
    let help = bare_llama_train(&["--help"]);
    assert_eq!(help.status.code(), Some(0));
    let help = String::from_utf8_lossy(&help.stdout);
    for heading in [
        "Model:",
        "Data:",
        "Devices:",
        "Processes (with --env):",
        "Optimisation:",
        "Memory:",
        "Output:",
    ] {
        assert!(help.contains(heading), "no {heading:?} in {help}");
    }
    for text in [
        "--config <PRESET|FILE.json>",
        "[default: tiny]",
        "--steps <N>",
        "[default: 600]",
        "--seq-len <TOKENS>",
        "--gpu-memory <BYTES>",
        "--offload <off|all|N>",
        "--layers-per-checkpoint <1|2>",
        "--plan",
        "attention-output",
        "[env: WORLD_SIZE",
        "--val-every <STEPS>",
    ] {
        assert!(help.contains(text), "no {text:?} in {help}");
    }
    // -h: one line per option, choices listed.
    let short = bare_llama_train(&["-h"]);
    let short = String::from_utf8_lossy(&short.stdout);
    assert!(
        short.contains("[possible values: ndarray, wgpu, cuda]"),
        "{short}"
    );
}

#[test]
fn bad_command_lines_exit_with_code_two_saying_what_is_wrong() {
    let cases: [(&[&str], &[&str]); 10] = [
        (
            &["--no-such-option"],
            &[
                "unexpected argument '--no-such-option'",
                "Usage: llama_train",
            ],
        ),
        (
            &["--lerning-rate", "1"],
            &["unexpected argument '--lerning-rate'"],
        ),
        (
            &["--batch", "0"],
            &["invalid value '0' for '--batch <N>'", "1.."],
        ),
        (
            &["--group-timeout", "0"],
            &["invalid value '0' for '--group-timeout <SECONDS>'", "1.."],
        ),
        (
            &["--lr", "-1"],
            &[
                "invalid value '-1' for '--lr <RATE>'",
                "a finite number >= 0",
            ],
        ),
        (
            &["--backend", "tpu"],
            &[
                "invalid value 'tpu' for '--backend <BACKEND>'",
                "ndarray, wgpu, cuda",
            ],
        ),
        (&["--eot", "3"], &["--pack"]),
        (
            &["--config", "llama-9b"],
            &["llama_train:", "llama-9b", "one of tiny, llama-7b"],
        ),
        (
            &["--optimizer-state", "disk"],
            &[
                "invalid value 'disk' for '--optimizer-state <gpu|host>'",
                "gpu, host",
            ],
        ),
        (
            &["--plan", "--optimizer-state", "host"],
            &["--optimizer-state host", "add --zero 1 or --zero 2"],
        ),
    ];
    for (args, expected) in cases {
        let stderr = stderr_of(&bare_llama_train(args), 2);
        for text in expected {
            assert!(stderr.contains(text), "{args:?}: no {text:?} in {stderr}");
        }
    }
    let stderr = stderr_of(&bare_llama_train(&["--rank", "1"]), 2);
    assert!(
        stderr.contains("--rank") && stderr.contains("add --env"),
        "{stderr}"
    );
}

#[test]
fn a_run_logs_plain_progress_lines_and_draws_its_loss() {
    let dir = TempDir::new("cli-progress");
    let out = dir.path();
    let stderr = stderr_of(&llama_train(out, &["--steps", "3", "--log-every", "2"]), 0);
    let lines = progress_lines(&stderr);
    let records = read_metrics(&out.join("metrics.jsonl")).expect("metrics.jsonl");
    // Every --log-every steps and the last, with the loss metrics.jsonl has for the step.
    assert_eq!(
        lines.iter().map(|l| (l.step, l.total)).collect::<Vec<_>>(),
        [(2, 3), (3, 3)],
        "{stderr}"
    );
    for line in &lines {
        let logged = records[line.step as usize - 1].loss;
        assert!(
            (line.loss - logged).abs() <= 5e-5,
            "{line:?} against {logged}"
        );
    }
    let svg = std::fs::read_to_string(out.join("loss.svg")).expect("loss.svg");
    assert!(
        svg.starts_with("<svg") && svg.contains("<polyline"),
        "{svg}"
    );
}

#[test]
fn a_run_without_checkpoints_writes_none_and_refuses_an_export() {
    let dir = TempDir::new("cli-no-checkpoint");
    let out = dir.path();
    let stderr = stderr_of(&llama_train(out, &["--steps", "2", "--no-checkpoint"]), 0);
    assert!(
        stderr.contains("no checkpoint (--no-checkpoint)"),
        "{stderr}"
    );
    assert!(out.join("metrics.jsonl").is_file(), "{stderr}");
    assert!(!out.join("checkpoint").exists(), "{stderr}");
    let export = out.join("hf").display().to_string();
    let refused = llama_train(out, &["--no-checkpoint", "--export-weights", &export]);
    let stderr = stderr_of(&refused, 2);
    assert!(
        stderr.contains("--no-checkpoint") && stderr.contains("--export-weights"),
        "{stderr}"
    );
}

/// The steps `metrics.jsonl` in `out` records.
fn steps_logged(out: &Path) -> Vec<u64> {
    let records = read_metrics(&out.join("metrics.jsonl")).expect("metrics.jsonl");
    records.iter().map(|m| m.step).collect()
}

#[test]
fn a_resumed_run_takes_steps_as_its_new_total() {
    let dir = TempDir::new("cli-resume");
    let out = dir.path();
    let first = stderr_of(&llama_train(out, &["--steps", "2"]), 0);
    assert!(first.contains("done: 2 steps"), "{first}");
    assert!(!first.contains("validation loss"), "{first}");
    assert_eq!(steps_logged(out), [1, 2]);

    let extended = stderr_of(&llama_train(out, &["--resume", "--steps", "4"]), 0);
    assert!(extended.contains("done: 4 steps"), "{extended}");
    assert_eq!(steps_logged(out), [1, 2, 3, 4]);

    // Without --steps the checkpoint's total stands: nothing is left to train.
    let again = stderr_of(&llama_train(out, &["--resume"]), 0);
    assert!(again.contains("done: 4 steps"), "{again}");
    assert_eq!(steps_logged(out), [1, 2, 3, 4]);

    let below = stderr_of(&llama_train(out, &["--resume", "--steps", "3"]), 2);
    assert!(
        below.contains("--steps 3 is below the checkpoint's step 4"),
        "{below}"
    );
    assert_eq!(steps_logged(out), [1, 2, 3, 4]);
}

#[test]
fn a_bad_training_option_exits_with_code_two_naming_it() {
    let dir = TempDir::new("cli-bad-option");
    let stderr = stderr_of(&llama_train(dir.path(), &["--val-fraction", "1.5"]), 2);
    assert!(
        stderr.contains("invalid value '1.5' for '--val-fraction <F>'")
            && stderr.contains("below 1"),
        "{stderr}"
    );
    assert!(!dir.path().join("metrics.jsonl").exists());
}

#[test]
fn chunk_options_change_no_loss_and_refuse_zero_or_words() {
    let (whole, chunked) = (TempDir::new("cli-whole"), TempDir::new("cli-chunked"));
    stderr_of(&llama_train(whole.path(), &["--steps", "2"]), 0);
    let chunks = ["--steps", "2", "--loss-chunk", "7", "--ffn-chunk", "5"];
    stderr_of(&llama_train(chunked.path(), &chunks), 0);
    let losses = |out: &Path| -> Vec<f64> {
        let records = read_metrics(&out.join("metrics.jsonl")).expect("metrics.jsonl");
        records.iter().map(|m| m.loss).collect()
    };
    let (expected, got) = (losses(whole.path()), losses(chunked.path()));
    assert_eq!(got.len(), expected.len());
    for (g, e) in got.iter().zip(&expected) {
        assert!(
            (g - e).abs() <= 1e-5 * e.abs(),
            "chunked {got:?}, whole {expected:?}"
        );
    }
    let dir = TempDir::new("cli-bad-chunk");
    let zero = stderr_of(&llama_train(dir.path(), &["--loss-chunk", "0"]), 2);
    assert!(
        zero.contains("invalid value '0' for '--loss-chunk <TOKENS>'") && zero.contains("1.."),
        "{zero}"
    );
    let word = stderr_of(&llama_train(dir.path(), &["--ffn-chunk", "many"]), 2);
    assert!(
        word.contains("invalid value 'many' for '--ffn-chunk <TOKENS>'"),
        "{word}"
    );
}

/// Eight GPUs, whose default ZeRO stage 2 fits LLaMA-7B's sharded step on an H200 (on four, the
/// step and the whole f32 weight vector a master share keeps are planned above 90% of one).
#[test]
fn plan_prints_one_gpus_memory_without_data_or_device() {
    let plan = std::process::Command::new(env!("CARGO_BIN_EXE_llama_train"))
        .args([
            "--plan",
            "--config",
            "llama-7b",
            "--backend",
            "cuda",
            "--gpus",
            "8",
        ])
        .args([
            "--seq-len",
            "262144",
            "--batch",
            "1",
            "--gpu-memory",
            "139GiB",
        ])
        .args(["--data", "no-such-file.txt"])
        .output()
        .expect("llama_train starts");
    stderr_of(&plan, 0);
    let stdout = String::from_utf8_lossy(&plan.stdout);
    for line in [
        "checkpoints",
        "peak",
        "longest sequence that fits",
        "ZeRO stage 2",
    ] {
        assert!(stdout.contains(line), "no {line:?} in {stdout}");
    }
}

#[test]
fn memory_auto_trains_with_the_chunks_it_picks_and_needs_a_gpu_memory() {
    let dir = TempDir::new("cli-memory-auto");
    let auto = ["--steps", "1", "--memory", "auto", "--gpu-memory", "8GiB"];
    let stderr = stderr_of(&llama_train(dir.path(), &auto), 0);
    assert!(
        stderr.contains("--memory auto: loss chunks of 64 rows"),
        "{stderr}"
    );
    let none = stderr_of(&llama_train(dir.path(), &["--memory", "auto"]), 2);
    assert!(none.contains("--gpu-memory"), "{none}");
    let tiny = ["--memory", "auto", "--gpu-memory", "1MiB"];
    let tiny = stderr_of(&llama_train(dir.path(), &tiny), 2);
    assert!(tiny.contains("predicted peak"), "{tiny}");
    let both = [
        "--memory",
        "auto",
        "--gpu-memory",
        "8GiB",
        "--loss-chunk",
        "4",
    ];
    let both = stderr_of(&llama_train(dir.path(), &both), 2);
    assert!(
        both.contains("'--memory <MODE>' cannot be used with '--loss-chunk <TOKENS>'"),
        "{both}"
    );
}
