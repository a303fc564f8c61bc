// The C++ bridge between PyTorch and liballoc_ffi.so.
//
// A plain torch.cuda.memory.CUDAPluggableAllocator forwards only malloc and
// free: torch.cuda.memory_stats() and _snapshot() raise, and
// Tensor.record_stream, empty_cache, set_per_process_memory_fraction and the
// CUDA graph pool hooks never reach the library (a silently ignored
// record_stream is a use-after-free across streams). This bridge implements
// PyTorch's whole CUDAAllocator interface by forwarding to the gpualloc_* C
// API, and installs itself as PyTorch's CUDA allocator.
//
// Built on first use by python/gpu_alloc (torch.utils.cpp_extension.load),
// against the installed torch. The library is opened with dlopen at the path
// the helper passes, so the bridge and the ctypes helper share one allocator;
// its functions are declared by gpualloc.h (bridge_api.h).

#include <dlfcn.h>

#include <atomic>
#include <limits>
#include <map>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <algorithm>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/record_function.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cuda_runtime_api.h>

#include "bridge_api.h"
#include "bridge_free_hint.h"
#include "bridge_history.h"
#include "bridge_ipc.h"
#include "bridge_settings.h"
#include "bridge_testing.h"

namespace gpu_alloc_bridge {

using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::SegmentInfo;
using c10::CachingDeviceAllocator::BlockInfo;
using c10::CachingDeviceAllocator::Stat;
using c10::CachingDeviceAllocator::TraceEntry;
using c10::cuda::MempoolId_t;
using c10::cuda::CUDACachingAllocator::CUDAAllocator;
using c10::cuda::CUDACachingAllocator::SnapshotInfo;

Api api;

// Stacks, trace and trackers of torch.cuda.memory._record_memory_history.
// Never destroyed: its entries may hold Python stacks at interpreter exit.
History& history = *new History();

std::string last_error() {
  const char* e = api.last_error();
  return e ? std::string(e) : std::string("unknown error");
}

// Messages are built from strings only (numbers through std::to_string): a
// number streamed by c10::str instantiates iostream code with this
// extension's compiler, which crashed inside torch's process on the GPU
// machine (its libstdc++ is older than the compiler torch's extension loader
// finds there).

// Raises the library's last error as a C++ exception (a RuntimeError in Python).
void check(int code, const char* what) {
  TORCH_CHECK(code >= 0, "gpualloc ", what, " failed: ", last_error());
}

// An allocation routing opened by beginAllocateToPool: allocations on streams
// the filter accepts go to the pool (a CUDA graph capture, use_mem_pool).
struct Route {
  c10::DeviceIndex device;
  MempoolId_t pool;
  std::function<bool(cudaStream_t)> filter;
};

void bridge_delete(void* ptr);

// A private pool's layout saved by the library (getCheckpointState); the
// library's handle is freed with the last reference.
struct PoolCheckpoint : c10::cuda::CUDACachingAllocator::AllocatorState {
  explicit PoolCheckpoint(void* handle) : handle(handle) {}
  PoolCheckpoint(const PoolCheckpoint&) = delete;
  PoolCheckpoint& operator=(const PoolCheckpoint&) = delete;
  ~PoolCheckpoint() override { api.pool_checkpoint_free(handle); }
  void* handle;
};

// An address array owned by the library, freed on scope exit.
struct LibraryArray {
  uint64_t* values = nullptr;
  size_t len = 0;
  LibraryArray() = default;
  LibraryArray(const LibraryArray&) = delete;
  LibraryArray& operator=(const LibraryArray&) = delete;
  ~LibraryArray() { api.u64_array_free(values, len); }
};

// Blocks handed out while caching is off (torch.cuda.caching_allocator_enable(
// False)): straight from cudaMalloc and back to cudaFree, as PyTorch does.
class UncachedBlocks {
 public:
  void* allocate(size_t size) {
    void* ptr = nullptr;
    C10_CUDA_CHECK(cudaMalloc(&ptr, size));
    std::lock_guard<std::mutex> lock(mutex_);
    ptrs_.insert(ptr);
    count_.store(ptrs_.size(), std::memory_order_release);
    return ptr;
  }

