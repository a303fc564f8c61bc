// Test hooks the bridge module exports: PyTorch offers no Python call for
// allocator trace trackers, so the GPU scenario attaches one from here; and
// a thread's free device hint (bridge_free_hint.h) can be set wrong, as
// another device's allocation would leave it.
// attach_counting_tracker() goes through the public
// c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker, that is to
// whichever allocator PyTorch has installed (the bridge, once enabled).

#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>

#include <c10/cuda/CUDACachingAllocator.h>
#include <pybind11/pybind11.h>

#include "bridge_free_hint.h"
#include "bridge_history.h"

namespace gpu_alloc_bridge::test_hooks {

// Entries seen by the counting tracker, by action.
inline std::array<std::atomic<int64_t>, kTraceActionCount>& tracker_counters() {
  static std::array<std::atomic<int64_t>, kTraceActionCount> counters{};
  return counters;
}

// Attaches, once per process, a tracker counting every entry by action.
inline void attach_counting_tracker() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(
        [](const c10::CachingDeviceAllocator::TraceEntry& entry) {
          auto index = static_cast<size_t>(entry.action_);
          if (index < kTraceActionCount) {
            tracker_counters()[index].fetch_add(1, std::memory_order_relaxed);
          }
        });
  });
}

// {action name: count} for every action.
inline pybind11::dict tracker_counts() {
  pybind11::dict counts;
  for (const auto& [action, name] : kTraceActions) {
    counts[name] = tracker_counters()[static_cast<size_t>(action)].load(std::memory_order_relaxed);
  }
  return counts;
}

inline void reset_tracker_counts() {
  for (auto& counter : tracker_counters()) {
    counter.store(0, std::memory_order_relaxed);
  }
}

inline void bind(pybind11::module_& m) {
  m.def("attach_counting_tracker", &attach_counting_tracker,
        "Attach (once) an allocator trace tracker counting entries by action");
  m.def("tracker_counts", &tracker_counts, "The counting tracker's {action: count}");
  m.def("reset_tracker_counts", &reset_tracker_counts, "Zero the counting tracker's counts");
  m.def("set_free_hint", [](int device) { free_hint::device = device; },
        "Set the device this thread's frees name to the library (a wrong one: the test of "
        "the library's own search); -1: ask the runtime at the next free");
  m.def("free_hint", [] { return free_hint::device; }, "This thread's free device hint");
}

}  // namespace gpu_alloc_bridge::test_hooks
