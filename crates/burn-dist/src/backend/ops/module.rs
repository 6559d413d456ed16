//! Forwards `ModuleOps` to the inner backend.
//!
//! The list between the `@generated` markers is burn-backend 0.21.0's `ModuleOps`
//! signatures, written by
//! `BURN_DIST_REGENERATE=1 cargo test -p burn-dist --test forwarding_is_complete -- --ignored`.

#[allow(unused_imports)]
use super::prelude::*;

forward! {
    ops ModuleOps;
    const FORWARDED;
    by_hand [] {}
    // @generated begin
    fn embedding(weights: FloatTensor<Self> => float, indices: IntTensor<Self>) -> FloatTensor<Self> => float;
    fn embedding_backward(weights: FloatTensor<Self> => float_meta, output_grad: FloatTensor<Self> => float, indices: IntTensor<Self>) -> FloatTensor<Self> => float;
    fn linear(x: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, bias: Option<FloatTensor<Self>> => float_opt) -> FloatTensor<Self> => float;
    fn linear_x_backward(weight: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn linear_weight_backward(x: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn linear_bias_backward(output_grad: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn conv1d(x: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, bias: Option<FloatTensor<Self>> => float_opt, options: ConvOptions<1>) -> FloatTensor<Self> => float;
    fn conv1d_x_backward(x: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float, options: ConvOptions<1>) -> FloatTensor<Self> => float;
    fn conv1d_weight_backward(x: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float, options: ConvOptions<1>) -> FloatTensor<Self> => float;
    fn conv1d_bias_backward(x: FloatTensor<Self> => float, bias: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn conv2d(x: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, bias: Option<FloatTensor<Self>> => float_opt, options: ConvOptions<2>) -> FloatTensor<Self> => float;
    fn conv2d_x_backward(x: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float, options: ConvOptions<2>) -> FloatTensor<Self> => float;
    fn conv2d_weight_backward(x: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float, options: ConvOptions<2>) -> FloatTensor<Self> => float;
    fn conv2d_bias_backward(x: FloatTensor<Self> => float, bias: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn deform_conv2d(x: FloatTensor<Self> => float, offset: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, mask: Option<FloatTensor<Self>> => float_opt, bias: Option<FloatTensor<Self>> => float_opt, options: DeformConvOptions<2>) -> FloatTensor<Self> => float;
    fn deform_conv2d_backward(x: FloatTensor<Self> => float, offset: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, mask: Option<FloatTensor<Self>> => float_opt, bias: Option<FloatTensor<Self>> => float_opt, output_grad: FloatTensor<Self> => float, options: DeformConvOptions<2>) -> DeformConv2dBackward<Self> => wrap;
    fn conv3d(x: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, bias: Option<FloatTensor<Self>> => float_opt, options: ConvOptions<3>) -> FloatTensor<Self> => float;
    fn conv3d_x_backward(x: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float, options: ConvOptions<3>) -> FloatTensor<Self> => float;
    fn conv3d_weight_backward(x: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float, options: ConvOptions<3>) -> FloatTensor<Self> => float;
    fn conv3d_bias_backward(x: FloatTensor<Self> => float, bias: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn conv_transpose1d(x: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, bias: Option<FloatTensor<Self>> => float_opt, options: ConvTransposeOptions<1>) -> FloatTensor<Self> => float;
    fn conv_transpose1d_x_backward(weight: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float, options: ConvTransposeOptions<1>) -> FloatTensor<Self> => float;
    fn conv_transpose1d_weight_backward(x: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float, options: ConvTransposeOptions<1>) -> FloatTensor<Self> => float;
    fn conv_transpose1d_bias_backward(x: FloatTensor<Self> => float, bias: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn conv_transpose2d(x: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, bias: Option<FloatTensor<Self>> => float_opt, options: ConvTransposeOptions<2>) -> FloatTensor<Self> => float;
    fn conv_transpose2d_x_backward(weight: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float, options: ConvTransposeOptions<2>) -> FloatTensor<Self> => float;
    fn conv_transpose2d_weight_backward(x: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float, options: ConvTransposeOptions<2>) -> FloatTensor<Self> => float;
    fn conv_transpose2d_bias_backward(x: FloatTensor<Self> => float, bias: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn conv_transpose3d(x: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, bias: Option<FloatTensor<Self>> => float_opt, options: ConvTransposeOptions<3>) -> FloatTensor<Self> => float;
    fn conv_transpose3d_x_backward(weight: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float, options: ConvTransposeOptions<3>) -> FloatTensor<Self> => float;
    fn conv_transpose3d_weight_backward(x: FloatTensor<Self> => float, weight: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float, options: ConvTransposeOptions<3>) -> FloatTensor<Self> => float;
    fn conv_transpose3d_bias_backward(x: FloatTensor<Self> => float, bias: FloatTensor<Self> => float, output_grad: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn unfold4d(x: FloatTensor<Self> => float, kernel_size: [usize; 2], options: UnfoldOptions) -> FloatTensor<Self> => float;
    fn avg_pool1d(x: FloatTensor<Self> => float, kernel_size: usize, stride: usize, padding: usize, count_include_pad: bool, ceil_mode: bool) -> FloatTensor<Self> => float;
    fn avg_pool1d_backward(x: FloatTensor<Self> => float, grad: FloatTensor<Self> => float, kernel_size: usize, stride: usize, padding: usize, count_include_pad: bool, ceil_mode: bool) -> FloatTensor<Self> => float;
    fn avg_pool2d(x: FloatTensor<Self> => float, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], count_include_pad: bool, ceil_mode: bool) -> FloatTensor<Self> => float;
    fn avg_pool2d_backward(x: FloatTensor<Self> => float, grad: FloatTensor<Self> => float, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], count_include_pad: bool, ceil_mode: bool) -> FloatTensor<Self> => float;
    fn adaptive_avg_pool2d(x: FloatTensor<Self> => float, output_size: [usize; 2]) -> FloatTensor<Self> => float;
    fn adaptive_avg_pool2d_backward(x: FloatTensor<Self> => float, grad: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn adaptive_avg_pool1d(x: FloatTensor<Self> => float, output_size: usize) -> FloatTensor<Self> => float;
    fn adaptive_avg_pool1d_backward(x: FloatTensor<Self> => float, grad: FloatTensor<Self> => float) -> FloatTensor<Self> => float;
    fn max_pool1d(x: FloatTensor<Self> => float, kernel_size: usize, stride: usize, padding: usize, dilation: usize, ceil_mode: bool) -> FloatTensor<Self> => float;
    fn max_pool1d_with_indices(x: FloatTensor<Self> => float, kernel_size: usize, stride: usize, padding: usize, dilation: usize, ceil_mode: bool) -> MaxPool1dWithIndices<Self> => wrap;
    fn max_pool1d_with_indices_backward(x: FloatTensor<Self> => float, kernel_size: usize, stride: usize, padding: usize, dilation: usize, ceil_mode: bool, output_grad: FloatTensor<Self> => float, indices: IntTensor<Self>) -> MaxPool1dBackward<Self> => wrap;
    fn max_pool2d(x: FloatTensor<Self> => float, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], dilation: [usize; 2], ceil_mode: bool) -> FloatTensor<Self> => float;
    fn max_pool2d_with_indices(x: FloatTensor<Self> => float, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], dilation: [usize; 2], ceil_mode: bool) -> MaxPool2dWithIndices<Self> => wrap;
    fn max_pool2d_with_indices_backward(x: FloatTensor<Self> => float, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], dilation: [usize; 2], ceil_mode: bool, output_grad: FloatTensor<Self> => float, indices: IntTensor<Self>) -> MaxPool2dBackward<Self> => wrap;
    fn interpolate(x: FloatTensor<Self> => float, output_size: [usize; 2], options: InterpolateOptions) -> FloatTensor<Self> => float;
    fn interpolate_backward(x: FloatTensor<Self> => float, grad: FloatTensor<Self> => float, output_size: [usize; 2], options: InterpolateOptions) -> FloatTensor<Self> => float;
    fn attention(query: FloatTensor<Self> => float, key: FloatTensor<Self> => float, value: FloatTensor<Self> => float, mask: Option<BoolTensor<Self>>, attn_bias: Option<FloatTensor<Self>> => float_opt, options: AttentionModuleOptions) -> FloatTensor<Self> => float;
    fn layer_norm(tensor: FloatTensor<Self> => float, gamma: FloatTensor<Self> => float, beta: Option<FloatTensor<Self>> => float_opt, epsilon: f64) -> FloatTensor<Self> => float;
    fn ctc_loss(log_probs: FloatTensor<Self> => float, targets: IntTensor<Self>, input_lengths: IntTensor<Self>, target_lengths: IntTensor<Self>, blank: usize) -> FloatTensor<Self> => float;
    fn has_ctc_loss_backward() -> bool;
    fn ctc_loss_backward(_log_probs: FloatTensor<Self> => float, _targets: IntTensor<Self>, _input_lengths: IntTensor<Self>, _target_lengths: IntTensor<Self>, _grad_loss: FloatTensor<Self> => float, _blank: usize) -> FloatTensor<Self> => float;
    fn rfft(signal: FloatTensor<Self> => float, dim: usize, n: Option<usize>) -> (FloatTensor<Self>, FloatTensor<Self>) => (float, float);
    fn irfft(spectrum_re: FloatTensor<Self> => float, spectrum_im: FloatTensor<Self> => float, dim: usize, n: Option<usize>) -> FloatTensor<Self> => float;
    // @generated end
}
