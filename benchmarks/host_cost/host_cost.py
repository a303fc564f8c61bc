"""Host cost of gpualloc next to PyTorch's allocator and cudaMallocAsync, in the shared
harness's loops (../shared/device/alloc_bench.cpp, the loops of baseline.py), on a GPU
machine:

    python3 benchmarks/host_cost/host_cost.py --harness PATH/alloc_bench.cpp \
        --so target/release/liballoc_ffi.so [--out DIR]

Why more than baseline.py:
- baseline.py builds the harness with torch.utils.cpp_extension.load and no
  extra_cflags, that is without optimisation (-O0). Its mixed loop (mt19937_64,
  uniform_real_distribution, std::exp/log, a std::vector) then costs hundreds of ns per
  op by itself, which is charged to every allocator. This script builds the same
  source twice, as baseline.py does (-O0) and with -O2, and times a null allocator
  (malloc returns a constant, free does nothing; a C file built here) in the same
  loops: its figure is the loop's own cost, to subtract.
- It times gpualloc two ways: as a plain .so called by the loops (what baseline.py
  --so measures), and through PyTorch's allocator interface with the C++ bridge
  installed by gpu_alloc.enable() (the loops' "torch" kind then calls PyTorch's
  raw_alloc, which the bridge forwards to gpualloc: the path a PyTorch program takes).
  The second runs in a process of its own, since an allocator is chosen once per
  process.

Prints one table per build and writes DIR/host_cost.json. All figures are ns per
alloc+free pair (pair rows) and ns per operation (mixed rows), as in baseline.py.

--interleave N times only gpualloc's .so and the null allocator, in one process, in N
rounds that alternate the harness builds (O0, O2, O0, O2, ...): whether a difference
between the builds is the harness's or the host's drift between processes. Writes
DIR/host_cost_interleaved.json.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "python"))

# (label, baseline.py's loop arguments); the same sizes and counts as baseline.py.
PAIRS = [(512, 200000), (65536, 200000), (1 << 20, 200000), (8 << 20, 100000), (64 << 20, 50000)]
MIXED = [("mixed small", 512, 1 << 20, 1000), ("mixed wide", 512, 64 << 20, 200)]
MIXED_OPS = 400000
KIND_TORCH, KIND_ASYNC, KIND_SO = 0, 1, 3
NULL_C = r"""
#include <stddef.h>
#include <sys/types.h>
static char sink[64];
void* null_malloc(ssize_t n, int d, void* s) { (void)n; (void)d; (void)s; return sink; }
void null_free(void* p, ssize_t n, int d, void* s) { (void)p; (void)n; (void)d; (void)s; }
"""


def row_labels():
    return ["%s pair" % human(size) for size, _ in PAIRS] + [m[0] for m in MIXED]


def human(n):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return "%d %s" % (n // scale, unit)
    return "%d B" % n


def build_harness(path, opt):
    from torch.utils.cpp_extension import load

    flags = [] if opt == "O0" else ["-" + opt]
    return load(name="alloc_bench_host_cost_" + opt, sources=[path], extra_cflags=flags,
                extra_ldflags=["-ldl"], with_cuda=True)


def build_null(tmp):
    src = os.path.join(tmp, "null_alloc.c")
    so = os.path.join(tmp, "libnull_alloc.so")
    with open(src, "w") as f:
        f.write(NULL_C)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", so, src], check=True)
    return so


def time_kind(ext, kind):
    """baseline.py's loops for one allocator kind: pairs, then the mixed workloads."""
    out = [ext.pair_ns(kind, size, iters) for size, iters in PAIRS]
    out += [ext.mixed_ns(kind, 42, MIXED_OPS, live, lo, hi) for _, lo, hi, live in MIXED]
    return out


def start_cuda():
    """Initialises CUDA and the current allocator before any loop is timed."""
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")


def child(args):
    """One process: either the native set (torch, cudaMallocAsync, gpualloc .so, null)
    or the bridge run (gpu_alloc.enable(), then the torch kind)."""
    if args.child == "bridge":
        import gpu_alloc

        gpu_alloc.enable(args.config, so_path=args.so, bridge=True)
    start_cuda()
    ext = build_harness(args.harness, args.opt)
    res = {}
    if args.child == "bridge":
        res["gpualloc via bridge"] = time_kind(ext, KIND_TORCH)
    else:
        res["torch"] = time_kind(ext, KIND_TORCH)
        res["cudaMallocAsync"] = time_kind(ext, KIND_ASYNC)
        with tempfile.TemporaryDirectory() as tmp:
            res.update(time_so_and_null(ext, args.so, build_null(tmp)))
    print("RESULT " + json.dumps(res), flush=True)


