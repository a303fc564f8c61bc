//! The C API as one table: the header `include/gpualloc.h` is generated from
//! it ([`header_text`]), and the tests check that the header file (and its
//! copy in the Python package, which the package's ctypes declarations and
//! C++ bridge are read from) equals the generated text and that every
//! `extern "C"` function of this crate has the C signature the table gives
//! (see `tests/header.rs`). The structs of the interface are declared once,
//! with `c_struct!`, which makes both the Rust type and its C text. The
//! interface's constants and structs are defined here and the modules that
//! implement the functions use them, so this module uses no other module.

use std::ffi::c_int;

/// One exported function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiFn {
    /// C return type.
    pub ret: &'static str,
    /// Symbol name.
    pub name: &'static str,
    /// Parameters as `(C type, name)`.
    pub params: &'static [(&'static str, &'static str)],
    /// Comment placed above the declaration (lines joined with `\n`).
    pub doc: &'static str,
}

/// A field of a C struct of the interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CField {
    /// C type, with the array length if any (`GpuallocStat[3]`).
    pub c_type: &'static str,
    /// Field name.
    pub name: &'static str,
    /// Comment placed after the field.
    pub doc: &'static str,
    /// Byte offset in the Rust (`repr(C)`) struct, for the layout tests.
    pub offset: usize,
}

/// A C struct of the interface, as `c_struct!` describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CStruct {
    /// Type name, the same in C and Rust.
    pub name: &'static str,
    /// Comment placed above the definition (lines joined with `\n`).
    pub doc: &'static str,
    /// The fields, in order.
    pub fields: &'static [CField],
    /// `size_of` the Rust struct, for the layout tests.
    pub size: usize,
}

