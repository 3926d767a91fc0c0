//! Sequence-parallel attention run on an in-process group, one thread per rank, checked against
//! the f64 reference on the whole sequence (forward and every gradient).
#![allow(dead_code)]

use std::time::Duration;

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;
use burn_distflash::collective::on_each_rank;
use burn_distflash::schedule::{Layout, Schedule, ScheduleKind};
use burn_distflash::sequence_parallel::{sequence_parallel_attention, SequenceParallelOptions};
use burn_distflash::{
    DeviceGroup, Documents, Error, FlashAttentionBackend, FlashAttentionOptions, Mask,
    SlidingWindow,
};
use distflash_kernels::{AttentionDims, ElemType};

use super::burn_case::{expected, to_host, to_tensor, Expected};
use super::{assert_close, Rng};

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
    pub window: Option<SlidingWindow>,
    /// Document lengths per batch row (one list: shared by every row), each list repeated
    /// until the sequence is covered (the last document cut at its end); see
    /// [`documents_of`].
    pub documents: Option<&'static [&'static [usize]]>,
    pub schedule: ScheduleKind,
    pub overlap: bool,
    /// Row parts in which the backward streams another rank's key/value shard.
    pub backward_parts: usize,
}

impl Case {
    /// Causal, GQA 4/2, head dim 16, no window or documents, overlap on.
    pub fn new(world: usize, shard: usize, schedule: ScheduleKind) -> Self {
        Self {
            world,
            shard,
            batch: 1,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 16,
            causal: true,
            window: None,
            documents: None,
            schedule,
            overlap: true,
            backward_parts: 1,
        }
    }

    /// The same case with the backward streaming remote key/value shards in `parts` row parts.
    pub fn in_parts(self, parts: usize) -> Self {
        Self {
            backward_parts: parts,
            ..self
        }
    }

    /// Where the ranks' shards come from (the options' layout).
    pub fn layout(&self) -> Layout {
        self.options().layout(self.world, self.shard)
    }

    /// The options every rank passes (the documents of the whole sequence).
    pub fn options(&self) -> SequenceParallelOptions {
        SequenceParallelOptions {
            attention: FlashAttentionOptions::masked(Mask {
                causal: self.causal,
                window: self.window,
                documents: (self.documents)
                    .map(|lengths| documents_of(lengths, self.world * self.shard)),
                ..Mask::none()
            }),
            schedule: self.schedule,
            overlap: self.overlap,
            backward_parts: self.backward_parts,
        }
    }

    /// The schedule every rank derives.
    pub fn schedule(&self) -> Schedule {
        (self.options().schedule_for(self.world, self.shard)).expect("a valid case")
    }
}

/// Documents over `len` positions: per batch row, its document lengths repeated until `len`
/// is covered, the last document cut at `len`.
pub fn documents_of(lengths: &[&[usize]], len: usize) -> Documents {
    let rows: Vec<Vec<usize>> = (lengths.iter())
        .map(|row| {
            let mut cu = vec![0];
            for &l in row.iter().cycle() {
                let end = (cu[cu.len() - 1] + l).min(len);
                cu.push(end);
                if end == len {
                    break;
                }
            }
            cu
        })
        .collect();
    Documents::per_batch_row(&rows).expect("document lengths are positive")
}

/// Rank `rank`'s rows of a host tensor `[B, H, world*shard, D]` under `layout` (written out
/// position by position from the pure layout, independently of the library's tensor helpers).
pub fn shard_of(
    full: &[f64],
    [b, h, s, d]: [usize; 4],
    rank: usize,
    shard: usize,
    layout: Layout,
) -> Vec<f64> {
    let positions = layout.positions(s / shard, rank, shard).expect("layout");
    let mut out = Vec::with_capacity(b * h * shard * d);
    for bh in 0..b * h {
        for &pos in &positions {
            let start = (bh * s + pos) * d;
            out.extend_from_slice(&full[start..start + d]);
        }
    }
    out
}

