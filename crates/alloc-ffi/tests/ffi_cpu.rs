//! The C entry points without a GPU: bad input gives an error code and a
//! message, never a crash. (These tests run on machines with a GPU too; the
//! ones that would allocate check for the driver first.)
//!
//! `gpualloc_configure` seals on first use, so the configuration tests live in
//! their own test binaries (`configure.rs`, `env_config.rs`).

use std::ffi::{c_int, c_void, CStr, CString};
use std::ptr::null_mut;

use alloc_ffi::api::*;
use alloc_ffi::*;

fn last_error() -> Option<String> {
    let p = gpualloc_last_error();
    // SAFETY: NULL or a NUL-terminated string valid until the next call.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

fn err_contains(what: &[&str]) {
    let e = last_error().expect("an error message");
    for w in what {
        assert!(e.contains(w), "`{e}` lacks `{w}`");
    }
}

#[test]
fn free_of_null_is_a_no_op() {
    // A successful int call clears the thread's last error; freeing NULL,
    // even with a bad device index, must leave it clear.
    // SAFETY: a valid C string.
    assert_eq!(unsafe { gpualloc_check_config(c"".as_ptr()) }, GPUALLOC_OK);
    assert_eq!(last_error(), None);
    gpualloc_free(null_mut(), 0, 0, null_mut());
    gpualloc_free(null_mut(), 100, -5, null_mut());
    assert_eq!(last_error(), None, "freeing NULL reported an error");
}

#[test]
fn free_of_a_garbage_pointer_is_an_error_not_a_crash() {
    gpualloc_free(0xdead_beef_usize as *mut c_void, 64, 0, null_mut());
    err_contains(&["0xdeadbeef", "not allocated by gpualloc"]);
    gpualloc_free(8 as *mut c_void, 64, 3, null_mut());
    err_contains(&["0x8", "device 3"]);
    gpualloc_free(0x1000 as *mut c_void, 64, 1000, null_mut());
    err_contains(&["invalid device index 1000"]);
    gpualloc_free(0x1000 as *mut c_void, 64, -1, null_mut());
    err_contains(&["invalid device index -1"]);
}

#[test]
fn zero_and_negative_sizes() {
    gpualloc_free(0x10 as *mut c_void, 1, 0, null_mut()); // leave an error behind
    assert!(last_error().is_some());
    assert!(gpualloc_malloc(0, 0, null_mut()).is_null());
    assert_eq!(last_error(), None, "size 0 is not an error");
    assert!(gpualloc_malloc(-1, 0, null_mut()).is_null());
    err_contains(&["invalid allocation size -1", "negative"]);
    assert!(gpualloc_malloc(isize::MIN, 0, null_mut()).is_null());
    err_contains(&["negative"]);
}

#[test]
fn bad_device_index() {
    assert!(gpualloc_malloc(1024, -1, null_mut()).is_null());
    err_contains(&["invalid device index -1"]);
    assert!(gpualloc_malloc(1024, 64, null_mut()).is_null());
    err_contains(&["invalid device index 64"]);
    assert_eq!(gpualloc_empty_cache(99), GPUALLOC_ERR_INVALID);
    assert_eq!(gpualloc_reset_peak_stats(-2), GPUALLOC_ERR_INVALID);
    assert!(gpualloc_memory_stats_json(-3).is_null());
    err_contains(&["invalid device index -3"]);
}

#[test]
fn malloc_without_a_driver_names_the_missing_library() {
    if alloc_cuda::driver_available() {
        eprintln!("SKIP: a CUDA driver is present here");
        return;
    }
    for _ in 0..2 {
        assert!(gpualloc_malloc(4096, 0, null_mut()).is_null());
        err_contains(&["libcuda"]);
    }
    // The failed creation left nothing behind: stats are zero, snapshots empty.
    let snap = build_snapshot(0).unwrap();
    assert!(snap.segments.is_empty());
}

#[test]
fn last_error_is_per_thread() {
    gpualloc_free(0x20 as *mut c_void, 1, 0, null_mut());
    assert!(last_error().is_some());
    std::thread::spawn(|| assert_eq!(last_error(), None))
        .join()
        .unwrap();
    // An int call that succeeds clears it.
    assert_eq!(gpualloc_reset_peak_stats(0), GPUALLOC_OK);
    assert_eq!(last_error(), None);
}

#[test]
fn stats_of_an_unused_device_are_zero_with_pytorch_names() {
    let p = gpualloc_memory_stats_json(5);
    assert!(!p.is_null());
    // SAFETY: a string from the library.
    let json = unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_string();
    // SAFETY: freed once.
    unsafe { gpualloc_string_free(p) };
    let map: std::collections::BTreeMap<String, i64> = serde_json::from_str(&json).unwrap();
    for key in [
        "allocated_bytes.all.current",
        "allocated_bytes.all.peak",
        "reserved_bytes.all.peak",
        "reserved_bytes.large_pool.current",
        "active_bytes.small_pool.freed",
        "requested_bytes.all.allocated",
        "inactive_split_bytes.all.current",
        "segment.all.peak",
        "num_alloc_retries",
        "num_ooms",
        "num_device_alloc",
        "num_device_free",
        "num_sync_all_streams",
        "oversize_allocations.peak",
        "page_moves.pages_unmapped",
        "page_moves.host_ns",
    ] {
        assert_eq!(map.get(key), Some(&0), "{key}");
    }
    assert_eq!(map["max_split_size"], -1);
    // SAFETY: NULL is accepted.
    unsafe { gpualloc_string_free(null_mut()) };
}

#[test]
fn check_config_accepts_and_rejects() {
    let ok = |s: &str| {
        let c = CString::new(s).unwrap();
        // SAFETY: a valid C string.
        unsafe { gpualloc_check_config(c.as_ptr()) }
    };
    assert_eq!(ok(""), GPUALLOC_OK);
    assert_eq!(
        ok("policy:size-class,max_split_size_mb:128,garbage_collection_threshold:0.6"),
        GPUALLOC_OK
    );
    assert_eq!(
        ok("roundup_power2_divisions:[256:1,512:2,>:4]"),
        GPUALLOC_OK
    );
    assert_eq!(ok("expandable_segments:True"), GPUALLOC_OK);
    assert_eq!(ok("max_split_size_mb:10"), GPUALLOC_ERR_INVALID);
    err_contains(&["max_split_size_mb", "at least 20"]);
    assert_eq!(ok("policy:nope"), GPUALLOC_ERR_INVALID);
    err_contains(&["nope", "compiled-in policies"]);
    assert_eq!(
        ok("policy:buddy,expandable_segments:True"),
        GPUALLOC_ERR_INVALID
    );
    err_contains(&["expandable_segments"]);
    assert_eq!(ok("bogus:1"), GPUALLOC_ERR_INVALID);
    err_contains(&["unknown allocator option `bogus`"]);
    // SAFETY: NULL is rejected, not dereferenced.
    assert_eq!(
        unsafe { gpualloc_check_config(std::ptr::null()) },
        GPUALLOC_ERR_INVALID
    );
    err_contains(&["config is NULL"]);
    let bad_utf8 = [0xffu8, 0xfe, 0];
    // SAFETY: NUL-terminated.
    assert_eq!(
        unsafe { gpualloc_check_config(bad_utf8.as_ptr().cast()) },
        GPUALLOC_ERR_INVALID
    );
    err_contains(&["UTF-8"]);
}

#[test]
fn cache_and_stats_calls_on_unused_devices_succeed() {
    assert_eq!(gpualloc_empty_cache(7), GPUALLOC_OK);
    assert_eq!(gpualloc_empty_cache(-1), GPUALLOC_OK);
    assert_eq!(gpualloc_reset_peak_stats(-1), GPUALLOC_OK);
    assert_eq!(gpualloc_reset_accumulated_stats(7), GPUALLOC_OK);
}

#[test]
fn bad_memory_fraction_and_record_stream() {
    assert_eq!(gpualloc_set_memory_fraction(1.5, 0), GPUALLOC_ERR_INVALID);
    err_contains(&["memory fraction 1.5", "[0, 1]"]);
    assert_eq!(gpualloc_set_memory_fraction(-0.5, 0), GPUALLOC_ERR_INVALID);
    assert_eq!(
        gpualloc_set_memory_fraction(f64::NAN, 0),
        GPUALLOC_ERR_INVALID
    );
    assert_eq!(gpualloc_set_memory_fraction(0.5, -7), GPUALLOC_ERR_INVALID);
    assert_eq!(
        gpualloc_record_stream(0x1234 as *mut c_void, 6, 0x99 as *mut c_void),
        GPUALLOC_ERR_INVALID
    );
    err_contains(&["record_stream", "0x1234"]);
}

#[test]
fn snapshot_of_nothing_is_a_loadable_pickle() {
    let dir = std::env::temp_dir().join(format!("gpualloc_ffi_cpu_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("empty.pickle");
    let c = CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(
        unsafe { gpualloc_write_snapshot(c.as_ptr(), 9) },
        GPUALLOC_OK
    );
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(bytes[0], 0x80, "pickle protocol marker");
    let snap = build_snapshot(9).unwrap();
    assert!(snap.segments.is_empty());
    assert_eq!(
        snap.device_traces.len(),
        10,
        "one trace list per device up to 9"
    );
    assert!(snap.allocator_settings.contains_key("max_split_size"));
    // SAFETY: NULL and bad paths are errors.
    assert_eq!(
        unsafe { gpualloc_write_snapshot(std::ptr::null(), 0) },
        GPUALLOC_ERR_INVALID
    );
    let bad = CString::new("/nonexistent-dir/x/snap.pickle").unwrap();
    // SAFETY: a valid C string.
    assert_eq!(
        unsafe { gpualloc_write_snapshot(bad.as_ptr(), 0) },
        GPUALLOC_ERR_INVALID
    );
    err_contains(&["cannot write snapshot", "/nonexistent-dir/x/snap.pickle"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn history_switch_and_version() {
    assert_eq!(gpualloc_record_history(1, 10), GPUALLOC_OK);
    assert_eq!(gpualloc_record_history(0, 0), GPUALLOC_OK);
    // SAFETY: a static string.
    let v = unsafe { CStr::from_ptr(gpualloc_version()) }
        .to_str()
        .unwrap();
    assert_eq!(v, env!("CARGO_PKG_VERSION"));
}

#[test]
fn a_pool_allocator_needs_a_pool_and_both_functions() {
    extern "C" fn alloc(_: usize, _: c_int, _: *mut c_void) -> *mut c_void {
        null_mut()
    }
    // SAFETY: refused before any function is stored or called.
    let code = unsafe { gpualloc_set_pool_allocator(0, 0, 7, Some(alloc), None, null_mut()) };
    assert_eq!(code, GPUALLOC_ERR_INVALID);
    err_contains(&["NULL allocate or free function"]);
    // SAFETY: as above.
    let code = unsafe { gpualloc_set_pool_allocator(0, 0, 0, Some(alloc), None, null_mut()) };
    assert_eq!(code, GPUALLOC_ERR_INVALID);
    err_contains(&["(0, 0)"]);
}

#[test]
fn host_register_refuses_bad_ranges_and_flags_without_a_driver_call() {
    let mut buf = vec![0u8; 4096];
    let ptr = buf.as_mut_ptr().cast::<c_void>();
    // SAFETY: each is refused before the driver is asked.
    unsafe {
        assert_eq!(
            gpualloc_host_register(null_mut(), 4096, 0),
            GPUALLOC_ERR_INVALID
        );
        err_contains(&["gpualloc_host_register", "at least one byte"]);
        assert_eq!(gpualloc_host_register(ptr, 0, 0), GPUALLOC_ERR_INVALID);
        assert_eq!(gpualloc_host_register(ptr, 4096, 6), GPUALLOC_ERR_INVALID);
        err_contains(&["unknown flags 0x6", "GPUALLOC_HOST_REGISTER_MAPPED = 1"]);
        // Nothing was ever registered in this process (there is no driver).
        assert_eq!(gpualloc_host_unregister(ptr), GPUALLOC_ERR_INVALID);
    }
    err_contains(&["is not the start of a range registered"]);
}
