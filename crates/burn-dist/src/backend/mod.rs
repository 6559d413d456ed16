//! The [`DistributedBackend`] decorator type: `B`'s types, `B`'s ops, our backward hooks.
//!
//! The methods of `Backend` and of every op trait are forwarded to `B` by the [`forward!`] macro
//! (see `forward.rs`). The signature lists between `@generated` markers here and in `ops/` are
//! written by
//! `BURN_DIST_REGENERATE=1 cargo test -p burn-dist --test forwarding_is_complete -- --ignored`
//! from burn-backend's source; do not edit them by hand.

mod distributed;
pub(crate) mod forward;
pub(crate) mod mode;
mod ops;
pub(crate) mod relabel;
pub(crate) mod view;

use core::fmt;
use core::marker::PhantomData;

use burn_backend::{BackendTypes, DType, DTypeUsageSet, ExecutionError, TensorData};

use forward::forward;
pub use mode::{Mode, Replicated};
pub use view::View;

#[doc(hidden)]
pub use ops::FORWARDED;

/// A backend that computes exactly like `B` and feeds gradients to the burn-dist reducer.
///
/// Use it under Burn's autodiff decorator: `Autodiff<DistributedBackend<B>>`. In its default
/// mode, [`Replicated`], it has `B`'s device, tensor primitives and element types, and every
/// tensor operation calls `B`'s implementation, including the ones `B` overrides for speed. Only
/// Burn's distributed hooks differ: during `backward()` they hand parameter gradients to the
/// reducer (see the crate docs).
///
/// `DistributedBackend<B, Sharded>` ([`Sharded`](crate::Sharded), ZeRO stage 3) keeps only this
/// rank's piece of every parameter: a float primitive is a local tensor of `B` or a handle to a
/// sharded parameter, gathered by the op that uses it and released when that op returns.
pub struct DistributedBackend<B, P = Replicated>(PhantomData<(B, P)>);

// Written by hand, not derived: a derive would require `B: Clone` etc. even where `B` needs none.
impl<B, P> Clone for DistributedBackend<B, P> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B, P> Copy for DistributedBackend<B, P> {}

impl<B, P> Default for DistributedBackend<B, P> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<B, P> fmt::Debug for DistributedBackend<B, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DistributedBackend<{}, {}>",
            core::any::type_name::<B>(),
            core::any::type_name::<P>()
        )
    }
}

impl<B: burn_backend::Backend, P: Mode<B>> BackendTypes for DistributedBackend<B, P> {
    type Device = B::Device;

    type FloatTensorPrimitive = P::Float;
    type FloatElem = B::FloatElem;

    type IntTensorPrimitive = B::IntTensorPrimitive;
    type IntElem = B::IntElem;

    type BoolTensorPrimitive = B::BoolTensorPrimitive;
    type BoolElem = B::BoolElem;

    type QuantizedTensorPrimitive = B::QuantizedTensorPrimitive;
}

forward! {
    backend Backend;
    const BACKEND;
    by_hand [memory_persistent_allocations, staging] {
        fn memory_persistent_allocations<
            Output: Send,
            Input: Send,
            Func: Fn(Input) -> Output + Send,
        >(
            device: &Self::Device,
            input: Input,
            func: Func,
        ) -> Output {
            B::memory_persistent_allocations(device, input, func)
        }

        fn staging<'a, Iter>(data: Iter, device: &Self::Device)
        where
            Iter: Iterator<Item = &'a mut TensorData>,
        {
            B::staging(data, device)
        }
    }
    // @generated begin
    fn ad_enabled(_device: &Self::Device) -> bool;
    fn memory_cleanup(device: &Self::Device);
    fn name(device: &Self::Device) -> String;
    fn seed(device: &Self::Device, seed: u64);
    fn sync(_device: &Self::Device) -> Result<(), ExecutionError>;
    fn supports_dtype(device: &Self::Device, dtype: DType) -> bool;
    fn dtype_usage(device: &Self::Device, dtype: DType) -> DTypeUsageSet;
    fn device_count(type_id: u16) -> usize;
    // @generated end
}
