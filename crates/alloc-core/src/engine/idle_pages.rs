//! Which free pages of a growable segment the GPU is known to be done with
//! (`unmap_free_pages`), so that they can be unmapped without waiting.
//!
//! Unmapping a page that queued kernels may still touch is undefined, so an
//! unmap must know that the work queued on the segment's stream before the
//! page became free has run. Waiting for the stream on the host proves it,
//! but drains the queue the host had run ahead with: one wait per unmap
//! round tripled GPT-2 training's step time. Instead, time is cut into
//! epochs, each ended by an event (a *mark*) recorded on the stream at an
//! unmap round; every page remembers the epoch of the last free that touched
//! it. Once a mark has completed, pages last freed in its epoch or before
//! are idle: they can be unmapped at once.
//!
//! A busy page need not wait either when its memory goes to a mapping on
//! the same stream: that mapping's work is queued after the page's last
//! use. The backend then *detaches* it (the memory is mapped at the new
//! address while the old one stays mapped for the queued work), and the old
//! mapping is dropped once the epoch of its last free is idle.

use std::collections::VecDeque;

use crate::page_layout::RangePages;
use crate::page_set::{partition_pages, Runs};

/// Outstanding marks per segment: beyond this, rounds record no new one
/// (frees keep the current epoch until an older mark completes).
const MAX_MARKS: usize = 16;

/// Epoch stamps of one growable segment's pages and its outstanding marks.
#[derive(Debug)]
pub(super) struct IdlePages<E> {
    /// The segment's pages.
    pages: RangePages,
    /// Per smallest page of the layout, from the segment's start: epoch of
    /// the last free touching the page over it; 0 = not used since it was
    /// mapped. Every stamp covers whole pages, so all the entries of a
    /// larger page agree.
    freed_in: Vec<u64>,
    /// The epoch frees are stamped with now (starts at 1).
    epoch: u64,
    /// Marks recorded at the end of epochs, oldest first: `(epoch, number,
    /// mark)`, numbered in the order of recording across all segments.
    marks: VecDeque<(u64, u64, E)>,
    /// Frees stamped with this epoch or an earlier one are done on the GPU.
    idle_through: u64,
    /// Old mappings of detached pages: `(start, bytes, epoch)`, droppable
    /// once `epoch` is idle.
    detached: Vec<(u64, u64, u64)>,
    /// Bytes freed since the last mark.
    freed_since_mark: u64,
}

impl<E> IdlePages<E> {
    /// No page used yet, in a segment of these pages.
    pub(super) fn new(pages: RangePages) -> Self {
        IdlePages {
            pages,
            freed_in: Vec::new(),
            epoch: 1,
            marks: VecDeque::new(),
            idle_through: 0,
            detached: Vec::new(),
            freed_since_mark: 0,
        }
    }

    /// Indexes in `freed_in` of the whole pages that `[lo, hi)` touches.
    #[inline]
    fn pages(&self, lo: u64, hi: u64) -> std::ops::Range<usize> {
        let (base, unit) = (self.pages.base, self.pages.layout.smallest());
        if self.pages.layout.is_uniform() {
            // Every page is `unit` bytes (every free stamps, so the common
            // layout skips the page-size lookups of floor and ceil).
            return ((lo - base) / unit) as usize..(hi - base).div_ceil(unit) as usize;
        }
        let first = ((self.pages.floor(lo) - base) / unit) as usize;
        let end = ((self.pages.ceil(hi) - base) / unit) as usize;
        first..end
    }

    /// A block over `[lo, hi)` became free now: every page it touches.
    /// Returns whether `mark_every` bytes (or more) were freed since the
    /// last mark: the epoch is then due to end. Inline, and the growth of
    /// the stamps out of line: every free under `unmap_free_pages` comes
    /// here, and its register saves cost more than the stamp.
    #[inline]
    pub(super) fn freed(&mut self, lo: u64, hi: u64, mark_every: u64) -> bool {
        self.stamp(lo, hi);
        self.freed_since_mark += hi - lo;
        self.freed_since_mark >= mark_every
    }

