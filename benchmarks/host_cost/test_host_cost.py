"""CPU test of host_cost.py's table (no torch, no GPU): python3 benchmarks/host_cost/test_host_cost.py"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_cost  # noqa: E402


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


if __name__ == "__main__":
    unittest.main(verbosity=2)
