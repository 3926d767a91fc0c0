//! How many scores of a rectangle of positions (query positions x key positions) a mask leaves
//! visible, counted exactly without visiting single positions.
//!
//! Every [`Mask`] is a band cut by documents: the query at position `x` sees the keys
//! `x - before ..= x + after` (the window's reach, unbounded without a window, nothing after
//! the query when causal) that lie in its own document. Over a rectangle, each document both
//! sides reach contributes the band's scores inside (its queries x its keys), and the band's
//! count over a rectangle has a closed form: each query row sees `min(C, x + u, v - x)` keys
//! (clamped at 0), a concave piecewise-linear function whose sum is a few arithmetic series.
//! So a count costs `O(documents the query range reaches)` per document row, which is what lets
//! a schedule decide every pair of shards and blocks of a long sequence cheaply.
//!
//! ```text
//! causal, window of 3, documents [0, 5, 12)        keys  0 1 2 3 4 5 6 7 ...
//!   query 6 sees keys 5..=6 (its document starts at 5)     . . . . . # # .
//!   query 4 sees keys 2..=4                                 . . # # # . . .
//! ```

use core::ops::Range;

use crate::mask::Mask;

/// A distance beyond any two positions' (positions fit 64 bits): the reach of a mask without a
/// window.
const UNBOUNDED: i128 = 1 << 64;

/// Scores of the query positions `queries` against the key positions `keys` that `mask` leaves
/// visible, summed over the mask's document rows (one without documents or when every batch
/// row shares them). Positions are absolute: the mask's offsets are not applied (a
/// whole-sequence mask has offsets 0). Positions past the
/// documents' end see nothing, as in [`Mask::visible`]. Exact: non-zero iff some batch row has
/// a visible score in the rectangle.
pub fn visible_scores(mask: &Mask, queries: Range<usize>, keys: Range<usize>) -> u128 {
    let (before, after) = reach(mask);
    let band = |q: Range<usize>, k: Range<usize>| band_scores(q, k, before, after);
    let Some(documents) = &mask.documents else {
        return band(queries, keys);
    };
    (0..documents.batch_rows())
        .map(|row| {
            let bounds = documents.cu_seqlens(row);
            // The document holding the first query position, then the following ones that
            // still hold query positions.
            let first = bounds
                .partition_point(|&b| b <= queries.start)
                .saturating_sub(1);
            (bounds[first..].windows(2))
                .take_while(|doc| doc[0] < queries.end)
                .map(|doc| {
                    let inside = |r: &Range<usize>| r.start.max(doc[0])..r.end.min(doc[1]);
                    band(inside(&queries), inside(&keys))
                })
                .sum::<u128>()
        })
        .sum()
}

/// How far before and after its own position a query sees under `mask`: the window's reach
/// ([`UNBOUNDED`] without a window), nothing after it when causal.
fn reach(mask: &Mask) -> (i128, i128) {
    let before = mask.window.map_or(UNBOUNDED, |w| w.before as i128);
    let after = match (mask.causal, mask.window) {
        (true, _) => 0,
        (false, Some(w)) => w.after as i128,
        (false, None) => UNBOUNDED,
    };
    (before, after)
}

