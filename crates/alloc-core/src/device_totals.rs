//! Device-wide statistics of several engines that share one device.
//!
//! PyTorch keeps one set of statistics a device, and its peaks are peaks of
//! device-wide sums: `allocated_bytes.all.peak` is the most memory handed
//! out at any moment, whatever stream held it. An engine's own statistics
//! are exact for what it serves; when one device runs several engines (one
//! a stream, so that threads on their own streams do not queue on one
//! lock), the device's figures are their sums, and a sum's peak is not the
//! sum of the peaks. [`DeviceTotals`] keeps the sums as they change: after
//! each of its operations an engine publishes how far every statistic moved
//! (`Engine::publish_to`), one atomic add a changed value, and a value's
//! peak is the highest that any add left it at. Those adds are totally
//! ordered on each value, in an order that keeps every engine's own, so
//! each peak is exact for a sequence of the engines' operations that the
//! device could have run: the same guarantee one lock gives, without a lock.
//!
//! An operation may raise a value and lower it again before it returns (an
//! allocation in one pool served by freeing idle memory of the other, as
//! size-class does, raises and lowers the sum over pools). So an engine
//! publishes each value's move by way of the highest it reached since its
//! last publish, its own peak, which publishing starts again from the
//! present value: the totals rise to that and fall from it, and the
//! device's peak sees what the engine's own peak saw. The property test
//! `device_totals_of_one_engine_are_its_own_statistics` (alloc-policy's
//! `engine_props`) checks it after every operation of random sequences
//! under every policy and setting.
//!
//! ```
//! use alloc_core::{AllocatorConfig, DeviceTotals, SimMemory, SimStreams, StreamId, GIB, MIB};
//! use alloc_policy::AnyPolicy;
//!
//! let cfg = AllocatorConfig::default();
//! let engine = || AnyPolicy::engine(&cfg, SimMemory::new(GIB), SimStreams::new());
//! let (mut a, mut b) = (engine()?, engine()?);
//! let totals = DeviceTotals::new();
//!
//! let x = a.malloc(3 * MIB, StreamId(1))?;
//! a.publish_to(&totals);
//! let y = b.malloc(5 * MIB, StreamId(2))?;
//! b.publish_to(&totals);
//! a.free(x.addr)?;
//! a.publish_to(&totals);
//!
//! let device = totals.combine(&[a.stats(), b.stats()]);
//! assert_eq!(device.allocated_bytes.all.current, 5 * MIB as i64);
//! // Both blocks were out at once: the device's peak, not either engine's.
//! assert_eq!(device.allocated_bytes.all.peak, 8 * MIB as i64);
//! assert_eq!(device.allocation.all.allocated, 2);
//! # b.free(y.addr)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::atomic::{AtomicI64, Ordering};

use crate::stats::{Stat, StatArray, Stats};
use crate::types::Pool;

/// The statistics of PyTorch's model that have a pool split, in the order
/// [`Levels::pools`] holds them (an engine's own storage order).
const ARRAYS: usize = 9;
/// Where [`arrays`] puts the allocated and the reserved bytes.
const ALLOCATED_BYTES: usize = 1;
const RESERVED_BYTES: usize = 8;

/// The present value of every statistic that has a peak (`Engine::levels`,
/// [`DeviceTotals::current`], or [`Levels::of`] a [`Stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Levels {
    /// Per statistic (allocation, allocated bytes, requested bytes,
    /// inactive split, inactive split bytes, active, active bytes,
    /// segment, reserved bytes), the current value in each pool (indexed
    /// by [`Pool::index`]).
    pub pools: [[i64; 2]; ARRAYS],
    /// The current oversize allocations and oversize segments.
    pub oversize: [i64; 2],
}

/// The statistic arrays of `stats` in [`Levels::pools`]' order.
fn arrays(stats: &Stats) -> [&StatArray; ARRAYS] {
    [
        &stats.allocation,
        &stats.allocated_bytes,
        &stats.requested_bytes,
        &stats.inactive_split,
        &stats.inactive_split_bytes,
        &stats.active,
        &stats.active_bytes,
        &stats.segment,
        &stats.reserved_bytes,
    ]
}

/// [`arrays`], to fill in.
fn arrays_mut(stats: &mut Stats) -> [&mut StatArray; ARRAYS] {
    [
        &mut stats.allocation,
        &mut stats.allocated_bytes,
        &mut stats.requested_bytes,
        &mut stats.inactive_split,
        &mut stats.inactive_split_bytes,
        &mut stats.active,
        &mut stats.active_bytes,
        &mut stats.segment,
        &mut stats.reserved_bytes,
    ]
}

