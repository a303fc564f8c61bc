"""CPU-only tests of the gpu_alloc helper: no torch, no GPU needed.

Run with either of
    python3 -m pytest python/tests/test_cpu.py
    python3 python/tests/test_cpu.py

They test this clone's gpu_alloc with a fresh `cargo build -p alloc-ffi` (or $GPUALLOC_SO),
or, with GPUALLOC_TEST_INSTALLED=1, the installed package and its packaged library (see
support.py). Without a library, the tests that need it are skipped with a message.
torch is replaced by a mock where enable() is exercised.
"""

import ctypes
import os
import pickle
import sys
import tempfile
import types
import unittest
import warnings
from unittest import mock

from support import HERE, INSTALLED, PYROOT, SO, gpu_alloc, needs_so, run_python


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


class WithoutLibrary(unittest.TestCase):
    def test_missing_library_is_a_clear_error(self):
        with self.assertRaises(gpu_alloc.GpuAllocError) as cm:
            gpu_alloc.library_path("/nonexistent/liballoc_ffi.so")
        self.assertIn("cargo build --release -p alloc-ffi", str(cm.exception))

    def test_module_imports_without_torch(self):
        self.assertTrue(callable(gpu_alloc.enable))
        self.assertEqual(gpu_alloc.ALLOC_FN, "gpualloc_malloc")
        self.assertEqual(gpu_alloc.FREE_FN, "gpualloc_free")


