// What a page move costs the allocating thread when its unmap runs on another
// thread. A move of `unmap_free_pages` takes the physical page under a free
// block at one address and maps it under the block being allocated at
// another: cuMemUnmap (old) + cuMemMap (new) + cuMemSetAccess (new). The
// driver lets one physical allocation be mapped at two addresses, so the map
// at the new address need not wait for the unmap at the old one, which a
// worker thread can do later. This times, per moved page on the calling
// thread (median over repetitions of a run of moves):
//   serial        unmap old, map new, set access, all on the caller;
//   unmap_worker  map new, set access on the caller; the unmap of the old
//                 address queued to a worker thread (the caller's time
//                 alone; the wait for the queue to drain afterwards is
//                 reported apart as drain_us_per_move);
//   map_only      map new and set access, no unmap anywhere (the floor).
// It also checks that memory double-mapped this way reads back what was
// written through the other address. Build and run on the GPU machine:
//   nvcc -O2 -std=c++17 -o /tmp/move_overlap benchmarks/vmm_cost/move_overlap.cu -lcuda -lpthread
//   /tmp/move_overlap [PAGE_MIB] [MOVES]
// Prints one JSON object a line: {"mode", "page_mib", "moves", "us_per_move", ...}.
#include "vmm_common.h"
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

// Unmaps queued address ranges on its own thread, in the caller's context.
struct Unmapper {
  CUcontext ctx;
  std::mutex m;
  std::condition_variable cv, idle;
  std::deque<std::pair<CUdeviceptr, size_t>> q;
  bool stop = false, busy = false;
  std::thread t;
  explicit Unmapper(CUcontext c) : ctx(c), t([this] { run(); }) {}
  void run() {
    CK(cuCtxSetCurrent(ctx));
    std::unique_lock<std::mutex> l(m);
    for (;;) {
      cv.wait(l, [this] { return stop || !q.empty(); });
      if (q.empty()) return;
      auto job = q.front();
      q.pop_front();
      busy = true;
      l.unlock();
      CK(cuMemUnmap(job.first, job.second));
      l.lock();
      busy = false;
      if (q.empty()) idle.notify_all();
    }
  }
  void post(CUdeviceptr p, size_t n) {
    {
      std::lock_guard<std::mutex> g(m);
      q.emplace_back(p, n);
    }
    cv.notify_one();
  }
  void drain() {
    std::unique_lock<std::mutex> l(m);
    idle.wait(l, [this] { return q.empty() && !busy; });
  }
  ~Unmapper() {
    {
      std::lock_guard<std::mutex> g(m);
      stop = true;
    }
    cv.notify_one();
    t.join();
  }
};

int main(int argc, char** argv) {
  const size_t page = size_t(argc > 1 ? atoi(argv[1]) : 4) << 20;
  const int moves = argc > 2 ? atoi(argv[2]) : 64;
  const int reps = 9;
  Device0 d = open_device0();
  CUcontext ctx = d.ctx;
  CUmemAllocationProp prop = d.prop;
  CUmemAccessDesc access = d.access;

  // Two halves of one reserved range: pages start mapped in the low half
  // and move to the high half, then back.
  const size_t half = page * moves;
  CUdeviceptr base;
  CK(cuMemAddressReserve(&base, 2 * half, page, 0, 0));
  std::vector<CUmemGenericAllocationHandle> hs(moves);
  for (int i = 0; i < moves; i++) {
    CK(cuMemCreate(&hs[i], page, &prop, 0));
    CK(cuMemMap(base + i * page, page, 0, hs[i], 0));
    CK(cuMemSetAccess(base + i * page, page, &access, 1));
  }
  CK(cuCtxSynchronize());

  Unmapper worker(ctx);
  const char* modes[] = {"serial", "unmap_worker", "map_only"};
  std::vector<double> per[3], drain;
  bool at_low = true;
  // Interleaved: one run of every mode per repetition.
  for (int r = 0; r < reps; r++) {
    for (int mode = 0; mode < 3; mode++) {
      CUdeviceptr from = at_low ? base : base + half, to = at_low ? base + half : base;
      double t0 = now_us();
      for (int i = 0; i < moves; i++) {
        if (mode == 0) CK(cuMemUnmap(from + i * page, page));
        CK(cuMemMap(to + i * page, page, 0, hs[i], 0));
        CK(cuMemSetAccess(to + i * page, page, &access, 1));
        if (mode == 1) worker.post(from + i * page, page);
      }
      double t1 = now_us();
      per[mode].push_back((t1 - t0) / moves);
      if (mode == 1) {
        worker.drain();
        drain.push_back((now_us() - t1) / moves);
      }
      if (mode == 2) {
        // Check the double mapping: write through the new address, read
        // through the old one; then unmap the old (untimed).
        CK(cuMemsetD32(to, 0x5eed0000u + r, page / 4));
        CK(cuCtxSynchronize());
        unsigned v = 0;
        CK(cuMemcpyDtoH(&v, from + page - 4, 4));
        if (v != 0x5eed0000u + r) {
          fprintf(stderr, "double mapping read %#x\n", v);
          return 1;
        }
        for (int i = 0; i < moves; i++) CK(cuMemUnmap(from + i * page, page));
      }
      at_low = !at_low;
    }
  }
  for (int mode = 0; mode < 3; mode++) {
    printf("{\"mode\": \"%s\", \"page_mib\": %zu, \"moves\": %d, \"us_per_move\": %.2f",
           modes[mode], page >> 20, moves, median(per[mode]));
    if (mode == 1) printf(", \"drain_us_per_move\": %.2f", median(drain));
    printf("}\n");
  }
  return 0;
}
