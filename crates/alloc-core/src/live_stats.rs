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

use crate::device_totals::{DeviceTotals, Levels};
use crate::stats::{PageMoves, Stat, StatArray, Stats};
use crate::types::Pool;

/// One quantity of the small and the large pool (indexed by
/// [`Pool::index`]), with the all-pools peak: the value a reader gets
/// ([`LiveStats::counter`]); the heap updates the stored form through a
/// [`CounterMut`].
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

/// The quantities, in the order they are stored: those a malloc or free
/// changes first, so that their changing parts share as few cache lines as
/// they can.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Quantity {
    Allocation,
    AllocatedBytes,
    RequestedBytes,
    InactiveSplit,
    InactiveSplitBytes,
    /// Stale while [`LiveStats::follows`]: see [`Counter::followed`].
    Active,
    /// Stale while [`LiveStats::follows`], as `Active`.
    ActiveBytes,
    Segment,
    ReservedBytes,
}

impl Quantity {
    /// Every quantity, in storage order.
    pub(crate) const ALL: [Quantity; 9] = [
        Quantity::Allocation,
        Quantity::AllocatedBytes,
        Quantity::RequestedBytes,
        Quantity::InactiveSplit,
        Quantity::InactiveSplitBytes,
        Quantity::Active,
        Quantity::ActiveBytes,
        Quantity::Segment,
        Quantity::ReservedBytes,
    ];
}

/// The part of a counter every change writes: 32 bytes, two to a cache
/// line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Changing {
    current: [i64; 2],
    allocated: [u64; 2],
}

/// The part of a counter a change reads, and writes only at a new peak,
/// which is rare once the allocator runs steady.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Peaks {
    peak: [i64; 2],
    all_peak: i64,
}

/// Every counter's changing parts together, on cache lines of their own.
#[derive(Clone, Copy, Debug, Default)]
#[repr(align(64))]
struct ChangingParts([Changing; 9]);

/// The counters as stored: each split into what every change writes, what
/// it only reads, and what only the resets use. Held by counter (72 bytes
/// each), the five counters an allocation and a free change spread over
/// seven cache lines; split, their changing parts take three. With several
/// threads on one device every line an operation writes moves to the next
/// thread's core, and a line it only reads, unwritten, does not.
#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    changing: ChangingParts,
    peaks: [Peaks; 9],
    base: [[i64; 2]; 9],
}

impl Counters {
    fn get(&self, q: Quantity) -> Counter {
        let (c, p) = (self.changing.0[q as usize], self.peaks[q as usize]);
        Counter {
            current: c.current,
            peak: p.peak,
            allocated: c.allocated,
            base: self.base[q as usize],
            all_peak: p.all_peak,
        }
    }

    fn set(&mut self, q: Quantity, v: Counter) {
        let i = q as usize;
        self.changing.0[i] = Changing {
            current: v.current,
            allocated: v.allocated,
        };
        self.peaks[i] = Peaks {
            peak: v.peak,
            all_peak: v.all_peak,
        };
        self.base[i] = v.base;
    }
}

/// One counter of [`LiveStats`], to change.
pub(crate) struct CounterMut<'a> {
    changing: &'a mut Changing,
    peaks: &'a mut Peaks,
}

impl CounterMut<'_> {
    /// Adds `amount` to `pool`.
    #[inline(always)]
    pub(crate) fn increase(&mut self, pool: Pool, amount: u64) {
        self.apply(pool, amount as i64);
    }

    /// Subtracts `amount` from `pool`.
    #[inline(always)]
    pub(crate) fn decrease(&mut self, pool: Pool, amount: u64) {
        self.changing.current[pool.index()] -= amount as i64;
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
        let c = &mut *self.changing;
        let current = c.current[p] + delta;
        c.current[p] = current;
        c.allocated[p] += delta.max(0) as u64;
        // Branches, unlike the sign's: a new peak is rare once the
        // allocator runs steady, so they are predicted (and the peaks'
        // line is then only read).
        if current > self.peaks.peak[p] {
            self.peaks.peak[p] = current;
        }
        let all = c.current[0] + c.current[1];
        if all > self.peaks.all_peak {
            self.peaks.all_peak = all;
        }
    }
}

