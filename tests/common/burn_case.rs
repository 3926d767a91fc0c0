//! The Burn-op check shared by the per-precision test binaries: forward output and the gradients
//! of `sum(O * dO)` through `Autodiff`, against the f64 reference.
#![allow(dead_code)]

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_distflash::{flash_attention, FlashAttentionBackend, FlashAttentionOptions};
use distflash_kernels::reference::{self, exact};
use distflash_kernels::{AttentionDims, ElemType, Mask};

use super::{assert_close, naive_rounding, Rng};

/// Host values as a tensor of `B` on `device`.
pub fn to_tensor<B: burn::tensor::backend::Backend>(
    data: &[f64],
    shape: [usize; 4],
    device: &B::Device,
) -> Tensor<B, 4> {
    let values: Vec<f32> = data.iter().map(|&x| x as f32).collect();
    Tensor::from_data(TensorData::new(values, shape), device)
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

/// The exact reference and the naive low-precision computation, forward and backward.
pub struct Expected {
    pub fwd: reference::ReferenceForward,
    pub naive_fwd: reference::ReferenceForward,
    pub grads: reference::ReferenceGrads,
    pub naive_grads: reference::ReferenceGrads,
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
        fwd: reference::forward(dims, q, k, v, mask, scale, exact),
        naive_fwd: reference::forward(dims, q, k, v, mask, scale, naive),
        grads: reference::backward(dims, q, k, v, dout, mask, scale, exact),
        naive_grads: reference::backward(dims, q, k, v, dout, mask, scale, naive),
    }
}

