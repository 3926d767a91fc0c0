//! The whole f32 weight vector a device-resident ZeRO 1/2 share keeps alive on a group.
//!
//! `ShardedAdamW` makes a rank's f32 master weights as its share of the whole model's weights
//! laid end to end in f32 (`FlatLayout::weights` narrowed to the rank's range). A narrowed tensor
//! on CubeCL is a view of the whole vector's buffer, and the update (Burn's element-wise
//! operations, which write in place into a tensor they hold alone) keeps writing into that view:
//! the buffer of all `P s` elements stays allocated for as long as the state lives, `4 (P - 1) s`
//! bytes more than the share the state counts. Measured on two H200s (LLaMA-7B shape, 4 layers,
//! ZeRO 2): the bytes in use after a forward exceed the counted weights, state and activations
//! by 1.98 GiB at every sequence length and checkpoint placement, where `4 (P - 1) s` is 2.00
//! GiB. On one GPU the share is the whole vector; a state read from a checkpoint, or kept in
//! host memory, is made share by share.

use crate::optimizer::StatePlacement;
use crate::train::MemoryReport;

/// Bytes of f32.
const F32: u64 = 4;

/// The bytes of the whole f32 weight vector beyond the rank's share that a fresh
/// device-resident sharded state keeps alive (0 replicated, on one GPU, or in host memory).
pub(crate) fn retained_master_vector(report: &MemoryReport, placement: StatePlacement) -> u64 {
    let world = report.world.max(1) as u64;
    if !report.stage.is_sharded() || world == 1 || placement == StatePlacement::Host {
        return 0;
    }
    let share = (report.parameters as u64).div_ceil(world);
    F32 * share * (world - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optimizer::ZeroStage;

    fn report(parameters: usize, world: usize, stage: ZeroStage) -> MemoryReport {
        MemoryReport::for_parameters(parameters, 2 * parameters as u64, world, stage)
    }

    #[test]
    fn a_group_keeps_the_other_ranks_shares_of_the_f32_vector() {
        // 1001 parameters over 4 ranks: shares of 251, the vector padded to 1004.
        let sharded = report(1001, 4, ZeroStage::Gradients);
        assert_eq!(
            retained_master_vector(&sharded, StatePlacement::Gpu),
            4 * 251 * 3
        );
        let stage_1 = report(1001, 2, ZeroStage::OptimizerStates);
        assert_eq!(
            retained_master_vector(&stage_1, StatePlacement::Gpu),
            4 * 501
        );
    }

    #[test]
    fn nothing_is_retained_replicated_on_one_gpu_or_on_the_host() {
        let cases = [
            (report(1000, 2, ZeroStage::Replicated), StatePlacement::Gpu),
            (report(1000, 1, ZeroStage::Gradients), StatePlacement::Gpu),
            (report(1000, 2, ZeroStage::Gradients), StatePlacement::Host),
        ];
        for (report, placement) in cases {
            assert_eq!(retained_master_vector(&report, placement), 0, "{report:?}");
        }
    }
}
