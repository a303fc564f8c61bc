#!/usr/bin/env python3
"""CPU tests of rounds.py's run order, commands, summary and table, with fake results (no
torch):

    python3 benchmarks/fsdp/test_rounds.py
"""
import contextlib
import io
import json
import os
import sys
import tarfile
import tempfile
import threading
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import rounds  # noqa: E402
import fsdp_bench  # noqa: E402


def write_run(out, rnd, world, fsdp, setting, mean, status="ok", counters=None, rank=0,
              gap=1.25, active=None, profile=None, probe=None):
    path = fsdp_bench.result_path(rounds.run_dir(out, rnd, world), setting, fsdp,
                                  "gpt2-medium", rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    summary = {"status": status, "mean_step_ms": mean, "median_step_ms": mean - 1,
               "reserved_over_allocated": gap, "peak_reserved_bytes": 3 * 2**30}
    if counters is not None:
        summary["counters_per_step"] = counters
    if active is not None:
        summary["active_over_allocated"] = active
    if probe is not None:  # fsdp_bench's host probe, before and after the steps
        summary["host_probe_us"] = probe
    if profile is not None:  # as budget.profile_steps gives it, over 2 steps
        summary["profile"] = {"steps": 2, "wall_ms_per_step": profile[1],
                              "kernel_ms_per_step": profile[1] / 2,
                              "allocator_calls": {"gpualloc::malloc": {"total_us": profile[0]},
                                                  "gpualloc::free": {"total_us": profile[0]}}}
    with open(path, "w") as f:
        json.dump(summary, f)


class FakeWorldTest(unittest.TestCase):
    def args(self, out, extra=()):
        return rounds.parse_args(["--out", out, "--settings", "torch,ours-budget",
                                  "--worlds", "2,4", "--rounds", "2", "--fake", *extra])

    def test_rounds_rotate_the_settings(self):
        order = rounds.plan(self.args("/tmp/x"))
        self.assertEqual(len(order), 2 * 2 * 2)
        first = [s for r, w, f, s in order if r == 0 and w == 2]
        second = [s for r, w, f, s in order if r == 1 and w == 2]
        self.assertEqual(first, ["torch", "ours-budget"])
        self.assertEqual(second, ["ours-budget", "torch"])

    def test_the_anchor_is_required(self):
        with self.assertRaises(SystemExit):
            rounds.parse_args(["--out", "/tmp/x", "--settings", "ours"])

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
                    for r in rounds.summarize(rounds.load(args), args.rounds)}
            ours = rows[(2, "ours-budget")]
            self.assertEqual(ours["ratio_mean_to_torch"], [1.1, 1.1])
            self.assertEqual(ours["mean_step_spread_ms"], [110.0, 220.0])
            self.assertEqual(ours["counters_per_step"]["page_moves.pages_unmapped"], 3.0)
            self.assertEqual(rows[(4, "ours-budget")]["runs"], 0, "a failed run is no result")
            self.assertEqual(rows[(4, "torch")]["runs"], 1)
            text = rounds.table(list(rows.values()))
            self.assertIn("| 2 | fsdp2 | ours-budget | 165.0 (110.0-220.0) | 1.100, 1.100 |", text)
            self.assertIn("2.5", text, "host wait ns shown in microseconds")
            self.assertIn("| 4 | fsdp2 | ours-budget | no complete run |", text)