impl Counter {
    /// The present value of both pools together.
    #[inline]
    fn all_current(&self) -> i64 {
        self.current[0] + self.current[1]
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
/// counter for each per-pool [`Quantity`]).
#[derive(Clone, Debug, Default)]
pub(crate) struct LiveStats {
    counters: Counters,
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
    /// The most bytes reserved (both pools) since creation: what
    /// `unmap_free_pages` measures a new mapping against. The statistics'
    /// own peak of reserved bytes is that too, until the program resets the
    /// peaks (`reset_peak_memory_stats`) or an engine sharing its device
    /// hands its peaks over ([`LiveStats::publish_to`]); this one stays, so
    /// that the pages the allocator moves do not depend on when a program
    /// reads its peaks.
    reserved_mark: i64,
    /// The allocated peak (both pools) before the last
    /// [`LiveStats::reset_peaks`]: [`LiveStats::allocated_mark`] is the
    /// higher of it and the statistics' own peak since.
    allocated_mark_before_reset: i64,
    /// What [`LiveStats::publish_to`] last published.
    published: Levels,
    /// The allocated totals of `allocation` and `allocated_bytes` when
    /// the active counts last began to follow them.
    marks: [[u64; 2]; 2],
    /// Tests compare the statistics with the active counts always updated
    /// themselves: set (after [`LiveStats::part`]), they never follow.
    #[cfg(test)]
    pub(crate) never_follow: bool,
}

/// The active counts and the allocated counts they follow
/// ([`LiveStats::follows`]): (follower, leader).
const FOLLOWS: [(Quantity, Quantity); 2] = [
    (Quantity::Active, Quantity::Allocation),
    (Quantity::ActiveBytes, Quantity::AllocatedBytes),
];

/// Each quantity's leader by [`FOLLOWS`] (itself where it follows none).
const LEADERS: [usize; 9] = {
    let mut leaders = [0, 1, 2, 3, 4, 5, 6, 7, 8];
    let mut k = 0;
    while k < FOLLOWS.len() {
        leaders[FOLLOWS[k].0 as usize] = FOLLOWS[k].1 as usize;
        k += 1;
    }
    leaders
};

/// The order [`LiveStats::publish_to`] goes through the quantities in: the
/// followers of [`FOLLOWS`] first (they read their leaders' peaks, which
/// publishing starts again), then the others in storage order.
const PUBLISH_ORDER: [Quantity; 9] = {
    let mut order = Quantity::ALL;
    let mut n = 0;
    let mut followers = true;
    loop {
        let mut q = 0;
        while q < order.len() {
            if (LEADERS[q] != q) == followers {
                order[n] = Quantity::ALL[q];
                n += 1;
            }
            q += 1;
        }
        if !followers {
            break order;
        }
        followers = false;
    }
};

macro_rules! counter_accessors {
    ($($name:ident: $q:ident),* $(,)?) => {
        $(
            #[doc = concat!("The `", stringify!($q), "` counter, to change.")]
            #[inline(always)]
            pub(crate) fn $name(&mut self) -> CounterMut<'_> {
                self.at(Quantity::$q)
            }
        )*
    };
}

impl LiveStats {
    counter_accessors!(
        allocation: Allocation,
        allocated_bytes: AllocatedBytes,
        requested_bytes: RequestedBytes,
        inactive_split: InactiveSplit,
        inactive_split_bytes: InactiveSplitBytes,
        active: Active,
        active_bytes: ActiveBytes,
        segment: Segment,
        reserved_bytes: ReservedBytes,
    );

    /// Counter `q`, to change.
    #[inline(always)]
    pub(crate) fn at(&mut self, q: Quantity) -> CounterMut<'_> {
        let i = q as usize;
        CounterMut {
            changing: &mut self.counters.changing.0[i],
            peaks: &mut self.counters.peaks[i],
        }
    }

    /// Counter `q`'s stored value (stale for the active counts while they
    /// follow: [`LiveStats::actives`] has their true values).
    pub(crate) fn counter(&self, q: Quantity) -> Counter {
        self.counters.get(q)
    }

