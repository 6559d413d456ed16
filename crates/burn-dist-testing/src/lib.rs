//! Scaffolding shared by burn-dist's tests, benches and examples: the models of
//! `burn-dist-models`, parameter extraction, the synthetic training loop with any optimizer
//! (Burn's or ZeroAdam, errors as values), and fault injection. Not published: the published
//! crates use it only as a dev-dependency.

use burn::tensor::ElementConversion;
pub use burn_dist_models::*;

#[cfg(feature = "device")]
pub mod one_device;
#[cfg(feature = "device")]
pub mod placed;
pub mod roll_back;

/// Every float tensor's values as f32, in visit order.
pub use burn_dist_models::step::float_params as parameters;

/// Which synthetic task [`train_synthetic`] trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Synthetic {
    /// [`MLP_SIZES`] on rows of 16 features.
    Mlp,
    /// A [`TransformerBlock`] of width [`TRANSFORMER_WIDTH`] on sequences of [`SEQUENCE`].
    Transformer,
    /// A [`ConvNorm`] (convolution, batch normalization, linear head) on [`CONV_INPUT`] images.
    ConvBatchNorm,
    /// An [`RmsMlp`] (RMS normalization in front of the MLP) on rows of 16 features.
    RmsNorm,
}

pub const TRANSFORMER_WIDTH: usize = 16;
pub const SEQUENCE: usize = 5;

/// Trains `task` with Adam on synthetic regression data for `steps` steps: this rank's shard of
/// each global batch, split into the `ddp`'s accumulation micro-batches, MSE loss. Calls
/// `on_step(step, local loss)` and returns the final parameters. The example and the
/// equivalence tests run exactly this loop.
#[allow(clippy::too_many_arguments)] // a test helper: each argument is one knob of the run
pub fn train_synthetic<B: burn_dist::DistributedAutodiff>(
    ddp: &mut burn_dist::Ddp,
    task: Synthetic,
    optimizer: &impl OptimizerKind,
    steps: usize,
    global_batch: usize,
    lr: f64,
    device: &B::Device,
    on_step: impl FnMut(usize, f32),
) -> burn_dist::Result<Vec<Vec<f32>>> {
    let [input, .., output] = MLP_SIZES;
    let (width, seq) = (TRANSFORMER_WIDTH, SEQUENCE);
    match task {
        Synthetic::Mlp => {
            let model = Mlp::<B>::new(&MLP_SIZES, 7, device);
            train_loop(
                ddp,
                model,
                optimizer,
                steps,
                global_batch,
                lr,
                on_step,
                |model, step, rows| {
                    let x = synthetic_rows::<B, 2>(
                        0,
                        step,
                        [global_batch, input],
                        rows.clone(),
                        device,
                    );
                    let y = synthetic_rows::<B, 2>(1, step, [global_batch, output], rows, device);
                    (model.forward(x) - y).powi_scalar(2).mean()
                },
            )
        }
        Synthetic::ConvBatchNorm => {
            let model = ConvNorm::<B>::new(13, device);
            let [channels, height, width] = CONV_INPUT;
            train_loop(
                ddp,
                model,
                optimizer,
                steps,
                global_batch,
                lr,
                on_step,
                |model, step, rows| {
                    let x = synthetic_rows::<B, 4>(
                        4,
                        step,
                        [global_batch, channels, height, width],
                        rows.clone(),
                        device,
                    );
                    let y =
                        synthetic_rows::<B, 2>(5, step, [global_batch, CONV_OUTPUT], rows, device);
                    (model.forward(x) - y).powi_scalar(2).mean()
                },
            )
        }
        Synthetic::RmsNorm => {
            let model = RmsMlp::<B>::new(17, device);
            train_loop(
                ddp,
                model,
                optimizer,
                steps,
                global_batch,
                lr,
                on_step,
                |model, step, rows| {
                    let x = synthetic_rows::<B, 2>(
                        6,
                        step,
                        [global_batch, input],
                        rows.clone(),
                        device,
                    );
                    let y = synthetic_rows::<B, 2>(7, step, [global_batch, output], rows, device);
                    (model.forward(x) - y).powi_scalar(2).mean()
                },
            )
        }
        Synthetic::Transformer => {
            let model = TransformerBlock::<B>::new(width, 2, 11, device);
            train_loop(
                ddp,
                model,
                optimizer,
                steps,
                global_batch,
                lr,
                on_step,
                |model, step, rows| {
                    let x = synthetic_rows::<B, 3>(
                        2,
                        step,
                        [global_batch, seq, width],
                        rows.clone(),
                        device,
                    );
                    let y =
                        synthetic_rows::<B, 3>(3, step, [global_batch, seq, width], rows, device);
                    (model.forward(x) - y).powi_scalar(2).mean()
                },
            )
        }
    }
}

