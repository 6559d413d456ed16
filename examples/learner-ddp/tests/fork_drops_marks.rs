//! Why `TrainStep::step` marks the model: burn-train's single-device strategy forks the model
//! before training, and Burn's fork drops the sync marks that `Ddp::prepare` set.

use burn::backend::Autodiff;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use burn_dist::DistributedBackend;
use burn_flex::{Flex, FlexDevice};
use learner_ddp::model::Regressor;
use learner_ddp::sync::mark_for_sync;

type B = Autodiff<DistributedBackend<Flex>>;

/// Whether each float parameter is marked for sync, in visit order.
fn marks<M: Module<B>>(model: &M) -> Vec<bool> {
    struct Marks(Vec<bool>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Marks {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.val().is_distributed());
        }
    }
    let mut marks = Marks(Vec::new());
    model.visit(&mut marks);
    marks.0
}

#[test]
fn the_learners_fork_drops_the_sync_marks_and_mark_for_sync_restores_them() {
    let model = mark_for_sync(Regressor::<B>::new(1, &FlexDevice));
    let count = marks(&model).len();
    assert!(count > 0);
    assert_eq!(marks(&model), vec![true; count]);
    // What `SingleDeviceTrainingStrategy::fit` does before its first step.
    let forked = model.fork(&FlexDevice);
    assert_eq!(
        marks(&forked),
        vec![false; count],
        "Burn's fork kept the marks"
    );
    assert_eq!(marks(&mark_for_sync(forked)), vec![true; count]);
}
