//! The engine layout of the devices, decided once when the configuration
//! is sealed: one engine a device ([`alloc_cuda::CudaAllocator`], the
//! default) or an engine for each stream (`engine_per_stream:True`,
//! `crate::per_stream`).

use std::sync::atomic::{AtomicU8, Ordering};

const UNDECIDED: u8 = 0;
const ONE_ENGINE: u8 = 1;
const PER_STREAM: u8 = 2;
static LAYOUT: AtomicU8 = AtomicU8::new(UNDECIDED);

/// Records the layout the sealed configuration asks for (`state::seal`
/// calls it, under the configuration's lock).
pub(crate) fn decide(per_stream: bool) {
    let layout = if per_stream { PER_STREAM } else { ONE_ENGINE };
    LAYOUT.store(layout, Ordering::Release);
}

/// Whether the devices run an engine per stream; `None` before the
/// configuration is sealed.
#[inline]
pub(crate) fn decided() -> Option<bool> {
    match LAYOUT.load(Ordering::Acquire) {
        ONE_ENGINE => Some(false),
        PER_STREAM => Some(true),
        _ => None,
    }
}

/// Whether the layout is known to be an engine per stream, without sealing
/// anything (for calls that must not make an allocator).
#[inline]
pub(crate) fn decided_on() -> bool {
    decided() == Some(true)
}

/// Why a call that needs the one engine of a device is refused under an
/// engine per stream.
pub(crate) const REFUSED: &str = "not available with engine_per_stream:True (an engine for \
     each stream serves malloc and free on the default pool, record_stream, empty_cache, \
     the memory fraction, statistics and snapshots; private pools and CUDA graphs, sleep \
     tags, IPC, checkpoints, segment callbacks and the allocation history need one engine \
     a device)";
