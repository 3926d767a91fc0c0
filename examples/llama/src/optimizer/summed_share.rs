//! [`summed_share`]: this rank's share of the gradients summed over a group, in f32, made bucket
//! by bucket straight from the gradients in their own float types ([`FlatPieces`]) and kept as
//! one tensor per bucket ([`SummedShare`]), so that no f32 vector of the whole model or of the
//! whole share is ever made.
//!
//! Each rank's share is cut into buckets of `k` elements (the same offsets in every share). For
//! a bucket at offsets `a .. a + k`, the ranges `r s + a .. r s + a + k` of every rank `r` (`s`
//! the share's length) are read in f32 and concatenated (`P k` elements, the gradient pieces
//! cast as they are read), and one collective sums them: stage 2 reduce-scatters the bucket (each
//! rank receives its `k` elements of the sum), stage 1 all-reduces it and copies its `k` out (so
//! that the whole bucket's sum is let go). Each bucket's sum is kept as a tensor of its own, read
//! back in any ranges ([`SummedShare::range`]). A gradient piece is let go once the last bucket
//! that reads it is read.
//!
//! The sums are element-wise, so the buckets change no number where a collective's order of
//! addition does not depend on the tensor's size: in-process groups add every element's
//! contributions in rank order whatever the tensor and the collective, so the share is bitwise
//! what one collective over the whole vector gives, at either stage. Over NCCL at two ranks an
//! element's sum is one addition (`a + b = b + a`): bitwise the same too. Over NCCL at more
//! ranks the order of each element's additions depends on the algorithm, the channels and the
//! element's place in the buffer: the sum may differ in its last bits from an unbucketed one (and
//! between stages), by reassociation only.
//!
//! On one device the share is the gradients laid end to end, read bucket by bucket the same way
//! (no collective).

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_distflash::{DeviceGroup, Error as PluginError};

use super::device_shard::owned_f32;
use super::flat::FlatLayout;
use super::flat_pieces::FlatPieces;
use super::state_chunks::ranges;
use super::zero_stage::ZeroStage;
use crate::Error;

/// This rank's share of the gradients summed over a group, in f32, one tensor per bucket (see
/// the module's documentation).
pub struct SummedShare<I: Backend> {
    /// Each bucket's range of the share and its sum (`None` once let go).
    buckets: Vec<(Range<usize>, Option<Tensor<I, 1>>)>,
}

impl<I: Backend> SummedShare<I> {
    /// Elements `range` of the share: a view of one bucket's sum, or the buckets' parts
    /// concatenated when `range` spans several.
    ///
    /// # Panics
    ///
    /// When `range` holds elements [`release_before`](Self::release_before) let go of, or lies
    /// past the share (a caller's bug).
    pub fn range(&self, range: Range<usize>) -> Tensor<I, 1> {
        let mut parts = Vec::new();
        for (bucket, sum) in &self.buckets {
            let (start, end) = (range.start.max(bucket.start), range.end.min(bucket.end));
            if start < end {
                let sum = sum.as_ref().unwrap_or_else(|| {
                    panic!("elements {range:?} of the summed share read after being let go")
                });
                parts.push(sum.clone().narrow(0, start - bucket.start, end - start));
            }
        }
        let covered: usize = parts.iter().map(|p| p.dims()[0]).sum();
        assert_eq!(
            covered,
            range.len(),
            "elements {range:?} of the summed share"
        );
        match parts.len() {
            1 => parts.pop().expect("one part"),
            _ => Tensor::cat(parts, 0),
        }
    }

    /// Lets go of every bucket whose elements all lie before `end`: a pass reading the share in
    /// order up to `end` needs them no more.
    pub fn release_before(&mut self, end: usize) {
        for (bucket, sum) in &mut self.buckets {
            if bucket.end <= end {
                *sum = None;
            }
        }
    }
}

