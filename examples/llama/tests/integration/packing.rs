//! Packed documents and sliding windows in the Llama model, on the CPU: a packed forward gives
//! each document the logits it gets alone, so earlier documents' tokens change nothing after
//! them (and do without packing); a window changes the logits of the positions beyond it only;
//! configs written before the `window` field still load, and a window of 0 or an end-of-text id
//! outside the vocabulary is refused.

use crate::common::input_error;
use burn::backend::ndarray::NdArrayDevice;
use burn::backend::NdArray;
use burn::tensor::{Int, Tensor, TensorData};
use burn_distflash::{AttentionContext, Documents};
use distflash_llama::data::Packing;
use distflash_llama::{Llama, LlamaConfig, LlamaInput};

type Cpu = NdArray<f32>;
const DEVICE: NdArrayDevice = NdArrayDevice::Cpu;
const VOCAB: usize = 64;
/// The end-of-text token of these tests.
const EOT: u32 = 3;
const SEED: u64 = 21;

/// vocab 64, d_model 64, 2 layers, 4 heads over 2 key/value heads (head_dim 16), d_ff 96.
fn config() -> LlamaConfig {
    LlamaConfig::new(VOCAB, 64, 2, 4, 2, 96)
}

fn model(config: &LlamaConfig) -> Llama<Cpu> {
    config.try_init_seeded::<Cpu>(&DEVICE, SEED).unwrap()
}

/// Logits `[rows][position][vocab]` of `rows` (all of one length), packed when `documents` is
/// given.
fn logits(
    model: &Llama<Cpu>,
    rows: &[Vec<u32>],
    documents: Option<&Documents>,
) -> Vec<Vec<Vec<f32>>> {
    let (batch, seq) = (rows.len(), rows[0].len());
    let values: Vec<i64> = rows.iter().flatten().map(|&t| i64::from(t)).collect();
    let tokens = Tensor::<Cpu, 2, Int>::from_data(TensorData::new(values, [batch, seq]), &DEVICE);
    let context = AttentionContext::Local;
    let input = LlamaInput {
        tokens,
        documents: documents.cloned(),
    };
    let out = model.forward(input, &context).unwrap();
    let flat = out.into_data().to_vec::<f32>().unwrap();
    flat.chunks(seq * VOCAB)
        .map(|row| row.chunks(VOCAB).map(<[f32]>::to_vec).collect())
        .collect()
}

/// The largest difference between two runs of logits.
fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Two rows of 24 tokens with their documents ended by [`EOT`]: row 0 holds documents of 7, 1
/// and 16 tokens (the second only an EOT), row 1 an EOT first (a one-token document at the row's
/// start), then 22 tokens and an EOT at the last position (which ends the last document).
fn packed_rows() -> Vec<Vec<u32>> {
    let text = |seed: u32, n: usize| -> Vec<u32> {
        (0..n as u32)
            .map(|i| 4 + (seed * 7 + i * 13) % (VOCAB as u32 - 4))
            .collect()
    };
    let mut row0 = text(1, 6);
    row0.push(EOT);
    row0.push(EOT);
    row0.extend(text(2, 16));
    let mut row1 = vec![EOT];
    row1.extend(text(3, 22));
    row1.push(EOT);
    vec![row0, row1]
}

#[test]
fn packed_forward_equals_each_document_alone() {
    let rows = packed_rows();
    let packing = Packing::new(EOT, VOCAB).unwrap();
    let inputs: Vec<u32> = rows.concat();
    let documents = packing.documents(&inputs, 24).unwrap();
    assert_eq!(documents.cu_seqlens(0), [0, 7, 8, 24]);
    assert_eq!(documents.cu_seqlens(1), [0, 1, 24]);
    let model = model(&config());
    let packed = logits(&model, &rows, Some(&documents));
    for (r, row) in rows.iter().enumerate() {
        for bounds in documents.cu_seqlens(r).windows(2) {
            let doc = &row[bounds[0]..bounds[1]];
            // Alone, the document is at positions 0.. instead: rotary scores depend only on the
            // distance, so the logits agree up to rounding.
            let alone = logits(&model, &[doc.to_vec()], None).remove(0);
            let diff = max_diff(&packed[r][bounds[0]..bounds[1]], &alone);
            assert!(
                diff < 1e-4,
                "row {r}, document {bounds:?}: differs by {diff:e}"
            );
        }
    }
}

