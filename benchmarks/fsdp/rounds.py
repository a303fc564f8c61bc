#!/usr/bin/env python3
"""FSDP under every setting in interleaved rounds, on N GPUs or, with --fake, on one GPU
as rank 0 of N over PyTorch's fake process group:

    GPUALLOC_SO=$PWD/target/release/liballoc_ffi.so python3 benchmarks/fsdp/rounds.py \\
        --out out/rounds --worlds 2 --fsdp fsdp2,fsdp1,fsdp1-limit \\
        --settings torch,torch-expandable,ours-streamwait-unmap,ours-budget,ours-bound \\
        --rounds 4 --steps 30 --bench-args "--varlen 256"

On N GPUs each run is one process group of N ranks (started directly, with torchrun's
variables, as `run_all.py --launcher direct` does). With --fake, FSDP shards the model N
ways, gathers each unit's parameters into buffers allocated on its all-gather stream,
reduces gradients on its reduce-scatter stream and frees across streams exactly as rank 0
of N GPUs does; only the collectives move no data. So the allocator's part of a
multi-GPU step (host waits on other streams' events, stream waits, page moves) is measured
on one GPU, without the communication time that would hide some of it: an upper bound on
what the allocator adds.

Rounds are interleaved: round r runs every (world, fsdp, setting) once, the settings
rotated by r (compare_workloads' round_order), so a slow spell of the machine falls on
different settings. With --fake and --side-by-side, the settings of one (round, world,
fsdp) run at the same time instead, each on a GPU of its own (the i-th of the rotated
order on GPU i, so each setting changes GPU from round to round, and on the i-th CPU
list of --rank-cpus): a slow spell of the host then falls on PyTorch's run and its
pair alike, and the ratio of the two is what remains. Each run is its own process (the
allocator cannot be swapped inside one). Step times of multi-GPU runs move by 10-20%
between rounds on the same machine, so a setting is compared with PyTorch's default of
the same round, and the per-round ratios are summarised by their geometric mean and 95%
interval.

Output: OUT/r<R>/w<N>/runs/*.json (fsdp_bench's, one per rank), OUT/rounds.json (the
summary) and a markdown table on stdout: per (world, fsdp, setting), the mean step over
the rounds (each round's mean over its ranks of the mean over steps 3..N) and its
spread, the ratio to PyTorch's default in each round and their interval with a verdict
on the 1.02 target, each timed step over PyTorch default's same step (the same sequence
lengths; same round and rank) split by whether it moved pages (medians: the steps without
moves show the runs' difference with no move at all), peak reserved / peak allocated over
ranks and rounds, peak active /
peak allocated (active bytes count freed blocks still awaiting other streams' events
too: the floor for an allocator that adds no waits), and gpu_alloc's per-step counters (host waits and their time, stream waits, pages moved and their host
time). Imports no torch.
"""
import argparse
import functools
import json
import os
import statistics
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "python", "examples"))

import compare_workloads as cw  # noqa: E402  (round order, ratio interval; no torch)
import cpu_cores  # noqa: E402  (CPU lists apart)
import fsdp_bench  # noqa: E402  (no torch at import)
import run_all  # noqa: E402  (the ranks' commands and environment, the launcher)

BASELINE = fsdp_bench.BASELINE_SETTING
COUNTERS = (("stream_ops.host_waits", "host waits"), ("stream_ops.host_wait_ns", "host wait us"),
            ("stream_ops.stream_waits", "stream waits"),
            ("page_moves.pages_unmapped", "pages unmapped"),
            ("page_moves.pages_mapped", "pages mapped"), ("page_moves.host_ns", "move us"),
            ("page_moves.blocks_lent", "blocks lent"))


def csv(text):
    return [x.strip() for x in text.split(",") if x.strip()]


