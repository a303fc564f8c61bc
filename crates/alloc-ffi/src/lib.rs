#![doc = include_str!("../README.md")]
//!
//! ## From Rust
//!
//! The entry points are plain functions of this crate too; checking a
//! configuration needs no GPU:
//!
//! ```
//! use std::ffi::CStr;
//!
//! use alloc_ffi::api::{GPUALLOC_ERR_INVALID, GPUALLOC_OK};
//! use alloc_ffi::{gpualloc_check_config, gpualloc_last_error};
//!
//! let good = c"max_split_size_mb:128,garbage_collection_threshold:0.8";
//! // SAFETY: NUL-terminated strings that outlive the calls.
//! assert_eq!(unsafe { gpualloc_check_config(good.as_ptr()) }, GPUALLOC_OK);
//! let bad = c"max_split_size_mb:lots";
//! assert_eq!(unsafe { gpualloc_check_config(bad.as_ptr()) }, GPUALLOC_ERR_INVALID);
//! // SAFETY: the message stays valid until the next call on this thread.
//! let message = unsafe { CStr::from_ptr(gpualloc_last_error()) }.to_string_lossy();
//! assert!(message.contains("max_split_size_mb"), "{message}");
//! ```
//!
//! ## Behaviour
//!
//! The declarations are in `include/gpualloc.h`, generated from
//! [`api::API`].
//!
//! - One process-wide allocator per device ([`alloc_cuda::CudaAllocator::global`]),
//!   created at the first call that needs it. Its configuration comes from
//!   [`gpualloc_configure`] if called before, else from the environment
//!   variable `GPUALLOC_CONF` (syntax of `PYTORCH_CUDA_ALLOC_CONF`: `policy`,
//!   `max_split_size_mb`, `roundup_power2_divisions`,
//!   `garbage_collection_threshold`, `expandable_segments`,
//!   `stream_wait_reuse`, ...), read once. An invalid `GPUALLOC_CONF` is
//!   reported once on stderr and **every allocation then fails** with that
//!   message: running with settings other than those asked for would be worse.
//!   With `engine_per_stream:True` each device is served by an
//!   [`alloc_cuda::StreamEngines`] instead (an engine for each stream, for
//!   threads allocating on their own streams, under one memory fraction);
//!   the calls that need one engine a device (private pools, sleep tags,
//!   IPC, checkpoints, the allocation history) then fail naming the
//!   setting.
//! - No panic crosses the C ABI: every entry point runs inside
//!   [`std::panic::catch_unwind`]. Failures return NULL or a negative
//!   `GPUALLOC_ERR_*` code; the message is [`gpualloc_last_error`]
//!   (thread-local).
//! - With `GPUALLOC_TIME_CALLS=1` in the environment (read as the first
//!   device's allocator is made) the library counts and times its own
//!   malloc and free calls per device: `host_calls.*` in
//!   [`gpualloc_memory_stats_json`], cleared by
//!   [`gpualloc_reset_accumulated_stats`]. Off, a call pays one load.
//! - `gpualloc_malloc(0, ..)` returns NULL without an error: a zero-byte
//!   block has no address, PyTorch keeps a NULL data pointer for an empty
//!   tensor and never calls free for it. A negative size is an error.
//! - PyTorch 2.11's `CUDAPluggableAllocator` does not check the pointer it
//!   gets back, so an allocation failure does not raise `OutOfMemoryError`:
//!   the tensor gets a NULL data pointer. The first failures are therefore
//!   also written to stderr with the allocator's out-of-memory report.

#![warn(missing_docs)]

mod advise;
pub mod api;
mod call_times;
mod checkpoint;
mod device_stats;
mod host_register;
mod ipc;
mod layout;
mod per_stream;
mod pool_allocator;
mod segments;
mod sleep;
pub mod snapshot;
mod state;

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use alloc_core::{AllocError, PoolId};
use alloc_cuda::{AnyPolicy, CudaAllocator, CudaError, Pools, StreamHandle};

