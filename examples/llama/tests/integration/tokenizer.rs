//! Hugging Face tokenizers through `distflash_llama::tokenizer`: ids of multilingual text
//! (Devanagari, Thai, circled letters and numbers, ASCII) equal the ids Hugging Face's
//! reference library (`tokenizers` for Python, 0.23.3) produced for the same `tokenizer.json`.
//!
//! The fixtures `tests/fixtures/bpe_{gpt2,llama3}.json` and the ids below were written by
//! `tests/fixtures/make_tokenizers.py`: one byte-level BPE, trained without a regex split so that
//! its merges cross the places where the GPT-2 and the Llama 3 regexes split words, saved with
//! each regex as its pre-tokenizer. A tokenizer whose word split differs from the regex's (the
//! hand-written one this crate used before counted Devanagari vowel signs, Thai vowel marks and
//! circled letters as letters, where `\p{L}` does not) gets other ids here.

use std::path::PathBuf;

use distflash_llama::tokenizer::Tokenizer;

const TEXTS: [&str; 4] = [
    "Hello, world! It's 2024 and we're testing.",
    "नमस्ते दुनिया, हिन्दी में लिखा है।",
    "สวัสดีชาวโลก ภาษาไทย",
    "Ⓐⓑⓒ circled ①② letters, xⒶy",
];

/// Ids from the reference library with the GPT-2 regex (12, 24, 6 and 8 pre-tokens).
const GPT2_IDS: [&[u32]; 4] = [
    &[
        363, 78, 11, 220, 308, 75, 67, 0, 220, 290, 284, 325, 19, 220, 291, 67, 220, 86, 68, 283,
        68, 220, 352, 298, 70, 13,
    ],
    &[
        356, 116, 258, 235, 256, 97, 277, 259, 99, 258, 223, 274, 256, 123, 256, 107, 275, 11, 279,
        256, 123, 274, 258, 235, 256, 99, 258, 222, 259, 106, 277, 256, 224, 259, 110, 256, 123,
        256, 244, 275, 279, 344, 97,
    ],
    &[
        276, 100, 257, 109, 276, 242, 257, 113, 257, 334, 374, 312, 223, 324, 385, 383,
    ],
    &[
        359, 240, 326, 304, 67, 220, 270, 340, 94, 220, 351, 303, 11, 220, 87, 281, 88,
    ],
];

/// Ids from the reference library with the Llama 3 regex (14, 18, 4 and 8 pre-tokens).
const LLAMA3_IDS: [&[u32]; 4] = [
    &[
        363, 78, 11, 220, 308, 75, 67, 0, 220, 290, 284, 220, 287, 19, 220, 291, 67, 220, 86, 68,
        283, 68, 220, 352, 298, 70, 13,
    ],
    &[
        356, 116, 278, 97, 277, 259, 99, 258, 328, 261, 107, 275, 11, 279, 261, 101, 278, 99, 258,
        222, 259, 106, 277, 256, 224, 259, 110, 261, 244, 275, 279, 344, 97,
    ],
    &[
        276, 100, 257, 320, 242, 257, 379, 374, 312, 223, 324, 385, 383,
    ],
    &[
        359, 240, 326, 304, 67, 220, 270, 340, 94, 220, 351, 303, 11, 220, 87, 281, 88,
    ],
];

fn fixture(name: &str) -> Tokenizer {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    Tokenizer::from_file(&path).unwrap_or_else(|e| panic!("{e}"))
}

fn check(name: &str, expected: [&[u32]; 4]) {
    let tokenizer = fixture(name);
    assert_eq!(tokenizer.vocab_size(), 410, "{name}");
    for (text, want) in TEXTS.iter().zip(expected) {
        let ids = tokenizer.encode(text).unwrap();
        assert_eq!(ids, want, "{name}: ids of {text:?}");
        assert_eq!(tokenizer.decode(&ids).unwrap(), *text, "{name}: round trip");
    }
}

#[test]
fn gpt2_regex_ids_match_the_reference_library() {
    check("bpe_gpt2.json", GPT2_IDS);
}

#[test]
fn llama3_regex_ids_match_the_reference_library() {
    check("bpe_llama3.json", LLAMA3_IDS);
}

#[test]
fn the_two_regexes_split_differently() {
    // Guards the fixtures themselves: if both pre-tokenizers gave the same ids, the two tests
    // above would not tell the regexes apart.
    for (i, text) in TEXTS.iter().enumerate().take(3) {
        assert_ne!(GPT2_IDS[i], LLAMA3_IDS[i], "{text:?}");
    }
    let gpt2 = fixture("bpe_gpt2.json");
    assert_eq!(gpt2.token_id("Ġ"), Some(220));
}
