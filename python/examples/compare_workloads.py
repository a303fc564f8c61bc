"""Real workloads under PyTorch's allocator and under gpualloc, same seeds, one process
each (run on a machine with a GPU):

    GPUALLOC_SO=target/release/liballoc_ffi.so python3 python/examples/compare_workloads.py \
        [gpt2_train,resnet50_train] [torch,gpualloc,gpualloc:policy:size-class]

Per workload and allocator: the losses, the median step time (steps 2..n: the first
includes cuBLAS / cuDNN set-up), peak reserved bytes (torch.cuda.memory_stats under
PyTorch's allocator, gpu_alloc.memory_stats under gpualloc), and the peak of device memory
in use as cuMemGetInfo reports it (torch.cuda.mem_get_info, sampled after every step:
includes the CUDA context and library workspaces, so it is the cross-check, not the figure
to compare with the allocators' own).
"""
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def run(workload, alloc):
    if alloc.startswith("gpualloc"):
        import gpu_alloc

        conf = alloc.split(":", 1)[1] if ":" in alloc else None
        gpu_alloc.enable(conf)
    import torch

    torch.manual_seed(0)
    random.seed(0)
    dev = "cuda"
    free0, total = torch.cuda.mem_get_info()
    used_peak = 0
    losses, times = [], []

    def step_done(t, loss):
        nonlocal used_peak
        torch.cuda.synchronize()
        times.append(time.time() - t)
        losses.append(round(loss.item(), 6))
        free, _ = torch.cuda.mem_get_info()
        used_peak = max(used_peak, total - free)

    if workload == "resnet50_train":
        import torchvision

        m = torchvision.models.resnet50().to(dev)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for _ in range(6):
            t = time.time()
            x = torch.randn(64, 3, 224, 224, device=dev)
            y = torch.randint(0, 1000, (64,), device=dev)
            loss = torch.nn.functional.cross_entropy(m(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step_done(t, loss)
    elif workload == "gpt2_train":
        from transformers import GPT2Config, GPT2LMHeadModel

        m = GPT2LMHeadModel(GPT2Config()).to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        for _ in range(6):
            t = time.time()
            ids = torch.randint(0, 50257, (8, 1024), device=dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(input_ids=ids, labels=ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step_done(t, loss)
    else:
        raise SystemExit("unknown workload " + workload)

    if alloc.startswith("gpualloc"):
        import gpu_alloc

        st = gpu_alloc.memory_stats()
    else:
        st = torch.cuda.memory_stats()
    keys = ["allocated_bytes.all.peak", "reserved_bytes.all.peak", "requested_bytes.all.peak",
            "num_device_alloc", "num_alloc_retries"]
    res = {k: st.get(k) for k in keys}
    res.update(workload=workload, alloc=alloc, losses=losses,
               step_s=[round(v, 4) for v in times],
               median_step_s=round(statistics.median(times[1:]), 4),
               device_used_peak=used_peak, device_used_at_start=total - free0)
    print("RESULT " + json.dumps(res))


def main():
    workloads = (sys.argv[1] if len(sys.argv) > 1 else "gpt2_train,resnet50_train").split(",")
    allocs = (sys.argv[2] if len(sys.argv) > 2 else "torch,gpualloc").split(",")
    results = []
    for w in workloads:
        for a in allocs:
            r = subprocess.run([sys.executable, __file__, "--child", w, a],
                               capture_output=True, text=True, timeout=300)
            line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
            if r.returncode != 0 or not line:
                print("FAILED", w, a, r.returncode, r.stderr[-1500:], flush=True)
                continue
            res = json.loads(line[-1][7:])
            results.append(res)
            gib = lambda v: "%.3f" % (v / 2**30) if isinstance(v, int) else str(v)
            print("%-15s %-28s median_step=%.1f ms reserved_peak=%s GiB allocated_peak=%s GiB "
                  "device_used_peak=%s GiB dev_allocs=%s losses=%s" % (
                      w, a, res["median_step_s"] * 1e3, gib(res["reserved_bytes.all.peak"]),
                      gib(res["allocated_bytes.all.peak"]), gib(res["device_used_peak"]),
                      res["num_device_alloc"], res["losses"]), flush=True)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "compare_workloads.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        run(sys.argv[2], sys.argv[3])
    else:
        main()
