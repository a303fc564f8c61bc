//! The memory budget of `unmap_free_pages` (`memory_budget_mb`,
//! `memory_budget_fraction`): the reserved level below which the heap grows
//! by mapping new pages, with no unmaps and no page moves, and at which free
//! pages are unmapped and reused before the heap passes it. Without a budget
//! that level is the reserved peak (least memory at every moment: pages move
//! whenever the heap would pass its own earlier peak). Between the two,
//! `memory_budget_over_allocated` sets the level at a multiple of the most
//! ever allocated (the allocation being served included), never below the
//! reserved peak: a heap a few percent above
//! what it holds grows without moving a page, and pages move only where the
//! peak rule alone would have grown it further.

/// A memory budget as configured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MemoryBudget {
    /// A number of bytes (`memory_budget_mb`).
    Bytes(u64),
    /// A fraction of the device's capacity, in `(0, 1]`
    /// (`memory_budget_fraction`).
    Fraction(f64),
    /// A multiple, at least 1, of the allocated peak
    /// (`memory_budget_over_allocated`). Not a shortage: the level never
    /// falls below the reserved peak, the host never waits for streams to
    /// reach it, and the device is not asked for its free memory (a mapping
    /// the device refuses reclaims as under any setting).
    OverAllocated(f64),
}

impl MemoryBudget {
    /// The budget in bytes on a device of `capacity` bytes that has held at
    /// most `allocated_peak` bytes allocated (never more than the device).
    pub fn bytes(&self, capacity: u64, allocated_peak: u64) -> u64 {
        // `as` saturates: a fraction of 1 of a 2^64-byte device stays in
        // range.
        let scaled = |bytes: u64, f: f64| (bytes as f64 * f) as u64;
        match *self {
            MemoryBudget::Bytes(bytes) => bytes.min(capacity),
            MemoryBudget::Fraction(f) => scaled(capacity, f).min(capacity),
            MemoryBudget::OverAllocated(f) => scaled(allocated_peak, f).min(capacity),
        }
    }

    /// Whether reaching the budget means memory is short: the host then
    /// waits for streams whose free pages the GPU may still use rather than
    /// pass it, and the device's free memory counts as a budget too. A
    /// multiple of the allocated peak is a bound on waste, not a shortage.
    pub fn is_shortage(&self) -> bool {
        !matches!(self, MemoryBudget::OverAllocated(_))
    }

    /// The configuration key and value that set this budget.
    pub fn key_value(&self) -> (&'static str, String) {
        match *self {
            MemoryBudget::Bytes(bytes) => ("memory_budget_mb", (bytes >> 20).to_string()),
            MemoryBudget::Fraction(f) => ("memory_budget_fraction", f.to_string()),
            MemoryBudget::OverAllocated(f) => ("memory_budget_over_allocated", f.to_string()),
        }
    }
}

/// What the reclaim level depends on, read from the engine when a mapping is
/// about to be made.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ReclaimInputs {
    /// The budget, if one is set.
    pub budget: Option<MemoryBudget>,
    /// The device's capacity.
    pub capacity: u64,
    /// The reserved peak.
    pub peak: u64,
    /// The allocated peak, counting the allocation being served (a level
    /// over it rises with an allocation that raises it).
    pub allocated_peak: u64,
    /// Reserved bytes now.
    pub reserved: u64,
    /// The reserved-bytes limit of the memory fraction, if one is set.
    pub limit: Option<u64>,
}

impl ReclaimInputs {
    /// The reserved level past which a mapping first unmaps free pages.
    /// Without a budget: the peak. With one: the lowest of the budget, the
    /// memory-fraction limit (PyTorch's per-process fraction counts as a
    /// budget: past it nothing maps at all) and what the device can still
    /// give (`device_free`, asked only with a budget that is a shortage:
    /// another process may have taken memory since). A multiple of the
    /// allocated peak: the higher of it and the reserved peak, under the
    /// limit.
    pub fn level(&self, device_free: impl FnOnce() -> u64) -> u64 {
        let Some(budget) = self.budget else {
            return self.peak;
        };
        let limit = self.limit.unwrap_or(u64::MAX);
        let bytes = budget.bytes(self.capacity, self.allocated_peak);
        if !budget.is_shortage() {
            return bytes.max(self.peak).min(limit);
        }
        bytes
            .min(limit)
            .min(self.reserved.saturating_add(device_free()))
    }

