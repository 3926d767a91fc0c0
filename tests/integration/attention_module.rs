//! `DistFlashAttention` against a plain multi-head attention written with Burn tensor ops (the
//! rotary embedding from its textbook formula in f64), for irregular and few heads, GQA and MQA,
//! on one device and sharded over a group; its output and every gradient (input and the four
//! weights) on wgpu against the same attention differentiated in f64, for short sequences, odd
//! head counts, GQA ratios and every head dim; configuration and input errors; the configuration
//! as one options value and documents as part of the input; the rotary embedding itself.

use std::f64::consts::PI;
use std::time::Duration;

use crate::common::block_case::relative_error;
use crate::common::within::within;
use crate::common::Rng;
use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_distflash::collective::on_each_rank;
use burn_distflash::layers::{Llama3RopeScaling, RopeConfig, RotaryTables};
use burn_distflash::sequence_parallel::{gather_sequence, shard_sequence, ScheduleKind};
use burn_distflash::{
    AttentionContext, AttentionInput, DeviceGroup, DistFlashAttention, DistFlashAttentionConfig,
    Documents, FlashAttentionOptions, Mask, SlidingWindow,
};

type Cpu = NdArray<f32>;
const DEVICE: NdArrayDevice = NdArrayDevice::Cpu;

fn random(rng: &mut Rng, dims: [usize; 3]) -> Tensor<Cpu, 3> {
    let n = dims.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.uniform() as f32).collect();
    Tensor::from_data(TensorData::new(values, dims), &DEVICE)
}

/// Rotates `x` `[batch, heads, seq, d]` at positions `0..seq` with angles computed in f64 from
/// `p * theta^(-2i/d)` (pairs `(i, i + d/2)`), independently of the module's tables.
fn textbook_rope(x: Tensor<Cpu, 4>, theta: f64) -> Tensor<Cpu, 4> {
    let [b, h, s, d] = x.dims();
    let v: Vec<f32> = x.into_data().to_vec().unwrap();
    let mut out = v.clone();
    for row in 0..b * h * s {
        let p = (row % s) as f64;
        for i in 0..d / 2 {
            let angle = p * theta.powf(-2.0 * i as f64 / d as f64);
            let (a, c) = (v[row * d + i] as f64, v[row * d + i + d / 2] as f64);
            out[row * d + i] = (a * angle.cos() - c * angle.sin()) as f32;
            out[row * d + i + d / 2] = (c * angle.cos() + a * angle.sin()) as f32;
        }
    }
    Tensor::from_data(TensorData::new(out, [b, h, s, d]), &DEVICE)
}

/// Plain causal multi-head attention with the module's weights: project, rotate, repeat the
/// key/value heads, softmax of masked scores, output projection.
fn reference(m: &DistFlashAttention<Cpu>, x: Tensor<Cpu, 3>) -> Tensor<Cpu, 3> {
    let [b, s, _] = x.dims();
    let (h, kvh, d) = (m.n_heads, m.n_kv_heads, m.head_dim);
    let heads = |w: Tensor<Cpu, 2>, n: usize| {
        x.clone()
            .matmul(w.unsqueeze())
            .reshape([b, s, n, d])
            .swap_dims(1, 2)
    };
    let q = textbook_rope(heads(m.query.weight.val(), h), 10000.0);
    let k = textbook_rope(heads(m.key.weight.val(), kvh), 10000.0);
    let v = heads(m.value.weight.val(), kvh);
    let repeat = |t: Tensor<Cpu, 4>| {
        t.reshape([b, kvh, 1, s, d])
            .repeat_dim(2, h / kvh)
            .reshape([b, h, s, d])
    };
    let (k, v) = (repeat(k), repeat(v));
    let scores = q.matmul(k.swap_dims(2, 3)).div_scalar((d as f64).sqrt());
    let mask = Tensor::<Cpu, 2, burn::tensor::Bool>::tril_mask([s, s], 0, &DEVICE);
    let scores = scores.mask_fill(mask.unsqueeze::<4>(), f32::NEG_INFINITY);
    let out = softmax(scores, 3).matmul(v);
    m.output.forward(out.swap_dims(1, 2).reshape([b, s, h * d]))
}

