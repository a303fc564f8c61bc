"""Colocation on one GPU, as reinforcement-learning post-training runs it: a rollout model
(generation with a KV cache, the decode step captured as a CUDA graph) and the training step of
a second model take turns. With sleep and wake the idle side's memory is paused (rollout
weights and trainer state with a host backup, the KV cache and the graph's memory without) and
resumed at the same addresses, so the graph replays; without, everything stays resident.

    GPUALLOC_SO=gpu-bundle/lib/liballoc_ffi.so python3 benchmarks/sleep_wake/colocation.py \\
        [--iterations 4] [--modes sleep,resident,torch] [--out FILE] [model sizes, see --help]

Modes, each in a process of its own: "sleep" (gpualloc, pause and resume at every switch),
"resident" (gpualloc, the same regions, never paused) and "torch" (PyTorch's own allocator,
resident, the reference outputs). Each mode prints one JSON object; then a summary compares
them: device memory peak (cuMemGetInfo sampled every millisecond by a thread, and the
allocator's peak reserved bytes), whether the generated tokens and the training losses equal
those of the runs that never pause (bit for bit), and median times of the rollout phase, the
training step and the switch (pauses and resumes) over the iterations after the first.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "python"))

GIB = 1 << 30


class PeakSampler:
    """Highest device memory in use (cuMemGetInfo: total - free), sampled every `period`
    seconds by a thread, and at every explicit sample() call."""

    def __init__(self, torch, period=0.001):
        self.torch, self.period = torch, period
        self.peak, self.stop_flag = 0, False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def sample(self):
        free, total = self.torch.cuda.mem_get_info()
        self.peak = max(self.peak, total - free)
        return total - free

    def _run(self):
        while not self.stop_flag:
            self.sample()
            time.sleep(self.period)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_flag = True
        self.thread.join()


def build_rollout(torch, a):
    """A decoder-only transformer in bf16 with a static KV cache, and its decode step."""
    nn, F = torch.nn, torch.nn.functional
    d, h, layers = a.rollout_width, a.heads, a.rollout_layers
    hd = d // h
    kw = dict(device="cuda", dtype=torch.bfloat16)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d, **kw), nn.LayerNorm(d, **kw)
            self.qkv = nn.Linear(d, 3 * d, bias=False, **kw)
            self.proj = nn.Linear(d, d, bias=False, **kw)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d, **kw), nn.Linear(4 * d, d, **kw)

        def step(self, x, k_cache, v_cache, pos, mask):
            b = x.shape[0]
            q, k, v = self.qkv(self.ln1(x)).view(b, 3, h, hd).unbind(1)
            k_cache.index_copy_(2, pos, k.unsqueeze(2))
            v_cache.index_copy_(2, pos, v.unsqueeze(2))
            att = torch.einsum("bhd,bhtd->bht", q, k_cache) * hd ** -0.5
            att = att.masked_fill(~mask, float("-inf")).softmax(-1)
            o = torch.einsum("bht,bhtd->bhd", att, v_cache).reshape(b, d)
            x = x + self.proj(o)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    torch.manual_seed(1)
    emb = nn.Embedding(a.vocab, d, **kw)
    blocks = nn.ModuleList(Block() for _ in range(layers))
    ln_f, head = nn.LayerNorm(d, **kw), nn.Linear(d, a.vocab, bias=False, **kw)
    return emb, blocks, ln_f, head


class Rollout:
    """Generation with a KV cache; the decode step is one CUDA graph (prefill included, one
    token at a time, greedy)."""

    def __init__(self, torch, a, weights_region, cache_region, graph_ctx):
        self.torch, self.a = torch, a
        with weights_region():
            self.emb, self.blocks, self.ln_f, self.head = build_rollout(torch, a)
        hd = a.rollout_width // a.heads
        with cache_region():
            shape = (a.batch, a.heads, a.max_len, hd)
            self.k = [torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
                      for _ in range(a.rollout_layers)]
            self.v = [torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
                      for _ in range(a.rollout_layers)]
            self.positions = torch.arange(a.max_len, device="cuda")
            self.tok = torch.zeros(a.batch, dtype=torch.long, device="cuda")
            self.pos = torch.zeros(1, dtype=torch.long, device="cuda")
            self.next_tok = torch.zeros(a.batch, dtype=torch.long, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), graph_ctx(self.graph):
            self._step()

    def _step(self):
        mask = self.positions <= self.pos
        x = self.emb(self.tok)
        for i, blk in enumerate(self.blocks):
            x = blk.step(x, self.k[i], self.v[i], self.pos, mask)
        self.next_tok.copy_(self.head(self.ln_f(x)).argmax(-1))

    def generate(self, seed):
        """Greedy tokens [gen, batch] for a random prompt of `seed`."""
        torch, a = self.torch, self.a
        # The cache region is resumed without backup: its bytes are undefined, so
        # everything in it is initialised again (the caches, and the positions the
        # graph's mask reads).
        for c in self.k + self.v:
            c.zero_()
        torch.arange(a.max_len, out=self.positions)
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, a.vocab, (a.batch, a.prompt), generator=g).cuda()
        out = []
        for t in range(a.prompt + a.gen - 1):
            self.pos.fill_(t)
            self.tok.copy_(prompt[:, t] if t < a.prompt else self.next_tok)
            self.graph.replay()
            if t >= a.prompt - 1:
                out.append(self.next_tok.clone())
        return torch.stack(out).cpu()


class Trainer:
    """A fp32 MLP regression model with AdamW: one step per turn."""

    def __init__(self, torch, a, region):
        self.torch, self.a, self.region = torch, a, region
        nn = torch.nn
        torch.manual_seed(2)
        with region():
            layers = []
            for _ in range(a.train_layers):
                layers += [nn.Linear(a.train_width, 4 * a.train_width, device="cuda"), nn.GELU(),
                           nn.Linear(4 * a.train_width, a.train_width, device="cuda")]
            self.model = nn.Sequential(*layers)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, seed):
        torch, a = self.torch, self.a
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(a.train_tokens, a.train_width, generator=g)
        y = torch.randn(a.train_tokens, a.train_width, generator=g)
        with self.region():  # activations and optimizer states in the trainer's tag
            x, y = x.cuda(), y.cuda()
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            value = loss.item()
            del x, y, loss
        return value


def child(mode, a):
    if mode in ("sleep", "resident"):
        import gpu_alloc

        gpu_alloc.enable(a.conf, bridge=True)
    import contextlib

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    sleep = mode == "sleep"
    if mode == "torch":
        def region(tag, backup):
            return contextlib.nullcontext

        # thread_local: the sampler thread's cuMemGetInfo may not break the capture.
        def graph_ctx(g):
            return torch.cuda.graph(g, capture_error_mode="thread_local")
    else:
        def region(tag, backup):
            return lambda: gpu_alloc.region(tag, enable_cpu_backup=backup)

        def graph_ctx(g):
            return gpu_alloc.cuda_graph(g, tag="kv_cache", capture_error_mode="thread_local")

    def pause(*tags):
        if sleep:
            for t in tags:
                gpu_alloc.pause(t)

    def resume(*tags):
        if sleep:
            for t in tags:
                gpu_alloc.resume(t)

    def stats():
        if mode == "torch":
            return torch.cuda.max_memory_reserved()
        return gpu_alloc.max_memory_reserved()

    tokens, losses, times = [], [], []
    with PeakSampler(torch) as peak:
        t0 = time.perf_counter()
        trainer = Trainer(torch, a, region("trainer", True))
        pause("trainer")
        rollout = Rollout(torch, a, region("rollout_weights", True), region("kv_cache", False),
                          graph_ctx)
        setup_s = time.perf_counter() - t0
        for it in range(a.iterations):
            times.append({})
            t0 = time.perf_counter()
            if it > 0:
                resume("rollout_weights", "kv_cache")
            t1 = time.perf_counter()
            tokens.append(rollout.generate(seed=100 + it))
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            pause("kv_cache", "rollout_weights")
            resume("trainer")
            t3 = time.perf_counter()
            losses.append(trainer.step(seed=200 + it))
            torch.cuda.synchronize()
            t4 = time.perf_counter()
            pause("trainer")
            t5 = time.perf_counter()
            peak.sample()
            times[-1] = {"rollout_s": t2 - t1, "train_s": t4 - t3,
                         "switch_s": (t1 - t0) + (t3 - t2) + (t5 - t4)}
    result = {
        "mode": mode,
        "config": a.conf if mode != "torch" else "pytorch",
        "device_peak_bytes": peak.peak,
        "allocator_peak_reserved_bytes": stats(),
        "setup_s": setup_s,
        "iterations": times,
        "tokens": [t.tolist() for t in tokens],
        "losses": losses,
    }
    if mode != "torch":
        result["tags"] = gpu_alloc.tags()
        result["pinned_pool"] = gpu_alloc.host_stats()
    print("RESULT " + json.dumps(result), flush=True)


def summarize(results):
    ref = next((r for r in results if r["mode"] == "torch"), None) or next(
        (r for r in results if r["mode"] == "resident"), None)
    rows = []
    for r in results:
        warm = r["iterations"][1:] or r["iterations"]
        row = {
            "mode": r["mode"],
            "device_peak_gib": r["device_peak_bytes"] / GIB,
            "allocator_peak_reserved_gib": r["allocator_peak_reserved_bytes"] / GIB,
            "rollout_s": statistics.median(i["rollout_s"] for i in warm),
            "train_s": statistics.median(i["train_s"] for i in warm),
            "switch_s": statistics.median(i["switch_s"] for i in warm),
        }
        if ref is not None:
            row["tokens_equal_to_" + ref["mode"]] = r["tokens"] == ref["tokens"]
            row["losses_equal_to_" + ref["mode"]] = r["losses"] == ref["losses"]
            row["max_loss_diff"] = max(abs(x - y) for x, y in zip(r["losses"], ref["losses"]))
        rows.append(row)
    by_mode = {r["mode"]: r for r in rows}
    if "sleep" in by_mode and "resident" in by_mode:
        s, res = by_mode["sleep"], by_mode["resident"]
        by_mode["sleep"]["device_peak_vs_resident"] = s["device_peak_gib"] / res["device_peak_gib"]
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="sleep,resident,torch")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--conf", default="expandable_segments:True",
                    help="gpualloc configuration of the sleep and resident modes")
    ap.add_argument("--rollout-width", type=int, default=4096)
    ap.add_argument("--rollout-layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--train-width", type=int, default=4096)
    ap.add_argument("--train-layers", type=int, default=8)
    ap.add_argument("--train-tokens", type=int, default=4096)
    ap.add_argument("--out", help="also write the results as JSON here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a)
    passthrough = [x for x in sys.argv[1:]]
    results, failed = [], []
    for mode in a.modes.split(","):
        cmd = [sys.executable, __file__, "--child", mode] + passthrough
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
        if r.returncode != 0 or not lines:
            tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
            failed.append({"mode": mode, "failed": "exit %d: %s" % (r.returncode, " | ".join(tail))})
            print(json.dumps(failed[-1]), flush=True)
            continue
        res = json.loads(lines[-1][len("RESULT "):])
        shown = {k: v for k, v in res.items() if k != "tokens"}
        print(json.dumps(shown), flush=True)
        results.append(res)
    summary = summarize(results) if results else []
    print(json.dumps({"summary": summary, "failed": failed}, indent=1), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"results": results, "summary": summary, "failed": failed}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
