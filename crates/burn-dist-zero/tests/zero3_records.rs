//! ZeRO stage 3's Burn records, the ones burn-train's checkpointer takes (the model's
//! `into_record`, ZeroAdam's `to_record`): every rank takes them, only rank 0's hold values
//! (each parameter, and the optimizer state, gathered to rank 0), a rank that tries to encode
//! its own is told so by name, and rank 0's records load at another world size into a model
//! that stays sharded and trains on as the uninterrupted run does. A parameter's own record
//! transformations (Burn's column-major `Linear` transposes its weight) still apply. A record
//! kept in memory and loaded back into the same model (rolling back to the best model) restores
//! every rank's piece: the model ends where stage 2 ends, bit for bit.

use std::panic::{AssertUnwindSafe, catch_unwind};

use burn::backend::Autodiff;
use burn::module::Module;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Linear, LinearConfig, LinearLayout};
use burn::optim::Optimizer;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use burn_dist::{Ddp, DdpConfig, DistributedAutodiff, DistributedBackend, PrefetchConfig, Sharded};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::roll_back::{
    AfterLoad, RolledBack, assert_trained_on_from_the_load, roll_back,
};
use burn_dist_testing::{
    Cast, DeterministicInit, MLP_SIZES, Mlp, assert_close, parameters, seeded_when_initialized,
    shard_rows, synthetic_rows,
};
use burn_dist_zero::{ZeroAdam, ZeroAdamConfig, ZeroError};
use burn_flex::{Flex, FlexDevice};

type Stage3 = Autodiff<DistributedBackend<Flex, Sharded>>;
type Model = Mlp<Stage3>;
type ModelRecord = <Model as Module<Stage3>>::Record;
type OptimRecord = <ZeroAdam as Optimizer<Model, Stage3>>::Record;

/// Divisible by every world size used here: each step is the same global batch.
const GLOBAL_BATCH: usize = 12;
/// Steps before the records are taken, and in all.
const TAKEN_AT: usize = 2;
const STEPS: usize = 4;

fn recorder() -> BinBytesRecorder<FullPrecisionSettings> {
    BinBytesRecorder::default()
}

/// A prepared stage-3 model from `seed` and its optimizer, on this rank of `comm`'s group.
fn sharded(comm: HostCommunicator, seed: u64) -> (Ddp, Model, ZeroAdam) {
    let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
    let model = Model::new(&MLP_SIZES, seed, &FlexDevice);
    let model = ddp.prepare_sharded(model).expect("prepare_sharded");
    let zero = ZeroAdamConfig::new()
        .with_stage(3)
        .init::<Stage3, _>(&ddp, &model)
        .expect("ZeroAdam");
    (ddp, model, zero)
}

/// Steps `range` of training: each rank its rows of the step's global batch of inputs, the
/// loss their outputs' mean square.
fn train(
    ddp: &mut Ddp,
    mut model: Model,
    zero: &mut ZeroAdam,
    range: std::ops::Range<usize>,
) -> Model {
    let rows = shard_rows(GLOBAL_BATCH, ddp.rank(), ddp.world_size());
    for step in range {
        let shape = [GLOBAL_BATCH, MLP_SIZES[0]];
        let x = synthetic_rows::<Stage3, 2>(0, step, shape, rows.clone(), &FlexDevice);
        let loss = model.forward(x).powi_scalar(2).mean();
        let grads = ddp.backward(loss, &model).unwrap().unwrap();
        model = zero.step(1e-2, model, grads, ddp).unwrap().0;
    }
    model
}

/// What one rank of the 3-rank run saw.
struct Taken {
    /// Rank 0's encoded records (`None` elsewhere), and the values they must hold.
    bytes: Option<(Vec<u8>, Vec<u8>)>,
    values_at_take: Vec<Vec<f32>>,
    /// Reads the records cost this rank, against its sharded parameters.
    reads: u64,
    sharded_params: usize,
    /// On ranks other than 0: what encoding its own records said.
    own_model_record: Option<String>,
    own_optim_record: Option<String>,
    /// Parameters at the end of the uninterrupted run.
    end: Vec<Vec<f32>>,
}

/// The message of the panic `run` ends with (`None` if it returns).
fn panic_message(run: impl FnOnce()) -> Option<String> {
    let payload = catch_unwind(AssertUnwindSafe(run)).err()?;
    let text = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()));
    Some(text.unwrap_or_default())
}

