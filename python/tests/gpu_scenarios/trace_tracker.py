"""GPU scenario: allocator trace trackers (c10::cuda::CUDACachingAllocator::
attachAllocatorTraceTracker) are called by the gpu_alloc bridge as by PyTorch's allocator.

    GPUALLOC_SO=target/release/liballoc_ffi.so python3 python/tests/gpu_scenarios/trace_tracker.py

PyTorch has no Python call for trackers; the bridge module's test hooks
(bridge_testing.h) attach one counting entries by action. Checks: with history off the
tracker sees each allocation and free (alloc, free_requested and free_completed once per
tensor); actions that skip_actions keeps out of the trace still reach it; an out-of-memory
reaches it; a snapshot reports one "snapshot" action per device; segment allocations and
frees (cuMemAlloc / cuMemFree) reach it, and are recorded in the trace while history is on.
Prints "RESULT <summary>" and exits 0, or raises (non-zero exit).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # python/, for gpu_alloc

N = 16


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def alloc_free_counted(torch, bridge, n):
    """Counts of n allocations of distinct sizes, then of their frees."""
    torch.cuda.synchronize()
    bridge.reset_tracker_counts()
    tensors = [torch.empty(4096 * (i + 1) + i, dtype=torch.uint8, device="cuda") for i in range(n)]
    after_alloc = dict(bridge.tracker_counts())
    del tensors
    return after_alloc, dict(bridge.tracker_counts())


def run():
    import gpu_alloc

    gpu_alloc.enable(bridge=True)
    import torch

    check(gpu_alloc.uses_bridge(), "bridge installed")
    bridge = gpu_alloc._bridge
    torch.ones(1, device="cuda")
    torch.cuda.memory._record_memory_history(enabled=None)
    bridge.attach_counting_tracker()

    after_alloc, after_free = alloc_free_counted(torch, bridge, N)
    check(after_alloc["alloc"] == N and after_alloc["free_requested"] == 0,
          "history off: after %d allocations the tracker counted %s" % (N, after_alloc))
    for action in ("alloc", "free_requested", "free_completed"):
        check(after_free[action] == N, "history off: %s counted %d, expected %d (%s)"
              % (action, after_free[action], N, after_free))

    skipped = ["alloc", "free_requested", "free_completed"]
    torch.cuda.memory._record_memory_history(stacks="python", skip_actions=skipped)
    _, counts = alloc_free_counted(torch, bridge, N)
    for action in skipped:
        check(counts[action] == N, "skipped %s still reaches the tracker: %s" % (action, counts))
    snap = torch.cuda.memory._snapshot()
    kept = {e["action"] for t in snap["device_traces"] for e in t}
    check(not kept & set(skipped), "skip_actions kept %s in the trace" % (kept & set(skipped)))
    devices = torch.cuda.device_count()
    check(bridge.tracker_counts()["snapshot"] == devices,
          "a snapshot reports one 'snapshot' per device: %s" % bridge.tracker_counts())

    bridge.reset_tracker_counts()
    try:
        torch.empty(1 << 46, dtype=torch.uint8, device="cuda")  # 64 TiB
    except torch.OutOfMemoryError:
        pass
    else:
        raise AssertionError("a 64 TiB allocation succeeded")
    check(bridge.tracker_counts()["oom"] == 1, "oom counted: %s" % bridge.tracker_counts())
    # Segments: a 64 MiB tensor needs a segment of its own; empty_cache frees it.
    torch.cuda.memory._record_memory_history(stacks="python")
    torch.cuda.empty_cache()
    bridge.reset_tracker_counts()
    big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del big
    torch.cuda.empty_cache()
    counts = dict(bridge.tracker_counts())
    check(counts["segment_alloc"] >= 1 and counts["segment_free"] >= 1,
          "segment events reach the tracker: %s" % counts)
    actions = [e["action"] for e in torch.cuda.memory._snapshot()["device_traces"][0]]
    check("segment_alloc" in actions and "segment_free" in actions,
          "segment events in the trace: %s" % sorted(set(actions)))
    torch.cuda.memory._record_memory_history(enabled=None)
    return "tracker counted %d alloc / free_requested / free_completed with history off and " \
           "with them skipped, 1 oom, %d snapshot, %d segment_alloc / %d segment_free" % (
               N, devices, counts["segment_alloc"], counts["segment_free"])


if __name__ == "__main__":
    print("RESULT " + run())
