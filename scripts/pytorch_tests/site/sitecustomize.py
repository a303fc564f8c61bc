"""Makes gpualloc PyTorch's CUDA allocator in every Python process that starts with this
folder on PYTHONPATH and GPUALLOC_TESTS_ENABLE=1: the test process of run.py and every
Python process its tests start (subprocess.run([sys.executable, ...]), multiprocessing's
spawn children), before any of them can initialise CUDA.

gpu_alloc.enable(bridge=True) reads $GPUALLOC_CONF and $GPUALLOC_SO and requires the C++
bridge: without it the process would run under a plain pluggable allocator, which is not
what the tests are meant to judge. What happened is kept in GPUALLOC_TESTS_STATUS (child.py
reads it) and, for failures, appended to $GPUALLOC_TESTS_LOG, not printed: some tests
compare what a subprocess writes to stderr.

Another sitecustomize that this one shadows on sys.path runs first.
"""
import os
import sys

GPUALLOC_TESTS_STATUS = None


def _run_shadowed():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        import importlib.machinery
        import importlib.util

        path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
        if spec is None or spec.origin is None:
            return
        if os.path.abspath(spec.origin) == os.path.abspath(__file__):
            return
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception:  # noqa: BLE001 - the other sitecustomize is not ours to fix
        pass


def _log(message):
    path = os.environ.get("GPUALLOC_TESTS_LOG")
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write("pid %d (%s): %s\n" % (os.getpid(), " ".join(sys.argv)[:200], message))
    except OSError:
        pass


def _enable():
    global GPUALLOC_TESTS_STATUS
    if os.environ.get("GPUALLOC_TESTS_ENABLE") != "1":
        return
    status = {"enabled": False, "bridge": False, "error": None,
              "config": os.environ.get("GPUALLOC_CONF")}
    try:
        import gpu_alloc

        gpu_alloc.enable(bridge=True)
        status["enabled"] = gpu_alloc.is_enabled()
        status["bridge"] = gpu_alloc.uses_bridge()
        status["library"] = gpu_alloc.library_path()
        status["version"] = gpu_alloc.version()
    except BaseException as e:  # noqa: B036 - never stop the interpreter from starting
        status["error"] = "%s: %s" % (type(e).__name__, str(e).strip()[-1500:])
        _log("enabling gpualloc failed: " + status["error"])
    GPUALLOC_TESTS_STATUS = status


_run_shadowed()
_enable()
