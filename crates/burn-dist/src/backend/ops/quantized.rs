//! Forwards `QTensorOps` to the inner backend.
//!
//! The list between the `@generated` markers is burn-backend 0.21.0's `QTensorOps`
//! signatures, written by
//! `BURN_DIST_REGENERATE=1 cargo test -p burn-dist --test forwarding_is_complete -- --ignored`.

#[allow(unused_imports)]
use super::prelude::*;

forward! {
    ops QTensorOps;
    const FORWARDED;
    by_hand [] {}
    // @generated begin
    fn q_from_data(data: TensorData, device: &Device<Self>) -> QuantizedTensor<Self>;
    fn quantize(tensor: FloatTensor<Self> => float, scheme: &QuantScheme, qparams: QuantizationParametersPrimitive<Self> => wrap) -> QuantizedTensor<Self>;
    fn quantize_dynamic(tensor: FloatTensor<Self> => float, scheme: &QuantScheme) -> QuantizedTensor<Self>;
    fn dequantize(tensor: QuantizedTensor<Self>, dtype: FloatDType) -> FloatTensor<Self> => float;
    fn q_device(tensor: &QuantizedTensor<Self>) -> Device<Self>;
    fn q_to_device(tensor: QuantizedTensor<Self>, device: &Device<Self>) -> QuantizedTensor<Self>;
    fn q_reshape(tensor: QuantizedTensor<Self>, shape: Shape) -> QuantizedTensor<Self>;
    fn q_into_data(tensor: QuantizedTensor<Self>) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send;
    fn q_detach(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
    fn q_set_require_grad(tensor: QuantizedTensor<Self>, _require_grad: bool) -> QuantizedTensor<Self>;
    fn q_is_require_grad(_tensor: &QuantizedTensor<Self>) -> bool;
    fn q_expand(tensor: QuantizedTensor<Self>, shape: Shape) -> QuantizedTensor<Self>;
    fn q_transpose(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
    fn q_swap_dims(tensor: QuantizedTensor<Self>, dim1: usize, dim2: usize) -> QuantizedTensor<Self>;
    fn q_permute(tensor: QuantizedTensor<Self>, axes: &[usize]) -> QuantizedTensor<Self>;
    fn q_flip(tensor: QuantizedTensor<Self>, axes: &[usize]) -> QuantizedTensor<Self>;
    fn q_select(tensor: QuantizedTensor<Self>, dim: usize, indices: IntTensor<Self>) -> QuantizedTensor<Self>;
    fn q_slice(tensor: QuantizedTensor<Self>, slices: &[Slice]) -> QuantizedTensor<Self>;
    fn q_gather(dim: usize, tensor: QuantizedTensor<Self>, indices: IntTensor<Self>) -> QuantizedTensor<Self>;
    fn q_repeat_dim(tensor: QuantizedTensor<Self>, dim: usize, times: usize) -> QuantizedTensor<Self>;
    fn q_add(lhs: QuantizedTensor<Self>, rhs: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_add_scalar(lhs: QuantizedTensor<Self>, rhs: Scalar) -> TensorPrimitive<Self> => wrap;
    fn q_clamp_min(tensor: QuantizedTensor<Self>, min: Scalar) -> TensorPrimitive<Self> => wrap;
    fn q_clamp_max(tensor: QuantizedTensor<Self>, max: Scalar) -> TensorPrimitive<Self> => wrap;
    fn q_clamp(tensor: QuantizedTensor<Self>, min: Scalar, max: Scalar) -> TensorPrimitive<Self> => wrap;
    fn q_sub(lhs: QuantizedTensor<Self>, rhs: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_sub_scalar(lhs: QuantizedTensor<Self>, rhs: Scalar) -> TensorPrimitive<Self> => wrap;
    fn q_mul(lhs: QuantizedTensor<Self>, rhs: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_mul_scalar(lhs: QuantizedTensor<Self>, rhs: Scalar) -> TensorPrimitive<Self> => wrap;
    fn q_div(lhs: QuantizedTensor<Self>, rhs: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_div_scalar(lhs: QuantizedTensor<Self>, rhs: Scalar) -> TensorPrimitive<Self> => wrap;
    fn q_matmul(lhs: TensorPrimitive<Self> => wrap, rhs: TensorPrimitive<Self> => wrap) -> TensorPrimitive<Self> => wrap;
    fn q_neg(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_recip(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_sum(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_sum_dim(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self> => wrap;
    fn q_prod(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_prod_dim(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self> => wrap;
    fn q_mean(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_mean_dim(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self> => wrap;
    fn q_cumsum(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self> => wrap;
    fn q_cumprod(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self> => wrap;
    fn q_cummin(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self> => wrap;
    fn q_cummax(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self> => wrap;
    fn q_exp(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_log(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_log1p(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_powf(lhs: QuantizedTensor<Self>, rhs: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_powi(lhs: QuantizedTensor<Self>, rhs: IntTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_powi_scalar(lhs: QuantizedTensor<Self>, rhs: Scalar) -> TensorPrimitive<Self> => wrap;
    fn q_powf_scalar(tensor: QuantizedTensor<Self>, value: Scalar) -> TensorPrimitive<Self> => wrap;
    fn q_sqrt(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_abs(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
    fn q_cos(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_sin(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_tan(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_cosh(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_sinh(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_tanh(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_erf(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => wrap;
    fn q_cat(tensors: Vec<QuantizedTensor<Self>>, dim: usize) -> QuantizedTensor<Self>;
    fn q_argmax(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: IntDType) -> IntTensor<Self>;
    fn q_argtopk(tensor: QuantizedTensor<Self>, dim: usize, k: usize, out_dtype: IntDType) -> IntTensor<Self>;
    fn q_topk(tensor: QuantizedTensor<Self>, dim: usize, k: usize) -> QuantizedTensor<Self>;
    fn q_argmin(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: IntDType) -> IntTensor<Self>;
    fn q_max(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
    fn q_max_dim(tensor: QuantizedTensor<Self>, dim: usize) -> QuantizedTensor<Self>;
    fn q_max_dim_with_indices(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: IntDType) -> (QuantizedTensor<Self>, IntTensor<Self>);
    fn q_min(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
    fn q_min_dim(tensor: QuantizedTensor<Self>, dim: usize) -> QuantizedTensor<Self>;
    fn q_min_dim_with_indices(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: IntDType) -> (QuantizedTensor<Self>, IntTensor<Self>);
    fn q_max_abs(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
    fn q_max_abs_dim(tensor: QuantizedTensor<Self>, dim: usize) -> QuantizedTensor<Self>;
    fn q_any(tensor: QuantizedTensor<Self>, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn q_any_dim(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn q_all(tensor: QuantizedTensor<Self>, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn q_all_dim(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn q_sort(tensor: QuantizedTensor<Self>, dim: usize, descending: bool) -> QuantizedTensor<Self>;
    fn q_sort_with_indices(tensor: QuantizedTensor<Self>, dim: usize, descending: bool, out_dtype: IntDType) -> (QuantizedTensor<Self>, IntTensor<Self>);
    fn q_argsort(tensor: QuantizedTensor<Self>, dim: usize, descending: bool, out_dtype: IntDType) -> IntTensor<Self>;
    // @generated end
}
