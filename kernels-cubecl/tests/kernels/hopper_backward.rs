//! The Hopper attention backward (`hopper::attention_backward`, `Variant::Hopper`) against the
//! f64 reference, into gradients poisoned with NaN: both head dims and 16-bit types, causal and
//! not, GQA and MQA, odd lengths (partial query tiles and key blocks), a later query chunk whose
//! causal diagonal crosses tiles, keys ahead of the queries (rows that see nothing), key blocks
//! no query sees (zero gradients), extreme scores beside a partial key block, and sliding
//! windows and packed documents (alone, combined, at offsets, at their edges); `Variant::Auto`
//! running it where it covers a call (masked calls included, and the deterministic backward,
//! under packed documents too); the deterministic backward (dQ added in a fixed order) against
//! the reference and bitwise the same twice, under every mask, and with its ordered dQ adds made
//! by a producer warp (forced) bitwise its consumers' form; each GQA group's query heads
//! split over several cubes (dK and dV added with atomics), forced on every case, and the
//! deterministic backward never splitting; and its refusals. The backward runs on an H100/H200
//! only; elsewhere it must refuse the device.

use super::hopper_cases::{
    auto_case, bits, check_all, common_cases, compare, every_type_and_head_dim, hopper_client,
    masked_cases, named, Named, Quantity,
};
use super::*;
use distflash_kernels::hopper::{self, schedule, BackwardSchedule, DeterministicAdds, HeadSplit};

/// The forward's output and log-sum-exp of `case` (the Hopper forward's), and its output
/// gradient, on the device.
fn forward_of<R: Runtime>(
    client: &ComputeClient<R>,
    case: &Case,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
) -> (DeviceTensor, DeviceTensor, DeviceTensor) {
    let (out, lse) =
        distflash_kernels::attention(client, q, k, v, &options(case, Variant::Hopper)).unwrap();
    let grad_out = case.upload(client, &case.grad_out, case.dims.q_shape());
    (out, lse, grad_out)
}

/// The options of the Hopper backward of `case`, `deterministic` or not.
fn hopper_options(case: &Case, deterministic: bool) -> StepOptions {
    StepOptions {
        deterministic,
        ..options(case, Variant::Hopper)
    }
}

/// `[dq, dk, dv]` of `case` by `hopper::attention_backward` (`deterministic` or not), from q, k,
/// v and the forward's output, log-sum-exp and output gradient, into gradients poisoned with
/// NaN.
fn hopper_gradients<R: Runtime>(
    client: &ComputeClient<R>,
    (case, deterministic): (&Case, bool),
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    (out, lse, grad_out): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
) -> Result<[DeviceTensor; 3], KernelError> {
    let dims = &case.dims;
    let grads = [dims.q_shape(), dims.kv_shape(), dims.kv_shape()]
        .map(|shape| nan_tensor(client, shape, case.elem));
    hopper::attention_backward(
        client,
        (q, k, v),
        out,
        lse,
        grad_out,
        (&grads[0], &grads[1], &grads[2]),
        &hopper_options(case, deterministic),
    )?;
    Ok(grads)
}

