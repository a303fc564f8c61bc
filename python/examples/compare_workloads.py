"""Real workloads under PyTorch's allocator settings and under gpualloc's policies, one
process per (workload, allocator), same seeds (run on a machine with a GPU):

    GPUALLOC_SO=target/release/liballoc_ffi.so python3 python/examples/compare_workloads.py \
        [WORKLOADS|all] [ALLOCATORS|all] [--timeout S] [--out DIR] [--deterministic] [--repeat N]
        [--steps N] [--cpus LIST[;LIST...]] [--side-by-side]

WORKLOADS (comma list; default: the four below; shapes as in shared/device/traces.py):
  resnet50_train      torchvision ResNet-50, 64 x 3 x 224 x 224, SGD momentum; 20 steps
  gpt2_train          GPT-2 small, 8 x 1024 tokens, bf16 autocast, AdamW; 16 steps
  gpt2_generate       GPT-2 small, 3 rounds of 8 prompts of 16..256 tokens, 256 sampled
                      new tokens each; a step is one decoded token
  vit_varbatch_infer  torchvision vit_b_16 (random weights, classifier re-drawn from
                      N(0, 0.02) since torchvision zeroes it), 40 batches of 1..96 images,
                      bf16 autocast, no_grad; the 40 run twice, the first pass is warm-up
Models are built with random weights directly on the GPU (torch.device("cuda")), which
takes a fraction of the CPU initialisation's time; nothing is downloaded.
  gpt2_varlen_train   (not in the default set) GPT-2 small, 30 steps of 8 x 32..1024
ALLOCATORS (comma list; a CONF may hold commas; default: all nine):
  torch               PyTorch's caching allocator (PYTORCH_CUDA_ALLOC_CONF unset)
  torch-expandable    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  torch-async         PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
  torch:CONF          PYTORCH_CUDA_ALLOC_CONF=CONF
  gpualloc            gpu_alloc.enable() with the default policy (GPUALLOC_CONF unset)
  gpualloc:CONF       gpu_alloc.enable(CONF), e.g. gpualloc:policy:buddy,
                      gpualloc:policy:size-class, gpualloc:policy:pytorch-bfc+gc-age,
                      gpualloc:expandable_segments:True,
                      gpualloc:expandable_segments:True,unmap_free_pages:True
  NAME#TAG            the same allocator run once more (torch#2: a run-to-run noise control)
  gpualloc:CONF@PATH  loads the library at PATH for this run instead of --so's: two builds
                      interleaved in one call

Per run (a child process of this script): the outputs' fingerprint (training: every
step's loss; vit: every batch's sum of logits in float64; generate: per round the sum of
all logits computed, in float64, and a SHA-256 of the generated token ids), compared
exactly with the `torch` run's; the median step time after the warm-up steps; peak
reserved and allocated bytes and num_device_alloc (torch.cuda.memory_stats under PyTorch;
under gpualloc too when it answers, else gpu_alloc.memory_stats); and the cross-check
"device used": the peak of total - free from cuMemGetInfo (torch.cuda.mem_get_info)
sampled after every step, minus its value right after CUDA initialisation (so it includes
cuBLAS / cuDNN workspaces and lazily loaded kernels but not the context). Under gpualloc
the JSON also has our page_moves.* and plan_layout.* counters and, for the training and
ViT workloads, `unmapped_after_step`: the pages unmapped so far after each step (where a
run's page moves happen: before a plan is followed, or every step). The report then splits
each such run's timed steps, over PyTorch's same steps of the same round, into those in
which it moved pages and those in which it moved none: the second show how far two runs
differ with no move at all (the host's noise), the first what the moves cost.
With --time-calls the library also times its own malloc and free calls
(GPUALLOC_TIME_CALLS=1), read at every step's edges outside the timed span
(`calls_in_step`: each step's calls and their time; for generation, read at each token's
forward): the report gives
their time per timed step and its share of the mean step, a bound on what the allocator's
calls add to a step that holds however much whole processes differ from one another.

Writes $OUT/compare_workloads.json and $OUT/compare_workloads.md (--out overrides $OUT;
default /tmp) after every run, so that a cut-off matrix keeps what it finished.
`--from-json FILE` only re-renders the table of an earlier JSON (no torch needed).

--side-by-side (a machine with a GPU an allocator): the allocators of one round run at the
same time, the i-th of the round's rotated order on GPU i and pinned to the i-th of
--cpus's ';'-separated lists, so a round's runs see the same host, whose slow spells make
whole processes run 10-30% apart when they run one after another; the rotation moves each
allocator from GPU to GPU, round by round, so a faster GPU favours none. Each run's JSON
records its `gpu` and `started_s`. `--cpus apart:N` builds the lists from the host's
topology (cpu_cores.py): N physical cores each, none shared (hyperthread siblings of one
core in two lists would slow both runs).

Exact equality of losses needs deterministic kernels: GPT-2's backward (attention) uses
atomics, so its later losses can differ in the last digits between two runs of the same
allocator; the PyTorch rows (and torch#2) show that noise. --deterministic asks PyTorch for
deterministic algorithms (slower, other kernels) to make the comparison strict.
"""
import argparse
import functools
import hashlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PYROOT = os.path.dirname(HERE)

sys.path.insert(0, HERE)
import cpu_cores  # noqa: E402

# name -> (steps, warm-up steps excluded from the median). gpt2_generate: rounds, and the
# whole first round is warm-up (its steps are the decoded tokens).
WORKLOADS = {
    "resnet50_train": (20, 4),
    "gpt2_train": (16, 4),
    "gpt2_generate": (3, 1),
    "vit_varbatch_infer": (40, 40),  # the 40 batches twice, the first pass as warm-up
    "gpt2_varlen_train": (30, 5),
}
DEFAULT_WORKLOADS = ["resnet50_train", "gpt2_train", "gpt2_generate", "vit_varbatch_infer"]
TORCH_ALIASES = {
    "torch": "",
    "torch-expandable": "expandable_segments:True",
    "torch-async": "backend:cudaMallocAsync",
}
DEFAULT_ALLOCS = [
    "torch",
    "torch-expandable",
    "torch-async",
    "gpualloc",
    "gpualloc:policy:buddy",
    "gpualloc:policy:size-class",
    "gpualloc:policy:pytorch-bfc+gc-age",
    "gpualloc:expandable_segments:True",
    "gpualloc:expandable_segments:True,unmap_free_pages:True",
]
REF_ALLOC = "torch"
T_START = time.perf_counter()  # runs' start times (started_s) are given from here
# The headroom target of the mean step (issue "The memory win without paying for it in
# step time"): within 1.02x of PyTorch default's. The repeated-settings table says, per
# setting, whether its rounds put the ratio within it, above it, or cannot tell yet.
STEP_TARGET = 1.02
# Two-sided 95% quantiles of Student's t by degrees of freedom 1..30 (beyond: 1.96).
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201,
        2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074,
        2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
GIB = float(2**30)


# ---------------------------------------------------------------------------------------
# Allocator names, medians, the table: plain Python (tested without torch).


def parse_alloc(name):
    """'torch-async' -> ('torch', 'backend:cudaMallocAsync'); 'gpualloc' -> ('gpualloc',
    None); 'gpualloc:policy:buddy' -> ('gpualloc', 'policy:buddy'). A '#tag' suffix
    (a repeated run) and an '@PATH' suffix (the library to load, see split_so) are ignored.
    Raises ValueError for anything else."""
    base, _ = split_so(split_tag(name)[0])
    if base in TORCH_ALIASES:
        return "torch", TORCH_ALIASES[base]
    if base.startswith("torch:") and len(base) > 6:
        return "torch", base[6:]
    if base == "gpualloc":
        return "gpualloc", None
    if base.startswith("gpualloc:") and len(base) > 9:
        return "gpualloc", base[9:]
    raise ValueError(
        "unknown allocator %r (torch, torch-expandable, torch-async, torch:CONF, gpualloc, "
        "gpualloc:CONF, each optionally with #TAG)" % name
    )