    /// Adds `bytes` reserved in `pool` (a segment made or grown, pages
    /// mapped), raising the reserved mark ([`LiveStats::reserved_mark`]).
    pub(crate) fn reserve(&mut self, pool: Pool, bytes: u64) {
        self.reserved_bytes().increase(pool, bytes);
        let all = self.all_current(Quantity::ReservedBytes);
        self.reserved_mark = self.reserved_mark.max(all);
    }

    /// The most bytes reserved since creation, whatever peaks were reset
    /// or handed to device totals since.
    #[inline]
    pub(crate) fn reserved_mark(&self) -> i64 {
        self.reserved_mark
    }

    /// The most bytes allocated (both pools) since creation: what
    /// `memory_budget_over_allocated` scales, whatever peaks the program
    /// reset since (a training loop that resets them every step to log
    /// the step's peak would otherwise lower the level to that step's
    /// start, and every growth past it would move pages). Only an engine
    /// alone on its device keeps it (one that publishes starts its peaks
    /// again at every publish), and only such an engine moves pages.
    #[inline]
    pub(crate) fn allocated_mark(&self) -> i64 {
        self.counters.peaks[Quantity::AllocatedBytes as usize]
            .all_peak
            .max(self.allocated_mark_before_reset)
    }

    /// The present value of both pools of `q` together.
    #[inline]
    pub(crate) fn all_current(&self, q: Quantity) -> i64 {
        let c = &self.counters.changing.0[q as usize];
        c.current[0] + c.current[1]
    }

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
        let (active, active_bytes) = (
            self.counter(Quantity::Active),
            self.counter(Quantity::ActiveBytes),
        );
        if self.apart {
            return (active, active_bytes);
        }
        (
            active.followed(&self.counter(Quantity::Allocation), self.marks[0]),
            active_bytes.followed(&self.counter(Quantity::AllocatedBytes), self.marks[1]),
        )
    }

    /// The active counts stop following (a block is about to await
    /// events): their stored values are brought up to date, and are
    /// updated from now on.
    pub(crate) fn part(&mut self) {
        let (active, active_bytes) = self.actives();
        self.counters.set(Quantity::Active, active);
        self.counters.set(Quantity::ActiveBytes, active_bytes);
        self.apart = true;
    }

    /// If the active counts equal the allocated ones (no block awaits
    /// events), they follow them again; returns whether they do.
    pub(crate) fn rejoin(&mut self) -> bool {
        #[cfg(test)]
        if self.never_follow {
            return false;
        }
        if !self.apart {
            return true;
        }
        let changing = &self.counters.changing.0;
        if FOLLOWS
            .iter()
            .any(|&(f, l)| changing[f as usize].current != changing[l as usize].current)
        {
            return false;
        }
        for (f, l) in FOLLOWS {
            let (follower, leader) = (
                &self.counters.peaks[f as usize],
                &self.counters.peaks[l as usize],
            );
            debug_assert!(follower.peak[0] >= leader.peak[0]);
            debug_assert!(follower.peak[1] >= leader.peak[1]);
            debug_assert!(follower.all_peak >= leader.all_peak);
        }
        self.marks = FOLLOWS.map(|(_, l)| changing[l as usize].allocated);
        self.apart = false;
        true
    }

    /// The counter that holds the values of quantity `q` (its index): its
    /// leader while it follows one ([`FOLLOWS`]), else `q` itself.
    #[inline]
    fn source(&self, q: usize) -> usize {
        if self.apart {
            q
        } else {
            LEADERS[q]
        }
    }

    /// The present value of every statistic with a peak, the active
    /// counts brought up to date.
    pub(crate) fn levels(&self) -> Levels {
        let changing = &self.counters.changing.0;
        Levels {
            pools: Quantity::ALL.map(|q| changing[self.source(q as usize)].current),
            oversize: [
                self.oversize_allocations.current,
                self.oversize_segments.current,
            ],
        }
    }

    /// Adds to device totals how far every statistic moved since the last
    /// publish, each by way of its peak since then (what an operation
    /// raised and lowered again reaches the totals at its highest), then
    /// starts every peak again from its present value. An engine that
    /// shares its device with others publishes after each operation, and
    /// its own peaks then only say how high a value went since the last
    /// publish, which is what the totals need; the device's peaks are the
    /// totals'. The peaks keep doing that work, so an engine alone on its
    /// device, which never publishes, pays nothing for it.
    pub(crate) fn publish_to(&mut self, totals: &DeviceTotals) {
        // A follower's values are its leader's and its peaks the higher of
        // its own and the leader's (as `Counter::followed` reads them), so
        // the leaders' peaks start again only after the followers have read
        // them (PUBLISH_ORDER).
        // Unrolled: each quantity's index is a constant, so its leader and
        // the bounds of every array it reads are known where it is inlined.
        macro_rules! publish_each {
            ($($n:literal)*) => { $(self.publish_quantity(PUBLISH_ORDER[$n] as usize, totals);)* };
        }
        publish_each!(0 1 2 3 4 5 6 7 8);
        for (k, stat) in [&mut self.oversize_allocations, &mut self.oversize_segments]
            .into_iter()
            .enumerate()
        {
            if stat.peak != stat.current || self.published.oversize[k] != stat.current {
                totals.move_oversize(k, self.published.oversize[k], stat.peak, stat.current);
                self.published.oversize[k] = stat.current;
                stat.reset_peak();
            }
        }
    }

    /// Publishes quantity `i` (see [`LiveStats::publish_to`]).
    #[inline(always)]
    fn publish_quantity(&mut self, i: usize, totals: &DeviceTotals) {
        let l = self.source(i);
        let now = self.counters.changing.0[l].current;
        let was = self.published.pools[i];
        let mut high = self.counters.peaks[i];
        if l != i {
            let leader = &self.counters.peaks[l];
            high.peak[0] = high.peak[0].max(leader.peak[0]);
            high.peak[1] = high.peak[1].max(leader.peak[1]);
            high.all_peak = high.all_peak.max(leader.all_peak);
        }
        let all = now[0] + now[1];
        // One test for "not moved since the last publish" (most of them).
        let moved = (was[0] ^ now[0])
            | (was[1] ^ now[1])
            | (high.peak[0] ^ now[0])
            | (high.peak[1] ^ now[1])
            | (high.all_peak ^ all);
        if moved == 0 {
            return;
        }
        totals.move_array(i, was, [high.peak[0], high.peak[1], high.all_peak], now);
        self.published.pools[i] = now;
        self.counters.peaks[i] = Peaks {
            peak: now,
            all_peak: all,
        };
    }

    /// The statistics in PyTorch's model.
    pub(crate) fn snapshot(&self) -> Stats {
        let (active, active_bytes) = self.actives();
        let array = |q| self.counter(q).array();
        Stats {
            allocation: array(Quantity::Allocation),
            segment: array(Quantity::Segment),
            active: active.array(),
            inactive_split: array(Quantity::InactiveSplit),
            allocated_bytes: array(Quantity::AllocatedBytes),
            reserved_bytes: array(Quantity::ReservedBytes),
            active_bytes: active_bytes.array(),
            inactive_split_bytes: array(Quantity::InactiveSplitBytes),
            requested_bytes: array(Quantity::RequestedBytes),
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

    /// Applies `reset` to every counter, the active ones brought up to
    /// date first; if they followed the allocated ones, they follow again.
    fn reset_counters(&mut self, reset: fn(&mut Counter)) {
        let follows = self.follows();
        self.part();
        for q in Quantity::ALL {
            let mut c = self.counter(q);
            reset(&mut c);
            self.counters.set(q, c);
        }
        if follows {
            self.rejoin();
        }
    }

    /// Makes every peak equal to its current value (`reset_peak_memory_stats`).
    /// The marks that decide page moves ([`LiveStats::reserved_mark`],
    /// [`LiveStats::allocated_mark`]) keep their values.
    pub(crate) fn reset_peaks(&mut self) {
        self.allocated_mark_before_reset = self.allocated_mark();
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

    /// Publishing to device totals ([`LiveStats::publish_to`]).
    mod publishing {
        use super::*;

        const SMALL: Pool = Pool::Small;
        const LARGE: Pool = Pool::Large;

        /// An engine's statistics that hold `small` and `large` allocated bytes
        /// (the active counts following them), published.
        fn hold(stats: &mut LiveStats, totals: &DeviceTotals, small: i64, large: i64) {
            let now = stats.levels().pools[1];
            stats.allocated_bytes().apply(SMALL, small - now[0]);
            stats.allocated_bytes().apply(LARGE, large - now[1]);
            stats.publish_to(totals);
        }

        #[test]
        fn followers_publish_before_their_leaders() {
            assert_eq!(
                PUBLISH_ORDER,
                [
                    Quantity::Active,
                    Quantity::ActiveBytes,
                    Quantity::Allocation,
                    Quantity::AllocatedBytes,
                    Quantity::RequestedBytes,
                    Quantity::InactiveSplit,
                    Quantity::InactiveSplitBytes,
                    Quantity::Segment,
                    Quantity::ReservedBytes,
                ]
            );
        }

        #[test]
        fn the_peak_is_the_peak_of_the_sum() {
            let totals = DeviceTotals::new();
            let (mut a, mut b) = (LiveStats::default(), LiveStats::default());
            hold(&mut a, &totals, 10, 0);
            hold(&mut b, &totals, 0, 30);
            hold(&mut a, &totals, 0, 0);
            hold(&mut b, &totals, 5, 0);
            let (now, peaks) = (totals.current(), totals.peaks());
            assert_eq!(now.pools[1], [5, 0]);
            assert_eq!(peaks.pools[1], [10, 30]);
            // Both pools: 10 + 30 = 40 at once, though no engine ever held 40.
            let device = totals.combine(&[]);
            assert_eq!(device.allocated_bytes.all.peak, 40);
            assert_eq!(device.allocated_bytes.all.current, 5);
            // The active bytes followed the allocated ones.
            assert_eq!(device.active_bytes.all.peak, 40);
        }

        #[test]
        fn a_value_raised_and_lowered_in_one_operation_reaches_its_high() {
            let totals = DeviceTotals::new();
            let (mut a, mut b) = (LiveStats::default(), LiveStats::default());
            hold(&mut b, &totals, 0, 100);
            // One operation of `a`: up by 50 in the small pool, then down again.
            a.allocated_bytes().increase(SMALL, 50);
            a.allocated_bytes().decrease(SMALL, 50);
            a.publish_to(&totals);
            assert_eq!(totals.current().pools[1], [0, 100]);
            assert_eq!(totals.combine(&[]).allocated_bytes.all.peak, 150);
            // Published, `a`'s peaks start again: a second publish adds nothing.
            a.publish_to(&totals);
            assert_eq!(totals.combine(&[]).allocated_bytes.all.peak, 150);
        }

        #[test]
        fn reset_peaks_starts_from_the_current_values() {
            let totals = DeviceTotals::new();
            let mut a = LiveStats::default();
            hold(&mut a, &totals, 0, 100);
            hold(&mut a, &totals, 0, 20);
            totals.reset_peaks();
            assert_eq!(totals.peaks().pools[1], [0, 20]);
            hold(&mut a, &totals, 0, 50);
            assert_eq!(totals.combine(&[]).allocated_bytes.all.peak, 50);
        }

        #[test]
        fn threads_publishing_at_once_leave_exact_sums() {
            const THREADS: i64 = 8;
            const STEPS: i64 = 2000;
            let totals = DeviceTotals::new();
            std::thread::scope(|s| {
                for t in 0..THREADS {
                    let totals = &totals;
                    s.spawn(move || {
                        let mut stats = LiveStats::default();
                        for step in 0..STEPS {
                            // Up by t + 1 on even steps, back down on odd ones.
                            let held = if step % 2 == 0 { t + 1 } else { 0 };
                            hold(&mut stats, totals, held, held * 2);
                        }
                        hold(&mut stats, totals, t, 0);
                    });
                }
            });
            let sum: i64 = (0..THREADS).sum();
            assert_eq!(totals.current().pools[1], [sum, 0]);
            let peaks = totals.peaks().pools[1];
            let most: i64 = (1..=THREADS).sum();
            // At least the largest one thread held, at most all at once.
            assert!((THREADS..=most).contains(&peaks[0]), "{peaks:?}");
            assert!((2 * THREADS..=2 * most).contains(&peaks[1]), "{peaks:?}");
        }
    }

    /// One change of a random sequence: (kind, which counter, small pool?,
    /// amount).
    fn changes() -> impl Strategy<Value = Vec<(u8, usize, bool, u64)>> {
        prop::collection::vec((0u8..20, 0usize..9, any::<bool>(), 0u64..1000), 0..400)
    }

    proptest! {
        /// Any sequence of changes to any counters, resets included, gives
        /// the same statistics through [`LiveStats`]' stored counters as
        /// through PyTorch's model kept directly for each.
        #[test]
        fn counters_match_the_stat_model(seq in changes()) {
            let mut live = LiveStats { never_follow: true, ..LiveStats::default() };
            live.part();
            let mut model = [StatArray::default(); 9];
            for (kind, which, small, amount) in seq {
                let (q, pool) = (Quantity::ALL[which], if small { Pool::Small } else { Pool::Large });
                let m = &mut model[which];
                let now = m.pool(pool).current;
                match kind {
                    0 => {
                        live.reset_peaks();
                        for s in model.iter_mut().flat_map(|a| [&mut a.all, &mut a.small_pool, &mut a.large_pool]) {
                            s.reset_peak();
                        }
                    }
                    1 => {
                        live.reset_accumulated();
                        for s in model.iter_mut().flat_map(|a| [&mut a.all, &mut a.small_pool, &mut a.large_pool]) {
                            s.reset_accumulated();
                        }
                    }
                    2..=8 => {
                        live.at(q).increase(pool, amount);
                        m.increase(pool, amount);
                    }
                    9..=14 => {
                        let amount = amount.min(now as u64);
                        live.at(q).decrease(pool, amount);
                        m.decrease(pool, amount);
                    }
                    _ => {
                        let delta = (amount as i64 - 500).max(-now);
                        live.at(q).apply(pool, delta);
                        m.apply(pool, delta);
                    }
                }
                for (q, m) in Quantity::ALL.into_iter().zip(&model) {
                    prop_assert_eq!(live.counter(q).array(), *m);
                    prop_assert_eq!(live.all_current(q), m.all.current);
                }
            }
        }
    }

    /// The counters an allocation and a free change keep their changing
    /// parts on three cache lines, apart from everything else.
    #[test]
    fn the_changing_parts_share_three_cache_lines() {
        assert_eq!(std::mem::size_of::<Changing>(), 32);
        assert_eq!(std::mem::align_of::<ChangingParts>(), 64);
        let hot = [
            Quantity::Allocation,
            Quantity::AllocatedBytes,
            Quantity::RequestedBytes,
            Quantity::InactiveSplit,
            Quantity::InactiveSplitBytes,
        ];
        let lines: std::collections::BTreeSet<usize> =
            hot.iter().map(|&q| q as usize * 32 / 64).collect();
        assert_eq!(lines.len(), 3);
    }

    #[test]
    fn snapshot_names_each_counter_in_its_field() {
        let mut live = LiveStats::default();
        live.part();
        let order = [
            Quantity::Allocation,
            Quantity::Segment,
            Quantity::Active,
            Quantity::InactiveSplit,
            Quantity::AllocatedBytes,
            Quantity::ReservedBytes,
            Quantity::ActiveBytes,
            Quantity::InactiveSplitBytes,
            Quantity::RequestedBytes,
        ];
        for (i, q) in order.into_iter().enumerate() {
            live.at(q).increase(Pool::Large, i as u64 + 1);
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
    fn the_marks_that_decide_page_moves_outlive_a_reset_of_the_peaks() {
        let mut live = LiveStats::default();
        live.reserve(Pool::Large, 100);
        live.allocated_bytes().increase(Pool::Large, 80);
        live.allocated_bytes().decrease(Pool::Large, 60);
        live.reset_peaks();
        let s = live.snapshot();
        assert_eq!(s.allocated_bytes.all.peak, 20);
        assert_eq!((live.allocated_mark(), live.reserved_mark()), (80, 100));
        // A new high after the reset raises the mark past the old one.
        live.allocated_bytes().increase(Pool::Large, 70);
        assert_eq!(live.allocated_mark(), 90);
    }

    #[test]
    fn resets_reach_every_counter() {
        let mut live = LiveStats::default();
        live.part();
        for q in Quantity::ALL {
            live.at(q).increase(Pool::Small, 10);
            live.at(q).decrease(Pool::Small, 4);
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
        live.segment().increase(Pool::Large, 1);
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
            blocks_lent: 7,
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
