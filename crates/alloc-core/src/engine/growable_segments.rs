//! Growable segments and page recycling (expandable segments,
//! `unmap_free_pages`): the growable segment of each cache key and pool,
//! which of them may hold free mapped pages, which hold nothing, and how far
//! the range a policy keeps mapped may raise the reserved peak.
//!
//! This part decides what needs no device: which segment a request grows
//! and by how much, the pages of a new one, the pages to map under a block,
//! which free pages a walk takes (outside the policy's kept range, within
//! its growth allowance), when a busy segment parks and wakes, which empty
//! segment goes back. Its methods in `expandable.rs` drive the backends with
//! these answers, with what the engine lends them for the call (`Lent`).

use std::ops::Index;

use rustc_hash::FxHashMap;

use super::empty_segments::EmptySegments;
use super::free_page_index::FreePageIndex;
use super::growable::{growth, Growable, SegmentKey};
use super::lending::Lending;
use crate::heap::{BlockState, Heap};
use crate::page_layout::{PageLayout, RangePages};
use crate::policy::KeptKeys;
use crate::types::{BlockId, CacheKey, Pool, SegmentId, StreamId};

/// Keeping a planned range mapped may raise the reserved peak by at most
/// 1/100 of it over the allocator's life: enough for what outlives a step
/// above the plan (ResNet-50's input batch: +0.9%), and a bound when plans
/// that are followed for a while and then dropped keep pages from the
/// requests that vary around them (ViT with random batches: +4.3% before
/// the bound).
const KEPT_MAPPED_SHARE: u64 = 100;

/// The growable segments by (cache, pool), and what recycling their pages
/// needs to know (`E`: the stream backend's event).
#[derive(Debug)]
pub(super) struct GrowableSegments<E> {
    /// Growable segments by (cache, pool), when expandable segments are on.
    segments: FxHashMap<SegmentKey, Growable<E>>,
    /// The growable segments that may hold free mapped pages: what
    /// unmapping free pages visits, less those parked while their pages
    /// are busy.
    free_pages: FreePageIndex,
    /// The growable segments that hold nothing, given back beyond a few.
    empty: EmptySegments,
    /// Whether segments grow (asked for, and both the policy and the
    /// backend support it).
    expandable: bool,
    /// The backend's page granularity; 0 when it has no virtual memory.
    granularity: u64,
    /// Whether free pages are unmapped and their memory serves growth
    /// (`unmap_free_pages`).
    recycles: bool,
    /// The large pool's pages when recycling pages or in a sleep tag's pool.
    large_pages: PageLayout,
    /// Bytes by which the reserved peak rose while the policy kept free
    /// pages mapped ([`Reclaim::kept_mapped`](crate::Reclaim::kept_mapped)),
    /// at most a share of the peak.
    kept_growth: u64,
    /// Bytes freed in a segment after which a free ends its epoch with a
    /// mark (`idle_mark_mb`); `u64::MAX` when off.
    mark_every: u64,
    /// Whether another stream's idle free blocks serve large requests whose
    /// growth would pass the level (`lend_idle_blocks`).
    pub(super) lending: Lending,
}

impl<E> GrowableSegments<E> {
    /// None yet, on a backend of page `granularity` (0: no virtual memory);
    /// segments grow if `expandable` and the backend has virtual memory;
    /// free pages are unmapped if `recycles` (`unmap_free_pages`);
    /// `large_pages`: the large pool's pages then and in sleep tags' pools.
    pub(super) fn new(
        granularity: u64,
        expandable: bool,
        recycles: bool,
        large_pages: PageLayout,
    ) -> Self {
        GrowableSegments {
            segments: FxHashMap::default(),
            free_pages: FreePageIndex::default(),
            empty: EmptySegments::default(),
            expandable: expandable && granularity > 0,
            granularity,
            recycles,
            large_pages,
            kept_growth: 0,
            mark_every: u64::MAX,
            lending: Lending::default(),
        }
    }

