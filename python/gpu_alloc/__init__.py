"""gpu_alloc: the gpualloc caching allocator (liballoc_ffi.so) as PyTorch's CUDA allocator.

Install it with ``pip install .`` from a clone (builds the library with Rust) or from the
wheel (library inside, no Rust needed); ``python -m gpu_alloc doctor`` then says what this
machine can do with it. Pure Python (ctypes) around the C library::

    import gpu_alloc
    gpu_alloc.enable("policy:pytorch-bfc,max_split_size_mb:128")  # before any CUDA tensor
    import torch
    x = torch.randn(1024, 1024, device="cuda")
    print(gpu_alloc.memory_stats()["allocated_bytes.all.current"])
    gpu_alloc.snapshot("snap.pickle")  # python -m torch.cuda._memory_viz trace_plot snap.pickle -o s.html

enable() installs the allocator through a small C++ bridge (``bridge.cpp`` here, built
against the installed torch by ``torch.utils.cpp_extension`` on first use and cached), so
that all of PyTorch's memory interface reaches the library: ``torch.cuda.memory_stats``
and everything built on it, ``Tensor.record_stream`` (and NCCL's record_stream),
``empty_cache``, ``set_per_process_memory_fraction``, ``memory._snapshot`` /
``_record_memory_history``, out-of-memory as ``torch.OutOfMemoryError``, and CUDA graph
capture into private pools. Without a C++ compiler or CUDA headers, enable() says so once
and falls back to a plain ``CUDAPluggableAllocator``, where only malloc and free reach the
library: then use this module's functions of the same names (``record_stream`` above all:
without it a block used on a second stream can be reused too early).

``pool()`` routes only the allocations inside a ``with`` block to gpualloc while PyTorch's
own allocator serves the rest (works after CUDA is in use).

Sleep and wake (with enable(); names as torch_memory_saver's): tensors made inside
``with gpu_alloc.region("kv_cache"):`` live in that tag's pool; ``gpu_alloc.pause("kv_cache")``
gives their GPU memory back (optionally keeping the contents in pinned host memory:
``backup="host"``, or ``region(..., enable_cpu_backup=True)``) and ``gpu_alloc.resume("kv_cache")``
maps fresh memory at the same addresses, so tensors and CUDA graphs over them stay valid.
``pinned_empty()`` and ``host_alloc()`` hand out pinned host memory from the library's cached
pool (the one host backups use).

CuPy and Numba draw on the same cache: ``cupy.cuda.set_allocator(gpu_alloc.cupy_allocator)``
(module gpu_alloc.cupy) and ``numba.cuda.set_memory_manager(gpu_alloc.numba.GpuAllocNumbaManager)``
or ``NUMBA_CUDA_MEMORY_MANAGER=gpu_alloc`` (module gpu_alloc.numba); neither is imported until
asked for. The command line: ``python -m gpu_alloc doctor|advise|version``, also installed as
``gpu-alloc``.

The library is ``so_path`` when given (nothing else is tried); otherwise the first that
exists of: the packaged library (``liballoc_ffi.so`` next to this file, where the wheel puts
it), then ``$GPUALLOC_SO``, then,
when this package is the one in a clone of the repository, cargo's ``target/release`` and
``target/debug`` (``$CARGO_TARGET_DIR`` if set). A set ``$GPUALLOC_SO`` replaces the
clone's build folders, so that a wrong path is reported rather than passed over.

Messages go to stderr through ``warnings`` (the fallback of enable()) and the ``logging``
logger ``"gpu_alloc"``.
"""

import collections
import contextlib
import ctypes
import logging
import os
import pickle
import shutil
import tempfile
import warnings

from gpu_alloc import _header

__all__ = [
    "GpuAllocError",
    "enable",
    "is_enabled",
    "uses_bridge",
    "build_bridge",
    "pool",
    "region",
    "cuda_graph",
    "tag_pool",
    "pause",
    "resume",
    "tags",
    "memory_saver",
    "pinned_empty",
    "host_alloc",
    "host_free",
    "host_record_stream",
    "host_register",
    "host_unregister",
    "host_stats",
    "host_empty_cache",
    "library_path",
    "library_candidates",
    "load_library",
    "check_config",
    "update_settings",
    "settings",
    "memory_stats",
    "memory_allocated",
    "memory_reserved",
    "max_memory_allocated",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
    "empty_cache",
    "set_memory_fraction",
    "record_stream",
    "record_history",
    "snapshot",
    "last_error",
    "version",
    "advise",
    "set_per_process_memory_fraction",
    "memory_snapshot",
]

# The package's version: the workspace's (Cargo.toml), which the library reports too.
__version__ = "0.1.0"

LIB_NAME = "liballoc_ffi.so"
ALLOC_FN = "gpualloc_malloc"
FREE_FN = "gpualloc_free"
ENV_CONF = "GPUALLOC_CONF"
ENV_SO = "GPUALLOC_SO"