class GpusTest(unittest.TestCase):
    def args(self, out):
        return rounds.parse_args(["--out", out, "--settings", "torch,ours-bound", "--worlds",
                                  "2", "--rounds", "2", "--steps", "30",
                                  "--bench-args", "--varlen 256"])

    def test_a_run_is_one_process_a_rank_and_a_fake_world_one_process(self):
        args = self.args("/tmp/x")
        cmds = rounds.commands(args, 2, "fsdp1", "ours-bound", "/tmp/x/r0/w2")
        self.assertEqual([env["RANK"] for _, env in cmds], ["0", "1"])
        self.assertTrue(all(env["WORLD_SIZE"] == "2" for _, env in cmds))
        argv = cmds[0][0]
        self.assertNotIn("--fake-world", argv)
        self.assertEqual(argv[argv.index("--varlen") + 1], "256")
        self.assertEqual(argv[argv.index("--steps") + 1], "30")
        fake = rounds.parse_args(["--out", "/tmp/x", "--settings", "torch", "--worlds", "4",
                                  "--fake"])
        cmds = rounds.commands(fake, 4, "fsdp2", "torch", "/tmp/x/r0/w4")
        self.assertEqual(len(cmds), 1)
        self.assertEqual(cmds[0][1], {}, "the fake group needs no process group variables")
        self.assertEqual(cmds[0][0][cmds[0][0].index("--fake-world") + 1], "4")

    def test_each_rank_runs_on_its_own_cpus_when_asked(self):
        args = rounds.parse_args(["--out", "/tmp/x", "--settings", "torch", "--worlds", "2",
                                  "--rank-cpus", "4-11; 20-27"])
        cmds = rounds.commands(args, 2, "fsdp2", "torch", "/tmp/x/r0/w2")
        self.assertEqual([argv[:3] for argv, _ in cmds],
                         [["taskset", "-c", "4-11"], ["taskset", "-c", "20-27"]])
        self.assertEqual([env["RANK"] for _, env in cmds], ["0", "1"])
        unpinned = rounds.commands(self.args("/tmp/x"), 2, "fsdp2", "torch", "/tmp/x/r0/w2")
        self.assertNotIn("taskset", unpinned[0][0])
        with self.assertRaises(SystemExit):  # two ranks, one CPU list
            with contextlib.redirect_stderr(io.StringIO()):
                rounds.parse_args(["--out", "/tmp/x", "--settings", "torch", "--worlds", "2",
                                   "--rank-cpus", "4-11"])

    def test_steps_over_the_host_probe_take_the_hosts_speed_out(self):
        with tempfile.TemporaryDirectory() as out:
            args = rounds.parse_args(["--out", out, "--settings", "torch,ours-bound",
                                      "--rounds", "2"])
            # Round 2's host is twice as slow for ours: the raw ratio doubles, the one over
            # the probe does not.
            for rnd, (slow, ours_probe) in enumerate(((1.0, [5.0, 5.0]), (2.0, [9.0, 11.0]))):
                for rank in (0, 1):
                    write_run(out, rnd, 2, "fsdp2", "torch", 100.0, rank=rank,
                              probe=[5.0, 5.0])
                    write_run(out, rnd, 2, "fsdp2", "ours-bound", 101.0 * slow, rank=rank,
                              probe=ours_probe)
            rows = {r["setting"]: r for r in rounds.summarize(rounds.load(args), 2)}
            ours = rows["ours-bound"]
            self.assertEqual(ours["ratio_mean_to_torch"], [1.01, 2.02])
            self.assertEqual(ours["ratio_host_normalized"], [1.01, 1.01])
            self.assertAlmostEqual(ours["host_normalized_interval"][0], 1.01)
            self.assertEqual(ours["host_probe_us"], 7.5)
            self.assertEqual(rows["torch"]["ratio_host_normalized"], [1.0, 1.0])
            self.assertIn("| 1.010 (1.010-1.010) |", rounds.table(list(rows.values())))
            # A run without a probe (older results): no normalized ratio at all.
            write_run(out, 1, 2, "fsdp2", "ours-bound", 202.0, rank=1)
            ours = next(r for r in rounds.summarize(rounds.load(args), 2)
                        if r["setting"] == "ours-bound")
            self.assertNotIn("ratio_host_normalized", ours)

    def test_the_host_probe_times_adds_into_a_tensor_it_made_before(self):
        calls = {"add": 0, "sync": 0, "made": 0}

        class FakeTorch:
            @staticmethod
            def ones(n, device):
                calls["made"] += 1
                return [1.0] * n

            @staticmethod
            def empty_like(x):
                calls["made"] += 1
                return list(x)

            @staticmethod
            def add(x, y, out):
                calls["add"] += 1
                out[0] = x[0] + y[0]

        us = fsdp_bench.host_probe(FakeTorch, "cpu", lambda: calls.__setitem__(
            "sync", calls["sync"] + 1), ops=10, repeats=3)
        self.assertGreater(us, 0)
        self.assertEqual(calls, {"add": 30, "sync": 4, "made": 3},
                         "three tensors made once, then only adds into one of them")

    def test_every_rank_counts_and_a_missing_rank_is_no_result(self):
        with tempfile.TemporaryDirectory() as out:
            args = self.args(out)
            for rnd in (0, 1):
                write_run(out, rnd, 2, "fsdp2", "torch", 200.0, rank=0)
                write_run(out, rnd, 2, "fsdp2", "torch", 220.0, rank=1)
            write_run(out, 0, 2, "fsdp2", "ours-bound", 200.0, rank=0, gap=1.006, active=1.004)
            write_run(out, 0, 2, "fsdp2", "ours-bound", 240.0, rank=1, gap=1.02, active=1.012)
            write_run(out, 1, 2, "fsdp2", "ours-bound", 100.0, rank=0)  # rank 1 lost
            rows = {r["setting"]: r for r in rounds.summarize(rounds.load(args), args.rounds)}
            ours = rows["ours-bound"]
            self.assertEqual(ours["runs"], 1)
            self.assertEqual(ours["ratio_mean_to_torch"], [round(220.0 / 210.0, 3)])
            self.assertEqual(ours["reserved_over_allocated"], [1.006, 1.02])
            self.assertIsNone(ours["ratio_interval"], "one round gives no interval")
            self.assertEqual(rows["torch"]["runs"], 2)
            self.assertEqual(ours["active_over_allocated"], [1.004, 1.012])
            self.assertNotIn("profile_per_step", ours, "no run was profiled")
            self.assertIsNone(rows["torch"]["active_over_allocated"], "not in older results")
            text = rounds.table(list(rows.values()))
            self.assertIn("| 1.006-1.020 | 1.004-1.012 |", text)
            self.assertIn("| 1.250 | - |", text)

    def test_the_interval_and_verdict_come_from_the_rounds(self):
        with tempfile.TemporaryDirectory() as out:
            args = rounds.parse_args(["--out", out, "--settings", "torch,ours-bound",
                                      "--rounds", "3"])
            for rnd, ratio in enumerate((1.30, 1.32, 1.31)):
                for rank in (0, 1):
                    write_run(out, rnd, 2, "fsdp2", "torch", 100.0, rank=rank)
                    write_run(out, rnd, 2, "fsdp2", "ours-bound", 100.0 * ratio, rank=rank,
                              profile=(1000.0 + 100 * rank, 50.0))
            ours = next(r for r in rounds.summarize(rounds.load(args), 3)
                        if r["setting"] == "ours-bound")
            self.assertEqual(ours["verdict"], "above")
            self.assertEqual(ours["profile_per_step"],
                             {"allocator_us": 1050.0, "wall_ms": 50.0, "kernel_ms": 25.0})
            self.assertAlmostEqual(ours["ratio_interval"][0], 1.31, places=2)