/// 3 ranks train, take both records at [`TAKEN_AT`] on every rank, and train on to [`STEPS`].
fn uninterrupted() -> Vec<Taken> {
    run_ranks(
        HostCommunicator::local_group(3, &CommConfig::default()),
        |rank, comm| {
            let (mut ddp, model, mut zero) = sharded(comm, 7);
            let model = train(&mut ddp, model, &mut zero, 0..TAKEN_AT);
            let stats = || ddp.shard_stats().expect("stage 3");
            let before = stats().reads;
            let model_record = model.clone().into_record();
            let optim_record = Optimizer::<Model, Stage3>::to_record(&zero);
            let reads = stats().reads - before;
            let values_at_take = parameters::<Stage3, _>(&model);
            let (mut own_model_record, mut own_optim_record, mut bytes) = (None, None, None);
            if rank == 0 {
                let model_bytes = recorder().record(model_record, ()).unwrap();
                let optim_bytes = Recorder::<Stage3>::record(&recorder(), optim_record, ())
                    .expect("ZeroAdam's record");
                bytes = Some((model_bytes, optim_bytes));
            } else {
                own_model_record = panic_message(|| {
                    let _ = recorder().record(model_record, ());
                });
                // Empty here: it encodes, but no optimizer takes it.
                let encoded = Recorder::<Stage3>::record(&recorder(), optim_record, ()).unwrap();
                let loaded: OptimRecord =
                    Recorder::<Stage3>::load(&recorder(), encoded, &FlexDevice).unwrap();
                let fresh = zero.clone();
                own_optim_record = panic_message(move || {
                    let _ = Optimizer::<Model, Stage3>::load_record(fresh, loaded);
                });
            }
            let end = parameters::<Stage3, _>(&train(&mut ddp, model, &mut zero, TAKEN_AT..STEPS));
            Taken {
                bytes,
                values_at_take,
                reads,
                sharded_params: ddp.param_shards().expect("stage 3").params().len(),
                own_model_record,
                own_optim_record,
                end,
            }
        },
    )
}

/// `world` ranks build a fresh model (another seed), load rank 0's records into it and train
/// the steps after [`TAKEN_AT`]; returns per rank whether the loaded model stayed sharded, its
/// values right after the load, and at the end.
fn resumed(world: usize, (model_bytes, optim_bytes): &(Vec<u8>, Vec<u8>)) -> Vec<Resumed> {
    run_ranks(
        HostCommunicator::local_group(world, &CommConfig::default()),
        |_, comm| {
            let (mut ddp, model, zero) = sharded(comm, 99);
            let record: ModelRecord = recorder().load(model_bytes.clone(), &FlexDevice).unwrap();
            // A load builds new parameters, which Burn's backward knows nothing of: mark them.
            let model = ddp.mark(model.load_record(record));
            let shards = ddp.param_shards().expect("stage 3");
            let still_sharded = shards.check_model(&model).map_err(|e| e.to_string());
            let live_after_load = shards.stats().live_bytes;
            let record: OptimRecord =
                Recorder::<Stage3>::load(&recorder(), optim_bytes.clone(), &FlexDevice).unwrap();
            let mut zero = Optimizer::<Model, Stage3>::load_record(zero, record);
            let loaded = parameters::<Stage3, _>(&model);
            let end = parameters::<Stage3, _>(&train(&mut ddp, model, &mut zero, TAKEN_AT..STEPS));
            Resumed {
                still_sharded,
                live_after_load,
                loaded,
                end,
            }
        },
    )
}

struct Resumed {
    still_sharded: Result<(), String>,
    live_after_load: usize,
    loaded: Vec<Vec<f32>>,
    end: Vec<Vec<f32>>,
}

