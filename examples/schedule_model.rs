//! The schedules' time model for causal attention: time in pair-times (one full pair of
//! shards), speedup over one device and per-rank efficiency for ring, balanced and zigzag, and
//! what `ScheduleKind::Auto` picks, for P = 2..16. Pure arithmetic (communication counted as
//! free); prints the Markdown table of BENCHMARKS.md.
//!
//! `cargo run --release --example schedule_model`

use burn_distflash::schedule::{Schedule, ScheduleKind};

fn main() {
    println!("| P | ring time | balanced time | zigzag time | ring eff. | balanced eff. | zigzag eff. | Auto |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for p in 2..=16 {
        let s = |kind| Schedule::new(kind, p, true);
        let (ring, balanced, zigzag) = (
            s(ScheduleKind::Ring),
            s(ScheduleKind::Balanced),
            s(ScheduleKind::Zigzag),
        );
        let eff = |s: &Schedule| 100.0 * s.ideal_speedup() / p as f64;
        println!(
            "| {p} | {:.1} | {:.1} | {:.1} | {:.1}% | {:.1}% | {:.1}% | {:?} |",
            ring.time(),
            balanced.time(),
            zigzag.time(),
            eff(&ring),
            eff(&balanced),
            eff(&zigzag),
            s(ScheduleKind::Auto).kind(),
        );
    }
}
