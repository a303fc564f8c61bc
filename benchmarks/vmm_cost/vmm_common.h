// Shared by the vmm_cost benchmarks: a driver-call check that exits with the
// call and its error string, a host clock in microseconds, and a median.
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
