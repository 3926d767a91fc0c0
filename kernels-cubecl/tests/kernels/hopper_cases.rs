//! What the Hopper kernels' tests share: tables of named cases (those every attention kernel's
//! table holds among them), each computed quantity compared with the f64 reference under
//! `assert_close`'s rule, every case run before any failure is reported, and each failure
//! reported with a map of where it lies (which rows of a block, which columns, the first few
//! values).

use super::*;

/// One case of a table: its data and a name for the report.
pub struct Named {
    pub name: String,
    pub case: Case,
}

/// The case of these sizes and mask, named by them.
pub fn named(
    seed: u64,
    heads: (usize, usize, usize),
    lens: (usize, usize, usize),
    mask: Mask,
    elem: ElemType,
) -> Named {
    Named {
        name: format!("{heads:?} {lens:?} {mask:?} {elem:?}"),
        case: Case::new(seed, heads, lens, mask, elem),
    }
}

/// The CUDA client of device 0, once it is known to run the Hopper kernels (an H100/H200).
pub fn hopper_client() -> ComputeClient<cubecl::cuda::CudaRuntime> {
    let client = cubecl::cuda::CudaRuntime::client(&cubecl::cuda::CudaDevice::new(0));
    assert!(
        distflash_kernels::hopper::available(&client),
        "not a compute capability 9.0 GPU"
    );
    client
}

/// The bits of a tensor's values, for comparisons that must be exact.
pub fn bits<R: Runtime>(client: &ComputeClient<R>, tensor: &DeviceTensor) -> Vec<u64> {
    read(client, tensor).iter().map(|x| x.to_bits()).collect()
}

/// The call the kernels' `Variant::Auto` tests make: GQA 4/2, 300 rows, head dim 128, causal,
/// bf16.
pub fn auto_case() -> Case {
    Case::new(
        9,
        (1, 4, 2),
        (300, 300, 128),
        Mask::causal(),
        ElemType::BF16,
    )
}

/// Scores far below zero (every `q . k` near -900) beside a key count that ends inside a key
/// tile or block: its zero-filled keys past the end score 0, far above every real key, so they
/// must stay masked (a backward's probabilities of them would overflow).
pub fn extreme_scores(mask: Mask, elem: ElemType, head_dim: usize) -> Named {
    let mut named = named(67, (1, 2, 1), (64, 100, head_dim), mask, elem);
    named.case.set_extreme_scores();
    named.name = format!("extreme scores, {}", named.name);
    named
}

/// The cases every Hopper attention kernel's table holds for one element type and head dim:
/// one tile, the causal diagonal alone, batch 2 with short tiles, tiny MQA, a later query chunk
/// against a longer key chunk (its diagonal crossing tiles at an offset that is no multiple of
/// one), extreme scores, and GQA with odd lengths over several tiles (unmasked, causal aligned at
/// the end, and keys ahead of the queries: the first 40 rows see nothing).
pub fn common_cases(elem: ElemType, d: usize) -> Vec<Named> {
    let mut cases = vec![
        named(1, (1, 1, 1), (128, 128, d), Mask::none(), elem),
        named(2, (1, 2, 2), (128, 128, d), Mask::causal(), elem),
        named(3, (2, 3, 3), (96, 96, d), Mask::causal(), elem),
        named(4, (1, 4, 1), (33, 70, d), Mask::none(), elem),
        named(
            5,
            (1, 4, 2),
            (700, 1100, d),
            Mask::causal().at(300, 0),
            elem,
        ),
        extreme_scores(Mask::none(), elem, d),
        extreme_scores(Mask::causal().at(200, 0), elem, d),
    ];
    for mask in [
        Mask::none(),
        Mask::causal().at(517 - 383, 0),
        Mask::causal().at(0, 40),
    ] {
        cases.push(named(6, (1, 4, 2), (383, 517, d), mask, elem));
    }
    cases
}

/// Sliding windows (1 key, 37, 200 over several tiles, wider than the sequence, two-sided) and
/// packed documents (lengths 1, odd and longer than a tile; shared and one list per batch row;
/// bidirectional; under a window), each call's query and key chunks ending at the sequence's
/// last position, then the edges of a band: keys ahead of every query, the diagonal alone,
/// documents that start inside the key chunk or end inside the query chunk, runs of one-token
/// documents. Both 16-bit types and head dims, GQA, two batch rows.
pub fn masked_cases() -> Vec<Named> {
    let mut cases = Vec::new();
    let shapes = [
        (ElemType::BF16, (1, 4, 2), (383, 517, 128)),
        (ElemType::F16, (1, 4, 2), (383, 517, 64)),
        (ElemType::F16, (2, 3, 3), (300, 300, 128)),
        (ElemType::BF16, (2, 3, 3), (300, 300, 64)),
    ];
    for (elem, heads, lens) in shapes {
        for group in [BandGroup::Windows, BandGroup::Documents] {
            for mask in band_masks(group, heads.0, lens.0, lens.1) {
                cases.push(named(53, heads, lens, mask, elem));
            }
        }
    }
    let mut edges = band_edges();
    edges.push((
        (1100, 1100),
        Mask::causal().with_window(SlidingWindow::causal(200).unwrap()),
    ));
    for (i, ((q_len, kv_len), mask)) in edges.into_iter().enumerate() {
        let (elem, head_dim) = if i % 2 == 0 {
            (ElemType::BF16, 128)
        } else {
            (ElemType::F16, 64)
        };
        cases.push(named(61, (1, 2, 1), (q_len, kv_len, head_dim), mask, elem));
    }
    cases
}