fn check_heads(d_model: usize, heads: usize, kv_heads: usize, seed: u64) {
    let config = DistFlashAttentionConfig::new(d_model, heads).with_n_kv_heads(Some(kv_heads));
    let module = config.init::<Cpu>(&DEVICE);
    let x = random(&mut Rng::new(seed), [2, 20, d_model]);
    let got = module.forward(x.clone(), &AttentionContext::Local);
    let expected = reference(&module, x);
    let err = relative_error(
        &got.into_data().to_vec::<f32>().unwrap(),
        &expected.into_data().to_vec::<f32>().unwrap(),
    );
    assert!(
        err < 1e-5,
        "{heads} heads over {kv_heads}: differs from the reference by {err:e}"
    );
}

#[test]
fn matches_plain_attention_with_33_heads_and_gqa() {
    check_heads(33 * 16, 33, 3, 1);
}

#[test]
fn matches_plain_attention_with_two_heads() {
    check_heads(2 * 32, 2, 2, 2);
}

#[test]
fn matches_plain_attention_with_one_key_value_head() {
    check_heads(4 * 16, 4, 1, 3);
}

#[test]
fn a_sharded_sequence_matches_plain_attention_over_the_whole_sequence() {
    // Contiguous (3 ranks, Auto: balanced), zigzag (4 ranks, Auto; 3 ranks, asked for): the
    // shards are cut and joined by the public helpers for the context's layout.
    for (world, schedule, seq) in [
        (3, ScheduleKind::Auto, 21),
        (4, ScheduleKind::Auto, 24),
        (3, ScheduleKind::Zigzag, 30),
    ] {
        within(Duration::from_secs(120), move || {
            let config = DistFlashAttentionConfig::new(5 * 16, 5);
            let module = config.init::<Cpu>(&DEVICE);
            let x = random(&mut Rng::new(4), [1, seq, 80]);
            let expected: Vec<f32> = reference(&module, x.clone()).into_data().to_vec().unwrap();
            let layout = schedule.resolve(world, true).layout();
            let groups = DeviceGroup::<Cpu>::in_process(vec![DEVICE; world]);
            let per_rank = (groups.into_iter().enumerate())
                .map(|(rank, group)| {
                    let x = shard_sequence(x.clone(), 1, layout, world, rank).unwrap();
                    (group, module.clone(), x)
                })
                .collect();
            let shards = on_each_rank(per_rank, |_, (group, module, x)| {
                let context = AttentionContext::sharded(group).with_schedule(schedule);
                assert_eq!(context.layout(module.options(), seq / world), layout);
                module.forward(x, &context)
            });
            let got = gather_sequence(shards, 1, layout).unwrap();
            let got: Vec<f32> = got.into_data().to_vec().unwrap();
            let err = relative_error(&got, &expected);
            assert!(
                err < 1e-5,
                "{world} ranks, {schedule:?}: differs by {err:e}"
            );
        });
    }
}

#[test]
fn an_odd_shard_under_zigzag_is_refused_by_the_module() {
    within(Duration::from_secs(60), || {
        let module = DistFlashAttentionConfig::new(2 * 16, 2).init::<Cpu>(&DEVICE);
        let groups = DeviceGroup::<Cpu>::in_process(vec![DEVICE; 2]);
        let per_rank = groups.into_iter().map(|g| (g, module.clone())).collect();
        let errors = on_each_rank(per_rank, |_, (group, module)| {
            let x = Tensor::<Cpu, 3>::ones([1, 5, 32], &DEVICE);
            let context = AttentionContext::sharded(group).with_schedule(ScheduleKind::Zigzag);
            module.try_forward(x, &context).unwrap_err().to_string()
        });
        for e in errors {
            assert!(
                e.contains("Zigzag") && e.contains("got a shard of 5"),
                "{e}"
            );
        }
    });
}

