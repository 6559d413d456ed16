//! Moves values between the structs that Burn makes generic over the backend itself.
//!
//! `DistributedBackend<B, P>` declares `B`'s types for everything but floats, whose type is the
//! mode's. A struct generic over the backend (`TensorPrimitive<Self>`,
//! `MaxPool2dWithIndices<Self>`, ...) is a different nominal type for `Self` and for `B`;
//! [`Relabel`] moves its fields across, passing the float ones through the mode like any float
//! argument or result (`forward!`'s `wrap` tag).

use burn_backend::Backend;
use burn_backend::TensorPrimitive;
use burn_backend::ops::{
    DeformConv2dBackward, MaxPool1dBackward, MaxPool1dWithIndices, MaxPool2dBackward,
    MaxPool2dWithIndices,
};
use burn_backend::tensor::quantization::QuantizationParametersPrimitive;

use super::mode::Mode;
use crate::DistributedBackend;

/// A value of the decorator's form of a struct, and `B`'s form of it.
pub(crate) trait Relabel<B: Backend, P: Mode<B>>: Sized {
    /// The same struct generic over `B`.
    type Inner;
    /// Into `B`'s form, for one of `B`'s ops.
    fn enter(self) -> Self::Inner;
    /// Out of `B`'s form, from one of `B`'s ops.
    fn leave(inner: Self::Inner) -> Self;
}

impl<B: Backend, P: Mode<B>> Relabel<B, P> for TensorPrimitive<DistributedBackend<B, P>> {
    type Inner = TensorPrimitive<B>;

    #[inline(always)]
    fn enter(self) -> TensorPrimitive<B> {
        match self {
            TensorPrimitive::Float(tensor) => TensorPrimitive::Float(P::enter(tensor)),
            TensorPrimitive::QFloat(tensor) => TensorPrimitive::QFloat(tensor),
        }
    }

    #[inline(always)]
    fn leave(inner: TensorPrimitive<B>) -> Self {
        match inner {
            TensorPrimitive::Float(tensor) => TensorPrimitive::Float(P::leave(tensor)),
            TensorPrimitive::QFloat(tensor) => TensorPrimitive::QFloat(tensor),
        }
    }
}

impl<B: Backend, P: Mode<B>> Relabel<B, P>
    for QuantizationParametersPrimitive<DistributedBackend<B, P>>
{
    type Inner = QuantizationParametersPrimitive<B>;

    #[inline(always)]
    fn enter(self) -> Self::Inner {
        QuantizationParametersPrimitive {
            scales: P::enter(self.scales),
        }
    }

    #[inline(always)]
    fn leave(inner: Self::Inner) -> Self {
        QuantizationParametersPrimitive {
            scales: P::leave(inner.scales),
        }
    }
}

impl<B: Backend, P: Mode<B>> Relabel<B, P> for MaxPool1dWithIndices<DistributedBackend<B, P>> {
    type Inner = MaxPool1dWithIndices<B>;

    #[inline(always)]
    fn enter(self) -> Self::Inner {
        MaxPool1dWithIndices {
            output: P::enter(self.output),
            indices: self.indices,
        }
    }

    #[inline(always)]
    fn leave(inner: Self::Inner) -> Self {
        MaxPool1dWithIndices {
            output: P::leave(inner.output),
            indices: inner.indices,
        }
    }
}

impl<B: Backend, P: Mode<B>> Relabel<B, P> for MaxPool2dWithIndices<DistributedBackend<B, P>> {
    type Inner = MaxPool2dWithIndices<B>;

    #[inline(always)]
    fn enter(self) -> Self::Inner {
        MaxPool2dWithIndices {
            output: P::enter(self.output),
            indices: self.indices,
        }
    }

    #[inline(always)]
    fn leave(inner: Self::Inner) -> Self {
        MaxPool2dWithIndices {
            output: P::leave(inner.output),
            indices: inner.indices,
        }
    }
}

impl<B: Backend, P: Mode<B>> Relabel<B, P> for MaxPool1dBackward<DistributedBackend<B, P>> {
    type Inner = MaxPool1dBackward<B>;

    #[inline(always)]
    fn enter(self) -> Self::Inner {
        MaxPool1dBackward {
            x_grad: P::enter(self.x_grad),
        }
    }

    #[inline(always)]
    fn leave(inner: Self::Inner) -> Self {
        MaxPool1dBackward {
            x_grad: P::leave(inner.x_grad),
        }
    }
}

impl<B: Backend, P: Mode<B>> Relabel<B, P> for MaxPool2dBackward<DistributedBackend<B, P>> {
    type Inner = MaxPool2dBackward<B>;

    #[inline(always)]
    fn enter(self) -> Self::Inner {
        MaxPool2dBackward {
            x_grad: P::enter(self.x_grad),
        }
    }

    #[inline(always)]
    fn leave(inner: Self::Inner) -> Self {
        MaxPool2dBackward {
            x_grad: P::leave(inner.x_grad),
        }
    }
}

impl<B: Backend, P: Mode<B>> Relabel<B, P> for DeformConv2dBackward<DistributedBackend<B, P>> {
    type Inner = DeformConv2dBackward<B>;

    #[inline(always)]
    fn enter(self) -> Self::Inner {
        DeformConv2dBackward {
            x_grad: P::enter(self.x_grad),
            offset_grad: P::enter(self.offset_grad),
            weight_grad: P::enter(self.weight_grad),
            mask_grad: self.mask_grad.map(P::enter),
            bias_grad: self.bias_grad.map(P::enter),
        }
    }

    #[inline(always)]
    fn leave(inner: Self::Inner) -> Self {
        DeformConv2dBackward {
            x_grad: P::leave(inner.x_grad),
            offset_grad: P::leave(inner.offset_grad),
            weight_grad: P::leave(inner.weight_grad),
            mask_grad: inner.mask_grad.map(P::leave),
            bias_grad: inner.bias_grad.map(P::leave),
        }
    }
}