class ActiveBytesTest(unittest.TestCase):
    def stats(self, reserved, allocated, active):
        keys = dict.fromkeys(fsdp_bench.AllocStats.KEYS, 0)
        keys.update({"reserved_bytes.all.peak": reserved, "allocated_bytes.all.peak": allocated,
                     "active_bytes.all.peak": active})
        return {"primary": keys}

    def test_the_peak_of_blocks_awaiting_events_is_recorded_and_summarised(self):
        before = self.stats(0, 0, 0)
        steps = [fsdp_bench.step_record(i, 1.0, 100.0, self.stats(*peaks), before, 0)
                 for i, peaks in enumerate([(110, 100, 100), (130, 100, 120), (120, 110, 111)])]
        self.assertEqual([s["primary"]["active_peak"] for s in steps], [100, 120, 111])
        out = fsdp_bench.summarize(steps, skip=0)
        self.assertEqual(out["peak_active_bytes"], 120)
        self.assertEqual(out["active_over_allocated"], round(120 / 110, 4))
        self.assertEqual(out["reserved_over_allocated"], round(130 / 110, 4))
        for s in steps:  # results written before active bytes were read
            del s["primary"]["active_peak"]
        self.assertIsNone(fsdp_bench.summarize(steps, skip=0)["active_over_allocated"])


