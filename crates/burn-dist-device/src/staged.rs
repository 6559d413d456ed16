//! Device collectives for any cubecl runtime, staged through the host communicator: read the
//! slices to the host, run the host collective, write the results back in place. This is the
//! path on wgpu (and the CPU twin of the NCCL path in CI), and on CUDA where NCCL is absent.
//!
//! Reads happen when a call is issued, on the calling thread, so they are ordered after the
//! kernels that produced the data; write-backs happen in [`DevicePending::wait`], on the waiting
//! thread, before any kernel launched after it. Only the ranges a call changes are written.

use std::ops::Range;
use std::sync::Arc;

use burn_dist_comm::{Communicator, HostBuffer, HostCommunicator, Pending, ReduceOp};
use cubecl::Runtime;

use crate::collectives::{DeviceCollectives, DevicePending};
use crate::copy::{download, download_all, upload_into};
use crate::error::{DeviceError, Result};
use crate::slice::{DeviceSlice, chunk_ranges};
use crate::traffic::TrafficCounter;

/// [`DeviceCollectives`] over a host communicator.
pub struct StagedCollectives {
    comm: Arc<HostCommunicator>,
    traffic: Arc<TrafficCounter>,
    /// Whether the collectives run on `comm`'s gather lane (`HostCommunicator::gather_lane`).
    gather_lane: bool,
}

impl StagedCollectives {
    /// Collectives staged through `comm`, counting their host traffic in `traffic`.
    pub fn new(comm: Arc<HostCommunicator>, traffic: Arc<TrafficCounter>) -> Self {
        StagedCollectives {
            comm,
            traffic,
            gather_lane: false,
        }
    }

    /// Collectives staged through `comm`'s gather lane (its main lane when it has none), so
    /// that they never wait behind the main lane's: ZeRO stage 3's parameter gathers.
    pub fn on_gather_lane(comm: Arc<HostCommunicator>, traffic: Arc<TrafficCounter>) -> Self {
        StagedCollectives {
            comm,
            traffic,
            gather_lane: true,
        }
    }

    /// The lane these collectives run on.
    fn comm(&self) -> &HostCommunicator {
        match self.gather_lane {
            true => self.comm.gather_lane(),
            false => &self.comm,
        }
    }

    /// After `pending`, writes each `(slice, from, to)`: elements `from` of its result into
    /// elements `to` of `slice`. Every staged collective ends here, and counts as one call.
    fn write_back<R: Runtime>(
        &self,
        pending: Pending<HostBuffer>,
        writes: Vec<(DeviceSlice<R>, Range<usize>, Range<usize>)>,
    ) -> DevicePending {
        let (traffic, rank) = (self.traffic.clone(), self.comm().rank());
        self.traffic.call();
        DevicePending::host(pending, move |result| {
            for (slice, from, to) in writes {
                upload_into(&slice.range(to), &result.slice(from), &traffic, rank)?;
            }
            Ok(())
        })
    }
}

impl StagedCollectives {
    /// Checks a grouped call's `(slice, counts)` parts (one dtype, counts that describe each
    /// slice, slices inside their buffers); each part's chunk ranges, one per rank.
    fn check_parts<R: Runtime>(
        &self,
        parts: &[(DeviceSlice<R>, Vec<usize>)],
        op: &'static str,
    ) -> Result<Vec<Vec<Range<usize>>>> {
        let (rank, world) = (self.comm().rank(), self.comm().world_size());
        let mut chunks = Vec::with_capacity(parts.len());
        for (slice, counts) in parts {
            let first = parts[0].0.dtype;
            if slice.dtype != first {
                return Err(DeviceError::MixedDTypes {
                    rank,
                    op,
                    first,
                    other: slice.dtype,
                });
            }
            chunks.push(chunk_ranges(counts, world, slice.len, rank, op)?);
            slice.check(rank, op)?;
        }
        Ok(chunks)
    }
}

/// Each rank's count in a grouped host collective: its chunks of every part, summed.
fn counts_by_rank(chunks: &[Vec<Range<usize>>], world: usize) -> Vec<usize> {
    (0..world)
        .map(|q| chunks.iter().map(|ranges| ranges[q].len()).sum())
        .collect()
}

/// The elements of `buffers` one after the other (all of one dtype).
fn concat(buffers: &[HostBuffer]) -> HostBuffer {
    let dtype = buffers
        .first()
        .map_or(burn_dist_comm::DType::F32, HostBuffer::dtype);
    let bytes: Vec<u8> = buffers.iter().flat_map(|b| b.as_bytes().to_vec()).collect();
    let mut out = HostBuffer::zeros(dtype, bytes.len() / dtype.size());
    out.as_bytes_mut().copy_from_slice(&bytes);
    out
}

impl<R: Runtime> DeviceCollectives<R> for StagedCollectives {
    fn rank(&self) -> usize {
        self.comm().rank()
    }

    fn world_size(&self) -> usize {
        self.comm().world_size()
    }

