//! ZeroAdam's shard on a cubecl device, updated by the fused kernels of `burn-dist-kernels`.
//!
//! The state (fp32 master weights, m, v and the step counter) lives in device buffers between
//! steps. A step uploads the gradient shard, runs pass 1 (unscale, inf/NaN check, sum of
//! squares), agrees with the other ranks on found-inf and the global norm through the host
//! communicator (the only host read: two floats), writes the agreed values back, and runs the
//! finalize and update kernels; the updated master weights are read back for the all-gather.
//! The same code runs on wgpu (tested on lavapipe in CI) and on CUDA.
//!
//! The kernels keep one step counter for the whole shard, where Burn (and the host path) count
//! per parameter. The two agree whenever every parameter has a gradient at every step, which
//! this path requires (a step where a parameter has none is refused, naming it).

use burn_dist_kernels::{FusedAdam, Hyper, ModelDtype, StepBuffers};
use cubecl::Runtime;
use cubecl::prelude::ComputeClient;

/// The device half of a ZeroAdam step, whatever the runtime.
pub(crate) trait DeviceShard: Send {
    /// Uploads the gradient shard and runs pass 1; returns this shard's (found_inf, sum of
    /// squares of the unscaled gradient).
    fn check(&mut self, grad: &[f32], inv_scale: f32) -> (bool, f64);
    /// With every rank's agreed (found_inf, total sum of squares): finalize and update.
    fn update(&mut self, found_inf: bool, total_sum_sq: f64, hyper: Hyper);
    /// The fp32 master weights.
    fn master(&self) -> Vec<f32>;
    /// (master, m, v), read back.
    fn state(&self) -> [Vec<f32>; 3];
    /// Replaces the state (a checkpoint's), with `steps_taken` steps already counted.
    fn load(&mut self, master: &[f32], m: &[f32], v: &[f32], steps_taken: u32);
    /// What runs it, for messages.
    fn name(&self) -> String;
}

pub(crate) struct FusedShard<R: Runtime> {
    fused: FusedAdam<R>,
    buffers: StepBuffers,
}

impl<R: Runtime> FusedShard<R> {
    pub(crate) fn new(
        client: ComputeClient<R>,
        master: &[f32],
        m: &[f32],
        v: &[f32],
        steps_taken: u32,
    ) -> Self {
        let fused = FusedAdam::new(client);
        let zeros = vec![0.0; master.len()];
        let buffers = fused.upload(master, m, v, steps_taken, &zeros, 1.0, ModelDtype::None);
        FusedShard { fused, buffers }
    }

    fn upload_f32(&self, values: &[f32]) -> cubecl::server::Handle {
        self.fused
            .client()
            .create_from_slice(bytemuck::cast_slice(values))
    }
}

impl<R: Runtime> DeviceShard for FusedShard<R> {
    fn check(&mut self, grad: &[f32], inv_scale: f32) -> (bool, f64) {
        self.fused.write_grads(&mut self.buffers, grad);
        self.buffers.inv_scale = self.upload_f32(&[inv_scale]);
        self.fused.unscale_and_check(&self.buffers);
        let stats = self.fused.read_f32(&self.buffers.stats);
        (stats[1] > 0.0, f64::from(stats[0]))
    }

    fn update(&mut self, found_inf: bool, total_sum_sq: f64, hyper: Hyper) {
        // The kernels take the global statistics from `stats`, as after an all-reduce on the
        // device; an infinite or NaN total also counts as found-inf there.
        let found = if found_inf { 1.0 } else { 0.0 };
        self.buffers.stats = self.upload_f32(&[total_sum_sq as f32, found]);
        self.fused.update(&self.buffers, hyper);
    }

    fn master(&self) -> Vec<f32> {
        self.fused.read_f32(&self.buffers.master)
    }

    fn state(&self) -> [Vec<f32>; 3] {
        let b = &self.buffers;
        [b.master.clone(), b.m.clone(), b.v.clone()].map(|h| self.fused.read_f32(&h))
    }

    fn load(&mut self, master: &[f32], m: &[f32], v: &[f32], steps_taken: u32) {
        let zeros = vec![0.0; master.len()];
        self.buffers = self
            .fused
            .upload(master, m, v, steps_taken, &zeros, 1.0, ModelDtype::None);
    }

    fn name(&self) -> String {
        format!("{:?}", self.fused.client().properties().hardware)
    }
}
