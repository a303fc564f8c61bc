/* gpualloc.h: C API of liballoc_ffi.so, a caching CUDA memory allocator.
 *
 * GENERATED from crates/alloc-ffi/src/api.rs; `cargo test -p alloc-ffi` fails when
 * this file and the Rust code drift apart. Regenerate with
 *   GPUALLOC_BLESS=1 cargo test -p alloc-ffi --test header
 *
 * Use from PyTorch, before the first CUDA allocation (python/gpu_alloc does this):
 *   torch.cuda.memory.change_current_allocator(
 *       torch.cuda.memory.CUDAPluggableAllocator(
 *           "liballoc_ffi.so", "gpualloc_malloc", "gpualloc_free"))
 *
 * Configuration: the environment variable GPUALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF
 * syntax), read at the first use, or gpualloc_configure() before it. An invalid
 * GPUALLOC_CONF is reported once on stderr and makes every allocation fail.
 *
 * Every function is thread-safe and never lets a panic escape. The int functions
 * return GPUALLOC_OK (0) or a negative GPUALLOC_ERR_* code; the message of the
 * last failure on the calling thread is gpualloc_last_error().
 */
#ifndef GPUALLOC_H
#define GPUALLOC_H

#include <stdint.h> /* uint64_t */
#include <sys/types.h> /* ssize_t, size_t */

#ifndef __DRIVER_TYPES_H__
/* The same typedef as CUDA's driver_types.h (included by cuda_runtime.h). */
typedef struct CUstream_st* cudaStream_t;
#endif

/* The segment source of gpualloc_set_pool_allocator. */
typedef void* (*gpualloc_pool_alloc_fn)(size_t size, int device, void* ctx);
typedef void (*gpualloc_pool_free_fn)(void* ptr, size_t size, int device, void* ctx);

/* The callback of gpualloc_set_segment_callback (action: GPUALLOC_SEGMENT_*). */
typedef void (*gpualloc_segment_callback)(int device, int action, uint64_t addr,
                                          uint64_t size);

