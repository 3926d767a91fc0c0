//! The optimizer's per-parameter passes (a gradient's squared norm, the AdamW update): one CubeCL
//! kernel each on the CubeCL backends (CUDA, wgpu). The portable forms, Burn tensor operations,
//! are in the parent module ([`TrainingKernels`](crate::TrainingKernels) picks).

use std::sync::OnceLock;

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::adamw_kernels::{adamw_update, sum_of_squares, AdamWStep};
use super::portable::squared_norm_portable;
use burn_distflash::cube_support::CUBE_UNITS;
use burn_distflash::cube_support::{
    array, contiguous, empty_like, is_kernel_float, vector_size, with_float_type,
};

/// A parameter's AdamW tensors after one update: `(param, moment_1, moment_2)`.
pub type AdamWTensors<B> = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

/// Whether `DISTFLASH_UNFUSED_OPTIMIZER=1` asks for the portable passes on every backend (for
/// side-by-side measurements; read once per process).
pub fn unfused_optimizer_forced() -> bool {
    static FORCED: OnceLock<bool> = OnceLock::new();
    *FORCED.get_or_init(|| std::env::var("DISTFLASH_UNFUSED_OPTIMIZER").is_ok_and(|v| v == "1"))
}

/// `sum(x^2)` over every element of `tensor` in f32, one kernel pass (the portable form for
/// element types the kernel does not take, or under `DISTFLASH_UNFUSED_OPTIMIZER=1`).
pub(crate) fn squared_norm<R, F, I, BT, const D: usize>(
    tensor: Tensor<CubeBackend<R, F, I, BT>, D>,
) -> Tensor<CubeBackend<R, F, I, BT>, 1>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    if unfused_optimizer_forced() || !is_kernel_float(tensor.dtype()) {
        return squared_norm_portable(tensor);
    }
    let tensor = contiguous(tensor.into_primitive().tensor());
    let len = tensor.meta.num_elements();
    let vector = vector_size(len, tensor.dtype);
    let vectors = len / vector;
    // Enough cubes to fill the device several times over, each unit striding over the rest.
    let cubes = vectors.div_ceil(CUBE_UNITS * 8).clamp(1, 1024);
    let partials = empty_like(&tensor, Shape::new([cubes]), DType::F32);
    let client = tensor.client.clone();
    let (count, dim) = (
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_1d(CUBE_UNITS as u32),
    );
    let units = (cubes * CUBE_UNITS) as u32;
    macro_rules! launch_as {
        ($F:ty) => {
            sum_of_squares::launch_unchecked::<$F, R>(
                &client,
                count,
                dim,
                vector,
                array(&tensor, len),
                array(&partials, cubes),
                units,
            )
        };
    }
    // SAFETY: `tensor` is contiguous with `len` elements and `partials` has one element per
    // cube; the kernel guards its reads by the array length.
    unsafe { with_float_type!(tensor.dtype, launch_as) }
    Tensor::<CubeBackend<R, F, I, BT>, 1>::from_primitive(TensorPrimitive::Float(partials)).sum()
}

/// One AdamW update in one kernel pass: `(param, moment_1, moment_2)` after the step, or `None`
/// where the kernel does not take these tensors (or under `DISTFLASH_UNFUSED_OPTIMIZER=1`).
pub(crate) fn fused_adamw<R: CubeRuntime>(
    param: CubeTensor<R>,
    grad: CubeTensor<R>,
    (moment_1, moment_2): (CubeTensor<R>, CubeTensor<R>),
    step: &AdamWStep,
) -> Option<(CubeTensor<R>, CubeTensor<R>, CubeTensor<R>)> {
    if unfused_optimizer_forced() {
        return None;
    }
    let dtype = kernel_dtype(&[&param, &grad, &moment_1, &moment_2])?;
    let shape = param.meta.shape().clone();
    if [&grad, &moment_1, &moment_2]
        .iter()
        .any(|t| *t.meta.shape() != shape)
    {
        return None;
    }
    let [param, grad, moment_1, moment_2] = [param, grad, moment_1, moment_2].map(contiguous);
    let len = param.meta.num_elements();
    let vector = vector_size(len, dtype);
    let vectors = len / vector;
    let outputs = [0; 3].map(|_| empty_like(&param, shape.clone(), dtype));
    let client = param.client.clone();
    let dim = CubeDim::new_1d(CUBE_UNITS as u32);
    let count = cubecl::calculate_cube_count_elemwise(&client, vectors, dim);
    let [p_out, m1_out, m2_out] = &outputs;
    macro_rules! launch_as {
        ($F:ty) => {
            adamw_update::launch_unchecked::<$F, R>(
                &client,
                count,
                dim,
                vector,
                array(&param, len),
                array(&grad, len),
                array(&moment_1, len),
                array(&moment_2, len),
                array(p_out, len),
                array(m1_out, len),
                array(m2_out, len),
                step.beta_1,
                step.beta_2,
                step.bias_1,
                step.bias_2,
                step.epsilon,
                step.decay,
                step.lr,
            )
        };
    }
    // SAFETY: all seven arrays are contiguous with `len` elements of `dtype`;
    // the kernel guards every access by the array length.
    unsafe { with_float_type!(dtype, launch_as) }
    let [p, m1, m2] = outputs;
    Some((p, m1, m2))
}

/// The element type every tensor shares, if the kernels take it (f32, f16, bf16).
fn kernel_dtype<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) -> Option<DType> {
    let dtype = tensors.first()?.dtype;
    (is_kernel_float(dtype) && tensors.iter().all(|t| t.dtype == dtype)).then_some(dtype)
}
