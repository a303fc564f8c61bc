//! Helpers shared by the C ABI's integration tests.
#![allow(dead_code)] // each test file uses its own subset

use std::ffi::CStr;

/// The thread's last error message; fails the test when there is none.
pub fn last_error() -> String {
    let p = alloc_ffi::gpualloc_last_error();
    assert!(!p.is_null(), "expected an error message");
    // SAFETY: a NUL-terminated string of the library, valid until its next call.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// A tool a test needs is missing: with `GPUALLOC_TESTS_REQUIRE_TOOLS` set
/// (as CI sets it) the test fails, so that it can never pass by skipping;
/// otherwise it says SKIP and returns.
pub fn missing_tool(why: &str) {
    if std::env::var_os("GPUALLOC_TESTS_REQUIRE_TOOLS").is_some() {
        panic!("{why}, and GPUALLOC_TESTS_REQUIRE_TOOLS is set");
    }
    eprintln!("SKIP: {why}");
}

/// Whether a CUDA driver (the null driver, for the `null_driver_*` tests)
/// is loaded; when it is not, says so as [`missing_tool`] does. It must be
/// there when `GPUALLOC_NULL_DRIVER` is set.
pub fn driver_loaded() -> bool {
    if alloc_cuda::driver_available() {
        return true;
    }
    assert!(
        std::env::var_os("GPUALLOC_NULL_DRIVER").is_none(),
        "no driver loaded"
    );
    missing_tool("no CUDA driver (the null driver) on the library path");
    false
}

/// The statistics of `device` as the C library reports them
/// (`gpualloc_memory_stats_json`).
pub fn stats(device: i32) -> std::collections::BTreeMap<String, i64> {
    let p = alloc_ffi::gpualloc_memory_stats_json(device);
    assert!(!p.is_null(), "{}", last_error());
    // SAFETY: a NUL-terminated string of the library, freed right after.
    let json = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    // SAFETY: returned by the library, freed once.
    unsafe { alloc_ffi::gpualloc_string_free(p) };
    serde_json::from_str(&json).unwrap()
}
