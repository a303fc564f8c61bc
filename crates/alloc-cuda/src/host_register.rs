//! Page-locking host memory that the caller allocated (`cuMemHostRegister`),
//! as Numba's `mempin` (`cuda.pinned(array)`, `cuda.mapped(array)`) does:
//! the pinned allocator ([`crate::PinnedAllocator`]) allocates its memory, this pins
//! memory it does not own.
//!
//! The ranges are kept in a table, so that the bytes pinned this way are
//! counted beside the pool's (the host statistics), an overlapping register
//! is refused with the range in the way named rather than the driver's
//! `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`, and an unregister of an
//! address that no range starts at is an error without a driver call.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::driver::CudaContext;

use crate::driver;
use crate::error::{driver_error, CudaError};
use crate::lock::lock_consistent;

/// Counters of host memory page-locked in place ([`HostRegistry`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegisteredStats {
    /// Bytes registered now.
    pub registered_bytes: u64,
    /// Highest `registered_bytes` so far.
    pub peak_registered_bytes: u64,
    /// Ranges registered now.
    pub registered_ranges: u64,
    /// `cuMemHostRegister` calls that succeeded.
    pub host_registers: u64,
    /// `cuMemHostUnregister` calls that succeeded.
    pub host_unregisters: u64,
}

impl RegisteredStats {
    /// The counters as `(name, value)` pairs, for flat maps (the C ABI's
    /// JSON of host statistics, beside [`crate::PinnedStats::named`]).
    pub fn named(&self) -> [(&'static str, u64); 5] {
        [
            ("registered_bytes", self.registered_bytes),
            ("peak_registered_bytes", self.peak_registered_bytes),
            ("registered_ranges", self.registered_ranges),
            ("host_registers", self.host_registers),
            ("host_unregisters", self.host_unregisters),
        ]
    }
}

/// The registered ranges and their counters, without the driver (so that
/// the rules are tested without a GPU).
#[derive(Debug, Default)]
pub struct Registrations {
    /// Length of each range, by its start address.
    ranges: BTreeMap<u64, u64>,
    stats: RegisteredStats,
}

impl Registrations {
    /// `Ok` when `addr..addr + len` overlaps no registered range, else the
    /// error naming the one in the way.
    pub fn check_free(&self, addr: u64, len: u64) -> Result<(), CudaError> {
        let end = addr.saturating_add(len);
        // The last range starting before `end` is the only one that can
        // reach into the new range (registered ranges do not overlap).
        match self.ranges.range(..end).next_back() {
            Some((&start, &bytes)) if start + bytes > addr => Err(CudaError::HostRangeRegistered {
                addr,
                end,
                registered: start,
                registered_end: start + bytes,
            }),
            _ => Ok(()),
        }
    }

    /// Records the range `addr..addr + len`, registered with the driver.
    pub fn insert(&mut self, addr: u64, len: u64) {
        self.ranges.insert(addr, len);
        let s = &mut self.stats;
        s.registered_bytes += len;
        s.peak_registered_bytes = s.peak_registered_bytes.max(s.registered_bytes);
        s.registered_ranges += 1;
        s.host_registers += 1;
    }

    /// The length of the range starting at `addr`, if one does.
    pub fn get(&self, addr: u64) -> Option<u64> {
        self.ranges.get(&addr).copied()
    }

    /// Forgets the range starting at `addr`, unregistered from the driver;
    /// returns its length.
    pub fn remove(&mut self, addr: u64) -> Option<u64> {
        let len = self.ranges.remove(&addr)?;
        let s = &mut self.stats;
        s.registered_bytes -= len;
        s.registered_ranges -= 1;
        s.host_unregisters += 1;
        Some(len)
    }

