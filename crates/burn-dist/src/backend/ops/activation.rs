//! Forwards `ActivationOps` to the inner backend.
//!
//! The list between the `@generated` markers is burn-backend 0.21.0's `ActivationOps`
//! signatures, written by
//! `BURN_DIST_REGENERATE=1 cargo test -p burn-dist --test forwarding_is_complete -- --ignored`.

#[allow(unused_imports)]
use super::prelude::*;

forward! {
    ops ActivationOps;
    const FORWARDED;
    by_hand [] {}
    // @generated begin
    fn leaky_relu(tensor: FloatTensor<Self> => float, negative_slope: Scalar) -> FloatTensor<Self> => float;
    fn relu(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn relu_backward(output: FloatTensor<Self> => float, grad: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn gelu(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn prelu(tensor: FloatTensor<Self> => float, alpha: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn gelu_backward(x: FloatTensor<Self> => float, grad: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn sigmoid(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn sigmoid_backward(output: FloatTensor<Self> => float, grad: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn hard_sigmoid(tensor: FloatTensor<Self> => float, alpha: Scalar, beta: Scalar) -> FloatTensor<Self> => float;
    fn log_sigmoid(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn softmax(tensor: FloatTensor<Self> => float, dim: usize) -> FloatTensor<Self> => float;
    fn log_softmax(tensor: FloatTensor<Self> => float, dim: usize) -> FloatTensor<Self> => float;
    fn softmin(tensor: FloatTensor<Self> => float, dim: usize) -> FloatTensor<Self> => float;
    fn log_sigmoid_backward(x: FloatTensor<Self> => float, grad: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    // @generated end
}
