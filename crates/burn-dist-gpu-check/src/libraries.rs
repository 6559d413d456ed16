//! Looks for libcuda and libnvrtc before cubecl-cuda would panic on a missing one.

/// `Err` naming the missing library, the names that were tried, and where it usually is.
pub fn check_cuda_runtime() -> Result<(), String> {
    // SAFETY: only tries to open the candidate libraries.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(format!(
            "the CUDA driver library was not found (tried {:?}): is this a GPU machine with \
             the NVIDIA driver installed?",
            cudarc::get_lib_name_candidates("cuda")
        ));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(format!(
            "NVRTC, which cubecl-cuda compiles its kernels with, was not found (tried {:?}): \
             put the lib directory of the nvidia-cuda-nvrtc Python package on LD_LIBRARY_PATH \
             (run.sh does; see docs/gpu.md)",
            cudarc::get_lib_name_candidates("nvrtc")
        ));
    }
    Ok(())
}
