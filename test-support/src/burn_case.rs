//! The Burn-op checks shared by the test binaries, against the f64 reference: one-shot (forward
//! output and the gradients of `sum(O * dO)` through `Autodiff`) and stepped (the step
//! operations chunk by chunk, and the accumulating backward step block by block:
//! [`accumulating_steps`]).

use crate::attention as oracle;
use crate::{assert_close, exact, naive_rounding, Rng};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor, TensorData};
use burn_distflash::{flash_attention_with_lse, FlashAttentionBackend, FlashAttentionOptions};
use distflash_kernels::{AttentionDims, ElemType, Mask};

pub mod accumulating_steps;
use accumulating_steps::{check_accumulating_steps, BackwardInputs};

/// Host values as a tensor of `B`'s default float type on `device`.
pub fn to_tensor<B: Backend>(data: &[f64], shape: [usize; 4], device: &B::Device) -> Tensor<B, 4> {
    let values: Vec<f32> = data.iter().map(|&x| x as f32).collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// Host data as a tensor of float type `dtype`, whatever the device's default.
pub fn typed_tensor<B: Backend>(
    data: &[f64],
    shape: [usize; 4],
    device: &B::Device,
    dtype: DType,
) -> Tensor<B, 4> {
    let values: Vec<f32> = data.iter().map(|&x| x as f32).collect();
    Tensor::from_data(TensorData::new(values, shape), (device, dtype))
}

/// The Burn float type of a kernel element type.
pub fn dtype_of(elem: ElemType) -> DType {
    match elem {
        ElemType::F16 => DType::F16,
        ElemType::BF16 => DType::BF16,
        ElemType::F32 => DType::F32,
    }
}

/// A tensor's values on the host, as f64.
pub fn to_host<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f64> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|&x| x as f64)
        .collect()
}

/// One problem's dimensions and host data (q, k, v, dO), already rounded to its element type.
pub struct HostCase {
    /// The call's dimensions.
    pub dims: AttentionDims,
    /// `[batch, q_heads, q_len, head_dim]`.
    pub q_shape: [usize; 4],
    /// `[batch, kv_heads, kv_len, head_dim]`.
    pub kv_shape: [usize; 4],
    /// Queries, row-major in `q_shape`.
    pub q: Vec<f64>,
    /// Keys, row-major in `kv_shape`.
    pub k: Vec<f64>,
    /// Values, row-major in `kv_shape`.
    pub v: Vec<f64>,
    /// The output gradient, row-major in `q_shape`.
    pub dout: Vec<f64>,
}

impl HostCase {
    /// Random data from `seed` for the given heads and lengths, rounded to `elem`.
    pub fn new(
        seed: u64,
        elem: ElemType,
        (batch, q_heads, kv_heads): (usize, usize, usize),
        (q_len, kv_len, head_dim): (usize, usize, usize),
    ) -> Self {
        let q_shape = [batch, q_heads, q_len, head_dim];
        let kv_shape = [batch, kv_heads, kv_len, head_dim];
        let dims = AttentionDims::from_qkv(&q_shape, &kv_shape, &kv_shape).expect("a valid case");
        let (nq, nkv) = (q_shape.iter().product(), kv_shape.iter().product());
        let mut rng = Rng::new(seed);
        Self {
            dims,
            q_shape,
            kv_shape,
            q: rng.tensor(nq, 2.0, elem),
            k: rng.tensor(nkv, 2.0, elem),
            v: rng.tensor(nkv, 1.0, elem),
            dout: rng.tensor(nq, 1.0, elem),
        }
    }

    /// [`expected`] for this case.
    pub fn expected(&self, mask: &Mask, elem: ElemType) -> Expected {
        let scale = 1.0 / (self.dims.head_dim as f64).sqrt();
        let data = (&self.q[..], &self.k[..], &self.v[..], &self.dout[..]);
        expected(&self.dims, data, mask, scale, elem)
    }
}

/// The exact reference and the naive low-precision computation, forward and backward.
pub struct Expected {
    /// The exact forward (f64).
    pub fwd: oracle::ReferenceForward,
    /// The forward computed naively in the element type's precision.
    pub naive_fwd: oracle::ReferenceForward,
    /// The exact gradients (f64).
    pub grads: oracle::ReferenceGrads,
    /// The gradients computed naively in the element type's precision.
    pub naive_grads: oracle::ReferenceGrads,
}

