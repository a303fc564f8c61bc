#!/usr/bin/env python3
"""Record allocation traces of real PyTorch workloads, for offline replay.

What it does
------------
For every workload below it starts three fresh processes on the GPU, one per
PyTorch allocator setting:

  native      default caching allocator. This process records the allocator's
              history from the very start (torch.cuda.init() and then
              torch.cuda.memory._record_memory_history(enabled="all",
              context=None) before the first CUDA allocation), runs the
              workload, takes torch.cuda.memory._snapshot() and writes
              device_traces[0] as a gzip'd text trace <name>.trace.gz.
  expandable  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, no recording.
  async       PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync, no recording.

Every process reports torch.cuda.memory_stats() (peak requested / allocated /
reserved bytes, number of cudaMalloc calls, ...) as one JSON line. The same
seed is used in all three, so they run the very same sequence of shapes.

The small_mlp workload additionally dumps the raw snapshot pickle
(torch.cuda.memory._dump_snapshot) for testing a pickle reader: once without
stacks (small_mlp.snapshot.pickle) and once with Python stacks
(small_mlp_stacks.snapshot.pickle).

Trace format (same as /work/shared/traces/README.md, one event a line):

    # workload <name> torch <version> device <gpu name>
    # segment_alloc <bytes> <addr> PyTorch called cudaMalloc here (and got addr)
    # segment_free <bytes>         PyTorch called cudaFree here (empty_cache / OOM retry)
    a <id> <requested_bytes> <stream>
    f <id> <stream>
    c <id>                         the free of <id> completed here, after other
                                   entries (other streams used the block)

The size of an 'alloc' entry in the snapshot trace is the caller's requested
size (orig_size, before rounding); the stream is the raw cudaStream_t, which is
mapped to small integers in order of first use, the default (null) stream
being 0. Frees of addresses that were never allocated while recording are
left out (with recording from process start there are none).

Usage
-----
    python3 scripts/capture/capture_traces.py all OUTDIR [w1,w2,...]   driver
    python3 scripts/capture/capture_traces.py child NAME CONF OUTDIR    one process
    python3 scripts/capture/capture_traces.py list                      workload names

The driver writes OUTDIR/<name>.trace.gz, OUTDIR/*.snapshot.pickle and
OUTDIR/results.json, and prints a summary table. On a GPU machine, with $OUT a
folder to collect the log and the bundle:

    export PYTHONUNBUFFERED=1; python3 scripts/capture/capture_traces.py all /tmp/cap \
        2>&1 | tee $OUT/log.txt; tar -C /tmp/cap -cf $OUT/bundle.tar .

CAPTURE_WITH_ADDRESSES=1 also writes OUTDIR/<name>.addresses.gz: every trace
entry as "<action> <addr> <size> <stream>", to locate where a replay's
placement first differs from PyTorch's.

Environment: CAPTURE_BUDGET_S (default 470) is the driver's wall-clock budget;
a workload is skipped when less than CAPTURE_MIN_LEFT_S (default 75) is left.
"""
import datetime
import gzip
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)