class StepRatiosTest(unittest.TestCase):
    @staticmethod
    def steps(times, moved=()):
        out = []
        for i, t in enumerate(times, start=1):
            rec = {"step": i, "time_ms": t}
            if moved is not None:
                rec["counters"] = {"page_moves.pages_unmapped": 2} if i in moved else {}
            out.append(rec)
        return out

    def test_each_step_is_paired_with_the_same_step_and_split_by_moves(self):
        torch = [{"per_step": self.steps([900, 900, 100, 200, 100, 400], moved=None)},
                 {"per_step": self.steps([900, 900, 100, 100, 100, 100], moved=None)}]
        ours = [{"per_step": self.steps([5, 5, 110, 200, 120, 400], moved={3, 5})},
                {"per_step": self.steps([5, 5, 100, 150, 100, 100], moved={4})}]
        with_moves, without = rounds.step_ratios(ours, torch)
        # the first SKIP_STEPS steps are left out, as in the step means
        self.assertEqual(sorted(with_moves), [1.1, 1.2, 1.5])
        self.assertEqual(sorted(without), [1.0, 1.0, 1.0, 1.0, 1.0])
        self.assertEqual(rounds._median_of(with_moves), [1.2, 3])
        no_counters = [{"per_step": self.steps([1, 1, 1, 1], moved=None)}]
        self.assertEqual(rounds.step_ratios(no_counters, torch[:1]), ([], []))

    def test_the_table_shows_both_medians(self):
        row = {"world": 2, "fsdp": "fsdp1", "setting": "ours-bound", "runs": 2,
               "mean_step_ms": 100.0, "mean_step_spread_ms": [90.0, 110.0],
               "ratio_mean_to_torch": [1.0, 1.1], "ratio_interval": None,
               "reserved_over_allocated": [1.0, 1.0],
               "step_ratio_with_moves": [1.126, 161], "step_ratio_without_moves": [1.091, 63]}
        self.assertIn("| 1.126 (161); 1.091 (63) |", rounds.table([row]))
        row["step_ratio_with_moves"] = None
        self.assertIn("| -; 1.091 (63) |", rounds.table([row]))