def timed_steps(result):
    """The step times after the warm-up ones ([] without step_ms)."""
    return (result.get("step_ms") or [])[result.get("warmup", 0):]


def median_step_ms(result):
    """Median of the steps after the warm-up ones (from step_ms and warmup when present)."""
    if result.get("step_ms"):
        timed = timed_steps(result)
        return statistics.median(timed) if timed else None
    return result.get("median_step_ms")


def mean_step_ms(result):
    """Mean of the steps after the warm-up ones: unlike the median it counts the few slow
    steps (page moves, say), so it is what throughput follows. None without step_ms."""
    timed = timed_steps(result)
    return statistics.fmean(timed) if timed else None


def first_difference(ref, got, path="fingerprint"):
    """None when got == ref exactly, else a short description of the first difference."""
    if isinstance(ref, dict) and isinstance(got, dict):
        for k in sorted(set(ref) | set(got)):
            if k not in ref or k not in got:
                return "%s.%s present in one run only" % (path, k)
            d = first_difference(ref[k], got[k], "%s.%s" % (path, k))
            if d:
                return d
        return None
    if isinstance(ref, list) and isinstance(got, list):
        for i, (x, y) in enumerate(zip(ref, got)):
            d = first_difference(x, y, "%s[%d]" % (path, i))
            if d:
                return d
        if len(ref) != len(got):
            return "%s: %d entries, ref %d" % (path, len(got), len(ref))
        return None
    if _is_num(ref) and _is_num(got):
        if got == ref:
            return None
        rel = " (relative %.2g)" % (abs(got - ref) / abs(ref)) if ref else ""
        return "%s: %r, ref %r%s" % (path, got, ref, rel)
    if type(got) is type(ref) and got == ref:
        return None
    return "%s: %r, ref %r" % (path, got, ref)


def _is_num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _failed(r):
    return bool(r.get("error")) or "fingerprint" not in r


def summarize(results, ref_alloc=REF_ALLOC):
    """One dict per result, in the results' order grouped by workload (first appearance),
    with the figures and ratios the table shows:

    step_ratio      median step / the ref_alloc run's median step (same workload)
    reserved_ratio  peak reserved / the smallest peak reserved among the workload's
                    PyTorch settings (kind 'torch'); settings whose figure is the
                    cuMemGetInfo fallback count only when no other PyTorch setting has one
    outputs_equal   'ref' for the ref_alloc run itself, 'yes' / 'no' for exact equality of
                    the fingerprint with it, 'n/a' without a successful ref_alloc run
    """
    order, groups = [], {}
    for r in results:
        w = r.get("workload")
        if w not in groups:
            order.append(w)
            groups[w] = []
        groups[w].append(r)
    rows = []
    for w in order:
        rs = groups[w]
        ok = [r for r in rs if not _failed(r)]
        ref = next((r for r in ok if r.get("alloc") == ref_alloc), None)
        ref_ms = median_step_ms(ref) if ref else None
        ref_mean = mean_step_ms(ref) if ref else None
        pytorch = [r for r in ok if _kind(r.get("alloc")) == "torch" and r.get("peak_reserved")]
        direct = [r for r in pytorch if r.get("reserved_source") != "cuMemGetInfo"]
        best = min(direct or pytorch, key=lambda r: r["peak_reserved"]) if pytorch else None
        for r in rs:
            row = {"workload": w, "alloc": r.get("alloc"), "error": None}
            if _failed(r):
                row["error"] = r.get("error") or "no result"
                rows.append(row)
                continue
            ms, mean = median_step_ms(r), mean_step_ms(r)
            reserved = r.get("peak_reserved")
            row.update(
                median_step_ms=ms,
                step_ratio=(ms / ref_ms) if (ms is not None and ref_ms) else None,
                mean_ratio=(mean / ref_mean) if (mean is not None and ref_mean) else None,
                peak_reserved=reserved,
                reserved_marked=r.get("reserved_source") == "cuMemGetInfo",
                reserved_ratio=(reserved / best["peak_reserved"]) if (best and reserved) else None,
                best_pytorch=best.get("alloc") if best else None,
                peak_allocated=r.get("peak_allocated"),
                allocated_marked=r.get("allocated_source") == "cudaMallocAsync pool",
                num_device_alloc=r.get("num_device_alloc"),
                device_used_delta=r.get("device_used_delta"),
            )
            if r is ref:
                row["outputs_equal"], row["difference"] = "ref", None
            elif ref is None:
                row["outputs_equal"], row["difference"] = "n/a", None
            else:
                d = first_difference(ref["fingerprint"], r["fingerprint"])
                row["outputs_equal"], row["difference"] = ("no" if d else "yes"), d
            rows.append(row)
    return rows


def _kind(alloc):
    try:
        return parse_alloc(alloc)[0]
    except (ValueError, AttributeError):
        return None


def _gib(v):
    return "-" if v is None else "%.3f" % (v / GIB)


def _ms(v):
    return "-" if v is None else "%.2f" % v


def _ratio(v):
    return "-" if v is None else "%.3f" % v


TABLE_COLUMNS = [
    "workload",
    "allocator",
    "median step ms",
    "step / torch",
    "mean step / torch",
    "peak reserved GiB",
    "reserved / best PyTorch",
    "peak allocated GiB",
    "device allocs",
    "cuMemGetInfo Δ GiB",
    "outputs equal",
]


def make_table(results, ref_alloc=REF_ALLOC):
    """The markdown report: one table row per (workload, allocator), then notes,
    output mismatches and failures."""
    rows = summarize(results, ref_alloc)
    out = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    marked_res = marked_alloc = False
    mismatches, failures, best = [], [], {}
    for row in rows:
        if row["error"]:
            err = " ".join(str(row["error"]).split())
            cells = [row["workload"], row["alloc"]] + ["-"] * (len(TABLE_COLUMNS) - 3) + ["FAILED"]
            failures.append("%s / %s: %s" % (row["workload"], row["alloc"], err[-400:]))
        else:
            res = _gib(row["peak_reserved"])
            if row["reserved_marked"] and row["peak_reserved"] is not None:
                res += " †"
                marked_res = True
            alloc = _gib(row["peak_allocated"])
            if row["allocated_marked"] and row["peak_allocated"] is not None:
                alloc += " ‡"
                marked_alloc = True
            nda = row["num_device_alloc"]
            cells = [
                row["workload"],
                row["alloc"],
                _ms(row["median_step_ms"]),
                _ratio(row["step_ratio"]),
                _ratio(row["mean_ratio"]),
                res,
                _ratio(row["reserved_ratio"]),
                alloc,
                "n/a" if nda is None else str(nda),
                _gib(row["device_used_delta"]),
                row["outputs_equal"],
            ]
            if row["outputs_equal"] == "no":
                mismatches.append("%s / %s: %s" % (row["workload"], row["alloc"], row["difference"]))
            if row["best_pytorch"]:
                best[row["workload"]] = row["best_pytorch"]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    out.append("")
    notes = [
        "step / torch: median step time over the `%s` run's; mean step / torch: the same "
        "for the mean, which counts the few slow steps the median leaves out (page moves, "
        "say); reserved / best PyTorch: peak reserved over the smallest of the PyTorch "
        "settings' (%s)."
        % (ref_alloc, ", ".join("%s: %s" % kv for kv in best.items()) or "none"),
        "cuMemGetInfo Δ: peak of total - free sampled after every step, minus the figure "
        "right after CUDA initialisation (includes cuBLAS / cuDNN workspaces and kernels).",
        "gpt2_generate's step is one decoded token (the first round is warm-up).",
    ]
    if marked_res:
        notes.append("†: the allocator reports no reserved figure (cudaMallocAsync: "
                     "memory_reserved() is 0); the cuMemGetInfo Δ stands in for it.")
    if marked_alloc:
        notes.append("‡: cudaMallocAsync's pool high-water mark of used memory as the driver "
                     "reports it (driver granularity), not comparable byte for byte.")
    out += ["- " + n for n in notes]
    if mismatches:
        out += ["", "Outputs that differ from the `%s` run (PyTorch settings differing too "
                "point at nondeterministic kernels; see --deterministic):" % ref_alloc]
        out += ["- " + m for m in mismatches]
    if failures:
        out += ["", "Failed runs:"] + ["- " + f for f in failures]
    out += repeat_summary(results, ref_alloc)
    out += moves_summary(results, ref_alloc)
    out += kernel_summary(results)
    out += calls_summary(results)
    return "\n".join(out) + "\n"


