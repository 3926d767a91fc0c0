//! The CubeCL kernels against the f64 reference (`distflash-test-support`): forward, backward, masks
//! and offsets, GQA, odd lengths, every head dim, grids folded past a grid axis, fully-masked
//! rows, chunk-by-chunk stepping and merging, and bad input; the Hopper kernels in their own
//! modules (`hopper_forward`, `hopper_backward`, `hopper_steps`, `hopper_gemm`; `hopper_cases`
//! holds what they share).
//!
//! The suite is generic over the CubeCL runtime. It runs on wgpu (Mesa's software Vulkan in CI)
//! and, with `--ignored`, on CUDA (the GPU machine), for both kernel variants there. The CUDA
//! source CubeCL generates is checked without a GPU in `generated_cuda`.

mod generated_cuda;
mod hopper_backward;
mod hopper_cases;
mod hopper_forward;
mod hopper_gemm;
mod hopper_steps;

use cubecl::prelude::*;
use distflash_kernels::{
    AttentionDims, DeviceTensor, Documents, ElemType, GradAccumulators, KernelError, Mask,
    ScheduleError, SlidingWindow, SoftmaxState, StepOptions, Variant,
};
use distflash_test_support::{
    self as oracle, assert_close, exact, naive_rounding, to_f32, to_f64, Rng,
};

/// One attention problem with its host data.
struct Case {
    dims: AttentionDims,
    mask: Mask,
    elem: ElemType,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    grad_out: Vec<f64>,
}

impl Case {
    #[allow(clippy::too_many_arguments)]
    fn new(
        seed: u64,
        (batch, q_heads, kv_heads): (usize, usize, usize),
        (q_len, kv_len, head_dim): (usize, usize, usize),
        mask: Mask,
        elem: ElemType,
    ) -> Self {
        let dims = AttentionDims {
            batch,
            q_heads,
            kv_heads,
            q_len,
            kv_len,
            head_dim,
        };
        let mut rng = Rng::new(seed);
        let nq = batch * q_heads * q_len * head_dim;
        let nk = batch * kv_heads * kv_len * head_dim;
        // Amplitude 2 gives peaked softmax rows, so masking and max tracking matter.
        let q = rng.tensor(nq, 2.0, elem);
        let k = rng.tensor(nk, 2.0, elem);
        let v = rng.tensor(nk, 1.0, elem);
        let grad_out = rng.tensor(nq, 1.0, elem);
        Self {
            dims,
            mask,
            elem,
            q,
            k,
            v,
            grad_out,
        }
    }

    fn scale(&self) -> f64 {
        1.0 / (self.dims.head_dim as f64).sqrt()
    }

    /// Every `q . k` near -900 (4 times keys of -4 plus multiples of 1/32 below 1, all exact in
    /// f16 and bf16), so that keys zero-filled past a chunk's end, scoring 0, would dominate any
    /// row they leaked into.
    fn set_extreme_scores(&mut self) {
        let mut rng = Rng::new(68);
        self.q = vec![4.0; self.q.len()];
        self.k = (0..self.k.len())
            .map(|_| -4.0 + (rng.uniform().abs() * 32.0).floor().min(31.0) / 32.0)
            .collect();
    }

    /// Scores that rise from key to key: each key holds its 64-key tile's level (0.75 a tile)
    /// plus a little noise, and each 32 query rows scale the rise by 1, 1/2 or 1/4. Every value
    /// is a multiple of 1/32 with at most 7 significant bits, exact in f16 and bf16.
    fn set_rising_scores(&mut self) {
        let d = self.dims;
        let mut rng = Rng::new(72);
        self.q = (0..self.q.len())
            .map(|i| [1.0, 0.5, 0.25][(i / d.head_dim % d.q_len / 32) % 3])
            .collect();
        self.k = (0..self.k.len())
            .map(|i| {
                let key = (i / d.head_dim) % d.kv_len;
                0.75 * (key / 64) as f64 + (rng.uniform().abs() * 8.0).floor() / 32.0
            })
            .collect();
    }

    /// The reference forward in f64, exact and rounded as a naive kernel in the element type
    /// would round it (the two ends of `assert_close`'s tolerance).
    fn reference_forward(&self) -> (oracle::ReferenceForward, oracle::ReferenceForward) {
        let forward = |round: oracle::Rounding| {
            let (q, k, v) = (&self.q, &self.k, &self.v);
            oracle::forward(&self.dims, q, k, v, &self.mask, self.scale(), round)
        };
        (forward(exact), forward(naive_rounding(self.elem)))
    }

    /// The reference gradients in f64 (from `grad_out`), exact and rounded as a naive kernel in
    /// the element type would round them.
    fn reference_backward(&self) -> (oracle::ReferenceGrads, oracle::ReferenceGrads) {
        let backward = |round: oracle::Rounding| {
            let (q, k, v, grad_out) = (&self.q, &self.k, &self.v, &self.grad_out);
            oracle::backward(
                &self.dims,
                q,
                k,
                v,
                grad_out,
                &self.mask,
                self.scale(),
                round,
            )
        };
        (backward(exact), backward(naive_rounding(self.elem)))
    }

    fn upload<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        data: &[f64],
        shape: Vec<usize>,
    ) -> DeviceTensor {
        DeviceTensor::from_f32(client, &to_f32(data), shape, self.elem)
    }

    fn qkv<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
    ) -> (DeviceTensor, DeviceTensor, DeviceTensor) {
        (
            self.upload(client, &self.q, self.dims.q_shape()),
            self.upload(client, &self.k, self.dims.kv_shape()),
            self.upload(client, &self.v, self.dims.kv_shape()),
        )
    }
}

fn read<R: Runtime>(client: &ComputeClient<R>, t: &DeviceTensor) -> Vec<f64> {
    to_f64(&t.to_f32(client))
}

fn nan_tensor<R: Runtime>(
    client: &ComputeClient<R>,
    shape: Vec<usize>,
    elem: ElemType,
) -> DeviceTensor {
    let n = shape.iter().product();
    DeviceTensor::from_f32(client, &vec![f32::NAN; n], shape, elem)
}

