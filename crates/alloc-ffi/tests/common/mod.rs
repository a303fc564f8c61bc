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

/// Two threads at once, each allocating four blocks on device 0 (a size
/// and a stream, given as an integer, each): all eight are live together.
/// Returns each thread's addresses.
pub fn four_blocks_on_two_threads(
    first: (isize, usize),
    second: (isize, usize),
) -> (Vec<usize>, Vec<usize>) {
    let barrier = std::sync::Barrier::new(2);
    std::thread::scope(|s| {
        let run = |(size, stream): (isize, usize)| {
            let barrier = &barrier;
            s.spawn(move || {
                let blocks: Vec<usize> = (0..4)
                    .map(|_| {
                        let p = alloc_ffi::gpualloc_malloc(size, 0, stream as _);
                        assert!(!p.is_null(), "{}", last_error());
                        p as usize
                    })
                    .collect();
                barrier.wait(); // both threads' blocks live at once
                blocks
            })
        };
        let a = run(first);
        let b = run(second);
        (a.join().unwrap(), b.join().unwrap())
    })
}

/// Frees the blocks of `a` on one thread and those of `b` on another, at
/// once.
pub fn free_on_two_threads(a: &[usize], b: &[usize]) {
    let free = |blocks: &[usize]| {
        for &p in blocks {
            alloc_ffi::gpualloc_free(p as _, 0, 0, std::ptr::null_mut());
        }
    };
    std::thread::scope(|s| {
        s.spawn(|| free(a));
        s.spawn(|| free(b));
    });
}
