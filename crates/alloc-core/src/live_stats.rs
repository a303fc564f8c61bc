//! The statistics as the heap keeps them while it runs: every malloc and
//! free changes several of them, so they are held in the form that costs
//! least to update, and [`LiveStats::snapshot`] turns them into PyTorch's
//! model ([`Stats`]) when someone reads them.
//!
//! Two totals of [`Stat`] are left to the reader: the all-pools column is
//! the sum of the two pools' (all but its peak, which is tracked), and the
//! freed total follows from the allocated total and the current value. A
//! decrease then writes one number instead of four.

use crate::stats::{PageMoves, Stat, StatArray, Stats};
use crate::types::PoolKind;

/// One quantity of the small and the large pool (indexed by
/// [`PoolKind::index`]), with the all-pools peak.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counter {
    current: [i64; 2],
    peak: [i64; 2],
    /// Sum of all increases since the totals were last reset.
    allocated: [u64; 2],
    /// The current value when the totals were last reset: the freed total
    /// is `allocated - (current - base)`.
    base: [i64; 2],
    /// Highest sum of both pools' current values.
    all_peak: i64,
}

impl Counter {
    /// Adds `amount` to `pool`.
    #[inline(always)]
    pub(crate) fn increase(&mut self, pool: PoolKind, amount: u64) {
        self.apply(pool, amount as i64);
    }

    /// Subtracts `amount` from `pool`.
    #[inline(always)]
    pub(crate) fn decrease(&mut self, pool: PoolKind, amount: u64) {
        self.current[pool.index()] -= amount as i64;
    }

    /// Adds a signed change to `pool` (an increase when positive).
    ///
    /// Without a branch on the sign: the sign of a settled change (the
    /// inactive split counts, which splits and merges move both ways) is
    /// random from one operation to the next, and mispredicted it costs
    /// more than the arithmetic of both directions.
    #[inline(always)]
    pub(crate) fn apply(&mut self, pool: PoolKind, delta: i64) {
        let p = pool.index();
        let current = self.current[p] + delta;
        self.current[p] = current;
        self.allocated[p] += delta.max(0) as u64;
        // Branches, unlike the sign's: a new peak is rare once the
        // allocator runs steady, so they are predicted.
        if current > self.peak[p] {
            self.peak[p] = current;
        }
        let all = self.current[0] + self.current[1];
        if all > self.all_peak {
            self.all_peak = all;
        }
    }

    /// The present value of both pools together.
    #[inline]
    pub(crate) fn all_current(&self) -> i64 {
        self.current[0] + self.current[1]
    }

    /// The highest value of both pools together.
    #[inline]
    pub(crate) fn all_peak(&self) -> i64 {
        self.all_peak
    }

    /// One pool in PyTorch's model.
    fn stat(&self, p: usize) -> Stat {
        Stat {
            current: self.current[p],
            peak: self.peak[p],
            allocated: self.allocated[p],
            freed: (self.allocated[p] as i64 - (self.current[p] - self.base[p])) as u64,
        }
    }

    /// The quantity in PyTorch's model: both pools and their sum.
    pub(crate) fn array(&self) -> StatArray {
        let (small, large) = (
            self.stat(PoolKind::Small.index()),
            self.stat(PoolKind::Large.index()),
        );
        StatArray {
            all: Stat {
                current: small.current + large.current,
                peak: self.all_peak,
                allocated: small.allocated + large.allocated,
                freed: small.freed + large.freed,
            },
            small_pool: small,
            large_pool: large,
        }
    }

    fn reset_peak(&mut self) {
        self.peak = self.current;
        self.all_peak = self.all_current();
    }

    fn reset_accumulated(&mut self) {
        self.allocated = [0; 2];
        self.base = self.current;
    }
}

/// Every statistic, as the heap updates them ([`Stats`]' fields, with a
/// [`Counter`] for each per-pool quantity).
#[derive(Clone, Debug, Default)]
pub(crate) struct LiveStats {
    pub(crate) allocation: Counter,
    pub(crate) segment: Counter,
    pub(crate) active: Counter,
    pub(crate) inactive_split: Counter,
    pub(crate) allocated_bytes: Counter,
    pub(crate) reserved_bytes: Counter,
    pub(crate) active_bytes: Counter,
    pub(crate) inactive_split_bytes: Counter,
    pub(crate) requested_bytes: Counter,
    pub(crate) num_alloc_retries: u64,
    pub(crate) num_ooms: u64,
    pub(crate) num_sync_all_streams: u64,
    pub(crate) num_device_alloc: u64,
    pub(crate) num_device_free: u64,
    pub(crate) oversize_allocations: Stat,
    pub(crate) oversize_segments: Stat,
    pub(crate) page_moves: PageMoves,
}

