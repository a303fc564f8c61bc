#!/usr/bin/env python3
"""CPU tests of fake_world.py's run order, summary and table, with fake results (no torch):

    python3 benchmarks/fsdp/test_fake_world.py
"""
import json
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fake_world  # noqa: E402
import fsdp_bench  # noqa: E402


def write_run(out, rnd, world, fsdp, setting, mean, status="ok", counters=None):
    path = fsdp_bench.result_path(fake_world.run_dir(out, rnd, world), setting, fsdp,
                                  "gpt2-medium", 0)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    summary = {"status": status, "mean_step_ms": mean, "median_step_ms": mean - 1,
               "reserved_over_allocated": 1.25, "peak_reserved_bytes": 3 * 2**30}
    if counters is not None:
        summary["counters_per_step"] = counters
    with open(path, "w") as f:
        json.dump(summary, f)


class FakeWorldTest(unittest.TestCase):
    def args(self, out, extra=()):
        return fake_world.parse_args(["--out", out, "--settings", "torch,ours-budget",
                                      "--worlds", "2,4", "--rounds", "2", *extra])

    def test_rounds_rotate_the_settings(self):
        order = fake_world.plan(self.args("/tmp/x"))
        self.assertEqual(len(order), 2 * 2 * 2)
        first = [s for r, w, f, s in order if r == 0 and w == 2]
        second = [s for r, w, f, s in order if r == 1 and w == 2]
        self.assertEqual(first, ["torch", "ours-budget"])
        self.assertEqual(second, ["ours-budget", "torch"])

    def test_the_anchor_is_required(self):
        with self.assertRaises(SystemExit):
            fake_world.parse_args(["--out", "/tmp/x", "--settings", "ours"])

    def test_ratios_are_to_torch_of_the_same_round(self):
        with tempfile.TemporaryDirectory() as out:
            args = self.args(out)
            counters = {"stream_ops.host_waits": 1.0, "stream_ops.host_wait_ns": 2500.0,
                        "stream_ops.stream_waits": 0.0, "page_moves.pages_unmapped": 3.0,
                        "page_moves.pages_mapped": 3.0, "page_moves.host_ns": 1e6}
            for rnd, base in ((0, 100.0), (1, 200.0)):
                write_run(out, rnd, 2, "fsdp2", "torch", base)
                write_run(out, rnd, 2, "fsdp2", "ours-budget", base * 1.1, counters=counters)
            write_run(out, 0, 4, "fsdp2", "torch", 100.0)
            write_run(out, 0, 4, "fsdp2", "ours-budget", 90.0, status="error")
            rows = {(r["world"], r["setting"]): r
                    for r in fake_world.summarize(fake_world.load(args), args.rounds)}
            ours = rows[(2, "ours-budget")]
            self.assertEqual(ours["ratio_mean_to_torch"], [1.1, 1.1])
            self.assertEqual(ours["mean_step_spread_ms"], [110.0, 220.0])
            self.assertEqual(ours["counters_per_step"]["page_moves.pages_unmapped"], 3.0)
            self.assertEqual(rows[(4, "ours-budget")]["runs"], 0, "a failed run is no result")
            self.assertEqual(rows[(4, "torch")]["runs"], 1)
            text = fake_world.table(list(rows.values()))
            self.assertIn("| 2 | fsdp2 | ours-budget | 165.0 (110.0-220.0) | 1.100, 1.100 |", text)
            self.assertIn("2.5", text, "host wait ns shown in microseconds")
            self.assertIn("| 4 | fsdp2 | ours-budget | failed |", text)


if __name__ == "__main__":
    unittest.main()
