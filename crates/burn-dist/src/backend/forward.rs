//! The `forward!` macro: implements one of Burn's backend traits for [`DistributedBackend<B>`]
//! by calling `B`'s implementation of every listed method.
//!
//! Input, in this order:
//!
//! ```text
//! forward! {
//!     ops FloatTensorOps;        // `ops Trait;` for `Trait<Self>`, or `backend Backend;`
//!     const FORWARDED;           // name of the emitted `(trait name, method names)` constant
//!     by_hand [name, ...] { ... } // methods written out in full (generic ones), and their names
//!     fn float_add(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self>;
//!     #[relabel] fn q_add(lhs: QuantizedTensor<Self>, rhs: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
//!     ...
//! }
//! ```
//!
//! Each `fn` line is the trait's own signature with the trait's backend parameter written as
//! `Self`, so the emitted method matches the trait exactly. Its body is
//! `<B as Trait<B>>::name(args...)`: the types are the same because [`DistributedBackend<B>`]
//! declares exactly `B`'s associated types. A few signatures name a struct that is generic over
//! the backend itself (`TensorPrimitive<Self>`, `MaxPool2dWithIndices<Self>`, ...), which is a
//! different nominal type from the one `B` takes or returns; those lines carry `#[relabel]`, and
//! every argument and the result pass through [`Relabel`](super::relabel::Relabel), a
//! field-by-field move.
//!
//! The signature lists are generated from burn-backend's source (see `tests/common/mod.rs`),
//! and `tests/forwarding_is_complete.rs` checks them against the source.
//!
//! [`DistributedBackend<B>`]: crate::DistributedBackend

macro_rules! forward {
    (
        $kind:ident $Trait:ident;
        const $CONST:ident;
        by_hand [$($hand:ident),* $(,)?] { $($hand_items:tt)* }
        $(
            $(#[$relabel:ident])?
            fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) $(-> $ret:ty)?;
        )*
    ) => {
        $crate::backend::forward::forward!(@impl $kind $Trait {
            $($hand_items)*
            $(
                $crate::backend::forward::forward!(
                    @method $kind $Trait [$($relabel)?] $name ($($arg : $ty),*) $(-> $ret)?
                );
            )*
        });

        /// The trait and the names of the methods this module forwards to the inner backend.
        pub(crate) const $CONST: (&str, &[&str]) =
            (stringify!($Trait), &[$(stringify!($hand),)* $(stringify!($name)),*]);
    };

    // The impl block.
    (@impl ops $Trait:ident { $($items:tt)* }) => {
        impl<B: ::burn_backend::Backend> ::burn_backend::ops::$Trait<Self>
            for $crate::DistributedBackend<B>
        {
            $($items)*
        }
    };
    (@impl backend $Trait:ident { $($items:tt)* }) => {
        impl<B: ::burn_backend::Backend> ::burn_backend::$Trait for $crate::DistributedBackend<B> {
            $($items)*
        }
    };

    // One method whose signature types are identical for `Self` and `B`.
    (@method $kind:ident $Trait:ident [] $name:ident ($($arg:ident : $ty:ty),*) $(-> $ret:ty)?) => {
        #[inline(always)]
        fn $name($($arg: $ty),*) $(-> $ret)? {
            $crate::backend::forward::forward!(@inner $kind $Trait $name)($($arg),*)
        }
    };
    // One method whose signature names a struct generic over the backend: relabel everything.
    (@method $kind:ident $Trait:ident [relabel] $name:ident ($($arg:ident : $ty:ty),*) $(-> $ret:ty)?) => {
        #[inline(always)]
        fn $name($($arg: $ty),*) $(-> $ret)? {
            use $crate::backend::relabel::Relabel;
            Relabel::relabel($crate::backend::forward::forward!(@inner $kind $Trait $name)(
                $(Relabel::relabel($arg)),*
            ))
        }
    };

    // The inner backend's method.
    (@inner ops $Trait:ident $name:ident) => {
        <B as ::burn_backend::ops::$Trait<B>>::$name
    };
    (@inner backend $Trait:ident $name:ident) => {
        <B as ::burn_backend::$Trait>::$name
    };
}

pub(crate) use forward;
