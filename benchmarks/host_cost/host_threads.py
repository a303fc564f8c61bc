"""Host cost with many threads on one device, and with one thread per device, side by side
with PyTorch's allocator and cudaMallocAsync (method and columns: README.md here).

    bash benchmarks/host_cost/prepare.sh          # where Rust is: gpu_bench + liballoc_ffi.so
    python3 benchmarks/host_cost/host_threads.py --out $OUT             # one GPU
    python3 benchmarks/host_cost/host_threads.py --devices 1,2,4 --out $OUT  # 1 thread/device
    python3 benchmarks/host_cost/host_threads.py --null-driver --out DIR  # no GPU, no torch

Paths (each its own column of cells; "process" says which process times it):
- native process: PyTorch's allocator (raw_alloc_with_stream / raw_delete), cudaMallocAsync,
  the C library (liballoc_ffi.so called as a pluggable .so), a null allocator (the loop's own
  cost), at::empty in C++ threads, torch.empty / del in Python threads;
- bridge process (gpu_alloc.enable(bridge=True)): at::empty, raw_alloc and torch.empty, which
  now reach gpualloc through the C++ bridge, and cudaMallocAsync as the anchor between
  processes;
- pluggable processes, one per library (torch.cuda.memory.CUDAPluggableAllocator installed
  before CUDA is initialised): at::empty over null_pluggable.c, an allocator doing nothing
  (the floor of PyTorch's path), and over liballoc_ffi.so's gpualloc_malloc / gpualloc_free
  without the bridge; cudaMallocAsync as the anchor in each;
- rust process: gpu_bench --threads (CudaAllocator, and cuMemAllocAsync as the anchor).
With --null-driver: the C library, the null allocator and gpu_bench over the null driver of
crates/alloc-cuda/null-driver (a libcuda.so doing no device work): host code only, never GPU
figures.

Writes DIR/host_threads.json (every cell of every repeat, and the tables) and prints the
tables: one per path, ratios to its PyTorch reference (same process: median and mean of the
per-repeat ratios; across processes: ratio of the medians, marked *), and the floor of the
at::empty path with each allocator's share above it.
"""
import argparse
import ctypes
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "python", "examples"))
import compare_workloads as cw  # noqa: E402  (the interval of per-round ratios)
BUNDLE = os.path.join(REPO, "gpu-bundle", "host_cost")

TORCH_RAW = "torch raw_alloc"
AT_EMPTY = "at::empty, PyTorch's allocator"
PY_EMPTY = "torch.empty (Python), PyTorch's allocator"
ANCHOR = "cudaMallocAsync"
BRIDGE_EMPTY = "at::empty via bridge"
FLOOR = "at::empty via pluggable null"
PLUGGABLE_EMPTY = "at::empty via pluggable gpualloc"

# (path, process, kind, reference path or None). The kinds are mt_torch.cpp's, plus
# "python" (this file's Python threads) and the gpu_bench --threads columns.
PATHS = [
    (TORCH_RAW, "native", "torch", None),
    (ANCHOR, "native", "async", TORCH_RAW),
    ("gpualloc C library", "native", "so", TORCH_RAW),
    ("null (loop cost)", "native", "null", None),
    (AT_EMPTY, "native", "empty", None),
    (PY_EMPTY, "native", "python", None),
    (BRIDGE_EMPTY, "bridge", "empty", AT_EMPTY),
    ("raw_alloc via bridge", "bridge", "torch", TORCH_RAW),
    ("torch.empty (Python) via bridge", "bridge", "python", PY_EMPTY),
    ("cudaMallocAsync (bridge process)", "bridge", "async", ANCHOR),
    (FLOOR, "pluggable-null", "empty", AT_EMPTY),
    ("cudaMallocAsync (pluggable-null process)", "pluggable-null", "async", ANCHOR),
    (PLUGGABLE_EMPTY, "pluggable-gpualloc", "empty", AT_EMPTY),
    ("cudaMallocAsync (pluggable-gpualloc process)", "pluggable-gpualloc", "async", ANCHOR),
    ("gpualloc CudaAllocator (Rust)", "rust", "ours", TORCH_RAW),
    ("cuMemAllocAsync (Rust process)", "rust", "driver-async", ANCHOR),
]
NULL_DRIVER_PATHS = [
    ("gpualloc C library", "cpu", "so", None),
    ("null (loop cost)", "cpu", "null", None),
    ("gpualloc CudaAllocator (Rust)", "rust", "ours", "gpualloc C library"),
    ("cuMemAllocAsync (Rust process)", "rust", "driver-async", None),
]
# --rust-engines: gpu_bench's engine layouts beyond one engine a device ("device", the
# paths above), each a path of the rust process: an engine per thread (what per-stream
# engines could carry), alone and with the device-wide counters they would share
# (docs/architecture.md, "Threads"). Mode -> (path name, gpu_bench's flags).
ENGINE_MODES = {
    "thread": ("gpualloc CudaAllocator, an engine per thread", ["--engines", "thread"]),
    "thread+atomic": ("gpualloc CudaAllocator, an engine per thread, atomic shared counters",
                      ["--engines", "thread", "--shared-totals", "atomic"]),
    "thread+locked": ("gpualloc CudaAllocator, an engine per thread, locked shared counters",
                      ["--engines", "thread", "--shared-totals", "locked"]),
    "stream": ("gpualloc StreamEngines, an engine per stream", ["--engines", "stream"]),
}


def engine_per_stream(config):
    """Whether a GPUALLOC_CONF string asks for an engine per stream: the C library then
    serves each device through StreamEngines, whose Rust path is --rust-engines' "stream"
    (CudaAllocator, one engine a device, refuses the setting)."""
    for item in (config or "").split(","):
        key, _, value = item.partition(":")
        if key.strip() == "engine_per_stream":
            return value.strip().lower() in ("true", "1")
    return False


def engine_paths(args, reference):
    """The rust process's paths of --rust-engines' modes beyond "device"."""
    return [(ENGINE_MODES[m][0], "rust", "ours:" + m, reference)
            for m in args.rust_engines if m != "device"]
# The pluggable processes: the library PyTorch's CUDAPluggableAllocator loads in each
# ("null": null_pluggable.c, built at run time; "gpualloc": --so) and its two functions.
PLUGGABLE = {
    "pluggable-null": ("null", "null_malloc", "null_free"),
    "pluggable-gpualloc": ("gpualloc", "gpualloc_malloc", "gpualloc_free"),
}
# Python threads hold the GIL for most of each call: fewer calls per window suffice.
PYTHON_WARM_CALLS = 2000


