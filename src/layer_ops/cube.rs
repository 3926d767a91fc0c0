//! The layer operations on `CubeBackend` tensors: one CubeCL pass each (the norm's backward takes
//! three), or `None` where the kernels do not take the tensors (a float type other than f32, f16
//! and bf16, mismatched shapes or types, a width the vectors cannot split) and the caller runs
//! the portable version. Also `None` under `DISTFLASH_UNFUSED_LAYERS=1`.

use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

use super::kernels::swiglu_forward;
use super::kernels::{rotary as rotary_kernel, swiglu_backward as swiglu_backward_kernel};
use super::norm_kernels::{
    rms_norm_backward_rows, rms_norm_rows, rms_norm_weight_partials, rms_norm_weight_sums,
};
use super::unfused_layers_forced;
use crate::cube_support::{
    array, contiguous, empty_like, is_kernel_float, vector_size, CUBE_UNITS,
};
use crate::with_float_type;

/// Rows of one partial sum of the norm's weight gradient.
const NORM_CHUNK_ROWS: usize = 64;

/// The common float type of `tensors` when the kernels take it and the shapes agree.
fn fused_dtype<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) -> Option<DType> {
    let dtype = tensors[0].dtype;
    let shape = tensors[0].meta.shape();
    let agree = tensors
        .iter()
        .all(|t| t.dtype == dtype && t.meta.shape() == shape);
    (!unfused_layers_forced() && is_kernel_float(dtype) && agree).then_some(dtype)
}

/// One unit per vector of `vectors`.
fn element_grid<R: CubeRuntime>(like: &CubeTensor<R>, vectors: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new_1d(CUBE_UNITS as u32);
    let count = cubecl::calculate_cube_count_elemwise(&like.client, vectors, dim);
    (count, dim)
}

/// One cube per row.
fn row_grid<R: CubeRuntime>(like: &CubeTensor<R>, rows: usize) -> (CubeCount, CubeDim) {
    let count = cubecl::calculate_cube_count_elemwise(&like.client, rows, CubeDim::new_1d(1));
    (count, CubeDim::new_1d(CUBE_UNITS as u32))
}

/// `silu(gate) * up`.
pub(crate) fn swiglu<R: CubeRuntime>(
    gate: CubeTensor<R>,
    up: CubeTensor<R>,
) -> Option<CubeTensor<R>> {
    let dtype = fused_dtype(&[&gate, &up])?;
    let [gate, up] = [gate, up].map(contiguous);
    let len = gate.meta.num_elements();
    let vector = vector_size(len, dtype);
    let hidden = empty_like(&gate, gate.meta.shape().clone(), dtype);
    let (count, dim) = element_grid(&gate, len / vector);
    let client = gate.client.clone();
    macro_rules! launch_as {
        ($F:ty) => {
            swiglu_forward::launch_unchecked::<$F, R>(
                &client,
                count,
                dim,
                vector,
                array(&gate, len),
                array(&up, len),
                array(&hidden, len),
            )
        };
    }
    // SAFETY: the three tensors are contiguous with `len` elements; the kernel guards by length.
    unsafe { with_float_type!(dtype, launch_as) };
    Some(hidden)
}

/// `(hidden, dgate, dup)` of [`swiglu`] for the hidden gradient `dhidden`.
pub(crate) fn swiglu_backward<R: CubeRuntime>(
    gate: CubeTensor<R>,
    up: CubeTensor<R>,
    dhidden: CubeTensor<R>,
) -> Option<[CubeTensor<R>; 3]> {
    let dtype = fused_dtype(&[&gate, &up, &dhidden])?;
    let [gate, up, dhidden] = [gate, up, dhidden].map(contiguous);
    let len = gate.meta.num_elements();
    let vector = vector_size(len, dtype);
    let outputs = [0; 3].map(|_| empty_like(&gate, gate.meta.shape().clone(), dtype));
    let (count, dim) = element_grid(&gate, len / vector);
    let client = gate.client.clone();
    let [hidden, dgate, dup] = &outputs;
    macro_rules! launch_as {
        ($F:ty) => {
            swiglu_backward_kernel::launch_unchecked::<$F, R>(
                &client,
                count,
                dim,
                vector,
                array(&gate, len),
                array(&up, len),
                array(&dhidden, len),
                array(hidden, len),
                array(dgate, len),
                array(dup, len),
            )
        };
    }
    // SAFETY: the six tensors are contiguous with `len` elements; the kernel guards by length.
    unsafe { with_float_type!(dtype, launch_as) };
    Some(outputs)
}