pub use advise::{gpualloc_advise, gpualloc_advise_budget};
pub use api::{
    GpuallocDeviceStats, GpuallocStat, GPUALLOC_HOST_REGISTER_MAPPED, GPUALLOC_SEGMENT_ALLOC,
    GPUALLOC_SEGMENT_FREE, GPUALLOC_SEGMENT_MAP, GPUALLOC_SEGMENT_UNMAP,
};
pub use checkpoint::{
    gpualloc_checkpoint_pool, gpualloc_pool_checkpoint_free, gpualloc_pool_live_allocations_are,
    gpualloc_restore_pool, gpualloc_u64_array_free,
};
pub use device_stats::gpualloc_device_stats;
pub use host_register::{gpualloc_host_register, gpualloc_host_unregister};
pub use pool_allocator::{gpualloc_set_pool_allocator, PoolAllocFn, PoolFreeFn};
pub use segments::{gpualloc_set_segment_callback, SegmentCallback};
pub use sleep::{
    gpualloc_bind_tag, gpualloc_host_alloc, gpualloc_host_empty_cache, gpualloc_host_free,
    gpualloc_host_record_stream, gpualloc_host_stats_json, gpualloc_pause, gpualloc_resume,
    gpualloc_tag_pool, gpualloc_tags_json,
};
use state::{CtxGuard, FfiResult};
pub use state::{FfiError, ENV_CONF};

/// `cudaStream_t`: an opaque stream handle (`0` is the legacy default stream).
pub type CudaStream = *mut c_void;

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string());
    format!("internal error (panic caught at the C boundary): {what}")
}

/// Runs an entry point returning an int code: 0, or the error's code with
/// the message stored as the thread's last error.
fn call_int(f: impl FnOnce() -> FfiResult<()>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => {
            state::clear_last_error();
            api::GPUALLOC_OK
        }
        Ok(Err(e)) => {
            state::set_last_error(e.code, &e.message);
            e.code
        }
        Err(p) => {
            state::set_last_error(api::GPUALLOC_ERR_INTERNAL, &panic_message(p));
            api::GPUALLOC_ERR_INTERNAL
        }
    }
}

/// Runs an entry point returning a pointer: NULL on failure.
fn call_ptr<T>(f: impl FnOnce() -> FfiResult<*mut T>) -> *mut T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            state::set_last_error(e.code, &e.message);
            std::ptr::null_mut()
        }
        Err(p) => {
            state::set_last_error(api::GPUALLOC_ERR_INTERNAL, &panic_message(p));
            std::ptr::null_mut()
        }
    }
}