const POOLS: [Pool; 2] = [Pool::Small, Pool::Large];

impl Levels {
    /// Bytes handed out, both pools (`allocated_bytes.all.current`).
    pub fn allocated_bytes(&self) -> i64 {
        self.pools[ALLOCATED_BYTES].iter().sum()
    }

    /// Bytes reserved from the device, both pools
    /// (`reserved_bytes.all.current`).
    pub fn reserved_bytes(&self) -> i64 {
        self.pools[RESERVED_BYTES].iter().sum()
    }

    /// The levels of a statistics report.
    pub fn of(stats: &Stats) -> Levels {
        let mut levels = Levels::default();
        for (slot, array) in levels.pools.iter_mut().zip(arrays(stats)) {
            for pool in POOLS {
                slot[pool.index()] = array.pool(pool).current;
            }
        }
        let (a, s) = (&stats.oversize_allocations, &stats.oversize_segments);
        levels.oversize = [a.current, s.current];
        levels
    }
}

/// Values per statistic array: the small pool, the large pool, both.
const PER_ARRAY: usize = 3;
const ALL: usize = 2;
/// Every shared value: the arrays' three each, then the two oversize counts.
const SLOTS: usize = ARRAYS * PER_ARRAY + 2;

/// One number for each shared value, on cache lines of its own.
#[repr(align(64))]
struct Slots([AtomicI64; SLOTS]);

impl Default for Slots {
    fn default() -> Self {
        Slots(std::array::from_fn(|_| AtomicI64::new(0)))
    }
}

/// The device-wide current values and peaks of several engines' statistics
/// (see the module's documentation); `Sync`, shared by the engines of one
/// device.
#[derive(Default)]
pub struct DeviceTotals {
    /// Written by every publish that changes a value.
    current: Slots,
    /// Read by every change, written only at a new peak.
    peak: Slots,
}

impl std::fmt::Debug for DeviceTotals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceTotals")
            .field("current", &self.current())
            .finish_non_exhaustive()
    }
}

impl DeviceTotals {
    /// Totals of no engine yet: every value and peak 0.
    pub fn new() -> Self {
        DeviceTotals::default()
    }

    /// One statistic's move in an engine: each pool's value from `was` to
    /// `is` by way of `high` (the pools' highs, then their sum's), since
    /// the engine last published (`LiveStats::publish_to`).
    #[inline]
    pub(crate) fn move_array(&self, q: usize, was: [i64; 2], high: [i64; 3], is: [i64; 2]) {
        let base = q * PER_ARRAY;
        self.move_through(base, was[0], high[0], is[0]);
        self.move_through(base + 1, was[1], high[1], is[1]);
        self.move_through(base + ALL, was[0] + was[1], high[ALL], is[0] + is[1]);
    }

    /// The oversize count `k` (allocations, segments) moved from `was` to
    /// `is` by way of `high`.
    #[inline]
    pub(crate) fn move_oversize(&self, k: usize, was: i64, high: i64, is: i64) {
        self.move_through(ARRAYS * PER_ARRAY + k, was, high, is);
    }

    /// One value's move from `was` to `is` by way of `high`: a rise to the
    /// highest it reached, then the fall from there, so that the peak sees
    /// the value at its highest. `high` is an engine's peak since its last
    /// publish, so at least `is`; it is below `was` only after the engine's
    /// peaks were reset, and then the first step falls, which raises no peak.
    #[inline]
    fn move_through(&self, slot: usize, was: i64, high: i64, is: i64) {
        debug_assert!(high >= is, "a peak below its value: {high} < {is}");
        if high != was {
            self.add(slot, high - was);
        }
        if is != high {
            self.add(slot, is - high);
        }
    }

    /// One change of one value, and its peak if it is a new one.
    #[inline]
    fn add(&self, slot: usize, delta: i64) {
        // Relaxed: each value's adds are totally ordered whatever the
        // ordering asked for, and nothing else is published through them.
        let value = self.current.0[slot].fetch_add(delta, Ordering::Relaxed) + delta;
        if value > self.peak.0[slot].load(Ordering::Relaxed) {
            self.peak.0[slot].fetch_max(value, Ordering::Relaxed);
        }
    }

    /// The device-wide current values.
    pub fn current(&self) -> Levels {
        self.levels(&self.current)
    }

    /// The device-wide peaks of each pool's values.
    pub fn peaks(&self) -> Levels {
        self.levels(&self.peak)
    }

