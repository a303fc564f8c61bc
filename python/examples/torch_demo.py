"""gpualloc under PyTorch, end to end (run on a machine with a GPU):

    GPUALLOC_SO=target/release/liballoc_ffi.so python3 python/examples/torch_demo.py OUTDIR

Enables the allocator through the gpu_alloc helper, runs tensor ops and a few training
steps of a small conv net, checks gpu_alloc.memory_stats() against what the tensors hold
and against cuMemGetInfo (torch.cuda.mem_get_info), uses record_stream across two streams,
writes a snapshot (with the allocation history) and renders it with torch.cuda._memory_viz
(trace_plot / segment_plot HTML, segsum text) into OUTDIR. Then, in child processes: what
happens when enable() comes too late, and what PyTorch does with an allocation that fails.
"""
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")

import gpu_alloc  # noqa: E402

if len(sys.argv) > 2 and sys.argv[2] == "--child-late":
    import torch

    torch.zeros(1, device="cuda")
    try:  # PyTorch's own refusal, then the helper's
        torch.cuda.memory.change_current_allocator(torch.cuda.memory.CUDAPluggableAllocator(
            gpu_alloc.library_path(), gpu_alloc.ALLOC_FN, gpu_alloc.FREE_FN))
    except RuntimeError as e:
        print("torch refuses:", str(e).splitlines()[0])
    try:
        gpu_alloc.enable()
        print("late enable: no error (unexpected)")
    except gpu_alloc.GpuAllocError as e:
        print("late enable -> GpuAllocError:", e)
    sys.exit(0)

if len(sys.argv) > 2 and sys.argv[2] == "--child-oom":
    import torch

    gpu_alloc.enable()
    try:
        t = torch.empty(1 << 46, dtype=torch.uint8, device="cuda")  # 64 TiB
        print("oom: torch.empty returned, data_ptr =", t.data_ptr())
        t.fill_(1)
        torch.cuda.synchronize()
        print("oom: fill_ completed (unexpected)")
    except Exception as e:  # noqa: BLE001
        print("oom: %s: %s" % (type(e).__name__, str(e).splitlines()[0][:300]))
    sys.exit(0)

gpu_alloc.enable(os.environ.get("DEMO_CONF", "policy:pytorch-bfc"))
gpu_alloc.record_history(True, max_entries=5000)

import torch  # noqa: E402

print("torch", torch.__version__, "gpualloc", gpu_alloc.version(), "library", gpu_alloc._lib_path)
free0, total = torch.cuda.mem_get_info()

# Tensor ops.
a = torch.randn(1024, 1024, device="cuda")
b = torch.randn(1024, 1024, device="cuda")
c = (a @ b).relu_()
ref = (a.cpu() @ b.cpu()).relu_()
print("matmul max abs err vs CPU: %.2e" % (c.cpu() - ref).abs().max().item())
e = torch.empty(0, device="cuda")  # zero bytes: NULL data pointer, no error
print("empty tensor ok, numel", e.numel())
s = gpu_alloc.memory_stats()
live = sum(t.untyped_storage().nbytes() for t in (a, b, c))
print("requested_bytes.all.current", s["requested_bytes.all.current"], ">= live tensors", live)
assert s["requested_bytes.all.current"] >= live

# A few training steps of a small conv net.
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
    torch.nn.Flatten(), torch.nn.Linear(64, 10),
).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(64, 3, 64, 64, device="cuda")
y = torch.randint(0, 10, (64,), device="cuda")
losses = []
for step in range(5):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item())
print("losses", ["%.4f" % v for v in losses])
assert losses[-1] < losses[0]

# record_stream across streams (torch's Tensor.record_stream is ignored under a
# pluggable allocator; gpu_alloc.record_stream reaches the allocator).
side = torch.cuda.Stream()
t = torch.ones(1 << 20, device="cuda")
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    u = t * 2
gpu_alloc.record_stream(t, side)
del t
torch.cuda.synchronize()
print("record_stream ok, u.sum() =", u.sum().item())

torch.cuda.synchronize()
s = gpu_alloc.memory_stats()
free1, _ = torch.cuda.mem_get_info()
keys = ["allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
        "reserved_bytes.all.peak", "active_bytes.all.peak", "requested_bytes.all.peak",
        "segment.all.current", "num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms"]
for k in keys:
    print("  %-28s %d" % (k, s[k]))
print("cuMemGetInfo used grew by %d bytes; reserved_bytes.all.current %d"
      % (free0 - free1, s["reserved_bytes.all.current"]))

# Snapshot and the memory visualizer.
from torch.cuda import _memory_viz as viz  # noqa: E402

path = os.path.join(OUT, "gpualloc_snapshot.pickle")
snap = gpu_alloc.snapshot(path)
print("snapshot: %d segments, %d blocks, %d trace events, settings %s" % (
    len(snap["segments"]), sum(len(g["blocks"]) for g in snap["segments"]),
    sum(len(t) for t in snap["device_traces"]), json.dumps(snap["allocator_settings"])[:160]))
with open(os.path.join(OUT, "gpualloc_trace_plot.html"), "w") as f:
    f.write(viz.trace_plot(snap))
with open(os.path.join(OUT, "gpualloc_segment_plot.html"), "w") as f:
    f.write(viz.segment_plot(snap))
for line in viz.segsum(snap).splitlines():
    if line.startswith(("segments:", "total_reserved", "total_allocated", "total_free")):
        print("segsum", line)
trace_txt = viz.trace(snap)
print("trace:", trace_txt.splitlines()[:2], "...", len(trace_txt.splitlines()), "lines")
r = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", path, "-o",
                    os.path.join(OUT, "gpualloc_cli_trace_plot.html")], capture_output=True, text=True)
print("python -m torch.cuda._memory_viz trace_plot: rc", r.returncode, r.stderr[-300:])

del a, b, c, model, opt, x, y, u
torch.cuda.synchronize()
gpu_alloc.empty_cache()
print("after empty_cache: reserved", gpu_alloc.memory_reserved(), "allocated", gpu_alloc.memory_allocated())

for flag in ["--child-late", "--child-oom"]:
    t0 = time.time()
    r = subprocess.run([sys.executable, __file__, OUT, flag], capture_output=True, text=True, timeout=120)
    print(flag, "rc", r.returncode, "(%.0fs)" % (time.time() - t0))
    print("  stdout:", r.stdout.strip()[-600:])
    print("  stderr:", r.stderr.strip()[-600:])
print("demo done")
