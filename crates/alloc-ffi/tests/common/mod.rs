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