    /// Stamps every page `[lo, hi)` touches with the current epoch.
    #[inline]
    fn stamp(&mut self, lo: u64, hi: u64) {
        let pages = self.pages(lo, hi);
        if self.freed_in.len() < pages.end {
            self.grow_stamps(pages.end);
        }
        self.freed_in[pages].fill(self.epoch);
    }

    /// Room for the stamps of the first `pages` pages (0: never freed).
    #[cold]
    #[inline(never)]
    fn grow_stamps(&mut self, pages: usize) {
        self.freed_in.resize(pages, 0);
    }

    /// The pages of `[lo, hi)` were just mapped: nothing has used them,
    /// unless `reused_busy` (their memory may come from detached pages the
    /// GPU still uses elsewhere: busy as of now).
    pub(super) fn mapped(&mut self, lo: u64, hi: u64, reused_busy: bool) {
        if reused_busy {
            return self.stamp(lo, hi);
        }
        let pages = self.pages(lo, hi);
        let end = pages.end.min(self.freed_in.len());
        if pages.start < end {
            self.freed_in[pages.start..end].fill(0);
        }
    }

    /// Whether the GPU is known to be done with the page at `addr`.
    pub(super) fn is_idle(&self, addr: u64) -> bool {
        self.freed_in
            .get(((addr - self.pages.base) / self.pages.layout.smallest()) as usize)
            .is_none_or(|&e| e <= self.idle_through)
    }

    /// Whether the GPU is known to be done with every page `[lo, hi)`
    /// touches (pages never freed since they were mapped included).
    pub(super) fn is_idle_range(&self, lo: u64, hi: u64) -> bool {
        let pages = self.pages(lo, hi);
        let end = pages.end.min(self.freed_in.len());
        self.freed_in
            .get(pages.start..end)
            .is_none_or(|epochs| epochs.iter().all(|&e| e <= self.idle_through))
    }

    /// The pages of `[lo, hi)` were detached: their old mapping stays until
    /// the epoch of their last free is idle.
    pub(super) fn detached(&mut self, lo: u64, hi: u64) {
        let pages = self.pages(lo, hi);
        let end = pages.end.min(self.freed_in.len());
        let last_free = self
            .freed_in
            .get(pages.start..end)
            .and_then(|epochs| epochs.iter().max().copied())
            .unwrap_or(0);
        self.detached.push((lo, hi - lo, last_free));
    }

    /// Removes and returns the detached runs `(start, bytes)` whose old
    /// mapping the GPU is done with.
    pub(super) fn take_idle_detached(&mut self) -> Runs {
        let mut idle = Vec::new();
        let idle_through = self.idle_through;
        self.detached.retain(|&(start, bytes, epoch)| {
            let done = epoch <= idle_through;
            if done {
                idle.push((start, bytes));
            }
            !done
        });
        idle
    }

    /// The epoch that must be idle before the detached runs overlapping
    /// `[lo, hi)` can be dropped; `None` when none does.
    pub(super) fn detached_epoch_in(&self, lo: u64, hi: u64) -> Option<u64> {
        self.detached
            .iter()
            .filter(|&&(start, bytes, _)| start < hi && lo < start + bytes)
            .map(|&(_, _, epoch)| epoch)
            .max()
    }

    /// The oldest outstanding mark whose completion makes `epoch` idle:
    /// waiting for it waits for no work queued after it.
    pub(super) fn mark_ending(&self, epoch: u64) -> Option<&E> {
        self.marks
            .iter()
            .find(|(ended, _, _)| *ended >= epoch)
            .map(|(_, _, mark)| mark)
    }

    /// The detached runs `(start, bytes)` not yet dropped.
    pub(super) fn detached_runs(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.detached
            .iter()
            .map(|&(start, bytes, _)| (start, bytes))
    }

    /// Whether a new mark may be recorded (few enough outstanding).
    pub(super) fn wants_mark(&self) -> bool {
        self.marks.len() < MAX_MARKS
    }

    /// Counts the bytes freed from zero again (see [`IdlePages::freed`]).
    pub(super) fn restart_free_count(&mut self) {
        self.freed_since_mark = 0;
    }