fn supports<R: Runtime>(client: &ComputeClient<R>, elem: ElemType) -> bool {
    let ty = match elem {
        ElemType::F32 => f32::as_type_native_unchecked(),
        ElemType::F16 => half::f16::as_type_native_unchecked(),
        ElemType::BF16 => half::bf16::as_type_native_unchecked(),
    };
    client.properties().supports_type(ty)
}

/// The variants to test for `elem` on this runtime: none where the runtime cannot run the type
/// (said on stderr), the portable kernels, and the tensor-core kernels where available.
fn configurations<R: Runtime>(
    client: &ComputeClient<R>,
    elem: ElemType,
) -> Vec<(ElemType, Variant)> {
    if !supports(client, elem) {
        eprintln!("skipping {elem:?}: not supported by this runtime");
        return Vec::new();
    }
    let mut out = vec![(elem, Variant::Portable)];
    if [64, 128]
        .into_iter()
        .any(|head_dim| distflash_kernels::tensor_core_available(client, elem, head_dim))
    {
        out.push((elem, Variant::TensorCore));
    }
    out
}

fn options(case: &Case, variant: Variant) -> StepOptions {
    StepOptions {
        mask: case.mask.clone(),
        scale: None,
        variant,
        deterministic: false,
    }
}

/// The backward modes worth checking for a variant: the tensor-core backward has a fused one
/// (dQ by atomics, the default) and a deterministic one; the portable kernels have one.
fn backward_modes(variant: Variant) -> Vec<bool> {
    match variant {
        Variant::TensorCore => vec![false, true],
        _ => vec![false],
    }
}

/// Runs the whole forward and checks O and lse (poisoned beforehand) against the reference.
fn check_forward<R: Runtime>(client: &ComputeClient<R>, case: &Case, variant: Variant) {
    let (q, k, v) = case.qkv(client);
    let dims = &case.dims;
    let state =
        SoftmaxState::empty(client, dims.batch, dims.q_heads, dims.q_len, dims.head_dim).unwrap();
    distflash_kernels::forward_step(client, &q, &k, &v, &state, &options(case, variant)).unwrap();
    let out = nan_tensor(client, dims.q_shape(), case.elem);
    let lse = nan_tensor(client, dims.row_shape(), ElemType::F32);
    distflash_kernels::finalize_into(client, &state, &out, &lse).unwrap();

    let (exact_fwd, naive) = case.reference_forward();
    // The step + finalize path, then the one-call attention (one kernel on the tensor cores).
    let (whole_out, whole_lse) =
        distflash_kernels::attention(client, &q, &k, &v, &options(case, variant)).unwrap();
    for (path, out, lse) in [("step", &out, &lse), ("attention", &whole_out, &whole_lse)] {
        let what = format!("forward ({path}) {dims:?} {:?} {variant:?}", case.mask);
        assert_close(
            &format!("{what}: O"),
            &read(client, out),
            &exact_fwd.out,
            &naive.out,
            case.elem,
        );
        // lse is f32 in every variant: compare against f32 precision.
        assert_close(
            &format!("{what}: lse"),
            &read(client, lse),
            &exact_fwd.lse,
            &exact_fwd.lse,
            ElemType::F32,
        );
    }
}

/// Runs the backward (in every mode of `variant`) from the kernel's own forward, into
/// accumulators that start non-zero (so accumulation, and every element being written, is
/// checked); the deterministic mode runs twice and must give bitwise the same gradients.
fn check_backward<R: Runtime>(client: &ComputeClient<R>, case: &Case, variant: Variant) {
    for deterministic in backward_modes(variant) {
        check_backward_mode(client, case, variant, deterministic);
    }
}

/// Asserts that each named pair of tensors holds bitwise the same values.
fn assert_same_bits<R: Runtime>(
    client: &ComputeClient<R>,
    what: &str,
    pairs: [(&str, &DeviceTensor, &DeviceTensor); 3],
) {
    let bits =
        |t: &DeviceTensor| -> Vec<u64> { read(client, t).iter().map(|x| x.to_bits()).collect() };
    for (name, a, b) in pairs {
        assert!(bits(a) == bits(b), "{what}: {name} differs between runs");
    }
}