  // Frees `ptr` if it is one of these blocks; false if it is not.
  bool free(void* ptr) noexcept {
    if (count_.load(std::memory_order_acquire) == 0) {
      return false;  // the common case: one load
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (ptrs_.erase(ptr) == 0) {
        return false;
      }
      count_.store(ptrs_.size(), std::memory_order_release);
    }
    (void)cudaFree(ptr);
    return true;
  }

 private:
  std::mutex mutex_;
  std::unordered_set<void*> ptrs_;
  std::atomic<size_t> count_{0};
};

UncachedBlocks uncached;

// Memory events for torch.profiler(profile_memory=True), reported as
// PyTorch's allocator reports them; the sizes of blocks allocated while the
// profiler records memory are kept to report their frees.
class ProfiledBlocks {
 public:
  void on_alloc(void* ptr, size_t size, c10::DeviceIndex device) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      sizes_[ptr] = {size, device};
      count_.store(sizes_.size(), std::memory_order_release);
    }
    report(ptr, static_cast<int64_t>(size), device);
  }

  void on_free(void* ptr) noexcept {
    if (count_.load(std::memory_order_acquire) == 0) {
      return;
    }
    std::pair<size_t, c10::DeviceIndex> block;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = sizes_.find(ptr);
      if (it == sizes_.end()) {
        return;
      }
      block = it->second;
      sizes_.erase(it);
      count_.store(sizes_.size(), std::memory_order_release);
    }
    try {
      report(ptr, -static_cast<int64_t>(block.first), block.second);
    } catch (...) {
      // A deleter must not throw: the profiler misses this event.
    }
  }

 private:
  static void report(void* ptr, int64_t delta, c10::DeviceIndex device) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
    c10::reportMemoryUsageToProfiler(ptr, delta, stats.allocated_bytes[0].current,
                                     stats.reserved_bytes[0].current,
                                     c10::Device(c10::DeviceType::CUDA, device));
  }

  std::mutex mutex_;
  std::unordered_map<void*, std::pair<size_t, c10::DeviceIndex>> sizes_;
  std::atomic<size_t> count_{0};
};

ProfiledBlocks profiled;

// PyTorch's size format in messages ("20.00 MiB"), so that tools and tests
// matching its out-of-memory text match ours.
std::string format_size(uint64_t size) {
  char text[64];
  if (size <= 1024) {
    std::snprintf(text, sizeof text, "%llu bytes", static_cast<unsigned long long>(size));
  } else if (size <= 1048576) {
    std::snprintf(text, sizeof text, "%.2f KiB", size / 1024.0);
  } else if (size <= 1073741824ULL) {
    std::snprintf(text, sizeof text, "%.2f MiB", size / 1048576.0);
  } else {
    std::snprintf(text, sizeof text, "%.2f GiB", size / 1073741824.0);
  }
  return text;
}

// Requests above this (1 PiB) exceed any device: the library refuses them as
// invalid, PyTorch reports them as out of memory, and so does the bridge.
constexpr uint64_t kLargestRequest = uint64_t{1} << 50;
constexpr uint64_t kOneExabyte = 1152921504606846976ULL;

// Segments of a MemPool(allocator) pool, from and back to that allocator
// (called by the library with its lock held: no exception may escape).
void* pool_segment_alloc(size_t size, int device, void* allocator) {
  try {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    return static_cast<CUDAAllocator*>(allocator)->raw_alloc(size);
  } catch (...) {
    return nullptr;  // out of memory for the pool
  }
}

void pool_segment_free(void* ptr, size_t /*size*/, int device, void* allocator) {
  try {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    static_cast<CUDAAllocator*>(allocator)->raw_delete(ptr);
  } catch (...) {
    std::fprintf(stderr, "gpu_alloc: a MemPool allocator failed to free a segment\n");
  }
}

