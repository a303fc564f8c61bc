"""CPU tests of host_cost.py's table and of host_threads.py's plan and report (no torch, no
GPU), and host_threads.py end to end over the null driver (the C library and gpu_bench
--threads of a cargo build; skipped when none is built, unless GPUALLOC_TESTS_REQUIRE_TOOLS=1):
python3 benchmarks/host_cost/test_host_cost.py"""
import contextlib
import io
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import cache_lines  # noqa: E402
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
        for bad in ("pair", "mixed:1M:512:10", "mixed:512:1M:0", "triple:1", "pair0:0"):
            with self.assertRaises(ValueError):
                ht.parse_workload(bad)

    def test_zero_pairs_parse_and_need_an_odd_sample_every(self):
        w = ht.parse_workload("pair0:512")
        self.assertEqual((w["spec"], w["size"], w["with_zero"], w["mixed"]),
                         ("pair0:512", 512, True, False))
        self.assertEqual(w["label"], "512 B pair, 0 B pairs between")
        self.assertFalse(ht.parse_workload("pair:512")["with_zero"])
        self.assertFalse(ht.parse_workload("mixed:512:1M:10")["with_zero"])
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull), \
                self.assertRaises(SystemExit):
            ht.parse_args(["--so", __file__, "--workloads", "pair0:512", "--sample-every", "8"])
        ht.parse_args(["--so", __file__, "--workloads", "pair:512", "--sample-every", "8"])

    def test_zero_pairs_run_where_a_zero_byte_request_returns_something_to_free(self):
        self.assertTrue(ht.runs_zero_pairs("native", "empty"))
        self.assertTrue(ht.runs_zero_pairs("bridge", "empty"))
        self.assertTrue(ht.runs_zero_pairs("cpu", "null"))
        for process, kind in (("pluggable-null", "empty"), ("pluggable-gpualloc", "empty"),
                              ("native", "torch"), ("native", "async"), ("native", "so"),
                              ("native", "python"), ("bridge", "torch")):
            self.assertFalse(ht.runs_zero_pairs(process, kind), (process, kind))
        args = ht.parse_args(["--so", __file__, "--threads", "1", "--streams", "own",
                              "--workloads", "pair:512,pair0:512", "--repeats", "1"])
        timed = []

        def timer(kind):
            def run(w, streams, devs):
                timed.append((kind, w["spec"]))
                return {"calls": 1, "wall_ns": 1.0, "p50_ns": 1, "p99_ns": 1}
            return run

        ht.run_cells(args, "native", {k: timer(k) for k in
                                      ("torch", "async", "so", "null", "empty", "python")})
        self.assertEqual(sorted(k for k, spec in timed if spec == "pair0:512"), ["empty", "null"])
        self.assertEqual(len([1 for _, spec in timed if spec == "pair:512"]), 6)
        self.assertEqual(ht.rust_workloads(args), [ht.parse_workload("pair:512")])
        self.assertNotIn("pair0:512", ht.rust_argv(args))

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

    def test_engine_layouts_are_paths_of_their_own(self):
        w = [ht.parse_workload("pair:512")]
        line = ('CELL {"kind": "%s", "repeat": 0, "spec": "pair:512", "streams": "own", '
                '"threads": 2, "devices": 1, "calls": 10, "wall_ns": 5.0, "p50_ns": 1, '
                '"p99_ns": 2, "p999_ns": 2, "max_ns": 3, "samples": 1, "failed_threads": 0, '
                '"error": "", "engines": "%s", "shared_totals": "%s"}')
        out = "\n".join(line % k for k in [("ours", "device", "none"), ("ours", "thread", "none"),
                                           ("ours", "thread", "locked"),
                                           ("ours", "stream", "none"),
                                           ("driver-async", "thread", "none")])
        got = [c["path"] for c in ht.rust_cells(out, w)]
        self.assertEqual(got, ["gpualloc CudaAllocator (Rust)",
                               ht.ENGINE_MODES["thread"][0],
                               ht.ENGINE_MODES["thread+locked"][0],
                               ht.ENGINE_MODES["stream"][0],
                               "cuMemAllocAsync (Rust process)"])
        self.assertFalse(any("engines" in c or "shared_totals" in c
                             for c in ht.rust_cells(out, w)))
        args = ht.parse_args(["--so", __file__, "--null-driver",
                              "--rust-engines", "device,thread+atomic"])
        names = [p[0] for p in ht.active_paths(args)]
        self.assertIn(ht.ENGINE_MODES["thread+atomic"][0], names)
        self.assertNotIn(ht.ENGINE_MODES["thread"][0], names)
        with self.assertRaises(SystemExit):
            ht.parse_args(["--so", __file__, "--rust-engines", "process"])

    def test_an_engine_per_stream_runs_the_rust_path_of_that_layout(self):
        args = ht.parse_args(["--so", __file__, "--null-driver",
                              "--config", "policy:pytorch-bfc, engine_per_stream:True"])
        self.assertEqual(args.rust_engines, ["stream"])
        names = [p[0] for p in ht.active_paths(args)]
        self.assertIn(ht.ENGINE_MODES["stream"][0], names)
        self.assertNotIn("gpualloc CudaAllocator (Rust)", names)
        args = ht.parse_args(["--so", __file__, "--null-driver",
                              "--config", "engine_per_stream:false"])
        self.assertEqual(args.rust_engines, ["device"])
        with self.assertRaises(SystemExit):
            ht.parse_args(["--so", __file__, "--config", "engine_per_stream:True",
                           "--rust-engines", "device,thread"])


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


