// Shared by the vmm_cost benchmarks: a driver-call check that exits with the
// call and its error string, a host clock in microseconds, a median, and
// device 0 set up for the virtual-memory calls.
#pragma once
#include <cuda.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                              \
  do {                                                                     \
    CUresult r_ = (x);                                                     \
    if (r_ != CUDA_SUCCESS) {                                              \
      const char* s_ = nullptr;                                            \
      cuGetErrorString(r_, &s_);                                           \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_);       \
      exit(1);                                                             \
    }                                                                      \
  } while (0)

static double now_us() {
  using namespace std::chrono;
  return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Device 0, its primary context (made current), the properties of pinned
// device memory on it, and read-write access to it.
struct Device0 {
  CUdevice dev;
  CUcontext ctx;
  CUmemAllocationProp prop;
  CUmemAccessDesc access;
};

static Device0 open_device0() {
  Device0 d = {};
  CK(cuInit(0));
  CK(cuDeviceGet(&d.dev, 0));
  CK(cuDevicePrimaryCtxRetain(&d.ctx, d.dev));
  CK(cuCtxSetCurrent(d.ctx));
  d.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  d.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.prop.location.id = 0;
  d.access.location = d.prop.location;
  d.access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return d;
}
