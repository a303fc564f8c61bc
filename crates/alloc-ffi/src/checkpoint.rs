//! Private-pool checkpoints across the C ABI, for CUDA graph trees
//! (`torch.compile(mode="reduce-overhead")`): the bridge's
//! `getCheckpointState`, `setCheckpointPoolState` and
//! `checkPoolLiveAllocations` call these.

use std::collections::HashSet;
use std::ffi::{c_int, c_void};

use alloc_core::PoolCheckpoint;

use crate::state::{self, CtxGuard, FfiError, FfiResult};
use crate::{call_int, call_ptr, named_pool};

/// Saves the layout of a private pool; the returned handle is freed with
/// [`gpualloc_pool_checkpoint_free`]. NULL on error.
#[no_mangle]
pub extern "C" fn gpualloc_checkpoint_pool(
    device: c_int,
    pool_first: u64,
    pool_second: u64,
) -> *mut c_void {
    call_ptr(|| {
        let pool = named_pool(pool_first, pool_second)?;
        let cp = state::allocator(device)?.pools().checkpoint(pool)?;
        Ok(Box::into_raw(Box::new(cp)).cast::<c_void>())
    })
}

/// Frees a checkpoint from [`gpualloc_checkpoint_pool`]. NULL is a no-op.
///
/// # Safety
/// `checkpoint` is NULL or a handle from [`gpualloc_checkpoint_pool`] not
/// freed before.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_pool_checkpoint_free(checkpoint: *mut c_void) {
    if checkpoint.is_null() {
        return;
    }
    // SAFETY: the handle came from Box::into_raw in gpualloc_checkpoint_pool
    // and is freed once (the caller's contract).
    drop(unsafe { Box::from_raw(checkpoint.cast::<PoolCheckpoint>()) });
}

/// A library-owned array of `u64`, handed to C as pointer and length.
fn into_c_array(values: Vec<u64>, out: *mut *mut u64, len: *mut usize) {
    let boxed = values.into_boxed_slice();
    let n = boxed.len();
    // SAFETY: both out-pointers were checked non-NULL by the caller of this
    // function and point to writable storage (the C caller's contract).
    unsafe {
        *len = n;
        *out = Box::into_raw(boxed).cast::<u64>();
    }
}

/// Puts the pool of `checkpoint` back into its layout. On success writes the
/// addresses of the blocks it freed and of those it allocated again (the
/// caller owns those) as arrays freed with [`gpualloc_u64_array_free`].
///
/// # Safety
/// `checkpoint` is a live handle from [`gpualloc_checkpoint_pool`]; the four
/// out-pointers are valid for writes.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_restore_pool(
    device: c_int,
    checkpoint: *mut c_void,
    freed: *mut *mut u64,
    n_freed: *mut usize,
    allocated: *mut *mut u64,
    n_allocated: *mut usize,
) -> c_int {
    call_int(|| {
        crate::required(&[
            (checkpoint.is_null(), "checkpoint"),
            (freed.is_null(), "freed"),
            (n_freed.is_null(), "n_freed"),
            (allocated.is_null(), "allocated"),
            (n_allocated.is_null(), "n_allocated"),
        ])?;
        // SAFETY: a live checkpoint handle (the caller's contract).
        let cp = unsafe { &*checkpoint.cast::<PoolCheckpoint>() };
        let _ctx = CtxGuard::save_if_driver_loaded();
        let out = state::allocator(device)?.pools().restore(cp)?;
        into_c_array(out.freed, freed, n_freed);
        into_c_array(
            out.allocated.iter().map(|a| a.addr).collect(),
            allocated,
            n_allocated,
        );
        Ok(())
    })
}

/// Frees an array from [`gpualloc_restore_pool`]. NULL is a no-op.
///
/// # Safety
/// `values` and `len` are a pair written by [`gpualloc_restore_pool`], not
/// freed before.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_u64_array_free(values: *mut u64, len: usize) {
    if values.is_null() {
        return;
    }
    // SAFETY: the pair came from Box::into_raw of a boxed slice of `len`
    // elements in into_c_array (the caller's contract).
    drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(values, len)) });
}

/// Whether the blocks allocated in the pool are exactly the `n` addresses
/// of `expected`: 1 yes, 0 no, negative on error.
///
/// # Safety
/// `expected` points to `n` readable values (or is NULL with `n == 0`).
#[no_mangle]
pub unsafe extern "C" fn gpualloc_pool_live_allocations_are(
    device: c_int,
    pool_first: u64,
    pool_second: u64,
    expected: *const u64,
    n: usize,
) -> c_int {
    let mut answer = false;
    let code = call_int(|| {
        let pool = named_pool(pool_first, pool_second)?;
        let set: HashSet<u64> = if n == 0 {
            HashSet::new()
        } else if expected.is_null() {
            return Err(FfiError::invalid("expected is NULL"));
        } else {
            // SAFETY: `n` readable values (the caller's contract).
            unsafe { std::slice::from_raw_parts(expected, n) }
                .iter()
                .copied()
                .collect()
        };
        answer = check_live(device, pool, &set)?;
        Ok(())
    });
    if code == crate::api::GPUALLOC_OK {
        c_int::from(answer)
    } else {
        code
    }
}

fn check_live(device: c_int, pool: alloc_core::PoolId, set: &HashSet<u64>) -> FfiResult<bool> {
    Ok(match state::existing(device)? {
        Some(alloc) => alloc.pools().live_allocations_are(pool, set)?,
        None => set.is_empty(),
    })
}
