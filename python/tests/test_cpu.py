"""CPU-only tests of the gpu_alloc helper: no torch, no GPU needed.

Run with either of
    python3 -m pytest python/tests/test_cpu.py
    python3 python/tests/test_cpu.py

They need liballoc_ffi.so: $GPUALLOC_SO if set; else, with cargo on PATH, a fresh
`cargo build -p alloc-ffi` (target/debug); else wherever gpu_alloc finds one (next to the
package, target/release, target/debug). Without any, the tests that need it are skipped
with a message.
torch is replaced by a mock where enable() is exercised.
"""

import ctypes
import contextlib
import io
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import types
import unittest
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
PYROOT = os.path.dirname(HERE)
REPO = os.path.dirname(PYROOT)
sys.path.insert(0, PYROOT)

import gpu_alloc  # noqa: E402


def _find_or_build_library():
    """$GPUALLOC_SO if set; else a fresh debug build when cargo is here (so that the
    tests never run a stale library); else whatever gpu_alloc finds."""
    if os.environ.get("GPUALLOC_SO"):
        try:
            return gpu_alloc.library_path(), None
        except gpu_alloc.GpuAllocError as e:
            return None, str(e)
    if shutil.which("cargo") is not None:
        r = subprocess.run(
            ["cargo", "build", "-p", "alloc-ffi"], cwd=REPO, capture_output=True, text=True
        )
        if r.returncode != 0:
            return None, "cargo build -p alloc-ffi failed:\n" + r.stderr[-2000:]
        return gpu_alloc.library_path(
            os.path.join(gpu_alloc.cargo_target_dir(), "debug", "liballoc_ffi.so")
        ), None
    try:
        return gpu_alloc.library_path(), None
    except gpu_alloc.GpuAllocError as e:
        return None, "%s (and no cargo on PATH to build it)" % e


SO, WHY_NO_SO = _find_or_build_library()
needs_so = unittest.skipIf(SO is None, "liballoc_ffi.so unavailable: %s" % WHY_NO_SO)


def fake_torch(available=True, initialized=False, swap_error=None, bridge=False):
    """A stand-in for the parts of torch that gpu_alloc.enable() touches; with bridge=True
    its cpp_extension.load "builds" a bridge module that records install()."""
    calls = []

    class CUDAPluggableAllocator:
        def __init__(self, path, alloc_fn_name, free_fn_name):
            calls.append(("CUDAPluggableAllocator", path, alloc_fn_name, free_fn_name))

    def change_current_allocator(allocator):
        if swap_error:
            raise RuntimeError(swap_error)
        calls.append(("change_current_allocator", allocator))

    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(
        is_available=lambda: available,
        is_initialized=lambda: initialized,
        current_device=lambda: 0,
        memory=types.SimpleNamespace(
            CUDAPluggableAllocator=CUDAPluggableAllocator,
            change_current_allocator=change_current_allocator,
        ),
    )
    if bridge:
        def load(name, sources, **kwargs):
            calls.append(("cpp_extension.load", name, os.path.basename(sources[0])))
            return types.SimpleNamespace(install=lambda path: calls.append(("install", path)))

        torch.utils = types.SimpleNamespace(cpp_extension=types.SimpleNamespace(load=load))
    return torch, calls