/// The inverse of [`shard_of`]: the whole tensor from every rank's rows.
pub fn unshard(
    shards: &[Vec<f64>],
    [b, h, s, d]: [usize; 4],
    shard: usize,
    layout: Layout,
) -> Vec<f64> {
    let mut full = vec![f64::NAN; b * h * s * d];
    for (rank, part) in shards.iter().enumerate() {
        let positions = layout.positions(shards.len(), rank, shard).expect("layout");
        for bh in 0..b * h {
            for (row, &pos) in positions.iter().enumerate() {
                let (dst, src) = ((bh * s + pos) * d, (bh * shard + row) * d);
                full[dst..dst + d].copy_from_slice(&part[src..src + d]);
            }
        }
    }
    full
}

/// What one rank returns from a training call: its output rows, its shards' gradients, and the
/// messages it sent per exchange.
pub struct RankResult {
    pub out: Vec<f64>,
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
    pub forward_messages: Vec<usize>,
    pub backward_messages: Vec<usize>,
}

/// Messages one rank sends per exchange, in posting order, as the schedule predicts: inputs of
/// each stage (kv and query chunks) and results after it. The forward has one stage per step;
/// the backward `parts` per step, the key/value chunks and their gradients travelling in each,
/// query bundles and their gradients only in a step's first.
pub fn expected_messages(
    schedule: &Schedule,
    rank: usize,
    overlap: bool,
    backward: bool,
    parts: usize,
) -> Vec<usize> {
    let parts = if backward { parts } else { 1 };
    let stages = schedule.num_steps() * parts;
    let plan = |t: usize| schedule.rank_step(rank, t / parts);
    let first = |t: usize| t.is_multiple_of(parts) as usize;
    let inputs = |t: usize| plan(t).kv_to.len() + first(t) * plan(t).query_to.len();
    let results = |t: usize| {
        let p = plan(t);
        first(t) * p.query_result_to().is_some() as usize
            + (backward && p.kv_result_to().is_some()) as usize
    };
    let mut log = vec![inputs(0)];
    for t in 0..stages {
        if overlap {
            if t + 1 < stages {
                log.push(inputs(t + 1));
            }
            log.push(results(t));
        } else {
            log.push(results(t));
            if t + 1 < stages {
                log.push(inputs(t + 1));
            }
        }
    }
    log
}

/// One rank's shards of a case's host data.
#[derive(Debug, Clone)]
pub struct RankInputs {
    pub q: Vec<f64>,
    pub k: Vec<f64>,
    pub v: Vec<f64>,
    pub dout: Vec<f64>,
    /// Shape of the q and dO shards.
    pub q_shape: [usize; 4],
    /// Shape of the k and v shards.
    pub kv_shape: [usize; 4],
}

impl RankInputs {
    /// q, k, v as fresh tensors of `B` on `device`.
    pub fn tensors<B: Backend>(&self, device: &B::Device) -> [Tensor<B, 4>; 3] {
        [
            to_tensor::<B>(&self.q, self.q_shape, device),
            to_tensor::<B>(&self.k, self.kv_shape, device),
            to_tensor::<B>(&self.v, self.kv_shape, device),
        ]
    }
}

/// A case's deterministic host data over the whole sequence, and its f64 reference.
pub struct CaseData {
    pub case: Case,
    pub elem: ElemType,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    dout: Vec<f64>,
}

impl CaseData {
    /// Random q, k, v and dO for `case` (seeded by its world size and shard length), rounded to
    /// `elem`.
    pub fn new(case: Case, elem: ElemType) -> Self {
        let (q_shape, kv_shape) = case.full_shapes();
        let n = |s: [usize; 4]| s.iter().product::<usize>();
        let mut rng = Rng::new((case.world * 1000 + case.shard) as u64);
        Self {
            case,
            elem,
            q: rng.tensor(n(q_shape), 2.0, elem),
            k: rng.tensor(n(kv_shape), 2.0, elem),
            v: rng.tensor(n(kv_shape), 1.0, elem),
            dout: rng.tensor(n(q_shape), 1.0, elem),
        }
    }

