//! Properties of the schedules for every world size from 1 to 16 (pure logic, no tensors).

use std::collections::BTreeMap;

use crate::common::schedules::{every_schedule, WORLDS};
use burn_distflash::schedule::{Pair, Schedule, ScheduleKind};

/// Every pair of shards the attention needs: all of them when not causal or under the zigzag
/// layout (every rank holds a late chunk that sees an early chunk of every other), `kv <= query`
/// when causal and contiguous.
fn required_pairs(s: &Schedule) -> Vec<Pair> {
    let (world, causal) = (
        s.world_size(),
        s.causal() && s.kind() != ScheduleKind::Zigzag,
    );
    let mut pairs = Vec::new();
    for query in 0..world {
        for kv in 0..world {
            if !causal || kv <= query {
                pairs.push(Pair { query, kv });
            }
        }
    }
    pairs
}

#[test]
fn every_required_pair_is_computed_exactly_once() {
    for s in every_schedule() {
        let mut count: BTreeMap<Pair, usize> = BTreeMap::new();
        for step in 0..s.num_steps() {
            for rank in 0..s.world_size() {
                if let Some(pair) = s.pair(rank, step) {
                    *count.entry(pair).or_default() += 1;
                }
            }
        }
        let required = required_pairs(&s);
        for pair in &required {
            assert_eq!(count.get(pair), Some(&1), "{s:?}: pair {pair:?}");
        }
        assert_eq!(count.len(), required.len(), "{s:?} computes extra pairs");
    }
}

#[test]
fn a_rank_computes_only_pairs_it_owns_a_side_of() {
    for s in every_schedule() {
        for step in 0..s.num_steps() {
            for rank in 0..s.world_size() {
                if let Some(p) = s.pair(rank, step) {
                    assert!(p.query == rank || p.kv == rank, "{s:?} {rank} {step} {p:?}");
                }
            }
        }
    }
}

#[test]
fn sends_match_receives_and_nobody_talks_to_itself() {
    for s in every_schedule() {
        let p = s.world_size();
        for step in 0..s.num_steps() {
            let plans: Vec<_> = (0..p).map(|r| s.rank_step(r, step)).collect();
            for (rank, plan) in plans.iter().enumerate() {
                assert_ne!(plan.kv_from, Some(rank));
                assert_ne!(plan.query_from, Some(rank));
                assert!(!plan.kv_to.contains(&rank) && !plan.query_to.contains(&rank));
                for &to in &plan.kv_to {
                    assert_eq!(plans[to].kv_from, Some(rank), "{s:?} step {step}");
                }
                for &to in &plan.query_to {
                    assert_eq!(plans[to].query_from, Some(rank), "{s:?} step {step}");
                }
                if let Some(from) = plan.kv_from {
                    assert!(plans[from].kv_to.contains(&rank), "{s:?} step {step}");
                }
                if let Some(from) = plan.query_from {
                    assert!(plans[from].query_to.contains(&rank), "{s:?} step {step}");
                }
                // Results go back to the owner of the remote side.
                assert_eq!(plan.query_result_to(), plan.query_from);
                assert_eq!(plan.kv_result_to(), plan.kv_from);
            }
        }
    }
}

#[test]
fn step_counts() {
    for p in WORLDS {
        assert_eq!(Schedule::new(ScheduleKind::Ring, p, true).num_steps(), p);
        assert_eq!(
            Schedule::new(ScheduleKind::Balanced, p, true).num_steps(),
            p / 2 + 1
        );
    }
}

#[test]
fn idle_fractions_match_the_paper() {
    for p in WORLDS {
        let pf = p as f64;
        let ring = Schedule::new(ScheduleKind::Ring, p, true).idle_fraction();
        assert!(
            (ring - (pf * pf - pf) / (2.0 * pf * pf)).abs() < 1e-12,
            "P={p}"
        );
        let balanced = Schedule::new(ScheduleKind::Balanced, p, true).idle_fraction();
        let expected = if p % 2 == 0 { 1.0 / (2.0 * pf) } else { 0.0 };
        assert!((balanced - expected).abs() < 1e-12, "P={p}: {balanced}");
    }
}

