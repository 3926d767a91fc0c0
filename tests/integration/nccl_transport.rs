//! The NCCL transport: setup refused before CUDA is touched and missing libraries reported run
//! anywhere (CI; the rendezvous and the environment parsing have unit tests beside them in
//! `src/collective/nccl/`); the exchanges need two CUDA GPUs with NCCL and are `#[ignore]`d: run
//! them with `.ci/gpu-tests -f nccl_transport` on the GPU machine (they
//! skip with a message when fewer than two GPUs, or no NCCL, are there). The collectives run on
//! NCCL groups of two GPUs and, in bf16, on in-process groups of one GPU (no CPU backend holds
//! bf16). The faults (a peer that stops, ends its thread or exits) are in `nccl_faults`, which
//! shares this module's tensor helpers.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use crate::common::collective_case::check_collectives;
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, TensorData};
use burn_cubecl::CubeBackend;
use burn_distflash::collective::nccl::{self, NcclTransport};
use burn_distflash::collective::{
    on_each_rank, DeviceGroup, Incoming, MessageKind, Outgoing, TensorLayout, Transport,
};
use burn_distflash::Error;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use half::bf16;

pub(crate) type B = CubeBackend<CudaRuntime, f32, i32, u8>;
pub(crate) type Tensor = burn::tensor::ops::FloatTensor<B>;

/// A localhost address with a port that was free a moment ago.
pub(crate) fn free_addr() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    let port = listener.local_addr().expect("local address").port();
    format!("127.0.0.1:{port}")
}

// ---------------------------------------------------------------------------------------------
// Setup refused before CUDA is touched; missing libraries are errors, not panics (no GPU)
// ---------------------------------------------------------------------------------------------

#[test]
fn bad_device_lists_are_refused() {
    match DeviceGroup::<B>::nccl(&[]) {
        Err(Error::GroupSetup(message)) => assert!(message.contains("none was given"), "{message}"),
        other => panic!("expected a setup error, got {other:?}"),
    }
    let devices = [CudaDevice::new(0), CudaDevice::new(1), CudaDevice::new(0)];
    match DeviceGroup::<B>::nccl(&devices) {
        Err(Error::GroupSetup(message)) => {
            assert!(
                message.contains("Cuda(0)") && message.contains("twice"),
                "{message}"
            )
        }
        other => panic!("expected a setup error, got {other:?}"),
    }
    match DeviceGroup::<B>::nccl_with_rendezvous(
        2,
        2,
        CudaDevice::new(0),
        "127.0.0.1:1",
        Duration::from_secs(1),
    ) {
        Err(Error::GroupSetup(message)) => assert!(message.contains("rank 2"), "{message}"),
        other => panic!("expected a setup error, got {other:?}"),
    }
}

#[test]
fn missing_cuda_or_nccl_is_an_error_not_a_panic() {
    let Err(probe) = nccl::probe() else {
        eprintln!("skipped: CUDA and NCCL are both present on this machine");
        return;
    };
    let Error::Nccl(message) = &probe else {
        panic!("expected an NCCL error, got {probe:?}");
    };
    assert!(
        message.contains("libcuda") || message.contains("libnccl"),
        "{message}"
    );
    let devices = [CudaDevice::new(0), CudaDevice::new(1)];
    assert_eq!(DeviceGroup::<B>::nccl(&devices).unwrap_err(), probe);
    let single = DeviceGroup::<B>::nccl_with_rendezvous(
        0,
        1,
        CudaDevice::new(0),
        "",
        Duration::from_secs(1),
    );
    assert_eq!(single.unwrap_err(), probe);
}

// ---------------------------------------------------------------------------------------------
// Exchanges on two GPUs (ignored: run on the GPU machine)
// ---------------------------------------------------------------------------------------------

/// Fails the test, saying why, unless this machine has `n` GPUs and NCCL: an ignored GPU test
/// run where it cannot run must not pass as if it had.
fn require_gpus(n: usize) {
    if let Err(e) = nccl::probe() {
        panic!("needs {n} CUDA GPU(s) and NCCL: {e}");
    }
    match nccl::device_count() {
        Ok(count) if count >= n => {}
        Ok(count) => panic!("needs {n} CUDA GPU(s), this machine has {count}"),
        Err(e) => panic!("needs {n} CUDA GPU(s): {e}"),
    }
}

fn devices(n: usize) -> Vec<CudaDevice> {
    (0..n).map(CudaDevice::new).collect()
}

/// Runs `body(group)` for both ranks of an NCCL group over two GPUs with `timeout`, each rank
/// on its own thread; fails at once where the machine has no two GPUs and NCCL.
fn on_two_gpus(timeout: Duration, body: impl Fn(DeviceGroup<B>) + Sync) {
    require_gpus(2);
    let groups = DeviceGroup::<B>::nccl_with_timeout(&devices(2), timeout).expect("NCCL group");
    on_each_rank(groups, |_, group| body(group));
}

