//! Growable segments and page recycling (expandable segments,
//! `unmap_free_pages`): the growable segment of each cache key and pool,
//! which of them may hold free mapped pages, which hold nothing, and how far
//! the range a policy keeps mapped may raise the reserved peak.
//!
//! This part decides what needs no device: which segment a request grows
//! and by how much, the pages of a new one, the growth allowance of the kept
//! range, which segments are empty. The engine's `expandable.rs` drives the
//! backends with its answers, handing it the heap where a record changes.

use std::ops::Index;

use rustc_hash::FxHashMap;

use super::empty_segments::EmptySegments;
use super::free_page_index::FreePageIndex;
use super::growable::{growth, Growable, SegmentKey};
use crate::heap::{BlockState, Heap};
use crate::page_layout::PageLayout;
use crate::types::{BlockId, PoolKind};

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
        }
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

    /// Every growable segment, by key.
    pub(super) fn iter(&self) -> impl Iterator<Item = (&SegmentKey, &Growable<E>)> {
        self.segments.iter()
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
        stream: crate::types::StreamId,
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
    pub(super) fn page_layout(&self, pool: PoolKind, tagged: bool) -> PageLayout {
        if (self.recycles || tagged) && pool == PoolKind::Large {
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
        pool: PoolKind,
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
        mut releasable: impl FnMut(&crate::types::CacheKey) -> bool,
    ) -> Option<Option<crate::types::SegmentId>> {
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

    /// Of a `deficit` of bytes past the reserved peak `peak` that the
    /// policy's kept range would cause, how many it may still raise the peak
    /// by ([`KEPT_MAPPED_SHARE`]); the rest its free pages give up.
    pub(super) fn kept_allowance(&self, peak: u64) -> u64 {
        (peak / KEPT_MAPPED_SHARE).saturating_sub(self.kept_growth)
    }

    /// The kept range raised the reserved peak by `bytes`.
    pub(super) fn kept_grew(&mut self, bytes: u64) {
        self.kept_growth += bytes;
    }

    /// `unmap_free_pages`: stamps the pages under the block `id` of the
    /// heap, about to become free, with the current epoch, and lists its
    /// segment as holding free mapped pages.
    pub(super) fn freed(&mut self, heap: &Heap, id: BlockId) {
        let b = heap.block(id);
        let seg = heap.segment(b.segment);
        if !seg.expandable {
            return;
        }
        let key = (seg.key(), seg.pool);
        if let Some(g) = self.segments.get_mut(&key) {
            g.idle.freed(b.addr, b.addr + b.size);
            self.free_pages.note(key);
        }
    }

    /// Every growable segment's invariants ([`Growable::check`]; `paused`
    /// says whether its cache is paused), when recycling pages each one with
    /// free mapped pages listed for unmapping, and the empty ones listed as
    /// such.
    pub(super) fn check(
        &self,
        heap: &Heap,
        mut paused: impl FnMut(&crate::types::CacheKey) -> bool,
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

impl<E> Index<&SegmentKey> for GrowableSegments<E> {
    type Output = Growable<E>;

    /// The growable segment `key`, which must exist.
    fn index(&self, key: &SegmentKey) -> &Growable<E> {
        &self.segments[key]
    }
}
