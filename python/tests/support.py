"""What the CPU tests share: which gpu_alloc they test, and which library it loads.

By default they test this clone's python/gpu_alloc with the library from $GPUALLOC_SO if
set, else from a fresh `cargo build -p alloc-ffi` when cargo is on PATH (so that they never
run a stale library), else wherever gpu_alloc finds one.

With GPUALLOC_TEST_INSTALLED=1 they test gpu_alloc as the running Python imports it (an
installed wheel: run them from outside the clone, with that environment's python) and the
library packaged with it; importing a clone's gpu_alloc then is an error.
"""

import os
import shutil
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PYROOT = os.path.dirname(HERE)
REPO = os.path.dirname(PYROOT)
INSTALLED = os.environ.get("GPUALLOC_TEST_INSTALLED", "") not in ("", "0")

if not INSTALLED:
    sys.path.insert(0, PYROOT)

import gpu_alloc  # noqa: E402

if INSTALLED and os.path.dirname(os.path.abspath(gpu_alloc.__file__)).startswith(PYROOT):
    raise RuntimeError(
        "GPUALLOC_TEST_INSTALLED=1, but gpu_alloc was imported from the clone (%s): run the "
        "tests from outside it, with the python of the environment it is installed in"
        % gpu_alloc.__file__
    )


def _packaged_library():
    """The installed package's own library."""
    try:
        origin, path = gpu_alloc._find_library()
    except gpu_alloc.GpuAllocError as e:
        return None, str(e)
    if origin != "packaged":
        return None, "the installed gpu_alloc has no packaged library (%s found %s)" % (origin, path)
    return path, None


def _clone_library():
    """$GPUALLOC_SO, else a fresh debug build, else whatever gpu_alloc finds."""
    if os.environ.get("GPUALLOC_SO"):
        try:
            return gpu_alloc.library_path(os.environ["GPUALLOC_SO"]), None
        except gpu_alloc.GpuAllocError as e:
            return None, str(e)
    if shutil.which("cargo") is not None:
        r = subprocess.run(
            ["cargo", "build", "-p", "alloc-ffi"], cwd=REPO, capture_output=True, text=True
        )
        if r.returncode != 0:
            return None, "cargo build -p alloc-ffi failed:\n" + r.stderr[-2000:]
        return gpu_alloc.library_path(
            os.path.join(gpu_alloc.cargo_target_dir(), "debug", gpu_alloc.LIB_NAME)
        ), None
    try:
        return gpu_alloc.library_path(), None
    except gpu_alloc.GpuAllocError as e:
        return None, "%s (and no cargo on PATH to build it)" % e


SO, WHY_NO_SO = _packaged_library() if INSTALLED else _clone_library()
needs_so = unittest.skipIf(SO is None, "liballoc_ffi.so unavailable: %s" % WHY_NO_SO)


def child_env(**extra):
    """The environment of a child Python that imports the same gpu_alloc and names the
    same library in $GPUALLOC_SO."""
    env = dict(os.environ, GPUALLOC_SO=SO or "", **extra)
    if not INSTALLED:
        env["PYTHONPATH"] = PYROOT
    return env


# A child's first lines: load the library under test, whatever else gpu_alloc would find.
_LOAD_SO = "import os, gpu_alloc\ngpu_alloc.load_library(os.environ['GPUALLOC_SO'])\n"


def run_python(code, env_extra):
    """Runs `code` in a child Python with the library under test loaded."""
    return subprocess.run(
        [sys.executable, "-c", _LOAD_SO + code], env=child_env(**env_extra),
        capture_output=True, text=True,
    )


def run_gpu_alloc(*args, env_extra=None):
    """Runs `python -m gpu_alloc ARGS...` in a child Python."""
    return subprocess.run(
        [sys.executable, "-m", "gpu_alloc"] + list(args), env=child_env(**(env_extra or {})),
        capture_output=True, text=True,
    )
