/*
 * A libcuda.so that does no device work: enough of the CUDA driver API for
 * an allocator to be created, take segments, make contexts and streams and
 * record events, each call returning at once. With it on LD_LIBRARY_PATH,
 * `gpu_bench --paths` measures the host cost of the allocator's own code
 * (the Rust path and the C library path over one engine) on a machine
 * without a GPU. Device addresses are handed out from a bump counter and
 * never dereferenced; nothing here is a substitute for the real driver in
 * any test of correctness.
 *
 * Failure injection, for tests that check what the allocator does when a
 * driver call fails: null_cuda_fail_at("cuMemAlloc_v2", 3, 2) makes the
 * third call of cuMemAlloc_v2 from now return 2 (CUDA_ERROR_OUT_OF_MEMORY),
 * once (null_cuda_fail_times(name, 3, 4, 2): the third to the sixth
 * call); null_cuda_calls(name) counts the calls of a function since the
 * first null_cuda_fail_at (counting costs nothing before it), and
 * null_cuda_function(i) names the i-th function that can fail (NULL past
 * the last). One failure is armed at a time, for the whole process.
 *
 * Build: cc -O2 -shared -fPIC -o libcuda.so.1 null_cuda.c (run.sh does it).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_SUPPORTED 801

#define DEVICE_BYTES (80ULL << 30)
#define MAX_DEVICES 8

/* Every function that can be made to fail, in the order of the table. */
#define NULL_CUDA_FUNCTIONS(X) \
    X(cuInit) X(cuDriverGetVersion) X(cuDeviceGetCount) X(cuDeviceGet) \
    X(cuDeviceGetName) X(cuDeviceGetAttribute) X(cuDevicePrimaryCtxRetain) \
    X(cuDevicePrimaryCtxRelease_v2) X(cuCtxCreate_v4) X(cuCtxDestroy_v2) \
    X(cuCtxSetCurrent) X(cuCtxGetCurrent) X(cuCtxGetDevice) X(cuCtxSynchronize) \
    X(cuMemGetInfo_v2) X(cuMemAlloc_v2) X(cuMemFree_v2) X(cuMemHostAlloc) \
    X(cuMemFreeHost) X(cuMemHostRegister_v2) X(cuMemHostUnregister) \
    X(cuStreamCreate) X(cuStreamDestroy_v2) X(cuStreamSynchronize) \
    X(cuStreamWaitEvent) X(cuEventCreate) X(cuEventDestroy_v2) X(cuEventRecord) \
    X(cuEventQuery) X(cuEventSynchronize) X(cuDeviceTotalMem_v2)

#define NULL_CUDA_ENUM(f) F_##f,
enum { NULL_CUDA_FUNCTIONS(NULL_CUDA_ENUM) F_COUNT };
#define NULL_CUDA_NAME(f) #f,
static const char *const names[F_COUNT] = { NULL_CUDA_FUNCTIONS(NULL_CUDA_NAME) };

static int injecting;               /* set by the first null_cuda_fail_at */
static long long calls[F_COUNT];
static int armed = -1;              /* the function to fail, or -1 */
static long long fail_call;         /* ... from this value of its counter */
static long long fail_last;         /* ... to this one */
static CUresult fail_code;

/* Counts a call of `f` and returns the code armed for it, if this is the
 * call to fail (0 otherwise). */
static CUresult fault(int f) {
    if (__builtin_expect(!injecting, 1)) return CUDA_SUCCESS;
    long long n = __atomic_add_fetch(&calls[f], 1, __ATOMIC_RELAXED);
    if (f == __atomic_load_n(&armed, __ATOMIC_ACQUIRE) && n >= fail_call && n <= fail_last) {
        if (n == fail_last) __atomic_store_n(&armed, -1, __ATOMIC_RELEASE);
        return fail_code;
    }
    return CUDA_SUCCESS;
}
#define FAULT(f) do { CUresult r_ = fault(F_##f); if (r_) return r_; } while (0)

static int lookup(const char *name) {
    for (int i = 0; name && i < F_COUNT; i++)
        if (strcmp(names[i], name) == 0) return i;
    return -1;
}

/* Makes `count` calls of `name` from the `nth` from now (1: the next)
 * return `code`; name NULL (or nth or count <= 0) disarms. -1 for a name
 * this library lacks. */