/// `[rows, width]` of a norm's input `[.., width]` whose weight is `[width]` of the same type.
fn norm_rows<R: CubeRuntime>(x: &CubeTensor<R>, weight: &CubeTensor<R>) -> Option<[usize; 2]> {
    let shape = x.meta.shape();
    let width = *shape.last()?;
    let fits = !unfused_layers_forced()
        && is_kernel_float(x.dtype)
        && weight.dtype == x.dtype
        && weight.meta.shape()[..] == [width]
        && width > 0;
    fits.then(|| [x.meta.num_elements() / width, width])
}

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension.
pub(crate) fn rms_norm<R: CubeRuntime>(
    x: CubeTensor<R>,
    weight: CubeTensor<R>,
    eps: f64,
) -> Option<CubeTensor<R>> {
    let [rows, width] = norm_rows(&x, &weight)?;
    let [x, weight] = [x, weight].map(contiguous);
    let dtype = x.dtype;
    let vector = vector_size(width, dtype);
    let out = empty_like(&x, x.meta.shape().clone(), dtype);
    let (count, dim) = row_grid(&x, rows);
    let client = x.client.clone();
    macro_rules! launch_as {
        ($F:ty) => {
            rms_norm_rows::launch_unchecked::<$F, R>(
                &client,
                count,
                dim,
                vector,
                array(&x, rows * width),
                array(&weight, width),
                array(&out, rows * width),
                rows as u32,
                width as u32,
                eps as f32,
            )
        };
    }
    // SAFETY: `x` and `out` are contiguous `[rows, width]`, `weight` `[width]`; extra cubes of the
    // grid return.
    unsafe { with_float_type!(dtype, launch_as) };
    Some(out)
}

/// `(dx, dweight)` of [`rms_norm`] for the output gradient `grad`.
pub(crate) fn rms_norm_backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    weight: CubeTensor<R>,
    grad: CubeTensor<R>,
    eps: f64,
) -> Option<[CubeTensor<R>; 2]> {
    let [rows, width] = norm_rows(&x, &weight)?;
    if grad.dtype != x.dtype || grad.meta.shape() != x.meta.shape() {
        return None;
    }
    let [x, weight, grad] = [x, weight, grad].map(contiguous);
    let dtype = x.dtype;
    let vector = vector_size(width, dtype);
    let vectors = width / vector;
    let chunks = rows.div_ceil(NORM_CHUNK_ROWS);
    let dx = empty_like(&x, x.meta.shape().clone(), dtype);
    let dweight = empty_like(&x, Shape::new([width]), dtype);
    let inverse_rms = empty_like(&x, Shape::new([rows]), DType::F32);
    let partials = empty_like(&x, Shape::new([chunks, width]), DType::F32);
    let client = x.client.clone();
    let (row_count, row_dim) = row_grid(&x, rows);
    let (partial_count, partial_dim) = element_grid(&x, chunks * vectors);
    let (sum_count, sum_dim) = element_grid(&x, vectors);
    macro_rules! launch_as {
        ($F:ty) => {{
            rms_norm_backward_rows::launch_unchecked::<$F, R>(
                &client,
                row_count,
                row_dim,
                vector,
                array(&x, rows * width),
                array(&weight, width),
                array(&grad, rows * width),
                array(&dx, rows * width),
                array(&inverse_rms, rows),
                rows as u32,
                width as u32,
                eps as f32,
            );
            rms_norm_weight_partials::launch_unchecked::<$F, R>(
                &client,
                partial_count,
                partial_dim,
                vector,
                array(&x, rows * width),
                array(&grad, rows * width),
                array(&inverse_rms, rows),
                array(&partials, chunks * width),
                rows as u32,
                width as u32,
                NORM_CHUNK_ROWS as u32,
            );
            rms_norm_weight_sums::launch_unchecked::<$F, R>(
                &client,
                sum_count,
                sum_dim,
                vector,
                array(&partials, chunks * width),
                array(&dweight, width),
                chunks as u32,
            );
        }};
    }
    // SAFETY: `x`, `grad` and `dx` are contiguous `[rows, width]`, `weight` and `dweight`
    // `[width]`, `inverse_rms` `[rows]` and `partials` `[chunks, width]`; the kernels guard by
    // length (extra cubes of the row grid return).
    unsafe { with_float_type!(dtype, launch_as) };
    Some([dx, dweight])
}

