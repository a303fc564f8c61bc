"""GPU tests of one gpualloc cache for PyTorch, CuPy and Numba (run on a machine with a GPU,
torch, CuPy and numba-cuda; the library built, or carried by `cargo xtask test-gpu --bundle`):

    GPUALLOC_SO=target/release/liballoc_ffi.so python3 python/tests/gpu_libraries.py [SCENARIO...]

Each scenario runs in a process of its own (allocators are chosen once per process) and prints
PASS or FAIL with its figures; the exit status is non-zero if any failed (a missing package
fails its scenarios too).
"""
import os
import subprocess
import sys

import scenarios  # the runner shared with gpu_torch.py (this script's folder)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MIB = 1 << 20

# A kernel that waits `ns` nanoseconds of GPU time (%globaltimer), then copies src to dst:
# the reader that must still see the old contents of a freed block.
SPIN_COPY = r"""
extern "C" __global__ void spin_copy(const float* src, float* dst, long long n, long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"""


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def with_cupy():
    import cupy
    import gpu_alloc

    cupy.cuda.set_allocator(gpu_alloc.cupy_allocator)
    return gpu_alloc, cupy


def spin_copy(cupy):
    kernel = cupy.RawKernel(SPIN_COPY, "spin_copy")

    def launch(src, dst, ns):
        kernel((64,), (256,), (src, dst, cupy.int64(src.size), cupy.int64(ns)))

    warm = cupy.ones(1024, dtype=cupy.float32)
    launch(warm, cupy.empty_like(warm), 0)  # compile and load before any timing matters
    cupy.cuda.Device().synchronize()
    return launch