def parse_size(text):
    """'512', '64K', '8M' -> bytes."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def parse_workload(spec):
    """'pair:SIZE', 'pair0:SIZE' or 'mixed:LO:HI:LIVE' -> dict (sizes in bytes, with a
    label). pair0: pairs of SIZE taking turns with pairs of 0 bytes, the calls of each
    timed apart (the allocator's share of the path; runs_zero_pairs says where)."""
    parts = spec.split(":")
    if parts[0] in ("pair", "pair0") and len(parts) == 2:
        size = parse_size(parts[1])
        zero = parts[0] == "pair0"
        if zero and size == 0:
            raise ValueError("pair0:SIZE needs SIZE > 0: " + spec)
        return {"spec": "%s:%d" % (parts[0], size), "mixed": False, "size": size, "lo": 0,
                "hi": 0, "max_live": 0, "with_zero": zero,
                "label": "%s pair%s" % (human(size), ", 0 B pairs between" if zero else "")}
    if parts[0] == "mixed" and len(parts) == 4:
        lo, hi, live = parse_size(parts[1]), parse_size(parts[2]), int(parts[3])
        if not 0 < lo <= hi or live < 1:
            raise ValueError("mixed:LO:HI:LIVE needs 0 < LO <= HI and LIVE >= 1: " + spec)
        return {"spec": "mixed:%d:%d:%d" % (lo, hi, live), "mixed": True, "size": 0, "lo": lo,
                "hi": hi, "max_live": live, "with_zero": False,
                "label": "mixed %s..%s, %d live" % (human(lo), human(hi), live)}
    raise ValueError("a workload is pair:SIZE, pair0:SIZE or mixed:LO:HI:LIVE, not " + spec)


# mt_loops.h's Phase: alloc and free of the workload's size, then of 0 bytes.
PHASES = 4


def runs_zero_pairs(process, kind):
    """Whether a path times pair0 workloads: those whose 0-byte request returns something to
    free without asking the allocator for memory, at::empty in PyTorch's own process and in
    the bridge's (a tensor of no bytes: PyTorch's allocator and the bridge hand out nothing
    for it), and the null allocator. raw_alloc, cudaMallocAsync and the C library return NULL
    for 0 bytes, and PyTorch's pluggable wrapper passes 0 bytes on to the library and
    records what it returns, so pair0 leaves them out."""
    return kind == "null" or (kind == "empty" and process not in PLUGGABLE)


def human(n):
    """Bytes as the labels write them: 512 B, 64 KiB, 8 MiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return "%d %s" % (n // scale, unit)
    return "%d B" % n


def plan(args):
    """The cells of one repeat, in order: (workload, streams, device_of_thread)."""
    cells = []
    for w in args.workloads:
        if args.devices:
            for n in args.devices:
                cells.append((w, "own", list(range(n))))
        else:
            for streams in args.streams:
                for t in args.threads:
                    cells.append((w, streams, [0] * t))
    return cells


def rotate(items, k):
    """items rotated left by k: the order of the paths in cell k."""
    k %= max(len(items), 1)
    return items[k:] + items[:k]


def warm_calls(w):
    """Calls each thread makes before the start line: enough for the cache to hold the
    workload's blocks (a mixed run's live set grows as a random walk)."""
    return 2000 if not w["mixed"] else max(20000, 20 * w["max_live"])


def process_label(args, process):
    """The process a cell ran in, as ratios tell same-process pairs apart: `process`, or
    with --kinds (a run of --path-per-process) `process:kind+kind`."""
    return process if args.kinds is None else "%s:%s" % (process, "+".join(args.kinds))


def run_cells(args, process, timers, log=print):
    """Runs every cell of the plan, `args.repeats` times, the paths of `process` rotated
    from cell to cell; timers: kind -> function(w, streams, device_of_thread) -> dict."""
    paths = [p for p in active_paths(args) if p[1] == process
             and (args.kinds is None or p[2] in args.kinds)]
    out = []
    for rep in range(args.repeats):
        for i, (w, streams, devs) in enumerate(plan(args)):
            for name, _, kind, _ in rotate(paths, rep + i):
                if w["with_zero"] and not runs_zero_pairs(process, kind):
                    continue
                r = timers[kind](w, streams, devs)
                cell = {"path": name, "process": process_label(args, process), "repeat": rep,
                        "workload": w["label"],
                        "streams": streams, "threads": len(devs), "devices": len(set(devs))}
                cell.update(r)
                out.append(cell)
                if r.get("failed_threads"):
                    log("%s, %s, %d threads: %d thread(s) failed: %s" % (
                        name, w["label"], len(devs), r["failed_threads"], r.get("error")))
    return out


def active_paths(args):
    """The paths this run times (PATHS, less the Python threads with --no-python, the
    bridge process with --no-bridge and the pluggable processes with --no-pluggable; the
    null driver's set with --null-driver; CudaAllocator's when --rust-engines leaves out
    one engine a device)."""
    one_engine = "device" in args.rust_engines
    base = NULL_DRIVER_PATHS if args.null_driver else PATHS
    kept = [p for p in base if not (args.no_python and p[2] == "python")
            and not (args.no_bridge and p[1] == "bridge")
            and not (args.no_pluggable and p[1] in PLUGGABLE)
            and not (not one_engine and p[1:3] == ("rust", "ours"))]
    return kept + engine_paths(args, "gpualloc C library" if args.null_driver else TORCH_RAW)


def processes(args):
    """The child processes of a GPU run, in the order they run: those of the active paths
    other than gpu_bench's."""
    return list(dict.fromkeys(p[1] for p in active_paths(args) if p[1] != "rust"))


# PyTorch's C++ paths (raw_alloc, at::empty). In one process their cells run in two regimes
# by their order: the first of them in a group of cells fast, the next slow, and every one
# slow after the first repeat (docs/benchmarks.md, "PyTorch's path with many threads").
# --path-per-process gives each of them a process of its own.
TORCH_CXX_KINDS = ("torch", "empty")


def child_runs(args, which):
    """The runs of process `which`: one running all its paths ([None]), or with
    --path-per-process one for each of its PyTorch C++ paths (TORCH_CXX_KINDS) and one
    for the rest, each a list of the kinds it times."""
    if not args.path_per_process:
        return [None]
    kinds = [p[2] for p in active_paths(args) if p[1] == which]
    alone = [[k] for k in kinds if k in TORCH_CXX_KINDS]
    rest = [k for k in kinds if k not in TORCH_CXX_KINDS]
    return alone + ([rest] if rest else [])


# ---------------------------------------------------------------- Python threads

