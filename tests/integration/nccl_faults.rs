//! Faults on real GPUs: a rank of a two-GPU NCCL group that stops answering (in one process or
//! as a second process), ends its thread (dropping its group) or exits its process after the
//! first of several steps (point-to-point
//! exchanges, all-reduces, sequence-parallel attention calls) makes the surviving rank's next
//! step return a collective error that names the silent rank, within the group's timeout plus
//! [`BOUND`]; later calls fail at once. Nothing may hang: every test runs under a wall-clock
//! limit. `#[ignore]`d: run them with `.ci/gpu-tests -f nccl_faults` on a machine with two GPUs
//! and NCCL (with fewer they fail, saying what is missing).

use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use crate::common::distributed_case::{Case, CaseData};
use crate::common::within;
use crate::nccl_transport::{f32_tensor, free_addr, host, layout, values, B};
use burn::tensor::DType;
use burn_distflash::collective::nccl::{self, RENDEZVOUS_PORT_VAR};
use burn_distflash::collective::{
    on_each_rank, DeviceGroup, Exchange, Incoming, MessageKind, Outgoing,
};
use burn_distflash::schedule::ScheduleKind;
use burn_distflash::sequence_parallel::sequence_parallel_attention;
use burn_distflash::Error;
use cubecl::cuda::CudaDevice;
use distflash_kernels::ElemType;

/// The groups' timeout in one process for exchanges and all-reduces (setup is local and quick).
const TIMEOUT: Duration = Duration::from_secs(5);
/// The groups' timeout in one process for attention calls: the first call compiles the kernels
/// (NVRTC), which one rank may still be doing while the other waits for its first message.
const ATTENTION_TIMEOUT: Duration = Duration::from_secs(30);
/// The timeout across two processes: it also bounds the rendezvous and the child's CUDA and
/// NCCL setup.
const PROCESS_TIMEOUT: Duration = Duration::from_secs(20);
/// How long after the timeout a failure may come: NCCL's abort is waited for at most 10 s, then
/// the kernels get 10 s to stop.
const BOUND: Duration = Duration::from_secs(25);
/// Wall-clock limit around a whole test.
const LIMIT: Duration = Duration::from_secs(300);
/// Steps the surviving rank tries: the first with its peer, then the ones that must fail.
const STEPS: usize = 4;
/// Elements of a point-to-point step's tensor.
const SHAPE: [usize; 2] = [64, 33];

/// Set in the child process of the two-process test: it plays rank 1.
const CHILD_VAR: &str = "DISTFLASH_NCCL_FAULT_CHILD";
/// The child's exit code after it left mid-exchange on purpose.
const CHILD_EXIT: i32 = 17;
/// The child's exit code when its setup or first step failed.
const CHILD_FAILED: i32 = 3;

/// Fails, saying what is missing, unless this machine has two CUDA GPUs and NCCL.
fn require_two_gpus() {
    if let Err(e) = nccl::probe() {
        panic!("needs 2 CUDA GPUs and NCCL: {e}");
    }
    let count = nccl::device_count().unwrap_or_else(|e| panic!("needs a CUDA driver: {e}"));
    assert!(count >= 2, "needs 2 CUDA GPUs, this machine has {count}");
}

/// What one step of the ranks does.
#[derive(Debug, Clone, Copy)]
enum Traffic {
    /// One point-to-point exchange each way.
    PointToPoint,
    /// One all-reduce (NCCL's kernel).
    AllReduce,
    /// One sequence-parallel attention forward (an agreement, then point-to-point steps).
    Attention,
}

/// How rank 1 leaves after the first step.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// Keeps its group but calls nothing more, for longer than the survivor waits.
    StopsAnswering,
    /// Its thread ends and drops its group (a point-to-point peer first posts the second step
    /// and drops it unfinished).
    ThreadEnds,
}

/// The point-to-point exchange of step `salt`, posted (not waited for).
fn post(group: &DeviceGroup<B>, salt: usize) -> Result<Box<dyn Exchange<B> + '_>, Error> {
    let (rank, peer) = (group.rank(), 1 - group.rank());
    let send = Outgoing {
        peer,
        kind: MessageKind::KeyValue,
        tensors: vec![f32_tensor(
            group.device(),
            &SHAPE,
            values(rank, salt, SHAPE[0] * SHAPE[1]),
        )],
    };
    let receive = Incoming {
        peer,
        kind: MessageKind::KeyValue,
        layouts: vec![layout(&SHAPE, DType::F32)],
    };
    group.exchange(vec![send], vec![receive])
}