    /// A free ends its segment's epoch with a mark once `bytes` were freed
    /// in it since the last one (`idle_mark_mb`; 0: never).
    pub(super) fn set_idle_mark(&mut self, bytes: u64) {
        self.mark_every = if bytes == 0 { u64::MAX } else { bytes };
    }

    /// Another stream's idle free blocks serve large requests whose growth
    /// would pass the level from now on if `on` (`lend_idle_blocks`).
    pub(super) fn set_lending(&mut self, on: bool) {
        self.lending = Lending::new(on);
    }

    /// Whether segments grow.
    #[inline]
    pub(super) fn expandable(&self) -> bool {
        self.expandable
    }

    /// Segments grow from now on if `expandable` (and the backend has
    /// virtual memory).
    pub(super) fn set_expandable(&mut self, expandable: bool) {
        self.expandable = expandable && self.granularity > 0;
    }

    /// The backend's page granularity; 0 when it has no virtual memory.
    #[inline]
    pub(super) fn granularity(&self) -> u64 {
        self.granularity
    }

    /// Whether free pages are unmapped and their memory serves growth
    /// (`unmap_free_pages`): the one question a malloc asks this part.
    #[inline(always)]
    pub(super) fn recycles_pages(&self) -> bool {
        self.recycles
    }

    /// The keys of every growable segment.
    pub(super) fn keys(&self) -> Vec<SegmentKey> {
        self.segments.keys().copied().collect()
    }

    /// The growable segment `key`, if there is one.
    pub(super) fn get(&self, key: &SegmentKey) -> Option<&Growable<E>> {
        self.segments.get(key)
    }

    /// The growable segment `key`, which must exist.
    pub(super) fn get_mut(&mut self, key: &SegmentKey) -> &mut Growable<E> {
        self.segments.get_mut(key).expect("growable segment")
    }

    /// The segments that may hold free mapped pages.
    pub(super) fn free_pages(&self) -> &FreePageIndex {
        &self.free_pages
    }

    /// The segments that may hold free mapped pages, to note, visit, park
    /// and wake them.
    pub(super) fn free_pages_mut(&mut self) -> &mut FreePageIndex {
        &mut self.free_pages
    }

    /// Wakes the parked segments a walk for a mapping on `stream` may get
    /// something from without waiting: its own, and those whose oldest
    /// mark `done` says completed (or that have none).
    pub(super) fn wake_for<X>(
        &mut self,
        stream: StreamId,
        mut done: impl FnMut(&E) -> Result<bool, X>,
    ) -> Result<(), X> {
        let segments = &self.segments;
        self.free_pages
            .wake_for(stream, |key| match segments[key].idle.oldest_mark() {
                Some(mark) => done(mark),
                None => Ok(true),
            })
    }

    /// The physical pages of a new growable segment of `pool`: the
    /// backend's granularity, or the configured large-pool pages (each at
    /// least a granule) when recycling pages or in a sleep tag's pool
    /// (`tagged`), where fewer, larger pages make pauses and resumes
    /// cheaper.
    pub(super) fn page_layout(&self, pool: Pool, tagged: bool) -> PageLayout {
        if (self.recycles || tagged) && pool == Pool::Large {
            self.large_pages.at_least(self.granularity)
        } else {
            PageLayout::uniform(self.granularity)
        }
    }

    /// Bytes to map at the end of the growable segment `key` of `pages` so
    /// that its free tail covers `size` bytes (PyTorch's steps), with the
    /// segment's mapped bytes and free tail as the heap has them.
    pub(super) fn growth(
        &self,
        heap: &Heap,
        key: &SegmentKey,
        pages: &PageLayout,
        size: u64,
    ) -> u64 {
        let (mapped, free_tail) = self.segments.get(key).map_or((0, 0), |g| {
            let seg = heap.segment(g.segment);
            let last = heap.block(seg.last);
            let tail = if last.state == BlockState::Free {
                last.size
            } else {
                0
            };
            (seg.size, tail)
        });
        growth(key.1, pages, self.granularity, mapped, size, free_tail)
    }