def python_cell(torch, w, devs, streams, args):
    """torch.empty / del in Python threads (one per entry of devs), timed as mt_loops.h
    times its threads: warm, start line, rounds of sample_every calls (the last timed)
    until the window ends."""
    n = len(devs)
    stop = threading.Event()
    start = threading.Barrier(n + 1)
    res = [None] * n
    every = args.sample_every

    def worker(t):
        dev = torch.device("cuda", devs[t])
        idx = 0 if streams == "shared" else sum(1 for d in devs[:t] if d == devs[t])
        rng = random.Random(42 + t)
        live, held = [], []
        empty, u8 = torch.empty, torch.uint8
        lat = []
        log_lo = lo_span = 0.0
        if w["mixed"]:
            import math

            log_lo = math.log(w["lo"])
            lo_span = math.log(w["hi"]) - log_lo
            exp = math.exp

        def call():
            if not w["mixed"]:
                if held:
                    held.pop()
                else:
                    held.append(empty(w["size"], dtype=u8, device=dev))
                return
            if not live or (len(live) < w["max_live"] and rng.random() < 0.5):
                live.append(empty(int(exp(log_lo + rng.random() * lo_span)), dtype=u8, device=dev))
            else:
                j = int(rng.random() * len(live))
                live[j] = live[-1]
                live.pop()

        try:
            with torch.cuda.device(dev), torch.cuda.stream(PY_STREAMS[devs[t]][idx]):
                for _ in range(min(warm_calls(w), PYTHON_WARM_CALLS)):
                    call()
                start.wait()
                calls, clock, rounds = 0, time.perf_counter_ns, range(every - 1)
                while True:  # rounds of `every` calls, the last one timed
                    for _ in rounds:
                        call()
                    a = clock()
                    call()
                    lat.append(clock() - a)
                    calls += every
                    if stop.is_set():
                        break
                end = time.perf_counter_ns()
                held.clear()
                live.clear()
            res[t] = (calls, end, lat, None)
        except Exception as e:  # out of memory, or another thread's failure
            start.abort()  # nobody waits for this thread at the start line
            res[t] = (0, 0, [], "%s: %s" % (type(e).__name__, e))

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(n)]
    for th in ts:
        th.start()
    try:
        start.wait()
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter_ns()
    time.sleep(args.window)
    stop.set()
    for th in ts:
        th.join()
    for d in sorted(set(devs)):
        torch.cuda.synchronize(d)
    ok = [r for r in res if r[3] is None]
    errors = [r[3] for r in res if r[3] is not None]
    lat = sorted(x for r in ok for x in r[2])
    return {"calls": sum(r[0] for r in ok),
            "wall_ns": float(max(r[1] for r in ok) - t0) if ok else 0.0,
            "p50_ns": quantile(lat, 0.5), "p99_ns": quantile(lat, 0.99),
            "p999_ns": quantile(lat, 0.999), "max_ns": float(lat[-1]) if lat else 0.0,
            "samples": len(lat), "failed_threads": len(errors),
            "error": errors[0] if errors else ""}


PY_STREAMS = {}


