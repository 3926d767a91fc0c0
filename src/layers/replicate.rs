//! [`replicate`]: one trainable copy of a module per rank, with the same weights on every rank.

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;

/// One trainable copy of `module` per device: copy `r` lives on `devices[r]` and goes to rank
/// `r` (move it to the rank's thread). Every copy holds exactly the weights `module` holds,
/// requires gradients where `module` does (new modules: every float weight), and has weights of
/// its own in the autodiff graph, so each rank's backward fills its own gradients and each rank's
/// optimizer updates its own copy.
///
/// Call it once, on the module all ranks start from. Burn initialises a module's weights
/// lazily, at first use, and a clone made before that draws its own random values: copying a
/// freshly initialised module with `clone` or `Module::from_inner` gives every rank different
/// weights. This function first fixes every weight of `module` (initialising the lazy ones, in
/// `module` itself), then copies; cloning `module` afterwards also gives the same weights.
///
/// ```
/// # use burn::backend::{Autodiff, NdArray};
/// use burn_distflash::layers::replicate;
/// use burn_distflash::DistFlashAttentionConfig;
///
/// type B = Autodiff<NdArray<f32>>;
/// let device = Default::default();
/// let model = DistFlashAttentionConfig::new(64, 4).init::<B>(&device);
/// let per_rank = replicate(&model, &[device; 4]);
/// assert_eq!(per_rank.len(), 4);
/// ```
pub fn replicate<B, M>(module: &M, devices: &[B::Device]) -> Vec<M>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    // Reading every weight initialises the lazy ones, in `module` itself. The flags are taken
    // from the weights, not from `valid`, which forgets a lazy weight's `set_require_grad`.
    let mut flags = RequireGradFlags(Vec::new());
    module.visit(&mut flags);
    // `from_inner` makes new leaves of the fixed values; `fork` moves them to the rank's
    // device as leaves of their own.
    devices
        .iter()
        .map(|device| {
            M::from_inner(module.valid())
                .fork(device)
                .map(&mut SetRequireGrad(flags.0.iter()))
        })
        .collect()
}

/// Whether each float weight requires gradients, in visiting order.
struct RequireGradFlags(Vec<bool>);

impl<B: Backend> ModuleVisitor<B> for RequireGradFlags {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.0.push(param.val().is_require_grad());
    }
}

/// Sets each float weight's gradient requirement from a list in visiting order.
struct SetRequireGrad<'a>(core::slice::Iter<'a, bool>);

impl<B: Backend> ModuleMapper<B> for SetRequireGrad<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let require_grad = *self.0.next().expect("a copy has the source's weights");
        param.set_require_grad(require_grad)
    }
}
