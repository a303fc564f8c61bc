// The many-thread loops of mt_loops.h as a PyTorch extension (built by
// host_threads.py with torch.utils.cpp_extension, -O2), over:
//   torch   PyTorch's allocator: CUDACachingAllocator raw_alloc_with_stream /
//           raw_delete (with gpu_alloc.enable() in the process: the bridge)
//   async   cudaMallocAsync / cudaFreeAsync, the default pool kept
//   so      a pluggable-allocator .so (liballoc_ffi.so: gpualloc_malloc/free)
//   null    a function doing nothing, called as the .so is (the loop's cost)
//   empty   at::empty / the tensor's release: PyTorch's whole C++ path
// Each thread sets its device and its current stream, so `empty` runs on the
// same stream as the others.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "mt_loops.h"

namespace {

typedef void* (*alloc_fn)(ssize_t, int, cudaStream_t);
typedef void (*free_fn)(void*, ssize_t, int, cudaStream_t);

alloc_fn ext_alloc = nullptr;
free_fn ext_free = nullptr;
std::vector<std::vector<cudaStream_t>> streams;  // per device

char null_sink[64];
void* null_malloc(ssize_t, int, cudaStream_t) { return null_sink; }
void null_free(void*, ssize_t, int, cudaStream_t) {}

enum Kind { TORCH, ASYNC, SO, NUL, EMPTY };

Kind parse_kind(const std::string& k) {
  if (k == "torch") return TORCH;
  if (k == "async") return ASYNC;
  if (k == "so") return SO;
  if (k == "null") return NUL;
  if (k == "empty") return EMPTY;
  throw std::invalid_argument("unknown kind " + k);
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// One thread's allocator on its device and stream.
struct Backend {
  Kind kind;
  int device;
  cudaStream_t s;
  alloc_fn a;
  free_fn f;
  at::TensorOptions opts;

  void* alloc(size_t n) {
    void* p = nullptr;
    switch (kind) {
      case TORCH:
        return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(n, s);
      case ASYNC:
        return cudaMallocAsync(&p, n, s) == cudaSuccess ? p : nullptr;
      case EMPTY:
        return at::empty({(int64_t)n}, opts).unsafeReleaseTensorImpl();
      default:
        return a((ssize_t)n, device, s);
    }
  }
  void release(void* p, size_t n) {
    switch (kind) {
      case TORCH:
        c10::cuda::CUDACachingAllocator::raw_delete(p);
        break;
      case ASYNC:
        cudaFreeAsync(p, s);
        break;
      case EMPTY:
        // Takes back the reference released in alloc; the tensor goes with it.
        c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim(
            static_cast<c10::TensorImpl*>(p));
        break;
      default:
        f(p, (ssize_t)n, device, s);
    }
  }
};

bool load_so(const std::string& path, const std::string& a, const std::string& f) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) return false;
  ext_alloc = (alloc_fn)dlsym(h, a.c_str());
  ext_free = (free_fn)dlsym(h, f.c_str());
  return ext_alloc && ext_free;
}

// `n` non-blocking streams on each of devices 0..devices-1; the default
// pools of those devices keep their memory (as alloc_bench.cpp does).
void make_streams(int devices, int n) {
  streams.assign((size_t)devices, {});
  for (int d = 0; d < devices; d++) {
    check(cudaSetDevice(d), "cudaSetDevice");
    for (int i = 0; i < n; i++) {
      cudaStream_t s;
      check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      streams[(size_t)d].push_back(s);
    }
    cudaMemPool_t pool;
    check(cudaDeviceGetDefaultMemPool(&pool, d), "cudaDeviceGetDefaultMemPool");
    uint64_t keep = UINT64_MAX;
    check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep),
          "cudaMemPoolSetAttribute");
  }
  check(cudaSetDevice(0), "cudaSetDevice");
}

py::dict cell(const std::string& kind_name, bool mixed, int64_t size, int64_t lo, int64_t hi,
              int64_t max_live, bool with_zero, std::vector<int> device_of_thread, bool shared,
              double window_s, int64_t warm_calls, int64_t sample_every, bool bind_context) {
  Kind kind = parse_kind(kind_name);
  if (kind == SO && !ext_alloc) throw std::runtime_error("load_so first");
  int threads = (int)device_of_thread.size();
  for (int t = 0; t < threads; t++) {
    size_t d = (size_t)device_of_thread[(size_t)t];
    if (d >= streams.size() ||
        (size_t)mt::stream_index(device_of_thread, t, shared) >= streams[d].size())
      throw std::runtime_error("not enough streams: make_streams first");
  }
  mt::Cell c;
  c.w.mixed = mixed;
  c.w.size = size;
  c.w.lo = lo;
  c.w.hi = hi;
  c.w.max_live = max_live;
  c.w.with_zero = with_zero;
  c.threads = threads;
  c.window_s = window_s;
  c.warm_calls = warm_calls;
  c.sample_every = sample_every;
  std::function<Backend(int)> make = [&](int t) {
    int d = device_of_thread[(size_t)t];
    cudaStream_t s = streams[(size_t)d][(size_t)mt::stream_index(device_of_thread, t, shared)];
    // Unforced, c10's set_device skips cudaSetDevice when cudaGetDevice already names the
    // device, which a new thread's does for device 0: the thread then has no current
    // context, and every runtime call of PyTorch's path (cudaGetDevice in each
    // DeviceGuard) takes a driver lock to find one. A thread that has launched a kernel
    // has its context; forced, set_device calls cudaSetDevice, which makes it current.
    c10::cuda::set_device((c10::DeviceIndex)d, /*force=*/bind_context);
    c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromExternal(s, (c10::DeviceIndex)d));
    Backend b{kind, d, s, kind == NUL ? null_malloc : ext_alloc, kind == NUL ? null_free : ext_free,
              at::TensorOptions().dtype(at::kByte).device(at::Device(at::kCUDA, (c10::DeviceIndex)d))};
    return b;
  };
  mt::Result r;
  {
    py::gil_scoped_release nogil;
    r = mt::run<Backend>(c, make);
    for (size_t d = 0; d < streams.size(); d++) {
      cudaSetDevice((int)d);
      cudaDeviceSynchronize();
    }
    cudaSetDevice(0);
  }
  py::dict out;
  out["calls"] = r.calls;
  out["wall_ns"] = r.wall_ns;
  out["p50_ns"] = r.p50_ns;
  out["p99_ns"] = r.p99_ns;
  out["p999_ns"] = r.p999_ns;
  out["max_ns"] = r.max_ns;
  out["samples"] = r.samples;
  if (with_zero) {
    out["phase_p50_ns"] = std::vector<double>(r.phase_p50_ns, r.phase_p50_ns + mt::PHASES);
    out["phase_samples"] = std::vector<uint64_t>(r.phase_samples, r.phase_samples + mt::PHASES);
  }
  out["failed_threads"] = r.failed_threads;
  out["error"] = r.error;
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("load_so", &load_so);
  m.def("make_streams", &make_streams);
  m.def("clock_pair_ns", &mt::clock_pair_ns);
  m.def("cell", &cell);
}
