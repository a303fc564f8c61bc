"""CPU tests of scripts/pytorch_tests (the runner of PyTorch's own allocator tests): test
selection, what a crashed / killed / finished test process means for each test, the
comparison of modes and its markdown, and one whole run of run.py on a small test file of
its own (no torch, no GPU):

    python3 python/tests/test_pytorch_tests_report.py      (or python3 -m pytest ...)
"""
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RUNNER = os.path.join(REPO, "scripts", "pytorch_tests")
sys.path.insert(0, RUNNER)

import events  # noqa: E402
import report  # noqa: E402
import selection  # noqa: E402

F = "test_cuda.py"


def tid(cls, method, file=F):
    return selection.test_id(file, cls, method)


class SelectionTest(unittest.TestCase):
    def test_class_names_and_device_instantiations(self):
        self.assertTrue(selection.class_matches("TestCudaOptims", "TestCudaOptims"))
        self.assertTrue(selection.class_matches("TestCudaOptims", "TestCudaOptimsCUDA"))
        self.assertFalse(selection.class_matches("TestCuda", "TestCudaMallocAsync"))
        self.assertFalse(selection.class_matches("TestCuda", "TestCudaOptimsCUDA"))

    def test_include_exclude_and_keywords(self):
        chunk = {"name": "c", "file": F, "classes": {
            "TestCuda": {"include": selection.TEST_CUDA_INCLUDE,
                         "exclude": selection.TEST_CUDA_EXCLUDE},
            "TestCudaOptims": {"include": r"^test_graph_"}}}
        available = [
            ("TestCuda", "test_memory_stats"), ("TestCuda", "test_pinned_memory_empty_cache"),
            ("TestCuda", "test_sum_fp16"), ("TestCuda", "test_graph_two_successive"),
            ("TestCuda", "test_batch_norm_gather_stats"),
            ("TestCudaOptimsCUDA", "test_graph_optims_Adam_cuda_float32"),
            ("TestCudaOptimsCUDA", "test_grad_scaler_with_preset_grad_scale_SGD_cuda_float32"),
            ("TestCudaMallocAsync", "test_memory_snapshot"),
        ]
        self.assertEqual(selection.select(chunk, available), [
            tid("TestCuda", "test_memory_stats"), tid("TestCuda", "test_graph_two_successive"),
            tid("TestCudaOptimsCUDA", "test_graph_optims_Adam_cuda_float32")])
        self.assertEqual(selection.select(chunk, available, keywords=["two_succ"]),
                         [tid("TestCuda", "test_graph_two_successive")])
        # --all ignores include / exclude but not the classes.
        self.assertEqual(len(selection.select(chunk, available, all_tests=True)), 7)

    def test_default_plan_is_well_formed(self):
        names = [c["name"] for c in selection.DEFAULT_PLAN]
        self.assertEqual(len(names), len(set(names)))
        self.assertEqual(selection.chunk_files(selection.DEFAULT_PLAN),
                         ["test_cuda.py", "test_multiprocessing.py"])
        for chunk in selection.DEFAULT_PLAN:
            self.assertTrue(chunk["classes"])


def ev(kind, **kw):
    kw["event"] = kind
    return kw


A, B, C = tid("T", "test_a"), tid("T", "test_b"), tid("T", "test_c")


