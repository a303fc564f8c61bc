"""``python -m gpu_alloc doctor``: what this machine can do with gpu_alloc, in plain words.

Every line of the report starts with ``ok``, ``problem`` or ``note``, and every problem is
followed by its fix. In order, it looks at:

- the C library: where it was found and its version;
- the NVIDIA driver: ``libcuda.so.1`` (which the library opens at run time) and the CUDA
  version it supports;
- the GPUs the driver sees (through torch when the driver cannot be asked);
- torch: its version, its CUDA build, and whether ``torch.cuda`` is available;
- what building the C++ bridge needs: a C++ compiler, ninja, CUDA headers;
- the bridge's build itself, tried only where torch has CUDA (cached in torch's extension
  folder, so that enable() later finds it built);
- ``$GPUALLOC_CONF``, validated by the library.

The exit status is 0 when everything the PyTorch path needs works (enable() would install
gpualloc through the bridge), 1 otherwise. No check raises: one that fails unexpectedly
becomes a problem line of its own.
"""

import collections
import ctypes
import importlib
import os
import platform
import shutil
import sys

import gpu_alloc

OK = "ok"
PROBLEM = "problem"
NOTE = "note"

BRIDGE_NAME = "gpu_alloc_bridge"
HEADER = "cuda_runtime_api.h"

Finding = collections.namedtuple("Finding", "status topic text fix")
Gpu = collections.namedtuple("Gpu", "index name total_bytes capability vmm")


class Report:
    """The findings, in order; printed as they come when given a stream."""

    def __init__(self, stream=None):
        self.findings = []
        self._stream = stream

    def add(self, status, topic, text, fix=None):
        finding = Finding(status, topic, text, fix)
        self.findings.append(finding)
        if self._stream is not None:
            for line in format_finding(finding):
                print(line, file=self._stream)
            self._stream.flush()
        return finding

    def problems(self):
        return [f for f in self.findings if f.status == PROBLEM]

    def exit_status(self):
        return 1 if self.problems() else 0


def format_finding(finding):
    """The lines of one finding: ``status  topic: text`` and, for a fix, ``fix: ...``."""
    lines = ["%-8s%s: %s" % (finding.status, finding.topic, finding.text)]
    if finding.fix:
        lines.append("%8sfix: %s" % ("", finding.fix))
    return lines


# The NVIDIA driver -----------------------------------------------------------------------


class CudaError(Exception):
    """A driver API call that did not return CUDA_SUCCESS."""

    NO_DEVICE = 100

    def __init__(self, call, code, name):
        super().__init__("%s returned %s (%d)" % (call, name, code))
        self.code = code
        self.name = name


class CudaDriver:
    """The few driver API calls the doctor makes, through ctypes on libcuda.so.1 (the
    library that gpualloc itself opens at run time)."""

    LIBRARY = "libcuda.so.1"
    _ATTR_CC_MAJOR = 75  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    _ATTR_CC_MINOR = 76
    _ATTR_VMM = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED

    def __init__(self, lib):
        self._lib = lib

    @classmethod
    def load(cls):
        """Opens the driver library; raises OSError where there is none."""
        return cls(ctypes.CDLL(cls.LIBRARY))

    def _error_name(self, code):
        name = ctypes.c_char_p()
        try:
            if self._lib.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
                return name.value.decode()
        except AttributeError:
            pass
        return "error"

    def _call(self, function, *args):
        code = getattr(self._lib, function)(*args)
        if code != 0:
            raise CudaError(function, code, self._error_name(code))

    def driver_version(self):
        """The newest CUDA version the driver supports, as (major, minor)."""
        version = ctypes.c_int()
        self._call("cuDriverGetVersion", ctypes.byref(version))
        return version.value // 1000, version.value % 1000 // 10

    def init(self):
        self._call("cuInit", 0)

    def _attribute(self, attribute, device):
        value = ctypes.c_int()
        self._call("cuDeviceGetAttribute", ctypes.byref(value), attribute, device)
        return value.value

    def devices(self):
        """The visible GPUs (after init())."""
        count = ctypes.c_int()
        self._call("cuDeviceGetCount", ctypes.byref(count))
        gpus = []
        for index in range(count.value):
            device = ctypes.c_int()
            self._call("cuDeviceGet", ctypes.byref(device), index)
            name = ctypes.create_string_buffer(256)
            self._call("cuDeviceGetName", name, len(name), device)
            total = ctypes.c_size_t()
            self._call("cuDeviceTotalMem_v2", ctypes.byref(total), device)
            capability = (
                self._attribute(self._ATTR_CC_MAJOR, device),
                self._attribute(self._ATTR_CC_MINOR, device),
            )
            vmm = bool(self._attribute(self._ATTR_VMM, device))
            gpus.append(Gpu(index, name.value.decode(), total.value, capability, vmm))
        return gpus


