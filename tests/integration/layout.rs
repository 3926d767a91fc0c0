//! Layouts and the step calls of every scheduled pair, position by position, for every world
//! size from 1 to 16 (pure logic, no tensors).

use std::collections::BTreeMap;

use crate::common::schedules::{every_schedule, WORLDS};
use burn_distflash::schedule::{Layout, Schedule, ScheduleKind};

/// Tokens per chunk in the position-level checks (odd, so a halved chunk would show).
const CHUNK: usize = 3;

/// The (query position, key position) pairs `rank` computes at `step`.
fn computed(s: &Schedule, rank: usize, step: usize) -> Vec<(usize, usize)> {
    let Some(pair) = s.pair(rank, step) else {
        return Vec::new();
    };
    let (world, layout) = (s.world_size(), s.layout());
    let shard = CHUNK * layout.chunks_per_rank();
    let qpos = layout.positions(world, pair.query, shard).unwrap();
    let kpos = layout.positions(world, pair.kv, shard).unwrap();
    let mut out = Vec::new();
    for block in s.blocks(pair) {
        let rows = block.query.start * CHUNK..block.query.end * CHUNK;
        let cols = block.kv.start * CHUNK..block.kv.end * CHUNK;
        for (i, qi) in rows.clone().enumerate() {
            for (j, kj) in cols.clone().enumerate() {
                if block.mask.visible(0, i, j) {
                    out.push((qpos[qi], kpos[kj]));
                }
            }
        }
    }
    out
}

#[test]
fn every_visible_position_pair_is_computed_exactly_once() {
    for s in every_schedule() {
        let seq = s.world_size() * CHUNK * s.layout().chunks_per_rank();
        let mut count: BTreeMap<(usize, usize), usize> = BTreeMap::new();
        for step in 0..s.num_steps() {
            for rank in 0..s.world_size() {
                for p in computed(&s, rank, step) {
                    *count.entry(p).or_default() += 1;
                }
            }
        }
        for q in 0..seq {
            for k in 0..seq {
                let needed = !s.causal() || k <= q;
                let got = count.get(&(q, k)).copied().unwrap_or(0);
                assert_eq!(got, needed as usize, "{s:?}: query {q}, key {k}");
            }
        }
    }
}

#[test]
fn zigzag_gives_every_rank_the_same_work_at_every_step() {
    for p in WORLDS {
        for causal in [true, false] {
            let s = Schedule::new(ScheduleKind::Zigzag, p, causal);
            assert_eq!(s.num_steps(), p);
            for step in 0..p {
                let work: Vec<usize> = (0..p).map(|r| computed(&s, r, step).len()).collect();
                assert!(
                    work.iter().all(|&w| w == work[0]),
                    "P={p} step {step}: {work:?}"
                );
                for rank in 0..p {
                    let cost = s.pair_cost(s.pair(rank, step).unwrap());
                    assert_eq!(cost, if causal { 0.5 } else { 1.0 }, "P={p} {rank} {step}");
                }
            }
            assert_eq!(s.idle_fraction(), 0.0);
        }
    }
}

#[test]
fn zigzag_pairs_are_one_block_each() {
    // Against itself: one causal block; against another rank: one full block (the early key
    // chunk for every query, or the late query chunk against every key).
    for p in WORLDS {
        let s = Schedule::new(ScheduleKind::Zigzag, p, true);
        for step in 0..p {
            for rank in 0..p {
                let blocks = s.blocks(s.pair(rank, step).unwrap());
                assert_eq!(blocks.len(), 1, "P={p} rank {rank} step {step}: {blocks:?}");
                assert_eq!(blocks[0].mask.is_masked(), step == 0);
            }
        }
    }
}

#[test]
fn contiguous_schedules_cost_what_they_did() {
    // One block per pair, causal exactly on the diagonal.
    for s in every_schedule() {
        if s.layout() != Layout::Contiguous {
            continue;
        }
        for step in 0..s.num_steps() {
            for rank in 0..s.world_size() {
                if let Some(pair) = s.pair(rank, step) {
                    let blocks = s.blocks(pair);
                    assert_eq!(blocks.len(), 1);
                    assert_eq!(blocks[0].mask.is_masked(), s.causal() && pair.is_diagonal());
                }
            }
        }
    }
}

#[test]
fn layouts_cover_the_sequence_once() {
    for p in WORLDS {
        for layout in [Layout::Contiguous, Layout::Zigzag] {
            let shard = 4 * layout.chunks_per_rank();
            let mut all: Vec<usize> = (0..p)
                .flat_map(|r| layout.positions(p, r, shard).unwrap())
                .collect();
            all.sort_unstable();
            assert_eq!(all, (0..p * shard).collect::<Vec<_>>(), "{layout:?} P={p}");
        }
        // Rank r holds chunks r and 2P-1-r, in that order.
        for r in 0..p {
            assert_eq!(Layout::Zigzag.chunks(p, r), vec![r, 2 * p - 1 - r]);
        }
    }
}

#[test]
fn lengths_a_layout_cannot_split_are_errors_that_say_what_is_allowed() {
    let e = Layout::Zigzag.check_shard_len(4, 7).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("Zigzag") && msg.contains("multiple of 2") && msg.contains("got a shard of 7"),
        "{msg}"
    );
    let e = Layout::Zigzag.shard_len(3, 10).unwrap_err().to_string();
    assert!(e.contains("multiple of 6") && e.contains("got 10"), "{e}");
    assert!(Layout::Contiguous.shard_len(3, 10).is_err());
    assert!(Layout::Contiguous.check_shard_len(3, 0).is_err());
    assert_eq!(Layout::Zigzag.shard_len(3, 12), Ok(4));
    assert_eq!(Layout::Contiguous.shard_len(3, 9), Ok(3));
}

#[test]
fn ranks_outside_the_group_are_errors_not_positions() {
    for layout in [Layout::Contiguous, Layout::Zigzag] {
        for rank in [4, 7, 8, 100] {
            let e = layout.positions(4, rank, 8).unwrap_err().to_string();
            assert!(
                e.contains(&format!("rank {rank}")) && e.contains("0..4"),
                "{e}"
            );
        }
        assert_eq!(layout.positions(4, 3, 8).map(|p| p.len()), Ok(8));
    }
}
