"""Throughput at a memory budget: for each workload and each of three budgets between its
peak allocated and PyTorch default's peak reserved, the largest batch that runs its steps
without running out of memory, and the tokens (samples) per second at that batch, under
PyTorch's allocator (default and expandable segments) and under gpualloc (run on a machine
with a GPU):

    GPUALLOC_SO=target/release/liballoc_ffi.so python3 benchmarks/budget/budget.py \
        [WORKLOADS] [ALLOCATORS] [--shares 0.25,0.5,0.75] [--steps N] [--rounds R]
        [--cpus LIST] [--out DIR]

The budget is PyTorch's per-process memory fraction (`set_per_process_memory_fraction`),
which both allocators honour: reserved memory may not pass it. ALLOCATORS use the names of
python/examples/compare_workloads.py (torch, torch-expandable, gpualloc:CONF, ...).

How one (workload, allocator) is measured, in a process of its own:
  1. The budgets come first from a calibration run under PyTorch's default allocator at the
     workload's reference batch with no budget: peak allocated A and peak reserved R; the
     budgets are A + s * (R - A) for each share s (--shares).
  2. For each budget, largest first, the fraction is set, the cache emptied and the peaks
     reset; then batches are tried from twice the reference batch downwards, each for
     the workload's steps (20; 6 whole generations for gpt2_generate); where twice the
     reference runs, upwards from it in steps of a quarter of the reference until one
     fails or CEILING (4) times the reference runs too (`capped`: the budget did not
     bind). The first step
     takes the longest sequence of the run, so that a batch that cannot fit fails at
     once (--probe-steps N: the search runs on the first N steps alone, then the batch
     found runs in full, stepping down the ladder while it fails). An out-of-memory
     error frees the step's tensors, empties the cache and moves to the next smaller
     batch. The largest batch whose steps all
     run is the answer; its throughput is the work of the steps after the warm-up over
     their time (a mean, not a median: throughput follows the mean). ViT's steps run
     twice and the second pass is timed (cuDNN plans each new batch size once).
  3. Under gpualloc, its page-move and stream counters (`page_moves.*`, `stream_ops.*` of
     gpu_alloc.memory_stats()) are read just before the timed steps of the batch that ran
     and just after them: `moves_per_step` holds their growth per timed step (the warm-up,
     ViT's first pass and the failed batches left out); `page_moves` the cumulative ones.
The same seeds draw the same sequence lengths (batch sizes) for every allocator.

--rounds R runs every (workload, allocator) process R times, interleaved: round k runs
the allocators in the given order rotated left by k - 1, so that a slow spell of the host
falls on a different allocator each round; the calibration runs once per workload (its
result has round 0). Each result carries its `round`. The table gives, per workload,
budget and allocator, the mean rate over rounds and its spread, and the ratio to PyTorch
default's both as the ratio of the means and as the mean of each round's ratio (PyTorch's
rate in the same round, at the same budget). --cpus LIST pins every process to those CPUs.
--side-by-side (a GPU an allocator) runs the allocators of a round at the same time, the
i-th of the round's order on GPU i and the i-th of --cpus's ';'-separated lists (or
`apart:N`, lists of N physical cores that share none), so that the rates of one round
see the same host; each result records its `gpu`.

--no-limit-rates: after each round, PyTorch's default runs every batch the round's
allocators fitted with no budget at all; a table gives each cell's share of that rate at
its batch, and per budget the most that fitting a larger batch can give.

Writes DIR/budget.json and DIR/budget.md (default $OUT or /tmp); --from-json re-renders.
"""
import argparse
import functools
import gc
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "python", "examples"))
import compare_workloads as cw  # noqa: E402  (allocator names, child environments)

GIB = float(2**30)
# name -> (reference batch, steps, passes, warm-up steps, unit of work). Generation's
# steps are whole generations of 256 tokens each, hence fewer of them. ViT and the two
# training workloads run their steps twice and time the second pass: a shape (batch
# size, sequence length) met for the first time in a process pays for kernel selection
# and planning, more than its allocations, and an allocator whose batch was already run
# at a larger budget of the same process would otherwise be timed warm against the
# others' cold (FSDP2's torch process, H200 2026-11-29: 2x at the one budget where it
# ran its batch a second time).
WORKLOADS = {
    "llama_varlen_train": (8, 20, 2, 0, "tokens"),
    "vit_varbatch_infer": (64, 20, 2, 0, "images"),
    "gpt2_generate": (64, 6, 1, 1, "tokens"),
    "fsdp2_varlen_train": (8, 20, 2, 0, "tokens"),
}
DEFAULT_ALLOCS = ["torch", "torch-expandable", "gpualloc:budget"]
# Ops kept per profile (--profile-steps), and shown per allocator in the profile table.
PROFILE_TOP = 40
PROFILE_SHOWN = 12


# ---------------------------------------------------------------------------------------
# Workloads: each returns step(batch, i) -> work units done, after building its model.


def training(torch, opt, loss_of, lengths, device):
    """(step, reset) of a training workload: step(batch, i) computes `loss_of(batch,
    lengths[i])` under bf16 autocast, takes an optimizer step and returns the tokens done;
    reset drops the gradients (after an out-of-memory error)."""

    def step(batch, i):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = loss_of(batch, lengths[i])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return batch * lengths[i]

    def reset():
        opt.zero_grad(set_to_none=True)

    return step, reset


