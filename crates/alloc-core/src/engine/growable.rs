//! A growable segment (expandable segments): one per cache key and pool, an
//! address range reserved the size of the device whose mapped prefix its
//! blocks tile, mapped in whole pages, with holes of unmapped pages under
//! free blocks (`unmap_free_pages`, sleep tags). This module keeps that
//! bookkeeping and its page arithmetic; the engine (`expandable.rs`) drives
//! the backend with it.

use super::idle_pages::IdlePages;
use crate::heap::{BlockState, Heap};
use crate::page_layout::{PageLayout, RangePages};
use crate::page_set::PageSet;
use crate::pytorch::{LARGE_BUFFER, SMALL_BUFFER};
use crate::types::{BlockId, Pool, SegmentId};

pub(crate) use crate::types::SegmentKey;

/// Bytes to map at the end of a growable segment of `pool` now `mapped`
/// bytes long, with pages `pages`, whose free tail has `free_tail` bytes, so
/// that the tail holds `size`: in PyTorch's step (2 MiB in the small pool,
/// 20 MiB in the large) when pages are the backend's `granularity`; up to
/// the next page boundary with larger pages of one size (`unmap_page_mb`),
/// not PyTorch's step rounded up to them; and with pages that grow with the
/// offset (`unmap_page_mb:auto`, 2 MiB near the start), PyTorch's step
/// rounded up to the page it reaches. At least one step or page.
pub(super) fn growth(
    pool: Pool,
    pages: &PageLayout,
    granularity: u64,
    mapped: u64,
    size: u64,
    free_tail: u64,
) -> u64 {
    let needed = size.saturating_sub(free_tail).max(1);
    let step = [SMALL_BUFFER, LARGE_BUFFER][pool.index()];
    if pages.largest() <= granularity {
        needed.div_ceil(step) * step
    } else if pages.is_uniform() {
        pages.ceil(mapped + needed) - mapped
    } else {
        pages.ceil(mapped + needed.div_ceil(step) * step) - mapped
    }
}

/// The growable segment of one cache key and pool (`E`: the stream
/// backend's event).
#[derive(Debug)]
pub(super) struct Growable<E> {
    pub(super) segment: SegmentId,
    /// Its physical pages: maps and unmaps cover whole pages.
    pages: RangePages,
    /// Size of the reserved address range.
    pub(super) range: u64,
    /// Pages inside the segment that are not mapped.
    pub(super) unmapped: PageSet,
    /// Which free pages the GPU is done with (`unmap_free_pages`).
    pub(super) idle: IdlePages<E>,
}

impl<E> Growable<E> {
    /// The segment `segment` at `base`, in a range of `range` bytes with
    /// pages of `page` bytes, whose first `mapped` bytes were just mapped
    /// (with memory the GPU may still use elsewhere if `reused_busy`).
    pub(super) fn new(
        segment: SegmentId,
        base: u64,
        layout: PageLayout,
        range: u64,
        mapped: u64,
        reused_busy: bool,
    ) -> Self {
        let pages = RangePages { base, layout };
        let mut idle = IdlePages::new(pages);
        idle.mapped(base, base + mapped, reused_busy);
        Growable {
            segment,
            pages,
            range,
            unmapped: PageSet::default(),
            idle,
        }
    }

    /// Its pages.
    #[inline]
    pub(super) fn pages(&self) -> &RangePages {
        &self.pages
    }

    /// The whole pages that `[addr, addr + size)` touches, as a range.
    pub(super) fn covering(&self, addr: u64, size: u64) -> (u64, u64) {
        (self.pages.floor(addr), self.pages.ceil(addr + size))
    }

    /// Whether every page that `[addr, addr + size)` touches is mapped.
    pub(super) fn is_mapped(&self, addr: u64, size: u64) -> bool {
        let (lo, hi) = self.covering(addr, size);
        !self.unmapped.any_in(lo, hi)
    }

    /// Runs `(start, bytes)` of the mapped pages of `[lo, hi)`.
    pub(super) fn mapped_runs(&self, lo: u64, hi: u64) -> Vec<(u64, u64)> {
        self.unmapped.gaps_in(lo, hi, &self.pages)
    }

    /// Runs `(start, bytes)` of the unmapped pages of `[lo, hi)`.
    pub(super) fn unmapped_runs(&self, lo: u64, hi: u64) -> Vec<(u64, u64)> {
        self.unmapped.runs_in(lo, hi, &self.pages)
    }