def run_python(code, env_extra):
    env = dict(os.environ, GPUALLOC_SO=SO or "", PYTHONPATH=PYROOT, **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


class WithoutLibrary(unittest.TestCase):
    def test_missing_library_is_a_clear_error(self):
        with self.assertRaises(gpu_alloc.GpuAllocError) as cm:
            gpu_alloc.library_path("/nonexistent/liballoc_ffi.so")
        self.assertIn("cargo build --release -p alloc-ffi", str(cm.exception))

    def test_module_imports_without_torch(self):
        self.assertTrue(callable(gpu_alloc.enable))
        self.assertEqual(gpu_alloc.ALLOC_FN, "gpualloc_malloc")
        self.assertEqual(gpu_alloc.FREE_FN, "gpualloc_free")


@needs_so
class Library(unittest.TestCase):
    def setUp(self):
        gpu_alloc._enabled_with = None
        gpu_alloc._bridge = None
        gpu_alloc.load_library(SO)

    def test_version(self):
        self.assertRegex(gpu_alloc.version(), r"^\d+\.\d+\.\d+")

    def test_check_config(self):
        gpu_alloc.check_config("")
        gpu_alloc.check_config("policy:size-class,max_split_size_mb:128,expandable_segments:False")
        gpu_alloc.check_config("roundup_power2_divisions:[256:1,512:2,>:4]")
        gpu_alloc.check_config("policy:size-class,idle_slab_limit_mb:256")
        for bad, words in [
            ("idle_slab_limit_mb:256", ["idle_slab_limit_mb", "size-class"]),
            ("max_split_size_mb:1", ["max_split_size_mb", "at least 20"]),
            ("bogus:1", ["bogus"]),
            ("policy:nope", ["nope", "compiled-in policies"]),
            ("garbage_collection_threshold:2", ["strictly between"]),
        ]:
            with self.assertRaises(ValueError) as cm:
                gpu_alloc.check_config(bad)
            for w in words:
                self.assertIn(w, str(cm.exception))

    def test_stats_of_unused_device_are_zero(self):
        s = gpu_alloc.memory_stats(device=3)
        self.assertEqual(list(s), sorted(s))
        for k in ["allocated_bytes.all.current", "reserved_bytes.all.peak", "num_ooms",
                  "requested_bytes.large_pool.allocated", "segment.small_pool.current"]:
            self.assertEqual(s[k], 0, k)
        self.assertEqual(s["max_split_size"], -1)
        self.assertEqual(gpu_alloc.memory_reserved(3), 0)
        self.assertEqual(gpu_alloc.max_memory_allocated("cuda:3"), 0)
        with self.assertRaises(gpu_alloc.GpuAllocError):
            gpu_alloc.memory_stats(device=100)

    def test_cache_calls_and_bad_arguments(self):
        gpu_alloc.empty_cache(device=5)
        gpu_alloc.reset_peak_memory_stats(5)
        gpu_alloc.reset_accumulated_memory_stats(5)
        with self.assertRaises(ValueError) as cm:
            gpu_alloc.set_memory_fraction(1.5, device=0)
        self.assertIn("(0, 1]", str(cm.exception))
        with self.assertRaises(ValueError):
            gpu_alloc.empty_cache(device=-7)

    def test_snapshot_of_nothing(self):
        snap = gpu_alloc.snapshot(device=2)
        self.assertEqual(set(snap), {"segments", "device_traces", "allocator_settings"})
        self.assertEqual(snap["segments"], [])
        self.assertEqual(snap["device_traces"], [[], [], []])
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "s.pickle")
            gpu_alloc.snapshot(p)
            with open(p, "rb") as f:
                self.assertIn("segments", pickle.load(f))
        with self.assertRaises(ValueError):
            gpu_alloc.snapshot("/nonexistent-dir/s.pickle")

    def test_garbage_free_is_reported_not_a_crash(self):
        lib = gpu_alloc.load_library()
        lib.gpualloc_free(ctypes.c_void_p(0xDEADBEEF), 16, 0, None)
        self.assertIn("0xdeadbeef", gpu_alloc.last_error())
        self.assertIsNone(lib.gpualloc_malloc(0, 0, None))  # size 0: NULL, no error
        self.assertIsNone(gpu_alloc.last_error())
        self.assertIsNone(lib.gpualloc_malloc(-5, 0, None))
        self.assertIn("negative", gpu_alloc.last_error())

    def test_record_history_switch(self):
        gpu_alloc.record_history(True, max_entries=10)
        gpu_alloc.record_history(False)

    # enable() with torch mocked -------------------------------------------------

    def test_enable_installs_the_pluggable_allocator(self):
        torch, calls = fake_torch()
        with mock.patch.dict(sys.modules, {"torch": torch}), mock.patch.dict(os.environ):
            os.environ.pop("GPUALLOC_CONF", None)
            gpu_alloc.enable(so_path=SO)
            self.assertTrue(gpu_alloc.is_enabled())
            gpu_alloc.enable()  # again: a no-op
        self.assertEqual(calls[0], ("CUDAPluggableAllocator", SO, "gpualloc_malloc", "gpualloc_free"))
        self.assertEqual(calls[1][0], "change_current_allocator")
        self.assertEqual(len(calls), 2)

    def test_enable_installs_the_bridge_when_it_builds(self):
        torch, calls = fake_torch(bridge=True)
        modules = {"torch": torch, "torch.utils": torch.utils}
        with mock.patch.dict(sys.modules, modules), mock.patch.dict(os.environ):
            os.environ.pop("GPUALLOC_CONF", None)
            gpu_alloc.enable(so_path=SO)
            self.assertTrue(gpu_alloc.uses_bridge())
        self.assertEqual(calls[0], ("cpp_extension.load", "gpu_alloc_bridge", "bridge.cpp"))
        self.assertEqual(calls[1], ("install", SO))
        self.assertEqual(len(calls), 2, "no plain pluggable allocator as well")

    def test_enable_falls_back_to_plain_pluggable_and_says_what_is_lost(self):
        torch, calls = fake_torch()  # no torch.utils: the bridge cannot be built
        err = io.StringIO()
        with mock.patch.dict(sys.modules, {"torch": torch}), mock.patch.dict(os.environ), \
                contextlib.redirect_stderr(err):
            os.environ.pop("GPUALLOC_CONF", None)
            gpu_alloc.enable(so_path=SO)
        self.assertFalse(gpu_alloc.uses_bridge())
        self.assertEqual(calls[0][0], "CUDAPluggableAllocator")
        self.assertIn("cannot build the C++ bridge", err.getvalue())
        self.assertIn("record_stream", err.getvalue())

    def test_enable_with_bridge_required_raises_when_it_cannot_be_built(self):
        torch, calls = fake_torch()
        with mock.patch.dict(sys.modules, {"torch": torch}):
            with self.assertRaises(gpu_alloc.GpuAllocError) as cm:
                gpu_alloc.enable(so_path=SO, bridge=True)
        self.assertIn("C++ bridge", str(cm.exception))
        self.assertEqual(calls, [])
        self.assertFalse(gpu_alloc.is_enabled())

    def test_no_compiler_is_named(self):
        with mock.patch.dict(os.environ, {"PATH": "", "CXX": "no-such-compiler"}):
            with self.assertRaises(gpu_alloc.GpuAllocError) as cm:
                gpu_alloc.build_bridge()
        self.assertIn("no C++ compiler", str(cm.exception))

    def test_enable_too_late_says_so(self):
        torch, _ = fake_torch(swap_error="Can't swap an already initialized allocator")
        with mock.patch.dict(sys.modules, {"torch": torch}):
            with self.assertRaises(gpu_alloc.GpuAllocError) as cm:
                gpu_alloc.enable()
        self.assertIn("before the first CUDA allocation", str(cm.exception))
        self.assertFalse(gpu_alloc.is_enabled())
        torch, calls = fake_torch(initialized=True)
        with mock.patch.dict(sys.modules, {"torch": torch}):
            with self.assertRaises(gpu_alloc.GpuAllocError) as cm:
                gpu_alloc.enable()
        self.assertIn("before the first CUDA allocation", str(cm.exception))
        self.assertEqual(calls, [], "no swap attempted once CUDA is initialised")

    def test_enable_without_gpu_says_so(self):
        torch, calls = fake_torch(available=False)
        with mock.patch.dict(sys.modules, {"torch": torch}):
            with self.assertRaises(gpu_alloc.GpuAllocError) as cm:
                gpu_alloc.enable()
        self.assertIn("no CUDA device", str(cm.exception))
        self.assertEqual(calls, [])

    def test_enable_rejects_a_bad_config_before_touching_torch(self):
        torch, calls = fake_torch()
        with mock.patch.dict(sys.modules, {"torch": torch}):
            with self.assertRaises(ValueError) as cm:
                gpu_alloc.enable("max_split_size_mb:5")
            self.assertIn("max_split_size_mb", str(cm.exception))
            with mock.patch.dict(os.environ, {"GPUALLOC_CONF": "bogus:1"}):
                with self.assertRaises(ValueError) as cm:
                    gpu_alloc.enable()
                self.assertIn("bogus", str(cm.exception))
        self.assertEqual(calls, [])

    # fresh processes (the configuration is sealed once per process) ----------

    def test_enable_with_config_then_library_refuses_changes(self):
        code = r"""
import sys, ctypes
sys.path.insert(0, %r)
from test_cpu import fake_torch
import gpu_alloc
torch, calls = fake_torch()
sys.modules["torch"] = torch
gpu_alloc.enable("policy:size-class,max_split_size_mb:64")
import os
assert os.environ["GPUALLOC_CONF"] == "policy:size-class,max_split_size_mb:64"
assert calls[0][2:] == ("gpualloc_malloc", "gpualloc_free"), calls
try:
    gpu_alloc.enable("policy:buddy")
    raise SystemExit("expected an error")
except gpu_alloc.GpuAllocError as e:
    assert "cannot change" in str(e), e
lib = gpu_alloc.load_library()
lib.gpualloc_malloc(1024, 0, None)  # first use (fails without a GPU)
assert lib.gpualloc_configure(b"policy:buddy") == gpu_alloc.ERR_TOO_LATE
assert "before the first use" in gpu_alloc.last_error()
print("subprocess ok")
""" % HERE
        r = run_python(code, {})
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("subprocess ok", r.stdout)

    def test_bad_env_config_fails_allocations_and_is_reported_once(self):
        code = r"""
import gpu_alloc
lib = gpu_alloc.load_library()
for _ in range(3):
    assert lib.gpualloc_malloc(4096, 0, None) is None
    msg = gpu_alloc.last_error()
    assert "invalid GPUALLOC_CONF" in msg and "roundup_power2_divisions" in msg, msg
print("subprocess ok")
"""
        r = run_python(code, {"GPUALLOC_CONF": "roundup_power2_divisions:3"})
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("subprocess ok", r.stdout)
        self.assertEqual(r.stderr.count("GPUALLOC_CONF"), 1, r.stderr)
        self.assertIn("every allocation will fail", r.stderr)

    def test_no_gpu_allocation_fails_cleanly(self):
        code = r"""
import gpu_alloc
lib = gpu_alloc.load_library()
p = lib.gpualloc_malloc(1 << 20, 0, None)
if p is None:
    print("NULL:", gpu_alloc.last_error())
else:
    lib.gpualloc_free(p, 1 << 20, 0, None)
    print("allocated on a real GPU")
"""
        r = run_python(code, {"GPUALLOC_CONF": ""})
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        if "NULL:" in r.stdout:
            self.assertRegex(r.stdout, r"libcuda|CUDA|device")
            self.assertIn("gpualloc_malloc(1048576 bytes, device 0) returned NULL", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
