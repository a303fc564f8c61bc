"""CPU tests of the sleep-and-wake benchmarks' report code (no torch, no GPU):

    python3 benchmarks/sleep_wake/test_reports.py
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import colocation  # noqa: E402
import pause_resume  # noqa: E402

GIB = 1 << 30


class PauseResume(unittest.TestCase):
    def test_layout_adds_up_with_a_tenth_in_small_blocks(self):
        for size in (GIB, 4 * GIB, 16 * GIB):
            sizes = pause_resume.layout(size)
            total = sum(sizes)
            self.assertLessEqual(total, size)
            self.assertGreater(total, size - pause_resume.BIG)
            small = sum(s for s in sizes if s == pause_resume.SMALL)
            self.assertAlmostEqual(small / size, 0.1, delta=0.01)

    def test_summary_in_seconds_per_gib_against_the_pinned_copy(self):
        r = {"impl": "gpualloc", "backup": "host", "bytes": 4 * GIB,
             "pause_s": [0.5, 0.4, 0.6], "resume_s": [0.3, 0.2, 0.4],
             "given_back_bytes": [4 * GIB] * 3, "taken_again_bytes": [4 * GIB] * 3,
             "pinned_copy": {"d2h_gib_per_s": 20.0, "h2d_gib_per_s": 25.0}}
        s = pause_resume.summarize(r)
        self.assertAlmostEqual(s["pause_s_per_gib"], 0.125)
        self.assertAlmostEqual(s["resume_gib_per_s"], 13.333, places=2)
        self.assertAlmostEqual(s["pause_vs_pinned_d2h"], 0.4)
        self.assertAlmostEqual(s["resume_vs_pinned_h2d"], 13.333 / 25, places=3)
        self.assertEqual(s["given_back_gib"], 4.0)
        r["backup"] = "none"
        self.assertNotIn("pause_vs_pinned_d2h", pause_resume.summarize(r))

    def test_cases_in_order_with_the_retaining_variant_only_under_host_backup(self):
        todo = pause_resume.cases(["gpualloc", "tms_retain", "tms"], ["none", "host"], ["1", "4"])
        self.assertEqual(todo, [
            ("gpualloc", "none", "1"), ("gpualloc", "none", "4"),
            ("gpualloc", "host", "1"), ("gpualloc", "host", "4"),
            ("tms_retain", "host", "1"), ("tms_retain", "host", "4"),
            ("tms", "none", "1"), ("tms", "none", "4"),
            ("tms", "host", "1"), ("tms", "host", "4"),
        ])

    def test_an_unknown_implementation_is_refused_before_any_case_runs(self):
        with self.assertRaisesRegex(ValueError, "unknown implementation vllm"):
            pause_resume.cases(["gpualloc", "vllm"], ["none"], ["1"])


class Colocation(unittest.TestCase):
    def run_of(self, mode, peak, tokens, losses):
        it = {"rollout_s": 1.0, "train_s": 2.0, "switch_s": 0.5}
        return {"mode": mode, "device_peak_bytes": peak, "allocator_peak_reserved_bytes": peak,
                "iterations": [dict(it, switch_s=9.0), it, it], "tokens": tokens,
                "losses": losses}

    def test_summary_compares_with_the_reference_and_skips_the_first_iteration(self):
        rows = colocation.summarize([
            self.run_of("sleep", 20 * GIB, [[1, 2]], [0.5, 0.25]),
            self.run_of("resident", 40 * GIB, [[1, 2]], [0.5, 0.25]),
            self.run_of("torch", 41 * GIB, [[1, 2]], [0.5, 0.26]),
        ])
        sleep, resident, torch = rows
        self.assertEqual(sleep["switch_s"], 0.5, "the first iteration is left out")
        self.assertTrue(sleep["tokens_equal_to_torch"])
        self.assertFalse(sleep["losses_equal_to_torch"])
        self.assertAlmostEqual(sleep["max_loss_diff"], 0.01)
        self.assertAlmostEqual(sleep["device_peak_vs_resident"], 0.5)
        self.assertTrue(torch["losses_equal_to_torch"])


if __name__ == "__main__":
    unittest.main(verbosity=1)