# The C interface, read from gpualloc.h (module _header): functions, structs, constants.
HEADER = _header.load()

# Return codes (gpualloc.h).
OK = HEADER.constants["GPUALLOC_OK"]
ERR_INVALID = HEADER.constants["GPUALLOC_ERR_INVALID"]
ERR_OUT_OF_MEMORY = HEADER.constants["GPUALLOC_ERR_OUT_OF_MEMORY"]
ERR_CUDA = HEADER.constants["GPUALLOC_ERR_CUDA"]
ERR_TOO_LATE = HEADER.constants["GPUALLOC_ERR_TOO_LATE"]
ERR_INTERNAL = HEADER.constants["GPUALLOC_ERR_INTERNAL"]
ERR_UNKNOWN_POOL = HEADER.constants["GPUALLOC_ERR_UNKNOWN_POOL"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_log = logging.getLogger("gpu_alloc")
_lib = None
_lib_path = None
_enabled_with = None  # (path, config) once enable() succeeded
_allocator = None  # keeps the CUDAPluggableAllocator alive
_bridge = None  # the built bridge module once installed
_pool_allocator = None  # the CUDAPluggableAllocator behind pool()

# What a plain pluggable allocator leaves out (said when the bridge is unavailable).
_WITHOUT_BRIDGE = (
    "torch.cuda.memory_stats/memory_allocated/memory_reserved/memory_summary and "
    "memory._snapshot raise; Tensor.record_stream, torch.cuda.empty_cache and "
    "set_per_process_memory_fraction do not reach gpu_alloc (use gpu_alloc.record_stream "
    "etc.); an out-of-memory gives a NULL tensor instead of torch.OutOfMemoryError; CUDA "
    "graph capture fails"
)


class GpuAllocError(RuntimeError):
    """A failure of the gpualloc library or of enabling it."""

    def __init__(self, message, code=None):
        super().__init__(message)
        self.code = code


def _clone_dir():
    """The folder two levels above this package: the repository when the package is its
    python/gpu_alloc."""
    return os.path.dirname(os.path.dirname(_HERE))


def repository_root():
    """The clone of the repository that this package sits in (as python/gpu_alloc), or
    None for an installed package."""
    root = _clone_dir()
    return root if os.path.isfile(os.path.join(root, "Cargo.toml")) else None


def cargo_target_dir():
    """Cargo's output folder for this repository: $CARGO_TARGET_DIR, else target/."""
    return os.environ.get("CARGO_TARGET_DIR") or os.path.join(_clone_dir(), "target")


def library_candidates(so_path=None):
    """The places library_path() looks, in order, as (origin, path) pairs: see the
    module's docstring."""
    if so_path:
        return [("so_path", so_path)]
    # Where the wheel puts the library (setup.py): next to this file.
    candidates = [("packaged", os.path.join(_HERE, LIB_NAME))]
    if os.environ.get(ENV_SO):
        candidates.append(("$" + ENV_SO, os.environ[ENV_SO]))
    elif repository_root() is not None:
        target = cargo_target_dir()
        candidates += [
            ("cargo release build", os.path.join(target, "release", LIB_NAME)),
            ("cargo debug build", os.path.join(target, "debug", LIB_NAME)),
        ]
    return candidates


def _find_library(so_path=None):
    """(origin, absolute path) of the library that would be loaded; raises if none exists."""
    candidates = library_candidates(so_path)
    for origin, path in candidates:
        if os.path.isfile(path):
            return origin, os.path.abspath(path)
    raise GpuAllocError(
        "%s not found (looked at: %s); install the package with its library (`pip install .` "
        "from a clone of the repository, or its wheel), or build it in a clone with "
        "`cargo build --release -p alloc-ffi`, or pass so_path= / set %s"
        % (LIB_NAME, ", ".join(path for _, path in candidates), ENV_SO)
    )


def library_path(so_path=None):
    """The path of liballoc_ffi.so that would be loaded (raises if none is found)."""
    return _find_library(so_path)[1]


def _declare(lib):
    """Declares the library's functions as gpualloc.h gives them (module _header): the one
    declaration of the C interface, which the C++ bridge compiles against too."""
    _header.declare(lib, HEADER)
    return lib


def load_library(so_path=None):
    """Loads liballoc_ffi.so once (later calls return the same library)."""
    global _lib, _lib_path
    if _lib is not None:
        if so_path and os.path.abspath(so_path) != _lib_path:
            raise GpuAllocError(
                "gpu_alloc already loaded %s; cannot switch to %s in one process"
                % (_lib_path, so_path)
            )
        return _lib
    origin, path = _find_library(so_path)
    env_so = os.environ.get(ENV_SO)
    if origin == "packaged" and env_so and os.path.abspath(env_so) != path:
        _log.warning(
            "$%s=%s is not used: the library packaged with gpu_alloc (%s) comes first; "
            "pass so_path= to load another", ENV_SO, env_so, path,
        )
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise GpuAllocError("cannot load %s: %s" % (path, e)) from e
    _lib, _lib_path = _declare(lib), path
    return _lib


def last_error():
    """The library's last error message on this thread, or None."""
    msg = load_library().gpualloc_last_error()
    return msg.decode("utf-8", "replace") if msg else None


def version():
    """The library's version string."""
    return load_library().gpualloc_version().decode()


def _check(code, what):
    if code != OK:
        msg = last_error() or "unknown error"
        if code == ERR_INVALID:
            raise ValueError("%s: %s" % (what, msg))
        raise GpuAllocError("%s: %s" % (what, msg), code)


# Characters of a configuration that a message quotes at most (as the library does).
_EXCERPT_CHARS = 48


def _excerpt(text):
    """``text`` quoted for a message: whole when short, else its start and its length."""
    if len(text) <= _EXCERPT_CHARS:
        return repr(text)
    return "%r... (%d characters)" % (text[:_EXCERPT_CHARS], len(text))


def _config_bytes(config, what):
    """``config`` as the C string the library takes. A NUL would end the string there and
    drop the rest unseen, so it is refused, as is text that UTF-8 cannot encode."""
    if not isinstance(config, str):
        raise TypeError("%s must be a str, not %s" % (what, type(config).__name__))
    at = config.find("\0")
    if at >= 0:
        raise ValueError(
            "%s %s: contains a NUL byte at offset %d: C strings and the environment end "
            "there" % (what, _excerpt(config), at)
        )
    try:
        return config.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError("%s %s: not valid UTF-8 (%s)" % (what, _excerpt(config), e.reason))


def check_config(config, so_path=None):
    """Validates a configuration: PYTORCH_CUDA_ALLOC_CONF syntax, a setting's name (``bound``,
    ``unmap16``, ...: docs/policies.md, "Settings by name"), or a name followed by further
    options (``bound,max_split_size_mb:64``); raises ValueError with the reason. Needs the
    library, not a GPU."""
    lib = load_library(so_path)
    text = _config_bytes(config, "gpu_alloc configuration")
    _check(lib.gpualloc_check_config(text), "invalid gpu_alloc configuration %s" % _excerpt(config))


def update_settings(text, so_path=None):
    """Changes the settings ``text`` names (configuration syntax) while the allocator runs,
    as ``torch.cuda.memory._set_allocator_settings`` does for PyTorch's allocator (which,
    with the bridge installed, reaches gpualloc too): ``roundup_power2_divisions``,
    ``max_split_size_mb``, ``max_non_split_rounding_mb``, ``garbage_collection_threshold``,
    ``expandable_segments``, ``stream_wait_reuse``, ``graph_capture_record_stream_reuse``,
    ``per_process_memory_fraction``. Raises ValueError, changing nothing, for a malformed
    string or an option fixed at creation (``policy``, ``unmap_free_pages``,
    ``unmap_page_mb``, ``unmap_worker``)."""
    lib = load_library(so_path)
    data = _config_bytes(text, "gpu_alloc settings")
    _check(lib.gpualloc_update_settings(data), "gpu_alloc settings %s" % _excerpt(text))


def settings(so_path=None):
    """The configuration in effect: the configured string (enable(config) or
    $GPUALLOC_CONF), then every change accepted since, comma-joined."""
    lib = load_library(so_path)
    ptr = lib.gpualloc_settings_text()
    if not ptr:
        raise GpuAllocError("gpualloc_settings_text: %s" % last_error())
    try:
        return ctypes.string_at(ptr).decode()
    finally:
        lib.gpualloc_string_free(ptr)


def _device_index(device):
    """None -> the current CUDA device (0 when torch is not in use); ints and
    torch.device / 'cuda:N' strings -> their index."""
    if device is None:
        import sys

        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return torch.cuda.current_device()
        return 0
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        return int(device.split(":")[1]) if ":" in device else 0
    index = getattr(device, "index", None)
    return 0 if index is None else int(index)


_TOO_LATE = (
    "gpu_alloc.enable() must run before the first CUDA allocation of the process: "
    "PyTorch cannot swap an allocator that has already allocated (or initialised CUDA). "
    "Call gpu_alloc.enable() right after `import torch`, before creating any CUDA tensor, "
    "model.cuda(), or torch.cuda.init()."
)


def cxx_compiler():
    """The C++ compiler that building the bridge would use ($CXX, else c++, else g++), as a
    path, or None when there is none on PATH."""
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def build_bridge(verbose=False):
    """Builds (or loads from torch's extension cache) the C++ bridge and returns its module.
    Raises GpuAllocError naming what is missing when it cannot be built."""
    if cxx_compiler() is None:
        raise GpuAllocError("no C++ compiler (c++ / g++ / $CXX) on PATH")
    try:
        from torch.utils import cpp_extension

        return cpp_extension.load(
            name="gpu_alloc_bridge",
            sources=[os.path.join(_HERE, "bridge.cpp")],
            extra_cflags=["-O2"],
            extra_include_paths=[_header.HEADER_DIR],
            with_cuda=True,
            verbose=verbose,
        )
    except Exception as e:  # compiler, CUDA headers (CUDA_HOME), ninja, ...
        raise GpuAllocError("cannot build the C++ bridge: %s" % (str(e).strip()[-2000:],)) from e


def _torch_backend_requested():
    """(variable, backend) when PyTorch's allocator configuration (PYTORCH_ALLOC_CONF or
    PYTORCH_CUDA_ALLOC_CONF) names another backend (``backend:cudaMallocAsync``), else
    None."""
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        for option in os.environ.get(var, "").split(","):
            key, _, value = option.partition(":")
            if key.strip() == "backend" and value.strip() and value.strip() != "native":
                return var, value.strip()
    return None


def enable(config=None, so_path=None, bridge=None):
    """Makes gpualloc PyTorch's CUDA allocator for this process.

    config: configuration string in PYTORCH_CUDA_ALLOC_CONF syntax (``policy``,
        ``max_split_size_mb``, ``roundup_power2_divisions``, ``garbage_collection_threshold``,
        ``expandable_segments``, ``stream_wait_reuse``, ``unmap_free_pages``, ``unmap_page_mb``,
        ``unmap_worker``, ``idle_mark_mb``, ``lend_idle_blocks``, ``plan_layout``, ``first_fit_mb``, ``idle_slab_limit_mb``,
        ``memory_budget_mb``, ``memory_budget_fraction``, ``memory_budget_over_allocated``,
        ``engine_per_stream`` for threads allocating on their own streams, with
        ``engine_per_thread`` for threads sharing one);
        or a setting's name, alone or followed by options that override it
        (``"bound"``, ``"unmap8,max_split_size_mb:64"``; docs/policies.md, "Settings by
        name"); None keeps $GPUALLOC_CONF (if set). For memory at the bound: ``"bound"``
        (docs/policies.md, "Memory at the bound"); ``advise()`` says which setting suits a
        recorded workload.
    so_path: path of liballoc_ffi.so (default: see the module's docstring).
    bridge: None (default) installs through the C++ bridge and falls back, with a one-time
        message naming what will not work, to a plain CUDAPluggableAllocator when the bridge
        cannot be built; True requires the bridge; False uses the plain pluggable path.

    Must be called before the first CUDA allocation: afterwards PyTorch refuses the swap and
    this raises GpuAllocError saying so. Calling it again with the same arguments does nothing.
    """
    global _enabled_with, _allocator
    lib = load_library(so_path)
    if config is not None:
        check_config(config)
    elif os.environ.get(ENV_CONF):
        # The library would read it at the first allocation and fail every
        # allocation if it is invalid: say so now instead.
        check_config(os.environ[ENV_CONF])
    key = (_lib_path, config)
    if _enabled_with is not None:
        if config is None or key == _enabled_with:
            return
        raise GpuAllocError(
            "gpu_alloc is already enabled with config %r; the configuration cannot change"
            % (_enabled_with[1],)
        )

    requested = _torch_backend_requested()
    if requested is not None:
        var, backend = requested
        raise GpuAllocError(
            "%s asks for PyTorch's %r allocator backend, which gpu_alloc.enable() would "
            "replace: remove backend:%s from it to use gpu_alloc" % (var, backend, backend)
        )

    torch = _import_torch("gpu_alloc.enable()")

    if not torch.cuda.is_available():
        raise GpuAllocError(
            "no CUDA device is visible to PyTorch (torch.cuda.is_available() is False): "
            "gpu_alloc has nothing to manage"
        )
    if torch.cuda.is_initialized():
        raise GpuAllocError(_TOO_LATE)
    if config is not None:
        os.environ[ENV_CONF] = config
        code = lib.gpualloc_configure(_config_bytes(config, "gpu_alloc configuration"))
        if code != OK:
            msg = last_error()
            if code == ERR_TOO_LATE:
                raise GpuAllocError(
                    "the gpu_alloc library (liballoc_ffi.so) was already used in this process with another "
                    "configuration: %s" % msg,
                    code,
                )
            _check(code, "gpualloc_configure")
    module = None
    if bridge is not False:
        try:
            module = build_bridge()
        except GpuAllocError as e:
            if bridge:
                raise
            warnings.warn(
                "gpu_alloc: %s; falling back to a plain CUDAPluggableAllocator, where %s "
                "(`python -m gpu_alloc doctor` says what is missing)" % (e, _WITHOUT_BRIDGE),
                RuntimeWarning,
                stacklevel=2,
            )
    try:
        if module is not None:
            module.install(_lib_path)
        else:
            allocator = torch.cuda.memory.CUDAPluggableAllocator(_lib_path, ALLOC_FN, FREE_FN)
            torch.cuda.memory.change_current_allocator(allocator)
            _allocator = allocator
    except RuntimeError as e:
        if "already initialized" in str(e) or "initialized allocator" in str(e):
            raise GpuAllocError(_TOO_LATE) from e
        raise
    global _bridge
    _bridge = module
    _enabled_with = key


def is_enabled():
    """Whether enable() succeeded in this process."""
    return _enabled_with is not None


def uses_bridge():
    """Whether enable() installed the C++ bridge (False: plain pluggable, or not enabled)."""
    return _bridge is not None


@contextlib.contextmanager
def pool(so_path=None):
    """Routes the CUDA allocations made inside the ``with`` block (on this thread) to
    gpualloc, through ``torch.cuda.MemPool`` and ``torch.cuda.use_mem_pool``, while PyTorch's
    own allocator serves everything else. Works after CUDA is already in use. Yields the
    MemPool: keep it alive as long as the tensors allocated inside. PyTorch's allocator
    caches blocks of the pool on top of the segments gpualloc hands it; ``gpu_alloc.
    memory_stats()`` shows those segments.
    """
    global _pool_allocator
    if _enabled_with is not None:
        raise GpuAllocError("gpu_alloc.pool() is for PyTorch's own allocator; gpu_alloc is "
                            "already the allocator of this process (enable() was called)")
    torch = _import_torch("gpu_alloc.pool()")

    load_library(so_path)
    if _pool_allocator is None:
        _pool_allocator = torch.cuda.memory.CUDAPluggableAllocator(_lib_path, ALLOC_FN, FREE_FN)
    mem_pool = torch.cuda.MemPool(_pool_allocator.allocator())
    with torch.cuda.use_mem_pool(mem_pool):
        yield mem_pool


# ---------------------------------------------------------------- sleep and wake

_tag_pools = {}  # (device, tag) -> the torch.cuda.MemPool of the tag
_tag_backup = {}  # (device, tag) -> True once a region asked for a CPU backup
DEFAULT_TAG = "default"


def _require_bridge(what):
    if _bridge is None:
        raise GpuAllocError(
            "%s needs gpu_alloc installed as PyTorch's allocator through the C++ bridge: call "
            "gpu_alloc.enable() first (before any CUDA allocation)" % what
        )


def _take_json(ptr, what):
    """Parses and frees a JSON string returned by the library."""
    lib = load_library()
    if not ptr:
        raise GpuAllocError("%s: %s" % (what, last_error()))
    try:
        import json

        return json.loads(ctypes.string_at(ptr).decode())
    finally:
        lib.gpualloc_string_free(ptr)


def tag_pool(tag=DEFAULT_TAG, device=None):
    """The torch.cuda.MemPool of the sleep tag ``tag`` on ``device`` (created on first use and
    kept for the life of the process). Its ``.id`` can be given to ``torch.cuda.graph(g,
    pool=...)`` so that a captured graph's memory is paused and resumed with the tag."""
    _require_bridge("gpu_alloc.tag_pool()")
    import torch

    index = _device_index(device)
    key = (index, tag)
    pool = _tag_pools.get(key)
    if pool is None:
        with torch.cuda.device(index):
            pool = torch.cuda.MemPool()
        first, second = pool.id
        code = load_library().gpualloc_bind_tag(index, tag.encode(), first, second)
        _check(code, "bind_tag(%r)" % tag)
        _tag_pools[key] = pool
    return pool


@contextlib.contextmanager
def region(tag=DEFAULT_TAG, enable_cpu_backup=False, device=None):
    """Allocations made inside the ``with`` block (on this thread, on ``device``) go to the sleep
    tag ``tag``'s pool: cached and reused like any other gpualloc memory, on growable segments
    whose pages pause() gives back. enable_cpu_backup=True makes ``pause(tag)`` keep the
    contents in pinned host memory by default (torch_memory_saver's argument)."""
    pool = tag_pool(tag, device)
    import torch

    index = _device_index(device)
    if enable_cpu_backup:
        _tag_backup[(index, tag)] = True
    with torch.cuda.use_mem_pool(pool, device=index):
        yield pool


@contextlib.contextmanager
def cuda_graph(cuda_graph, pool=None, stream=None, capture_error_mode="global",
               tag=DEFAULT_TAG, enable_cpu_backup=False):
    """``torch.cuda.graph`` capturing into the sleep tag ``tag``'s pool (unless ``pool`` is
    given), so that the graph's memory is paused and resumed with the tag and the graph
    replays after resume (torch_memory_saver's ``cuda_graph``)."""
    import torch

    if pool is None:
        pool = tag_pool(tag).id
    if enable_cpu_backup:
        _tag_backup[(_device_index(None), tag)] = True
    with torch.cuda.graph(cuda_graph, pool=pool, stream=stream,
                          capture_error_mode=capture_error_mode):
        yield


def _backup_of(tag, device, backup):
    if backup is not None:
        if backup not in ("none", "host"):
            raise ValueError("backup must be 'none' or 'host', not %r" % (backup,))
        return backup
    return "host" if _tag_backup.get((device, tag)) else "none"


def pause(tag=None, backup=None, device=None):
    """Gives the GPU memory of the sleep tag ``tag`` back (None: every tag not paused). Waits for
    the work of the streams that used the tag's tensors (events on them, not a device-wide
    synchronize); with ``backup="host"`` first copies the live tensors' bytes to pinned host
    memory; then unmaps and releases the pages, keeping their addresses. ``backup=None`` takes
    the tag's default: "host" if a region of it asked for enable_cpu_backup, else "none" (the
    contents are then undefined after resume). Until resume(), allocating in the tag's region
    raises; freeing its tensors is fine."""
    lib = load_library()
    index = _device_index(device)
    names = [tag] if tag is not None else [t["name"] for t in tags(index) if not t["paused"]]
    for name in names:
        mode = _backup_of(name, index, backup)
        _check(lib.gpualloc_pause(index, name.encode(), mode.encode()), "pause(%r)" % name)


def resume(tag=None, device=None):
    """Maps fresh GPU memory for the paused sleep tag ``tag`` (None: every paused tag) at the same
    addresses, and copies host backups back before returning. Raises GpuAllocError (out of
    memory) when the device has no room; the tag then stays paused."""
    lib = load_library()
    index = _device_index(device)
    name = tag.encode() if tag is not None else None
    _check(lib.gpualloc_resume(index, name), "resume(%r)" % (tag,))


def tags(device=None):
    """The sleep tags of ``device`` (-1: every device in use) as dicts: name, pool, paused,
    backup, paused_bytes (given back), backed_up_bytes, reserved_bytes (mapped now),
    allocated_bytes, segments."""
    dev = -1 if device == -1 else _device_index(device)
    return _take_json(load_library().gpualloc_tags_json(dev), "tags")


class _MemorySaver:
    """torch_memory_saver's interface over gpualloc's sleep tags, so that code written for it
    switches by replacing ``torch_memory_saver`` with ``gpu_alloc.memory_saver``."""

    enabled = True

    def region(self, tag=DEFAULT_TAG, enable_cpu_backup=False):
        return region(tag, enable_cpu_backup)

    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global",
                   tag=DEFAULT_TAG, enable_cpu_backup=False):
        return globals()["cuda_graph"](cuda_graph, pool, stream, capture_error_mode, tag,
                                       enable_cpu_backup)

    def pause(self, tag=None):
        pause(tag)

    def resume(self, tag=None):
        resume(tag)


