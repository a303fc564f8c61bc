// Does the way device memory is mapped change how fast kernels use it?
// The same N bytes of device 0 are provided in several mapping shapes, each
// its own buffer:
//   cuMemAlloc          what cudaMalloc gives (PyTorch's default segments);
//   vmm_2m, vmm_20m     one reserved range mapped with physical allocations
//                       of 2 MiB / 20 MiB each (PyTorch's expandable
//                       segments: small pool / large pool);
//   vmm_16m, vmm_64m    16 MiB each (gpualloc's budget setting, large pool),
//                       64 MiB each;
//   vmm_whole           one physical allocation for the whole range;
//   vmm_2m_shuffled,    pages created in a shuffled order of their addresses,
//   vmm_16m_shuffled    so that neighbouring addresses lie far apart in
//                       physical memory (what a caching allocator that has
//                       unmapped and remapped pages for hours ends up with);
//   vmm_2m_interleaved  pages created alternately with another range's,
//                       which is then released: every other physical 2 MiB
//                       of the run is a hole (if the driver places pages
//                       in the order they are made).
// Pages are mapped as the allocator maps them: exportable as POSIX file
// descriptors where the driver allows it, the range aligned to its page when
// the page is a power of two, one cuMemSetAccess over the range.
//
// It then times, with CUDA events, kernels whose speed depends on address
// translation:
//   copy    streaming read + write, the buffer's first half to its second;
//   gather  each thread follows a chain of 4-byte reads at pseudo-random
//           words over the whole buffer, each address made from the word
//           read before (translation latency on the critical path; a wrong
//           read sends the chain elsewhere and changes the checksum);
//   stride  4-byte reads 2 MiB + 64 B apart: every access in a new 2 MiB region.
// Warm-ups first, then repetitions; within one, every kernel runs on every
// shape in turn (round robin, starting one shape later each repetition).
// Every gather and stride sum is checked against the one computed on the
// host; any difference makes the exit status 1.
//
// Build and run on the GPU machine:
//   nvcc -O2 -std=c++17 -arch=sm_90 -o /tmp/vmm_access benchmarks/vmm_cost/vmm_access.cu -lcuda
//   /tmp/vmm_access [MIB] [REPS]   # buffer MiB (default 4096), repetitions (20)
// Prints one JSON object a line: a header, one "setup" line per shape, one
// line per (shape, kernel) with the median, mean and min milliseconds over
// the repetitions and their ratios to the cuMemAlloc shape's, and one
// "check" line per summed kernel.
#include "vmm_common.h"
#include <cstdint>
#include <numeric>
#include <random>

// The runtime's counterpart of CK, for kernel launches.
#define CKR(x)                                                                          \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

static const size_t kMiB = size_t(1) << 20;
static const int kBlockThreads = 256;
static const int kBlocksPerSm = 8;  // 2048 threads: a full SM on sm_90
static const int kGatherSteps = 256;
static const int kStrideSteps = 256;
static const uint64_t kStride = 2 * kMiB + 64;
static const int kWarmups = 3;

// splitmix64's finalizer: the fill pattern and the gather's addresses.
__host__ __device__ inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// x scaled to [0, n): the high half of the 128-bit product.
__host__ __device__ inline uint64_t scale(uint64_t x, uint64_t n) {
#ifdef __CUDA_ARCH__
  return __umul64hi(x, n);
#else
  return uint64_t((unsigned __int128)x * n >> 64);
#endif
}

// The word at index w of every buffer once the first copy has run: both
// halves hold the same words, so later copies change nothing.
__host__ __device__ inline uint32_t pattern(uint64_t w, uint64_t half_words) {
  return uint32_t(mix64(w % half_words));
}

__device__ inline uint64_t thread_index() {
  return blockIdx.x * uint64_t(blockDim.x) + threadIdx.x;
}

// Adds every thread's acc to *sum, one atomic per warp (all lanes active).
__device__ inline void add_to(unsigned long long* sum, unsigned long long acc) {
  for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
  if ((threadIdx.x & 31) == 0) atomicAdd(sum, acc);
}

// The pattern in the first half, zeros in the second: the copy fills it.
__global__ void fill(uint32_t* p, uint64_t words) {
  const uint64_t half = words / 2;
  for (uint64_t w = thread_index(); w < words; w += uint64_t(gridDim.x) * blockDim.x)
    p[w] = w < half ? pattern(w, half) : 0u;
}

// Streaming: the buffer's first half into its second, 16 bytes a thread a step.
__global__ void copy_half(uint4* p, uint64_t half_vecs) {
  const uint4* a = p;
  uint4* b = p + half_vecs;
  for (uint64_t i = thread_index(); i < half_vecs; i += uint64_t(gridDim.x) * blockDim.x)
    b[i] = a[i];
}