/// `[dq, dk, dv]` of `case` by the default (not deterministic) Hopper backward, as
/// [`hopper_gradients`] gives them; panics where it refuses the call.
fn direct_gradients<R: Runtime>(
    client: &ComputeClient<R>,
    case: &Case,
    qkv: (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    forward: (&DeviceTensor, &DeviceTensor, &DeviceTensor),
) -> [DeviceTensor; 3] {
    hopper_gradients(client, (case, false), qkv, forward).unwrap()
}

/// Runs the Hopper backward of `case` (from the Hopper forward's output) into poisoned
/// gradients and compares dQ, dK and dV with the f64 reference; the error, with a map of where
/// it lies, if they differ.
fn check_case<R: Runtime>(client: &ComputeClient<R>, case: &Case) -> Result<(), String> {
    let (q, k, v) = case.qkv(client);
    let (out, lse, grad_out) = forward_of(client, case, (&q, &k, &v));
    let grads = hopper_gradients(client, (case, false), (&q, &k, &v), (&out, &lse, &grad_out))
        .map_err(|e| format!("refused: {e}"))?;
    compare_with_reference(client, case, &grads)
}

/// dQ, dK and dV of `case` against the f64 reference; the error, with a map of where it lies,
/// if they differ.
fn compare_with_reference<R: Runtime>(
    client: &ComputeClient<R>,
    case: &Case,
    grads: &[DeviceTensor; 3],
) -> Result<(), String> {
    let dims = &case.dims;
    let [got_dq, got_dk, got_dv] = [&grads[0], &grads[1], &grads[2]].map(|g| read(client, g));
    let (exact, naive) = case.reference_backward();
    let quantity = |name, got, exact, naive, slice_rows, block_rows| Quantity {
        name,
        got,
        exact,
        naive,
        elem: case.elem,
        slice_rows,
        cols: dims.head_dim,
        block_rows,
    };
    compare(&[
        quantity("dQ", &got_dq, &exact.dq, &naive.dq, dims.q_len, 64),
        quantity("dK", &got_dk, &exact.dk, &naive.dk, dims.kv_len, 128),
        quantity("dV", &got_dv, &exact.dv, &naive.dv, dims.kv_len, 128),
    ])
}

/// The table for one element type and head dim: the common cases, and keys ahead of the
/// queries such that the blocks from key 256 on are seen by no query (their walks are empty,
/// their gradients zero).
fn cases(elem: ElemType, head_dim: usize) -> Vec<Named> {
    let mut cases = common_cases(elem, head_dim);
    let unseen_blocks = Mask::causal().at(0, 100);
    cases.push(named(
        7,
        (1, 2, 1),
        (300, 600, head_dim),
        unseen_blocks,
        elem,
    ));
    cases
}

/// Every element type and head dim the kernel covers.
pub fn backward_matches_the_f64_reference<R: Runtime>(client: &ComputeClient<R>) {
    let all = every_type_and_head_dim(cases);
    check_all("hopper backward", &all, |case| check_case(client, case));
}

/// `attention_backward` of q, k, v and the forward's output, log-sum-exp and output gradient
/// under `options`: `(dq, dk, dv)`.
fn backward_of<R: Runtime>(
    client: &ComputeClient<R>,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    (out, lse, grad_out): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    options: &StepOptions,
) -> (DeviceTensor, DeviceTensor, DeviceTensor) {
    distflash_kernels::attention_backward(client, q, k, v, out, lse, grad_out, options).unwrap()
}

/// The masked cases ([`masked_cases`]): windows and documents, forward and backward on Hopper.
pub fn masks_match_the_f64_reference<R: Runtime>(client: &ComputeClient<R>) {
    check_all("hopper backward, masks", &masked_cases(), |case| {
        check_case(client, case)
    });
}

/// `attention_backward` under `Variant::Hopper` and `Variant::Auto` runs the Hopper backward
/// where it covers the call (dK and dV bitwise the direct call's, dQ, whose atomics add in no
/// fixed order, within the tolerance of it); `Variant::Auto` runs the deterministic backward
/// on the Hopper kernels (bitwise theirs), under packed documents too.
pub fn auto_runs_it_where_it_covers_the_call<R: Runtime>(client: &ComputeClient<R>) {
    let bits = |t: &DeviceTensor| bits(client, t);
    let case = auto_case();
    let (q, k, v) = case.qkv(client);
    let (out, lse, grad_out) = forward_of(client, &case, (&q, &k, &v));
    let direct = direct_gradients(client, &case, (&q, &k, &v), (&out, &lse, &grad_out));
    let backward =
        |options: &StepOptions| backward_of(client, (&q, &k, &v), (&out, &lse, &grad_out), options);
    for variant in [Variant::Hopper, Variant::Auto] {
        let (dq, dk, dv) = backward(&options(&case, variant));
        assert!(
            bits(&dk) == bits(&direct[1]) && bits(&dv) == bits(&direct[2]),
            "{variant:?} is not the Hopper backward"
        );
        // Each dQ against the other's values: the sums differ only in their order.
        let exact = read(client, &direct[0]);
        assert_close(
            &format!("{variant:?} dQ"),
            &read(client, &dq),
            &exact,
            &exact,
            case.elem,
        );
    }
    let (_, tc_dk, _) = backward(&options(&case, Variant::TensorCore));
    assert!(
        bits(&tc_dk) != bits(&direct[1]),
        "the tensor-core backward gave bitwise the Hopper dK: the comparison above proves nothing"
    );

    // Masked calls: Auto runs the Hopper backward there too (dK and dV bitwise the direct call's).
    let documents = Documents::from_cu_seqlens(&[0, 1, 100, 250, 300]).unwrap();
    for mask in [
        Mask::causal().with_window(SlidingWindow::causal(100).unwrap()),
        Mask::causal().with_documents(documents),
    ] {
        let masked = Case::new(9, (1, 4, 2), (300, 300, 128), mask, ElemType::BF16);
        let (q, k, v) = masked.qkv(client);
        let (out, lse, grad_out) = forward_of(client, &masked, (&q, &k, &v));
        let direct = direct_gradients(client, &masked, (&q, &k, &v), (&out, &lse, &grad_out));
        let auto = options(&masked, Variant::Auto);
        let (_, dk, dv) = backward_of(client, (&q, &k, &v), (&out, &lse, &grad_out), &auto);
        assert!(
            bits(&dk) == bits(&direct[1]) && bits(&dv) == bits(&direct[2]),
            "Auto is not the Hopper backward under {:?}",
            masked.mask
        );
    }

    // The deterministic backward: Auto runs the Hopper one (bitwise, dQ included) ...
    let deterministic = |variant| StepOptions {
        deterministic: true,
        ..options(&case, variant)
    };
    let auto = backward(&deterministic(Variant::Auto));
    let hopper = backward(&deterministic(Variant::Hopper));
    let tensor_core = backward(&deterministic(Variant::TensorCore));
    for (name, a, b, c) in [
        ("dq", &auto.0, &hopper.0, &tensor_core.0),
        ("dk", &auto.1, &hopper.1, &tensor_core.1),
        ("dv", &auto.2, &hopper.2, &tensor_core.2),
    ] {
        assert!(
            bits(a) == bits(b),
            "Auto does not run the deterministic Hopper backward ({name})"
        );
        assert!(
            name == "dv" || bits(b) != bits(c),
            "the deterministic tensor-core backward gave bitwise the Hopper {name}: the \
             comparison above proves nothing"
        );
    }
    // ... under packed documents too.
    let documents = Documents::from_cu_seqlens(&[0, 1, 100, 250, 300]).unwrap();
    let packed = Case::new(
        9,
        (1, 4, 2),
        (300, 300, 128),
        Mask::causal().with_documents(documents),
        ElemType::BF16,
    );
    let (q, k, v) = packed.qkv(client);
    let (out, lse, grad_out) = forward_of(client, &packed, (&q, &k, &v));
    let packed_backward = |variant| {
        let options = StepOptions {
            deterministic: true,
            ..options(&packed, variant)
        };
        let grads = backward_of(client, (&q, &k, &v), (&out, &lse, &grad_out), &options);
        [grads.0, grads.1, grads.2].map(|g| bits(&g))
    };
    let packed_hopper = packed_backward(Variant::Hopper);
    assert!(
        packed_backward(Variant::Auto) == packed_hopper,
        "Auto does not run the deterministic Hopper backward under documents"
    );
    assert!(
        packed_backward(Variant::TensorCore)[1] != packed_hopper[1],
        "the deterministic tensor-core backward gave bitwise the Hopper dK under documents: the \
         comparison above proves nothing"
    );
}

/// The cases of the deterministic backward: every case of the default backward's tables
/// (packed documents included), and a long causal GQA call whose query tiles each take adds
/// from up to nine key blocks in turn.
fn deterministic_cases() -> Vec<Named> {
    let mut all = every_type_and_head_dim(cases);
    all.extend(masked_cases());
    all.push(named(
        71,
        (1, 4, 2),
        (1100, 1100, 128),
        Mask::causal(),
        ElemType::BF16,
    ));
    all
}

/// The deterministic Hopper backward against the f64 reference, into poisoned gradients;
/// bitwise the same gradients on a second run; dK and dV bitwise those of the default backward
/// (the same products: only the order of dQ's adds differs).
pub fn deterministic_backward_matches_the_f64_reference_bitwise_twice<R: Runtime>(
    client: &ComputeClient<R>,
) {
    check_all(
        "hopper deterministic backward",
        &deterministic_cases(),
        |case| {
            let (q, k, v) = case.qkv(client);
            let (out, lse, grad_out) = forward_of(client, case, (&q, &k, &v));
            let run = |deterministic| {
                hopper_gradients(
                    client,
                    (case, deterministic),
                    (&q, &k, &v),
                    (&out, &lse, &grad_out),
                )
                .map_err(|e| format!("refused: {e}"))
            };
            let first = run(true)?;
            compare_with_reference(client, case, &first)?;
            let second = run(true)?;
            // The default backward with a cube per block walking its whole group: where the plan
            // would split the group's heads, dK and dV are summed in another order.
            force_head_split(Some(HeadSplit::Never));
            let default = run(false);
            force_head_split(None);
            let default = default?;
            let bits_of = |grads: &[DeviceTensor; 3]| grads.each_ref().map(|g| bits(client, g));
            let (first, second, default) = (bits_of(&first), bits_of(&second), bits_of(&default));
            if first != second {
                return Err("a second run gave other gradients".into());
            }
            if first[1..] != default[1..] {
                return Err("dK or dV differ from the default backward's".into());
            }
            Ok(())
        },
    );
}

/// Makes the Hopper backward on this thread split each GQA group's heads as `split` says (`None`:
/// the plan's choice again).
fn force_head_split(split: Option<HeadSplit>) {
    schedule::force_backward(split.map(|head_split| BackwardSchedule {
        head_split,
        ..BackwardSchedule::default()
    }));
}

/// The deterministic backward with its ordered dQ adds made by a producer warp from shared
/// memory (`DeterministicAdds::Producer`, forced) on the deterministic cases (every mask, both
/// head dims and 16-bit types): against the f64 reference into gradients poisoned with NaN,
/// bitwise the same twice, and bitwise the consumers' form (`DeterministicAdds::Consumers`):
/// both add each key block's dQ to a tile's f32 sum in the same order, last block first, with
/// the same f32 adds, so dQ too is the same bit for bit.
pub fn deterministic_producer_adds_match_the_reference_and_the_consumers_bitwise<R: Runtime>(
    client: &ComputeClient<R>,
) {
    check_all(
        "hopper deterministic backward, producer adds",
        &deterministic_cases(),
        |case| {
            let (q, k, v) = case.qkv(client);
            let (out, lse, grad_out) = forward_of(client, case, (&q, &k, &v));
            let run = |adds| {
                schedule::force_backward(Some(BackwardSchedule {
                    deterministic_adds: adds,
                    ..BackwardSchedule::default()
                }));
                let grads =
                    hopper_gradients(client, (case, true), (&q, &k, &v), (&out, &lse, &grad_out));
                schedule::force_backward(None);
                grads.map_err(|e| format!("refused: {e}"))
            };
            let first = run(DeterministicAdds::Producer)?;
            compare_with_reference(client, case, &first)?;
            let second = run(DeterministicAdds::Producer)?;
            let consumers = run(DeterministicAdds::Consumers)?;
            let bits_of = |grads: &[DeviceTensor; 3]| grads.each_ref().map(|g| bits(client, g));
            let (first, second, consumers) =
                (bits_of(&first), bits_of(&second), bits_of(&consumers));
            if first != second {
                return Err("a second run gave other gradients".into());
            }
            for (name, (producer, consumer)) in
                ["dQ", "dK", "dV"].iter().zip(first.iter().zip(&consumers))
            {
                if producer != consumer {
                    return Err(format!("{name} differs from the consumers' form's"));
                }
            }
            Ok(())
        },
    );
}

/// The Hopper backward with each GQA group's query heads split over several cubes per block of
/// keys, forced (one query head per cube, then two parts where the group's size allows; a group
/// of one, MHA, never splits) on the default backward's cases (GQA and MQA, odd lengths, causal,
/// keys ahead of the queries, blocks no query sees, extreme scores, both head dims and types,
/// GQA 32 / 8) and the masked cases (windows, documents), into gradients poisoned with NaN: the
/// parts' dK and dV, added with atomics to zeroed f32 sums and converted after, against the f64
/// reference. Then the deterministic backward under the forced split: it never splits (bitwise
/// its unsplit self, twice), while the default backward does (other bits than unsplit: the
/// comparison proves something).
pub fn head_split_matches_the_f64_reference<R: Runtime>(client: &ComputeClient<R>) {
    let mut all = every_type_and_head_dim(cases);
    all.extend(masked_cases());
    for parts in [usize::MAX, 2] {
        force_head_split(Some(HeadSplit::Parts(parts)));
        let what = match parts {
            usize::MAX => "hopper backward, a query head per cube".to_string(),
            parts => format!("hopper backward, heads split in {parts}"),
        };
        check_all(&what, &all, |case| check_case(client, case));
    }
    force_head_split(None);

    let gqa = [
        Case::new(
            81,
            (1, 8, 2),
            (1100, 1100, 128),
            Mask::causal(),
            ElemType::BF16,
        ),
        Case::new(82, (1, 4, 1), (383, 517, 64), Mask::none(), ElemType::F16),
        Case::new(
            83,
            (2, 6, 2),
            (300, 300, 128),
            Mask::causal().with_window(SlidingWindow::causal(100).unwrap()),
            ElemType::BF16,
        ),
    ];
    for (i, case) in gqa.iter().enumerate() {
        let (q, k, v) = case.qkv(client);
        let (out, lse, grad_out) = forward_of(client, case, (&q, &k, &v));
        let run = |split, deterministic| {
            force_head_split(Some(split));
            let grads = hopper_gradients(
                client,
                (case, deterministic),
                (&q, &k, &v),
                (&out, &lse, &grad_out),
            );
            force_head_split(None);
            grads.unwrap().each_ref().map(|g| bits(client, g))
        };
        let per_head = HeadSplit::Parts(usize::MAX);
        let split_first = run(per_head, true);
        let split_second = run(per_head, true);
        let unsplit = run(HeadSplit::Never, true);
        assert!(
            split_first == split_second,
            "the deterministic backward under a forced split gave other gradients on a second              run ({:?})",
            case.dims
        );
        assert!(
            split_first == unsplit,
            "the deterministic backward split its group's heads ({:?})",
            case.dims
        );
        if i == 0 {
            // 1100 x 128 keys of two key/value heads: the default backward's dK or dV, summed
            // per head and added with atomics, rounds otherwise than one cube's sum somewhere.
            let default_split = run(per_head, false);
            let default_unsplit = run(HeadSplit::Never, false);
            assert!(
                default_split[1..] != default_unsplit[1..],
                "the forced split gave the unsplit dK and dV bit for bit: the comparisons above                  prove nothing"
            );
        }
    }
}

/// What the Hopper backward does not cover is refused naming it, before anything runs, whatever
/// the device; `Variant::Auto` runs the same calls elsewhere.
pub fn uncovered_calls_are_refused<R: Runtime>(client: &ComputeClient<R>) {
    let case = Case::new(13, (1, 2, 1), (64, 64, 64), Mask::causal(), ElemType::F16);
    let (q, k, v) = case.qkv(client);
    let dims = case.dims;
    let grad_out = case.upload(client, &case.grad_out, dims.q_shape());
    // Any output and lse of the right shapes: every refusal comes before they are read.
    let out = case.upload(client, &case.grad_out, dims.q_shape());
    let lse = DeviceTensor::from_f32(
        client,
        &vec![0.0; dims.batch * dims.q_heads * dims.q_len],
        dims.row_shape(),
        ElemType::F32,
    );
    let hopper_options = options(&case, Variant::Hopper);
    let with = |change: &dyn Fn(&mut StepOptions)| {
        let mut options = hopper_options.clone();
        change(&mut options);
        options
    };
    let negative = with(&|o| o.scale = Some(-0.5));
    let backward = |options: &StepOptions| {
        distflash_kernels::attention_backward(client, &q, &k, &v, &out, &lse, &grad_out, options)
            .err()
    };
    let zeros = |shape| distflash_kernels::zeros_f32(client, shape).unwrap();
    let grads = GradAccumulators {
        dq: zeros(dims.q_shape()),
        dk: zeros(dims.kv_shape()),
        dv: zeros(dims.kv_shape()),
    };
    let backward_step = |options: &StepOptions| {
        distflash_kernels::backward_step(client, &q, &k, &v, &grad_out, &lse, &lse, &grads, options)
            .err()
    };
    let refusals = [
        (backward(&negative), "positive, finite score scale"),
        (backward_step(&negative), "positive, finite score scale"),
    ];
    for (err, what) in refusals {
        let err = err.unwrap_or_else(|| panic!("not refused: {what}"));
        assert!(err.to_string().contains(what), "{what}: {err}");
    }
    // The same calls under Auto run (on the Hopper backward or elsewhere).
    if !supports(client, ElemType::F16) {
        return;
    }
    let auto = StepOptions {
        variant: Variant::Auto,
        ..negative.clone()
    };
    assert!(backward(&auto).is_none(), "Auto refused {negative:?}");
}

#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_backward_matches_f64_reference() {
    backward_matches_the_f64_reference(&hopper_client());
}