    /// The counters.
    pub fn stats(&self) -> RegisteredStats {
        self.stats
    }
}

/// Host memory page-locked in place, for every context of the process (see
/// the module docs). One per process: [`HostRegistry::global`].
pub struct HostRegistry {
    ctx: Arc<CudaContext>,
    table: Mutex<Registrations>,
}

impl std::fmt::Debug for HostRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegistry")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

static GLOBAL: OnceLock<Arc<HostRegistry>> = OnceLock::new();

impl HostRegistry {
    /// The process-wide registry (its driver calls run in device 0's primary
    /// context; the ranges are portable, so every context sees them pinned),
    /// created on first use.
    pub fn global() -> Result<Arc<Self>, CudaError> {
        if let Some(r) = GLOBAL.get() {
            return Ok(r.clone());
        }
        driver::device_count()?;
        let ctx = CudaContext::new(0).map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e.0))?;
        Ok(GLOBAL
            .get_or_init(|| {
                Arc::new(HostRegistry {
                    ctx,
                    table: Mutex::new(Registrations::default()),
                })
            })
            .clone())
    }

    /// The process-wide registry if [`HostRegistry::global`] made it.
    pub fn existing() -> Option<Arc<Self>> {
        GLOBAL.get().cloned()
    }

    fn table(&self) -> MutexGuard<'_, Registrations> {
        // The table is changed only after the driver call succeeded, in
        // steps that cannot panic: it stays consistent.
        lock_consistent(&self.table)
    }

    /// Page-locks `len` bytes at `ptr` (and maps them into the device
    /// address space when `mapped`, for kernels that read host memory
    /// directly). Refused, with no driver call, when the range overlaps one
    /// registered here.
    ///
    /// # Safety
    /// `ptr..ptr + len` is memory of this process that stays allocated until
    /// [`HostRegistry::unregister`] of `ptr`.
    pub unsafe fn register(&self, ptr: *mut u8, len: usize, mapped: bool) -> Result<(), CudaError> {
        let addr = ptr as u64;
        // Held across the driver call, so that two overlapping requests
        // cannot both pass the check.
        let mut table = self.table();
        table.check_free(addr, len as u64)?;
        driver::bind(&self.ctx)?;
        // SAFETY: the caller's contract.
        unsafe { driver::host_register(ptr, len, mapped) }?;
        table.insert(addr, len as u64);
        Ok(())
    }

    /// Unpins the range registered at `ptr` and returns its length. An
    /// address no range starts at is an error and no driver call; a failed
    /// driver call keeps the range registered (and counted).
    ///
    /// # Safety
    /// No queued copy uses the range any more.
    pub unsafe fn unregister(&self, ptr: *mut u8) -> Result<usize, CudaError> {
        let addr = ptr as u64;
        let mut table = self.table();
        if table.get(addr).is_none() {
            return Err(CudaError::HostNotRegistered { addr });
        }
        driver::bind(&self.ctx)?;
        // SAFETY: `ptr` starts a range registered here (checked above); the
        // caller vouches that no copy uses it.
        unsafe { driver::host_unregister(ptr) }?;
        Ok(table.remove(addr).unwrap_or(0) as usize)
    }

    /// The counters.
    pub fn stats(&self) -> RegisteredStats {
        self.table().stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_ranges_are_refused_and_adjacent_ones_taken() {
        let mut t = Registrations::default();
        t.check_free(0x1000, 0x1000).unwrap();
        t.insert(0x1000, 0x1000);
        for (addr, len) in [(0x1000, 1), (0x1fff, 1), (0x800, 0x801), (0, 0x10000)] {
            match t.check_free(addr, len) {
                Err(CudaError::HostRangeRegistered {
                    registered,
                    registered_end,
                    ..
                }) => assert_eq!((registered, registered_end), (0x1000, 0x2000)),
                other => panic!("{addr:#x}+{len:#x}: {other:?}"),
            }
        }
        t.check_free(0x2000, 0x1000).expect("adjacent after");
        t.check_free(0x800, 0x800).expect("adjacent before");
        let message = t.check_free(0x1800, 16).unwrap_err().to_string();
        assert!(
            message.contains("0x1800..0x1810 overlaps 0x1000..0x2000"),
            "{message}"
        );
    }

    #[test]
    fn counters_follow_the_ranges() {
        let mut t = Registrations::default();
        t.insert(0x1000, 4096);
        t.insert(0x10000, 3 << 20);
        assert_eq!(t.get(0x10000), Some(3 << 20));
        assert_eq!(t.get(0x10001), None, "only a range's start names it");
        assert_eq!(t.remove(0x1000), Some(4096));
        assert_eq!(t.remove(0x1000), None, "removed once");
        let s = t.stats();
        assert_eq!(
            (s.registered_bytes, s.registered_ranges),
            (3 << 20, 1),
            "{s:?}"
        );
        assert_eq!(s.peak_registered_bytes, (3 << 20) + 4096);
        assert_eq!((s.host_registers, s.host_unregisters), (2, 1));
        let named = s.named();
        assert_eq!(named[0], ("registered_bytes", 3 << 20));
        assert_eq!(named.len(), 5);
    }
}