class LibraryLookup(unittest.TestCase):
    """library_path()'s order, on files in a scratch folder laid out as a clone: so_path,
    else the packaged library, else $GPUALLOC_SO, else the clone's cargo builds."""

    def setUp(self):
        scratch = tempfile.TemporaryDirectory()
        self.addCleanup(scratch.cleanup)
        self.root = scratch.name
        self.package = os.path.join(self.root, "python", "gpu_alloc")
        os.makedirs(self.package)
        self.touch("Cargo.toml")
        for patcher in [mock.patch.object(gpu_alloc, "_HERE", self.package),
                        mock.patch.dict(os.environ)]:
            patcher.start()
            self.addCleanup(patcher.stop)
        os.environ.pop("GPUALLOC_SO", None)
        os.environ.pop("CARGO_TARGET_DIR", None)
        self.packaged = os.path.join(self.package, "liballoc_ffi.so")
        self.release = os.path.join(self.root, "target", "release", "liballoc_ffi.so")
        self.debug = os.path.join(self.root, "target", "debug", "liballoc_ffi.so")
        self.env_so = os.path.join(self.root, "elsewhere", "liballoc_ffi.so")

    def touch(self, *parts):
        path = os.path.join(self.root, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").close()
        return path

    def test_packaged_first_then_env_then_release_then_debug(self):
        for path in [self.packaged, self.release, self.debug, self.env_so]:
            self.touch(path)
        os.environ["GPUALLOC_SO"] = self.env_so
        for expected in [self.packaged, self.env_so]:
            self.assertEqual(gpu_alloc.library_path(), expected)
            os.unlink(expected)
        del os.environ["GPUALLOC_SO"]
        for expected in [self.release, self.debug]:
            self.assertEqual(gpu_alloc.library_path(), expected)
            os.unlink(expected)
        with self.assertRaises(gpu_alloc.GpuAllocError):
            gpu_alloc.library_path()

    def test_the_packaged_library_is_the_one_next_to_the_package(self):
        self.touch(self.packaged)
        self.touch(self.env_so)
        os.environ["GPUALLOC_SO"] = self.env_so
        self.assertEqual(gpu_alloc.library_path(), self.packaged)
        self.assertEqual(gpu_alloc.library_candidates()[0],
                         ("packaged", self.packaged), "the wheel's place is looked at first")

    def test_so_path_wins_and_is_the_only_place_looked_at(self):
        given = self.touch("mine", "liballoc_ffi.so")
        self.touch(self.packaged)
        self.assertEqual(gpu_alloc.library_path(given), given)
        with self.assertRaises(gpu_alloc.GpuAllocError) as cm:
            gpu_alloc.library_path(os.path.join(self.root, "missing.so"))
        self.assertNotIn(self.packaged, str(cm.exception))

    def test_a_set_env_replaces_the_cargo_builds(self):
        self.touch(self.release)
        os.environ["GPUALLOC_SO"] = self.env_so  # not there
        with self.assertRaises(gpu_alloc.GpuAllocError) as cm:
            gpu_alloc.library_path()
        self.assertIn(self.env_so, str(cm.exception))
        self.assertNotIn(self.release, str(cm.exception))

    def test_cargo_target_dir_is_honoured(self):
        elsewhere = self.touch("build", "release", "liballoc_ffi.so")
        self.touch(self.release)
        os.environ["CARGO_TARGET_DIR"] = os.path.join(self.root, "build")
        self.assertEqual(gpu_alloc.library_path(), elsewhere)

    def test_an_installed_package_looks_only_at_itself_and_the_env(self):
        os.unlink(os.path.join(self.root, "Cargo.toml"))  # not a clone any more
        self.touch(self.release)
        origins = [origin for origin, _ in gpu_alloc.library_candidates()]
        self.assertEqual(origins, ["packaged"])
        with self.assertRaises(gpu_alloc.GpuAllocError) as cm:
            gpu_alloc.library_path()
        self.assertIn("pip install .", str(cm.exception))
        self.assertIn("GPUALLOC_SO", str(cm.exception))


@unittest.skipUnless(INSTALLED, "tests the installed package (GPUALLOC_TEST_INSTALLED=1)")
class InstalledPackage(unittest.TestCase):
    def test_the_package_is_not_the_clone_and_carries_its_files(self):
        here = os.path.dirname(os.path.abspath(gpu_alloc.__file__))
        self.assertFalse(here.startswith(PYROOT), here)
        self.assertIsNone(gpu_alloc.repository_root())
        self.assertTrue(os.path.isfile(os.path.join(here, "bridge.cpp")))
        self.assertEqual(SO, os.path.join(here, "liballoc_ffi.so"))

    def test_the_wheel_carries_the_library_and_header_and_no_cffi_module(self):
        # ctypes with gpualloc.h is the one way the package calls the library.
        import importlib

        with self.assertRaises(ImportError):
            importlib.import_module("gpu_alloc.alloc_ffi")
        here = os.path.dirname(os.path.abspath(gpu_alloc.__file__))
        for name in ("liballoc_ffi.so", "gpualloc.h", "bridge_api.h", "bridge.cpp"):
            self.assertTrue(os.path.isfile(os.path.join(here, name)), name)

    def test_the_packaged_library_comes_before_the_env(self):
        with tempfile.NamedTemporaryFile(suffix=".so") as other, \
                mock.patch.dict(os.environ, {"GPUALLOC_SO": other.name}):
            self.assertEqual(gpu_alloc.library_path(), SO)


@needs_so
class Library(unittest.TestCase):
    def setUp(self):
        gpu_alloc._enabled_with = None
        gpu_alloc._bridge = None
        gpu_alloc.load_library(SO)
        # Under the mock torch, enable() falls back to the plain allocator with a warning:
        # the test of that fallback checks it (assertWarns sees it still), the others
        # need not print it.
        quiet = warnings.catch_warnings()
        quiet.__enter__()
        self.addCleanup(quiet.__exit__, None, None, None)
        warnings.filterwarnings("ignore", "gpu_alloc: cannot build the C\\+\\+ bridge", RuntimeWarning)

    def test_version(self):
        self.assertRegex(gpu_alloc.version(), r"^\d+\.\d+\.\d+")

    def test_version_attribute_is_the_workspace_and_library_version(self):
        import re

        with open(os.path.join(os.path.dirname(PYROOT), "Cargo.toml")) as f:
            cargo = re.search(r'^version = "([^"]+)"', f.read(), re.M)
        if cargo is not None and not INSTALLED:
            self.assertEqual(gpu_alloc.__version__, cargo.group(1))
        self.assertTrue(gpu_alloc.version().startswith(gpu_alloc.__version__), gpu_alloc.version())

    def test_torch_names_are_aliases(self):
        with self.assertRaises(ValueError) as cm:
            gpu_alloc.set_per_process_memory_fraction(1.5, device=0)
        self.assertIn("[0, 1]", str(cm.exception))
        self.assertEqual(gpu_alloc.memory_snapshot(device=2), [])
        for name in ("set_per_process_memory_fraction", "memory_snapshot"):
            self.assertIn(name, gpu_alloc.__all__)

    def test_enable_without_torch_says_what_to_install(self):
        with mock.patch.dict(sys.modules, {"torch": None}), mock.patch.dict(os.environ):
            os.environ.pop("GPUALLOC_CONF", None)
            with self.assertRaises(ModuleNotFoundError) as cm:
                gpu_alloc.enable(so_path=SO)
        self.assertIn("gpu_alloc.enable() needs torch", str(cm.exception))
        self.assertIn("pip install torch", str(cm.exception))
        self.assertFalse(gpu_alloc.is_enabled())

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

    def test_check_config_takes_names_and_suggests(self):
        for name in ["bound", "unmap16", "unmap8", "expandable", "default", "size-class"]:
            gpu_alloc.check_config(name)
        gpu_alloc.check_config("bound,max_split_size_mb:64")
        for bad, meant in [("bund", "bound"), ("max_split_size:64", "max_split_size_mb")]:
            with self.assertRaises(ValueError) as cm:
                gpu_alloc.check_config(bad)
            self.assertIn("did you mean `%s`?" % meant, str(cm.exception))

    def test_check_config_refuses_nul_and_unencodable_text(self):
        with self.assertRaises(ValueError) as cm:
            gpu_alloc.check_config("max_split_size_mb:64\x00garbage")
        self.assertIn("NUL byte at offset 20", str(cm.exception))
        with self.assertRaises(ValueError) as cm:
            gpu_alloc.check_config("policy:buddy\udcff")
        self.assertIn("not valid UTF-8", str(cm.exception))
        with self.assertRaises(ValueError):
            gpu_alloc.update_settings("max_split_size_mb:64\x00")
        with self.assertRaises(TypeError):
            gpu_alloc.check_config(b"policy:buddy")

    def test_a_long_bad_config_is_quoted_in_part(self):
        long = "max_split_size_mb:" + "x" * (1 << 20)
        with self.assertRaises(ValueError) as cm:
            gpu_alloc.check_config(long)
        self.assertLess(len(str(cm.exception)), 1500)
        self.assertIn("max_split_size_mb", str(cm.exception))

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
        self.assertIn("[0, 1]", str(cm.exception))
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

    def test_sleep_tags_need_the_bridge_and_say_what_is_wrong(self):
        with self.assertRaises(gpu_alloc.GpuAllocError) as cm:
            with gpu_alloc.region("kv_cache"):
                pass
        self.assertIn("gpu_alloc.enable()", str(cm.exception))
        # Through the library: no allocator on device 3, so the tag is unknown there.
        with self.assertRaises(ValueError) as cm:
            gpu_alloc.pause("kv_cache", device=3)
        self.assertIn('sleep tag "kv_cache" is unknown', str(cm.exception))
        with self.assertRaises(ValueError) as cm:
            gpu_alloc.resume("kv_cache", device=3)
        self.assertIn("unknown", str(cm.exception))
        with self.assertRaises(ValueError) as cm:
            gpu_alloc.pause("kv_cache", backup="disk", device=3)
        self.assertIn("'none' or 'host'", str(cm.exception))
        self.assertEqual(gpu_alloc.tags(device=-1), [])
        gpu_alloc.pause(device=3)  # every tag of an unused device: none
        gpu_alloc.resume(device=3)

    def test_backup_defaults_follow_the_regions(self):
        gpu_alloc._tag_backup.clear()
        self.assertEqual(gpu_alloc._backup_of("w", 0, None), "none")
        gpu_alloc._tag_backup[(0, "w")] = True
        self.assertEqual(gpu_alloc._backup_of("w", 0, None), "host")
        self.assertEqual(gpu_alloc._backup_of("w", 1, None), "none", "per device")
        self.assertEqual(gpu_alloc._backup_of("w", 0, "none"), "none", "explicit wins")
        gpu_alloc._tag_backup.clear()

    def test_pinned_host_free_of_garbage_is_an_error(self):
        with self.assertRaises(ValueError) as cm:
            gpu_alloc.host_free(0x1234)
        self.assertIn("not memory from gpualloc_host_alloc", str(cm.exception))
        gpu_alloc.host_free(0)  # NULL: a no-op

    def test_host_register_refuses_bad_ranges_with_the_reason(self):
        with self.assertRaises(ValueError) as cm:
            gpu_alloc.host_register(0x1000, 0)
        self.assertIn("at least one byte", str(cm.exception))
        with self.assertRaises(ValueError) as cm:
            gpu_alloc.host_unregister(0x1234)
        self.assertIn("not the start of a range registered", str(cm.exception))
        self.assertEqual(gpu_alloc.HOST_REGISTER_MAPPED, 1)

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
        with mock.patch.dict(sys.modules, {"torch": torch}), mock.patch.dict(os.environ), \
                self.assertWarns(RuntimeWarning) as warned:
            os.environ.pop("GPUALLOC_CONF", None)
            gpu_alloc.enable(so_path=SO)
        self.assertFalse(gpu_alloc.uses_bridge())
        self.assertEqual(calls[0][0], "CUDAPluggableAllocator")
        message = str(warned.warning)
        self.assertIn("cannot build the C++ bridge", message)
        self.assertIn("record_stream", message)
        self.assertIn("python -m gpu_alloc doctor", message)
        self.assertEqual(os.path.basename(warned.filename), os.path.basename(__file__),
                         "the warning points at enable()'s caller")

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

    def test_enable_refuses_when_pytorch_is_asked_for_another_backend(self):
        torch, calls = fake_torch()
        with mock.patch.dict(sys.modules, {"torch": torch}):
            conf = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True, backend:cudaMallocAsync"}
            with mock.patch.dict(os.environ, conf):
                with self.assertRaises(gpu_alloc.GpuAllocError) as cm:
                    gpu_alloc.enable()
                self.assertIn("backend:cudaMallocAsync", str(cm.exception))
            with mock.patch.dict(os.environ, {"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}):
                with self.assertRaises(gpu_alloc.GpuAllocError) as cm:
                    gpu_alloc.enable()
                self.assertIn("PYTORCH_ALLOC_CONF", str(cm.exception))
            self.assertEqual(calls, [])
            with mock.patch.dict(os.environ, {"PYTORCH_CUDA_ALLOC_CONF": "backend:native"}):
                gpu_alloc.enable()
        self.assertEqual(calls[-1][0], "change_current_allocator", calls)

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

    def test_settings_change_at_run_time(self):
        code = r"""
import gpu_alloc
assert gpu_alloc.settings() == "expandable_segments:true", gpu_alloc.settings()
try:
    gpu_alloc.update_settings("max_split_size_mb:5")
    raise SystemExit("expected an error")
except ValueError as e:
    assert "at least 20" in str(e), e
try:
    gpu_alloc.update_settings("policy:buddy")
    raise SystemExit("expected an error")
except ValueError as e:
    assert "growable" in str(e), e
gpu_alloc.update_settings("roundup_power2_divisions:4,per_process_memory_fraction:0.5")
assert gpu_alloc.settings() == (
    "expandable_segments:true,roundup_power2_divisions:4,per_process_memory_fraction:0.5"
), gpu_alloc.settings()
lib = gpu_alloc.load_library()
assert lib.gpualloc_configure(b"policy:buddy") == gpu_alloc.ERR_TOO_LATE
print("subprocess ok")
"""
        r = run_python(code, {"GPUALLOC_CONF": "expandable_segments:true"})
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


class HeaderDeclarations(unittest.TestCase):
    """The ctypes declarations come from gpualloc.h (gpu_alloc._header), the header the C++
    bridge compiles against: one declaration of the C interface."""

    SAMPLE = """
#ifndef SAMPLE_H
#define SAMPLE_H
#include <stdint.h>
typedef struct CUstream_st* cudaStream_t;
typedef void (*done_fn)(int device, uint64_t addr, void* ctx);
#ifdef __cplusplus
extern "C" {
#endif
#define SAMPLE_OK (0) /* success */
#define SAMPLE_BAD (-7)
/* A pair. */
typedef struct Pair {
  int64_t first; /* one */
  int64_t second[2]; /* two */
} Pair;
typedef struct Outer {
  size_t size;
  Pair pairs[3];
} Outer;
/* Comments are ignored: int not_a_function(void); */
char* owned_text(int device);
const char* static_text(void);
void give_back(char* s);
int fill(int device, Outer* out, const uint64_t* in, uint64_t** arrays, size_t* n);
void* take(ssize_t size, cudaStream_t stream, const void* data, done_fn done);
double ratio(double x);
#ifdef __cplusplus
}
#endif
#endif
"""

    def test_the_parser_reads_every_construct_of_the_header(self):
        c = ctypes
        h = gpu_alloc._header.parse(self.SAMPLE)
        self.assertEqual(h.constants, {"SAMPLE_OK": 0, "SAMPLE_BAD": -7})
        pair, outer = h.structs["Pair"], h.structs["Outer"]
        self.assertEqual(c.sizeof(pair), 24)
        self.assertEqual(c.sizeof(outer), 8 + 3 * 24)
        self.assertEqual(outer.pairs.offset, 8)
        self.assertEqual(set(h.functions), {"owned_text", "static_text", "give_back", "fill",
                                            "take", "ratio"})
        self.assertEqual(h.functions["owned_text"], (c.c_void_p, [c.c_int]))
        self.assertEqual(h.functions["static_text"], (c.c_char_p, []))
        self.assertEqual(h.functions["give_back"], (None, [c.c_void_p]))
        self.assertEqual(h.functions["ratio"], (c.c_double, [c.c_double]))
        ret, args = h.functions["fill"]
        self.assertEqual(ret, c.c_int)
        self.assertEqual(args[:2], [c.c_int, c.POINTER(outer)])
        self.assertEqual(args[2:], [c.POINTER(c.c_uint64), c.POINTER(c.POINTER(c.c_uint64)),
                                    c.POINTER(c.c_size_t)])
        ret, args = h.functions["take"]
        self.assertEqual(ret, c.c_void_p)
        self.assertEqual(args[:3], [c.c_ssize_t, c.c_void_p, c.c_void_p])
        self.assertIs(args[3], h.types["done_fn"])
        self.assertEqual(args[3]._argtypes_, (c.c_int, c.c_uint64, c.c_void_p))
        self.assertIsNone(args[3]._restype_)

    def test_the_parser_refuses_what_it_cannot_read(self):
        for text in ["enum mode { A, B };", "int f(unknown_t x);", "int f(int x[4]);",
                     "typedef struct A { int x; } B;"]:
            with self.assertRaises(ValueError, msg=text):
                gpu_alloc._header.parse(text)

    def test_the_package_reads_the_crate_header_or_its_packaged_copy(self):
        # One header in the repository: the clone's package reads the crate's file, the
        # installed package the copy its wheel carries.
        if INSTALLED:
            expected = os.path.join(os.path.dirname(os.path.abspath(gpu_alloc.__file__)),
                                    "gpualloc.h")
        else:
            expected = os.path.join(os.path.dirname(PYROOT), "crates", "alloc-ffi", "include",
                                    "gpualloc.h")
            self.assertFalse(os.path.exists(gpu_alloc._header.PACKAGED_HEADER),
                             "a copy of the header in the clone's package")
        self.assertEqual(gpu_alloc._header.HEADER_PATH, expected)
        self.assertEqual(gpu_alloc._header.HEADER_DIR, os.path.dirname(expected))
        with open(gpu_alloc._header.HEADER_PATH) as f:
            text = f.read()
        import re

        prototypes = set(re.findall(r"^[\w* ]+?\b(gpualloc_\w+)\(", text, re.M))
        self.assertEqual(set(gpu_alloc.HEADER.functions), prototypes)
        self.assertIn("gpualloc_device_stats", prototypes)
        self.assertIn("gpualloc_host_register", prototypes)
        self.assertEqual(gpu_alloc.ERR_INVALID, -1)
        self.assertEqual(gpu_alloc.ERR_TOO_LATE, -4)


@needs_so
class DeviceStatsStruct(unittest.TestCase):
    """gpualloc_device_stats through ctypes, with the struct read from the header."""

    def setUp(self):
        self.lib = gpu_alloc.load_library(SO)
        self.struct = gpu_alloc.HEADER.structs["GpuallocDeviceStats"]

    def test_every_header_function_is_declared_on_the_library(self):
        self.assertEqual(gpu_alloc._header.declare(self.lib, gpu_alloc.HEADER), [])
        for name, (restype, argtypes) in gpu_alloc.HEADER.functions.items():
            f = getattr(self.lib, name)
            self.assertEqual((f.restype, f.argtypes), (restype, argtypes), name)

    def test_an_unused_device_has_zero_statistics(self):
        out = self.struct(size=ctypes.sizeof(self.struct))
        out.num_ooms = 99
        self.assertEqual(self.lib.gpualloc_device_stats(3, ctypes.byref(out)), gpu_alloc.OK)
        self.assertEqual(out.size, ctypes.sizeof(self.struct))
        self.assertEqual(out.max_split_size, -1)
        self.assertEqual(out.num_ooms, 0)
        flat = gpu_alloc.memory_stats(device=3)
        for name, _ in self.struct._fields_:
            value = getattr(out, name)
            if name == "size":
                continue
            if isinstance(value, ctypes.Array):
                for stat, pool in zip(value, ["all", "small_pool", "large_pool"]):
                    for part in ("current", "peak", "allocated", "freed"):
                        key = "%s.%s.%s" % (name, pool, part)
                        self.assertEqual(getattr(stat, part), flat[key], key)
            elif isinstance(value, int):
                self.assertEqual(value, flat[name], name)
            else:
                for part in ("current", "peak", "allocated", "freed"):
                    key = "%s.%s" % (name, part)
                    self.assertEqual(getattr(value, part), flat[key], key)

    def test_an_older_caller_gets_only_the_fields_it_has(self):
        out = self.struct()
        out.max_split_size = 12345
        known = self.struct.max_split_size.offset
        out.size = known
        self.assertEqual(self.lib.gpualloc_device_stats(3, ctypes.byref(out)), gpu_alloc.OK)
        self.assertEqual(out.size, known)
        self.assertEqual(out.max_split_size, 12345)

    def test_bad_arguments_are_errors(self):
        out = self.struct(size=0)
        self.assertEqual(self.lib.gpualloc_device_stats(3, ctypes.byref(out)),
                         gpu_alloc.ERR_INVALID)
        self.assertIn("sizeof(GpuallocDeviceStats)", gpu_alloc.last_error())
        self.assertEqual(self.lib.gpualloc_device_stats(3, None), gpu_alloc.ERR_INVALID)
        out.size = ctypes.sizeof(self.struct)
        self.assertEqual(self.lib.gpualloc_device_stats(100000, ctypes.byref(out)),
                         gpu_alloc.ERR_INVALID)


@needs_so
class BridgeDeclarations(unittest.TestCase):
    """bridge_api.h, the bridge's pointers to the library typed decltype(&gpualloc_...) from
    gpualloc.h, compiled without torch and resolved against the library: a function the
    bridge uses that the header or the library lacks, or a call that does not match the
    header, fails here rather than on a GPU machine."""

    PROGRAM = r"""
#include "bridge_api.h"

#include <cstdio>

int main(int, char** argv) {
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::printf("dlopen: %s\n", dlerror());
    return 2;
  }
  gpu_alloc_bridge::Api api;
  if (const char* missing = api.resolve(lib)) {
    std::printf("missing %s\n", missing);
    return 3;
  }
  GpuallocDeviceStats stats{};
  stats.size = sizeof stats;
  if (api.device_stats(3, &stats) != GPUALLOC_OK || stats.max_split_size != -1 ||
      stats.size != sizeof stats) {
    return 4;
  }
  std::printf("ok\n");
  return 0;
}
"""

    def test_the_bridge_api_compiles_against_the_header_and_resolves(self):
        import subprocess

        compiler = gpu_alloc.cxx_compiler()
        if compiler is None:
            if os.environ.get("GPUALLOC_TESTS_REQUIRE_TOOLS"):
                self.fail("no C++ compiler, and GPUALLOC_TESTS_REQUIRE_TOOLS is set")
            self.skipTest("no C++ compiler")
        package = os.path.dirname(os.path.abspath(gpu_alloc.__file__))
        with tempfile.TemporaryDirectory() as tmp:
            src, exe = os.path.join(tmp, "main.cpp"), os.path.join(tmp, "main")
            with open(src, "w") as f:
                f.write(self.PROGRAM)
            build = subprocess.run(
                [compiler, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-I", package, "-I",
                 gpu_alloc._header.HEADER_DIR, src, "-o", exe, "-ldl"],
                capture_output=True, text=True)
            self.assertEqual(build.returncode, 0, build.stderr)
            run = subprocess.run([exe, SO], capture_output=True, text=True)
            self.assertEqual((run.returncode, run.stdout), (0, "ok\n"), run.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
