//! The Hopper attention forward (`hopper::attention_forward`, `Variant::Hopper`) against the f64
//! reference, into outputs poisoned with NaN: both head dims and 16-bit types, causal and not,
//! GQA and MQA, odd lengths (partial query blocks and key tiles), a later query chunk whose
//! causal diagonal crosses tiles, keys ahead of the queries (rows that see nothing), extreme
//! scores beside a partial key tile, and scores that rise from tile to tile (the stale row max);
//! sliding windows and packed documents (alone, combined, at offsets, at their edges); every
//! schedule of the kernel, the persistent grid on every case above and on calls with more blocks
//! than an H200 has multiprocessors (each cube walking several); `Variant::Auto` running it where it covers a call (masked calls
//! included) and the tensor-core kernels where not; and its refusals. The forward runs on an
//! H100/H200 only; elsewhere it must refuse the device.

use super::hopper_cases::{
    auto_case, bits, common_cases, compare, every_type_and_head_dim, hopper_client, masked_cases,
    named, Named, Quantity,
};
use super::*;
use distflash_kernels::hopper::{self, schedule, ForwardSchedule};

/// Runs the Hopper forward of `case` into poisoned outputs and compares O and lse with the f64
/// reference; the error, with a map of where it lies, if they differ.
fn check_case<R: Runtime>(client: &ComputeClient<R>, case: &Case) -> Result<(), String> {
    let (q, k, v) = case.qkv(client);
    let dims = &case.dims;
    let out = nan_tensor(client, dims.q_shape(), case.elem);
    let lse = nan_tensor(client, dims.row_shape(), ElemType::F32);
    hopper::attention_forward(
        client,
        (&q, &k, &v),
        &out,
        &lse,
        &options(case, Variant::Hopper),
    )
    .map_err(|e| format!("refused: {e}"))?;
    let (got_out, got_lse) = (read(client, &out), read(client, &lse));
    let (exact, naive) = case.reference_forward();
    let rows = |name, got, exact, naive, elem, cols| Quantity {
        name,
        got,
        exact,
        naive,
        elem,
        slice_rows: dims.q_len,
        cols,
        block_rows: 128,
    };
    compare(&[
        rows(
            "O",
            &got_out,
            &exact.out,
            &naive.out,
            case.elem,
            dims.head_dim,
        ),
        // lse is f32: compared against f32 precision.
        rows("lse", &got_lse, &exact.lse, &exact.lse, ElemType::F32, 1),
    ])
}

/// Runs every case on `client` and panics listing the failures.
fn check_all<R: Runtime>(client: &ComputeClient<R>, what: &str, cases: &[Named]) {
    hopper_cases::check_all(what, cases, |case| check_case(client, case));
}

/// Scores that rise from key to key (at head dim 64, by about 0.14 in base 2 in some query rows
/// and by a half or a quarter of that in others: 18, 9 or 4.5 over a tile of 128 keys; more at
/// 128): rows pass their stale max by more than its slack at different tiles of the walk, so
/// warps rescale at different times and weigh against maxima up to 8 below the true one in
/// between.
fn rising_scores(mask: Mask, elem: ElemType, head_dim: usize) -> Named {
    let mut named = named(71, (1, 2, 1), (130, 340, head_dim), mask, elem);
    named.case.set_rising_scores();
    named.name = format!("rising scores, {}", named.name);
    named
}

/// The table for one element type and head dim: the common cases, and scores that rise from
/// tile to tile (the stale row max).
fn cases(elem: ElemType, head_dim: usize) -> Vec<Named> {
    let mut cases = common_cases(elem, head_dim);
    cases.push(rising_scores(Mask::none(), elem, head_dim));
    cases.push(rising_scores(Mask::causal().at(40, 0), elem, head_dim));
    cases
}

/// Every element type and head dim the kernel covers, with the default schedule.
pub fn forward_matches_the_f64_reference<R: Runtime>(client: &ComputeClient<R>) {
    check_all(client, "default schedule", &every_type_and_head_dim(cases));
}

/// The masked cases ([`masked_cases`]) with the default schedule.
pub fn masks_match_the_f64_reference<R: Runtime>(client: &ComputeClient<R>) {
    check_all(client, "masks", &masked_cases());
}

