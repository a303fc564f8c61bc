//! Garbage collection by age, a collector that composes with any policy.
//!
//! [`GcAge`] is a [`Reclaim`] of its own: a policy holds one and calls it
//! from its own [`Reclaim::collect_garbage`] ([`GcAge::collect_then`] runs
//! the policy's own collector after it); `AnyPolicy` does so for
//! `<base>+gc-age`. Wholly idle segments age in allocator ticks (one tick
//! per cache lookup in their pool, [`Heap::clock`], since
//! [`Segment::idle_since`](alloc_core::Segment::idle_since)); whenever a new
//! segment is needed while reserved memory exceeds threshold x limit (the
//! memory fraction's limit, or the device capacity), idle segments go back
//! to the device oldest first, the larger first among equally old ones, until
//! reserved memory is at or below the line. The policy's own collector then
//! runs on what is left.
//!
//! Unlike PyTorch's collector (`pytorch-bfc`'s own), which frees only
//! unsplit large-pool blocks at least as old as the average and only with a
//! memory fraction set, this one considers every idle segment of both pools,
//! with or without a memory fraction, in strict age order.

use std::collections::BTreeSet;

use alloc_core::{AllocatorConfig, Heap, Pressure, Reclaim, SegmentId};

use crate::idle::idle_oldest_first;

/// Threshold used when the configuration sets no
/// `garbage_collection_threshold`.
pub const DEFAULT_THRESHOLD: f64 = 0.8;

/// Settings of the age-based collector.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct GcAgeSettings {
    /// Collect once reserved memory exceeds this fraction of the limit
    /// (`garbage_collection_threshold`, default [`DEFAULT_THRESHOLD`]).
    pub threshold: f64,
    /// Segments idle for fewer ticks than this are kept (default 0: any idle
    /// segment may go).
    pub min_age_ticks: u64,
}

impl Default for GcAgeSettings {
    fn default() -> Self {
        GcAgeSettings {
            threshold: DEFAULT_THRESHOLD,
            min_age_ticks: 0,
        }
    }
}

impl From<&AllocatorConfig> for GcAgeSettings {
    /// The threshold from `garbage_collection_threshold`, else the default.
    fn from(cfg: &AllocatorConfig) -> Self {
        GcAgeSettings::with_threshold(cfg.garbage_collection_threshold)
    }
}

impl GcAgeSettings {
    /// The settings with `garbage_collection_threshold` when given
    /// ([`alloc_core::config::GarbageCollection::ByAge`]), else
    /// [`DEFAULT_THRESHOLD`].
    pub fn with_threshold(threshold: Option<f64>) -> Self {
        GcAgeSettings {
            threshold: threshold.unwrap_or(DEFAULT_THRESHOLD),
            ..GcAgeSettings::default()
        }
    }
}

/// The age-based collector (see the module documentation).
#[derive(Debug, Clone, Default)]
pub struct GcAge {
    settings: GcAgeSettings,
}

impl GcAge {
    /// A collector with `settings`.
    pub fn new(settings: GcAgeSettings) -> Self {
        GcAge { settings }
    }

    /// The settings in use.
    pub fn settings(&self) -> &GcAgeSettings {
        &self.settings
    }

    /// Takes the threshold of `cfg` changed at run time.
    pub fn reconfigure(&mut self, cfg: &AllocatorConfig) {
        self.settings.threshold = GcAgeSettings::from(cfg).threshold;
    }

    /// Idle segments to release under `pressure`, oldest first, and the
    /// reserved bytes left once they are gone.
    fn choose(&self, heap: &Heap, pressure: &Pressure) -> (Vec<SegmentId>, u64) {
        let line = (self.settings.threshold * pressure.limit as f64) as u64;
        let mut reserved = pressure.reserved;
        if reserved <= line {
            return (Vec::new(), reserved);
        }
        let min_age = self.settings.min_age_ticks;
        let mut chosen = Vec::new();
        for idle in idle_oldest_first(heap, |_, age| age >= min_age) {
            if reserved <= line {
                break;
            }
            reserved = reserved.saturating_sub(idle.size);
            chosen.push(idle.id);
        }
        (chosen, reserved)
    }

    /// Idle segments oldest first while reserved memory exceeds threshold x
    /// limit, then those `then` (the policy's own collector) chooses under
    /// the pressure that is left, each segment once.
    pub fn collect_then<R: Reclaim + ?Sized>(
        &mut self,
        heap: &Heap,
        pressure: &Pressure,
        then: &mut R,
    ) -> Vec<SegmentId> {
        let (mut chosen, reserved) = self.choose(heap, pressure);
        let left = Pressure {
            reserved,
            ..*pressure
        };
        let more = then.collect_garbage(heap, &left);
        if chosen.is_empty() {
            return more;
        }
        if !more.is_empty() {
            let mut seen: BTreeSet<SegmentId> = chosen.iter().copied().collect();
            chosen.extend(more.into_iter().filter(|id| seen.insert(*id)));
        }
        chosen
    }
}

