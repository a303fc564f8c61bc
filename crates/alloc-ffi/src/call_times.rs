//! The host time of the library's own allocation calls, per device, when
//! `GPUALLOC_TIME_CALLS=1` is set (read once): how many `gpualloc_malloc` /
//! `gpualloc_malloc_in_pool` and `gpualloc_free` calls (from the creation of
//! the first device's allocator on), the nanoseconds spent
//! inside them (the engine's lock and every driver call included), the
//! slowest one, and how many took 100 us or more. They appear in
//! `gpualloc_memory_stats_json` as `host_calls.*`, cleared with the other
//! cumulative counters, so that a step's share of the allocator is the
//! difference of two readings, without a profiler's own cost on every op.
//!
//! Off (the default) a call pays one relaxed load of a flag and a branch;
//! on, two clock reads and four atomic updates.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};
use std::time::Instant;

use alloc_cuda::MAX_DEVICES;

/// The environment variable that turns the timing on (`1`).
pub const ENV_TIME_CALLS: &str = "GPUALLOC_TIME_CALLS";

/// A call this long or longer counts as slow.
const SLOW_NS: u64 = 100_000;

/// Calls of one kind on one device.
struct Counter {
    calls: AtomicU64,
    ns: AtomicU64,
    slow: AtomicU64,
    max_ns: AtomicU64,
}

impl Counter {
    /// At zero, in a constant context, so that the process's counters are
    /// a plain static (no lazy initialisation on the hot path).
    const fn zero() -> Counter {
        Counter {
            calls: AtomicU64::new(0),
            ns: AtomicU64::new(0),
            slow: AtomicU64::new(0),
            max_ns: AtomicU64::new(0),
        }
    }

    fn add(&self, ns: u64) {
        self.calls.fetch_add(1, Relaxed);
        self.ns.fetch_add(ns, Relaxed);
        if ns >= SLOW_NS {
            self.slow.fetch_add(1, Relaxed);
        }
        self.max_ns.fetch_max(ns, Relaxed);
    }

    fn reset(&self) {
        for c in [&self.calls, &self.ns, &self.slow, &self.max_ns] {
            c.store(0, Relaxed);
        }
    }

    fn values(&self) -> [u64; 4] {
        [&self.calls, &self.ns, &self.slow, &self.max_ns].map(|c| c.load(Relaxed))
    }
}

/// Which call is timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call {
    /// `gpualloc_malloc`, `gpualloc_malloc_in_pool`.
    Malloc,
    /// `gpualloc_free`.
    Free,
}

/// The counters of every device.
pub(crate) struct CallTimes {
    /// 0: not read yet, 1: off, 2: on.
    state: AtomicU8,
    devices: [[Counter; 2]; MAX_DEVICES],
}

impl CallTimes {
    /// Counters at zero; `on` decides at once (None: from the environment at
    /// the first call).
    const fn new(on: Option<bool>) -> Self {
        let state = match on {
            None => 0,
            Some(false) => 1,
            Some(true) => 2,
        };
        CallTimes {
            state: AtomicU8::new(state),
            devices: [const { [Counter::zero(), Counter::zero()] }; MAX_DEVICES],
        }
    }

    /// Whether calls are timed: one load, off until [`CallTimes::read_env`].
    #[inline(always)]
    pub(crate) fn on(&self) -> bool {
        self.state.load(Relaxed) == 2
    }

    /// Reads `GPUALLOC_TIME_CALLS` the first time (the C library calls it
    /// as it creates a device's allocator, before that allocator's first
    /// call); later calls change nothing.
    #[cold]
    pub(crate) fn read_env(&self) {
        if self.state.load(Relaxed) == 0 {
            let on = std::env::var(ENV_TIME_CALLS).is_ok_and(|v| v.trim() == "1");
            let _ = self
                .state
                .compare_exchange(0, if on { 2 } else { 1 }, Relaxed, Relaxed);
        }
    }

