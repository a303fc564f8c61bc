//! Process-wide state behind the C entry points: the configuration phase,
//! the per-device allocators (a lock-free lookup once created), the
//! thread-local last error, and rate-limited reports on stderr.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, CString};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use alloc_core::AllocError;
use alloc_cuda::{CudaAllocator, CudaError, MAX_DEVICES};

use crate::api;

/// The environment variable read at the first use.
pub const ENV_CONF: &str = "GPUALLOC_CONF";

/// A failure of an entry point: a return code and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FfiError {
    /// One of the negative `GPUALLOC_ERR_*` codes.
    pub code: i32,
    /// What went wrong.
    pub message: String,
}

impl FfiError {
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        FfiError {
            code: api::GPUALLOC_ERR_INVALID,
            message: message.into(),
        }
    }

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        FfiError {
            code: api::GPUALLOC_ERR_INTERNAL,
            message: message.into(),
        }
    }
}

impl From<CudaError> for FfiError {
    fn from(e: CudaError) -> Self {
        let code = match &e {
            CudaError::Alloc(AllocError::OutOfMemory(_)) => api::GPUALLOC_ERR_OUT_OF_MEMORY,
            CudaError::Alloc(AllocError::UnknownPool { .. }) => api::GPUALLOC_ERR_UNKNOWN_POOL,
            CudaError::Alloc(AllocError::Backend(_)) => api::GPUALLOC_ERR_CUDA,
            CudaError::Alloc(_) | CudaError::Config(_) => api::GPUALLOC_ERR_INVALID,
            CudaError::AlreadyInitialized { .. } => api::GPUALLOC_ERR_TOO_LATE,
            CudaError::Poisoned | CudaError::Damaged(_) => api::GPUALLOC_ERR_INTERNAL,
            CudaError::SizeOverflow { .. }
            | CudaError::LengthMismatch { .. }
            | CudaError::HostRangeRegistered { .. }
            | CudaError::HostNotRegistered { .. } => api::GPUALLOC_ERR_INVALID,
            _ => api::GPUALLOC_ERR_CUDA,
        };
        FfiError {
            code,
            message: e.to_string(),
        }
    }
}

pub(crate) type FfiResult<T> = Result<T, FfiError>;

thread_local! {
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
    static LAST_CODE: Cell<i32> = const { Cell::new(0) };
}

/// Records `message` (with its `GPUALLOC_ERR_*` code) as this thread's last
/// error.
pub(crate) fn set_last_error(code: i32, message: &str) {
    // Interior NULs cannot occur in our messages, but never panic on them.
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = Some(c));
    let _ = LAST_CODE.try_with(|slot| slot.set(code));
}

/// Forgets this thread's last error.
pub(crate) fn clear_last_error() {
    let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = None);
    let _ = LAST_CODE.try_with(|slot| slot.set(0));
}

/// The code of this thread's last error (0 if none).
pub(crate) fn last_error_code() -> i32 {
    LAST_CODE.try_with(Cell::get).unwrap_or(0)
}

/// This thread's last error as a C string (NULL if none), valid until the
/// next call that sets or clears it.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|slot| {
            slot.borrow()
                .as_ref()
                .map_or(std::ptr::null(), |c| c.as_ptr())
        })
        .unwrap_or(std::ptr::null())
}

/// Writes `gpualloc: <message>` to stderr, ignoring a stderr that cannot be
/// written (a closed pipe, a full disk): `eprintln!` would panic there, and
/// a report must never abort the host process or undo what it reports.
pub(crate) fn to_stderr(message: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "gpualloc: {message}");
}

/// [`to_stderr`] for the first `LIMIT` reports of a `counter`; says once
/// that further ones are suppressed.
pub(crate) fn report(counter: &AtomicU32, message: &str) {
    const LIMIT: u32 = 8;
    let n = counter.fetch_add(1, Ordering::Relaxed);
    if n < LIMIT {
        to_stderr(message);
    } else if n == LIMIT {
        to_stderr("further messages of this kind are suppressed");
    }
}

/// Reports of failed allocations (PyTorch 2.11's CUDAPluggableAllocator does
/// not check for NULL, so stderr is where the user learns why).
pub(crate) static MALLOC_FAILURES: AtomicU32 = AtomicU32::new(0);
/// Reports of failed frees (no return value to carry them).
pub(crate) static FREE_FAILURES: AtomicU32 = AtomicU32::new(0);

/// The configuration phase, under one lock.
struct ConfigState {
    /// Set by the first use: configuration can no longer change.
    sealed: bool,
    /// The string given to `gpualloc_configure`, if any.
    explicit: Option<String>,
    /// The environment's string, when it was read.
    env: Option<String>,
    /// A bad `GPUALLOC_CONF`: every allocator creation fails with it.
    env_error: Option<String>,
    /// Settings changed since (`gpualloc_update_settings`), in order.
    updates: Vec<String>,
}

