#!/usr/bin/env python3
"""Runs fsdp_bench.py for every (setting x FSDP variant x shape), one process group each
(the allocator cannot be swapped inside a process), and writes the report:

    GPUALLOC_SO=$PWD/target/release/liballoc_ffi.so \\
    python3 benchmarks/fsdp/run_all.py --out out/fsdp --budget 540 \\
        [--settings torch,ours] [--fsdp fsdp2] [--shapes gpt2-medium] [--steps 30]

Order: shapes, then FSDP variants, then settings (`torch` first: it is the loss baseline),
so a budget cut leaves complete groups behind. Before each run the driver estimates its
length from the runs before it (same shape, else any, else --first-estimate) and skips it
if the budget left cannot hold it; each run is also killed after min(--run-timeout, budget
left). The report is rewritten after every run, so a driver killed from outside still
leaves one.

OUT/
  fsdp_results.json   every run: status, wall time, per-rank summaries and per-step records
  fsdp_table.md       per setting / fsdp / shape / rank: peak reserved, peak allocated,
                      ratio, device allocations, median step, max |loss - torch's loss|
  fsdp_reserved.svg   per-step peak reserved memory, a panel per (shape, fsdp)
  runs/*.json         what each rank wrote; logs/*.log: each run's output
  attempts.json       the driver's record of its runs (kept across invocations: a later
                      invocation with the same OUT adds to the report, e.g. a second shape)

--report-only rebuilds the three report files from OUT without running anything.
Imports no torch.
"""
import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fsdp_bench  # noqa: E402  (no torch at import)
import plot  # noqa: E402

SETTINGS = list(fsdp_bench.SETTINGS)
FSDPS = list(fsdp_bench.FSDP_VARIANTS)
SHAPES = list(fsdp_bench.SHAPES)
BASELINE = fsdp_bench.BASELINE_SETTING
GIB = float(2 ** 30)
ECHO_PREFIXES = ("[fsdp_bench]", "Traceback", "RuntimeError", "torch.OutOfMemoryError",
                 "torch.cuda.OutOfMemoryError", "gpu_alloc.", "NCCL WARN", "Error", "[run_all]")


def csv_list(valid, what):
    def parse(text):
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in valid]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                "unknown %s %s (choose from %s)" % (what, ",".join(bad) or "''", ",".join(valid)))
        return items
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/fsdp",
                   help="output folder (default out/fsdp: git ignores /out)")
    p.add_argument("--settings", type=csv_list(SETTINGS, "setting"), default=SETTINGS,
                   help="comma list (default all: %s)" % ",".join(SETTINGS))
    p.add_argument("--fsdp", type=csv_list(FSDPS, "fsdp variant"), default=FSDPS,
                   help="comma list (default all: %s)" % ",".join(FSDPS))
    p.add_argument("--shapes", type=csv_list(SHAPES, "shape"), default=SHAPES,
                   help="comma list (default all: %s)" % ",".join(SHAPES))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--nproc", type=int, default=2, help="processes (GPUs) per run")
    p.add_argument("--budget", type=float, default=540.0,
                   help="seconds for all runs together (default 540)")
    p.add_argument("--run-timeout", type=float, default=240.0,
                   help="seconds before one run is killed (default 240)")
    p.add_argument("--first-estimate", type=float, default=40.0,
                   help="assumed length of a run before any has finished (default 40 s)")
    p.add_argument("--launcher", choices=("torchrun", "direct"), default="torchrun",
                   help="torchrun (default), or direct: start the ranks here with torchrun's "
                        "variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*): saves torchrun's "
                        "own start-up (a torch import, ~2-3 s) per run")
    p.add_argument("--torchrun", default=None,
                   help="torchrun command (default: torchrun on PATH, else python -m "
                        "torch.distributed.run)")
    p.add_argument("--python", default=sys.executable, help="python for --launcher direct")
    p.add_argument("--gpualloc-so", default=None,
                   help="liballoc_ffi.so for the ours-* settings (sets GPUALLOC_SO; default: "
                        "$GPUALLOC_SO, else gpu_alloc's own search)")
    p.add_argument("--bench-args", default="",
                   help="extra arguments for fsdp_bench.py, one string (e.g. '--model hf')")
    p.add_argument("--verbose", action="store_true", help="echo every line of every run")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the report from OUT, run nothing")
    a = p.parse_args(argv)
    if a.steps < 1 or a.nproc < 1:
        p.error("--steps and --nproc must be >= 1")
    return a


