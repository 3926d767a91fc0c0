//! Module helpers shared by the model tests: marking weights trainable, reading every weight.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// Marks every weight as needing a gradient (cloning a module of an inner backend forgets it).
pub struct RequireGrad;

impl<B: Backend> ModuleMapper<B> for RequireGrad {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        param.set_require_grad(true)
    }
}

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
