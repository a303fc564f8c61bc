// CUDA IPC for the bridge (bridge.cpp): sharing gpualloc's blocks with other
// processes, and opening what other processes share, in the handle format of
// PyTorch 2.11's CUDACachingAllocator, byte for byte, so that a tensor sent
// by torch.multiprocessing opens whether either side runs gpualloc or
// PyTorch's allocator.
//
// The handle (ShareableHandle::handle) is a version byte (2), a type byte and
// a payload; ShareableHandle::offset is the block's offset in what is shared:
//   'c'  a cuMemAlloc segment: the 64-byte cudaIpcMemHandle_t of the
//        segment's base; offset = block - base.
//   'e'  pages of an expandable segment: struct ShareHeader { pid_t pid;
//        size_t segment_size; size_t num_handles; } (native layout, 24 bytes)
//        and num_handles ints, POSIX file descriptors in the sender's fd
//        table, one per page of segment_size bytes covering the block;
//        offset = block - first page. The receiver duplicates them with
//        pidfd_getfd, so the descriptors stay open in the sender (gpualloc
//        keeps each until its page's memory is released).
// A 64-byte handle with no header comes from a PyTorch older than the
// versioned format and is a 'c' handle. A received 'e' handle whose payload
// has 64 bytes per page carries fabric handles (a PyTorch sender where
// CU_MEM_HANDLE_TYPE_FABRIC works); they are imported as such.
//
// The receiver keeps one mapping per handle string while anything uses it
// (PyTorch's ipcMemHandle_to_devptr) and releases it when the last user goes:
// cudaIpcCloseMemHandle, or a device synchronize then cuMemUnmap,
// cuMemRelease and cuMemAddressFree. Driver functions are resolved through the
// runtime (cudaGetDriverEntryPoint[ByVersion]), so the extension links no
// libcuda.
//
// Limits: an 'e' handle needs pidfd_open / pidfd_getfd (Linux 5.6) and ptrace
// permission over the sender (kernel.yama.ptrace_scope 0, or the sender
// allowing the receiver with prctl(PR_SET_PTRACER, ...), or CAP_SYS_PTRACE);
// received memory is made accessible to the receiving device only (no peers).

#pragma once

#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "gpualloc.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace gpu_alloc_bridge {
namespace ipc {

// PyTorch's SHAREABLE_HANDLE_VERSION and ShareableHandleType.
constexpr char kHandleVersion = 2;
constexpr char kCudaMalloc = 'c';
constexpr char kExpandable = 'e';
constexpr size_t kIpcHandleSize = 64;     // CUDA_IPC_HANDLE_SIZE
constexpr size_t kFabricHandleSize = 64;  // sizeof(CUmemFabricHandle)
constexpr auto kFabricHandleType = static_cast<CUmemAllocationHandleType>(0x8);

// PyTorch's ExpandableSegment ShareHeader, in the same native layout.
struct ShareHeader {
  pid_t pid;
  size_t segment_size;
  size_t num_handles;
};
static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleSize, "cudaIpcMemHandle_t is 64 bytes");

// ------------------------------------------------------------------ sender

// The library functions the sender uses, typed by gpualloc.h.
struct Library {
  decltype(&gpualloc_block_segment) block_segment;
  decltype(&gpualloc_export_pages) export_pages;
  decltype(&gpualloc_last_error) last_error;
};

inline void check_library(const Library& lib, int code, const char* what) {
  if (code >= 0) {
    return;
  }
  const char* e = lib.last_error ? lib.last_error() : nullptr;
  TORCH_CHECK(false, "gpu_alloc: ", what, " failed: ", e ? e : "unknown error");
}

inline int current_device_or_any() {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    device = -1;  // the library searches every device
  }
  return device;
}