#[test]
fn stage_3_records_are_gathered_to_rank_0_only_and_load_sharded_at_any_world_size() {
    let taken = uninterrupted();
    for (rank, t) in taken.iter().enumerate() {
        assert_eq!(
            t.reads, t.sharded_params as u64,
            "rank {rank}: the model's record gathers each sharded parameter once, on every rank"
        );
        if rank == 0 {
            continue;
        }
        let said = t
            .own_model_record
            .as_deref()
            .expect("rank 1's record encoded");
        assert!(
            said.contains(&format!("rank {rank}: parameter `"))
                && said.contains("has its values on rank 0 only")
                && said.contains("RankZeroRecorder"),
            "rank {rank}: {said}"
        );
        let said = t
            .own_optim_record
            .as_deref()
            .expect("an empty record loaded");
        assert!(
            said.contains("the ZeroAdam record is empty") && said.contains("rank 0"),
            "rank {rank}: {said}"
        );
    }

    // Rank 0's model record holds the model's values: a plain, unsharded model takes them.
    let bytes = taken[0].bytes.as_ref().expect("rank 0's records");
    let plain = Mlp::<Autodiff<Flex>>::new(&MLP_SIZES, 99, &FlexDevice)
        .load_record(recorder().load(bytes.0.clone(), &FlexDevice).unwrap());
    assert!(
        parameters::<Autodiff<Flex>, _>(&plain) == taken[0].values_at_take,
        "rank 0's record does not hold the model's values"
    );

    for world in [3, 2] {
        let runs = resumed(world, bytes);
        for (rank, run) in runs.iter().enumerate() {
            let what = format!("resumed on {world} ranks, rank {rank}");
            assert_eq!(
                run.still_sharded,
                Ok(()),
                "{what}: load_record unsharded it"
            );
            assert_eq!(
                run.live_after_load, 0,
                "{what}: a gathered copy outlived the load"
            );
            assert!(
                run.loaded == taken[0].values_at_take,
                "{what}: loaded other values"
            );
            if world == 3 {
                assert!(run.end == taken[rank].end, "{what}: not bit for bit");
            } else {
                assert_close(&run.end, &taken[0].end, 1e-5, &what);
            }
        }
    }
}

#[test]
fn a_column_major_linear_keeps_burns_own_record_transformations_at_stage_3() {
    // Burn's column-major Linear transposes its weight when it saves and when it loads: the
    // stage-3 hooks must run around that, not instead of it. Not square, so a missed
    // transpose cannot go unseen.
    let config = LinearConfig::new(6, 4).with_layout(LinearLayout::Col);
    let group = || HostCommunicator::local_group(2, &CommConfig::default());
    let taken = run_ranks(group(), |rank, comm| {
        let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
        let model = ddp
            .prepare_sharded(config.init::<Stage3>(&FlexDevice))
            .unwrap();
        let record = model.clone().into_record();
        let bytes = (rank == 0).then(|| recorder().record(record, ()).unwrap());
        (parameters::<Stage3, _>(&model), bytes)
    });
    let (values, bytes) = (&taken[0].0, taken[0].1.clone().expect("rank 0's record"));

    // The record is Burn's own: an unsharded column-major Linear loads the same values from
    // it and records the same bytes. (Not on Autodiff: Burn's own load of a column-major
    // Linear marks its transposed, non-leaf weight as requiring a gradient, which autodiff
    // refuses.)
    type Plain = Flex;
    let plain = config
        .init::<Plain>(&FlexDevice)
        .load_record(recorder().load(bytes.clone(), &FlexDevice).unwrap());
    assert!(
        parameters::<Plain, _>(&plain) == *values,
        "an unsharded Linear reads other values from stage 3's record"
    );
    let again = recorder().record(plain.into_record(), ()).unwrap();
    assert!(again == bytes, "stage 3 recorded other bytes than Burn");

    // Loaded back into sharded Linears (other initial values) on 2 ranks.
    let loaded = run_ranks(group(), |_, comm| {
        let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
        let model = ddp
            .prepare_sharded(config.init::<Stage3>(&FlexDevice))
            .unwrap();
        let model = model.load_record(recorder().load(bytes.clone(), &FlexDevice).unwrap());
        let sharded = ddp.param_shards().unwrap().check_model(&model).is_ok();
        let got = parameters::<Stage3, _>(&model);
        // Prepared again while the first preparation's shards live on (as a stale optimizer
        // would keep them), it records what it recorded before (one transpose, not two), and
        // a load keeps it on the new shards.
        let stale = ddp.param_shards();
        let model = ddp.prepare_sharded(model).unwrap();
        let record = model.clone().into_record();
        let again = (ddp.rank() == 0).then(|| recorder().record(record, ()).unwrap());
        let model = model.load_record(recorder().load(bytes.clone(), &FlexDevice).unwrap());
        let resharded = ddp.param_shards().unwrap().check_model(&model).is_ok();
        drop(stale);
        (sharded && resharded, got, again)
    });
    for (rank, (sharded, got, again)) in loaded.iter().enumerate() {
        assert!(*sharded, "rank {rank}: a load unsharded the Linear");
        assert!(got == values, "rank {rank}: loaded other values");
        if let Some(again) = again {
            assert!(
                *again == bytes,
                "prepared again, the Linear records other bytes"
            );
        }
    }
}