def zero_cell(path, process, repeat, phases, threads=1, samples=(9, 9, 9, 9)):
    """A pair0 cell whose four phases' medians are `phases` (alloc, free, alloc of 0 bytes,
    free of 0 bytes)."""
    c = cell(path, process, repeat, 1, threads=threads, workload="512 B pair, 0 B pairs between")
    c.update(phase_p50_ns=list(phases), phase_samples=list(samples))
    return c


class ZeroPairsShareTest(unittest.TestCase):
    def cells(self):
        return [
            # PyTorch's at::empty: a call 1000 ns, of which 400 its allocator's
            zero_cell(ht.AT_EMPTY, "native", 0, (1200, 800, 700, 500)),
            zero_cell(ht.AT_EMPTY, "native", 1, (1300, 900, 800, 600)),
            # through the bridge: 700 ns, of which 150 (a third of PyTorch's share)
            zero_cell(ht.BRIDGE_EMPTY, "bridge", 0, (800, 600, 600, 500)),
            zero_cell(ht.BRIDGE_EMPTY, "bridge", 1, (800, 600, 600, 500)),
            # at 2 threads the bridge's share is 300 against PyTorch's 400: not half
            zero_cell(ht.AT_EMPTY, "native", 0, (1200, 800, 700, 500), threads=2),
            zero_cell(ht.BRIDGE_EMPTY, "bridge", 0, (1100, 700, 700, 500), threads=2),
            # a phase without samples gives no share
            zero_cell(ht.BRIDGE_EMPTY, "bridge", 0, (0, 600, 600, 500), threads=4,
                      samples=(0, 9, 9, 9)),
            zero_cell(ht.AT_EMPTY, "native", 0, (1200, 800, 700, 500), threads=4),
        ]

    def test_the_share_is_the_call_less_the_zero_byte_call_of_the_same_loop(self):
        shares = ht.call_shares(self.cells())
        k = ("512 B pair, 0 B pairs between", "own", 1, 1)
        # medians over the repeats: 1250, 850, 750, 550
        self.assertEqual(shares[(ht.AT_EMPTY,) + k]["phases"], [1250, 850, 750, 550])
        self.assertEqual(shares[(ht.AT_EMPTY,) + k]["call"], 1050)
        self.assertEqual(shares[(ht.AT_EMPTY,) + k]["share"], 400)
        self.assertEqual(shares[(ht.BRIDGE_EMPTY,) + k]["share"], 150)
        four = (ht.BRIDGE_EMPTY, "512 B pair, 0 B pairs between", "own", 4, 1)
        self.assertIsNone(shares[four]["share"])
        self.assertIsNone(ht.share_ratio(100, 0))

    def test_the_table_and_the_target(self):
        cells = self.cells()
        table = ht.share_table(cells).splitlines()
        self.assertIn("bridge share / PyTorch's", table[0])
        self.assertEqual(table[2], "| 512 B pair, 0 B pairs between | own | 1 | 1 | 1050 | 400 | "
                                   "700 | 150 | 0.38 |")
        self.assertEqual(table[3], "| 512 B pair, 0 B pairs between | own | 2 | 1 | 1000 | 400 | "
                                   "900 | 300 | 0.75 |")
        self.assertEqual(table[4], "| 512 B pair, 0 B pairs between | own | 4 | 1 | 1000 | 400 | "
                                   "n/a | n/a | n/a |")
        lines = [l for l in ht.targets(cells, ht.summarize(cells), ht.PATHS) if "share" in l]
        self.assertEqual(len(lines), 2)
        self.assertTrue(lines[0].endswith("1 threads, 1 devices: 150 / 400 ns = 0.38 "
                                          "(target <= 0.5: met)"), lines[0])
        self.assertTrue(lines[1].endswith("= 0.75 (target <= 0.5: NOT met)"), lines[1])
        # a pair0 cell's throughput mixes two sizes: no throughput target is read from it
        self.assertFalse(any("per-op cost at most half" in l
                             for l in ht.targets(cells, ht.summarize(cells), ht.PATHS)))
        text = ht.report(cells, ht.PATHS, False, {})
        self.assertIn("### The allocator's share of a call, against 0-byte pairs", text)
        self.assertEqual(ht.share_table([cell(ht.AT_EMPTY, "native", 0, 4)]), "")


