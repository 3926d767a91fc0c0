//! [`FlatPieces`]: a model's parameters, or their gradients, each flattened in its own float
//! type and in the [`FlatLayout`](super::FlatLayout)'s order, from which any range of the flat
//! f32 vector is read on its own: a streamed optimizer step reads its chunks of the gradient this
//! way instead of gathering the whole vector in f32 first.

use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor};

/// The flattened pieces of a flat vector (see the module's documentation).
pub struct FlatPieces<I: Backend> {
    /// Each parameter's flattened tensor (`None`: a parameter without a gradient, read as
    /// zeros) and its length, in visiting order.
    pieces: Vec<(Option<Tensor<I, 1>>, usize)>,
    device: I::Device,
    /// Flat index before which nothing may be read any more ([`FlatPieces::release_before`]).
    released: usize,
}

impl<I: Backend> FlatPieces<I> {
    /// Every parameter's gradient, taken out of `grads`.
    pub fn gradients<B, M>(model: &M, grads: &mut GradientsParams) -> Self
    where
        B: AutodiffBackend<InnerBackend = I>,
        M: Module<B>,
    {
        Self::collect(model, Some(grads))
    }

    /// Every parameter's value.
    pub fn weights<B, M>(model: &M) -> Self
    where
        B: AutodiffBackend<InnerBackend = I>,
        M: Module<B>,
    {
        Self::collect(model, None)
    }

    fn collect<B, M>(model: &M, grads: Option<&mut GradientsParams>) -> Self
    where
        B: AutodiffBackend<InnerBackend = I>,
        M: Module<B>,
    {
        let mut visitor = Collect::<I> {
            grads,
            pieces: Vec::new(),
            device: None,
        };
        model.visit(&mut visitor);
        Self {
            pieces: visitor.pieces,
            device: visitor.device.unwrap_or_default(),
            released: 0,
        }
    }

    /// Lets go of every piece that lies wholly before flat index `end`: a streamed step that has
    /// read its chunks up to `end` needs them no more, and their memory can serve what the step
    /// makes next (the new weights). Reading before `end` afterwards is a caller's bug.
    pub fn release_before(&mut self, end: usize) {
        let mut offset = 0;
        for (piece, len) in &mut self.pieces {
            if offset + *len > end {
                break;
            }
            *piece = None;
            offset += *len;
        }
        self.released = self.released.max(end);
    }

    /// The device the pieces are on.
    pub fn device(&self) -> &I::Device {
        &self.device
    }

    /// Elements `range` of the flat vector in f32, zeros past the parameters (the padding): the
    /// same values as the same range of [`FlatLayout::gradients`](super::FlatLayout::gradients)
    /// or [`FlatLayout::weights`](super::FlatLayout::weights).
    ///
    /// # Panics
    ///
    /// When `range` starts before what [`release_before`](Self::release_before) let go of.
    pub fn range(&self, range: Range<usize>) -> Tensor<I, 1> {
        assert!(
            range.start >= self.released,
            "elements {range:?} read after the pieces before {} were released",
            self.released
        );
        let mut parts = Vec::new();
        let mut offset = 0;
        for (piece, len) in &self.pieces {
            let (start, end) = (range.start.max(offset), range.end.min(offset + len));
            if start < end {
                parts.push(match piece {
                    Some(piece) => piece
                        .clone()
                        .narrow(0, start - offset, end - start)
                        .cast(DType::F32),
                    None => f32_zeros(end - start, &self.device),
                });
            }
            offset += len;
        }
        let covered = parts.iter().map(|p| p.dims()[0]).sum::<usize>();
        if covered < range.len() {
            parts.push(f32_zeros(range.len() - covered, &self.device));
        }
        match parts.len() {
            1 => parts.pop().expect("one part"),
            _ => Tensor::cat(parts, 0),
        }
    }
}

/// An f32 vector of `len` zeros.
fn f32_zeros<I: Backend>(len: usize, device: &I::Device) -> Tensor<I, 1> {
    Tensor::<I, 1>::zeros([len], device).cast(DType::F32)
}

/// Flattens each parameter's gradient (taken out of `grads`) or, without `grads`, its value.
struct Collect<'a, I: Backend> {
    grads: Option<&'a mut GradientsParams>,
    pieces: Vec<(Option<Tensor<I, 1>>, usize)>,
    device: Option<I::Device>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val();
        let len = value.shape().num_elements();
        self.device.get_or_insert_with(|| value.device());
        let piece = match self.grads.as_mut() {
            None => Some(value.inner()),
            Some(grads) => grads.remove::<B::InnerBackend, D>(param.id),
        };
        self.pieces.push((piece.map(|p| p.reshape([len])), len));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};
    use burn::nn::{Initializer, Linear, LinearConfig};

    type Cpu = Autodiff<NdArray<f32>>;

    /// Two linear layers (3x5 + 5, then 5x2 + 2: 32 elements) of constant weights, no draw
    /// from NdArray's shared generator.
    fn two() -> (Linear<Cpu>, Linear<Cpu>) {
        let device = Default::default();
        let constant = Initializer::Constant { value: 0.25 };
        let linear =
            |i, o| (LinearConfig::new(i, o).with_initializer(constant.clone())).init(&device);
        (linear(3, 5), linear(5, 2))
    }

    fn values(t: Tensor<NdArray<f32>, 1>) -> Vec<f32> {
        t.to_data().to_vec().unwrap()
    }

    #[test]
    fn released_pieces_leave_later_ranges_unchanged_and_earlier_ones_unreadable() {
        let pieces = FlatPieces::weights::<Cpu, _>(&two());
        let whole = values(pieces.range(0..32));
        let mut released = FlatPieces::weights::<Cpu, _>(&two());
        // 0..18 covers the first weight (15) but not the first bias (15..20): the bias stays.
        released.release_before(18);
        assert!(released.pieces[0].0.is_none() && released.pieces[1].0.is_some());
        assert_eq!(values(released.range(18..32)), whole[18..32]);
        assert_eq!(values(released.range(20..33))[..12], whole[20..32]);
        let early =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| released.range(17..20)));
        assert!(early.is_err(), "a read before the released bound must fail");
    }
}
