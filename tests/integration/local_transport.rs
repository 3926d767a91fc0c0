//! The in-process transport's contract: a received tensor is the receiver's own memory (the
//! sender may drop and reuse its memory at once, on wgpu where streams have their own pools);
//! bad peers and uneven all-gathers are refused with the group still usable; a failure while
//! messages move breaks the group, and later calls say so at once. Its collectives equal a
//! rank-ordered host sum for 1 to 8 ranks (f32 on ndarray here; f16 on wgpu in the
//! `half_precision` test binary, bf16 on CUDA in `nccl_transport`), and refuse bad or mismatched
//! calls on every rank.

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use crate::common::collective_case::{check_collectives, float_tensor, host, values};
use crate::common::within::within;
use burn::backend::ndarray::NdArrayDevice;
use burn::backend::NdArray;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, FloatDType, Tensor, TensorData, TensorPrimitive};
use burn_distflash::collective::on_each_rank;
use burn_distflash::collective::{Incoming, MessageKind, Outgoing, TensorLayout};
use burn_distflash::{DeviceGroup, Error};
use cubecl::wgpu::WgpuDevice;

type Cpu = NdArray<f32>;
type WgpuF32 = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;

const LIMIT: Duration = Duration::from_secs(120);
const N: usize = 4096;

/// `N` copies of `value`.
fn tensor<B: Backend>(value: f32, device: &B::Device) -> Tensor<B, 1> {
    Tensor::from_data(TensorData::new(vec![value; N], [N]), device)
}

/// `t` for `peer`.
fn message<B: Backend>(peer: usize, t: Tensor<B, 1>) -> Outgoing<B> {
    Outgoing {
        peer,
        kind: MessageKind::Reduction,
        tensors: vec![t.into_primitive().tensor()],
    }
}

/// An f32 tensor of `N` elements expected from `peer`.
fn expect(peer: usize) -> Incoming {
    let layout = TensorLayout {
        shape: vec![N],
        dtype: burn::tensor::DType::F32,
    };
    Incoming {
        peer,
        kind: MessageKind::Reduction,
        layouts: vec![layout],
    }
}

/// Rank 0 sends a tensor of ones and, once rank 1 has queued a kernel reading it, drops it and
/// fills fresh tensors of the same size (reusing its memory); rank 1 must still read ones.
#[test]
fn a_received_tensor_survives_the_sender_reusing_its_memory_on_wgpu() {
    within(LIMIT, || {
        let device = WgpuDevice::Cpu;
        let mut groups = DeviceGroup::<WgpuF32>::in_process(vec![device.clone(); 2]);
        let (receiver, sender) = (groups.remove(0), groups.remove(0));
        let queued = Arc::new(Barrier::new(2));
        let reused = Arc::new(Barrier::new(2));
        let (q, r) = (queued.clone(), reused.clone());
        let dev = device.clone();
        let sending = thread::spawn(move || {
            let sent = tensor::<WgpuF32>(1.0, &dev);
            sender
                .exchange(vec![message(0, sent)], vec![])
                .unwrap()
                .wait()
                .unwrap();
            q.wait();
            // The sent tensor is gone; new tensors of its size take its memory.
            let fresh: Vec<_> = (0..8)
                .map(|i| tensor::<WgpuF32>(-7.0 - i as f32, &dev))
                .collect();
            WgpuF32::sync(&dev).unwrap();
            r.wait();
            drop(fresh);
        });
        let received = receiver.exchange(vec![], vec![expect(1)]).unwrap();
        let mut received = received.wait().unwrap();
        let t = received.remove(0).tensors.remove(0);
        // An exchange between receipt and use, as the pipeline posts the next step's inputs.
        receiver.exchange(vec![], vec![]).unwrap().wait().unwrap();
        let t = Tensor::<WgpuF32, 1>::from_primitive(TensorPrimitive::Float(t));
        // Queued, not run; the clone makes it write a new buffer rather than `t`'s.
        let doubled = t.clone() * 2.0;
        // The last handle on the received tensor: its memory is free for its owner's stream.
        drop(t);
        queued.wait();
        reused.wait();
        let values = doubled.into_data().to_vec::<f32>().unwrap();
        sending.join().unwrap();
        let wrong = values.iter().filter(|&&v| v != 2.0).count();
        assert_eq!(
            wrong, 0,
            "{wrong} of {N} elements read the sender's reused memory"
        );
    });
}

/// Runs `body(rank, group)` for both ranks of an in-process pair on the CPU, one thread each,
/// with a short timeout for silent peers.
fn on_pair<T: Send + 'static>(
    timeout: Duration,
    body: impl Fn(usize, DeviceGroup<Cpu>) -> T + Send + Sync + Copy + 'static,
) -> Vec<T> {
    within(LIMIT, move || {
        let groups =
            DeviceGroup::<Cpu>::in_process_with_timeout(vec![NdArrayDevice::Cpu; 2], timeout);
        on_each_rank(groups, body)
    })
}