class ProcessRoundsTest(unittest.TestCase):
    def cells(self, bridge_shares):
        """One cell of each path a process round: PyTorch's share 400 ns each round, the
        bridge's as given."""
        out = []
        for rnd, share in enumerate(bridge_shares, 1):
            for c in (zero_cell(ht.AT_EMPTY, "native", 0, (1200, 800, 700, 500)),
                      zero_cell(ht.BRIDGE_EMPTY, "bridge", 0,
                                (600 + share, 600 + share, 600, 600))):
                c["process_round"] = rnd
                out.append(c)
        return out

    def test_each_round_pairs_its_own_processes_and_the_interval_decides(self):
        # The bridge's share 160, 180, 200 ns: 0.40, 0.45, 0.50 of PyTorch's.
        cells = self.cells([160, 180, 200])
        k = ("512 B pair, 0 B pairs between", "own", 1, 1)
        self.assertEqual([round(r, 2) for r in ht.round_ratios(cells)[k]], [0.4, 0.45, 0.5])
        table = ht.share_table(cells).splitlines()
        self.assertTrue(table[0].endswith("| per process round | geometric mean (95%) |"))
        self.assertIn("| 0.45 | 0.40 / 0.45 / 0.50 | 0.45 (", table[2])
        line = [l for l in ht.targets(cells, ht.summarize(cells), ht.PATHS) if "share" in l][0]
        # Three rounds spread 0.40-0.50: the interval reaches past 0.5.
        self.assertIn("; per process round 0.45 (", line)
        self.assertTrue(line.endswith("over 3 process rounds: undecided"), line)
        tight = self.cells([160, 164, 168, 162, 166])
        line = [l for l in ht.targets(tight, ht.summarize(tight), ht.PATHS) if "share" in l][0]
        self.assertTrue(line.endswith("over 5 process rounds: met"), line)
        wide = self.cells([400, 410, 390])
        line = [l for l in ht.targets(wide, ht.summarize(wide), ht.PATHS) if "share" in l][0]
        self.assertTrue(line.endswith("over 3 process rounds: NOT met"), line)
        # One round (no process_round, as before): no per-round columns or verdict.
        one = ZeroPairsShareTest().cells()
        self.assertEqual(ht.round_ratios(one), {})
        self.assertNotIn("per process round", ht.share_table(one))

    def test_the_option_and_the_rotation(self):
        args = ht.parse_args(["--so", __file__, "--workloads", "pair0:512", "--process-rounds",
                              "3", "--no-python", "--no-pluggable"])
        self.assertEqual(args.process_rounds, 3)
        self.assertEqual(ht.rotate(ht.processes(args), 1), ["bridge", "native"])
        with contextlib.redirect_stderr(io.StringIO()):
            with self.assertRaises(SystemExit):
                ht.parse_args(["--so", __file__, "--process-rounds", "0"])


