//! The statistics ledger: the live statistics in PyTorch's model and the
//! pending change of the operation in progress.
//!
//! The block arena ([`crate::heap::Heap`]) reports every change it makes
//! to a block or a segment here, as a few numbers (the pool, the block's
//! size and state, whether its segment is split). Changes of the segment
//! counts apply at once; changes of the block-derived counts are tallied
//! per pool and applied once per operation by [`Ledger::settle`], so peaks
//! and totals describe the states between operations. The one block-state
//! change of a plain `malloc` or `free` may apply at once instead
//! ([`Ledger::state_changed`] with `NOW`), which saves the tally.

use crate::live_stats::LiveStats;
use crate::stats::Stats;
use crate::types::{BlockState, Pool};

/// Net change of the block-derived statistics of one pool since the last
/// [`Ledger::settle`], indexed by the `T_*` constants.
type Tally = [i64; 8];
const T_ALLOCATION: usize = 0;
const T_ALLOCATED_BYTES: usize = 1;
const T_ACTIVE: usize = 2;
const T_ACTIVE_BYTES: usize = 3;
const T_REQUESTED_BYTES: usize = 4;
const T_INACTIVE_SPLIT: usize = 5;
const T_INACTIVE_SPLIT_BYTES: usize = 6;
const T_OVERSIZE: usize = 7;

/// The live statistics and the change pending until the operation in
/// progress settles.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    /// Live statistics; the engine adds its event counters to them.
    pub(crate) stats: LiveStats,
    /// Blocks and segments at or above this size count as oversize
    /// (PyTorch's `max_split_size`).
    oversize_threshold: u64,
    /// Statistics change (per pool) of the operation in progress.
    tally: [Tally; 2],
    /// Whether a tally holds block-state changes (anything but the inactive
    /// split counts) since the last settle: changes that would apply at
    /// once ([`Ledger::state_changed`] with `NOW`) are tallied too, so that
    /// the operation's net change is what counts. Also set from one settle
    /// to the next while the active counts do not follow the allocated
    /// ones ([`LiveStats::follows`]): changes applied at once update only
    /// those that follow.
    states_tallied: bool,
    /// Direction (1 or -1, 0 for none) of the block-state changes applied
    /// at once since the last settle, to check that no tallied change of
    /// the same operation goes the other way.
    #[cfg(debug_assertions)]
    applied_sign: i64,
}

/// Adds (`sign = 1`) or removes (`sign = -1`) the contribution of one block
/// with these attributes to a pool's tally.
#[inline(always)]
fn contribute(
    t: &mut Tally,
    sign: i64,
    state: BlockState,
    split: bool,
    size: u64,
    requested: u64,
    oversize_threshold: u64,
) {
    let (bytes, requested) = (size as i64 * sign, requested as i64 * sign);
    match state {
        BlockState::Free => {
            if split {
                t[T_INACTIVE_SPLIT] += sign;
                t[T_INACTIVE_SPLIT_BYTES] += bytes;
            }
        }
        state => {
            t[T_ACTIVE] += sign;
            t[T_ACTIVE_BYTES] += bytes;
            t[T_REQUESTED_BYTES] += requested;
            if state == BlockState::Allocated {
                t[T_ALLOCATION] += sign;
                t[T_ALLOCATED_BYTES] += bytes;
                if size >= oversize_threshold {
                    t[T_OVERSIZE] += sign;
                }
            }
        }
    }
}

impl Ledger {
    /// An empty ledger; `oversize_threshold` as in
    /// [`Ledger::oversize_threshold`].
    pub(crate) fn new(oversize_threshold: u64) -> Self {
        Ledger {
            oversize_threshold,
            ..Ledger::default()
        }
    }

    /// The statistics in PyTorch's model, as of the last settle (the
    /// segment counts and event counters as of now).
    pub(crate) fn snapshot(&self) -> Stats {
        self.stats.snapshot()
    }

    /// The size from which blocks and segments count as oversize.
    #[inline]
    pub(crate) fn oversize_threshold(&self) -> u64 {
        self.oversize_threshold
    }

    /// The tally of `pool`.
    #[inline(always)]
    fn tally_mut(&mut self, pool: Pool) -> &mut Tally {
        &mut self.tally[pool.index()]
    }