fn check_backward_mode<R: Runtime>(
    client: &ComputeClient<R>,
    case: &Case,
    variant: Variant,
    deterministic: bool,
) {
    let (q, k, v) = case.qkv(client);
    let dims = &case.dims;
    let opts = StepOptions {
        deterministic,
        ..options(case, variant)
    };
    let (out, lse) = distflash_kernels::attention(client, &q, &k, &v, &opts).unwrap();
    let grad_out = case.upload(client, &case.grad_out, dims.q_shape());
    let delta = distflash_kernels::backward_delta(client, &out, &grad_out).unwrap();

    let mut rng = Rng::new(7);
    let start_dq = rng.tensor(q.len(), 1.0, ElemType::F32);
    let start_dk = rng.tensor(k.len(), 1.0, ElemType::F32);
    let start_dv = rng.tensor(v.len(), 1.0, ElemType::F32);
    let up =
        |d: &[f64], s: Vec<usize>| DeviceTensor::from_f32(client, &to_f32(d), s, ElemType::F32);
    let run = || {
        let grads = GradAccumulators {
            dq: up(&start_dq, dims.q_shape()),
            dk: up(&start_dk, dims.kv_shape()),
            dv: up(&start_dv, dims.kv_shape()),
        };
        distflash_kernels::backward_step(
            client, &q, &k, &v, &grad_out, &lse, &delta, &grads, &opts,
        )
        .unwrap();
        grads
    };
    let grads = run();
    if deterministic {
        let again = run();
        assert_same_bits(
            client,
            &format!("deterministic backward {variant:?}"),
            [
                ("dq", &grads.dq, &again.dq),
                ("dk", &grads.dk, &again.dk),
                ("dv", &grads.dv, &again.dv),
            ],
        );
    }

    let args = (&case.q, &case.k, &case.v, &case.grad_out);
    let exact_g = oracle::backward(
        dims,
        args.0,
        args.1,
        args.2,
        args.3,
        &case.mask,
        case.scale(),
        exact,
    );
    let naive = oracle::backward(
        dims,
        args.0,
        args.1,
        args.2,
        args.3,
        &case.mask,
        case.scale(),
        naive_rounding(case.elem),
    );
    let what = format!(
        "backward {dims:?} {:?} {variant:?} deterministic {deterministic}",
        case.mask
    );
    let minus = |got: Vec<f64>, start: &[f64]| -> Vec<f64> {
        got.iter().zip(start).map(|(g, s)| g - s).collect()
    };
    assert_close(
        &format!("{what}: dq"),
        &minus(read(client, &grads.dq), &start_dq),
        &exact_g.dq,
        &naive.dq,
        case.elem,
    );
    assert_close(
        &format!("{what}: dk"),
        &minus(read(client, &grads.dk), &start_dk),
        &exact_g.dk,
        &naive.dk,
        case.elem,
    );
    assert_close(
        &format!("{what}: dv"),
        &minus(read(client, &grads.dv), &start_dv),
        &exact_g.dv,
        &naive.dv,
        case.elem,
    );

    // The one-call backward: gradients finished in the element type (on the tensor cores
    // written by the kernels themselves), bitwise reproducible in the deterministic mode.
    let whole = || {
        distflash_kernels::attention_backward(client, &q, &k, &v, &out, &lse, &grad_out, &opts)
            .unwrap()
    };
    let (dq, dk, dv) = whole();
    if deterministic {
        let (dq2, dk2, dv2) = whole();
        assert_same_bits(
            client,
            &format!("deterministic attention_backward {variant:?}"),
            [("dq", &dq, &dq2), ("dk", &dk, &dk2), ("dv", &dv, &dv2)],
        );
    }
    for (name, got, exact_grad, naive_grad) in [
        ("dq", &dq, &exact_g.dq, &naive.dq),
        ("dk", &dk, &exact_g.dk, &naive.dk),
        ("dv", &dv, &exact_g.dv, &naive.dv),
    ] {
        assert_eq!(
            got.elem, case.elem,
            "{what}: attention_backward {name} type"
        );
        assert_close(
            &format!("{what}: attention_backward {name}"),
            &read(client, got),
            exact_grad,
            naive_grad,
            case.elem,
        );
    }
}

/// Masks exercised by the shape cases: none, causal aligned at the end (the usual decoder
/// training case when q_len == kv_len), and causal with keys ahead of queries (leading rows see
/// nothing at all).
fn masks(q_len: usize, kv_len: usize) -> Vec<Mask> {
    vec![
        Mask::none(),
        Mask::causal().at(kv_len as i64 - q_len as i64, 0),
        Mask::causal().at(0, 40),
    ]
}

/// Cumulative lengths of documents of the given lengths, repeated and cut to end at `len`.
fn packed(lengths: &[usize], len: usize) -> Vec<usize> {
    let mut cu = vec![0];
    for &l in lengths.iter().cycle() {
        let end = (cu[cu.len() - 1] + l).min(len);
        cu.push(end);
        if end == len {
            return cu;
        }
    }
    unreachable!("cycle never ends")
}

/// Which of [`band_masks`] a test takes: each group compiles its own kernel variants, so the two
/// are separate tests a runner can spread over processes.
#[derive(Clone, Copy, PartialEq)]
enum BandGroup {
    /// Sliding windows alone.
    Windows,
    /// Packed documents, with and without a window.
    Documents,
}

/// Sliding windows or packed documents for a `batch` x `q_len` x `kv_len` call whose query and
/// key chunks both end at the sequence's last position. Windows: 1, 37 and longer than the
/// sequence, and a two-sided window without causality. Documents: lengths 1, odd and longer than
/// a tile (shared, and one list per batch row), bidirectional documents, documents with a window.
fn band_masks(group: BandGroup, batch: usize, q_len: usize, kv_len: usize) -> Vec<Mask> {
    let total = q_len.max(kv_len);
    let at = |m: Mask| m.at((total - q_len) as i64, (total - kv_len) as i64);
    if group == BandGroup::Windows {
        return vec![
            at(Mask::causal().with_window(SlidingWindow::causal(1).unwrap())),
            at(Mask::causal().with_window(SlidingWindow::causal(37).unwrap())),
            at(Mask::causal().with_window(SlidingWindow::causal(10 * total).unwrap())),
            at(Mask::none().with_window(SlidingWindow::two_sided(19, 45))),
        ];
    }
    let docs = Documents::from_cu_seqlens(&packed(&[1, 7, 64, 3, 130, 33], total)).unwrap();
    let rows: Vec<Vec<usize>> = (0..batch)
        .map(|b| packed(&[5 + 40 * b, 1, 71, 2], total))
        .collect();
    let per_row = Documents::per_batch_row(&rows).unwrap();
    vec![
        at(Mask::causal().with_documents(docs.clone())),
        at(Mask::causal().with_documents(per_row)),
        at(Mask::none().with_documents(docs.clone())),
        at(Mask::causal()
            .with_documents(docs)
            .with_window(SlidingWindow::causal(50).unwrap())),
    ]
}

/// Sliding windows (see [`band_masks`]), forward and backward, against the reference.
pub fn band_windows_match_reference<R: Runtime>(client: &ComputeClient<R>, elem: ElemType) {
    band_masks_match_reference(client, elem, BandGroup::Windows)
}

/// Packed documents (see [`band_masks`]), forward and backward, against the reference.
pub fn band_documents_match_reference<R: Runtime>(client: &ComputeClient<R>, elem: ElemType) {
    band_masks_match_reference(client, elem, BandGroup::Documents)
}

/// One group of [`band_masks`], forward and backward, against the reference: shapes with several
/// key tiles and query blocks, GQA and two batch rows.
fn band_masks_match_reference<R: Runtime>(
    client: &ComputeClient<R>,
    elem: ElemType,
    group: BandGroup,
) {
    for (elem, variant) in configurations(client, elem) {
        for (heads, lens) in [
            ((1, 4, 2), (131, 197, 64)),
            ((2, 3, 3), (96, 96, 128)),
            ((1, 2, 1), (300, 300, 64)),
        ] {
            for mask in band_masks(group, heads.0, lens.0, lens.1) {
                let case = Case::new(53, heads, lens, mask, elem);
                check_forward(client, &case, variant);
                check_backward(client, &case, variant);
            }
        }
    }
}

