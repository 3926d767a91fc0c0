//! [`DistFlashAttention`]: multi-head self-attention with query/key/value/output projections,
//! grouped key/value heads (GQA/MQA), rotary embeddings at absolute positions, on one device or on
//! a rank of a sequence-parallel group.

use std::ops::Range;

use crate::Error;
use burn::config::Config;
use burn::module::Module;
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use super::counter::ForwardCounter;
use super::head_groups::HeadGroup;
use super::input::AttentionInput;
use super::linear_layer::{linear, project};
use super::rope::{RopeConfig, RotaryTables};
use crate::extension::AttentionContext;
use crate::extension::FlashAttentionBackend;
use crate::flash_attention_with_lse;
use crate::kernels::SUPPORTED_HEAD_DIMS;
use crate::options::{Documents, FlashAttentionOptions, Mask, SlidingWindow};
use crate::sequence_parallel::{announce_refusal, sequence_parallel_attention_with_lse};

/// Configuration of [`DistFlashAttention`].
#[derive(Config, Debug)]
pub struct DistFlashAttentionConfig {
    /// Width of the residual stream.
    pub d_model: usize,
    /// Number of query heads (any count: 33 and 2 are fine).
    pub n_heads: usize,
    /// Number of key/value heads, dividing `n_heads` (GQA; 1 is MQA). Default: `n_heads`.
    #[config(default = "None")]
    pub n_kv_heads: Option<usize>,
    /// Per-head width. Default: `d_model / n_heads`, which must then divide evenly.
    #[config(default = "None")]
    pub head_dim: Option<usize>,
    /// Causal masking over the whole sequence.
    #[config(default = true)]
    pub causal: bool,
    /// A sliding window around each query (see [`SlidingWindow`]; with `causal`, its `after` is
    /// ignored), over absolute positions: sharded, it spans the ranks. Default: none.
    #[config(default = "None")]
    pub window: Option<SlidingWindow>,
    /// Bitwise reproducible attention gradients (slower backward on CUDA; see
    /// [`crate::FlashAttentionOptions::deterministic`]). Default: off.
    #[config(default = false)]
    pub deterministic: bool,
    /// Rotary embedding.
    #[config(default = "RopeConfig::new()")]
    pub rope: RopeConfig,
    /// Initialiser of the projection weights (Llama: normal, std 0.02).
    #[config(default = "Initializer::Normal { mean: 0.0, std: 0.02 }")]
    pub initializer: Initializer,
}

impl DistFlashAttentionConfig {
    /// `(n_kv_heads, head_dim)` after defaults, or what is wrong with the configuration.
    ///
    /// # Errors
    ///
    /// [`Error`] when `d_model`, `n_heads` or `n_kv_heads` is zero, when `n_kv_heads`
    /// does not divide `n_heads`, when `head_dim` is unset and `n_heads` does not divide
    /// `d_model`, or when `head_dim` is not in [`SUPPORTED_HEAD_DIMS`].
    pub fn resolved(&self) -> Result<(usize, usize), Error> {
        let n_kv = self.n_kv_heads.unwrap_or(self.n_heads);
        if self.d_model == 0 || self.n_heads == 0 || n_kv == 0 {
            return Err(Error::config(
                "d_model, n_heads and n_kv_heads",
                "all positive",
                format!("{}, {} and {n_kv}", self.d_model, self.n_heads),
            ));
        }
        if !self.n_heads.is_multiple_of(n_kv) {
            return Err(Error::config(
                "n_kv_heads",
                format!(
                    "a divisor of n_heads ({}): each key/value head serves a group of query heads",
                    self.n_heads
                ),
                n_kv,
            ));
        }
        let head_dim = match self.head_dim {
            Some(d) => d,
            None if self.d_model.is_multiple_of(self.n_heads) => self.d_model / self.n_heads,
            None => {
                return Err(Error::config(
                    "n_heads",
                    format!(
                        "a divisor of d_model ({}) when head_dim is unset (or set head_dim)",
                        self.d_model
                    ),
                    self.n_heads,
                ))
            }
        };
        if !SUPPORTED_HEAD_DIMS.contains(&head_dim) {
            return Err(Error::config(
                "head_dim",
                format!("one the attention kernels support: {SUPPORTED_HEAD_DIMS:?}"),
                head_dim,
            ));
        }
        Ok((n_kv, head_dim))
    }

