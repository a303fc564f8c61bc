"""CPU tests of gpu_alloc's CuPy allocator and Numba memory manager: no GPU, no CuPy, no Numba.

    python3 python/tests/test_libraries.py

CuPy and Numba are replaced by small stand-ins of the parts gpu_alloc.cupy and gpu_alloc.numba
use, and the library by a recorder of its calls, so that what reaches gpualloc (sizes,
devices, streams, frees, stream records) is checked; a few tests use the real library (built
as test_cpu.py builds it) where it answers without a GPU. The GPU side is
python/tests/gpu_libraries.py.
"""

import collections
import contextlib
import ctypes
import importlib
import os
import sys
import types
import unittest
import weakref
from unittest import mock

from support import SO, gpu_alloc, needs_so

gpu_alloc_libraries = importlib.import_module("gpu_alloc._libraries")


class FakeLibrary:
    """Records the entry points the modules call; malloc hands out increasing addresses."""

    def __init__(self, fail_code=None):
        self.calls = []
        self.next = 0x7F0000000000
        self.fail_code = fail_code

    def gpualloc_malloc(self, size, device, stream):
        self.calls.append(("malloc", size, device, gpu_alloc_libraries.address(stream)))
        if self.fail_code is not None:
            return None
        self.next += 1 << 20
        return self.next

    def gpualloc_free(self, ptr, size, device, stream):
        self.calls.append(("free", gpu_alloc_libraries.address(ptr), device))

    def gpualloc_record_stream(self, ptr, device, stream):
        self.calls.append(("record_stream", gpu_alloc_libraries.address(ptr), device,
                           gpu_alloc_libraries.address(stream)))
        return 0

    def gpualloc_host_record_stream(self, ptr, stream):
        self.calls.append(("host_record_stream", gpu_alloc_libraries.address(ptr),
                           gpu_alloc_libraries.address(stream)))
        return 0

    def gpualloc_host_free(self, ptr):
        self.calls.append(("host_free", gpu_alloc_libraries.address(ptr)))
        return 0

    def gpualloc_host_register(self, ptr, size, flags):
        self.calls.append(("host_register", gpu_alloc_libraries.address(ptr), size, flags))
        return self.fail_code or 0

    def gpualloc_host_unregister(self, ptr):
        self.calls.append(("host_unregister", gpu_alloc_libraries.address(ptr)))
        return 0

    def gpualloc_last_error_code(self):
        return self.fail_code or 0

    def named(self, name):
        return [c for c in self.calls if c[0] == name]


# ---------------------------------------------------------------- CuPy stand-in


def fake_cupy(device=0):
    """The parts of CuPy that gpu_alloc.cupy uses; ``state`` sets the current stream and
    device."""
    state = types.SimpleNamespace(stream=0, device=device, streams={})

    class UnownedMemory:
        def __init__(self, ptr, size, owner, device_id=-1):
            self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem, offset):
            self.mem, self.ptr = mem, mem.ptr + offset

    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr

    class OutOfMemoryError(MemoryError):
        def __init__(self, size, total, limit=0):
            super().__init__("Out of memory allocating %d bytes (allocated so far: %d bytes)."
                             % (size, total))

    def get_current_stream():
        return state.streams.setdefault(state.stream, Stream(state.stream))

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(
        MemoryPointer=MemoryPointer,
        UnownedMemory=UnownedMemory,
        Stream=Stream,
        get_current_stream=get_current_stream,
        runtime=types.SimpleNamespace(getDevice=lambda: state.device),
        memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
    )
    cupy.ndarray = None
    return cupy, state


@contextlib.contextmanager
def fresh_module(name, stand_ins):
    """Imports gpu_alloc.<name> anew with ``stand_ins`` in sys.modules."""
    saved = sys.modules.pop("gpu_alloc." + name, None)
    try:
        with mock.patch.dict(sys.modules, stand_ins):
            module = importlib.import_module("gpu_alloc." + name)
            yield module
    finally:
        sys.modules.pop("gpu_alloc." + name, None)
        if saved is not None:
            sys.modules["gpu_alloc." + name] = saved