    /// Ends the current epoch with `mark`, recorded on the stream now as
    /// the `number`th mark of the allocator.
    pub(super) fn end_epoch(&mut self, mark: E, number: u64) {
        self.marks.push_back((self.epoch, number, mark));
        self.epoch += 1;
        self.freed_since_mark = 0;
    }

    /// The oldest outstanding mark.
    pub(super) fn oldest_mark(&self) -> Option<&E> {
        self.marks.front().map(|(_, _, e)| e)
    }

    /// The number of the oldest outstanding mark (see
    /// [`IdlePages::end_epoch`]).
    pub(super) fn oldest_mark_number(&self) -> Option<u64> {
        self.marks.front().map(|&(_, n, _)| n)
    }

    /// The oldest mark completed: its epoch and every earlier one are idle.
    /// Returns the mark for release.
    pub(super) fn oldest_mark_done(&mut self) -> Option<E> {
        let (epoch, _, mark) = self.marks.pop_front()?;
        self.idle_through = self.idle_through.max(epoch);
        Some(mark)
    }

    /// The host waited for the mark that ends `epoch` (see
    /// [`IdlePages::mark_ending`]): that epoch and every earlier one are
    /// idle. Returns the marks it retires (the one waited for and older
    /// ones, all done), for release.
    pub(super) fn waited_for_epoch(&mut self, epoch: u64) -> impl Iterator<Item = E> + '_ {
        let done = self
            .marks
            .iter()
            .take_while(|(ended, _, _)| *ended < epoch)
            .count()
            + 1;
        let done = done.min(self.marks.len());
        let ended = self.marks.get(done.wrapping_sub(1)).map_or(epoch, |m| m.0);
        self.idle_through = self.idle_through.max(ended).max(epoch);
        self.marks.drain(..done).map(|(_, _, e)| e)
    }

    /// The host waited for the stream: every free so far is idle, and frees
    /// from now on belong to a new epoch. Returns the marks, all done.
    pub(super) fn waited(&mut self) -> impl Iterator<Item = E> + '_ {
        self.idle_through = self.epoch;
        self.epoch += 1;
        self.take_marks()
    }

    /// Removes the outstanding marks, for release to the stream backend.
    pub(super) fn take_marks(&mut self) -> impl Iterator<Item = E> + '_ {
        self.marks.drain(..).map(|(_, _, e)| e)
    }

    /// Splits page runs `(start, bytes)` into the runs of idle pages and the
    /// runs of the others.
    pub(super) fn split_runs(&self, page_runs: &[(u64, u64)]) -> (Runs, Runs) {
        partition_pages(&self.pages, page_runs, |addr, _| self.is_idle(addr))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page_layout::PageLayout;

    /// Pages of `page` bytes from `base`.
    fn uniform(base: u64, page: u64) -> RangePages {
        RangePages {
            base,
            layout: PageLayout::uniform(page),
        }
    }

    #[test]
    fn a_free_stamps_the_whole_larger_page_it_touches() {
        const MIB: u64 = 1 << 20;
        // 2 MiB pages below 2 GiB, 4 MiB pages from there.
        let pages = RangePages {
            base: 0,
            layout: PageLayout::scaled(2 * MIB, 4 * MIB, 512).unwrap(),
        };
        let big = 2u64 << 30;
        let mut p: IdlePages<u8> = IdlePages::new(pages);
        p.freed(big + MIB, big + 2 * MIB, u64::MAX); // inside the first 4 MiB page
        assert!(!p.is_idle(big), "the page's start is stamped too");
        assert!(p.is_idle(big + 4 * MIB) && p.is_idle(big - 2 * MIB));
        let runs = [(big - 2 * MIB, 10 * MIB)];
        assert_eq!(
            p.split_runs(&runs),
            (
                vec![(big - 2 * MIB, 2 * MIB), (big + 4 * MIB, 4 * MIB)],
                vec![(big, 4 * MIB)]
            )
        );
        p.end_epoch(7, 0);
        p.oldest_mark_done();
        assert!(p.is_idle(big) && p.is_idle(big + 3 * MIB));
    }

    #[test]
    fn a_range_is_idle_once_every_page_it_touches_is() {
        const MIB: u64 = 1 << 20;
        let mut p: IdlePages<u8> = IdlePages::new(uniform(0, 2 * MIB));
        assert!(p.is_idle_range(0, 64 * MIB), "never freed since mapped");
        p.freed(4 * MIB, 6 * MIB, u64::MAX);
        p.end_epoch(1, 0);
        p.freed(10 * MIB + 1, 11 * MIB, u64::MAX); // inside the page at 10 MiB
        assert!(!p.is_idle_range(0, 8 * MIB), "the first free's mark is out");
        p.oldest_mark_done();
        assert!(p.is_idle_range(0, 10 * MIB));
        assert!(
            !p.is_idle_range(9 * MIB, 10 * MIB + 1),
            "touches the later free's page"
        );
        assert!(p.is_idle_range(12 * MIB, 200 * MIB), "past the stamps");
    }

    #[test]
    fn an_epoch_is_due_to_end_once_enough_bytes_were_freed_in_it() {
        let mut p: IdlePages<u8> = IdlePages::new(uniform(0, 10));
        assert!(!p.freed(0, 30, 50), "30 of 50 bytes");
        assert!(p.freed(30, 50, 50), "50 of 50");
        assert!(p.freed(50, 60, 50), "still due until a mark ends the epoch");
        p.end_epoch(1, 0);
        assert!(!p.freed(60, 70, 50), "counted again from the mark");
        assert!(p.freed(0, 40, 50));
        p.restart_free_count(); // a mark that could not be recorded
        assert!(!p.freed(40, 50, 50), "counted again from the attempt");
        assert!(!p.freed(0, 1000, u64::MAX), "never due when off");
        // A mapping of memory other work may still use stamps without counting.
        let mut q: IdlePages<u8> = IdlePages::new(uniform(0, 10));
        q.mapped(0, 100, true);
        assert!(!q.is_idle(0));
        assert!(!q.freed(0, 10, 20));
    }

    #[test]
    fn pages_become_idle_when_a_later_mark_completes() {
        // Pages of 10 bytes from address 100: page i is [100 + 10i, 110 + 10i).
        let mut p: IdlePages<u32> = IdlePages::new(uniform(100, 10));
        let page = |i: u64| 100 + 10 * i;
        assert!(p.is_idle(page(3)), "never used");
        p.freed(page(2) + 3, page(3) + 5, u64::MAX); // touches pages 2 and 3
        assert!(!p.is_idle(page(2)) && !p.is_idle(page(3)) && p.is_idle(page(4)));
        p.end_epoch(7, 0); // mark of epoch 1
        p.freed(page(4), page(5), u64::MAX); // epoch 2
        assert_eq!(p.oldest_mark(), Some(&7));
        assert_eq!(p.oldest_mark_done(), Some(7));
        assert!(
            p.is_idle(page(2)) && p.is_idle(page(3)),
            "freed before the mark"
        );
        assert!(!p.is_idle(page(4)), "freed after it");
        p.freed(page(2), page(3), u64::MAX); // used and freed again: busy again
        assert!(!p.is_idle(page(2)));
        let done: Vec<u32> = p.waited().collect();
        assert!(done.is_empty());
        assert!(p.is_idle(page(2)) && p.is_idle(page(4)));
        p.freed(page(4), page(5), u64::MAX);
        assert!(
            !p.is_idle(page(4)),
            "a free after the wait is in a new epoch"
        );
        p.mapped(page(4), page(9), false);
        assert!(p.is_idle(page(4)), "remapped pages are unused");
    }

    #[test]
    fn marks_are_capped_and_returned_by_a_wait() {
        let mut p: IdlePages<usize> = IdlePages::new(uniform(0, 1));
        let mut n = 0;
        while p.wants_mark() {
            p.end_epoch(n, 100 + n as u64);
            n += 1;
        }
        assert_eq!(n, MAX_MARKS);
        assert_eq!(p.oldest_mark_number(), Some(100));
        p.oldest_mark_done();
        assert_eq!(p.oldest_mark_number(), Some(101), "numbered as recorded");
        assert!(p.wants_mark());
        p.end_epoch(n, 200);
        assert_eq!(p.waited().count(), MAX_MARKS);
        assert!(p.wants_mark());
    }

    #[test]
    fn detached_runs_become_droppable_with_the_epoch_of_their_last_free() {
        let mut p: IdlePages<u8> = IdlePages::new(uniform(0, 10));
        p.freed(0, 20, u64::MAX); // epoch 1
        p.end_epoch(1, 0);
        p.freed(30, 40, u64::MAX); // epoch 2
        p.detached(0, 20);
        p.detached(30, 40);
        p.detached(50, 60); // never used: droppable at once
        assert_eq!(p.detached_epoch_in(15, 16), Some(1));
        assert_eq!(p.detached_epoch_in(20, 30), None);
        assert_eq!(p.detached_epoch_in(0, 100), Some(2));
        assert_eq!(p.mark_ending(1), Some(&1));
        assert_eq!(p.mark_ending(2), None, "epoch 2 has no mark yet");
        p.end_epoch(2, 0);
        p.end_epoch(3, 0);
        assert_eq!(p.mark_ending(2), Some(&2));
        assert_eq!(p.take_idle_detached(), vec![(50, 10)]);
        assert_eq!(p.waited_for_epoch(1).collect::<Vec<_>>(), vec![1]);
        assert_eq!(p.take_idle_detached(), vec![(0, 20)], "epoch 1 is idle");
        assert_eq!(p.detached_runs().collect::<Vec<_>>(), vec![(30, 10)]);
        assert_eq!(
            p.waited_for_epoch(2).collect::<Vec<_>>(),
            vec![2],
            "3 stays"
        );
        assert_eq!(p.take_idle_detached(), vec![(30, 10)]);
        assert_eq!(p.oldest_mark(), Some(&3));
        assert_eq!(p.detached_epoch_in(0, 100), None);
    }

    #[test]
    fn a_detached_run_waits_for_the_last_free_of_any_of_its_pages() {
        let mut p: IdlePages<u8> = IdlePages::new(uniform(0, 10));
        p.freed(0, 10, u64::MAX); // page 0 in epoch 1
        p.end_epoch(1, 0);
        p.freed(10, 20, u64::MAX); // page 1 in epoch 2
        p.end_epoch(2, 0);
        p.detached(0, 20); // one run over both
        assert_eq!(p.detached_epoch_in(0, 10), Some(2));
        assert_eq!(p.oldest_mark_done(), Some(1));
        assert!(
            p.take_idle_detached().is_empty(),
            "page 1's old mapping may still be in use"
        );
        assert_eq!(p.oldest_mark_done(), Some(2));
        assert_eq!(p.take_idle_detached(), vec![(0, 20)]);
    }

    #[test]
    fn pages_mapped_with_memory_still_in_use_elsewhere_are_busy() {
        let mut p: IdlePages<u8> = IdlePages::new(uniform(0, 10));
        p.mapped(0, 30, true);
        assert!(
            !p.is_idle(0) && !p.is_idle(25),
            "their memory came from detached pages the GPU may still use"
        );
        assert_eq!(p.split_runs(&[(0, 30)]), (vec![], vec![(0, 30)]));
        p.end_epoch(1, 0);
        p.oldest_mark_done();
        assert!(
            p.is_idle(0) && p.is_idle(25),
            "idle once the mark completed"
        );
        p.freed(0, 10, u64::MAX);
        p.mapped(0, 10, false);
        assert!(p.is_idle(0), "fresh memory is unused");
    }

    #[test]
    fn runs_split_by_idleness() {
        let base = 1000;
        let mut p: IdlePages<()> = IdlePages::new(uniform(base, 10));
        p.freed(base + 10, base + 20, u64::MAX); // page 1 busy
        p.freed(base + 40, base + 60, u64::MAX); // pages 4, 5 busy
        let (idle, busy) = p.split_runs(&[(base, 3 * 10), (base + 40, 30)]);
        assert_eq!(idle, vec![(base, 10), (base + 20, 10), (base + 60, 10)]);
        assert_eq!(busy, vec![(base + 10, 10), (base + 40, 20)]);
    }
}
