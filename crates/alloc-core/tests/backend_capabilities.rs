//! The engine asks a memory backend for its capabilities (virtual memory,
//! detaching busy pages) and does without those it lacks: a device without
//! virtual memory gets plain segments, and one that cannot detach pages
//! keeps busy pages mapped, never an "unsupported" error at run time.

use alloc_core::{
    AllocError, AllocatorConfig, BackendError, Engine, MemoryBackend, PageLayout, SimMemory,
    SimStreams, StreamId, VirtualMemory, GIB, MIB,
};
use alloc_policy::AnyPolicy;

/// The simulated device with only some of its capabilities: virtual
/// memory if `virtual_memory`, never page detaching.
struct Restricted {
    sim: SimMemory,
    virtual_memory: bool,
}

impl Restricted {
    fn new(virtual_memory: bool) -> Self {
        Restricted {
            sim: SimMemory::new(GIB),
            virtual_memory,
        }
    }
}

impl MemoryBackend for Restricted {
    fn allocate(&mut self, size: u64) -> Result<u64, BackendError> {
        self.sim.allocate(size)
    }
    fn free(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.sim.free(addr, size)
    }
    fn capacity(&self) -> u64 {
        self.sim.capacity()
    }
    fn free_bytes(&self) -> u64 {
        self.sim.free_bytes()
    }
    fn virtual_memory(&mut self) -> Option<&mut dyn VirtualMemory> {
        if self.virtual_memory {
            Some(self)
        } else {
            None
        }
    }
}

impl VirtualMemory for Restricted {
    fn granularity(&self) -> u64 {
        self.sim.granularity()
    }
    fn reserve(&mut self, size: u64, pages: PageLayout) -> Result<u64, BackendError> {
        self.sim.reserve(size, pages)
    }
    fn map(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.sim.map(addr, size)
    }
    fn unmap(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.sim.unmap(addr, size)
    }
    fn release(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.sim.release(addr, size)
    }
}

fn engine<M: MemoryBackend>(
    config: &str,
    memory: M,
    streams: SimStreams,
) -> Engine<AnyPolicy, M, SimStreams> {
    let cfg = AllocatorConfig::parse(config).expect("test config parses");
    AnyPolicy::engine(&cfg, memory, streams).expect("policy builds")
}

#[test]
fn a_device_without_virtual_memory_gets_plain_segments() {
    let s = StreamId(0);
    let mut e = engine(
        "expandable_segments:True",
        Restricted::new(false),
        SimStreams::new(),
    );
    assert!(!e.expandable(), "no virtual memory: segments cannot grow");
    let a = e.malloc(3 * MIB, s).unwrap();
    // PyTorch's plain rule: a request below 10 MiB takes a 20 MiB segment.
    assert_eq!(e.stats().reserved_bytes.all.current, 20 * MIB as i64);
    assert_eq!(e.memory().sim.allocs, 1);
    assert!(matches!(
        e.tag_pool("kv_cache"),
        Err(AllocError::InvalidArgument(msg)) if msg.contains("virtual memory")
    ));
    e.free(a.addr).unwrap();
    e.empty_cache().unwrap();
    assert_eq!(e.memory().sim.used(), 0);
    e.assert_valid();
}

/// Frees a 40 MiB block on a stream whose GPU lags, so its pages stay busy,
/// then asks for 60 MiB more: with `unmap_free_pages` the busy pages would
/// move to the new mapping if the backend can detach them. Returns the
/// busy pages reused and the peak reserved bytes.
fn grow_over_busy_pages<M: MemoryBackend>(memory: M) -> (u64, i64) {
    let s = StreamId(0);
    let mut e = engine(
        "expandable_segments:True,unmap_free_pages:True",
        memory,
        SimStreams::with_gpu_lag(1000),
    );
    let a = e.malloc(40 * MIB, s).unwrap();
    let b = e.malloc(40 * MIB, s).unwrap();
    e.free(a.addr).unwrap();
    let c = e.malloc(60 * MIB, s).unwrap();
    e.assert_valid();
    let stats = e.stats().clone();
    for addr in [b.addr, c.addr] {
        e.free(addr).unwrap();
    }
    e.empty_cache().unwrap();
    e.assert_valid();
    (
        stats.page_moves.busy_pages_reused,
        stats.reserved_bytes.all.peak,
    )
}

#[test]
fn busy_pages_move_only_where_the_backend_detaches_them() {
    let (moved, peak_detaching) = grow_over_busy_pages(SimMemory::new(GIB));
    assert!(moved > 0, "the simulated device detaches busy pages");
    let (kept, peak_without) = grow_over_busy_pages(Restricted::new(true));
    assert_eq!(kept, 0, "no detaching: busy pages stay mapped");
    assert!(
        peak_without > peak_detaching,
        "without detaching the new mapping raises the peak ({peak_without} vs {peak_detaching})"
    );
}

#[test]
fn expandable_segments_without_virtual_memory_fall_back_to_ordinary_segments() {
    let s = StreamId(0);
    // The setting recommended for memory, on a device without virtual
    // memory: ordinary segments, as PyTorch gives, and every call works.
    let mut e = engine("bound", Restricted::new(false), SimStreams::new());
    assert!(e.expandable_fallback() && !e.expandable());
    let mut plain = engine("", Restricted::new(false), SimStreams::new());
    assert!(!plain.expandable_fallback());
    for (size, round) in [(3 * MIB, 0), (30 * MIB, 1), (5 * MIB, 2), (64 * MIB, 3)] {
        let a = e.malloc(size, s).unwrap();
        let b = plain.malloc(size, s).unwrap();
        assert_eq!(
            e.stats().reserved_bytes.all.current,
            plain.stats().reserved_bytes.all.current,
            "round {round}"
        );
        if round % 2 == 0 {
            e.free(a.addr).unwrap();
            plain.free(b.addr).unwrap();
        }
    }
    e.empty_cache().unwrap();
    e.assert_valid();
    // Asked for at run time, as `_set_allocator_settings` would: accepted,
    // and segments stay ordinary.
    let mut late = engine("", Restricted::new(false), SimStreams::new());
    let cfg = AllocatorConfig::default()
        .with_settings("expandable_segments:True")
        .unwrap();
    late.reconfigure(&cfg).unwrap();
    assert!(late.expandable_fallback() && !late.expandable());
    late.malloc(3 * MIB, s).unwrap();
    assert_eq!(late.stats().reserved_bytes.all.current, 20 * MIB as i64);
    // With virtual memory nothing falls back.
    let grown = engine("expandable", Restricted::new(true), SimStreams::new());
    assert!(grown.expandable() && !grown.expandable_fallback());
}