// A chain of `steps` dependent reads a thread at pseudo-random words of the
// whole buffer; their sum goes to *sum.
__global__ void gather(const uint32_t* p, uint64_t words, int steps, unsigned long long* sum) {
  uint64_t x = mix64(thread_index());
  unsigned long long acc = 0;
  for (int k = 0; k < steps; k++) {
    const uint32_t v = p[scale(x, words)];
    acc += v;
    x = mix64(x ^ v);
  }
  add_to(sum, acc);
}

// `steps` reads a thread, `stride` bytes apart across the threads (a warp's
// 32 reads in 32 different 2 MiB regions), wrapping at the buffer's end; sum to *sum.
__global__ void strided(const uint32_t* p, uint64_t bytes, uint64_t stride, int steps,
                        unsigned long long* sum) {
  // Read k is at (t + k * threads) * stride % bytes, stepped without a
  // division in the loop.
  const uint64_t step = uint64_t(gridDim.x) * blockDim.x * stride % bytes;
  uint64_t at = thread_index() * stride % bytes;
  unsigned long long acc = 0;
  for (int k = 0; k < steps; k++) {
    acc += p[at / 4];
    at += step;
    if (at >= bytes) at -= bytes;
  }
  add_to(sum, acc);
}

// What `gather` and `strided` must sum to, computed on the host.
static uint64_t expect_gather(uint64_t threads, uint64_t words, int steps) {
  uint64_t sum = 0;
  for (uint64_t t = 0; t < threads; t++) {
    uint64_t x = mix64(t);
    for (int k = 0; k < steps; k++) {
      const uint32_t v = pattern(scale(x, words), words / 2);
      sum += v;
      x = mix64(x ^ v);
    }
  }
  return sum;
}

static uint64_t expect_stride(uint64_t threads, uint64_t bytes, uint64_t stride, int steps) {
  uint64_t sum = 0;
  for (uint64_t j = 0; j < threads * steps; j++) sum += pattern(j * stride % bytes / 4, bytes / 8);
  return sum;
}

// How a shape's physical pages are made and placed.
enum class Layout { kDriverAlloc, kInOrder, kShuffled, kInterleaved };

// A mapping shape: page_mib 0 is one physical allocation for the whole range.
struct Shape {
  const char* name;
  size_t page_mib;
  Layout layout;
};

// Makes physical allocations as the allocator does: exportable as a POSIX
// file descriptor, or plain from the first time the driver refuses that.
struct PageMaker {
  CUmemAllocationProp prop;
  bool exportable;

  CUmemGenericAllocationHandle create(size_t size) {
    CUmemGenericAllocationHandle h;
    if (exportable) {
      if (cuMemCreate(&h, size, &prop, 0) == CUDA_SUCCESS) return h;
      exportable = false;
      prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    }
    CK(cuMemCreate(&h, size, &prop, 0));
    return h;
  }
};

// One buffer of at least the bytes asked for, in one mapping shape: its
// address range and the physical allocations mapped there (none for
// cuMemAlloc), all freed by release().
struct Buffer {
  Shape shape;
  CUdeviceptr ptr = 0;
  size_t size = 0, page = 0;
  std::vector<CUmemGenericAllocationHandle> pages;  // by address
  double setup_ms = 0;

  Buffer(const Shape& s, size_t bytes, PageMaker& maker, const CUmemAccessDesc& access)
      : shape(s) {
    const double t0 = now_us();
    if (s.layout == Layout::kDriverAlloc) {
      CK(cuMemAlloc(&ptr, bytes));
      size = bytes;
    } else {
      map(bytes, maker, access);
    }
    setup_ms = (now_us() - t0) / 1e3;
  }

  static size_t mapped_bytes(const Shape& s, size_t bytes) {
    const size_t page = s.page_mib ? s.page_mib * kMiB : bytes;
    return (bytes + page - 1) / page * page;
  }