// getBaseAllocation: what is shared for the block at `ptr` (its cuMemAlloc
// segment, or the pages of an expandable segment that cover it).
inline void* base_allocation(const Library& lib, void* ptr, size_t* size) {
  uint64_t base = 0, bytes = 0;
  int expandable = 0;
  check_library(lib,
                lib.block_segment(ptr, current_device_or_any(), &base, &bytes, &expandable),
                "getBaseAllocation (gpualloc_block_segment)");
  if (size != nullptr) {
    *size = static_cast<size_t>(bytes);
  }
  return reinterpret_cast<void*>(static_cast<uintptr_t>(base));
}

// shareIpcHandle: the handle and offset of the block at `ptr`.
inline c10::cuda::CUDACachingAllocator::ShareableHandle share_handle(const Library& lib,
                                                                      void* ptr) {
  int device = current_device_or_any();
  uint64_t base = 0, bytes = 0;
  int expandable = 0;
  check_library(lib, lib.block_segment(ptr, device, &base, &bytes, &expandable),
                "shareIpcHandle (gpualloc_block_segment)");
  const auto at = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptr));
  std::string out;
  out.push_back(kHandleVersion);
  if (!expandable) {
    out.push_back(kCudaMalloc);
    cudaIpcMemHandle_t handle;
    C10_CUDA_CHECK(
        cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(base))));
    out.append(reinterpret_cast<const char*>(&handle), kIpcHandleSize);
    return {static_cast<ptrdiff_t>(at - base), out};
  }
  uint64_t first = 0, page = 0;
  size_t n = 0;
  check_library(lib, lib.export_pages(ptr, device, &first, &page, nullptr, 0, &n),
                "shareIpcHandle (gpualloc_export_pages)");
  std::vector<int> fds(n);
  check_library(lib, lib.export_pages(ptr, device, &first, &page, fds.data(), n, &n),
                "shareIpcHandle (gpualloc_export_pages)");
  ShareHeader header;
  std::memset(&header, 0, sizeof(header));  // padding too: equal shares, equal strings
  header.pid = getpid();
  header.segment_size = static_cast<size_t>(page);
  header.num_handles = n;
  out.push_back(kExpandable);
  out.append(reinterpret_cast<const char*>(&header), sizeof(header));
  out.append(reinterpret_cast<const char*>(fds.data()), n * sizeof(int));
  return {static_cast<ptrdiff_t>(at - first), out};
}

// ------------------------------------------------------------------ receiver

// The driver functions the receiver calls, from the runtime's entry points.
struct Driver {
  CUresult (*mem_import)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType);
  CUresult (*address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*address_free)(CUdeviceptr, size_t);
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*release)(CUmemGenericAllocationHandle);
  CUresult (*error_string)(CUresult, const char**);
};

template <typename F>
void driver_symbol(const char* name, F& fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  cudaError_t err = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found);
#else
  cudaError_t err = cudaGetDriverEntryPoint(name, &p, cudaEnableDefault, &found);
#endif
  TORCH_CHECK(err == cudaSuccess && found == cudaDriverEntryPointSuccess && p != nullptr,
              "gpu_alloc: CUDA IPC needs the driver function ", name,
              ", which the CUDA runtime could not resolve (", cudaGetErrorString(err), ")");
  fn = reinterpret_cast<F>(p);
}

inline const Driver& driver() {
  static const Driver d = [] {
    Driver x{};
    driver_symbol("cuMemImportFromShareableHandle", x.mem_import);
    driver_symbol("cuMemAddressReserve", x.address_reserve);
    driver_symbol("cuMemAddressFree", x.address_free);
    driver_symbol("cuMemMap", x.map);
    driver_symbol("cuMemUnmap", x.unmap);
    driver_symbol("cuMemSetAccess", x.set_access);
    driver_symbol("cuMemRelease", x.release);
    driver_symbol("cuGetErrorString", x.error_string);
    return x;
  }();
  return d;
}

inline std::string driver_error(CUresult r) {
  const char* s = nullptr;
  if (driver().error_string(r, &s) != CUDA_SUCCESS || s == nullptr) {
    return "CUresult " + std::to_string(static_cast<int>(r));
  }
  return std::string(s) + " (" + std::to_string(static_cast<int>(r)) + ")";
}

