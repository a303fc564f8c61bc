"""GPU scenarios of sleep and wake through PyTorch (gpu_alloc.region / pause / resume over the
C++ bridge). Run by python/tests/gpu_torch.py, one process per case:

    GPUALLOC_SO=target/release/liballoc_ffi.so python3 python/tests/gpu_torch.py \\
        sleep_region sleep_host_backup sleep_cuda_graph

region():      tensors made in a region live in the tag's pool; pause gives their memory back
               (cuMemGetInfo), allocating in the paused tag raises, frees are fine, double pause
               and resuming an unknown or running tag raise; resume keeps every address; untagged
               memory (expandable_segments + unmap_free_pages) is untouched; stats and snapshots
               show the tag.
host_backup(): a model's weights made in a region with enable_cpu_backup come back intact after
               pause and resume, its output equals the one before; a second cycle pins no new
               host memory; pinned_empty() gives a pinned tensor from the same cache.
cuda_graph():  a CUDA graph captured into the tag's pool (gpu_alloc.cuda_graph) replays equal to
               eager after pause and resume with host backup, and after a pause without backup
               once the weights are loaded again.
Each returns a one-line summary or raises.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # python/, for gpu_alloc

MIB = 1 << 20


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def enabled(config=None):
    import gpu_alloc

    gpu_alloc.enable(config, bridge=True)
    import torch

    check(gpu_alloc.uses_bridge(), "the bridge is installed")
    return gpu_alloc, torch


def tag_info(gpu_alloc, name):
    found = [t for t in gpu_alloc.tags() if t["name"] == name]
    check(len(found) == 1, "tag %r listed once: %s" % (name, gpu_alloc.tags()))
    return found[0]


def raises(exc, words, fn):
    """Calls fn(); checks that it raises exc with every word of `words` in its message."""
    try:
        fn()
    except exc as e:
        for w in words:
            check(w in str(e), "%r lacks %r" % (str(e), w))
        return str(e)
    raise AssertionError("%s did not raise %s" % (fn, exc.__name__))


def region():
    gpu_alloc, torch = enabled("expandable_segments:True,unmap_free_pages:True")
    untagged = torch.full((64 * MIB // 4,), 2.0, device="cuda")
    with gpu_alloc.region("kv_cache"):
        kv = torch.full((256 * MIB // 4,), 3.0, device="cuda")
        small = torch.arange(1000, device="cuda", dtype=torch.float32)
    ptr_kv = kv.data_ptr()
    info = tag_info(gpu_alloc, "kv_cache")
    check(info["allocated_bytes"] >= 256 * MIB and not info["paused"], "tag: %s" % info)
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()

    gpu_alloc.pause("kv_cache")
    free1, _ = torch.cuda.mem_get_info()
    info = tag_info(gpu_alloc, "kv_cache")
    check(info["paused"] and info["backup"] == "none", "paused: %s" % info)
    check(info["paused_bytes"] >= 256 * MIB, "paused bytes: %s" % info)
    check(free1 - free0 >= info["paused_bytes"] - 2 * MIB,
          "cuMemGetInfo: %d more bytes free, %d paused" % (free1 - free0, info["paused_bytes"]))

    def alloc_in_paused_region():
        with gpu_alloc.region("kv_cache"):
            torch.empty(1024, device="cuda")

    paused_msg = raises(RuntimeError, ['"kv_cache" is paused'], alloc_in_paused_region)
    raises(ValueError, ["already paused"], lambda: gpu_alloc.pause("kv_cache"))
    other = torch.full((32 * MIB // 4,), 1.0, device="cuda")  # untagged memory still works
    check(other.sum().item() == 32 * MIB // 4, "untagged allocation while paused")
    check(untagged.sum().item() == 2.0 * (64 * MIB // 4), "untagged contents untouched")
    del small  # a free into the paused tag
    snap = gpu_alloc.snapshot()
    tagged = [s for s in snap["segments"] if s.get("tag") == "kv_cache"]
    check(tagged and all(s.get("paused") for s in tagged), "snapshot: %s" % tagged[:1])

    gpu_alloc.resume("kv_cache")
    free2, _ = torch.cuda.mem_get_info()
    check(free1 - free2 >= info["paused_bytes"] - 2 * MIB, "cuMemGetInfo: memory taken again")
    check(kv.data_ptr() == ptr_kv, "same address after resume")
    kv.fill_(5.0)  # backup "none": contents undefined until written
    check(kv.sum().item() == 5.0 * (256 * MIB // 4), "writable after resume")
    raises(ValueError, ["not paused"], lambda: gpu_alloc.resume("kv_cache"))
    raises(ValueError, ['"nope" is unknown'], lambda: gpu_alloc.resume("nope"))
    with gpu_alloc.region("kv_cache"):
        again = torch.empty(1000, device="cuda")  # served from the tag's cache
    check(torch.cuda.memory_stats()["allocated_bytes.all.current"] > 256 * MIB, "torch stats")
    del kv, again
    return ("256 MiB tag paused: %d MiB back per cuMemGetInfo, taken again on resume at the "
            "same address; paused allocation refused: %s" % ((free1 - free0) // MIB,
                                                              paused_msg.splitlines()[0][:100]))


def host_backup():
    gpu_alloc, torch = enabled()
    torch.manual_seed(0)
    with gpu_alloc.region("weights", enable_cpu_backup=True):
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                    torch.nn.Linear(4096, 1024)).cuda()
        big = torch.randn(64 * MIB // 4, device="cuda")
    want = [p.detach().cpu().clone() for p in model.parameters()] + [big.cpu()]
    x = torch.randn(8, 1024, device="cuda")
    with torch.no_grad():
        y0 = model(x)
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    gpu_alloc.pause("weights")  # the region asked for a CPU backup
    free1, _ = torch.cuda.mem_get_info()
    info = tag_info(gpu_alloc, "weights")
    check(info["backup"] == "host" and info["backed_up_bytes"] >= 64 * MIB, "tag: %s" % info)
    check(free1 - free0 >= info["paused_bytes"] - 2 * MIB, "memory given back")
    hs = gpu_alloc.host_stats()
    check(hs["allocated_bytes"] >= info["backed_up_bytes"], "backup in the pinned host allocator: %s" % hs)
    gpu_alloc.resume("weights")
    got = [p.detach().cpu() for p in model.parameters()] + [big.cpu()]
    check(all(torch.equal(a, b) for a, b in zip(want, got)), "contents intact after resume")
    with torch.no_grad():
        y1 = model(x)
    check(torch.equal(y0, y1), "the model computes the same output")
    allocs = gpu_alloc.host_stats()["host_allocs"]
    gpu_alloc.pause("weights")
    gpu_alloc.resume("weights")
    hs = gpu_alloc.host_stats()
    check(hs["host_allocs"] == allocs, "a second cycle pinned new memory: %s" % hs)
    check(torch.equal(big.cpu(), want[-1]), "intact after a second cycle")

    staging = gpu_alloc.pinned_empty(16 * MIB)
    check(staging.is_pinned(), "pinned_empty() is pinned memory")
    staging.fill_(7)
    on_gpu = staging.to("cuda", non_blocking=True)
    gpu_alloc.host_record_stream(staging.data_ptr(), torch.cuda.current_stream())
    torch.cuda.synchronize()
    check(on_gpu.sum().item() == 7 * 16 * MIB, "a non_blocking copy from pinned_empty()")
    del staging
    return ("%d MiB of weights paused with host backup (%d MiB back per cuMemGetInfo) and "
            "restored bit for bit; second cycle reused the pinned blocks (%d host allocs); "
            "pinned host allocator %s"
            % (info["backed_up_bytes"] // MIB, (free1 - free0) // MIB, allocs,
               {k: hs[k] for k in ("cache_hits", "reserved_bytes")}))


def cuda_graph():
    gpu_alloc, torch = enabled("expandable_segments:True")
    torch.manual_seed(0)
    with gpu_alloc.region("rollout", enable_cpu_backup=True):
        model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                    torch.nn.Linear(2048, 512)).cuda()
        static_in = torch.randn(64, 512, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), gpu_alloc.cuda_graph(graph, tag="rollout"):
        static_out = model(static_in)
    params = sum(p.numel() * 4 for p in model.parameters())
    check(tag_info(gpu_alloc, "rollout")["allocated_bytes"] > params, "the graph's memory is tagged")

    def replay_equals_eager(what):
        x = torch.randn(64, 512, device="cuda")
        static_in.copy_(x)
        graph.replay()
        with torch.no_grad():
            eager = model(x)
        torch.cuda.synchronize()
        diff = (static_out - eager).abs().max().item()
        check(diff == 0.0, "%s: replay differs from eager by %g" % (what, diff))

    replay_equals_eager("before pause")
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    gpu_alloc.pause("rollout")
    free1, _ = torch.cuda.mem_get_info()
    gpu_alloc.resume("rollout")
    replay_equals_eager("after a host-backed pause")

    weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    gpu_alloc.pause("rollout", backup="none")
    gpu_alloc.resume("rollout")
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(weights[k])  # contents were dropped: load the weights again
    replay_equals_eager("after a pause without backup, weights reloaded")
    return ("graph in tag 'rollout' replays equal to eager after pause/resume (host backup, "
            "%d MiB given back) and after a no-backup pause once the weights are reloaded"
            % ((free1 - free0) // MIB))