memory_saver = _MemorySaver()


# ---------------------------------------------------------------- pinned host memory


def host_alloc(nbytes):
    """``nbytes`` of pinned (page-locked) host memory from the library's pinned host allocator,
    as an address (int). Give it back with host_free()."""
    ptr = load_library().gpualloc_host_alloc(int(nbytes))
    if not ptr:
        raise GpuAllocError("host_alloc(%d): %s" % (nbytes, last_error()))
    return ptr


def host_free(ptr):
    """Returns memory from host_alloc() to the cache."""
    _check(load_library().gpualloc_host_free(ctypes.c_void_p(ptr)), "host_free")


def host_record_stream(ptr, stream):
    """Declares that work queued on ``stream`` (a torch.cuda.Stream or raw handle) uses the
    pinned memory at ``ptr``: after host_free() it is reused only once that work is done."""
    handle = stream.cuda_stream if hasattr(stream, "cuda_stream") else int(stream)
    code = load_library().gpualloc_host_record_stream(ctypes.c_void_p(ptr), ctypes.c_void_p(handle))
    _check(code, "host_record_stream")


def pinned_empty(nbytes):
    """A torch.uint8 CPU tensor of ``nbytes`` in pinned memory from the library's pinned host
    allocator (``is_pinned()`` is True, so non_blocking copies are asynchronous); the memory
    goes back to the cache when the tensor is freed. Record streams that copy from or to it with
    ``host_record_stream(t.data_ptr(), stream)`` before dropping it."""
    import weakref

    torch = _import_torch("gpu_alloc.pinned_empty()")

    nbytes = int(nbytes)
    ptr = host_alloc(nbytes)
    buffer = (ctypes.c_uint8 * nbytes).from_address(ptr)
    weakref.finalize(buffer, host_free, ptr)
    return torch.frombuffer(buffer, dtype=torch.uint8)