/// Band masks at their edges, each with its `(q_len, kv_len)`: keys that lie ahead of every query
/// (a window sees a few, a two-sided window none), a window wider before than after, the diagonal
/// alone, documents that start inside the key chunk or end inside the query chunk, and runs of
/// one-token documents with and without a window.
fn band_edges() -> Vec<((usize, usize), Mask)> {
    let window = |before, after| Mask::none().with_window(SlidingWindow::two_sided(before, after));
    let split = Documents::from_cu_seqlens(&[0, 250, 350, 600]).unwrap();
    let tiny = Documents::from_cu_seqlens(&packed(&[1, 1, 2, 1, 150, 1, 3], 300)).unwrap();
    vec![
        (
            (300, 300),
            Mask::causal()
                .with_window(SlidingWindow::causal(10).unwrap())
                .at(0, 200),
        ),
        ((300, 300), window(5, 3).at(500, 0)),
        ((200, 517), window(70, 130).at(100, 0)),
        ((300, 300), window(0, 0)),
        (
            (300, 300),
            Mask::causal().with_documents(split.clone()).at(0, 300),
        ),
        ((300, 300), Mask::causal().with_documents(split).at(300, 0)),
        ((300, 300), Mask::causal().with_documents(tiny.clone())),
        (
            (300, 300),
            Mask::causal()
                .with_documents(tiny)
                .with_window(SlidingWindow::causal(2).unwrap()),
        ),
    ]
}

/// The band masks at their edges ([`band_edges`]), forward and backward, against the reference.
pub fn band_mask_edges_match_reference<R: Runtime>(client: &ComputeClient<R>, elem: ElemType) {
    let cases = band_edges();
    for (elem, variant) in configurations(client, elem) {
        for ((q_len, kv_len), mask) in &cases {
            let case = Case::new(61, (1, 2, 1), (*q_len, *kv_len, 64), mask.clone(), elem);
            check_forward(client, &case, variant);
            check_backward(client, &case, variant);
        }
    }
}

/// Scores far below zero (every `q . k` near -900) beside a key chunk that ends inside a key
/// block: the block's zero-filled keys past the chunk score 0, far above every real key, so the
/// backward must keep them masked (unmasked, their probability `exp(0 - lse)` overflows f32 and
/// reaches dQ as NaN). Unmasked and causal at an offset where every row sees every key.
pub fn extreme_scores_beside_a_partial_key_block<R: Runtime>(
    client: &ComputeClient<R>,
    elem: ElemType,
) {
    for (elem, variant) in configurations(client, elem) {
        for mask in [Mask::none(), Mask::causal().at(200, 0)] {
            let mut case = Case::new(67, (1, 2, 1), (64, 100, 64), mask, elem);
            case.set_extreme_scores();
            check_forward(client, &case, variant);
            check_backward(client, &case, variant);
        }
    }
}

/// Scores that rise from key tile to key tile, by about 8.7 (base 2) a tile in some 32-row
/// groups of queries and by a half or a quarter of that in others: the tensor-core forward
/// keeps a stale row max until one of a plane's rows passes it by more than its slack, so some
/// planes rescale the running output on every tile, others every second or fourth tile, and in
/// between weigh against a max up to 8 below the true one. Unmasked and causal, forward and
/// backward.
pub fn rising_scores<R: Runtime>(client: &ComputeClient<R>, elem: ElemType) {
    for (elem, variant) in configurations(client, elem) {
        for mask in [Mask::none(), Mask::causal().at(40, 0)] {
            let mut case = Case::new(71, (1, 2, 1), (130, 340, 64), mask.clone(), elem);
            let d = case.dims;
            case.set_rising_scores();
            check_forward(client, &case, variant);
            check_backward(client, &case, variant);

            // A stored state holds each row's exact max, though its tiles weighed against a
            // stale one.
            let (q, k, v) = case.qkv(client);
            let state =
                distflash_kernels::forward_first_step(client, &q, &k, &v, &options(&case, variant))
                    .unwrap();
            let m = read(client, &state.m);
            let group = d.q_heads / d.kv_heads;
            for (row, &got) in m.iter().enumerate() {
                let (bh, i) = (row / d.q_len, row % d.q_len);
                let (b, h) = (bh / d.q_heads, bh % d.q_heads);
                let q_row = &case.q[row * d.head_dim..(row + 1) * d.head_dim];
                let expected = (0..d.kv_len)
                    .filter(|&j| case.mask.visible(b, i, j))
                    .map(|j| {
                        let at = ((b * d.kv_heads + h / group) * d.kv_len + j) * d.head_dim;
                        let k_row = &case.k[at..at + d.head_dim];
                        case.scale() * q_row.iter().zip(k_row).map(|(x, y)| x * y).sum::<f64>()
                    })
                    .fold(f64::NEG_INFINITY, f64::max);
                assert!(
                    (got - expected).abs() <= 1e-4 * expected.abs().max(1.0),
                    "rising scores {mask:?} {elem:?} {variant:?}: state max of row {row} is {got}, \
                     expected {expected}"
                );
            }
        }
    }
}

pub fn forward_matches_reference<R: Runtime>(client: &ComputeClient<R>, elem: ElemType) {
    for (elem, variant) in configurations(client, elem) {
        for (heads, lens) in [
            ((1, 8, 2), (383, 517, 64)),
            ((2, 3, 3), (96, 96, 128)),
            ((1, 4, 1), (33, 70, 64)),
        ] {
            for mask in masks(lens.0, lens.1) {
                let case = Case::new(11, heads, lens, mask, elem);
                check_forward(client, &case, variant);
            }
        }
    }
}

