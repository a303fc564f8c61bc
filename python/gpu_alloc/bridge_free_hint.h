// The device a free names to the library, found without a CUDA call.
//
// A tensor's deleter gets only the pointer; the library finds the device that
// owns it either way (a wrong device costs a look at the others), but a right
// one saves that look. Asking the runtime (cudaGetDevice) on every free made
// the bridge's free several times PyTorch's own, which makes no runtime call,
// on threads where the runtime's answer is slow (docs/benchmarks.md, "The
// allocator's share of at::empty, measured"). So each thread remembers the
// device of its last allocation through the bridge, and asks the runtime only
// for its first free when it has allocated nothing (autograd's threads free
// what others made). A thread that allocates on several devices names the last
// one; a free of another device's block then costs the library's search (one
// lookup under each other device's lock), as a free named with the thread's
// current device did whenever that was not the block's.

#pragma once

#include <c10/macros/Macros.h>
#include <cuda_runtime_api.h>

namespace gpu_alloc_bridge::free_hint {

// This thread's hint; -1 until it allocates or frees.
inline thread_local int device = -1;

// Called with the device of every allocation the bridge hands out.
inline void on_alloc(int d) { device = d; }

// The device to name for a free on this thread.
inline int for_free() {
  if (C10_LIKELY(device >= 0)) {
    return device;
  }
  int d = 0;
  (void)cudaGetDevice(&d);
  device = d;
  return d;
}

}  // namespace gpu_alloc_bridge::free_hint