def rank_cpus(text):
    """--rank-cpus: CPU lists separated by ';', or cpu_cores.Apart for 'apart:N'."""
    try:
        apart = cpu_cores.parse_apart(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))
    return apart or [x.strip() for x in text.split(";") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--worlds", type=lambda t: [int(x) for x in csv(t)], default=[2],
                   help="ranks per run: GPUs, or with --fake the fake world's size")
    p.add_argument("--fake", action="store_true",
                   help="one GPU: one process as rank 0 of each world over the fake process "
                        "group")
    p.add_argument("--fsdp", type=csv, default=["fsdp2"])
    p.add_argument("--settings", type=csv, default=[BASELINE, "ours"])
    p.add_argument("--shape", default="gpt2-medium", choices=sorted(fsdp_bench.SHAPES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--first-round", type=int, default=1,
                   help="number of the first round to run (from 1): a later command adds "
                        "rounds to the same OUT; --report-only reads rounds FIRST..FIRST+"
                        "ROUNDS-1 (give 1 and the total to summarise all)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--bench-args", default="", help="more arguments for fsdp_bench.py")
    p.add_argument("--run-timeout", type=float, default=180.0)
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for everything; runs that would start after it are skipped")
    p.add_argument("--gpualloc-so", default=None,
                   help="liballoc_ffi.so for the ours-* settings (default: $GPUALLOC_SO, else "
                        "gpu_alloc's own search)")
    p.add_argument("--rank-cpus", type=rank_cpus, default=[],
                   help="one CPU list a rank, separated by ';' (e.g. '4-11;20-27'): rank r runs "
                        "under `taskset -c` of the r-th, so the ranks' host threads neither "
                        "migrate nor share cores (a multi-GPU step is host-bound enough for "
                        "that to move it by 10-20%%); 'apart:N': lists of N physical cores "
                        "that share no core, one a rank (a setting with --side-by-side)")
    p.add_argument("--pack", default=None, metavar="FILE.tar.gz",
                   help="after every run, OUT packed into this one file (written whole, then "
                        "renamed): a command stopped midway leaves every finished run in it")
    p.add_argument("--side-by-side", action="store_true",
                   help="with --fake: the settings of a round run at the same time, the i-th "
                        "(rotated each round) on GPU i and the i-th CPU list of --rank-cpus; "
                        "needs a GPU a setting")
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args(argv)
    if isinstance(a.rank_cpus, cpu_cores.Apart):
        lists = len(a.settings) if a.side_by_side else max(1 if a.fake else w for w in a.worlds)
        try:
            a.rank_cpus = [cpu_cores.format_cpus(c)
                           for c in cpu_cores.cores_apart(lists, a.rank_cpus.per)]
        except ValueError as e:
            p.error(str(e))
    bad = [s for s in a.settings if s not in fsdp_bench.SETTINGS]
    bad += [f for f in a.fsdp if f not in fsdp_bench.FSDP_VARIANTS]
    if bad:
        p.error("unknown setting or fsdp variant: %s" % ",".join(bad))
    if BASELINE not in a.settings:
        p.error("--settings must include %s (the ratios' anchor)" % BASELINE)
    if a.rank_cpus and len(a.rank_cpus) < max(1 if a.fake else w for w in a.worlds):
        p.error("--rank-cpus names %d CPU lists, fewer than the ranks of a run"
                % len(a.rank_cpus))
    if a.rounds < 1 or a.first_round < 1 or a.steps <= fsdp_bench.SKIP_STEPS:
        p.error("--rounds and --first-round must be >= 1 and --steps > %d"
                % fsdp_bench.SKIP_STEPS)
    if a.fake and min(a.worlds) < 2:
        p.error("--fake needs worlds of 2 or more ranks")
    if a.side_by_side and not a.fake:
        p.error("--side-by-side runs one process a setting: it needs --fake")
    if a.side_by_side and a.rank_cpus and len(a.rank_cpus) < len(a.settings):
        p.error("--side-by-side with --rank-cpus needs a CPU list a setting (%d given for "
                "%d settings)" % (len(a.rank_cpus), len(a.settings)))
    return a


def run_dir(out, rnd, world):
    return os.path.join(out, "r%d" % rnd, "w%d" % world)


def ranks_written(args, world):
    """The ranks whose results a run leaves: rank 0 alone in a fake world."""
    return [0] if args.fake else list(range(world))


def last_round(args):
    """The number of the last round this invocation runs or reads (from 1)."""
    return args.first_round - 1 + args.rounds


def plan(args):
    """(round, world, fsdp, setting) in run order: settings rotated by the round."""
    order = []
    for r in range(args.first_round - 1, last_round(args)):
        settings = cw.round_order(args.settings, r + 1)
        for world in args.worlds:
            for fsdp in args.fsdp:
                order.extend((r, world, fsdp, s) for s in settings)
    return order


def side_by_side_groups(args):
    """The plan in groups that run at the same time: with --side-by-side one group a
    (round, world, fsdp), its settings in their rotated order (the i-th on GPU i);
    otherwise one run a group."""
    if not args.side_by_side:
        return [[run] for run in plan(args)]
    groups = {}
    for rnd, world, fsdp, setting in plan(args):
        groups.setdefault((rnd, world, fsdp), []).append((rnd, world, fsdp, setting))
    return list(groups.values())


def commands(args, world, fsdp, setting, out, slot=None):
    """[(argv, extra environment)]: one process for a fake world, one per rank otherwise.
    `slot` (--side-by-side): the process's GPU and CPU list, by its place in the group."""
    launch = argparse.Namespace(steps=args.steps, nproc=world, launcher="direct",
                                python=sys.executable, torchrun=None,
                                bench_args=args.bench_args + (
                                    " --fake-world %d" % world if args.fake else ""))
    cmds = run_all.commands(launch, setting, fsdp, args.shape, out, run_all.free_port())
    if args.fake:  # no process group variables: fsdp_bench builds the fake one itself
        cmds = [(argv, {}) for argv, _ in cmds[:1]]
    if slot is not None:
        cmds = [(argv, dict(env, CUDA_VISIBLE_DEVICES=str(slot))) for argv, env in cmds]
    if args.rank_cpus:
        cmds = [(["taskset", "-c", args.rank_cpus[r if slot is None else slot]] + argv, env)
                for r, (argv, env) in enumerate(cmds)]
    return cmds


def run_group(args, group, left):
    """Runs one group of side_by_side_groups: alone, or its runs at the same time, each
    in a thread of its own (each waits on its processes)."""
    if not args.side_by_side:
        run(args, *group[0], left)
        return
    cw.at_once([functools.partial(run, args, *g, left, slot=i) for i, g in enumerate(group)])


def run(args, rnd, world, fsdp, setting, left, slot=None):
    out = run_dir(args.out, rnd, world)
    for r in ranks_written(args, world):  # no stale result from an earlier invocation
        try:
            os.unlink(fsdp_bench.result_path(out, setting, fsdp, args.shape, r))
        except FileNotFoundError:
            pass
    env = run_all.run_env(args, setting)
    log = os.path.join(out, "logs", "%s__%s.log" % (setting, fsdp))
    status, rc, wall, _ = run_all.launch(
        commands(args, world, fsdp, setting, out, slot), env, log, min(args.run_timeout, left),
        lambda line: line.startswith("Traceback") or "Error" in line,
        "%s %s" % (setting, fsdp))
    print("[rounds] round %d world %d %s %s: %s (rc %s), %.0f s" % (
        rnd + 1, world, fsdp, setting, status, rc, wall), flush=True)


def load(args):
    """{(world, fsdp, setting): [each round's rank summaries (all ranks ok) or None]}"""
    runs = {}
    for rnd, world, fsdp, setting in plan(args):
        ranks = []
        for r in ranks_written(args, world):
            path = fsdp_bench.result_path(run_dir(args.out, rnd, world), setting, fsdp,
                                          args.shape, r)
            try:
                with open(path) as f:
                    s = json.load(f)
            except (OSError, ValueError):
                s = None
            ranks.append(s if s and s.get("status") == "ok" else None)
        got = ranks if all(ranks) else None
        runs.setdefault((world, fsdp, setting), [None] * last_round(args))[rnd] = got
    return runs


def round_step(ranks):
    """One round's step: the mean over ranks of each rank's mean step (the ranks wait for
    each other in every collective, so they differ little)."""
    return statistics.fmean(s["mean_step_ms"] for s in ranks)


def step_ratios(ranks, base_ranks):
    """Each timed step of each rank over PyTorch default's same step of the same round and
    rank (the same sequence lengths), split by whether the step moved pages (gpu_alloc's
    per-step counters): (ratios of steps with moves, ratios of steps without). The steps
    without moves show how far two runs differ with no move at all."""
    with_moves, without = [], []
    for mine, theirs in zip(ranks, base_ranks):
        ref = {s["step"]: s["time_ms"]
               for s in (theirs.get("per_step") or [])[fsdp_bench.SKIP_STEPS:]}
        for s in (mine.get("per_step") or [])[fsdp_bench.SKIP_STEPS:]:
            if s["step"] not in ref or "counters" not in s or not ref[s["step"]]:
                continue
            c = s["counters"]
            moved = c.get("page_moves.pages_unmapped", 0) or c.get("page_moves.pages_mapped", 0)
            (with_moves if moved else without).append(s["time_ms"] / ref[s["step"]])
    return with_moves, without


# Steady steps: from this step on (1-based), those that raise the allocated peak in
# neither run. Early steps and new highs are where any heap grows (and where the settings
# past a level move most of their pages); a training run of thousands of steps has the
# same few of them, so the steady steps' mean is what its throughput follows.
STEADY_FROM = 11


def steady_steps(mine, theirs):
    """The steps (numbers) of one rank's run and PyTorch default's of the same round and
    rank that are steady in both: at least STEADY_FROM, and the allocated peak
    (`primary.allocated_peak`) no higher than at the step before."""
    def steady(per_step):
        out, last = set(), None
        for s in per_step or []:
            peak = (s.get("primary") or {}).get("allocated_peak")
            if peak is None:
                return set()
            if last is not None and peak <= last and s["step"] >= STEADY_FROM:
                out.add(s["step"])
            last = peak if last is None else max(last, peak)
        return out
    return sorted(steady(mine.get("per_step")) & steady(theirs.get("per_step")))


def steady_ratio(ranks, base_ranks):
    """One round's steady mean step over PyTorch default's (the steps steady in both, their
    times summed over ranks), and this run's pages unmapped per steady step; None where a
    rank has no steady step or no per-step record."""
    mine_ms = theirs_ms = unmapped = count = 0
    for mine, theirs in zip(ranks, base_ranks):
        steps = steady_steps(mine, theirs)
        if not steps:
            return None
        by_step = {s["step"]: s for s in mine["per_step"]}
        ref = {s["step"]: s["time_ms"] for s in theirs["per_step"]}
        for n in steps:
            mine_ms += by_step[n]["time_ms"]
            theirs_ms += ref[n]
            unmapped += (by_step[n].get("counters") or {}).get("page_moves.pages_unmapped", 0)
            count += 1
    return mine_ms / theirs_ms, unmapped / count


def probe_us(ranks):
    """A run's host probe (fsdp_bench's `host_probe_us`, before and after its steps): the mean
    over ranks and the two timings; None where a rank has none."""
    probes = [s.get("host_probe_us") for s in ranks]
    if not all(probes):
        return None
    return statistics.fmean(statistics.fmean(p) for p in probes)


def _median_of(ratios):
    return [round(statistics.median(ratios), 3), len(ratios)] if ratios else None


def summarize(runs, rounds):
    """Rows of the table: one per (world, fsdp, setting) with a run in any round."""
    rows = []
    for (world, fsdp, setting), per_round in sorted(runs.items()):
        ok = [(r, ranks) for r, ranks in enumerate(per_round) if ranks]
        if not ok:
            rows.append({"world": world, "fsdp": fsdp, "setting": setting, "runs": 0})
            continue
        base = runs.get((world, fsdp, BASELINE), [None] * rounds)
        # (this setting's ranks, PyTorch default's) in each round that has both
        paired = [(ranks, base[r]) for r, ranks in ok if base[r]]
        ratios = [round_step(mine) / round_step(theirs) for mine, theirs in paired]
        means = [round_step(ranks) for _, ranks in ok]
        summaries = [s for _, ranks in ok for s in ranks]
        gaps = [s["reserved_over_allocated"] or 0 for s in summaries]
        floors = [s["active_over_allocated"] for s in summaries
                  if s.get("active_over_allocated")]
        row = {
            "world": world, "fsdp": fsdp, "setting": setting, "runs": len(ok),
            "mean_step_ms": round(statistics.fmean(means), 2),
            "mean_step_spread_ms": [round(min(means), 2), round(max(means), 2)],
            "median_step_ms": round(statistics.fmean(s["median_step_ms"] for s in summaries), 2),
            "ratio_mean_to_torch": [round(x, 3) for x in ratios],
            "ratio_interval": cw.ratio_interval(ratios) if setting != BASELINE else None,
            "verdict": cw.verdict(ratios) if setting != BASELINE else None,
            "reserved_over_allocated": [min(gaps), max(gaps)],
            "active_over_allocated": [min(floors), max(floors)] if floors else None,
            "peak_reserved_gib": round(max(s["peak_reserved_bytes"] or 0 for s in summaries)
                                       / 2**30, 3),
        }
        probes = [(probe_us(mine), probe_us(theirs)) for mine, theirs in paired]
        if probes and all(p and q for p, q in probes):
            # Each run's step over its host's probe, over PyTorch default's of the round:
            # (step / probe) / (step' / probe') is the plain ratio times probe' / probe.
            row["host_probe_us"] = round(statistics.fmean(p for p, _ in probes), 3)
            normal = [ratio * q / p for ratio, (p, q) in zip(ratios, probes)]
            row["ratio_host_normalized"] = [round(x, 3) for x in normal]
            if setting != BASELINE:
                row["host_normalized_interval"] = cw.ratio_interval(normal)
        if setting != BASELINE:
            split = [step_ratios(mine, theirs) for mine, theirs in paired]
            row["step_ratio_with_moves"] = _median_of([x for w, _ in split for x in w])
            row["step_ratio_without_moves"] = _median_of([x for _, n in split for x in n])
            steady = [steady_ratio(mine, theirs) for mine, theirs in paired]
            if steady and all(steady):
                ratios_steady = [r for r, _ in steady]
                row["steady_ratio_to_torch"] = [round(x, 3) for x in ratios_steady]
                row["steady_interval"] = cw.ratio_interval(ratios_steady)
                row["steady_pages_unmapped"] = round(statistics.fmean(u for _, u in steady), 2)
        profiled = [s["profile"] for s in summaries if s.get("profile")]
        if profiled:  # fsdp_bench --profile: the profiled steps' time and allocator calls
            row["profile_per_step"] = {
                "wall_ms": round(statistics.fmean(p["wall_ms_per_step"] for p in profiled), 2),
                "kernel_ms": round(statistics.fmean(p["kernel_ms_per_step"] for p in profiled),
                                   2),
                "allocator_us": round(statistics.fmean(
                    sum(c["total_us"] for c in p["allocator_calls"].values()) / p["steps"]
                    for p in profiled), 1),
            }
        counted = [s["counters_per_step"] for s in summaries if s.get("counters_per_step")]
        if counted:
            row["counters_per_step"] = {k: round(statistics.fmean(c.get(k, 0) for c in counted), 2)
                                        for k, _ in COUNTERS}
        rows.append(row)
    return rows


def _interval(row):
    iv = row.get("ratio_interval")
    if not iv:
        return "-"
    return "%.3f (%.3f-%.3f) %s" % (iv[0], iv[1], iv[2], row.get("verdict") or "")


def _host_normalized(row):
    """The ratio of steps over host probes: its interval, else the per-round values."""
    iv = row.get("host_normalized_interval")
    if iv:
        return "%.3f (%.3f-%.3f)" % tuple(iv)
    return ", ".join("%.3f" % x for x in row.get("ratio_host_normalized") or []) or "-"


def _by_moves(row):
    """The median step ratio with and without page moves, with the number of steps."""
    parts = [row.get("step_ratio_with_moves"), row.get("step_ratio_without_moves")]
    if not any(parts):
        return "-"
    return "; ".join("%.3f (%d)" % tuple(p) if p else "-" for p in parts)


def _steady(row):
    """The steady steps' ratio (95% interval) and pages unmapped a steady step."""
    iv = row.get("steady_interval")
    if iv:
        return "%.3f (%.3f-%.3f); %.1f" % (*iv, row["steady_pages_unmapped"])
    ratios = row.get("steady_ratio_to_torch")
    if ratios:
        return "%s; %.1f" % (", ".join("%.3f" % x for x in ratios), row["steady_pages_unmapped"])
    return "-"


def _span(pair):
    """min-max of a ratio, one figure where they agree; "-" where not measured."""
    if not pair:
        return "-"
    lo, hi = pair
    return "%.3f" % hi if "%.3f" % lo == "%.3f" % hi else "%.3f-%.3f" % (lo, hi)


def table(rows):
    head = ["world", "fsdp", "setting", "mean step ms (spread)", "/ torch, per round",
            "/ torch (95%)", "/ torch over host probe (95%)",
            "by step, moved pages: yes; no (steps)",
            "steady steps: / torch (95%); pages unmapped a step", "reserved / allocated",
            "active / allocated"] + [
                name for _, name in COUNTERS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if not r["runs"]:
            # Failed, stopped by --budget or never started: the logs say which.
            lines.append("| %d | %s | %s | no complete run |%s" % (
                r["world"], r["fsdp"], r["setting"], " |" * (len(head) - 3)))
            continue
        c = r.get("counters_per_step")
        cells = [str(r["world"]), r["fsdp"], r["setting"],
                 "%.1f (%.1f-%.1f)" % (r["mean_step_ms"], *r["mean_step_spread_ms"]),
                 ", ".join("%.3f" % x for x in r["ratio_mean_to_torch"]),
                 _interval(r), _host_normalized(r), _by_moves(r), _steady(r),
                 _span(r["reserved_over_allocated"]),
                 _span(r.get("active_over_allocated"))]
        for k, _ in COUNTERS:
            v = c.get(k) if c else None
            if v is not None and k.endswith("_ns"):
                v = v / 1000.0
            cells.append("-" if v is None else "%.1f" % v)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pack(out, path):
    """OUT as a gzip'd tar at `path`, replaced only once whole."""
    part = path + ".part"
    with tarfile.open(part, "w:gz") as tar:
        tar.add(out, arcname=os.path.basename(os.path.normpath(out)))
    os.replace(part, path)


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    if not args.report_only:
        for group in side_by_side_groups(args):
            left = (args.budget - (time.time() - t0)) if args.budget else args.run_timeout
            if left < 1:
                print("[rounds] budget spent: skipping the rest", flush=True)
                break
            run_group(args, group, left)
            if args.pack:
                pack(args.out, args.pack)
    rows = summarize(load(args), last_round(args))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "rounds.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print(table(rows))
    if args.pack:
        pack(args.out, args.pack)


if __name__ == "__main__":
    main()