#define GPU_ALLOC_IPC_DRIVER_CHECK(call, what)                                         \
  do {                                                                                 \
    CUresult gpu_alloc_ipc_r = (call);                                                 \
    TORCH_CHECK(gpu_alloc_ipc_r == CUDA_SUCCESS, "gpu_alloc: getIpcDevPtr: ", what, \
                " failed: ", ::gpu_alloc_bridge::ipc::driver_error(gpu_alloc_ipc_r));  \
  } while (0)

// One received handle, opened in this process.
struct Opened {
  int device = -1;
  void* ipc_ptr = nullptr;  // 'c': from cudaIpcOpenMemHandle
  // 'e': the reserved range and the imported pages mapped into it.
  CUdeviceptr va = 0;
  size_t page = 0;
  size_t reserved = 0;
  size_t mapped = 0;
  std::vector<CUmemGenericAllocationHandle> handles;

  void* ptr() const {
    return ipc_ptr ? ipc_ptr : reinterpret_cast<void*>(static_cast<uintptr_t>(va));
  }

  // Undoes what was opened; never throws (it runs in a deleter). Failures
  // are reported on stderr unless the driver is already shut down.
  void release() noexcept {
    try {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
      if (ipc_ptr != nullptr) {
        report(cudaIpcCloseMemHandle(ipc_ptr), "cudaIpcCloseMemHandle");
        ipc_ptr = nullptr;
      }
      if (va != 0 || !handles.empty()) {
        // Work queued on the mapping must end before it goes (cuMemUnmap
        // does not wait), as PyTorch's expandable segments do.
        report(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
        const Driver& d = driver();
        for (size_t i = 0; i < mapped; ++i) {
          report(d.unmap(va + i * page, page), "cuMemUnmap");
        }
        mapped = 0;
        for (CUmemGenericAllocationHandle h : handles) {
          report(d.release(h), "cuMemRelease");
        }
        handles.clear();
        if (va != 0) {
          report(d.address_free(va, reserved), "cuMemAddressFree");
          va = 0;
        }
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "gpu_alloc: releasing received CUDA IPC memory failed: %s\n",
                   e.what());
    }
  }

 private:
  static void report(cudaError_t err, const char* what) {
    if (err != cudaSuccess && err != cudaErrorCudartUnloading) {
      (void)cudaGetLastError();
      TORCH_WARN("gpu_alloc: releasing received CUDA IPC memory: ", what, " failed: ",
                 cudaGetErrorString(err));
    }
  }
  static void report(CUresult r, const char* what) {
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_DEINITIALIZED) {
      TORCH_WARN("gpu_alloc: releasing received CUDA IPC memory: ", what, " failed: ",
                 driver_error(r));
    }
  }
};

// Releases `o` unless dismissed (an open that failed half-way).
struct OpenGuard {
  Opened* o;
  ~OpenGuard() {
    if (o != nullptr) {
      o->release();
    }
  }
};

inline std::string pidfd_error(const char* call, int err, pid_t pid) {
  std::string what = std::string(call) + " on the sending process (pid " + std::to_string(pid) +
                     ") failed: " + std::strerror(err);
  if (err == ENOSYS) {
    return what +
           ". This kernel lacks the pidfd_open / pidfd_getfd system calls (Linux 5.6) that "
           "sharing memory of expandable segments needs; allocate the tensors to share with "
           "expandable_segments:False";
  }
  if (err == EPERM) {
    return what +
           ". Duplicating the sender's file descriptors needs ptrace permission over it: "
           "kernel.yama.ptrace_scope (/proc/sys/kernel/yama/ptrace_scope) must be 0, or the "
           "sender must allow this process with prctl(PR_SET_PTRACER, <receiver pid or "
           "PR_SET_PTRACER_ANY>), or this process needs CAP_SYS_PTRACE (containers: "
           "--cap-add=SYS_PTRACE; seccomp may block pidfd_getfd too); otherwise share "
           "tensors allocated with expandable_segments:False";
  }
  if (err == ESRCH) {
    return what + ". The sending process has exited";
  }
  if (err == EBADF) {
    return what + ". The descriptor is no longer open in the sender (its memory was released)";
  }
  return what;
}

