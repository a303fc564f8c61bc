// The many-thread loops of mt_loops.h without PyTorch, for host_threads.py
// --null-driver: the C library (any .so with the pluggable-allocator
// signature) and the null allocator, on streams made with the CUDA driver
// API (libcuda.so.1 opened at run time: the real driver, or the null driver
// of crates/alloc-cuda/null-driver, which does no device work). Loaded with
// ctypes; every entry point returns 0 on success, else -1 with a message in
// mt_error().
//
// Build: g++ -O2 -std=c++17 -shared -fPIC -pthread -o libmt_cpu.so mt_cpu.cpp -ldl
#include <dlfcn.h>

#include <cstring>
#include <string>
#include <vector>

#include "mt_loops.h"

namespace {

typedef void* (*alloc_fn)(ssize_t, int, void*);
typedef void (*free_fn)(void*, ssize_t, int, void*);
typedef int (*cu_init_fn)(unsigned);
typedef int (*cu_device_get_fn)(int*, int);
typedef int (*cu_retain_fn)(void**, int);
typedef int (*cu_set_current_fn)(void*);
typedef int (*cu_stream_create_fn)(void**, unsigned);

alloc_fn ext_alloc = nullptr;
free_fn ext_free = nullptr;
std::vector<std::vector<void*>> streams;  // per device
std::string last_error;

char null_sink[64];
void* null_malloc(ssize_t, int, void*) { return null_sink; }
void null_free(void*, ssize_t, int, void*) {}

// A pluggable-allocator .so (or the null one) on one device and stream.
struct Pluggable {
  alloc_fn a;
  free_fn f;
  int device;
  void* stream;
  void* alloc(size_t n) { return a((ssize_t)n, device, stream); }
  void release(void* p, size_t n) { f(p, (ssize_t)n, device, stream); }
};

int error(std::string why) {
  last_error = std::move(why);
  return -1;
}

}  // namespace

extern "C" {

// The message of the last failure.
const char* mt_error() { return last_error.c_str(); }

// Opens `path` and takes its alloc and free entry points.
int mt_load(const char* path, const char* alloc_sym, const char* free_sym) {
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) return error(dlerror());
  ext_alloc = (alloc_fn)dlsym(h, alloc_sym);
  ext_free = (free_fn)dlsym(h, free_sym);
  if (!ext_alloc || !ext_free) return error(std::string("missing symbols in ") + path);
  return 0;
}

// Makes `n` non-blocking streams on each of devices 0..devices-1 (in their
// primary contexts, which the allocators use).
int mt_make_streams(int devices, int n) {
  void* cu = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!cu) return error(dlerror());
  auto init = (cu_init_fn)dlsym(cu, "cuInit");
  auto get = (cu_device_get_fn)dlsym(cu, "cuDeviceGet");
  auto retain = (cu_retain_fn)dlsym(cu, "cuDevicePrimaryCtxRetain");
  auto set = (cu_set_current_fn)dlsym(cu, "cuCtxSetCurrent");
  auto create = (cu_stream_create_fn)dlsym(cu, "cuStreamCreate");
  if (!init || !get || !retain || !set || !create) return error("libcuda.so.1 lacks an entry point");
  if (init(0) != 0) return error("cuInit failed");
  streams.assign((size_t)devices, {});
  for (int d = 0; d < devices; d++) {
    int dev = 0;
    void* ctx = nullptr;
    if (get(&dev, d) != 0 || retain(&ctx, dev) != 0 || set(ctx) != 0)
      return error("cannot make device " + std::to_string(d) + "'s primary context current");
    for (int i = 0; i < n; i++) {
      void* s = nullptr;
      if (create(&s, 1 /* CU_STREAM_NON_BLOCKING */) != 0) return error("cuStreamCreate failed");
      streams[(size_t)d].push_back(s);
    }
  }
  return 0;
}

// Median cost of the two clock reads around a sampled call.
double mt_clock_pair_ns() { return mt::clock_pair_ns(); }

// One cell: backend 0 = the loaded .so, 1 = the null allocator.
// device_of_thread[t] is thread t's device; shared: all threads of a device
// on its first stream; with_zero: pairs of 0 bytes between (mt_loops.h).
// out (8 + 2 x mt::PHASES values): calls, wall ns, p50, p99, p99.9, max ns, samples,
// failed threads, then with_zero's median and sample count of each phase.
int mt_cell(int backend, int mixed, int64_t size, int64_t lo, int64_t hi, int64_t max_live,
            int with_zero, int threads, const int* device_of_thread, int shared,
            double window_s, int64_t warm_calls, int64_t sample_every, double* out) {
  if (backend == 0 && !ext_alloc) return error("mt_load first");
  std::vector<int> devs(device_of_thread, device_of_thread + threads);
  for (int t = 0; t < threads; t++) {
    size_t d = (size_t)devs[(size_t)t];
    if (d >= streams.size() || (size_t)mt::stream_index(devs, t, shared != 0) >= streams[d].size())
      return error("not enough streams: mt_make_streams first");
  }
  mt::Cell c;
  c.w.mixed = mixed != 0;
  c.w.size = size;
  c.w.lo = lo;
  c.w.hi = hi;
  c.w.max_live = max_live;
  c.w.with_zero = with_zero != 0;
  c.threads = threads;
  c.window_s = window_s;
  c.warm_calls = warm_calls;
  c.sample_every = sample_every;
  alloc_fn a = backend == 0 ? ext_alloc : null_malloc;
  free_fn f = backend == 0 ? ext_free : null_free;
  std::function<Pluggable(int)> make = [&](int t) {
    int d = devs[(size_t)t];
    return Pluggable{a, f, d, streams[(size_t)d][(size_t)mt::stream_index(devs, t, shared != 0)]};
  };
  mt::Result r = mt::run<Pluggable>(c, make);
  double v[8 + 2 * mt::PHASES] = {(double)r.calls, r.wall_ns, r.p50_ns, r.p99_ns, r.p999_ns,
                                  r.max_ns, (double)r.samples, (double)r.failed_threads};
  for (int k = 0; k < mt::PHASES; k++) {
    v[8 + k] = r.phase_p50_ns[k];
    v[8 + mt::PHASES + k] = (double)r.phase_samples[k];
  }
  std::memcpy(out, v, sizeof v);
  if (r.failed_threads) last_error = r.error;
  return 0;
}

}  // extern "C"
