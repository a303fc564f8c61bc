#!/usr/bin/env python3
"""FSDP training memory under PyTorch's allocator and under gpualloc (issue 7).

One run = one allocator setting x one FSDP variant x one model shape, one process per GPU:

    GPUALLOC_SO=$PWD/target/release/liballoc_ffi.so \\
    torchrun --nproc-per-node 2 benchmarks/fsdp/fsdp_bench.py \\
        --setting ours --fsdp fsdp2 --shape gpt2-medium --steps 30 --out out/fsdp

Settings (the script sets / clears the variables itself, before importing torch, so a
stray PYTORCH_CUDA_ALLOC_CONF in the caller's environment cannot taint a run):
    torch             PyTorch's caching allocator, defaults
    torch-avoid-rs    TORCH_NCCL_AVOID_RECORD_STREAMS=1
    torch-expandable  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    ours              gpu_alloc.enable()
    ours-streamwait   gpu_alloc.enable("stream_wait_reuse:true")
    ours-expandable   gpu_alloc.enable("expandable_segments:True")
    ours-unmap        gpu_alloc.enable("expandable_segments:True,unmap_free_pages:true")
    ours-streamwait-unmap  the two above together
    ours-streamwait-over   the same, pages moved only past 1.03x the allocated peak
NCCL_NVLS_ENABLE=0 (NVLink multicast off) in every setting.

Model: a GPT-2-style decoder written here in plain torch (nn.Linear / LayerNorm /
scaled_dot_product_attention, tied embedding), random weights from a fixed seed (same on
every rank and setting), random tokens from torch.manual_seed(1234 + rank); bf16 autocast,
AdamW. FSDP2: fully_shard per block, then the root. FSDP1: FullyShardedDataParallel with one
unit per block, limit_all_gathers False (fsdp1) or True (fsdp1-limit).

The model is built on the CPU (random numbers drawn on the GPU and copied over, the GPU's
cache emptied afterwards) and moved to the GPU unit by unit by FSDP while it shards it.
Set-up (model build, sharding, optimizer) is not measured: after it the allocator's cache is
emptied and its peaks reset, so every setting starts training from the same state (the
set-up's figures are kept in the JSON: "setup", "after_setup"). Each step
is timed between two torch.cuda.synchronize(); after it the script reads the allocator's
figures (peaks per step: the peaks are reset after each reading) and the device's memory in
use (torch.cuda.mem_get_info: includes the CUDA context, NCCL buffers and cuBLAS workspaces).
Before the first step and after the last, `host_probe_us` times a small `torch.add(...,
out=)` (no allocation): the host's dispatch speed, which moves between runs of the same
setting, so that rounds.py can set each run's step beside its host's speed.

The allocator's figures come from torch.cuda.memory_stats() where it works; under a
pluggable allocator (no C++ bridge) it raises, and then gpu_alloc.memory_stats()
(same key names) is used. Under the ours-* settings gpu_alloc's figures are recorded too.

Output: DIR/runs/<setting>__<fsdp>__<shape>__rank<R>.json per rank (summary + per-step
records) and one line `RESULT {json}` per rank on stdout (the summary without the per-step
records and set-up figures). Exit status 1 if the run failed (the JSON then has "status": "error" and the error).

Does not import torch before the arguments are parsed (--help and run_all.py stay fast).
"""
import argparse
import collections
import gc
import inspect
import json
import math
import os
import random
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# Variables each setting controls: value to set, or None to clear.
CONTROLLED_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "TORCH_NCCL_AVOID_RECORD_STREAMS", "GPUALLOC_CONF")

