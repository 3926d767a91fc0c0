//! Checkpoints of the sharded optimizer (ZeRO stages 1 and 2) on the CPU: saved and resumed at
//! the same world size (1 and 2 ranks) a run continues bitwise; resumed at another world size
//! (2 -> 3 -> 1, with padding) the f32 master weights and moments are carried over exactly and
//! the next step agrees with the uninterrupted run's up to f32 rounding; the exported weights
//! load through the Hugging Face loader as the master weights; bad checkpoints are refused
//! naming the file, and a failed resume or save changes nothing on disk; a checkpoint's bytes
//! as the trainer counts them for the disk check; the memory report's arithmetic by stage, and
//! CubeCL's device count on wgpu.

use crate::common::exclusive_wgpu;
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::modules::float_params;
use crate::common::temp_dir::TempDir;
use crate::common::within::within;
use crate::train::{
    assert_same_stats, copies, dataset, max_difference, on_ranks, small, train_on, trajectory,
    zero_options, Cpu, Inner, DEVICE,
};
use burn::tensor::DType;
use burn_distflash::layers::{replicate, CheckpointPlacement};
use burn_distflash::{AttentionContext, DeviceGroup};
use distflash_llama::disk_space::FILE_OVERHEAD;
use distflash_llama::optimizer::{FlatLayout, ShardSet, ShardTensor, ZeroStage};
use distflash_llama::safetensors::Checkpoint;
use distflash_llama::train::{export_weights, MemoryReport, Trainer};
use distflash_llama::weights::load_hf_llama;
use distflash_llama::{Error, Llama, LlamaConfig, TrainingKernels};

/// The small model with one more token: 90496 parameters, which 2 divides and 3 does not (each
/// of 3 ranks owns 30166 elements, the last 2 of them padding).
pub(crate) fn padded() -> LlamaConfig {
    LlamaConfig::new(257, 64, 2, 4, 2, 128).with_tie_embeddings(true)
}

/// `count` trainable copies of `config`'s model with the weights of `seed`.
pub(crate) fn seeded(config: &LlamaConfig, seed: u64, count: usize) -> Vec<Llama<Cpu>> {
    let model = config.try_init_seeded::<Cpu>(&DEVICE, seed).unwrap();
    replicate(&model, &vec![DEVICE; count])
}

/// A trainer of `model` on `context` that resumes `dir`, built with other options than the
/// checkpoint's (and, from [`seeded`] with another seed, other weights), so that everything
/// must come from it.
fn resumed(
    model: Llama<Cpu>,
    context: AttentionContext<Cpu>,
    dir: &Path,
) -> Result<Trainer<Cpu>, Error> {
    Trainer::new(model, context, zero_options(99, ZeroStage::Replicated)).resume(dir)
}

/// [`resumed`] on one device, from a model of the small config.
fn resumed_alone(dir: &Path) -> Result<Trainer<Cpu>, Error> {
    let model = seeded(&small(), 1234, 1).remove(0);
    resumed(model, AttentionContext::Local, dir)
}

/// The shard file names of a world of `world`.
fn shard_names(world: usize) -> Vec<String> {
    (0..world)
        .map(|r| format!("optimizer-rank{r}-of-{world}.safetensors"))
        .collect()
}

/// Every file under `dir` with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(snapshot(&path));
        } else {
            let bytes = fs::read(&path).unwrap();
            files.insert(path, bytes);
        }
    }
    files
}

/// A copy of the directory `from` at `to`.
fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
    }
}

