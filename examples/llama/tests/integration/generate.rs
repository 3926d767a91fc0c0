//! Text generation after training: a small Llama trained on a repeating pattern continues it
//! greedily; top-k sampling is reproducible from its seed; bad prompts and settings are refused.

use crate::common::input_error;
use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn_distflash::AttentionContext;
use distflash_llama::data::TokenDataset;
use distflash_llama::generate::{generate, Sampling};
use distflash_llama::tokenizer::Tokenizer;
use distflash_llama::train::{TrainOptions, Trainer};
use distflash_llama::{Llama, LlamaConfig};

type Cpu = Autodiff<NdArray<f32>>;
const DEVICE: NdArrayDevice = NdArrayDevice::Cpu;

/// A model trained on "abcdefg" repeated until it predicts the pattern.
fn trained() -> Llama<Cpu> {
    let text = "abcdefg".repeat(400);
    let data = TokenDataset::from_text(&text, &Tokenizer::bytes()).unwrap();
    let model = LlamaConfig::new(256, 64, 2, 4, 2, 128)
        .with_tie_embeddings(true)
        .try_init::<Cpu>(&DEVICE)
        .unwrap();
    let options = TrainOptions::new(60, 4, 32).with_lr(1e-2).with_warmup(5);
    let mut trainer = Trainer::new(model, AttentionContext::Local, options);
    for step in 0..60 {
        let (x, y) = data.batch(step, 0, 4, 32).unwrap();
        trainer.train_step(&x, &y).unwrap();
    }
    trainer.model
}

#[test]
fn a_trained_model_continues_its_pattern_and_sampling_is_seeded() {
    let model = trained();
    let tokenizer = Tokenizer::bytes();
    let prompt = tokenizer.encode("cde").unwrap();
    let greedy = generate(&model, &prompt, 12, 32, Sampling::Greedy).unwrap();
    assert_eq!(greedy[..3], prompt[..], "the prompt comes first");
    assert_eq!(tokenizer.decode(&greedy).unwrap(), "cdefgabcdefgabc");

    let top_k = |seed| Sampling::TopK {
        k: 5,
        temperature: 1.0,
        seed,
    };
    let a = generate(&model, &prompt, 20, 8, top_k(1)).unwrap();
    assert_eq!(a.len(), 23);
    assert_eq!(a, generate(&model, &prompt, 20, 8, top_k(1)).unwrap());
    // A sharp distribution: top-1 sampling is greedy whatever the seed.
    let top_1 = Sampling::TopK {
        k: 1,
        temperature: 1.0,
        seed: 9,
    };
    assert_eq!(generate(&model, &prompt, 12, 32, top_1).unwrap(), greedy);
}

#[test]
fn bad_prompts_and_settings_are_refused() {
    let model = LlamaConfig::new(256, 64, 1, 4, 2, 128)
        .try_init::<Cpu>(&DEVICE)
        .unwrap();
    let (what, _, got) = input_error(generate(&model, &[], 5, 8, Sampling::Greedy));
    assert_eq!((what.as_str(), got.as_str()), ("the prompt", "empty"));
    let (what, expected, got) = input_error(generate(&model, &[1, 256], 5, 8, Sampling::Greedy));
    assert_eq!((what.as_str(), got.as_str()), ("a prompt token", "256"));
    assert!(expected.contains("vocabulary of 256"), "{expected}");
    let (what, _, got) = input_error(generate(&model, &[1], 5, 0, Sampling::Greedy));
    assert_eq!((what.as_str(), got.as_str()), ("the context length", "0"));
    let cold = Sampling::TopK {
        k: 3,
        temperature: 0.0,
        seed: 0,
    };
    let (what, _, got) = input_error(generate(&model, &[1], 5, 8, cold));
    assert!(
        what.contains("temperature") && got.contains("temperature 0"),
        "{got}"
    );
    assert_eq!(generate(&model, &[7], 0, 8, Sampling::Greedy).unwrap(), [7]);
}
