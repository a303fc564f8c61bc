"""Cache lines per call of the C library: how many 64-byte lines one gpualloc_malloc or
gpualloc_free touches and writes, and how many lines one call writes that the next call
touches. With several threads on one device, calls run one at a time under the engine's
lock, and a line written by one thread's call moves to the core of the thread whose call
comes next, so that last figure is what a call pays in line moves when threads alternate
(docs/architecture.md, "Threads"). Deterministic, like an instruction count: one thread
under valgrind's lackey over the null driver, no timing.

    python3 benchmarks/host_cost/cache_lines.py [--so PATH] [--calls N] [--who]

Needs valgrind and a C compiler; builds the null driver (crates/alloc-cuda/null-driver)
and `cache_lines.c` in a temporary folder. `--who` adds, for each line most calls write,
the functions (file:line) of the library that write it. The stack is left out (private to
a thread); the library's heap and statics are counted wherever they are.
"""
import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
LINE = 64
# Under valgrind the client's stacks lie at and above this address; heap, statics and
# libraries below it.
STACKS_FROM = 0x1000000000
WORKLOADS = {"pair": "512 B alloc+free pairs", "mixed": "mixed 512 B..1 MiB, 1000 live"}


def parse_trace(lines, sep, exclude=()):
    """Cuts a lackey --trace-mem log into one segment per call (a store to `sep` begins
    one). Returns a list of (touched, written, writers): the sets of line numbers the call
    loaded or stored, of those it stored, and per stored line the instruction addresses
    that stored to it. Addresses in the `exclude` ranges ((start, end) pairs: the
    measuring program's own data) and on the stacks are left out."""
    sep_line = sep // LINE
    segments, cur, ip = [], None, 0
    for line in lines:
        if line.startswith("I "):
            ip = int(line[3:].split(",", 1)[0], 16)
            continue
        if len(line) < 4 or line[0] != " " or line[1] not in "LSM":
            continue
        addr = int(line[3:].split(",", 1)[0], 16)
        ln, store = addr // LINE, line[1] in "SM"
        if ln == sep_line:
            if store:
                cur = (set(), set(), collections.defaultdict(set))
                segments.append(cur)
            continue
        if cur is None or addr >= STACKS_FROM or any(a <= addr < b for a, b in exclude):
            continue
        cur[0].add(ln)
        if store:
            cur[1].add(ln)
            cur[2][ln].add(ip)
    return segments


def summarize(calls):
    """Means over the calls: lines touched, lines written, and lines written by one call
    and touched by the next."""
    if len(calls) < 2:
        raise ValueError("need at least two calls, got %d" % len(calls))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "calls": len(calls),
        "touched": mean([len(t) for t, _, _ in calls]),
        "written": mean([len(w) for _, w, _ in calls]),
        "moved_between_calls": mean([len(calls[k][1] & calls[k + 1][0])
                                     for k in range(len(calls) - 1)]),
    }


def hot_lines(calls, share=0.5):
    """The lines written by at least `share` of the calls, most written first, each with
    its writers' instruction addresses by count."""
    count, writers = collections.Counter(), collections.defaultdict(collections.Counter)
    for _, written, by in calls:
        for ln in written:
            count[ln] += 1
            writers[ln].update(by[ln])
    return [(ln, c, writers[ln]) for ln, c in count.most_common() if c >= share * len(calls)]


def mappings(maps, path):
    """(start, end, file offset) of each of `path`'s mappings in /proc/self/maps lines."""
    name = os.path.realpath(path)
    for line in maps:
        f = line.split()
        if len(f) >= 6 and os.path.realpath(f[5]) == name:
            start, end = (int(x, 16) for x in f[0].split("-"))
            yield start, end, int(f[2], 16)


def library_base(maps, so):
    """The address the library's first mapping (file offset 0) was loaded at."""
    return next((start for start, _, offset in mappings(maps, so) if offset == 0), None)


