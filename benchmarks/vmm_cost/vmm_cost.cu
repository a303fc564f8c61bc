// Host cost of the CUDA driver's virtual-memory calls that expandable
// segments make, per call and per byte, to choose how large the physical
// allocations behind a growable segment should be and how many calls a
// mapped run needs. Build and run on the GPU machine:
//   nvcc -O2 -o vmm_cost benchmarks/vmm_cost/vmm_cost.cu -lcuda && ./vmm_cost
// Prints one JSON object a line: {"op", "handle_mib", "handles", "us"} with
// the median host microseconds of one call over the repetitions.
#include "vmm_common.h"

static void report(const char* op, size_t handle, int handles, double us) {
  printf("{\"op\": \"%s\", \"handle_mib\": %zu, \"handles\": %d, \"us\": %.2f}\n", op,
         handle >> 20, handles, us);
  fflush(stdout);
}

int main() {
  Device0 d = open_device0();
  CUmemAllocationProp prop = d.prop;
  CUmemAccessDesc access = d.access;
  size_t gran = 0;
  CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));

  const size_t range = size_t(8) << 30;
  CUdeviceptr base;
  CK(cuMemAddressReserve(&base, range, 0, 0, 0));
  const int reps = 15;

  // One handle of each size: create, map, set access, unmap, release.
  for (size_t mib : {2, 20, 200, 2048}) {
    size_t size = mib << 20;
    std::vector<double> create, map, access_t, unmap, release;
    for (int r = 0; r < reps; r++) {
      CUmemGenericAllocationHandle h;
      double t0 = now_us();
      CK(cuMemCreate(&h, size, &prop, 0));
      double t1 = now_us();
      CK(cuMemMap(base, size, 0, h, 0));
      double t2 = now_us();
      CK(cuMemSetAccess(base, size, &access, 1));
      double t3 = now_us();
      CK(cuMemUnmap(base, size));
      double t4 = now_us();
      CK(cuMemRelease(h));
      double t5 = now_us();
      create.push_back(t1 - t0);
      map.push_back(t2 - t1);
      access_t.push_back(t3 - t2);
      unmap.push_back(t4 - t3);
      release.push_back(t5 - t4);
    }
    report("create", size, 1, median(create));
    report("map", size, 1, median(map));
    report("set_access", size, 1, median(access_t));
    report("unmap", size, 1, median(unmap));
    report("release", size, 1, median(release));
  }

  // A run of n existing handles of 2 MiB (or 20 MiB) mapped side by side:
  // access per handle vs one access for the run; unmap per handle vs one
  // unmap over the run (allowed when it covers whole mappings).
  for (size_t hmib : {(size_t)2, (size_t)20}) {
    size_t hsize = hmib << 20;
    for (int n : {10, 100}) {
      if (hsize * n > range) continue;
      std::vector<CUmemGenericAllocationHandle> hs(n);
      for (auto& h : hs) CK(cuMemCreate(&h, hsize, &prop, 0));
      std::vector<double> map_each, map_run, unmap_each, unmap_run;
      for (int r = 0; r < reps; r++) {
        double t0 = now_us();
        for (int i = 0; i < n; i++) {
          CK(cuMemMap(base + i * hsize, hsize, 0, hs[i], 0));
          CK(cuMemSetAccess(base + i * hsize, hsize, &access, 1));
        }
        double t1 = now_us();
        for (int i = 0; i < n; i++) CK(cuMemUnmap(base + i * hsize, hsize));
        double t2 = now_us();
        for (int i = 0; i < n; i++) CK(cuMemMap(base + i * hsize, hsize, 0, hs[i], 0));
        CK(cuMemSetAccess(base, hsize * n, &access, 1));
        double t3 = now_us();
        CK(cuMemUnmap(base, hsize * n));
        double t4 = now_us();
        map_each.push_back(t1 - t0);
        unmap_each.push_back(t2 - t1);
        map_run.push_back(t3 - t2);
        unmap_run.push_back(t4 - t3);
      }
      report("map+access_each", hsize, n, median(map_each));
      report("unmap_each", hsize, n, median(unmap_each));
      report("map_each+access_run", hsize, n, median(map_run));
      report("unmap_run", hsize, n, median(unmap_run));
      for (auto& h : hs) CK(cuMemRelease(h));
    }
  }

  // For scale: cudaMalloc-equivalent driver calls of the same sizes.
  for (size_t mib : {2, 20, 200, 2048}) {
    size_t size = mib << 20;
    std::vector<double> alloc, freed;
    for (int r = 0; r < reps; r++) {
      CUdeviceptr p;
      double t0 = now_us();
      CK(cuMemAlloc(&p, size));
      double t1 = now_us();
      CK(cuMemFree(p));
      double t2 = now_us();
      alloc.push_back(t1 - t0);
      freed.push_back(t2 - t1);
    }
    report("cuMemAlloc", size, 1, median(alloc));
    report("cuMemFree", size, 1, median(freed));
  }
  CK(cuMemAddressFree(base, range));
  return 0;
}
