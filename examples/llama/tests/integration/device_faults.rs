//! A step that runs the GPU out of memory ends the run with that error: exit code 1 and a last
//! line saying the GPU ran out of memory, no step logged with a NaN loss, and no wait beyond
//! the trainer's grace for a step stuck on a missing buffer. CubeCL fails an allocation on its
//! own device thread, which the trainer learns of through `burn_distflash::device_faults`.
//! `#[ignore]`d: one CUDA GPU (`.ci/gpu-tests -f cuda`).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::command_line::QUIET;
use crate::common::data_file;
use crate::common::temp_dir::TempDir;

/// Kernel compilation, the model's initialisation and the trainer's 30 s grace, with margin.
const LIMIT: Duration = Duration::from_secs(300);

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn cuda_a_step_out_of_gpu_memory_ends_the_run_saying_so() {
    let dir = TempDir::new("out-of-memory");
    let start = Instant::now();
    // Eight LLaMA-7B layers over 128K tokens with no checkpoints: the planner predicts a peak of
    // 175.7 GiB in bf16, beyond any H100 or H200 (four layers, 101.1 GiB planned, trained in
    // 99.8 GiB on an H200), while every tensor stays below 2^31 elements (the kernels' index
    // limit, which 512K tokens of 32 heads of 128 reach first with its own error).
    let output = Command::new(env!("CARGO_BIN_EXE_llama_train"))
        .args(["--backend", "cuda", "--config", "llama-7b", "--layers", "8"])
        .args(["--seq-len", "131072", "--batch", "1", "--steps", "2"])
        .args([
            "--checkpoint",
            "none",
            "--log-every",
            "1",
            "--save-every",
            "0",
        ])
        .args(QUIET)
        .arg("--data")
        .arg(data_file())
        .arg("--out")
        .arg(dir.path())
        .stdout(Stdio::null())
        .output()
        .expect("llama_train starts");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(start.elapsed() < LIMIT, "{:?}: {stderr}", start.elapsed());
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("llama_train: ") && last.contains("ran out of memory"),
        "the last line must say the GPU ran out of memory: {stderr}"
    );
    assert!(
        !stderr.contains("loss NaN"),
        "no step may be logged: {stderr}"
    );
    // CubeCL's failures are printed once, not once per failed task.
    assert!(
        stderr.matches("can't allocate buffer").count() <= 2,
        "{stderr}"
    );
}
