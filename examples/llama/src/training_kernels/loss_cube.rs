//! The fused cross-entropy (a forward that keeps each row's log-sum-exp, a backward from it): one
//! pass over the logits each way on the CubeCL backends instead of an f32 copy of the logits and
//! Burn's log-softmax graph. The portable forms, Burn tensor operations, are in the parent module
//! ([`TrainingKernels`](crate::TrainingKernels) picks).

use std::sync::OnceLock;

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, IntElement};
use cubecl::prelude::*;

use super::loss_kernels::{cross_entropy_grad, cross_entropy_rows, cross_entropy_target_grad};
use burn_distflash::cube_support::CUBE_UNITS;
use burn_distflash::cube_support::{
    array, contiguous, empty_like, is_kernel_float, vector_size, with_float_type,
};

/// Whether `DISTFLASH_UNFUSED_LOSS=1` asks for Burn's log-softmax on every backend (for
/// side-by-side measurements; read once per process).
pub fn unfused_loss_forced() -> bool {
    static FORCED: OnceLock<bool> = OnceLock::new();
    *FORCED.get_or_init(|| std::env::var("DISTFLASH_UNFUSED_LOSS").is_ok_and(|v| v == "1"))
}

/// A row-wise cross-entropy's per-row results: `(loss, lse)`, both f32 `[rows]`.
pub type CrossEntropyRows<B> = (FloatTensor<B>, FloatTensor<B>);

/// Per row, `(loss, lse)` in f32 in one pass over the logits, or `None` where the kernel does not
/// take these tensors (or under `DISTFLASH_UNFUSED_LOSS=1`); `I` is the backend's int type.
pub(crate) fn cross_entropy_forward<R: CubeRuntime, I: IntElement>(
    logits: CubeTensor<R>,
    targets: CubeTensor<R>,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    if unfused_loss_forced() {
        return None;
    }
    let [rows, vocab] = fused_shape::<R, I>(&logits, &targets)?;
    let loss = empty_like(&logits, Shape::new([rows]), DType::F32);
    let lse = empty_like(&logits, Shape::new([rows]), DType::F32);
    let client = logits.client.clone();
    let vector = vector_size(vocab, logits.dtype);
    let count = cubecl::calculate_cube_count_elemwise(&client, rows, CubeDim::new_1d(1));
    let dim = CubeDim::new_1d(CUBE_UNITS as u32);
    macro_rules! launch_as {
        ($F:ty) => {
            cross_entropy_rows::launch_unchecked::<$F, I, R>(
                &client,
                count,
                dim,
                vector,
                array(&logits, rows * vocab),
                array(&targets, rows),
                array(&loss, rows),
                array(&lse, rows),
                rows as u32,
                vocab as u32,
                f32::NAN,
            )
        };
    }
    // SAFETY: `fused_shape` checked the logits `[rows, vocab]` and the targets `[rows]`,
    // both contiguous; the outputs hold `rows` f32 each; extra cubes of the grid return.
    unsafe { with_float_type!(logits.dtype, launch_as) };
    Some((loss, lse))
}

/// The backward of [`cross_entropy_forward`] from its `lse` and the rows' loss gradient `grad`.
pub(crate) fn cross_entropy_backward<R: CubeRuntime, I: IntElement>(
    logits: CubeTensor<R>,
    targets: CubeTensor<R>,
    lse: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> CubeTensor<R> {
    let [rows, vocab] = fused_shape::<R, I>(&logits, &targets)
        .expect("the fused backward follows the fused forward, which checked these tensors");
    let grad = contiguous(grad);
    let dlogits = empty_like(&logits, logits.meta.shape().clone(), logits.dtype);
    let client = logits.client.clone();
    let vector = vector_size(vocab, logits.dtype);
    let dim = CubeDim::new_1d(CUBE_UNITS as u32);
    let elements = cubecl::calculate_cube_count_elemwise(&client, rows * vocab / vector, dim);
    let per_row = cubecl::calculate_cube_count_elemwise(&client, rows, dim);
    macro_rules! launch_as {
        ($F:ty) => {{
            cross_entropy_grad::launch_unchecked::<$F, R>(
                &client,
                elements,
                dim,
                vector,
                array(&logits, rows * vocab),
                array(&lse, rows),
                array(&grad, rows),
                array(&dlogits, rows * vocab),
                vocab as u32,
            );
            cross_entropy_target_grad::launch_unchecked::<$F, I, R>(
                &client,
                per_row,
                dim,
                array(&logits, rows * vocab),
                array(&targets, rows),
                array(&lse, rows),
                array(&grad, rows),
                array(&dlogits, rows * vocab),
                rows as u32,
                vocab as u32,
            );
        }};
    }
    // SAFETY: as in the forward; `lse` and `grad` hold `rows` f32 (the forward's and the
    // sum's backward's), `dlogits` is contiguous like the logits.
    unsafe { with_float_type!(logits.dtype, launch_as) };
    dlogits
}

/// `[rows, vocab]` when the kernels take these tensors: float logits `[rows, vocab]` and targets
/// `[rows]` of the backend's int type, both contiguous.
fn fused_shape<R: CubeRuntime, I: IntElement>(
    logits: &CubeTensor<R>,
    targets: &CubeTensor<R>,
) -> Option<[usize; 2]> {
    let (shape, target_shape) = (logits.meta.shape(), targets.meta.shape());
    let (&[rows, vocab], &[target_rows]) = (&shape[..], &target_shape[..]) else {
        return None;
    };
    let fits = is_kernel_float(logits.dtype)
        && rows == target_rows
        && vocab > 0
        && targets.dtype == I::dtype()
        && logits.is_contiguous()
        && targets.is_contiguous();
    fits.then_some([rows, vocab])
}
