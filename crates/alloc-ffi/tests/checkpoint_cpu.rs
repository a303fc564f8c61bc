//! The private-pool checkpoint entry points reject bad arguments with a
//! clear error and never touch the device for them (no GPU needed).

use alloc_ffi::api::GPUALLOC_ERR_INVALID;
use alloc_ffi::{
    gpualloc_pool_checkpoint_free, gpualloc_pool_live_allocations_are, gpualloc_restore_pool,
    gpualloc_u64_array_free,
};

mod common;
use common::last_error;

#[test]
fn null_arguments_are_invalid_and_frees_of_null_are_no_ops() {
    let (mut freed, mut n_freed) = (std::ptr::null_mut(), 0usize);
    let (mut made, mut n_made) = (std::ptr::null_mut(), 0usize);
    // SAFETY: the out-pointers are valid; the checkpoint is NULL on purpose.
    let code = unsafe {
        gpualloc_restore_pool(
            0,
            std::ptr::null_mut(),
            &mut freed,
            &mut n_freed,
            &mut made,
            &mut n_made,
        )
    };
    assert_eq!(code, GPUALLOC_ERR_INVALID);
    assert!(last_error().contains("NULL"), "{}", last_error());
    assert!(
        freed.is_null() && made.is_null(),
        "nothing written on error"
    );
    // SAFETY: NULL handles are documented no-ops.
    unsafe {
        gpualloc_pool_checkpoint_free(std::ptr::null_mut());
        gpualloc_u64_array_free(std::ptr::null_mut(), 0);
    }
}

#[test]
fn pool_zero_is_refused_and_expected_must_not_be_null() {
    // SAFETY: no addresses are read for n == 0.
    let code = unsafe { gpualloc_pool_live_allocations_are(0, 0, 0, std::ptr::null(), 0) };
    assert_eq!(code, GPUALLOC_ERR_INVALID);
    assert!(last_error().contains("(0, 0)"), "{}", last_error());
    // SAFETY: a NULL `expected` with n > 0 must be refused, not read.
    let code = unsafe { gpualloc_pool_live_allocations_are(0, 1, 2, std::ptr::null(), 3) };
    assert_eq!(code, GPUALLOC_ERR_INVALID);
    assert!(
        last_error().contains("expected is NULL"),
        "{}",
        last_error()
    );
}
