//! Loading libcuda and libnccl without panicking, and turning CUDA and NCCL failures into
//! [`CommError`]s that name the rank and the operation.
//!
//! cudarc loads both libraries lazily and panics when one is missing or lacks a symbol. So
//! before any other call, [`check_libraries`] looks for them under the names cudarc tries,
//! checks every NCCL symbol this module calls, and checks NCCL's version; a problem becomes an
//! error that says which library, which names were tried and what to do (docs/gpu.md).
//!
//! How failures map onto [`CommError`]:
//! - a missing or too old library: [`CommError::Env`] on `LD_LIBRARY_PATH`;
//! - a failed CUDA or NCCL call: [`CommError::Io`], context `rank R: NCCL all_reduce #7 (…)`,
//!   message the NCCL error name and NCCL's own last-error text;
//! - a collective that does not finish within the timeout: [`CommError::Aborted`] by this
//!   rank, after `ncclCommAbort` (NCCL does not say which peer is missing);
//! - every later collective on an aborted communicator: [`CommError::Aborted`] with the first
//!   failure as the reason.

use std::ffi::{CStr, c_char};

use cudarc::driver::DriverError;
use cudarc::nccl::sys::{self, ncclComm_t, ncclResult_t};

use crate::CommError;

/// The oldest NCCL with everything used here: non-blocking communicators (2.14), `ncclAvg`
/// and bf16 (2.10).
pub(crate) const MIN_NCCL_VERSION: (i32, i32) = (2, 14);

/// Every NCCL entry point this module calls (checked up front: cudarc panics on a missing one).
const NCCL_SYMBOLS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRankConfig",
    "ncclCommGetAsyncError",
    "ncclCommFinalize",
    "ncclCommDestroy",
    "ncclCommAbort",
    "ncclGetErrorString",
    "ncclGetLastError",
    "ncclAllReduce",
    "ncclReduceScatter",
    "ncclAllGather",
    "ncclBroadcast",
    "ncclReduce",
    "ncclGroupStart",
    "ncclGroupEnd",
];

const HINT: &str = "see docs/gpu.md: the nvidia-nccl-cu13 Python wheel ships only libnccl.so.2, \
                    which cudarc does not try; link libnccl.so to it in a directory on \
                    LD_LIBRARY_PATH";

fn library_error(problem: String) -> CommError {
    CommError::Env {
        var: "LD_LIBRARY_PATH".into(),
        problem,
    }
}

/// Finds libcuda and libnccl, checks NCCL's symbols and version, and returns the version as
/// `(major, minor, patch)`. Call it before any CUDA or NCCL call.
pub(crate) fn check_libraries(rank: usize) -> Result<(i32, i32, i32), CommError> {
    // SAFETY: only tries to open the candidate libraries.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(library_error(format!(
            "rank {rank}: the CUDA driver library was not found (tried {:?}): is an NVIDIA \
             driver installed, and is this a GPU machine?",
            cudarc::get_lib_name_candidates("cuda")
        )));
    }
    // SAFETY: as above.
    if !unsafe { sys::is_culib_present() } {
        return Err(library_error(format!(
            "rank {rank}: NCCL was not found (tried {:?}); {HINT}",
            cudarc::get_lib_name_candidates("nccl")
        )));
    }
    // SAFETY: `is_culib_present` just opened one of the candidates, so `culib` does not panic;
    // looking a symbol up runs no code of the library.
    let lib = unsafe { sys::culib() };
    let missing: Vec<&str> = NCCL_SYMBOLS
        .iter()
        .copied()
        .filter(|name| unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_err())
        .collect();
    if !missing.is_empty() {
        return Err(library_error(format!(
            "rank {rank}: the NCCL library that was loaded lacks {missing:?}: it is older than \
             {}.{} or not NCCL; {HINT}",
            MIN_NCCL_VERSION.0, MIN_NCCL_VERSION.1
        )));
    }
    let code = cudarc::nccl::result::get_nccl_version()
        .map_err(|e| nccl_error(rank, "ncclGetVersion", e.0, None))?;
    let version = decode_version(code);
    if (version.0, version.1) < MIN_NCCL_VERSION {
        return Err(library_error(format!(
            "rank {rank}: NCCL {}.{}.{} is too old; burn-dist needs {}.{} or newer",
            version.0, version.1, version.2, MIN_NCCL_VERSION.0, MIN_NCCL_VERSION.1
        )));
    }
    Ok(version)
}

/// `NCCL_VERSION_CODE` to `(major, minor, patch)`: `X*1000 + Y*100 + Z` up to 2.8, then
/// `X*10000 + Y*100 + Z`.
pub(crate) fn decode_version(code: i32) -> (i32, i32, i32) {
    if code >= 10000 {
        (code / 10000, (code % 10000) / 100, code % 100)
    } else {
        (code / 1000, (code % 1000) / 100, code % 100)
    }
}

fn c_text(ptr: *const c_char) -> Option<String> {
    // SAFETY: NCCL returns null or a NUL-terminated string it owns.
    (!ptr.is_null()).then(|| {
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned()
    })
}

/// A failed NCCL call: `rank R: NCCL <what>: ncclInvalidArgument (invalid argument): <NCCL's
/// last error>`.
pub(crate) fn nccl_error(
    rank: usize,
    what: &str,
    code: ncclResult_t,
    comm: Option<ncclComm_t>,
) -> CommError {
    // SAFETY: both return static or communicator-owned strings; `comm` is live or null.
    let name = c_text(unsafe { sys::ncclGetErrorString(code) }).unwrap_or_default();
    let last = comm
        .and_then(|c| c_text(unsafe { sys::ncclGetLastError(c) }))
        .filter(|s| !s.is_empty())
        .map(|s| format!(": {s}"))
        .unwrap_or_default();
    CommError::Io {
        context: format!("rank {rank}: NCCL {what}"),
        message: format!("{code:?} ({name}){last}"),
    }
}

/// A failed CUDA driver call: `rank R: CUDA <what>: CUDA_ERROR_OUT_OF_MEMORY (out of memory)`.
pub(crate) fn cuda_error(rank: usize, what: &str, err: DriverError) -> CommError {
    let name = err
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", err.0));
    let text = err
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    CommError::Io {
        context: format!("rank {rank}: CUDA {what}"),
        message: format!("{name} ({text})"),
    }
}

/// Turns an NCCL return code into `Ok(in_progress)` or an error.
pub(crate) fn nccl_result(
    rank: usize,
    what: &str,
    code: ncclResult_t,
    comm: Option<ncclComm_t>,
) -> Result<bool, CommError> {
    match code {
        ncclResult_t::ncclSuccess => Ok(false),
        ncclResult_t::ncclInProgress => Ok(true),
        code => Err(nccl_error(rank, what, code, comm)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_decode_before_and_after_2_9() {
        assert_eq!(decode_version(2708), (2, 7, 8));
        assert_eq!(decode_version(21003), (2, 10, 3));
        assert_eq!(decode_version(22805), (2, 28, 5));
    }
}