# name -> (environment, gpu_alloc config: False = PyTorch's allocator, None = enable() defaults)
SETTINGS = {
    "torch": ({}, False),
    "torch-avoid-rs": ({"TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}, False),
    "torch-expandable": ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, False),
    "ours": ({}, None),
    "ours-streamwait": ({}, "stream_wait_reuse:true"),
    "ours-expandable": ({}, "expandable_segments:True"),
    # Not in the list: physical pages of free blocks serve growth.
    "ours-unmap": ({}, "expandable_segments:True,unmap_free_pages:true"),
    # Both: blocks held by other streams' events reused through stream waits, and free
    # pages' physical memory serving growth.
    "ours-streamwait-unmap": ({}, "stream_wait_reuse:true,expandable_segments:True,unmap_free_pages:true"),
    # The same, with pages moved only past 1.03x the allocated peak (the multi-stream target).
    "ours-streamwait-over": ({}, "stream_wait_reuse:true,expandable_segments:True,"
                                 "unmap_free_pages:true,memory_budget_over_allocated:1.03"),
    # The named settings: the least memory at every moment, the multi-stream setting (the
    # one above by its name), and pages moved only at the memory budget (the device's memory
    # by default).
    "ours-bound": ({}, "bound"),
    "ours-multi-stream": ({}, "multi-stream"),
    # multi-stream before it lent idle blocks across streams (the name of its first rounds
    # with marks).
    "ours-multi-stream-marked": ({}, "stream_wait_reuse:true,expandable_segments:True,"
                                     "unmap_free_pages:true,memory_budget_over_allocated:1.03,"
                                     "idle_mark_mb:512"),
    "ours-budget": ({}, "budget"),
    # multi-stream with 64 MiB pages: a page move is a driver call per physical
    # allocation, so four times fewer calls for the same bytes moved.
    "ours-multi-stream-64": ({}, "multi-stream,unmap_page_mb:64"),
}
FSDP_VARIANTS = ("fsdp2", "fsdp1", "fsdp1-limit")
SHAPES = {
    "gpt2-medium": dict(layers=24, d_model=1024, heads=16, vocab=50257, seq=1024, batch=8),
    "1.3b": dict(layers=24, d_model=2048, heads=16, vocab=50257, seq=1024, batch=1),
}
BASELINE_SETTING = "torch"
SKIP_STEPS = 2  # median step time over steps 3..N (the first ones include cuBLAS/NCCL set-up)


def is_ours(setting):
    return SETTINGS[setting][1] is not False


def run_name(setting, fsdp, shape):
    return "%s__%s__%s" % (setting, fsdp, shape)


def rank_file(out_dir, folder, ext, setting, fsdp, shape, rank):
    """OUT/<folder>/<run>__rank<r>.<ext>: one rank's file of a run."""
    return os.path.join(out_dir, folder, "%s__rank%d.%s" % (run_name(setting, fsdp, shape),
                                                            rank, ext))


def result_path(out_dir, setting, fsdp, shape, rank):
    return rank_file(out_dir, "runs", "json", setting, fsdp, shape, rank)


def snapshot_path(out_dir, setting, fsdp, shape, rank):
    return rank_file(out_dir, "snapshots", "pickle", setting, fsdp, shape, rank)


def record_history(torch, step, n_data, steps, path):
    """`steps` more steps (cycling through the `n_data` batches) with PyTorch's memory
    history on, without stacks (a snapshot of FSDP's steps stays a few MB); dumps it to
    `path` where given (rank 0) and returns what was recorded: steps, entries and the
    actions' counts on the current device."""
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python")
    try:
        for i in range(steps):
            step(i % n_data)
        snap = torch.cuda.memory._snapshot()
        if path:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.cuda.memory._dump_snapshot(path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    actions = dict(collections.Counter(e["action"] for e in trace))
    return {"steps": steps, "entries": len(trace), "actions": actions, "path": path}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", required=True, choices=sorted(SETTINGS))
    p.add_argument("--fsdp", required=True, choices=FSDP_VARIANTS)
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", required=True, help="output folder (JSON under OUT/runs/)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--model", choices=("plain", "hf"), default="plain",
                   help="plain: the decoder in this file (default); hf: transformers' "
                        "GPT2LMHeadModel with the same shape")
    p.add_argument("--bridge", choices=("auto", "on", "off"), default="auto",
                   help="ours-* settings, gpu_alloc versions with the C++ bridge: auto = "
                        "gpu_alloc.enable()'s default, on = bridge=True, off = bridge=False "
                        "(plain CUDAPluggableAllocator)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: gloo + CPU tensors, to test this script without a GPU")
    p.add_argument("--varlen", type=int, default=None, metavar="MIN",
                   help="draw each step's sequence length from [MIN, seq] (the same draws "
                        "under every setting) instead of using seq throughout")
    p.add_argument("--fake-world", type=int, default=None, metavar="N",
                   help="one process plays rank 0 of N over PyTorch's fake process group: "
                        "FSDP shards, gathers and reduces on its own streams as with N GPUs, "
                        "but no collective moves data (the gathered parameters hold whatever "
                        "the buffer held, so the loss is not checked). Measures the "
                        "allocator's part of the multi-stream pattern on one GPU")
    p.add_argument("--profile", type=int, default=None, metavar="N",
                   help="after the timed steps, N more under torch.profiler (CPU and CUDA), "
                        "summarised by benchmarks/budget's profile_steps into the summary's "
                        "'profile' (per step: wall and kernel time, the allocator's calls, "
                        "the operators with the most host time)")
    p.add_argument("--memory-history", type=int, default=None, metavar="N",
                   help="after the timed (and profiled) steps, N more with PyTorch's memory "
                        "history on (torch.cuda.memory._record_memory_history, no stacks), "
                        "dumped by rank 0 to OUT/snapshots/<run>__rank0.pickle: FSDP's "
                        "allocations, streams and cross-stream frees for `cargo xtask "
                        "replay` and `advise`")
    for k in ("layers", "d_model", "heads", "vocab", "seq", "batch"):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None,
                       help="override the shape's %s (tests)" % k)
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error("--steps must be >= 1")
    if a.profile is not None and a.profile < 1:
        p.error("--profile takes a number of steps, at least 1")
    if a.memory_history is not None and a.memory_history < 1:
        p.error("--memory-history takes a number of steps, at least 1")
    if a.memory_history and a.device == "cpu":
        p.error("--memory-history records the CUDA allocator's history: it needs a GPU")
    if a.fake_world is not None and a.fake_world < 2:
        p.error("--fake-world must be >= 2")
    if a.device == "cpu" and is_ours(a.setting):
        p.error("the ours-* settings need a GPU")
    return a


