#!/usr/bin/env python3
"""CuPy workloads whose own memory pool fragments, under CuPy's MemoryPool and under gpualloc
(through gpu_alloc.cupy_allocator), and under RMM's pool where rmm is installed:

- growing: one buffer grown step by step (a new, larger buffer, the old contents copied in,
  the old one freed), as an append-only array does;
- kv_cache: a key/value cache of several layers grown by one token a step with
  cupy.concatenate, plus a per-layer scores temporary that grows with it.

Every (workload, pool) pair runs in a process of its own (an allocator is chosen once per
process). Printed: a markdown table of peak reserved memory over peak requested (the bytes
the workload's live arrays held at most, counted by the workload itself, the same for every
pool), the median and the mean time per step (synchronised at the end of each step).

    GPUALLOC_SO=target/release/liballoc_ffi.so python3 benchmarks/cupy_pool/growing.py
    python3 benchmarks/cupy_pool/growing.py --steps 64        # shorter
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MIB = 1 << 20

# The pools compared: name -> (kind, gpualloc configuration).
POOLS = {
    "cupy MemoryPool": ("cupy", None),
    "rmm pool": ("rmm", None),
    "gpualloc default": ("gpualloc", ""),
    "gpualloc expandable": ("gpualloc", "expandable_segments:True"),
    "gpualloc memory-bound": (
        "gpualloc",
        "expandable_segments:True,unmap_free_pages:True,unmap_page_mb:8,plan_layout:True,"
        "first_fit_mb:8",
    ),
}


class Account:
    """The bytes the workload's live arrays hold, and their peak."""

    def __init__(self):
        self.live = 0
        self.peak = 0

    def add(self, nbytes):
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def drop(self, nbytes):
        self.live -= nbytes


def growing(xp, steps, account, step_done):
    """One buffer grown by 1 MiB + 12 KiB a step, starting at 1 MiB."""
    grow = MIB + 12 * 1024
    size = MIB
    buf = xp.zeros(size, dtype=xp.uint8)
    account.add(size)
    for _ in range(steps):
        new_size = size + grow
        new = xp.empty(new_size, dtype=xp.uint8)
        account.add(new_size)
        new[:size] = buf
        new[size:] = 1
        del buf
        account.drop(size)
        buf, size = new, new_size
        step_done()
    del buf
    account.drop(size)


def kv_cache(xp, steps, account, step_done, layers=8, batch=8, heads=16, dim=64):
    """A key and a value tensor per layer, [batch, tokens, heads * dim] in float16, grown by
    one token a step with concatenate; a float32 scores temporary [batch, heads, tokens] per
    layer and step."""
    width = heads * dim
    token = batch * width * 2
    cache = []
    for _ in range(layers):
        pair = [xp.zeros((batch, 1, width), dtype=xp.float16) for _ in range(2)]
        account.add(2 * token)
        cache.append(pair)
    for step in range(1, steps + 1):
        tokens = step + 1
        for pair in cache:
            for i in range(2):
                fresh = xp.ones((batch, 1, width), dtype=xp.float16)
                account.add(token)
                grown = xp.concatenate([pair[i], fresh], axis=1)
                account.add(tokens * token)
                pair[i] = grown  # the old tensor is freed here
                account.drop((tokens - 1) * token)
                del fresh
                account.drop(token)
            scores = xp.empty((batch, heads, tokens), dtype=xp.float32)
            account.add(scores.nbytes)
            scores.fill(0)
            account.drop(scores.nbytes)
            del scores
        step_done()
    del cache
    account.drop(account.live)


WORKLOADS = {"growing": growing, "kv_cache": kv_cache}


def run_child(workload, pool, steps):
    """Runs one workload under one pool in this process; returns its figures."""
    kind, config = POOLS[pool]
    if kind == "gpualloc":
        os.environ["GPUALLOC_CONF"] = config
    import cupy

    if kind == "gpualloc":
        sys.path.insert(0, os.path.join(REPO, "python"))
        import gpu_alloc

        cupy.cuda.set_allocator(gpu_alloc.cupy_allocator)
        reserved_peak = lambda: gpu_alloc.max_memory_reserved(0)  # noqa: E731
    elif kind == "rmm":
        import rmm
        from rmm.allocators.cupy import rmm_cupy_allocator

        # RMM's pool, starting empty (any initial size would count as held), growing from
        # cudaMalloc; it never gives memory back, so its size is its peak.
        pool_mr = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=0)
        rmm.mr.set_current_device_resource(pool_mr)
        cupy.cuda.set_allocator(rmm_cupy_allocator)
        reserved_peak = pool_mr.pool_size
    else:
        pool_object = cupy.get_default_memory_pool()
        cupy.cuda.set_allocator(pool_object.malloc)
        reserved_peak = pool_object.total_bytes  # only grows: never freed back here

    device = cupy.cuda.Device()
    account = Account()
    times = []
    last = [time.perf_counter()]
    observed = [0]

    def step_done():
        device.synchronize()
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now
        if reserved_peak is not None:
            observed[0] = max(observed[0], reserved_peak())

    WORKLOADS[workload](cupy, steps, account, step_done)
    return {
        "workload": workload,
        "pool": pool,
        "steps": steps,
        "peak_requested": account.peak,
        "peak_reserved": observed[0] if reserved_peak is not None else None,
        "step_ms": statistics.median(times) * 1e3,
        "mean_step_ms": statistics.fmean(times) * 1e3,
    }


def markdown_table(results):
    """The results as a markdown table, one row per (workload, pool)."""
    lines = [
        "| workload | pool | peak requested | peak reserved | reserved / requested | ms / step |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.get("error"):
            lines.append("| %s | %s | | | (%s) | |" % (r["workload"], r["pool"], r["error"]))
            continue
        reserved = r["peak_reserved"]
        lines.append("| %s | %s | %.1f MiB | %s | %s | %.3f |" % (
            r["workload"], r["pool"], r["peak_requested"] / MIB,
            "%.1f MiB" % (reserved / MIB) if reserved is not None else "n/a",
            "%.2f" % (reserved / r["peak_requested"]) if reserved is not None else "n/a",
            r["step_ms"]))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS))
    parser.add_argument("--pool", action="append", choices=list(POOLS))
    parser.add_argument("--json", metavar="FILE", help="also write the results here")
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "POOL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run_child(args.child[0], args.child[1], args.steps)))
        return 0
    results = []
    for workload in args.workload or list(WORKLOADS):
        for pool in args.pool or list(POOLS):
            r = subprocess.run(
                [sys.executable, __file__, "--steps", str(args.steps), "--child", workload, pool],
                capture_output=True, text=True, timeout=1200)
            found = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
            if r.returncode == 0 and found:
                results.append(json.loads(found[-1][len("RESULT "):]))
            else:
                why = (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1]
                if POOLS[pool][0] == "rmm" and "No module named 'rmm'" in r.stderr:
                    why = "rmm not installed"
                results.append({"workload": workload, "pool": pool, "error": why[:120]})
            print(markdown_table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(markdown_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    failed = [r for r in results if r.get("error") and POOLS[r["pool"]][0] != "rmm"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
