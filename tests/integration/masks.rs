//! Masks through the Burn op and the modules: packed documents (one list, per batch row, from
//! segment ids) and sliding windows (causal, two-sided, longer than the sequence, combined with
//! documents), forward, lse and gradients against the f64 reference, GQA and MQA; the step
//! operations chunk by chunk at absolute offsets against the one-shot call; rows that see no
//! key (O = 0, lse = -inf, no gradient, never NaN); the attention module and checkpointed
//! blocks over packed documents against each document run on its own, and a windowed module
//! against the window's slice of the input; bad masks refused with a clear error.
//!
//! The same suite runs on ndarray (the tensor-operation path), on wgpu (the kernels' portable
//! path on lavapipe) and on wgpu under `Fusion` (the op and the steps as custom operations of
//! the fusion stream, which carry the whole mask).

use crate::common::block_case::{
    assert_same_step, lift, random_blocks, relative_error, small_config, step, step_with_documents,
    StepResult,
};
use crate::common::burn_case::{
    check_options_case, check_steps_case, to_host, to_tensor, HostCase,
};
use crate::common::Rng;
use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn::config::{config_to_json, Config};
use burn::nn::Initializer;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
use burn_distflash::kernels::{ElemType, KernelError};
use burn_distflash::layers::CheckpointPlacement;
use burn_distflash::schedule::ScheduleError;
use burn_distflash::{
    flash_attention, flash_attention_with_lse, AttentionContext, AttentionInput,
    DistFlashAttention, DistFlashAttentionConfig, Documents, Error, FlashAttentionBackend,
    FlashAttentionOptions, Mask, SlidingWindow,
};
use distflash_test_support::max_abs_diff;

type WgpuF32 = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
type CudaF32 = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

