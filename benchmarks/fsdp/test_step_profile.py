#!/usr/bin/env python3
"""CPU tests of step_profile.py with a stand-in for torch.profiler (no torch):

    python3 benchmarks/fsdp/test_step_profile.py
"""
import os
import sys
import tempfile
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import step_profile  # noqa: E402


def avg(key, count, self_cpu, cpu_total=None, device=0.0, device_field="self_device_time_total"):
    a = types.SimpleNamespace(key=key, count=count, self_cpu_time_total=self_cpu,
                              cpu_time_total=cpu_total if cpu_total is not None else self_cpu)
    setattr(a, device_field, device)
    return a


class Averages(list):
    def table(self, sort_by, row_limit):
        return "table of %d rows by %s" % (min(len(self), row_limit), sort_by)


class FakeTorch:
    """torch.profiler and torch.cuda as StepProfile uses them."""

    def __init__(self, averages):
        self.entered = self.exited = self.synced = 0
        self.activities = None
        fake = self

        class Profile:
            def __init__(self, activities):
                fake.activities = activities

            def __enter__(self):
                fake.entered += 1

            def __exit__(self, *exc):
                fake.exited += 1

            def key_averages(self):
                return averages

        self.profiler = types.SimpleNamespace(
            ProfilerActivity=types.SimpleNamespace(CPU="cpu", CUDA="cuda"), profile=Profile)
        self.cuda = types.SimpleNamespace(is_available=lambda: True,
                                          synchronize=lambda: setattr(self, "synced", 1))


class StepProfileTest(unittest.TestCase):
    def test_rows_are_per_step_and_keep_the_top_and_the_watched_operators(self):
        averages = [avg("aten::mm", 40, 4000.0, device=9000.0)]
        averages += [avg("op%d" % i, 2, 100.0 - i) for i in range(step_profile.TOP)]
        averages += [avg("gpualloc::malloc", 200, 20.0), avg("cudaEventQuery", 100, 10.0),
                     avg("rare_op", 2, 1.0)]
        rows = step_profile.rows_from_averages(averages, steps=2)
        names = [r["name"] for r in rows]
        self.assertEqual(names[0], "aten::mm")
        self.assertIn("gpualloc::malloc", names, "watched although below the top")
        self.assertIn("cudaEventQuery", names)
        self.assertNotIn("rare_op", names)
        mm = rows[0]
        self.assertEqual((mm["calls"], mm["self_cpu_us"], mm["self_device_us"]),
                         (20.0, 2000.0, 4500.0))
        s = step_profile.summary(rows, 2)
        self.assertEqual(s["allocator_self_cpu_us"], 10.0)
        self.assertEqual(s["watched_cuda_self_cpu_us"], 5.0)

    def test_older_torch_names_the_device_time_cuda(self):
        rows = step_profile.rows_from_averages(
            [avg("k", 1, 1.0, device=7.0, device_field="self_cuda_time_total")], steps=1)
        self.assertEqual(rows[0]["self_device_us"], 7.0)

    def test_the_profile_wraps_the_steps_and_writes_its_tables(self):
        torch = FakeTorch(Averages([avg("gpualloc::free", 30, 6.0)]))
        with tempfile.TemporaryDirectory() as out:
            path = os.path.join(out, "profiles", "run__rank0.txt")
            with step_profile.StepProfile(torch, 3, path) as prof:
                self.assertEqual((torch.entered, torch.exited), (1, 0))
            self.assertEqual((torch.entered, torch.exited, torch.synced), (1, 1, 1))
            self.assertEqual(torch.activities, ["cpu", "cuda"])
            self.assertEqual(prof.result["allocator_self_cpu_us"], 2.0)
            with open(path) as f:
                text = f.read()
            self.assertIn("table of 1 rows by self_cpu_time_total", text)
            self.assertIn('"allocator_self_cpu_us": 2.0', text)

    def test_a_failure_inside_leaves_no_result(self):
        torch = FakeTorch(Averages([]))
        with tempfile.TemporaryDirectory() as out:
            prof = step_profile.StepProfile(torch, 1, os.path.join(out, "p", "x.txt"))
            with self.assertRaises(RuntimeError):
                with prof:
                    raise RuntimeError("out of memory")
            self.assertIsNone(prof.result)
            self.assertFalse(os.path.exists(os.path.join(out, "p")))

    def test_the_number_of_steps_is_checked(self):
        self.assertEqual(step_profile.parse_steps("4"), 4)
        with self.assertRaises(ValueError):
            step_profile.parse_steps("0")


if __name__ == "__main__":
    unittest.main()