#[allow(clippy::too_many_arguments)] // as train_synthetic
fn train_loop<B, M>(
    ddp: &mut burn_dist::Ddp,
    model: M,
    optimizer: &impl OptimizerKind,
    steps: usize,
    global_batch: usize,
    lr: f64,
    mut on_step: impl FnMut(usize, f32),
    loss: impl Fn(&M, usize, std::ops::Range<usize>) -> burn::tensor::Tensor<B, 1>,
) -> burn_dist::Result<Vec<Vec<f32>>>
where
    B: burn_dist::DistributedAutodiff,
    M: burn::module::AutodiffModule<B> + 'static,
{
    let (rank, world, micro) = (ddp.rank(), ddp.world_size(), ddp.accumulation_steps());
    // Replicated or sharded (ZeRO stage 3), as the backend's mode says.
    let mut model = B::prepare_model(ddp, model)?;
    let mut optim = optimizer.build::<B, M>(ddp, &model);
    for step in 0..steps {
        let shard = shard_rows(global_batch, rank, world);
        let per_micro = shard.len() / micro;
        let mut total = 0.0;
        for m in 0..micro {
            let rows = shard.start + m * per_micro..shard.start + (m + 1) * per_micro;
            model = ddp.mark(model);
            let loss = loss(&model, step, rows);
            total += loss.clone().into_scalar().elem::<f32>();
            if let Some(grads) = ddp.backward(loss, &model)? {
                model = optim.step(ddp, lr, model, grads)?;
            }
        }
        on_step(step, total / micro as f32);
    }
    Ok(parameters::<B, _>(&model))
}

/// One optimizer step, whatever the optimizer: Burn's (through [`BurnOptimizer`]) or a
/// sharded one that needs the `Ddp`.
pub trait Stepper<B: burn::tensor::backend::AutodiffBackend, M: burn::module::AutodiffModule<B>> {
    fn step(
        &mut self,
        ddp: &burn_dist::Ddp,
        lr: f64,
        model: M,
        grads: burn::optim::GradientsParams,
    ) -> burn_dist::Result<M>;
}

/// Builds the optimizer of a training run once the model's type is known.
pub trait OptimizerKind {
    fn build<B, M>(&self, ddp: &burn_dist::Ddp, model: &M) -> Box<dyn Stepper<B, M>>
    where
        B: burn::tensor::backend::AutodiffBackend,
        M: burn::module::AutodiffModule<B> + 'static;
}

/// A Burn optimizer as a [`Stepper`].
pub struct BurnOptimizer<O>(pub O);

impl<B, M, O> Stepper<B, M> for BurnOptimizer<O>
where
    B: burn::tensor::backend::AutodiffBackend,
    M: burn::module::AutodiffModule<B>,
    O: burn::optim::Optimizer<M, B>,
{
    fn step(
        &mut self,
        _ddp: &burn_dist::Ddp,
        lr: f64,
        model: M,
        grads: burn::optim::GradientsParams,
    ) -> burn_dist::Result<M> {
        Ok(self.0.step(lr, model, grads))
    }
}

/// Burn's `Adam` with its defaults.
pub struct BurnAdam;

impl OptimizerKind for BurnAdam {
    fn build<B, M>(&self, _ddp: &burn_dist::Ddp, _model: &M) -> Box<dyn Stepper<B, M>>
    where
        B: burn::tensor::backend::AutodiffBackend,
        M: burn::module::AutodiffModule<B> + 'static,
    {
        Box::new(BurnOptimizer(burn::optim::AdamConfig::new().init::<B, M>()))
    }
}

/// Burn's `AdamW` with its defaults.
pub struct BurnAdamW;

impl OptimizerKind for BurnAdamW {
    fn build<B, M>(&self, _ddp: &burn_dist::Ddp, _model: &M) -> Box<dyn Stepper<B, M>>
    where
        B: burn::tensor::backend::AutodiffBackend,
        M: burn::module::AutodiffModule<B> + 'static,
    {
        Box::new(BurnOptimizer(
            burn::optim::AdamWConfig::new().init::<B, M>(),
        ))
    }
}

