"""Numba on gpualloc: an External Memory Management (EMM) plugin, so that Numba's device
arrays come from the same cache as PyTorch's (with ``gpu_alloc.enable()``) and CuPy's (with
``gpu_alloc.cupy_allocator``). Either, before Numba's first CUDA use::

    from numba import cuda
    import gpu_alloc.numba
    cuda.set_memory_manager(gpu_alloc.numba.GpuAllocNumbaManager)

or ``NUMBA_CUDA_MEMORY_MANAGER=gpu_alloc`` in the environment (Numba imports the module it
names and takes its ``_numba_memory_manager``).

- ``memalloc``: a block of gpualloc on the context's device for the legacy default stream
  (Numba's allocations name no stream; PyTorch's and CuPy's default streams are that stream
  too, so their blocks are reused by one another at once).
- ``memhostalloc``: pinned host memory from gpualloc's pinned host allocator (portable),
  given back when Numba drops it, after the work queued on the legacy default stream at that
  time (which waits for Numba's blocking streams) is done. Mapped or write-combined requests,
  which that allocator does not serve, are Numba's own (``cuMemHostAlloc``).
- ``mempin`` (``cuda.pinned(array)``, ``cuda.mapped(array)``): the caller's memory pinned in
  place through gpualloc (``gpu_alloc.host_register``, portable, mapped into the device
  address space for ``cuda.mapped``), counted in ``gpu_alloc.host_stats()`` as
  ``registered_bytes``; unpinned as soon as Numba drops it, as Numba's own ``mempin`` does
  (not held back by ``defer_cleanup``: the same memory may be pinned again right after).
- ``get_memory_info``: the device's free memory (``cuMemGetInfo``) plus what gpualloc caches
  unused on it, which Numba's next allocations can take; total as the device's.
- ``get_ipc_handle``: a CUDA IPC handle of the ``cuMemAlloc`` segment under the block, with
  the block's offset in it. Blocks of expandable segments cannot be shared that way (Numba's
  handles are ``cuIpcGetMemHandle``'s); that is an error naming the setting.
- ``reset`` (a context reset) gives back every block still handed to Numba on the context;
  ``defer_cleanup`` holds frees back, blocks staying out of the cache, until the outermost
  such block ends.

Work on a stream other than the legacy default one that uses a Numba array: call
``record_stream(array, stream)`` before dropping it, or drop it inside ``cuda.defer_cleanup()``
while the work runs.
"""

import contextlib
import ctypes
import threading
import weakref

import gpu_alloc
from gpu_alloc import _libraries

_cuda = _libraries.require("numba.cuda", "gpu_alloc.numba")
_driver_module = _libraries.require("numba.cuda.cudadrv.driver", "gpu_alloc.numba")

__all__ = ["GpuAllocNumbaManager", "record_stream"]

_streams = _libraries.StreamKeeper()


def _out_of_memory(message):
    """Numba's own out-of-memory error (CudaAPIError with CUDA_ERROR_OUT_OF_MEMORY), so that
    Numba's callers handle it as they handle the driver's."""
    code = _driver_module.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    return _driver_module.CudaAPIError(code, message)