/// The schedules other than the default, on a few cases each.
pub fn every_schedule_matches_the_f64_reference<R: Runtime>(client: &ComputeClient<R>) {
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            schedule::force(None);
        }
    }
    let _restore = Restore;
    for intra_overlap in [false, true] {
        for pingpong in [false, true] {
            let forced = ForwardSchedule {
                intra_overlap,
                pingpong,
                grouped_slices: true,
                persistent: false,
            };
            if forced == ForwardSchedule::default() {
                continue;
            }
            schedule::force(Some(forced));
            let mut some = Vec::new();
            for (elem, head_dim) in [(ElemType::BF16, 128), (ElemType::F16, 64)] {
                some.push(named(
                    5,
                    (1, 4, 2),
                    (700, 1100, head_dim),
                    Mask::causal().at(300, 0),
                    elem,
                ));
                some.push(named(
                    6,
                    (1, 4, 2),
                    (383, 517, head_dim),
                    Mask::none(),
                    elem,
                ));
                some.push(rising_scores(Mask::causal().at(40, 0), elem, head_dim));
                some.push(named(
                    7,
                    (1, 4, 2),
                    (700, 1100, head_dim),
                    Mask::causal()
                        .with_window(SlidingWindow::causal(150).unwrap())
                        .at(400, 0),
                    elem,
                ));
            }
            check_all(client, &format!("{forced:?}"), &some);
        }
    }
    // Every slice's block `b` before any slice's block `b - 1` (one group of all slices): the
    // decode of each cube's work changes, not its products.
    let ungrouped = ForwardSchedule {
        grouped_slices: false,
        ..ForwardSchedule::default()
    };
    schedule::force(Some(ungrouped));
    check_all(
        client,
        &format!("{ungrouped:?}"),
        &[
            named(
                42,
                (2, 16, 4),
                (257, 257, 64),
                Mask::causal(),
                ElemType::BF16,
            ),
            named(
                43,
                (1, 3, 3),
                (700, 1100, 128),
                Mask::causal().at(300, 0),
                ElemType::F16,
            ),
        ],
    );
}

/// Calls with more blocks of 128 query rows than an H100 or H200 has multiprocessors (132 or
/// 114), so that each cube of a persistent grid walks several (of different lengths: causal, a
/// window, documents, and keys ahead of the queries, whose first block sees no key), at odd
/// lengths, both head dims and 16-bit types, GQA.
fn many_blocks() -> Vec<Named> {
    let mut cases = vec![
        named(
            81,
            (4, 12, 3),
            (555, 555, 64),
            Mask::causal(),
            ElemType::F16,
        ),
        named(
            82,
            (2, 16, 4),
            (700, 1100, 128),
            Mask::causal().at(300, 0),
            ElemType::BF16,
        ),
        named(
            83,
            (2, 16, 8),
            (600, 600, 128),
            Mask::causal().with_window(SlidingWindow::causal(150).unwrap()),
            ElemType::BF16,
        ),
        named(
            84,
            (2, 16, 4),
            (600, 700, 64),
            Mask::causal().at(0, 200),
            ElemType::F16,
        ),
        named(
            85,
            (2, 40, 40),
            (383, 517, 128),
            Mask::none(),
            ElemType::F16,
        ),
    ];
    for mask in band_masks(BandGroup::Documents, 2, 517, 517) {
        cases.push(named(86, (2, 16, 4), (517, 517, 64), mask, ElemType::BF16));
    }
    cases
}

