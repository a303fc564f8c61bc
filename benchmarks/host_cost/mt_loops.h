// Many-thread loops of the host-cost benchmark (host_threads.py), shared by
// the PyTorch extension (mt_torch.cpp) and the plain C++ build for machines
// without PyTorch (mt_cpu.cpp). No CUDA or torch header here: a backend is any
// type with `void* alloc(size_t)` and `void release(void*, size_t)`.
//
// One cell: `threads` threads, each with its own backend (made inside the
// thread, so that per-thread setup such as the current device happens there),
// warm up, meet at a start line, then run the workload until the main thread
// says stop after `window_s`. Each thread counts its calls (an alloc or a
// free is one call) in rounds of `sample_every` calls, the last of each
// round timed with steady_clock (two clock reads on sampled calls only, so
// the loop's own cost stays low); a failed round's calls are not counted. Aggregate calls/s = all threads' calls / (last thread's
// stop - start).
//
// With `with_zero`, pairs of `size` take turns with pairs of 0 bytes, and the
// sampled calls are kept apart by phase (alloc and free of each size): the
// zero pairs run the same path without its allocator (PyTorch's allocators
// and the bridge hand out no memory for 0 bytes), so the difference of the
// medians is the allocator's share of the path, measured in one loop, in one
// process, at one moment.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace mt {

using clk = std::chrono::steady_clock;

// What each thread runs.
struct Workload {
  bool mixed = false;   // false: alloc+free pairs of `size`
  int64_t size = 512;   // pair size
  int64_t lo = 512;     // mixed: log-uniform sizes in [lo, hi]
  int64_t hi = 1 << 20;
  int64_t max_live = 1000;  // mixed: live blocks per thread at most
  bool with_zero = false;   // pairs only: pairs of 0 bytes in between
};

// The calls of a pair workload with zero pairs between, in the order they run.
enum Phase { ALLOC = 0, FREE = 1, ALLOC_ZERO = 2, FREE_ZERO = 3, PHASES = 4 };

// One cell's parameters.
struct Cell {
  Workload w;
  int threads = 1;
  double window_s = 0.1;
  int64_t warm_calls = 20000;  // per thread, before the start line
  int64_t sample_every = 31;   // odd: pairs alternate alloc and free samples
  uint64_t seed = 42;          // thread t uses seed + t
  int64_t max_samples = 1 << 17;  // per thread
};

// One cell's outcome.
struct Result {
  uint64_t calls = 0;
  double wall_ns = 0;
  double p50_ns = 0, p99_ns = 0, p999_ns = 0, max_ns = 0;
  uint64_t samples = 0;
  // With Workload::with_zero: the median of each Phase's samples, and how
  // many it had (an even sample_every would leave phases without any).
  double phase_p50_ns[PHASES] = {0, 0, 0, 0};
  uint64_t phase_samples[PHASES] = {0, 0, 0, 0};
  int failed_threads = 0;
  std::string error;  // first failure's message
};

// SplitMix64: the same generator as gpu_bench's, cheap and seedable.
struct Rng {
  uint64_t s;
  uint64_t next() {
    s += 0x9E3779B97F4A7C15ULL;
    uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  double uniform() { return (double)(next() >> 11) / (double)(1ULL << 53); }
};

struct Shared {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::atomic<bool> stop{false};
  clk::time_point t0;
};

struct ThreadOut {
  uint64_t calls = 0;
  clk::time_point end;
  std::vector<uint32_t> lat;
  std::vector<uint8_t> phase;  // with_zero: each sample's Phase
  bool failed = false;
  std::string error;
};

// The workload's state on one thread, and one call of it.
template <class B>
class Driver {
 public:
  Driver(B& b, const Workload& w, uint64_t seed) : b_(b), w_(w), rng_{seed} {
    if (w.mixed) {
      live_.reserve((size_t)w.max_live);
      log_lo_ = std::log((double)w.lo);
      log_span_ = std::log((double)w.hi) - log_lo_;
    }
  }
  Driver(const Driver&) = delete;
  Driver& operator=(const Driver&) = delete;