static CONFIG: Mutex<ConfigState> = Mutex::new(ConfigState {
    sealed: false,
    explicit: None,
    env: None,
    env_error: None,
    updates: Vec::new(),
});

fn config_state() -> MutexGuard<'static, ConfigState> {
    // The state stays consistent across a panic (plain field writes).
    alloc_cuda::lock::lock_consistent(&CONFIG)
}

/// The configuration string in effect (explicit, else the environment's,
/// then the settings changed since), for snapshots' `allocator_settings`.
pub(crate) fn config_text() -> String {
    let s = config_state();
    let env = || match s.sealed {
        true => s.env.clone(),
        // Not read yet: what the first use will read.
        false => std::env::var(ENV_CONF).ok(),
    };
    let base = s.explicit.clone().or_else(env);
    base.into_iter()
        .chain(s.updates.iter().cloned())
        .filter(|t| !t.trim().is_empty())
        .collect::<Vec<_>>()
        .join(",")
}

/// `gpualloc_update_settings`: seals the configuration (a change is made
/// to the configuration in effect, `GPUALLOC_CONF` included) and applies
/// the settings to every allocator and to those made later.
pub(crate) fn update_settings(text: &str) -> FfiResult<()> {
    let mut s = config_state();
    seal(&mut s);
    if let Some(msg) = &s.env_error {
        return Err(FfiError::invalid(msg.clone()));
    }
    if crate::layout::decided_on() {
        return Err(FfiError::invalid(crate::layout::REFUSED));
    }
    let _ctx = CtxGuard::save_if_driver_loaded();
    CudaAllocator::update_global_settings(text)?;
    s.updates.push(text.to_string());
    Ok(())
}

/// `gpualloc_configure`.
pub(crate) fn configure(text: &str) -> FfiResult<()> {
    let mut s = config_state();
    if s.sealed {
        return Err(FfiError {
            code: api::GPUALLOC_ERR_TOO_LATE,
            message: "gpualloc_configure must be called before the first use of the allocator \
                      (its first allocation, or any call that creates a device's allocator); \
                      the configuration in effect cannot change any more"
                .into(),
        });
    }
    CudaAllocator::configure_global(text)?;
    s.explicit = Some(text.to_string());
    Ok(())
}

/// `gpualloc_check_config`: parses and builds the policy, no CUDA call.
pub(crate) fn check_config(text: &str) -> FfiResult<()> {
    let cfg =
        alloc_core::AllocatorConfig::parse(text).map_err(|e| FfiError::invalid(e.to_string()))?;
    alloc_policy::AnyPolicy::from_config(&cfg).map_err(|e| FfiError::invalid(e.to_string()))?;
    Ok(())
}

/// Seals the configuration now, as the first use would; fails as every
/// allocation then will when `GPUALLOC_CONF` is bad.
pub(crate) fn seal_now() -> FfiResult<()> {
    let mut s = config_state();
    seal(&mut s);
    match &s.env_error {
        Some(msg) => Err(FfiError::invalid(msg.clone())),
        None => Ok(()),
    }
}

/// Seals the configuration, applying `GPUALLOC_CONF` unless
/// `gpualloc_configure` was called; a bad variable is reported once. The
/// devices' engine layout is decided here.
fn seal(s: &mut ConfigState) {
    if s.sealed {
        return;
    }
    s.sealed = true;
    read_configuration(s);
    crate::layout::decide(
        s.env_error.is_none() && CudaAllocator::global_config().engine_per_stream,
    );
}

/// Applies `GPUALLOC_CONF` unless `gpualloc_configure` was called.
fn read_configuration(s: &mut ConfigState) {
    if s.explicit.is_some() {
        return;
    }
    let Ok(text) = std::env::var(ENV_CONF) else {
        if std::env::var_os(ENV_CONF).is_some() {
            let msg = format!("{ENV_CONF} is not valid UTF-8; every allocation will fail");
            s.env_error = Some(msg.clone());
            to_stderr(&msg);
        }
        return;
    };
    s.env = Some(text.clone());
    if text.trim().is_empty() {
        return;
    }
    if let Err(e) = CudaAllocator::configure_global(&text) {
        let msg = format!(
            "invalid {ENV_CONF}=\"{}\": {e}",
            alloc_core::config::excerpt(&text)
        );
        s.env_error = Some(msg.clone());
        to_stderr(&format!(
            "{msg}; every allocation will fail until the process restarts"
        ));
    }
}

