//! [`HostShard`]: one rank's f32 master weights and moments in host memory (pinned on CUDA,
//! through the backend's [`HostOffload`]), cut into chunks of a byte budget, and the streamed
//! pass over them: each chunk comes to the device, is updated there and goes back.
//!
//! The pass brings chunk `k + 1` in (on CUDA an asynchronous copy on the offload's copy stream)
//! while chunk `k` is updated, and sends chunk `k` back once its update is queued; before chunk
//! `k + 1` is brought in, the host waits for chunk `k - 1`'s copy out, whose device memory is
//! then released. So the device holds two chunks of state (the one updated and the one coming
//! in), and the copy stream alternates in and out without waiting for the updates.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use burn_distflash::offload::{HostOffload, HostTensor};

use super::flat::FlatLayout;
use super::shard_file::whole_vector;
use super::state_chunks::ranges;
use crate::safetensors_streamed::PieceSink;
use crate::Error;

/// Master weights, first moment and second moment of one range of a shard, on the device.
pub type StateVectors<I> = [Tensor<I, 1>; 3];

/// Master weights, first moment and second moment of one chunk, in host memory.
type HostVectors<I> = [HostTensor<I>; 3];

/// One rank's optimizer state in host memory (see the module's documentation).
pub struct HostShard<I: HostOffload> {
    /// The layout of the model's parameters over the group.
    pub layout: FlatLayout,
    /// Optimizer steps taken.
    pub time: i32,
    /// Each chunk's range of the shard and its three vectors (`None` only during a pass).
    chunks: Vec<(Range<usize>, Option<HostVectors<I>>)>,
    device: I::Device,
}

impl<I: HostOffload> HostShard<I> {
    /// A shard of `layout`'s share in chunks of `chunk` elements, each chunk's vectors made on
    /// `device` by `make` and moved to host memory. The host memory for all of them is had
    /// first (checked against what the host has available, pinned on CUDA), so that a host
    /// without enough fails here, before anything moves.
    ///
    /// # Errors
    ///
    /// [`Error::Attention`] wrapping the backend's [`Offload`](burn_distflash::Error::Offload)
    /// error, which names the bytes asked for and what the host has.
    pub fn build(
        layout: FlatLayout,
        time: i32,
        chunk: usize,
        device: &I::Device,
        mut make: impl FnMut(Range<usize>) -> StateVectors<I>,
    ) -> Result<Self, Error> {
        let ranges = ranges(layout.shard_len(), chunk);
        let sizes: Vec<usize> = (ranges.iter()).flat_map(|r| [r.len() * 4; 3]).collect();
        I::prepare_host_offload(device, &sizes).map_err(host_error)?;
        let mut chunks = Vec::with_capacity(ranges.len());
        for range in ranges {
            let mut vectors = offload(make(range.clone()))?;
            vectors.iter_mut().for_each(HostTensor::wait_copied);
            chunks.push((range, Some(vectors)));
        }
        Ok(Self {
            layout,
            time,
            chunks,
            device: device.clone(),
        })
    }

    /// Bytes of host memory the shard holds.
    pub fn bytes(&self) -> u64 {
        let held = self.chunks.iter().flat_map(|(_, v)| v.iter().flatten());
        held.map(|t| t.bytes() as u64).sum()
    }

    /// Streams every chunk through the device in order: `update(range, vectors)` gets the
    /// chunk's vectors on the device and returns their new values, which go back to host
    /// memory (see the module's documentation for the overlap).
    ///
    /// # Errors
    ///
    /// `update`'s errors, and [`Error::Attention`] when a chunk cannot go back to host memory
    /// (the host memory was had before the first step, so only a failing device does this);
    /// the shard is unusable after an error.
    pub fn stream(
        &mut self,
        mut update: impl FnMut(Range<usize>, StateVectors<I>) -> Result<StateVectors<I>, Error>,
    ) -> Result<(), Error> {
        let mut incoming = self.chunks.first_mut().map(|chunk| restore(&mut chunk.1));
        for k in 0..self.chunks.len() {
            let current = incoming.take().expect("every chunk is brought in");
            let vectors = current.map(|r| wrap(r.finish()));
            if k > 0 {
                let previous = self.chunks[k - 1].1.as_mut().expect("sent back");
                previous.iter_mut().for_each(HostTensor::wait_copied);
            }
            incoming = self
                .chunks
                .get_mut(k + 1)
                .map(|chunk| restore(&mut chunk.1));
            let range = self.chunks[k].0.clone();
            self.chunks[k].1 = Some(offload(update(range, vectors)?)?);
        }
        if let Some((_, Some(last))) = self.chunks.last_mut() {
            last.iter_mut().for_each(HostTensor::wait_copied);
        }
        Ok(())
    }