class PluggablePlanTest(unittest.TestCase):
    def args(self, *extra):
        return ht.parse_args(["--so", __file__, "--threads", "1,2", "--workloads",
                              "pair:512,mixed:512:1M:100", "--repeats", "2"] + list(extra))

    def test_the_pluggable_processes_and_their_references(self):
        args = self.args()
        self.assertEqual(ht.processes(args),
                         ["native", "bridge", "pluggable-null", "pluggable-gpualloc"])
        paths = {p[0]: p for p in ht.active_paths(args)}
        self.assertEqual(paths[ht.FLOOR][1:], ("pluggable-null", "empty", ht.AT_EMPTY))
        self.assertEqual(paths[ht.PLUGGABLE_EMPTY][1:],
                         ("pluggable-gpualloc", "empty", ht.AT_EMPTY))
        without = self.args("--no-pluggable", "--no-python")
        self.assertEqual(ht.processes(without), ["native", "bridge"])
        self.assertFalse(any(p[1].startswith("pluggable") or p[2] == "python"
                             for p in ht.active_paths(without)))
        self.assertEqual(ht.processes(self.args("--no-python"))[2:],
                         ["pluggable-null", "pluggable-gpualloc"])
        lean = self.args("--no-pluggable", "--no-bridge")
        self.assertEqual(ht.processes(lean), ["native"])
        self.assertFalse(any(p[1] == "bridge" for p in ht.active_paths(lean)))

    def test_a_pluggable_process_runs_its_at_empty_and_its_anchor_rotated(self):
        args = self.args()
        order = []

        def timer(kind):
            def run(w, streams, devs):
                order.append(kind)
                return {"calls": 10, "wall_ns": 1e6, "p50_ns": 1, "p99_ns": 2, "failed_threads": 0}
            return run

        cells = ht.run_cells(args, "pluggable-null", {"empty": timer("empty"),
                                                      "async": timer("async")})
        # 2 repeats x 2 workloads x 2 stream modes x 2 thread counts, two paths each
        self.assertEqual(len(cells), 2 * 2 * 2 * 2 * 2)
        self.assertEqual({c["path"] for c in cells},
                         {ht.FLOOR, "cudaMallocAsync (pluggable-null process)"})
        self.assertEqual({c["process"] for c in cells}, {"pluggable-null"})
        self.assertEqual(order[:6], ["empty", "async", "async", "empty", "empty", "async"])

    def test_each_pytorch_cxx_path_can_run_in_a_process_of_its_own(self):
        args = self.args("--no-pluggable", "--path-per-process")
        self.assertEqual(ht.child_runs(args, "native"),
                         [["torch"], ["empty"], ["async", "so", "null", "python"]])
        self.assertEqual(ht.child_runs(args, "bridge"),
                         [["empty"], ["torch"], ["python", "async"]])
        self.assertEqual(ht.child_runs(self.args("--no-pluggable"), "native"), [None])
        # A child given --kinds times those paths only, and labels its cells' process
        # with them: the ratios then count the cells as another process's.
        child = self.args("--no-pluggable", "--child", "native", "--kinds", "empty")
        ran = []

        def timer(kind):
            def run(w, streams, devs):
                ran.append(kind)
                return {"calls": 10, "wall_ns": 1e6, "p50_ns": 1, "p99_ns": 2,
                        "failed_threads": 0}
            return run

        cells = ht.run_cells(child, "native", {k: timer(k) for k in
                                               ("torch", "async", "so", "null", "empty",
                                                "python")})
        self.assertEqual(set(ran), {"empty"})
        self.assertEqual({c["process"] for c in cells}, {"native:empty"})
        self.assertEqual({c["path"] for c in cells}, {ht.AT_EMPTY})

    def test_the_library_each_pluggable_process_loads(self):
        args = self.args("--child", "pluggable-null", "--null-pluggable", __file__)
        self.assertEqual(ht.pluggable_library(args),
                         (os.path.abspath(__file__), "null_malloc", "null_free"))
        args = self.args("--child", "pluggable-gpualloc")
        self.assertEqual(ht.pluggable_library(args),
                         (os.path.abspath(__file__), "gpualloc_malloc", "gpualloc_free"))
        with self.assertRaises(SystemExit):
            ht.pluggable_library(self.args("--child", "pluggable-null"))


def fake_torch_modules(events, data_ptr=0x1000):
    """torch as child() uses it, recording each step in `events` (its extension's cells take
    1 ms for 10 calls; torch.empty's tensors have address `data_ptr`)."""
    import types

    torch = types.ModuleType("torch")
    torch.__version__ = "fake"
    torch.version = types.SimpleNamespace(cuda="fake")

    class Allocator:
        def __init__(self, path, malloc_name, free_name):
            events.append(("pluggable", path, malloc_name, free_name))

    class Ext:
        def make_streams(self, ndev, per_device):
            events.append(("streams", ndev, per_device))

        def clock_pair_ns(self):
            return 20.0

        def cell(self, kind, *rest):
            events.append(("cell", kind))
            return {"calls": 10, "wall_ns": 1e6, "p50_ns": 1.0, "p99_ns": 2.0, "p999_ns": 2.0,
                    "max_ns": 3.0, "samples": 1, "failed_threads": 0, "error": ""}

    def empty(n, device):
        events.append(("empty", device))
        return types.SimpleNamespace(data_ptr=lambda: data_ptr)

    torch.cuda = types.SimpleNamespace(
        init=lambda: events.append(("init",)),
        memory=types.SimpleNamespace(
            CUDAPluggableAllocator=Allocator,
            change_current_allocator=lambda a: events.append(("change", type(a).__name__))),
        Stream=lambda device: "stream", get_device_name=lambda d: "fake", device_count=lambda: 1)
    torch.device = lambda kind, index: (kind, index)
    torch.empty = empty
    cpp = types.ModuleType("torch.utils.cpp_extension")
    cpp.load = lambda **kw: Ext()
    utils = types.ModuleType("torch.utils")
    utils.cpp_extension = cpp
    torch.utils = utils
    return {"torch": torch, "torch.utils": utils, "torch.utils.cpp_extension": cpp}