    /// The address range to reserve for a new growable segment of `pool`
    /// and `pages` on a device of `capacity` bytes: the device's size in
    /// whole growth steps and largest pages, no larger than `most` bytes
    /// and a step (a backend's value: no overflow).
    pub(super) fn new_range(
        &self,
        pool: Pool,
        pages: &PageLayout,
        capacity: u64,
        most: u64,
    ) -> u64 {
        let step = growth(pool, pages, self.granularity, 0, 1, 0);
        let capacity = capacity.min(most + step);
        (capacity.div_ceil(step) * step).next_multiple_of(pages.largest())
    }

    /// A new growable segment `g` for `key`, listed as holding free mapped
    /// pages.
    pub(super) fn add(&mut self, key: SegmentKey, g: Growable<E>) {
        self.segments.insert(key, g);
        self.free_pages.note(key);
    }

    /// The unmapped pages `[start, start + bytes)` of `key` were mapped (with
    /// memory the GPU may still use elsewhere if `reused_busy`): the segment
    /// is no longer empty.
    pub(super) fn pages_mapped(
        &mut self,
        key: &SegmentKey,
        start: u64,
        bytes: u64,
        reused_busy: bool,
    ) {
        self.get_mut(key).pages_mapped(start, bytes, reused_busy);
        self.empty.remove(key);
    }

    /// The mapped pages `[start, start + bytes)` of `key` were unmapped (or
    /// with `detached` handed to the next mapping), in the heap's record too.
    pub(super) fn pages_unmapped(
        &mut self,
        heap: &mut Heap,
        key: &SegmentKey,
        start: u64,
        bytes: u64,
        detached: bool,
    ) {
        let g = self.get_mut(key);
        g.pages_unmapped(start, bytes, detached);
        heap.pages_unmapped(g.segment, bytes);
    }

    /// Lists `key` as empty if its segment holds nothing: every page
    /// unmapped, no block in use, no private pool's.
    pub(super) fn note_if_empty(&mut self, heap: &Heap, key: &SegmentKey) {
        let seg = heap.segment(self.segments[key].segment);
        if seg.unmapped == seg.size && seg.is_idle() && seg.private_pool.is_none() {
            self.empty.note(*key);
        }
    }

    /// The free mapped pages of `key` that a walk may take, as runs in
    /// address order: none under `keep`, and none of the range `spared`
    /// gives for the segment's cache (the policy's kept range, while it
    /// stays mapped). `None` when there are none; a segment without any
    /// free mapped page (nor `keep`) leaves the index until a free or a
    /// mapping notes it again.
    pub(super) fn runs_to_take(
        &mut self,
        heap: &Heap,
        key: &SegmentKey,
        keep: Option<BlockId>,
        spared: impl FnOnce(CacheKey) -> Option<(u64, u64)>,
    ) -> Option<Vec<(u64, u64)>> {
        let g = &self.segments[key];
        let mut runs = g.free_mapped_runs(heap, keep);
        if runs.is_empty() && !Self::holds(heap, g, keep) {
            self.free_pages.forget(key);
            return None;
        }
        if let Some((lo, hi)) = spared(heap.segment(g.segment).key()) {
            let pages = g.pages();
            runs = outside(runs, (pages.floor(lo), pages.ceil(hi)));
        }
        (!runs.is_empty()).then_some(runs)
    }

    /// A walk for a mapping found every free page of `key` busy and none
    /// that can move: unless the segment holds `keep` or may still record a
    /// mark, walks skip it until its oldest mark completes, as nothing they
    /// do changes that before.
    pub(super) fn park_if_stuck(&mut self, heap: &Heap, key: SegmentKey, keep: Option<BlockId>) {
        let g = &self.segments[&key];
        if Self::holds(heap, g, keep) {
            return;
        }
        if let (false, Some(mark)) = (g.idle.wants_mark(), g.idle.oldest_mark_number()) {
            self.free_pages.park(key, mark);
        }
    }

