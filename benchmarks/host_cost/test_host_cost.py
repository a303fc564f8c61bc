"""CPU tests of host_cost.py's table and of host_threads.py's plan and report (no torch, no
GPU), and host_threads.py end to end over the null driver (the C library and gpu_bench
--threads of a cargo build; skipped when none is built, unless GPUALLOC_TESTS_REQUIRE_TOOLS=1):
python3 benchmarks/host_cost/test_host_cost.py"""
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import host_cost  # noqa: E402
import host_threads as ht  # noqa: E402


class TableTest(unittest.TestCase):
    def test_ratios_and_net_cost(self):
        n = len(host_cost.row_labels())
        res = {"torch": [400.0] * n, "cudaMallocAsync": [800.0] * n, "gpualloc .so": [100.0] * n,
               "gpualloc via bridge": [200.0] * n, "null (loop cost)": [30.0] * n}
        lines = host_cost.table("O2", res).splitlines()
        self.assertIn("with -O2", lines[0])
        rows = [l for l in lines if l.startswith("| ") and not l.startswith("| workload")]
        self.assertEqual(len(rows), n)
        self.assertEqual(rows[0], "| 512 B pair | 400 | 800 | 100 | 200 | 30 | 0.25 | 0.50 | 70 |")
        self.assertTrue(rows[-1].startswith("| mixed wide |"))

    def test_without_the_bridge_run(self):
        n = len(host_cost.row_labels())
        res = {"torch": [400.0] * n, "cudaMallocAsync": [800.0] * n, "gpualloc .so": [100.0] * n,
               "null (loop cost)": [30.0] * n}
        self.assertIn("| 0.25 | n/a | 70 |", host_cost.table("O0", res))
        self.assertIn("no optimisation", host_cost.table("O0", res))

    def test_interleaved_rounds_best_and_net(self):
        n = len(host_cost.row_labels())
        rounds = [{"opt": "O0", "gpualloc .so": [200.0] * n, "null (loop cost)": [12.0] * n},
                  {"opt": "O2", "gpualloc .so": [110.0] * n, "null (loop cost)": [4.0] * n},
                  {"opt": "O0", "gpualloc .so": [150.0] * n, "null (loop cost)": [10.0] * n},
                  {"opt": "O2", "gpualloc .so": [130.0] * n, "null (loop cost)": [3.0] * n}]
        lines = host_cost.interleaved_table(rounds).splitlines()
        self.assertEqual(len(lines), 2 + 2 * n)
        self.assertEqual(lines[2], "| 512 B pair | O0 | 200 / 150 | 150 | 10 | 140 |")
        self.assertEqual(lines[3], "| 512 B pair | O2 | 110 / 130 | 110 | 3 | 107 |")

    def test_labels(self):
        self.assertEqual(host_cost.row_labels()[:2], ["512 B pair", "64 KiB pair"])
        self.assertEqual(host_cost.human(64 << 20), "64 MiB")


def cell(path, process, repeat, rate_m, threads=1, devices=1, streams="own", workload="512 B pair",
         p50=100.0, p99=300.0):
    """A cell of `rate_m` million calls per second (a 0.1 s window)."""
    return {"path": path, "process": process, "repeat": repeat, "workload": workload,
            "streams": streams, "threads": threads, "devices": devices,
            "calls": int(rate_m * 1e5), "wall_ns": 1e8, "p50_ns": p50, "p99_ns": p99,
            "failed_threads": 0}


