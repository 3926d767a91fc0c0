//! The Hopper steps of the stat-carrying contract (`forward_first_step`, `forward_step`,
//! `forward_last_step`, `backward_step` under `Variant::Hopper`) against the f64 reference: a
//! sequence cut into query chunks and key chunks of odd lengths, each query chunk's attention
//! stepped over every key chunk (in order, or from the last chunk to the first) and its gradients
//! added pair by pair to f32 accumulators that start from random values, with causal offsets,
//! sliding windows and packed documents (each step's mask at its chunks' offsets), GQA and MQA,
//! both 16-bit types and head dims. Pairs no query sees (they must leave the state and the
//! accumulators bit for bit as they were) and pairs in which some rows see nothing (they must not
//! turn into NaN) come with the chunks. Beside them: `Variant::Auto` running the steps on the
//! Hopper kernels where they cover the call (bitwise the same as `Variant::Hopper`, masked steps
//! included), the deterministic backward step (the same cases, and bitwise the same twice), and
//! the refusals, on a device without `wgmma` too.

use super::hopper_cases::{bits, check_each, compare, hopper_client, Quantity};
use super::*;
use distflash_kernels::hopper::{schedule, BackwardSchedule, DeterministicAdds};

/// A whole sequence's attention computed in chunks: the case (query and key lengths equal), the
/// bounds of the query chunks and of the key chunks, and whether each query chunk steps over the
/// key chunks from the last to the first; and whether its backward steps are deterministic.
struct Chunked {
    name: String,
    case: Case,
    q_bounds: Vec<usize>,
    kv_bounds: Vec<usize>,
    reversed: bool,
    deterministic: bool,
}

/// The rows `[start, end)` of each of the `slices` slices of `data` (`len` rows of `cols` a
/// slice).
fn rows_of(
    data: &[f64],
    (slices, len, cols): (usize, usize, usize),
    (start, end): (usize, usize),
) -> Vec<f64> {
    (0..slices)
        .flat_map(|slice| {
            let base = slice * len * cols;
            data[base + start * cols..base + end * cols].iter().copied()
        })
        .collect()
}

/// Writes `part` (the rows `[start, end)` of each slice, as [`rows_of`] cuts them) into `full`.
fn place_rows(
    full: &mut [f64],
    part: &[f64],
    (slices, len, cols): (usize, usize, usize),
    (start, end): (usize, usize),
) {
    let rows = end - start;
    for slice in 0..slices {
        let dst = (slice * len + start) * cols;
        let src = slice * rows * cols;
        full[dst..dst + rows * cols].copy_from_slice(&part[src..src + rows * cols]);
    }
}

/// Random f32 values uploaded as an f32 accumulator of `shape`, and their values.
fn random_accumulator<R: Runtime>(
    client: &ComputeClient<R>,
    rng: &mut Rng,
    shape: Vec<usize>,
) -> (DeviceTensor, Vec<f64>) {
    let values = rng.tensor(shape.iter().product(), 0.5, ElemType::F32);
    let tensor = DeviceTensor::from_f32(client, &to_f32(&values), shape, ElemType::F32);
    (tensor, values)
}

impl Chunked {
    fn new(
        seed: u64,
        heads: (usize, usize, usize),
        (len, head_dim): (usize, usize),
        (mask, elem): (Mask, ElemType),
        (q_bounds, kv_bounds): (&[usize], &[usize]),
        reversed: bool,
    ) -> Self {
        Self {
            name: format!(
                "{heads:?} len {len} d{head_dim} {mask:?} {elem:?} q {q_bounds:?} kv {kv_bounds:?}{}",
                if reversed { " reversed" } else { "" }
            ),
            case: Case::new(seed, heads, (len, len, head_dim), mask, elem),
            q_bounds: q_bounds.to_vec(),
            kv_bounds: kv_bounds.to_vec(),
            reversed,
            deterministic: false,
        }
    }

    fn chunks(bounds: &[usize]) -> Vec<(usize, usize)> {
        bounds.windows(2).map(|w| (w[0], w[1])).collect()
    }

    /// The key chunks in the order each query chunk steps over them.
    fn kv_chunks(&self) -> Vec<(usize, usize)> {
        let mut chunks = Self::chunks(&self.kv_bounds);
        if self.reversed {
            chunks.reverse();
        }
        chunks
    }