/// Forward output and gradients of `sum(O * dO)` against the reference, for one shape.
pub fn check_case<B: AutodiffBackend + FlashAttentionBackend>(
    device: &B::Device,
    elem: ElemType,
    (batch, q_heads, kv_heads): (usize, usize, usize),
    (q_len, kv_len, head_dim): (usize, usize, usize),
    causal: bool,
) {
    let dims = AttentionDims {
        batch,
        q_heads,
        kv_heads,
        q_len,
        kv_len,
        head_dim,
    };
    let mut rng = Rng::new(q_len as u64 * 31 + kv_len as u64);
    let q_shape = [batch, q_heads, q_len, head_dim];
    let kv_shape = [batch, kv_heads, kv_len, head_dim];
    let n = |s: [usize; 4]| s.iter().product::<usize>();
    let (hq, hk, hv, hdo) = (
        rng.tensor(n(q_shape), 2.0, elem),
        rng.tensor(n(kv_shape), 2.0, elem),
        rng.tensor(n(kv_shape), 1.0, elem),
        rng.tensor(n(q_shape), 1.0, elem),
    );
    let q = to_tensor::<B>(&hq, q_shape, device).require_grad();
    // Burn 0.21 keeps a default float type per device: the first backend type that touches a
    // device fixes it for the whole process. Make sure this test runs the precision it claims.
    let expected_dtype = match elem {
        ElemType::F16 => DType::F16,
        ElemType::BF16 => DType::BF16,
        ElemType::F32 => DType::F32,
    };
    assert_eq!(
        q.dtype(),
        expected_dtype,
        "tensors were created as {:?}",
        q.dtype()
    );
    let k = to_tensor::<B>(&hk, kv_shape, device).require_grad();
    let v = to_tensor::<B>(&hv, kv_shape, device).require_grad();
    let options = FlashAttentionOptions {
        causal,
        scale: None,
    };
    let out = flash_attention(q.clone(), k.clone(), v.clone(), options).unwrap();
    let loss = (out.clone() * to_tensor::<B>(&hdo, q_shape, device)).sum();
    let grads = loss.backward();

    let mask = if causal { Mask::causal() } else { Mask::None };
    let scale = 1.0 / (head_dim as f64).sqrt();
    let Expected {
        fwd,
        naive_fwd,
        grads: g,
        naive_grads: naive_g,
    } = expected(&dims, (&hq, &hk, &hv, &hdo), &mask, scale, elem);
    let what = format!("{} {dims:?} causal={causal}", std::any::type_name::<B>());
    assert_close(
        &format!("{what}: O"),
        &to_host(out),
        &fwd.out,
        &naive_fwd.out,
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
    use burn::tensor::TensorPrimitive;
    use burn_distflash::StepMask;
    let dims = AttentionDims {
        batch: 1,
        q_heads: 4,
        kv_heads: 2,
        q_len: 77,
        kv_len: 150,
        head_dim: 64,
    };
    let mask = Mask::Causal {
        q_offset: 100,
        kv_offset: 0,
    };
    let mut rng = Rng::new(99);
    let (q_shape, kv_shape) = ([1, 4, 77, 64], [1, 2, 150, 64]);
    let (hq, hk, hv, hdo) = (
        rng.tensor(4 * 77 * 64, 2.0, elem),
        rng.tensor(2 * 150 * 64, 2.0, elem),
        rng.tensor(2 * 150 * 64, 1.0, elem),
        rng.tensor(4 * 77 * 64, 1.0, elem),
    );
    let make = |d: &[f64], s: [usize; 4]| -> Tensor<B, 4> {
        Tensor::from_data(
            TensorData::new(d.iter().map(|&x| x as f32).collect::<Vec<_>>(), s),
            device,
        )
    };
    let (q, k, v, dout) = (
        make(&hq, q_shape),
        make(&hk, kv_shape),
        make(&hv, kv_shape),
        make(&hdo, q_shape),
    );
    let prim = |t: Tensor<B, 4>| t.into_primitive().tensor();
    let bounds = [0usize, 50, 150];
    let chunk = |t: &Tensor<B, 4>, a: usize, b: usize| t.clone().slice([0..1, 0..2, a..b, 0..64]);
    let step = |a: usize| StepMask {
        mask: Mask::Causal {
            q_offset: 100,
            kv_offset: a as i64,
        },
        scale: None,
    };

    let mut stepped = B::attention_state_empty(q_shape, q.dtype(), device);
    let mut merged = B::attention_state_empty(q_shape, q.dtype(), device);
    for w in bounds.windows(2) {
        let (kc, vc) = (prim(chunk(&k, w[0], w[1])), prim(chunk(&v, w[0], w[1])));
        stepped =
            B::attention_forward_step(prim(q.clone()), kc.clone(), vc.clone(), stepped, step(w[0]));
        let partial = B::attention_forward_step(
            prim(q.clone()),
            kc,
            vc,
            B::attention_state_empty(q_shape, q.dtype(), device),
            step(w[0]),
        );
        merged = B::attention_merge(merged, partial);
    }
    let scale = 0.125;
    let Expected {
        fwd,
        naive_fwd: naive,
        grads: g,
        naive_grads: ng,
    } = expected(&dims, (&hq, &hk, &hv, &hdo), &mask, scale, elem);
    let host = |p: burn::tensor::ops::FloatTensor<B>| -> Vec<f64> {
        to_host(Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(p)))
    };
    let host3 = |p: burn::tensor::ops::FloatTensor<B>| -> Vec<f64> {
        to_host(Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(p)))
    };
    let (out, lse) = B::attention_finalize(stepped, q.dtype());
    let (merged_out, _) = B::attention_finalize(merged, q.dtype());
    let what = std::any::type_name::<B>();
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
    let mut dq = vec![0.0; hq.len()];
    let (mut dk, mut dv) = (vec![0.0; hk.len()], vec![0.0; hv.len()]);
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
        let len = w[1] - w[0];
        for (full, part) in [(&mut dk, host(gk)), (&mut dv, host(gv))] {
            for h in 0..2 {
                let dst = (h * 150 + w[0]) * 64;
                full[dst..dst + len * 64].copy_from_slice(&part[h * len * 64..(h + 1) * len * 64]);
            }
        }
    }
    assert_close(&format!("{what} steps: dq"), &dq, &g.dq, &ng.dq, elem);
    assert_close(&format!("{what} steps: dk"), &dk, &g.dk, &ng.dk, elem);
    assert_close(&format!("{what} steps: dv"), &dv, &g.dv, &ng.dv, elem);
}
