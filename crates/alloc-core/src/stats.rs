//! Statistics in PyTorch's model (`torch.cuda.memory_stats()`): each quantity
//! has a current value, a peak, and cumulative allocated / freed totals, kept for
//! all pools together and for the small and large pools apart. A [`Stats`]
//! is a report: `Engine::stats()` assembles one from the counters the heap
//! updates, and resets go through the engine (`reset_peak_stats`,
//! `reset_accumulated_stats`).

use serde::Serialize;

use crate::types::Pool;

/// One tracked quantity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Stat {
    /// Present value.
    pub current: i64,
    /// Highest value since creation or the last `reset_peak`.
    pub peak: i64,
    /// Sum of all increases.
    pub allocated: u64,
    /// Sum of all decreases.
    pub freed: u64,
}

impl Stat {
    /// Adds `amount` to the current value.
    #[inline]
    pub fn increase(&mut self, amount: u64) {
        self.current += amount as i64;
        self.allocated += amount;
        if self.current > self.peak {
            self.peak = self.current;
        }
    }

    /// Subtracts `amount` from the current value.
    #[inline]
    pub fn decrease(&mut self, amount: u64) {
        self.current -= amount as i64;
        self.freed += amount;
    }

    /// Adds a signed change (an increase when positive).
    ///
    /// Without a branch: the sign of a settled change (the inactive split
    /// counts, which splits and merges move both ways) is random from one
    /// operation to the next, and mispredicted it cost more than the
    /// arithmetic of both directions. Same result as [`Stat::increase`] or
    /// [`Stat::decrease`] (nothing for 0).
    #[inline]
    pub fn apply(&mut self, delta: i64) {
        let up = delta.max(0);
        self.current += delta;
        self.allocated += up as u64;
        self.freed += (up - delta) as u64;
        // A branch here, unlike the sign's: a new peak is rare once the
        // allocator runs steady, so it is predicted, and the common case is
        // a compare instead of a load, a select and a store.
        if self.current > self.peak {
            self.peak = self.current;
        }
    }

    /// Makes the peak equal to the current value.
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    /// Clears the cumulative totals.
    pub fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }
}

/// A quantity tracked for all pools, the small pool and the large pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StatArray {
    /// Both pools together.
    pub all: Stat,
    /// The small pool.
    pub small_pool: Stat,
    /// The large pool.
    pub large_pool: Stat,
}

impl StatArray {
    #[inline]
    fn pool_mut(&mut self, pool: Pool) -> &mut Stat {
        match pool {
            Pool::Small => &mut self.small_pool,
            Pool::Large => &mut self.large_pool,
        }
    }

    /// The entry of one pool.
    pub fn pool(&self, pool: Pool) -> &Stat {
        match pool {
            Pool::Small => &self.small_pool,
            Pool::Large => &self.large_pool,
        }
    }

    /// Increases the entry for `pool` and the total.
    #[inline]
    pub fn increase(&mut self, pool: Pool, amount: u64) {
        self.all.increase(amount);
        self.pool_mut(pool).increase(amount);
    }

    /// Decreases the entry for `pool` and the total.
    #[inline]
    pub fn decrease(&mut self, pool: Pool, amount: u64) {
        self.all.decrease(amount);
        self.pool_mut(pool).decrease(amount);
    }

    /// Applies a signed change to the entry for `pool` and the total.
    #[inline]
    pub fn apply(&mut self, pool: Pool, delta: i64) {
        self.all.apply(delta);
        self.pool_mut(pool).apply(delta);
    }
}