class ThreadsPlanTest(unittest.TestCase):
    def test_workloads_parse(self):
        w = ht.parse_workload("mixed:512:1M:1000")
        self.assertEqual((w["lo"], w["hi"], w["max_live"]), (512, 1 << 20, 1000))
        self.assertEqual(w["spec"], "mixed:512:1048576:1000")
        self.assertEqual(w["label"], "mixed 512 B..1 MiB, 1000 live")
        self.assertEqual(ht.parse_workload("pair:8M")["label"], "8 MiB pair")
        self.assertEqual(ht.parse_workload("pair:1000")["label"], "1000 B pair")
        for bad in ("pair", "mixed:1M:512:10", "mixed:512:1M:0", "triple:1"):
            with self.assertRaises(ValueError):
                ht.parse_workload(bad)

    def test_plan_and_rotation(self):
        args = ht.parse_args(["--so", __file__, "--threads", "1,8", "--workloads", "pair:512"])
        cells = ht.plan(args)
        self.assertEqual([(s, len(d)) for _, s, d in cells],
                         [("own", 1), ("own", 8), ("shared", 1), ("shared", 8)])
        args = ht.parse_args(["--so", __file__, "--devices", "1,4", "--workloads", "pair:512"])
        self.assertEqual([d for _, _, d in ht.plan(args)], [[0], [0, 1, 2, 3]])
        self.assertEqual(ht.rotate([1, 2, 3], 4), [2, 3, 1])

    def test_the_loops_and_python_agree_on_quantiles(self):
        v = list(range(1, 101))
        self.assertEqual((ht.quantile(v, 0.5), ht.quantile(v, 0.99)), (50.0, 99.0))
        self.assertEqual(ht.quantile([], 0.5), 0.0)

    def test_rust_cells_get_names_and_labels(self):
        w = [ht.parse_workload("pair:512")]
        out = 'noise\nCELL {"kind": "ours", "repeat": 0, "spec": "pair:512", "streams": "own", ' \
              '"threads": 2, "devices": 1, "calls": 10, "wall_ns": 5.0, "p50_ns": 1, ' \
              '"p99_ns": 2, "p999_ns": 2, "max_ns": 3, "samples": 1, "failed_threads": 0, ' \
              '"error": ""}'
        (c,) = ht.rust_cells(out, w)
        self.assertEqual((c["path"], c["workload"], c["process"]),
                         ("gpualloc CudaAllocator (Rust)", "512 B pair", "rust"))