#[test]
fn ideal_speedups() {
    for p in WORLDS {
        let pf = p as f64;
        // One device computes P²/2 pair units (diagonals count half).
        let ring = Schedule::new(ScheduleKind::Ring, p, true).ideal_speedup();
        assert!((ring - pf * pf / 2.0 / (pf - 0.5)).abs() < 1e-9, "P={p}");
        let balanced = Schedule::new(ScheduleKind::Balanced, p, true).ideal_speedup();
        assert!((balanced - pf * pf / 2.0 / (0.5 + (p / 2) as f64)).abs() < 1e-9);
        let full = Schedule::new(ScheduleKind::Ring, p, false).ideal_speedup();
        assert!((full - pf).abs() < 1e-9);
        // Zigzag: P steps of half a pair each, P/2 pair-times in all: no idle slot.
        let zigzag = Schedule::new(ScheduleKind::Zigzag, p, true);
        assert!((zigzag.time() - pf / 2.0).abs() < 1e-9, "P={p}");
        assert!((zigzag.ideal_speedup() - pf).abs() < 1e-9, "P={p}");
    }
    // The paper's P = 8 figures: ring about 4.3x, balanced about 7.1x.
    let ring8 = Schedule::new(ScheduleKind::Ring, 8, true).ideal_speedup();
    let balanced8 = Schedule::new(ScheduleKind::Balanced, 8, true).ideal_speedup();
    assert!((4.2..4.3).contains(&ring8) && (7.1..7.2).contains(&balanced8));
}

#[test]
fn auto_picks_the_fastest_schedule_by_the_time_model() {
    for p in WORLDS {
        let auto = Schedule::new(ScheduleKind::Auto, p, true);
        // Zigzag is strictly faster at even P; at odd P zigzag and balanced tie and balanced,
        // with fewer steps and the contiguous layout, is kept.
        let expected = if p % 2 == 0 {
            ScheduleKind::Zigzag
        } else {
            ScheduleKind::Balanced
        };
        assert_eq!(auto.kind(), expected, "P={p}");
        for kind in [
            ScheduleKind::Ring,
            ScheduleKind::Balanced,
            ScheduleKind::Zigzag,
        ] {
            assert!(
                auto.time() <= Schedule::new(kind, p, true).time() + 1e-12,
                "P={p}"
            );
        }
        assert_eq!(ScheduleKind::Auto.resolve(p, true).layout(), auto.layout());
        let full = Schedule::new(ScheduleKind::Auto, p, false);
        assert_eq!(full.kind(), ScheduleKind::Ring, "P={p}");
    }
}

#[test]
fn auto_under_a_window_picks_the_fastest_schedule_under_that_window() {
    use burn_distflash::schedule::{Mask, SlidingWindow};
    use ScheduleKind::{Auto, Balanced, Ring, Zigzag};
    let window = |size| Mask::causal().with_window(SlidingWindow::causal(size).unwrap());
    // A window shorter than a shard: zigzag's late chunk needs another rank's keys, so zigzag
    // takes as long (P = 2) or longer (P >= 4) and balanced is kept.
    for (p, shard, size) in [
        (2, 16384, 4096),
        (4, 16384, 4096),
        (4, 16384, 8192),
        (8, 8192, 4096),
    ] {
        let mask = window(size);
        assert_eq!(Auto.resolve_for(p, shard, &mask), Balanced, "P={p}");
        let auto = Schedule::for_mask(Auto, p, shard, &mask).unwrap();
        assert_eq!(auto.kind(), Balanced, "P={p}");
        let zigzag = Schedule::for_mask(Zigzag, p, shard, &mask).unwrap();
        assert!(auto.time() <= zigzag.time() + 1e-12, "P={p}");
    }
    // A window as long as two shards keeps zigzag's balance at even P, and one past the
    // sequence is plain causal attention.
    assert_eq!(Auto.resolve_for(2, 16384, &window(32768)), Zigzag);
    assert_eq!(Auto.resolve_for(4, 16384, &window(1 << 20)), Zigzag);
    assert_eq!(Auto.resolve_for(3, 16384, &window(1 << 20)), Balanced);
    // Without a window: `resolve`'s choice. An odd shard leaves zigzag out.
    assert_eq!(Auto.resolve_for(4, 16384, &Mask::causal()), Zigzag);
    assert_eq!(Auto.resolve_for(2, 16385, &window(32768)), Balanced);
    // Not causal: the ring. A concrete kind stays.
    let two_sided = Mask::none().with_window(SlidingWindow::two_sided(100, 100));
    assert_eq!(Auto.resolve_for(4, 16384, &two_sided), Ring);
    assert_eq!(Zigzag.resolve_for(4, 16384, &window(4096)), Zigzag);
}