#[test]
fn a_sharded_run_resumed_at_the_same_world_size_continues_bitwise() {
    within(Duration::from_secs(600), || {
        let data = dataset();
        for (world, zero) in [(1, ZeroStage::OptimizerStates), (2, ZeroStage::Gradients)] {
            let straight = train_on(world, zero, 4, &data);
            let tmp = TempDir::new("zero-resume");
            let dir = tmp.path().join("checkpoint");
            on_ranks(
                copies(world, CheckpointPlacement::Layer),
                |context, model| {
                    let mut trainer = Trainer::new(model, context, zero_options(4, zero));
                    trajectory(&mut trainer, &data, 2);
                    trainer.save(&dir).unwrap();
                },
            );
            let mut names: Vec<String> = fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            let mut expected = shard_names(world);
            expected.extend(["model.bin".to_string(), "trainer.json".to_string()]);
            expected.sort();
            assert_eq!(names, expected, "{world} ranks: the checkpoint's files");
            let siblings = fs::read_dir(tmp.path()).unwrap().count();
            assert_eq!(
                siblings, 1,
                "a staging directory was left beside the checkpoint"
            );

            let others = seeded(&small(), 99, world);
            let rest = on_ranks(others, |context, model| {
                let mut trainer = resumed(model, context, &dir).unwrap();
                assert_eq!((trainer.step, trainer.options.zero), (2, zero));
                trajectory(&mut trainer, &data, 2)
            });
            for (rank, (rest, all)) in rest.iter().zip(&straight).enumerate() {
                for (step, (got, want)) in rest.iter().zip(&all[2..]).enumerate() {
                    assert_eq!(
                        got.0,
                        want.0,
                        "{world} ranks, rank {rank}, step {}",
                        step + 2
                    );
                    assert!(
                        got.1 == want.1,
                        "{world} ranks, rank {rank}, step {}: the weights differ",
                        step + 2
                    );
                }
            }
        }
    });
}

/// The merged f32 master weights and moments of the checkpoint in `dir` (written by `world`
/// ranks), without padding, and the optimizer's step count.
fn merged_state(dir: &Path, world: usize, layout: &FlatLayout) -> (Vec<Vec<u32>>, i32) {
    let shards = ShardSet::open(dir, world, layout).unwrap();
    let bits = |t| {
        let values = shards.read(t, 0, layout.len());
        values.into_iter().map(f32::to_bits).collect()
    };
    let vectors = ShardTensor::ALL.into_iter().map(bits).collect();
    (vectors, shards.header().optimizer_step)
}

#[test]
fn sharded_state_reshards_exactly_from_two_ranks_to_three_and_from_three_to_one() {
    within(Duration::from_secs(600), || {
        let data = dataset();
        let config = padded();
        let tmp = TempDir::new("reshard");
        let dirs = ["two", "three", "one"].map(|name| tmp.path().join(name));
        let zero = ZeroStage::Gradients;
        // Two ranks: two steps, saved, then the reference's third step.
        let reference = on_ranks(seeded(&config, 5, 2), |context, model| {
            let mut trainer = Trainer::new(model, context, zero_options(4, zero));
            trajectory(&mut trainer, &data, 2);
            trainer.save(&dirs[0]).unwrap();
            trajectory(&mut trainer, &data, 1).remove(0)
        });
        // Three ranks resume and save at once (the re-sharded state), then step; one rank
        // resumes the three ranks' checkpoint the same way.
        let next = |from: &Path, to: &Path, world: usize| {
            on_ranks(seeded(&config, 77, world), |context, model| {
                let mut trainer = resumed(model, context, from).unwrap();
                trainer.save(to).unwrap();
                trajectory(&mut trainer, &data, 1).remove(0)
            })
        };
        let on_three = next(&dirs[0], &dirs[1], 3);
        let on_one = next(&dirs[1], &dirs[2], 1);

        let model = config.try_init::<Cpu>(&DEVICE).unwrap();
        let layout = FlatLayout::of::<Cpu, _>(&model, 3);
        assert_eq!((layout.len(), layout.padded()), (90496, 90498));
        let two = merged_state(&dirs[0], 2, &layout);
        assert_eq!(two.1, 2, "two optimizer steps");
        assert!(
            two.0[2].iter().any(|&b| b != 0),
            "the second moment is zero"
        );
        for (world, dir) in [(3, &dirs[1]), (1, &dirs[2])] {
            // The state written after resuming is the state read: every f32 bit carried over.
            assert!(
                merged_state(dir, world, &layout) == two,
                "the state re-sharded to {world} rank(s) differs from the two ranks' state"
            );
        }
        let last = ShardSet::open(&dirs[1], 3, &layout).unwrap();
        assert_eq!(last.read(ShardTensor::Master, 90494, 4)[2..], [0.0, 0.0]);

        // The next step splits each sequence 3 ways (or not at all) instead of 2: the attention
        // merges its partial results and the gradients are summed in another order, so the step
        // agrees with the uninterrupted one up to f32 rounding, not bitwise (see the train
        // tests' bounds). The ranks of one group agree bitwise.
        let want = &reference[0];
        for (what, got) in [("3 ranks", &on_three[0]), ("1 rank", &on_one[0])] {
            assert_same_stats(&got.0, &want.0, what);
            let err = max_difference(&got.1, &want.1);
            assert!(err < 1e-4, "{what}: the weights differ by {err:e}");
        }
        assert!(on_three.iter().all(|r| r.1 == on_three[0].1));
    });
}

