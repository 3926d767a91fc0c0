//! `llama_train --env` on two GPUs, one process each (the variables torchrun sets): it trains
//! the same losses, step for step and bit for bit, as one process driving both GPUs with the
//! same seed and data; when one rank's process is killed mid-run the other exits with code 1
//! within `--group-timeout` (plus NCCL's abort), its last line naming the step and the silent
//! rank; a rank whose rank 0 never starts exits with code 2 naming the rendezvous address. One
//! process driving both GPUs under ZeRO 1 and 2 trains bit for bit the same losses and gradient
//! norms with the gradients summed in small buckets as in one bucket (at two ranks an element's
//! sum is one addition, whatever NCCL's algorithm). `#[ignore]`d: two CUDA GPUs and NCCL (`.ci/gpu-tests -f nccl`).

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::command_line::{stderr_of, QUIET};
use crate::common::data_file;
use crate::common::temp_dir::TempDir;
use distflash_llama::metrics::read_metrics;

/// Steps each run trains: enough for the optimizer's moments and the gradient sums to matter.
const STEPS: &str = "6";

/// The options every run here shares: a small model on CUDA, a sequence split over the two
/// GPUs, `steps` steps.
fn shared_options(steps: &str, out: &Path) -> Vec<String> {
    let options = [
        "--backend",
        "cuda",
        "--layers",
        "2",
        "--batch",
        "2",
        "--seq-len",
        "256",
        "--steps",
        steps,
    ];
    let mut options: Vec<String> = (options.iter().chain(&QUIET))
        .map(|s| s.to_string())
        .collect();
    options.push("--data".into());
    options.push(data_file().display().to_string());
    options.push("--out".into());
    options.push(out.display().to_string());
    options
}

/// A TCP port nobody listens on now (the rendezvous's).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free local port")
        .port()
}

/// Rank `rank` of a two-process group whose rank 0 listens on `port`, training `steps` steps.
fn rank_process(rank: usize, port: u16, steps: &str, out: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_llama_train"));
    command
        .args(shared_options(steps, out))
        .arg("--env")
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env_remove("DISTFLASH_RENDEZVOUS_PORT");
    command
}

/// The training losses `metrics.jsonl` in `out` records, in step order.
fn losses(out: &Path) -> Vec<f64> {
    let records = read_metrics(&out.join("metrics.jsonl")).expect("metrics.jsonl");
    records.iter().map(|m| m.loss).collect()
}

/// Runs both ranks of a two-process group and waits for both.
fn two_processes(out: &Path) -> [Output; 2] {
    let port = free_port();
    let children = [0, 1].map(|rank| {
        rank_process(rank, port, STEPS, out)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("llama_train starts")
    });
    children.map(|child| child.wait_with_output().expect("llama_train ends"))
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL: run with --ignored on the GPU machine"]
fn nccl_one_process_per_gpu_trains_the_losses_of_one_process_driving_both() {
    let dir = TempDir::new("one-process-per-gpu");
    let one_process = dir.path().join("one-process");
    let per_gpu = dir.path().join("per-gpu");
    let output = Command::new(env!("CARGO_BIN_EXE_llama_train"))
        .args(shared_options(STEPS, &one_process))
        .args(["--gpus", "2"])
        .output()
        .expect("llama_train starts");
    stderr_of(&output, 0);
    for (rank, output) in two_processes(&per_gpu).iter().enumerate() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(0), "rank {rank}: {stderr}");
    }
    let (expected, got) = (losses(&one_process), losses(&per_gpu));
    assert_eq!(
        expected.len(),
        STEPS.parse::<usize>().unwrap(),
        "{expected:?}"
    );
    assert!(expected.iter().all(|loss| loss.is_finite()), "{expected:?}");
    assert_eq!(
        got.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
        expected.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
        "one process per GPU {got:?}, one process driving both {expected:?}"
    );
}

