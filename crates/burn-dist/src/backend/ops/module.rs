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
    fn embedding(weights: FloatTensor<Self>, indices: IntTensor<Self>) -> FloatTensor<Self>;
    fn embedding_backward(weights: FloatTensor<Self>, output_grad: FloatTensor<Self>, indices: IntTensor<Self>) -> FloatTensor<Self>;
    fn linear(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>) -> FloatTensor<Self>;
    fn linear_x_backward(weight: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self>;
    fn linear_weight_backward(x: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self>;
    fn linear_bias_backward(output_grad: FloatTensor<Self>) -> FloatTensor<Self>;
    fn conv1d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvOptions<1>) -> FloatTensor<Self>;
    fn conv1d_x_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<1>) -> FloatTensor<Self>;
    fn conv1d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<1>) -> FloatTensor<Self>;
    fn conv1d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self>;
    fn conv2d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvOptions<2>) -> FloatTensor<Self>;
    fn conv2d_x_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<2>) -> FloatTensor<Self>;
    fn conv2d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<2>) -> FloatTensor<Self>;
    fn conv2d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self>;
    fn deform_conv2d(x: FloatTensor<Self>, offset: FloatTensor<Self>, weight: FloatTensor<Self>, mask: Option<FloatTensor<Self>>, bias: Option<FloatTensor<Self>>, options: DeformConvOptions<2>) -> FloatTensor<Self>;
    #[relabel] fn deform_conv2d_backward(x: FloatTensor<Self>, offset: FloatTensor<Self>, weight: FloatTensor<Self>, mask: Option<FloatTensor<Self>>, bias: Option<FloatTensor<Self>>, output_grad: FloatTensor<Self>, options: DeformConvOptions<2>) -> DeformConv2dBackward<Self>;
    fn conv3d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvOptions<3>) -> FloatTensor<Self>;
    fn conv3d_x_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<3>) -> FloatTensor<Self>;
    fn conv3d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<3>) -> FloatTensor<Self>;
    fn conv3d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self>;
    fn conv_transpose1d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvTransposeOptions<1>) -> FloatTensor<Self>;
    fn conv_transpose1d_x_backward(weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<1>) -> FloatTensor<Self>;
    fn conv_transpose1d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<1>) -> FloatTensor<Self>;
    fn conv_transpose1d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self>;
    fn conv_transpose2d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvTransposeOptions<2>) -> FloatTensor<Self>;
    fn conv_transpose2d_x_backward(weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<2>) -> FloatTensor<Self>;
    fn conv_transpose2d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<2>) -> FloatTensor<Self>;
    fn conv_transpose2d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self>;
    fn conv_transpose3d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvTransposeOptions<3>) -> FloatTensor<Self>;
    fn conv_transpose3d_x_backward(weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<3>) -> FloatTensor<Self>;
    fn conv_transpose3d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<3>) -> FloatTensor<Self>;
    fn conv_transpose3d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self>;
    fn unfold4d(x: FloatTensor<Self>, kernel_size: [usize; 2], options: UnfoldOptions) -> FloatTensor<Self>;
    fn avg_pool1d(x: FloatTensor<Self>, kernel_size: usize, stride: usize, padding: usize, count_include_pad: bool, ceil_mode: bool) -> FloatTensor<Self>;
    fn avg_pool1d_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>, kernel_size: usize, stride: usize, padding: usize, count_include_pad: bool, ceil_mode: bool) -> FloatTensor<Self>;
    fn avg_pool2d(x: FloatTensor<Self>, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], count_include_pad: bool, ceil_mode: bool) -> FloatTensor<Self>;
    fn avg_pool2d_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], count_include_pad: bool, ceil_mode: bool) -> FloatTensor<Self>;
    fn adaptive_avg_pool2d(x: FloatTensor<Self>, output_size: [usize; 2]) -> FloatTensor<Self>;
    fn adaptive_avg_pool2d_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
    fn adaptive_avg_pool1d(x: FloatTensor<Self>, output_size: usize) -> FloatTensor<Self>;
    fn adaptive_avg_pool1d_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
    fn max_pool1d(x: FloatTensor<Self>, kernel_size: usize, stride: usize, padding: usize, dilation: usize, ceil_mode: bool) -> FloatTensor<Self>;
    #[relabel] fn max_pool1d_with_indices(x: FloatTensor<Self>, kernel_size: usize, stride: usize, padding: usize, dilation: usize, ceil_mode: bool) -> MaxPool1dWithIndices<Self>;
    #[relabel] fn max_pool1d_with_indices_backward(x: FloatTensor<Self>, kernel_size: usize, stride: usize, padding: usize, dilation: usize, ceil_mode: bool, output_grad: FloatTensor<Self>, indices: IntTensor<Self>) -> MaxPool1dBackward<Self>;
    fn max_pool2d(x: FloatTensor<Self>, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], dilation: [usize; 2], ceil_mode: bool) -> FloatTensor<Self>;
    #[relabel] fn max_pool2d_with_indices(x: FloatTensor<Self>, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], dilation: [usize; 2], ceil_mode: bool) -> MaxPool2dWithIndices<Self>;
    #[relabel] fn max_pool2d_with_indices_backward(x: FloatTensor<Self>, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], dilation: [usize; 2], ceil_mode: bool, output_grad: FloatTensor<Self>, indices: IntTensor<Self>) -> MaxPool2dBackward<Self>;
    fn interpolate(x: FloatTensor<Self>, output_size: [usize; 2], options: InterpolateOptions) -> FloatTensor<Self>;
    fn interpolate_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>, output_size: [usize; 2], options: InterpolateOptions) -> FloatTensor<Self>;
    fn attention(query: FloatTensor<Self>, key: FloatTensor<Self>, value: FloatTensor<Self>, mask: Option<BoolTensor<Self>>, attn_bias: Option<FloatTensor<Self>>, options: AttentionModuleOptions) -> FloatTensor<Self>;
    fn layer_norm(tensor: FloatTensor<Self>, gamma: FloatTensor<Self>, beta: Option<FloatTensor<Self>>, epsilon: f64) -> FloatTensor<Self>;
    fn ctc_loss(log_probs: FloatTensor<Self>, targets: IntTensor<Self>, input_lengths: IntTensor<Self>, target_lengths: IntTensor<Self>, blank: usize) -> FloatTensor<Self>;
    fn has_ctc_loss_backward() -> bool;
    fn ctc_loss_backward(_log_probs: FloatTensor<Self>, _targets: IntTensor<Self>, _input_lengths: IntTensor<Self>, _target_lengths: IntTensor<Self>, _grad_loss: FloatTensor<Self>, _blank: usize) -> FloatTensor<Self>;
    fn rfft(signal: FloatTensor<Self>, dim: usize, n: Option<usize>) -> (FloatTensor<Self>, FloatTensor<Self>);
    fn irfft(spectrum_re: FloatTensor<Self>, spectrum_im: FloatTensor<Self>, dim: usize, n: Option<usize>) -> FloatTensor<Self>;
    // @generated end
}