int null_cuda_fail_times(const char *name, long long nth, long long count, int code) {
    injecting = 1;
    __atomic_store_n(&armed, -1, __ATOMIC_RELEASE);
    if (!name || nth <= 0 || count <= 0) return 0;
    int f = lookup(name);
    if (f < 0) return -1;
    fail_call = __atomic_load_n(&calls[f], __ATOMIC_RELAXED) + nth;
    fail_last = fail_call + count - 1;
    fail_code = code;
    __atomic_store_n(&armed, f, __ATOMIC_RELEASE);
    return 0;
}

/* Makes the `nth` call (1: the next) of `name` from now return `code`. */
int null_cuda_fail_at(const char *name, long long nth, int code) {
    return null_cuda_fail_times(name, nth, 1, code);
}

/* Calls of `name` counted so far; -1 for a name this library lacks. */
long long null_cuda_calls(const char *name) {
    int f = lookup(name);
    return f < 0 ? -1 : __atomic_load_n(&calls[f], __ATOMIC_RELAXED);
}

/* Whether the armed failure is still to come (1) or was spent (0). */
int null_cuda_armed(void) { return __atomic_load_n(&armed, __ATOMIC_ACQUIRE) >= 0; }

/* The i-th function that can fail, NULL past the last. */
const char *null_cuda_function(int i) { return i >= 0 && i < F_COUNT ? names[i] : 0; }

/* One primary context per device; NULL_CUDA_DEVICES (1 to 8, default 1)
 * says how many devices there are. */
static char contexts[MAX_DEVICES];
static __thread CUcontext current;
/* Taken by several threads at once (one allocator per device). */
static CUdeviceptr next_addr = 0x7f0000000000ULL;

static int device_count(void) {
    const char *v = getenv("NULL_CUDA_DEVICES");
    int n = v ? atoi(v) : 1;
    return n < 1 ? 1 : n > MAX_DEVICES ? MAX_DEVICES : n;
}

CUresult cuInit(unsigned flags) {
    FAULT(cuInit);
    (void)flags;
    return CUDA_SUCCESS;
}
CUresult cuDriverGetVersion(int *v) {
    FAULT(cuDriverGetVersion);
    *v = 13000;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetCount(int *n) {
    FAULT(cuDeviceGetCount);
    *n = device_count();
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    FAULT(cuDeviceGet);
    if (ordinal < 0 || ordinal >= device_count()) return CUDA_ERROR_INVALID_VALUE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    FAULT(cuDeviceGetName);
    (void)d;
    strncpy(name, "null driver (no device work)", (size_t)len);
    if (len > 0) name[len - 1] = 0;
    return CUDA_SUCCESS;
}

/* Every capability is absent (0), so the allocator takes its plain paths:
 * no memory pools, no virtual memory management, no IPC handles. */
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
    FAULT(cuDeviceGetAttribute);
    (void)attr; (void)d;
    *v = 0;
    return CUDA_SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t *g, const void *prop, int option) {
    (void)g; (void)prop; (void)option;
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
    FAULT(cuDevicePrimaryCtxRetain);
    if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_VALUE;
    *c = (CUcontext)&contexts[d];
    return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    FAULT(cuDevicePrimaryCtxRelease_v2);
    (void)d;
    return CUDA_SUCCESS;
}

