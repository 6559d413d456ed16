//! ZeRO stage 3 on the device path: this rank's pieces of the sharded parameters live in one
//! device buffer (its shard of the flat layout, in the parameters' dtype), and a gather writes
//! every rank's pieces of a unit of parameters straight into fresh device buffers, one per
//! parameter, which become the backend's tensors with no copy through the host.
//!
//! A gather: a fresh buffer per parameter; this rank's piece copied into its place by a device
//! copy; one `all_gather_each` of the unit on the gather collectives (NCCL in place, or staged
//! through the host communicator's gather lane); each buffer then handed to the backend
//! (`CubeResident::from_cube`, so that fusion sees it). The shard buffer itself is what ZeroAdam
//! updates in place at stage 3 (its master weights in f32, its model-dtype copy otherwise).

use std::any::Any;
use std::ops::Range;
use std::sync::Arc;

use burn::tensor::{DType, Shape, TensorData};
use burn_cubecl::cubecl::Runtime;
use burn_cubecl::cubecl::prelude::ComputeClient;
use burn_cubecl::cubecl::server::Handle;
use burn_cubecl::tensor::CubeTensor;
use burn_dist_comm::{CommError, HostBuffer};
use burn_dist_device::{
    DeviceCollectives, DeviceError, DevicePending, DeviceSlice, copy, download, upload_into,
};

use super::resident::CubeResident;

/// One parameter of a unit to gather.
#[derive(Debug, Clone)]
pub(crate) struct GatherPart {
    pub shape: Vec<usize>,
    /// Elements of the parameter each rank's piece holds, in rank order.
    pub counts: Vec<usize>,
    /// This rank's piece: where it lies in the shard, and where in the parameter.
    pub mine: Option<(Range<usize>, Range<usize>)>,
}

/// This rank's pieces in device memory, whatever the backend (`ParamShards` is not generic).
pub(crate) trait DevicePieces: Send + Sync {
    /// Issues the gather of `parts` (adjacent parameters) into fresh device buffers; `tag`
    /// names the first parameter to the peers.
    fn issue(&self, parts: &[GatherPart], tag: u32) -> Result<Box<dyn DeviceGathering>, CommError>;
    /// The whole shard as f32 (padding included), read to the host.
    fn shard_values(&self) -> Vec<f32>;
    /// Replaces the whole shard by `values` (f32, rounded to the pieces' dtype), from the host.
    fn write_shard(&self, values: &[f32]);
    /// Elements `range` of the shard, in the pieces' dtype, read to the host.
    fn read(&self, range: Range<usize>) -> Vec<u8>;
    /// Writes `bytes` (in the pieces' dtype) into elements `range` of the shard.
    fn write(&self, range: Range<usize>, bytes: &[u8]);
    /// The shard buffer and its dtype: ZeroAdam's stage-3 step updates it in place.
    fn shard(&self) -> (Handle, DType);
}

/// A device gather in flight.
pub(crate) trait DeviceGathering: Send {
    /// Waits for it; one float primitive of the backend per parameter, boxed.
    fn finish(self: Box<Self>) -> Result<Vec<Box<dyn Any + Send>>, CommError>;
}

/// A device collective's failure as the communicator error a failed gather reports (the group
/// aborted, a peer's death…), or, for a device failure, an I/O error that says so.
fn comm_error(error: DeviceError) -> CommError {
    match error {
        DeviceError::Comm(error) => error,
        other => CommError::Io {
            context: "a device gather".into(),
            message: other.to_string(),
        },
    }
}

/// A read or write of the pieces that the device refused (lost, out of memory): the callers
/// (checkpoints, records, a host optimizer) return no error, so it ends the rank with what
/// went wrong.
fn failed(what: &str, error: DeviceError) -> ! {
    panic!("burn-dist: {what}: {error}")
}

/// [`DevicePieces`] of backend `B`.
pub(crate) struct CubePieces<B: CubeResident> {
    gathers: Arc<dyn DeviceCollectives<B::Runtime>>,
    client: ComputeClient<B::Runtime>,
    device: <B::Runtime as Runtime>::Device,
    dtype: DType,
    shard: DeviceSlice<B::Runtime>,
    rank: usize,
}