/// The losses' and gradient norms' bits `metrics.jsonl` in `out` records, in step order.
fn loss_and_norm_bits(out: &Path) -> Vec<[u64; 2]> {
    let records = read_metrics(&out.join("metrics.jsonl")).expect("metrics.jsonl");
    (records.iter())
        .map(|m| [m.loss.to_bits(), m.grad_norm.to_bits()])
        .collect()
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL: run with --ignored on the GPU machine"]
fn nccl_gradient_sums_in_buckets_train_bitwise_like_one_bucket_on_two_gpus() {
    let dir = TempDir::new("nccl-grad-buckets");
    for zero in ["1", "2"] {
        // 8 KiB: buckets of 1024 elements of each share, many per step; 1 GiB: one.
        let [small, whole] = ["8KiB", "1GiB"].map(|bucket| {
            let out = dir.path().join(format!("zero{zero}-{bucket}"));
            let output = Command::new(env!("CARGO_BIN_EXE_llama_train"))
                .args(shared_options(STEPS, &out))
                .args(["--gpus", "2", "--zero", zero, "--grad-bucket", bucket])
                .output()
                .expect("llama_train starts");
            stderr_of(&output, 0);
            loss_and_norm_bits(&out)
        });
        assert_eq!(whole.len(), STEPS.parse::<usize>().unwrap(), "zero {zero}");
        assert_eq!(small, whole, "zero {zero}: buckets of 8 KiB against one");
    }
}

/// The group timeout of the fault tests, in seconds.
const GROUP_TIMEOUT_S: u64 = 10;
/// How long after the group timeout a rank may still be stopping: NCCL's abort (at most 10 s)
/// and the aborted kernels (10 s), plus the process's exit.
const STOP_BOUND: Duration = Duration::from_secs(30);

/// Waits at most `limit` for `child` to end, then kills it; its exit code, if it ended itself.
fn exit_code_within(child: &mut Child, limit: Duration) -> Option<i32> {
    let until = Instant::now() + limit;
    while Instant::now() < until {
        if let Ok(Some(status)) = child.try_wait() {
            return status.code();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL: run with --ignored on the GPU machine"]
fn nccl_a_rank_whose_peer_process_dies_mid_run_exits_naming_it() {
    let dir = TempDir::new("peer-dies");
    let port = free_port();
    let timeout = GROUP_TIMEOUT_S.to_string();
    let spawn = |rank: usize| {
        rank_process(rank, port, "100000", dir.path())
            .args(["--group-timeout", &timeout])
            .stdout(Stdio::null())
            .stderr(if rank == 0 {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .spawn()
            .expect("llama_train starts")
    };
    let (mut survivor, mut victim) = (spawn(0), spawn(1));
    // Rank 0's standard error, line by line; a notice once its second step is logged.
    let (stepped, second_step) = mpsc::channel();
    let stderr = survivor.stderr.take().expect("rank 0's stderr");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.starts_with("step 2/") {
                let _ = stepped.send(());
            }
            text.push_str(&line);
            text.push('\n');
        }
        text
    });
    let started = second_step.recv_timeout(Duration::from_secs(180));
    let _ = victim.kill();
    let _ = victim.wait();
    let killed_at = Instant::now();
    let limit = Duration::from_secs(GROUP_TIMEOUT_S) + STOP_BOUND;
    let code = exit_code_within(&mut survivor, limit);
    let stopped_after = killed_at.elapsed();
    let stderr = reader.join().expect("rank 0's stderr reader");
    assert!(
        started.is_ok(),
        "rank 0 never logged its second step: {stderr}"
    );
    assert_eq!(
        code,
        Some(1),
        "rank 0 must exit with code 1 within {limit:?} of its peer's death \
         (ended itself: {}, after {stopped_after:?}): {stderr}",
        code.is_some()
    );
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("llama_train: step ") && last.contains("rank 1"),
        "rank 0's last line must name the step and the silent rank: {stderr}"
    );
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL: run with --ignored on the GPU machine"]
fn nccl_a_rank_whose_rank_0_never_starts_exits_naming_the_rendezvous() {
    let dir = TempDir::new("lonely-rank");
    let port = free_port();
    let start = Instant::now();
    // Rank 1 alone: rank 0, which would listen on the port, never starts.
    let output = rank_process(1, port, STEPS, dir.path())
        .args(["--group-timeout", &GROUP_TIMEOUT_S.to_string()])
        .output()
        .expect("llama_train starts");
    let stderr = stderr_of(&output, 2);
    assert!(
        start.elapsed() < Duration::from_secs(GROUP_TIMEOUT_S) + STOP_BOUND,
        "{:?}: {stderr}",
        start.elapsed()
    );
    assert!(stderr.contains(&format!("127.0.0.1:{port}")), "{stderr}");
}
