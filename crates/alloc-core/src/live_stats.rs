//! The statistics as the heap keeps them while it runs: every malloc and
//! free changes several of them, so they are held in the form that costs
//! least to update, and [`LiveStats::snapshot`] turns them into PyTorch's
//! model ([`Stats`]) when someone reads them.
//!
//! Two totals of [`Stat`] are left to the reader: the all-pools column is
//! the sum of the two pools' (all but its peak, which is tracked), and the
//! freed total follows from the allocated total and the current value. A
//! decrease then writes one number instead of four.
//!
//! The active counts follow the allocated ones while no block awaits
//! events: a block is active when allocated or awaiting events, so until
//! one awaits them the two move together, and only the allocated counts are
//! updated ([`LiveStats::follows`]).

use crate::stats::{PageMoves, Stat, StatArray, Stats};
use crate::types::Pool;

/// One quantity of the small and the large pool (indexed by
/// [`Pool::index`]), with the all-pools peak.
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
    pub(crate) fn increase(&mut self, pool: Pool, amount: u64) {
        self.apply(pool, amount as i64);
    }

    /// Subtracts `amount` from `pool`.
    #[inline(always)]
    pub(crate) fn decrease(&mut self, pool: Pool, amount: u64) {
        self.current[pool.index()] -= amount as i64;
    }

    /// Adds a signed change to `pool` (an increase when positive).
    ///
    /// Without a branch on the sign: the sign of a settled change (the
    /// inactive split counts, which splits and merges move both ways) is
    /// random from one operation to the next, and mispredicted it costs
    /// more than the arithmetic of both directions.
    #[inline(always)]
    pub(crate) fn apply(&mut self, pool: Pool, delta: i64) {
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
            self.stat(Pool::Small.index()),
            self.stat(Pool::Large.index()),
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

    /// The true values of a counter that was stored as `self` when it
    /// began to follow `leader`, whose allocated totals were `mark` then,
    /// and has moved with it since. Its peaks are the higher of its own and
    /// the leader's: the leader's peaks before the following began were
    /// never above its own (a follower is never below its leader, and both
    /// reset together), and since then it had the leader's values.
    fn followed(&self, leader: &Counter, mark: [u64; 2]) -> Counter {
        let mut c = *self;
        c.current = leader.current;
        for (p, mark) in mark.into_iter().enumerate() {
            c.peak[p] = c.peak[p].max(leader.peak[p]);
            c.allocated[p] += leader.allocated[p] - mark;
        }
        c.all_peak = c.all_peak.max(leader.all_peak);
        c
    }
}

/// Every statistic, as the heap updates them ([`Stats`]' fields, with a
/// [`Counter`] for each per-pool quantity).
#[derive(Clone, Debug, Default)]
pub(crate) struct LiveStats {
    pub(crate) allocation: Counter,
    pub(crate) segment: Counter,
    /// Stale while [`LiveStats::follows`]: see [`Counter::followed`].
    pub(crate) active: Counter,
    pub(crate) inactive_split: Counter,
    pub(crate) allocated_bytes: Counter,
    pub(crate) reserved_bytes: Counter,
    /// Stale while [`LiveStats::follows`], as `active`.
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
    /// Whether `active` and `active_bytes` are updated themselves; when
    /// not, they follow `allocation` and `allocated_bytes`.
    apart: bool,
    /// The allocated totals of `allocation` and `allocated_bytes` when
    /// the active counts last began to follow them.
    marks: [[u64; 2]; 2],
    /// Tests compare the statistics with the active counts always updated
    /// themselves: set (after [`LiveStats::part`]), they never follow.
    #[cfg(test)]
    pub(crate) never_follow: bool,
}

impl LiveStats {
    /// Whether the active counts follow the allocated ones, unchanged
    /// themselves: set while no block awaits events (the two then differ
    /// by nothing), so that a malloc or free updates three counters
    /// instead of five.
    #[inline(always)]
    pub(crate) fn follows(&self) -> bool {
        !self.apart
    }

