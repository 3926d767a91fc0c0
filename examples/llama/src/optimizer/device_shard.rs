//! [`DeviceShard`]: one rank's f32 master weights and moments on the device, cut into the same
//! chunks as a host-resident state ([`chunk_elements`](super::state_chunks::chunk_elements)),
//! each chunk's three vectors tensors of their own: the step updates them chunk by chunk in
//! place, and no vector of the whole share is ever allocated (CubeCL's pools would put one of
//! several GiB into pages of a quarter of the GPU).

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

use super::flat::FlatLayout;
use super::host_shard::StateVectors;
use super::state_chunks::ranges;
use crate::safetensors_streamed::PieceSink;
use crate::Error;

/// One rank's optimizer state on the device, in chunks (see the module's documentation).
pub struct DeviceShard<I: Backend> {
    /// The layout of the model's parameters over the group.
    pub layout: FlatLayout,
    /// Optimizer steps taken.
    pub time: i32,
    /// Each chunk's range of the shard and its three vectors, in order.
    chunks: Vec<(Range<usize>, StateVectors<I>)>,
}

impl<I: Backend> DeviceShard<I> {
    /// A shard of `layout`'s share in chunks of `chunk` elements, each chunk's vectors made by
    /// `make` (tensors of their own: a view of a larger tensor would keep all of it allocated).
    pub fn build(
        layout: FlatLayout,
        time: i32,
        chunk: usize,
        mut make: impl FnMut(Range<usize>) -> StateVectors<I>,
    ) -> Self {
        let chunks = (ranges(layout.shard_len(), chunk).into_iter())
            .map(|range| (range.clone(), make(range)))
            .collect();
        Self {
            layout,
            time,
            chunks,
        }
    }

    /// Passes every chunk in order through `update(range, vectors)`, which returns their new
    /// values (the fused update writes them over the old ones).
    ///
    /// # Errors
    ///
    /// `update`'s errors; the shard is unusable after an error.
    pub fn stream(
        &mut self,
        mut update: impl FnMut(Range<usize>, StateVectors<I>) -> Result<StateVectors<I>, Error>,
    ) -> Result<(), Error> {
        for (range, vectors) in std::mem::take(&mut self.chunks) {
            let updated = update(range.clone(), vectors)?;
            self.chunks.push((range, updated));
        }
        Ok(())
    }

    /// One of the three vectors (0: master weights, 1: first moment, 2: second moment) read
    /// into host memory chunk by chunk, each chunk (in f32) handed to `sink` as it is read.
    ///
    /// # Errors
    ///
    /// The errors `sink` returns.
    pub fn pieces(&self, vector: usize, sink: &mut PieceSink<'_>) -> Result<(), Error> {
        for (_, vectors) in &self.chunks {
            sink(vectors[vector].to_data().convert_dtype(DType::F32))?;
        }
        Ok(())
    }

    /// One of the three vectors, whole, read into host memory chunk by chunk.
    #[cfg(test)]
    pub fn read(&self, vector: usize) -> burn::tensor::TensorData {
        super::shard_file::whole_vector(self.layout.shard_len(), |sink| self.pieces(vector, sink))
    }

    /// One of the three vectors, whole, on the device (its chunks concatenated: a vector of the
    /// whole share, for callers that ask for one).
    pub fn vector(&self, vector: usize) -> Tensor<I, 1> {
        let chunks = self.chunks.iter().map(|(_, v)| v[vector].clone()).collect();
        Tensor::cat(chunks, 0)
    }
}

/// `values` copied into a tensor of its own (a view's copy, so that what it views can be let
/// go): bitwise the same elements, in f32.
pub fn owned_f32<I: Backend>(values: Tensor<I, 1>) -> Tensor<I, 1> {
    let len = values.dims()[0];
    let all = 0..len;
    Tensor::<I, 1>::empty([len], (&values.device(), DType::F32)).slice_assign([all], values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    type Cpu = NdArray<f32>;

    fn vectors(range: Range<usize>) -> StateVectors<Cpu> {
        let values = |k: f32| -> Vec<f32> { range.clone().map(|i| i as f32 * k).collect() };
        [1.0, -2.0, 0.5].map(|k| Tensor::from_floats(values(k).as_slice(), &Default::default()))
    }

    #[test]
    fn every_chunk_goes_through_the_update_once_in_order_and_reads_back_whole() {
        let layout = FlatLayout::of_len(5000, 2);
        let n = layout.shard_len();
        let mut shard = DeviceShard::<Cpu>::build(layout, 3, 1024, vectors);
        let mut seen = Vec::new();
        shard
            .stream(|r, [a, b, c]| {
                seen.push(r.clone());
                assert_eq!(a.to_data(), vectors(r)[0].to_data());
                Ok([a.add_scalar(1.0), b, c])
            })
            .unwrap();
        assert_eq!(seen, ranges(n, 1024));
        let want: Vec<f32> = (0..n).map(|i| i as f32 + 1.0).collect();
        assert_eq!(shard.read(0).to_vec::<f32>().unwrap(), want);
        assert_eq!(shard.vector(0).to_data().to_vec::<f32>().unwrap(), want);
        assert_eq!(shard.read(2), vectors(0..n)[2].to_data());
    }

    #[test]
    fn a_failed_update_stops_the_pass() {
        let mut shard = DeviceShard::<Cpu>::build(FlatLayout::of_len(4096, 1), 0, 1024, vectors);
        let mut calls = 0;
        let result = shard.stream(|r, v| {
            calls += 1;
            match r.start {
                2048 => Err(Error::invalid("a chunk", "any", "a test's failure")),
                _ => Ok(v),
            }
        });
        assert!(result.is_err());
        assert_eq!(calls, 3);
    }

    #[test]
    fn an_owned_copy_is_bitwise_its_view() {
        let whole: Tensor<Cpu, 1> =
            Tensor::from_floats([1.5, -0.0, f32::MIN_POSITIVE, 7.0], &Default::default());
        let copy = owned_f32(whole.clone().narrow(0, 1, 3));
        let bits = |t: Tensor<Cpu, 1>| -> Vec<u32> {
            t.to_data()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_eq!(bits(copy), bits(whole.narrow(0, 1, 3)));
    }
}
