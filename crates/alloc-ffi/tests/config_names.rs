//! `gpualloc_check_config` and `gpualloc_configure` take settings by name,
//! suggest the name or option meant, refuse bytes that are not text, and
//! quote only an excerpt of a long string. No GPU needed.

use std::ffi::{c_char, CString};

use alloc_ffi::api::*;
use alloc_ffi::*;

mod common;
use common::last_error;

fn check_bytes(bytes: &[u8]) -> i32 {
    let c = CString::new(bytes).unwrap();
    // SAFETY: a NUL-terminated string that outlives the call.
    unsafe { gpualloc_check_config(c.as_ptr()) }
}

fn check(text: &str) -> i32 {
    check_bytes(text.as_bytes())
}

#[test]
fn names_are_configurations() {
    for ok in [
        "bound",
        "unmap16",
        "unmap8",
        "expandable",
        "default",
        "size-class",
        "stream-wait",
        "multi-stream",
        "bound,max_split_size_mb:64",
        "unmap8, garbage_collection_threshold:0.7",
        "policy:buddy",
    ] {
        assert_eq!(check(ok), GPUALLOC_OK, "{ok}: {}", last_error());
    }
    assert_eq!(check("bund"), GPUALLOC_ERR_INVALID);
    let e = last_error();
    assert!(e.contains("did you mean `bound`?"), "{e}");
    assert_eq!(check("max_split_size:64"), GPUALLOC_ERR_INVALID);
    assert!(last_error().contains("did you mean `max_split_size_mb`?"));
    assert_eq!(
        check("pinned_num_register_threads:banana"),
        GPUALLOC_ERR_INVALID
    );
    assert_eq!(check("pinned_reserve_segment_size_mb:64"), GPUALLOC_OK);
}

#[test]
fn bytes_that_are_not_text_are_refused() {
    assert_eq!(
        check_bytes(b"max_split_size_mb:\xff64"),
        GPUALLOC_ERR_INVALID
    );
    let e = last_error();
    assert!(e.contains("not valid UTF-8"), "{e}");
    assert_eq!(check_bytes(b"policy:buddy\x1b"), GPUALLOC_ERR_INVALID);
    assert!(last_error().contains("control character"));
}

#[test]
fn a_long_bad_string_is_quoted_in_part() {
    let long = format!("max_split_size_mb:{}", "9x".repeat(500_000));
    assert_eq!(check(&long), GPUALLOC_ERR_INVALID);
    let e = last_error();
    assert!(e.len() < 1200 && e.contains("max_split_size_mb"), "{e}");
    let c = CString::new(long).unwrap();
    // SAFETY: a NUL-terminated string that outlives the call.
    assert_eq!(
        unsafe { gpualloc_configure(c.as_ptr() as *const c_char) },
        GPUALLOC_ERR_INVALID
    );
    assert!(last_error().len() < 1200);
}