def kernel_summary(results):
    """Markdown lines for --kernel-time runs: per run, the mean timed step, the mean GPU
    time of its kernels, and the rest (host time the GPU waited for), with the kernel that
    took the most GPU time. Two runs whose steps differ by their kernel time differ on the
    GPU; by the rest, on the host. Empty when no run timed its kernels."""
    rows = []
    for r in results:
        kernel_ms = r.get("kernel_ms")
        if _failed(r) or not kernel_ms:
            continue
        base, tag = split_tag(r.get("alloc", ""))
        warmup = r.get("warmup", 0)
        steps, kernels = timed_steps(r), kernel_ms[warmup:]
        if not steps or len(steps) != len(kernels):
            continue
        step, kernel = statistics.mean(steps), statistics.mean(kernels)
        count = statistics.mean((r.get("kernels") or [0] * len(kernel_ms))[warmup:])
        top = (r.get("top_kernels") or [None])[0]
        heaviest = "%s %.2f" % (top["name"][:60], top["ms_per_step"]) if top else "-"
        rows.append("| %s | %s | %s | %.2f | %.2f | %.2f | %.3f | %.0f | %s |" % (
            r.get("workload"), base, tag or "1", step, kernel, step - kernel, kernel / step,
            count, heaviest))
    if not rows:
        return []
    return ["", "GPU time per step (--kernel-time; means over the timed steps; kernels: GPU "
            "time of the step's kernels, copies and fills; rest: step minus kernels, the host "
            "time the GPU waited for):", "",
            "| workload | allocator | round | step ms | kernels ms | rest ms | kernels / step "
            "| kernels a step | heaviest kernel, ms a step |",
            "|---|---|---|---|---|---|---|---|---|"] + rows


def calls_per_timed_step(run):
    """(mallocs, frees, ms in the library's calls) per timed step of a --time-calls run,
    from each step's counted calls; None without them or with a short list."""
    counted = run.get("calls_in_step")
    steps = run.get("step_ms") or []
    if not counted or len(counted) != len(steps):
        return None
    per = counted[run.get("warmup", 0):]
    if not per:
        return None
    return [(m, f, (m_ns + f_ns) / 1e6) for m, f, m_ns, f_ns in per]


def calls_summary(results):
    """Markdown lines for --time-calls runs: per gpualloc run, the library's own malloc
    and free calls per timed step, the time they took, and that time's share of the mean
    step. The share bounds what the allocator's calls can add to the step: were PyTorch's
    allocator to take no time at all, and everything else in the step the same, the step
    would be shorter by that share and no more. Empty when no run timed its calls."""
    rows = []
    for r in results:
        per = None if _failed(r) else calls_per_timed_step(r)
        if not per:
            continue
        base, tag = split_tag(r.get("alloc", ""))
        steps = timed_steps(r)
        mallocs = statistics.mean(p[0] for p in per)
        frees = statistics.mean(p[1] for p in per)
        ms = [p[2] for p in per]
        calls = sum(p[0] + p[1] for p in per)
        us_a_call = sum(ms) * 1e3 / calls if calls else 0.0
        step = statistics.mean(steps)
        rows.append("| %s | %s | %s | %.0f | %.0f | %.3f | %.3f | %.3f | %.2f%% |" % (
            r.get("workload"), base, tag or "1", mallocs, frees, us_a_call,
            statistics.mean(ms), max(ms), 100 * statistics.mean(ms) / step))
    if not rows:
        return []
    return ["", "The library's own calls per timed step (--time-calls: GPUALLOC_TIME_CALLS=1; "
            "share: their mean time over the mean step, the most the allocator's calls can "
            "add to a step):", "",
            "| workload | allocator | round | mallocs | frees | us a call | ms a step, mean "
            "| ms a step, most | share of the mean step |",
            "|---|---|---|---|---|---|---|---|---|"] + rows


def split_tag(alloc):
    """'gpualloc:policy:buddy#3' -> ('gpualloc:policy:buddy', '3'); untagged -> (alloc, '')."""
    base, _, tag = alloc.partition("#")
    return base, tag


def split_so(base):
    """'gpualloc:CONF@lib/other.so' -> ('gpualloc:CONF', 'lib/other.so'): that run loads
    this build of the library instead of --so's, so that two builds interleave in one call;
    no suffix -> (base, '')."""
    base, _, so = base.partition("@")
    return base, so


def round_order(allocs, rnd):
    """The allocators in the order round `rnd` (from 1) runs them: rotated left by rnd - 1,
    so that no setting always runs first and a slow spell of the host falls on a different
    allocator in each round (a process that follows another may run faster or slower for
    it)."""
    k = (rnd - 1) % len(allocs)
    return allocs[k:] + allocs[:k]


def with_repeats(allocs, repeat):
    """The allocators run `repeat` times, interleaved: round 1 as given, round k tagged '#k'
    in round_order."""
    return [a if k == 1 else "%s#%d" % (a, k) for k in range(1, repeat + 1)
            for a in round_order(allocs, k)]


def ratio_interval(ratios):
    """(geometric mean, low, high): the 95% t interval of per-round ratios (each round's
    setting over the reference run of the same round), taken on their logarithms so that
    1.1 and 1/1.1 weigh alike; None with fewer than two rounds."""
    if len(ratios) < 2:
        return None
    logs = [math.log(r) for r in ratios]
    mean, sd = statistics.mean(logs), statistics.stdev(logs)
    t = T975[len(logs) - 2] if len(logs) - 1 <= len(T975) else 1.96
    half = t * sd / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def verdict(ratios, target=STEP_TARGET):
    """Whether the rounds put the ratio within `target` (the interval's top at or below
    it), above it (its bottom above), or cannot tell yet: then about how many rounds at
    the same spread would (the normal approximation)."""
    interval = ratio_interval(ratios)
    if interval is None:
        return "-"
    mean, low, high = interval
    if high <= target:
        return "within"
    if low > target:
        return "above"
    logs = [math.log(r) for r in ratios]
    gap = abs(math.log(target) - math.log(mean))
    if gap == 0:
        return "undecided"
    need = math.ceil((1.96 * statistics.stdev(logs) / gap) ** 2)
    return "undecided (~%d rounds)" % max(need, len(ratios) + 1)


