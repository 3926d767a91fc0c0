//! [`WeightWriter`]: a model's updated weights assembled parameter by parameter from pieces of
//! the flat vector written in any order (a streamed optimizer step's chunks, or on a group each
//! rank's chunks gathered), so that no vector of the whole model is ever made: a parameter's new
//! value is made as soon as its last piece arrives, and the pieces it was made of are let go.

use std::ops::Range;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;

use super::flat::FlatLayout;

/// The updated weights of a [`FlatLayout`]'s parameters, filled piece by piece.
pub struct WeightWriter<I: Backend> {
    /// Each parameter's range of the flat vector, in visiting order.
    spans: Vec<Range<usize>>,
    /// Each parameter's pieces so far (their first flat index and values), or once complete
    /// its whole value (one piece).
    pieces: Vec<Vec<(usize, Tensor<I, 1>)>>,
    /// Elements of each parameter written so far.
    written: Vec<usize>,
}

impl<I: Backend> WeightWriter<I> {
    /// A writer of `layout`'s parameters, none written yet.
    pub fn new(layout: &FlatLayout) -> Self {
        let spans = layout.spans();
        Self {
            pieces: spans.iter().map(|_| Vec::new()).collect(),
            written: vec![0; spans.len()],
            spans,
        }
    }

    /// Writes `values`, elements `start .. start + len` of the flat vector (any float type;
    /// elements past the parameters, the padding, are dropped). Each element must be written
    /// once.
    pub fn write(&mut self, start: usize, values: Tensor<I, 1>) {
        let end = start + values.dims()[0];
        let first = self.spans.partition_point(|span| span.end <= start);
        for p in first..self.spans.len() {
            let span = self.spans[p].clone();
            if span.start >= end {
                break;
            }
            let (from, to) = (span.start.max(start), span.end.min(end));
            let piece = values.clone().narrow(0, from - start, to - from);
            self.pieces[p].push((from, piece));
            self.written[p] += to - from;
            if self.written[p] == span.len() && self.pieces[p].len() > 1 {
                let mut pieces = std::mem::take(&mut self.pieces[p]);
                pieces.sort_by_key(|(from, _)| *from);
                let whole = Tensor::cat(pieces.into_iter().map(|(_, t)| t).collect(), 0);
                self.pieces[p].push((span.start, whole));
            }
        }
    }

    /// `model` with every parameter replaced by its written values, cast to the parameter's
    /// float type; parameters that required gradients still do.
    ///
    /// # Panics
    ///
    /// When a parameter was not wholly written (a caller's bug: every chunk of every rank is
    /// written before this).
    pub fn into_model<B: AutodiffBackend<InnerBackend = I>, M: Module<B>>(self, model: M) -> M {
        let written = self.spans.iter().zip(&self.written);
        assert!(
            written.clone().all(|(span, &n)| n == span.len()),
            "every parameter is written before the model is rebuilt"
        );
        let values = (self.pieces.into_iter())
            .map(|mut pieces| pieces.pop().map(|(_, t)| t))
            .collect::<Vec<_>>();
        model.map(&mut Replace {
            values: values.into_iter(),
        })
    }
}

/// Replaces each parameter by its new value, in visiting order.
struct Replace<I: Backend> {
    values: std::vec::IntoIter<Option<Tensor<I, 1>>>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Replace<B::InnerBackend> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, old, mapper) = param.consume();
        let (shape, dtype) = (old.shape(), old.dtype());
        let value = match self.values.next().flatten() {
            Some(value) => value.reshape(shape).cast(dtype),
            // A parameter of no elements.
            None => old.clone().inner(),
        };
        let mut new = Tensor::<B, D>::from_inner(value);
        if old.is_require_grad() {
            new = new.require_grad();
        }
        Param::from_mapped_value(id, new, mapper)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};
    use burn::nn::{Initializer, Linear, LinearConfig};

    type Cpu = Autodiff<NdArray<f32>>;

    /// Two linear layers: weights and biases of four shapes.
    type Two = (Linear<Cpu>, Linear<Cpu>);

    /// Constant weights: no draw from NdArray's generator, which other tests of this binary
    /// share.
    fn two() -> Two {
        let device = Default::default();
        let constant = Initializer::Constant { value: 0.25 };
        let linear =
            |i, o| (LinearConfig::new(i, o).with_initializer(constant.clone())).init(&device);
        (linear(3, 5), linear(5, 2))
    }

    fn flat(model: &Two) -> Vec<f32> {
        let layout = FlatLayout::of::<Cpu, _>(model, 1);
        layout.weights::<Cpu, _>(model).to_data().to_vec().unwrap()
    }

    #[test]
    fn pieces_written_in_any_order_make_every_parameter_and_drop_the_padding() {
        let device = Default::default();
        let model = two();
        // 3x5 + 5 + 5x2 + 2 = 32 elements, padded to 33 over 3 ranks.
        let layout = FlatLayout::of::<Cpu, _>(&model, 3);
        assert_eq!((layout.len(), layout.padded()), (32, 33));
        let values: Vec<f32> = (0..33).map(|i| i as f32 * 0.5 - 3.0).collect();
        let mut writer = WeightWriter::<NdArray<f32>>::new(&layout);
        for range in [20..33, 0..7, 13..20, 7..13] {
            let piece = Tensor::from_floats(&values[range.clone()], &device);
            writer.write(range.start, piece);
        }
        let model = writer.into_model::<Cpu, _>(model);
        assert_eq!(flat(&model), values[..32]);
        assert!(model.0.weight.val().is_require_grad());
    }

    #[test]
    #[should_panic(expected = "every parameter is written")]
    fn a_parameter_left_unwritten_is_a_bug_not_stale_weights() {
        let model = two();
        let layout = FlatLayout::of::<Cpu, _>(&model, 1);
        let mut writer = WeightWriter::<NdArray<f32>>::new(&layout);
        writer.write(0, Tensor::zeros([20], &Default::default()));
        writer.into_model::<Cpu, _>(model);
    }
}
