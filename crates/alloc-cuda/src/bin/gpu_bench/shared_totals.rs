//! `gpu_bench --threads ... --shared-totals`: what exact device-wide
//! statistics would cost engines that share nothing else. With one engine
//! per stream (docs/architecture.md, "Threads"), PyTorch's peaks, which are
//! peaks of device-wide sums, need every allocation and free to add its
//! change to counters all threads write: per changed counter, an atomic add
//! to its value in the pool and to its sum over pools, each followed by a
//! compare with the peak (and, at a new peak, an atomic maximum). This
//! makes those changes for the counters an allocation and a free change
//! (allocations, allocated, requested, inactive split count and bytes), so
//! that a cell with `--engines thread` measures engines that share nothing
//! but these counters. Two ways: `atomic` (an atomic add per value, as
//! above) and `locked` (the values and peaks as plain numbers behind a lock
//! of their own, the engine's kind: two atomic operations a call, and the
//! lines move once).

use std::sync::atomic::{AtomicI64, Ordering};

use alloc_cuda::lock::SpinParkMutex;

use crate::{Backend, BoxResult};

/// The counters a call changes, each with its value in the pool and its
/// sum over pools.
const COUNTERS: usize = 5;

/// Values written by every call, on lines of their own.
#[repr(align(64))]
#[derive(Default)]
struct Values([AtomicI64; 2 * COUNTERS]);

/// Peaks, read by every call and written at a new peak only.
#[repr(align(64))]
#[derive(Default)]
struct PeakValues([AtomicI64; 2 * COUNTERS]);

/// How the totals are kept.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Sharing {
    /// An atomic add to every value, an atomic maximum at a new peak.
    #[default]
    Atomic,
    /// Plain values and peaks behind a spin lock of their own.
    Locked,
}

impl Sharing {
    /// `atomic` or `locked`.
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        match text {
            "atomic" => Ok(Sharing::Atomic),
            "locked" => Ok(Sharing::Locked),
            other => Err(format!(
                "--shared-totals takes atomic or locked, not {other}"
            )),
        }
    }
}

/// Device-wide totals with exact peaks, shared by every thread of a device.
#[derive(Default)]
pub(crate) struct SharedTotals {
    sharing: Sharing,
    values: Values,
    peaks: PeakValues,
    /// The `locked` form: values, then peaks.
    locked: SpinParkMutex<[i64; 4 * COUNTERS]>,
}

/// One call's change of each counter.
#[inline]
fn deltas(bytes: i64) -> [i64; COUNTERS] {
    let one = bytes.signum();
    [one, bytes, bytes, one, bytes]
}

impl SharedTotals {
    /// Totals kept as `sharing` says.
    pub(crate) fn new(sharing: Sharing) -> Self {
        SharedTotals {
            sharing,
            ..SharedTotals::default()
        }
    }

    /// A call that changed a block of `bytes` (negative: a free).
    #[inline]
    pub(crate) fn change(&self, bytes: i64) {
        match self.sharing {
            Sharing::Atomic => self.change_atomic(bytes),
            Sharing::Locked => self.change_locked(bytes),
        }
    }

    #[inline]
    fn change_locked(&self, bytes: i64) {
        // A panic cannot happen under this lock; a poisoned one is kept.
        let Ok(mut n) = self.locked.lock_checked(|_| Ok(())) else {
            return;
        };
        for (k, delta) in deltas(bytes).into_iter().enumerate() {
            for slot in [k, COUNTERS + k] {
                n[slot] += delta;
                n[2 * COUNTERS + slot] = n[2 * COUNTERS + slot].max(n[slot]);
            }
        }
    }

    #[inline]
    fn change_atomic(&self, bytes: i64) {
        for (k, delta) in deltas(bytes).into_iter().enumerate() {
            for slot in [k, COUNTERS + k] {
                let now = self.values.0[slot].fetch_add(delta, Ordering::AcqRel) + delta;
                if now > self.peaks.0[slot].load(Ordering::Relaxed) {
                    self.peaks.0[slot].fetch_max(now, Ordering::Relaxed);
                }
            }
        }
    }

    /// Counter `k`'s value and peak (its value in the pool).
    #[cfg(test)]
    fn get(&self, k: usize) -> (i64, i64) {
        match self.sharing {
            Sharing::Atomic => (
                self.values.0[k].load(Ordering::SeqCst),
                self.peaks.0[k].load(Ordering::SeqCst),
            ),
            Sharing::Locked => {
                let n = self.locked.lock_checked(|_| Ok(())).expect("not poisoned");
                (n[k], n[2 * COUNTERS + k])
            }
        }
    }
}

/// A backend whose calls also change device-wide totals.
pub(crate) struct WithTotals<B> {
    pub(crate) inner: B,
    pub(crate) totals: &'static SharedTotals,
}

impl<B: Backend> Backend for WithTotals<B> {
    #[inline]
    fn alloc(&mut self, size: usize) -> BoxResult<u64> {
        let p = self.inner.alloc(size)?;
        self.totals.change(size as i64);
        Ok(p)
    }
    #[inline]
    fn release(&mut self, ptr: u64, size: usize) -> BoxResult<()> {
        self.inner.release(ptr, size)?;
        self.totals.change(-(size as i64));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Four threads each hold at most one block of 100 bytes at a time: the
    /// totals come back to zero, and the peak of the sum lies between one
    /// block and four, never above what was ever live at once.
    #[test]
    fn totals_are_exact_under_threads() {
        for sharing in [Sharing::Atomic, Sharing::Locked] {
            exact_under_threads(sharing);
        }
        assert!(Sharing::parse("striped").is_err());
    }

    fn exact_under_threads(sharing: Sharing) {
        let totals: &'static SharedTotals = Box::leak(Box::new(SharedTotals::new(sharing)));
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..10_000 {
                        totals.change(100);
                        totals.change(-100);
                    }
                });
            }
        });
        let (count, count_peak) = totals.get(0);
        let (bytes, bytes_peak) = totals.get(1);
        assert_eq!((count, bytes), (0, 0));
        assert!((1..=4).contains(&count_peak), "{count_peak}");
        assert!((100..=400).contains(&bytes_peak), "{bytes_peak}");
        // The sum over pools moves by the same changes, in its own order.
        assert!((100..=400).contains(&totals.get(COUNTERS + 1).1));
    }
}
