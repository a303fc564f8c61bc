//! `gpualloc_advise`: which setting for a workload, from the bytes of its
//! PyTorch memory snapshot (`torch.cuda.memory._dump_snapshot()`), for
//! PyTorch users who have the library but no Rust: `python -m gpu_alloc
//! advise SNAPSHOT.pickle` calls it. The replay and the rule are
//! `alloc_replay::advise`'s (`docs/advise.md`).

use std::ffi::{c_char, c_int, c_void, CString};

use crate::state::FfiError;
use crate::{c_str, call_ptr};

/// The advice on a snapshot as a JSON object; see `include/gpualloc.h`.
///
/// # Safety
/// `data` points to `len` readable bytes; `name` is NULL or a NUL-terminated
/// string.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_advise(
    data: *const c_void,
    len: usize,
    device: c_int,
    name: *const c_char,
) -> *mut c_char {
    // SAFETY: the caller's contract is this function's.
    unsafe { gpualloc_advise_budget(data, len, device, name, 0) }
}

/// [`gpualloc_advise`] for a memory budget of `budget_bytes` (0: the
/// device's memory); see `include/gpualloc.h`.
///
/// # Safety
/// As [`gpualloc_advise`].
#[no_mangle]
pub unsafe extern "C" fn gpualloc_advise_budget(
    data: *const c_void,
    len: usize,
    device: c_int,
    name: *const c_char,
    budget_bytes: u64,
) -> *mut c_char {
    call_ptr(|| {
        if data.is_null() {
            return Err(FfiError::invalid("data is NULL"));
        }
        let name = if name.is_null() {
            "snapshot"
        } else {
            // SAFETY: non-NULL, NUL-terminated per the caller's contract.
            unsafe { c_str(name, "name") }?
        };
        // SAFETY: `data` holds `len` readable bytes per the caller's contract.
        let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) };
        let device = match device {
            -1 => None,
            d => Some(usize::try_from(d).map_err(|_| {
                FfiError::invalid(format!(
                    "device {d}: expected -1 (the first with events) or >= 0"
                ))
            })?),
        };
        let budget = (budget_bytes > 0).then_some(budget_bytes);
        let json = advice_json(name, bytes, device, budget)?;
        CString::new(json)
            .map(CString::into_raw)
            .map_err(|e| FfiError::internal(e.to_string()))
    })
}

#[cfg(feature = "advise")]
fn advice_json(
    name: &str,
    bytes: &[u8],
    device: Option<usize>,
    budget: Option<u64>,
) -> Result<String, FfiError> {
    let trace = alloc_replay::parse_bytes_of(name, bytes, device).map_err(|e| match e {
        // The first line of a file that is no pickle is not a trace line either: a file
        // of some other kind, which the trace format's own words would not explain.
        alloc_replay::TraceError::Parse { line: 1, .. } => FfiError::invalid(format!(
            "{name}: not a PyTorch memory snapshot (pickle) or gpualloc trace"
        )),
        e => named(name, &e),
    })?;
    let mut opts = alloc_replay::ReplayOptions::default();
    opts.timed_runs = 0;
    let advice = alloc_replay::advise_at(&trace, &opts, budget).map_err(|e| named(name, &e))?;
    serde_json::to_string(&advice.to_json()).map_err(|e| FfiError::internal(e.to_string()))
}

/// `e` as an invalid-input error that starts with the trace's name once: the replay's
/// errors name it already.
#[cfg(feature = "advise")]
fn named(name: &str, e: &dyn std::fmt::Display) -> FfiError {
    let text = e.to_string();
    if text.starts_with(&format!("{name}:")) || text.starts_with(&format!("{name} ")) {
        FfiError::invalid(text)
    } else {
        FfiError::invalid(format!("{name}: {text}"))
    }
}

#[cfg(not(feature = "advise"))]
fn advice_json(_: &str, _: &[u8], _: Option<usize>, _: Option<u64>) -> Result<String, FfiError> {
    Err(FfiError::invalid(
        "this library was built without the `advise` feature",
    ))
}