impl LiveStats {
    /// The statistics in PyTorch's model.
    pub(crate) fn snapshot(&self) -> Stats {
        Stats {
            allocation: self.allocation.array(),
            segment: self.segment.array(),
            active: self.active.array(),
            inactive_split: self.inactive_split.array(),
            allocated_bytes: self.allocated_bytes.array(),
            reserved_bytes: self.reserved_bytes.array(),
            active_bytes: self.active_bytes.array(),
            inactive_split_bytes: self.inactive_split_bytes.array(),
            requested_bytes: self.requested_bytes.array(),
            num_alloc_retries: self.num_alloc_retries,
            num_ooms: self.num_ooms,
            num_sync_all_streams: self.num_sync_all_streams,
            num_device_alloc: self.num_device_alloc,
            num_device_free: self.num_device_free,
            oversize_allocations: self.oversize_allocations,
            oversize_segments: self.oversize_segments,
            page_moves: self.page_moves,
        }
    }

    fn counters_mut(&mut self) -> [&mut Counter; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    /// Makes every peak equal to its current value (`reset_peak_memory_stats`).
    pub(crate) fn reset_peaks(&mut self) {
        for c in self.counters_mut() {
            c.reset_peak();
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    /// Clears cumulative totals and event counters (`reset_accumulated_memory_stats`).
    pub(crate) fn reset_accumulated(&mut self) {
        for c in self.counters_mut() {
            c.reset_accumulated();
        }
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
        self.page_moves = PageMoves::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One change of a random sequence: (kind, small pool?, amount).
    fn changes() -> impl Strategy<Value = Vec<(u8, bool, u64)>> {
        prop::collection::vec((0u8..20, any::<bool>(), 0u64..1000), 0..400)
    }

    proptest! {
        /// Any sequence of changes, resets included, gives the same
        /// statistics through a [`Counter`] as through PyTorch's model kept
        /// directly.
        #[test]
        fn counter_matches_the_stat_model(seq in changes()) {
            let mut counter = Counter::default();
            let mut model = StatArray::default();
            for (kind, small, amount) in seq {
                let pool = if small { PoolKind::Small } else { PoolKind::Large };
                let now = model.pool(pool).current;
                match kind {
                    0 => {
                        counter.reset_peak();
                        for s in [&mut model.all, &mut model.small_pool, &mut model.large_pool] {
                            s.reset_peak();
                        }
                    }
                    1 => {
                        counter.reset_accumulated();
                        for s in [&mut model.all, &mut model.small_pool, &mut model.large_pool] {
                            s.reset_accumulated();
                        }
                    }
                    2..=8 => {
                        counter.increase(pool, amount);
                        model.increase(pool, amount);
                    }
                    9..=14 => {
                        let amount = amount.min(now as u64);
                        counter.decrease(pool, amount);
                        model.decrease(pool, amount);
                    }
                    _ => {
                        let delta = (amount as i64 - 500).max(-now);
                        counter.apply(pool, delta);
                        model.apply(pool, delta);
                    }
                }
                prop_assert_eq!(counter.array(), model);
                prop_assert_eq!(counter.all_current(), model.all.current);
                prop_assert_eq!(counter.all_peak(), model.all.peak);
            }
        }
    }

    #[test]
    fn snapshot_names_each_counter_in_its_field() {
        let mut live = LiveStats::default();
        for (i, c) in live.counters_mut().into_iter().enumerate() {
            c.increase(PoolKind::Large, i as u64 + 1);
        }
        let s = live.snapshot();
        let seen = [
            s.allocation,
            s.segment,
            s.active,
            s.inactive_split,
            s.allocated_bytes,
            s.reserved_bytes,
            s.active_bytes,
            s.inactive_split_bytes,
            s.requested_bytes,
        ]
        .map(|a| a.large_pool.current);
        assert_eq!(seen, [1, 2, 3, 4, 5, 6, 7, 8, 9]);
    }

    #[test]
    fn resets_reach_every_counter() {
        let mut live = LiveStats::default();
        for c in live.counters_mut() {
            c.increase(PoolKind::Small, 10);
            c.decrease(PoolKind::Small, 4);
        }
        live.num_ooms = 1;
        live.reset_peaks();
        live.reset_accumulated();
        let s = live.snapshot();
        let want = Stat {
            current: 6,
            peak: 6,
            allocated: 0,
            freed: 0,
        };
        for a in [
            s.allocation,
            s.segment,
            s.active,
            s.requested_bytes,
            s.inactive_split_bytes,
        ] {
            assert_eq!(a.small_pool, want);
            assert_eq!(a.all, want);
        }
        assert_eq!(s.num_ooms, 0);
    }
}
