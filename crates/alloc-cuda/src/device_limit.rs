//! One limit on the memory that several engines of one device reserve
//! (PyTorch's per-process memory fraction under an engine for each stream,
//! [`crate::StreamEngines`]): each engine's memory backend takes the bytes
//! of a segment or mapping from the shared count before the driver call and
//! gives them back after freeing or unmapping them, so that the device's
//! reserved bytes never pass the limit whichever engine grows. An engine
//! refused reads it as the device being full: it empties its own cache and
//! tries again, then the other engines' caches are emptied (as PyTorch's one
//! engine frees every stream's cached blocks before it gives up).

use std::sync::atomic::{AtomicU64, Ordering};

/// No limit.
const NONE: u64 = u64::MAX;

/// The reserved bytes of one device's engines and their limit.
#[derive(Debug)]
pub(crate) struct DeviceLimit {
    reserved: AtomicU64,
    limit: AtomicU64,
}

impl Default for DeviceLimit {
    fn default() -> Self {
        DeviceLimit {
            reserved: AtomicU64::new(0),
            limit: AtomicU64::new(NONE),
        }
    }
}

impl DeviceLimit {
    /// Sets the limit (`None`: none). Memory already reserved above a new
    /// limit stays; only growth is refused until it is back under.
    pub(crate) fn set(&self, limit: Option<u64>) {
        self.limit.store(limit.unwrap_or(NONE), Ordering::Relaxed);
    }

    /// The limit, if one is set.
    pub(crate) fn limit(&self) -> Option<u64> {
        let l = self.limit.load(Ordering::Relaxed);
        (l != NONE).then_some(l)
    }

    /// Takes `bytes` if the reserved bytes stay within the limit with them;
    /// `false`, taking nothing, if not.
    pub(crate) fn take(&self, bytes: u64) -> bool {
        let limit = self.limit.load(Ordering::Relaxed);
        let mut now = self.reserved.load(Ordering::Relaxed);
        loop {
            let next = match now.checked_add(bytes) {
                Some(n) if n <= limit => n,
                _ => return false,
            };
            match self.reserved.compare_exchange_weak(
                now,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(seen) => now = seen,
            }
        }
    }

    /// Gives back `bytes` taken before.
    pub(crate) fn give(&self, bytes: u64) {
        self.reserved.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Bytes that may still be reserved under the limit (`None`: no limit).
    pub(crate) fn room(&self) -> Option<u64> {
        self.limit()
            .map(|l| l.saturating_sub(self.reserved.load(Ordering::Relaxed)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn growth_stops_at_the_limit_and_resumes_when_memory_goes_back() {
        let limit = DeviceLimit::default();
        assert!(limit.take(u64::MAX / 2), "no limit: anything fits");
        limit.give(u64::MAX / 2);
        limit.set(Some(100));
        assert!(limit.take(60));
        assert!(!limit.take(41), "60 + 41 passes 100");
        assert_eq!(limit.room(), Some(40));
        assert!(limit.take(40));
        limit.give(60);
        assert!(limit.take(60));
        limit.set(None);
        assert_eq!(limit.room(), None);
    }

    #[test]
    fn threads_taking_at_once_never_pass_the_limit() {
        let limit = Arc::new(DeviceLimit::default());
        limit.set(Some(1000));
        let taken: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let limit = &limit;
                    s.spawn(move || (0..1000).filter(|_| limit.take(7)).count() as u64 * 7)
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert!(taken <= 1000 && taken > 1000 - 7, "{taken}");
        assert_eq!(limit.room(), Some(1000 - taken));
    }
}