def median_interval(ratios):
    """(median, low, high): the median of per-round ratios with a distribution-free
    interval of at least 95% coverage, the order statistics k + 1 and n - k of the sorted
    ratios for the largest k with P(Binomial(n, 1/2) <= k) <= 0.025. A round whose whole
    process ran slow (the host, not the allocator: every step of it slower alike) moves
    the geometric mean and widens its t interval, where it moves the median by one place.
    None with fewer than six rounds (no such k)."""
    n = len(ratios)
    below, k = 0.0, -1
    while True:
        below += math.comb(n, k + 1) / 2.0 ** n
        if below > 0.025:
            break
        k += 1
    if k < 0:
        return None
    ordered = sorted(ratios)
    return statistics.median(ordered), ordered[k], ordered[n - k - 1]


def median_verdict(ratios, target=STEP_TARGET):
    """'within' when the median's interval lies at or below `target`, 'above' when it lies
    above, 'undecided' across it; '-' with too few rounds for an interval."""
    interval = median_interval(ratios)
    if interval is None:
        return "-"
    _, low, high = interval
    return "within" if high <= target else "above" if low > target else "undecided"


def pooled(runs_by_file):
    """The results of several calls as one set of rounds: each file's round k (untagged
    is 1) becomes round offset + k, the offset being the rounds of the files before it,
    so that repeat_summary pairs each run with its own round's reference."""
    out, offset = [], 0
    for results in runs_by_file:
        most = 0
        for r in results:
            base, tag = split_tag(r.get("alloc", ""))
            k = int(tag) if tag.isdigit() else 1
            most = max(most, k)
            n = offset + k
            out.append(dict(r, alloc=base if n == 1 else "%s#%d" % (base, n)))
        offset += most
    return out


def repeat_summary(results, ref_alloc=REF_ALLOC):
    """Markdown lines summarising settings run more than once ('#tag' rounds): every
    round's median step, and its ratio to the ref_alloc run of the same round (the run
    next to it, so the drift between rounds cancels). Empty when nothing was repeated."""
    rounds = {}  # (workload, base) -> {tag: median ms}
    means = {}  # (workload, base) -> {tag: mean ms}
    order = []
    for r in results:
        if _failed(r):
            continue
        base, tag = split_tag(r.get("alloc", ""))
        key = (r.get("workload"), base)
        if key not in rounds:
            rounds[key], means[key] = {}, {}
            order.append(key)
        ms, mean = median_step_ms(r), mean_step_ms(r)
        if ms is not None:
            rounds[key][tag] = ms
        if mean is not None:
            means[key][tag] = mean
    repeated = [k for k in order if len(rounds[k]) > 1]
    if not repeated:
        return []
    out = ["", "Repeated settings (median step ms per round; ratio to the `%s` run of the same "
           "round; best round over the `%s` runs' best: a run is only slowed by the rest of "
           "the host, so the best round is the cleanest figure; the mean step's ratio per round, "
           "which counts the slow steps the median leaves out; its geometric mean over the "
           "rounds with a 95%% t interval, and whether that interval lies within the %.2f "
           "target, above it, or across it, with about how many rounds at the same spread "
           "would decide; then the median of the mean-step ratios with its distribution-free "
           "95%% interval (order statistics, six rounds or more), which a whole slow process "
           "moves by one place only, and its verdict):" % (ref_alloc, ref_alloc, STEP_TARGET),
           "",
           "| workload | allocator | rounds | step ms per round | ratio per round | median ratio "
           "| best / best | mean-step ratio per round | median mean-step ratio "
           "| mean-step ratio, 95%% interval | vs %.2f | median's 95%% interval "
           "| vs %.2f by the median |" % (STEP_TARGET, STEP_TARGET),
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w, base in repeated:
        runs = rounds[(w, base)]
        ref = rounds.get((w, ref_alloc), {})
        tags = sorted(runs, key=lambda t: (t != "", int(t) if t.isdigit() else 0, t))
        ratios = [runs[t] / ref[t] for t in tags if ref.get(t)]
        best = min(runs.values()) / min(ref.values()) if ref else None
        mine, ref_means = means[(w, base)], means.get((w, ref_alloc), {})
        mean_ratios = [mine[t] / ref_means[t] for t in tags if t in mine and ref_means.get(t)]
        interval = ratio_interval(mean_ratios)
        by_median = median_interval(mean_ratios)
        out.append("| %s | %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            w, base, len(tags), " / ".join("%.2f" % runs[t] for t in tags),
            " / ".join("%.3f" % x for x in ratios) or "-",
            "%.3f" % statistics.median(ratios) if ratios else "-",
            "%.3f" % best if best is not None else "-",
            " / ".join("%.3f" % x for x in mean_ratios) or "-",
            "%.3f" % statistics.median(mean_ratios) if mean_ratios else "-",
            "%.3f (%.3f-%.3f)" % interval if interval else "-",
            verdict(mean_ratios) if base != ref_alloc else "-",
            "%.3f-%.3f" % by_median[1:] if by_median else "-",
            median_verdict(mean_ratios) if base != ref_alloc else "-"))
    return out


def step_ratios_by_moves(run, ref):
    """The timed steps of `run` paired with those of `ref` (the same steps: the same
    batches, in the same order), split by whether `run` moved pages in them: (ratios of
    the steps with moves, ratios of the steps without, pages moved in the timed steps).
    None when `run` has no per-step page counts or the two differ in steps."""
    moved, mine, theirs = run.get("unmapped_after_step"), timed_steps(run), timed_steps(ref)
    warmup = run.get("warmup", 0)
    if not moved or len(moved) != len(run.get("step_ms") or []) or len(mine) != len(theirs):
        return None
    before = [moved[warmup - 1] if warmup else 0] + moved[warmup:-1]
    with_moves, without = [], []
    for after, start, a, b in zip(moved[warmup:], before, mine, theirs):
        (with_moves if after > start else without).append(a / b)
    return with_moves, without, moved[-1] - before[0]


def moves_summary(results, ref_alloc=REF_ALLOC):
    """Markdown lines separating the cost of page moves from the host's noise: for each
    run with per-step page counts, its timed steps over the `ref_alloc` run's same steps
    of the same round, split into the steps in which it moved pages and those in which it
    moved none. The steps without moves show how far two runs differ with no move at all.
    Empty when no run has per-step page counts."""
    refs = {}
    for r in results:
        base, tag = split_tag(r.get("alloc", ""))
        if base == ref_alloc and not _failed(r):
            refs[(r.get("workload"), tag)] = r
    rows = []
    for r in results:
        base, tag = split_tag(r.get("alloc", ""))
        ref = refs.get((r.get("workload"), tag))
        if _failed(r) or ref is None or base == ref_alloc:
            continue
        split = step_ratios_by_moves(r, ref)
        if split is None:
            continue
        with_moves, without, pages = split
        med = lambda xs: "%.3f" % statistics.median(xs) if xs else "-"  # noqa: E731
        rows.append("| %s | %s | %s | %d of %d | %d | %s | %s |" % (
            r.get("workload"), base, tag or "1", len(with_moves), len(with_moves) + len(without),
            pages, med(with_moves), med(without)))
    if not rows:
        return []
    return ["", "Page moves in the timed steps (each step over the `%s` run's same step of "
            "the same round, median over the steps with moves and over those without):"
            % ref_alloc, "",
            "| workload | allocator | round | steps with moves | pages moved | step ratio, "
            "steps with moves | step ratio, steps without |",
            "|---|---|---|---|---|---|---|"] + rows


# ---------------------------------------------------------------------------------------
# The child: one workload under one allocator. torch is imported here only.


# The library's own call counters (GPUALLOC_TIME_CALLS=1), in the order kept per step.
CALL_KEYS = ("host_calls.malloc", "host_calls.free", "host_calls.malloc_ns",
             "host_calls.free_ns")