class MissingPackages(unittest.TestCase):
    """Without CuPy or Numba, gpu_alloc imports and says what to install when asked for them."""

    def test_cupy_allocator_names_the_package(self):
        with fresh_module_missing("cupy") as error:
            _ = gpu_alloc.cupy_allocator
        message = str(error.exception)
        self.assertIn("gpu_alloc.cupy_allocator needs cupy", message)
        self.assertIn("pip install cupy-cuda12x", message)
        self.assertEqual(error.exception.name, "cupy")

    def test_numba_manager_names_the_package(self):
        with fresh_module_missing("numba") as error:
            importlib.import_module("gpu_alloc.numba")
        self.assertIn("gpu_alloc.numba needs numba", str(error.exception))
        self.assertIn("pip install numba-cuda", str(error.exception))
        with fresh_module_missing("numba") as error:
            _ = gpu_alloc._numba_memory_manager
        self.assertIn("numba-cuda", str(error.exception))

    def test_enable_without_torch_says_what_to_install(self):
        with mock.patch.dict(sys.modules, {"torch": None}):
            with self.assertRaises(ModuleNotFoundError) as cm:
                gpu_alloc._import_torch("gpu_alloc.enable()")
        self.assertIn("gpu_alloc.enable() needs torch", str(cm.exception))
        self.assertIn("pip install torch", str(cm.exception))

    def test_a_missing_dependency_of_the_package_is_not_blamed_on_it(self):
        def broken(name):
            raise ModuleNotFoundError("No module named 'fastrlock'", name="fastrlock")

        with mock.patch.object(importlib, "import_module", broken):
            with self.assertRaises(ModuleNotFoundError) as cm:
                gpu_alloc_libraries.require("cupy", "x")
        self.assertEqual(cm.exception.name, "fastrlock")

    def test_unknown_attributes_still_fail(self):
        with self.assertRaises(AttributeError):
            _ = gpu_alloc.no_such_thing


@contextlib.contextmanager
def fresh_module_missing(package):
    """``package`` made unimportable (as when it is not installed), gpu_alloc's modules
    that use it imported anew; yields the assertRaises context of the import."""
    names = [n for n in sys.modules if n == package or n.startswith(package + ".")]
    blocked = {n: None for n in names}
    blocked[package] = None
    ours = {n: sys.modules.pop(n) for n in ("gpu_alloc.cupy", "gpu_alloc.numba") if n in sys.modules}
    case = unittest.TestCase()
    try:
        with mock.patch.dict(sys.modules, blocked), case.assertRaises(ModuleNotFoundError) as cm:
            yield cm
    finally:
        for n in ("gpu_alloc.cupy", "gpu_alloc.numba"):
            sys.modules.pop(n, None)
        sys.modules.update(ours)


