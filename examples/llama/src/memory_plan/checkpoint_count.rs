//! [`CheckpointCount`]: how many gradient checkpoints a Llama keeps and how many of them wait in
//! host memory, from its layers, its layers per checkpoint and its offload policy, as the model
//! runs them (`BlockChain`): one checkpoint per layer, or per pair of consecutive layers (an odd
//! last layer alone), each offloaded when its first layer's policy says so.

use crate::config::LlamaConfig;

/// A model's checkpoints (one block's, or with two layers per checkpoint one pair's, each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CheckpointCount {
    /// Checkpoints in all.
    pub all: u64,
    /// Checkpoints in host memory (the first ones in the forward).
    pub offloaded: u64,
}

impl CheckpointCount {
    /// The checkpoints of `config`'s model.
    pub fn of(config: &LlamaConfig) -> Self {
        let layers = config.n_layers;
        let firsts = (0..layers).step_by(config.layers_per_checkpoint.max(1));
        let offloaded = (firsts.clone())
            .filter(|&layer| config.offload.offloads(layer, layers))
            .count();
        Self {
            all: firsts.count() as u64,
            offloaded: offloaded as u64,
        }
    }

    /// Checkpoints on the GPU.
    pub fn on_gpu(&self) -> u64 {
        self.all - self.offloaded
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_distflash::layers::{CheckpointPlacement, Offload};

    fn count(layers: usize, per_checkpoint: usize, offload: Offload) -> (u64, u64) {
        let mut config = LlamaConfig::new(256, 64, layers, 4, 4, 128)
            .with_checkpoint(CheckpointPlacement::Layer)
            .with_offload(offload);
        config.layers_per_checkpoint = per_checkpoint;
        let count = CheckpointCount::of(&config);
        (count.all, count.offloaded)
    }

    #[test]
    fn pairs_halve_the_checkpoints_and_offload_as_their_first_layer() {
        assert_eq!(count(32, 1, Offload::All), (32, 32));
        assert_eq!(count(32, 2, Offload::All), (16, 16));
        assert_eq!(count(32, 2, Offload::AllButLast(3)), (16, 15));
        // Layers 0-1, 2-3 and 4 alone; the last two layers keep theirs on the GPU: layer 3's
        // pair offloads with layer 2.
        assert_eq!(count(5, 2, Offload::AllButLast(2)), (3, 2));
        assert_eq!(count(5, 2, Offload::AllButLast(1)), (3, 2));
        assert_eq!(count(5, 2, Offload::All), (3, 3));
        assert_eq!(count(5, 2, Offload::Off), (3, 0));
    }
}
