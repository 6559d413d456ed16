//! Device memory per rank on the device path, read from the cubecl client's own count
//! (`memory_usage().bytes_in_use`) on the wgpu twin, against the formula of docs/guide.md
//! ("Memory per rank"), at ZeRO stages 2 and 3, and with the optimizer offloaded to the host
//! (`ZeroAdam::offloaded`) at stages 1 to 3.
//!
//! Two thread ranks, each on a wgpu device of its own (lavapipe's adapter opened twice, as
//! `DefaultDevice` and `Cpu`: two cubecl clients, two memory pools), so that each rank's count
//! is its own. The model is a stack of square layers trained on one row per rank: the
//! parameters dwarf the activations, and one layer is a sixteenth of the model, so the terms
//! that do not shrink with the ranks (a bucket in flight, a gathered unit, one gradient) stay
//! small, as in a real model.
//!
//! With Ψ parameter elements (f32), S the elements of a rank's shard, B one bucket, U one
//! gather unit, G the largest parameter:
//! - stage 2, between steps: the parameters (4Ψ) and ZeroAdam's master weights, moments and
//!   model copy (16S); no buffer of the whole flat parameter vector, no gradient shard (the
//!   step lets it go);
//! - stage 3, between steps: the pieces, which are the master weights, and the moments (12S);
//! - offloaded, stages 1 and 2, between steps: the parameters (4Ψ) alone, 16S below stage 2's
//!   state in device memory: master weights, moments and the model copy stay on the host, and
//!   the step lets its gradient shard and the uploaded new shard go;
//! - offloaded, stage 3, between steps: the pieces alone (4S in f32, 2S in f16, against 12S
//!   and 14S with the state in device memory);
//! - during backward, on top: the gradient shard being filled (4S), at most two buckets of
//!   local gradients in flight and the one that just arrived with its private copy (fusion's
//!   gradients share memory with fusion), and at stage 3 the gathered units (the one in use
//!   and two ahead).
//!
//! The measured figures are printed (`--nocapture`) and kept in docs/perf/device-memory.md.

use std::sync::{Arc, Mutex};

use burn::backend::Autodiff;
use burn::module::Module;
use burn::tensor::FloatDType;
use burn::tensor::backend::Backend;
use burn_dist::{
    BucketConfig, Ddp, DdpConfig, DistributedAutodiff, DistributedBackend, FlatLayout,
    PrefetchConfig, ReducerEvent, Sharded,
};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::placed::Place;
use burn_dist_testing::{Cast, Mlp, shard_rows, synthetic_rows};
use burn_dist_zero::ZeroAdamConfig;
use burn_wgpu::{Wgpu, WgpuDevice, WgpuRuntime};

type Stage2 = Autodiff<DistributedBackend<Wgpu>>;
type Stage3 = Autodiff<DistributedBackend<Wgpu, Sharded>>;

/// Sixteen layers of 256 × 256 (and their biases): Ψ = 16 × 65 792 elements, 4.0 MiB.
const SIZES: [usize; 17] = [256; 17];
const WORLD: usize = 2;
const STEPS: usize = 3;
/// A bucket, and a gather unit, hold about one layer, as 25 MiB hold a few layers of a large
/// model: 256 KiB.
const BUCKET_BYTES: usize = 256 << 10;
/// Gathers ahead of use (`PrefetchConfig`'s default).
const UNITS_AHEAD: usize = 2;
/// What the formula leaves out: the optimizer's scalars and per-cube partials, the one-element
/// stand-ins, a loss: a few kilobytes.
const SMALL: u64 = 64 << 10;

/// Each rank's own device: the same adapter, two cubecl clients.
fn device(rank: usize) -> WgpuDevice {
    match rank {
        0 => WgpuDevice::DefaultDevice,
        _ => WgpuDevice::Cpu,
    }
}

/// Bytes in use on `device` once everything queued there has run.
fn in_use(device: &WgpuDevice) -> u64 {
    <Wgpu as Backend>::sync(device).expect("sync");
    use burn_cubecl::cubecl::Runtime;
    WgpuRuntime::client(device)
        .memory_usage()
        .expect("memory usage")
        .bytes_in_use
}

/// One rank's figures, bytes.
#[derive(Debug, Clone, Copy, Default)]
struct Measured {
    /// After the last optimizer step.
    between_steps: u64,
    /// The most at any gradient's arrival during backward, or right after a forward.
    peak: u64,
}

/// One measurement at a time: the two devices are the process's.
static SERIAL: Mutex<()> = Mutex::new(());