def llama_varlen_train(torch, steps):
    """A 0.2B Llama (transformers' LlamaForCausalLM, random weights) trained with AdamW under
    bf16 autocast, without checkpointing; sequence lengths drawn from 128..2048 per step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                      num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                      max_position_embeddings=2048)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(7)
    lengths = [2048] + [rng.randint(128, 2048) for _ in range(steps - 1)]

    def loss_of(batch, length):
        ids = torch.randint(0, cfg.vocab_size, (batch, length), device="cuda")
        return model(input_ids=ids, labels=ids).loss

    return training(torch, opt, loss_of, lengths, "cuda")


def vit_varbatch_infer(torch, steps):
    """torchvision's vit_b_16 (random weights) under bf16 autocast and no_grad; the batch
    size of each step drawn from 1..batch (the first step takes the whole batch)."""
    import torchvision

    with torch.device("cuda"):
        model = torchvision.models.vit_b_16().eval()
    rng = random.Random(7)
    shares = [1.0] + [rng.random() for _ in range(steps - 1)]

    def step(batch, i):
        b = max(1, round(batch * shares[i]))
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(torch.randn(b, 3, 224, 224, device="cuda"))
            out.sum().item()
        return b

    return step, lambda: None


def gpt2_generate(torch, steps):
    """GPT-2 small (transformers, random weights): a step generates 256 new tokens for a
    batch of prompts of 16..256 tokens (the first step's prompts the longest); key/value
    caches grow by one token per decoded token."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("cuda"):
        model = GPT2LMHeadModel(GPT2Config()).eval()
    rng = random.Random(7)
    prompts = [256] + [rng.randint(16, 256) for _ in range(steps - 1)]

    def step(batch, i):
        ids = torch.randint(0, 50257, (batch, prompts[i]), device="cuda")
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=256, min_new_tokens=256, do_sample=True,
                                 pad_token_id=0)
        return batch * (out.shape[1] - prompts[i])

    return step, lambda: None


def fsdp2_varlen_train(torch, steps, device="cuda", world=2):
    """FSDP2 (`fully_shard` per block, then the root) of benchmarks/fsdp's GPT-2-medium-shaped
    decoder (0.35B, random weights), AdamW, bf16 autocast; sequence lengths drawn from
    256..1024 per step (the first 1024). One process plays rank 0 of `world` over PyTorch's
    fake process group: it holds rank 0's shards, gathers each block's parameters into
    buffers of the full size on FSDP's own streams and frees them across streams, as on
    `world` GPUs, so its memory is rank 0's; no collective moves data (the gathered values
    are whatever the buffers held, so the loss is not checked) and the work per second
    leaves out the communication a real run would add. `device` "cpu" runs it without a GPU
    (the harness's own test of this function)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "fsdp"))
    import fsdp_bench

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    cfg = dict(fsdp_bench.SHAPES["gpt2-medium"])
    if device == "cpu":  # the test: a small model of the same structure
        cfg.update(layers=2, d_model=64, heads=4, vocab=512, seq=64)
    model, _ = fsdp_bench.build_plain_model(torch, cfg)
    fsdp_bench.init_plain_model(torch, model, cfg, torch.device(device))
    mesh = init_device_mesh(device, (world,))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(7)
    top = cfg["seq"]
    lengths = [top] + [rng.randint(top // 4, top) for _ in range(steps - 1)]

    def loss_of(batch, length):
        ids = torch.randint(0, cfg["vocab"], (batch, length + 1), device=device)
        logits = model(ids[:, :-1])
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    return training(torch, opt, loss_of, lengths, device)


# ---------------------------------------------------------------------------------------
# One process: the workload under one allocator, every budget.


def is_oom(torch, e):
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


COUNTER_GROUPS = ("page_moves.", "stream_ops.", "host_calls.")
# PyTorch's own counters of driver allocations and frees (a page mapped or unmapped
# counts as one) and of retries after a failed one.
DEVICE_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def moves_counters(stats):
    """The page-move and stream counters (`page_moves.*`, `stream_ops.*`), the library's
    own call times (`host_calls.*`, with --time-calls) and the driver allocation counters
    (DEVICE_COUNTERS) of a gpu_alloc.memory_stats() map."""
    return {k: v for k, v in stats.items()
            if k.startswith(COUNTER_GROUPS) or k in DEVICE_COUNTERS}


def per_step_difference(before, after, steps):
    """Each counter's growth from `before` to `after`, divided by `steps`: the mean per
    timed step. A key missing from `before` counts from zero."""
    return {k: (v - before.get(k, 0)) / steps for k, v in sorted(after.items())}


class TimedCounters:
    """Counters read just before the first timed step of a batch and just after its last
    (the reads themselves stay outside the timed spans), so that what they count belongs
    to the timed steps alone: not to the warm-up, a first pass or a batch that ran out of
    memory. `read` returns a dict of counter name -> value."""

    def __init__(self, read):
        self.read = read
        self.before = None
        self.per_step = None

    def reset(self):
        """Before a batch: forgets the figures of an earlier one."""
        self.before = self.per_step = None

    def start(self):
        """Before the first timed step."""
        self.before = self.read()

    def stop(self, steps):
        """After the last of the `steps` timed steps."""
        self.per_step = per_step_difference(self.before, self.read(), steps)


def run_batch(torch, step, reset, batch, steps, warmup, passes=1, counters=None):
    """(ok, work units per second over the timed steps, mean step ms, error text). The
    schedule of `steps` runs `passes` times; the last pass's steps from `warmup` on are
    timed. `counters` (a TimedCounters, or None) is read around the timed steps."""
    times, work = [], 0
    timed_from = steps * (passes - 1) + warmup
    if counters is not None:
        counters.reset()
    try:
        for i in range(steps * passes):
            if counters is not None and i == timed_from:
                counters.start()  # the step before synchronized: nothing of it is pending
            t0 = time.perf_counter()
            done = step(batch, i % steps)
            torch.cuda.synchronize()
            if i >= timed_from:
                times.append(time.perf_counter() - t0)
                work += done
    except Exception as e:  # noqa: BLE001 (out of memory is the expected one)
        if not is_oom(torch, e):
            raise
        err = str(e).splitlines()[0][:160]
        del e
        reset()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return False, None, None, err
    if counters is not None:
        counters.stop(len(times))
    return True, work / sum(times), 1e3 * sum(times) / len(times), None


def batches_from(reference):
    """Twice the reference batch down to one eighth of it, in steps of an eighth."""
    eighth = max(1, reference // 8)
    return list(range(2 * reference, 0, -eighth))


# How far above the reference batch the search goes when twice it fits: a budget that
# every allocator meets at twice the reference would otherwise show the same batch for
# all, whatever memory each leaves free.
CEILING = 4


def batches_above(reference):
    """Above twice the reference batch up to CEILING times it, in steps of a quarter."""
    quarter = max(1, reference // 4)
    return list(range(2 * reference + quarter, CEILING * reference + 1, quarter))


# The children read --probe-steps here (their command line is the driver's own protocol).
PROBE_ENV = "BUDGET_PROBE_STEPS"


def ladder(reference):
    """Every batch the search may try (batches_from and batches_above), ascending."""
    return sorted(set(batches_from(reference) + batches_above(reference)))


def largest_batch(reference, run, probe=None):
    """The largest batch that runs: `run(batch)` -> (ok, result) for batches from twice the
    reference down (batches_from) until one runs; if the first one, twice the reference,
    runs, then upward (batches_above) until one fails. Returns (batch, its result, the
    batches tried as (batch, ok, result), capped): batch 0 and result None when none
    ran; capped when CEILING times the reference ran too (the budget did not bind).

    With `probe` (batch -> (ok, result), a shorter run) the same search runs on probes;
    then the batch the probes found, and below it each smaller batch of the ladder until
    one runs, is `run` in full: the same answer wherever a batch that fails its run fails
    its probe too, and no more than one full run where the probes are right. A probe's
    entry in `tried` has `"probe": True` in its result."""
    if probe is None:
        return _search(reference, run)
    found, _, tried, capped = _search(reference, lambda b: _marked_probe(probe, b))
    for batch in reversed([b for b in ladder(reference) if b <= found]):
        ok, result = run(batch)
        tried.append((batch, ok, result))
        if ok:
            return batch, result, tried, capped and batch == found
    return 0, None, tried, False


def _marked_probe(probe, batch):
    ok, result = probe(batch)
    return ok, dict(result, probe=True)


def _search(reference, run):
    """largest_batch's search over `run` alone."""
    tried = []
    for batch in batches_from(reference):
        ok, result = run(batch)
        tried.append((batch, ok, result))
        if ok:
            break
    else:
        return 0, None, tried, False
    best, best_result = batch, result
    if batch != 2 * reference:
        return best, best_result, tried, False
    for batch in batches_above(reference):
        ok, result = run(batch)
        tried.append((batch, ok, result))
        if not ok:
            return best, best_result, tried, False
        best, best_result = batch, result
    return best, best_result, tried, True