#[test]
fn bad_configurations_say_what_is_wrong() {
    let err = |c: DistFlashAttentionConfig| c.try_init::<Cpu>(&DEVICE).unwrap_err().to_string();
    assert!(err(DistFlashAttentionConfig::new(100, 3))
        .contains("n_heads is 3; expected a divisor of d_model (100)"));
    let e = err(DistFlashAttentionConfig::new(64, 4).with_n_kv_heads(Some(3)));
    assert!(
        e.contains("n_kv_heads is 3; expected a divisor of n_heads (4)"),
        "{e}"
    );
    let e = err(DistFlashAttentionConfig::new(40, 4));
    assert!(
        e.contains("head_dim is 10; expected one the attention kernels support"),
        "{e}"
    );
    assert!(err(DistFlashAttentionConfig::new(64, 0)).contains("expected all positive"));
    // An explicit head width need not divide the hidden size.
    let odd = DistFlashAttentionConfig::new(100, 3).with_head_dim(Some(32));
    assert_eq!(
        odd.try_init::<Cpu>(&DEVICE).unwrap().query.weight.dims(),
        [100, 96]
    );
}

#[test]
fn the_configuration_becomes_one_options_value_that_calls_only_add_documents_to() {
    let window = SlidingWindow::causal(5).unwrap();
    let config = DistFlashAttentionConfig::new(64, 4)
        .with_window(Some(window))
        .with_deterministic(true);
    let expected =
        FlashAttentionOptions::masked(Mask::causal().with_window(window)).with_deterministic(true);
    assert_eq!(config.options(), expected);
    let module = config.init::<Cpu>(&DEVICE);
    assert_eq!(module.options(), expected);
    // A call's documents join the same mask; a plain tensor is an input without documents.
    let x = random(&mut Rng::new(8), [2, 12, 64]);
    let documents = Documents::from_cu_seqlens(&[0, 5, 12]).unwrap();
    let input = AttentionInput::new(x.clone()).documents(documents.clone());
    assert_eq!(input.documents, Some(documents.clone()));
    assert_eq!(AttentionInput::from(x.clone()).documents, None);
    // The documents reach attention: a window over each document alone gives the same rows.
    let packed = module.forward(input, &AttentionContext::Local);
    let values = |t: Tensor<Cpu, 3>| t.into_data().to_vec::<f32>().unwrap();
    for (start, end) in [(0, 5), (5, 12)] {
        let alone = module.forward(
            x.clone().slice([0..2, start..end]),
            &AttentionContext::Local,
        );
        let rows = packed.clone().slice([0..2, start..end]);
        let error = relative_error(&values(rows), &values(alone));
        assert!(
            error < 1e-5,
            "document {start}..{end}: relative error {error:e}"
        );
    }
}

#[test]
fn inputs_the_module_cannot_take_are_refused_before_any_work() {
    let module = DistFlashAttentionConfig::new(64, 4).init::<Cpu>(&DEVICE);
    let refuse = |x: Tensor<Cpu, 3>| {
        module
            .try_forward(x, &AttentionContext::Local)
            .unwrap_err()
            .to_string()
    };
    let e = refuse(random(&mut Rng::new(6), [1, 8, 48]));
    assert!(e.contains("[1, 8, 48]; expected [batch, seq, 64]"), "{e}");
    let e = refuse(Tensor::zeros([1, 0, 64], &DEVICE));
    assert!(e.contains("[1, 0, 64]") && e.contains("at least 1"), "{e}");
    let e = refuse(random(&mut Rng::new(7), [1, 8, 64]).cast(DType::F64));
    assert!(
        e.contains("is F64; expected the module weights' float type F32"),
        "{e}"
    );
    assert_eq!(module.counter.get(), 0, "attention ran");
}

#[test]
fn a_rank_whose_input_is_refused_makes_the_other_ranks_fail_at_once() {
    let errors = within(Duration::from_secs(120), || {
        let module = DistFlashAttentionConfig::new(64, 4).init::<Cpu>(&DEVICE);
        let groups =
            DeviceGroup::<Cpu>::in_process_with_timeout(vec![DEVICE; 2], Duration::from_secs(60));
        let start = std::time::Instant::now();
        let per_rank = groups.into_iter().map(|g| (g, module.clone())).collect();
        let errors: Vec<String> = on_each_rank(per_rank, |rank, (group, module)| {
            let width = if rank == 0 { 48 } else { 64 };
            let x = random(&mut Rng::new(8), [1, 8, width]);
            (module.try_forward(x, &AttentionContext::sharded(group)))
                .unwrap_err()
                .to_string()
        });
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "a rank waited for the timeout"
        );
        errors
    });
    assert!(
        errors[0].contains("expected [batch, seq, 64]"),
        "{}",
        errors[0]
    );
    assert!(
        errors[1].contains("rank 0 refused its own input"),
        "{}",
        errors[1]
    );
}