class SteadyStepsTest(unittest.TestCase):
    @staticmethod
    def record(times, peaks, unmapped=None):
        return {"per_step": [
            {"step": i, "time_ms": t, "primary": {"allocated_peak": p},
             "counters": {"page_moves.pages_unmapped": (unmapped or {}).get(i, 0)}}
            for i, (t, p) in enumerate(zip(times, peaks), start=1)]}

    def test_steady_steps_are_late_and_raise_no_peak_in_either_run(self):
        n = rounds.STEADY_FROM + 4
        peaks = [10] * n
        peaks[rounds.STEADY_FROM] = 12  # step STEADY_FROM + 1 raises the peak
        theirs = self.record([100] * n, peaks)
        mine_peaks = list(peaks)
        mine_peaks[rounds.STEADY_FROM + 2] = 13  # a step that raises only ours
        mine = self.record([110] * n, mine_peaks)
        first = rounds.STEADY_FROM
        self.assertEqual(rounds.steady_steps(mine, theirs), [first, first + 2, first + 4])
        self.assertEqual(rounds.steady_steps({"per_step": [{"step": 12, "time_ms": 1}]}, theirs),
                         [])

    def test_the_steady_ratio_sums_the_steady_steps_of_every_rank(self):
        n = rounds.STEADY_FROM + 1  # steps STEADY_FROM and STEADY_FROM + 1 are steady
        flat = [5] * n
        base = [self.record([100] * n, flat), self.record([200] * n, flat)]
        # rank 0: steady steps 110 and 130 against 100 and 100; rank 1: 200 and 260
        # against 200 and 200; the early steps (slow, moving pages) are left out
        t0 = [900] * (n - 2) + [110, 130]
        t1 = [900] * (n - 2) + [200, 260]
        mine = [self.record(t0, flat, {n - 1: 4, 3: 50}), self.record(t1, flat, {n: 2})]
        ratio, unmapped = rounds.steady_ratio(mine, base)
        self.assertAlmostEqual(ratio, (110 + 130 + 200 + 260) / 600)
        self.assertAlmostEqual(unmapped, (4 + 2) / 4)
        self.assertIsNone(rounds.steady_ratio([self.record([1] * 5, [1] * 5)], base[:1]))

    def test_the_table_shows_the_steady_interval(self):
        row = {"world": 2, "fsdp": "fsdp1", "setting": "ours-bound", "runs": 2,
               "mean_step_ms": 100.0, "mean_step_spread_ms": [90.0, 110.0],
               "ratio_mean_to_torch": [1.0, 1.1], "ratio_interval": None,
               "reserved_over_allocated": [1.0, 1.0],
               "steady_interval": [0.998, 0.981, 1.015], "steady_pages_unmapped": 5.1}
        self.assertIn("| 0.998 (0.981-1.015); 5.1 |", rounds.table([row]))


class MainTest(unittest.TestCase):
    def test_rounds_run_every_rank_and_summarise_them(self):
        """rounds.main with the launcher replaced: each run's ranks write their results
        where fsdp_bench would, and the summary reads them back."""
        launched = []

        def fake_launch(cmds, env, log, timeout, echo, tag):
            for argv, extra in cmds:
                out = argv[argv.index("--out") + 1]
                setting = argv[argv.index("--setting") + 1]
                fsdp = argv[argv.index("--fsdp") + 1]
                rank = int(extra.get("RANK", 0))
                launched.append((setting, fsdp, rank, env.get("GPUALLOC_SO")))
                rnd = int(os.path.basename(os.path.dirname(out))[1:])
                mean = 100.0 * (1 + rnd) * (1.1 if setting != "torch" else 1.0)
                write_run(os.path.dirname(os.path.dirname(out)), rnd, 2, fsdp, setting, mean,
                          rank=rank)
            return "ok", 0, 1.0, []

        real = rounds.run_all.launch
        rounds.run_all.launch = fake_launch
        try:
            with tempfile.TemporaryDirectory() as out:
                so = os.path.join(out, "lib.so")
                rounds.main(["--out", out, "--settings", "torch,ours-bound", "--rounds", "2",
                             "--fsdp", "fsdp1", "--gpualloc-so", so])
                with open(os.path.join(out, "rounds.json")) as f:
                    rows = {r["setting"]: r for r in json.load(f)["rows"]}
        finally:
            rounds.run_all.launch = real
        self.assertEqual([(s, r) for s, _, r, _ in launched],
                         [("torch", 0), ("torch", 1), ("ours-bound", 0), ("ours-bound", 1),
                          ("ours-bound", 0), ("ours-bound", 1), ("torch", 0), ("torch", 1)])
        self.assertTrue(all(so_path == so for _, _, _, so_path in launched))
        self.assertEqual(rows["ours-bound"]["ratio_mean_to_torch"], [1.1, 1.1])
        self.assertEqual(rows["ours-bound"]["runs"], 2)


