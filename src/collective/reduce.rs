//! Summing many tensors over a group (replicated weights' gradients) in a few collectives: small
//! tensors of one float type travel together in flat buckets.

use crate::Error;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Slice};

use super::{DeviceGroup, TensorLayout};

/// The most bytes [`DeviceGroup::all_reduce_sum`] packs into one bucket (one all-reduce).
pub const BUCKET_BYTES: usize = 64 << 20;

impl<B: Backend> DeviceGroup<B> {
    /// [`all_reduce_sum_in_buckets`](Self::all_reduce_sum_in_buckets) with buckets of at most
    /// [`BUCKET_BYTES`].
    ///
    /// # Errors
    ///
    /// As [`all_reduce_sum_in_buckets`](Self::all_reduce_sum_in_buckets).
    pub fn all_reduce_sum(
        &self,
        tensors: Vec<FloatTensor<B>>,
    ) -> Result<Vec<FloatTensor<B>>, Error> {
        self.all_reduce_sum_in_buckets(tensors, BUCKET_BYTES)
    }

    /// The element-wise sum over all ranks of each of `tensors` (every rank passes tensors of the
    /// same shapes and float types, in the same order), in a few collectives: tensors of one
    /// float type are packed, in order, into flat buckets of at most `bucket_bytes` (a larger
    /// tensor is a bucket of its own, not copied), each bucket is one
    /// [`all_reduce`](Self::all_reduce), and its sum is cut back into the tensors. Sums are
    /// element-wise, so bucketing changes no bit: in-process every rank gets bitwise the same
    /// sums, added in rank order, and replicated weights stay identical after an optimizer
    /// step. The ranks first compare the count, sizes and a fingerprint of their tensors' layouts
    /// (one small all-gather).
    ///
    /// # Shapes
    ///
    /// - tensors: any shapes, the same on every rank
    /// - output: the sums, of the same shapes, in the same order (tensors without elements come
    ///   back as they are)
    ///
    /// # Errors
    ///
    /// - [`Error::RanksDisagree`] when the ranks' lists differ (count, sizes, shapes or float
    ///   types), on every rank, before any tensor moves.
    /// - Those of [`all_reduce`](Self::all_reduce) (see [`all_gather`](Self::all_gather)),
    ///   notably [`Error::DType`] for a float type the collectives do not take and
    ///   [`Error::Timeout`] when a peer does not take part. A group of one rank returns
    ///   `tensors` as they are and never errs.
    pub fn all_reduce_sum_in_buckets(
        &self,
        tensors: Vec<FloatTensor<B>>,
        bucket_bytes: usize,
    ) -> Result<Vec<FloatTensor<B>>, Error> {
        if self.world_size() == 1 {
            return Ok(tensors);
        }
        let layouts: Vec<TensorLayout> = tensors.iter().map(TensorLayout::of::<B>).collect();
        self.check_same_tensors(&layouts)?;
        let mut inputs: Vec<Option<FloatTensor<B>>> = tensors.into_iter().map(Some).collect();
        let mut take = |i: usize| inputs[i].take().expect("each tensor is in one bucket");
        let mut sums: Vec<Option<FloatTensor<B>>> = (0..layouts.len()).map(|_| None).collect();
        for bucket in buckets(&layouts, bucket_bytes) {
            if let [i] = bucket[..] {
                sums[i] = Some(if elements(&layouts[i]) == 0 {
                    take(i)
                } else {
                    self.all_reduce(take(i))?
                });
                continue;
            }
            let flat = bucket
                .iter()
                .map(|&i| B::float_reshape(take(i), Shape::from(vec![elements(&layouts[i])])))
                .collect();
            let sum = self.all_reduce(B::float_cat(flat, 0))?;
            let mut start = 0;
            for &i in &bucket {
                let end = start + elements(&layouts[i]);
                let slice = Slice::new(start as isize, Some(end as isize), 1);
                let part = B::float_slice(sum.clone(), &[slice]);
                sums[i] = Some(B::float_reshape(
                    part,
                    Shape::from(layouts[i].shape.clone()),
                ));
                start = end;
            }
        }
        Ok(sums
            .into_iter()
            .map(|sum| sum.expect("every bucket was summed"))
            .collect())
    }

