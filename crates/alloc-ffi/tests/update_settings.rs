//! `gpualloc_update_settings`: settings changed at run time are checked
//! against the configuration in effect, and they seal it. One test (the
//! process-wide configuration seals once).

use std::ffi::CString;

use alloc_ffi::api::*;
use alloc_ffi::*;

mod common;
use common::last_error;

fn update(s: &str) -> i32 {
    let c = CString::new(s).unwrap();
    // SAFETY: a valid C string.
    unsafe { gpualloc_update_settings(c.as_ptr()) }
}

fn configure(s: &str) -> i32 {
    let c = CString::new(s).unwrap();
    // SAFETY: a valid C string.
    unsafe { gpualloc_configure(c.as_ptr()) }
}

#[test]
fn settings_change_the_configuration_in_effect() {
    // SAFETY: NULL is rejected.
    assert_eq!(
        unsafe { gpualloc_update_settings(std::ptr::null()) },
        GPUALLOC_ERR_INVALID
    );
    assert!(last_error().contains("settings"), "{}", last_error());
    assert_eq!(
        configure("expandable_segments:true,unmap_free_pages:true"),
        GPUALLOC_OK
    );

    assert_eq!(update("max_split_size_mb:"), GPUALLOC_ERR_INVALID);
    assert_eq!(
        update("per_process_memory_fraction:2"),
        GPUALLOC_ERR_INVALID
    );
    assert!(last_error().contains("0.0 to 1.0"), "{}", last_error());
    // Checked against the configuration in effect, not the defaults.
    assert_eq!(update("expandable_segments:false"), GPUALLOC_ERR_INVALID);
    assert!(
        last_error().contains("unmap_free_pages"),
        "{}",
        last_error()
    );

    assert_eq!(
        update("roundup_power2_divisions:4,per_process_memory_fraction:0.5"),
        GPUALLOC_OK,
        "{}",
        last_error()
    );
    let text = snapshot_settings();
    assert!(
        text.contains("unmap_free_pages:true") && text.contains("roundup_power2_divisions:4"),
        "{text}"
    );
    // A change seals the configuration.
    assert_eq!(configure("policy:buddy"), GPUALLOC_ERR_TOO_LATE);
}

/// The configuration text a snapshot reports.
fn snapshot_settings() -> String {
    let p = gpualloc_settings_text();
    assert!(!p.is_null(), "{}", last_error());
    // SAFETY: a string from the library, freed once.
    let text = unsafe { std::ffi::CStr::from_ptr(p) }
        .to_str()
        .unwrap()
        .to_string();
    unsafe { gpualloc_string_free(p) };
    text
}