/// Trains the model in `dtype` at `stage` on every rank, ZeroAdam at `place`, and measures each
/// rank's device memory.
fn measure<B: DistributedAutodiff<Device = WgpuDevice>>(
    stage: u8,
    place: Place,
    dtype: FloatDType,
) -> Vec<Measured> {
    let _one_run = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    burn_dist_kernels::testing::wgpu_client();
    let comms = HostCommunicator::local_group(WORLD, &CommConfig::default());
    run_ranks(comms, |rank, comm| {
        let device = device(rank);
        // Two buckets in flight at most, stage 3's default, set at stage 2 too (its optimizer
        // step keeps the ranks in step, so a wait in backward is safe on threads).
        let buckets = BucketConfig::new()
            .with_first_bucket_bytes(BUCKET_BYTES)
            .with_bucket_bytes(BUCKET_BYTES)
            .with_max_in_flight_bytes(Some(2 * BUCKET_BYTES));
        let config = DdpConfig::new()
            .with_buckets(buckets)
            .with_prefetch(PrefetchConfig::new().with_unit_bytes(BUCKET_BYTES));
        let mut ddp = Ddp::for_thread_staged::<Wgpu>(comm, config, &device);
        let model = Mlp::<B>::new(&SIZES, 7, &device).map(&mut Cast(dtype));
        let model = B::prepare_model(&mut ddp, model).unwrap();
        let zero = ZeroAdamConfig::new()
            .with_stage(stage)
            .init::<B, _>(&ddp, &model)
            .unwrap();
        let mut zero = place.apply::<Wgpu>(zero, &ddp, &device).unwrap();
        let peak = Arc::new(Mutex::new(0u64));
        let watched = (peak.clone(), device.clone());
        ddp.set_observer(move |_, ReducerEvent::Gradient { .. }| {
            let now = in_use(&watched.1);
            let mut peak = watched.0.lock().unwrap();
            *peak = (*peak).max(now);
        });
        let mut model = model;
        let mut between_steps = 0;
        for step in 0..STEPS {
            let rows = shard_rows(WORLD, rank, WORLD);
            let x = synthetic_rows::<B, 2>(0, step, [WORLD, SIZES[0]], rows.clone(), &device);
            let y = synthetic_rows::<B, 2>(1, step, [WORLD, SIZES[16]], rows, &device);
            let loss = (model.forward(x.cast(dtype)) - y.cast(dtype))
                .powi_scalar(2)
                .mean();
            let after_forward = in_use(&device);
            {
                let mut peak = peak.lock().unwrap();
                *peak = (*peak).max(after_forward);
            }
            let grads = ddp.backward(loss, &model).unwrap().unwrap();
            model = zero.step(1e-3, model, grads, &ddp).unwrap().0;
            between_steps = in_use(&device);
        }
        let peak = *peak.lock().unwrap();
        drop(model);
        Measured {
            between_steps,
            peak,
        }
    })
}

/// Ψ, S (this layout's shard), G, in elements.
fn sizes() -> (u64, u64, u64) {
    let numels: Vec<usize> = SIZES.windows(2).flat_map(|w| [w[0] * w[1], w[1]]).collect();
    let flat = FlatLayout::new(&numels, WORLD, burn_dist::SHARD_ALIGN);
    let largest = numels.iter().copied().max().unwrap_or(0);
    (flat.total as u64, flat.shard_len as u64, largest as u64)
}

/// The bytes backward may add on top of what stays between steps, at either stage: the
/// gradient shard being filled, two buckets in flight, the gradient that just arrived and its
/// private copy, and the staging of one bucket through the host (its download and upload
/// buffers).
fn backward_transient(shard: u64, largest: u64) -> u64 {
    4 * shard + 2 * BUCKET_BYTES as u64 + 2 * 4 * largest + 2 * BUCKET_BYTES as u64
}

/// Prints every rank's figures, then asserts them: between steps the formula (`between`) plus
/// at most [`SMALL`], and a peak of at most `peak`.
fn assert_fits(what: &str, measured: &[Measured], between: u64, peak: u64) {
    for (rank, m) in measured.iter().enumerate() {
        eprintln!(
            "{what}, rank {rank}: between steps {} B (formula {between} B), peak {} B \
             (bound {peak} B)",
            m.between_steps, m.peak
        );
    }
    for (rank, m) in measured.iter().enumerate() {
        assert!(
            (between..=between + SMALL).contains(&m.between_steps),
            "{what}, rank {rank}: {} bytes between steps, the formula says {between} (+ at \
             most {SMALL})",
            m.between_steps
        );
        assert!(
            m.peak <= peak,
            "{what}, rank {rank}: a peak of {} bytes during the step, above the bound of \
             {peak}",
            m.peak
        );
    }
}

#[test]
fn stage_two_holds_the_parameters_and_a_sixteen_byte_shard_per_element() {
    let (total, shard, largest) = sizes();
    let between = 4 * total + 16 * shard;
    let peak = between + backward_transient(shard, largest) + SMALL;
    assert_fits(
        "stage 2",
        &measure::<Stage2>(2, Place::Device, FloatDType::F32),
        between,
        peak,
    );
}

