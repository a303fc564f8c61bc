"""What the CuPy allocator (gpu_alloc.cupy) and the Numba memory manager (gpu_alloc.numba)
share: importing the other library with an error that says what to install, turning any
library's stream object into a raw handle, and keeping alive the streams the allocator was
handed, which the C library requires (gpualloc.h: a stream must outlive the blocks cached
for it).
"""

import ctypes
import importlib
import threading

import gpu_alloc

# pip names of the packages a feature needs, by import name.
INSTALL_HINTS = {
    "cupy": "cupy-cuda12x or cupy-cuda13x (the one that matches your CUDA driver)",
    "numba": "numba-cuda (with the CUDA bindings: numba-cuda[cu12] or numba-cuda[cu13])",
    "torch": "torch (a CUDA build that matches your driver; `python -m gpu_alloc doctor` checks)",
}


def require(module, feature):
    """Imports ``module`` for ``feature`` (e.g. "gpu_alloc.cupy_allocator"), or raises
    ModuleNotFoundError naming the package to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        if e.name is None or e.name.split(".")[0] != top:
            raise  # the package is there but something it imports is not
        hint = INSTALL_HINTS.get(top, top)
        raise ModuleNotFoundError(
            "%s needs %s, which is not installed: pip install %s" % (feature, top, hint),
            name=top,
        ) from None


def library():
    """gpu_alloc.load_library(): every entry point declared from gpualloc.h."""
    return gpu_alloc.load_library()


def address(value):
    """An integer address or handle from an int, a ctypes pointer, or a binding's handle
    object (cuda.bindings' CUdeviceptr and CUstream convert with int())."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    if isinstance(value, ctypes.c_void_p):
        return value.value or 0
    return int(value)


def stream_handle(stream):
    """The raw CUstream of ``stream``: a CuPy stream (``.ptr``), a torch.cuda.Stream
    (``.cuda_stream``), a Numba stream (``.handle``), or an int (0: the legacy default
    stream)."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    for attribute in ("ptr", "cuda_stream"):
        value = getattr(stream, attribute, None)
        if value is not None:
            return address(value)
    handle = getattr(stream, "handle", None)
    if handle is not None:
        return address(getattr(handle, "value", handle))
    raise TypeError(
        "not a stream: %r (expected a CuPy, PyTorch or Numba stream, or a raw handle)"
        % (stream,)
    )


class StreamKeeper:
    """Holds the stream objects whose handles were given to the allocator, so that their
    owners cannot destroy them (and the driver cannot hand their handle to a new stream)
    while the allocator may still cache blocks for them or wait on them. The legacy
    (0, 1) and per-thread (2) default streams need no keeping."""

    _PSEUDO = (0, 1, 2)

    def __init__(self):
        self._streams = {}
        self._lock = threading.Lock()

    def knows(self, handle):
        """Whether ``handle`` needs no keeping or is kept already (the allocation path's
        check: no lock, a dict lookup)."""
        return handle in self._PSEUDO or handle in self._streams

    def keep(self, handle, stream):
        """Keeps ``stream`` (the object behind ``handle``) for the life of the process."""
        if handle in self._PSEUDO or stream is None:
            return
        with self._lock:
            self._streams.setdefault(handle, stream)

    def __len__(self):
        return len(self._streams)