/// This rank's share of the gradients `pieces` (laid out as `layout`) summed over `group`
/// (`None`: one device, whose share is the whole vector), in f32, in buckets of `bucket` elements
/// of each share (see the module's documentation). `stage` picks the collective: stage 2
/// reduce-scatters each bucket, stage 1 all-reduces it.
///
/// # Errors
///
/// [`Error::Comm`] when a collective fails (every rank then fails at the same bucket).
pub fn summed_share<I: Backend>(
    mut pieces: FlatPieces<I>,
    layout: &FlatLayout,
    group: Option<&DeviceGroup<I>>,
    stage: ZeroStage,
    bucket: usize,
) -> Result<SummedShare<I>, Error> {
    let (rank, world) = group.map_or((0, 1), |g| (g.rank(), g.world_size()));
    let n = layout.shard_len();
    let mut buckets = Vec::new();
    for range in ranges(n, bucket) {
        let k = range.len();
        let input = pieces.gather((0..world).map(|r| r * n + range.start..r * n + range.end));
        pieces.release_read(n, range.end);
        let sum = match (group, stage) {
            (None, _) => input,
            (Some(group), ZeroStage::Gradients) => {
                collective(group.reduce_scatter(primitive(input)), "the gradients")?
            }
            (Some(group), _) => {
                let all = collective(group.all_reduce(primitive(input)), "the gradients")?;
                owned_f32(all.narrow(0, rank * k, k))
            }
        };
        buckets.push((range, Some(sum)));
    }
    Ok(SummedShare { buckets })
}

/// A tensor's primitive, for the collectives.
pub(super) fn primitive<I: Backend>(tensor: Tensor<I, 1>) -> FloatTensor<I> {
    tensor.into_primitive().tensor()
}