    /// Bytes to unmap before mapping `needed` more: how far reserved memory
    /// plus `needed` passes the [level](ReclaimInputs::level). The device's
    /// free memory is asked only when something is to be mapped: with
    /// `needed` 0 it cannot make the deficit larger (the level's device term
    /// is then at least reserved memory), and asking is a driver call
    /// (`cuMemGetInfo`) on every allocation that maps nothing.
    pub fn deficit(&self, needed: u64, device_free: impl FnOnce() -> u64) -> u64 {
        let level = if needed == 0 {
            self.level(|| u64::MAX)
        } else {
            self.level(device_free)
        };
        self.reserved.saturating_add(needed).saturating_sub(level)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{GIB, MIB};

    fn inputs(budget: Option<MemoryBudget>, limit: Option<u64>) -> ReclaimInputs {
        ReclaimInputs {
            budget,
            capacity: 80 * GIB,
            peak: 10 * GIB,
            allocated_peak: 9 * GIB,
            reserved: 8 * GIB,
            limit,
        }
    }

    #[test]
    fn the_deficit_asks_the_device_only_when_something_is_to_be_mapped() {
        let asked = std::cell::Cell::new(0);
        let free = |bytes: u64| {
            let asked = &asked;
            move || {
                asked.set(asked.get() + 1);
                bytes
            }
        };
        for budget in [
            None,
            Some(MemoryBudget::Bytes(9 * GIB)),
            Some(MemoryBudget::Bytes(GIB)),
            Some(MemoryBudget::OverAllocated(1.02)),
        ] {
            for limit in [None, Some(7 * GIB)] {
                let i = inputs(budget, limit);
                // With nothing to map the device is never asked, and the
                // deficit is what any device answer would have given.
                for device_free in [0, GIB, 100 * GIB] {
                    let expected = i.reserved.saturating_sub(i.level(|| device_free));
                    assert_eq!(i.deficit(0, || unreachable!("asked")), expected);
                }
                asked.set(0);
                let d = i.deficit(512 * MIB, free(256 * MIB));
                assert_eq!(
                    asked.get(),
                    u32::from(budget.is_some_and(|b| b.is_shortage())),
                    "{budget:?} {limit:?}"
                );
                assert_eq!(
                    d,
                    (i.reserved + 512 * MIB).saturating_sub(i.level(|| 256 * MIB)),
                    "{budget:?} {limit:?}"
                );
            }
        }
        // The device short: mapping 2 GiB with 1 GiB free needs 1 GiB unmapped.
        let i = inputs(Some(MemoryBudget::Fraction(1.0)), None);
        assert_eq!(i.deficit(2 * GIB, || GIB), GIB);
    }

    #[test]
    fn budgets_resolve_against_the_device() {
        assert_eq!(MemoryBudget::Bytes(512 * MIB).bytes(GIB, 0), 512 * MIB);
        assert_eq!(MemoryBudget::Bytes(2 * GIB).bytes(GIB, 0), GIB);
        assert_eq!(MemoryBudget::Fraction(0.5).bytes(GIB, 0), GIB / 2);
        assert_eq!(MemoryBudget::Fraction(1.0).bytes(u64::MAX, 0), u64::MAX);
        let over = MemoryBudget::OverAllocated(1.25);
        assert_eq!(over.bytes(GIB, 512 * MIB), 640 * MIB);
        assert_eq!(over.bytes(GIB, GIB), GIB, "never more than the device");
    }

    #[test]
    fn over_the_allocated_peak_the_level_never_falls_below_the_reserved_peak() {
        let asked = std::cell::Cell::new(false);
        let device = || {
            asked.set(true);
            0
        };
        // 1.25 x 9 GiB allocated = 11.25 GiB, above the 10 GiB reserved peak.
        let over = Some(MemoryBudget::OverAllocated(1.25));
        assert_eq!(inputs(over, None).level(device), 11 * GIB + GIB / 4);
        // 1.02 x 9 GiB is below the reserved peak: the peak rule stands, so
        // the budget never moves more pages than no budget would.
        let tight = Some(MemoryBudget::OverAllocated(1.02));
        assert_eq!(inputs(tight, None).level(device), 10 * GIB);
        // The memory fraction still caps it.
        assert_eq!(inputs(over, Some(7 * GIB)).level(device), 7 * GIB);
        assert!(!asked.get(), "not a shortage: the device is not asked");
        // Below the level the heap grows with nothing unmapped.
        assert_eq!(inputs(over, None).deficit(3 * GIB, device), 0);
        assert_eq!(
            inputs(over, None).deficit(4 * GIB, device),
            12 * GIB - (11 * GIB + GIB / 4)
        );
        assert_eq!(
            MemoryBudget::OverAllocated(1.02).key_value(),
            ("memory_budget_over_allocated", "1.02".to_string())
        );
    }

    #[test]
    fn without_a_budget_the_level_is_the_peak_and_the_device_is_not_asked() {
        let asked = std::cell::Cell::new(false);
        let level = inputs(None, Some(GIB)).level(|| {
            asked.set(true);
            0
        });
        assert_eq!(level, 10 * GIB);
        assert!(!asked.get());
    }

    #[test]
    fn with_a_budget_the_level_is_the_lowest_of_budget_limit_and_device() {
        let all = Some(MemoryBudget::Fraction(1.0));
        assert_eq!(inputs(all, None).level(|| 72 * GIB), 80 * GIB);
        // The per-process fraction counts as a budget.
        assert_eq!(inputs(all, Some(24 * GIB)).level(|| 72 * GIB), 24 * GIB);
        // An explicit budget below the limit wins.
        let twenty = Some(MemoryBudget::Bytes(20 * GIB));
        assert_eq!(inputs(twenty, Some(24 * GIB)).level(|| 72 * GIB), 20 * GIB);
        // Another process took all but 4 GiB: reserved 8 + 4.
        assert_eq!(inputs(all, None).level(|| 4 * GIB), 12 * GIB);
        assert_eq!(inputs(all, None).level(|| u64::MAX), 80 * GIB);
    }
}