#[test]
fn llama3_scaling_keeps_short_wavelengths_divides_long_ones_and_blends_between() {
    let scaling = Llama3RopeScaling::new(8.0, 1.0, 4.0, 8192);
    // Thresholds: wavelengths below 8192 / 4 = 2048 kept, above 8192 / 1 divided by 8.
    let short = 2.0 * PI / 1000.0;
    assert_eq!(scaling.scale(short), short);
    let long = 2.0 * PI / 10000.0;
    assert!((scaling.scale(long) - long / 8.0).abs() < 1e-15);
    // Wavelength 4096: smooth = (8192/4096 - 1) / (4 - 1) = 1/3.
    let mid = 2.0 * PI / 4096.0;
    let expected = (2.0 / 3.0) * mid / 8.0 + (1.0 / 3.0) * mid;
    assert!((scaling.scale(mid) - expected).abs() < 1e-15);
    let config = RopeConfig::new()
        .with_theta(500000.0)
        .with_scaling(Some(scaling));
    let freqs = config.inverse_frequencies(128);
    assert_eq!(freqs.len(), 64);
    assert_eq!(freqs[0], 1.0, "the highest frequency is unscaled");
    let unscaled = RopeConfig::new()
        .with_theta(500000.0)
        .inverse_frequencies(128);
    assert!((freqs[63] - unscaled[63] / 8.0).abs() < 1e-18);
}

#[test]
fn rotary_tables_of_a_shard_are_rows_of_the_whole_sequence_and_the_transpose_is_the_adjoint() {
    let config = RopeConfig::new();
    let mut rng = Rng::new(5);
    let values: Vec<f32> = (0..2 * 12 * 32).map(|_| rng.uniform() as f32).collect();
    let x = Tensor::<Cpu, 4>::from_data(TensorData::new(values, [1, 2, 12, 32]), &DEVICE);
    let dtype = x.dtype();
    let whole = RotaryTables::<Cpu>::new(&config, 32, 0, 12, dtype, &DEVICE).apply(x.clone());
    let tail = RotaryTables::<Cpu>::new(&config, 32, 5, 7, dtype, &DEVICE);
    let got: Vec<f32> = tail
        .apply(x.clone().narrow(2, 5, 7))
        .into_data()
        .to_vec()
        .unwrap();
    let expected: Vec<f32> = whole.narrow(2, 5, 7).into_data().to_vec().unwrap();
    assert!(relative_error(&got, &expected) < 1e-6);
    let textbook: Vec<f32> = textbook_rope(x.clone(), 10000.0)
        .into_data()
        .to_vec()
        .unwrap();
    let module: Vec<f32> = RotaryTables::<Cpu>::new(&config, 32, 0, 12, dtype, &DEVICE)
        .apply(x.clone())
        .into_data()
        .to_vec()
        .unwrap();
    assert!(relative_error(&module, &textbook) < 1e-5);
    // <g, R x> == <R^T g, x> for a random g.
    let g = Tensor::<Cpu, 4>::from_data(
        TensorData::new(
            (0..2 * 7 * 32)
                .map(|_| rng.uniform() as f32)
                .collect::<Vec<_>>(),
            [1, 2, 7, 32],
        ),
        &DEVICE,
    );
    let shard = x.narrow(2, 5, 7);
    let lhs: f32 = (g.clone() * tail.apply(shard.clone())).sum().into_scalar();
    let rhs: f32 = (tail.apply_transpose(g) * shard).sum().into_scalar();
    assert!(
        (lhs - rhs).abs() < 1e-4 * lhs.abs().max(1.0),
        "{lhs} vs {rhs}"
    );
}

/// The f64 reference of the gradient tests: Burn's own autodiff over plain tensor operations.
type F64 = Autodiff<NdArray<f64>>;
type WgpuF32 = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;

