//! Schedules under sliding windows and documents (pure logic, no tensors): every visible score
//! is computed exactly once, by a pair's blocks and by its cells (one call per chunk pair), and
//! no scheduled pair is wasted, for P = 1..8, every schedule and masks of every shape; a short window needs only the neighbours' chunks (steps, messages and
//! the time model say so); documents inside shards need no messages; bad masks are refused.

use std::collections::BTreeMap;

use crate::common::distributed_case::documents_of;
use burn_distflash::schedule::{Block, Layout, Pair, Schedule, ScheduleError, ScheduleKind};
use burn_distflash::{Documents, Mask, SlidingWindow};

/// Tokens per shard: chunks of 3 under zigzag (odd, so a halved chunk would show).
const SHARD: usize = 6;

const KINDS: [ScheduleKind; 4] = [
    ScheduleKind::Ring,
    ScheduleKind::Balanced,
    ScheduleKind::Zigzag,
    ScheduleKind::Auto,
];

/// Masks of every shape over `len` positions: windows of 1, shorter than a zigzag chunk,
/// between a chunk and a shard and longer than a shard, causal or two-sided; documents of
/// length 1, odd lengths spanning shard boundaries, shared or per batch row, with a window.
fn masks(len: usize) -> Vec<Mask> {
    let docs = |lengths: &[&[usize]]| documents_of(lengths, len);
    let causal = Mask::causal;
    vec![
        causal().with_window(SlidingWindow::causal(1).unwrap()),
        causal().with_window(SlidingWindow::causal(2).unwrap()),
        causal().with_window(SlidingWindow::causal(5).unwrap()),
        causal().with_window(SlidingWindow::causal(14).unwrap()),
        Mask::none().with_window(SlidingWindow::two_sided(1, 2)),
        Mask::none().with_window(SlidingWindow::two_sided(4, 7)),
        causal().with_documents(docs(&[&[1]])),
        causal().with_documents(docs(&[&[5]])),
        causal().with_documents(docs(&[&[1, 4, 7]])),
        Mask::none().with_documents(docs(&[&[3, 8]])),
        (causal().with_window(SlidingWindow::causal(4).unwrap())).with_documents(docs(&[&[7, 2]])),
        causal().with_documents(docs(&[&[5], &[2, 9]])),
        causal().with_documents(docs(&[&[len]])),
    ]
}

fn batch_rows(mask: &Mask) -> usize {
    mask.documents.as_ref().map_or(1, Documents::batch_rows)
}