def _import_torch():
    return importlib.import_module("torch")


# The checks ------------------------------------------------------------------------------

_ORIGINS = {
    "so_path": "given with --so",
    "packaged": "packaged with gpu_alloc",
    "$" + gpu_alloc.ENV_SO: "from $" + gpu_alloc.ENV_SO,
    "cargo release build": "cargo's release build in this clone",
    "cargo debug build": "cargo's debug build in this clone",
}

_INSTALL_LIBRARY = (
    "install gpu_alloc with its library: `pip install <the gpu_alloc wheel>`, or "
    "`pip install .` in a clone of the repository (needs Rust); or build it in a clone with "
    "`cargo build --release -p alloc-ffi`, or set $%s to a liballoc_ffi.so" % gpu_alloc.ENV_SO
)


def check_library(report, so_path=None):
    """Finds and loads the C library; returns whether it loaded."""
    topic = "library"
    try:
        origin, path = gpu_alloc._find_library(so_path)
    except gpu_alloc.GpuAllocError:
        looked = ", ".join(p for _, p in gpu_alloc.library_candidates(so_path))
        report.add(PROBLEM, topic, "%s not found (looked at: %s)" % (gpu_alloc.LIB_NAME, looked),
                   _INSTALL_LIBRARY)
        return False
    try:
        gpu_alloc.load_library(so_path)
        version = gpu_alloc.version()
    except gpu_alloc.GpuAllocError as e:
        report.add(PROBLEM, topic, str(e),
                   "this build does not run here: install the manylinux wheel, or rebuild on "
                   "this machine with `pip install .` in a clone")
        return False
    report.add(OK, topic, "%s (%s), version %s" % (path, _ORIGINS.get(origin, origin), version))
    env_so = os.environ.get(gpu_alloc.ENV_SO)
    if origin == "packaged" and env_so and os.path.abspath(env_so) != path:
        report.add(NOTE, topic, "$%s=%s is not used: the packaged library comes first "
                   "(enable(so_path=...) loads another)" % (gpu_alloc.ENV_SO, env_so))
    if origin == "cargo debug build":
        report.add(NOTE, topic, "a debug build (slower); `cargo build --release -p alloc-ffi` "
                   "makes the release build, which comes first")
    return True


def check_driver(report, load_cuda):
    """Opens libcuda.so.1; returns the driver and the CUDA version it supports (or Nones)."""
    topic = "NVIDIA driver"
    try:
        cuda = load_cuda()
    except OSError as e:
        report.add(PROBLEM, topic, "%s cannot be loaded (%s): gpu_alloc cannot reach a GPU"
                   % (CudaDriver.LIBRARY, e),
                   "install the NVIDIA driver (it provides %s); in a container, start it with "
                   "the GPUs (e.g. `docker run --gpus all` with the NVIDIA Container Toolkit)"
                   % CudaDriver.LIBRARY)
        return None, None
    try:
        version = cuda.driver_version()
    except CudaError as e:
        report.add(PROBLEM, topic, "%s loaded, but %s" % (CudaDriver.LIBRARY, e),
                   "reinstall the NVIDIA driver; `nvidia-smi` should list the GPUs")
        return None, None
    report.add(OK, topic, "%s loaded; the driver supports CUDA %d.%d"
               % ((CudaDriver.LIBRARY,) + version))
    return cuda, version


def _gib(n):
    return "%.1f GiB" % (n / 2.0**30)


def check_gpus(report, cuda):
    """Lists the GPUs through the driver; returns how many there are (None: unknown)."""
    topic = "GPUs"
    if cuda is None:
        return None
    try:
        cuda.init()
        gpus = cuda.devices()
    except CudaError as e:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        fix = "`nvidia-smi` should list the GPUs"
        if visible is not None:
            fix += "; $CUDA_VISIBLE_DEVICES=%r selects which ones this process sees" % visible
        if e.code == CudaError.NO_DEVICE:
            report.add(PROBLEM, topic, "the driver sees no GPU (%s)" % e, fix)
        else:
            report.add(PROBLEM, topic, "the driver cannot start (%s)" % e, fix)
        return 0
    if not gpus:
        report.add(PROBLEM, topic, "the driver sees no GPU", "`nvidia-smi` should list the GPUs")
    for gpu in gpus:
        text = "%d: %s, %s, compute capability %d.%d" % (
            (gpu.index, gpu.name, _gib(gpu.total_bytes)) + tuple(gpu.capability))
        if not gpu.vmm:
            text += "; no virtual memory management, so expandable_segments:True cannot work"
        report.add(OK, topic, text)
    return len(gpus)


