// Memory history for the C++ bridge, as PyTorch's own CUDA caching allocator
// keeps it: stack contexts of live blocks (a snapshot's BlockInfo frames), the
// per-device ring of TraceEntry records behind a snapshot's device_traces, and
// the allocator trace trackers of attachAllocatorTraceTracker.
//
// PyTorch's rules, followed here (c10/cuda/CUDACachingAllocator.cpp):
// - recordHistory(enabled, recorder, max_entries, when, clear, skip_actions):
//   a context level other than NEVER needs a recorder; the ring keeps at most
//   max(1, max_entries) entries per device, overwriting the oldest; turning
//   history off or clear=true empties it; skip_actions names actions
//   ("alloc", "free_requested", ...) kept out of the ring (trackers still see
//   them), unknown names are ignored.
// - Stacks are taken outside any lock (the recorder may take the GIL): an
//   allocation takes one when `when` >= STATE and keeps it with its block, a
//   free takes one when `when` == ALL. A trace entry carries a stack only when
//   `when` >= ALLOC: the free's own stack, else the block's allocation stack.
// - Every action goes to the trackers, history on or off, while the lock is
//   held, before the ring; they must not take the GIL or call the allocator.
// - Times are approximate-clock ticks, converted to microseconds since the
//   epoch when a snapshot is taken (what torch.cuda._memory_viz reads).
// - A snapshot records a "snapshot" action per device after its trace was
//   read, so it shows up in the next snapshot's trace.
//
// Differences: "segment_map" and "segment_unmap" are honoured in skip_actions
// too; a failing recorder or tracker is reported on stderr and dropped (a free
// runs inside a tensor's deleter and must not throw); live blocks lose their
// stacks when history is turned off (PyTorch keeps them until the block is
// freed), so that nothing is looked up on a free while history is off.
//
// Cost while history is off and no tracker is attached: the caller's one
// relaxed load of watching() per malloc and free; nothing is stored.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>

namespace gpu_alloc_bridge {

// Every TraceEntry action with the name PyTorch's snapshots give it.
inline constexpr std::pair<c10::CachingDeviceAllocator::TraceEntry::Action, const char*>
    kTraceActions[] = {
        {c10::CachingDeviceAllocator::TraceEntry::ALLOC, "alloc"},
        {c10::CachingDeviceAllocator::TraceEntry::FREE_REQUESTED, "free_requested"},
        {c10::CachingDeviceAllocator::TraceEntry::FREE_COMPLETED, "free_completed"},
        {c10::CachingDeviceAllocator::TraceEntry::SEGMENT_ALLOC, "segment_alloc"},
        {c10::CachingDeviceAllocator::TraceEntry::SEGMENT_FREE, "segment_free"},
        {c10::CachingDeviceAllocator::TraceEntry::SEGMENT_MAP, "segment_map"},
        {c10::CachingDeviceAllocator::TraceEntry::SEGMENT_UNMAP, "segment_unmap"},
        {c10::CachingDeviceAllocator::TraceEntry::SNAPSHOT, "snapshot"},
        {c10::CachingDeviceAllocator::TraceEntry::OOM, "oom"},
};
inline constexpr size_t kTraceActionCount = sizeof(kTraceActions) / sizeof(kTraceActions[0]);

class History {
 public:
  using Action = c10::CachingDeviceAllocator::TraceEntry::Action;
  using Context = std::shared_ptr<c10::GatheredContext>;
  using RecordContext = c10::CachingDeviceAllocator::RecordContext;
  using TraceEntry = c10::CachingDeviceAllocator::TraceEntry;

  // Whether malloc and free must call on_alloc / on_free: history on or a
  // tracker attached. The only cost on those paths when both are off.
  bool watching() const { return watching_.load(std::memory_order_relaxed); }

  // isHistoryEnabled().
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