/// Models of burn-nn, which this repository did not write, with seeded values so that every
/// run starts alike.
#[derive(Debug, Clone, Copy)]
enum BurnModel {
    /// `TransformerEncoder`: attention, feed-forward, layer norms (no dropout).
    Encoder,
    /// A column-major `Linear`, whose weight's own record transformations transpose it.
    ColumnMajorLinear,
    /// Two non-square column-major `Linear`s (16 → 24 → 16) left lazy, as `LinearConfig::init`
    /// makes them: Burn's lazy shape of such a weight is its draw's, `[d_output, d_input]`,
    /// before the init transformation transposes it, so `Ddp::prepare_sharded` must take the
    /// initialized one. (Trainable leaves, `seeded_when_initialized`: Burn's own leaves the
    /// weight untrainable on Autodiff, and its load of an in-memory record of a trainable one
    /// panics at stages 1 and 2, so this model is not rolled back here.)
    LazyColumnMajorLinears,
}

/// A [`BurnModel`] and its forward on `[batch, sequence, 16]`.
#[derive(Module, Debug)]
#[allow(clippy::large_enum_variant)] // one per rank and run
enum Net<B: Backend> {
    Encoder(TransformerEncoder<B>),
    Linear(Linear<B>),
    Linears(Linears<B>),
}

#[derive(Module, Debug)]
struct Linears<B: Backend> {
    up: Linear<B>,
    down: Linear<B>,
}

impl<B: Backend> Net<B> {
    fn new(which: BurnModel) -> Self {
        let seeded = DeterministicInit::new(11);
        let col = |d_input, d_output| {
            LinearConfig::new(d_input, d_output)
                .with_layout(LinearLayout::Col)
                .init::<B>(&Default::default())
        };
        match which {
            BurnModel::Encoder => Net::Encoder(
                TransformerEncoderConfig::new(16, 32, 2, 2)
                    .with_dropout(0.0)
                    .init::<B>(&Default::default())
                    .map(&mut { seeded }),
            ),
            BurnModel::ColumnMajorLinear => Net::Linear(col(16, 16).map(&mut { seeded })),
            BurnModel::LazyColumnMajorLinears => {
                let lazy = |d_input, d_output, place: usize| {
                    let mut linear = col(d_input, d_output);
                    linear.weight = seeded_when_initialized(linear.weight, 11, 2 * place);
                    linear.bias = linear
                        .bias
                        .map(|bias| seeded_when_initialized(bias, 11, 2 * place + 1));
                    assert!(!linear.weight.is_initialized(), "the Linear is lazy");
                    linear
                };
                Net::Linears(Linears {
                    up: lazy(16, 24, 0),
                    down: lazy(24, 16, 1),
                })
            }
        }
    }

    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        match self {
            Net::Encoder(encoder) => encoder.forward(TransformerEncoderInput::new(x)),
            Net::Linear(linear) => linear.forward(x),
            Net::Linears(Linears { up, down }) => down.forward(up.forward(x)),
        }
    }
}

/// Step `step`'s batch of rows `rows` on `[batch, 3, 16]`, inputs and targets, in `dtype`.
fn net_batch<B: Backend<Device = FlexDevice>>(
    step: usize,
    rows: std::ops::Range<usize>,
    dtype: FloatDType,
) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let shape = [GLOBAL_BATCH, 3, 16];
    let x = synthetic_rows::<B, 3>(0, step, shape, rows.clone(), &FlexDevice);
    let y = synthetic_rows::<B, 3>(1, step, shape, rows, &FlexDevice);
    (x.cast(dtype), y.cast(dtype))
}

/// A [`Net`] prepared for `stage` on this rank of `comm`'s group (`config`), its parameters in
/// `dtype`, and ZeroAdam at `stage`.
fn prepared_net<B: DistributedAutodiff<Device = FlexDevice>>(
    comm: HostCommunicator,
    config: DdpConfig,
    which: BurnModel,
    stage: u8,
    dtype: FloatDType,
) -> (Ddp, Net<B>, ZeroAdam) {
    let mut ddp = Ddp::for_thread(comm, config);
    let net = Net::<B>::new(which);
    let net = match dtype {
        FloatDType::F32 => net,
        _ => net.map(&mut Cast(dtype)),
    };
    let model = B::prepare_model(&mut ddp, net).unwrap();
    let zero = ZeroAdamConfig::new()
        .with_stage(stage)
        .init::<B, _>(&ddp, &model)
        .unwrap();
    (ddp, model, zero)
}

