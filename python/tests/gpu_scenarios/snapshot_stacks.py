"""GPU scenario: torch.cuda.memory._record_memory_history through the gpu_alloc bridge
keeps Python stacks and a trace as PyTorch's own allocator does.

    GPUALLOC_SO=target/release/liballoc_ffi.so python3 python/tests/gpu_scenarios/snapshot_stacks.py

Checks: the stack of a uniquely named allocating function in the live block's frames and
in its "alloc" trace entry; a free's own stack with context="all", the allocation's with
context="alloc", none in the trace with context="state"; skip_actions; max_entries as a
ring keeping the newest entries; times in microseconds since the epoch; an "oom" entry;
frees of blocks allocated before recording carry their sizes; history off stops recording
and clears the trace; torch.cuda._memory_viz renders the snapshot with the stacks in it.
Prints "RESULT <summary>" and exits 0, or raises (non-zero exit).
"""
import base64
import io
import json
import os
import pickle
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # python/, for gpu_alloc

MIB = 1 << 20
SIZE = 3 * MIB + 123  # a requested size no other allocation here has


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def gpu_alloc_probe_allocating_fn(torch, size=SIZE):
    return torch.empty(size, dtype=torch.uint8, device="cuda")


def gpu_alloc_probe_freeing_fn(holder):
    holder.clear()  # the tensor's last reference: freed in this frame


def gpu_alloc_probe_oom_fn(torch):
    try:
        torch.empty(1 << 46, dtype=torch.uint8, device="cuda")  # 64 TiB
    except torch.OutOfMemoryError:
        return
    raise AssertionError("a 64 TiB allocation succeeded")


def names(frames):
    return {f["name"] for f in frames or []}


def device_trace(snap):
    return snap["device_traces"][0]


def entries(snap, action, addr=None):
    return [e for e in device_trace(snap)
            if e["action"] == action and (addr is None or e.get("addr") == addr)]


def block_at(snap, addr):
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["address"] == addr:
                return b
    raise AssertionError("no block at %#x in the snapshot" % addr)


def record(torch, **kwargs):
    # Python stacks only: C++ frames would be symbolized at every snapshot (slow).
    torch.cuda.memory._record_memory_history(stacks="python", clear_history=True, **kwargs)


def alloc_and_free(torch):
    """Allocates in the allocating probe, frees in the freeing probe; returns the address."""
    holder = [gpu_alloc_probe_allocating_fn(torch)]
    addr = holder[0].data_ptr()
    gpu_alloc_probe_freeing_fn(holder)
    return addr


def check_stacks(torch):
    alloc_fn, free_fn = gpu_alloc_probe_allocating_fn.__name__, gpu_alloc_probe_freeing_fn.__name__
    record(torch, max_entries=100000)  # context="all"
    x = gpu_alloc_probe_allocating_fn(torch)
    snap = torch.cuda.memory._snapshot()
    block = block_at(snap, x.data_ptr())
    check(block["state"] == "active_allocated" and block["requested_size"] == SIZE, str(block))
    check(alloc_fn in names(block.get("frames")), "live block frames: %s" % block.get("frames"))
    alloc = entries(snap, "alloc", x.data_ptr())
    check(len(alloc) == 1 and alloc[0]["size"] == SIZE, "alloc entries: %s" % alloc)
    check(alloc_fn in names(alloc[0].get("frames")), "alloc entry frames: %s" % alloc[0])
    now_us = time.time() * 1e6
    check(abs(alloc[0]["time_us"] - now_us) < 600e6,
          "time_us %s is not microseconds since the epoch (now %d)" % (alloc[0]["time_us"], now_us))
    addr = x.data_ptr()
    holder = [x]
    del x
    gpu_alloc_probe_freeing_fn(holder)
    snap = torch.cuda.memory._snapshot()
    for action in ("free_requested", "free_completed"):
        e = entries(snap, action, addr)
        check(len(e) == 1 and e[0]["size"] == SIZE, "%s entries: %s" % (action, e))
        check(free_fn in names(e[0].get("frames")) and alloc_fn not in names(e[0].get("frames")),
              "context='all': %s carries the free's stack: %s" % (action, e[0].get("frames")))

    record(torch, context="alloc")
    addr = alloc_and_free(torch)
    snap = torch.cuda.memory._snapshot()
    e = entries(snap, "free_requested", addr)
    check(len(e) == 1 and alloc_fn in names(e[0].get("frames")),
          "context='alloc': a free carries the allocation's stack: %s" % e)

    record(torch, context="state")
    x = gpu_alloc_probe_allocating_fn(torch)
    snap = torch.cuda.memory._snapshot()
    check(alloc_fn in names(block_at(snap, x.data_ptr()).get("frames")),
          "context='state': live block keeps its stack")
    e = entries(snap, "alloc", x.data_ptr())
    check(len(e) == 1 and not e[0].get("frames"), "context='state': no stack in the trace: %s" % e)
    del x
    return "stacks in blocks and alloc/free entries as context= asks"


