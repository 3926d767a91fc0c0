//! Sequence-parallel attention run on an in-process group, one thread per rank, checked against
//! the f64 reference on the whole sequence (forward and every gradient).
#![allow(dead_code)]

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use burn_distflash::schedule::{Schedule, ScheduleKind};
use burn_distflash::{
    sequence_parallel_attention, DeviceGroup, FlashAttentionOptions, SequenceParallelBackend,
    SequenceParallelOptions,
};
use distflash_kernels::{AttentionDims, ElemType, Mask};

use super::burn_case::{expected, to_host, to_tensor, Expected};
use super::{assert_close, Rng};

/// Runs `f` on another thread and fails the test if it does not finish within `limit`.
pub fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(value)) => value,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("the test did not finish within {limit:?} (a hang)"),
    }
}

/// One sharded case: `world` ranks of `shard` tokens each.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub world: usize,
    pub shard: usize,
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub causal: bool,
    pub schedule: ScheduleKind,
    pub overlap: bool,
}

impl Case {
    /// Causal, GQA 4/2, head dim 16, overlap on.
    pub fn new(world: usize, shard: usize, schedule: ScheduleKind) -> Self {
        Self {
            world,
            shard,
            batch: 1,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 16,
            causal: true,
            schedule,
            overlap: true,
        }
    }

    fn options(&self) -> SequenceParallelOptions {
        SequenceParallelOptions {
            attention: FlashAttentionOptions {
                causal: self.causal,
                scale: None,
            },
            schedule: self.schedule,
            overlap: self.overlap,
        }
    }
}

/// Rows `r*shard .. (r+1)*shard` of a host tensor `[B, H, world*shard, D]`.
pub fn shard_of(full: &[f64], [b, h, s, d]: [usize; 4], rank: usize, shard: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(b * h * shard * d);
    for bh in 0..b * h {
        let start = (bh * s + rank * shard) * d;
        out.extend_from_slice(&full[start..start + shard * d]);
    }
    out
}

/// The inverse of [`shard_of`]: the whole tensor from every rank's rows.
pub fn unshard(shards: &[Vec<f64>], [b, h, s, d]: [usize; 4], shard: usize) -> Vec<f64> {
    let mut full = vec![f64::NAN; b * h * s * d];
    for (rank, part) in shards.iter().enumerate() {
        for bh in 0..b * h {
            let dst = (bh * s + rank * shard) * d;
            let src = bh * shard * d;
            full[dst..dst + shard * d].copy_from_slice(&part[src..src + shard * d]);
        }
    }
    full
}

/// What one rank returns: its output rows, its shards' gradients, and the messages it sent
/// per exchange.
pub struct RankResult {
    pub out: Vec<f64>,
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
    pub forward_messages: Vec<usize>,
    pub backward_messages: Vec<usize>,
}

/// Messages one rank sends per exchange, in posting order, as the schedule predicts:
/// inputs of each step (kv and query chunks) and results after it.
pub fn expected_messages(
    schedule: &Schedule,
    rank: usize,
    overlap: bool,
    backward: bool,
) -> Vec<usize> {
    let steps = schedule.num_steps();
    let plan = |s: usize| schedule.rank_step(rank, s);
    let inputs = |s: usize| plan(s).kv_to.len() + plan(s).query_to.len();
    let results = |s: usize| {
        let p = plan(s);
        p.query_result_to().is_some() as usize + (backward && p.kv_result_to().is_some()) as usize
    };
    let mut log = vec![inputs(0)];
    for s in 0..steps {
        if overlap {
            if s + 1 < steps {
                log.push(inputs(s + 1));
            }
            log.push(results(s));
        } else {
            log.push(results(s));
            if s + 1 < steps {
                log.push(inputs(s + 1));
            }
        }
    }
    log
}

/// Runs one case on an in-process group over `devices` (rank `r` on `devices[r]`).
pub fn check<B>(devices: Vec<B::Device>, case: Case, elem: ElemType)
where
    B: AutodiffBackend + SequenceParallelBackend,
{
    let groups = DeviceGroup::<<B as SequenceParallelBackend>::Inner>::in_process_with_timeout(
        devices.iter().map(|d| B::inner_device(d)).collect(),
        Duration::from_secs(120),
    );
    check_groups::<B>(devices, groups, case, elem)
}