# name -> one-line description (also written into results.json / measured.json)
WORKLOADS = {
    "bert_mlm_varlen_train":
        "BERT-base (BertForMaskedLM, random init), MLM, batch 16, random seq len 64..512 "
        "each step, bf16 autocast, AdamW, 20 steps",
    "unet_diffusion_train":
        "DDPM-style conv UNet (ch 64, mult 1,2,4,4, attention at 32x32 and 16x16, GroupNorm), "
        "noise-prediction loss, batch 32 x 3x128x128, bf16 autocast, AdamW, 10 steps",
    "seq2seq_varlen_train":
        "torch.nn.Transformer encoder-decoder (d 512, 6+6 layers, vocab 32000), batch 32, "
        "random src and tgt len 32..256 each step, bf16 autocast, AdamW, 20 steps",
    "lstm_lm_varlen_train":
        "2-layer cuDNN LSTM language model (emb/hidden 1024, vocab 32000), fp32, batch 32, "
        "random seq len 64..256 each step, AdamW, 15 steps",
    "convnext_varres_infer":
        "torchvision ConvNeXt-Tiny inference (no_grad, bf16 autocast), random batch 1..64 "
        "and random resolution 160..288 each request, 40 requests",
    "vit_varbatch_infer":
        "compare_workloads.py's vit_varbatch_infer: torchvision vit_b_16 inference (no_grad, "
        "bf16 autocast), 40 random batches of 1..96 images at 224x224, run twice",
    "small_mlp":
        "3-layer MLP (512-1024-1024-10), batch 128, Adam, 3 steps (tiny; raw snapshot pickle)",
}
ORDER = ["small_mlp", "bert_mlm_varlen_train", "unet_diffusion_train", "seq2seq_varlen_train",
         "lstm_lm_varlen_train", "convnext_varres_infer", "vit_varbatch_infer"]
CONFS = [("native", None), ("expandable", "expandable_segments:True"),
         ("async", "backend:cudaMallocAsync")]
STAT_KEYS = ["requested_bytes.all.peak", "allocated_bytes.all.peak", "reserved_bytes.all.peak",
             "active_bytes.all.peak", "num_device_alloc", "num_device_free", "num_alloc_retries",
             "num_ooms", "segment.all.peak", "allocation.all.current",
             "inactive_split_bytes.all.peak"]


# ----------------------------------------------------------------------------- workloads

def _bert_mlm_varlen_train(torch, dev):
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig()  # bert-base: 12 layers, hidden 768, vocab 30522, 512 positions
    model = BertForMaskedLM(cfg).to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shapes = []
    for _ in range(20):
        L = random.randint(64, 512)
        shapes.append(L)
        ids = torch.randint(0, cfg.vocab_size, (16, L), device=dev)
        labels = ids.clone()
        labels[torch.rand(16, L, device=dev) > 0.15] = -100
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
    return shapes


def _unet_modules(torch):
    nn = torch.nn
    F = torch.nn.functional

    class Attn(nn.Module):
        def __init__(self, c, heads=4):
            super().__init__()
            self.heads = heads
            self.norm = nn.GroupNorm(32, c)
            self.qkv = nn.Conv2d(c, 3 * c, 1)
            self.proj = nn.Conv2d(c, c, 1)

        def forward(self, x):
            B, C, H, W = x.shape
            qkv = self.qkv(self.norm(x)).reshape(B, 3, self.heads, C // self.heads, H * W)
            q, k, v = (t.transpose(-1, -2) for t in qkv.unbind(1))
            h = F.scaled_dot_product_attention(q, k, v)
            return x + self.proj(h.transpose(-1, -2).reshape(B, C, H, W))

    class Block(nn.Module):
        def __init__(self, cin, cout, tdim, attn):
            super().__init__()
            self.n1 = nn.GroupNorm(32, cin)
            self.c1 = nn.Conv2d(cin, cout, 3, padding=1)
            self.t = nn.Linear(tdim, cout)
            self.n2 = nn.GroupNorm(32, cout)
            self.c2 = nn.Conv2d(cout, cout, 3, padding=1)
            self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()
            self.attn = Attn(cout) if attn else nn.Identity()

        def forward(self, x, temb):
            h = self.c1(F.silu(self.n1(x)))
            h = h + self.t(temb)[:, :, None, None]
            h = self.c2(F.silu(self.n2(h)))
            return self.attn(h + self.skip(x))

    class UNet(nn.Module):
        def __init__(self, ch=64, mult=(1, 2, 4, 4), nres=2, attn_at=(2, 3), tdim=256):
            super().__init__()
            self.ch = ch
            self.temb = nn.Sequential(nn.Linear(ch, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
            self.inp = nn.Conv2d(3, ch, 3, padding=1)
            self.down = nn.ModuleList()
            skips, c = [ch], ch
            for lvl, m in enumerate(mult):
                for _ in range(nres):
                    self.down.append(Block(c, ch * m, tdim, lvl in attn_at))
                    c = ch * m
                    skips.append(c)
                if lvl != len(mult) - 1:
                    self.down.append(nn.Conv2d(c, c, 3, stride=2, padding=1))
                    skips.append(c)
            self.mid = nn.ModuleList([Block(c, c, tdim, True), Block(c, c, tdim, False)])
            self.up = nn.ModuleList()
            for lvl, m in reversed(list(enumerate(mult))):
                for _ in range(nres + 1):
                    self.up.append(Block(c + skips.pop(), ch * m, tdim, lvl in attn_at))
                    c = ch * m
                if lvl != 0:
                    self.up.append(nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"),
                                                 nn.Conv2d(c, c, 3, padding=1)))
            self.out = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))

        def forward(self, x, t):
            half = self.ch // 2
            freqs = torch.exp(-torch.arange(half, device=x.device) * (9.21034 / half))
            a = t.float()[:, None] * freqs[None]
            temb = self.temb(torch.cat([a.sin(), a.cos()], 1))
            h = self.inp(x)
            hs = [h]
            for m in self.down:
                h = m(h, temb) if isinstance(m, Block) else m(h)
                hs.append(h)
            for m in self.mid:
                h = m(h, temb)
            for m in self.up:
                h = m(torch.cat([h, hs.pop()], 1), temb) if isinstance(m, Block) else m(h)
            return self.out(h)

    return UNet


