//! Forwards `FloatTensorOps` to the inner backend.
//!
//! The list between the `@generated` markers is burn-backend 0.21.0's `FloatTensorOps`
//! signatures, written by
//! `BURN_DIST_REGENERATE=1 cargo test -p burn-dist --test forwarding_is_complete -- --ignored`.

#[allow(unused_imports)]
use super::prelude::*;
use crate::backend::view::View;

forward! {
    ops FloatTensorOps;
    const FORWARDED;
    by_hand [
        float_random, float_into_data, float_device, float_is_require_grad, float_detach,
        float_set_require_grad, float_to_device, float_reshape, float_transpose, float_swap_dims,
        float_permute, float_flip, float_expand, float_slice, float_cast,
    ] {
        // Under a `Ddp`, draw from the rank's counter-based stream (see `random.rs`).
        fn float_random(shape: Shape, distribution: Distribution, device: &Device<Self>, dtype: FloatDType) -> FloatTensor<Self> {
            P::leave(match crate::random::draw(shape.num_elements(), distribution) {
                Some(values) => {
                    let data = TensorData::new(values, shape).convert_dtype(dtype.into());
                    B::float_from_data(data, device)
                }
                None => B::float_random(shape, distribution, device, dtype),
            })
        }

        // Reading values is not an op: a stage-3 handle read here is counted as materialized
        // outside one (`ShardStats::reads`).
        fn float_into_data(tensor: FloatTensor<Self>) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
            B::float_into_data(P::read(tensor))
        }

        // Metadata and the inner backend's gradient flags never gather.
        fn float_device(tensor: &FloatTensor<Self>) -> Device<Self> {
            P::device(tensor)
        }
        fn float_is_require_grad(tensor: &FloatTensor<Self>) -> bool {
            P::is_require_grad(tensor)
        }
        fn float_detach(tensor: FloatTensor<Self>) -> FloatTensor<Self> {
            P::detach(tensor)
        }
        fn float_set_require_grad(tensor: FloatTensor<Self>, require_grad: bool) -> FloatTensor<Self> {
            P::set_require_grad(tensor, require_grad)
        }
        fn float_to_device(tensor: FloatTensor<Self>, device: &Device<Self>) -> FloatTensor<Self> {
            P::to_device(tensor, device)
        }

        // Views: recorded on a stage-3 handle, replayed by the op that gathers it (`view.rs`).
        fn float_reshape(tensor: FloatTensor<Self>, shape: Shape) -> FloatTensor<Self> {
            P::view(tensor, View::Reshape(shape))
        }
        fn float_transpose(tensor: FloatTensor<Self>) -> FloatTensor<Self> {
            P::view(tensor, View::Transpose)
        }
        fn float_swap_dims(tensor: FloatTensor<Self>, dim1: usize, dim2: usize) -> FloatTensor<Self> {
            P::view(tensor, View::SwapDims(dim1, dim2))
        }
        fn float_permute(tensor: FloatTensor<Self>, axes: &[usize]) -> FloatTensor<Self> {
            P::view(tensor, View::Permute(axes.to_vec()))
        }
        fn float_flip(tensor: FloatTensor<Self>, axes: &[usize]) -> FloatTensor<Self> {
            P::view(tensor, View::Flip(axes.to_vec()))
        }
        fn float_expand(tensor: FloatTensor<Self>, shape: Shape) -> FloatTensor<Self> {
            P::view(tensor, View::Expand(shape))
        }
        fn float_slice(tensor: FloatTensor<Self>, slices: &[Slice]) -> FloatTensor<Self> {
            P::view(tensor, View::Slice(slices.to_vec()))
        }
        fn float_cast(tensor: FloatTensor<Self>, dtype: FloatDType) -> FloatTensor<Self> {
            P::view(tensor, View::Cast(dtype))
        }
    }
    // @generated begin
    fn float_from_data(data: TensorData, device: &Device<Self>) -> FloatTensor<Self> => float;
    fn float_zeros(shape: Shape, device: &Device<Self>, dtype: FloatDType) -> FloatTensor<Self> => float;
    fn float_ones(shape: Shape, device: &Device<Self>, dtype: FloatDType) -> FloatTensor<Self> => float;
    fn float_full(shape: Shape, fill_value: Scalar, device: &Device<Self>, dtype: FloatDType) -> FloatTensor<Self> => float;
    fn float_into_int(tensor: FloatTensor<Self> => float, out_dtype: IntDType) -> IntTensor<Self>;
    fn float_empty(shape: Shape, device: &Device<Self>, dtype: FloatDType) -> FloatTensor<Self> => float;
    fn float_repeat_dim(tensor: FloatTensor<Self> => float, dim: usize, times: usize) -> FloatTensor<Self> => float;
    fn float_add(lhs: FloatTensor<Self> => float, rhs: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_add_scalar(lhs: FloatTensor<Self> => float, rhs: Scalar) -> FloatTensor<Self> => float;
    fn float_clamp_min(tensor: FloatTensor<Self> => float, min: Scalar) -> FloatTensor<Self> => float;
    fn float_clamp_max(tensor: FloatTensor<Self> => float, max: Scalar) -> FloatTensor<Self> => float;
    fn float_clamp(tensor: FloatTensor<Self> => float, min: Scalar, max: Scalar) -> FloatTensor<Self> => float;
    fn float_sub(lhs: FloatTensor<Self> => float, rhs: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_sub_scalar(lhs: FloatTensor<Self> => float, rhs: Scalar) -> FloatTensor<Self> => float;
    fn float_mul(lhs: FloatTensor<Self> => float, rhs: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_mul_scalar(lhs: FloatTensor<Self> => float, rhs: Scalar) -> FloatTensor<Self> => float;
    fn float_div(lhs: FloatTensor<Self> => float, rhs: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_div_scalar(lhs: FloatTensor<Self> => float, rhs: Scalar) -> FloatTensor<Self> => float;
    fn float_remainder(lhs: FloatTensor<Self> => float, rhs: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_remainder_scalar(lhs: FloatTensor<Self> => float, rhs: Scalar) -> FloatTensor<Self> => float;
    fn float_matmul(lhs: FloatTensor<Self> => float, rhs: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_cross(lhs: FloatTensor<Self> => float, rhs: FloatTensor<Self> => float, dim: usize) -> FloatTensor<Self> => float;
    fn float_neg(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_recip(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_gather(dim: usize, tensor: FloatTensor<Self> => float, indices: IntTensor<Self>) -> FloatTensor<Self> => float;
    fn float_scatter_add(dim: usize, tensor: FloatTensor<Self> => float, indices: IntTensor<Self>, value: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_scatter_nd(_data: FloatTensor<Self> => float, _indices: IntTensor<Self>, _values: FloatTensor<Self> => float, _reduction: burn_backend::tensor::IndexingUpdateOp) -> FloatTensor<Self> => float;
    fn float_gather_nd(_data: FloatTensor<Self> => float, _indices: IntTensor<Self>) -> FloatTensor<Self> => float;
    fn float_select(tensor: FloatTensor<Self> => float, dim: usize, indices: IntTensor<Self>) -> FloatTensor<Self> => float;
    fn float_select_add(tensor: FloatTensor<Self> => float, dim: usize, indices: IntTensor<Self>, value: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_slice_assign(tensor: FloatTensor<Self> => float, slices: &[Slice], value: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_mask_where(tensor: FloatTensor<Self> => float, mask: BoolTensor<Self>, value: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_mask_fill(tensor: FloatTensor<Self> => float, mask: BoolTensor<Self>, value: Scalar) -> FloatTensor<Self> => float;
    fn float_equal(lhs: FloatTensor<Self> => float, rhs: FloatTensor<Self> => float, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn float_not_equal(lhs: FloatTensor<Self> => float, rhs: FloatTensor<Self> => float, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn float_equal_elem(lhs: FloatTensor<Self> => float, rhs: Scalar, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn float_not_equal_elem(lhs: FloatTensor<Self> => float, rhs: Scalar, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn float_greater(lhs: FloatTensor<Self> => float, rhs: FloatTensor<Self> => float, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn float_greater_elem(lhs: FloatTensor<Self> => float, rhs: Scalar, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn float_greater_equal(lhs: FloatTensor<Self> => float, rhs: FloatTensor<Self> => float, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn float_greater_equal_elem(lhs: FloatTensor<Self> => float, rhs: Scalar, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn float_lower(lhs: FloatTensor<Self> => float, rhs: FloatTensor<Self> => float, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn float_lower_elem(lhs: FloatTensor<Self> => float, rhs: Scalar, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn float_lower_equal(lhs: FloatTensor<Self> => float, rhs: FloatTensor<Self> => float, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn float_lower_equal_elem(lhs: FloatTensor<Self> => float, rhs: Scalar, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn float_sum(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_sum_dim(tensor: FloatTensor<Self> => float, dim: usize) -> FloatTensor<Self> => float;
    fn float_prod(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_prod_dim(tensor: FloatTensor<Self> => float, dim: usize) -> FloatTensor<Self> => float;
    fn float_mean(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_mean_dim(tensor: FloatTensor<Self> => float, dim: usize) -> FloatTensor<Self> => float;
    fn float_cumsum(tensor: FloatTensor<Self> => float, dim: usize) -> FloatTensor<Self> => float;
    fn float_cumprod(tensor: FloatTensor<Self> => float, dim: usize) -> FloatTensor<Self> => float;
    fn float_cummin(tensor: FloatTensor<Self> => float, dim: usize) -> FloatTensor<Self> => float;
    fn float_cummax(tensor: FloatTensor<Self> => float, dim: usize) -> FloatTensor<Self> => float;
    fn float_exp(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_log(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_log1p(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_powf(lhs: FloatTensor<Self> => float, rhs: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_powi(lhs: FloatTensor<Self> => float, rhs: IntTensor<Self>) -> FloatTensor<Self> => float;
    fn float_powi_scalar(lhs: FloatTensor<Self> => float, rhs: Scalar) -> FloatTensor<Self> => float;
    fn float_powi_scalar_impl(lhs: FloatTensor<Self> => float, rhs: Scalar) -> FloatTensor<Self> => float;
    fn float_powf_scalar(tensor: FloatTensor<Self> => float, value: Scalar) -> FloatTensor<Self> => float;
    fn float_powf_scalar_impl(tensor: FloatTensor<Self> => float, value: Scalar) -> FloatTensor<Self> => float;
    fn float_sqrt(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_abs(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_cos(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_sin(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_tan(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_cosh(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_sinh(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_tanh(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_acos(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_acosh(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_asin(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_asinh(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_atan(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_atanh(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_atan2(lhs: FloatTensor<Self> => float, rhs: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_round(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_floor(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_ceil(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_trunc(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_erf(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_cat(tensors: Vec<FloatTensor<Self>> => floats, dim: usize) -> FloatTensor<Self> => float;
    fn float_argmax(tensor: FloatTensor<Self> => float, dim: usize, out_dtype: IntDType) -> IntTensor<Self>;
    fn float_argtopk(tensor: FloatTensor<Self> => float, dim: usize, k: usize, out_dtype: IntDType) -> IntTensor<Self>;
    fn float_topk(tensor: FloatTensor<Self> => float, dim: usize, k: usize) -> FloatTensor<Self> => float;
    fn float_argmin(tensor: FloatTensor<Self> => float, dim: usize, out_dtype: IntDType) -> IntTensor<Self>;
    fn float_max(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_max_dim(tensor: FloatTensor<Self> => float, dim: usize) -> FloatTensor<Self> => float;
    fn float_max_dim_with_indices(tensor: FloatTensor<Self> => float, dim: usize, indices_dtype: IntDType) -> (FloatTensor<Self>, IntTensor<Self>) => (float, _);
    fn float_min(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_min_dim(tensor: FloatTensor<Self> => float, dim: usize) -> FloatTensor<Self> => float;
    fn float_min_dim_with_indices(tensor: FloatTensor<Self> => float, dim: usize, indices_dtype: IntDType) -> (FloatTensor<Self>, IntTensor<Self>) => (float, _);
    fn float_max_abs(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_max_abs_dim(tensor: FloatTensor<Self> => float, dim: usize) -> FloatTensor<Self> => float;
    fn float_any(tensor: FloatTensor<Self> => float, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn float_any_dim(tensor: FloatTensor<Self> => float, dim: usize, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn float_all(tensor: FloatTensor<Self> => float, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn float_all_dim(tensor: FloatTensor<Self> => float, dim: usize, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn float_sign(tensor: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn float_sort(tensor: FloatTensor<Self> => float, dim: usize, descending: bool) -> FloatTensor<Self> => float;
    fn float_sort_with_indices(tensor: FloatTensor<Self> => float, dim: usize, descending: bool, indices_dtype: IntDType) -> (FloatTensor<Self>, IntTensor<Self>) => (float, _);
    fn float_argsort(tensor: FloatTensor<Self> => float, dim: usize, descending: bool, out_dtype: IntDType) -> IntTensor<Self>;
    fn float_grid_sample_2d(tensor: FloatTensor<Self> => float, grid: FloatTensor<Self> => float, options: GridSampleOptions) -> FloatTensor<Self> => float;
    fn float_unfold(tensor: FloatTensor<Self> => float, dim: usize, size: usize, step: usize) -> FloatTensor<Self> => float;
    fn float_is_nan(tensor: FloatTensor<Self> => float, out_dtype: BoolDType) -> BoolTensor<Self>;
    fn float_is_inf(tensor: FloatTensor<Self> => float, out_dtype: BoolDType) -> BoolTensor<Self>;
    // @generated end
}
