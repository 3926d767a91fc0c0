//! The in-process transport's contract: a received tensor is the receiver's own memory (the
//! sender may drop and reuse its memory at once, on wgpu where streams have their own pools);
//! bad peers and uneven all-gathers are refused with the group still usable; a failure while
//! messages move breaks the group, and later calls say so at once.

mod common;

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use burn::backend::ndarray::NdArrayDevice;
use burn::backend::NdArray;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use burn_distflash::collective::on_each_rank;
use burn_distflash::collective::{Incoming, MessageKind, Outgoing, TensorLayout};
use burn_distflash::{DeviceGroup, Error};
use common::within::within;

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
        let device = cubecl::wgpu::WgpuDevice::Cpu;
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
