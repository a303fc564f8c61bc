"""Pause and resume of a sleep tag: time per GiB with backup "none" and "host", against the
machine's pinned copy bandwidth measured in the same run, and the memory given back and taken
again as cuMemGetInfo sees it. For gpualloc (gpu_alloc.region / pause / resume through the C++
bridge) and, when importable, torch_memory_saver (its region / pause / resume, hook_mode
"torch"; "tms_retain" with its retain_cpu_backup, host backup only), each case in a process of
its own (an allocator is chosen once per process).

    GPUALLOC_SO=gpu-bundle/lib/liballoc_ffi.so python3 benchmarks/sleep_wake/pause_resume.py \\
        [--sizes-gib 1,4,16] [--cycles 5] [--impls gpualloc,tms,tms_retain] [--tms-path DIR] \\
        [--out FILE]

Each case allocates SIZE GiB in one tag as tensors of 256 MiB and 1 MiB + 4 KiB (a KV cache
and weights of assorted sizes), fills them, then pauses and resumes CYCLES times, timing each
call after a device synchronize (both implementations return with the copies done). With host
backup it checks the contents after each resume. Plain pinned copies of the same size
(cudaMemcpyAsync device to host and back, timed with events) give the bound for the host-backed
calls. Prints one JSON object per case, then {"summary": [...]} with medians: seconds per GiB,
GiB/s, and the ratio to the pinned copy bandwidth.
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
sys.path.insert(0, os.path.join(REPO, "python"))

GIB = 1 << 30
MIB = 1 << 20
BIG = 256 * MIB
SMALL = MIB + 4096


def layout(size):
    """Tensor sizes (bytes) that add up to about `size`: 256 MiB blocks, and a tenth of the
    total in odd 1 MiB + 4 KiB ones."""
    small_total = size // 10
    n_small = max(1, small_total // SMALL)
    n_big = max(1, (size - n_small * SMALL) // BIG)
    return [BIG] * n_big + [SMALL] * n_small


def pinned_bandwidth(torch, size, repeat=3):
    """GiB/s of a device-to-host and a host-to-device copy of `size` bytes through pinned
    memory (best of `repeat`, timed with CUDA events)."""
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        best = None
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            s = start.elapsed_time(end) / 1e3
            best = s if best is None else min(best, s)
        out[name + "_gib_per_s"] = size / GIB / best
    del dev, host
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch._C._host_emptyCache()  # PyTorch's pinned cache: the copies' host buffer
    return out


class Gpualloc:
    """gpualloc's sleep tags through the bridge."""

    name = "gpualloc"

    def __init__(self, backup):
        import gpu_alloc

        gpu_alloc.enable(os.environ.get("SLEEP_BENCH_CONF", ""), bridge=True)
        self.g = gpu_alloc
        self.backup = backup

    def region(self):
        return self.g.region("bench", enable_cpu_backup=self.backup == "host")

    def pause(self):
        self.g.pause("bench")

    def resume(self):
        self.g.resume("bench")

    def details(self):
        t = [t for t in self.g.tags() if t["name"] == "bench"][0]
        return {"tag": t, "pinned_pool": self.g.host_stats()}

    def leave(self):
        """The process ends normally."""