class CupyAllocator(unittest.TestCase):
    def setUp(self):
        self.cupy, self.state = fake_cupy(device=1)
        context = fresh_module("cupy", {"cupy": self.cupy})
        self.module = context.__enter__()
        self.addCleanup(context.__exit__, None, None, None)
        self.lib = FakeLibrary()
        patcher = mock.patch.object(self.module, "_lib", self.lib)
        patcher.start()
        self.addCleanup(patcher.stop)

    def test_allocates_on_the_current_device_and_stream_and_frees_when_dropped(self):
        self.state.stream = 0x5000
        pointer = self.module.cupy_allocator(4096)
        self.assertEqual(self.lib.calls, [("malloc", 4096, 1, 0x5000)])
        self.assertEqual(pointer.ptr, self.lib.next)
        self.assertEqual((pointer.mem.size, pointer.mem.device_id), (4096, 1))
        ptr = pointer.ptr
        del pointer
        self.assertEqual(self.lib.calls[-1], ("free", ptr, 1), "freed once CuPy drops it")
        self.assertEqual(len(self.lib.named("record_stream")), 0, "same stream: no record")

    def test_a_free_under_another_stream_records_it_first(self):
        pointer = self.module.cupy_allocator(1 << 20)  # on the null stream
        ptr = pointer.ptr
        self.state.stream = 0x6000  # `with stream:` around the `del`
        del pointer
        self.assertEqual(self.lib.calls[-2:], [("record_stream", ptr, 1, 0x6000), ("free", ptr, 1)])
        self.assertEqual(self.module.kept_streams(), 1)

    def test_a_free_on_another_device_records_nothing(self):
        pointer = self.module.cupy_allocator(512)
        self.state.device, self.state.stream = 0, 0x7000
        del pointer
        self.assertEqual([c[0] for c in self.lib.calls], ["malloc", "free"])

    def test_streams_allocated_on_are_kept_alive(self):
        self.state.stream = 0x8000
        stream = self.cupy.cuda.get_current_stream()
        ref = weakref.ref(stream)
        self.module.cupy_allocator(64)
        del stream
        self.state.streams.clear()
        self.assertIsNotNone(ref(), "the allocator holds the stream object")
        self.state.stream = 0  # the default stream needs no keeping
        self.module.cupy_allocator(64)
        self.assertEqual(self.module.kept_streams(), 1)

    def test_zero_bytes_allocates_nothing(self):
        pointer = self.module.cupy_allocator(0)
        self.assertEqual((pointer.ptr, pointer.mem.size, pointer.mem.device_id), (0, 0, 1))
        self.assertEqual(self.lib.calls, [])

    def test_out_of_memory_is_cupys_error_with_our_report(self):
        self.lib.fail_code = gpu_alloc.ERR_OUT_OF_MEMORY
        stats = {"allocated_bytes.all.current": 123}
        with mock.patch.object(gpu_alloc, "last_error", lambda: "CUDA out of memory: 80 GiB"), \
                mock.patch.object(gpu_alloc, "memory_stats", lambda device: stats):
            with self.assertRaises(self.cupy.cuda.memory.OutOfMemoryError) as cm:
                self.module.cupy_allocator(1 << 40)
        self.assertIn("allocated so far: 123 bytes", str(cm.exception))
        self.assertIsInstance(cm.exception.__cause__, gpu_alloc.GpuAllocError)
        self.assertIn("80 GiB", str(cm.exception.__cause__))

    def test_other_failures_are_gpu_alloc_errors(self):
        self.lib.fail_code = gpu_alloc.ERR_CUDA
        with mock.patch.object(gpu_alloc, "last_error", lambda: "no CUDA driver"):
            with self.assertRaises(gpu_alloc.GpuAllocError) as cm:
                self.module.cupy_allocator(100)
        self.assertIn("cupy_allocator(100 bytes, device 1): no CUDA driver", str(cm.exception))
        self.assertEqual(cm.exception.code, gpu_alloc.ERR_CUDA)

    def test_record_stream_takes_the_block_of_an_array_and_any_stream(self):
        pointer = self.module.cupy_allocator(256)
        array = types.SimpleNamespace(data=pointer)
        torch_stream = types.SimpleNamespace(cuda_stream=0x9000)
        with mock.patch.object(self.module, "_library", lambda: self.lib):
            self.module.record_stream(array, torch_stream)
            self.module.record_stream(pointer, 0xA000)
        records = self.lib.named("record_stream")
        self.assertEqual(records, [("record_stream", pointer.ptr, 1, 0x9000),
                                   ("record_stream", pointer.ptr, 1, 0xA000)])


class StreamHandles(unittest.TestCase):
    def test_every_librarys_stream_object(self):
        handle = gpu_alloc_libraries.stream_handle
        self.assertEqual(handle(None), 0)
        self.assertEqual(handle(0x10), 0x10)
        self.assertEqual(handle(types.SimpleNamespace(ptr=0x20)), 0x20)
        self.assertEqual(handle(types.SimpleNamespace(cuda_stream=0x30)), 0x30)
        self.assertEqual(handle(types.SimpleNamespace(handle=ctypes.c_void_p(0x40))), 0x40)
        self.assertEqual(handle(types.SimpleNamespace(handle=ctypes.c_void_p(None))), 0)
        with self.assertRaises(TypeError):
            handle("stream")

    def test_the_keeper_ignores_default_streams(self):
        keeper = gpu_alloc_libraries.StreamKeeper()
        for pseudo in (0, 1, 2):
            self.assertTrue(keeper.knows(pseudo))
            keeper.keep(pseudo, object())
        self.assertEqual(len(keeper), 0)
        keeper.keep(0x50, object())
        self.assertTrue(keeper.knows(0x50))
        self.assertEqual(len(keeper), 1)


# ---------------------------------------------------------------- Numba stand-in