    /// The module, or what is wrong with the configuration.
    ///
    /// # Errors
    ///
    /// As [`resolved`](Self::resolved).
    pub fn try_init<B: FlashAttentionBackend>(
        &self,
        device: &B::Device,
    ) -> Result<DistFlashAttention<B>, Error> {
        let (n_kv_heads, head_dim) = self.resolved()?;
        let linear = |d_in: usize, d_out: usize| {
            LinearConfig::new(d_in, d_out)
                .with_bias(false)
                .with_initializer(self.initializer.clone())
                .init(device)
        };
        Ok(DistFlashAttention {
            query: linear(self.d_model, self.n_heads * head_dim),
            key: linear(self.d_model, n_kv_heads * head_dim),
            value: linear(self.d_model, n_kv_heads * head_dim),
            output: linear(self.n_heads * head_dim, self.d_model),
            n_heads: self.n_heads,
            n_kv_heads,
            head_dim,
            options: self.options(),
            rope: self.rope.clone(),
            counter: ForwardCounter::default(),
        })
    }

    /// The module.
    ///
    /// # Panics
    ///
    /// With the configuration error where [`try_init`](Self::try_init) returns one.
    pub fn init<B: FlashAttentionBackend>(&self, device: &B::Device) -> DistFlashAttention<B> {
        self.try_init(device).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The attention options this configuration means (causal order and the window as the mask,
    /// the default scale, determinism): the value the module carries to the kernels.
    pub fn options(&self) -> FlashAttentionOptions {
        let mask = Mask {
            causal: self.causal,
            window: self.window,
            ..Mask::none()
        };
        FlashAttentionOptions::masked(mask).with_deterministic(self.deterministic)
    }
}

/// Multi-head self-attention over `[batch, seq, d_model]` computed by this project's
/// memory-efficient kernels, locally or sequence-parallel (see [`AttentionContext`]).
///
/// Its mask is configuration (causal, a sliding window) plus, per call, optional packed
/// documents ([`AttentionInput::documents`]). Rotary positions
/// stay global across packed documents (they do not restart at each document): attention
/// scores depend only on the distance between positions, which is the same either way.
#[derive(Module, Debug)]
pub struct DistFlashAttention<B: Backend> {
    /// Query projection `[d_model, n_heads * head_dim]`.
    pub query: Linear<B>,
    /// Key projection `[d_model, n_kv_heads * head_dim]`.
    pub key: Linear<B>,
    /// Value projection `[d_model, n_kv_heads * head_dim]`.
    pub value: Linear<B>,
    /// Output projection `[n_heads * head_dim, d_model]`.
    pub output: Linear<B>,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// What its attention computes: the configured mask (causal order, a sliding window; each
    /// call adds its documents), the scale and determinism (see
    /// [`DistFlashAttentionConfig::options`]).
    #[module(skip)]
    pub options: FlashAttentionOptions,
    /// Rotary embedding.
    #[module(skip)]
    pub rope: RopeConfig,
    /// How many times this module (and its clones) computed attention's forward.
    #[module(skip)]
    pub counter: ForwardCounter,
}

/// Queries, keys and values `[batch, heads, seq, head_dim]` after the rotary embedding.
#[derive(Debug, Clone)]
pub(crate) struct Projected<B: FlashAttentionBackend> {
    pub q: Tensor<B, 4>,
    pub k: Tensor<B, 4>,
    pub v: Tensor<B, 4>,
    pub rope: RotaryTables<B>,
}

impl<B: FlashAttentionBackend> DistFlashAttention<B> {
    /// Attention of `input` (the whole sequence, or this rank's shard, and the documents packed
    /// into it if any; a plain tensor converts into an input without documents).
    ///
    /// # Shapes
    ///
    /// - input.x: `[batch, seq, d_model]`
    /// - input.documents: boundaries of the whole sequence (`seq` positions locally;
    ///   `world_size * seq` when sharded), one list for every batch row or one per batch row
    /// - output: `[batch, seq, d_model]`
    ///
    /// # Panics
    ///
    /// With a clear message where [`try_forward`](Self::try_forward) returns an error.
    pub fn forward(
        &self,
        input: impl Into<AttentionInput<B>>,
        context: &AttentionContext<B>,
    ) -> Tensor<B, 3> {
        self.try_forward(input, context)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`forward`](Self::forward), or why it cannot run. When sharded and this rank refuses its
    /// input, the other ranks are told, so their attention fails at once too.
    ///
    /// # Shapes
    ///
    /// As [`forward`](Self::forward).
    ///
    /// # Errors
    ///
    /// - [`Error::Shape`] when `x` is not `[batch, seq, d_model]` with `batch` and
    ///   `seq` at least 1; [`Error::DType`] when it is not of the weights' float type.
    /// - [`Error::Device`] when `x` is not on the weights' device, or (sharded) not
    ///   on the device of this rank of the context's group.
    /// - [`Error::Layout`] (sharded) when the schedule's layout cannot split shards
    ///   of length `seq` (zigzag: an odd length).
    /// - [`Error::Kernel`] with
    ///   [`KernelError::BadMask`](crate::kernels::KernelError::BadMask) when the documents do not
    ///   end at the sequence's length (`seq`, or `world_size * seq` sharded) or have neither one
    ///   list nor one per batch row.
    /// - [`Error::Kernel`] or [`Error::DType`] when attention refuses the projected heads (see
    ///   [`crate::flash_attention`]: a float type it does not run, or a call beyond the
    ///   device's limits).
    /// - Sharded, the other errors of [`crate::sequence_parallel::sequence_parallel_attention`]:
    ///   [`Error::RanksDisagree`] or [`Error::PeerRefused`] when the ranks disagree or another
    ///   rank refused its input, and the collective layer's errors
    ///   ([`Error::is_collective`]) when moving tensors between the ranks fails.
    pub fn try_forward(
        &self,
        input: impl Into<AttentionInput<B>>,
        context: &AttentionContext<B>,
    ) -> Result<Tensor<B, 3>, Error> {
        let AttentionInput { x, documents } = input.into();
        let documents = documents.as_ref();
        self.check_input(&x, context, documents)?;
        let projected = self.project(x, context, documents);
        let (out, _) = self.attend(&projected, context, documents)?;
        Ok(linear(&self.output, merge_heads(out)))
    }

    /// Refuses, before any work, an input that is not `[batch > 0, seq > 0, d_model]` of the
    /// weights' float type on the weights' device, not on the device of `context`'s group, or of a
    /// length the sharded layout cannot split (zigzag: odd), and documents that do not split the
    /// whole sequence of this batch.
    /// Sharded, the other ranks are told, so that their attention fails at once too.
    pub(crate) fn check_input(
        &self,
        x: &Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> Result<(), Error> {
        let refused = self.input_problem(x, context, documents);
        if let (Err(_), AttentionContext::Sharded { group, .. }) = (&refused, context) {
            announce_refusal(group);
        }
        refused
    }

    fn input_problem(
        &self,
        x: &Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> Result<(), Error> {
        let weight = self.query.weight.val();
        let d_model = weight.dims()[0];
        let dims = x.dims();
        if dims[2] != d_model || dims[0] == 0 || dims[1] == 0 {
            return Err(Error::Shape {
                tensor: "the attention input".into(),
                expected: format!("[batch, seq, {d_model}] with batch and seq at least 1"),
                got: format!("{dims:?}"),
            });
        }
        if x.dtype() != weight.dtype() {
            return Err(Error::DType {
                tensor: "the attention input".into(),
                expected: format!(
                    "the module weights' float type {:?} (cast one to the other)",
                    weight.dtype()
                ),
                got: format!("{:?}", x.dtype()),
            });
        }
        if x.device() != weight.device() {
            return Err(Error::Device {
                tensor: "the attention input".into(),
                expected: format!("the module weights' device {:?}", weight.device()),
                got: format!("{:?}", x.device()),
            });
        }
        context.positions(dims[1], self.options_with(documents))?;
        if let Some(documents) = documents {
            self.documents_problem(dims, context, documents)?;
        }
        if let AttentionContext::Sharded { group, .. } = context {
            if B::inner_device(&x.device()) != *group.device() {
                return Err(Error::Device {
                    tensor: "the attention input".into(),
                    expected: format!(
                        "{:?}, the device rank {} of its group computes on",
                        group.device(),
                        group.rank()
                    ),
                    got: format!("{:?}", x.device()),
                });
            }
        }
        Ok(())
    }

    /// Errors unless `documents` split the whole sequence of an input of `[batch, seq, _]`
    /// (`seq` positions locally, `world_size * seq` sharded) into documents given once or per
    /// batch row: the checks of a one-shot call over the whole sequence.
    fn documents_problem(
        &self,
        [batch, seq, _]: [usize; 3],
        context: &AttentionContext<B>,
        documents: &Documents,
    ) -> Result<(), Error> {
        let whole = match context {
            AttentionContext::Local => seq,
            AttentionContext::Sharded { group, .. } => group.world_size() * seq,
        };
        let q = [batch, self.n_heads, whole, self.head_dim];
        let kv = [batch, self.n_kv_heads, whole, self.head_dim];
        let dims = crate::options::check_shapes(&q, &kv, &kv)?;
        self.options_with(Some(documents))
            .check_one_shot_mask(&dims)
    }

    /// The options of this module's attention (its configured mask, no documents).
    pub fn options(&self) -> FlashAttentionOptions {
        self.options.clone()
    }

    /// The options of one call of this module's attention, with that call's documents.
    pub(crate) fn options_with(&self, documents: Option<&Documents>) -> FlashAttentionOptions {
        let mask = Mask {
            documents: documents.cloned(),
            ..self.options.mask.clone()
        };
        self.options.clone().with_mask(mask)
    }

    /// Projects `x` to rotated queries and keys and to values, rotated at the positions of the
    /// layout attention with `documents` runs in (global positions, not restarted per document).
    pub(crate) fn project(
        &self,
        x: Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> Projected<B> {
        let rope = self.rotary(&x, context, documents);
        let all = HeadGroup {
            query: 0..self.n_heads,
            key_value: 0..self.n_kv_heads,
        };
        self.project_heads(x, &rope, &all)
    }

    /// The rotary tables of an input `x` `[batch, seq, d_model]`: the positions of the layout
    /// attention with `documents` runs in.
    pub(crate) fn rotary(
        &self,
        x: &Tensor<B, 3>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> RotaryTables<B> {
        let [_, seq, _] = x.dims();
        let options = self.options_with(documents);
        // A length the layout cannot split is refused by `check_input` before this runs.
        let positions = (context.positions(seq, options)).unwrap_or_default();
        RotaryTables::at_positions(
            &self.rope,
            self.head_dim,
            &positions,
            x.dtype(),
            &x.device(),
        )
    }

    /// The rotated queries and keys and the values of `group`'s heads: `x` times column slices
    /// of the projection weights (all of each weight for a group of every head).
    pub(crate) fn project_heads(
        &self,
        x: Tensor<B, 3>,
        rope: &RotaryTables<B>,
        group: &HeadGroup,
    ) -> Projected<B> {
        let heads = |layer: &Linear<B>, heads: &Range<usize>| {
            split_heads(
                project(x.clone(), self.head_columns(layer, heads)),
                heads.len(),
            )
        };
        let q = heads(&self.query, &group.query);
        let k = heads(&self.key, &group.key_value);
        let v = heads(&self.value, &group.key_value);
        Projected {
            q: rope.apply(q),
            k: rope.apply(k),
            v,
            rope: rope.clone(),
        }
    }

    /// The columns of a query, key or value projection's weight `[d_model, heads * head_dim]`
    /// that project `heads` (a view).
    pub(crate) fn head_columns(&self, layer: &Linear<B>, heads: &Range<usize>) -> Tensor<B, 2> {
        let weight = layer.weight.val();
        let [d_in, _] = weight.dims();
        weight.slice([0..d_in, HeadGroup::columns(heads, self.head_dim)])
    }

    /// `(O, lse)` of the projected heads, within `documents` when given; counts one forward
    /// computation.
    pub(crate) fn attend(
        &self,
        p: &Projected<B>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> Result<(Tensor<B, 4>, Tensor<B, 3>), Error> {
        self.counter.record();
        self.attend_heads(p, context, documents)
    }

    /// `(O, lse)` of the projected heads (all, or a group of them), within `documents` when
    /// given, without counting a forward computation.
    pub(crate) fn attend_heads(
        &self,
        p: &Projected<B>,
        context: &AttentionContext<B>,
        documents: Option<&Documents>,
    ) -> Result<(Tensor<B, 4>, Tensor<B, 3>), Error> {
        let (q, k, v) = (p.q.clone(), p.k.clone(), p.v.clone());
        let options = self.options_with(documents);
        match context.sequence_parallel_options(options.clone()) {
            None => Ok(flash_attention_with_lse(q, k, v, options)?),
            Some((group, options)) => {
                sequence_parallel_attention_with_lse(q, k, v, group, &options)
            }
        }
    }
}

/// `[batch, seq, heads * head_dim]` -> `[batch, heads, seq, head_dim]`.
pub(crate) fn split_heads<B: Backend>(x: Tensor<B, 3>, heads: usize) -> Tensor<B, 4> {
    let [batch, seq, width] = x.dims();
    x.reshape([batch, seq, heads, width / heads])
        .swap_dims(1, 2)
}

/// `[batch, heads, seq, head_dim]` -> `[batch, seq, heads * head_dim]`.
pub(crate) fn merge_heads<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 3> {
    let [batch, heads, seq, head_dim] = x.dims();
    x.swap_dims(1, 2).reshape([batch, seq, heads * head_dim])
}
