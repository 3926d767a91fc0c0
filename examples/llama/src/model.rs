//! [`Llama`]: token embedding, [`TransformerBlock`]s, final RMSNorm and the output projection
//! (tied to the embedding or not), with the next-token cross-entropy loss, which runs the output
//! projection and the loss over row chunks so that no more than one chunk of logits exists.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::{Embedding, EmbeddingConfig, Initializer, Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use super::config::LlamaConfig;
use super::loss::{CrossEntropyBackend, HeadLayout, DEFAULT_LOSS_CHUNKS};
use super::rng::SplitMix64;
use burn_distflash::layers::{
    linear, project, BlockChain, RmsNorm, RmsNormConfig, RowChunks, TransformerBlock,
};
use burn_distflash::{
    AttentionContext, AttentionInput, Documents, Error as PluginError, FlashAttentionBackend,
    FlashAttentionOptions,
};

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
    /// How many rows (tokens) the output projection and loss take at a time in
    /// [`loss`](Llama::loss) ([`crate::loss::loss_bytes_per_row`] is what a budget is divided
    /// by); [`DEFAULT_LOSS_CHUNKS`] when built. The loss and gradients are the whole
    /// sequence's at once.
    #[module(skip)]
    pub loss_chunks: RowChunks,
    /// How many consecutive blocks share one gradient checkpoint
    /// ([`LlamaConfig::layers_per_checkpoint`], checked when built).
    #[module(skip)]
    layers_per_checkpoint: usize,
}

/// Standard deviation of the initial weight matrices.
const INIT_STD: f64 = 0.02;

impl LlamaConfig {
    /// The model with freshly initialised weights (normal, std 0.02), or what is wrong with the
    /// configuration.
    pub fn try_init<B: FlashAttentionBackend>(
        &self,
        device: &B::Device,
    ) -> Result<Llama<B>, PluginError> {
        self.validate()?;
        let init = Initializer::Normal {
            mean: 0.0,
            std: INIT_STD,
        };
        let mut block = self.block()?;
        block.attention = block.attention.with_initializer(init.clone());
        let blocks = (0..self.n_layers)
            .map(|layer| {
                let offload = self.offload.offloads(layer, self.n_layers);
                block.clone().with_offload(offload).try_init(device)
            })
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
            loss_chunks: DEFAULT_LOSS_CHUNKS,
            layers_per_checkpoint: self.layers_per_checkpoint,
        })
    }

    /// [`try_init`](Self::try_init) with every weight drawn at once on `device` by the
    /// backend's own generator seeded with `seed` (nothing is generated on the host, so a
    /// LLaMA-7B model is ready in seconds on a GPU). The draws are made in the module's visiting
    /// order, not at each weight's first read, so the same seed gives the same weights on the
    /// same backend in every run and every process, provided no other thread of the process
    /// draws from the backend's generator meanwhile (it is shared): call it before starting the
    /// ranks' threads. Another backend draws other values from the same seed.
    ///
    /// # Errors
    ///
    /// Those of [`try_init`](Self::try_init).
    pub fn try_init_on_device<B: FlashAttentionBackend>(
        &self,
        device: &B::Device,
        seed: u64,
    ) -> Result<Llama<B>, PluginError> {
        B::seed(device, seed);
        let model = self.try_init::<B>(device)?;
        model.visit(&mut DrawNow);
        Ok(model)
    }

    /// [`try_init`](Self::try_init) with the weight matrices drawn (normal, std 0.02) from a
    /// splitmix64 stream seeded with `seed`, not from the backend's generator: that one is
    /// shared by every thread of the process and, as Burn initialises weights lazily, drawn
    /// from whenever a weight is first read. The same seed gives the same weights in every run
    /// (rounded to the backend's float type), whatever other threads do. The norm scales keep
    /// their initial ones.
    pub fn try_init_seeded<B: FlashAttentionBackend>(
        &self,
        device: &B::Device,
        seed: u64,
    ) -> Result<Llama<B>, PluginError> {
        let model = self.try_init::<B>(device)?;
        Ok(model.map(&mut SeededMatrices {
            seed,
            index: 0,
            device: device.clone(),
        }))
    }
}