impl<B: CubeResident> CubePieces<B> {
    /// Uploads `shard` (this rank's shard of the flat layout, `len` elements of `dtype`, as
    /// bytes) to `device`; gathers go through `gathers`.
    pub(crate) fn new(
        gathers: Arc<dyn DeviceCollectives<B::Runtime>>,
        device: <B::Runtime as Runtime>::Device,
        dtype: DType,
        shard: &[u8],
    ) -> Result<Self, DeviceError> {
        let rank = gathers.rank();
        let device_dtype = super::device_dtype(dtype).ok_or_else(|| DeviceError::Device {
            rank,
            op: "placing the sharded parameters on the device",
            reason: format!("the device path moves f32, f16 and bf16, not {dtype:?}"),
        })?;
        let client = B::Runtime::client(&device);
        let len = shard.len() / dtype.size();
        // One element at least: cubecl gives no buffer of 0 bytes.
        let handle = client.empty(shard.len().max(dtype.size()));
        let slice = DeviceSlice::new(client.clone(), handle, 0, len, device_dtype);
        let mut values = HostBuffer::zeros(device_dtype.host(), len);
        values.as_bytes_mut().copy_from_slice(shard);
        upload_into(&slice, &values, gathers.traffic(), rank)?;
        Ok(CubePieces {
            gathers,
            client,
            device,
            dtype,
            shard: slice,
            rank,
        })
    }

    fn host_buffer(&self, bytes: &[u8]) -> HostBuffer {
        let mut values =
            HostBuffer::zeros(self.shard.dtype.host(), bytes.len() / self.dtype.size());
        values.as_bytes_mut().copy_from_slice(bytes);
        values
    }
}

impl<B: CubeResident> DevicePieces for CubePieces<B> {
    fn issue(&self, parts: &[GatherPart], tag: u32) -> Result<Box<dyn DeviceGathering>, CommError> {
        let elem = self.dtype.size();
        let mut slices = Vec::with_capacity(parts.len());
        for part in parts {
            let numel: usize = part.shape.iter().product();
            let handle = self.client.empty((numel * elem).max(elem));
            let slice = DeviceSlice::new(self.client.clone(), handle, 0, numel, self.shard.dtype);
            if let Some((in_shard, within)) = &part.mine {
                copy(
                    &self.shard.range(in_shard.clone()),
                    &slice.range(within.clone()),
                    self.rank,
                )
                .map_err(comm_error)?;
            }
            slices.push((slice, part.counts.clone()));
        }
        let pending = self
            .gathers
            .all_gather_each(&slices, tag)
            .map_err(comm_error)?;
        Ok(Box::new(CubeGathering::<B> {
            pending,
            tensors: slices
                .into_iter()
                .zip(parts)
                .map(|((slice, _), part)| (slice.handle, part.shape.clone()))
                .collect(),
            client: self.client.clone(),
            device: self.device.clone(),
            dtype: self.dtype,
        }))
    }

    fn shard_values(&self) -> Vec<f32> {
        download(&self.shard, self.gathers.traffic(), self.rank)
            .unwrap_or_else(|e| failed("reading this rank's pieces from the device", e))
            .to_f32_vec()
    }

    fn write_shard(&self, values: &[f32]) {
        // Rounded as the host path rounds (`ParamShards::write_shard`): Burn's conversion.
        let data = TensorData::new(values.to_vec(), [values.len()]).convert_dtype(self.dtype);
        let values = self.host_buffer(&data.into_bytes());
        upload_into(&self.shard, &values, self.gathers.traffic(), self.rank)
            .unwrap_or_else(|e| failed("writing this rank's pieces to the device", e));
    }

    fn read(&self, range: Range<usize>) -> Vec<u8> {
        download(&self.shard.range(range), self.gathers.traffic(), self.rank)
            .unwrap_or_else(|e| failed("reading a piece from the device", e))
            .as_bytes()
            .to_vec()
    }

    fn write(&self, range: Range<usize>, bytes: &[u8]) {
        let values = self.host_buffer(bytes);
        upload_into(
            &self.shard.range(range),
            &values,
            self.gathers.traffic(),
            self.rank,
        )
        .unwrap_or_else(|e| failed("writing a piece to the device", e));
    }

    fn shard(&self) -> (Handle, DType) {
        (self.shard.handle.clone(), self.dtype)
    }
}

/// A gather of backend `B` in flight: its collective and the buffers it fills.
struct CubeGathering<B: CubeResident> {
    pending: DevicePending,
    tensors: Vec<(Handle, Vec<usize>)>,
    client: ComputeClient<B::Runtime>,
    device: <B::Runtime as Runtime>::Device,
    dtype: DType,
}

impl<B: CubeResident> DeviceGathering for CubeGathering<B> {
    fn finish(self: Box<Self>) -> Result<Vec<Box<dyn Any + Send>>, CommError> {
        let this = *self;
        this.pending.wait().map_err(comm_error)?;
        Ok(this
            .tensors
            .into_iter()
            .map(|(handle, shape)| {
                let tensor = CubeTensor::new_contiguous(
                    this.client.clone(),
                    this.device.clone(),
                    Shape::from(shape),
                    handle,
                    this.dtype,
                );
                Box::new(B::from_cube(tensor)) as Box<dyn Any + Send>
            })
            .collect())
    }
}
