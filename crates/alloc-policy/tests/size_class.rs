//! Size-class's idle slabs on the simulated device: kept and carved again
//! for any class by default, given back before a new slab in the bounded
//! mode (`idle_slab_limit_mb`), and freed under memory pressure.
#![cfg(feature = "size-class")]

mod common;

use alloc_core::{StreamId, GIB, MIB};
use common::engine;

#[test]
fn idle_slab_limit_builds_with_size_class_adapted_or_not() {
    engine("policy:size-class,idle_slab_limit_mb:0", GIB).assert_valid();
    if cfg!(feature = "gc-age") {
        engine("policy:size-class+gc-age,idle_slab_limit_mb:0", GIB).assert_valid();
    }
}

/// Allocates `count` blocks of `size` bytes on `stream`, then frees them
/// all: their memory stays cached.
fn allocate_then_free(e: &mut common::SimEngine, count: usize, size: u64, stream: StreamId) {
    let addrs: Vec<u64> = (0..count)
        .map(|_| e.malloc(size, stream).unwrap().addr)
        .collect();
    for x in addrs {
        e.free(x).unwrap();
    }
}

/// One "training step" of a size-class engine: activations of one class,
/// then of another, each freed before the next.
fn size_class_step(e: &mut common::SimEngine, first: u64, second: u64) {
    allocate_then_free(e, 4, first, StreamId(0));
    allocate_then_free(e, 4, second, StreamId(0));
}

#[test]
fn size_class_keeps_idle_slabs_unless_a_limit_is_set() {
    // Default: after the first step, the idle slabs are reset and carved
    // again for either class; nothing goes back to the device.
    let mut e = engine("policy:size-class", 8 * GIB);
    for _ in 0..5 {
        size_class_step(&mut e, 96 * MIB, 224 * MIB);
    }
    let s = e.stats();
    assert_eq!((s.num_device_alloc, s.num_device_free), (8, 0));
    assert_eq!(s.reserved_bytes.all.peak as u64, 4 * (96 + 224) * MIB);
    e.assert_valid();
    // With a limit (the bounded mode), idle slabs keep their classes and go
    // back before a new slab is reserved: the peak is the larger class's
    // 896 MiB, paid for with a device free per slab, every step.
    let mut e = engine("policy:size-class,idle_slab_limit_mb:0", 8 * GIB);
    for _ in 0..5 {
        size_class_step(&mut e, 96 * MIB, 224 * MIB);
    }
    let s = e.stats();
    assert_eq!((s.num_device_alloc, s.num_device_free), (40, 36));
    assert_eq!(s.reserved_bytes.all.peak as u64, 4 * 224 * MIB);
    e.assert_valid();
    // Out of memory still empties the idle cache: 5 x 1 GiB cached, 6 GiB
    // asked on an 8 GiB device.
    let mut e = engine("policy:size-class", 8 * GIB);
    allocate_then_free(&mut e, 5, GIB, StreamId(0));
    let big = e.malloc(6 * GIB, StreamId(0)).unwrap();
    assert_eq!(e.memory().used(), big.size);
    e.assert_valid();
    // Also when the cache belongs to another stream and the other pool.
    e.free(big.addr).unwrap();
    allocate_then_free(&mut e, 512, MIB, StreamId(2));
    let other = e.malloc(7 * GIB, StreamId(1)).unwrap();
    assert_eq!(e.memory().used(), other.size);
    e.assert_valid();
}