  void map(size_t bytes, PageMaker& maker, const CUmemAccessDesc& access) {
    page = shape.page_mib ? shape.page_mib * kMiB : bytes;
    size = mapped_bytes(shape, bytes);
    const size_t n = size / page;
    const bool pow2 = (page & (page - 1)) == 0;
    CK(cuMemAddressReserve(&ptr, size, pow2 ? page : 0, 0, 0));
    // Pages are made one after the other, which the driver is expected to
    // place one after the other in physical memory; the slot each new page
    // is mapped at decides whether neighbouring addresses stay neighbours.
    std::vector<size_t> slot(n);
    std::iota(slot.begin(), slot.end(), 0);
    if (shape.layout == Layout::kShuffled)
      std::shuffle(slot.begin(), slot.end(), std::mt19937_64(42));
    pages.resize(n);
    std::vector<CUmemGenericAllocationHandle> others;
    for (size_t i = 0; i < n; i++) {
      pages[slot[i]] = maker.create(page);
      CK(cuMemMap(ptr + slot[i] * page, page, 0, pages[slot[i]], 0));
      if (shape.layout == Layout::kInterleaved) others.push_back(maker.create(page));
    }
    CK(cuMemSetAccess(ptr, size, &access, 1));
    for (auto h : others) CK(cuMemRelease(h));
  }

  void release() {
    if (pages.empty()) {
      CK(cuMemFree(ptr));
      return;
    }
    CK(cuMemUnmap(ptr, size));
    for (auto h : pages) CK(cuMemRelease(h));
    CK(cuMemAddressFree(ptr, size));
  }
};

// Median, mean and min of one (shape, kernel)'s milliseconds.
struct Stats {
  double median, mean, min;
};

