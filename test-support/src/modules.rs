//! Module helpers shared by the model tests: reading every weight and whether it requires
//! gradients.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// Shape and values of one float parameter.
pub type ParamValues = (Vec<usize>, Vec<f32>);

/// Shape and values of every float parameter, in visiting order.
struct Collect(Vec<ParamValues>);

impl<B: Backend> ModuleVisitor<B> for Collect {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val();
        let dims = value.dims().to_vec();
        let values = value.into_data().convert::<f32>().to_vec::<f32>().unwrap();
        self.0.push((dims, values));
    }
}

/// Shape and values of every float parameter of `module`, in visiting order.
pub fn float_params<B: Backend, M: Module<B>>(module: &M) -> Vec<ParamValues> {
    let mut collect = Collect(Vec::new());
    module.visit(&mut collect);
    collect.0
}

/// Whether each float parameter requires gradients, in visiting order.
struct RequireGradFlags(Vec<bool>);

impl<B: Backend> ModuleVisitor<B> for RequireGradFlags {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.0.push(param.val().is_require_grad());
    }
}

/// Whether each float parameter of `module` requires gradients, in visiting order.
pub fn require_grad_flags<B: Backend, M: Module<B>>(module: &M) -> Vec<bool> {
    let mut flags = RequireGradFlags(Vec::new());
    module.visit(&mut flags);
    flags.0
}