pub fn backward_matches_reference<R: Runtime>(client: &ComputeClient<R>, elem: ElemType) {
    for (elem, variant) in configurations(client, elem) {
        for (heads, lens) in [((1, 4, 2), (131, 197, 64)), ((1, 2, 1), (64, 48, 128))] {
            for mask in masks(lens.0, lens.1) {
                let case = Case::new(23, heads, lens, mask, elem);
                check_backward(client, &case, variant);
            }
        }
    }
}

/// Splits k and v into key chunks `[start, end)` along the sequence.
fn key_chunk<R: Runtime>(
    client: &ComputeClient<R>,
    case: &Case,
    data: &[f64],
    start: usize,
    end: usize,
) -> DeviceTensor {
    let d = case.dims;
    let mut out = Vec::new();
    for bh in 0..d.batch * d.kv_heads {
        let base = bh * d.kv_len * d.head_dim;
        out.extend_from_slice(&data[base + start * d.head_dim..base + end * d.head_dim]);
    }
    case.upload(
        client,
        &out,
        vec![d.batch, d.kv_heads, end - start, d.head_dim],
    )
}

fn chunk_mask(case: &Case, start: usize) -> Mask {
    case.mask
        .clone()
        .at(case.mask.q_offset, case.mask.kv_offset + start as i64)
}

/// Attention over the concatenation of key/value chunks equals stepping chunk by chunk (from an
/// empty state, or from `forward_first_step` to `forward_last_step`), and equals merging
/// independent partials; the backward summed over chunks equals the whole backward.
pub fn chunks_step_and_merge_exactly<R: Runtime>(client: &ComputeClient<R>, elem: ElemType) {
    for (elem, variant) in configurations(client, elem) {
        let causal = Mask::causal().at(150, 0);
        let documents = Documents::from_cu_seqlens(&packed(&[9, 61, 2, 100], 227)).unwrap();
        let banded = Mask::causal()
            .with_documents(documents)
            .with_window(SlidingWindow::causal(70).unwrap())
            .at(150, 0);
        for mask in [Mask::none(), causal, banded] {
            let case = Case::new(31, (1, 4, 2), (77, 227, 64), mask.clone(), elem);
            let dims = case.dims;
            let (q, k, v) = case.qkv(client);
            let opts = options(&case, variant);
            let (whole_out, whole_lse) =
                distflash_kernels::attention(client, &q, &k, &v, &opts).unwrap();
            let bounds = [0, 50, 113, 227];

            let empty = || {
                SoftmaxState::empty(client, dims.batch, dims.q_heads, dims.q_len, dims.head_dim)
                    .unwrap()
            };
            // Key chunk `w[0]..w[1]` and its step's options.
            let chunk_step = |w: &[usize]| {
                let (kc, vc) = (
                    key_chunk(client, &case, &case.k, w[0], w[1]),
                    key_chunk(client, &case, &case.v, w[0], w[1]),
                );
                let step_opts = StepOptions {
                    mask: chunk_mask(&case, w[0]),
                    ..opts
                };
                (kc, vc, step_opts)
            };
            let (stepped, merged) = (empty(), empty());
            for w in bounds.windows(2) {
                let (kc, vc, step_opts) = chunk_step(w);
                distflash_kernels::forward_step(client, &q, &kc, &vc, &stepped, &step_opts)
                    .unwrap();
                let partial = empty();
                distflash_kernels::forward_step(client, &q, &kc, &vc, &partial, &step_opts)
                    .unwrap();
                distflash_kernels::merge(client, &merged, &partial).unwrap();
            }
            let what = format!("chunks {mask:?} {elem:?} {variant:?}");
            let scale = case.scale();
            let args = (&case.q, &case.k, &case.v);
            let exact_fwd =
                oracle::forward(&dims, args.0, args.1, args.2, &case.mask, scale, exact);
            let naive = oracle::forward(
                &dims,
                args.0,
                args.1,
                args.2,
                &case.mask,
                scale,
                naive_rounding(elem),
            );
            // The first chunk starts a state and the last one finishes it, each in one call.
            let windows: Vec<&[usize]> = bounds.windows(2).collect();
            let (kc, vc, first_opts) = chunk_step(windows[0]);
            let fused =
                distflash_kernels::forward_first_step(client, &q, &kc, &vc, &first_opts).unwrap();
            for w in &windows[1..windows.len() - 1] {
                let (kc, vc, step_opts) = chunk_step(w);
                distflash_kernels::forward_step(client, &q, &kc, &vc, &fused, &step_opts).unwrap();
            }
            let (kc, vc, last_opts) = chunk_step(windows[windows.len() - 1]);
            let first_to_last =
                distflash_kernels::forward_last_step(client, &q, &kc, &vc, fused, &last_opts)
                    .unwrap();
            let whole_lse_host = read(client, &whole_lse);
            let finished = [
                (
                    "stepped",
                    distflash_kernels::finalize(client, &stepped, elem).unwrap(),
                ),
                (
                    "merged",
                    distflash_kernels::finalize(client, &merged, elem).unwrap(),
                ),
                ("first to last", first_to_last),
            ];
            for (name, (out, lse)) in finished {
                assert_close(
                    &format!("{what} {name} O"),
                    &read(client, &out),
                    &exact_fwd.out,
                    &naive.out,
                    elem,
                );
                // lse stays f32 across chunks: it must match the one-call lse to f32 precision.
                assert_close(
                    &format!("{what} {name} lse"),
                    &read(client, &lse),
                    &whole_lse_host,
                    &whole_lse_host,
                    ElemType::F32,
                );
            }

            // Backward: the sum over key chunks of the per-pair gradients equals the whole.
            let grad_out = case.upload(client, &case.grad_out, dims.q_shape());
            let delta = distflash_kernels::backward_delta(client, &whole_out, &grad_out).unwrap();
            let whole_g = GradAccumulators::zeros(client, &dims).unwrap();
            distflash_kernels::backward_step(
                client, &q, &k, &v, &grad_out, &whole_lse, &delta, &whole_g, &opts,
            )
            .unwrap();
            let dq = distflash_kernels::zeros_f32(client, dims.q_shape()).unwrap();
            let (mut dk, mut dv) = (Vec::new(), Vec::new());
            for w in bounds.windows(2) {
                let (kc, vc, step_opts) = chunk_step(w);
                let chunk_dims = AttentionDims {
                    kv_len: w[1] - w[0],
                    ..dims
                };
                let g = GradAccumulators {
                    dq: dq.clone(),
                    ..GradAccumulators::zeros(client, &chunk_dims).unwrap()
                };
                distflash_kernels::backward_step(
                    client, &q, &kc, &vc, &grad_out, &whole_lse, &delta, &g, &step_opts,
                )
                .unwrap();
                dk.push((w[0], w[1], read(client, &g.dk)));
                dv.push((w[0], w[1], read(client, &g.dv)));
            }
            let assemble = |parts: &[(usize, usize, Vec<f64>)]| {
                let mut full = vec![0.0; dims.batch * dims.kv_heads * dims.kv_len * dims.head_dim];
                for (s, e, part) in parts {
                    let len = e - s;
                    for bh in 0..dims.batch * dims.kv_heads {
                        let dst = (bh * dims.kv_len + s) * dims.head_dim;
                        let src = bh * len * dims.head_dim;
                        full[dst..dst + len * dims.head_dim]
                            .copy_from_slice(&part[src..src + len * dims.head_dim]);
                    }
                }
                full
            };
            let f32_acc = ElemType::F32;
            assert_close(
                &format!("{what} dq"),
                &read(client, &dq),
                &read(client, &whole_g.dq),
                &read(client, &whole_g.dq),
                f32_acc,
            );
            assert_close(
                &format!("{what} dk"),
                &assemble(&dk),
                &read(client, &whole_g.dk),
                &read(client, &whole_g.dk),
                f32_acc,
            );
            assert_close(
                &format!("{what} dv"),
                &assemble(&dv),
                &read(client, &whole_g.dv),
                &read(client, &whole_g.dv),
                f32_acc,
            );
        }
    }
}