/// A C string argument as `&str`.
///
/// # Safety
/// `s` is NULL or a NUL-terminated string valid for the call.
unsafe fn c_str<'a>(s: *const c_char, what: &str) -> FfiResult<&'a str> {
    if s.is_null() {
        return Err(FfiError::invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-NULL and NUL-terminated per the caller's contract.
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map_err(|_| FfiError::invalid(format!("{what} is not valid UTF-8")))
}

// ---------------------------------------------------------------- hot path

/// Allocates `size` bytes on `device` for `stream`; NULL on failure (see
/// `include/gpualloc.h`).
#[no_mangle]
pub extern "C" fn gpualloc_malloc(size: isize, device: c_int, stream: CudaStream) -> *mut c_void {
    match catch_unwind(AssertUnwindSafe(|| malloc_impl(size, device, stream))) {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            malloc_failed(size, device, &e);
            std::ptr::null_mut()
        }
        Err(p) => {
            let e = FfiError::internal(panic_message(p));
            malloc_failed(size, device, &e);
            std::ptr::null_mut()
        }
    }
}

#[inline(always)]
fn malloc_impl(size: isize, device: c_int, stream: CudaStream) -> FfiResult<*mut c_void> {
    malloc_counted(size, device, stream, None)
}

/// [`malloc_in`], timed when `GPUALLOC_TIME_CALLS=1` (both malloc entry
/// points come here).
#[inline(always)]
fn malloc_counted(
    size: isize,
    device: c_int,
    stream: CudaStream,
    pool: Option<PoolId>,
) -> FfiResult<*mut c_void> {
    if call_times::global().on() {
        return timed_malloc(size, device, stream, pool);
    }
    malloc_in(size, device, stream, pool)
}

/// [`malloc_in`] timed (`GPUALLOC_TIME_CALLS=1`), out of line so that the
/// untimed path stays as it was.
#[cold]
#[inline(never)]
fn timed_malloc(
    size: isize,
    device: c_int,
    stream: CudaStream,
    pool: Option<PoolId>,
) -> FfiResult<*mut c_void> {
    call_times::global().time(call_times::Call::Malloc, device, || {
        malloc_in(size, device, stream, pool)
    })
}

#[inline(always)]
fn malloc_in(
    size: isize,
    device: c_int,
    stream: CudaStream,
    pool: Option<PoolId>,
) -> FfiResult<*mut c_void> {
    if size <= 0 {
        if size == 0 {
            state::clear_last_error();
            return Ok(std::ptr::null_mut());
        }
        return Err(FfiError::invalid(format!(
            "invalid allocation size {size}: negative"
        )));
    }
    // SAFETY: the stream comes from the caller (PyTorch's current stream of
    // `device`, or 0): a stream of the device's primary context that lives
    // as long as the allocator holds anything of it, as the header demands
    // (PyTorch never destroys the streams of its pools).
    let handle = unsafe { StreamHandle::from_raw(stream.cast()) };
    let stream = handle.id();
    // The one engine first: a device made under `engine_per_stream` has none.
    let served = match state::existing(device)? {
        Some(alloc) => alloc.malloc_in_pool(size as u64, &handle, pool),
        None if pool.is_none() && per_stream::on()? => {
            per_stream::engines(device)?.malloc(size as u64, &handle)
        }
        None => state::allocator(device)?.malloc_in_pool(size as u64, &handle, pool),
    };
    match served {
        Ok(addr) => {
            if snapshot::recording() {
                snapshot::record(device as usize, "alloc", addr, size as u64, stream.0, None);
            }
            Ok(addr as usize as *mut c_void)
        }
        Err(e) => {
            if snapshot::recording() {
                if let Some(r) = e.oom_report() {
                    let free = Some(r.device_free);
                    snapshot::record(device as usize, "oom", 0, size as u64, stream.0, free);
                }
            }
            Err(e.into())
        }
    }
}

#[cold]
fn malloc_failed(size: isize, device: c_int, e: &FfiError) {
    state::set_last_error(e.code, &e.message);
    // Out of memory and driver failures also go to stderr, since PyTorch does
    // not look at the NULL (bad arguments and a bad GPUALLOC_CONF, which is
    // reported once when read, only go to the last error).
    if e.code == api::GPUALLOC_ERR_INVALID {
        return;
    }
    state::report(
        &state::MALLOC_FAILURES,
        &format!(
            "gpualloc_malloc({size} bytes, device {device}) returned NULL: {}",
            e.message
        ),
    );
}

/// Frees a block from [`gpualloc_malloc`]; `size` and `stream` are ignored.
#[no_mangle]
pub extern "C" fn gpualloc_free(ptr: *mut c_void, size: isize, device: c_int, stream: CudaStream) {
    let _ = (size, stream);
    let result = catch_unwind(AssertUnwindSafe(|| free_impl(ptr, device)))
        .unwrap_or_else(|p| Err(FfiError::internal(panic_message(p))));
    if let Err(e) = result {
        free_failed(ptr, device, &e);
    }
}

#[inline(always)]
fn free_impl(ptr: *mut c_void, device: c_int) -> FfiResult<()> {
    if ptr.is_null() {
        return Ok(());
    }
    if call_times::global().on() {
        return timed_free(ptr, device);
    }
    free_ptr(ptr, device)
}

/// [`free_ptr`] timed (`GPUALLOC_TIME_CALLS=1`), out of line.
#[cold]
#[inline(never)]
fn timed_free(ptr: *mut c_void, device: c_int) -> FfiResult<()> {
    call_times::global().time(call_times::Call::Free, device, || free_ptr(ptr, device))
}

/// Frees a non-NULL `ptr` (the device is a hint).
#[inline(always)]
fn free_ptr(ptr: *mut c_void, device: c_int) -> FfiResult<()> {
    let addr = ptr as usize as u64;
    let Some(alloc) = state::existing(device)? else {
        if layout::decided_on() {
            return per_stream::free(addr, device);
        }
        return free_elsewhere(addr, device);
    };
    match free_on(alloc, device as usize, addr) {
        Ok(()) => Ok(()),
        Err(CudaError::Alloc(AllocError::UnknownPointer { .. })) => free_elsewhere(addr, device),
        Err(e) => Err(e.into()),
    }
}

#[inline(always)]
fn free_on(alloc: &CudaAllocator, device: usize, addr: u64) -> Result<(), CudaError> {
    if snapshot::recording() {
        free_recorded(alloc, device, addr)
    } else {
        alloc.free(addr)
    }
}

/// [`free_on`] recording `free_requested` / `free_completed` events with the
/// block's requested size and stream.
#[cold]
fn free_recorded(alloc: &CudaAllocator, device: usize, addr: u64) -> Result<(), CudaError> {
    let block = alloc.diagnostics().allocation(addr)?;
    alloc.free(addr)?;
    if let Some(b) = block {
        snapshot::record(
            device,
            "free_requested",
            addr,
            b.requested,
            b.stream.0,
            None,
        );
        snapshot::record(
            device,
            "free_completed",
            addr,
            b.requested,
            b.stream.0,
            None,
        );
    }
    Ok(())
}

/// A pointer unknown on `device`: free it on the device that owns it, if any.
#[cold]
fn free_elsewhere(addr: u64, device: c_int) -> FfiResult<()> {
    for (d, alloc) in state::existing_all() {
        if d as c_int != device && alloc.diagnostics().allocation(addr)?.is_some() {
            return Ok(free_on(alloc, d, addr)?);
        }
    }
    Err(FfiError::invalid(format!(
        "free of pointer {addr:#x} on device {device}: not allocated by gpualloc \
         (or already freed)"
    )))
}

#[cold]
fn free_failed(ptr: *mut c_void, device: c_int, e: &FfiError) {
    state::set_last_error(e.code, &e.message);
    state::report(
        &state::FREE_FAILURES,
        &format!(
            "gpualloc_free({ptr:p}, device {device}) failed: {}",
            e.message
        ),
    );
}

/// The pool id `(first, second)`; `(0, 0)` means no private pool.
fn pool_id(first: u64, second: u64) -> Option<PoolId> {
    (first != 0 || second != 0).then_some((first, second))
}

/// [`gpualloc_malloc`] from a private pool; failures only in the last error.
#[no_mangle]
pub extern "C" fn gpualloc_malloc_in_pool(
    size: isize,
    device: c_int,
    stream: CudaStream,
    pool_first: u64,
    pool_second: u64,
) -> *mut c_void {
    call_ptr(|| malloc_counted(size, device, stream, pool_id(pool_first, pool_second)))
}

/// Fails naming the first NULL among required pointer arguments, given as
/// `(is_null, name)`.
fn required(args: &[(bool, &str)]) -> FfiResult<()> {
    match args.iter().find(|(null, _)| *null) {
        Some((_, name)) => Err(FfiError::invalid(format!("{name} is NULL"))),
        None => Ok(()),
    }
}

/// The pool `(first, second)`, which must not be `(0, 0)`.
fn named_pool(first: u64, second: u64) -> FfiResult<PoolId> {
    pool_id(first, second).ok_or_else(|| FfiError::invalid("pool id (0, 0) names no pool"))
}

/// Runs `f` on the pools of `device`'s allocator with the named pool, as
/// an int entry point.
fn on_pool(
    device: c_int,
    first: u64,
    second: u64,
    f: impl FnOnce(&Pools<'static, AnyPolicy>, PoolId) -> Result<(), CudaError>,
) -> c_int {
    call_int(|| {
        let pool = named_pool(first, second)?;
        let _ctx = CtxGuard::save_if_driver_loaded();
        Ok(f(&state::allocator(device)?.pools(), pool)?)
    })
}

/// Starts routing allocations to a private pool; see `include/gpualloc.h`.
#[no_mangle]
pub extern "C" fn gpualloc_begin_allocate_to_pool(device: c_int, first: u64, second: u64) -> c_int {
    on_pool(device, first, second, Pools::begin_allocate_to)
}

/// Ends a routing to a private pool.
#[no_mangle]
pub extern "C" fn gpualloc_end_allocate_to_pool(device: c_int, first: u64, second: u64) -> c_int {
    on_pool(device, first, second, Pools::end_allocate_to)
}

/// One more holder of a private pool.
#[no_mangle]
pub extern "C" fn gpualloc_retain_pool(device: c_int, first: u64, second: u64) -> c_int {
    on_pool(device, first, second, Pools::retain)
}

/// One holder of a private pool fewer.
#[no_mangle]
pub extern "C" fn gpualloc_release_pool(device: c_int, first: u64, second: u64) -> c_int {
    on_pool(device, first, second, Pools::release)
}

/// Returns one private pool's idle segments to the driver; see
/// `include/gpualloc.h`.
#[no_mangle]
pub extern "C" fn gpualloc_empty_pool_cache(device: c_int, first: u64, second: u64) -> c_int {
    call_int(|| {
        let pool = named_pool(first, second)?;
        let _ctx = CtxGuard::save_if_driver_loaded();
        for (_, alloc) in state::targets(device)? {
            alloc.pools().empty_cache(pool)?;
        }
        Ok(())
    })
}

/// Makes a private pool hand out whole blocks, never split.
#[no_mangle]
pub extern "C" fn gpualloc_set_pool_no_split(device: c_int, first: u64, second: u64) -> c_int {
    on_pool(device, first, second, Pools::set_no_split)
}

/// Holders of a private pool; negative on error.
#[no_mangle]
pub extern "C" fn gpualloc_pool_use_count(
    device: c_int,
    pool_first: u64,
    pool_second: u64,
) -> c_int {
    let mut count = 0;
    let code = call_int(|| {
        let pool = named_pool(pool_first, pool_second)?;
        count = match state::existing(device)? {
            Some(alloc) => alloc.pools().use_count(pool)?,
            None => 0,
        };
        Ok(())
    });
    if code == api::GPUALLOC_OK {
        count.min(c_int::MAX as u32) as c_int
    } else {
        code
    }
}

// ---------------------------------------------------------------- configuration

/// Sets the configuration before the first use; see `include/gpualloc.h`.
///
/// # Safety
/// `config` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_configure(config: *const c_char) -> c_int {
    call_int(|| {
        // SAFETY: the caller's contract.
        let text = unsafe { c_str(config, "config") }?;
        state::configure(text)
    })
}

/// Changes the settings a string names, at run time; see `include/gpualloc.h`.
///
/// # Safety
/// `settings` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_update_settings(settings: *const c_char) -> c_int {
    call_int(|| {
        // SAFETY: the caller's contract.
        let text = unsafe { c_str(settings, "settings") }?;
        state::update_settings(text)
    })
}