def apply_setting_env(setting, environ=None):
    """Sets / clears the variables of `setting` in `environ` (os.environ); returns the
    list of (variable, old, new) it changed, for the record."""
    environ = os.environ if environ is None else environ
    want = dict(SETTINGS[setting][0])
    want["NCCL_NVLS_ENABLE"] = "0"
    changed = []
    for var in CONTROLLED_ENV + ("NCCL_NVLS_ENABLE",):
        old, new = environ.get(var), want.get(var)
        if old == new:
            continue
        if new is None:
            del environ[var]
        else:
            environ[var] = new
        changed.append((var, old, new))
    return changed


def log(rank, msg):
    if rank == 0:
        print("[fsdp_bench] " + msg, flush=True)


# --------------------------------------------------------------------------------------
# Model (torch imported lazily: this module is imported by run_all.py without torch)


def build_plain_model(torch, cfg):
    nn, F = torch.nn, torch.nn.functional

    class Attention(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h = h
            self.c_attn = nn.Linear(d, 3 * d)
            self.c_proj = nn.Linear(d, d)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(x).split(c, dim=2)
            q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).reshape(b, t, c))

    class MLP(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.c_fc = nn.Linear(d, 4 * d)
            self.c_proj = nn.Linear(4 * d, d)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.ln_1 = nn.LayerNorm(d)
            self.attn = Attention(d, h)
            self.ln_2 = nn.LayerNorm(d)
            self.mlp = MLP(d)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self, c):
            super().__init__()
            d = c["d_model"]
            self.wte = nn.Embedding(c["vocab"], d)
            self.wpe = nn.Embedding(c["seq"], d)
            self.blocks = nn.ModuleList(Block(d, c["heads"]) for _ in range(c["layers"]))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, c["vocab"], bias=False)
            self.tie()

        def tie(self):
            self.lm_head.weight = self.wte.weight

        def forward(self, ids):
            pos = torch.arange(ids.shape[1], device=ids.device)
            x = self.wte(ids) + self.wpe(pos)
            for blk in self.blocks:
                x = blk(x)
            return self.lm_head(self.ln_f(x))

    # Built on the meta device, then materialised and initialised once (GPT-2's init:
    # N(0, 0.02), residual projections scaled by 1/sqrt(2 layers)), instead of nn's default
    # init followed by a second one.
    with torch.device("meta"):
        model = GPT(cfg)
    return model, Block