/// Runs one case with rank `r` on `devices[r]` in `groups[r]` (one thread per rank) and
/// checks it.
pub fn check_groups<B>(
    devices: Vec<B::Device>,
    groups: Vec<DeviceGroup<<B as SequenceParallelBackend>::Inner>>,
    case: Case,
    elem: ElemType,
) where
    B: AutodiffBackend + SequenceParallelBackend,
{
    let Case {
        world,
        shard,
        batch,
        q_heads,
        kv_heads,
        head_dim,
        causal,
        ..
    } = case;
    let seq = world * shard;
    let dims = AttentionDims {
        batch,
        q_heads,
        kv_heads,
        q_len: seq,
        kv_len: seq,
        head_dim,
    };
    let (q_shape, kv_shape) = (
        [batch, q_heads, seq, head_dim],
        [batch, kv_heads, seq, head_dim],
    );
    let n = |s: [usize; 4]| s.iter().product::<usize>();
    let mut rng = Rng::new((world * 1000 + shard) as u64);
    let (hq, hk, hv, hdo) = (
        rng.tensor(n(q_shape), 2.0, elem),
        rng.tensor(n(kv_shape), 2.0, elem),
        rng.tensor(n(kv_shape), 1.0, elem),
        rng.tensor(n(q_shape), 1.0, elem),
    );
    let handles: Vec<_> = groups
        .into_iter()
        .zip(devices)
        .enumerate()
        .map(|(rank, (group, device))| {
            let part = |full: &[f64], shape: [usize; 4]| shard_of(full, shape, rank, shard);
            let (q, k, v, dout) = (
                part(&hq, q_shape),
                part(&hk, kv_shape),
                part(&hv, kv_shape),
                part(&hdo, q_shape),
            );
            let options = case.options();
            thread::spawn(move || {
                let sq = [batch, q_heads, shard, head_dim];
                let skv = [batch, kv_heads, shard, head_dim];
                let q = to_tensor::<B>(&q, sq, &device).require_grad();
                let k = to_tensor::<B>(&k, skv, &device).require_grad();
                let v = to_tensor::<B>(&v, skv, &device).require_grad();
                let out =
                    sequence_parallel_attention(q.clone(), k.clone(), v.clone(), &group, &options)
                        .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                let forward_messages = group.take_traffic().messages;
                let grads = (out.clone() * to_tensor::<B>(&dout, sq, &device))
                    .sum()
                    .backward();
                let backward_messages = group.take_traffic().messages;
                let grad = |t: &Tensor<B, 4>| to_host(t.grad(&grads).expect("gradient"));
                RankResult {
                    out: to_host(out),
                    dq: grad(&q),
                    dk: grad(&k),
                    dv: grad(&v),
                    forward_messages,
                    backward_messages,
                }
            })
        })
        .collect();
    let results: Vec<RankResult> = handles
        .into_iter()
        .map(|h| h.join().expect("a rank panicked"))
        .collect();

    let schedule = case.options().schedule_for(world);
    for (rank, r) in results.iter().enumerate() {
        assert_eq!(
            r.forward_messages,
            expected_messages(&schedule, rank, case.overlap, false),
            "{case:?}: rank {rank} forward messages per exchange"
        );
        assert_eq!(
            r.backward_messages,
            expected_messages(&schedule, rank, case.overlap, true),
            "{case:?}: rank {rank} backward messages per exchange"
        );
    }
    let mask = if causal { Mask::causal() } else { Mask::None };
    let scale = 1.0 / (head_dim as f64).sqrt();
    let Expected {
        fwd,
        naive_fwd,
        grads,
        naive_grads,
    } = expected(&dims, (&hq, &hk, &hv, &hdo), &mask, scale, elem);
    let gather = |pick: fn(&RankResult) -> &Vec<f64>, shape| {
        let parts: Vec<Vec<f64>> = results.iter().map(|r| pick(r).clone()).collect();
        unshard(&parts, shape, shard)
    };
    let what = format!("{} {case:?}", std::any::type_name::<B>());
    assert_close(
        &format!("{what}: O"),
        &gather(|r| &r.out, q_shape),
        &fwd.out,
        &naive_fwd.out,
        elem,
    );
    assert_close(
        &format!("{what}: dq"),
        &gather(|r| &r.dq, q_shape),
        &grads.dq,
        &naive_grads.dq,
        elem,
    );
    assert_close(
        &format!("{what}: dk"),
        &gather(|r| &r.dk, kv_shape),
        &grads.dk,
        &naive_grads.dk,
        elem,
    );
    assert_close(
        &format!("{what}: dv"),
        &gather(|r| &r.dv, kv_shape),
        &grads.dv,
        &naive_grads.dv,
        elem,
    );
}