    /// Adds (`sign = 1`) or removes (`sign = -1`) one block's contribution
    /// to the pending tally: a mutation removes the contributions of the
    /// blocks it touches, changes them, and adds them back. `split`: the
    /// block's segment has more than one block.
    #[inline]
    pub(crate) fn account(
        &mut self,
        pool: Pool,
        sign: i64,
        state: BlockState,
        split: bool,
        size: u64,
        requested: u64,
    ) {
        self.states_tallied |= state != BlockState::Free;
        let threshold = self.oversize_threshold;
        contribute(
            self.tally_mut(pool),
            sign,
            state,
            split,
            size,
            requested,
            threshold,
        );
    }

    /// A free block of `whole` bytes was split in two free blocks;
    /// `was_alone`: it was its segment's only block (so it did not count
    /// as inactive split before).
    #[inline(always)]
    pub(crate) fn block_split(&mut self, pool: Pool, whole: u64, was_alone: bool) {
        let unsplit = i64::from(was_alone);
        let t = self.tally_mut(pool);
        t[T_INACTIVE_SPLIT] += 1 + unsplit;
        t[T_INACTIVE_SPLIT_BYTES] += unsplit * whole as i64;
    }

    /// Two free blocks were merged into one of `merged` bytes; `now_alone`:
    /// it is its segment's only block now (so it no longer counts as
    /// inactive split).
    #[inline(always)]
    pub(crate) fn blocks_merged(&mut self, pool: Pool, merged: u64, now_alone: bool) {
        let unsplit = i64::from(now_alone);
        let t = self.tally_mut(pool);
        t[T_INACTIVE_SPLIT] -= 1 + unsplit;
        t[T_INACTIVE_SPLIT_BYTES] -= unsplit * merged as i64;
    }

    /// A block of `size` bytes became allocated (`sign = 1`, `requested`
    /// bytes asked for) or free (`sign = -1`, `requested` the bytes it had
    /// been asked for); `split`: its segment has more than one block.
    ///
    /// With `NOW`, the change of the allocated and requested counts applies
    /// at once instead of at the settle, unless block-state changes are
    /// already tallied (then it is tallied with them). The caller's
    /// operation must change no other block's state the other way (only the
    /// inactive split counts, which are always tallied), so that the totals
    /// and peaks are those of the operation's net change: that is the block
    /// a `malloc` hands out or a `free` gives back.
    #[inline(always)]
    pub(crate) fn state_changed<const NOW: bool>(
        &mut self,
        pool: Pool,
        sign: i64,
        size: u64,
        requested: u64,
        split: bool,
    ) {
        let oversize = size >= self.oversize_threshold;
        if split {
            // A free block of a split segment counts as inactive split.
            let t = self.tally_mut(pool);
            t[T_INACTIVE_SPLIT] -= sign;
            t[T_INACTIVE_SPLIT_BYTES] -= sign * size as i64;
        }
        if NOW && !self.states_tallied {
            self.apply_states(pool, sign, size, requested, oversize);
            return;
        }
        self.states_tallied = true;
        let (size, requested) = (size as i64, requested as i64);
        let t = self.tally_mut(pool);
        t[T_ACTIVE] += sign;
        t[T_ACTIVE_BYTES] += sign * size;
        t[T_REQUESTED_BYTES] += sign * requested;
        t[T_ALLOCATION] += sign;
        t[T_ALLOCATED_BYTES] += sign * size;
        t[T_OVERSIZE] += sign * i64::from(oversize);
    }

    /// A block changed state other than between free and allocated (to or
    /// from awaiting events): `old` and `new` are its state and requested
    /// bytes before and after; `split` as in [`Ledger::account`].
    #[inline(always)]
    pub(crate) fn state_changed_other(
        &mut self,
        pool: Pool,
        size: u64,
        split: bool,
        old: (BlockState, u64),
        new: (BlockState, u64),
    ) {
        self.states_tallied = true;
        // A block awaiting events is active but not allocated: the active
        // counts go their own way until none is left.
        self.stats.part();
        let threshold = self.oversize_threshold;
        let t = self.tally_mut(pool);
        contribute(t, -1, old.0, split, size, old.1, threshold);
        contribute(t, 1, new.0, split, size, new.1, threshold);
    }