def quantile(sorted_values, q):
    """Nearest-rank quantile of a sorted list, as mt_loops.h computes it."""
    if not sorted_values:
        return 0.0
    i = max(int(-(-q * len(sorted_values) // 1)) - 1, 0)
    return float(sorted_values[min(i, len(sorted_values) - 1)])


# ---------------------------------------------------------------- processes

def build_ext(verbose=False):
    """Builds (or loads from torch's extension cache) mt_torch.cpp with -O2."""
    from torch.utils.cpp_extension import load

    return load(name="host_threads_mt", sources=[os.path.join(HERE, "mt_torch.cpp")],
                extra_cflags=["-O2", "-I" + HERE], extra_ldflags=["-ldl"],
                with_cuda=True, verbose=verbose)


def child(args):
    """One process of the GPU run (--child native|bridge|pluggable-*): prints RESULT <json>."""
    if args.child == "bridge":
        sys.path.insert(0, os.path.join(REPO, "python"))
        import gpu_alloc

        gpu_alloc.enable(args.config, so_path=args.so, bridge=True)
    import torch

    if args.child in PLUGGABLE:  # before CUDA is initialised: PyTorch's allocator is chosen once
        allocator = torch.cuda.memory.CUDAPluggableAllocator(*pluggable_library(args))
        torch.cuda.memory.change_current_allocator(allocator)

    torch.cuda.init()
    ndev = max(args.devices) if args.devices else 1
    for d in range(ndev):
        if torch.empty(1, device=torch.device("cuda", d)).data_ptr() == 0:
            sys.exit("%s process: the allocator gave no memory on device %d" % (args.child, d))
    ext = build_ext()
    per_device = 1 if args.devices else max(args.threads)
    ext.make_streams(ndev, per_device)
    for d in range(ndev):
        PY_STREAMS[d] = [torch.cuda.Stream(device=d) for _ in range(per_device)]
    if args.child == "native":
        assert ext.load_so(os.path.abspath(args.so), "gpualloc_malloc", "gpualloc_free"), \
            "cannot load " + args.so

    def native(kind):
        return lambda w, streams, devs: ext.cell(
            kind, w["mixed"], w["size"], w["lo"], w["hi"], w["max_live"], w["with_zero"], devs,
            streams == "shared", args.window, warm_calls(w), args.sample_every,
            not args.unbound_threads)

    timers = {k: native(k) for k in ("torch", "async", "so", "null", "empty")}
    timers["python"] = lambda w, streams, devs: python_cell(torch, w, devs, streams, args)
    cells = run_cells(args, args.child, timers, log=lambda m: print(m, file=sys.stderr))
    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0), "devices": torch.cuda.device_count(),
            "clock_pair_ns": ext.clock_pair_ns(),
            "threads_bind_context": not args.unbound_threads}
    print("RESULT " + json.dumps({"cells": cells, "info": info}), flush=True)


def pluggable_library(args):
    """(library, malloc name, free name) PyTorch's CUDAPluggableAllocator loads in the
    pluggable process args.child."""
    lib, malloc_name, free_name = PLUGGABLE[args.child]
    path = args.null_pluggable if lib == "null" else args.so
    if not path or not os.path.isfile(path):
        sys.exit("%s: no library %r" % (args.child, path))
    return os.path.abspath(path), malloc_name, free_name


def run_child(args, which, env=None, extra=()):
    """Runs this script as process `which` and returns its RESULT."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", which] + common_argv(args)
    t = time.time()
    r = subprocess.run(cmd + list(extra), capture_output=True, text=True, env=env)
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        sys.exit("%s process failed (exit %d):\n%s%s" % (which, r.returncode, r.stdout[-3000:],
                                                         r.stderr[-5000:]))
    if r.stderr.strip():
        print(r.stderr.strip()[-2000:], file=sys.stderr)
    got = json.loads(lines[-1][7:])
    label = which
    if "--kinds" in extra:
        label += " (%s)" % extra[list(extra).index("--kinds") + 1]
    print("%s process: %d cells in %.0f s" % (label, len(got["cells"]), time.time() - t), flush=True)
    return got


def common_argv(args):
    """The options a child process of this script gets from the parent."""
    argv = ["--so", args.so, "--window", str(args.window), "--repeats", str(args.repeats),
            "--sample-every", str(args.sample_every),
            "--workloads", ",".join(w["spec"] for w in args.workloads)]
    argv += shape_argv(args)
    if args.no_python:
        argv.append("--no-python")
    if args.unbound_threads:
        argv.append("--unbound-threads")
    if args.null_driver:
        argv.append("--null-driver")
    return argv


def rust_argv(args):
    """gpu_bench --threads's command line for this plan."""
    argv = [args.gpu_bench, "--window", str(args.window), "--repeats", str(args.repeats),
            "--sample-every", str(args.sample_every)]
    for w in rust_workloads(args):
        argv += ["--workload", w["spec"], "--warm", str(warm_calls(w))]
    return argv + shape_argv(args)


def rust_workloads(args):
    """The workloads gpu_bench --threads runs: all but pair0's (its paths return nothing
    for 0 bytes)."""
    return [w for w in args.workloads if not w["with_zero"]]


def shape_argv(args):
    """The plan's shape, as both the child processes and gpu_bench take it: the devices
    (one thread each) or the thread counts and stream modes, and the configuration."""
    argv = []
    if args.devices:
        argv += ["--devices", ",".join(map(str, args.devices))]
    else:
        argv += ["--threads", ",".join(map(str, args.threads)), "--streams",
                 ",".join(args.streams)]
    if args.config is not None:
        argv += ["--config", args.config]
    return argv


def run_rust(args, env=None):
    """gpu_bench --threads, once for each of --rust-engines' modes: one CELL <json> line per
    cell. cuMemAllocAsync's cells are kept from the first run only."""
    cells = []
    for n, mode in enumerate(args.rust_engines):
        t = time.time()
        flags = ENGINE_MODES[mode][1] if mode != "device" else []
        r = subprocess.run(rust_argv(args) + flags, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            sys.exit("gpu_bench --threads failed (exit %d):\n%s%s" % (
                r.returncode, r.stdout[-3000:], r.stderr[-3000:]))
        got = [c for c in rust_cells(r.stdout, args.workloads)
               if n == 0 or c["path"] != "cuMemAllocAsync (Rust process)"]
        print("rust process (engines: %s): %d cells in %.0f s" % (mode, len(got),
                                                                time.time() - t), flush=True)
        cells += got
    return cells


def rust_kind(cell):
    """The path kind of a gpu_bench CELL: "ours" with one engine a device, "ours:MODE" for
    an --rust-engines mode, else gpu_bench's own kind."""
    kind = cell.pop("kind")
    engines, totals = cell.pop("engines", "device"), cell.pop("shared_totals", "none")
    if kind != "ours" or engines == "device":
        return kind
    return "ours:" + engines + ("" if totals == "none" else "+" + totals)


def rust_cells(stdout, workloads):
    """gpu_bench's CELL lines as cells of this script (path names, workload labels)."""
    names = {kind: name for name, proc, kind, _ in PATHS if proc == "rust"}
    names.update(("ours:" + m, name) for m, (name, _) in ENGINE_MODES.items())
    labels = {w["spec"]: w["label"] for w in workloads}
    cells = []
    for line in stdout.splitlines():
        if line.startswith("CELL "):
            c = json.loads(line[5:])
            c["path"] = names[rust_kind(c)]
            c["workload"] = labels[c.pop("spec")]
            c["process"] = "rust"
            cells.append(c)
    return cells


def null_driver_env(devices=1):
    """Builds the null driver (as its run.sh does) and returns an environment with it first
    on LD_LIBRARY_PATH, showing `devices` devices."""
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target"))
    drv = os.path.join(target, "null-driver")
    os.makedirs(drv, exist_ok=True)
    src = os.path.join(REPO, "crates", "alloc-cuda", "null-driver", "null_cuda.c")
    lib = os.path.join(drv, "libcuda.so.1")
    compile_so("cc", src, lib, ["-Wall"])
    link = os.path.join(drv, "libcuda.so")
    if not os.path.lexists(link):
        os.symlink("libcuda.so.1", link)
    env = dict(os.environ, NULL_CUDA_DEVICES=str(devices))
    env["LD_LIBRARY_PATH"] = drv + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


def compile_so(compiler, src, so, flags=(), libs=()):
    """Compiles one source file into the shared library `so` with -O2; returns its path."""
    subprocess.run([compiler, "-O2"] + list(flags) + ["-shared", "-fPIC", "-o", so, src]
                   + list(libs), check=True)
    return so


def build_cpu_loops(out_dir):
    """Compiles mt_cpu.cpp into out_dir; returns the library's path."""
    return compile_so("g++", os.path.join(HERE, "mt_cpu.cpp"),
                      os.path.join(out_dir, "libmt_cpu.so"), ["-std=c++17", "-pthread"], ["-ldl"])


def build_null_pluggable(out_dir, largest=0):
    """Compiles null_pluggable.c into out_dir, its block per device large enough for a
    request of `largest` bytes and at least 64 MiB; returns the library's path."""
    block = max(64 << 20, largest)
    return compile_so("cc", os.path.join(HERE, "null_pluggable.c"),
                      os.path.join(out_dir, "libnull_pluggable.so"),
                      ["-Wall", "-pthread", "-DNULL_PLUGGABLE_BLOCK=%dLL" % block], ["-ldl"])


def largest_request(workloads):
    """The largest allocation any of the workloads makes, in bytes."""
    return max(w["hi"] if w["mixed"] else w["size"] for w in workloads)


def cpu_child(args):
    """--child cpu: the C library and the null allocator through mt_cpu.cpp (the null driver
    is on LD_LIBRARY_PATH): prints RESULT <json>."""
    lib = ctypes.CDLL(args.cpu_loops)
    lib.mt_error.restype = ctypes.c_char_p
    lib.mt_clock_pair_ns.restype = ctypes.c_double
    lib.mt_cell.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_int64] * 4 + [
        ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_double,
        ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_double)]

    def ok(rc):
        if rc != 0:
            sys.exit("mt_cpu: " + lib.mt_error().decode())

    ok(lib.mt_load(os.path.abspath(args.so).encode(), b"gpualloc_malloc", b"gpualloc_free"))
    ndev = max(args.devices) if args.devices else 1
    ok(lib.mt_make_streams(ndev, 1 if args.devices else max(args.threads)))

    def timer(backend):
        def run(w, streams, devs):
            out = (ctypes.c_double * (8 + 2 * PHASES))()
            ok(lib.mt_cell(backend, int(w["mixed"]), w["size"], w["lo"], w["hi"], w["max_live"],
                           int(w["with_zero"]), len(devs), (ctypes.c_int * len(devs))(*devs),
                           int(streams == "shared"), args.window, warm_calls(w),
                           args.sample_every, out))
            keys = ["calls", "wall_ns", "p50_ns", "p99_ns", "p999_ns", "max_ns", "samples",
                    "failed_threads"]
            r = dict(zip(keys, out))
            for k in ("calls", "samples", "failed_threads"):
                r[k] = int(r[k])
            if w["with_zero"]:
                r["phase_p50_ns"] = list(out[8:8 + PHASES])
                r["phase_samples"] = [int(x) for x in out[8 + PHASES:8 + 2 * PHASES]]
            r["error"] = lib.mt_error().decode() if r["failed_threads"] else ""
            return r
        return run

    cells = run_cells(args, "cpu", {"so": timer(0), "null": timer(1)},
                      log=lambda m: print(m, file=sys.stderr))
    info = {"driver": "null driver (no device work)", "clock_pair_ns": lib.mt_clock_pair_ns()}
    print("RESULT " + json.dumps({"cells": cells, "info": info}), flush=True)


