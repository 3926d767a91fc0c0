//! Summing tensors over a group (replicated weights' gradients), identically on every rank.

use crate::Error;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use super::{DeviceGroup, Incoming, MessageKind, Outgoing, TensorLayout};

impl<B: Backend> DeviceGroup<B> {
    /// The element-wise sum over all ranks of each of `tensors` (every rank passes tensors of the
    /// same shapes, in the same order). Each rank sends its tensors to every other rank and adds
    /// the P contributions in rank order, so every rank gets bitwise the same sums and replicated
    /// weights stay identical after an optimizer step. Traffic is `(P - 1)` times the tensors per
    /// rank: meant for gradients, one weight (or a few) per call.
    ///
    /// # Shapes
    ///
    /// - tensors: any shapes, the same on every rank
    /// - output: the sums, of the same shapes, in the same order
    ///
    /// # Errors
    ///
    /// As [`exchange`](Self::exchange) and [`Exchange::wait`](super::Exchange::wait), notably
    /// [`Error::Timeout`] when a peer does not take part, and (in-process)
    /// [`Error::Mismatch`] when a peer's tensors have other shapes or float types (NCCL does
    /// not check them). A group of one rank returns `tensors` as they are and never errs.
    pub fn all_reduce_sum(
        &self,
        tensors: Vec<FloatTensor<B>>,
    ) -> Result<Vec<FloatTensor<B>>, Error> {
        let (rank, world) = (self.rank(), self.world_size());
        if world == 1 {
            return Ok(tensors);
        }
        let layouts: Vec<TensorLayout> = tensors.iter().map(TensorLayout::of::<B>).collect();
        let peers = (0..world).filter(|&p| p != rank);
        let sends = peers
            .clone()
            .map(|peer| Outgoing {
                peer,
                kind: MessageKind::Reduction,
                tensors: tensors.clone(),
            })
            .collect();
        let receives = peers
            .map(|peer| Incoming {
                peer,
                kind: MessageKind::Reduction,
                layouts: layouts.clone(),
            })
            .collect();
        let received = self.exchange(sends, receives)?.wait()?;
        let mut by_rank: Vec<Vec<FloatTensor<B>>> = Vec::with_capacity(world);
        let mut received = received.into_iter();
        let mut own = Some(tensors);
        for r in 0..world {
            let next = if r == rank {
                own.take()
            } else {
                received.next().map(|m| m.tensors)
            };
            by_rank.push(next.expect("one message per peer, in rank order"));
        }
        let mut contributions = by_rank.into_iter();
        let first = contributions.next().expect("at least one rank");
        Ok(contributions.fold(first, |sums, next| {
            sums.into_iter()
                .zip(next)
                .map(|(a, b)| B::float_add(a, b))
                .collect()
        }))
    }
}