class SideBySideTest(unittest.TestCase):
    def test_it_needs_the_fake_world_and_a_cpu_list_a_setting(self):
        with contextlib.redirect_stderr(io.StringIO()):
            with self.assertRaises(SystemExit):
                rounds.parse_args(["--out", "/tmp/x", "--side-by-side"])
            with self.assertRaises(SystemExit):
                rounds.parse_args(["--out", "/tmp/x", "--fake", "--side-by-side",
                                   "--settings", "torch,ours,ours-bound",
                                   "--rank-cpus", "0-3;4-7"])

    def test_a_rounds_settings_run_at_once_each_on_a_gpu_that_rotates(self):
        """main with the launcher replaced: the runs of a group must meet at a barrier
        (they run at the same time), each sees its own GPU and CPU list, and the setting
        on GPU 0 changes from round to round."""
        seen, lock = [], threading.Lock()
        meet = threading.Barrier(2, timeout=10)

        def fake_launch(cmds, env, log, timeout, echo, tag):
            (argv, extra), = cmds  # a fake world: one process
            meet.wait()  # a BrokenBarrierError here: the pair did not run at once
            out = argv[argv.index("--out") + 1]
            setting = argv[argv.index("--setting") + 1]
            rnd = int(os.path.basename(os.path.dirname(out))[1:])
            with lock:
                seen.append((rnd, setting, extra["CUDA_VISIBLE_DEVICES"],
                             argv[argv.index("taskset") + 2]))
            write_run(os.path.dirname(os.path.dirname(out)), rnd, 2, "fsdp2", setting,
                      110.0 if setting != "torch" else 100.0)
            return "ok", 0, 1.0, []

        real = rounds.run_all.launch
        rounds.run_all.launch = fake_launch
        try:
            with tempfile.TemporaryDirectory() as out:
                with contextlib.redirect_stdout(io.StringIO()):
                    rounds.main(["--out", out, "--fake", "--side-by-side", "--settings",
                                 "torch,ours-bound", "--rounds", "2", "--rank-cpus",
                                 "2-9;18-25"])
                with open(os.path.join(out, "rounds.json")) as f:
                    rows = {r["setting"]: r for r in json.load(f)["rows"]}
        finally:
            rounds.run_all.launch = real
        by_round = {}
        for rnd, setting, gpu, cpus in seen:
            by_round.setdefault(rnd, {})[gpu] = setting
            self.assertEqual(cpus, ["2-9", "18-25"][int(gpu)])
        self.assertEqual(sorted(by_round), [0, 1])
        self.assertEqual(sorted(by_round[0].values()), ["ours-bound", "torch"])
        self.assertNotEqual(by_round[0]["0"], by_round[1]["0"])
        self.assertEqual(rows["ours-bound"]["ratio_mean_to_torch"], [1.1, 1.1])