#ifdef __cplusplus
extern "C" {
#endif

#define GPUALLOC_OK (0) /* success */
#define GPUALLOC_ERR_INVALID (-1) /* bad argument: pointer, size, device, fraction, path or configuration */
#define GPUALLOC_ERR_OUT_OF_MEMORY (-2) /* out of memory after freeing the cache and retrying */
#define GPUALLOC_ERR_CUDA (-3) /* CUDA driver failure, no driver, or no such device */
#define GPUALLOC_ERR_TOO_LATE (-4) /* gpualloc_configure after the allocator was first used */
#define GPUALLOC_ERR_INTERNAL (-5) /* internal error (caught panic): a bug; later calls work */
#define GPUALLOC_ERR_UNKNOWN_POOL (-6) /* private pool never created (retain / begin_allocate_to_pool) or released */
#define GPUALLOC_SEGMENT_ALLOC (0) /* a segment was allocated (cuMemAlloc) */
#define GPUALLOC_SEGMENT_FREE (1) /* a segment was freed (cuMemFree) */
#define GPUALLOC_SEGMENT_MAP (2) /* pages were mapped into an expandable segment */
#define GPUALLOC_SEGMENT_UNMAP (3) /* pages of an expandable segment were unmapped */
#define GPUALLOC_HOST_REGISTER_MAPPED (1) /* gpualloc_host_register: also map the range into the device address space */

/* One statistic as torch.cuda.memory_stats() keeps it. */
typedef struct GpuallocStat {
  int64_t current; /* Present value. */
  int64_t peak; /* Highest value since creation or the last reset of peaks. */
  int64_t allocated; /* Sum of all increases since the last reset of accumulated counters. */
  int64_t freed; /* Sum of all decreases since the last reset of accumulated counters. */
} GpuallocStat;

/* The statistics of a device, with PyTorch's names (DeviceStats). Arrays of three
 * are indexed [all pools, small pool, large pool]. Set `size` to
 * sizeof(GpuallocDeviceStats) before the call. */
typedef struct GpuallocDeviceStats {
  size_t size; /* In: the size of the struct the caller has. Out: the bytes the library filled (fields are only ever appended; those past it are left untouched). */
  GpuallocStat allocation[3]; /* Blocks handed out to callers. */
  GpuallocStat segment[3]; /* Device allocations (segments) held. */
  GpuallocStat active[3]; /* Blocks in use or waiting for stream events. */
  GpuallocStat inactive_split[3]; /* Free blocks inside split segments. */
  GpuallocStat allocated_bytes[3]; /* Bytes of blocks handed out (after rounding). */
  GpuallocStat reserved_bytes[3]; /* Bytes reserved from the device. */
  GpuallocStat active_bytes[3]; /* Bytes of active blocks. */
  GpuallocStat inactive_split_bytes[3]; /* Bytes of free blocks inside split segments. */
  GpuallocStat requested_bytes[3]; /* Bytes callers asked for (before rounding), over active blocks. */
  GpuallocStat oversize_allocations; /* Allocations at or above max_split_size. */
  GpuallocStat oversize_segments; /* Segments at or above max_split_size. */
  int64_t num_alloc_retries; /* Device allocations retried after freeing the cache. */
  int64_t num_ooms; /* Allocations that failed with out of memory. */
  int64_t num_sync_all_streams; /* Times every pending stream event was waited for. */
  int64_t num_device_alloc; /* Device allocation calls. */
  int64_t num_device_free; /* Device free calls. */
  int64_t max_split_size; /* max_split_size in bytes; -1 when unlimited. */
} GpuallocDeviceStats;

/* Allocates `size` bytes on `device` for use on `stream` (the allocation function
 * of torch.cuda.memory.CUDAPluggableAllocator). Returns NULL on failure with the
 * message in gpualloc_last_error(); size 0 returns NULL with no error (the block
 * would have no address; PyTorch never frees a NULL data pointer). The first call
 * on a device creates its allocator, with GPUALLOC_CONF read once per process.
 * `stream` (NULL: the legacy default stream) must be a stream of `device` that
 * lives as long as the allocator holds blocks allocated on it, cached ones included
 * (until gpualloc_empty_cache); PyTorch's streams always do. */
void* gpualloc_malloc(ssize_t size, int device, cudaStream_t stream);

/* Frees a block from gpualloc_malloc (the free function of CUDAPluggableAllocator).
 * `size` and `stream` are ignored: the allocator knows both. NULL is a no-op. A
 * pointer it did not hand out is reported (gpualloc_last_error, and stderr for the
 * first few) and otherwise ignored, never undefined behaviour. */
void gpualloc_free(void* ptr, ssize_t size, int device, cudaStream_t stream);

/* Sets the configuration (PYTORCH_CUDA_ALLOC_CONF syntax, e.g.
 * "policy:pytorch-bfc,max_split_size_mb:128,expandable_segments:True", or a
 * setting's name, alone or followed by options: "bound,max_split_size_mb:64"), replacing
 * GPUALLOC_CONF. Must be called before the first use of the allocator: then it
 * returns GPUALLOC_ERR_TOO_LATE. A bad string returns GPUALLOC_ERR_INVALID (-1). */
int gpualloc_configure(const char* config);

/* Parses and validates a configuration string or setting name without applying it
 * (no CUDA call). */
int gpualloc_check_config(const char* config);

/* Changes the settings that `settings` names (configuration syntax) while the
 * allocator runs, on every device and for devices used later, as PyTorch's
 * _set_allocator_settings: roundup_power2_divisions, max_split_size_mb,
 * max_non_split_rounding_mb, garbage_collection_threshold, expandable_segments,
 * stream_wait_reuse, graph_capture_record_stream_reuse, per_process_memory_fraction
 * apply from the next allocation. GPUALLOC_ERR_INVALID for a malformed string or
 * an option fixed at creation (policy, unmap_free_pages, unmap_page_mb,
 * idle_slab_limit_mb once slabs exist). Seals the configuration. */
int gpualloc_update_settings(const char* settings);

/* The configuration in effect: gpualloc_configure's string, else GPUALLOC_CONF's,
 * then every string gpualloc_update_settings accepted since, comma-joined (what
 * snapshots report as allocator_settings). Free it with gpualloc_string_free. */
char* gpualloc_settings_text(void);

/* Waits for pending cross-stream events, then returns every unused cached segment
 * to the driver. device -1: every device in use. */
int gpualloc_empty_cache(int device);

/* Limits the memory reserved on `device` to `fraction` [0, 1] of its capacity (0: nothing more). */
int gpualloc_set_memory_fraction(double fraction, int device);

/* Marks the block at `ptr` (the address gpualloc_malloc returned) as used by
 * `stream` too: its free then defers reuse until that stream's work queued before
 * the free is done (Tensor.record_stream). `stream` must outlive the block's free. */
int gpualloc_record_stream(void* ptr, int device, cudaStream_t stream);

/* Makes every peak statistic equal to its current value. device -1: every device. */
int gpualloc_reset_peak_stats(int device);

/* Clears the cumulative counters (allocated / freed totals, event counts, call times). */
int gpualloc_reset_accumulated_stats(int device);

/* Statistics of `device` as a JSON object with torch.cuda.memory_stats()'s flat key
 * names ("allocated_bytes.all.current", "reserved_bytes.all.peak", ...), plus
 * "max_split_size" and our "page_moves.*" counters (what unmap_free_pages
 * moved: rounds, pages_unmapped, busy_pages_reused, pages_mapped, stream_waits, host_ns,
 *               blocks_lent)
 * and "stream_ops.*" counters (what stream ordering asked of the driver: recorded,
 * queried, host_waits, host_wait_ns, stream_waits), all zero for a device never used.
 * With GPUALLOC_TIME_CALLS=1 also "host_calls.*": the library's own malloc and free
 * calls naming the device (malloc, malloc_ns, malloc_slow (100 us or more),
 * malloc_max_ns, and the same for free). Free the string with gpualloc_string_free. NULL on error. */
char* gpualloc_memory_stats_json(int device);

/* Statistics of `device` in *out (all zero, max_split_size -1, for a device never
 * used): the numbers of gpualloc_memory_stats_json without the JSON. Set out->size
 * to sizeof(GpuallocDeviceStats) first; the library fills the fields that fit in
 * it and sets out->size to the bytes filled, so callers built against an older or
 * newer header work. GPUALLOC_ERR_INVALID for a NULL out, out->size too small
 * for its first field, or a bad device index. */
int gpualloc_device_stats(int device, GpuallocDeviceStats* out);

/* Which setting for a workload: replays the PyTorch memory snapshot in `data` (the
 * `len` bytes of a torch.cuda.memory._dump_snapshot() pickle, or a trace file)
 * under PyTorch's default and expandable segments and our settings on a
 * simulated device (no GPU needed) and returns the advice as a JSON object: the
 * "outcomes" per setting, the "recommended_setting", its "enable_call",
 * "gpualloc_conf", "cost" in page moves per step, and the printable "text"
 * (rule: docs/advise.md). device -1: the first device with events. `name` (or
 * NULL) titles the report. Free with gpualloc_string_free. NULL on error (a
 * corrupt or foreign file, no events, a library built without `advise`). */
char* gpualloc_advise(const void* data, size_t len, int device, const char* name);

/* gpualloc_advise for a workload with a memory budget of `budget_bytes` (0: the
 * device's memory): the "budget" setting is replayed reclaiming at it, and no
 * setting whose peak reserved passes it is recommended while one stays under it
 * (docs/advise.md). The same JSON, with "budget_bytes"; the same errors. */
char* gpualloc_advise_budget(const void* data, size_t len, int device, const char* name, uint64_t budget_bytes);

/* Frees a string returned by this library. NULL is a no-op. */
void gpualloc_string_free(char* s);

/* gpualloc_malloc from the private pool (pool_first, pool_second) (PyTorch's
 * MempoolId_t), or from the ordinary cache when both are 0. The pool must exist
 * (gpualloc_retain_pool or gpualloc_begin_allocate_to_pool, not yet released by
 * its last holder): else GPUALLOC_ERR_UNKNOWN_POOL. For callers that check the
 * result (the C++ bridge raises OutOfMemoryError): NULL on failure with the
 * message in gpualloc_last_error(), nothing printed. */
void* gpualloc_malloc_in_pool(ssize_t size, int device, cudaStream_t stream, uint64_t pool_first, uint64_t pool_second);

/* A CUDA graph capture (or MemPool context) into the pool begins: holds the pool
 * (created on first use) and, until the matching end, queries and records no event
 * and returns no memory to the driver (both would break a capture). Allocations
 * reach the pool through gpualloc_malloc_in_pool. */
int gpualloc_begin_allocate_to_pool(int device, uint64_t pool_first, uint64_t pool_second);

/* Ends what gpualloc_begin_allocate_to_pool began (the pool stays held). */
int gpualloc_end_allocate_to_pool(int device, uint64_t pool_first, uint64_t pool_second);

/* One more holder of the pool (PyTorch's createOrIncrefPool). */
int gpualloc_retain_pool(int device, uint64_t pool_first, uint64_t pool_second);

/* One holder fewer (a graph was deleted). With none left the pool's idle segments
 * go back to the driver; its other blocks become ordinary cache once freed, and the
 * pool is gone: naming it again is GPUALLOC_ERR_UNKNOWN_POOL until it is created
 * anew. Its bookkeeping goes with its last segment. */
int gpualloc_release_pool(int device, uint64_t pool_first, uint64_t pool_second);

/* Makes a held private pool with no segment yet take its segments from `alloc` and
 * give them back through `free` (MemPool(allocator)): they are cached and split as
 * the library's own, and never grow. Both are called with the device's allocator
 * lock held (they must not call into this library, nor throw) and with `ctx`; alloc
 * returns NULL when out of memory. */
int gpualloc_set_pool_allocator(int device, uint64_t first, uint64_t second, gpualloc_pool_alloc_fn alloc, gpualloc_pool_free_fn free, void* ctx);

/* Waits for pending cross-stream events, then returns the idle segments of this
 * private pool, and only those, to the driver (PyTorch's emptyCache(mempool_id),
 * called as a MemPool is destroyed). A pool still held keeps them. device -1:
 * every device in use. */
int gpualloc_empty_pool_cache(int device, uint64_t pool_first, uint64_t pool_second);

/* Makes a private pool hand out whole blocks, never split (MemPool(no_split=True)):
 * each allocation takes a whole cached block or a new segment. Refused with
 * expandable segments and with policy:size-class. */
int gpualloc_set_pool_no_split(int device, uint64_t first, uint64_t second);

/* Saves the layout of a private pool (CUDA graph trees: getCheckpointState). Every block
 * of the pool must be done with other streams' events. Free the handle with
 * gpualloc_pool_checkpoint_free. NULL on error. */
void* gpualloc_checkpoint_pool(int device, uint64_t pool_first, uint64_t pool_second);

/* Frees a checkpoint from gpualloc_checkpoint_pool. NULL is a no-op. */
void gpualloc_pool_checkpoint_free(void* checkpoint);

/* Puts the checkpoint's pool back into its layout (setCheckpointPoolState): frees every
 * block allocated in the pool now and allocates the checkpoint's live blocks again at
 * their addresses; the caller owns those. Writes both address lists as arrays freed
 * with gpualloc_u64_array_free. Fails before changing anything when a block of the pool
 * is used by another stream, or the policy cannot rebuild layouts (size-class). */
int gpualloc_restore_pool(int device, void* checkpoint, uint64_t** freed, size_t* n_freed, uint64_t** allocated, size_t* n_allocated);

/* Frees an array written by gpualloc_restore_pool. NULL is a no-op. */
void gpualloc_u64_array_free(uint64_t* values, size_t len);

/* Whether the blocks allocated in the pool are exactly the n addresses of expected
 * (checkPoolLiveAllocations): 1 yes, 0 no, negative on error. */
int gpualloc_pool_live_allocations_are(int device, uint64_t pool_first, uint64_t pool_second, const uint64_t* expected, size_t n);

/* Holders of the pool (0 when unknown or released); negative on error. */
int gpualloc_pool_use_count(int device, uint64_t pool_first, uint64_t pool_second);

/* Sleep tags: writes the private pool of the tag `tag` on `device`, created on first
 * use (growable segments on the driver's virtual-memory API, whatever
 * expandable_segments says; cached and served by the configured policy). Allocate in
 * it with gpualloc_malloc_in_pool, or route a thread's allocations to it with
 * gpualloc_begin_allocate_to_pool / _end_ (as a CUDA graph capture does). Needs a
 * policy that grows segments (not buddy) and a device with virtual memory. */
int gpualloc_tag_pool(int device, const char* tag, uint64_t* pool_first, uint64_t* pool_second);

/* Makes the private pool (pool_first, pool_second) - a PyTorch MemPool with no segment
 * yet - the pool of the new sleep tag `tag` (gpu_alloc.region() does this). Binding the
 * same pair again is a no-op; another pool for the tag, or a pool with segments, is
 * GPUALLOC_ERR_INVALID. */
int gpualloc_bind_tag(int device, const char* tag, uint64_t pool_first, uint64_t pool_second);

/* Pauses the sleep tag `tag` (NULL: every tag not paused) on `device` (-1: on every device
 * in use that has it): waits for the work of the streams that used its blocks through events on them
 * (never a device-wide synchronize), with backup "host" copies its live blocks to
 * pinned host memory (backup NULL or "none": contents are lost), then unmaps and
 * releases every page of its segments, keeping their addresses. Until gpualloc_resume,
 * allocating from the tag fails (GPUALLOC_ERR_INVALID, "is paused"); freeing its
 * blocks is fine. Pausing a paused or unknown tag, or during a capture, fails. */
int gpualloc_pause(int device, const char* tag, const char* backup);

/* Resumes the paused sleep tag `tag` (NULL: every paused tag) on `device` (-1: on every
 * device in use that has it): maps fresh memory at the same addresses (freeing this allocator's
 * other idle cache first if the device is full) and copies host backups back before
 * returning. GPUALLOC_ERR_OUT_OF_MEMORY leaves the tag paused. Resuming a tag that is
 * not paused, or an unknown one, is GPUALLOC_ERR_INVALID. */
int gpualloc_resume(int device, const char* tag);

/* The sleep tags of `device` (-1: every device in use) as a JSON array of objects with
 * device, name, pool [first, second], paused, backup ("none", "host" or null),
 * paused_bytes (given back), backed_up_bytes, reserved_bytes (mapped now),
 * allocated_bytes and segments. Free with gpualloc_string_free; NULL on error. */
char* gpualloc_tags_json(int device);

/* `size` bytes of pinned (page-locked, portable) host memory from the library's pinned
 * host allocator, which sleep tags' host backups use too: blocks are cached by rounded
 * size and reused, so repeated requests pin nothing new. NULL on failure. */
void* gpualloc_host_alloc(size_t size);

/* Gives back memory from gpualloc_host_alloc to the cache. NULL is a no-op; any other
 * pointer is GPUALLOC_ERR_INVALID. */
int gpualloc_host_free(void* ptr);

/* Declares that work queued on `stream` (an async copy) uses the pinned memory at `ptr`:
 * after gpualloc_host_free it is reused only once that work is done. `stream` must
 * outlive the free. */
int gpualloc_host_record_stream(void* ptr, cudaStream_t stream);

/* Unpins every cached block of the pinned host allocator. */
int gpualloc_host_empty_cache(void);

/* The pinned host allocator's counters as a JSON object: allocated_bytes, cached_bytes,
 * pending_bytes, reserved_bytes, peak_reserved_bytes, requests, cache_hits,
 * host_allocs, host_frees; and those of memory pinned in place with
 * gpualloc_host_register: registered_bytes, peak_registered_bytes,
 * registered_ranges, host_registers, host_unregisters. Free with
 * gpualloc_string_free; NULL on error. */
char* gpualloc_host_stats_json(void);

/* Page-locks `size` bytes at `ptr`, memory the caller allocated (cuMemHostRegister,
 * portable: pinned for every context), as Numba's mempin does; with flags
 * GPUALLOC_HOST_REGISTER_MAPPED also maps it into the device address space. Counted
 * in gpualloc_host_stats_json as registered_bytes. The memory must stay allocated
 * until gpualloc_host_unregister(ptr). GPUALLOC_ERR_INVALID for NULL, size 0, an
 * unknown flag or a range overlapping one registered here (nothing is pinned then). */
int gpualloc_host_register(void* ptr, size_t size, int flags);

/* Unpins the range gpualloc_host_register pinned at `ptr` (its start); no queued copy
 * may use it any more. GPUALLOC_ERR_INVALID where no registered range starts. */
int gpualloc_host_unregister(void* ptr);

/* The snapshot of `device` (-1: all) as text, one item per line (segment, block,
 * trace lines; the format is in crates/alloc-ffi/src/snapshot.rs, to_text), for the
 * C++ bridge. Free with gpualloc_string_free. NULL on error. */
char* gpualloc_snapshot_text(int device);

/* Writes a pickle with the structure of torch.cuda.memory._snapshot() (segments,
 * device_traces, allocator_settings) to `path`, for torch.cuda._memory_viz and
 * pytorch.org/memory_viz. device -1: every device in use. */
int gpualloc_write_snapshot(const char* path, int device);

/* Starts (enabled != 0) or stops recording alloc / free / oom events for the
 * snapshots' device_traces, keeping the last `max_entries` per device (<= 0: 100000).
 * Starting clears earlier entries. */
int gpualloc_record_history(int enabled, ssize_t max_entries);

/* CUDA IPC: the memory shared with another process for the live block containing
 * `ptr` (PyTorch's getBaseAllocation). *expandable = 0: the block's cuMemAlloc
 * segment, [*base, *base + *size), shared whole through cudaIpcGetMemHandle(*base)
 * at offset ptr - *base (PyTorch's 'c' handle). *expandable = 1: the whole pages of
 * an expandable segment that cover the block, [*base, *base + *size), shared through
 * gpualloc_export_pages at offset ptr - *base ('e' handle). `device` is searched
 * first, then every other device in use (-1: all). A pointer that is not in a live
 * block of gpualloc, or a NULL out-pointer, is GPUALLOC_ERR_INVALID. */
int gpualloc_block_segment(void* ptr, int device, uint64_t* base, uint64_t* size, int* expandable);

/* CUDA IPC of a block of an expandable segment: the pages that cover the live block
 * containing `ptr`, every one *page_size bytes, from *first_page_addr on, as *n_fds
 * POSIX file descriptors of this process written to fds[0..*n_fds] in address order
 * (cuMemExportToShareableHandle; a receiver duplicates them with pidfd_getfd, as
 * PyTorch's 'e' handle requires). Each page is exported once; its descriptor stays
 * open, owned by the library, until the page's memory is released: never close it.
 * fds = NULL with max_fds = 0 only reports the three values. Fewer than *n_fds slots,
 * a block of a cuMemAlloc segment (use gpualloc_block_segment), an unknown pointer or
 * a device whose memory cannot be exported: a negative code, *n_fds still set when
 * known. `device` as in gpualloc_block_segment. */
int gpualloc_export_pages(void* ptr, int device, uint64_t* first_page_addr, uint64_t* page_size, int* fds, size_t max_fds, size_t* n_fds);

/* Registers the callback told of every later segment event of every device: action
 * GPUALLOC_SEGMENT_ALLOC / _FREE (cuMemAlloc / cuMemFree) or _MAP / _UNMAP (pages of
 * an expandable segment), with the range's address and size. NULL: none. It runs
 * with the device's allocator lock held: it must not call into this library, and
 * must not throw or unwind. */
int gpualloc_set_segment_callback(gpualloc_segment_callback callback);

/* The message of the last failed call on this thread, or NULL. The int functions
 * clear it when they succeed (so does gpualloc_malloc of 0 bytes); a successful
 * gpualloc_malloc / gpualloc_free leaves it as it was, so check their result first.
 * Valid until the next gpualloc_* call on this thread. */
const char* gpualloc_last_error(void);

/* The GPUALLOC_ERR_* code of the last failed call on this thread (0 if none), with
 * the same lifetime rules as gpualloc_last_error(). */
int gpualloc_last_error_code(void);

/* The library version (static string). */
const char* gpualloc_version(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GPUALLOC_H */
