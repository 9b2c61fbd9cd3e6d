//! Why an NCCL call failed ([`NcclError`]), how that maps onto a [`CollectiveError`], and
//! reading NCCL's result codes.

use crate::collective::CollectiveError;
use cudarc::nccl::sys;
use std::ffi::CStr;
use std::sync::OnceLock;
use tessera_kernels::cuda::GpuError;

/// The sentence [`NcclError::Library`] starts with.
pub const LIBRARY_MISSING: &str = "libnccl.so.2 could not be loaded; point LD_LIBRARY_PATH at NCCL (docs/GPU.md)";

/// Why an NCCL operation failed; every variant names the operation and, where it has one, the
/// rank that saw it.
#[derive(Debug, thiserror::Error)]
pub enum NcclError {
    #[error(
        "libnccl.so.2 could not be loaded; point LD_LIBRARY_PATH at NCCL (docs/GPU.md). cudarc opens it as libnccl.so: \
         where only libnccl.so.2 exists (pip's nvidia-nccl-cu13), add a link libnccl.so -> libnccl.so.2 in a directory \
         on LD_LIBRARY_PATH"
    )]
    Library,
    #[error("{op} failed on rank {rank}: {code}: {detail}")]
    Nccl { op: &'static str, rank: usize, code: String, detail: String },
    #[error("{op}: rank {rank} waited {waited_ms} ms for the operation to finish and gave up; the communicator is aborted")]
    Timeout { op: &'static str, rank: usize, waited_ms: u64 },
    #[error("{op}: rank {rank}: the communicator was aborted: {reason}")]
    Aborted { op: &'static str, rank: usize, reason: String },
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error("{op}: ranks disagree (seen by rank {rank}): {detail}")]
    Mismatch { op: &'static str, rank: usize, detail: String },
    #[error("{op}: invalid argument: {detail}")]
    Invalid { op: &'static str, detail: String },
}

impl From<NcclError> for CollectiveError {
    fn from(e: NcclError) -> Self {
        match e {
            NcclError::Timeout { op, rank, waited_ms } => CollectiveError::Timeout { op, rank, waited_ms },
            NcclError::Aborted { op, reason, .. } => CollectiveError::Aborted { op, reason },
            NcclError::Mismatch { op, detail, .. } => CollectiveError::Mismatch { op, detail },
            NcclError::Invalid { op, detail } => CollectiveError::InvalidArgument { op, detail },
            // A failed NCCL call or GPU error leaves the group unusable (the host path aborts
            // the communicator on them): report it as the abort it is.
            e @ NcclError::Nccl { op, .. } => CollectiveError::Aborted { op, reason: e.to_string() },
            e @ (NcclError::Library | NcclError::Gpu(_)) => CollectiveError::Aborted { op: "nccl", reason: e.to_string() },
        }
    }
}

/// Whether cudarc can open NCCL (probed once).
pub(super) fn ensure_library() -> Result<(), NcclError> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the library names cudarc uses; no NCCL call is made.
    if *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() }) {
        Ok(())
    } else {
        Err(NcclError::Library)
    }
}

pub(super) fn is_ok(r: sys::ncclResult_t) -> bool {
    matches!(r, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress)
}

/// NCCL's description of `r` and, when there is a communicator, its last error message.
fn describe(r: sys::ncclResult_t, comm: sys::ncclComm_t) -> String {
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: NCCL returns NUL-terminated static or per-thread strings.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    // SAFETY: plain queries; `comm` is null or a live communicator (NCCL accepts null here).
    let (what, last) = unsafe { (text(sys::ncclGetErrorString(r)), text(sys::ncclGetLastError(comm))) };
    if last.is_empty() || last == what {
        what
    } else {
        format!("{what} ({last})")
    }
}

pub(super) fn nccl_err(op: &'static str, rank: usize, r: sys::ncclResult_t, comm: sys::ncclComm_t) -> NcclError {
    NcclError::Nccl { op, rank, code: format!("{r:?}"), detail: describe(r, comm) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_collective_errors() {
        let t: CollectiveError = NcclError::Timeout { op: "all_gather", rank: 1, waited_ms: 5 }.into();
        assert_eq!(t, CollectiveError::Timeout { op: "all_gather", rank: 1, waited_ms: 5 });
        let m: CollectiveError = NcclError::Mismatch { op: "broadcast", rank: 0, detail: "x".into() }.into();
        assert_eq!(m, CollectiveError::Mismatch { op: "broadcast", detail: "x".into() });
        let l: CollectiveError = NcclError::Library.into();
        assert!(matches!(l, CollectiveError::Aborted { reason, .. } if reason.starts_with(LIBRARY_MISSING)));
    }
}
