// The gpualloc_* functions the bridge (bridge.cpp) calls, as pointers
// resolved from the library it opens with dlopen. Each pointer's type is
// decltype(&gpualloc_name) of gpualloc.h, the header generated from the
// library's Rust source and shipped next to this file, so the compiler
// checks every call against the one declaration of the C interface.
//
// Needs neither torch nor CUDA (gpualloc.h declares cudaStream_t when
// CUDA's headers are not included first), so the package's CPU tests compile
// it alone and resolve it against the built library.

#pragma once

#include <dlfcn.h>

#include "gpualloc.h"

namespace gpu_alloc_bridge {

// X(name) for every gpualloc_name the bridge uses.
#define GPU_ALLOC_BRIDGE_FUNCTIONS(X) \
  X(malloc_in_pool)                   \
  X(free)                             \
  X(empty_cache)                      \
  X(set_memory_fraction)              \
  X(record_stream)                    \
  X(reset_peak_stats)                 \
  X(reset_accumulated_stats)          \
  X(device_stats)                     \
  X(snapshot_text)                    \
  X(string_free)                      \
  X(begin_allocate_to_pool)           \
  X(end_allocate_to_pool)             \
  X(retain_pool)                      \
  X(release_pool)                     \
  X(pool_use_count)                   \
  X(set_pool_no_split)                \
  X(set_pool_allocator)               \
  X(checkpoint_pool)                  \
  X(pool_checkpoint_free)             \
  X(restore_pool)                     \
  X(u64_array_free)                   \
  X(pool_live_allocations_are)        \
  X(last_error)                       \
  X(last_error_code)                  \
  X(set_segment_callback)             \
  X(block_segment)                    \
  X(export_pages)                     \
  X(update_settings)                  \
  X(empty_pool_cache)                 \
  X(settings_text)

// The functions, once resolve() succeeded: api.name is gpualloc_name.
struct Api {
#define GPU_ALLOC_BRIDGE_POINTER(name) decltype(&gpualloc_##name) name = nullptr;
  GPU_ALLOC_BRIDGE_FUNCTIONS(GPU_ALLOC_BRIDGE_POINTER)
#undef GPU_ALLOC_BRIDGE_POINTER

  // Resolves every function from `lib` (a dlopen handle). Returns nullptr,
  // or the name of the first symbol the library lacks (an older library).
  const char* resolve(void* lib) {
#define GPU_ALLOC_BRIDGE_RESOLVE(name)                                            \
  name = reinterpret_cast<decltype(&gpualloc_##name)>(dlsym(lib, "gpualloc_" #name)); \
  if (name == nullptr) {                                                          \
    return "gpualloc_" #name;                                                     \
  }
    GPU_ALLOC_BRIDGE_FUNCTIONS(GPU_ALLOC_BRIDGE_RESOLVE)
#undef GPU_ALLOC_BRIDGE_RESOLVE
    return nullptr;
  }
};

}  // namespace gpu_alloc_bridge