#[test]
fn earlier_documents_change_later_logits_only_without_packing() {
    let rows = packed_rows();
    let mut changed = rows.clone();
    for token in &mut changed[0][..6] {
        *token = (*token + 5) % VOCAB as u32;
    }
    let packing = Packing::new(EOT, VOCAB).unwrap();
    // The EOTs have not moved: both batches have the same documents.
    let documents = packing.documents(&rows.concat(), 24).unwrap();
    assert_eq!(documents, packing.documents(&changed.concat(), 24).unwrap());
    let model = model(&config());
    let (before, after) = (
        logits(&model, &rows, Some(&documents)),
        logits(&model, &changed, Some(&documents)),
    );
    assert!(
        max_diff(&before[0][..7], &after[0][..7]) > 1e-3,
        "the changed document"
    );
    let later = max_diff(&before[0][7..], &after[0][7..]);
    assert!(later < 1e-6, "later documents moved by {later:e}");
    assert_eq!(max_diff(&before[1], &after[1]), 0.0, "the other row");

    let (before, after) = (logits(&model, &rows, None), logits(&model, &changed, None));
    let later = max_diff(&before[0][7..], &after[0][7..]);
    assert!(
        later > 1e-3,
        "unpacked, later tokens see the change ({later:e})"
    );
}

#[test]
fn a_window_changes_only_the_positions_beyond_it() {
    const WINDOW: usize = 5;
    let rows = vec![(0..20u32)
        .map(|i| (i * 11 + 4) % VOCAB as u32)
        .collect::<Vec<_>>()];
    let full = logits(&model(&config()), &rows, None).remove(0);
    let windowed = config().with_window(Some(WINDOW));
    assert_eq!(
        windowed.attention().unwrap().window,
        Some(burn_distflash::SlidingWindow::causal(WINDOW).unwrap())
    );
    let windowed = logits(&model(&windowed), &rows, None).remove(0);
    // Position i sees i + 1 - WINDOW ..= i: all of 0..=i while i < WINDOW.
    let inside = max_diff(&full[..WINDOW], &windowed[..WINDOW]);
    assert!(
        inside < 1e-5,
        "positions inside the window moved by {inside:e}"
    );
    for i in WINDOW..rows[0].len() {
        let diff = max_diff(&full[i..=i], &windowed[i..=i]);
        assert!(diff > 1e-4, "position {i} beyond the window: {diff:e}");
    }
}

#[test]
fn windows_and_documents_combine() {
    // With a window of 4 and the documents of `packed_rows`, each document still equals the
    // same document alone under the same window.
    let rows = packed_rows();
    let documents = Packing::new(EOT, VOCAB)
        .unwrap()
        .documents(&rows.concat(), 24)
        .unwrap();
    let model = model(&config().with_window(Some(4)));
    let packed = logits(&model, &rows, Some(&documents));
    let doc = &rows[0][8..];
    let alone = logits(&model, &[doc.to_vec()], None).remove(0);
    let diff = max_diff(&packed[0][8..], &alone);
    assert!(diff < 1e-4, "differs by {diff:e}");
}

#[test]
fn configs_without_a_window_still_load() {
    let mut json = serde_json::to_value(LlamaConfig::tiny()).unwrap();
    let fields = json.as_object_mut().unwrap();
    assert_eq!(fields.remove("window"), Some(serde_json::Value::Null));
    let old: LlamaConfig = serde_json::from_value(json).unwrap();
    assert_eq!(old.window, None);
    assert_eq!(old.attention().unwrap().window, None);
    let with: LlamaConfig = serde_json::from_str(
        &serde_json::to_string(&LlamaConfig::tiny().with_window(Some(64))).unwrap(),
    )
    .unwrap();
    assert_eq!(with.window, Some(64));
}

#[test]
fn a_window_of_zero_and_an_eot_outside_the_vocabulary_are_refused() {
    let e = config()
        .with_window(Some(0))
        .try_init::<Cpu>(&DEVICE)
        .unwrap_err()
        .to_string();
    assert!(e.contains("window") && e.contains("at least 1"), "{e}");
    let (what, expected, got) = input_error(Packing::new(VOCAB as u32, VOCAB));
    assert_eq!(
        (what.as_str(), got.as_str()),
        ("the end-of-text token id", "64")
    );
    assert!(expected.contains("vocabulary of 64 tokens"), "{expected}");
    // Documents of another length than the sequence are the plugin's error.
    let rows = packed_rows();
    let short = Documents::from_cu_seqlens(&[0, 5, 23]).unwrap();
    let values: Vec<i64> = rows.concat().iter().map(|&t| i64::from(t)).collect();
    let tokens = Tensor::<Cpu, 2, Int>::from_data(TensorData::new(values, [2, 24]), &DEVICE);
    let e = model(&config())
        .forward(
            LlamaInput::new(tokens).with_documents(short),
            &AttentionContext::Local,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("23") && e.contains("24"), "{e}");
}
