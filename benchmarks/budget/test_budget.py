"""CPU tests of the budget harness's plain-Python parts (no torch, no GPU):
    python3 benchmarks/budget/test_budget.py"""
import os
import sys
import types
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import budget  # noqa: E402

GIB = 2**30


def result(alloc, batch, rate, reserved, moved=None):
    row = {"budget": 10 * GIB, "batch": batch, "rate": rate, "peak_reserved": reserved,
           "peak_allocated": reserved // 2}
    if moved is not None:
        row["page_moves"] = {"pages_unmapped": moved}
    return {"workload": "llama_varlen_train", "alloc": alloc, "unit": "tokens",
            "budgets": [row]}


class BudgetTests(unittest.TestCase):
    def test_budgets_lie_between_allocated_and_reserved(self):
        self.assertEqual(budget.budgets_between(100, 200, [0.25, 0.5, 0.75]), [125, 150, 175])

    def test_batches_run_from_twice_the_reference_down_by_eighths(self):
        self.assertEqual(budget.batches_from(8), list(range(16, 0, -1)))
        got = budget.batches_from(64)
        self.assertEqual((got[0], got[1], got[-1]), (128, 120, 8))
        self.assertEqual(budget.batches_from(1), [2, 1])

    def test_table_rates_each_allocator_against_pytorch_default_of_its_budget(self):
        rows = [result("torch", 8, 1000.0, 9 * GIB),
                result("gpualloc:budget", 10, 1300.0, 10 * GIB, moved=12),
                result("torch-expandable", 0, None, 3 * GIB)]
        table = budget.make_table(rows)
        line = [l for l in table.splitlines() if "gpualloc:budget" in l][0]
        self.assertIn("| 10 |", line)
        self.assertIn("1.30x", line)
        self.assertIn("| 12 |", line)
        none = [l for l in table.splitlines() if "torch-expandable" in l][0]
        self.assertIn("| none |", none)
        self.assertIn("| - |", none)

    def test_a_batch_times_the_last_pass_after_its_warm_up(self):
        class OutOfMemoryError(RuntimeError):
            pass

        torch = types.SimpleNamespace(
            OutOfMemoryError=OutOfMemoryError,
            cuda=types.SimpleNamespace(synchronize=lambda: None, empty_cache=lambda: None))
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
                raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
            return batch

        resets = []
        ok, rate, _, err = budget.run_batch(torch, failing, lambda: resets.append(1), 4, 3, 1)
        self.assertEqual((ok, rate, len(resets)), (False, None, 1))
        self.assertIn("out of memory", err)

    def test_every_workload_has_a_builder(self):
        for name in budget.WORKLOADS:
            self.assertTrue(callable(getattr(budget, name)))


if __name__ == "__main__":
    unittest.main()
