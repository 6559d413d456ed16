//! The `forward!` macro: implements one of Burn's backend traits for [`DistributedBackend<B, P>`]
//! by calling `B`'s implementation of every listed method, in either mode `P`.
//!
//! Input, in this order:
//!
//! ```text
//! forward! {
//!     ops FloatTensorOps;        // `ops Trait;` for `Trait<Self>`, or `backend Backend;`
//!     const FORWARDED;           // name of the emitted `(trait name, method names)` constant
//!     by_hand [name, ...] { ... } // methods written out in full, and their names
//!     fn float_add(lhs: FloatTensor<Self> => float, rhs: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
//!     fn q_add(lhs: QuantizedTensor<Self>, rhs: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
//!     ...
//! }
//! ```
//!
//! Each `fn` line is the trait's own signature with the trait's backend parameter written as
//! `Self`, so the emitted method matches the trait exactly. The generator tags every argument and
//! result that carries a float tensor of the decorator, whose type is the mode's
//! ([`Mode::Float`](super::mode::Mode::Float)), not `B`'s:
//!
//! | tag | type | into `B`'s op | out of it |
//! |---|---|---|---|
//! | `float` | `FloatTensor<Self>` | `P::enter` | `P::leave` |
//! | `float_meta` | `FloatTensor<Self>`, read only for its shape, dtype, device | `P::enter_meta` | |
//! | `float_opt` | `Option<FloatTensor<Self>>` | each `P::enter` | |
//! | `floats` | `Vec<FloatTensor<Self>>` | each `P::enter` | each `P::leave` |
//! | `(float, _)`, `(float, float)` | a pair | | `P::leave` on the floats |
//! | `wrap` | a struct generic over the backend (`TensorPrimitive<Self>`, ...) | [`Relabel`](super::relabel::Relabel) | [`Relabel`](super::relabel::Relabel) |
//!
//! Untagged types (ints, bools, devices, shapes, options) are `B`'s own, since
//! `DistributedBackend<B, P>` declares `B`'s types for them. The body of every method is
//! `P::op(|| leave(<B as Trait<B>>::name(enter(args)...)))`. In [`Replicated`] mode every one
//! of these conversions is the identity and `op` just runs the call: the generated method is a
//! direct call of `B`'s. In [`Sharded`](crate::Sharded) mode `enter` gathers a parameter
//! handle and `op` releases the gathered copy when `B`'s op returns.
//!
//! The signature lists are generated from burn-backend's source (see `tests/common/mod.rs`),
//! and `tests/forwarding_is_complete.rs` checks them against the source.
//!
//! [`DistributedBackend<B, P>`]: crate::DistributedBackend
//! [`Replicated`]: super::mode::Replicated

macro_rules! forward {
    (
        $kind:ident $Trait:ident;
        const $CONST:ident;
        by_hand [$($hand:ident),* $(,)?] { $($hand_items:tt)* }
        $(
            fn $name:ident ( $($arg:ident : $ty:ty $(=> $ak:tt)?),* $(,)? ) $(-> $ret:ty $(=> $rk:tt)?)?;
        )*
    ) => {
        $crate::backend::forward::forward!(@impl $kind $Trait {
            $($hand_items)*
            $(
                $crate::backend::forward::forward!(
                    @method $kind $Trait $name ($($arg : $ty $(=> $ak)?),*) $(-> $ret $(=> $rk)?)?
                );
            )*
        });

        /// The trait and the names of the methods this module forwards to the inner backend.
        pub(crate) const $CONST: (&str, &[&str]) =
            (stringify!($Trait), &[$(stringify!($hand),)* $(stringify!($name)),*]);
    };

    // The impl block.
    (@impl ops $Trait:ident { $($items:tt)* }) => {
        impl<B: ::burn_backend::Backend, P: $crate::backend::mode::Mode<B>>
            ::burn_backend::ops::$Trait<Self> for $crate::DistributedBackend<B, P>
        {
            $($items)*
        }
    };
    (@impl backend $Trait:ident { $($items:tt)* }) => {
        impl<B: ::burn_backend::Backend, P: $crate::backend::mode::Mode<B>> ::burn_backend::$Trait
            for $crate::DistributedBackend<B, P>
        {
            $($items)*
        }
    };

    // One method: its float arguments enter `B`'s op, its float results leave it.
    (@method $kind:ident $Trait:ident $name:ident
        ($($arg:ident : $ty:ty $(=> $ak:tt)?),*) $(-> $ret:ty $(=> $rk:tt)?)?) => {
        #[inline(always)]
        fn $name($($arg: $ty),*) $(-> $ret)? {
            <P as $crate::backend::mode::Mode<B>>::op(|| {
                $crate::backend::forward::forward!(@leave [$($($rk)?)?] [$($ret)?]
                    $crate::backend::forward::forward!(@inner $kind $Trait $name)(
                        $($crate::backend::forward::forward!(@enter [$($ak)?] $arg)),*
                    )
                )
            })
        }
    };

    // An argument on its way into `B`'s op.
    (@enter [] $arg:ident) => { $arg };
    (@enter [float] $arg:ident) => { <P as $crate::backend::mode::Mode<B>>::enter($arg) };
    (@enter [float_meta] $arg:ident) => {
        <P as $crate::backend::mode::Mode<B>>::enter_meta($arg)
    };
    (@enter [float_opt] $arg:ident) => {
        $arg.map(<P as $crate::backend::mode::Mode<B>>::enter)
    };
    (@enter [floats] $arg:ident) => {
        $arg.into_iter().map(<P as $crate::backend::mode::Mode<B>>::enter).collect()
    };
    (@enter [wrap] $arg:ident) => {
        $crate::backend::relabel::Relabel::<B, P>::enter($arg)
    };

    // A result on its way out of `B`'s op.
    (@leave [] [$($ret:ty)?] $result:expr) => { $result };
    (@leave [float] [$ret:ty] $result:expr) => {
        <P as $crate::backend::mode::Mode<B>>::leave($result)
    };
    (@leave [floats] [$ret:ty] $result:expr) => {
        $result.into_iter().map(<P as $crate::backend::mode::Mode<B>>::leave).collect()
    };
    (@leave [(float, _)] [$ret:ty] $result:expr) => {{
        let (float, other) = $result;
        (<P as $crate::backend::mode::Mode<B>>::leave(float), other)
    }};
    (@leave [(float, float)] [$ret:ty] $result:expr) => {{
        let (first, second) = $result;
        (
            <P as $crate::backend::mode::Mode<B>>::leave(first),
            <P as $crate::backend::mode::Mode<B>>::leave(second),
        )
    }};
    (@leave [wrap] [$ret:ty] $result:expr) => {
        <$ret as $crate::backend::relabel::Relabel<B, P>>::leave($result)
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
