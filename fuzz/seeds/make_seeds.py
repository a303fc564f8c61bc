"""Writes the seed corpus of the fuzz targets from the bundled traces (run
from anywhere: python3 fuzz/seeds/make_seeds.py). The engine's seeds are
inputs kept from fuzzing runs (`arbitrary` decodes them), not written here.

config/  valid configuration strings, one per file, and a few refused ones
trace/   the small MLP trace cut to 60 lines (text and gzip'd), a hand-written
         trace with segment addresses and two streams, a cut snapshot pickle,
         and runs of MARKs gzip'd (64 KiB in 100 bytes, which inflates within
         the limit, 2 MiB in 2 KB, 16 MiB in 16 KB: inputs that cost the
         most memory per byte, to mutate from)
pickle/  the small MLP snapshots cut to a few events and segments (protocols
         2 and 4, with and without stack frames), the synthetic snapshot of
         crates/alloc-replay/tests/data, and a 16 KiB run of MARKs
"""
import gzip
import os
import pickle
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

CONFIGS = {
    "empty": "",
    "buddy": "policy:buddy",
    "size_class_bounded": "policy:size-class,idle_slab_limit_mb:64",
    "gc_age": "policy:pytorch-bfc+gc-age,garbage_collection_threshold:0.6",
    "expandable": "expandable_segments:True",
    "unmap_pages": "expandable_segments:True,unmap_free_pages:True,unmap_page_mb:8",
    "fsdp": "stream_wait_reuse:true,expandable_segments:true,unmap_free_pages:true",
    "expandable_split": "expandable_segments:True,max_split_size_mb:40",
    "split_gc": "max_split_size_mb:128,garbage_collection_threshold:0.8",
    "divisions": "roundup_power2_divisions:4,max_non_split_rounding_mb:64",
    "divisions_list": "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
    "pytorch_host_keys": "backend:native,release_lock_on_cudamalloc:True,"
    "pinned_use_cuda_host_register:False,pinned_num_register_threads:4,"
    "pinned_use_background_threads:false",
    "bad_value": "max_split_size_mb:lots",
    "bad_syntax": "max_split_size_mb:64 policy:buddy",
}


def cut(snapshot, events, segments, frames):
    """The snapshot with `events` trace entries per device, `segments`
    segments of at most 3 blocks, and stack frames only if `frames`."""
    out = dict(snapshot)
    out["device_traces"] = [
        [{k: v for k, v in e.items() if frames or k != "frames"} for e in t[:events]]
        for t in snapshot["device_traces"]
    ]
    out["segments"] = []
    for seg in snapshot["segments"][:segments]:
        seg = dict(seg, blocks=[dict(b) for b in seg["blocks"][:3]])
        if not frames:
            seg["frames"] = []
            for b in seg["blocks"]:
                b.pop("frames", None)
        out["segments"].append(seg)
    return out


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def main():
    for name, text in CONFIGS.items():
        write(f"{HERE}/config/{name}", text.encode())

    with open(f"{ROOT}/traces/small_mlp.snapshot.pickle", "rb") as f:
        mlp = pickle.load(f)
    with open(f"{ROOT}/traces/small_mlp_stacks.snapshot.pickle", "rb") as f:
        stacks = pickle.load(f)
    cuts = {
        "small_mlp_12_events": (mlp, 12, 1, False, 4),
        "small_mlp_30_events_protocol2": (mlp, 30, 2, False, 2),
        "small_mlp_frames": (mlp, 6, 1, True, 4),
        "small_mlp_stacks_8_events": (stacks, 8, 1, True, 4),
    }
    for name, (snap, events, segments, frames, protocol) in cuts.items():
        data = pickle.dumps(cut(snap, events, segments, frames), protocol=protocol)
        write(f"{HERE}/pickle/{name}.pickle", data)
    shutil.copy(
        f"{ROOT}/crates/alloc-replay/tests/data/synthetic.snapshot.pickle",
        f"{HERE}/pickle/synthetic.pickle",
    )

    with gzip.open(f"{ROOT}/traces/small_mlp.trace.gz", "rt") as f:
        lines = f.read().splitlines()
    text = ("\n".join(lines[:60]) + "\n").encode()
    write(f"{HERE}/trace/small_mlp_60_lines.trace", text)
    write(f"{HERE}/trace/small_mlp_60_lines.trace.gz", gzip.compress(text, mtime=0))
    write(
        f"{HERE}/trace/two_streams_with_addresses.trace",
        b"# two streams, recorded segment addresses\n"
        b"# segment_alloc 2097152 139921889165312\n"
        b"a 0 512 0\na 1 1048577 7\n"
        b"# segment_alloc 20971520 139921891262464\n"
        b"f 0 0\nf 9 7\na 0 3000000 7\nf 1 7\nf 0 7\n",
    )
    shutil.copy(f"{HERE}/pickle/small_mlp_12_events.pickle", f"{HERE}/trace/")

    # Runs of MARK, each of which cost the decoder 4 KiB before they were
    # counted: the shapes that cost the most memory per input byte.
    write(f"{HERE}/pickle/marks_16_kib.pickle", marks(16 << 10))
    for name, n in (("64_kib", 64 << 10), ("2_mib", 2 << 20), ("16_mib", 16 << 20)):
        data = gzip.compress(marks(n), 9, mtime=0)
        write(f"{HERE}/trace/marks_{name}.pickle.gz", data)


def marks(n):
    """A protocol 4 pickle of `n` MARK opcodes."""
    return b"\x80\x04" + b"(" * n + b"."


if __name__ == "__main__":
    main()