// Opens an 'e' payload (after the version and type bytes) on `device`.
inline void open_expandable(Opened& o, const char* p, size_t rest) {
  TORCH_CHECK(rest >= sizeof(ShareHeader),
              "gpu_alloc: getIpcDevPtr: truncated expandable-segment handle (", std::to_string(rest),
              " bytes after the type)");
  ShareHeader header;
  std::memcpy(&header, p, sizeof(header));
  p += sizeof(header);
  rest -= sizeof(header);
  const size_t n = header.num_handles;
  TORCH_CHECK(n > 0 && header.segment_size > 0 && n <= rest,
              "gpu_alloc: getIpcDevPtr: malformed expandable-segment handle (", std::to_string(n),
              " pages of ", std::to_string(header.segment_size), " bytes, ", std::to_string(rest),
              " bytes of payload)");
  bool fabric = false;
  if (rest == n * sizeof(int)) {
    fabric = false;
  } else if (rest == n * kFabricHandleSize) {
    fabric = true;
  } else {
    TORCH_CHECK(false, "gpu_alloc: getIpcDevPtr: malformed expandable-segment handle: ",
                std::to_string(rest), " bytes for ", std::to_string(n), " pages (expected ",
                std::to_string(n * sizeof(int)), " for file descriptors or ",
                std::to_string(n * kFabricHandleSize), " for fabric handles)");
  }
  const Driver& d = driver();
  o.page = header.segment_size;
  o.handles.reserve(n);
  if (!fabric) {
    long pidfd = syscall(SYS_pidfd_open, header.pid, 0);
    TORCH_CHECK(pidfd >= 0, "gpu_alloc: getIpcDevPtr: ",
                pidfd_error("pidfd_open", errno, header.pid));
    for (size_t i = 0; i < n; ++i) {
      int fd = 0;
      std::memcpy(&fd, p + i * sizeof(int), sizeof(int));
      long mine = syscall(SYS_pidfd_getfd, static_cast<int>(pidfd), fd, 0);
      if (mine < 0) {
        int err = errno;
        close(static_cast<int>(pidfd));
        TORCH_CHECK(false, "gpu_alloc: getIpcDevPtr: ",
                    pidfd_error("pidfd_getfd", err, header.pid), " (descriptor ", std::to_string(fd),
                    ")");
      }
      CUmemGenericAllocationHandle h = 0;
      CUresult r = d.mem_import(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(mine)),
                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
      close(static_cast<int>(mine));
      if (r != CUDA_SUCCESS) {
        close(static_cast<int>(pidfd));
      }
      GPU_ALLOC_IPC_DRIVER_CHECK(r, "cuMemImportFromShareableHandle (POSIX file descriptor)");
      o.handles.push_back(h);
    }
    close(static_cast<int>(pidfd));
  } else {
    for (size_t i = 0; i < n; ++i) {
      unsigned char fabric_handle[kFabricHandleSize];
      std::memcpy(fabric_handle, p + i * kFabricHandleSize, kFabricHandleSize);
      CUmemGenericAllocationHandle h = 0;
      GPU_ALLOC_IPC_DRIVER_CHECK(d.mem_import(&h, fabric_handle, kFabricHandleType),
                                 "cuMemImportFromShareableHandle (fabric handle)");
      o.handles.push_back(h);
    }
  }
  o.reserved = n * o.page;
  GPU_ALLOC_IPC_DRIVER_CHECK(d.address_reserve(&o.va, o.reserved, 0, 0, 0),
                             "cuMemAddressReserve");
  for (size_t i = 0; i < n; ++i) {
    GPU_ALLOC_IPC_DRIVER_CHECK(d.map(o.va + i * o.page, o.page, 0, o.handles[i], 0), "cuMemMap");
    o.mapped = i + 1;
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = o.device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  GPU_ALLOC_IPC_DRIVER_CHECK(d.set_access(o.va, o.reserved, &access, 1), "cuMemSetAccess");
}

// Opens `handle` on the current device.
inline Opened open_handle_uncached(const std::string& handle) {
  Opened o;
  C10_CUDA_CHECK(cudaGetDevice(&o.device));
  // Makes the device's primary context current on this thread for the
  // driver calls below (the device stays the same).
  C10_CUDA_CHECK(cudaSetDevice(o.device));
  char type = kCudaMalloc;
  size_t at = 0;
  if (handle.size() != kIpcHandleSize) {
    TORCH_CHECK(handle.size() >= 2, "gpu_alloc: getIpcDevPtr: a CUDA IPC handle of ",
                std::to_string(handle.size()), " bytes is malformed");
    const int version = static_cast<unsigned char>(handle[0]);
    TORCH_CHECK(version <= kHandleVersion,
                "gpu_alloc: getIpcDevPtr: received a shareable handle of version ",
                std::to_string(version), " from a newer torch; this one knows version ",
                std::to_string(static_cast<int>(kHandleVersion)),
                " and earlier");
    type = handle[1];
    at = 2;
  }  // else: a raw cudaIpcMemHandle_t from a torch older than the versioned format
  OpenGuard guard{&o};
  if (type == kCudaMalloc) {
    TORCH_CHECK(handle.size() - at == kIpcHandleSize, "gpu_alloc: getIpcDevPtr: a 'c' handle of ",
                std::to_string(handle.size() - at), " bytes (expected ",
                std::to_string(kIpcHandleSize), ")");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data() + at, kIpcHandleSize);
    cudaError_t err = cudaIpcOpenMemHandle(&o.ipc_ptr, h, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      o.ipc_ptr = nullptr;
      TORCH_CHECK(false, "gpu_alloc: getIpcDevPtr: cudaIpcOpenMemHandle failed on device ",
                  std::to_string(o.device), ": ", cudaGetErrorString(err),
                  " (the sender must still hold the memory; a process cannot open its own "
                  "handle)");
    }
  } else if (type == kExpandable) {
    open_expandable(o, handle.data() + at, handle.size() - at);
  } else {
    TORCH_CHECK(false, "gpu_alloc: getIpcDevPtr: unknown shareable handle type ",
                std::to_string(static_cast<int>(static_cast<unsigned char>(type))),
                " (expected 'c' or 'e')");
  }
  guard.o = nullptr;
  return o;
}