# ---------------------------------------------------------------- report

def rate(cell):
    """Calls (allocs + frees) per second of all threads of one cell."""
    return cell["calls"] / cell["wall_ns"] * 1e9 if cell["wall_ns"] > 0 else 0.0


def key(cell):
    """A cell's place in the plan: (workload, streams, threads, devices)."""
    return (cell["workload"], cell["streams"], cell["threads"], cell["devices"])


def summarize(cells):
    """(path, workload, streams, threads, devices) -> figures over the repeats: median and
    mean calls/s, median p50 / p99 ns, repeats, failed threads."""
    groups = {}
    for c in cells:
        groups.setdefault((c["path"],) + key(c), []).append(c)
    out = {}
    for k, cs in groups.items():
        rates = [rate(c) for c in cs]
        out[k] = {"median": statistics.median(rates), "mean": statistics.fmean(rates),
                  "p50_ns": statistics.median(c["p50_ns"] for c in cs),
                  "p99_ns": statistics.median(c["p99_ns"] for c in cs),
                  "repeats": len(cs), "failed": sum(c.get("failed_threads", 0) for c in cs)}
    return out


def ratio_to(cells, path, ref, k):
    """Throughput of `path` over `ref` for one cell key: (median, mean, same_process).
    Same process: the per-repeat ratios' median and mean; else the medians' ratio (twice)."""
    mine = {c["repeat"]: c for c in cells if c["path"] == path and key(c) == k}
    theirs = {c["repeat"]: c for c in cells if c["path"] == ref and key(c) == k}
    if not mine or not theirs:
        return None
    same = {c["process"] for c in mine.values()} == {c["process"] for c in theirs.values()}
    if same:
        rs = [rate(mine[r]) / rate(theirs[r]) for r in sorted(mine) if r in theirs
              and rate(theirs[r]) > 0]
        if rs:
            return statistics.median(rs), statistics.fmean(rs), True
    a = statistics.median(rate(c) for c in mine.values())
    b = statistics.median(rate(c) for c in theirs.values())
    return (a / b, a / b, False) if b > 0 else None


def fmt_ratio(r):
    """A ratio_to() result as two table cells, median and mean (* across processes)."""
    if r is None:
        return "n/a", "n/a"
    mark = "" if r[2] else "*"
    return "%.2f%s" % (r[0], mark), "%.2f%s" % (r[1], mark)


