//! How a growable segment's address range is cut into pages, each page one
//! physical allocation that `unmap_free_pages` maps and unmaps whole.
//!
//! A page size is a trade: a free page can be given back only whole, so large
//! pages leave more memory mapped under holes, while every page moved costs
//! about the same driver time whatever its size, so small pages move more
//! often for the same memory. [`PageLayout::uniform`] uses one size.
//! [`PageLayout::scaled`] lets the page grow with the heap beneath it: a page
//! is at most a fixed share of the offset it starts at, so a small heap
//! (inference) gets small pages and stays near the bound of live bytes, and a
//! large heap (training) gets large pages and moves few of them, with the
//! memory held under holes staying the same share of the heap.
//!
//! ```
//! use alloc_core::PageLayout;
//! const MIB: u64 = 1 << 20;
//!
//! // 2 MiB pages up to 2 GiB, then each page at most 1/512 of the offset
//! // below it: 4 MiB from 2 GiB, 8 MiB from 4 GiB, 16 MiB from 8 GiB on.
//! let pages = PageLayout::scaled(2 * MIB, 16 * MIB, 512).unwrap();
//! assert_eq!(pages.size_at(100 * MIB), 2 * MIB);
//! assert_eq!(pages.size_at(3 << 30), 4 * MIB);
//! assert_eq!(pages.size_at(40 << 30), 16 * MIB);
//! // Pages tile the range: a run's pages, as (offset, size).
//! let run: Vec<_> = pages.pages((2 << 30) - 4 * MIB, (2 << 30) + 8 * MIB).collect();
//! assert_eq!(run, [
//!     ((2 << 30) - 4 * MIB, 2 * MIB),
//!     ((2 << 30) - 2 * MIB, 2 * MIB),
//!     (2 << 30, 4 * MIB),
//!     ((2 << 30) + 4 * MIB, 4 * MIB),
//! ]);
//! ```

use std::fmt;

/// The pages of a reserved range, as a function of the offset from its
/// start (which is aligned to [`PageLayout::largest`]). Every page is a power
/// of two aligned to its size, so page boundaries are the same for every
/// range with this layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageLayout {
    smallest: u64,
    largest: u64,
    /// 0: uniform. Otherwise a page starting at offset `o` is the largest
    /// power of two at most `o / ratio`, within `[smallest, largest]`.
    ratio: u64,
}

impl PageLayout {
    /// Every page `page` bytes (a power of two).
    pub const fn uniform(page: u64) -> Self {
        PageLayout {
            smallest: page,
            largest: page,
            ratio: 0,
        }
    }

    /// Pages that grow with their offset: `smallest` bytes near the start,
    /// then the largest power of two at most `offset / ratio`, at most
    /// `largest`. `None` unless both sizes are powers of two with `smallest
    /// <= largest` and `ratio >= 1`.
    pub fn scaled(smallest: u64, largest: u64, ratio: u64) -> Option<Self> {
        let ok = smallest.is_power_of_two()
            && largest.is_power_of_two()
            && smallest <= largest
            && ratio >= 1;
        ok.then(|| Self::scaled_const(smallest, largest, ratio))
    }

    /// [`PageLayout::scaled`] for constants whose arguments are known to
    /// be valid (panics at compile time otherwise).
    pub const fn scaled_const(smallest: u64, largest: u64, ratio: u64) -> Self {
        assert!(smallest.is_power_of_two() && largest.is_power_of_two());
        assert!(smallest <= largest && ratio >= 1);
        PageLayout {
            smallest,
            largest,
            ratio: if smallest == largest { 0 } else { ratio },
        }
    }

    /// The same layout with every page at least `granularity` bytes (a
    /// power of two): what a device that maps no less can map.
    pub fn at_least(self, granularity: u64) -> Self {
        PageLayout {
            smallest: self.smallest.max(granularity),
            largest: self.largest.max(granularity),
            ratio: if self.largest <= granularity {
                0
            } else {
                self.ratio
            },
        }
    }

    /// Whether every page has the same size.
    pub fn is_uniform(&self) -> bool {
        self.ratio == 0
    }

    /// The size of the smallest page.
    pub fn smallest(&self) -> u64 {
        self.smallest
    }

    /// The size of the largest page; ranges start aligned to it.
    pub fn largest(&self) -> u64 {
        self.largest
    }

    /// The size of the page holding `offset`.
    #[inline]
    pub fn size_at(&self, offset: u64) -> u64 {
        if self.ratio == 0 {
            return self.smallest;
        }
        let share = offset / self.ratio;
        if share <= self.smallest {
            self.smallest
        } else {
            // A page's size changes only at offsets that are multiples of
            // it (ratio x size), so every offset of a page agrees on it.
            (1u64 << (63 - share.leading_zeros())).min(self.largest)
        }
    }

    /// The start of the page holding `offset`.
    #[inline]
    pub fn floor(&self, offset: u64) -> u64 {
        let page = self.size_at(offset);
        offset / page * page
    }