fn ones() -> Tensor<Cpu, 1> {
    tensor::<Cpu>(1.0, &NdArrayDevice::Cpu)
}

#[test]
fn bad_peers_are_refused_before_anything_moves() {
    on_pair(LIMIT, |rank, group| {
        let outside = group.exchange(vec![message(5, ones())], vec![]).err();
        assert!(
            matches!(&outside, Some(Error::GroupSetup(m)) if m.contains("the group has 2 ranks")),
            "{outside:?}"
        );
        let to_self = group.exchange(vec![], vec![expect(rank)]).err();
        assert!(
            matches!(to_self, Some(Error::Mismatch { .. })),
            "{to_self:?}"
        );
        // Nothing moved: the ranks are still in step, and the traffic log holds no refused call.
        assert!(group.take_traffic().messages.is_empty());
        let peer = 1 - rank;
        let got = group
            .exchange(vec![message(peer, ones())], vec![expect(peer)])
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(group.take_traffic().messages, vec![1]);
    });
}

#[test]
fn uneven_all_gathers_are_refused_on_every_rank_and_the_group_stays_usable() {
    on_pair(LIMIT, |rank, group| {
        let values = vec![7; 2 + rank];
        match group.all_gather_values(&values) {
            Err(Error::Mismatch { detail, .. }) => {
                assert!(detail.contains("gave"), "{detail}")
            }
            other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
        }
        let again = group.all_gather_values(&[rank as u64]).unwrap();
        assert_eq!(again, vec![vec![0], vec![1]]);
    });
}

#[test]
fn a_failure_while_messages_move_breaks_the_group_and_later_calls_say_so_at_once() {
    let timeout = Duration::from_millis(300);
    on_pair(timeout, move |rank, group| {
        if rank == 1 {
            // Rank 1 posts a different message kind: rank 0's receive does not match it.
            let wrong = Outgoing {
                kind: MessageKind::QueryGrad,
                ..message(0, ones())
            };
            let _ = group.exchange(vec![wrong], vec![]).unwrap().wait();
            // Still in the group (not gone) while rank 0 waits in vain.
            thread::sleep(3 * timeout);
            return;
        }
        let failed = group.exchange(vec![], vec![expect(1)]).unwrap().wait();
        assert!(failed.is_err(), "a receive nobody sent succeeded");
        let start = Instant::now();
        for later in [
            group.all_gather_values(&[1]).err(),
            group.exchange(vec![], vec![]).err(),
        ] {
            match later {
                Some(Error::Broken { rank: 0, cause }) => {
                    assert!(
                        cause.contains("no Reduction message from rank 1"),
                        "{cause}"
                    )
                }
                other => panic!("expected the group to refuse, got {other:?}"),
            }
        }
        assert!(start.elapsed() < timeout, "a broken group waited for peers");
    });
}

#[test]
fn collectives_in_f32_equal_a_rank_ordered_host_sum_for_one_to_eight_ranks() {
    within(LIMIT, || {
        for world in 1..=8 {
            let groups = DeviceGroup::<Cpu>::in_process(vec![NdArrayDevice::Cpu; world]);
            check_collectives(groups, DType::F32);
        }
    });
}

/// An f32 tensor of `shape` on the CPU, rank `rank`'s values.
fn cpu_tensor(rank: usize, shape: &[usize]) -> burn::tensor::ops::FloatTensor<Cpu> {
    let n = shape.iter().product();
    float_tensor::<Cpu>(&values(rank, 0, n), shape, DType::F32, &NdArrayDevice::Cpu)
}

/// `call`'s error on `rank`, which must be a disagreement with `peer` described as `mine` and
/// `theirs`.
fn assert_disagree<T>(call: Result<T, Error>, rank: usize, peer: usize, mine: &str, theirs: &str) {
    match call {
        Err(Error::RanksDisagree {
            rank: r,
            peer: p,
            mine: m,
            theirs: t,
        }) => assert_eq!((r, p, m.as_str(), t.as_str()), (rank, peer, mine, theirs)),
        Err(other) => panic!("rank {rank}: expected a disagreement, got {other}"),
        Ok(_) => panic!("rank {rank}: a mismatched collective succeeded"),
    }
}