/// Every statistic the allocator keeps, named as in `torch.cuda.memory_stats()`.
///
/// ```
/// use alloc_core::{AllocatorConfig, SimMemory, SimStreams, StreamId, GIB, MIB};
/// use alloc_policy::AnyPolicy;
///
/// let cfg = AllocatorConfig::default();
/// let mut engine = AnyPolicy::engine(&cfg, SimMemory::new(GIB), SimStreams::new())?;
/// let a = engine.malloc(3 * MIB, StreamId(0))?;
/// engine.free(a.addr)?;
///
/// let stats = engine.stats();
/// assert_eq!(stats.allocated_bytes.all.current, 0);
/// assert_eq!(stats.allocated_bytes.large_pool.peak, 3 * MIB as i64);
/// assert_eq!(stats.allocation.all.allocated, 1);
/// // The flat keys of `torch.cuda.memory_stats()`.
/// assert_eq!(stats.to_flat_map()["reserved_bytes.all.current"], 20 * MIB as i64);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    /// Number of blocks handed out to callers.
    pub allocation: StatArray,
    /// Number of device allocations (segments) held.
    pub segment: StatArray,
    /// Number of blocks in use or waiting for stream events.
    pub active: StatArray,
    /// Number of free blocks inside segments that are split (not wholly free).
    pub inactive_split: StatArray,
    /// Bytes of blocks handed out to callers (after rounding).
    pub allocated_bytes: StatArray,
    /// Bytes reserved from the device.
    pub reserved_bytes: StatArray,
    /// Bytes of active blocks.
    pub active_bytes: StatArray,
    /// Bytes of free blocks inside split segments.
    pub inactive_split_bytes: StatArray,
    /// Bytes callers asked for (before rounding), over active blocks.
    pub requested_bytes: StatArray,
    /// Device allocations retried after freeing the whole cache.
    pub num_alloc_retries: u64,
    /// Allocations that failed with out of memory.
    pub num_ooms: u64,
    /// Times every pending stream event was waited for (cache flushes).
    pub num_sync_all_streams: u64,
    /// Device allocation calls (cudaMalloc).
    pub num_device_alloc: u64,
    /// Device free calls (cudaFree).
    pub num_device_free: u64,
    /// Allocations at or above the oversize threshold (`max_split_size_mb`).
    pub oversize_allocations: Stat,
    /// Segments at or above the oversize threshold.
    pub oversize_segments: Stat,
    /// What `unmap_free_pages` moved (ours: not in PyTorch's statistics).
    pub page_moves: PageMoves,
}

/// The work `unmap_free_pages` did: pages unmapped under free blocks to make
/// room, mapped again when a block over them was handed out, and the host
/// time it took. Each moved page costs driver calls (tens of microseconds
/// on an H100, whatever the page size), so these explain its step time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PageMoves {
    /// Rounds that unmapped free pages: before a mapping would have raised
    /// reserved memory above its peak, and on `empty_cache`.
    pub rounds: u64,
    /// Pages unmapped by those rounds.
    pub pages_unmapped: u64,
    /// Of those, pages the GPU might still have been using: their memory
    /// went to a mapping on the same stream (ordered after that use) while
    /// the old address stayed mapped until the GPU was done there. Each is
    /// a wait saved.
    pub busy_pages_reused: u64,
    /// Unmapped pages mapped again under blocks handed out.
    pub pages_mapped: u64,
    /// Times the host waited for a stream: a round whose idle pages were
    /// not enough and whose busy ones could not move without a wait (they
    /// belong to another stream), or a mapping over an address whose old
    /// mapping the GPU might still use.
    pub stream_waits: u64,
    /// Host nanoseconds spent in those maps, unmaps and waits.
    pub host_ns: u64,
    /// Free blocks of another stream's growable segment, over pages the GPU
    /// was done with, handed to a stream whose growth would have passed the
    /// level instead of moving pages to it (`lend_idle_blocks`).
    pub blocks_lent: u64,
}

/// Adds another engine's counts (the device's, from its engines': see
/// `DeviceTotals::combine`).
impl std::ops::AddAssign for PageMoves {
    fn add_assign(&mut self, other: PageMoves) {
        self.rounds += other.rounds;
        self.pages_unmapped += other.pages_unmapped;
        self.busy_pages_reused += other.busy_pages_reused;
        self.pages_mapped += other.pages_mapped;
        self.stream_waits += other.stream_waits;
        self.host_ns += other.host_ns;
        self.blocks_lent += other.blocks_lent;
    }
}

