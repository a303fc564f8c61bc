//! Sleep tags and pinned host memory across the C ABI: a tag's pool
//! (`gpualloc_tag_pool`, or `gpualloc_bind_tag` for a PyTorch `MemPool`),
//! `gpualloc_pause` / `gpualloc_resume`, the tags' state as JSON, and the
//! pinned host allocator (`gpualloc_host_*`).

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::{Mutex, MutexGuard};

use alloc_core::{AllocError, Backup, TagInfo};
use alloc_cuda::{CudaAllocator, CudaError, PinnedAllocator, PinnedBuffer, StreamHandle};

use crate::state::{self, CtxGuard, FfiError, FfiResult};
use crate::{c_str, call_int, call_ptr, named_pool, CudaStream};

/// The backup named by `backup` (NULL: `"none"`).
///
/// # Safety
/// `backup` is NULL or a NUL-terminated string.
unsafe fn backup_arg(backup: *const c_char) -> FfiResult<Backup> {
    if backup.is_null() {
        return Ok(Backup::None);
    }
    // SAFETY: the caller's contract.
    let text = unsafe { c_str(backup, "backup") }?;
    Backup::parse(text).ok_or_else(|| {
        FfiError::invalid(format!("backup \"{text}\": expected \"none\" or \"host\""))
    })
}

/// The tag named by `tag`, or `None` for NULL (every tag).
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
unsafe fn tag_arg<'a>(tag: *const c_char) -> FfiResult<Option<&'a str>> {
    if tag.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's contract.
    unsafe { c_str(tag, "tag") }.map(Some)
}

/// Runs `f` on every (allocator, tag) that a pause (`paused == false`) or
/// a resume (`true`) applies to: the named `tag` on `device` (on each
/// device in use that has it, for -1), or every tag of those devices in
/// the other state (`tag` NULL). A named tag found nowhere is unknown.
fn for_each_tag(
    device: c_int,
    tag: Option<&str>,
    paused: bool,
    f: impl Fn(&CudaAllocator, &str) -> Result<(), CudaError>,
) -> FfiResult<()> {
    let mut found = false;
    for (_, alloc) in state::targets(device)? {
        let names: Vec<String> = match tag {
            // The engine's error says what is wrong with the tag there.
            Some(t) if device >= 0 => vec![t.to_string()],
            _ => alloc
                .sleep()
                .tags()?
                .into_iter()
                .filter(|i| tag.map_or(i.paused == paused, |t| i.name == t))
                .map(|i| i.name)
                .collect(),
        };
        for name in names {
            found = true;
            f(alloc, &name)?;
        }
    }
    match tag {
        Some(t) if !found => Err(FfiError::from(CudaError::Alloc(AllocError::Tag {
            tag: t.to_string(),
            reason: "is unknown: no allocation was tagged with it",
        }))),
        _ => Ok(()),
    }
}

/// Writes the pool of the sleep tag `tag` on `device` (created on first
/// use); see `include/gpualloc.h`.
///
/// # Safety
/// `tag` is a NUL-terminated string; the out-pointers are valid for writes.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_tag_pool(
    device: c_int,
    tag: *const c_char,
    pool_first: *mut u64,
    pool_second: *mut u64,
) -> c_int {
    call_int(|| {
        crate::required(&[
            (pool_first.is_null(), "pool_first"),
            (pool_second.is_null(), "pool_second"),
        ])?;
        // SAFETY: the caller's contract.
        let tag = unsafe { c_str(tag, "tag") }?;
        let _ctx = CtxGuard::save_if_driver_loaded();
        let pool = state::allocator(device)?.sleep().tag(tag)?.pool();
        // SAFETY: checked non-NULL above; writable by the caller's contract.
        unsafe {
            *pool_first = pool.0;
            *pool_second = pool.1;
        }
        Ok(())
    })
}

/// Makes the private pool `(first, second)` (a `MemPool` with no segment
/// yet) the pool of the new sleep tag `tag`.
///
/// # Safety
/// `tag` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_bind_tag(
    device: c_int,
    tag: *const c_char,
    first: u64,
    second: u64,
) -> c_int {
    call_int(|| {
        // SAFETY: the caller's contract.
        let tag = unsafe { c_str(tag, "tag") }?;
        let pool = named_pool(first, second)?;
        Ok(state::allocator(device)?.sleep().bind_tag(tag, pool)?)
    })
}

/// Pauses the sleep tag `tag` (NULL: every tag not paused) of `device`
/// (-1: every device in use).
///
/// # Safety
/// `tag` and `backup` are NULL or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_pause(
    device: c_int,
    tag: *const c_char,
    backup: *const c_char,
) -> c_int {
    call_int(|| {
        // SAFETY: the caller's contract.
        let (tag, backup) = unsafe { (tag_arg(tag)?, backup_arg(backup)?) };
        let _ctx = CtxGuard::save_if_driver_loaded();
        for_each_tag(device, tag, false, |alloc, t| {
            alloc.sleep().pause(t, backup).map(drop)
        })
    })
}

/// Resumes the paused sleep tag `tag` (NULL: every paused tag) of `device`
/// (-1: every device in use).
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_resume(device: c_int, tag: *const c_char) -> c_int {
    call_int(|| {
        // SAFETY: the caller's contract.
        let tag = unsafe { tag_arg(tag) }?;
        let _ctx = CtxGuard::save_if_driver_loaded();
        for_each_tag(device, tag, true, |alloc, t| {
            alloc.sleep().resume(t).map(drop)
        })
    })
}