    /// The first page boundary at or after `offset`; `u64::MAX` when the
    /// page holding `offset` ends past the address space (no boundary lies
    /// beyond it).
    #[inline]
    pub fn ceil(&self, offset: u64) -> u64 {
        let start = self.floor(offset);
        if start == offset {
            offset
        } else {
            start.saturating_add(self.size_at(start))
        }
    }

    /// Whether a page starts at `offset`.
    pub fn is_boundary(&self, offset: u64) -> bool {
        self.floor(offset) == offset
    }

    /// The pages `(start, size)` from the one holding `lo` up to the one
    /// holding `hi - 1`, in address order.
    pub fn pages(&self, lo: u64, hi: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut at = Some(self.floor(lo));
        std::iter::from_fn(move || {
            let start = at.filter(|&a| a < hi)?;
            let page = (start, self.size_at(start));
            // The last page of the address space ends the run.
            at = start.checked_add(page.1);
            Some(page)
        })
    }

    /// How many pages [`PageLayout::pages`] gives for `[lo, hi)`.
    pub fn count(&self, lo: u64, hi: u64) -> u64 {
        if self.ratio == 0 {
            let page = self.smallest;
            return (hi.div_ceil(page)).saturating_sub(lo / page);
        }
        self.pages(lo, hi).count() as u64
    }
}

/// Default large-pool page of `unmap_free_pages` (16 MiB): on the H100,
/// with busy pages moving without host waits, it keeps the step time of
/// ResNet-50 and GPT-2 training within 2% of PyTorch's and reserves less
/// than every PyTorch setting on those and on ViT; 8 MiB pages reserve a
/// little less (also below PyTorch on GPT-2 generation) at 1.03-1.3x the
/// training step (docs/policies.md, "Page size").
pub const DEFAULT_UNMAP_PAGE: u64 = 16 << 20;

impl Default for PageLayout {
    /// `unmap_free_pages`' default: pages of [`DEFAULT_UNMAP_PAGE`] bytes.
    fn default() -> Self {
        PageLayout::uniform(DEFAULT_UNMAP_PAGE)
    }
}

impl fmt::Display for PageLayout {
    /// `N MiB` pages, or `scaled N..M MiB, 1/R`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const MIB: u64 = 1 << 20;
        if self.is_uniform() {
            write!(f, "{} MiB", self.smallest / MIB)
        } else {
            write!(
                f,
                "scaled {}..{} MiB, 1/{}",
                self.smallest / MIB,
                self.largest / MIB,
                self.ratio
            )
        }
    }
}

/// The pages of one reserved range: its start address and layout, with the
/// page arithmetic in addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RangePages {
    /// The range's start (aligned to the layout's largest page).
    pub base: u64,
    /// How the range is cut into pages.
    pub layout: PageLayout,
}

impl RangePages {
    /// The size of the page holding `addr`.
    #[inline]
    pub fn size_at(&self, addr: u64) -> u64 {
        self.layout.size_at(addr - self.base)
    }

    /// The start of the page holding `addr`.
    #[inline]
    pub fn floor(&self, addr: u64) -> u64 {
        self.base + self.layout.floor(addr - self.base)
    }

    /// The first page boundary at or after `addr`.
    #[inline]
    pub fn ceil(&self, addr: u64) -> u64 {
        self.base + self.layout.ceil(addr - self.base)
    }

    /// Whether `[addr, addr + size)` is whole pages (`size > 0`).
    pub fn is_whole(&self, addr: u64, size: u64) -> bool {
        size > 0
            && addr >= self.base
            && self.layout.is_boundary(addr - self.base)
            && self.layout.is_boundary(addr + size - self.base)
    }

    /// The pages `(start address, size)` that `[lo, hi)` touches.
    pub fn pages(&self, lo: u64, hi: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let base = self.base;
        self.layout
            .pages(lo - base, hi - base)
            .map(move |(at, size)| (base + at, size))
    }

    /// How many pages `[lo, hi)` touches.
    pub fn count(&self, lo: u64, hi: u64) -> u64 {
        self.layout.count(lo - self.base, hi - self.base)
    }