  // One alloc or free; false when the allocator returned NULL.
  inline bool call() {
    if (!w_.mixed) {
      if (w_.with_zero) return zero_pair_call();
      if (held_) {
        b_.release(held_, (size_t)w_.size);
        held_ = nullptr;
        return true;
      }
      held_ = b_.alloc((size_t)w_.size);
      return held_ != nullptr;
    }
    bool do_alloc = live_.empty() || ((int64_t)live_.size() < w_.max_live && rng_.uniform() < 0.5);
    if (do_alloc) {
      size_t n = (size_t)std::exp(log_lo_ + rng_.uniform() * log_span_);
      void* p = b_.alloc(n);
      if (!p) return false;
      live_.push_back({p, n});
    } else {
      size_t j = (size_t)(rng_.uniform() * (double)live_.size());
      std::swap(live_[j], live_.back());
      b_.release(live_.back().first, live_.back().second);
      live_.pop_back();
    }
    return true;
  }

  // The Phase of the last call (with_zero).
  int last_phase() const { return last_; }

  // Frees whatever is still held.
  void drain() {
    if (held_) b_.release(held_, size_of(last_));
    held_ = nullptr;
    for (auto& x : live_) b_.release(x.first, x.second);
    live_.clear();
  }

 private:
  // The bytes of a pair call in `phase` (a plain pair's calls stay in ALLOC).
  size_t size_of(int phase) const { return phase >= ALLOC_ZERO ? 0 : (size_t)w_.size; }

  // One call of a pair workload with zero pairs between: the phases in turn.
  bool zero_pair_call() {
    last_ = next_;
    next_ = (next_ + 1) % PHASES;
    size_t n = size_of(last_);
    if (last_ == FREE || last_ == FREE_ZERO) {
      b_.release(held_, n);
      held_ = nullptr;
      return true;
    }
    held_ = b_.alloc(n);
    return held_ != nullptr;
  }

