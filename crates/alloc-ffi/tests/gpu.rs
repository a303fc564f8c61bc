//! The C entry points on a real GPU (device 0). Ignored by plain
//! `cargo test`; run with `cargo test -p alloc-ffi --test gpu -- --ignored`
//! on a machine with a GPU (or build with `--no-run` and carry the binary).
//! The allocators are process-wide: the tests share device 0's, one after
//! the other (`--test-threads=1`), each with its own memory.

use std::collections::BTreeMap;
use std::ffi::{c_void, CStr, CString};
use std::ptr::null_mut;

use alloc_ffi::api::*;
use alloc_ffi::*;

mod common;
use common::last_error;

fn stats() -> BTreeMap<String, i64> {
    let p = gpualloc_memory_stats_json(0);
    assert!(!p.is_null());
    // SAFETY: a string from the library, freed once.
    let json = unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_string();
    unsafe { gpualloc_string_free(p) };
    serde_json::from_str(&json).unwrap()
}

/// `gpualloc_device_stats(0)` gives the numbers of `stats()`.
fn assert_struct_stats_match_json() {
    let mut c = GpuallocDeviceStats {
        size: std::mem::size_of::<GpuallocDeviceStats>(),
        ..Default::default()
    };
    // SAFETY: a sized struct.
    assert_eq!(unsafe { gpualloc_device_stats(0, &mut c) }, GPUALLOC_OK);
    let json = stats();
    for (key, value) in c.flat() {
        assert_eq!(Some(&value), json.get(&key), "{key}");
    }
}

