//! Step-by-step attention: the running softmax state ([`AttentionState`]) that
//! [`AttentionBackend`](crate::AttentionBackend)'s step methods (`attention_state_empty`,
//! `attention_forward_step`, `attention_merge`, `attention_finalize`, `attention_backward_step`,
//! `attention_backward_step_add`) take and return, and where a backward step's rows sit in the
//! gradient accumulators it adds into ([`StepRows`]); sequence-parallel attention is built from
//! them. A step takes the same
//! [`FlashAttentionOptions`](crate::FlashAttentionOptions) as a one-shot call, its mask at the
//! step's chunks' absolute offsets ([`Mask::at`](crate::Mask::at)).
//!
//! The state's operations from tensor operations (empty, merge, finalize, delta, adding a step's
//! gradients into rows of the accumulators) are the trait's defaults, which every backend gets; the CubeCL backends override them with the
//! kernels. The tensor-op forward step is in the crate's `attention_tensor_ops` module.

use core::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, Slice, Tensor, TensorMetadata, TensorPrimitive};

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

/// Where one backward step's rows sit in the f32 gradient accumulators it adds into, along the
/// sequence dimension (2) of `[batch, heads, seq, head_dim]`: the step's query rows are rows
/// `query` of the dq accumulator, its key/value rows rows `kv` of the dk and dv accumulators.
/// Ranges that cover an accumulator's every row name the accumulator itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepRows {
    /// Rows of the dq accumulator the step's query rows are.
    pub query: Range<usize>,
    /// Rows of the dk and dv accumulators the step's key/value rows are.
    pub kv: Range<usize>,
}

impl StepRows {
    /// Steps whose rows are the accumulators' every row: `query_len` query rows, `kv_len`
    /// key/value rows.
    pub fn whole(query_len: usize, kv_len: usize) -> Self {
        Self {
            query: 0..query_len,
            kv: 0..kv_len,
        }
    }
}

/// Whether `rows` are all of `t`'s rows (dimension 2).
pub(crate) fn covers<B: Backend>(t: &FloatTensor<B>, rows: &Range<usize>) -> bool {
    rows.start == 0 && rows.end == t.shape()[2]
}

/// The slices selecting rows `rows` (dimension 2) of `t`.
pub(crate) fn row_slices<B: Backend>(t: &FloatTensor<B>, rows: &Range<usize>) -> Vec<Slice> {
    (t.shape().iter().enumerate())
        .map(|(d, &n)| match d {
            2 => Slice::new(rows.start as isize, Some(rows.end as isize), 1),
            _ => Slice::new(0, Some(n as isize), 1),
        })
        .collect()
}

/// `t` as `chunks` slices of equal length along dimension 2, in order (`t` itself for one
/// chunk): the default of `attention_chunks`.
pub(crate) fn chunk_slices<B: Backend>(t: FloatTensor<B>, chunks: usize) -> Vec<FloatTensor<B>> {
    if chunks == 1 {
        return vec![t];
    }
    let len = t.shape()[2] / chunks;
    (0..chunks)
        .map(|c| B::float_slice(t.clone(), &row_slices::<B>(&t, &(c * len..(c + 1) * len))))
        .collect()
}

/// `grad` (as f32) added into rows `rows` of the f32 accumulator `acc`: in place where the
/// backend allows, when the caller holds `acc` alone.
pub(crate) fn add_into_rows<B: Backend>(
    acc: FloatTensor<B>,
    rows: &Range<usize>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let grad = match grad.dtype() {
        DType::F32 => grad,
        _ => B::float_cast(grad, FloatDType::F32),
    };
    if covers::<B>(&acc, rows) {
        return B::float_add(acc, grad);
    }
    let slices = row_slices::<B>(&acc, rows);
    let sum = B::float_add(B::float_slice(acc.clone(), &slices), grad);
    B::float_slice_assign(acc, &slices, sum)
}

/// A backward step's `(dq, dk, dv)` added into rows `rows` of the f32 accumulators `acc`
/// (see [`StepRows`]): the default of `attention_backward_step_add`.
pub fn add_step_grads<B: Backend>(
    (dq, dk, dv): (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>),
    rows: &StepRows,
    (gq, gk, gv): (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>),
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    (
        add_into_rows::<B>(dq, &rows.query, gq),
        add_into_rows::<B>(dk, &rows.kv, gk),
        add_into_rows::<B>(dv, &rows.kv, gv),
    )
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
