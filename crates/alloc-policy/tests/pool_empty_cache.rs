//! `Engine::empty_pool_cache` (PyTorch's `emptyCache(mempool_id)`, which a
//! `MemPool` calls as it is destroyed): only that pool's idle segments go
//! back; the device-wide cache and other pools keep theirs.
#![cfg(feature = "pytorch-bfc")]

mod common;

use alloc_core::{StreamId, MIB};
use common::{engine, malloc_in_pool, release_all};

const POOL: (u64, u64) = (0, 1);
const OTHER: (u64, u64) = (0, 2);
const S: StreamId = StreamId(1);

#[test]
fn only_the_named_pools_idle_segments_go_back() {
    let mut e = engine("", 8 << 30);
    let shared = e.malloc(4 * MIB, S).unwrap();
    e.free(shared.addr).unwrap(); // cached in the device-wide cache
    e.retain_pool(POOL);
    e.retain_pool(OTHER);
    let y = malloc_in_pool(&mut e, POOL, S, 4 * MIB);
    let z = malloc_in_pool(&mut e, OTHER, S, 4 * MIB);
    e.free(z).unwrap();
    // The pool is released while its block is live, as when a tensor
    // outlives its MemPool; the block's free leaves the segment idle.
    release_all(&mut e, POOL);
    e.free(y).unwrap();
    let reserved = |e: &common::SimEngine| e.stats().reserved_bytes.all.current;
    assert_eq!(reserved(&e), 3 * 20 * MIB as i64);

    e.empty_pool_cache(POOL).unwrap();
    assert_eq!(
        reserved(&e),
        2 * 20 * MIB as i64,
        "the released pool's segment went back"
    );
    // A pool still held keeps its idle segment (a graph may replay into it).
    e.empty_pool_cache(OTHER).unwrap();
    assert_eq!(reserved(&e), 2 * 20 * MIB as i64);
    release_all(&mut e, OTHER);
    e.empty_cache().unwrap();
    assert_eq!(reserved(&e), 0);
    e.assert_valid();
}
