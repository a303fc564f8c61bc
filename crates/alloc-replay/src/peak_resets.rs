//! Resets of the statistics' peaks during a replay, as a program makes them.
//!
//! A training loop that logs each step's peak memory calls
//! `torch.cuda.reset_peak_memory_stats()` once a step; PyTorch's memory
//! history does not record those calls. [`PeakResets`] makes them again,
//! every so many allocations (a step's, for a trace of whole steps), so that
//! a replay shows what an allocator does under such a loop, and keeps the
//! peaks the resets hid, so that the report still gives the trace's peaks.

use alloc_core::Stats;

/// The trace-wide peaks of the quantities a replay reports, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Peaks {
    /// Peak of `requested_bytes.all`.
    pub requested: u64,
    /// Peak of `allocated_bytes.all`.
    pub allocated: u64,
    /// Peak of `reserved_bytes.all`.
    pub reserved: u64,
}

impl Peaks {
    /// The peaks the statistics give now.
    pub fn of(stats: &Stats) -> Self {
        Peaks {
            requested: stats.requested_bytes.all.peak.max(0) as u64,
            allocated: stats.allocated_bytes.all.peak.max(0) as u64,
            reserved: stats.reserved_bytes.all.peak.max(0) as u64,
        }
    }

    /// Each peak the higher of the two.
    fn max(self, other: Peaks) -> Peaks {
        Peaks {
            requested: self.requested.max(other.requested),
            allocated: self.allocated.max(other.allocated),
            reserved: self.reserved.max(other.reserved),
        }
    }
}

/// Counts allocations and says when the peaks are to be reset; keeps the
/// highest peaks seen before each reset.
#[derive(Debug, Clone)]
pub struct PeakResets {
    every: u64,
    allocations: u64,
    before: Peaks,
}

impl PeakResets {
    /// Resets after every `every` allocations; `None` for 0.
    pub fn every(every: u64) -> Option<Self> {
        (every > 0).then_some(PeakResets {
            every,
            allocations: 0,
            before: Peaks::default(),
        })
    }

    /// Counts one allocation; `true` when the peaks are due for a reset, in
    /// which case `stats` (read just before it) are folded into the kept
    /// peaks first.
    pub fn after_allocation(&mut self, stats: impl FnOnce() -> Stats) -> bool {
        self.allocations += 1;
        if !self.allocations.is_multiple_of(self.every) {
            return false;
        }
        self.before = self.before.max(Peaks::of(&stats()));
        true
    }

    /// The trace's peaks: the higher of those kept and `stats`' own (the
    /// peaks since the last reset).
    pub fn peaks(&self, stats: &Stats) -> Peaks {
        self.before.max(Peaks::of(stats))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(requested: i64, allocated: i64, reserved: i64) -> Stats {
        let mut s = Stats::default();
        s.requested_bytes.all.peak = requested;
        s.allocated_bytes.all.peak = allocated;
        s.reserved_bytes.all.peak = reserved;
        s
    }

    #[test]
    fn a_reset_is_due_every_n_allocations_and_none_for_zero() {
        assert!(PeakResets::every(0).is_none());
        let mut r = PeakResets::every(3).unwrap();
        let due: Vec<bool> = (0..7)
            .map(|_| r.after_allocation(|| stats(0, 0, 0)))
            .collect();
        assert_eq!(due, [false, false, true, false, false, true, false]);
    }

    #[test]
    fn the_peaks_before_a_reset_are_kept() {
        let mut r = PeakResets::every(1).unwrap();
        assert!(r.after_allocation(|| stats(90, 100, 120)));
        // After the reset the statistics' own peaks are lower but for one.
        let later = stats(40, 50, 130);
        assert_eq!(
            r.peaks(&later),
            Peaks {
                requested: 90,
                allocated: 100,
                reserved: 130
            }
        );
    }
}