def fake_numba():
    """numba, numba.cuda and numba.cuda.cudadrv.driver with the parts gpu_alloc.numba uses,
    shaped as numba-cuda's: a HostOnlyCUDAMemoryManager whose host allocations and
    deferral are recorded."""
    record = []

    class CudaAPIError(Exception):
        def __init__(self, code, msg):
            super().__init__(code, msg)
            self.code = code

    class SizeNotSet(int):
        pass

    size_not_set = SizeNotSet()

    class PendingDeallocs:
        memory_capacity = size_not_set

        @contextlib.contextmanager
        def disable(self):
            record.append("numba defer begins")
            yield
            record.append("numba defer ends")

    class HostOnlyCUDAMemoryManager:
        def __init__(self, *args, **kwargs):
            if "context" not in kwargs:
                raise RuntimeError("Memory manager requires a context")
            self.context = kwargs.pop("context")
            self.allocations = {}
            self.deallocations = PendingDeallocs()

        def memhostalloc(self, size, mapped=False, portable=False, wc=False):
            record.append(("numba memhostalloc", size, mapped, wc))
            return "numba's pinned memory"

        def reset(self):
            record.append("numba reset")

        @contextlib.contextmanager
        def defer_cleanup(self):
            with self.deallocations.disable():
                yield

    class MemoryPointer:
        def __init__(self, context, pointer, size, owner=None, finalizer=None):
            self.context, self.size = context, size
            self.device_pointer = self.handle = pointer.value or 0
            self._owner = owner
            if finalizer is not None:
                self._finalizer = weakref.finalize(self, finalizer)

        @property
        def owner(self):
            return self if self._owner is None else self._owner

    class PinnedMemory:
        def __init__(self, context, pointer, size, owner=None, finalizer=None):
            self.host_pointer = self.handle = pointer
            self.size = size
            if finalizer is not None:
                weakref.finalize(self, finalizer)

    class MappedMemory:
        def __init__(self, context, pointer, size, owner=None, finalizer=None):
            self.host_pointer = self.handle = pointer
            self.size, self.owned = size, owner
            self.free = weakref.finalize(self, finalizer)

        def own(self):
            return OwnedPointer(self)

    class OwnedPointer:
        """Numba's: the view of a MappedMemory, whose end frees it."""

        def __init__(self, mem):
            self._mem = mem
            weakref.finalize(self, mem.free)

    class IpcHandle:
        def __init__(self, base, handle, size, source_info=None, offset=0):
            self.base, self.handle, self.size = base, handle, size
            self.source_info, self.offset = source_info, offset

    device = types.SimpleNamespace(id=2, get_device_identity=lambda: {"pci_bus_id": 7})
    class Context:  # weakly referable, as Numba's
        pass

    context = Context()
    context.device = device
    driver = types.SimpleNamespace(
        cuMemGetInfo=lambda: (1000, 5000),
        cuIpcGetMemHandle=lambda base: ("ipc handle of", base),
    )
    binding = types.SimpleNamespace(
        CUresult=types.SimpleNamespace(CUDA_ERROR_OUT_OF_MEMORY=2))
    driver_module = types.ModuleType("numba.cuda.cudadrv.driver")
    driver_module.driver = driver
    driver_module.binding = binding
    driver_module.CudaAPIError = CudaAPIError
    driver_module._SizeNotSet = size_not_set
    cuda = types.ModuleType("numba.cuda")
    cuda.HostOnlyCUDAMemoryManager = HostOnlyCUDAMemoryManager
    cuda.MemoryPointer = MemoryPointer
    cuda.PinnedMemory = PinnedMemory
    cuda.MappedMemory = MappedMemory
    cuda.IpcHandle = IpcHandle
    cuda.MemoryInfo = collections.namedtuple("MemoryInfo", "free,total")
    cuda.current_context = lambda: context
    numba = types.ModuleType("numba")
    numba.cuda = cuda
    cudadrv = types.ModuleType("numba.cuda.cudadrv")
    cudadrv.driver = driver_module
    modules = {"numba": numba, "numba.cuda": cuda, "numba.cuda.cudadrv": cudadrv,
               "numba.cuda.cudadrv.driver": driver_module}
    return modules, context, record