class SettleTest(unittest.TestCase):
    def test_finished_process(self):
        att = events.Attempt([ev("boot"), ev("plan", ids=[A, B]), ev("start", id=A),
                              ev("end", id=A, outcome="passed"), ev("start", id=B),
                              ev("end", id=B, outcome="failed", message="AssertionError: x"),
                              ev("done")])
        results, remaining = events.settle(att, None, None)
        self.assertEqual(remaining, [])
        self.assertEqual(results[A]["outcome"], "passed")
        self.assertEqual(results[B]["message"], "AssertionError: x")

    def test_crash_marks_the_running_test_and_retries_the_rest(self):
        att = events.Attempt([ev("plan", ids=[A, B, C]), ev("start", id=A),
                              ev("end", id=A, outcome="passed"), ev("start", id=B)])
        results, remaining = events.settle(att, None, None, "line\nSegmentation fault\n")
        self.assertEqual(results[B]["outcome"], "crashed")
        self.assertIn("Segmentation fault", results[B]["message"])
        self.assertEqual(remaining, [C])

    def test_restart_uses_the_ids_it_was_given(self):
        att = events.Attempt([ev("start", id=C), ev("end", id=C, outcome="skipped"),
                              ev("done")])
        results, remaining = events.settle(att, [C], None)
        self.assertEqual((results[C]["outcome"], remaining), ("skipped", []))

    def test_timeout_and_budget(self):
        att = events.Attempt([ev("plan", ids=[A, B]), ev("start", id=A)])
        results, remaining = events.settle(att, None, "timeout")
        self.assertEqual((results[A]["outcome"], remaining), ("timeout", [B]))
        results, remaining = events.settle(att, None, "budget")
        self.assertEqual(results[A]["outcome"], "interrupted")
        self.assertEqual((results[B]["outcome"], remaining), ("not-run", []))

    def test_fatal_fails_every_planned_test(self):
        att = events.Attempt([ev("fatal", message="gpualloc is not the allocator")])
        results, remaining = events.settle(att, [A, B], None)
        self.assertEqual({r["outcome"] for r in results.values()}, {"error"})
        self.assertEqual(remaining, [])

    def test_crash_line(self):
        tail = ("x = 1\nterminate called after throwing an instance of 'c10::Error'\n"
                "  what():  CUDA error: an illegal memory access was encountered\n"
                "Fatal Python error: Aborted\n\nCurrent thread 0x01 (most recent call first):\n"
                '  File "child.py", line 9 in main\n')
        self.assertEqual(events.crash_line(tail),
                         "what():  CUDA error: an illegal memory access was encountered")
        self.assertEqual(events.crash_line('ok\n  File "a.py", line 1 in f\n'), "ok")

    def test_no_progress_is_not_retried(self):
        att = events.Attempt([ev("plan", ids=[A, B])])
        results, remaining = events.settle(att, None, None, "Killed")
        self.assertEqual(remaining, [])
        self.assertIn("before running any test", results[A]["message"])

    def test_class_fixture_error(self):
        att = events.Attempt([
            ev("plan", ids=[A, tid("U", "test_x")]), ev("start", id=A),
            ev("end", id=A, outcome="passed"),
            ev("fixture_error", description="setUpClass (test_cuda.U)", message="RuntimeError: no"),
            ev("done")])
        results, _ = events.settle(att, None, None)
        self.assertEqual(results[tid("U", "test_x")]["outcome"], "error")
        self.assertIn("RuntimeError: no", results[tid("U", "test_x")]["message"])

    def test_truncated_last_line_is_ignored(self):
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            f.write(json.dumps(ev("start", id=A)) + "\n" + '{"event": "end", "id"')
        try:
            att = events.Attempt(events.load_events(f.name))
        finally:
            os.unlink(f.name)
        self.assertEqual(att.inflight, A)


def results_data():
    r = events.result
    modes = {
        "pytorch": {"description": "PyTorch", "env": {"torch": "2.11.0+cu130",
                                                      "device": "NVIDIA H100"},
                    "tests": {
                        tid("T", "test_ok"): r("passed"),
                        tid("T", "test_ipc"): r("passed"),
                        tid("T", "test_both"): r("failed", "AssertionError: 1 != 2"),
                        tid("T", "test_skip"): r("skipped", "needs 2 GPUs"),
                        tid("T", "test_torch_only"): r("error", "RuntimeError: flaky"),
                        tid("T", "test_xf"): r("xfail", "expected"),
                    }},
        "gpualloc": {"description": "gpualloc", "env": None, "tests": {
            tid("T", "test_ok"): r("passed"),
            tid("T", "test_ipc"): r("error", "RuntimeError: CUDA IPC | not supported\nmore"),
            tid("T", "test_both"): r("failed", "AssertionError: 1 != 2"),
            tid("T", "test_skip"): r("skipped", "needs 2 GPUs"),
            tid("T", "test_torch_only"): r("passed"),
            tid("T", "test_xf"): r("xfail", "expected"),
            tid("T", "test_crash"): r("crashed", "its process died: Segmentation fault"),
        }},
    }
    return {"meta": {"started": "2026-11-24 00:00 UTC", "seconds": 300, "max_seconds": 500,
                     "test_timeout": 150, "notes": ["a note"],
                     "sources": [{"file": F, "source": "commit abc"}]},
            "modes": modes,
            "chunks": [{"name": "c", "mode": "gpualloc", "tests": 7, "seconds": 9.5,
                        "attempts": 2, "notes": ["crashed T.test_crash"]}]}