    /// Whether the block `keep` lies in `g`'s segment.
    fn holds(heap: &Heap, g: &Growable<E>, keep: Option<BlockId>) -> bool {
        keep.is_some_and(|b| heap.block(b).segment == g.segment)
    }

    /// The pages to map under the free block `block` of the heap before it
    /// is handed out; `None` when its segment does not grow or has every
    /// page mapped.
    pub(super) fn runs_to_map(&self, heap: &Heap, block: BlockId) -> Option<RunsToMap> {
        if !heap.has_unmapped_pages(block) {
            return None;
        }
        let b = heap.block(block);
        let seg = heap.segment(b.segment);
        let key = (seg.key(), seg.pool);
        let g = &self.segments[&key];
        let span = g.covering(b.addr, b.size);
        Some(RunsToMap {
            key,
            segment: b.segment,
            span,
            pages: *g.pages(),
            runs: g.unmapped_runs(span.0, span.1),
        })
    }

    /// Whether the policy keeps part of a large-pool growable segment
    /// mapped ([`Reclaim::kept_mapped`](crate::Reclaim::kept_mapped)):
    /// `keys` are the caches it may answer for, `kept` its answer for one.
    pub(super) fn keeps_range(
        &self,
        heap: &Heap,
        keys: KeptKeys,
        kept: impl Fn(CacheKey) -> bool,
    ) -> bool {
        let kept = |key: &SegmentKey, g: &Growable<E>| {
            key.1 == Pool::Large && kept(heap.segment(g.segment).key())
        };
        match keys {
            KeptKeys::None => false,
            KeptKeys::One(cache) => {
                let key = (cache, Pool::Large);
                self.segments.get(&key).is_some_and(|g| kept(&key, g))
            }
            KeptKeys::Any => self.segments.iter().any(|(key, g)| kept(key, g)),
        }
    }

    /// Whether more segments are empty than may be kept.
    #[inline(always)]
    pub(super) fn too_many_empty(&self) -> bool {
        self.empty.too_many(self.segments.len())
    }

    /// The segment that became empty first, while more are empty than may
    /// be kept, if it still is one of ours and holds nothing (`releasable`
    /// says whether its cache may give memory back now): what to give back.
    /// `None` once few enough are left or the oldest is in use again.
    pub(super) fn next_to_forget(
        &mut self,
        heap: &Heap,
        mut releasable: impl FnMut(&CacheKey) -> bool,
    ) -> Option<Option<SegmentId>> {
        if !self.too_many_empty() {
            return None;
        }
        let key = self.empty.pop_oldest()?;
        let Some(g) = self.segments.get(&key) else {
            return Some(None);
        };
        let seg = heap.segment(g.segment);
        let empty = seg.unmapped == seg.size && seg.is_idle();
        let detached = g.idle.detached_runs().next().is_some();
        if !empty || detached || !releasable(&seg.key()) {
            return Some(None); // in use again, or not ours to give back now
        }
        Some(Some(g.segment))
    }

    /// Forgets the growable segment `key` (its segment is gone); returns it,
    /// so that the caller releases its marks.
    pub(super) fn remove(&mut self, key: &SegmentKey) -> Option<Growable<E>> {
        self.free_pages.forget(key);
        self.empty.remove(key);
        self.segments.remove(key)
    }

    /// How many bytes the policy's kept range may still raise the reserved
    /// peak `peak` by ([`KEPT_MAPPED_SHARE`]): past that, its free pages
    /// give way to a mapping too.
    pub(super) fn kept_allowance(&self, peak: u64) -> u64 {
        (peak / KEPT_MAPPED_SHARE).saturating_sub(self.kept_growth)
    }

    /// The kept range raised the reserved peak by `bytes`.
    pub(super) fn kept_grew(&mut self, bytes: u64) {
        self.kept_growth += bytes;
    }