def init_plain_model(torch, model, cfg, rng_device):
    """Materialises `model` on the CPU and fills it with GPT-2's init (N(0, 0.02), residual
    projections scaled by 1/sqrt(2 layers), LayerNorm 1/0, biases 0). The random numbers are
    drawn on `rng_device` from a fixed seed (the same on every rank: FSDP2 does not
    broadcast) and copied over, one parameter at a time: drawing 1.3e9 normals on the CPU
    takes half a minute, on the GPU milliseconds. The model stays on the CPU until FSDP
    moves each unit to the GPU while sharding it, so no full copy of it is ever on the GPU."""
    model.to_empty(device="cpu")
    model.tie()
    g = torch.Generator(device=rng_device)
    g.manual_seed(0)
    proj_std = 0.02 / math.sqrt(2 * cfg["layers"])
    with torch.no_grad():
        for name, p in model.named_parameters():  # the tied weight once
            if name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                std = proj_std if name.endswith("c_proj.weight") else 0.02
                buf = torch.empty(p.shape, device=rng_device)
                buf.normal_(0.0, std, generator=g)
                p.copy_(buf)
                del buf
    return model


def build_model(torch, args, cfg, device):
    """(model on the CPU, block class, blocks)"""
    if args.model == "hf":
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        torch.manual_seed(0)
        conf = GPT2Config(vocab_size=cfg["vocab"], n_positions=cfg["seq"], n_embd=cfg["d_model"],
                          n_layer=cfg["layers"], n_head=cfg["heads"],
                          attn_implementation="sdpa")
        model = GPT2LMHeadModel(conf)  # CPU init: slow for the 1.3b shape
        model.config.use_cache = False
        return model, GPT2Block, list(model.transformer.h)
    model, block_cls = build_plain_model(torch, cfg)
    init_plain_model(torch, model, cfg, device)
    return model, block_cls, list(model.blocks)


def shard(torch, args, model, block_cls, blocks, device, world):
    if args.fsdp == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for blk in blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({block_cls}),
        device_id=device if device.type == "cuda" else None,
        limit_all_gathers=(args.fsdp == "fsdp1-limit"),
    )


# --------------------------------------------------------------------------------------
# Allocator figures


class AllocStats:
    """Reads the allocator's figures: torch.cuda.memory_stats() where it works, else
    gpu_alloc.memory_stats() (ours-* settings without the C++ bridge)."""

    # active bytes: allocated, plus freed blocks still awaiting other streams' events
    # (record_stream), which no allocator can hand out without a wait.
    KEYS = ("reserved_bytes.all.current", "reserved_bytes.all.peak",
            "allocated_bytes.all.current", "allocated_bytes.all.peak",
            "active_bytes.all.peak",
            "num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms")
    # gpu_alloc's cumulative counters of what stream ordering and page recycling cost:
    # host waits for the GPU, stream waits, events, page moves (ours-* settings).
    COUNTERS = ("stream_ops.recorded", "stream_ops.queried", "stream_ops.host_waits",
                "stream_ops.host_wait_ns", "stream_ops.stream_waits",
                "page_moves.rounds", "page_moves.pages_unmapped", "page_moves.pages_mapped",
                "page_moves.stream_waits", "page_moves.host_ns", "page_moves.blocks_lent",
                "num_sync_all_streams")

    def __init__(self, torch, device, gpu_alloc=None):
        self.torch, self.device, self.gpu_alloc = torch, device, gpu_alloc
        self.source = None
        self.torch_error = None
        if device.type != "cuda":
            self.source = "none"
            return
        try:
            s = torch.cuda.memory_stats(device)
            if "reserved_bytes.all.current" not in s:
                raise RuntimeError("torch.cuda.memory_stats() has no reserved_bytes.all.current")
            self.source = "torch"
        except Exception as e:  # pluggable allocator without the bridge
            self.torch_error = "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:200])
            if gpu_alloc is None:
                raise
            self.source = "gpu_alloc"

    def _pick(self, s):
        return {k: int(s.get(k, 0)) for k in self.KEYS}

    def read(self):
        """{'primary': {...}, 'gpu_alloc': {...} (ours-* settings only)}"""
        if self.source == "none":
            return {"primary": {k: 0 for k in self.KEYS}}
        if self.source == "torch":
            prim = self._pick(self.torch.cuda.memory_stats(self.device))
        else:
            prim = self._pick(self.gpu_alloc.memory_stats(self.device))
        out = {"primary": prim}
        if self.gpu_alloc is not None:
            ours = self.gpu_alloc.memory_stats(self.device)
            out["gpu_alloc"] = prim if self.source == "gpu_alloc" else self._pick(ours)
            out["counters"] = {k: int(ours.get(k, 0)) for k in self.COUNTERS}
        return out

    def reset_peaks(self):
        if self.source == "none":
            return
        if self.source == "torch":
            self.torch.cuda.reset_peak_memory_stats(self.device)
        if self.gpu_alloc is not None:
            self.gpu_alloc.reset_peak_memory_stats(self.device)

    def empty_cache(self):
        if self.source == "none":
            return
        self.torch.cuda.empty_cache()  # a no-op under a pluggable allocator without the bridge
        if self.gpu_alloc is not None:
            self.gpu_alloc.empty_cache(self.device)

    def device_used(self):
        if self.source == "none":
            return 0
        free, total = self.torch.cuda.mem_get_info(self.device)
        return int(total - free)