def scenario_cupy_basic():
    gpu_alloc, cupy = with_cupy()
    before = gpu_alloc.memory_allocated(0)
    sizes = [1, 511, 4096, 3 * MIB + 5, 64 * MIB]
    arrays = [cupy.arange(n // 4 + 1, dtype=cupy.float32) for n in sizes]
    for a in arrays:
        check(float(a[-1]) == a.size - 1, "data of %d floats" % a.size)
    del a
    held = gpu_alloc.memory_allocated(0) - before
    need = sum(a.nbytes for a in arrays)
    check(held >= need, "memory_allocated grew by %d for %d bytes of arrays" % (held, need))
    big = arrays[-1].data.ptr
    del arrays
    check(gpu_alloc.memory_allocated(0) == before, "every block back after del")
    reserved = gpu_alloc.memory_reserved(0)
    again = cupy.empty(64 * MIB // 4 + 1, dtype=cupy.float32)
    check(again.data.ptr == big, "the freed block served the same size again")
    check(gpu_alloc.memory_reserved(0) == reserved, "no new memory reserved")
    with cupy.cuda.Stream() as s:
        on_stream = cupy.ones(MIB, dtype=cupy.float32) * 3
        total = float(on_stream.sum())
        s.synchronize()
    check(total == 3.0 * MIB, "a stream's array")
    empty = cupy.empty(0)
    check(empty.data.ptr == 0 and empty.size == 0, "zero-size array")
    try:
        cupy.empty(1 << 50, dtype=cupy.uint8)
        raise AssertionError("a 1 PiB array was allocated")
    except cupy.cuda.memory.OutOfMemoryError as e:
        check(isinstance(e.__cause__, gpu_alloc.GpuAllocError), "OOM chained to our report")
    return "%d arrays (%d bytes) from gpualloc, freed block reused, stream array, OOM as CuPy's" % (
        len(sizes), need)


def _reuse_hazard(cupy, launch, stream, record, n=8 * MIB // 4):
    """x (n floats) on the null stream, read by a 300 ms kernel on `stream`, freed; the same
    size is then allocated on the null stream and overwritten. Returns (whether what the
    kernel read is intact, whether the new block has x's address)."""
    x = cupy.full(n, 1.0, dtype=cupy.float32)
    y = cupy.zeros(n, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    old = x.data.ptr
    with stream:
        launch(x, y, 300_000_000)
    record(x)
    del x  # under the null stream
    z = cupy.full(n, 2.0, dtype=cupy.float32)  # queued on the null stream at once
    reused = z.data.ptr == old
    cupy.cuda.Device().synchronize()
    return bool((y == 1.0).all()), reused


def scenario_cupy_streams():
    gpu_alloc, cupy = with_cupy()
    launch = spin_copy(cupy)
    s = cupy.cuda.Stream(non_blocking=True)
    intact, reused = _reuse_hazard(cupy, launch, s, lambda x: gpu_alloc.cupy.record_stream(x, s))
    check(intact and not reused, "record_stream: intact %s, reused %s" % (intact, reused))
    # Freed while the reading stream is current: recorded without being asked.
    n = 8 * MIB // 4
    x = cupy.full(n, 1.0, dtype=cupy.float32)
    y = cupy.zeros(n, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    old = x.data.ptr
    with s:
        launch(x, y, 300_000_000)
        del x
    z = cupy.full(n, 2.0, dtype=cupy.float32)
    check(z.data.ptr != old, "a block freed under its reader's stream was reused at once")
    cupy.cuda.Device().synchronize()
    check(bool((y == 1.0).all()), "the reader saw the block overwritten")
    # The control: without a record the block comes back at once (what the record prevents).
    # A size no earlier block had, so that x's block is the only free one that fits.
    intact, reused = _reuse_hazard(cupy, launch, s, lambda x: None, n=26 * MIB // 4)
    check(reused, "without record_stream the same block comes back at once")
    return "block not reused while another stream reads it (record_stream, and a free under " \
           "that stream); without a record it is (the reader's data intact then: %s)" % intact


def scenario_dlpack():
    import gpu_alloc

    gpu_alloc.enable()
    import torch

    gpu_alloc, cupy = with_cupy()
    launch = spin_copy(cupy)
    n = 8 * MIB // 4
    # torch -> CuPy: CuPy's stream reads a tensor that torch frees.
    t = torch.full((n,), 1.0, device="cuda")
    c = cupy.from_dlpack(t)
    check(c.data.ptr == t.data_ptr(), "zero-copy view")
    y = cupy.zeros(n, dtype=cupy.float32)
    torch.cuda.synchronize()
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        launch(c, y, 300_000_000)
    t.record_stream(torch.cuda.ExternalStream(s.ptr))
    old = t.data_ptr()
    del t, c
    u = torch.full((n,), 2.0, device="cuda")
    check(u.data_ptr() != old, "torch reused the block while CuPy's stream read it")
    torch.cuda.synchronize()
    check(bool((y == 1.0).all()), "CuPy's stream read an overwritten block")
    # CuPy -> torch: a torch side stream reads an array that CuPy frees.
    x = cupy.full(n, 1.0, dtype=cupy.float32)
    v = torch.from_dlpack(x)
    check(v.data_ptr() == x.data.ptr, "zero-copy view")
    cupy.cuda.Device().synchronize()
    b = torch.cuda.Stream()
    with torch.cuda.stream(b):
        # b's first allocations first: a new segment's cuMemAlloc may synchronize the
        # device, which would end the sleep before the free below.
        seen = v.sum()
        torch.cuda._sleep(500_000_000)
        torch.sum(v, 0, out=seen)
    gpu_alloc.cupy.record_stream(x, b)
    old = x.data.ptr
    del v, x
    z = cupy.full(n, 2.0, dtype=cupy.float32)
    check(z.data.ptr != old, "CuPy reused the block while torch's stream read it")
    torch.cuda.synchronize()
    check(seen.item() == float(n), "torch's stream read %s" % seen.item())
    both = gpu_alloc.memory_allocated(0)
    check(torch.cuda.memory_allocated(0) == both, "torch's and our counts agree")
    return "DLPack both ways from one pool; neither block reused while the other side read it"


def numba_kernels_on_this_numpy():
    """numba-cuda releases made before numpy 2.4 name np.row_stack (removed there; it was
    np.vstack) when their first kernel compiles: alias it, so that this test's kernels
    compile on such a pairing. Our memory manager is not involved."""
    import numpy as np

    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


def with_numba():
    numba_kernels_on_this_numpy()
    from numba import cuda

    import gpu_alloc.numba

    cuda.set_memory_manager(gpu_alloc.numba.GpuAllocNumbaManager)
    return gpu_alloc, cuda


def scenario_numba():
    import numpy as np

    gpu_alloc, cuda = with_numba()

    @cuda.jit
    def add_one(a):
        i = cuda.grid(1)
        if i < a.size:
            a[i] += 1

    before = gpu_alloc.memory_allocated(0)
    host = np.arange(1 << 20, dtype=np.float32)
    d = cuda.to_device(host)
    manager = cuda.current_context().memory_manager
    check(isinstance(manager, gpu_alloc.numba.GpuAllocNumbaManager), "our manager is in use")
    check(gpu_alloc.memory_allocated(0) - before >= host.nbytes, "the array is ours")
    add_one[(host.size + 255) // 256, 256](d)
    check((d.copy_to_host() == host + 1).all(), "kernel result")
    old = d.device_ctypes_pointer.value
    del d
    e = cuda.device_array(1 << 20, dtype=np.float32)
    check(e.device_ctypes_pointer.value == old, "the freed block served the next array")
    info = cuda.current_context().get_memory_info()
    check(0 < info.free <= info.total, "memory info %s" % (info,))
    requests = gpu_alloc.host_stats()["requests"]
    pinned = cuda.pinned_array(1 << 20, dtype=np.float32)
    pinned[:] = 5
    check(gpu_alloc.host_stats()["requests"] == requests + 1, "pinned array from our pool")
    s = cuda.stream()
    dp = cuda.to_device(pinned, stream=s)
    s.synchronize()
    check((dp.copy_to_host() == 5).all(), "async copy from pinned memory")
    mapped = cuda.mapped_array(16, dtype=np.float32)  # Numba's own (mapped)
    mapped[:] = 1
    pinned_in_place = _numba_mempin(gpu_alloc, cuda, add_one, s)
    with cuda.defer_cleanup():
        held = gpu_alloc.memory_allocated(0)
        del e
        check(gpu_alloc.memory_allocated(0) == held, "the free is held back in defer_cleanup")
    check(gpu_alloc.memory_allocated(0) < held, "the held free happened at the end")
    handle = dp.get_ipc_handle()
    offset = handle._ipc_handle.offset
    seen = _open_in_another_process(handle)
    check(seen == 5.0 * (1 << 20), "the other process read %s" % seen)
    return "kernel on our memory, block reused, pinned host allocator, %s, defer_cleanup, " \
        "IPC read by another process (offset %d in its segment)" % (pinned_in_place, offset)


def _numba_mempin(gpu_alloc, cuda, add_one, stream):
    """cuda.pinned / cuda.mapped of numpy arrays: pinned in place through gpualloc (counted as
    registered bytes while pinned), unpinned at the end of the with block."""
    import numpy as np

    arr = np.full(1 << 20, 3, dtype=np.float32)
    base = gpu_alloc.host_stats()
    with cuda.pinned(arr):
        during = gpu_alloc.host_stats()
        check(during["registered_bytes"] == base["registered_bytes"] + arr.nbytes,
              "the pinned numpy array is counted: %s" % during)
        check(during["host_registers"] == base["host_registers"] + 1, "one registration")
        d = cuda.to_device(arr, stream=stream)
        stream.synchronize()
        check((d.copy_to_host() == 3).all(), "async copy from the pinned array")
    check(gpu_alloc.host_stats()["registered_bytes"] == base["registered_bytes"],
          "unpinned at the end of the with block")
    with cuda.pinned(arr):  # again at once: the unpin was not deferred
        pass
    m = np.zeros(256, dtype=np.float32)
    with cuda.mapped(m) as dm:
        check(gpu_alloc.host_stats()["registered_bytes"] == base["registered_bytes"] + m.nbytes,
              "the mapped numpy array is counted")
        add_one[1, 256](dm)
        cuda.synchronize()
    check((m == 1).all(), "a kernel wrote the host array through its mapping")
    after = gpu_alloc.host_stats()
    check(after["registered_bytes"] == base["registered_bytes"], "unmapped at the end: %s" % after)
    check(after["host_unregisters"] == base["host_unregisters"] + 3, "three unpins")
    return "cuda.pinned/cuda.mapped numpy arrays pinned in place (%d bytes counted while pinned)" \
        % arr.nbytes


def _open_in_another_process(handle):
    """The sum another process reads through a Numba IPC array handle."""
    import pickle
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".pickle") as f:
        pickle.dump(handle, f)
        f.flush()
        code = ("import pickle, sys\nfrom numba import cuda\n"
                "h = pickle.load(open(sys.argv[1], 'rb'))\n"
                "a = h.open()\nprint(float(a.copy_to_host().sum()))\nh.close()\n")
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_CUDA_MEMORY_MANAGER"}
        r = subprocess.run([sys.executable, "-c", code, f.name], capture_output=True,
                           text=True, timeout=300, env=env)
    check(r.returncode == 0, "the receiver failed: " + r.stderr[-2000:])
    return float(r.stdout.split()[-1])


def scenario_numba_env():
    """NUMBA_CUDA_MEMORY_MANAGER=gpu_alloc (set by the runner for this scenario)."""
    import numpy as np
    from numba import cuda

    import gpu_alloc

    check(os.environ.get("NUMBA_CUDA_MEMORY_MANAGER") == "gpu_alloc", "env var set")
    d = cuda.to_device(np.ones(1024, dtype=np.float32))
    manager = cuda.current_context().memory_manager
    check(type(manager).__name__ == "GpuAllocNumbaManager", "manager %r" % manager)
    check(gpu_alloc.memory_allocated(0) >= d.nbytes, "the array is ours")
    return "NUMBA_CUDA_MEMORY_MANAGER=gpu_alloc selects %s" % type(manager).__name__


def scenario_shared_cache():
    import gpu_alloc

    gpu_alloc.enable()
    import numpy as np
    import torch

    gpu_alloc, cupy = with_cupy()
    gpu_alloc, cuda = with_numba()
    n = 64 * MIB // 4
    t = torch.empty(n, device="cuda")
    first = t.data_ptr()
    del t
    reserved = gpu_alloc.memory_reserved(0)
    c = cupy.empty(n, dtype=cupy.float32)
    check(c.data.ptr == first, "CuPy got torch's freed block")
    del c
    d = cuda.device_array(n, dtype=np.float32)
    check(d.device_ctypes_pointer.value == first, "Numba got CuPy's freed block")
    del d
    t = torch.empty(n, device="cuda")
    check(t.data_ptr() == first, "torch got Numba's freed block")
    check(gpu_alloc.memory_reserved(0) == reserved, "nothing more reserved")
    c = cupy.empty(n, dtype=cupy.float32)
    d = cuda.device_array(n, dtype=np.float32)
    ours = gpu_alloc.memory_allocated(0)
    check(ours >= 3 * n * 4, "all three counted: %d" % ours)
    check(torch.cuda.memory_allocated(0) == ours, "torch.cuda.memory_stats counts all three")
    check(torch.cuda.memory_stats(0)["allocation.all.current"] >= 3, "three allocations")
    del t, c, d
    return "one 64 MiB block passed torch -> CuPy -> Numba -> torch; %d MiB reserved; stats " \
           "count all three" % (reserved // MIB)


SCENARIOS = {
    name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")
}
ENV = {"numba_env": {"NUMBA_CUDA_MEMORY_MANAGER": "gpu_alloc"}}


def child_env(name):
    """A scenario's environment: gpu_alloc importable, plus the scenario's own variables."""
    env = dict(os.environ, **ENV.get(name, {}))
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(HERE)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


if __name__ == "__main__":
    sys.exit(scenarios.main(__file__, SCENARIOS, sys.argv[1:], env_for=child_env, width=14))