#[test]
fn exported_weights_load_through_the_hugging_face_loader_as_the_trained_weights() {
    within(Duration::from_secs(300), || {
        let data = dataset();
        let tmp = TempDir::new("export");
        for (world, zero) in [(2, ZeroStage::Gradients), (1, ZeroStage::Replicated)] {
            let dir = tmp.path().join(format!("checkpoint-{zero}"));
            let out = tmp.path().join(format!("hf-{zero}"));
            let trained = on_ranks(
                copies(world, CheckpointPlacement::None),
                |context, model| {
                    let mut trainer = Trainer::new(model, context, zero_options(3, zero));
                    trajectory(&mut trainer, &data, 2);
                    trainer.save(&dir).unwrap();
                    if trainer.rank().0 == 0 {
                        export_weights(&trainer.model, &small(), &dir, &out).unwrap();
                    }
                    float_params(&trainer.model)
                },
            );
            let (config, loaded) = load_hf_llama::<Inner>(&out, &DEVICE).unwrap();
            assert_eq!(config.vocab_size, 256);
            // On NdArray in f32 the working weights are the master weights.
            assert!(
                float_params(&loaded) == trained[0],
                "stage {zero}: the exported weights differ from the trained ones"
            );
            let file = Checkpoint::open_dir(&out).unwrap();
            assert_eq!(
                file.get("model.embed_tokens.weight").unwrap().dtype,
                DType::F32
            );
        }
    });
}

/// A damaged checkpoint: its name, the file its error must name, what the error must say, and
/// the damage done to a copy of a good checkpoint.
type Case<'a> = (&'a str, &'a str, &'a str, &'a dyn Fn(&Path));

/// A damage to a checkpoint directory: its `file` replaced by the file of that name in `from`.
fn replaced_from<'a>(from: &'a Path, file: &'a str) -> impl Fn(&Path) + 'a {
    move |dir| {
        fs::copy(from.join(file), dir.join(file)).unwrap();
    }
}

/// The message of `result`'s error, with a check that it names `file`.
fn error_naming<T>(result: Result<T, Error>, file: &str) -> String {
    let message = result.err().expect("an error").to_string();
    assert!(
        message.contains(file),
        "the error does not name {file}: {message}"
    );
    message
}