class ThreadsReportTest(unittest.TestCase):
    def cells(self):
        out = []
        for rep, (torch_m, ours_m) in enumerate([(10, 30), (20, 50), (10, 40)]):
            out.append(cell(ht.TORCH_RAW, "native", rep, torch_m))
            out.append(cell("gpualloc C library", "native", rep, ours_m))
            out.append(cell(ht.TORCH_RAW, "native", rep, torch_m / 2, threads=8))
            out.append(cell("gpualloc C library", "native", rep, ours_m * 2, threads=8))
            out.append(cell("gpualloc CudaAllocator (Rust)", "rust", rep, 45))
        return out

    def test_same_process_ratios_pair_the_repeats(self):
        r = ht.ratio_to(self.cells(), "gpualloc C library", ht.TORCH_RAW, ("512 B pair", "own", 1, 1))
        # per-repeat ratios 3, 2.5, 4: median 3, mean 3.17
        self.assertEqual((round(r[0], 2), round(r[1], 2), r[2]), (3.0, 3.17, True))

    def test_cross_process_ratios_are_of_the_medians(self):
        r = ht.ratio_to(self.cells(), "gpualloc CudaAllocator (Rust)", ht.TORCH_RAW,
                        ("512 B pair", "own", 1, 1))
        self.assertEqual((r[0], r[2]), (4.5, False))
        self.assertIsNone(ht.ratio_to(self.cells(), "nothing", ht.TORCH_RAW,
                                      ("512 B pair", "own", 1, 1)))

    def test_table_rows(self):
        cells = self.cells()
        s = ht.summarize(cells)
        lines = ht.path_table(cells, s, "gpualloc C library", ht.TORCH_RAW, False).splitlines()
        self.assertEqual(len(lines), 4)
        # medians 40 and 80 M calls/s, mean 40 / 80, ratio 3 (1 thread) and 12 (8 threads)
        self.assertEqual(lines[2], "| 512 B pair | own | 1 | 40.00 | 40.00 | 100 | 300 | 3.00 | "
                                   "3.17 | 1.00 |")
        self.assertEqual(lines[3], "| 512 B pair | own | 8 | 80.00 | 80.00 | 100 | 300 | 12.00 | "
                                   "12.67 | 2.00 |")
        rust = ht.path_table(cells, s, "gpualloc CudaAllocator (Rust)", ht.TORCH_RAW, False)
        self.assertIn("| 4.50* | 4.50* |", rust)

    def test_targets_say_met_or_not(self):
        cells = self.cells() + [cell(ht.TORCH_RAW, "native", 0, 10, threads=4),
                                cell("gpualloc C library", "native", 0, 5, threads=4)]
        lines = ht.targets(cells, ht.summarize(cells), ht.PATHS)
        c_lines = [l for l in lines if l.startswith("gpualloc C library")]
        self.assertEqual(len(c_lines), 3)
        self.assertTrue(c_lines[0].endswith("1 threads: 3.00 (target >= 1: met)"), c_lines[0])
        self.assertTrue(c_lines[1].endswith("4 threads: 0.50 (target >= 1: NOT met)"))
        self.assertTrue(c_lines[2].endswith("8 threads: 12.00 (target >= 4: met)"))
        self.assertTrue(any("CudaAllocator" in l and "4.50* (target >= 1: met)" in l
                            for l in lines))

    def test_the_pytorch_path_target_and_device_scaling(self):
        cells = [cell(ht.AT_EMPTY, "native", 0, 4), cell("at::empty via bridge", "bridge", 0, 6),
                 cell(ht.AT_EMPTY, "native", 0, 4, threads=2, devices=2),
                 cell("at::empty via bridge", "bridge", 0, 12, threads=2, devices=2)]
        s = ht.summarize(cells)
        lines = ht.targets(cells, s, ht.PATHS)
        self.assertIn("1.50* (target >= 2, per-op cost at most half: NOT met)", lines[0])
        self.assertIn("3.00* (target >= 2, per-op cost at most half: met)", lines[1])
        self.assertEqual(ht.device_scaling(s), [
            "at::empty via bridge, 512 B pair: 2 devices 2.00x one device's throughput (ideal 2)",
            "at::empty, PyTorch's allocator, 512 B pair: 2 devices 1.00x one device's throughput "
            "(ideal 2)"])
        text = ht.report(cells, ht.PATHS, True, {"gpu": "test"})
        self.assertIn("### at::empty via bridge (bridge process)", text)
        self.assertIn("| workload | streams | devices |", text)


class FakeTorch:
    """What python_cell uses of torch, on the host: torch.empty makes a bytearray (and
    fails past `fail_after` calls on one thread, as an out-of-memory would)."""

    uint8 = "uint8"

    def __init__(self, fail_after=None):
        self.fail_after = fail_after
        self.made = {}
        self.synced = []
        outer = self

        class Cuda:
            @staticmethod
            def device(d):
                return contextlib.nullcontext()

            @staticmethod
            def stream(s):
                return contextlib.nullcontext()

            @staticmethod
            def synchronize(d):
                outer.synced.append(d)

        self.cuda = Cuda

    def device(self, kind, index):
        return (kind, index)

    def empty(self, n, dtype, device):
        name = threading.current_thread().name
        self.made[name] = self.made.get(name, 0) + 1
        if self.fail_after is not None and self.made[name] > self.fail_after:
            raise MemoryError("fake out of memory")
        return bytearray(min(n, 64))