def _unet_diffusion_train(torch, dev):
    UNet = _unet_modules(torch)
    model = UNet().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    steps = torch.arange(1000, device=dev, dtype=torch.float32)
    alpha_bar = torch.cos((steps / 1000 + 0.008) / 1.008 * torch.pi / 2) ** 2
    for _ in range(10):
        x0 = torch.randn(32, 3, 128, 128, device=dev)
        noise = torch.randn_like(x0)
        t = torch.randint(0, 1000, (32,), device=dev)
        ab = alpha_bar[t][:, None, None, None]
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(xt, t)
            loss = torch.nn.functional.mse_loss(pred.float(), noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
    return [[32, 3, 128, 128]] * 10


def _seq2seq_varlen_train(torch, dev):
    nn = torch.nn
    V, D = 32000, 512

    class Seq2Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.pos = nn.Embedding(512, D)
            self.tr = nn.Transformer(d_model=D, nhead=8, num_encoder_layers=6,
                                     num_decoder_layers=6, dim_feedforward=2048,
                                     dropout=0.1, batch_first=True)
            self.head = nn.Linear(D, V)

        def embed(self, ids):
            return self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))[None]

        def forward(self, src, tgt):
            mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
            h = self.tr(self.embed(src), self.embed(tgt), tgt_mask=mask, tgt_is_causal=True)
            return self.head(h)

    model = Seq2Seq().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shapes = []
    for _ in range(20):
        S, T = random.randint(32, 256), random.randint(32, 256)
        shapes.append([S, T])
        src = torch.randint(0, V, (32, S), device=dev)
        tgt = torch.randint(0, V, (32, T + 1), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(src, tgt[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V).float(),
                                                     tgt[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
    return shapes


def _lstm_lm_varlen_train(torch, dev):
    nn = torch.nn
    V, H = 32000, 1024

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, H)
            self.rnn = nn.LSTM(H, H, num_layers=2, batch_first=True, dropout=0.1)
            self.head = nn.Linear(H, V)

        def forward(self, ids):
            return self.head(self.rnn(self.emb(ids))[0])

    model = LM().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shapes = []
    for _ in range(15):
        L = random.randint(64, 256)
        shapes.append(L)
        ids = torch.randint(0, V, (32, L + 1), device=dev)
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
    return shapes


def _convnext_varres_infer(torch, dev):
    import torchvision
    model = torchvision.models.convnext_tiny().to(dev).eval()
    shapes = []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(40):
            b = random.randint(1, 64)
            r = random.choice([160, 192, 224, 256, 288])
            shapes.append([b, r])
            model(torch.randn(b, 3, r, r, device=dev))
            torch.cuda.synchronize()
    return shapes


def _vit_varbatch_infer(torch, dev):
    """compare_workloads.py's own workload (same seeds, same batches), so that replay
    sees the requests whose step time that script measures."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "..", "..", "python", "examples"))
    import compare_workloads as cw

    steps, _ = cw.WORKLOADS["vit_varbatch_infer"]
    extra = {}
    cw.wl_vit_varbatch_infer(torch, cw.Meter(torch), steps, extra)
    return extra.get("batches", [])


def _small_mlp(torch, dev):
    nn = torch.nn
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        x = torch.randn(128, 512, device=dev)
        y = torch.randint(0, 10, (128,), device=dev)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
    return [[128, 512]] * 3


RUNNERS = {
    "bert_mlm_varlen_train": _bert_mlm_varlen_train,
    "unet_diffusion_train": _unet_diffusion_train,
    "seq2seq_varlen_train": _seq2seq_varlen_train,
    "lstm_lm_varlen_train": _lstm_lm_varlen_train,
    "convnext_varres_infer": _convnext_varres_infer,
    "vit_varbatch_infer": _vit_varbatch_infer,
    "small_mlp": _small_mlp,
}


# ----------------------------------------------------------------------------- conversion

def convert_trace(entries, header):
    """Turn snapshot device_traces[0] entries into trace text lines.

    Returns (lines, info). Pure Python, no torch needed (tested offline)."""
    lines = [header]
    live = {}            # addr -> (id, requested_bytes)
    streams = {0: 0}     # raw cudaStream_t -> small id, default stream 0
    counts = {}
    next_id = 0
    unknown_frees = 0
    cur_req = peak_req = 0
    deferred = 0         # free_requested not followed at once by its free_completed
    pending = None       # the address of the free requested by the entry before
    awaiting = {}        # addr -> id of a free requested and not yet completed

    def sid(raw):
        raw = int(raw)
        if raw not in streams:
            streams[raw] = len(streams)
        return streams[raw]

    for e in entries:
        act = e["action"]
        counts[act] = counts.get(act, 0) + 1
        at_once = act == "free_completed" and e.get("addr") == pending
        if pending is not None:
            if not at_once:
                deferred += 1
            pending = None
        if act == "alloc":
            size = int(e["size"])
            live[e["addr"]] = (next_id, size)
            lines.append(f"a {next_id} {size} {sid(e['stream'])}")
            next_id += 1
            cur_req += size
            peak_req = max(peak_req, cur_req)
        elif act == "free_requested":
            pending = e["addr"]
            hit = live.pop(e["addr"], None)
            if hit is None:
                unknown_frees += 1
                continue
            lines.append(f"f {hit[0]} {sid(e['stream'])}")
            awaiting[e["addr"]] = hit[0]
            cur_req -= hit[1]
        elif act == "free_completed":
            # Completed later than requested (other streams used the block):
            # the replay keeps it out of reuse until here.
            freed = awaiting.pop(e["addr"], None)
            if freed is not None and not at_once:
                lines.append(f"c {freed}")
        elif act == "segment_alloc":
            # The device address lets a replay reproduce the driver's address
            # order, which best fit's lowest-address tie-breaks depend on.
            lines.append(f"# {act} {int(e['size'])} {int(e['addr'])}")
        elif act in ("segment_free", "segment_map", "segment_unmap", "oom"):
            lines.append(f"# {act} {int(e['size'])}")
    if pending is not None:
        deferred += 1
    info = {
        "actions": counts,
        "allocs": next_id,
        "unknown_frees_skipped": unknown_frees,
        "never_freed": len(live),
        "deferred_frees": deferred,
        "trace_peak_requested_bytes": peak_req,
        "streams_raw_to_id": {str(k): v for k, v in streams.items()},
    }
    return lines, info


# ----------------------------------------------------------------------------- child

def child(name, conf, outdir):
    import torch
    random.seed(0)
    torch.manual_seed(0)
    dev = "cuda"
    record = conf in ("native", "stacks")
    torch.cuda.init()  # allocator exists now, no memory taken yet
    if record:
        kw = dict(enabled="all", context=None, stacks="python", max_entries=20_000_000)
        if conf == "stacks":
            kw.update(context="all", stacks="python")
        try:
            torch.cuda.memory._record_memory_history(**kw)
        except TypeError:
            kw.pop("max_entries")
            torch.cuda.memory._record_memory_history(**kw)
    t0 = time.time()
    shapes = RUNNERS[name](torch, dev)
    torch.cuda.synchronize()
    wall = time.time() - t0
    st = torch.cuda.memory_stats()
    res = {k: st.get(k) for k in STAT_KEYS}
    res.update(workload=name, conf=conf, wall_s=round(wall, 2), shapes=shapes,
               torch=torch.__version__, cuda=torch.version.cuda,
               device=torch.cuda.get_device_name(0),
               alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    if record:
        snap = torch.cuda.memory._snapshot()
        res["snapshot_keys"] = sorted(snap.keys())
        tr = snap["device_traces"][0]
        res["trace_entry_keys"] = sorted(tr[0].keys()) if tr else []
        res["first_entries"] = [{k: v for k, v in e.items() if k != "frames"} for e in tr[:3]]
        if name == "small_mlp":
            fn = "small_mlp.snapshot.pickle" if conf == "native" else "small_mlp_stacks.snapshot.pickle"
            p = os.path.join(outdir, fn)
            torch.cuda.memory._dump_snapshot(p)
            res["pickle_bytes"] = os.path.getsize(p)
        torch.cuda.memory._record_memory_history(enabled=None)
        if os.environ.get("CAPTURE_WITH_ADDRESSES"):
            # Every entry with its address, to compare a replay's placement
            # decisions with PyTorch's: "<action> <addr> <size> <stream>".
            p = os.path.join(outdir, f"{name}.addresses.gz")
            with gzip.open(p, "wt") as f:
                for e in tr:
                    f.write(f"{e['action']} {e['addr']} {e['size']} {e['stream']}\n")
        if conf == "native":
            header = (f"# workload {name} torch {torch.__version__} "
                      f"device {torch.cuda.get_device_name(0)}")
            lines, info = convert_trace(tr, header)
            p = os.path.join(outdir, f"{name}.trace.gz")
            with gzip.open(p, "wt") as f:
                f.write("\n".join(lines) + "\n")
            info["trace_gz_bytes"] = os.path.getsize(p)
            info["segment_alloc_entries"] = info["actions"].get("segment_alloc", 0)
            res["trace"] = info
    print("RESULT " + json.dumps(res), flush=True)


# ----------------------------------------------------------------------------- driver

def _run_children(name, outdir, confs, timeout):
    procs = []
    for cname, conf in confs:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        p = subprocess.Popen([sys.executable, HERE, "child", name, cname, outdir], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append((cname, p))
    out = []
    for cname, p in procs:
        try:
            o, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            o, _ = p.communicate()
            o = (o or "") + f"\n[killed after {timeout}s]"
        r = None
        for line in (o or "").splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[7:])
        if r is None:
            r = {"workload": name, "conf": cname, "error": (o or "")[-2500:], "rc": p.returncode}
            print(f"--- {name}/{cname} FAILED rc={p.returncode}:\n{(o or '')[-2500:]}", flush=True)
        out.append(r)
    return out


def _fmt(v):
    return str(v) if v is not None else "-"


def driver(outdir, only=None):
    os.makedirs(outdir, exist_ok=True)
    budget = float(os.environ.get("CAPTURE_BUDGET_S", "470"))
    min_left = float(os.environ.get("CAPTURE_MIN_LEFT_S", "75"))
    t_start = time.time()
    names = only or ORDER
    print(f"capture start {datetime.datetime.now(datetime.timezone.utc).isoformat()} "
          f"python {sys.version.split()[0]} workloads {names}", flush=True)
    try:
        print(subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30).stdout.strip(), flush=True)
    except Exception as ex:  # noqa: BLE001
        print("nvidia-smi:", ex)
    results = {"started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "runs": [], "skipped": []}
    for name in names:
        left = budget - (time.time() - t_start)
        if left < min_left:
            print(f"=== skip {name}: only {left:.0f}s of budget left", flush=True)
            results["skipped"].append(name)
            continue
        confs = list(CONFS)
        if name == "small_mlp":
            confs.append(("stacks", None))
        t = time.time()
        print(f"=== {name} ({left:.0f}s left)", flush=True)
        rs = _run_children(name, outdir, confs, timeout=min(180, max(30, left - 10)))
        for r in rs:
            print(f"    {r['conf']:10} req_peak={_fmt(r.get('requested_bytes.all.peak'))} "
                  f"alloc_peak={_fmt(r.get('allocated_bytes.all.peak'))} "
                  f"res_peak={_fmt(r.get('reserved_bytes.all.peak'))} "
                  f"ndev={_fmt(r.get('num_device_alloc'))} retries={_fmt(r.get('num_alloc_retries'))} "
                  f"wall={_fmt(r.get('wall_s'))}" + (" ERROR" if "error" in r else ""), flush=True)
            if "trace" in r:
                tinfo = r["trace"]
                print(f"    trace: {json.dumps(tinfo)}", flush=True)
                print(f"    entry keys: {r.get('trace_entry_keys')} first: {r.get('first_entries')}",
                      flush=True)
                ok_req = tinfo["trace_peak_requested_bytes"] == r.get("requested_bytes.all.peak")
                ok_seg = tinfo["segment_alloc_entries"] == r.get("num_device_alloc")
                print(f"    check trace peak requested == stats: {ok_req}; "
                      f"segment_alloc entries == num_device_alloc: {ok_seg}", flush=True)
            if "pickle_bytes" in r:
                print(f"    pickle bytes: {r['pickle_bytes']}", flush=True)
        print(f"    ({time.time() - t:.1f}s)", flush=True)
        results["runs"].extend(rs)
        with open(os.path.join(outdir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)

    # summary table
    print("\nSUMMARY (bytes)")
    hdr = ["workload", "peak_req", "peak_alloc", "peak_res", "cudaMalloc", "res_expandable",
           "res_async", "trace_gz"]
    print(" | ".join(hdr))
    by = {}
    for r in results["runs"]:
        by.setdefault(r["workload"], {})[r["conf"]] = r
    for name, d in by.items():
        n, e, a = d.get("native", {}), d.get("expandable", {}), d.get("async", {})
        print(" | ".join([name, _fmt(n.get("requested_bytes.all.peak")),
                          _fmt(n.get("allocated_bytes.all.peak")),
                          _fmt(n.get("reserved_bytes.all.peak")), _fmt(n.get("num_device_alloc")),
                          _fmt(e.get("reserved_bytes.all.peak")), _fmt(a.get("reserved_bytes.all.peak")),
                          _fmt(n.get("trace", {}).get("trace_gz_bytes"))]))
    results["total_s"] = round(time.time() - t_start, 1)
    with open(os.path.join(outdir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"total {results['total_s']}s", flush=True)


def main(argv):
    if len(argv) >= 3 and argv[1] == "all":
        driver(argv[2], argv[3].split(",") if len(argv) > 3 else None)
    elif len(argv) == 5 and argv[1] == "child":
        child(argv[2], argv[3], argv[4])
    elif len(argv) == 2 and argv[1] == "list":
        for n in ORDER:
            print(n, "-", WORKLOADS[n])
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