/// Steps `steps` of training: each rank its rows of the step's batch, the loss the mean square
/// of the outputs' error. A step's error is returned.
fn train_net<B: DistributedAutodiff<Device = FlexDevice>>(
    ddp: &mut Ddp,
    zero: &mut ZeroAdam,
    mut model: Net<B>,
    steps: std::ops::Range<usize>,
    dtype: FloatDType,
) -> Result<Net<B>, ZeroError> {
    let rows = shard_rows(GLOBAL_BATCH, ddp.rank(), ddp.world_size());
    for step in steps {
        let (x, y) = net_batch::<B>(step, rows.clone(), dtype);
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        let grads = ddp.backward(loss, &model).unwrap().unwrap();
        model = zero.step(1e-2, model, grads, ddp)?.0;
    }
    Ok(model)
}

/// [`roll_back`] on `world` ranks with ZeroAdam at `stage`, the model's parameters in `dtype`;
/// the probe is the loss of a held-out batch on the loaded model.
fn rolled_back<B: DistributedAutodiff<Device = FlexDevice>>(
    which: BurnModel,
    world: usize,
    stage: u8,
    dtype: FloatDType,
    after_load: AfterLoad,
) -> Vec<RolledBack<Vec<f32>>> {
    run_ranks(
        HostCommunicator::local_group(world, &CommConfig::default()),
        |rank, comm| {
            let (mut ddp, model, mut zero) =
                prepared_net::<B>(comm, DdpConfig::new(), which, stage, dtype);
            let step = |ddp: &mut Ddp, zero: &mut ZeroAdam, model, s: usize| {
                train_net(ddp, zero, model, s..s + 1, dtype).unwrap()
            };
            let held_out_loss = |model: &Net<B>| {
                let (x, y) = net_batch::<B>(1_000, shard_rows(GLOBAL_BATCH, rank, world), dtype);
                let loss = (model.forward(x) - y).powi_scalar(2).mean();
                loss.cast(FloatDType::F32).into_data().to_vec().unwrap()
            };
            roll_back(&mut ddp, &mut zero, model, step, after_load, held_out_loss)
        },
    )
}

/// Every float parameter's values, in visit order.
type Parameters = Vec<Vec<f32>>;

/// The parameters of [`BurnModel::LazyColumnMajorLinears`] on every rank of `world` when
/// prepared, and after 4 steps at `stage`.
fn lazy_linears_trained<B: DistributedAutodiff<Device = FlexDevice>>(
    world: usize,
    stage: u8,
) -> Vec<(Parameters, Parameters)> {
    let which = BurnModel::LazyColumnMajorLinears;
    let group = HostCommunicator::local_group(world, &CommConfig::default());
    run_ranks(group, |_, comm| {
        let f32 = FloatDType::F32;
        let (mut ddp, model, mut zero) =
            prepared_net::<B>(comm, DdpConfig::new(), which, stage, f32);
        let start = parameters::<B, _>(&model);
        let end = train_net(&mut ddp, &mut zero, model, 0..4, f32).unwrap();
        (start, parameters::<B, _>(&end))
    })
}

#[test]
fn a_lazy_column_major_linear_trains_at_stage_3_as_at_stage_2() {
    type Stage2 = Autodiff<DistributedBackend<Flex>>;
    for world in [2, 3] {
        let two = lazy_linears_trained::<Stage2>(world, 2);
        let three = lazy_linears_trained::<Stage3>(world, 3);
        for (rank, ((start, two), (_, three))) in two.iter().zip(&three).enumerate() {
            let what = format!("{world} ranks, rank {rank}");
            assert_eq!(start[0].len(), 16 * 24, "{what}: not the model under test");
            assert!(
                start.iter().zip(two).all(|(a, b)| a != b),
                "{what}: stage 2 left a parameter untrained"
            );
            assert!(
                three == two,
                "{what}: stage 3 trained other values than stage 2"
            );
        }
    }
}