/// A collective's result as a tensor, or its failure as an [`Error::Comm`] about `what`.
pub(super) fn collective<I: Backend>(
    result: Result<FloatTensor<I>, PluginError>,
    what: &'static str,
) -> Result<Tensor<I, 1>, Error> {
    result
        .map(|t| Tensor::from_primitive(TensorPrimitive::Float(t)))
        .map_err(|source| Error::Comm { what, source })
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};
    use burn::module::Param;
    use burn::nn::{Linear, LinearConfig};

    type Cpu = Autodiff<NdArray<f32>>;
    type Inner = NdArray<f32>;

    /// Two linear layers (3x5 + 5, then 5x2 + 2: 32 elements) whose weights are rank `rank`'s
    /// values of [`value`] (set, not drawn from NdArray's shared generator).
    fn two(rank: usize) -> (Linear<Cpu>, Linear<Cpu>) {
        linears([(3, 5), (5, 2)], |e| value(rank, e))
    }

    /// Two linear layers of `dims` (inputs, outputs) whose flat vector's element `e` (weight,
    /// then bias, of each in turn) is `value(e)`.
    pub(in crate::optimizer) fn linears(
        dims: [(usize, usize); 2],
        value: impl Fn(usize) -> f32,
    ) -> (Linear<Cpu>, Linear<Cpu>) {
        let device = Default::default();
        let mut next = 0;
        let mut linear = |(i, o): (usize, usize)| {
            let mut layer: Linear<Cpu> = LinearConfig::new(i, o).init(&device);
            let mut values = |len: usize| -> Vec<f32> {
                next += len;
                (next - len..next).map(&value).collect()
            };
            let weight = Tensor::<Cpu, 1>::from_floats(values(i * o).as_slice(), &device);
            layer.weight = Param::from_tensor(weight.reshape([i, o]));
            let bias = Tensor::from_floats(values(o).as_slice(), &device);
            layer.bias = Some(Param::from_tensor(bias));
            layer
        };
        (linear(dims[0]), linear(dims[1]))
    }

    /// Element `e` of rank `rank`'s flat vector: values of many magnitudes, so that the order
    /// of the additions shows in the sum's bits.
    fn value(rank: usize, e: usize) -> f32 {
        let x = ((rank * 31 + e * 17) % 23) as f32 - 11.0;
        x * [1.0, 1e-3, 7e4][(rank + e) % 3] + 0.1 * (e as f32 + 1.0).recip()
    }

    /// Each rank's f32 share of the sum over `world` ranks, added in rank order (in f32), the
    /// padding zeros.
    fn expected(world: usize) -> Vec<Vec<u32>> {
        let layout = FlatLayout::of::<Cpu, _>(&two(0), world);
        let n = layout.shard_len();
        let sum = |e: usize| match e < layout.len() {
            true => (1..world).fold(value(0, e), |acc, r| acc + value(r, e)),
            false => 0.0,
        };
        (0..world)
            .map(|r| (r * n..(r + 1) * n).map(|e| sum(e).to_bits()).collect())
            .collect()
    }

    /// Every rank's [`summed_share`] of [`two`]'s weights over an in-process group of `world`.
    fn shares(world: usize, stage: ZeroStage, bucket: usize) -> Vec<Vec<u32>> {
        on_ranks(world, |rank, group| {
            let model = two(rank);
            let layout = FlatLayout::of::<Cpu, _>(&model, world);
            let pieces = FlatPieces::weights::<Cpu, _>(&model);
            let share = summed_share(pieces, &layout, Some(&group), stage, bucket);
            let share = share.unwrap().range(0..layout.shard_len());
            let share = share.into_data().to_vec::<f32>().unwrap();
            share.iter().map(|v| v.to_bits()).collect()
        })
    }

    /// `run(rank, group)` on every rank of an in-process group of `world`, each on a thread of
    /// its own, the ranks' results in rank order.
    pub(in crate::optimizer) fn on_ranks<T: Send>(
        world: usize,
        run: impl Fn(usize, DeviceGroup<Inner>) -> T + Sync,
    ) -> Vec<T> {
        let groups = DeviceGroup::<Inner>::in_process(vec![Default::default(); world]);
        let run = &run;
        std::thread::scope(|scope| {
            let ranks: Vec<_> = (groups.into_iter().enumerate())
                .map(|(rank, group)| scope.spawn(move || run(rank, group)))
                .collect();
            ranks.into_iter().map(|r| r.join().unwrap()).collect()
        })
    }

    #[test]
    fn buckets_of_any_size_sum_every_share_bitwise_in_rank_order_at_both_stages() {
        for world in 1..=3 {
            let want = expected(world);
            for stage in [ZeroStage::OptimizerStates, ZeroStage::Gradients] {
                // Shares of 32, 16 and 11 (one padding element): buckets of one element, sizes
                // that divide no share, and one bucket for the whole share.
                for bucket in [1, 3, 5, 7, 11, 16, 64] {
                    let got = shares(world, stage, bucket);
                    assert!(
                        got == want,
                        "{world} rank(s), stage {stage}, buckets of {bucket}"
                    );
                }
            }
        }
    }

    #[test]
    fn one_device_lays_the_pieces_end_to_end_in_any_buckets() {
        let model = two(0);
        let layout = FlatLayout::of::<Cpu, _>(&model, 1);
        let whole = layout.weights::<Cpu, _>(&model).into_data();
        for bucket in [1, 6, 32, 100] {
            let pieces = FlatPieces::weights::<Cpu, _>(&model);
            let share = summed_share(pieces, &layout, None, ZeroStage::Gradients, bucket);
            let share = share.unwrap();
            assert_eq!(share.range(0..32).into_data(), whole, "buckets of {bucket}");
        }
    }

    #[test]
    fn a_share_reads_back_in_ranges_across_buckets_and_refuses_released_ones() {
        let model = two(0);
        let layout = FlatLayout::of::<Cpu, _>(&model, 1);
        let whole = layout
            .weights::<Cpu, _>(&model)
            .to_data()
            .to_vec::<f32>()
            .unwrap();
        let pieces = FlatPieces::weights::<Cpu, _>(&model);
        let mut share = summed_share(pieces, &layout, None, ZeroStage::Gradients, 5).unwrap();
        for range in [0..5, 3..4, 3..17, 9..32, 31..32] {
            let got = share
                .range(range.clone())
                .into_data()
                .to_vec::<f32>()
                .unwrap();
            assert_eq!(got, whole[range.clone()], "{range:?}");
        }
        share.release_before(12);
        let later = share.range(10..32).into_data().to_vec::<f32>().unwrap();
        assert_eq!(later, whole[10..32], "the bucket 10..15 is kept");
        let early = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| share.range(9..11)));
        assert!(early.is_err(), "a read of a released bucket must fail");
    }
}