class PluggableChildTest(unittest.TestCase):
    """child() of a pluggable process over a stand-in of torch: what it installs, when, and
    what it times."""

    argv = ["--so", __file__, "--threads", "1,2", "--streams", "own", "--workloads", "pair:512",
            "--repeats", "1"]

    def run_child(self, which, data_ptr=0x1000):
        import io
        from unittest import mock

        events = []
        args = ht.parse_args(self.argv + ["--child", which, "--null-pluggable", __file__])
        out = io.StringIO()
        with mock.patch.dict(sys.modules, fake_torch_modules(events, data_ptr)), \
                contextlib.redirect_stdout(out):
            ht.child(args)
        (line,) = [l for l in out.getvalue().splitlines() if l.startswith("RESULT ")]
        return events, json.loads(line[7:])

    def test_the_allocator_is_installed_before_cuda_starts(self):
        events, got = self.run_child("pluggable-null")
        self.assertEqual(events[:3], [("pluggable", os.path.abspath(__file__), "null_malloc",
                                       "null_free"), ("change", "Allocator"), ("init",)])
        self.assertEqual({e[1] for e in events if e[0] == "cell"}, {"empty", "async"})
        self.assertEqual([(c["path"], c["threads"]) for c in got["cells"]],
                         [(ht.FLOOR, 1), ("cudaMallocAsync (pluggable-null process)", 1),
                          ("cudaMallocAsync (pluggable-null process)", 2), (ht.FLOOR, 2)])
        events, got = self.run_child("pluggable-gpualloc")
        self.assertEqual(events[0][2:], ("gpualloc_malloc", "gpualloc_free"))
        self.assertEqual({c["process"] for c in got["cells"]}, {"pluggable-gpualloc"})

    def test_an_allocator_giving_no_memory_stops_the_process(self):
        with self.assertRaises(SystemExit):
            self.run_child("pluggable-null", data_ptr=0)


class MainProcessesTest(unittest.TestCase):
    """main() of a GPU run with the children stood in for: which processes run, and the null
    library built into --out for the pluggable-null one."""

    def run_main(self, *extra):
        from unittest import mock

        runs = []

        def fake_child(args, which, env=None, extra=()):
            runs.append((which, list(extra)))
            return {"cells": [], "info": {}}

        out = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, out)
        argv = ["--so", __file__, "--no-rust", "--out", out] + list(extra)
        with open(os.devnull, "w") as null, mock.patch.object(ht, "prebuild", lambda: None), \
                mock.patch.object(ht, "run_child", fake_child), contextlib.redirect_stdout(null):
            self.assertEqual(ht.main(argv), 0)
        return runs, out

    def test_the_pluggable_processes_run_last_and_only_the_null_one_gets_the_library(self):
        if not shutil.which("cc"):
            if os.environ.get("GPUALLOC_TESTS_REQUIRE_TOOLS") == "1":
                self.fail("needs cc")
            self.skipTest("needs cc")
        runs, out = self.run_main()
        so = os.path.join(out, "libnull_pluggable.so")
        self.assertEqual(runs, [("native", []), ("bridge", []),
                                ("pluggable-null", ["--null-pluggable", so]),
                                ("pluggable-gpualloc", [])])
        self.assertTrue(os.path.isfile(so))
        runs, out = self.run_main("--no-pluggable")
        self.assertEqual(runs, [("native", []), ("bridge", [])])
        self.assertFalse(os.path.exists(os.path.join(out, "libnull_pluggable.so")))
        runs, out = self.run_main("--no-pluggable", "--no-python", "--path-per-process")
        self.assertEqual(runs, [("native", ["--kinds", "torch"]),
                                ("native", ["--kinds", "empty"]),
                                ("native", ["--kinds", "async,so,null"]),
                                ("bridge", ["--kinds", "empty"]),
                                ("bridge", ["--kinds", "torch"]),
                                ("bridge", ["--kinds", "async"])])


class FloorTableTest(unittest.TestCase):
    def cells(self):
        out = []
        # one thread: PyTorch 4, floor 5 (median of 5, 4, 10), bridge 2, pluggable 2.5 M calls/s
        for rep, floor_m in enumerate([5, 4, 10]):
            out += [cell(ht.AT_EMPTY, "native", rep, 4), cell(ht.FLOOR, "pluggable-null", rep,
                                                               floor_m),
                    cell(ht.BRIDGE_EMPTY, "bridge", rep, 2),
                    cell(ht.PLUGGABLE_EMPTY, "pluggable-gpualloc", rep, 2.5)]
        # two threads: PyTorch 4, floor 8, bridge 5 M calls/s, no pluggable gpualloc
        out += [cell(ht.AT_EMPTY, "native", 0, 4, threads=2),
                cell(ht.FLOOR, "pluggable-null", 0, 8, threads=2),
                cell(ht.BRIDGE_EMPTY, "bridge", 0, 5, threads=2)]
        return out

    def test_rows_subtract_the_floor_from_each_path(self):
        cells = self.cells()
        lines = ht.floor_table(cells, ht.summarize(cells), False).splitlines()
        self.assertEqual(lines[0], "| workload | streams | threads | PyTorch ns | floor ns | "
                                   "bridge ns | pluggable gpualloc ns | PyTorch's share ns (a) | "
                                   "bridge's share ns (a) | pluggable gpualloc's share ns |")
        self.assertEqual(len(lines), 4)
        # 1e9 / 4e6 = 250, / 5e6 = 200, / 2e6 = 500, / 2.5e6 = 400; shares 50, 300, 200
        self.assertEqual(lines[2], "| 512 B pair | own | 1 | 250 | 200 | 500 | 400 | 50 | 300 | "
                                   "200 |")
        # 2 x 1e9 / 4e6 = 500, / 8e6 = 250, / 5e6 = 400; shares 250 and 150
        self.assertEqual(lines[3], "| 512 B pair | own | 2 | 500 | 250 | 400 | n/a | 250 | 150 | "
                                   "n/a |")

    def test_the_report_has_the_section_only_with_a_floor(self):
        cells = self.cells()
        text = ht.report(cells, ht.PATHS, False, {})
        self.assertIn("### The floor of the at::empty path", text)
        self.assertIn(ht.FLOOR_NOTE, text)
        self.assertIn("### at::empty via pluggable null (pluggable-null process)", text)
        self.assertIn("at::empty via pluggable gpualloc / at::empty, PyTorch's allocator, "
                      "512 B pair, own streams, 1 threads, 1 devices: 0.62* (target >= 2", text)
        rest = [c for c in cells if c["path"] != ht.FLOOR]
        self.assertNotIn("floor", ht.report(rest, ht.PATHS, False, {}))
        self.assertEqual(ht.floor_table(rest, ht.summarize(rest), False), "")

    def test_one_thread_per_device(self):
        cells = [cell(ht.AT_EMPTY, "native", 0, 4, threads=2, devices=2),
                 cell(ht.FLOOR, "pluggable-null", 0, 10, threads=2, devices=2)]
        lines = ht.floor_table(cells, ht.summarize(cells), True).splitlines()
        self.assertTrue(lines[0].startswith("| workload | streams | devices |"))
        self.assertEqual(lines[2], "| 512 B pair | own | 2 | 500 | 200 | n/a | n/a | 300 | n/a | "
                                   "n/a |")