/// Reads every float weight of a module once, in visiting order, which makes Burn draw the
/// lazily initialised ones now.
struct DrawNow;

impl<B: Backend> ModuleVisitor<B> for DrawNow {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let _ = param.val();
    }
}

/// Replaces every weight matrix of a module, in visiting order, with normal values (std
/// [`INIT_STD`]) from the stream `(seed, index)`; vectors (the norm scales) are kept.
struct SeededMatrices<B: Backend> {
    seed: u64,
    index: u64,
    device: B::Device,
}

impl<B: Backend> ModuleMapper<B> for SeededMatrices<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if D < 2 {
            return param;
        }
        let shape = param.lazy_shape();
        let mut rng = SplitMix64::for_step(self.seed, self.index);
        self.index += 1;
        let values: Vec<f32> = (0..shape.num_elements())
            .map(|_| (INIT_STD * rng.normal()) as f32)
            .collect();
        load_param(param, TensorData::new(values, shape), &self.device)
    }
}

/// `param` with its value replaced by `data` (converted to the device's float type as it is
/// placed), keeping its id, device and parameter mapper, and requiring gradients so the loaded
/// model can be fine-tuned (meaningful on autodiff backends; a no-op elsewhere).
pub(crate) fn load_param<B: Backend, const D: usize>(
    param: Param<Tensor<B, D>>,
    data: TensorData,
    device: &B::Device,
) -> Param<Tensor<B, D>> {
    let tensor = B::memory_persistent_allocations(device, data, |data| {
        Tensor::<B, D>::from_data(data, device)
    });
    let id = param.id;
    param.transform_for_load(tensor, id).set_require_grad(true)
}

/// What [`Llama::forward`] and [`Llama::loss`] read: token ids `[batch, seq]` (the whole
/// sequence, or this rank's shard with a sharded context) and, for rows that pack several
/// documents, their boundaries. A tensor of token ids converts into an input without documents.
///
/// With documents, every block's attention lets a token see only the earlier tokens of its own
/// document (and of the configured window), so each document's logits are those it would get
/// alone (rotary positions stay global; attention depends only on distances, which packing does
/// not change). `documents` are the boundaries of the whole sequence (`world_size * seq`
/// positions when `tokens` is this rank's shard), once for every batch row or once per row (see
/// [`Documents`] and [`crate::data::Packing`]).
#[derive(Debug, Clone)]
pub struct LlamaInput<B: Backend> {
    /// Token ids `[batch, seq]`.
    pub tokens: Tensor<B, 2, Int>,
    /// The documents packed in the rows, if any.
    pub documents: Option<Documents>,
}

impl<B: Backend> LlamaInput<B> {
    /// `tokens` without documents.
    pub fn new(tokens: Tensor<B, 2, Int>) -> Self {
        Self {
            tokens,
            documents: None,
        }
    }

    /// The same tokens packing `documents`.
    pub fn with_documents(self, documents: Documents) -> Self {
        Self {
            documents: Some(documents),
            ..self
        }
    }
}

impl<B: Backend> From<Tensor<B, 2, Int>> for LlamaInput<B> {
    fn from(tokens: Tensor<B, 2, Int>) -> Self {
        Self::new(tokens)
    }
}

impl<B: FlashAttentionBackend> Llama<B> {
    /// Next-token logits `[batch, seq, vocab]` for `input` (token ids `[batch, seq]`, or a
    /// [`LlamaInput`] with documents).
    ///
    /// # Errors
    ///
    /// The plugin's shape or device error for tokens that are not `[batch > 0, seq > 0]` on the
    /// model's device, those of the blocks' attention, and its `BadMask` kernel error when the
    /// documents do not end at the whole sequence's length or have neither one list nor one per
    /// batch row.
    pub fn forward(
        &self,
        input: impl Into<LlamaInput<B>>,
        context: &AttentionContext<B>,
    ) -> Result<Tensor<B, 3>, PluginError> {
        let x = self.hidden_states(input.into(), context)?;
        Ok(match &self.lm_head {
            Some(head) => linear(head, x),
            None => project(x, self.embedding.weight.val().transpose()),
        })
    }