/// One tag as JSON (the fields of [`TagInfo`], with its device).
fn tag_json(device: usize, t: &TagInfo) -> serde_json::Value {
    serde_json::json!({
        "device": device,
        "name": t.name,
        "pool": [t.pool.0, t.pool.1],
        "paused": t.paused,
        "backup": t.backup.map(Backup::name),
        "paused_bytes": t.paused_bytes,
        "backed_up_bytes": t.backed_up_bytes,
        "reserved_bytes": t.reserved_bytes,
        "allocated_bytes": t.allocated_bytes,
        "segments": t.segments,
    })
}

/// A JSON value as a C string owned by the caller (freed with
/// `gpualloc_string_free`).
fn json_string(value: &serde_json::Value) -> FfiResult<*mut c_char> {
    let c = CString::new(value.to_string()).map_err(|e| FfiError::internal(e.to_string()))?;
    Ok(c.into_raw())
}

/// Every sleep tag of `device` (-1: every device in use) as a JSON array.
#[no_mangle]
pub extern "C" fn gpualloc_tags_json(device: c_int) -> *mut c_char {
    call_ptr(|| {
        let mut all = Vec::new();
        for (d, alloc) in state::targets(device)? {
            all.extend(alloc.sleep().tags()?.iter().map(|t| tag_json(d, t)));
        }
        json_string(&serde_json::Value::Array(all))
    })
}

// ---------------------------------------------------------------- pinned host memory

/// The buffers handed out through the C ABI, by address.
static HOST_BUFFERS: Mutex<Option<HashMap<usize, PinnedBuffer>>> = Mutex::new(None);

fn host_buffers() -> MutexGuard<'static, Option<HashMap<usize, PinnedBuffer>>> {
    // A map of owned buffers stays consistent across a panic.
    alloc_cuda::lock::lock_consistent(&HOST_BUFFERS)
}

/// `size` bytes of pinned host memory from the process-wide cached pool;
/// NULL on failure.
#[no_mangle]
pub extern "C" fn gpualloc_host_alloc(size: usize) -> *mut c_void {
    call_ptr(|| {
        if size == 0 {
            return Err(FfiError::invalid("gpualloc_host_alloc of 0 bytes"));
        }
        let _ctx = CtxGuard::save_if_driver_loaded();
        let mut buf = PinnedAllocator::global()?.alloc(size)?;
        let ptr = buf.as_mut_ptr();
        host_buffers()
            .get_or_insert_with(HashMap::new)
            .insert(ptr as usize, buf);
        Ok(ptr.cast::<c_void>())
    })
}

/// Gives back memory from [`gpualloc_host_alloc`]; NULL is a no-op.
#[no_mangle]
pub extern "C" fn gpualloc_host_free(ptr: *mut c_void) -> c_int {
    call_int(|| {
        if ptr.is_null() {
            return Ok(());
        }
        let _ctx = CtxGuard::save_if_driver_loaded();
        let buf = host_buffers()
            .as_mut()
            .and_then(|m| m.remove(&(ptr as usize)));
        match buf {
            Some(b) => {
                drop(b);
                Ok(())
            }
            None => Err(FfiError::invalid(format!(
                "gpualloc_host_free({ptr:p}): not memory from gpualloc_host_alloc (or freed)"
            ))),
        }
    })
}

/// Declares that work queued on `stream` uses the pinned memory at `ptr`:
/// after its free it is reused only once that work is done.
#[no_mangle]
pub extern "C" fn gpualloc_host_record_stream(ptr: *mut c_void, stream: CudaStream) -> c_int {
    call_int(|| {
        let mut guard = host_buffers();
        let Some(buf) = guard.as_mut().and_then(|m| m.get_mut(&(ptr as usize))) else {
            return Err(FfiError::invalid(format!(
                "gpualloc_host_record_stream({ptr:p}): not memory from gpualloc_host_alloc"
            )));
        };
        // SAFETY: the caller promises the stream outlives the buffer's free
        // (documented in the header), as with Tensor.record_stream.
        buf.record_stream(&unsafe { StreamHandle::from_raw(stream.cast()) });
        Ok(())
    })
}

/// Unpins every cached block of the pinned host allocator.
#[no_mangle]
pub extern "C" fn gpualloc_host_empty_cache() -> c_int {
    call_int(|| {
        let _ctx = CtxGuard::save_if_driver_loaded();
        Ok(PinnedAllocator::global()?.empty_cache()?)
    })
}

/// The pinned host allocator's counters and those of memory pinned in place
/// (`gpualloc_host_register`) as one JSON object.
#[no_mangle]
pub extern "C" fn gpualloc_host_stats_json() -> *mut c_char {
    call_ptr(|| {
        let _ctx = CtxGuard::save_if_driver_loaded();
        let pool = PinnedAllocator::global()?.stats()?;
        let registered = crate::host_register::registered_stats();
        let map: serde_json::Map<String, serde_json::Value> = pool
            .named()
            .iter()
            .chain(registered.named().iter())
            .map(|&(k, v)| (k.to_string(), v.into()))
            .collect();
        json_string(&serde_json::Value::Object(map))
    })
}