/// Pairs `(x, y)` of `queries` x `keys` with `x - before <= y <= x + after`.
///
/// Query `x` sees `g(x) = min(C, x + u, v - x)` keys (none where that is not positive), with
/// `C = min(|keys|, before + after + 1)`, `u = after + 1 - keys.start`, `v = keys.end + before`:
/// a trapezoid rising with slope 1 to `C`, flat, then falling (the slopes would meet at height
/// `(|keys| + before + after + 1) / 2 >= C`, so the plateau always exists). Cut where it
/// changes piece or crosses zero, `g` is affine with one sign on each segment, so each
/// segment's sum is an arithmetic series.
fn band_scores(queries: Range<usize>, keys: Range<usize>, before: i128, after: i128) -> u128 {
    if queries.is_empty() || keys.is_empty() {
        return 0;
    }
    let (x0, x1) = (queries.start as i128, queries.end as i128);
    let (k0, k1) = (keys.start as i128, keys.end as i128);
    let c = (k1 - k0).min(before + after + 1);
    let (u, v) = (after + 1 - k0, k1 + before);
    let g = |x: i128| c.min(x + u).min(v - x);
    let mut cuts: Vec<i128> = [x0, x1, c - u, v - c, -u, v]
        .into_iter()
        .map(|cut| cut.clamp(x0, x1))
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    (cuts.windows(2))
        .map(|segment| {
            let (first, last) = (g(segment[0]), g(segment[1] - 1));
            if first < 0 || last < 0 {
                return 0;
            }
            // An arithmetic series of integers: (first + last) * count is even.
            ((first + last) * (segment[1] - segment[0]) / 2) as u128
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Documents, SlidingWindow};

    /// A small deterministic generator (SplitMix64).
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % n as u64) as usize
        }

        fn range(&mut self, len: usize) -> Range<usize> {
            let (a, b) = (self.below(len + 1), self.below(len + 1));
            a.min(b)..a.max(b)
        }
    }

    /// The same count, score by score, from [`Mask::visible`].
    fn brute_force(mask: &Mask, queries: Range<usize>, keys: Range<usize>) -> u128 {
        let rows = mask.documents.as_ref().map_or(1, Documents::batch_rows);
        let mut count = 0;
        for b in 0..rows {
            for x in queries.clone() {
                count += keys.clone().filter(|&y| mask.visible(b, x, y)).count() as u128;
            }
        }
        count
    }

    fn random_documents(rng: &mut Rng, len: usize) -> Documents {
        let rows: Vec<Vec<usize>> = (0..1 + rng.below(3))
            .map(|_| {
                let mut cu = vec![0];
                while *cu.last().unwrap() < len {
                    let next = cu.last().unwrap() + 1 + rng.below(7);
                    cu.push(next.min(len));
                }
                cu
            })
            .collect();
        Documents::per_batch_row(&rows).unwrap()
    }

    #[test]
    fn counts_equal_the_masks_own_visibility_score_by_score() {
        let mut rng = Rng(7);
        let len = 40;
        for case in 0..3000 {
            let mut mask = if rng.below(2) == 0 {
                Mask::causal()
            } else {
                Mask::none()
            };
            if rng.below(3) > 0 {
                let window = SlidingWindow::two_sided(rng.below(12), rng.below(12));
                mask = mask.with_window(window);
            }
            if rng.below(2) == 0 {
                mask = mask.with_documents(random_documents(&mut rng, len));
            }
            let (queries, keys) = (rng.range(len), rng.range(len));
            assert_eq!(
                visible_scores(&mask, queries.clone(), keys.clone()),
                brute_force(&mask, queries.clone(), keys.clone()),
                "case {case}: {mask:?}, queries {queries:?}, keys {keys:?}"
            );
        }
    }

    #[test]
    fn long_ranges_count_in_closed_form() {
        // A million queries against a million keys, causal: n (n + 1) / 2.
        let n = 1u128 << 20;
        let all = 0..n as usize;
        assert_eq!(
            visible_scores(&Mask::causal(), all.clone(), all.clone()),
            n * (n + 1) / 2
        );
        assert_eq!(
            visible_scores(&Mask::none(), all.clone(), all.clone()),
            n * n
        );
        // A causal window of 8: 8 keys per query but the first 7.
        let window = Mask::causal().with_window(SlidingWindow::causal(8).unwrap());
        assert_eq!(visible_scores(&window, all.clone(), all), 8 * n - 28);
    }

    #[test]
    fn positions_past_the_documents_see_nothing() {
        let documents = Documents::from_cu_seqlens(&[0, 4, 10]).unwrap();
        let mask = Mask::none().with_documents(documents);
        assert_eq!(visible_scores(&mask, 10..20, 0..20), 0);
        assert_eq!(visible_scores(&mask, 8..20, 0..20), 2 * 6);
    }
}