#[test]
fn a_record_kept_in_memory_and_loaded_back_at_stage_3_ends_bitwise_as_at_stage_2() {
    type Stage2 = Autodiff<DistributedBackend<Flex>>;
    for which in [BurnModel::Encoder, BurnModel::ColumnMajorLinear] {
        for world in [2, 3] {
            let roll_back_at = |stage| match stage {
                2 => rolled_back::<Stage2>(which, world, 2, FloatDType::F32, AfterLoad::TrainOn),
                _ => rolled_back::<Stage3>(which, world, 3, FloatDType::F32, AfterLoad::TrainOn),
            };
            let (two, three) = (roll_back_at(2), roll_back_at(3));
            for (rank, (two, three)) in two.iter().zip(&three).enumerate() {
                let what = format!("{which:?}, {world} ranks, rank {rank}");
                assert!(
                    two.before_load != two.at_record,
                    "{what}: the steps after the record changed nothing, a load would show nothing"
                );
                assert!(
                    three.at_record == two.at_record && three.before_load == two.before_load,
                    "{what}: stage 3 trained other values than stage 2"
                );
                assert!(
                    two.loaded == two.at_record,
                    "{what}: stage 2 did not load its record back"
                );
                assert!(
                    three.loaded == two.loaded,
                    "{what}: stage 3 loaded its record back to other values than stage 2"
                );
                assert!(
                    three.probed == two.probed,
                    "{what}: the loaded model computes another loss at stage 3 ({:?}) than at \
                     stage 2 ({:?})",
                    three.probed,
                    two.probed
                );
                assert!(
                    three.end == two.end,
                    "{what}: stage 3 trained on from the loaded model to other values than stage 2"
                );
            }
        }
    }
}

#[test]
fn training_goes_on_from_a_record_loaded_back_at_every_stage_and_precision() {
    type Replicated = Autodiff<DistributedBackend<Flex>>;
    // Every float parameter of the encoder is trainable, so the reference's import can take
    // the model's values by visit order.
    let which = BurnModel::Encoder;
    for dtype in [FloatDType::F32, FloatDType::BF16, FloatDType::F16] {
        for stage in 1..=3 {
            let run = |after_load| match stage {
                3 => rolled_back::<Stage3>(which, 2, 3, dtype, after_load),
                _ => rolled_back::<Replicated>(which, 2, stage, dtype, after_load),
            };
            // Bitwise: ZeroAdam's master weights become the loaded values converted to f32
            // (exact from bf16 and f16), as the reference's import sets them, and the moments
            // and step counts are the same on both sides.
            assert_trained_on_from_the_load(
                &run(AfterLoad::TrainOn),
                &run(AfterLoad::ImportLoadedMaster),
                &format!("{which:?} in {dtype:?} at stage {stage}"),
            );
        }
    }
}

/// On 2 ranks at `stage`: keeps a record after a step, steps again, loads it on rank 0 only and
/// steps: every rank's error.
fn load_on_rank_0_only<B: DistributedAutodiff<Device = FlexDevice>>(stage: u8) -> Vec<ZeroError> {
    // A load drops the gathers issued ahead on the rank that loads: without a window the
    // ranks' gathers still pair up, and the step is where they meet.
    let config = DdpConfig::new().with_prefetch(PrefetchConfig::OFF);
    run_ranks(
        HostCommunicator::local_group(2, &CommConfig::default()),
        |rank, comm| {
            let f32 = FloatDType::F32;
            let (mut ddp, model, mut zero) =
                prepared_net::<B>(comm, config.clone(), BurnModel::Encoder, stage, f32);
            let model = train_net(&mut ddp, &mut zero, model, 0..1, f32).unwrap();
            let kept = model.clone().into_record();
            let mut model = train_net(&mut ddp, &mut zero, model, 1..2, f32).unwrap();
            if rank == 0 {
                model = ddp.mark(model.load_record(kept));
            }
            match train_net(&mut ddp, &mut zero, model, 2..3, f32) {
                Err(error) => error,
                Ok(_) => panic!("rank {rank}: the step after a load on rank 0 alone passed"),
            }
        },
    )
}

#[test]
fn a_record_loaded_on_one_rank_only_fails_the_next_step_on_every_rank() {
    type Replicated = Autodiff<DistributedBackend<Flex>>;
    for (stage, errors) in [
        (2, load_on_rank_0_only::<Replicated>(2)),
        (3, load_on_rank_0_only::<Stage3>(3)),
    ] {
        for (rank, error) in errors.iter().enumerate() {
            let what = format!("stage {stage}, rank {rank}");
            let ZeroError::ReplacedOnSomeRanks {
                rank: differs,
                found,
                rank0_found,
                ..
            } = error
            else {
                panic!("{what}: {error}");
            };
            assert_eq!(*differs, 1, "{what}: {error}");
            assert_eq!(found.replaced, 0, "{what}: {error}");
            assert!(rank0_found.replaced > 0, "{what}: {error}");
            let said = error.to_string();
            assert!(
                said.contains("rank 1 found 0 parameters replaced")
                    && said.contains("on some ranks only"),
                "{what}: {said}"
            );
        }
    }
}