/// Validates a configuration string without applying it.
///
/// # Safety
/// `config` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_check_config(config: *const c_char) -> c_int {
    call_int(|| {
        // SAFETY: the caller's contract.
        let text = unsafe { c_str(config, "config") }?;
        state::check_config(text)
    })
}

// ---------------------------------------------------------------- cache and streams

/// Returns unused cached segments of `device` (-1: all devices) to the driver.
#[no_mangle]
pub extern "C" fn gpualloc_empty_cache(device: c_int) -> c_int {
    call_int(|| {
        let _ctx = CtxGuard::save_if_driver_loaded();
        for (_, alloc) in state::targets(device)? {
            alloc.empty_cache()?;
        }
        for (_, engines) in per_stream::targets(device)? {
            engines.empty_cache()?;
        }
        Ok(())
    })
}

/// Limits reserved memory of `device` to `fraction` of its capacity.
#[no_mangle]
pub extern "C" fn gpualloc_set_memory_fraction(fraction: f64, device: c_int) -> c_int {
    call_int(|| {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(FfiError::invalid(format!(
                "memory fraction {fraction} must be in [0, 1]"
            )));
        }
        if per_stream::on()? {
            return Ok(per_stream::engines(device)?.set_memory_fraction(fraction)?);
        }
        Ok(state::allocator(device)?.set_memory_fraction(fraction)?)
    })
}