#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_backward_masks_match_f64_reference() {
    masks_match_the_f64_reference(&hopper_client());
}

#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_deterministic_backward_matches_f64_reference_bitwise_twice() {
    deterministic_backward_matches_the_f64_reference_bitwise_twice(&hopper_client());
}

#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_deterministic_producer_adds_match_f64_reference_and_consumers_bitwise() {
    deterministic_producer_adds_match_the_reference_and_the_consumers_bitwise(&hopper_client());
}

#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_backward_head_split_matches_f64_reference() {
    head_split_matches_the_f64_reference(&hopper_client());
}

#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_backward_is_what_auto_runs_and_refuses_what_it_does_not_cover() {
    let client = hopper_client();
    uncovered_calls_are_refused(&client);
    auto_runs_it_where_it_covers_the_call(&client);
    // A buffer that starts off a 16-byte boundary (a view into another) is refused.
    let case = Case::new(16, (1, 2, 2), (64, 64, 64), Mask::none(), ElemType::BF16);
    let (q, k, v) = case.qkv(&client);
    let (out, lse, grad_out) = forward_of(&client, &case, (&q, &k, &v));
    let shifted = DeviceTensor {
        handle: grad_out.handle.clone().offset_start(8),
        shape: vec![1, 2, 63, 64],
        elem: grad_out.elem,
    };
    let dims63 = |t: &DeviceTensor, shape: Vec<usize>| DeviceTensor { shape, ..t.clone() };
    let err = distflash_kernels::attention_backward(
        &client,
        &dims63(&q, vec![1, 2, 63, 64]),
        &dims63(&k, vec![1, 2, 63, 64]),
        &dims63(&v, vec![1, 2, 63, 64]),
        &dims63(&out, vec![1, 2, 63, 64]),
        &dims63(&lse, vec![1, 2, 63]),
        &shifted,
        &options(&case, Variant::Hopper),
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("`grad_out` starts 8 bytes past"),
        "{err}"
    );
}

