"""GPU scenario: the snapshot readers' limits leave room for real snapshots. PyTorch's
own allocator records a small transformer's training steps with the heaviest history it
keeps (Python and C++ stacks on every entry, context="all"); the dumped pickle, and the
pickle gzip'd, must be read and advised on by the library, not refused by the reader's
budget (8 units of values per pickle byte) or gzip limit (32 times the file, and 64 KiB).

    GPUALLOC_SO=target/release/liballoc_ffi.so python3 python/tests/gpu_scenarios/snapshot_budget.py

Prints "RESULT <summary>" with the pickle's size, its gzip ratio and the time advise took,
and exits 0, or raises (non-zero exit).
"""
import gzip
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # python/, for gpu_alloc


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def record(torch, path):
    """Three training steps of a small transformer, recorded with every stack."""
    torch.cuda.memory._record_memory_history(max_entries=100000, context="all", stacks="all")
    layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=4).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for step in range(3):
        x = torch.randn(16, 128 + 32 * step, 256, device="cuda")
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)


def main():
    import torch

    import gpu_alloc

    so = os.environ.get("GPUALLOC_SO")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "transformer.pickle")
        record(torch, path)
        with open(path, "rb") as f:
            data = f.read()
        packed = gzip.compress(data)
        ratio = len(data) / len(packed)
        check(ratio < 32, "the snapshot gzips %.1f:1, past the inflation limit" % ratio)
        gz_path = path + ".gz"
        with open(gz_path, "wb") as f:
            f.write(packed)
        t0 = time.perf_counter()
        advice = gpu_alloc.advise(path, so_path=so)
        took = time.perf_counter() - t0
        check(advice.get("recommended_setting"), "no recommendation: %s" % advice)
        again = gpu_alloc.advise(gz_path, so_path=so)
        check(again["recommended_setting"] == advice["recommended_setting"], "gzip'd differs")
    print(
        "RESULT snapshot with Python and C++ stacks: %d bytes, gzip %.1f:1, advised in %.1f s "
        "(recommended %s); the gzip'd file too"
        % (len(data), ratio, took, advice["recommended_setting"])
    )


if __name__ == "__main__":
    main()