    /// The unmapped pages of `[start, start + bytes)` were mapped (with
    /// memory the GPU may still use elsewhere if `reused_busy`).
    pub(super) fn pages_mapped(&mut self, start: u64, bytes: u64, reused_busy: bool) {
        self.unmapped.remove_in(start, start + bytes, &self.pages);
        self.idle.mapped(start, start + bytes, reused_busy);
    }

    /// The mapped pages of `[start, start + bytes)` were unmapped, or with
    /// `detached` handed to the next mapping while they stay mapped for
    /// work the GPU may still run on them.
    pub(super) fn pages_unmapped(&mut self, start: u64, bytes: u64, detached: bool) {
        if detached {
            self.idle.detached(start, start + bytes);
        }
        self.unmapped.insert_run(start, bytes, &self.pages);
    }

    /// The mapped pages that lie wholly inside free blocks other than
    /// `keep`, as runs in address order: what unmapping free pages may
    /// take.
    pub(super) fn free_mapped_runs(&self, heap: &Heap, keep: Option<BlockId>) -> Vec<(u64, u64)> {
        let mut runs = Vec::new();
        for id in heap.segment_blocks(self.segment) {
            let b = heap.block(id);
            if b.state != BlockState::Free || Some(id) == keep {
                continue;
            }
            let lo = self.pages.ceil(b.addr);
            let hi = self.pages.floor(b.addr + b.size);
            if lo < hi {
                runs.extend(self.unmapped.gaps_in(lo, hi, &self.pages));
            }
        }
        runs
    }

    /// Where trimming cuts the segment's free tail: the first page boundary
    /// at or after the start of its last block, when that block is free and
    /// whole pages lie beyond it; `None` otherwise.
    pub(super) fn trim_point(&self, heap: &Heap) -> Option<u64> {
        let seg = heap.segment(self.segment);
        let last = heap.block(seg.last);
        if last.state != BlockState::Free {
            return None;
        }
        let keep_to = self.pages.ceil(last.addr);
        (keep_to < seg.addr + seg.size).then_some(keep_to)
    }