/// A row that sees no key gives O = 0 and lse = -inf (never NaN), and zero gradients.
pub fn fully_masked_rows_are_zero<R: Runtime>(client: &ComputeClient<R>, elem: ElemType) {
    for (elem, variant) in configurations(client, elem) {
        // Keys start at position 50: query rows 0..50 see nothing.
        let mask = Mask::causal().at(0, 50);
        let case = Case::new(5, (1, 2, 2), (80, 64, 64), mask, elem);
        let (q, k, v) = case.qkv(client);
        let opts = options(&case, variant);
        let (out, lse) = distflash_kernels::attention(client, &q, &k, &v, &opts).unwrap();
        let (out, lse) = (read(client, &out), read(client, &lse));
        for h in 0..2 {
            for i in 0..80 {
                let row_lse = lse[h * 80 + i];
                if i < 50 {
                    assert_eq!(
                        row_lse,
                        f64::NEG_INFINITY,
                        "row {i} lse ({elem:?} {variant:?})"
                    );
                    assert!(
                        out[(h * 80 + i) * 64..][..64].iter().all(|&x| x == 0.0),
                        "row {i} output"
                    );
                } else {
                    assert!(row_lse.is_finite(), "row {i} lse {row_lse}");
                }
            }
        }
    }
}

/// Bad input is refused with an error that names the problem; nothing is launched.
pub fn bad_input_is_refused<R: Runtime>(client: &ComputeClient<R>) {
    let e = ElemType::F32;
    let t = |shape: Vec<usize>| {
        DeviceTensor::from_f32(client, &vec![0.0; shape.iter().product()], shape, e)
    };
    let opts = StepOptions::default();
    let q = t(vec![1, 4, 8, 64]);
    let k = t(vec![1, 2, 8, 64]);
    let err = |r: Result<_, KernelError>| {
        r.map(|_: (DeviceTensor, DeviceTensor)| ())
            .unwrap_err()
            .to_string()
    };

    let msg = err(distflash_kernels::attention(
        client,
        &q,
        &t(vec![1, 3, 8, 64]),
        &t(vec![1, 3, 8, 64]),
        &opts,
    ));
    assert!(msg.contains("multiple of key/value heads"), "{msg}");
    let msg = err(distflash_kernels::attention(
        client,
        &q,
        &k,
        &t(vec![1, 2, 9, 64]),
        &opts,
    ));
    assert!(msg.contains("v against k"), "{msg}");
    let msg = err(distflash_kernels::attention(
        client,
        &t(vec![1, 4, 8, 48]),
        &t(vec![1, 2, 8, 48]),
        &t(vec![1, 2, 8, 48]),
        &opts,
    ));
    assert!(msg.contains("head dimension 48 is not supported"), "{msg}");
    let msg = err(distflash_kernels::attention(
        client,
        &t(vec![4, 8, 64]),
        &k,
        &k,
        &opts,
    ));
    assert!(msg.contains("must have 4 dimensions"), "{msg}");
    let half_k = DeviceTensor::from_f32(client, &vec![0.0; 1024], vec![1, 2, 8, 64], ElemType::F16);
    let msg = err(distflash_kernels::attention(
        client, &q, &half_k, &half_k, &opts,
    ));
    assert!(msg.contains("dtype"), "{msg}");

    let wrong_state = SoftmaxState::empty(client, 1, 4, 7, 64).unwrap();
    let msg = distflash_kernels::forward_step(client, &q, &k, &k, &wrong_state, &opts)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("state.o"), "{msg}");
    let msg = err(distflash_kernels::forward_last_step(
        client,
        &q,
        &k,
        &k,
        wrong_state,
        &opts,
    ));
    assert!(msg.contains("state.o"), "{msg}");
    let msg = distflash_kernels::forward_first_step(client, &q, &half_k, &half_k, &opts)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("dtype"), "{msg}");

    let nan_scale = StepOptions {
        scale: Some(f32::NAN),
        ..opts.clone()
    };
    let msg = err(distflash_kernels::attention(client, &q, &k, &k, &nan_scale));
    assert!(msg.contains("scale must be finite"), "{msg}");

    // Document boundaries: refused at construction, or when they do not fit the call.
    let bad = |r: Result<Documents, ScheduleError>| r.unwrap_err().to_string();
    let msg = bad(Documents::from_cu_seqlens(&[0, 5, 5, 8]));
    assert!(msg.contains("strictly increase"), "{msg}");
    let msg = bad(Documents::from_cu_seqlens(&[1, 8]));
    assert!(msg.contains("start at 0"), "{msg}");
    let msg = bad(Documents::per_batch_row(&[vec![0, 8], vec![0, 3, 9]]));
    assert!(msg.contains("must end at the sequence length"), "{msg}");
    let with_documents = |cu: &[usize], q_offset: i64| StepOptions {
        mask: Mask::causal()
            .with_documents(Documents::from_cu_seqlens(cu).unwrap())
            .at(q_offset, 0),
        ..opts.clone()
    };
    let msg = err(distflash_kernels::attention(
        client,
        &q,
        &k,
        &k,
        &with_documents(&[0, 3, 6], 0),
    ));
    assert!(msg.contains("the documents cover 0..6"), "{msg}");
    let msg = err(distflash_kernels::attention(
        client,
        &q,
        &k,
        &k,
        &with_documents(&[0, 3, 8], -1),
    ));
    assert!(msg.contains("positions -1..7"), "{msg}");
    let two_rows = Documents::per_batch_row(&[vec![0, 8], vec![0, 4, 8]]).unwrap();
    let msg = err(distflash_kernels::attention(
        client,
        &q,
        &k,
        &k,
        &StepOptions {
            mask: Mask::causal().with_documents(two_rows),
            ..opts.clone()
        },
    ));
    assert!(
        msg.contains("given for 2 batch rows, the call has 1"),
        "{msg}"
    );
    if !supports(client, ElemType::BF16) {
        let bf16 = |shape: Vec<usize>| {
            DeviceTensor::from_f32(
                client,
                &vec![0.0; shape.iter().product()],
                shape,
                ElemType::BF16,
            )
        };
        let (q, k) = (bf16(vec![1, 4, 8, 64]), bf16(vec![1, 2, 8, 64]));
        let msg = err(distflash_kernels::attention(client, &q, &k, &k, &opts));
        assert!(msg.contains("does not run kernels on BF16"), "{msg}");
    }
}