    /// Whether no query row of `q` sees any key of `kv` in any batch row (under a causal mask
    /// the keys after them; a window's keys before it; other documents' keys).
    fn hidden(&self, q: (usize, usize), kv: (usize, usize)) -> bool {
        let mask = &self.case.mask;
        (0..self.case.dims.batch).all(|b| {
            (q.0..q.1).all(|i| {
                let seen = mask.visible_keys(b, i, self.case.dims.kv_len);
                seen.end <= kv.0 || seen.start >= kv.1 || seen.is_empty()
            })
        })
    }

    /// The options of the step of query chunk `q` against key chunk `kv`.
    fn step_options(&self, q: (usize, usize), kv: (usize, usize), variant: Variant) -> StepOptions {
        let mask = &self.case.mask;
        StepOptions {
            mask: mask
                .clone()
                .at(mask.q_offset + q.0 as i64, mask.kv_offset + kv.0 as i64),
            deterministic: self.deterministic,
            ..options(&self.case, variant)
        }
    }

    /// The rows `chunk` of host `data` (query or key side) on the device.
    fn upload_rows<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        data: &[f64],
        heads: usize,
        chunk: (usize, usize),
    ) -> DeviceTensor {
        let d = self.case.dims;
        let part = rows_of(data, (d.batch * heads, d.q_len, d.head_dim), chunk);
        let shape = vec![d.batch, heads, chunk.1 - chunk.0, d.head_dim];
        self.case.upload(client, &part, shape)
    }
}

