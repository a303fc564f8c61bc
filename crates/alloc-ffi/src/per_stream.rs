//! The C library under `engine_per_stream:True`: each device served by an
//! [`alloc_cuda::StreamEngines`] (an engine for each stream, so that
//! threads allocating on their own streams do not queue on one lock)
//! instead of the one-engine [`alloc_cuda::CudaAllocator`].
//!
//! The layout is decided once, when the configuration is sealed (the first
//! use), and cannot change afterwards. Under it this module serves the
//! calls PyTorch's allocator interface makes on every step: malloc and
//! free on the default pool, `record_stream`, `empty_cache`, the memory
//! fraction, the statistics and their resets, and snapshots. The calls
//! that need the device's single engine (private pools and CUDA graphs,
//! sleep tags, IPC, checkpoints, segment callbacks, recording the
//! allocation history) fail with a message naming the setting
//! ([`state::allocator`] refuses them), as do the settings whose decisions
//! span streams when the configuration is parsed.

use std::sync::OnceLock;

use alloc_core::{AllocError, Stats};
use alloc_cuda::{CudaAllocator, CudaError, StreamEngines, MAX_DEVICES};

use crate::layout;
use crate::state::{self, FfiError, FfiResult};

/// Each device's engines, once made.
static ENGINES: [OnceLock<StreamEngines>; MAX_DEVICES] = [const { OnceLock::new() }; MAX_DEVICES];

/// Whether the devices run an engine per stream (seals the configuration
/// on the first call, as the first allocation would).
#[inline]
pub(crate) fn on() -> FfiResult<bool> {
    match layout::decided() {
        Some(per_stream) => Ok(per_stream),
        None => {
            state::seal_now()?;
            Ok(layout::decided_on())
        }
    }
}

/// The engines of `device`, made on first use with the sealed
/// configuration.
#[inline]
pub(crate) fn engines(device: i32) -> FfiResult<&'static StreamEngines> {
    let d = state::slot(device)?;
    match ENGINES[d].get() {
        Some(e) => Ok(e),
        None => make(d),
    }
}

#[cold]
fn make(d: usize) -> FfiResult<&'static StreamEngines> {
    let _ctx = state::CtxGuard::save_if_driver_loaded();
    crate::call_times::global().read_env();
    let made = StreamEngines::new(d, &CudaAllocator::global_config())?;
    Ok(ENGINES[d].get_or_init(|| made))
}

/// The engines of `device` if they were made (no side effect).
#[inline]
pub(crate) fn existing(device: i32) -> FfiResult<Option<&'static StreamEngines>> {
    Ok(ENGINES[state::slot(device)?].get())
}

/// The engines of every device that has them, in index order.
pub(crate) fn existing_all() -> impl Iterator<Item = (usize, &'static StreamEngines)> {
    state::made(&ENGINES)
}

/// The devices an operation applies to: `-1` = every device with engines.
pub(crate) fn targets(device: i32) -> FfiResult<Vec<(usize, &'static StreamEngines)>> {
    state::targets_in(&ENGINES, device)
}

/// Frees `addr`, on `device` if its engines hold it, else on the device
/// that does.
#[inline]
pub(crate) fn free(addr: u64, device: i32) -> FfiResult<()> {
    let d = state::slot(device)?;
    if let Some(freed) = ENGINES[d].get().and_then(|e| free_in(e, addr)) {
        return freed;
    }
    free_elsewhere(addr, d)
}

/// Frees `addr` in `engines`; `None` if they do not hold it.
#[inline]
fn free_in(engines: &StreamEngines, addr: u64) -> Option<FfiResult<()>> {
    match engines.free(addr) {
        Err(CudaError::Alloc(AllocError::UnknownPointer { .. })) => None,
        other => Some(other.map_err(FfiError::from)),
    }
}

#[cold]
fn free_elsewhere(addr: u64, device: usize) -> FfiResult<()> {
    for (d, e) in existing_all() {
        if d == device {
            continue; // asked already
        }
        if let Some(freed) = free_in(e, addr) {
            return freed;
        }
    }
    Err(FfiError::invalid(format!(
        "free of pointer {addr:#x} on device {device}: not allocated by gpualloc \
         (or already freed)"
    )))
}

/// The statistics of `device` and its `max_split_size`, or `None` when it
/// has no engines.
pub(crate) fn stats(device: i32) -> FfiResult<Option<(Stats, u64)>> {
    match existing(device)? {
        Some(e) => Ok(Some((e.stats()?, e.config().max_split_size))),
        None => Ok(None),
    }
}
