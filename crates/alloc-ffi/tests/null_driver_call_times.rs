//! `GPUALLOC_TIME_CALLS=1`: the library's own malloc and free calls counted
//! and timed per device, in the statistics as `host_calls.*` and cleared
//! with the other cumulative counters, through the C entry points over the
//! null driver (`crates/alloc-cuda/null-driver`).
//!
//! `#[ignore]`d: it needs the null driver on the library path, as
//! `bash crates/alloc-cuda/null-driver/run.sh --tests` (CI) sets it. Its own
//! test binary: the variable is read once per process, at the first call.

mod common;

use std::ptr::null_mut;

use alloc_ffi::api::GPUALLOC_OK;
use alloc_ffi::*;

#[test]
#[ignore = "needs the null driver: bash crates/alloc-cuda/null-driver/run.sh --tests"]
fn malloc_and_free_calls_are_counted_timed_and_cleared() {
    if !common::driver_loaded() {
        return;
    }
    std::env::set_var("GPUALLOC_TIME_CALLS", "1");
    // The variable is read as the device's allocator is made (this first
    // call): from then on every call counts.
    let first = gpualloc_malloc(1 << 20, 0, null_mut());
    assert!(!first.is_null(), "{}", common::last_error());
    gpualloc_free(first, 0, 0, null_mut());
    assert_eq!(common::stats(0)["host_calls.free"], 1);
    assert_eq!(gpualloc_reset_accumulated_stats(0), GPUALLOC_OK);
    let blocks: Vec<_> = (1..=3)
        .map(|mib| gpualloc_malloc(mib << 20, 0, null_mut()))
        .collect();
    assert!(
        blocks.iter().all(|p| !p.is_null()),
        "{}",
        common::last_error()
    );
    let pooled = gpualloc_malloc_in_pool(1 << 20, 0, null_mut(), 0, 0);
    assert!(!pooled.is_null());
    for p in blocks.iter().chain([&pooled]) {
        gpualloc_free(*p, 0, 0, null_mut());
    }
    let s = common::stats(0);
    assert_eq!(s["host_calls.malloc"], 4, "{s:?}");
    assert_eq!(s["host_calls.free"], 4);
    assert!(s["host_calls.malloc_ns"] > 0 && s["host_calls.free_ns"] > 0);
    assert!(s["host_calls.malloc_ns"] >= s["host_calls.malloc_max_ns"]);
    assert!(s["host_calls.malloc_slow"] <= 4);
    assert_eq!(gpualloc_reset_accumulated_stats(0), GPUALLOC_OK);
    let s = common::stats(0);
    assert_eq!((s["host_calls.malloc"], s["host_calls.free_ns"]), (0, 0));
}
