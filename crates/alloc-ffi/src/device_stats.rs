//! `gpualloc_device_stats`: a device's statistics as a plain C struct, for
//! callers that want numbers rather than JSON (the C++ bridge fills
//! PyTorch's `DeviceStats` from it).
//!
//! The struct is versioned by its first field, `size`: the caller writes the
//! size of the struct it was compiled with, the library fills the fields that
//! fit and writes back how many bytes it filled. New fields are only ever
//! appended, so an older caller keeps working with a newer library and a newer
//! caller learns which fields an older library knew.

use std::ffi::c_int;
use std::mem::size_of;

use alloc_core::{PageMoves, Stat, StatArray, Stats};

use crate::api::{GpuallocDeviceStats, GpuallocStat};
use crate::state::{self, FfiResult};
use crate::{call_int, FfiError};

/// A counter as C's `int64_t`, saturating.
fn signed(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

impl From<&Stat> for GpuallocStat {
    fn from(s: &Stat) -> Self {
        GpuallocStat {
            current: s.current,
            peak: s.peak,
            allocated: signed(s.allocated),
            freed: signed(s.freed),
        }
    }
}

fn triple(a: &StatArray) -> [GpuallocStat; 3] {
    [
        (&a.all).into(),
        (&a.small_pool).into(),
        (&a.large_pool).into(),
    ]
}

/// A C counter back as the `u64` it was made from (negative ones do not
/// occur: [`signed`] saturates).
fn unsigned(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

impl From<&GpuallocStat> for Stat {
    fn from(s: &GpuallocStat) -> Self {
        Stat {
            current: s.current,
            peak: s.peak,
            allocated: unsigned(s.allocated),
            freed: unsigned(s.freed),
        }
    }
}

fn stat_array(t: &[GpuallocStat; 3]) -> StatArray {
    StatArray {
        all: (&t[0]).into(),
        small_pool: (&t[1]).into(),
        large_pool: (&t[2]).into(),
    }
}

/// The [`Stats`] a struct was made from (by [`GpuallocDeviceStats::new`]):
/// every field but `size` and `max_split_size`, which `Stats` lacks; the
/// `page_moves` counters, which the struct lacks, are zero. Every field is
/// named, so that a field added to `Stats` is a decision here.
impl From<&GpuallocDeviceStats> for Stats {
    fn from(c: &GpuallocDeviceStats) -> Self {
        Stats {
            allocation: stat_array(&c.allocation),
            segment: stat_array(&c.segment),
            active: stat_array(&c.active),
            inactive_split: stat_array(&c.inactive_split),
            allocated_bytes: stat_array(&c.allocated_bytes),
            reserved_bytes: stat_array(&c.reserved_bytes),
            active_bytes: stat_array(&c.active_bytes),
            inactive_split_bytes: stat_array(&c.inactive_split_bytes),
            requested_bytes: stat_array(&c.requested_bytes),
            num_alloc_retries: unsigned(c.num_alloc_retries),
            num_ooms: unsigned(c.num_ooms),
            num_sync_all_streams: unsigned(c.num_sync_all_streams),
            num_device_alloc: unsigned(c.num_device_alloc),
            num_device_free: unsigned(c.num_device_free),
            oversize_allocations: (&c.oversize_allocations).into(),
            oversize_segments: (&c.oversize_segments).into(),
            page_moves: PageMoves::default(),
        }
    }
}

impl GpuallocDeviceStats {
    /// The statistics `stats` of an allocator whose `max_split_size` is
    /// `max_split` (`u64::MAX`: unlimited), with `size` the whole struct.
    pub fn new(stats: &Stats, max_split: u64) -> Self {
        GpuallocDeviceStats {
            size: size_of::<Self>(),
            allocation: triple(&stats.allocation),
            segment: triple(&stats.segment),
            active: triple(&stats.active),
            inactive_split: triple(&stats.inactive_split),
            allocated_bytes: triple(&stats.allocated_bytes),
            reserved_bytes: triple(&stats.reserved_bytes),
            active_bytes: triple(&stats.active_bytes),
            inactive_split_bytes: triple(&stats.inactive_split_bytes),
            requested_bytes: triple(&stats.requested_bytes),
            oversize_allocations: (&stats.oversize_allocations).into(),
            oversize_segments: (&stats.oversize_segments).into(),
            num_alloc_retries: signed(stats.num_alloc_retries),
            num_ooms: signed(stats.num_ooms),
            num_sync_all_streams: signed(stats.num_sync_all_streams),
            num_device_alloc: signed(stats.num_device_alloc),
            num_device_free: signed(stats.num_device_free),
            max_split_size: if max_split == u64::MAX {
                -1
            } else {
                signed(max_split)
            },
        }
    }

    /// Every number of the struct but `size`, under the flat key of
    /// `torch.cuda.memory_stats()` (and `gpualloc_memory_stats_json`) that
    /// holds the same number: `"allocation.all.current"`, ...,
    /// `"max_split_size"`. The keys are alloc-core's
    /// ([`Stats::to_flat_map`], the one list of PyTorch's names): the struct
    /// is read back as the [`Stats`] it was made from.
    pub fn flat(&self) -> Vec<(String, i64)> {
        let mut out: Vec<_> = Stats::from(self).to_flat_map().into_iter().collect();
        out.push(("max_split_size".to_string(), self.max_split_size));
        out
    }

    /// Copies the fields that fit in a caller's struct of `caller_size`
    /// bytes to `out`, setting its `size` to the bytes filled.
    ///
    /// # Safety
    /// `out` points to at least `caller_size` writable bytes.
    unsafe fn write_to(mut self, out: *mut GpuallocDeviceStats, caller_size: usize) {
        // Whole fields only: every field is 8 bytes wide and aligned.
        let filled = caller_size.min(size_of::<Self>()) & !7;
        self.size = filled;
        // SAFETY: `self` is a plain `repr(C)` value of `size_of::<Self>()`
        // bytes and `filled` is no more than that nor than what the caller
        // said `out` holds.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&self as *const Self).cast::<u8>(),
                out.cast::<u8>(),
                filled,
            );
        }
    }
}