# --------------------------------------------------------------------------------------


def summarize(per_step, skip=SKIP_STEPS):
    """Peaks, median step time and losses from the per-step records."""
    def peak(key, sub="primary"):
        vals = [s[sub][key] for s in per_step if sub in s and s[sub].get(key) is not None]
        return max(vals) if vals else None

    times = [s["time_ms"] for s in per_step]
    timed = times[skip:] if len(times) > skip else times
    out = {
        "steps_done": len(per_step),
        "losses": [s["loss"] for s in per_step],
        "median_step_ms": round(statistics.median(timed), 3) if timed else None,
        "mean_step_ms": round(statistics.fmean(timed), 3) if timed else None,
        "stdev_step_ms": round(statistics.stdev(timed), 3) if len(timed) > 1 else None,
        "peak_reserved_bytes": peak("reserved_peak"),
        "peak_allocated_bytes": peak("allocated_peak"),
        "peak_device_used_bytes": max((s["device_used"] for s in per_step), default=None),
    }
    if per_step and "gpu_alloc" in per_step[0]:
        out["gpu_alloc_peak_reserved_bytes"] = peak("reserved_peak", "gpu_alloc")
        out["gpu_alloc_peak_allocated_bytes"] = peak("allocated_peak", "gpu_alloc")
    r, a = out["peak_reserved_bytes"], out["peak_allocated_bytes"]
    out["reserved_over_allocated"] = round(r / a, 4) if r and a else None
    # Peak active over peak allocated: the part of the gap that is blocks awaiting other
    # streams' events, the floor for an allocator that adds no waits.
    act = peak("active_peak")
    out["peak_active_bytes"] = act
    out["active_over_allocated"] = round(act / a, 4) if act and a else None
    counted = [s["counters"] for s in per_step[skip:] if "counters" in s]
    if counted:  # per timed step: what stream ordering and page recycling cost
        out["counters_per_step"] = {k: round(statistics.fmean(c[k] for c in counted), 2)
                                    for k in counted[0]}
    return out


def step_record(step, loss, time_ms, stats, before, device_used, previous=None):
    """One step's figures; counters as deltas from `before` (the end of set-up), and
    gpu_alloc's stream and page counters as this step's own (deltas from `previous`, the
    reading after the step before)."""
    rec = {"step": step, "loss": loss, "time_ms": round(time_ms, 3), "device_used": device_used}
    if "counters" in stats:
        base = (previous or before).get("counters", {})
        rec["counters"] = {k: v - base.get(k, 0) for k, v in stats["counters"].items()}
    for sub, s in stats.items():
        if sub == "counters":
            continue
        rec[sub] = {
            "reserved": s["reserved_bytes.all.current"],
            "reserved_peak": s["reserved_bytes.all.peak"],
            "allocated": s["allocated_bytes.all.current"],
            "allocated_peak": s["allocated_bytes.all.peak"],
            "active_peak": s["active_bytes.all.peak"],
            "num_device_alloc": s["num_device_alloc"] - before[sub]["num_device_alloc"],
            "num_device_free": s["num_device_free"] - before[sub]["num_device_free"],
            "num_alloc_retries": s["num_alloc_retries"] - before[sub]["num_alloc_retries"],
        }
    return rec