static Stats stats(const std::vector<double>& v) {
  return {median(v), std::accumulate(v.begin(), v.end(), 0.0) / v.size(),
          *std::min_element(v.begin(), v.end())};
}

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? strtoull(argv[1], nullptr, 10) : 4096;
  const int reps = argc > 2 ? atoi(argv[2]) : 20;
  if (mib < 2 || mib % 2 != 0 || reps < 1) {
    fprintf(stderr, "usage: %s [MIB: even, >= 2] [REPS: >= 1]\n", argv[0]);
    return 2;
  }
  const size_t bytes = mib * kMiB;
  const uint64_t words = bytes / 4;

  Device0 d = open_device0();
  PageMaker maker{d.prop, true};
  maker.prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran = 0;
  CK(cuMemGetAllocationGranularity(&gran, &maker.prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  if ((2 * kMiB) % gran != 0) {
    fprintf(stderr, "granularity %zu does not divide 2 MiB\n", gran);
    return 1;
  }

  const Shape shapes[] = {
      {"cuMemAlloc", 0, Layout::kDriverAlloc},  // the reference: first
      {"vmm_2m", 2, Layout::kInOrder},
      {"vmm_20m", 20, Layout::kInOrder},
      {"vmm_16m", 16, Layout::kInOrder},
      {"vmm_64m", 64, Layout::kInOrder},
      {"vmm_whole", 0, Layout::kInOrder},
      {"vmm_2m_shuffled", 2, Layout::kShuffled},
      {"vmm_16m_shuffled", 16, Layout::kShuffled},
      {"vmm_2m_interleaved", 2, Layout::kInterleaved},
  };
  const int ns = sizeof(shapes) / sizeof(shapes[0]);
  const char* layouts[] = {"driver", "in_order", "shuffled", "interleaved"};

  // Everything at once, plus the interleaved shape's other range while it
  // is made, plus room for the context.
  size_t need = bytes + kMiB * 1024, free_b = 0, total_b = 0;
  for (const Shape& s : shapes) need += Buffer::mapped_bytes(s, bytes);
  CK(cuMemGetInfo(&free_b, &total_b));
  if (need > free_b) {
    fprintf(stderr, "needs %zu MiB, %zu MiB free: ask for fewer MiB\n", need >> 20, free_b >> 20);
    return 1;
  }

  int sms = 0;
  CK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, d.dev));
  const int blocks = sms * kBlocksPerSm;
  const uint64_t threads = uint64_t(blocks) * kBlockThreads;
  printf("{\"mib\": %zu, \"reps\": %d, \"warmups\": %d, \"sms\": %d, \"threads\": %llu, "
         "\"copy_bytes_read\": %zu, \"gather_reads\": %llu, \"stride_reads\": %llu, "
         "\"stride_bytes\": %llu}\n",
         mib, reps, kWarmups, sms, (unsigned long long)threads, bytes / 2,
         (unsigned long long)(threads * kGatherSteps), (unsigned long long)(threads * kStrideSteps),
         (unsigned long long)kStride);
  fflush(stdout);

  std::vector<Buffer> bufs;
  for (const Shape& s : shapes) {
    bufs.emplace_back(s, bytes, maker, d.access);
    const Buffer& b = bufs.back();
    fill<<<blocks, kBlockThreads>>>(reinterpret_cast<uint32_t*>(b.ptr), words);
    CKR(cudaGetLastError());
    printf("{\"setup\": \"%s\", \"layout\": \"%s\", \"page_mib\": %zu, \"pages\": %zu, "
           "\"mapped_mib\": %zu, \"base_align_mib\": %llu, \"exportable\": %s, "
           "\"setup_ms\": %.1f}\n",
           s.name, layouts[int(s.layout)], b.page >> 20, b.pages.size(), b.size >> 20,
           (unsigned long long)((b.ptr & (~b.ptr + 1)) >> 20),
           b.pages.empty() ? "null" : (maker.exportable ? "true" : "false"), b.setup_ms);
    fflush(stdout);
  }
  CK(cuCtxSynchronize());

  const uint64_t expected[] = {0, expect_gather(threads, words, kGatherSteps),
                               expect_stride(threads, bytes, kStride, kStrideSteps)};
  const char* kernels[] = {"copy", "gather", "stride"};
  const int nk = 3;

  CUstream stream;
  CK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  CUevent start, stop;
  CK(cuEventCreate(&start, CU_EVENT_DEFAULT));
  CK(cuEventCreate(&stop, CU_EVENT_DEFAULT));
  CUdeviceptr sum_d;
  CK(cuMemAlloc(&sum_d, sizeof(unsigned long long)));
  auto* sum = reinterpret_cast<unsigned long long*>(sum_d);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);

  std::vector<std::vector<std::vector<double>>> ms(ns, std::vector<std::vector<double>>(nk));
  std::vector<std::vector<uint64_t>> last(ns, std::vector<uint64_t>(nk, 0));
  std::vector<std::vector<int>> wrong(ns, std::vector<int>(nk, 0));
  for (int rep = -kWarmups; rep < reps; rep++) {
    for (int k = 0; k < nk; k++) {
      for (int i = 0; i < ns; i++) {
        const int s = (i + rep + kWarmups) % ns;
        auto* p = reinterpret_cast<uint32_t*>(bufs[s].ptr);
        CK(cuMemsetD32Async(sum_d, 0, 2, stream));
        CK(cuEventRecord(start, stream));
        if (k == 0)
          copy_half<<<blocks, kBlockThreads, 0, st>>>(reinterpret_cast<uint4*>(p), bytes / 32);
        else if (k == 1)
          gather<<<blocks, kBlockThreads, 0, st>>>(p, words, kGatherSteps, sum);
        else
          strided<<<blocks, kBlockThreads, 0, st>>>(p, bytes, kStride, kStrideSteps, sum);
        CKR(cudaGetLastError());
        CK(cuEventRecord(stop, stream));
        CK(cuEventSynchronize(stop));
        float t = 0;
        CK(cuEventElapsedTime(&t, start, stop));
        if (rep >= 0) ms[s][k].push_back(t);
        if (k > 0) {
          CK(cuMemcpyDtoH(&last[s][k], sum_d, sizeof(uint64_t)));
          if (last[s][k] != expected[k]) wrong[s][k]++;
        }
      }
    }
  }

  for (int k = 0; k < nk; k++) {
    const Stats ref = stats(ms[0][k]);
    for (int s = 0; s < ns; s++) {
      const Stats x = stats(ms[s][k]);
      printf("{\"shape\": \"%s\", \"kernel\": \"%s\", \"reps\": %d, \"median_ms\": %.4f, "
             "\"mean_ms\": %.4f, \"min_ms\": %.4f, \"ratio_median\": %.4f, \"ratio_mean\": %.4f, "
             "\"ratio_min\": %.4f",
             shapes[s].name, kernels[k], reps, x.median, x.mean, x.min, x.median / ref.median,
             x.mean / ref.mean, x.min / ref.min);
      if (k > 0)
        printf(", \"checksum\": %llu, \"wrong_sums\": %d", (unsigned long long)last[s][k],
               wrong[s][k]);
      printf("}\n");
    }
  }
  bool ok = true;
  for (int k = 1; k < nk; k++) {
    int bad = 0;
    for (int s = 0; s < ns; s++) bad += wrong[s][k] > 0;
    printf("{\"check\": \"%s\", \"expected\": %llu, \"shapes_wrong\": %d}\n", kernels[k],
           (unsigned long long)expected[k], bad);
    ok = ok && bad == 0;
  }

  CK(cuMemFree(sum_d));
  CK(cuEventDestroy(start));
  CK(cuEventDestroy(stop));
  CK(cuStreamDestroy(stream));
  for (Buffer& b : bufs) b.release();
  CK(cuDevicePrimaryCtxRelease(d.dev));
  if (!ok) fprintf(stderr, "a gather or stride sum differs from the host's\n");
  return ok ? 0 : 1;
}
