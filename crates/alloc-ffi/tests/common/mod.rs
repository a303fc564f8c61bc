//! Helpers shared by the C ABI's integration tests.

use std::ffi::CStr;

/// The thread's last error message; fails the test when there is none.
pub fn last_error() -> String {
    let p = alloc_ffi::gpualloc_last_error();
    assert!(!p.is_null(), "expected an error message");
    // SAFETY: a NUL-terminated string of the library, valid until its next call.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}
