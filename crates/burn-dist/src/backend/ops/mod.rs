//! One module per Burn op trait, each a `forward!` invocation over that trait's signatures.

mod activation;
mod boolean;
mod float;
mod int;
mod module;
mod quantized;
mod transaction;

/// Every type that appears in an op-trait signature, for the generated signature lists.
mod prelude {
    pub(super) use super::super::forward::forward;
    pub(super) use burn_backend::ops::{
        AttentionModuleOptions, ConvOptions, ConvTransposeOptions, DeformConv2dBackward,
        DeformConvOptions, GridSampleOptions, InterpolateOptions, MaxPool1dBackward,
        MaxPool1dWithIndices, MaxPool2dBackward, MaxPool2dWithIndices, TransactionPrimitive,
        TransactionPrimitiveData, UnfoldOptions,
    };
    pub(super) use burn_backend::quantization::QuantScheme;
    pub(super) use burn_backend::tensor::quantization::QuantizationParametersPrimitive;
    pub(super) use burn_backend::tensor::{
        BoolTensor, Device, FloatTensor, IntTensor, QuantizedTensor,
    };
    pub(super) use burn_backend::{
        BoolDType, Distribution, ExecutionError, FloatDType, IntDType, Scalar, Shape, Slice,
        TensorData, TensorPrimitive,
    };
    pub(super) use core::ops::Range;
}

/// `(trait, methods)` for every trait [`DistributedBackend`](crate::DistributedBackend)
/// forwards to its inner backend, required and provided methods alike.
pub const FORWARDED: &[(&str, &[&str])] = &[
    super::BACKEND,
    float::FORWARDED,
    int::FORWARDED,
    boolean::FORWARDED,
    quantized::FORWARDED,
    module::FORWARDED,
    activation::FORWARDED,
    transaction::FORWARDED,
];