def _cuda_major(version_text):
    try:
        return int(str(version_text).split(".")[0])
    except ValueError:
        return None


def check_torch(report, import_torch, driver_cuda, driver_gpus):
    """Imports torch; returns (torch or None, whether torch.cuda is available)."""
    topic = "torch"
    try:
        torch = import_torch()
    except ImportError:
        report.add(PROBLEM, topic,
                   "not installed: gpu_alloc's library functions work without it, but enable() "
                   "and pool() need it",
                   "`pip install torch` (its Linux wheels are CUDA builds), or install gpu_alloc "
                   "with its `torch` extra")
        return None, False
    except Exception as e:  # a broken installation fails in many ways
        report.add(PROBLEM, topic, "cannot be imported: %s: %s" % (type(e).__name__, e),
                   "reinstall torch (`pip install --force-reinstall torch`)")
        return None, False
    built_for = getattr(torch.version, "cuda", None)
    if not built_for:
        report.add(PROBLEM, topic, "%s is a CPU-only build" % torch.__version__,
                   "install a CUDA build of torch (PyTorch's install page gives the command for "
                   "each CUDA version)")
        return torch, False
    report.add(OK, topic, "%s, built for CUDA %s" % (torch.__version__, built_for))
    if torch.cuda.is_available():
        report.add(OK, "torch.cuda", "available, %d device(s)" % torch.cuda.device_count())
        if driver_gpus is None:  # the driver could not be asked: name them through torch
            for i in range(torch.cuda.device_count()):
                report.add(OK, "GPUs", "%d: %s" % (i, torch.cuda.get_device_name(i)))
        return torch, True
    fix = "fix the NVIDIA driver or GPU problem above"
    torch_major = _cuda_major(built_for)
    if driver_cuda is not None and torch_major is not None and torch_major > driver_cuda[0]:
        fix = ("the driver supports CUDA %d.%d, older than torch's %s: update the driver, or "
               "install a torch build for CUDA %d" % (driver_cuda + (built_for, driver_cuda[0])))
    elif driver_cuda is not None and driver_gpus:
        fix = "check that this process may use the GPUs (`nvidia-smi`, $CUDA_VISIBLE_DEVICES)"
    report.add(PROBLEM, "torch.cuda", "not available (torch.cuda.is_available() is False)", fix)
    return torch, False


def _cuda_home(torch):
    """The CUDA toolkit folder that torch's extension builder would use."""
    if torch is not None:
        try:
            return importlib.import_module("torch.utils.cpp_extension").CUDA_HOME
        except Exception:  # an old or broken torch: fall back to the same search below
            pass
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    return "/usr/local/cuda" if os.path.isdir("/usr/local/cuda") else None


def check_bridge_tools(report, torch):
    """A C++ compiler, ninja and CUDA headers: what building the bridge needs. Returns
    whether all are there."""
    topic = "C++ bridge"
    found = True
    compiler = gpu_alloc.cxx_compiler()
    if compiler:
        report.add(OK, topic, "C++ compiler %s" % compiler)
    else:
        found = False
        report.add(PROBLEM, topic, "no C++ compiler ($CXX, c++ or g++ on PATH)",
                   "install one (Debian/Ubuntu: `apt-get install g++`), or set $CXX")
    ninja = shutil.which("ninja")
    if ninja:
        report.add(OK, topic, "ninja %s" % ninja)
    else:
        found = False
        report.add(PROBLEM, topic, "no ninja on PATH (torch's extension builder runs it)",
                   "`pip install ninja` into this environment, with its bin folder on PATH")
    home = _cuda_home(torch)
    header = os.path.join(home, "include", HEADER) if home else None
    if header and os.path.isfile(header):
        report.add(OK, topic, "CUDA headers %s" % header)
    else:
        found = False
        where = "CUDA_HOME is %s" % home if home else "no CUDA toolkit found"
        wanted = getattr(getattr(torch, "version", None), "cuda", None)
        report.add(PROBLEM, topic, "no CUDA headers (%s; %s)" % (HEADER, where),
                   "install the CUDA toolkit%s and set $CUDA_HOME to it"
                   % (" for CUDA %s (torch's)" % wanted if wanted else ""))
    return found


def bridge_cache_dir(torch):
    """Where torch's extension builder keeps the built bridge (with torch, its own answer;
    without, the root of its cache: $TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions)."""
    if torch is not None:
        try:
            cpp_extension = importlib.import_module("torch.utils.cpp_extension")
            return cpp_extension._get_build_directory(BRIDGE_NAME, False)
        except Exception:  # a private function of torch: fall back to its documented root
            pass
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions")


