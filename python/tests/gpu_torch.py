"""GPU tests of gpualloc inside PyTorch (run on a machine with a GPU, torch and a C++
compiler; `cargo xtask test-gpu --bundle` carries this file and runs it):

    GPUALLOC_SO=target/release/liballoc_ffi.so python3 python/tests/gpu_torch.py [SCENARIO...]

Each scenario runs in a process of its own (an allocator is chosen once per process) and
prints PASS or FAIL with its figures; the exit status is non-zero if any failed. With
OUT set, memory_viz renderings of a snapshot are written to $OUT.
"""
import gc
import os
import pickle
import subprocess
import sys

import scenarios  # the runner shared with gpu_libraries.py (this script's folder)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MIB = 1 << 20


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def enabled(config=None, bridge=True):
    if os.environ.get("GPU_TORCH_REFERENCE") == "1":
        # The same scenario under PyTorch's own allocator, as a control.
        import torch

        return None, torch
    import gpu_alloc

    gpu_alloc.enable(config, bridge=bridge)
    import torch

    return gpu_alloc, torch


def hazard_run(torch):
    """Allocate x on stream A, read it on stream B after a long sleep, record_stream(B),
    free it, allocate the same size on A and overwrite it. Returns (what B read, the
    expected value, whether the new tensor got x's address)."""
    n = 8 * MIB // 4
    a = torch.cuda.current_stream()
    b = torch.cuda.Stream()
    # Load every kernel first: loading a module lazily synchronizes the device,
    # which would end B's sleep before the hazard could happen.
    w = torch.full((n,), 1.0, device="cuda")
    with torch.cuda.stream(b):
        torch.cuda._sleep(1000)
        w.sum()
    del w
    torch.cuda.synchronize()
    x = torch.full((n,), 1.0, device="cuda")
    torch.cuda.synchronize()
    b.wait_stream(a)
    with torch.cuda.stream(b):
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time before the read
        seen = x.sum()
    x.record_stream(b)
    old = x.data_ptr()
    del x
    z = torch.full((n,), 2.0, device="cuda")  # on A, runs while B still sleeps
    reused = z.data_ptr() == old
    torch.cuda.synchronize()
    return seen.item(), float(n), reused


def scenario_record_stream():
    gpu_alloc, torch = enabled()
    check(gpu_alloc.uses_bridge(), "bridge installed")
    seen, expected, reused = hazard_run(torch)
    check(seen == expected, "stream B read %s, expected %s (block reused too early)" % (seen, expected))
    check(not reused, "the block was handed out again while stream B used it")
    # After B's work completes the block becomes reusable again.
    torch.cuda.synchronize()
    return "B read %.0f as expected; block not reused while in use" % seen


def scenario_record_stream_plain():
    """The same with a plain pluggable allocator: record_stream never reaches the library."""
    gpu_alloc, torch = enabled(bridge=False)
    seen, expected, reused = hazard_run(torch)
    check(reused and seen != expected,
          "expected the hazard without the bridge: read %s (expected %s), reused=%s"
          % (seen, expected, reused))
    return "hazard shown: B read %.0f instead of %.0f (block reused at once)" % (seen, expected)