    /// What rank `rank` holds.
    pub fn rank_inputs(&self, rank: usize) -> RankInputs {
        let Case {
            batch,
            q_heads,
            kv_heads,
            head_dim,
            shard,
            ..
        } = self.case;
        let (q_shape, kv_shape) = self.case.full_shapes();
        let layout = self.case.layout();
        let part = |full: &[f64], shape: [usize; 4]| shard_of(full, shape, rank, shard, layout);
        RankInputs {
            q: part(&self.q, q_shape),
            k: part(&self.k, kv_shape),
            v: part(&self.v, kv_shape),
            dout: part(&self.dout, q_shape),
            q_shape: [batch, q_heads, shard, head_dim],
            kv_shape: [batch, kv_heads, shard, head_dim],
        }
    }

    /// The f64 reference over the whole sequence and the naive low-precision computation.
    pub fn expected(&self) -> Expected {
        let c = self.case;
        let seq = c.world * c.shard;
        let dims = AttentionDims {
            batch: c.batch,
            q_heads: c.q_heads,
            kv_heads: c.kv_heads,
            q_len: seq,
            kv_len: seq,
            head_dim: c.head_dim,
        };
        let mask = c.options().attention.mask;
        let scale = 1.0 / (c.head_dim as f64).sqrt();
        let data = (&self.q[..], &self.k[..], &self.v[..], &self.dout[..]);
        expected(&dims, data, &mask, scale, self.elem)
    }

    /// Asserts that every rank's output rows, put together, are attention over the whole
    /// sequence.
    pub fn assert_output(&self, what: &str, expected: &Expected, outs: &[Vec<f64>]) {
        let (q_shape, _) = self.case.full_shapes();
        assert_close(
            &format!("{what}: O"),
            &unshard(outs, q_shape, self.case.shard, self.case.layout()),
            &expected.fwd.out,
            &expected.naive_fwd.out,
            self.elem,
        );
    }

    /// Asserts the output and every gradient of the ranks' training calls.
    pub fn assert_training(&self, what: &str, expected: &Expected, results: &[RankResult]) {
        let (q_shape, kv_shape) = self.case.full_shapes();
        let gather = |pick: fn(&RankResult) -> &Vec<f64>, shape| {
            let parts: Vec<Vec<f64>> = results.iter().map(|r| pick(r).clone()).collect();
            unshard(&parts, shape, self.case.shard, self.case.layout())
        };
        let outs: Vec<Vec<f64>> = results.iter().map(|r| r.out.clone()).collect();
        self.assert_output(what, expected, &outs);
        let (grads, naive) = (&expected.grads, &expected.naive_grads);
        for (name, got, exact, naive) in [
            ("dq", gather(|r| &r.dq, q_shape), &grads.dq, &naive.dq),
            ("dk", gather(|r| &r.dk, kv_shape), &grads.dk, &naive.dk),
            ("dv", gather(|r| &r.dv, kv_shape), &grads.dv, &naive.dv),
        ] {
            assert_close(&format!("{what}: {name}"), &got, exact, naive, self.elem);
        }
    }
}

impl Case {
    /// Shapes of the whole-sequence q (and dO) and k (and v).
    pub fn full_shapes(&self) -> ([usize; 4], [usize; 4]) {
        let seq = self.world * self.shard;
        (
            [self.batch, self.q_heads, seq, self.head_dim],
            [self.batch, self.kv_heads, seq, self.head_dim],
        )
    }
}

/// One training call on one rank: forward through `Autodiff`, backward of `sum(O * dO)`, the
/// output, the gradients and the messages sent.
pub fn train_on_rank<B>(
    inputs: &RankInputs,
    group: &DeviceGroup<B::Inner>,
    device: &B::Device,
    options: &SequenceParallelOptions,
) -> RankResult
where
    B: AutodiffBackend + FlashAttentionBackend,
{
    let rank = group.rank();
    let [q, k, v] = inputs.tensors::<B>(device).map(Tensor::require_grad);
    group.take_traffic();
    let out = sequence_parallel_attention(q.clone(), k.clone(), v.clone(), group, options)
        .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    let forward_messages = group.take_traffic().messages;
    let grads = (out.clone() * to_tensor::<B>(&inputs.dout, inputs.q_shape, device))
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
}

