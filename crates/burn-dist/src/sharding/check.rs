//! The check that a model still holds its shards: every sharded parameter a whole handle of its
//! own index in this rank's [`ParamShards`], not a tensor written over it (`ParamShards::check_model`).

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use super::shards::{Holding, ParamShards};

/// The first sharded parameter of `model` that is not a whole handle of its own index in
/// `shards`.
pub(super) fn first_replaced<B: AutodiffBackend, M: Module<B>>(
    shards: &ParamShards,
    model: &M,
) -> Option<usize> {
    let mut check = CheckHandles {
        shards,
        found: None,
    };
    model.visit(&mut check);
    check.found
}

struct CheckHandles<'a> {
    shards: &'a ParamShards,
    found: Option<usize>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for CheckHandles<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.found.is_some() {
            return;
        }
        let Some(index) = self.shards.params().iter().position(|p| p.id == param.id) else {
            return;
        };
        let primitive = param.val().inner().into_primitive().tensor();
        let holds = self.shards.holding(&primitive);
        // A handle of another `ParamShards` is one of an earlier preparation of the model, whose
        // pieces this rank's optimizer no longer steps.
        let own = Holding::Handle {
            index,
            whole: true,
            shards: self.shards as *const ParamShards as usize,
        };
        if holds != Some(own) {
            self.found = Some(index);
        }
    }
}