class NumbaManager(unittest.TestCase):
    def setUp(self):
        modules, self.context, self.record = fake_numba()
        context = fresh_module("numba", modules)
        self.module = context.__enter__()
        self.addCleanup(context.__exit__, None, None, None)
        self.lib = FakeLibrary()
        self.manager = self.module.GpuAllocNumbaManager(context=self.context)
        self.manager._lib = self.lib

    def test_numba_can_instantiate_it_without_a_context_and_reads_version_1(self):
        dummy = self.module.GpuAllocNumbaManager(context=None)  # as set_memory_manager does
        self.assertEqual(dummy.interface_version, 1)

    def test_the_env_var_finds_the_manager_through_the_package(self):
        self.assertIs(importlib.import_module("gpu_alloc")._numba_memory_manager,
                      self.module.GpuAllocNumbaManager)
        self.assertIs(self.module._numba_memory_manager, self.module.GpuAllocNumbaManager)

    def test_memalloc_on_the_contexts_device_and_the_default_stream_freed_when_dropped(self):
        pointer = self.manager.memalloc(1 << 20)
        self.assertEqual(self.lib.calls, [("malloc", 1 << 20, 2, 0)])
        self.assertEqual(self.manager.live_blocks(), 1)
        ptr = pointer.handle
        del pointer
        self.assertEqual(self.lib.calls[-1], ("free", ptr, 2))
        self.assertEqual(self.manager.live_blocks(), 0)

    def test_zero_bytes_is_a_null_pointer_with_nothing_to_free(self):
        pointer = self.manager.memalloc(0)
        self.assertEqual((pointer.handle, pointer.size), (0, 0))
        del pointer
        self.assertEqual(self.lib.calls, [])

    def test_out_of_memory_is_numbas_error(self):
        self.lib.fail_code = gpu_alloc.ERR_OUT_OF_MEMORY
        with mock.patch.object(gpu_alloc, "last_error", lambda: "out of memory on device 2"):
            with self.assertRaises(Exception) as cm:
                self.manager.memalloc(1 << 40)
        self.assertEqual(type(cm.exception).__name__, "CudaAPIError")
        self.assertEqual(cm.exception.code, 2)
        self.assertIn("out of memory on device 2", str(cm.exception))

    def test_defer_cleanup_holds_frees_until_the_outermost_block_ends(self):
        first, second = self.manager.memalloc(100), self.manager.memalloc(200)
        with self.manager.defer_cleanup():
            with self.manager.defer_cleanup():
                del first
            self.assertEqual(self.lib.named("free"), [], "held back")
            del second
            self.assertEqual(self.lib.named("free"), [])
        self.assertEqual(len(self.lib.named("free")), 2)
        self.assertIn("numba defer begins", self.record, "Numba's own host frees deferred too")

    def test_reset_frees_live_blocks_once_even_when_their_address_comes_back(self):
        old = self.manager.memalloc(100)
        old_ptr = old.handle
        self.manager.reset()
        self.assertEqual(self.lib.named("free"), [("free", old_ptr, 2)])
        self.assertIn("numba reset", self.record)
        self.lib.next = old_ptr - (1 << 20)  # the next block gets the same address
        new = self.manager.memalloc(100)
        self.assertEqual(new.handle, old_ptr)
        del old  # its finalizer must not free the new block
        self.assertEqual(len(self.lib.named("free")), 1)
        del new
        self.assertEqual(len(self.lib.named("free")), 2)

    def test_pinned_memory_comes_from_our_pool_and_waits_for_the_default_stream(self):
        with mock.patch.object(gpu_alloc, "host_alloc", lambda size: 0xABC000):
            pinned = self.manager.memhostalloc(4096)
        self.assertEqual((pinned.host_pointer, pinned.size), (0xABC000, 4096))
        del pinned
        self.assertEqual(self.lib.calls, [("host_record_stream", 0xABC000, 0),
                                          ("host_free", 0xABC000)])

    def test_mempin_pins_through_the_library_and_unpins_at_once(self):
        owner = bytearray(8192)
        pinned = self.manager.mempin(owner, 0xBEE000, 8192)
        self.assertEqual(self.lib.calls, [("host_register", 0xBEE000, 8192, 0)])
        self.assertEqual(pinned.host_pointer, 0xBEE000)
        with self.manager.defer_cleanup():
            del pinned
            self.assertEqual(self.lib.calls[-1], ("host_unregister", 0xBEE000),
                             "not deferred: the memory may be pinned again at once")

    def test_mapped_mempin_maps_and_is_tracked_until_its_view_ends(self):
        view = self.manager.mempin(None, 0xC0F000, 4096, mapped=True)
        self.assertEqual(self.lib.calls,
                         [("host_register", 0xC0F000, 4096, gpu_alloc.HOST_REGISTER_MAPPED)])
        self.assertIn(0xC0F000, self.manager.allocations)
        del view
        self.assertEqual(self.lib.calls[-1], ("host_unregister", 0xC0F000))
        self.assertNotIn(0xC0F000, self.manager.allocations)

    def test_a_refused_mempin_raises_and_pins_nothing(self):
        self.lib.fail_code = gpu_alloc.ERR_INVALID
        with mock.patch.object(gpu_alloc, "last_error", lambda: "overlaps 0x1000..0x2000"):
            with self.assertRaises(ValueError) as cm:
                self.manager.mempin(None, 0x1800, 16)
        self.assertIn("overlaps 0x1000..0x2000", str(cm.exception))
        self.assertEqual(self.lib.named("host_unregister"), [])

    def test_mapped_and_write_combined_host_memory_are_numbas(self):
        self.assertEqual(self.manager.memhostalloc(10, mapped=True), "numba's pinned memory")
        self.assertEqual(self.manager.memhostalloc(10, wc=True), "numba's pinned memory")
        self.assertEqual(self.lib.calls, [])

    def test_memory_info_counts_our_cache_as_free(self):
        stats = {"reserved_bytes.all.current": 300, "allocated_bytes.all.current": 100}
        with mock.patch.object(gpu_alloc, "memory_stats", lambda device: stats):
            info = self.manager.get_memory_info()
        self.assertEqual((info.free, info.total), (1200, 5000))

    def test_initialize_sizes_numbas_host_queue(self):
        stats = {"reserved_bytes.all.current": 0, "allocated_bytes.all.current": 0}
        with mock.patch.object(gpu_alloc_libraries, "library", lambda: self.lib), \
                mock.patch.object(gpu_alloc, "memory_stats", lambda device: stats):
            self.manager.initialize()
        self.assertEqual(self.manager.deallocations.memory_capacity, 5000)

    def test_ipc_handle_of_the_segment_with_the_offset(self):
        pointer = self.manager.memalloc(1 << 20)
        base = pointer.handle - 4096
        with mock.patch.object(self.module, "_segment_of", lambda lib, p, d: (base, False)):
            handle = self.manager.get_ipc_handle(pointer)
        self.assertEqual(handle.handle, ("ipc handle of", base))
        self.assertEqual((handle.offset, handle.size), (4096, 1 << 20))
        self.assertEqual(handle.source_info, {"pci_bus_id": 7})
        with mock.patch.object(self.module, "_segment_of", lambda lib, p, d: (base, True)):
            with self.assertRaises(gpu_alloc.GpuAllocError) as cm:
                self.manager.get_ipc_handle(pointer)
        self.assertIn("expandable_segments", str(cm.exception))

    def test_record_stream_takes_the_block_under_a_view(self):
        pointer = self.manager.memalloc(1 << 20)
        view = types.SimpleNamespace(owner=pointer, handle=pointer.handle + 64)
        array = types.SimpleNamespace(gpu_data=view)
        with mock.patch.object(gpu_alloc, "load_library", lambda: self.lib):
            self.module.record_stream(array, types.SimpleNamespace(handle=ctypes.c_void_p(0xB000)))
        self.assertEqual(self.lib.named("record_stream"), [("record_stream", pointer.handle, 2, 0xB000)])