    /// Runs `f`, a call of kind `call` naming `device`, and counts its time
    /// (a device index out of range is not counted). Out of line: the entry
    /// points test [`CallTimes::on`] and come here only while timing is on,
    /// so that their untimed path stays as it was.
    #[inline(never)]
    pub(crate) fn time<R>(&self, call: Call, device: i32, f: impl FnOnce() -> R) -> R {
        let started = Instant::now();
        let r = f();
        self.count(call, device, started);
        r
    }

    fn count(&self, call: Call, device: i32, started: Instant) {
        let ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        if let Some(d) = usize::try_from(device).ok().filter(|&d| d < MAX_DEVICES) {
            self.devices[d][call as usize].add(ns);
        }
    }

    /// Clears the counters of `device`.
    pub(crate) fn reset(&self, device: usize) {
        if let Some(counters) = self.devices.get(device) {
            counters.iter().for_each(Counter::reset);
        }
    }

    /// The counters of `device` as `host_calls.*` pairs; empty while timing
    /// is off.
    pub(crate) fn named(&self, device: usize) -> Vec<(&'static str, u64)> {
        self.read_env();
        let Some(counters) = self.devices.get(device).filter(|_| self.on()) else {
            return Vec::new();
        };
        const NAMES: [[&str; 4]; 2] = [
            [
                "host_calls.malloc",
                "host_calls.malloc_ns",
                "host_calls.malloc_slow",
                "host_calls.malloc_max_ns",
            ],
            [
                "host_calls.free",
                "host_calls.free_ns",
                "host_calls.free_slow",
                "host_calls.free_max_ns",
            ],
        ];
        NAMES
            .iter()
            .zip(counters)
            .flat_map(|(names, c)| names.iter().copied().zip(c.values()))
            .collect()
    }
}

/// The process's counters.
static TIMES: CallTimes = CallTimes::new(None);

/// The process's counters.
#[inline(always)]
pub(crate) fn global() -> &'static CallTimes {
    &TIMES
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn off_nothing_is_reported() {
        let t = CallTimes::new(Some(false));
        assert!(!t.on());
        assert!(t.named(0).is_empty());
    }

    #[test]
    fn on_calls_are_counted_per_device_and_kind_and_cleared() {
        let t = CallTimes::new(Some(true));
        assert!(t.on());
        assert_eq!(t.time(Call::Malloc, 1, || 7), 7, "the call's result");
        t.time(Call::Malloc, 1, || {
            std::thread::sleep(Duration::from_millis(1))
        });
        t.time(Call::Free, 1, || ());
        t.time(Call::Free, -1, || ()); // no device: not counted
        t.time(Call::Free, MAX_DEVICES as i32, || ());
        let got: std::collections::HashMap<_, _> = t.named(1).into_iter().collect();
        assert_eq!(got["host_calls.malloc"], 2);
        assert_eq!(got["host_calls.malloc_slow"], 1, "the 1 ms call");
        assert!(got["host_calls.malloc_max_ns"] >= 1_000_000);
        assert!(got["host_calls.malloc_ns"] >= got["host_calls.malloc_max_ns"]);
        assert_eq!(
            (got["host_calls.free"], got["host_calls.free_slow"]),
            (1, 0)
        );
        assert_eq!(got.len(), 8);
        assert!(t.named(0).iter().all(|&(_, v)| v == 0));
        t.reset(1);
        assert!(t.named(1).iter().all(|&(_, v)| v == 0));
        t.reset(MAX_DEVICES); // out of range: nothing
    }

    #[test]
    fn the_environment_decides_once() {
        let t = CallTimes::new(None);
        assert!(!t.on(), "off until the environment is read");
        t.read_env();
        // Whatever the test environment says, the answer stays the same.
        let first = t.on();
        t.read_env();
        assert_eq!(t.on(), first);
        assert_eq!(
            first,
            std::env::var(ENV_TIME_CALLS).is_ok_and(|v| v.trim() == "1")
        );
    }
}
