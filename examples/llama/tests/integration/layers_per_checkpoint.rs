//! Two layers per gradient checkpoint in training (ndarray): steps give bitwise the losses,
//! gradient norms, weights and evaluation of one layer checkpoint per block, on one device and
//! on each rank of a group of 2, with the checkpoints on the device or offloaded; a config file
//! written before the field loads with one layer per checkpoint; other counts, and two without
//! the layer placement, are refused; `--layers-per-checkpoint` on the command line, beside
//! `--resume` too, where a run resumed with two layers per checkpoint continues with the losses
//! of one resumed with one.

use std::path::Path;
use std::time::Duration;

use crate::command_line::{llama_train, stderr_of};
use crate::common::temp_dir::TempDir;
use crate::common::within::within;
use crate::offload::{assert_same_runs, config, runs};
use crate::train::{Cpu, DEVICE};
use burn_distflash::layers::{CheckpointPlacement, Offload};
use distflash_llama::metrics::read_metrics;
use distflash_llama::LlamaConfig;

const LIMIT: Duration = Duration::from_secs(300);

#[test]
fn pairs_of_layers_train_bitwise_as_one_layer_per_checkpoint() {
    within(LIMIT, || {
        for world in [1, 2] {
            let expected = runs(world, &config(CheckpointPlacement::Layer, Offload::Off));
            for policy in [Offload::Off, Offload::All, Offload::AllButLast(1)] {
                let paired =
                    config(CheckpointPlacement::Layer, policy).with_layers_per_checkpoint(2);
                let what = format!("{world} rank(s), {policy:?}");
                assert_same_runs(&what, &runs(world, &paired), &expected);
            }
        }
    });
}

#[test]
fn configs_without_the_field_load_and_bad_counts_are_refused() {
    let dir = TempDir::new("layers-per-checkpoint-config");
    let mut json = serde_json::to_value(LlamaConfig::tiny()).unwrap();
    let fields = json.as_object_mut().unwrap();
    assert_eq!(fields.remove("layers_per_checkpoint"), Some(1.into()));
    fields.remove("offload");
    let old = dir.path().join("old.json");
    std::fs::write(&old, json.to_string()).unwrap();
    let loaded = LlamaConfig::from_name_or_file(old.to_str().unwrap()).unwrap();
    assert_eq!(loaded.layers_per_checkpoint, 1);
    assert_eq!(loaded.offload, Offload::Off);
    assert_eq!(loaded.d_model, LlamaConfig::tiny().d_model);
    // A file that lacks a field `new` takes is still refused, naming it.
    assert_refused_without(&dir.path().join("no-layers.json"), "n_layers");

    let layer = LlamaConfig::tiny().with_checkpoint(CheckpointPlacement::Layer);
    assert!(layer
        .clone()
        .with_layers_per_checkpoint(2)
        .validate()
        .is_ok());
    for (config, got) in [
        (
            layer.clone().with_layers_per_checkpoint(3),
            "3 with checkpoint Layer",
        ),
        (
            layer.clone().with_layers_per_checkpoint(0),
            "0 with checkpoint Layer",
        ),
        (
            LlamaConfig::tiny().with_layers_per_checkpoint(2),
            "2 with checkpoint AttentionOutput",
        ),
    ] {
        let err = config.try_init::<Cpu>(&DEVICE).unwrap_err().to_string();
        assert!(
            err.contains("layers_per_checkpoint") && err.contains(got),
            "{err}"
        );
    }
}

/// Writes the tiny config without `field` to `path` and checks that loading it names `field`.
fn assert_refused_without(path: &Path, field: &str) {
    let mut json = serde_json::to_value(LlamaConfig::tiny()).unwrap();
    json.as_object_mut().unwrap().remove(field);
    std::fs::write(path, json.to_string()).unwrap();
    let err = LlamaConfig::from_name_or_file(path.to_str().unwrap()).unwrap_err();
    assert!(err.to_string().contains(field), "{err}");
}

/// The losses `metrics.jsonl` in `out` records.
fn losses(out: &Path) -> Vec<f64> {
    let records = read_metrics(&out.join("metrics.jsonl")).expect("metrics.jsonl");
    records.iter().map(|m| m.loss).collect()
}

#[test]
fn the_command_line_pairs_layers_also_when_resuming_and_names_what_it_refuses() {
    let layers = ["--layers", "3", "--checkpoint", "layer"];
    let run = |out: &Path, extra: &[&str]| llama_train(out, &[&layers[..], extra].concat());
    // Two steps with one layer per checkpoint, then a third resumed with one or with two (and
    // every checkpoint offloaded): the same losses.
    let resumed = |extra: &[&str]| {
        let dir = TempDir::new("cli-pairs");
        stderr_of(&run(dir.path(), &["--steps", "2"]), 0);
        let again = stderr_of(
            &run(dir.path(), &[&["--resume", "--steps", "3"], extra].concat()),
            0,
        );
        assert!(again.contains("done: 3 steps"), "{again}");
        (again, losses(dir.path()))
    };
    let (_, one) = resumed(&[]);
    let (paired, two) = resumed(&["--layers-per-checkpoint", "2", "--offload", "all"]);
    assert!(
        paired.contains("checkpoint Layer (2 layer(s) per checkpoint)"),
        "{paired}"
    );
    assert_eq!(two, one);

    let dir = TempDir::new("cli-bad-pairs");
    let three = stderr_of(
        &llama_train(dir.path(), &["--layers-per-checkpoint", "3"]),
        2,
    );
    assert!(
        three.contains("invalid value '3' for '--layers-per-checkpoint <1|2>'"),
        "{three}"
    );
    let without = stderr_of(
        &llama_train(dir.path(), &["--layers-per-checkpoint", "2"]),
        2,
    );
    assert!(
        without.contains("layers_per_checkpoint") && without.contains("--checkpoint layer"),
        "{without}"
    );
}