def scenario_stats():
    gpu_alloc, torch = enabled()
    free0, total = torch.cuda.mem_get_info()
    x = torch.empty(1024 * MIB, dtype=torch.uint8, device="cuda")
    y = torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")
    ours = gpu_alloc.memory_stats()
    theirs = torch.cuda.memory_stats()
    for k, v in ours.items():
        if k.startswith(("page_moves.", "stream_ops.")):
            continue  # ours (page moves, stream ordering's driver calls): PyTorch has none
        check(theirs.get(k) == v, "torch.cuda.memory_stats()[%r] = %r, ours %r" % (k, theirs.get(k), v))
    check(torch.cuda.memory_allocated() == ours["allocated_bytes.all.current"], "memory_allocated")
    check(torch.cuda.memory_reserved() == ours["reserved_bytes.all.current"], "memory_reserved")
    check(torch.cuda.memory_allocated() >= 1027 * MIB, "allocated counts both tensors")
    free1, _ = torch.cuda.mem_get_info()
    used = free0 - free1
    reserved = torch.cuda.memory_reserved()
    check(abs(used - reserved) <= 64 * MIB,
          "cuMemGetInfo saw %d bytes taken, allocator reserved %d" % (used, reserved))
    del x
    check(torch.cuda.max_memory_allocated() >= 1027 * MIB, "peak kept after free")
    torch.cuda.reset_peak_memory_stats()
    check(torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated(), "peak reset")
    summary = torch.cuda.memory_summary()
    check("Allocated memory" in summary, "memory_summary renders")
    torch.cuda.empty_cache()  # reaches the library: the freed 1 GiB segment goes back
    check(torch.cuda.memory_reserved() < reserved - 1000 * MIB, "empty_cache released the segment")
    free2, _ = torch.cuda.mem_get_info()
    check(free2 - free1 >= 1000 * MIB, "the driver got the memory back")
    del y
    return "stats equal in %d keys; cuMemGetInfo delta %d vs reserved %d" % (len(ours), used, reserved)


def scenario_fraction_and_oom():
    gpu_alloc, torch = enabled()
    _, total = torch.cuda.mem_get_info()
    torch.cuda.set_per_process_memory_fraction(0.25)
    keep = torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda")
    try:
        torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        msg = str(e)
    else:
        raise AssertionError("allocation past the memory fraction succeeded")
    check("out of memory" in msg.lower(), "OOM message: " + msg)
    check(torch.cuda.memory_stats()["num_ooms"] >= 1, "num_ooms counted")
    small = torch.ones(1000, device="cuda")  # still works after the OOM
    check(small.sum().item() == 1000, "allocations work after an OOM")
    del keep
    return "torch.OutOfMemoryError raised: " + msg.splitlines()[0][:160]