class CoresApartTest(unittest.TestCase):
    def test_apart_gives_a_list_of_cores_a_setting_side_by_side_and_a_rank_otherwise(self):
        real = rounds.cpu_cores.cores_apart
        asked = []

        def fake(count, per):
            asked.append((count, per))
            return [[10 * i + j for j in range(per)] for i in range(count)]

        rounds.cpu_cores.cores_apart = fake
        try:
            a = rounds.parse_args(["--out", "/tmp/x", "--fake", "--side-by-side", "--settings",
                                   "torch,ours", "--rank-cpus", "apart:3"])
            b = rounds.parse_args(["--out", "/tmp/x", "--worlds", "2,4", "--rank-cpus",
                                   "apart:2"])
        finally:
            rounds.cpu_cores.cores_apart = real
        self.assertEqual(asked, [(2, 3), (4, 2)])
        self.assertEqual(a.rank_cpus, ["0,1,2", "10,11,12"])
        self.assertEqual(b.rank_cpus, ["0,1", "10,11", "20,21", "30,31"])

    def test_too_few_cores_is_an_error_that_says_so(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            with self.assertRaises(SystemExit):
                rounds.parse_args(["--out", "/tmp/x", "--worlds", "2",
                                   "--rank-cpus", "apart:100000"])
        self.assertIn("physical cores", err.getvalue())


class PackTest(unittest.TestCase):
    def test_a_command_stopped_midway_leaves_its_finished_runs_packed(self):
        runs = []

        def fake_launch(cmds, env, log, timeout, echo, tag):
            if len(runs) == 2:
                raise KeyboardInterrupt  # the command is stopped in its third run
            for argv, extra in cmds:
                out = argv[argv.index("--out") + 1]
                setting = argv[argv.index("--setting") + 1]
                rnd = int(os.path.basename(os.path.dirname(out))[1:])
                write_run(os.path.dirname(os.path.dirname(out)), rnd, 2, "fsdp1", setting,
                          100.0, rank=int(extra.get("RANK", 0)))
            runs.append(tag)
            return "ok", 0, 1.0, []

        real = rounds.run_all.launch
        rounds.run_all.launch = fake_launch
        try:
            with tempfile.TemporaryDirectory() as tmp:
                out, packed = os.path.join(tmp, "fsdp"), os.path.join(tmp, "fsdp.tar.gz")
                with self.assertRaises(KeyboardInterrupt):
                    rounds.main(["--out", out, "--settings", "torch,ours-bound", "--rounds",
                                 "2", "--fsdp", "fsdp1", "--pack", packed])
                with tarfile.open(packed) as tar:
                    names = sorted(n for n in tar.getnames() if n.endswith(".json"))
                self.assertFalse(os.path.exists(packed + ".part"))
        finally:
            rounds.run_all.launch = real
        self.assertEqual(len(names), 4, names)  # two runs, two ranks each
        self.assertTrue(all(n.startswith("fsdp/r0/w2/runs/") for n in names), names)


class LaterRoundsTest(unittest.TestCase):
    def test_a_later_command_runs_the_next_rounds_rotated_on(self):
        first = rounds.parse_args(["--out", "/tmp/x", "--settings", "torch,ours,ours-bound",
                                   "--rounds", "2"])
        later = rounds.parse_args(["--out", "/tmp/x", "--settings", "torch,ours,ours-bound",
                                   "--rounds", "2", "--first-round", "3"])
        self.assertEqual(sorted({r for r, _, _, _ in rounds.plan(first)}), [0, 1])
        self.assertEqual(sorted({r for r, _, _, _ in rounds.plan(later)}), [2, 3])
        third = [s for r, _, _, s in rounds.plan(later) if r == 2]
        self.assertEqual(third, ["ours-bound", "torch", "ours"])
        with self.assertRaises(SystemExit):
            rounds.parse_args(["--out", "/tmp/x", "--first-round", "0"])

    def test_the_report_reads_every_round_of_the_out_folder(self):
        with tempfile.TemporaryDirectory() as out:
            for rnd in range(4):
                write_run(out, rnd, 2, "fsdp2", "torch", 100.0)
                write_run(out, rnd, 2, "fsdp2", "ours", 110.0)
            args = rounds.parse_args(["--out", out, "--settings", "torch,ours", "--rounds",
                                      "4", "--fake"])
            rows = {r["setting"]: r for r in rounds.summarize(rounds.load(args),
                                                                 rounds.last_round(args))}
            self.assertEqual(rows["ours"]["runs"], 4)
            args = rounds.parse_args(["--out", out, "--settings", "torch,ours", "--rounds",
                                      "2", "--first-round", "3", "--fake"])
            rows = {r["setting"]: r for r in rounds.summarize(rounds.load(args),
                                                                 rounds.last_round(args))}
            self.assertEqual(rows["ours"]["runs"], 2, "rounds 3 and 4 only")


if __name__ == "__main__":
    unittest.main()
