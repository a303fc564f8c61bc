#!/usr/bin/env python3
"""FSDP's multi-stream allocation pattern on one GPU: fsdp_bench.py as rank 0 of N over
PyTorch's fake process group, every setting in interleaved rounds.

    GPUALLOC_SO=$PWD/target/release/liballoc_ffi.so python3 benchmarks/fsdp/fake_world.py \\
        --out out/fake --worlds 2,4 --fsdp fsdp2,fsdp1,fsdp1-limit \\
        --settings torch,torch-expandable,ours,ours-streamwait,ours-budget,ours-bound \\
        --rounds 2 --steps 20 --bench-args "--varlen 256"

With the fake process group FSDP shards the model N ways, gathers each unit's parameters
into buffers allocated on its all-gather stream, reduces gradients on its reduce-scatter
stream and frees across streams exactly as rank 0 of N GPUs does; only the collectives
move no data. So the allocator's part of a multi-GPU step (host waits on other streams'
events, stream waits, page moves) is measured without the GPUs, and without the
communication time that would hide some of it: an upper bound on what the allocator adds.

Rounds are interleaved: round r runs every (world, fsdp, setting) once, settings rotated
by r, so a slow spell of the host falls on different settings. Each run is one process
(the allocator cannot be swapped inside one).

Output: OUT/r<R>/w<N>/runs/*.json (fsdp_bench's), OUT/fake_world.json (the summary) and a
markdown table on stdout: per (world, fsdp, setting), the mean and median step over the
rounds with the ratio to PyTorch's default in the same round, peak reserved / peak
allocated, and gpu_alloc's per-step counters (host waits and their time, stream waits,
pages moved and their host time). Imports no torch.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fsdp_bench  # noqa: E402  (no torch at import)

BASELINE = fsdp_bench.BASELINE_SETTING
COUNTERS = (("stream_ops.host_waits", "host waits"), ("stream_ops.host_wait_ns", "host wait us"),
            ("stream_ops.stream_waits", "stream waits"),
            ("page_moves.pages_unmapped", "pages unmapped"),
            ("page_moves.pages_mapped", "pages mapped"), ("page_moves.host_ns", "move us"))


def csv(text):
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--worlds", type=lambda t: [int(x) for x in csv(t)], default=[2])
    p.add_argument("--fsdp", type=csv, default=["fsdp2"])
    p.add_argument("--settings", type=csv, default=[BASELINE, "ours"])
    p.add_argument("--shape", default="gpt2-medium", choices=sorted(fsdp_bench.SHAPES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--bench-args", default="", help="more arguments for fsdp_bench.py")
    p.add_argument("--run-timeout", type=float, default=180.0)
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for everything; runs that would start after it are skipped")
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args(argv)
    bad = [s for s in a.settings if s not in fsdp_bench.SETTINGS]
    bad += [f for f in a.fsdp if f not in fsdp_bench.FSDP_VARIANTS]
    if bad:
        p.error("unknown setting or fsdp variant: %s" % ",".join(bad))
    if BASELINE not in a.settings:
        p.error("--settings must include %s (the ratios' anchor)" % BASELINE)
    return a


def run_dir(out, rnd, world):
    return os.path.join(out, "r%d" % rnd, "w%d" % world)


def plan(args):
    """(round, world, fsdp, setting) in run order: settings rotated by the round."""
    order = []
    for r in range(args.rounds):
        k = r % len(args.settings)
        settings = args.settings[k:] + args.settings[:k]
        for world in args.worlds:
            for fsdp in args.fsdp:
                order.extend((r, world, fsdp, s) for s in settings)
    return order


def run(args, rnd, world, fsdp, setting):
    out = run_dir(args.out, rnd, world)
    cmd = [sys.executable, os.path.join(HERE, "fsdp_bench.py"), "--setting", setting,
           "--fsdp", fsdp, "--shape", args.shape, "--steps", str(args.steps), "--out", out,
           "--fake-world", str(world)] + args.bench_args.split()
    t0 = time.time()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=args.run_timeout)
        rc, text = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(
            e.stdout, bytes) else (e.stdout or "")
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    with open(os.path.join(out, "logs", "%s__%s.log" % (setting, fsdp)), "w") as f:
        f.write(text)
    print("[fake_world] round %d world %d %s %s: rc %s, %.0f s" % (
        rnd + 1, world, fsdp, setting, rc, time.time() - t0), flush=True)
    if rc != 0:
        tail = [ln for ln in text.splitlines() if "Error" in ln][-2:]
        for ln in tail:
            print("    " + ln[:300], flush=True)


def load(args):
    """{(world, fsdp, setting): [summary of each round or None]}"""
    runs = {}
    for rnd, world, fsdp, setting in plan(args):
        path = fsdp_bench.result_path(run_dir(args.out, rnd, world), setting, fsdp,
                                      args.shape, 0)
        try:
            with open(path) as f:
                s = json.load(f)
            if s.get("status") != "ok":
                s = None
        except (OSError, ValueError):
            s = None
        runs.setdefault((world, fsdp, setting), [None] * args.rounds)[rnd] = s
    return runs


def summarize(runs, rounds):
    """Rows of the table: one per (world, fsdp, setting) with a run in any round."""
    rows = []
    for (world, fsdp, setting), per_round in sorted(runs.items()):
        ok = [(r, s) for r, s in enumerate(per_round) if s]
        if not ok:
            rows.append({"world": world, "fsdp": fsdp, "setting": setting, "runs": 0})
            continue
        base = runs.get((world, fsdp, BASELINE), [None] * rounds)
        ratios = [s["mean_step_ms"] / base[r]["mean_step_ms"] for r, s in ok
                  if base[r] and base[r].get("mean_step_ms")]
        means = [s["mean_step_ms"] for _, s in ok]
        row = {
            "world": world, "fsdp": fsdp, "setting": setting, "runs": len(ok),
            "mean_step_ms": round(statistics.fmean(means), 2),
            "mean_step_spread_ms": [round(min(means), 2), round(max(means), 2)],
            "median_step_ms": round(statistics.fmean(s["median_step_ms"] for _, s in ok), 2),
            "ratio_mean_to_torch": [round(x, 3) for x in ratios],
            "reserved_over_allocated": max(s["reserved_over_allocated"] or 0 for _, s in ok),
            "peak_reserved_gib": round(max(s["peak_reserved_bytes"] or 0 for _, s in ok)
                                       / 2**30, 3),
        }
        counted = [s["counters_per_step"] for _, s in ok if s.get("counters_per_step")]
        if counted:
            row["counters_per_step"] = {k: round(statistics.fmean(c.get(k, 0) for c in counted), 2)
                                        for k, _ in COUNTERS}
        rows.append(row)
    return rows


def table(rows):
    head = ["world", "fsdp", "setting", "mean step ms (spread)", "/ torch, per round",
            "reserved / allocated"] + [name for _, name in COUNTERS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if not r["runs"]:
            lines.append("| %d | %s | %s | failed |%s" % (r["world"], r["fsdp"], r["setting"],
                                                          " |" * (len(head) - 3)))
            continue
        c = r.get("counters_per_step")
        cells = [str(r["world"]), r["fsdp"], r["setting"],
                 "%.1f (%.1f-%.1f)" % (r["mean_step_ms"], *r["mean_step_spread_ms"]),
                 ", ".join("%.3f" % x for x in r["ratio_mean_to_torch"]),
                 "%.3f" % r["reserved_over_allocated"]]
        for k, _ in COUNTERS:
            v = c.get(k) if c else None
            if v is not None and k.endswith("_ns"):
                v = v / 1000.0
            cells.append("-" if v is None else "%.1f" % v)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    if not args.report_only:
        for rnd, world, fsdp, setting in plan(args):
            if args.budget and time.time() - t0 > args.budget:
                print("[fake_world] budget spent: skipping the rest", flush=True)
                break
            run(args, rnd, world, fsdp, setting)
    rows = summarize(load(args), args.rounds)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fake_world.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
