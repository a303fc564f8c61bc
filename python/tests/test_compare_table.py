"""CPU test of compare_workloads.py's table (no torch, no GPU):

    python3 python/tests/test_compare_table.py      (or python3 -m pytest ...)

The expected figures are worked out by hand from the synthetic results below, so a wrong
median, ratio, baseline or equality verdict fails a test.
"""
import json
import contextlib
import os
import subprocess
import sys
import tempfile
import math
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import compare_workloads as cw  # noqa: E402

G = 2**30


def run(alloc, step_ms, warmup, reserved, allocated, fingerprint, workload="w1",
        reserved_source="torch.cuda.memory_stats", allocated_source=None, dev_allocs=10,
        used=None):
    return {
        "workload": workload, "alloc": alloc, "step_ms": step_ms, "warmup": warmup,
        "peak_reserved": reserved, "reserved_source": reserved_source,
        "peak_allocated": allocated, "allocated_source": allocated_source or reserved_source,
        "num_device_alloc": dev_allocs, "device_used_delta": used if used is not None else reserved,
        "fingerprint": fingerprint,
    }


FP = {"losses": [10.981129, 10.977077, 10.983126]}
FP_OTHER = {"losses": [10.981129, 10.977077, 10.983126 + 1e-6]}

RESULTS = [
    # warm-up steps (500, 300) must not count: median of [100, 104, 96] = 100
    run("torch", [500.0, 300.0, 100.0, 104.0, 96.0], 2, 10 * G, 6 * G, FP),
    run("torch-expandable", [400.0, 101.0, 99.0, 103.0], 1, 8 * G, 6 * G, FP, dev_allocs=3),
    # cudaMallocAsync without a reserved figure: the cuMemGetInfo stand-in (7 GiB) is
    # smaller than expandable's 8 GiB but must not become the baseline
    run("torch-async", [300.0, 110.0, 112.0, 111.0], 1, 7 * G, 5.5 * G, FP,
        reserved_source="cuMemGetInfo", allocated_source="cudaMallocAsync pool", dev_allocs=None),
    # median of [102, 101, 103] = 102 -> 1.020; 8.8 GiB / 8 GiB = 1.100
    run("gpualloc", [900.0, 102.0, 101.0, 103.0], 1, int(8.8 * G), 6 * G, FP,
        reserved_source="gpu_alloc.memory_stats"),
    # even number of timed steps: median of [98, 99, 101, 102] = 100 -> 1.000; 12 / 8 = 1.5
    run("gpualloc:policy:buddy", [1.0, 98.0, 102.0, 99.0, 101.0], 1, 12 * G, 6 * G, FP_OTHER),
    {"workload": "w1", "alloc": "gpualloc:policy:size-class", "error": "rc -11: Segmentation fault"},
    # second workload with no torch run: no step ratio, no equality verdict; the best
    # PyTorch reserved is the cuMemGetInfo one because no other PyTorch figure exists
    run("torch-async", [5.0, 4.0, 4.0], 1, 2 * G, G, {"logit_sums": [1.5]}, workload="w2",
        reserved_source="cuMemGetInfo", dev_allocs=None),
    run("gpualloc", [5.0, 4.0, 6.0], 1, 3 * G, G, {"logit_sums": [1.5]}, workload="w2"),
]