# A stand-in for the CUDA runtime's cudaMalloc: fails while stub_fail is set, sleeps
# stub_delay_us (so that threads meet on a first call), hands out made-up addresses.
STUB_CUDART = r"""
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>
int stub_fail, stub_calls, stub_delay_us;
size_t stub_last_size;
int cudaMalloc(void** p, size_t n) {
  int call = __atomic_add_fetch(&stub_calls, 1, __ATOMIC_SEQ_CST);
  if (stub_delay_us) usleep((useconds_t)stub_delay_us);
  stub_last_size = n;
  if (stub_fail) { *p = NULL; return 2; }
  *p = (void*)(uintptr_t)(0x10000000u * (unsigned)call);
  return 0;
}
"""


LOCKED_LOOP = r"""
#include <pthread.h>
#include <stdio.h>
static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static long count;
static long unshared;
__attribute__((noinline)) void take_the_shared_lock(void) {
  pthread_mutex_lock(&m);
  for (volatile int i = 0; i < 200; i++) {}
  count++;
  pthread_mutex_unlock(&m);
}
static void* work(void* arg) {
  pthread_mutex_t own = PTHREAD_MUTEX_INITIALIZER;
  for (int i = 0; i < 20000; i++) {
    take_the_shared_lock();
    pthread_mutex_lock(&own);  /* never contended */
    unshared++;
    pthread_mutex_unlock(&own);
  }
  return arg;
}
int main(void) {
  pthread_t t[4];
  for (int i = 0; i < 4; i++) pthread_create(&t[i], 0, work, 0);
  for (int i = 0; i < 4; i++) pthread_join(t[i], 0);
  printf("%ld\n", count);
  return 0;
}
"""


class LockWaitsTest(unittest.TestCase):
    """lock_waits.c (LD_PRELOAD) over a program whose four threads share one mutex."""

    def test_the_contended_lock_is_named_by_its_caller(self):
        import subprocess

        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            if os.environ.get("GPUALLOC_TESTS_REQUIRE_TOOLS") == "1":
                self.fail("needs cc")
            self.skipTest("needs cc")
        d = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, d)
        so, prog = os.path.join(d, "lock_waits.so"), os.path.join(d, "loop")
        with open(prog + ".c", "w") as f:
            f.write(LOCKED_LOOP)
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", so,
                        os.path.join(HERE, "lock_waits.c"), "-ldl", "-lpthread"], check=True)
        subprocess.run([cc, "-O1", "-rdynamic", "-o", prog, prog + ".c", "-lpthread"], check=True)
        env = dict(os.environ, LD_PRELOAD=so, LOCK_WAITS_DIR=d)
        r = subprocess.run([prog], env=env, capture_output=True, text=True, check=True)
        self.assertEqual(r.stdout.strip(), "80000")  # the mutex still excludes
        reports = [f for f in os.listdir(d) if f.startswith("lock_waits.")
                   and f.endswith(".txt")]
        self.assertEqual(len(reports), 1)
        with open(os.path.join(d, reports[0])) as f:
            text = f.read()
        waited, free = (int(n) for n in re.match(r"locks waited for (\d+), found free (\d+)",
                                                   text).groups())
        self.assertEqual(waited + free, 160000)  # every lock seen, each once
        # Four threads on one mutex 80,000 times wait at times (on one core too: a
        # thread preempted inside holds it); the per-thread mutexes never wait.
        self.assertGreater(waited, 0)
        first = text.split("\n== ")[1].splitlines()
        self.assertIn("take_the_shared_lock+0x", first[1])
        self.assertNotIn("work", first[1])


