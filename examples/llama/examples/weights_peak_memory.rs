//! Peak host memory of loading a bf16 Hugging Face checkpoint onto the CPU (ndarray, f32).
//!
//! `cargo run --release -p distflash-llama --example weights_peak_memory -- write DIR` saves a
//! randomly initialised 168M-parameter Llama (vocabulary 32000, 8 layers of width 1024, FFN 2816,
//! untied) as a bf16 checkpoint (336 MB) in `DIR`; `... -- load DIR`, in a fresh process, loads
//! it and prints the process's peak resident memory (`VmHWM` in `/proc/self/status`, Linux)
//! beside the checkpoint's size and the loaded model's. The loaded model alone is f32 (twice the
//! checkpoint); the mapped file's pages count as resident while they are read.

use std::path::{Path, PathBuf};

use burn::backend::NdArray;
use burn::tensor::DType;
use clap::Parser;
use distflash_llama::weights::{load_hf_llama, save_hf_llama};
use distflash_llama::LlamaConfig;

type Cpu = NdArray<f32>;

fn config() -> LlamaConfig {
    LlamaConfig::new(32000, 1024, 8, 8, 8, 2816)
}

/// A field of `/proc/self/status` in MiB (`VmHWM`, `VmRSS`); `None` where there is no procfs.
fn status_mib(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

fn dir_size(dir: &Path) -> std::io::Result<u64> {
    std::fs::read_dir(dir)?.try_fold(0, |total, entry| Ok(total + entry?.metadata()?.len()))
}

/// The example's command line: one subcommand.
#[derive(Parser)]
#[command(about = "Peak host memory of loading a bf16 Hugging Face checkpoint onto the CPU")]
enum Args {
    /// Save a randomly initialised 168M-parameter Llama as a bf16 checkpoint in DIR
    Write {
        /// The checkpoint's directory
        dir: PathBuf,
    },
    /// Load the checkpoint in DIR and print the process's peak resident memory
    Load {
        /// The checkpoint's directory
        dir: PathBuf,
    },
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (write, dir) = match Args::parse() {
        Args::Write { dir } => (true, dir),
        Args::Load { dir } => (false, dir),
    };
    let config = config();
    let device = Default::default();
    if write {
        let model = config.try_init::<Cpu>(&device)?;
        save_hf_llama(&model, &config, &dir, DType::BF16)?;
        println!(
            "wrote {} parameters as bf16: {:.0} MiB in {}",
            config.num_params(),
            mib(dir_size(&dir)?),
            dir.display()
        );
        return Ok(());
    }
    let before = status_mib("VmRSS:");
    let (loaded, model) = load_hf_llama::<Cpu>(&dir, &device)?;
    let peak = status_mib("VmHWM:");
    let f32_model = mib(4 * loaded.num_params() as u64);
    println!(
        "checkpoint {:.0} MiB (bf16); model on the host {f32_model:.0} MiB (f32); \
         resident before loading {}; peak resident {}",
        mib(dir_size(&dir)?),
        before.map_or("n/a".into(), |m| format!("{m:.0} MiB")),
        peak.map_or("n/a (no /proc/self/status)".into(), |m| format!(
            "{m:.0} MiB"
        )),
    );
    drop(model);
    Ok(())
}