def parse_markdown(md):
    """{(workload, allocator): {column: cell}} from the report's table."""
    lines = [l for l in md.splitlines() if l.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    table = {}
    for l in lines[2:]:
        cells = [c.strip() for c in l.strip().strip("|").split("|")]
        assert len(cells) == len(header), l
        row = dict(zip(header, cells))
        table[(row["workload"], row["allocator"])] = row
    return header, table


class TableTest(unittest.TestCase):
    def setUp(self):
        self.md = cw.make_table(RESULTS)
        self.header, self.t = parse_markdown(self.md)

    def cell(self, alloc, col, workload="w1"):
        return self.t[(workload, alloc)][col]

    def test_columns_and_rows(self):
        self.assertEqual(self.header, cw.TABLE_COLUMNS)
        self.assertEqual(len(self.t), len(RESULTS))
        self.assertEqual(list(self.t), [(r["workload"], r["alloc"]) for r in RESULTS])

    def test_median_excludes_warmup(self):
        self.assertEqual(self.cell("torch", "median step ms"), "100.00")
        self.assertEqual(self.cell("torch-expandable", "median step ms"), "101.00")
        self.assertEqual(self.cell("gpualloc", "median step ms"), "102.00")
        self.assertEqual(self.cell("gpualloc:policy:buddy", "median step ms"), "100.00")
        self.assertEqual(cw.median_step_ms({"step_ms": [9.0, 1.0, 2.0, 3.0], "warmup": 1}), 2.0)

    def test_mean_step_counts_the_slow_steps_the_median_leaves_out(self):
        # torch: mean of [100, 104, 96] = 100; gpualloc: mean of [102, 101, 103] = 102
        self.assertEqual(self.cell("torch", "mean step / torch"), "1.000")
        self.assertEqual(self.cell("gpualloc", "mean step / torch"), "1.020")
        # buddy: mean of [98, 102, 99, 101] = 100
        self.assertEqual(self.cell("gpualloc:policy:buddy", "mean step / torch"), "1.000")
        self.assertEqual(self.cell("gpualloc", "mean step / torch", "w2"), "-")
        self.assertEqual(self.cell("gpualloc:policy:size-class", "mean step / torch"), "-")
        # One slow step in four: the median stays, the mean moves.
        slow = [run("torch", [50.0, 10.0, 10.0, 10.0, 10.0], 1, G, G, FP),
                run("gpualloc", [50.0, 10.0, 10.0, 10.0, 30.0], 1, G, G, FP)]
        _, t = parse_markdown(cw.make_table(slow))
        self.assertEqual(t[("w1", "gpualloc")]["step / torch"], "1.000")
        self.assertEqual(t[("w1", "gpualloc")]["mean step / torch"], "1.500")
        self.assertEqual(cw.mean_step_ms({"step_ms": [9.0, 1.0, 2.0, 6.0], "warmup": 1}), 3.0)
        self.assertIsNone(cw.mean_step_ms({"median_step_ms": 4.0}))

    def test_step_ratio_to_torch(self):
        self.assertEqual(self.cell("torch", "step / torch"), "1.000")
        self.assertEqual(self.cell("torch-expandable", "step / torch"), "1.010")
        self.assertEqual(self.cell("torch-async", "step / torch"), "1.110")
        self.assertEqual(self.cell("gpualloc", "step / torch"), "1.020")
        self.assertEqual(self.cell("gpualloc:policy:buddy", "step / torch"), "1.000")

    def test_reserved_ratio_to_best_pytorch_setting(self):
        self.assertEqual(self.cell("torch", "peak reserved GiB"), "10.000")
        self.assertEqual(self.cell("torch", "reserved / best PyTorch"), "1.250")
        self.assertEqual(self.cell("torch-expandable", "reserved / best PyTorch"), "1.000")
        self.assertEqual(self.cell("torch-async", "peak reserved GiB"), "7.000 †")
        self.assertEqual(self.cell("torch-async", "reserved / best PyTorch"), "0.875")
        self.assertEqual(self.cell("gpualloc", "peak reserved GiB"), "8.800")
        self.assertEqual(self.cell("gpualloc", "reserved / best PyTorch"), "1.100")
        self.assertEqual(self.cell("gpualloc:policy:buddy", "reserved / best PyTorch"), "1.500")
        self.assertIn("w1: torch-expandable", self.md)

    def test_marked_fallback_is_baseline_only_when_alone(self):
        self.assertEqual(self.cell("torch-async", "reserved / best PyTorch", "w2"), "1.000")
        self.assertEqual(self.cell("gpualloc", "reserved / best PyTorch", "w2"), "1.500")

    def test_allocated_and_device_allocs(self):
        self.assertEqual(self.cell("torch", "peak allocated GiB"), "6.000")
        self.assertEqual(self.cell("torch-async", "peak allocated GiB"), "5.500 ‡")
        self.assertEqual(self.cell("torch-expandable", "device allocs"), "3")
        self.assertEqual(self.cell("torch-async", "device allocs"), "n/a")
        self.assertEqual(self.cell("gpualloc", "cuMemGetInfo Δ GiB"), "8.800")

    def test_outputs_equal(self):
        self.assertEqual(self.cell("torch", "outputs equal"), "ref")
        self.assertEqual(self.cell("torch-expandable", "outputs equal"), "yes")
        self.assertEqual(self.cell("gpualloc", "outputs equal"), "yes")
        # 1e-6 apart is a mismatch: equality is exact, and the report says where
        self.assertEqual(self.cell("gpualloc:policy:buddy", "outputs equal"), "no")
        self.assertIn("gpualloc:policy:buddy: fingerprint.losses[2]", self.md)

    def test_without_reference_run(self):
        self.assertEqual(self.cell("gpualloc", "step / torch", "w2"), "-")
        self.assertEqual(self.cell("gpualloc", "outputs equal", "w2"), "n/a")

    def test_failed_run(self):
        self.assertEqual(self.cell("gpualloc:policy:size-class", "outputs equal"), "FAILED")
        self.assertEqual(self.cell("gpualloc:policy:size-class", "median step ms"), "-")
        self.assertIn("Segmentation fault", self.md)

    def test_order_independent(self):
        md2 = cw.make_table(list(reversed(RESULTS[:6])) + RESULTS[6:])
        _, t2 = parse_markdown(md2)
        for key, row in self.t.items():
            self.assertEqual(t2[key], row)

    def test_first_difference(self):
        self.assertIsNone(cw.first_difference({"a": [1.0, "x"]}, {"a": [1.0, "x"]}))
        self.assertIn("fingerprint.a[1]", cw.first_difference({"a": [1.0, "x"]}, {"a": [1.0, "y"]}))
        self.assertIn("entries", cw.first_difference({"a": [1.0]}, {"a": [1.0, 2.0]}))
        self.assertIsNotNone(cw.first_difference({"s": 0.1 + 0.2}, {"s": 0.3}))

    def test_parse_alloc(self):
        self.assertEqual(cw.parse_alloc("torch"), ("torch", ""))
        self.assertEqual(cw.parse_alloc("torch-expandable"), ("torch", "expandable_segments:True"))
        self.assertEqual(cw.parse_alloc("torch-async"), ("torch", "backend:cudaMallocAsync"))
        self.assertEqual(cw.parse_alloc("torch#2"), ("torch", ""))
        self.assertEqual(cw.parse_alloc("gpualloc"), ("gpualloc", None))
        self.assertEqual(cw.parse_alloc("gpualloc:policy:pytorch-bfc+gc-age"),
                         ("gpualloc", "policy:pytorch-bfc+gc-age"))
        self.assertEqual(cw.parse_alloc("gpualloc:expandable_segments:True"),
                         ("gpualloc", "expandable_segments:True"))
        self.assertEqual(cw.parse_alloc("gpualloc:unmap_free_pages:True@lib/a.so#2"),
                         ("gpualloc", "unmap_free_pages:True"))
        with self.assertRaises(ValueError):
            cw.parse_alloc("rmm")
        for a in cw.DEFAULT_ALLOCS:
            cw.parse_alloc(a)

    def test_child_env_loads_the_build_a_run_names(self):
        env = cw.child_env("gpualloc:unmap_free_pages:True@lib/a.so#2", False)
        self.assertEqual(env["GPUALLOC_SO"], os.path.abspath("lib/a.so"))

    def test_child_env(self):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        os.environ["GPUALLOC_CONF"] = "policy:buddy"
        try:
            self.assertNotIn("PYTORCH_CUDA_ALLOC_CONF", cw.child_env("torch", False))
            self.assertNotIn("PYTORCH_CUDA_ALLOC_CONF", cw.child_env("gpualloc", False))
            self.assertNotIn("GPUALLOC_CONF", cw.child_env("gpualloc", False))
            self.assertEqual(cw.child_env("torch-async", False)["PYTORCH_CUDA_ALLOC_CONF"],
                             "backend:cudaMallocAsync")
        finally:
            del os.environ["PYTORCH_CUDA_ALLOC_CONF"], os.environ["GPUALLOC_CONF"]

    def test_from_json_and_no_torch_import(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "r.json")
            with open(path, "w") as f:
                json.dump(RESULTS, f)
            script = os.path.join(os.path.dirname(HERE), "examples", "compare_workloads.py")
            p = subprocess.run([sys.executable, script, "--from-json", path],
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertEqual(p.stdout, self.md)
        self.assertNotIn("torch", sys.modules)


class RepeatTest(unittest.TestCase):
    def test_rounds_are_interleaved_and_tagged(self):
        self.assertEqual(cw.with_repeats(["torch", "gpualloc:policy:buddy"], 3),
                         ["torch", "gpualloc:policy:buddy", "gpualloc:policy:buddy#2", "torch#2",
                          "torch#3", "gpualloc:policy:buddy#3"])
        # Three settings: each runs first in one round of three.
        self.assertEqual(cw.with_repeats(["a", "b", "c"], 3),
                         ["a", "b", "c", "b#2", "c#2", "a#2", "c#3", "a#3", "b#3"])
        self.assertEqual(cw.with_repeats(["torch"], 1), ["torch"])
        self.assertEqual(cw.split_tag("gpualloc:policy:buddy#12"), ("gpualloc:policy:buddy", "12"))
        self.assertEqual(cw.split_tag("torch"), ("torch", ""))

    def test_each_round_is_compared_with_its_own_reference_run(self):
        results = [
            # round 1: torch 10, ours 11 (1.1); round 2: torch 20 (drift), ours 19 (0.95);
            # round 3: torch 10, ours 10.5 (1.05); round 2's other setting failed.
            run("torch", [10.0], 0, G, G, FP),
            run("gpualloc", [11.0], 0, G, G, FP),
            run("gpualloc:policy:buddy", [12.0], 0, G, G, FP),
            run("torch#2", [20.0], 0, G, G, FP),
            run("gpualloc#2", [19.0], 0, G, G, FP),
            {"workload": "w1", "alloc": "gpualloc:policy:buddy#2", "error": "timeout after 40 s"},
            run("torch#3", [10.0], 0, G, G, FP),
            run("gpualloc#3", [10.5], 0, G, G, FP),
        ]
        lines = cw.repeat_summary(results)
        rows = {line.split(" | ")[1]: line for line in lines if line.startswith("| w1 ")}
        self.assertEqual(set(rows), {"torch", "gpualloc"})  # buddy succeeded once only
        # One step a run: the mean ratios are the median ones.
        self.assertIn("| 3 | 11.00 / 19.00 / 10.50 | 1.100 / 0.950 / 1.050 | 1.050 | 1.050 "
                      "| 1.100 / 0.950 / 1.050 | 1.050 |", rows["gpualloc"])
        self.assertIn("| 3 | 10.00 / 20.00 / 10.00 | 1.000 / 1.000 / 1.000 | 1.000 | 1.000 "
                      "| 1.000 / 1.000 / 1.000 | 1.000 |", rows["torch"])
        self.assertIn("Repeated settings", cw.make_table(results))
        self.assertEqual(cw.repeat_summary(RESULTS), [])


class IntervalTest(unittest.TestCase):
    def test_the_interval_of_per_round_ratios_and_the_verdict_against_the_target(self):
        self.assertIsNone(cw.ratio_interval([1.01]))
        mean, low, high = cw.ratio_interval([1.0, 1.0, 1.0])
        self.assertEqual((round(mean, 6), round(low, 6), round(high, 6)), (1.0, 1.0, 1.0))
        # Logs 0.01 and 0.03: mean 0.02, sd 0.01414, t(1) 12.706 -> half 0.127.
        mean, low, high = cw.ratio_interval([math.exp(0.01), math.exp(0.03)])
        self.assertAlmostEqual(math.log(mean), 0.02)
        self.assertAlmostEqual(math.log(high) - math.log(mean), 12.706 * 0.0141421356 / 2 ** 0.5,
                               places=5)
        self.assertEqual(cw.verdict([1.0, 1.005, 0.995, 1.0]), "within")
        self.assertEqual(cw.verdict([1.05, 1.06, 1.055, 1.05]), "above")
        # Across 1.02 with a 3% spread: undecided, and more rounds than run would decide.
        got = cw.verdict([0.99, 1.05, 1.00, 1.04])
        self.assertTrue(got.startswith("undecided (~"), got)
        self.assertGreater(int(got.split("~")[1].split()[0]), 4)
        self.assertEqual(cw.verdict([1.0]), "-")

    def test_the_repeated_table_carries_the_interval_and_the_verdict(self):
        results = []
        for k, (ref, ours) in enumerate([(10.0, 10.0), (20.0, 20.1), (10.0, 10.05)], 1):
            tag = "" if k == 1 else "#%d" % k
            results += [run("torch" + tag, [ref], 0, G, G, FP),
                        run("gpualloc" + tag, [ours], 0, G, G, FP)]
        rows = {line.split(" | ")[1]: line for line in cw.repeat_summary(results)
                if line.startswith("| w1 ")}
        # Three rounds: within by the t interval; too few for the median's interval.
        self.assertTrue(rows["gpualloc"].endswith("| within | - | - |"), rows["gpualloc"])
        self.assertIn("| 1.003 (", rows["gpualloc"])
        self.assertTrue(rows["torch"].endswith("| 1.000 (1.000-1.000) | - | - | - |"),
                        rows["torch"])

    def test_the_median_interval_is_order_statistics(self):
        self.assertIsNone(cw.median_interval([1.0] * 5))  # P(B(5) <= 0) = 1/32 > 0.025
        # Six rounds: k = 0 (1/64 <= 0.025; 7/64 is not): the extremes.
        self.assertEqual(cw.median_interval([1.03, 0.98, 1.0, 1.01, 0.99, 1.02]),
                         (1.005, 0.98, 1.03))
        # 38 rounds: k = 12 (P(B(38) <= 12) = 0.0168, <= 13 is 0.0362): the 13th and 26th.
        ratios = [1.0 + i / 1000.0 for i in range(38)]
        median, low, high = cw.median_interval(ratios)
        self.assertAlmostEqual(median, 1.0185)
        self.assertEqual((low, high), (ratios[12], ratios[25]))
        # One whole slow process moves the median's interval by one place at most.
        slow = ratios[:-1] + [1.5]
        self.assertEqual(cw.median_interval(slow)[1:], (ratios[12], ratios[25]))

    def test_the_verdict_by_the_median(self):
        self.assertEqual(cw.median_verdict([1.0, 1.005, 0.995, 1.0, 1.01, 0.99]), "within")
        self.assertEqual(cw.median_verdict([1.05, 1.06, 1.055, 1.05, 1.03, 1.04]), "above")
        self.assertEqual(cw.median_verdict([0.99, 1.05, 1.00, 1.04, 1.0, 1.03]), "undecided")
        self.assertEqual(cw.median_verdict([1.0] * 5), "-")
        # Two slow processes out of twelve leave the median within; the t interval is not.
        ratios = [1.0, 1.005, 0.995, 1.002, 0.998, 1.001, 0.999, 1.003, 0.997, 1.0, 1.25, 1.3]
        self.assertEqual(cw.median_verdict(ratios), "within")
        self.assertTrue(cw.verdict(ratios).startswith("undecided"), cw.verdict(ratios))

    def test_files_pool_into_rounds_numbered_on(self):
        first = [run("torch", [10.0], 0, G, G, FP), run("gpualloc", [10.0], 0, G, G, FP),
                 run("gpualloc#2", [22.0], 0, G, G, FP), run("torch#2", [20.0], 0, G, G, FP)]
        second = [run("torch", [10.0], 0, G, G, FP), run("gpualloc", [10.5], 0, G, G, FP)]
        got = [r["alloc"] for r in cw.pooled([first, second])]
        self.assertEqual(got, ["torch", "gpualloc", "gpualloc#2", "torch#2", "torch#3",
                               "gpualloc#3"])
        rows = {line.split(" | ")[1]: line for line in cw.repeat_summary(cw.pooled([first, second]))
                if line.startswith("| w1 ")}
        self.assertIn("| 1.000 / 1.100 / 1.050 |", rows["gpualloc"])
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for k, results in enumerate((first, second)):
                paths.append(os.path.join(d, "r%d.json" % k))
                with open(paths[-1], "w") as f:
                    json.dump(results, f)
            script = os.path.join(os.path.dirname(HERE), "examples", "compare_workloads.py")
            p = subprocess.run([sys.executable, script, "--from-json", ",".join(paths)],
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("| w1 | gpualloc | 3 |", p.stdout)


class MovesTest(unittest.TestCase):
    def moved_run(self, alloc, step_ms, moved):
        r = run(alloc, step_ms, 2, G, G, FP)
        r["unmapped_after_step"] = moved
        return r

    def test_steps_are_split_by_the_pages_they_moved(self):
        # Two warm-up steps (4 pages moved by then), four timed ones: steps 3 and 5 move
        # pages (4 -> 10, 10 -> 10, 10 -> 12, 12 -> 12), so 8 pages in the timed steps.
        # Ratios to torch's same steps: 12/10, 10/10, 33/30, 19/20.
        ours = self.moved_run("gpualloc", [50.0, 40.0, 12.0, 10.0, 33.0, 19.0],
                              [1, 4, 10, 10, 12, 12])
        ref = run("torch", [60.0, 45.0, 10.0, 10.0, 30.0, 20.0], 2, G, G, FP)
        with_moves, without, pages = cw.step_ratios_by_moves(ours, ref)
        self.assertEqual(pages, 8)
        self.assertEqual([round(x, 3) for x in with_moves], [1.2, 1.1])
        self.assertEqual([round(x, 3) for x in without], [1.0, 0.95])
        lines = cw.moves_summary([ref, ours])
        row = [line for line in lines if line.startswith("| w1 ")]
        self.assertEqual(row, ["| w1 | gpualloc | 1 | 2 of 4 | 8 | 1.150 | 0.975 |"])

    def test_each_round_pairs_with_its_own_reference_run(self):
        results = [
            run("torch", [9.0, 9.0, 10.0], 2, G, G, FP),
            self.moved_run("gpualloc", [9.0, 9.0, 30.0], [0, 0, 5]),
            run("torch#2", [9.0, 9.0, 20.0], 2, G, G, FP),
            self.moved_run("gpualloc#2", [9.0, 9.0, 30.0], [0, 0, 0]),
        ]
        rows = [line for line in cw.moves_summary(results) if line.startswith("| w1 ")]
        self.assertEqual(rows, ["| w1 | gpualloc | 1 | 1 of 1 | 5 | 3.000 | - |",
                                "| w1 | gpualloc | 2 | 0 of 1 | 0 | - | 1.500 |"])

    def test_nothing_without_per_step_counts(self):
        self.assertEqual(cw.moves_summary(RESULTS), [])
        # Counts that do not cover every step are not paired.
        ours = self.moved_run("gpualloc", [9.0, 9.0, 30.0], [0, 5])
        ref = run("torch", [9.0, 9.0, 10.0], 2, G, G, FP)
        self.assertIsNone(cw.step_ratios_by_moves(ours, ref))


class KernelTimeTest(unittest.TestCase):
    def test_the_step_splits_into_kernel_time_and_the_rest_per_run(self):
        ours = run("gpualloc#2", [50.0, 12.0, 10.0], 1, G, G, FP)
        ours.update(kernel_ms=[40.0, 9.0, 9.0], kernels=[900, 300, 302],
                    top_kernels=[{"name": "sm90_gemm", "ms_per_step": 4.5}])
        ref = run("torch", [50.0, 10.0, 10.0], 1, G, G, FP)
        ref.update(kernel_ms=[40.0, 9.0, 8.0], kernels=[900, 300, 300], top_kernels=[])
        rows = [line for line in cw.kernel_summary([ref, ours]) if line.startswith("| w1 ")]
        self.assertEqual(rows, ["| w1 | torch | 1 | 10.00 | 8.50 | 1.50 | 0.850 | 300 | - |",
                                "| w1 | gpualloc | 2 | 11.00 | 9.00 | 2.00 | 0.818 | 301 "
                                "| sm90_gemm 4.50 |"])
        self.assertIn("GPU time per step", cw.make_table([ref, ours]))

    def test_nothing_without_kernel_times_or_with_a_short_list(self):
        self.assertEqual(cw.kernel_summary(RESULTS), [])
        short = run("torch", [50.0, 10.0, 10.0], 1, G, G, FP)
        short["kernel_ms"] = [40.0, 9.0]
        self.assertEqual(cw.kernel_summary([short]), [])


class FakeCuda:
    """torch.cuda as the Meter reads it: 10 of 100 bytes in use."""

    @staticmethod
    def mem_get_info():
        return (90, 100)


class FakeTorch:
    cuda = FakeCuda


@contextlib.contextmanager
def time_calls(on):
    """GPUALLOC_TIME_CALLS=1 set (or unset) for the block, as the harness's child has it."""
    saved = os.environ.pop("GPUALLOC_TIME_CALLS", None)
    if on:
        os.environ["GPUALLOC_TIME_CALLS"] = "1"
    try:
        yield
    finally:
        os.environ.pop("GPUALLOC_TIME_CALLS", None)
        if saved is not None:
            os.environ["GPUALLOC_TIME_CALLS"] = saved


class CallTimesTest(unittest.TestCase):
    def timed_run(self):
        ours = run("gpualloc#2", [50.0, 10.0, 10.0], 1, G, G, FP)
        # Each step's calls (mallocs, frees, malloc ns, free ns): the warm-up step's 190
        # calls and 6 ms must not count.
        ours.update(calls_in_step=[[100, 90, 5_000_000, 1_000_000],
                                   [100, 100, 500_000, 200_000],
                                   [100, 100, 600_000, 300_000]])
        return ours

    def test_the_calls_of_the_timed_steps_and_their_share_of_the_step(self):
        # Timed steps: 100 + 100 calls in 0.7 ms, then 100 + 100 in 0.9 ms: 1.6 ms over
        # 400 calls is 4 us a call; 0.8 ms of a 10 ms mean step is 8%.
        rows = [line for line in cw.calls_summary([self.timed_run()]) if line.startswith("| w1 ")]
        self.assertEqual(rows, ["| w1 | gpualloc | 2 | 100 | 100 | 4.000 | 0.800 | 0.900 | 8.00% |"])
        self.assertIn("The library's own calls per timed step", cw.make_table([self.timed_run()]))

    def test_nothing_without_counters_or_with_a_short_list(self):
        self.assertEqual(cw.calls_summary(RESULTS), [])
        short = self.timed_run()
        short["calls_in_step"] = short["calls_in_step"][:2]
        self.assertEqual(cw.calls_summary([short]), [])

    def test_the_meter_reads_the_counters_once_a_step(self):
        reads = []

        def ours():
            n = len(reads)
            reads.append(n)
            return {"page_moves.pages_unmapped": n, "host_calls.malloc": 10 * n,
                    "host_calls.free": 10 * n, "host_calls.malloc_ns": 1000 * n,
                    "host_calls.free_ns": 500 * n}

        with time_calls(True):
            meter = cw.Meter(FakeTorch, ours)
        meter.step_done(cw.time.perf_counter())
        meter.step_done(cw.time.perf_counter())
        self.assertEqual(len(reads), 3)
        self.assertEqual(meter.calls_in_step, [[10, 10, 1000, 500], [10, 10, 1000, 500]])
        self.assertEqual(meter.unmapped_after_step, [1, 2])

        untimed = cw.Meter(FakeTorch, lambda: {"page_moves.pages_unmapped": 3})
        untimed.step_done(cw.time.perf_counter())
        self.assertIsNone(untimed.calls_now())
        self.assertEqual((untimed.calls_in_step, untimed.unmapped_after_step), ([], [3]))

    def test_steps_marked_inside_a_call_count_the_calls_between_their_marks(self):
        # Generation reads the counters at each token's forward; a round's first reading
        # (the prefill's) opens the first timed interval, and what runs between two rounds
        # lands in no step.
        meter = cw.Meter(FakeTorch)
        meter.add_calls([[5, 5, 50, 50], [7, 6, 80, 60], [10, 9, 120, 90]])
        meter.add_calls([[100, 100, 1000, 1000], [101, 101, 1010, 1005]])
        self.assertEqual(meter.calls_in_step, [[2, 1, 30, 10], [3, 3, 40, 30], [1, 1, 10, 5]])
        meter.add_calls([None, None])  # a library that does not time its calls
        self.assertEqual(len(meter.calls_in_step), 3)

    def test_counters_are_read_only_where_the_library_times_its_calls(self):
        reads = []

        def ours():
            reads.append(1)
            return {k: 1 for k in cw.CALL_KEYS}

        with time_calls(False):
            self.assertIsNone(cw.Meter(FakeTorch, ours=ours).calls_now())
        self.assertEqual(reads, [])  # a plain run reads nothing inside its steps
        with time_calls(True):
            self.assertEqual(cw.Meter(FakeTorch, ours=ours).calls_now(), [1, 1, 1, 1])


class PickTest(unittest.TestCase):
    def test_a_conf_with_commas_stays_one_allocator(self):
        got = cw._pick("torch,gpualloc:expandable_segments:True,unmap_free_pages:True,torch-async",
                       cw.DEFAULT_ALLOCS, cw.DEFAULT_ALLOCS)
        self.assertEqual(got, ["torch", "gpualloc:expandable_segments:True,unmap_free_pages:True",
                               "torch-async"])

    def test_plain_lists_default_and_all(self):
        self.assertEqual(cw._pick("resnet50_train, gpt2_train", cw.DEFAULT_WORKLOADS, cw.WORKLOADS),
                         ["resnet50_train", "gpt2_train"])
        self.assertEqual(cw._pick(None, cw.DEFAULT_WORKLOADS, cw.WORKLOADS), cw.DEFAULT_WORKLOADS)
        self.assertEqual(cw._pick("all", cw.DEFAULT_WORKLOADS, cw.WORKLOADS), list(cw.WORKLOADS))
        self.assertEqual(cw._pick("torch:a:1,torch-async", [], []), ["torch:a:1", "torch-async"])

    def test_cpu_lists(self):
        self.assertEqual(cw.parse_cpus("2-5,8"), [2, 3, 4, 5, 8])
        self.assertEqual(cw.parse_cpus("3, 1,3"), [1, 3])
        for bad in ("", "a", "5-2", "-1", "2-"):
            with self.assertRaises(Exception, msg=bad):
                cw.parse_cpus(bad)
        self.assertIsNone(cw.pinned_to(None))

    def test_pinned_child_runs_on_the_given_cpu(self):
        cpu = sorted(os.sched_getaffinity(0))[-1]
        p = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                           capture_output=True, text=True, preexec_fn=cw.pinned_to([cpu]), check=True)
        self.assertEqual(p.stdout.strip(), str([cpu]))


    def test_cpu_lists_a_run_of_the_round(self):
        self.assertEqual(cw.parse_cpu_lists("2-3;5"), [[2, 3], [5]])
        self.assertEqual(cw.parse_cpu_lists("1"), [[1]])
        with self.assertRaises(Exception):
            cw.parse_cpu_lists("2-3;")


# A child that stands in for a workload's: it sleeps, then prints the RESULT line with what
# it saw (its GPU variable, its CPUs, when it ran).
FAKE_CHILD = """
import json, os, sys, time
t0 = time.time()
time.sleep(0.4)
print("RESULT " + json.dumps({"workload": sys.argv[1], "alloc": sys.argv[2],
    "seen_gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "seen_cpus": sorted(os.sched_getaffinity(0)), "t0": t0, "t1": time.time()}))
"""


class SideBySideTest(unittest.TestCase):
    def test_a_round_is_one_group_in_its_rotated_order(self):
        allocs = cw.with_repeats(["torch", "gpualloc:budget"], 3)
        self.assertEqual(cw.run_groups(allocs, True),
                         [["torch", "gpualloc:budget"], ["gpualloc:budget#2", "torch#2"],
                          ["torch#3", "gpualloc:budget#3"]])
        self.assertEqual(cw.run_groups(allocs, False), [[a] for a in allocs])

    def test_the_runs_of_a_round_overlap_each_on_its_gpu_and_cpus(self):
        cpus = sorted(os.sched_getaffinity(0))
        lists = [[cpus[0]], [cpus[-1]]]
        args = argparse_namespace(side_by_side=True, cpus=lists)
        with fake_child():
            got = cw.run_group("w1", ["torch#2", "gpualloc#2"], args)
        self.assertEqual([r["alloc"] for r in got], ["torch#2", "gpualloc#2"])
        self.assertEqual([r["seen_gpu"] for r in got], ["0", "1"])
        self.assertEqual([r["gpu"] for r in got], [0, 1])
        self.assertEqual([r["seen_cpus"] for r in got], lists)
        # at the same time: each started before the other ended
        self.assertLess(got[0]["t0"], got[1]["t1"])
        self.assertLess(got[1]["t0"], got[0]["t1"])

    def test_alone_a_run_keeps_the_gpu_it_was_given(self):
        args = argparse_namespace(side_by_side=False, cpus=None)
        with fake_child(), mock_env("CUDA_VISIBLE_DEVICES", "7"):
            got = cw.run_group("w1", ["torch"], args)
        self.assertEqual(got[0]["seen_gpu"], "7")
        self.assertNotIn("gpu", got[0])

    def test_cpus_must_match_the_round(self):
        with self.assertRaises(SystemExit):
            cw.main(["vit_varbatch_infer", "torch,gpualloc", "--side-by-side", "--cpus", "1-2"])
        with self.assertRaises(SystemExit):
            cw.main(["vit_varbatch_infer", "torch,gpualloc", "--cpus", "1;2"])


def argparse_namespace(**kw):
    base = dict(deterministic=False, steps=None, kernel_time=False, timeout=30)
    base.update(kw)
    return types.SimpleNamespace(**base)


@contextlib.contextmanager
def mock_env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


@contextlib.contextmanager
def fake_child():
    """run_child starts FAKE_CHILD instead of a workload's child."""
    real = cw.child_command
    cw.child_command = lambda w, a, *rest: [sys.executable, "-c", FAKE_CHILD, w, a]
    try:
        yield
    finally:
        cw.child_command = real


class ChildCommandTest(unittest.TestCase):
    def test_steps_and_determinism_reach_the_child(self):
        cmd = cw.child_command("gpt2_train", "torch", deterministic=True, steps=60)
        self.assertEqual(cmd[2:5], ["--child", "gpt2_train", "torch"])
        self.assertEqual(cw.child_args(cmd[5:]),
                         {"deterministic": True, "steps": 60, "kernel_time": False})
        plain = cw.child_command("resnet50_train", "gpualloc")
        self.assertEqual(cw.child_args(plain[5:]),
                         {"deterministic": False, "steps": None, "kernel_time": False})
        timed = cw.child_command("gpt2_train", "torch", kernel_time=True)
        self.assertTrue(cw.child_args(timed[5:])["kernel_time"])

    def test_steps_must_leave_a_timed_step(self):
        with self.assertRaises(SystemExit):
            cw.main(["gpt2_train", "torch", "--steps", "4"])

if __name__ == "__main__":
    unittest.main(verbosity=2)
