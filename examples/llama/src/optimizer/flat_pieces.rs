//! [`FlatPieces`]: a model's parameters, or their gradients, each flattened in its own float
//! type and in the [`FlatLayout`](super::FlatLayout)'s order, from which any ranges of the flat
//! f32 vector are read on their own: a streamed optimizer step reads its chunks of the gradient
//! this way, and the gradients' sum over a group its buckets (the same range of every rank's
//! share), instead of gathering the whole vector in f32 first. Pieces read for good are let go
//! as the reads advance.

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
    /// What may not be read any more ([`FlatPieces::release_read`]): the elements before this
    /// offset of every share of that many elements.
    released: Released,
}

/// The elements a [`FlatPieces`] has let go of: those before offset `end` of every share of
/// `share` elements (the flat vector cut into consecutive shares).
#[derive(Debug, Clone, Copy)]
struct Released {
    share: usize,
    end: usize,
}

impl Released {
    /// Whether every element of `range` (not empty) lies before `end` in its share.
    fn covers(&self, range: &Range<usize>) -> bool {
        let one_share = range.start / self.share == (range.end - 1) / self.share;
        (one_share && (range.end - 1) % self.share < self.end) || self.end >= self.share
    }

    /// Whether some element of `range` (not empty) lies before `end` in its share.
    fn touches(&self, range: &Range<usize>) -> bool {
        let one_share = range.start / self.share == (range.end - 1) / self.share;
        !one_share && self.end > 0 || range.start % self.share < self.end
    }
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
            released: Released {
                share: usize::MAX,
                end: 0,
            },
        }
    }

    /// Lets go of every piece whose elements all lie before offset `end` of their share, the
    /// flat vector being cut into shares of `share` elements (one share: flat indices before
    /// `end`): a pass that reads every share in order up to `end` (a streamed step's chunks, the
    /// gradients' sum's buckets) needs them no more, and their memory can serve what it makes
    /// next. Reading such elements afterwards is a caller's bug. Every call of one pass names
    /// the same `share` (at least 1), with `end` growing.
    pub fn release_read(&mut self, share: usize, end: usize) {
        self.released = Released {
            share: share.max(1),
            end: end.max(self.released.end),
        };
        let mut offset = 0;
        for (piece, len) in &mut self.pieces {
            let range = offset..offset + *len;
            if range.is_empty() || self.released.covers(&range) {
                *piece = None;
            }
            offset += *len;
        }
    }

    /// The device the pieces are on.
    pub fn device(&self) -> &I::Device {
        &self.device
    }

    /// Elements `range` of the flat vector in f32, zeros past the parameters (the padding): the
    /// same values as the same range of [`FlatLayout::weights`](super::FlatLayout::weights) (or
    /// of the gradients laid end to end).
    ///
    /// # Panics
    ///
    /// When `range` holds elements [`release_read`](Self::release_read) let go of.
    pub fn range(&self, range: Range<usize>) -> Tensor<I, 1> {
        self.gather([range])
    }

    /// [`range`](Self::range) of each of `ranges`, concatenated in order (one concatenation, no
    /// f32 copy of each range first).
    ///
    /// # Panics
    ///
    /// As [`range`](Self::range).
    pub fn gather(&self, ranges: impl IntoIterator<Item = Range<usize>>) -> Tensor<I, 1> {
        let mut parts = Vec::new();
        for range in ranges {
            self.parts(range, &mut parts);
        }
        match parts.len() {
            0 => f32_zeros(0, &self.device),
            1 => parts.pop().expect("one part"),
            _ => Tensor::cat(parts, 0),
        }
    }

    /// Pushes onto `parts` the f32 parts making elements `range` (see [`range`](Self::range)).
    fn parts(&self, range: Range<usize>, parts: &mut Vec<Tensor<I, 1>>) {
        assert!(
            range.is_empty() || !self.released.touches(&range),
            "elements {range:?} read after the elements before offset {} of every share of {} \
             were released",
            self.released.end,
            self.released.share
        );
        let mut offset = 0;
        let mut covered = 0;
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
                covered += end - start;
            }
            offset += len;
        }
        if covered < range.len() {
            parts.push(f32_zeros(range.len() - covered, &self.device));
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
        // One share of 33 (32 elements and a padding one): 0..18 covers the first weight (15)
        // but not the first bias (15..20): the bias stays.
        released.release_read(33, 18);
        assert!(released.pieces[0].0.is_none() && released.pieces[1].0.is_some());
        assert_eq!(values(released.range(18..32)), whole[18..32]);
        assert_eq!(values(released.range(20..33))[..12], whole[20..32]);
        let early =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| released.range(17..20)));
        assert!(early.is_err(), "a read before the released bound must fail");
    }

    #[test]
    fn pieces_read_in_every_share_are_released_and_the_rest_read_together() {
        let whole = values(FlatPieces::weights::<Cpu, _>(&two()).range(0..32));
        // Two shares of 16: weight 0..15, bias 15..20 (across the shares), weight 20..30 (16
        // to 30 in the second share: offsets 4..14), bias 30..32 (offsets 14..16).
        let mut pieces = FlatPieces::weights::<Cpu, _>(&two());
        pieces.release_read(16, 10);
        assert!(
            pieces.pieces.iter().all(|(p, _)| p.is_some()),
            "none read whole"
        );
        pieces.release_read(16, 15);
        let held: Vec<bool> = pieces.pieces.iter().map(|(p, _)| p.is_some()).collect();
        assert_eq!(held, [false, true, false, true]);
        let read = values(pieces.gather([15..16, 31..32, 15..15]));
        assert_eq!(read, [whole[15], whole[31]]);
        for early in [14..16, 16..18, 15..18, 30..32] {
            let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pieces.range(early.clone())
            }));
            assert!(read.is_err(), "{early:?} holds released elements");
        }
        pieces.release_read(16, 16);
        assert!(pieces.pieces.iter().all(|(p, _)| p.is_none()), "all read");
    }
}
