#!/usr/bin/env python3
"""CPU tests of fsdp_bench.py's memory-history recording, with a stand-in for torch's
memory functions (no torch, no GPU):

    python3 benchmarks/fsdp/test_fsdp_bench.py
"""
import os
import pickle
import sys
import tempfile
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fsdp_bench  # noqa: E402


def fake_torch(calls):
    """torch.cuda.memory's history functions, recording what they were asked; each step
    adds an alloc, a free requested and a free completed to device 1's trace."""
    trace = []

    def record(enabled="all", context="all", stacks="all"):
        calls.append(("record", enabled, context, stacks))

    def snapshot():
        return {"device_traces": [[], list(trace)], "segments": []}

    def dump(path):
        with open(path, "wb") as f:
            pickle.dump(snapshot(), f)

    memory = types.SimpleNamespace(_record_memory_history=record, _snapshot=snapshot,
                                   _dump_snapshot=dump)
    cuda = types.SimpleNamespace(memory=memory, current_device=lambda: 1)
    return types.SimpleNamespace(cuda=cuda), trace


class MemoryHistoryTest(unittest.TestCase):
    def test_the_steps_run_with_the_history_on_and_rank_0_dumps_it(self):
        calls = []
        torch, trace = fake_torch(calls)

        def step(i):
            calls.append(("step", i))
            trace.extend({"action": a} for a in ("alloc", "free_requested", "free_completed"))

        with tempfile.TemporaryDirectory() as out:
            path = fsdp_bench.snapshot_path(out, "torch", "fsdp2", "gpt2-medium", 0)
            got = fsdp_bench.record_history(torch, step, 2, 3, path)
            with open(path, "rb") as f:
                dumped = pickle.load(f)
        self.assertEqual(calls, [("record", "all", None, "python"), ("step", 0), ("step", 1),
                                 ("step", 0), ("record", None, "all", "all")])
        self.assertEqual(got["entries"], 9)
        self.assertEqual(got["actions"], {"alloc": 3, "free_requested": 3,
                                          "free_completed": 3})
        self.assertEqual(len(dumped["device_traces"][1]), 9)
        self.assertTrue(path.endswith(os.path.join(
            "snapshots", "torch__fsdp2__gpt2-medium__rank0.pickle")))

    def test_other_ranks_dump_nothing_and_a_failed_step_turns_the_history_off(self):
        calls = []
        torch, _ = fake_torch(calls)
        self.assertIsNone(fsdp_bench.record_history(torch, lambda i: None, 1, 1, None)["path"])

        def fail(i):
            raise RuntimeError("out of memory")

        calls.clear()
        with self.assertRaises(RuntimeError):
            fsdp_bench.record_history(torch, fail, 1, 1, "/nonexistent/x.pickle")
        self.assertEqual(calls[-1][:2], ("record", None))

    def test_the_step_count_is_checked(self):
        base = ["--setting", "torch", "--fsdp", "fsdp2", "--shape", "gpt2-medium",
                "--out", "x"]
        self.assertEqual(fsdp_bench.parse_args(base + ["--memory-history", "2"])
                         .memory_history, 2)
        for bad in (["--memory-history", "0"], ["--memory-history", "1", "--device", "cpu"]):
            with self.assertRaises(SystemExit), open(os.devnull, "w") as null:
                stderr, sys.stderr = sys.stderr, null
                try:
                    fsdp_bench.parse_args(base + bad)
                finally:
                    sys.stderr = stderr


if __name__ == "__main__":
    unittest.main()
