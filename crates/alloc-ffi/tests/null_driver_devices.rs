//! A free names a device that may not be the block's: the C library frees
//! the block on the device that owns it (the PyTorch bridge names the device
//! of the freeing thread's last allocation, which is another device's after
//! a thread allocated on two). Two devices of the null driver
//! (`crates/alloc-cuda/null-driver`, `NULL_CUDA_DEVICES=2`).
//!
//! `#[ignore]`d: it needs the null driver on the library path, as
//! `bash crates/alloc-cuda/null-driver/run.sh --tests` (CI) sets it. Its own
//! test binary: the device count is read when the driver is first used.

mod common;

use std::ffi::c_void;
use std::ptr::null_mut;

use alloc_ffi::*;

const MIB: isize = 1 << 20;

fn allocated(device: i32) -> i64 {
    common::stats(device)["allocated_bytes.all.current"]
}

#[test]
#[ignore = "needs the null driver: bash crates/alloc-cuda/null-driver/run.sh --tests"]
fn a_free_naming_another_device_frees_the_block_where_it_lives() {
    // Before anything asks the driver how many devices it has.
    std::env::set_var("NULL_CUDA_DEVICES", "2");
    if !common::driver_loaded() {
        return;
    }
    let on_zero = gpualloc_malloc(3 * MIB, 0, null_mut());
    let on_one = gpualloc_malloc(2 * MIB, 1, null_mut());
    assert!(
        !on_zero.is_null() && !on_one.is_null(),
        "{}",
        common::last_error()
    );
    assert_eq!(
        (allocated(0), allocated(1)),
        (3 * MIB as i64, 2 * MIB as i64)
    );

    // Device 1's block freed naming device 0, which has an allocator of its own.
    gpualloc_free(on_one, 0, 0, null_mut());
    assert_eq!((allocated(0), allocated(1)), (3 * MIB as i64, 0));

    // Naming a device without an allocator, and the highest index there is.
    for hint in [5, 63] {
        let p = gpualloc_malloc(MIB, 1, null_mut());
        assert!(!p.is_null(), "{}", common::last_error());
        gpualloc_free(p, 0, hint, null_mut());
        assert_eq!(allocated(1), 0, "freed naming device {hint}");
    }

    // Device 0's block freed naming device 1.
    gpualloc_free(on_zero, 0, 1, null_mut());
    assert_eq!((allocated(0), allocated(1)), (0, 0));

    // A pointer no device holds is still an error, whichever device is named.
    gpualloc_free(0x1000 as *mut c_void, 0, 1, null_mut());
    assert!(common::last_error().contains("not allocated by gpualloc"));
    // And a block freed twice: the second free finds it on neither device.
    let p = gpualloc_malloc(MIB, 1, null_mut());
    gpualloc_free(p, 0, 1, null_mut());
    gpualloc_free(p, 0, 0, null_mut());
    assert!(common::last_error().contains("not allocated by gpualloc"));
    assert_eq!((allocated(0), allocated(1)), (0, 0));
}