/// Runs the chunked forward and backward of `chunked` on the Hopper steps and compares O, lse,
/// dQ, dK and dV with the f64 reference; checks that pairs no query sees change nothing.
fn check_chunked<R: Runtime>(client: &ComputeClient<R>, chunked: &Chunked) -> Result<(), String> {
    let case = &chunked.case;
    let d = case.dims;
    let (q_slices, kv_slices) = (d.batch * d.q_heads, d.batch * d.kv_heads);
    let refused = |e: KernelError| format!("refused: {e}");
    let keys: Vec<_> = chunked
        .kv_chunks()
        .into_iter()
        .map(|kv| {
            let k = chunked.upload_rows(client, &case.k, d.kv_heads, kv);
            let v = chunked.upload_rows(client, &case.v, d.kv_heads, kv);
            (kv, k, v)
        })
        .collect();
    let mut got_out = vec![0.0; case.q.len()];
    let mut got_lse = vec![0.0; q_slices * d.q_len];
    let mut got_dq = vec![0.0; case.q.len()];
    let mut unchanged = Vec::new();
    let mut rng = Rng::new(91);
    // Each key chunk's dK and dV accumulators, from random values, over every query chunk.
    let key_grads: Vec<_> = keys
        .iter()
        .map(|((start, end), _, _)| {
            let shape = vec![d.batch, d.kv_heads, end - start, d.head_dim];
            (
                random_accumulator(client, &mut rng, shape.clone()),
                random_accumulator(client, &mut rng, shape),
            )
        })
        .collect();
    for q_chunk in Chunked::chunks(&chunked.q_bounds) {
        let q = chunked.upload_rows(client, &case.q, d.q_heads, q_chunk);
        let opts = |kv| chunked.step_options(q_chunk, kv, Variant::Hopper);
        let (first, middle, last) = (&keys[0], &keys[1..keys.len() - 1], &keys[keys.len() - 1]);
        let state =
            distflash_kernels::forward_first_step(client, &q, &first.1, &first.2, &opts(first.0))
                .map_err(refused)?;
        for (kv, k, v) in middle {
            let before = [&state.o, &state.m, &state.l].map(|t| bits(client, t));
            distflash_kernels::forward_step(client, &q, k, v, &state, &opts(*kv))
                .map_err(refused)?;
            if chunked.hidden(q_chunk, *kv)
                && before != [&state.o, &state.m, &state.l].map(|t| bits(client, t))
            {
                unchanged.push(format!(
                    "forward step {q_chunk:?} x {kv:?} changed the state"
                ));
            }
        }
        let (out, lse) = distflash_kernels::forward_last_step(
            client,
            &q,
            &last.1,
            &last.2,
            state,
            &opts(last.0),
        )
        .map_err(refused)?;
        let out_host = read(client, &out);
        place_rows(
            &mut got_out,
            &out_host,
            (q_slices, d.q_len, d.head_dim),
            q_chunk,
        );
        place_rows(
            &mut got_lse,
            &read(client, &lse),
            (q_slices, d.q_len, 1),
            q_chunk,
        );

        let grad_out = chunked.upload_rows(client, &case.grad_out, d.q_heads, q_chunk);
        let delta = distflash_kernels::backward_delta(client, &out, &grad_out).map_err(refused)?;
        let q_shape = vec![d.batch, d.q_heads, q_chunk.1 - q_chunk.0, d.head_dim];
        let (dq, dq_start) = random_accumulator(client, &mut rng, q_shape);
        for ((kv, k, v), ((dk, _), (dv, _))) in keys.iter().zip(&key_grads) {
            let grads = GradAccumulators {
                dq: dq.clone(),
                dk: dk.clone(),
                dv: dv.clone(),
            };
            let before = [&dq, dk, dv].map(|t| bits(client, t));
            distflash_kernels::backward_step(
                client,
                &q,
                k,
                v,
                &grad_out,
                &lse,
                &delta,
                &grads,
                &opts(*kv),
            )
            .map_err(refused)?;
            if chunked.hidden(q_chunk, *kv) && before != [&dq, dk, dv].map(|t| bits(client, t)) {
                unchanged.push(format!(
                    "backward step {q_chunk:?} x {kv:?} changed a gradient"
                ));
            }
        }
        let added: Vec<f64> = read(client, &dq)
            .iter()
            .zip(&dq_start)
            .map(|(g, s)| g - s)
            .collect();
        place_rows(
            &mut got_dq,
            &added,
            (q_slices, d.q_len, d.head_dim),
            q_chunk,
        );
    }
    let (mut got_dk, mut got_dv) = (vec![0.0; case.k.len()], vec![0.0; case.k.len()]);
    for ((kv, _, _), ((dk, dk_start), (dv, dv_start))) in keys.iter().zip(&key_grads) {
        for (full, tensor, start) in [(&mut got_dk, dk, dk_start), (&mut got_dv, dv, dv_start)] {
            let added: Vec<f64> = read(client, tensor)
                .iter()
                .zip(start)
                .map(|(g, s)| g - s)
                .collect();
            place_rows(full, &added, (kv_slices, d.kv_len, d.head_dim), *kv);
        }
    }

    let (exact_fwd, naive_fwd) = case.reference_forward();
    let (exact_bwd, naive_bwd) = case.reference_backward();
    let quantity = |name, got, exact, naive, elem, cols| Quantity {
        name,
        got,
        exact,
        naive,
        elem,
        slice_rows: d.q_len,
        cols,
        block_rows: 128,
    };
    let compared = compare(&[
        quantity(
            "O",
            &got_out,
            &exact_fwd.out,
            &naive_fwd.out,
            case.elem,
            d.head_dim,
        ),
        // lse is f32: compared against f32 precision.
        quantity(
            "lse",
            &got_lse,
            &exact_fwd.lse,
            &exact_fwd.lse,
            ElemType::F32,
            1,
        ),
        quantity(
            "dQ",
            &got_dq,
            &exact_bwd.dq,
            &naive_bwd.dq,
            case.elem,
            d.head_dim,
        ),
        quantity(
            "dK",
            &got_dk,
            &exact_bwd.dk,
            &naive_bwd.dk,
            case.elem,
            d.head_dim,
        ),
        quantity(
            "dV",
            &got_dv,
            &exact_bwd.dv,
            &naive_bwd.dv,
            case.elem,
            d.head_dim,
        ),
    ]);
    match (compared, unchanged.is_empty()) {
        (Ok(()), true) => Ok(()),
        (outcome, _) => {
            Err([outcome.err().unwrap_or_default(), unchanged.join("; ")].join("\n    "))
        }
    }
}