/// The persistent grid (`ForwardSchedule::persistent`) on the default schedule's cases, the
/// masked ones and [`many_blocks`], then with each other overlap schedule on a few; the steps,
/// which keep a cube per block whatever the schedule says, still match the reference under it.
pub fn the_persistent_grid_matches_the_f64_reference<R: Runtime>(client: &ComputeClient<R>) {
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            schedule::force(None);
        }
    }
    let _restore = Restore;
    let persistent = ForwardSchedule {
        persistent: true,
        ..ForwardSchedule::default()
    };
    schedule::force(Some(persistent));
    check_all(client, "persistent, many blocks", &many_blocks());
    check_all(
        client,
        "persistent, default schedule's cases",
        &every_type_and_head_dim(cases),
    );
    check_all(client, "persistent, masks", &masked_cases());
    for (intra_overlap, pingpong) in [(false, false), (true, false), (false, true)] {
        let forced = ForwardSchedule {
            intra_overlap,
            pingpong,
            ..persistent
        };
        schedule::force(Some(forced));
        let few = many_blocks().into_iter().take(3).chain([
            rising_scores(Mask::causal().at(40, 0), ElemType::BF16, 128),
            rising_scores(Mask::none(), ElemType::F16, 64),
        ]);
        check_all(client, &format!("{forced:?}"), &few.collect::<Vec<_>>());
    }
    // Slices in launch order (one group of all of them) on the persistent grid.
    let ungrouped = ForwardSchedule {
        grouped_slices: false,
        ..persistent
    };
    schedule::force(Some(ungrouped));
    check_all(client, &format!("{ungrouped:?}"), &many_blocks()[..2]);
    schedule::force(Some(persistent));
    super::hopper_steps::chunked_steps_match_the_f64_reference(client);
}

/// `attention` under `Variant::Hopper` and `Variant::Auto` runs the Hopper forward where it
/// covers the call (bitwise the same results as `hopper::attention_forward`): unmasked, causal,
/// under a sliding window and over packed documents.
pub fn auto_runs_it_where_it_covers_the_call<R: Runtime>(client: &ComputeClient<R>) {
    let bits = |t: &DeviceTensor| bits(client, t);
    let case = auto_case();
    let (q, k, v) = case.qkv(client);
    let dims = case.dims;
    let out = nan_tensor(client, dims.q_shape(), case.elem);
    let lse = nan_tensor(client, dims.row_shape(), ElemType::F32);
    let documents = Documents::from_cu_seqlens(&[0, 1, 100, 250, 300]).unwrap();
    for mask in [
        case.mask.clone(),
        Mask::causal().with_window(SlidingWindow::causal(100).unwrap()),
        Mask::causal().with_documents(documents),
    ] {
        let with = |variant| StepOptions {
            mask: mask.clone(),
            ..options(&case, variant)
        };
        hopper::attention_forward(client, (&q, &k, &v), &out, &lse, &with(Variant::Hopper))
            .unwrap();
        for variant in [Variant::Hopper, Variant::Auto] {
            let (o, l) = distflash_kernels::attention(client, &q, &k, &v, &with(variant)).unwrap();
            assert!(
                bits(&o) == bits(&out) && bits(&l) == bits(&lse),
                "{variant:?} is not the Hopper forward under {mask:?}"
            );
        }
        let (tc_out, _) =
            distflash_kernels::attention(client, &q, &k, &v, &with(Variant::TensorCore)).unwrap();
        assert!(
            bits(&tc_out) != bits(&out),
            "the tensor-core forward gave bitwise the Hopper output under {mask:?}: the \
             comparison above proves nothing"
        );
    }
}