    /// `unmap_free_pages`: stamps the pages under the block `id` of the
    /// heap, about to become free, with the current epoch, and lists its
    /// segment as holding free mapped pages. Returns the segment's key when
    /// its epoch is due to end with a mark ([`Self::set_idle_mark`]).
    #[inline]
    pub(super) fn freed(&mut self, heap: &Heap, id: BlockId) -> Option<SegmentKey> {
        let b = heap.block(id);
        let seg = heap.segment(b.segment);
        if !seg.expandable {
            return None;
        }
        let key = (seg.key(), seg.pool);
        let g = self.segments.get_mut(&key)?;
        let due = g.idle.freed(b.addr, b.addr + b.size, self.mark_every);
        self.free_pages.note(key);
        due.then_some(key)
    }

    /// Every growable segment's invariants ([`Growable::check`]; `paused`
    /// says whether its cache is paused), when recycling pages each one with
    /// free mapped pages listed for unmapping, and the empty ones listed as
    /// such.
    pub(super) fn check(
        &self,
        heap: &Heap,
        mut paused: impl FnMut(&CacheKey) -> bool,
    ) -> Result<(), String> {
        for (key, g) in &self.segments {
            g.check(heap, paused(&heap.segment(g.segment).key()))?;
            let unlisted = self.recycles_pages() && !self.free_pages.contains(key);
            if unlisted && !g.free_mapped_runs(heap, None).is_empty() {
                return Err(format!(
                    "segment {:#x} holds free mapped pages but is not listed for unmapping",
                    heap.segment(g.segment).addr
                ));
            }
            let seg = heap.segment(g.segment);
            let empty = seg.unmapped == seg.size && seg.is_idle() && seg.private_pool.is_none();
            if empty != self.empty.contains(key) {
                return Err(format!(
                    "segment {:#x} is empty: {empty}, listed as empty: {}",
                    seg.addr, !empty
                ));
            }
        }
        if self.empty.len() > self.segments.len() {
            return Err(format!(
                "{} empty segments listed, {} growable segments",
                self.empty.len(),
                self.segments.len()
            ));
        }
        Ok(())
    }
}

/// The pages to map under a block before it is handed out
/// ([`GrowableSegments::runs_to_map`]).
#[derive(Debug, PartialEq)]
pub(super) struct RunsToMap {
    /// The block's growable segment, by key.
    pub(super) key: SegmentKey,
    /// The block's segment in the heap.
    pub(super) segment: SegmentId,
    /// The whole pages the block touches, `[lo, hi)`.
    pub(super) span: (u64, u64),
    /// The segment's pages.
    pub(super) pages: RangePages,
    /// The unmapped runs `(start, bytes)` of `span`, in address order.
    pub(super) runs: Vec<(u64, u64)>,
}

impl RunsToMap {
    /// Bytes to map.
    pub(super) fn bytes(&self) -> u64 {
        self.runs.iter().map(|r| r.1).sum()
    }

    /// The size of the first page to map (0 when none is).
    pub(super) fn first_page(&self) -> u64 {
        self.runs.first().map_or(0, |r| self.pages.size_at(r.0))
    }
}

impl<E> Index<&SegmentKey> for GrowableSegments<E> {
    type Output = Growable<E>;

    /// The growable segment `key`, which must exist.
    fn index(&self, key: &SegmentKey) -> &Growable<E> {
        &self.segments[key]
    }
}