def scenario_torch_settings():
    """PyTorch's allocator settings reach gpualloc: PYTORCH_CUDA_ALLOC_CONF's device options
    at enable(), torch.cuda.memory._set_allocator_settings (and torch._C's
    _accelerator_setAllocatorSettings) afterwards."""
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "per_process_memory_fraction:0.5,max_split_size_mb:64"
    os.environ.pop("GPUALLOC_CONF", None)
    gpu_alloc, torch = enabled()
    settings = gpu_alloc.settings()
    check("per_process_memory_fraction:0.5" in settings and "max_split_size_mb:64" in settings,
          "PYTORCH_CUDA_ALLOC_CONF applied: " + settings)
    fraction = torch.cuda.memory.get_per_process_memory_fraction(0)
    check(fraction == 0.5, "get_per_process_memory_fraction gave %r" % fraction)
    _, total = torch.cuda.mem_get_info()
    try:
        torch.empty(int(total * 0.6), dtype=torch.uint8, device="cuda")
        raise AssertionError("an allocation past per_process_memory_fraction:0.5 succeeded")
    except torch.OutOfMemoryError:
        pass
    key = "active_bytes.all.allocated"
    nbytes = 84 * MIB

    def grows_by(make):
        before = torch.cuda.memory_stats()[key]
        kept.append(make())
        return torch.cuda.memory_stats()[key] - before

    kept = []
    plain = grows_by(lambda: torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
    torch.cuda.memory._set_allocator_settings("roundup_power2_divisions:4")
    rounded = grows_by(lambda: torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
    check((plain, rounded) == (nbytes, 96 * MIB),
          "84 MiB took %d then %d bytes (expected 84 MiB, then 96 MiB with 4 divisions)"
          % (plain, rounded))
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    kept.append(torch.empty(300 * MIB, dtype=torch.uint8, device="cuda"))
    expandable = [s for s in torch.cuda.memory_snapshot() if s.get("is_expandable")]
    check(expandable, "no expandable segment after expandable_segments:True")
    check("expandable_segments:true" in gpu_alloc.settings(), gpu_alloc.settings())
    del kept
    return ("PYTORCH_CUDA_ALLOC_CONF applied (fraction %.1f, OOM past it); 84 MiB -> %d MiB "
            "after roundup_power2_divisions:4; %d expandable segment(s) after "
            "expandable_segments:True" % (fraction, rounded // MIB, len(expandable)))


def scenario_snapshot():
    gpu_alloc, torch = enabled()
    torch.cuda.memory._record_memory_history(max_entries=100000)
    m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
    for _ in range(3):
        loss = m(torch.randn(256, 1024, device="cuda")).square().mean()
        loss.backward()
    snap = torch.cuda.memory._snapshot()
    check(len(snap["segments"]) > 0, "segments in torch.cuda.memory._snapshot()")
    check(any(len(t) > 10 for t in snap["device_traces"]), "device_traces recorded")
    blocks = sum(len(s["blocks"]) for s in snap["segments"])
    total = sum(s["total_size"] for s in snap["segments"])
    check(total == torch.cuda.memory_reserved(), "snapshot segments = reserved bytes")
    out = os.environ.get("OUT", "/tmp")
    path = os.path.join(out, "bridge_snapshot.pickle")
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    from torch.cuda import _memory_viz

    with open(path, "rb") as f:
        data = pickle.load(f)
    html = _memory_viz.trace_plot(data)
    with open(os.path.join(out, "bridge_memory_viz_trace.html"), "w") as f:
        f.write(html)
    seg_html = _memory_viz.segment_plot(data)
    with open(os.path.join(out, "bridge_memory_viz_segments.html"), "w") as f:
        f.write(seg_html)
    return "%d segments, %d blocks, %d trace events; rendered by torch.cuda._memory_viz" % (
        len(snap["segments"]), blocks, sum(len(t) for t in snap["device_traces"]))


def scenario_cuda_graph():
    gpu_alloc, torch = enabled()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
    static_in = torch.randn(64, 512, device="cuda")
    reserved0 = torch.cuda.memory_reserved()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        static_out = model(static_in)
    pools = {tuple(s["segment_pool_id"]) for s in torch.cuda.memory._snapshot()["segments"]}
    check(any(p != (0, 0) for p in pools), "capture allocated in a private pool: %s" % pools)
    worst = 0.0
    for i in range(5):
        x = torch.randn(64, 512, device="cuda")
        static_in.copy_(x)
        g.replay()
        with torch.no_grad():
            eager = model(x)
        torch.cuda.synchronize()
        worst = max(worst, (static_out - eager).abs().max().item())
    check(worst == 0.0, "graph replay differs from eager by %g" % worst)
    # make_graphed_callables (forward and backward captured).
    lin = torch.nn.Linear(256, 256).cuda()
    graphed = torch.cuda.make_graphed_callables(lin, (torch.randn(32, 256, device="cuda", requires_grad=True),))
    inp = torch.randn(32, 256, device="cuda", requires_grad=True)
    out = graphed(inp)
    out.sum().backward()
    check(torch.allclose(out, lin(inp)), "make_graphed_callables output equals eager")
    # make_graphed_callables patches `lin` in place (graphed is lin), and the
    # gradients it leaves (inp.grad, lin.weight.grad) are views of the backward
    # graph's static outputs, in its private pool: drop all of them. cuBLAS keeps
    # the workspaces it got while capturing (32 MiB and 1 MiB on an H100, per
    # handle and stream) in PyTorch's workspace cache, in the graphs' pools, with
    # PyTorch's allocator too: clear that cache as PyTorch's own tests do.
    del g, static_out, graphed, out, lin, inp
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    leftover = [(tuple(s["segment_pool_id"]), [(b["size"], b["state"]) for b in s["blocks"] if b["state"] != "inactive"])
                for s in torch.cuda.memory._snapshot()["segments"] if tuple(s["segment_pool_id"]) != (0, 0)]
    reserved1 = torch.cuda.memory_reserved()
    check(not leftover, "private pool segments left after the graphs were deleted and "
          "empty_cache ran (pool, live blocks): %s" % leftover)
    return "replay == eager (max diff %g); reserved before %d, after delete+empty_cache %d" % (worst, reserved0, reserved1)


def scenario_mempool():
    import torch
    import gpu_alloc

    torch.ones(1, device="cuda")  # PyTorch's allocator is in use already
    base_torch = torch.cuda.memory_stats()["allocated_bytes.all.current"]
    base_ours = gpu_alloc.memory_stats()["reserved_bytes.all.current"]
    outside = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    check(gpu_alloc.memory_stats()["reserved_bytes.all.current"] == base_ours,
          "an allocation outside the pool reached gpualloc")
    with gpu_alloc.pool() as mem_pool:
        inside = torch.empty(32 * MIB, dtype=torch.uint8, device="cuda")
    ours = gpu_alloc.memory_stats()
    check(ours["reserved_bytes.all.current"] >= 32 * MIB, "the pool's allocation reached gpualloc")
    check(torch.cuda.memory_stats()["allocated_bytes.all.current"] >= base_torch + 64 * MIB,
          "PyTorch's allocator served the outside tensor")
    inside.fill_(3)
    check(inside.sum().item() == 3 * 32 * MIB, "pool tensor usable")
    del inside, outside, mem_pool
    return "inside: gpualloc reserved %d bytes; outside: PyTorch's allocator" % ours["reserved_bytes.all.current"]


def _count_calls(module, names):
    """Wraps module.<name> for each name with a call counter; returns the counts."""
    counts = dict.fromkeys(names, 0)

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return counted

    for name in names:
        setattr(module, name, wrap(name, getattr(module, name)))
    return counts


def _private_pool_segments(torch):
    return [s for s in torch.cuda.memory._snapshot()["segments"]
            if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]


def scenario_compile_reduce_overhead():
    """torch.compile(mode="reduce-overhead"): CUDA graph trees over gpualloc's private
    pools, for inference (three chained functions, the last one recorded after the
    others replay, so the tree restores a checkpoint) and for training (forward and
    backward graphs); outputs equal eager; the pools' memory goes back afterwards."""
    gpu_alloc, torch = enabled()
    import copy

    calls = _count_calls(torch._C, ["_cuda_getCheckpointState", "_cuda_setCheckpointPoolState",
                                    "_cuda_checkPoolLiveAllocations"])
    torch.manual_seed(0)
    width = 512
    layers = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()).cuda()
              for _ in range(3)]
    x = torch.randn(64, width, device="cuda")
    before = torch.cuda.memory_allocated()

    # Inference: f, g, h chained; h joins from the fourth step, after f and g were
    # recorded, so it is recorded while its parents replay.
    compiled = [torch.compile(m, mode="reduce-overhead") for m in layers]
    worst = 0.0
    with torch.no_grad():
        want2 = layers[1](layers[0](x))
        want3 = layers[2](want2)
        for step in range(7):
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled[1](compiled[0](x))
            want = want2
            if step >= 3:
                out = compiled[2](out)
                want = want3
            worst = max(worst, (out - want).abs().max().item())
            out = None
    check(worst < 1e-3, "inference differs from eager by %g" % worst)

    # Training: forward and backward graphs, against an eager replica.
    model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                torch.nn.Linear(4 * width, width)).cuda()
    replica = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.SGD(replica.parameters(), lr=1e-2)
    y = torch.randn(64, width, device="cuda")

    def step(m, o):
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        o.step()
        # Gradients made by a graph live in its pool: let go of them each step.
        o.zero_grad(set_to_none=True)
        return loss.item()

    train = torch.compile(model, mode="reduce-overhead")
    losses = []
    for _ in range(8):
        torch.compiler.cudagraph_mark_step_begin()
        losses.append((step(train, opt), step(replica, opt_ref)))
    for got, ref in losses:
        check(abs(got - ref) <= 1e-3 * max(1.0, abs(ref)), "training loss %g vs eager %g" % (got, ref))
    check(losses[-1][0] < losses[0][0], "the compiled training does not learn: %s" % losses)
    check(calls["_cuda_getCheckpointState"] > 0, "no checkpoint taken: %s" % calls)
    check(calls["_cuda_setCheckpointPoolState"] > 0, "no checkpoint restored: %s" % calls)
    check(calls["_cuda_checkPoolLiveAllocations"] > 0, "live allocations never checked: %s" % calls)
    pooled = sum(s["total_size"] for s in _private_pool_segments(torch))
    check(pooled > 0, "the graphs used no private pool")

    # Memory goes back once the compiled functions are gone.
    del compiled, train, out
    for p in list(model.parameters()) + list(replica.parameters()):
        p.grad = None
    torch._dynamo.reset()
    torch._C._cuda_clearCublasWorkspaces()  # cuBLAS keeps one per handle and stream
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    left = _private_pool_segments(torch)
    check(not left, "%d private-pool segments left after reset: %s" % (len(left), left[:2]))
    model_bytes = sum(p.numel() * 4 for p in list(model.parameters()) + list(replica.parameters()))
    extra = torch.cuda.memory_allocated() - before - model_bytes
    check(extra <= 64 * MIB, "%d bytes still allocated after reset" % extra)
    return ("inference max |diff| %.2g, training losses %.4f -> %.4f (eager %.4f -> %.4f); "
            "private pools peaked at %d MiB and were released; calls %s" % (
                worst, losses[0][0], losses[-1][0], losses[0][1], losses[-1][1],
                pooled // MIB, calls))


def _gpu_scenario(name, case="run"):
    """case() (default run()) of python/tests/gpu_scenarios/<name>.py, in this scenario's own
    process."""
    sys.path.insert(0, os.path.join(HERE, "gpu_scenarios"))
    return getattr(__import__(name), case)()


def scenario_snapshot_stacks():
    return _gpu_scenario("snapshot_stacks")


def scenario_trace_tracker():
    return _gpu_scenario("trace_tracker")


def scenario_sleep_region():
    return _gpu_scenario("sleep_wake", "region")


def scenario_sleep_host_backup():
    return _gpu_scenario("sleep_wake", "host_backup")


def scenario_sleep_cuda_graph():
    return _gpu_scenario("sleep_wake", "cuda_graph")


def scenario_capture_reuse():
    """graph_capture_record_stream_reuse (on through $GPUALLOC_CONF in this process):
    PyTorch's two- and four-stream capture tests, the data checked after a replay."""
    return _gpu_scenario("capture_reuse")


def scenario_ipc_share():
    """python/tests/gpu_scenarios/ipc_share.py: every sender/receiver case, each in
    processes of its own (torch.multiprocessing spawns the receivers)."""
    script = os.path.join(HERE, "gpu_scenarios", "ipc_share.py")
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=1800)
    sys.stdout.write(r.stdout)
    check(r.returncode == 0, "IPC cases failed:\n" + r.stdout[-3000:] + r.stderr[-2000:])
    return [l for l in r.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):]


def scenario_budget_fresh_streams():
    """A fresh stream for every weight sync (vLLM issue 52950's pattern): 16 streams, each
    filling a 1 GiB buffer and dropping it, under a 4 GiB memory budget. Reserved memory
    stays flat at the budget (PyTorch's allocator keeps each stream's buffer: 16 GiB)."""
    gpu_alloc, torch = enabled(
        "expandable_segments:True,unmap_free_pages:True,unmap_page_mb:16,memory_budget_mb:4096"
    )
    most = 0
    for i in range(16):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            buf = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
            buf.fill_(i)
            check(buf[-1].item() == i, "the buffer holds what was written")
        del buf
        most = max(most, torch.cuda.memory_reserved())
    torch.cuda.synchronize()
    check(most <= (4 << 30) + 64 * MIB, "reserved %d MiB passed the 4 GiB budget" % (most >> 20))
    stats = torch.cuda.memory_stats()
    return "16 fresh streams x 1 GiB: most reserved %d MiB (budget 4096), %d OOMs" % (
        most >> 20, stats.get("num_ooms", 0))


def scenario_profiler_shows_the_allocator():
    """Under torch.profiler the bridge's calls are ops of their own (gpualloc::malloc and
    gpualloc::free, with their host time), inside the ops that allocate: a user's profile
    says what the allocator costs."""
    gpu_alloc, torch = enabled()
    x = torch.ones(1024, device="cuda")
    activity = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[activity.CPU]) as prof:
        for _ in range(10):
            y = x * 2  # one output allocation a multiplication
            del y
        torch.cuda.synchronize()
    ops = {e.key: e for e in prof.key_averages()}
    check("gpualloc::malloc" in ops and "gpualloc::free" in ops,
          "allocator ops missing from the profile: %s" % sorted(ops)[:30])
    check(ops["gpualloc::malloc"].count >= 10 and ops["gpualloc::free"].count >= 10,
          "counts: malloc %d, free %d" % (ops["gpualloc::malloc"].count,
                                          ops["gpualloc::free"].count))
    return "profiled: %d mallocs (%.1f us each), %d frees (%.1f us each)" % (
        ops["gpualloc::malloc"].count,
        ops["gpualloc::malloc"].self_cpu_time_total / ops["gpualloc::malloc"].count,
        ops["gpualloc::free"].count,
        ops["gpualloc::free"].self_cpu_time_total / ops["gpualloc::free"].count)


