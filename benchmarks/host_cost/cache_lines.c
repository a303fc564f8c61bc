// The C library, one thread, over the null driver, for cache_lines.py: after a
// warm-up it runs N calls of a workload with a store to `sep` before each call,
// so that a valgrind lackey trace of its memory accesses can be cut into one
// segment per call. At the end it prints its memory map to stderr (where the
// library was loaded) after a line "sep 0x...".
//
//   cache_lines pair|mixed WARM N LIBALLOC_FFI_SO
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

typedef void* (*alloc_fn)(ssize_t, int, void*);
typedef void (*free_fn)(void*, ssize_t, int, void*);

volatile long sep;
static unsigned long long rng = 88172645463325252ull;

static unsigned long long next_random(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

static void* need(void* h, const char* name) {
  void* f = dlsym(h, name);
  if (!f) {
    fprintf(stderr, "cache_lines: %s not found: %s\n", name, dlerror());
    exit(2);
  }
  return f;
}

enum { LIVE = 1000 };

int main(int argc, char** argv) {
  if (argc != 5 || (strcmp(argv[1], "pair") && strcmp(argv[1], "mixed"))) {
    fprintf(stderr, "usage: cache_lines pair|mixed WARM N LIBALLOC_FFI_SO\n");
    return 2;
  }
  int mixed = argv[1][0] == 'm';
  long warm = atol(argv[2]), n = atol(argv[3]);
  void* cu = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!cu) {
    fprintf(stderr, "cache_lines: libcuda.so.1: %s\n", dlerror());
    return 2;
  }
  int (*init)(unsigned) = need(cu, "cuInit");
  int (*get)(int*, int) = need(cu, "cuDeviceGet");
  int (*retain)(void**, int) = need(cu, "cuDevicePrimaryCtxRetain");
  int (*set)(void*) = need(cu, "cuCtxSetCurrent");
  int (*create)(void**, unsigned) = need(cu, "cuStreamCreate");
  int dev;
  void *ctx, *stream;
  if (init(0) || get(&dev, 0) || retain(&ctx, dev) || set(ctx) || create(&stream, 1)) {
    fprintf(stderr, "cache_lines: the driver refused to make a stream\n");
    return 2;
  }
  void* lib = dlopen(argv[4], RTLD_NOW);
  if (!lib) {
    fprintf(stderr, "cache_lines: %s\n", dlerror());
    return 2;
  }
  alloc_fn a = need(lib, "gpualloc_malloc");
  free_fn f = need(lib, "gpualloc_free");
  static void* live[LIVE];
  static ssize_t size[LIVE];
  for (int i = 0; i < LIVE && mixed; i++) {
    size[i] = 512 + next_random() % (1 << 20);
    live[i] = a(size[i], 0, stream);
  }
  for (long i = 0; i < warm + n; i++) {
    if (mixed) {
      // Free a random live block, allocate another size in its place.
      int k = next_random() % LIVE;
      sep = i;
      f(live[k], size[k], 0, stream);
      size[k] = 512 + next_random() % (1 << 20);
      sep = i;
      live[k] = a(size[k], 0, stream);
    } else {
      sep = i;
      void* p = a(512, 0, stream);
      sep = i;
      f(p, 512, 0, stream);
    }
  }
  sep = -1;  // closes the last call's segment
  fprintf(stderr, "sep %p\n", (void*)&sep);
  FILE* maps = fopen("/proc/self/maps", "r");
  char line[512];
  while (maps && fgets(line, sizeof line, maps)) fputs(line, stderr);
  return 0;
}
