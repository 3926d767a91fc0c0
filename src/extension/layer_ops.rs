//! The layer-operation capability of a backend: the linear layers' product and the element-wise
//! parts of a Llama block (SwiGLU, RMS norm, the rotary embedding) with their backwards.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::layer_ops;
use crate::matmul::{product, Transposed};

/// The operations the layers are made of besides attention. The defaults are Burn tensor
/// operations (cuBLAS for the product on CUDA `CubeBackend` tensors); `CubeBackend` runs each
/// element-wise operation as one CubeCL pass, and `Autodiff` makes each one graph node whose
/// backward runs the backend's backward operation.
pub trait LayerOpsBackend: Backend {
    /// `x W` of a linear layer. cuBLAS on CUDA `CubeBackend` tensors (feature `cublas`;
    /// contiguous f32/f16/bf16 operands), Burn's `matmul` elsewhere; on `Autodiff` one node whose
    /// backward products take the same path.
    ///
    /// # Shapes
    ///
    /// - x: `[rows, d_in]`
    /// - weight: `[d_in, d_out]`
    /// - output: `[rows, d_out]`
    fn linear_product(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::matrix_product(x, weight, Transposed::Neither)
    }

    /// The product of two matrices as `transposed` says (the linear layers' forward and
    /// backward products, outside any autodiff graph): cuBLAS on CUDA `CubeBackend` tensors,
    /// Burn's `matmul` on row-major copies elsewhere; `Fusion<B>` runs it on `B` as a custom
    /// operation of the fusion stream, never through Burn's fused matmul.
    ///
    /// # Shapes
    ///
    /// As [`Transposed`] says: `[m, k]` or `[k, m]` times `[k, n]` or `[n, k]`, giving `[m, n]`.
    fn matrix_product(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        transposed: Transposed,
    ) -> FloatTensor<Self> {
        let wrap = |t| Tensor::<Self, 2>::from_primitive(TensorPrimitive::Float(t));
        product(wrap(lhs), wrap(rhs), transposed)
            .into_primitive()
            .tensor()
    }

    /// `silu(gate) * up` (SwiGLU's hidden activation), `gate` and `up` of one shape and float
    /// type. One CubeCL pass on `CubeBackend` (computing in f32), Burn tensor operations elsewhere.
    ///
    /// # Shapes
    ///
    /// - gate, up: `[batch, seq, d_ff]`
    /// - output: `[batch, seq, d_ff]`
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        layer_ops::tensor_ops::swiglu::<Self>(gate, up)
    }

    /// `(hidden, dgate, dup)` of [`swiglu`](Self::swiglu) for the hidden gradient `dhidden`:
    /// the activation recomputed (the down projection's weight gradient needs it) and the
    /// gradients of `gate` and `up`.
    ///
    /// # Shapes
    ///
    /// - gate, up, dhidden: `[batch, seq, d_ff]`
    /// - hidden, dgate, dup: `[batch, seq, d_ff]`
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        dhidden: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        layer_ops::tensor_ops::swiglu_backward::<Self>(gate, up, dhidden)
    }

    /// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension of `x`, statistics in f32,
    /// the result in `x`'s float type.
    ///
    /// # Shapes
    ///
    /// - x: `[batch, seq, d]`
    /// - weight: `[d]`
    /// - output: `[batch, seq, d]`
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        layer_ops::tensor_ops::rms_norm::<Self>(x, weight, eps)
    }

    /// `(dx, dweight)` of [`rms_norm`](Self::rms_norm) at `x` for the output gradient `grad`.
    ///
    /// # Shapes
    ///
    /// - x, grad: `[batch, seq, d]`
    /// - weight: `[d]`
    /// - dx: `[batch, seq, d]`; dweight: `[d]`
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        layer_ops::tensor_ops::rms_norm_backward::<Self>(x, weight, grad, eps)
    }

    /// The rotary embedding of `x` with tables `cos`, `sin`: `x cos + rotate_half(x) sin`,
    /// `rotate_half([x1, x2]) = [-x2, x1]`; with `transpose` its adjoint (the rotation by the
    /// opposite angle, which maps the rotated tensor's gradient to the input's). `x` may be a
    /// strided view; the result is contiguous.
    ///
    /// # Shapes
    ///
    /// - x: `[batch, heads, len, head_dim]`
    /// - cos, sin: `[1, 1, len, head_dim]`
    /// - output: `[batch, heads, len, head_dim]`
    fn rotary(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        transpose: bool,
    ) -> FloatTensor<Self> {
        layer_ops::tensor_ops::rotary::<Self>(x, cos, sin, transpose)
    }
}
