//! `engine_per_stream:True,engine_per_thread:True`: the C library serving
//! each device with an engine for each stream and thread, through the C
//! entry points over the null driver (`crates/alloc-cuda/null-driver`):
//! two threads on one stream get engines of their own (one's cached block
//! is not the other's), a thread started after they ended takes one over,
//! threads free each other's blocks, and the device's statistics stay
//! exact.
//!
//! `#[ignore]`d: it needs the null driver on the library path, as
//! `bash crates/alloc-cuda/null-driver/run.sh --tests` (CI) sets it. Its own
//! test binary: the layout is decided once a process, at the first use.

mod common;

use std::ptr::null_mut;
use std::sync::Barrier;

use alloc_ffi::api::GPUALLOC_OK;
use alloc_ffi::*;

const MIB: isize = 1 << 20;

/// Reserved bytes of device 0.
fn reserved() -> i64 {
    common::stats(0)["reserved_bytes.all.current"]
}

/// A 3 MiB block on device 0's default stream, freed at once.
fn malloc_and_free() {
    let p = gpualloc_malloc(3 * MIB, 0, null_mut());
    assert!(!p.is_null(), "{}", common::last_error());
    gpualloc_free(p, 0, 0, null_mut());
}

#[test]
#[ignore = "needs the null driver: bash crates/alloc-cuda/null-driver/run.sh --tests"]
fn threads_on_one_stream_get_engines_of_their_own() {
    if !common::driver_loaded() {
        return;
    }
    // SAFETY: a NUL-terminated string that outlives the call.
    let alone = unsafe { gpualloc_configure(c"engine_per_thread:True".as_ptr()) };
    assert_ne!(
        alone, GPUALLOC_OK,
        "engine_per_thread needs engine_per_stream"
    );
    assert!(common::last_error().contains("needs engine_per_stream"));
    // SAFETY: as above.
    let ok =
        unsafe { gpualloc_configure(c"engine_per_stream:True,engine_per_thread:True".as_ptr()) };
    assert_eq!(ok, GPUALLOC_OK, "{}", common::last_error());

    // A block one thread freed on the default stream is not another
    // live thread's to reuse on it: the second thread's engine reserves
    // anew.
    let both_freed = Barrier::new(2);
    std::thread::scope(|s| {
        let run = || {
            s.spawn(|| {
                malloc_and_free();
                both_freed.wait(); // neither ends before both freed
            })
        };
        // Joined: a join returns once the thread's destructors ran (which
        // give its engine back for the next thread).
        let (a, b) = (run(), run());
        a.join().unwrap();
        b.join().unwrap();
    });
    let two = reserved();
    assert!(two > 0);
    // Once they ended, a new thread takes over an engine and its cache:
    // nothing more is reserved.
    std::thread::scope(|s| {
        s.spawn(malloc_and_free).join().unwrap();
    });
    assert_eq!(reserved(), two, "an ended thread's engine taken over");

    // Two threads on the one stream, each freeing the other's blocks.
    let (mine, theirs) = common::four_blocks_on_two_threads((3 * MIB, 0), (5 * MIB, 0));
    let live = (4 * 3 * MIB + 4 * 5 * MIB) as i64;
    assert_eq!(common::stats(0)["allocated_bytes.all.current"], live);
    common::free_on_two_threads(&theirs, &mine);
    let st = common::stats(0);
    assert_eq!(st["allocated_bytes.all.current"], 0, "{st:?}");
    assert_eq!(st["allocated_bytes.all.peak"], live, "the device's peak");
    assert_eq!(st["allocation.all.allocated"], st["allocation.all.freed"]);
    assert_eq!(gpualloc_empty_cache(-1), GPUALLOC_OK);
    assert_eq!(reserved(), 0, "empty_cache reaches every thread's engine");
}
