//! What a zigzag two-rank backward makes its rank's pools reserve, on wgpu (whose pools count
//! their bytes per stream, one stream per rank thread): the pages of the tensors the pass must
//! hold and nothing more. Each rank's chunks are tensors of their own for the whole pass, so
//! the pair against the other rank's shard (every query against the early keys, or the late
//! queries against every key) runs on whole tensors and copies none of their rows: neither the
//! inputs' nor the f32 accumulators'.
//!
//! The shard is sized so that one page of the pool holds exactly one shard or two chunks
//! (CubeCL's sliced pages of 32 MiB on lavapipe, whose 128 MiB pages give it that class: a
//! buffer within 20% of the page takes one, slices of at most 16 MiB share one), and a freed
//! page serves either size; so the bytes a rank's backward makes the pools reserve, from pools
//! cleaned up before it, are whole shards, and bound what it holds at its busiest from below.
//!
//! Streaming the other rank's key/value shard in row parts: the same backward, once with the
//! remote shard whole and once in 4 row parts ([`SequenceParallelOptions::backward_parts`]), each from pools cleaned up
//! before it. Whole, the rank holds beside its f32 accumulators (3 shards) the other rank's
//! `k, v` and their f32 `dk, dv` (2 and 2 shards, less O's page, freed once delta is made): 6
//! shards of pages measured. In 4 parts it holds a quarter of each, and the next part and the
//! previous part's gradients in flight, slices of at most 4 MiB that share one page: 4 shards
//! measured, 2 less, which the test asks for.

use burn_distflash::collective::on_each_rank;
use burn_distflash::schedule::ScheduleKind;
use burn_distflash::sequence_parallel::SequenceParallelOptions;
use burn_distflash::{DeviceGroup, SequenceParallelBackend};
use distflash_test_support::exclusive_wgpu;

use crate::common::wgpu_pools::{clean_up, device, random, reserved, WgpuF32};

/// 2048 heads of 64 rows of 64 (chunks of 32 rows, parts of 8): 32 MiB of f32 a shard, 16 MiB a
/// chunk.
const SHARD: [usize; 4] = [32, 64, 64, 64];
const SHARD_BYTES: u64 = 32 * 64 * 64 * 64 * 4;

/// The bytes each rank's backward makes its pools reserve with the remote shard in `parts`.
fn backward_reserved(parts: usize) -> Vec<u64> {
    let options = (SequenceParallelOptions::causal())
        .with_schedule(ScheduleKind::Zigzag)
        .with_backward_parts(parts);
    let groups = DeviceGroup::<WgpuF32>::in_process(vec![device(); 2]);
    on_each_rank(groups, move |_, group| {
        let (q, k, v) = (random(SHARD), random(SHARD), random(SHARD));
        let (out, lse) =
            WgpuF32::sequence_parallel_attention(q.clone(), k.clone(), v.clone(), &group, &options)
                .unwrap();
        let grad_out = random(SHARD);
        clean_up();
        let before = reserved();
        // The inputs are moved in, as the autodiff node moves its saved tensors.
        let grads =
            WgpuF32::sequence_parallel_backward(q, k, v, out, lse, grad_out, &group, &options)
                .unwrap();
        let after = reserved();
        drop(grads);
        clean_up();
        after - before
    })
}

#[test]
fn a_zigzag_backward_reserves_only_the_shards_the_pass_holds() {
    let _wgpu = exclusive_wgpu();
    let reserved_by_rank = backward_reserved(1);
    println!("reserved by each rank's backward: {reserved_by_rank:?} B ({SHARD_BYTES} B a shard)");
    // What the pass holds at its busiest: the rank's f32 accumulators (3 shards), the other
    // rank's k and v (2) and the f32 gradients of one side of the other rank's shard (dk and dv:
    // 2; dq: 1), less O's page, which the backward frees once delta is made (the inputs' own
    // pages hold their chunks): 6 shards, and below a seventh the small tensors (lse, delta,
    // their chunks). Copies of a chunk's rows (of q and dO and the dq accumulator's, or of k
    // and v and the dk and dv accumulators') would take a seventh and an eighth.
    for (rank, reserved) in reserved_by_rank.into_iter().enumerate() {
        assert!(
            reserved < 7 * SHARD_BYTES,
            "rank {rank}'s backward reserved {reserved} B, 7 shards of {SHARD_BYTES} B or more"
        );
    }
}

#[test]
fn streaming_the_remote_shard_in_parts_reserves_less() {
    let _wgpu = exclusive_wgpu();
    let whole = backward_reserved(1);
    let parts = backward_reserved(4);
    println!("reserved by each rank's backward: whole {whole:?} B, in 4 parts {parts:?} B ({SHARD_BYTES} B a shard)");
    for (rank, (whole, parts)) in whole.into_iter().zip(parts).enumerate() {
        assert!(
            parts + 2 * SHARD_BYTES <= whole,
            "rank {rank}: in 4 parts {parts} B, whole {whole} B: not 2 shards of {SHARD_BYTES} B \
             less"
        );
    }
}