/// Marks the block at `ptr` as used by `stream` too.
#[no_mangle]
pub extern "C" fn gpualloc_record_stream(
    ptr: *mut c_void,
    device: c_int,
    stream: CudaStream,
) -> c_int {
    call_int(|| {
        let addr = ptr as usize as u64;
        let none = || {
            FfiError::invalid(format!(
                "record_stream of pointer {addr:#x}: no allocation was made on device {device}"
            ))
        };
        // SAFETY: the caller promises the stream outlives the block's free
        // (documented in the header), as with Tensor.record_stream.
        let handle = unsafe { StreamHandle::from_raw(stream.cast()) };
        if layout::decided_on() {
            let engines = per_stream::existing(device)?.ok_or_else(none)?;
            return Ok(engines.record_stream(addr, &handle)?);
        }
        let alloc = state::existing(device)?.ok_or_else(none)?;
        Ok(alloc.record_stream(addr, &handle)?)
    })
}

// ---------------------------------------------------------------- statistics

/// Makes every peak statistic of `device` (-1: all) equal to its current value.
#[no_mangle]
pub extern "C" fn gpualloc_reset_peak_stats(device: c_int) -> c_int {
    call_int(|| {
        for (_, alloc) in state::targets(device)? {
            alloc.reset_peak_stats()?;
        }
        for (_, engines) in per_stream::targets(device)? {
            engines.reset_peak_stats()?;
        }
        Ok(())
    })
}