/* Non-primary contexts: distinct heap addresses, as streams below. */
CUresult cuCtxCreate_v4(CUcontext *c, void *params, unsigned flags, CUdevice d) {
    FAULT(cuCtxCreate_v4);
    (void)params; (void)flags; (void)d;
    *c = malloc(16);
    if (!*c) return CUDA_ERROR_INVALID_VALUE;
    current = *c;
    return CUDA_SUCCESS;
}
CUresult cuCtxDestroy_v2(CUcontext c) {
    FAULT(cuCtxDestroy_v2);
    if (current == c) current = 0;
    free(c);
    return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext c) {
    FAULT(cuCtxSetCurrent);
    current = c;
    return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext *c) {
    FAULT(cuCtxGetCurrent);
    *c = current;
    return CUDA_SUCCESS;
}
/* The device of a primary context; non-primary ones are device 0's. */
CUresult cuCtxGetDevice(CUdevice *d) {
    FAULT(cuCtxGetDevice);
    char *c = (char *)current;
    *d = c >= contexts && c < contexts + MAX_DEVICES ? (int)(c - contexts) : 0;
    return CUDA_SUCCESS;
}
CUresult cuCtxSynchronize(void) {
    FAULT(cuCtxSynchronize);
    return CUDA_SUCCESS;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    FAULT(cuMemGetInfo_v2);
    *free_bytes = DEVICE_BYTES;
    *total = DEVICE_BYTES;
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t *total, CUdevice d) {
    FAULT(cuDeviceTotalMem_v2);
    (void)d;
    *total = DEVICE_BYTES;
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes) {
    FAULT(cuMemAlloc_v2);
    CUdeviceptr span = (bytes + 0x1fffff) & ~(CUdeviceptr)0x1fffff;
    *p = __atomic_fetch_add(&next_addr, span, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
    FAULT(cuMemFree_v2);
    (void)p;
    return CUDA_SUCCESS;
}

/* Pinned host memory is ordinary memory here. */
CUresult cuMemHostAlloc(void **p, size_t bytes, unsigned flags) {
    FAULT(cuMemHostAlloc);
    (void)flags;
    *p = malloc(bytes ? bytes : 1);
    return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult cuMemFreeHost(void *p) {
    FAULT(cuMemFreeHost);
    free(p);
    return CUDA_SUCCESS;
}

/* Page-locking caller memory: nothing to do but accept it. */
CUresult cuMemHostRegister_v2(void *p, size_t bytes, unsigned flags) {
    FAULT(cuMemHostRegister_v2);
    (void)flags;
    return p && bytes ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuMemHostUnregister(void *p) {
    FAULT(cuMemHostUnregister);
    return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* The driver's stream-ordered pool, for benchmarks that time it beside the
 * allocator (gpu_bench --threads): addresses from the same bump counter. */
static char pools[MAX_DEVICES];
CUresult cuDeviceGetDefaultMemPool(void **pool, CUdevice d) {
    if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_VALUE;
    *pool = &pools[d];
    return CUDA_SUCCESS;
}
CUresult cuMemPoolSetAttribute(void *pool, int attr, void *value) {
    (void)pool; (void)attr; (void)value;
    return CUDA_SUCCESS;
}
CUresult cuMemPoolTrimTo(void *pool, size_t keep) { (void)pool; (void)keep; return CUDA_SUCCESS; }
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t bytes, CUstream s) {
    (void)s;
    return cuMemAlloc_v2(p, bytes);
}
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { (void)p; (void)s; return CUDA_SUCCESS; }

/* Streams and events are distinct heap addresses, so that handles stay
 * unique while they live, as the driver's are. */
CUresult cuStreamCreate(CUstream *s, unsigned flags) {
    FAULT(cuStreamCreate);
    (void)flags;
    *s = malloc(16);
    return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuStreamDestroy_v2(CUstream s) {
    FAULT(cuStreamDestroy_v2);
    free(s);
    return CUDA_SUCCESS;
}
CUresult cuStreamSynchronize(CUstream s) {
    FAULT(cuStreamSynchronize);
    (void)s;
    return CUDA_SUCCESS;
}
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned f) {
    FAULT(cuStreamWaitEvent);
    (void)s; (void)e; (void)f;
    return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent *e, unsigned flags) {
    FAULT(cuEventCreate);
    (void)flags;
    *e = malloc(16);
    return *e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuEventDestroy_v2(CUevent e) {
    FAULT(cuEventDestroy_v2);
    free(e);
    return CUDA_SUCCESS;
}
CUresult cuEventRecord(CUevent e, CUstream s) {
    FAULT(cuEventRecord);
    (void)e; (void)s;
    return CUDA_SUCCESS;
}
CUresult cuEventQuery(CUevent e) {
    FAULT(cuEventQuery);
    (void)e;
    return CUDA_SUCCESS;
}
CUresult cuEventSynchronize(CUevent e) {
    FAULT(cuEventSynchronize);
    (void)e;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult r, const char **s) {
    (void)r;
    *s = "null driver error";
    return CUDA_SUCCESS;
}
CUresult cuGetErrorName(CUresult r, const char **s) {
    (void)r;
    *s = "CUDA_ERROR_NULL_DRIVER";
    return CUDA_SUCCESS;
}