#[test]
fn stage_three_holds_twelve_bytes_per_element_of_its_shard() {
    let (_, shard, largest) = sizes();
    let between = 12 * shard;
    let gathered = (UNITS_AHEAD as u64 + 1) * BUCKET_BYTES as u64;
    let peak = between + backward_transient(shard, largest) + gathered + SMALL;
    assert_fits(
        "stage 3",
        &measure::<Stage3>(3, Place::Device, FloatDType::F32),
        between,
        peak,
    );
}

/// Offloaded, the device holds the parameters alone between steps, at stages 1 and 2: the
/// state that stays in device memory without offload is not there (stage 2: 16S, master
/// weights, moments, model copy; stage 1 also its gradient shard buffer, 20S), measured the
/// same way. During backward the same transient terms as on the device come on top: at stage 2
/// the formula's; at stage 1, which hands back the averaged gradient whole (4Ψ), at most 12Ψ
/// with the local gradients and the buckets in flight. Offloading never raises the peak.
#[test]
fn offloaded_at_stages_1_and_2_holds_only_the_parameters_between_steps() {
    let (total, shard, largest) = sizes();
    let between = 4 * total;
    for (stage, state_on_device, peak) in [
        (1, 20 * shard, 3 * 4 * total + SMALL),
        (
            2,
            16 * shard,
            between + backward_transient(shard, largest) + SMALL,
        ),
    ] {
        let f32 = FloatDType::F32;
        let offloaded = measure::<Stage2>(stage, Place::Offloaded, f32);
        let what = format!("stage {stage}, offloaded");
        assert_fits(&what, &offloaded, between, peak);
        let on_device = measure::<Stage2>(stage, Place::Device, f32);
        assert_offloading_saves(&what, &on_device, &offloaded, state_on_device);
    }
}

/// Offloaded at stage 3, the device holds this rank's pieces alone between steps (pS, p bytes
/// per element of the model's dtype): master weights and moments stay on the host. In f32 the
/// pieces on the device are the master weights, so offloading takes the moments off (8S, 12S
/// against 4S); in f16 the device state is the pieces, the master weights and the moments
/// (14S), against the pieces (2S) offloaded: a seventh, the ratio the GPU goal sets at a fifth
/// for bf16. During backward, the same transient terms as stage 3 on the device.
#[test]
fn offloaded_at_stage_3_holds_only_its_pieces_between_steps() {
    let (_, shard, largest) = sizes();
    let gathered = (UNITS_AHEAD as u64 + 1) * BUCKET_BYTES as u64;
    for (dtype, p, state_on_device) in [
        (FloatDType::F32, 4, 8 * shard),
        (FloatDType::F16, 2, 12 * shard),
    ] {
        let between = p * shard;
        // The transient terms are f32 (the gradient shard) or the parameters' dtype, bounded
        // by their f32 size.
        let peak = between + backward_transient(shard, largest) + gathered + SMALL;
        let offloaded = measure::<Stage3>(3, Place::Offloaded, dtype);
        let what = format!("stage 3 in {dtype:?}, offloaded");
        assert_fits(&what, &offloaded, between, peak);
        let on_device = measure::<Stage3>(3, Place::Device, dtype);
        assert_offloading_saves(&what, &on_device, &offloaded, state_on_device);
        for (rank, (on_device, offloaded)) in on_device.iter().zip(&offloaded).enumerate() {
            assert!(
                5 * offloaded.between_steps <= on_device.between_steps || dtype == FloatDType::F32,
                "{what}, rank {rank}: offloaded holds {} bytes between steps, more \
                 than a fifth of the {} on the device",
                offloaded.between_steps,
                on_device.between_steps
            );
        }
    }
}

/// Between steps, offloading saves `state_on_device` bytes per rank (to [`SMALL`]) against the
/// state in device memory, measured the same way, and never raises the peak.
fn assert_offloading_saves(
    what: &str,
    on_device: &[Measured],
    offloaded: &[Measured],
    state_on_device: u64,
) {
    for (rank, (on_device, offloaded)) in on_device.iter().zip(offloaded).enumerate() {
        let saved = on_device.between_steps - offloaded.between_steps;
        eprintln!(
            "{what}, rank {rank}: offloading saves {saved} B between steps (formula \
             {state_on_device} B); peak {} B, on the device {} B",
            offloaded.peak, on_device.peak
        );
        assert!(
            (state_on_device - SMALL..=state_on_device + SMALL).contains(&saved),
            "{what}, rank {rank}: offloading saved {saved} bytes between steps, the \
             formula says {state_on_device}"
        );
        assert!(
            offloaded.peak <= on_device.peak,
            "{what}, rank {rank}: offloaded, a peak of {} bytes, above the {} of the \
             state in device memory",
            offloaded.peak,
            on_device.peak
        );
    }
}
