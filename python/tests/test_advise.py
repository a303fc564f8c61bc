"""gpu_alloc.advise and ``python -m gpu_alloc advise``: the replay of a snapshot through
the library (no torch, no GPU), on the bundled small MLP snapshot and on files that are no
snapshot.

Run with ``python3 python/tests/test_advise.py`` (see support.py for which library)."""

import gzip
import json
import os
import resource
import subprocess
import sys
import tempfile
import unittest

from support import REPO, child_env, gpu_alloc, needs_so, run_gpu_alloc, SO

SNAPSHOT = os.path.join(REPO, "traces", "small_mlp_stacks.snapshot.pickle")


@needs_so
class Advise(unittest.TestCase):
    def setUp(self):
        gpu_alloc.load_library(SO)

    def test_the_snapshot_gets_a_recommendation(self):
        advice = gpu_alloc.advise(SNAPSHOT)
        self.assertEqual(advice["trace"], "small_mlp_stacks")
        self.assertEqual(advice["recommended_setting"], "unmap16")
        self.assertEqual(advice["enable_call"], 'gpu_alloc.enable("unmap16")')
        self.assertEqual(advice["gpualloc_conf"], "expandable_segments:True,unmap_free_pages:True")
        names = [o["setting"]["name"] for o in advice["outcomes"]]
        self.assertEqual(names[:2], ["default", "expandable"])
        # PyTorch's default as PyTorch measured it (traces/measured.json).
        self.assertEqual(advice["outcomes"][0]["report"]["peak_reserved_bytes"], 113246208)
        with open(SNAPSHOT, "rb") as f:
            same = gpu_alloc.advise(f.read(), name="small_mlp_stacks")
        self.assertEqual(same["text"], advice["text"])

    def test_a_budget_is_passed_through(self):
        advice = gpu_alloc.advise(SNAPSHOT, budget="100MiB")
        self.assertEqual(advice["budget_bytes"], 100 << 20)
        budget = [o for o in advice["outcomes"] if o["setting"]["name"] == "budget"]
        self.assertEqual(len(budget), 1)
        self.assertLessEqual(advice["outcomes"][advice["recommended"]]["report"]
                             ["peak_reserved_bytes"], 100 << 20)
        self.assertIsNone(gpu_alloc.advise(SNAPSHOT)["budget_bytes"])
        self.assertEqual(gpu_alloc.budget_bytes("2GiB"), 2 << 30)
        self.assertEqual(gpu_alloc.budget_bytes(4096), 4096)
        for bad in ("", "0", "-1", "lots", "24 GB", True):
            with self.assertRaises(ValueError):
                gpu_alloc.budget_bytes(bad)

    def test_a_file_that_is_no_snapshot_is_a_value_error(self):
        with open(SNAPSHOT, "rb") as f:
            data = f.read()
        for bad in (data[: len(data) // 3], b"\x80\x04garbage", b"", os.urandom(256)):
            with self.assertRaises(ValueError) as cm:
                gpu_alloc.advise(bad, name="bad")
            self.assertIn("bad:", str(cm.exception))
        with self.assertRaises(ValueError) as cm:
            gpu_alloc.advise(SNAPSHOT, device=5)
        self.assertIn("no trace for device 5", str(cm.exception))

    def test_the_command_prints_the_advice(self):
        r = run_gpu_alloc("advise", SNAPSHOT)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("recommended: unmap_free_pages, 16 MiB pages", r.stdout)
        self.assertIn('gpu_alloc.enable("unmap16"), or GPUALLOC_CONF="unmap16"', r.stdout)
        self.assertIn("expandable_segments:True,unmap_free_pages:True", r.stdout)
        self.assertIn("PyTorch's expandable segments", r.stdout)
        self.assertIn("cost: ", r.stdout)
        r = run_gpu_alloc("advise", "--json", SNAPSHOT)
        self.assertEqual(json.loads(r.stdout)["recommended_setting"], "unmap16")

    def test_the_command_fails_cleanly_on_a_bad_file(self):
        with tempfile.NamedTemporaryFile(suffix=".pickle") as f:
            f.write(b"\x80\x04\x95not a pickle")
            f.flush()
            r = run_gpu_alloc("advise", f.name)
        self.assertEqual(r.returncode, 1)
        self.assertIn("cannot decode pickle", r.stderr)
        self.assertNotIn("Traceback", r.stderr)
        r = run_gpu_alloc("advise", "/nonexistent.pickle")
        self.assertEqual(r.returncode, 1)
        self.assertNotIn("Traceback", r.stderr)

    def test_messages_name_the_file_once_and_no_internal_format(self):
        with tempfile.TemporaryDirectory() as d:
            empty = os.path.join(d, "empty.pickle")
            open(empty, "wb").close()
            r = run_gpu_alloc("advise", empty)
            self.assertEqual(r.returncode, 1)
            self.assertEqual(r.stderr.count("empty:"), 1, r.stderr)
            self.assertIn("no allocations", r.stderr)
            notes = os.path.join(d, "notes.txt")
            with open(notes, "w") as f:
                f.write("hello world\n")
            r = run_gpu_alloc("advise", notes)
            self.assertEqual(r.returncode, 1)
            self.assertIn("notes.txt: not a PyTorch memory snapshot (pickle) or gpualloc trace",
                          r.stderr)
            self.assertNotIn("unknown operation", r.stderr)

    def test_the_rule_is_linked_where_a_pip_user_can_read_it(self):
        text = gpu_alloc.advise(SNAPSHOT)["text"]
        self.assertIn("https://github.com/gpu-alloc/gpu-alloc/blob/main/docs/advise.md", text)
        self.assertNotIn("(docs/advise.md)", text)

    def test_runs_of_marks_are_refused_under_a_small_address_space(self):
        # 2 MiB of MARKs gzip'd to 2 KB took 8.4 GB, and under a 4 GB
        # address-space limit aborted the process; 100 KB raw took 406 MB.
        marks = gzip.compress(b"\x80\x04" + b"(" * (2 << 20) + b".", 9)
        raw = b"\x80\x04" + b"(" * (100 << 10) + b"."
        self.assertLess(len(marks), 2100)
        for data, reason in ((marks, "decompression bomb"), (raw, "would build more than")):
            with tempfile.NamedTemporaryFile(suffix=".pickle") as f:
                f.write(data)
                f.flush()
                r = subprocess.run(
                    [sys.executable, "-m", "gpu_alloc", "advise", f.name],
                    env=child_env(), capture_output=True, text=True,
                    preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)),
                )
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn(reason, r.stderr)
            self.assertNotIn("Traceback", r.stderr)
            with self.assertRaises(ValueError) as cm:
                gpu_alloc.advise(data, name="marks")
            self.assertIn(reason, str(cm.exception))


if __name__ == "__main__":
    unittest.main(verbosity=2)