class TorchMemorySaver:
    """torch_memory_saver, hook_mode "torch": its region() routes allocations to a MemPool of
    its own whose CUDAPluggableAllocator maps each segment with cuMemCreate + cuMemMap; pause and
    resume are the same C++ calls (TorchMemorySaver::pause / resume) as in hook_mode "preload",
    which instead needs LD_PRELOAD set before the process starts (and, in 0.0.10, the directory
    of pip's libcudart.so.13 on LD_LIBRARY_PATH: its hook library has no RUNPATH)."""

    name = "tms"

    def __init__(self, backup, retain_cpu_backup=False):
        from torch_memory_saver import torch_memory_saver

        torch_memory_saver.hook_mode = "torch"  # before the first region: it builds the hook
        if retain_cpu_backup:
            # The host copies outlive resume and serve the next pause, instead of a
            # cudaMallocHost per allocation at every pause and a cudaFreeHost at every resume.
            torch_memory_saver.retain_cpu_backup = True
        self.t = torch_memory_saver
        self.backup = backup
        self.retain_cpu_backup = retain_cpu_backup

    def region(self):
        return self.t.region(tag="bench", enable_cpu_backup=self.backup == "host")

    def pause(self):
        self.t.pause("bench")

    def resume(self):
        self.t.resume("bench")

    def details(self):
        from importlib.metadata import version

        return {"version": version("torch_memory_saver"), "hook_mode": "torch",
                "retain_cpu_backup": self.retain_cpu_backup}

    def leave(self):
        """Ends the process without tearing the interpreter down. The region's MemPool lives in
        torch_memory_saver's singleton until then, and its destructor gives the pool's segments
        back through tms_torch_free outside any region, which torch_memory_saver refuses with
        exit(1) ("only support interesting region", csrc/entrypoint.cpp), after the result was
        printed; its own tests judge hook_mode "torch" runs by their result, not the exit
        status, for that reason."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


IMPLS = {
    "gpualloc": Gpualloc,
    "tms": TorchMemorySaver,
    "tms_retain": lambda backup: TorchMemorySaver(backup, retain_cpu_backup=True),
}
# Implementations that only differ from another one with a host backup.
HOST_BACKUP_ONLY = {"tms_retain"}


def cases(impls, backups, sizes_gib):
    """The (implementation, backup, GiB) cases of a run, in order; an unknown implementation
    is an error, and a host-backup-only one skips the other backups."""
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        raise ValueError("unknown implementation %s (known: %s)"
                         % (", ".join(unknown), ", ".join(IMPLS)))
    return [(impl, backup, gib) for impl in impls for backup in backups for gib in sizes_gib
            if backup == "host" or impl not in HOST_BACKUP_ONLY]


def child(impl_name, backup, size_gib, cycles):
    impl = IMPLS[impl_name](backup)
    import torch

    size = int(size_gib * GIB)
    sizes = layout(size)
    total = sum(sizes)
    bandwidth = pinned_bandwidth(torch, total)
    with impl.region():
        tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    for i, t in enumerate(tensors):
        t.fill_(i % 251 + 1)
    checksum = [int(t[:: 4096].sum().item()) for t in tensors] if backup == "host" else None
    torch.cuda.synchronize()
    free0, total_mem = torch.cuda.mem_get_info()
    pauses, resumes, given, taken = [], [], [], []
    for _ in range(cycles):
        torch.cuda.synchronize()
        before, _ = torch.cuda.mem_get_info()
        t0 = time.perf_counter()
        impl.pause()
        t1 = time.perf_counter()
        paused, _ = torch.cuda.mem_get_info()
        impl.resume()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        after, _ = torch.cuda.mem_get_info()
        pauses.append(t1 - t0)
        resumes.append(t2 - t1)
        given.append(paused - before)
        taken.append(paused - after)
        if checksum is not None:
            got = [int(t[:: 4096].sum().item()) for t in tensors]
            if got != checksum:
                raise AssertionError("contents differ after resume (%s backup)" % backup)
        else:
            for i, t in enumerate(tensors):  # "none": the user writes them again
                t.fill_(i % 251 + 1)
    result = {
        "impl": impl_name,
        "backup": backup,
        "bytes": total,
        "tensors": len(tensors),
        "cycles": cycles,
        "device_total_bytes": total_mem,
        "pause_s": pauses,
        "resume_s": resumes,
        "given_back_bytes": given,
        "taken_again_bytes": taken,
        "contents_checked": checksum is not None,
        "pinned_copy": bandwidth,
    }
    result.update(impl.details())
    print("RESULT " + json.dumps(result), flush=True)
    impl.leave()


def summarize(r):
    gib = r["bytes"] / GIB
    pause, resume = statistics.median(r["pause_s"]), statistics.median(r["resume_s"])
    s = {
        "impl": r["impl"],
        "backup": r["backup"],
        "gib": round(gib, 3),
        "pause_s_per_gib": pause / gib,
        "resume_s_per_gib": resume / gib,
        "pause_gib_per_s": gib / pause,
        "resume_gib_per_s": gib / resume,
        "given_back_gib": statistics.median(r["given_back_bytes"]) / GIB,
        "taken_again_gib": statistics.median(r["taken_again_bytes"]) / GIB,
        "pinned_d2h_gib_per_s": r["pinned_copy"]["d2h_gib_per_s"],
        "pinned_h2d_gib_per_s": r["pinned_copy"]["h2d_gib_per_s"],
    }
    if r["backup"] == "host":
        # 1.0: as fast as a plain pinned copy of the same bytes.
        s["pause_vs_pinned_d2h"] = s["pause_gib_per_s"] / s["pinned_d2h_gib_per_s"]
        s["resume_vs_pinned_h2d"] = s["resume_gib_per_s"] / s["pinned_h2d_gib_per_s"]
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-gib", default="1,4,16")
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--impls", default="gpualloc,tms",
                    help="from %s" % ",".join(IMPLS))
    ap.add_argument("--backups", default="none,host")
    ap.add_argument("--tms-path", default=os.path.join(HERE, "site"),
                    help="a folder with torch_memory_saver installed (pip install --target)")
    ap.add_argument("--out", help="also write the results as JSON here")
    ap.add_argument("--child", nargs=4, metavar=("IMPL", "BACKUP", "GIB", "CYCLES"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        impl, backup, gib, cycles = args.child
        return child(impl, backup, float(gib), int(cycles))
    env = dict(os.environ)
    if os.path.isdir(args.tms_path):
        env["PYTHONPATH"] = args.tms_path + os.pathsep + env.get("PYTHONPATH", "")
    try:
        todo = cases(args.impls.split(","), args.backups.split(","), args.sizes_gib.split(","))
    except ValueError as e:
        ap.error(str(e))
    results, summary = [], []
    for impl, backup, gib in todo:
        cmd = [sys.executable, __file__, "--child", impl, backup, gib, str(args.cycles)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
        lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
        res = json.loads(lines[-1][len("RESULT "):]) if lines else None
        if r.returncode != 0 or res is None:
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            # A failure after the result (in the process's teardown) still fails the case.
            when = " after its result" if res is not None else ""
            out = {"impl": impl, "backup": backup, "gib": float(gib),
                   "failed": "exit %d%s: %s" % (r.returncode, when, " | ".join(tail))}
            print(json.dumps(out), flush=True)
            results.append(out)
            continue
        print(json.dumps(res), flush=True)
        results.append(res)
        summary.append(summarize(res))
    print(json.dumps({"summary": summary}, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"results": results, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