// `work()` as an op of its own named `name` (its host time in a profile, inside
// the op that allocates) while any RecordFunction callback is on, as PyTorch's
// dispatcher runs an op; otherwise one check, without making a RecordFunction
// (whose construction and virtual destruction are calls into libtorch).
template <class Work>
auto as_op(const char* name, Work&& work) -> decltype(work()) {
  auto callbacks = at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION);
  if (C10_UNLIKELY(callbacks.has_value())) {
    at::RecordFunction guard(std::move(*callbacks));
    at::detail::record_function_with_scope(guard, name, std::vector<c10::IValue>());
    return work();
  }
  return work();
}

class Bridge : public CUDAAllocator {
 public:
  // ---------------------------------------------------------------- memory
  c10::DataPtr allocate(size_t size) override {
    TORCH_CHECK_WITH(OutOfMemoryError, size < kOneExabyte,
                     "CUDA out of memory. Tried to allocate more than 1EB memory.");
    c10::DeviceIndex device = c10::cuda::current_device();
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    void* ptr = size == 0 ? nullptr : alloc_on(size, device, stream);
    return {ptr, ptr, &bridge_delete, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &bridge_delete; }

  void* raw_alloc(size_t nbytes) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) {
      return nullptr;
    }
    return alloc_on(nbytes, c10::cuda::current_device(), stream);
  }

  void raw_delete(void* ptr) override { bridge_delete(ptr); }

  void copy_data(void* dest, const void* src, std::size_t count) const final {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // ---------------------------------------------------------------- set-up
  void init(int device_count) override {
    std::lock_guard<std::mutex> lock(mutex_);
    fractions_.resize(std::max<size_t>(fractions_.size(), device_count), default_fraction_);
  }

  // A memory fraction set for every device by a setting
  // (per_process_memory_fraction), which the library applied already.
  void set_default_fraction(double fraction) {
    std::lock_guard<std::mutex> lock(mutex_);
    default_fraction_ = fraction;
    std::fill(fractions_.begin(), fractions_.end(), fraction);
  }

  // The library creates each device's allocator on first use: it is ready
  // as soon as it is installed (torch.accelerator.memory_stats asks this).
  bool initialized() override { return true; }

  // torch.cuda.caching_allocator_enable(): while off, allocations bypass the
  // cache (cudaMalloc / cudaFree per block), as with PyTorch's allocator.
  void enable(bool value) override { caching_.store(value, std::memory_order_relaxed); }
  bool isEnabled() const override { return caching_.load(std::memory_order_relaxed); }
  std::string name() override { return "gpualloc"; }

  double getMemoryFraction(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return device < static_cast<int>(fractions_.size()) ? fractions_[device] : default_fraction_;
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    check(api.set_memory_fraction(fraction, device), "set_memory_fraction");
    std::lock_guard<std::mutex> lock(mutex_);
    if (device >= static_cast<int>(fractions_.size())) {
      fractions_.resize(device + 1, default_fraction_);
    }
    fractions_[device] = fraction;
  }

  // While an allocation routing is open (a capture, or use_mem_pool on any
  // thread) the library frees nothing; PyTorch calls this from destructors
  // too, so that case is a warning, not an exception.
  // A pool's id (a MemPool being destroyed) empties that pool's cache only,
  // as PyTorch does; {0, 0} empties everything.
  void emptyCache(MempoolId_t mempool_id) override {
    const bool whole = mempool_id.first == 0 && mempool_id.second == 0;
    int code = whole ? api.empty_cache(-1)
                     : api.empty_pool_cache(-1, mempool_id.first, mempool_id.second);
    if (code == GPUALLOC_ERR_INVALID) {
      TORCH_WARN_ONCE("gpu_alloc: empty_cache freed nothing: ", last_error());
      return;
    }
    check(code, "empty_cache");
  }

  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    // As PyTorch: the larger of the device's free bytes and the largest
    // cached free block (cuDNN sizes its workspace with this).
    size_t free_bytes = 0, total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    size_t largest = free_bytes;
    for (const auto& f : snapshot_lines(device)) {
      if (f[0] == "block" && f.size() >= 5 && f[4] == "inactive") {
        largest = std::max<size_t>(largest, to_u64(f[2]));
      }
    }
    *largestBlock = largest;
  }

  std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex /*device*/) override {
    return {};
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    return ipc::base_allocation(ipc_library(), ptr, size);
  }

  // ---------------------------------------------------------------- streams
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (!ptr.get() || ptr.get_deleter() != &bridge_delete) {
      return;  // an empty tensor, or memory gpualloc did not allocate (as PyTorch)
    }
    check(api.record_stream(ptr.get(), ptr.device().index(), stream.stream()), "record_stream");
  }

  // ---------------------------------------------------------------- statistics
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    GpuallocDeviceStats c{};
    c.size = sizeof c;
    check(api.device_stats(device, &c), "device_stats");
    DeviceStats s;
    auto copy_pools = [](c10::CachingDeviceAllocator::StatArray& to,
                         const GpuallocStat (&from)[3]) {
      for (size_t pool = 0; pool < 3; ++pool) {
        to[pool] = to_stat(from[pool]);  // [all, small pool, large pool] in both
      }
    };
    copy_pools(s.allocation, c.allocation);
    copy_pools(s.segment, c.segment);
    copy_pools(s.active, c.active);
    copy_pools(s.inactive_split, c.inactive_split);
    copy_pools(s.allocated_bytes, c.allocated_bytes);
    copy_pools(s.reserved_bytes, c.reserved_bytes);
    copy_pools(s.active_bytes, c.active_bytes);
    copy_pools(s.inactive_split_bytes, c.inactive_split_bytes);
    copy_pools(s.requested_bytes, c.requested_bytes);
    s.oversize_allocations = to_stat(c.oversize_allocations);
    s.oversize_segments = to_stat(c.oversize_segments);
    s.num_alloc_retries = c.num_alloc_retries;
    s.num_ooms = c.num_ooms;
    s.num_sync_all_streams = c.num_sync_all_streams;
    s.num_device_alloc = c.num_device_alloc;
    s.num_device_free = c.num_device_free;
    s.max_split_size = c.max_split_size;
    return s;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check(api.reset_accumulated_stats(device), "reset_accumulated_stats");
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check(api.reset_peak_stats(device), "reset_peak_stats");
  }

  // ---------------------------------------------------------------- snapshots
  SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces) override {
    SnapshotInfo info{};
    info.config_metadata = {};
    int devices = c10::cuda::device_count();
    info.device_traces.resize(devices);
    for (const auto& f : snapshot_lines(-1)) {
      if (f[0] == "segment" && f.size() >= 9) {
        SegmentInfo seg;
        seg.device = static_cast<c10::DeviceIndex>(to_i64(f[1]));
        seg.address = to_u64(f[2]);
        seg.total_size = to_u64(f[3]);
        seg.stream = reinterpret_cast<void*>(to_u64(f[4]));
        seg.is_large = f[5] == "large";
        seg.is_expandable = f[6] == "1";
        seg.owner_private_pool_id = {to_u64(f[7]), to_u64(f[8])};
        info.segments.push_back(std::move(seg));
      } else if (f[0] == "block" && f.size() >= 5) {
        TORCH_CHECK(!info.segments.empty(), "gpu_alloc bridge: block before any segment");
        BlockInfo block;
        block.size = to_u64(f[2]);
        block.requested_size = to_u64(f[3]);
        block.allocated = f[4] == "active_allocated";
        block.active = f[4] != "inactive";
        SegmentInfo& seg = info.segments.back();
        if (block.allocated) {
          seg.allocated_size += block.size;
        }
        if (block.active) {
          seg.active_size += block.size;
          seg.requested_size += block.requested_size;
        }
        seg.blocks.push_back(std::move(block));
      }
    }
    if (mempool_id.first != 0 || mempool_id.second != 0) {
      std::vector<SegmentInfo> kept;
      for (auto& seg : info.segments) {
        if (seg.owner_private_pool_id == mempool_id) {
          kept.push_back(std::move(seg));
        }
      }
      info.segments = std::move(kept);
    }
    history.fill_snapshot(info, include_traces, mempool_id);
    info.config_metadata.last_allocator_settings = "gpualloc";
    return info;
  }

  bool isHistoryEnabled() override { return history.enabled(); }

  void recordHistory(bool enabled,
                     c10::cuda::CUDACachingAllocator::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries,
                     c10::cuda::CUDACachingAllocator::RecordContext when,
                     bool clearHistory,
                     const std::vector<std::string>& skip_actions) override {
    history.configure(enabled, context_recorder, alloc_trace_max_entries, when, clearHistory,
                      skip_actions);
    if (enabled) {
      adopt_live_blocks();
    }
  }

  void setUserMetadata(const std::string& metadata) override {
    History::set_user_metadata(metadata);
  }

  std::string getUserMetadata() override { return History::user_metadata(); }

  void attachOutOfMemoryObserver(
      c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(mutex_);
    oom_observers_.push_back(std::move(observer));
  }

  void attachAllocatorTraceTracker(
      c10::cuda::CUDACachingAllocator::AllocatorTraceTracker tracker) override {
    history.attach_tracker(std::move(tracker));
    adopt_live_blocks();
  }

  // ---------------------------------------------------------------- pools (CUDA graphs)
  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
    check(api.begin_allocate_to_pool(device, mempool_id.first, mempool_id.second),
          "begin_allocate_to_pool");
    std::lock_guard<std::mutex> lock(mutex_);
    routes_.push_back(Route{device, mempool_id, std::move(filter)});
    routing_.store(static_cast<int>(routes_.size()), std::memory_order_release);
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = routes_.begin(); it != routes_.end(); ++it) {
        if (it->device == device && it->pool == mempool_id) {
          routes_.erase(it);
          break;
        }
      }
      routing_.store(static_cast<int>(routes_.size()), std::memory_order_release);
    }
    check(api.end_allocate_to_pool(device, mempool_id.first, mempool_id.second),
          "end_allocate_to_pool");
  }

  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    check(api.release_pool(device, mempool_id.first, mempool_id.second), "release_pool");
    if (api.pool_use_count(device, mempool_id.first, mempool_id.second) == 0) {
      setUseOnOOM(device, mempool_id, false);
    }
  }

  // MemPool(use_on_oom=True): when the default pools run out, a request may
  // be served from this pool's cached blocks (the most recent such pool
  // first), as PyTorch does.
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id, bool use_on_oom) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto key = std::make_pair(device, mempool_id);
    oom_pools_.erase(std::remove(oom_pools_.begin(), oom_pools_.end(), key), oom_pools_.end());
    if (use_on_oom) {
      oom_pools_.push_back(key);
    }
  }

  // MemPool(no_split=True): the pool hands out whole blocks.
  void setNoSplit(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    check(api.set_pool_no_split(device, mempool_id.first, mempool_id.second), "set_pool_no_split");
  }

  // torch.compile regions, stored with each trace entry.
  void pushCompileContext(std::string& md) override { history.push_compile_context(md); }
  void popCompileContext() override { history.pop_compile_context(); }

  // record_function regions, kept for the snapshot's external_annotations.
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    history.record_annotation(c10::cuda::current_device(), md);
  }

  // A MemPool with an allocator of its own takes its segments from it: the
  // library caches and splits them, and gives them back through it. The
  // allocator is kept alive for as long as the process may free into it.
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                          std::shared_ptr<CUDAAllocator> allocator) override {
    check(api.retain_pool(device, mempool_id.first, mempool_id.second), "retain_pool");
    if (allocator == nullptr) {
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    auto& kept = pool_allocators_[std::make_pair(device, mempool_id)];
    if (kept) {
      return;  // one more holder of a pool that has its source
    }
    check(api.set_pool_allocator(device, mempool_id.first, mempool_id.second, &pool_segment_alloc,
                                 &pool_segment_free, allocator.get()),
          "set_pool_allocator");
    kept = std::move(allocator);
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    int n = api.pool_use_count(device, mempool_id.first, mempool_id.second);
    check(n, "pool_use_count");
    return n;
  }

  // ---------------------------------------------------------------- peers
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();  // clear the sticky-free error
      return;
    }
    C10_CUDA_CHECK(err);
  }

  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dstDevice == srcDevice) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  // ---------------------------------------------------------------- CUDA IPC
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    return ipc::open_handle(handle);
  }

  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* ptr) override {
    return ipc::share_handle(ipc_library(), ptr);
  }

  // ---------------------------------------------------------------- CUDA graph trees
  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(
      c10::DeviceIndex device, MempoolId_t id) override {
    void* handle = api.checkpoint_pool(device, id.first, id.second);
    TORCH_CHECK(handle != nullptr, "gpualloc checkpoint_pool failed: ", last_error());
    return std::make_shared<PoolCheckpoint>(handle);
  }

  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device,
      std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> state) override {
    auto checkpoint = std::dynamic_pointer_cast<PoolCheckpoint>(state);
    TORCH_CHECK(checkpoint, "gpu_alloc: setCheckpointPoolState needs a checkpoint made by gpualloc");
    LibraryArray freed, allocated;
    check(api.restore_pool(device, checkpoint->handle, &freed.values, &freed.len,
                           &allocated.values, &allocated.len),
          "restore_pool");
    c10::cuda::CUDACachingAllocator::CheckpointDelta delta;
    for (size_t i = 0; i < freed.len; ++i) {
      void* ptr = reinterpret_cast<void*>(freed.values[i]);
      if (history.watching()) {
        history.on_free(ptr, device);
      }
      delta.ptrs_freed.push_back(ptr);
    }
    // The recreated blocks belong to the storages PyTorch attaches them to.
    for (size_t i = 0; i < allocated.len; ++i) {
      void* ptr = reinterpret_cast<void*>(allocated.values[i]);
      delta.dataptrs_allocd.emplace_back(ptr, ptr, &bridge_delete,
                                         c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }

  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected) override {
    std::vector<uint64_t> addresses;
    addresses.reserve(expected.size());
    for (void* p : expected) {
      addresses.push_back(reinterpret_cast<uint64_t>(p));
    }
    int answer = api.pool_live_allocations_are(device, mempool_id.first, mempool_id.second,
                                               addresses.data(), addresses.size());
    check(answer, "pool_live_allocations_are");
    return answer == 1;
  }

 private:
  // The library functions the CUDA IPC sender uses.
  static ipc::Library ipc_library() { return {api.block_segment, api.export_pages, api.last_error}; }

  static std::string take_string(char* s, const char* what) {
    TORCH_CHECK(s != nullptr, "gpualloc ", what, " failed: ", last_error());
    std::string out(s);
    api.string_free(s);
    return out;
  }

  static uint64_t to_u64(const std::string& s) { return std::strtoull(s.c_str(), nullptr, 10); }
  static int64_t to_i64(const std::string& s) { return std::strtoll(s.c_str(), nullptr, 10); }

  // The library's snapshot text (see gpualloc_snapshot_text) split into lines
  // of space-separated fields; no empty lines.
  static std::vector<std::vector<std::string>> snapshot_lines(int device) {
    std::string text = take_string(api.snapshot_text(device), "snapshot");
    std::vector<std::vector<std::string>> lines;
    size_t pos = 0;
    while (pos < text.size()) {
      size_t eol = text.find('\n', pos);
      if (eol == std::string::npos) {
        eol = text.size();
      }
      std::vector<std::string> fields;
      size_t f = pos;
      while (f < eol) {
        size_t sp = text.find(' ', f);
        if (sp == std::string::npos || sp > eol) {
          sp = eol;
        }
        if (sp > f) {
          fields.push_back(text.substr(f, sp - f));
        }
        f = sp + 1;
      }
      if (!fields.empty()) {
        lines.push_back(std::move(fields));
      }
      pos = eol + 1;
    }
    return lines;
  }

  // Live blocks allocated before history or a tracker started: their sizes
  // and streams, so that their frees are recorded as PyTorch records them.
  void adopt_live_blocks() {
    c10::DeviceIndex device = 0;
    void* stream = nullptr;
    MempoolId_t pool{0, 0};
    for (const auto& f : snapshot_lines(-1)) {
      if (f[0] == "segment" && f.size() >= 9) {
        device = static_cast<c10::DeviceIndex>(to_i64(f[1]));
        stream = reinterpret_cast<void*>(to_u64(f[4]));
        pool = {to_u64(f[7]), to_u64(f[8])};
      } else if (f[0] == "block" && f.size() >= 5 && f[4] == "active_allocated") {
        history.adopt(device, reinterpret_cast<void*>(to_u64(f[1])), to_u64(f[3]), stream, pool);
      }
    }
  }

  // The private pool this allocation goes to, or {0, 0}.
  MempoolId_t route(c10::DeviceIndex device, cudaStream_t stream) {
    if (routing_.load(std::memory_order_acquire) == 0) {
      return {0, 0};
    }
    std::lock_guard<std::mutex> lock(mutex_);
    // The innermost routing first: nested use_mem_pool blocks.
    for (auto r = routes_.rbegin(); r != routes_.rend(); ++r) {
      if (r->device == device && r->filter(stream)) {
        return r->pool;
      }
    }
    return {0, 0};
  }

  // Pools of `device` marked use_on_oom, the most recent first.
  std::vector<MempoolId_t> oom_pools(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<MempoolId_t> pools;
    for (auto p = oom_pools_.rbegin(); p != oom_pools_.rend(); ++p) {
      if (p->first == device) {
        pools.push_back(p->second);
      }
    }
    return pools;
  }

  // Served: history and profiler records of a new block.
  void* handed_out(void* ptr, size_t size, c10::DeviceIndex device, cudaStream_t stream,
                   MempoolId_t pool) {
    free_hint::on_alloc(device);
    if (history.watching()) {
      history.on_alloc(device, ptr, size, stream, pool);
    }
    if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
      profiled.on_alloc(ptr, size, device);
    }
    return ptr;
  }

  // Under torch.profiler the allocator's own time is an op of its own.
  void* alloc_on(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    return as_op("gpualloc::malloc", [&] { return alloc_served(size, device, stream); });
  }

  void* alloc_served(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    if (C10_UNLIKELY(!caching_.load(std::memory_order_relaxed))) {
      return uncached.allocate(size);
    }
    MempoolId_t pool = route(device, stream);
    bool too_large = size > kLargestRequest;
    void* ptr = too_large ? nullptr
                          : api.malloc_in_pool(static_cast<ssize_t>(size), device, stream,
                                               pool.first, pool.second);
    if (ptr != nullptr) {
      return handed_out(ptr, size, device, stream, pool);
    }
    std::string message = too_large ? std::string("larger than any device") : last_error();
    if (too_large || api.last_error_code() == GPUALLOC_ERR_OUT_OF_MEMORY) {
      if (!too_large && pool == MempoolId_t{0, 0}) {
        for (MempoolId_t spare : oom_pools(device)) {
          ptr = api.malloc_in_pool(static_cast<ssize_t>(size), device, stream, spare.first,
                                   spare.second);
          if (ptr != nullptr) {
            return handed_out(ptr, size, device, stream, spare);
          }
        }
      }
      size_t free_bytes = 0, total = 0;
      (void)cudaMemGetInfo(&free_bytes, &total);
      if (history.watching()) {
        history.on_oom(device, size, stream, free_bytes, pool);
      }
      std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> observers;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        observers = oom_observers_;
      }
      for (const auto& observer : observers) {
        observer(device, static_cast<int64_t>(size), static_cast<int64_t>(total),
                 static_cast<int64_t>(free_bytes));
      }
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ",
                       format_size(size), ". GPU ", std::to_string(device),
                       " has a total capacity of ", format_size(total), " of which ",
                       format_size(free_bytes), " is free. gpualloc: ", message);
    }
    TORCH_CHECK(false, "gpualloc could not allocate ", std::to_string(size), " bytes on device ",
                std::to_string(device), ": ", message);
  }

  static Stat to_stat(const GpuallocStat& g) {
    Stat stat;
    stat.current = g.current;
    stat.peak = g.peak;
    stat.allocated = g.allocated;
    stat.freed = g.freed;
    return stat;
  }

  std::mutex mutex_;
  std::vector<double> fractions_;
  double default_fraction_ = 1.0;
  std::vector<Route> routes_;
  std::atomic<int> routing_{0};
  std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> oom_observers_;
  std::atomic<bool> caching_{true};
  std::map<std::pair<c10::DeviceIndex, MempoolId_t>, std::shared_ptr<CUDAAllocator>>
      pool_allocators_;
  std::vector<std::pair<c10::DeviceIndex, MempoolId_t>> oom_pools_;
};

