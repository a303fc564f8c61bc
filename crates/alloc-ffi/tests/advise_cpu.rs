//! `gpualloc_advise` on the bundled snapshot, and on bytes that are not one:
//! a corrupt or foreign file is GPUALLOC_ERR_INVALID with a message, never a
//! panic (which the boundary would report as GPUALLOC_ERR_INTERNAL).

use std::ffi::{c_int, CStr};
use std::ptr;

use alloc_ffi::api::GPUALLOC_ERR_INVALID;
use alloc_ffi::{gpualloc_advise, gpualloc_last_error_code, gpualloc_string_free};

mod common;

const SNAPSHOT: &[u8] = include_bytes!("../../../traces/small_mlp_stacks.snapshot.pickle");

/// The JSON advice, or the error code and message.
fn advise(bytes: &[u8], device: c_int) -> Result<serde_json::Value, (c_int, String)> {
    // SAFETY: `bytes` is readable for its length; the name is a C literal.
    let p = unsafe { gpualloc_advise(bytes.as_ptr().cast(), bytes.len(), device, c"mlp".as_ptr()) };
    if p.is_null() {
        return Err((gpualloc_last_error_code(), common::last_error()));
    }
    // SAFETY: a NUL-terminated string of the library, freed once below.
    let text = unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_owned();
    // SAFETY: returned by gpualloc_advise, not freed before.
    unsafe { gpualloc_string_free(p) };
    Ok(serde_json::from_str(&text).unwrap())
}

#[test]
fn the_snapshot_gets_a_recommendation_with_its_call_and_cost() {
    let advice = advise(SNAPSHOT, -1).unwrap();
    assert_eq!(advice["trace"], "mlp");
    assert_eq!(advice["recommended_setting"], "unmap16");
    assert_eq!(advice["enable_call"], "gpu_alloc.enable(\"unmap16\")");
    assert_eq!(
        advice["gpualloc_conf"],
        "expandable_segments:True,unmap_free_pages:True"
    );
    assert_eq!(advice["steps"]["steps"], 3);
    let outcomes = advice["outcomes"].as_array().unwrap();
    assert_eq!(outcomes[0]["report"]["peak_reserved_bytes"], 113_246_208);
    let text = advice["text"].as_str().unwrap();
    assert!(text.contains("recommended: unmap_free_pages"), "{text}");
    assert!(advice["cost"].as_str().unwrap().contains("no page moves"));
    // Device 0 is the one with events.
    assert_eq!(
        advise(SNAPSHOT, 0).unwrap()["recommended_setting"],
        "unmap16"
    );
}

#[test]
fn bad_input_is_an_invalid_argument_with_a_message() {
    let expect_invalid = |bytes: &[u8], device: c_int, what: &str| match advise(bytes, device) {
        Err((code, message)) => {
            assert_eq!(code, GPUALLOC_ERR_INVALID, "{what}: {message}");
            assert!(
                message.starts_with("mlp: ") || message.contains("device"),
                "{message}"
            );
        }
        Ok(v) => panic!("{what}: advice {}", v["recommended_setting"]),
    };
    for len in (1..SNAPSHOT.len()).step_by(97) {
        expect_invalid(&SNAPSHOT[..len], -1, &format!("cut at {len}"));
    }
    expect_invalid(b"", -1, "empty");
    expect_invalid(&[0x80, 0x04, 0xff, 0x00, 0x13], -1, "garbage pickle");
    expect_invalid(b"\x80\x02]q\x00(K\x01K\x02K\x03e.", -1, "a pickled list");
    expect_invalid(SNAPSHOT, 3, "a device without a trace");
    expect_invalid(SNAPSHOT, -2, "a negative device");
    let (code, message) = advise(SNAPSHOT, 3).unwrap_err();
    assert_eq!(code, GPUALLOC_ERR_INVALID);
    assert!(message.contains("no trace for device 3"), "{message}");
    // SAFETY: a NULL pointer is checked before use.
    let p = unsafe { gpualloc_advise(ptr::null(), 10, -1, ptr::null()) };
    assert!(p.is_null());
    assert!(common::last_error().contains("data is NULL"));
}