/// Step `salt` of `traffic` with the peer; what arrived is checked where it is cheap to.
fn step(group: &DeviceGroup<B>, traffic: Traffic, salt: usize) -> Result<(), Error> {
    let (rank, peer) = (group.rank(), 1 - group.rank());
    let n = SHAPE[0] * SHAPE[1];
    match traffic {
        Traffic::PointToPoint => {
            let mut received = post(group, salt)?.wait()?;
            let (_, _, data) = host(received.remove(0).tensors.remove(0));
            assert_eq!(data, values(peer, salt, n), "rank {rank}, step {salt}");
        }
        Traffic::AllReduce => {
            let tensor = f32_tensor(group.device(), &SHAPE, values(rank, salt, n));
            let (_, _, data) = host(group.all_reduce(tensor)?);
            let want: Vec<f32> = (values(0, salt, n).iter().zip(values(1, salt, n)))
                .map(|(a, b)| a + b)
                .collect();
            assert_eq!(data, want, "rank {rank}, step {salt}");
        }
        Traffic::Attention => {
            let case = Case::new(2, 64, ScheduleKind::Ring);
            let data = CaseData::new(case, ElemType::F32);
            let [q, k, v] = data.rank_inputs(rank).tensors::<B>(group.device());
            sequence_parallel_attention(q, k, v, group, &case.options())?;
        }
    }
    Ok(())
}

/// Rank 0's side: the first step with its peer, then steps until one fails (at the latest the
/// last); that failure is checked (see [`check_failure`]) and returned.
fn survive(group: &DeviceGroup<B>, traffic: Traffic, timeout: Duration) -> Error {
    step(group, traffic, 1).unwrap_or_else(|e| panic!("rank 0, first step ({traffic:?}): {e}"));
    for salt in 2..=STEPS {
        let started = Instant::now();
        if let Err(error) = step(group, traffic, salt) {
            check_failure(&error, started.elapsed(), timeout);
            // The communicator is gone: later calls fail at once instead of hanging.
            let started = Instant::now();
            let again = step(group, traffic, salt + 1);
            assert!(
                matches!(again, Err(Error::Nccl(_))),
                "after the failure, expected an NCCL error, got {again:?}"
            );
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "{:?}",
                started.elapsed()
            );
            return error;
        }
    }
    panic!("rank 0: {traffic:?} steps 2..={STEPS} all completed without the peer");
}

/// A survivor's error: a collective one (a timeout or the transport's error) that names rank
/// 1, within the timeout plus [`BOUND`].
fn check_failure(error: &Error, elapsed: Duration, timeout: Duration) {
    eprintln!("rank 0 got, after {elapsed:?}: {error}");
    assert!(
        error.is_collective(),
        "expected a collective error: {error}"
    );
    match error {
        Error::Timeout {
            rank: 0,
            peer: 1,
            waited,
            ..
        } => assert!(*waited >= timeout, "timed out after {waited:?}"),
        Error::Timeout { .. } => panic!("a timeout that blames the wrong ranks: {error}"),
        Error::Nccl(_) => {}
        other => panic!("expected a timeout or an NCCL error, got {other:?}"),
    }
    let text = error.to_string();
    assert!(
        text.contains("rank 0:") && text.contains("rank 1"),
        "the error does not name this rank and the peer: {text}"
    );
    assert!(
        elapsed < timeout + BOUND,
        "the failure took {elapsed:?}, more than the timeout {timeout:?} plus {BOUND:?}"
    );
}

/// Runs `traffic` on a fresh two-GPU group in which rank 1 leaves as `fault` says after the
/// first step.
fn survive_in_process(traffic: Traffic, fault: Fault) {
    let timeout = match traffic {
        Traffic::Attention => ATTENTION_TIMEOUT,
        Traffic::PointToPoint | Traffic::AllReduce => TIMEOUT,
    };
    let groups =
        DeviceGroup::<B>::nccl_with_timeout(&[CudaDevice::new(0), CudaDevice::new(1)], timeout)
            .expect("NCCL group");
    on_each_rank(groups, |_, group| {
        if group.rank() == 0 {
            survive(&group, traffic, timeout);
            return;
        }
        step(&group, traffic, 1).unwrap_or_else(|e| panic!("rank 1, first step: {e}"));
        match (fault, traffic) {
            (Fault::StopsAnswering, _) => std::thread::sleep(timeout + BOUND),
            (Fault::ThreadEnds, Traffic::PointToPoint) => {
                let unfinished = post(&group, 2);
                drop(unfinished);
            }
            (Fault::ThreadEnds, _) => {}
        }
        drop(group);
    });
}

