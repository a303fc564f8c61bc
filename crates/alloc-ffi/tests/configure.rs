//! `gpualloc_configure`: validated, replaceable before the first use, refused
//! after it. One test (the process-wide configuration seals once).

use std::ffi::{CStr, CString};
use std::ptr::null_mut;

use alloc_ffi::api::*;
use alloc_ffi::*;

mod common;
use common::last_error;

fn configure(s: &str) -> i32 {
    let c = CString::new(s).unwrap();
    // SAFETY: a valid C string.
    unsafe { gpualloc_configure(c.as_ptr()) }
}

#[test]
fn configure_before_first_use_only() {
    // SAFETY: NULL is rejected.
    assert_eq!(
        unsafe { gpualloc_configure(std::ptr::null()) },
        GPUALLOC_ERR_INVALID
    );
    assert_eq!(configure("bogus:1"), -1);
    assert!(last_error().contains("bogus"));
    assert_eq!(configure("policy:buddy,expandable_segments:True"), -1);
    assert!(last_error().contains("does not support growable segments"));
    // Accepted, and may be replaced until the first use.
    assert_eq!(configure("policy:size-class"), GPUALLOC_OK);
    assert_eq!(
        configure("policy:pytorch-bfc,max_split_size_mb:64"),
        GPUALLOC_OK
    );

    // First use: creates (or fails to create, without a GPU) the allocator.
    let p = gpualloc_malloc(1 << 20, 0, null_mut());
    if p.is_null() {
        eprintln!("no GPU here: {}", last_error());
    } else {
        let s = gpualloc_memory_stats_json(0);
        // SAFETY: a string from the library, freed once.
        let json = unsafe { CStr::from_ptr(s) }.to_str().unwrap().to_string();
        unsafe { gpualloc_string_free(s) };
        assert!(
            json.contains(&format!("\"max_split_size\":{}", 64 << 20)),
            "{json}"
        );
        gpualloc_free(p, 1 << 20, 0, null_mut());
    }

    assert_eq!(configure("policy:size-class"), GPUALLOC_ERR_TOO_LATE);
    let e = last_error();
    assert!(e.contains("before the first use"), "{e}");
}