  // recordHistory(). Throws (a Python RuntimeError) on a context level
  // without a recorder, as PyTorch does.
  void configure(bool enabled, c10::CachingDeviceAllocator::CreateContextFn recorder,
                 size_t max_entries, RecordContext when, bool clear,
                 const std::vector<std::string>& skip_actions) {
    TORCH_CHECK(when == RecordContext::NEVER || recorder != nullptr,
                "gpu_alloc: recordHistory needs a context recorder to record stacks");
    uint32_t skip = 0;
    for (const auto& name : skip_actions) {
      for (const auto& [action, action_name] : kTraceActions) {
        if (name == action_name) {
          skip |= bit(action);
        }
      }
    }
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    enabled_.store(enabled, std::memory_order_relaxed);
    recorder_.store(enabled ? recorder : nullptr, std::memory_order_release);
    when_.store(enabled ? when : RecordContext::NEVER, std::memory_order_relaxed);
    skip_ = skip;
    capacity_ = std::max<size_t>(1, max_entries);
    for (auto& ring : rings_) {
      ring.set_capacity(capacity_);
      if (!enabled || clear) {
        ring.clear();
      }
    }
    if (!enabled || clear) {
      annotations_.clear();
    }
    if (!enabled) {
      // Blocks are then known only for the trackers' sake: no stacks, and
      // none at all without trackers (a free then looks nothing up).
      if (trackers_.empty()) {
        std::unordered_map<void*, Block>().swap(blocks_);
      } else {
        for (auto& entry : blocks_) {
          entry.second.context.reset();
        }
      }
    }
    update_watching();
  }

  // The recorder's context when `when` reaches `level`, else none. Call it
  // outside every lock: PyTorch's recorder takes the GIL.
  Context gather(RecordContext level) const noexcept {
    if (when_.load(std::memory_order_relaxed) < level) {
      return nullptr;
    }
    auto recorder = recorder_.load(std::memory_order_acquire);
    if (recorder == nullptr) {
      return nullptr;
    }
    Context context;
    guarded("the stack recorder", [&] { context = recorder(); });
    return context;
  }

  // An allocation the library made (requested bytes, on `stream`, in `pool`).
  void on_alloc(c10::DeviceIndex device, void* ptr, size_t size, void* stream,
                c10::MempoolId_t pool) noexcept {
    guarded("recording an allocation", [&] {
      Context context = gather(RecordContext::STATE);
      std::lock_guard<std::recursive_mutex> lock(mutex_);
      if (!recording_or_tracked()) {
        return;
      }
      blocks_[ptr] = Block{device, size, stream, pool, context};
      record(TraceEntry::ALLOC, device, ptr_value(ptr), size, stream, pool, std::move(context));
    });
  }

  // A free, called before the library frees `ptr` (afterwards another thread
  // could be handed the same address first). Records free_requested and
  // free_completed: the library makes a block reusable at its free, waiting
  // for record_stream's events on reuse. `device` is used for blocks
  // allocated before history was on.
  void on_free(void* ptr, c10::DeviceIndex device) noexcept {
    guarded("recording a free", [&] {
      Context context = gather(RecordContext::ALL);
      std::lock_guard<std::recursive_mutex> lock(mutex_);
      auto it = blocks_.find(ptr);
      Block block{device, 0, nullptr, {0, 0}, nullptr};
      if (it != blocks_.end()) {
        block = std::move(it->second);
        blocks_.erase(it);
      } else if (!recording_or_tracked()) {
        return;
      }
      const Context& stack = context ? context : block.context;
      for (Action action : {TraceEntry::FREE_REQUESTED, TraceEntry::FREE_COMPLETED}) {
        record(action, block.device, ptr_value(ptr), block.size, block.stream, block.pool, stack);
      }
    });
  }

  // An allocation the library refused for lack of memory (`device_free`
  // bytes free on the device), before torch.OutOfMemoryError is raised.
  void on_oom(c10::DeviceIndex device, size_t size, void* stream, size_t device_free,
              c10::MempoolId_t pool) noexcept {
    guarded("recording an out-of-memory", [&] {
      Context context = gather(RecordContext::STATE);
      std::lock_guard<std::recursive_mutex> lock(mutex_);
      record(TraceEntry::OOM, device, device_free, size, stream, pool, std::move(context));
    });
  }

  // segment_alloc / segment_free / segment_map / segment_unmap, for when the
  // library reports them. PyTorch passes the allocation's stack with a
  // segment_alloc and the releasing call's (gather(ALL)) with a segment_free.
  void on_segment(Action action, c10::DeviceIndex device, size_t address, size_t size,
                  void* stream, c10::MempoolId_t pool, Context context = nullptr) noexcept {
    guarded("recording a segment", [&] {
      std::lock_guard<std::recursive_mutex> lock(mutex_);
      record(action, device, address, size, stream, pool, std::move(context));
    });
  }