class Meter:
    """Step times, the cuMemGetInfo cross-check and, under our allocator (`ours`: a
    callable giving gpu_alloc.memory_stats()), after each step the pages unmapped so far
    and, where the library times its calls (--time-calls), each step's calls and their time
    (`calls_in_step`, from one read of the statistics a step, outside the timed span)."""

    def __init__(self, torch, ours=None, kernels=None):
        self.torch = torch
        self.kernels = kernels
        free0, self.total = torch.cuda.mem_get_info()
        self.used0 = self.total - free0
        self.used_peak = self.used0
        self.step_ms = []
        self.ours = ours
        # Generation reads the counters at every token, inside `generate`: only when the
        # library counts its calls, so that a plain run reads nothing PyTorch's does not.
        self.timing = ours is not None and os.environ.get("GPUALLOC_TIME_CALLS") == "1"
        self.unmapped_after_step = []
        self.calls_in_step = []
        # The counters before the first step, so that step 0 has a difference too.
        self._calls_last = self.calls_now()

    @staticmethod
    def _calls(stats):
        if CALL_KEYS[0] not in stats:
            return None
        return [stats.get(k, 0) for k in CALL_KEYS]

    def calls_now(self):
        """The library's call counters so far (CALL_KEYS' order), or None when it does not
        time its calls or the allocator is not ours (then nothing is read)."""
        return self._calls(self.ours()) if self.timing else None

    def add_calls(self, readings):
        """Appends a step's calls for each pair of consecutive readings of calls_now(): for
        workloads whose steps are marked inside a library call (generation's tokens)."""
        if readings and None not in readings:
            self.calls_in_step.extend([a - b for a, b in zip(x, y)]
                                      for x, y in zip(readings[1:], readings[:-1]))

    def sample(self):
        free, _ = self.torch.cuda.mem_get_info()
        self.used_peak = max(self.used_peak, self.total - free)

    def step_done(self, t0):
        """Call after torch.cuda.synchronize(): records the step, then samples memory."""
        self.step_ms.append((time.perf_counter() - t0) * 1e3)
        self.sample()
        if self.ours is not None:
            stats = self.ours()
            self.unmapped_after_step.append(stats.get("page_moves.pages_unmapped"))
            calls = self._calls(stats)
            if calls is not None and self._calls_last is not None:
                self.add_calls([self._calls_last, calls])
            self._calls_last = calls
        if self.kernels is not None:
            self.kernels.step_done()


class KernelTimer:
    """--kernel-time: the GPU time of every step's kernels, copies and fills, from the
    CUDA activity of torch.profiler (CUPTI), one profiling cycle a step, so that a slower
    step can be told apart as slower GPU work or as host time the GPU waited for (step
    time minus kernel time). The profiler's own host cost lands in every run alike."""

    TOP = 8  # kernels kept, by GPU time over the timed steps

    def __init__(self, torch):
        self.torch = torch
        self.ms, self.count, self.names = [], [], []
        sched = torch.profiler.schedule(wait=0, warmup=0, active=1, repeat=0)
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                           schedule=sched, on_trace_ready=self._collect)
        self.prof.start()

    def _collect(self, prof):
        cuda, by_name, count = self.torch.autograd.DeviceType.CUDA, {}, 0
        for e in prof.events():
            if e.device_type == cuda:
                by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
                count += 1
        self.ms.append(sum(by_name.values()))
        self.count.append(count)
        self.names.append(by_name)

    def step_done(self):
        """Ends the step's profiling cycle (its kernels are summed now) and starts the next."""
        self.prof.step()

    def result(self, warmup):
        """Per-step kernel ms and counts, and the kernels with the most GPU time per timed
        step (after `warmup`); the profiler is stopped. Stopping ends a last cycle (what ran
        after the last step), which is left out."""
        steps = len(self.ms)
        self.prof.stop()
        del self.ms[steps:], self.count[steps:], self.names[steps:]
        timed, total = self.names[warmup:], {}
        for by_name in timed:
            for name, ms in by_name.items():
                total[name] = total.get(name, 0.0) + ms
        top = sorted(total.items(), key=lambda kv: -kv[1])[:self.TOP]
        n = max(len(timed), 1)
        return {"kernel_ms": [round(v, 4) for v in self.ms], "kernels": self.count,
                "top_kernels": [{"name": k[:120], "ms_per_step": round(v / n, 4)}
                                for k, v in top]}


def _gpt2(torch):
    """GPT-2 small (124M) from transformers' config, random weights; a built-in equivalent
    when transformers is missing (its numbers then do not compare with transformers')."""
    try:
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return _mini_gpt2(torch), "builtin"
    try:
        transformers.logging.set_verbosity_error()
    except Exception:
        pass
    return GPT2LMHeadModel(GPT2Config()), "transformers " + transformers.__version__


def _mini_gpt2(torch):
    nn, F = torch.nn, torch.nn.functional
    V, P, D, H, NL = 50257, 1024, 768, 12, 12

    class Block(nn.Module):
        def __init__(s):
            super().__init__()
            s.ln_1, s.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
            s.c_attn, s.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            s.c_fc, s.mlp_proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

        def forward(s, x, cache):
            B, T, _ = x.shape
            q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in s.c_attn(s.ln_1(x)).split(D, 2))
            if cache is not None:
                if cache:
                    k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
                cache[:] = [k, v]
            a = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
            x = x + s.c_proj(a.transpose(1, 2).reshape(B, T, D))
            return x + s.mlp_proj(F.gelu(s.c_fc(s.ln_2(x)), approximate="tanh"))

    class Trunk(nn.Module):
        def __init__(s):
            super().__init__()
            s.wte, s.wpe = nn.Embedding(V, D), nn.Embedding(P, D)
            s.h = nn.ModuleList(Block() for _ in range(NL))
            s.ln_f = nn.LayerNorm(D)

        def forward(s, ids, caches=None, pos0=0):
            x = s.wte(ids) + s.wpe(torch.arange(pos0, pos0 + ids.shape[1], device=ids.device))
            for i, blk in enumerate(s.h):
                x = blk(x, None if caches is None else caches[i])
            return s.ln_f(x)

    class Out:
        def __init__(s, loss, logits):
            s.loss, s.logits = loss, logits

    class MiniGPT2(nn.Module):
        def __init__(s):
            super().__init__()
            s.transformer = Trunk()
            s.lm_head = nn.Linear(D, V, bias=False)
            s.lm_head.weight = s.transformer.wte.weight

        def forward(s, input_ids, labels=None):
            logits = s.lm_head(s.transformer(input_ids))
            loss = None
            if labels is not None:
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
            return Out(loss, logits)

        def generate(s, ids, max_new_tokens, top_k=50, **_):
            caches = [[] for _ in s.transformer.h]
            toks, cur, pos = [ids], ids, 0
            for _ in range(max_new_tokens):
                h = s.transformer(cur, caches, pos)
                pos += cur.shape[1]
                logits = s.lm_head(h[:, -1:])[:, -1].float()
                val, idx = logits.topk(top_k)
                cur = idx.gather(1, torch.multinomial(F.softmax(val, -1), 1))
                toks.append(cur)
            return torch.cat(toks, 1)

    return MiniGPT2()