/// The collector alone: idle segments oldest first while reserved memory
/// exceeds threshold x limit.
impl Reclaim for GcAge {
    fn collect_garbage(&mut self, heap: &Heap, pressure: &Pressure) -> Vec<SegmentId> {
        self.choose(heap, pressure).0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc_core::{Audit, BlockId, CacheKey, Capabilities, Policy, Request, StreamId};
    use alloc_core::{Engine, EngineOptions, Pool, SimMemory, SimStreams, GIB, MIB};

    /// A minimal policy: one block per segment, exact-size reuse, no
    /// collector of its own but a [`GcAge`]. Sizes are rounded to 2 MiB;
    /// requests of at most 1 MiB go to the small pool.
    #[derive(Debug, Default)]
    struct Whole {
        free: Vec<BlockId>,
        gc: GcAge,
    }

    impl Whole {
        fn new(settings: GcAgeSettings) -> Self {
            Whole {
                free: Vec::new(),
                gc: GcAge::new(settings),
            }
        }
    }

    /// The composition: the policy's collector is the age-based one.
    impl Reclaim for Whole {
        fn collect_garbage(&mut self, heap: &Heap, pressure: &Pressure) -> Vec<SegmentId> {
            self.gc.collect_garbage(heap, pressure)
        }
    }

    impl Policy for Whole {
        fn name(&self) -> &str {
            "whole"
        }
        fn round_request(&self, requested: u64, key: CacheKey) -> Request {
            let pool = if requested <= MIB {
                Pool::Small
            } else {
                Pool::Large
            };
            Request {
                requested,
                size: requested.div_ceil(2 * MIB) * 2 * MIB,
                pool,
                key,
            }
        }
        fn segment_size(&self, req: &Request) -> u64 {
            req.size
        }
        fn take_free(&mut self, heap: &Heap, req: &Request) -> Option<BlockId> {
            let at = self.free.iter().position(|&b| {
                let b = heap.block(b);
                b.size == req.size && b.key() == req.key && b.pool == req.pool
            })?;
            Some(self.free.swap_remove(at))
        }
        fn carve(&mut self, _heap: &mut Heap, block: BlockId, _req: &Request) -> BlockId {
            block
        }
        fn insert_free(&mut self, _heap: &mut Heap, block: BlockId) {
            self.free.push(block);
        }
        fn remove_free(&mut self, _heap: &Heap, block: BlockId) {
            self.free.retain(|&b| b != block);
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities {
                coalesces: true,
                ..Capabilities::default()
            }
        }
    }

    impl Audit for Whole {
        fn indexed_blocks(&self) -> Vec<BlockId> {
            self.free.clone()
        }
    }

    type TestEngine = Engine<Whole, SimMemory, SimStreams>;

    /// A 1 GiB device limited to 512 MiB, collecting above 0.5 x 512 MiB.
    fn engine(min_age_ticks: u64) -> TestEngine {
        let settings = GcAgeSettings {
            threshold: 0.5,
            min_age_ticks,
        };
        let mut e = Engine::new(
            Whole::new(settings),
            SimMemory::new(GIB),
            SimStreams::new(),
            EngineOptions::default(),
        );
        e.set_memory_fraction(0.5).unwrap();
        e
    }

    #[test]
    fn settings_from_the_configuration() {
        let cfg = AllocatorConfig::parse("garbage_collection_threshold:0.6").unwrap();
        assert_eq!(GcAgeSettings::from(&cfg).threshold, 0.6);
        assert_eq!(
            GcAgeSettings::from(&AllocatorConfig::default()).threshold,
            0.8
        );
        let mut gc = GcAge::new(GcAgeSettings::default());
        gc.reconfigure(&cfg);
        assert_eq!(gc.settings().threshold, 0.6);
    }

    /// Frees `addr`, then ticks the large pool's clock by reusing a cached block.
    fn free_and_tick(e: &mut TestEngine, addr: u64, tick: &mut u64) {
        e.free(addr).unwrap();
        let t = e.malloc(2 * MIB, StreamId(0)).unwrap();
        *tick = t.addr;
    }

    #[test]
    fn oldest_idle_segment_goes_back_first() {
        let mut e = engine(0);
        let mut tick = e.malloc(2 * MIB, StreamId(0)).unwrap().addr;
        // 140 MiB freed first, then a larger 150 MiB: age wins over size.
        let a = e.malloc(140 * MIB, StreamId(0)).unwrap();
        let b = e.malloc(150 * MIB, StreamId(0)).unwrap();
        e.free(tick).unwrap();
        free_and_tick(&mut e, a.addr, &mut tick);
        e.free(tick).unwrap();
        free_and_tick(&mut e, b.addr, &mut tick);
        // 292 MiB reserved > 256 MiB: the first new segment releases `a` only.
        let c = e.malloc(100 * MIB, StreamId(0)).unwrap();
        assert_eq!(e.stats().num_device_free, 1);
        let now = e.snapshot().segment_addresses();
        assert!(!now.contains(&a.addr), "the oldest idle segment went back");
        assert!(now.contains(&b.addr) && now.contains(&c.addr));
        e.assert_valid();
        // Under the line: nothing more goes.
        e.free(c.addr).unwrap();
        e.malloc(4 * MIB, StreamId(0)).unwrap();
        assert_eq!(e.stats().num_device_free, 1);
        e.assert_valid();
    }

    #[test]
    fn equally_old_segments_go_larger_first_in_both_pools() {
        let mut e = engine(0);
        let a = e.malloc(100 * MIB, StreamId(0)).unwrap();
        let b = e.malloc(160 * MIB, StreamId(0)).unwrap();
        let s = e.malloc(1000, StreamId(0)).unwrap();
        e.free(a.addr).unwrap();
        e.free(b.addr).unwrap();
        e.free(s.addr).unwrap();
        // 262 MiB reserved: `b` alone brings it under 256 MiB.
        e.malloc(8 * MIB, StreamId(0)).unwrap();
        assert_eq!(e.stats().num_device_free, 1);
        let now = e.snapshot().segment_addresses();
        assert!(!now.contains(&b.addr) && now.contains(&a.addr) && now.contains(&s.addr));
        // Ten small-pool lookups age the small segment past `a`; over the
        // line again (112 MiB + 160 MiB), both go, the small one first.
        for _ in 0..10 {
            let x = e.malloc(1000, StreamId(1)).unwrap();
            e.free(x.addr).unwrap();
        }
        e.malloc(160 * MIB, StreamId(0)).unwrap();
        assert!(e.malloc(100 * MIB, StreamId(1)).is_ok());
        let now = e.snapshot().segment_addresses();
        assert!(!now.contains(&a.addr) && !now.contains(&s.addr));
        e.assert_valid();
    }

    /// A policy's own collector: records the reserved bytes it was shown,
    /// answers `segments`.
    struct Fixed {
        segments: Vec<SegmentId>,
        shown: Option<u64>,
    }

    impl Reclaim for Fixed {
        fn collect_garbage(&mut self, _heap: &Heap, pressure: &Pressure) -> Vec<SegmentId> {
            self.shown = Some(pressure.reserved);
            self.segments.clone()
        }
    }

    #[test]
    fn the_policy_collector_runs_after_on_what_is_left_each_segment_once() {
        let mut e = engine(0);
        let a = e.malloc(100 * MIB, StreamId(0)).unwrap();
        let b = e.malloc(60 * MIB, StreamId(0)).unwrap();
        e.free(a.addr).unwrap();
        e.free(b.addr).unwrap();
        let heap = e.heap();
        let segment = |addr| heap.block(heap.block_at(addr).unwrap()).segment;
        let (sa, sb) = (segment(a.addr), segment(b.addr));
        let mut gc = GcAge::new(GcAgeSettings {
            threshold: 0.5,
            min_age_ticks: 0,
        });
        // 160 MiB reserved over a line of 128 MiB: the larger of the two
        // equally old segments goes, leaving 60 MiB for the policy's own.
        let pressure = Pressure {
            reserved: 160 * MIB,
            limit: 256 * MIB,
            fraction_set: true,
            threshold: None,
        };
        let mut own = Fixed {
            segments: vec![sa, sb],
            shown: None,
        };
        assert_eq!(gc.collect_then(heap, &pressure, &mut own), vec![sa, sb]);
        assert_eq!(own.shown, Some(60 * MIB));
        assert_eq!(gc.collect_garbage(heap, &pressure), vec![sa]);
        // Under the line: only the policy's own choice.
        let calm = Pressure {
            reserved: 100 * MIB,
            ..pressure
        };
        own.segments = vec![sb];
        assert_eq!(gc.collect_then(heap, &calm, &mut own), vec![sb]);
        assert_eq!(own.shown, Some(100 * MIB));
    }

    #[test]
    fn minimum_age_keeps_recently_freed_segments() {
        let mut e = engine(1000);
        let a = e.malloc(200 * MIB, StreamId(0)).unwrap();
        e.free(a.addr).unwrap();
        e.malloc(100 * MIB, StreamId(0)).unwrap();
        // 200 MiB idle for 2 ticks only: kept although 300 MiB > 256 MiB.
        e.malloc(50 * MIB, StreamId(0)).unwrap();
        assert_eq!(e.stats().num_device_free, 0);
        e.assert_valid();
    }

    #[test]
    fn without_a_memory_fraction_the_limit_is_the_device() {
        let mut e = Engine::new(
            Whole::new(GcAgeSettings::default()),
            SimMemory::new(GIB),
            SimStreams::new(),
            EngineOptions::default(),
        );
        let a = e.malloc(500 * MIB, StreamId(0)).unwrap();
        e.free(a.addr).unwrap();
        e.malloc(300 * MIB, StreamId(0)).unwrap();
        // 800 MiB reserved, under 0.8 x 1 GiB: nothing goes.
        let b = e.malloc(20 * MIB, StreamId(0)).unwrap();
        assert_eq!(e.stats().num_device_free, 0);
        // 820 MiB reserved: the idle 500 MiB goes back.
        e.free(b.addr).unwrap();
        e.malloc(10 * MIB, StreamId(0)).unwrap();
        assert_eq!(e.stats().num_device_free, 1);
        assert!(!e.snapshot().segment_addresses().contains(&a.addr));
    }
}