class CacheLinesTest(unittest.TestCase):
    """cache_lines.py's reading of a lackey trace (a synthetic one: no valgrind)."""

    SEP = 0x10c080

    def trace(self):
        # Before the first store to sep nothing counts; then two calls. Lines are numbered
        # from L = 0x4000000 / 64. Call 1 loads line L, stores L+1 and L+2 (L+2 twice, by two
        # instructions), touches the stack and the program's own data (both left out).
        # Call 2 loads L+2 and stores L+3.
        return [
            " S 04000000,8\n",
            " S 0010c080,8\n",
            "I  04a00010,3\n", " L 04000000,8\n",
            "I  04a00020,3\n", " S 04000040,8\n",
            "I  04a00030,3\n", " M 04000080,4\n",
            "I  04a00040,3\n", " S 040000b8,8\n",
            " S 1ffeffc000,8\n", " S 0010c040,8\n",
            " L 0010c080,8\n",
            " S 0010c080,8\n",
            "I  04a00050,3\n", " L 04000088,8\n",
            "I  04a00060,3\n", " S 040000c0,8\n",
            "==123== a log line\n",
        ]

    def test_a_trace_is_cut_into_calls_at_the_stores_to_sep(self):
        calls = cache_lines.parse_trace(self.trace(), self.SEP, exclude=[(0x10c000, 0x10c080)])
        self.assertEqual(len(calls), 2)
        touched, written, by = calls[0]
        L = 0x4000000 // 64
        self.assertEqual(touched, {L, L + 1, L + 2})
        self.assertEqual(written, {L + 1, L + 2})
        self.assertEqual(by[L + 2], {0x4a00030, 0x4a00040})
        self.assertEqual((calls[1][0], calls[1][1]), ({L + 2, L + 3}, {L + 3}))

    def test_the_means_and_the_lines_that_move_between_calls(self):
        calls = cache_lines.parse_trace(self.trace(), self.SEP, exclude=[(0x10c000, 0x10c080)])
        got = cache_lines.summarize(calls)
        # Touched 3 and 2, written 2 and 1; of call 1's written lines call 2 touches one.
        self.assertEqual(got, {"calls": 2, "touched": 2.5, "written": 1.5,
                               "moved_between_calls": 1.0})
        L = 0x4000000 // 64
        self.assertEqual(sorted((ln, c) for ln, c, _ in cache_lines.hot_lines(calls)),
                         [(L + 1, 1), (L + 2, 1), (L + 3, 1)])
        with self.assertRaises(ValueError):
            cache_lines.summarize(calls[:1])

    def test_the_library_and_the_program_are_found_in_the_memory_map(self):
        maps = ["sep 0x10c080",
                "0010c000-0010d000 rw-p 00003000 fe:00 1 /tmp/x/cache_lines",
                "04a2a000-04a93000 r--p 00000000 fe:00 2 /lib/liballoc_ffi.so",
                "04a93000-04c34000 r-xp 00068000 fe:00 2 /lib/liballoc_ffi.so"]
        self.assertEqual(cache_lines.library_base(maps, "/lib/liballoc_ffi.so"), 0x4a2a000)
        self.assertEqual(cache_lines.mapped_ranges(maps, "/tmp/x/cache_lines"),
                         [(0x10c000, 0x10d000)])