def _train_step(torch, opt, loss, meter, t0, losses):
    """Backward and optimizer step, then time the step and keep its loss."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    meter.step_done(t0)
    losses.append(loss.item())

def wl_resnet50_train(torch, meter, steps, extra):
    import torchvision

    F = torch.nn.functional
    with torch.device("cuda"):  # initialised on the GPU: much faster than on the CPU
        m = torchvision.models.resnet50()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        t0 = time.perf_counter()
        x = torch.randn(64, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (64,), device="cuda")
        loss = F.cross_entropy(m(x), y)
        _train_step(torch, opt, loss, meter, t0, losses)
    return {"losses": losses}


def _gpt2_train(torch, meter, steps, extra, varlen):
    with torch.device("cuda"):  # initialised on the GPU: much faster than on the CPU
        m, extra["model"] = _gpt2(torch)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    losses, lengths = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        L = random.randint(32, 1024) if varlen else 1024
        ids = torch.randint(0, 50257, (8, L), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        _train_step(torch, opt, loss, meter, t0, losses)
        lengths.append(L)
    if varlen:
        extra["lengths"] = lengths
    return {"losses": losses}


def wl_gpt2_train(torch, meter, steps, extra):
    return _gpt2_train(torch, meter, steps, extra, varlen=False)


def wl_gpt2_varlen_train(torch, meter, steps, extra):
    return _gpt2_train(torch, meter, steps, extra, varlen=True)


def wl_gpt2_generate(torch, meter, rounds, extra):
    """Steps are decoded tokens: the time between the starts of two consecutive forward
    passes of the trunk (generate synchronises on every token), less the memory
    sampling done at each start. The prefill (first forward) and the last token of each
    round are left out; the caller's warm-up is the whole first round."""
    with torch.device("cuda"):
        m, extra["model"] = _gpt2(torch)
    m.eval()
    acc = torch.zeros((), dtype=torch.float64, device="cuda")
    marks, reads = [], []  # each forward's (start, end of the sampling), call counters

    def on_logits(mod, inp, out):
        acc.add_(out.sum(dtype=torch.float64))

    def on_forward(mod, args):
        a = time.perf_counter()
        meter.sample()
        reads.append(meter.calls_now())
        marks.append((a, time.perf_counter()))

    hooks = [m.lm_head.register_forward_hook(on_logits),
             m.transformer.register_forward_pre_hook(on_forward)]
    fp, round_ms, tokens, warm = [], [], [], 0
    with torch.no_grad():
        for r in range(rounds):
            del marks[:], reads[:]
            acc.zero_()
            t0 = time.perf_counter()
            plen = random.randint(16, 256)
            ids = torch.randint(0, 50257, (8, plen), device="cuda")
            out = m.generate(ids, max_new_tokens=256, do_sample=True, pad_token_id=0, min_new_tokens=256)
            torch.cuda.synchronize()
            round_ms.append((time.perf_counter() - t0) * 1e3)
            meter.sample()
            iv = [(marks[k + 1][0] - marks[k][1]) * 1e3 for k in range(1, len(marks) - 1)]
            meter.step_ms.extend(iv)
            meter.add_calls(reads[1:])  # the calls between the same marks as iv
            if r == 0:
                warm = len(iv)
            new = out[:, plen:].tolist()
            tokens.append(len(new[0]))
            fp.append({"prompt_len": plen, "logit_sum": acc.item(),
                       "tokens_sha256": hashlib.sha256(json.dumps(new).encode()).hexdigest()})
            del out, ids
    for h in hooks:
        h.remove()
    extra.update(round_ms=[round(v, 2) for v in round_ms], new_tokens=tokens, warmup=warm)
    return {"rounds": fp}


def wl_vit_varbatch_infer(torch, meter, steps, extra):
    """The sequence of `steps` random batch sizes runs twice; the first pass is the
    warm-up: every new batch size costs tens of ms of cuDNN plan building (the patch
    convolution) on its first use, far more than its allocations."""
    import torchvision

    with torch.device("cuda"):
        m = torchvision.models.vit_b_16().eval()
        # torchvision zero-initialises the classifier, which would make every logit 0
        torch.nn.init.normal_(m.heads.head.weight, std=0.02)
    batches = [random.randint(1, 96) for _ in range(steps)]
    sums = []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for b in batches + batches:
            t0 = time.perf_counter()
            out = m(torch.randn(b, 3, 224, 224, device="cuda"))
            torch.cuda.synchronize()
            meter.step_done(t0)
            sums.append(out.sum(dtype=torch.float64).item())
            del out
    extra.update(batches=batches, warmup=steps)
    return {"logit_sums": sums}


def _stats(torch, kind):
    """(memory_stats dict, source name, gpu_alloc's own dict or None)."""
    ours = None
    if kind == "gpualloc":
        import gpu_alloc

        ours = dict(gpu_alloc.memory_stats())
        try:
            st = dict(torch.cuda.memory_stats())
        except Exception:  # the pluggable allocator without the C++ bridge raises
            st = {}
        if st.get("reserved_bytes.all.peak"):
            return st, "torch.cuda.memory_stats", ours
        return ours, "gpu_alloc.memory_stats", ours
    return dict(torch.cuda.memory_stats()), "torch.cuda.memory_stats", None


STAT_KEYS = ["allocated_bytes.all.peak", "reserved_bytes.all.peak", "requested_bytes.all.peak",
             "active_bytes.all.peak", "num_device_alloc", "num_device_free", "num_alloc_retries",
             "num_ooms", "segment.all.peak"]


def child(workload, alloc, deterministic=False, steps=None, kernel_time=False):
    kind, conf = parse_alloc(alloc)
    default_steps, warmup = WORKLOADS[workload]
    steps = steps or default_steps
    t_start = time.perf_counter()
    bridge = None
    if kind == "gpualloc":
        sys.path.insert(0, PYROOT)
        import gpu_alloc

        gpu_alloc.enable(conf)  # the driver removed GPUALLOC_CONF: None = the defaults
        bridge = gpu_alloc.uses_bridge() if hasattr(gpu_alloc, "uses_bridge") else False
    import torch

    if deterministic:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        # ResNet-50's adaptive_avg_pool2d backward has no deterministic kernel (it is
        # exact here anyway: one contribution per input element).
        torch.use_deterministic_algorithms(True, warn_only=workload == "resnet50_train")
        import torch.utils.deterministic

        torch.utils.deterministic.fill_uninitialized_memory = False
    torch.manual_seed(0)
    random.seed(0)
    torch.cuda.init()
    ours = None
    if kind == "gpualloc":
        import gpu_alloc

        def ours():
            return gpu_alloc.memory_stats()
    meter = Meter(torch, ours, KernelTimer(torch) if kernel_time else None)
    extra = {}
    t0 = time.perf_counter()
    fingerprint = globals()["wl_" + workload](torch, meter, steps, extra)
    run_s = time.perf_counter() - t0
    warmup = extra.pop("warmup", warmup)
    if meter.kernels is not None:
        extra.update(meter.kernels.result(warmup))
    backend = torch.cuda.get_allocator_backend() if kind == "torch" else "gpualloc"
    st, source, ours = _stats(torch, kind)
    used_delta = meter.used_peak - meter.used0
    res = {k: st.get(k) for k in STAT_KEYS}
    res.update(
        workload=workload, alloc=alloc, kind=kind, conf=conf, backend=backend,
        deterministic=deterministic, bridge=bridge, fingerprint=fingerprint,
        step_ms=[round(v, 4) for v in meter.step_ms], warmup=warmup, steps=steps,
        unmapped_after_step=meter.unmapped_after_step or None,
        calls_in_step=meter.calls_in_step or None,
        median_step_ms=median_step_ms({"step_ms": meter.step_ms, "warmup": warmup}),
        stats_source=source,
        peak_reserved=st.get("reserved_bytes.all.peak"), reserved_source=source,
        peak_allocated=st.get("allocated_bytes.all.peak"), allocated_source=source,
        num_device_alloc=st.get("num_device_alloc"),
        device_used_at_start=meter.used0, device_used_peak=meter.used_peak,
        device_used_delta=used_delta, device_total=meter.total,
        run_s=round(run_s, 2), child_s=round(time.perf_counter() - t_start, 2),
        torch=torch.__version__, device=torch.cuda.get_device_name(), **extra)
    if backend == "cudaMallocAsync":
        # Only allocated / active / reserved exist there; device allocation counts do not.
        res["num_device_alloc"] = None
        res["allocated_source"] = "cudaMallocAsync pool"
        if not res["peak_reserved"]:
            res["peak_reserved"] = torch.cuda.max_memory_reserved() or None
        if not res["peak_reserved"]:
            res.update(peak_reserved=used_delta, reserved_source="cuMemGetInfo")
    if ours is not None and source != "gpu_alloc.memory_stats":
        res["gpu_alloc_stats"] = {k: ours.get(k) for k in STAT_KEYS}
    if ours is not None:
        # Our own counters, by group: what unmap_free_pages moved and the host
        # time it took; what plan_layout did (with it on).
        for group in ("page_moves", "plan_layout"):
            res[group] = {k.split(".", 1)[1]: v for k, v in ours.items()
                          if k.startswith(group + ".")}
    print("RESULT " + json.dumps(res), flush=True)
    sys.stderr.flush()
    os._exit(0)  # skips the interpreter's and CUDA's teardown (a second per run)