impl PageMoves {
    /// The counters as `(name, value)` pairs, named `page_moves.<field>`.
    pub fn named(&self) -> [(&'static str, u64); 7] {
        [
            ("page_moves.rounds", self.rounds),
            ("page_moves.pages_unmapped", self.pages_unmapped),
            ("page_moves.busy_pages_reused", self.busy_pages_reused),
            ("page_moves.pages_mapped", self.pages_mapped),
            ("page_moves.stream_waits", self.stream_waits),
            ("page_moves.host_ns", self.host_ns),
            ("page_moves.blocks_lent", self.blocks_lent),
        ]
    }
}

impl Stats {
    /// The statistics as a flat map with PyTorch's key names
    /// (`allocated_bytes.all.current`, `num_device_alloc`, ...): the one
    /// list of those names, which the C struct of the statistics
    /// (alloc-ffi's `GpuallocDeviceStats::flat`) reads its keys from too.
    pub fn to_flat_map(&self) -> std::collections::BTreeMap<String, i64> {
        let mut out = std::collections::BTreeMap::new();
        let arrays: [(&str, &StatArray); 9] = [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ];
        for (name, array) in arrays {
            for (pool, stat) in [
                ("all", &array.all),
                ("small_pool", &array.small_pool),
                ("large_pool", &array.large_pool),
            ] {
                insert_stat(&mut out, &format!("{name}.{pool}"), stat);
            }
        }
        insert_stat(&mut out, "oversize_allocations", &self.oversize_allocations);
        insert_stat(&mut out, "oversize_segments", &self.oversize_segments);
        for (name, value) in [
            ("num_alloc_retries", self.num_alloc_retries),
            ("num_ooms", self.num_ooms),
            ("num_sync_all_streams", self.num_sync_all_streams),
            ("num_device_alloc", self.num_device_alloc),
            ("num_device_free", self.num_device_free),
        ] {
            out.insert(name.to_string(), value as i64);
        }
        out
    }
}

fn insert_stat(out: &mut std::collections::BTreeMap<String, i64>, prefix: &str, stat: &Stat) {
    out.insert(format!("{prefix}.current"), stat.current);
    out.insert(format!("{prefix}.peak"), stat.peak);
    out.insert(format!("{prefix}.allocated"), stat.allocated as i64);
    out.insert(format!("{prefix}.freed"), stat.freed as i64);
}

/// A byte count scaled to the largest binary unit that keeps it at least 1:
/// `(1.5, "KiB")` for 1536. Counts below 1 KiB stay in bytes.
pub fn scale_bytes(bytes: u64) -> (f64, &'static str) {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    (value, UNITS[unit])
}

/// Formats a byte count as PyTorch's messages do (`1.50 GiB`, `512 B`).
pub fn human_bytes(bytes: u64) -> String {
    match scale_bytes(bytes) {
        (_, "B") => format!("{bytes} B"),
        (value, unit) => format!("{value:.2} {unit}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_peak_and_totals() {
        let mut s = Stat::default();
        s.increase(10);
        s.increase(5);
        s.decrease(12);
        assert_eq!((s.current, s.peak, s.allocated, s.freed), (3, 15, 15, 12));
        s.reset_peak();
        assert_eq!(s.peak, 3);
    }

    #[test]
    fn apply_is_increase_or_decrease() {
        let mut by_apply = Stat::default();
        let mut by_sign = Stat::default();
        for delta in [5, -3, 0, 7, -9, 2, -2, 0, 4] {
            by_apply.apply(delta);
            if delta > 0 {
                by_sign.increase(delta as u64);
            } else if delta < 0 {
                by_sign.decrease(delta.unsigned_abs());
            }
            assert_eq!(by_apply, by_sign, "after {delta}");
        }
    }

    #[test]
    fn array_updates_pool_and_total() {
        let mut a = StatArray::default();
        a.increase(Pool::Small, 4);
        a.increase(Pool::Large, 6);
        a.decrease(Pool::Small, 4);
        assert_eq!(a.all.current, 6);
        assert_eq!(a.small_pool.current, 0);
        assert_eq!(a.large_pool.peak, 6);
    }

    #[test]
    fn flat_map_uses_pytorch_names() {
        let mut stats = Stats::default();
        stats.allocated_bytes.increase(Pool::Large, 100);
        stats.num_device_alloc = 2;
        let map = stats.to_flat_map();
        assert_eq!(map["allocated_bytes.all.current"], 100);
        assert_eq!(map["allocated_bytes.large_pool.peak"], 100);
        assert_eq!(map["num_device_alloc"], 2);
        assert_eq!(map.len(), 9 * 3 * 4 + 2 * 4 + 5);
    }

    #[test]
    fn human_bytes_picks_unit() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(3 << 30), "3.00 GiB");
    }
}