    /// Applies the statistics change of one block becoming allocated
    /// (`sign = 1`) or free (`sign = -1`) now.
    #[inline(always)]
    fn apply_states(&mut self, pool: Pool, sign: i64, size: u64, requested: u64, oversize: bool) {
        #[cfg(debug_assertions)]
        {
            debug_assert!(
                self.applied_sign != -sign,
                "opposite changes in one operation"
            );
            self.applied_sign = sign;
        }
        // One copy per pool, so that the pool's column is a constant offset
        // in each update instead of an address computed for each.
        match pool {
            Pool::Small => self.apply_states_in(Pool::Small, sign, size, requested, oversize),
            Pool::Large => self.apply_states_in(Pool::Large, sign, size, requested, oversize),
        }
    }

    /// [`Ledger::apply_states`] for one pool.
    #[inline(always)]
    fn apply_states_in(
        &mut self,
        pool: Pool,
        sign: i64,
        size: u64,
        requested: u64,
        oversize: bool,
    ) {
        // The active counts follow these (changes are applied at once
        // only while they do).
        let s = &mut self.stats;
        debug_assert!(s.follows());
        if sign > 0 {
            s.allocation().increase(pool, 1);
            s.allocated_bytes().increase(pool, size);
            s.requested_bytes().increase(pool, requested);
            if oversize {
                s.oversize_allocations.increase(1);
            }
        } else {
            s.allocation().decrease(pool, 1);
            s.allocated_bytes().decrease(pool, size);
            s.requested_bytes().decrease(pool, requested);
            if oversize {
                s.oversize_allocations.decrease(1);
            }
        }
    }

    /// A segment of `size` bytes was made.
    pub(crate) fn segment_added(&mut self, pool: Pool, size: u64) {
        self.stats.segment().increase(pool, 1);
        self.stats.reserve(pool, size);
        if size >= self.oversize_threshold {
            self.stats.oversize_segments.increase(1);
        }
    }

    /// A segment of `size` bytes, `unmapped` of them not mapped, was
    /// removed (its blocks' contributions were removed with
    /// [`Ledger::account`]).
    pub(crate) fn segment_removed(&mut self, pool: Pool, size: u64, unmapped: u64) {
        self.stats.segment().decrease(pool, 1);
        self.stats.reserved_bytes().decrease(pool, size - unmapped);
        if size >= self.oversize_threshold {
            self.stats.oversize_segments.decrease(1);
        }
    }

    /// A segment grew from `old` to `new` bytes, all of them mapped.
    pub(crate) fn segment_grown(&mut self, pool: Pool, old: u64, new: u64) {
        self.resized(old, new);
        self.stats.reserve(pool, new - old);
    }

    /// A segment shrank from `old` to `new` bytes; `unmapped` of the bytes
    /// cut off were not mapped (so they were not reserved).
    pub(crate) fn segment_shrunk(&mut self, pool: Pool, old: u64, new: u64, unmapped: u64) {
        self.resized(old, new);
        self.stats
            .reserved_bytes()
            .decrease(pool, old - new - unmapped);
    }

    /// A segment's size changes from `old` to `new` bytes: the oversize
    /// segment count follows it across the threshold.
    fn resized(&mut self, old: u64, new: u64) {
        let (was, is) = (
            old >= self.oversize_threshold,
            new >= self.oversize_threshold,
        );
        if is && !was {
            self.stats.oversize_segments.increase(1);
        } else if was && !is {
            self.stats.oversize_segments.decrease(1);
        }
    }

    /// `bytes` of pages inside a segment were unmapped: they no longer
    /// count as reserved.
    pub(crate) fn pages_unmapped(&mut self, pool: Pool, bytes: u64) {
        self.stats.reserved_bytes().decrease(pool, bytes);
    }

    /// `bytes` of unmapped pages inside a segment were mapped again.
    pub(crate) fn pages_mapped(&mut self, pool: Pool, bytes: u64) {
        self.stats.reserve(pool, bytes);
    }

