"""CPU tests of the budget harness's plain-Python parts (no torch, no GPU):
    python3 benchmarks/budget/test_budget.py"""
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import types
import unittest
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import budget  # noqa: E402

GIB = 2**30


def result(alloc, batch, rate, reserved, moved=None, budget=10 * GIB, rnd=None, per_step=None):
    row = {"budget": budget, "batch": batch, "rate": rate, "peak_reserved": reserved,
           "peak_allocated": reserved // 2}
    if moved is not None:
        row["page_moves"] = {"pages_unmapped": moved}
    if per_step is not None:
        row["moves_per_step"] = per_step
    r = {"workload": "llama_varlen_train", "alloc": alloc, "unit": "tokens", "budgets": [row]}
    if rnd is not None:
        r["round"] = rnd
    return r


def fake_torch():
    """What run_batch uses of torch: its out-of-memory error and two no-op calls."""

    class OutOfMemoryError(RuntimeError):
        pass

    return types.SimpleNamespace(
        OutOfMemoryError=OutOfMemoryError,
        cuda=types.SimpleNamespace(synchronize=lambda: None, empty_cache=lambda: None))


def line_of(table, alloc, budget_gib=None):
    return [l for l in table.splitlines() if ("| %s |" % alloc) in l
            and (budget_gib is None or ("| %.2f |" % budget_gib) in l)][0]


def child_result(workload, alloc, budgets, allocated):
    """What a child reports: the calibration's peaks (no budgets), else batch 8 at every
    budget."""
    if not budgets:
        return {"workload": workload, "alloc": alloc, "ok": True, "batch": 64,
                "peak_allocated": allocated, "peak_reserved": 3 * GIB}
    return {"workload": workload, "alloc": alloc, "unit": "images", "budgets": [
        {"budget": b, "batch": 8, "rate": 10.0, "peak_reserved": b} for b in budgets]}


def main_with(fake_child, argv):
    """budget.main(argv) with its children replaced by `fake_child`: the results it wrote."""
    saved = budget.run_child, budget.cw.prebuild_bridge
    budget.run_child, budget.cw.prebuild_bridge = fake_child, lambda timeout: None
    try:
        with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(io.StringIO()):
            budget.main(argv + ["--out", d])
            with open(os.path.join(d, "budget.json")) as f:
                return json.load(f)
    finally:
        budget.run_child, budget.cw.prebuild_bridge = saved


class BudgetTests(unittest.TestCase):
    def test_budgets_lie_between_allocated_and_reserved(self):
        self.assertEqual(budget.budgets_between(100, 200, [0.25, 0.5, 0.75]), [125, 150, 175])

    def test_batches_run_from_twice_the_reference_down_by_eighths(self):
        self.assertEqual(budget.batches_from(8), list(range(16, 0, -1)))
        got = budget.batches_from(64)
        self.assertEqual((got[0], got[1], got[-1]), (128, 120, 8))
        self.assertEqual(budget.batches_from(1), [2, 1])

    def test_the_largest_batch_that_runs_searched_down_then_up(self):
        def runs_up_to(limit):
            seen = []

            def run(batch):
                seen.append(batch)
                return batch <= limit, {"rate": float(batch)}
            return run, seen

        # Below twice the reference: downwards by eighths, the first that runs.
        run, seen = runs_up_to(13)
        batch, res, tried, capped = budget.largest_batch(8, run)
        self.assertEqual((batch, res["rate"], capped), (13, 13.0, False))
        self.assertEqual(seen, [16, 15, 14, 13])
        self.assertEqual([t[:2] for t in tried], [(16, False), (15, False), (14, False),
                                                  (13, True)])
        # Twice the reference runs: upwards by quarters until one fails; the result kept
        # is the largest batch's that ran.
        run, seen = runs_up_to(150)
        batch, res, tried, capped = budget.largest_batch(64, run)
        self.assertEqual((batch, res["rate"], capped), (144, 144.0, False))
        self.assertEqual(seen, [128, 144, 160])
        # Up to CEILING times the reference: the budget did not bind.
        run, seen = runs_up_to(10**6)
        batch, res, tried, capped = budget.largest_batch(8, run)
        self.assertEqual((batch, capped), (budget.CEILING * 8, True))
        self.assertEqual(seen, [16, 18, 20, 22, 24, 26, 28, 30, 32])
        # None runs.
        run, seen = runs_up_to(0)
        self.assertEqual(budget.largest_batch(2, run), (0, None, [(4, False, {"rate": 4.0}),
                         (3, False, {"rate": 3.0}), (2, False, {"rate": 2.0}),
                         (1, False, {"rate": 1.0})], False))

    def test_probes_search_and_one_full_run_confirms(self):
        def fits(limit, seen, tag):
            def go(batch):
                seen.append((tag, batch))
                return batch <= limit, {"rate": float(batch), "error": None}
            return go

        # The probes find 144 (160 fails): one full run, at 144.
        seen = []
        batch, res, tried, capped = budget.largest_batch(
            64, fits(150, seen, "run"), fits(150, seen, "probe"))
        self.assertEqual((batch, res["rate"], capped), (144, 144.0, False))
        self.assertEqual(seen, [("probe", 128), ("probe", 144), ("probe", 160), ("run", 144)])
        self.assertEqual([(b, k, bool(r.get("probe"))) for b, k, r in tried],
                         [(128, True, True), (144, True, True), (160, False, True),
                          (144, True, False)])
        # A batch whose probe runs but whose full run fails: down the ladder in full
        # runs, the answer the full search gives.
        seen = []
        batch, res, tried, capped = budget.largest_batch(
            64, fits(130, seen, "run"), fits(150, seen, "probe"))
        self.assertEqual((batch, capped), (128, False))
        self.assertEqual(seen[-2:], [("run", 144), ("run", 128)])
        self.assertEqual(batch, budget.largest_batch(64, fits(130, [], "run"))[0])
        # Below the reference: down by eighths, from the probe's answer on.
        seen = []
        batch, _, _, _ = budget.largest_batch(8, fits(11, seen, "run"), fits(13, seen, "probe"))
        self.assertEqual(batch, 11)
        self.assertEqual([b for t, b in seen if t == "run"], [13, 12, 11])
        # Capped only if the full run at the ceiling runs; nothing runs: batch 0.
        b, _, _, capped = budget.largest_batch(8, fits(10**6, [], "run"), fits(10**6, [], "p"))
        self.assertEqual((b, capped), (32, True))
        b, _, _, capped = budget.largest_batch(8, fits(31, [], "run"), fits(10**6, [], "p"))
        self.assertEqual((b, capped), (30, False))
        self.assertEqual(budget.largest_batch(8, fits(0, [], "run"), fits(3, [], "p"))[:2],
                         (0, None))

    def test_a_budget_that_did_not_bind_is_marked(self):
        capped = result("gpualloc:budget", 32, 900.0, 9 * GIB)
        capped["budgets"][0]["capped"] = True
        table = budget.make_table([result("torch", 30, 800.0, 9 * GIB), capped])
        self.assertIn("| gpualloc:budget | 1 | 32+ |", table)
        self.assertIn("| torch | 1 | 30 |", table)
        self.assertIn("+: 4 times the reference batch ran too", table)
        self.assertNotIn("+: ", budget.make_table([result("torch", 30, 800.0, 9 * GIB)]))

    def test_a_child_out_of_time_keeps_the_budgets_it_finished(self):
        # A child that finished one budget, printed it, and hung in the next.
        done = result("gpualloc:budget", 9, 1100.0, 9 * GIB)
        code = ("import json, sys, time\n"
                "print('PARTIAL ' + json.dumps(%r), flush=True)\n"
                "time.sleep(60)\n" % (done,))
        res = budget.cw.child_result([sys.executable, "-c", code], dict(os.environ), 3,
                                     "llama_varlen_train", "gpualloc:budget")
        self.assertEqual(res["error"], "timeout after 3 s")
        self.assertEqual(res["budgets"], done["budgets"])
        table = budget.make_table([result("torch", 8, 1000.0, 9 * GIB), res])
        self.assertIn("| gpualloc:budget | 1 | 9 | 1100 tokens |", table)
        self.assertIn("- FAILED llama_varlen_train / gpualloc:budget / round 1: timeout after "
                      "3 s", table)
        # Nothing printed (or a line cut off): the error alone, as before.
        self.assertIsNone(budget.cw.last_partial(b""))
        self.assertIsNone(budget.cw.last_partial(b'PARTIAL {"budg'))
        self.assertEqual(budget.cw.last_partial(b'x\nPARTIAL {"a": 1}\nPARTIAL {"a": 2}\n'),
                         {"a": 2})

    def test_old_json_without_rounds_still_renders(self):
        # A JSON of one pass, as written before rounds: no round field, cumulative page
        # moves only, and the calibration run without budgets.
        rows = [{"workload": "llama_varlen_train", "alloc": "torch", "ok": True, "batch": 8},
                result("torch", 8, 1000.0, 9 * GIB),
                result("gpualloc:budget", 10, 1300.0, 10 * GIB, moved=12),
                result("torch-expandable", 0, None, 3 * GIB)]
        table = budget.make_table(rows)
        line = line_of(table, "gpualloc:budget")
        self.assertEqual(line, "| llama_varlen_train | 10.00 | gpualloc:budget | 1 | 10 | "
                               "1300 tokens | - | 1.30x | 1.30x | 10.00 |  |  |")
        none = line_of(table, "torch-expandable")
        self.assertIn("| 1 (0 with a rate) | none | - | - | - | - |", none)
        self.assertIn("- llama_varlen_train, gpualloc:budget: largest batch >= "
                      "torch-expandable's and > torch's at 1 of 1 budgets (in every round); "
                      "mean rate >= 1.2x torch's at 1 of 1", table)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "old.json")
            with open(path, "w") as f:
                json.dump(rows, f)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                self.assertEqual(budget.main(["--from-json", path]), 0)
            self.assertEqual(out.getvalue(), table)

    def two_rounds(self):
        small = 4 * GIB
        return [
            result("torch", 8, 1000.0, 9 * GIB, rnd=1),
            result("torch-expandable", 9, 1100.0, 9 * GIB, rnd=1),
            result("gpualloc:budget", 10, 1500.0, 10 * GIB, rnd=1,
                   per_step={"page_moves.pages_unmapped": 4.0, "stream_ops.host_waits": 1.0}),
            result("torch", 4, 500.0, 4 * GIB, budget=small, rnd=1),
            result("torch-expandable", 5, 600.0, 4 * GIB, budget=small, rnd=1),
            result("gpualloc:budget", 5, 700.0, 4 * GIB, budget=small, rnd=1, per_step={}),
            # round 2, in the rotated order
            result("torch-expandable", 9, 1000.0, 9 * GIB, rnd=2),
            result("gpualloc:budget", 9, 1320.0, 11 * GIB, rnd=2,
                   per_step={"page_moves.pages_unmapped": 2.0, "stream_ops.host_waits": 0.0}),
            result("torch", 8, 1200.0, 9 * GIB, rnd=2),
            result("torch-expandable", 5, 600.0, 4 * GIB, budget=small, rnd=2),
            result("gpualloc:budget", 4, 540.0, 4 * GIB, budget=small, rnd=2, per_step={}),
            result("torch", 4, 500.0, 4 * GIB, budget=small, rnd=2),
        ]

    def test_two_rounds_mean_spread_and_both_ratios(self):
        rows = {(r["budget"] // GIB, r["alloc"]): r for r in budget.summarize(self.two_rounds())}
        ours = rows[(10, "gpualloc:budget")]
        self.assertEqual(ours["batches"], {1: 10, 2: 9})
        self.assertEqual((ours["rate_mean"], ours["rate_min"], ours["rate_max"]),
                         (1410.0, 1320.0, 1500.0))
        # ratio of the means 1410 / 1100; mean of the ratios (1500/1000 + 1320/1200) / 2
        self.assertAlmostEqual(ours["ratio_of_means"], 1410.0 / 1100.0)
        self.assertAlmostEqual(ours["mean_of_ratios"], 1.3)
        self.assertEqual((ours["pages_per_step"], ours["host_waits_per_step"]), (3.0, 0.5))
        self.assertEqual(ours["peak_reserved"], 11 * GIB)
        exp = rows[(10, "torch-expandable")]
        self.assertAlmostEqual(exp["ratio_of_means"], 1050.0 / 1100.0)
        self.assertAlmostEqual(exp["mean_of_ratios"], (1.1 + 1000.0 / 1200.0) / 2)
        self.assertIsNone(exp["pages_per_step"])
        self.assertEqual(rows[(4, "gpualloc:budget")]["pages_per_step"], 0)

        table = budget.make_table(self.two_rounds())
        self.assertEqual(line_of(table, "gpualloc:budget", 10),
                         "| llama_varlen_train | 10.00 | gpualloc:budget | 2 | 9-10 | "
                         "1410 tokens | 1320-1500 | 1.28x | 1.30x | 11.00 | 3.00 | 0.50 |")
        self.assertEqual(line_of(table, "torch-expandable", 10),
                         "| llama_varlen_train | 10.00 | torch-expandable | 2 | 9 | "
                         "1050 tokens | 1000-1100 | 0.95x | 0.97x | 9.00 |  |  |")
        self.assertIn("| 4.00 | gpualloc:budget | 2 | 4-5 | 620 tokens | 540-700 | 1.24x "
                      "| 1.24x |", table)
        # Budgets ascending; at 4 GiB round 2's batch (4) is below torch-expandable's (5).
        self.assertLess(table.index("| 4.00 |"), table.index("| 10.00 |"))
        self.assertIn("- llama_varlen_train, gpualloc:budget: largest batch >= "
                      "torch-expandable's and > torch's at 1 of 2 budgets (in every round); "
                      "mean rate >= 1.2x torch's at 2 of 2; with 95% confidence (the "
                      "per-round ratios' interval at or above it) at 0 of 2", table)
        # Two rounds of 1.5x and 1.1x: a geometric mean of 1.28x, an interval far wider.
        mean, low, high = ours["ratio_interval"]
        self.assertAlmostEqual(mean, (1.5 * 1.1) ** 0.5)
        self.assertLess(low, 1.0)
        self.assertGreater(high, 2.0)

    def test_batches_of_disagreeing_rounds_show_their_range(self):
        self.assertEqual(budget.batch_text({1: 8, 2: 8}), "8")
        self.assertEqual(budget.batch_text({1: 8, 2: 7, 3: 8}), "7-8")
        self.assertEqual(budget.batch_text({1: 0, 2: 0}), "none")
        self.assertEqual(budget.batch_text({1: 0, 2: 3}), "0-3")

    def test_rounds_rotate_the_allocators(self):
        allocs = ["torch", "torch-expandable", "gpualloc:budget"]
        self.assertEqual(budget.cw.round_order(allocs, 1), allocs)
        self.assertEqual(budget.cw.round_order(allocs, 2),
                         ["torch-expandable", "gpualloc:budget", "torch"])
        self.assertEqual(budget.cw.round_order(allocs, 3),
                         ["gpualloc:budget", "torch", "torch-expandable"])
        self.assertEqual(budget.cw.round_order(allocs, 4), allocs)

    def test_main_calibrates_once_then_runs_rounds_rotated_and_pinned(self):
        calls = []

        def fake_child(workload, alloc, budgets, steps, timeout, cpus=None, profile=0,
                       snapshot=None, gpu=None):
            calls.append((workload, alloc, tuple(budgets), cpus))
            self.assertEqual(profile, 0)
            self.assertIsNone(snapshot)
            return child_result(workload, alloc, budgets, GIB)

        saved_results = main_with(fake_child, [
            "vit_varbatch_infer", "torch,gpualloc:budget", "--rounds", "2", "--cpus", "2-3,5",
            "--shares", "0.5"])
        two = (2 * GIB,)
        self.assertEqual(calls, [
            ("vit_varbatch_infer", "torch", (), [2, 3, 5]),
            ("vit_varbatch_infer", "torch", two, [2, 3, 5]),
            ("vit_varbatch_infer", "gpualloc:budget", two, [2, 3, 5]),
            ("vit_varbatch_infer", "gpualloc:budget", two, [2, 3, 5]),
            ("vit_varbatch_infer", "torch", two, [2, 3, 5])])
        self.assertEqual([(r["alloc"], r["round"]) for r in saved_results], [
            ("torch", 0), ("torch", 1), ("gpualloc:budget", 1), ("gpualloc:budget", 2),
            ("torch", 2)])
        self.assertTrue(saved_results[0]["calibration"])

    def test_probe_steps_reach_the_children_through_their_environment(self):
        seen = []

        def fake_child(workload, alloc, budgets, steps, timeout, cpus=None, profile=0,
                       snapshot=None, gpu=None):
            seen.append(os.environ.get(budget.PROBE_ENV))
            return child_result(workload, alloc, budgets, GIB)

        saved = os.environ.get(budget.PROBE_ENV)
        try:
            main_with(fake_child, ["gpt2_generate", "torch", "--probe-steps", "1",
                                   "--shares", "0.5"])
            self.assertEqual(seen, ["1", "1"])
            main_with(fake_child, ["gpt2_generate", "torch", "--shares", "0.5"])
            self.assertEqual(seen[2:], ["0", "0"])
        finally:
            os.environ.pop(budget.PROBE_ENV, None)
            if saved is not None:
                os.environ[budget.PROBE_ENV] = saved

    def test_side_by_side_runs_a_round_at_once_each_on_its_gpu_and_cpus(self):
        calls, lock = [], threading.Lock()
        meet = threading.Barrier(2, timeout=10)

        def fake_child(workload, alloc, budgets, steps, timeout, cpus=None, profile=0,
                       snapshot=None, gpu=None):
            if budgets:  # not the calibration, which runs alone on GPU 0
                meet.wait()  # a BrokenBarrierError here: the round did not run at once
            with lock:
                calls.append((int(bool(budgets)), alloc, gpu, cpus))
            return child_result(workload, alloc, budgets, GIB)

        saved_results = main_with(fake_child, [
            "vit_varbatch_infer", "torch,gpualloc:budget", "--rounds", "2", "--side-by-side",
            "--cpus", "2-3;4-5", "--shares", "0.5"])
        self.assertEqual(calls[0], (0, "torch", 0, [2, 3]))
        by_gpu = {(a, g): c for _, a, g, c in calls[1:]}
        # round 1: torch on GPU 0, round 2 rotated: gpualloc on GPU 0
        self.assertEqual(by_gpu, {("torch", 0): [2, 3], ("gpualloc:budget", 1): [4, 5],
                                  ("gpualloc:budget", 0): [2, 3], ("torch", 1): [4, 5]})
        self.assertEqual([(r["alloc"], r["round"]) for r in saved_results], [
            ("torch", 0), ("torch", 1), ("gpualloc:budget", 1), ("gpualloc:budget", 2),
            ("torch", 2)])

    def test_no_limit_rates_run_the_fitted_batches_after_each_round(self):
        calls = []
        fitted = {"torch": 6, "gpualloc:budget": 8}

        def fake_child(workload, alloc, budgets, steps, timeout, cpus=None, profile=0,
                       snapshot=None, gpu=None):
            calls.append((alloc, budgets))
            if isinstance(budgets, dict):  # no limit: rate 100 a sequence of the batch
                return {"workload": workload, "alloc": alloc, "unit": "tokens",
                        "device": "d", "no_limit": [
                            {"batch": b, "ok": True, "rate": 100.0 * b,
                             "peak_allocated": b * GIB // 4} for b in budgets["batches"]]}
            res = child_result(workload, alloc, budgets, GIB)
            for b in res.get("budgets", []):
                b["batch"] = fitted[alloc]
                b["rate"] = {"torch": 500.0, "gpualloc:budget": 720.0}[alloc]
            return res

        saved = main_with(fake_child, ["llama_varlen_train", "torch,gpualloc:budget",
                                       "--rounds", "2", "--shares", "0.5",
                                       "--no-limit-rates"])
        # After each round's two children, one no-limit child of the batches they fitted
        # and the next batch of the ladder above each.
        self.assertEqual([c for c in calls if isinstance(c[1], dict)],
                         [("torch", {"batches": [6, 7, 8, 9]})] * 2)
        self.assertEqual([(r["alloc"], r["round"], "no_limit" in r) for r in saved[1:4]],
                         [("torch", 1, False), ("gpualloc:budget", 1, False),
                          ("torch", 1, True)])
        table = budget.make_table(saved)
        # gpualloc at batch 8: 720 of 800 with no limit; torch at 6: 500 of 600.
        self.assertIn("| llama_varlen_train | 2.00 | gpualloc:budget | 8 | 720 | 800 | 0.900 |",
                      table)
        self.assertIn("| llama_varlen_train | 2.00 | torch | 6 | 500 | 600 | 0.833 |", table)
        # The most a larger batch gives there: 800 (batch 8, no limit) over torch's 500.
        self.assertIn("- llama_varlen_train at 2.00 GiB: a larger batch can give at most "
                      "1.60x torch's rate (>= 1.2x)", table)
        # Batch 9, the next above the largest fitted (8), allocates 9/4 GiB with no limit:
        # above the 2 GiB budget, so no allocator could fit it.
        self.assertIn("- llama_varlen_train at 2.00 GiB, round 1: batch 9 (the next above the "
                      "largest fitted, 8) allocates 2.25 GiB with no limit: above the budget, "
                      "no allocator fits it", table)
        # The no-limit runs add no row to the main table.
        self.assertEqual(table.count("| llama_varlen_train | 2.00 | torch | 2 |"), 1)
        self.assertEqual(budget.no_limit_lines(saved[:3], budget.summarize(saved[:3])), [])

    def test_the_next_batch_follows_the_search_ladder(self):
        self.assertEqual(budget.next_batch(8, 6), 7)
        self.assertEqual(budget.next_batch(64, 112), 120)  # eighths below twice the reference
        self.assertEqual(budget.next_batch(64, 128), 144)  # quarters above it
        self.assertIsNone(budget.next_batch(64, 256))  # the ladder's top
        self.assertEqual(budget.no_limit_batches("gpt2_generate", [
            result("torch", 80, 1.0, GIB), result("gpualloc:budget", 224, 1.0, GIB)]),
            [80, 88, 224, 240])
        # Within the budget: an allocator could fit it.
        rows = [result("torch", 6, 500.0, 2 * GIB, budget=2 * GIB, rnd=1)]
        rows.append({"workload": "llama_varlen_train", "alloc": "torch", "round": 1,
                     "no_limit": [{"batch": 7, "ok": True, "rate": 1.0,
                                   "peak_allocated": GIB}]})
        self.assertEqual(budget.next_batch_lines(rows, budget.summarize(rows)), [
            "- llama_varlen_train at 2.00 GiB, round 1: batch 7 (the next above the largest "
            "fitted, 6) allocates 1.00 GiB with no limit: within the budget, an allocator "
            "could fit it"])

    def test_side_by_side_needs_a_cpu_list_an_allocator(self):
        with contextlib.redirect_stderr(io.StringIO()):
            with self.assertRaises(SystemExit):
                budget.main(["vit_varbatch_infer", "torch,gpualloc:budget", "--side-by-side",
                             "--cpus", "2-3"])
            with self.assertRaises(SystemExit):
                budget.main(["vit_varbatch_infer", "torch,gpualloc:budget", "--cpus", "2;3"])

    def test_snapshot_steps_reach_the_calibration_alone(self):
        calls = []

        def fake_child(workload, alloc, budgets, steps, timeout, cpus=None, profile=0,
                       snapshot=None, gpu=None):
            calls.append((alloc, tuple(budgets), snapshot))
            return {"workload": workload, "alloc": alloc, "ok": True, "batch": 8,
                    "peak_allocated": GIB, "peak_reserved": 2 * GIB}

        saved = budget.run_child
        budget.run_child = fake_child
        try:
            with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(io.StringIO()):
                budget.main(["fsdp2_varlen_train", "torch", "--rounds", "0",
                             "--snapshot-steps", "4", "--out", d])
                path = os.path.join(os.path.abspath(d), "fsdp2_varlen_train.snapshot.pickle")
        finally:
            budget.run_child = saved
        self.assertEqual(calls, [("torch", (), (4, path))])
        with mock.patch.object(budget.cw.subprocess, "run") as run:
            run.return_value = types.SimpleNamespace(returncode=1, stdout="", stderr="x")
            budget.run_child("w", "torch", [], 0, 5, snapshot=(4, "/o/w.pickle"))
        self.assertEqual(run.call_args[0][0][-4:], ["0", "0", "4", "/o/w.pickle"])

    def test_profile_steps_keeps_the_heaviest_ops_per_step(self):
        seen = []

        class Event:
            def __init__(self, key, count, self_us, total_us, device="cpu", device_us=0.0):
                self.key, self.count = key, count
                self.self_cpu_time_total, self.cpu_time_total = self_us, total_us
                self.device_type, self.self_device_time_total = device, device_us

        class Profile:
            def __init__(self, activities):
                seen.append(("activities", activities))

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def events(self):
                return [types.SimpleNamespace(
                    name=name, time_range=types.SimpleNamespace(elapsed_us=lambda us=us: us))
                    for name, us in [("gpualloc::malloc", 2.0), ("aten::add", 9.0),
                                     ("gpualloc::malloc", 400.0), ("gpualloc::malloc", 3.0),
                                     ("gpualloc::free", 1.0)]]

            def key_averages(self):
                return [Event("aten::empty_strided", 40, 800.0, 900.0),
                        Event("cudaLaunchKernel", 100, 2000.0, 2000.0),
                        Event("aten::add", 20, 100.0, 300.0, device_us=7000.0),
                        Event("add_kernel", 20, 0.0, 0.0, "gpu", 6000.0),
                        Event("gemm", 4, 0.0, 0.0, "gpu", 2000.0)]

        torch = types.SimpleNamespace(
            profiler=types.SimpleNamespace(
                profile=Profile, ProfilerActivity=types.SimpleNamespace(CPU="cpu", CUDA="cuda")),
            autograd=types.SimpleNamespace(DeviceType=types.SimpleNamespace(CUDA="gpu")),
            cuda=types.SimpleNamespace(synchronize=lambda: seen.append("sync")))
        steps = []
        saved = budget.PROFILE_TOP
        budget.PROFILE_TOP = 2
        try:
            prof = budget.profile_steps(torch, lambda b, i: steps.append((b, i)), 6, 3, 4)
        finally:
            budget.PROFILE_TOP = saved
        self.assertEqual(steps, [(6, 0), (6, 1), (6, 2), (6, 0)])
        self.assertEqual(seen, [("activities", ["cpu", "cuda"])] + ["sync"] * 4)
        self.assertEqual(prof["steps"], 4)
        self.assertEqual(prof["kernel_ms_per_step"], 2.0)  # the device entries alone, per step
        malloc = prof["allocator_calls"]["gpualloc::malloc"]
        self.assertEqual((malloc["calls"], malloc["p50_us"], malloc["max_us"],
                          malloc["slow_calls"]), (3, 3.0, 400.0, 1))
        self.assertAlmostEqual(malloc["slow_share"], 400.0 / 405.0)
        self.assertEqual(sorted(prof["allocator_calls"]), ["gpualloc::free", "gpualloc::malloc"])
        self.assertEqual(prof["top"], [
            {"name": "cudaLaunchKernel", "calls": 25.0, "self_cpu_us": 500.0, "cpu_us": 500.0},
            {"name": "aten::empty_strided", "calls": 10.0, "self_cpu_us": 200.0,
             "cpu_us": 225.0}])

    def test_profile_table_joins_each_allocators_heaviest_ops(self):
        def run(alloc, top, wall):
            return {"workload": "w", "alloc": alloc, "round": 1, "budgets": [
                {"budget": 2 * GIB, "batch": 8, "rate": 1.0,
                 "profile": {"steps": 5, "wall_ms_per_step": wall,
                             "kernel_ms_per_step": wall - 2, "top": [
                     {"name": n, "calls": 1, "self_cpu_us": us, "cpu_us": us}
                     for n, us in top]}}]}

        results = [run("gpualloc:budget", [("a", 50.0), ("b", 40.0), ("c", 30.0)], 12.5),
                   run("torch", [("c", 60.0), ("d", 45.0), ("a", 10.0)], 10.0),
                   {"workload": "w", "alloc": "torch", "round": 2, "budgets": [
                       {"budget": 2 * GIB, "profile": {"steps": 5, "wall_ms_per_step": 99.0,
                                                       "top": [{"name": "z", "calls": 1,
                                                                "self_cpu_us": 999.0,
                                                                "cpu_us": 999.0}]}}]}]
        self.assertEqual(budget.profile_tables(results, shown=2), [
            "", "Host time per step under torch.profiler, w at 2.00 GiB (self CPU us; "
            "profiled steps ran torch 10.0 (8.0), gpualloc:budget 12.5 (10.5) ms each, of which "
            "kernels):", "",
            "| op | torch | gpualloc:budget |", "|---|---:|---:|",
            "| c | 60 | 30 |", "| a | 10 | 50 |", "| d | 45 | - |", "| b | - | 40 |"])
        no_profile = {"workload": "w", "alloc": "torch", "budgets": [{"budget": GIB}]}
        self.assertEqual(budget.profile_tables([no_profile]), [])

    def test_the_librarys_own_calls_per_timed_step(self):
        rows = self.two_rounds()
        rows[2]["budgets"][0]["moves_per_step"] = {
            "host_calls.malloc": 2000.0, "host_calls.malloc_ns": 4e6,
            "host_calls.free": 2000.0, "host_calls.free_ns": 1e6, "host_calls.malloc_slow": 3}
        lines = budget.host_call_lines(rows)
        self.assertEqual(lines[-1], "| llama_varlen_train | 10.00 | gpualloc:budget | 1 | 2000 "
                                    "| 2.00 | 0.50 | 5.00 | 3.0 |")
        self.assertEqual(len([l for l in lines if l.startswith("| llama")]), 1)
        self.assertIn("The library's own calls", budget.make_table(rows))
        self.assertEqual(budget.host_call_lines(self.two_rounds()), [])
        self.assertEqual(budget.moves_counters({"host_calls.malloc": 5, "x.y": 1}),
                         {"host_calls.malloc": 5})

    def test_counters_per_timed_step(self):
        stats = {"page_moves.rounds": 2, "stream_ops.host_waits": 1, "num_ooms": 3,
                 "num_device_alloc": 7, "num_alloc_retries": 1}
        self.assertEqual(budget.moves_counters(stats),
                         {"page_moves.rounds": 2, "stream_ops.host_waits": 1,
                          "num_device_alloc": 7, "num_alloc_retries": 1})
        self.assertEqual(
            budget.per_step_difference({"a": 10, "b": 5}, {"a": 16, "b": 5, "c": 3}, 3),
            {"a": 2.0, "b": 0.0, "c": 1.0})

    def test_a_batch_times_the_last_pass_after_its_warm_up(self):
        torch = fake_torch()
        seen = []

        def step(batch, i):
            seen.append(i)
            return batch

        ok, rate, mean_ms, err = budget.run_batch(torch, step, lambda: None, 4, 3, 1, passes=2)
        self.assertTrue(ok)
        self.assertIsNone(err)
        self.assertEqual(seen, [0, 1, 2, 0, 1, 2])
        self.assertGreater(rate, 0)

        def failing(batch, i):
            if i == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
            return batch

        resets = []
        ok, rate, _, err = budget.run_batch(torch, failing, lambda: resets.append(1), 4, 3, 1)
        self.assertEqual((ok, rate, len(resets)), (False, None, 1))
        self.assertIn("out of memory", err)

    def test_counters_cover_only_the_timed_steps_of_the_last_pass(self):
        torch = fake_torch()
        moved = {"page_moves.pages_unmapped": 0, "stream_ops.host_waits": 0}
        calls = []

        def step(batch, i):
            # call n (from 0) moves n + 1 pages and waits once on odd calls
            calls.append(i)
            moved["page_moves.pages_unmapped"] += len(calls)
            moved["stream_ops.host_waits"] += (len(calls) - 1) % 2
            return batch

        counters = budget.TimedCounters(lambda: dict(moved))
        # 3 steps, 2 passes, 1 warm-up: the timed steps are calls 4 and 5 (5 + 6 pages,
        # one wait), the first pass and the warm-up step left out.
        ok = budget.run_batch(torch, step, lambda: None, 4, 3, 1, passes=2, counters=counters)[0]
        self.assertTrue(ok)
        self.assertEqual(counters.per_step,
                         {"page_moves.pages_unmapped": 5.5, "stream_ops.host_waits": 0.5})

        def failing(batch, i):
            step(batch, i)
            if i == 0:  # the usual failure: the first step, before the timed ones
                raise torch.OutOfMemoryError("CUDA out of memory")
            return batch

        ok = budget.run_batch(torch, failing, lambda: None, 4, 3, 1, counters=counters)[0]
        self.assertFalse(ok)
        self.assertIsNone(counters.per_step)  # a failed batch leaves no figures

    def test_the_module_imports_without_torch(self):
        here = os.path.dirname(os.path.abspath(__file__))
        code = ("import sys; sys.modules['torch'] = None; sys.path.insert(0, %r); "
                "import budget; print(budget.child.__name__, budget.TimedCounters.__name__)"
                % here)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        self.assertEqual((out.returncode, out.stdout.strip()), (0, "child TimedCounters"),
                         out.stderr)

    def test_every_workload_has_a_builder(self):
        for name in budget.WORKLOADS:
            self.assertTrue(callable(getattr(budget, name)))


if __name__ == "__main__":
    unittest.main()
