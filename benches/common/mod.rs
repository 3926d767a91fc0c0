//! What the benches' command lines share: the flag `cargo bench` appends, and lists of sizes
//! (`8192,16384`, or `none`). Each bench uses part of it.
#![allow(dead_code)]

use std::str::FromStr;

use clap::Args;

/// The `--bench` flag `cargo bench` passes to every bench binary (the test harness's switch);
/// accepted and ignored, so a bench runs the same under `cargo bench` and by itself.
#[derive(Debug, Clone, Args)]
pub struct CargoBench {
    #[arg(long = "bench", hide = true)]
    bench: bool,
}

/// A comma-separated list of positive sizes (`8192,16384,32768`), or `none` for no size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sizes(pub Vec<usize>);

impl FromStr for Sizes {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.trim() == "none" {
            return Ok(Self(Vec::new()));
        }
        text.split(',')
            .map(|part| match part.trim().parse::<usize>() {
                Ok(size) if size > 0 => Ok(size),
                _ => Err(format!(
                    "takes comma-separated sizes of at least 1 (8192,16384) or none, got {part:?}"
                )),
            })
            .collect::<Result<_, _>>()
            .map(Self)
    }
}

impl std::ops::Deref for Sizes {
    type Target = [usize];

    fn deref(&self) -> &[usize] {
        &self.0
    }
}