    /// Changes the size from which blocks and segments count as oversize
    /// (`max_split_size_mb` changed at run time): the current oversize
    /// counts are recounted under the new threshold, so that later frees
    /// and releases undo exactly what they count. `segments` gives the
    /// size of every segment, `allocated` the pool and size of every
    /// allocated block. Settles.
    pub(crate) fn set_oversize_threshold(
        &mut self,
        threshold: u64,
        segments: impl Iterator<Item = u64>,
        allocated: impl Iterator<Item = (Pool, u64)>,
    ) {
        let old = std::mem::replace(&mut self.oversize_threshold, threshold);
        if old == threshold {
            return;
        }
        let counts = |size: u64, t: u64| i64::from(size >= t);
        let mut changed = 0;
        for size in segments {
            changed += counts(size, threshold) - counts(size, old);
        }
        self.stats.oversize_segments.apply(changed);
        for (pool, size) in allocated {
            let delta = counts(size, threshold) - counts(size, old);
            if delta != 0 {
                self.tally_mut(pool)[T_OVERSIZE] += delta;
                self.states_tallied = true;
            }
        }
        self.settle();
    }

    /// Applies the net change tallied since the last call to the
    /// statistics. The engine calls it once at the end of every operation,
    /// so peaks and totals describe states between operations.
    #[inline]
    pub(crate) fn settle(&mut self) {
        // A pool's tally is read, not a flag of it kept: every split, merge
        // and state change stored a flag, and a zero change applies as
        // nothing. Block-state changes settle both pools.
        if self.states_tallied {
            self.settle_pool::<true>();
            self.settle_pool::<false>();
            self.settled_states();
        } else {
            let split_changed = |t: &Tally| (t[T_INACTIVE_SPLIT] | t[T_INACTIVE_SPLIT_BYTES]) != 0;
            if split_changed(&self.tally[Pool::Small.index()]) {
                self.settle_split::<true>();
            }
            if split_changed(&self.tally[Pool::Large.index()]) {
                self.settle_split::<false>();
            }
        }
        #[cfg(debug_assertions)]
        {
            self.applied_sign = 0;
        }
    }

    /// The end of a settle that applied tallied block-state changes: if
    /// the active counts follow the allocated ones (again), changes may
    /// apply at once from the next operation on.
    #[inline(never)]
    fn settled_states(&mut self) {
        self.states_tallied = !self.stats.rejoin();
    }

    /// Applies one pool's tallied change of the inactive split counts,
    /// the settle of an operation that changed no block's state.
    // Out of line and apart from `settle_pool`, which no longer tests
    // whether states were tallied on this path; inlined into `settle`, it
    // cost more.
    #[inline(never)]
    fn settle_split<const SMALL: bool>(&mut self) {
        self.apply_split::<SMALL>();
    }

    /// The body of [`Ledger::settle_split`], inlined into `settle_pool`.
    #[inline(always)]
    fn apply_split<const SMALL: bool>(&mut self) {
        let pool = pool_of::<SMALL>();
        let t = &mut self.tally[pool.index()];
        let split = std::mem::take(&mut t[T_INACTIVE_SPLIT]);
        let split_bytes = std::mem::take(&mut t[T_INACTIVE_SPLIT_BYTES]);
        let s = &mut self.stats;
        s.inactive_split().apply(pool, split);
        s.inactive_split_bytes().apply(pool, split_bytes);
    }

    /// Applies one pool's tallied change, the settle of an operation that
    /// changed block states.
    // Kept out of line: inlined into the caller, the compiler keeps every
    // statistic in registers across both pools and spills heavily. One copy
    // per pool, so that the pool's column is a constant offset.
    #[inline(never)]
    fn settle_pool<const SMALL: bool>(&mut self) {
        let pool = pool_of::<SMALL>();
        let p = pool.index();
        self.apply_split::<SMALL>();
        let t = std::mem::take(&mut self.tally[p]);
        let s = &mut self.stats;
        #[cfg(debug_assertions)]
        for q in [
            T_ALLOCATION,
            T_ALLOCATED_BYTES,
            T_ACTIVE,
            T_ACTIVE_BYTES,
            T_REQUESTED_BYTES,
            T_OVERSIZE,
        ] {
            debug_assert!(
                t[q] * self.applied_sign >= 0,
                "a tallied change goes against one applied at once"
            );
        }
        s.allocation().apply(pool, t[T_ALLOCATION]);
        s.allocated_bytes().apply(pool, t[T_ALLOCATED_BYTES]);
        if s.follows() {
            // No block awaited events in this operation either.
            debug_assert_eq!(t[T_ACTIVE], t[T_ALLOCATION]);
            debug_assert_eq!(t[T_ACTIVE_BYTES], t[T_ALLOCATED_BYTES]);
        } else {
            s.active().apply(pool, t[T_ACTIVE]);
            s.active_bytes().apply(pool, t[T_ACTIVE_BYTES]);
        }
        s.requested_bytes().apply(pool, t[T_REQUESTED_BYTES]);
        s.oversize_allocations.apply(t[T_OVERSIZE]);
    }