/// The chunked cases: GQA and MQA, both types and head dims, causal (query and key chunks cut
/// at different places, so that some pairs are hidden and some rows of a pair see nothing) and
/// unmasked, in order and reversed (a first step no query sees, later steps from the empty
/// state), equal chunks over several tiles as the sequence-parallel passes cut them, and masks
/// that hide pairs below the diagonal too: sliding windows (150 keys, 1 key, two-sided) and
/// packed documents (a one-token document, odd lengths, one list per batch row, under a window).
fn cases() -> Vec<Chunked> {
    let causal = Mask::causal();
    let (bf16, f16) = (ElemType::BF16, ElemType::F16);
    let uneven: (&[usize], &[usize]) = (&[0, 131, 300, 517, 700], &[0, 200, 450, 700]);
    let mut cases: Vec<Chunked> = [
        (81, 128, bf16, false),
        (82, 64, f16, true),
        (83, 128, f16, true),
        (84, 64, bf16, false),
    ]
    .into_iter()
    .map(|(seed, d, elem, reversed)| {
        let mask = (causal.clone(), elem);
        Chunked::new(seed, (1, 4, 2), (700, d), mask, uneven, reversed)
    })
    .collect();
    cases.extend([
        Chunked::new(
            85,
            (2, 3, 3),
            (383, 64),
            (Mask::none(), bf16),
            (&[0, 190, 383], &[0, 129, 256, 383]),
            false,
        ),
        Chunked::new(
            86,
            (1, 4, 1),
            (520, 128),
            (causal.clone(), f16),
            (&[0, 256, 520], &[0, 128, 300, 520]),
            true,
        ),
        Chunked::new(
            87,
            (1, 2, 2),
            (1100, 128),
            (causal, bf16),
            (&[0, 275, 550, 825, 1100], &[0, 275, 550, 825, 1100]),
            false,
        ),
    ]);
    let window = |size| Mask::causal().with_window(SlidingWindow::causal(size).unwrap());
    let documents = Documents::from_cu_seqlens(&[0, 1, 140, 141, 400, 523, 700]).unwrap();
    let per_row = Documents::per_batch_row(&[vec![0, 90, 91, 383], vec![0, 200, 383]]).unwrap();
    let masked = [
        (88, (1, 4, 2), 128, bf16, window(150), false),
        (89, (1, 4, 1), 64, f16, window(1), true),
        (
            90,
            (1, 2, 2),
            128,
            f16,
            Mask::none().with_window(SlidingWindow::two_sided(60, 20)),
            false,
        ),
        (
            91,
            (1, 4, 2),
            64,
            bf16,
            Mask::causal().with_documents(documents.clone()),
            true,
        ),
        (
            92,
            (1, 4, 2),
            128,
            bf16,
            Mask::none().with_documents(documents.clone()),
            false,
        ),
        (
            93,
            (1, 2, 1),
            128,
            f16,
            window(100).with_documents(documents),
            false,
        ),
    ];
    for (seed, heads, d, elem, mask, reversed) in masked {
        cases.push(Chunked::new(
            seed,
            heads,
            (700, d),
            (mask, elem),
            uneven,
            reversed,
        ));
    }
    cases.push(Chunked::new(
        94,
        (2, 3, 3),
        (383, 64),
        (Mask::causal().with_documents(per_row), f16),
        (&[0, 190, 383], &[0, 129, 256, 383]),
        false,
    ));
    cases
}

/// Every chunked case on the Hopper steps against the f64 reference.
pub fn chunked_steps_match_the_f64_reference<R: Runtime>(client: &ComputeClient<R>) {
    let all = cases();
    let named = all.iter().map(|chunked| (chunked.name.as_str(), chunked));
    check_each("hopper steps", named, |chunked| {
        check_chunked(client, chunked)
    });
}

/// The chunked cases (packed documents included) on the deterministic Hopper backward steps
/// against the f64 reference; then one pair's deterministic backward step twice into zeroed
/// accumulators: bitwise the same.
pub fn deterministic_steps_match_the_f64_reference_bitwise_twice<R: Runtime>(
    client: &ComputeClient<R>,
) {
    let all = deterministic_cases();
    let named = all.iter().map(|chunked| (chunked.name.as_str(), chunked));
    check_each("hopper deterministic steps", named, |chunked| {
        check_chunked(client, chunked)
    });
    let run = one_deterministic_step(client, &all[0]);
    assert!(
        run() == run(),
        "the deterministic backward step gave other gradients on a second run ({})",
        all[0].name
    );
}

