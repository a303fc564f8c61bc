"""CPU-only tests of `python -m gpu_alloc` (doctor, version, --help): no torch, no GPU needed.

Run with either of
    python3 -m pytest python/tests/test_doctor.py
    python3 python/tests/test_doctor.py

Like test_cpu.py, they test this clone's gpu_alloc, or the installed one with
GPUALLOC_TEST_INSTALLED=1 (see support.py). The driver and torch are stood in for by fakes
where the report on a machine with a GPU is tested.
"""

import ctypes
import importlib.util
import io
import os
import tempfile
import types
import unittest
from unittest import mock

from support import SO, gpu_alloc, needs_so, run_gpu_alloc

from gpu_alloc import doctor

# How every line of the report starts.
LINE_STARTS = ("gpu_alloc doctor:", "ok ", "problem ", "note ", " " * 8 + "fix: ", "summary: ")


def has_libcuda():
    try:
        ctypes.CDLL(doctor.CudaDriver.LIBRARY)
        return True
    except OSError:
        return False


class FakeDriver:
    """Stands in for CudaDriver: a driver supporting `cuda`, seeing `gpus`; init() raises
    `init_error` when given."""

    def __init__(self, cuda=(13, 0), gpus=None, init_error=None):
        self.cuda = cuda
        self.gpus = [doctor.Gpu(0, "Fake GPU", 80 * 2**30, (9, 0), True)] if gpus is None else gpus
        self.init_error = init_error

    def driver_version(self):
        return self.cuda

    def init(self):
        if self.init_error:
            raise self.init_error

    def devices(self):
        return self.gpus


def fake_torch(cuda="13.0", available=True):
    """The parts of torch that the doctor reads."""
    return types.SimpleNamespace(
        __version__="2.11.0+cu130" if cuda else "2.11.0+cpu",
        version=types.SimpleNamespace(cuda=cuda),
        cuda=types.SimpleNamespace(
            is_available=lambda: available,
            device_count=lambda: 1 if available else 0,
            get_device_name=lambda i: "Fake GPU",
        ),
    )


def no_driver():
    raise OSError("libcuda.so.1: cannot open shared object file: No such file or directory")


def no_torch():
    raise ImportError("No module named 'torch'")


