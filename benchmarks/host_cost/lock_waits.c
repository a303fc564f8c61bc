// Which pthread mutexes a process waits on, and from where: an LD_PRELOAD library
// that counts, for every pthread_mutex_lock that finds its mutex taken, the caller's
// stack (eight frames) and the time until the lock was had. At exit it writes the
// fifteen stacks that waited longest to $LOCK_WAITS_DIR/lock_waits.<pid>.txt (default
// /tmp), each frame as symbol+offset (library) [library+offset] for addr2line.
//
//   gcc -O2 -shared -fPIC -o lock_waits.so benchmarks/host_cost/lock_waits.c -ldl -lpthread
//   LOCK_WAITS_DIR=$OUT/locks LD_PRELOAD=$PWD/lock_waits.so python3 benchmarks/host_cost/...
//
// A lock that is free costs one pthread_mutex_trylock more than before; only waits are
// recorded, so what it shows is contention, not how often a lock is taken. Used to find
// the driver lock behind PyTorch's path on threads without a current context
// (docs/benchmarks.md, "PyTorch's path on threads with their context current").
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <execinfo.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define DEPTH 8
#define SLOTS 4096
#define SHOWN 15

// One caller stack: its hash (0: a free slot), frames, waits and the time waited.
typedef struct {
  _Atomic uint64_t hash;
  void* frames[DEPTH];
  _Atomic uint64_t waits;
  _Atomic uint64_t waited_ns;
} Stack;

static Stack stacks[SLOTS];
static int (*real_lock)(pthread_mutex_t*);
static int (*real_trylock)(pthread_mutex_t*);
static _Atomic uint64_t waited_locks, free_locks;
// Set while this library takes locks itself (backtrace, the report): those are not counted.
static __thread int inside;

static void resolve(void) {
  real_lock = (int (*)(pthread_mutex_t*))dlsym(RTLD_NEXT, "pthread_mutex_lock");
  real_trylock = (int (*)(pthread_mutex_t*))dlsym(RTLD_NEXT, "pthread_mutex_trylock");
}

__attribute__((constructor)) static void start(void) {
  resolve();
  void* frames[2];
  inside = 1;
  backtrace(frames, 2);  // loads the unwinder now, not inside the first wait
  inside = 0;
}

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static void record(void** frames, int n, uint64_t waited) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the frame addresses
  for (int i = 0; i < n; i++) h = (h ^ (uint64_t)(uintptr_t)frames[i]) * 1099511628211ull;
  if (h == 0) h = 1;
  for (uint64_t k = 0; k < SLOTS; k++) {
    Stack* s = &stacks[(h + k) % SLOTS];
    uint64_t seen = atomic_load(&s->hash);
    if (seen == 0) {
      uint64_t empty = 0;
      if (atomic_compare_exchange_strong(&s->hash, &empty, h)) {
        memcpy(s->frames, frames, sizeof(void*) * (size_t)n);
        seen = h;
      } else {
        seen = empty;
      }
    }
    if (seen == h) {
      atomic_fetch_add(&s->waits, 1);
      atomic_fetch_add(&s->waited_ns, waited);
      return;
    }
  }  // a full table drops the stack; the totals still count it
}

int pthread_mutex_lock(pthread_mutex_t* m) {
  if (!real_lock) resolve();
  if (inside) return real_lock(m);
  int r = real_trylock(m);
  if (r != EBUSY) {
    atomic_fetch_add(&free_locks, 1);
    return r;
  }
  atomic_fetch_add(&waited_locks, 1);
  inside = 1;
  void* frames[DEPTH + 1] = {0};
  int n = backtrace(frames, DEPTH + 1);  // frame 0 is this function
  uint64_t t0 = now_ns();
  r = real_lock(m);
  record(frames + 1, n > 1 ? n - 1 : 0, now_ns() - t0);
  inside = 0;
  return r;
}

static int longer_wait_first(const void* a, const void* b) {
  uint64_t x = ((const Stack*)a)->waited_ns, y = ((const Stack*)b)->waited_ns;
  return x < y ? 1 : x > y ? -1 : 0;
}

__attribute__((destructor)) static void report(void) {
  inside = 1;
  const char* dir = getenv("LOCK_WAITS_DIR");
  char path[512];
  snprintf(path, sizeof path, "%s/lock_waits.%d.txt", dir ? dir : "/tmp", (int)getpid());
  FILE* out = fopen(path, "w");
  if (!out) return;
  static Stack sorted[SLOTS];
  memcpy(sorted, stacks, sizeof stacks);
  qsort(sorted, SLOTS, sizeof(Stack), longer_wait_first);
  fprintf(out, "locks waited for %lu, found free %lu\n", (unsigned long)waited_locks,
          (unsigned long)free_locks);
  for (int i = 0; i < SHOWN && sorted[i].waits; i++) {
    fprintf(out, "\n== %lu waits, %.3f ms waited\n", (unsigned long)sorted[i].waits,
            (double)sorted[i].waited_ns / 1e6);
    for (int j = 0; j < DEPTH && sorted[i].frames[j]; j++) {
      void* at = sorted[i].frames[j];
      Dl_info d;
      if (dladdr(at, &d) && d.dli_fname) {
        const char* base = strrchr(d.dli_fname, '/') ? strrchr(d.dli_fname, '/') + 1 : d.dli_fname;
        void* from = d.dli_saddr ? d.dli_saddr : d.dli_fbase;
        fprintf(out, "  %s+0x%lx  (%s)  [%s+0x%lx]\n", d.dli_sname ? d.dli_sname : "?",
                (unsigned long)((char*)at - (char*)from), d.dli_fname, base,
                (unsigned long)((char*)at - (char*)d.dli_fbase));
      } else {
        fprintf(out, "  %p\n", at);
      }
    }
  }
  fclose(out);
}
