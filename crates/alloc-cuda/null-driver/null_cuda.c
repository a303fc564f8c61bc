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
#define CUDA_ERROR_NOT_SUPPORTED 801

#define DEVICE_BYTES (80ULL << 30)
#define MAX_DEVICES 8

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

CUresult cuInit(unsigned flags) { (void)flags; return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *n) { *n = device_count(); return CUDA_SUCCESS; }

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (ordinal < 0 || ordinal >= device_count()) return CUDA_ERROR_INVALID_VALUE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    (void)d;
    strncpy(name, "null driver (no device work)", (size_t)len);
    if (len > 0) name[len - 1] = 0;
    return CUDA_SUCCESS;
}

/* Every capability is absent (0), so the allocator takes its plain paths:
 * no memory pools, no virtual memory management, no IPC handles. */
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
    (void)attr; (void)d;
    *v = 0;
    return CUDA_SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t *g, const void *prop, int option) {
    (void)g; (void)prop; (void)option;
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
    if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_VALUE;
    *c = (CUcontext)&contexts[d];
    return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { (void)d; return CUDA_SUCCESS; }

/* Non-primary contexts: distinct heap addresses, as streams below. */
CUresult cuCtxCreate_v4(CUcontext *c, void *params, unsigned flags, CUdevice d) {
    (void)params; (void)flags; (void)d;
    *c = malloc(16);
    if (!*c) return CUDA_ERROR_INVALID_VALUE;
    current = *c;
    return CUDA_SUCCESS;
}
CUresult cuCtxDestroy_v2(CUcontext c) {
    if (current == c) current = 0;
    free(c);
    return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext c) { current = c; return CUDA_SUCCESS; }
CUresult cuCtxGetCurrent(CUcontext *c) { *c = current; return CUDA_SUCCESS; }
/* The device of a primary context; non-primary ones are device 0's. */
CUresult cuCtxGetDevice(CUdevice *d) {
    char *c = (char *)current;
    *d = c >= contexts && c < contexts + MAX_DEVICES ? (int)(c - contexts) : 0;
    return CUDA_SUCCESS;
}
CUresult cuCtxSynchronize(void) { return CUDA_SUCCESS; }

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    *free_bytes = DEVICE_BYTES;
    *total = DEVICE_BYTES;
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes) {
    CUdeviceptr span = (bytes + 0x1fffff) & ~(CUdeviceptr)0x1fffff;
    *p = __atomic_fetch_add(&next_addr, span, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}
CUresult cuMemFree_v2(CUdeviceptr p) { (void)p; return CUDA_SUCCESS; }

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
    (void)flags;
    *s = malloc(16);
    return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuStreamDestroy_v2(CUstream s) { free(s); return CUDA_SUCCESS; }
CUresult cuStreamSynchronize(CUstream s) { (void)s; return CUDA_SUCCESS; }
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned f) {
    (void)s; (void)e; (void)f;
    return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent *e, unsigned flags) {
    (void)flags;
    *e = malloc(16);
    return *e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuEventDestroy_v2(CUevent e) { free(e); return CUDA_SUCCESS; }
CUresult cuEventRecord(CUevent e, CUstream s) { (void)e; (void)s; return CUDA_SUCCESS; }
CUresult cuEventQuery(CUevent e) { (void)e; return CUDA_SUCCESS; }
CUresult cuEventSynchronize(CUevent e) { (void)e; return CUDA_SUCCESS; }

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
