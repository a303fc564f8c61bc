"""A profile of a few training steps run after the timed ones (`fsdp_bench.py --profile N`):
torch.profiler over CPU and CUDA, summarised per operator, so that where a setting's step
time goes (the allocator's calls, which the bridge records as `gpualloc::malloc` and
`gpualloc::free`, event records and queries, stream waits, the kernels) can be set beside
PyTorch's default's. The profiled steps are not among the timed ones: the profiler's own
overhead would move the step times it is meant to explain.

Imports no torch at module level (run_all.py and the tests import it without torch).
"""
import json
import os

# Operators kept in the summary whatever their rank: the allocator's own, and the CUDA
# calls stream ordering and page recycling make.
WATCHED = ("gpualloc::", "cudaEvent", "cudaStreamWaitEvent", "cudaMalloc", "cudaFree",
           "cuMem", "cudaDeviceSynchronize", "cudaStreamSynchronize")
TOP = 25  # the operators with the most self CPU time, besides the watched ones


def _us(avg, *names):
    """The first of `names` the averaged event has, in microseconds (torch renamed the
    device fields from cuda to device)."""
    for n in names:
        v = getattr(avg, n, None)
        if v is not None:
            return float(v)
    return 0.0


def rows_from_averages(averages, steps):
    """Per-operator rows, per profiled step: name, calls, self CPU, CPU total and self
    device microseconds. The TOP operators by self CPU time and every WATCHED one."""
    rows = []
    for a in averages:
        rows.append({
            "name": a.key,
            "calls": round(a.count / steps, 2),
            "self_cpu_us": round(_us(a, "self_cpu_time_total") / steps, 1),
            "cpu_total_us": round(_us(a, "cpu_time_total") / steps, 1),
            "self_device_us": round(_us(a, "self_device_time_total",
                                        "self_cuda_time_total") / steps, 1),
        })
    rows.sort(key=lambda r: -r["self_cpu_us"])
    keep = rows[:TOP] + [r for r in rows[TOP:] if r["name"].startswith(WATCHED)]
    return keep


def summary(rows, steps):
    """Totals per profiled step: self CPU of every operator, of the allocator's own
    (`gpualloc::`), and the watched CUDA calls'."""
    def total(pred):
        return round(sum(r["self_cpu_us"] for r in rows if pred(r["name"])), 1)
    return {
        "steps": steps,
        "allocator_self_cpu_us": total(lambda n: n.startswith("gpualloc::")),
        "watched_cuda_self_cpu_us": total(lambda n: n.startswith(WATCHED)
                                          and not n.startswith("gpualloc::")),
        "ops": rows,
    }


def parse_steps(text):
    """--profile's value: a number of steps, at least 1."""
    n = int(text)
    if n < 1:
        raise ValueError("--profile takes a number of steps, at least 1")
    return n


class StepProfile:
    """`with StepProfile(torch, steps, path):` around the profiled steps; `result` is the
    summary afterwards, and `path` (.txt) gets torch's own tables."""

    def __init__(self, torch, steps, path):
        self.torch, self.steps, self.path = torch, steps, path
        self.prof, self.result = None, None

    def __enter__(self):
        p = self.torch.profiler
        activities = [p.ProfilerActivity.CPU]
        if self.torch.cuda.is_available():
            activities.append(p.ProfilerActivity.CUDA)
        self.prof = p.profile(activities=activities)
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.torch.cuda.is_available():
            self.torch.cuda.synchronize()
        self.prof.__exit__(*exc)
        if exc[0] is not None:
            return False
        averages = self.prof.key_averages()
        self.result = summary(rows_from_averages(averages, self.steps), self.steps)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w") as f:
            f.write("# %d profiled steps\n\n" % self.steps)
            f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40))
            f.write("\n\n")
            f.write(json.dumps(self.result, indent=1))
            f.write("\n")
        return False