/// [`Expected`] for host data `(q, k, v, dO)`.
pub fn expected(
    dims: &AttentionDims,
    (q, k, v, dout): (&[f64], &[f64], &[f64], &[f64]),
    mask: &Mask,
    scale: f64,
    elem: ElemType,
) -> Expected {
    let naive = naive_rounding(elem);
    Expected {
        fwd: oracle::forward(dims, q, k, v, mask, scale, exact),
        naive_fwd: oracle::forward(dims, q, k, v, mask, scale, naive),
        grads: oracle::backward(dims, q, k, v, dout, mask, scale, exact),
        naive_grads: oracle::backward(dims, q, k, v, dout, mask, scale, naive),
    }
}

/// Forward output and gradients of `sum(O * dO)` against the reference, for one shape.
pub fn check_case<B: AutodiffBackend + FlashAttentionBackend>(
    device: &B::Device,
    elem: ElemType,
    heads: (usize, usize, usize),
    lens: (usize, usize, usize),
    causal: bool,
) {
    let options = match causal {
        true => FlashAttentionOptions::causal(),
        false => FlashAttentionOptions::default(),
    };
    check_options_case::<B>(device, elem, heads, lens, &options);
}

/// Forward output, lse and gradients of `sum(O * dO)` against the reference, for one shape and
/// any options (the reference applies `options.mask`).
pub fn check_options_case<B: AutodiffBackend + FlashAttentionBackend>(
    device: &B::Device,
    elem: ElemType,
    (batch, q_heads, kv_heads): (usize, usize, usize),
    (q_len, kv_len, head_dim): (usize, usize, usize),
    options: &FlashAttentionOptions,
) {
    let case = HostCase::new(
        q_len as u64 * 31 + kv_len as u64,
        elem,
        (batch, q_heads, kv_heads),
        (q_len, kv_len, head_dim),
    );
    let (dims, q_shape, kv_shape) = (case.dims, case.q_shape, case.kv_shape);
    let dtype = dtype_of(elem);
    let q = typed_tensor::<B>(&case.q, q_shape, device, dtype).require_grad();
    let k = typed_tensor::<B>(&case.k, kv_shape, device, dtype).require_grad();
    let v = typed_tensor::<B>(&case.v, kv_shape, device, dtype).require_grad();
    let (out, lse) =
        flash_attention_with_lse(q.clone(), k.clone(), v.clone(), options.clone()).unwrap();
    assert_eq!(out.dtype(), dtype, "output type");
    let loss = (out.clone() * typed_tensor::<B>(&case.dout, q_shape, device, dtype)).sum();
    let grads = loss.backward();

    let mask = &options.mask;
    let Expected {
        fwd,
        naive_fwd,
        grads: g,
        naive_grads: naive_g,
    } = case.expected(mask, elem);
    let what = format!("{} {dims:?} {options:?}", std::any::type_name::<B>());
    assert_close(
        &format!("{what}: O"),
        &to_host(out),
        &fwd.out,
        &naive_fwd.out,
        elem,
    );
    assert_close(
        &format!("{what}: lse"),
        &to_host(lse),
        &fwd.lse,
        &naive_fwd.lse,
        elem,
    );
    for (name, t, exact_g, naive_g) in [
        ("dq", &q, &g.dq, &naive_g.dq),
        ("dk", &k, &g.dk, &naive_g.dk),
        ("dv", &v, &g.dv, &naive_g.dv),
    ] {
        let grad = t
            .grad(&grads)
            .unwrap_or_else(|| panic!("{what}: no gradient for {name}"));
        assert_close(
            &format!("{what}: {name}"),
            &to_host(grad),
            exact_g,
            naive_g,
            elem,
        );
    }
}

/// [`check_case`] over the shapes every backend is checked on (GQA and MQA, causal and full,
/// odd lengths).
pub fn check_backend<B: AutodiffBackend + FlashAttentionBackend>(
    device: &B::Device,
    elem: ElemType,
) {
    for causal in [true, false] {
        check_case::<B>(device, elem, (1, 4, 2), (45, 45, 64), causal);
        check_case::<B>(device, elem, (2, 2, 1), (33, 70, 128), causal);
    }
}

/// The step operations chunk by chunk (stepping and merging; per-pair backward steps) against
/// the f64 reference, with keys split into chunks at absolute offsets and a causal mask whose
/// queries start at position 100.
pub fn check_steps<B: FlashAttentionBackend>(device: &B::Device, elem: ElemType) {
    let mask = Mask::causal().at(100, 0);
    check_steps_case::<B>(device, elem, (1, 4, 2), (77, 150, 64), mask);
}