    /// Its invariants against the heap: the segment counts the unmapped
    /// pages listed here; detached pages are counted unmapped; a `paused`
    /// segment (a sleep tag's) has every page unmapped, and any other only
    /// pages under free blocks.
    pub(super) fn check(&self, heap: &Heap, paused: bool) -> Result<(), String> {
        let seg = heap.segment(self.segment);
        if seg.unmapped != self.unmapped.bytes(&self.pages) {
            return Err(format!(
                "segment {:#x}: {} unmapped bytes counted, {} pages listed",
                seg.addr,
                seg.unmapped,
                self.unmapped.len()
            ));
        }
        for (start, bytes) in self.idle.detached_runs() {
            if !self.mapped_runs(start, start + bytes).is_empty() {
                return Err(format!(
                    "detached pages at {start:#x} are counted as mapped"
                ));
            }
        }
        if paused {
            // A paused tag gave every page back, live blocks' included.
            if seg.unmapped != seg.size {
                return Err(format!(
                    "paused segment {:#x} still has {} bytes mapped",
                    seg.addr,
                    seg.size - seg.unmapped
                ));
            }
            return Ok(());
        }
        for id in heap.segment_blocks(self.segment) {
            let b = heap.block(id);
            let (lo, hi) = self.covering(b.addr, b.size);
            if b.state != BlockState::Free && self.unmapped.any_in(lo, hi) {
                return Err(format!("block {:#x} in use over an unmapped page", b.addr));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{CacheKey, StreamId, MIB};

    const BASE: u64 = 0x1000_0000;

    /// A growable segment of eight 1 MiB pages: [0, 2.5 MiB) allocated,
    /// [2.5, 7 MiB) free, [7, 8 MiB) allocated.
    fn segment() -> (Heap, Growable<u32>, [BlockId; 3]) {
        let mut heap = Heap::new(u64::MAX);
        let key = CacheKey::shared(StreamId(0));
        let (seg, a) = heap.add_segment(BASE, 8 * MIB, Pool::Large, key);
        heap.set_expandable(seg);
        let free = heap.split(a, 5 * MIB / 2);
        let c = heap.split(free, 9 * MIB / 2);
        heap.set_state(a, BlockState::Allocated, MIB);
        heap.set_state(c, BlockState::Allocated, MIB);
        let g = Growable::new(
            seg,
            BASE,
            PageLayout::uniform(MIB),
            64 * MIB,
            8 * MIB,
            false,
        );
        (heap, g, [a, free, c])
    }

    #[test]
    fn growth_is_whole_steps_past_the_free_tail() {
        let (small, large) = (Pool::Small, Pool::Large);
        let granule = PageLayout::uniform(2 * MIB);
        assert_eq!(
            growth(small, &granule, 2 * MIB, 0, 5 * MIB, MIB),
            2 * SMALL_BUFFER
        );
        assert_eq!(
            growth(large, &granule, 2 * MIB, 0, 5 * MIB, 0),
            LARGE_BUFFER
        );
        assert_eq!(
            growth(large, &granule, 2 * MIB, 0, MIB, 3 * MIB),
            LARGE_BUFFER,
            "at least a step"
        );
        let big = PageLayout::uniform(16 * MIB);
        assert_eq!(
            growth(large, &big, 2 * MIB, 32 * MIB, 5 * MIB, MIB),
            16 * MIB
        );
        assert_eq!(
            growth(large, &big, 2 * MIB, 32 * MIB, MIB, 3 * MIB),
            16 * MIB,
            "at least a page"
        );
        // Scaled pages: PyTorch's step, up to the boundary of the page it
        // reaches.
        let scaled = PageLayout::scaled(2 * MIB, 4 * MIB, 512).unwrap();
        let two_gib = 2 << 30;
        assert_eq!(
            growth(large, &scaled, 2 * MIB, two_gib - 2 * MIB, 3 * MIB, 0),
            22 * MIB
        );
        assert_eq!(growth(large, &scaled, 2 * MIB, 0, 3 * MIB, 0), 20 * MIB);
    }

    #[test]
    fn free_pages_are_the_whole_mapped_pages_inside_free_blocks() {
        let (mut heap, mut g, [_, free, _]) = segment();
        assert_eq!(
            g.free_mapped_runs(&heap, None),
            vec![(BASE + 3 * MIB, 4 * MIB)]
        );
        assert!(g.free_mapped_runs(&heap, Some(free)).is_empty(), "kept");
        g.pages_unmapped(BASE + 4 * MIB, MIB, false);
        heap.pages_unmapped(g.segment, MIB);
        assert_eq!(
            g.free_mapped_runs(&heap, None),
            vec![(BASE + 3 * MIB, MIB), (BASE + 5 * MIB, 2 * MIB)]
        );
        assert_eq!(
            g.unmapped_runs(BASE, BASE + 8 * MIB),
            vec![(BASE + 4 * MIB, MIB)]
        );
        assert_eq!(g.covering(BASE + MIB / 2, MIB), (BASE, BASE + 2 * MIB));
        g.check(&heap, false).unwrap();
        g.pages_mapped(BASE + 4 * MIB, MIB, false);
        heap.pages_mapped(g.segment, MIB);
        assert_eq!(g.mapped_runs(BASE, BASE + 8 * MIB), vec![(BASE, 8 * MIB)]);
        g.check(&heap, false).unwrap();
    }

    #[test]
    fn the_free_tail_is_trimmed_from_its_first_page_boundary() {
        let (mut heap, g, [_, free, c]) = segment();
        assert_eq!(g.trim_point(&heap), None, "the last block is allocated");
        heap.set_state(c, BlockState::Free, 0);
        heap.merge_next(free);
        assert_eq!(g.trim_point(&heap), Some(BASE + 3 * MIB));
    }

    #[test]
    fn check_finds_pages_unmapped_under_busy_blocks_and_miscounts() {
        let (mut heap, mut g, _) = segment();
        g.pages_unmapped(BASE + 7 * MIB, MIB, false); // under the last, allocated block
        heap.pages_unmapped(g.segment, MIB);
        let err = g.check(&heap, false).unwrap_err();
        assert!(err.contains("in use over an unmapped page"), "{err}");
        assert!(g.check(&heap, true).unwrap_err().contains("still has"));
        g.pages_unmapped(BASE + 3 * MIB, MIB, true); // detached: still mapped
        assert!(g.check(&heap, false).unwrap_err().contains("pages listed"));
    }
}
