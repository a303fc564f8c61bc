//! Shared helpers for the policy integration tests.
#![allow(dead_code)]

use alloc_core::{PoolId, SimStreams, StreamId};
pub use alloc_policy::testing::SimEngine;

/// An engine on a simulated device of `capacity` bytes with the given config.
pub fn engine(config: &str, capacity: u64) -> SimEngine {
    alloc_policy::testing::engine_with(config, capacity, SimStreams::new())
        .expect("test config builds an engine")
}

/// Frees `addrs`, empties the cache and checks that nothing stays on the
/// simulated device and the engine's invariants hold.
pub fn drain(e: &mut SimEngine, addrs: impl IntoIterator<Item = u64>) {
    for addr in addrs {
        e.free(addr).unwrap();
    }
    e.empty_cache().unwrap();
    assert_eq!(e.memory().used(), 0, "memory left on the device");
    e.assert_valid();
}

/// Allocates `size` bytes for `stream` from the private `pool`, with an
/// allocation routing opened and closed around it (which holds the pool
/// once more, as PyTorch's captures and `use_mem_pool` blocks do).
pub fn malloc_in_pool(e: &mut SimEngine, pool: PoolId, stream: StreamId, size: u64) -> u64 {
    e.begin_allocate_to_pool(pool);
    let a = e.malloc_in(size, stream, Some(pool)).unwrap().addr;
    e.end_allocate_to_pool(pool).unwrap();
    a
}

/// Drops every holder of `pool`.
pub fn release_all(e: &mut SimEngine, pool: PoolId) {
    while e.pool_use_count(pool) > 0 {
        e.release_pool(pool).unwrap();
    }
}