/// Small buckets (1 KiB first, 4 KiB after) and `accumulation` micro-batches: the synthetic
/// models then span several buckets, and ZeRO's gradient segments cross shard boundaries.
pub fn small_bucket_config(accumulation: usize) -> burn_dist::DdpConfig {
    let buckets = burn_dist::BucketConfig::new()
        .with_first_bucket_bytes(1024)
        .with_bucket_bytes(4096);
    burn_dist::DdpConfig::new()
        .with_buckets(buckets)
        .with_accumulation_steps(accumulation)
}

/// Trains `task` with `world` in-process ranks (threads, host collectives) and returns every
/// rank's final parameters: the common body of the equivalence tests.
#[allow(clippy::too_many_arguments)] // as train_synthetic
pub fn train_ranks<B: burn_dist::DistributedAutodiff>(
    world: usize,
    config: &burn_dist::DdpConfig,
    task: Synthetic,
    optimizer: &(impl OptimizerKind + Sync),
    steps: usize,
    global_batch: usize,
    lr: f64,
    device: &B::Device,
) -> Vec<Vec<Vec<f32>>> {
    let make = |comm| burn_dist::Ddp::for_thread(comm, config.clone());
    train_ranks_with::<B>(
        world,
        make,
        task,
        optimizer,
        steps,
        global_batch,
        lr,
        device,
    )
    .into_iter()
    .map(|(params, _)| params)
    .collect()
}

/// [`train_ranks`] with each rank's `Ddp` built by `make_ddp` from its communicator (the device
/// path's, for instance); returns every rank's final parameters and its reducer's counters.
#[allow(clippy::too_many_arguments)] // as train_synthetic
pub fn train_ranks_with<B: burn_dist::DistributedAutodiff>(
    world: usize,
    make_ddp: impl Fn(burn_dist_comm::HostCommunicator) -> burn_dist::Ddp + Sync,
    task: Synthetic,
    optimizer: &(impl OptimizerKind + Sync),
    steps: usize,
    global_batch: usize,
    lr: f64,
    device: &B::Device,
) -> Vec<(Vec<Vec<f32>>, burn_dist::ReducerStats)> {
    let comms = burn_dist_comm::HostCommunicator::local_group(
        world,
        &burn_dist_comm::CommConfig::default(),
    );
    burn_dist_comm::testing::run_ranks(comms, |_, comm| {
        let mut ddp = make_ddp(comm);
        let params = train_synthetic::<B>(
            &mut ddp,
            task,
            optimizer,
            steps,
            global_batch,
            lr,
            device,
            |_, _| {},
        )
        .expect("training");
        (params, ddp.stats())
    })
}

/// Two MLP branches; virtual rank `v` of `virtual_ranks` uses the second one unless
/// `unused_on(v)`. Trained 3 Adam steps (lr 1e-2) on a batch of 12 rows with `world` real ranks
/// (each a shard of virtual ranks, its `Ddp` built by `make_ddp`): with `world = 1` this is the
/// one-process reference, whose loss is the mean of the virtual ranks' losses. Returns, per
/// rank, the final parameters and whether the second branch ever got a gradient.
pub fn train_with_unused<B: burn::tensor::backend::AutodiffBackend>(
    world: usize,
    virtual_ranks: usize,
    unused_on: &(dyn Fn(usize) -> bool + Sync),
    make_ddp: impl Fn(burn_dist_comm::HostCommunicator) -> burn_dist::Ddp + Sync,
    device: &B::Device,
) -> Vec<(Vec<Vec<f32>>, bool)> {
    use burn::optim::Optimizer;
    use burn::tensor::Tensor;
    const BATCH: usize = 12;
    let comms = burn_dist_comm::HostCommunicator::local_group(
        world,
        &burn_dist_comm::CommConfig::default(),
    );
    burn_dist_comm::testing::run_ranks(comms, |rank, comm| {
        let mut ddp = make_ddp(comm);
        let branches: Vec<Mlp<B>> = (0..2)
            .map(|i| Mlp::new(&MLP_SIZES, 7 + i, device))
            .collect();
        let mut model = ddp.prepare(branches).expect("prepare");
        let mut optim = burn::optim::AdamConfig::new().init();
        let mut second_got_grad = false;
        let per_rank = virtual_ranks / world;
        for step in 0..3 {
            let losses: Vec<Tensor<B, 1>> = (rank * per_rank..(rank + 1) * per_rank)
                .map(|v| {
                    let rows = shard_rows(BATCH, v, virtual_ranks);
                    let x = || {
                        synthetic_rows::<B, 2>(0, step, [BATCH, MLP_SIZES[0]], rows.clone(), device)
                    };
                    let mut out = model[0].forward(x());
                    if !unused_on(v) {
                        out = out + model[1].forward(x());
                    }
                    out.powi_scalar(2).mean()
                })
                .collect();
            let loss = Tensor::cat(losses, 0).mean();
            let grads = ddp
                .backward(loss, &model)
                .expect("backward")
                .expect("a window of one");
            second_got_grad |= grads
                .get::<B::InnerBackend, 2>(model[1].layers[0].weight.id)
                .is_some();
            model = optim.step(1e-2, model, grads);
        }
        (parameters::<B, _>(&model), second_got_grad)
    })
}