/// How many times each (batch row, query position, key position) is computed by `s`'s step
/// calls (`calls` of a pair: its blocks or its cells), each block applying its own mask to its
/// rows.
fn computed(
    s: &Schedule,
    rows: usize,
    calls: impl Fn(&Schedule, Pair) -> Vec<Block>,
) -> BTreeMap<(usize, usize, usize), usize> {
    let (world, layout) = (s.world_size(), s.layout());
    let chunk = SHARD / layout.chunks_per_rank();
    let mut count = BTreeMap::new();
    for step in 0..s.num_steps() {
        for rank in 0..world {
            let Some(pair) = s.pair(rank, step) else {
                continue;
            };
            let qpos = layout.positions(world, pair.query, SHARD).unwrap();
            let kpos = layout.positions(world, pair.kv, SHARD).unwrap();
            let blocks = calls(s, pair);
            assert!(!blocks.is_empty(), "{s:?}: pair {pair:?} has no step call");
            for block in blocks {
                let rows_of = |r: &std::ops::Range<usize>| r.start * chunk..r.end * chunk;
                let (q_rows, k_rows) = (rows_of(&block.query), rows_of(&block.kv));
                assert!(
                    !block
                        .mask
                        .hides_everything(q_rows.len(), k_rows.len(), rows),
                    "{s:?}: pair {pair:?} block {block:?} computes nothing"
                );
                for b in 0..rows {
                    for (i, qi) in q_rows.clone().enumerate() {
                        for (j, kj) in k_rows.clone().enumerate() {
                            if block.mask.visible(b, i, j) {
                                *count.entry((b, qpos[qi], kpos[kj])).or_default() += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    count
}

/// Checks that `s`'s step calls (`calls` of each pair) compute every score `mask` shows once
/// and no other.
fn assert_computed_once(s: &Schedule, mask: &Mask, calls: impl Fn(&Schedule, Pair) -> Vec<Block>) {
    let (rows, len) = (batch_rows(mask), s.world_size() * SHARD);
    let count = computed(s, rows, calls);
    for b in 0..rows {
        for q in 0..len {
            for k in 0..len {
                let got = count.get(&(b, q, k)).copied().unwrap_or(0);
                let needed = mask.visible(b, q, k) as usize;
                assert_eq!(got, needed, "{s:?}: row {b}, query {q}, key {k}");
            }
        }
    }
}

#[test]
fn every_visible_score_is_computed_once_and_every_scheduled_pair_sees_one() {
    for world in 1..=8 {
        let len = world * SHARD;
        for mask in masks(len) {
            for kind in KINDS {
                let s = Schedule::for_mask(kind, world, SHARD, &mask).unwrap();
                assert_computed_once(&s, &mask, Schedule::blocks);
                // Under the contiguous layout every pair is one step call.
                if s.layout() == Layout::Contiguous {
                    for step in 0..s.num_steps() {
                        for rank in 0..world {
                            if let Some(pair) = s.pair(rank, step) {
                                assert_eq!(s.blocks(pair).len(), 1, "{s:?} {pair:?}");
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A pair's cells: one step call per chunk pair with a visible score (one query chunk against
/// one key/value chunk, so a call covers whole chunks), computing every visible score once
/// under causal order alone, no mask, windows and documents, with the blocks' total cost; under
/// the contiguous layout they are the blocks.
#[test]
fn the_cells_of_a_pair_compute_its_visible_scores_once_one_chunk_pair_each() {
    for world in 1..=8 {
        let len = world * SHARD;
        let plain = [Mask::causal(), Mask::none()];
        for mask in plain.into_iter().chain(masks(len)) {
            for kind in KINDS {
                let s = Schedule::for_mask(kind, world, SHARD, &mask).unwrap();
                assert_computed_once(&s, &mask, Schedule::cells);
                let per_rank = s.layout().chunks_per_rank();
                for (rank, step) in (0..world).flat_map(|r| (0..s.num_steps()).map(move |t| (r, t)))
                {
                    let Some(pair) = s.pair(rank, step) else {
                        continue;
                    };
                    let cells = s.cells(pair);
                    let mut seen = Vec::new();
                    for cell in &cells {
                        assert_eq!((cell.query.len(), cell.kv.len()), (1, 1), "{s:?}: {cell:?}");
                        assert!(cell.query.end <= per_rank && cell.kv.end <= per_rank);
                        seen.push((cell.query.start, cell.kv.start));
                    }
                    seen.sort_unstable();
                    seen.dedup();
                    assert_eq!(
                        seen.len(),
                        cells.len(),
                        "{s:?} {pair:?}: a chunk pair twice"
                    );
                    let cost = |calls: Vec<Block>| calls.iter().map(|b| b.cost).sum::<f64>();
                    let (by_cells, by_blocks) = (cost(cells), cost(s.blocks(pair)));
                    assert!((by_cells - by_blocks).abs() < 1e-12, "{s:?} {pair:?}");
                    if s.layout() == Layout::Contiguous {
                        assert_eq!(s.cells(pair), s.blocks(pair), "{s:?} {pair:?}");
                    }
                }
            }
        }
    }
}

/// Key/value messages of a whole pass: `(from, to)` for every step.
fn kv_messages(s: &Schedule) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for step in 0..s.num_steps() {
        for rank in 0..s.world_size() {
            let plan = s.rank_step(rank, step);
            assert!(plan.query_to.is_empty(), "{s:?}: no helper work is left");
            out.extend(plan.kv_to.iter().map(|&to| (rank, to)));
        }
    }
    out.sort_unstable();
    out
}

#[test]
fn a_window_shorter_than_a_chunk_needs_only_the_neighbours_keys() {
    for world in 2..=8 {
        // A window of one key is each query itself: every rank computes alone.
        let itself = Mask::causal().with_window(SlidingWindow::causal(1).unwrap());
        for kind in KINDS {
            let s = Schedule::for_mask(kind, world, SHARD, &itself).unwrap();
            assert_eq!(s.num_steps(), 1, "{s:?}");
            assert!(kv_messages(&s).is_empty(), "{s:?}");
        }
        for size in [2, 3] {
            let mask = Mask::causal().with_window(SlidingWindow::causal(size).unwrap());
            // Contiguous: rank r needs rank r - 1's keys, in one step after its own.
            let previous: Vec<(usize, usize)> = (1..world).map(|r| (r - 1, r)).collect();
            for kind in [ScheduleKind::Ring, ScheduleKind::Balanced] {
                let s = Schedule::for_mask(kind, world, SHARD, &mask).unwrap();
                assert_eq!(s.num_steps(), 2, "{s:?}");
                assert_eq!(kv_messages(&s), previous, "{s:?}");
            }
            // Zigzag: rank r's early chunk needs rank r - 1's early chunk, its late chunk rank
            // r + 1's late one (the middle rank's late chunk follows its own early one): steps
            // 0, 1 and P - 1.
            let s = Schedule::for_mask(ScheduleKind::Zigzag, world, SHARD, &mask).unwrap();
            let mut both: Vec<(usize, usize)> =
                (1..world).flat_map(|r| [(r - 1, r), (r, r - 1)]).collect();
            both.sort_unstable();
            assert_eq!(kv_messages(&s), both, "{s:?}");
            assert_eq!(s.num_steps(), if world == 2 { 2 } else { 3 }, "{s:?}");
        }
        // A two-sided window: each contiguous rank needs both neighbours, never wrapping around.
        let mask = Mask::none().with_window(SlidingWindow::two_sided(2, 1));
        let s = Schedule::for_mask(ScheduleKind::Ring, world, SHARD, &mask).unwrap();
        let mut both: Vec<(usize, usize)> =
            (1..world).flat_map(|r| [(r - 1, r), (r, r - 1)]).collect();
        both.sort_unstable();
        assert_eq!(kv_messages(&s), both, "{s:?}");
        assert_eq!(s.num_steps(), if world == 2 { 2 } else { 3 }, "{s:?}");
    }
}

#[test]
fn the_time_model_counts_the_window_s_scores() {
    // Causal window of w <= S keys on the ring: each shard against itself sees
    // S w - w (w - 1) / 2 scores, against its predecessor w (w - 1) / 2. With P > 1 that is two
    // steps whose slowest pairs add up to w / S pair-times (one step of 1 / S for w = 1), and a
    // speedup of P - (w - 1) / 2S over one device.
    for world in 1..=8 {
        for w in [1, 2, 4, 6] {
            let mask = Mask::causal().with_window(SlidingWindow::causal(w).unwrap());
            let s = Schedule::for_mask(ScheduleKind::Ring, world, SHARD, &mask).unwrap();
            let (p, wf, sf) = (world as f64, w as f64, SHARD as f64);
            let itself = (sf * wf - wf * (wf - 1.0) / 2.0) / (sf * sf);
            let (time, speedup) = match world {
                1 => (itself, 1.0),
                _ => (wf / sf, p - (wf - 1.0) / (2.0 * sf)),
            };
            assert!(
                (s.time() - time).abs() < 1e-12,
                "P={world} w={w}: {}",
                s.time()
            );
            assert!(
                (s.ideal_speedup() - speedup).abs() < 1e-9,
                "P={world} w={w}: {}",
                s.ideal_speedup()
            );
            // Rank 0 idles at the second step, when there is one.
            let idle = if world == 1 || w == 1 {
                0.0
            } else {
                1.0 / (p * p)
            };
            assert!((s.idle_fraction() - idle).abs() < 1e-12, "P={world} w={w}");
        }
    }
}

#[test]
fn documents_inside_the_shards_need_no_messages() {
    for world in 1..=8 {
        for lengths in [&[1usize][..], &[3], &[2, 1], &[SHARD]] {
            let documents = documents_of(&[lengths], world * SHARD);
            let mask = Mask::causal().with_documents(documents);
            for kind in KINDS {
                let s = Schedule::for_mask(kind, world, SHARD, &mask).unwrap();
                if s.layout() == Layout::Zigzag && lengths == [SHARD] {
                    continue; // A document of a shard's length spans two zigzag chunks' ranks.
                }
                assert_eq!(s.num_steps(), 1, "{lengths:?} {s:?}");
                assert!(kv_messages(&s).is_empty(), "{lengths:?} {s:?}");
                assert_eq!(s.idle_fraction(), 0.0);
            }
            // Documents of one token: each shard sees S of its S² scores.
            if lengths == [1] {
                let s = Schedule::for_mask(ScheduleKind::Ring, world, SHARD, &mask).unwrap();
                assert!((s.time() - 1.0 / SHARD as f64).abs() < 1e-12);
                assert!((s.ideal_speedup() - world as f64).abs() < 1e-9);
            }
        }
    }
}

#[test]
fn one_document_over_the_sequence_or_a_long_window_keeps_the_causal_schedule() {
    for world in 1..=8 {
        let len = world * SHARD;
        for mask in [
            Mask::causal().with_documents(Documents::from_cu_seqlens(&[0, len]).unwrap()),
            Mask::causal().with_window(SlidingWindow::causal(len).unwrap()),
        ] {
            for kind in KINDS {
                let masked = Schedule::for_mask(kind, world, SHARD, &mask).unwrap();
                let plain = Schedule::new(kind, world, true);
                assert_eq!(masked.kind(), plain.kind());
                assert_eq!(masked.num_steps(), plain.num_steps(), "{masked:?}");
                for step in 0..plain.num_steps() {
                    for rank in 0..world {
                        assert_eq!(masked.pair(rank, step), plain.pair(rank, step));
                        assert_eq!(masked.rank_step(rank, step), plain.rank_step(rank, step));
                    }
                }
            }
        }
    }
}

#[test]
fn auto_follows_the_window_and_not_the_documents() {
    for world in 1..=8 {
        for mask in masks(world * SHARD) {
            let s = Schedule::for_mask(ScheduleKind::Auto, world, SHARD, &mask).unwrap();
            // Documents change per batch while a run keeps one layout: they do not count.
            let run_mask = Mask {
                documents: None,
                ..mask.clone()
            };
            let kind = ScheduleKind::Auto.resolve_for(world, SHARD, &run_mask);
            assert_eq!(s.kind(), kind, "{mask:?}");
            if mask.window.is_none() {
                assert_eq!(kind, ScheduleKind::Auto.resolve(world, mask.causal));
            }
        }
    }
}

#[test]
fn masks_that_do_not_fit_the_sequence_are_refused_with_what_is_allowed() {
    let bad_mask = |result: Result<Schedule, ScheduleError>| match result {
        Err(ScheduleError::BadMask { what }) => what,
        other => panic!("expected a mask error, got {other:?}"),
    };
    // Documents of a shard, or of a longer sequence, instead of the whole sequence's.
    for cu in [&[0, 2, 6][..], &[0, 5, 30]] {
        let documents = Documents::from_cu_seqlens(cu).unwrap();
        let mask = Mask::causal().with_documents(documents);
        let what = bad_mask(Schedule::for_mask(ScheduleKind::Ring, 4, SHARD, &mask));
        assert!(
            what.contains(&format!("0..{}", cu[cu.len() - 1])) && what.contains("0..24"),
            "{what}"
        );
    }
    let what = bad_mask(Schedule::for_mask(
        ScheduleKind::Ring,
        4,
        SHARD,
        &Mask::causal().at(6, 0),
    ));
    assert!(what.contains("offsets 0"), "{what}");
    let window = Mask::causal().with_window(SlidingWindow::causal(2).unwrap());
    for (world, shard) in [(0, SHARD), (4, 0)] {
        let e = Schedule::for_mask(ScheduleKind::Ring, world, shard, &window).unwrap_err();
        assert!(matches!(e, ScheduleError::Layout { .. }), "{e}");
    }
    let e = Schedule::for_mask(ScheduleKind::Zigzag, 4, 7, &window).unwrap_err();
    assert!(e.to_string().contains("multiple of 2"), "{e}");
}