/// `per_head_dim`'s cases for every element type and head dim of the Hopper attention kernels,
/// then two in the benchmarks' configuration: many tiles and blocks, and GQA 32 / 8.
pub fn every_type_and_head_dim(per_head_dim: impl Fn(ElemType, usize) -> Vec<Named>) -> Vec<Named> {
    let mut all = Vec::new();
    for elem in [ElemType::BF16, ElemType::F16] {
        for head_dim in distflash_kernels::hopper::HEAD_DIMS {
            all.extend(per_head_dim(elem, head_dim));
        }
    }
    all.push(named(
        41,
        (1, 5, 5),
        (1023, 1023, 128),
        Mask::causal(),
        ElemType::BF16,
    ));
    all.push(named(
        42,
        (1, 32, 8),
        (257, 257, 64),
        Mask::causal(),
        ElemType::BF16,
    ));
    all
}

/// One computed quantity of a case beside its reference: exact, and as a naive kernel in `elem`
/// would round it (the two ends of the tolerance). Its values are rows of `cols`, `slice_rows`
/// rows a (batch, head) slice, which the kernel computes in blocks of `block_rows`.
pub struct Quantity<'a> {
    pub name: &'a str,
    pub got: &'a [f64],
    pub exact: &'a [f64],
    pub naive: &'a [f64],
    pub elem: ElemType,
    pub slice_rows: usize,
    pub cols: usize,
    pub block_rows: usize,
}

/// Each quantity against its reference (`assert_close`); the errors, each with a map of where
/// it lies, if any differs.
pub fn compare(quantities: &[Quantity]) -> Result<(), String> {
    let mut failures = Vec::new();
    for quantity in quantities {
        let Quantity {
            name,
            got,
            exact,
            naive,
            elem,
            ..
        } = *quantity;
        let outcome = std::panic::catch_unwind(|| assert_close(name, got, exact, naive, elem));
        if let Err(panic) = outcome {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_else(|| "assert_close failed".into());
            failures.push(format!("{message}\n      {}", error_map(quantity)));
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("\n    "))
    }
}

/// Where a quantity differs from its reference beyond the tolerance: how many elements (NaN
/// among them), which eighths of a block's rows, which 8-column groups, and the first few.
fn error_map(quantity: &Quantity) -> String {
    let threshold = threshold(quantity.exact, quantity.naive, quantity.elem);
    let (cols, block_rows) = (quantity.cols, quantity.block_rows);
    let mut bad = 0usize;
    let mut nan = 0usize;
    let mut row_groups = [0usize; 8];
    let mut col_groups = vec![0usize; cols.div_ceil(8)];
    let mut first = Vec::new();
    for (index, (g, e)) in quantity.got.iter().zip(quantity.exact).enumerate() {
        let wrong = if g.is_nan() || e.is_nan() {
            g.is_nan() != e.is_nan()
        } else if g.is_infinite() || e.is_infinite() {
            g != e
        } else {
            (g - e).abs() > threshold
        };
        if !wrong {
            continue;
        }
        bad += 1;
        nan += usize::from(g.is_nan());
        let (row, col) = (index / cols, index % cols);
        let (slice, i) = (row / quantity.slice_rows, row % quantity.slice_rows);
        row_groups[(i % block_rows) * 8 / block_rows] += 1;
        col_groups[col / 8] += 1;
        if first.len() < 4 {
            first.push(format!("slice {slice} row {i} col {col}: {g} vs {e}"));
        }
    }
    format!(
        "{bad} of {} wrong ({nan} NaN); by eighth of a {block_rows}-row block {row_groups:?}; \
         by 8-column group {col_groups:?}; first: {}",
        quantity.got.len(),
        first.join("; ")
    )
}

/// The tolerance of `assert_close` for these values.
fn threshold(exact: &[f64], naive: &[f64], elem: ElemType) -> f64 {
    let magnitude = exact
        .iter()
        .filter(|x| x.is_finite())
        .fold(1.0f64, |a, x| a.max(x.abs()));
    2.0 * oracle::max_abs_diff(naive, exact) + 1e-3 * magnitude * f64::from(elem != ElemType::F32)
}

/// Runs `check` on every case (all of them, so one run shows the whole picture) and panics
/// listing the failures.
pub fn check_all(what: &str, cases: &[Named], check: impl Fn(&Case) -> Result<(), String>) {
    let named = cases.iter().map(|named| (named.name.as_str(), &named.case));
    check_each(what, named, check);
}

/// [`check_all`] for cases of any kind, each with its name.
pub fn check_each<'a, T: 'a>(
    what: &str,
    cases: impl IntoIterator<Item = (&'a str, &'a T)>,
    check: impl Fn(&T) -> Result<(), String>,
) {
    let mut count = 0;
    let failures: Vec<String> = cases
        .into_iter()
        .filter_map(|(name, case)| {
            count += 1;
            let outcome = check(case);
            println!(
                "{what} {name}: {}",
                if outcome.is_ok() { "ok" } else { "FAILED" }
            );
            outcome
                .err()
                .map(|error| format!("{what} {name}:\n    {error}"))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {count} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
