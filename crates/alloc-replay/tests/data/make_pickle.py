"""Builds tests/data/synthetic.snapshot.pickle: a small dict shaped like
`torch.cuda.memory._snapshot()` (no torch needed). Run from anywhere:

    python3 make_pickle.py [PROTOCOL [OUTPUT]]     (defaults: 4, synthetic.snapshot.pickle here)

Device 0 trace, in order (streams: 0 = default, 0x7f3a00001000 and 0x55c0ffee0000 are side streams):
  segment_alloc 2 MiB                          -> segment_allocs [2097152]
  alloc A @0x7f3a12000000 size 1024 req 1000   -> Alloc id0 size 1000 stream 0
  alloc B @0x7f3a12000400 size 512 (no req)    -> Alloc id1 size 512  stream 0
  free_requested A                             -> Free id0
  free_completed A                             (right after its request: nothing)
  segment_alloc 20 MiB on side stream 1        -> segment_allocs [.., 20971520]
  alloc C @0x7f3a14000000 size 4096 req 0, side stream 0x7f3a00001000 -> Alloc id2 size 4096 stream 1
  alloc D @0x7f3a12000000 size 2048 req 2000, stream 0x55c0ffee0000 -> Alloc id3 size 2000 stream 2 (address reused)
  free_requested @0x100000 (never allocated)   -> Free id4 stream 0, and Alloc id4 size 256
                                                  placed first (allocated before the trace)
  snapshot, oom (no addr)                      (ignored)
  free_requested C on its stream               -> Free id2 stream 1
  free_completed C                             (right after its request: nothing)
  segment_free 20 MiB                          (ignored)
Device 1 trace: alloc + free_requested of one block.
"""
import os
import pickle
import sys


class OpaqueContext:
    """A class instance: the Rust reader cannot resolve it and must read it as None."""

    def __init__(self, tag):
        self.tag = tag


MIB = 1 << 20
S1 = 0x7F3A00001000
S2 = 0x55C0FFEE0000
FRAMES = [
    {"filename": "train.py", "line": 42, "name": "forward"},
    {"filename": "torch/nn/modules/linear.py", "line": 125, "name": "forward"},
]


def ev(action, addr=None, size=0, stream=0, **extra):
    e = {"action": action, "size": size, "stream": stream, "frames": FRAMES, "time_us": 1_700_000_000_000_000}
    if addr is not None:
        e["addr"] = addr
    e.update(extra)
    return e


dev0 = [
    ev("segment_alloc", 0x7F3A12000000, 2 * MIB),
    ev("alloc", 0x7F3A12000000, 1024, requested_size=1000, compile_context="N/A"),
    ev("alloc", 0x7F3A12000400, 512, user_metadata=OpaqueContext("x")),
    ev("free_requested", 0x7F3A12000000, 1024),
    ev("free_completed", 0x7F3A12000000, 1024),
    ev("segment_alloc", 0x7F3A14000000, 20 * MIB, S1),
    ev("alloc", 0x7F3A14000000, 4096, S1, requested_size=0),
    ev("alloc", 0x7F3A12000000, 2048, S2, requested_size=2000),
    ev("free_requested", 0x100000, 256),
    ev("snapshot", 0, 0),
    {"action": "oom", "size": 1 << 40, "stream": 0, "device_free": 123, "frames": []},
    ev("free_requested", 0x7F3A14000000, 4096, S1),
    ev("free_completed", 0x7F3A14000000, 4096, S1),
    ev("segment_free", 0x7F3A14000000, 20 * MIB, S1),
]
dev1 = [
    ev("alloc", 0x7E0000000000, 64, requested_size=60),
    ev("free_requested", 0x7E0000000000, 64),
]
snapshot = {
    "segments": [
        {
            "device": 0,
            "address": 0x7F3A12000000,
            "total_size": 2 * MIB,
            "allocated_size": 2048 + 512,
            "active_size": 2048 + 512,
            "requested_size": 2000 + 512,
            "stream": 0,
            "segment_type": "small",
            "segment_pool_id": (0, 0),
            "is_expandable": False,
            "frames": FRAMES,
            "blocks": [
                {"address": 0x7F3A12000000, "size": 2048, "requested_size": 2000, "state": "active_allocated", "frames": FRAMES},
                {"address": 0x7F3A12000400, "size": 512, "requested_size": 512, "state": "active_allocated", "frames": []},
            ],
        }
    ],
    "device_traces": [dev0, dev1],
    "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "expandable_segments": False},
}

protocol = int(sys.argv[1]) if len(sys.argv) > 1 else 4
here = os.path.dirname(os.path.abspath(__file__))
out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(here, "synthetic.snapshot.pickle")
data = pickle.dumps(snapshot, protocol=protocol)
with open(out, "wb") as f:
    f.write(data)
