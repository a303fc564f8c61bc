//! The options the parser knows: ours, and every option of PyTorch's
//! allocator configuration (`c10/core/AllocatorConfig.h` and
//! `c10/cuda/CUDAAllocatorConfig.h` of PyTorch's main branch, which hold 2.11's), each
//! with what this allocator does with it.

/// What the allocator does with one of PyTorch's options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Treatment {
    /// Applied to device memory as PyTorch applies it.
    Honoured,
    /// A setting of PyTorch's pinned host allocator, which stays PyTorch's
    /// and reads it from `PYTORCH_CUDA_ALLOC_CONF` itself: checked as
    /// PyTorch checks it, then left to PyTorch.
    PyTorchHost,
    /// Checked and accepted, with no effect here, for the reason given.
    NoEffect(&'static str),
    /// The value given is refused, for the reason given (other values may
    /// be accepted: `backend:native`, `throw_on_cudamalloc_oom:False`).
    Refused(&'static str),
}

/// Why `release_lock_on_cudamalloc` changes nothing.
pub const RELEASE_LOCK_REASON: &str =
    "each device has its own allocator lock, so a driver call blocks only its own device";
/// Why `backend:cudaMallocAsync` is refused.
pub const BACKEND_REASON: &str = "this allocator is itself the backend; only `native` is accepted";
/// Why `throw_on_cudamalloc_oom:True` is refused.
pub const THROW_ON_OOM_REASON: &str = "not supported: a request the device cannot hold \
     already fails with an out-of-memory error once the cache is emptied";

/// One of PyTorch's options: its name, a value PyTorch accepts, and what
/// this allocator does with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PyTorchKey {
    /// The option.
    pub key: &'static str,
    /// A value that PyTorch accepts for it.
    pub example: &'static str,
    /// What this allocator does with that value.
    pub treatment: Treatment,
}

const fn key(key: &'static str, example: &'static str, treatment: Treatment) -> PyTorchKey {
    PyTorchKey {
        key,
        example,
        treatment,
    }
}

/// Every option of PyTorch's allocator configuration (its device and host
/// allocators, the ROCm spellings included).
pub const PYTORCH_KEYS: &[PyTorchKey] = &[
    key("max_split_size_mb", "64", Treatment::Honoured),
    key("max_non_split_rounding_mb", "64", Treatment::Honoured),
    key("garbage_collection_threshold", "0.6", Treatment::Honoured),
    key(
        "roundup_power2_divisions",
        "[256:1,>:4]",
        Treatment::Honoured,
    ),
    key("expandable_segments", "True", Treatment::Honoured),
    key(
        "graph_capture_record_stream_reuse",
        "True",
        Treatment::Honoured,
    ),
    key("per_process_memory_fraction", "0.5", Treatment::Honoured),
    key(
        "backend",
        "cudaMallocAsync",
        Treatment::Refused(BACKEND_REASON),
    ),
    key(
        "release_lock_on_cudamalloc",
        "True",
        Treatment::NoEffect(RELEASE_LOCK_REASON),
    ),
    key(
        "release_lock_on_hipmalloc",
        "True",
        Treatment::NoEffect(RELEASE_LOCK_REASON),
    ),
    key(
        "throw_on_cudamalloc_oom",
        "True",
        Treatment::Refused(THROW_ON_OOM_REASON),
    ),
    key(
        "pinned_use_background_threads",
        "True",
        Treatment::PyTorchHost,
    ),
    key(
        "pinned_use_cuda_host_register",
        "True",
        Treatment::PyTorchHost,
    ),
    key(
        "pinned_use_hip_host_register",
        "True",
        Treatment::PyTorchHost,
    ),
    key("pinned_num_register_threads", "8", Treatment::PyTorchHost),
    key(
        "pinned_reserve_segment_size_mb",
        "64",
        Treatment::PyTorchHost,
    ),
    key("pinned_free_catch_all", "True", Treatment::PyTorchHost),
];

/// The options of this allocator that PyTorch does not have.
pub const OUR_KEYS: &[&str] = &[
    "policy",
    "stream_wait_reuse",
    "unmap_free_pages",
    "unmap_page_mb",
    "unmap_worker",
    "idle_mark_mb",
    "lend_idle_blocks",
    "plan_layout",
    "first_fit_mb",
    "idle_slab_limit_mb",
    "memory_budget_mb",
    "memory_budget_fraction",
    "memory_budget_over_allocated",
    "engine_per_stream",
    "engine_per_thread",
];

/// PyTorch's limit on `pinned_num_register_threads`.
pub const MAX_REGISTER_THREADS: u64 = 128;

/// Every option name, ours first.
pub fn all_keys() -> impl Iterator<Item = &'static str> {
    OUR_KEYS
        .iter()
        .copied()
        .chain(PYTORCH_KEYS.iter().map(|k| k.key))
}

/// Every option name, comma separated, for error messages.
pub fn known_keys() -> String {
    all_keys().collect::<Vec<_>>().join(", ")
}
