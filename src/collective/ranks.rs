//! Running one closure per rank of an in-process group, each rank on a thread of its own.

use std::panic::resume_unwind;
use std::thread;

/// Runs `body(rank, item)` for every item of `per_rank` (item `r` belongs to rank `r`: its
/// [`DeviceGroup`](super::DeviceGroup), or the group zipped with the rank's inputs) on a scoped
/// thread of its own, and returns the results in rank order.
///
/// A group's ranks block on each other's messages, so they must run concurrently; this is the
/// harness for groups made in one process (`DeviceGroup::in_process`, or NCCL with one process
/// for all GPUs). Every rank runs to its end before this returns.
///
/// # Panics
///
/// Resumes the panic of the first rank (in rank order) that panicked, once every rank has
/// finished (the others may first fail on messages the panicked rank never sent).
pub fn on_each_rank<I, T, F>(per_rank: Vec<I>, body: F) -> Vec<T>
where
    I: Send,
    T: Send,
    F: Fn(usize, I) -> T + Sync,
{
    thread::scope(|scope| {
        let body = &body;
        let handles: Vec<_> = (per_rank.into_iter().enumerate())
            .map(|(rank, item)| scope.spawn(move || body(rank, item)))
            .collect();
        let outcomes: Vec<_> = handles.into_iter().map(|h| h.join()).collect();
        (outcomes.into_iter())
            .map(|outcome| outcome.unwrap_or_else(|panic| resume_unwind(panic)))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_back_in_rank_order() {
        let out = on_each_rank(vec![10, 20, 30], |rank, item| (rank, item * 2));
        assert_eq!(out, vec![(0, 20), (1, 40), (2, 60)]);
    }

    #[test]
    fn ranks_run_concurrently() {
        // Each rank waits for the other: this only finishes if both run at once.
        let barrier = std::sync::Barrier::new(2);
        let out = on_each_rank(vec![(); 2], |rank, ()| {
            barrier.wait();
            rank
        });
        assert_eq!(out, vec![0, 1]);
    }

    #[test]
    #[should_panic(expected = "rank 1 failed")]
    fn a_rank_panic_reaches_the_caller() {
        on_each_rank(vec![(); 3], |rank, ()| {
            if rank == 1 {
                panic!("rank 1 failed");
            }
        });
    }
}