    fn all_reduce(&self, slices: &[DeviceSlice<R>], op: ReduceOp) -> Result<DevicePending> {
        const OP: &str = "device all_reduce";
        let rank = self.comm().rank();
        if let Some(first) = slices.first()
            && let Some(other) = slices.iter().find(|s| s.dtype != first.dtype)
        {
            return Err(DeviceError::MixedDTypes {
                rank,
                op: OP,
                first: first.dtype,
                other: other.dtype,
            });
        }
        for slice in slices {
            slice.check(rank, OP)?;
        }
        let parts = download_all(slices, &self.traffic, rank)?;
        let pending = self.comm().all_reduce(concat(&parts), op);
        let mut at = 0;
        let writes = slices
            .iter()
            .map(|slice| {
                at += slice.len;
                (slice.clone(), at - slice.len..at, 0..slice.len)
            })
            .collect();
        Ok(self.write_back(pending, writes))
    }

    fn reduce_scatter(
        &self,
        slice: &DeviceSlice<R>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<DevicePending> {
        const OP: &str = "device reduce_scatter";
        let (rank, world) = (self.comm().rank(), self.comm().world_size());
        let chunks = chunk_ranges(counts, world, slice.len, rank, OP)?;
        slice.check(rank, OP)?;
        let local = download(slice, &self.traffic, rank)?;
        let pending = self
            .comm()
            .reduce_scatter_counts(local, op, counts.to_vec());
        let mine = chunks[rank].clone();
        Ok(self.write_back(pending, vec![(slice.clone(), 0..mine.len(), mine)]))
    }

    fn reduce_scatter_each(
        &self,
        parts: &[(DeviceSlice<R>, Vec<usize>)],
        op: ReduceOp,
    ) -> Result<DevicePending> {
        const OP: &str = "device reduce_scatter_each";
        let (rank, world) = (self.comm().rank(), self.comm().world_size());
        if parts.is_empty() {
            return Ok(DevicePending::done());
        }
        let chunks = self.check_parts(parts, OP)?;
        let local = download_all(parts.iter().map(|(slice, _)| slice), &self.traffic, rank)?;
        // One host reduce-scatter: rank q's chunk is its chunks of every part, in part order.
        let mut by_rank = Vec::with_capacity(world * parts.len());
        for q in 0..world {
            for (part, ranges) in local.iter().zip(&chunks) {
                by_rank.push(part.slice(ranges[q].clone()));
            }
        }
        let counts = counts_by_rank(&chunks, world);
        let pending = self
            .comm()
            .reduce_scatter_counts(concat(&by_rank), op, counts);
        let mut at = 0;
        let writes = parts
            .iter()
            .zip(&chunks)
            .map(|((slice, _), ranges)| {
                let mine = ranges[rank].clone();
                at += mine.len();
                (slice.clone(), at - mine.len()..at, mine)
            })
            .collect();
        Ok(self.write_back(pending, writes))
    }

    fn all_gather_each(
        &self,
        parts: &[(DeviceSlice<R>, Vec<usize>)],
        tag: u32,
    ) -> Result<DevicePending> {
        const OP: &str = "device all_gather";
        let (rank, world) = (self.comm().rank(), self.comm().world_size());
        if parts.is_empty() {
            return Ok(DevicePending::done());
        }
        let chunks = self.check_parts(parts, OP)?;
        let own: Vec<DeviceSlice<R>> = parts
            .iter()
            .zip(&chunks)
            .map(|((slice, _), ranges)| slice.range(ranges[rank].clone()))
            .collect();
        let own = download_all(&own, &self.traffic, rank)?;
        // Rank q's chunk of the host all-gather: its chunks of every part, in part order.
        let counts = counts_by_rank(&chunks, world);
        let pending = self.comm().all_gather_counts(concat(&own), counts, tag);
        let mut writes = Vec::new();
        let mut at = 0;
        for q in 0..world {
            for ((slice, _), ranges) in parts.iter().zip(&chunks) {
                let chunk = ranges[q].clone();
                if q != rank && !chunk.is_empty() {
                    writes.push((slice.clone(), at..at + chunk.len(), chunk.clone()));
                }
                at += chunk.len();
            }
        }
        Ok(self.write_back(pending, writes))
    }

    fn broadcast(&self, slice: &DeviceSlice<R>, root: usize) -> Result<DevicePending> {
        const OP: &str = "device broadcast";
        let (rank, world) = (self.comm().rank(), self.comm().world_size());
        if root >= world {
            return Err(DeviceError::Root {
                rank,
                op: OP,
                root,
                world,
            });
        }
        slice.check(rank, OP)?;
        let local = if rank == root {
            download(slice, &self.traffic, rank)?
        } else {
            HostBuffer::zeros(slice.dtype.host(), slice.len)
        };
        let pending = self.comm().broadcast(local, root);
        let back = if rank == root {
            Vec::new()
        } else {
            vec![(slice.clone(), 0..slice.len, 0..slice.len)]
        };
        Ok(self.write_back(pending, back))
    }

    fn traffic(&self) -> &Arc<TrafficCounter> {
        &self.traffic
    }

    fn name(&self) -> &'static str {
        "staged through the host"
    }
}