class PythonThreadsTest(unittest.TestCase):
    def setUp(self):
        ht.PY_STREAMS.clear()
        ht.PY_STREAMS.update({0: ["s0", "s1", "s2"], 1: ["t0"]})
        self.args = ht.parse_args(["--so", __file__, "--window", "0.05", "--sample-every", "5"])

    def test_threads_count_calls_and_sample_every_nth(self):
        fake = FakeTorch()
        for w in (ht.parse_workload("pair:512"), ht.parse_workload("mixed:512:64K:20")):
            r = ht.python_cell(fake, w, [0, 0, 1], "own", self.args)
            self.assertEqual(r["failed_threads"], 0)
            self.assertGreater(r["calls"], 0)
            self.assertEqual(r["calls"] % 5, 0)
            self.assertEqual(r["samples"], r["calls"] // 5)
            self.assertLessEqual(r["p50_ns"], r["p99_ns"])
            self.assertGreater(r["wall_ns"], 0.04e9)
        self.assertEqual(fake.synced[-2:], [0, 1])

    def test_failing_threads_are_reported_not_counted_and_the_cell_ends(self):
        fake = FakeTorch(fail_after=10)
        r = ht.python_cell(fake, ht.parse_workload("pair:512"), [0, 0], "shared", self.args)
        self.assertEqual(r["failed_threads"], 2)
        self.assertIn("fake out of memory", r["error"])
        self.assertEqual(r["calls"], 0)


def built(name):
    """The newest of target/{release,debug}/NAME (or under $CARGO_TARGET_DIR)."""
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target"))
    found = [os.path.join(target, p, name) for p in ("release", "debug")]
    found = [f for f in found if os.path.isfile(f)]
    return max(found, key=os.path.getmtime) if found else None


class NullDriverEndToEndTest(unittest.TestCase):
    """host_threads.py --null-driver: threads, streams, devices, timing and report through
    the C library and gpu_bench --threads over a libcuda.so doing no device work."""

    def setUp(self):
        self.so, self.bench = built("liballoc_ffi.so"), built("gpu_bench")
        tools = shutil.which("g++") and shutil.which("cc")
        if not (self.so and self.bench and tools):
            msg = "needs a cargo build of liballoc_ffi.so and gpu_bench, g++ and cc"
            if os.environ.get("GPUALLOC_TESTS_REQUIRE_TOOLS") == "1":
                self.fail(msg)
            self.skipTest(msg)
        self.out = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.out)

    def run_script(self, *extra):
        argv = ["--null-driver", "--so", self.so, "--gpu-bench", self.bench, "--out", self.out,
                "--window", "0.02", "--repeats", "2", "--sample-every", "7",
                "--workloads", "pair:512,mixed:512:64K:50"] + list(extra)
        self.assertEqual(ht.main(argv), 0)
        name = "host_threads_devices.json" if "--devices" in extra else "host_threads.json"
        with open(os.path.join(self.out, name)) as f:
            return json.load(f)

    def check_cells(self, got, expect):
        cells = got["cells"]
        self.assertEqual(len(cells), expect)
        for c in cells:
            self.assertEqual(c["failed_threads"], 0, c)
            self.assertGreater(c["calls"], 0, c)
            self.assertGreater(c["samples"], 0, c)
            self.assertLessEqual(c["p50_ns"], c["p99_ns"], c)
            self.assertLessEqual(c["p99_ns"], c["max_ns"], c)
            # every 7th call timed, at most one sample more per thread
            self.assertLessEqual(c["samples"], c["calls"] // 7 + c["threads"], c)

    def test_threads_on_one_device(self):
        got = self.run_script("--threads", "1,3", "--streams", "own,shared")
        # 4 paths x 2 repeats x 2 workloads x 2 stream modes x 2 thread counts
        self.check_cells(got, 4 * 2 * 2 * 2 * 2)
        self.assertEqual({c["path"] for c in got["cells"]},
                         {p[0] for p in ht.NULL_DRIVER_PATHS})
        self.assertIn("### gpualloc CudaAllocator (Rust) (rust process)", got["report"])
        self.assertIn("| mixed 512 B..64 KiB, 50 live | shared | 3 |", got["report"])

    def test_one_thread_per_device(self):
        got = self.run_script("--devices", "1,2")
        self.check_cells(got, 4 * 2 * 2 * 2)
        self.assertEqual({(c["threads"], c["devices"]) for c in got["cells"]}, {(1, 1), (2, 2)})
        self.assertIn("2 devices", got["report"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
