//! `llama_train` as a user runs it, on ndarray with a one-layer model: a resumed run takes
//! `--steps` as its new total (and refuses one below the checkpoint's step), a run without
//! validation ends without a validation loss, a bad option exits with code 2 naming it; the
//! chunk options change no loss, and 0 or a word for one exits with code 2; `--plan` prints the
//! memory plan with no data file and no device; `--memory auto` trains with the chunks the
//! planner picks, and refuses to run without a GPU memory, with one too small, or beside
//! explicit chunks.

use std::path::Path;
use std::process::Output;

use crate::common::temp_dir::TempDir;
use distflash_llama::metrics::read_metrics;

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
        .args([
            "--val-every",
            "0",
            "--sample-tokens",
            "0",
            "--log-every",
            "1",
        ])
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
    let stderr = stderr_of(&llama_train(dir.path(), &["--lr", "-1"]), 2);
    assert!(
        stderr.contains("the training option `lr` is -1"),
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
        zero.contains("--loss-chunk") && zero.contains("at least 1"),
        "{zero}"
    );
    let word = stderr_of(&llama_train(dir.path(), &["--ffn-chunk", "many"]), 2);
    assert!(word.contains("--ffn-chunk takes a whole number"), "{word}");
}

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
            "2",
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
    assert!(both.contains("drop --loss-chunk"), "{both}");
}
