//! ZeroAdam placed beside a model on a burn-cubecl device: its state in device memory
//! (`ZeroAdam::on_device`) or offloaded to the host (`ZeroAdam::offloaded`), on thread ranks
//! with the staged device collectives. The device-path tests (on_device.rs, zero3_on_device.rs,
//! offload.rs) share it, so that each compares the two places, at any stage, through one body.

use burn::module::{AutodiffModule, Module};
use burn::tensor::FloatDType;
use burn::tensor::backend::AutodiffBackend;
use burn_dist::{CubeResident, Ddp, DdpConfig, DistributedAutodiff};
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_zero::{ZeroAdam, ZeroAdamConfig};

use crate::{Cast, MLP_SIZES, Mlp, OptimizerKind, Stepper, Synthetic, train_ranks_with};

/// Where ZeroAdam's state lives beside a model on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// In device memory (`ZeroAdam::on_device`).
    Device,
    /// On the host (`ZeroAdam::offloaded`).
    Offloaded,
}

impl Place {
    /// Places `zero` beside a model on `device` of backend `D`.
    pub fn apply<D: CubeResident>(
        self,
        zero: ZeroAdam,
        ddp: &Ddp,
        device: &D::Device,
    ) -> burn_dist_zero::Result<ZeroAdam> {
        match self {
            Place::Device => zero.on_device::<D>(ddp, device),
            Place::Offloaded => zero.offloaded::<D>(ddp, device),
        }
    }
}

/// ZeroAdam with `config`, placed at `place` on `device` of backend `D` once built.
pub struct Placed<D: CubeResident> {
    pub config: ZeroAdamConfig,
    pub place: Place,
    pub device: D::Device,
}

impl<D: CubeResident> OptimizerKind for Placed<D> {
    fn build<A, M>(&self, ddp: &Ddp, model: &M) -> Box<dyn Stepper<A, M>>
    where
        A: AutodiffBackend,
        M: AutodiffModule<A> + 'static,
    {
        let zero = self
            .config
            .init::<A, M>(ddp, model)
            .and_then(|zero| self.place.apply::<D>(zero, ddp, &self.device))
            .unwrap_or_else(|e| panic!("ZeroAdam placed at {:?}: {e}", self.place));
        Box::new(zero)
    }
}

/// `world` thread ranks on the staged device collectives of backend `D`
/// (`Ddp::for_thread_staged` with `config`) training the synthetic MLP task
/// ([`train_ranks_with`]) with ZeroAdam as `optimizer` places it, on backend `B`. Per rank: its
/// final parameters and its reducer's stats.
pub fn train_placed<B, D>(
    world: usize,
    config: &DdpConfig,
    optimizer: &Placed<D>,
    steps: usize,
    global_batch: usize,
    lr: f64,
) -> Vec<(Vec<Vec<f32>>, burn_dist::ReducerStats)>
where
    B: DistributedAutodiff<Device = D::Device>,
    D: CubeResident,
    D::Device: Sync,
{
    let device = &optimizer.device;
    train_ranks_with::<B>(
        world,
        |comm| Ddp::for_thread_staged::<D>(comm, config.clone(), device),
        Synthetic::Mlp,
        optimizer,
        steps,
        global_batch,
        lr,
        device,
    )
}

/// What [`placed_ranks`] runs on each rank: its rank, its `Ddp`, its prepared MLP and its
/// placed ZeroAdam.
pub type RankBody<'a, B, T> = &'a (dyn Fn(usize, &mut Ddp, Mlp<B>, &mut ZeroAdam) -> T + Sync);

/// `world` thread ranks on the staged device collectives of backend `D`
/// (`Ddp::for_thread_staged` with `config`), each with the test MLP ([`MLP_SIZES`], seed 7)
/// cast to `dtype` and prepared as `B`'s mode says (sharded at stage 3), and ZeroAdam at
/// `stage` placed at `place`; runs `body` on each and returns what it returned, by rank.
pub fn placed_ranks<B, D, T>(
    world: usize,
    config: &DdpConfig,
    (stage, place): (u8, Place),
    dtype: FloatDType,
    device: &D::Device,
    body: RankBody<'_, B, T>,
) -> Vec<T>
where
    B: DistributedAutodiff<Device = D::Device>,
    D: CubeResident,
    T: Send,
{
    let comms = HostCommunicator::local_group(world, &CommConfig::default());
    burn_dist_comm::testing::run_ranks(comms, |rank, comm| {
        let mut ddp = Ddp::for_thread_staged::<D>(comm, config.clone(), device);
        let mut model = Mlp::<B>::new(&MLP_SIZES, 7, device);
        if dtype != FloatDType::F32 {
            model = model.map(&mut Cast(dtype));
        }
        let model = B::prepare_model(&mut ddp, model).expect("the MLP prepared");
        let zero = ZeroAdamConfig::new()
            .with_stage(stage)
            .init::<B, _>(&ddp, &model)
            .expect("ZeroAdam built");
        let mut zero = place
            .apply::<D>(zero, &ddp, device)
            .unwrap_or_else(|e| panic!("rank {rank}: ZeroAdam placed at {place:?}: {e}"));
        body(rank, &mut ddp, model, &mut zero)
    })
}
