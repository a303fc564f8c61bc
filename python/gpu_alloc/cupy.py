"""CuPy on gpualloc: one cache for CuPy, PyTorch and Numba in a process.

    import cupy, gpu_alloc
    cupy.cuda.set_allocator(gpu_alloc.cupy_allocator)
    x = cupy.zeros(1 << 20)            # from gpualloc, on CuPy's current stream

``cupy_allocator(nbytes)`` follows CuPy's convention for outside allocators: it returns a
``cupy.cuda.MemoryPointer`` over a ``cupy.cuda.UnownedMemory`` whose owner gives the block
back to gpualloc's cache when CuPy drops the memory. Blocks come from the allocator of the
current device, the one PyTorch uses after ``gpu_alloc.enable()`` and Numba uses through
``gpu_alloc.numba``, for CuPy's current stream: a block freed by any of them is reused by the
next request of any of them on the same stream (PyTorch's, CuPy's and Numba's default
streams are all the legacy default stream), and ``gpu_alloc.memory_stats()`` (or, with
enable(), ``torch.cuda.memory_stats()``) counts all of them.

Streams: a block is reused on the stream it was allocated on without waiting. When CuPy frees
it while another stream of the same device is current (``with stream: ... del x``), that
stream is recorded first, so the block is not handed out again before the work queued there
has finished. For any other stream that read the memory, call ``record_stream(x, stream)``
before dropping the last reference (``Tensor.record_stream`` does the same for a torch tensor
made from a CuPy array through DLPack, and the other way round). The streams CuPy allocated
on are kept alive for the life of the process, as gpualloc requires of a stream that blocks
may be cached for.

Out of memory raises ``cupy.cuda.memory.OutOfMemoryError`` (gpualloc has already freed its
cache and retried), chained to a GpuAllocError with gpualloc's report.
"""

import ctypes

import gpu_alloc
from gpu_alloc import _libraries

cupy = _libraries.require("cupy", "gpu_alloc.cupy_allocator")

__all__ = ["cupy_allocator", "record_stream", "kept_streams"]

_lib = None  # the library, once the first allocation loaded it
_streams = _libraries.StreamKeeper()
_MemoryPointer = cupy.cuda.MemoryPointer
_UnownedMemory = cupy.cuda.UnownedMemory


def _current_stream_ptr():
    """The handle of CuPy's current stream on the current device (0: the legacy default
    stream), through CuPy's public API."""
    return cupy.cuda.get_current_stream().ptr


_get_device = cupy.cuda.runtime.getDevice


def _library():
    global _lib
    if _lib is None:
        _lib = _libraries.library()
    return _lib


class _Block:
    """The owner of one block: CuPy's UnownedMemory holds it, and when CuPy drops that, the
    block goes back to gpualloc's cache."""

    __slots__ = ("ptr", "size", "device", "stream")

    def __init__(self, ptr, size, device, stream):
        self.ptr = ptr
        self.size = size
        self.device = device
        self.stream = stream

    def __del__(self):
        _release(self.ptr, self.size, self.device, self.stream)


def _release(ptr, size, device, stream):
    """Gives a block back, first recording the current stream of its device when that is
    not the block's own (so that CuPy work queued there finishes before any reuse)."""
    lib = _lib
    if lib is None:  # torn down at exit
        return
    try:
        if _get_device() == device:
            current = _current_stream_ptr()
            if current != stream:
                if not _streams.knows(current):
                    _streams.keep(current, cupy.cuda.get_current_stream())
                lib.gpualloc_record_stream(ctypes.c_void_p(ptr), device, ctypes.c_void_p(current))
    except Exception:  # noqa: BLE001 - a finalizer must not raise; the free below still runs
        pass
    lib.gpualloc_free(ctypes.c_void_p(ptr), size, device, None)


def cupy_allocator(nbytes):
    """CuPy's allocator function (``cupy.cuda.set_allocator(gpu_alloc.cupy_allocator)``):
    ``nbytes`` from gpualloc on the current device for CuPy's current stream, as a
    ``cupy.cuda.MemoryPointer``. Raises ``cupy.cuda.memory.OutOfMemoryError`` when the
    device is full, GpuAllocError on any other failure."""
    device = _get_device()
    if nbytes == 0:
        return _MemoryPointer(_UnownedMemory(0, 0, None, device), 0)
    lib = _lib if _lib is not None else _library()
    stream = _current_stream_ptr()
    if not _streams.knows(stream):
        _streams.keep(stream, cupy.cuda.get_current_stream())
    ptr = lib.gpualloc_malloc(nbytes, device, stream)
    if not ptr:
        _raise_failure(lib, nbytes, device)
    block = _Block(ptr, nbytes, device, stream)
    return _MemoryPointer(_UnownedMemory(ptr, nbytes, block, device), 0)


def _raise_failure(lib, nbytes, device):
    code = lib.gpualloc_last_error_code()
    message = gpu_alloc.last_error() or "unknown error"
    error = gpu_alloc.GpuAllocError(
        "gpu_alloc.cupy_allocator(%d bytes, device %d): %s" % (nbytes, device, message), code
    )
    if code == gpu_alloc.ERR_OUT_OF_MEMORY:
        allocated = gpu_alloc.memory_stats(device)["allocated_bytes.all.current"]
        raise cupy.cuda.memory.OutOfMemoryError(nbytes, allocated) from error
    raise error


def record_stream(array, stream):
    """Declares that work queued on ``stream`` (a CuPy, PyTorch or Numba stream, or a raw
    handle) uses the memory of ``array`` (a cupy.ndarray, or a MemoryPointer from
    cupy_allocator): once CuPy frees it, gpualloc reuses the block only after that work has
    finished (events on the stream, no host wait). Raises ValueError for memory gpualloc did
    not allocate."""
    pointer = getattr(array, "data", array)  # ndarray -> MemoryPointer
    memory = getattr(pointer, "mem", pointer)  # MemoryPointer -> its UnownedMemory
    handle = _libraries.stream_handle(stream)
    if not _streams.knows(handle):
        _streams.keep(handle, stream)
    lib = _library()
    code = lib.gpualloc_record_stream(
        ctypes.c_void_p(memory.ptr), memory.device_id, ctypes.c_void_p(handle)
    )
    gpu_alloc._check(code, "gpu_alloc.cupy.record_stream")


def kept_streams():
    """How many streams (other than the default ones) the allocator keeps alive."""
    return len(_streams)