/// The deterministic Hopper backward steps with their ordered dQ adds made by a producer warp
/// (`DeterministicAdds::Producer`, forced) on the chunked cases against the f64 reference; then
/// one pair's step twice into zeroed accumulators: bitwise the same, and bitwise the consumers'
/// form (`DeterministicAdds::Consumers`: the same adds in the same order).
pub fn deterministic_producer_steps_match_the_reference_and_the_consumers_bitwise<R: Runtime>(
    client: &ComputeClient<R>,
) {
    let force = |adds| {
        schedule::force_backward(Some(BackwardSchedule {
            deterministic_adds: adds,
            ..BackwardSchedule::default()
        }))
    };
    let all = deterministic_cases();
    let named = all.iter().map(|chunked| (chunked.name.as_str(), chunked));
    force(DeterministicAdds::Producer);
    check_each(
        "hopper deterministic steps, producer adds",
        named,
        |chunked| check_chunked(client, chunked),
    );
    let run = one_deterministic_step(client, &all[0]);
    let (first, second) = (run(), run());
    force(DeterministicAdds::Consumers);
    let consumers = run();
    schedule::force_backward(None);
    assert!(
        first == second,
        "the deterministic backward step with producer adds gave other gradients on a second run \
         ({})",
        all[0].name
    );
    assert!(
        first == consumers,
        "the deterministic backward step with producer adds differs from the consumers' form ({})",
        all[0].name
    );
}

/// The chunked cases, deterministic.
fn deterministic_cases() -> Vec<Chunked> {
    cases()
        .into_iter()
        .map(|mut chunked| {
            chunked.deterministic = true;
            chunked.name.push_str(" deterministic");
            chunked
        })
        .collect()
}

/// One pair of `chunked`'s chunks: a call of its deterministic backward step into zeroed
/// accumulators, giving the bits of dQ, dK and dV.
fn one_deterministic_step<'a, R: Runtime>(
    client: &'a ComputeClient<R>,
    chunked: &Chunked,
) -> impl Fn() -> [Vec<u64>; 3] + 'a {
    let case = &chunked.case;
    let d = case.dims;
    let (q_chunk, kv) = ((131, 700), (0, 450));
    let q = chunked.upload_rows(client, &case.q, d.q_heads, q_chunk);
    let grad_out = chunked.upload_rows(client, &case.grad_out, d.q_heads, q_chunk);
    let k = chunked.upload_rows(client, &case.k, d.kv_heads, kv);
    let v = chunked.upload_rows(client, &case.v, d.kv_heads, kv);
    let opts = chunked.step_options(q_chunk, kv, Variant::Hopper);
    let (out, lse) = distflash_kernels::attention(client, &q, &k, &v, &opts).unwrap();
    let delta = distflash_kernels::backward_delta(client, &out, &grad_out).unwrap();
    let rows = AttentionDims {
        q_len: q_chunk.1 - q_chunk.0,
        kv_len: kv.1 - kv.0,
        ..d
    };
    move || {
        let grads = GradAccumulators::zeros(client, &rows).unwrap();
        distflash_kernels::backward_step(
            client, &q, &k, &v, &grad_out, &lse, &delta, &grads, &opts,
        )
        .unwrap();
        [&grads.dq, &grads.dk, &grads.dv].map(|t| bits(client, t))
    }
}

/// `values` (f32) uploaded into the middle of a larger f32 buffer, after `before` random values
/// (a multiple of 4: the view starts on a 16-byte boundary) and before 37 more: the view of
/// `shape`, the whole buffer, and the whole buffer's values.
fn view_in_larger_buffer<R: Runtime>(
    client: &ComputeClient<R>,
    rng: &mut Rng,
    (values, shape): (&[f64], Vec<usize>),
    before: usize,
) -> (DeviceTensor, DeviceTensor, Vec<f64>) {
    let mut all = rng.tensor(before, 0.5, ElemType::F32);
    all.extend_from_slice(values);
    all.extend(rng.tensor(37, 0.5, ElemType::F32));
    let whole = DeviceTensor::from_f32(client, &to_f32(&all), vec![all.len()], ElemType::F32);
    let view = DeviceTensor {
        handle: whole.handle.clone().offset_start((before * 4) as u64),
        shape,
        elem: ElemType::F32,
    };
    (view, whole, all)
}

/// The f32 bits of a tensor's values.
fn f32_bits<R: Runtime>(client: &ComputeClient<R>, tensor: &DeviceTensor) -> Vec<u32> {
    tensor.to_f32(client).iter().map(|x| x.to_bits()).collect()
}