// The handles opened in this process, by handle string (PyTorch's
// ipcMemHandle_to_devptr): one mapping per handle while anything uses it.
class Receiver {
 public:
  std::shared_ptr<void> open(const std::string& handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = cache_.find(handle);
    if (it != cache_.end()) {
      if (auto alive = it->second.second.lock()) {
        return alive;
      }
      // Its last user is releasing it right now: open it anew (the
      // releasing deleter leaves this newer entry alone).
      cache_.erase(it);
    }
    Opened opened = open_handle_uncached(handle);
    const uint64_t id = ++next_id_;
    void* ptr = opened.ptr();
    std::shared_ptr<void> sp(ptr, [this, handle, id, opened](void*) mutable {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        auto found = cache_.find(handle);
        if (found != cache_.end() && found->second.first == id) {
          cache_.erase(found);
        }
      }
      // Outside the lock: releasing an expandable mapping synchronizes.
      opened.release();
    });
    cache_[handle] = {id, sp};
    return sp;
  }

 private:
  std::mutex mutex_;
  uint64_t next_id_ = 0;
  std::unordered_map<std::string, std::pair<uint64_t, std::weak_ptr<void>>> cache_;
};

// The process's receiver (never destroyed: mappings may outlive static
// destruction at exit).
inline Receiver& receiver() {
  static Receiver* r = new Receiver();
  return *r;
}

// getIpcDevPtr: the base of what `handle` shares, mapped in this process on
// the current device, alive while the returned pointer (or another for the
// same handle) is.
inline std::shared_ptr<void> open_handle(const std::string& handle) {
  return receiver().open(handle);
}

}  // namespace ipc
}  // namespace gpu_alloc_bridge

#undef GPU_ALLOC_IPC_DRIVER_CHECK
