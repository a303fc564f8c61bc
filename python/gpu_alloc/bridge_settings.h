// PyTorch's allocator settings applied to gpualloc: the device options of
// PYTORCH_CUDA_ALLOC_CONF (where the gpualloc configuration does not name
// them) when the bridge is installed, and every later change made through
// torch.cuda.memory._set_allocator_settings (or
// torch._C._accelerator_setAllocatorSettings), which reaches c10's
// configuration parser hook. PyTorch's parsed values are read back from c10
// and the options whose value changed are handed to
// gpualloc_update_settings, so the library follows PyTorch's own rules for
// what a settings string resets.

#pragma once

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDAAllocatorConfig.h>
#include <c10/util/Exception.h>

#include "gpualloc.h"

namespace gpu_alloc_bridge::settings {

// The device options PyTorch keeps, in gpualloc's syntax (numbers through
// std::to_string: see bridge.cpp on c10::str).
struct Options {
  std::vector<std::pair<std::string, std::string>> values;
  double fraction = 1.0;  // per_process_memory_fraction

  static Options current() {
    using Accel = c10::CachingAllocator::AcceleratorAllocatorConfig;
    using Cuda = c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig;
    Options o;
    constexpr uint64_t kMiB = 1 << 20;
    const size_t max_split = Accel::max_split_size();
    o.values.emplace_back("max_split_size_mb",
                          max_split == std::numeric_limits<size_t>::max()
                              ? std::to_string(std::numeric_limits<uint64_t>::max())
                              : std::to_string(max_split / kMiB));
    o.values.emplace_back("max_non_split_rounding_mb",
                          std::to_string(Accel::max_non_split_rounding_size() / kMiB));
    std::string divisions = "[";
    const auto& per_interval = Accel::roundup_power2_divisions();
    for (size_t i = 0; i < per_interval.size() && i < 64; ++i) {
      divisions += (i ? "," : "") + std::to_string(uint64_t{1} << i) + ":" +
                   std::to_string(per_interval[i]);
    }
    o.values.emplace_back("roundup_power2_divisions", divisions + "]");
    const double gc = Accel::garbage_collection_threshold();
    // 0 is PyTorch's "off"; gpualloc has no value for off, so a change back
    // to 0 is left out (documented in docs/pytorch.md).
    o.values.emplace_back("garbage_collection_threshold", gc > 0.0 ? std::to_string(gc) : "");
    o.values.emplace_back("expandable_segments", Accel::use_expandable_segments() ? "true" : "false");
    o.values.emplace_back("graph_capture_record_stream_reuse",
                          Cuda::graph_capture_record_stream_reuse() ? "true" : "false");
    o.fraction = Cuda::per_process_memory_fraction();
    o.values.emplace_back("per_process_memory_fraction", std::to_string(o.fraction));
    return o;
  }
};

// Applies changes of PyTorch's settings to the library.
class Sync {
 public:
  using Update = decltype(&gpualloc_update_settings);
  using Text = decltype(&gpualloc_settings_text);
  using Free = decltype(&gpualloc_string_free);
  using LastError = decltype(&gpualloc_last_error);
  // Told the memory fraction now in effect on every device.
  using OnFraction = std::function<void(double)>;

  // Applies PyTorch's options that differ from PyTorch's defaults and that
  // the library's configuration does not name, then follows every change.
  void install(Update update, Text text, Free free_text, LastError last_error,
               OnFraction on_fraction) {
    std::lock_guard<std::mutex> lock(mutex_);
    update_ = update;
    last_error_ = last_error;
    on_fraction_ = std::move(on_fraction);
    char* ours = text();
    const std::string configured = ours ? std::string(ours) : std::string();
    if (ours) {
      free_text(ours);
    }
    const Options now = Options::current();
    // PyTorch's defaults: the values c10 holds before any settings string.
    static const Options defaults = pytorch_defaults();
    std::string changes;
    for (size_t i = 0; i < now.values.size(); ++i) {
      const auto& [key, value] = now.values[i];
      if (value != defaults.values[i].second && !value.empty() &&
          configured.find(key + ":") == std::string::npos) {
        changes += (changes.empty() ? "" : ",") + key + ":" + value;
      }
    }
    const std::string fraction_key = "per_process_memory_fraction:";
    const size_t ours_at = configured.rfind(fraction_key);
    if (ours_at != std::string::npos) {
      on_fraction_(std::strtod(configured.c_str() + ours_at + fraction_key.size(), nullptr));
    }
    if (apply(changes, "PYTORCH_CUDA_ALLOC_CONF") && ours_at == std::string::npos &&
        now.fraction != defaults.fraction) {
      on_fraction_(now.fraction);
    }
    seen_ = now;
    auto& hook = c10::CachingAllocator::AcceleratorAllocatorConfig::getConfigParserHook();
    auto previous = hook;
    hook = [this, previous](const std::string& env) {
      if (previous) {
        previous(env);
      }
      on_settings_changed();
    };
  }

  // Called after PyTorch parsed a settings string.
  void on_settings_changed() {
    std::lock_guard<std::mutex> lock(mutex_);
    const Options now = Options::current();
    std::string changes;
    for (size_t i = 0; i < now.values.size(); ++i) {
      const auto& [key, value] = now.values[i];
      if (value != seen_.values[i].second && !value.empty()) {
        changes += (changes.empty() ? "" : ",") + key + ":" + value;
      }
    }
    if (apply(changes, "_set_allocator_settings") && now.fraction != seen_.fraction) {
      on_fraction_(now.fraction);
    }
    seen_ = now;
  }

  // Strings the library accepted, for tests and reports.
  int applied() const { return applied_; }

 private:
  // c10's values as its constructor leaves them (PyTorch's documented
  // defaults; c10 offers no way to read them once an environment is parsed).
  static Options pytorch_defaults() {
    const size_t intervals =
        c10::CachingAllocator::AcceleratorAllocatorConfig::roundup_power2_divisions().size();
    std::string no_divisions = "[";
    for (size_t i = 0; i < intervals && i < 64; ++i) {
      no_divisions += (i ? "," : "") + std::to_string(uint64_t{1} << i) + ":0";
    }
    Options o;
    o.values = {{"max_split_size_mb", std::to_string(std::numeric_limits<uint64_t>::max())},
                {"max_non_split_rounding_mb", "20"},
                {"roundup_power2_divisions", no_divisions + "]"},
                {"garbage_collection_threshold", ""},
                {"expandable_segments", "false"},
                {"graph_capture_record_stream_reuse", "false"},
                {"per_process_memory_fraction", std::to_string(1.0)}};
    o.fraction = 1.0;
    return o;
  }

  // Whether the library took `changes` (nothing to take counts as taken).
  bool apply(const std::string& changes, const char* source) {
    if (changes.empty()) {
      return true;
    }
    if (update_(changes.c_str()) < 0) {
      const char* e = last_error_();
      // A settings call cannot fail PyTorch's own parsing after the fact:
      // say what gpualloc could not take.
      TORCH_WARN("gpualloc: settings from ", source, " not applied (", changes,
                 "): ", e ? e : "unknown error");
      return false;
    }
    ++applied_;
    return true;
  }

  std::mutex mutex_;
  Update update_ = nullptr;
  LastError last_error_ = nullptr;
  OnFraction on_fraction_;
  Options seen_;
  int applied_ = 0;
};

}  // namespace gpu_alloc_bridge::settings