#[test]
fn hopper_backward_refuses_a_device_without_wgmma() {
    let client = cubecl::wgpu::WgpuRuntime::client(&cubecl::wgpu::WgpuDevice::Cpu);
    assert!(!hopper::available(&client));
    let case = Case::new(17, (1, 2, 1), (40, 40, 64), Mask::causal(), ElemType::F32);
    let (q, k, v) = case.qkv(&client);
    let dims = case.dims;
    let (out, lse) =
        distflash_kernels::attention(&client, &q, &k, &v, &options(&case, Variant::Auto)).unwrap();
    let grad_out = case.upload(&client, &case.grad_out, dims.q_shape());
    let grads = [dims.q_shape(), dims.kv_shape(), dims.kv_shape()]
        .map(|shape| nan_tensor(&client, shape, ElemType::F32));
    let direct = |options: &StepOptions| {
        hopper::attention_backward(
            &client,
            (&q, &k, &v),
            &out,
            &lse,
            &grad_out,
            (&grads[0], &grads[1], &grads[2]),
            options,
        )
        .unwrap_err()
    };
    // The element type first for a call the kernel would not cover ...
    let err = direct(&options(&case, Variant::Auto));
    assert!(
        matches!(err, KernelError::Unsupported { .. }) && err.to_string().contains("got F32"),
        "{err}"
    );
    // ... and the device for one it would (f16 buffers: nothing runs on them).
    let f16_case = Case::new(17, (1, 2, 1), (40, 40, 64), Mask::causal(), ElemType::F16);
    let (q16, k16, v16) = f16_case.qkv(&client);
    let f16 = |shape| nan_tensor(&client, shape, ElemType::F16);
    let err = hopper::attention_backward(
        &client,
        (&q16, &k16, &v16),
        &f16(dims.q_shape()),
        &lse,
        &f16(dims.q_shape()),
        (
            &f16(dims.q_shape()),
            &f16(dims.kv_shape()),
            &f16(dims.kv_shape()),
        ),
        &options(&f16_case, Variant::Hopper),
    )
    .unwrap_err();
    assert!(
        matches!(err, KernelError::DeviceLimit { .. })
            && err
                .to_string()
                .contains("the Hopper attention backward needs a CUDA GPU")
            && err.to_string().contains("9.0"),
        "{err}"
    );
    uncovered_calls_are_refused(&client);
    // Auto runs here, on the portable kernels.
    distflash_kernels::attention_backward(
        &client,
        &q,
        &k,
        &v,
        &out,
        &lse,
        &grad_out,
        &options(&case, Variant::Auto),
    )
    .unwrap();
}
