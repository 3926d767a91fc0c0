//! [`summed_share`]: this rank's share of the gradients summed over a group, in f32, made bucket
//! by bucket straight from the gradients in their own float types ([`FlatPieces`]), so that no
//! f32 vector of the whole model is ever made.
//!
//! Each rank's share is cut into buckets of `k` elements (the same offsets in every share). For
//! a bucket at offsets `a .. a + k`, the ranges `r s + a .. r s + a + k` of every rank `r` (`s`
//! the share's length) are read in f32 and concatenated (`P k` elements, the gradient pieces
//! cast as they are read), and one collective sums them: stage 2 reduce-scatters the bucket (each
//! rank receives its `k` elements of the sum), stage 1 all-reduces it and keeps its `k`. The sum
//! is written into the share at `a` (a share of its own, allocated once). A gradient piece is let
//! go once the last bucket that reads it is read.
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
//! On one device the share is the gradients laid end to end, copied bucket by bucket the same
//! way (no collective).

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_distflash::{DeviceGroup, Error as PluginError};

use super::flat::FlatLayout;
use super::flat_pieces::FlatPieces;
use super::state_chunks::ranges;
use super::zero_stage::ZeroStage;
use crate::Error;

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
) -> Result<Tensor<I, 1>, Error> {
    let (rank, world) = group.map_or((0, 1), |g| (g.rank(), g.world_size()));
    let n = layout.shard_len();
    let buckets = ranges(n, bucket);
    let mut share: Option<Tensor<I, 1>> = None;
    for range in buckets {
        let k = range.len();
        let input = pieces.gather((0..world).map(|r| r * n + range.start..r * n + range.end));
        pieces.release_read(n, range.end);
        let (sum, own) = match (group, stage) {
            (None, _) => (input, true),
            (Some(group), ZeroStage::Gradients) => (
                collective(group.reduce_scatter(primitive(input)), "the gradients")?,
                true,
            ),
            (Some(group), _) => {
                let all = collective(group.all_reduce(primitive(input)), "the gradients")?;
                (all.narrow(0, rank * k, k), false)
            }
        };
        share = Some(match share {
            // One bucket whose sum is a tensor of its own: that is the share.
            None if own && k == n => sum,
            None => written(empty_f32(n, &sum.device()), range, sum),
            Some(share) => written(share, range, sum),
        });
    }
    Ok(share.expect("a layout with elements has at least one bucket"))
}

/// `share` with elements `range` replaced by `values` (in place where `share` is not shared).
fn written<I: Backend>(
    share: Tensor<I, 1>,
    range: Range<usize>,
    values: Tensor<I, 1>,
) -> Tensor<I, 1> {
    share.slice_assign([range], values)
}

/// An f32 vector of `len` elements, each written before it is read.
fn empty_f32<I: Backend>(len: usize, device: &I::Device) -> Tensor<I, 1> {
    Tensor::empty([len], (device, DType::F32))
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
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};
    use burn::module::Param;
    use burn::nn::{Linear, LinearConfig};

    type Cpu = Autodiff<NdArray<f32>>;
    type Inner = NdArray<f32>;

    /// Two linear layers (3x5 + 5, then 5x2 + 2: 32 elements) whose weights are rank `rank`'s
    /// values of [`value`] (set, not drawn from NdArray's shared generator).
    fn two(rank: usize) -> (Linear<Cpu>, Linear<Cpu>) {
        let device = Default::default();
        let mut next = 0;
        let mut linear = |i, o| {
            let mut layer: Linear<Cpu> = LinearConfig::new(i, o).init(&device);
            let mut values = |len: usize| -> Vec<f32> {
                next += len;
                (next - len..next).map(|e| value(rank, e)).collect()
            };
            let weight = Tensor::<Cpu, 1>::from_floats(values(i * o).as_slice(), &device);
            layer.weight = Param::from_tensor(weight.reshape([i, o]));
            let bias = Tensor::from_floats(values(o).as_slice(), &device);
            layer.bias = Some(Param::from_tensor(bias));
            layer
        };
        (linear(3, 5), linear(5, 2))
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
        let groups = DeviceGroup::<Inner>::in_process(vec![Default::default(); world]);
        std::thread::scope(|scope| {
            let ranks: Vec<_> = (groups.into_iter().enumerate())
                .map(|(rank, group)| {
                    scope.spawn(move || {
                        let model = two(rank);
                        let layout = FlatLayout::of::<Cpu, _>(&model, world);
                        let pieces = FlatPieces::weights::<Cpu, _>(&model);
                        let share = summed_share(pieces, &layout, Some(&group), stage, bucket);
                        let share = share.unwrap().into_data().to_vec::<f32>().unwrap();
                        share.iter().map(|v| v.to_bits()).collect()
                    })
                })
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
            assert_eq!(share.unwrap().into_data(), whole, "buckets of {bucket}");
        }
    }
}