/// A backward step (169 query rows, 69 of which see no key of the pair: their lse is -inf) whose
/// lse, delta and accumulators are views into larger buffers, each past other data: it adds what
/// the same step adds to buffers of their own (dK and dV bit for bit; dQ, added with atomics in
/// no fixed order, within f32 tolerance), leaves the rows that see nothing and the data around
/// the views bit for bit as they were, and writes no NaN.
pub fn a_step_adds_into_views_of_larger_buffers<R: Runtime>(client: &ComputeClient<R>) {
    let chunked = &cases()[0];
    let case = &chunked.case;
    let d = case.dims;
    let (q_chunk, kv) = ((131, 300), (200, 450));
    let rows = AttentionDims {
        q_len: q_chunk.1 - q_chunk.0,
        kv_len: kv.1 - kv.0,
        ..d
    };
    let q = chunked.upload_rows(client, &case.q, d.q_heads, q_chunk);
    let grad_out = chunked.upload_rows(client, &case.grad_out, d.q_heads, q_chunk);
    let k = chunked.upload_rows(client, &case.k, d.kv_heads, kv);
    let v = chunked.upload_rows(client, &case.v, d.kv_heads, kv);
    let hopper = chunked.step_options(q_chunk, kv, Variant::Hopper);
    // The pair's own attention: its rows that see no key have lse = -inf and delta = 0.
    let auto = StepOptions {
        variant: Variant::Auto,
        ..hopper.clone()
    };
    let (out, lse) = distflash_kernels::attention(client, &q, &k, &v, &auto).unwrap();
    let delta = distflash_kernels::backward_delta(client, &out, &grad_out).unwrap();
    let (lse_host, delta_host) = (read(client, &lse), read(client, &delta));
    let blind = kv.0 - q_chunk.0;
    assert!(
        lse_host[..blind].iter().all(|x| *x == f64::NEG_INFINITY),
        "the first rows of the pair see no key"
    );
    let mut rng = Rng::new(93);
    let shapes = [rows.q_shape(), rows.kv_shape(), rows.kv_shape()];
    let starts = shapes
        .clone()
        .map(|shape| rng.tensor(shape.iter().product(), 0.5, ElemType::F32));
    let upload = |values: &[f64], shape: &Vec<usize>| {
        DeviceTensor::from_f32(client, &to_f32(values), shape.clone(), ElemType::F32)
    };
    let own = GradAccumulators {
        dq: upload(&starts[0], &shapes[0]),
        dk: upload(&starts[1], &shapes[1]),
        dv: upload(&starts[2], &shapes[2]),
    };
    let step = |lse: &DeviceTensor, delta: &DeviceTensor, grads: &GradAccumulators| {
        distflash_kernels::backward_step(client, &q, &k, &v, &grad_out, lse, delta, grads, &hopper)
            .unwrap()
    };
    step(&lse, &delta, &own);

    let row_shape = rows.row_shape();
    let (lse_view, _, _) =
        view_in_larger_buffer(client, &mut rng, (&lse_host, row_shape.clone()), 4);
    let (delta_view, _, _) = view_in_larger_buffer(client, &mut rng, (&delta_host, row_shape), 8);
    let [(dq, dq_whole, dq_all), (dk, dk_whole, dk_all), (dv, dv_whole, dv_all)] =
        [0, 1, 2].map(|i| {
            view_in_larger_buffer(
                client,
                &mut rng,
                (&starts[i], shapes[i].clone()),
                4 * (i + 1),
            )
        });
    step(&lse_view, &delta_view, &GradAccumulators { dq, dk, dv });

    for (name, whole, all, before, own) in [
        ("dQ", &dq_whole, &dq_all, 4, &own.dq),
        ("dK", &dk_whole, &dk_all, 8, &own.dk),
        ("dV", &dv_whole, &dv_all, 12, &own.dv),
    ] {
        let got = whole.to_f32(client);
        let len = own.len();
        let around = |values: &[f32]| {
            let (head, rest) = values.split_at(before);
            [head, &rest[len..]]
                .concat()
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>()
        };
        assert!(
            around(&got) == around(&to_f32(all)),
            "{name}: the step wrote outside its view"
        );
        let view = &got[before..before + len];
        assert!(
            view.iter().all(|x| x.is_finite()),
            "{name}: NaN or infinity"
        );
        if name == "dQ" {
            let expected = read(client, own);
            assert_close(
                "dQ in a view",
                &to_f64(view),
                &expected,
                &expected,
                ElemType::F32,
            );
            // Rows that see no key of the pair keep their values bit for bit.
            let start = to_f32(&starts[0]);
            let slice_values = rows.q_len * d.head_dim;
            let blind_values = blind * d.head_dim;
            for slice in 0..d.batch * d.q_heads {
                let first = slice * slice_values;
                let blind_rows = first..first + blind_values;
                assert!(
                    view[blind_rows.clone()]
                        .iter()
                        .zip(&start[blind_rows])
                        .all(|(g, s)| g.to_bits() == s.to_bits()),
                    "dQ: a row of slice {slice} that sees no key changed"
                );
            }
        } else {
            let own_bits = f32_bits(client, own);
            assert!(
                view.iter().map(|x| x.to_bits()).eq(own_bits),
                "{name}: a view's sum differs from a buffer's own"
            );
        }
    }
}

