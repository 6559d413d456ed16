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

/// NVRTC's and the driver's CUDA versions as this binary loads them, for `run.sh`: one line
/// `nvrtc=13.0 driver=13.0`, with `none` for a library that does not load and `stub` for a
/// libcuda that is the toolkit's stub (`CUDA_ERROR_STUB_LIBRARY`). A newer NVRTC than the
/// driver writes PTX the driver cannot load, so `run.sh` stops the kernel checks then.
pub fn versions() -> String {
    format!("nvrtc={} driver={}", nvrtc_version(), driver_version())
}

fn nvrtc_version() -> String {
    use cudarc::nvrtc::sys;
    // SAFETY: only tries to open the candidate libraries.
    if !unsafe { sys::is_culib_present() } {
        return "none".into();
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers; NVRTC needs no initialisation.
    match unsafe { sys::nvrtcVersion(&mut major, &mut minor) } {
        sys::nvrtcResult::NVRTC_SUCCESS => format!("{major}.{minor}"),
        other => format!("error:{other:?}"),
    }
}

fn driver_version() -> String {
    use cudarc::driver::sys;
    // SAFETY: only tries to open the candidate libraries.
    if !unsafe { sys::is_culib_present() } {
        return "none".into();
    }
    let mut version = 0;
    // SAFETY: a valid out-pointer; cuDriverGetVersion may be called before cuInit.
    match unsafe { sys::cuDriverGetVersion(&mut version) } {
        sys::CUresult::CUDA_SUCCESS => format!("{}.{}", version / 1000, version % 1000 / 10),
        sys::CUresult::CUDA_ERROR_STUB_LIBRARY => "stub".into(),
        other => format!("error:{other:?}"),
    }
}