def profile_steps(torch, step, batch, steps, n):
    """Runs `n` more steps of the schedule at `batch` under torch.profiler (CPU and CUDA
    activities) and returns the ops with the most self CPU time, per step: what a slower
    step spends its host time on (`--profile-steps`), and the GPU time of its kernels,
    copies and fills per step (a slower step with the same kernel time waited on the host). The profiler slows every op, so these
    steps are not timed for the rate. benchmarks/fsdp's `fsdp_bench.py --profile` uses it
    too."""
    activity = torch.profiler.ProfilerActivity
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[activity.CPU, activity.CUDA]) as prof:
        for i in range(n):
            step(batch, i % steps)
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    averages = prof.key_averages()
    top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)
    # The GPU's own time: the device-side entries (kernels, copies, fills), each once.
    cuda = getattr(getattr(torch, "autograd", None), "DeviceType", None)
    kernel_us = sum(e.self_device_time_total for e in averages
                    if cuda is not None and getattr(e, "device_type", None) == cuda.CUDA)
    return {"steps": n, "wall_ms_per_step": 1e3 * wall / n,
            "kernel_ms_per_step": kernel_us / 1e3 / n,
            "allocator_calls": allocator_call_spread(prof.events()),
            "top": [{"name": e.key, "calls": e.count / n,
                     "self_cpu_us": e.self_cpu_time_total / n,
                     "cpu_us": e.cpu_time_total / n} for e in top[:PROFILE_TOP]]}


def allocator_call_spread(events, slow_us=100.0):
    """The spread of gpualloc's calls in a profile (the bridge's gpualloc::malloc and
    gpualloc::free ops): per name, the count, the percentiles of one call's host time in
    us, and the share of the total in calls of at least `slow_us`: whether a high mean is
    every call or a few long ones."""
    by_name = {}
    for e in events:
        if e.name.startswith("gpualloc::"):
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    out = {}
    for name, us in sorted(by_name.items()):
        us.sort()
        total = sum(us)
        slow = [u for u in us if u >= slow_us]
        out[name] = {"calls": len(us), "total_us": total,
                     "p50_us": us[len(us) // 2], "p90_us": us[int(len(us) * 0.9)],
                     "p99_us": us[int(len(us) * 0.99)], "max_us": us[-1],
                     "slow_calls": len(slow), "slow_share": sum(slow) / total if total else 0.0}
    return out


def record_snapshot(torch, step, batch, steps, n, path):
    """Runs `n` more steps of the schedule at `batch` with PyTorch's allocation history on
    (no stacks) and writes the snapshot pickle to `path`: the workload's allocation trace,
    streams included, which `cargo xtask replay PATH --capacity-gib BUDGET` replays on the
    simulated device under every setting (`--snapshot-steps`)."""
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             max_entries=1 << 22)
    try:
        for i in range(n):
            step(batch, i % steps)
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return path