    fn levels(&self, slots: &Slots) -> Levels {
        let get = |slot: usize| slots.0[slot].load(Ordering::Relaxed);
        let mut levels = Levels::default();
        for (q, pools) in levels.pools.iter_mut().enumerate() {
            *pools = [get(q * PER_ARRAY), get(q * PER_ARRAY + 1)];
        }
        levels.oversize = [get(ARRAYS * PER_ARRAY), get(ARRAYS * PER_ARRAY + 1)];
        levels
    }

    /// The device's statistics in PyTorch's model, from the engines' own
    /// (`engines`: every engine of the device, each read after its last
    /// publish): current values and peaks are the totals', cumulative
    /// totals and event counts the engines' sums.
    pub fn combine(&self, engines: &[Stats]) -> Stats {
        let mut out = Stats::default();
        for s in engines {
            for (sum, one) in arrays_mut(&mut out).into_iter().zip(arrays(s)) {
                add_totals(&mut sum.all, &one.all);
                add_totals(&mut sum.small_pool, &one.small_pool);
                add_totals(&mut sum.large_pool, &one.large_pool);
            }
            add_totals(&mut out.oversize_allocations, &s.oversize_allocations);
            add_totals(&mut out.oversize_segments, &s.oversize_segments);
            out.num_alloc_retries += s.num_alloc_retries;
            out.num_ooms += s.num_ooms;
            out.num_sync_all_streams += s.num_sync_all_streams;
            out.num_device_alloc += s.num_device_alloc;
            out.num_device_free += s.num_device_free;
            out.page_moves += s.page_moves;
        }
        let get = |slots: &Slots, slot: usize| slots.0[slot].load(Ordering::Relaxed);
        for (q, array) in arrays_mut(&mut out).into_iter().enumerate() {
            for (k, stat) in [&mut array.small_pool, &mut array.large_pool, &mut array.all]
                .into_iter()
                .enumerate()
            {
                stat.current = get(&self.current, q * PER_ARRAY + k);
                stat.peak = get(&self.peak, q * PER_ARRAY + k);
            }
        }
        for (k, stat) in [&mut out.oversize_allocations, &mut out.oversize_segments]
            .into_iter()
            .enumerate()
        {
            stat.current = get(&self.current, ARRAYS * PER_ARRAY + k);
            stat.peak = get(&self.peak, ARRAYS * PER_ARRAY + k);
        }
        out
    }

    /// Makes every peak equal to its current value
    /// (`reset_peak_memory_stats`); exact while no engine publishes.
    pub fn reset_peaks(&self) {
        for (peak, current) in self.peak.0.iter().zip(&self.current.0) {
            peak.store(current.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }
}

/// Adds `one`'s cumulative totals to `sum`'s.
fn add_totals(sum: &mut Stat, one: &Stat) {
    sum.allocated += one.allocated;
    sum.freed += one.freed;
}

#[cfg(test)]
mod tests {
    use super::*;

    // Publishing from an engine's statistics: live_stats.rs's tests.

    #[test]
    fn combine_sums_the_engines_counts_and_totals() {
        let totals = DeviceTotals::new();
        let mut one = Stats::default();
        one.allocation.small_pool.allocated = 3;
        one.allocation.all.allocated = 3;
        one.allocation.all.freed = 1;
        one.num_device_alloc = 2;
        one.oversize_segments.allocated = 1;
        one.page_moves.pages_unmapped = 4;
        let device = totals.combine(&[one.clone(), one]);
        assert_eq!(device.allocation.small_pool.allocated, 6);
        assert_eq!(device.allocation.all.allocated, 6);
        assert_eq!(device.allocation.all.freed, 2);
        assert_eq!(device.num_device_alloc, 4);
        assert_eq!(device.oversize_segments.allocated, 2);
        assert_eq!(device.page_moves.pages_unmapped, 8);
    }

    #[test]
    fn levels_of_a_report_read_every_current_value() {
        let mut s = Stats::default();
        s.reserved_bytes.large_pool.current = 7;
        s.active.small_pool.current = 2;
        s.oversize_allocations.current = 1;
        s.allocated_bytes.small_pool.current = 3;
        let l = Levels::of(&s);
        assert_eq!((l.reserved_bytes(), l.allocated_bytes()), (7, 3));
        assert_eq!(l.pools[8][Pool::Large.index()], 7);
        assert_eq!(l.pools[5][Pool::Small.index()], 2);
        assert_eq!(l.oversize, [1, 0]);
    }
}