def mapped_ranges(maps, path):
    """The (start, end) address ranges of `path`'s mappings."""
    return [(start, end) for start, end, _ in mappings(maps, path)]


def symbol(so, base, ip):
    if base is None or ip < base:
        return "(outside the library)"
    out = subprocess.run(["addr2line", "-f", "-C", "-i", "-e", so, hex(ip - base)],
                         capture_output=True, text=True).stdout.splitlines()
    frames = ["%s@%s" % (out[k].split("::")[-1][:40], os.path.basename(out[k + 1]))
              for k in range(0, len(out) - 1, 2)]
    return " <- ".join(frames[:3]) or hex(ip)


def build(tmp):
    drv = os.path.join(tmp, "driver")
    os.makedirs(drv)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", os.path.join(drv, "libcuda.so.1"),
                    os.path.join(REPO, "crates/alloc-cuda/null-driver/null_cuda.c")], check=True)
    exe = os.path.join(tmp, "cache_lines")
    subprocess.run(["cc", "-O2", "-o", exe, os.path.join(HERE, "cache_lines.c"), "-ldl"],
                   check=True)
    return drv, exe


def measure(exe, drv, so, workload, warm, calls, tmp):
    log = os.path.join(tmp, workload + ".lackey")
    env = dict(os.environ, LD_LIBRARY_PATH=drv)
    p = subprocess.run(["valgrind", "--tool=lackey", "--trace-mem=yes", "--log-file=" + log,
                        exe, workload, str(warm), str(calls), so],
                       env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit("cache_lines %s failed: %s" % (workload, p.stderr[-2000:]))
    err = p.stderr.splitlines()
    sep = int(next(l for l in err if l.startswith("sep ")).split()[1], 16)
    with open(log, errors="replace") as f:
        segments = parse_trace(f, sep, mapped_ranges(err, exe))
    os.remove(log)
    # Every loop turn makes two calls; the last segment is what follows the loop.
    measured = segments[2 * warm:2 * (warm + calls)]
    return measured, library_base(err, so)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--so", default=os.path.join(REPO, "target/release/liballoc_ffi.so"))
    ap.add_argument("--workloads", default="pair,mixed")
    ap.add_argument("--warm", type=int, default=2000, help="loop turns before the measured ones")
    ap.add_argument("--calls", type=int, default=200, help="measured loop turns (two calls each)")
    ap.add_argument("--who", action="store_true", help="the writers of the lines most calls write")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    if not os.path.exists(args.so):
        ap.error("%s not found (cargo build --release -p alloc-ffi)" % args.so)
    needed = ["valgrind", "cc"] + (["addr2line"] if args.who else [])
    missing = [tool for tool in needed if shutil.which(tool) is None]
    if missing:
        ap.error("needs %s on PATH (apt-get install valgrind gcc binutils)" % " and ".join(missing))
    if args.calls < 2 or args.warm < 0:
        ap.error("--calls must be at least 2 and --warm at least 0")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        drv, exe = build(tmp)
        print("| workload | calls | lines touched a call | lines written a call "
              "| written by one call, touched by the next |")
        print("|---|---:|---:|---:|---:|")
        detail = []
        for w in args.workloads.split(","):
            if w not in WORKLOADS:
                ap.error("unknown workload %r (%s)" % (w, ", ".join(WORKLOADS)))
            calls, base = measure(exe, drv, args.so, w, args.warm, args.calls, tmp)
            s = summarize(calls)
            results[w] = s
            print("| %s | %d | %.1f | %.1f | %.1f |" % (
                WORKLOADS[w], s["calls"], s["touched"], s["written"], s["moved_between_calls"]))
            if args.who:
                detail.append("\n%s: lines written by at least half the calls" % WORKLOADS[w])
                for ln, c, by in hot_lines(calls):
                    names = " | ".join(symbol(args.so, base, ip) for ip, _ in by.most_common(2))
                    detail.append("  %#x  %d/%d  %s" % (ln * LINE, c, len(calls), names))
        print("\n".join(detail))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