fn host_values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f64> {
    t.into_data().convert::<f64>().to_vec::<f64>().unwrap()
}

/// Plain multi-head attention in f64 over the values of `weights` (`[d_in, d_out]` each: query,
/// key, value, output) with a differentiable rotary embedding (pairs `(i, i + d/2)`, angles
/// `p * theta^(-2i/d)` in f64): the output and the gradients of `x` and of the four weights for
/// the output gradient `grad`.
#[allow(clippy::too_many_arguments)]
fn f64_reference(
    x: &[f64],
    weights: [&[f64]; 4],
    grad: &[f64],
    [b, s, d_model]: [usize; 3],
    (h, kvh, d): (usize, usize, usize),
    causal: bool,
) -> Vec<Vec<f64>> {
    let dev = NdArrayDevice::Cpu;
    let tensor = |v: &[f64], shape: [usize; 2]| {
        Tensor::<F64, 2>::from_data(TensorData::new(v.to_vec(), shape), &dev).require_grad()
    };
    let xt = Tensor::<F64, 3>::from_data(TensorData::new(x.to_vec(), [b, s, d_model]), &dev)
        .require_grad();
    let widths = [h * d, kvh * d, kvh * d];
    let [wq, wk, wv] = [0, 1, 2].map(|i| tensor(weights[i], [d_model, widths[i]]));
    let wo = tensor(weights[3], [h * d, d_model]);
    let (mut cos, mut sin) = (vec![0.0; s * d], vec![0.0; s * d]);
    for p in 0..s {
        for i in 0..d / 2 {
            let angle = p as f64 * 10000f64.powf(-2.0 * i as f64 / d as f64);
            for c in [i, i + d / 2] {
                cos[p * d + c] = angle.cos();
                sin[p * d + c] = angle.sin();
            }
        }
    }
    let table = |v: Vec<f64>| {
        Tensor::<F64, 2>::from_data(TensorData::new(v, [s, d]), &dev).reshape([1, 1, s, d])
    };
    let (cos, sin) = (table(cos), table(sin));
    let rope = |t: Tensor<F64, 4>| {
        let half = d / 2;
        let [bb, hh, ss, _] = t.dims();
        let first = t.clone().slice([0..bb, 0..hh, 0..ss, 0..half]);
        let second = t.clone().slice([0..bb, 0..hh, 0..ss, half..d]);
        let rotated = Tensor::cat(vec![second.neg(), first], 3);
        t * cos.clone() + rotated * sin.clone()
    };
    let heads = |w: Tensor<F64, 2>, n: usize| {
        xt.clone()
            .matmul(w.unsqueeze())
            .reshape([b, s, n, d])
            .swap_dims(1, 2)
    };
    let q = rope(heads(wq.clone(), h));
    let k = rope(heads(wk.clone(), kvh));
    let v = heads(wv.clone(), kvh);
    let repeat = |t: Tensor<F64, 4>| {
        t.reshape([b, kvh, 1, s, d])
            .repeat_dim(2, h / kvh)
            .reshape([b, h, s, d])
    };
    let mut scores = q
        .matmul(repeat(k).swap_dims(2, 3))
        .div_scalar((d as f64).sqrt());
    if causal {
        let mask = Tensor::<F64, 2, burn::tensor::Bool>::tril_mask([s, s], 0, &dev);
        scores = scores.mask_fill(mask.unsqueeze::<4>(), f64::NEG_INFINITY);
    }
    let merged = softmax(scores, 3)
        .matmul(repeat(v))
        .swap_dims(1, 2)
        .reshape([b, s, h * d]);
    let out = merged.matmul(wo.clone().unsqueeze());
    let g = Tensor::<F64, 3>::from_data(TensorData::new(grad.to_vec(), [b, s, d_model]), &dev);
    let grads = (out.clone() * g).sum().backward();
    let mut results = vec![host_values(out), host_values(xt.grad(&grads).unwrap())];
    for w in [wq, wk, wv, wo] {
        results.push(host_values(w.grad(&grads).unwrap()));
    }
    results
}

