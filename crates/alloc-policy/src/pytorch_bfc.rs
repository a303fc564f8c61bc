//! PyTorch 2.x's default policy (`c10/cuda/CUDACachingAllocator.cpp`): best
//! fit with coalescing over per-pool free sets ordered by (stream, size,
//! address), 512-byte rounding with optional power-of-two divisions, small and
//! large pools, PyTorch's segment sizes and split thresholds,
//! `max_split_size_mb` oversize handling, and garbage collection by age.

use crate::free_index::{Entry, FreeIndex};
use crate::layout_plan::{LayoutPlan, PlanStats};
use alloc_core::config::{AllocatorConfig, BfcConfig, ROUNDUP_INTERVALS};
use alloc_core::pytorch::{
    LARGE_BUFFER, MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE,
};
use alloc_core::{
    coalesce, Audit, BlockId, CacheKey, Capabilities, ConfigError, Heap, KeptKeys, OomRelease,
    Policy, Pool, Pressure, Reclaim, Request, SegmentId,
};

/// Settings of the PyTorch policy, from the allocator configuration.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct BfcSettings {
    /// `max_split_size_mb` in bytes (`u64::MAX` = unlimited).
    pub max_split_size: u64,
    /// `max_non_split_rounding_mb` in bytes.
    pub max_non_split_rounding: u64,
    /// `roundup_power2_divisions` per interval.
    pub divisions: [u32; ROUNDUP_INTERVALS],
    /// `expandable_segments`: split any remainder of at least 512 bytes, in
    /// both pools, since growable segments are not rounded to 20 MiB.
    pub expandable: bool,
    /// `plan_layout`: follow a layout learned from the repeating steps
    /// ([`crate::layout_plan`]).
    pub plan_layout: bool,
    /// `first_fit_mb`: requests of at least this many bytes take the free
    /// block of lowest address that fits (`u64::MAX` when off).
    pub first_fit_from: u64,
}

impl Default for BfcSettings {
    fn default() -> Self {
        Self::from(&AllocatorConfig::default())
    }
}

impl From<&AllocatorConfig> for BfcSettings {
    /// The flat view's options, as [`BfcSettings::new`] takes them.
    fn from(cfg: &AllocatorConfig) -> Self {
        BfcSettings::new(&cfg.bfc(), cfg.expandable_segments)
    }
}

impl BfcSettings {
    /// The policy's settings from its configuration, and whether segments
    /// grow (`expandable_segments`, an engine option this policy places
    /// blocks by).
    pub fn new(cfg: &BfcConfig, expandable: bool) -> Self {
        BfcSettings {
            max_split_size: cfg.max_split_size,
            max_non_split_rounding: cfg.max_non_split_rounding,
            divisions: cfg.roundup_power2_divisions,
            expandable,
            plan_layout: cfg.plan_layout,
            first_fit_from: cfg.first_fit.unwrap_or(u64::MAX),
        }
    }

    /// PyTorch's `round_size`.
    pub fn round_size(&self, size: u64) -> u64 {
        if size < MIN_BLOCK_SIZE {
            return MIN_BLOCK_SIZE;
        }
        let log = 63 - size.leading_zeros() as usize;
        let divisions = self.divisions[log.saturating_sub(20).min(ROUNDUP_INTERVALS - 1)] as u64;
        if divisions > 1 && size > MIN_BLOCK_SIZE * divisions {
            round_to_power2_division(size, divisions)
        } else {
            round_to_block(size)
        }
    }

    /// Whether any interval has divisions, that is whether
    /// [`BfcSettings::round_size`] may differ from [`round_to_block`].
    fn divides(&self) -> bool {
        self.divisions.iter().any(|&d| d > 1)
    }
}

/// `round_size` without divisions: a multiple of 512 bytes, at least 512.
#[inline]
fn round_to_block(size: u64) -> u64 {
    size.max(MIN_BLOCK_SIZE).div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
}

/// Rounds `size` up to the next of `divisions` equal steps between the powers
/// of two around it (PyTorch's `roundup_power2_next_division`).
fn round_to_power2_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor >> divisions.trailing_zeros();
    if step == 0 {
        return floor << 1;
    }
    let down = size & !(step - 1);
    if down == size {
        size
    } else {
        down + step
    }
}