  B& b_;
  Workload w_;
  Rng rng_;
  void* held_ = nullptr;
  int next_ = ALLOC, last_ = ALLOC;
  std::vector<std::pair<void*, size_t>> live_;
  double log_lo_ = 0, log_span_ = 0;
};

inline void fail(ThreadOut& out, Shared& sh, std::string why) {
  out.failed = true;
  out.error = std::move(why);
  out.end = clk::now();
  sh.ready.fetch_add(1);  // never leave the main thread waiting
}

// One thread of a cell: make the backend, warm up, wait for the start,
// run until stop, drain.
template <class B>
void worker(const std::function<B(int)>& make, int t, const Cell& c, Shared& sh, ThreadOut& out) {
  bool counted = false;
  try {
    B b = make(t);
    Driver<B> d(b, c.w, c.seed + (uint64_t)t);
    for (int64_t i = 0; i < c.warm_calls; i++) {
      if (!d.call()) {
        d.drain();
        return fail(out, sh, "allocation failed while warming up");
      }
    }
    out.lat.reserve((size_t)c.max_samples);
    if (c.w.with_zero) out.phase.reserve((size_t)c.max_samples);
    sh.ready.fetch_add(1);
    counted = true;
    while (!sh.go.load(std::memory_order_acquire)) std::this_thread::yield();
    // Rounds of sample_every calls, the last one timed; the stop flag is
    // read between rounds, so every thread makes at least one round.
    uint64_t calls = 0;
    bool ok = true;
    do {
      for (int64_t i = 1; i < c.sample_every && ok; i++) ok = d.call();
      if (!ok) break;
      auto a = clk::now();
      ok = d.call();
      auto z = clk::now();
      if (!ok) break;
      if ((int64_t)out.lat.size() < c.max_samples) {
        auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(z - a).count();
        out.lat.push_back((uint32_t)std::min<int64_t>(ns, UINT32_MAX));
        if (c.w.with_zero) out.phase.push_back((uint8_t)d.last_phase());
      }
      calls += (uint64_t)c.sample_every;
    } while (!sh.stop.load(std::memory_order_relaxed));
    out.end = clk::now();
    out.calls = calls;
    d.drain();
    if (!ok) {
      out.failed = true;
      out.error = "allocation failed in the timed window";
    }
  } catch (const std::exception& e) {
    out.failed = true;
    out.error = e.what();
    out.end = clk::now();
    if (!counted) sh.ready.fetch_add(1);
  }
}

// The value at quantile q of sorted v (nearest rank).
inline double quantile(const std::vector<uint32_t>& v, double q) {
  if (v.empty()) return 0;
  size_t i = (size_t)std::ceil(q * (double)v.size());
  i = i == 0 ? 0 : i - 1;
  return (double)v[std::min(i, v.size() - 1)];
}

// Runs one cell: `make(t)` builds thread t's backend inside thread t.
template <class B>
Result run(const Cell& c, const std::function<B(int)>& make) {
  Shared sh;
  std::vector<ThreadOut> outs((size_t)c.threads);
  std::vector<std::thread> ts;
  ts.reserve((size_t)c.threads);
  for (int t = 0; t < c.threads; t++)
    ts.emplace_back([&, t] { worker<B>(make, t, c, sh, outs[(size_t)t]); });
  while (sh.ready.load() < c.threads) std::this_thread::sleep_for(std::chrono::microseconds(200));
  sh.t0 = clk::now();
  sh.go.store(true, std::memory_order_release);
  std::this_thread::sleep_for(std::chrono::duration<double>(c.window_s));
  sh.stop.store(true, std::memory_order_relaxed);
  for (auto& t : ts) t.join();

  Result r;
  std::vector<uint32_t> all, by_phase[PHASES];
  clk::time_point last = sh.t0;
  for (auto& o : outs) {
    if (o.failed) {
      if (r.failed_threads++ == 0) r.error = o.error;
      continue;
    }
    r.calls += o.calls;
    last = std::max(last, o.end);
    all.insert(all.end(), o.lat.begin(), o.lat.end());
    for (size_t i = 0; i < o.phase.size(); i++) by_phase[o.phase[i]].push_back(o.lat[i]);
  }
  for (int k = 0; k < PHASES; k++) {
    std::sort(by_phase[k].begin(), by_phase[k].end());
    r.phase_p50_ns[k] = quantile(by_phase[k], 0.50);
    r.phase_samples[k] = by_phase[k].size();
  }
  r.wall_ns = std::chrono::duration<double, std::nano>(last - sh.t0).count();
  std::sort(all.begin(), all.end());
  r.samples = all.size();
  r.p50_ns = quantile(all, 0.50);
  r.p99_ns = quantile(all, 0.99);
  r.p999_ns = quantile(all, 0.999);
  r.max_ns = all.empty() ? 0 : (double)all.back();
  return r;
}

// Which of its device's streams thread t uses: the first for all when
// `shared`, else one of its own (the how-many-th thread of that device it is).
inline int stream_index(const std::vector<int>& device_of_thread, int t, bool shared) {
  if (shared) return 0;
  int k = 0;
  for (int i = 0; i < t; i++) k += device_of_thread[(size_t)i] == device_of_thread[(size_t)t];
  return k;
}

// Median cost of one steady_clock read pair (what a sampled latency adds).
inline double clock_pair_ns() {
  std::vector<uint32_t> v;
  for (int i = 0; i < 10001; i++) {
    auto a = clk::now();
    auto z = clk::now();
    v.push_back((uint32_t)std::chrono::duration_cast<std::chrono::nanoseconds>(z - a).count());
  }
  std::sort(v.begin(), v.end());
  return (double)v[v.size() / 2];
}

}  // namespace mt