# gpualloc_host_register's flag (gpualloc.h).
HOST_REGISTER_MAPPED = HEADER.constants["GPUALLOC_HOST_REGISTER_MAPPED"]


def host_register(ptr, nbytes, mapped=False):
    """Page-locks ``nbytes`` of host memory at ``ptr`` (an int address) that the caller
    allocated, for every CUDA context of the process (``cuMemHostRegister``, portable);
    ``mapped=True`` also maps it into the device address space. Counted in host_stats() as
    ``registered_bytes``. The memory must stay allocated until host_unregister(ptr). Raises
    ValueError for an empty range or one overlapping a range registered already."""
    flags = HOST_REGISTER_MAPPED if mapped else 0
    code = load_library().gpualloc_host_register(ctypes.c_void_p(ptr), int(nbytes), flags)
    _check(code, "host_register(%#x, %d)" % (ptr, nbytes))


def host_unregister(ptr):
    """Unpins the range host_register() pinned at ``ptr`` (its start). No queued copy may use
    it any more."""
    _check(load_library().gpualloc_host_unregister(ctypes.c_void_p(ptr)),
           "host_unregister(%#x)" % ptr)


def host_stats():
    """Counters of the pinned host allocator: allocated_bytes, cached_bytes, pending_bytes,
    reserved_bytes, peak_reserved_bytes, requests, cache_hits, host_allocs, host_frees; and
    of memory pinned in place with host_register(): registered_bytes, peak_registered_bytes,
    registered_ranges, host_registers, host_unregisters."""
    return _take_json(load_library().gpualloc_host_stats_json(), "host_stats")