    /// The final norm's output `[batch, seq, d_model]` (what the output projection takes).
    fn hidden_states(
        &self,
        input: LlamaInput<B>,
        context: &AttentionContext<B>,
    ) -> Result<Tensor<B, 3>, PluginError> {
        let LlamaInput { tokens, documents } = input;
        self.check_tokens(&tokens)?;
        let x = self.embedding.forward(tokens);
        let x = (self.chain()).try_forward(AttentionInput { x, documents }, context)?;
        Ok(self.norm.forward(x))
    }

    /// How many consecutive blocks share one gradient checkpoint (1 or 2).
    pub fn layers_per_checkpoint(&self) -> usize {
        self.layers_per_checkpoint
    }

    /// The blocks with [`layers_per_checkpoint`](Self::layers_per_checkpoint) layers per
    /// checkpoint.
    fn chain(&self) -> BlockChain<'_, B> {
        BlockChain::try_new(&self.blocks, self.layers_per_checkpoint).expect(
            "the configuration's layers per checkpoint were checked when the model was built",
        )
    }

    /// The output projection's weight and its layout: the head's `[d_model, vocab]`, or the
    /// embedding table `[vocab, d_model]` when tied.
    fn head_weight(&self) -> (Tensor<B, 2>, HeadLayout) {
        match &self.lm_head {
            Some(head) => (head.weight.val(), HeadLayout::Untied),
            None => (self.embedding.weight.val(), HeadLayout::Tied),
        }
    }

    /// The options of the blocks' attention (the configured causal order, window and
    /// determinism; every block has the same), which with a sharded context's world size and
    /// shard length decide the sequence's [`Layout`](burn_distflash::schedule::Layout).
    pub fn attention_options(&self) -> FlashAttentionOptions {
        (self.blocks.first()).map_or_else(FlashAttentionOptions::causal, |block| {
            block.attention.options()
        })
    }

    /// This model with `loss` as its [`loss_chunks`](Self::loss_chunks) and `ffn` as every
    /// block's [`ffn_chunks`](TransformerBlock::ffn_chunks): how many rows the loss and the
    /// feed-forward blocks take at a time (memory only; the results do not change).
    pub fn with_chunks(mut self, loss: RowChunks, ffn: RowChunks) -> Self {
        self.loss_chunks = loss;
        for block in &mut self.blocks {
            block.ffn_chunks = ffn;
        }
        self
    }

    /// The bytes of each tensor the blocks' checkpoints (one per pair of blocks with two layers
    /// per checkpoint) move to host memory in one training step on `[batch, seq]` tokens (`seq`
    /// this rank's), for
    /// [`HostOffload::prepare_host_offload`](burn_distflash::offload::HostOffload::prepare_host_offload) before the
    /// step; empty when no block offloads.
    pub fn offloaded_bytes(&self, batch: usize, seq: usize) -> Vec<usize> {
        self.chain().offloaded_bytes(batch, seq)
    }

    /// Refuses, before any work, tokens that are not `[batch > 0, seq > 0]` on the model's
    /// device.
    fn check_tokens(&self, tokens: &Tensor<B, 2, Int>) -> Result<(), PluginError> {
        let dims = tokens.dims();
        if dims[0] == 0 || dims[1] == 0 {
            return Err(PluginError::Shape {
                tensor: "the tokens".into(),
                expected: "[batch, seq] with batch and seq at least 1".into(),
                got: format!("{dims:?}"),
            });
        }
        let device = self.embedding.weight.val().device();
        if tokens.device() != device {
            return Err(PluginError::Device {
                tensor: "the tokens".into(),
                expected: format!("the model's device {device:?}"),
                got: format!("{:?}", tokens.device()),
            });
        }
        Ok(())
    }

    /// Cross-entropy of `targets` `[batch, seq]` summed over the tokens of `input` and divided
    /// by `normalizer`: with `normalizer` the number of target tokens of the whole sequence, the
    /// ranks' losses add up to the mean loss, and so do their gradients. The output projection
    /// and the loss run over row chunks ([`loss_chunks`](Self::loss_chunks)): the logits of
    /// one chunk exist at a time, also in the backward.
    ///
    /// With documents every target counts, the one after a document's last token included: that
    /// token (an end-of-text token, see [`crate::data::Packing`]) sees only its own document, so
    /// the model learns how documents begin, as in unpacked training on the same text.
    ///
    /// # Errors
    ///
    /// Those of [`forward`](Self::forward).
    pub fn loss(
        &self,
        input: impl Into<LlamaInput<B>>,
        targets: Tensor<B, 2, Int>,
        context: &AttentionContext<B>,
        normalizer: usize,
    ) -> Result<Tensor<B, 1>, PluginError>
    where
        B: CrossEntropyBackend,
    {
        let hidden = self.hidden_states(input.into(), context)?;
        let [batch, seq, d_model] = hidden.dims();
        let rows = batch * seq;
        let (weight, layout) = self.head_weight();
        let sum = B::projected_cross_entropy_sum(
            hidden.reshape([rows, d_model]),
            weight,
            layout,
            targets.reshape([rows]),
            &self.loss_chunks,
        );
        Ok(sum.div_scalar(normalizer as f64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    fn values<const D: usize>(param: &Param<Tensor<NdArray, D>>) -> Vec<f32> {
        param.val().into_data().to_vec().unwrap()
    }

    #[test]
    fn seeded_weights_depend_on_the_seed_alone() {
        let config = LlamaConfig::new(64, 32, 1, 2, 2, 48);
        let device = Default::default();
        let a = config.try_init_seeded::<NdArray>(&device, 7).unwrap();
        let b = config.try_init_seeded::<NdArray>(&device, 7).unwrap();
        let c = config.try_init_seeded::<NdArray>(&device, 8).unwrap();
        let embedding = values(&a.embedding.weight);
        assert_eq!(embedding, values(&b.embedding.weight));
        assert_ne!(embedding, values(&c.embedding.weight));
        let up = values(&a.blocks[0].ffn.up.weight);
        assert_eq!(up, values(&b.blocks[0].ffn.up.weight));
        assert_ne!(up, embedding[..up.len()], "each matrix has its own stream");
        let n = embedding.len() as f64;
        let std = (embedding.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / n).sqrt();
        assert!((std - INIT_STD).abs() < 0.1 * INIT_STD, "std {std}");
        assert!(values(&a.norm.weight).iter().all(|&v| v == 1.0));
    }

    #[test]
    fn weights_drawn_on_the_device_depend_on_the_seed_not_on_the_order_of_reads() {
        let config = LlamaConfig::new(64, 32, 2, 2, 2, 48);
        let device = Default::default();
        let a = config.try_init_on_device::<NdArray>(&device, 7).unwrap();
        let b = config.try_init_on_device::<NdArray>(&device, 7).unwrap();
        let c = config.try_init_on_device::<NdArray>(&device, 8).unwrap();
        // `b`'s last block read first: the values were drawn at initialisation, in visiting
        // order, not at a first read.
        let last = values(&b.blocks[1].ffn.down.weight);
        assert_eq!(values(&a.blocks[1].ffn.down.weight), last);
        assert_eq!(values(&a.embedding.weight), values(&b.embedding.weight));
        assert_ne!(values(&a.embedding.weight), values(&c.embedding.weight));
        // Drawn, not constant. (No other test of this binary draws from the backend's shared
        // generator, which would shift the draws of a concurrent test.)
        let embedding = values(&a.embedding.weight);
        assert!(embedding.iter().any(|&v| v != embedding[0]));
    }
}