/// The parts of page runs `(start, bytes)` outside `[lo, hi)` (page
/// boundaries).
fn outside(runs: Vec<(u64, u64)>, (lo, hi): (u64, u64)) -> Vec<(u64, u64)> {
    let mut out = Vec::with_capacity(runs.len());
    for (start, bytes) in runs {
        let end = start + bytes;
        if end <= lo || start >= hi {
            out.push((start, bytes));
            continue;
        }
        out.extend((start < lo).then(|| (start, lo - start)));
        out.extend((end > hi).then(|| (hi, end - hi)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pytorch::LARGE_BUFFER;
    use crate::types::{GIB, MIB};

    const BASE: u64 = 0x1000_0000;
    const GRANULE: u64 = 2 * MIB;

    /// The large pool of stream 0's shared cache.
    fn key() -> SegmentKey {
        (CacheKey::shared(StreamId(0)), Pool::Large)
    }

    /// Page recycling on, with 8 MiB large pages on a 2 MiB device.
    fn recycling() -> GrowableSegments<u32> {
        GrowableSegments::new(GRANULE, true, true, PageLayout::uniform(8 * MIB))
    }

    /// A growable segment of `key()` of eight 2 MiB pages: [0, 4 MiB)
    /// allocated, [4, 14 MiB) free, [14, 16 MiB) allocated; its blocks.
    fn segment(segments: &mut GrowableSegments<u32>, heap: &mut Heap) -> [BlockId; 3] {
        let sizes = [(4 * MIB, true), (10 * MIB, false), (2 * MIB, true)];
        let (seg, blocks) = heap.add_cut_segment(BASE, key().0, &sizes);
        heap.set_expandable(seg);
        let pages = PageLayout::uniform(GRANULE);
        let g = Growable::new(seg, BASE, pages, GIB, 16 * MIB, false);
        segments.add(key(), g);
        [blocks[0], blocks[1], blocks[2]]
    }

    #[test]
    fn large_pages_serve_recycling_and_tagged_pools_only() {
        let large = PageLayout::uniform(8 * MIB);
        let plain = GrowableSegments::<u32>::new(GRANULE, true, false, large);
        let uniform = PageLayout::uniform(GRANULE);
        assert_eq!(plain.page_layout(Pool::Large, false), uniform);
        assert_eq!(plain.page_layout(Pool::Large, true), large);
        assert_eq!(recycling().page_layout(Pool::Large, false), large);
        assert_eq!(recycling().page_layout(Pool::Small, true), uniform);
        // Pages are never smaller than the device maps.
        let coarse = GrowableSegments::<u32>::new(16 * MIB, true, true, large);
        let pages = coarse.page_layout(Pool::Large, false);
        assert_eq!(pages, PageLayout::uniform(16 * MIB));
        assert!(recycling().recycles_pages() && !plain.recycles_pages());
    }

    #[test]
    fn segments_grow_only_with_virtual_memory() {
        let mut none = GrowableSegments::<u32>::new(0, true, false, PageLayout::uniform(MIB));
        assert!(!none.expandable());
        none.set_expandable(true);
        assert!(!none.expandable(), "no virtual memory: ordinary segments");
        let mut vm = GrowableSegments::<u32>::new(GRANULE, false, false, PageLayout::uniform(MIB));
        assert!(!vm.expandable());
        vm.set_expandable(true);
        assert!(vm.expandable());
    }

    #[test]
    fn growth_counts_the_free_tail_and_ranges_are_whole_steps() {
        let mut segments = GrowableSegments::new(GRANULE, true, false, PageLayout::uniform(MIB));
        let mut heap = Heap::new(u64::MAX);
        let pages = PageLayout::uniform(GRANULE);
        // No segment yet: one step covers 5 MiB.
        assert_eq!(
            segments.growth(&heap, &key(), &pages, 5 * MIB),
            LARGE_BUFFER
        );
        // The segment's tail is allocated: a whole step again, for 21 MiB two.
        segment(&mut segments, &mut heap);
        assert_eq!(
            segments.growth(&heap, &key(), &pages, 21 * MIB),
            2 * LARGE_BUFFER
        );
        let range = segments.new_range(Pool::Large, &pages, 100 * MIB, GIB);
        assert_eq!(range, 5 * LARGE_BUFFER, "the device in whole steps");
        let capped = segments.new_range(Pool::Large, &pages, 8 * GIB, GIB);
        assert_eq!(
            capped,
            GIB.div_ceil(LARGE_BUFFER) * LARGE_BUFFER + LARGE_BUFFER
        );
    }

    #[test]
    fn the_kept_range_may_raise_the_peak_by_a_hundredth() {
        let mut segments = recycling();
        let peak = 1000 * MIB;
        assert_eq!(segments.kept_allowance(peak), 10 * MIB);
        segments.kept_grew(4 * MIB);
        assert_eq!(segments.kept_allowance(peak), 6 * MIB);
        segments.kept_grew(6 * MIB);
        assert_eq!(segments.kept_allowance(peak), 0);
        assert_eq!(
            segments.kept_allowance(2 * peak),
            10 * MIB,
            "a share of the peak"
        );
    }

    #[test]
    fn walks_take_free_pages_outside_the_kept_block_and_range() {
        let mut segments = recycling();
        let mut heap = Heap::new(u64::MAX);
        let [_, free, _] = segment(&mut segments, &mut heap);
        let whole = segments.runs_to_take(&heap, &key(), None, |_| None);
        assert_eq!(whole, Some(vec![(BASE + 4 * MIB, 10 * MIB)]));
        // The policy keeps [6, 9 MiB) mapped: whole pages [6, 10 MiB) stay.
        let kept = |_| Some((BASE + 6 * MIB, BASE + 9 * MIB));
        let spared = segments.runs_to_take(&heap, &key(), None, kept);
        let runs = vec![(BASE + 4 * MIB, 2 * MIB), (BASE + 10 * MIB, 4 * MIB)];
        assert_eq!(spared, Some(runs));
        // The block being mapped keeps its pages: none left, yet the
        // segment stays listed (it holds that block).
        assert_eq!(
            segments.runs_to_take(&heap, &key(), Some(free), |_| None),
            None
        );
        assert!(segments.free_pages().contains(&key()));
        // No free page at all: the segment leaves the index until noted.
        heap.set_state(free, BlockState::Allocated, 10 * MIB);
        assert_eq!(segments.runs_to_take(&heap, &key(), None, |_| None), None);
        assert!(!segments.free_pages().contains(&key()));
        heap.set_state(free, BlockState::Free, 0);
        segments.freed(&heap, free);
        assert!(
            segments.free_pages().contains(&key()),
            "a free notes it again"
        );
    }

    #[test]
    fn busy_segments_park_until_their_oldest_mark_unless_they_hold_the_block() {
        let mut segments = recycling();
        let mut heap = Heap::new(u64::MAX);
        let [_, free, _] = segment(&mut segments, &mut heap);
        // A mark may still be recorded: the next walk ends an epoch.
        segments.get_mut(&key()).idle.end_epoch(7, 1);
        segments.park_if_stuck(&heap, key(), None);
        assert_eq!(segments.free_pages().parked(), 0);
        let mut number = 1;
        while segments[&key()].idle.wants_mark() {
            number += 1;
            segments.get_mut(&key()).idle.end_epoch(8, number);
        }
        segments.park_if_stuck(&heap, key(), Some(free));
        assert_eq!(segments.free_pages().parked(), 0, "it holds the block");
        segments.park_if_stuck(&heap, key(), None);
        assert_eq!(segments.free_pages().parked(), 1);
        // Its mark completed: a walk for its stream wakes it.
        let woken = segments.wake_for(StreamId(1), |&mark| Ok::<_, ()>(mark == 7));
        assert_eq!(woken, Ok(()));
        assert_eq!(segments.free_pages().parked(), 0);
    }

    #[test]
    fn empty_segments_are_listed_and_checked() {
        let mut segments = recycling();
        let mut heap = Heap::new(u64::MAX);
        let blocks = segment(&mut segments, &mut heap);
        assert_eq!(segments.check(&heap, |_| false), Ok(()));
        for b in [blocks[0], blocks[2]] {
            heap.set_state(b, BlockState::Free, 0);
        }
        heap.merge_next(blocks[0]);
        heap.merge_next(blocks[0]);
        assert_eq!(heap.block(blocks[0]).size, 16 * MIB);
        segments.pages_unmapped(&mut heap, &key(), BASE, 16 * MIB, false);
        let unlisted = segments.check(&heap, |_| false);
        assert!(unlisted.is_err_and(|e| e.contains("is empty: true")));
        segments.note_if_empty(&heap, &key());
        assert_eq!(segments.check(&heap, |_| false), Ok(()));
        // One empty segment is within what is kept: nothing to give back.
        assert!(!segments.too_many_empty());
        let releasable = |_: &CacheKey| true;
        assert_eq!(segments.next_to_forget(&heap, releasable), None);
        // Mapped again, it is no longer empty; removed, it is gone.
        segments.pages_mapped(&key(), BASE, 2 * MIB, false);
        heap.pages_mapped(segments[&key()].segment, 2 * MIB);
        assert_eq!(segments.check(&heap, |_| false), Ok(()));
        assert!(segments.remove(&key()).is_some());
        assert!(segments.get(&key()).is_none() && segments.keys().is_empty());
    }

    #[test]
    fn a_block_maps_the_unmapped_pages_it_touches() {
        let mut segments = recycling();
        let mut heap = Heap::new(u64::MAX);
        let [a, free, _] = segment(&mut segments, &mut heap);
        assert_eq!(segments.runs_to_map(&heap, free), None, "all mapped");
        // [6, 10 MiB) unmapped: the free block [4, 14 MiB) maps them back.
        segments.pages_unmapped(&mut heap, &key(), BASE + 6 * MIB, 4 * MIB, false);
        let plan = segments.runs_to_map(&heap, free).expect("pages to map");
        assert_eq!(plan.span, (BASE + 4 * MIB, BASE + 14 * MIB));
        assert_eq!(plan.runs, vec![(BASE + 6 * MIB, 4 * MIB)]);
        assert_eq!((plan.bytes(), plan.first_page()), (4 * MIB, GRANULE));
        // The allocated block [0, 4 MiB) lies on mapped pages.
        let none = segments.runs_to_map(&heap, a).expect("a growable segment");
        assert!(none.runs.is_empty() && none.bytes() == 0 && none.first_page() == 0);
    }

    #[test]
    fn only_the_large_pool_keeps_a_range_and_for_the_keys_asked() {
        let mut segments = recycling();
        let mut heap = Heap::new(u64::MAX);
        segment(&mut segments, &mut heap);
        let cache = key().0;
        assert!(!segments.keeps_range(&heap, KeptKeys::None, |_| true));
        assert!(segments.keeps_range(&heap, KeptKeys::Any, |_| true));
        assert!(!segments.keeps_range(&heap, KeptKeys::Any, |_| false));
        assert!(segments.keeps_range(&heap, KeptKeys::One(cache), |c| c == cache));
        let other = CacheKey::shared(StreamId(3));
        assert!(!segments.keeps_range(&heap, KeptKeys::One(other), |_| true));
        // A small-pool segment keeps nothing.
        let mut small = recycling();
        let (seg, _) = heap.add_cut_segment(BASE + GIB, cache, &[(2 * MIB, false)]);
        let g = Growable::new(
            seg,
            BASE + GIB,
            PageLayout::uniform(GRANULE),
            GIB,
            2 * MIB,
            false,
        );
        small.add((cache, Pool::Small), g);
        assert!(!small.keeps_range(&heap, KeptKeys::Any, |_| true));
    }

    #[test]
    fn runs_are_cut_to_what_lies_outside_the_kept_range() {
        let runs = vec![(0, 4), (8, 8), (20, 4), (30, 2)];
        assert_eq!(
            outside(runs, (10, 22)),
            vec![(0, 4), (8, 2), (22, 2), (30, 2)]
        );
        assert_eq!(outside(vec![(0, 8)], (0, 8)), vec![]);
        assert_eq!(outside(vec![(4, 4)], (0, 2)), vec![(4, 4)]);
    }
}