void free_served(void* ptr);

void bridge_delete(void* ptr) {
  if (ptr == nullptr || uncached.free(ptr)) {
    return;
  }
  as_op("gpualloc::free", [ptr] { free_served(ptr); });
}

void free_served(void* ptr) {
  profiled.on_free(ptr);
  // The device is a hint: the library finds the owning device itself. A
  // failed free is reported by the library on stderr (a deleter must not throw).
  int device = -1;
  if (history.watching()) {
    // The trace names the thread's current device.
    (void)cudaGetDevice(&device);
    history.on_free(ptr, static_cast<c10::DeviceIndex>(device));  // before another thread can reuse ptr
  } else {
    device = free_hint::for_free();
  }
  api.free(ptr, 0, device, nullptr);
}

// Segment events from the library (GPUALLOC_SEGMENT_ALLOC, _FREE, _MAP,
// _UNMAP), recorded and passed to the trace trackers as PyTorch does. Called
// with the library's lock held: records only, never calls back into it.
void on_segment_event(int device, int action, uint64_t addr, uint64_t size) {
  using Action = c10::CachingDeviceAllocator::TraceEntry::Action;
  static constexpr Action actions[] = {Action::SEGMENT_ALLOC, Action::SEGMENT_FREE,
                                       Action::SEGMENT_MAP, Action::SEGMENT_UNMAP};
  if (action < 0 || action > 3 || !history.watching()) {
    return;
  }
  history.on_segment(actions[action], static_cast<c10::DeviceIndex>(device), addr, size,
                     nullptr, MempoolId_t{0, 0});
}

