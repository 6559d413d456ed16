//! Marking a model's parameters for gradient sync inside a burn-train step.
//!
//! Why this exists: burn-train's `SingleDeviceTrainingStrategy::fit` starts with
//! `learner.fork(device)`, and `Param::fork` does `tensor.to_device(device).detach()` and then
//! `require_grad()`. `detach` builds a fresh autodiff node, so the mark that `Ddp::prepare` put
//! on every parameter (`Tensor::set_distributed`) is gone before the first step. Without it
//! Burn's backward never calls the sync hooks: each rank would silently train on its own
//! gradients. Burn's optimizers only re-mark parameters that were marked when they stepped
//! (`burn-optim`'s `OptimizerAdaptor` checks `is_distributed()`), so the marks never come back.
//! (burn-train's own DDP strategy re-marks after the fork with `Learner::grad_sharded`; the
//! single-device strategy has no such step.)
//!
//! The fix is to mark (`burn_dist::mark_for_sync`) in `TrainStep::step`, on every step, the
//! clone of the model that runs the forward pass: marking keeps each parameter's autodiff node
//! id, so the gradients that `TrainOutput::new` collects are keyed exactly as without it.

pub use burn_dist::mark_for_sync;
