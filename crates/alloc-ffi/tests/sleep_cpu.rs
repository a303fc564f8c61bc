//! Sleep tags and the pinned host pool across the C ABI, without a GPU:
//! bad arguments are error codes with messages, never a crash or a driver
//! call.

use std::ffi::{c_void, CStr};
use std::ptr::null_mut;

use alloc_ffi::api::*;
use alloc_ffi::*;

mod common;
use common::last_error;

#[test]
fn bad_arguments_are_errors_before_any_driver_call() {
    // SAFETY: valid C strings (or NULL where the header allows it).
    unsafe {
        assert_eq!(
            gpualloc_pause(0, c"kv".as_ptr(), c"disk".as_ptr()),
            GPUALLOC_ERR_INVALID
        );
        assert!(
            last_error().contains("expected \"none\" or \"host\""),
            "{}",
            last_error()
        );
        let (mut a, mut b) = (0u64, 0u64);
        assert_eq!(
            gpualloc_tag_pool(0, std::ptr::null(), &mut a, &mut b),
            GPUALLOC_ERR_INVALID
        );
        assert!(last_error().contains("tag is NULL"), "{}", last_error());
        assert_eq!(
            gpualloc_tag_pool(0, c"kv".as_ptr(), null_mut(), &mut b),
            GPUALLOC_ERR_INVALID
        );
        assert!(
            last_error().contains("pool_first is NULL"),
            "{}",
            last_error()
        );
        assert_eq!(
            gpualloc_bind_tag(0, c"kv".as_ptr(), 0, 0),
            GPUALLOC_ERR_INVALID
        );
        assert!(last_error().contains("names no pool"), "{}", last_error());
        // No allocator on device 3: a named tag there is unknown.
        assert_eq!(gpualloc_resume(3, c"kv".as_ptr()), GPUALLOC_ERR_INVALID);
        assert!(
            last_error().contains("sleep tag \"kv\" is unknown"),
            "{}",
            last_error()
        );
        assert_eq!(
            gpualloc_pause(70, std::ptr::null(), std::ptr::null()),
            GPUALLOC_ERR_INVALID
        );
        assert!(
            last_error().contains("invalid device index 70"),
            "{}",
            last_error()
        );
        // A named tag on every device in use: found nowhere, unknown.
        assert_eq!(
            gpualloc_pause(-1, c"kv".as_ptr(), std::ptr::null()),
            GPUALLOC_ERR_INVALID
        );
        assert!(
            last_error().contains("sleep tag \"kv\" is unknown"),
            "{}",
            last_error()
        );
        // Every tag of every device in use: none, nothing to do.
        assert_eq!(
            gpualloc_pause(-1, std::ptr::null(), c"host".as_ptr()),
            GPUALLOC_OK
        );
        assert_eq!(gpualloc_resume(-1, std::ptr::null()), GPUALLOC_OK);
    }
    let json = gpualloc_tags_json(-1);
    assert!(!json.is_null());
    // SAFETY: a string of the library, freed once.
    let text = unsafe { CStr::from_ptr(json) }
        .to_string_lossy()
        .into_owned();
    unsafe { gpualloc_string_free(json) };
    assert_eq!(text, "[]");
}

#[test]
fn pinned_host_frees_of_unknown_pointers_are_errors() {
    assert_eq!(gpualloc_host_free(null_mut()), GPUALLOC_OK);
    let bogus = 0x1234usize as *mut c_void;
    assert_eq!(gpualloc_host_free(bogus), GPUALLOC_ERR_INVALID);
    assert!(last_error().contains("not memory from gpualloc_host_alloc"));
    assert_eq!(
        gpualloc_host_record_stream(bogus, null_mut()),
        GPUALLOC_ERR_INVALID
    );
    assert!(gpualloc_host_alloc(0).is_null());
    assert!(last_error().contains("0 bytes"));
}