/// The module on `Autodiff<B>`: output and the gradients of the input and of the query, key,
/// value and output weights, each within 1e-4 (relative to its largest value) of
/// [`f64_reference`] over the values the module holds.
fn check_gradients<B: burn_distflash::FlashAttentionBackend>(
    device: &B::Device,
    (d_model, h, kvh, d): (usize, usize, usize, usize),
    [batch, seq]: [usize; 2],
    causal: bool,
    seed: u64,
) {
    let config = DistFlashAttentionConfig::new(d_model, h)
        .with_n_kv_heads(Some(kvh))
        .with_head_dim(Some(d))
        .with_causal(causal)
        .with_initializer(burn::nn::Initializer::Normal {
            mean: 0.0,
            std: 0.3,
        });
    let module = config.init::<Autodiff<B>>(device);
    let mut rng = Rng::new(seed);
    let mut uniform =
        |n: usize| -> Vec<f64> { (0..n).map(|_| rng.uniform() as f32 as f64).collect() };
    let shape = [batch, seq, d_model];
    let (x, grad) = (
        uniform(batch * seq * d_model),
        uniform(batch * seq * d_model),
    );
    let upload =
        |v: &[f64]| Tensor::<Autodiff<B>, 3>::from_data(TensorData::new(v.to_vec(), shape), device);
    let xt = upload(&x).require_grad();
    let out = module.forward(xt.clone(), &AttentionContext::Local);
    let grads = (out.clone() * upload(&grad)).sum().backward();
    let linears = [&module.query, &module.key, &module.value, &module.output];
    let weights = linears.map(|l| host_values(l.weight.val()));
    let mut got = vec![host_values(out), host_values(xt.grad(&grads).unwrap())];
    for l in linears {
        got.push(host_values(
            l.weight.grad(&grads).expect("every weight has a gradient"),
        ));
    }
    let expected = f64_reference(
        &x,
        [&weights[0], &weights[1], &weights[2], &weights[3]],
        &grad,
        shape,
        (h, kvh, d),
        causal,
    );
    let names = ["output", "dx", "dWq", "dWk", "dWv", "dWo"];
    for ((name, got), expected) in names.iter().zip(&got).zip(&expected) {
        let scale = expected.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
        let err = got.iter().zip(expected).fold(0f64, |m, (g, e)| {
            if g.is_finite() {
                m.max((g - e).abs())
            } else {
                f64::INFINITY
            }
        });
        assert!(
            err <= 1e-4 * scale,
            "{name} of d_model {d_model}, {h}/{kvh} heads of {d}, {batch} x {seq} tokens, causal \
             {causal}: off by {err:e} at values up to {scale:e}"
        );
    }
}

/// Short sequences (fewer rows than a matmul tile), odd head counts, GQA ratios and every head
/// dim the kernels take, on wgpu: the products of the projections' gradients once went wrong
/// there for 8 and 16 rows (Burn's matmul of a transposed view).
#[test]
fn every_gradient_on_wgpu_matches_f64_for_short_sequences_and_odd_heads() {
    let device = cubecl::wgpu::WgpuDevice::Cpu;
    let cases = [
        ((40, 33, 3, 16), [1, 8], false),
        ((40, 33, 3, 16), [2, 19], true),
        ((40, 33, 11, 16), [1, 16], true),
        ((24, 4, 2, 32), [1, 1], true),
        ((36, 6, 3, 64), [1, 5], false),
        ((20, 3, 1, 96), [3, 3], true),
        ((48, 2, 2, 128), [1, 17], true),
        ((16, 1, 1, 256), [1, 9], false),
    ];
    for (case, (heads, tokens, causal)) in cases.into_iter().enumerate() {
        check_gradients::<WgpuF32>(&device, heads, tokens, causal, 40 + case as u64);
    }
}

/// The same check on ndarray, the backend whose matmul takes views as they are.
#[test]
fn every_gradient_on_ndarray_matches_f64_for_short_sequences_and_odd_heads() {
    check_gradients::<Cpu>(&DEVICE, (40, 33, 3, 16), [1, 8], false, 60);
    check_gradients::<Cpu>(&DEVICE, (36, 6, 3, 64), [2, 7], true, 61);
}