/// Clears the cumulative counters of `device` (-1: all).
#[no_mangle]
pub extern "C" fn gpualloc_reset_accumulated_stats(device: c_int) -> c_int {
    call_int(|| {
        for (d, alloc) in state::targets(device)? {
            alloc.reset_accumulated_stats()?;
            call_times::global().reset(d);
        }
        for (d, engines) in per_stream::targets(device)? {
            engines.reset_accumulated_stats()?;
            call_times::global().reset(d);
        }
        Ok(())
    })
}

/// The statistics of one allocator (or zeros) as PyTorch's flat map, plus
/// `max_split_size` (-1 when unset, as PyTorch reports it), our
/// `page_moves.*` counters (`unmap_free_pages`), the `stream_ops.*` counters
/// (host waits, stream waits, event records and queries) and, with
/// `plan_layout`, the `plan_layout.*` counters.
pub fn stats_map(
    alloc: Option<&CudaAllocator>,
) -> FfiResult<std::collections::BTreeMap<String, i64>> {
    let (stats, max_split) = match alloc {
        Some(a) => (a.stats()?, a.config().max_split_size),
        None => (alloc_core::Stats::default(), u64::MAX),
    };
    let (plan, ops) = match alloc {
        Some(a) => (
            a.diagnostics().plan_stats()?,
            a.diagnostics().stream_op_counts()?,
        ),
        None => (None, alloc_cuda::StreamOpCounts::default()),
    };
    Ok(flat_stats(&stats, max_split, plan, ops))
}

