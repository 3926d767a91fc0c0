//! Step-by-step attention: the running softmax state ([`AttentionState`]) that
//! [`AttentionBackend`](crate::AttentionBackend)'s step methods (`attention_state_empty`,
//! `attention_forward_step`, `attention_merge`, `attention_finalize`, `attention_backward_step`)
//! take and return; sequence-parallel attention is built from them. A step takes the same
//! [`FlashAttentionOptions`](crate::FlashAttentionOptions) as a one-shot call, its mask at the
//! step's chunks' absolute offsets ([`Mask::at`](crate::Mask::at)).
//!
//! The state's operations from tensor operations (empty, merge, finalize, delta) are the
//! trait's defaults, which every backend gets; the CubeCL backends override them with the
//! kernels. The tensor-op forward step is in the crate's `attention_tensor_ops` module.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, Tensor, TensorPrimitive};

/// Running state of a block of query rows, all f32 where the backend allows: `o`
/// (unnormalised output, `[B, H, S, D]`), `m` (running max) and `l` (running sum), `[B, H, S]`.
#[derive(Debug, Clone)]
pub struct AttentionState<B: Backend> {
    /// Unnormalised output.
    pub o: FloatTensor<B>,
    /// Running max of the scores seen.
    pub m: FloatTensor<B>,
    /// Running sum of `exp(score - m)`.
    pub l: FloatTensor<B>,
}

fn t4<B: Backend>(p: FloatTensor<B>) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}
fn t3<B: Backend>(p: FloatTensor<B>) -> Tensor<B, 3> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}
fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// Factor rescaling a state relative to `old` so it is relative to `new >= old`; 1 where both
/// are `-inf` (an empty row stays empty).
fn rescale<B: Backend>(old: Tensor<B, 3>, new: Tensor<B, 3>) -> Tensor<B, 3> {
    let floor = -1e30;
    (old.clamp_min(floor) - new.clamp_min(floor)).exp()
}

/// An empty state (`o = 0, m = -inf, l = 0`) for `[batch, heads, len, head_dim]`.
pub fn empty<B: Backend>(shape: [usize; 4], dtype: DType, device: &B::Device) -> AttentionState<B> {
    let [b, h, s, _] = shape;
    AttentionState {
        o: prim(Tensor::<B, 4>::zeros(shape, (device, dtype))),
        m: prim(Tensor::<B, 3>::full(
            [b, h, s],
            f64::NEG_INFINITY,
            (device, dtype),
        )),
        l: prim(Tensor::<B, 3>::zeros([b, h, s], (device, dtype))),
    }
}

/// Merges two partial states of the same rows.
pub fn merge<B: Backend>(a: AttentionState<B>, b: AttentionState<B>) -> AttentionState<B> {
    let (ma, mb) = (t3::<B>(a.m), t3::<B>(b.m));
    let m = ma.clone().max_pair(mb.clone());
    let (wa, wb) = (rescale(ma, m.clone()), rescale(mb, m.clone()));
    AttentionState {
        o: prim(
            t4::<B>(a.o) * wa.clone().unsqueeze_dim::<4>(3)
                + t4::<B>(b.o) * wb.clone().unsqueeze_dim::<4>(3),
        ),
        l: prim(t3::<B>(a.l) * wa + t3::<B>(b.l) * wb),
        m: prim(m),
    }
}

/// `(O, lse)` from a finished state, O in float type `output` (lse in the state's); rows that
/// saw no key give `O = 0`, `lse = -inf`.
pub fn finalize<B: Backend>(
    state: AttentionState<B>,
    output: DType,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (m, l) = (t3::<B>(state.m), t3::<B>(state.l));
    let mut out = t4::<B>(state.o) / l.clone().clamp_min(1e-30).unsqueeze_dim::<4>(3);
    if out.dtype() != output {
        out = out.cast(FloatDType::from(output));
    }
    let lse = m.clamp_min(-1e30) + l.log();
    (prim(out), prim(lse))
}

/// `delta = rowsum(dO * O)`, `[B, H, S]`.
pub fn delta<B: Backend>(out: FloatTensor<B>, grad_out: FloatTensor<B>) -> FloatTensor<B> {
    prim(
        (t4::<B>(grad_out) * t4::<B>(out))
            .sum_dim(3)
            .squeeze_dim::<3>(3),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_ndarray::NdArray;

    #[test]
    fn finalize_writes_the_output_in_the_float_type_asked_for() {
        let device = Default::default();
        let state = empty::<NdArray<f32>>([1, 2, 3, 4], DType::F32, &device);
        let (out, lse) = finalize::<NdArray<f32>>(state.clone(), DType::F64);
        assert_eq!(t4::<NdArray<f32>>(out).dtype(), DType::F64);
        assert_eq!(t3::<NdArray<f32>>(lse).dtype(), DType::F32);
        let (out, _) = finalize::<NdArray<f32>>(state, DType::F32);
        assert_eq!(t4::<NdArray<f32>>(out).dtype(), DType::F32);
    }
}