def plan(settings, fsdps, shapes):
    """(setting, fsdp, shape) in run order: shape, fsdp, then setting, each in the
    canonical order (the baseline setting first)."""
    s_order = sorted(set(settings), key=SETTINGS.index)
    return [(s, f, sh)
            for sh in sorted(set(shapes), key=SHAPES.index)
            for f in sorted(set(fsdps), key=FSDPS.index)
            for s in s_order]


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_argv(args, setting, fsdp, shape, out_dir):
    return ([os.path.join(HERE, "fsdp_bench.py"), "--setting", setting, "--fsdp", fsdp,
             "--shape", shape, "--steps", str(args.steps), "--out", out_dir]
            + args.bench_args.split())


def run_env(args, setting):
    env = dict(os.environ)
    fsdp_bench.apply_setting_env(setting, env)  # the bench does it too; explicit here
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if args.gpualloc_so:
        env["GPUALLOC_SO"] = os.path.abspath(args.gpualloc_so)
    return env


def commands(args, setting, fsdp, shape, out_dir, port):
    """[(argv, extra env)] : one entry for torchrun, one per rank for direct."""
    bench = bench_argv(args, setting, fsdp, shape, out_dir)
    if args.launcher == "torchrun":
        tr = args.torchrun.split() if args.torchrun else (
            [shutil.which("torchrun")] if shutil.which("torchrun")
            else [args.python, "-m", "torch.distributed.run"])
        return [(tr + ["--nproc-per-node", str(args.nproc), "--master-addr", "127.0.0.1",
                       "--master-port", str(port)] + bench, {})]
    return [([args.python] + bench,
             {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(args.nproc),
              "LOCAL_WORLD_SIZE": str(args.nproc), "GROUP_RANK": "0",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            for r in range(args.nproc)]


def descendants(pid):
    """Pids of every process below `pid` (torchrun starts its workers in sessions of their
    own, so killing torchrun's process group does not reach them)."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _signal(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(procs):
    """SIGTERM to the processes we started and everything below them, SIGKILL after 8 s."""
    pids = []
    for p in procs:
        if p.poll() is None:
            pids += [p.pid] + descendants(p.pid)
    _signal(pids, signal.SIGTERM)
    deadline = time.time() + 8
    while time.time() < deadline and any(os.path.exists("/proc/%d" % q) and
                                         p_alive(q) for q in pids):
        for p in procs:
            p.poll()
        time.sleep(0.2)
    _signal([q for q in pids if p_alive(q)], signal.SIGKILL)
    for p in procs:
        p.wait()


def p_alive(pid):
    """Whether `pid` exists and is not a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def launch(cmds, env, log_path, timeout, echo, tag):
    """Runs the processes of one run; returns (status, rc, wall_s, RESULT dicts)."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    results, lock = [], threading.Lock()
    t0 = time.time()
    with open(log_path, "w") as logf:
        procs = []
        for argv, extra in cmds:
            logf.write("$ %s %s\n" % (" ".join("%s=%s" % kv for kv in sorted(extra.items())),
                                      " ".join(argv)))
            logf.flush()
            procs.append(subprocess.Popen(argv, env=dict(env, **extra), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, bufsize=1,
                                          errors="replace", start_new_session=True))

        def pump(proc):
            for line in proc.stdout:
                with lock:
                    logf.write(line)
                    if line.startswith("RESULT "):
                        try:
                            results.append(json.loads(line[7:]))
                        except ValueError:
                            pass
                    elif echo(line):
                        sys.stdout.write("  %s| %s" % (tag, line))
                        sys.stdout.flush()

        threads = [threading.Thread(target=pump, args=(p,), daemon=True) for p in procs]
        for t in threads:
            t.start()
        status, failed_at = "ok", None
        while any(p.poll() is None for p in procs):
            now = time.time()
            if now - t0 > timeout:
                status = "timeout"
                break
            if any(p.poll() not in (None, 0) for p in procs):
                failed_at = failed_at or now
                if now - failed_at > 10:  # a failed rank leaves its peers in a collective
                    status = "error"
                    break
            time.sleep(0.2)
        if any(p.poll() is None for p in procs):
            kill_tree(procs)
        for t in threads:
            t.join(timeout=5)
        rcs = [p.returncode for p in procs]
        rc = next((c for c in rcs if c), 0)
        if status == "ok" and rc:
            status = "error"
        with lock:
            logf.write("[run_all] status %s, return codes %s, %.1f s\n"
                       % (status, rcs, time.time() - t0))
    return status, rc, round(time.time() - t0, 2), results


# --------------------------------------------------------------------------------------
# Results and report (no torch; tested by test_plot.py)


def load_json(path, default):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def write_text(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def collect(out_dir, attempts):
    """Results from OUT/runs/*.json and the driver's attempts (name -> record)."""
    runs_dir = os.path.join(out_dir, "runs")
    files = {}
    if os.path.isdir(runs_dir):
        for fn in sorted(os.listdir(runs_dir)):
            if fn.endswith(".json") and "__rank" in fn:
                name, _, r = fn[:-5].rpartition("__rank")
                files.setdefault(name, {})[int(r)] = os.path.join(runs_dir, fn)
    names = set(files) | set(attempts)
    runs = []
    for name in names:
        parts = name.split("__")
        if len(parts) != 3:
            continue
        setting, fsdp, shape = parts
        att = attempts.get(name, {})
        ranks = {}
        for r, path in files.get(name, {}).items():
            d = load_json(path, None)
            if d is not None:
                ranks[r] = d
        for d in att.get("result_lines", []):  # ranks whose file is missing
            ranks.setdefault(int(d.get("rank", -1)), d)
        rank_list = [ranks[r] for r in sorted(ranks)]
        status = att.get("status")
        if status is None:
            status = "ok" if rank_list and all(d.get("status") == "ok" for d in rank_list) \
                else "error"
        runs.append({"name": name, "setting": setting, "fsdp": fsdp, "shape": shape,
                     "status": status, "rc": att.get("rc"), "wall_s": att.get("wall_s"),
                     "log": att.get("log"), "ranks": rank_list})

    def key(run):
        return (SHAPES.index(run["shape"]) if run["shape"] in SHAPES else 99,
                FSDPS.index(run["fsdp"]) if run["fsdp"] in FSDPS else 99,
                SETTINGS.index(run["setting"]) if run["setting"] in SETTINGS else 99,
                run["name"])

    runs.sort(key=key)
    add_loss_deltas(runs)
    return runs


def add_loss_deltas(runs):
    """Each rank summary gets max_abs_loss_delta: max |loss - the baseline's loss| over the
    steps both have (same fsdp, shape and rank; None without a baseline)."""
    base = {}
    for run in runs:
        if run["setting"] == BASELINE:
            for rk in run["ranks"]:
                base[(run["fsdp"], run["shape"], rk.get("rank"))] = rk.get("losses") or []
    for run in runs:
        for rk in run["ranks"]:
            ref = base.get((run["fsdp"], run["shape"], rk.get("rank")))
            mine = rk.get("losses") or []
            n = min(len(ref or []), len(mine))
            if not n:
                rk["max_abs_loss_delta"] = None
                continue
            deltas = [abs(a - b) for a, b in zip(mine[:n], ref[:n])
                      if isinstance(a, (int, float)) and isinstance(b, (int, float))]
            rk["max_abs_loss_delta"] = max(deltas) if deltas else None
            if len(deltas) < n or any(d != d for d in deltas):  # NaN losses
                rk["max_abs_loss_delta"] = float("nan")


def _gib(v):
    return "—" if v is None else "%.2f" % (v / GIB)


def _f(v, fmt):
    if v is None:
        return "—"
    if v != v:
        return "nan"
    return fmt % v


def table_rows(runs):
    rows = []
    for run in runs:
        ranks = run["ranks"] or [None]
        for rk in ranks:
            rk = rk or {}
            notes = []
            if run["status"] != "ok":
                notes.append(run["status"])
            if rk.get("error"):
                notes.append(rk["error"].splitlines()[0][:80])
            if rk.get("allocator") == "gpualloc":
                notes.append("bridge" if rk.get("bridge") else "no bridge")
            if rk.get("stats_source") == "gpu_alloc":
                notes.append("stats: gpu_alloc")
            if rk and rk.get("steps_done") is not None and rk.get("steps_done") != rk.get("steps"):
                notes.append("%s/%s steps" % (rk.get("steps_done"), rk.get("steps")))
            delta = rk.get("max_abs_loss_delta")
            if run["setting"] == BASELINE and rk.get("losses"):
                dtxt = "baseline"
            else:
                dtxt = _f(delta, "%.2e")
            rows.append([
                run["setting"], run["fsdp"], run["shape"],
                str(rk.get("rank", "—")),
                _gib(rk.get("peak_reserved_bytes")),
                _gib(rk.get("peak_allocated_bytes")),
                _f(rk.get("reserved_over_allocated"), "%.3f"),
                _f(rk.get("num_device_alloc"), "%d"),
                _f(rk.get("median_step_ms"), "%.1f"),
                dtxt,
                _gib(rk.get("peak_device_used_bytes")),
                "; ".join(notes).replace("|", "/"),
            ])
    return rows


TABLE_HEAD = ["setting", "fsdp", "shape", "rank", "peak reserved GiB", "peak allocated GiB",
              "reserved/allocated", "device allocs", "median step ms",
              "max abs loss diff vs torch", "peak device used GiB", "notes"]


def ratio_summary(runs):
    """Markdown lines: per shape, setting x fsdp -> ratio min-max over ranks (peak reserved
    GiB max over ranks)."""
    lines = []
    for shape in [s for s in SHAPES if any(r["shape"] == s for r in runs)] + sorted(
            {r["shape"] for r in runs} - set(SHAPES)):
        sub = [r for r in runs if r["shape"] == shape]
        fsdps = [f for f in FSDPS if any(r["fsdp"] == f for r in sub)]
        settings = [s for s in SETTINGS if any(r["setting"] == s for r in sub)]
        lines.append("")
        lines.append("**%s**: peak reserved / peak allocated, min-max over ranks "
                     "(max peak reserved GiB; median step ms)" % shape)
        lines.append("")
        lines.append("| setting | " + " | ".join(fsdps) + " |")
        lines.append("|---|" + "---|" * len(fsdps))
        for s in settings:
            cells = []
            for f in fsdps:
                run = next((r for r in sub if r["setting"] == s and r["fsdp"] == f), None)
                ratios = [rk.get("reserved_over_allocated") for rk in (run or {}).get("ranks", [])]
                ratios = [x for x in ratios if x is not None]
                if not ratios:
                    cells.append(run["status"] if run else "—")
                    continue
                res = max(rk.get("peak_reserved_bytes") or 0 for rk in run["ranks"])
                ms = [rk.get("median_step_ms") for rk in run["ranks"]
                      if rk.get("median_step_ms") is not None]
                lo, hi = min(ratios), max(ratios)
                txt = "%.3f" % lo if "%.3f" % lo == "%.3f" % hi else "%.3f-%.3f" % (lo, hi)
                txt += " (%.2f GiB" % (res / GIB)
                txt += "; %.0f ms)" % max(ms) if ms else ")"
                if run["status"] != "ok":
                    txt += " " + run["status"]
                cells.append(txt)
            lines.append("| %s | %s |" % (s, " | ".join(cells)))
    return lines


def make_table(results):
    runs = results.get("runs", [])
    meta = results.get("meta", {})
    first = next((rk for r in runs for rk in r["ranks"]), {})
    out = ["# FSDP memory benchmark", ""]
    env_bits = []
    if first:
        env_bits.append("torch %s" % first.get("torch_version"))
        env_bits.append("%s x %s" % (first.get("world_size"), first.get("device_name")))
        env_bits.append("model %s" % first.get("model", "plain"))
    steps = sorted({rk.get("steps") for r in runs for rk in r["ranks"] if rk.get("steps")})
    if steps:
        env_bits.append("%s steps" % "/".join(map(str, steps)))
    if meta.get("launcher"):
        env_bits.append("launcher %s" % meta["launcher"])
    if env_bits:
        out.append(", ".join(env_bits) + ".")
        out.append("")
    out.append("Peaks over the training steps (set-up excluded: cache emptied and peaks reset "
               "after it), from the allocator's statistics (torch.cuda.memory_stats, or "
               "gpu_alloc.memory_stats where torch's raise: see notes). Device allocs: "
               "cudaMalloc/cuMemCreate calls during training. Median step over steps "
               "%d..N. Loss diff: max over steps of |loss - loss under `torch`|, same "
               "fsdp/shape/rank. Peak device used: cuMemGetInfo after each step (context, "
               "NCCL and cuBLAS included)." % (fsdp_bench.SKIP_STEPS + 1))
    out.append("")
    out.append("| " + " | ".join(TABLE_HEAD) + " |")
    out.append("|" + "---|" * len(TABLE_HEAD))
    for row in table_rows(runs):
        out.append("| " + " | ".join(row) + " |")
    out.extend(ratio_summary(runs))
    skipped = meta.get("skipped") or []
    if skipped:
        out.append("")
        out.append("Not run (budget): " + ", ".join(skipped))
    return "\n".join(out) + "\n"


def write_reports(out_dir, attempts, meta):
    runs = collect(out_dir, attempts)
    results = {"meta": meta, "runs": runs}
    write_text(os.path.join(out_dir, "fsdp_results.json"), json.dumps(results, indent=1) + "\n")
    table = make_table(results)
    write_text(os.path.join(out_dir, "fsdp_table.md"), table)
    plot.write_reserved_svg(results, os.path.join(out_dir, "fsdp_reserved.svg"))
    return results, table


# --------------------------------------------------------------------------------------


def estimate(done, shape, default):
    same = [d["wall_s"] for d in done if d["shape"] == shape and d["status"] == "ok"]
    if same:
        return max(same)
    anyw = [d["wall_s"] for d in done if d["status"] == "ok"]
    if anyw:
        return max(anyw) * (1.5 if shape == "1.3b" else 1.0)
    return default


def main(argv=None):
    args = parse_args(argv)
    out_dir = os.path.abspath(args.out)
    if not args.dry_run:
        os.makedirs(os.path.join(out_dir, "runs"), exist_ok=True)  # before --report-only too
    attempts_path = os.path.join(out_dir, "attempts.json")
    attempts = load_json(attempts_path, {})
    meta = load_json(os.path.join(out_dir, "fsdp_results.json"), {}).get("meta", {})
    if args.report_only:
        _, table = write_reports(out_dir, attempts, meta)
        print(table)
        return 0
    meta.update({"steps": args.steps, "nproc": args.nproc, "launcher": args.launcher,
                 "budget_s": args.budget, "argv": sys.argv[1:],
                 "gpualloc_so": args.gpualloc_so or os.environ.get("GPUALLOC_SO")})
    todo = plan(args.settings, args.fsdp, args.shapes)
    if any(fsdp_bench.is_ours(s) for s, _, _ in todo) and not args.dry_run:
        so = args.gpualloc_so or os.environ.get("GPUALLOC_SO")
        if so and not os.path.isfile(so):
            print("[run_all] GPUALLOC_SO=%s does not exist" % so, file=sys.stderr)
            return 2
    t0 = time.time()
    done, skipped = [], []
    meta["skipped"] = skipped
    for i, (setting, fsdp, shape) in enumerate(todo):
        name = fsdp_bench.run_name(setting, fsdp, shape)
        left = args.budget - (time.time() - t0)
        est = estimate(done, shape, args.first_estimate)
        if args.dry_run:
            for argv, extra in commands(args, setting, fsdp, shape, out_dir, 29500):
                print(" ".join("%s=%s" % kv for kv in sorted(extra.items())), " ".join(argv))
            continue
        if est > left:
            print("[run_all] skip %s: ~%.0f s needed, %.0f s of budget left" % (name, est, left),
                  flush=True)
            skipped.append(name)
            continue
        for r in range(args.nproc):  # no stale rank files from an earlier invocation
            try:
                os.unlink(fsdp_bench.result_path(out_dir, setting, fsdp, shape, r))
            except FileNotFoundError:
                pass
        print("[run_all] %d/%d %s (budget left %.0f s)" % (i + 1, len(todo), name, left),
              flush=True)
        log_path = os.path.join(out_dir, "logs", name + ".log")
        echo = (lambda line: True) if args.verbose else (
            lambda line: line.lstrip().startswith(ECHO_PREFIXES))
        status, rc, wall, lines = launch(
            commands(args, setting, fsdp, shape, out_dir, free_port()), run_env(args, setting),
            log_path, min(args.run_timeout, left), echo, name)
        rec = {"status": status, "rc": rc, "wall_s": wall, "log": os.path.relpath(log_path, out_dir),
               "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
        files_missing = [r for r in range(args.nproc) if not os.path.isfile(
            fsdp_bench.result_path(out_dir, setting, fsdp, shape, r))]
        if files_missing:
            rec["result_lines"] = [d for d in lines if d.get("rank") in files_missing]
        attempts[name] = rec
        done.append({"shape": shape, "status": status, "wall_s": wall})
        write_text(attempts_path, json.dumps(attempts, indent=1) + "\n")
        meta["elapsed_s"] = round(time.time() - t0, 1)
        results, _ = write_reports(out_dir, attempts, meta)
        for run in results["runs"]:
            if run["name"] == name:
                for rk in run["ranks"]:
                    print("[run_all]   %s rank %s: %s, peak reserved %s GiB, allocated %s GiB, "
                          "ratio %s, device allocs %s, median %s ms, dloss %s (%.0f s)"
                          % (name, rk.get("rank"), rk.get("status"),
                             _gib(rk.get("peak_reserved_bytes")),
                             _gib(rk.get("peak_allocated_bytes")),
                             _f(rk.get("reserved_over_allocated"), "%.3f"),
                             _f(rk.get("num_device_alloc"), "%d"),
                             _f(rk.get("median_step_ms"), "%.1f"),
                             _f(rk.get("max_abs_loss_delta"), "%.2e"), wall), flush=True)
                if not run["ranks"]:
                    print("[run_all]   %s: %s, no result (see %s)" % (name, status, log_path),
                          flush=True)
    if args.dry_run:
        return 0
    meta["elapsed_s"] = round(time.time() - t0, 1)
    _, table = write_reports(out_dir, attempts, meta)
    print()
    print(table)
    print("[run_all] wrote %s/{fsdp_results.json,fsdp_table.md,fsdp_reserved.svg} in %.0f s"
          % (out_dir, time.time() - t0))
    failed = [n for n, a in attempts.items() if a.get("status") != "ok"]
    return 1 if failed and any(fsdp_bench.run_name(*t) in failed for t in todo) else 0


if __name__ == "__main__":
    sys.exit(main())