    /// One of the three vectors (0: master weights, 1: first moment, 2: second moment) read
    /// from host memory chunk by chunk, each chunk handed to `sink` as it is read (so that a
    /// checkpoint never holds a second copy of the state: see `write_shard_file`).
    ///
    /// # Errors
    ///
    /// The errors `sink` returns.
    pub fn pieces(&self, vector: usize, sink: &mut PieceSink<'_>) -> Result<(), Error> {
        for (_, vectors) in &self.chunks {
            let chunk = vectors
                .as_ref()
                .expect("between passes every chunk is held");
            sink(chunk[vector].to_data())?;
        }
        Ok(())
    }

    /// One of the three vectors, whole, read from host memory.
    pub fn read(&self, vector: usize) -> TensorData {
        whole_vector(self.layout.shard_len(), |sink| self.pieces(vector, sink))
    }

    /// One of the three vectors, whole, on the device.
    pub fn vector(&self, vector: usize) -> Tensor<I, 1> {
        Tensor::from_data(self.read(vector), &self.device)
    }
}

/// Starts bringing a chunk's vectors back to the device.
fn restore<I: HostOffload>(
    held: &mut Option<HostVectors<I>>,
) -> [burn_distflash::offload::Restoring<I>; 3] {
    held.take()
        .expect("a chunk is brought in once per pass")
        .map(I::restore_from_host)
}

/// Starts moving a chunk's vectors to host memory.
fn offload<I: HostOffload>(vectors: StateVectors<I>) -> Result<HostVectors<I>, Error> {
    let [a, b, c] = vectors.map(|v| I::offload_to_host(v.into_primitive().tensor()));
    Ok([
        a.map_err(host_error)?,
        b.map_err(host_error)?,
        c.map_err(host_error)?,
    ])
}

fn wrap<I: Backend>(tensor: burn::tensor::ops::FloatTensor<I>) -> Tensor<I, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(tensor))
}

/// The backend's refusal of host memory as this crate's error.
fn host_error(source: burn_distflash::Error) -> Error {
    Error::Attention {
        during: "keeping the optimizer state in host memory",
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    type Cpu = NdArray<f32>;

    fn vectors(range: Range<usize>, seed: f32) -> StateVectors<Cpu> {
        let values = |k: f32| -> Vec<f32> { range.clone().map(|i| i as f32 * k + seed).collect() };
        [1.0, -2.0, 0.5].map(|k| Tensor::from_floats(values(k).as_slice(), &Default::default()))
    }

    #[test]
    fn every_chunk_goes_through_the_update_once_in_order_and_reads_back_whole() {
        let layout = FlatLayout::of_len(10_000, 3);
        let n = layout.shard_len();
        let built =
            HostShard::<Cpu>::build(layout, 4, 1024, &Default::default(), |r| vectors(r, 0.0));
        let mut shard = built.unwrap();
        assert_eq!(shard.bytes(), 12 * n as u64);
        let mut seen = Vec::new();
        shard
            .stream(|r, [a, b, c]| {
                seen.push(r.clone());
                assert_eq!(a.to_data(), vectors(r.clone(), 0.0)[0].to_data());
                Ok([a.add_scalar(1.0), b, c])
            })
            .unwrap();
        assert_eq!(seen, ranges(n, 1024));
        let master = shard.read(0).to_vec::<f32>().unwrap();
        let want: Vec<f32> = (0..n).map(|i| i as f32 + 1.0).collect();
        assert_eq!(master, want);
        assert_eq!(shard.read(1), vectors(0..n, 0.0)[1].to_data());
    }

    #[test]
    fn a_host_that_cannot_hold_the_state_is_refused_before_anything_moves() {
        if burn_distflash::offload::host_memory_available().is_none() {
            return; // no MemAvailable to check against (not Linux)
        }
        // 2^40 elements: 12 TiB of state.
        let layout = FlatLayout::of_len(1 << 40, 1);
        let chunk = 1 << 38;
        let result = HostShard::<Cpu>::build(layout, 0, chunk, &Default::default(), |_| {
            panic!("nothing is made when the host memory is refused")
        });
        let err = result.err().expect("refused").to_string();
        assert!(
            err.contains("12288.00 GiB") && err.contains("available"),
            "{err}"
        );
        let start = "keeping the optimizer state in host memory: offloading to host memory";
        assert!(err.starts_with(start), "{err}");
    }
}
