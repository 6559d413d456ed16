//! When the device reducer copies a gradient before reducing it in place, and the copy.

use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;

/// A copy of `tensor` in new memory, row-major without padding: cubecl's `into_contiguous`
/// always allocates unpadded memory, where `CubeTensor::copy` would allocate padded rows again
/// (and `burn_cubecl::kernel::into_contiguous` returns a contiguous tensor as it is). What the
/// reducer reduces instead of a gradient it cannot reduce where it is; public for the device
/// check.
#[doc(hidden)]
pub fn contiguous_copy<R: CubeRuntime>(tensor: CubeTensor<R>) -> CubeTensor<R> {
    let (client, device, dtype) = (tensor.client.clone(), tensor.device.clone(), tensor.dtype);
    let output =
        burn_cubecl::cubecl::std::tensor::into_contiguous(&client, tensor.binding(), dtype.into());
    CubeTensor::new(client, output.handle, *output.metadata, device, dtype)
}

/// Why the device path copied a gradient before reducing it in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyReason {
    /// Its memory is shared (fusion's own handle, another tensor, or a later backward step).
    Shared,
    /// A private tensor whose rows the allocator padded (cubecl-cuda: see
    /// `burn_dist::cuda_pads_rows`).
    Pitched,
    /// Another strided layout: a transposed or broadcast view, a slice.
    Strided,
}

/// Gradients the device path copied before reducing them in place (in the reducer's stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CopyCounts {
    /// Every copy, whatever the reason.
    pub(crate) private: u64,
    /// Those of private gradients whose rows the allocator had padded.
    pub(crate) pitched: u64,
}

impl CopyCounts {
    /// Counts a gradient copied for `reason` (nothing for `None`: reduced where it was).
    pub(crate) fn record(&mut self, reason: Option<CopyReason>) {
        if let Some(reason) = reason {
            self.private += 1;
            if reason == CopyReason::Pitched {
                self.pitched += 1;
            }
        }
    }
}

/// Why a gradient with this memory and layout must be copied before an in-place reduction;
/// `None` when it can be reduced where it is (unique and contiguous).
pub(crate) fn copy_reason(
    unique: bool,
    contiguous: bool,
    shape: &[usize],
    strides: &[usize],
) -> Option<CopyReason> {
    match (unique, contiguous) {
        (true, true) => None,
        (false, _) => Some(CopyReason::Shared),
        (true, false) if is_pitched(shape, strides) => Some(CopyReason::Pitched),
        (true, false) => Some(CopyReason::Strided),
    }
}

/// Whether `strides` is a padded-rows layout of `shape`: row-major, except that each row (the
/// last dimension) is followed by padding, as cubecl-runtime's `PitchedMemoryLayoutPolicy` lays
/// out the tensors cubecl-cuda creates (`create_tensor`, `empty_tensor`: kernel outputs too).
fn is_pitched(shape: &[usize], strides: &[usize]) -> bool {
    let rank = shape.len();
    rank >= 2
        && strides.len() == rank
        && strides[rank - 1] == 1
        && strides[rank - 2] > shape[rank - 1]
        && (0..rank - 2).all(|i| strides[i] == strides[i + 1] * shape[i + 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shared memory and strided views are copied for their own reason; a unique contiguous
    /// gradient is not copied; the counts add up per reason.
    #[test]
    fn copies_are_counted_by_reason() {
        let mut counts = CopyCounts::default();
        let transposed = copy_reason(true, false, &[96, 64], &[1, 96]);
        let broadcast = copy_reason(true, false, &[16, 128], &[0, 1]);
        let shared = copy_reason(false, true, &[16, 128], &[128, 1]);
        let shared_padded = copy_reason(false, false, &[64, 96], &[128, 1]);
        let padded = copy_reason(true, false, &[64, 96], &[128, 1]);
        let in_place = copy_reason(true, true, &[16, 128], &[128, 1]);
        assert_eq!(transposed, Some(CopyReason::Strided));
        assert_eq!(broadcast, Some(CopyReason::Strided));
        assert_eq!(shared, Some(CopyReason::Shared));
        assert_eq!(shared_padded, Some(CopyReason::Shared));
        assert_eq!(padded, Some(CopyReason::Pitched));
        assert_eq!(in_place, None);
        for reason in [
            transposed,
            broadcast,
            shared,
            shared_padded,
            padded,
            in_place,
        ] {
            counts.record(reason);
        }
        assert_eq!(
            counts,
            CopyCounts {
                private: 5,
                pitched: 1
            }
        );
    }
}