class _Frees:
    """The frees of one memory manager: done at once, or held back while a defer_cleanup
    block is open, and skipped for blocks a reset already gave back (a block's finalizer may
    run after a reset, when its address may belong to a new block)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._live = {}  # address -> token of the block handed out there
        self._held = []  # (release function, args) while deferred
        self._depth = 0

    def handed_out(self, address):
        """Registers a block handed out at ``address``; returns its token."""
        token = object()
        with self._lock:
            self._live[address] = token
        return token

    def free(self, address, token, release, *args):
        """Calls ``release(*args)`` for the block ``token`` at ``address`` now, or at the
        end of the outermost deferral; nothing if a reset gave the block back."""
        with self._lock:
            if self._live.get(address) is not token:
                return
            del self._live[address]
            if self._depth:
                self._held.append((release, args))
                return
        release(*args)

    @contextlib.contextmanager
    def deferred(self):
        """Holds frees back until the outermost such block ends."""
        with self._lock:
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                held, self._held = (self._held, []) if self._depth == 0 else ([], self._held)
            for release, args in held:
                release(*args)

    def take_all(self):
        """Forgets every live block and returns their addresses (for a reset)."""
        with self._lock:
            live, self._live = list(self._live), {}
            held, self._held = self._held, []
        return live, held

    def __len__(self):
        return len(self._live)


class GpuAllocNumbaManager(_cuda.HostOnlyCUDAMemoryManager):
    """Numba's EMM plugin over gpualloc (see the module's docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._device_frees = _Frees()
        self._host_frees = _Frees()
        self._lib = None

    def initialize(self):
        """Loads the library; sizes Numba's queue of host deallocations as Numba does."""
        self._lib = _libraries.library()
        not_set = getattr(_driver_module, "_SizeNotSet", None)
        if not_set is not None and self.deallocations.memory_capacity == not_set:
            self.deallocations.memory_capacity = self.get_memory_info().total

    def _library(self):
        if self._lib is None:
            self._lib = _libraries.library()
        return self._lib

    @property
    def _device(self):
        return self.context.device.id

    def memalloc(self, size):
        """``size`` bytes of device memory from gpualloc, as a MemoryPointer whose
        finalizer gives the block back."""
        lib = self._library()
        device = self._device
        context = weakref.proxy(self.context)
        if size == 0:
            return _cuda.MemoryPointer(context, ctypes.c_void_p(0), 0)
        ptr = lib.gpualloc_malloc(size, device, None)
        if not ptr:
            code = lib.gpualloc_last_error_code()
            message = "gpu_alloc.numba: memalloc(%d bytes, device %d): %s" % (
                size, device, gpu_alloc.last_error() or "unknown error")
            if code == gpu_alloc.ERR_OUT_OF_MEMORY:
                raise _out_of_memory(message)
            raise gpu_alloc.GpuAllocError(message, code)
        token = self._device_frees.handed_out(ptr)
        frees = self._device_frees

        def finalizer():
            frees.free(ptr, token, _free_device, lib, ptr, size, device)

        return _cuda.MemoryPointer(context, ctypes.c_void_p(ptr), size, finalizer=finalizer)

    def memhostalloc(self, size, mapped=False, portable=False, wc=False):
        """Pinned host memory from gpualloc's pinned host allocator; mapped or write-combined
        memory from Numba's own implementation."""
        if mapped or wc or size == 0:
            return super().memhostalloc(size, mapped, portable, wc)
        lib = self._library()
        ptr = gpu_alloc.host_alloc(size)
        token = self._host_frees.handed_out(ptr)
        frees = self._host_frees

        def finalizer():
            frees.free(ptr, token, _free_host, lib, ptr)

        return _cuda.PinnedMemory(weakref.proxy(self.context), ptr, size, finalizer=finalizer)

    def mempin(self, owner, pointer, size, mapped=False):
        """Pins ``size`` bytes of the caller's memory at ``pointer`` through gpualloc (mapped
        into the device address space when ``mapped``), as a PinnedMemory (or, mapped, an
        owned MappedMemory, tracked in ``allocations`` as Numba does) whose finalizer unpins
        it at once."""
        lib = self._library()
        ptr = _libraries.address(pointer)
        flags = gpu_alloc.HOST_REGISTER_MAPPED if mapped else 0
        code = lib.gpualloc_host_register(ctypes.c_void_p(ptr), size, flags)
        gpu_alloc._check(code, "gpu_alloc.numba: mempin(%#x, %d bytes)" % (ptr, size))
        allocations = self.allocations

        def finalizer():
            if mapped:
                allocations.pop(ptr, None)
            _unpin(lib, ptr)

        context = weakref.proxy(self.context)
        if mapped:
            mem = _cuda.MappedMemory(context, pointer, size, owner=owner, finalizer=finalizer)
            self.allocations[ptr] = mem
            return mem.own()
        return _cuda.PinnedMemory(context, pointer, size, owner=owner, finalizer=finalizer)

    def get_memory_info(self):
        """(free, total) of the device: free counts the memory gpualloc caches unused."""
        free, total = _driver_module.driver.cuMemGetInfo()
        stats = gpu_alloc.memory_stats(self._device)
        cached = stats["reserved_bytes.all.current"] - stats["allocated_bytes.all.current"]
        return _cuda.MemoryInfo(free=int(free) + max(cached, 0), total=int(total))

    def get_ipc_handle(self, memory):
        """A CUDA IPC handle for ``memory`` (a MemoryPointer of this manager, or a view of
        one): the handle of the segment under the block and the offset within it."""
        ptr = _libraries.address(memory.handle)
        base, expandable = _segment_of(self._library(), ptr, self._device)
        if expandable:
            raise gpu_alloc.GpuAllocError(
                "gpu_alloc.numba: the block at %#x lies on an expandable segment, which "
                "Numba's IPC handles (cuIpcGetMemHandle) cannot share: share it through "
                "PyTorch (torch.multiprocessing), or allocate without "
                "expandable_segments:True" % ptr
            )
        handle = _driver_module.driver.cuIpcGetMemHandle(base)
        source = self.context.device.get_device_identity()
        return _cuda.IpcHandle(memory, handle, memory.size, source, offset=ptr - base)

    def reset(self):
        """Gives back every block this manager handed out on the context (a context reset
        ends Numba's use of them), then Numba's host allocations."""
        live_device, held_device = self._device_frees.take_all()
        live_host, held_host = self._host_frees.take_all()
        for release, args in held_device + held_host:
            release(*args)
        if live_device or live_host:
            lib, device = self._library(), self._device
            for ptr in live_device:
                _free_device(lib, ptr, 0, device)
            for ptr in live_host:
                _free_host(lib, ptr)
        super().reset()

    @contextlib.contextmanager
    def defer_cleanup(self):
        """Holds back the frees of device and host blocks (ours and Numba's) until the
        outermost ``defer_cleanup`` block ends."""
        with super().defer_cleanup(), self._device_frees.deferred(), \
                self._host_frees.deferred():
            yield

    @property
    def interface_version(self):
        """The EMM plugin interface this implements: 1."""
        return 1

    def live_blocks(self):
        """How many device blocks Numba holds from this manager now."""
        return len(self._device_frees)