/// Every supported head dim, MHA, GQA and MQA, causal (aligned at the end) and full, forward
/// and backward against the reference, on tiny odd shapes: the portable backward kernels pick
/// their shared-memory tiles per head dim to fit the device (at 256 the dK/dV kernel's 16-row
/// tile needs 32,896 bytes, over lavapipe's 32 KiB, and used to give zero gradients). The
/// portable kernels run in f32 here (each head dim and element type is a shader to compile,
/// and llvmpipe compiles slowly); their f16/bf16 runs at every head dim are in the op matrix
/// (the root crate's `burn_op` tests), their f16/bf16 runs at 64 and 128 in the tests above.
pub fn head_dim_matches_reference<R: Runtime>(
    client: &ComputeClient<R>,
    head_dim: usize,
    elem: ElemType,
) {
    for (elem, variant) in configurations(client, elem) {
        let skip = match variant {
            Variant::Portable => elem != ElemType::F32,
            _ => !distflash_kernels::tensor_core_available(client, elem, head_dim),
        };
        if skip {
            continue;
        }
        for heads in [(2, 2, 2), (1, 4, 2), (1, 3, 1)] {
            for mask in [Mask::none(), masks(9, 19)[1].clone()] {
                let case = Case::new(head_dim as u64, heads, (9, 19, head_dim), mask, elem);
                check_forward(client, &case, variant);
                check_backward(client, &case, variant);
            }
        }
    }
}

/// batch x query heads = 65,536 (one more than a grid axis allows): the (batch, head) slices
/// fold over grid y and z, forward and backward still match the reference.
pub fn folded_grid_matches_reference<R: Runtime>(client: &ComputeClient<R>, elem: ElemType) {
    for (elem, variant) in configurations(client, elem) {
        if elem != ElemType::F32 && variant != Variant::TensorCore {
            continue;
        }
        let head_dim = if variant == Variant::TensorCore {
            64
        } else {
            16
        };
        let case = Case::new(3, (2, 32768, 32768), (2, 3, head_dim), Mask::causal(), elem);
        check_forward(client, &case, variant);
        check_backward(client, &case, variant);
    }
}

/// A fill of more elements than one grid axis of cubes covers (where the device's x axis is
/// small enough to make that affordable): the element-wise kernels' grid folds over y and z.
pub fn linear_grid_folds<R: Runtime>(client: &ComputeClient<R>) {
    let max_x = distflash_kernels::DeviceLimits::of(client).max_cube_count.0 as usize;
    let len = max_x.min(1 << 16) * 256 + 100;
    let tensor = nan_tensor(client, vec![len], ElemType::F32);
    distflash_kernels::fill(client, &tensor, 3.0).unwrap();
    let host = read(client, &tensor);
    let wrong = host.iter().position(|&x| x != 3.0);
    assert_eq!(wrong, None, "first unfilled element of {len}");
}

/// The head dims the suite has one test each for (`head_dims::d16` ...): every supported one.
const TESTED_HEAD_DIMS: [usize; 6] = [16, 32, 64, 96, 128, 256];

#[test]
fn every_supported_head_dim_has_a_test() {
    assert_eq!(TESTED_HEAD_DIMS, distflash_kernels::SUPPORTED_HEAD_DIMS);
}

