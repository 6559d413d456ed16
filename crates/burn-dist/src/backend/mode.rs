//! The decorator's modes: what its float primitive is, and how an op hands it to `B`.
//!
//! [`DistributedBackend<B, P>`](crate::DistributedBackend) is one decorator with two modes:
//! - [`Replicated`] (the default): the float primitive *is* `B`'s, every conversion below is the
//!   identity, and every op compiles to a direct call of `B`'s (DDP, ZeRO stages 1 and 2).
//! - [`Sharded`](crate::Sharded) (ZeRO stage 3): a float primitive is either a local tensor of
//!   `B` or a handle to a parameter whose elements are spread over the ranks. An op that
//!   receives a handle gathers it, calls `B`'s op, and releases the full copy when the op
//!   returns.
//!
//! The forwarding (`forward.rs`) is written once against this trait, from signature lists whose
//! float arguments and results the generator tags, so both modes run the same generated code.

use core::fmt;

use burn_backend::{Backend, TensorMetadata};

use super::view::View;

/// How [`DistributedBackend<B, Self>`](crate::DistributedBackend) represents and hands over
/// float tensors. Implemented by [`Replicated`] and [`Sharded`](crate::Sharded) only.
pub trait Mode<B: Backend>:
    Clone + Copy + Default + fmt::Debug + Send + Sync + 'static + sealed::Sealed
{
    /// The decorator's float tensor primitive.
    type Float: TensorMetadata + 'static;

    /// Runs one of `B`'s ops: whatever `enter` gathered for it is released when it returns.
    fn op<R>(run: impl FnOnce() -> R) -> R;

    /// A float argument of an op, as `B` takes it (a handle is gathered, its views replayed).
    fn enter(tensor: Self::Float) -> B::FloatTensorPrimitive;

    /// A float argument that `B`'s op reads only for its shape, dtype and device (the
    /// generator's list `METADATA_ONLY`): a handle passes as a one-element stand-in of its
    /// shape, not gathered.
    fn enter_meta(tensor: Self::Float) -> B::FloatTensorPrimitive;

    /// A float result of one of `B`'s ops.
    fn leave(tensor: B::FloatTensorPrimitive) -> Self::Float;

    /// A shape operation: `B`'s on a local tensor, recorded on a handle (never a gather).
    fn view(tensor: Self::Float, view: View) -> Self::Float;

    /// `B`'s `float_detach` on a local tensor; a handle unchanged (the inner backend tracks no
    /// gradients, so there is nothing to detach it from).
    fn detach(tensor: Self::Float) -> Self::Float;

    /// The tensor on `device` (a handle moves without gathering).
    fn to_device(tensor: Self::Float, device: &B::Device) -> Self::Float;

    /// Its device, without gathering.
    fn device(tensor: &Self::Float) -> B::Device;

    /// `B`'s `float_set_require_grad` on a local tensor; a handle records it (clearing it is
    /// how Burn's `valid()` makes the evaluation model, whose gathers follow their own schedule).
    fn set_require_grad(tensor: Self::Float, require_grad: bool) -> Self::Float;

    /// Whether `B` tracks gradients for it (a handle: no, as for any inner-backend tensor).
    fn is_require_grad(tensor: &Self::Float) -> bool;

    /// The tensor as `B`'s, to read its values outside any op (`into_data`); counted.
    fn read(tensor: Self::Float) -> B::FloatTensorPrimitive;

    /// `B`'s tensor in place, for the backward hooks, which read and replace gradients in
    /// Burn's container (a handle there is first gathered in place; counted as a read).
    fn local_mut(tensor: &mut Self::Float) -> &mut B::FloatTensorPrimitive;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Replicated {}
    impl Sealed for crate::Sharded {}
}

/// The default mode: every rank holds every parameter; the decorator is `B` with hooks.
#[derive(Clone, Copy, Default, Debug)]
pub struct Replicated;

impl<B: Backend> Mode<B> for Replicated {
    type Float = B::FloatTensorPrimitive;

    #[inline(always)]
    fn op<R>(run: impl FnOnce() -> R) -> R {
        run()
    }

    #[inline(always)]
    fn enter(tensor: Self::Float) -> B::FloatTensorPrimitive {
        tensor
    }

    #[inline(always)]
    fn enter_meta(tensor: Self::Float) -> B::FloatTensorPrimitive {
        tensor
    }

    #[inline(always)]
    fn leave(tensor: B::FloatTensorPrimitive) -> Self::Float {
        tensor
    }

    #[inline(always)]
    fn view(tensor: Self::Float, view: View) -> Self::Float {
        view.apply::<B>(tensor)
    }

    #[inline(always)]
    fn detach(tensor: Self::Float) -> Self::Float {
        B::float_detach(tensor)
    }

    #[inline(always)]
    fn to_device(tensor: Self::Float, device: &B::Device) -> Self::Float {
        B::float_to_device(tensor, device)
    }

    #[inline(always)]
    fn device(tensor: &Self::Float) -> B::Device {
        B::float_device(tensor)
    }

    #[inline(always)]
    fn set_require_grad(tensor: Self::Float, require_grad: bool) -> Self::Float {
        B::float_set_require_grad(tensor, require_grad)
    }

    #[inline(always)]
    fn is_require_grad(tensor: &Self::Float) -> bool {
        B::float_is_require_grad(tensor)
    }

    #[inline(always)]
    fn read(tensor: Self::Float) -> B::FloatTensorPrimitive {
        tensor
    }

    #[inline(always)]
    fn local_mut(tensor: &mut Self::Float) -> &mut B::FloatTensorPrimitive {
        tensor
    }
}