#[test]
fn bad_sharded_checkpoints_are_refused_naming_the_file_and_change_nothing() {
    within(Duration::from_secs(600), || {
        let data = dataset();
        let tmp = TempDir::new("bad-shards");
        let root = tmp.path();
        let (good, later, untied) = (root.join("good"), root.join("later"), root.join("untied"));
        // Two ranks: a checkpoint after one step and one after two.
        on_ranks(copies(2, CheckpointPlacement::None), |context, model| {
            let mut trainer = Trainer::new(model, context, zero_options(3, ZeroStage::Gradients));
            trajectory(&mut trainer, &data, 1);
            trainer.save(&good).unwrap();
            trajectory(&mut trainer, &data, 1);
            trainer.save(&later).unwrap();
        });
        // Another model (an untied output layer), saved before its first step.
        let other = small().with_tie_embeddings(false);
        on_ranks(seeded(&other, 3, 2), |context, model| {
            let trainer = Trainer::new(model, context, zero_options(3, ZeroStage::Gradients));
            trainer.save(&untied).unwrap();
        });
        let [rank0, rank1] = [0, 1].map(|r| shard_names(2)[r].clone());
        let case = |name: &str, damage: &dyn Fn(&Path)| -> String {
            let dir = root.join(name);
            copy_dir(&good, &dir);
            damage(&dir);
            let before = snapshot(root);
            let message = resumed_alone(&dir)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_else(|| panic!("{name}: the damaged checkpoint was resumed"));
            assert!(
                before == snapshot(root),
                "{name}: a failed resume changed the files"
            );
            message
        };
        let truncate = |dir: &Path| {
            let bytes = fs::read(dir.join(&rank0)).unwrap();
            fs::write(dir.join(&rank0), &bytes[..bytes.len() - 100]).unwrap();
        };
        let earlier_version = |dir: &Path| {
            let path = dir.join("trainer.json");
            let mut json: serde_json::Value =
                serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
            json.as_object_mut().unwrap().remove("optimizer_shards");
            fs::write(&path, json.to_string()).unwrap();
        };
        let both_later = |dir: &Path| {
            replaced_from(&later, &rank0)(dir);
            replaced_from(&later, &rank1)(dir);
        };
        let cases: [Case; 8] = [
            ("missing", &rank1, "does not exist", &|dir: &Path| {
                fs::remove_file(dir.join(&rank1)).unwrap()
            }),
            (
                "another-model",
                &rank1,
                "a shard of another model",
                &replaced_from(&untied, &rank1),
            ),
            ("another-rank", &rank1, "is rank 0 of 2", &|dir: &Path| {
                fs::copy(dir.join(&rank0), dir.join(&rank1)).unwrap();
            }),
            (
                "another-save",
                &rank1,
                "trainer step 2",
                &replaced_from(&later, &rank1),
            ),
            ("mixed-with-trainer-json", &rank0, "step 1", &both_later),
            (
                "truncated",
                &rank0,
                "is not a valid safetensors file",
                &truncate,
            ),
            (
                "corrupt",
                &rank1,
                "is not a valid safetensors file",
                &|dir: &Path| fs::write(dir.join(&rank1), b"garbage").unwrap(),
            ),
            (
                "earlier-version",
                "trainer.json",
                "written without them",
                &earlier_version,
            ),
        ];
        for (name, file, says, damage) in cases {
            let message = case(name, damage);
            assert!(
                message.contains(file) && message.contains(says),
                "{name}: the error does not name {file} or say {says:?}: {message}"
            );
        }

        // A directory an interrupted save replaced halfway: none, but its previous contents.
        let gone = root.join("gone");
        copy_dir(&good, &root.join(".gone.old"));
        let message = error_naming(resumed_alone(&gone), ".gone.old");
        assert!(message.contains("interrupted"), "{message}");
        // A stale staging directory does not stop the resume of the checkpoint beside it.
        copy_dir(&later, &root.join(".good.partial"));
        resumed_alone(&good).unwrap();
    });
}

#[test]
fn a_failed_save_fails_on_every_rank_and_keeps_the_previous_checkpoint() {
    within(Duration::from_secs(300), || {
        let tmp = TempDir::new("failed-save");
        let blocker = tmp.path().join("file");
        fs::write(&blocker, "not a directory").unwrap();
        // The staging directory cannot be created under a file.
        let dir = blocker.join("checkpoint");
        let errors = on_ranks(copies(2, CheckpointPlacement::None), |context, model| {
            let trainer = Trainer::new(model, context, zero_options(3, ZeroStage::Gradients));
            trainer.save(&dir).err().map(|e| e.to_string())
        });
        assert!(
            errors[0]
                .as_deref()
                .unwrap()
                .contains(".checkpoint.partial"),
            "{errors:?}"
        );
        assert!(
            errors[1].as_deref().unwrap().contains("rank 0 failed"),
            "{errors:?}"
        );
        assert_eq!(fs::read_to_string(&blocker).unwrap(), "not a directory");
    });
}