def child(workload, alloc, budgets, steps, profile=0, snapshot=None):
    kind, conf = cw.parse_alloc(alloc)
    if kind == "gpualloc":
        sys.path.insert(0, os.path.join(ROOT, "python"))
        import gpu_alloc

        gpu_alloc.enable(conf)
    import torch

    torch.manual_seed(0)
    torch.cuda.init()
    total = torch.cuda.mem_get_info()[1]
    reference, default_steps, passes, warmup, unit = WORKLOADS[workload]
    steps = steps or default_steps
    probe_steps = min(int(os.environ.get(PROBE_ENV, "0") or 0), steps)
    step, reset = globals()[workload](torch, steps)
    counters = None
    if kind == "gpualloc":
        counters = TimedCounters(lambda: moves_counters(gpu_alloc.memory_stats()))
    out = {"workload": workload, "alloc": alloc, "unit": unit, "device_total": total,
           "torch": torch.__version__, "device": torch.cuda.get_device_name()}
    if isinstance(budgets, dict):  # --no-limit-rates: each batch with no budget at all
        out["no_limit"] = []
        for batch in budgets["batches"]:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            ok, rate, mean_ms, err = run_batch(torch, step, reset, batch, steps, warmup,
                                               passes)
            out["no_limit"].append({"batch": batch, "ok": ok, "rate": rate,
                                    "mean_step_ms": mean_ms, "error": err,
                                    "peak_allocated": torch.cuda.max_memory_allocated(),
                                    "peak_reserved": torch.cuda.max_memory_reserved()})
            print("PARTIAL " + json.dumps(out), flush=True)
        print("RESULT " + json.dumps(out), flush=True)
        return
    out["budgets"] = []
    if not budgets:  # calibration: the reference batch with no budget
        ok, rate, mean_ms, err = run_batch(torch, step, reset, reference, steps, warmup, passes)
        out.update(ok=ok, rate=rate, mean_step_ms=mean_ms, error=err, batch=reference,
                   peak_allocated=torch.cuda.max_memory_allocated(),
                   peak_reserved=torch.cuda.max_memory_reserved())
        if ok and snapshot:
            n, path = snapshot
            out["snapshot"] = record_snapshot(torch, step, reference, steps, n, path)
    for budget in sorted(budgets, reverse=True):
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
        torch.cuda.reset_peak_memory_stats()

        def run(batch):
            ok, rate, mean_ms, err = run_batch(torch, step, reset, batch, steps, warmup, passes,
                                               counters)
            # The counters of the batch that ran last; kept with its result.
            per_step = counters.per_step if ok and counters else None
            return ok, {"rate": rate, "mean_step_ms": mean_ms, "error": err,
                        "per_step": per_step}

        def probe(batch):
            ok, _, _, err = run_batch(torch, step, reset, batch, probe_steps, 0)
            return ok, {"error": err}

        batch, best, tried, capped = largest_batch(reference, run,
                                                   probe if probe_steps else None)
        ok = best is not None
        rate = best["rate"] if ok else None
        mean_ms = best["mean_step_ms"] if ok else None
        row = {"budget": budget, "batch": batch, "rate": rate, "mean_step_ms": mean_ms,
               "tried": [{"batch": b, "ok": k, "error": r["error"],
                          **({"probe": True} if r.get("probe") else {})}
                         for b, k, r in tried],
               "capped": capped,
               "peak_reserved": torch.cuda.max_memory_reserved(),
               "peak_allocated": torch.cuda.max_memory_allocated()}
        if ok and profile:
            try:
                row["profile"] = profile_steps(torch, step, batch, steps, profile)
            except Exception as e:  # noqa: BLE001 (the rate stands without its profile)
                row["profile"] = {"error": str(e).splitlines()[0][:300]}
        if kind == "gpualloc":
            # Cumulative over the process (earlier budgets and failed batches included);
            # moves_per_step holds the timed steps' own.
            st = gpu_alloc.memory_stats()
            row["page_moves"] = {k.split(".", 1)[1]: v for k, v in st.items()
                                 if k.startswith("page_moves.")}
            if ok:
                row["moves_per_step"] = best["per_step"]
        out["budgets"].append(row)
        # What a timeout would otherwise lose: the budgets finished so far.
        print("PARTIAL " + json.dumps(out), flush=True)
        moved = row.get("moves_per_step") or {}
        print("%s %s budget %.2f GiB: batch %s, %s %s/s%s" % (
            workload, alloc, budget / GIB, row["batch"], rate and round(rate), unit,
            ", %.2f pages moved and %.2f host waits per timed step" % (
                moved.get("page_moves.pages_unmapped", 0), moved.get("stream_ops.host_waits", 0))
            if moved else ""), flush=True)
    print("RESULT " + json.dumps(out), flush=True)
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------
# The driver and the report (plain Python, tested without torch).


def budgets_between(allocated, reserved, shares):
    """Budgets at `shares` of the way from peak allocated to peak reserved."""
    return [int(allocated + s * (reserved - allocated)) for s in shares]


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _kind(alloc):
    try:
        return cw.parse_alloc(alloc)[0]
    except (ValueError, AttributeError):
        return None


def cells(results):
    """{(workload, budget, allocator): {round: (result, budget row)}}, in the results'
    order; a result without a `round` (a JSON of one pass) is round 1."""
    out = {}
    for r in results:
        for b in r.get("budgets") or []:
            key = (r["workload"], b["budget"], r["alloc"])
            out.setdefault(key, {})[r.get("round", 1)] = (r, b)
    return out