  // A block that was live before history or a tracker started, so that its
  // free is recorded with its size and stream (and no stack: none was taken).
  void adopt(c10::DeviceIndex device, void* ptr, size_t size, void* stream,
             c10::MempoolId_t pool) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (recording_or_tracked()) {
      blocks_.emplace(ptr, Block{device, size, stream, pool, nullptr});
    }
  }

  // The stack taken when the live block at `ptr` was allocated, if any.
  Context block_context(void* ptr) const {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    auto it = blocks_.find(ptr);
    return it == blocks_.end() ? nullptr : it->second.context;
  }

  // Completes a snapshot built from the library's segments: the allocation
  // stacks of allocated blocks (addresses follow from the segment's address
  // and the block sizes, in address order), the recorded traces with their
  // times in microseconds since the epoch (include_traces), then a
  // "snapshot" action per device carrying its active bytes.
  void fill_snapshot(c10::cuda::CUDACachingAllocator::SnapshotInfo& info, bool include_traces,
                     c10::MempoolId_t pool) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    size_t devices = std::max(info.device_traces.size(), rings_.size());
    for (const auto& segment : info.segments) {
      devices = std::max<size_t>(devices, static_cast<size_t>(std::max<int>(segment.device, 0)) + 1);
    }
    std::vector<size_t> active(devices, 0);
    for (auto& segment : info.segments) {
      active[std::max<int>(segment.device, 0)] += segment.active_size;
      size_t address = segment.address;
      for (auto& block : segment.blocks) {
        if (block.allocated) {
          auto it = blocks_.find(reinterpret_cast<void*>(address));
          if (it != blocks_.end()) {
            block.context_when_allocated = it->second.context;
          }
        }
        address += block.size;
      }
    }
    if (include_traces) {
      auto to_ns = clock_.makeConverter();
      if (info.device_traces.size() < rings_.size()) {
        info.device_traces.resize(rings_.size());
      }
      for (size_t d = 0; d < rings_.size(); ++d) {
        auto& out = info.device_traces[d];
        size_t first = out.size();
        rings_[d].copy_to(out);
        for (size_t i = first; i < out.size(); ++i) {
          out[i].time_.t_ = to_ns(out[i].time_.approx_t_) / 1000;
        }
      }
      for (const auto& annotation : annotations_) {
        info.external_annotations.push_back(annotation);
        auto& time = info.external_annotations.back().time_;
        time.t_ = to_ns(time.approx_t_) / 1000;
      }
    }
    for (size_t d = 0; d < devices; ++d) {
      record(TraceEntry::SNAPSHOT, static_cast<c10::DeviceIndex>(d), 0, active[d], nullptr, pool,
             nullptr);
    }
  }

  // attachAllocatorTraceTracker(). Trackers are never detached (as PyTorch).
  void attach_tracker(c10::CachingDeviceAllocator::AllocatorTraceTracker tracker) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    trackers_.push_back(std::move(tracker));
    update_watching();
  }

  // pushCompileContext() / popCompileContext(): the innermost torch.compile
  // region is stored with each entry ("N/A" outside any), as PyTorch does.
  void push_compile_context(const std::string& context) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    compile_contexts_.push_back(context);
  }
  void pop_compile_context() {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (!compile_contexts_.empty()) {
      compile_contexts_.pop_back();
    }
  }

  // recordAnnotation(): a record_function region's metadata, kept (while
  // history is on, at most max_entries) for the snapshot's
  // external_annotations.
  void record_annotation(c10::DeviceIndex device,
                         const std::vector<std::pair<std::string, std::string>>& metadata) {
    if (!enabled()) {
      return;
    }
    c10::CachingDeviceAllocator::AnnotationEntry entry(device, c10::getApproximateTime());
    for (const auto& [name, value] : metadata) {
      entry.recordUserMetadata(name, value);
    }
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    annotations_.push_back(std::move(entry));
    while (annotations_.size() > capacity_) {
      annotations_.pop_front();
    }
  }

  // setUserMetadata() / getUserMetadata(): per thread, stored with each entry.
  static void set_user_metadata(const std::string& metadata) { user_metadata() = metadata; }
  static std::string& user_metadata() {
    thread_local std::string metadata;
    return metadata;
  }

 private:
  struct Block {
    c10::DeviceIndex device;
    size_t size;  // requested bytes
    void* stream;
    c10::MempoolId_t pool;
    Context context;  // the allocation's stack (when >= STATE)
  };

  // One device's entries, oldest first from `next` once full.
  struct Ring {
    std::vector<TraceEntry> entries;
    size_t next = 0;

    void push(TraceEntry entry, size_t capacity) {
      if (entries.size() < capacity) {
        entries.push_back(std::move(entry));
      } else {
        entries[next] = std::move(entry);
        next = (next + 1) % entries.size();
      }
    }
    void copy_to(std::vector<TraceEntry>& out) const {
      out.reserve(out.size() + entries.size());
      const auto oldest = entries.begin() + static_cast<std::ptrdiff_t>(next);
      out.insert(out.end(), oldest, entries.end());
      out.insert(out.end(), entries.begin(), oldest);
    }
    // Keeps the newest `capacity` entries, oldest first.
    void set_capacity(size_t capacity) {
      std::rotate(entries.begin(), entries.begin() + static_cast<std::ptrdiff_t>(next),
                  entries.end());
      next = 0;
      if (entries.size() > capacity) {
        entries.erase(entries.begin(),
                      entries.begin() + static_cast<std::ptrdiff_t>(entries.size() - capacity));
      }
    }
    void clear() {
      std::vector<TraceEntry>().swap(entries);
      next = 0;
    }
  };

  static uint32_t bit(Action action) { return 1u << static_cast<unsigned>(action); }
  static size_t ptr_value(void* ptr) { return reinterpret_cast<size_t>(ptr); }

  bool recording_or_tracked() const { return enabled() || !trackers_.empty(); }
  void update_watching() { watching_.store(recording_or_tracked(), std::memory_order_relaxed); }

  // PyTorch's record_trace. The caller holds mutex_.
  void record(Action action, c10::DeviceIndex device, size_t address, size_t size, void* stream,
              c10::MempoolId_t pool, Context context) {
    const bool keep = enabled() && (skip_ & bit(action)) == 0;
    if (!keep && trackers_.empty()) {
      return;
    }
    if (when_.load(std::memory_order_relaxed) < RecordContext::ALLOC) {
      context = nullptr;
    }
    TraceEntry entry(action, device, address, size, stream, pool, c10::getApproximateTime(),
                     std::move(context),
                     compile_contexts_.empty() ? std::string("N/A") : compile_contexts_.back(),
                     user_metadata());
    for (const auto& tracker : trackers_) {
      guarded("an allocator trace tracker", [&] { tracker(entry); });
    }
    if (keep) {
      size_t d = static_cast<size_t>(std::max<int>(device, 0));
      if (rings_.size() <= d) {
        rings_.resize(d + 1);
      }
      rings_[d].push(std::move(entry), capacity_);
    }
  }

  // Runs `body`; an exception is reported (the first few) and dropped.
  template <typename F>
  static void guarded(const char* what, F&& body) noexcept {
    try {
      body();
    } catch (const c10::Error& e) {
      report(what, e.what_without_backtrace());
    } catch (const std::exception& e) {
      report(what, e.what());
    } catch (...) {
      report(what, "unknown exception");
    }
  }

  static void report(const char* what, const char* why) noexcept {
    static std::atomic<int> reported{0};
    if (reported.fetch_add(1, std::memory_order_relaxed) < 5) {
      std::fprintf(stderr, "gpu_alloc: memory history: %s failed, event kept without it: %s\n",
                   what, why);
    }
  }

  mutable std::recursive_mutex mutex_;  // a tracker calling back in does not deadlock
  std::atomic<bool> watching_{false};
  std::atomic<bool> enabled_{false};
  std::atomic<c10::CachingDeviceAllocator::CreateContextFn> recorder_{nullptr};
  std::atomic<RecordContext> when_{RecordContext::NEVER};
  // Guarded by mutex_:
  uint32_t skip_ = 0;
  size_t capacity_ = 1;
  std::vector<Ring> rings_;                   // by device
  std::unordered_map<void*, Block> blocks_;   // live blocks while watching
  std::deque<c10::CachingDeviceAllocator::AllocatorTraceTracker> trackers_;  // stable on push
  std::vector<std::string> compile_contexts_;  // innermost last
  std::deque<c10::CachingDeviceAllocator::AnnotationEntry> annotations_;
  c10::ApproximateClockToUnixTimeConverter clock_;
};

}  // namespace gpu_alloc_bridge
