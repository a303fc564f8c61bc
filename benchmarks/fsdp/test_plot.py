#!/usr/bin/env python3
"""CPU tests of the FSDP benchmark's plot and report code, with fake data (no torch, no GPU):

    python3 benchmarks/fsdp/test_plot.py            # unittest
    python3 benchmarks/fsdp/test_plot.py --write D  # also writes a fake report into D to look at
"""
import contextlib
import io
import json
import math
import os
import random
import shutil
import sys
import tempfile
import unittest
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fsdp_bench  # noqa: E402
import plot  # noqa: E402
import run_all  # noqa: E402

SVG = "{http://www.w3.org/2000/svg}"
GIB = 2 ** 30


def fake_rank(setting, fsdp, shape, rank, steps=30, seed=0, loss_shift=0.0, stats_source="torch"):
    """A rank summary as fsdp_bench.py writes it, with made-up figures: the torch settings
    spike above the allocations (more with fsdp1), ours stays close."""
    rnd = random.Random(hash((setting, fsdp, shape, rank, seed)) & 0xFFFF)
    base = (14.0 if shape == "gpt2-medium" else 20.0) * GIB
    spike = {"torch": 0.14, "torch-avoid-rs": 0.10, "torch-expandable": 0.08}.get(setting, 0.03)
    spike *= 1.3 if fsdp == "fsdp1" else 1.0
    per_step, before = [], None
    for i in range(1, steps + 1):
        alloc = base * (1 + 0.01 * rnd.random())
        reserved = alloc * (1 + spike * min(1.0, i / 4.0) + 0.005 * rnd.random())
        s = {"reserved": int(reserved * 0.9), "reserved_peak": int(reserved),
             "allocated": int(alloc * 0.5), "allocated_peak": int(alloc),
             "num_device_alloc": 40 + i // 10, "num_device_free": 0, "num_alloc_retries": 0}
        rec = {"step": i, "loss": 10.9 - 0.01 * i + loss_shift + 0.1 * rank,
               "time_ms": 140.0 + rnd.random() * 10 + (900 if i == 1 else 0),
               "device_used": int(reserved + 2 * GIB), "primary": s}
        if setting.startswith("ours"):
            rec["gpu_alloc"] = s
        per_step.append(rec)
    summary = {"setting": setting, "fsdp": fsdp, "shape": shape, "rank": rank, "world_size": 2,
               "allocator": "gpualloc" if setting.startswith("ours") else "torch", "bridge": False,
               "steps": steps, "model": "plain", "torch_version": "2.11.0", "device_name": "H200",
               "stats_source": stats_source, "status": "ok"}
    summary.update(fsdp_bench.summarize(per_step))
    summary["num_device_alloc"] = per_step[-1]["primary"]["num_device_alloc"]
    summary["per_step"] = per_step
    return summary


def fake_out_dir(root, settings=None, fsdps=("fsdp2", "fsdp1"), shapes=("gpt2-medium",)):
    settings = settings or list(fsdp_bench.SETTINGS)
    attempts = {}
    for shape in shapes:
        for fsdp in fsdps:
            for setting in settings:
                name = fsdp_bench.run_name(setting, fsdp, shape)
                for r in range(2):
                    d = fake_rank(setting, fsdp, shape, r,
                                  loss_shift=0.0 if setting == "torch" else 1e-3 * (1 + r),
                                  stats_source="gpu_alloc" if setting.startswith("ours") else "torch")
                    fsdp_bench.write_json(fsdp_bench.result_path(root, setting, fsdp, shape, r), d)
                attempts[name] = {"status": "ok", "rc": 0, "wall_s": 12.5}
    return attempts


def read(path):
    with open(path) as f:
        return f.read()


def parse_svg(text):
    root = ET.fromstring(text)
    assert root.tag == SVG + "svg", root.tag
    return root


class NiceTicks(unittest.TestCase):
    def test_cover_and_round(self):
        for lo, hi in [(0, 1), (12.3, 15.9), (1, 30), (0.001, 0.0042), (-3, 7), (5, 5), (0, 0),
                       (1e9, 3e9), (14.02, 14.03)]:
            t = plot.nice_ticks(lo, hi)
            self.assertGreaterEqual(len(t), 2, (lo, hi, t))
            self.assertLessEqual(t[0], min(lo, hi) + 1e-9, (lo, hi, t))
            self.assertGreaterEqual(t[-1], max(lo, hi) - 1e-9, (lo, hi, t))
            self.assertLessEqual(len(t), 12, (lo, hi, t))
            steps = {round(b - a, 9) for a, b in zip(t, t[1:])}
            self.assertEqual(len(steps), 1, (lo, hi, t))

    def test_reversed(self):
        self.assertEqual(plot.nice_ticks(10, 0), plot.nice_ticks(0, 10))


class RenderSvg(unittest.TestCase):
    def panels(self):
        return [
            {"title": "a <&> b", "series": [
                {"label": "torch & co", "color": "#d62728", "points": [(1, 1.0), (2, 3.0), (3, 2.0)]},
                {"label": "ours", "color": "#1f77b4", "dash": "6,3",
                 "points": [(1, 1.0), (2, None), (3, float("nan")), (4, 2.0), (5, 2.5)]},
                {"label": "single", "color": "#2ca02c", "points": [(2, 2.0)]},
                {"label": "hidden", "color": "#000", "points": [(1, 1)], "legend": False},
            ]},
            {"title": "empty", "series": []},
            {"title": "flat", "series": [{"label": "torch & co", "color": "#d62728",
                                          "points": [(1, 0.0), (2, 0.0)]}]},
        ]

    def test_well_formed_and_complete(self):
        text = plot.render_svg(self.panels(), title="T <x>", note="n & m")
        root = parse_svg(text)
        texts = [t.text for t in root.iter(SVG + "text")]
        self.assertIn("T <x>", texts)
        self.assertIn("a <&> b", texts)
        self.assertIn("no data", texts)
        self.assertIn("n & m", texts)
        # Legend: distinct (label, color, dash), hidden ones left out.
        self.assertEqual(texts.count("torch & co"), 1)
        self.assertNotIn("hidden", texts)
        polylines = list(root.iter(SVG + "polyline"))
        # torch (1) + ours split at the missing values (1 run of >1 point + 1 single) + flat (1)
        self.assertEqual(len(polylines), 3)
        self.assertEqual(len(list(root.iter(SVG + "circle"))), 3)  # ours' lone point, single, hidden
        for pl in polylines:
            for xy in pl.get("points").split():
                x, y = map(float, xy.split(","))
                self.assertTrue(math.isfinite(x) and math.isfinite(y))
        w, h = float(root.get("width")), float(root.get("height"))
        for el in root.iter():
            for attr in ("x", "y", "x1", "x2", "y1", "y2", "cx", "cy"):
                if el.get(attr) is not None:
                    v = float(el.get(attr))
                    self.assertTrue(-1 <= v <= max(w, h) + 1, (el.tag, attr, v))

    def test_no_panels(self):
        root = parse_svg(plot.render_svg([]))
        self.assertIn("no results", [t.text for t in root.iter(SVG + "text")])

    def test_points_inside_plot_area(self):
        pan = [{"title": "p", "series": [{"label": "s", "color": "#000",
                                          "points": [(i, 10 + math.sin(i)) for i in range(1, 31)]}]}]
        root = parse_svg(plot.render_svg(pan, cols=1))
        frame = [r for r in root.iter(SVG + "rect") if r.get("fill") == "none"][0]
        fx, fy = float(frame.get("x")), float(frame.get("y"))
        fw, fh = float(frame.get("width")), float(frame.get("height"))
        pts = [tuple(map(float, p.split(","))) for p in
               next(root.iter(SVG + "polyline")).get("points").split()]
        self.assertEqual(len(pts), 30)
        for x, y in pts:
            self.assertTrue(fx - 0.1 <= x <= fx + fw + 0.1 and fy - 0.1 <= y <= fy + fh + 0.1)
        self.assertEqual(sorted(pts), pts)  # x increases with the step


class ReservedPanels(unittest.TestCase):
    def test_from_results(self):
        tmp = tempfile.mkdtemp()
        try:
            attempts = fake_out_dir(tmp, settings=["torch", "ours", "ours-streamwait"])
            runs = run_all.collect(tmp, attempts)
            panels = plot.reserved_panels({"runs": runs})
            self.assertEqual([p["title"] for p in panels],
                             ["gpt2-medium / fsdp2", "gpt2-medium / fsdp1"])
            for p in panels:
                # 3 settings x 2 ranks + the allocated reference
                self.assertEqual(len(p["series"]), 7)
                self.assertEqual(p["series"][-1]["color"], plot.REFERENCE_COLOR)
                torch0 = p["series"][0]
                self.assertEqual(torch0["color"], plot.SETTING_COLORS["torch"])
                self.assertEqual(len(torch0["points"]), 30)
                self.assertTrue(all(5 < y < 30 for _, y in torch0["points"]))  # GiB
                self.assertIsNotNone(p["series"][1]["dash"])  # rank 1
                self.assertFalse(p["series"][1]["legend"])
            path = os.path.join(tmp, "x.svg")
            plot.write_reserved_svg({"runs": runs}, path)
            root = parse_svg(read(path))
            legend = [t.text for t in root.iter(SVG + "text")]
            for s in ("torch", "ours", "ours-streamwait"):
                self.assertEqual(legend.count(s), 1)
        finally:
            shutil.rmtree(tmp)

    def test_unknown_setting_and_missing_steps(self):
        results = {"runs": [
            {"setting": "other", "fsdp": "fsdp2", "shape": "s", "ranks": [
                {"rank": 0, "per_step": [{"step": 1, "primary": {"reserved_peak": GIB}},
                                         {"step": 2, "primary": {}}]}]},
            {"setting": "torch", "fsdp": "fsdp2", "shape": "s", "ranks": [{"rank": 0}]},
        ]}
        panels = plot.reserved_panels(results)
        self.assertEqual(len(panels), 1)
        parse_svg(plot.render_svg(panels))


class Report(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def test_table_and_files(self):
        attempts = fake_out_dir(self.tmp)
        # A failed run with no files, and one with a RESULT line only.
        attempts["ours__fsdp1-limit__gpt2-medium"] = {"status": "timeout", "rc": 1, "wall_s": 240}
        attempts["torch__fsdp1-limit__gpt2-medium"] = {
            "status": "error", "rc": 1, "wall_s": 30,
            "result_lines": [{"rank": 0, "status": "error", "error": "OutOfMemoryError: x|y\nmore",
                              "steps": 30, "steps_done": 3, "losses": [1.0, 2.0, 3.0]}]}
        meta = {"steps": 30, "launcher": "torchrun", "skipped": ["ours__fsdp2__1.3b"]}
        results, table = run_all.write_reports(self.tmp, attempts, meta)
        for fn in ("fsdp_results.json", "fsdp_table.md", "fsdp_reserved.svg"):
            self.assertTrue(os.path.isfile(os.path.join(self.tmp, fn)), fn)
        data = json.loads(read(os.path.join(self.tmp, "fsdp_results.json")))
        # Every setting under two FSDP variants, plus the two failed attempts.
        self.assertEqual(len(data["runs"]), 2 * len(fsdp_bench.SETTINGS) + 2)
        parse_svg(read(os.path.join(self.tmp, "fsdp_reserved.svg")))

        rows = [l for l in table.splitlines() if l.startswith("| ") and "|---" not in l]
        head = [c.strip() for c in rows[0].strip("|").split("|")]
        self.assertEqual(head, run_all.TABLE_HEAD)
        body = [[c.strip() for c in r.strip("|").split("|")] for r in rows[1:]
                if r.count("|") == len(head) + 1]
        by = {(r[0], r[1], r[2], r[3]): dict(zip(head, r)) for r in body}
        t0 = by[("torch", "fsdp2", "gpt2-medium", "0")]
        self.assertEqual(t0["max abs loss diff vs torch"], "baseline")
        o1 = by[("ours", "fsdp2", "gpt2-medium", "1")]
        self.assertEqual(o1["max abs loss diff vs torch"], "2.00e-03")
        self.assertIn("stats: gpu_alloc", o1["notes"])
        self.assertIn("no bridge", o1["notes"])
        self.assertEqual(t0["notes"], "")
        ratio = float(o1["reserved/allocated"])
        self.assertAlmostEqual(ratio, float(o1["peak reserved GiB"]) / float(o1["peak allocated GiB"]),
                               delta=0.01)
        self.assertGreater(float(t0["reserved/allocated"]), ratio)
        self.assertEqual(o1["device allocs"], "43")
        self.assertTrue(140 <= float(o1["median step ms"]) <= 150)  # the 1st step's 900 ms left out
        to = by[("ours", "fsdp1-limit", "gpt2-medium", "—")]
        self.assertEqual(to["notes"], "timeout")
        err = by[("torch", "fsdp1-limit", "gpt2-medium", "0")]
        self.assertIn("error", err["notes"])
        self.assertIn("3/30 steps", err["notes"])
        self.assertNotIn("x|y", table)
        self.assertIn("Not run (budget): ours__fsdp2__1.3b", table)
        self.assertIn("**gpt2-medium**", table)
        # Two ranks per (setting, variant) run, plus a row per failed attempt.
        self.assertEqual(len(body), 2 * len(fsdp_bench.SETTINGS) * 2 + 1 + 1)

    def test_no_baseline_and_nan(self):
        attempts = fake_out_dir(self.tmp, settings=["ours"], fsdps=("fsdp2",))
        results, table = run_all.write_reports(self.tmp, attempts, {})
        self.assertTrue(all(rk["max_abs_loss_delta"] is None
                            for r in results["runs"] for rk in r["ranks"]))
        runs = [{"setting": "torch", "fsdp": "f", "shape": "s", "ranks": [{"rank": 0, "losses": [1.0, 2.0]}]},
                {"setting": "ours", "fsdp": "f", "shape": "s", "ranks": [{"rank": 0, "losses": [1.5, float("nan")]}]}]
        run_all.add_loss_deltas(runs)
        self.assertTrue(math.isnan(runs[1]["ranks"][0]["max_abs_loss_delta"]))
        self.assertEqual(runs[0]["ranks"][0]["max_abs_loss_delta"], 0.0)

    def test_report_only_merges_invocations(self):
        fake_out_dir(self.tmp, settings=["torch"], fsdps=("fsdp2",))
        # No attempts.json: the report is built from runs/*.json alone.
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            self.assertEqual(run_all.main(["--out", self.tmp, "--report-only"]), 0)
        self.assertIn("| torch | fsdp2 | gpt2-medium | 0 |", printed.getvalue())
        data = json.loads(read(os.path.join(self.tmp, "fsdp_results.json")))
        self.assertEqual([r["name"] for r in data["runs"]], ["torch__fsdp2__gpt2-medium"])
        self.assertEqual(data["runs"][0]["status"], "ok")


class Plan(unittest.TestCase):
    def test_order_and_parse(self):
        a = run_all.parse_args(["--settings", "ours,torch", "--fsdp", "fsdp1,fsdp2",
                                "--shapes", "1.3b,gpt2-medium", "--steps", "5"])
        p = run_all.plan(a.settings, a.fsdp, a.shapes)
        self.assertEqual(p[0], ("torch", "fsdp2", "gpt2-medium"))
        self.assertEqual(p[1], ("ours", "fsdp2", "gpt2-medium"))
        self.assertEqual(p[-1], ("ours", "fsdp1", "1.3b"))
        self.assertEqual(len(p), 8)
        with self.assertRaises(SystemExit):
            run_all.parse_args(["--settings", "nope"])

    def test_setting_env(self):
        env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "GPUALLOC_CONF": "x"}
        fsdp_bench.apply_setting_env("torch-avoid-rs", env)
        self.assertEqual(env, {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1", "NCCL_NVLS_ENABLE": "0"})
        fsdp_bench.apply_setting_env("torch-expandable", env)
        self.assertEqual(env, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                               "NCCL_NVLS_ENABLE": "0"})

    def test_commands(self):
        a = run_all.parse_args(["--launcher", "direct", "--nproc", "2", "--bench-args", "--model hf"])
        cmds = run_all.commands(a, "ours", "fsdp2", "1.3b", "/o", 1234)
        self.assertEqual(len(cmds), 2)
        self.assertEqual(cmds[1][1]["RANK"], "1")
        self.assertEqual(cmds[0][0][-2:], ["--model", "hf"])
        a = run_all.parse_args(["--torchrun", "torchrun"])
        (argv, extra), = run_all.commands(a, "ours", "fsdp2", "1.3b", "/o", 1234)
        self.assertEqual(argv[:3], ["torchrun", "--nproc-per-node", "2"])
        self.assertEqual(extra, {})


def write_example(out):
    os.makedirs(out, exist_ok=True)
    attempts = fake_out_dir(out, fsdps=("fsdp2", "fsdp1", "fsdp1-limit"),
                            shapes=("gpt2-medium", "1.3b"))
    run_all.write_reports(out, attempts, {"steps": 30, "launcher": "fake data"})
    print("fake report in %s" % out)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--write":
        write_example(sys.argv[2])
        sys.argv[1:3] = []
    unittest.main()
