//! Every concrete schedule (and `Auto`, causal) for every world size from 1 to 16.

use burn_distflash::schedule::{Schedule, ScheduleKind};

/// The world sizes the pure-logic schedule and layout tests cover.
pub const WORLDS: std::ops::RangeInclusive<usize> = 1..=16;

/// Ring, balanced and zigzag causal; ring and zigzag full; `Auto` causal; for every world size.
pub fn every_schedule() -> Vec<Schedule> {
    WORLDS
        .flat_map(|p| {
            [
                Schedule::new(ScheduleKind::Ring, p, true),
                Schedule::new(ScheduleKind::Balanced, p, true),
                Schedule::new(ScheduleKind::Zigzag, p, true),
                Schedule::new(ScheduleKind::Ring, p, false),
                Schedule::new(ScheduleKind::Zigzag, p, false),
                Schedule::new(ScheduleKind::Auto, p, true),
            ]
        })
        .collect()
}
