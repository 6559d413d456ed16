//! Device collectives in place on CUDA memory through NCCL (feature `cuda`): nothing crosses to
//! the host.
//!
//! Each call is one NCCL group on the communicator's stream: an all-reduce per slice; a
//! reduce-scatter of uneven chunks as one `ncclReduce` per owner; an all-gather of uneven
//! chunks as one `ncclBroadcast` per owner (NCCL's own collectives take equal chunks only).
//!
//! Ordering: cubecl-cuda 0.10 has no accessor for its compute stream, so NCCL's stream cannot
//! wait on it with an event; a call first waits on the host until the compute stream has run
//! what was queued (`ComputeClient::sync`), and [`DevicePending::wait`] returns once NCCL's
//! completion event has been seen, so kernels launched afterwards see the results.

use std::sync::Arc;

use burn_dist_comm::{Communicator, InPlaceGroup, InPlaceOp, NcclCommunicator, RawSlice, ReduceOp};
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cubecl::server::Handle;

use crate::collectives::{DeviceCollectives, DevicePending};
use crate::error::{DeviceError, Result};
use crate::slice::{DeviceSlice, chunk_ranges};
use crate::traffic::TrafficCounter;

/// [`DeviceCollectives`] on CUDA memory through an NCCL communicator of the same GPU.
pub struct NcclCollectives {
    comm: Arc<NcclCommunicator>,
    traffic: Arc<TrafficCounter>,
}

impl NcclCollectives {
    /// Collectives on `comm`, recording in `traffic` (they move nothing through the host
    /// themselves; the counter is shared with the callers' scalar reads).
    pub fn new(comm: Arc<NcclCommunicator>, traffic: Arc<TrafficCounter>) -> Self {
        NcclCollectives { comm, traffic }
    }

    /// One NCCL group of `calls`, in place.
    fn group(
        &self,
        op: &'static str,
        calls: Vec<(DeviceSlice<CudaRuntime>, InPlaceOp)>,
    ) -> Result<DevicePending> {
        let rank = self.comm.rank();
        let mut raw = Vec::with_capacity(calls.len());
        let mut keep = Vec::with_capacity(calls.len());
        let mut client = None;
        for (slice, call) in calls {
            slice.check(rank, op)?;
            if slice.len == 0 {
                continue;
            }
            let (ptr, resource) = device_address(&slice.client, &slice.handle)
                .map_err(|reason| DeviceError::Device { rank, op, reason })?;
            raw.push((
                RawSlice {
                    ptr: ptr + (slice.offset * slice.dtype.size()) as u64,
                    len: slice.len,
                    dtype: slice.dtype.host(),
                },
                call,
            ));
            client.get_or_insert_with(|| slice.client.clone());
            keep.push((slice.handle, resource));
        }
        let Some(client) = client else {
            return Ok(DevicePending::done());
        };
        self.traffic.call();
        cubecl::future::block_on(client.sync()).map_err(|e| DeviceError::Device {
            rank,
            op,
            reason: format!("synchronizing the compute stream: {e:?}"),
        })?;
        let group = InPlaceGroup {
            calls: raw,
            keep_alive: Box::new(keep),
        };
        // SAFETY: every slice was checked to lie inside its buffer, which `keep` holds (handle
        // and resolved resource) until NCCL is done; the compute stream has drained, and the
        // caller launches nothing on these slices before waiting.
        let pending = unsafe { self.comm.in_place(group) };
        Ok(DevicePending::in_place(pending))
    }
}

impl NcclCollectives {
    /// One call per owner's chunk of every `(slice, counts)` of `parts`: `call(owner)` on it
    /// (NCCL's own reduce-scatter and all-gather take equal chunks only).
    fn per_owner(
        &self,
        parts: &[(DeviceSlice<CudaRuntime>, Vec<usize>)],
        op: &'static str,
        call: impl Fn(usize) -> InPlaceOp,
    ) -> Result<Vec<(DeviceSlice<CudaRuntime>, InPlaceOp)>> {
        let mut calls = Vec::new();
        for (slice, counts) in parts {
            let chunks = chunk_ranges(counts, self.comm.world_size(), slice.len, self.rank(), op)?;
            calls.extend(
                chunks
                    .into_iter()
                    .enumerate()
                    .map(|(owner, chunk)| (slice.range(chunk), call(owner))),
            );
        }
        Ok(calls)
    }
}

/// The device address of `handle`'s first byte (its offset into the memory page included),
/// with cubecl's resource, which keeps the memory out of the pool while it lives.
pub fn device_address(
    client: &ComputeClient<CudaRuntime>,
    handle: &Handle,
) -> Result<(u64, impl Send + 'static), String> {
    let resource = client
        .get_resource(handle.clone())
        .map_err(|e| format!("cubecl could not resolve the memory: {e:?}"))?;
    Ok((resource.resource().ptr, resource))
}

impl DeviceCollectives<CudaRuntime> for NcclCollectives {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_reduce(
        &self,
        slices: &[DeviceSlice<CudaRuntime>],
        op: ReduceOp,
    ) -> Result<DevicePending> {
        let calls = slices
            .iter()
            .map(|s| (s.clone(), InPlaceOp::AllReduce(op)))
            .collect();
        self.group("device all_reduce", calls)
    }

    fn reduce_scatter(
        &self,
        slice: &DeviceSlice<CudaRuntime>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<DevicePending> {
        const OP: &str = "device reduce_scatter";
        let chunks = chunk_ranges(counts, self.comm.world_size(), slice.len, self.rank(), OP)?;
        let calls = chunks
            .into_iter()
            .enumerate()
            .map(|(root, chunk)| (slice.range(chunk), InPlaceOp::Reduce { root, op }))
            .collect();
        self.group(OP, calls)
    }

    fn reduce_scatter_each(
        &self,
        parts: &[(DeviceSlice<CudaRuntime>, Vec<usize>)],
        op: ReduceOp,
    ) -> Result<DevicePending> {
        const OP: &str = "device reduce_scatter_each";
        let calls = self.per_owner(parts, OP, |root| InPlaceOp::Reduce { root, op })?;
        self.group(OP, calls)
    }

    fn all_gather_each(
        &self,
        parts: &[(DeviceSlice<CudaRuntime>, Vec<usize>)],
        _tag: u32,
    ) -> Result<DevicePending> {
        const OP: &str = "device all_gather";
        let calls = self.per_owner(parts, OP, |root| InPlaceOp::Broadcast { root })?;
        self.group(OP, calls)
    }

    fn broadcast(&self, slice: &DeviceSlice<CudaRuntime>, root: usize) -> Result<DevicePending> {
        const OP: &str = "device broadcast";
        let world = self.comm.world_size();
        if root >= world {
            return Err(DeviceError::Root {
                rank: self.rank(),
                op: OP,
                root,
                world,
            });
        }
        self.group(OP, vec![(slice.clone(), InPlaceOp::Broadcast { root })])
    }

    fn traffic(&self) -> &Arc<TrafficCounter> {
        &self.traffic
    }

    fn name(&self) -> &'static str {
        "nccl"
    }
}