fn current_ctx() -> usize {
    alloc_cuda::cudarc::driver::result::ctx::get_current()
        .unwrap()
        .map_or(0, |c| c as usize)
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn ffi_on_the_gpu() {
    assert_eq!(gpualloc_record_history(1, 1000), GPUALLOC_OK);
    // The first call creates the allocator; the thread had no context.
    let sizes = [1isize, 512, 4096, 1 << 20, (1 << 20) + 1, 7 << 20, 64 << 20];
    let ptrs: Vec<*mut c_void> = sizes
        .iter()
        .map(|&s| {
            let p = gpualloc_malloc(s, 0, null_mut());
            assert!(!p.is_null(), "malloc({s}): {}", last_error());
            assert_eq!(p as usize % 512, 0);
            p
        })
        .collect();
    let s = stats();
    let requested: i64 = sizes.iter().map(|&s| s as i64).sum();
    assert_eq!(s["requested_bytes.all.current"], requested);
    assert_eq!(s["allocation.all.current"], sizes.len() as i64);
    assert!(s["reserved_bytes.all.current"] >= s["allocated_bytes.all.current"]);
    assert!(s["segment.all.current"] >= 2, "small and large pools");
    assert_struct_stats_match_json();

    // A snapshot with the blocks and the recorded events.
    let dir = std::env::temp_dir().join(format!("gpualloc_gpu_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = CString::new(dir.join("snap.pickle").to_str().unwrap()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(
        unsafe { gpualloc_write_snapshot(path.as_ptr(), 0) },
        GPUALLOC_OK
    );
    let snap = build_snapshot(0).unwrap();
    let live: usize = snap
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state == "active_allocated")
        .count();
    assert_eq!(live, sizes.len());
    assert_eq!(
        snap.device_traces[0].len(),
        sizes.len(),
        "one alloc event each"
    );

    // record_stream on a foreign (here: the per-thread default) stream.
    let per_thread = 2usize as *mut c_void;
    assert_eq!(gpualloc_record_stream(ptrs[2], 0, per_thread), GPUALLOC_OK);

    // Frees: a wrong device index is tolerated (found on device 0).
    gpualloc_free(ptrs[0], sizes[0], 1, null_mut());
    for (&p, &s) in ptrs.iter().zip(&sizes).skip(1) {
        gpualloc_free(p, s, 0, null_mut());
    }
    let s = stats();
    assert_eq!(s["allocated_bytes.all.current"], 0);
    assert_struct_stats_match_json();
    // Double free and garbage: errors, no crash.
    gpualloc_free(ptrs[0], 0, 0, null_mut());
    assert!(last_error().contains("double free"), "{}", last_error());
    gpualloc_free(0x10 as *mut c_void, 0, 0, null_mut());
    assert!(last_error().contains("not allocated by gpualloc"));

    // Out of memory: NULL with the allocator's report; later calls work.
    // Skipped under compute-sanitizer, which reports the driver's deliberate
    // out-of-memory return as an API error (as the alloc-cuda suite does).
    if std::env::var_os("ALLOC_CUDA_SANITIZER").is_none() {
        let p = gpualloc_malloc(1 << 46, 0, null_mut());
        assert!(p.is_null());
        let e = last_error();
        assert!(
            e.contains("out of memory") && e.contains("total capacity"),
            "{e}"
        );
        assert_eq!(stats()["num_ooms"], 1);
    }

    // Memory fraction: a request above the limit fails.
    assert_eq!(gpualloc_set_memory_fraction(0.01, 0), GPUALLOC_OK);
    assert!(gpualloc_malloc(4 << 30, 0, null_mut()).is_null());
    assert_eq!(gpualloc_set_memory_fraction(1.0, 0), GPUALLOC_OK);

    // empty_cache binds the device's context for its driver calls and then
    // restores the caller's (here: none). (malloc binds it too when it needs
    // a segment; PyTorch calls it with that device current anyway.)
    // SAFETY: unbinding the thread's context is always valid.
    unsafe { alloc_cuda::cudarc::driver::result::ctx::set_current(null_mut()) }.unwrap();
    assert_eq!(gpualloc_empty_cache(0), GPUALLOC_OK);
    assert_eq!(gpualloc_reset_peak_stats(0), GPUALLOC_OK);
    let s = stats();
    assert_eq!(s["reserved_bytes.all.current"], 0);
    assert_eq!(s["reserved_bytes.all.peak"], 0);
    assert!(s["num_device_free"] >= 2);
    assert_eq!(current_ctx(), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

fn tags_json() -> serde_json::Value {
    let p = gpualloc_tags_json(0);
    assert!(!p.is_null(), "{}", last_error());
    // SAFETY: a string from the library, freed once.
    let json = unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_string();
    unsafe { gpualloc_string_free(p) };
    serde_json::from_str(&json).unwrap()
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn sleep_tags_and_pinned_host_memory_through_the_c_abi() {
    use alloc_cuda::cudarc::driver::result;
    let (mut first, mut second) = (0u64, 0u64);
    // SAFETY: a valid C string and out-pointers.
    let code = unsafe { gpualloc_tag_pool(0, c"ffi_kv".as_ptr(), &mut first, &mut second) };
    assert_eq!(code, GPUALLOC_OK, "{}", last_error());
    let words: Vec<u32> = (0..(6u32 << 20))
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let bytes = (words.len() * 4) as isize;
    let p = gpualloc_malloc_in_pool(bytes, 0, null_mut(), first, second);
    assert!(!p.is_null(), "{}", last_error());
    let ctx = alloc_cuda::CudaAllocator::global(0)
        .unwrap()
        .context()
        .clone();
    ctx.bind_to_thread().unwrap();
    // SAFETY: `p` is a live block of `bytes` bytes on device 0.
    unsafe { result::memcpy_htod_sync(p as u64, &words) }.unwrap();

    // SAFETY: valid C strings.
    assert_eq!(
        unsafe { gpualloc_pause(0, c"ffi_kv".as_ptr(), c"host".as_ptr()) },
        GPUALLOC_OK,
        "{}",
        last_error()
    );
    let tags = tags_json();
    let tag = &tags.as_array().unwrap()[0];
    assert_eq!(tag["name"], "ffi_kv");
    assert_eq!(tag["paused"], true);
    assert_eq!(tag["backup"], "host");
    assert!(tag["paused_bytes"].as_u64().unwrap() >= bytes as u64);
    assert_eq!(tag["backed_up_bytes"].as_u64().unwrap(), bytes as u64);
    assert!(gpualloc_malloc_in_pool(4096, 0, null_mut(), first, second).is_null());
    assert!(last_error().contains("is paused"), "{}", last_error());
    // SAFETY: valid C strings.
    unsafe {
        assert_eq!(
            gpualloc_pause(0, c"ffi_kv".as_ptr(), std::ptr::null()),
            GPUALLOC_ERR_INVALID
        );
        assert!(last_error().contains("already paused"), "{}", last_error());
        assert_eq!(
            gpualloc_resume(0, std::ptr::null()),
            GPUALLOC_OK,
            "{}",
            last_error()
        );
    }
    assert_eq!(tags_json()[0]["paused"], false);
    let mut back = vec![0u32; words.len()];
    ctx.bind_to_thread().unwrap();
    // SAFETY: `p` is live and mapped again, `back` holds as many bytes.
    unsafe { result::memcpy_dtoh_sync(&mut back, p as u64) }.unwrap();
    assert!(back == words, "contents restored from the host backup");
    gpualloc_free(p, bytes, 0, null_mut());

    // Pinned host memory: cached, reused, its counters.
    let h = gpualloc_host_alloc(3 << 20);
    assert!(!h.is_null(), "{}", last_error());
    // SAFETY: 3 MiB of writable pinned memory.
    unsafe { std::ptr::write_bytes(h.cast::<u8>(), 1, 3 << 20) };
    assert_eq!(gpualloc_host_free(h), GPUALLOC_OK);
    let again = gpualloc_host_alloc(3 << 20);
    assert_eq!(again, h, "served from the cache");
    assert_eq!(gpualloc_host_free(again), GPUALLOC_OK);
    let stats = host_stats();
    assert!(
        stats["cache_hits"] >= 1 && stats["allocated_bytes"] == 0,
        "{stats:?}"
    );
    assert_eq!(gpualloc_host_empty_cache(), GPUALLOC_OK);
    assert_eq!(gpualloc_empty_cache(0), GPUALLOC_OK);
}

/// The pinned host counters (`gpualloc_host_stats_json`).
fn host_stats() -> BTreeMap<String, u64> {
    let p = gpualloc_host_stats_json();
    assert!(!p.is_null(), "{}", last_error());
    // SAFETY: a string from the library, read then freed once.
    let stats = serde_json::from_str(unsafe { CStr::from_ptr(p) }.to_str().unwrap()).unwrap();
    unsafe { gpualloc_string_free(p) };
    stats
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn memory_pinned_in_place_through_the_c_abi() {
    use alloc_cuda::cudarc::driver::{result, sys};
    let words: Vec<u32> = (0..(2u32 << 20)).map(|i| i ^ 0x5a5a_5a5a).collect();
    let bytes = words.len() * 4;
    let host = words.as_ptr() as *mut c_void;
    let before = host_stats();
    // SAFETY: `words` outlives its registration (unregistered below).
    let code = unsafe { gpualloc_host_register(host, bytes, GPUALLOC_HOST_REGISTER_MAPPED) };
    assert_eq!(code, GPUALLOC_OK, "{}", last_error());
    let during = host_stats();
    assert_eq!(
        during["registered_bytes"],
        before["registered_bytes"] + bytes as u64
    );
    // Mapped: the device reaches it at an address of its own, from device 0's
    // context (the allocator's).
    let ctx = alloc_cuda::CudaAllocator::global(0)
        .unwrap()
        .context()
        .clone();
    ctx.bind_to_thread().unwrap();
    let mut mapped = 0u64;
    // SAFETY: `host` is registered with the device-map flag; one out-pointer.
    let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut mapped, host, 0) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    assert_ne!(mapped, 0);
    // A copy out of the registered memory into a block of ours, read back.
    let p = gpualloc_malloc(bytes as isize, 0, null_mut());
    assert!(!p.is_null(), "{}", last_error());
    // SAFETY: `p` is a live block of `bytes` bytes, `words` as many.
    unsafe { result::memcpy_htod_sync(p as u64, &words) }.unwrap();
    let mut back = vec![0u32; words.len()];
    // SAFETY: as above.
    unsafe { result::memcpy_dtoh_sync(&mut back, p as u64) }.unwrap();
    assert!(back == words);
    gpualloc_free(p, bytes as isize, 0, null_mut());
    // SAFETY: a range inside the registered one: refused before the driver.
    let inside = unsafe { gpualloc_host_register(host.cast::<u8>().add(4096).cast(), 4096, 0) };
    assert_eq!(inside, GPUALLOC_ERR_INVALID);
    // SAFETY: registered above, no copy uses it any more.
    assert_eq!(unsafe { gpualloc_host_unregister(host) }, GPUALLOC_OK);
    let after = host_stats();
    assert_eq!(after["registered_bytes"], before["registered_bytes"]);
    assert_eq!(after["host_unregisters"], before["host_unregisters"] + 1);
}