#[test]
fn a_checkpoint_takes_the_bytes_the_trainer_counts_for_it() {
    within(Duration::from_secs(300), || {
        let data = dataset();
        let stages = [
            (1, ZeroStage::Replicated),
            (2, ZeroStage::Gradients),
            (3, ZeroStage::OptimizerStates),
        ];
        for (world, zero) in stages {
            let tmp = TempDir::new("checkpoint-bytes");
            let dir = tmp.path().join("checkpoint");
            let counted = on_ranks(seeded(&padded(), 7, world), |context, model| {
                let mut trainer = Trainer::new(model, context, zero_options(1, zero));
                trajectory(&mut trainer, &data, 1);
                trainer.save(&dir).unwrap();
                trainer.checkpoint_bytes()
            });
            assert!(counted.iter().all(|&c| c == counted[0]), "{counted:?}");
            let files = snapshot(&dir);
            let written: u64 = files.values().map(|bytes| bytes.len() as u64).sum();
            // Counted: the tensors' bytes, and FILE_OVERHEAD a file for the headers and records,
            // which take a few KiB here.
            let tensors = counted[0] - files.len() as u64 * FILE_OVERHEAD;
            assert!(
                written <= counted[0] && tensors <= written && written - tensors <= 16 << 10,
                "{world} rank(s), {zero:?}: {written} bytes written, {tensors} counted for the \
                 tensors of {} files",
                files.len()
            );
        }
    });
}

#[test]
fn the_memory_report_counts_each_stage_per_rank() {
    let n = 90496u64;
    let mut groups = DeviceGroup::<Inner>::in_process(vec![DEVICE; 3]);
    let models = seeded(&padded(), 1, 3);
    let stages = [
        ZeroStage::Replicated,
        ZeroStage::OptimizerStates,
        ZeroStage::Gradients,
    ];
    for (stage, model) in stages.into_iter().zip(models) {
        let trainer = Trainer::new(model, AttentionContext::Local, zero_options(1, stage));
        let report = trainer.memory_report();
        assert_eq!((report.world, report.parameters), (1, n as usize));
        assert_eq!(
            (report.weights, report.gradients),
            (4 * n, 4 * n),
            "{report}"
        );
        // One rank keeps no summed f32 gradient: its update reads the gradients themselves.
        let sharded = (0, 12 * n);
        let want = [(0, 8 * n), sharded, sharded][stage.number() as usize];
        assert_eq!(
            (report.summed_gradients, report.optimizer),
            want,
            "{report}"
        );
        assert_eq!(report.device, None);
        assert!(report.to_string().contains("device n/a"), "{report}");
    }
    // Three ranks: each owns ceil(n / 3) = 30166 elements of f32 master weights and moments.
    let share = n.div_ceil(3);
    let model = padded().try_init::<Cpu>(&DEVICE).unwrap();
    let group = groups.remove(0);
    // Both stages keep only their share of the summed gradient (made bucket by bucket).
    for (stage, summed) in [
        (ZeroStage::OptimizerStates, 4 * share),
        (ZeroStage::Gradients, 4 * share),
    ] {
        let context = AttentionContext::sharded(group.clone());
        let trainer = Trainer::new(model.clone(), context, zero_options(1, stage));
        let report = trainer.memory_report();
        assert_eq!(report.world, 3);
        assert_eq!(
            (report.summed_gradients, report.optimizer),
            (summed, 12 * share)
        );
        assert_eq!(report.total(), 8 * n + summed + 12 * share);
        assert!(report.to_string().contains("1/3"), "{report}");
    }
    assert_eq!(
        MemoryReport::estimate(&FlatLayout::of::<Cpu, _>(&model, 3), ZeroStage::Replicated)
            .optimizer,
        8 * n
    );
}

#[test]
fn cubecl_backends_report_their_device_memory() {
    let _wgpu = exclusive_wgpu();
    type Wgpu = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
    let device = cubecl::wgpu::WgpuDevice::Cpu;
    let tensor = burn::tensor::Tensor::<Wgpu, 1>::ones([1 << 20], &device);
    let memory = Wgpu::device_memory(&device).expect("CubeCL counts its pools");
    assert!(memory.in_use >= 4 << 20, "{memory:?}");
    assert!(memory.reserved >= memory.in_use, "{memory:?}");
    drop(tensor);
    // Dropped, a tensor's bytes leave `in_use` but stay reserved: `reserved` is the peak.
    let sum = burn::tensor::Tensor::<Wgpu, 1>::ones([1 << 21], &device).sum();
    let _ = sum.into_scalar();
    let after = Wgpu::device_memory(&device).expect("CubeCL counts its pools");
    assert!(
        after.reserved >= 8 << 20,
        "the peak was released: {after:?}"
    );
}
