//! Page-locking memory the caller allocated, across the C ABI
//! (`gpualloc_host_register` / `gpualloc_host_unregister`): Numba's `mempin`
//! through the library, so that the bytes pinned in place are counted in
//! the host statistics (`gpualloc_host_stats_json`) beside the pinned allocator's.

use std::ffi::{c_int, c_void};

use alloc_cuda::{CudaError, HostRegistry, RegisteredStats};

use crate::api::GPUALLOC_HOST_REGISTER_MAPPED;
use crate::call_int;
use crate::state::{CtxGuard, FfiError};

/// Page-locks `size` bytes at `ptr` (portable: for every context); see
/// `include/gpualloc.h`.
///
/// # Safety
/// `ptr..ptr + size` is memory of this process that stays allocated until
/// [`gpualloc_host_unregister`] of `ptr`.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_host_register(
    ptr: *mut c_void,
    size: usize,
    flags: c_int,
) -> c_int {
    call_int(|| {
        if ptr.is_null() || size == 0 {
            return Err(FfiError::invalid(format!(
                "gpualloc_host_register({ptr:p}, {size}): a range of at least one byte"
            )));
        }
        if flags & !GPUALLOC_HOST_REGISTER_MAPPED != 0 {
            return Err(FfiError::invalid(format!(
                "gpualloc_host_register: unknown flags {flags:#x} (known: \
                 GPUALLOC_HOST_REGISTER_MAPPED = {GPUALLOC_HOST_REGISTER_MAPPED})"
            )));
        }
        let mapped = flags & GPUALLOC_HOST_REGISTER_MAPPED != 0;
        let _ctx = CtxGuard::save_if_driver_loaded();
        // SAFETY: the caller's contract above.
        unsafe { HostRegistry::global()?.register(ptr.cast(), size, mapped) }?;
        Ok(())
    })
}

/// Unpins the range [`gpualloc_host_register`] pinned at `ptr`; see
/// `include/gpualloc.h`.
///
/// # Safety
/// No queued copy uses the range any more.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_host_unregister(ptr: *mut c_void) -> c_int {
    call_int(|| {
        // Nothing registered yet: no range starts at `ptr`, whether or not
        // there is a driver to ask.
        let registry =
            HostRegistry::existing().ok_or(CudaError::HostNotRegistered { addr: ptr as u64 })?;
        let _ctx = CtxGuard::save_if_driver_loaded();
        // SAFETY: the caller's contract above.
        unsafe { registry.unregister(ptr.cast()) }?;
        Ok(())
    })
}

/// The counters of memory pinned in place, zeros before the first
/// registration (so that the host statistics need no driver for them).
pub(crate) fn registered_stats() -> RegisteredStats {
    HostRegistry::existing().map_or_else(RegisteredStats::default, |r| r.stats())
}