/// The step operations on one shape: keys split into three chunks at absolute offsets (`mask`
/// gives the queries' offset), stepped into one state and merged from independent partials,
/// then the backward step per chunk and the accumulating backward step per block of query and
/// key rows ([`check_accumulating_steps`]), all against the f64 reference.
pub fn check_steps_case<B: FlashAttentionBackend>(
    device: &B::Device,
    elem: ElemType,
    (batch, q_heads, kv_heads): (usize, usize, usize),
    (q_len, kv_len, head_dim): (usize, usize, usize),
    mask: Mask,
) {
    use burn::tensor::TensorPrimitive;
    let case = HostCase::new(
        99 + q_len as u64 * 7 + head_dim as u64,
        elem,
        (batch, q_heads, kv_heads),
        (q_len, kv_len, head_dim),
    );
    let (dims, q_shape, kv_shape) = (case.dims, case.q_shape, case.kv_shape);
    let dtype = dtype_of(elem);
    let make = |d: &[f64], s: [usize; 4]| typed_tensor::<B>(d, s, device, dtype);
    let (q, k, v, dout) = (
        make(&case.q, q_shape),
        make(&case.k, kv_shape),
        make(&case.v, kv_shape),
        make(&case.dout, q_shape),
    );
    let prim = |t: Tensor<B, 4>| t.into_primitive().tensor();
    let bounds = [0, kv_len / 3, kv_len];
    let chunk = |t: &Tensor<B, 4>, a: usize, b: usize| {
        t.clone().slice([0..batch, 0..kv_heads, a..b, 0..head_dim])
    };
    let options = FlashAttentionOptions::masked(mask.clone());
    let step = |a: usize| options.clone().at(mask.q_offset, a as i64);

    let mut stepped = B::attention_state_empty(q_shape, dtype, device);
    let mut merged = B::attention_state_empty(q_shape, dtype, device);
    for w in bounds.windows(2) {
        let (kc, vc) = (prim(chunk(&k, w[0], w[1])), prim(chunk(&v, w[0], w[1])));
        stepped =
            B::attention_forward_step(prim(q.clone()), kc.clone(), vc.clone(), stepped, step(w[0]));
        let partial = B::attention_forward_step(
            prim(q.clone()),
            kc,
            vc,
            B::attention_state_empty(q_shape, dtype, device),
            step(w[0]),
        );
        merged = B::attention_merge(merged, partial);
    }
    let expected = case.expected(&mask, elem);
    let Expected {
        fwd,
        naive_fwd: naive,
        grads: g,
        naive_grads: ng,
    } = &expected;
    let host = |p: burn::tensor::ops::FloatTensor<B>| -> Vec<f64> {
        to_host(Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(p)))
    };
    let host3 = |p: burn::tensor::ops::FloatTensor<B>| -> Vec<f64> {
        to_host(Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(p)))
    };
    let (out, lse) = B::attention_finalize(stepped, dtype);
    let (merged_out, _) = B::attention_finalize(merged, dtype);
    let what = format!("{} {dims:?} {mask:?}", std::any::type_name::<B>());
    assert_close(
        &format!("{what} steps: O"),
        &host(out.clone()),
        &fwd.out,
        &naive.out,
        elem,
    );
    assert_close(
        &format!("{what} merged: O"),
        &host(merged_out),
        &fwd.out,
        &naive.out,
        elem,
    );
    assert_close(
        &format!("{what} steps: lse"),
        &host3(lse.clone()),
        &fwd.lse,
        &fwd.lse,
        elem,
    );

    let delta = B::attention_delta(out, prim(dout.clone()));
    let mut dq = vec![0.0; case.q.len()];
    let (mut dk, mut dv) = (vec![0.0; case.k.len()], vec![0.0; case.v.len()]);
    for w in bounds.windows(2) {
        let (gq, gk, gv) = B::attention_backward_step(
            prim(q.clone()),
            prim(chunk(&k, w[0], w[1])),
            prim(chunk(&v, w[0], w[1])),
            prim(dout.clone()),
            lse.clone(),
            delta.clone(),
            step(w[0]),
        );
        dq.iter_mut().zip(host(gq)).for_each(|(a, b)| *a += b);
        let rows = (w[1] - w[0]) * head_dim;
        for (full, part) in [(&mut dk, host(gk)), (&mut dv, host(gv))] {
            for bh in 0..batch * kv_heads {
                let dst = (bh * kv_len + w[0]) * head_dim;
                full[dst..dst + rows].copy_from_slice(&part[bh * rows..(bh + 1) * rows]);
            }
        }
    }
    assert_close(&format!("{what} steps: dq"), &dq, &g.dq, &ng.dq, elem);
    assert_close(&format!("{what} steps: dk"), &dk, &g.dk, &ng.dk, elem);
    assert_close(&format!("{what} steps: dv"), &dv, &g.dv, &ng.dv, elem);
    let inputs = BackwardInputs {
        q,
        k,
        v,
        dout,
        lse,
        delta,
    };
    check_accumulating_steps::<B>(device, elem, &case, &inputs, (&mask, &bounds), &expected);
}
