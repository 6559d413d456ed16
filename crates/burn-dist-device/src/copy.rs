//! Moving a slice between host and device, and between two places on the device: one copy
//! kernel, so that a slice at any element offset can be read or written (a buffer binding's
//! offset must be aligned on wgpu; a kernel's index need not be).

use burn_dist_comm::HostBuffer;
use cubecl::prelude::*;
use cubecl::server::{Handle, ServerError};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use crate::error::{DeviceError, Result};
use crate::slice::{DeviceDType, DeviceSlice};
use crate::traffic::TrafficCounter;

/// Units per cube of the copy.
const CUBE_SIZE: u32 = 256;

/// `dst[dst_offset + i] = src[src_offset + i]` for `i < len`, converted to `O` (rounded to
/// nearest even when it narrows).
#[cube(launch)]
fn copy_range<I: Float, O: Float>(
    src: &Array<I>,
    dst: &mut Array<O>,
    src_offset: u32,
    dst_offset: u32,
    len: u32,
) {
    if ABSOLUTE_POS < len as usize {
        dst[dst_offset as usize + ABSOLUTE_POS] =
            O::cast_from(src[src_offset as usize + ABSOLUTE_POS]);
    }
}

/// Fails unless `client`'s runtime can hold `dtype` (f16 on WGSL needs `shader-f16`; WGSL has
/// no bf16).
pub(crate) fn check_dtype<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: DeviceDType,
    rank: usize,
    op: &'static str,
) -> Result<()> {
    let native = match dtype {
        DeviceDType::F32 => return Ok(()),
        DeviceDType::F16 => half::f16::as_type_native_unchecked(),
        DeviceDType::BF16 => half::bf16::as_type_native_unchecked(),
    };
    if client.properties().supports_type(native) {
        Ok(())
    } else {
        Err(DeviceError::UnsupportedDType {
            rank,
            op,
            dtype,
            runtime: R::name(client).to_string(),
        })
    }
}

/// Copies `src` into `dst` on the device, converting from `src`'s dtype to `dst`'s. Both must
/// have the same length and lie inside their buffers; the runtime must have both dtypes.
pub fn copy<R: Runtime>(src: &DeviceSlice<R>, dst: &DeviceSlice<R>, rank: usize) -> Result<()> {
    const OP: &str = "copying a device slice";
    for slice in [src, dst] {
        slice.check(rank, OP)?;
        check_dtype(&slice.client, slice.dtype, rank, OP)?;
    }
    if src.len != dst.len {
        return Err(DeviceError::Device {
            rank,
            op: OP,
            reason: format!("{} elements into {}", src.len, dst.len),
        });
    }
    copy_slice(src, dst);
    Ok(())
}

/// [`copy`] without the checks (the callers here checked).
pub(crate) fn copy_slice<R: Runtime>(src: &DeviceSlice<R>, dst: &DeviceSlice<R>) {
    debug_assert_eq!(src.len, dst.len);
    if src.len == 0 {
        return;
    }
    let client = &dst.client;
    let count = cubecl::calculate_cube_count_elemwise(client, src.len, CubeDim::new_1d(CUBE_SIZE));
    macro_rules! launch {
        ($i:ty, $o:ty) => {
            // SAFETY: both ranges were checked against their buffers' sizes (`check`), and
            // the kernel writes only `dst[dst_offset..dst_offset + len]`.
            unsafe {
                copy_range::launch::<$i, $o, R>(
                    client,
                    count,
                    CubeDim::new_1d(CUBE_SIZE),
                    ArrayArg::from_raw_parts(src.handle.clone(), src.buffer_len()),
                    ArrayArg::from_raw_parts(dst.handle.clone(), dst.buffer_len()),
                    src.offset as u32,
                    dst.offset as u32,
                    src.len as u32,
                )
            }
        };
    }
    macro_rules! to {
        ($i:ty) => {
            match dst.dtype {
                DeviceDType::F32 => launch!($i, f32),
                DeviceDType::F16 => launch!($i, half::f16),
                DeviceDType::BF16 => launch!($i, half::bf16),
            }
        };
    }
    match src.dtype {
        DeviceDType::F32 => to!(f32),
        DeviceDType::F16 => to!(half::f16),
        DeviceDType::BF16 => to!(half::bf16),
    }
}

/// Reads `slice` to the host, counting the bytes in `counter`.
pub fn download<R: Runtime>(
    slice: &DeviceSlice<R>,
    counter: &TrafficCounter,
    rank: usize,
) -> Result<HostBuffer> {
    download_async(slice, counter, rank)?.wait()
}

/// A read of a device slice that was issued and not yet waited for ([`download_async`]).
pub struct PendingDownload {
    /// The runtime's read of the staging copy; `None` for an empty slice.
    read: Option<Read>,
    dtype: DeviceDType,
    /// Bytes of the slice (the staging buffer may be larger).
    bytes: usize,
    rank: usize,
}

type ReadResult = std::result::Result<Vec<cubecl::bytes::Bytes>, ServerError>;

/// A read in flight, or already over when it was issued.
enum Read {
    InFlight(Pin<Box<dyn Future<Output = ReadResult> + Send>>),
    Done(ReadResult),
}