def path_table(cells, summary, path, ref, devices_mode):
    """One path's table: a row per workload, streams and thread (or device) count."""
    scale_col = "vs 1 device" if devices_mode else "vs 1 thread"
    count_col = "devices" if devices_mode else "threads"
    ref_cols = ["vs %s (median)" % ref, "(mean)"] if ref else []
    head = ["workload", "streams", count_col, "M calls/s (median)", "(mean)", "p50 ns", "p99 ns"]
    head += ref_cols + [scale_col]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    keys = sorted((k for k in summary if k[0] == path), key=lambda k: (
        order_of(cells, k[1]), k[2], k[4] if devices_mode else k[3]))
    for k in keys:
        s = summary[k]
        base = summary.get((path, k[1], k[2], 1, 1))
        count = k[4] if devices_mode else k[3]
        row = [k[1], k[2], str(count), "%.2f" % (s["median"] / 1e6), "%.2f" % (s["mean"] / 1e6),
               "%.0f" % s["p50_ns"], "%.0f" % s["p99_ns"]]
        if ref:
            row += list(fmt_ratio(ratio_to(cells, path, ref, k[1:])))
        row.append("%.2f" % (s["median"] / base["median"]) if base and base["median"] else "n/a")
        if s["failed"]:
            row[0] += " (%d failed threads)" % s["failed"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def order_of(cells, workload):
    """Workloads in the order the run met them."""
    seen = list(dict.fromkeys(c["workload"] for c in cells))
    return seen.index(workload) if workload in seen else len(seen)


def targets(cells, summary, paths):
    """The issue's targets, each as a line: measured figure and whether it holds."""
    lines = []
    names = {p[0] for p in paths}
    for ours in ("gpualloc C library", "gpualloc CudaAllocator (Rust)"):
        if ours not in names or TORCH_RAW not in names:
            continue
        for k in sorted({k[1:] for k in summary if k[0] == ours and k[4] == 1},
                        key=lambda k: (order_of(cells, k[0]), k[1], k[2])):
            r = ratio_to(cells, ours, TORCH_RAW, k)
            if r is None:
                continue
            need = 4.0 if k[2] == 8 else 1.0
            lines.append("%s / %s, %s, %s streams, %d threads: %.2f%s (target >= %.0f: %s)" % (
                ours, TORCH_RAW, k[0], k[1], k[2], r[0], "" if r[2] else "*", need,
                "met" if r[0] >= need else "NOT met"))
    zero = zero_pair_workloads(cells)
    for ours, ref in ((BRIDGE_EMPTY, AT_EMPTY), (PLUGGABLE_EMPTY, AT_EMPTY),
                      ("torch.empty (Python) via bridge", PY_EMPTY)):
        if ours not in names or ref not in names:
            continue
        for k in sorted({k[1:] for k in summary if k[0] == ours and k[1] not in zero},
                        key=lambda k: (order_of(cells, k[0]), k[1], k[2], k[3])):
            r = ratio_to(cells, ours, ref, k)
            if r is not None:
                lines.append("%s / %s, %s, %s streams, %d threads, %d devices: %.2f%s "
                             "(target >= 2, per-op cost at most half: %s)" % (
                                 ours, ref, k[0], k[1], k[2], k[3], r[0], "" if r[2] else "*",
                                 "met" if r[0] >= 2 else "NOT met"))
    shares = call_shares(cells)
    per_round = round_ratios(cells)
    for k in sorted({k[1:] for k in shares if k[0] == BRIDGE_EMPTY},
                    key=lambda k: (order_of(cells, k[0]), k[1], k[2], k[3])):
        both = bridge_over_pytorch(shares, k)
        if both is None:
            continue
        ours, theirs, r = both
        line = ("the allocator's share of an at::empty call, bridge / PyTorch's, %s, %s "
                "streams, %d threads, %d devices: %.0f / %.0f ns = %s (target <= 0.5: %s)" % (
                    k[0], k[1], k[2], k[3], ours, theirs, "n/a" if r is None else "%.2f" % r,
                    "met" if r is not None and r <= 0.5 else "NOT met"))
        got = per_round.get(k, [])
        v = rounds_verdict(got)
        if v is not None:
            line += "; per process round %s over %d process rounds: %s" % (v[0], len(got), v[1])
        lines.append(line)
    return lines


def zero_pair_workloads(cells):
    """The workload labels of pair0 cells (their throughput mixes two sizes)."""
    return {c["workload"] for c in cells if "phase_p50_ns" in c}


def call_shares(cells):
    """(path, workload, streams, threads, devices) of each pair0 cell -> the median over
    the repeats of each phase's median ns ("phases": alloc, free, alloc of 0 bytes, free of
    0 bytes), the path's ns a call ("call": the mean of its alloc and free) and the
    allocator's share of it ("share": the call less the zero-byte call of the same loop;
    None where a phase had no sample)."""
    groups = {}
    for c in cells:
        if "phase_p50_ns" in c:
            groups.setdefault((c["path"],) + key(c), []).append(c)
    out = {}
    for k, cs in groups.items():
        phases = []
        for i in range(PHASES):
            got = [c["phase_p50_ns"][i] for c in cs if c["phase_samples"][i] > 0]
            phases.append(statistics.median(got) if got else None)
        whole = None if None in phases else (phases[0] + phases[1]) / 2
        out[k] = {"phases": phases, "call": whole,
                  "share": None if whole is None else whole - (phases[2] + phases[3]) / 2}
    return out


def share_ratio(ours, theirs):
    """Our share over theirs, None when theirs is not above 0 (nothing to compare with)."""
    return ours / theirs if theirs > 0 else None


def bridge_over_pytorch(shares, k):
    """For cell key k of call_shares: (the bridge's share, PyTorch's, share_ratio of the
    two), or None unless both paths have a share there."""
    a, b = shares.get((BRIDGE_EMPTY,) + k), shares.get((AT_EMPTY,) + k)
    if not a or not b or a["share"] is None or b["share"] is None:
        return None
    return a["share"], b["share"], share_ratio(a["share"], b["share"])


# The share section's paths and column names: PyTorch's at::empty, the bridge's, and over
# the null driver the null allocator (whose share is the loop's noise).
SHARE_PATHS = ((AT_EMPTY, "PyTorch"), (BRIDGE_EMPTY, "bridge"), ("null (loop cost)", "null"))
SHARE_NOTE = (
    "ns: the median over the repeats of each call's median latency (the sampled calls), "
    "the alloc and the free of one pair averaged; share: that less the same for the 0-byte "
    "pairs run in turn in the same loop, the part of a call that is its allocator's (a 0-byte "
    "at::empty takes the path's every step but the allocator's). Each path's share comes "
    "from its own loop, so process drift moves the share only as much as it moves the "
    "allocator; the two at::empty paths still ran in two processes.")


def process_rounds(cells):
    """The --process-rounds numbers the pair0 cells ran in, ascending (1 without any)."""
    return sorted({c.get("process_round", 1) for c in cells if "phase_p50_ns" in c})


def round_ratios(cells):
    """With several process rounds: cell key -> the bridge's share over PyTorch's in each
    round both had one (each round's shares from its own processes, which ran next to
    each other); {} with one round. A round whose ratio is not above 0 (the bridge's share
    lost in the loop's noise) is left out: the interval is taken on logarithms."""
    rounds = process_rounds(cells)
    if len(rounds) < 2:
        return {}
    out = {}
    for r in rounds:
        shares = call_shares([c for c in cells if c.get("process_round", 1) == r])
        for k in {k[1:] for k in shares if k[0] == BRIDGE_EMPTY}:
            both = bridge_over_pytorch(shares, k)
            if both is not None and both[2] is not None and both[2] > 0:
                out.setdefault(k, []).append(both[2])
    return out


def rounds_verdict(ratios, target=0.5):
    """The rounds' ratios' geometric mean and its 95% t interval (as
    compare_workloads.ratio_interval takes it) as text, and whether that interval lies at
    or below `target` (met), above it (NOT met) or across it (undecided); None under two
    rounds."""
    interval = cw.ratio_interval(ratios)
    if interval is None:
        return None
    mean, low, high = interval
    verdict = "met" if high <= target else "NOT met" if low > target else "undecided"
    return "%.2f (%.2f-%.2f)" % (mean, low, high), verdict


def share_table(cells):
    """The allocator's share of a call on each pair0 path, a row per cell key, with the
    bridge's over PyTorch's ("" without pair0 cells)."""
    shares = call_shares(cells)
    if not shares:
        return ""
    present = [(p, n) for p, n in SHARE_PATHS if any(k[0] == p for k in shares)]
    keys = sorted({k[1:] for k in shares},
                  key=lambda k: (order_of(cells, k[0]), k[1], k[3], k[2]))
    head = ["workload", "streams", "threads", "devices"]
    for _, n in present:
        head += ["%s ns" % n, "%s share ns" % n]
    both = {AT_EMPTY, BRIDGE_EMPTY} <= {p for p, _ in present}
    per_round = round_ratios(cells) if both else {}
    if both:
        head.append("bridge share / PyTorch's")
    if per_round:
        head += ["per process round", "geometric mean (95%)"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]

    def fmt(ns):
        return "n/a" if ns is None else "%.0f" % ns

    for k in keys:
        row = [k[0], k[1], str(k[2]), str(k[3])]
        for p, _ in present:
            got = shares.get((p,) + k, {})
            row += [fmt(got.get("call")), fmt(got.get("share"))]
        if both:
            r = (bridge_over_pytorch(shares, k) or (None, None, None))[2]
            row.append("n/a" if r is None else "%.2f" % r)
        if per_round:
            got = per_round.get(k, [])
            row.append(" / ".join("%.2f" % x for x in got) or "n/a")
            v = rounds_verdict(got)
            row.append("n/a" if v is None else v[0])
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# The floor section's paths after the floor itself: (path, column name).
FLOOR_PATHS = ((AT_EMPTY, "PyTorch"), (BRIDGE_EMPTY, "bridge"),
               (PLUGGABLE_EMPTY, "pluggable gpualloc"))
FLOOR_NOTE = (
    "ns: the time a thread spends per call, threads x 1e9 / the median over the repeats of "
    "all threads' calls per second (one thread: the cost of one call; more: waiting on each "
    "other included). floor: at::empty through PyTorch's CUDAPluggableAllocator over an "
    "allocator doing nothing (null_pluggable.c). share: path ns - floor ns, the part of the "
    "path that is its allocator's. (a) The floor includes the pluggable wrapper's own work (a "
    "deleter context per tensor, a mutex and a map of pointers on each malloc), which "
    "PyTorch's own allocator and the bridge do not pay: their share is a lower bound of "
    "their allocator's cost, short by the wrapper's. The pluggable gpualloc path goes through "
    "the same wrapper as the floor: its share is gpualloc's own. The four paths ran in four "
    "processes: read the cudaMallocAsync anchors for drift between them.")


def per_call_ns(s, threads):
    """A summary entry as ns a thread spends per call (None without one)."""
    return threads * 1e9 / s["median"] if s and s["median"] > 0 else None


def floor_table(cells, summary, devices_mode):
    """The at::empty path's floor and each allocator's share above it, a row per cell key of
    the floor path ("" when the run has no floor)."""
    keys = sorted({k[1:] for k in summary if k[0] == FLOOR},
                  key=lambda k: (order_of(cells, k[0]), k[1], k[3] if devices_mode else k[2]))
    if not keys:
        return ""
    names = [n for _, n in FLOOR_PATHS]
    head = (["workload", "streams", "devices" if devices_mode else "threads"]
            + ["%s ns" % names[0], "floor ns"] + ["%s ns" % n for n in names[1:]]
            + ["%s's share ns%s" % (n, "" if p == PLUGGABLE_EMPTY else " (a)")
               for p, n in FLOOR_PATHS])
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]

    def fmt(ns):
        return "n/a" if ns is None else "%.0f" % ns

    for k in keys:
        floor = per_call_ns(summary[(FLOOR,) + k], k[2])
        ns = [per_call_ns(summary.get((p,) + k), k[2]) for p, _ in FLOOR_PATHS]
        row = [k[0], k[1], str(k[3] if devices_mode else k[2]), fmt(ns[0]), fmt(floor)]
        row += [fmt(n) for n in ns[1:]]
        row += [fmt(None if n is None or floor is None else n - floor) for n in ns]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def device_scaling(summary):
    """With one thread per device: each path's throughput on n devices over 1 device."""
    lines = []
    for k, s in sorted(summary.items()):
        path, workload, streams, threads, devices = k
        base = summary.get((path, workload, streams, 1, 1))
        if devices > 1 and threads == devices and base and base["median"] > 0:
            lines.append("%s, %s: %d devices %.2fx one device's throughput (ideal %d)" % (
                path, workload, devices, s["median"] / base["median"], devices))
    return lines