/// The statistics of `device` in `out` (zeros for a device never used); see
/// `include/gpualloc.h`.
///
/// # Safety
/// `out` is NULL or points to a struct whose `size` field holds the number
/// of writable bytes it has.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_device_stats(
    device: c_int,
    out: *mut GpuallocDeviceStats,
) -> c_int {
    call_int(|| {
        if out.is_null() {
            return Err(FfiError::invalid("out is NULL"));
        }
        // SAFETY: non-NULL; the caller's contract makes its first field
        // readable. Read unaligned: C gives no stronger promise we check.
        let caller_size = unsafe { std::ptr::addr_of!((*out).size).read_unaligned() };
        if caller_size < size_of::<usize>() {
            return Err(FfiError::invalid(format!(
                "out->size is {caller_size}: set it to sizeof(GpuallocDeviceStats)"
            )));
        }
        let stats = device_stats(device)?;
        // SAFETY: the caller said `out` has `caller_size` writable bytes.
        unsafe { stats.write_to(out, caller_size) };
        Ok(())
    })
}

/// The statistics of `device`, zeros for a device never used.
fn device_stats(device: c_int) -> FfiResult<GpuallocDeviceStats> {
    if let Some((stats, max_split)) = crate::per_stream::stats(device)? {
        return Ok(GpuallocDeviceStats::new(&stats, max_split));
    }
    Ok(match state::existing(device)? {
        Some(a) => GpuallocDeviceStats::new(&a.stats()?, a.config().max_split_size),
        None => GpuallocDeviceStats::new(&Stats::default(), u64::MAX),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use alloc_core::{AllocatorConfig, SimMemory, SimStreams, StreamId, MIB};
    use alloc_policy::AnyPolicy;

    /// Stats with every counter different from the others, from a small
    /// workload on a simulated device.
    fn busy_stats() -> Stats {
        let cfg = AllocatorConfig::parse("max_split_size_mb:64").unwrap();
        let mut engine =
            AnyPolicy::engine(&cfg, SimMemory::new(1 << 30), SimStreams::new()).expect("engine");
        let small = engine.malloc(1000, StreamId(0)).unwrap();
        let _large = engine.malloc(3 * MIB, StreamId(0)).unwrap();
        let huge = engine.malloc(100 * MIB, StreamId(0)).unwrap();
        engine.free(small.addr).unwrap();
        engine.free(huge.addr).unwrap();
        engine.stats()
    }

    #[test]
    fn every_field_is_the_flat_statistic_of_the_same_name() {
        let stats = busy_stats();
        let mut flat = stats.to_flat_map();
        flat.insert("max_split_size".into(), (64 * MIB) as i64);
        let c = GpuallocDeviceStats::new(&stats, 64 * MIB);
        let fields = c.flat();
        // Every 8-byte field but `size` once: the list misses none.
        assert_eq!(fields.len(), size_of::<GpuallocDeviceStats>() / 8 - 1);
        for (key, value) in &fields {
            assert_eq!(Some(value), flat.get(key), "{key}");
        }
        assert_eq!(c.size, size_of::<GpuallocDeviceStats>());
        // The workload moved the numbers, so equal fields are not all zeros.
        assert_eq!(c.allocation[1].allocated, 1);
        assert_eq!(c.allocation[2].allocated, 2);
        assert_eq!(c.oversize_allocations.allocated, 1);
        assert!(c.allocated_bytes[0].peak > c.allocated_bytes[0].current);
    }

    /// Stats whose every number differs from every other, all fields named
    /// (a field added to `Stats` must be added here too).
    fn distinct_stats() -> Stats {
        struct Numbers(i64);
        impl Numbers {
            fn stat(&mut self) -> Stat {
                self.0 += 4;
                let n = self.0;
                Stat {
                    current: n,
                    peak: n + 1,
                    allocated: n as u64 + 2,
                    freed: n as u64 + 3,
                }
            }
            fn array(&mut self) -> StatArray {
                StatArray {
                    all: self.stat(),
                    small_pool: self.stat(),
                    large_pool: self.stat(),
                }
            }
            fn count(&mut self) -> u64 {
                self.0 += 4;
                self.0 as u64
            }
        }
        let mut n = Numbers(0);
        Stats {
            allocation: n.array(),
            segment: n.array(),
            active: n.array(),
            inactive_split: n.array(),
            allocated_bytes: n.array(),
            reserved_bytes: n.array(),
            active_bytes: n.array(),
            inactive_split_bytes: n.array(),
            requested_bytes: n.array(),
            num_alloc_retries: n.count(),
            num_ooms: n.count(),
            num_sync_all_streams: n.count(),
            num_device_alloc: n.count(),
            num_device_free: n.count(),
            oversize_allocations: n.stat(),
            oversize_segments: n.stat(),
            page_moves: PageMoves::default(),
        }
    }

    #[test]
    fn the_struct_and_the_flat_map_name_each_number_alike() {
        let stats = distinct_stats();
        let c = GpuallocDeviceStats::new(&stats, 3);
        assert_eq!(Stats::from(&c), stats, "read back as it was made");
        let mut expected = stats.to_flat_map();
        expected.insert("max_split_size".into(), 3);
        let flat: std::collections::BTreeMap<_, _> = c.flat().into_iter().collect();
        assert_eq!(flat, expected);
        // Each number once: a field paired with another's name would show.
        let values: std::collections::HashSet<_> = expected.values().collect();
        assert_eq!(values.len(), expected.len());
        // Every 8-byte field of the struct but `size` has a key.
        assert_eq!(flat.len(), size_of::<GpuallocDeviceStats>() / 8 - 1);
    }

    #[test]
    fn unlimited_split_size_is_minus_one() {
        let c = GpuallocDeviceStats::new(&Stats::default(), u64::MAX);
        assert_eq!(c.max_split_size, -1);
        assert_eq!(c.allocated_bytes, [GpuallocStat::default(); 3]);
    }

    #[test]
    fn an_older_caller_gets_the_fields_it_knows_and_no_more() {
        let stats = GpuallocDeviceStats::new(&busy_stats(), 64 * MIB);
        let mut out = GpuallocDeviceStats {
            num_ooms: 77,
            ..Default::default()
        };
        let known = std::mem::offset_of!(GpuallocDeviceStats, num_ooms);
        // SAFETY: `out` has more than `known` bytes.
        unsafe { stats.write_to(&mut out, known + 3) };
        assert_eq!(out.size, known);
        assert_eq!(out.allocation, stats.allocation);
        assert_eq!(out.num_alloc_retries, stats.num_alloc_retries);
        assert_eq!(out.num_ooms, 77, "past the caller's size: untouched");
    }

    #[test]
    fn a_newer_caller_learns_what_was_filled() {
        #[repr(C)]
        struct Newer {
            stats: GpuallocDeviceStats,
            later_field: i64,
        }
        let mut out = Newer {
            stats: GpuallocDeviceStats::default(),
            later_field: 5,
        };
        out.stats.size = size_of::<Newer>();
        // SAFETY: `out` is a valid struct whose size field holds its size.
        let code = unsafe { gpualloc_device_stats(7, &mut out.stats) };
        assert_eq!(code, crate::api::GPUALLOC_OK);
        assert_eq!(out.stats.size, size_of::<GpuallocDeviceStats>());
        assert_eq!(out.stats.max_split_size, -1, "device 7 is unused");
        assert_eq!(out.later_field, 5);
    }

    #[test]
    fn null_and_unsized_structs_are_refused() {
        // SAFETY: NULL is allowed.
        let code = unsafe { gpualloc_device_stats(0, std::ptr::null_mut()) };
        assert_eq!(code, crate::api::GPUALLOC_ERR_INVALID);
        let mut out = GpuallocDeviceStats::default();
        // SAFETY: a valid struct; its size field says 0.
        let code = unsafe { gpualloc_device_stats(0, &mut out) };
        assert_eq!(code, crate::api::GPUALLOC_ERR_INVALID);
        out.size = size_of::<GpuallocDeviceStats>();
        // SAFETY: as above, sized.
        let code = unsafe { gpualloc_device_stats(100_000, &mut out) };
        assert_eq!(
            code,
            crate::api::GPUALLOC_ERR_INVALID,
            "no such device slot"
        );
    }
}