    /// Makes the active counts never follow the allocated ones, so that
    /// every change is tallied and they are always updated (to check that
    /// following them changes nothing).
    #[cfg(test)]
    pub(crate) fn never_follow(&mut self) {
        self.stats.part();
        self.stats.never_follow = true;
        self.states_tallied = true;
    }
}

/// The pool of a settle's copy: `SMALL` names the small pool.
#[inline(always)]
const fn pool_of<const SMALL: bool>() -> Pool {
    if SMALL {
        Pool::Small
    } else {
        Pool::Large
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LARGE: Pool = Pool::Large;
    const SMALL: Pool = Pool::Small;

    #[test]
    fn splits_and_merges_count_at_the_settle() {
        let mut l = Ledger::new(u64::MAX);
        l.segment_added(LARGE, 1000);
        // 1000 bytes split into 300 + 700, then 700 into 300 + 400.
        l.block_split(LARGE, 1000, true);
        l.block_split(LARGE, 700, false);
        assert_eq!(l.snapshot().inactive_split.all.current, 0, "tallied");
        l.settle();
        let s = l.snapshot();
        assert_eq!(s.inactive_split.all.current, 3);
        assert_eq!(s.inactive_split_bytes.all.current, 1000);
        assert_eq!(s.inactive_split.large_pool.current, 3);
        assert_eq!(s.inactive_split.small_pool.current, 0);
        // Merged back into one block alone in its segment.
        l.blocks_merged(LARGE, 700, false);
        l.blocks_merged(LARGE, 1000, true);
        l.settle();
        let s = l.snapshot();
        assert_eq!(s.inactive_split.all.current, 0);
        assert_eq!(s.inactive_split_bytes.all.current, 0);
        assert_eq!(s.inactive_split.all.peak, 3);
        assert_eq!(s.segment.all.current, 1);
        assert_eq!(s.reserved_bytes.all.current, 1000);
    }

    #[test]
    fn a_change_counted_now_applies_before_the_settle() {
        let mut now = Ledger::new(u64::MAX);
        let mut later = Ledger::new(u64::MAX);
        now.state_changed::<true>(SMALL, 1, 512, 500, false);
        later.state_changed::<false>(SMALL, 1, 512, 500, false);
        assert_eq!(now.snapshot().allocated_bytes.all.current, 512);
        assert_eq!(later.snapshot().allocated_bytes.all.current, 0);
        now.settle();
        later.settle();
        assert_eq!(now.snapshot(), later.snapshot());
        let s = now.snapshot();
        assert_eq!(s.allocation.small_pool.current, 1);
        assert_eq!(s.active_bytes.all.current, 512);
        assert_eq!(s.requested_bytes.all.current, 500);
    }

    #[test]
    fn a_change_counted_now_after_tallied_ones_is_tallied() {
        // Freed then allocated again in one operation: the allocated count
        // does not move, so its peak and totals see no step.
        let mut l = Ledger::new(u64::MAX);
        l.state_changed::<true>(LARGE, 1, 4096, 4096, false);
        l.settle();
        l.state_changed::<false>(LARGE, -1, 4096, 4096, false);
        l.state_changed::<true>(LARGE, 1, 4096, 4000, false);
        assert_eq!(l.snapshot().allocated_bytes.all.current, 4096);
        l.settle();
        let s = l.snapshot();
        assert_eq!(s.allocation.all.current, 1);
        assert_eq!(s.allocation.all.peak, 1);
        assert_eq!(s.allocation.all.allocated, 1, "the net change counts");
        assert_eq!(s.requested_bytes.all.current, 4000);
    }

    #[test]
    fn a_block_awaiting_events_stays_active() {
        let mut l = Ledger::new(u64::MAX);
        l.segment_added(LARGE, 4096);
        l.block_split(LARGE, 4096, true);
        l.state_changed::<true>(LARGE, 1, 2048, 2000, true);
        l.settle();
        let allocated = (BlockState::Allocated, 2000);
        let awaiting = (BlockState::AwaitingEvents, 2000);
        l.state_changed_other(LARGE, 2048, true, allocated, awaiting);
        l.settle();
        let s = l.snapshot();
        assert_eq!(s.allocation.all.current, 0);
        assert_eq!(s.active.all.current, 1);
        assert_eq!(s.active_bytes.all.current, 2048);
        assert_eq!(s.requested_bytes.all.current, 2000);
        assert_eq!(s.inactive_split.all.current, 1);
        l.state_changed_other(LARGE, 2048, true, awaiting, (BlockState::Free, 0));
        l.settle();
        let s = l.snapshot();
        assert_eq!(s.active.all.current, 0);
        assert_eq!(s.active.all.peak, 1);
        assert_eq!(s.requested_bytes.all.current, 0);
        assert_eq!(s.inactive_split.all.current, 2);
        assert_eq!(s.inactive_split_bytes.all.current, 4096);
        // The active counts follow the allocated ones again.
        l.state_changed::<true>(LARGE, 1, 2048, 10, true);
        assert_eq!(l.snapshot().allocation.all.current, 1);
        l.settle();
        let s = l.snapshot();
        assert_eq!(s.active.all.current, 1);
        assert_eq!(s.active.all.allocated, 2);
        assert_eq!(s.allocation.all.allocated, 2);
    }

    #[test]
    fn accounted_contributions_cancel() {
        let mut l = Ledger::new(100);
        for state in [
            BlockState::Free,
            BlockState::Allocated,
            BlockState::AwaitingEvents,
        ] {
            l.account(SMALL, -1, state, true, 300, 200);
            l.account(SMALL, 1, state, true, 300, 200);
        }
        l.settle();
        assert_eq!(l.snapshot(), Ledger::new(100).snapshot());
    }

    #[test]
    fn segments_count_as_oversize_across_the_threshold() {
        let mut l = Ledger::new(1000);
        l.segment_added(LARGE, 800);
        assert_eq!(l.snapshot().oversize_segments.current, 0);
        l.segment_grown(LARGE, 800, 1200);
        assert_eq!(l.snapshot().oversize_segments.current, 1);
        assert_eq!(l.snapshot().reserved_bytes.all.current, 1200);
        l.pages_unmapped(LARGE, 200);
        assert_eq!(l.snapshot().reserved_bytes.all.current, 1000);
        l.pages_mapped(LARGE, 100);
        // 300 bytes cut off, 100 of them unmapped.
        l.segment_shrunk(LARGE, 1200, 900, 100);
        let s = l.snapshot();
        assert_eq!(s.oversize_segments.current, 0);
        assert_eq!(s.oversize_segments.peak, 1);
        assert_eq!(s.reserved_bytes.all.current, 900);
        assert_eq!(s.reserved_bytes.all.peak, 1200);
        l.segment_removed(LARGE, 900, 0);
        let s = l.snapshot();
        assert_eq!(s.reserved_bytes.all.current, 0);
        assert_eq!(s.segment.all.current, 0);
    }

    #[test]
    fn a_new_threshold_recounts_what_is_oversize() {
        let mut l = Ledger::new(u64::MAX);
        l.segment_added(LARGE, 4096);
        l.state_changed::<true>(LARGE, 1, 4096, 4096, false);
        l.settle();
        assert_eq!(l.snapshot().oversize_allocations.current, 0);
        l.set_oversize_threshold(4096, [4096].into_iter(), [(LARGE, 4096)].into_iter());
        let s = l.snapshot();
        assert_eq!(s.oversize_allocations.current, 1);
        assert_eq!(s.oversize_segments.current, 1);
        // The free and the release undo exactly what was recounted.
        l.state_changed::<true>(LARGE, -1, 4096, 4096, false);
        l.settle();
        l.segment_removed(LARGE, 4096, 0);
        let s = l.snapshot();
        assert_eq!(s.oversize_allocations.current, 0);
        assert_eq!(s.oversize_segments.current, 0);
        assert_eq!(l.oversize_threshold(), 4096);
    }
}
