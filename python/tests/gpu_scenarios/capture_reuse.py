"""GPU scenario: graph_capture_record_stream_reuse. During a CUDA graph capture, a tensor
that another stream used (record_stream) and that is freed gives its block back to the
capturing stream once the graph joins the other stream into it, never before, as with
PyTorch's allocator (the steps of PyTorch's TestMemPool.test_graph_capture_reclaim_2_streams
and _4_streams, with the data checked after a replay).

    GPUALLOC_SO=target/release/liballoc_ffi.so python3 python/tests/gpu_scenarios/capture_reuse.py

The option is turned on through $GPUALLOC_CONF in this process (added to what it holds);
with GPU_TORCH_REFERENCE=1 the same steps run under PyTorch's allocator with the option
set by torch.cuda.memory._set_allocator_settings. The other streams sleep on the GPU
before reading the freed tensor while the capturing stream writes the tensor allocated
before the join: a block reused too early would show in what they read. Prints
"RESULT <summary>" and exits 0, or raises (non-zero exit).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # python/, for gpu_alloc

OPTION = "graph_capture_record_stream_reuse:True"
SLEEP_CYCLES = 50_000_000  # tens of milliseconds of GPU time


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def enable():
    if os.environ.get("GPU_TORCH_REFERENCE") == "1":
        import torch

        torch.cuda.memory._set_allocator_settings(OPTION)
        return torch
    os.environ["GPUALLOC_CONF"] = ",".join(filter(None, [os.environ.get("GPUALLOC_CONF"), OPTION]))
    import gpu_alloc

    gpu_alloc.enable(bridge=True)
    check(gpu_alloc.uses_bridge(), "bridge installed")
    import torch

    return torch


def end_after_join(torch, g, label, data1_ptr, data2):
    """On the capturing stream after the (last) join: allocates and writes data3, ends the
    capture, replays it and checks that data3, not data2, got data1's block."""
    data3 = torch.empty(8, device="cuda")
    data3.fill_(7.0)
    g.capture_end()
    g.replay()
    torch.cuda.synchronize()
    check(data2.data_ptr() != data1_ptr, "%s: data1's block reused before the join" % label)
    check(data3.data_ptr() == data1_ptr, "%s: data1's block not reused after the join" % label)
    check(torch.equal(data3, torch.full((8,), 7.0, device="cuda")), "%s: data3 %s" % (label, data3.tolist()))


def two_streams(torch):
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        g.capture_begin()
        sink1 = torch.empty(8, device="cuda")
        data1 = torch.full((8,), 1.0, device="cuda")
        data1_ptr = data1.data_ptr()
        s2.wait_stream(s1)  # fork
        with torch.cuda.stream(s2):
            torch.cuda._sleep(SLEEP_CYCLES)
            buf2 = data1 + 2.0
            data1.record_stream(s2)
        del data1
        data2 = torch.empty(8, device="cuda")  # before the join
        data2.fill_(100.0)  # runs while s2 may still read data1
        s1.wait_stream(s2)  # join
        sink1.copy_(buf2)
        end_after_join(torch, g, "2 streams", data1_ptr, data2)
    check(torch.equal(buf2, torch.full((8,), 3.0, device="cuda")),
          "2 streams: s2 read %s, expected 3s" % buf2.tolist())
    check(torch.equal(sink1, buf2), "2 streams: the join ordered s1 after s2")
    return "2 streams: data1 reused by data3 after the join, not by data2 before it"


def four_streams(torch):
    s1, s2, s3, s4 = (torch.cuda.Stream() for _ in range(4))
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        g.capture_begin()
        data1 = torch.ones(8, device="cuda")
        data1_ptr = data1.data_ptr()
        sink1 = torch.empty_like(data1)
        sink3 = torch.empty_like(data1)
        bufs = []
        for k, s in ((2, s2), (3, s3), (4, s4)):
            s.wait_stream(s1)
            with torch.cuda.stream(s):
                torch.cuda._sleep(SLEEP_CYCLES)
                bufs.append(data1 + float(k))
                data1.record_stream(s)
        del data1
        s1.wait_stream(s2)  # partial joins: s2 into s1, s4 into s3
        sink1.fill_(1.0)
        s3.wait_stream(s4)
        with torch.cuda.stream(s3):
            sink3.fill_(3.0)
            sink3.record_stream(s3)
        data2 = torch.empty(8, device="cuda")  # s3 and s4 not joined into s1 yet
        data2.fill_(100.0)
        s1.wait_stream(s3)  # the final join
        sink1.add_(sink3)
        end_after_join(torch, g, "4 streams", data1_ptr, data2)
    for k, buf in zip((2, 3, 4), bufs):
        check(torch.equal(buf, torch.full((8,), 1.0 + k, device="cuda")),
              "4 streams: stream %d read %s" % (k, buf.tolist()))
    check(torch.equal(sink1, torch.full((8,), 4.0, device="cuda")), "4 streams: sink1 %s" % sink1.tolist())
    return "4 streams: reused only after the final join"


def run():
    torch = enable()
    return "%s; %s" % (two_streams(torch), four_streams(torch))


if __name__ == "__main__":
    print("RESULT " + run())
