//! Seam for expandable segments (`expandable_segments:True`), not wired in
//! yet: the engine is gaining growable segments, and this module will hold
//! `VmmSegments`, the memory backend that grows them with the driver's
//! virtual-memory API.
//!
//! The plan, following PyTorch's `ExpandableSegment`:
//! - reserve a large virtual range per (stream, pool) with
//!   `cuMemAddressReserve` (the device's capacity, rounded to the
//!   granularity);
//! - grow by mapping physical chunks of the allocation granularity (2 MiB on
//!   an H100) at its end: `cuMemCreate` + `cuMemMap` + `cuMemSetAccess`;
//! - shrink from the end on `empty_cache` / OOM retry: `cuMemUnmap` +
//!   `cuMemRelease`, after the chunk's blocks are free and their events done;
//! - keep the reservation until the allocator is dropped
//!   (`cuMemAddressFree`).
//!
//! These calls are only in `cudarc::driver::sys`; they will be wrapped in
//! the crate's `driver` module like the others. Until then
//! [`crate::CudaAllocator::new`] refuses a configuration with
//! `expandable_segments:True` ([`crate::CudaError::Unsupported`]).

/// The allocation granularity the virtual-memory backend will map in (the
/// driver reports 2 MiB on the H100; `cuMemGetAllocationGranularity` will be
/// queried when the backend lands).
pub const EXPECTED_GRANULARITY: u64 = 2 << 20;