#[test]
fn bad_or_mismatched_collectives_are_refused_on_every_rank_and_the_group_stays_usable() {
    within(LIMIT, || {
        let groups = DeviceGroup::<Cpu>::in_process(vec![NdArrayDevice::Cpu; 3]);
        on_each_rank(groups, |rank, group| {
            // Rows the world size does not divide.
            match group.reduce_scatter(cpu_tensor(rank, &[7, 2])) {
                Err(Error::Shape {
                    tensor,
                    expected,
                    got,
                }) => {
                    assert_eq!(
                        (tensor.as_str(), got.as_str()),
                        ("the reduce_scatter input", "[7, 2]")
                    );
                    assert!(
                        expected.contains("divisible by the group's 3 ranks"),
                        "{expected}"
                    );
                }
                other => panic!("rank {rank}: expected a shape error, got {other:?}"),
            }
            // Rank 2 passes another shape: every rank names the first rank that differs.
            let shape: &[usize] = if rank == 2 { &[4, 3] } else { &[3, 4] };
            let (a, b) = ("all_reduce of F32 [3, 4]", "all_reduce of F32 [4, 3]");
            let outcome = group.all_reduce(cpu_tensor(rank, shape));
            match rank {
                2 => assert_disagree(outcome, 2, 0, b, a),
                _ => assert_disagree(outcome, rank, 2, a, b),
            }
            // Rank 0 passes a tensor with fewer dimensions.
            let shape: &[usize] = if rank == 0 { &[6] } else { &[2, 3] };
            let (one, two) = (
                "all_reduce of F32 with 1 dimensions",
                "all_reduce of F32 with 2 dimensions",
            );
            let outcome = group.all_reduce(cpu_tensor(rank, shape));
            match rank {
                0 => assert_disagree(outcome, 0, 1, one, two),
                _ => assert_disagree(outcome, rank, 0, two, one),
            }
            // Rank 1 passes f64.
            let mut t = cpu_tensor(rank, &[6]);
            if rank == 1 {
                t = Cpu::float_cast(t, FloatDType::F64);
            }
            let outcome = group.all_gather(t);
            let (f32s, f64s) = ("all_gather of F32 [6]", "all_gather of F64 [6]");
            match rank {
                1 => assert_disagree(outcome, 1, 0, f64s, f32s),
                _ => assert_disagree(outcome, rank, 1, f32s, f64s),
            }
            // Rank 0 gathers while the others reduce.
            let outcome = if rank == 0 {
                group.all_gather(cpu_tensor(rank, &[2, 2]))
            } else {
                group.all_reduce(cpu_tensor(rank, &[2, 2]))
            };
            let (gather, reduce) = ("all_gather of F32 [2, 2]", "all_reduce of F32 [2, 2]");
            match rank {
                0 => assert_disagree(outcome, 0, 1, gather, reduce),
                _ => assert_disagree(outcome, rank, 0, reduce, gather),
            }
            // Rank 1 sums one tensor more than the others.
            let mut tensors = vec![cpu_tensor(rank, &[3]), cpu_tensor(rank, &[2, 2])];
            if rank == 1 {
                tensors.push(cpu_tensor(rank, &[1]));
            }
            match group.all_reduce_sum(tensors) {
                Err(Error::RanksDisagree { mine, theirs, .. }) => {
                    let (three, two) = (
                        "3 tensors to sum, 8 elements",
                        "2 tensors to sum, 7 elements",
                    );
                    let (m, t) = if rank == 1 {
                        (three, two)
                    } else {
                        (two, three)
                    };
                    assert!(
                        mine.starts_with(m) && theirs.starts_with(t),
                        "{mine} / {theirs}"
                    );
                }
                other => panic!("rank {rank}: expected a disagreement, got {other:?}"),
            }
            // Nothing moved: the group still sums.
            let sum = host::<Cpu>(group.all_reduce(cpu_tensor(rank, &[4])).unwrap());
            let want: Vec<f32> = (0..4)
                .map(|i| (values(0, 0, 4)[i] + values(1, 0, 4)[i]) + values(2, 0, 4)[i])
                .collect();
            assert_eq!(sum, (DType::F32, vec![4], want));
        });
    });
}

#[test]
fn a_rank_that_skips_a_collective_times_it_out_and_breaks_the_group() {
    let timeout = Duration::from_millis(300);
    on_pair(timeout, move |rank, group| {
        if rank == 1 {
            // Still in the group (not gone) while rank 0 waits in vain.
            thread::sleep(3 * timeout);
            return;
        }
        let started = Instant::now();
        match group.all_reduce(cpu_tensor(0, &[5])) {
            Err(Error::Timeout {
                rank: 0,
                peer: 1,
                waited,
                ..
            }) => assert!(waited >= timeout),
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(started.elapsed() < 3 * timeout, "waited past the timeout");
        let started = Instant::now();
        let later = group.reduce_scatter(cpu_tensor(0, &[2])).err();
        assert!(
            matches!(later, Some(Error::Broken { rank: 0, .. })),
            "{later:?}"
        );
        assert!(
            started.elapsed() < timeout,
            "a broken group waited for peers"
        );
    });
}