class ReportTest(unittest.TestCase):
    def test_categories(self):
        data = results_data()
        cmp_ = report.compare(data["modes"], "pytorch", "gpualloc")
        self.assertEqual(cmp_["failing only under gpualloc"], [tid("T", "test_ipc")])
        self.assertEqual(cmp_["failing under both"], [tid("T", "test_both")])
        self.assertEqual(cmp_["failing only under pytorch"], [tid("T", "test_torch_only")])
        self.assertEqual(cmp_["skipped"], [tid("T", "test_skip")])
        self.assertEqual(cmp_["passed under both"], [tid("T", "test_ok"), tid("T", "test_xf")])
        # Only gpualloc ran it: not a comparison.
        self.assertEqual(cmp_["not run"], [tid("T", "test_crash")])

    def test_counts_fill_in_not_run(self):
        c = report.counts(results_data()["modes"], "pytorch")
        self.assertEqual(c["not-run"], 1)
        self.assertEqual(sum(c.values()), 7)

    def test_setup_error_fails_every_test_of_the_mode(self):
        data = results_data()
        data["modes"]["gpualloc"] = {"description": "gpualloc", "tests": {},
                                     "setup_error": "building the C++ bridge failed: x"}
        cmp_ = report.compare(data["modes"], "pytorch", "gpualloc")
        self.assertIn(tid("T", "test_ok"), cmp_["failing only under gpualloc"])

    def test_baselines(self):
        modes = {"pytorch": {}, "gpualloc": {}, "gpualloc-expandable": {}}
        self.assertEqual(report.baseline_of("gpualloc-expandable", modes), "pytorch")
        modes["pytorch-expandable"] = {}
        self.assertEqual(report.baseline_of("gpualloc-expandable", modes), "pytorch-expandable")
        self.assertIsNone(report.baseline_of("pytorch", modes))

    def test_markdown(self):
        text = report.render(results_data())
        self.assertIn("torch 2.11.0+cu130, NVIDIA H100.", text)
        self.assertIn("| pytorch | 7 | 2 | 1 | 1 | 0 | 0 | 1 | 1 | 0 | 0 | 1 |", text)
        self.assertIn("| gpualloc | 7 | 2 | 1 | 1 | 1 | 0 | 1 | 1 | 0 | 0 | 0 |", text)
        self.assertIn("### Failing only under gpualloc (1)", text)
        # First line of the error, with the table's separator escaped.
        self.assertIn("| T.test_ipc | passed | error | RuntimeError: CUDA IPC \\| not supported "
                      "more |", text)
        self.assertIn("- failing only under pytorch: 1", text)
        self.assertIn("| test_cuda.py | T | 7 |", text)
        self.assertIn("- a note", text)
        self.assertEqual(report.check_outcomes(results_data()), [])


class ChunkErrorTest(unittest.TestCase):
    def test_a_chunk_that_failed_to_start_fails_the_tests_the_other_mode_ran(self):
        import run

        chunk = {"name": "ipc", "file": "test_multiprocessing.py",
                 "classes": {"TestMultiprocessing": {}}}
        t1 = tid("TestMultiprocessing", "test_event", "test_multiprocessing.py")
        t2 = tid("TestMultiprocessing", "test_cuda_simple", "test_multiprocessing.py")
        pseudo = run.collection_id(chunk)
        runner = run.Runner.__new__(run.Runner)
        runner.modes = {
            "pytorch": {"tests": {t1: events.result("passed"), t2: events.result("skipped"),
                                  tid("TestCuda", "test_x"): events.result("passed")}},
            "gpualloc": {"tests": {pseudo: events.result("error", "gpualloc is not the "
                                                         "allocator of this process")}},
        }
        runner.spread_chunk_errors([chunk])
        got = runner.modes["gpualloc"]["tests"]
        self.assertEqual(sorted(got), sorted([t1, t2]))
        self.assertEqual(got[t1]["message"], "gpualloc is not the allocator of this process")
        self.assertTrue(run.in_chunk(chunk, t1))
        self.assertFalse(run.in_chunk(chunk, pseudo))