# ---------------------------------------------------------------------------------------
# The driver.


def _pick(arg, default, known):
    if arg in (None, "", "default"):
        names = default
    elif arg == "all":
        names = list(known)
    else:
        names = []
        for part in arg.split(","):
            # A CONF holds commas too: a part that names no allocator or workload
            # continues the previous CONF ('gpualloc:a:1,b:2' is one allocator).
            if names and ":" in part and ":" in names[-1] and not part.startswith(("torch", "gpualloc")):
                names[-1] += "," + part
            else:
                names.append(part)
    return [n.strip() for n in names if n.strip()]


def child_env(alloc, deterministic):
    kind, conf = parse_alloc(alloc)
    env = dict(os.environ)
    so = split_so(split_tag(alloc)[0])[1]
    if so:
        env["GPUALLOC_SO"] = os.path.abspath(so)
    env.pop("GPUALLOC_CONF", None)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if kind == "torch" and conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error",
               PYTHONWARNINGS="ignore")
    if deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    return env


def prebuild_bridge(timeout):
    """Builds gpu_alloc's C++ bridge into torch's extension cache once, so that the first
    gpualloc run does not carry the compilation (a no-op for a gpu_alloc without one)."""
    code = ("import sys; sys.path.insert(0, %r); import gpu_alloc\n"
            "b = getattr(gpu_alloc, 'build_bridge', None)\n"
            "print('built' if b and b() else 'none')" % PYROOT)
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=timeout, env=child_env("gpualloc", False))
        what = p.stdout.strip() if p.returncode == 0 else "failed: " + p.stderr.strip()[-600:]
    except subprocess.TimeoutExpired:
        what = "timed out"
    print("gpu_alloc bridge: %s (%.1f s)" % (what, time.perf_counter() - t0), flush=True)


def parse_cpus(text):
    """CPU numbers of a list such as '2-5,8' (argparse type for --cpus)."""
    cpus = set()
    try:
        for part in text.split(","):
            lo, dash, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if dash else int(lo)
            if first < 0 or last < first:
                raise ValueError
            cpus.update(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError("not a CPU list: %r (e.g. '2-5' or '2,3')" % text)
    return sorted(cpus)


def parse_cpu_lists(text):
    """CPU lists separated by ';', such as '2-9;18-25' (argparse type for --cpus): one for
    every child, or with --side-by-side the i-th for the i-th run of a round; or 'apart:N'
    (cpu_cores.Apart), lists of N physical cores that share none, made once their number
    is known."""
    try:
        apart = cpu_cores.parse_apart(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))
    return apart or [parse_cpus(part) for part in text.split(";")]


def resolve_cpu_lists(cpus, per_round, side_by_side):
    """--cpus as parse_cpu_lists gave it, for a round of `per_round` runs at once
    (side_by_side) or one run at a time: 'apart:N' made into that many lists (printed);
    ValueError unless there is one list a run of the round (one without side_by_side)."""
    wanted = per_round if side_by_side else 1
    if isinstance(cpus, cpu_cores.Apart):
        cpus = cpu_cores.cores_apart(wanted, cpus.per)
        print("CPU lists, no core shared: %s" % " ; ".join(
            cpu_cores.format_cpus(c) for c in cpus), flush=True)
    if cpus and len(cpus) != wanted:
        raise ValueError("--cpus needs %s (%d given)" % (
            "one CPU list a run of the round with --side-by-side (%d)" % wanted
            if side_by_side else "one CPU list without --side-by-side", len(cpus)))
    return cpus


