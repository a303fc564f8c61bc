//! A private pool whose segments come from a source of its own (PyTorch's
//! `MemPool(allocator)`): its segments are taken from and given back to that
//! source only, cached and split like any other, and the device backend
//! never sees them.
#![cfg(feature = "pytorch-bfc")]

mod common;

use std::sync::{Arc, Mutex};

use alloc_core::{AllocError, BackendError, SegmentSource, StreamId, MIB};
use common::engine;

/// Segments from a range of its own; records every call.
#[derive(Clone, Default)]
struct Counting(Arc<Mutex<Calls>>);

#[derive(Default)]
struct Calls {
    next: u64,
    allocated: Vec<(u64, u64)>,
    freed: Vec<(u64, u64)>,
    room: Option<u64>,
}

impl SegmentSource for Counting {
    fn allocate(&mut self, size: u64) -> Result<u64, BackendError> {
        let mut c = self.0.lock().unwrap();
        if c.room.is_some_and(|room| room < size) {
            return Err(BackendError::OutOfMemory);
        }
        if let Some(room) = c.room.as_mut() {
            *room -= size;
        }
        let addr = 0x5000_0000_0000 + c.next;
        c.next += size + (2 << 20);
        c.allocated.push((addr, size));
        Ok(addr)
    }
    fn free(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.0.lock().unwrap().freed.push((addr, size));
        Ok(())
    }
}

const POOL: (u64, u64) = (0, 9);

#[test]
fn a_sourced_pool_takes_and_gives_back_through_its_source() {
    for config in ["", "expandable_segments:True"] {
        let mut e = engine(config, 8 << 30);
        let source = Counting::default();
        assert!(
            e.set_pool_source(POOL, Box::new(source.clone())).is_err(),
            "unheld pool"
        );
        e.retain_pool(POOL);
        e.set_pool_source(POOL, Box::new(source.clone())).unwrap();
        e.begin_allocate_to_pool(POOL);
        let a = e.malloc_in(4 * MIB, StreamId(0), Some(POOL)).unwrap().addr;
        let b = e.malloc_in(4 * MIB, StreamId(0), Some(POOL)).unwrap().addr;
        e.end_allocate_to_pool(POOL).unwrap();
        let outside = e.malloc(4 * MIB, StreamId(0)).unwrap().addr;
        {
            let c = source.0.lock().unwrap();
            // One 20 MiB segment from the source, split for both blocks;
            // the allocation outside the pool comes from the device.
            assert_eq!(c.allocated.len(), 1, "`{config}`");
            assert_eq!(c.allocated[0].1, 20 * MIB);
            let seg = c.allocated[0].0..c.allocated[0].0 + 20 * MIB;
            assert!(seg.contains(&a) && seg.contains(&b) && !seg.contains(&outside));
        }
        assert!(
            e.memory().used() >= 4 * MIB,
            "the outside block is the device's"
        );
        e.assert_valid();
        e.free(a).unwrap();
        e.free(b).unwrap();
        e.free(outside).unwrap();
        e.empty_cache().unwrap();
        assert!(
            source.0.lock().unwrap().freed.is_empty(),
            "a held pool keeps its memory"
        );
        common::release_all(&mut e, POOL);
        e.empty_cache().unwrap();
        let c = source.0.lock().unwrap();
        assert_eq!(c.freed, c.allocated, "`{config}`: given back to the source");
        assert_eq!(e.memory().used(), 0);
        assert_eq!(e.stats().reserved_bytes.all.current, 0);
        e.assert_valid();
    }
}

#[test]
fn a_full_source_is_out_of_memory_for_its_pool_only() {
    let mut e = engine("", 8 << 30);
    let source = Counting::default();
    source.0.lock().unwrap().room = Some(0);
    e.retain_pool(POOL);
    e.set_pool_source(POOL, Box::new(source)).unwrap();
    assert!(matches!(
        e.malloc_in(MIB, StreamId(0), Some(POOL)),
        Err(AllocError::OutOfMemory(_))
    ));
    let outside = e.malloc(MIB, StreamId(0)).unwrap().addr; // the device still serves
    e.free(outside).unwrap();
    e.release_pool(POOL).unwrap();
    e.empty_cache().unwrap();
    e.assert_valid();
}