    /// Bytes of the fewest whole pages at the end of `[lo, hi)` (page
    /// boundaries) that hold at least `at_least` bytes, or all of it.
    pub fn tail(&self, lo: u64, hi: u64, at_least: u64) -> u64 {
        let mut at = hi;
        while at > lo && hi - at < at_least {
            at = self.floor(at - 1);
        }
        hi - at
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn scaled() -> PageLayout {
        PageLayout::scaled(2 * MIB, 16 * MIB, 512).unwrap()
    }

    #[test]
    fn offsets_at_the_end_of_the_address_space_do_not_overflow() {
        let layouts = [
            scaled(),
            PageLayout::scaled(2 * MIB, 4 * MIB, 512).unwrap(),
            PageLayout::uniform(2 * MIB),
            PageLayout::scaled(1, 1 << 63, 1).unwrap(),
        ];
        for pages in layouts {
            for offset in [u64::MAX, u64::MAX - 1, u64::MAX - 3 * MIB] {
                let size = pages.size_at(offset);
                assert!(size.is_power_of_two() && size <= pages.largest());
                let floor = pages.floor(offset);
                assert!(floor <= offset && offset - floor < size);
                let ceil = pages.ceil(offset);
                assert!(ceil >= offset, "{pages}: ceil({offset:#x}) = {ceil:#x}");
                assert!(pages.is_boundary(floor));
                let run: Vec<_> = pages.pages(offset, u64::MAX).take(4).collect();
                assert!(!run.is_empty() && run.len() <= 3, "{pages}: {run:?}");
                assert_eq!(run[0].0, floor);
                assert!(pages.count(offset, u64::MAX) >= 1);
            }
        }
        assert_eq!(
            PageLayout::scaled(2 * MIB, 4 * MIB, 512)
                .unwrap()
                .size_at(u64::MAX),
            4 * MIB
        );
    }

    #[test]
    fn scaled_pages_grow_with_the_offset_up_to_the_largest() {
        let p = scaled();
        assert_eq!(p.size_at(0), 2 * MIB);
        assert_eq!(p.size_at(2 * GIB - 1), 2 * MIB);
        assert_eq!(p.size_at(2 * GIB), 4 * MIB);
        assert_eq!(p.size_at(4 * GIB - 1), 4 * MIB);
        assert_eq!(p.size_at(4 * GIB), 8 * MIB);
        assert_eq!(p.size_at(8 * GIB), 16 * MIB);
        assert_eq!(p.size_at(80 * GIB), 16 * MIB);
    }

    #[test]
    fn pages_tile_a_range_each_aligned_to_its_size() {
        let p = scaled();
        let mut at = 0;
        for (start, size) in p.pages(0, 12 * GIB) {
            assert_eq!(start, at, "no gap, no overlap");
            assert_eq!(start % size, 0, "aligned");
            assert_eq!(p.size_at(start + size - 1), size, "one size over a page");
            assert!(p.is_boundary(start) && !p.is_boundary(start + MIB));
            at += size;
        }
        assert_eq!(at, 12 * GIB);
        // 1024 + 512 + 512 + 256 pages below 2, 4, 8 and 12 GiB.
        assert_eq!(p.count(0, 12 * GIB), 2304);
    }

    #[test]
    fn floor_and_ceil_find_the_page_boundaries() {
        let p = scaled();
        assert_eq!(p.floor(5 * GIB + 3 * MIB), 5 * GIB);
        assert_eq!(p.ceil(5 * GIB + 3 * MIB), 5 * GIB + 8 * MIB);
        assert_eq!(p.ceil(5 * GIB), 5 * GIB);
        assert_eq!(p.ceil(2 * GIB - MIB), 2 * GIB);
        let r = RangePages {
            base: 64 * GIB,
            layout: p,
        };
        assert!(r.is_whole(64 * GIB + 2 * GIB, 4 * MIB));
        assert!(!r.is_whole(64 * GIB + 2 * GIB, 2 * MIB));
        assert_eq!(r.count(64 * GIB, 64 * GIB + 3 * MIB), 2);
        // The top pages of a run that cover a budget: two 4 MiB pages for
        // 5 MiB, and no more than the run.
        let (lo, hi) = (66 * GIB - 4 * MIB, 66 * GIB + 8 * MIB);
        assert_eq!(r.tail(lo, hi, 5 * MIB), 8 * MIB);
        assert_eq!(r.tail(lo, hi, 10 * MIB), 10 * MIB);
        assert_eq!(r.tail(lo, hi, u64::MAX), 12 * MIB);
        assert_eq!(r.tail(lo, hi, 0), 0);
    }

    #[test]
    fn uniform_and_degenerate_layouts() {
        let u = PageLayout::uniform(8 * MIB);
        assert!(u.is_uniform());
        assert_eq!(u.size_at(123 * GIB), 8 * MIB);
        assert_eq!(u.count(8 * MIB, 24 * MIB + 1), 3);
        assert_eq!(
            PageLayout::scaled(4 * MIB, 4 * MIB, 512),
            Some(PageLayout::uniform(4 * MIB))
        );
        assert_eq!(PageLayout::scaled(4 * MIB, 2 * MIB, 512), None);
        assert_eq!(PageLayout::scaled(3 * MIB, 4 * MIB, 512), None);
        assert_eq!(PageLayout::scaled(2 * MIB, 4 * MIB, 0), None);
        // A device whose pages are at least 32 MiB maps them uniformly.
        assert_eq!(scaled().at_least(32 * MIB), PageLayout::uniform(32 * MIB));
        assert_eq!(scaled().at_least(4 * MIB).size_at(0), 4 * MIB);
        assert_eq!(scaled().to_string(), "scaled 2..16 MiB, 1/512");
    }
}
