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
use super::portable::{adamw_update_portable, squared_norm_portable};
use burn_distflash::cube_support::CUBE_UNITS;
use burn_distflash::cube_support::{
    array, contiguous, empty_like, is_kernel_float, vector_size, with_float_type,
};

/// A one-dimensional tensor of a CubeCL backend.
type CubeVector<R, F, I, BT> = Tensor<CubeBackend<R, F, I, BT>, 1>;

/// AdamW's two moments, as [`CubeVector`]s.
type CubeMoments<R, F, I, BT> = (CubeVector<R, F, I, BT>, CubeVector<R, F, I, BT>);

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
    moments: (CubeTensor<R>, CubeTensor<R>),
    step: &AdamWStep,
) -> Option<(CubeTensor<R>, CubeTensor<R>, CubeTensor<R>)> {
    let described = [&param, &grad, &moments.0, &moments.1]
        .map(|t| (t.dtype, t.meta.shape().iter().copied().collect()));
    let dtype = adamw_kernel_dtype(described)?;
    Some(launch_adamw(param, grad, moments, step, dtype))
}

/// [`TrainingKernels::adamw_update`](super::TrainingKernels::adamw_update) on a CubeCL backend:
/// [`launch_adamw`] where the kernel takes the tensors, else the portable passes.
pub(crate) fn adamw_update_cube<R, F, I, BT>(
    param: CubeVector<R, F, I, BT>,
    grad: CubeVector<R, F, I, BT>,
    (moment_1, moment_2): CubeMoments<R, F, I, BT>,
    step: &AdamWStep,
) -> [CubeVector<R, F, I, BT>; 3]
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let described = [&param, &grad, &moment_1, &moment_2].map(|t| (t.dtype(), t.dims().to_vec()));
    let Some(dtype) = adamw_kernel_dtype(described) else {
        return adamw_update_portable(param, grad, (moment_1, moment_2), step);
    };
    let primitive = |t: CubeVector<R, F, I, BT>| t.into_primitive().tensor();
    let moments = (primitive(moment_1), primitive(moment_2));
    let (p, m1, m2) = launch_adamw(primitive(param), primitive(grad), moments, step, dtype);
    [p, m1, m2].map(|t| Tensor::from_primitive(TensorPrimitive::Float(t)))
}

/// The element type of the update's four tensors `(dtype, shape)` when the kernel takes them
/// (one type among f32, f16 and bf16, one shape), `None` otherwise and under
/// `DISTFLASH_UNFUSED_OPTIMIZER=1`.
fn adamw_kernel_dtype(tensors: [(DType, Vec<usize>); 4]) -> Option<DType> {
    let (dtype, shape) = &tensors[0];
    let same = tensors.iter().all(|(d, s)| d == dtype && s == shape);
    (!unfused_optimizer_forced() && is_kernel_float(*dtype) && same).then_some(*dtype)
}

/// The fused AdamW update of four tensors of `dtype` and one shape, in one kernel pass:
/// `(param, moment_1, moment_2)` after the step.
///
/// Each result is written over its input when this call holds the input's only handle
/// (CubeCL's `can_mut`: nothing else can see the buffer change), else into a new tensor: the
/// same kernel, its output aliasing the input, so the numbers are bitwise the same either way.
/// Tensors updated step after step (a sharded optimizer's master weights and moments) thus
/// allocate nothing.
fn launch_adamw<R: CubeRuntime>(
    param: CubeTensor<R>,
    grad: CubeTensor<R>,
    (moment_1, moment_2): (CubeTensor<R>, CubeTensor<R>),
    step: &AdamWStep,
    dtype: DType,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let shape = param.meta.shape().clone();
    let [param, grad, moment_1, moment_2] = [param, grad, moment_1, moment_2].map(contiguous);
    let len = param.meta.num_elements();
    let vector = vector_size(len, dtype);
    let vectors = len / vector;
    // The kernel's inputs in order (param 0, grad 1, moment_1 2, moment_2 3): each result's
    // input and its position, and whether the result may overwrite it (asked before any clone).
    let updated = [(&param, 0), (&moment_1, 2), (&moment_2, 3)];
    let in_place = updated.map(|(input, _)| input.can_mut());
    let outputs = [0, 1, 2].map(|k| match in_place[k] {
        true => updated[k].0.clone(),
        false => empty_like(&param, shape.clone(), dtype),
    });
    // SAFETY: every output is contiguous with `len` elements of `dtype` (an input made
    // contiguous above, or a new tensor); an aliased one is the input at its position.
    let output = |k: usize| match in_place[k] {
        true => ArrayArg::Alias {
            input_pos: updated[k].1,
            length: [len],
        },
        false => unsafe { array(&outputs[k], len) },
    };
    let client = param.client.clone();
    let dim = CubeDim::new_1d(CUBE_UNITS as u32);
    let count = cubecl::calculate_cube_count_elemwise(&client, vectors, dim);
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
                output(0),
                output(1),
                output(2),
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
    // SAFETY: all arrays are contiguous with `len` elements of `dtype`; the kernel guards every
    // access by the array length, and each unit reads element `i` of every input before it
    // writes element `i` of the outputs (an aliased output is never read by another unit).
    unsafe { with_float_type!(dtype, launch_as) }
    let [p, m1, m2] = outputs;
    (p, m1, m2)
}