/// The rotary embedding (or its adjoint) of `x` `[batch, heads, len, head_dim]`, any strides
/// with a contiguous last dimension, with tables `cos`, `sin` `[1, 1, len, head_dim]`; the result
/// is contiguous.
pub(crate) fn rotary<R: CubeRuntime>(
    x: CubeTensor<R>,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
    transpose: bool,
) -> Option<CubeTensor<R>> {
    let shape = x.meta.shape().clone();
    let &[batch, heads, len, head_dim] = &shape[..] else {
        return None;
    };
    let dtype = fused_dtype(&[&cos, &sin])?;
    let strides = x.meta.strides().to_vec();
    let fits = x.dtype == dtype
        && cos.meta.shape()[..] == [1, 1, len, head_dim]
        && head_dim % 2 == 0
        && strides[3] == 1;
    if !fits || shape.iter().any(|&d| d == 0) {
        return None;
    }
    let [cos, sin] = [cos, sin].map(contiguous);
    let vector = [head_dim / 2, strides[0], strides[1], strides[2]]
        .iter()
        .fold(vector_size(head_dim / 2, dtype), |v, &s| {
            if s % v == 0 {
                v
            } else {
                1
            }
        });
    // Elements from the view's start to one past its last element.
    let extent = 1 + (0..4).map(|d| (shape[d] - 1) * strides[d]).sum::<usize>();
    let out = empty_like(&x, shape.clone(), dtype);
    let total = batch * heads * len * head_dim;
    let (count, dim) = element_grid(&x, total / vector);
    let client = x.client.clone();
    macro_rules! launch_as {
        ($F:ty) => {
            rotary_kernel::launch_unchecked::<$F, R>(
                &client,
                count,
                dim,
                vector,
                array(&x, extent),
                array(&cos, len * head_dim),
                array(&sin, len * head_dim),
                array(&out, total),
                heads as u32,
                len as u32,
                head_dim as u32,
                strides[0] as u32,
                strides[1] as u32,
                strides[2] as u32,
                transpose,
            )
        };
    }
    // SAFETY: every element the kernel reads from `x` lies within `extent` of the view's start
    // (the strides are the view's own and `N` divides them), the tables are contiguous
    // `[len, head_dim]`, `out` contiguous with `total` elements; the kernel guards by length.
    unsafe { with_float_type!(dtype, launch_as) };
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Tensor, TensorData};

    type Wgpu = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;

    fn tensor<const D: usize>(shape: [usize; D]) -> CubeTensor<cubecl::wgpu::WgpuRuntime> {
        let n = shape.iter().product::<usize>();
        let values: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
        Tensor::<Wgpu, D>::from_data(TensorData::new(values, shape), &Default::default())
            .into_primitive()
            .tensor()
    }

    /// The integration tests compare results only; this checks that the kernels, not the
    /// portable fallback, produced them, and that mismatched inputs fall back.
    #[test]
    fn kernels_take_the_layers_tensors_and_refuse_mismatches() {
        let (a, b) = (tensor([1, 3, 8]), tensor([1, 3, 8]));
        assert!(swiglu(a.clone(), b.clone()).is_some());
        assert!(swiglu_backward(a.clone(), b.clone(), a.clone()).is_some());
        assert!(swiglu(a.clone(), tensor([1, 3, 4])).is_none());
        let weight = tensor([8]);
        assert!(rms_norm(a.clone(), weight.clone(), 1e-5).is_some());
        assert!(rms_norm_backward(a.clone(), weight, b, 1e-5).is_some());
        assert!(rms_norm(a.clone(), tensor([4]), 1e-5).is_none());
        let table = tensor([1, 1, 3, 8]);
        let strided =
            Tensor::<Wgpu, 4>::from_primitive(burn::tensor::TensorPrimitive::Float(tensor([
                1, 3, 2, 8,
            ])))
            .swap_dims(1, 2)
            .into_primitive()
            .tensor();
        assert!(rotary(strided, table.clone(), table.clone(), false).is_some());
        assert!(rotary(tensor([1, 2, 3, 8]), tensor([1, 1, 3, 4]), table, true).is_none());
    }
}