    /// The active counts' true values: ([`LiveStats::active`],
    /// [`LiveStats::active_bytes`]) brought up to date if they follow.
    fn actives(&self) -> (Counter, Counter) {
        if self.apart {
            return (self.active, self.active_bytes);
        }
        (
            self.active.followed(&self.allocation, self.marks[0]),
            self.active_bytes
                .followed(&self.allocated_bytes, self.marks[1]),
        )
    }

    /// The active counts stop following (a block is about to await
    /// events): their stored values are brought up to date, and are
    /// updated from now on.
    pub(crate) fn part(&mut self) {
        (self.active, self.active_bytes) = self.actives();
        self.apart = true;
    }

    /// If the active counts equal the allocated ones (no block awaits
    /// events), they follow them again; returns whether they do.
    pub(crate) fn rejoin(&mut self) -> bool {
        #[cfg(test)]
        if self.never_follow {
            return false;
        }
        if self.apart
            && self.active.current == self.allocation.current
            && self.active_bytes.current == self.allocated_bytes.current
        {
            for (follower, leader) in [
                (&self.active, &self.allocation),
                (&self.active_bytes, &self.allocated_bytes),
            ] {
                debug_assert!(follower.peak[0] >= leader.peak[0]);
                debug_assert!(follower.peak[1] >= leader.peak[1]);
                debug_assert!(follower.all_peak >= leader.all_peak);
            }
            self.marks = [self.allocation.allocated, self.allocated_bytes.allocated];
            self.apart = false;
        }
        !self.apart
    }

    /// The statistics in PyTorch's model.
    pub(crate) fn snapshot(&self) -> Stats {
        let (active, active_bytes) = self.actives();
        Stats {
            allocation: self.allocation.array(),
            segment: self.segment.array(),
            active: active.array(),
            inactive_split: self.inactive_split.array(),
            allocated_bytes: self.allocated_bytes.array(),
            reserved_bytes: self.reserved_bytes.array(),
            active_bytes: active_bytes.array(),
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

    /// Applies `reset` to every counter, the active ones brought up to
    /// date first; if they followed the allocated ones, they follow again.
    fn reset_counters(&mut self, reset: fn(&mut Counter)) {
        let follows = self.follows();
        self.part();
        for c in self.counters_mut() {
            reset(c);
        }
        if follows {
            self.rejoin();
        }
    }

    /// Makes every peak equal to its current value (`reset_peak_memory_stats`).
    pub(crate) fn reset_peaks(&mut self) {
        self.reset_counters(Counter::reset_peak);
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    /// Clears cumulative totals and event counters (`reset_accumulated_memory_stats`).
    pub(crate) fn reset_accumulated(&mut self) {
        self.reset_counters(Counter::reset_accumulated);
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
                let pool = if small { Pool::Small } else { Pool::Large };
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
        live.part();
        for (i, c) in live.counters_mut().into_iter().enumerate() {
            c.increase(Pool::Large, i as u64 + 1);
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
        live.part();
        for c in live.counters_mut() {
            c.increase(Pool::Small, 10);
            c.decrease(Pool::Small, 4);
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

    /// `reset_accumulated_memory_stats` clears every event count, the
    /// page moves' included; the current values stay.
    #[test]
    fn reset_accumulated_clears_every_event_count() {
        let mut live = LiveStats::default();
        live.segment.increase(Pool::Large, 1);
        live.num_alloc_retries = 1;
        live.num_ooms = 2;
        live.num_sync_all_streams = 3;
        live.num_device_alloc = 4;
        live.num_device_free = 5;
        live.oversize_segments.increase(1);
        live.page_moves = PageMoves {
            rounds: 1,
            pages_unmapped: 2,
            busy_pages_reused: 3,
            pages_mapped: 4,
            stream_waits: 5,
            host_ns: 6,
        };
        live.reset_accumulated();
        let s = live.snapshot();
        let counts = [
            s.num_alloc_retries,
            s.num_ooms,
            s.num_sync_all_streams,
            s.num_device_alloc,
            s.num_device_free,
            s.oversize_segments.allocated,
        ];
        assert_eq!(counts, [0; 6]);
        assert_eq!(s.page_moves, PageMoves::default());
        assert_eq!((s.segment.all.current, s.oversize_segments.current), (1, 1));
    }
}