/// Instantiates the suite for one runtime. Each element type and each head dim is its own test,
/// so a runner can spread them over processes: CubeCL compiles one kernel at a time per process,
/// and compilation (NVRTC, then the driver's PTX JIT) dominates a cold CUDA run.
macro_rules! suite {
    ($name:ident, $client:expr $(, #[$attr:meta])?) => {
        mod $name {
            use super::*;
            suite!(@per_elem forward, forward_matches_reference, $client $(, #[$attr])?);
            suite!(@per_elem backward, backward_matches_reference, $client $(, #[$attr])?);
            suite!(@per_elem chunks, chunks_step_and_merge_exactly, $client $(, #[$attr])?);
            suite!(@per_elem fully_masked, fully_masked_rows_are_zero, $client $(, #[$attr])?);
            suite!(@per_elem band_windows, band_windows_match_reference, $client $(, #[$attr])?);
            suite!(@per_elem band_documents, band_documents_match_reference, $client $(, #[$attr])?);
            suite!(@per_elem band_mask_edges, band_mask_edges_match_reference, $client $(, #[$attr])?);
            suite!(@per_elem extreme_scores, extreme_scores_beside_a_partial_key_block, $client $(, #[$attr])?);
            suite!(@per_elem rising_scores, rising_scores, $client $(, #[$attr])?);
            suite!(@per_elem folded_grid, folded_grid_matches_reference, $client $(, #[$attr])?);
            #[test] $(#[$attr])? fn bad_input() { bad_input_is_refused(&$client) }
            #[test] $(#[$attr])? fn linear_grid() { linear_grid_folds(&$client) }
            mod head_dims {
                use super::*;
                suite!(@head_dim d16, 0, $client $(, #[$attr])?);
                suite!(@head_dim d32, 1, $client $(, #[$attr])?);
                suite!(@head_dim d64, 2, $client $(, #[$attr])?);
                suite!(@head_dim d96, 3, $client $(, #[$attr])?);
                suite!(@head_dim d128, 4, $client $(, #[$attr])?);
                suite!(@head_dim d256, 5, $client $(, #[$attr])?);
            }
        }
    };
    (@head_dim $dim:ident, $index:expr, $client:expr $(, #[$attr:meta])?) => {
        mod $dim {
            use super::*;
            fn check(elem: ElemType) {
                head_dim_matches_reference(&$client, TESTED_HEAD_DIMS[$index], elem)
            }
            #[test] $(#[$attr])? fn f32() { check(ElemType::F32) }
            #[test] $(#[$attr])? fn f16() { check(ElemType::F16) }
            #[test] $(#[$attr])? fn bf16() { check(ElemType::BF16) }
        }
    };
    (@per_elem $test:ident, $check:ident, $client:expr $(, #[$attr:meta])?) => {
        mod $test {
            use super::*;
            #[test] $(#[$attr])? fn f32() { $check(&$client, ElemType::F32) }
            #[test] $(#[$attr])? fn f16() { $check(&$client, ElemType::F16) }
            #[test] $(#[$attr])? fn bf16() { $check(&$client, ElemType::BF16) }
        }
    };
}

suite!(
    wgpu,
    cubecl::wgpu::WgpuRuntime::client(&cubecl::wgpu::WgpuDevice::Cpu)
);
suite!(
    cuda,
    cubecl::cuda::CudaRuntime::client(&cubecl::cuda::CudaDevice::new(0)),
    #[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
);

/// Larger and odd shapes, checked on the GPU only (the f64 host reference takes seconds here):
/// 5 heads at 1023 tokens with head dim 128, GQA with 32 query heads over 8 key/value heads, and
/// a later query chunk against a longer key chunk (`q_offset` 300, not a multiple of any tile), so
/// the kernels' unmasked interior tiles, diagonal tiles and partial last tiles all run; a sliding
/// window and packed documents over many tiles, so skipped tiles and masked leading tiles run.
pub fn larger_shapes_match_reference<R: Runtime>(client: &ComputeClient<R>, elem: ElemType) {
    let later_chunk = Mask::causal().at(300, 0);
    // A window over several key tiles, not a multiple of any; documents from 1 to 700 tokens
    // crossing tiles and blocks (one list per batch row), with and without a window.
    let long_window = Mask::causal().with_window(SlidingWindow::causal(333).unwrap());
    let rows = vec![
        packed(&[700, 1, 3, 129, 64, 203], 1100),
        packed(&[17, 250, 90], 1100),
    ];
    let long_documents = Mask::causal()
        .with_documents(Documents::per_batch_row(&rows).unwrap())
        .at(400, 0);
    let windowed_documents = Mask::causal()
        .with_documents(Documents::from_cu_seqlens(&rows[1]).unwrap())
        .with_window(SlidingWindow::causal(100).unwrap())
        .at(400, 0);
    for (elem, variant) in configurations(client, elem) {
        for (heads, lens, mask) in [
            ((1, 5, 5), (1023, 1023, 128), Mask::causal()),
            ((1, 32, 8), (257, 257, 64), Mask::causal()),
            ((1, 4, 2), (700, 1100, 128), later_chunk.clone()),
            ((2, 2, 1), (515, 1100, 64), later_chunk.clone()),
            ((1, 4, 2), (1023, 1023, 128), long_window.clone()),
            ((2, 4, 1), (700, 1100, 64), long_documents.clone()),
            ((1, 2, 2), (700, 1100, 128), windowed_documents.clone()),
        ] {
            let case = Case::new(41, heads, lens, mask, elem);
            check_forward(client, &case, variant);
            check_backward(client, &case, variant);
        }
    }
}

/// The tensor-core backward with the value-by-value stores of devices without `stmatrix`
/// (before sm_90), forced on this thread of an sm_90 device, against the f64 reference: both
/// ways of storing P^T and dS^T stay tested on one machine.
pub fn backward_without_stmatrix_matches_reference<R: Runtime>(
    client: &ComputeClient<R>,
    elem: ElemType,
) {
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            distflash_kernels::scalar_fragment_stores::force(false);
        }
    }
    let _restore = Restore;
    distflash_kernels::scalar_fragment_stores::force(true);
    backward_matches_reference(client, elem);
}

mod cuda_scalar_stores {
    use super::*;
    suite!(
        @per_elem backward,
        backward_without_stmatrix_matches_reference,
        cubecl::cuda::CudaRuntime::client(&cubecl::cuda::CudaDevice::new(0)),
        #[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
    );
}

mod cuda_large {
    use super::*;
    suite!(
        @per_elem larger_shapes,
        larger_shapes_match_reference,
        cubecl::cuda::CudaRuntime::client(&cubecl::cuda::CudaDevice::new(0)),
        #[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
    );
}