def scenario_free_device_hint():
    """A free names to the library the device of its thread's last allocation
    (bridge_free_hint.h), asking the runtime only on a thread that has allocated nothing.
    A hint left wrong (as an allocation on another device leaves it, or naming a device
    this process never used) still frees the block on its own device, and a thread that
    never allocated frees what another made."""
    import threading

    gpu_alloc, torch = enabled()
    bridge = gpu_alloc._bridge
    keep = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    check(bridge.free_hint() == device,
          "after an allocation the hint is its device %d, not %d" % (device, bridge.free_hint()))
    base = torch.cuda.memory_allocated()
    for wrong in (device + 1, 63):
        t = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
        bridge.set_free_hint(wrong)
        del t
        check(torch.cuda.memory_allocated() == base,
              "a free named device %d: %d bytes still allocated over %d"
              % (wrong, torch.cuda.memory_allocated(), base))
    made = [torch.empty(MIB * (k + 1), dtype=torch.uint8, device="cuda") for k in range(4)]
    seen = []

    def free_them():
        seen.append(bridge.free_hint())
        made.clear()
        seen.append(bridge.free_hint())

    worker = threading.Thread(target=free_them)
    worker.start()
    worker.join()
    check(seen == [-1, device], "the freeing thread's hint went %s, not [-1, %d]" % (seen, device))
    check(torch.cuda.memory_allocated() == base, "a thread that never allocated left %d bytes"
          % (torch.cuda.memory_allocated() - base))
    stats = gpu_alloc.memory_stats()
    check(stats["allocation.all.current"] == 1, "one live block (keep), not %d"
          % stats["allocation.all.current"])
    del keep
    return "frees under hints %d and 63 and from a thread that never allocated: none left" % (
        device + 1)