def summarize(results, ref="torch"):
    """One dict per (workload, budget, allocator), by workload and budget (allocators in
    the results' order), with what the table shows:

    batches         the largest batch of each round (0: none fitted), by round
    rate_mean       the mean over rounds of the work per second (each round at its own
                    batch); rate_min / rate_max its spread; rates: how many rounds had one
    ratio_of_means  rate_mean over the `ref` allocator's rate_mean at the same budget
    mean_of_ratios  the mean over rounds of the rate over `ref`'s rate of the same round
    ratio_interval  (geometric mean, low, high) of those per-round ratios, the 95% t
                    interval (compare_workloads.ratio_interval); None under two rounds
    pages_per_step  pages unmapped per timed step, the mean over rounds (None without
                    moves_per_step); host_waits_per_step: the same for host waits
    peak_reserved   the largest over rounds
    """
    table = cells(results)
    rows = []
    for (w, budget, alloc), by_round in sorted(table.items(), key=lambda kv: kv[0][:2]):
        rounds = sorted(by_round)
        rates = {k: by_round[k][1].get("rate") for k in rounds if by_round[k][1].get("rate")}
        ref_rates = {k: b.get("rate") for k, (_, b) in table.get((w, budget, ref), {}).items()
                     if b.get("rate")}
        mean = _mean(list(rates.values()))
        ref_mean = _mean(list(ref_rates.values()))
        per_round = [rates[k] / ref_rates[k] for k in rounds if k in rates and k in ref_rates]
        moves = [by_round[k][1]["moves_per_step"] for k in rounds
                 if by_round[k][1].get("moves_per_step") is not None]
        rows.append({
            "workload": w, "budget": budget, "alloc": alloc,
            "unit": by_round[rounds[0]][0].get("unit", ""), "rounds": len(rounds),
            "batches": {k: by_round[k][1].get("batch") or 0 for k in rounds},
            "capped": any(by_round[k][1].get("capped") for k in rounds),
            "rates": len(rates), "rate_mean": mean,
            "rate_min": min(rates.values()) if rates else None,
            "rate_max": max(rates.values()) if rates else None,
            "ratio_of_means": mean / ref_mean if mean and ref_mean else None,
            "mean_of_ratios": _mean(per_round),
            "ratio_interval": cw.ratio_interval(per_round),
            "peak_reserved": max(by_round[k][1].get("peak_reserved") or 0 for k in rounds),
            "pages_per_step": _mean([m.get("page_moves.pages_unmapped", 0) for m in moves]),
            "host_waits_per_step": _mean([m.get("stream_ops.host_waits", 0) for m in moves]),
        })
    return rows


def fitted_batches(results):
    """The batches the results' allocators fitted at any budget, ascending."""
    return sorted({b["batch"] for r in results for b in r.get("budgets") or []
                   if b.get("batch")})


def next_batch(reference, batch):
    """The batch the search would try next above `batch` (largest_batch's ladder), or None
    above the ladder's top."""
    return next((b for b in ladder(reference) if b > batch), None)


def no_limit_batches(workload, results):
    """The batches a --no-limit-rates run takes: each batch fitted, and the next one of the
    ladder above it (whose allocated peak says whether any allocator could fit it)."""
    fitted = fitted_batches(results)
    nexts = [next_batch(WORKLOADS[workload][0], b) for b in fitted]
    return sorted(set(fitted) | {b for b in nexts if b})


def no_limit_rates(results, key="rate"):
    """{(workload, round): {batch: rate}} of the --no-limit-rates runs (PyTorch's default,
    no budget), the batches that ran; `key` "peak_allocated": their allocated peaks."""
    out = {}
    for r in results:
        for b in r.get("no_limit") or []:
            if b.get("ok") and b.get(key):
                out.setdefault((r["workload"], r.get("round", 1)), {})[b["batch"]] = b[key]
    return out


def by_budget(rows):
    """The allocators of each (workload, budget) of summarize's rows, in the rows' order."""
    out = {}
    for row in rows:
        out.setdefault((row["workload"], row["budget"]), []).append(row["alloc"])
    return out


def largest_fitted(table, workload, budget, allocs):
    """{round: the largest batch any of `allocs` fitted at `budget` in that round}
    (0 where none fitted), from cells(results)."""
    out = {}
    for a in allocs:
        for rnd, (_, b) in table[(workload, budget, a)].items():
            out[rnd] = max(out.get(rnd, 0), b.get("batch") or 0)
    return dict(sorted(out.items()))


def next_batch_lines(results, rows):
    """Per budget, the allocated peak with no limit of the next batch above the largest any
    allocator fitted there: above the budget, no allocator can fit that batch (what it
    hands out at once exceeds the budget), so the largest fitted is the most any can."""
    peaks = no_limit_rates(results, "peak_allocated")
    table = cells(results)
    lines = []
    for (w, budget), allocs in by_budget(rows).items():
        for rnd, largest in largest_fitted(table, w, budget, allocs).items():
            nxt = next_batch(WORKLOADS[w][0], largest) if w in WORKLOADS and largest else None
            peak = peaks.get((w, rnd), {}).get(nxt)
            if peak:
                lines.append("- %s at %.2f GiB, round %d: batch %d (the next above the largest "
                             "fitted, %d) allocates %.2f GiB with no limit: %s" % (
                                 w, budget / GIB, rnd, nxt, largest, peak / GIB,
                                 "above the budget, no allocator fits it" if peak > budget
                                 else "within the budget, an allocator could fit it"))
    return lines