def pinned_to(cpus):
    """A preexec_fn that pins the child to `cpus` (None: no pinning)."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def run_groups(allocs, side_by_side):
    """The runs of one workload in groups that run at the same time: with side_by_side one
    group a round (its allocators in the round's rotated order, the i-th on GPU i), otherwise
    one run a group."""
    if not side_by_side:
        return [[a] for a in allocs]
    groups = {}
    for a in allocs:
        groups.setdefault(split_tag(a)[1], []).append(a)
    return list(groups.values())


def run_group(workload, group, args):
    """The results of one group of run_groups, in the group's order: alone on the default
    GPU and --cpus, or (--side-by-side) every run at once, the i-th on GPU i and the i-th
    CPU list, so that the host's slow spells fall on all of the round's runs alike."""
    if not args.side_by_side:
        return [run_child(workload, group[0], args, None, args.cpus[0] if args.cpus else None)]
    return at_once([functools.partial(run_child, workload, alloc, args, i,
                                      args.cpus[i] if args.cpus else None)
                    for i, alloc in enumerate(group)])


def at_once(calls):
    """Runs the functions `calls` (no arguments) at the same time, each in a thread of its
    own, and returns their results in order (--side-by-side: a round's runs)."""
    results = [None] * len(calls)

    def one(i):
        results[i] = calls[i]()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results


def run_child(workload, alloc, args, gpu, cpus):
    """One run's child process: its RESULT line, or the error it ended with. `gpu`: the
    device it sees as its only one (CUDA_VISIBLE_DEVICES; None leaves the variable)."""
    cmd = child_command(workload, alloc, args.deterministic, args.steps, args.kernel_time)
    started = round(time.perf_counter() - T_START, 2)
    res = child_result(cmd, child_env(alloc, args.deterministic), args.timeout,
                       workload, alloc, cpus, gpu)
    res["started_s"] = started
    return res


def child_result(cmd, env, timeout, workload, alloc, cpus=None, gpu=None):
    """Runs a child that ends its output with a `RESULT <json>` line, pinned to `cpus` and
    seeing only GPU `gpu` (None: neither changed): that JSON, or a dict whose `error` says
    how the child ended; with its `proc_s`, and its `cpus` and `gpu` where given. A child
    that ran out of time keeps what its last `PARTIAL <json>` line said it had finished,
    with the error beside it."""
    if gpu is not None:
        env = dict(env, CUDA_VISIBLE_DEVICES=str(gpu))
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                           preexec_fn=pinned_to(cpus))
        lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        if p.returncode == 0 and lines:
            res = json.loads(lines[-1][7:])
        else:
            res = {"workload": workload, "alloc": alloc, "rc": p.returncode,
                   "error": "rc %s: %s" % (p.returncode, (p.stderr or p.stdout)[-1500:])}
    except subprocess.TimeoutExpired as e:  # run() killed the child
        res = last_partial(e.stdout) or {"workload": workload, "alloc": alloc}
        res["error"] = "timeout after %g s" % timeout
    res["proc_s"] = round(time.perf_counter() - t0, 2)
    if cpus:
        res["cpus"] = cpus
    if gpu is not None:
        res["gpu"] = gpu
    return res


def last_partial(stdout):
    """The JSON of the last `PARTIAL <json>` line of a child's output (bytes or text, as
    a timeout leaves it), or None."""
    if not stdout:
        return None
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    lines = [l for l in stdout.splitlines() if l.startswith("PARTIAL ")]
    try:
        return json.loads(lines[-1][len("PARTIAL "):]) if lines else None
    except ValueError:  # cut off mid-line
        return None


def report_run(res):
    """One line (or three) of a finished run on stdout."""
    w, a = res["workload"], res["alloc"]
    if _failed(res):
        print("FAILED %-20s %-36s %s" % (w, a, res["error"][-600:]), flush=True)
        return
    print("%-20s %-36s median %8s ms  reserved %s GiB (%s)  allocated %s GiB  "
          "dev allocs %s  cuMemGetInfo d %s GiB  %.1f s%s" % (
              w, a, _ms(res.get("median_step_ms")), _gib(res["peak_reserved"]),
              res["reserved_source"], _gib(res["peak_allocated"]),
              res["num_device_alloc"], _gib(res["device_used_delta"]), res["proc_s"],
              "  GPU %d" % res["gpu"] if "gpu" in res else ""),
          flush=True)
    moves = res.get("page_moves") or {}
    if moves.get("rounds"):
        print("%-20s %-36s page moves: %s rounds, %s unmapped (%s while busy), "
              "%s mapped, %s waits, %.1f ms host"
              % (w, a, moves["rounds"], moves.get("pages_unmapped"),
                 moves.get("busy_pages_reused"), moves.get("pages_mapped"),
                 moves.get("stream_waits"), (moves.get("host_ns") or 0) / 1e6),
              flush=True)
    plan = res.get("plan_layout") or {}
    if plan:
        print("%-20s %-36s plan_layout: %s plans (%s dropped), period %s, %s placed, "
              "%s conflicts, %s mismatches"
              % (w, a, plan.get("plans"), plan.get("dropped"), plan.get("period"),
                 plan.get("placed"), plan.get("conflicts"), plan.get("mismatches")),
              flush=True)


def write_outputs(results, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "compare_workloads.json"), "w") as f:
        json.dump(results, f, indent=1)
    head = ""
    ok = [r for r in results if not _failed(r)]
    if ok:
        r = ok[0]
        bridged = sorted({str(x.get("bridge")) for x in ok if x.get("kind") == "gpualloc"})
        head = "%s, torch %s%s%s\n\n" % (
            r.get("device"), r.get("torch"),
            ", deterministic algorithms" if r.get("deterministic") else "",
            (", gpualloc through the C++ bridge: %s" % "/".join(bridged)) if bridged else "")
    with open(os.path.join(out_dir, "compare_workloads.md"), "w") as f:
        f.write(head + make_table(results))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="?", help="comma list, 'all' or 'default' (%s)" % ",".join(DEFAULT_WORKLOADS))
    ap.add_argument("allocs", nargs="?", help="comma list, 'all' or 'default' (all nine)")
    ap.add_argument("--timeout", type=float, default=150, help="seconds per run (default 150)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"), help="output folder (default $OUT or /tmp)")
    ap.add_argument("--so", help="liballoc_ffi.so (default $GPUALLOC_SO, else gpu_alloc's search)")
    ap.add_argument("--deterministic", action="store_true", help="deterministic algorithms in every child")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run every allocator N times, interleaved (round k tagged '#k'); the "
                         "report adds each round's ratio to the reference run of that round")
    ap.add_argument("--cpus", type=parse_cpu_lists, metavar="LIST",
                    help="pin every child to these CPUs (e.g. '2-5' or '2,3'): a host-bound step "
                         "then moves less between runs; with --side-by-side one list a run of "
                         "the round, separated by ';' (e.g. '2-9;18-25'); 'apart:N': lists "
                         "of N physical cores that share no core (cpu_cores.py)")
    ap.add_argument("--side-by-side", action="store_true",
                    help="the allocators of a round run at the same time, the i-th of the "
                         "round's rotated order on GPU i (needs a GPU an allocator): slow "
                         "spells of the host then fall on every run of the round alike")
    ap.add_argument("--steps", type=int, metavar="N",
                    help="steps per run instead of each workload's default (rounds for "
                         "gpt2_generate, batches for vit_varbatch_infer); the warm-up steps "
                         "stay, so a longer run weighs the steady state more in the mean")
    ap.add_argument("--kernel-time", action="store_true",
                    help="time every step's kernels on the GPU (torch.profiler's CUDA activity): "
                         "the report splits the mean step into GPU work and host time the GPU "
                         "waited for, per run")
    ap.add_argument("--time-calls", action="store_true",
                    help="gpualloc runs time the library's own malloc and free calls "
                         "(GPUALLOC_TIME_CALLS=1): the report gives their time per timed step "
                         "and its share of the step, which bounds what the allocator adds")
    ap.add_argument("--from-json", metavar="FILE[,FILE...]",
                    help="only print the table of an earlier run's JSON; several files "
                         "(comma-separated) are pooled, their rounds numbered on")
    args = ap.parse_args(argv)
    if args.from_json:
        files = []
        for path in args.from_json.split(","):
            with open(path) as f:
                files.append(json.load(f))
        sys.stdout.write(make_table(files[0] if len(files) == 1 else pooled(files)))
        return 0
    workloads = _pick(args.workloads, DEFAULT_WORKLOADS, WORKLOADS)
    allocs = _pick(args.allocs, DEFAULT_ALLOCS, DEFAULT_ALLOCS)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    allocs = with_repeats(allocs, args.repeat)
    for w in workloads:
        if w not in WORKLOADS:
            ap.error("unknown workload %r (known: %s)" % (w, ", ".join(WORKLOADS)))
        if args.steps is not None and args.steps <= WORKLOADS[w][1] and w != "vit_varbatch_infer":
            ap.error("--steps %d leaves no timed step of %s (its warm-up is %d)"
                     % (args.steps, w, WORKLOADS[w][1]))
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be at least 1")
    for a in allocs:
        try:
            parse_alloc(a)
        except ValueError as e:
            ap.error(str(e))
    per_round = len(allocs) // args.repeat
    try:
        args.cpus = resolve_cpu_lists(args.cpus, per_round, args.side_by_side)
    except ValueError as e:
        ap.error(str(e))
    if args.so:
        os.environ["GPUALLOC_SO"] = os.path.abspath(args.so)
    if args.time_calls:
        os.environ["GPUALLOC_TIME_CALLS"] = "1"  # child_env passes it on
    results, t_all = [], time.perf_counter()
    if any(parse_alloc(a)[0] == "gpualloc" for a in allocs):
        prebuild_bridge(max(args.timeout, 300))
    for w in workloads:
        for group in run_groups(allocs, args.side_by_side):
            for res in run_group(w, group, args):
                results.append(res)
                report_run(res)
            write_outputs(results, args.out)
    print("\n%d runs in %.0f s; wrote %s/compare_workloads.{json,md}\n" % (
        len(results), time.perf_counter() - t_all, args.out))
    sys.stdout.write(make_table(results))
    return 0


def child_command(workload, alloc, deterministic=False, steps=None, kernel_time=False):
    """The command line of one run's child process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", workload, alloc]
    if deterministic:
        cmd.append("--deterministic")
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if kernel_time:
        cmd.append("--kernel-time")
    return cmd


def child_args(argv):
    """child()'s keyword arguments from the options after `--child WORKLOAD ALLOC`."""
    steps = None
    if "--steps" in argv:
        steps = int(argv[argv.index("--steps") + 1])
    return {"deterministic": "--deterministic" in argv, "steps": steps,
            "kernel_time": "--kernel-time" in argv}


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], **child_args(sys.argv[4:]))
    else:
        sys.exit(main())