def host_probe(torch, device, sync, ops=2000, repeats=5):
    """Microseconds one `torch.add(x, y, out=z)` of small tensors on `device` takes, as the
    median of `repeats` timings of `ops` calls and a synchronization: the host's speed at
    dispatching and launching, with no allocation at all (`out=`), taken before and after
    the timed steps so that a run's step can be set beside the speed of its host."""
    x = torch.ones(256, device=device)
    y = torch.ones(256, device=device)
    z = torch.empty_like(x)
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(ops):
            torch.add(x, y, out=z)
        sync()
        times.append((time.perf_counter() - t0) * 1e6 / ops)
    return round(statistics.median(times), 3)


def write_json(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def main(argv=None):
    t_start = time.time()
    args = parse_args(argv)
    env_changed = apply_setting_env(args.setting)
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.fake_world:
        rank, local_rank, world = 0, 0, args.fake_world
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    cfg = dict(SHAPES[args.shape])
    for k in cfg:
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    for var, old, new in env_changed:
        if old is not None:
            log(rank, "setting %s: %s=%r (was %r)" % (args.setting, var, new, old))

    import torch
    import torch.distributed as dist

    gpu_alloc, alloc_info = None, {"allocator": "torch"}
    if is_ours(args.setting):
        # Before anything that touches CUDA (set_device, init_process_group, the model).
        sys.path.insert(0, os.path.join(REPO, "python"))
        import gpu_alloc

        conf = SETTINGS[args.setting][1]
        kwargs = {}
        if args.bridge != "auto":
            if "bridge" not in inspect.signature(gpu_alloc.enable).parameters:
                raise SystemExit("--bridge %s: this gpu_alloc has no bridge option" % args.bridge)
            kwargs["bridge"] = args.bridge == "on"
        gpu_alloc.enable(conf, **kwargs)
        alloc_info = {"allocator": "gpualloc", "config": conf,
                      "library": gpu_alloc.library_path(), "version": gpu_alloc.version(),
                      "bridge": bool(getattr(gpu_alloc, "uses_bridge", lambda: False)())}
    t_import = time.time()

    if args.fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        device = torch.device(args.device, 0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    elif args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    t_pg = time.time()

    summary = {
        "setting": args.setting, "fsdp": args.fsdp, "shape": args.shape, "rank": rank,
        "world_size": world, "fake_world": bool(args.fake_world), "steps": args.steps, "model": args.model, "shape_config": cfg,
        "torch_version": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "env": {k: os.environ.get(k) for k in CONTROLLED_ENV + ("NCCL_NVLS_ENABLE",)},
        **alloc_info,
    }
    path = result_path(args.out, args.setting, args.fsdp, args.shape, rank)
    per_step = []
    status, error = "ok", None
    try:
        stats = AllocStats(torch, device, gpu_alloc)
        summary["stats_source"] = stats.source
        if stats.torch_error:
            summary["torch_memory_stats_error"] = stats.torch_error

        model, block_cls, blocks = build_model(torch, args, cfg, device)
        stats.empty_cache()  # the init's temporaries: nothing of the model is on the GPU
        model = shard(torch, args, model, block_cls, blocks, device, world)
        forward = (lambda ids: model(input_ids=ids).logits) if args.model == "hf" else model
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        torch.manual_seed(1234 + rank)
        lengths = [cfg["seq"]] * args.steps
        if args.varlen:
            draw = random.Random(4321)  # the same lengths under every setting and rank
            lengths = [draw.randint(min(args.varlen, cfg["seq"]), cfg["seq"])
                       for _ in range(args.steps)]
        data = [torch.randint(0, cfg["vocab"], (cfg["batch"], n + 1)) for n in lengths]
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        summary["setup"] = {"stats": stats.read(), "device_used": stats.device_used()}
        stats.empty_cache()
        stats.reset_peaks()
        before = stats.read()
        previous = before
        summary["after_setup"] = {"stats": before, "device_used": stats.device_used()}
        t_setup = time.time()
        summary["startup_s"] = {"import_and_enable": round(t_import - t_start, 2),
                                "init_process_group": round(t_pg - t_import, 2),
                                "model_and_shard": round(t_setup - t_pg, 2)}
        log(rank, "%s %s %s: start-up %.1fs (import%s %.1f, process group %.1f, model %.1f); "
            "stats from %s%s" % (args.setting, args.fsdp, args.shape, t_setup - t_start,
                                 " + gpu_alloc.enable" if gpu_alloc else "", t_import - t_start,
                                 t_pg - t_import, t_setup - t_pg, stats.source,
                                 "; bridge %s" % ("on" if alloc_info.get("bridge") else "off")
                                 if gpu_alloc else ""))

        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        amp_device = device.type

        def train_step(tokens):
            """One step on `tokens`: (loss, milliseconds between two synchronizations)."""
            batch = tokens.to(device)
            inp, tgt = batch[:, :-1], batch[:, 1:]
            sync()
            t0 = time.perf_counter()
            with torch.autocast(amp_device, dtype=torch.bfloat16):
                logits = forward(inp)
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            dt = (time.perf_counter() - t0) * 1000.0
            return float(loss.item()), dt

        probes = [host_probe(torch, device, sync)]
        for step in range(args.steps):
            lv, dt = train_step(data[step])
            reading = stats.read()
            rec = step_record(step + 1, lv, dt, reading, before, stats.device_used(),
                              previous)
            previous = reading
            stats.reset_peaks()
            per_step.append(rec)
            if rank == 0 and (step == 0 or (step + 1) % 10 == 0 or step + 1 == args.steps):
                p = rec["primary"]
                log(rank, "step %d loss %.4f %.1f ms reserved %.2f GiB (peak %.2f) "
                    "allocated peak %.2f GiB" % (step + 1, lv, dt, p["reserved"] / 2**30,
                                                 p["reserved_peak"] / 2**30,
                                                 p["allocated_peak"] / 2**30))
            if not math.isfinite(lv) and not args.fake_world:
                raise RuntimeError("loss is %r at step %d" % (lv, step + 1))
        probes.append(host_probe(torch, device, sync))
        summary["host_probe_us"] = probes
        if args.profile:  # after the timed steps: the profiler's overhead is in none of them
            sys.path.insert(0, os.path.join(REPO, "benchmarks", "budget"))
            import budget  # its profile_steps, which budget.py's --profile-steps uses too
            try:
                prof = budget.profile_steps(torch, lambda _, i: train_step(data[i]), None,
                                            len(data), args.profile)
                summary["profile"] = prof
                log(rank, "profile of %d steps: %.1f ms a step, of which kernels %.1f" % (
                    args.profile, prof["wall_ms_per_step"], prof["kernel_ms_per_step"]))
            except Exception as e:  # the timed steps stand without it
                summary["profile_error"] = "%s: %s" % (type(e).__name__, str(e)[:500])
                traceback.print_exc()
        if args.memory_history:  # after the timed steps too: recording costs host time
            snap = snapshot_path(args.out, args.setting, args.fsdp, args.shape, rank)
            summary["memory_history"] = record_history(
                torch, lambda i: train_step(data[i]), len(data), args.memory_history,
                snap if rank == 0 else None)
            if rank == 0:
                log(rank, "memory history of %d steps: %s" % (args.memory_history, snap))
    except Exception as e:
        status, error = "error", "%s: %s" % (type(e).__name__, e)
        traceback.print_exc()

    summary.update(summarize(per_step))
    if per_step:
        last = per_step[-1]
        for sub in ("primary", "gpu_alloc"):
            if sub in last:
                pre = "" if sub == "primary" else "gpu_alloc_"
                summary[pre + "num_device_alloc"] = last[sub]["num_device_alloc"]
                summary[pre + "num_device_free"] = last[sub]["num_device_free"]
                summary[pre + "num_alloc_retries"] = last[sub]["num_alloc_retries"]
    summary["status"] = status
    if error:
        summary["error"] = error[:2000]
    summary["wall_s"] = round(time.time() - t_start, 2)
    write_json(path, dict(summary, per_step=per_step))
    brief = {k: v for k, v in summary.items() if k not in ("setup", "after_setup", "profile")}
    # One write (atomic on a pipe up to 4 KiB): the ranks share torchrun's stdout.
    sys.stdout.write("RESULT " + json.dumps(brief, separators=(",", ":")) + "\n")
    sys.stdout.flush()
    if status == "ok":
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (allocator / NCCL destructors at exit): the results are
    # written, and a failed rank must not wait for its peer in a collective.
    os._exit(0 if status == "ok" else 1)


if __name__ == "__main__":
    main()
