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
    fn leaky_relu(tensor: FloatTensor<Self>, negative_slope: Scalar) -> FloatTensor<Self>;
    fn relu(tensor: FloatTensor<Self>) -> FloatTensor<Self>;
    fn relu_backward(output: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
    fn gelu(tensor: FloatTensor<Self>) -> FloatTensor<Self>;
    fn prelu(tensor: FloatTensor<Self>, alpha: FloatTensor<Self>) -> FloatTensor<Self>;
    fn gelu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
    fn sigmoid(tensor: FloatTensor<Self>) -> FloatTensor<Self>;
    fn sigmoid_backward(output: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
    fn hard_sigmoid(tensor: FloatTensor<Self>, alpha: Scalar, beta: Scalar) -> FloatTensor<Self>;
    fn log_sigmoid(tensor: FloatTensor<Self>) -> FloatTensor<Self>;
    fn softmax(tensor: FloatTensor<Self>, dim: usize) -> FloatTensor<Self>;
    fn log_softmax(tensor: FloatTensor<Self>, dim: usize) -> FloatTensor<Self>;
    fn softmin(tensor: FloatTensor<Self>, dim: usize) -> FloatTensor<Self>;
    fn log_sigmoid_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
    // @generated end
}