def host_empty_cache():
    """Unpins every cached block of the pinned host allocator."""
    _check(load_library().gpualloc_host_empty_cache(), "host_empty_cache")


def memory_stats(device=None):
    """Statistics with torch.cuda.memory_stats()'s key names, as an OrderedDict sorted
    by key (all zero for a device the allocator never served)."""
    lib = load_library()
    ptr = lib.gpualloc_memory_stats_json(_device_index(device))
    if not ptr:
        raise GpuAllocError("gpualloc_memory_stats_json: %s" % last_error())
    try:
        import json

        data = json.loads(ctypes.string_at(ptr).decode())
    finally:
        lib.gpualloc_string_free(ptr)
    return collections.OrderedDict(sorted(data.items()))


def budget_bytes(budget):
    """A memory budget as ``advise`` takes it: an int of bytes, or a string of bytes or of
    whole MiB or GiB (``"24576MiB"``, ``"24GiB"``). Raises ValueError otherwise."""
    if isinstance(budget, bool):
        raise ValueError("budget %r: expected bytes, or a whole number of MiB or GiB" % (budget,))
    if isinstance(budget, int):
        value = budget
    else:
        text = str(budget).strip()
        unit = 1
        for suffix, scale in (("GiB", 1 << 30), ("MiB", 1 << 20)):
            if text.endswith(suffix):
                text, unit = text[: -len(suffix)].strip(), scale
                break
        if not text.isdigit():
            raise ValueError("budget %r: expected bytes, or a whole number of MiB or GiB (24GiB)"
                             % (budget,))
        value = int(text) * unit
    if not 0 < value < 1 << 64:
        raise ValueError("budget %r: expected a positive number of bytes" % (budget,))
    return value