def time_so_and_null(ext, so, null_so):
    """baseline.py's loops calling gpualloc's .so, then the null allocator (the loop's cost)."""
    res = {}
    for name, lib, a, f in (("gpualloc .so", so, "gpualloc_malloc", "gpualloc_free"),
                            ("null (loop cost)", null_so, "null_malloc", "null_free")):
        assert ext.load_ext(os.path.abspath(lib), a, f), "cannot load " + lib
        res[name] = time_kind(ext, KIND_SO)
    return res


def interleaved(args):
    """One process: every harness build of --opts, then --interleave rounds alternating
    the builds, each timing gpualloc's .so and the null allocator."""
    start_cuda()
    opts = args.opts.split(",")
    exts = {opt: build_harness(args.harness, opt) for opt in opts}
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        null_so = build_null(tmp)
        for _ in range(args.interleave):
            for opt in opts:
                got = {"opt": opt, **time_so_and_null(exts[opt], args.so, null_so)}
                rounds.append(got)
                print("round %d, %s: .so %s | null %s" % (
                    len(rounds), opt, " ".join("%.0f" % v for v in got["gpualloc .so"]),
                    " ".join("%.0f" % v for v in got["null (loop cost)"])), flush=True)
    return rounds


def interleaved_table(rounds):
    """Per build and row: every round's .so figure, the best one, the best null figure and
    the best .so figure net of it."""
    opts = list(dict.fromkeys(r["opt"] for r in rounds))
    lines = ["| workload | build | gpualloc .so per round | best | null, best | best - null |",
             "|---|---|---|---|---|---|"]
    for i, label in enumerate(row_labels()):
        for opt in opts:
            ours = [r["gpualloc .so"][i] for r in rounds if r["opt"] == opt]
            null = min(r["null (loop cost)"][i] for r in rounds if r["opt"] == opt)
            lines.append("| %s | %s | %s | %.0f | %.0f | %.0f |" % (
                label, opt, " / ".join("%.0f" % v for v in ours), min(ours), null,
                min(ours) - null))
    return "\n".join(lines)


def table(opt, res):
    cols = ["torch", "cudaMallocAsync", "gpualloc .so", "gpualloc via bridge", "null (loop cost)"]
    cols = [c for c in cols if c in res]
    lines = ["harness built %s (ns; pair rows per alloc+free pair, mixed rows per op)" % (
        "as baseline.py builds it (no optimisation)" if opt == "O0" else "with -" + opt), "",
        "| workload | " + " | ".join(cols) + " | gpualloc .so / torch | bridge / torch | gpualloc .so - null |",
        "|---" * (len(cols) + 4) + "|"]
    for i, label in enumerate(row_labels()):
        vals = [res[c][i] for c in cols]
        ours, torch_ns = res["gpualloc .so"][i], res["torch"][i]
        bridge = res.get("gpualloc via bridge", [None] * len(row_labels()))[i]
        lines.append("| %s | %s | %.2f | %s | %.0f |" % (
            label, " | ".join("%.0f" % v for v in vals), ours / torch_ns,
            "%.2f" % (bridge / torch_ns) if bridge else "n/a", ours - res["null (loop cost)"][i]))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--harness", required=True, help="alloc_bench.cpp of the shared device folder")
    ap.add_argument("--so", default=os.environ.get("GPUALLOC_SO"), help="liballoc_ffi.so")
    ap.add_argument("--config", default=None, help="GPUALLOC_CONF for both gpualloc runs")
    ap.add_argument("--opts", default="O0,O2", help="harness builds to time (default O0,O2)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--interleave", type=int, metavar="N",
                    help="only gpualloc's .so and the null allocator, N rounds alternating the builds")
    ap.add_argument("--child", choices=("native", "bridge"), help=argparse.SUPPRESS)
    ap.add_argument("--opt", default="O0", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.so:
        ap.error("--so (or $GPUALLOC_SO) is required")
    if args.child:
        return child(args)
    if args.config is not None:
        os.environ["GPUALLOC_CONF"] = args.config  # for this process and the children
    if args.interleave:
        rounds = interleaved(args)
        print("\n" + interleaved_table(rounds), flush=True)
        with open(os.path.join(args.out, "host_cost_interleaved.json"), "w") as f:
            json.dump({"rows": row_labels(), "rounds": rounds}, f, indent=1)
        return None
    results = {}
    for opt in args.opts.split(","):
        res = {}
        for which in ("native", "bridge"):
            cmd = [sys.executable, __file__, "--child", which, "--opt", opt, "--harness",
                   args.harness, "--so", args.so]
            r = subprocess.run(cmd, capture_output=True, text=True)
            lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
            if r.returncode != 0 or not lines:
                sys.exit("%s run (%s) failed:\n%s%s" % (which, opt, r.stdout[-3000:], r.stderr[-3000:]))
            res.update(json.loads(lines[-1][7:]))
        results[opt] = res
        print(table(opt, res) + "\n", flush=True)
    with open(os.path.join(args.out, "host_cost.json"), "w") as f:
        json.dump({"rows": row_labels(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
