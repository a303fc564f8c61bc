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
//! are idle: they can be unmapped at once, and only the rest need a wait.

use std::collections::VecDeque;

/// Page runs `(start, bytes)`.
type Runs = Vec<(u64, u64)>;

/// Outstanding marks per segment: beyond this, rounds record no new one
/// (frees keep the current epoch until an older mark completes).
const MAX_MARKS: usize = 16;

/// Epoch stamps of one growable segment's pages and its outstanding marks.
#[derive(Debug)]
pub(super) struct IdlePages<E> {
    /// Per page, from the segment's start: epoch of the last free touching
    /// it; 0 = not used since it was mapped.
    freed_in: Vec<u64>,
    /// The epoch frees are stamped with now (starts at 1).
    epoch: u64,
    /// Marks recorded at the end of epochs, oldest first.
    marks: VecDeque<(u64, E)>,
    /// Frees stamped with this epoch or an earlier one are done on the GPU.
    idle_through: u64,
}

impl<E> Default for IdlePages<E> {
    fn default() -> Self {
        IdlePages {
            freed_in: Vec::new(),
            epoch: 1,
            marks: VecDeque::new(),
            idle_through: 0,
        }
    }
}

impl<E> IdlePages<E> {
    /// A block over pages `[first, end)` became free now.
    pub(super) fn freed(&mut self, first: usize, end: usize) {
        if self.freed_in.len() < end {
            self.freed_in.resize(end, 0);
        }
        self.freed_in[first..end].fill(self.epoch);
    }

    /// Pages `[first, end)` were just mapped: nothing has used them.
    pub(super) fn mapped(&mut self, first: usize, end: usize) {
        let end = end.min(self.freed_in.len());
        if first < end {
            self.freed_in[first..end].fill(0);
        }
    }

    /// Whether the GPU is known to be done with page `page`.
    pub(super) fn is_idle(&self, page: usize) -> bool {
        self.freed_in
            .get(page)
            .is_none_or(|&e| e <= self.idle_through)
    }

    /// Whether a new mark may be recorded (few enough outstanding).
    pub(super) fn wants_mark(&self) -> bool {
        self.marks.len() < MAX_MARKS
    }

    /// Ends the current epoch with `mark`, recorded on the stream now.
    pub(super) fn end_epoch(&mut self, mark: E) {
        self.marks.push_back((self.epoch, mark));
        self.epoch += 1;
    }

    /// The oldest outstanding mark.
    pub(super) fn oldest_mark(&self) -> Option<&E> {
        self.marks.front().map(|(_, e)| e)
    }

    /// The oldest mark completed: its epoch and every earlier one are idle.
    /// Returns the mark for release.
    pub(super) fn oldest_mark_done(&mut self) -> Option<E> {
        let (epoch, mark) = self.marks.pop_front()?;
        self.idle_through = self.idle_through.max(epoch);
        Some(mark)
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
        self.marks.drain(..).map(|(_, e)| e)
    }

    /// Splits page runs `(start, bytes)` of a segment starting at `base`
    /// into the runs of idle pages and the runs of the others.
    pub(super) fn split_runs(&self, base: u64, runs: &[(u64, u64)], page: u64) -> (Runs, Runs) {
        let (mut idle, mut busy): (Runs, Runs) = (Vec::new(), Vec::new());
        for &(start, bytes) in runs {
            for addr in (start..start + bytes).step_by(page as usize) {
                let out = if self.is_idle(((addr - base) / page) as usize) {
                    &mut idle
                } else {
                    &mut busy
                };
                match out.last_mut() {
                    Some(last) if last.0 + last.1 == addr => last.1 += page,
                    _ => out.push((addr, page)),
                }
            }
        }
        (idle, busy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_become_idle_when_a_later_mark_completes() {
        let mut p: IdlePages<u32> = IdlePages::default();
        assert!(p.is_idle(3), "never used");
        p.freed(2, 4);
        assert!(!p.is_idle(2) && !p.is_idle(3) && p.is_idle(4));
        p.end_epoch(7); // mark of epoch 1
        p.freed(4, 5); // epoch 2
        assert_eq!(p.oldest_mark(), Some(&7));
        assert_eq!(p.oldest_mark_done(), Some(7));
        assert!(p.is_idle(2) && p.is_idle(3), "freed before the mark");
        assert!(!p.is_idle(4), "freed after it");
        p.freed(2, 3); // used and freed again: busy again
        assert!(!p.is_idle(2));
        let done: Vec<u32> = p.waited().collect();
        assert!(done.is_empty());
        assert!(p.is_idle(2) && p.is_idle(4));
        p.freed(4, 5);
        assert!(!p.is_idle(4), "a free after the wait is in a new epoch");
        p.mapped(4, 9);
        assert!(p.is_idle(4), "remapped pages are unused");
    }

    #[test]
    fn marks_are_capped_and_returned_by_a_wait() {
        let mut p: IdlePages<usize> = IdlePages::default();
        let mut n = 0;
        while p.wants_mark() {
            p.end_epoch(n);
            n += 1;
        }
        assert_eq!(n, MAX_MARKS);
        assert_eq!(p.waited().count(), MAX_MARKS);
        assert!(p.wants_mark());
    }

    #[test]
    fn runs_split_by_idleness() {
        let mut p: IdlePages<()> = IdlePages::default();
        let base = 1000;
        p.freed(1, 2); // page 1 busy
        p.freed(4, 6); // pages 4, 5 busy
        let (idle, busy) = p.split_runs(base, &[(base, 3 * 10), (base + 40, 30)], 10);
        assert_eq!(idle, vec![(base, 10), (base + 20, 10), (base + 60, 10)]);
        assert_eq!(busy, vec![(base + 10, 10), (base + 40, 20)]);
    }
}
