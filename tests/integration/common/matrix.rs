//! The op's coverage matrix on one backend: every supported head dim x {MHA, GQA, MQA} x
//! {f32, f16, bf16} x {causal, full} x {one-shot, stepped}, each cell checking the forward
//! output and all three gradients against the f64 reference (tiny odd shapes, so CI can afford
//! it). Prints the matrix, then fails naming every failed cell.
#![allow(dead_code)]

use std::panic::{catch_unwind, AssertUnwindSafe};

use burn::tensor::backend::AutodiffBackend;
use burn_distflash::FlashAttentionBackend;
use distflash_kernels::{ElemType, Mask, SUPPORTED_HEAD_DIMS};

use super::burn_case::{check_case, check_steps_case, dtype_of};

/// Head groupings: name, batch, query heads, key/value heads.
const GROUPINGS: [(&str, usize, usize, usize); 3] =
    [("MHA", 2, 2, 2), ("GQA", 1, 4, 2), ("MQA", 1, 3, 1)];
/// Query and key lengths: odd, longer than one 16-row tile, keys split into 3 + 13 + ... chunks
/// when stepped.
const LENS: (usize, usize) = (9, 19);
const ELEMS: [ElemType; 3] = [ElemType::F32, ElemType::F16, ElemType::BF16];

/// What one cell came to.
enum Cell {
    Pass,
    Fail(String),
    /// The backend does not support the float type on this device.
    Unsupported,
}

fn run(check: impl FnOnce()) -> Cell {
    match catch_unwind(AssertUnwindSafe(check)) {
        Ok(()) => Cell::Pass,
        Err(payload) => Cell::Fail(
            payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panicked".into()),
        ),
    }
}

/// Runs the whole matrix on `B` (one-shot through `Autodiff`, stepped on the inner backend's
/// step operations) and asserts every supported cell passes.
pub fn check_matrix<B>(device: &B::Device, backend: &str)
where
    B: AutodiffBackend + FlashAttentionBackend,
    B::InnerBackend: FlashAttentionBackend,
{
    let (q_len, kv_len) = LENS;
    let mut lines = Vec::new();
    let mut failures = Vec::new();
    let mut header = format!("{:>4} {:<4}", "hd", "");
    for elem in ELEMS {
        for mode in [
            "causal 1-shot",
            "causal stepped",
            "full 1-shot",
            "full stepped",
        ] {
            header += &format!(" | {:<4} {:<14}", format!("{elem:?}"), mode);
        }
    }
    for head_dim in SUPPORTED_HEAD_DIMS {
        for (grouping, batch, q_heads, kv_heads) in GROUPINGS {
            let mut line = format!("{head_dim:>4} {grouping:<4}");
            for elem in ELEMS {
                let supported = B::supports_dtype(device, dtype_of(elem));
                for causal in [true, false] {
                    let heads = (batch, q_heads, kv_heads);
                    let lens = (q_len, kv_len, head_dim);
                    let stepped_mask = if causal {
                        Mask::causal().at((kv_len - q_len) as i64, 0)
                    } else {
                        Mask::none()
                    };
                    let cells = if supported {
                        [
                            run(|| check_case::<B>(device, elem, heads, lens, causal)),
                            run(|| {
                                check_steps_case::<B::InnerBackend>(
                                    device,
                                    elem,
                                    heads,
                                    lens,
                                    stepped_mask,
                                )
                            }),
                        ]
                    } else {
                        [Cell::Unsupported, Cell::Unsupported]
                    };
                    for (mode, cell) in ["one-shot", "stepped"].iter().zip(cells) {
                        let mark = match cell {
                            Cell::Pass => "ok",
                            Cell::Unsupported => "n/a",
                            Cell::Fail(message) => {
                                failures.push(format!(
                                    "{backend} head_dim {head_dim} {grouping} {elem:?} causal={causal} {mode}: {message}"
                                ));
                                "FAIL"
                            }
                        };
                        line += &format!(" | {mark:<19}");
                    }
                }
            }
            lines.push(line);
        }
    }
    eprintln!(
        "coverage matrix on {backend} (forward O and dq, dk, dv against f64; q {q_len} rows, \
         k/v {kv_len} rows; n/a = float type unsupported by the backend):\n{header}\n{}",
        lines.join("\n")
    );
    assert!(
        failures.is_empty(),
        "{} failed cells:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