    /// Refuses lists of tensors that differ between the ranks.
    fn check_same_tensors(&self, layouts: &[TensorLayout]) -> Result<(), Error> {
        let total: usize = layouts.iter().map(elements).sum();
        let mine = [layouts.len() as u64, total as u64, fingerprint(layouts)];
        let all = self.all_gather_values(&mine)?;
        let rank = self.rank();
        match all.iter().position(|theirs| *theirs != mine) {
            None => Ok(()),
            Some(peer) => {
                let describe = |v: &[u64]| {
                    format!(
                        "{} tensors to sum, {} elements, layouts fingerprint {:#018x}",
                        v[0], v[1], v[2]
                    )
                };
                Err(Error::RanksDisagree {
                    rank,
                    peer,
                    mine: describe(&mine),
                    theirs: describe(&all[peer]),
                })
            }
        }
    }
}

fn elements(layout: &TensorLayout) -> usize {
    layout.shape.iter().product()
}

/// FNV-1a over the layouts' float types and shapes: the same on every rank and process.
fn fingerprint(layouts: &[TensorLayout]) -> u64 {
    let bytes = layouts.iter().flat_map(|l| {
        let dims = (l.shape.iter()).flat_map(|&d| (d as u64).to_le_bytes());
        let dtype = format!("{:?}:{}", l.dtype, l.shape.len()).into_bytes();
        dtype.into_iter().chain(dims).collect::<Vec<u8>>()
    });
    bytes.fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Indices of `layouts` grouped into buckets, in order: per float type, consecutive tensors
/// while their bytes stay within `bucket_bytes` (a larger tensor, or one without elements, is a
/// bucket of its own). Buckets come in the order of their first tensor.
fn buckets(layouts: &[TensorLayout], bucket_bytes: usize) -> Vec<Vec<usize>> {
    let mut done: Vec<Vec<usize>> = Vec::new();
    // Open bucket per float type: (index in `done`, bytes so far).
    let mut open: Vec<(burn::tensor::DType, usize, usize)> = Vec::new();
    for (i, layout) in layouts.iter().enumerate() {
        let bytes = layout.bytes();
        if bytes == 0 || bytes > bucket_bytes {
            done.push(vec![i]);
            continue;
        }
        match open.iter_mut().find(|(dtype, ..)| *dtype == layout.dtype) {
            Some((_, at, filled)) if *filled + bytes <= bucket_bytes => {
                done[*at].push(i);
                *filled += bytes;
            }
            Some((_, at, filled)) => {
                *at = done.len();
                *filled = bytes;
                done.push(vec![i]);
            }
            None => {
                open.push((layout.dtype, done.len(), bytes));
                done.push(vec![i]);
            }
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::DType;

    fn layout(len: usize, dtype: DType) -> TensorLayout {
        TensorLayout {
            shape: vec![len],
            dtype,
        }
    }

    #[test]
    fn buckets_pack_tensors_of_one_type_in_order_within_the_bound() {
        let layouts = [
            layout(10, DType::F32),  // 40 bytes
            layout(10, DType::BF16), // 20 bytes
            layout(10, DType::F32),  // 40 bytes: fills the first f32 bucket
            layout(5, DType::F32),   // 20 bytes: a new f32 bucket
            layout(30, DType::F32),  // 120 bytes: alone, larger than the bound
            layout(0, DType::F32),   // nothing to sum: alone
            layout(30, DType::BF16), // 60 bytes: joins the bf16 bucket
        ];
        assert_eq!(
            buckets(&layouts, 80),
            vec![vec![0, 2], vec![1, 6], vec![3], vec![4], vec![5]]
        );
        assert_eq!(buckets(&layouts, 0).len(), layouts.len());
        let one: Vec<usize> = buckets(&layouts[..4], 1 << 20).concat();
        assert_eq!(one, vec![0, 2, 3, 1]);
    }

    #[test]
    fn fingerprints_tell_shapes_and_types_apart() {
        let a = [layout(6, DType::F32)];
        let b = [layout(6, DType::BF16)];
        let c = [TensorLayout {
            shape: vec![2, 3],
            dtype: DType::F32,
        }];
        let prints = [fingerprint(&a), fingerprint(&b), fingerprint(&c)];
        assert_ne!(prints[0], prints[1]);
        assert_ne!(prints[0], prints[2]);
        assert_eq!(fingerprint(&a), fingerprint(&a.clone()));
    }
}