def advise(snapshot, device=None, name=None, so_path=None, budget=None):
    """Which allocator setting for the workload recorded in ``snapshot``: the path of a
    ``torch.cuda.memory._dump_snapshot()`` pickle (or of a trace file), or its bytes.

    The library replays it under PyTorch's default and expandable segments and our
    settings on a simulated device (no GPU, no torch needed) and picks one by the rule of
    docs/advise.md. Returns a dict: ``recommended_setting``, ``enable_call`` (the
    ``gpu_alloc.enable(...)`` to use), ``gpualloc_conf``, ``cost`` (page moves per step, in
    words), ``outcomes`` (per setting: peak reserved, ratios to PyTorch's default and
    best, pages moved), ``steps`` and the printable ``text``. ``device``: the snapshot's
    device (default: the first with events). ``budget``: the memory the workload may use
    (bytes, or ``"24GiB"``; default: the device's memory): the ``budget`` setting reclaims
    at it and settings whose peak passes it are not recommended. Raises ValueError for a
    file that is not a snapshot with events or a bad budget, GpuAllocError for a library
    without ``gpualloc_advise`` (or, with a budget, ``gpualloc_advise_budget``)."""
    budget = 0 if budget is None else budget_bytes(budget)
    if isinstance(snapshot, (bytes, bytearray)):
        data = bytes(snapshot)
        name = name or "snapshot"
    else:
        with open(snapshot, "rb") as f:
            data = f.read()
        if name is None:
            name = os.path.basename(os.fspath(snapshot))
            for suffix in (".gz", ".pickle", ".pkl", ".snapshot", ".trace"):
                name = name[: -len(suffix)] if name.endswith(suffix) and name != suffix else name
    lib = load_library(so_path)
    entry_name = "gpualloc_advise_budget" if budget else "gpualloc_advise"
    entry = getattr(lib, entry_name, None)
    if entry is None:
        raise GpuAllocError(
            "%s has no %s (built before it, or without the `advise` feature): "
            "rebuild it" % (_lib_path, entry_name)
        )
    args = [data, len(data), -1 if device is None else int(device), name.encode()]
    if budget:
        args.append(budget)
    ptr = entry(*args)
    if not ptr:
        raise ValueError(last_error() or "gpualloc_advise failed")
    try:
        import json

        return json.loads(ctypes.string_at(ptr).decode())
    finally:
        lib.gpualloc_string_free(ptr)