def report(cells, paths, devices_mode, info):
    """The whole report: a header, one table per path, the floor, the targets."""
    summary = summarize(cells)
    out = ["Aggregate calls per second (an alloc or a free is one call) of all threads, and "
           "the latency of one call (every Nth call timed), over the repeats. Ratios: "
           "throughput over the reference's; * = the two ran in different processes "
           "(ratio of medians)."]
    if info:
        out.append("Run: " + ", ".join("%s %s" % (k, v) for k, v in sorted(info.items())))
    for name, process, _, ref in paths:
        if any(k[0] == name for k in summary):
            out += ["", "### %s (%s process)" % (name, process), "",
                    path_table(cells, summary, name, ref, devices_mode)]
    f = floor_table(cells, summary, devices_mode)
    if f:
        out += ["", "### The floor of the at::empty path", "", f, "", FLOOR_NOTE]
    z = share_table(cells)
    if z:
        out += ["", "### The allocator's share of a call, against 0-byte pairs in the same loop",
                "", z, "", SHARE_NOTE]
    t = targets(cells, summary, paths)
    if t:
        out += ["", "### Targets (issue 37)", ""] + ["- " + line for line in t]
    d = device_scaling(summary) if devices_mode else []
    if d:
        out += ["", "### Scaling with one thread per device", ""] + ["- " + line for line in d]
    return "\n".join(out)


# ---------------------------------------------------------------- main

