//! Collectives of a group against a host reference: every rank's result must equal the sum over
//! the ranks in rank order, computed in f32 and rounded once to the tensors' float type (the
//! in-process transport's order; NCCL's on two ranks, where any order gives the same sum).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, TensorData};
use burn_distflash::collective::on_each_rank;
use burn_distflash::DeviceGroup;
use half::{bf16, f16};

/// Rank `rank`'s values of tensor `salt` (`n` of them): fractions whose sums round in f32, f16
/// and bf16, different per rank and tensor.
pub fn values(rank: usize, salt: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((rank * 7919 + salt * 1031 + i * 31) % 2003) as f32 / 97.0 - 10.0)
        .collect()
}

/// `values` rounded to `dtype` (F32, F16 or BF16).
pub fn rounded(values: &[f32], dtype: DType) -> Vec<f32> {
    values
        .iter()
        .map(|&v| match dtype {
            DType::F16 => f16::from_f32(v).to_f32(),
            DType::BF16 => bf16::from_f32(v).to_f32(),
            _ => v,
        })
        .collect()
}

/// A tensor of `shape` holding `values` in `dtype` (F32, F16 or BF16).
pub fn float_tensor<B: Backend>(
    values: &[f32],
    shape: &[usize],
    dtype: DType,
    device: &B::Device,
) -> FloatTensor<B> {
    let shape = shape.to_vec();
    let data = match dtype {
        DType::F16 => TensorData::new(values.iter().map(|&v| f16::from_f32(v)).collect(), shape),
        DType::BF16 => TensorData::new(values.iter().map(|&v| bf16::from_f32(v)).collect(), shape),
        _ => TensorData::new(values.to_vec(), shape),
    };
    B::float_from_data(data, device)
}

/// A tensor on the host: float type, shape, values.
pub type HostTensor = (DType, Vec<usize>, Vec<f32>);

/// Reads a tensor back.
pub fn host<B: Backend>(tensor: FloatTensor<B>) -> HostTensor {
    let data = cubecl::future::block_on(B::float_into_data(tensor)).expect("read back");
    let values = data.iter::<f32>().collect();
    (data.dtype, data.shape.to_vec(), values)
}

/// The sum over `world` ranks of tensor `salt` (`n` values), in rank order in f32, rounded once.
pub fn reference_sum(world: usize, salt: usize, n: usize, dtype: DType) -> Vec<f32> {
    let mut sum = vec![0.0f32; n];
    for rank in 0..world {
        let mine = rounded(&values(rank, salt, n), dtype);
        for (s, v) in sum.iter_mut().zip(mine) {
            *s = if rank == 0 { v } else { *s + v };
        }
    }
    rounded(&sum, dtype)
}

/// Shapes of the tensors [`check_collectives`] sums in buckets: odd sizes, one of one element.
const BUCKETED: [&[usize]; 4] = [&[2, 3], &[7], &[1], &[4, 5]];

/// Runs every collective on every rank of `groups` in `dtype` (odd lengths, an all-reduce of
/// fewer elements than ranks when there are more than five, a bucketed sum of several tensors
/// in buckets of 64 bytes) and checks each rank's result against the host reference, value for
/// value.
pub fn check_collectives<B: Backend>(groups: Vec<DeviceGroup<B>>, dtype: DType) {
    let world = groups.len();
    let results = on_each_rank(groups, |rank, group| {
        let device = group.device().clone();
        let make = |salt: usize, shape: &[usize]| {
            let n = shape.iter().product();
            float_tensor::<B>(&values(rank, salt, n), shape, dtype, &device)
        };
        let summed = group.all_reduce(make(1, &[3, 7])).expect("all_reduce");
        let short = group.all_reduce(make(2, &[5])).expect("short all_reduce");
        let scattered = (group.reduce_scatter(make(3, &[3 * world, 5]))).expect("reduce_scatter");
        let gathered = group.all_gather(make(4, &[3, 5])).expect("all_gather");
        let bucketed: Vec<_> = (BUCKETED.iter().enumerate())
            .map(|(i, shape)| make(10 + i, shape))
            .collect();
        let bucketed = group
            .all_reduce_sum_in_buckets(bucketed, 64)
            .expect("all_reduce_sum_in_buckets");
        let outputs = [summed, short, scattered, gathered].into_iter();
        outputs.chain(bucketed).map(host::<B>).collect::<Vec<_>>()
    });
    for (rank, got) in results.into_iter().enumerate() {
        let all = reference_sum(world, 3, 3 * world * 5, dtype);
        let mut want: Vec<HostTensor> = vec![
            (dtype, vec![3, 7], reference_sum(world, 1, 21, dtype)),
            (dtype, vec![5], reference_sum(world, 2, 5, dtype)),
            (dtype, vec![3, 5], all[rank * 15..(rank + 1) * 15].to_vec()),
            (
                dtype,
                vec![3 * world, 5],
                (0..world)
                    .flat_map(|r| rounded(&values(r, 4, 15), dtype))
                    .collect(),
            ),
        ];
        want.extend(BUCKETED.iter().enumerate().map(|(i, shape)| {
            let n = shape.iter().product();
            (
                dtype,
                shape.to_vec(),
                reference_sum(world, 10 + i, n, dtype),
            )
        }));
        let names = [
            "all_reduce",
            "short all_reduce",
            "reduce_scatter",
            "all_gather",
        ];
        for (i, (got, want)) in got.iter().zip(&want).enumerate() {
            let name = names.get(i).copied().unwrap_or("bucketed sum");
            assert_eq!(
                got, want,
                "{dtype:?}, {world} ranks, rank {rank}: {name} #{i}"
            );
        }
    }
}