def memory_allocated(device=None):
    """Bytes handed out to tensors (after rounding)."""
    return memory_stats(device)["allocated_bytes.all.current"]


def memory_reserved(device=None):
    """Bytes held from the device (cached included)."""
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_allocated(device=None):
    """Peak of memory_allocated since start or reset_peak_memory_stats."""
    return memory_stats(device)["allocated_bytes.all.peak"]


def max_memory_reserved(device=None):
    """Peak of memory_reserved since start or reset_peak_memory_stats."""
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device=None):
    """Makes every peak equal to the current value."""
    _check(load_library().gpualloc_reset_peak_stats(_device_index(device)), "reset_peak_stats")


def reset_accumulated_memory_stats(device=None):
    """Clears the cumulative counters."""
    lib = load_library()
    _check(lib.gpualloc_reset_accumulated_stats(_device_index(device)), "reset_accumulated_stats")


def empty_cache(device=None):
    """Returns unused cached memory to the driver (device=-1: every device)."""
    _check(load_library().gpualloc_empty_cache(_device_index(device)), "empty_cache")


def set_memory_fraction(fraction, device=None):
    """Limits reserved memory to `fraction` of the device's capacity."""
    lib = load_library()
    _check(lib.gpualloc_set_memory_fraction(float(fraction), _device_index(device)), "set_memory_fraction")


