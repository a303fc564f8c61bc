//! The memory budget of `unmap_free_pages` (`memory_budget_mb`,
//! `memory_budget_fraction`): the reserved level below which the heap grows
//! by mapping new pages, with no unmaps and no page moves, and at which free
//! pages are unmapped and reused before the heap passes it. Without a budget
//! that level is the reserved peak (least memory at every moment: pages move
//! whenever the heap would pass its own earlier peak).

/// A memory budget as configured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MemoryBudget {
    /// A number of bytes (`memory_budget_mb`).
    Bytes(u64),
    /// A fraction of the device's capacity, in `(0, 1]`
    /// (`memory_budget_fraction`).
    Fraction(f64),
}

impl MemoryBudget {
    /// The budget in bytes on a device of `capacity` bytes (never more than
    /// the device).
    pub fn bytes(&self, capacity: u64) -> u64 {
        match *self {
            MemoryBudget::Bytes(bytes) => bytes.min(capacity),
            // `as` saturates: a fraction of 1 of a 2^64-byte device stays
            // in range.
            MemoryBudget::Fraction(f) => ((capacity as f64 * f) as u64).min(capacity),
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
    /// give (`device_free`, asked only with a budget: another process may
    /// have taken memory since).
    pub fn level(&self, device_free: impl FnOnce() -> u64) -> u64 {
        let Some(budget) = self.budget else {
            return self.peak;
        };
        budget
            .bytes(self.capacity)
            .min(self.limit.unwrap_or(u64::MAX))
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
                    u32::from(budget.is_some()),
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
        assert_eq!(MemoryBudget::Bytes(512 * MIB).bytes(GIB), 512 * MIB);
        assert_eq!(MemoryBudget::Bytes(2 * GIB).bytes(GIB), GIB);
        assert_eq!(MemoryBudget::Fraction(0.5).bytes(GIB), GIB / 2);
        assert_eq!(MemoryBudget::Fraction(1.0).bytes(u64::MAX), u64::MAX);
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