def check_oom(torch):
    record(torch)
    gpu_alloc_probe_oom_fn(torch)
    snap = torch.cuda.memory._snapshot()
    oom = entries(snap, "oom")
    check(len(oom) == 1 and oom[0]["size"] == 1 << 46 and "device_free" in oom[0], "oom: %s" % oom)
    check(gpu_alloc_probe_oom_fn.__name__ in names(oom[0].get("frames")), "oom frames: %s" % oom[0])
    return "oom entry with its stack"


def check_skip_and_ring(torch):
    record(torch, skip_actions=["free_requested"])
    addr = alloc_and_free(torch)
    snap = torch.cuda.memory._snapshot()
    check(not entries(snap, "free_requested"), "skip_actions kept free_requested entries")
    check(entries(snap, "alloc", addr) and entries(snap, "free_completed", addr),
          "skip_actions dropped more than free_requested")

    record(torch, max_entries=7)
    addrs = [alloc_and_free(torch) for _ in range(20)]
    trace = device_trace(torch.cuda.memory._snapshot())
    check(len(trace) == 7, "max_entries=7 kept %d entries" % len(trace))
    check(trace[-1]["action"] == "free_completed" and trace[-1]["addr"] == addrs[-1],
          "the ring keeps the newest entries last: %s" % trace[-1])
    return "skip_actions honoured; max_entries=7 kept the newest 7 of 60"


def check_adopted_and_off(torch):
    torch.cuda.memory._record_memory_history(enabled=None)
    early = torch.empty(SIZE, dtype=torch.uint8, device="cuda")  # while not recording
    addr = early.data_ptr()
    record(torch)
    del early
    snap = torch.cuda.memory._snapshot()
    e = entries(snap, "free_requested", addr)
    check(len(e) == 1 and e[0]["size"] == SIZE,
          "a block allocated before recording is freed with its size: %s" % e)

    torch.cuda.memory._record_memory_history(enabled=None)
    check(not any(torch.cuda.memory._snapshot()["device_traces"]), "history off clears the trace")
    alloc_and_free(torch)
    check(not any(torch.cuda.memory._snapshot()["device_traces"]), "history off records nothing")
    return "pre-recording blocks freed with their sizes; history off records nothing"


def embedded_snapshot(html):
    """The snapshot a torch.cuda._memory_viz page carries (base64 of the pickle)."""
    start = html.index("const local_files = ") + len("const local_files = ")
    files = json.loads(html[start:html.index("\n", start)])
    return pickle.loads(base64.b64decode(files[0]["base64"]).rstrip(b"\x00"))


def check_memory_viz(torch):
    from torch.cuda import _memory_viz

    alloc_fn = gpu_alloc_probe_allocating_fn.__name__
    record(torch)
    keep = gpu_alloc_probe_allocating_fn(torch)
    alloc_and_free(torch)
    snap = torch.cuda.memory._snapshot()
    out = os.environ.get("OUT")
    for kind, html in (("trace", _memory_viz.trace_plot(snap)), ("segments", _memory_viz.segment_plot(snap))):
        shown = embedded_snapshot(html)
        block = block_at(shown, keep.data_ptr())
        check(alloc_fn in names(block.get("frames")), "%s page: block frames lost" % kind)
        check(any(alloc_fn in names(e.get("frames")) for e in shown["device_traces"][0]),
              "%s page: trace frames lost" % kind)
        if out:
            with open(os.path.join(out, "bridge_stacks_%s.html" % kind), "w") as f:
                f.write(html)
    text = _memory_viz.trace(snap)
    check("cudaMalloc" in text or "del " in text, "_memory_viz.trace renders the trace")
    _memory_viz.segsum(snap)
    if hasattr(_memory_viz, "_write_blocks"):  # the flame graph's input lines
        f = io.StringIO()
        for seg in snap["segments"]:
            _memory_viz._write_blocks(f, "seg", seg["blocks"])
        check(alloc_fn in f.getvalue(), "flame graph lines name the allocating function")
    torch.cuda.memory._record_memory_history(enabled=None)
    del keep
    return "trace_plot and segment_plot carry the stacks"


def run():
    import gpu_alloc

    gpu_alloc.enable(bridge=True)
    import torch

    check(gpu_alloc.uses_bridge(), "bridge installed")
    torch.ones(1, device="cuda")  # CUDA initialised before recording starts
    done = [check_stacks(torch), check_oom(torch), check_skip_and_ring(torch),
            check_adopted_and_off(torch), check_memory_viz(torch)]
    return "; ".join(done)


if __name__ == "__main__":
    print("RESULT " + run())
