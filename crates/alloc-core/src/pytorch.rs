//! PyTorch's size constants (`c10/cuda/CUDACachingAllocator.cpp`,
//! PyTorch 2.x), in one place for the engine, the configuration and every
//! policy: PyTorch's own rules are built from them, and the other policies
//! take them as defaults so that their pools and segments compare with
//! PyTorch's.

use crate::types::MIB;

/// Every size is rounded to at least this, and to a multiple of it
/// (`kMinBlockSize`).
pub const MIN_BLOCK_SIZE: u64 = 512;

/// The largest request of the small pool, after rounding (`kSmallSize`).
pub const SMALL_SIZE: u64 = MIB;

/// The segment size of the small pool, and the step in which an expandable
/// segment of the small pool grows (`kSmallBuffer`).
pub const SMALL_BUFFER: u64 = 2 * MIB;

/// The segment size for requests between [`SMALL_SIZE`] and
/// [`MIN_LARGE_ALLOC`], the step in which an expandable segment of the
/// large pool grows, the smallest accepted `max_split_size_mb` and the
/// default slack an oversize block may have over the request it serves
/// (`kLargeBuffer`).
pub const LARGE_BUFFER: u64 = 20 * MIB;

/// Requests from this size get a segment of their own size
/// (`kMinLargeAlloc`).
pub const MIN_LARGE_ALLOC: u64 = 10 * MIB;

/// Segments of their own size are rounded up to this (`kRoundLarge`, the
/// driver's allocation granularity).
pub const ROUND_LARGE: u64 = 2 * MIB;

// How PyTorch's rules rely on the sizes nesting, checked when compiling: a
// small request fits a small segment with room to split, requests between
// the pools' limits fit the 20 MiB segment, and every segment size is whole
// blocks and whole granules.
const _: () = assert!(SMALL_SIZE < SMALL_BUFFER && SMALL_BUFFER.is_multiple_of(MIN_BLOCK_SIZE));
const _: () = assert!(SMALL_SIZE < MIN_LARGE_ALLOC && MIN_LARGE_ALLOC < LARGE_BUFFER);
const _: () =
    assert!(LARGE_BUFFER.is_multiple_of(ROUND_LARGE) && SMALL_BUFFER.is_multiple_of(ROUND_LARGE));
