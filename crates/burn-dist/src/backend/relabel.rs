//! Moves values between the structs that Burn makes generic over the backend itself.
//!
//! [`DistributedBackend<B>`](crate::DistributedBackend) declares exactly `B`'s associated types,
//! so `FloatTensor<Self>` *is* `FloatTensor<B>`. But `TensorPrimitive<Self>` and
//! `TensorPrimitive<B>` are two nominal types with the same fields; [`Relabel`] moves the fields
//! across. It has an identity impl for every type so `forward!`'s `#[relabel]` arm can apply it to
//! every argument and result without knowing which ones need it.

use burn_backend::Backend;
use burn_backend::TensorPrimitive;
use burn_backend::ops::{
    DeformConv2dBackward, MaxPool1dBackward, MaxPool1dWithIndices, MaxPool2dBackward,
    MaxPool2dWithIndices,
};
use burn_backend::tensor::quantization::QuantizationParametersPrimitive;

use crate::DistributedBackend;

/// Converts a value generic over one backend into the same value generic over the other, for two
/// backends with identical associated types.
pub(crate) trait Relabel<Target> {
    /// Moves the fields into `Target`.
    fn relabel(self) -> Target;
}

impl<T> Relabel<T> for T {
    #[inline(always)]
    fn relabel(self) -> T {
        self
    }
}

impl<B: Backend> Relabel<TensorPrimitive<B>> for TensorPrimitive<DistributedBackend<B>> {
    #[inline(always)]
    fn relabel(self) -> TensorPrimitive<B> {
        match self {
            TensorPrimitive::Float(tensor) => TensorPrimitive::Float(tensor),
            TensorPrimitive::QFloat(tensor) => TensorPrimitive::QFloat(tensor),
        }
    }
}

impl<B: Backend> Relabel<TensorPrimitive<DistributedBackend<B>>> for TensorPrimitive<B> {
    #[inline(always)]
    fn relabel(self) -> TensorPrimitive<DistributedBackend<B>> {
        match self {
            TensorPrimitive::Float(tensor) => TensorPrimitive::Float(tensor),
            TensorPrimitive::QFloat(tensor) => TensorPrimitive::QFloat(tensor),
        }
    }
}

impl<B: Backend> Relabel<QuantizationParametersPrimitive<B>>
    for QuantizationParametersPrimitive<DistributedBackend<B>>
{
    #[inline(always)]
    fn relabel(self) -> QuantizationParametersPrimitive<B> {
        QuantizationParametersPrimitive {
            scales: self.scales,
        }
    }
}

impl<B: Backend> Relabel<MaxPool1dWithIndices<DistributedBackend<B>>> for MaxPool1dWithIndices<B> {
    #[inline(always)]
    fn relabel(self) -> MaxPool1dWithIndices<DistributedBackend<B>> {
        MaxPool1dWithIndices {
            output: self.output,
            indices: self.indices,
        }
    }
}

impl<B: Backend> Relabel<MaxPool2dWithIndices<DistributedBackend<B>>> for MaxPool2dWithIndices<B> {
    #[inline(always)]
    fn relabel(self) -> MaxPool2dWithIndices<DistributedBackend<B>> {
        MaxPool2dWithIndices {
            output: self.output,
            indices: self.indices,
        }
    }
}

impl<B: Backend> Relabel<MaxPool1dBackward<DistributedBackend<B>>> for MaxPool1dBackward<B> {
    #[inline(always)]
    fn relabel(self) -> MaxPool1dBackward<DistributedBackend<B>> {
        MaxPool1dBackward {
            x_grad: self.x_grad,
        }
    }
}

impl<B: Backend> Relabel<MaxPool2dBackward<DistributedBackend<B>>> for MaxPool2dBackward<B> {
    #[inline(always)]
    fn relabel(self) -> MaxPool2dBackward<DistributedBackend<B>> {
        MaxPool2dBackward {
            x_grad: self.x_grad,
        }
    }
}

impl<B: Backend> Relabel<DeformConv2dBackward<DistributedBackend<B>>> for DeformConv2dBackward<B> {
    #[inline(always)]
    fn relabel(self) -> DeformConv2dBackward<DistributedBackend<B>> {
        DeformConv2dBackward {
            x_grad: self.x_grad,
            offset_grad: self.offset_grad,
            weight_grad: self.weight_grad,
            mask_grad: self.mask_grad,
            bias_grad: self.bias_grad,
        }
    }
}