def scenario_engine_per_stream():
    """engine_per_stream:True under PyTorch: four threads, each on its own stream, train a
    small model and free tensors the others made; the statistics are the device's (equal
    in PyTorch's view and ours, the peak of the sums), empty_cache reaches every engine,
    a snapshot renders, the memory fraction limits the streams together, and what needs
    one engine a device (here a run-time setting) fails with a message naming it."""
    return threads_train_and_free("engine_per_stream:True", own_streams=True)


def scenario_engine_per_thread():
    """engine_per_thread:True beside engine_per_stream:True: the same four threads all on
    one stream, so that each thread's allocations on it have an engine of their own (and
    backward's, on autograd's thread, another); the same checks."""
    return threads_train_and_free("engine_per_stream:True,engine_per_thread:True",
                                  own_streams=False)


def threads_train_and_free(config, own_streams):
    """Four threads train a small model on their own streams (or all on one) under
    `config` and free tensors the others made; then the checks of
    scenario_engine_per_stream."""
    import threading

    gpu_alloc, torch = enabled(config)
    handed, errors, lock = [], [], threading.Lock()
    start = threading.Barrier(4)
    shared = None if own_streams else torch.cuda.Stream()

    def work(seed):
        try:
            s = torch.cuda.Stream() if own_streams else shared
            with torch.cuda.stream(s):
                torch.manual_seed(seed)
                model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                            torch.nn.Linear(1024, 512)).cuda()
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
                start.wait()
                for _ in range(20):
                    loss = model(torch.randn(64, 512, device="cuda")).square().mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                keep = torch.full((4 * MIB,), seed, dtype=torch.uint8, device="cuda")
            s.synchronize()
            check(torch.isfinite(loss).item(), "loss is finite")
            with lock:
                handed.append(keep)
        except Exception as e:  # reported below: a thread's failure fails the scenario
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check(not errors, "threads failed: %s" % errors)
    check(sorted(int(t[0].item()) for t in handed) == [0, 1, 2, 3], "each thread's tensor kept")
    ours = gpu_alloc.memory_stats()
    theirs = torch.cuda.memory_stats()
    for k in ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
              "allocation.all.allocated", "segment.all.current"):
        check(theirs.get(k) == ours[k], "%s: torch %r, ours %r" % (k, theirs.get(k), ours[k]))
    check(ours["allocated_bytes.all.peak"] >= 4 * 4 * MIB, "the peak counts every thread's tensors")
    peak = ours["allocated_bytes.all.peak"]
    before = torch.cuda.memory_allocated()
    handed.clear()  # freed on this thread, made on the others' streams
    torch.cuda.synchronize()
    check(torch.cuda.memory_allocated() == before - 4 * 4 * MIB,
          "freed: %d bytes allocated, %d before" % (torch.cuda.memory_allocated(), before))
    reserved = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    check(torch.cuda.memory_reserved() < reserved, "empty_cache reached the engines")
    snap = torch.cuda.memory_snapshot()
    check(isinstance(snap, list), "memory_snapshot renders")
    # The memory fraction is one limit for every stream's engine.
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 256 * MIB) / total)
    side = torch.cuda.Stream()
    a = torch.empty(160 * MIB, dtype=torch.uint8, device="cuda")
    try:
        with torch.cuda.stream(side):
            torch.empty(160 * MIB, dtype=torch.uint8, device="cuda")
        raise AssertionError("two streams passed the memory fraction together")
    except torch.cuda.OutOfMemoryError:
        pass
    del a
    with torch.cuda.stream(side):
        b = torch.empty(160 * MIB, dtype=torch.uint8, device="cuda")  # a's cache went back
    del b
    torch.cuda.set_per_process_memory_fraction(1.0)
    try:
        gpu_alloc.update_settings("max_split_size_mb:64")
        raise AssertionError("a run-time setting was accepted under engine_per_stream")
    except ValueError as e:  # the library's invalid-argument error, as for any bad setting
        check("engine_per_stream" in str(e), str(e))
    return "4 threads on %s trained and freed each other's tensors; " \
        "peak %d MiB, stats equal, empty_cache, snapshot and the fraction served" % (
            "their own streams" if own_streams else "one stream", peak >> 20)


def scenario_late_enable():
    import torch
    import gpu_alloc

    torch.ones(1, device="cuda")
    try:
        gpu_alloc.enable()
    except gpu_alloc.GpuAllocError as e:
        check("before the first CUDA allocation" in str(e), str(e))
        return "late enable refused clearly"
    raise AssertionError("enable() after CUDA use did not raise")


SCENARIOS = {
    name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")
}


if __name__ == "__main__":
    sys.exit(scenarios.main(__file__, SCENARIOS, sys.argv[1:]))