def parse_args(argv=None):
    """The command line, with workloads parsed and the library and gpu_bench found."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--so", default=None, help="liballoc_ffi.so (default: prepare.sh's, "
                    "else $GPUALLOC_SO, else target/release)")
    ap.add_argument("--gpu-bench", default=None, help="gpu_bench (default: beside --so)")
    ap.add_argument("--config", default=None, help="GPUALLOC_CONF of every gpualloc path")
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--streams", default="own,shared",
                    help="own: each thread its own stream; shared: all on one")
    ap.add_argument("--devices", default=None,
                    help="one thread per device instead: device counts, e.g. 1,2,4")
    ap.add_argument("--workloads", default="pair:512,pair:8M,mixed:512:1M:1000")
    ap.add_argument("--window", type=float, default=0.08, help="seconds per cell")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sample-every", type=int, default=31, help="time every Nth call")
    ap.add_argument("--unbound-threads", action="store_true",
                    help="the C++ threads of the GPU processes do not make their device's "
                         "primary context current (cudaSetDevice) before their loop: "
                         "PyTorch's path then finds no current context on every runtime call, "
                         "each a driver lock (the cells of 2026-11-30 and before)")
    ap.add_argument("--no-python", action="store_true", help="leave out the Python threads")
    ap.add_argument("--no-rust", action="store_true", help="leave out gpu_bench --threads")
    ap.add_argument("--rust-engines", default="device",
                    help="gpu_bench's engine layouts, a comma list of device (one engine a "
                    "device, as the library has), %s" % ", ".join(ENGINE_MODES))
    ap.add_argument("--no-bridge", action="store_true",
                    help="leave out the bridge process (at::empty, raw_alloc and torch.empty "
                    "through gpu_alloc's C++ bridge)")
    ap.add_argument("--no-pluggable", action="store_true",
                    help="leave out at::empty through PyTorch's pluggable allocator (null and "
                    "gpualloc)")
    ap.add_argument("--null-driver", action="store_true",
                    help="no GPU: C library and Rust paths over the null driver")
    ap.add_argument("--path-per-process", action="store_true",
                    help="each of PyTorch's C++ paths (raw_alloc, at::empty) in a process of "
                    "its own, the other paths of its process in another")
    ap.add_argument("--process-rounds", type=int, default=1, metavar="N",
                    help="run the GPU processes N times, rotated: the share table then gives "
                    "the bridge's share over PyTorch's per round and their interval")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--child", choices=("native", "bridge", "cpu") + tuple(PLUGGABLE),
                    help=argparse.SUPPRESS)
    ap.add_argument("--cpu-loops", help=argparse.SUPPRESS)
    ap.add_argument("--null-pluggable", help=argparse.SUPPRESS)
    ap.add_argument("--kinds", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.kinds = args.kinds.split(",") if args.kinds else None
    args.threads = [int(t) for t in args.threads.split(",")]
    args.streams = args.streams.split(",")
    if any(s not in ("own", "shared") for s in args.streams):
        ap.error("--streams takes own and/or shared")
    args.devices = [int(d) for d in args.devices.split(",")] if args.devices else None
    args.workloads = [parse_workload(w) for w in args.workloads.split(",")]
    args.rust_engines = args.rust_engines.split(",")
    if any(m != "device" and m not in ENGINE_MODES for m in args.rust_engines):
        ap.error("--rust-engines takes device, %s" % ", ".join(ENGINE_MODES))
    if engine_per_stream(args.config):
        # the layout the C library runs under the setting, in place of one engine a device
        if any(m.startswith("thread") for m in args.rust_engines):
            ap.error("--config engine_per_stream:True runs an engine per stream; the thread "
                     "layouts build one CudaAllocator each, which refuses it")
        args.rust_engines = list(dict.fromkeys(
            "stream" if m == "device" else m for m in args.rust_engines))
    if args.process_rounds < 1:
        ap.error("--process-rounds is at least 1")
    if args.sample_every < 1 or args.repeats < 1 or args.window <= 0:
        ap.error("--sample-every and --repeats are at least 1, --window above 0")
    if any(w["with_zero"] for w in args.workloads) and args.sample_every % 2 == 0:
        ap.error("a pair0 workload needs an odd --sample-every: its four calls (alloc and "
                 "free of each size) are then sampled in turn")
    if args.so is None:
        args.so = first_file([os.path.join(BUNDLE, "liballoc_ffi.so"),
                              os.environ.get("GPUALLOC_SO"),
                              os.path.join(REPO, "target", "release", "liballoc_ffi.so")])
    if args.so is None:
        ap.error("no liballoc_ffi.so: run prepare.sh or give --so")
    if args.gpu_bench is None:
        args.gpu_bench = os.path.join(os.path.dirname(os.path.abspath(args.so)), "gpu_bench")
    return args


def first_file(candidates):
    """The first of candidates that is a file, else None."""
    return next((c for c in candidates if c and os.path.isfile(c)), None)


def main(argv=None):
    """Runs the processes of the plan, prints the report and writes the JSON; 0 when done."""
    args = parse_args(argv)
    if args.child == "cpu":
        return cpu_child(args)
    if args.child:
        return child(args)
    if args.config is not None:
        os.environ["GPUALLOC_CONF"] = args.config  # the C library's, in every process
    t0 = time.time()
    info, cells = {}, []
    paths = active_paths(args)
    if args.null_driver:
        import tempfile

        env = null_driver_env(max(args.devices) if args.devices else 1)
        with tempfile.TemporaryDirectory() as tmp:
            loops = build_cpu_loops(tmp)
            got = run_child(args, "cpu", env, ["--cpu-loops", loops])
        cells += got["cells"]
        info.update(got["info"])
    else:
        prebuild()
        os.makedirs(args.out, exist_ok=True)
        null_so = None
        if "pluggable-null" in processes(args):
            null_so = build_null_pluggable(args.out, largest_request(args.workloads))
        for rnd in range(1, args.process_rounds + 1):
            # each round its processes rotated, so that following another falls on each
            for which in rotate(processes(args), rnd - 1):
                for kinds in child_runs(args, which):
                    extra = ["--null-pluggable", null_so] if which == "pluggable-null" else []
                    if kinds is not None:
                        extra += ["--kinds", ",".join(kinds)]
                    got = run_child(args, which, extra=extra)
                    for c in got["cells"]:
                        c["process_round"] = rnd
                    cells += got["cells"]
                    info.update(got["info"])
                    # what is measured so far survives a run stopped before its end
                    save(args, argv, {"info": info, "cells": cells, "partial": True}, t0)
        env = None
    if not args.no_rust and rust_workloads(args):
        if os.path.isfile(args.gpu_bench):
            cells += run_rust(args, env)
        else:
            print("gpu_bench --threads left out: no %s (prepare.sh builds it)" % args.gpu_bench)
    text = report(cells, paths, bool(args.devices), info)
    print("\n" + text)
    where = save(args, argv, {"info": info, "cells": cells, "report": text}, t0)
    print("\n%s written (%.0f s in all)" % (where, time.time() - t0))
    return 0


def save(args, argv, doc, t0):
    """Writes the run's JSON (doc, with the command line and the seconds so far) under
    --out; returns its path."""
    name = "host_threads_devices.json" if args.devices else "host_threads.json"
    os.makedirs(args.out, exist_ok=True)
    where = os.path.join(args.out, name)
    doc = dict(doc, argv=sys.argv[1:] if argv is None else argv,
               seconds=round(time.time() - t0, 1))
    with open(where, "w") as f:
        json.dump(doc, f, indent=1)
    return where


def prebuild():
    """Compiles the loops' extension and gpu_alloc's bridge at once (two processes), before
    anything is timed: the children then load both from torch's extension cache."""
    t = time.time()
    jobs = [subprocess.Popen([sys.executable, "-c", "import sys; sys.path.insert(0, %r); "
                              "import host_threads; host_threads.build_ext()" % HERE]),
            subprocess.Popen([sys.executable, "-c", "import sys; sys.path.insert(0, %r); "
                              "import gpu_alloc; gpu_alloc.build_bridge()"
                              % os.path.join(REPO, "python")])]
    if any([j.wait() != 0 for j in jobs]):  # waits for both
        sys.exit("building the loops' extension or the bridge failed")
    print("extension and bridge built in %.0f s" % (time.time() - t), flush=True)


if __name__ == "__main__":
    sys.exit(main())