/// Small integers: exact in bf16 and f32. Different per rank, message and tensor.
pub(crate) fn values(rank: usize, salt: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((rank * 97 + salt * 31 + i) % 251) as f32 - 100.0)
        .collect()
}

pub(crate) fn f32_tensor(device: &CudaDevice, shape: &[usize], data: Vec<f32>) -> Tensor {
    B::float_from_data(TensorData::new(data, shape.to_vec()), device)
}

fn bf16_tensor(device: &CudaDevice, shape: &[usize], data: Vec<f32>) -> Tensor {
    let data: Vec<bf16> = data.into_iter().map(bf16::from_f32).collect();
    B::float_from_data(TensorData::new(data, shape.to_vec()), device)
}

/// A tensor on the host: dtype, shape, values.
pub(crate) type HostTensor = (DType, Vec<usize>, Vec<f32>);

pub(crate) fn host(tensor: Tensor) -> HostTensor {
    let data = cubecl::future::block_on(B::float_into_data(tensor)).expect("read back");
    let values = data.iter::<f32>().collect();
    (data.dtype, data.shape.to_vec(), values)
}

pub(crate) fn layout(shape: &[usize], dtype: DType) -> TensorLayout {
    TensorLayout {
        shape: shape.to_vec(),
        dtype,
    }
}

/// What rank `from` sends: a KeyValue message `[f32 [3, 5], bf16 [2, 7] (sent transposed,
/// non-contiguous)]` and a Query message `[bf16 [4, 3]]`.
fn expected(from: usize) -> Vec<(MessageKind, Vec<HostTensor>)> {
    let transposed: Vec<f32> = {
        // The [7, 2] tensor rank `from` built, read as its transpose [2, 7].
        let built = values(from, 2, 14);
        (0..2)
            .flat_map(|r| (0..7).map(move |c| (r, c)))
            .map(|(r, c)| built[c * 2 + r])
            .collect()
    };
    vec![
        (
            MessageKind::KeyValue,
            vec![
                (DType::F32, vec![3, 5], values(from, 1, 15)),
                (DType::BF16, vec![2, 7], transposed),
            ],
        ),
        (
            MessageKind::Query,
            vec![(DType::BF16, vec![4, 3], values(from, 3, 12))],
        ),
    ]
}

fn sends(rank: usize, peer: usize, device: &CudaDevice) -> Vec<Outgoing<B>> {
    let kv = Outgoing {
        peer,
        kind: MessageKind::KeyValue,
        tensors: vec![
            f32_tensor(device, &[3, 5], values(rank, 1, 15)),
            B::float_swap_dims(bf16_tensor(device, &[7, 2], values(rank, 2, 14)), 0, 1),
        ],
    };
    let query = Outgoing {
        peer,
        kind: MessageKind::Query,
        tensors: vec![bf16_tensor(device, &[4, 3], values(rank, 3, 12))],
    };
    // The ranks list their messages in different orders; the transport must still match them.
    if rank == 0 {
        vec![kv, query]
    } else {
        vec![query, kv]
    }
}

fn receives(rank: usize, peer: usize) -> Vec<Incoming> {
    let kv = Incoming {
        peer,
        kind: MessageKind::KeyValue,
        layouts: vec![layout(&[3, 5], DType::F32), layout(&[2, 7], DType::BF16)],
    };
    let query = Incoming {
        peer,
        kind: MessageKind::Query,
        layouts: vec![layout(&[4, 3], DType::BF16)],
    };
    if rank == 0 {
        vec![query, kv]
    } else {
        vec![kv, query]
    }
}