/// Every test of this file for one backend (`$inner`, and `Autodiff` of it for gradients).
macro_rules! mask_suite {
    ($name:ident, $inner:ty, $device:expr $(, #[$attr:meta])?) => {
        mod $name {
            type Inner = $inner;
            type Train = burn::backend::Autodiff<$inner>;

            fn device() -> burn::tensor::Device<Inner> {
                $device
            }

            #[test]
            $(#[$attr])?
            fn documents_match_reference() {
                super::documents_match_reference::<Train>(&device());
            }

            #[test]
            $(#[$attr])?
            fn windows_match_reference() {
                super::windows_match_reference::<Train>(&device());
            }

            #[test]
            $(#[$attr])?
            fn combined_masks_match_reference() {
                super::combined_masks_match_reference::<Train>(&device());
            }

            #[test]
            $(#[$attr])?
            fn per_batch_row_documents_match_reference() {
                super::per_batch_row_documents_match_reference::<Train>(&device());
            }

            #[test]
            $(#[$attr])?
            fn grouped_heads_match_reference() {
                super::grouped_heads_match_reference::<Train>(&device());
            }

            #[test]
            $(#[$attr])?
            fn rows_that_see_no_key_give_zero() {
                super::rows_that_see_no_key_give_zero::<Train>(&device());
            }

            #[test]
            $(#[$attr])?
            fn steps_at_offsets_match_one_shot() {
                super::steps_at_offsets_match_one_shot::<Inner>(&device());
            }

            #[test]
            $(#[$attr])?
            fn bad_masks_are_refused() {
                super::bad_masks_are_refused::<Inner>(&device());
            }

            #[test]
            $(#[$attr])?
            fn attention_module_packs_documents() {
                super::attention_module_packs_documents::<Train>(&device());
            }

            #[test]
            $(#[$attr])?
            fn attention_module_window_sees_its_slice() {
                super::attention_module_window_sees_its_slice::<Inner>(&device());
            }

            #[test]
            $(#[$attr])?
            fn checkpointed_blocks_keep_the_mask() {
                super::checkpointed_blocks_keep_the_mask::<Train>(&device());
            }
        }
    };
}

mask_suite!(
    ndarray,
    burn::backend::NdArray<f32>,
    burn::backend::ndarray::NdArrayDevice::Cpu
);
mask_suite!(wgpu, super::WgpuF32, cubecl::wgpu::WgpuDevice::Cpu);
mask_suite!(
    fused_wgpu,
    burn_fusion::Fusion<super::WgpuF32>,
    cubecl::wgpu::WgpuDevice::Cpu
);
mask_suite!(
    cuda,
    super::CudaF32,
    cubecl::cuda::CudaDevice::new(0),
    #[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
);

const F32: ElemType = ElemType::F32;
/// Head width of the op-level cases (one the kernels support, small for lavapipe).
const HEAD_DIM: usize = 32;

fn documents(cu_seqlens: &[usize]) -> Documents {
    Documents::from_cu_seqlens(cu_seqlens).expect("valid documents")
}

/// Options of a causal or full mask with `documents` and `window` where given.
fn options(
    causal: bool,
    documents: Option<&Documents>,
    window: Option<SlidingWindow>,
) -> FlashAttentionOptions {
    FlashAttentionOptions::masked(Mask {
        causal,
        window,
        documents: documents.cloned(),
        ..Mask::none()
    })
}

/// Documents of length 1, of odd lengths, many short ones and one spanning everything, causal
/// and not.
fn documents_match_reference<B: AutodiffBackend + FlashAttentionBackend>(device: &B::Device) {
    let seq = 37;
    let many_short: Vec<usize> = (0..seq).step_by(2).chain([seq]).collect();
    for cu in [
        vec![0, 1, 2, seq],
        vec![0, 5, 12, seq],
        many_short,
        vec![0, seq],
    ] {
        let docs = documents(&cu);
        for causal in [false, true] {
            let options = options(causal, Some(&docs), None);
            check_options_case::<B>(device, F32, (2, 2, 2), (seq, seq, HEAD_DIM), &options);
        }
    }
}

/// Windows of 1, shorter and longer than the sequence, two-sided, causal with an `after` that
/// is ignored; over equal and unequal query and key lengths (the latter leaves rows that see no
/// key).
fn windows_match_reference<B: AutodiffBackend + FlashAttentionBackend>(device: &B::Device) {
    let cases = [
        (true, SlidingWindow::causal(1).unwrap()),
        (true, SlidingWindow::causal(6).unwrap()),
        (true, SlidingWindow::causal(100).unwrap()),
        (true, SlidingWindow::two_sided(4, 7)),
        (false, SlidingWindow::two_sided(0, 0)),
        (false, SlidingWindow::two_sided(3, 5)),
        (false, SlidingWindow::two_sided(40, 2)),
    ];
    for (causal, window) in cases {
        for lens in [(29, 29), (29, 45), (45, 29)] {
            let options = options(causal, None, Some(window));
            check_options_case::<B>(device, F32, (1, 2, 1), (lens.0, lens.1, HEAD_DIM), &options);
        }
    }
}

/// Documents and a window together, causal and two-sided.
fn combined_masks_match_reference<B: AutodiffBackend + FlashAttentionBackend>(device: &B::Device) {
    let docs = documents(&[0, 7, 8, 20, 33]);
    for (causal, window) in [
        (true, SlidingWindow::causal(4).unwrap()),
        (false, SlidingWindow::two_sided(2, 3)),
    ] {
        let options = options(causal, Some(&docs), Some(window));
        check_options_case::<B>(device, F32, (2, 2, 1), (33, 33, HEAD_DIM), &options);
    }
}

/// Different documents in each batch row (from cumulative lengths and from segment ids).
fn per_batch_row_documents_match_reference<B: AutodiffBackend + FlashAttentionBackend>(
    device: &B::Device,
) {
    let rows = Documents::per_batch_row(&[vec![0, 10, 33], vec![0, 1, 2, 3, 33], vec![0, 33]])
        .expect("valid documents");
    let ids: Vec<Vec<u32>> = (0..3)
        .map(|b| (0..33).map(|p| (p / (4 + 3 * b)) as u32).collect())
        .collect();
    let from_ids = Documents::from_segment_ids(&ids).expect("valid segment ids");
    for docs in [rows, from_ids] {
        for (causal, window) in [(true, None), (false, Some(SlidingWindow::two_sided(5, 2)))] {
            let options = options(causal, Some(&docs), window);
            check_options_case::<B>(device, F32, (3, 2, 2), (33, 33, HEAD_DIM), &options);
        }
    }
}

/// GQA and MQA with documents and a causal window.
fn grouped_heads_match_reference<B: AutodiffBackend + FlashAttentionBackend>(device: &B::Device) {
    let docs = documents(&[0, 9, 16, 31]);
    let options = options(true, Some(&docs), Some(SlidingWindow::causal(5).unwrap()));
    for heads in [(2, 6, 2), (1, 3, 1)] {
        check_options_case::<B>(device, F32, heads, (31, 31, HEAD_DIM), &options);
    }
}

/// Query rows whose window holds no key (20 queries, 12 keys, each query sees only the key at
/// its own position): O = 0 and lse = -inf exactly, and no gradient reaches q from them; no NaN
/// anywhere.
fn rows_that_see_no_key_give_zero<B: AutodiffBackend + FlashAttentionBackend>(device: &B::Device) {
    let (q_len, kv_len) = (20, 12);
    let options = options(false, None, Some(SlidingWindow::two_sided(0, 0)));
    check_options_case::<B>(device, F32, (1, 2, 2), (q_len, kv_len, HEAD_DIM), &options);

    let case = HostCase::new(5, F32, (1, 2, 2), (q_len, kv_len, HEAD_DIM));
    let q = to_tensor::<B>(&case.q, case.q_shape, device).require_grad();
    let k = to_tensor::<B>(&case.k, case.kv_shape, device).require_grad();
    let v = to_tensor::<B>(&case.v, case.kv_shape, device).require_grad();
    let (out, lse) = flash_attention_with_lse(q.clone(), k.clone(), v.clone(), options).unwrap();
    let dout = to_tensor::<B>(&case.dout, case.q_shape, device);
    let grads = (out.clone() * dout).sum().backward();
    let (out, lse) = (to_host(out), to_host(lse));
    let dq = to_host(q.grad(&grads).expect("a gradient for q"));
    for (name, values) in [
        ("O", &out),
        ("dq", &dq),
        ("dk", &to_host(k.grad(&grads).expect("a gradient for k"))),
        ("dv", &to_host(v.grad(&grads).expect("a gradient for v"))),
    ] {
        assert!(
            values.iter().all(|x| x.is_finite()),
            "{name} holds NaN or inf"
        );
    }
    for row in 0..2 * q_len {
        let hidden = row % q_len >= kv_len;
        let o = &out[row * HEAD_DIM..][..HEAD_DIM];
        let g = &dq[row * HEAD_DIM..][..HEAD_DIM];
        if hidden {
            assert_eq!(
                lse[row],
                f64::NEG_INFINITY,
                "lse of row {row}, which sees no key"
            );
            assert!(
                o.iter().chain(g).all(|&x| x == 0.0),
                "O or dq of row {row} not 0"
            );
        } else {
            assert!(lse[row].is_finite(), "lse of row {row}, which sees a key");
        }
    }
}

fn wrap<B: Backend, const D: usize>(primitive: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

fn prim<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> FloatTensor<B> {
    tensor.into_primitive().tensor()
}

/// Asserts that `got` equals `expected` to `1e-5` of its magnitude (infinities must match).
fn assert_near(what: &str, got: &[f64], expected: &[f64]) {
    let magnitude = (expected.iter())
        .filter(|x| x.is_finite())
        .fold(1.0f64, |a, x| a.max(x.abs()));
    let err = max_abs_diff(got, expected);
    assert!(err <= 1e-5 * magnitude, "{what}: differs by {err:e}");
}

/// The step operations over uneven chunks of queries and keys at absolute offsets (each pair
/// with `options.at(q_offset, kv_offset)`, pairs that see nothing included) give the
/// one-shot call's O, lse, dq, dk and dv; the last query chunk stepped over the keys in three
/// chunks matches the f64 reference.
fn steps_at_offsets_match_one_shot<B: FlashAttentionBackend>(device: &B::Device) {
    let len = 40;
    let per_row = Documents::per_batch_row(&[vec![0, 11, 12, 40], vec![0, 25, 40]]).unwrap();
    let shared = documents(&[0, 3, 19, 40]);
    let cases = [
        options(true, None, Some(SlidingWindow::causal(7).unwrap())),
        options(false, Some(&shared), None),
        options(
            true,
            Some(&per_row),
            Some(SlidingWindow::causal(9).unwrap()),
        ),
        options(false, Some(&shared), Some(SlidingWindow::two_sided(4, 6))),
    ];
    for options in &cases {
        let mask = options.mask.clone().at(21, 0);
        check_steps_case::<B>(device, F32, (2, 4, 2), (len - 21, len, HEAD_DIM), mask);
    }
    let case = HostCase::new(11, F32, (2, 4, 2), (len, len, HEAD_DIM));
    let q = to_tensor::<B>(&case.q, case.q_shape, device);
    let k = to_tensor::<B>(&case.k, case.kv_shape, device);
    let v = to_tensor::<B>(&case.v, case.kv_shape, device);
    let dout = to_tensor::<B>(&case.dout, case.q_shape, device);
    let bounds = [0, 13, 27, len];
    let rows = |t: &Tensor<B, 4>, a: usize, b: usize| {
        t.clone().slice([0..2, 0..t.dims()[1], a..b, 0..HEAD_DIM])
    };
    let rows3 = |t: &Tensor<B, 3>, a: usize, b: usize| t.clone().slice([0..2, 0..4, a..b]);
    for options in cases {
        let what = format!("{} {options:?}", std::any::type_name::<B>());
        let (out, lse) =
            flash_attention_with_lse(q.clone(), k.clone(), v.clone(), options.clone()).unwrap();
        let step = |qa: usize, ka: usize| options.clone().at(qa as i64, ka as i64);
        let (mut outs, mut lses) = (Vec::new(), Vec::new());
        for qc in bounds.windows(2) {
            let mut state =
                B::attention_state_empty([2, 4, qc[1] - qc[0], HEAD_DIM], DType::F32, device);
            for kc in bounds.windows(2) {
                state = B::attention_forward_step(
                    prim(rows(&q, qc[0], qc[1])),
                    prim(rows(&k, kc[0], kc[1])),
                    prim(rows(&v, kc[0], kc[1])),
                    state,
                    step(qc[0], kc[0]),
                );
            }
            let (o, l) = B::attention_finalize(state, DType::F32);
            outs.push(wrap::<B, 4>(o));
            lses.push(wrap::<B, 3>(l));
        }
        let stepped_out = Tensor::cat(outs, 2);
        assert_near(
            &format!("{what}: O"),
            &to_host(stepped_out),
            &to_host(out.clone()),
        );
        assert_near(
            &format!("{what}: lse"),
            &to_host(Tensor::cat(lses, 2)),
            &to_host(lse.clone()),
        );

        let (dq, dk, dv) = B::flash_attention_backward(
            prim(q.clone()),
            prim(k.clone()),
            prim(v.clone()),
            prim(out.clone()),
            prim(lse.clone()),
            prim(dout.clone()),
            options.clone(),
        );
        let delta = wrap::<B, 3>(B::attention_delta(prim(out), prim(dout.clone())));
        let chunks = bounds.len() - 1;
        let (mut dqs, mut dks, mut dvs) = (
            vec![None::<Tensor<B, 4>>; chunks],
            vec![None::<Tensor<B, 4>>; chunks],
            vec![None::<Tensor<B, 4>>; chunks],
        );
        let add = |sum: &mut Option<Tensor<B, 4>>, t: FloatTensor<B>| {
            let t = wrap::<B, 4>(t);
            *sum = Some(match sum.take() {
                Some(s) => s + t,
                None => t,
            });
        };
        for (qi, qc) in bounds.windows(2).enumerate() {
            for (ki, kc) in bounds.windows(2).enumerate() {
                let (gq, gk, gv) = B::attention_backward_step(
                    prim(rows(&q, qc[0], qc[1])),
                    prim(rows(&k, kc[0], kc[1])),
                    prim(rows(&v, kc[0], kc[1])),
                    prim(rows(&dout, qc[0], qc[1])),
                    prim(rows3(&lse, qc[0], qc[1])),
                    prim(rows3(&delta, qc[0], qc[1])),
                    step(qc[0], kc[0]),
                );
                add(&mut dqs[qi], gq);
                add(&mut dks[ki], gk);
                add(&mut dvs[ki], gv);
            }
        }
        let join = |parts: Vec<Option<Tensor<B, 4>>>| {
            to_host(Tensor::cat(parts.into_iter().flatten().collect(), 2))
        };
        assert_near(
            &format!("{what}: dq"),
            &join(dqs),
            &to_host(wrap::<B, 4>(dq)),
        );
        assert_near(
            &format!("{what}: dk"),
            &join(dks),
            &to_host(wrap::<B, 4>(dk)),
        );
        assert_near(
            &format!("{what}: dv"),
            &join(dvs),
            &to_host(wrap::<B, 4>(dv)),
        );
    }
}

/// The `BadMask` message of an error, or a panic naming what came instead.
fn bad_mask(result: Result<impl std::fmt::Debug, impl Into<Error>>) -> String {
    match result.map_err(Into::into) {
        Err(Error::Kernel(KernelError::BadMask { what })) => what,
        other => panic!("expected a BadMask error, got {other:?}"),
    }
}

/// Boundaries that do not start at 0, do not increase or end at different lengths per row;
/// documents that do not end at the sequence length, of the wrong number of batch rows, or
/// over different query and key lengths; the same through the attention module.
fn bad_masks_are_refused<B: FlashAttentionBackend>(device: &B::Device) {
    let what = bad_mask(Documents::from_cu_seqlens(&[1, 5, 9]));
    assert!(what.contains("start at 0"), "{what}");
    let what = bad_mask(Documents::from_cu_seqlens(&[0, 5, 5, 9]));
    assert!(what.contains("strictly increase"), "{what}");
    let what = bad_mask(Documents::per_batch_row(&[vec![0, 4, 9], vec![0, 10]]));
    assert!(what.contains("end at"), "{what}");

    let tensor = |shape: [usize; 4]| Tensor::<B, 4>::zeros(shape, device);
    let call = |batch: usize, q_len: usize, kv_len: usize, docs: &Documents| {
        let (q, kv) = ([batch, 2, q_len, HEAD_DIM], [batch, 2, kv_len, HEAD_DIM]);
        let options = options(true, Some(docs), None);
        flash_attention(tensor(q), tensor(kv), tensor(kv), options)
    };
    for docs_len in [20, 30] {
        let what = bad_mask(call(1, 25, 25, &documents(&[0, 7, docs_len])));
        assert!(
            what.contains(&format!("end at position {docs_len}")) && what.contains("25 positions"),
            "{what}"
        );
    }
    let what = bad_mask(call(1, 20, 30, &documents(&[0, 7, 20])));
    assert!(what.contains("seq_q == seq_kv"), "{what}");
    let two_rows = Documents::per_batch_row(&[vec![0, 3, 25], vec![0, 25]]).unwrap();
    let what = bad_mask(call(3, 25, 25, &two_rows));
    assert!(
        what.contains("2 batch rows") && what.contains("has 3"),
        "{what}"
    );

    let module = DistFlashAttentionConfig::new(64, 4).init::<B>(device);
    let x = Tensor::<B, 3>::zeros([3, 25, 64], device);
    let context = AttentionContext::Local;
    let input = AttentionInput::new(x.clone()).documents(documents(&[0, 24]));
    let what = bad_mask(module.try_forward(input, &context));
    assert!(what.contains("end at position 24"), "{what}");
    let what = bad_mask(module.try_forward(AttentionInput::new(x).documents(two_rows), &context));
    assert!(what.contains("2 batch rows"), "{what}");
}

/// Uniform noise of amplitude `amp`, shaped `dims`.
fn noise<B: Backend>(
    rng: &mut Rng,
    dims: [usize; 3],
    amp: f64,
    device: &B::Device,
) -> Tensor<B, 3> {
    let n = dims.iter().product();
    let values: Vec<f32> = (0..n).map(|_| (amp * rng.uniform()) as f32).collect();
    Tensor::from_data(TensorData::new(values, dims), device)
}

/// A GQA attention module (4 query heads over 2 key/value heads of width 16) with weights large
/// enough for sharp attention.
fn module_config(causal: bool) -> DistFlashAttentionConfig {
    DistFlashAttentionConfig::new(64, 4)
        .with_n_kv_heads(Some(2))
        .with_causal(causal)
        .with_initializer(Initializer::Uniform {
            min: -0.3,
            max: 0.3,
        })
}

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec().unwrap()
}

/// The module over packed documents (different per batch row) equals the module over each
/// document alone (rotary positions differ, but scores depend only on distances): outputs, input
/// gradients, and weight gradients summed over the documents.
fn attention_module_packs_documents<B: AutodiffBackend + FlashAttentionBackend>(
    device: &B::Device,
) {
    let (batch, seq, d_model) = (2, 15, 64);
    let cu = [vec![0, 6, 15], vec![0, 1, 9, 15]];
    let docs = Documents::per_batch_row(&cu).unwrap();
    let mut rng = Rng::new(3);
    let x = noise::<B::InnerBackend>(&mut rng, [batch, seq, d_model], 1.0, device);
    let r = noise::<B::InnerBackend>(&mut rng, [batch, seq, d_model], 1.0, device);
    let context = AttentionContext::Local;
    for causal in [true, false] {
        let module = module_config(causal).init::<B>(device);
        let weights = |m: &DistFlashAttention<B>| {
            [&m.query, &m.key, &m.value, &m.output].map(|l| l.weight.val())
        };
        let run = |x: Tensor<B::InnerBackend, 3>,
                   r: Tensor<B::InnerBackend, 3>,
                   docs: Option<&Documents>| {
            let x = Tensor::<B, 3>::from_inner(x).require_grad();
            let input = AttentionInput {
                x: x.clone(),
                documents: docs.cloned(),
            };
            let y = module.forward(input, &context);
            let grads = (y.clone() * Tensor::from_inner(r)).sum().backward();
            let weight_grads =
                weights(&module).map(|w| host(w.grad(&grads).expect("a weight gradient")));
            (
                host(y.inner()),
                host(x.grad(&grads).expect("an input gradient")),
                weight_grads,
            )
        };
        let (packed_y, packed_dx, packed_dw) = run(x.clone(), r.clone(), Some(&docs));
        let mut summed_dw: Vec<Vec<f32>> = packed_dw.iter().map(|w| vec![0.0; w.len()]).collect();
        for (b, bounds) in cu.iter().enumerate() {
            for doc in bounds.windows(2) {
                let slice = |t: &Tensor<B::InnerBackend, 3>| {
                    t.clone().slice([b..b + 1, doc[0]..doc[1], 0..d_model])
                };
                let (y, dx, dw) = run(slice(&x), slice(&r), None);
                let at = (b * seq + doc[0]) * d_model..(b * seq + doc[1]) * d_model;
                let what = format!("causal {causal}, batch row {b}, document {doc:?}");
                let err = relative_error(&packed_y[at.clone()], &y);
                assert!(err < 1e-4, "{what}: output differs by {err:e}");
                let err = relative_error(&packed_dx[at], &dx);
                assert!(err < 1e-4, "{what}: input gradient differs by {err:e}");
                for (sum, g) in summed_dw.iter_mut().zip(&dw) {
                    sum.iter_mut().zip(g).for_each(|(s, g)| *s += g);
                }
            }
        }
        for (i, (packed, summed)) in packed_dw.iter().zip(&summed_dw).enumerate() {
            let err = relative_error(packed, summed);
            assert!(
                err < 1e-4,
                "causal {causal}: gradient of weight {i} differs by {err:e}"
            );
        }
    }
}

/// A windowed module's output at each position equals its output over just the positions the
/// window covers (causal, and two-sided without causality).
fn attention_module_window_sees_its_slice<B: FlashAttentionBackend>(device: &B::Device) {
    let (seq, d_model) = (12, 64);
    let x = noise::<B>(&mut Rng::new(8), [1, seq, d_model], 1.0, device);
    let context = AttentionContext::Local;
    for (causal, before, after) in [(true, 3, 0), (false, 2, 3)] {
        let module = module_config(causal)
            .with_window(Some(SlidingWindow::two_sided(before, after)))
            .init::<B>(device);
        let y = host(module.forward(x.clone(), &context));
        for i in 0..seq {
            let (lo, hi) = (i.saturating_sub(before), (i + after + 1).min(seq));
            let part = host(module.forward(x.clone().slice([0..1, lo..hi, 0..d_model]), &context));
            let row = i - lo;
            let err = relative_error(
                &y[i * d_model..][..d_model],
                &part[row * d_model..][..d_model],
            );
            assert!(
                err < 1e-4,
                "window ({before}, {after}), causal {causal}, row {i}: {err:e}"
            );
        }
    }
}

/// Two blocks with a causal window over packed documents: checkpointed at the layer or at the
/// attention output, they give the un-checkpointed step (the recomputed attention and its
/// backward use the same documents), which equals each document run on its own.
fn checkpointed_blocks_keep_the_mask<B: AutodiffBackend + FlashAttentionBackend>(
    device: &B::Device,
) {
    let mut config = small_config();
    config.attention.window = Some(SlidingWindow::causal(5).unwrap());
    let blocks = random_blocks::<B>(&config, 21, device);
    let (batch, seq, d_model) = (2, 14, 64);
    let cu = [vec![0, 4, 14], vec![0, 9, 10, 14]];
    let docs = Documents::per_batch_row(&cu).unwrap();
    let mut rng = Rng::new(4);
    let x = noise::<B::InnerBackend>(&mut rng, [batch, seq, d_model], 1.0, device);
    let r = noise::<B::InnerBackend>(&mut rng, [batch, seq, d_model], 1.0, device);
    let context = AttentionContext::Local;
    let run = |placement: CheckpointPlacement, x, r, docs: Option<&Documents>| {
        let lifted = lift(&blocks, placement, std::slice::from_ref(device)).remove(0);
        step_with_documents(&lifted, x, r, &context, docs)
    };
    let stored = run(CheckpointPlacement::None, x.clone(), r.clone(), Some(&docs));
    for placement in [
        CheckpointPlacement::Layer,
        CheckpointPlacement::AttentionOutput,
    ] {
        let got = run(placement, x.clone(), r.clone(), Some(&docs));
        assert_same_step(&format!("{placement:?}"), &got, &stored, 1e-5);
    }

    let plain = lift(
        &blocks,
        CheckpointPlacement::None,
        std::slice::from_ref(device),
    )
    .remove(0);
    let mut summed: Vec<Vec<f32>> = (stored.weight_grads.iter())
        .map(|w| vec![0.0; w.len()])
        .collect();
    for (b, bounds) in cu.iter().enumerate() {
        for doc in bounds.windows(2) {
            let slice = |t: &Tensor<B::InnerBackend, 3>| {
                t.clone().slice([b..b + 1, doc[0]..doc[1], 0..d_model])
            };
            let alone: StepResult = step(&plain, slice(&x), slice(&r), &context);
            let at = (b * seq + doc[0]) * d_model..(b * seq + doc[1]) * d_model;
            let what = format!("batch row {b}, document {doc:?}");
            let err = relative_error(&stored.output[at.clone()], &alone.output);
            assert!(err < 1e-4, "{what}: output differs by {err:e}");
            let err = relative_error(&stored.input_grad[at], &alone.input_grad);
            assert!(err < 1e-4, "{what}: input gradient differs by {err:e}");
            for (sum, g) in summed.iter_mut().zip(&alone.weight_grads) {
                sum.iter_mut().zip(g).for_each(|(s, g)| *s += g);
            }
        }
    }
    for (i, (got, expected)) in stored.weight_grads.iter().zip(&summed).enumerate() {
        let err = relative_error(got, expected);
        assert!(err < 1e-4, "gradient of weight {i} differs by {err:e}");
    }
}

/// A configuration saved before windows existed (no `window` field) loads with no window; one
/// with a window keeps it.
#[test]
fn attention_config_window_defaults_to_none() {
    let windowed =
        DistFlashAttentionConfig::new(64, 4).with_window(Some(SlidingWindow::causal(8).unwrap()));
    let loaded = DistFlashAttentionConfig::load_binary(config_to_json(&windowed).as_bytes());
    assert_eq!(
        loaded.unwrap().window,
        Some(SlidingWindow::causal(8).unwrap())
    );

    let json = config_to_json(&DistFlashAttentionConfig::new(64, 4));
    let without: String = (json.lines())
        .filter(|line| !line.contains("\"window\""))
        .collect::<Vec<_>>()
        .join("\n");
    assert_ne!(without, json, "the saved configuration names its window");
    let loaded = DistFlashAttentionConfig::load_binary(without.as_bytes()).unwrap();
    assert_eq!(loaded.window, None);
    let module = loaded.init::<Autodiff<NdArray<f32>>>(&NdArrayDevice::Cpu);
    assert_eq!(module.options().mask.window, None);
}

/// A causal window of no key is refused where it is built, with the crate's mask error; the
/// smallest window, 1, is each query seeing itself.
#[test]
fn a_causal_window_of_zero_keys_is_an_error() {
    let error = SlidingWindow::causal(0).expect_err("a window of 0 keys must be refused");
    assert!(
        matches!(error, ScheduleError::BadMask { ref what } if what.contains("0 keys")),
        "{error}"
    );
    assert_eq!(
        SlidingWindow::causal(1).unwrap(),
        SlidingWindow::two_sided(0, 0)
    );
    assert_eq!(
        SlidingWindow::causal(usize::MAX).unwrap().before,
        usize::MAX - 1
    );
}