@needs_so
class Report(unittest.TestCase):
    """doctor.diagnose() with the driver and torch stood in for."""

    def setUp(self):
        env = mock.patch.dict(os.environ)
        env.start()
        self.addCleanup(env.stop)
        for name in ["GPUALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "GPUALLOC_SO"]:
            os.environ.pop(name, None)
        scratch = tempfile.TemporaryDirectory()
        self.addCleanup(scratch.cleanup)
        self.cuda_home = scratch.name

    def diagnose(self, load_cuda, import_torch, tools=True, build=True, bridge_error=None):
        """Runs the doctor; with tools=True a compiler, ninja and CUDA headers are "there"
        and build_bridge() succeeds (or raises bridge_error)."""
        header = os.path.join(self.cuda_home, "include", doctor.HEADER)
        if tools:
            os.makedirs(os.path.dirname(header), exist_ok=True)
            open(header, "w").close()

        def build_bridge():
            if bridge_error:
                raise bridge_error
            return types.SimpleNamespace()

        out = io.StringIO()
        with mock.patch.object(gpu_alloc, "cxx_compiler", lambda: "/usr/bin/c++" if tools else None), \
                mock.patch.object(doctor.shutil, "which", lambda name: "/usr/bin/" + name if tools else None), \
                mock.patch.object(doctor, "_cuda_home", lambda torch: self.cuda_home), \
                mock.patch.object(doctor, "bridge_cache_dir", lambda torch: "/cache/gpu_alloc_bridge"), \
                mock.patch.object(gpu_alloc, "build_bridge", build_bridge):
            report, loaded = doctor.diagnose(so_path=SO, build=build, load_cuda=load_cuda,
                                             import_torch=import_torch, stream=out)
        self.assertTrue(loaded)
        text = out.getvalue()
        for line in text.splitlines():
            self.assertTrue(line.startswith(LINE_STARTS), line)
        for finding in report.problems():
            self.assertTrue(finding.fix, "a problem without a fix: %s" % (finding,))
        return report, text

    def topics(self, report, status):
        return [f.topic for f in report.findings if f.status == status]

    def test_everything_there_is_ready(self):
        report, text = self.diagnose(FakeDriver, fake_torch)
        self.assertEqual(report.exit_status(), 0, text)
        self.assertIn("version %s" % gpu_alloc.version(), text)
        self.assertIn("the driver supports CUDA 13.0", text)
        self.assertIn("GPUs: 0: Fake GPU, 80.0 GiB, compute capability 9.0", text)
        self.assertIn("torch: 2.11.0+cu130, built for CUDA 13.0", text)
        self.assertIn("built, cached in /cache/gpu_alloc_bridge", text)
        self.assertIn("ready", doctor.summary(report, True))

    def test_no_driver_and_no_torch(self):
        report, text = self.diagnose(no_driver, no_torch, tools=False)
        self.assertEqual(report.exit_status(), 1)
        self.assertEqual(self.topics(report, doctor.PROBLEM),
                         ["NVIDIA driver", "torch", "C++ bridge", "C++ bridge", "C++ bridge"])
        self.assertIn("libcuda.so.1 cannot be loaded", text)
        self.assertIn("install the NVIDIA driver", text)
        self.assertIn("`pip install torch`", text)
        self.assertIn("no C++ compiler", text)
        self.assertIn("no ninja", text)
        self.assertIn("no CUDA headers", text)
        self.assertIn("not built: that needs torch with CUDA", text)
        summary = doctor.summary(report, True)
        self.assertIn("5 problems", summary)
        self.assertIn("the library itself loads", summary)

    def test_a_driver_without_gpus(self):
        error = doctor.CudaError("cuInit", doctor.CudaError.NO_DEVICE, "CUDA_ERROR_NO_DEVICE")
        with mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": ""}):
            report, text = self.diagnose(lambda: FakeDriver(init_error=error),
                                         lambda: fake_torch(available=False))
        self.assertEqual(report.exit_status(), 1)
        self.assertIn("the driver sees no GPU (cuInit returned CUDA_ERROR_NO_DEVICE (100))", text)
        self.assertIn("$CUDA_VISIBLE_DEVICES=''", text)
        self.assertIn("torch.cuda: not available", text)

    def test_a_driver_older_than_torch(self):
        report, text = self.diagnose(lambda: FakeDriver(cuda=(11, 8)),
                                     lambda: fake_torch(cuda="12.4", available=False))
        self.assertEqual(report.exit_status(), 1)
        self.assertIn("the driver supports CUDA 11.8, older than torch's 12.4: update the "
                      "driver, or install a torch build for CUDA 11", text)

    def test_a_cpu_only_torch(self):
        report, text = self.diagnose(FakeDriver, lambda: fake_torch(cuda=None, available=False))
        self.assertEqual(report.exit_status(), 1)
        self.assertIn("2.11.0+cpu is a CPU-only build", text)

    def test_a_bridge_that_does_not_build(self):
        error = gpu_alloc.GpuAllocError("cannot build the C++ bridge: compiler says no")
        report, text = self.diagnose(FakeDriver, fake_torch, bridge_error=error)
        self.assertEqual(self.topics(report, doctor.PROBLEM), ["C++ bridge"])
        self.assertIn("does not build: cannot build the C++ bridge: compiler says no", text)
        self.assertIn("falls back to a plain CUDAPluggableAllocator", text)

    def test_no_build_is_a_note(self):
        report, text = self.diagnose(FakeDriver, fake_torch, build=False)
        self.assertEqual(report.exit_status(), 0, text)
        self.assertIn("not built (--no-build)", text)

    def test_gpualloc_conf(self):
        os.environ["GPUALLOC_CONF"] = "policy:size-class,max_split_size_mb:128"
        report, text = self.diagnose(FakeDriver, fake_torch)
        self.assertIn("ok      $GPUALLOC_CONF: 'policy:size-class,max_split_size_mb:128' is valid",
                      text)
        os.environ["GPUALLOC_CONF"] = "bogus:1"
        report, text = self.diagnose(FakeDriver, fake_torch)
        self.assertEqual(self.topics(report, doctor.PROBLEM), ["$GPUALLOC_CONF"])
        self.assertIn("bogus", text)
        self.assertIn("every allocation fails", text)

    def test_a_check_that_breaks_is_a_problem_not_a_crash(self):
        class BrokenDriver(FakeDriver):
            def driver_version(self):
                raise ZeroDivisionError("boom")

        report, text = self.diagnose(BrokenDriver, fake_torch)
        self.assertIn("NVIDIA driver: the check itself failed: ZeroDivisionError: boom", text)
        self.assertEqual(report.exit_status(), 1)


class CommandLine(unittest.TestCase):
    """`python -m gpu_alloc` in a child Python, on this machine as it is."""

    def test_help_names_the_commands(self):
        r = run_gpu_alloc("--help")
        self.assertEqual(r.returncode, 0, r.stderr)
        for word in ["doctor", "version"]:
            self.assertIn(word, r.stdout)
        r = run_gpu_alloc()
        self.assertEqual(r.returncode, 2)
        self.assertIn("doctor", r.stdout)

    @needs_so
    def test_version_prints_the_library_version(self):
        gpu_alloc.load_library(SO)
        r = run_gpu_alloc("version")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "gpu_alloc %s, library %s\n" % (gpu_alloc.version(), SO))

    def test_version_without_a_library_says_so(self):
        r = run_gpu_alloc("version", "--so", "/nonexistent/liballoc_ffi.so")
        self.assertEqual(r.returncode, 1)
        self.assertIn("liballoc_ffi.so not found", r.stderr)
        self.assertNotIn("Traceback", r.stderr)

    @needs_so
    def test_doctor_on_this_machine(self):
        r = run_gpu_alloc("doctor", "--no-build")
        self.assertNotIn("Traceback", r.stdout + r.stderr)
        lines = r.stdout.splitlines()
        for line in lines:
            self.assertTrue(line.startswith(LINE_STARTS), line)
        problems = [line for line in lines if line.startswith("problem ")]
        self.assertEqual(r.returncode, 1 if problems else 0, r.stdout)
        self.assertTrue(lines[-1].startswith("summary: "), r.stdout)
        self.assertIn("ok      library: %s" % SO, r.stdout)
        if not has_libcuda():
            self.assertIn("problem NVIDIA driver: libcuda.so.1 cannot be loaded", r.stdout)
            self.assertEqual(r.returncode, 1)
        if importlib.util.find_spec("torch") is None:
            self.assertIn("problem torch: not installed", r.stdout)
            self.assertEqual(r.returncode, 1)


if __name__ == "__main__":
    unittest.main(verbosity=2)