/// The steps under `Variant::Auto` are bitwise those under `Variant::Hopper` (the backward's dQ,
/// added with atomics in no fixed order, within the tolerance of it) where the Hopper kernels
/// cover the call, a windowed step among them.
pub fn auto_runs_the_hopper_steps_where_they_cover_the_call<R: Runtime>(client: &ComputeClient<R>) {
    let chunked = &cases()[0];
    let case = &chunked.case;
    let d = case.dims;
    let (q_chunk, first, last) = ((300, 517), (0, 200), (200, 450));
    let q = chunked.upload_rows(client, &case.q, d.q_heads, q_chunk);
    let grad_out = chunked.upload_rows(client, &case.grad_out, d.q_heads, q_chunk);
    let keys = |kv| {
        (
            chunked.upload_rows(client, &case.k, d.kv_heads, kv),
            chunked.upload_rows(client, &case.v, d.kv_heads, kv),
        )
    };
    let ((k0, v0), (k1, v1)) = (keys(first), keys(last));
    let run = |variant| {
        let opts = |kv| chunked.step_options(q_chunk, kv, variant);
        let state =
            distflash_kernels::forward_first_step(client, &q, &k0, &v0, &opts(first)).unwrap();
        let stepped = [&state.o, &state.m, &state.l].map(|t| bits(client, t));
        let again = SoftmaxState::empty(
            client,
            d.batch,
            d.q_heads,
            q_chunk.1 - q_chunk.0,
            d.head_dim,
        )
        .unwrap();
        distflash_kernels::forward_step(client, &q, &k0, &v0, &again, &opts(first)).unwrap();
        let from_empty = [&again.o, &again.m, &again.l].map(|t| bits(client, t));
        let (out, lse) =
            distflash_kernels::forward_last_step(client, &q, &k1, &v1, state, &opts(last)).unwrap();
        let delta = distflash_kernels::backward_delta(client, &out, &grad_out).unwrap();
        let rows = AttentionDims {
            q_len: q_chunk.1 - q_chunk.0,
            kv_len: last.1 - last.0,
            ..d
        };
        let grads = GradAccumulators::zeros(client, &rows).unwrap();
        distflash_kernels::backward_step(
            client,
            &q,
            &k1,
            &v1,
            &grad_out,
            &lse,
            &delta,
            &grads,
            &opts(last),
        )
        .unwrap();
        let finished = [&out, &lse, &grads.dk, &grads.dv].map(|t| bits(client, t));
        (stepped, from_empty, finished, read(client, &grads.dq))
    };
    let (hopper_state, hopper_from_empty, hopper_finished, hopper_dq) = run(Variant::Hopper);
    assert!(
        hopper_state == hopper_from_empty,
        "the Hopper first step is not the empty state and a step"
    );
    let (auto_state, _, auto_finished, auto_dq) = run(Variant::Auto);
    assert!(
        auto_state == hopper_state && auto_finished == hopper_finished,
        "Auto does not run the Hopper steps"
    );
    assert_close("Auto dQ", &auto_dq, &hopper_dq, &hopper_dq, ElemType::F32);
    let (tc_state, _, tc_finished, _) = run(Variant::TensorCore);
    assert!(
        tc_state != hopper_state && tc_finished != hopper_finished,
        "the tensor-core steps gave bitwise the Hopper results: the comparison above proves nothing"
    );

    let windowed = |variant| StepOptions {
        mask: Mask::causal()
            .with_window(SlidingWindow::causal(100).unwrap())
            .at(q_chunk.0 as i64, last.0 as i64),
        ..options(case, variant)
    };
    let first_step = |variant| {
        let state = distflash_kernels::forward_first_step(client, &q, &k1, &v1, &windowed(variant))
            .unwrap();
        [&state.o, &state.m, &state.l].map(|t| bits(client, t))
    };
    assert!(
        first_step(Variant::Auto) == first_step(Variant::Hopper),
        "Auto does not run a windowed step on the Hopper forward"
    );
    assert!(
        first_step(Variant::TensorCore) != first_step(Variant::Hopper),
        "the tensor-core step gave bitwise the Hopper state: the comparison above proves nothing"
    );
}