std::shared_ptr<Bridge> installed;

// Opens the library and makes the bridge PyTorch's CUDA allocator. Must run
// before the first CUDA allocation of the process.
void install(const std::string& library_path) {
  TORCH_CHECK(!installed, "gpu_alloc bridge: already installed");
  void* lib = dlopen(library_path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  TORCH_CHECK(lib != nullptr, "gpu_alloc bridge: cannot open ", library_path, ": ", dlerror());
  const char* missing = api.resolve(lib);
  TORCH_CHECK(missing == nullptr, "gpu_alloc bridge: ", missing, " not found in the library (",
              library_path, "); is it an older liballoc_ffi.so?");
  check(api.set_segment_callback(&on_segment_event), "set_segment_callback");
  // PyTorch's settings are parsed (and an invalid PYTORCH_CUDA_ALLOC_CONF
  // raised, as PyTorch's allocator raises it) before the swap.
  settings::Options::current();
  auto bridge = std::make_shared<Bridge>();
  // Raises "Can't swap an already initialized allocator" when CUDA memory
  // is already in use.
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(bridge);
  // torch.accelerator's memory functions ask c10's allocator registry, which
  // changeCurrentAllocator leaves on PyTorch's own allocator.
  c10::SetAllocator(c10::DeviceType::CUDA, bridge.get(), std::numeric_limits<uint8_t>::max());
  installed = bridge;
  // Never destroyed: c10's settings hook refers to it until the process ends.
  static auto& sync = *new settings::Sync();
  sync.install(api.update_settings, api.settings_text, api.string_free, api.last_error,
               [bridge](double fraction) { bridge->set_default_fraction(fraction); });
}

bool is_installed() { return installed != nullptr; }

}  // namespace gpu_alloc_bridge

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Installs gpualloc as PyTorch's CUDA allocator with its whole interface";
  m.def("install", &gpu_alloc_bridge::install, "Open liballoc_ffi.so and install the bridge",
        pybind11::arg("library_path"));
  m.def("is_installed", &gpu_alloc_bridge::is_installed, "Whether the bridge is installed");
  gpu_alloc_bridge::test_hooks::bind(m);
}