class NullPluggableTest(unittest.TestCase):
    """null_pluggable.c as host_threads.py builds it, over a stand-in cudaMalloc loaded into
    the global scope first (as PyTorch's process has libcudart). The stand-in is loaded once
    (the first cudaMalloc of the global scope is the one found); each test loads a fresh copy
    of null_pluggable.c's library (a path of its own), so none of its blocks exist yet."""

    stub = None

    @classmethod
    def setUpClass(cls):
        if not shutil.which("cc"):
            return
        import ctypes

        cls.stub_dir = tempfile.mkdtemp()
        src = os.path.join(cls.stub_dir, "stub_cudart.c")
        with open(src, "w") as f:
            f.write(STUB_CUDART)
        cls.stub = ctypes.CDLL(ht.compile_so("cc", src, os.path.join(cls.stub_dir, "libstub.so")),
                               mode=ctypes.RTLD_GLOBAL)

    @classmethod
    def tearDownClass(cls):
        if cls.stub is not None:
            shutil.rmtree(cls.stub_dir)

    def setUp(self):
        if self.stub is None:
            if os.environ.get("GPUALLOC_TESTS_REQUIRE_TOOLS") == "1":
                self.fail("needs cc")
            self.skipTest("needs cc")
        self.dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.dir)
        self.so = ht.build_null_pluggable(self.dir)

    def load(self):
        import ctypes

        stub = self.stub
        for name in ("stub_fail", "stub_calls", "stub_delay_us"):
            ctypes.c_int.in_dll(stub, name).value = 0
        lib = ctypes.CDLL(self.so)
        lib.null_malloc.restype = ctypes.c_void_p
        lib.null_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.null_free.restype = None
        lib.null_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                                  ctypes.c_void_p]
        return stub, lib, lambda name: ctypes.c_int.in_dll(stub, name)

    def test_one_block_per_device_a_new_address_in_it_for_what_fits(self):
        stub, lib, var = self.load()
        var("stub_fail").value = 1
        self.assertIsNone(lib.null_malloc(512, 0, None))  # cudaMalloc failed: NULL, try again
        var("stub_fail").value = 0
        base = lib.null_malloc(512, 0, None)
        self.assertEqual(base, 2 * 0x10000000)
        self.assertEqual(ctypes_size(stub), 64 << 20)
        # Live requests never share an address (PyTorch's pluggable allocator fails the
        # free of a pointer it holds twice): the next ones follow 512 bytes apart.
        self.assertEqual(lib.null_malloc(64 << 20, 0, None), base + 512)
        lib.null_free(base, 512, 0, None)
        self.assertEqual(lib.null_malloc(0, 0, None), base + 1024)
        self.assertEqual(var("stub_calls").value, 2)
        for size, device in (((64 << 20) + 1, 0), (-1, 0), (512, -1), (512, 64)):
            self.assertIsNone(lib.null_malloc(size, device, None), (size, device))
        self.assertEqual(lib.null_malloc(8 << 20, 1, None), 3 * 0x10000000 + 3 * 512)
        self.assertEqual(var("stub_calls").value, 3)
        seen = {lib.null_malloc(512, 0, None) for _ in range(4096 - 4)}
        self.assertEqual(len(seen), 4096 - 4)
        self.assertLess(max(seen), base + (64 << 20))
        self.assertEqual(lib.null_malloc(512, 0, None), base)  # the lane wraps after 4096

    def test_the_block_is_as_large_as_built(self):
        self.so = ht.build_null_pluggable(self.dir, 3 << 30)
        stub, lib, _ = self.load()
        self.assertEqual(lib.null_malloc(3 << 30, 0, None), 0x10000000)
        self.assertEqual(ctypes_size(stub), 3 << 30)
        self.assertIsNone(lib.null_malloc((3 << 30) + 1, 0, None))
        self.assertEqual(ht.largest_request([ht.parse_workload("pair:8M"),
                                             ht.parse_workload("mixed:512:100M:10")]), 100 << 20)

    def test_threads_meeting_on_the_first_call_make_one_block_and_take_lanes_of_it(self):
        stub, lib, var = self.load()
        var("stub_delay_us").value = 20000
        got = []
        ts = [threading.Thread(target=lambda: got.append([lib.null_malloc(512, 5, None)
                                                          for _ in range(3)]))
              for _ in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        self.assertEqual(var("stub_calls").value, 1)
        lanes = sorted(g[0] for g in got)
        self.assertEqual(lanes, [0x10000000 + i * 4096 * 512 for i in range(8)])
        for g in got:
            self.assertEqual(g, [g[0], g[0] + 512, g[0] + 1024])

    def test_without_a_cuda_runtime_every_request_is_null(self):
        import subprocess

        code = ("import ctypes; lib = ctypes.CDLL(%r); lib.null_malloc.restype = ctypes.c_void_p; "
                "print(lib.null_malloc(ctypes.c_ssize_t(512), 0, None))" % self.so)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout
        self.assertEqual(out.strip(), "None")


def ctypes_size(stub):
    """The size of the stand-in's last cudaMalloc."""
    import ctypes

    return ctypes.c_size_t.in_dll(stub, "stub_last_size").value


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

    def test_zero_pairs_through_the_loops(self):
        got = self.run_script("--threads", "1,2", "--streams", "own", "--workloads",
                              "pair0:512", "--no-rust")
        # only the null allocator takes 0 bytes: 2 repeats x 2 thread counts
        self.check_cells(got, 2 * 2)
        for c in got["cells"]:
            self.assertEqual(c["path"], "null (loop cost)")
            # every phase sampled (an odd --sample-every), about a quarter of the samples each
            self.assertEqual(sum(c["phase_samples"]), c["samples"])
            self.assertTrue(all(n >= c["samples"] // 4 - c["threads"]
                                for n in c["phase_samples"]), c)
        self.assertIn("| null ns | null share ns |", got["report"])

    def test_one_thread_per_device(self):
        got = self.run_script("--devices", "1,2")
        self.check_cells(got, 4 * 2 * 2 * 2)
        self.assertEqual({(c["threads"], c["devices"]) for c in got["cells"]}, {(1, 1), (2, 2)})
        self.assertIn("2 devices", got["report"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
