//! Burn backends whose float tensors live in cubecl device memory: burn-cubecl's backends
//! without fusion (`CubeBackend<R, ..>`) and with it (`Fusion<CubeBackend<R, ..>>`, Burn's
//! default `Cuda` and `Wgpu`). The device path reaches their memory through this trait, with no
//! host round trip.

use burn_backend::{Backend, TensorMetadata};
use burn_cubecl::cubecl;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::stream::OperationStreams;
use burn_fusion::{Fusion, NoOp};
use burn_ir::{BackendIr, InitOperationIr, OperationIr};

/// A Burn backend whose float primitive is, or wraps, a cubecl tensor of runtime
/// [`CubeResident::Runtime`].
pub trait CubeResident: Backend {
    /// The cubecl runtime the tensors live on.
    type Runtime: CubeRuntime;

    /// The cubecl device of a Burn device of this backend (the same device).
    fn cube_device(device: &Self::Device) -> <Self::Runtime as cubecl::Runtime>::Device;

    /// The cubecl tensor behind `tensor` (the same memory, no copy), and whether nothing else
    /// holds that memory (so it may be written in place). With fusion this first runs what the
    /// fusion stream still holds for the tensor, and the memory is never exclusive: fusion's
    /// own handle still refers to it.
    fn cube_view(tensor: &Self::FloatTensorPrimitive) -> (CubeTensor<Self::Runtime>, bool);

    /// A float primitive over `tensor`'s memory (no copy). With fusion, registered as a new
    /// tensor of the fusion stream, so that later fused operations read it.
    fn from_cube(tensor: CubeTensor<Self::Runtime>) -> Self::FloatTensorPrimitive;
}

impl<R, F, I, BT> CubeResident for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    type Runtime = R;

    fn cube_device(device: &R::Device) -> R::Device {
        device.clone()
    }

    fn cube_view(tensor: &CubeTensor<R>) -> (CubeTensor<R>, bool) {
        // Asked before the clone, which shares the handle.
        let unique = tensor.can_mut();
        (tensor.clone(), unique)
    }

    fn from_cube(tensor: CubeTensor<R>) -> CubeTensor<R> {
        tensor
    }
}

impl<R, F, I, BT> CubeResident for Fusion<CubeBackend<R, F, I, BT>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    type Runtime = R;

    fn cube_device(device: &R::Device) -> R::Device {
        device.clone()
    }

    fn cube_view(tensor: &Self::FloatTensorPrimitive) -> (CubeTensor<R>, bool) {
        // A clone is resolved read-only: fusion keeps its handle, so the memory is shared.
        let client = tensor.client.clone();
        let view = client.resolve_tensor_float::<CubeBackend<R, F, I, BT>>(tensor.clone());
        (view, false)
    }

    fn from_cube(tensor: CubeTensor<R>) -> Self::FloatTensorPrimitive {
        let client = burn_fusion::get_client::<CubeBackend<R, F, I, BT>>(&tensor.device);
        let (shape, dtype) = (tensor.shape(), tensor.dtype);
        let handle = CubeBackend::<R, F, I, BT>::float_tensor_handle(tensor);
        let init = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
        client
            .register(
                OperationStreams::default(),
                OperationIr::Init(init),
                NoOp::<CubeBackend<R, F, I, BT>>::new(),
            )
            .remove(0)
    }
}
