//! Tensors the CubeCL kernels write in place: a buffer of the call's own ([`exclusive`]), and
//! the rows of an f32 gradient accumulator that a backward step adds into
//! ([`AccumulatorRows`]).

use core::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::Slice;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use crate::step;

/// A tensor this call may overwrite in place: itself when it is contiguous and nothing else
/// holds its buffer, else a contiguous copy in a buffer of its own. (Burn's own copy may come
/// back pitched on CUDA, rows padded to an alignment; the kernels would then write a further
/// contiguous copy and the caller's tensor would never see the writes.)
pub(super) fn exclusive<R: CubeRuntime>(tensor: CubeTensor<R>) -> CubeTensor<R> {
    if tensor.is_contiguous() && tensor.can_mut() {
        return tensor;
    }
    let (client, device, dtype) = (tensor.client.clone(), tensor.device.clone(), tensor.dtype);
    let copy = cubecl::std::tensor::into_contiguous(&client, tensor.binding(), dtype.into());
    CubeTensor::new(client, copy.handle, *copy.metadata, device, dtype)
}

/// Where a backward step's kernels add into one f32 accumulator `[B, H, S, D]`: the
/// accumulator itself (made [`exclusive`]: in place when the caller held it alone) when the
/// step covers all its rows, else a contiguous copy of the step's rows, which
/// [`finish`](Self::finish) writes back. A view of the rows cannot be written instead: unless
/// `B * H` is 1 the rows are `B * H` separate runs of the buffer, and the kernels take
/// contiguous buffers.
pub(super) struct AccumulatorRows<R: CubeRuntime> {
    accumulator: CubeTensor<R>,
    /// The rows' slices of the accumulator and their contiguous copy, when not all rows.
    rows: Option<(Vec<Slice>, CubeTensor<R>)>,
}

impl<R: CubeRuntime> AccumulatorRows<R> {
    /// Rows `rows` (dimension 2) of `accumulator`, of backend `B`.
    pub(super) fn new<B>(accumulator: CubeTensor<R>, rows: &Range<usize>) -> Self
    where
        B: Backend<FloatTensorPrimitive = CubeTensor<R>>,
    {
        let accumulator = exclusive(accumulator);
        if step::covers::<B>(&accumulator, rows) {
            return Self {
                accumulator,
                rows: None,
            };
        }
        let slices = step::row_slices::<B>(&accumulator, rows);
        let copy = exclusive(B::float_slice(accumulator.clone(), &slices));
        Self {
            accumulator,
            rows: Some((slices, copy)),
        }
    }

    /// The contiguous tensor the kernels add into.
    pub(super) fn target(&self) -> &CubeTensor<R> {
        match &self.rows {
            Some((_, copy)) => copy,
            None => &self.accumulator,
        }
    }

    /// The accumulator with the kernels' additions (the copy's rows written back, in place:
    /// the caller has dropped its views of the target).
    pub(super) fn finish<B>(self) -> CubeTensor<R>
    where
        B: Backend<FloatTensorPrimitive = CubeTensor<R>>,
    {
        match self.rows {
            None => self.accumulator,
            Some((slices, copy)) => B::float_slice_assign(self.accumulator, &slices, copy),
        }
    }
}