/// [`stats_map`]'s map from its parts (an engine per stream has no plan and
/// counts no stream operations: the settings that make them are refused).
fn flat_stats(
    stats: &alloc_core::Stats,
    max_split: u64,
    plan: Option<alloc_policy::layout_plan::PlanStats>,
    ops: alloc_cuda::StreamOpCounts,
) -> std::collections::BTreeMap<String, i64> {
    let mut map = stats.to_flat_map();
    let counters = stats.page_moves.named().into_iter().chain(ops.named());
    for (name, value) in counters.chain(plan.iter().flat_map(|p| p.named())) {
        map.insert(name.into(), i64::try_from(value).unwrap_or(i64::MAX));
    }
    let max_split = if max_split == u64::MAX {
        -1
    } else {
        max_split as i64
    };
    map.insert("max_split_size".into(), max_split);
    map
}

/// The statistics of `device` as a JSON object (free with
/// [`gpualloc_string_free`]); NULL on error.
#[no_mangle]
pub extern "C" fn gpualloc_memory_stats_json(device: c_int) -> *mut c_char {
    call_ptr(|| {
        let mut map = match per_stream::stats(device)? {
            Some((stats, max_split)) => flat_stats(&stats, max_split, None, Default::default()),
            None => stats_map(state::existing(device)?)?,
        };
        if let Ok(d) = usize::try_from(device) {
            for (name, value) in call_times::global().named(d) {
                map.insert(name.into(), i64::try_from(value).unwrap_or(i64::MAX));
            }
        }
        let json = serde_json::to_string(&map).map_err(|e| FfiError::internal(e.to_string()))?;
        let c = CString::new(json).map_err(|e| FfiError::internal(e.to_string()))?;
        Ok(c.into_raw())
    })
}

/// The configuration in effect (free with [`gpualloc_string_free`]); NULL
/// on error.
#[no_mangle]
pub extern "C" fn gpualloc_settings_text() -> *mut c_char {
    call_ptr(|| {
        let c =
            CString::new(state::config_text()).map_err(|e| FfiError::internal(e.to_string()))?;
        Ok(c.into_raw())
    })
}

/// Frees a string returned by this library.
///
/// # Safety
/// `s` is NULL or a string from this library, not freed before.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_string_free(s: *mut c_char) {
    if s.is_null() {
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `s` came from `CString::into_raw` in this library.
        drop(unsafe { CString::from_raw(s) });
    }));
}

// ---------------------------------------------------------------- snapshots

/// The snapshot of `device` (-1: every device in use) in PyTorch's layout.
pub fn build_snapshot(device: c_int) -> FfiResult<snapshot::PySnapshot> {
    let targets = state::targets(device)?;
    let mut segments = Vec::new();
    let mut settings = None;
    let conf_text = state::config_text();
    for (d, alloc) in &targets {
        let snap = alloc.snapshot()?;
        segments.extend(snapshot::segments_of(*d, &snap));
        if settings.is_none() {
            let policy = alloc.diagnostics().policy_name()?;
            settings = Some(snapshot::settings_of(&conf_text, &alloc.config(), &policy));
        }
    }
    let engines = per_stream::targets(device)?;
    for (d, e) in &engines {
        segments.extend(snapshot::segments_of(*d, &e.snapshot()?));
        if settings.is_none() {
            settings = Some(snapshot::settings_of(
                &conf_text,
                e.config(),
                e.policy_name(),
            ));
        }
    }
    let settings = match settings {
        Some(s) => s,
        None => {
            let cfg = alloc_core::AllocatorConfig::parse(&conf_text).unwrap_or_default();
            let policy = cfg.policy.clone().unwrap_or_else(|| "pytorch-bfc".into());
            snapshot::settings_of(&conf_text, &cfg, &policy)
        }
    };
    let mut n = snapshot::traced_devices();
    if let Some(d) = targets
        .iter()
        .map(|t| t.0)
        .chain(engines.iter().map(|t| t.0))
        .max()
    {
        n = n.max(d + 1);
    }
    if device >= 0 {
        n = n.max(device as usize + 1);
    }
    n = n.max(1);
    Ok(snapshot::PySnapshot {
        segments,
        device_traces: snapshot::traces(n),
        allocator_settings: settings,
    })
}