impl Read {
    /// Issues the read of `handle` now. cubecl's `read_async` borrows the client, so the
    /// future that outlives this call owns a clone and calls it on its first poll, which is
    /// made here (with a waker that does nothing: the wait polls it again with its own).
    fn issue<R: Runtime>(client: &ComputeClient<R>, handle: Handle) -> Self {
        let client = client.clone();
        let mut read: Pin<Box<dyn Future<Output = ReadResult> + Send>> =
            Box::pin(async move { client.read_async(vec![handle]).await });
        match read.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(result) => Read::Done(result),
            Poll::Pending => Read::InFlight(read),
        }
    }

    fn wait(self) -> ReadResult {
        match self {
            Read::InFlight(read) => cubecl::reader::read_sync(read),
            Read::Done(result) => result,
        }
    }
}

impl PendingDownload {
    /// Waits for the read: the slice's values as they were when it was issued.
    pub fn wait(self) -> Result<HostBuffer> {
        const OP: &str = "reading a device slice";
        let Some(read) = self.read else {
            return Ok(HostBuffer::zeros(self.dtype.host(), 0));
        };
        let bytes = read
            .wait()
            .map_err(|e| DeviceError::Device {
                rank: self.rank,
                op: OP,
                reason: format!("{e:?}"),
            })?
            .remove(0);
        let bytes = &bytes[..self.bytes];
        Ok(match self.dtype {
            DeviceDType::F32 => HostBuffer::F32(bytemuck::pod_collect_to_vec(bytes)),
            DeviceDType::F16 => HostBuffer::F16(bytemuck::pod_collect_to_vec(bytes)),
            DeviceDType::BF16 => HostBuffer::BF16(bytemuck::pod_collect_to_vec(bytes)),
        })
    }
}

/// Issues a read of `slice` to the host and returns without waiting for it, counting the
/// bytes in `counter`: the slice is copied into a staging buffer in stream order, so later
/// kernels on the slice do not change what is read, and the runtime's read of that copy runs
/// while the caller goes on (cubecl-cuda reads into its page-locked pool; wgpu maps the
/// buffer).
pub fn download_async<R: Runtime>(
    slice: &DeviceSlice<R>,
    counter: &TrafficCounter,
    rank: usize,
) -> Result<PendingDownload> {
    const OP: &str = "reading a device slice";
    slice.check(rank, OP)?;
    check_dtype(&slice.client, slice.dtype, rank, OP)?;
    let mut pending = PendingDownload {
        read: None,
        dtype: slice.dtype,
        bytes: slice.bytes(),
        rank,
    };
    if slice.len == 0 {
        return Ok(pending);
    }
    let staging = DeviceSlice::whole(
        slice.client.clone(),
        slice.client.empty(slice.bytes()),
        slice.dtype,
    );
    copy_slice(slice, &staging.range(0..slice.len));
    pending.read = Some(Read::issue(&slice.client, staging.handle));
    counter.to_host(slice.bytes());
    Ok(pending)
}

/// Reads every slice of `slices` to the host: all the reads are issued before the first is
/// waited for, so that the runtime copies them back to back instead of one round trip each.
pub(crate) fn download_all<'a, R: Runtime>(
    slices: impl IntoIterator<Item = &'a DeviceSlice<R>>,
    counter: &TrafficCounter,
    rank: usize,
) -> Result<Vec<HostBuffer>> {
    let issued = slices
        .into_iter()
        .map(|slice| download_async(slice, counter, rank))
        .collect::<Result<Vec<_>>>()?;
    issued.into_iter().map(PendingDownload::wait).collect()
}

/// A device buffer holding `bytes`, uploaded from page-locked host memory where the runtime
/// has it: cubecl-cuda copies them into its pinned pool first (`ComputeClient::staging`), so
/// the copy to the device is a DMA from pinned memory and not the driver's pageable path;
/// wgpu has no such pool (its `staging` answers "unsupported" and the bytes stay where they
/// are: wgpu copies them into its own mapped staging buffer either way).
pub fn create_staged<R: Runtime>(client: &ComputeClient<R>, bytes: &[u8]) -> Handle {
    let mut data = cubecl::bytes::Bytes::from_bytes_vec(bytes.to_vec());
    client.staging(std::iter::once(&mut data), false);
    client.create(data)
}

/// Writes `values` (of the slice's length and dtype) into `slice` on the device, counting the
/// bytes in `counter`. Ordered after every kernel already launched on the slice's client.
pub fn upload_into<R: Runtime>(
    slice: &DeviceSlice<R>,
    values: &HostBuffer,
    counter: &TrafficCounter,
    rank: usize,
) -> Result<()> {
    const OP: &str = "writing a device slice";
    slice.check(rank, OP)?;
    check_dtype(&slice.client, slice.dtype, rank, OP)?;
    if values.dtype() != slice.dtype.host() || values.len() != slice.len {
        return Err(DeviceError::Device {
            rank,
            op: OP,
            reason: format!(
                "{} elements of {} given for a slice of {} elements of {}",
                values.len(),
                values.dtype(),
                slice.len,
                slice.dtype
            ),
        });
    }
    if slice.len == 0 {
        return Ok(());
    }
    counter.to_device(values.as_bytes().len());
    let staged = DeviceSlice::whole(
        slice.client.clone(),
        create_staged(&slice.client, values.as_bytes()),
        slice.dtype,
    );
    copy_slice(&staged.range(0..slice.len), slice);
    Ok(())
}
