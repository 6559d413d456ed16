//! What is particular to CUDA on the device path (feature `cuda`): burn-cuda's backend without
//! fusion and its device, and which gradient shapes cubecl-cuda's allocator pads (each costs
//! the in-place reducer a private copy). The device reducer itself is runtime-generic
//! (`crate::device`); on CUDA its collectives are NCCL's (`burn_dist_device::NcclCollectives`).

use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::cuda::CudaRuntime;

/// burn-cuda's backend without fusion.
pub type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;

/// The row alignment, in bytes, of cubecl-cuda 0.10's allocator (`mem_alignment` in its
/// `runtime.rs`, what `cuMemAllocPitch` returns), to which `PitchedMemoryLayoutPolicy` pads rows.
pub const CUDA_ROW_ALIGNMENT: usize = 512;

/// Whether cubecl-cuda 0.10 pads the rows of a new tensor of `shape` with elements of
/// `elem_size` bytes, which makes it non-contiguous and so costs the in-place reducer a private
/// copy of its gradient. A row of `width × elem_size` bytes is padded to a multiple of
/// `min(512, its next power of two)` (at least 16): rows of a multiple of 512 bytes, of a power
/// of two of at least 16 bytes, or of one element are not padded; nor is a tensor of rank 1.
pub fn cuda_pads_rows(shape: &[usize], elem_size: usize) -> bool {
    let Some((&width, rows)) = shape.split_last() else {
        return false;
    };
    if rows.is_empty() || width <= 1 {
        return false;
    }
    let bytes = width * elem_size;
    let align = bytes.next_power_of_two().clamp(16, CUDA_ROW_ALIGNMENT);
    !bytes.is_multiple_of(align)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{CopyReason, copy_reason};

    /// The layout cubecl-cuda 0.10 gives a new tensor: its server's own `MemoryLayoutPolicy`
    /// (cubecl-runtime's `PitchedMemoryLayoutPolicy`) at the runtime's 512-byte alignment.
    fn cuda_strides(shape: &[usize], elem_size: usize) -> Vec<usize> {
        use burn_cubecl::cubecl::Runtime;
        use burn_cubecl::cubecl::server::{
            ComputeServer, MemoryLayoutDescriptor, MemoryLayoutPolicy,
        };
        type Policy = <<CudaRuntime as Runtime>::Server as ComputeServer>::MemoryLayoutPolicy;
        let descriptor = MemoryLayoutDescriptor::optimized(shape.to_vec().into(), elem_size);
        // cubecl-cuda 0.10's `runtime.rs` creates its policy with `mem_alignment = 512`.
        let (_, layouts) = Policy::new(512).apply(
            burn_cubecl::cubecl::stream_id::StreamId::current(),
            &[descriptor],
        );
        layouts[0].strides.to_vec()
    }

    fn row_major(shape: &[usize]) -> Vec<usize> {
        let mut strides = vec![1; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1];
        }
        strides
    }

    /// `cuda_pads_rows` predicts exactly which shapes cubecl-cuda's allocator pads, and every
    /// padded layout is recognized as such (a `Pitched` copy, not a `Strided` one).
    #[test]
    fn padded_rows_are_predicted_and_recognized_as_cubecl_lays_them_out() {
        let widths = (1..=300).chain([384, 511, 512, 513, 768, 1000, 1024, 3072, 50257, 50304]);
        let mut padded = 0;
        for width in widths {
            for leading in [&[][..], &[1], &[3], &[64], &[2, 5]] {
                for elem_size in [2, 4] {
                    let shape: Vec<usize> = leading.iter().copied().chain([width]).collect();
                    let strides = cuda_strides(&shape, elem_size);
                    let contiguous = strides == row_major(&shape);
                    assert_eq!(
                        cuda_pads_rows(&shape, elem_size),
                        !contiguous,
                        "{shape:?} of {elem_size} B: cubecl gives strides {strides:?}"
                    );
                    let reason = copy_reason(true, contiguous, &shape, &strides);
                    if contiguous {
                        assert_eq!(reason, None, "{shape:?}");
                    } else {
                        padded += 1;
                        assert_eq!(reason, Some(CopyReason::Pitched), "{shape:?} {strides:?}");
                    }
                }
            }
        }
        assert!(
            padded > 1000,
            "the shapes tried include padded ones: {padded}"
        );
        // The case: [64, 96] f32 has 384-byte rows, padded to 512.
        assert_eq!(cuda_strides(&[64, 96], 4), [128, 1]);
        // Rows of a multiple of 512 bytes, or of a power of two, are not padded.
        for (shape, elem_size) in [([64, 128], 4), ([64, 256], 2), ([7, 64], 4), ([3, 768], 4)] {
            assert!(!cuda_pads_rows(&shape, elem_size), "{shape:?}");
        }
    }
}