/// The snapshot of `device` (-1: all) as text for the C++ bridge (free with
/// [`gpualloc_string_free`]); NULL on error.
#[no_mangle]
pub extern "C" fn gpualloc_snapshot_text(device: c_int) -> *mut c_char {
    call_ptr(|| {
        let text = snapshot::to_text(&build_snapshot(device)?);
        let c = CString::new(text).map_err(|e| FfiError::internal(e.to_string()))?;
        Ok(c.into_raw())
    })
}

/// Writes the snapshot of `device` (-1: all) as a pickle to `path`.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_write_snapshot(path: *const c_char, device: c_int) -> c_int {
    call_int(|| {
        // SAFETY: the caller's contract.
        let path = unsafe { c_str(path, "path") }?;
        if path.is_empty() {
            return Err(FfiError::invalid("path is empty"));
        }
        let snap = build_snapshot(device)?;
        let bytes = snapshot::to_pickle(&snap).map_err(FfiError::internal)?;
        std::fs::write(path, bytes)
            .map_err(|e| FfiError::invalid(format!("cannot write snapshot to {path}: {e}")))
    })
}

/// Starts or stops recording allocation events for the snapshots.
#[no_mangle]
pub extern "C" fn gpualloc_record_history(enabled: c_int, max_entries: isize) -> c_int {
    call_int(|| {
        if enabled != 0 && per_stream::on()? {
            // Frees would be recorded without their blocks' sizes and streams.
            return Err(FfiError::invalid(layout::REFUSED));
        }
        snapshot::set_recording(enabled != 0, max_entries);
        Ok(())
    })
}

// ---------------------------------------------------------------- misc

/// The `GPUALLOC_ERR_*` code of this thread's last error, or 0.
#[no_mangle]
pub extern "C" fn gpualloc_last_error_code() -> c_int {
    catch_unwind(state::last_error_code).unwrap_or(api::GPUALLOC_ERR_INTERNAL)
}

/// The last error message of this thread, or NULL.
#[no_mangle]
pub extern "C" fn gpualloc_last_error() -> *const c_char {
    catch_unwind(state::last_error_ptr).unwrap_or(std::ptr::null())
}

static VERSION: &CStr =
    match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(s) => s,
        Err(_) => c"unknown",
    };

/// The library version.
#[no_mangle]
pub extern "C" fn gpualloc_version() -> *const c_char {
    VERSION.as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> String {
        let p = gpualloc_last_error();
        assert!(!p.is_null());
        // SAFETY: a NUL-terminated string valid until the next call.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    #[test]
    fn panics_become_internal_errors_not_unwinding() {
        assert_eq!(call_int(|| panic!("boom")), api::GPUALLOC_ERR_INTERNAL);
        assert!(last().contains("boom"), "{}", last());
        let p: *mut u8 = call_ptr(|| panic!("{}", String::from("bang")));
        assert!(p.is_null());
        assert!(last().contains("panic caught at the C boundary): bang"));
        assert_eq!(call_int(|| Ok(())), api::GPUALLOC_OK);
        assert!(gpualloc_last_error().is_null());
    }
}