def record_stream(tensor, stream):
    """Tensor.record_stream for gpualloc: the tensor's block is not reused until the work
    queued on `stream` before its free has finished. (torch's own Tensor.record_stream is
    silently ignored under a pluggable allocator.)"""
    storage = tensor.untyped_storage()
    handle = stream.cuda_stream if hasattr(stream, "cuda_stream") else int(stream)
    code = load_library().gpualloc_record_stream(
        ctypes.c_void_p(storage.data_ptr()), _device_index(tensor.device), ctypes.c_void_p(handle)
    )
    _check(code, "record_stream")


def record_history(enabled=True, max_entries=100000):
    """Starts (clearing earlier events) or stops recording alloc/free/oom events, which
    snapshot() puts in device_traces (for the memory_viz timelines)."""
    _check(load_library().gpualloc_record_history(1 if enabled else 0, int(max_entries)), "record_history")


def snapshot(path=None, device=-1):
    """The allocator's state as torch.cuda.memory._snapshot() would give it: a dict with
    'segments', 'device_traces' and 'allocator_settings'. With `path`, also written there
    as a pickle for ``python -m torch.cuda._memory_viz`` or pytorch.org/memory_viz.
    device=-1 (default): every device in use."""
    lib = load_library()
    target = path
    if target is None:
        fd, target = tempfile.mkstemp(suffix=".pickle", prefix="gpualloc_")
        os.close(fd)
    try:
        dev = -1 if device == -1 else _device_index(device)
        _check(lib.gpualloc_write_snapshot(os.fsencode(target), dev), "write_snapshot")
        with open(target, "rb") as f:
            return pickle.load(f)
    finally:
        if path is None:
            os.unlink(target)


# ---------------------------------------------------------------- torch's names


def set_per_process_memory_fraction(fraction, device=None):
    """torch.cuda.set_per_process_memory_fraction's name for set_memory_fraction()."""
    set_memory_fraction(fraction, device)


def memory_snapshot(device=-1):
    """torch.cuda.memory_snapshot()'s view: the segments of snapshot(device=device)."""
    return snapshot(device=device)["segments"]


# ---------------------------------------------------------------- other libraries


def _import_torch(feature):
    """torch, or ModuleNotFoundError saying what to install for ``feature``."""
    from gpu_alloc import _libraries

    return _libraries.require("torch", feature)


# Attributes that import another GPU library, made on first access so that ``import
# gpu_alloc`` needs none of them: gpu_alloc.cupy_allocator (CuPy's allocator),
# gpu_alloc.cupy and gpu_alloc.numba (the modules), and _numba_memory_manager, which
# NUMBA_CUDA_MEMORY_MANAGER=gpu_alloc makes Numba look up here.
_LAZY = {
    "cupy_allocator": ("gpu_alloc.cupy", "cupy_allocator"),
    "cupy": ("gpu_alloc.cupy", None),
    "numba": ("gpu_alloc.numba", None),
    "_numba_memory_manager": ("gpu_alloc.numba", "GpuAllocNumbaManager"),
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError("module 'gpu_alloc' has no attribute %r" % name)
    import importlib

    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)