def check_bridge_build(report, torch, cuda_available, build):
    """Builds the bridge where torch has CUDA (or says why not)."""
    topic = "C++ bridge"
    cache = bridge_cache_dir(torch)
    if not cuda_available:
        report.add(NOTE, topic, "not built: that needs torch with CUDA; enable() builds it on "
                   "first use, into torch's extension cache (%s)" % cache)
        return
    if not build:
        report.add(NOTE, topic, "not built (--no-build); enable() builds it on first use, into "
                   "%s" % cache)
        return
    try:
        gpu_alloc.build_bridge()
    except gpu_alloc.GpuAllocError as e:
        report.add(PROBLEM, topic, "does not build: %s" % e,
                   "fix what the lines above and the compiler's message name, then run this "
                   "again (without the bridge, enable() falls back to a plain "
                   "CUDAPluggableAllocator, where %s)" % gpu_alloc._WITHOUT_BRIDGE)
        return
    report.add(OK, topic, "built, cached in %s: enable() installs gpu_alloc with all of "
               "PyTorch's memory interface" % cache)


def check_config(report, library_loaded):
    """Validates $GPUALLOC_CONF with the library."""
    topic = "$" + gpu_alloc.ENV_CONF
    config = os.environ.get(gpu_alloc.ENV_CONF)
    if not config:
        report.add(NOTE, topic, "not set: the default configuration (policy:pytorch-bfc); set "
                   "it, or pass enable(config), for another")
    elif not library_loaded:
        report.add(NOTE, topic, "%r not checked: that needs the library" % config)
    else:
        try:
            gpu_alloc.check_config(config)
            report.add(OK, topic, "%r is valid" % config)
        except ValueError as e:
            report.add(PROBLEM, topic, str(e),
                       "correct or unset $%s: while it is invalid, every allocation fails"
                       % gpu_alloc.ENV_CONF)
    torch_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if torch_conf:
        report.add(NOTE, "$PYTORCH_CUDA_ALLOC_CONF",
                   "%r: with the bridge its device options apply to gpu_alloc too, except those "
                   "$%s or enable(config) names" % (torch_conf, gpu_alloc.ENV_CONF))


# The whole report ------------------------------------------------------------------------


def _guarded(report, topic, check, *args, default=None):
    """Runs one check; an unexpected exception becomes a problem line instead of a crash."""
    try:
        return check(report, *args)
    except Exception as e:
        report.add(PROBLEM, topic, "the check itself failed: %s: %s" % (type(e).__name__, e),
                   "report this, with the output of `python -m gpu_alloc doctor`")
        return default


def _package_description():
    try:
        from importlib import metadata

        installed = "gpu_alloc %s" % metadata.version("gpu-alloc")
    except Exception:  # not installed as a distribution (a clone on sys.path)
        installed = "gpu_alloc (not installed)"
    return "%s at %s" % (installed, os.path.dirname(os.path.abspath(gpu_alloc.__file__)))


def diagnose(so_path=None, build=True, load_cuda=CudaDriver.load, import_torch=_import_torch,
             stream=None):
    """Runs every check and returns the Report (printed as it goes when given a stream).
    load_cuda and import_torch stand in for the driver and torch in tests."""
    report = Report(stream)
    if stream is not None:
        print("gpu_alloc doctor: %s; Python %s (%s), %s %s" % (
            _package_description(), platform.python_version(), sys.executable,
            platform.system(), platform.machine()), file=stream)
    loaded = _guarded(report, "library", check_library, so_path, default=False)
    cuda, driver_cuda = _guarded(report, "NVIDIA driver", check_driver, load_cuda,
                                 default=(None, None))
    gpus = _guarded(report, "GPUs", check_gpus, cuda)
    torch, cuda_available = _guarded(report, "torch", check_torch, import_torch, driver_cuda,
                                     gpus, default=(None, False))
    _guarded(report, "C++ bridge", check_bridge_tools, torch)
    _guarded(report, "C++ bridge", check_bridge_build, torch, cuda_available, build)
    _guarded(report, "$" + gpu_alloc.ENV_CONF, check_config, loaded)
    return report, loaded


def summary(report, library_loaded):
    """The closing sentence."""
    problems = len(report.problems())
    if not problems:
        return ("ready: gpu_alloc.enable() before the first CUDA tensor makes gpu_alloc "
                "PyTorch's allocator")
    text = "%d problem%s: the PyTorch path (gpu_alloc.enable()) needs %s fixed" % (
        problems, "" if problems == 1 else "s", "it" if problems == 1 else "them")
    if library_loaded:
        text += "; the library itself loads and checks configurations here"
    return text


def main(so_path=None, build=True, stream=None):
    """Prints the report (to stdout by default); returns the exit status."""
    stream = stream or sys.stdout
    report, loaded = diagnose(so_path=so_path, build=build, stream=stream)
    print("summary: %s" % summary(report, loaded), file=stream)
    return report.exit_status()
