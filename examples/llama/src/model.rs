//! [`Llama`]: token embedding, [`TransformerBlock`]s, final RMSNorm and the output projection
//! (tied to the embedding or not), with the next-token cross-entropy loss.

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Initializer, Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use super::config::LlamaConfig;
use super::loss::CrossEntropyBackend;
use burn_distflash::layers::{
    linear, AttentionContext, ConfigError, RmsNorm, RmsNormConfig, TransformerBlock,
    TransformerBlockConfig,
};
use burn_distflash::{CheckpointBackend, DistributedError, FlashAttentionBackend};

/// A Llama language model.
#[derive(Module, Debug)]
pub struct Llama<B: Backend> {
    /// Token embedding `[vocab, d_model]`.
    pub embedding: Embedding<B>,
    /// The decoder blocks.
    pub blocks: Vec<TransformerBlock<B>>,
    /// Final norm.
    pub norm: RmsNorm<B>,
    /// Output projection `[d_model, vocab]`; `None` when tied to the embedding.
    pub lm_head: Option<Linear<B>>,
}

impl LlamaConfig {
    /// The model with freshly initialised weights (normal, std 0.02), or what is wrong with the
    /// configuration.
    pub fn try_init<B: FlashAttentionBackend>(
        &self,
        device: &B::Device,
    ) -> Result<Llama<B>, ConfigError> {
        self.validate()?;
        let init = Initializer::Normal {
            mean: 0.0,
            std: 0.02,
        };
        let block =
            TransformerBlockConfig::new(self.attention().with_initializer(init.clone()), self.d_ff)
                .with_norm_eps(self.norm_eps)
                .with_checkpoint(self.checkpoint);
        let blocks = (0..self.n_layers)
            .map(|_| block.try_init(device))
            .collect::<Result<_, _>>()?;
        Ok(Llama {
            embedding: EmbeddingConfig::new(self.vocab_size, self.d_model)
                .with_initializer(init.clone())
                .init(device),
            blocks,
            norm: RmsNormConfig::new(self.d_model)
                .with_eps(self.norm_eps)
                .init(device),
            lm_head: (!self.tie_embeddings).then(|| {
                LinearConfig::new(self.d_model, self.vocab_size)
                    .with_bias(false)
                    .with_initializer(init)
                    .init(device)
            }),
        })
    }
}

impl<B: CheckpointBackend> Llama<B> {
    /// Next-token logits `[batch, seq, vocab]` for `tokens` `[batch, seq]` (the whole sequence,
    /// or this rank's shard with a sharded context).
    pub fn forward(
        &self,
        tokens: Tensor<B, 2, Int>,
        context: &AttentionContext<B::Inner>,
    ) -> Result<Tensor<B, 3>, DistributedError> {
        self.check_tokens(&tokens)?;
        let mut x = self.embedding.forward(tokens);
        for block in &self.blocks {
            x = block.try_forward(x, context)?;
        }
        let x = self.norm.forward(x);
        Ok(match &self.lm_head {
            Some(head) => linear(head, x),
            None => x.matmul(self.embedding.weight.val().transpose().unsqueeze()),
        })
    }

    /// Refuses, before any work, tokens that are not `[batch > 0, seq > 0]` on the model's
    /// device.
    fn check_tokens(&self, tokens: &Tensor<B, 2, Int>) -> Result<(), DistributedError> {
        let dims = tokens.dims();
        if dims[0] == 0 || dims[1] == 0 {
            return Err(DistributedError::Input(format!(
                "tokens are {dims:?}; batch and seq must be at least 1"
            )));
        }
        let device = self.embedding.weight.val().device();
        if tokens.device() != device {
            return Err(DistributedError::Device(format!(
                "tokens are on {:?} but the model is on {device:?}",
                tokens.device()
            )));
        }
        Ok(())
    }

    /// Cross-entropy of `targets` `[batch, seq]` summed over these tokens and divided by
    /// `normalizer`: with `normalizer` the number of target tokens of the whole sequence, the
    /// ranks' losses add up to the mean loss, and so do their gradients.
    pub fn loss(
        &self,
        tokens: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
        context: &AttentionContext<B::Inner>,
        normalizer: usize,
    ) -> Result<Tensor<B, 1>, DistributedError>
    where
        B: CrossEntropyBackend,
    {
        let logits = self.forward(tokens, context)?;
        let [batch, seq, vocab] = logits.dims();
        let rows = batch * seq;
        let sum = B::cross_entropy_sum(logits.reshape([rows, vocab]), targets.reshape([rows]));
        Ok(sum.div_scalar(normalizer as f64))
    }
}
