//! `engine_per_stream:True`: the C library serving each device with an
//! engine for each stream (`alloc_cuda::StreamEngines`), through the C
//! entry points over the null driver (`crates/alloc-cuda/null-driver`):
//! threads on their own streams freeing each other's blocks, the device's
//! statistics (peaks of the sums), the memory fraction as one limit,
//! empty_cache, snapshots, and the calls that need one engine a device
//! refused by name.
//!
//! `#[ignore]`d: it needs the null driver on the library path, as
//! `bash crates/alloc-cuda/null-driver/run.sh --tests` (CI) sets it. Its own
//! test binary: the layout is decided once a process, at the first use.

mod common;

use std::ffi::{c_void, CStr};
use std::ptr::null_mut;

use alloc_ffi::api::{GPUALLOC_ERR_INVALID, GPUALLOC_OK};
use alloc_ffi::*;

const MIB: isize = 1 << 20;

extern "C" {
    /// The C library's IPC lookup (`include/gpualloc.h`), which the crate
    /// does not re-export.
    fn gpualloc_block_segment(
        ptr: *mut c_void,
        device: i32,
        base: *mut u64,
        size: *mut u64,
        expandable: *mut i32,
    ) -> i32;
}
/// `CU_STREAM_PER_THREAD`: a second stream besides the legacy default (0),
/// so a second engine.
const PER_THREAD: CudaStream = 2 as CudaStream;

fn refused(code: i32) {
    assert_eq!(code, GPUALLOC_ERR_INVALID);
    let msg = common::last_error();
    assert!(msg.contains("engine_per_stream"), "{msg}");
}

#[test]
#[ignore = "needs the null driver: bash crates/alloc-cuda/null-driver/run.sh --tests"]
fn an_engine_per_stream_serves_the_c_library() {
    if !common::driver_loaded() {
        return;
    }
    // Settings whose decisions span streams are refused with it.
    // SAFETY: NUL-terminated strings that outlive the calls.
    let spans = unsafe {
        gpualloc_configure(c"engine_per_stream:True,garbage_collection_threshold:0.8".as_ptr())
    };
    assert_eq!(spans, GPUALLOC_ERR_INVALID);
    assert!(common::last_error().contains("span streams"));
    // SAFETY: as above.
    let ok = unsafe { gpualloc_configure(c"engine_per_stream:True".as_ptr()) };
    assert_eq!(ok, GPUALLOC_OK, "{}", common::last_error());

    // Two threads, each on its own stream, each freeing the other's blocks.
    let (mine, theirs) =
        common::four_blocks_on_two_threads((3 * MIB, 0), (5 * MIB, PER_THREAD as usize));
    let s = common::stats(0);
    assert_eq!(
        s["allocated_bytes.all.current"],
        (4 * 3 * MIB + 4 * 5 * MIB) as i64
    );
    assert_eq!(s["allocation.all.current"], 8);
    common::free_on_two_threads(&theirs, &mine);
    let s = common::stats(0);
    assert_eq!(s["allocated_bytes.all.current"], 0, "{s:?}");
    // The device's peak: both threads' blocks at once, not either engine's.
    assert_eq!(
        s["allocated_bytes.all.peak"],
        (4 * 3 * MIB + 4 * 5 * MIB) as i64
    );
    assert_eq!(s["allocation.all.freed"], 8);
    assert!(s["reserved_bytes.all.current"] > 0);

    // The struct of statistics says the same.
    let mut st = GpuallocDeviceStats {
        size: std::mem::size_of::<GpuallocDeviceStats>(),
        ..Default::default()
    };
    // SAFETY: `st` is writable for its size.
    assert_eq!(unsafe { gpualloc_device_stats(0, &mut st) }, GPUALLOC_OK);
    assert_eq!(st.allocated_bytes[0].peak, s["allocated_bytes.all.peak"]);

    // A block of one stream recorded on the other, then freed.
    let p = gpualloc_malloc(MIB, 0, null_mut());
    assert!(!p.is_null());
    assert_eq!(gpualloc_record_stream(p, 0, PER_THREAD), GPUALLOC_OK);
    gpualloc_free(p, 0, 0, null_mut());
    // A pointer no engine holds is an error, not a crash.
    gpualloc_free(0x1000 as *mut c_void, 0, 0, null_mut());
    assert!(common::last_error().contains("not allocated by gpualloc"));
    // A free naming a device without engines finds the block where it lives.
    let p = gpualloc_malloc(MIB, 0, PER_THREAD);
    assert!(!p.is_null(), "{}", common::last_error());
    gpualloc_free(p, 0, 5, null_mut());
    assert_eq!(common::stats(0)["allocated_bytes.all.current"], 0);

    // The snapshot has every engine's segments.
    let text = gpualloc_snapshot_text(0);
    assert!(!text.is_null(), "{}", common::last_error());
    // SAFETY: a NUL-terminated string of the library, freed right after.
    let snap = unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: returned by the library, freed once.
    unsafe { gpualloc_string_free(text) };
    assert!(snap.contains("segment"), "{snap}");

    // The memory fraction is one limit for every engine: 1/1280 of the
    // null driver's 80 GiB is 64 MiB, which two streams' 40 MiB pass.
    assert_eq!(gpualloc_set_memory_fraction(0.00078125, 0), GPUALLOC_OK);
    let p = gpualloc_malloc(40 * MIB, 0, null_mut());
    assert!(!p.is_null(), "{}", common::last_error());
    assert!(gpualloc_malloc(40 * MIB, 0, PER_THREAD).is_null());
    assert_eq!(
        gpualloc_last_error_code(),
        alloc_ffi::api::GPUALLOC_ERR_OUT_OF_MEMORY
    );
    gpualloc_free(p, 0, 0, null_mut());
    let q = gpualloc_malloc(40 * MIB, 0, PER_THREAD);
    assert!(!q.is_null(), "the other engine's cache went back");
    gpualloc_free(q, 0, 0, null_mut());
    assert_eq!(gpualloc_set_memory_fraction(1.0, 0), GPUALLOC_OK);

    // empty_cache reaches every engine.
    assert_eq!(gpualloc_empty_cache(-1), GPUALLOC_OK);
    assert_eq!(common::stats(0)["reserved_bytes.all.current"], 0);
    assert_eq!(gpualloc_reset_peak_stats(0), GPUALLOC_OK);
    assert_eq!(common::stats(0)["allocated_bytes.all.peak"], 0);

    // What needs one engine a device is refused by name.
    assert!(gpualloc_malloc_in_pool(MIB, 0, null_mut(), 1, 2).is_null());
    refused(gpualloc_last_error_code());
    refused(gpualloc_record_history(1, 100));
    // SAFETY: a NUL-terminated string that outlives the call.
    refused(unsafe { gpualloc_update_settings(c"max_split_size_mb:64".as_ptr()) });
    let (mut base, mut size, mut expandable) = (0u64, 0u64, 0i32);
    let p = gpualloc_malloc(MIB, 0, null_mut());
    // SAFETY: the three out-pointers are valid for one write each.
    refused(unsafe { gpualloc_block_segment(p, 0, &mut base, &mut size, &mut expandable) });
    gpualloc_free(p, 0, 0, null_mut());
    // A device out of range is an error as under one engine a device.
    assert_eq!(
        gpualloc_record_stream(p, -1, PER_THREAD),
        GPUALLOC_ERR_INVALID
    );
}