/// PyTorch's segment size for a rounded request (`get_allocation_size`).
pub fn allocation_size(size: u64) -> u64 {
    if size <= SMALL_SIZE {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        size.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

/// Whether the free block `e` may serve `req`: no oversize block for a
/// small request, nor one much larger than an oversize request.
#[inline(always)]
fn accepts(settings: &BfcSettings, req: &Request, e: &Entry) -> bool {
    let max_split = settings.max_split_size;
    if req.size < max_split {
        e.size < max_split
    } else {
        e.size < req.size.saturating_add(settings.max_non_split_rounding)
    }
}

/// Removes a block from the free index of its pool.
fn unindex(free: &mut [FreeIndex; 2], heap: &Heap, id: BlockId) {
    let b = heap.block(id);
    free[b.pool.index()].discard_block(b.key(), id);
}

/// Adds a block to the free index of its pool.
fn index(free: &mut [FreeIndex; 2], heap: &Heap, id: BlockId) {
    let b = heap.block(id);
    free[b.pool.index()].insert(b.key(), b.size, b.addr, id);
}

/// Whether `id` is the last block of a growable segment: with expandable
/// segments its size can grow by the unmapped rest of the segment's range.
fn is_growable_tail(heap: &Heap, id: BlockId) -> bool {
    let b = heap.block(id);
    b.next.is_none() && heap.segment(b.segment).expandable
}

/// PyTorch's best fit with expandable segments counts the free tail of a
/// growable segment as its size plus the unmapped rest, so any other free
/// block that fits is preferred to it, and the tail is kept for growth.
/// `tail` is the best fit by size; takes the next block instead if there is
/// one (checked by `accept`, as PyTorch checks the block it settles on).
fn take_sparing_tail(
    free: &mut FreeIndex,
    req: &Request,
    tail: Entry,
    accept: impl Fn(&Entry) -> bool,
) -> Option<BlockId> {
    let removed = free.remove_block(req.key, tail.id);
    debug_assert!(removed.is_some(), "the tail was indexed");
    let next = free.take_lower_bound(req.key, req.size, &accept);
    let has_next = next.is_some() || free.lower_bound(req.key, req.size).is_some();
    if has_next {
        free.insert(req.key, tail.size, tail.addr, tail.id);
        return next.map(|e| e.id);
    }
    if accept(&tail) {
        Some(tail.id)
    } else {
        free.insert(req.key, tail.size, tail.addr, tail.id);
        None
    }
}

/// PyTorch's best fit with coalescing.
#[derive(Debug, Clone, Default)]
pub struct PytorchBfc {
    settings: BfcSettings,
    /// `settings.divides()`, kept so that a malloc without
    /// `roundup_power2_divisions` (the default) skips the lookup by size.
    divides: bool,
    /// Free blocks per pool, ordered as PyTorch's `BlockComparatorSize`.
    free: [FreeIndex; 2],
    /// With `plan_layout`: the layout learned from the repeating steps.
    plan: Option<Box<LayoutPlan>>,
}

impl PytorchBfc {
    /// A policy with the given settings.
    pub fn new(settings: BfcSettings) -> Self {
        PytorchBfc {
            plan: settings.plan_layout.then(Box::default),
            divides: settings.divides(),
            settings,
            free: Default::default(),
        }
    }

    /// What `plan_layout` did so far (`None` when it is off).
    pub fn plan_stats(&self) -> Option<PlanStats> {
        self.plan.as_ref().map(|p| p.stats())
    }

    /// The settings in use.
    pub fn settings(&self) -> &BfcSettings {
        &self.settings
    }

    /// Cache keys with free-block bins, both pools counted: the keys with
    /// free blocks, and those that had some since the last pruning.
    pub fn key_entries(&self) -> usize {
        self.free.iter().map(FreeIndex::key_entries).sum()
    }

    fn should_split(&self, pool: Pool, block_size: u64, size: u64) -> bool {
        let remaining = block_size - size;
        if pool == Pool::Small || self.settings.expandable {
            remaining >= MIN_BLOCK_SIZE
        } else {
            size < self.settings.max_split_size && remaining > SMALL_SIZE
        }
    }

    /// PyTorch's carve: the block's front, the rest indexed if worth a block.
    #[inline]
    fn carve_front(&mut self, heap: &mut Heap, block: BlockId, req: &Request) -> BlockId {
        if self.should_split(req.pool, heap.block(block).size, req.size) {
            let rest = heap.split(block, req.size);
            index(&mut self.free, heap, rest);
        }
        block
    }

    /// The best fit for `req` that [`accepts`], taken out of the index.
    #[inline(always)]
    fn take_best_fit(&mut self, req: &Request) -> Option<BlockId> {
        // The settings by reference, not copied into the closure: copied
        // before the search, they were more values kept across its loops.
        let settings = &self.settings;
        self.free[req.pool.index()]
            .take_lower_bound(req.key, req.size, |e| accepts(settings, req, e))
            .map(|e| e.id)
    }

    /// [`Policy::insert_free`] with a plan, which hears of the free
    /// before and after it.
    #[cold]
    #[inline(never)]
    fn insert_free_planned(&mut self, heap: &mut Heap, block: BlockId) {
        if let Some(plan) = self.plan.as_deref_mut() {
            plan.freeing(block);
        }
        let survivor = self.coalesce_and_index(heap, block);
        if let Some(plan) = self.plan.as_deref_mut() {
            plan.freed(heap, survivor);
        }
    }

    /// Merges a freed block with its free neighbours and indexes the
    /// result; returns it.
    #[inline(always)]
    fn coalesce_and_index(&mut self, heap: &mut Heap, block: BlockId) -> BlockId {
        let free = &mut self.free;
        let survivor = coalesce(heap, block, |h, n| unindex(free, h, n));
        index(&mut self.free, heap, survivor);
        survivor
    }

    /// Whether blocks are taken by
    /// [`PytorchBfc::take_free_planned_or_growable`]: with `plan_layout` or
    /// expandable segments.
    #[inline(always)]
    fn planned_or_growable(&self) -> bool {
        self.plan.is_some() || self.settings.expandable
    }

    /// [`Policy::take_free`] with `plan_layout` or expandable segments.
    // Out of line: inlined, its calls and their results in memory enlarged
    // the stack frame of every malloc's search.
    #[inline(never)]
    fn take_free_planned_or_growable(&mut self, heap: &Heap, req: &Request) -> Option<BlockId> {
        if let Some(plan) = self.plan.as_deref_mut() {
            let planned = plan.take(heap, &mut self.free[req.pool.index()], req);
            if planned.is_some() {
                return planned;
            }
        }
        if self.settings.expandable {
            let settings = &self.settings;
            let free = &mut self.free[req.pool.index()];
            let accept = |e: &Entry| accepts(settings, req, e);
            // `first_fit_mb`: the growable tail, its segment's highest
            // block, is taken only when nothing below it fits.
            if req.size >= settings.first_fit_from {
                return free
                    .take_lowest_fit(req.key, req.size, accept)
                    .map(|e| e.id);
            }
            // One search: the best fit is taken unless it is a growable
            // tail, which is then spared if another block fits.
            let mut tail = None;
            let taken = free.take_lower_bound(req.key, req.size, |e| {
                if is_growable_tail(heap, e.id) {
                    tail = Some(*e);
                    return false;
                }
                accept(e)
            });
            return match tail {
                Some(best) => take_sparing_tail(free, req, best, accept),
                None => taken.map(|e| e.id),
            };
        }
        self.take_best_fit(req)
    }

    /// [`Policy::carve`] with `plan_layout`: at the planned address, else at
    /// the front; the plan learns what was carved.
    // Out of line with the request by value: see `take_free`.
    #[inline(never)]
    fn carve_planned(&mut self, heap: &mut Heap, block: BlockId, req: Request) -> BlockId {
        let req = &req;
        let Some(plan) = self.plan.as_deref_mut() else {
            return self.carve_front(heap, block, req);
        };
        let piece = match plan.carve(heap, &mut self.free[req.pool.index()], block, req) {
            Some(piece) => piece,
            None => self.carve_front(heap, block, req),
        };
        if let Some(plan) = self.plan.as_deref_mut() {
            plan.carved(heap, piece, req);
        }
        piece
    }

    /// Smallest free block of `stream` in `pool` with size >= `size`.
    #[inline]
    fn lower_bound(&self, pool: Pool, stream: CacheKey, size: u64) -> Option<Entry> {
        self.free[pool.index()].lower_bound(stream, size)
    }
}

impl Policy for PytorchBfc {
    fn name(&self) -> &str {
        "pytorch-bfc"
    }

    /// Every setting may change at run time, as in PyTorch, whose allocator
    /// reads its configuration at each decision.
    fn reconfigure(&mut self, cfg: &AllocatorConfig) -> Result<(), ConfigError> {
        self.settings = BfcSettings::from(cfg);
        self.divides = self.settings.divides();
        if self.settings.plan_layout != self.plan.is_some() {
            self.plan = self.settings.plan_layout.then(Box::default);
        }
        Ok(())
    }

    fn round_request(&self, requested: u64, key: CacheKey) -> Request {
        let size = if self.divides {
            self.settings.round_size(requested)
        } else {
            round_to_block(requested)
        };
        Request::new(requested, size, key, SMALL_SIZE)
    }

    fn segment_size(&self, req: &Request) -> u64 {
        allocation_size(req.size)
    }

    // take_free, carve and insert_free run on every malloc and free: inlined
    // into the engine through AnyPolicy, they save a call and its spills.
    #[inline]
    fn take_free(&mut self, heap: &Heap, req: &Request) -> Option<BlockId> {
        if self.planned_or_growable() {
            // A copy's address, not the caller's request's: passed by
            // reference, its address escaped and every malloc stored it to
            // the stack.
            return self.take_free_planned_or_growable(heap, &{ *req });
        }
        self.take_best_fit(req)
    }

    #[inline]
    fn carve(&mut self, heap: &mut Heap, block: BlockId, req: &Request) -> BlockId {
        if self.plan.is_some() {
            // A copy, as in `take_free`.
            return self.carve_planned(heap, block, *req);
        }
        self.carve_front(heap, block, req)
    }

    // The plan tested once: without one, a free coalesces and indexes
    // only.
    #[inline]
    fn insert_free(&mut self, heap: &mut Heap, block: BlockId) {
        if self.plan.is_some() {
            return self.insert_free_planned(heap, block);
        }
        self.coalesce_and_index(heap, block);
    }

    fn remove_free(&mut self, heap: &Heap, block: BlockId) {
        unindex(&mut self.free, heap, block);
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            coalesces: true,
            rebuilds_layouts: true,
            supports_growth: true,
            oversize_threshold: self.settings.max_split_size,
        }
    }
}

impl Reclaim for PytorchBfc {
    /// PyTorch's `release_available_cached_blocks`: free the smallest
    /// oversize block that covers the request, else the largest oversize
    /// blocks of the stream until their sizes add up to it.
    fn release_for_oom(&mut self, heap: &Heap, req: &Request) -> OomRelease {
        let max_split = self.settings.max_split_size;
        if max_split == u64::MAX {
            return OomRelease::default();
        }
        let target = req.size.max(max_split);
        let whole = |e: &Entry| heap.segment(heap.block(e.id).segment).blocks == 1;
        if let Some(e) = self.lower_bound(req.pool, req.key, target) {
            if whole(&e) {
                return OomRelease {
                    segments: vec![heap.block(e.id).segment],
                    sufficient: true,
                };
            }
        }
        let mut released = 0;
        let mut segments = Vec::new();
        for e in self.free[req.pool.index()].below_descending(req.key, target) {
            if released >= target || e.size < max_split {
                break;
            }
            if whole(&e) {
                released += e.size;
                segments.push(heap.block(e.id).segment);
            }
        }
        OomRelease {
            sufficient: released >= target,
            segments,
        }
    }

    /// PyTorch's `garbage_collect_cached_blocks`: with a memory fraction and a
    /// threshold set, once reserved memory passes threshold x limit, release
    /// unsplit large-pool blocks at least as old as the average, repeatedly,
    /// until enough is reclaimed.
    fn collect_garbage(&mut self, heap: &Heap, pressure: &Pressure) -> Vec<SegmentId> {
        let Some(threshold) = pressure.threshold.filter(|_| pressure.fraction_set) else {
            return Vec::new();
        };
        let gc_threshold = (threshold * pressure.limit as f64) as u64;
        if pressure.reserved <= gc_threshold {
            return Vec::new();
        }
        let target = pressure.reserved - gc_threshold;
        let now = heap.clock(Pool::Large);
        let mut candidates: Vec<(BlockId, u64, u64)> = self.free[Pool::Large.index()]
            .iter()
            .filter(|(_, e)| heap.segment(heap.block(e.id).segment).blocks == 1)
            .map(|(_, e)| (e.id, e.size, now - heap.block(e.id).freed_at))
            .collect();
        let mut total_age: u64 = candidates.iter().map(|c| c.2).sum();
        let mut reclaimed = 0;
        let mut released = Vec::new();
        while reclaimed < target && !candidates.is_empty() {
            let threshold_age = total_age as f64 / candidates.len() as f64;
            let before = candidates.len();
            candidates.retain(|&(id, size, age)| {
                if age as f64 >= threshold_age {
                    reclaimed += size;
                    total_age -= age;
                    released.push(heap.block(id).segment);
                    false
                } else {
                    true
                }
            });
            if candidates.len() == before {
                break;
            }
        }
        released
    }

    fn kept_mapped(&self, key: CacheKey) -> Option<(u64, u64)> {
        self.plan.as_ref()?.kept_mapped(key)
    }

    fn kept_mapped_keys(&self) -> KeptKeys {
        match self.plan.as_ref().and_then(|p| p.planned_key()) {
            Some(key) => KeptKeys::One(key),
            None => KeptKeys::None,
        }
    }

    fn forget_empty_keys(&mut self) {
        for free in &mut self.free {
            free.forget_empty_keys();
        }
    }
}

impl Audit for PytorchBfc {
    fn indexed_blocks(&self) -> Vec<BlockId> {
        self.free
            .iter()
            .flat_map(|f| f.iter().map(|(_, e)| e.id))
            .collect()
    }

    fn check(&self, heap: &Heap) -> Result<(), String> {
        for (pool, free) in [Pool::Small, Pool::Large].iter().zip(&self.free) {
            for (stream, e) in free.iter() {
                let b = heap.block(e.id);
                if (b.key(), b.size, b.addr, b.pool) != (stream, e.size, e.addr, *pool) {
                    return Err(format!("stale free-index entry for block at {:#x}", e.addr));
                }
            }
        }
        match &self.plan {
            Some(plan) => plan.check(&self.free[Pool::Large.index()]),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc_core::MIB;

    #[test]
    fn rounding_matches_pytorch() {
        let s = BfcSettings::default();
        assert_eq!(s.round_size(1), 512);
        assert_eq!(s.round_size(512), 512);
        assert_eq!(s.round_size(513), 1024);
        assert_eq!(s.round_size(3 * MIB + 1), 3 * MIB + 512);
        let cfg = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
        let s = BfcSettings::from(&cfg);
        // 1200 B: below 512 x 4, plain rounding.
        assert_eq!(s.round_size(1200), 1536);
        // 5 MiB + 1: floor 4 MiB, step 1 MiB -> 6 MiB.
        assert_eq!(s.round_size(5 * MIB + 1), 6 * MIB);
        assert_eq!(s.round_size(8 * MIB), 8 * MIB);
        assert_eq!(s.round_size(6 * MIB), 6 * MIB);
    }

    #[test]
    fn plain_rounding_is_round_size_without_divisions() {
        let plain = BfcSettings::default();
        assert!(!plain.divides());
        let cfg = AllocatorConfig::parse("roundup_power2_divisions:[256:1,>:1]").unwrap();
        assert!(!BfcSettings::from(&cfg).divides());
        let cfg = AllocatorConfig::parse("roundup_power2_divisions:[256:1,>:2]").unwrap();
        assert!(BfcSettings::from(&cfg).divides());
        for size in (1..4096).chain([MIB - 1, MIB, MIB + 1, 3 * MIB + 1, 1 << 40]) {
            assert_eq!(round_to_block(size), plain.round_size(size), "{size}");
        }
    }

    #[test]
    fn segment_sizes_match_pytorch() {
        assert_eq!(allocation_size(512), 2 * MIB);
        assert_eq!(allocation_size(MIB), 2 * MIB);
        assert_eq!(allocation_size(MIB + 512), 20 * MIB);
        assert_eq!(allocation_size(10 * MIB - 512), 20 * MIB);
        assert_eq!(allocation_size(10 * MIB), 10 * MIB);
        assert_eq!(allocation_size(11 * MIB + 1), 12 * MIB);
    }

    #[test]
    fn split_thresholds() {
        let p = PytorchBfc::default();
        assert!(p.should_split(Pool::Small, 2 * MIB, 2 * MIB - 512));
        assert!(!p.should_split(Pool::Small, 1024, 1024));
        assert!(!p.should_split(Pool::Large, 20 * MIB, 19 * MIB));
        assert!(p.should_split(Pool::Large, 20 * MIB, 19 * MIB - 512));
        let p = PytorchBfc::new(BfcSettings::from(
            &AllocatorConfig::parse("max_split_size_mb:64").unwrap(),
        ));
        assert!(!p.should_split(Pool::Large, 200 * MIB, 64 * MIB));
        assert!(p.should_split(Pool::Large, 200 * MIB, 63 * MIB));
    }
}