/// Defines a `#[repr(C)]` struct of the interface and its C declaration
/// (an associated `C: CStruct`), so that the two cannot differ: each field
/// is written `pub name: RustType = "C type",`.
macro_rules! c_struct {
    (
        $(#[doc = $doc:literal])*
        pub struct $name:ident {
            $( $(#[doc = $fdoc:literal])* pub $field:ident : $ty:ty = $cty:literal, )*
        }
    ) => {
        $(#[doc = $doc])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct $name {
            $( $(#[doc = $fdoc])* pub $field: $ty, )*
        }

        impl $name {
            /// The C declaration of this struct (include/gpualloc.h).
            pub const C: $crate::api::CStruct = $crate::api::CStruct {
                name: stringify!($name),
                doc: concat!($($doc, "\n"),*),
                fields: &[$(
                    $crate::api::CField {
                        c_type: $cty,
                        name: stringify!($field),
                        doc: concat!($($fdoc, "\n"),*),
                        offset: ::std::mem::offset_of!($name, $field),
                    },
                )*],
                size: ::std::mem::size_of::<$name>(),
            };
        }
    };
}
c_struct! {
    /// One statistic as torch.cuda.memory_stats() keeps it.
    pub struct GpuallocStat {
        /// Present value.
        pub current: i64 = "int64_t",
        /// Highest value since creation or the last reset of peaks.
        pub peak: i64 = "int64_t",
        /// Sum of all increases since the last reset of accumulated counters.
        pub allocated: i64 = "int64_t",
        /// Sum of all decreases since the last reset of accumulated counters.
        pub freed: i64 = "int64_t",
    }
}

c_struct! {
    /// The statistics of a device, with PyTorch's names (DeviceStats). Arrays of three
    /// are indexed [all pools, small pool, large pool]. Set `size` to
    /// sizeof(GpuallocDeviceStats) before the call.
    pub struct GpuallocDeviceStats {
        /// In: the size of the struct the caller has. Out: the bytes the library filled
        /// (fields are only ever appended; those past it are left untouched).
        pub size: usize = "size_t",
        /// Blocks handed out to callers.
        pub allocation: [GpuallocStat; 3] = "GpuallocStat[3]",
        /// Device allocations (segments) held.
        pub segment: [GpuallocStat; 3] = "GpuallocStat[3]",
        /// Blocks in use or waiting for stream events.
        pub active: [GpuallocStat; 3] = "GpuallocStat[3]",
        /// Free blocks inside split segments.
        pub inactive_split: [GpuallocStat; 3] = "GpuallocStat[3]",
        /// Bytes of blocks handed out (after rounding).
        pub allocated_bytes: [GpuallocStat; 3] = "GpuallocStat[3]",
        /// Bytes reserved from the device.
        pub reserved_bytes: [GpuallocStat; 3] = "GpuallocStat[3]",
        /// Bytes of active blocks.
        pub active_bytes: [GpuallocStat; 3] = "GpuallocStat[3]",
        /// Bytes of free blocks inside split segments.
        pub inactive_split_bytes: [GpuallocStat; 3] = "GpuallocStat[3]",
        /// Bytes callers asked for (before rounding), over active blocks.
        pub requested_bytes: [GpuallocStat; 3] = "GpuallocStat[3]",
        /// Allocations at or above max_split_size.
        pub oversize_allocations: GpuallocStat = "GpuallocStat",
        /// Segments at or above max_split_size.
        pub oversize_segments: GpuallocStat = "GpuallocStat",
        /// Device allocations retried after freeing the cache.
        pub num_alloc_retries: i64 = "int64_t",
        /// Allocations that failed with out of memory.
        pub num_ooms: i64 = "int64_t",
        /// Times every pending stream event was waited for.
        pub num_sync_all_streams: i64 = "int64_t",
        /// Device allocation calls.
        pub num_device_alloc: i64 = "int64_t",
        /// Device free calls.
        pub num_device_free: i64 = "int64_t",
        /// max_split_size in bytes; -1 when unlimited.
        pub max_split_size: i64 = "int64_t",
    }
}

/// The structs of the interface, in header order (a struct before those
/// that contain it).
pub const STRUCTS: &[CStruct] = &[GpuallocStat::C, GpuallocDeviceStats::C];

/// Success.
pub const GPUALLOC_OK: i32 = 0;
/// A bad argument: unknown or already freed pointer, bad size, device,
/// fraction, path or configuration string.
pub const GPUALLOC_ERR_INVALID: i32 = -1;
/// Out of memory, after the cache was freed and the allocation retried.
pub const GPUALLOC_ERR_OUT_OF_MEMORY: i32 = -2;
/// The CUDA driver failed, is missing, or the device does not exist.
pub const GPUALLOC_ERR_CUDA: i32 = -3;
/// `gpualloc_configure` after the first use of the allocator.
pub const GPUALLOC_ERR_TOO_LATE: i32 = -4;
/// An internal error (a caught panic, state a panic damaged): a bug, please
/// report. The call that panicked fails; later calls work (see
/// `alloc_cuda::lock`).
pub const GPUALLOC_ERR_INTERNAL: i32 = -5;
/// A private pool that does not exist: never created (`gpualloc_retain_pool`,
/// `gpualloc_begin_allocate_to_pool`), or released by its last holder.
pub const GPUALLOC_ERR_UNKNOWN_POOL: i32 = -6;

/// The return codes, as `(name, value, meaning)`.
pub const CODES: &[(&str, i32, &str)] = &[
    ("GPUALLOC_OK", GPUALLOC_OK, "success"),
    (
        "GPUALLOC_ERR_INVALID",
        GPUALLOC_ERR_INVALID,
        "bad argument: pointer, size, device, fraction, path or configuration",
    ),
    (
        "GPUALLOC_ERR_OUT_OF_MEMORY",
        GPUALLOC_ERR_OUT_OF_MEMORY,
        "out of memory after freeing the cache and retrying",
    ),
    (
        "GPUALLOC_ERR_CUDA",
        GPUALLOC_ERR_CUDA,
        "CUDA driver failure, no driver, or no such device",
    ),
    (
        "GPUALLOC_ERR_TOO_LATE",
        GPUALLOC_ERR_TOO_LATE,
        "gpualloc_configure after the allocator was first used",
    ),
    (
        "GPUALLOC_ERR_INTERNAL",
        GPUALLOC_ERR_INTERNAL,
        "internal error (caught panic): a bug; later calls work",
    ),
    (
        "GPUALLOC_ERR_UNKNOWN_POOL",
        GPUALLOC_ERR_UNKNOWN_POOL,
        "private pool never created (retain / begin_allocate_to_pool) or released",
    ),
];

/// Every exported function, in header order.
pub const API: &[ApiFn] = &[
    ApiFn {
        ret: "void*",
        name: "gpualloc_malloc",
        params: &[
            ("ssize_t", "size"),
            ("int", "device"),
            ("cudaStream_t", "stream"),
        ],
        doc: "Allocates `size` bytes on `device` for use on `stream` (the allocation function\n\
              of torch.cuda.memory.CUDAPluggableAllocator). Returns NULL on failure with the\n\
              message in gpualloc_last_error(); size 0 returns NULL with no error (the block\n\
              would have no address; PyTorch never frees a NULL data pointer). The first call\n\
              on a device creates its allocator, with GPUALLOC_CONF read once per process.\n\
              `stream` (NULL: the legacy default stream) must be a stream of `device` that\n\
              lives as long as the allocator holds blocks allocated on it, cached ones included\n\
              (until gpualloc_empty_cache); PyTorch's streams always do.",
    },
    ApiFn {
        ret: "void",
        name: "gpualloc_free",
        params: &[
            ("void*", "ptr"),
            ("ssize_t", "size"),
            ("int", "device"),
            ("cudaStream_t", "stream"),
        ],
        doc: "Frees a block from gpualloc_malloc (the free function of CUDAPluggableAllocator).\n\
              `size` and `stream` are ignored: the allocator knows both. NULL is a no-op. A\n\
              pointer it did not hand out is reported (gpualloc_last_error, and stderr for the\n\
              first few) and otherwise ignored, never undefined behaviour.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_configure",
        params: &[("const char*", "config")],
        doc: "Sets the configuration (PYTORCH_CUDA_ALLOC_CONF syntax, e.g.\n\
              \"policy:pytorch-bfc,max_split_size_mb:128,expandable_segments:True\", or a\n\
              setting's name, alone or followed by options: \"bound,max_split_size_mb:64\"), replacing\n\
              GPUALLOC_CONF. Must be called before the first use of the allocator: then it\n\
              returns GPUALLOC_ERR_TOO_LATE. A bad string returns GPUALLOC_ERR_INVALID (-1).",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_check_config",
        params: &[("const char*", "config")],
        doc: "Parses and validates a configuration string or setting name without applying it\n\
              (no CUDA call).",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_update_settings",
        params: &[("const char*", "settings")],
        doc: "Changes the settings that `settings` names (configuration syntax) while the\n\
              allocator runs, on every device and for devices used later, as PyTorch's\n\
              _set_allocator_settings: roundup_power2_divisions, max_split_size_mb,\n\
              max_non_split_rounding_mb, garbage_collection_threshold, expandable_segments,\n\
              stream_wait_reuse, graph_capture_record_stream_reuse, per_process_memory_fraction\n\
              apply from the next allocation. GPUALLOC_ERR_INVALID for a malformed string or\n\
              an option fixed at creation (policy, unmap_free_pages, unmap_page_mb,\n\
              idle_slab_limit_mb once slabs exist). Seals the configuration.",
    },
    ApiFn {
        ret: "char*",
        name: "gpualloc_settings_text",
        params: &[],
        doc: "The configuration in effect: gpualloc_configure's string, else GPUALLOC_CONF's,\n\
              then every string gpualloc_update_settings accepted since, comma-joined (what\n\
              snapshots report as allocator_settings). Free it with gpualloc_string_free.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_empty_cache",
        params: &[("int", "device")],
        doc: "Waits for pending cross-stream events, then returns every unused cached segment\n\
              to the driver. device -1: every device in use.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_set_memory_fraction",
        params: &[("double", "fraction"), ("int", "device")],
        doc: "Limits the memory reserved on `device` to `fraction` [0, 1] of its capacity (0: nothing more).",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_record_stream",
        params: &[
            ("void*", "ptr"),
            ("int", "device"),
            ("cudaStream_t", "stream"),
        ],
        doc: "Marks the block at `ptr` (the address gpualloc_malloc returned) as used by\n\
              `stream` too: its free then defers reuse until that stream's work queued before\n\
              the free is done (Tensor.record_stream). `stream` must outlive the block's free.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_reset_peak_stats",
        params: &[("int", "device")],
        doc: "Makes every peak statistic equal to its current value. device -1: every device.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_reset_accumulated_stats",
        params: &[("int", "device")],
        doc: "Clears the cumulative counters (allocated / freed totals, event counts, call times).",
    },
    ApiFn {
        ret: "char*",
        name: "gpualloc_memory_stats_json",
        params: &[("int", "device")],
        doc: "Statistics of `device` as a JSON object with torch.cuda.memory_stats()'s flat key\n\
              names (\"allocated_bytes.all.current\", \"reserved_bytes.all.peak\", ...), plus\n\
              \"max_split_size\" and our \"page_moves.*\" counters (what unmap_free_pages\n\
              moved: rounds, pages_unmapped, busy_pages_reused, pages_mapped, stream_waits, host_ns,
              blocks_lent)\n\
              and \"stream_ops.*\" counters (what stream ordering asked of the driver: recorded,\n\
              queried, host_waits, host_wait_ns, stream_waits), all zero for a device never used.\n\
              With GPUALLOC_TIME_CALLS=1 also \"host_calls.*\": the library's own malloc and free\n\
              calls naming the device (malloc, malloc_ns, malloc_slow (100 us or more),\n\
              malloc_max_ns, and the same for free). Free the string with gpualloc_string_free. NULL on error.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_device_stats",
        params: &[("int", "device"), ("GpuallocDeviceStats*", "out")],
        doc: "Statistics of `device` in *out (all zero, max_split_size -1, for a device never\n\
              used): the numbers of gpualloc_memory_stats_json without the JSON. Set out->size\n\
              to sizeof(GpuallocDeviceStats) first; the library fills the fields that fit in\n\
              it and sets out->size to the bytes filled, so callers built against an older or\n\
              newer header work. GPUALLOC_ERR_INVALID for a NULL out, out->size too small\n\
              for its first field, or a bad device index.",
    },
    ApiFn {
        ret: "char*",
        name: "gpualloc_advise",
        params: &[
            ("const void*", "data"),
            ("size_t", "len"),
            ("int", "device"),
            ("const char*", "name"),
        ],
        doc: "Which setting for a workload: replays the PyTorch memory snapshot in `data` (the\n\
              `len` bytes of a torch.cuda.memory._dump_snapshot() pickle, or a trace file)\n\
              under PyTorch's default and expandable segments and our settings on a\n\
              simulated device (no GPU needed) and returns the advice as a JSON object: the\n\
              \"outcomes\" per setting, the \"recommended_setting\", its \"enable_call\",\n\
              \"gpualloc_conf\", \"cost\" in page moves per step, and the printable \"text\"\n\
              (rule: docs/advise.md). device -1: the first device with events. `name` (or\n\
              NULL) titles the report. Free with gpualloc_string_free. NULL on error (a\n\
              corrupt or foreign file, no events, a library built without `advise`).",
    },
    ApiFn {
        ret: "char*",
        name: "gpualloc_advise_budget",
        params: &[
            ("const void*", "data"),
            ("size_t", "len"),
            ("int", "device"),
            ("const char*", "name"),
            ("uint64_t", "budget_bytes"),
        ],
        doc: "gpualloc_advise for a workload with a memory budget of `budget_bytes` (0: the\n\
              device's memory): the \"budget\" setting is replayed reclaiming at it, and no\n\
              setting whose peak reserved passes it is recommended while one stays under it\n\
              (docs/advise.md). The same JSON, with \"budget_bytes\"; the same errors.",
    },
    ApiFn {
        ret: "void",
        name: "gpualloc_string_free",
        params: &[("char*", "s")],
        doc: "Frees a string returned by this library. NULL is a no-op.",
    },
    ApiFn {
        ret: "void*",
        name: "gpualloc_malloc_in_pool",
        params: &[
            ("ssize_t", "size"),
            ("int", "device"),
            ("cudaStream_t", "stream"),
            ("uint64_t", "pool_first"),
            ("uint64_t", "pool_second"),
        ],
        doc: "gpualloc_malloc from the private pool (pool_first, pool_second) (PyTorch's\n\
              MempoolId_t), or from the ordinary cache when both are 0. The pool must exist\n\
              (gpualloc_retain_pool or gpualloc_begin_allocate_to_pool, not yet released by\n\
              its last holder): else GPUALLOC_ERR_UNKNOWN_POOL. For callers that check the\n\
              result (the C++ bridge raises OutOfMemoryError): NULL on failure with the\n\
              message in gpualloc_last_error(), nothing printed.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_begin_allocate_to_pool",
        params: &[
            ("int", "device"),
            ("uint64_t", "pool_first"),
            ("uint64_t", "pool_second"),
        ],
        doc: "A CUDA graph capture (or MemPool context) into the pool begins: holds the pool\n\
              (created on first use) and, until the matching end, queries and records no event\n\
              and returns no memory to the driver (both would break a capture). Allocations\n\
              reach the pool through gpualloc_malloc_in_pool.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_end_allocate_to_pool",
        params: &[
            ("int", "device"),
            ("uint64_t", "pool_first"),
            ("uint64_t", "pool_second"),
        ],
        doc: "Ends what gpualloc_begin_allocate_to_pool began (the pool stays held).",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_retain_pool",
        params: &[
            ("int", "device"),
            ("uint64_t", "pool_first"),
            ("uint64_t", "pool_second"),
        ],
        doc: "One more holder of the pool (PyTorch's createOrIncrefPool).",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_release_pool",
        params: &[
            ("int", "device"),
            ("uint64_t", "pool_first"),
            ("uint64_t", "pool_second"),
        ],
        doc: "One holder fewer (a graph was deleted). With none left the pool's idle segments\n\
              go back to the driver; its other blocks become ordinary cache once freed, and the\n\
              pool is gone: naming it again is GPUALLOC_ERR_UNKNOWN_POOL until it is created\n\
              anew. Its bookkeeping goes with its last segment.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_set_pool_allocator",
        params: &[
            ("int", "device"),
            ("uint64_t", "first"),
            ("uint64_t", "second"),
            ("gpualloc_pool_alloc_fn", "alloc"),
            ("gpualloc_pool_free_fn", "free"),
            ("void*", "ctx"),
        ],
        doc: "Makes a held private pool with no segment yet take its segments from `alloc` and\n\
              give them back through `free` (MemPool(allocator)): they are cached and split as\n\
              the library's own, and never grow. Both are called with the device's allocator\n\
              lock held (they must not call into this library, nor throw) and with `ctx`; alloc\n\
              returns NULL when out of memory.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_empty_pool_cache",
        params: &[
            ("int", "device"),
            ("uint64_t", "pool_first"),
            ("uint64_t", "pool_second"),
        ],
        doc: "Waits for pending cross-stream events, then returns the idle segments of this\n\
              private pool, and only those, to the driver (PyTorch's emptyCache(mempool_id),\n\
              called as a MemPool is destroyed). A pool still held keeps them. device -1:\n\
              every device in use.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_set_pool_no_split",
        params: &[
            ("int", "device"),
            ("uint64_t", "first"),
            ("uint64_t", "second"),
        ],
        doc: "Makes a private pool hand out whole blocks, never split (MemPool(no_split=True)):\n\
              each allocation takes a whole cached block or a new segment. Refused with\n\
              expandable segments and with policy:size-class.",
    },
    ApiFn {
        ret: "void*",
        name: "gpualloc_checkpoint_pool",
        params: &[
            ("int", "device"),
            ("uint64_t", "pool_first"),
            ("uint64_t", "pool_second"),
        ],
        doc: "Saves the layout of a private pool (CUDA graph trees: getCheckpointState). Every block\n\
              of the pool must be done with other streams' events. Free the handle with\n\
              gpualloc_pool_checkpoint_free. NULL on error.",
    },
    ApiFn {
        ret: "void",
        name: "gpualloc_pool_checkpoint_free",
        params: &[("void*", "checkpoint")],
        doc: "Frees a checkpoint from gpualloc_checkpoint_pool. NULL is a no-op.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_restore_pool",
        params: &[
            ("int", "device"),
            ("void*", "checkpoint"),
            ("uint64_t**", "freed"),
            ("size_t*", "n_freed"),
            ("uint64_t**", "allocated"),
            ("size_t*", "n_allocated"),
        ],
        doc: "Puts the checkpoint's pool back into its layout (setCheckpointPoolState): frees every\n\
              block allocated in the pool now and allocates the checkpoint's live blocks again at\n\
              their addresses; the caller owns those. Writes both address lists as arrays freed\n\
              with gpualloc_u64_array_free. Fails before changing anything when a block of the pool\n\
              is used by another stream, or the policy cannot rebuild layouts (size-class).",
    },
    ApiFn {
        ret: "void",
        name: "gpualloc_u64_array_free",
        params: &[("uint64_t*", "values"), ("size_t", "len")],
        doc: "Frees an array written by gpualloc_restore_pool. NULL is a no-op.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_pool_live_allocations_are",
        params: &[
            ("int", "device"),
            ("uint64_t", "pool_first"),
            ("uint64_t", "pool_second"),
            ("const uint64_t*", "expected"),
            ("size_t", "n"),
        ],
        doc: "Whether the blocks allocated in the pool are exactly the n addresses of expected\n\
              (checkPoolLiveAllocations): 1 yes, 0 no, negative on error.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_pool_use_count",
        params: &[
            ("int", "device"),
            ("uint64_t", "pool_first"),
            ("uint64_t", "pool_second"),
        ],
        doc: "Holders of the pool (0 when unknown or released); negative on error.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_tag_pool",
        params: &[
            ("int", "device"),
            ("const char*", "tag"),
            ("uint64_t*", "pool_first"),
            ("uint64_t*", "pool_second"),
        ],
        doc: "Sleep tags: writes the private pool of the tag `tag` on `device`, created on first\n\
              use (growable segments on the driver's virtual-memory API, whatever\n\
              expandable_segments says; cached and served by the configured policy). Allocate in\n\
              it with gpualloc_malloc_in_pool, or route a thread's allocations to it with\n\
              gpualloc_begin_allocate_to_pool / _end_ (as a CUDA graph capture does). Needs a\n\
              policy that grows segments (not buddy) and a device with virtual memory.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_bind_tag",
        params: &[
            ("int", "device"),
            ("const char*", "tag"),
            ("uint64_t", "pool_first"),
            ("uint64_t", "pool_second"),
        ],
        doc: "Makes the private pool (pool_first, pool_second) - a PyTorch MemPool with no segment\n\
              yet - the pool of the new sleep tag `tag` (gpu_alloc.region() does this). Binding the\n\
              same pair again is a no-op; another pool for the tag, or a pool with segments, is\n\
              GPUALLOC_ERR_INVALID.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_pause",
        params: &[
            ("int", "device"),
            ("const char*", "tag"),
            ("const char*", "backup"),
        ],
        doc: "Pauses the sleep tag `tag` (NULL: every tag not paused) on `device` (-1: on every device\n\
              in use that has it): waits for the work of the streams that used its blocks through events on them\n\
              (never a device-wide synchronize), with backup \"host\" copies its live blocks to\n\
              pinned host memory (backup NULL or \"none\": contents are lost), then unmaps and\n\
              releases every page of its segments, keeping their addresses. Until gpualloc_resume,\n\
              allocating from the tag fails (GPUALLOC_ERR_INVALID, \"is paused\"); freeing its\n\
              blocks is fine. Pausing a paused or unknown tag, or during a capture, fails.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_resume",
        params: &[("int", "device"), ("const char*", "tag")],
        doc: "Resumes the paused sleep tag `tag` (NULL: every paused tag) on `device` (-1: on every\n\
              device in use that has it): maps fresh memory at the same addresses (freeing this allocator's\n\
              other idle cache first if the device is full) and copies host backups back before\n\
              returning. GPUALLOC_ERR_OUT_OF_MEMORY leaves the tag paused. Resuming a tag that is\n\
              not paused, or an unknown one, is GPUALLOC_ERR_INVALID.",
    },
    ApiFn {
        ret: "char*",
        name: "gpualloc_tags_json",
        params: &[("int", "device")],
        doc: "The sleep tags of `device` (-1: every device in use) as a JSON array of objects with\n\
              device, name, pool [first, second], paused, backup (\"none\", \"host\" or null),\n\
              paused_bytes (given back), backed_up_bytes, reserved_bytes (mapped now),\n\
              allocated_bytes and segments. Free with gpualloc_string_free; NULL on error.",
    },
    ApiFn {
        ret: "void*",
        name: "gpualloc_host_alloc",
        params: &[("size_t", "size")],
        doc: "`size` bytes of pinned (page-locked, portable) host memory from the library's pinned\n\
              host allocator, which sleep tags' host backups use too: blocks are cached by rounded\n\
              size and reused, so repeated requests pin nothing new. NULL on failure.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_host_free",
        params: &[("void*", "ptr")],
        doc: "Gives back memory from gpualloc_host_alloc to the cache. NULL is a no-op; any other\n\
              pointer is GPUALLOC_ERR_INVALID.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_host_record_stream",
        params: &[("void*", "ptr"), ("cudaStream_t", "stream")],
        doc: "Declares that work queued on `stream` (an async copy) uses the pinned memory at `ptr`:\n\
              after gpualloc_host_free it is reused only once that work is done. `stream` must\n\
              outlive the free.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_host_empty_cache",
        params: &[],
        doc: "Unpins every cached block of the pinned host allocator.",
    },
    ApiFn {
        ret: "char*",
        name: "gpualloc_host_stats_json",
        params: &[],
        doc: "The pinned host allocator's counters as a JSON object: allocated_bytes, cached_bytes,\n\
              pending_bytes, reserved_bytes, peak_reserved_bytes, requests, cache_hits,\n\
              host_allocs, host_frees; and those of memory pinned in place with\n\
              gpualloc_host_register: registered_bytes, peak_registered_bytes,\n\
              registered_ranges, host_registers, host_unregisters. Free with\n\
              gpualloc_string_free; NULL on error.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_host_register",
        params: &[("void*", "ptr"), ("size_t", "size"), ("int", "flags")],
        doc: "Page-locks `size` bytes at `ptr`, memory the caller allocated (cuMemHostRegister,\n\
              portable: pinned for every context), as Numba's mempin does; with flags\n\
              GPUALLOC_HOST_REGISTER_MAPPED also maps it into the device address space. Counted\n\
              in gpualloc_host_stats_json as registered_bytes. The memory must stay allocated\n\
              until gpualloc_host_unregister(ptr). GPUALLOC_ERR_INVALID for NULL, size 0, an\n\
              unknown flag or a range overlapping one registered here (nothing is pinned then).",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_host_unregister",
        params: &[("void*", "ptr")],
        doc: "Unpins the range gpualloc_host_register pinned at `ptr` (its start); no queued copy\n\
              may use it any more. GPUALLOC_ERR_INVALID where no registered range starts.",
    },
    ApiFn {
        ret: "char*",
        name: "gpualloc_snapshot_text",
        params: &[("int", "device")],
        doc: "The snapshot of `device` (-1: all) as text, one item per line (segment, block,\n\
              trace lines; the format is in crates/alloc-ffi/src/snapshot.rs, to_text), for the\n\
              C++ bridge. Free with gpualloc_string_free. NULL on error.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_write_snapshot",
        params: &[("const char*", "path"), ("int", "device")],
        doc: "Writes a pickle with the structure of torch.cuda.memory._snapshot() (segments,\n\
              device_traces, allocator_settings) to `path`, for torch.cuda._memory_viz and\n\
              pytorch.org/memory_viz. device -1: every device in use.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_record_history",
        params: &[("int", "enabled"), ("ssize_t", "max_entries")],
        doc: "Starts (enabled != 0) or stops recording alloc / free / oom events for the\n\
              snapshots' device_traces, keeping the last `max_entries` per device (<= 0: 100000).\n\
              Starting clears earlier entries.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_block_segment",
        params: &[
            ("void*", "ptr"),
            ("int", "device"),
            ("uint64_t*", "base"),
            ("uint64_t*", "size"),
            ("int*", "expandable"),
        ],
        doc: "CUDA IPC: the memory shared with another process for the live block containing\n\
              `ptr` (PyTorch's getBaseAllocation). *expandable = 0: the block's cuMemAlloc\n\
              segment, [*base, *base + *size), shared whole through cudaIpcGetMemHandle(*base)\n\
              at offset ptr - *base (PyTorch's 'c' handle). *expandable = 1: the whole pages of\n\
              an expandable segment that cover the block, [*base, *base + *size), shared through\n\
              gpualloc_export_pages at offset ptr - *base ('e' handle). `device` is searched\n\
              first, then every other device in use (-1: all). A pointer that is not in a live\n\
              block of gpualloc, or a NULL out-pointer, is GPUALLOC_ERR_INVALID.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_export_pages",
        params: &[
            ("void*", "ptr"),
            ("int", "device"),
            ("uint64_t*", "first_page_addr"),
            ("uint64_t*", "page_size"),
            ("int*", "fds"),
            ("size_t", "max_fds"),
            ("size_t*", "n_fds"),
        ],
        doc: "CUDA IPC of a block of an expandable segment: the pages that cover the live block\n\
              containing `ptr`, every one *page_size bytes, from *first_page_addr on, as *n_fds\n\
              POSIX file descriptors of this process written to fds[0..*n_fds] in address order\n\
              (cuMemExportToShareableHandle; a receiver duplicates them with pidfd_getfd, as\n\
              PyTorch's 'e' handle requires). Each page is exported once; its descriptor stays\n\
              open, owned by the library, until the page's memory is released: never close it.\n\
              fds = NULL with max_fds = 0 only reports the three values. Fewer than *n_fds slots,\n\
              a block of a cuMemAlloc segment (use gpualloc_block_segment), an unknown pointer or\n\
              a device whose memory cannot be exported: a negative code, *n_fds still set when\n\
              known. `device` as in gpualloc_block_segment.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_set_segment_callback",
        params: &[("gpualloc_segment_callback", "callback")],
        doc: "Registers the callback told of every later segment event of every device: action\n\
              GPUALLOC_SEGMENT_ALLOC / _FREE (cuMemAlloc / cuMemFree) or _MAP / _UNMAP (pages of\n\
              an expandable segment), with the range's address and size. NULL: none. It runs\n\
              with the device's allocator lock held: it must not call into this library, and\n\
              must not throw or unwind.",
    },
    ApiFn {
        ret: "const char*",
        name: "gpualloc_last_error",
        params: &[],
        doc: "The message of the last failed call on this thread, or NULL. The int functions\n\
              clear it when they succeed (so does gpualloc_malloc of 0 bytes); a successful\n\
              gpualloc_malloc / gpualloc_free leaves it as it was, so check their result first.\n\
              Valid until the next gpualloc_* call on this thread.",
    },
    ApiFn {
        ret: "int",
        name: "gpualloc_last_error_code",
        params: &[],
        doc: "The GPUALLOC_ERR_* code of the last failed call on this thread (0 if none), with\n\
              the same lifetime rules as gpualloc_last_error().",
    },
    ApiFn {
        ret: "const char*",
        name: "gpualloc_version",
        params: &[],
        doc: "The library version (static string).",
    },
];

/// A segment was allocated (`cuMemAlloc`).
pub const GPUALLOC_SEGMENT_ALLOC: c_int = 0;
/// A segment was freed (`cuMemFree`).
pub const GPUALLOC_SEGMENT_FREE: c_int = 1;
/// Pages were mapped into an expandable segment.
pub const GPUALLOC_SEGMENT_MAP: c_int = 2;
/// Pages of an expandable segment were unmapped.
pub const GPUALLOC_SEGMENT_UNMAP: c_int = 3;

/// The segment event actions of `gpualloc_set_segment_callback`, as
/// `(name, value, meaning)`.
pub const SEGMENT_ACTIONS: &[(&str, i32, &str)] = &[
    (
        "GPUALLOC_SEGMENT_ALLOC",
        GPUALLOC_SEGMENT_ALLOC,
        "a segment was allocated (cuMemAlloc)",
    ),
    (
        "GPUALLOC_SEGMENT_FREE",
        GPUALLOC_SEGMENT_FREE,
        "a segment was freed (cuMemFree)",
    ),
    (
        "GPUALLOC_SEGMENT_MAP",
        GPUALLOC_SEGMENT_MAP,
        "pages were mapped into an expandable segment",
    ),
    (
        "GPUALLOC_SEGMENT_UNMAP",
        GPUALLOC_SEGMENT_UNMAP,
        "pages of an expandable segment were unmapped",
    ),
];

/// `flags` of [`gpualloc_host_register`](crate::gpualloc_host_register):
/// also map the range into the device address space (Numba's `mapped`,
/// CUDA's `CU_MEMHOSTREGISTER_DEVICEMAP`).
pub const GPUALLOC_HOST_REGISTER_MAPPED: c_int = 1;

/// The flags of `gpualloc_host_register`, as `(name, value, meaning)`.
pub const HOST_REGISTER_FLAGS: &[(&str, i32, &str)] = &[(
    "GPUALLOC_HOST_REGISTER_MAPPED",
    GPUALLOC_HOST_REGISTER_MAPPED,
    "gpualloc_host_register: also map the range into the device address space",
)];

/// The header's first lines (comment, guards, types).
const PREAMBLE: &[&str] = &[
    "/* gpualloc.h: C API of liballoc_ffi.so, a caching CUDA memory allocator.",
    " *",
    " * GENERATED from crates/alloc-ffi/src/api.rs; `cargo test -p alloc-ffi` fails when",
    " * this file and the Rust code drift apart. Regenerate with",
    " *   GPUALLOC_BLESS=1 cargo test -p alloc-ffi --test header",
    " *",
    " * Use from PyTorch, before the first CUDA allocation (python/gpu_alloc does this):",
    " *   torch.cuda.memory.change_current_allocator(",
    " *       torch.cuda.memory.CUDAPluggableAllocator(",
    " *           \"liballoc_ffi.so\", \"gpualloc_malloc\", \"gpualloc_free\"))",
    " *",
    " * Configuration: the environment variable GPUALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF",
    " * syntax), read at the first use, or gpualloc_configure() before it. An invalid",
    " * GPUALLOC_CONF is reported once on stderr and makes every allocation fail.",
    " *",
    " * Every function is thread-safe and never lets a panic escape. The int functions",
    " * return GPUALLOC_OK (0) or a negative GPUALLOC_ERR_* code; the message of the",
    " * last failure on the calling thread is gpualloc_last_error().",
    " */",
    "#ifndef GPUALLOC_H",
    "#define GPUALLOC_H",
    "",
    "#include <stdint.h> /* uint64_t */",
    "#include <sys/types.h> /* ssize_t, size_t */",
    "",
    "#ifndef __DRIVER_TYPES_H__",
    "/* The same typedef as CUDA's driver_types.h (included by cuda_runtime.h). */",
    "typedef struct CUstream_st* cudaStream_t;",
    "#endif",
    "",
    "/* The segment source of gpualloc_set_pool_allocator. */",
    "typedef void* (*gpualloc_pool_alloc_fn)(size_t size, int device, void* ctx);",
    "typedef void (*gpualloc_pool_free_fn)(void* ptr, size_t size, int device, void* ctx);",
    "",
    "/* The callback of gpualloc_set_segment_callback (action: GPUALLOC_SEGMENT_*). */",
    "typedef void (*gpualloc_segment_callback)(int device, int action, uint64_t addr,",
    "                                          uint64_t size);",
    "",
    "#ifdef __cplusplus",
    "extern \"C\" {",
    "#endif",
    "",
];

/// The text of `include/gpualloc.h`.
pub fn header_text() -> String {
    let mut h = String::new();
    for line in PREAMBLE {
        h.push_str(line);
        h.push('\n');
    }
    for (name, value, meaning) in CODES
        .iter()
        .chain(SEGMENT_ACTIONS)
        .chain(HOST_REGISTER_FLAGS)
    {
        h.push_str(&format!("#define {name} ({value}) /* {meaning} */\n"));
    }
    h.push('\n');
    for s in STRUCTS {
        h.push_str(&struct_text(s));
    }
    for f in API {
        h.push_str("/* ");
        h.push_str(&f.doc.replace('\n', "\n * "));
        h.push_str(" */\n");
        let params = if f.params.is_empty() {
            "void".to_string()
        } else {
            f.params
                .iter()
                .map(|(ty, name)| format!("{ty} {name}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        h.push_str(&format!("{} {}({});\n\n", f.ret, f.name, params));
    }
    h.push_str(
        "#ifdef __cplusplus\n\
         } /* extern \"C\" */\n\
         #endif\n\
         \n\
         #endif /* GPUALLOC_H */\n",
    );
    h
}

/// A doc text of `///` lines as one comment body: lines trimmed, joined
/// with `sep`.
fn doc_lines(doc: &str, sep: &str) -> String {
    doc.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(sep)
}

/// The C definition of a struct: `typedef struct Name { ... } Name;`.
fn struct_text(s: &CStruct) -> String {
    let mut t = format!("/* {} */\n", doc_lines(s.doc, "\n * "));
    t.push_str(&format!("typedef struct {} {{\n", s.name));
    for f in s.fields {
        // An array type `T[N]` is declared `T name[N]`.
        let (ty, len) = match f.c_type.find('[') {
            Some(i) => (&f.c_type[..i], &f.c_type[i..]),
            None => (f.c_type, ""),
        };
        t.push_str(&format!(
            "  {ty} {}{len}; /* {} */\n",
            f.name,
            doc_lines(f.doc, " ")
        ));
    }
    t.push_str(&format!("}} {};\n\n", s.name));
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_prefixed() {
        let mut names: Vec<_> = API.iter().map(|f| f.name).collect();
        assert!(names.iter().all(|n| n.starts_with("gpualloc_")));
        names.sort();
        names.dedup();
        assert_eq!(names.len(), API.len());
    }

    #[test]
    fn header_declares_every_function() {
        let h = header_text();
        for f in API {
            assert!(h.contains(&format!(" {}(", f.name)), "{}", f.name);
        }
    }
}