FAKE_TESTS = textwrap.dedent("""\
    import os, signal, time, unittest

    class TestFake(unittest.TestCase):
        def test_1_pass(self):
            pass

        def test_2_fail(self):
            self.assertEqual(1, 2)

        def test_3_crash(self):
            os.kill(os.getpid(), signal.SIGSEGV)

        def test_4_skip(self):
            self.skipTest("nothing to do here")

        def test_5_hang(self):
            time.sleep(60)

        def test_6_subtest(self):
            for i in range(2):
                with self.subTest(i=i):
                    self.assertLess(i, 1)

        def test_7_pass(self):
            pass

    class TestOther(unittest.TestCase):
        def test_not_selected(self):
            pass
    """)


class WholeRunTest(unittest.TestCase):
    def test_run_with_crash_timeout_and_failed_gpualloc_setup(self):
        with tempfile.TemporaryDirectory() as d:
            tests = os.path.join(d, "tests")
            os.makedirs(tests)
            with open(os.path.join(tests, "fake_tests.py"), "w") as f:
                f.write(FAKE_TESTS)
            plan = os.path.join(d, "plan.json")
            with open(plan, "w") as f:
                json.dump([{"name": "fake", "file": "fake_tests.py",
                            "classes": {"TestFake": {}}}], f)
            out = os.path.join(d, "out")
            env = dict(os.environ, GPUALLOC_SO=os.path.join(d, "no-such-library.so"))
            r = subprocess.run(
                [sys.executable, os.path.join(RUNNER, "run.py"), "--tests", tests,
                 "--out", out, "--work", os.path.join(d, "work"), "--plan", plan,
                 "--modes", "pytorch,gpualloc", "--test-timeout", "3", "--max-seconds", "120"],
                capture_output=True, text=True, env=env, timeout=180)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            with open(os.path.join(out, "results.json")) as f:
                data = json.load(f)
            got = {k.split("::")[2]: v for k, v in data["modes"]["pytorch"]["tests"].items()}
            self.assertEqual({k: v["outcome"] for k, v in got.items()}, {
                "test_1_pass": "passed", "test_2_fail": "failed", "test_3_crash": "crashed",
                "test_4_skip": "skipped", "test_5_hang": "timeout", "test_6_subtest": "failed",
                "test_7_pass": "passed"})
            self.assertEqual(got["test_2_fail"]["message"], "AssertionError: 1 != 2")
            self.assertIn("i=1", got["test_6_subtest"]["message"])
            self.assertEqual(got["test_4_skip"]["message"], "nothing to do here")
            self.assertIn("its process died (killed by SIGSEGV): Fatal Python error: "
                          "Segmentation fault", got["test_3_crash"]["message"])
            self.assertIn("test_3_crash", got["test_3_crash"]["details"])  # faulthandler's stack
            chunk = [c for c in data["chunks"] if c["mode"] == "pytorch"][0]
            self.assertEqual(chunk["attempts"], 3)  # restarted after the crash and the hang
            # No library: gpualloc's setup fails and every test says so, not a silent pass.
            self.assertIn("liballoc_ffi.so not found", data["modes"]["gpualloc"]["setup_error"])
            with open(os.path.join(out, "report.md")) as f:
                text = f.read()
            self.assertIn("### Failing only under gpualloc (3)", text)  # a skip is no failure
            self.assertIn("setup failed: liballoc_ffi.so not found", text)
            self.assertTrue(os.path.isfile(os.path.join(out, "logs.tar.gz")))
            self.assertEqual(sorted(os.listdir(out)), ["logs.tar.gz", "report.md",
                                                       "results.json"])


if __name__ == "__main__":
    unittest.main()
