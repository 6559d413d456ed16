//! How much device memory is left, where the runtime can say: so that an allocation known to
//! be too large fails with an error naming what it was for, before cubecl's allocator fails
//! deep inside a later operation.

use std::any::Any;

use cubecl::Runtime;
use cubecl::prelude::ComputeClient;

/// A device's memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// What a new allocation can still take: the driver's free memory plus what cubecl has
    /// reserved and holds no tensor in.
    pub available: u64,
    /// The device's whole memory.
    pub total: u64,
}

/// The memory of `device` (of runtime `R`, whose client is `client`), where the runtime says:
/// CUDA (the driver's `cuMemGetInfo` on the device's primary context, the one cubecl uses).
/// `None` on other runtimes (wgpu does not tell), or when the driver does not answer.
pub fn device_memory<R: Runtime>(
    client: &ComputeClient<R>,
    device: &R::Device,
) -> Option<DeviceMemory> {
    let (free, total) = driver_memory(device as &dyn Any)?;
    // Reserved by cubecl's pools but free of tensors: the next allocation reuses it.
    let pooled = client.memory_usage().ok().map_or(0, |usage| {
        usage.bytes_reserved.saturating_sub(usage.bytes_in_use)
    });
    Some(DeviceMemory {
        available: free + pooled,
        total,
    })
}

#[cfg(feature = "cuda")]
fn driver_memory(device: &dyn Any) -> Option<(u64, u64)> {
    use cudarc::driver::result;
    let device = device.downcast_ref::<cubecl::cuda::CudaDevice>()?;
    // SAFETY: plain driver queries. The primary context is retained for the query and
    // released after it (cubecl holds its own reference, so it stays alive), and made current
    // on this thread, as cubecl-cuda makes it current on the threads it runs on.
    unsafe {
        result::init().ok()?;
        let handle = result::device::get(i32::try_from(device.index).ok()?).ok()?;
        let context = result::primary_ctx::retain(handle).ok()?;
        let queried = result::ctx::set_current(context)
            .ok()
            .and_then(|()| result::mem_get_info().ok());
        let _ = result::primary_ctx::release(handle);
        let (free, total) = queried?;
        Some((free as u64, total as u64))
    }
}

#[cfg(not(feature = "cuda"))]
fn driver_memory(_: &dyn Any) -> Option<(u64, u64)> {
    None
}