fn check_received(
    rank: usize,
    peer: usize,
    incoming: &[Incoming],
    got: Vec<burn_distflash::collective::Received<B>>,
) {
    let want = expected(peer);
    assert_eq!(got.len(), incoming.len());
    for (message, asked) in got.into_iter().zip(incoming) {
        assert_eq!((message.peer, message.kind), (asked.peer, asked.kind));
        let (_, tensors) = want
            .iter()
            .find(|(kind, _)| *kind == asked.kind)
            .expect("a kind that was sent");
        let got: Vec<_> = message.tensors.into_iter().map(host).collect();
        assert_eq!(
            &got, tensors,
            "rank {rank}: {:?} from rank {peer}",
            asked.kind
        );
    }
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL: run with --ignored on the GPU machine"]
fn f32_and_bf16_messages_cross_both_ways() {
    on_two_gpus(Duration::from_secs(60), |group| {
        let (rank, peer) = (group.rank(), 1 - group.rank());
        let device = group.device().clone();
        let incoming = receives(rank, peer);
        let exchange = group
            .exchange(sends(rank, peer, &device), incoming.clone())
            .expect("post");
        let got = exchange.wait().expect("wait");
        check_received(rank, peer, &incoming, got);

        // Addressing itself or a rank outside the group is refused before anything moves.
        let to_self = group.exchange(
            Vec::new(),
            vec![Incoming {
                peer: rank,
                ..incoming[0].clone()
            }],
        );
        assert!(matches!(to_self.err(), Some(Error::Mismatch { .. })));
        let outside = group.exchange(
            Vec::new(),
            vec![Incoming {
                peer: 2,
                ..incoming[0].clone()
            }],
        );
        assert!(matches!(outside.err(), Some(Error::GroupSetup(_))));
    });
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL: run with --ignored on the GPU machine"]
fn exchanges_posted_before_waiting_complete_in_order() {
    on_two_gpus(Duration::from_secs(60), |group| {
        let (rank, peer) = (group.rank(), 1 - group.rank());
        let device = group.device().clone();
        let step = |salt: usize| {
            let send = Outgoing {
                peer,
                kind: MessageKind::KeyValue,
                tensors: vec![f32_tensor(&device, &[64, 33], values(rank, salt, 64 * 33))],
            };
            let receive = Incoming {
                peer,
                kind: MessageKind::KeyValue,
                layouts: vec![layout(&[64, 33], DType::F32)],
            };
            group.exchange(vec![send], vec![receive]).expect("post")
        };
        let check = |received: Vec<burn_distflash::collective::Received<B>>, salt: usize| {
            let mut message = received.into_iter().next().expect("one message");
            let (dtype, shape, data) = host(message.tensors.remove(0));
            assert_eq!((dtype, shape), (DType::F32, vec![64, 33]));
            assert_eq!(
                data,
                values(peer, salt, 64 * 33),
                "rank {rank}, step {salt}"
            );
        };
        // Prefetch: step 2 travels while step 1 is consumed; step 3 is posted before step 2 is
        // waited on.
        let first = step(1);
        let second = step(2);
        check(first.wait().expect("wait 1"), 1);
        let third = step(3);
        check(second.wait().expect("wait 2"), 2);
        check(third.wait().expect("wait 3"), 3);
    });
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL: run with --ignored on the GPU machine"]
fn all_gather_values_returns_every_rank() {
    on_two_gpus(Duration::from_secs(60), |group| {
        let rank = group.rank() as u64;
        let gathered = group
            .all_gather_values(&[rank, 10 + rank, u64::MAX - rank])
            .expect("all-gather");
        assert_eq!(
            gathered,
            vec![vec![0, 10, u64::MAX], vec![1, 11, u64::MAX - 1]]
        );
        // Ranks that disagree on the length get an error, and the group stays usable.
        let uneven: Vec<u64> = (0..=rank).collect();
        assert!(matches!(
            group.all_gather_values(&uneven),
            Err(Error::Mismatch { .. })
        ));
        assert_eq!(
            group.all_gather_values(&[]).expect("empty all-gather"),
            vec![Vec::<u64>::new(), Vec::new()]
        );
    });
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL: run with --ignored on the GPU machine"]
fn a_silent_peer_gives_a_timeout() {
    let timeout = Duration::from_secs(3);
    on_two_gpus(timeout, |group| {
        let (rank, peer) = (group.rank(), 1 - group.rank());
        // Each rank expects a message the other never sends.
        let kind = if rank == 0 {
            MessageKind::KeyValue
        } else {
            MessageKind::Query
        };
        let started = Instant::now();
        let outcome = group
            .exchange(
                Vec::new(),
                vec![Incoming {
                    peer,
                    kind,
                    layouts: vec![layout(&[128], DType::F32)],
                }],
            )
            .and_then(|exchange| exchange.wait());
        let elapsed = started.elapsed();
        match outcome {
            Err(Error::Timeout {
                rank: r,
                peer: p,
                kind: k,
                waited,
            }) => {
                assert_eq!((r, p, k), (rank, peer, kind));
                assert!(waited >= timeout, "waited {waited:?}");
            }
            Err(other) => panic!("rank {rank}: expected a timeout, got {other}"),
            Ok(_) => panic!("rank {rank}: a message nobody sent arrived"),
        }
        assert!(
            elapsed < timeout + Duration::from_secs(12),
            "took {elapsed:?}"
        );
        // The communicator is gone: later calls fail at once instead of hanging.
        let again = group.all_gather_values(&[1]);
        assert!(matches!(again, Err(Error::Nccl(_))), "{again:?}");
    });
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL: run with --ignored on the GPU machine"]
fn rendezvous_groups_exchange_tensors() {
    require_gpus(2);
    let addr = free_addr();
    let groups: Vec<DeviceGroup<B>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let addr = addr.clone();
                s.spawn(move || {
                    let transport = NcclTransport::<f32, i32, u8>::with_rendezvous(
                        rank,
                        2,
                        CudaDevice::new(rank),
                        &addr,
                        Duration::from_secs(60),
                    )
                    .expect("rendezvous group");
                    assert_eq!(Transport::<B>::rank(&transport), rank);
                    DeviceGroup::new(transport)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    on_each_rank(groups, |_, group| {
        let (rank, peer) = (group.rank(), 1 - group.rank());
        let device = group.device().clone();
        let incoming = receives(rank, peer);
        let got = group
            .exchange(sends(rank, peer, &device), incoming.clone())
            .expect("post")
            .wait()
            .expect("wait");
        check_received(rank, peer, &incoming, got);
    });
}

// ---------------------------------------------------------------------------------------------
// Collectives (ignored: run on the GPU machine)
// ---------------------------------------------------------------------------------------------

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL: run with --ignored on the GPU machine"]
fn nccl_collectives_in_f32_and_bf16_equal_a_host_sum() {
    require_gpus(2);
    for dtype in [DType::F32, DType::BF16] {
        let groups = DeviceGroup::<B>::nccl_with_timeout(&devices(2), Duration::from_secs(60))
            .expect("NCCL group");
        check_collectives(groups, dtype);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn in_process_collectives_in_bf16_and_f32_on_one_gpu_equal_a_rank_ordered_host_sum() {
    require_gpus(1);
    for dtype in [DType::BF16, DType::F32] {
        for world in 1..=8 {
            let groups = DeviceGroup::<B>::in_process(vec![CudaDevice::new(0); world]);
            check_collectives(groups, dtype);
        }
    }
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL: run with --ignored on the GPU machine"]
fn nccl_all_reduce_leaves_a_shared_input_alone_and_bad_calls_are_refused() {
    on_two_gpus(Duration::from_secs(60), |group| {
        let (rank, device) = (group.rank(), group.device().clone());
        let want: Vec<f32> = (0..12)
            .map(|i| values(0, 9, 12)[i] + values(1, 9, 12)[i])
            .collect();
        // The caller keeps a handle: the sum goes to a buffer of its own.
        let input = f32_tensor(&device, &[4, 3], values(rank, 9, 12));
        let kept = input.clone();
        let sum = group.all_reduce(input).expect("all_reduce");
        assert_eq!(host(kept), (DType::F32, vec![4, 3], values(rank, 9, 12)));
        assert_eq!(host(sum), (DType::F32, vec![4, 3], want.clone()));
        // The only handle: summed in place.
        let input = f32_tensor(&device, &[4, 3], values(rank, 9, 12));
        let sum = group.all_reduce(input).expect("in-place all_reduce");
        assert_eq!(host(sum), (DType::F32, vec![4, 3], want));
        // Refused on every rank before anything moves; the group goes on.
        let odd = f32_tensor(&device, &[3], values(rank, 1, 3));
        match group.reduce_scatter(odd) {
            Err(Error::Shape { expected, .. }) => {
                assert!(
                    expected.contains("divisible by the group's 2 ranks"),
                    "{expected}"
                )
            }
            other => panic!("rank {rank}: expected a shape error, got {other:?}"),
        }
        let gathered = group
            .all_gather(bf16_tensor(&device, &[1, 2], values(rank, 2, 2)))
            .expect("all_gather");
        let want: Vec<f32> = [values(0, 2, 2), values(1, 2, 2)].concat();
        assert_eq!(host(gathered), (DType::BF16, vec![2, 2], want));
    });
}

#[test]
#[ignore = "needs 2 CUDA GPUs and NCCL: run with --ignored on the GPU machine"]
fn a_rank_that_skips_a_collective_times_it_out() {
    let timeout = Duration::from_secs(3);
    on_two_gpus(timeout, |group| {
        let (rank, device) = (group.rank(), group.device().clone());
        if rank == 1 {
            // Still in the group while rank 0 waits in vain.
            std::thread::sleep(3 * timeout);
            return;
        }
        let started = Instant::now();
        match group.all_reduce(f32_tensor(&device, &[64], values(rank, 1, 64))) {
            Err(Error::Timeout {
                rank: 0,
                peer: 1,
                kind: MessageKind::Reduction,
                waited,
            }) => assert!(waited >= timeout, "waited {waited:?}"),
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(started.elapsed() < timeout + Duration::from_secs(12));
        // The communicator is gone: later calls fail at once instead of hanging.
        let again = group.all_gather(f32_tensor(&device, &[2], values(rank, 1, 2)));
        assert!(matches!(again, Err(Error::Nccl(_))), "{:?}", again.err());
    });
}
