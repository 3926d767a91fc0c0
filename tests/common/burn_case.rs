//! The Burn-op check shared by the per-precision test binaries: forward output and the gradients
//! of `sum(O * dO)` through `Autodiff`, against the f64 reference.
#![allow(dead_code)]

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_distflash::{flash_attention, FlashAttentionBackend, FlashAttentionOptions};
use distflash_kernels::reference::{self, exact};
use distflash_kernels::{AttentionDims, ElemType, Mask};

use super::{assert_close, naive_rounding, Rng};

pub fn to_tensor<B: AutodiffBackend>(
    data: &[f64],
    shape: [usize; 4],
    device: &B::Device,
) -> Tensor<B, 4> {
    let values: Vec<f32> = data.iter().map(|&x| x as f32).collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

pub fn to_host<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f64> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|&x| x as f64)
        .collect()
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
    let expected = match elem {
        ElemType::F16 => DType::F16,
        ElemType::BF16 => DType::BF16,
        ElemType::F32 => DType::F32,
    };
    assert_eq!(
        q.dtype(),
        expected,
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
    let fwd = reference::forward(&dims, &hq, &hk, &hv, &mask, scale, exact);
    let naive_fwd = reference::forward(&dims, &hq, &hk, &hv, &mask, scale, naive_rounding(elem));
    let g = reference::backward(&dims, &hq, &hk, &hv, &hdo, &mask, scale, exact);
    let naive_g = reference::backward(
        &dims,
        &hq,
        &hk,
        &hv,
        &hdo,
        &mask,
        scale,
        naive_rounding(elem),
    );
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
