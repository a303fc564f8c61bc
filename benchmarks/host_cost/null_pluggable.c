// An allocator that does nothing, with the signatures of PyTorch's pluggable
// allocator (torch.cuda.memory.CUDAPluggableAllocator): the floor of PyTorch's
// at::empty path, everything but an allocator's own work (host_threads.py's
// "at::empty via pluggable null").
//
// at::empty never touches the memory, but PyTorch keeps the pointer as a
// device address, so it has to be one: each device gets one block of
// NULL_PLUGGABLE_BLOCK bytes from the CUDA runtime's cudaMalloc on its first
// request (PyTorch calls malloc with that device current), and every request
// that fits gets an address inside it; larger ones, and any failure, get NULL.
// free does nothing; the blocks live as long as the process.
//
// PyTorch's pluggable allocator keeps a table of the live pointers and fails
// a free whose pointer it no longer holds, so two live requests must not get
// the same address. Each thread takes the next of its own NULL_PLUGGABLE_SLOTS
// addresses, 512 bytes apart, in a lane of the block that is its alone (a
// thread-local counter, so the floor adds no shared cache line). The bytes two
// requests name overlap; nothing reads them. Addresses repeat only after a
// thread's NULL_PLUGGABLE_SLOTS requests, or when more than NULL_PLUGGABLE_LANES
// threads share a lane.
//
// cudaMalloc is looked up at run time (the process has loaded libcudart), so
// no CUDA header or library is needed to build:
//   cc -O2 -Wall -shared -fPIC -pthread -o libnull_pluggable.so null_pluggable.c -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <sys/types.h>

#ifndef NULL_PLUGGABLE_BLOCK
// host_threads.py sets it to the largest request of its plan, at least 64 MiB
// (its default workloads ask for 8 MiB at most).
#define NULL_PLUGGABLE_BLOCK (64LL << 20)
#endif
#define NULL_PLUGGABLE_DEVICES 64
// Lanes of 4096 addresses each: 64 MiB, the smallest block, holds all 32.
#define NULL_PLUGGABLE_LANES 32
#define NULL_PLUGGABLE_SLOTS 4096
#define NULL_PLUGGABLE_STEP 512
_Static_assert((long long)NULL_PLUGGABLE_LANES * NULL_PLUGGABLE_SLOTS * NULL_PLUGGABLE_STEP <=
                   NULL_PLUGGABLE_BLOCK,
               "every lane's addresses lie in the block");

typedef int (*cuda_malloc_fn)(void**, size_t);

static _Atomic(void*) blocks[NULL_PLUGGABLE_DEVICES];
static pthread_mutex_t first_call = PTHREAD_MUTEX_INITIALIZER;
static atomic_uint lanes_taken;
static _Thread_local unsigned lane = ~0u;
static _Thread_local unsigned next_slot;

// cudaMalloc of the process: in the global scope, else in a libcudart
// already loaded (RTLD_NOLOAD: never loads one).
static cuda_malloc_fn find_cuda_malloc(void) {
  static const char* names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};
  void* f = dlsym(RTLD_DEFAULT, "cudaMalloc");
  for (size_t i = 0; !f && i < sizeof names / sizeof names[0]; i++) {
    void* h = dlopen(names[i], RTLD_LAZY | RTLD_NOLOAD);
    if (h) f = dlsym(h, "cudaMalloc");
  }
  return (cuda_malloc_fn)f;
}

// The device's block, made on its first call (one thread makes it, the
// others wait on the mutex); NULL when cudaMalloc is missing or fails, and
// then the next call tries again.
static void* block_of(int device) {
  void* b = atomic_load_explicit(&blocks[device], memory_order_acquire);
  if (b) return b;
  pthread_mutex_lock(&first_call);
  b = atomic_load_explicit(&blocks[device], memory_order_relaxed);
  if (!b) {
    cuda_malloc_fn cuda_malloc = find_cuda_malloc();
    void* p = NULL;
    if (cuda_malloc && cuda_malloc(&p, NULL_PLUGGABLE_BLOCK) == 0) b = p;
    atomic_store_explicit(&blocks[device], b, memory_order_release);
  }
  pthread_mutex_unlock(&first_call);
  return b;
}

// The next address of the calling thread's lane in the device's block, for
// any request of at most NULL_PLUGGABLE_BLOCK bytes; else NULL.
void* null_malloc(ssize_t size, int device, void* stream) {
  (void)stream;
  if (size < 0 || size > NULL_PLUGGABLE_BLOCK || device < 0 || device >= NULL_PLUGGABLE_DEVICES)
    return NULL;
  char* b = block_of(device);
  if (!b) return NULL;
  if (lane == ~0u) lane = atomic_fetch_add_explicit(&lanes_taken, 1, memory_order_relaxed) %
                          NULL_PLUGGABLE_LANES;
  unsigned slot = next_slot++ % NULL_PLUGGABLE_SLOTS;
  return b + ((size_t)lane * NULL_PLUGGABLE_SLOTS + slot) * NULL_PLUGGABLE_STEP;
}

// Nothing to give back: every request lies in the device's block.
void null_free(void* ptr, ssize_t size, int device, void* stream) {
  (void)ptr;
  (void)size;
  (void)device;
  (void)stream;
}