def no_limit_lines(results, rows, ref="torch", threshold=1.2):
    """With --no-limit-rates: per workload, budget and allocator, the mean over rounds of
    the rate with no limit at the batch the allocator fitted (PyTorch's default, the same
    round) and the mean of the allocator's rate over it; then per budget the most any
    allocator could give: the no-limit rate at the largest batch fitted there over `ref`'s
    rate, the mean over rounds. Empty without such runs."""
    free = no_limit_rates(results)
    if not free:
        return []
    table = cells(results)
    lines = ["", "Against the rate with no limit at the same batch (PyTorch's default, no "
             "budget, the same round): what any allocator could reach at that batch, and "
             "the share of it each reached; then, per budget, the no-limit rate at the "
             "largest batch any allocator fitted over %s's rate there: the most that fitting "
             "a larger batch can give at that budget (rounds' mean):" % ref, "",
             "| workload | budget GiB | allocator | batch | rate, mean | no-limit rate at "
             "its batch, mean | share of it |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        key = (row["workload"], row["budget"], row["alloc"])
        bounds, shares = [], []
        for rnd, (_, b) in sorted(table[key].items()):
            bound = free.get((row["workload"], rnd), {}).get(b.get("batch"))
            if bound:
                bounds.append(bound)
                if b.get("rate"):
                    shares.append(b["rate"] / bound)
        lines.append("| %s | %.2f | %s | %s | %s | %s | %s |" % (
            row["workload"], row["budget"] / GIB, row["alloc"], batch_text(row["batches"]),
            _fmt(row["rate_mean"], "%.0f"), _fmt(_mean(bounds), "%.0f"),
            _fmt(_mean(shares), "%.3f")))
    for (w, budget), allocs in by_budget(rows).items():
        ratios = []
        for rnd, largest in largest_fitted(table, w, budget, allocs).items():
            ref_b = table.get((w, budget, ref), {}).get(rnd)
            bound = free.get((w, rnd), {}).get(largest)
            if bound and ref_b and ref_b[1].get("rate"):
                ratios.append(bound / ref_b[1]["rate"])
        mean = _mean(ratios)
        if mean is not None:
            lines.append("- %s at %.2f GiB: a larger batch can give at most %.2fx %s's rate "
                         "(%s %.1fx)" % (w, budget / GIB, mean, ref,
                                         ">=" if mean >= threshold else "<", threshold))
    return lines + next_batch_lines(results, rows)


def batch_text(batches):
    """The largest batch over rounds: '8', 'none', or '7-8' when the rounds disagree."""
    values = list(batches.values())
    lo, hi = min(values), max(values)
    if lo == hi:
        return str(lo) if lo else "none"
    return "%d-%d" % (lo, hi)


def workload_summary(rows, ref="torch", expandable="torch-expandable", threshold=1.2):
    """One line per (workload, gpualloc allocator): at how many budgets its largest batch
    is >= `expandable`'s and > `ref`'s in every round both ran, and at how many its ratio
    of the mean rates to `ref`'s is >= `threshold`."""
    by = {(r["workload"], r["budget"], r["alloc"]): r for r in rows}
    lines, seen = [], set()
    for row in rows:
        w, alloc = row["workload"], row["alloc"]
        if _kind(alloc) != "gpualloc" or (w, alloc) in seen:
            continue
        seen.add((w, alloc))
        mine = [r for r in rows if r["workload"] == w and r["alloc"] == alloc]
        tests = [(name, op) for name, op in ((expandable, ">="), (ref, ">"))
                 if any((w, r["budget"], name) in by for r in mine)]
        bigger = faster = sure = 0
        for r in mine:
            holds = []
            for name, op in tests:
                other = by.get((w, r["budget"], name))
                common = [k for k in r["batches"] if other and k in other["batches"]]
                holds.append(bool(common) and all(
                    (r["batches"][k] >= other["batches"][k]) if op == ">="
                    else (r["batches"][k] > other["batches"][k]) for k in common))
            bigger += bool(tests) and all(holds)
            faster += (r["ratio_of_means"] or 0) >= threshold
            sure += r["ratio_interval"] is not None and r["ratio_interval"][1] >= threshold
        what = " and ".join("%s %s's" % (op, name) for name, op in tests) or "(no PyTorch run)"
        lines.append("- %s, %s: largest batch %s at %d of %d budgets (in every round); mean "
                     "rate >= %.1fx %s's at %d of %d; with 95%% confidence (the per-round "
                     "ratios' interval at or above it) at %d of %d" % (
                         w, alloc, what, bigger, len(mine), threshold, ref, faster, len(mine),
                         sure, len(mine)))
    return lines


def _fmt(v, pattern, absent="-"):
    return absent if v is None else pattern % v


def make_table(results):
    """A markdown report: a line on the runs, then per workload, budget and allocator the
    largest batch, the work per second (mean over rounds and its spread), its ratio to
    PyTorch default's at the same budget (ratio of the means and mean of the per-round
    ratios), peak reserved and gpualloc's page moves and host waits per timed step; then a
    summary line per workload and gpualloc allocator, and the runs that failed."""
    ok = [r for r in results if r.get("device")]
    rounds = max([r.get("round", 1) for r in results if not r.get("calibration")] or [1])
    head = []
    if ok:
        cpus = next((r["cpus"] for r in ok if r.get("cpus")), None)
        head = ["%s, torch %s; %d round%s, allocators rotated from round to round%s" % (
            ok[0]["device"], ok[0].get("torch"), rounds, "" if rounds == 1 else "s",
            "; children pinned to CPUs %s" % ",".join(map(str, cpus)) if cpus else ""), ""]
    lines = head + [
        "| workload | budget GiB | allocator | rounds | largest batch | per second, mean "
        "| spread | vs torch, ratio of means | vs torch, mean of ratios | peak reserved GiB "
        "| pages moved / step | host waits / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = summarize(results)
    for r in rows:
        spread = "-"
        if r["rates"] > 1:
            spread = "%.0f-%.0f" % (r["rate_min"], r["rate_max"])
        lines.append("| %s | %.2f | %s | %s | %s | %s | %s | %s | %s | %.2f | %s | %s |" % (
            r["workload"], r["budget"] / GIB, r["alloc"],
            r["rounds"] if r["rates"] == r["rounds"] else "%d (%d with a rate)" % (
                r["rounds"], r["rates"]),
            batch_text(r["batches"]) + ("+" if r["capped"] else ""),
            _fmt(r["rate_mean"], "%%.0f %s" % r["unit"]), spread,
            _fmt(r["ratio_of_means"], "%.2fx"), _fmt(r["mean_of_ratios"], "%.2fx"),
            r["peak_reserved"] / GIB, _fmt(r["pages_per_step"], "%.2f", ""),
            _fmt(r["host_waits_per_step"], "%.2f", "")))
    if any(r["capped"] for r in rows):
        lines += ["", "+: %d times the reference batch ran too, the largest tried: the budget "
                  "did not bind." % CEILING]
    lines += [""] + workload_summary(rows)
    lines += no_limit_lines(results, rows)
    lines += host_call_lines(results)
    failed = ["- FAILED %s / %s / round %s: %s" % (
        r.get("workload"), r.get("alloc"), r.get("round", 1),
        " ".join(str(r["error"]).split())[-300:]) for r in results if r.get("error")]
    if failed:
        lines += [""] + failed
    return "\n".join(lines + profile_tables(results)) + "\n"


def host_call_lines(results):
    """With --time-calls: per gpualloc cell and round, the library's own malloc and free
    calls in a timed step (host_calls.* per timed step): how many, the mean us a call, and
    the ms of the step they took. Empty without them."""
    rows = []
    for (w, bud, alloc), by_round in cells(results).items():
        for rnd, (_, b) in sorted(by_round.items()):
            per = b.get("moves_per_step") or {}
            if cw.CALL_KEYS[0] not in per:
                continue
            mallocs, frees, malloc_ns, free_ns = (per.get(k, 0) for k in cw.CALL_KEYS)
            rows.append("| %s | %.2f | %s | %s | %.0f | %s | %s | %.2f | %.1f |" % (
                w, bud / GIB, alloc, rnd, mallocs,
                _fmt(malloc_ns / mallocs / 1e3 if mallocs else None, "%.2f"),
                _fmt(free_ns / frees / 1e3 if frees else None, "%.2f"),
                (malloc_ns + free_ns) / 1e6, per.get("host_calls.malloc_slow", 0)))
    if not rows:
        return []
    return ["", "The library's own calls per timed step (--time-calls: GPUALLOC_TIME_CALLS=1):",
            "", "| workload | budget GiB | allocator | round | mallocs | us a malloc | us a free "
            "| ms a step | mallocs of 100 us or more |", "|---|---|---|---|---|---|---|---|---|"] + rows


def profile_tables(results, shown=PROFILE_SHOWN):
    """With --profile-steps: per workload and budget, the ops that take the most host time
    (self CPU microseconds per step, from the first round that has a profile), one column
    per allocator: the union of each allocator's `shown` heaviest ops, heaviest first by
    their largest figure. Empty without profiles."""
    profiles = {}  # (workload, budget) -> alloc -> profile
    for (workload, bud, alloc), by_round in cells(results).items():
        prof = next((b["profile"] for _, (_, b) in sorted(by_round.items())
                     if "top" in (b.get("profile") or {})), None)
        if prof:
            profiles.setdefault((workload, bud), {})[alloc] = prof
    out = []
    for (workload, bud), by_alloc in sorted(profiles.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        allocs = sorted(by_alloc, key=lambda a: (a != "torch", a))
        self_us = {a: {e["name"]: e["self_cpu_us"] for e in by_alloc[a]["top"]} for a in allocs}
        names = set()
        for a in allocs:
            names.update(e["name"] for e in by_alloc[a]["top"][:shown])
        order = sorted(names, key=lambda n: (-max(self_us[a].get(n, 0) for a in allocs), n))
        out += ["", "Host time per step under torch.profiler, %s at %.2f GiB (self CPU us; "
                "profiled steps ran %s ms each, of which kernels):" % (
                    workload, bud / GIB, ", ".join(
                        "%s %.1f (%s)" % (a, by_alloc[a]["wall_ms_per_step"],
                                          _fmt(by_alloc[a].get("kernel_ms_per_step"), "%.1f"))
                        for a in allocs)), "",
                "| op | " + " | ".join(allocs) + " |",
                "|---|" + "---:|" * len(allocs)]
        for n in order:
            out.append("| %s | %s |" % (n, " | ".join(
                _fmt(self_us[a].get(n), "%.0f") for a in allocs)))
    return out


def run_child(workload, alloc, budgets, steps, timeout, cpus=None, profile=0, snapshot=None,
              gpu=None):
    """One (workload, allocator) process, pinned to `cpus` (None: not pinned): its result,
    or a dict with `error`. `profile`: steps to profile after each budget's batch;
    `snapshot`: (steps, path) of a snapshot recorded after the calibration's batch; `gpu`:
    the device it sees as its only one (None: CUDA_VISIBLE_DEVICES left as it is)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", workload, alloc,
           json.dumps(budgets), str(steps), str(profile)]
    if snapshot:
        cmd += [str(snapshot[0]), snapshot[1]]
    return cw.child_result(cmd, cw.child_env(alloc, False), timeout, workload, alloc, cpus,
                           gpu)


def run_round(workload, allocs, rnd, budgets, args):
    """The results of round `rnd` of one workload, in the round's rotated order: one run
    after another, or (--side-by-side) all at once, the i-th on GPU i and the i-th CPU
    list, so that a slow spell of the host falls on the whole round."""
    order = cw.round_order(allocs, rnd)
    if not args.side_by_side:
        cpus = args.cpus[0] if args.cpus else None
        return [run_child(workload, a, budgets, args.steps, args.timeout, cpus,
                          args.profile_steps) for a in order]
    return cw.at_once([functools.partial(run_child, workload, a, budgets, args.steps,
                                         args.timeout, args.cpus[i] if args.cpus else None,
                                         args.profile_steps, gpu=i)
                       for i, a in enumerate(order)])


def write_outputs(results, out_dir):
    """DIR/budget.json and DIR/budget.md (after every child, so a cut-off run keeps what
    it finished)."""
    with open(os.path.join(out_dir, "budget.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out_dir, "budget.md"), "w") as f:
        f.write(make_table(results))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workloads", nargs="?", default=",".join(WORKLOADS))
    ap.add_argument("allocs", nargs="?", default=",".join(DEFAULT_ALLOCS))
    ap.add_argument("--shares", default="0.25,0.5,0.75",
                    help="budgets as shares of the way from peak allocated to peak reserved")
    ap.add_argument("--steps", type=int, default=0,
                    help="steps per batch tried (default: each workload's own, 20 or 6)")
    ap.add_argument("--rounds", type=int, default=1, metavar="R",
                    help="run every (workload, allocator) R times, interleaved, the "
                         "allocators rotated from round to round (the calibration once; 0: "
                         "the calibration alone)")
    ap.add_argument("--cpus", type=cw.parse_cpu_lists, metavar="LIST",
                    help="pin every child to these CPUs (e.g. '2-9'); with --side-by-side one "
                         "list an allocator, separated by ';'; 'apart:N': lists of N physical "
                         "cores that share no core")
    ap.add_argument("--side-by-side", action="store_true",
                    help="the allocators of a round run at the same time, the i-th of the "
                         "round's rotated order on GPU i (needs a GPU an allocator); the "
                         "calibration runs alone on GPU 0")
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--profile-steps", type=int, default=0, metavar="N",
                    help="after each budget's batch, N more steps under torch.profiler: the "
                         "ops with the most host time per step, per allocator (not timed)")
    ap.add_argument("--snapshot-steps", type=int, default=0, metavar="N",
                    help="after the calibration, N more steps with PyTorch's allocation "
                         "history on, written to OUT/WORKLOAD.snapshot.pickle (a trace for "
                         "`cargo xtask replay`)")
    ap.add_argument("--time-calls", action="store_true",
                    help="gpualloc children time the library's own malloc and free calls "
                         "(GPUALLOC_TIME_CALLS=1): per timed step in the table")
    ap.add_argument("--no-limit-rates", action="store_true",
                    help="after each round, PyTorch's default runs every batch an allocator "
                         "fitted with no budget at all: the rate any allocator could reach at "
                         "that batch, and how much of it each reached (a table of its own)")
    ap.add_argument("--probe-steps", type=int, default=0, metavar="N",
                    help="search each budget's largest batch with runs of the first N steps "
                         "of the schedule (the longest first), then run the batch found in "
                         "full, stepping down while it fails: the same batch in far less "
                         "time where steps are long (gpt2_generate: 1)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--from-json", metavar="FILE")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            sys.stdout.write(make_table(json.load(f)))
        return 0
    if args.time_calls:
        os.environ["GPUALLOC_TIME_CALLS"] = "1"  # the children inherit it
    if args.probe_steps < 0:
        ap.error("--probe-steps must be at least 0 (0: every batch tried runs in full)")
    os.environ[PROBE_ENV] = str(args.probe_steps)
    if args.rounds < 0:
        ap.error("--rounds must be at least 0 (0: the calibration alone)")
    shares = [float(s) for s in args.shares.split(",")]
    workloads = args.workloads.split(",")
    for w in workloads:
        if w not in WORKLOADS:
            ap.error("unknown workload %r (known: %s)" % (w, ", ".join(WORKLOADS)))
    allocs = cw._pick(args.allocs, DEFAULT_ALLOCS, DEFAULT_ALLOCS)
    for a in allocs:
        try:
            cw.parse_alloc(a)
        except ValueError as e:
            ap.error(str(e))
    try:
        args.cpus = cw.resolve_cpu_lists(args.cpus, len(allocs), args.side_by_side)
    except ValueError as e:
        ap.error(str(e))
    if any(cw.parse_alloc(a)[0] == "gpualloc" for a in allocs):
        cw.prebuild_bridge(300)
    results = []
    os.makedirs(args.out, exist_ok=True)
    for w in workloads:
        snapshot = None
        if args.snapshot_steps:
            snapshot = (args.snapshot_steps,
                        os.path.join(os.path.abspath(args.out), w + ".snapshot.pickle"))
        cal = run_child(w, "torch", [], args.steps, args.timeout,
                        args.cpus[0] if args.cpus else None, snapshot=snapshot,
                        gpu=0 if args.side_by_side else None)
        cal.update(round=0, calibration=True)
        results.append(cal)
        if cal.get("error") or not cal.get("ok"):
            print("calibration of %s failed: %s" % (w, cal.get("error")), flush=True)
            continue
        budgets = budgets_between(cal["peak_allocated"], cal["peak_reserved"], shares)
        print("%s: allocated %.2f GiB, reserved %.2f GiB at batch %d; budgets %s GiB" % (
            w, cal["peak_allocated"] / GIB, cal["peak_reserved"] / GIB, cal["batch"],
            ", ".join("%.2f" % (b / GIB) for b in budgets)), flush=True)
        for rnd in range(1, args.rounds + 1):
            done = run_round(w, allocs, rnd, budgets, args)
            if args.no_limit_rates:
                batches = no_limit_batches(w, done)
                if batches:
                    done.append(run_child(w, "torch", {"batches": batches}, args.steps,
                                          args.timeout, args.cpus[0] if args.cpus else None,
                                          gpu=0 if args.side_by_side else None))
            for res in done:
                res["round"] = rnd
                results.append(res)
                if res.get("error"):
                    print("FAILED %s %s round %d: %s" % (w, res["alloc"], rnd,
                                                        res["error"][-800:]), flush=True)
            write_outputs(results, args.out)
    sys.stdout.write(make_table(results))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 5 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5]),
              int(sys.argv[6]) if len(sys.argv) > 6 else 0,
              (int(sys.argv[7]), sys.argv[8]) if len(sys.argv) > 8 else None)
    else:
        sys.exit(main())
