//! Shape operations that a stage-3 parameter handle records instead of computing.
//!
//! A parameter often reaches the op that consumes it through a view: RmsNorm's
//! `gamma.unsqueeze()` (a reshape), BatchNorm's reshape, a tied head's `weight.transpose()`.
//! Autodiff saves what the *consumer* received, so if a view of a handle were computed (gathering
//! the parameter) the saved input would be the full tensor, kept alive until backward. A handle
//! records the view instead and replays it with `B`'s own op when an op gathers it: each view is
//! exactly the inner backend call the decorator received, so the consumer sees the same tensor
//! (values, shape and strides) as it would without sharding.

use burn_backend::{Backend, FloatDType, Shape, Slice};

/// One shape operation on a float tensor, as the decorator received it.
#[derive(Debug, Clone, PartialEq)]
pub enum View {
    Reshape(Shape),
    Transpose,
    SwapDims(usize, usize),
    Permute(Vec<usize>),
    Flip(Vec<usize>),
    Expand(Shape),
    Slice(Vec<Slice>),
    Cast(FloatDType),
}

impl View {
    /// `B`'s op for this view on `tensor`.
    #[inline(always)]
    pub(crate) fn apply<B: Backend>(
        self,
        tensor: B::FloatTensorPrimitive,
    ) -> B::FloatTensorPrimitive {
        match self {
            View::Reshape(shape) => B::float_reshape(tensor, shape),
            View::Transpose => B::float_transpose(tensor),
            View::SwapDims(a, b) => B::float_swap_dims(tensor, a, b),
            View::Permute(axes) => B::float_permute(tensor, &axes),
            View::Flip(axes) => B::float_flip(tensor, &axes),
            View::Expand(shape) => B::float_expand(tensor, shape),
            View::Slice(slices) => B::float_slice(tensor, &slices),
            View::Cast(dtype) => B::float_cast(tensor, dtype),
        }
    }

    /// The shape of the view of a tensor of shape `shape` (a cast keeps it).
    pub(crate) fn shape(&self, shape: &Shape) -> Shape {
        let dims = shape.as_slice();
        match self {
            View::Reshape(to) | View::Expand(to) => to.clone(),
            View::Transpose => {
                let n = dims.len();
                swapped(dims, n.saturating_sub(2), n.saturating_sub(1))
            }
            View::SwapDims(a, b) => swapped(dims, *a, *b),
            View::Permute(axes) => Shape::from(axes.iter().map(|&a| dims[a]).collect::<Vec<_>>()),
            View::Flip(_) | View::Cast(_) => shape.clone(),
            View::Slice(slices) => Shape::from(
                dims.iter()
                    .enumerate()
                    .map(|(d, &size)| slices.get(d).map_or(size, |s| s.output_size(size)))
                    .collect::<Vec<_>>(),
            ),
        }
    }
}

fn swapped(dims: &[usize], a: usize, b: usize) -> Shape {
    let mut dims = dims.to_vec();
    dims.swap(a, b);
    Shape::from(dims)
}