/// What the Hopper forward does not cover is refused naming it, before anything runs, whatever
/// the device; `Variant::Auto` runs the same calls elsewhere.
pub fn uncovered_calls_are_refused<R: Runtime>(client: &ComputeClient<R>) {
    let case = Case::new(13, (1, 2, 1), (64, 64, 64), Mask::causal(), ElemType::F16);
    let (q, k, v) = case.qkv(client);
    let hopper_options = options(&case, Variant::Hopper);
    let negative = StepOptions {
        scale: Some(-0.5),
        ..hopper_options.clone()
    };
    let state = SoftmaxState::empty(client, 1, 2, 64, 64).unwrap();
    let f32_case = Case::new(14, (1, 2, 1), (64, 64, 64), Mask::causal(), ElemType::F32);
    let (q32, k32, v32) = f32_case.qkv(client);
    let d96 = Case::new(15, (1, 2, 1), (64, 64, 96), Mask::causal(), ElemType::F16);
    let (q96, k96, v96) = d96.qkv(client);
    let refusals = [
        (
            distflash_kernels::forward_step(client, &q, &k, &v, &state, &negative).err(),
            "positive, finite score scale",
        ),
        (
            distflash_kernels::forward_last_step(client, &q, &k, &v, state.clone(), &negative)
                .err(),
            "positive, finite score scale",
        ),
        (
            distflash_kernels::attention(client, &q, &k, &v, &negative).err(),
            "positive, finite score scale",
        ),
        (
            distflash_kernels::attention(client, &q32, &k32, &v32, &hopper_options).err(),
            "bf16 or f16",
        ),
        (
            distflash_kernels::attention(client, &q96, &k96, &v96, &hopper_options).err(),
            "got 96",
        ),
        (
            distflash_kernels::check_launch(client, &case.dims, ElemType::F16, &negative).err(),
            "positive, finite score scale",
        ),
    ];
    for (err, what) in refusals {
        let err = err.unwrap_or_else(|| panic!("not refused: {what}"));
        assert!(err.to_string().contains(what), "{what}: {err}");
    }
    // The same calls under Auto run (on the Hopper forward or elsewhere).
    if !supports(client, ElemType::F16) {
        return;
    }
    let auto = StepOptions {
        variant: Variant::Auto,
        ..negative
    };
    distflash_kernels::attention(client, &q, &k, &v, &auto).unwrap();
}

#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_forward_matches_f64_reference() {
    forward_matches_the_f64_reference(&hopper_client());
}

#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_forward_masks_match_f64_reference() {
    masks_match_the_f64_reference(&hopper_client());
}

#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_forward_schedules_match_f64_reference() {
    let client = hopper_client();
    every_schedule_matches_the_f64_reference(&client);
}

#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_forward_persistent_matches_f64_reference() {
    the_persistent_grid_matches_the_f64_reference(&hopper_client());
}

#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_forward_is_what_auto_runs_and_refuses_what_it_does_not_cover() {
    let client = hopper_client();
    uncovered_calls_are_refused(&client);
    auto_runs_it_where_it_covers_the_call(&client);
    // A buffer that starts off a 16-byte boundary (a view into another) is refused.
    let case = Case::new(16, (1, 2, 2), (64, 64, 64), Mask::none(), ElemType::BF16);
    let (q, k, v) = case.qkv(&client);
    let shifted = DeviceTensor {
        handle: q.handle.clone().offset_start(8),
        shape: vec![1, 2, 63, 64],
        elem: q.elem,
    };
    let err = distflash_kernels::attention(
        &client,
        &shifted,
        &DeviceTensor {
            shape: vec![1, 2, 63, 64],
            ..k.clone()
        },
        &DeviceTensor {
            shape: vec![1, 2, 63, 64],
            ..v.clone()
        },
        &options(&case, Variant::Hopper),
    )
    .unwrap_err();
    assert!(err.to_string().contains("`q` starts 8 bytes past"), "{err}");
}

#[test]
fn hopper_forward_refuses_a_device_without_wgmma() {
    let client = cubecl::wgpu::WgpuRuntime::client(&cubecl::wgpu::WgpuDevice::Cpu);
    assert!(!hopper::available(&client));
    let case = Case::new(17, (1, 2, 1), (40, 40, 64), Mask::causal(), ElemType::F32);
    let (q, k, v) = case.qkv(&client);
    let hopper_options = options(&case, Variant::Hopper);
    // The device, for a call the kernel would cover in f16 ...
    let f16_dims = case.dims;
    let err = distflash_kernels::check_launch(&client, &f16_dims, ElemType::F16, &hopper_options)
        .unwrap_err();
    assert!(
        matches!(err, KernelError::DeviceLimit { .. }) && err.to_string().contains("9.0"),
        "{err}"
    );
    // ... the element type first for one it would not.
    let err = distflash_kernels::attention(&client, &q, &k, &v, &hopper_options).unwrap_err();
    assert!(matches!(err, KernelError::Unsupported { .. }), "{err}");
    uncovered_calls_are_refused(&client);
    // Auto runs here, on the portable kernels.
    distflash_kernels::attention(&client, &q, &k, &v, &options(&case, Variant::Auto)).unwrap();
}