def _free_device(lib, ptr, size, device):
    lib.gpualloc_free(ctypes.c_void_p(ptr), size, device, None)


def _free_host(lib, ptr):
    # The legacy default stream's work queued now (a copy from or to the buffer on it, or
    # on a blocking stream, which it waits for) must end before the pool hands it out again.
    lib.gpualloc_host_record_stream(ctypes.c_void_p(ptr), None)
    lib.gpualloc_host_free(ctypes.c_void_p(ptr))


def _unpin(lib, ptr):
    # A finalizer: a failure is reported, not raised.
    if lib.gpualloc_host_unregister(ctypes.c_void_p(ptr)) != gpu_alloc.OK:
        gpu_alloc._log.warning("gpu_alloc.numba: unpinning %#x: %s", ptr, gpu_alloc.last_error())


def _segment_of(lib, ptr, device):
    """(base, expandable) of the memory shared for the live block containing ``ptr``."""
    base, size, expandable = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int()
    code = lib.gpualloc_block_segment(
        ctypes.c_void_p(ptr), device, ctypes.byref(base), ctypes.byref(size),
        ctypes.byref(expandable),
    )
    gpu_alloc._check(code, "gpu_alloc.numba: get_ipc_handle")
    return base.value, bool(expandable.value)


def record_stream(array, stream):
    """Declares that work queued on ``stream`` (a Numba, CuPy or PyTorch stream, or a raw
    handle) uses ``array`` (a Numba device array or a MemoryPointer of this manager): after
    Numba frees it, gpualloc reuses the block only once that work has finished."""
    memory = getattr(array, "gpu_data", array)
    owner = getattr(memory, "owner", memory)  # a view's owner is the block's pointer
    ptr = _libraries.address(getattr(owner, "handle", owner))
    handle = _libraries.stream_handle(stream)
    if not _streams.knows(handle):
        _streams.keep(handle, stream)
    device = _cuda.current_context().device.id
    code = gpu_alloc.load_library().gpualloc_record_stream(
        ctypes.c_void_p(ptr), device, ctypes.c_void_p(handle)
    )
    gpu_alloc._check(code, "gpu_alloc.numba.record_stream")


# NUMBA_CUDA_MEMORY_MANAGER=gpu_alloc.numba (gpu_alloc itself forwards this name too).
_numba_memory_manager = GpuAllocNumbaManager