/// The allocator of every device, once created.
static ALLOCATORS: [OnceLock<CudaAllocator>; MAX_DEVICES] =
    [const { OnceLock::new() }; MAX_DEVICES];

/// Checks a device index.
pub(crate) fn slot(device: i32) -> FfiResult<usize> {
    match usize::try_from(device) {
        Ok(d) if d < MAX_DEVICES => Ok(d),
        _ => Err(FfiError::invalid(format!(
            "invalid device index {device} (expected 0..{MAX_DEVICES})"
        ))),
    }
}

/// The allocator of `device` if it was created (no side effect).
#[inline]
pub(crate) fn existing(device: i32) -> FfiResult<Option<&'static CudaAllocator>> {
    Ok(ALLOCATORS[slot(device)?].get())
}

/// The allocator of `device`, created on first use (which seals the
/// configuration).
#[inline]
pub(crate) fn allocator(device: i32) -> FfiResult<&'static CudaAllocator> {
    let d = slot(device)?;
    match ALLOCATORS[d].get() {
        Some(a) => Ok(a),
        None => create(d),
    }
}

#[cold]
fn create(d: usize) -> FfiResult<&'static CudaAllocator> {
    let mut s = config_state();
    seal(&mut s);
    if let Some(msg) = &s.env_error {
        return Err(FfiError::invalid(msg.clone()));
    }
    if let Some(a) = ALLOCATORS[d].get() {
        return Ok(a);
    }
    if crate::layout::decided_on() {
        return Err(FfiError::invalid(crate::layout::REFUSED));
    }
    // Creating the allocator retains the device's primary context and may make
    // it current on this thread: restore the caller's context afterwards.
    let _ctx = CtxGuard::save_if_driver_loaded();
    crate::call_times::global().read_env();
    let a = CudaAllocator::global(d)?;
    crate::segments::observe(&a);
    Ok(ALLOCATORS[d].get_or_init(|| a))
}

/// Every device whose allocator exists, in index order.
pub(crate) fn existing_all() -> impl Iterator<Item = (usize, &'static CudaAllocator)> {
    made(&ALLOCATORS)
}

/// The devices an operation applies to: `-1` = every existing allocator.
pub(crate) fn targets(device: i32) -> FfiResult<Vec<(usize, &'static CudaAllocator)>> {
    targets_in(&ALLOCATORS, device)
}

/// The devices of `slots` whose value is made, in index order.
pub(crate) fn made<T>(
    slots: &'static [OnceLock<T>; MAX_DEVICES],
) -> impl Iterator<Item = (usize, &'static T)> {
    slots
        .iter()
        .enumerate()
        .filter_map(|(i, s)| s.get().map(|a| (i, a)))
}

/// The made values of `slots` an operation on `device` applies to: `-1`
/// = every one.
pub(crate) fn targets_in<T>(
    slots: &'static [OnceLock<T>; MAX_DEVICES],
    device: i32,
) -> FfiResult<Vec<(usize, &'static T)>> {
    if device == -1 {
        return Ok(made(slots).collect());
    }
    let d = slot(device)?;
    Ok(slots[d].get().map(|a| (d, a)).into_iter().collect())
}

/// Restores the calling thread's current CUDA context on drop: our driver
/// calls bind the device's primary context, which would otherwise change
/// the CUDA runtime's current device under PyTorch.
pub(crate) struct CtxGuard(Option<usize>);

impl CtxGuard {
    /// Saves the current context when the driver library is loaded (never
    /// loads it: without a driver there is nothing to restore).
    pub(crate) fn save_if_driver_loaded() -> Self {
        CtxGuard(Self::current_if_initialised())
    }

    fn current() -> Option<usize> {
        use alloc_cuda::cudarc::driver::result;
        match result::ctx::get_current() {
            Ok(c) => Some(c.map_or(0, |c| c as usize)),
            Err(_) => None,
        }
    }

    fn current_if_initialised() -> Option<usize> {
        use alloc_cuda::cudarc::driver::result;
        if !alloc_cuda::driver_available() {
            return None;
        }
        // cuInit is idempotent and cheap after the first time; before it,
        // cuCtxGetCurrent would fail with CUDA_ERROR_NOT_INITIALIZED.
        if result::init().is_err() {
            return None;
        }
        Self::current()
    }
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        use alloc_cuda::cudarc::driver::{result, sys};
        let Some(saved) = self.0 else { return };
        if Self::current() != Some(saved) {
            // SAFETY: `saved` was the thread's current context (or none) when
            // the guard was made; contexts of this process outlive the call.
            let _ = unsafe { result::ctx::set_current(saved as sys::CUcontext) };
        }
    }
}