/// Fault injection for the overflow tests: an overflow on this rank alone, created after the
/// gradients were averaged over ranks, as if only this rank's own arithmetic had overflowed.
/// Adds `value` (infinity, or a finite value whose square overflows f32) to every gradient in
/// `grads`, or, under ZeRO stage 2 (where `grads` is empty and the gradient is this rank's
/// reduced shard), to the shard's first element. The average cannot spread it: only a
/// cross-rank found-inf agreement can tell the other ranks. Panics when a stage-2 rank has no
/// finished shard waiting.
pub fn overflow_on_this_rank<B, M>(
    ddp: &burn_dist::Ddp,
    grads: burn::optim::GradientsParams,
    model: &M,
    value: f32,
) -> burn::optim::GradientsParams
where
    B: burn::tensor::backend::AutodiffBackend,
    M: burn::module::AutodiffModule<B>,
{
    if ddp.poison_gradient_shard(value) {
        return grads;
    }
    let mut overflow = Overflow::<B> {
        grads,
        value,
        _b: std::marker::PhantomData,
    };
    model.visit(&mut overflow);
    overflow.grads
}

/// Adds `value` to every gradient of a module.
struct Overflow<B> {
    grads: burn::optim::GradientsParams,
    value: f32,
    _b: std::marker::PhantomData<B>,
}

impl<B: burn::tensor::backend::AutodiffBackend> burn::module::ModuleVisitor<B> for Overflow<B> {
    fn visit_float<const D: usize>(
        &mut self,
        param: &burn::module::Param<burn::tensor::Tensor<B, D>>,
    ) {
        if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            self.grads.register(param.id, grad.add_scalar(self.value));
        }
    }
}

/// ZeroAdam, as the harness builds and steps it.
impl OptimizerKind for burn_dist_zero::ZeroAdamConfig {
    fn build<B, M>(&self, ddp: &burn_dist::Ddp, model: &M) -> Box<dyn Stepper<B, M>>
    where
        B: burn::tensor::backend::AutodiffBackend,
        M: burn::module::AutodiffModule<B> + 'static,
    {
        Box::new(
            self.init::<B, M>(ddp, model)
                .expect("ZeroAdam for a prepared model"),
        )
    }
}

impl<B, M> Stepper<B, M> for burn_dist_zero::ZeroAdam
where
    B: burn::tensor::backend::AutodiffBackend,
    M: burn::module::AutodiffModule<B>,
{
    fn step(
        &mut self,
        ddp: &burn_dist::Ddp,
        lr: f64,
        model: M,
        grads: burn::optim::GradientsParams,
    ) -> burn_dist::Result<M> {
        burn_dist_zero::ZeroAdam::step(self, lr, model, grads, ddp)
            .map(|(model, _)| model)
            .map_err(|e| burn_dist::DistError::Usage(e.to_string()))
    }
}

/// One ZeroAdam step of the test [`Mlp`] at learning rate `lr`: this rank's rows of step
/// `step`'s global batch of `global_batch` synthetic rows, in the model's `dtype`, the loss the
/// mean square error.
pub fn zero_mlp_step<B: burn::tensor::backend::AutodiffBackend>(
    ddp: &mut burn_dist::Ddp,
    model: Mlp<B>,
    zero: &mut burn_dist_zero::ZeroAdam,
    (rank, world, step): (usize, usize, usize),
    (global_batch, lr): (usize, f64),
    dtype: burn::tensor::FloatDType,
    device: &B::Device,
) -> Mlp<B> {
    let [input, .., output] = MLP_SIZES;
    let rows = shard_rows(global_batch, rank, world);
    let x = synthetic_rows::<B, 2>(0, step, [global_batch, input], rows.clone(), device);
    let y = synthetic_rows::<B, 2>(1, step, [global_batch, output], rows, device);
    let loss = (model.forward(x.cast(dtype)) - y.cast(dtype))
        .powi_scalar(2)
        .mean();
    let grads = ddp.backward(loss, &model).unwrap().unwrap();
    zero.step(lr, model, grads, ddp).unwrap().0
}
