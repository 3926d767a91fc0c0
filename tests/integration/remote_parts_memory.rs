//! What streaming the other rank's key/value shard in row parts saves a two-rank zigzag
//! backward on wgpu (whose pools count their bytes per stream, one stream per rank thread):
//! the same backward as in `zigzag_backward_memory`, once with the remote shard whole and once
//! in 4 row parts ([`SequenceParallelOptions::backward_parts`]), each from pools cleaned up
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

/// 2048 heads of 64 rows of 64 (chunks of 32 rows, parts of 8): 32 MiB of f32 a shard.
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