@needs_so
class WithTheLibrary(unittest.TestCase):
    """The real library, without a GPU."""

    def setUp(self):
        gpu_alloc.load_library(SO)

    def test_cupy_allocator_reports_the_driver_failure(self):
        cupy, _ = fake_cupy()
        with fresh_module("cupy", {"cupy": cupy}) as module:
            lib = module._library()
            pointer = None
            try:
                pointer = module.cupy_allocator(1 << 20)
            except gpu_alloc.GpuAllocError as e:
                self.assertIn("gpu_alloc.cupy_allocator(1048576 bytes, device 0)", str(e))
                self.assertNotEqual(e.code, gpu_alloc.OK)
            if pointer is not None:  # a machine with a GPU: a real block
                self.assertTrue(pointer.ptr)
            self.assertIs(lib, gpu_alloc.load_library())

    def test_ipc_of_memory_that_is_not_ours_is_refused(self):
        modules, context, _ = fake_numba()
        with fresh_module("numba", modules) as module:
            manager = module.GpuAllocNumbaManager(context=context)
            foreign = types.SimpleNamespace(handle=0x1234000, size=16)
            with self.assertRaises(ValueError) as cm:
                manager.get_ipc_handle(foreign)
        self.assertIn("not memory of gpualloc", str(cm.exception))


if __name__ == "__main__":
    if os.environ.get("GPUALLOC_TEST_INSTALLED") not in (None, "", "0"):
        sys.stderr.write("(testing the installed gpu_alloc)\n")
    unittest.main(verbosity=2)