#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_steps_match_f64_reference() {
    chunked_steps_match_the_f64_reference(&hopper_client());
}

#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_deterministic_steps_match_f64_reference_bitwise_twice() {
    deterministic_steps_match_the_f64_reference_bitwise_twice(&hopper_client());
}

#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_deterministic_producer_steps_match_f64_reference_and_consumers_bitwise() {
    deterministic_producer_steps_match_the_reference_and_the_consumers_bitwise(&hopper_client());
}

#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_step_adds_into_views_of_larger_buffers() {
    a_step_adds_into_views_of_larger_buffers(&hopper_client());
}

#[test]
#[ignore = "needs an H100/H200 (CUDA compute capability 9.0): run with --ignored there"]
fn cuda_hopper_steps_are_what_auto_runs() {
    auto_runs_the_hopper_steps_where_they_cover_the_call(&hopper_client());
}

#[test]
fn hopper_steps_refuse_a_device_without_wgmma() {
    let client = cubecl::wgpu::WgpuRuntime::client(&cubecl::wgpu::WgpuDevice::Cpu);
    // f16 buffers the kernels would cover: nothing runs on them.
    let case = Case::new(18, (1, 2, 1), (40, 40, 64), Mask::causal(), ElemType::F16);
    let (q, k, v) = case.qkv(&client);
    let d = case.dims;
    let hopper = options(&case, Variant::Hopper);
    let f32_zeros = |shape| distflash_kernels::zeros_f32(&client, shape).unwrap();
    let state = SoftmaxState::empty(&client, d.batch, d.q_heads, d.q_len, d.head_dim).unwrap();
    let grads = GradAccumulators::zeros(&client, &d).unwrap();
    let (lse, delta) = (f32_zeros(d.row_shape()), f32_zeros(d.row_shape()));
    let grad_out = case.upload(&client, &case.grad_out, d.q_shape());
    let forward = "the Hopper attention forward needs a CUDA GPU of compute capability 9.0";
    let backward = "the Hopper attention backward needs a CUDA GPU of compute capability 9.0";
    let refusals = [
        (
            distflash_kernels::forward_first_step(&client, &q, &k, &v, &hopper).err(),
            forward,
        ),
        (
            distflash_kernels::forward_step(&client, &q, &k, &v, &state, &hopper).err(),
            forward,
        ),
        (
            distflash_kernels::forward_last_step(&client, &q, &k, &v, state.clone(), &hopper).err(),
            forward,
        ),
        (
            distflash_kernels::backward_step(
                &client, &q, &k, &v, &grad_out, &lse, &delta, &grads, &hopper,
            )
            .err(),
            backward,
        ),
    ];
    for (err, what) in refusals {
        let err = err.unwrap_or_else(|| panic!("not refused: {what}"));
        assert!(
            matches!(err, KernelError::DeviceLimit { .. }) && err.to_string().contains(what),
            "{what}: {err}"
        );
    }
    // Auto runs the steps here, on the portable kernels.
    let f32_case = Case::new(19, (1, 2, 1), (40, 40, 64), Mask::causal(), ElemType::F32);
    let (q32, k32, v32) = f32_case.qkv(&client);
    let auto = options(&f32_case, Variant::Auto);
    let state = distflash_kernels::forward_first_step(&client, &q32, &k32, &v32, &auto).unwrap();
    distflash_kernels::forward_step(&client, &q32, &k32, &v32, &state, &auto).unwrap();
}