/// [`survive_in_process`] under `fault` for point-to-point exchanges, all-reduces and attention.
fn survive_every_traffic_in_process(fault: Fault) {
    for traffic in [
        Traffic::PointToPoint,
        Traffic::AllReduce,
        Traffic::Attention,
    ] {
        survive_in_process(traffic, fault);
    }
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL: run with --ignored on the GPU machine"]
fn nccl_a_rank_that_stops_answering_mid_exchange_fails_the_other_within_the_timeout() {
    require_two_gpus();
    within(LIMIT, || {
        survive_every_traffic_in_process(Fault::StopsAnswering)
    });
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL: run with --ignored on the GPU machine"]
fn nccl_a_rank_whose_thread_ends_mid_exchange_fails_the_other_within_the_timeout() {
    require_two_gpus();
    within(LIMIT, || {
        survive_every_traffic_in_process(Fault::ThreadEnds)
    });
}

/// Kills the child (if it still runs) and reaps it when dropped, whatever happened.
struct Reaped(Child);

impl Reaped {
    /// The child's exit status, waiting at most `limit`.
    fn status_within(&mut self, limit: Duration) -> Option<ExitStatus> {
        let until = Instant::now() + limit;
        loop {
            match self.0.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(20)),
                _ => return None,
            }
        }
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Rank 1 in the child process: joins from the environment, runs the first point-to-point step,
/// posts the second, then exits without waiting for it (nothing is dropped or aborted) or, when
/// it plays a rank that stops answering, sleeps until it is killed.
fn child_rank(fault: &str) -> ! {
    let group = match DeviceGroup::<B>::nccl_from_env_with_timeout(PROCESS_TIMEOUT) {
        Ok(group) => group,
        Err(e) => {
            eprintln!("child rank 1: setup failed: {e}");
            std::process::exit(CHILD_FAILED);
        }
    };
    if let Err(e) = step(&group, Traffic::PointToPoint, 1) {
        eprintln!("child rank 1: first step failed: {e}");
        std::process::exit(CHILD_FAILED);
    }
    let unfinished = post(&group, 2);
    let posted = if unfinished.is_ok() { "ok" } else { "refused" };
    if fault == STALLS {
        eprintln!("child rank 1: silent with step 2 posted ({posted})");
        std::thread::sleep(LIMIT);
    }
    eprintln!("child rank 1: exiting with step 2 posted ({posted})");
    std::process::exit(CHILD_EXIT);
}

/// [`CHILD_VAR`]'s value for a child that stops answering (any other value: it exits).
const STALLS: &str = "stalls";

/// This test's name as the test harness knows it (its module path without the crate).
fn own_test_name(function: &str) -> String {
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    format!("{module}::{function}")
}

/// Rank 0 here, rank 1 a child process running the test `function` of this binary, which
/// leaves after the first step as `fault` ([`STALLS`] or "exits") says; rank 0's next step must
/// fail within the timeout plus [`BOUND`], naming rank 1.
fn survive_child_process(function: &str, fault: &str) {
    if let Ok(fault) = std::env::var(CHILD_VAR) {
        child_rank(&fault);
    }
    require_two_gpus();
    let addr = free_addr();
    let (master_addr, master_port) = addr.rsplit_once(':').expect("host:port");
    let exe = std::env::current_exe().expect("this test binary");
    let child = Command::new(exe)
        .args([
            &own_test_name(function),
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD_VAR, fault)
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", "1")
        .env("MASTER_ADDR", master_addr)
        .env("MASTER_PORT", master_port)
        .env_remove(RENDEZVOUS_PORT_VAR)
        .spawn()
        .expect("start the child process (rank 1)");
    let mut child = Reaped(child);
    let error = within(LIMIT, move || {
        let group = DeviceGroup::<B>::nccl_with_rendezvous(
            0,
            2,
            CudaDevice::new(0),
            &addr,
            PROCESS_TIMEOUT,
        )
        .expect("rank 0 of a two-process group");
        survive(&group, Traffic::PointToPoint, PROCESS_TIMEOUT).to_string()
    });
    if fault == STALLS {
        let status = child.0.try_wait();
        assert!(
            matches!(status, Ok(None)),
            "the child was to stay alive and silent ({status:?}); rank 0's error was: {error}"
        );
        return;
    }
    let status = child.status_within(Duration::from_secs(30));
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(CHILD_EXIT),
        "the child did not leave as planned ({status:?}); rank 0's error was: {error}"
    );
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL: run with --ignored on the GPU machine"]
fn nccl_a_process_that_exits_mid_exchange_fails_the_other_with_a_clear_error() {
    survive_child_process(
        "nccl_a_process_that_exits_mid_exchange_fails_the_other_with_a_clear_error",
        "exits",
    );
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL: run with --ignored on the GPU machine"]
fn nccl_a_process_that_stops_answering_mid_exchange_fails_the_other_within_the_timeout() {
    survive_child_process(
        "nccl_a_process_that_stops_answering_mid_exchange_fails_the_other_within_the_timeout",
        STALLS,
    );
}