/// One forward-only call on one rank (no autodiff): the output rows and the messages sent.
pub fn forward_on_rank<B: FlashAttentionBackend>(
    inputs: &RankInputs,
    group: &DeviceGroup<B::Inner>,
    device: &B::Device,
    options: &SequenceParallelOptions,
) -> (Vec<f64>, Vec<usize>) {
    let rank = group.rank();
    let [q, k, v] = inputs.tensors::<B>(device);
    group.take_traffic();
    let out = sequence_parallel_attention(q, k, v, group, options)
        .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    let messages = group.take_traffic().messages;
    (to_host(out), messages)
}

/// Runs one case on an in-process group over `devices` (rank `r` on `devices[r]`).
pub fn check<B>(devices: Vec<B::Device>, case: Case, elem: ElemType)
where
    B: AutodiffBackend + FlashAttentionBackend,
{
    check_groups::<B>(
        devices.clone(),
        in_process_groups::<B>(&devices),
        case,
        elem,
    )
}

/// An in-process group over `devices` (rank `r` on `devices[r]`) that gives up on a silent peer
/// after two minutes.
pub fn in_process_groups<B: FlashAttentionBackend>(
    devices: &[B::Device],
) -> Vec<DeviceGroup<B::Inner>> {
    DeviceGroup::<B::Inner>::in_process_with_timeout(
        devices.iter().map(|d| B::inner_device(d)).collect(),
        Duration::from_secs(120),
    )
}

/// Runs one training call with rank `r` on `devices[r]` in `groups[r]` (one thread per rank)
/// and checks it: output, gradients, messages per exchange.
pub fn check_groups<B>(
    devices: Vec<B::Device>,
    groups: Vec<DeviceGroup<B::Inner>>,
    case: Case,
    elem: ElemType,
) where
    B: AutodiffBackend + FlashAttentionBackend,
{
    let data = CaseData::new(case, elem);
    let options = case.options();
    let inputs = with_devices(&data, devices);
    let per_rank = inputs.into_iter().zip(groups).collect();
    let results = on_each_rank(per_rank, |_, ((inputs, device), group)| {
        train_on_rank::<B>(&inputs, &group, &device, &options)
    });
    assert_messages(&case, &results);
    let what = format!("{} {case:?}", std::any::type_name::<B>());
    data.assert_training(&what, &data.expected(), &results);
}

/// Each rank's shards of `data` with its device.
pub fn with_devices<D>(data: &CaseData, devices: Vec<D>) -> Vec<(RankInputs, D)> {
    (devices.into_iter().enumerate())
        .map(|(rank, device)| (data.rank_inputs(rank), device))
        .collect()
}

/// Asserts that every rank sent, per exchange, the messages its schedule predicts.
pub fn assert_messages(case: &Case, results: &[RankResult]) {
    let schedule = case.schedule();
    for (rank, r) in results.iter().enumerate() {
        assert_eq!(
            r.forward_messages,
            expected_messages(&schedule, rank, case.overlap, false, case.backward_parts),
            "{case:?}: rank {rank} forward messages per exchange"
        );
        assert_eq!(
            r.backward_messages,
            expected_messages(&schedule, rank, case.overlap, true, case.backward_parts),
            "{case:?}: rank {rank} backward messages per exchange"
        );
    }
}

/// The text (`mine / theirs`) of the `RanksDisagree` error every rank gets; panics on any other
/// result.
pub fn disagreements(results: Vec<Result<(), Error>>) -> Vec<String> {
    (results.into_iter())
        .map(|result| match result {
            Err(Error::RanksDisagree { mine, theirs, .. }) => format!("{mine} / {theirs}"),
            other => panic!("expected the ranks to disagree, got {other:?}"),
        })
        .collect()
}
